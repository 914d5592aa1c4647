"""Jobs: the second level of work.  A Snakemake job runs a contiguous range of tasks
(:func:`~.schedule.job_range`; how many per job is :mod:`.schedule`).

A job writes each task's chunks and manifest as a task always did; its own marker
``<work_dir>/jobs/NNNNNN.json`` comes last.  A task whose manifest and stored objects check out
(``finalize.verify``) is skipped, so a killed or retried job redoes only its unfinished tasks.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError, DataError, ZnniError
from ..io import atomic_write
from .schedule import job_range

JOB_FORMAT = "znni-job/1"


def job_marker_path(work, job: int) -> Path:
    """The marker job ``job`` writes last: ``<work>/jobs/NNNNNN.json`` (six digits)."""
    return Path(work) / "jobs" / f"{job:06d}.json"


def run_job(
    run_file,
    job: int,
    per_job: int,
    num_tasks: int | None = None,
    *,
    marker=None,
    device=None,
    tasks_file=None,
    log=print,
    overlap: bool = True,
) -> dict:
    """Run the tasks of ``job``; skip those already done and verified; write the job's marker last.

    ``tasks_file``: a run with a mask batches only its live tasks (``mask_tasks.json``).  A task
    that fails is logged and the others still run; the job then fails naming them (no marker), so
    a retry runs only what is left.  ``overlap``: read the next task's input and store the last
    task's output while the engine computes (:func:`run_pipelined`); off when the job's memory
    holds one task's buffers only.
    """
    from .done import check_task
    from .identity import changed_inputs
    from .mask import load_mask_tasks, positions
    from .task import manifest_path, open_run

    t0 = time.perf_counter()
    ctx = open_run(run_file)
    run = ctx.run
    if tasks_file is not None or run.mask:
        order = positions(load_mask_tasks(run, tasks_file))
    else:
        order = range(len(ctx.tasks))
    n = len(order)
    if num_tasks is not None and n != num_tasks:
        raise ConfigError(
            f"the workflow was scheduled for {num_tasks} tasks but {run_file} has {n}: the schedule is "
            f"stale; delete {Path(run.work_dir) / 'schedule.json'} and run the workflow again"
        )
    ks = [order[i] for i in job_range(job, per_job, n)]
    if job < 0 or not ks:
        raise ConfigError(
            f"job {job} has no task: {n} tasks at {per_job} per job make "
            f"{math.ceil(n / per_job)} jobs (0 to {math.ceil(n / per_job) - 1})"
        )
    verify = run.config.finalize.verify
    inputs = run.config.recompute == "inputs"

    def done(block):
        if not manifest_path(run, block.id).is_file():
            return False
        m = check_task(run, ctx.out, block, verify)
        changed = changed_inputs(ctx.inp, m, ctx.mask.layer if ctx.mask else None) if inputs else []
        if changed:
            raise DataError(f"{len(changed)} of its input objects changed since it ran (first: {changed[0]})")
        return True

    todo, skipped = pending_blocks([ctx.tasks[k] for k in ks], done, log)
    ran, failed = run_pipelined(ctx, todo, device=device, log=log, overlap=overlap)
    raise_failed(failed, len(ks), f"job {job}")
    doc = {
        "format": JOB_FORMAT,
        "job": job,
        "run_digest": run.digest,
        "tasks": [ctx.tasks[k].id for k in ks],
        "ran": ran,
        "skipped": skipped,
        "seconds": round(time.perf_counter() - t0, 3),
        "finished": time.time(),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    path = Path(marker) if marker else job_marker_path(run.work_dir, job)
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    vox = sum(r["voxels"] for r in ran)
    log(
        f"job {job}: {len(ran)} task(s) run, {len(skipped)} skipped (already done), {vox:,} voxels in "
        f"{doc['seconds']:.1f} s -> {path}"
    )
    return doc


def pending_blocks(blocks, check, log=print) -> tuple[list, list]:
    """``(blocks to run, ids skipped)``: a block is skipped when ``check(block)`` is true (its
    manifest and stored objects verify); false: no manifest; DataError: a manifest that does not
    check out (run again).  Any other failure of the check itself (an ``OSError`` of the storage,
    a ``StorageError``) is a :class:`DataError` naming the task: the job stops before running
    anything, never taking the task as done nor redoing everything (docs/reliability.md, T16)."""
    from ..errors import StorageError

    todo, skipped = [], []
    for block in blocks:
        try:
            if check(block):
                skipped.append(block.id)
                log(f"task {block.id}: done and verified, skipped")
                continue
        except StorageError as exc:  # the storage failed, not the task: nothing is run or taken as done
            raise DataError(f"task {block.id}: its done-check failed: {exc}; fix the storage and re-run") from exc
        except DataError as exc:
            log(f"task {block.id}: {exc}; running it again")
        except OSError as exc:
            raise DataError(
                f"task {block.id}: its done-check failed: {exc.strerror or exc} ({exc.filename or 'storage'}); "
                "fix the storage and re-run"
            ) from exc
        todo.append(block)
    return todo, skipped


def raise_failed(failed: dict, n: int, what: str) -> None:
    """DataError naming the failed tasks (the others are done: a retry runs only these)."""
    if failed:
        raise DataError(
            f"{what}: {len(failed)} of {n} task(s) failed ("
            + "; ".join(f"task {t}: {e}" for t, e in list(failed.items())[:3])
            + "); the others are done. Re-running it runs only the failed ones."
        )


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
        return {
            "task": ti.task_id,
            "voxels": m["voxels"],
            "seconds": m["timings"]["total_s"],
            "compute_s": m["timings"]["compute_s"],
        }

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
    return {
        "tasks": num_tasks,
        "jobs": jobs,
        "done_now": now,
        "skipped": skipped,
        "not_done": not_done,
        "jobs_not_done": missing,
        "voxels": voxels,
        "seconds": seconds,
    }
