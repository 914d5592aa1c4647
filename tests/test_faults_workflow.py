"""Whole-workflow faults (docs/reliability.md, T4, T15; T4 and T5 on SLURM in test_slurm.py).

T4: the Snakemake main process is SIGKILLed at seeded times, again and again within one run, and
restarted as documented (``--unlock``, then the same command with ``--rerun-incomplete``). After
every kill: no manifest lies, every chunk finished before the kill equals the uninterrupted run
(NL), and the restart reruns none of the tasks that were done (counted from its log). At the end
the layer equals the uninterrupted run byte for byte (BI).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import psutil
import pytest

from tests import faults_helpers as H
from znni_core.io.atomic import TMP_MARK

KILLS = int(os.environ.get("ZNNI_FAULT_KILLS", "20"))


def chain_timeout(kills: int) -> int:
    """pytest-timeout's limit for a chain of ``kills`` kills of Snakemake's main process (20-40 s
    each on 2 cores, restarts included; up to 25 s more on SLURM), after the module's golden run:
    the 20 of ``make faults`` get 50 minutes."""
    return 600 + 120 * kills


def _queued_jobs(case) -> list[str]:
    """SLURM jobs submitted from this case (pending ones have no process yet); [] without SLURM."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i|%Z"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    root = str(case.root)
    return [line.split("|", 1)[0] for line in out.stdout.splitlines() if line.partition("|")[2].rstrip("/") == root]


def _wait_jobs_gone(case, timeout=120):
    """Wait until no job of this case is left: neither a process (orphans of a killed main finish
    or die) nor a SLURM job still queued by the killed main (it would start later and finish a task
    behind the restart's back)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        left = _queued_jobs(case)
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
            except psutil.NoSuchProcess:
                continue
            if str(case.run_file) in cmd or (str(case.root) in cmd and "snakemake" in cmd):
                left.append(p.pid)
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"job processes of {case.root} still running after {timeout} s")


def _done_tasks(case) -> set[int]:
    done = set()
    for t in case.tasks() if case.run_file.exists() else []:
        ok = H.manifest_ok(case, t["id"])
        assert ok is not False, f"task {t['id']}: manifest lists a chunk that does not verify"
        if ok:
            done.add(t["id"])
    return done


def chained_kills(case, golden_files, *, kills, profile, seed0, delay=(1.0, 8.0), reset=3, timeout=400):
    """``kills`` cycles of: start, SIGKILL at a seeded time, check, --unlock, restart to the end, check."""
    rng = random.Random(seed0)
    log = case.root / "snakemake.out"
    # kills: the main process was still running when the kill came; landed: it died of that
    # SIGKILL with work left (the restart had tasks to run)
    stats = {"kills": 0, "landed": 0, "rerun": 0}
    for k in range(kills):
        log.write_text("")
        p = H.start_snakemake(case, profile=profile, log=log)
        try:
            p.wait(rng.uniform(*delay))
            assert p.returncode == 0, log.read_text()[-3000:]  # finished before the kill
        except subprocess.TimeoutExpired:
            if rng.random() < 0.5:  # a crashed session: main process and its local jobs
                os.killpg(p.pid, signal.SIGKILL)
            else:  # only the main process (its jobs run on as orphans)
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
            stats["kills"] += 1
        _wait_jobs_gone(case)
        done = _done_tasks(case)
        every = {t["id"] for t in case.tasks()} if case.run_file.exists() else None  # None: killed in validate
        if p.returncode == -signal.SIGKILL and done != every:
            stats["landed"] += 1
        # a write the kill cut short leaves its temporary (readers never list it; the restart
        # removes it, checked below): the layer is what is left besides temporaries
        files = {n: b for n, b in (H.layer_files(case.out) if case.out.exists() else {}).items() if TMP_MARK not in n}
        H.assert_same_chunks(files, {n: golden_files[n] for n in files if n in golden_files}, f"kill {k}")
        assert set(files) <= set(golden_files), f"kill {k}: unexpected files {sorted(set(files) - set(golden_files))}"
        # restart as documented: --unlock, then the same command (the profile has rerun-incomplete)
        u = H.snakemake(case, "--unlock", profile=profile, timeout=120)
        assert u.returncode == 0, u.stderr[-2000:]
        log.write_text("")
        since = time.time() - 1e-3
        q = H.start_snakemake(case, profile=profile, log=log)
        q.wait(timeout)
        text = log.read_text()
        assert q.returncode == 0, text[-3000:]
        rerun = H.ran_tasks(case, since)
        stats["rerun"] += len(rerun)
        assert not (rerun & done), f"kill {k}: tasks {sorted(rerun & done)} were done but ran again"
        assert rerun | done == {t["id"] for t in case.tasks()}, (
            f"kill {k}: done before restart {sorted(done)}, rerun {sorted(rerun)}:\n{text[-3000:]}"
        )
        H.assert_same_chunks(H.layer_files(case.out), golden_files, f"kill {k}: after restart")
        assert not H.temporaries(case.out)
        # give the next kill work to interrupt: forget a seeded few tasks and the report (as
        # `--forcerun` would; with the report present Snakemake ignores missing intermediates)
        for t in rng.sample([t["id"] for t in case.tasks()], k=min(reset, len(case.tasks()))):
            H.forget_task(case, t)
        (case.work / "report" / "summary.json").unlink(missing_ok=True)
    return stats


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A case nobody has run: kills may land in validate, create-layer or tasks too."""
    return H.make_case(tmp_path_factory.mktemp("wf") / "fresh")


@pytest.fixture(scope="module")
def golden_files(fresh, tmp_path_factory):
    case = H.prepare(fresh.copy(tmp_path_factory.mktemp("wfgold") / "case"))
    for t in case.tasks():
        assert H.run_task_proc(case, t["id"]).exitcode == 0
    return H.layer_files(case.out)


@pytest.mark.slow
@pytest.mark.timeout(chain_timeout(KILLS))
def test_t4_kill_snakemake_main_local_and_resume(fresh, golden_files, tmp_path):
    """Batched: a job runs 3 tasks, so kills land between and inside a job's tasks."""
    import yaml

    case = fresh.copy(tmp_path / "case")
    cfg = yaml.safe_load(case.config.read_text())
    cfg["jobs"] = {"tasks_per_job": 3}
    case.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    stats = chained_kills(case, golden_files, kills=KILLS, profile="profiles/local", seed0=4000)
    assert stats["landed"] >= max(1, KILLS // 2), f"too few kills interrupted work: {stats}"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A case nobody has run whose tasks hold two chunks each, and its uninterrupted layer."""
    case = H.make_case(tmp_path_factory.mktemp("wfpairs") / "fresh", task_chunks=(1, 1, 2))
    run = H.prepare(case.copy(tmp_path_factory.mktemp("wfpairsgold") / "case"))
    for t in run.tasks():
        assert H.run_task_proc(run, t["id"]).exitcode == 0
    return case, H.layer_files(run.out)


@pytest.mark.slow
def test_t1_job_killed_mid_task_is_retried_by_snakemake(pairs, tmp_path):
    """The job running task 3 (two chunks) is SIGKILLed between the task's two chunk writes, once
    (``after-chunk-once``: a marker records where the kill landed); Snakemake's own retry (the
    local profile's ``retries: 1``) runs the job again, which redoes task 3. The run completes and
    the layer equals the uninterrupted run byte for byte."""
    fresh, golden = pairs
    case = fresh.copy(tmp_path / "case")
    env = H.fault_env("after-chunk-once:3:1", {"ZNNI_FAULT_DIR": str(tmp_path)})
    p = H.snakemake(case, profile="profiles/local", env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert (tmp_path / "killed-3").read_text() == "task 3 after chunk 1 of 2\n", "the kill did not land mid-task"
    assert H.kills(tmp_path) == ["after-chunk-once task 3 after chunk 1 of 2"]
    # the job's shell saw its znni die of SIGKILL (bash: 128 + 9); Snakemake then retried it
    assert "Error in rule infer_job" in out and re.search(r"exit status 137|Signals.SIGKILL", out), out[-4000:]
    assert _done_tasks(case) == {t["id"] for t in case.tasks()}
    H.assert_same_chunks(H.layer_files(case.out), golden, "T1 after Snakemake's retry")


@pytest.mark.slow
def test_t15_one_task_always_fails_keep_going(fresh, golden_files, tmp_path):
    case = fresh.copy(tmp_path / "case")
    p = H.snakemake(case, "--retries", 2, profile="profiles/local", env=H.fault_env("fail:5"))
    assert p.returncode != 0
    err = p.stdout + p.stderr
    assert re.search(r"1 not done \(jobs \[5\]\)", err), err[-3000:]
    assert err.count("injected failure of task 5") >= 1 or "000005" in err
    assert _done_tasks(case) == {t["id"] for t in case.tasks()} - {5}
    files = H.layer_files(case.out)
    H.assert_same_chunks(files, {n: golden_files[n] for n in files}, "T15 other tasks")
    assert len(files) == len(golden_files) - 1
    assert not (case.work / "report" / "summary.json").exists()
