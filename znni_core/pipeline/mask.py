"""Masks: an optional layer (tissue, a region of interest; any mip, any resolution) that restricts
the work to where it is non-zero.

An output chunk is *live* when a non-zero mask voxel overlaps it (inside the region); otherwise it
is *masked*: not computed, not written (readers see 0), recorded ``masked`` in its task's
manifest.  A task with no live chunk is masked as a whole: the workflow's checkpoint
``mask_tasks`` (``znni mask-tasks``) lists the live tasks once, in ``<work_dir>/mask_tasks.json``,
so that the DAG has jobs only for them, and ``finalize`` reports the masked tasks apart from
tasks that never ran.  A partly masked task computes only the box of its live chunks.  Inside a
live chunk the network's output is kept whole (the mask decides what is computed, it does not
multiply the output).

Input voxel ``v`` covers ``[v r, (v + 1) r)`` nm at the input's resolution ``r``; mask voxel
``m`` covers ``[m s, (m + 1) s)`` at the mask's ``s``.  The mask voxels under an input box are
found with exact fractions, so any mip of the mask, coarser or finer than the input, works.
Outside the mask layer's bounds the mask is 0.  A missing mask chunk (not found, or 0 bytes) is
an error naming it (``mask.missing: fail``, the default: a truncated mask would silently turn
work into "masked"), or with ``mask.missing: zero`` reads as 0 and is recorded
(``missing_mask_filled`` in ``mask_tasks.json`` and in the manifests of the tasks that read it).
A chunk the mask layer's sha256 index records is never filled, and an unreadable one (I/O or
permission error, a directory in its place) is never missing.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import reduce
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError
from ..geometry import Roi
from ..io import open_input, parse_layer_url
from ..io.workdir import work_path
from .run import Run, location
from .settings import Config

MASK_FILE = "mask_tasks.json"
MASK_FORMAT = "znni-mask-tasks/1"
READ_VOXELS = 2**26  # mask voxels read at once when scanning the tasks


class Mask:
    """A mask layer seen from the input's voxels.

    >>> class L: resolution, bounds = (40.0, 32.0, 32.0), Roi((0, 0, 0), (10, 10, 10))
    >>> Mask(L(), (40.0, 8.0, 8.0)).box(Roi((2, 3, 4), (1, 5, 4)))  # 8 nm voxels 3..7 -> 32 nm voxels 0..1
    Roi(offset=(2, 0, 1), shape=(1, 2, 1))
    """

    def __init__(self, layer, in_resolution, url=None, mip: int = 0, missing: str = "fail"):
        self.layer, self.url, self.mip, self.missing = layer, url, mip, missing
        self.ratio = tuple(Fraction(float(a)) / Fraction(float(b)) for a, b in zip(in_resolution, layer.resolution))

    def box(self, roi: Roi) -> Roi:
        """The mask voxels that overlap the input-voxel box ``roi``."""
        lo = [math.floor(b * r) for b, r in zip(roi.begin, self.ratio)]
        hi = [math.ceil(e * r) for e, r in zip(roi.end, self.ratio)]
        return Roi.from_bounds(lo, hi)

    def read(self, roi: Roi, filled: list | None = None, versions: dict | None = None) -> tuple[np.ndarray, Roi]:
        """``(bool (z, y, x) array, its box in mask voxels)``: where the mask is non-zero under ``roi``.

        A missing mask chunk is a :class:`DataError` naming it unless ``mask.missing`` is ``zero``;
        then it reads as 0 and its name is appended to ``filled``.  ``versions``: gets the
        versions of the mask objects read, taken before the read (as a task's input's)."""
        box = self.box(roi)
        out = np.zeros(tuple(box.shape), bool)
        inside = box.intersect(self.layer.bounds)
        if not inside.empty:
            if versions is not None:
                versions.update(self.layer.object_versions(inside))
            a, missing = self.layer.read(inside, fill_missing=True)  # recorded chunks are never filled
            if missing and self.missing != "zero":
                raise DataError(
                    f"mask {self.url} mip {self.mip}: {len(missing)} chunk(s) under {inside} (mask voxels) are "
                    f"missing or empty (first: {missing[:3]}); a missing mask chunk would mask its tasks "
                    "silently. Repair the mask, or set mask.missing: zero to read them as 0 (masked; "
                    "recorded as missing_mask_filled)"
                )
            if filled is not None:
                filled.extend(missing)
            out[inside.to_slices(box.offset)] = (a != 0).any(axis=0)
        return out, box

    def under(self, arr: np.ndarray, box: Roi, roi: Roi) -> np.ndarray:
        """The part of ``arr`` (read over ``box``) under the input-voxel box ``roi``."""
        return arr[self.box(roi).to_slices(box.offset)]


def open_mask(cfg: Config, in_resolution) -> Mask | None:
    """The config's mask (``mask.path``), or None without one."""
    m = cfg.mask
    if m is None:
        return None
    url = parse_layer_url(m.path, endpoint=m.endpoint_url, what="mask.path")
    return Mask(open_input(url, m.mip, resolution=m.resolution, what="mask"), in_resolution, url, m.mip, m.missing)


def check_mask(mask: Mask, region: Roi) -> None:
    """Plan-time checks: the mask must overlap the region somewhere."""
    box = mask.box(region)
    if not box.intersects(mask.layer.bounds):
        res = tuple(float(v) for v in mask.layer.resolution)
        raise ConfigError(
            f"mask {mask.url} mip {mask.mip} (bounds {mask.layer.bounds}, "
            f"{res} nm) covers none of the region: the region is {box} in mask voxels. Check mask.path and mask.mip "
            "(the mask's resolution maps it onto the input), or drop the mask"
        )


def live_chunks(mask: Mask, grid, region: Roi, chunks, filled: list | None = None, versions=None) -> set:
    """The chunks (indices) of ``chunks`` that a non-zero mask voxel overlaps inside ``region``
    (``filled``: gets the mask chunks read as 0; ``versions``: the mask objects' versions;
    :meth:`Mask.read`)."""
    rois = {tuple(i): grid.chunk_roi(i).intersect(region) for i in chunks}
    rois = {i: r for i, r in rois.items() if not r.empty}
    if not rois:
        return set()
    arr, box = mask.read(reduce(Roi.union, rois.values()), filled, versions)
    return {i for i, r in rois.items() if mask.under(arr, box, r).any()}


def scan(tasks, mask: Mask, *, log=None) -> dict:
    """Which tasks of ``tasks`` (a TaskGrid) have a live chunk: their positions as ranges, the
    live chunks and voxels, and the mask chunks read as 0 (``mask.missing: zero``).  Reads the
    mask a row of tasks at a time (at most READ_VOXELS)."""
    grid, region = tasks.grid, tasks.region
    n = len(tasks)
    live, chunks_live, voxels_live, filled = [], 0, 0, []
    row = tasks.shape[-1] if n else 1  # tasks along x: consecutive positions
    per_read = max(1, min(row, READ_VOXELS // max(mask.box(tasks[0].write_roi.intersect(region)).size, 1))) if n else 1
    for k0 in range(0, n, row):
        for a in range(k0, min(k0 + row, n), per_read):
            ks = range(a, min(a + per_read, k0 + row, n))
            blocks = [tasks[k] for k in ks]
            rois = [b.write_roi.intersect(region) for b in blocks]
            arr, box = mask.read(reduce(Roi.union, rois), filled)
            for k, b, r in zip(ks, blocks, rois):
                sub = mask.under(arr, box, r)
                if not sub.any():
                    continue
                if sub.all():
                    cs = [grid.chunk_roi(i).intersect(region) for i in b.chunks]
                else:
                    cs = [
                        c
                        for c in (grid.chunk_roi(i).intersect(region) for i in b.chunks)
                        if not c.empty and mask.under(arr, box, c).any()
                    ]
                chunks_live += sum(1 for c in cs if not c.empty)
                voxels_live += sum(c.size for c in cs)
                if live and live[-1][1] == k:
                    live[-1][1] = k + 1
                else:
                    live.append([k, k + 1])
        if log and n > 100 * row and (k0 // row) % 100 == 0:
            log(f"mask: {min(k0 + row, n):,} of {n:,} tasks scanned")
    num_live = sum(b - a for a, b in live)
    return {
        "format": MASK_FORMAT,
        "num_tasks": n,
        "num_live": num_live,
        "num_masked": n - num_live,
        "live": live,
        "chunks_live": chunks_live,
        "voxels_live": int(voxels_live),
        "mask": str(mask.url) if mask.url is not None else None,
        "missing_mask_filled": sorted(set(filled)),
    }


def positions(doc: dict) -> list[int]:
    """The TaskGrid positions of the live tasks, in order."""
    return [k for a, b in doc["live"] for k in range(a, b)]


def mask_tasks_path(run: Run) -> Path:
    """Where the run's live tasks are recorded: ``<work_dir>/mask_tasks.json``."""
    return work_path(run) / MASK_FILE


def load_mask_tasks(run: Run, path=None) -> dict:
    """The run's ``mask_tasks.json``; ConfigError when missing or written for another run."""
    path = location(path) if path else mask_tasks_path(run)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"{path} is missing or unreadable: this run has a mask; run `znni mask-tasks "
            f"{work_path(run) / 'run.json'}` (the workflow's mask_tasks rule) first"
        ) from None
    if doc.get("format") != MASK_FORMAT or doc.get("run_digest") != run.digest:
        raise ConfigError(
            f"{path} was written for another run (the config or plan changed); run `znni mask-tasks` "
            "again (the workflow does when run.json changes)"
        )
    return doc
