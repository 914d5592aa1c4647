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
import itertools
import json
import math
import os

import numpy as np

from .. import load_network
from ..errors import ZnniError
from ..geometry import Halo, TaskGrid
from ..io import atomic_write, open_input, parse_layer_url
from ..io.mips import task_chunks_of
from ..io.workdir import work_path
from .network_file import network_file
from .resolve import JOB_MEM_MB, layout, net_halo, output_scales, stored_channels, task_plan
from .settings import Config, Jobs, parse_config

SCHEDULE_FORMAT = "znni-schedule/5"
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
        return float(json.loads((work_path(cfg) / ESTIMATE_FILE).read_text())["voxels_per_second"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def predicted_rate(cfg: Config, net, lay) -> float | None:
    """Output voxels per second of one single-threaded job, as the time model predicts for the plan
    ``validate`` will make (:func:`task_plan`; the budget of the default 2000 MB job).  The plan
    cache makes ``validate``'s own search a hit; the machine's calibration is made here once when
    absent (it is cached).  None for a ``plan.file`` run (its plan says) or when planning fails
    (``validate`` then reports why)."""
    if cfg.plan.file:
        # lazy: loads numba and scipy only when called
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
    net = load_network(network_file(cfg.network)) if net is None else net
    iu = parse_layer_url(cfg.input.path, endpoint=cfg.input.endpoint_url, what="input.path")
    inp = open_input(iu, cfg.input.mip, resolution=cfg.input.resolution)
    halo = net_halo(net)
    lay = layout(cfg, net, inp, halo, f"input {iu} mip {cfg.input.mip}", slots)
    specs = output_scales(cfg, lay, inp.resolution, stored_channels(cfg, net))
    return inp, lay, TaskGrid(lay.grid, lay.task_chunks, halo, lay.region), specs


def _axis_reads(tasks: TaskGrid, inp, a: int) -> tuple[list, tuple]:
    """Along axis ``a``: per task position ``(first, end)`` input chunk of what its read fetches
    (the voxels it computes, the write box within the region, grown by the halo, clipped to the
    input's bounds, grown to whole chunks; ``(0, 0)`` when it reads nothing there), and the same
    ``(first, end)`` of the region's whole read box."""
    og, ig = tasks.grid, inp.grid
    off, cs = int(og.bounds.offset[a]), int(og.chunk_shape[a])
    ioff, ics, iend = int(ig.bounds.offset[a]), int(ig.chunk_shape[a]), int(ig.bounds.end[a])
    r0, r1 = int(tasks.region.begin[a]), int(tasks.region.end[a])
    lo, hi, tc = int(tasks.lo[a]), int(tasks.hi[a]), int(tasks.task_chunks[a])
    hl, hh = int(tasks.halo.low[a]), int(tasks.halo.high[a])

    def fetched(b: int, e: int) -> tuple[int, int]:
        b, e = max(b, ioff), min(e, iend)  # outside the input: the edge policy, nothing read
        if e <= b:
            return 0, 0
        return (b - ioff) // ics, -(-(e - ioff) // ics)

    per = []
    for t in range(int(tasks.tlo[a]), int(tasks.thi[a])):
        b = max(off + max(t * tc, lo) * cs, r0)
        e = min(off + min((t + 1) * tc, hi) * cs, r1)
        per.append(fetched(b - hl, e + hh))
    return per, fetched(r0 - hl, r1 + hh)


class _Axes:
    """The tasks' fetched chunk ranges per axis (:func:`_axis_reads`) and the input's chunking."""

    def __init__(self, tasks: TaskGrid, inp):
        g = inp.grid
        reads = [_axis_reads(tasks, inp, a) for a in range(3)]
        self.per = [r[0] for r in reads]
        self.whole = [r[1] for r in reads]
        self.chunking = [(int(g.bounds.offset[a]), int(g.chunk_shape[a]), int(g.bounds.end[a])) for a in range(3)]
        # the most chunks one task fetches, and the most two neighbouring tasks share, per axis
        self.own = [max((e - f for f, e in per), default=0) for per in self.per]
        self.shared = [
            max((max(0, p[t][1] - p[t + 1][0]) for t in range(len(p) - 1) if p[t + 1][1] > p[t + 1][0]), default=0)
            for p in self.per
        ]
        self._slabs: dict = {}

    def slabs(self, a: int, b: int) -> list:
        """``(first, end)`` chunks each run of ``b`` consecutive tasks fetches along axis ``a``
        (:func:`_slabs`, computed once)."""
        if (a, b) not in self._slabs:
            self._slabs[a, b] = _slabs(self.per[a], b)
        return self._slabs[a, b]

    def span(self, a: int, b: int) -> int:
        """The most chunks a run of ``b`` consecutive tasks fetches along axis ``a``."""
        return max((e - f for f, e in self.slabs(a, b)), default=0)

    def fetched(self, a: int, b: int) -> int:
        """Voxels along axis ``a`` that runs of ``b`` consecutive tasks fetch, each run once."""
        return sum(self.voxels(a, *r) for r in self.slabs(a, b))

    def voxels(self, a: int, first: int, end: int) -> int:
        """Voxels along axis ``a`` of input chunks ``first..end-1`` (the last one clipped to the bounds)."""
        ioff, ics, iend = self.chunking[a]
        return max(0, min(iend, ioff + end * ics) - (ioff + first * ics))


def _span(runs: list) -> tuple[int, int]:
    """``(first, end)`` chunks of the tasks' ranges ``runs`` (consecutive tasks: ascending)
    together (``(0, 0)``: none)."""
    if runs and runs[0][1] > runs[0][0] and runs[-1][1] > runs[-1][0]:
        return runs[0][0], runs[-1][1]
    runs = [r for r in runs if r[1] > r[0]]  # tasks whose read lies outside the input (edge: zero)
    return (min(r[0] for r in runs), max(r[1] for r in runs)) if runs else (0, 0)


def _slabs(per: list, b: int) -> list[tuple[int, int]]:
    """``(first, end)`` chunks each run of ``b`` consecutive tasks fetches once (a job's cache keeps
    what its tasks share)."""
    return [_span(per[k : k + b]) for k in range(0, len(per), b)]


def _boxes(positions: range, shape) -> list[tuple]:
    """A run of consecutive task positions (C order in a task grid of ``shape``) as at most five
    boxes ``((z0, z1), (y0, y1), (x0, x1))``: a partial row, rows, planes, rows, a partial row."""
    _, ny, nx = (int(v) for v in shape)
    k, end, out = positions.start, positions.stop, []
    while k < end:
        z, y, x = k // (ny * nx), k // nx % ny, k % nx
        if x or end - k < nx:
            e = min(end, k - x + nx)
            out.append(((z, z + 1), (y, y + 1), (x, x + e - k)))
        elif y or end - k < nx * ny:
            rows = min(ny - y, (end - k) // nx)
            out.append(((z, z + 1), (y, y + rows), (0, nx)))
            e = k + rows * nx
        else:
            planes = (end - k) // (nx * ny)
            out.append(((z, z + planes), (0, ny), (0, nx)))
            e = k + planes * nx * ny
        k = e
    return out


def _union_size(axes: _Axes, boxes: list) -> tuple[int, int]:
    """``(voxels, chunks)`` of the union of boxes of input chunks (``((first, end),) * 3``), by
    inclusion and exclusion (a job's runs of tasks are at most five boxes)."""
    vox = chunks = 0
    for r in range(1, len(boxes) + 1):
        sign = 1 if r % 2 else -1
        for group in itertools.combinations(boxes, r):
            inter = [(max(b[a][0] for b in group), min(b[a][1] for b in group)) for a in range(3)]
            if any(e <= f for f, e in inter):
                continue
            vox += sign * math.prod(axes.voxels(a, *inter[a]) for a in range(3))
            chunks += sign * math.prod(e - f for f, e in inter)
    return vox, chunks


#: above this many jobs of consecutive tasks, their shared chunks are not counted (an upper bound)
MAX_COUNTED_JOBS = 10**5


def input_reads(tasks: TaskGrid, inp, jobs: JobMap | None = None) -> dict:
    """What the tasks fetch from the input layer ``inp``: each task the voxels it computes plus the
    halo, clipped to the input's bounds and grown to whole input chunks (what a reader fetches),
    against the unique input of the region (its read box, grown alike).  With ``jobs``, a job
    fetches each chunk its tasks share once (its :class:`~znni_core.io.chunk_cache.ChunkCache`):
    a job of a brick of tasks fetches the box of chunks its tasks read; one of consecutive tasks
    the union of at most five such boxes.  The task grid and the bricks are products of per-axis
    intervals, so the totals are products of per-axis sums (10^7 tasks cost nothing).
    ``voxels`` and ``chunks`` (object reads: one request each, ranged reads in a shard) fetched;
    ``amplification`` = voxels / unique voxels; ``voxel_bytes`` of every channel of a voxel.
    A graph network's task reads its window's patches, which reach past the halo by up to a
    patch's overlap: counted here as the halo."""
    voxel_bytes = int(inp.channels) * np.dtype(inp.dtype).itemsize
    out = {"voxels": 0, "chunks": 0, "unique_voxels": 0, "unique_chunks": 0, "amplification": 1.0}
    if len(tasks) == 0:
        return out | {"voxel_bytes": voxel_bytes}
    axes = _Axes(tasks, inp)
    unique = math.prod(axes.voxels(a, *axes.whole[a]) for a in range(3))
    unique_chunks = math.prod(e - f for f, e in axes.whole)
    brick = jobs.brick if jobs is not None else None
    counted = jobs is not None and not brick and jobs.per_job > 1 and jobs.num_jobs <= MAX_COUNTED_JOBS
    if counted:
        total = chunks = 0
        for j in range(jobs.num_jobs):
            boxes = []
            for box in _boxes(jobs.positions(j), tasks.shape):
                iv = [_span(axes.per[a][box[a][0] : box[a][1]]) for a in range(3)]
                if all(e > f for f, e in iv):
                    boxes.append(iv)
            v, c = _union_size(axes, boxes)
            total, chunks = total + v, chunks + c
    else:  # each task alone (runs of one), or bricks: products of per-axis sums
        runs = [axes.slabs(a, int(brick[a]) if brick else 1) for a in range(3)]
        total = math.prod(sum(axes.voxels(a, *r) for r in runs[a]) for a in range(3))
        chunks = math.prod(sum(e - f for f, e in runs[a]) for a in range(3))
    out.update(voxels=total, chunks=chunks, unique_voxels=unique, unique_chunks=unique_chunks)
    out["amplification"] = total / unique if unique else 1.0
    if brick:
        out["jobs"] = f"a job's {'x'.join(map(str, brick))} tasks share"
    elif counted:
        out["jobs"] = "a job's consecutive tasks share"
    elif jobs is not None and jobs.per_job > 1:
        out["jobs"] = "each task alone (too many jobs to count what they share)"
    else:
        out["jobs"] = "each task alone"
    return out | {"voxel_bytes": voxel_bytes}


def cache_chunks(axes: _Axes, brick) -> int:
    """The most input chunks a job of ``brick`` tasks (run in C order) holds for its later tasks at
    once: the chunks the next z-layer of tasks shares with the layer done (a plane across the
    brick), those the next row shares with the row done, those the next task shares with the last,
    and the current task's own."""
    span = [axes.span(a, int(brick[a])) for a in range(3)]
    own = axes.own
    shared = [axes.shared[a] if int(brick[a]) > 1 else 0 for a in range(3)]
    return (
        shared[0] * span[1] * span[2]
        + shared[1] * own[0] * span[2]
        + shared[2] * own[0] * own[1]
        + own[0] * own[1] * own[2]
    )


def choose_jobs(tasks: TaskGrid, inp, per_job: int, max_jobs: int, cache_bytes: int, slots: int | None = None):
    """``(JobMap, reads)``: runs of ``per_job`` consecutive tasks, or the box of tasks (a brick)
    that fetches the fewest input bytes when it fetches less than those runs: its jobs of at most
    ``per_job`` tasks (a quarter more where that reads less), at most ``max_jobs`` of them and at
    least ``slots`` (jobs at once), its cache of shared chunks within ``cache_bytes``
    (:func:`cache_chunks`).  ``cache_bytes`` 0: no cache, each task fetches its own."""
    shape = tuple(int(v) for v in tasks.shape)
    runs = JobMap(per_job, len(tasks), None, shape)
    if cache_bytes <= 0:
        return runs, input_reads(tasks, inp)
    base = input_reads(tasks, inp, runs)
    n = len(tasks)
    if per_job <= 1 or n <= 1:
        return runs, base
    item = int(inp.channels) * np.dtype(inp.dtype).itemsize
    chunk_bytes = int(np.prod([int(c) for c in inp.grid.chunk_shape])) * item
    cap = max(1, int(per_job * 1.25))
    axes = _Axes(tasks, inp)
    best = None
    for bz in range(1, min(shape[0], cap) + 1):
        for by in range(1, min(shape[1], cap // bz) + 1):
            bx = min(shape[2], cap // (bz * by))
            jobs = math.ceil(shape[0] / bz) * math.ceil(shape[1] / by) * math.ceil(shape[2] / bx)
            if jobs > max_jobs or (slots and jobs < min(slots, n)):
                continue
            vox = axes.fetched(0, bz) * axes.fetched(1, by) * axes.fetched(2, bx)
            key = (vox, -(bz * by * bx))
            if best is not None and key >= best[0]:
                continue
            if cache_chunks(axes, (bz, by, bx)) * chunk_bytes > cache_bytes:
                continue
            best = (key, (bz, by, bx))
    if best is None or best[0][0] >= base["voxels"]:
        return runs, base
    bricks = JobMap(per_job, n, best[1], shape)
    return bricks, input_reads(tasks, inp, bricks)


def compute_schedule(cfg: dict | Config, *, slots: int | None = None, rate: float | None = None) -> dict:
    """The run's tasks and jobs from the config, the network's halo and the input's bounds.

    ``slots``: jobs Snakemake runs at once; ``rate``: output voxels/s of one job, else measured
    (``jobs.voxels_per_second``, ``znni estimate``) or, last, the time model's prediction."""
    cfg = parse_config(cfg)
    net = load_network(network_file(cfg.network))
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
    cache = cfg.jobs.cache_bytes
    shape = tuple(int(v) for v in tasks.shape)
    jobs = JobMap(per, len(tasks), None, shape)
    if cfg.jobs.tasks_per_job == "auto":
        jobs, reads = choose_jobs(tasks, inp, per, cfg.jobs.max_jobs, cache, slots)
    else:
        reads = input_reads(tasks, inp, jobs if cache else None)
    brick = jobs.brick
    if brick:
        per = jobs.per_job
        why += f"; a job is a box of {'x'.join(map(str, brick))} tasks (z, y, x): it fetches the input they share once"
    return {
        "format": SCHEDULE_FORMAT,
        "num_tasks": len(tasks),
        "tasks_per_job": per,
        "brick": list(jobs.brick) if brick else None,
        "task_grid": list(jobs.shape),
        "slots": slots,
        "num_jobs": jobs.num_jobs,
        "why": why,
        "task_voxels": int(task_voxels),
        "task_chunks": list(lay.task_chunks),
        "task_box": list(lay.box),
        "num_chunks": lay.grid.num_chunks,
        "sharded": lay.sharding is not None,
        "shard_bytes": int(lay.shard_bytes),
        "note": lay.note,
        "region_voxels": int(lay.region.shape.prod()),
        "input_reads": reads,
        "pyramid": pyramid_schedule(dataclasses.replace(cfg, task_chunks=list(lay.box)), specs),
    }


def schedule_key(cfg: Config) -> dict:
    """What the schedule depends on: the config and the network file (size, mtime).  Kept in
    clear (not hashed), so a moved work directory whose paths were rewritten still matches."""
    try:
        st = os.stat(cfg.network.path)  # a network in storage: its URL (the key's config has it)
        net = [st.st_size, st.st_mtime_ns]
    except OSError:
        net = None
    return json.loads(json.dumps({"config": cfg.to_dict(), "network_file": net}, sort_keys=True, default=str))


def workflow_schedule(cfg: dict | Config, slots: int | None = None, *, job: bool = False) -> dict:
    """The schedule, cached in ``<work_dir>/schedule.json`` (computed again when the config or the
    network changes, not when ``slots`` does: a resume with another ``--jobs`` keeps the job
    ranges its markers name).  ``job``: for a job of the workflow (Snakemake parsing it again
    where the job runs, perhaps another machine, with other slots and the network file at another
    mtime): the schedule the workflow made, whatever the key.  Never raises for a bad run:
    ``{"error": message}`` instead, so that the workflow's ``validate`` job reports it with its log."""
    try:
        cfg = parse_config(cfg)
        key = schedule_key(cfg)
        path = work_path(cfg) / "schedule.json"
        try:
            s = json.loads(path.read_text())
            if s.get("format") == SCHEDULE_FORMAT and (job or s.get("key") == key):
                return s
            why = "was made by another version of znni"
        except (OSError, ValueError) as exc:
            why = f"cannot be read ({exc})"
        if job:  # never another schedule than the one the workflow's jobs were made from
            return {"error": f"{path} {why}; the workflow writes it when it starts: run it again"}
        s = compute_schedule(cfg, slots=slots) | {"key": key}
        atomic_write(path, (json.dumps(s, indent=1, sort_keys=True) + "\n").encode())
        return s
    except (ZnniError, OSError, ValueError) as exc:
        return {"error": str(exc)}


def job_range(job: int, per_job: int, num_tasks: int) -> range:
    """Positions (in the TaskGrid) of the tasks of ``job``."""
    return range(job * per_job, min((job + 1) * per_job, num_tasks))


@dataclasses.dataclass(frozen=True)
class JobMap:
    """Which tasks each job runs: runs of ``per_job`` consecutive positions of the task grid, or
    with ``brick`` (tasks per axis) the boxes of ``brick`` tasks of the task grid ``shape`` (jobs
    and the tasks in a job in C order), so that a job's tasks share their halos' input chunks.

    >>> m = JobMap(4, 12, (1, 2, 2), (1, 3, 4))
    >>> m.num_jobs, list(m.positions(0)), list(m.positions(2)), list(m.positions(3))
    (4, [0, 1, 4, 5], [8, 9], [10, 11])
    >>> JobMap(5, 12).num_jobs, list(JobMap(5, 12).positions(2))
    (3, [10, 11])
    """

    per_job: int
    num_tasks: int
    brick: tuple | None = None
    shape: tuple | None = None

    def __post_init__(self):
        if self.brick:
            brick = tuple(min(int(b), int(s)) for b, s in zip(self.brick, self.shape))
            object.__setattr__(self, "brick", brick)
            object.__setattr__(self, "per_job", math.prod(brick))

    @property
    def grid(self) -> tuple:
        """Jobs per axis (bricks)."""
        return tuple(-(-int(s) // b) for s, b in zip(self.shape, self.brick))

    @property
    def num_jobs(self) -> int:
        """How many jobs (bricks, or runs of ``per_job``)."""
        if self.brick:
            return math.prod(self.grid) if self.num_tasks else 0
        return math.ceil(self.num_tasks / self.per_job) if self.num_tasks else 0

    def positions(self, job: int):
        """The task grid positions of ``job``'s tasks, in the order it runs them."""
        if not self.brick:
            return job_range(job, self.per_job, self.num_tasks)
        if not 0 <= job < self.num_jobs:
            return range(0)
        gy, gx = self.grid[1], self.grid[2]
        j = (job // (gy * gx), job // gx % gy, job % gx)
        lo = [j[a] * self.brick[a] for a in range(3)]
        hi = [min(lo[a] + self.brick[a], self.shape[a]) for a in range(3)]
        sy, sx = self.shape[1], self.shape[2]
        return [
            (z * sy + y) * sx + x for z in range(lo[0], hi[0]) for y in range(lo[1], hi[1]) for x in range(lo[2], hi[2])
        ]


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
