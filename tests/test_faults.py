"""Crash, fault and bad-input cases of docs/reliability.md on a tiny generated volume.

Timing-dependent cases run over 20 fixed seeds and are marked slow (CI runs them with
``pytest -m slow``); the clear-error cases are fast and run with ``make test``.
One plan and one uninterrupted ("golden") layer per module: every trial works on a copy.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests import faults_helpers as H

SEEDS = list(range(20))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A validated case (plan, layer, tasks) with no task run yet."""
    return H.prepare(H.make_case(tmp_path_factory.mktemp("faults") / "base"))


@pytest.fixture(scope="module")
def golden(base, tmp_path_factory):
    """The uninterrupted run: chunk bytes and per-task durations."""
    case = base.copy(tmp_path_factory.mktemp("golden") / "case")
    seconds = {}
    for t in case.tasks():
        r = H.run_task_proc(case, t["id"])
        assert r.exitcode == 0, f"task {t['id']} failed in the golden run"
        seconds[t["id"]] = r.seconds
    files = H.layer_files(case.out)
    assert len(files) == len(case.tasks())  # one chunk per task, none empty in the demo volume
    return {"files": files, "seconds": seconds, "case": case}


def _trial(base, tmp_path, golden_run=None) -> H.Case:
    case = base.copy(tmp_path / "case")
    if golden_run is not None:  # start from a finished run (manifests and chunks present)
        shutil.rmtree(case.out)
        shutil.copytree(golden_run.out, case.out)
        shutil.copytree(golden_run.work / "manifests", case.work / "manifests")
    return case


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Tasks of two chunks each (the kill points between and inside a task's chunk writes): the
    validated case, and the uninterrupted run's chunk bytes by task."""
    case = H.prepare(H.make_case(tmp_path_factory.mktemp("pairs") / "base", task_chunks=(1, 1, 2)))
    run = case.copy(tmp_path_factory.mktemp("pairs-golden") / "case")
    by_task, seen = {}, {}
    for t in run.tasks():
        assert H.run_task_proc(run, t["id"]).exitcode == 0, f"task {t['id']} failed in the golden run"
        files = H.layer_files(run.out)
        by_task[t["id"]] = {k: v for k, v in files.items() if k not in seen}
        seen = files
    assert all(len(f) == 2 for f in by_task.values()), {t: sorted(f) for t, f in by_task.items()}
    return case, by_task


# ---- T1: SIGKILL a task during its run; rerun --------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_t1_sigkill_task_then_rerun(base, golden, tmp_path, seed):
    """SIGKILL at a seeded moment of the task's run (up to its uninterrupted duration).  The task
    waits before its manifest until killed (kill point ``hold``), so the kill always lands: the
    process ends by SIGKILL, without a manifest; chunks finished before keep their bytes, the
    rerun is byte-identical."""
    rng = random.Random(seed)
    case = _trial(base, tmp_path, golden["case"])
    task = rng.choice([t["id"] for t in case.tasks()])
    case.manifest(task).unlink()  # Snakemake removes a job's output before running it
    before = H.layer_files(case.out)
    delay = rng.uniform(0.0, golden["seconds"][task])
    r = H.run_task_proc(case, task, fault=f"hold:{task}", kill_after=delay)
    assert r.killed, f"seed {seed}: the kill at {delay:.2f} s did not land (exit {r.exitcode})"
    assert not case.manifest(task).exists(), f"seed {seed}: a manifest for the task killed at {delay:.2f} s"
    after_kill = H.layer_files(case.out)
    others = {k: v for k, v in before.items() if k in after_kill}
    # NL: every chunk finished before the kill is byte-identical (this task rewrites identical bytes)
    H.assert_same_chunks(others, {k: golden["files"][k] for k in others}, f"seed {seed} after kill")
    r2 = H.run_task_proc(case, task)
    assert r2.exitcode == 0
    assert H.manifest_ok(case, task) is True
    H.assert_same_chunks(H.layer_files(case.out), golden["files"], f"seed {seed} after rerun")
    assert not H.temporaries(case.out)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_t1_sigkill_at_points_no_done_marker(pairs, tmp_path, seed):
    """Named kill points in a task of two chunks (fresh run): before its compute (nothing
    written), after its first chunk (one of two written), or inside its first or second chunk
    write (half the bytes in a temporary).  The kill lands where it says (the hook's record), no
    manifest, the chunks written before equal the uninterrupted run's; the rerun completes the
    task byte-identically and leaves no temporary."""
    from znni_core.io.atomic import TMP_MARK

    base, by_task = pairs
    rng = random.Random(1000 + seed)
    case = base.copy(tmp_path / "case")
    task = rng.choice(sorted(by_task))
    point = rng.choice(["compute", "after-chunk:1", "mid-write:1", "mid-write:2"])
    name, _, n = point.partition(":")
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    r = H.run_task_proc(case, task, fault=f"{name}:{task}:{n}", env={"ZNNI_FAULT_DIR": str(fault_dir)})
    assert r.killed, f"{point}: exit {r.exitcode}, not SIGKILL"
    where = H.kills(fault_dir)
    expect = {
        "compute": f"compute task {task}: before its compute",
        "after-chunk:1": f"after-chunk task {task} after chunk 1 of 2",
        "mid-write:1": f"mid-write task {task} chunk 1: ",
        "mid-write:2": f"mid-write task {task} chunk 2: ",
    }[point]
    assert len(where) == 1 and where[0].startswith(expect), (point, where)
    assert not case.manifest(task).exists(), f"done-marker written before the kill ({point})"
    files = H.layer_files(case.out)
    written = {k: v for k, v in files.items() if TMP_MARK not in k}
    torn = [k for k in files if TMP_MARK in k]
    want_chunks = {"compute": 0, "after-chunk:1": 1, "mid-write:1": 0, "mid-write:2": 1}[point]
    assert len(written) == want_chunks and len(torn) == (name == "mid-write"), (point, sorted(files))
    H.assert_same_chunks(written, {k: by_task[task][k] for k in written}, f"seed {seed} {point}: before the kill")
    r2 = H.run_task_proc(case, task)
    assert r2.exitcode == 0 and H.manifest_ok(case, task) is True
    H.assert_same_chunks(H.layer_files(case.out), by_task[task], f"seed {seed} {point}: the rerun")
    assert not H.temporaries(case.out)  # only this task ran, and left no temporary


# ---- T3: SIGKILL between the last write and the manifest ----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_t3_kill_before_manifest_then_rerun(base, golden, tmp_path, seed):
    rng = random.Random(2000 + seed)
    case = _trial(base, tmp_path, golden["case"] if seed % 2 else None)
    task = rng.choice([t["id"] for t in case.tasks()])
    if case.manifest(task).exists():
        case.manifest(task).unlink()
    r = H.run_task_proc(case, task, fault="before-manifest")
    assert r.killed and not case.manifest(task).exists()
    assert not H.temporaries(case.out)  # chunk writes themselves completed
    r2 = H.run_task_proc(case, task)
    assert r2.exitcode == 0 and H.manifest_ok(case, task) is True
    got = H.layer_files(case.out)
    H.assert_same_chunks(got, {k: golden["files"][k] for k in got}, f"seed {seed}")


# ---- T2 at the task level: a task killed in the middle of its shard's write --------------------
def _sharded_case(root: Path, kind: str) -> tuple[H.Case, Path, str]:
    """A validated case whose output is sharded precomputed or zarr v3 (a shard of two chunks per
    task); its layer directory and the URL its readers open."""
    if kind == "sharded":
        case = H.make_case(root, output__sharding="sharded", output__shard_bytes=2 * 8 * 32 * 32 * 4)
        return H.prepare(case), case.out, "file://" + str(case.out)
    layer = root / "out.zarr"
    case = H.make_case(root, task_chunks=(1, 1, 2), output__path=str(layer))
    return H.prepare(case), layer, f"zarr://file://{layer}/0"


def _read_back(url: str):
    from znni_core.io import open_input, parse_layer_url

    layer = open_input(parse_layer_url(url), checksums="none")
    return layer.read(layer.bounds, fill_missing=True)[0]


@pytest.mark.slow  # 8 s each on 2 busy cores, 40 s more for a cold forkserver and the golden run
@pytest.mark.parametrize("kind", ["sharded", "zarr"])
def test_t2_task_killed_mid_shard_write_leaves_no_torn_shard(tmp_path, kind):
    """The kill hook inside a task's shard write (``mid-write``: half of the shard's bytes in the
    atomic write's temporary, then SIGKILL), on a sharded precomputed and on a zarr v3 output.
    First with no shard yet: the shard's name stays absent (readers see no data, not a torn
    shard); then over the finished shard: its bytes stay the previous version's. No manifest
    either time; each rerun writes the uninterrupted run's bytes and leaves no temporary."""
    from znni_core.io.atomic import TMP_MARK

    case, layer, url = _sharded_case(tmp_path / "case", kind)
    gold = case.copy(tmp_path / "gold")
    for t in gold.tasks():
        assert H.run_task_proc(gold, t["id"]).exitcode == 0
    gold_layer = Path(str(layer).replace(str(case.root), str(gold.root)))
    golden = H.layer_files(gold_layer)
    victim = case.tasks()[1]["id"]
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()

    def killed_mid_write(before: dict[str, bytes]) -> None:
        n = len(H.kills(fault_dir))
        r = H.run_task_proc(case, victim, fault=f"mid-write:{victim}", env={"ZNNI_FAULT_DIR": str(fault_dir)})
        assert r.killed, f"exit {r.exitcode}: the kill hook never fired on the {kind} shard write"
        where = H.kills(fault_dir)[n:]
        assert len(where) == 1 and where[0].startswith(f"mid-write task {victim} shard 1: "), where
        assert not case.manifest(victim).exists(), "a manifest for a task killed mid-write"
        files = H.layer_files(layer)
        torn = {k: v for k, v in files.items() if TMP_MARK in k}
        half, whole = (int(w) for w in where[0].split(": ")[1].split()[:3:2])
        assert [len(v) for v in torn.values()] == [half] and 0 < half < whole, (where, sorted(torn))
        assert {k: v for k, v in files.items() if TMP_MARK not in k} == before, "a shard changed mid-write"

    # 1. no shard yet: the kill leaves its name absent; the layer reads as no data
    before = H.layer_files(layer)
    assert not any(k in golden and golden[k] != v for k, v in before.items())
    killed_mid_write(before)
    assert not _read_back(url).any(), "data readable from a shard whose write was killed"
    assert H.run_task_proc(case, victim).exitcode == 0 and H.manifest_ok(case, victim) is True
    after = H.layer_files(layer)
    shard = sorted(set(after) - set(before))
    assert len(shard) == 1 and not H.temporaries(layer), sorted(after)
    H.assert_same_chunks(after, {k: golden[k] for k in after}, f"{kind}: rerun after the kill")

    # 2. over the finished shard (its manifest lost): the previous version survives the kill whole
    want = _read_back(url)
    case.manifest(victim).unlink()
    killed_mid_write(after)
    assert (_read_back(url) == want).all()
    assert H.run_task_proc(case, victim).exitcode == 0 and H.manifest_ok(case, victim) is True
    assert H.layer_files(layer) == after and not H.temporaries(layer)

    # 3. ``after-chunk`` fires on a shard too: the kill follows the whole shard's write
    case.manifest(victim).unlink()
    env = {"ZNNI_FAULT_DIR": str(fault_dir)}
    assert H.run_task_proc(case, victim, fault=f"after-chunk:{victim}:1", env=env).killed
    assert H.kills(fault_dir)[-1] == f"after-chunk task {victim} after chunk 2 of 2"
    assert not case.manifest(victim).exists() and H.layer_files(layer) == after


# ---- T16: the done-check itself raises ---------------------------------------------------------
@pytest.mark.parametrize("how", ["truncated-json", "directory", "lying-checksum"])
def test_t16_done_check_raises_is_a_clear_error(base, golden, tmp_path, how):
    case = _trial(base, tmp_path, golden["case"])
    m = case.manifest(3)
    if how == "truncated-json":
        m.write_text(m.read_text()[:40])
    elif how == "directory":
        m.unlink()
        m.mkdir()
    else:
        doc = json.loads(m.read_text())
        doc["chunks"][0]["sha256"] = "0" * 64
        m.write_text(json.dumps(doc))
    before = H.layer_files(case.out)
    p = H.znni("finalize", case.run_file)
    assert p.returncode != 0, "finalize accepted a broken done-marker"
    assert "000003" in p.stderr or "task 3" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not (case.work / "report" / "summary.json").exists()
    H.assert_same_chunks(H.layer_files(case.out), before, "finalize must not touch chunks")


# ---- T19: NaN / Inf in weights -----------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_t19_nonfinite_weights_refused_at_load(tmp_path, bad):
    from znni_core.pipeline.demo import demo_network

    net = demo_network()
    net.layers[0].weight[0, 0, 1, 1, 1] = bad
    case = H.make_case(tmp_path / "c", net=net)
    p = H.znni("validate", case.config, "--memory", "2000MiB", "--threads", 1)
    assert p.returncode != 0
    assert "conv1" in p.stderr and ("NaN" in p.stderr or "nan" in p.stderr.lower() or "inf" in p.stderr.lower())
    assert "Traceback" not in p.stderr
    assert not case.run_file.exists() and not case.out.exists()


# ---- T20: NaN / Inf produced during inference ------------------------------------------------------
def test_t20_nonfinite_output_is_a_clear_error_nothing_written(base, tmp_path):
    import yaml

    # normalize.scale large enough that bright voxels become Inf in float32 inside the network
    case = _trial(base, tmp_path)
    cfg = yaml.safe_load(case.config.read_text())
    cfg["normalize"]["scale"] = 3e38
    case.config.write_text(yaml.safe_dump(cfg))
    p = H.znni("validate", case.config, "--memory", "2000MiB", "--threads", 1)
    if p.returncode == 0:
        H.znni("tasks", case.run_file, "--output", case.work / "tasks.json", check=True)
        p = H.znni("run-task", case.run_file, "--task", 0, "--no-progress")
    assert p.returncode != 0
    assert "NaN" in p.stderr or "Inf" in p.stderr or "finite" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not case.manifest(0).exists()
    assert H.layer_files(case.out) == {}


def test_t20_injected_nan_in_engine_output(base, tmp_path):
    case = _trial(base, tmp_path)
    p = H.znni("run-task", case.run_file, "--task", 2, "--no-progress", env=H.fault_env("nan"))
    assert p.returncode != 0 and ("NaN" in p.stderr or "finite" in p.stderr), p.stderr[-2000:]
    assert not case.manifest(2).exists() and H.layer_files(case.out) == {}


# ---- T25: a patch over the memory budget -------------------------------------------------------
def test_t25_planner_refuses_patch_over_budget(base, tmp_path):
    """Every chosen plan fits its budget; below the smallest patch the planner refuses (CE)."""
    import znni_core
    from znni_core.plan import autotune

    net = znni_core.load_network(base.data / "net.yaml")
    for budget in (20_000, 200_000, 20_000_000):
        plan = autotune(net, memory_budget=budget)
        assert plan.predicted_peak_bytes <= budget, (budget, plan.predicted_peak_bytes)
    p = H.znni("plan", base.data / "net.yaml", "--memory", 1000, "--output", tmp_path / "plan.json")
    assert p.returncode != 0 and "budget" in p.stderr.lower(), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "plan.json").exists()


def test_t25_job_memory_below_plan_refused_before_any_write(base, tmp_path):
    case = _trial(base, tmp_path)
    p = H.znni("run-task", case.run_file, "--task", 0, "--memory", "10MiB", "--no-progress")
    assert p.returncode != 0 and "mem" in p.stderr.lower(), p.stderr[-2000:]
    assert not case.manifest(0).exists() and H.layer_files(case.out) == {}


# ---- T9: corrupt input chunk at rest ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["truncated", "zero-bytes", "extra-bytes"])
def test_t9_corrupt_input_chunk_at_rest(base, golden, tmp_path, how):
    case = _trial(base, tmp_path)
    chunks = sorted(p for p in (case.data / "em").rglob("*") if p.is_file() and p.name not in ("info", "provenance"))
    victim = chunks[0]
    good = victim.read_bytes()
    victim.write_bytes({"truncated": good[: len(good) // 2], "zero-bytes": b"", "extra-bytes": good + b"\0" * 7}[how])
    # task 0's read ROI starts at the origin: it reads the victim (the chunk at the origin)
    p = H.znni("run-task", case.run_file, "--task", 0, "--no-progress")
    assert p.returncode != 0, "a corrupt input chunk was read silently"
    assert victim.name in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert not case.manifest(0).exists() and H.layer_files(case.out) == {}
    victim.write_bytes(good)  # repair, rerun: BI
    assert H.znni("run-task", case.run_file, "--task", 0, "--no-progress").returncode == 0
    got = H.layer_files(case.out)
    assert len(got) == 1
    H.assert_same_chunks(got, {k: golden["files"][k] for k in got}, f"T9 {how} after repair")


@pytest.mark.parametrize("fmt", ["precomputed", "sharded", "zarr"])
def test_t9_flipped_byte_in_a_checksummed_input_fails_the_task(tmp_path, fmt):
    """A byte flipped inside a chunk of an input that carries checksums (a znni output: the sha256
    index its finalize writes beside precomputed chunks or shards, or the crc32c of each zarr chunk) fails
    the task that reads it, naming the chunk, and writes nothing; repaired, the rerun is
    byte-identical. ``input.checksums: required`` refuses, at validate, a raw input that carries
    none (the EM written by another tool), and with the index deleted a validated run's task
    refuses to read unverified."""
    from tests.nets import make_net
    from tests.pipeline_helpers import base_config, em
    from tests.test_pipeline import QUIET, prepare, run_all
    from znni_core.errors import ConfigError, DataError
    from znni_core.io.sharding import shard_name
    from znni_core.net import save_network
    from znni_core.pipeline.finalize import finalize
    from znni_core.pipeline.run import load_run
    from znni_core.pipeline.task import run_task

    out_a = tmp_path / ("a.zarr" if fmt == "zarr" else "a")
    out_cfg = {"path": str(out_a), "chunk_size": [4, 16, 16], **({"sharding": "sharded"} if fmt == "sharded" else {})}
    cfg_a = base_config(tmp_path / "A", vol=em((12, 48, 48)), output=out_cfg)
    rf_a = prepare(cfg_a)
    run_all(rf_a)
    summary = finalize(rf_a, log=lambda *a: None)
    channels = load_run(rf_a).network.out_channels
    save_network(make_net([("conv", 1, 3), ("act", "sigmoid")], c_in=channels, seed=2), tmp_path / "b.yaml")
    cfg_b = {
        "work_dir": str(tmp_path / "B" / "work"),
        "input": {"path": (f"zarr://file://{out_a}/0" if fmt == "zarr" else f"file://{out_a}"), "dtype": "float32"},
        "network": {"path": str(tmp_path / "b.yaml")},
        "normalize": {"scale": 1.0},
        "output": {"path": str(tmp_path / "B" / ("out.zarr" if fmt == "zarr" else "out")), "chunk_size": [4, 8, 8]},
        "task_chunks": [1, 2, 2],
    }
    rf_b = prepare(cfg_b)
    run_b = load_run(rf_b)
    assert run_b.input_checksums == ("crc32c" if fmt == "zarr" else "sha256")
    if fmt != "zarr":
        index = out_a / load_run(rf_a).output.scale["key"] / "znni-sha256" / "index.json"
        assert summary["checksum_index_chunks"] > 0 and index.is_file()
    run_task(rf_b, 0, **QUIET)
    manifest = next((Path(run_b.work_dir) / "manifests").rglob("*.json"))
    good_out = {p: p.read_bytes() for p in (tmp_path / "B").rglob("*") if p.is_file() and "work" not in p.parts}
    manifest.unlink()
    # the chunk (precomputed) or shard (zarr, sharded precomputed) of A at the origin, which task 0 of B reads
    key = load_run(rf_a).output.scale["key"]
    at = None  # where the byte is flipped: a third into the file, or in a shard the origin chunk's data
    if fmt == "zarr":
        victim = next(p for p in sorted((out_a / "0" / "c").rglob("*")) if p.is_file())
    elif fmt == "sharded":
        sharding = load_run(rf_a).output.info["scales"][0]["sharding"]
        victim = out_a / key / shard_name(sharding, 0)
        at = (16 << sharding["minishard_bits"]) + 100  # after the shard index: chunk 0's data (raw) comes first
    else:
        victim = next(p for p in sorted((out_a / key).iterdir()) if p.is_file() and p.name.startswith("0-"))
    good = victim.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 3 if at is None else at] ^= 0x10
    victim.write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="checksum" if fmt == "zarr" else "changed at rest") as ei:
        run_task(rf_b, 0, **QUIET)
    if fmt == "precomputed":
        assert victim.name in str(ei.value)
    elif fmt == "sharded":
        assert f"chunk {key}/0-16_0-16_0-4 changed at rest" in str(ei.value), str(ei.value)
    else:
        assert "that fail on their own: ['0/" in str(ei.value), str(ei.value)
    assert not manifest.exists()
    victim.write_bytes(good)
    run_task(rf_b, 0, **QUIET)
    again = {p: p.read_bytes() for p in (tmp_path / "B").rglob("*") if p.is_file() and "work" not in p.parts}
    assert again == good_out
    if fmt != "zarr":
        shutil.rmtree(out_a / key / "znni-sha256")
        with pytest.raises(ConfigError, match="required"):
            run_task(rf_b, 0, **QUIET)
        raw = dict(cfg_a, work_dir=str(tmp_path / "C"), input={**cfg_a["input"], "checksums": "required"})
        with pytest.raises(ConfigError, match="no checksum"):
            prepare(raw)


# ---- T28a/b: unsafe network files ----------------------------------------------------------------
def test_t28a_pickle_checkpoint_refused_without_running_payload(tmp_path):
    import pickle

    import znni_core
    from znni_core.errors import NetworkError

    canary = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (canary,))

    for name in ("net.pt", "net.pkl", "net.pth", "net.ckpt"):
        f = tmp_path / name
        f.write_bytes(pickle.dumps({"state_dict": Payload()}))
        with pytest.raises(NetworkError, match="never unpickles"):
            znni_core.load_network(f)
        assert not canary.exists(), f"{name}: the pickle payload ran"


def test_t28b_yaml_tags_refused(tmp_path):
    import znni_core
    from znni_core.errors import NetworkError

    canary = tmp_path / "pwned"
    spec = tmp_path / "net.yaml"
    spec.write_text(f"name: x\nlayers: !!python/object/apply:os.system ['touch {canary}']\n")
    with pytest.raises(NetworkError, match="tags that construct Python objects are refused"):
        znni_core.load_network(spec)
    assert not canary.exists()


# ---- T28c: a layer info with '..' or absolute keys ------------------------------------------------
@pytest.mark.parametrize("key", ["../../escape", "/tmp/znni-escape-abs", "a/../../b"])
def test_t28c_bad_scale_key_refused_before_any_write(base, tmp_path, key):
    case = _trial(base, tmp_path)
    info = json.loads((case.out / "info").read_text())
    info["scales"][0]["key"] = key
    (case.out / "info").write_text(json.dumps(info))
    before = {p for p in tmp_path.rglob("*")}
    p = H.znni("run-task", case.run_file, "--task", 0, "--no-progress")
    assert p.returncode != 0 and ("key" in p.stderr.lower()), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    created = {q for q in tmp_path.rglob("*")} - before
    assert not created, f"files created: {sorted(map(str, created))[:5]}"
    assert not Path("/tmp/znni-escape-abs").exists()


def test_t28c_bad_scale_key_in_config_refused(base, tmp_path):
    import yaml

    case = _trial(base, tmp_path)
    shutil.rmtree(case.work)
    shutil.rmtree(case.out)
    cfg = yaml.safe_load(case.config.read_text())
    cfg["output"]["scale_key"] = "../outside"
    case.config.write_text(yaml.safe_dump(cfg))
    # refused by `validate` (checks, then the layer, as the workflow's first job): before any layer
    # write or task
    p = H.znni(
        "validate", case.config, "--memory", "2000MiB", "--threads", 1, "--layer-marker", case.work / "layer.json"
    )
    assert p.returncode != 0 and "key" in p.stderr.lower(), p.stderr[-2000:]
    assert not (case.work / "layer.json").exists()
    assert "Traceback" not in p.stderr
    assert not (case.root / "outside").exists() and not case.out.exists()


# ---- T16 at the job level: the check that decides which of a job's tasks to skip ----------------
@pytest.mark.parametrize("how", ["truncated-json", "directory", "eio"])
def test_t16_job_level_done_check(tmp_path, how):
    """A retried job skips only the tasks whose manifest and stored chunks verify. A truncated
    manifest is never taken for done: the task runs again (the job says why), its chunks come
    out byte-identical, and its manifest is whole again; the other tasks are skipped. A
    directory in the manifest's place cannot be replaced by the rerun's manifest: the job fails
    naming it, the task not marked done. A chunk whose read fails with a real I/O error (EIO: a
    link to ``/proc/self/mem``) is a failure of the storage, not of the task: the job stops
    naming the task and the error, running nothing and marking nothing done."""
    from tests.pipeline_helpers import base_config, em, layer_files
    from tests.test_pipeline import prepare
    from znni_core.errors import DataError
    from znni_core.io import read_manifest
    from znni_core.pipeline.jobs import job_marker_path, run_job
    from znni_core.pipeline.run import load_run
    from znni_core.pipeline.task import manifest_path

    cfg = base_config(tmp_path, vol=em((8, 32, 32)))
    rf = prepare(cfg)
    run = load_run(rf)
    n = run.num_tasks
    run_job(rf, 0, n, log=lambda *a: None)
    job_marker_path(run.work_dir, 0).unlink()
    before = layer_files(run.output.url)
    victim = 1
    mp = manifest_path(run, victim)
    if how == "truncated-json":
        mp.write_text(mp.read_text()[:40])
    elif how == "directory":
        mp.unlink()
        mp.mkdir()
    else:
        name = read_manifest(mp)["chunks"][0]["name"]
        chunk = Path(run.output.url.removeprefix("file://")) / name
        chunk.unlink()
        chunk.symlink_to("/proc/self/mem")
        with pytest.raises(OSError):  # the fault is real: reading the chunk fails at the kernel
            chunk.read_bytes()
    lines = []
    if how == "directory":  # not taken for done; the rerun cannot replace it: a clear error naming it
        with pytest.raises(DataError, match=f"{mp.name}.*Is a directory"):
            run_job(rf, 0, n, log=lines.append)
        assert mp.is_dir() and layer_files(run.output.url) == before
        assert sum("done and verified, skipped" in line for line in lines) == n - 1, lines
        return
    if how == "eio":
        with pytest.raises(DataError, match=f"task {victim}: its done-check failed.*Input/output error"):
            run_job(rf, 0, n, log=lines.append)
        assert not any("running it again" in line for line in lines), lines
        assert not job_marker_path(run.work_dir, 0).exists()
        assert read_manifest(mp)["task"] == victim  # untouched
        return
    lines = []
    doc = run_job(rf, 0, n, log=lines.append)
    assert [r["task"] for r in doc["ran"]] == [victim] and sorted(doc["skipped"]) == sorted(set(range(n)) - {victim})
    assert any(f"task {victim}:" in line and "running it again" in line for line in lines), lines
    assert read_manifest(mp)["task"] == victim
    assert layer_files(run.output.url) == before
