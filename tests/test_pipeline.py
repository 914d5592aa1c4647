"""Pipeline: per-task execution equals the engine on the whole volume; pre-scheduling errors
(docs/reliability.md, T21-T24, T26, T27); reruns (T13, T14); concurrent tasks (T12); non-finite output (T20)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import znni_core
from znni_core.errors import ConfigError, DataError, InputError, NonFiniteError, PlanError
from znni_core.geometry import Roi
from znni_core.io import PrecomputedLayer, parse_layer_url
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.resolve import resolve
from znni_core.pipeline.run import load_run, run_geometry, save_run
from znni_core.pipeline.settings import parse_config, validate_config
from znni_core.pipeline.task import manifest_path, run_task
from znni_core.pipeline.verify import verify_run

from .pipeline_helpers import base_config, em, layer_files
from .reference import torch_dense

QUIET = dict(show_progress=False, log=lambda *a: None)


def prepare(cfg, mem_mb=2000):
    """validate + plan + create layer, as the first rules do; returns the run file."""
    from znni_core.io import create_layer
    from znni_core.pipeline.run import output_specs

    run, plan = resolve(cfg, mem_mb=mem_mb, threads=1, progress=lambda *a: None)
    path = save_run(run, plan, Path(run.work_dir))
    create_layer(
        parse_layer_url(run.output.url, endpoint=run.config.output.endpoint_url),
        output_specs(run),
        {"processing": []},
    )
    return path


def run_all(run_file):
    run = load_run(run_file)
    from znni_core.pipeline.run import run_geometry

    ids = [b.id for b in run_geometry(run)[3]]
    for i in ids:
        run_task(run_file, i, **QUIET)
    return ids


def reference(cfg, vol, pad=None):
    net = znni_core.load_network(cfg["network"]["path"])
    x = vol.astype(np.float32) * np.float32(cfg["normalize"]["scale"])
    if pad is not None:
        low, high = net.halo
        if pad == "mirror":
            x = np.pad(x, list(zip(low, high)), mode="reflect")
        else:
            x = np.pad(x, list(zip(low, high)), mode="constant")
    return znni_core.infer(net, x)


def read_out(run_file):
    """The output over the run's region; the rest of an aligned layer must be 0 (never computed)."""
    run = load_run(run_file)
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    region = Roi.from_dict(run.region)
    whole = layer.read(layer.bounds, fill_missing=True)[0]
    got = whole[(slice(None),) + region.to_slices(layer.bounds.offset)].copy()
    whole[(slice(None),) + region.to_slices(layer.bounds.offset)] = 0
    assert not whole.any(), "voxels outside the region were written non-zero"
    return got, layer


def test_tasks_equal_whole_volume_inference(tmp_path):
    vol = em()
    cfg = base_config(tmp_path, vol=vol)
    rf = prepare(cfg)
    ids = run_all(rf)
    assert len(ids) > 4
    got, layer = read_out(rf)
    ref = reference(cfg, vol)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    s = finalize(rf, log=lambda *a: None)
    assert s["done"] == len(ids) and not s["failed"] and Path(s["preview"]).is_file()
    # the report's figures: PNGs that open, each referenced by report.html; the tasks' checks summed
    from PIL import Image

    report = Path(s["preview"]).parent
    assert {"timeline.png", "tasks.png"} <= set(s["figures"]) and len(s["figures"]) == 4, s["figures"]
    html_text = (report / "report.html").read_text()
    for name in s["figures"]:
        assert Image.open(report / name).size[0] > 100 and f'src="{name}"' in html_text
    assert s["recomputed_voxels"] > 0 and s["recomputed_max_deviation"] <= s["recomputed_tolerance"], s
    assert "primitive" in html_text  # the plan per layer
    prov = json.loads((Path(layer.url.local_path) / "provenance").read_text())
    assert prov["processing"][-1]["method"]["network_digest"] == load_run(rf).network.digest


@pytest.mark.parametrize("edge", ["mirror", "zero"])
def test_edge_policies_equal_padded_inference(tmp_path, edge):
    vol = em((8, 30, 30))
    cfg = base_config(tmp_path, vol=vol, edge=edge)
    rf = prepare(cfg)
    run_all(rf)
    got, _ = read_out(rf)
    ref = reference(cfg, vol, pad=edge)
    assert got.shape[1:] == vol.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_uint8_output_and_region(tmp_path):
    vol = em()
    cfg = base_config(tmp_path, vol=vol, output={"dtype": "uint8"}, region={"offset": [3, 10, 7], "shape": [5, 17, 20]})
    rf = prepare(cfg)
    run_all(rf)
    got, layer = read_out(rf)
    # output.align: the layer starts on the chunk grid of absolute coordinates (pyramids)
    chunk = layer.spec.chunk_shape
    assert all(o % c == 0 and o <= r < o + c for o, c, r in zip(layer.bounds.offset, chunk, (3, 10, 7)))
    assert layer.bounds.end == (8, 27, 27) and layer.bounds.offset != (3, 10, 7) and got.dtype == np.uint8
    ref = reference(cfg, vol)
    low = znni_core.load_network(cfg["network"]["path"]).halo[0]
    sl = tuple(slice(o - lo, o - lo + s) for o, lo, s in zip((3, 10, 7), low, (5, 17, 20)))
    assert np.abs(got.astype(int) - np.rint(ref[(slice(None),) + sl] * 255).astype(int)).max() <= 1


def test_uint8_output_with_scale_and_offset(tmp_path):
    """``output.scale``/``offset``: stored = round(clip(v * scale + offset, 0, 255)), values outside
    clipped (not refused); the mapping is in the layer's provenance after finalize; a scale with a
    float32 output is refused at validate naming the key."""
    from znni_core.pipeline.finalize import output_mapping

    vol = em()
    cfg = base_config(tmp_path, vol=vol, output={"dtype": "uint8"})
    ref = reference(cfg, vol).astype(np.float64)
    lo, hi = np.quantile(ref, [0.2, 0.8])  # a fifth of the voxels below 0, a fifth above 255
    scale, offset = 255.0 / (hi - lo), -lo * 255.0 / (hi - lo)
    cfg["output"].update(scale=scale, offset=offset)
    rf = prepare(cfg)
    run_all(rf)
    got, _ = read_out(rf)
    want = np.rint(np.clip(ref * scale + offset, 0, 255))
    assert got.dtype == np.uint8 and (want == 0).mean() > 0.1 and (want == 255).mean() > 0.1
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert f"{scale:g}" in output_mapping(load_run(rf).config)
    with pytest.raises(ConfigError, match="output.scale"):
        resolve(dict(cfg, output={**cfg["output"], "dtype": "float32"}), progress=lambda *a: None)


def test_unaligned_output_starts_at_the_region(tmp_path):
    vol = em()
    cfg = base_config(tmp_path, vol=vol, output={"align": False}, region={"offset": [3, 10, 7], "shape": [5, 17, 20]})
    rf = prepare(cfg)
    run_all(rf)
    got, layer = read_out(rf)
    assert layer.bounds == Roi((3, 10, 7), (5, 17, 20))
    aligned = tmp_path / "aligned"
    aligned.mkdir()
    cfg_a = base_config(aligned, vol=vol, region={"offset": [3, 10, 7], "shape": [5, 17, 20]})
    rf_a = prepare(cfg_a)
    run_all(rf_a)
    # alignment moves the layer and the task boxes (other patches: float rounding), never a value
    np.testing.assert_allclose(read_out(rf_a)[0], got, rtol=1e-5, atol=1e-6)


# ---- clear errors before scheduling ----------------------------------------------------------


def test_T21_wrong_input_dtype(tmp_path):
    cfg = base_config(tmp_path, input={"dtype": "uint16"})
    with pytest.raises(InputError, match="holds uint8 but input.dtype says uint16"):
        resolve(cfg, progress=lambda *a: None)


def test_T21_T22_existing_output_layer_mismatch(tmp_path):
    cfg = base_config(tmp_path)
    prepare(cfg)
    with pytest.raises(DataError, match="dtype"):
        resolve(dict(cfg, output={**cfg["output"], "dtype": "uint8"}), progress=lambda *a: None)
    with pytest.raises(DataError, match="bounds"):
        resolve(dict(cfg, region={"offset": [2, 5, 5], "shape": [4, 8, 8]}), progress=lambda *a: None)


def test_T22_region_not_covered_with_halo(tmp_path):
    cfg = base_config(tmp_path, region={"offset": [0, 0, 0], "shape": [4, 8, 8]})
    with pytest.raises(InputError, match="halo"):
        resolve(cfg, progress=lambda *a: None)


def test_T23_resolution_mismatch(tmp_path):
    cfg = base_config(tmp_path, network={"resolution": [30, 4, 4]})
    with pytest.raises(InputError, match="trained at"):
        resolve(cfg, progress=lambda *a: None)


def test_T24_task_too_big_for_memory_and_bad_sizes(tmp_path):
    cfg = base_config(
        tmp_path, task_chunks=[1, 1, 1], output={"chunk_size": [12, 40, 40]}, plan={"memory_fraction": 0.9}
    )
    with pytest.raises(PlanError, match="task_chunks"):
        resolve(cfg, mem_mb=1, progress=lambda *a: None)
    with pytest.raises(ConfigError, match="chunk_size"):
        validate_config(dict(cfg, output={**cfg["output"], "chunk_size": [0, 8, 8]}))
    with pytest.raises(ConfigError, match="task_chunks"):
        validate_config(dict(cfg, task_chunks=[1, 2]))


def test_T27_channel_mismatch(tmp_path):
    vol = np.stack([em(), em(seed=1)])  # 2 channels; the network takes 1
    cfg = base_config(tmp_path, vol=vol)
    with pytest.raises(InputError, match="2 channel"):
        resolve(cfg, progress=lambda *a: None)


def test_config_schema_errors_name_the_key(tmp_path):
    cfg = base_config(tmp_path)
    with pytest.raises(ConfigError, match="edge"):
        validate_config(dict(cfg, edge="wrap"))
    with pytest.raises(ConfigError, match="unexpected_key|Additional properties"):
        validate_config(dict(cfg, unexpected_key=1))
    with pytest.raises(ConfigError, match="gzip"):
        resolve(dict(cfg, output={**cfg["output"], "compression": "gzip"}), progress=lambda *a: None)


def test_T26_missing_input_fails_unless_filling_is_chosen(tmp_path):
    vol = em()
    cfg = base_config(tmp_path, vol=vol)
    in_layer = PrecomputedLayer(parse_layer_url(cfg["input"]["path"]), 0)
    name = in_layer.chunk_name((1, 1, 1))
    (in_layer.url.local_path / name).unlink()
    rf = prepare(cfg)
    run = load_run(rf)
    gone = in_layer.grid.chunk_roi((1, 1, 1))
    failed = 0
    for block in run_geometry(run)[3]:  # a task that reads the chunk fails and is not done; the others are
        if block.read_roi.intersects(gone):
            with pytest.raises(DataError, match=name.split("/")[1]):
                run_task(rf, block.id, **QUIET)
            assert not manifest_path(run, block.id).is_file()
            failed += 1
        else:
            run_task(rf, block.id, **QUIET)
            assert manifest_path(run, block.id).is_file()
    assert failed >= 1
    cfg2 = base_config(tmp_path / "fill", vol=vol, input={"missing": "zero"})
    in2 = PrecomputedLayer(parse_layer_url(cfg2["input"]["path"]), 0)
    (in2.url.local_path / name).unlink()
    rf2 = prepare(cfg2)
    run_all(rf2)
    filled = [
        json.loads(p.read_text())["missing_input_filled"] for p in (tmp_path / "fill/work/manifests").rglob("*.json")
    ]
    assert any(name in f for f in filled)
    assert name in finalize(rf2, log=lambda *a: None)["missing_input_filled"]


def test_T26_black_region_recorded_empty(tmp_path):
    vol = em()
    vol[:, :, :20] = 0  # left half black
    cfg = base_config(tmp_path, vol=vol)
    rf = prepare(cfg)
    run_all(rf)
    s = finalize(rf, log=lambda *a: None)
    assert s["chunks_empty"] > 0 and s["chunks_written"] > 0
    ms = [json.loads(p.read_text()) for p in sorted((tmp_path / "work/manifests").rglob("*.json"))]
    empties = [c for m in ms for c in m["chunks"] if c["status"] == "empty"]
    layer = PrecomputedLayer(parse_layer_url(load_run(rf).output.url), 0)
    for c in empties:  # recorded, and not written: distinguishable from "never ran" (no manifest)
        assert layer.read_chunk_bytes(tuple(c["index"])) is None
    # deterministic: a second run records the same chunks
    for m in ms:
        run_task(rf, m["task"], **QUIET)
    ms2 = [json.loads(p.read_text()) for p in sorted((tmp_path / "work/manifests").rglob("*.json"))]
    assert [c["status"] for m in ms for c in m["chunks"]] == [c["status"] for m in ms2 for c in m["chunks"]]


def test_T20_nonfinite_output_is_an_error_and_nothing_written(tmp_path):
    vol = em()
    # a finite input (<= 2.55e38) that a plain convolution overflows to Inf inside the engine
    cfg = base_config(tmp_path, vol=vol, normalize={"scale": 1e36})
    from znni_core.net import Conv, Network, save_network

    save_network(Network((Conv(np.ones((1, 1, 3, 3, 3), np.float32)),)), cfg["network"]["path"])  # sums overflow
    rf = prepare(cfg)
    with pytest.raises(NonFiniteError, match="NaN/Inf") as e:
        run_task(rf, 0, **QUIET)
    assert "8_8_40/" in str(e.value) and "nothing was written" in str(e.value)
    assert layer_files(load_run(rf).output.url) == {}
    assert not manifest_path(load_run(rf), 0).exists()
    # an input that is already non-finite after normalisation is refused before the engine runs
    rf2 = prepare(base_config(tmp_path / "b", vol=vol, normalize={"scale": 1e38}))
    with pytest.raises(InputError, match="normalize"):
        run_task(rf2, 0, **QUIET)


def test_T18_worker_refuses_mismatched_layer(tmp_path):
    cfg = base_config(tmp_path)
    rf = prepare(cfg)
    run = load_run(rf)
    info_path = Path(run.output.url.replace("file://", "")) / "info"
    info = json.loads(info_path.read_text())
    info["scales"][0]["voxel_offset"] = [v + 1 for v in info["scales"][0]["voxel_offset"]]
    info_path.write_text(json.dumps(info))
    with pytest.raises(DataError, match="does not match"):
        run_task(rf, 0, **QUIET)


# ---- reruns and concurrency ----------------------------------------------------------------


def test_T14_rerun_one_task_or_chunk_changes_only_its_bytes(tmp_path):
    cfg = base_config(tmp_path)
    rf = prepare(cfg)
    ids = run_all(rf)
    url = load_run(rf).output.url
    before = layer_files(url)
    mtimes = {k: (Path(url.replace("file://", "")) / k).stat().st_mtime_ns for k in before}
    m = json.loads(manifest_path(load_run(rf), ids[1]).read_text())
    own = {c["name"].split("/", 1)[1] for c in m["chunks"]}
    run_task(rf, ids[1], **QUIET)
    after = layer_files(url)
    assert after == before  # deterministic: identical bytes
    changed = {k for k in after if (Path(url.replace("file://", "")) / k).stat().st_mtime_ns != mtimes[k]}
    assert {k.split("/", 1)[1] for k in changed} == own  # only this task's chunks were touched
    # one chunk, by name: only it is rewritten, bytes equal the task run
    victim = m["chunks"][0]["name"]
    p = Path(url.replace("file://", "")) / victim
    p.write_bytes(b"garbage")
    run_task(rf, chunk=victim.split("/")[1], **QUIET)
    assert layer_files(url) == before
    assert finalize(rf, log=lambda *a: None)["done"] == len(ids)


def test_finalize_detects_corruption_and_missing_manifests(tmp_path):
    cfg = base_config(tmp_path)
    rf = prepare(cfg)
    ids = run_all(rf)
    run = load_run(rf)
    manifest_path(run, ids[0]).unlink()
    m = json.loads(manifest_path(run, ids[1]).read_text())
    p = Path(run.output.url.replace("file://", "")) / m["chunks"][0]["name"]
    data = bytearray(p.read_bytes())
    data[0] ^= 1
    p.write_bytes(bytes(data))
    with pytest.raises(DataError) as e:
        finalize(rf, log=lambda *a: None)
    assert str(ids[0]) in str(e.value) and str(ids[1]) in str(e.value)


def test_T12_T13_concurrent_tasks_and_crash_at_half(tmp_path):
    """27 tasks (3x3x3) run concurrently == sequential run, byte for byte; a rerun after 'crash at 50%'
    runs exactly the unfinished tasks."""
    vol = em((12, 40, 40))
    cfg_a = base_config(tmp_path / "a", vol=vol, task_chunks=[1, 2, 2])
    rf_a = prepare(cfg_a)
    ids = run_all(rf_a)
    assert len(ids) == 27
    cfg_b = base_config(tmp_path / "b", vol=vol, task_chunks=[1, 2, 2])
    rf_b = prepare(cfg_b)
    # all 27 at once, in threads (the processes variant is test_T12_processes, marked slow)
    with ThreadPoolExecutor(len(ids)) as ex:
        list(ex.map(lambda i: run_task(rf_b, i, **QUIET), ids))
    a, b = layer_files(load_run(rf_a).output.url), layer_files(load_run(rf_b).output.url)
    assert a == b and len(a) == 75
    # T13: lose half the manifests ("crash at 50%"): status lists exactly those, the rerun writes only them
    run_b = load_run(rf_b)
    lost = ids[::2]
    for i in lost:
        manifest_path(run_b, i).unlink()
    from znni_core.pipeline.run import run_geometry

    todo = [blk.id for blk in run_geometry(run_b)[3] if not manifest_path(run_b, blk.id).is_file()]
    assert todo == lost
    for i in todo:
        run_task(rf_b, i, **QUIET)
    assert layer_files(run_b.output.url) == a
    assert finalize(rf_b, log=lambda *a: None)["done"] == 27


@pytest.mark.slow
def test_T12_processes(tmp_path):
    """All 27 tasks of a 3x3x3 neighbourhood as 27 concurrent `znni run-task` processes: byte-identical."""
    from .pipeline_helpers import subprocess_env

    vol = em((12, 40, 40))
    rf_a = prepare(base_config(tmp_path / "a", vol=vol))
    ids = run_all(rf_a)
    rf_b = prepare(base_config(tmp_path / "b", vol=vol))
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "znni_core.cli", "run-task", str(rf_b), "--task", str(i), "--no-progress"],
            env=env,
            stderr=subprocess.PIPE,
        )
        for i in ids
    ]
    for p in procs:
        assert p.wait(timeout=600) == 0, p.stderr.read().decode()
    assert layer_files(load_run(rf_a).output.url) == layer_files(load_run(rf_b).output.url)
    _ = os


# --------------------------------------------------------------------------- job sizing (auto)
def test_auto_jobs_are_sized_by_the_predicted_rate_and_fill_the_slots(tmp_path):
    """No measured rate: the plan's time model sizes the jobs; a small volume is spread over the
    jobs Snakemake runs at once, not one job per task; the cached schedule keeps its job ranges
    when a resume runs with another --jobs."""
    from znni_core.pipeline.schedule import compute_schedule, workflow_schedule

    cfg = validate_config(base_config(tmp_path, vol=em((12, 40, 40)), task_chunks=[1, 1, 1]))
    whole = compute_schedule(cfg)  # one core's worth: everything in one ~30-minute job
    assert whole["num_tasks"] >= 4 and whole["num_jobs"] == 1, whole
    assert "predicted by the plan's time model" in whole["why"], whole["why"]
    two = compute_schedule(cfg, slots=2)
    # two jobs: halves, or boxes of tasks that share their input chunks (fetched once per job)
    assert two["num_jobs"] == 2 and two["tasks_per_job"] >= -(-two["num_tasks"] // 2), two
    assert "2 jobs at once" in two["why"]
    if two["brick"]:
        assert math.prod(two["brick"]) == two["tasks_per_job"] and "a job is a box of" in two["why"]
        assert two["input_reads"]["jobs"] == f"a job's {'x'.join(map(str, two['brick']))} tasks share"
    # a measured rate wins over the prediction; max_jobs still bounds the count
    slow = compute_schedule(cfg | {"jobs": cfg["jobs"] | {"voxels_per_second": 1e-3}}, slots=2)
    assert slow["tasks_per_job"] == 1 and "(measured)" in slow["why"], slow
    capped = compute_schedule(cfg | {"jobs": cfg["jobs"] | {"voxels_per_second": 1e-3, "max_jobs": 2}})
    assert capped["num_jobs"] == 2 and "max_jobs=2" in capped["why"], capped
    # no more tasks than slots: a job each, and no plan is made for the rate (it imported the
    # engine into Snakemake's process)
    import znni_core.pipeline.schedule as J

    planned = []
    real = J.predicted_rate
    J.predicted_rate = lambda *a: planned.append(1) or real(*a)
    try:
        few = compute_schedule(cfg | {"task_chunks": [64, 64, 64]}, slots=8)
    finally:
        J.predicted_rate = real
    assert few["num_tasks"] <= 8 and few["num_jobs"] == few["num_tasks"] and not planned, few
    assert "a job each" in few["why"]
    # the schedule is computed once per run: another slot count on resume reads the same ranges
    first = workflow_schedule(cfg, 2)
    again = workflow_schedule(cfg, 7)
    assert first == again and again["slots"] == 2


def test_auto_task_chunks_follow_the_slots_and_the_run_records_the_box(tmp_path):
    """task_chunks: auto gives at least as many tasks as slots on a small volume (never more than
    needed), the schedule records the box, and validate writes the same box into the run."""
    from znni_core.pipeline.schedule import compute_schedule

    cfg = validate_config(base_config(tmp_path, vol=em((12, 40, 40)), task_chunks="auto"))
    one = compute_schedule(cfg, slots=1)
    assert one["num_tasks"] == 1, one  # one job: the whole region, no halo computed twice
    four = compute_schedule(cfg, slots=4)
    assert 4 <= four["num_tasks"] <= 6 and four["task_box"] == four["task_chunks"], four
    run, _ = resolve(cfg | {"task_chunks": four["task_box"]}, mem_mb=2000, threads=1, progress=lambda *a: None)
    assert run.task_chunks == four["task_box"] == run.config.task_chunks
    run_auto, _ = resolve(cfg, mem_mb=2000, threads=1, progress=lambda *a: None)  # validate alone: this machine's CPUs
    assert run_auto.config.task_chunks == run_auto.task_chunks != "auto"


def test_job_overlaps_read_compute_and_store_with_bounded_memory(tmp_path, monkeypatch):
    """A job's tasks run as a Dask pipeline: task k+1's read starts before task k's compute ends,
    task k-1's store before task k's compute ends; never more than two inputs ahead; every
    compute runs in the thread that called the job (the engine's heap, ``run_pipelined``); the
    bytes equal task-by-task runs; a task whose read fails is named and the others are done."""
    import threading

    from znni_core.pipeline import task as T
    from znni_core.pipeline.jobs import run_job

    vol = em((12, 40, 40))
    cfg = base_config(tmp_path, vol=vol, task_chunks=[1, 1, 2])
    rf = prepare(cfg)
    n = load_run(rf).num_tasks
    assert n >= 4
    events, lock = [], threading.Lock()
    started = {s: {k: threading.Event() for k in range(n)} for s in ("read", "store")}
    ids = [b.id for b in run_geometry(load_run(rf))[3]]
    pos = {t: k for k, t in enumerate(ids)}

    def note(what, k):
        with lock:
            events.append((what, k))

    real_read, real_compute, real_store = T.read_task, T.compute_task, T.store_task

    def read(ctx, task_id, **kw):
        k = pos[task_id]
        note("read+", k)
        started["read"][k].set()
        return real_read(ctx, task_id, **kw)

    def compute(ctx, ti, **kw):
        k = pos[ti.task_id]
        note("compute+", k)
        note("compute in", threading.current_thread().name)
        # the next task's read and the previous task's store run while this compute is still open
        assert k + 1 >= n or started["read"][k + 1].wait(60), f"task {k + 1}'s read did not overlap compute {k}"
        assert k == 0 or started["store"][k - 1].wait(60), f"task {k - 1}'s store did not overlap compute {k}"
        out = real_compute(ctx, ti, **kw)
        note("compute-", k)
        return out

    def store(ctx, ti, *a, **kw):
        k = pos[ti.task_id]
        started["store"][k].set()
        return real_store(ctx, ti, *a, **kw)

    monkeypatch.setattr(T, "read_task", read)
    monkeypatch.setattr(T, "compute_task", compute)
    monkeypatch.setattr(T, "store_task", store)
    doc = run_job(rf, 0, n, log=lambda *a: None)
    assert len(doc["ran"]) == n
    assert {e[1] for e in events if e[0] == "compute in"} == {threading.current_thread().name}, events
    order = {e: i for i, e in enumerate(events)}
    for k in range(2, n):  # bounded: read k only after compute k-2 finished
        assert order[("read+", k)] > order[("compute-", k - 2)], events
    piped = layer_files(load_run(rf).output.url)
    monkeypatch.undo()

    # the same bytes as one task at a time
    cfg2 = base_config(tmp_path / "seq", vol=vol, task_chunks=[1, 1, 2])
    rf2 = prepare(cfg2)
    run_all(rf2)
    assert piped == layer_files(load_run(rf2).output.url)

    # a failing read: the others are done, the job names it
    for p in (Path(load_run(rf).work_dir) / "manifests").rglob("*.json"):
        p.unlink()

    def bad_read(ctx, task_id, **kw):
        if pos[task_id] == 1:
            raise DataError("injected read failure")
        return real_read(ctx, task_id, **kw)

    monkeypatch.setattr(T, "read_task", bad_read)
    with pytest.raises(DataError, match=r"1 of \d+ task\(s\) failed \(task \d+: injected read failure"):
        run_job(rf, 0, n, log=lambda *a: None)
    done = [manifest_path(load_run(rf), t).is_file() for t in ids]
    assert done == [k != 1 for k in range(n)]


def test_job_whose_compute_has_a_bug_stops_with_it(tmp_path, monkeypatch):
    """A compute that raises something other than a ZnniError (a bug, not bad data) runs in the
    calling thread: the job stops with that error (Dask's thread does not wait forever), and
    the task has no manifest."""
    from znni_core.pipeline import task as T
    from znni_core.pipeline.jobs import run_job

    cfg = base_config(tmp_path, vol=em((12, 40, 40)), task_chunks=[1, 1, 2])
    rf = prepare(cfg)
    n = load_run(rf).num_tasks

    def broken(ctx, ti, **kw):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(T, "compute_task", broken)
    with pytest.raises(RuntimeError, match="injected bug"):
        run_job(rf, 0, n, log=lambda *a: None)
    assert not list((Path(load_run(rf).work_dir) / "manifests").rglob("*.json"))


def test_task_compute_tiles_the_plan_over_a_larger_box_as_one_infer():
    """``task.compute`` runs a chain task's window: the plan's output tiles over the task's box
    (the last one per axis shifted back, so 3 per axis here), equal to one ``infer`` over the
    whole box, one progress step per patch; a task smaller than one patch is its input padded
    with edge values (only outputs cropped away see them), equal to ``infer`` too."""
    from tests.nets import make_net
    from znni_core.exec.executor import Executor
    from znni_core.exec.tiling import window
    from znni_core.pipeline.task import compute
    from znni_core.plan import autotune

    net = make_net([("conv", 3, 3), ("act", "relu"), ("pool", 2), ("conv", 2, 3)])
    fov = net.field_of_view
    plan = autotune(net, patch_shape=tuple(f + 3 for f in fov), memory_budget=1 << 30, use_cache=False)
    rng = np.random.default_rng(0)
    with Executor(plan, net) as run:
        for out_shape, patches in ((tuple(2 * o + 1 for o in plan.output_shape), 27), ((3, 1, 2), 1)):
            x = rng.standard_normal((1,) + tuple(o + f - 1 for o, f in zip(out_shape, fov)), dtype=np.float32)
            steps = []
            y = compute(run, x, window(net, plan, (0, 0, 0), out_shape), progress=steps.append)
            assert y.shape == (net.out_channels,) + out_shape
            assert len(steps) == patches
            np.testing.assert_allclose(y, znni_core.infer(net, x), rtol=1e-5, atol=1e-5)


def test_a_tasks_plan_may_cut_the_task_into_smaller_patches():
    """A chain net's task plan is the autotuner's for the task's read: where one patch of the
    whole task only fits the budget with depth-first pooling, thinner MPF patches that the
    model says are faster are chosen (a net flat in z pays no halo for them); the plan's rate
    over the task is never below the one-patch plan's."""
    from tests.nets import make_net
    from znni_core.pipeline.resolve import task_plan
    from znni_core.plan import autotune
    from znni_core.plan.candidates import rate as _rate

    net = make_net(
        [
            ("conv", 16, (1, 5, 5)),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 16, (1, 3, 3)),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 1, (1, 3, 3)),
        ],
        seed=4,
    )
    cfg = parse_config(
        {"input": {"path": "file:///em", "dtype": "uint8"}, "network": {"path": "n"}, "output": {"path": "file:///o"}}
    )
    task = (24, 200, 200)
    read = tuple(t + f - 1 for t, f in zip(task, net.field_of_view))
    budget = 96 << 20
    plan = task_plan(net, cfg, budget, 1, task, None)
    one = autotune(net, patch_shape=read, memory_budget=budget, threads=1, use_cache=False)
    assert plan.predicted_peak_bytes <= budget
    assert any(s.primitive != "mpf" for s in one.steps if s.op == "pool")  # one patch: MPF does not fit
    assert _rate(net, plan.patch_shape, plan.predicted_seconds, read) >= _rate(
        net, one.patch_shape, one.predicted_seconds, read
    )
    assert plan.patch_shape[1:] == read[1:] and plan.patch_shape[0] <= read[0]


@pytest.mark.parametrize("edge", ["valid", "mirror"])
def test_verify_recomputes_voxels_from_the_network_and_catches_tampering(tmp_path, edge):
    """``znni verify``: a finished run passes (stored objects against their manifests, and voxels
    recomputed from the network's definition, including each task's corners); a chunk changed
    after the run fails, named, whether or not its manifest's digest was changed with it."""
    import hashlib

    from znni_core.io import read_manifest
    from znni_core.pipeline.verify import verify_run

    vol = em()
    cfg = base_config(tmp_path, vol=vol, edge=edge)
    rf = prepare(cfg)
    run_all(rf)
    rec = verify_run(rf, tasks=3, samples=20, seed=1, log=lambda *a: None)
    assert rec["checksums"]["passed"] and rec["recomputed"]["passed"], rec
    assert rec["recomputed"]["voxels"] >= 3 * 8 and rec["recomputed"]["max_deviation"] < 1e-4, rec
    assert json.loads((Path(cfg["work_dir"]) / "verify.json").read_text()) == rec
    # tamper: one stored value of task 0's first chunk (a valid chunk, other bytes)
    run = load_run(rf)
    mp = manifest_path(run, 0)
    m = read_manifest(mp)
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    idx = tuple(m["chunks"][0]["index"])
    arr = layer.read_chunk(idx)
    arr[(0,) + tuple(s // 2 for s in arr.shape[1:])] += 0.5
    layer.write_chunk(idx, arr)
    with pytest.raises(DataError, match="sha256|checksum|changed"):
        verify_run(rf, tasks=3, samples=20, seed=1, log=lambda *a: None)
    # and its manifest rewritten to match: the recomputation still catches it (all tasks, dense sample)
    m["chunks"][0]["sha256"] = hashlib.sha256(
        np.ascontiguousarray(arr, dtype=np.dtype("float32").newbyteorder("<")).tobytes()
    ).hexdigest()
    mp.write_text(json.dumps(m))
    n_tasks = len(run_geometry(run)[3])
    with pytest.raises(DataError, match="the network gives"):
        verify_run(rf, tasks=n_tasks, samples=4000, seed=1, log=lambda *a: None)


def test_test_time_augmentation_equals_torch_on_every_variant(tmp_path):
    """``tta: {flips: [y, x], transpose_xy: true, variance: true}``: the stored output is the mean of
    the network on the 8 flipped/transposed inputs, each transformed back, as PyTorch computes them,
    then the per-voxel variance across them; a y/x-asymmetric halo with the transpose is refused at
    validate."""
    vol = em()
    layout = [("conv", 2, (1, 3, 3)), ("act", "relu"), ("pool", (1, 2, 2)), ("conv", 2, (2, 3, 3)), ("act", "tanh")]
    cfg = base_config(
        tmp_path,
        vol=vol,
        layout=layout,
        tta={"flips": ["y", "x"], "transpose_xy": True, "variance": True},
        verify_voxels=16,
    )
    rf = prepare(cfg)
    run_all(rf)
    got, _ = read_out(rf)
    net = znni_core.load_network(cfg["network"]["path"])
    x = vol.astype(np.float32)[None] * np.float32(cfg["normalize"]["scale"])
    outs = []
    for flips in ((), (2,), (3,), (2, 3)):
        for transpose in (False, True):
            xv = np.flip(x, flips) if flips else x
            xv = xv.swapaxes(2, 3) if transpose else xv
            y = torch_dense(net, np.ascontiguousarray(xv))
            y = y.swapaxes(2, 3) if transpose else y
            outs.append(np.flip(y, flips) if flips else y)
    ref = np.mean(outs, axis=0)
    assert not np.allclose(ref, outs[0], atol=1e-3)  # the variants differ: the mean is not the plain output
    c = ref.shape[0]
    assert got.shape[0] == 2 * c  # the mean's channels, then the variances'
    np.testing.assert_allclose(got[:c], ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[c:], np.var(np.asarray(outs, np.float64), axis=0), rtol=1e-4, atol=1e-7)
    # each task checked its sampled voxels against the definition under the same augmentation, and
    # `znni verify` recomputes mean and variance channels alike (a plain forward pass differs)
    run = load_run(rf)
    rec = json.loads(manifest_path(run, 0).read_text())["recomputed"]
    assert rec["voxels"] >= 8 and rec["max_deviation"] <= rec["tolerance"], rec
    n_tasks = len(run_geometry(run)[3])
    assert verify_run(rf, tasks=n_tasks, samples=32, log=lambda *a: None)["recomputed"]["passed"]
    asym = base_config(tmp_path / "asym", vol=vol, layout=[("conv", 1, (1, 2, 3))], tta={"transpose_xy": True})
    with pytest.raises(ConfigError, match="transpose_xy"):
        resolve(asym, progress=lambda *a: None)


def test_each_task_recomputes_sampled_voxels_before_it_is_done(tmp_path, monkeypatch):
    """``verify_voxels``: a task's manifest records the voxels recomputed from the definition; an
    engine that computed one sampled voxel wrong fails the task before anything is written."""
    from znni_core.pipeline import task as T

    cfg = base_config(tmp_path, verify_voxels=40)
    rf = prepare(cfg)
    run_task(rf, 0, **QUIET)
    rec = json.loads(manifest_path(load_run(rf), 0).read_text())["recomputed"]
    assert rec["voxels"] >= 8 and rec["max_deviation"] <= rec["tolerance"], rec
    real = T.compute

    def wrong(*a, **kw):
        y = real(*a, **kw)
        y[(slice(None),) + (0, 0, 0)] += 0.25  # a corner: always sampled
        return y

    monkeypatch.setattr(T, "compute", wrong)
    with pytest.raises(DataError, match="the network gives"):
        run_task(rf, 1, **QUIET)
    assert not manifest_path(load_run(rf), 1).exists()
