"""The GPU plans on the simulated GPU (layers/simdevice.py): every device code path, the
device memory model, GPU + host RAM and CPU -> GPU plans, against the CPU engine.

``ZNNI_TEST_DEVICE=cuda`` runs the same tests on the real CUDA device through CuPy
(``scripts/gpu_check.sh`` does, on a lent GPU); the few that test the simulation itself,
or need the pipeline's packages, are skipped there.

The simulated device is numpy behind CuPy's rules (a distinct array type, no implicit
host/device mixing, single-precision FFTs, a capped pool that counts its peak), so these
tests fail on what would fail first on a GPU: a weight left on the host, an allocation
the memory model did not predict.  Speed is not simulated."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest

import znni_core
from znni_core.errors import MemoryBudgetError, PlanError
from znni_core.exec.device import PeakMeter
from znni_core.layers import simdevice
from znni_core.layers.xp import SIMULATED, require_device
from znni_core.plan import Plan, autotune

from .nets import NETS, make_net

TOL = 1e-4
GPU_ONLY = ("direct-gemm", "fft-gemm")


#: run these tests on the real CUDA device (CuPy) instead of the simulated one
REAL = os.environ.get("ZNNI_TEST_DEVICE") == "cuda"
simulated_only = pytest.mark.skipif(REAL, reason="tests the simulated device itself")


@pytest.fixture
def gpu(monkeypatch):
    """The simulated GPU with 1 GiB (or the real device under ``ZNNI_TEST_DEVICE=cuda``), its
    memory emptied of earlier tests' kernel transforms."""
    znni_core.release_cache()
    if REAL:
        monkeypatch.delenv(SIMULATED, raising=False)
        xp = require_device("gpu")
        assert not getattr(xp, "simulated", False)
        return xp
    monkeypatch.setenv(SIMULATED, "1GiB")
    xp = simdevice.module(2**30)
    assert require_device("gpu") is xp
    return xp


def _input(net, extra=3, seed=0):
    shape = tuple(f + extra * d - 1 for f, d in zip(net.field_of_view, net.pooling_product))
    return np.random.default_rng(seed).standard_normal((net.in_channels,) + shape).astype(np.float32)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("name", ["iso2pool", "aniso", "deep", "nopool"])
@pytest.mark.parametrize("prim", ["direct-gemm", "fft-gemm", "fft-data", "winograd", "direct-torch"])
def test_every_primitive_and_pool_mode_on_the_device_equals_the_cpu(gpu, name, prim):
    if prim == "direct-torch":
        pytest.importorskip("torch")
    net = make_net(NETS[name], seed=2)
    x = _input(net)
    ref = znni_core.infer(net, x)
    modes = [None] + ([("pool",) * len(net.pools)] if net.pools else [])
    for m in modes:
        plan = autotune(
            net,
            device="gpu",
            memory_budget=2**28,
            primitives=(prim,),
            patch_shape=x.shape[1:],
            pool_modes=m,
            use_cache=False,
        )
        assert plan.device == "gpu" and plan.placement == ""
        out = znni_core.infer(net, x, device="gpu", plan=plan)
        assert isinstance(out, np.ndarray)
        assert rel(out, ref) <= TOL, (name, prim, m)


@pytest.mark.parametrize("name", ["iso2pool", "aniso"])
def test_device_peak_is_within_25_percent_of_the_plan(gpu, name):
    """GPU-only plans with the default GPU primitives: the pool's measured peak against the
    plan's predicted peak (the patch, kernel transforms, every layer's tensors and workspaces)."""
    net = make_net(NETS[name], seed=3)
    x = _input(net, extra=6)
    for budget in (2**28, 2**24):
        plan = autotune(
            net, device="gpu", memory_budget=budget, input_shape=x.shape[1:], use_cache=False, primitives=GPU_ONLY
        )  # the defaults
        assert plan.placement == ""
        znni_core.release_cache()
        with PeakMeter(gpu) as meter:
            znni_core.infer(net, x, device="gpu", plan=plan)
        measured = meter.peak
        assert measured <= plan.memory_budget
        assert 0.75 * plan.predicted_peak_bytes <= measured <= 1.25 * plan.predicted_peak_bytes, (
            budget,
            measured,
            plan.predicted_peak_bytes,
        )


def test_gpu_plus_host_ram_plan_streams_layers_larger_than_the_device(gpu):
    """A patch whose tensors do not fit the device: the planner keeps them in host RAM and
    streams each conv through the device in blocks; the device never holds more than its budget."""
    net = make_net(NETS["iso2pool"], seed=4)
    x = _input(net, extra=20)
    budget = 8_000_000
    with pytest.raises(MemoryBudgetError):  # all on the device (depth-first pooling: the least), it does not fit
        _gpu_only(net, x, budget)
    plan = autotune(net, device="gpu", memory_budget=budget, patch_shape=x.shape[1:], use_cache=False)
    assert plan.placement == "gpu+host"
    assert plan.predicted_peak_bytes <= budget
    assert any(s.tile or s.micro_batch for s in plan.steps if s.op == "conv")  # blocks or micro-batches
    znni_core.release_cache()
    with PeakMeter(gpu) as meter:
        out = znni_core.infer(net, x, device="gpu", plan=plan)
    assert meter.peak <= budget
    assert rel(out, znni_core.infer(net, x)) <= TOL
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("prefer", ["large", "small", "resident"])
def test_gpu_plus_host_plan_fits_whatever_the_timings_prefer(gpu, monkeypatch, prefer):
    """Which options the planner picks layer by layer follows the timings, and options that fit
    one by one may not fit together (an early call's blocks beside a later layer's resident
    kernel transforms). Whatever the calibration favours (the largest calls, the smallest, the
    resident primitives), a tight device budget still gets a plan that fits it."""
    from znni_core.plan import pricing
    from znni_core.plan.primitives import PRIMITIVES

    net = make_net(NETS["iso2pool"], seed=4)
    x = _input(net, extra=20)
    budget = 8_000_000
    real = pricing.streamed_seconds

    def streamed(timer, prim, n, layer, spatial, mb, reps, tile, host_cal):
        t = real(timer, prim, n, layer, spatial, mb, reps, tile, host_cal)
        size = math.prod(spatial if not tile else tile) * (mb or n)
        return {"large": 1.0 / size, "small": size, "resident": 1.0 if PRIMITIVES[prim].resident else 2.0}[prefer] * t

    monkeypatch.setattr(pricing, "streamed_seconds", streamed)
    plan = autotune(
        net, device="gpu", memory_budget=budget, patch_shape=x.shape[1:], use_cache=False, placement="gpu+host"
    )
    assert plan.placement == "gpu+host" and plan.predicted_peak_bytes <= budget


def _gpu_only(net, x, budget):
    from znni_core.plan import chain as C
    from znni_core.plan import search as S
    from znni_core.plan.pooling import DepthFirst

    cal_budget, cal, _ = S.device_budget(budget)
    timer = C.Pricer("estimate", 1, cal)
    _, _, peak, _ = C._evaluate(net, x.shape[1:], (DepthFirst(),) * 2, cal_budget, timer, S.GPU_PRIMITIVES)
    if peak > budget:
        raise MemoryBudgetError("does not fit")


def test_cpu_to_gpu_pipeline_splits_and_equals_the_cpu(gpu):
    """cpu+gpu: the layers before the split run on the CPU (numpy arrays), the rest on the
    device, over several patches (the two stages overlapped by a worker thread)."""
    net = make_net(NETS["iso2pool"], seed=5)
    plan = autotune(net, device="cpu+gpu", memory_budget=2**26, patch_shape=_input(net).shape[1:], use_cache=False)
    assert plan.device == "cpu+gpu" and plan.placement == "cpu+gpu"
    assert plan.split in {s.index for s in plan.steps if s.op == "conv"}
    assert all(m == "mpf" for m in plan.pool_modes)
    front = {s.index for s in plan.steps if s.index < plan.split}
    assert "cpu" in plan.describe() and front == set(range(plan.split))
    x = _input(net, extra=7, seed=1)  # several patches
    out = znni_core.infer(net, x, device="cpu+gpu", plan=plan)
    assert rel(out, znni_core.infer(net, x)) <= TOL
    # every split gives the same result (the CPU stage may be empty or hold all but the last conv)

    portable = tuple(dataclasses.replace(s, primitive="direct-gemm") if s.op == "conv" else s for s in plan.steps)
    for split in sorted({s.index for s in plan.steps if s.op == "conv"}):
        p = dataclasses.replace(plan, split=split, steps=portable)  # direct-gemm runs on either side
        assert rel(znni_core.infer(net, x, device="cpu+gpu", plan=p), znni_core.infer(net, x)) <= TOL
    with pytest.raises(PlanError, match="MPF"):
        autotune(net, device="cpu+gpu", memory_budget=2**26, pool_modes=("pool", "mpf"), use_cache=False)


def test_cpu_to_gpu_split_inside_a_run_of_pointwise_convs(gpu):
    """A split between two 1x1x1 convs: the CPU stage's run of 1x1x1 convs (one pass in cache)
    stops at the split, and every split equals the CPU's output."""
    net = make_net(
        [("conv", 4, 3), ("act", "relu"), ("pool", 2), ("conv", 5, 1), ("act", "relu"), ("conv", 3, 1), ("conv", 2, 1)],
        seed=7,
    )
    plan = autotune(net, device="cpu+gpu", memory_budget=2**26, patch_shape=_input(net).shape[1:], use_cache=False)
    portable = tuple(dataclasses.replace(s, primitive="direct-gemm") if s.op == "conv" else s for s in plan.steps)
    x = _input(net, extra=3, seed=2)
    ref = znni_core.infer(net, x)
    for split in (3, 5, 6):  # before, inside and at the end of the run of 1x1x1 convs
        p = dataclasses.replace(plan, split=split, steps=portable)
        assert rel(znni_core.infer(net, x, device="cpu+gpu", plan=p), ref) <= TOL, split


def test_pipeline_split_follows_the_stage_rates(gpu, monkeypatch):
    """The split balances the two stages by their calibrated rates: a GPU made 10^5x faster
    takes every conv; a GPU 10^5x slower (slower than any CPU, an H100 too) leaves the CPU all
    but the last one."""
    from znni_core.plan import gpu_timing

    net = make_net(NETS["iso2pool"], seed=5)
    real = gpu_timing.calibrate_device(gpu)
    convs = [i for i, l in enumerate(net.layers) if type(l).__name__ == "Conv"]
    splits = {}
    for factor in (1e5, 1e-5):
        cal = dataclasses.replace(
            real,
            gemm_flops=real.gemm_flops * factor,  # not the link's rate
            mem_bw=real.mem_bw * factor,
            fft_s_per_vlogv=real.fft_s_per_vlogv / factor,
        )
        monkeypatch.setattr(gpu_timing, "calibrate_device", lambda xp, cal=cal, **kw: cal)
        splits[factor] = autotune(
            net, device="cpu+gpu", memory_budget=2**28, patch_shape=(93, 93, 93), use_cache=False
        ).split
    assert splits[1e5] == convs[0]
    assert splits[1e-5] == convs[-1]


@simulated_only
def test_simulated_device_enforces_cupys_rules(gpu):
    a = gpu.asarray(np.ones((4, 4), np.float32))
    with pytest.raises(TypeError, match="host"):
        gpu.matmul(a, np.ones((4, 4), np.float32))  # a weight never moved to the device
    with pytest.raises(TypeError, match="host"):
        a + np.ones((4, 4), np.float32)
    with pytest.raises(TypeError, match="through xp"):
        np.concatenate([a, a])  # numpy on device memory
    assert gpu.fft.rfftn(gpu.zeros((4, 4, 4), np.float32)).dtype == np.complex64  # as cuFFT, not numpy.fft
    pool = gpu.get_default_memory_pool()
    pool.set_limit(size=pool.used_bytes() + 1000)
    try:
        with pytest.raises(gpu.cuda.memory.OutOfMemoryError):
            gpu.empty(10_000, np.float32)
    finally:
        pool.set_limit(size=0)
    assert isinstance(gpu.asnumpy(a), np.ndarray) and type(a.get()) is np.ndarray


def test_device_budget_is_checked_at_plan_time(gpu):
    net = make_net(NETS["iso2pool"])
    total = int(gpu.cuda.runtime.memGetInfo()[1])
    with pytest.raises(MemoryBudgetError, match="more than the GPU holds"):
        autotune(net, device="gpu", memory_budget=2 * total, use_cache=False)
    with pytest.raises(PlanError, match="device"):
        autotune(net, device="tpu", use_cache=False)
    with pytest.raises(PlanError, match="GPU primitive"):
        autotune(net, device="cpu", primitives=("direct-torch",), use_cache=False)
    plan = autotune(net, device="gpu", input_shape=(40, 40, 40), use_cache=False)  # default: the free memory
    assert plan.memory_budget < total


def test_out_of_memory_mid_run_is_a_budget_error_not_a_crash(gpu, monkeypatch):

    from znni_core.plan import budget

    monkeypatch.setattr(budget, "DEVICE_HEADROOM", 0)

    net = make_net(NETS["iso2pool"], seed=6)
    x = _input(net)
    plan = autotune(net, device="gpu", memory_budget=2**26, patch_shape=x.shape[1:], use_cache=False)
    lying = dataclasses.replace(plan, memory_budget=1000)  # a plan whose budget the run cannot keep
    with pytest.raises(MemoryBudgetError, match="ran out of memory"):
        znni_core.infer(net, x, device="gpu", plan=lying)
    assert gpu.get_default_memory_pool().get_limit() == 0  # the cap is lifted afterwards


@pytest.mark.parametrize("valid", [True, False])
def test_unet_graph_on_the_device_equals_the_cpu(gpu, tmp_path, valid):
    pytest.importorskip("onnx")
    torch = pytest.importorskip("torch")
    from .unets import UNet, admissible, export

    torch.manual_seed(1)
    model = UNet(valid=valid, depth=2, kernel=(3, 3, 3), pool=(1, 2, 2), width=4, bn=False)
    shape = tuple(admissible(model, a, lo) for a, lo in enumerate((8, 28, 28)))
    net = znni_core.load_network(export(model, tmp_path / "u.onnx", shape))
    x = np.random.default_rng(2).standard_normal((1,) + shape).astype(np.float32)
    plan = autotune(net, device="gpu", memory_budget=2**27, patch_shape=shape, use_cache=False)
    out = znni_core.infer(net, x, device="gpu", plan=plan)
    assert rel(out, znni_core.infer(net, x)) <= TOL


def test_cli_plans_and_runs_every_device_kind(gpu, tmp_path):
    from typer.testing import CliRunner

    from znni_core.cli import app
    from znni_core.net.native import save_network

    net = make_net(NETS["iso2pool"], seed=7)
    path = save_network(net, tmp_path / "net.yaml")
    x = _input(net, extra=4)
    np.save(tmp_path / "x.npy", x)
    ref = znni_core.infer(net, x)
    runner = CliRunner()
    for device in ("gpu", "cpu+gpu"):
        r = runner.invoke(
            app,
            [
                "plan",
                str(path),
                "--device",
                device,
                "--memory",
                "64MiB",
                "--input-shape",
                ",".join(map(str, x.shape[1:])),
                "-o",
                str(tmp_path / f"{device}.json"),
            ],
        )
        assert r.exit_code == 0, r.output
        assert f"on {device}" in r.output
        r = runner.invoke(
            app,
            [
                "infer",
                str(path),
                str(tmp_path / "x.npy"),
                str(tmp_path / "y.npy"),
                "--device",
                device,
                "--plan",
                str(tmp_path / f"{device}.json"),
            ],
        )
        assert r.exit_code == 0, r.output
        assert rel(np.load(tmp_path / "y.npy"), ref) <= TOL
    too_much = 2 * int(gpu.cuda.runtime.memGetInfo()[1])
    r = runner.invoke(app, ["plan", str(path), "--device", "gpu", "--memory", str(too_much)])
    assert r.exit_code == 2 and "more than the GPU holds" in r.output


@simulated_only
def test_gpu_benchmark_runs_on_the_simulated_gpu(gpu, tmp_path):
    """The GPU benchmark's plumbing (every plan kind, PyTorch, the report): it is the command a
    lent GPU runs, so it must not first fail there.  Nothing here is a measurement."""
    pytest.importorskip("torch")
    from benchmarks import gpu as bench

    res = bench.main(["--smoke", "--rounds", "1", "--steps", "--out", str(tmp_path)])
    kinds = res["rows"][0]["kinds"]
    assert set(kinds) == {"gpu", "gpu+host", "cpu+gpu"} and all("error" not in k for k in kinds.values())
    assert all(k["max_rel_err_vs_pytorch"] <= 1e-4 for k in kinds.values())
    assert all(st["measured_s"] is not None for st in kinds["gpu"]["steps"])  # every step timed
    assert kinds["gpu+host"]["placement"] == "gpu+host" and kinds["cpu+gpu"]["split"] > 0
    assert kinds["gpu+host"]["measured_peak"] <= kinds["gpu+host"]["budget"]
    assert "| n337 | gpu+host |" in (tmp_path / "GPU-smoke.md").read_text()


@simulated_only
def test_one_task_per_gpu_on_a_node(gpu, monkeypatch, tmp_path):
    """Processes on one node take distinct GPUs; a third waits until one is released."""
    import multiprocessing as mp
    import queue

    from znni_core.exec import device as D

    monkeypatch.setenv(simdevice.ENV_COUNT, "2")
    monkeypatch.setenv(D.LOCK_DIR, str(tmp_path))
    with D.claimed_gpu("cpu") as none:
        assert none is None
    ctx = mp.get_context("spawn")
    q, release = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claim, args=(q, str(tmp_path), release)) for _ in range(2)]
    try:
        with D.claimed_gpu("gpu") as first:
            with D.claimed_gpu("gpu") as again:  # nested in one process: the same GPU
                assert again == first
            procs[0].start()
            assert {first, q.get(timeout=120)} == {0, 1}
            procs[1].start()
            with pytest.raises(queue.Empty):  # both GPUs held: the third process waits
                q.get(timeout=5)
        assert q.get(timeout=120) == first  # released here: the third takes it
    finally:
        release.set()
        for p in procs:
            p.join(60)


def _claim(q, lock_dir, release):
    import os

    os.environ[SIMULATED], os.environ[simdevice.ENV_COUNT] = "1GiB", "2"
    from znni_core.exec import device as D

    os.environ[D.LOCK_DIR] = lock_dir
    with D.claimed_gpu("gpu", poll_s=0.2) as i:
        q.put(i)
        release.wait(120)


def test_measure_effort_times_options_on_the_device(gpu, monkeypatch):
    """effort=measure on the GPU: the shortlisted options are timed on the device (counted
    here), and the plan is exact."""
    from znni_core.plan import gpu_timing

    calls = []
    real = gpu_timing.DeviceMeasurements.conv

    def counted(self, *a):
        calls.append(a[0])
        return real(self, *a)

    monkeypatch.setattr(gpu_timing.DeviceMeasurements, "conv", counted)
    net = make_net(NETS["aniso"], seed=8)
    x = _input(net)
    plan = autotune(net, device="gpu", memory_budget=2**26, effort="measure", input_shape=x.shape[1:], use_cache=False)
    assert calls and set(calls) <= {"direct-gemm", "fft-gemm"}  # the defaults
    assert rel(znni_core.infer(net, x, device="gpu", plan=plan), znni_core.infer(net, x)) <= TOL


@pytest.mark.parametrize("device", ["gpu", "cpu+gpu"])
def test_workflow_tasks_on_the_device_equal_whole_volume_inference(gpu, tmp_path, device):
    """The pipeline with config ``device: gpu`` / ``cpu+gpu``: plan, tasks and chunks as on the
    CPU, the bytes equal whole-volume inference."""
    pytest.importorskip("cloudvolume")  # the pipeline's packages (a lent GPU machine may lack them)
    from .pipeline_helpers import base_config, em
    from .test_pipeline import prepare, read_out, reference, run_all

    vol = em((10, 36, 36))
    cfg = base_config(tmp_path, vol=vol, device=device)
    rf = prepare(cfg)
    from znni_core.pipeline.run import load_run

    assert load_run(rf).config.device == device
    run_all(rf)
    got, _ = read_out(rf)
    np.testing.assert_allclose(got, reference(cfg, vol), rtol=1e-4, atol=1e-5)
