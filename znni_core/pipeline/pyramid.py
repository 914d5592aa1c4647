"""``znni pyramid``: mips 1..N of the output layer with igneous, then checked against mip 0.

igneous (the tool labs use for precomputed pyramids) downsamples by ``downsample.factor``
(z, y, x; default 1 x 2 x 2) per mip, in tasks of whole chunks (sharded layers: whole
shards, one mip at a time), run here in one process.  znni's output starts on the chunk grid
(``output.align``), so a mip-k voxel averages exactly the mip-(k-1) voxels under it.  Each
new mip is then read back through cloud-volume and compared, in absolute coordinates, with
the mean of the blocks of the mip below it (whole blocks; float: relative 1e-5, uint8: 1):
a layer starting off the grid is caught there (igneous averages blocks from the layer's
start, and writes them half a voxel off); ``<work_dir>/pyramid.json``
is written only after every mip passed, and lists them for the report.

igneous is optional: ``pip install 'znni[pyramid]'``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError, DataError

__all__ = ["build_pyramid", "block_mean"]


def block_mean(a: np.ndarray, factor) -> np.ndarray:
    """Mean over whole ``factor`` blocks of ``a`` (..., z, y, x); partial blocks at the end dropped."""
    f = tuple(int(v) for v in factor)
    n = tuple(s // k for s, k in zip(a.shape[-3:], f))
    a = a[(...,) + tuple(slice(0, m * k) for m, k in zip(n, f))].astype(np.float64)
    lead = a.shape[:-3]
    a = a.reshape(lead + (n[0], f[0], n[1], f[1], n[2], f[2]))
    return a.mean(axis=tuple(len(lead) + i for i in (1, 3, 5)))


def _igneous():
    try:
        from igneous import task_creation
        from taskqueue import LocalTaskQueue
    except ImportError as exc:
        raise ConfigError(f"downsample.mips > 0 needs igneous: pip install 'znni[pyramid]' ({exc})") from None
    return task_creation, LocalTaskQueue


def build_pyramid(run: dict, log=print) -> dict:
    """Build, check and record the pyramid of a run's output; returns the record."""
    from ..io import PrecomputedLayer, atomic_write, parse_layer_url

    cfg = run["config"]
    mips, factor = int(cfg["downsample"]["mips"]), tuple(cfg["downsample"]["factor"])
    if mips < 1:
        raise ConfigError("downsample.mips is 0: there is no pyramid to build")
    task_creation, LocalTaskQueue = _igneous()
    url = parse_layer_url(run["output"]["url"], endpoint=cfg["output"]["endpoint_url"])
    base = PrecomputedLayer(url, 0)
    t0 = time.perf_counter()
    xyz = factor[::-1]
    tq = LocalTaskQueue(parallel=1, progress=False)
    if base.sharded:  # igneous' shard downsampling makes one mip per pass
        for k in range(mips):
            tq.insert(task_creation.create_image_shard_downsample_tasks(
                url.cloudpath(), mip=k, factor=xyz, fill_missing=True, num_mips=1))
            tq.execute(progress=False)
    else:
        tq.insert(task_creation.create_downsampling_tasks(
            url.cloudpath(), mip=0, num_mips=mips, factor=xyz, fill_missing=True, compress=False,
            delete_black_uploads=False))
        tq.execute(progress=False)
    seconds = time.perf_counter() - t0
    record = {"factor": list(factor), "seconds": round(seconds, 3), "mips": []}
    below, off_below = base.read(base.bounds, fill_missing=True)[0], tuple(base.bounds.offset)
    for k in range(1, mips + 1):
        layer = PrecomputedLayer(url, k)
        got = layer.read(layer.bounds, fill_missing=True)[0]
        # absolute coordinates: mip-k voxel a is the mean of mip-(k-1) voxels [f a, f a + f); the
        # mip-k voxels whose block starts before the layer below are skipped
        skip = [max(0, -(-(ob - f * o) // f)) for o, ob, f in zip(layer.bounds.offset, off_below, factor)]
        start = [f * (o + s) - ob for o, s, ob, f in zip(layer.bounds.offset, skip, off_below, factor)]
        want = block_mean(below[(slice(None),) + tuple(slice(a, None) for a in start)], factor)
        have = got[(slice(None),) + tuple(slice(s, s + n) for s, n in zip(skip, want.shape[1:]))].astype(np.float64)
        want = want[(slice(None),) + tuple(slice(0, n) for n in have.shape[1:])]
        err = float(np.abs(have - want).max()) if want.size else 0.0
        tol = 1.0 if np.dtype(layer.dtype).kind in "ui" else 1e-5 * max(1.0, float(np.abs(want).max(initial=0)))
        if err > tol:
            raise DataError(f"mip {k} ({layer.key}) of {url} differs from the mean of mip {k - 1} by {err:.3g} "
                            f"> {tol:.3g}: the pyramid is wrong; delete its scales from the info and re-run")
        record["mips"].append({"mip": k, "key": layer.key, "size_zyx": list(layer.bounds.shape),
                               "offset_zyx": list(layer.bounds.offset), "max_abs_error": err})
        log(f"pyramid: mip {k} {layer.key} {tuple(layer.bounds.shape)} (z, y, x), max error vs mip {k - 1}: {err:.2e}")
        below, off_below = got, tuple(layer.bounds.offset)
    atomic_write(Path(run["work_dir"]) / "pyramid.json", (json.dumps(record, indent=1) + "\n").encode())
    return record
