"""A work directory in object storage, and jobs that share no file system (docs/cloud.md).

The work directory's objects through :class:`~znni_core.io.workdir.WorkPath` on a loopback S3
server (moto); then the whole workflow with ``work_dir``, input and output on that server, run by
Snakemake's generic cluster executor whose submit script starts every job in a fresh empty
directory (sources deployed through the S3 storage plugin, Snakemake's own files there too). One
job is SIGKILLed mid-task once; Snakemake's retry, in another empty directory, resumes it. The
output equals a local run's byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import faults_helpers as H
from tests.pipeline_helpers import base_config, layer_files, subprocess_env

REPO = Path(__file__).resolve().parents[1]


def _s3(endpoint):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _objects(endpoint, prefix: str) -> dict:
    """{key below ``prefix``: bytes} of the bucket ``znni``."""
    c, out = _s3(endpoint), {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket="znni", Prefix=prefix):
        for o in page.get("Contents", ()):
            out[o["Key"][len(prefix) :]] = c.get_object(Bucket="znni", Key=o["Key"])["Body"].read()
    return out


def _listed(work) -> list:
    return sorted(str(p).rsplit("/w/", 1)[1] for p, _, _ in work.listing())


@pytest.mark.parametrize("proto", ["s3", "gs"])
def test_work_path_reads_writes_and_lists_objects(proto, request, monkeypatch):
    from znni_core.io.atomic import atomic_write
    from znni_core.io.workdir import local_copy, work_path

    server = request.getfixturevalue("moto_s3" if proto == "s3" else "gcs_emulator")
    work = work_path({"work_dir": f"{proto}://znni/w", "work_endpoint_url": server if proto == "s3" else None})
    assert str(work / "jobs" / "000001.json") == f"{proto}://znni/w/jobs/000001.json"
    with pytest.raises(FileNotFoundError):
        (work / "run.json").read_text()
    assert not (work / "run.json").is_file() and not work.exists()
    assert atomic_write(work / "jobs" / "000001.json", b'{"a": 1}')
    assert atomic_write(work / "jobs" / "000002.json", b"{}")
    assert atomic_write(work / "jobs" / "records" / "000001" / "1-h-2.json", b"{}")
    # exclusive: created once; a second creator gets False and the first bytes stay
    assert atomic_write(work / "prediction.json", b"first", exclusive=True)
    if proto == "s3":  # gcp-storage-emulator ignores ifGenerationMatch=0 (GCS honours it)
        assert not atomic_write(work / "prediction.json", b"second", exclusive=True)
        assert (work / "prediction.json").read_bytes() == b"first"
    assert json.loads((work / "jobs" / "000001.json").read_text()) == {"a": 1}
    assert (work / "jobs").is_dir() and (work / "jobs" / "000001.json").is_file()
    assert [p.name for p in (work / "jobs").glob("[0-9]*.json")] == ["000001.json", "000002.json"]
    assert [p.name for p in (work / "jobs").iterdir()] == ["000001.json", "000002.json", "records"]
    assert [str(p) for p in (work / "jobs").rglob("1-*.json")] == [f"{proto}://znni/w/jobs/records/000001/1-h-2.json"]
    assert (work / "jobs" / "000001.json").stat().st_size == 8
    # levels as pathlib's glob: `*` and `?` within one, `**` any number of them
    assert [p.name for p in work.glob("jobs/*.json")] == ["000001.json", "000002.json"]
    assert [p.name for p in work.glob("**/1-*.json")] == ["1-h-2.json"]
    assert [p.name for p in work.glob("jobs?000001.json")] == [] and [p.name for p in work.glob("*.json")] == [
        "prediction.json"
    ]
    assert (work / "jobs").first_file(".json").name == "000001.json"
    (work / "jobs" / "000002.json").unlink()
    (work / "jobs" / "000002.json").unlink(missing_ok=True)
    assert not (work / "jobs" / "000002.json").exists()
    # a local directory for what matplotlib draws, uploaded after, then gone
    with local_copy(work / "report", last="summary.json") as d:
        (d / "summary.json").write_text("{}")
        (d / "preview.png").write_bytes(b"png")
        tmp = d
    assert not tmp.exists()
    assert "report/preview.png" in _listed(work) and "report/summary.json" in _listed(work)
    assert (work / "report" / "summary.json").read_text() == "{}"
    if proto == "gs":
        return
    # a file named by URL alone (a command line's run file): the endpoint from the environment
    monkeypatch.setenv("ZNNI_WORK_ENDPOINT_URL", server)
    from znni_core.pipeline.run import location

    run_file = location(Path("s3://znni/w/jobs/000001.json"))  # as a shell and Path leave it
    assert str(run_file) == "s3://znni/w/jobs/000001.json" and run_file.read_bytes() == b'{"a": 1}'
    # an unreachable store fails like a file system (OSError naming the object), never as "absent"
    monkeypatch.setenv("ZNNI_S3_MAX_ATTEMPTS", "1")
    dead = work_path({"work_dir": "s3://znni/w", "work_endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(OSError, match="000001.json"):
        (dead / "jobs" / "000001.json").read_text()
    with pytest.raises(OSError, match="LIST"):  # a listing refused: the same (never a KeyError)
        list(work_path({"work_dir": "s3://no-such-bucket/w", "work_endpoint_url": server}).iterdir())


def test_work_dir_urls_are_checked_before_anything_runs(tmp_path):
    from znni_core.errors import ConfigError
    from znni_core.pipeline.resolve import resolve
    from znni_core.pipeline.settings import parse_config

    cfg = base_config(tmp_path)
    for bad, what in [
        ("https://host/work", "http"),
        ("s3://", "bucket"),
        ("s3://b/../x", "bucket"),
    ]:
        with pytest.raises(ConfigError, match=what):
            resolve(parse_config(cfg | {"work_dir": bad}))
    with pytest.raises(ConfigError, match="work_endpoint_url"):
        resolve(parse_config(cfg | {"work_endpoint_url": "http://127.0.0.1:9"}))
    from znni_core.io.workdir import work_endpoint

    out = {"path": "s3://o/out", "endpoint_url": "http://o:1"}
    assert work_endpoint({"work_dir": "s3://w/x", "output": out}) == "http://o:1"
    assert work_endpoint({"work_dir": "s3://w/x", "work_endpoint_url": "http://w:2", "output": out}) == "http://w:2"
    assert work_endpoint({"work_dir": "gs://w/x", "output": out}) is None
    assert work_endpoint(parse_config(cfg | {"work_dir": "s3://w/x", "output": out})) == "http://o:1"
    with pytest.raises(ConfigError, match="work_endpoint_url"):
        resolve(parse_config(cfg | {"work_dir": "gs://b/w", "work_endpoint_url": "http://h:1"}))


SUBMIT = """#!/bin/bash
# a batch system with no shared file system: the job script runs in a fresh empty directory
js=$(realpath "$1"); d=$(mktemp -d "{jobs}/job.XXXXXX"); id=$(basename "$d")
( cd "$d" && cp "$js" job.sh && bash job.sh > out.log 2>&1; echo $? > "{jobs}/state.$id" ) >/dev/null 2>&1 &
echo "$id"
"""
STATUS = """#!/bin/bash
f="{jobs}/state.$1"
if [ ! -f "$f" ]; then echo running; elif [ "$(cat "$f")" = 0 ]; then echo success; else echo failed; fi
"""


def _upload_layer(endpoint, local: Path, prefix: str) -> None:
    c = _s3(endpoint)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            c.put_object(Bucket="znni", Key=f"{prefix}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())


@pytest.mark.timeout(900)
def test_workflow_runs_every_job_in_an_empty_directory_with_work_dir_on_s3(moto_s3, tmp_path):
    pytest.importorskip("snakemake_storage_plugin_s3", reason="the dev extra installs the S3 storage plugin")
    pytest.importorskip("snakemake_executor_plugin_cluster_generic")
    env = subprocess_env()
    # the reference: the same config run locally (work_dir and output on this file system)
    ref = base_config(tmp_path / "ref")
    znni = [sys.executable, "-m", "znni_core.cli"]
    marker = str(tmp_path / "layer.json")
    p = subprocess.run(
        # as the workflow's validate rule plans (its memory and threads): one plan, one set of bytes
        [*znni, "validate", "--config-json", json.dumps(ref), "--memory", "2000MiB", "--threads", "1"]
        + ["--layer-marker", marker],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    run_file = Path(ref["work_dir"]) / "run.json"
    n = json.loads(run_file.read_text())["num_tasks"]
    job = [*znni, "run-job", str(run_file), "--job", "0", "--tasks-per-job", str(n)]
    p = subprocess.run(job, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    want = layer_files(ref["output"]["path"])
    assert want

    # the same data and network, input, output and work_dir on S3; the workflow in a directory of
    # its own (its sources are deployed to each job from S3)
    root = tmp_path / "launch"
    root.mkdir()
    for d in ("workflow", "rules"):
        shutil.copytree(REPO / d, root / d, symlinks=False)
    _upload_layer(moto_s3, Path(ref["input"]["path"].removeprefix("file://")), "em")
    net = Path(ref["network"]["path"])
    for f in net.parent.glob(net.stem + ".*"):  # the spec and its weights beside it
        _s3(moto_s3).put_object(Bucket="znni", Key=f"models/{f.name}", Body=f.read_bytes())
    cfg = ref | {
        "network": {"path": f"s3://znni/models/{net.name}", "endpoint_url": moto_s3},
        "work_dir": "s3://znni/work",  # its endpoint: the output's (work_endpoint_url unset)
        "input": ref["input"] | {"path": "s3://znni/em", "endpoint_url": moto_s3},
        "output": ref["output"] | {"path": "s3://znni/out", "endpoint_url": moto_s3},
    }
    (root / "config.yaml").write_text(json.dumps(cfg))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for name, text in (("submit.sh", SUBMIT), ("status.sh", STATUS)):
        (root / name).write_text(text.replace("{jobs}", str(jobs)))
        (root / name).chmod(0o755)
    faults = tmp_path / "faults"
    faults.mkdir()
    victim = 3  # killed once after its first chunk; Snakemake's retry resumes its job elsewhere
    env = H.fault_env(f"after-chunk-once:{victim}:1", {"ZNNI_FAULT_DIR": str(faults)}) | {
        k: v
        for k, v in env.items()
        if k in ("PATH", "ZNNI_CACHE_DIR")  # the reference's calibration
    }
    env["NUMBA_CACHE_DIR"] = os.environ.get("NUMBA_CACHE_DIR") or str(Path.home() / ".cache" / "znni-tests-numba")
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        "workflow/Snakefile",
        "--executor",
        "cluster-generic",
        "--cluster-generic-submit-cmd",
        str(root / "submit.sh"),
        "--cluster-generic-status-cmd",
        str(root / "status.sh"),
        "--default-storage-provider",
        "s3",
        "--default-storage-prefix",
        "s3://znni/snakemake",
        "--storage-s3-endpoint-url",
        moto_s3,
        "--storage-s3-access-key",
        "testing",
        "--storage-s3-secret-key",
        "testing",
        "--shared-fs-usage",
        "none",
        "--job-deploy-sources",
        "--jobs",
        "2",
        "--retries",
        "1",
        "--seconds-between-status-checks",
        "2",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=800)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    # every job ran in an empty directory of its own: none in the launch directory's
    dirs = sorted(d for d in jobs.iterdir() if d.is_dir())
    assert len(dirs) >= 4, dirs  # validate, the infer jobs (one twice), finalize
    assert not (root / "znni").exists() and not (root / "s3:").exists()
    # the kill landed mid-task, and the retry skipped the tasks its job had finished before it
    assert (faults / f"killed-{victim}").read_text().startswith(f"task {victim} after chunk 1 of ")
    work = _objects(moto_s3, "work/")
    markers = [json.loads(v) for k, v in work.items() if k.startswith("jobs/") and k.count("/") == 1]
    assert sum(len(m["ran"]) + len(m["skipped"]) for m in markers) == n
    killed_job = next(m for m in markers if victim in m["tasks"])
    assert killed_job["skipped"] == [t for t in killed_job["tasks"] if t < victim][: len(killed_job["skipped"])]
    assert killed_job["tasks"].index(victim) == 0 or killed_job["skipped"], killed_job
    assert sum(1 for k in work if k.startswith("manifests/")) == n
    assert {"run.json", "plan.json", "identity.json", "schedule.json", "prediction.json"} <= set(work)
    summary = json.loads(work["report/summary.json"])
    assert summary["done"] == n and summary["failed"] == []
    assert {"report/report.html", "report/preview.png"} <= set(work)
    # Snakemake's own files: flags and logs under its storage prefix, beside nothing of znni's
    sm = _objects(moto_s3, "snakemake/znni/")
    assert "report/summary.json.done" in sm and any(k.startswith("logs/jobs/") for k in sm)
    # the run watched from anywhere, by its run file's URL
    p = subprocess.run(
        [*znni, "status", "s3://znni/work/run.json"],
        capture_output=True,
        text=True,
        env=subprocess_env() | {"ZNNI_WORK_ENDPOINT_URL": moto_s3},
    )
    assert p.returncode == 0 and f"{n} of {n} tasks done" in p.stdout + p.stderr, p.stdout + p.stderr
    # the output equals the local run's, object for object
    got = {
        k: v
        for k, v in _objects(moto_s3, "out/").items()
        if k not in ("info", "provenance") and "znni-sha256" not in k.split("/")
    }
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]][:5]
    # changed settings in the same work_dir, launched from a new machine (no .snakemake/ records):
    # refused in the job that validates, the reason (read from the log Snakemake stored in the
    # bucket) on this machine's stderr, and nothing written
    shutil.rmtree(root / ".snakemake")
    (root / "config.yaml").write_text(json.dumps(cfg | {"normalize": cfg["normalize"] | {"shift": 0.5}}))
    env.pop("ZNNI_FAULT", None)
    again = [*cmd[: cmd.index("--retries")], *cmd[cmd.index("--retries") + 2 :]]  # a refusal is not retried
    p = subprocess.run(again, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert p.returncode != 0 and "science.normalize.shift 0.0 -> 0.5" in p.stderr, p.stderr[-3000:]
    assert "validate refused the run" in p.stderr and "skipped (already done)" not in p.stderr
    after = _objects(moto_s3, "out/")
    assert after.keys() >= got.keys() and all(after[k] == got[k] for k in got)
