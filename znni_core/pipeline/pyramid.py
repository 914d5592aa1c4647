"""The pyramid (``downsample.mips``): mips 1..N of the output, in tasks of whole shards or chunks.

Mip k's scales come from :mod:`znni_core.io.mips` (planned with the run: the output layer is
created with every mip in its ``info`` or OME-Zarr group).  A task of mip k is one shard of
mip k (or ``task_chunks`` chunks of an unsharded layer); chunk by chunk, it reads the ``factor``
box under the chunk from mip k-1 (whole chunks: the layer starts on the factor's grid), averages each block as
igneous does (floats: the mean; integers: the mean rounded down), and writes its chunks or its
shard exactly as an inference task does (:func:`~znni_core.io.store_chunks`: whole,
atomic, read back, one writer per object), then its manifest ``manifests/mipK/...``.  All-zero
chunks are not written (they read as 0).

Nothing of mip k-1 is read as 0 because it is absent: a task reads what the manifests of mip k-1
record now.  A chunk recorded ``written`` is read and its bytes' sha256 compared with the
manifest's (absent or changed: a :class:`DataError` naming the chunk and the task to re-run); a
chunk recorded ``empty`` or ``masked``, and every chunk of a masked mip-0 task, is 0 and not read.
The task's manifest pins them all (``below``: ``{"mip": k-1, "chunks": {name: sha256 | "empty" |
"masked"}}``), and the task is done only while its pins equal what the manifests of mip k-1 record:
a mip-0 task re-run with other bytes makes the task of mip 1 above it not done, rebuilding that
one changes its digests and so makes the task of mip 2 above it not done, and so on
(:func:`pyramid_status` follows this through every mip at once, from the manifests alone).

The workflow runs mip k's tasks in jobs (rule ``pyramid_job``) once every job of mip k-1 is done,
then ``znni pyramid`` (rule ``pyramid``) checks every manifest and stored object of every mip
and writes ``<work_dir>/pyramid.json`` for the report.  Outside the workflow, ``znni pyramid``
builds whatever is not done yet, then checks.  Re-runs skip the tasks that verify.  Before it
writes anything, ``znni pyramid`` refuses a mip 0 with a task not done (no manifest, or another
run's), naming them; a job of mip k refuses alike for the tasks of mip k-1 under its own.
"""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np

from ..errors import DataError, StorageError
from ..geometry import Coordinate, Roi, TaskGrid
from ..io import atomic_write, open_output, parse_layer_url, store_chunks, write_manifest
from ..io.precomputed import encode_raw
from ..io.store import sha256
from ..io.workdir import remove_before_rewrite, work_path
from .jobs import run_blocks
from .mask import load_mask_tasks, positions
from .run import Run, load_run, location, output_specs, run_geometry
from .schedule import job_range, mip_tasks

__all__ = ["downsample", "run_pyramid_job", "build_pyramid", "pyramid_status"]

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

        cfg = run.config
        self.run, self.factor = run, Coordinate(cfg.downsample.factor)
        self.specs = output_specs(run)
        if len(self.specs) < 2:
            raise DataError(f"downsample.mips is 0 in {run.work_dir}/run.json: the run has no pyramid to build")
        self.url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
        self.run_file = work_path(run) / "run.json"
        self._layers, self._grids, self._live = {}, {}, None

    def layer(self, k: int):
        if k not in self._layers:
            self._layers[k] = open_output(self.url, self.specs[k], k)
        return self._layers[k]

    def tasks(self, k: int) -> TaskGrid:
        if not 1 <= k < len(self.specs):
            raise DataError(f"mip {k} is not a mip of this run's pyramid (1 to {len(self.specs) - 1})")
        return mip_tasks(self.specs[k], self.run.config.task_chunks)

    def grid(self, j: int) -> TaskGrid:
        """The tasks of mip ``j``: the run's inference tasks for mip 0."""
        if j not in self._grids:
            self._grids[j] = run_geometry(self.run)[3] if j == 0 else self.tasks(j)
        return self._grids[j]

    def masked(self, block) -> bool:
        """A mip-0 task the mask is 0 over (never run: no manifest, every chunk absent)."""
        if not self.run.mask:
            return False
        if self._live is None:
            self._live = set(positions(load_mask_tasks(self.run)))
        return self.grid(0).index(block.id) not in self._live

    def fix(self, j: int, task) -> str:
        if j == 0:
            return f"run it (the workflow's infer jobs, or `znni run-task {self.run_file} --task {task}`)"
        return f"build it (`znni pyramid {self.run_file}`, or the workflow's pyramid jobs of mip {j})"

    def manifest(self, j: int, block) -> dict:
        """Task ``block`` of mip ``j``'s manifest, if it is this run's (:func:`.done.this_runs_manifest`,
        no stored object read); DataError naming it and the fix."""
        # lazy: loads numba and scipy only when called
        from .done import this_runs_manifest
        from .task import manifest_path

        path = manifest_path(self.run, block.id, j)
        if not path.is_file():
            raise DataError(f"mip {j} task {block.id} is not done (no manifest {path}); {self.fix(j, block.id)}")
        try:
            return this_runs_manifest(self.run, block, j)
        except DataError as exc:
            raise DataError(f"mip {j} task {block.id}: {exc}; {self.fix(j, block.id)}") from None

    def require(self, j: int, blocks) -> None:
        """Refuse (DataError, before anything is written) if a task of ``blocks`` of mip ``j`` is not done."""
        bad, n = {}, 0
        for n, b in enumerate(blocks, 1):
            if not (j == 0 and self.masked(b)):
                try:
                    self.manifest(j, b)
                except DataError as exc:
                    bad[b.id] = exc
        if bad:
            ids = sorted(bad)
            raise DataError(
                f"mip {j} is incomplete: {len(ids)} of {n} task(s) not done or of another run (first: {ids[:5]}; "
                f"{bad[ids[0]]}); nothing of the pyramid was written"
            )

    def box(self, k: int, roi: Roi) -> Roi:
        """The box of mip k-1 under ``roi`` of mip k (whole chunks of mip k-1)."""
        return Roi.from_bounds(roi.begin * self.factor, (roi.end * self.factor).min(self.layer(k - 1).bounds.end))

    def below(self, k: int, roi: Roi) -> dict:
        """``{task of mip k-1: [its chunks under roi of mip k]}``."""
        grid, out = self.grid(k - 1), {}
        for idx in self.layer(k - 1).grid.chunks_in(self.box(k, roi)):
            key = tuple(idx // grid.task_chunks)
            if key not in out:
                out[key] = (grid.owner(idx), [])
            out[key][1].append(tuple(idx))
        return dict(out.values())

    def sources(self, k: int, roi: Roi) -> dict:
        """``{chunk of mip k-1 under roi: (its task's id, sha256 | "empty" | "masked")}`` as the
        manifests of mip k-1 record them now (DataError where a task there is not done)."""
        out = {}
        for b, idxs in self.below(k, roi).items():
            if k == 1 and self.masked(b):
                out.update((i, (b.id, "masked")) for i in idxs)
                continue
            rec = {tuple(c["index"]): c.get("sha256") or c["status"] for c in self.manifest(k - 1, b)["chunks"]}
            out.update((i, (b.id, rec[i])) for i in idxs)
        return out

    def pins(self, k: int, sources: dict) -> dict:
        """A task's manifest entry ``below``: what it averaged of mip k-1, chunk by chunk."""
        name = self.layer(k - 1).chunk_name
        return {"mip": k - 1, "chunks": {name(i): v for i, (_, v) in sources.items()}}

    def current(self, k: int, block, m: dict, not_done=frozenset()) -> None:
        """DataError unless manifest ``m`` of task ``block`` of mip k pins what mip k-1 records now
        and no task of mip k-1 under it is in ``not_done``."""
        src = self.sources(k, block.write_roi)
        want, had = self.pins(k, src), m.get("below")
        if had != want:
            old = had.get("chunks") if isinstance(had, dict) and isinstance(had.get("chunks"), dict) else {}
            changed = [n for n, v in want["chunks"].items() if old.get(n) != v]
            raise DataError(
                f"mip {k} task {block.id} is stale: {len(changed)} of the {len(want['chunks'])} mip {k - 1} "
                f"chunks under it are not what it averaged (first: {changed[0] if changed else None})"
            )
        under = sorted({t for t, _ in src.values()} & set(not_done))
        if under:
            raise DataError(f"mip {k} task {block.id} is stale: mip {k - 1} task(s) {under[:5]} under it are not done")

    def read_below(self, k: int, idx, task: int, digest: str) -> np.ndarray:
        """Chunk ``idx`` of mip k-1, refused unless its bytes are those task ``task``'s manifest records."""
        layer = self.layer(k - 1)
        try:
            a = layer.read(layer.grid.chunk_roi(idx))[0]
        except StorageError:  # the storage failed: not an absent chunk
            raise
        except DataError:  # a precomputed layer refuses an absent chunk; zarr reads it as 0 (the digest differs)
            a = None
        if a is None or sha256(encode_raw(a, layer.dtype)) != digest:
            state = "absent" if a is None or not a.any() else "changed"
            fix = (
                f"re-run mip 0 task {task} (`znni run-task {self.run_file} --task {task}`), then the pyramid"
                if k == 1
                else f"run `znni pyramid {self.run_file}` (it rebuilds mip {k - 1} task {task} first)"
            )
            raise DataError(
                f"mip {k - 1} chunk {layer.chunk_name(idx)} is {state}: its manifest "
                f"(task {task}) records it written with sha256 {digest[:12]}...; {fix}"
            )
        return a

    def done(self, k: int, block) -> bool:
        # lazy: loads numba and scipy only when called
        from .done import check_task
        from .task import manifest_path

        if not manifest_path(self.run, block.id, k).is_file():
            return False
        m = check_task(self.run, self.layer(k), block, self.run.config.finalize.verify, mip=k)
        self.current(k, block, m)
        return True

    def run_task(self, k: int, block) -> dict:
        """Average the box of mip k-1 under ``block``, write its chunks (or shard), then its manifest."""
        # lazy: loads numba and scipy only when called
        from .task import manifest_path

        t0 = time.perf_counter()
        below, out = self.layer(k - 1), self.layer(k)
        w = block.write_roi
        src = self.sources(k, w)
        encoded, skipped = {}, {}
        for idx in block.chunks:  # chunk by chunk: memory is the task's output plus one source box
            box = self.box(k, out.grid.chunk_roi(idx))
            a = np.zeros((below.channels,) + tuple(box.shape), below.dtype)
            for i in below.grid.chunks_in(box):
                task, rec = src[tuple(i)]
                if rec not in ("empty", "masked"):
                    a[(slice(None),) + below.grid.chunk_roi(i).to_slices(box.offset)] = self.read_below(k, i, task, rec)
            c = downsample(a, self.factor, out.dtype)
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
            "read_roi": self.box(k, w).to_dict(),
            "below": self.pins(k, src),
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
    """Run the tasks of ``job`` of mip ``mip`` (skipping those done and verified); marker last.
    DataError before anything is written if a task of mip ``mip - 1`` under them is not done."""
    t0 = time.perf_counter()
    run = load_run(run_file)
    path = location(marker) if marker else work_path(run) / "pyramid" / f"mip{mip}" / f"{job:06d}.json"
    if marker is None:
        remove_before_rewrite(path)
    p = _Pyramid(run)
    tasks = p.tasks(mip)
    ks = list(job_range(job, per_job, len(tasks)))
    if job < 0 or not ks:
        raise DataError(f"mip {mip} job {job} has no task: {len(tasks)} tasks at {per_job} per job")
    blocks = [tasks[k] for k in ks]
    p.require(mip - 1, {u for b in blocks for u in p.below(mip, b.write_roi)})
    ran, skipped = run_blocks(
        blocks, lambda b: p.done(mip, b), lambda b: p.run_task(mip, b), f"mip {mip} job {job}", log
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
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    log(f"mip {mip} job {job}: {len(ran)} task(s) run, {len(skipped)} skipped (already done) in {doc['seconds']:.1f} s")
    return doc


def build_pyramid(run: Run, log=print) -> dict:
    """Build what is not done yet of every mip (in order), check every mip's manifests and stored
    objects, then write ``pyramid.json`` (what the report shows) and return it.  DataError before
    anything is written if a task of mip 0 is not done."""

    t0 = time.perf_counter()
    remove_before_rewrite(work_path(run) / RECORD)
    p = _Pyramid(run)
    p.require(0, p.grid(0))
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
    atomic_write(work_path(run) / RECORD, (json.dumps(record, indent=1) + "\n").encode())
    return record


def pyramid_status(run: Run) -> list[dict]:
    """Per mip 1..N: ``{"mip", "tasks", "not_done": {task id: why}}``, from the manifests alone
    (no stored object is read).  A task is done when its manifest is this run's, what it pins of
    mip k-1 is what the manifests there record now, and no task of mip k-1 under it is not done."""
    p = _Pyramid(run)
    out, not_done = [], set()
    for k in range(1, len(p.specs)):
        tasks, bad = p.tasks(k), {}
        for b in tasks:
            try:
                p.current(k, b, p.manifest(k, b), not_done)
            except DataError as exc:
                bad[b.id] = str(exc)
        out.append({"mip": k, "tasks": len(tasks), "not_done": bad})
        not_done = set(bad)
    return out


def require_pyramid(run: Run, log=print) -> None:
    """DataError naming the tasks of the pyramid that are not done or stale (:func:`pyramid_status`)."""
    bad = [(s["mip"], t, why) for s in pyramid_status(run) for t, why in sorted(s["not_done"].items())]
    for k, t, why in bad:
        log(f"NOT DONE mip {k} task {t}: {why}")
    if bad:
        raise DataError(
            f"the pyramid has {len(bad)} task(s) not done or stale (first: mip {bad[0][0]} task {bad[0][1]}: "
            f"{bad[0][2]}); run `znni pyramid {work_path(run) / 'run.json'}` (it rebuilds only those)"
        )
