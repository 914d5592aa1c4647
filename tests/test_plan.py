"""The autotuner: budgets are never exceeded, predictions match measurements, caches work."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import znni_core
from znni_core.plan import Plan, autotune
from znni_core.plan import timing as T
from znni_core.plan import wisdom as W

from .nets import NETS, make_net

MIB = 2**20


def measured_peak(net, plan):
    """tracemalloc peak of a warm infer on one patch (the steady state of a run: every resident
    kernel spectrum is alive from its first use on, so a second patch meets them all), plus
    those spectra and the input patch itself."""
    from znni_core import inference

    x = np.random.default_rng(0).standard_normal((net.in_channels,) + plan.patch_shape).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:  # fresh buffers: the engine's own live set, as the model counts it
        mp.setenv("ZNNI_REUSE_BUFFERS", "0")
        znni_core.infer(net, x, plan=plan)  # warm-up: FFTW plans, numba compilation, resident spectra
        tracemalloc.start()
        tracemalloc.reset_peak()
        znni_core.infer(net, x, plan=plan)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    spectra = sum(
        c.kernel_cache_bytes for c in inference._LAST["executor"].state.values() if hasattr(c, "kernel_cache_bytes")
    )
    return peak + spectra + x.nbytes


WIDE = [
    ("conv", 8, 3),
    ("act", "relu"),
    ("pool", 2),
    ("conv", 12, 3),
    ("act", "relu"),
    ("pool", 2),
    ("conv", 12, 3),
    ("act", "relu"),
    ("conv", 3, 3),
    ("act", "sigmoid"),
]


@pytest.mark.parametrize("prim", ["direct-gemm", "fft-data", "fft-task", "fft-stream", "fft-gemm", "winograd"])
@pytest.mark.parametrize(
    "modes", [("mpf", "mpf"), ("pool", "mpf"), ("pool", "pool"), ("slab:4", "mpf"), ("slab:2", "pool")]
)
def test_predicted_peak_matches_measured(prim, modes):
    net = make_net(WIDE, seed=1)
    plan = autotune(net, memory_budget=2**31, primitives=(prim,), pool_modes=modes, patch_shape=(45, 45, 45))
    measured = measured_peak(net, plan)
    assert measured <= plan.memory_budget
    assert abs(measured - plan.predicted_peak_bytes) <= 0.25 * plan.predicted_peak_bytes, (
        measured / MIB,
        plan.predicted_peak_bytes / MIB,
    )


@pytest.mark.parametrize("budget_mib", [24, 64, 256])
def test_autotuned_plan_stays_under_budget(budget_mib):
    net = make_net(WIDE, seed=2)
    plan = autotune(net, memory_budget=budget_mib * MIB)
    measured = measured_peak(net, plan)
    assert plan.predicted_peak_bytes <= budget_mib * MIB
    # tracemalloc also counts the interpreter's own small objects (frames, dicts: a few KiB);
    # a plan at the budget measured 24.002 MiB of 24 at the last commit and at this one
    assert measured <= budget_mib * MIB + 64 * 1024, (measured / MIB, budget_mib)


def test_throughput_grows_with_budget():
    net = make_net(WIDE, seed=3)
    vps = [autotune(net, memory_budget=b * MIB).predicted_voxels_per_s for b in (16, 64, 512)]
    assert vps[0] <= vps[1] <= vps[2]
    assert vps[2] > vps[0]


def test_measure_plan_is_cached_and_reloads_without_measuring(monkeypatch):
    net = make_net(NETS["iso2pool"], seed=4)
    first = autotune(net, memory_budget=16 * MIB, effort="measure")
    calls = []
    monkeypatch.setattr(T.Measurements, "conv", lambda *a, **k: calls.append(a) or 1.0)
    monkeypatch.setattr("znni_core.plan.chain._evaluate", lambda *a, **k: calls.append(a) or None)
    again = autotune(net, memory_budget=16 * MIB, effort="measure")
    assert calls == []  # from the cache: nothing evaluated, nothing measured
    assert again == first and first.effort == "measure"


def test_estimate_plan_is_cached_by_input_shape(monkeypatch):
    from znni_core.plan import chain

    net = make_net(WIDE, seed=4)
    a = autotune(net, memory_budget=64 * MIB, input_shape=(40, 50, 60))
    evaluated, real = [], chain._evaluate
    monkeypatch.setattr(chain, "_evaluate", lambda *a, **k: evaluated.append(1) or real(*a, **k))
    assert autotune(net, memory_budget=64 * MIB, input_shape=(40, 50, 60)) == a
    assert evaluated == []
    b = autotune(net, memory_budget=64 * MIB, input_shape=(40, 50, 61))  # another shape: planned anew
    assert evaluated and b.provenance["input_shape"] == (40, 50, 61)


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


@pytest.mark.parametrize("name", ["n337", "n537", "n726", "n926", "boundary"])
def test_znni_networks_plan_with_bounded_search_under_every_budget(name):
    """Planning is bounded by counts, not seconds: the candidates evaluated stay
    few (coarse-to-fine over patch series, depth-first prefixes), every budget fits, and no
    patch exceeds the input it is planned for."""
    from benchmarks.nets import make_boundary_network, make_network

    nets = [make_boundary_network()] if name == "boundary" else [make_network(name, width=w) for w in (24, 80)]
    for net in nets:
        shape = tuple(f - 1 + 16 * d for f, d in zip(net.field_of_view, net.pooling_product))
        for gib in (0.5, 2, 8):
            for input_shape in (None, shape):
                plan = autotune(net, memory_budget=int(gib * 2**30), input_shape=input_shape, use_cache=False)
                assert plan.provenance["candidates"] <= 300, (net.name, gib, plan.provenance["candidates"])
                assert plan.predicted_peak_bytes <= gib * 2**30
                assert Plan.from_json(plan.to_json()) == plan
                if input_shape is not None:
                    assert all(p <= n for p, n in zip(plan.patch_shape, shape)), (plan.patch_shape, shape)


def test_patch_never_exceeds_the_input_and_small_input_is_one_patch():
    from znni_core.plan.candidates import input_patch

    net = make_net(WIDE, seed=9)
    fov, d = net.field_of_view, net.pooling_product
    x_shape = (fov[0] + 5, fov[1] + 3, fov[2] + 9)  # output not a multiple of D: rounded up once
    plan = autotune(net, memory_budget=2**31, input_shape=x_shape, use_cache=False)
    cap = input_patch(net, x_shape)
    assert plan.patch_shape == cap  # smaller than one good patch: runs as one patch
    assert all((c - f + 1) % dd == 0 and c - n < dd for c, n, f, dd in zip(cap, x_shape, fov, d))
    with pytest.raises(znni_core.errors.PlanError, match="field of view"):
        autotune(net, memory_budget=2**31, input_shape=(1, 1, 1))


def test_a_patch_short_of_the_input_is_charged_for_the_patches_it_needs():
    """The search ranks patches by the input's output voxels over the time of every patch
    that covers it: a patch one pooling product short of the input needs two per axis."""
    from znni_core.plan.candidates import input_patch
    from znni_core.plan.candidates import rate as _rate

    net = make_net(WIDE, seed=9)
    d = net.pooling_product
    x_shape = tuple(f + 4 * dd + 1 for f, dd in zip(net.field_of_view, d))
    whole = input_patch(net, x_shape)
    short = tuple(w - dd for w, dd in zip(whole, d))
    need = np.prod(net.output_shape(x_shape))
    assert _rate(net, whole, 1.0, x_shape) == need  # one patch in a second
    assert _rate(net, short, 1.0, x_shape) == need / 8  # 2 x 2 x 2 patches
    assert _rate(net, short, 1.0) == np.prod(net.output_shape(short))  # no input: the patch's own rate


def test_infer_keeps_the_kernel_spectra_for_the_next_call(monkeypatch):
    """A second ``infer`` with the same plan builds no kernel spectra; another plan replaces
    them; ``release_cache`` drops them (counts, not seconds)."""
    from znni_core import layers

    built = []
    real = layers.FFTGemmConv

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(layers, "FFTGemmConv", counting)  # the primitives build through the layers package
    net = make_net(WIDE, seed=4)
    x = np.random.default_rng(1).standard_normal((1,) + tuple(f + 3 for f in net.field_of_view)).astype(np.float32)
    plan = autotune(net, memory_budget=2**31, primitives=("fft-gemm",), input_shape=x.shape[1:], use_cache=False)
    n_conv = sum(1 for s in plan.steps if s.op == "conv")
    built.clear()  # the runs' builds only (planning may calibrate, which builds its own)
    first = znni_core.infer(net, x, plan=plan)
    assert len(built) == n_conv
    np.testing.assert_array_equal(znni_core.infer(net, x, plan=plan), first)
    assert len(built) == n_conv  # warm: nothing rebuilt
    znni_core.release_cache()
    znni_core.infer(net, x, plan=plan)
    assert len(built) == 2 * n_conv


def test_plan_cache_keeps_the_newest_entries(tmp_path):
    c = W.JsonCache(tmp_path / "plans.json", max_entries=2)
    for k in ("a", "b", "a", "c"):  # re-putting "a" makes it the newest
        c.put(k, {"v": k})
    assert list(W.JsonCache(tmp_path / "plans.json").data) == ["a", "c"]


def test_plan_cache_keeps_what_other_processes_wrote(tmp_path):
    """Two writers that read the file before either wrote (two jobs, two test workers sharing a
    cache): the second put keeps the first one's entry (it re-reads under a lock), where writing
    its stale copy lost it and the next call planned again.  A separate process writes one too."""
    import subprocess
    import sys

    path = tmp_path / "plans.json"
    a, b = W.JsonCache(path), W.JsonCache(path)
    a.put("a", 1)
    b.put("b", 2)
    code = "import sys; from znni_core.plan import wisdom as W; W.JsonCache(sys.argv[1]).put('c', 3)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    a.put("d", 4)
    assert W.JsonCache(path).data == {"a": 1, "b": 2, "c": 3, "d": 4}


def test_plan_cache_parses_an_unchanged_file_once(tmp_path, monkeypatch):
    """``infer`` looks its plan up at every call: the file is parsed again only when it changed
    (another writer replaced it), and what a put or another process wrote is always seen."""
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "plans.json"
    W.JsonCache(path).put("a", 1)
    parses, loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda text: parses.append(1) or loads(text))
    assert [W.JsonCache(path).get("a") for _ in range(3)] == [1, 1, 1] and len(parses) <= 1
    before = len(parses)
    code = "import sys; from znni_core.plan import wisdom as W; W.JsonCache(sys.argv[1]).put('b', 2)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    assert W.JsonCache(path).data == {"a": 1, "b": 2} and len(parses) == before + 1
    W.JsonCache(path).put("c", 3)  # this process's own write (put reads the file afresh)
    assert W.JsonCache(path).data == {"a": 1, "b": 2, "c": 3}
    # a file rewritten in place with the same size and mtime is the one case the memo cannot see;
    # writers never do that (they replace the file), and a corrupt file is still only a cache
    path.write_text("{not json")
    os.utime(path, ns=(0, 0))
    assert W.JsonCache(path).data == {}


def test_one_by_one_convs_never_get_the_numba_loop_unless_forced():
    """A 1x1x1 conv is one GEMM in direct-gemm; direct-numba only when the caller forces it."""
    net = make_net([("conv", 6, (1, 3, 3)), ("act", "relu"), ("conv", 8, 1), ("act", "relu"), ("conv", 2, 1)], seed=2)
    for budget in (2**30, 2**24):
        plan = autotune(net, memory_budget=budget, input_shape=(4, 40, 40), use_cache=False)
        one = [s.primitive for s in plan.steps if s.op == "conv" and s.index > 0]
        assert "direct-numba" not in one, one
    forced = autotune(net, memory_budget=2**30, input_shape=(4, 40, 40), primitives=("direct-numba",), use_cache=False)
    assert {s.primitive for s in forced.steps if s.op == "conv"} == {"direct-numba"}


def test_a_net_flat_in_z_walks_the_inputs_whole_planes_in_equal_depths():
    """z costs a net flat in z no halo: beside the growing cubes, the search walks the input's
    whole planes at its depth cut in 2, 3, 4 ... equal parts (a 30-deep input of the boundary net
    ran as three 10-deep MPF patches in 7.6 s; as one, in slab + depth-first pooling, 14 s).  A net with depth
    in z gets no such series, and the plan for a deep input is at least as fast by the model as
    the whole input in one patch."""
    from znni_core.plan import chain as S

    flat = make_net([("conv", 8, (1, 5, 5)), ("act", "relu"), ("pool", (1, 2, 2)), ("conv", 1, (1, 3, 3))], seed=3)
    deep = make_net([("conv", 8, (3, 5, 5)), ("act", "relu"), ("pool", (1, 2, 2)), ("conv", 1, (1, 3, 3))], seed=3)
    shape = (30, 120, 120)
    cap = S.input_patch(flat, shape)
    got = {p for series in S.patch_candidates(flat, S.MAX_PATCH_VOXELS, shape) for p in series}
    assert {(15,) + cap[1:], (10,) + cap[1:], (8,) + cap[1:], cap} <= got
    n_flat = sum(map(len, S.patch_candidates(flat, S.MAX_PATCH_VOXELS, shape)))
    n_deep = sum(map(len, S.patch_candidates(deep, S.MAX_PATCH_VOXELS, shape)))
    assert n_flat >= n_deep + 3  # the planes series (the cube series are alike)
    plan = autotune(flat, memory_budget=2**30, input_shape=shape, use_cache=False)
    whole = autotune(flat, memory_budget=2**30, patch_shape=cap, use_cache=False)
    assert S.rate(flat, plan.patch_shape, plan.predicted_seconds, shape) >= S.rate(
        flat, cap, whole.predicted_seconds, shape
    )


def test_a_net_flat_in_z_plans_thin_slabs_when_the_input_does_not_fit_one_patch(monkeypatch):
    """2D kernels and pools: z costs no halo, so on an input too large for one patch the search
    also walks slabs SLAB_SLICES deep (wider in y, x) and picks one when it is faster; an input
    that fits one patch walks no slab at all (counted in patches evaluated)."""
    from znni_core.plan import candidates as C
    from znni_core.plan import chain as S

    net = make_net(
        [
            ("conv", 16, (1, 5, 5)),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 16, (1, 5, 5)),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 1, (1, 3, 3)),
        ],
        seed=3,
    )
    calls = []
    orig = S.patch_candidates
    monkeypatch.setattr(S, "patch_candidates", lambda *a, **k: calls.append(k.get("slabs", False)) or orig(*a, **k))
    budget = 256 << 20
    big = autotune(net, memory_budget=budget, input_shape=(40, 1000, 1000), use_cache=False)
    assert calls == [False, True], calls
    assert big.predicted_peak_bytes <= budget
    slabs = S.patch_candidates(net, S.MAX_PATCH_VOXELS, (40, 1000, 1000), slabs=True)
    assert slabs and all(p[0] == C.SLAB_SLICES for series in slabs for p in series)
    assert max(p[1] for series in slabs for p in series) >= 1000  # as wide as the input
    calls.clear()
    small = autotune(net, memory_budget=budget, input_shape=(40, 100, 100), use_cache=False)
    assert small.patch_shape == S.input_patch(net, (40, 100, 100)) and calls == [False]
    # the slab is chosen for its rate over the input: without slabs the plan is slower
    monkeypatch.setattr(S, "patch_candidates", lambda *a, **k: [] if k.get("slabs") else orig(*a, **k))
    deep = autotune(net, memory_budget=budget, input_shape=(40, 1000, 1000), use_cache=False)
    assert deep.patch_shape[0] > C.SLAB_SLICES
    shape = (40, 1000, 1000)
    rate, rate_deep = (S.rate(net, p.patch_shape, p.predicted_seconds, shape) for p in (big, deep))
    # chosen only when faster (the calibration of the machine decides; on this one it is)
    assert rate > rate_deep if big.patch_shape[0] == C.SLAB_SLICES else big.patch_shape == deep.patch_shape


def _fixed_model(scale: dict | None = None):
    """The cost model of a stored calibration (``tests/data``), some primitives' rates scaled."""
    import copy
    import json
    from pathlib import Path

    from znni_core.plan.calibration import CpuCalibration
    from znni_core.plan.costs import CpuCostModel

    cal = json.loads((Path(__file__).parent / "data" / "calibration-zen4-2threads.json").read_text())["calibration"]
    cal = copy.deepcopy(cal)
    for key, factor in (scale or {}).items():  # "fft.winograd" -> every per-unit time in cal["fft"]["winograd"]
        part = cal
        for k in key.split("."):
            part = part[k]
        for k, v in part.items():
            if k.startswith("s_per") or k == "build_s_per_value":
                part[k] = v * factor
            elif k == "mac_points":
                part[k] = [[a, b * factor] for a, b in v]
    return CpuCostModel(CpuCalibration.from_dict(cal, "tests/data"))


def test_a_given_cost_model_plans_without_the_host(monkeypatch):
    """With a cost model given, the planner never calibrates this host, and its choices follow the
    model's rates: Winograd made 100x cheaper takes every layer it supports, made 100x dearer
    none; the same model gives the same plan twice."""
    from znni_core.errors import PlanError
    from znni_core.plan import timing

    def no_host(*a, **kw):
        raise AssertionError("the host's calibration was used")

    monkeypatch.setattr(timing, "calibrate", no_host)
    net = make_net([("conv", 8, (1, 3, 3)), ("act", "relu"), ("conv", 8, (3, 3, 3)), ("act", "relu"), ("conv", 2, 1)])
    shape = (12, 40, 40)

    def convs(model):
        plan = autotune(net, memory_budget=2**30, input_shape=shape, threads=2, cost_model=model)
        return [s.primitive for s in plan.steps if s.op == "conv"], plan

    cheap, plan = convs(_fixed_model({"fft.winograd": 0.01}))
    # 1 -> 8 maps (one input channel) and the 1x1x1 conv are not Winograd's; 8 -> 8 maps 3^3 is,
    # and it is now by far the cheapest
    assert cheap[1] == "winograd" and cheap[0] != "winograd" and cheap[2] != "winograd", cheap
    dear, _ = convs(_fixed_model({"fft.winograd": 100.0}))
    assert "winograd" not in dear, dear
    again, plan2 = convs(_fixed_model({"fft.winograd": 0.01}))
    assert again == cheap and plan2.steps == plan.steps and plan2.patch_shape == plan.patch_shape
    with pytest.raises(PlanError, match="estimate"):
        autotune(net, memory_budget=2**30, input_shape=shape, effort="measure", cost_model=_fixed_model())


def test_the_other_host_profiles_rescale_what_they_name():
    """``ZNNI_TEST_HOST`` (``make test-hosts``) plans the tests under another host's rates: each
    profile moves the rates and the Winograd times it names, and keeps the calibration's form."""
    import json
    from pathlib import Path

    from znni_core.plan.calibration import CpuCalibration

    from .other_host import PROFILES, rescaled

    doc = json.loads((Path(__file__).parent / "data" / "calibration-zen4-2threads.json").read_text())
    cal = CpuCalibration.from_dict(doc["calibration"], "tests/data")
    for name, profile in PROFILES.items():
        other = rescaled(cal, profile)
        assert other.gemm_flops == pytest.approx(cal.gemm_flops * profile["gemm"]), name
        assert other.mem_bw == pytest.approx(cal.mem_bw * profile["mem_bw"]), name
        w, w0 = other.fft["winograd"], cal.fft["winograd"]
        assert w["s_per_value"] == pytest.approx(w0["s_per_value"] * profile["winograd_time"]), name
        assert w["mac_points"][0][1] == pytest.approx(w0["mac_points"][0][1] / profile["winograd_time"]), name
        assert type(other) is CpuCalibration and other.tuned == cal.tuned
