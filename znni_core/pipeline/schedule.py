"""The schedule: how many tasks a run has and how many each job runs, from the config alone.

::

    tasks (TaskGrid, C order)   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
    jobs  (tasks_per_job = 4)      0    |    1    |     2     |   3

The schedule depends only on the config, the network's halo and the input's bounds, so the
workflow computes it when it is parsed (no checkpoint) and caches it in
``<work_dir>/schedule.json``: a resume, or a SLURM job parsing the workflow, reads the file
instead of opening the network, and the job ranges never move under a run.

Jobs are sized by ``jobs.tasks_per_job`` (an integer), or, with ``auto``, so that a job computes
for about ``jobs.minutes`` at the measured rate (``jobs.voxels_per_second``, else the rate that
``znni estimate`` measured and stored in the work directory), and never more than
``jobs.max_jobs`` jobs: the DAG Snakemake builds stays small (about 1.3 ms and 18 KB per job).
The pyramid's mips are scheduled alike (:func:`pyramid_schedule`).  Running the jobs is
:mod:`.jobs`; building the pyramid, :mod:`.pyramid`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from ..errors import ZnniError
from ..geometry import Halo, TaskGrid
from ..io import atomic_write
from ..io.mips import task_chunks_of
from .settings import Config, Jobs, parse_config

SCHEDULE_FORMAT = "znni-schedule/4"
ESTIMATE_FILE = "estimate.json"
# source voxels a pyramid job reads, averages, writes and reads back per second and thread
# (about 2-4 x 10^7 on a 2-core machine, raw file:// layers): sizes its jobs
PYRAMID_VOXELS_PER_S = 2e7


def tasks_per_job(
    num_tasks: int, task_voxels: int, jobs: Jobs, rate: float | None, slots: int | None = None
) -> tuple[int, str]:
    """(tasks per job, why) for ``num_tasks`` tasks of up to ``task_voxels`` output voxels.

    ``auto``: about ``jobs.minutes`` of compute at ``rate`` (output voxels/s of one job), never
    more than ``jobs.max_jobs`` jobs, and at least ``slots`` jobs (the jobs Snakemake runs at
    once) when there are that many tasks: a small volume keeps every core busy instead of
    running as one long job.

    >>> tasks_per_job(1000, 10**6, Jobs("auto", 30, 100, None), None)
    (10, 'at most jobs.max_jobs=100 jobs')
    >>> tasks_per_job(1000, 10**6, Jobs("auto", 30, 100, None), 10**5)
    (180, '~30 min per job at 100,000 voxels/s')
    >>> tasks_per_job(8, 10**5, Jobs("auto", 30, 100, None), 10**5, slots=2)
    (4, '2 jobs at once: 4 tasks each (~4 s at 100,000 voxels/s)')
    >>> tasks_per_job(10, 10**6, Jobs(4, 30, 100, None), None)
    (4, 'jobs.tasks_per_job')
    >>> tasks_per_job(2, 10**6, Jobs("auto", 30, 100, None), None, slots=2)
    (1, '2 task(s), 2 jobs at once: a job each')
    """
    n = max(num_tasks, 1)
    if jobs.tasks_per_job != "auto":
        return min(int(jobs.tasks_per_job), n), "jobs.tasks_per_job"
    if slots and n <= slots:
        return 1, f"{n} task(s), {slots} jobs at once: a job each"
    floor = math.ceil(n / jobs.max_jobs)
    if not rate:
        return min(floor, n), f"at most jobs.max_jobs={jobs.max_jobs} jobs"
    per = max(1, round(jobs.minutes * 60 * rate / max(task_voxels, 1)))
    why = f"~{jobs.minutes:g} min per job at {rate:,.0f} voxels/s"
    if slots and slots > 1 and math.ceil(n / slots) < per:
        per = math.ceil(n / slots)
        why = f"{slots} jobs at once: {per} tasks each (~{per * task_voxels / rate:.0f} s at {rate:,.0f} voxels/s)"
    if per < floor:
        per, why = floor, f"at most jobs.max_jobs={jobs.max_jobs} jobs"
    return min(per, n), why


def measured_rate(cfg: Config) -> float | None:
    """Output voxels per second of one job: ``jobs.voxels_per_second``, else ``znni estimate``'s."""
    if cfg.jobs.voxels_per_second:
        return float(cfg.jobs.voxels_per_second)
    try:
        return float(json.loads((Path(cfg.work_dir) / ESTIMATE_FILE).read_text())["voxels_per_second"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def predicted_rate(cfg: Config, net, lay) -> float | None:
    """Output voxels per second of one single-threaded job, as the time model predicts for the plan
    ``validate`` will make (:func:`task_plan`; the budget of the default 2000 MB job).  The plan
    cache makes ``validate``'s own search a hit; the machine's calibration is made here once when
    absent (it is cached).  None for a ``plan.file`` run (its plan says) or when planning fails
    (``validate`` then reports why)."""
    from .resolve import JOB_MEM_MB, task_plan

    if cfg.plan.file:
        from ..plan.plan import Plan

        try:
            return Plan.load(cfg.plan.file).predicted_voxels_per_s
        except (ZnniError, OSError, ValueError):
            return None
    task_shape = (lay.task_chunks * lay.grid.chunk_shape).min(lay.region.shape)
    budget = None if cfg.device != "cpu" else int(JOB_MEM_MB * 2**20 * cfg.plan.memory_fraction)
    try:
        from .task import tta_variants  # each test-time augmentation variant is a full pass

        plan = task_plan(net, cfg, budget, 1, task_shape, lay.region)
        return plan.predicted_voxels_per_s / len(tta_variants(cfg.tta))
    except ZnniError:
        return None


def task_geometry(cfg: Config, net=None, slots: int | None = None):
    """``(input layer, Layout, TaskGrid, output scales)`` of a validated config, without a plan
    (``net``: the loaded network, else it is loaded from the config; ``slots``: jobs at once,
    for ``task_chunks: auto``)."""
    from .. import load_network
    from ..io import open_input, parse_layer_url
    from .resolve import layout, net_halo, output_scales, stored_channels

    net = load_network(Path(cfg.network.path)) if net is None else net
    iu = parse_layer_url(cfg.input.path, endpoint=cfg.input.endpoint_url, what="input.path")
    inp = open_input(iu, cfg.input.mip, resolution=cfg.input.resolution)
    halo = net_halo(net)
    lay = layout(cfg, net, inp, halo, f"input {iu} mip {cfg.input.mip}", slots)
    specs = output_scales(cfg, lay, inp.resolution, stored_channels(cfg, net))
    return inp, lay, TaskGrid(lay.grid, lay.task_chunks, halo, lay.region), specs


def input_reads(tasks: TaskGrid, inp) -> dict:
    """What the tasks read from the input layer ``inp``: each task its write box plus the
    halo, clipped to the input's bounds and grown to whole input chunks (what a reader fetches),
    against the unique input of the region (its read box, grown alike).  The task grid is a
    product of per-axis intervals, so the totals are products of per-axis sums (10^7 tasks cost
    nothing).  ``voxels`` and ``chunks`` (object reads: one request each, ranged reads in a
    shard) summed over the tasks; ``amplification`` = voxels / unique voxels; ``voxel_bytes`` of
    every channel of a voxel.  A graph network's task reads its window's patches, which reach
    past the halo by up to a patch's overlap."""
    voxel_bytes = int(inp.channels) * np.dtype(inp.dtype).itemsize
    if len(tasks) == 0:
        return {"voxels": 0, "chunks": 0, "unique_voxels": 0, "unique_chunks": 0, "amplification": 1.0} | {
            "voxel_bytes": voxel_bytes
        }
    og, ig = tasks.grid, inp.grid
    total, chunks, unique, unique_chunks = 1, 1, 1, 1
    for a in range(3):
        off, cs, end = int(og.bounds.offset[a]), int(og.chunk_shape[a]), int(og.bounds.end[a])
        ioff, ics, iend = int(ig.bounds.offset[a]), int(ig.chunk_shape[a]), int(ig.bounds.end[a])
        lo, hi, tc = int(tasks.lo[a]), int(tasks.hi[a]), int(tasks.task_chunks[a])
        hl, hh = int(tasks.halo.low[a]), int(tasks.halo.high[a])

        def fetched(b: int, e: int) -> tuple[int, int]:
            b, e = max(b, ioff), min(e, iend)  # outside the input: the edge policy, nothing read
            if e <= b:
                return 0, 0
            i0, i1 = (b - ioff) // ics, -(-(e - ioff) // ics)
            return min(iend, ioff + i1 * ics) - (ioff + i0 * ics), i1 - i0

        s_vox = s_chunks = 0
        first = last = None
        for t in range(int(tasks.tlo[a]), int(tasks.thi[a])):
            b = off + max(t * tc, lo) * cs
            e = min(off + min((t + 1) * tc, hi) * cs, end)
            v, c = fetched(b - hl, e + hh)
            s_vox, s_chunks = s_vox + v, s_chunks + c
            first = b - hl if first is None else first
            last = e + hh
        v, c = fetched(first, last)
        total, chunks, unique, unique_chunks = total * s_vox, chunks * s_chunks, unique * v, unique_chunks * c
    return {
        "voxels": total,
        "chunks": chunks,
        "unique_voxels": unique,
        "unique_chunks": unique_chunks,
        "amplification": total / unique if unique else 1.0,
        "voxel_bytes": voxel_bytes,
    }


def compute_schedule(cfg: dict | Config, *, slots: int | None = None, rate: float | None = None) -> dict:
    """The run's tasks and jobs from the config, the network's halo and the input's bounds.

    ``slots``: jobs Snakemake runs at once; ``rate``: output voxels/s of one job, else measured
    (``jobs.voxels_per_second``, ``znni estimate``) or, last, the time model's prediction."""
    from .. import load_network

    cfg = parse_config(cfg)
    net = load_network(Path(cfg.network.path))
    inp, lay, tasks, specs = task_geometry(cfg, net, slots=slots)
    task_voxels = (lay.task_chunks * lay.grid.chunk_shape).min(lay.bounds.shape).prod()
    source = "given"
    if rate is None:
        rate, source = measured_rate(cfg), "measured"
    # no more tasks than jobs at once: a job each whatever the rate, so no plan here (it imported
    # the engine and planned in Snakemake's process: 0.76 s of a 15 x 512^2 run's parse)
    if rate is None and cfg.jobs.tasks_per_job == "auto" and not (slots and len(tasks) <= slots):
        rate, source = predicted_rate(cfg, net, lay), "predicted by the plan's time model"
    per, why = tasks_per_job(len(tasks), task_voxels, cfg.jobs, rate, slots)
    if rate and cfg.jobs.tasks_per_job == "auto":
        why += f" ({source})"
    return {
        "format": SCHEDULE_FORMAT,
        "num_tasks": len(tasks),
        "tasks_per_job": per,
        "slots": slots,
        "num_jobs": math.ceil(len(tasks) / per),
        "why": why,
        "task_voxels": int(task_voxels),
        "task_chunks": list(lay.task_chunks),
        "task_box": list(lay.box),
        "num_chunks": lay.grid.num_chunks,
        "sharded": lay.sharding is not None,
        "shard_bytes": int(lay.shard_bytes),
        "note": lay.note,
        "region_voxels": int(lay.region.shape.prod()),
        "input_reads": input_reads(tasks, inp),
        "pyramid": pyramid_schedule(dataclasses.replace(cfg, task_chunks=list(lay.box)), specs),
    }


def schedule_key(cfg: Config) -> dict:
    """What the schedule depends on: the config and the network file (size, mtime).  Kept in
    clear (not hashed), so a moved work directory whose paths were rewritten still matches."""
    try:
        st = os.stat(cfg.network.path)
        net = [st.st_size, st.st_mtime_ns]
    except OSError:
        net = None
    return json.loads(json.dumps({"config": cfg.to_dict(), "network_file": net}, sort_keys=True, default=str))


def workflow_schedule(cfg: dict | Config, slots: int | None = None) -> dict:
    """The schedule, cached in ``<work_dir>/schedule.json`` (computed again when the config or the
    network changes, not when ``slots`` does: a resume with another ``--jobs`` keeps the job
    ranges its markers name).  Never raises for a bad run: ``{"error": message}`` instead, so
    that the workflow's ``validate`` job reports it with its log."""
    try:
        cfg = parse_config(cfg)
        key = schedule_key(cfg)
        path = Path(cfg.work_dir) / "schedule.json"
        try:
            s = json.loads(path.read_text())
            if s.get("format") == SCHEDULE_FORMAT and s.get("key") == key:
                return s
        except (OSError, ValueError):
            pass
        s = compute_schedule(cfg, slots=slots) | {"key": key}
        atomic_write(path, (json.dumps(s, indent=1, sort_keys=True) + "\n").encode())
        return s
    except (ZnniError, OSError, ValueError) as exc:
        return {"error": str(exc)}


def job_range(job: int, per_job: int, num_tasks: int) -> range:
    """Positions (in the TaskGrid) of the tasks of ``job``."""
    return range(job * per_job, min((job + 1) * per_job, num_tasks))


def mip_tasks(spec, task_chunks) -> TaskGrid:
    """The tasks of one mip: its shards (or boxes of ``task_chunks`` chunks), covering its bounds."""
    zero = Halo((0, 0, 0), (0, 0, 0))
    return TaskGrid(spec.grid, task_chunks_of(spec, task_chunks), zero, spec.bounds)


def pyramid_schedule(cfg: Config, specs) -> list[dict]:
    """Per mip 1..N: its tasks and how many a job runs (``jobs.tasks_per_job``, or ``auto`` at
    :data:`PYRAMID_VOXELS_PER_S`)."""
    out = []
    for k, spec in enumerate(specs[1:], start=1):
        tasks = mip_tasks(spec, cfg.task_chunks)
        box = (tasks.task_chunks * spec.chunk_shape).min(spec.bounds.shape)
        source = int(box.prod()) * int(np.prod(cfg.downsample.factor))
        per, why = tasks_per_job(len(tasks), source, cfg.jobs, PYRAMID_VOXELS_PER_S)
        out.append(
            {
                "mip": k,
                "num_tasks": len(tasks),
                "tasks_per_job": per,
                "num_jobs": math.ceil(len(tasks) / per),
                "why": why,
                "objects": len(tasks) if spec.sharding else spec.grid.num_chunks,
            }
        )
    return out
