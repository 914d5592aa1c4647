"""A job's input chunks, fetched once for all of its tasks that read them.

Neighbouring tasks read the same input chunks: each task's halo reaches into its neighbours'
chunks, and a task boundary off the input's chunk grid splits a chunk between two tasks. A job
knows the read boxes of all its tasks before it starts, so it knows how many of them read each
chunk; a :class:`ChunkCache` keeps a fetched chunk until the last of those tasks has read it
(in memory up to ``memory_bytes``, then in a file of a private directory on local disk, under
``$TMPDIR``), and drops it then. What a run fetches from its input, read amplification, is
:func:`~znni_core.pipeline.schedule.input_reads`; jobs are boxes of tasks that share much
(:func:`~znni_core.pipeline.schedule.choose_jobs`).

A cached chunk keeps what its fetch recorded, the versions of the objects it came from (taken
before the fetch) and whether it was missing and filled, so a task served from the cache records
the same provenance as one that fetched it.  Reads may come from several threads (a job reads the
next task while it computes one): the bookkeeping is locked, the fetches are not.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..geometry import Roi

#: what a cache holds in memory; the rest (up to its limit, ``jobs.cache_gb``) goes to files
MEMORY_BYTES = 64 * 2**20


@dataclass
class _Entry:
    array: np.ndarray | None  # (C, z, y, x) of the chunk's box, or None when spilled to ``path``
    path: Path | None
    shape: tuple
    versions: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)


def _box(idxs: list) -> tuple | None:
    """``(low, high)`` chunk indices of ``idxs`` when they are exactly a box, else None."""
    lo = tuple(min(i[a] for i in idxs) for a in range(3))
    hi = tuple(max(i[a] for i in idxs) + 1 for a in range(3))
    return (lo, hi) if math.prod(h - l for l, h in zip(lo, hi)) == len(set(map(tuple, idxs))) else None


class ChunkCache:
    """``layer`` (an input layer: ``bounds``, ``grid``, ``read``, ``objects``, ``versions``,
    ``missing_chunks``) read through a cache of whole chunks.

    ``uses``: ``{chunk index: reads to come}``, what the job's tasks will read
    (:func:`chunk_uses`); a chunk without uses left is never kept, nor one past ``limit_bytes``
    held (it is fetched again).  No ``uses``: every read goes to the layer (a single task).
    ``stats``: chunks and voxels fetched, chunks served from the cache, and the most bytes held at
    once (memory and files)."""

    def __init__(
        self, layer, uses: dict | None = None, *, limit_bytes: int = 0, memory_bytes: int = MEMORY_BYTES, spill_dir=None
    ):
        self.layer = layer
        self._uses = {tuple(map(int, k)): int(v) for k, v in (uses or {}).items()}
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()
        self._memory_bytes, self._limit = memory_bytes, limit_bytes
        self._spill_root, self._spill = spill_dir, None
        self._held = self._in_memory = 0
        self.stats = {"fetched_chunks": 0, "fetched_voxels": 0, "reused_chunks": 0, "peak_bytes": 0}

    # ---- the layer's face ---------------------------------------------------------------------------
    @property
    def bounds(self) -> Roi:
        """The layer's bounds."""
        return self.layer.bounds

    @property
    def grid(self):
        """The layer's chunk grid."""
        return self.layer.grid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Drop every cached chunk and the spill directory."""
        with self._lock:
            self._entries.clear()
            self._held = self._in_memory = 0
            spill, self._spill = self._spill, None
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)

    # ---- reads --------------------------------------------------------------------------------------
    def read(self, roi: Roi, *, fill_missing: bool = False, versions: dict | None = None, reads: dict | None = None):
        """``(C, z, y, x)`` array of ``roi`` and the names of the chunks filled with zeros, as
        ``layer.read``; ``versions``: filled with ``{object: version}`` of what the data came from
        (taken before its fetch); ``reads``: ``chunks`` and ``voxels`` fetched from the layer
        (whole chunks) and ``reused`` chunks served from the cache, added up."""
        grid = self.layer.grid
        idxs = [tuple(map(int, i)) for i in grid.chunks_in(roi)]
        with self._lock:
            hits = {i: self._entries[i] for i in idxs if i in self._entries}
        misses = [i for i in idxs if i not in hits]
        if not self._uses and not hits:  # nothing to keep: one read of the layer, as without a cache
            if versions is not None:
                versions.update(self.layer.object_versions(roi))
            self._count(reads, misses)
            return self.layer.read(roi, fill_missing=fill_missing)
        out = np.zeros((int(self.layer.channels),) + tuple(roi.shape), self.layer.dtype)
        missing: list = []
        fetched = self._fetch(misses, fill_missing) if misses else {}
        self._count(reads, misses)
        for i in idxs:
            e = hits.get(i) or fetched[i]
            croi = grid.chunk_roi(i)
            inter = croi.intersect(roi)
            arr = e.array if e.array is not None else np.fromfile(e.path, self.layer.dtype).reshape(e.shape)
            out[(slice(None),) + inter.to_slices(roi.offset)] = arr[(slice(None),) + inter.to_slices(croi.offset)]
            if versions is not None:
                versions.update(e.versions)
            missing.extend(e.missing)
        if reads is not None:
            reads["reused"] = reads.get("reused", 0) + len(hits)
        with self._lock:
            self.stats["reused_chunks"] += len(hits)
            for i in idxs:
                left = self._uses.get(i, 0) - 1
                self._uses[i] = left
                if left <= 0:
                    self._uses.pop(i, None)
                    self._drop(i)
                elif i in fetched and i not in self._entries:
                    self._keep(i, fetched[i])
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self._held)
        return out, missing

    def _count(self, reads, idxs) -> None:
        vox = sum(int(self.layer.grid.chunk_roi(i).shape.prod()) for i in idxs)
        with self._lock:
            self.stats["fetched_chunks"] += len(idxs)
            self.stats["fetched_voxels"] += vox
        if reads is not None:
            reads["chunks"] += len(idxs)
            reads["voxels"] += vox

    def _fetch(self, idxs: list, fill_missing: bool) -> dict:
        """``{chunk: _Entry}`` of ``idxs`` fetched from the layer: one read of their box when they
        make one (a task whose neighbours' shared chunks are cached), else one read each."""
        grid, layer = self.layer.grid, self.layer
        box = _box(idxs)
        groups = [(idxs, box)] if box is not None else [([i], (i, tuple(v + 1 for v in i))) for i in idxs]
        out = {}
        for group, (lo, hi) in groups:
            gbox = Roi.union(grid.chunk_roi(lo), grid.chunk_roi(tuple(h - 1 for h in hi)))
            got = layer.object_versions(gbox)
            arr, missing = layer.read(gbox, fill_missing=fill_missing)
            for i in group:
                croi = grid.chunk_roi(i)
                part = np.ascontiguousarray(arr[(slice(None),) + croi.to_slices(gbox.offset)])
                names = [] if not missing else (missing if len(group) == 1 else layer.missing_chunks(croi))
                mine = {o: got[o] for o in layer.objects(croi) if o in got}
                out[i] = _Entry(part, None, part.shape, mine, list(names))
        return out

    def _keep(self, i: tuple, e: _Entry) -> None:
        """Hold ``e`` for later tasks: in memory while the budget lasts, else in a file (lock held)."""
        size = e.array.nbytes
        if self._held + size > self._limit:
            return
        if self._in_memory + size > self._memory_bytes:
            if self._spill is None:
                root = self._spill_root or os.environ.get("TMPDIR") or tempfile.gettempdir()
                self._spill = Path(tempfile.mkdtemp(prefix="znni-input-cache-", dir=root))
            path = self._spill / "_".join(map(str, i))
            e.array.tofile(path)
            e = _Entry(None, path, e.shape, e.versions, e.missing)
        else:
            self._in_memory += size
        self._entries[i] = e
        self._held += size

    def _drop(self, i: tuple) -> None:
        e = self._entries.pop(i, None)
        if e is None:
            return
        size = math.prod(e.shape) * np.dtype(self.layer.dtype).itemsize
        self._held -= size
        if e.path is not None:
            e.path.unlink(missing_ok=True)
        else:
            self._in_memory -= size


def chunk_uses(grid, boxes) -> dict:
    """``{chunk index: how many of the read boxes cover it}`` (the boxes a job's tasks will read)."""
    uses: dict = {}
    for roi in boxes:
        if roi is None or roi.empty:
            continue
        for i in grid.chunks_in(roi):
            k = tuple(map(int, i))
            uses[k] = uses.get(k, 0) + 1
    return uses
