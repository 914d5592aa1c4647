"""The workflow on a real SLURM (scripts/slurm/up.sh): T4 and T5 of docs/reliability.md.

Skipped where ``sbatch`` is absent. Each test runs `snakemake --profile slurm` semantics through
the repository's profile (profiles/slurm), with resources overridden per test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from tests import faults_helpers as H
from tests.test_faults_workflow import _done_tasks, chained_kills, fresh, golden_files  # noqa: F401

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs SLURM (sbatch on PATH)"),
]
KILLS = int(os.environ.get("ZNNI_SLURM_KILLS", "5"))
SLURM = "profiles/slurm"


def _squeue(case_name=None):
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%j"], capture_output=True, text=True).stdout
    return [l.split("|") for l in out.splitlines() if l]


def test_t4_kill_snakemake_main_slurm_and_resume(fresh, golden_files, tmp_path):
    case = fresh.copy(tmp_path / "case")
    stats = chained_kills(case, golden_files, kills=KILLS, profile=SLURM, seed0=5000, delay=(3.0, 25.0))
    assert stats["kills"] >= 1, stats


def test_t5_oom_timeout_cancel_retried_with_more(fresh, golden_files, tmp_path):
    """Task 2 exceeds its memory, task 5 its time limit, task 6 is scancel'ed: all retried, BI.

    Task 2 holds 1200 MB on every attempt: over attempt 1's 1000 MB (OUT_OF_MEMORY), within
    attempt 2's 2000 MB. Task 5 sleeps 80 s on its first attempt only, over its 1-minute limit."""
    case = fresh.copy(tmp_path / "case")
    env = H.fault_env("sleep-once:5:80,hog:2:1200", {"ZNNI_FAULT_DIR": str(tmp_path)})
    mem = "infer_job:mem_mb=1000 * attempt"
    rt = "infer_job:runtime=(1 if wildcards.job == '000005' else 30) * attempt"  # one task per job here
    stop = threading.Event()

    def cancel_task6():  # scancel the first running attempt of task 6
        while not stop.is_set():
            for jid, st, _ in _squeue():
                log = case.root / ".snakemake" / "slurm_logs" / "rule_infer_job" / "000006" / f"{jid}.log"
                if st == "RUNNING" and log.exists():
                    subprocess.run(["scancel", jid])
                    return
            time.sleep(0.5)

    th = threading.Thread(target=cancel_task6, daemon=True)
    th.start()
    p = H.snakemake(case, "--set-resources", "validate:mem_mb=1000", mem, rt, profile=SLURM, env=env, timeout=500)
    stop.set()
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert re.search(r"SLURM-job '\d+' failed, SLURM status is: '(FAILED|OUT_OF_MEMORY)'", out), (
        "no memory failure seen"
    )
    assert "SLURM status is: 'TIMEOUT'" in out, "no TIMEOUT seen"
    assert "SLURM status is: 'CANCELLED'" in out, "no CANCELLED seen"
    assert "exceeded memory limit" in "".join(
        f.read_text() for f in (case.root / ".snakemake" / "slurm_logs").rglob("*.log")
    )
    assert _done_tasks(case) == {t["id"] for t in case.tasks()}
    H.assert_same_chunks(H.layer_files(case.out), golden_files, "T5 after retries")


def test_t5_unknown_state_counts_only_if_chunk_verifies(fresh, golden_files, tmp_path):
    """A wrapped `sacct` reports UNKNOWN for every job at once: the plugin takes it for success, so
    Snakemake must find a verified manifest, else the job is an error and is retried."""
    case = fresh.copy(tmp_path / "case")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sacct").write_text(
        "#!/bin/bash\n# every job of the run: UNKNOWN\n"
        "name=''; while [ $# -gt 0 ]; do [ \"$1\" = --name ] && name=$2; shift; done\n"
        "squeue -h --states=all --name \"$name\" -o '%i|UNKNOWN'\n"
    )
    (fake / "sacct").chmod(0o755)
    env = H.fault_env(None, {"PATH": f"{fake}:{H.job_env()['PATH']}"})
    p = H.snakemake(case, "--slurm-status-command", "sacct", "--latency-wait", "3", profile=SLURM, env=env, timeout=500)
    out = p.stdout + p.stderr
    # UNKNOWN arrived while jobs still ran: their manifests were missing -> errors, retried
    assert p.returncode == 0 or "MissingOutputException" in out or "Missing files after" in out, out[-4000:]
    if p.returncode != 0:  # retries exhausted: a rerun finishes; nothing unverified was marked done
        for m in sorted((case.work / "manifests").rglob("*.json")) if (case.work / "manifests").is_dir() else []:
            assert H.manifest_ok(case, int(m.stem)) is True, f"{m} does not verify"
        p = H.snakemake(case, profile=SLURM, timeout=500)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _done_tasks(case) == {t["id"] for t in case.tasks()}
    H.assert_same_chunks(H.layer_files(case.out), golden_files, "T5 UNKNOWN")
