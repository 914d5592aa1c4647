"""The pyramid (``downsample.mips``): mips 1..N of the output, in tasks of whole shards or chunks.

Mip k's scales come from :mod:`znni_core.io.mips` (planned with the run: the output layer is
created with every mip in its ``info`` or OME-Zarr group).  A task of mip k is one shard of
mip k (or ``task_chunks`` chunks of an unsharded layer); chunk by chunk, it reads the ``factor``
box under the chunk from mip k-1 (whole blocks: the layer starts on the factor's grid), averages each block as
igneous does (floats: the mean; integers: the mean rounded down), and writes its chunks or its
shard exactly as an inference task does (:func:`~znni_core.io.store_chunks`: whole,
atomic, read back, one writer per object), then its manifest ``manifests/mipK/...``.  All-zero
chunks are not written (they read as 0).

The workflow runs mip k's tasks in jobs (rule ``pyramid_job``) once every job of mip k-1 is done,
then ``znni pyramid`` (rule ``pyramid``) checks every manifest and stored object of every mip
and writes ``<work_dir>/pyramid.json`` for the report.  Outside the workflow, ``znni pyramid``
builds whatever is not done yet, then checks.  Re-runs skip the tasks that verify.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..geometry import Coordinate, Roi, TaskGrid
from ..io import atomic_write, open_output, parse_layer_url, store_chunks, write_manifest
from .jobs import run_blocks
from .run import Run
from .schedule import job_range, mip_tasks

__all__ = ["downsample", "run_pyramid_job", "build_pyramid"]

PYRAMID_JOB_FORMAT = "znni-pyramid-job/1"
RECORD = "pyramid.json"


def downsample(a: np.ndarray, factor, dtype: str) -> np.ndarray:
    """``(C, z, y, x)`` averaged over ``factor`` blocks; a partial last block averages the voxels it
    has.  Integers: the mean rounded down (igneous' averaging); floats: the float64 mean.

    >>> downsample(np.arange(6, dtype=np.float32).reshape(1, 1, 1, 6), (1, 1, 4), "float32")
    array([[[[1.5, 4.5]]]], dtype=float32)
    >>> downsample(np.array([1, 2, 2, 2], np.uint8).reshape(1, 1, 2, 2), (1, 2, 2), "uint8")
    array([[[[1]]]], dtype=uint8)
    """
    f = tuple(int(v) for v in factor)
    shape = a.shape[1:]
    n = tuple(-(-s // k) for s, k in zip(shape, f))
    integer = np.dtype(dtype).kind in "ui"
    acc = np.zeros((a.shape[0],) + tuple(m * k for m, k in zip(n, f)), np.int64 if integer else np.float64)
    acc[(slice(None),) + tuple(slice(0, s) for s in shape)] = a
    total = acc.reshape((a.shape[0], n[0], f[0], n[1], f[1], n[2], f[2])).sum(axis=(2, 4, 6))
    # voxels per block: f, or fewer in the last block of an axis
    counts = [np.minimum(k, s - k * np.arange(m)) for s, k, m in zip(shape, f, n)]
    count = counts[0][:, None, None] * counts[1][None, :, None] * counts[2][None, None, :]
    if integer:
        return (total // count).astype(dtype)
    return (total / count).astype(dtype)


class _Pyramid:
    """A run's output, mip by mip, opened once per process."""

    def __init__(self, run: Run):
        from .run import output_specs

        cfg = run.config
        self.run, self.factor = run, Coordinate(cfg.downsample.factor)
        self.specs = output_specs(run)
        if len(self.specs) < 2:
            raise DataError(f"downsample.mips is 0 in {run.work_dir}/run.json: the run has no pyramid to build")
        self.url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
        self._layers = {}

    def layer(self, k: int):
        if k not in self._layers:
            self._layers[k] = open_output(self.url, self.specs[k], k)
        return self._layers[k]

    def tasks(self, k: int) -> TaskGrid:
        if not 1 <= k < len(self.specs):
            raise DataError(f"mip {k} is not a mip of this run's pyramid (1 to {len(self.specs) - 1})")
        return mip_tasks(self.specs[k], self.run.config.task_chunks)

    def done(self, k: int, block) -> bool:
        from .finalize import check_task
        from .task import manifest_path

        verify = self.run.config.finalize.verify
        return manifest_path(self.run, block.id, k).is_file() and bool(
            check_task(self.run, self.layer(k), block, verify, mip=k)
        )

    def run_task(self, k: int, block) -> dict:
        """Average the box of mip k-1 under ``block``, write its chunks (or shard), then its manifest."""
        from .task import manifest_path

        t0 = time.perf_counter()
        below, out = self.layer(k - 1), self.layer(k)
        w = block.write_roi
        encoded, skipped = {}, {}
        for idx in block.chunks:  # chunk by chunk: memory is the task's output plus one source box
            roi = out.grid.chunk_roi(idx)
            src = Roi.from_bounds(roi.begin * self.factor, (roi.end * self.factor).min(below.bounds.end))
            c = downsample(below.read(src, fill_missing=True)[0], self.factor, out.dtype)
            if c.any():
                encoded[idx] = np.ascontiguousarray(c)
            else:
                skipped[idx] = "empty"
        entries, shard = store_chunks(out, block.chunks, encoded, skipped, self.run.config.output.compression)
        total = time.perf_counter() - t0
        manifest = {
            "task": block.id,
            "mip": k,
            "run_digest": self.run.digest,
            "layer": f"{self.url} mip {k}",
            "write_roi": w.to_dict(),
            "chunks": [entries[i] for i in block.chunks],
            "read_roi": Roi.from_bounds(w.begin * self.factor, (w.end * self.factor).min(below.bounds.end)).to_dict(),
            **({"shard": shard} if shard is not None else {}),
            "plan_digest": self.run.plan.digest,
            "network_digest": self.run.network.digest,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "voxels": int(w.shape.prod()),
            "timings": {"total_s": round(total, 4)},
            "finished": time.time(),
        }
        write_manifest(manifest_path(self.run, block.id, k), manifest)
        return {
            "task": block.id,
            "voxels": manifest["voxels"],
            "seconds": manifest["timings"]["total_s"],
            "written": len(encoded),
        }


def run_pyramid_job(run_file, mip: int, job: int, per_job: int, *, marker=None, log=print) -> dict:
    """Run the tasks of ``job`` of mip ``mip`` (skipping those done and verified); marker last."""
    from .run import load_run

    t0 = time.perf_counter()
    run = load_run(run_file)
    p = _Pyramid(run)
    tasks = p.tasks(mip)
    ks = list(job_range(job, per_job, len(tasks)))
    if job < 0 or not ks:
        raise DataError(f"mip {mip} job {job} has no task: {len(tasks)} tasks at {per_job} per job")
    ran, skipped = run_blocks(
        [tasks[k] for k in ks], lambda b: p.done(mip, b), lambda b: p.run_task(mip, b), f"mip {mip} job {job}", log
    )
    doc = {
        "format": PYRAMID_JOB_FORMAT,
        "mip": mip,
        "job": job,
        "run_digest": run.digest,
        "tasks": [tasks[k].id for k in ks],
        "ran": ran,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - t0, 3),
        "finished": time.time(),
    }
    path = Path(marker) if marker else Path(run.work_dir) / "pyramid" / f"mip{mip}" / f"{job:06d}.json"
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    log(f"mip {mip} job {job}: {len(ran)} task(s) run, {len(skipped)} skipped (already done) in {doc['seconds']:.1f} s")
    return doc


def build_pyramid(run: Run, log=print) -> dict:
    """Build what is not done yet of every mip (in order), check every mip's manifests and stored
    objects, then write ``pyramid.json`` (what the report shows) and return it."""

    t0 = time.perf_counter()
    p = _Pyramid(run)
    record = {"factor": list(p.factor), "mips": []}
    for k in range(1, len(p.specs)):
        tasks = p.tasks(k)
        ran, skipped = run_blocks(list(tasks), lambda b: p.done(k, b), lambda b: p.run_task(k, b), f"mip {k}", log)
        spec = p.specs[k]
        record["mips"].append(
            {
                "mip": k,
                "key": spec.key,
                "size_zyx": list(spec.bounds.shape),
                "offset_zyx": list(spec.bounds.offset),
                "resolution_zyx": list(spec.resolution),
                "tasks": len(tasks),
                "run_now": len(ran),
                "verified": len(skipped) + len(ran),
            }
        )
        log(
            f"pyramid: mip {k} {spec.key} {tuple(spec.bounds.shape)} (z, y, x): {len(tasks)} task(s), {len(ran)} run "
            f"now, all verified"
        )
    record["seconds"] = round(time.perf_counter() - t0, 3)
    atomic_write(Path(run.work_dir) / RECORD, (json.dumps(record, indent=1) + "\n").encode())
    return record
