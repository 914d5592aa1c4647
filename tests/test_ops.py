"""Operators as types (``net/ops.py``): every class registered where its memory, cost and run are
defined, validated where it is made, its geometry consistent, and no operator name compared
outside the loaders."""

from __future__ import annotations

import ast
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import NetworkError
from znni_core.net import ops
from znni_core.net.chain import Activation, Conv

ROOT = Path(__file__).resolve().parent.parent / "znni_core"


def _tables():
    from znni_core.exec.patch import _execute
    from znni_core.plan.memory import node_bytes
    from znni_core.plan.pricing import step_of

    return {"memory (plan/memory.node_bytes)": node_bytes, "cost (plan/pricing.step_of)": step_of, "run": _execute}


def test_every_operator_is_registered_in_every_table():
    """The memory walk, the cost model and the executor each have a function for every operator
    class; a class added to ``OPERATORS`` without one fails here, by name."""
    missing = [
        f"{cls.__name__} in {where}"
        for where, table in _tables().items()
        for cls in ops.OPERATORS
        if table.dispatch(cls) is table.dispatch(object)
    ]
    assert not missing, missing
    assert set(ops.BY_LABEL) == {cls.label for cls in ops.OPERATORS} and len(ops.BY_LABEL) == len(ops.OPERATORS)


def test_a_missing_registration_is_caught():
    """The check above can fail: an operator class of its own is in no table."""

    class Twice(ops.Operator):
        label = "twice"

    assert all(table.dispatch(Twice) is table.dispatch(object) for table in _tables().values())


def _compares_op(tree) -> list[int]:
    """Lines where something's ``.op`` is compared with ``==``, ``!=`` or ``in``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "op" for s in sides):
                out.append(node.lineno)
    return out


def test_no_operator_name_is_compared_outside_the_loaders():
    """Code reads an operator by its class (``isinstance``) or asks it; only the loaders map ONNX
    and YAML names to classes.  The scan finds a planted comparison."""
    loaders = {"net/onnx_loader.py", "net/native.py", "net/ops.py"}
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in loaders:
            lines = _compares_op(ast.parse(path.read_text(), str(path)))
            if lines:
                found[rel] = lines
    assert not found, found
    assert _compares_op(ast.parse('if node.op == "conv":\n    pass\n')) == [1]


@pytest.mark.parametrize(
    "label,params,match",
    [
        ("conv2d", {}, "unknown graph operator 'conv2d'"),
        ("pool", {"window": (1, 2, 2), "kind": "min"}, "pooling kind 'min'"),
        ("pool", {"window": (1, 0, 2)}, "at least 1"),
        ("pool", {"window": (2, 2, 2), "stride": (2, 2, 2)}, "no parameter 'stride'"),
        ("resize", {"scale": (1, 2, 2), "mode": "cubic"}, "resize mode 'cubic'"),
        ("resize", {"scale": (1, 2, 2), "mode": "linear", "coord": "asymmetric"}, "coordinate mode"),
        ("crop", {"low": (0, 1), "high": (0, 0, 0)}, "3 integers"),
        ("affine", {"scale": np.ones(3), "shift": np.zeros(2)}, "3 scales and 2 shifts"),
        ("act", {"act": "relu"}, "needs an Activation"),
        ("conv", {}, "needs"),
    ],
)
def test_an_operator_is_validated_where_it_is_made(label, params, match):
    with pytest.raises(NetworkError, match=match) as exc:
        ops.make(label, "node7", params)
    assert "node7" in str(exc.value)


def _single_input_ops():
    rng = np.random.default_rng(0)
    conv = Conv(rng.standard_normal((2, 3, 3, 2, 1)).astype(np.float32))
    return [
        ops.Convolution(conv),
        ops.Convolution(conv, stride=(2, 1, 3), pads=((1, 0, 0), (2, 1, 0))),
        ops.Deconvolution(rng.standard_normal((3, 2, 2, 3, 1)).astype(np.float32), stride=(2, 3, 1)),
        ops.Pooling((2, 3, 1)),
        ops.Pooling((3, 1, 2), "avg"),
        ops.Resize((2, 3, 1)),
        ops.Resize((2, 3, 1), "linear", "half_pixel"),
        ops.Resize((3, 2, 1), "linear", "align_corners"),
        ops.Crop((1, 0, 2), (0, 2, 1)),
        ops.Pad((1, 0, 2), (0, 2, 1), 0.5),
        ops.Act(Activation("relu")),
        ops.Affine(np.ones(3, np.float32), np.zeros(3, np.float32)),
    ]


@pytest.mark.parametrize("op", _single_input_ops(), ids=lambda o: type(o).__name__)
def test_each_operators_geometry_agrees_with_itself(op):
    """Per axis and input length: the input range of any output range lies in the input (empty only
    where a pad makes it all) and grows with the range; a crop's whole output reads its middle, an
    element-wise operator's range is its own; a resampling's output step is the length ratio."""
    for axis in range(3):
        for n in range(3, 14):
            try:
                m = op.length(axis, [n], False, "x")
            except ops.Inadmissible:
                continue
            step, _ = op.step_origin(axis, Fraction(1), Fraction(0))
            if not isinstance(op, (ops.Crop, ops.Pad, ops.Convolution)):
                assert m * step == n or isinstance(op, ops.Pooling), (axis, n, m, step)
            last = (0, 0)
            for a in range(m):
                for b in range(a + 1, m + 1):
                    lo, hi = op.in_range(axis, a, b, n)
                    assert 0 <= lo <= hi <= n and (lo < hi or isinstance(op, ops.Pad)), (axis, n, a, b, lo, hi)
                    if a == 0:
                        assert hi >= last[1]
                        last = (lo, hi)
            if isinstance(op, ops.Crop):
                assert op.in_range(axis, 0, m, n) == (op.low[axis], n - op.high[axis])
            elif op.elementwise:
                assert op.in_range(axis, 1, m, n) == (1, m)


def test_resize_tables_are_pytorchs():
    """A linear resize's index tables interpolate as ``torch.nn.functional.interpolate`` does."""
    torch = pytest.importorskip("torch")
    from znni_core.layers.resample import interpolate

    x = np.random.default_rng(1).standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    for coord in ("half_pixel", "align_corners"):
        op = ops.Resize((2, 3, 1), "linear", coord)
        got = interpolate(
            x, [None if f == 1 else op.table(ax, n) for ax, (f, n) in enumerate(zip(op.scale, x.shape[2:]))]
        )
        ref = torch.nn.functional.interpolate(
            torch.from_numpy(x), scale_factor=op.scale, mode="trilinear", align_corners=coord == "align_corners"
        ).numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [(1, 2, 2), (2, 3, 1), (2, 1, 1)])
def test_linear_resize_on_the_host_equals_the_generic_passes(scale, numba_thread_counts):
    """The host's one-pass linear resize (numba, rows over the run's workers) gives the generic
    path's values bit for bit (the same operations in the same order; inf and NaN alike), on
    channels-first and channels-last input (whose output stays channels last), whole tables and a
    tile's slice of them, on one worker and two."""
    from znni_core.layers.layout import empty_channels_last, is_channels_last
    from znni_core.layers.resample import interpolate

    rng = np.random.default_rng(sum(scale))
    x = rng.standard_normal((2, 5, 4, 6, 7)).astype(np.float32)
    x.reshape(-1)[::37] = np.inf
    x.reshape(-1)[5::41] = np.nan
    xc = empty_channels_last(x.shape)
    xc[...] = x
    for _ in numba_thread_counts:
        for coord in ("half_pixel", "align_corners"):
            op = ops.Resize(scale, "linear", coord)
            tables = [None if f == 1 else op.table(ax, n) for ax, (f, n) in enumerate(zip(scale, x.shape[2:]))]
            part = [None if t is None else tuple(v[1:-1] for v in t) for t in tables]  # a tile's rows
            for tb in (tables, part):
                with np.errstate(invalid="ignore"):
                    ref = interpolate.generic(x, tb)
                np.testing.assert_array_equal(interpolate(x, tb), ref)
                got = interpolate(xc, tb)
                assert is_channels_last(got)
                np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("kernel", [(1, 2, 2), (2, 2, 2), (2, 3, 1)])
def test_transposed_conv_on_the_host_keeps_channels_last_and_equals_the_generic_path(kernel, numba_thread_counts):
    """The host's transposed convolution of a channels-last input (a product per voxel's channels,
    then each voxel's output block scattered): channels last out, equal to the generic path's
    (channels first) and to PyTorch's, with and without bias, for a whole array and a part of one,
    on one worker and two."""
    torch = pytest.importorskip("torch")
    from znni_core.layers.layout import empty_channels_last, is_channels_last
    from znni_core.layers.resample import conv_transpose

    rng = np.random.default_rng(sum(kernel))
    x = rng.standard_normal((2, 6, 3, 4, 5)).astype(np.float32)
    xc = empty_channels_last(x.shape)
    xc[...] = x
    co = 5 if kernel == (2, 3, 1) else 12  # each voxel's runs: fewer than 8 channels, or 8 + an overlapping 8
    w = rng.standard_normal((6, co) + kernel).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32)
    for _ in numba_thread_counts:
        for bias in (b, None):
            ref = torch.nn.functional.conv_transpose3d(
                torch.from_numpy(x), torch.from_numpy(w), None if bias is None else torch.from_numpy(bias), kernel
            ).numpy()
            got = conv_transpose(xc, w, bias, kernel)
            assert is_channels_last(got)
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(conv_transpose.generic(x, w, bias, kernel), ref, rtol=1e-5, atol=1e-5)
            part = conv_transpose(xc[:, :, 1:], w, bias, kernel)  # channels inner, not whole
            assert is_channels_last(part)
            np.testing.assert_allclose(part, ref[:, :, kernel[0] :], rtol=1e-5, atol=1e-5)


def test_a_node_holds_an_operator():
    from znni_core.net.graph import Node

    with pytest.raises(NetworkError, match="not a graph operator"):
        Node("conv", ("x",), "y", "c1")
    act = Node(ops.Act(Activation("elu", 1.0)), ("x",), "y", "e")
    moved = act.with_op(act.op, ("z",), "w")
    assert moved.op is act.op and moved.name == "e" and moved.inputs == ("z",) and moved.output == "w"
    assert ops.replace(ops.Resize((1, 2, 2)), scale=(1, 4, 4)).scale == (1, 4, 4)


def test_output_tiles_inside_a_wide_padding_are_exact():
    """A graph that pads wider than its output tiles: tiles that read only padding, only input and
    both give exactly the whole patch's output, and no tensor's needed range is ever negative (a
    tile inside the padding asked for the input up to -1 before: a negative slice, and negative
    bytes in the memory walk)."""
    import dataclasses

    import znni_core
    from znni_core.net.graph import Graph, Node
    from znni_core.plan.ranges import needed_ranges, tile_starts
    from znni_core.plan.search import autotune

    rng = np.random.default_rng(3)
    conv = Conv(rng.standard_normal((2, 1, 1, 3, 3)).astype(np.float32), rng.standard_normal(2).astype(np.float32))
    net = Graph(
        (
            Node(ops.Pad((0, 5, 4), (0, 6, 5), 0.25), ("x",), "p", "pad"),
            Node(ops.Convolution(conv), ("p",), "y", "conv"),
        ),
        "x",
        "y",
        1,
    )
    x = rng.standard_normal((1, 3, 9, 10)).astype(np.float32)
    plan = autotune(net, memory_budget=2**30, patch_shape=x.shape[1:], use_cache=False)
    whole = znni_core.infer(net, x, plan=plan)
    ref = np.pad(x, ((0, 0), (0, 0), (5, 6), (4, 5)), constant_values=0.25)
    ref = (
        sum(
            conv.weight[:, 0, 0, dy, dx, None, None, None] * ref[0, None, :, dy : dy + 18, dx : dx + 17]
            for dy in range(3)
            for dx in range(3)
        )
        + conv.bias[:, None, None, None]
    )
    np.testing.assert_allclose(whole, ref, rtol=1e-5, atol=1e-5)
    shapes = net.shapes(x.shape[1:])
    for tile in ((3, 2, 2), (1, 3, 1), (2, 1, 4)):
        for lo in tile_starts(shapes["y"][1:], tile):
            hi = tuple(min(a + t, n) for a, t, n in zip(lo, tile, shapes["y"][1:]))
            for name, (a, b) in needed_ranges(net, shapes, lo, hi).items():
                assert all(0 <= u <= v for u, v in zip(a, b)), (tile, lo, name, a, b)
        tiled = znni_core.infer(net, x, plan=dataclasses.replace(plan, tile=tile))
        np.testing.assert_allclose(tiled, whole, rtol=1e-6, atol=1e-6, err_msg=str(tile))
