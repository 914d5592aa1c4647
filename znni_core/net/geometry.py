"""What a network takes and gives: admissible input lengths, context, halo, translation grid.

Chain and graph networks share this one description (:class:`NetGeometry`), so the tiler,
the task layout and the CLI read every network the same way::

    input length n admissible  <=>  n = n_min + k * grid  (k >= 0), per axis (z, y, x)
    output length              =   n - context
    output voxel i sits over input voxel i + low;   halo = (low, context - low)

A chain runs dense through max-pooling fragments, so any input of at least its field of
view is admissible (``n_min = F``, ``grid = 1``); a graph's lengths come from its pooling
and skip connections (``net/graph.py``).
"""

from __future__ import annotations

from typing import NamedTuple

Shape3 = tuple[int, int, int]


class NetGeometry(NamedTuple):
    """Per axis (z, y, x): the smallest admissible input length, the admissible step, the voxels
    the output loses and the part of them below the output.

    >>> g = NetGeometry(n_min=(5, 5, 5), grid=(2, 2, 2), context=(4, 4, 4), low=(2, 2, 2))
    >>> g.is_admissible((7, 9, 5)), g.is_admissible((6, 9, 5))
    (True, False)
    >>> g.floor((8, 4, 20)), g.ceil((8, 4, 20))
    ((7, 0, 19), (9, 5, 21))
    >>> g.field_of_view, g.halo, g.output_shape((9, 9, 9))
    ((5, 5, 5), ((2, 2, 2), (2, 2, 2)), (5, 5, 5))
    """

    n_min: Shape3
    grid: Shape3
    context: Shape3
    low: Shape3

    @classmethod
    def dense(cls, field_of_view) -> NetGeometry:
        """A network that takes any input of at least its field of view ``F``, its output centred
        (``low = (F - 1) // 2``): a chain through max-pooling fragments."""
        f = tuple(int(v) for v in field_of_view)
        return cls(f, (1, 1, 1), tuple(v - 1 for v in f), tuple((v - 1) // 2 for v in f))  # type: ignore[arg-type]

    @property
    def field_of_view(self) -> Shape3:
        """``context + 1``: an admissible input ``n`` gives ``n - F + 1`` output voxels."""
        return tuple(c + 1 for c in self.context)  # type: ignore[return-value]

    @property
    def halo(self) -> tuple[Shape3, Shape3]:
        """(low, high) input context around the output; ``low + high = context``."""
        return self.low, tuple(c - lo for c, lo in zip(self.context, self.low))  # type: ignore[return-value]

    def output_shape(self, in_shape) -> Shape3:
        """Output shape ``in_shape - context``; ``in_shape`` is not checked for admissibility."""
        return tuple(int(n) - c for n, c in zip(in_shape, self.context))  # type: ignore[return-value]

    def is_admissible(self, in_shape) -> bool:
        """True if every axis of ``in_shape`` is ``n_min + k * grid`` with k >= 0."""
        return all(n >= m and (n - m) % g == 0 for n, m, g in zip(in_shape, self.n_min, self.grid))

    def around(self, axis: int, n: int) -> tuple[int, int]:
        """(largest admissible length <= n, or 0 where there is none; smallest admissible >= n) on ``axis``."""
        m, g = self.n_min[axis], self.grid[axis]
        if n <= m:
            return (m if n == m else 0), m
        k = (n - m) // g
        return m + k * g, m + k * g + (0 if (n - m) % g == 0 else g)

    def floor(self, in_shape) -> Shape3:
        """Per axis the largest admissible length <= ``in_shape``, 0 where there is none."""
        return tuple(self.around(a, int(n))[0] for a, n in enumerate(in_shape))  # type: ignore[return-value]

    def ceil(self, in_shape) -> Shape3:
        """Per axis the smallest admissible length >= ``in_shape``."""
        return tuple(self.around(a, int(n))[1] for a, n in enumerate(in_shape))  # type: ignore[return-value]


class Geometric:
    """The geometry properties every network exposes, read from its :attr:`geometry`
    (a :class:`NetGeometry`); mixed into the chain and graph network classes."""

    geometry: NetGeometry

    @property
    def grid(self) -> Shape3:
        """Translation grid: patches starting on multiples of it see the whole volume's pooling phases."""
        return self.geometry.grid

    @property
    def context(self) -> Shape3:
        """Voxels lost per axis (z, y, x): an admissible input ``n`` gives ``n - context`` output voxels."""
        return self.geometry.context

    @property
    def field_of_view(self) -> Shape3:
        """``context + 1``: the output of an admissible input ``n`` has ``n - F + 1`` voxels."""
        return self.geometry.field_of_view

    @property
    def halo(self) -> tuple[Shape3, Shape3]:
        """(low, high) input context around the output per axis (z, y, x); ``low + high = context``."""
        return self.geometry.halo

    def output_shape(self, in_shape) -> Shape3:
        """Output shape ``in_shape - context`` (z, y, x); ``in_shape`` is not checked for admissibility."""
        return self.geometry.output_shape(in_shape)

    def is_admissible(self, in_shape) -> bool:
        """True if every axis of ``in_shape`` (z, y, x) is ``n_min + k * grid`` with k >= 0."""
        return self.geometry.is_admissible(in_shape)

    def admissible_around(self, axis: int, n: int) -> tuple[int, int]:
        """(largest admissible <= n or 0, smallest admissible >= n) on ``axis``."""
        return self.geometry.around(axis, n)

    def floor_admissible(self, in_shape) -> Shape3:
        """Per axis the largest admissible length <= ``in_shape`` (z, y, x), 0 where there is none."""
        return self.geometry.floor(in_shape)

    def ceil_admissible(self, in_shape) -> Shape3:
        """Per axis the smallest admissible length >= ``in_shape`` (z, y, x)."""
        return self.geometry.ceil(in_shape)
