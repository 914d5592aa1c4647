# Shared definitions: work directory, the config for the CLI, the job schedule (computed when the
# workflow is parsed: no checkpoint), input functions (get_*) and the end-of-run summary.
#
# Nothing here changes the parent workflow when znni is imported as a module: no shell.prefix
# (rules call `{params.env} znni ...`), no exported environment, no default target.
import os

# The environment as the parent (or snakemake) had it, before any znni import: what znni's imports
# and its schedule set in this process (joblib's KMP_INIT_AT_FORK, threadpoolctl's
# KMP_DUPLICATE_LIB_OK, the engine's GOMP_SPINCOUNT, ...) would reach every later job, the
# parent's rules' included. restore_environ() (the last line of workflow/Snakefile) puts it back
# exactly; znni's own jobs get what they need explicitly, as params.env (ZNNI_ENV below).
_ENVIRON_BEFORE = dict(os.environ)


def restore_environ():
    """Make os.environ what it was before znni's workflow was parsed: keys added removed, keys
    changed or removed set back."""
    for key in [k for k in os.environ if k not in _ENVIRON_BEFORE]:
        del os.environ[key]
    for key, value in _ENVIRON_BEFORE.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


import hashlib
import json
import posixpath
import sys
import time
from pathlib import Path

try:
    from znni_core.io.atomic import atomic_write
    from znni_core.io.workdir import ENDPOINT_ENV, is_remote_work, work_endpoint, work_path
    from znni_core.pipeline.jobs import job_marker_path, summary
    from znni_core.pipeline.schedule import JobMap, workflow_schedule
except ImportError as exc:
    raise WorkflowError(f"znni is not installed in the environment that runs snakemake ({exc}); "
                        "`make setup` (or `pip install -e .`) in this environment") from None

# work_dir as Snakemake sees it (a module's `prefix:` is added to it by Snakemake) and where the
# CLI writes it: the same directory.  A work_dir on s3:// or gs:// (jobs that share no file
# system, docs/cloud.md) is znni's alone: Snakemake's own files are then flags under WORK
# ("znni", below --default-storage-prefix with a storage plugin), each touched after its
# command succeeded, and the logs beside them.
REMOTE_WORK = is_remote_work(config["work_dir"])
WORK = "znni" if REMOTE_WORK else str(work_path(config["work_dir"]))  # file:// removed
_PREFIX = getattr(getattr(workflow.modifier, "path_modifier", None), "prefix", None) or ""
if REMOTE_WORK:
    WORK_DIR = str(config["work_dir"]).rstrip("/")
else:
    WORK_DIR = WORK if os.path.isabs(WORK) else os.path.abspath(os.path.join(_PREFIX, WORK))
ZNNI_CONFIG = {**config, "work_dir": WORK_DIR}
WORK_PATH = work_path(ZNNI_CONFIG)
STARTED = time.time()


def flagged(path):
    """A rule's output as Snakemake sees it: the file itself, or (an s3:// or gs:// work_dir) its flag."""
    return f"{path}.done" if REMOTE_WORK else path


# the run file the commands read, and what ends a command: with a work_dir on s3:// or gs://
# znni writes its markers there itself, and the rule's outputs are flags touched after it succeeded
RUN_FILE = f"{WORK_DIR}/run.json" if REMOTE_WORK else "{input.run}"
TOUCH = " && touch {output}" if REMOTE_WORK else ""
MARKER = "" if REMOTE_WORK else "--marker {output}"
# the rules' logs as this process finds them (with a work_dir on s3:// or gs:// they are Snakemake's,
# under WORK: local files, or with a storage plugin objects under --default-storage-prefix, read
# through znni's own store with the work_dir's endpoint)
_STORAGE_PREFIX = str(workflow.storage_settings.default_storage_prefix or "").replace("gcs://", "gs://", 1)
_IN_STORAGE = bool(workflow.storage_settings.default_storage_provider) and is_remote_work(_STORAGE_PREFIX)


def snakemake_file(name):
    """Where this process reads (and writes) Snakemake's file ``name`` under WORK: a local path, or
    with a bucket work_dir and a storage plugin the object under --default-storage-prefix."""
    if REMOTE_WORK and _IN_STORAGE:
        key = os.path.normpath(os.path.join(_PREFIX, WORK, name))
        return work_path(posixpath.join(_STORAGE_PREFIX, key), work_endpoint(config))
    return Path(WORK if REMOTE_WORK else WORK_DIR) / name


LOGS = snakemake_file("logs")
MASK_OUTPUT = "" if REMOTE_WORK else "--output {output}"
# the image the rules run in with --software-deployment-method apptainer (workflow/envs/Dockerfile)
CONTAINER = config.get("container")

# numba's default threading layer kills the process when called from threads (docs/pitfalls.md);
# compiled kernels are cached with znni's other machine caches (calibration, plans), so a new
# run starts warm too: in the work directory, every run's first jobs compiled again (about 17 s
# each, both at once, on 2 cores).  numba keys its entries by CPU, so one cache serves a mixed
# cluster.  Python's bytecode is written where a module has none (PYTHONDONTWRITEBYTECODE is
# cleared: some machines and containers set it, and every command then compiled znni's own modules
# from source again, 0.1 s of a finalize, 0.15 s of a job's start); installed packages already
# carry theirs, and a tree Python cannot write is left as it is.  Passed to each command as
# params.env (never shell.prefix, which would reach a parent's rules).
ZNNI_ENV = (
    "NUMBA_THREADING_LAYER=${NUMBA_THREADING_LAYER:-threadsafe} "
    f"NUMBA_CACHE_DIR=${{NUMBA_CACHE_DIR:-${{ZNNI_CACHE_DIR:-${{HOME:-{'$PWD' if REMOTE_WORK else WORK_DIR}}}/.cache/znni}}/numba}} "
    "PYTHONDONTWRITEBYTECODE="
    + (f" {ENDPOINT_ENV}={work_endpoint(config)}" if work_endpoint(config) else "")
)

# tasks and jobs: from the config, the network's halo and the input's bounds (schedule.json caches
# them); a run that cannot be scheduled gets no job, and `validate` reports why.  Jobs are sized
# to the jobs Snakemake runs at once (--jobs, else --cores; a dry run's default: the CPUs here),
# so a small volume still keeps every slot busy.
_NODES, _CORES = (getattr(workflow.global_resources.get(k), "value", None) for k in ("_nodes", "_cores"))
SLOTS = _NODES if _NODES and _NODES < sys.maxsize else _CORES if _CORES and _CORES > 1 else os.cpu_count()
# a task job with several threads (set-threads) takes that many cores: fewer run at once
_JOB_THREADS = workflow.resource_settings.overwrite_threads.get("infer_job", 1)
_JOB_THREADS = getattr(_JOB_THREADS, "value", _JOB_THREADS)  # an int, or a Resource holding one
if _CORES and _CORES < sys.maxsize and isinstance(_JOB_THREADS, int) and _JOB_THREADS > 1:
    SLOTS = max(1, min(SLOTS, _CORES // _JOB_THREADS))
# planning the schedule may load znni's engine in this (Snakemake's) process, which sets
# GOMP_SPINCOUNT for its own OpenMP threads: restore_environ() takes it back with the rest (znni's
# own jobs set it again when they load the engine)
# (a job parsing the workflow again where it runs takes the schedule the workflow made)
SCHEDULE = workflow_schedule(ZNNI_CONFIG, SLOTS, job=workflow.remote_exec)
# schedule.json is rewritten when the config or the network changes: as validate's input it makes a
# config change rerun validate under `rerun-triggers: mtime` too (a work_dir on s3:// or gs:// is not
# Snakemake's: validate's params, the config, do it)
SCHEDULE_FILE = [] if "error" in SCHEDULE or REMOTE_WORK else [f"{WORK}/schedule.json"]
SCHEDULE_ERROR = {"error": SCHEDULE["error"]} if "error" in SCHEDULE else {}
if "error" in SCHEDULE:
    print(f"znni: the run cannot be scheduled: {SCHEDULE['error']}", file=sys.stderr)
    SCHEDULE = {"num_tasks": 0, "tasks_per_job": 1, "num_jobs": 0, "pyramid": []}
# the CLI gets the task size the schedule chose (task_chunks: auto depends on the slots of the run
# that made schedule.json; a resume with another --jobs keeps it, and with it the tasks' ids)
CONFIG_JSON = json.dumps({**ZNNI_CONFIG, "task_chunks": SCHEDULE.get("task_box", ZNNI_CONFIG.get("task_chunks"))},
                         sort_keys=True)
CONFIG_DIGEST = hashlib.sha256(CONFIG_JSON.encode()).hexdigest()[:16]

# With a bucket work_dir the config itself is validate's input, rewritten here when it changed
# (this process only, never a job's): as schedule.json does on a file system, it makes validate run
# again on a changed config by modification time alone, with no record of Snakemake's (a launch
# machine's .snakemake/ may be new, and a change back to earlier settings must be checked again)
CONFIG_FILE = [f"{WORK}/config.json"] if REMOTE_WORK and not SCHEDULE_ERROR else []
if CONFIG_FILE and not workflow.remote_exec:
    _config = snakemake_file("config.json")
    try:
        _same = _config.read_text() == CONFIG_JSON
    except OSError:
        _same = False
    if not _same:
        try:
            atomic_write(_config, CONFIG_JSON.encode())
        except OSError as exc:
            raise WorkflowError(f"znni: {_config} cannot be written ({exc})") from None

# a mask makes the task list data-dependent: the checkpoint mask_tasks (rules/mask.smk) lists the
# live tasks and the jobs batch only those
MASKED = bool(config.get("mask"))
MASK_TASKS = [flagged(f"{WORK}/mask_tasks.json")] if MASKED else []

wildcard_constraints:
    job=r"\d{6}",
    mip=r"[1-9]\d*",


def live_tasks():
    """The number of tasks the jobs run: all, or after the mask checkpoint the live ones."""
    if not MASKED:
        return SCHEDULE["num_tasks"]
    checkpoints.mask_tasks.get()
    return json.loads((WORK_PATH / "mask_tasks.json").read_text())["num_live"]


def job_brick():
    """A job's box of tasks (z, y, x) by the schedule; None for runs of tasks (a mask's live ones too)."""
    return None if MASKED else SCHEDULE.get("brick")


def job_map(num_tasks):
    """Which tasks each job runs: the schedule's boxes of tasks, or (a mask's live tasks) runs of them."""
    return JobMap(SCHEDULE["tasks_per_job"], num_tasks, job_brick(), SCHEDULE.get("task_grid"))


def get_job_brick(wildcards):
    """run-job's --brick: a job's box of tasks (z,y,x), when the schedule has one."""
    brick = job_brick()
    return f"--brick {','.join(map(str, brick))}" if brick else ""


def get_job_markers(wildcards):
    """Every job's marker (written after all its tasks' manifests)."""
    n = live_tasks() if SCHEDULE["num_jobs"] else 0
    return [flagged(f"{WORK}/jobs/{j:06d}.json") for j in range(job_map(n).num_jobs)]


def get_job_tasks(wildcards):
    """run-job's task arguments: the scheduled count, or the mask checkpoint's list."""
    if MASKED:
        return f"--tasks-file {WORK_DIR}/mask_tasks.json"
    return f"--num-tasks {SCHEDULE['num_tasks']}"


def pyramid_markers(mip):
    """Every job marker of mip ``mip`` (the schedule: computed when the workflow is parsed)."""
    s = SCHEDULE["pyramid"][mip - 1]
    return [flagged(f"{WORK}/pyramid/mip{mip}/{j:06d}.json") for j in range(s["num_jobs"])]


def get_pyramid_below(wildcards):
    """What a job of a mip reads: all of the mip below."""
    mip = int(wildcards.mip)
    return get_job_markers(wildcards) if mip == 1 else pyramid_markers(mip - 1)


def get_pyramid_markers(wildcards):
    """Every job marker of every mip."""
    return [m for s in SCHEDULE["pyramid"] for m in pyramid_markers(s["mip"])]


def cancel_rate_timers():
    """Let Snakemake exit as soon as the workflow has ended.  Its scheduler re-arms a 1-s
    non-daemon ``threading.Timer`` (the job rate limit's re-evaluation) on every scheduling
    round, and the interpreter waits for the last one at exit: about 1 s after the last job on
    every run.  When onsuccess/onerror run no job is left to schedule, so the pending timers
    are cancelled (they only release the scheduler's semaphore)."""
    import threading

    for t in threading.enumerate():
        if isinstance(t, threading.Timer):
            t.cancel()


def validate_refused():
    """Whether this run's validate logged an error (its settings refused: no task ran)."""
    try:
        log = LOGS / "validate.log"
        return log.stat().st_mtime >= STARTED and any(
            line.startswith("error: ") for line in log.read_text(errors="replace").splitlines()
        )
    except OSError:
        return False


def print_summary(ok):
    """End-of-run summary from the job markers: tasks done now / already done (skipped) / not done."""
    if not SCHEDULE["num_jobs"]:
        return
    if not ok and validate_refused():  # the markers are another run's: nothing of this one ran
        print(f"\nznni summary: validate refused the run (above; {LOGS / 'validate.log'}); no task ran",
              file=sys.stderr)
        return
    n, masked = SCHEDULE["num_tasks"], None
    if MASKED:
        try:
            doc = json.loads((WORK_PATH / "mask_tasks.json").read_text())
            n, masked = doc["num_live"], doc["num_masked"]
        except (OSError, ValueError, KeyError):
            return
    s = summary(WORK_PATH, job_map(n), STARTED)
    print(f"\nznni summary: {s['tasks']} tasks in {s['jobs']} jobs: {s['done_now']} done now, {s['skipped']} skipped "
          f"(already done), {s['not_done']} not done"
          + (f" (jobs {s['jobs_not_done'][:20]})" if s["not_done"] else "")
          + (f"; {masked} masked (the mask is 0 over them, never run)" if masked is not None else ""),
          file=sys.stderr)
    wall = time.time() - STARTED
    report_html = WORK_PATH / "report" / "report.html"
    if s["done_now"]:
        # two clocks, named: this workflow's (Snakemake's start to now: validation, compilation, the
        # jobs, finalize) and the tasks' span, first start to last end, which the report gives
        try:
            span = json.loads(report_html.with_name("summary.json").read_text())["wall_seconds"]
        except (OSError, ValueError, KeyError):
            span = None
        print(f"  {s['voxels']:,} voxels; this workflow {wall:.1f} s wall ({s['voxels'] / wall:,.0f} voxels/s)"
              + (f"; the run's tasks {span:.1f} s from the first start to the last end (the report's wall time)"
                 if span else "")
              + f"; {s['voxels'] / max(s['seconds'], 1e-9):,.0f} voxels/s per task", file=sys.stderr)
    if ok and report_html.is_file():
        print(f"  report: {report_html}\n  preview: {report_html.with_name('preview.png')}", file=sys.stderr)
    if not ok:
        print(f"  re-run the same command to retry only the unfinished tasks; logs: {LOGS / 'jobs'}/",
              file=sys.stderr)


def print_errors():
    """After a failed run: the ``error:`` lines the run's commands logged (validate's refusal, a
    job's failed tasks), so the reason shows here and not only in a log file."""
    logs = [LOGS / "validate.log", *sorted((LOGS / "jobs").glob("*.log"))]
    shown = 0
    for log in logs:
        try:
            if log.stat().st_mtime < STARTED:
                continue
            lines = [l for l in log.read_text(errors="replace").splitlines() if l.startswith("error: ")]
        except OSError:
            continue
        for line in lines[-1:]:
            print(f"znni: {log.name}: {line}", file=sys.stderr)
            shown += 1
        if shown >= 5:
            break
