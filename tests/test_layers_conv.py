"""Every convolution path equals scipy.signal.correlate (valid) and torch conv3d."""

import numpy as np
import pytest
import scipy.signal
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from znni_core.errors import InputError
from znni_core.layers import (
    FFTConv,
    FFTGemmConv,
    WinogradConv,
    conv_direct_gemm,
    conv_direct_gemm_memory,
    conv_direct_numba,
    fft_conv,
    fft_shape,
    fft_size,
    pruned_rfftn,
    winograd_supports,
)
from znni_core.layers.direct import _gemm_blocks
from znni_core.layers.fft import _fft_conv_xp
from znni_core.layers.layout import is_channels_last

TOL = 1e-4  # max abs error / max |reference|, float32


def reference(x, w, b):
    """Float64 scipy correlate, summed over input channels."""
    n, ci = x.shape[:2]
    out = []
    for i in range(n):
        chans = []
        for o in range(w.shape[0]):
            acc = sum(
                scipy.signal.correlate(x[i, c].astype(np.float64), w[o, c].astype(np.float64), mode="valid")
                for c in range(ci)
            )
            chans.append(acc + (0.0 if b is None else float(b[o])))
        out.append(chans)
    return np.array(out)


def rel_err(y, ref):
    assert y.shape == ref.shape and y.dtype == np.float32
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))


def all_paths(x, w, b, threads=2):
    yield "gemm", conv_direct_gemm(x, w, b)
    # a tiny budget forces row and column blocks
    k = w.shape[1] * int(np.prod(w.shape[2:]))
    yield "gemm-cols", conv_direct_gemm(x, w, b, max_bytes=4 * (k + w.shape[0]) * 2)
    yield "numba", conv_direct_numba(x, w, b)
    cl = conv_direct_numba(x, w, b, channels_last=True)
    assert is_channels_last(cl) or w.shape[0] == 1
    yield "numba-channels-last", cl
    for mode in ("data", "task", "stream"):
        yield f"fft-{mode}", FFTConv(w, b, x.shape[2:], mode=mode, threads=threads, effort="estimate")(x)
    khat = np.conj(np.fft.rfftn(w, s=fft_shape(x.shape[2:]), axes=(2, 3, 4))).reshape(w.shape[0], w.shape[1], -1)
    gemm = FFTGemmConv(w, b, x.shape[2:], threads=threads)
    yield "fft-gemm", gemm(x)
    yield "fft-gemm-xp", gemm._call_xp(x, (0, 0, 0))  # the GPU's code path, on numpy
    if winograd_supports(w.shape[2:]):
        yield "winograd", WinogradConv(w, b, x.shape[2:], threads=threads)(x)
    yield (
        "fft-xp",
        _fft_conv_xp(x, khat, b, fft_shape(x.shape[2:]), tuple(n - q + 1 for n, q in zip(x.shape[2:], w.shape[2:]))),
    )


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 2),
    ci=st.integers(1, 3),
    co=st.integers(1, 3),
    kernel=st.tuples(*[st.integers(1, 4)] * 3),
    extra=st.tuples(*[st.sampled_from([0, 1, 2, 4, 6, 8])] * 3),
    bias=st.booleans(),
    threads=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_all_paths_equal_scipy_correlate(n, ci, co, kernel, extra, bias, threads, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(k + e for k, e in zip(kernel, extra))  # odd, even and prime sizes
    x = rng.standard_normal((n, ci) + shape).astype(np.float32)
    w = rng.standard_normal((co, ci) + kernel).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32) if bias else None
    ref = reference(x, w, b)
    for name, y in all_paths(x, w, b, threads):
        assert rel_err(y, ref) <= TOL, name


@pytest.mark.parametrize(
    "shape,kernel", [((13, 17, 11), (2, 4, 1)), ((20, 9, 16), (3, 3, 3)), ((7, 23, 12), (5, 1, 4))]
)
def test_all_paths_equal_torch_conv3d(shape, kernel):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4) + shape).astype(np.float32)
    w = rng.standard_normal((5, 4) + kernel).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    ref = torch.nn.functional.conv3d(
        torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double()
    ).numpy()
    for name, y in all_paths(x, w, b):
        assert rel_err(y, ref) <= TOL, name


@pytest.mark.parametrize("kernel", [(1, 1, 3), (2, 3, 4), (3, 2, 5), (1, 5, 5), (2, 2, 2)])
def test_numba_written_out_taps_equal_torch_conv3d(kernel):
    """direct-numba sums a row's 3, 4 or 5 taps in registers for each block of 4 output
    channels (9 here: two blocks and a remainder, zero-padded, its real channels stored), 1 and 2
    input channels, a fused ReLU."""
    rng = np.random.default_rng(sum(kernel))
    for ci in (1, 2):
        x = rng.standard_normal((2, ci, 9, 11, 19)).astype(np.float32)
        w = rng.standard_normal((9, ci) + kernel).astype(np.float32)
        b = rng.standard_normal(9).astype(np.float32)
        ref = (
            torch.nn.functional.conv3d(
                torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double()
            )
            .clamp(min=0)
            .numpy()
        )
        assert rel_err(conv_direct_numba(x, w, b, act=("relu", 0.0)), ref) <= TOL, ci


@pytest.mark.parametrize("group", [1, 2, 3, 7, 100])
def test_numba_grouped_rows_equal_torch_conv3d(monkeypatch, group):
    """Short output rows run ``group`` at a time as one row with gaps (the last group partial when
    7 rows do not divide), 3 output channels (one partial block), kernels taking each path."""
    import znni_core.layers.direct as D
    from znni_core.layers import tuning

    x_width = 10
    monkeypatch.setitem(tuning._VALUES, "direct.row_group", group * x_width)
    rng = np.random.default_rng(group)
    for kernel in ((3, 3, 3), (1, 4, 4), (2, 1, 5), (1, 2, 2)):
        x = rng.standard_normal((3, 2, 5, 6 + kernel[1], x_width)).astype(np.float32)
        w = rng.standard_normal((3, 2) + kernel).astype(np.float32)
        b = rng.standard_normal(3).astype(np.float32)
        assert D._row_group(x.shape[2:], kernel)[0] == min(group, 7)
        ref = (
            torch.nn.functional.conv3d(
                torch.from_numpy(x).double(), torch.from_numpy(w).double(), torch.from_numpy(b).double()
            )
            .clamp(min=0)
            .numpy()
        )
        assert rel_err(conv_direct_numba(x, w, b, act=("relu", 0.0)), ref) <= TOL, kernel
        cl = conv_direct_numba(x, w, b, act=("relu", 0.0), channels_last=True)
        assert is_channels_last(cl) and rel_err(cl, ref) <= TOL, kernel


ACTIVATIONS = {
    None: lambda r: r,
    ("relu", 0.0): lambda r: np.maximum(r, 0.0),
    ("leaky_relu", 0.1): lambda r: np.where(r > 0, r, 0.1 * r),
    ("elu", 1.0): lambda r: np.where(r > 0, r, np.expm1(np.minimum(r, 0.0))),
}


def _torch_case(rng, n, ci, co, kernel, spatial, act):
    """``(x, x channels last, w, b, reference)``: a random layer and its float64 torch output with
    the activation ``act``."""
    x = rng.standard_normal((n, ci) + spatial).astype(np.float32)
    w = rng.standard_normal((co, ci) + kernel).astype(np.float32)
    b = rng.standard_normal(co).astype(np.float32)
    t = [torch.from_numpy(a).double() for a in (x, w, b)]
    ref = ACTIVATIONS[act](torch.nn.functional.conv3d(*t).numpy())
    return x, np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3), w, b, ref


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_numba_register_tiles_equal_torch_conv3d(act):
    """Output rows of a register tile or more (one tile, a tile and a few values: the last tile
    shifted back over the first; several) run on tiles: blocks of 4 output channels and lone
    ones (1, 3, 5, 9, 24 channels), every kernel row length, inputs and outputs channels first and
    last (a channels-last output written 8 x 8 values at a time, the channels past them one by
    one), each fused activation, equal to float64 torch; and equal to the grouped rows' loop."""
    import znni_core.layers.direct as D

    W = D.TILE_WIDTH
    rng = np.random.default_rng(7)
    cases = (
        (1, 1, 5, (1, 5, 5), (2, 6, W + 4)),
        (2, 6, 1, (1, 5, 5), (1, 7, 2 * W + 7)),
        (1, 3, 9, (3, 3, 3), (4, 4, W + 2)),
        (1, 8, 4, (2, 2, 2), (3, 3, W + 1)),
        (1, 2, 3, (1, 1, 4), (2, 3, 3 * W + 3)),
        (3, 4, 6, (1, 2, 1), (2, 3, W)),
        (1, 1, 24, (1, 3, 3), (2, 4, W + 5)),  # channels last: three whole 8 x 8 transposes a tile
    )
    for n, ci, co, kernel, spatial in cases:
        assert D.direct_numba_tiles(spatial, kernel)
        x, x_cl, w, b, ref = _torch_case(rng, n, ci, co, kernel, spatial, act)
        for xin in (x, x_cl):
            for cl in (False, True):
                y = conv_direct_numba(xin, w, b, act=act, channels_last=cl)
                assert is_channels_last(y) == (cl and co > 1) and rel_err(y, ref) <= TOL, (kernel, co, cl)
        rows = conv_direct_numba(x, w, b, act=act, tiles=False)
        assert rel_err(rows, ref) <= TOL, (kernel, co)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_numba_reads_a_channels_last_input_in_place_for_few_output_channels(act):
    """A channels-last input and up to 4 output channels run on tiles of voxels with their input
    channels as whole vectors (``microkernel.fma_channels``: one to four vectors a voxel, the last
    overlapping the one before, 1-5 taps along x, the last tile of a row shifted back; in AVX2
    code tiles of one vector a voxel, the rest as below), equal to float64 torch; the others (5
    output channels, fewer input channels than a vector, a row shorter than a tile) take the
    channels-first tiles, and so does a channels-first input."""
    import znni_core.layers.direct as D
    from znni_core.layers.microkernel import VL

    rng = np.random.default_rng(11)
    cases = (  # (n, C_in, C_out, kernel, spatial)
        (1, VL, 1, (1, 3, 3), (2, 5, 15)),
        (2, VL + 12, 1, (1, 5, 5), (2, 7, 21)),  # the synapse detector's 28 -> 1 (1,5,5), AVX-512
        (1, 2 * VL + 3, 3, (3, 3, 3), (4, 5, 19)),
        (1, 4 * VL, 4, (2, 2, 1), (3, 4, 17)),
        (1, 3 * VL - 1, 2, (1, 2, 2), (2, 3, 40)),
        (1, VL + 1, 2, (1, 1, 1), (2, 2, 30)),
    )
    in_place = [D.reads_channels_last(ci, co, spatial, kernel) for _, ci, co, kernel, spatial in cases]
    assert in_place[0] and (VL == 8 or all(in_place)), in_place  # AVX2's 16 registers: one vector a voxel
    for n, ci, co, kernel, spatial in cases:
        x, x_cl, w, b, ref = _torch_case(rng, n, ci, co, kernel, spatial, act)
        for cl in (False, True):
            y = conv_direct_numba(x_cl, w, b, act=act, channels_last=cl)
            assert is_channels_last(y) == (cl and co > 1) and rel_err(y, ref) <= TOL, (ci, co, kernel, cl)
    assert not D.reads_channels_last(28, 5, (2, 7, 40), (1, 5, 5))  # more output channels than 4
    assert not D.reads_channels_last(VL - 1, 1, (2, 7, 40), (1, 3, 3))  # fewer input channels than a vector
    assert not D.reads_channels_last(4 * VL + 1, 1, (2, 7, 40), (1, 3, 3))  # five vectors a voxel
    assert not D.reads_channels_last(28, 1, (2, 7, 40), (1, 3, 7))  # 7 taps along x
    assert not D.reads_channels_last(VL, 1, (2, 7, 5), (1, 3, 3))  # a row shorter than a tile


def test_numba_register_tiles_priced_by_their_own_efficiency():
    """The model's efficiency of a layer on tiles: whole tiles and blocks of 4 channels run at the
    full rate; a row a tile and a bit long recomputes most of a tile; a lone channel runs at
    ``LONE_CHANNEL`` of a block's rate per channel; rows shorter than a tile take the rows' loop,
    and asking for tiles on them is a clear error (a tile would reach past the arrays)."""
    import znni_core.layers.direct as D

    W = D.TILE_WIDTH
    assert D.direct_numba_efficiency(24, (3, 3, 2 * W + 2), (3, 3, 3)) == 1.0
    assert D.direct_numba_efficiency(24, (3, 3, W + 3), (3, 3, 3)) == pytest.approx((W + 1) / (2 * W))
    assert D.direct_numba_efficiency(1, (3, 3, W + 2), (3, 3, 3)) == pytest.approx(D.LONE_CHANNEL)
    assert D.direct_numba_efficiency(5, (3, 3, W + 2), (3, 3, 3)) == pytest.approx(5 / (4 + 1 / D.LONE_CHANNEL))
    assert not D.direct_numba_tiles((3, 3, W + 1), (3, 3, 3)) and D.direct_numba_tiles((3, 3, W + 2), (3, 3, 3))
    x = np.zeros((1, 1, 3, 3, W + 1), np.float32)  # rows one value short of a tile
    with pytest.raises(InputError, match="shorter than a register tile"):
        conv_direct_numba(x, np.zeros((2, 1, 3, 3, 3), np.float32), tiles=True)


@pytest.mark.parametrize("target", [1, 3_000, 20_000, 60_000, 10**9])
def test_gemm_every_block_geometry(monkeypatch, target):
    """Small block targets force multi-plane blocks with a short last one, row blocks
    with a short last one, and column blocks."""
    import znni_core.layers.direct as D

    monkeypatch.setattr(D, "_BLOCK_TARGET", target)
    rng = np.random.default_rng(target)
    x = rng.standard_normal((2, 3, 12, 9, 7)).astype(np.float32)
    w = rng.standard_normal((2, 3, 2, 3, 2)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    ref = reference(x, w, b)
    for mb in (None, 4 * (3 * 12 + 2) * 3):
        assert rel_err(conv_direct_gemm(x, w, b, max_bytes=mb), ref) <= TOL


def test_gemm_blocks_respect_max_bytes():
    # one plane of lowered 16 x 27 channels at 40 x 40 is 0.7 MiB; whole planes fit 8 MiB
    assert _gemm_blocks((40, 40, 40), (3, 3, 3), 16, 16, None)[1:] == (40, 40)
    tz, ty, tw = _gemm_blocks((40, 40, 40), (3, 3, 3), 16, 16, 100_000)
    assert tz == 1 and tw == 40 and 4 * (16 * 27 + 16) * ty * tw <= 100_000
    tz, ty, tw = _gemm_blocks((40, 40, 40), (3, 3, 3), 16, 16, 10_000)
    assert (tz, ty) == (1, 1) and 4 * (16 * 27 + 16) * tw <= 10_000
    with pytest.raises(InputError, match="max_bytes"):
        _gemm_blocks((40, 40, 40), (3, 3, 3), 16, 16, 100)


def test_gemm_out_argument_and_validation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6, 6, 6)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 3, 3)).astype(np.float32)
    out = np.full((1, 3, 4, 4, 4), np.nan, np.float32)
    assert conv_direct_gemm(x, w, out=out) is out
    assert rel_err(out, reference(x, w, None)) <= TOL
    with pytest.raises(InputError, match="input channels"):
        conv_direct_gemm(x, w[:, :1])
    with pytest.raises(InputError, match="larger"):
        conv_direct_numba(x, np.zeros((1, 2, 7, 1, 1), np.float32))
    with pytest.raises(InputError, match="bias"):
        fft_conv(x, w, np.zeros(2, np.float32), effort="estimate")


def test_fftconv_reuses_kernel_spectra_across_calls_and_batches():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 3, 3, 2, 4)).astype(np.float32)
    conv = FFTConv(w, None, (9, 8, 10), effort="estimate")
    khat = conv.khat.copy()
    for n in (1, 4):
        x = rng.standard_normal((n, 3, 9, 8, 10)).astype(np.float32)
        assert rel_err(conv(x), reference(x, w, None)) <= TOL
    np.testing.assert_array_equal(conv.khat, khat)
    with pytest.raises(InputError, match="expected"):
        conv(rng.standard_normal((1, 3, 9, 8, 11)).astype(np.float32))


@pytest.mark.parametrize("extent,fshape", [((5, 5, 5), (64, 64, 64)), ((2, 4, 1), (9, 10, 7)), ((7, 3, 6), (7, 3, 6))])
def test_pruned_rfftn_equals_full_rfftn_of_padded(extent, fshape):
    a = np.random.default_rng(0).standard_normal((3, 2) + extent).astype(np.float32)
    full = np.fft.rfftn(a.astype(np.float64), s=fshape, axes=(-3, -2, -1))
    got = pruned_rfftn(a, fshape, threads=2)
    assert got.shape == full.shape
    assert np.abs(got - full).max() <= 1e-5 * np.abs(full).max()


def test_fft_size():
    assert [fft_size(n) for n in (1, 7, 11, 13, 17, 97, 121, 128)] == [1, 7, 12, 14, 18, 98, 125, 128]
    for n in range(1, 300):
        m = fft_size(n)
        r = m
        for p in (2, 3, 5, 7):
            while r % p == 0:
                r //= p
        assert r == 1 and m >= n
        # and no smaller smooth size was skipped
        for k in range(n, m):
            r = k
            for p in (2, 3, 5, 7):
                while r % p == 0:
                    r //= p
            assert r != 1
    assert fft_shape((11, 13, 97)) == (12, 14, 98)


def test_gemm_1x1x1_is_one_product_per_item_into_any_destination():
    """The 1x1x1 fast path (no lowering) into a contiguous and into a strided ``out``."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 4, 6, 7)).astype(np.float32)
    w = rng.standard_normal((3, 5, 1, 1, 1)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    ref = reference(x, w, b)
    assert rel_err(conv_direct_gemm(x, w, b), ref) <= TOL
    big = np.full((2, 3, 4, 6, 9), np.nan, np.float32)
    conv_direct_gemm(x, w, b, out=big[..., 1:8])
    assert rel_err(big[..., 1:8], ref) <= TOL and np.isnan(big[..., 0]).all()
    assert conv_direct_gemm_memory(2, 5, 3, (4, 6, 7), (1, 1, 1)) == 4 * ref.size  # the output only


@pytest.mark.parametrize("threads,block", [(1, 7), (2, 64), (3, 8192)])
def test_pointwise_chain_equals_torch_layer_by_layer(threads, block):
    """1x1x1 convs chained block by block in cache (every activation kind, blocks that do not
    divide the volume, several items, a channels-last input and output) equal PyTorch's conv3d
    and activations applied in turn."""
    from znni_core.layers import conv_pointwise_chain

    rng = np.random.default_rng(block)
    x = rng.standard_normal((2, 5, 3, 7, 9)).astype(np.float32)
    widths = [5, 8, 6, 4, 7, 3]
    acts = [("relu", 0.0), ("leaky_relu", 0.1), None, ("elu", 1.0), ("softmax", 0.0)]
    stages = [
        (
            rng.standard_normal((o, i, 1, 1, 1)).astype(np.float32),
            None if k == 2 else rng.standard_normal(o).astype(np.float32),
            a,
        )
        for k, (i, o, a) in enumerate(zip(widths[:-1], widths[1:], acts))
    ]
    t = torch.from_numpy(x).double()
    for w, b, a in stages:
        t = torch.nn.functional.conv3d(
            t, torch.from_numpy(w).double(), None if b is None else torch.from_numpy(b).double()
        )
        if a is not None:
            t = {
                "relu": torch.relu,
                "leaky_relu": lambda v: torch.nn.functional.leaky_relu(v, 0.1),
                "elu": torch.nn.functional.elu,
                "softmax": lambda v: torch.softmax(v, 1),
            }[a[0]](t)
    y = conv_pointwise_chain(x, stages, threads=threads, block=block)
    assert y.shape == (2, 3, 3, 7, 9) and y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_allclose(y, t.numpy(), rtol=1e-5, atol=1e-5)
    xc = np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)  # channels last: read in place
    yc = conv_pointwise_chain(xc, stages, threads=threads, block=block)
    assert yc.flags.c_contiguous
    np.testing.assert_allclose(yc, t.numpy(), rtol=1e-5, atol=1e-5)
    from znni_core.layers.layout import is_channels_last

    for src in (x, xc):  # written channels last (after the softmax's own pass, and without it)
        for part in (stages, stages[:-1]):
            want = t.numpy() if part is stages else None
            ycl = conv_pointwise_chain(src, part, threads=threads, block=block, channels_last=True)
            assert is_channels_last(ycl) and ycl.shape == (2, part[-1][0].shape[0], 3, 7, 9)
            if want is None:
                want = conv_pointwise_chain(src, part, threads=threads, block=block)
            np.testing.assert_allclose(ycl, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="1x1x1 chain"):
        conv_pointwise_chain(x, [(np.ones((2, 4, 1, 1, 1), np.float32), None, None)])


@pytest.mark.parametrize("channels", [8, 19, 24])
def test_pointwise_chain_moves_channels_last_blocks_in_whole_8x8_transposes_and_the_rest(channels):
    """A channels-last input or output of the 1x1x1 chain is moved 8 x 8 values at a time
    (:func:`~znni_core.layers.transform_vectors.vector_transpose8`), then the voxels and channels
    past whole blocks one at a time: every layout in and out gives the same bytes, blocks of
    voxels that are and are not multiples of 8, widths 8, 19 and 24."""
    from znni_core.layers import conv_pointwise_chain
    from znni_core.layers._numba import njit
    from znni_core.layers.layout import is_channels_last
    from znni_core.layers.transform_vectors import vector_transpose8

    @njit(cache=False)
    def transpose(x, xo, xs, y, yo, ys):
        vector_transpose8(x, xo, xs, y, yo, ys)

    src, dst = np.arange(300, dtype=np.float32), np.full(320, -1.0, np.float32)
    transpose(src, 3, 19, dst, 5, 30)
    block = np.array([[src[3 + i * 19 + j] for j in range(8)] for i in range(8)])
    assert np.array_equal(np.array([[dst[5 + j * 30 + i] for i in range(8)] for j in range(8)]), block.T)
    assert (dst >= 0).sum() == 64  # nothing else written

    rng = np.random.default_rng(channels)
    x = rng.standard_normal((2, channels, 3, 7, 9)).astype(np.float32)  # 189 voxels an item
    xc = np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
    stages = [
        (rng.standard_normal((o, i, 1, 1, 1)).astype(np.float32), None, None)
        for i, o in ((channels, 16), (16, channels))
    ]
    for block in (64, 8192):
        want = conv_pointwise_chain(x, stages, block=block)
        for src in (x, xc):
            assert np.array_equal(conv_pointwise_chain(src, stages, block=block), want)
            got = conv_pointwise_chain(src, stages, block=block, channels_last=True)
            assert is_channels_last(got) and np.array_equal(got, want)
    np.testing.assert_allclose(want, _pointwise_reference(x, stages), rtol=1e-5, atol=1e-5)


def _pointwise_reference(x, stages):
    from znni_core.layers import apply_activation

    ref = x.astype(np.float64)
    for w, b, act in stages:
        ref = np.einsum("oc,nczyx->nozyx", w[:, :, 0, 0, 0].astype(np.float64), ref)
        if b is not None:
            ref += b.reshape(1, -1, 1, 1, 1)
        if act is not None:
            ref = apply_activation(ref, *act)
    return ref


def _wide_chain(seed=4):
    """Widths that use every tile (8, 4, 2 and 1 output channels: 15 = 8 + 4 + 2 + 1), a 200 -> 1
    head, every fused activation and a sigmoid; 2 x 5 x 13 x 17 voxels (not a multiple of a tile)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 5, 13, 17)).astype(np.float32)
    widths = [3, 24, 48, 15, 200, 7, 1]
    acts = [("relu", 0.0), ("leaky_relu", 0.2), ("elu", 0.7), None, ("relu", 0.0), ("sigmoid", 0.0)]
    stages = [
        (
            rng.standard_normal((o, i, 1, 1, 1)).astype(np.float32) / np.sqrt(i),
            rng.standard_normal(o).astype(np.float32),
            a,
        )
        for i, o, a in zip(widths[:-1], widths[1:], acts)
    ]
    return x, stages


@pytest.mark.parametrize("threads,block", [(1, 32), (2, 100), (2, 2048)])
def test_pointwise_chain_tiles_every_run_of_output_channels(threads, block):
    """The register tiles on wide layers: every run of output channels, blocks short of a
    tile, several blocks and items, a read-only input and a channels-last one, against float64
    products."""
    from znni_core.layers import conv_pointwise_chain

    x, stages = _wide_chain()
    ref = _pointwise_reference(x, stages)
    x.setflags(write=False)
    y = conv_pointwise_chain(x, stages, threads=threads, block=block)
    assert y.shape == (2, 1, 5, 13, 17) and y.flags.c_contiguous
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    xc = np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
    yc = conv_pointwise_chain(xc, stages, threads=threads, block=block)
    np.testing.assert_allclose(yc, ref, rtol=1e-5, atol=1e-5)


def test_pointwise_chain_continues_after_an_activation_it_cannot_fuse():
    """A sigmoid mid-chain ends a run of stages (applied to that run's output) and the rest runs
    as a new one."""
    from znni_core.layers import conv_pointwise_chain

    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 5, 3, 11, 13)).astype(np.float32)
    acts = [("relu", 0.0), ("sigmoid", 0.0), ("tanh", 0.0), ("relu", 0.0)]
    widths = [5, 16, 9, 24, 3]
    stages = [
        (rng.standard_normal((o, i, 1, 1, 1)).astype(np.float32), rng.standard_normal(o).astype(np.float32), a)
        for i, o, a in zip(widths[:-1], widths[1:], acts)
    ]
    y = conv_pointwise_chain(x, stages, threads=2, block=64)
    np.testing.assert_allclose(y, _pointwise_reference(x, stages), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shapes",
    [
        ((40, 24), (24, 3000)),
        ((3, 40, 24), (3, 24, 700)),
        ((40, 24), (2, 24, 3000)),
        ((5, 8, 6), (5, 6, 7)),
        ((7, 5), (5, 9)),
    ],
)
def test_run_gemm_splits_over_the_run_threads_with_blas_single_threaded(shapes):
    """Inside a run (``thread_limits``) BLAS is single-threaded (a threaded OpenBLAS call leaves
    its workers spinning into the next step) and ``gemm`` hands each run thread a slab of the
    batch or the columns: equal to ``numpy.matmul``, with or without ``out``, split or not."""
    from threadpoolctl import threadpool_info

    from znni_core.inference import thread_limits
    from znni_core.layers import threads as T

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s, dtype=np.float32) for s in shapes)
    ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    blas = lambda: {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}  # noqa: E731
    before = blas()
    with thread_limits(2):
        assert blas() == {1}
        got = T.gemm(a, b)
        out = np.full(ref.shape, np.nan, np.float32)
        assert T.gemm(a, b, out) is out
    assert blas() == before
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


def test_run_gemm_counts_its_worker_calls(monkeypatch):
    """Two run threads: a wide product runs as two single-threaded calls (the caller's and a
    pooled thread's), a narrow one as one call; outside a run, one call."""
    import threading

    from znni_core.inference import thread_limits
    from znni_core.layers import threads as T

    calls = []
    real = np.matmul

    class Recorder:
        def matmul(self, *args, **kw):
            calls.append((threading.current_thread().name, args[1].shape))
            return real(*args, **kw)

        def __getattr__(self, name):
            return getattr(np, name)

    monkeypatch.setattr(T, "np", Recorder())
    a = np.ones((16, 8), np.float32)
    with thread_limits(2):
        T.gemm(a, np.ones((8, 4 * T.MIN_COLUMNS), np.float32))
        assert sorted(s for _, s in calls) == [(8, 2 * T.MIN_COLUMNS)] * 2
        names = {n for n, _ in calls}  # the caller and one pooled thread
        assert len(names) == 2 and threading.current_thread().name in names
        assert any(n.startswith("znni-worker") for n in names)
        calls.clear()
        T.gemm(a, np.ones((8, 10), np.float32))
        assert [s for _, s in calls] == [(8, 10)]
    calls.clear()
    T.gemm(a, np.ones((8, 4 * T.MIN_COLUMNS), np.float32))
    assert [s for _, s in calls] == [(8, 4 * T.MIN_COLUMNS)]


def test_layer_workers_are_pooled_threads_started_once():
    """Two-worker Winograd, FFT-GEMM and FFT-task layers called again and again start no thread
    after their first call (the workers are the caller and the process's pooled threads)."""
    import threading

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 6, 20, 20)).astype(np.float32)
    w = rng.standard_normal((6, 6, 1, 3, 3)).astype(np.float32)
    ref = reference(x, w, None)
    layers = [
        WinogradConv(w, None, x.shape[2:], threads=2),
        FFTGemmConv(w, None, x.shape[2:], threads=2),
        FFTConv(w, None, x.shape[2:], threads=2, mode="task"),
    ]
    started = []
    real = threading.Thread.start

    def counting(self):
        started.append(self.name)
        return real(self)

    for layer in layers:  # the first calls may start the pool
        np.testing.assert_allclose(layer(x), ref, rtol=1e-4, atol=1e-3)
    threading.Thread.start = counting
    try:
        for _ in range(3):
            for layer in layers:
                np.testing.assert_allclose(layer(x), ref, rtol=1e-4, atol=1e-3)
    finally:
        threading.Thread.start = real
    assert started == []


def test_thread_limits_scan_the_libraries_again_only_after_an_import(tmp_path, monkeypatch):
    """threadpoolctl's scan of the loaded libraries (about 1 ms; every ``infer`` sets limits) runs
    once, and again after an import, which is what loads a new library."""
    import sys

    import threadpoolctl

    from znni_core.layers import threads

    made = []
    real = threadpoolctl.ThreadpoolController
    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", lambda: made.append(1) or real())
    monkeypatch.setattr(threads, "_CONTROLLER", None)
    for _ in range(3):
        with threads.blas_limit(1), threads.openmp_limit(2):
            pass
    assert len(made) == 1
    (tmp_path / "znni_new_module_for_test.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import znni_new_module_for_test  # noqa: F401

    with threads.blas_limit(1):
        pass
    assert len(made) == 2
    sys.modules.pop("znni_new_module_for_test")


def test_openmp_threads_stop_spinning_soon_unless_the_user_chose():
    """numba's OpenMP threads spin briefly after a parallel kernel (``GOMP_SPINCOUNT``), not for
    libgomp's default milliseconds that took the next layer's core; a user's setting wins."""
    import os
    import subprocess
    import sys

    code = "import os, znni_core.layers._numba; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    for extra, expect in (({}, "20000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "None"), ({"GOMP_SPINCOUNT": "5"}, "5")):
        r = subprocess.run(
            [sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True, check=True
        )
        assert r.stdout.strip() == expect, (extra, r.stdout, r.stderr[-500:])


def test_each_worker_runs_every_worker_and_raises_after_all_end():
    import threading
    import time

    from znni_core.layers.threads import each_worker

    seen, done = [], []

    def fn(w):
        seen.append((w, threading.current_thread().name))
        if w == 0:
            raise ValueError("worker 0")
        time.sleep(0.05)  # still running when worker 0 fails: each_worker must wait for it
        done.append(w)

    with pytest.raises(ValueError, match="worker 0"):
        each_worker(fn, 3)
    assert sorted(w for w, _ in seen) == [0, 1, 2] and sorted(done) == [1, 2]
    assert dict(seen)[0] == threading.current_thread().name  # the caller is worker 0

    inner = []  # from a pooled thread, a fan-out runs inline there (no pooled task waits on the pool)

    def outer(w):
        me = threading.current_thread().name
        each_worker(lambda v: inner.append((w, v, me == threading.current_thread().name)), 2)

    each_worker(outer, 2)
    assert sorted(inner) == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True)]


@pytest.mark.parametrize("tasks,workers", [(0, 2), (1, 2), (3, 2), (7, 2), (1000, 2), (9, 1), (50, 3)])
def test_split_tasks_runs_every_task_once(tasks, workers):
    """The compiled kernels' fan-out: ``[0, tasks)`` in contiguous ranges, each task in exactly
    one range, at most RANGES_PER_WORKER ranges a worker, over at most ``workers`` threads."""
    import threading

    from znni_core.layers.threads import RANGES_PER_WORKER, split_tasks

    seen, lock, threads = [], threading.Lock(), set()

    def fn(t0, t1):
        with lock:
            seen.append((t0, t1))
            threads.add(threading.get_ident())

    split_tasks(fn, tasks, workers)
    covered = sorted(t for a, b in seen for t in range(a, b))
    assert covered == list(range(tasks)) and all(a < b for a, b in seen)
    assert len(seen) <= max(1, workers * RANGES_PER_WORKER) and len(threads) <= workers
