"""Graph networks (U-Nets) against PyTorch: valid nets exact on the whole input whatever the
tiling, padded nets exact on one patch and blended as documented on more."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import znni_core
from znni_core.errors import InputError, MemoryBudgetError, NetworkError, UnsupportedOperatorError
from znni_core.exec.blend import axis_plan, lattice, weights
from znni_core.exec.patch import run_patch
from znni_core.net.graph import Graph
from znni_core.plan import autotune

torch = pytest.importorskip("torch")
nn = torch.nn
from .real_data import DETECTOR, DETECTOR_FILES, DETECTOR_REFERENCE  # noqa: E402
from .unets import HalfCrop, UNet, admissible, export, randomise_bn, run  # noqa: E402


def _tiling_budget(net, shape) -> int:
    """A budget under which the whole input does not fit in one patch but some patch does."""
    whole = autotune(net, memory_budget=2**34, patch_shape=shape, use_cache=False).predicted_peak_bytes
    small = tuple(n + g * (1 if n == m else 0) for n, m, g in zip(net.geometry.n_min, net.geometry.n_min, net.grid))
    least = autotune(net, memory_budget=2**34, patch_shape=small, use_cache=False).predicted_peak_bytes
    return max(int(least * 1.05), whole // 2)


def _shape(model, lows):
    return tuple(admissible(model, a, lo) for a, lo in enumerate(lows))


unet_args = st.fixed_dictionaries(
    {
        "depth": st.integers(1, 2),
        "kernel": st.sampled_from([(3, 3, 3), (1, 3, 3)]),
        "pool": st.sampled_from([(1, 2, 2), (2, 2, 2)]),
        "width": st.sampled_from([2, 3]),
        "up": st.sampled_from(["nearest", "transpose"]),
        "bn": st.booleans(),
        "merge": st.sampled_from(["concat", "add"]),
        "down": st.sampled_from(["maxpool", "conv"]),
    }
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=unet_args, seed=st.integers(0, 2**16), grow=st.tuples(*[st.integers(0, 2)] * 3))
def test_valid_unet_equals_torch_on_the_whole_input_under_any_budget(tmp_path, args, seed, grow):
    torch.manual_seed(seed)
    model = randomise_bn(UNet(valid=True, **args), seed)
    exported = _shape(model, (1, 1, 1))
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", exported))
    assert isinstance(net, Graph) and net.kind == "valid"
    assert net.geometry.n_min == exported  # the graph's geometry agrees with the architecture
    # a larger admissible input than the export shape: crops are read relative to the shape
    g = net.grid
    shape = tuple(n + k * gg * 3 for n, k, gg in zip(exported, grow, g))
    shape = (shape[0] + 4 * g[0] if shape[0] < 4 else shape[0],) + shape[1:]
    x = np.random.default_rng(seed).standard_normal((1,) + shape).astype(np.float32)
    ref = run(model, x)
    for budget in (None, _tiling_budget(net, shape)):
        out = znni_core.infer(net, x, memory_budget=budget)
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_valid_unet_tiles_at_grid_offsets_equal_whole(tmp_path):
    torch.manual_seed(1)
    model = UNet(valid=True, depth=2, kernel=(1, 3, 3), pool=(1, 2, 2), width=3)
    shape = _shape(model, (5, 60, 60))
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", _shape(model, (1, 1, 1))))
    x = np.random.default_rng(0).standard_normal((1,) + shape).astype(np.float32)
    whole = run(model, x)
    plan = autotune(net, memory_budget=64 * 2**20, patch_shape=_shape(model, (3, 40, 44)))
    tiled = znni_core.infer(net, x, plan=plan)
    assert math.prod(plan.patch_shape) < math.prod(shape)  # several tiles
    np.testing.assert_allclose(tiled, whole, rtol=1e-4, atol=1e-5)


def test_valid_graph_inadmissible_input_drops_trailing_voxels_with_a_warning(tmp_path):
    model = UNet(valid=True, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=2)
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", _shape(model, (1, 1, 1))))
    shape = _shape(model, (2, 30, 30))
    x = np.random.default_rng(0).standard_normal((1, shape[0], shape[1] + 1, shape[2])).astype(np.float32)
    with pytest.warns(UserWarning, match="not admissible"):
        out = znni_core.infer(net, x)
    np.testing.assert_allclose(out, run(model, x[:, :, : shape[1]]), rtol=1e-4, atol=1e-5)
    with pytest.raises(InputError, match="smallest admissible"):
        znni_core.infer(net, x[:, :, : net.field_of_view[1], : net.field_of_view[2]])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=unet_args.map(lambda a: {**a, "up": "linear" if a["up"] == "nearest" and a["bn"] else a["up"]}),
    seed=st.integers(0, 2**16),
)
def test_padded_unet_one_patch_equals_torch(tmp_path, args, seed):
    torch.manual_seed(seed)
    model = randomise_bn(UNet(valid=False, **args), seed)
    shape = _shape(model, (4, 20, 20))
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", shape))
    assert isinstance(net, Graph) and net.kind == "padded" and net.field_of_view == (1, 1, 1)
    x = np.random.default_rng(seed).standard_normal((1,) + shape).astype(np.float32)
    out = znni_core.infer(net, x)
    np.testing.assert_allclose(out, run(model, x), rtol=1e-4, atol=1e-5)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    args=unet_args.map(lambda a: {**a, "up": "linear" if a["merge"] == "add" and a["up"] == "nearest" else a["up"]}),
    seed=st.integers(0, 2**16),
)
@example(
    args={
        "depth": 2,
        "kernel": (3, 3, 3),
        "pool": (1, 2, 2),
        "width": 3,
        "up": "linear",
        "bn": False,
        "merge": "add",
        "down": "maxpool",
    },
    seed=0,
)  # tiles save < 40% here (found in CI)
def test_padded_unet_under_a_small_budget_still_equals_torch_on_the_whole_input(tmp_path, args, seed):
    """The budget never changes a padded network's result: a patch that does not fit runs in
    exact output tiles (halos recomputed, zero padding only at the patch border)."""
    torch.manual_seed(seed)
    model = randomise_bn(UNet(valid=False, **args), seed)
    shape = _shape(model, (8, 96, 88))  # several receptive fields across: tiles save memory
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", _shape(model, (2, 8, 8))))
    x = np.random.default_rng(seed).standard_normal((1,) + shape).astype(np.float32)
    # one primitive: a smaller budget is met by tiling, not by a thriftier primitive
    prims = ("direct-gemm",)
    whole = autotune(net, memory_budget=2**34, input_shape=shape, use_cache=False, primitives=prims)
    assert not whole.tile
    # how much tiles save depends on the receptive field: the tightest of these budgets that fits
    # (a net whose tiles save nothing under 90% of the whole patch fails)
    small = None
    for frac in (0.6, 0.75, 0.9):
        budget = int(whole.predicted_peak_bytes * frac)
        try:
            small = autotune(net, memory_budget=budget, input_shape=shape, use_cache=False, primitives=prims)
            break
        except MemoryBudgetError:
            continue
    assert small is not None, "no tiling fits 90% of the whole patch's memory"
    assert small.tile and small.patch_shape == whole.patch_shape == shape
    assert small.predicted_peak_bytes <= budget
    np.testing.assert_allclose(znni_core.infer(net, x, plan=small), run(model, x), rtol=1e-4, atol=1e-5)


def _blend_reference(model, x, patch, overlap, kind):
    """Independent blending: PyTorch on every lattice patch, weights from the documented formula."""
    n = x.shape[1:]
    acc = np.zeros((2,) + n)
    norm = np.zeros(n)
    starts = [list(range(0, m - p, p - o)) + [m - p] if p < m else [0] for m, p, o in zip(n, patch, overlap)]
    ws = []
    for m, p, st_ in zip(n, patch, starts):
        u = (np.arange(p) + 0.5) / p
        w = np.exp(-1 / (u * (1 - u)))
        w = np.maximum(w / w.max(), 1e-4) if len(st_) > 1 else np.ones(p)
        ws.append(w)
    w3 = ws[0][:, None, None] * ws[1][None, :, None] * ws[2][None, None, :]
    for z in starts[0]:
        for y in starts[1]:
            for xx in starts[2]:
                sl = (slice(z, z + patch[0]), slice(y, y + patch[1]), slice(xx, xx + patch[2]))
                acc[(slice(None),) + sl] += run(model, x[(slice(None),) + sl]) * w3
                norm[sl] += w3
    return acc / norm


class _UpThenPointwise(nn.Module):
    """Pooling, nearest (or trilinear) upsampling, then a 1x1x1 conv (``twice``: the upsampled
    tensor read by a second conv too)."""

    def __init__(self, twice=False, mode="nearest"):
        super().__init__()
        self.twice = twice
        self.a, self.b = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 3, 1)
        self.up = nn.Upsample(scale_factor=(1, 2, 2), mode=mode)
        self.c = nn.Conv3d(4, 3, 1)

    def forward(self, x):
        u = self.up(nn.functional.max_pool3d(torch.relu(self.a(x)), (1, 2, 2)))
        return self.b(u) + self.c(u) if self.twice else self.b(u)


@pytest.mark.parametrize("mode", ["nearest", "trilinear"])
def test_a_pointwise_conv_after_upsampling_runs_first_and_equals_torch(tmp_path, mode):
    """The loader swaps "upsample (nearest or linear), 1x1x1 conv" (4x fewer voxels for the conv
    here): the output equals PyTorch's, on one patch and on the whole volume blended; an upsampled
    tensor that two nodes read is left alone."""
    torch.manual_seed(0)
    model = _UpThenPointwise(mode=mode)
    net = znni_core.load_network(export(model, tmp_path / "u.onnx", (4, 12, 12)))
    ops = [(n.op.label, n.name) for n in net.nodes]
    assert [o for o, _ in ops] == ["conv", "act", "pool", "conv", "resize"], ops
    assert net.nodes[-1].output == net.output and net.nodes[3].op.conv.kernel == (1, 1, 1)
    x = np.random.default_rng(0).standard_normal((1, 4, 12, 12)).astype(np.float32)
    np.testing.assert_allclose(znni_core.infer(net, x), run(model, x), rtol=1e-5, atol=1e-6)
    big = np.random.default_rng(1).standard_normal((1, 6, 40, 40)).astype(np.float32)
    whole = znni_core.infer(
        znni_core.load_network(export(model, tmp_path / "w.onnx", (6, 40, 40))), big, memory_budget=2**30
    )
    np.testing.assert_allclose(whole, run(model, big), rtol=1e-5, atol=1e-6)
    kept = znni_core.load_network(export(_UpThenPointwise(twice=True, mode=mode), tmp_path / "t.onnx", (4, 12, 12)))
    assert [n.op.label for n in kept.nodes][:4] == ["conv", "act", "pool", "resize"]


def test_padded_unet_blends_overlapping_patches_as_documented(tmp_path):
    torch.manual_seed(3)
    model = UNet(valid=False, depth=2, kernel=(3, 3, 3), pool=(1, 2, 2), width=3, bn=True, up="transpose")
    model = randomise_bn(model, 3)
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", (4, 16, 16)))
    x = np.random.default_rng(2).standard_normal((1, 6, 40, 36)).astype(np.float32)
    plan = autotune(net, memory_budget=2**30, patch_shape=(4, 16, 16), overlap=(2, 4, 4), input_shape=x.shape[1:])
    assert plan.kind == "padded" and plan.overlap == (2, 4, 4) and plan.blend == "bump"
    out = znni_core.infer(net, x, plan=plan)
    ref = _blend_reference(model, x, (4, 16, 16), (2, 4, 4), "bump")
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    # away from patch borders the blend is the network itself, and every voxel is finite
    assert np.isfinite(out).all()


def test_padded_input_not_admissible_is_zero_padded_and_cropped(tmp_path):
    model = UNet(valid=False, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=2)
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", (2, 16, 16)))
    x = np.random.default_rng(0).standard_normal((1, 3, 15, 17)).astype(np.float32)
    out = znni_core.infer(net, x)
    xp = np.pad(x, [(0, 0), (0, 0), (0, 1), (0, 1)])
    np.testing.assert_allclose(out, run(model, xp)[:, :, :15, :17], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [(1, 2, 2), (2, 2, 2), (2, 1, 3)])
def test_nearest_upsampling_and_padding_equal_numpy(scale):
    """The CPU kernels (numba upsampling, arena padding in the input's layout) equal ``np.repeat`` and
    ``np.pad``."""
    from znni_core.layers import arena
    from znni_core.layers.layout import is_channels_last
    from znni_core.layers.resample import pad, upsample_nearest

    x = np.random.default_rng(1).standard_normal((2, 4, 8, 61, 67)).astype(np.float32)  # > arena.MIN_BYTES
    expect = x.repeat(scale[0], 2).repeat(scale[1], 3).repeat(scale[2], 4)
    with arena.using(arena.Arena(1 << 30)):
        assert np.array_equal(upsample_nearest(x, scale), expect)
        for low, high in (((1, 0, 2), (0, 3, 1)), ((0, 0, 0), (1, 1, 1))):
            expect = np.pad(x, [(0, 0), (0, 0)] + list(zip(low, high)), constant_values=-2.5)
            for _ in range(2):  # the second from a reused (dirty) buffer
                y = pad(x, low, high, -2.5)
                assert np.array_equal(y, expect)
                del y
            # a channels-last input padded channels last (its reader takes it so)
            x_cl = np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
            y = pad(x_cl, low, high, -2.5)
            assert is_channels_last(y) and np.array_equal(y, expect)
            del y


def test_blend_lattice_and_weights():
    assert lattice(20, 8, 2) == [0, 6, 12]
    assert lattice(8, 8, 2) == [0]
    assert lattice(21, 8, 2, grid=4) == [0, 4, 8, 12, 13]
    for kind in ("bump", "gaussian", "linear"):
        w = weights(16, kind)
        assert w.max() == pytest.approx(1) and w.min() >= 1e-4 and np.allclose(w, w[::-1])
    starts, w, norm = axis_plan(20, 8, 2, "bump")
    assert (norm > 0).all() and len(starts) == 3


def test_graph_memory_walk_tracks_the_executor(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = UNet(valid=True, depth=2, kernel=(3, 3, 3), pool=(1, 2, 2), width=6, bn=True)
    shape = _shape(model, (12, 70, 70))
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", shape))
    plan = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=("direct-gemm",))
    x = np.random.default_rng(0).standard_normal((1,) + shape).astype(np.float32)
    monkeypatch.setenv("ZNNI_REUSE_BUFFERS", "0")  # fresh buffers: the executor's own live set
    run_patch(plan, net, x)  # warm-up (lazy imports, BLAS buffers)
    tracemalloc.start()
    run_patch(plan, net, x)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak += x.nbytes  # the walk counts the caller's patch
    assert 0.75 <= plan.predicted_peak_bytes / peak <= 1.33, (plan.predicted_peak_bytes, peak)


@pytest.mark.parametrize("act", ["elu", "leaky", "relu"])
def test_activations_after_convs_run_in_the_conv_output_pass(tmp_path, monkeypatch, act):
    """Every activation that is a conv's only reader runs inside that conv (no pass of its own,
    none charged by the walk); the head's sigmoid keeps its own; the output still equals
    PyTorch's, whole and in exact tiles (``tests/test_engine.py`` covers the primitives that do
    not fuse)."""
    import znni_core.exec.patch as EG
    from znni_core.plan.program import fuses_next

    torch.manual_seed(3)
    model = randomise_bn(UNet(valid=True, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=4, bn=True, act=act), 3)
    shape = _shape(model, (3, 40, 40))
    net = znni_core.load_network(export(model, tmp_path / "a.onnx", shape))
    x = np.random.default_rng(1).standard_normal((1,) + shape).astype(np.float32)
    ref = run(model, x)
    calls = []
    real = EG.apply_activation
    monkeypatch.setattr(EG, "apply_activation", lambda x, kind, *a, **k: calls.append(kind) or real(x, kind, *a, **k))
    after_conv = [i for i, n in enumerate(net.nodes) if n.op.label == "act" and n.op.act.kind != "sigmoid"]
    assert len(after_conv) == 6 and all(net.nodes[i - 1].op.label == "conv" for i in after_conv)
    for prims in (("winograd",), ("direct-gemm",), ("direct-numba",)):
        whole = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=prims, use_cache=False)
        tiled = autotune(
            net,
            memory_budget=int(whole.predicted_peak_bytes * 0.85),
            patch_shape=shape,
            primitives=prims,
            use_cache=False,
        )
        assert tiled.tile and not whole.tile
        for plan in (whole, tiled):
            consumers = net.consumers()
            fused = [i + 1 for i, s in enumerate(plan.steps) if fuses_next(net.nodes, i, s.primitive, consumers)]
            assert all(plan.steps[i].seconds == 0.0 for i in fused), prims
            calls.clear()
            np.testing.assert_allclose(znni_core.infer(net, x, plan=plan), ref, rtol=1e-4, atol=1e-5)
            # BatchNorm is folded into the convs: every activation but the head's sigmoid fuses (which
            # a run of 1x1x1 convs applies in its own pass)
            assert fused == after_conv and set(calls) <= {"sigmoid"}, (prims, fused, calls)


@pytest.mark.parametrize("merge", ["add", "concat"])
def test_winograd_convs_hand_channels_last_tensors_only_to_readers_that_take_them(tmp_path, monkeypatch, merge):
    """A Winograd conv or a run of 1x1x1 convs writes channels last only where every reader runs
    on it at speed: a Winograd or 1x1x1 conv, an element-wise node, a max-pool, a nearest
    upsampling, a concat (and so on through them). Never into the output, never mixed with a
    channels-first input of an add or a concat; the output equals PyTorch's and the channels-first
    run's (to rounding: a 1x1x1 product reads its operand in the other order)."""
    import znni_core.exec.patch as EG
    from znni_core.layers.layout import is_channels_last
    from znni_core.plan.program import program

    torch.manual_seed(4)
    model = randomise_bn(
        UNet(valid=False, depth=2, kernel=(1, 3, 3), pool=(1, 2, 2), width=3, bn=True, merge=merge, act="elu"), 4
    )
    shape = _shape(model, (3, 24, 24))
    net = znni_core.load_network(export(model, tmp_path / "u.onnx", shape))
    x = np.random.default_rng(4).standard_normal((1,) + shape).astype(np.float32)
    plan = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=("winograd",), use_cache=False)
    chosen = EG.channels_last_tensors(program(plan.steps, net))
    assert chosen and all(
        plan.steps[i].primitive == "winograd" or n.op.conv.kernel == (1, 1, 1)
        for i, n in enumerate(net.nodes)
        if n.output in chosen
    )
    seen, real_node, real_chain = [], EG._execute, EG._chain

    def node(op, nd, step, env, *a, **k):
        y = real_node(op, nd, step, env, *a, **k)
        seen.append((nd, step.primitive, [is_channels_last(env[i][0]) for i in nd.inputs], is_channels_last(y)))
        return y

    def chain(nd, followers, env, *a):
        seen.append((nd, nd.op.label, [is_channels_last(env[i][0]) for i in nd.inputs], None))
        return real_chain(nd, followers, env, *a)

    real_pointwise = EG.conv_pointwise_chain
    pointwise_ins, pointwise_outs = [], []

    def pointwise(x, stages, **k):  # runs of 1x1x1 convs (block by block in cache)
        pointwise_ins.append(is_channels_last(x))
        y = real_pointwise(x, stages, **k)
        assert is_channels_last(y) == (k.get("channels_last", False) and y.shape[1] > 1)
        pointwise_outs.append(is_channels_last(y))
        return y

    monkeypatch.setattr(EG, "_execute", node)
    monkeypatch.setattr(EG, "_chain", chain)
    monkeypatch.setattr(EG, "conv_pointwise_chain", pointwise)
    out = znni_core.infer(net, x, plan=plan)
    np.testing.assert_allclose(out, run(model, x), rtol=1e-4, atol=1e-5)
    pointwise_cl = sum(pointwise_ins)
    for nd, prim, ins, y in seen:
        if nd.op.label == "conv":
            assert y == (nd.output in chosen), nd.name
            assert prim == "winograd" or not any(ins), nd.name  # others read channels first
        if nd.op.label in ("add", "mul", "concat"):
            assert len(set(ins)) == 1, nd.name  # never mixed
        if nd.op.label == "concat":
            assert all(ins) and y, nd.name  # the skip and the upsampled tensor: channels last through it
    assert any(y for *_, y in seen) and pointwise_cl >= 2  # the upsampling's and the head's 1x1x1 convs
    # the 1x1x1 conv before each upsampling feeds an add or a concat: it writes channels last
    assert sum(pointwise_outs) == 2, pointwise_outs
    monkeypatch.setattr(EG, "channels_last_tensors", lambda prog: set())
    np.testing.assert_allclose(znni_core.infer(net, x, plan=plan), out, rtol=1e-6, atol=1e-6)


def test_a_direct_numba_first_layer_writes_channels_last_into_winograd(tmp_path, monkeypatch):
    """The first conv (one input channel) run by direct-numba writes channels last when its only
    reader is a Winograd conv: the tensor is chosen, the array is channels last at run time, and
    the output equals the channels-first run's and PyTorch's."""
    import dataclasses

    import znni_core.exec.patch as EG
    from znni_core.layers.layout import is_channels_last
    from znni_core.plan import primitives as P
    from znni_core.plan.program import program

    torch.manual_seed(5)
    model = randomise_bn(UNet(valid=False, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=6, bn=True, act="elu"), 5)
    shape = _shape(model, (3, 24, 24))
    net = znni_core.load_network(export(model, tmp_path / "u.onnx", shape))
    x = np.random.default_rng(5).standard_normal((1,) + shape).astype(np.float32)
    plan = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=("winograd",), use_cache=False)
    first = next(i for i, n in enumerate(net.nodes) if n.op.label == "conv")
    steps = list(plan.steps)
    steps[first] = dataclasses.replace(steps[first], primitive="direct-numba")
    plan = dataclasses.replace(plan, steps=tuple(steps) if isinstance(plan.steps, tuple) else steps)
    assert EG.channels_last_tensors(program(plan.steps, net)) >= {net.nodes[first].output}
    layouts, real = [], P.L.conv_direct_numba

    def direct(*a, **k):
        y = real(*a, **k)
        layouts.append(is_channels_last(y))
        return y

    monkeypatch.setattr(P.L, "conv_direct_numba", direct)
    out = znni_core.infer(net, x, plan=plan)
    assert layouts == [True]
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(x[None])).numpy()[0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    monkeypatch.setattr(P.DirectNumba, "writes_channels_last", False)
    np.testing.assert_allclose(znni_core.infer(net, x, plan=plan), out, rtol=1e-6, atol=1e-6)
    assert layouts == [True, False]


def test_a_last_layer_of_few_channels_reads_the_decoder_channels_last(tmp_path, monkeypatch):
    """A padded (1,5,5) conv to one channel after a Winograd conv of 16 maps (a U-Net's last layer,
    as the synapse detector's) reads the Winograd output channels last where direct-numba takes it
    in place (``layers.direct.reads_channels_last``; its zero padding copied in the same layout):
    the tensor is chosen, the array reaching the last conv is channels last, and the output equals
    PyTorch's and the channels-first run's."""
    import dataclasses

    import znni_core.exec.patch as EG
    from znni_core.layers.direct import reads_channels_last
    from znni_core.layers.layout import is_channels_last
    from znni_core.plan import primitives as P
    from znni_core.plan.program import program

    torch.manual_seed(6)
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv3d(1, 16, (1, 3, 3), padding=(0, 1, 1)),
        nn.ELU(),
        nn.Conv3d(16, 16, (1, 3, 3), padding=(0, 1, 1)),
        nn.ELU(),
        nn.Conv3d(16, 1, (1, 5, 5), padding=(0, 2, 2)),
        nn.Sigmoid(),
    )
    shape = (3, 20, 30)
    net = znni_core.load_network(export(model, tmp_path / "last.onnx", shape))
    x = np.random.default_rng(6).standard_normal((1,) + shape).astype(np.float32)
    plan = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=("winograd",), use_cache=False)
    convs = [i for i, n in enumerate(net.nodes) if n.op.label == "conv"]
    steps = list(plan.steps)
    steps[convs[1]] = dataclasses.replace(steps[convs[1]], primitive="winograd")
    steps[convs[2]] = dataclasses.replace(steps[convs[2]], primitive="direct-numba")
    plan = dataclasses.replace(plan, steps=tuple(steps) if isinstance(plan.steps, tuple) else steps)
    in_place = reads_channels_last(16, 1, (shape[0], shape[1] + 4, shape[2] + 4), (1, 5, 5))
    chosen = EG.channels_last_tensors(program(plan.steps, net), every=True)
    assert (net.nodes[convs[2]].inputs[0] in chosen) == in_place
    layouts, real = [], P.L.conv_direct_numba

    def direct(x, w, *a, **k):
        if w.shape[0] == 1:
            layouts.append(is_channels_last(x))
        return real(x, w, *a, **k)

    monkeypatch.setattr(P.L, "conv_direct_numba", direct)
    out = znni_core.infer(net, x, plan=plan)
    assert layouts == [in_place]
    np.testing.assert_allclose(out, run(model, x), rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(EG, "channels_last_tensors", lambda prog, every=False: set())
    np.testing.assert_allclose(znni_core.infer(net, x, plan=plan), out, rtol=1e-6, atol=1e-6)
    assert layouts == [in_place, False]


def test_exact_tiles_memory_walk_tracks_the_executor(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = randomise_bn(UNet(valid=False, depth=2, kernel=(1, 3, 3), pool=(1, 2, 2), width=6, bn=True, up="linear"), 0)
    shape = (4, 160, 160)
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", (4, 32, 32)))
    whole = autotune(net, memory_budget=2**34, input_shape=shape, primitives=("direct-gemm",), use_cache=False)
    plan = autotune(
        net,
        memory_budget=whole.predicted_peak_bytes // 2,
        input_shape=shape,
        primitives=("direct-gemm",),
        use_cache=False,
    )
    assert plan.tile
    x = np.random.default_rng(0).standard_normal((1,) + shape).astype(np.float32)
    monkeypatch.setenv("ZNNI_REUSE_BUFFERS", "0")  # fresh buffers: the executor's own live set
    run_patch(plan, net, x)
    tracemalloc.start()
    y = run_patch(plan, net, x)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak += x.nbytes - y.nbytes  # the walk counts the caller's patch, not the assembled output
    assert 0.75 <= plan.predicted_peak_bytes / peak <= 1.33, (plan.predicted_peak_bytes, peak)
    np.testing.assert_allclose(y, run(model, x), rtol=1e-4, atol=1e-5)


def test_budget_bounds_the_patch_and_too_small_a_budget_names_the_need(tmp_path):
    model = UNet(valid=True, depth=1, kernel=(3, 3, 3), pool=(2, 2, 2), width=4)
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", _shape(model, (1, 1, 1))))
    big = autotune(net, memory_budget=2**30, input_shape=(100, 100, 100))
    small = autotune(net, memory_budget=8 * 2**20, input_shape=(100, 100, 100))
    assert math.prod(small.patch_shape) < math.prod(big.patch_shape)
    assert small.predicted_peak_bytes <= 8 * 2**20
    assert all(net.is_admissible(p.patch_shape) for p in (big, small))
    with pytest.raises(znni_core.errors.MemoryBudgetError, match="needs"):
        autotune(net, memory_budget=2**14, input_shape=(100, 100, 100))


def test_loader_reads_crops_relative_and_folds_batchnorm(tmp_path):
    model = randomise_bn(UNet(valid=True, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=2, bn=True), 1)
    net = znni_core.load_network(export(model, tmp_path / "v.onnx", _shape(model, (3, 40, 40))))
    ops = [n.op.label for n in net.nodes]
    assert "affine" not in ops  # BatchNorm after a conv folds into it
    crops = [n.op for n in net.nodes if n.op.label == "crop"]
    assert crops and all(c.low == c.high for c in crops)  # centre crops, relative to the shape


def test_batchnorm_after_an_add_stays_an_affine_node(tmp_path):
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 3, 3, padding=1)
            self.bn = nn.BatchNorm3d(3)

        def forward(self, x):
            a = self.c1(x)
            return torch.sigmoid(self.bn(a + self.c2(a)) * 2.0 - 1.0)

    model = randomise_bn(Res(), 4)
    net = znni_core.load_network(export(model, tmp_path / "r.onnx", (6, 10, 10)))
    assert [n.op.label for n in net.nodes].count("affine") >= 1
    x = np.random.default_rng(0).standard_normal((1, 6, 10, 10)).astype(np.float32)
    np.testing.assert_allclose(znni_core.infer(net, x), run(model, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", [nn.InstanceNorm3d(3), nn.GroupNorm(1, 3)])
def test_patch_dependent_normalisation_is_refused_naming_node_and_why(tmp_path, norm):
    model = nn.Sequential(nn.Conv3d(1, 3, 3), norm, nn.ReLU())
    with pytest.raises(UnsupportedOperatorError, match="whole patch") as err:
        znni_core.load_network(export(model, tmp_path / "n.onnx", (8, 8, 8)))
    assert "node" in str(err.value)


@pytest.mark.parametrize(
    "module,match",
    [
        (nn.Conv3d(1, 2, 3, dilation=2), "dilations"),
        (nn.ConvTranspose3d(1, 2, 3, stride=2), "stride equal to the kernel"),
        (nn.Upsample(scale_factor=1.5, mode="nearest"), "integer"),
    ],
)
def test_unsupported_graph_operators_are_refused(tmp_path, module, match):
    model = nn.Sequential(nn.Conv3d(1, 1, 1), module)
    with pytest.raises(UnsupportedOperatorError, match=match):
        znni_core.load_network(export(model, tmp_path / "u.onnx", (8, 8, 8)))


def test_output_at_another_resolution_is_refused(tmp_path):
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.MaxPool3d(2), nn.Conv3d(2, 2, 3, padding=1))
    with pytest.raises(NetworkError, match="resolution"):
        znni_core.load_network(export(model, tmp_path / "d.onnx", (8, 8, 8)))


@pytest.mark.real_data(*DETECTOR_FILES)
def test_real_synapse_detector_equals_its_reference_output():
    net = znni_core.load_network(DETECTOR)
    assert net.kind == "padded" and net.export_shape == (18, 160, 160)
    ref = np.load(DETECTOR_REFERENCE)
    out = znni_core.infer(net, ref["input"])
    assert out.shape == (1,) + ref["output"].shape
    np.testing.assert_allclose(out[0], ref["output"], rtol=1e-4, atol=1e-4)


@pytest.mark.real_data(*DETECTOR_FILES)
def test_real_detector_runs_adds_batchnorms_and_elus_in_one_pass(monkeypatch):
    """The detector's residual add -> BatchNorm -> ELU runs as one pass (``chain_after``) and
    every ELU after a conv inside the conv: only the head's sigmoid is an activation of its own;
    the output still equals the reference."""
    import znni_core.exec.patch as EG
    from znni_core.plan.program import chain_after

    net = znni_core.load_network(DETECTOR)
    consumers = net.consumers()
    chains = {i: chain_after(net.nodes, i, consumers) for i, n in enumerate(net.nodes) if n.op.label == "add"}
    assert len(chains) == 7 and all([net.nodes[j].op.label for j in c] == ["affine", "act"] for c in chains.values())
    calls = []
    real = EG.apply_activation
    monkeypatch.setattr(EG, "apply_activation", lambda x, kind, *a, **k: calls.append(kind) or real(x, kind, *a, **k))
    ref = np.load(DETECTOR_REFERENCE)
    plan = autotune(net, input_shape=ref["input"].shape, memory_budget=2**31, use_cache=False)
    skipped = [s for s in plan.steps if s.op in ("affine", "act") and s.seconds == 0.0]
    assert len(skipped) == sum(1 for n in net.nodes if n.op.label == "act") - 1 + 7  # all but the sigmoid, 7 affines
    out = znni_core.infer(net, ref["input"], plan=plan)
    np.testing.assert_allclose(out[0], ref["output"], rtol=1e-4, atol=1e-4)
    assert calls == ["sigmoid"]


@pytest.mark.parametrize("valid", [True, False])
def test_pipeline_tasks_equal_whole_volume_infer(tmp_path, valid):
    """Every chunk written by one task, whole; together they equal ``infer`` on the region's input
    (exact tiles for a valid U-Net, the same blended lattice for a padded one)."""
    from .pipeline_helpers import em
    from .test_pipeline import prepare, read_out, reference, run_all

    torch.manual_seed(5)
    model = randomise_bn(
        UNet(
            valid=valid,
            depth=1,
            kernel=(1, 3, 3),
            pool=(1, 2, 2),
            width=3,
            bn=True,
            c_out=1,
            up="nearest" if valid else "transpose",
        ),
        5,
    )
    shape = _shape(model, (2, 20, 20)) if valid else (4, 16, 16)
    export(model, tmp_path / "net.onnx", shape)
    from .pipeline_helpers import base_config

    vol = em((8, 44, 44))
    edge = "valid" if valid else "zero"
    cfg = base_config(
        tmp_path,
        vol=vol,
        edge=edge,
        network={"path": str(tmp_path / "net.onnx")},
        output={"path": str(tmp_path / "out"), "chunk_size": [4, 8, 8]},
        task_chunks=[1, 2, 2],
        blend={"patch_shape": None if valid else [4, 16, 16], "overlap": None if valid else [2, 4, 4]},
    )
    if valid:
        net = znni_core.load_network(tmp_path / "net.onnx")
        c = net.context
        cfg["region"] = {
            "offset": list(net.halo[0]),
            "shape": [a - cc for a, cc in zip(net.floor_admissible(vol.shape), c)],
        }
    rf = prepare(cfg)
    ids = run_all(rf)
    assert len(ids) > 4
    got, _ = read_out(rf)
    if valid:
        ref = reference(cfg, vol[tuple(slice(0, r + cc) for r, cc in zip(cfg["region"]["shape"], c))])
    else:  # zero-padded U-Net: infer over the whole input with the run's plan (its patch and overlap)
        from znni_core.pipeline.run import load_run
        from znni_core.plan.plan import Plan

        plan = Plan.load(load_run(rf).plan.path)
        assert plan.overlap == (2, 4, 4) and plan.patch_shape == (4, 16, 16)
        net = znni_core.load_network(tmp_path / "net.onnx")
        ref = znni_core.infer(net, vol.astype(np.float32) * np.float32(cfg["normalize"]["scale"]), plan=plan)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # znni verify: in every task one patch recomputed alone (direct convolutions), compared with
    # what is stored where no other patch blends in; a changed stored value is found
    from znni_core.io import PrecomputedLayer, parse_layer_url, read_manifest
    from znni_core.pipeline.run import load_run
    from znni_core.pipeline.task import manifest_path
    from znni_core.pipeline.verify import verify_run

    # the tasks' own checks: auto skips (a patch alone costs more than 2% of a task) and says why
    run = load_run(rf)
    first = read_manifest(manifest_path(run, ids[0]))["recomputed"]
    assert first["voxels"] == 0 and "costs more than" in first["skipped"], first
    # with verify_voxels set, every task recomputes one of its patches alone before it writes
    cfg_v = dict(
        cfg,
        work_dir=str(tmp_path / "work_v"),
        verify_voxels=1,
        output={**cfg["output"], "path": str(tmp_path / "out_v")},
    )
    rf_v = prepare(cfg_v)
    run_all(rf_v)
    checks = [read_manifest(manifest_path(load_run(rf_v), i))["recomputed"] for i in ids]
    assert all(c["max_deviation"] < 1e-4 and "direct" in c["how"] for c in checks if c["voxels"]), checks
    assert sum(c["voxels"] for c in checks) > 0, checks
    rec = verify_run(rf, tasks=len(ids), seed=2, log=lambda *a: None)
    assert rec["recomputed"]["passed"] and "direct" in rec["recomputed"]["how"], rec
    assert rec["recomputed"]["voxels"] > 0 and rec["recomputed"]["max_deviation"] < 1e-4, rec
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    for tid in ids:
        for c in read_manifest(manifest_path(run, tid))["chunks"]:
            if c["status"] == "written":
                arr = layer.read_chunk(tuple(c["index"]))
                layer.write_chunk(tuple(c["index"]), arr + np.float32(0.25))
    with pytest.raises(znni_core.errors.DataError, match="the network gives"):
        verify_run(rf, tasks=len(ids), seed=2, checksums=False, log=lambda *a: None)


def test_cli_info_names_the_kind_and_plan_takes_patch_and_overlap(tmp_path):
    from typer.testing import CliRunner

    from znni_core.cli import app
    from znni_core.plan.plan import Plan

    runner = CliRunner()
    valid = export(UNet(valid=True, depth=1, kernel=(1, 3, 3), width=2), tmp_path / "v.onnx", (2, 18, 18))
    padded = export(UNet(valid=False, depth=1, kernel=(1, 3, 3), width=2), tmp_path / "p.onnx", (2, 16, 16))
    chain = export(
        nn.Sequential(nn.Conv3d(1, 2, 3), nn.MaxPool3d(2), nn.Conv3d(2, 1, 3)), tmp_path / "c.onnx", (12, 12, 12)
    )
    for path, words in [(valid, "valid graph"), (padded, "padded graph"), (chain, "chain")]:
        r = runner.invoke(app, ["info", str(path)])
        assert r.exit_code == 0 and f"kind: {words}" in r.output, r.output
    r = runner.invoke(
        app,
        [
            "plan",
            str(padded),
            "--input-shape",
            "4,64,64",
            "--patch",
            "4,32,32",
            "--overlap",
            "0,8,8",
            "--blend",
            "gaussian",
            "-o",
            str(tmp_path / "plan.json"),
        ],
    )
    assert r.exit_code == 0, r.output
    plan = Plan.load(tmp_path / "plan.json")
    assert (plan.kind, plan.patch_shape, plan.overlap, plan.blend) == ("padded", (4, 32, 32), (0, 8, 8), "gaussian")
    r = runner.invoke(app, ["plan", str(padded), "--patch", "4,31,32"])
    assert r.exit_code == 2 and "not admissible" in r.output


def test_yaml_spec_round_trips_a_graph(tmp_path):
    from znni_core.net import save_network

    model = randomise_bn(UNet(valid=False, depth=2, kernel=(1, 3, 3), width=2, bn=True, up="transpose", merge="add"), 2)
    net = znni_core.load_network(export(model, tmp_path / "p.onnx", (2, 16, 16)))
    again = znni_core.load_network(save_network(net, tmp_path / "p.yaml"))
    assert isinstance(again, Graph) and again.digest() == net.digest() and again.kind == "padded"
    x = np.random.default_rng(0).standard_normal((1, 2, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(znni_core.infer(again, x), znni_core.infer(net, x))


def test_valid_graph_default_region_is_cut_to_an_admissible_input(tmp_path):
    from znni_core.pipeline.resolve import resolve

    from .pipeline_helpers import base_config, em

    model = UNet(valid=True, depth=1, kernel=(1, 3, 3), pool=(1, 2, 2), width=2, c_out=1)
    export(model, tmp_path / "net.onnx", _shape(model, (2, 20, 20)))
    cfg = base_config(tmp_path, vol=em((8, 45, 43)), network={"path": str(tmp_path / "net.onnx")})
    run, plan = resolve(cfg, mem_mb=2000, threads=1, progress=lambda *a: None)
    net = znni_core.load_network(tmp_path / "net.onnx")
    shape = tuple(run.region["shape"])
    assert net.is_admissible(tuple(s + c for s, c in zip(shape, net.context)))
    assert 45 - net.grid[1] < shape[1] + net.context[1] <= 45 and 43 - net.grid[2] < shape[2] + net.context[2] <= 43


class _SizedUp(torch.nn.Module):
    """A padded two-level net that upsamples to the skip's size (``F.interpolate(size=...)``):
    with dynamic axes, the Resize's sizes come from Shape arithmetic."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Conv3d(1, 4, 3, padding=1)
        self.b = torch.nn.Conv3d(4, 4, 3, padding=1)
        self.c = torch.nn.Conv3d(8, 2, 1)

    def forward(self, x):
        s = torch.relu(self.a(x))
        d = torch.relu(self.b(torch.nn.functional.max_pool3d(s, (1, 2, 2))))
        u = torch.nn.functional.interpolate(d, size=s.shape[2:], mode="nearest")
        return self.c(torch.cat([s, u], 1))


def test_dynamic_axes_exports_fold_their_shape_arithmetic(tmp_path):
    """U-Nets exported with dynamic axes (crops computed from tensor shapes in a valid U-Net, a
    resize to the skip's size in a padded one) load, and equal PyTorch on an input of another
    shape than the export's; a crop that depends on the input size is refused naming its node."""
    pytest.importorskip("onnx")
    from .unets import UNet, admissible, export, run

    torch.manual_seed(4)
    valid = UNet(valid=True, depth=2, kernel=(3, 3, 3), pool=(1, 2, 2), width=4)
    shape = tuple(admissible(valid, a, lo) for a, lo in enumerate((10, 40, 40)))
    other = tuple(admissible(valid, a, lo) for a, lo in enumerate((shape[0] + 3, shape[1] + 9, shape[2] + 5)))
    assert other != shape
    for model, export_at, run_at in ((valid, shape, other), (_SizedUp(), (6, 20, 20), (7, 26, 22))):
        path = export(model, tmp_path / f"{type(model).__name__}.onnx", export_at, dynamic=True)
        net = znni_core.load_network(path)
        x = np.random.default_rng(2).standard_normal((1,) + run_at).astype(np.float32)
        np.testing.assert_allclose(znni_core.infer(net, x), run(model, x), rtol=1e-4, atol=1e-5)
    path = export(HalfCrop(), tmp_path / "half.onnx", (5, 12, 12), dynamic=True)
    with pytest.raises(NetworkError, match="Slice|shape arithmetic|depend"):
        znni_core.load_network(path)


def test_a_strided_convolution_runs_through_the_registry(tmp_path):
    """A conv node with a stride above 1 is a :class:`StridedConv` to the primitives.  The
    registry's primitive for it (the only one that ``strides``) equals PyTorch's strided conv3d
    and its memory bound holds the output; the searches give plain convolutions to the others
    only, and a U-Net that downsamples by strided convolutions is planned with it there."""
    from znni_core.net.chain import Conv
    from znni_core.net.graph import Node
    from znni_core.net.ops import Convolution, StridedConv
    from znni_core.plan.graph import GRAPH_PRIMITIVES
    from znni_core.plan.plan import CPU_PRIMITIVES
    from znni_core.plan.primitives import PRIMITIVES, names

    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    node = Node(Convolution(Conv(w, b), stride=(1, 2, 3)), ("x",), "y", "down")
    layer = node.op.layer
    assert isinstance(layer, StridedConv) and layer.stride == (1, 2, 3) and layer.kernel == (2, 3, 3)
    (name,) = names("cpu", strides=True)
    prim = PRIMITIVES[name]
    x = rng.standard_normal((2, 3, 7, 11, 14)).astype(np.float32)
    y = prim.build(layer, x.shape[2:])(x)
    ref = torch.nn.functional.conv3d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride=(1, 2, 3))
    assert y.shape == tuple(ref.shape) and np.abs(y - ref.numpy()).max() < 1e-4 * np.abs(ref.numpy()).max()
    assert prim.call_bytes(2, layer, x.shape[2:]) >= y.nbytes
    assert not any(PRIMITIVES[p].strides for p in CPU_PRIMITIVES + GRAPH_PRIMITIVES)

    model = UNet(valid=True, depth=1, kernel=(1, 3, 3), width=2, down="conv")
    shape = tuple(admissible(model, a, lo) for a, lo in enumerate((2, 18, 18)))
    net = znni_core.load_network(export(model, tmp_path / "s.onnx", shape))
    plan = autotune(net, patch_shape=shape, memory_budget=1 << 30, use_cache=False)
    by_node = {n.name: s.primitive for n, s in zip(net.nodes, plan.steps) if n.op.label == "conv"}
    strided = [n.name for n in net.nodes if n.op.label == "conv" and any(s > 1 for s in n.op.stride)]
    assert strided and all(by_node[n] == name for n in strided)
    assert all(by_node[n.name] != name for n in net.nodes if n.op.label == "conv" and n.name not in strided)
