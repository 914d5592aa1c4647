"""A tiny end-to-end run of the benchmark harness (no timing assertions).

It checks the plumbing: the ZNNi networks build, both PyTorch baselines agree with each
other and with znni, the harness times all three methods at two budgets, and the JSON,
plot and RESULTS.md are written.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import harness, machine, plot, report  # noqa: E402
from benchmarks.baselines import TorchDense, TorchNaive  # noqa: E402
from benchmarks.nets import ARCH, direct_flops_per_voxel, make_network  # noqa: E402
from tests.nets import make_net  # noqa: E402

MB = 2**20


def test_znni_networks_geometry():
    fov = {"n337": 86, "n537": 164, "n726": 118, "n926": 156}
    for name, (k, pools, convs) in ARCH.items():
        net = make_network(name, width=4)
        assert net.field_of_view == (fov[name],) * 3
        assert net.pooling_product == (2**pools,) * 3
        assert sum(1 for l in net.layers if type(l).__name__ == "Conv") == convs
        assert net.out_channels == 3 and net.in_channels == 1
    assert direct_flops_per_voxel(make_network("n337", 24)) == 2 * 27 * (24 + 5 * 24 * 24 + 24 * 3)


def test_the_multiply_add_peak_runs_a_chain_per_register_at_each_width():
    """``machine.fma_peak``: 24 independent multiply-add chains of the width asked; a rate for 256
    bits everywhere, for 512 bits only where the host has AVX-512 (no time is asserted)."""
    ir = machine._fma_loop_ir(16)
    assert ir.count("call <16 x float> @llvm.fma.v16f32(") == 24 and "<8 x float>" not in ir
    assert machine.fma_peak(256, iterations=10_000, repeats=1) > 0
    peak = machine.fma_peak(512, iterations=10_000, repeats=1)
    assert (peak is None) == ("avx512f" not in machine.cpu_flags()) and (peak is None or peak > 0)


def test_baselines_agree_on_a_small_net():
    torch.set_num_threads(2)
    net = make_net(
        [
            ("conv", 3, 3),
            ("act", "relu"),
            ("pool", 2),
            ("conv", 3, 2),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 2, 2),
        ],
        seed=3,
    )
    f, d = net.field_of_view, net.pooling_product
    x = np.random.default_rng(0).standard_normal(
        (1,) + tuple(ff - 1 + 2 * dd for ff, dd in zip(f, d)), dtype=np.float32
    )
    dense = TorchDense(net).run(x)
    naive, _, done = TorchNaive(net).run(x)
    assert done == np.prod(d)
    np.testing.assert_allclose(naive, dense, rtol=1e-5, atol=1e-5)


def test_harness_smoke(tmp_path):
    torch.set_num_threads(2)
    net = make_net(
        [("conv", 3, 3), ("act", "relu"), ("pool", 2), ("conv", 4, 3), ("act", "relu"), ("pool", 2), ("conv", 3, 2)],
        seed=1,
    )
    cfg = harness.Config(
        networks=(),
        width=4,
        budget=48 * MB,
        sweep_budgets=(32 * MB, 48 * MB),
        repeats=2,
        effort="estimate",
        dense_candidates=1,
        naive_time_limit=0.2,
        profile=True,
    )
    m = machine.describe(measure_haswell=False)
    res = harness.bench_network(net, cfg, m["gemm_flops"])
    main = res["main"]
    assert main["verify"]["ok"], main["verify"]
    for key in ("znni", "dense", "naive"):
        assert main[key]["voxels_per_s"] > 0 and len(main[key]["seconds"]) == cfg.repeats
    assert main["ratio_vs_dense"] > 0 and main["ratio_vs_naive"] > 0
    assert len(res["sweep"]) == 2 and "znni_profile" in main and "dense_profile" in main

    results = {"config": {**cfg.__dict__, "extra": {"command": "pytest smoke"}}, "machine": m, "networks": [res]}
    (tmp_path / "results_w4.json").write_text(json.dumps(results, default=str))
    png = plot.sweep_plot(results, tmp_path / "sweep_w4.png")
    assert png.stat().st_size > 1000
    md = report.write_report(tmp_path).read_text()
    assert net.name in md and "sweep_w4.png" in md and "GEMM" in md


def test_runtime_baselines_dense_forms_equal_znni(tmp_path):
    """The dense formulation every runtime baseline runs (3D, and 2D with z as the batch)
    computes what znni computes, and the ONNX export of it runs where a runtime is installed."""
    import znni_core
    from benchmarks.nets import make_boundary_network
    from benchmarks.runtimes import Baselines, dense_module, is_2d

    net = make_boundary_network()
    assert net.field_of_view == (1, 95, 95) and net.pooling_product == (1, 16, 16) and is_2d(net)
    assert direct_flops_per_voxel(net) == 2 * 218_696
    x = np.random.default_rng(0).random((1, 2, 110, 111), dtype=np.float32)
    ref = znni_core.infer(net, x, memory_budget=256 * MB)
    with torch.no_grad():
        y3 = dense_module(net)(torch.from_numpy(x[None])).numpy()[0]
        y2 = dense_module(net, two_d=True)(torch.from_numpy(x.transpose(1, 0, 2, 3).copy())).numpy()
    assert np.abs(y3 - ref).max() < 1e-4
    assert np.abs(y2.transpose(1, 0, 2, 3) - ref).max() < 1e-4
    base = Baselines(net, x, threads=1, tmp=tmp_path)
    for name, fn in base.fns.items():  # PyTorch always; ONNX Runtime / OpenVINO with the bench extra
        assert np.abs(fn() - ref).max() < 1e-4, name


def test_read_input_benchmark_reads_equal_boxes():
    """``benchmarks.read_input`` on a small volume: both readers return the box (asserted inside)."""
    from benchmarks.read_input import main

    doc = main(["--shape", "16,64,64", "--chunk", "8,32,32", "--box", "10,40,40", "--rounds", "1", "--pause", "0"])
    assert set(doc["layers"]) == {"raw", "sharded"} and doc["box"] == (10, 40, 40)


def test_layers_benchmark_matches_every_conv_to_openvinos_node(tmp_path):
    """``benchmarks.layers``: each conv of a generated U-Net is timed by znni's profile and found
    among OpenVINO's counters by its ONNX name (OpenVINO names some ``<name>/WithoutBiases``)."""
    pytest.importorskip("openvino")
    from benchmarks import layers

    r = layers.measure("padded-small-flat-whole", rounds=1, threads=1, tmp=tmp_path, whole=(4, 48, 48))
    assert len(r["rows"]) == 8, r["rows"]  # the generated U-Net's convs, every one
    assert all(row["znni_s"] > 0 and row["openvino_s"] and row["openvino"] for row in r["rows"]), r["rows"]
    assert r["whole"]["znni"] > 0 and r["whole"]["openvino"] > 0
    text = layers.render([r], "python -m benchmarks.layers", 1, 1)
    assert text.count("| /") == 8 and "| all convs |" in text
