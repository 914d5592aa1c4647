"""``Coordinate``: an immutable integer vector in voxels, axis order (z, y, x).

Arithmetic is element-wise; comparison operators are the *tuple* ones, so use
:meth:`Coordinate.all_le` and friends for element-wise tests.

>>> a = Coordinate(4, 8, 8)
>>> a + 1, a * (1, 2, 2), a // 4
(Coordinate(5, 9, 9), Coordinate(4, 16, 16), Coordinate(1, 2, 2))
"""

from __future__ import annotations

import numbers
import operator


class Coordinate(tuple):
    """An n-d integer vector (n = 3 for volumes: z, y, x).

    Accepts ``Coordinate(1, 2, 3)``, ``Coordinate((1, 2, 3))`` or any iterable of
    integral values; floats that are not whole numbers are refused.
    """

    __slots__ = ()

    def __new__(cls, *args):
        """Build from integers or one iterable of them.

        Raises ``TypeError`` for a value that is not a real number (or is a bool) and ``ValueError`` for
        a float that is not a whole number.
        """
        if len(args) == 1:
            a = args[0]
            if type(a) is tuple or type(a) is cls:
                args = a
            elif type(a) is not int and not isinstance(a, numbers.Number):
                args = tuple(a)
        if all(type(v) is int for v in args):  # the common case, checked fast (10^6 tasks name 10^7 chunks)
            return super().__new__(cls, args)
        vals = []
        for v in args:
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"Coordinate values must be integers, got {v!r} in {args!r}")
            iv = int(v)
            if iv != v:
                raise ValueError(f"Coordinate values must be whole numbers, got {v!r} in {args!r}")
            vals.append(iv)
        return super().__new__(cls, vals)

    @property
    def dims(self) -> int:
        """The number of entries (3 for volumes)."""
        return len(self)

    def _other(self, other) -> tuple:
        if type(other) is int or isinstance(other, numbers.Number):
            return (other,) * len(self)
        other = tuple(other)
        if len(other) != len(self):
            raise ValueError(f"dimension mismatch: {self!r} ({len(self)}-d) and {other!r} ({len(other)}-d)")
        return other

    def _op(self, other, op):
        return Coordinate(tuple(op(a, b) for a, b in zip(self, self._other(other))))

    def __add__(self, other):
        return self._op(other, operator.add)

    __radd__ = __add__

    def __sub__(self, other):
        return self._op(other, operator.sub)

    def __rsub__(self, other):
        return Coordinate(self._other(other)) - self

    def __mul__(self, other):
        return self._op(other, operator.mul)

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return self._op(other, operator.floordiv)

    def __mod__(self, other):
        return self._op(other, operator.mod)

    def __neg__(self):
        return Coordinate(-a for a in self)

    def ceil_div(self, other) -> "Coordinate":
        """Element-wise ``ceil(self / other)`` for integers."""
        return Coordinate(-(-a // b) for a, b in zip(self, self._other(other)))

    def max(self, other) -> "Coordinate":
        """Element-wise maximum with a number or a vector of the same length."""
        return self._op(other, max)

    def min(self, other) -> "Coordinate":
        """Element-wise minimum with a number or a vector of the same length."""
        return self._op(other, min)

    def all_le(self, other) -> bool:
        """Whether every entry is ``<=`` the matching entry of ``other`` (a number or a vector)."""
        return all(a <= b for a, b in zip(self, self._other(other)))

    def all_lt(self, other) -> bool:
        """Whether every entry is ``<`` the matching entry of ``other`` (a number or a vector)."""
        return all(a < b for a, b in zip(self, self._other(other)))

    def all_ge(self, other) -> bool:
        """Whether every entry is ``>=`` the matching entry of ``other`` (a number or a vector)."""
        return all(a >= b for a, b in zip(self, self._other(other)))

    def prod(self) -> int:
        """The product of the entries (a shape's voxel count; 1 for a 0-d coordinate)."""
        p = 1
        for a in self:
            p *= a
        return p

    def xyz(self) -> tuple:
        """The same vector in cloud-volume's (x, y, z) order (3-d only)."""
        if len(self) != 3:
            raise ValueError(f"xyz() needs a 3-d coordinate, got {self!r}")
        return (self[2], self[1], self[0])

    @classmethod
    def from_xyz(cls, xyz) -> "Coordinate":
        """The coordinate (z, y, x) of a vector given in cloud-volume's (x, y, z) order; values
        are checked as :class:`Coordinate` checks them (a fraction is refused, never truncated).

        >>> Coordinate.from_xyz([64, 32, 16.0])
        Coordinate(16, 32, 64)
        >>> Coordinate.from_xyz([0.5, 0, 0])
        Traceback (most recent call last):
        ...
        ValueError: Coordinate values must be whole numbers, got 0.5 in (0, 0, 0.5)
        """
        x, y, z = xyz
        return cls(z, y, x)

    def __repr__(self):
        return f"Coordinate({', '.join(str(a) for a in self)})"

    def __str__(self):
        return "(" + ", ".join(str(a) for a in self) + ")"


def as_coordinate(value, dims: int = 3, what: str = "value") -> Coordinate:
    """Normalise an int or a sequence to a :class:`Coordinate` of ``dims`` entries."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return Coordinate((value,) * dims)
    try:
        c = Coordinate(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be {dims} integers (z, y, x), got {value!r}: {exc}") from None
    if len(c) != dims:
        raise ValueError(f"{what} must have {dims} entries (z, y, x), got {value!r}")
    return c
