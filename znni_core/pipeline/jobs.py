"""Jobs: the second level of work.  A Snakemake job runs a contiguous range of tasks
(:func:`~.schedule.job_range`; how many per job is :mod:`.schedule`).

A job writes each task's chunks and manifest as a task always did; its own marker
``<work_dir>/jobs/NNNNNN.json`` comes last.  A task whose manifest and stored objects check out
(``finalize.verify``) is skipped, so a killed or retried job redoes only its unfinished tasks.

Each attempt of a job keeps its own record, one file written atomically by its own process only
(at the start, after each task and at the end), ``<work_dir>/jobs/records/NNNNNN/<start>-<host>-<pid>.json``
(``<start>``: the start in ns, 20 digits, so the names sort by start; two processes of one job, a
resubmission while the old one still runs, never write one file).  ``znni status`` and the report
merge a job's files (:func:`job_record`; :class:`JobRecord` writes them)::

    {"format": "znni-job-attempt/1", "job": 3, "run_digest": "...",
     "attempt": 1 (1 + the highest of the job's earlier attempts of this run), "state": "running" | "done" | "failed",
     "started": <unix time>, "host": "node12", "pid": 4242, "slurm_job": "998877" (SLURM_JOB_ID, if any),
     "mem_mb": 2000 (given to the job, or null), "threads": 1, "log": "<the job's log file, or null>",
     "tasks": [12, 13, 14], "skipped": [12], "ran": [13], "failed_tasks": {"14": "<error>"},
     "voxels": 123456, "updated": <unix time>,
     # once it ended:
     "finished": <unix time>, "seconds": 41.2, "max_rss_mb": 812.5,
     # when it failed:
     "kind": "error" | "oom" | "terminated" | "interrupted", "error": "<first line>", "exit": 1}

A file that is not such a document (unreadable, another format, a field of the wrong type) is
ignored, never an error.  A new attempt's writer prunes the job's finished attempt files (``done``,
``failed``, or ``running`` with its process gone on this host; another run's or unreadable ones
too) beyond the newest :data:`MAX_ATTEMPTS`, oldest first; an attempt that may still run is never
removed.  The merged record numbers the attempts in order of their start (``attempts_total``: the
last one's number, so pruned ones still count).

An attempt still ``running`` whose process is gone (on the same host), or that a later attempt
followed (unless its process is seen alive on this host), died without a record (SIGKILL: the OOM
killer's exit 137, a hard time limit).  Each task also logs a plain progress line (no terminal
needed; times as :func:`duration` writes them)::

    task 12/40 (job 3: 2/5) done in 4.1 s, 1.2 Mvox/s, ETA job 12.3 s
"""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError, DataError, StorageError, ZnniError
from ..io import atomic_write, open_input, parse_layer_url
from ..io.workdir import as_path, is_remote_work, remove_before_rewrite, work_path
from .identity import changed_inputs
from .mask import load_mask_tasks, positions
from .run import load_run, location, plan_path, run_geometry
from .schedule import ESTIMATE_FILE, JobMap, input_reads

JOB_FORMAT = "znni-job/1"
#: the format of an attempt's record file (module doc)
ATTEMPT_FORMAT = "znni-job-attempt/1"
#: finished attempt files a job keeps (the oldest pruned beyond by the next attempt's writer)
MAX_ATTEMPTS = 20
#: the states an attempt's record says
ATTEMPT_STATES = ("running", "done", "failed")
#: the prediction a run's first job records (``znni estimate``'s numbers, else validate's)
PREDICTION_FILE = "prediction.json"


def job_marker_path(work, job: int) -> Path:
    """The marker job ``job`` writes last: ``<work>/jobs/NNNNNN.json`` (six digits)."""
    return work_path(work) / "jobs" / f"{job:06d}.json"


def records_dir(work) -> Path:
    """Where the jobs' records are: ``<work>/jobs/records/`` (beside the markers, never one of them)."""
    return work_path(work) / "jobs" / "records"


def job_records_dir(work, job: int) -> Path:
    """Job ``job``'s attempt files: ``<work>/jobs/records/NNNNNN/`` (module doc)."""
    return records_dir(work) / f"{job:06d}"


def attempt_file_name(started_ns: int, host: str, pid: int) -> str:
    """``<start in ns, 20 digits>-<host>-<pid>.json``: sorted by name, attempts are in order of start.

    >>> attempt_file_name(1732848000123456789, "node12.cluster", 4242)
    '01732848000123456789-node12.cluster-4242.json'
    """
    safe = "".join(c if c.isalnum() or c in "._" else "_" for c in host) or "host"
    return f"{started_ns:020d}-{safe}-{pid}.json"


def duration(s: float | None) -> str:
    """``41.2 s``, ``3 min 05 s``, ``2 h 03 min``, ``1 d 04 h``.

    >>> duration(3.14159), duration(185), duration(7380), duration(None)
    ('3.1 s', '3 min 05 s', '2 h 03 min', '?')
    """
    if s is None or s != s:
        return "?"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    if s < 86400:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    return f"{int(s // 86400)} d {int(s % 86400 // 3600):02d} h"


def attempt_alive(attempt: dict) -> bool | None:
    """Whether the process of a running attempt lives: None on another host (not checked)."""
    if attempt.get("host") != socket.gethostname():
        return None
    pid = attempt.get("pid")
    if not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return None
    except (OSError, OverflowError):  # not a pid at all
        return False
    try:  # a pid used again since: a process younger than the attempt is not it
        # lazy: loads psutil only when called
        import psutil

        return psutil.Process(pid).create_time() <= float(attempt.get("started", 0)) + 2
    except Exception:  # noqa: BLE001 - no psutil, or the process ended meanwhile
        return True


class JobTerminated(BaseException):
    """SIGTERM reached a job (a time limit: SLURM sends it before its kill; scancel; Snakemake
    stopping): raised in the main thread so the attempt is recorded, then the job dies of it."""


_NUMBER = (int, float)
#: the optional fields of an attempt's record and their types (None allowed: unknown)
_FIELDS = {
    "updated": _NUMBER,
    "finished": _NUMBER,
    "seconds": _NUMBER,
    "max_rss_mb": _NUMBER,
    "mem_mb": _NUMBER,
    "voxels": _NUMBER,
    "pid": int,
    "threads": int,
    "exit": int,
    "host": str,
    "log": str,
    "slurm_job": str,
    "kind": str,
    "error": str,
    "failed_tasks": dict,
}


def _is(v, types) -> bool:
    return isinstance(v, types) and not isinstance(v, bool)


def valid_attempt(doc) -> bool:
    """Whether ``doc`` is an attempt's record (module doc): its format, and every field of its type.

    >>> a = {"format": ATTEMPT_FORMAT, "job": 0, "run_digest": "d", "attempt": 1, "state": "done", "started": 1.0}
    >>> valid_attempt(a), valid_attempt(a | {"attempt": "1"}), valid_attempt(a | {"ran": 3}), valid_attempt([a])
    (True, False, False, False)
    """
    if not isinstance(doc, dict) or doc.get("format") != ATTEMPT_FORMAT or doc.get("state") not in ATTEMPT_STATES:
        return False
    if not (_is(doc.get("job"), int) and _is(doc.get("attempt"), int) and isinstance(doc.get("run_digest"), str)):
        return False
    if not _is(doc.get("started"), _NUMBER):
        return False
    if any(doc.get(k) is not None and not _is(doc[k], t) for k, t in _FIELDS.items()):
        return False
    for k in ("tasks", "skipped", "ran"):
        ids = doc.get(k, [])
        if not isinstance(ids, list) or not all(_is(t, int) for t in ids):
            return False
    return all(k.isdigit() for k in doc.get("failed_tasks") or {})


def read_attempt(path) -> dict | None:
    """The attempt's record in the file ``path``, or None when it is not one (unreadable, not
    JSON, another format, a field of the wrong type): such a file is ignored, never an error."""
    try:
        doc = json.loads(as_path(path).read_text())
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    return doc if valid_attempt(doc) else None


def _attempt_files(work, job: int) -> list[tuple[Path, dict | None]]:
    """``[(file, its attempt or None)]`` of job ``job``, oldest first ([] when none can be listed)."""
    d = job_records_dir(work, job)
    try:
        paths = sorted(d.glob("[0-9]*.json"))
    except OSError:
        return []
    return [(p, read_attempt(p)) for p in paths]


def job_record(work, job: int, run_digest: str | None = None) -> dict | None:
    """Job ``job``'s record: its attempt files of run ``run_digest`` (None: the run of its latest
    attempt) merged, oldest first, ``{"job", "run_digest", "attempts_total", "attempts": [...]}``;
    None without any.  The attempts are numbered in order of their start (two that started
    together, each taking the same number, get consecutive ones); ``attempts_total`` is the last
    one's number (the pruned ones count)."""
    atts = [a for _, a in _attempt_files(work, job) if a is not None and a["job"] == job]
    if run_digest is None and atts:
        run_digest = max(atts, key=lambda a: a["started"])["run_digest"]
    atts = sorted((a for a in atts if a["run_digest"] == run_digest), key=lambda a: a["started"])
    if not atts:
        return None
    out, last = [], 0
    for a in atts:
        last = max(a["attempt"], last + 1)
        out.append({k: v for k, v in a.items() if k not in ("format", "job", "run_digest")} | {"attempt": last})
    return {"job": job, "run_digest": run_digest, "attempts_total": last, "attempts": out}


def _prunable(attempt: dict | None) -> bool:
    """Whether an attempt's file may go: it ended (or its process is gone, on this host), or it is
    not an attempt's record at all.  An attempt that may still run is never removed."""
    if attempt is None:
        return True
    return attempt["state"] != "running" or attempt_alive(attempt) is False


class JobRecord:
    """This attempt of one job (module doc): its own file, written at the start, after each task
    and at the end by this process only.  Writing it never fails the job: an error is logged once."""

    def __init__(self, work, job: int, run_digest: str, *, mem_mb=None, log=print):
        self.lock = threading.Lock()
        self.log = log
        self.warned = False
        started_ns = time.time_ns()
        now, host, pid = started_ns / 1e9, socket.gethostname(), os.getpid()
        self.path = job_records_dir(work, job) / attempt_file_name(started_ns, host, pid)
        try:
            earlier = _attempt_files(work, job)
        except Exception as exc:  # noqa: BLE001 - the record is never the job's failure
            self._warn(f"job records of job {job} not read ({exc})")
            earlier = []
        mine = [a["attempt"] for _, a in earlier if a is not None and a["run_digest"] == run_digest]
        self.head = {"format": ATTEMPT_FORMAT, "job": job, "run_digest": run_digest}
        self.now = {
            "attempt": max(mine, default=0) + 1,
            "state": "running",
            "started": now,
            "host": host,
            "pid": pid,
            **({"slurm_job": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}),
            "mem_mb": mem_mb if mem_mb is not None else _given_mem_mb(),
            "log": _log_file(work, job),
            "tasks": [],
            "skipped": [],
            "ran": [],
            "failed_tasks": {},
            "voxels": 0,
            "updated": now,
        }
        self.write()
        self.prune(earlier, run_digest)

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            self.log(f"{message}; the job goes on")

    def prune(self, earlier: list, run_digest: str) -> None:
        """Remove the job's finished attempt files (:func:`_prunable`) of another run, or beyond the
        newest :data:`MAX_ATTEMPTS` with this one, oldest first (an error is logged once, never raised)."""
        try:
            keep = MAX_ATTEMPTS - 1  # this attempt is one
            gone = [p for p, a in earlier if a is not None and a["run_digest"] != run_digest and _prunable(a)]
            left = [(p, a) for p, a in earlier if p not in gone]
            over = len(left) - keep
            for p, a in left:
                if over <= 0:
                    break
                if _prunable(a):
                    gone.append(p)
                    over -= 1
            for p in gone:
                p.unlink(missing_ok=True)
        except Exception as exc:  # noqa: BLE001 - the record is never the job's failure
            self._warn(f"old job records in {self.path.parent} not pruned ({exc})")

    def write(self) -> None:
        """This attempt's file, atomically (an error is logged once, never raised)."""
        with self.lock:
            data = (json.dumps(self.head | self.now, indent=1) + "\n").encode()
            try:
                atomic_write(self.path, data)
            except OSError as exc:
                self._warn(f"job record {self.path} not written ({exc.strerror or exc})")

    def update(self, **fields) -> None:
        """Set fields of this attempt, and write."""
        with self.lock:
            self.now.update(fields, updated=time.time())
        self.write()

    def task_done(self, task: int, voxels: int) -> None:
        """A task of this attempt is done (its manifest written)."""
        with self.lock:
            self.now["ran"].append(task)
            self.now["voxels"] += int(voxels)
        self.update()

    def task_failed(self, task: int, error: str) -> None:
        """A task of this attempt failed with ``error``."""
        with self.lock:
            self.now["failed_tasks"][str(task)] = error
        self.update()

    def end(self, exc: BaseException | None = None) -> None:
        """The attempt's end: ``done``, or ``failed`` with what ended it."""
        now = time.time()
        fields = {
            "state": "done" if exc is None else "failed",
            "finished": now,
            "seconds": round(now - self.now["started"], 3),
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
        if exc is not None:
            kind, code = _failure_kind(exc)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            fields |= {"kind": kind, "exit": code, "error": f"{type(exc).__name__}: {lines[0][:1000]}"}
        self.update(**fields)


def _failure_kind(exc: BaseException) -> tuple[str, int]:
    """(kind, exit status) of what ended an attempt."""
    if isinstance(exc, MemoryError):
        return "oom", 1
    if isinstance(exc, JobTerminated):
        return "terminated", 128 + signal.SIGTERM
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(exc, SystemExit):
        return "error", exc.code if isinstance(exc.code, int) else 1
    return "error", int(getattr(exc, "exit_code", 1))


def _log_file(work, job: int) -> str | None:
    """The file this process's stderr goes to (a Snakemake job's ``log:``), else the workflow's
    log of this job where it exists."""
    try:
        target = os.readlink("/proc/self/fd/2")
        if target.startswith("/") and not target.endswith("(deleted)") and Path(target).is_file():
            return target
    except OSError:
        pass
    p = work_path(work) / "logs" / "jobs" / f"{job:06d}.log"
    return str(p) if p.is_file() else None


def _given_mem_mb() -> int | None:
    """The job's memory (MiB) when the caller did not say (``znni run-job --memory``): SLURM's
    ``SLURM_MEM_PER_NODE``, else unknown."""
    try:
        return int(os.environ["SLURM_MEM_PER_NODE"])
    except (KeyError, ValueError):
        return None


def _raise_terminated(signum, frame):
    raise JobTerminated(f"terminated by signal {signum} (SIGTERM: a time limit, scancel or Snakemake stopping)")


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
    mem_mb: int | None = None,
    brick=None,
) -> dict:
    """Run the tasks of ``job``; skip those already done and verified; write the job's marker last.

    ``brick``: the schedule's box of tasks per job (``schedule.json``; :class:`~.schedule.JobMap`),
    else ``per_job`` consecutive tasks; the input chunks its tasks share are fetched once.

    ``tasks_file``: a run with a mask batches only its live tasks (``mask_tasks.json``).  A task
    that fails is logged and the others still run; the job then fails naming them (no marker), so
    a retry runs only what is left.  ``overlap``: read the next task's input and store the last
    task's output while the engine computes (:func:`run_pipelined`); off when the job's memory
    holds one task's buffers only.  ``mem_mb``: the job's memory, for its record (module doc),
    which says how each attempt started and ended.
    """
    run = load_run(run_file)  # unreadable: nothing to record in (the error says why)
    if marker is None:
        remove_before_rewrite(job_marker_path(run, job))
    record = JobRecord(run, job, run.digest, mem_mb=mem_mb, log=log)
    try:
        record_prediction(run, per_job, brick)  # before the first task of the run, for the report
    except Exception as exc:  # noqa: BLE001 - the prediction is for the report, never the job's failure
        log(f"the run's prediction was not recorded: {exc}")
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main and previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        doc = _run_job(run_file, job, per_job, num_tasks, record, marker, device, tasks_file, log, overlap, brick)
    except BaseException as exc:
        record.end(exc)
        if isinstance(exc, JobTerminated):  # recorded: now die of it, as without the handler
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        if main and previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    record.end()
    return doc


def prediction(run, per_job: int = 1, brick=None) -> dict:
    """What the run was predicted to cost (``znni estimate``'s formula): its output voxels (live
    ones with a mask scanned) at ``znni estimate``'s saved rate (``estimate.json``), else the plan's
    predicted rate (validate's estimate), as job-hours and node-hours (``threads`` of
    ``cores_per_node``: this machine's) or GPU-hours."""
    work = work_path(run)
    try:
        plan = json.loads(plan_path(run).read_text())
    except (OSError, ValueError):
        plan = {}
    rate, source = None, None
    try:
        est = json.loads((work / ESTIMATE_FILE).read_text())
        rate, source = float(est["voxels_per_second"]), f"znni estimate: {est.get('rate_source', '')}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not rate and plan.get("predicted_voxels_per_s"):
        rate, source = float(plan["predicted_voxels_per_s"]), "the plan's prediction (validate's estimate)"
    voxels = 1
    for v in run.region["shape"]:
        voxels *= int(v)
    if run.mask:
        try:
            voxels = int(json.loads((work / "mask_tasks.json").read_text())["voxels_live"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    threads = int(plan.get("threads") or 1)
    device = str(plan.get("device") or run.config.device)
    cores = os.cpu_count() or 1
    job_hours = voxels / rate / 3600 if rate else None
    doc = {
        "run_digest": run.digest,
        "voxels": voxels,
        "voxels_per_second": rate,
        "rate_source": source,
        "threads": threads,
        "device": device,
        "cores_per_node": cores,
        "job_hours": job_hours,
        "time": time.time(),
    }
    if job_hours is not None:
        doc["gpu_hours" if device == "gpu" else "node_hours"] = (
            job_hours if device == "gpu" else job_hours * threads / cores
        )
    try:  # what the tasks will read (znni estimate's count), for the report's measured reads
        doc["input_reads"] = predicted_reads(run, per_job, brick)
    except Exception as exc:  # noqa: BLE001 - an unreadable input fails the tasks, not the prediction
        doc["input_reads_error"] = str(exc)
    return doc


def predicted_reads(run, per_job: int = 1, brick=None) -> dict:
    """:func:`~.schedule.input_reads` of the run's tasks on its input, in jobs of ``per_job``
    consecutive tasks or of ``brick`` (each job fetching what its tasks share once, where the
    config gives jobs a cache and the run has no mask)."""
    cfg = run.config
    url = parse_layer_url(run.input.url, endpoint=cfg.input.endpoint_url)
    inp = open_input(url, run.input.mip, resolution=cfg.input.resolution, checksums="none")
    tasks = run_geometry(run)[3]
    jobs = JobMap(per_job, len(tasks), brick, tuple(int(v) for v in tasks.shape))
    return input_reads(tasks, inp, None if run.mask or not cfg.jobs.cache_bytes else jobs)


def record_prediction(run, per_job: int = 1, brick=None) -> dict:
    """``<work_dir>/prediction.json``: the run's :func:`prediction`, written once per run digest
    (before any task runs: its first job does it), so a later ``znni estimate`` (whose rate comes
    from finished tasks) never turns the prediction into a measurement.  Returns the recorded one."""
    path = work_path(run) / PREDICTION_FILE
    try:
        doc, first = json.loads(path.read_text()), False
        if doc.get("run_digest") == run.digest:
            return doc
    except FileNotFoundError:
        first = True
    except (OSError, ValueError):
        first = False
    doc = prediction(run, per_job, brick)
    # the run's first: created only if absent (of two first jobs starting together, one writes it)
    if not atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode(), exclusive=first):
        return json.loads(path.read_text())
    return doc


def job_positions(ctx, run_file, job: int, per_job: int, num_tasks, tasks_file, brick) -> tuple[list, int]:
    """``(task grid positions of job, tasks the jobs share)``: a brick of the task grid, or (a
    mask's live tasks, or no brick) a run of ``per_job`` consecutive ones; a :class:`ConfigError`
    when the run has another number of tasks than the workflow scheduled, or no such job."""
    run = ctx.run
    if tasks_file is not None or run.mask:
        order = positions(load_mask_tasks(run, tasks_file))
    else:
        order = range(len(ctx.tasks))
    n = len(order)
    if num_tasks is not None and n != num_tasks:
        raise ConfigError(
            f"the workflow was scheduled for {num_tasks} tasks but {run_file} has {n}: the schedule is "
            f"stale; delete {work_path(run) / 'schedule.json'} and run the workflow again"
        )
    jobs = JobMap(per_job, n, None if tasks_file is not None or run.mask else brick, tuple(ctx.tasks.shape))
    ks = [order[i] for i in jobs.positions(job)]
    if job < 0 or not ks:
        raise ConfigError(
            f"job {job} has no task: {n} tasks at {jobs.per_job} per job make "
            f"{jobs.num_jobs} jobs (0 to {jobs.num_jobs - 1})"
        )
    return ks, n


def _run_job(run_file, job, per_job, num_tasks, record, marker, device, tasks_file, log, overlap, brick) -> dict:
    """:func:`run_job`'s work, its attempt recorded in ``record``."""
    # lazy: loads numba and scipy only when called
    from .done import check_task
    from .task import job_cache, manifest_path, open_run

    t0 = time.perf_counter()
    ctx = open_run(run_file)
    run = ctx.run
    ks, n = job_positions(ctx, run_file, job, per_job, num_tasks, tasks_file, brick)
    record.update(tasks=[ctx.tasks[k].id for k in ks], threads=getattr(ctx.plan, "threads", None))
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
    record.update(skipped=skipped)
    t_run, count = time.perf_counter(), [0]

    def progress(r) -> None:  # after each task, in order: a plain line for the job's log, and the record
        count[0] += 1
        k = count[0]
        eta = (time.perf_counter() - t_run) / k * (len(todo) - k)
        task = r.task if isinstance(r, _Failed) else r["task"]
        where = f"task {task}/{n} (job {job}: {len(skipped) + k}/{len(ks)})"
        if isinstance(r, _Failed):
            record.task_failed(r.task, str(r.error))
            log(f"{where} failed, ETA job {duration(eta)}")
        else:
            record.task_done(r["task"], r["voxels"])
            rate = r["voxels"] / max(r["seconds"], 1e-9) / 1e6
            log(f"{where} done in {r['seconds']:.1f} s, {rate:.3g} Mvox/s, ETA job {duration(eta)}")

    with job_cache(ctx, todo) as cache:
        ran, failed = run_pipelined(ctx, todo, device=device, log=log, overlap=overlap, on_task=progress, cache=cache)
    if cache.stats["reused_chunks"]:
        st = cache.stats
        log(
            f"job {job}: input chunks fetched {st['fetched_chunks']:,}, served again from the job's cache "
            f"{st['reused_chunks']:,} (at most {st['peak_bytes'] / 2**20:,.0f} MiB held)"
        )
    record.update(input_cache=dict(cache.stats))
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
    path = location(marker) if marker else job_marker_path(run, job)
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


def run_pipelined(
    ctx, blocks, *, device=None, log=print, overlap: bool = True, on_task=None, cache=None
) -> tuple[list, dict]:
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
    ``on_task(result)``: called after each task's store, in order (its record, or its failure).
    ``cache``: the job's :class:`~znni_core.io.chunk_cache.ChunkCache` of the input chunks its
    tasks share (:func:`~.task.job_cache`).
    """
    # long (one graph): the three stages, their dependencies and the engine's thread share the
    # closures' state; the stages' dependencies read best side by side

    # lazy: loads dask only when called
    import dask
    from dask import delayed

    # lazy: loads numba and scipy only when called
    from ..layers.arena import retain_freed_memory
    from .task import compute_task, read_task, store_task

    retain_freed_memory()
    requests: queue.Queue = queue.Queue()  # (task input, reply box) from Dask; None: Dask is done

    def read(block, *after):
        try:
            return read_task(ctx, block.id, log=log, cache=cache)
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

    def stage_done(result):
        if on_task is not None:
            on_task(result)
        return result

    def store(done, *after):
        if isinstance(done, _Failed):
            log(f"task {done.task} FAILED: {done.error}")
            return stage_done(done)
        ti, y, t_comp = done
        try:
            m = store_task(ctx, ti, y, t_comp, device=device, log=log)
        except ZnniError as exc:
            log(f"task {ti.task_id} FAILED: {exc}")
            return stage_done(_Failed(ti.task_id, exc))
        return stage_done(
            {
                "task": ti.task_id,
                "voxels": m["voxels"],
                "seconds": m["timings"]["total_s"],
                "compute_s": m["timings"]["compute_s"],
            }
        )

    def token(_):  # a stage's completion without its data: dependents do not keep arrays alive
        return None

    reads, read_done, computed, stored = [], [], [], []
    for k, block in enumerate(blocks):
        after_r = [computed[k - 2]] if k >= 2 else []
        if not overlap and k:
            after_r = [stored[k - 1]]
        # reads in order, one at a time: a read finds in the job's cache what the last one fetched
        reads.append(delayed(read, pure=False)(block, *after_r, *read_done[k - 1 : k]))
        read_done.append(delayed(token, pure=False)(reads[k]))
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


def _markers(work, jobs: int):
    """``(marker document or None, its modification time)`` of jobs ``0..jobs-1`` in order; in an
    ``s3://`` / ``gs://`` work directory the times from one listing and 16 reads at once."""
    work = work_path(work)
    paths = [job_marker_path(work, j) for j in range(jobs)]

    def read(p):
        try:
            return json.loads(p.read_text()), (p.stat().st_mtime if mtimes is None else mtimes.get(p.name, 0.0))
        except (OSError, ValueError):
            return None, 0.0

    if not is_remote_work(work) or jobs < 2:
        mtimes = None
        yield from map(read, paths)
        return

    try:
        mtimes = {p.name: mtime for p, _, mtime in (work / "jobs").listing(recursive=False)}
    except OSError:
        mtimes = {}
    with ThreadPoolExecutor(16) as pool:
        yield from pool.map(read, paths)


def summary(work, jobmap: JobMap, started: float) -> dict:
    """Tasks run now, skipped (already done) and not done, from the job markers (never from the
    10^6 task manifests); ``started``: the time this Snakemake run began."""
    num_tasks, jobs = jobmap.num_tasks, jobmap.num_jobs
    now, skipped, missing, voxels, seconds = 0, 0, [], 0, 0.0
    for j, (m, mtime) in enumerate(_markers(work, jobs)):
        if m is None:
            missing.append(j)
            continue
        fresh = mtime >= started
        if fresh:
            now += len(m["ran"])
            skipped += len(m["skipped"])
            voxels += sum(r["voxels"] for r in m["ran"])
            seconds += sum(r["seconds"] for r in m["ran"])
        else:
            skipped += len(m["tasks"])
    not_done = sum(len(jobmap.positions(j)) for j in missing)
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
