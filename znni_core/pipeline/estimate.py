"""What a run will cost before it starts: tasks, jobs, chunks, shards, files, bytes and hours.

The rate (output voxels per second of one job) comes from, in order: ``--rate``; the tasks this
run already finished (their manifests' timings, reads and writes included); the plan timed on
one patch of random input on this machine (engine only: reads and writes are extra); or the
plan's prediction (``validate`` prints that one, to stay quick).  ``znni estimate`` stores a
measured rate in ``<work_dir>/estimate.json``, which sizes the workflow's jobs (``jobs.minutes``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from .. import load_network
from ..io import atomic_write
from ..io.workdir import work_path
from .mask import check_mask, open_mask, scan
from .network_file import network_file
from .resolve import resolve, stored_channels
from .schedule import ESTIMATE_FILE, compute_schedule, task_geometry
from .settings import Config, parse_config

DIR_FILES_WARN = 10**5
DAG_JOBS_WARN = 5 * 10**4
#: above this, the estimate says how to read less again (each task reads its halo; docs/slurm.md)
READ_AMPLIFICATION_WARN = 1.3


def rate_from_manifests(work, limit: int = 200) -> tuple[float, int] | None:
    """(voxels/s per task, tasks seen) from up to ``limit`` finished manifests of a run."""
    vox, secs, n = 0, 0.0, 0
    d = work_path(work) / "manifests"
    for p in sorted(d.rglob("*.json"))[:limit] if d.is_dir() else []:
        try:
            m = json.loads(p.read_text())
            vox += int(m["voxels"])
            secs += float(m["timings"]["total_s"])
            n += 1
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return (vox / secs, n) if n and secs > 0 else None


def time_plan(net, plan, repeats: int = 2) -> float:
    """Output voxels per second of ``plan`` on one patch of random input (after a warm-up call)."""
    # lazy: loads numba and scipy only when called
    from ..inference import infer, thread_limits

    shape = tuple(plan.patch_shape)
    x = np.random.default_rng(0).random((net.in_channels,) + shape, dtype=np.float32)
    best = math.inf
    with thread_limits(plan.threads):
        cache: dict = {}
        y = infer(net, x, plan=plan, cache=cache)  # warm-up: compilation, FFT wisdom, resident spectra
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = infer(net, x, plan=plan, cache=cache)
            best = min(best, time.perf_counter() - t0)
    return float(np.prod(y.shape[1:])) / best


def estimate(
    cfg: Config,
    schedule: dict,
    *,
    rate: float,
    rate_source: str,
    threads: int,
    device: str,
    out_channels: int,
    cores_per_node: int | None = None,
) -> dict:
    """The numbers of a run (see module doc); ``warnings`` lists what would hurt at this scale."""
    out = cfg.output
    itemsize = np.dtype(out.dtype).itemsize
    voxels = schedule["region_voxels"]
    tasks, jobs = schedule["num_tasks"], schedule["num_jobs"]
    objects = tasks if schedule["sharded"] else schedule["num_chunks"]
    dirs = math.ceil(tasks / 10_000)
    job_hours = voxels / rate / 3600 if rate else math.nan
    cores = cores_per_node or os.cpu_count() or 1
    pyr = schedule.get("pyramid", [])
    e = {
        "pyramid": {
            "mips": len(pyr),
            "tasks": sum(m["num_tasks"] for m in pyr),
            "jobs": sum(m["num_jobs"] for m in pyr),
            "objects": sum(m["objects"] for m in pyr),
        },
        "tasks": tasks,
        "jobs": jobs,
        "tasks_per_job": schedule["tasks_per_job"],
        "jobs_why": schedule["why"],
        "chunks": schedule["num_chunks"],
        "shards": tasks if schedule["sharded"] else 0,
        "shard_bytes": schedule.get("shard_bytes") if schedule["sharded"] else None,
        "sharding_note": schedule.get("note", ""),
        "output_objects": objects,
        "manifests": tasks,
        "manifest_dirs": dirs,
        "job_logs": 2 * jobs,
        "output_bytes": voxels * out_channels * itemsize,
        "voxels": voxels,
        "voxels_per_second": rate,
        "rate_source": rate_source,
        "threads": threads,
        "device": device,
        "job_hours": job_hours,
        "hours_per_job": job_hours / max(jobs, 1),
        "masked_tasks": schedule.get("masked_tasks"),
    }
    reads = schedule.get("input_reads")
    if reads:  # a schedule cached before this was counted has none
        item = reads["voxel_bytes"]
        e["input_read_bytes"] = reads["voxels"] * item
        e["input_unique_bytes"] = reads["unique_voxels"] * item
        e["read_amplification"] = reads["amplification"]
        e["input_reads_jobs"] = reads.get("jobs", "each task alone")
        e["input_cache_gb"] = cfg.jobs.cache_gb
        e["input_requests"] = reads["chunks"]
        # every output object, manifest and job marker is one write request (a retried write more)
        e["write_requests"] = objects + tasks + jobs
    if device == "gpu":
        e["gpu_hours"] = job_hours
    else:
        e["cores_per_node"] = cores
        e["node_hours"] = job_hours * threads / cores
    e["warnings"] = scale_warnings(cfg, schedule, e)
    return e


def scale_warnings(cfg: Config, schedule: dict, e: dict) -> list[str]:
    """What would hurt at the scale of estimate ``e``: too many files in one directory or jobs in
    the DAG, a high read amplification, days-long jobs; each with what to change."""
    objects, jobs, rate = e["output_objects"], e["jobs"], e["voxels_per_second"]
    w = []
    if objects > DIR_FILES_WARN:
        what = "shards" if schedule["sharded"] else "chunks"
        w.append(
            f"the output scale directory would hold {objects:,} {what} (> {DIR_FILES_WARN:,} files): fine on "
            "gs:// or s3://, slow on a file system" + ("" if schedule["sharded"] else "; use output.sharding: sharded")
        )
    if jobs + e["pyramid"]["jobs"] > DAG_JOBS_WARN:
        w.append(
            f"the DAG would have {jobs + e['pyramid']['jobs']:,} jobs (> {DAG_JOBS_WARN:,}): Snakemake needs ~1.3 ms and 18 KB per job "
            "at every start; lower jobs.max_jobs or raise jobs.tasks_per_job"
        )
    if 2 * jobs > DIR_FILES_WARN:
        w.append(f"{2 * jobs:,} job logs and benchmarks in two directories (> {DIR_FILES_WARN:,} files)")
    if e.get("read_amplification", 1.0) > READ_AMPLIFICATION_WARN:
        w.append(
            f"the tasks read each input byte {e['read_amplification']:.2f} times on average (their halos and "
            "the input's chunks read again by neighbouring tasks): "
            + (
                "give jobs a cache (jobs.cache_gb) and jobs.tasks_per_job: auto (boxes of tasks that share it), or "
                if not e.get("input_cache_gb") or cfg.jobs.tasks_per_job != "auto"
                else "raise jobs.cache_gb or jobs.minutes (larger boxes of tasks share more), or "
            )
            + "larger tasks ("
            + ("output.shard_bytes: a task is one shard" if schedule["sharded"] else "task_chunks")
            + ", within the infer job's memory)"
        )
    if rate and e["hours_per_job"] > 24:
        w.append(
            f"a job would compute for {e['hours_per_job']:.0f} h: raise jobs.max_jobs, give a job more threads "
            "or GPUs, or split the run by region"
        )
    return w


def describe(e: dict) -> str:
    """The estimate ``e`` as aligned text lines (sizes in powers of 1000), its warnings last."""

    def b(n):
        for unit in ("B", "KB", "MB", "GB", "TB", "PB", "EB"):
            if n < 1000 or unit == "EB":
                return f"{n:.3g} {unit}"
            n /= 1000

    lines = [
        f"tasks          {e['tasks']:,}"
        + (" (one shard each)" if e["shards"] else "")
        + (f"; {e['masked_tasks']:,} more masked (not counted below)" if e.get("masked_tasks") else ""),
        f"jobs           {e['jobs']:,} of {e['tasks_per_job']} task(s) ({e['jobs_why']})",
        f"chunks         {e['chunks']:,}"
        + (f" in {e['shards']:,} shards of about {b(e['shard_bytes'])}" if e["shards"] and e.get("shard_bytes") else "")
        + (f" in {e['shards']:,} shards" if e["shards"] and not e.get("shard_bytes") else ""),
        f"files/objects  {e['output_objects']:,} output + {e['manifests']:,} manifests in {e['manifest_dirs']:,} "
        f"dir(s) + {e['job_logs']:,} job logs/benchmarks",
        f"output         {b(e['output_bytes'])} uncompressed ({e['voxels']:,} voxels)",
    ]
    if "read_amplification" in e:
        lines.append(
            f"input reads    {b(e['input_read_bytes'])} uncompressed in {e['input_requests']:,} chunk reads: "
            f"{e['read_amplification']:.2f}x the region's unique input ({b(e['input_unique_bytes'])}; "
            f"halos and chunk edges read again by neighbouring tasks; fetched once where {e['input_reads_jobs']})"
        )
        lines.append(
            f"requests       {e['input_requests']:,} reads of input chunks + {e['write_requests']:,} writes "
            "(output objects, manifests, job markers), before retries"
        )
    if e["pyramid"]["mips"]:
        p = e["pyramid"]
        lines.append(
            f"pyramid        mips 1-{p['mips']}: {p['tasks']:,} tasks in {p['jobs']:,} jobs, {p['objects']:,} "
            f"output files/objects + {p['tasks']:,} manifests"
        )
    lines += [
        f"rate           {e['voxels_per_second']:,.0f} output voxels/s per job, {e['threads']} thread(s), "
        f"{e['device']} ({e['rate_source']})",
    ]
    if "gpu_hours" in e:
        lines.append(
            f"compute        {e['gpu_hours']:,.1f} GPU-hours (one GPU per job); {e['hours_per_job']:,.2f} h per job"
        )
    else:
        lines.append(
            f"compute        {e['job_hours']:,.1f} job-hours = {e['node_hours']:,.1f} node-hours at "
            f"{e['cores_per_node']} cores per node; {e['hours_per_job']:,.2f} h per job"
        )
    if e.get("sharding_note"):
        lines.append(f"sharding       {e['sharding_note']}")
    lines += [f"WARNING        {w}" for w in e["warnings"]]
    return "\n".join(lines)


def masked_schedule(cfg: Config, schedule: dict, log=print) -> dict:
    """The schedule counting only the work a mask leaves: live tasks, their jobs, live chunks and
    voxels (the mask is read over the whole region, as the workflow's checkpoint will)."""
    inp, lay, tasks, _ = task_geometry(cfg, slots=schedule.get("slots"))
    mask = open_mask(cfg, inp.resolution)
    check_mask(mask, lay.region)
    log(f"reading the mask {mask.url} over the region ...")
    doc = scan(tasks, mask, log=log)
    per = schedule["tasks_per_job"]
    return schedule | {
        "num_tasks": doc["num_live"],
        "num_jobs": math.ceil(doc["num_live"] / per),
        "num_chunks": doc["chunks_live"],
        "region_voxels": doc["voxels_live"],
        "masked_tasks": doc["num_masked"],
    }


def save_rate(work, e: dict) -> Path:
    """Record ``e``'s rate (voxels/s, source, threads, device, time) in ``<work>/estimate.json``; return its path."""
    path = work_path(work) / ESTIMATE_FILE
    atomic_write(
        path,
        (
            json.dumps(
                {k: e[k] for k in ("voxels_per_second", "rate_source", "threads", "device")} | {"time": time.time()},
                indent=1,
            )
            + "\n"
        ).encode(),
    )
    return path


def run_estimate(
    cfg: dict | Config,
    *,
    mem_mb: int | None,
    threads: int | None,
    rate: float | None,
    cores_per_node: int | None,
    log=print,
) -> dict:
    """``znni estimate``: the schedule, a rate (see module doc), the numbers; a measured rate is saved."""
    # lazy: loads numba and scipy only when called
    from .task import tta_variants

    cfg = parse_config(cfg)
    work = work_path(cfg)
    net = load_network(network_file(cfg.network))
    threads = threads or 1
    if rate:
        source = "--rate"
    elif (found := rate_from_manifests(work)) is not None:
        rate, n = found
        source = f"{n} finished task(s) of this run, reads and writes included"
    else:
        _, plan = resolve(cfg, mem_mb=mem_mb, threads=threads, progress=lambda *a: None)
        log(f"timing the plan (patch {tuple(plan.patch_shape)}, {plan.threads} thread(s)) on this machine ...")
        variants = len(tta_variants(cfg.tta))
        rate = time_plan(net, plan) / variants
        source = (
            f"the plan timed on one patch here, engine only (predicted {plan.predicted_voxels_per_s:,.0f}); "
            "reads and writes add to it" + (f"; {variants} test-time augmentation variants" if variants > 1 else "")
        )
    schedule = compute_schedule(cfg, rate=rate)  # jobs sized at this rate, as the workflow will once it is saved
    if cfg.mask is not None:
        schedule = masked_schedule(cfg, schedule, log)
    e = estimate(
        cfg,
        schedule,
        rate=rate,
        rate_source=source,
        threads=threads,
        device=cfg.device,
        out_channels=stored_channels(cfg, net),
        cores_per_node=cores_per_node,
    )
    if source != "--rate":
        save_rate(work, e)
    return e
