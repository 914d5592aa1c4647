"""Jobs: the second level of work.  A Snakemake job runs a contiguous range of tasks.

::

    tasks (TaskGrid, C order)   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
    jobs  (tasks_per_job = 4)      0    |    1    |     2     |   3

The schedule (how many tasks, how many per job) depends only on the config, the network's halo
and the input's bounds, so the workflow computes it when it is parsed (no checkpoint) and caches
it in ``<work_dir>/schedule.json``: a resume, or a SLURM job parsing the workflow, reads the file
instead of opening the network, and the job ranges never move under a run.

Jobs are sized by ``jobs.tasks_per_job`` (an integer), or, with ``auto``, so that a job computes
for about ``jobs.minutes`` at the measured rate (``jobs.voxels_per_second``, else the rate that
``znni estimate`` measured and stored in the work directory), and never more than
``jobs.max_jobs`` jobs: the DAG Snakemake builds stays small (about 1.3 ms and 18 KB per job).

A job writes each task's chunks and manifest as a task always did; its own marker
``<work_dir>/jobs/NNNNNN.json`` comes last.  A task whose manifest and stored objects check out
(``finalize.verify``) is skipped, so a killed or retried job redoes only its unfinished tasks.
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError, DataError, ZnniError
from ..io import atomic_write

SCHEDULE_FORMAT = "znni-schedule/3"
JOB_FORMAT = "znni-job/1"
ESTIMATE_FILE = "estimate.json"


def tasks_per_job(num_tasks: int, task_voxels: int, jobs: dict, rate: float | None,
                  slots: int | None = None) -> tuple[int, str]:
    """(tasks per job, why) for ``num_tasks`` tasks of up to ``task_voxels`` output voxels.

    ``auto``: about ``jobs.minutes`` of compute at ``rate`` (output voxels/s of one job), never
    more than ``jobs.max_jobs`` jobs, and at least ``slots`` jobs (the jobs Snakemake runs at
    once) when there are that many tasks: a small volume keeps every core busy instead of
    running as one long job.

    >>> tasks_per_job(1000, 10**6, {"tasks_per_job": "auto", "minutes": 30, "max_jobs": 100}, None)
    (10, 'at most jobs.max_jobs=100 jobs')
    >>> tasks_per_job(1000, 10**6, {"tasks_per_job": "auto", "minutes": 30, "max_jobs": 100}, 10**5)
    (180, '~30 min per job at 100,000 voxels/s')
    >>> tasks_per_job(8, 10**5, {"tasks_per_job": "auto", "minutes": 30, "max_jobs": 100}, 10**5, slots=2)
    (4, '2 jobs at once: 4 tasks each (~4 s at 100,000 voxels/s)')
    >>> tasks_per_job(10, 10**6, {"tasks_per_job": 4, "minutes": 30, "max_jobs": 100}, None)
    (4, 'jobs.tasks_per_job')
    >>> tasks_per_job(2, 10**6, {"tasks_per_job": "auto", "minutes": 30, "max_jobs": 100}, None, slots=2)
    (1, '2 task(s), 2 jobs at once: a job each')
    """
    n = max(num_tasks, 1)
    if jobs["tasks_per_job"] != "auto":
        return min(int(jobs["tasks_per_job"]), n), "jobs.tasks_per_job"
    if slots and n <= slots:
        return 1, f"{n} task(s), {slots} jobs at once: a job each"
    floor = math.ceil(n / jobs["max_jobs"])
    if not rate:
        return min(floor, n), f"at most jobs.max_jobs={jobs['max_jobs']} jobs"
    per = max(1, round(jobs["minutes"] * 60 * rate / max(task_voxels, 1)))
    why = f"~{jobs['minutes']:g} min per job at {rate:,.0f} voxels/s"
    if slots and slots > 1 and math.ceil(n / slots) < per:
        per = math.ceil(n / slots)
        why = f"{slots} jobs at once: {per} tasks each (~{per * task_voxels / rate:.0f} s at {rate:,.0f} voxels/s)"
    if per < floor:
        per, why = floor, f"at most jobs.max_jobs={jobs['max_jobs']} jobs"
    return min(per, n), why


def measured_rate(cfg: dict) -> float | None:
    """Output voxels per second of one job: ``jobs.voxels_per_second``, else ``znni estimate``'s."""
    if cfg["jobs"]["voxels_per_second"]:
        return float(cfg["jobs"]["voxels_per_second"])
    try:
        return float(json.loads((Path(cfg["work_dir"]) / ESTIMATE_FILE).read_text())["voxels_per_second"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def predicted_rate(cfg: dict, net, lay) -> float | None:
    """Output voxels per second of one single-threaded job, as the time model predicts for the plan
    ``validate`` will make (:func:`task_plan`; the budget of the default 2000 MB job).  The plan
    cache makes ``validate``'s own search a hit; the machine's calibration is made here once when
    absent (it is cached).  None for a ``plan.file`` run (its plan says) or when planning fails
    (``validate`` then reports why)."""
    from .config import JOB_MEM_MB, task_plan

    if cfg["plan"]["file"]:
        from ..plan.plan import Plan

        try:
            return Plan.load(cfg["plan"]["file"]).predicted_voxels_per_s
        except (ZnniError, OSError, ValueError):
            return None
    task_shape = (lay.task_chunks * lay.grid.chunk_shape).min(lay.region.shape)
    budget = None if cfg["device"] != "cpu" else int(JOB_MEM_MB * 2 ** 20 * cfg["plan"]["memory_fraction"])
    try:
        return task_plan(net, cfg, budget, 1, task_shape, lay.region).predicted_voxels_per_s
    except ZnniError:
        return None


def task_geometry(cfg: dict, net=None, slots: int | None = None):
    """``(input layer, Layout, TaskGrid, output scales)`` of a validated config, without a plan
    (``net``: the loaded network, else it is loaded from the config; ``slots``: jobs at once,
    for ``task_chunks: auto``)."""
    from .. import load_network
    from ..geometry import TaskGrid
    from ..io import open_input, parse_layer_url
    from .config import layout, net_halo, output_scales

    net = load_network(Path(cfg["network"]["path"])) if net is None else net
    iu = parse_layer_url(cfg["input"]["path"], endpoint=cfg["input"]["endpoint_url"], what="input.path")
    inp = open_input(iu, cfg["input"]["mip"], resolution=cfg["input"]["resolution"])
    halo = net_halo(net)
    lay = layout(cfg, net, inp, halo, f"input {iu} mip {cfg['input']['mip']}", slots)
    specs = output_scales(cfg, lay, inp.resolution, net.out_channels)
    return inp, lay, TaskGrid(lay.grid, lay.task_chunks, halo, lay.region), specs


def compute_schedule(cfg: dict, *, slots: int | None = None, rate: float | None = None) -> dict:
    """The run's tasks and jobs from the config, the network's halo and the input's bounds.

    ``slots``: jobs Snakemake runs at once; ``rate``: output voxels/s of one job, else measured
    (``jobs.voxels_per_second``, ``znni estimate``) or, last, the time model's prediction."""
    from .. import load_network
    from .config import validate_config
    from .pyramid import pyramid_schedule

    cfg = validate_config(cfg)
    net = load_network(Path(cfg["network"]["path"]))
    _, lay, tasks, specs = task_geometry(cfg, net, slots=slots)
    task_voxels = (lay.task_chunks * lay.grid.chunk_shape).min(lay.bounds.shape).prod()
    source = "given"
    if rate is None:
        rate, source = measured_rate(cfg), "measured"
    # no more tasks than jobs at once: a job each whatever the rate, so no plan here (it imported
    # the engine and planned in Snakemake's process: 0.76 s of a 15 x 512^2 run's parse)
    if rate is None and cfg["jobs"]["tasks_per_job"] == "auto" and not (slots and len(tasks) <= slots):
        rate, source = predicted_rate(cfg, net, lay), "predicted by the plan's time model"
    per, why = tasks_per_job(len(tasks), task_voxels, cfg["jobs"], rate, slots)
    if rate and cfg["jobs"]["tasks_per_job"] == "auto":
        why += f" ({source})"
    return {"format": SCHEDULE_FORMAT, "num_tasks": len(tasks), "tasks_per_job": per, "slots": slots,
            "num_jobs": math.ceil(len(tasks) / per), "why": why, "task_voxels": int(task_voxels),
            "task_chunks": list(lay.task_chunks), "task_box": list(lay.box), "num_chunks": lay.grid.num_chunks,
            "sharded": lay.sharding is not None, "region_voxels": int(lay.region.shape.prod()),
            "pyramid": pyramid_schedule(cfg | {"task_chunks": list(lay.box)}, specs)}


def schedule_key(cfg: dict) -> dict:
    """What the schedule depends on: the config and the network file (size, mtime).  Kept in
    clear (not hashed), so a moved work directory whose paths were rewritten still matches."""
    try:
        st = os.stat(cfg["network"]["path"])
        net = [st.st_size, st.st_mtime_ns]
    except OSError:
        net = None
    return json.loads(json.dumps({"config": cfg, "network_file": net}, sort_keys=True, default=str))


def workflow_schedule(cfg: dict, slots: int | None = None) -> dict:
    """The schedule, cached in ``<work_dir>/schedule.json`` (computed again when the config or the
    network changes, not when ``slots`` does: a resume with another ``--jobs`` keeps the job
    ranges its markers name).  Never raises for a bad run: ``{"error": message}`` instead, so
    that the workflow's ``validate`` job reports it with its log."""
    from .config import validate_config

    try:
        cfg = validate_config(cfg)
        key = schedule_key(cfg)
        path = Path(cfg["work_dir"]) / "schedule.json"
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


def job_marker_path(work, job: int) -> Path:
    return Path(work) / "jobs" / f"{job:06d}.json"


def run_job(run_file, job: int, per_job: int, num_tasks: int | None = None, *, marker=None, device=None,
            tasks_file=None, log=print, overlap: bool = True) -> dict:
    """Run the tasks of ``job``; skip those already done and verified; write the job's marker last.

    ``tasks_file``: a run with a mask batches only its live tasks (``mask_tasks.json``).  A task
    that fails is logged and the others still run; the job then fails naming them (no marker), so
    a retry runs only what is left.  ``overlap``: read the next task's input and store the last
    task's output while the engine computes (:func:`run_pipelined`); off when the job's memory
    holds one task's buffers only.
    """
    from .finalize import check_task
    from .mask import load_mask_tasks, positions
    from .task import manifest_path, open_run

    t0 = time.perf_counter()
    ctx = open_run(run_file)
    run = ctx.run
    if tasks_file is not None or run.get("mask"):
        order = positions(load_mask_tasks(run, tasks_file))
    else:
        order = range(len(ctx.tasks))
    n = len(order)
    if num_tasks is not None and n != num_tasks:
        raise ConfigError(f"the workflow was scheduled for {num_tasks} tasks but {run_file} has {n}: the schedule is "
                          f"stale; delete {Path(run['work_dir']) / 'schedule.json'} and run the workflow again")
    ks = [order[i] for i in job_range(job, per_job, n)]
    if job < 0 or not ks:
        raise ConfigError(f"job {job} has no task: {n} tasks at {per_job} per job make "
                          f"{math.ceil(n / per_job)} jobs (0 to {math.ceil(n / per_job) - 1})")
    verify = run["config"]["finalize"]["verify"]

    def done(block):
        return manifest_path(run, block.id).is_file() and bool(check_task(run, ctx.out, block, verify))

    todo, skipped = pending_blocks([ctx.tasks[k] for k in ks], done, log)
    ran, failed = run_pipelined(ctx, todo, device=device, log=log, overlap=overlap)
    raise_failed(failed, len(ks), f"job {job}")
    doc = {"format": JOB_FORMAT, "job": job, "run_digest": run["digest"], "tasks": [ctx.tasks[k].id for k in ks],
           "ran": ran, "skipped": skipped, "seconds": round(time.perf_counter() - t0, 3), "finished": time.time(),
           "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    path = Path(marker) if marker else job_marker_path(run["work_dir"], job)
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    vox = sum(r["voxels"] for r in ran)
    log(f"job {job}: {len(ran)} task(s) run, {len(skipped)} skipped (already done), {vox:,} voxels in "
        f"{doc['seconds']:.1f} s -> {path}")
    return doc


def pending_blocks(blocks, check, log=print) -> tuple[list, list]:
    """``(blocks to run, ids skipped)``: a block is skipped when ``check(block)`` is true (its
    manifest and stored objects verify); false: no manifest; DataError: a manifest that does not
    check out (run again)."""
    todo, skipped = [], []
    for block in blocks:
        try:
            if check(block):
                skipped.append(block.id)
                log(f"task {block.id}: done and verified, skipped")
                continue
        except DataError as exc:
            log(f"task {block.id}: {exc}; running it again")
        todo.append(block)
    return todo, skipped


def raise_failed(failed: dict, n: int, what: str) -> None:
    """DataError naming the failed tasks (the others are done: a retry runs only these)."""
    if failed:
        raise DataError(f"{what}: {len(failed)} of {n} task(s) failed ("
                        + "; ".join(f"task {t}: {e}" for t, e in list(failed.items())[:3])
                        + "); the others are done. Re-running it runs only the failed ones.")


def run_blocks(blocks, check, run_one, what: str, log=print) -> tuple[list, list]:
    """Run each task of ``blocks`` (``run_one(block)`` -> its record) unless ``check(block)`` is
    true (:func:`pending_blocks`).  A task that fails is logged and the others still run; then
    DataError naming the failed ones, so a retry runs only them.
    Returns ``(records of the tasks run, ids of those skipped)``."""
    todo, skipped = pending_blocks(blocks, check, log)
    ran, failed = [], {}
    for block in todo:
        try:
            ran.append(run_one(block))
        except ZnniError as exc:
            failed[block.id] = str(exc)
            log(f"task {block.id} FAILED: {exc}")
    raise_failed(failed, len(blocks), what)
    return ran, skipped


class _Failed(NamedTuple):
    task: int
    error: ZnniError


def run_pipelined(ctx, blocks, *, device=None, log=print, overlap: bool = True) -> tuple[list, dict]:
    """Run the tasks ``blocks`` of an open run, each read -> compute -> store (``pipeline.task``),
    with Dask overlapping the stages of neighbouring tasks: while the engine computes task k, one
    thread reads task k+1's input and another writes and verifies task k-1's chunks.  Memory stays
    bounded: a read waits for the compute two tasks back, a compute for the store two tasks back
    (at most two inputs and two outputs alive); computes and stores each run one at a time, in
    order.  ``overlap=False`` adds read k -> store k-1, i.e. one task at a time.

    Dask schedules from a helper thread; its compute tasks hand their work to the calling thread
    and wait for it, so the engine runs where ``infer`` runs, on the main heap that
    ``retain_freed_memory`` keeps for reuse.  In a Dask worker thread its large arrays came from
    fresh pages (a thread's own malloc arena cannot hold them: twice the system time on a
    boundary-net task), and forcing one arena on every thread made the FFT workers contend for its
    lock (``layers/arena``).

    Returns ``(records of the tasks run, {task id: error} of those that failed)``: a task's
    ZnniError in any stage is logged and skips its later stages; the other tasks still run.
    """
    import queue
    import threading

    import dask
    from dask import delayed

    from ..layers.arena import retain_freed_memory
    from .task import compute_task, read_task, store_task

    retain_freed_memory()
    requests: queue.Queue = queue.Queue()  # (task input, reply box) from Dask; None: Dask is done

    def read(block, *after):
        try:
            return read_task(ctx, block.id, log=log)
        except ZnniError as exc:
            return _Failed(block.id, exc)

    def compute(ti, *after):
        if isinstance(ti, _Failed):
            return ti
        box: queue.Queue = queue.Queue(maxsize=1)
        requests.put((ti, box))  # run by the calling thread (below)
        ok, value = box.get()
        if not ok:
            raise value
        return value

    def store(done, *after):
        if isinstance(done, _Failed):
            log(f"task {done.task} FAILED: {done.error}")
            return done
        ti, y, t_comp = done
        try:
            m = store_task(ctx, ti, y, t_comp, device=device, log=log)
        except ZnniError as exc:
            log(f"task {ti.task_id} FAILED: {exc}")
            return _Failed(ti.task_id, exc)
        return {"task": ti.task_id, "voxels": m["voxels"], "seconds": m["timings"]["total_s"],
                "compute_s": m["timings"]["compute_s"]}

    def token(_):  # a stage's completion without its data: dependents do not keep arrays alive
        return None

    reads, computed, stored = [], [], []
    for k, block in enumerate(blocks):
        after_r = [computed[k - 2]] if k >= 2 else []
        if not overlap and k:
            after_r = [stored[k - 1]]
        reads.append(delayed(read, pure=False)(block, *after_r))
        after_c = ([computed[k - 1]] if k else []) + ([stored[k - 2]] if k >= 2 else [])
        c = delayed(compute, pure=False)(reads[k], *after_c)
        computed.append(delayed(token, pure=False)(c))
        stored.append(delayed(store, pure=False)(c, *([stored[k - 1]] if k else [])))
    outcome: dict = {}

    def schedule():
        try:
            outcome["results"] = dask.compute(*stored, scheduler="threads", num_workers=3) if stored else ()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            outcome["error"] = exc
        finally:
            requests.put(None)

    scheduler = threading.Thread(target=schedule, name="znni-dask", daemon=True)
    scheduler.start()
    while (request := requests.get()) is not None:
        ti, box = request
        try:
            box.put((True, (ti,) + compute_task(ctx, ti, device=device)))
        except ZnniError as exc:
            box.put((True, _Failed(ti.task_id, exc)))
        except BaseException as exc:  # noqa: BLE001 - a bug: Dask re-raises it, the run stops
            box.put((False, exc))
    scheduler.join()
    if "error" in outcome:
        raise outcome["error"]
    results = outcome["results"]
    ran = [r for r in results if not isinstance(r, _Failed)]
    failed = {r.task: str(r.error) for r in results if isinstance(r, _Failed)}
    return ran, failed


def summary(work, num_tasks: int, per_job: int, started: float) -> dict:
    """Tasks run now, skipped (already done) and not done, from the job markers (never from the
    10^6 task manifests); ``started``: the time this Snakemake run began."""
    jobs = math.ceil(num_tasks / per_job) if num_tasks else 0
    now, skipped, missing, voxels, seconds = 0, 0, [], 0, 0.0
    for j in range(jobs):
        p = job_marker_path(work, j)
        try:
            m = json.loads(p.read_text())
            fresh = p.stat().st_mtime >= started
        except (OSError, ValueError):
            missing.append(j)
            continue
        if fresh:
            now += len(m["ran"])
            skipped += len(m["skipped"])
            voxels += sum(r["voxels"] for r in m["ran"])
            seconds += sum(r["seconds"] for r in m["ran"])
        else:
            skipped += len(m["tasks"])
    not_done = sum(len(job_range(j, per_job, num_tasks)) for j in missing)
    return {"tasks": num_tasks, "jobs": jobs, "done_now": now, "skipped": skipped, "not_done": not_done,
            "jobs_not_done": missing, "voxels": voxels, "seconds": seconds}
