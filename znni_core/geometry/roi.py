"""``Roi``: an immutable axis-aligned box ``[offset, offset + shape)`` in voxels (z, y, x).

::

    offset                      end = offset + shape
      |<--------- shape --------->|
      [###########################)          half-open on every axis

    grow(low, high):  |<-low->[###########)<-high->|

>>> r = Roi((0, 0, 0), (10, 20, 20))
>>> r.grow((1, 2, 2), (2, 3, 3))
Roi(offset=(-1, -2, -2), shape=(13, 25, 25))
>>> r.intersect(Roi((5, 5, 5), (10, 10, 10)))
Roi(offset=(5, 5, 5), shape=(5, 10, 10))
"""

from __future__ import annotations

from dataclasses import dataclass

from .coordinate import Coordinate, as_coordinate


@dataclass(frozen=True)
class Roi:
    """Half-open box; ``shape`` entries are >= 0 (an empty Roi has some 0 entry)."""

    offset: Coordinate
    shape: Coordinate

    def __init__(self, offset, shape):
        off = as_coordinate(offset, len(tuple(offset)) if not isinstance(offset, int) else 3, "Roi offset")
        shp = as_coordinate(shape, len(off), "Roi shape")
        if any(s < 0 for s in shp):
            raise ValueError(f"Roi shape must be >= 0 on every axis, got {tuple(shp)} (offset {tuple(off)})")
        object.__setattr__(self, "offset", off)
        object.__setattr__(self, "shape", shp)

    @classmethod
    def trusted(cls, offset: tuple, shape: tuple) -> "Roi":
        """The Roi of int tuples already known valid (shape >= 0), built without the checks (the
        task grid makes two per task, 10^6 tasks at a finalize)."""
        r = object.__new__(cls)
        object.__setattr__(r, "offset", Coordinate(offset))
        object.__setattr__(r, "shape", Coordinate(shape))
        return r

    @classmethod
    def from_bounds(cls, begin, end) -> "Roi":
        """The Roi ``[begin, end)``; ValueError if ``end`` is below ``begin`` on some axis."""
        begin, end = Coordinate(begin), Coordinate(end)
        if not begin.all_le(end):
            raise ValueError(f"Roi end {tuple(end)} is below its begin {tuple(begin)} on some axis")
        return cls(begin, end - begin)

    # ---- derived -----------------------------------------------------------------
    @property
    def begin(self) -> Coordinate:
        """The first voxel (z, y, x), the same as ``offset``."""
        return self.offset

    @property
    def end(self) -> Coordinate:
        """One past the last voxel, ``offset + shape`` (z, y, x)."""
        return self.offset + self.shape

    @property
    def dims(self) -> int:
        """The number of axes (3 for volumes)."""
        return len(self.offset)

    @property
    def size(self) -> int:
        """The number of voxels."""
        return self.shape.prod()

    @property
    def empty(self) -> bool:
        """True if some ``shape`` entry is 0."""
        return any(s == 0 for s in self.shape)

    # ---- relations ---------------------------------------------------------------
    def contains(self, other) -> bool:
        """True if ``other`` (a Roi or a Coordinate) lies inside; an empty Roi is inside everything."""
        if isinstance(other, Roi):
            if other.empty:
                return True
            return self.begin.all_le(other.begin) and other.end.all_le(self.end)
        c = Coordinate(other)
        return self.begin.all_le(c) and c.all_lt(self.end)

    def intersects(self, other: "Roi") -> bool:
        """True if the two boxes share at least one voxel."""
        return not self.intersect(other).empty

    def intersect(self, other: "Roi") -> "Roi":
        """The overlap of the two boxes; empty (some shape entry 0) if they are disjoint."""
        b = self.begin.max(other.begin)
        e = self.end.min(other.end).max(b)
        return Roi(b, e - b)

    def union(self, other: "Roi") -> "Roi":
        """The bounding box of both (not a set union)."""
        if self.empty:
            return other
        if other.empty:
            return self
        return Roi.from_bounds(self.begin.min(other.begin), self.end.max(other.end))

    # ---- new Rois ----------------------------------------------------------------
    def shift(self, by) -> "Roi":
        """The same shape moved by ``by`` voxels (a number or a vector)."""
        return Roi(self.offset + by, self.shape)

    def grow(self, low, high=None) -> "Roi":
        """Extend by ``low`` below and ``high`` above (default: ``high = low``); negatives shrink."""
        high = low if high is None else high
        low, high = as_coordinate(low, self.dims, "grow low"), as_coordinate(high, self.dims, "grow high")
        b = self.begin - low
        e = self.end + high
        if not b.all_le(e):
            raise ValueError(f"shrinking {self} by {tuple(-low)}/{tuple(-high)} leaves nothing")
        return Roi(b, e - b)

    def snap_to_grid(self, grid, offset=0, mode: str = "grow") -> "Roi":
        """Align begin and end to multiples of ``grid`` (relative to ``offset``).

        ``mode``: ``grow`` (outwards), ``shrink`` (inwards) or ``closest``.
        """
        grid = as_coordinate(grid, self.dims, "grid")
        origin = as_coordinate(offset, self.dims, "grid offset")
        if any(g <= 0 for g in grid):
            raise ValueError(f"grid must be positive on every axis, got {tuple(grid)}")
        b, e = self.begin - origin, self.end - origin
        if mode == "grow":
            nb, ne = (b // grid) * grid, e.ceil_div(grid) * grid
        elif mode == "shrink":
            nb, ne = b.ceil_div(grid) * grid, (e // grid) * grid
            ne = ne.max(nb)
        elif mode == "closest":
            nb = Coordinate((v + g // 2) // g * g for v, g in zip(b, grid))
            ne = Coordinate((v + g // 2) // g * g for v, g in zip(e, grid)).max(nb)
        else:
            raise ValueError(f"snap mode must be grow, shrink or closest, got {mode!r}")
        return Roi(nb + origin, ne - nb)

    def is_aligned(self, grid, offset=0) -> bool:
        """True if begin and end lie on multiples of ``grid`` (relative to ``offset``)."""
        return self.snap_to_grid(grid, offset, "grow") == self

    def to_slices(self, relative_to=None) -> tuple:
        """numpy slices of this Roi inside an array whose origin sits at ``relative_to`` (default 0)."""
        origin = (
            Coordinate((0,) * self.dims)
            if relative_to is None
            else Coordinate(relative_to.begin if isinstance(relative_to, Roi) else relative_to)
        )
        b = self.begin - origin
        if any(v < 0 for v in b):
            raise ValueError(f"{self} starts before the array origin {tuple(origin)}")
        return tuple(slice(v, v + s) for v, s in zip(b, self.shape))

    # ---- display / serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"offset": [...], "shape": [...]}`` as plain lists (see :meth:`from_dict`)."""
        return {"offset": list(self.offset), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "Roi":
        """The Roi that :meth:`to_dict` wrote."""
        return cls(d["offset"], d["shape"])

    def __repr__(self):
        return f"Roi(offset={tuple(self.offset)}, shape={tuple(self.shape)})"

    def __str__(self):
        return f"[{tuple(self.begin)}:{tuple(self.end)}] (z, y, x)"
