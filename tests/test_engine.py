"""The engine end to end: every plan choice gives the dense sliding-window output.

References: the definition applied window by window (``tests/reference.py``) and
PyTorch's dilated dense formulation.  Tolerance: max relative error <= 1e-4 (float32).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

import znni_core
from znni_core.errors import InputError, MemoryBudgetError, PlanError
from znni_core.net import Network
from znni_core.net.chain import Conv
from znni_core.plan import Plan, autotune

from .nets import NETS, make_net
from .reference import max_rel_err, naive_dense, torch_dense

TOL = 1e-4


def _input(net, extra, seed=1, c=None):
    rng = np.random.default_rng(seed)
    shape = tuple(f + e for f, e in zip(net.field_of_view, extra))
    return rng.standard_normal((c or net.in_channels,) + shape).astype(np.float32)


@pytest.mark.parametrize("name", sorted(NETS))
def test_default_infer_matches_torch_and_naive(name):
    net = make_net(NETS[name], c_in=2 if name == "aniso" else 1)
    x = _input(net, (5, 7, 6))
    out = znni_core.infer(net, x)
    ref = torch_dense(net, x)
    assert (
        out.shape == ref.shape == (net.out_channels,) + tuple(n - f + 1 for n, f in zip(x.shape[1:], net.field_of_view))
    )
    assert max_rel_err(out, ref) <= TOL
    rng = np.random.default_rng(3)
    pos = [tuple(int(rng.integers(0, s)) for s in out.shape[1:]) for _ in range(12)]
    for p, v in naive_dense(net, x, pos).items():
        assert max_rel_err(out[(slice(None),) + p], v) <= TOL, p


@pytest.mark.parametrize("prim", ["direct-gemm", "direct-numba", "fft-data", "fft-task", "fft-stream", "fft-gemm"])
@pytest.mark.parametrize("name", ["iso2pool", "aniso"])
def test_every_primitive_and_pool_mode(name, prim):
    net = make_net(NETS[name], c_in=2 if name == "aniso" else 1, seed=5)
    x = _input(net, (3, 9, 4), seed=2)
    ref = torch_dense(net, x)
    combos = list(itertools.product(("mpf", "pool"), repeat=len(net.pools)))
    combos += [("slab:1",) + c[1:] for c in combos[:2]] + [("slab:5",) + combos[-1][1:]]
    for modes in combos:
        plan = autotune(net, memory_budget=2**30, primitives=(prim,), pool_modes=modes)
        assert all(s.primitive == prim for s in plan.steps if s.op == "conv")
        assert plan.pool_modes == modes
        assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL, modes


def test_micro_batches_and_small_patches_are_exact():
    net = make_net(NETS["deep"], seed=7)
    x = _input(net, (13, 6, 17))
    ref = torch_dense(net, x)
    # smallest legal patch: many tiles, last ones shifted back
    d, f = net.pooling_product, net.field_of_view
    plan = autotune(net, memory_budget=2**30, patch_shape=tuple(a + b - 1 for a, b in zip(d, f)))
    assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL
    # force micro-batching by editing a plan's steps (the executor must honour them)
    plan = autotune(net, memory_budget=2**30, pool_modes=("mpf",) * 3, primitives=("fft-data",))
    steps = tuple(s.__class__(**{**s.__dict__, "micro_batch": 3 if s.op == "conv" else 0}) for s in plan.steps)
    mb_plan = Plan.from_dict({**plan.to_dict(), "steps": [s.__dict__ for s in steps]})
    assert max_rel_err(znni_core.infer(net, x, plan=mb_plan), ref) <= TOL


def test_small_budget_stays_exact_and_fits():
    net = make_net(NETS["iso2pool"], seed=11)
    x = _input(net, (20, 20, 20))
    ref = torch_dense(net, x)
    for budget in (2**20, 4 * 2**20, 64 * 2**20):
        plan = autotune(net, memory_budget=budget)
        assert plan.predicted_peak_bytes <= budget
        assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL


def test_budget_too_small_is_a_clear_error():
    net = make_net(NETS["iso2pool"])
    with pytest.raises(MemoryBudgetError, match="budget"):
        autotune(net, memory_budget=1000)


def test_plan_json_round_trip_and_describe():
    net = make_net(NETS["aniso"], c_in=2)
    plan = autotune(net, memory_budget=2**28)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()
    text = plan.describe()
    assert "primitive" in text and str(plan.patch_shape) in text
    assert plan.rejected, "the search keeps what it threw away"


def test_field_of_view_formula():
    net = make_net(NETS["aniso"], c_in=2)
    # conv(1,3,3) pool(1,2,2) conv(2,3,2)@d(1,2,2) pool(1,3,2)@d(1,2,2) conv(1,2,2)@d(1,6,4)
    assert net.field_of_view == (1 + 0 + 0 + 1 + 0 + 0, 1 + 2 + 1 + 4 + 4 + 6, 1 + 2 + 1 + 2 + 2 + 4)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda x: x.astype(np.uint8), "dtype"),
        (lambda x: x[:, :3], "field of view"),
        (lambda x: np.concatenate([x, x]), "channel"),
        (lambda x: np.where(x > 2, np.nan, x).astype(np.float32), "NaN"),
    ],
)
def test_bad_input_is_a_clear_error(bad, match):
    net = make_net(NETS["iso2pool"])
    x = _input(net, (2, 2, 2))
    with pytest.raises(InputError, match=match):
        znni_core.infer(net, bad(x))


@pytest.mark.parametrize(
    "value,dtype", [(np.inf, np.float32), (-np.inf, np.float32), (np.nan, np.float32), (1e39, np.float64)]
)
def test_non_finite_input_names_its_first_z_slice(value, dtype):
    """Every non-finite value is refused, a float64 one beyond float32's range too (it would
    become inf), and the error names the first z-slice holding one."""
    net = make_net(NETS["iso2pool"])
    x = _input(net, (2, 2, 2)).astype(dtype)
    x[0, 3, 1, 2] = value
    x[0, 5, 0, 0] = value
    with pytest.raises(InputError, match="NaN/Inf value.*first in z-slice 3"):
        znni_core.infer(net, x)


def test_plan_for_another_network_is_refused():
    a, b = make_net(NETS["nopool"], seed=1), make_net(NETS["nopool"], seed=2)
    plan = autotune(a, memory_budget=2**26)
    with pytest.raises(PlanError, match="another network"):
        znni_core.infer(b, _input(b, (1, 1, 1)), plan=plan)


def test_fft_kernel_spectra_built_once_per_run(monkeypatch):
    """Resident FFT layers are built once and reused by every pooling offset, slab and tile;
    ``fft-stream`` layers keep nothing and are rebuilt per call (cheap: no kernel cache)."""
    from znni_core import layers

    net = make_net(NETS["iso2pool"], seed=13)
    x = _input(net, (9, 7, 8), seed=3)
    ref = torch_dense(net, x)
    built = []
    real = layers.FFTConv

    def counting(*a, **kw):
        built.append(kw.get("mode"))
        return real(*a, **kw)

    monkeypatch.setattr(layers, "FFTConv", counting)  # the primitives build through the layers package
    d, f = net.pooling_product, net.field_of_view
    patch = tuple(a + b - 1 for a, b in zip(d, f))  # smallest patch: many tiles
    n_conv = sum(1 for l in net.layers if isinstance(l, Conv))
    for modes in (("pool", "pool"), ("slab:1", "pool")):
        plan = autotune(net, memory_budget=2**30, primitives=("fft-task",), pool_modes=modes, patch_shape=patch)
        built.clear()  # the run's builds only (planning may calibrate, which builds its own)
        assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL
        assert built == ["task"] * n_conv, modes
    # a cache dict kept across calls (the pipeline's Dask blocks): built once for all of them
    built.clear()
    cache = {}
    for _ in range(2):
        assert max_rel_err(znni_core.infer(net, x, plan=plan, cache=cache), ref) <= TOL
    assert built == ["task"] * n_conv
    small = x[:, : patch[0], : patch[1], : patch[2]]  # one smaller tile: rebuilt, replacing (never adding)
    znni_core.infer(net, small[:, :-1] if small.shape[1] > f[0] else small, plan=plan, cache=cache)
    assert len([k for k in cache["executor"].state if k != "arena"]) == n_conv and len(cache) == 1
    built.clear()
    plan = autotune(
        net, memory_budget=2**30, primitives=("fft-stream",), pool_modes=("pool", "pool"), patch_shape=patch
    )
    assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL
    assert len(built) > n_conv and set(built) == {"stream"}


@pytest.mark.parametrize("prim", ["fft-task", "fft-stream", "fft-gemm", "direct-gemm"])
def test_conv_in_blocks_is_exact(prim):
    """Overlap-save blocks (``Step.tile``): each conv run on input blocks whose outputs tile
    its output, the last block shifted back; any block shape gives the same result."""
    net = make_net(NETS["aniso"], c_in=2, seed=17)
    x = _input(net, (7, 11, 5), seed=4)
    ref = torch_dense(net, x)
    plan = autotune(net, memory_budget=2**30, primitives=(prim,), pool_modes=("mpf",) * len(net.pools))
    for shrink in ((1, 1, 1), (3, 2, 4)):
        steps = []
        for s in plan.steps:
            if s.op == "conv":
                k = net.layers[s.index].kernel
                # an input block with an output of at least 1 and smaller than the whole where possible
                t = tuple(max(kk, n - d) for n, kk, d in zip(s.in_shape[2:], k, shrink))
                s = s.__class__(**{**s.__dict__, "tile": t})
            steps.append(s)
        tiled = Plan.from_dict({**plan.to_dict(), "steps": [s.__dict__ for s in steps]})
        assert any(s.tile and s.tile != s.in_shape[2:] for s in tiled.steps)
        assert max_rel_err(znni_core.infer(net, x, plan=tiled), ref) <= TOL, shrink


def test_blocked_conv_memory_matches_model():
    import tracemalloc

    from znni_core.exec import steps
    from znni_core.plan import memory as M
    from znni_core.plan.plan import Step

    rng = np.random.default_rng(0)
    layer = Conv(rng.standard_normal((8, 6, 5, 5, 5), dtype=np.float32), np.zeros(8, np.float32))
    x = rng.standard_normal((3, 6, 70, 66, 61), dtype=np.float32)
    for prim, tile, mb in (
        ("fft-task", (32, 32, 32), 0),
        ("fft-stream", (48, 32, 61), 2),
        ("fft-data", (), 1),
        ("fft-gemm", (48, 48, 48), 0),
        ("fft-gemm", (), 2),
    ):
        step = Step(0, "conv", prim, x.shape, (), mb, 2, tile=tile)
        steps.run_conv(step, layer, x, np, {})  # warm-up: numba compilation, FFTW plans
        tracemalloc.start()
        convs = {}
        y = steps.run_conv(step, layer, x, np, convs)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        shape = M.conv_blocks(x.shape[2:], layer.kernel, tile)[0]
        pred = M.conv_step_bytes(prim, 3, mb, layer, x.shape[2:], tile, 2) + M.resident_bytes(prim, layer, shape)
        assert abs(peak - pred) <= 0.2 * pred, (prim, tile, peak / 2**20, pred / 2**20)
        del y, convs


def test_monotone_activations_move_after_pooling():
    from znni_core.net.chain import Activation, Pool
    from znni_core.plan.plan import Step
    from znni_core.plan.program import program

    w = np.ones((1, 1, 1, 1, 1), np.float32)
    for act, swapped in (
        (Activation("relu"), True),
        (Activation("elu", alpha=0.5), True),
        (Activation("leaky_relu", alpha=-0.2), False),
        (Activation("softmax"), False),
    ):
        for mode, moves in (("mpf", swapped), ("pool", swapped), ("max", False)):  # subsampling: in place
            net = Network((Conv(w), act, Pool((2, 2, 2)), Conv(w)))
            ops = ("conv", "act", "pool", "conv")
            prims = ("fft-data", act.kind, mode, "fft-data")  # fft-data applies no activation itself
            steps = tuple(Step(i, op, p, (), ()) for i, (op, p) in enumerate(zip(ops, prims)))
            prog = program(steps, net)
            got = [s.op for s in prog.steps]
            assert got == (["conv", "pool", "act", "conv"] if moves else list(ops)), (act.kind, mode)
            assert [n.op.label for n in prog.nodes] == got and [s.index for s in prog.steps] == (
                [0, 2, 1, 3] if moves else [0, 1, 2, 3]
            )
            # the tensors flow through the swapped nodes: pooled first, then the activation
            assert all(b.inputs == (a.output,) for a, b in zip(prog.nodes, prog.nodes[1:]))
    # exactness of the swap itself: max-pool of f(x) == f(max-pool of x) for a non-decreasing f
    from znni_core.layers import apply_activation, max_pool

    x = np.random.default_rng(3).standard_normal((1, 2, 6, 6, 6)).astype(np.float32)
    for kind, alpha in (("relu", 0.0), ("elu", 1.0), ("sigmoid", 0.0), ("tanh", 0.0), ("leaky_relu", 0.1)):
        a = max_pool(apply_activation(x.copy(), kind, alpha), (2, 2, 2))
        b = apply_activation(max_pool(x, (2, 2, 2)), kind, alpha)
        assert np.array_equal(a, b), kind


def test_activations_after_a_conv_run_in_the_conv_output_pass():
    """direct-gemm, direct-numba, fft-gemm and winograd apply a following ReLU, leaky ReLU or ELU
    in their own output pass (no separate pass); other primitives and other activations keep
    their step; the result is unchanged."""
    from znni_core.net.chain import Activation
    from znni_core.plan.plan import Step
    from znni_core.plan.program import program

    w = np.ones((1, 1, 1, 3, 3), np.float32)
    for prim, act, fused in (
        ("winograd", "relu", True),
        ("fft-gemm", "relu", True),
        ("direct-gemm", "relu", True),
        ("direct-numba", "relu", True),
        ("fft-data", "relu", False),
        ("winograd", "elu", True),
        ("direct-gemm", "leaky_relu", True),
        ("winograd", "sigmoid", False),
        ("winograd", "identity", False),
    ):
        net = Network((Conv(w), Activation(act, 0.3), Conv(w)))
        steps = (Step(0, "conv", prim, (), ()), Step(1, "act", act, (), ()), Step(2, "conv", prim, (), ()))
        prog = program(steps, net)
        assert prog.fused == ({1} if fused else set()) and prog.skip == prog.fused, (prim, act)
        first, last = prog.step(0), prog.step(2)
        assert getattr(first, "fused", "") == (act if fused else "") and getattr(last, "fused", "") == ""
        assert getattr(first, "alpha", 0.3 if fused else 0.0) == (0.3 if fused else 0.0)
    net = make_net(
        [
            ("conv", 5, (1, 3, 3)),
            ("act", "elu", 0.7),
            ("pool", (1, 2, 2)),
            ("conv", 4, (1, 4, 4)),
            ("act", "leaky_relu", 0.2),
            ("conv", 3, 1),
            ("act", "relu"),
            ("conv", 2, 3),
            ("act", "sigmoid"),
        ],
        seed=5,
    )
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1,) + tuple(f + e for f, e in zip(net.field_of_view, (4, 8, 6)))).astype(np.float32)
    ref = torch_dense(net, x)
    import znni_core.exec.patch as E

    calls = []
    real = E.apply_activation
    try:
        E.apply_activation = lambda x, kind, *a, **k: calls.append(kind) or real(x, kind, *a, **k)
        for prims in (("winograd",), ("fft-gemm",), ("direct-gemm",), ("direct-numba",)):
            calls.clear()
            # MPF: one pass of the rest (depth-first pooling, which the timings may favour, runs
            # the sigmoid once per offset)
            plan = autotune(net, memory_budget=2**30, primitives=prims, pool_modes=("mpf",), use_cache=False)
            assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= 1e-4, prims
            assert calls == ["sigmoid"], (prims, calls)  # every other activation ran inside a conv
    finally:
        E.apply_activation = real


@pytest.mark.parametrize("act", [("relu", 0.0), ("leaky_relu", 0.1), ("elu", 0.8)])
@pytest.mark.parametrize("kernel", [(1, 1, 1), (1, 3, 3), (3, 3, 3), (1, 5, 5)])
def test_fused_activation_in_each_primitive_equals_the_reference(kernel, act):
    from znni_core.layers import (
        FFTGemmConv,
        WinogradConv,
        apply_activation,
        conv_direct_gemm,
        conv_direct_numba,
        winograd_supports,
    )

    from .test_layers_conv import reference, rel_err

    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 6, 7, 20, 19)).astype(np.float32)
    w = rng.standard_normal((5, 6) + kernel).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    plain = reference(x, w, b)
    ref = apply_activation(plain.astype(np.float64), *act).astype(np.float32)  # numpy's exp, float64
    assert (plain < 0).mean() > 0.2 and not np.allclose(ref, plain)  # the activation matters
    big = np.full((2, 5, 9, 30, 30), 7.0, np.float32)
    dst = big[:, :, 1 : 1 + 8 - kernel[0], 2 : 2 + 21 - kernel[1], 3 : 3 + 20 - kernel[2]]
    assert rel_err(conv_direct_gemm(x, w, b, act=act), ref) <= 1e-4
    assert rel_err(np.ascontiguousarray(conv_direct_gemm(x, w, b, act=act, out=dst)), ref) <= 1e-4
    assert rel_err(conv_direct_numba(x, w, b, act=act), ref) <= 1e-4
    classes = [FFTGemmConv] + ([WinogradConv] if winograd_supports(kernel) else [])
    for cls in classes:
        conv = cls(w, b, x.shape[2:], threads=2)
        conv.act = act
        assert rel_err(conv(x), ref) <= 1e-4, cls.__name__
        assert conv(x, out=dst) is dst and rel_err(np.ascontiguousarray(dst), ref) <= 1e-4, cls.__name__
        conv.act = None
        assert rel_err(conv(x), plain) <= 1e-4, cls.__name__  # the attribute, not the layer, applies it


def test_output_buffers_are_reused_within_the_budget(monkeypatch):
    """The arena: a second patch of a run reuses the first one's output buffers (no fresh
    pages), the result is unchanged, and the buffers it holds plus the run's live set stay
    within the plan's budget (tracemalloc counts both)."""
    import tracemalloc

    from znni_core.exec.executor import Executor
    from znni_core.exec.patch import run_patch
    from znni_core.plan import autotune

    net = make_net(
        [("conv", 8, 3), ("act", "relu"), ("pool", 2), ("conv", 12, 3), ("act", "relu"), ("conv", 2, 3)], seed=4
    )
    x = np.random.default_rng(4).standard_normal((1, 37, 37, 37)).astype(np.float32)
    plan = autotune(net, memory_budget=96 * 2**20, patch_shape=(37, 37, 37))
    monkeypatch.setenv("ZNNI_REUSE_BUFFERS", "0")
    ref = run_patch(plan, net, x)
    monkeypatch.delenv("ZNNI_REUSE_BUFFERS")
    run = Executor(plan, net)
    tracemalloc.start()
    tracemalloc.reset_peak()
    run.patch(x)  # the first patch: every buffer is new
    a = run.state["arena"]
    assert a.misses > 0 and a.held_bytes > 0
    misses = a.misses
    y = run.patch(x)
    _, peak = tracemalloc.get_traced_memory()  # both patches: live arrays + held buffers + spectra
    tracemalloc.stop()
    assert a.misses == misses and a.hits > 0  # the second patch: all from the arena
    np.testing.assert_array_equal(y, ref)
    del y
    assert a.held_bytes <= plan.memory_budget - plan.predicted_peak_bytes
    # a tight budget leaves no slack: nothing is held, and the result is still the same
    tight = autotune(net, memory_budget=plan.predicted_peak_bytes, patch_shape=(37, 37, 37))
    with Executor(tight, net) as run:
        for _ in range(2):
            np.testing.assert_array_equal(run.patch(x), ref)
        assert run.state["arena"].held_bytes <= max(0, tight.memory_budget - tight.predicted_peak_bytes)
    with pytest.raises(PlanError, match="closed"):
        run.patch(x)
    assert peak <= plan.memory_budget


def test_executor_turns_numpy_huge_pages_off_unless_asked(tmp_path):
    """Once the executor ran, numpy no longer madvises huge pages (synchronous compaction on the
    first touch of each 2 MiB page cost a process's first call 2 s of system time on this VM);
    ``ZNNI_HUGEPAGES=1`` keeps numpy's default.  Checked on numpy's own flag, in fresh processes."""
    import subprocess
    import sys

    code = (
        "import numpy as np, znni_core\n"
        "from tests.nets import make_net\n"
        "net = make_net([('conv', 2, 3), ('act', 'relu')])\n"
        "before = np._core.multiarray._set_madvise_hugepage(True)\n"
        "znni_core.infer(net, np.ones((1, 8, 8, 8), np.float32))\n"
        "print(before, np._core.multiarray._set_madvise_hugepage(True))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ZNNI_HUGEPAGES"}
    env["ZNNI_CACHE_DIR"] = str(tmp_path)
    root = Path(__file__).resolve().parents[1]
    for value, expected in ((None, "True False"), ("1", "True True")):
        if value is not None:
            env["ZNNI_HUGEPAGES"] = value
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
        ).stdout.split("\n")[-2]
        assert out == expected, (value, out)


def test_memory_beyond_the_arena_is_reused_from_the_heap_not_fresh_pages():
    """After the executor's retain_freed_memory (glibc), a large array freed and allocated again
    touches no fresh page: counted in minor page faults (a fresh 64 MiB: 16384 at 4 KiB pages),
    not seconds; release_cache hands the memory back."""
    import resource

    from znni_core.layers import arena

    if not arena.retain_freed_memory():
        pytest.skip("glibc's mallopt is not available here (or ZNNI_REUSE_BUFFERS=0)")
    hp = np._core.multiarray._set_madvise_hugepage(False)  # 4 KiB pages: one fault per page
    try:
        n = (64 << 20) // 4
        a = np.empty(n, np.float32)
        a.fill(1.0)
        del a
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b = np.empty(n, np.float32)
        b.fill(2.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del b
    finally:
        np._core.multiarray._set_madvise_hugepage(hp)
    assert faults < 1000, faults
    znni_core.release_cache()  # malloc_trim: no error, the kept memory goes back


def test_winograd_layers_pass_channels_last_through_mpf_and_activations(monkeypatch):
    """A Winograd conv whose output reaches the next Winograd conv or a 1x1x1 conv through
    activations and MPF only writes it channels last (``layers/layout``), and MPF keeps it so;
    every other conv output (one read by a depth-first pool, the network's) is channels first,
    and a depth-first pool copies its fragments channels last for the Winograd conv after it.
    The output equals PyTorch's dense result and the all-channels-first run's (to rounding:
    the 1x1x1 product reads its operand in the other order)."""
    import znni_core.exec.patch as E
    from znni_core.layers import WinogradConv
    from znni_core.layers.layout import is_channels_last

    net = make_net(
        [
            ("conv", 4, (1, 3, 3)),
            ("act", "relu"),
            ("pool", (1, 2, 2)),
            ("conv", 5, (1, 3, 3)),
            ("act", "elu", 1.0),
            ("pool", (1, 2, 2)),
            ("conv", 3, (2, 3, 3)),
            ("conv", 2, (1, 3, 3)),
            ("act", "relu"),
            ("conv", 2, 1),
        ],
        seed=19,
    )
    x = np.random.default_rng(19).standard_normal((1, 5, 45, 45)).astype(np.float32)  # F 26, D 4
    ref = torch_dense(net, x)
    seen = []
    real = WinogradConv._call_cpu

    def call(self, x, out, low):
        y = real(self, x, out, low)
        seen.append((self.c_out, is_channels_last(x), is_channels_last(y)))
        return y

    monkeypatch.setattr(WinogradConv, "_call_cpu", call)
    # the first conv (one input channel) runs direct-gemm: three Winograd convs
    for pools, outs, ins in (
        (("mpf", "mpf"), [True, True, True], [True, True]),
        (("mpf", "pool"), [False, True, True], [True, True]),
    ):
        plan = autotune(
            net,
            memory_budget=2**30,
            patch_shape=x.shape[1:],
            primitives=("winograd",),
            pool_modes=pools,
            use_cache=False,
        )
        assert [s.primitive for s in plan.steps if s.op == "pool"] == list(pools)
        seen.clear()
        y = znni_core.infer(net, x, plan=plan)
        assert max_rel_err(y, ref) < 1e-4
        assert [o for _, _, o in seen[:3]] == outs, seen  # the first offset's convs
        assert [i for _, i, _ in seen[1:3]] == ins, seen  # read as written, or as the pool copied it
        monkeypatch.setattr(E, "channels_last_tensors", lambda prog: set())
        np.testing.assert_allclose(znni_core.infer(net, x, plan=plan), y, rtol=1e-6, atol=1e-6)
        monkeypatch.undo()
        monkeypatch.setattr(WinogradConv, "_call_cpu", call)


def test_profiled_charges_each_step_its_own_seconds():
    """``profiled()`` (the benchmarks' per-step times): every step the run takes has an entry,
    depth-first pooling is charged its own work only (its offsets' steps apart: never a negative
    remainder), and profiling changes nothing in the output."""
    from znni_core.exec.patch import profiled
    from znni_core.plan.program import program

    net = make_net(NETS["iso2pool"], seed=3)
    x = np.random.default_rng(0).standard_normal((1, 37, 37, 37)).astype(np.float32)
    for modes in (("mpf", "mpf"), ("pool", "mpf"), ("pool", "pool")):
        plan = autotune(
            net,
            memory_budget=2**28,
            patch_shape=x.shape[1:],
            pool_modes=modes,
            use_cache=False,
            primitives=("direct-gemm",),
        )
        ref = znni_core.infer(net, x, plan=plan)
        with profiled() as seconds:
            out = znni_core.infer(net, x, plan=plan)
        np.testing.assert_array_equal(out, ref)
        prog = program(plan.steps, net)
        run = {s.index for i, s in enumerate(prog.steps) if i not in prog.skip}
        assert set(seconds) == run, (modes, seconds)
        assert all(v >= 0 for v in seconds.values())
    with profiled():
        with pytest.raises(RuntimeError, match="nest"):
            with profiled():
                pass


def test_the_definition_equals_torch():
    """``plain_forward`` (the network on its field of view, strided pooling, numpy float64: what
    ``znni verify`` and the tests' naive reference compute) equals PyTorch's dense output at
    random windows, for every activation kind."""
    from znni_core.net.definition import plain_forward

    rng = np.random.default_rng(7)
    for act in (("relu",), ("leaky_relu", 0.2), ("elu", 0.7), ("sigmoid",), ("tanh",), ("softmax",), ("identity",)):
        layout = [("conv", 3, (2, 3, 3)), ("act",) + act, ("pool", (1, 2, 2)), ("conv", 2, 2), ("act",) + act]
        net = make_net(layout, seed=3)
        fov = net.field_of_view
        x = rng.standard_normal((1,) + tuple(f + 3 for f in fov)).astype(np.float32)
        dense = torch_dense(net, x)  # (C_out, 4, 4, 4)
        pos = [(0, 0, 0), (3, 2, 1), (1, 3, 3)]
        wins = np.stack([x[:, p[0] : p[0] + fov[0], p[1] : p[1] + fov[1], p[2] : p[2] + fov[2]] for p in pos])
        got = plain_forward(net, wins)
        want = np.stack([dense[(slice(None),) + p] for p in pos])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(act))


def test_an_executor_is_kept_per_plan_and_closed_when_replaced():
    """``executor_for`` gives the same executor for the same plan (built once: its kernels stay),
    and for another plan a new one, closing the one it replaces; a closed executor refuses to
    run, naming the fix."""
    from znni_core.inference import executor_for

    net = make_net([("conv", 4, 3), ("act", "relu"), ("conv", 2, 3)], seed=2)
    x = _input(net, (6, 5, 4), seed=2)
    a = autotune(net, memory_budget=2**30, primitives=("direct-numba",), patch_shape=(9, 9, 9))
    b = autotune(net, memory_budget=2**30, primitives=("direct-gemm",), patch_shape=(9, 9, 9))
    holder = {}
    first = executor_for(holder, a, net)
    assert executor_for(holder, a, net) is first and first.runs(a, np) and not first.runs(b, np)
    ya = first.volume(x)
    second = executor_for(holder, b, net)
    assert second is not first and holder["executor"] is second
    with pytest.raises(PlanError, match="closed"):
        first.volume(x)
    np.testing.assert_allclose(second.volume(x), ya, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ya, torch_dense(net, x), rtol=1e-4, atol=1e-5)
