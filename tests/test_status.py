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
from znni_core.pipeline.jobs import job_record_path, run_job
from znni_core.pipeline.run import load_run

from .pipeline_helpers import base_config, em
from .test_pipeline import prepare

PROGRESS = re.compile(
    r"^task (\d+)/(\d+) \(job (\d+): (\d+)/(\d+)\) done in [\d.]+ s, [\d.e+-]+ Mvox/s, ETA job \d+ (s|min|h)$"
)


def _small(tmp_path):
    """A run of 16 tasks (4 jobs of 4), nothing run yet."""
    cfg = base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 2])
    rf = prepare(cfg)
    return rf, load_run(rf)


def _fail_task(monkeypatch, victim: int):
    from znni_core.pipeline import task as T

    real = T.read_task

    def bad(ctx, task_id, **kw):
        if task_id == victim:
            raise DataError(f"injected read failure of task {victim}")
        return real(ctx, task_id, **kw)

    monkeypatch.setattr(T, "read_task", bad)


def test_job_records_its_attempt_and_logs_a_progress_line_per_task(tmp_path, monkeypatch):
    """A job's record (jobs/records/NNNNNN.json): start, host, pid, SLURM job id, mem_mb given,
    its tasks, the end with wall time and max RSS; each task a plain progress line in its log."""
    rf, run = _small(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "424242")
    lines = []
    t0 = time.time()
    run_job(rf, 1, 4, log=lines.append, mem_mb=1234)
    progress = [m for line in lines if (m := PROGRESS.match(line))]
    assert [int(m.group(4)) for m in progress] == [1, 2, 3, 4], lines
    assert {int(m.group(2)) for m in progress} == {run.num_tasks} and {m.group(3) for m in progress} == {"1"}
    doc = json.loads(job_record_path(run.work_dir, 1).read_text())
    assert doc["format"] == "znni-job-record/1" and doc["run_digest"] == run.digest and doc["attempts_total"] == 1
    (a,) = doc["attempts"]
    assert a["state"] == "done" and a["host"] == socket.gethostname() and a["pid"] == os.getpid()
    assert a["slurm_job"] == "424242" and a["mem_mb"] == 1234 and a["threads"] == 1
    assert t0 <= a["started"] <= a["finished"] and a["seconds"] >= 0 and a["max_rss_mb"] > 0
    assert a["tasks"] == [4, 5, 6, 7] and sorted(a["ran"]) == a["tasks"] and a["skipped"] == [] and a["voxels"] > 0
    # a second attempt is appended; its tasks are skipped (done and verified)
    run_job(rf, 1, 4, log=lines.append)
    doc = json.loads(job_record_path(run.work_dir, 1).read_text())
    assert [x["attempt"] for x in doc["attempts"]] == [1, 2] and doc["attempts"][1]["skipped"] == [4, 5, 6, 7]
    # the prediction is recorded by the run's first job, before any task ran
    pred = json.loads((Path(run.work_dir) / "prediction.json").read_text())
    assert pred["run_digest"] == run.digest and pred["node_hours"] > 0 and pred["voxels"] > 0


def test_a_failed_task_and_a_memory_error_are_recorded(tmp_path, monkeypatch):
    from znni_core.pipeline import task as T

    rf, run = _small(tmp_path)
    _fail_task(monkeypatch, 2)
    with pytest.raises(DataError, match="injected read failure of task 2"):
        run_job(rf, 0, 4, log=lambda *a: None)
    a = json.loads(job_record_path(run.work_dir, 0).read_text())["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "error" and a["exit"] == 1
    assert a["failed_tasks"] == {"2": "injected read failure of task 2"} and sorted(a["ran"]) == [0, 1, 3]
    assert a["error"].startswith("DataError: job 0: 1 of 4 task(s) failed") and a["max_rss_mb"] > 0

    def oom(ctx, ti, **kw):
        raise MemoryError

    monkeypatch.setattr(T, "compute_task", oom)
    with pytest.raises(MemoryError):
        run_job(rf, 1, 4, log=lambda *a: None)
    a = json.loads(job_record_path(run.work_dir, 1).read_text())["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "oom" and a["error"].startswith("MemoryError")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_status_shows_running_failed_throughput_eta_and_slowest_jobs(tmp_path, monkeypatch):
    """Job 0 fails one task, job 1 is done, job 2 runs (a live process's record): the status
    says so, with throughput, ETA and the slowest jobs; its first line is as it always was.
    ``--watch`` redraws until nothing runs; the running job's process gone, it is failed."""
    rf, run = _small(tmp_path)
    _fail_task(monkeypatch, 2)
    with pytest.raises(DataError):
        run_job(rf, 0, 4, log=lambda *a: None)
    run_job(rf, 1, 4, log=lambda *a: None)
    run_job(rf, 3, 4, log=lambda *a: None)
    now = time.time()
    running = {
        "format": "znni-job-record/1",
        "job": 2,
        "run_digest": run.digest,
        "attempts_total": 1,
        "attempts": [
            {
                "attempt": 1,
                "state": "running",
                "started": now - 30,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "mem_mb": 2000,
                "log": str(Path(run.work_dir) / "logs/jobs/000002.log"),
                "tasks": [8, 9, 10, 11],
                "skipped": [],
                "ran": [],
                "failed_tasks": {},
                "voxels": 0,
                "updated": now,
            }
        ],
    }
    rec = job_record_path(run.work_dir, 2)
    rec.write_text(json.dumps(running))
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
    running["attempts"][0]["pid"] = _dead_pid()
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
    record_snakemake_log(run.work_dir, log)
    s = collect(run)
    assert sorted(s["failed"]) == list(range(4, 12)) and not s["running"] and s["not_started"] == list(range(12, 16))
    assert {s["failed"][4]["kind"], s["failed"][8]["kind"]} == {"oom", "timeout"}
    assert s["failed"][4]["log"] == f"{run.work_dir}/logs/jobs/000001.log"
    assert "Snakemake: rule infer_job failed (exit 137): out of memory" in render(s)


def test_a_terminated_job_records_it_then_dies_of_sigterm(tmp_path):
    """SIGTERM (a SLURM time limit, scancel, Snakemake stopping) reaches ``znni run-job`` in a
    task: the attempt is recorded ``terminated`` (exit 143, mem_mb from ``--memory``, the log
    its stderr goes to), then the process dies of the signal as it would without the record."""
    import signal

    from tests import faults_helpers as H

    rf, run = _small(tmp_path)
    log = Path(run.work_dir) / "logs" / "jobs" / "000000.log"
    log.parent.mkdir(parents=True)
    rec = job_record_path(run.work_dir, 0)
    args = [H.ZNNI, "run-job", str(rf), "--job", "0", "--tasks-per-job", "4", "--memory", "1500MiB"]
    with open(log, "w") as f:
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=H.fault_env("hold:2"))
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # until task 2 holds before its manifest (tasks 0 and 1 done)
            try:
                if len(json.loads(rec.read_text())["attempts"][-1]["ran"]) == 2:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == -signal.SIGTERM
    finally:
        p.kill()
    a = json.loads(rec.read_text())["attempts"][-1]
    assert a["state"] == "failed" and a["kind"] == "terminated" and a["exit"] == 143, a
    assert a["mem_mb"] == 1500 and a["log"] == str(log) and a["pid"] == p.pid and sorted(a["ran"]) == [0, 1]
    from znni_core.pipeline.status import collect

    s = collect(run)
    assert sorted(s["failed"]) == [2, 3] and s["failed"][2]["kind"] == "terminated"
