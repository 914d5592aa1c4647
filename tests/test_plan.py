"""The autotuner: budgets are never exceeded, predictions match measurements, caches work."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

import znni_core
from znni_core.plan import Plan, autotune
from znni_core.plan import timing as T

from .nets import NETS, make_net

MIB = 2 ** 20


def measured_peak(net, plan):
    """tracemalloc peak of infer on one patch, counting the input patch itself."""
    x = np.random.default_rng(0).standard_normal((net.in_channels,) + plan.patch_shape).astype(np.float32)
    znni_core.infer(net, x, plan=plan)  # warm-up: FFTW plans, numba compilation
    tracemalloc.start()
    tracemalloc.reset_peak()
    znni_core.infer(net, x, plan=plan)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak + x.nbytes


WIDE = [("conv", 8, 3), ("act", "relu"), ("pool", 2), ("conv", 12, 3), ("act", "relu"), ("pool", 2),
        ("conv", 12, 3), ("act", "relu"), ("conv", 3, 3), ("act", "sigmoid")]


@pytest.mark.parametrize("prim", ["direct-gemm", "fft-data", "fft-task", "fft-stream"])
@pytest.mark.parametrize("modes", [("mpf", "mpf"), ("pool", "mpf"), ("pool", "pool"), ("slab:4", "mpf"), ("slab:2", "pool")])
def test_predicted_peak_matches_measured(prim, modes):
    net = make_net(WIDE, seed=1)
    plan = autotune(net, memory_budget=2 ** 31, primitives=(prim,), pool_modes=modes, patch_shape=(45, 45, 45))
    measured = measured_peak(net, plan)
    assert measured <= plan.memory_budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.25 * plan.predicted_peak_bytes, \
        (measured / MIB, plan.predicted_peak_bytes / MIB)


@pytest.mark.parametrize("budget_mib", [24, 64, 256])
def test_autotuned_plan_stays_under_budget(budget_mib):
    net = make_net(WIDE, seed=2)
    plan = autotune(net, memory_budget=budget_mib * MIB)
    measured = measured_peak(net, plan)
    assert plan.predicted_peak_bytes <= budget_mib * MIB
    assert measured <= budget_mib * MIB, (measured / MIB, budget_mib)


def test_throughput_grows_with_budget():
    net = make_net(WIDE, seed=3)
    vps = [autotune(net, memory_budget=b * MIB).predicted_voxels_per_s for b in (16, 64, 512)]
    assert vps[0] <= vps[1] <= vps[2]
    assert vps[2] > vps[0]


def test_measure_plan_is_cached_and_reloads_fast():
    net = make_net(NETS["iso2pool"], seed=4)
    t0 = time.perf_counter()
    first = autotune(net, memory_budget=16 * MIB, effort="measure")
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = autotune(net, memory_budget=16 * MIB, effort="measure")
    assert time.perf_counter() - t0 < 1.0
    assert again == first and first.effort == "measure"
    assert t_first > 0


def test_measurements_export_import_round_trip(tmp_path):
    m = T.Measurements(threads=1)
    net = make_net(NETS["nopool"], seed=5)
    conv = net.layers[0]
    t = m.conv("direct-gemm", 1, conv, (10, 10, 10))
    path = m.export(tmp_path / "measurements.json")
    m.cache.data.clear()
    assert m.import_(path) >= 1
    assert m.conv("direct-gemm", 1, conv, (10, 10, 10)) == t


def test_plan_records_rejections_with_reasons():
    net = make_net(WIDE, seed=6)
    plan = autotune(net, memory_budget=24 * MIB)
    reasons = [r.reason for r in plan.rejected]
    assert any("> budget" in r for r in reasons)
    assert any(r.startswith("slower") for r in reasons)


def test_exhaustive_measures_every_candidate_and_takes_the_best():
    net = make_net(NETS["iso2pool"], seed=8)
    plan = autotune(net, memory_budget=4 * MIB, effort="exhaustive")
    assert plan.effort == "exhaustive"
    slower = [r.voxels_per_s for r in plan.rejected if r.reason.startswith("slower")]
    assert slower and max(slower) <= plan.predicted_voxels_per_s
    # every conv timing was measured and cached on disk
    assert len(T.Measurements(plan.threads).cache.data) > 0


@pytest.mark.parametrize("name", ["n337", "n537", "n726", "n926"])
def test_znni_networks_plan_fast_under_every_budget(name):
    """Issue 3: estimate-planning under 10 s per network, every budget from 0.5 GiB up fits."""
    from benchmarks.nets import make_network
    from znni_core.plan.search import default_threads

    T.calibrate(default_threads())  # once per machine, cached; not part of planning time
    for width in (24, 80):
        net = make_network(name, width=width)
        for gib in (0.5, 2, 8):
            t0 = time.perf_counter()
            plan = autotune(net, memory_budget=int(gib * 2 ** 30))
            assert time.perf_counter() - t0 < 10.0
            assert plan.predicted_peak_bytes <= gib * 2 ** 30
            assert Plan.from_json(plan.to_json()) == plan
