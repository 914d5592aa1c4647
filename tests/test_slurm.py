"""The workflow on a real SLURM (scripts/slurm/up.sh): T4 and T5 of docs/reliability.md.

Skipped where ``sbatch`` is absent. Each test runs `snakemake --profile slurm` semantics through
the repository's profile (profiles/slurm), with resources overridden per test.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from tests import faults_helpers as H
from tests.test_faults_workflow import _done_tasks, chain_timeout, chained_kills, fresh, golden_files  # noqa: F401

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


def _job_ids(case, task: int) -> list[str]:
    """SLURM job ids of `infer_job` for one task (one task per job here), oldest first; the run
    must keep successful jobs' logs (`--slurm-keep-successful-logs`)."""
    d = case.root / ".snakemake" / "slurm_logs" / "rule_infer_job" / f"{task:06d}"
    return sorted((f.stem for f in d.glob("*.log")), key=int)


def _job_pids(jid: str) -> list[int]:
    """The processes of job ``jid`` on this node (`scontrol listpids`)."""
    out = subprocess.run(["scontrol", "listpids", jid], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()[1:] if line.split() and line.split()[0].isdigit()]


def _stepd(jid: str) -> list[int]:
    """The slurmstepd processes of job ``jid`` (``slurmstepd: [JID.batch]``)."""
    out = subprocess.run(["pgrep", "-f", rf"slurmstepd: \[{jid}\."], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_tree(jid: str) -> None:
    """SIGKILL job ``jid``'s processes on this node and all their descendants (a process the job
    started outlives its parent otherwise), then its slurmstepd."""
    import psutil

    procs = []
    for pid in _job_pids(jid) + _stepd(jid):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _sacct(job_ids) -> list[dict]:
    """Records of finished jobs from SLURM's job completion log, through `sacct --completion`.

    The test cluster has no slurmdbd; scripts/slurm/up.sh sets `JobCompType=jobcomp/filetxt`, which
    `sacct -c` reads: one record per end of a job (a requeued job has one per run). This sacct
    leaves the memory column empty for completion data, so `mem` comes from the same record's TRES
    in the completion log itself."""
    fields = "JobIDRaw,State,Timelimit,Start"
    out = subprocess.run(
        ["sacct", "-c", "--parsable2", "--noheader", f"--format={fields}", "-S", "2000-01-01", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    loc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    path = re.search(r"^JobCompLoc\s*=\s*(\S+)", loc, re.M).group(1)
    mem = {}  # (job id, start) -> memory TRES of that run
    for line in open(path).read().splitlines():
        kv = dict(w.split("=", 1) for w in line.split() if "=" in w)
        tres = dict(t.split("=", 1) for t in kv.get("Tres", "").split(",") if "=" in t)
        mem[(kv.get("JobId"), kv.get("StartTime"))] = tres.get("mem")
    rows = []
    for line in out.splitlines():
        jid, state, limit, start = line.split("|")
        rows.append({"id": jid, "state": state.split()[0], "timelimit": limit, "mem": mem.get((jid, start))})
    return rows


@pytest.mark.timeout(chain_timeout(KILLS))
def test_t4_kill_snakemake_main_slurm_and_resume(fresh, golden_files, tmp_path):
    case = fresh.copy(tmp_path / "case")
    stats = chained_kills(case, golden_files, kills=KILLS, profile=SLURM, seed0=5000, delay=(3.0, 25.0))
    assert stats["landed"] >= 1, f"no kill interrupted work: {stats}"


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
    p = H.snakemake(
        case,
        "--set-resources",
        "validate:mem_mb=1000",
        mem,
        rt,
        "--slurm-keep-successful-logs",
        profile=SLURM,
        env=env,
        timeout=500,
    )
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
    # what SLURM itself recorded: attempt 2 really ran with twice the memory, or twice the time
    oom = _sacct(_job_ids(case, 2))
    assert [r["state"] for r in oom][0] in ("OUT_OF_MEMORY", "FAILED"), oom
    assert (oom[0]["mem"], oom[-1]["mem"], oom[-1]["state"]) == ("1000M", "2000M", "COMPLETED"), oom
    slow = _sacct(_job_ids(case, 5))
    assert [(r["state"], r["timelimit"]) for r in slow][0] == ("TIMEOUT", "1"), slow
    assert (slow[-1]["state"], slow[-1]["timelimit"]) == ("COMPLETED", "2"), slow


#: SLURM's end states: the wrapped sacct of the UNKNOWN case reports each of them as UNKNOWN
ENDED = "COMPLETED|FAILED|CANCELLED|TIMEOUT|OUT_OF_MEMORY|NODE_FAIL|BOOT_FAIL|DEADLINE|PREEMPTED"


def test_t5_unknown_state_counts_only_if_the_marker_exists(fresh, golden_files, tmp_path):
    """A wrapped `sacct` reports every job that ended as UNKNOWN (queued and running ones as
    `squeue` has them), which the plugin takes for success: only a job's marker decides. The
    first attempt of task 5's job is SIGKILLed after its chunk, before its manifest and marker
    (``after-chunk-once``, a marker file proves it): SLURM ends it FAILED, sacct says UNKNOWN,
    Snakemake finds no marker (MissingOutputException) and retries the job. Every other job counts
    at once. The run completes byte-identical; task 5's job ran twice, every other job once."""
    case = fresh.copy(tmp_path / "case")
    fake = tmp_path / "bin"
    fake.mkdir()
    answers = tmp_path / "sacct.out"
    (fake / "sacct").write_text(
        "#!/bin/bash\n# the plugin's status query (sacct ... --format=JobIdRaw,State --name RUN): the jobs\n"
        "# of the run from squeue, every end state answered UNKNOWN\n"
        'name=""; while [ $# -gt 0 ]; do [ "$1" = --name ] && name=$2; shift; done\n'
        f"squeue -h --states=all --name \"$name\" -o '%i|%T' | sed -E 's/[|]({ENDED})$/|UNKNOWN/' | tee -a {answers}\n"
    )
    (fake / "sacct").chmod(0o755)
    env = H.fault_env(
        "after-chunk-once:5:1", {"ZNNI_FAULT_DIR": str(tmp_path), "PATH": f"{fake}:{H.job_env()['PATH']}"}
    )
    p = H.snakemake(
        case,
        "--slurm-status-command",
        "sacct",
        "--latency-wait",
        "3",
        "--slurm-keep-successful-logs",
        profile=SLURM,
        env=env,
        timeout=500,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert (tmp_path / "killed-5").read_text() == "task 5 after chunk 1 of 1\n", "the kill never happened"
    assert H.kills(tmp_path) == ["after-chunk-once task 5 after chunk 1 of 1"]
    said = answers.read_text().splitlines()
    assert any(a.endswith("|UNKNOWN") for a in said) and not re.search(rf"[|]({ENDED})$", "\n".join(said), re.M)
    # exactly one job was found without its marker: task 5's killed first attempt
    missing = [re.search(r"jobs/(\d{6})\.json", b).group(1) for b in out.split("MissingOutputException")[1:]]
    assert missing == ["000005"], out[-4000:]
    assert {t["id"]: len(_job_ids(case, t["id"])) for t in case.tasks()} == {
        t["id"]: 2 if t["id"] == 5 else 1 for t in case.tasks()
    }
    assert _done_tasks(case) == {t["id"] for t in case.tasks()}
    H.assert_same_chunks(H.layer_files(case.out), golden_files, "T5 UNKNOWN")


@pytest.mark.skipif(
    os.environ.get("ZNNI_NODE_FAIL") != "1", reason="downs the cluster's only node: `make faults` (ZNNI_NODE_FAIL=1)"
)
def test_t5_node_fail_mid_task_requeued_and_byte_identical(fresh, golden_files, tmp_path):
    """The node goes down (`scontrol update state=down`) while task 3 is inside its compute: SLURM
    ends the job NODE_FAIL and requeues it (the profile's `slurm-requeue`), the requeued run skips
    nothing it has not verified, and the layer is byte-identical.

    Task 3 sleeps 40 s inside its first compute; a marker written before the sleep proves where
    the node failed. A node that fails takes its processes with it: here the node is only marked
    down, so the test kills the job's processes itself and resumes the node once they are gone
    (a job relaunched beside its old self drains the node: "Duplicate jobid"). SLURM holds a
    requeued job for about two minutes (its begin time): the test releases it at once
    (`scontrol release`, `scontrol update jobid=... starttime=now`), as an operator would."""
    case = fresh.copy(tmp_path / "case")
    env = H.fault_env("sleep-once:3:40", {"ZNNI_FAULT_DIR": str(tmp_path)})
    host = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()[0]
    marker = tmp_path / "slept-3"
    failed = {}

    def fail_node():
        while not failed and not stop.is_set():
            ids = _job_ids(case, 3)
            running = {j for j, st, _ in _squeue() if st == "RUNNING"}
            if marker.exists() and ids and ids[-1] in running:
                failed["job"] = ids[-1]
                subprocess.run(["scontrol", "update", f"nodename={host}", "state=down", "reason=znni-T5"], check=True)
                for jid in running:  # every job on the node dies with it, its whole process tree
                    _kill_tree(jid)
                for _ in range(600):  # until nothing of any of them is left on the node
                    if not any(_job_pids(j) or _stepd(j) for j in running):
                        break
                    time.sleep(0.1)
                subprocess.run(["scontrol", "update", f"nodename={host}", "state=resume"], capture_output=True)
            time.sleep(0.3)
        while not stop.is_set():  # release requeued jobs: held, or waiting for their begin time
            for jid, st, _ in _squeue():
                if st == "PENDING":
                    subprocess.run(["scontrol", "release", jid], capture_output=True)
                    subprocess.run(["scontrol", "update", f"jobid={jid}", "starttime=now"], capture_output=True)
            time.sleep(1)

    stop = threading.Event()
    th = threading.Thread(target=fail_node, daemon=True)
    th.start()
    try:
        p = H.snakemake(case, "--slurm-keep-successful-logs", profile=SLURM, env=env, timeout=500)
    finally:
        stop.set()
        subprocess.run(["scontrol", "update", f"nodename={host}", "state=resume"], capture_output=True)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert failed, "the node was never failed: task 3 did not reach its compute"
    runs = _sacct([failed["job"]])
    states = [r["state"] for r in runs]  # a relaunch that failed would add a record between
    assert states[0] == "NODE_FAIL" and states[-1] == "COMPLETED", runs
    assert _done_tasks(case) == {t["id"] for t in case.tasks()}
    H.assert_same_chunks(H.layer_files(case.out), golden_files, "T5 after NODE_FAIL")
