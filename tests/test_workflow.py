"""The real workflow: snakemake with the local profile on a tiny volume.

Output == `infer` on the whole volume (float32 tolerance); two runs (jobs of one task, jobs of six)
byte-identical; a rerun after losing half the manifests runs exactly those tasks (T13); `znni
run-task` of one task rewrites only that task's chunks (T14); a batched job killed inside its tasks
resumes task by task (T1); tensorstore reads what cloud-volume reads; lint and dry run pass.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import znni_core
from znni_core.geometry import Roi
from znni_core.io import PrecomputedLayer, parse_layer_url
from znni_core.pipeline.run import load_run

from .pipeline_helpers import base_config, em, layer_files, subprocess_env
from .real_data import DETECTOR, DETECTOR_FILES, DETECTOR_REFERENCE

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [
    sys.executable,
    "-m",
    "snakemake",
    "-s",
    str(REPO / "workflow" / "Snakefile"),
    "--profile",
    str(REPO / "profiles" / "local"),
]


def snakemake(cwd, configfile, *args, check=True):
    p = subprocess.run(
        SNAKEMAKE + ["--configfile", str(configfile), *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def write_config(tmp_path, name, vol, **over):
    # valid output (10, 33, 33), its layer aligned down to the chunk grid (output.align): 2x3x3 chunks, 12 tasks
    over.setdefault("output", {"chunk_size": [6, 17, 17]})
    over.setdefault("jobs", {"tasks_per_job": 1})  # the resume cases count jobs as tasks (auto: 2 jobs here)
    cfg = base_config(tmp_path / name, vol=vol, task_chunks=[1, 1, 2], **over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, path


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run ``a`` in jobs of one task (12 jobs: the rerun cases count jobs as tasks), run ``b`` in two
    jobs of six; ``a``'s report as it was then is kept beside them (``a-report.json``: T13 reruns
    its finalize)."""
    tmp = tmp_path_factory.mktemp("wf")
    vol = em((12, 40, 40))
    out = []
    for name, per in (("a", 1), ("b", 6)):
        cfg, path = write_config(tmp, name, vol, jobs={"tasks_per_job": per})
        p = snakemake(tmp, path)
        out.append((cfg, path, p))
    report = Path(out[0][0]["work_dir"]) / "report" / "report.json"
    (tmp / "a-report.json").write_bytes(report.read_bytes())
    return tmp, vol, out


def test_workflow_equals_infer_and_is_byte_identical(two_runs):
    tmp, vol, [(cfg_a, _, pa), (cfg_b, _, _)] = two_runs
    assert "znni summary" in pa.stderr and "0 not done" in pa.stderr
    layer = PrecomputedLayer(parse_layer_url(cfg_a["output"]["path"]), 0)
    got, _ = layer.read(Roi.from_dict(load_run(Path(cfg_a["work_dir"]) / "run.json").region))
    net = znni_core.load_network(cfg_a["network"]["path"])
    ref = znni_core.infer(net, vol.astype(np.float32) * np.float32(1 / 255))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    a, b = layer_files(cfg_a["output"]["path"]), layer_files(cfg_b["output"]["path"])
    assert a and a == b
    report = Path(cfg_a["work_dir"]) / "report"
    s = json.loads((report / "summary.json").read_text())
    assert s["failed"] == [] and s["done"] == s["tasks"] and (report / "preview.png").stat().st_size > 0
    assert "neuroglancer" in s and (report / "report.html").is_file()
    for log in ("validate.log", "jobs/000000.log", "finalize.log"):
        assert (Path(cfg_a["work_dir"]) / "logs" / log).is_file()


def test_tensorstore_reads_what_cloudvolume_reads(two_runs):
    import tensorstore as ts

    _, _, [(cfg, _, _), _] = two_runs
    layer = PrecomputedLayer(parse_layer_url(cfg["output"]["path"]), 0)
    cv, _ = layer.read(layer.bounds)
    t = ts.open(
        {"driver": "neuroglancer_precomputed", "kvstore": "file://" + str(Path(cfg["output"]["path"]).resolve())}
    ).result()
    b, e = layer.bounds.begin.xyz(), layer.bounds.end.xyz()
    arr = np.asarray(t[b[0] : e[0], b[1] : e[1], b[2] : e[2], :].read().result()).transpose(3, 2, 1, 0)
    assert np.array_equal(arr, cv)


def _jobs_run(p, rule):
    return len(re.findall(rf"\(Rule: {rule}\)", p.stdout + p.stderr))  # "Finished jobid: N (Rule: x)"


def _ran(work, since):
    """Tasks computed (not skipped) by jobs whose marker was written after ``since``."""
    ran = []
    for p in sorted((Path(work) / "jobs").glob("*.json")):
        if p.stat().st_mtime >= since:
            ran += [r["task"] for r in json.loads(p.read_text())["ran"]]
    return sorted(ran)


@pytest.mark.slow  # ~30 s; the same cases run in-process in tests/test_pipeline.py
def test_T13_T14_rerun_only_unfinished_or_forced_tasks(two_runs):
    import time

    tmp, _, [(cfg, path, _), _] = two_runs
    work = Path(cfg["work_dir"])
    manifests = sorted((work / "manifests").rglob("*.json"))
    n = json.loads((work / "run.json").read_text())["num_tasks"]
    assert len(manifests) == n >= 4
    assert json.loads((work / "schedule.json").read_text())["num_jobs"] == n  # one task per job here
    before = layer_files(cfg["output"]["path"])
    root = Path(cfg["output"]["path"])
    # T13: lose two manifests and their jobs' markers (a crash after their chunks): exactly those rerun
    lost = [int(m.stem) for m in manifests[::2]]
    for t in lost:
        (work / "manifests" / "0000" / f"{t:06d}.json").unlink()
        (work / "jobs" / f"{t:06d}.json").unlink()  # job k runs task k (12 tasks, 1 per job)
    for f in (work / "report").iterdir():  # the crash came before finalize
        f.unlink()
    t0 = time.time()
    p = snakemake(tmp, path)
    assert _jobs_run(p, "infer_job") == len(lost), p.stdout[-2000:]
    assert _ran(work, t0) == lost
    assert f"{len(lost)} done now, {n - len(lost)} skipped" in p.stderr
    assert layer_files(cfg["output"]["path"]) == before
    # --force of a job re-verifies its task: nothing rewritten
    mt = {k: (root / k).stat().st_mtime_ns for k in before}
    t0 = time.time()
    p = snakemake(tmp, path, "--force", str(work / "jobs" / "000001.json"))
    assert _jobs_run(p, "infer_job") == 1 and _ran(work, t0) == []
    assert {k for k in before if (root / k).stat().st_mtime_ns != mt[k]} == set()
    # T14: redo one task as documented: only its chunks are rewritten, the report is refreshed
    target = manifests[1]
    own = {c["name"] for c in json.loads(target.read_text())["chunks"]}
    r = subprocess.run(
        [
            str(Path(sys.executable).with_name("znni")),
            "run-task",
            str(work / "run.json"),
            "--task",
            str(int(target.stem)),
            "--no-progress",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    changed = {k for k in before if (root / k).stat().st_mtime_ns != mt[k]}
    assert changed == own
    assert layer_files(cfg["output"]["path"]) == before
    p = snakemake(tmp, path, "--forcerun", "finalize")
    assert _jobs_run(p, "finalize") == 1 and _jobs_run(p, "infer_job") == 0


def test_jobs_as_boxes_of_tasks_fetch_the_input_they_share_once(two_runs, tmp_path):
    """``jobs.tasks_per_job: auto`` makes a job a box of tasks where that fetches less than runs of
    consecutive tasks (here 1x3x1 of a 2x3x2 task grid: tasks 0, 2, 4 in a job): every task runs in
    exactly one job, the chunk reads the tasks record equal the prediction and are fewer than tasks
    alone fetch, and the output is byte for byte that of jobs of one task."""
    tmp, vol, [(cfg_a, _, _), _] = two_runs
    cfg, path = write_config(tmp_path, "box", vol, jobs={"voxels_per_second": 1000, "minutes": 0.2})
    p = snakemake(tmp_path, path, "--cores", "2")
    work = Path(cfg["work_dir"])
    s = json.loads((work / "schedule.json").read_text())
    assert s["brick"] == [1, 3, 1] and s["num_jobs"] == 4 and "a job is a box of 1x3x1 tasks" in s["why"], s
    assert "12 done now" in p.stderr and "0 not done" in p.stderr
    runs = [json.loads((work / "jobs" / f"{j:06d}.json").read_text())["tasks"] for j in range(4)]
    assert sorted(t for r in runs for t in r) == list(range(12)) and runs[0] == [0, 2, 4], runs
    reads = json.loads((work / "report" / "report.json").read_text())["cost"]["reads"]
    alone = json.loads((tmp / "a-report.json").read_text())["cost"]["reads"]
    assert (
        reads["chunk_reads"] == reads["predicted_chunk_reads"] < alone["chunk_reads"] == alone["predicted_chunk_reads"]
    )
    assert layer_files(cfg["output"]["path"]) == layer_files(cfg_a["output"]["path"])


@pytest.mark.slow  # ~40 s
def test_T1_batched_job_killed_inside_resumes_task_by_task(two_runs, tmp_path):
    """Jobs of 5 tasks; the job of tasks 5-9 is SIGKILLed between the two chunk writes of task 8
    (the kill hook records where it landed; one of task 8's chunks is on storage). The rerun runs
    only that job, skips its verified tasks 5, 6 and 7 and computes 8 and 9; bytes as unbatched."""
    import time

    from .faults_helpers import INJECT_DIR, kills

    _, vol, [(cfg_a, _, _), _] = two_runs
    cfg, path = write_config(tmp_path, "batched", vol, jobs={"tasks_per_job": 5})
    faults = tmp_path / "faults"
    faults.mkdir()
    env = subprocess_env() | {
        "ZNNI_FAULT": "after-chunk:8:1",
        "ZNNI_FAULT_DIR": str(faults),
        "PYTHONPATH": str(INJECT_DIR),
    }
    p = subprocess.run(
        SNAKEMAKE + ["--configfile", str(path), "--retries", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode != 0
    assert kills(faults) == ["after-chunk task 8 after chunk 1 of 2"]
    assert re.search(r"exit status 137|Signals.SIGKILL", p.stdout + p.stderr), (p.stdout + p.stderr)[-3000:]
    work = Path(cfg["work_dir"])
    assert json.loads((work / "schedule.json").read_text())["num_jobs"] == 3
    assert sorted(int(m.stem) for m in (work / "manifests").rglob("*.json")) == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]
    assert not (work / "jobs" / "000001.json").exists()
    # tasks 0-7, 10 and 11 hold 15 chunks; the 16th is task 8's first, as the uninterrupted run wrote it
    want, got = layer_files(cfg_a["output"]["path"]), layer_files(cfg["output"]["path"])
    assert len(got) == 16 and all(want[k] == v for k, v in got.items()), sorted(set(want) - set(got))
    t0 = time.time()
    p = snakemake(tmp_path, path)
    assert _jobs_run(p, "infer_job") == 1
    assert _ran(work, t0) == [8, 9]
    assert json.loads((work / "jobs" / "000001.json").read_text())["skipped"] == [5, 6, 7]
    assert "2 done now, 10 skipped" in p.stderr
    assert layer_files(cfg["output"]["path"]) == want


def test_clear_error_before_scheduling(tmp_path):
    """A wrong input dtype stops the workflow in `validate`: no layer, no task."""
    cfg, path = write_config(tmp_path, "bad", em((12, 40, 40)), input={"dtype": "uint16"})
    p = snakemake(tmp_path, path, check=False)
    assert p.returncode != 0
    log = (Path(cfg["work_dir"]) / "logs" / "validate.log").read_text()
    assert "holds uint8 but input.dtype says uint16" in log
    assert not Path(cfg["output"]["path"]).exists()
    assert not (Path(cfg["work_dir"]) / "manifests").exists()
    assert "cannot be scheduled" in p.stderr or "holds uint8" in p.stderr


def test_schema_error_at_workflow_load(tmp_path):
    cfg, path = write_config(tmp_path, "bad", em((8, 30, 30)), edge="wrap")
    p = snakemake(tmp_path, path, "-n", check=False)
    assert p.returncode != 0 and "edge" in (p.stdout + p.stderr)


def test_lint_and_dry_run(tmp_path):
    cfg, path = write_config(tmp_path, "dry", em((8, 30, 30)))
    p = snakemake(tmp_path, path, "--lint")
    assert "good condition" in p.stdout + p.stderr
    p = snakemake(tmp_path, path, "-n")
    assert "validate" in p.stdout


def test_commands_cache_kernels_and_bytecode(tmp_path):
    """Every rule's command runs with numba's kernels cached under ZNNI_CACHE_DIR (a user's own
    NUMBA_CACHE_DIR wins) and Python's bytecode written even where PYTHONDONTWRITEBYTECODE is
    set (an empty value: Python reads it as unset); a user's PYTHONPYCACHEPREFIX is untouched."""
    cfg, path = write_config(tmp_path, "env", em((8, 30, 30)))
    p = snakemake(tmp_path, path, "-n", "-p", "--forceall")
    line = next(ln for ln in p.stdout.splitlines() if " znni validate " in ln)
    prefix = line[: line.index(" znni validate ")].split("Shell command:")[-1].strip()
    cache = tmp_path / "cache"

    def env_of(**extra):
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "ZNNI_CACHE_DIR": str(cache), **extra}
        out = subprocess.run(["sh", "-c", f"{prefix} env"], env=env, capture_output=True, text=True, check=True)
        return dict(ln.split("=", 1) for ln in out.stdout.splitlines() if "=" in ln)

    got = env_of(PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX="/mine")
    assert got["NUMBA_CACHE_DIR"] == f"{cache}/numba" and got["NUMBA_THREADING_LAYER"] == "threadsafe"
    assert got["PYTHONDONTWRITEBYTECODE"] == "" and got["PYTHONPYCACHEPREFIX"] == "/mine"
    assert env_of(NUMBA_CACHE_DIR="/kernels")["NUMBA_CACHE_DIR"] == "/kernels"


def test_mask_checkpoint_runs_only_live_tasks_and_reports_masked_ones(tmp_path):
    """With a mask (coarser than the input), one checkpoint lists the live tasks; the jobs batch only
    those; masked tasks never run and are reported apart from tasks not done; a rerun is a no-op.
    The output is zarr v3 (one Snakemake run covers both)."""
    import zarr

    from .pipeline_helpers import RES, write_volume

    vol = em((12, 40, 40))
    m = np.zeros((3, 10, 10), np.uint8)  # (160, 32, 32) nm voxels: 4x the input's on every axis but z
    m[:, :4, :3] = 1
    mask = write_volume(tmp_path / "mask", m, chunk=(3, 5, 5), resolution=(RES[0] * 4, RES[1] * 4, RES[2] * 4))
    cfg, path = write_config(
        tmp_path,
        "masked",
        vol,
        mask={"path": mask},
        jobs={"tasks_per_job": 2},
        output={"chunk_size": [6, 17, 17], "path": str(tmp_path / "masked" / "out.zarr")},
    )
    p = snakemake(tmp_path, path)
    work = Path(cfg["work_dir"])
    doc = json.loads((work / "mask_tasks.json").read_text())
    assert 0 < doc["num_live"] < doc["num_tasks"]
    markers = sorted((work / "jobs").glob("*.json"))
    assert len(markers) == -(-doc["num_live"] // 2)
    ran = {r["task"] for mk in markers for r in json.loads(mk.read_text())["ran"]}
    assert len(ran) == doc["num_live"]
    s = json.loads((work / "report" / "summary.json").read_text())
    assert s["tasks_masked"] == doc["num_masked"] and s["done"] == doc["num_live"] and s["failed"] == []
    assert f"{doc['num_masked']} masked" in p.stderr and "0 not done" in p.stderr
    assert s["output"].startswith("zarr://") and "zarr3%3A%2F%2F" in s["neuroglancer"]
    run = load_run(work / "run.json")
    a = zarr.open_array(str(tmp_path / "masked" / "out.zarr" / "0"), mode="r")
    assert a.shards is not None
    region = Roi.from_dict(run.region)
    scale = run.output.scale
    origin = Roi(scale["voxel_offset"][::-1], scale["size"][::-1]).offset  # the array starts here
    got = np.asarray(a[(slice(None),) + region.to_slices(origin)])
    net = znni_core.load_network(cfg["network"]["path"])
    ref = znni_core.infer(net, vol.astype(np.float32) * np.float32(1 / 255))
    written = got.any(axis=0)
    assert written.any() and not written.all()
    np.testing.assert_allclose(got[:, written], ref[:, written], rtol=1e-5, atol=1e-6)
    p = snakemake(tmp_path, path)  # everything done: nothing runs again
    assert "Nothing to be done" in p.stdout + p.stderr


@pytest.mark.real_data(*DETECTOR_FILES)
def test_real_synapse_detector_runs_through_the_workflow(tmp_path):
    """A padded U-Net (the real trained detector, real EM) through snakemake: every chunk equals
    ``infer`` over the whole input with the run's plan (the same blending lattice)."""
    from znni_core.plan.plan import Plan

    sample = np.load(DETECTOR_REFERENCE)["input"]
    vol = np.rint(sample[:6, :48, :40] * 255).astype(np.uint8)  # the real EM, as the uint8 it was stored as
    cfg, path = write_config(
        tmp_path,
        "det",
        vol,
        edge="zero",
        network={"path": str(DETECTOR)},
        output={"chunk_size": [6, 24, 20]},
        blend={"patch_shape": [6, 24, 24], "overlap": [0, 8, 8]},
    )
    p = snakemake(tmp_path, path)
    assert "0 not done" in p.stderr
    layer = PrecomputedLayer(parse_layer_url(cfg["output"]["path"]), 0)
    got, _ = layer.read(layer.bounds)
    plan = Plan.load(Path(cfg["work_dir"]) / "plan.json")
    assert plan.kind == "padded" and plan.overlap == (0, 8, 8)
    ref = znni_core.infer(znni_core.load_network(DETECTOR), vol.astype(np.float32) * np.float32(1 / 255), plan=plan)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~40 s: the optional pyramid, mip by mip in jobs, between the tasks and finalize
def test_pyramid_jobs_build_checked_mips_before_the_report(tmp_path):
    from znni_core.pipeline.pyramid import downsample

    cfg, path = write_config(
        tmp_path,
        "p",
        em((12, 40, 40)),
        downsample={"mips": 2},
        output={"chunk_size": [6, 8, 8]},
        jobs={"tasks_per_job": 6},
    )
    p = snakemake(tmp_path, path)
    log = p.stdout + p.stderr
    assert "pyramid_job" in log and "(Rule: pyramid)" in log
    s = json.loads((Path(cfg["work_dir"]) / "report" / "summary.json").read_text())
    assert [m[:6] for m in s["pyramid"]] == ["mip 1 ", "mip 2 "]
    assert len(list((Path(cfg["work_dir"]) / "pyramid" / "mip1").glob("*.json"))) == 2  # 12 tasks, 6 per job
    assert len(list((Path(cfg["work_dir"]) / "pyramid" / "mip2").glob("*.json"))) == 1
    url = parse_layer_url(cfg["output"]["path"])
    assert len(json.loads((url.local_path / "info").read_text())["scales"]) == 3
    mip1, mip2 = PrecomputedLayer(url, 1), PrecomputedLayer(url, 2)
    want = downsample(mip1.read(mip1.bounds, fill_missing=True)[0], (1, 2, 2), "float32")
    got = mip2.read(mip2.bounds, fill_missing=True)[0]
    assert got.any()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_jobs_with_more_threads_take_fewer_slots(tmp_path):
    """A job that takes 2 of the 2 cores (set-threads) leaves one slot: the schedule sizes the
    tasks for one job at a time, not for --jobs 2 (a dry run writes schedule.json)."""
    slots = {}
    for name, extra in (("one", []), ("two", ["--set-threads", "infer_job=2", "validate=2"])):
        cfg, path = write_config(tmp_path, name, em((8, 30, 30)))
        snakemake(tmp_path, path, "-n", "--cores", "2", "--jobs", "2", *extra)
        slots[name] = json.loads((Path(cfg["work_dir"]) / "schedule.json").read_text())["slots"]
    assert slots == {"one": 2, "two": 1}
