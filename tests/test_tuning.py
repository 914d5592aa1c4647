"""Kernel parameters measured per host (``layers/tuning.py``): chosen by the calibration, carried
by the plan, in force while the executor runs it, and exact whatever their values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import znni_core
from znni_core.errors import PlanError
from znni_core.layers import tuning
from znni_core.plan import Plan, autotune
from znni_core.plan import timing as T

from .nets import make_net
from .reference import max_rel_err, torch_dense

NET = [
    ("conv", 12, (1, 3, 3)),
    ("act", "relu"),
    ("pool", (1, 2, 2)),
    ("conv", 12, (1, 3, 3)),
    ("act", "relu"),
    ("conv", 12, (3, 3, 3)),
    ("act", "relu"),
    ("conv", 2, (1, 1, 1)),
    ("act", "sigmoid"),
]
ODD = {
    "winograd.block_bytes": 64 * 2**10,
    "winograd.large_tile_gain": 0.0,
    "winograd.blas": 1,
    "winograd.wide_tiles": 1,
    "pointwise.block": 64,
    "direct.row_group": 128,
}


def test_tune_keeps_the_default_on_a_tie_and_takes_a_clearly_faster_value(monkeypatch):
    """Scripted timings (each candidate's sum): the block size 1 MiB is 20% faster than the
    default and is taken; the tile gain 0 is 5% faster (a tie, noise) and the default stays;
    every candidate of every parameter is timed in every round, each under the values chosen
    before it, and a disturbed round does not decide (the minimum over rounds is kept)."""
    seen = []

    def fake_time_once(fn):
        v = tuning.current()
        seen.append(v)
        if v["winograd.block_bytes"] == 2**20 and len({s["winograd.large_tile_gain"] for s in seen}) == 1:
            return 0.8
        if v["winograd.large_tile_gain"] == 0.0:
            return 0.95
        if v["pointwise.block"] == 1024 and len([s for s in seen if s["pointwise.block"] == 1024]) == 3:
            return 5.0  # a disturbed round (the host busy) is not a measurement
        return 1.0

    monkeypatch.setattr(T, "_time_once", fake_time_once)
    monkeypatch.setattr(T, "_tuning_cases", lambda threads: {k: [lambda: lambda: None] for k in tuning.DEFAULTS})
    chosen, tried = T._tune(1)
    assert chosen == dict(tuning.DEFAULTS, **{"winograd.block_bytes": 2**20})
    assert {k: [v for v, _ in t] for k, t in tried.items()} == {k: list(c) for k, c in tuning.CANDIDATES.items()}
    assert len(seen) == T.TUNING_ROUNDS * sum(len(c) for c in tuning.CANDIDATES.values())
    n_block = T.TUNING_ROUNDS * len(tuning.CANDIDATES["winograd.block_bytes"])
    assert all(s["winograd.block_bytes"] == 2**20 for s in seen[n_block:])


def test_a_second_thread_count_reuses_the_first_ones_values(monkeypatch, tmp_path):
    """``warmup --threads 1 --threads 2`` times the kernel parameters once: the second calibration
    takes the first one's values and times no candidate."""
    monkeypatch.setenv("ZNNI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(T, "_tune", lambda threads: pytest.fail("timed the candidates again"))
    cal = T.calibrate(2, tuned=dict(ODD))
    assert cal.tuned == ODD and cal.tuning_seconds == {}


def test_a_quick_calibration_serves_until_a_full_one_is_asked_for(monkeypatch, tmp_path):
    """A cold host measures ``quick`` (defaults, one timed run per rate) and every later call
    takes it; ``level="full"`` tunes and measures again and replaces it; a quick request then
    takes the full one."""
    monkeypatch.setenv("ZNNI_CACHE_DIR", str(tmp_path))
    doc = json.loads((Path(__file__).parent / "data" / "calibration-zen4-2threads.json").read_text())["calibration"]
    rates = {k: v for k, v in doc.items() if k not in ("tuned", "tuning_seconds", "level")}
    seen = []

    def measure(threads, between=None):
        seen.append(T._LEVEL)
        return dict(rates, threads=threads)

    monkeypatch.setattr(T, "_measure", measure)
    monkeypatch.setattr(T, "_tune", lambda threads: (dict(ODD), {k: [[v, 1.0]] for k, v in ODD.items()}))
    cal = T.calibrate(1)
    assert (cal.level, cal.tuned, cal.tuning_seconds, seen) == ("quick", tuning.DEFAULTS, {}, ["quick"])
    assert T.calibrate(1) == cal and T.calibrate(1, level="quick") == cal and len(seen) == 1
    full = T.calibrate(1, level="full")
    assert (full.level, full.tuned, seen) == ("full", ODD, ["quick", "full"])
    assert T.calibrate(1) == full == T.calibrate(1, level="quick") == T.calibrate(1, level="full")
    assert T.calibrate(1, level="full", refresh=True).level == "full" and len(seen) == 3
    assert T._LEVEL == "full"  # the level is the measurement's only
    with pytest.raises(PlanError, match="'fast'"):
        T.calibrate(1, level="fast")
    monkeypatch.setenv("ZNNI_CALIBRATION", "quick")  # what a cold host measures: a cached full one still serves
    assert T.calibrate(1) == full
    monkeypatch.setenv("ZNNI_CALIBRATION", "Fast")
    with pytest.raises(PlanError, match="ZNNI_CALIBRATION 'fast'"):
        T.calibrate(1)
    monkeypatch.setenv("ZNNI_CALIBRATION", "full")
    monkeypatch.setenv("ZNNI_CACHE_DIR", str(tmp_path / "cold"))
    assert T.calibrate(1).level == "full" and seen[-1] == "full"


def test_the_measurement_times_the_first_compile_groups_kernels_before_it_waits_for_the_second(monkeypatch):
    """``znni warmup`` starts calibrating one thread when its first compile group ("winograd-in":
    1x1x1 chains, FFTs, activations, pooling) is done: ``between`` (the wait for the second) comes
    after every rate of the first group's kernels and before any of the second's (direct and
    Winograd), which the calibration would otherwise compile itself."""
    from znni_core import layers as L

    order = []

    def record(name, result=None):
        return lambda *a, **k: order.append(name) or result

    monkeypatch.setattr(T, "_best_of", lambda fn, repeats=5: (fn(), 1.0)[1])
    for name in ("conv_pointwise_chain", "apply_activation", "mpf", "conv_direct_gemm", "conv_direct_numba"):
        monkeypatch.setattr(L, name, record(name))
    monkeypatch.setattr(T, "_fft_rates", record("fft", {}))
    monkeypatch.setattr(T, "_fft_gemm_rates", record("fft-gemm", {}))
    monkeypatch.setattr(T, "_winograd_rates", record("winograd", {}))
    T._measure(1, between=lambda: order.append("between"))
    i = order.index("between")
    assert set(order[:i]) == {"conv_pointwise_chain", "fft", "fft-gemm", "apply_activation", "mpf"}, order
    assert set(order[i + 1 :]) == {"conv_direct_gemm", "conv_direct_numba", "winograd"}, order


def test_a_quick_calibration_times_each_rate_once_after_its_warm_up(monkeypatch):
    calls = []
    monkeypatch.setattr(T, "_LEVEL", "quick")
    T._best_of(lambda: calls.append(1), repeats=5)
    assert len(calls) == 2
    monkeypatch.setattr(T, "_LEVEL", "full")
    T._best_of(lambda: calls.append(1), repeats=5)
    assert len(calls) == 2 + 6


def test_the_plan_carries_the_hosts_values_and_the_executor_runs_under_them(monkeypatch):
    """A host whose calibration chose unusual values (a small Winograd block, 6-point tiles only,
    its products on BLAS, wide register tiles, short pointwise blocks and row groups): the plan records them, its digest and JSON keep them,
    and infer runs under them (they are in force after the run), equal to PyTorch."""
    cal = dataclasses.replace(T.calibrate(2), tuned=dict(ODD))
    monkeypatch.setattr(T, "calibrate", lambda threads=1, refresh=False: cal)
    net = make_net(NET, c_in=2)
    x = np.random.default_rng(0).standard_normal((2, 6, 41, 43)).astype(np.float32)
    plan = autotune(
        net, memory_budget=2**30, threads=2, input_shape=x.shape[1:], use_cache=False, primitives=("winograd",)
    )
    assert plan.tuning == ODD and any(s.primitive == "winograd" for s in plan.steps)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()

    assert dataclasses.replace(plan, tuning={}).digest() != plan.digest()
    with tuning.using(tuning.DEFAULTS):
        y = znni_core.infer(net, x, plan=plan)
        assert tuning.current() == ODD
    assert max_rel_err(y, torch_dense(net, x)) < 1e-4


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"winograd.tile": 1}, "unknown kernel parameters"),
        ({"pointwise.block": -1}, "pointwise.block=-1"),
        ({"direct.row_group": "big"}, "direct.row_group='big'"),
    ],
)
def test_a_plan_with_bad_tuning_is_refused_naming_the_value(bad, match):
    d = json.loads(
        Plan(
            network_digest="x",
            device="cpu",
            patch_shape=(1, 1, 1),
            output_shape=(1, 1, 1),
            field_of_view=(1, 1, 1),
            memory_budget=1,
            steps=(),
            predicted_seconds=1.0,
            predicted_peak_bytes=1,
        ).to_json()
    )
    d["tuning"] = bad
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)
