"""Winograd convolution (kernels of 1-3 in z, 1-5 in y and x): exact against independent references,
in the planner and the engine, with a true memory model.

References: float64 scipy correlate (``test_layers_conv.reference``), PyTorch conv3d, and the
engine's window-by-window definition.  Tolerance: max relative error <= 1e-4 (float32).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import znni_core
from znni_core import layers as L
from znni_core.errors import InputError
from znni_core.layers import tuning
from znni_core.layers.winograd import KERNEL_SIZES, WinogradConv, toom_cook, winograd_supports, winograd_tiles
from znni_core.plan import autotune
from znni_core.plan.primitives import primitive

from .nets import make_net
from .reference import max_rel_err, torch_dense
from .test_layers_conv import TOL, reference, rel_err
from .test_layers_memory import check, data, measured_peak


@pytest.mark.parametrize("a,r", [(a, r) for a, sizes in ((4, (2, 3)), (6, KERNEL_SIZES[1])) for r in sizes if r > 1])
def test_transform_matrices_compute_the_1d_correlation(a, r):
    """AT[(G g) * (BT d)] == the valid correlation of d with g, for random d and g (float64)."""
    BT, G, AT = toom_cook(a, r)
    m = AT.shape[0]
    assert BT.shape == (a, a) and G.shape == (a, r) and m == a + 1 - r
    rng = np.random.default_rng(0)
    for _ in range(20):
        d, g = rng.standard_normal(a), rng.standard_normal(r)
        y = AT @ ((G @ g) * (BT @ d))
        assert np.allclose(y, [d[i : i + r] @ g for i in range(m)], rtol=0, atol=1e-12)


def test_eight_point_bt_rows_scale_the_vandermonde_inverse():
    """a = 8's written-out BT (dyadic constants) is inverse(W)^T of the Vandermonde matrix W of
    0, +-1, +-2, +-1/2 and infinity, each row times a nonzero scale (a row's scale moves into G)."""
    from znni_core.layers.winograd import _BT, _POINTS

    pts = _POINTS[8]
    W = np.zeros((8, 8))
    for i, p in enumerate(pts):
        W[i] = [p**j for j in range(8)]
    W[-1, -1] = 1.0
    ref = np.linalg.inv(W).T
    scale = np.array([row[np.argmax(np.abs(row))] / r[np.argmax(np.abs(row))] for row, r in zip(_BT[8], ref)])
    assert np.all(np.abs(scale) > 1e-3)
    np.testing.assert_allclose(_BT[8], scale[:, None] * ref, rtol=0, atol=1e-12)
    # the pairs +-p differ in the sign of the odd columns only (what the written-out transform uses)
    for r in (1, 3, 5):
        np.testing.assert_array_equal(_BT[8][r + 1], _BT[8][r] * np.array([1, -1] * 4))


@pytest.mark.parametrize("a", [4, 6, 8])
def test_written_out_transforms_equal_the_matrices(a):
    """The compiled 1D transforms (``_bt_rows``, ``_at``: written out for 4, 6 and 8 points) equal
    ``BT @ d`` and ``AT @ x`` (float64 matrices) on strided float32 lanes, for every output
    count a kernel size gives."""
    from znni_core.layers.winograd import _at, _bt_rows

    rng = np.random.default_rng(a)
    L, ds, vs = 5, 7, 6  # 5 lanes; rows of the input and output 7 and 6 values apart
    d = rng.standard_normal(a * ds).astype(np.float32)
    v = np.zeros(a * vs, np.float32)
    BT = toom_cook(a, 2)[0]
    _bt_rows(a, d, 0, ds, 0, v, 0, vs, 0, L, 1)
    np.testing.assert_allclose(
        v.reshape(a, vs)[:, :L], BT @ d.reshape(a, ds)[:, :L].astype(np.float64), rtol=1e-5, atol=1e-5
    )
    for r in KERNEL_SIZES[2] if a == 8 else KERNEL_SIZES[1] if a == 6 else (1, 2, 3):
        if r == 1 or a + 1 - r < 1:
            continue
        AT = toom_cook(a, r)[2]
        m = AT.shape[0]
        y = np.zeros(m * vs, np.float32)
        _at(a, m, d, 0, ds, y, 0, vs, L)
        np.testing.assert_allclose(
            y.reshape(m, vs)[:, :L], AT @ d.reshape(a, ds)[:, :L].astype(np.float64), rtol=1e-5, atol=1e-4
        )


@pytest.mark.parametrize("L", [7, 8, 9, 15, 16, 17, 28, 33, 48])
def test_eight_point_transforms_on_whole_vectors_equal_the_matrices(L):
    """Runs of a vector or more go through :mod:`~znni_core.layers.transform_vectors` a vector at
    a time, the last vector overlapping (8- and 16-float vectors; 7 lanes stay on the loop): BT
    and AT for 4-7 outputs equal the float64 matrices on every lane, on ``nb`` runs, and write
    nothing past them."""
    from znni_core.layers.winograd import _at, _bt_rows

    rng = np.random.default_rng(L)
    nb, ds, vs, dstep, vstep = 3, L + 5, 3 * L + 2, 2, 3 * (L + 1)
    d = rng.standard_normal(1 + 8 * ds + nb * dstep).astype(np.float32)
    got = np.full(8 * vs + nb * vstep + 4, -7.0, np.float32)
    want = got.astype(np.float64)
    BT = toom_cook(8, 3)[0]
    for b in range(nb):
        rows = np.array([d[1 + b * dstep + k * ds :][:L] for k in range(8)], np.float64)
        for k, row in enumerate(BT @ rows):
            want[b * vstep + k * vs :][:L] = row
    _bt_rows(8, d, 1, ds, dstep, got, 0, vs, vstep, L, nb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for r in (2, 3, 4, 5):
        AT = toom_cook(8, r)[2]
        m = AT.shape[0]
        y = np.full(m * vs + 4, -7.0, np.float32)
        want = y.astype(np.float64)
        for k, row in enumerate(AT @ np.array([d[2 + k * ds :][:L] for k in range(8)], np.float64)):
            want[k * vs :][:L] = row
        _at(8, m, d, 2, ds, y, 0, vs, L)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("a", [4, 6])
@pytest.mark.parametrize("L", [7, 8, 9, 15, 16, 17, 24, 33, 48])
def test_six_and_four_point_input_transforms_on_whole_vectors_equal_the_matrix(a, L):
    """The 6- and 4-point BT on runs of a vector or more (:mod:`~znni_core.layers.transform_vectors`, the
    last vector overlapping; 7 lanes stay on the loop) equals the float64 matrix on every lane of
    ``nb`` runs and writes nothing past them."""
    from znni_core.layers.winograd import _bt_rows

    rng = np.random.default_rng(L)
    nb, ds, vs, dstep, vstep = 3, L + 5, 3 * L + 2, 2, 3 * (L + 1)
    d = rng.standard_normal(1 + a * ds + nb * dstep).astype(np.float32)
    got = np.full(a * vs + nb * vstep + 4, -7.0, np.float32)
    want = got.astype(np.float64)
    BT = toom_cook(a, 2)[0]
    for b in range(nb):
        rows = np.array([d[1 + b * dstep + k * ds :][:L] for k in range(a)], np.float64)
        for k, row in enumerate(BT @ rows):
            want[b * vstep + k * vs :][:L] = row
    _bt_rows(a, d, 1, ds, dstep, got, 0, vs, vstep, L, nb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a", [1, 4, 6, 8])
def test_transform_runs_equal_the_matrix_on_every_run(a):
    """``_bt_rows`` on ``nb`` runs of ``L`` lanes, ``dstep`` and ``vstep`` apart (the input
    transform's whole tile rows), equals ``BT @ d`` (float64) on every run and writes nothing else."""
    from znni_core.layers.winograd import _bt_rows

    rng = np.random.default_rng(a)
    L, ds, vs, nb, dstep, vstep = 5, 23, 31, 4, 6, 7  # runs overlap in the input, not in the output
    d = rng.standard_normal(3 + a * ds + nb * dstep).astype(np.float32)
    got = np.full(2 + a * vs + nb * vstep, -7.0, np.float32)
    want = got.astype(np.float64)
    BT = toom_cook(a, 2)[0] if a > 1 else np.ones((1, 1))
    for b in range(nb):
        rows = np.array([d[3 + b * dstep + k * ds :][:L] for k in range(a)], np.float64)
        for k, row in enumerate(BT @ rows):
            want[2 + b * vstep + k * vs :][:L] = row
    _bt_rows(a, d, 3, ds, dstep, got, 2, vs, vstep, L, nb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 3),
    ci=st.integers(1, 5),
    co=st.integers(1, 5),
    kernel=st.tuples(*[st.sampled_from(sizes) for sizes in KERNEL_SIZES]).filter(lambda k: max(k) > 1),
    extra=st.tuples(*[st.sampled_from([0, 1, 2, 3, 5, 8, 13])] * 3),
    bias=st.booleans(),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    low=st.tuples(*[st.integers(0, 2)] * 3),
    high=st.tuples(*[st.integers(0, 2)] * 3),
)
def test_winograd_equals_scipy_correlate(n, ci, co, kernel, extra, bias, threads, seed, low, high):
    """Every tiling edge case: outputs of 1..14 per axis (partial last tiles), single channels,
    more workers than channels; the CPU path and the xp (GPU) path; zero padding read in place
    (``low``: where the unpadded input starts), from a channels-first or a channels-last input,
    equals convolving a padded copy."""
    rng = np.random.default_rng(seed)
    shape = tuple(k + e for k, e in zip(kernel, extra))
    x = rng.standard_normal((n, ci) + shape).astype(np.float32)
    w = rng.standard_normal((co, ci) + kernel).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32) if bias else None
    ref = reference(x, w, b)
    conv = WinogradConv(w, b, shape, threads=threads)
    assert rel_err(conv(x), ref) <= TOL
    with tuning.using({"winograd.blas": 1}):  # the products on BLAS, as a host's calibration may choose
        assert rel_err(conv(x), ref) <= TOL
    assert rel_err(conv._call_xp(x, (0, 0, 0)), ref) <= TOL
    inner = tuple(max(1, s - lo - hi) for s, lo, hi in zip(shape, low, high))
    low = tuple(min(lo, s - e) for lo, s, e in zip(low, shape, inner))
    part = x[(slice(None), slice(None)) + tuple(slice(lo, lo + e) for lo, e in zip(low, inner))]
    padded = np.zeros_like(x)
    padded[(slice(None), slice(None)) + tuple(slice(lo, lo + e) for lo, e in zip(low, inner))] = part
    ref = reference(padded, w, b)
    assert rel_err(conv(np.ascontiguousarray(part), low=low), ref) <= TOL
    assert rel_err(conv(_channels_last(part), low=low), ref) <= TOL  # rows read in place, edges padded
    assert rel_err(conv._call_xp(part, low), ref) <= TOL


@pytest.mark.parametrize(
    "shape,kernel,c",
    [
        ((9, 70, 69), (1, 3, 3), (24, 40)),
        ((11, 21, 18), (3, 3, 3), (16, 8)),
        ((6, 9, 30), (3, 1, 3), (5, 7)),
        ((5, 61, 47), (1, 5, 5), (24, 24)),
        ((7, 40, 33), (1, 4, 4), (32, 20)),
        ((9, 26, 30), (2, 5, 4), (12, 10)),
        ((12, 30, 28), (5, 5, 5), (16, 16)),  # 8 points in z too where large tiles are on
    ],
)
@pytest.mark.parametrize("gain,blas,wide", [(0.0, 0, 0), (1.0, 0, 0), (1.0, 0, 1), (1.0, 1, 0)])
def test_winograd_equals_torch_conv3d_on_wide_layers(shape, kernel, c, gain, blas, wide):
    """Many channels, several blocks of tile rows (a small block size), trained-like weights; 6-point
    tiles only (``gain`` 0) and 8-point tiles where they need no more positions (1), the products on
    znni's register tiles (the narrow or the wide rule) or on BLAS: the values a host's calibration
    chooses between (``layers/tuning.py``)."""
    import znni_core.layers.winograd as W

    values = {"winograd.block_bytes": 64 * 2**10, "winograd.large_tile_gain": gain, "winograd.blas": blas}
    with tuning.using({**values, "winograd.wide_tiles": wide}):
        points = _check_wide_winograd(W, shape, kernel, c)
    assert gain or 8 not in points


def test_wide_register_tiles_give_the_same_values():
    """``winograd.wide_tiles`` changes how the products are blocked (16-float tiles padded), never
    a value's sum: the layer's output is bit for bit the narrow rule's, and its memory prediction
    follows the padded columns."""
    import znni_core.layers.winograd as W

    rng = np.random.default_rng(7)
    w, b = rng.standard_normal((36, 20, 1, 3, 3)).astype(np.float32), rng.standard_normal(36).astype(np.float32)
    x = rng.standard_normal((1, 20, 5, 30, 29)).astype(np.float32)
    outs, tiles, ldm = [], [], []
    for wide in (0, 1):
        with tuning.using({"winograd.wide_tiles": wide, "winograd.blas": 0}):
            conv = W.WinogradConv(w, b, x.shape[2:])
            outs.append(conv(x))
            tiles.append(conv.register_tile)
            ldm.append(conv.U.shape[2])
            assert W.winograd_kernel_bytes(20, 36, (1, 3, 3), x.shape[2:]) == conv.U.nbytes
    np.testing.assert_array_equal(outs[0], outs[1])
    assert ldm[1] >= ldm[0] >= 36 and all(u % (t[1] * t[2]) == 0 for u, t in zip(ldm, tiles))


def test_z_tiles_deepen_only_for_kernels_four_and_five_deep():
    """In z a kernel 2-3 deep keeps 4-point tiles whatever the gain (deeper ones lost precision);
    4-5 deep takes 8 points where they need no more transform positions than 6, as y and x do."""
    with tuning.using({"winograd.large_tile_gain": 1.0}):
        assert winograd_tiles((18, 64, 64), (3, 3, 3))[1] == (4, 8, 8)
        assert winograd_tiles((16, 64, 64), (2, 3, 3))[1] == (4, 8, 8)
        assert winograd_tiles((8, 64, 64), (5, 5, 5))[:2] == ((4, 4, 4), (8, 8, 8))
        assert winograd_tiles((9, 64, 64), (4, 4, 4))[1] == (8, 8, 8)
        assert winograd_tiles((2, 64, 64), (5, 5, 5))[1][0] == 6  # one tile of 6 points, not of 8
    with tuning.using({"winograd.large_tile_gain": 0.0}):
        assert winograd_tiles((8, 64, 64), (5, 5, 5))[1] == (6, 6, 6)


def _check_wide_winograd(W, shape, kernel, c):
    ci, co = c
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, ci) + shape).astype(np.float32)
    w = (rng.standard_normal((co, ci) + kernel) * np.sqrt(2 / (ci * np.prod(kernel)))).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32)
    ref = torch.nn.functional.conv3d(
        torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double()
    ).numpy()
    conv = WinogradConv(w, b, shape, threads=2)
    rows = 2 * conv.nt[0] * conv.nt[1]
    assert len(range(0, rows, W._blocks(rows, conv.nt[2], conv.T, ci, co, 2)[0])) > 2
    assert rel_err(conv(x), ref) <= TOL
    return W.winograd_tiles(ref.shape[2:], kernel)[1]


@pytest.mark.parametrize(
    "co, act", [(4, None), (19, None), (19, ("relu", 0.0)), (19, ("leaky_relu", 0.1)), (19, ("elu", 1.0))]
)
def test_winograd_writes_into_a_strided_destination_and_reuses_buffers(co, act):
    """A channels-first block of a larger array gets exactly its block, twice from kept buffers;
    19 channels with a bias and every fused activation (added and applied on the staged rows
    before each channel's row goes out).  A float64 destination is refused, naming the dtype."""
    from znni_core.layers.activation import apply_activation

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5, 12, 40)).astype(np.float32)
    w = rng.standard_normal((co, 3, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32) if co > 4 else None
    ref = reference(x, w, b)
    if act is not None:
        ref = apply_activation(ref.astype(np.float32), *act)
    big = np.full((2, co + 3, 7, 14, 42), 7.0, np.float32)
    dst = big[:, 2 : 2 + co, 1:6, 2:12, 3:41]
    conv = WinogradConv(w, b, x.shape[2:], threads=2)
    conv.keep_buffers = True
    conv.act = act
    with pytest.raises(InputError, match="float64"):
        conv(x, out=np.zeros(dst.shape))
    for _ in range(2):  # the kept block buffers serve the second call
        assert conv(x, out=dst) is dst
        assert rel_err(np.ascontiguousarray(dst), ref) <= TOL
    conv.release()
    mask = np.ones(big.shape, bool)
    mask[:, 2 : 2 + co, 1:6, 2:12, 3:41] = False
    assert (big[mask] == 7.0).all()  # nothing written outside the destination


def test_winograd_block_buffers_start_apart_within_a_page():
    """Each pass reads one of a worker's buffers and writes another, points a multiple of 4 KiB
    apart: the six start at six offsets within a page, a cache line or more apart, so no read
    stream shares its low address bits with a write stream's."""
    w = np.ones((24, 24, 3, 3, 3), np.float32)
    conv = WinogradConv(w, None, (10, 40, 40), threads=2)
    _, sets, _, _ = conv._buffers(1, False)
    for V, M, scratch in sets:
        starts = sorted(a.ctypes.data % 4096 for a in (V, M, *scratch))
        assert len(starts) == 6 and all(b - a >= 64 for a, b in zip(starts, starts[1:]))
        assert not V.any()  # rows past a block's tiles are read: zeros, not garbage


def test_winograd_refuses_what_it_cannot_run():
    w = np.ones((2, 2, 6, 5, 3), np.float32)
    with pytest.raises(InputError, match="1-5 on every axis"):
        WinogradConv(w, None, (8, 8, 8))
    assert not winograd_supports((1, 1, 1)) and not winograd_supports((1, 6, 6)) and not winograd_supports((7, 3, 3))
    assert winograd_supports((3, 1, 1)) and winograd_supports((2, 3, 3)) and winograd_supports((1, 5, 4))
    assert winograd_supports((5, 5, 5)) and winograd_supports((4, 4, 4))
    conv = WinogradConv(np.ones((2, 2, 1, 3, 3), np.float32), None, (4, 8, 8))
    with pytest.raises(InputError, match="expected"):
        conv(np.ones((1, 2, 4, 8, 9), np.float32))
    with pytest.raises(InputError, match="expected"):  # does not fit at that offset
        conv(np.ones((1, 2, 4, 7, 7), np.float32), low=(0, 2, 0))
    from znni_core.layers import FFTGemmConv

    with pytest.raises(InputError, match="no implicit padding"):
        FFTGemmConv(np.ones((2, 2, 1, 3, 3), np.float32), None, (4, 8, 8))(
            np.ones((1, 2, 4, 6, 6), np.float32), low=(0, 1, 1)
        )
    with pytest.raises(InputError, match="bias"):
        WinogradConv(np.ones((2, 2, 1, 3, 3), np.float32), np.ones(3, np.float32), (4, 8, 8))
    with pytest.raises(InputError, match="does not fit"):
        WinogradConv(np.ones((2, 2, 3, 3, 3), np.float32), None, (2, 8, 8))


@pytest.mark.parametrize(
    "n,ci,co,shape,kernel",
    [
        (1, 16, 16, (8, 96, 96), (1, 3, 3)),  # wide planes: several blocks of tile rows
        (64, 12, 40, (6, 13, 13), (1, 3, 3)),  # many small planes, more outputs than inputs
        (1, 8, 8, (48, 64, 64), (3, 3, 3)),  # 3D tiles
        (16, 24, 24, (6, 30, 30), (1, 4, 4)),  # F(3,4) on MPF-like planes
        (2, 16, 16, (6, 80, 80), (1, 5, 5)),  # F(2,5)
    ],
)
def test_winograd_memory_including_the_kernel_transform(n, ci, co, shape, kernel):
    x, w = data(n, ci, shape), data(co, ci, kernel, 1)
    WinogradConv(w, None, shape, threads=2)(x)  # numba kernels loaded

    def run():
        conv = WinogradConv(w, np.ones(co, np.float32), shape, threads=2)
        return conv, conv(x)

    check(
        L.winograd_memory(n, ci, co, shape, kernel, threads=2) + L.winograd_kernel_bytes(ci, co, kernel, shape),
        measured_peak(run),
    )


NET_3 = [
    ("conv", 6, (1, 3, 3)),
    ("act", "relu"),
    ("pool", (1, 2, 2)),
    ("conv", 8, 3),
    ("act", "elu", 0.5),
    ("pool", 2),
    ("conv", 5, (3, 1, 3)),
    ("act", "relu"),
    ("conv", 2, 1),
    ("act", "sigmoid"),
]


def test_winograd_in_plans_every_pool_mode_equals_torch():
    """Forced on every layer the planner offers it for (the first layer has one input channel and
    the last is 1x1x1: both fall back to direct-gemm), through MPF, depth-first pooling and
    slabs.  (A single channel's correctness: test_winograd_equals_scipy_correlate.)"""
    net = make_net(NET_3, seed=3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1,) + tuple(f + e for f, e in zip(net.field_of_view, (4, 10, 6)))).astype(np.float32)
    ref = torch_dense(net, x)
    for modes in itertools.product(("mpf", "pool"), repeat=2):
        plan = autotune(net, memory_budget=2**30, primitives=("winograd",), pool_modes=modes, use_cache=False)
        prims = [s.primitive for s in plan.steps if s.op == "conv"]
        assert prims == ["direct-gemm", "winograd", "winograd", "direct-gemm"], prims
        assert max_rel_err(znni_core.infer(net, x, plan=plan), ref) <= TOL, modes


def test_planner_offers_winograd_only_where_it_runs():
    assert primitive("winograd").supports((1, 3, 3)) and primitive("winograd").supports((1, 4, 4))
    assert not primitive("winograd").supports((1, 7, 7)) and primitive("fft-gemm").supports((1, 7, 7))
    # one channel on a side: outer products, transform-bound (the boundary net's 1 -> 48 layer: 4x direct-numba)
    assert not primitive("winograd").supports((1, 3, 3), (1, 48))
    assert not primitive("winograd").supports((3, 3, 3), (28, 1))
    assert primitive("winograd").supports((3, 3, 3), (24, 3)) and primitive("direct-numba").supports((1, 5, 5), (1, 28))
    net = make_net([("conv", 4, (1, 7, 7)), ("act", "relu"), ("conv", 4, (1, 3, 3))], seed=1)
    plan = autotune(net, memory_budget=2**30, input_shape=(3, 30, 30), primitives=("winograd",), use_cache=False)
    assert [s.primitive for s in plan.steps if s.op == "conv"] == ["direct-gemm", "winograd"]


@pytest.mark.parametrize("valid", [True, False])
def test_winograd_in_unet_graph_plans_equals_torch(tmp_path, valid):
    """The graph planner runs U-Nets' 3^3 and (1,3,3) convolutions with winograd (the
    executor's output blocks and padded convolutions included)."""
    pytest.importorskip("onnx")
    from .unets import UNet, admissible, export, run

    torch.manual_seed(3)
    for kernel in ((3, 3, 3), (1, 3, 3)):
        model = UNet(valid=valid, depth=2, kernel=kernel, pool=(1, 2, 2), width=6, bn=False)
        shape = tuple(admissible(model, a, lo) for a, lo in enumerate((10, 40, 40)))
        net = znni_core.load_network(export(model, tmp_path / f"u{valid}{kernel[0]}.onnx", shape))
        plan = autotune(net, memory_budget=2**30, patch_shape=shape, primitives=("winograd",), use_cache=False)
        assert "winograd" in {s.primitive for s in plan.steps}
        x = np.random.default_rng(5).standard_normal((1,) + shape).astype(np.float32)
        out = znni_core.infer(net, x, plan=plan)
        np.testing.assert_allclose(out, run(model, x), rtol=1e-4, atol=1e-5)


def _channels_last(a):
    from znni_core.layers.layout import memory_order

    return np.ascontiguousarray(memory_order(a)).transpose(0, 4, 1, 2, 3)


@pytest.mark.parametrize("kernel", [(1, 3, 3), (3, 3, 3), (1, 5, 5), (2, 1, 4)])
@pytest.mark.parametrize("co", [7, 19])
def test_winograd_reads_and_writes_channels_last_as_channels_first(kernel, co):
    """A channels-last input (``layers/layout``) reads as its channels-first self, zero padding
    included; ``channels_last`` makes the output channels last (ELU applied); a strided
    channels-last destination gets only its block.  Against the float64 reference.  19 output
    channels: a voxel's values copied a vector at a time, the last vector overlapping."""
    from znni_core.layers.activation import apply_activation
    from znni_core.layers.layout import is_channels_last

    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 5, 6, 13, 11)).astype(np.float32)
    w = rng.standard_normal((co, 5) + kernel).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32)
    low = tuple(k // 2 for k in kernel)
    spatial = tuple(n + k - 1 for n, k in zip(x.shape[2:], kernel))  # "same" output
    xpad = np.zeros(x.shape[:2] + spatial, np.float32)
    xpad[(slice(None), slice(None)) + tuple(slice(lo, lo + n) for lo, n in zip(low, x.shape[2:]))] = x
    ref = apply_activation(reference(xpad, w, b).astype(np.float32), "elu", 1.0)
    conv = WinogradConv(w, b, spatial, threads=2)
    conv.act = ("elu", 1.0)
    xc = _channels_last(x)
    for src in (x, xc):
        for cl in (False, True):
            conv.channels_last = cl
            y = conv(src, low=low)
            assert is_channels_last(y) == cl
            assert rel_err(y, ref) <= TOL
    big = _channels_last(np.full((2, co, 8, 15, 13), 5.0, np.float32))
    dst = big[:, :, 1:7, 1:14, 2:13]
    conv.channels_last = False  # the destination decides
    assert conv(xc, out=dst, low=low) is dst and rel_err(np.ascontiguousarray(dst), ref) <= TOL
    mask = np.ones(big.shape, bool)
    mask[:, :, 1:7, 1:14, 2:13] = False
    assert (big[mask] == 5.0).all()
