"""Halo, chunk grids, blocks and task creation.

The halo is *derived* from the network's field of view ``F``, never typed in::

    output voxel i sits over input voxel i + low,   low = (F - 1) // 2,  high = F - 1 - low

    input    |<-low->|<------- write_roi ------->|<-high->|
             [=======|###########################|========)
             |<------------------ read_roi --------------->|

Edge policies at the border of the input volume (daisy's ``fit`` documents the same idea)::

    valid   output bounds = input bounds shrunk by the halo; every read lies inside the input
              input   [...............................................]
              output         [.................................]
    mirror  output bounds = input bounds; reads beyond the border are reflected
    zero      input   [...............................................]
              output  [...............................................]
            (mirror: numpy ``reflect``, the border voxel is not repeated;
             zero: the missing context is 0.0 after normalisation)

Tasks are boxes of ``task_chunks`` whole output chunks, so every output chunk has exactly
one writer; only chunks at the high end of the output bounds are partial.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .coordinate import Coordinate, as_coordinate
from .roi import Roi

EDGE_POLICIES = ("valid", "mirror", "zero")


@dataclass(frozen=True)
class Halo:
    """Context around the write ROI that a network needs: ``low`` below, ``high`` above."""

    low: Coordinate
    high: Coordinate

    def __init__(self, low, high):
        low, high = as_coordinate(low, 3, "halo low"), as_coordinate(high, 3, "halo high")
        if any(v < 0 for v in tuple(low) + tuple(high)):
            raise ValueError(f"halo must be >= 0, got low {tuple(low)} high {tuple(high)}")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    @classmethod
    def from_field_of_view(cls, fov) -> "Halo":
        """The halo of a field of view ``F`` (z, y, x): ``low = (F - 1) // 2``, ``high = F - 1 - low``.

        Raises ``ValueError`` if ``F`` is below 1 on an axis.
        """
        f = as_coordinate(fov, 3, "field of view")
        if any(v < 1 for v in f):
            raise ValueError(f"field of view must be >= 1 on every axis, got {tuple(f)}")
        low = Coordinate((v - 1) // 2 for v in f)
        return cls(low, f - 1 - low)

    @property
    def field_of_view(self) -> Coordinate:
        """The field of view ``low + high + 1`` in voxels (z, y, x)."""
        return self.low + self.high + 1

    def read_roi(self, write_roi: Roi) -> Roi:
        """The input ``write_roi`` needs: grown by ``low`` below and ``high`` above."""
        return write_roi.grow(self.low, self.high)


def output_bounds(input_bounds: Roi, halo: Halo, edge: str) -> Roi:
    """Everything an input layer can produce under the edge policy."""
    if edge not in EDGE_POLICIES:
        raise ValueError(f"edge policy {edge!r} is not one of {EDGE_POLICIES}")
    if edge == "valid":
        if not (input_bounds.shape - halo.field_of_view).all_ge(0):
            raise ValueError(
                f"input bounds {input_bounds} are smaller than the field of view "
                f"{tuple(halo.field_of_view)}: no valid output exists; use edge: mirror or zero"
            )
        return input_bounds.grow(-halo.low, -halo.high)
    return input_bounds


@dataclass(frozen=True)
class ChunkGrid:
    """The storage grid of a layer: chunks of ``chunk_shape`` starting at ``bounds.offset``.

    >>> g = ChunkGrid(Roi((0, 0, 0), (10, 64, 64)), (4, 32, 32))
    >>> g.grid_shape
    Coordinate(3, 2, 2)
    >>> g.chunk_roi((2, 1, 1))
    Roi(offset=(8, 32, 32), shape=(2, 32, 32))
    """

    bounds: Roi
    chunk_shape: Coordinate

    def __init__(self, bounds: Roi, chunk_shape):
        cs = as_coordinate(chunk_shape, bounds.dims, "chunk shape")
        if any(v < 1 for v in cs):
            raise ValueError(f"chunk shape must be >= 1 on every axis, got {tuple(cs)}")
        object.__setattr__(self, "bounds", bounds)
        object.__setattr__(self, "chunk_shape", cs)
        # plain ints for chunk_box (a finalize names 10^4-10^6 chunks)
        object.__setattr__(self, "_ints", (tuple(bounds.offset), tuple(cs), tuple(bounds.end), tuple(self.grid_shape)))

    @property
    def grid_shape(self) -> Coordinate:
        """Chunks per axis (z, y, x), counting partial chunks at the high end."""
        return self.bounds.shape.ceil_div(self.chunk_shape)

    @property
    def num_chunks(self) -> int:
        """The number of chunks in the grid."""
        return self.grid_shape.prod()

    def chunk_box(self, index) -> tuple[tuple, tuple]:
        """``(begin, end)`` of chunk ``index`` as int tuples, clipped to the bounds: what
        :meth:`chunk_roi` says, without building geometry objects (10x faster)."""
        off, cs, end, gs = self._ints
        idx = tuple(int(i) for i in index)
        if len(idx) != len(gs) or any(i < 0 or i >= n for i, n in zip(idx, gs)):
            raise IndexError(f"chunk index {idx} outside the grid {gs}")
        b = tuple(o + i * c for o, i, c in zip(off, idx, cs))
        return b, tuple(min(v + c, e) for v, c, e in zip(b, cs, end))

    def chunk_roi(self, index) -> Roi:
        """The Roi of chunk ``index`` (z, y, x), clipped to the bounds; IndexError outside the grid."""
        b, e = self.chunk_box(index)
        return Roi(b, tuple(v - u for u, v in zip(b, e)))

    def chunk_index(self, roi: Roi) -> Coordinate:
        """Index of the chunk whose (clipped) Roi is exactly ``roi``; ValueError otherwise."""
        rel = roi.offset - self.bounds.offset
        idx = rel // self.chunk_shape
        if (
            rel % self.chunk_shape != Coordinate((0,) * roi.dims)
            or not (idx.all_ge(0) and idx.all_lt(self.grid_shape))
            or self.chunk_roi(idx) != roi
        ):
            raise ValueError(
                f"{roi!r} is not a chunk of the grid (chunks {tuple(self.chunk_shape)} "
                f"from {tuple(self.bounds.offset)}, bounds {self.bounds})"
            )
        return idx

    def chunks_in(self, roi: Roi):
        """Indices (C order) of every chunk intersecting ``roi``."""
        roi = roi.intersect(self.bounds)
        if roi.empty:
            return []
        lo = (roi.begin - self.bounds.offset) // self.chunk_shape
        hi = (roi.end - self.bounds.offset).ceil_div(self.chunk_shape)
        return [Coordinate(i) for i in itertools.product(*(range(a, b) for a, b in zip(lo, hi)))]

    def is_aligned(self, roi: Roi) -> bool:
        """True if ``roi`` is a union of whole chunks (chunks at the bounds' end may be partial)."""
        snapped = roi.snap_to_grid(self.chunk_shape, self.bounds.offset, "grow").intersect(self.bounds)
        return snapped == roi


@dataclass(frozen=True)
class Block:
    """One task: ``write_roi`` (whole output chunks) and ``read_roi = write_roi`` grown by the halo."""

    id: int
    write_roi: Roi
    read_roi: Roi
    chunks: tuple  # chunk indices (Coordinate) of the output grid, C order

    def to_dict(self) -> dict:
        """The block as JSON-able plain data (see :meth:`from_dict`)."""
        return {
            "id": self.id,
            "write_roi": self.write_roi.to_dict(),
            "read_roi": self.read_roi.to_dict(),
            "chunks": [list(c) for c in self.chunks],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Block":
        """The block that :meth:`to_dict` wrote."""
        return cls(
            int(d["id"]),
            Roi.from_dict(d["write_roi"]),
            Roi.from_dict(d["read_roi"]),
            tuple(Coordinate(c) for c in d["chunks"]),
        )


class TaskGrid:
    """The tasks of a run: boxes of ``task_chunks`` chunks (z, y, x) covering ``region`` (default:
    the whole grid), made on demand so that a run of 10^7 tasks is never listed.

    ``region`` is grown outwards to whole chunks (and clipped to the grid bounds): every output chunk
    touched by the region is written by exactly one task. Task ids are C-order indices in the
    global task grid, so they do not depend on the region; ``self[k]`` is the k-th task of the
    region in id order (a job of a workflow runs a contiguous range of k).

    >>> g = ChunkGrid(Roi((0, 0, 0), (8, 10, 10)), (4, 4, 4))
    >>> t = TaskGrid(g, (2, 2, 2), Halo((1, 1, 1), (1, 1, 1)))
    >>> len(t), [b.write_roi.shape for b in t]
    (4, [Coordinate(8, 8, 8), Coordinate(8, 8, 2), Coordinate(8, 2, 8), Coordinate(8, 2, 2)])
    >>> t.owner(Coordinate(1, 2, 1)).id, t.by_id(3).id, t.index(3)
    (2, 3, 3)
    """

    def __init__(self, grid: ChunkGrid, task_chunks, halo: Halo, region: Roi | None = None):
        tc = as_coordinate(task_chunks, grid.bounds.dims, "task size in chunks")
        if any(v < 1 for v in tc):
            raise ValueError(f"task size must be >= 1 chunk on every axis, got {tuple(tc)}")
        region = grid.bounds if region is None else region
        if not grid.bounds.contains(region):
            raise ValueError(f"region {region} is not inside the output bounds {grid.bounds}")
        self.grid, self.task_chunks, self.halo, self.region = grid, tc, halo, region
        if region.empty:
            self.lo = self.hi = self.tlo = self.thi = Coordinate((0,) * grid.bounds.dims)
        else:
            self.lo = (region.begin - grid.bounds.offset) // grid.chunk_shape
            self.hi = (region.end - grid.bounds.offset).ceil_div(grid.chunk_shape)
            # tasks are laid on the global chunk grid (multiples of task_chunks), so a sub-region run
            # and a whole-volume run give the same task for a chunk
            self.tlo, self.thi = self.lo // tc, self.hi.ceil_div(tc)
        self.shape = self.thi - self.tlo  # tasks per axis in the region
        self.global_shape = grid.grid_shape.ceil_div(tc)

    def __len__(self) -> int:
        return int(self.shape.prod()) if not self.region.empty else 0

    def __iter__(self):
        return (self[k] for k in range(len(self)))

    def __getitem__(self, k: int) -> Block:
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"task index {k} out of range ({n} tasks)")
        k %= n
        t = []
        for s in reversed(tuple(self.shape)):
            t.append(k % s)
            k //= s
        return self._block(Coordinate(reversed(t)) + self.tlo)

    def _block(self, t: Coordinate) -> Block:
        """Task ``t`` (task grid position) in plain int arithmetic: a finalize or a status walks
        10^6 tasks (building them through Coordinate operators took 0.1-0.4 ms a task)."""
        tc, lo, hi = tuple(self.task_chunks), tuple(self.lo), tuple(self.hi)
        off, cs, bend, _ = self.grid._ints
        t = tuple(t)
        c0 = tuple(max(a * b, c) for a, b, c in zip(t, tc, lo))
        c1 = tuple(min((a + 1) * b, c) for a, b, c in zip(t, tc, hi))
        chunks = tuple(map(Coordinate, itertools.product(*(range(a, b) for a, b in zip(c0, c1)))))
        begin = tuple(o + a * c for o, a, c in zip(off, c0, cs))
        end = tuple(min(o + a * c, e) for o, a, c, e in zip(off, c1, cs, bend))
        low, high = tuple(self.halo.low), tuple(self.halo.high)
        write = Roi.trusted(begin, tuple(e - b for b, e in zip(begin, end)))
        read = Roi.trusted(
            tuple(b - h for b, h in zip(begin, low)), tuple(e - b + h + g for b, e, h, g in zip(begin, end, low, high))
        )
        gs = self.global_shape
        tid = (t[0] * gs[1] + t[1]) * gs[2] + t[2]  # stable: the same chunk, the same task id
        return Block(tid, write, read, chunks)

    def _task_of_id(self, task_id: int) -> Coordinate | None:
        gs = self.global_shape
        if not 0 <= task_id < gs.prod():
            return None
        t = Coordinate(task_id // (gs[1] * gs[2]), task_id // gs[2] % gs[1], task_id % gs[2])
        return t if t.all_ge(self.tlo) and (self.thi - 1).all_ge(t) and len(self) else None

    def index(self, task_id: int) -> int:
        """Position k of a task id in this region (ValueError if the region has no such task)."""
        t = self._task_of_id(task_id)
        if t is None:
            raise ValueError(f"task {task_id} is not a task of this run ({len(self)} tasks)")
        r = t - self.tlo
        return int((r[0] * self.shape[1] + r[1]) * self.shape[2] + r[2])

    def by_id(self, task_id: int) -> Block:
        """The task with id ``task_id`` (ValueError if it is not a task of this region)."""
        return self[self.index(task_id)]

    def owner(self, chunk_index) -> Block:
        """The task that writes output chunk ``chunk_index`` (z, y, x)."""
        c = Coordinate(chunk_index)
        if not (c.all_ge(self.lo) and (self.hi - 1).all_ge(c)):
            raise ValueError(f"chunk {tuple(c)} is not written by this run")
        return self._block(c // self.task_chunks)


def _axis_pieces(lo: int, hi: int, t: int, origin: int, chunk: int, r0: int, r1: int) -> list[int]:
    """Voxels of ``[r0, r1)`` each task of ``t`` chunks writes along one axis (tasks start at
    multiples of ``t`` on the global chunk grid, as in :class:`TaskGrid`)."""
    out = []
    for k in range(lo // t, -(-hi // t)):
        b = max(r0, origin + max(lo, k * t) * chunk)
        e = min(r1, origin + min(hi, (k + 1) * t) * chunk)
        out.append(max(0, e - b))
    return out


def choose_task_chunks(
    grid: ChunkGrid,
    region: Roi,
    halo: Halo,
    slots: int,
    *,
    max_voxels: int,
    fits=None,
    task_overhead: int = 1 << 15,
    per_axis: int = 40,
) -> Coordinate:
    """The task size (chunks per axis) that finishes ``region`` soonest on ``slots`` jobs at once.

    A task computes its write box plus the halo, so small tasks repeat context (a 2D-kernel net
    with a 47-voxel halo on 256^2 tasks computes 1.9x the output) and big ones leave slots idle.
    The cost is the makespan in input voxels, ``ceil(tasks / slots) x (largest task's read box +
    task_overhead)``; axes without context (z of a 2D net) are split first because splitting
    them costs nothing.  Candidates per axis: every size that changes the task count, thinned to
    about ``per_axis``; ``max_voxels`` caps a task's write box (retry granularity) and
    ``fits(write_shape)`` its memory.  (1, 1, 1) when nothing larger qualifies.

    >>> g = ChunkGrid(Roi((0, 0, 0), (15, 465, 465)), (8, 64, 64))
    >>> r = Roi((0, 47, 47), (15, 418, 418))
    >>> choose_task_chunks(g, r, Halo((0, 47, 47), (0, 47, 47)), 2, max_voxels=1 << 26)
    Coordinate(1, 8, 8)
    >>> choose_task_chunks(g, r, Halo((0, 47, 47), (0, 47, 47)), 1, max_voxels=1 << 26)
    Coordinate(2, 8, 8)
    """
    if region.empty:
        return Coordinate((1,) * region.dims)
    cs, o = grid.chunk_shape, grid.bounds.offset
    lo = (region.begin - o) // cs
    hi = (region.end - o).ceil_div(cs)
    ctx = halo.low + halo.high
    axes = []
    for a in range(region.dims):
        n_chunks = int(hi[a])  # task boundaries are multiples of t from the grid's origin
        cands = sorted({-(-n_chunks // n) for n in range(1, n_chunks + 1)} | {1})
        if len(cands) > per_axis:  # keep the small sizes and a geometric thinning of the rest
            step = len(cands) / per_axis
            cands = sorted({cands[int(i * step)] for i in range(per_axis)} | {cands[-1]})
        stats = []
        for t in cands:
            w = [
                v
                for v in _axis_pieces(
                    int(lo[a]), int(hi[a]), t, int(o[a]), int(cs[a]), int(region.begin[a]), int(region.end[a])
                )
                if v
            ]
            stats.append((t, len(w), max(w), max(w) + int(ctx[a])))
        axes.append(stats)
    best, best_cost = Coordinate((1,) * region.dims), None
    for combo in itertools.product(*axes):
        write = 1
        for _, _, w, _ in combo:
            write *= w
        if write > max_voxels:
            continue
        shape = Coordinate(c[2] for c in combo)
        if fits is not None and not fits(shape):
            continue
        tasks, read = 1, 1
        for _, n, _, r in combo:
            tasks *= n
            read *= r
        cost = -(-tasks // max(1, slots)) * (read + task_overhead)
        if best_cost is None or cost < best_cost:
            best, best_cost = Coordinate(c[0] for c in combo), cost
    return best


def create_blocks(grid: ChunkGrid, task_chunks, halo: Halo, region: Roi | None = None) -> list[Block]:
    """Every task of :class:`TaskGrid` as a list.

    >>> g = ChunkGrid(Roi((0, 0, 0), (8, 10, 10)), (4, 4, 4))
    >>> [b.write_roi.shape for b in create_blocks(g, (2, 2, 2), Halo((1, 1, 1), (1, 1, 1)))]
    [Coordinate(8, 8, 8), Coordinate(8, 8, 2), Coordinate(8, 2, 8), Coordinate(8, 2, 2)]
    """
    return list(TaskGrid(grid, task_chunks, halo, region))
