"""``znni status`` (pipeline/status.py) and the jobs' records and progress lines (pipeline/jobs.py):
done / running / failed / masked tasks, throughput, ETA, the slowest jobs, ``--watch``."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from znni_core.cli import app
from znni_core.errors import DataError
from znni_core.pipeline.jobs import ATTEMPT_FORMAT, JobRecord, job_record, job_records_dir, records_dir, run_job
from znni_core.pipeline.run import load_run

from .pipeline_helpers import base_config, em, fail_task
from .test_pipeline import prepare

PROGRESS = re.compile(
    r"^task (\d+)/(\d+) \(job (\d+): (\d+)/(\d+)\) done in [\d.]+ s, [\d.e+-]+ Mvox/s, "
    r"ETA job (\d+\.\d s|\d+ min \d\d s|\d+ h \d\d min|\d+ d \d\d h)$"
)
NAME = re.compile(r"^\d{20}-[\w.]+-\d+\.json$")


def _small(tmp_path):
    """A run of 16 tasks (4 jobs of 4), nothing run yet."""
    cfg = base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 2])
    rf = prepare(cfg)
    return rf, load_run(rf)


def test_job_records_its_attempt_and_logs_a_progress_line_per_task(tmp_path, monkeypatch):
    """A job's attempt records (jobs/records/NNNNNN/<start>-<host>-<pid>.json, one file each):
    start, host, pid, SLURM job id, mem_mb given, its tasks, the end with wall time and max RSS;
    each task a plain progress line in its log (its ETA as ``status`` writes durations)."""
    rf, run = _small(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    lines = []
    t0 = time.time()
    run_job(rf, 1, 4, log=lines.append, mem_mb=1234)
    progress = [m for line in lines if (m := PROGRESS.match(line))]
    assert [int(m.group(4)) for m in progress] == [1, 2, 3, 4], lines
    assert {int(m.group(2)) for m in progress} == {run.num_tasks} and {m.group(3) for m in progress} == {"1"}
    (f,) = job_records_dir(run.work_dir, 1).iterdir()
    assert NAME.match(f.name) and f.name.endswith(f"-{os.getpid()}.json"), f.name
    raw = json.loads(f.read_text())
    assert (
        raw["format"] == ATTEMPT_FORMAT and raw["job"] == 1 and raw["run_digest"] == run.digest and raw["attempt"] == 1
    )
    doc = job_record(run.work_dir, 1, run.digest)
    assert doc["run_digest"] == run.digest and doc["attempts_total"] == 1
    (a,) = doc["attempts"]
    assert a["state"] == "done" and a["host"] == socket.gethostname() and a["pid"] == os.getpid()
    assert a["slurm_job"] == "424242" and a["mem_mb"] == 1234 and a["threads"] == 1
    assert t0 <= a["started"] <= a["finished"] and a["seconds"] >= 0 and a["max_rss_mb"] > 0
    assert a["tasks"] == [4, 5, 6, 7] and sorted(a["ran"]) == a["tasks"] and a["skipped"] == [] and a["voxels"] > 0
    # a second attempt writes a file of its own; its tasks are skipped (done and verified)
    run_job(rf, 1, 4, log=lines.append)
    assert len(list(job_records_dir(run.work_dir, 1).iterdir())) == 2
    doc = job_record(run.work_dir, 1, run.digest)
    assert [x["attempt"] for x in doc["attempts"]] == [1, 2] and doc["attempts"][1]["skipped"] == [4, 5, 6, 7]
    assert doc["attempts_total"] == 2 and doc["attempts"][0]["ran"] == [4, 5, 6, 7]
    # the prediction is recorded by the run's first job, before any task ran
    pred = json.loads((Path(run.work_dir) / "prediction.json").read_text())
    assert pred["run_digest"] == run.digest and pred["node_hours"] > 0 and pred["voxels"] > 0


def test_a_failed_task_and_a_memory_error_are_recorded(tmp_path, monkeypatch):
    from znni_core.pipeline import task as T

    rf, run = _small(tmp_path)
    fail_task(monkeypatch, 2)
    with pytest.raises(DataError, match="injected read failure of task 2"):
        run_job(rf, 0, 4, log=lambda *a: None)
    a = job_record(run.work_dir, 0)["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "error" and a["exit"] == 1
    assert a["failed_tasks"] == {"2": "injected read failure of task 2"} and sorted(a["ran"]) == [0, 1, 3]
    assert a["error"].startswith("DataError: job 0: 1 of 4 task(s) failed") and a["max_rss_mb"] > 0

    def oom(ctx, ti, **kw):
        raise MemoryError

    monkeypatch.setattr(T, "compute_task", oom)
    with pytest.raises(MemoryError):
        run_job(rf, 1, 4, log=lambda *a: None)
    a = job_record(run.work_dir, 1)["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "oom" and a["error"].startswith("MemoryError")


def _attempt(run, job: int, attempt: int, state: str, started: float, **fields) -> dict:
    """An attempt's record as ``run-job`` writes it (this host and process unless ``fields`` say)."""
    return {
        "format": ATTEMPT_FORMAT,
        "job": job,
        "run_digest": run.digest,
        "attempt": attempt,
        "state": state,
        "started": started,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "tasks": [],
        "skipped": [],
        "ran": [],
        **fields,
    }


def _write_attempt(run, doc: dict, name: str | None = None) -> Path:
    """``doc`` as an attempt file of its job (named by its start, host and pid unless ``name``)."""
    d = job_records_dir(run.work_dir, doc["job"])
    d.mkdir(parents=True, exist_ok=True)
    p = d / (name or f"{int(doc['started'] * 1e9):020d}-{doc['host']}-{doc['pid']}.json")
    p.write_text(json.dumps(doc))
    return p


def _process_start() -> float:
    """This process's start (psutil's), else a minute ago."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except ImportError:
        return time.time() - 60


def _live_pid_started_before(t: float) -> int:
    """A live process (this one, an ancestor, else init) that started before ``t``: a record of
    a running attempt started at ``t`` is then its own, whatever this process's age (a pid younger
    than the attempt is taken for a pid used again)."""
    import psutil

    p = psutil.Process(os.getpid())
    for q in [p] + p.parents():
        if q.create_time() <= t:
            return q.pid
    return 1


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_status_shows_running_failed_throughput_eta_and_slowest_jobs(tmp_path, monkeypatch):
    """Job 0 fails one task, job 1 is done, job 2 runs (a live process's record): the status
    says so, with throughput, ETA and the slowest jobs; its first line is as it always was.
    ``--watch`` redraws until nothing runs; the running job's process gone, it is failed."""
    rf, run = _small(tmp_path)
    fail_task(monkeypatch, 2)
    with pytest.raises(DataError):
        run_job(rf, 0, 4, log=lambda *a: None)
    run_job(rf, 1, 4, log=lambda *a: None)
    run_job(rf, 3, 4, log=lambda *a: None)
    now = time.time()
    running = _attempt(
        run,
        2,
        1,
        "running",
        now - 30,
        mem_mb=2000,
        log=str(Path(run.work_dir) / "logs/jobs/000002.log"),
        tasks=[8, 9, 10, 11],
        failed_tasks={},
        voxels=0,
        updated=now,
        pid=_live_pid_started_before(now - 30),
    )
    rec = _write_attempt(run, running)
    r = CliRunner().invoke(app, ["status", run.work_dir])  # the work dir is enough
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "11 of 16 tasks done; not done: [2, 8, 9, 10, 11]", r.output
    assert lines[1] == "tasks: 11 done, 4 running, 1 failed, 0 masked, 0 not started", r.output
    assert re.search(r"running job 2: 0 of 4 task\(s\) done, 3\d\.\d s so far, attempt 1, ", r.output), r.output
    assert "failed job 0 (attempt 1): task(s) [2]: injected read failure of task 2" in r.output
    assert re.search(
        r"throughput: [\d,.]+ tasks/h, [\d.e+-]+ Mvoxels/s over .* busy; ETA .* for 4 task\(s\) left", r.output
    )
    assert re.search(r"slowest jobs: job [012] .*max RSS", r.output), r.output
    # --watch redraws while a job runs (here twice, then the test's limit; the default interval once)
    r = CliRunner().invoke(app, ["status", str(rf), "--watch", "0.01", "--max-iterations", "2"])
    assert r.exit_code == 0 and r.output.count("tasks: 11 done, 4 running") == 2, r.output
    r = CliRunner().invoke(app, ["status", str(rf), "--watch", "--max-iterations", "1"])
    assert r.exit_code == 0 and r.output.count("tasks: 11 done, 4 running") == 1, r.output
    # the process is gone without a record: its tasks failed (killed), and the watch ends by itself
    running["pid"] = _dead_pid()
    rec.write_text(json.dumps(running))
    r = CliRunner().invoke(app, ["status", str(rf), "--watch", "0.01"])
    assert r.exit_code == 1 and r.output.count("tasks: 11 done, 0 running, 5 failed") == 1, r.output
    assert "failed job 2 (attempt 1, killed without a record (SIGKILL: exit 137" in r.output, r.output


def test_watch_returns_when_every_task_is_done(tmp_path):
    from znni_core.pipeline.status import watch

    rf, run = _small(tmp_path)
    for j in range(4):
        run_job(rf, j, 4, log=lambda *a: None)
    out, sleeps = [], []
    s = watch(run, 5, out.append, sleep=sleeps.append)
    assert len(out) == 1 and not sleeps and len(s["done"]) == 16 and "nothing left to run" in out[0], out


def test_snakemake_log_failures_count_as_failed_jobs(tmp_path):
    """A job Snakemake saw killed (exit 137) before it wrote anything is failed, as out of memory;
    a SLURM TIMEOUT is a timeout (``znni report --snakemake-log`` records them)."""
    from znni_core.pipeline.report import parse_snakemake_log, record_snakemake_log
    from znni_core.pipeline.status import collect, render

    rf, run = _small(tmp_path)
    run_job(rf, 0, 4, log=lambda *a: None)
    (Path(run.work_dir) / "schedule.json").write_text(json.dumps({"tasks_per_job": 4}))
    text = (
        "RuleException:\nCalledProcessError in file rules/infer.smk, line 32:\n"
        "Command 'set -euo pipefail; znni run-job ...' returned non-zero exit status 137.\n"
        "[Sun Nov 29 04:36:46 2026]\nError in rule infer_job:\n    message: None\n    jobid: 8\n"
        f"    output: {run.work_dir}/jobs/000001.json\n    log: {run.work_dir}/logs/jobs/000001.log (check log file(s))\n"
        "    shell:\n        znni run-job\n        (command exited with non-zero exit code)\n"
        "Error in rule infer_job:\n    message: SLURM-job '77' failed, SLURM status is: 'TIMEOUT'. For further error details\n"
        f"    output: {run.work_dir}/jobs/000002.json\n"
        "Error in rule finalize:\n    message: None\n    log: logs/finalize.log\n"
    )
    got = parse_snakemake_log(text)
    assert [(e["rule"], e["job"], e["exit"], e["slurm_state"]) for e in got] == [
        ("infer_job", 1, 137, None),
        ("infer_job", 2, None, "TIMEOUT"),
        ("finalize", None, None, None),
    ]
    log = tmp_path / "snakemake.log"
    log.write_text(text)
    record_snakemake_log(run.work_dir, log, run.digest)
    recorded = json.loads((records_dir(run.work_dir) / "snakemake-errors.json").read_text())
    assert recorded["run_digest"] == run.digest and recorded["recorded"] > 0
    s = collect(run)
    assert sorted(s["failed"]) == list(range(4, 12)) and not s["running"] and s["not_started"] == list(range(12, 16))
    assert {s["failed"][4]["kind"], s["failed"][8]["kind"]} == {"oom", "timeout"}
    assert s["failed"][4]["log"] == f"{run.work_dir}/logs/jobs/000001.log"
    assert "Snakemake: rule infer_job failed (exit 137): out of memory" in render(s)
    # recorded for another run (the config changed since, same work dir), or for no run known: not this run's
    record_snakemake_log(run.work_dir, log, "another run's digest")
    s = collect(run)
    assert not s["failed"] and not s["running"] and s["not_started"] == list(range(4, 16)), s["failed"]
    del recorded["run_digest"]
    (records_dir(run.work_dir) / "snakemake-errors.json").write_text(json.dumps(recorded))
    assert not collect(run)["failed"]


def test_a_terminated_job_records_it_then_dies_of_sigterm(tmp_path):
    """SIGTERM (a SLURM time limit, scancel, Snakemake stopping) reaches ``znni run-job`` in a
    task: the attempt is recorded ``terminated`` (exit 143, mem_mb from ``--memory``, the log
    its stderr goes to), then the process dies of the signal as it would without the record."""
    import signal

    from tests import faults_helpers as H

    rf, run = _small(tmp_path)
    log = Path(run.work_dir) / "logs" / "jobs" / "000000.log"
    log.parent.mkdir(parents=True)
    args = [H.ZNNI, "run-job", str(rf), "--job", "0", "--tasks-per-job", "4", "--memory", "1500MiB"]
    with open(log, "w") as f:
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=H.fault_env("hold:2"))
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # until task 2 holds before its manifest (tasks 0 and 1 done)
            rec = job_record(run.work_dir, 0)
            if rec is not None and len(rec["attempts"][-1]["ran"]) == 2:
                break
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == -signal.SIGTERM
    finally:
        p.kill()
    a = job_record(run.work_dir, 0)["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "terminated" and a["exit"] == 143, a
    assert a["mem_mb"] == 1500 and a["log"] == str(log) and a["pid"] == p.pid and sorted(a["ran"]) == [0, 1]
    from znni_core.pipeline.status import collect

    s = collect(run)
    assert sorted(s["failed"]) == [2, 3] and s["failed"][2]["kind"] == "terminated"


def test_records_that_are_not_attempts_are_ignored_and_never_fail_the_job(tmp_path):
    """A record file that parses but is no attempt (the old one-file record without ``attempts``,
    a list, a number where an id goes, a string for ``attempts``), or does not parse: the job runs,
    its own attempt is recorded as attempt 1, and ``status`` reads around them."""
    from znni_core.pipeline.status import collect

    rf, run = _small(tmp_path)
    d = job_records_dir(run.work_dir, 0)
    d.mkdir(parents=True)
    good = _attempt(run, 0, 1, "done", 1.0)
    bad = {
        "00000000000000000001-h-1.json": b"{not json",
        "00000000000000000002-h-1.json": b"\xff\xfe",
        "00000000000000000003-h-1.json": b"[]",
        "00000000000000000004-h-1.json": json.dumps(good | {"attempt": "1"}).encode(),
        "00000000000000000005-h-1.json": json.dumps(good | {"ran": 5}).encode(),
        "00000000000000000006-h-1.json": json.dumps(good | {"failed_tasks": {"x": "e"}}).encode(),
        "00000000000000000007-h-1.json": json.dumps(good | {"started": None}).encode(),
        "00000000000000000008-h-1.json": json.dumps({"format": ATTEMPT_FORMAT, "attempts": "no"}).encode(),
    }
    for name, data in bad.items():
        (d / name).write_bytes(data)
    legacy = records_dir(run.work_dir) / "000000.json"  # the one-file record of before, malformed
    legacy.write_text(json.dumps({"format": "znni-job-record/1", "job": 0, "run_digest": run.digest}))
    lines = []
    run_job(rf, 0, 4, log=lines.append)
    assert not any("job record" in line for line in lines), lines
    doc = job_record(run.work_dir, 0, run.digest)
    (a,) = doc["attempts"]
    assert (
        a["attempt"] == 1 and a["state"] == "done" and sorted(a["ran"]) == [0, 1, 2, 3] and doc["attempts_total"] == 1
    )
    s = collect(run)
    assert s["done"] == [0, 1, 2, 3] and not s["failed"] and s["jobs"][0]["state"] == "done"


def test_two_processes_of_one_job_keep_both_attempts(tmp_path):
    """A resubmission while the old attempt still runs: each writes its own file, so neither
    attempt's updates are lost, whatever order they write in (one record file: the last writer won)."""
    from znni_core.pipeline.status import job_table

    _, run = _small(tmp_path)
    old = JobRecord(run.work_dir, 3, run.digest, log=pytest.fail)
    new = JobRecord(run.work_dir, 3, run.digest, log=pytest.fail)
    old.update(tasks=[12, 13, 14, 15])
    new.update(tasks=[12, 13, 14, 15])
    old.task_done(12, 100)
    new.task_done(13, 100)
    old.task_done(14, 100)
    new.end()
    old.end(MemoryError())
    assert old.path != new.path and old.path.parent == new.path.parent == job_records_dir(run.work_dir, 3)
    doc = job_record(run.work_dir, 3, run.digest)
    assert [(a["attempt"], a["state"], a["ran"]) for a in doc["attempts"]] == [
        (1, "failed", [12, 14]),
        (2, "done", [13]),
    ]
    assert doc["attempts_total"] == 2 and doc["attempts"][0]["kind"] == "oom"
    # both still running, in this live process: neither is taken as killed
    JobRecord(run.work_dir, 2, run.digest, log=pytest.fail)
    JobRecord(run.work_dir, 2, run.digest, log=pytest.fail)
    j = job_table(run)[2]
    assert [a["state"] for a in j["attempts"]] == ["running", "running"] and j["state"] == "running"


def test_a_new_attempt_prunes_only_finished_attempts_beyond_the_bound(tmp_path):
    """The writer of a new attempt removes the job's finished attempt files beyond the newest
    MAX_ATTEMPTS, oldest first (an unreadable file counts as finished, another run's finished ones
    go at once); an attempt that may still run (alive here, or on another host) is never removed,
    one whose process is gone here is.  ``attempts_total`` still counts the pruned ones."""
    from znni_core.pipeline.jobs import MAX_ATTEMPTS

    _, run = _small(tmp_path)
    t = _process_start()  # the live attempt's start: not before this process (else a pid used again)
    garbage = job_records_dir(run.work_dir, 1) / "00000000000000000001-x-1.json"
    garbage.parent.mkdir(parents=True)
    garbage.write_text("{")
    live = _write_attempt(run, _attempt(run, 1, 1, "running", t + 0.001))
    remote = _write_attempt(run, _attempt(run, 1, 2, "running", t + 0.002, host="elsewhere.example", pid=1))
    dead = _write_attempt(run, _attempt(run, 1, 3, "running", t + 0.003, pid=_dead_pid()))
    done = [_write_attempt(run, _attempt(run, 1, 4 + k, "done", t + 0.004 + k / 1000)) for k in range(25)]
    other = _write_attempt(run, _attempt(run, 1, 1, "done", t + 0.04) | {"run_digest": "another run"})
    JobRecord(run.work_dir, 1, run.digest, log=pytest.fail)
    left = set(job_records_dir(run.work_dir, 1).iterdir())
    # 30 files of this run with the new one; the garbage, the dead one and the 8 oldest done ones go
    assert len(left) == MAX_ATTEMPTS and {live, remote} <= left and not {garbage, dead, other} & left
    assert set(done[8:]) <= left and not set(done[:8]) & left
    doc = job_record(run.work_dir, 1, run.digest)
    assert len(doc["attempts"]) == MAX_ATTEMPTS and doc["attempts_total"] == 29 and doc["attempts"][-1]["attempt"] == 29
    assert [a["state"] for a in doc["attempts"][:2]] == ["running", "running"]


def test_watch_reads_a_done_tasks_manifest_once(tmp_path, monkeypatch):
    """``--watch`` keeps the done tasks (and their timings) between redraws: done is permanent for
    a run, so each redraw reads only the manifests of the tasks not done yet."""
    from znni_core.pipeline import task as T
    from znni_core.pipeline.status import watch

    rf, run = _small(tmp_path)
    run_job(rf, 0, 4, log=lambda *a: None)
    JobRecord(run.work_dir, 1, run.digest).update(tasks=[4, 5, 6, 7])  # a live attempt: the watch goes on
    reads: dict = {}
    counting = [True]
    real = T.manifest_path

    def spy(r, task_id):
        reads[task_id] = reads.get(task_id, 0) + counting[0]
        return real(r, task_id)

    def between(_):  # job 2 runs between the first and the second redraw (its reads not counted)
        if len(out) == 1:
            counting[0] = False
            run_job(rf, 2, 4, log=lambda *a: None)
            counting[0] = True

    monkeypatch.setattr(T, "manifest_path", spy)
    out = []
    s = watch(run, 1, out.append, max_iterations=3, sleep=between)
    assert len(out) == 3 and sorted(s["done"]) == [0, 1, 2, 3, 8, 9, 10, 11], s["done"]
    assert s["throughput"]["voxels"] > 0 and len(s["running"]) == 4 and "8 of 16 tasks done" in out[-1]
    assert all(reads[t] == 1 for t in (0, 1, 2, 3)), reads  # done before the first redraw
    assert all(reads[t] == 2 for t in (8, 9, 10, 11)), reads  # not done at the first, done at the second
    assert all(reads[t] == 3 for t in (4, 5, 6, 7, 12, 13, 14, 15)), reads  # never done
