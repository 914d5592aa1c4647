"""Fault-suite harness (docs/reliability.md): tiny generated cases, fault injection, byte comparison.

Three ways to run a task, cheapest first:

* :func:`run_task_proc` -- a real process running :func:`znni_core.pipeline.task.run_task`, forked
  from a *forkserver* that imported znni, numpy, numba and cloud-volume once (a plain
  ``znni run-task`` spends seconds importing).  The parent can SIGKILL it after a seeded delay, or
  the child kills itself at a named point (:data:`POINTS`).  The forkserver starts before any
  thread exists, so forking is safe.
* ``znni run-task`` through the CLI (:func:`znni`), for messages and exit codes.
* the whole workflow (:func:`snakemake`), with ``ZNNI_FAULT`` injected into every job through
  ``sitecustomize`` (:func:`fault_env`).

Fault spec (``ZNNI_FAULT``, also the ``fault`` argument): ``point[:task[:arg]]`` with point in
:data:`POINTS`; ``task`` restricts it to one task id (``*`` = any); ``arg`` is the chunk count for
``after-chunk``, the write's number for ``mid-write``.  With ``ZNNI_FAULT_DIR`` set, each kill
records where it landed in ``$ZNNI_FAULT_DIR/kills.log`` (:func:`kills`).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ZNNI = str(BIN / "znni")
SNAKEMAKE = str(BIN / "snakemake")
INJECT_DIR = Path(__file__).resolve().parent / "faults_inject"

POINTS = (
    "compute",  # kill while the task computes (before any write)
    "after-chunk",  # kill once N chunks of the task are written (a sharded or zarr output: after its shard)
    "after-chunk-once",  # the same, on the task's first attempt only (a marker file in ZNNI_FAULT_DIR)
    "mid-write",  # kill inside the N-th chunk or shard write of the task: half its bytes in the temporary
    "before-manifest",  # kill after the last chunk was written and verified, before the manifest
    "hold",  # wait before the manifest until killed: a kill at a seeded moment always lands
    "fail",  # raise (a task that always fails)
    "nan",  # make the engine produce NaN (T20)
    "sleep-once",  # sleep N s in the task's first compute (a SLURM TIMEOUT, then fine)
    "hog",  # hold N MB for 4 s (over a SLURM job's --mem: OUT_OF_MEMORY)
)

# Small but real: FOV (5, 10, 10) demo network, 8 single-chunk tasks by default.
SHAPE = (16, 64, 64)
CHUNK = (8, 32, 32)
TASK = (1, 1, 1)


@dataclass
class Case:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def run_file(self) -> Path:
        return self.work / "run.json"

    def manifest(self, task: int) -> Path:
        return self.work / "manifests" / f"{task // 10_000:04d}" / f"{task:06d}.json"

    def tasks(self) -> list[dict]:
        from znni_core.pipeline.run import load_run
        from znni_core.pipeline.task import task_list

        return task_list(load_run(self.run_file))

    def copy(self, dest: Path) -> "Case":
        """A copy with every path rewritten (config, run.json, layer info); mtimes kept."""
        shutil.copytree(self.root, dest, symlinks=True, ignore=shutil.ignore_patterns("*.lock", "locks"))
        for f in [
            dest / "config.yaml",
            *dest.glob("work/*.json"),
            *dest.glob("work/manifests/*/*.json"),
            *dest.glob(".snakemake/metadata/*"),
        ]:
            if f.is_file():
                st = f.stat()
                f.write_text(f.read_text().replace(str(self.root), str(dest)))
                os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        return Case(dest)


def make_case(root: Path, *, shape=SHAPE, chunk=CHUNK, task_chunks=TASK, seed=0, net=None, **overrides) -> Case:
    """Demo volume + network + config.yaml under ``root`` (not yet validated); one task per job
    unless ``jobs__tasks_per_job`` says otherwise (the kill cases pick among many jobs)."""
    import yaml

    from znni_core.net import save_network
    from znni_core.pipeline.demo import write_demo, write_demo_config

    case = Case(Path(root))
    write_demo(case.data, shape=shape, seed=seed, chunk=chunk)
    if net is not None:
        save_network(net, case.data / "net.yaml")
    write_demo_config(
        case.config,
        case.data,
        work_dir=case.work,
        output="file://" + str(case.out),
        task_chunks=task_chunks,
        chunk=chunk,
    )
    overrides.setdefault("jobs__tasks_per_job", 1)
    if overrides:
        cfg = yaml.safe_load(case.config.read_text())
        for dotted, v in overrides.items():
            d = cfg
            *head, last = dotted.split("__")
            for k in head:
                d = d.setdefault(k, {})
            d[last] = v
        case.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return case


def znni(*args, env=None, timeout=120, check=False) -> subprocess.CompletedProcess:
    p = subprocess.run([ZNNI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env or job_env())
    if check and p.returncode != 0:
        raise AssertionError(f"znni {args} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def prepare(case: Case, mem_mb: int = 2000) -> Case:
    """validate (plan, then the output layer, once) + tasks, as the workflow's first rules do."""
    znni(
        "validate",
        case.config,
        "--memory",
        f"{mem_mb}MiB",
        "--threads",
        1,
        "--layer-marker",
        case.work / "layer.json",
        check=True,
    )
    znni("tasks", case.run_file, "--output", case.work / "tasks.json", check=True)
    return case


# ---- bytes --------------------------------------------------------------------------------------
def layer_files(layer_dir: Path) -> dict[str, bytes]:
    """Every chunk file of a file:// layer (relative path -> bytes): ``pipeline_helpers.layer_files``."""
    from tests.pipeline_helpers import layer_files as files

    return files(str(layer_dir))


def temporaries(layer_dir: Path) -> list[str]:
    return [str(p) for p in Path(layer_dir).rglob("*") if ".znni-tmp." in p.name]


def assert_same_chunks(got: dict[str, bytes], want: dict[str, bytes], what: str = "") -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(want) & set(got) if got[k] != want[k])
    assert not (missing or extra or differ), (
        f"{what}: layer differs from the uninterrupted run: missing {missing[:5]}, extra {extra[:5]}, "
        f"different bytes {differ[:5]}"
    )


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ---- environment ------------------------------------------------------------------------------
def job_env(fault: str | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
    env.setdefault("NUMBA_CACHE_DIR", str(Path.home() / ".cache" / "znni-tests-numba"))
    env.pop("ZNNI_FAULT", None)
    if fault:
        env["ZNNI_FAULT"] = fault
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT_DIR), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def fault_env(fault: str | None, extra: dict | None = None) -> dict:
    return job_env(fault, extra)


# the CI cluster (scripts/slurm/up.sh) has no slurmdbd and seconds-long jobs: the profile's status
# checks (sacct, first after 60 s) are for real clusters
CI_SLURM = ["--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2"]


def _profile_args(profile: str) -> list[str]:
    return ["--profile", str(REPO / profile), *(CI_SLURM if "slurm" in profile else [])]


def snakemake(case: Case, *args, profile="profiles/local", env=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = [
        "timeout",
        "-k",
        "10",
        str(timeout),
        SNAKEMAKE,
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "--directory",
        str(case.root),
        "--configfile",
        str(case.config),
        *_profile_args(profile),
        *map(str, args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or job_env(), cwd=case.root)


def start_snakemake(case: Case, *args, profile="profiles/local", env=None, log: Path | None = None):
    cmd = [
        SNAKEMAKE,
        "-s",
        str(REPO / "workflow" / "Snakefile"),
        "--directory",
        str(case.root),
        "--configfile",
        str(case.config),
        *_profile_args(profile),
        *map(str, args),
    ]
    f = open(log or case.root / "snakemake.out", "ab")
    return subprocess.Popen(
        cmd, stdout=f, stderr=subprocess.STDOUT, env=env or job_env(), cwd=case.root, start_new_session=True
    )


# ---- forked task runs -----------------------------------------------------------------------------
_CTX = None


def _ctx():
    """The forkserver: started once, before any thread, with znni and its dependencies imported."""
    global _CTX
    if _CTX is None:
        from multiprocessing import forkserver

        saved = dict(os.environ)
        os.environ.update({k: v for k, v in job_env().items() if k.startswith("NUMBA_")})
        # The server only imports (no engine call): an OpenMP/numba thread pool started before a
        # fork is unsafe, and children must compute exactly as `znni run-task` does.
        try:
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(["tests.faults_inject.warm"])
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _CTX


def _child(run_file: str, task: int, fault: str | None, env: dict | None = None) -> None:
    import logging

    os.environ.update(env or {})
    logging.disable(logging.CRITICAL)
    sys.path.insert(0, str(INJECT_DIR))
    import znni_core.pipeline.task as T
    from tests.faults_inject import sitecustomize as inj

    if fault:
        inj.patch_task_module(T, fault)
    T.run_task(run_file, task, show_progress=False, log=lambda *a, **k: None)


@dataclass
class ProcResult:
    exitcode: int  # negative: killed by that signal
    seconds: float

    @property
    def killed(self) -> bool:
        return self.exitcode == -signal.SIGKILL


def run_task_proc(
    case: Case,
    task: int,
    *,
    fault: str | None = None,
    kill_after: float | None = None,
    timeout: float = 120,
    env: dict | None = None,
) -> ProcResult:
    """Run one task in a forked process; SIGKILL it after ``kill_after`` s (if still running).
    ``env``: variables set in the child (``ZNNI_FAULT_DIR`` for :func:`kills`)."""
    p = _ctx().Process(target=_child, args=(str(case.run_file), task, fault, env))
    t0 = time.perf_counter()
    p.start()
    if kill_after is not None:
        p.join(kill_after)
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended (and the forkserver reaped it) after the check
                pass
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
        raise AssertionError(f"task {task} hung for {timeout} s")
    return ProcResult(p.exitcode, time.perf_counter() - t0)


def kills(fault_dir: Path) -> list[str]:
    """Where the injected kills landed, one line each (``$ZNNI_FAULT_DIR/kills.log``)."""
    f = Path(fault_dir) / "kills.log"
    return f.read_text().splitlines() if f.is_file() else []


def manifest_ok(case: Case, task: int) -> bool | None:
    """None: no manifest; True: manifest present and every chunk it lists verifies; False: it lies."""
    from znni_core.io import read_manifest

    mp_ = case.manifest(task)
    if not mp_.exists():
        return None
    m = read_manifest(mp_)
    shard = m.get("shard")
    if shard is not None:  # sharded precomputed or zarr: the task's chunks are its one shard
        if shard["status"] != "written":
            return True
        f = Path(m["layer"].removeprefix("zarr://").removeprefix("file://")) / shard["name"]
        return f.is_file() and digest(f.read_bytes()) == shard["sha256"]
    for c in m["chunks"]:
        if c["status"] != "written":
            continue
        f = list(case.out.rglob(c["name"].split("/")[-1]))
        if len(f) != 1 or digest(f[0].read_bytes()) != c["sha256"]:
            return False
    return True


def job_of(case: Case, task: int) -> int:
    """The workflow job that runs ``task`` (from the schedule the workflow cached)."""
    from znni_core.pipeline.run import load_run, run_geometry

    per = json.loads((case.work / "schedule.json").read_text())["tasks_per_job"]
    return run_geometry(load_run(case.run_file))[3].index(task) // per


def forget_task(case: Case, task: int) -> None:
    """Lose a task's manifest and its job's marker (as a crash before both would)."""
    case.manifest(task).unlink(missing_ok=True)
    (case.work / "jobs" / f"{job_of(case, task):06d}.json").unlink(missing_ok=True)


def ran_tasks(case: Case, since: float) -> set[int]:
    """Tasks computed (not skipped) by the jobs whose marker was written after ``since``."""
    ran = set()
    for p in (case.work / "jobs").glob("*.json") if (case.work / "jobs").is_dir() else []:
        if p.stat().st_mtime >= since:
            ran |= {r["task"] for r in json.loads(p.read_text())["ran"]}
    return ran


def kill_tree(pid: int, sig=signal.SIGKILL) -> None:
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
