"""max_pool, MPF, recombine and the dense max filter against brute-force references."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from znni_core.errors import InputError
from znni_core.layers import (
    conv_direct_gemm,
    fragment_of_filtered,
    max_filter_dense,
    max_filter_inplace,
    max_pool,
    mpf,
    recombine,
)

windows = st.tuples(*[st.integers(1, 3)] * 3)


def brute_max_filter(x, p, d=(1, 1, 1)):
    """Dense max filter by explicit windows (independent of the separable code)."""
    span = tuple((q - 1) * e + 1 for q, e in zip(p, d))
    v = sliding_window_view(x, span, axis=(2, 3, 4))[..., :: d[0], :: d[1], :: d[2]]
    return v.max(axis=(-3, -2, -1))


def test_mpf_1d_by_hand():
    x = np.arange(9, dtype=np.float32).reshape(1, 1, 1, 1, 9) % 5  # 0 1 2 3 4 0 1 2 3
    f = mpf(x, (1, 1, 2))
    assert f.shape == (2, 1, 1, 1, 4)
    assert f[0, 0, 0, 0].tolist() == [1, 3, 4, 2]  # windows [0 1][2 3][4 0][1 2]
    assert f[1, 0, 0, 0].tolist() == [2, 4, 1, 3]  # windows [1 2][3 4][0 1][2 3]
    assert recombine(f, [(1, 1, 2)])[0, 0, 0, 0].tolist() == [1, 2, 3, 4, 4, 1, 2, 3]


def test_max_pool_by_hand_and_shape():
    x = np.arange(2 * 3 * 5 * 4 * 7, dtype=np.float32).reshape(2, 3, 5, 4, 7)
    y = max_pool(x, (2, 2, 3))
    assert y.shape == (2, 3, 2, 2, 2)
    # increasing ramp: the max of a window is its last element
    assert y[1, 2, 1, 0, 1] == x[1, 2, 3, 1, 5]
    with pytest.raises(InputError):
        max_pool(x, (6, 1, 1))


@settings(max_examples=40, deadline=None)
@given(
    p=windows,
    n=st.integers(1, 2),
    c=st.integers(1, 2),
    extra=st.tuples(*[st.integers(0, 5)] * 3),
    seed=st.integers(0, 2**16),
)
def test_max_pool_and_mpf_equal_dense_then_subsample(p, n, c, extra, seed):
    rng = np.random.default_rng(seed)
    shape = tuple(2 * q + e for q, e in zip(p, extra))
    x = rng.standard_normal((n, c) + shape).astype(np.float32)
    dense = brute_max_filter(x, p)
    mp = max_pool(x, p)
    np.testing.assert_array_equal(
        mp, dense[:, :, :: p[0], :: p[1], :: p[2]][(...,) + tuple(slice(0, s) for s in mp.shape[2:])]
    )
    f = mpf(x, p)
    P = math.prod(p)
    m = tuple((s - q + 1) // q for s, q in zip(shape, p))
    assert f.shape == (n * P, c) + m
    for i in range(n):
        for k, o in enumerate(itertools.product(*[range(q) for q in p])):
            want = dense[i, :, o[0] :: p[0], o[1] :: p[1], o[2] :: p[2]][:, : m[0], : m[1], : m[2]]
            np.testing.assert_array_equal(f[i * P + k], want)


@settings(max_examples=40, deadline=None)
@given(p=windows, d=st.tuples(*[st.integers(1, 3)] * 3), seed=st.integers(0, 2**16))
def test_max_filter_dense_matches_brute_force(p, d, seed):
    x = np.random.default_rng(seed).standard_normal((2, 2, 9, 8, 7)).astype(np.float32)
    np.testing.assert_array_equal(max_filter_dense(x, p, d), brute_max_filter(x, p, d))


@pytest.mark.parametrize("p1,p2", [((1, 2, 2), (2, 3, 1)), ((2, 2, 2), (2, 2, 2)), ((3, 1, 2), (1, 2, 3))])
def test_recombine_two_mpf_layers_is_dilated_dense_filter(p1, p2):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 17, 16, 15)).astype(np.float32)
    y = recombine(mpf(mpf(x, p1), p2), [p1, p2])
    dense = brute_max_filter(brute_max_filter(x, p1), p2, p1)
    D = tuple(a * b for a, b in zip(p1, p2))
    assert y.shape[:2] == (2, 3) and all(s % q == 0 for s, q in zip(y.shape[2:], D))
    assert all(s <= t for s, t in zip(y.shape[2:], dense.shape[2:]))
    np.testing.assert_array_equal(y, dense[(...,) + tuple(slice(0, s) for s in y.shape[2:])])


def test_recombine_through_a_valid_conv_is_dilated_conv():
    """mpf -> valid conv -> recombine == dense filter -> conv dilated by the window."""
    rng = np.random.default_rng(1)
    p = (1, 2, 3)
    x = rng.standard_normal((1, 2, 12, 14, 16)).astype(np.float32)
    w = rng.standard_normal((3, 2, 2, 3, 2)).astype(np.float32)
    y = recombine(conv_direct_gemm(mpf(x, p), w), [p])
    dense = torch.nn.functional.conv3d(
        torch.from_numpy(brute_max_filter(x, p)), torch.from_numpy(w), dilation=p
    ).numpy()
    np.testing.assert_allclose(y, dense[(...,) + tuple(slice(0, s) for s in y.shape[2:])], rtol=1e-5, atol=1e-5)


def test_recombine_rejects_a_bad_batch():
    with pytest.raises(InputError, match="multiple"):
        recombine(np.zeros((3, 1, 2, 2, 2), np.float32), [(1, 1, 2)])


@pytest.mark.parametrize("p", [(2, 2, 2), (1, 2, 3), (3, 1, 2)])
def test_inplace_filter_fragments_equal_mpf(p):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 13, 11, 14)).astype(np.float32)
    want = mpf(x, p)
    xf = max_filter_inplace(x.copy(), p)
    offsets = list(itertools.product(*(range(q) for q in p)))
    got = np.stack([fragment_of_filtered(xf, p, o) for o in offsets], axis=1).reshape(want.shape)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("p", [(1, 2, 2), (2, 2, 2), (3, 1, 2)])
def test_gather_fragment_copies_each_offset_in_either_layout(p):
    """Depth-first pooling's copy of an offset's fragment: equal to the strided view, C-contiguous
    channels first, or a whole channels-last view (the layout its Winograd reader runs on)."""
    from znni_core.layers import gather_fragment
    from znni_core.layers.layout import is_channels_last

    rng = np.random.default_rng(8)
    xf = max_filter_inplace(rng.standard_normal((2, 5, 9, 11, 13)).astype(np.float32), p)
    for o in itertools.product(*(range(q) for q in p)):
        want = fragment_of_filtered(xf, p, o)
        cf, cl = gather_fragment(xf, p, o), gather_fragment(xf, p, o, channels_last=True)
        assert cf.flags.c_contiguous and is_channels_last(cl)
        assert np.array_equal(cf, want) and np.array_equal(cl, want)


def test_channels_last_pool_upsample_and_residual_stay_channels_last_and_equal_channels_first():
    """Max-pooling, MPF, nearest upsampling and the add/affine/activation pass keep a channels-last
    input channels last (``layers/layout``) and equal the channels-first results exactly; a
    mixed add is still right."""
    from znni_core.layers.epilogue import add_affine_act
    from znni_core.layers.layout import as_contiguous, empty_like_layout, is_channels_last, memory_order
    from znni_core.layers.resample import upsample_nearest

    rng = np.random.default_rng(3)
    cl = lambda a: np.ascontiguousarray(memory_order(a)).transpose(0, 4, 1, 2, 3)  # noqa: E731
    x = rng.standard_normal((2, 5, 6, 10, 12)).astype(np.float32)
    y = rng.standard_normal(x.shape).astype(np.float32)
    xc, yc = cl(x), cl(y)
    assert is_channels_last(xc) and not is_channels_last(x) and not is_channels_last(cl(x[:, :1]))
    for p in [(1, 2, 2), (2, 2, 2), (1, 3, 2)]:
        got = max_pool(xc, p)
        assert is_channels_last(got)
        np.testing.assert_array_equal(got, max_pool(x, p))
        np.testing.assert_array_equal(got, torch.nn.functional.max_pool3d(torch.from_numpy(x), p).numpy())
    for p in [(1, 2, 2), (2, 2, 2), (2, 3, 1)]:  # MPF's fragments stay channels last (the two windows
        # written out, and the general loop)
        got = mpf(xc, p)
        assert is_channels_last(got)
        np.testing.assert_array_equal(got, mpf(x, p))
    for f in [(1, 2, 2), (2, 1, 3)]:
        got = upsample_nearest(xc, f)
        assert is_channels_last(got)
        np.testing.assert_array_equal(got, x.repeat(f[0], 2).repeat(f[1], 3).repeat(f[2], 4))
    s, t = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    for b, bc in [(y, yc), (None, None)]:
        want = add_affine_act(x, b, s, t, ("elu", 1.0))
        got = add_affine_act(xc, bc, s, t, ("elu", 1.0))
        assert is_channels_last(got)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(add_affine_act(xc, y, s, t, ("relu", 0.0)), add_affine_act(x, y, s, t, ("relu", 0.0)))
    part = xc[:, :, 1:5]  # a part of a channels-last array is copied channels last
    assert not is_channels_last(part) and is_channels_last(as_contiguous(part))
    np.testing.assert_array_equal(as_contiguous(part), x[:, :, 1:5])
    assert is_channels_last(empty_like_layout(xc)) and empty_like_layout(x).flags.c_contiguous


@pytest.mark.parametrize("channels", [(24, 24), (3, 20), (9, 2, 17)])
def test_concat_channels_last_equals_numpy_on_whole_arrays_and_parts(channels, numba_thread_counts):
    """``layout.concat_channels_last`` (a U-Net's concat of channels-last tensors) equals numpy's
    concatenate and is channels last: whole arrays (flat runs; a part of fewer than 8 channels, 8 or
    more with an overlapping last vector), parts of them (any strides), on two workers and one."""
    from znni_core.layers.layout import concat_channels_last, empty_channels_last, is_channels_last

    rng = np.random.default_rng(len(channels))
    parts = []
    for c in channels:
        p = empty_channels_last((2, c, 3, 5, 7))
        p[...] = rng.standard_normal(p.shape)
        parts.append(p)
    for _ in numba_thread_counts:
        out = concat_channels_last(parts)
        assert is_channels_last(out)
        np.testing.assert_array_equal(out, np.concatenate(parts, axis=1))
        sub = [p[:, :, 1:3, ::2] for p in parts]  # not whole: the strided rows' loop
        np.testing.assert_array_equal(concat_channels_last(sub), np.concatenate(sub, axis=1))


def test_copy_into_copies_any_strides_in_parallel():
    """``layout.copy_into`` (a GPU + host RAM block staged into a pinned buffer and back, depth-first
    pooling's fragments): equal to numpy's copy from and into strided views; other arrays fall back."""
    from znni_core.layers.layout import copy_into

    rng = np.random.default_rng(3)
    big = rng.standard_normal((3, 5, 9, 11, 13)).astype(np.float32)
    src = big[1:, ::2, 2:8, 1::3, ::-1]  # strided, reversed
    dst = np.zeros(src.shape, np.float32)
    copy_into(dst, src)
    np.testing.assert_array_equal(dst, src)
    into, expect = np.zeros_like(big), np.zeros_like(big)
    view = (slice(0, 2), slice(1, 4), slice(None, None, 3), slice(3, 7), slice(None, 13))
    copy_into(into[view], dst[:, :, :3, :, :])  # into a strided view of a larger array
    expect[view] = dst[:, :, :3, :, :]
    np.testing.assert_array_equal(into, expect)
    f64 = np.zeros((2, 3), np.float64)
    copy_into(f64, np.ones((2, 3)))
    assert (f64 == 1).all()


@pytest.mark.parametrize("p", [(2, 2, 2), (1, 2, 2)])
@pytest.mark.parametrize("c", [19, 24])
def test_channels_last_pool_takes_each_voxels_channels_a_vector_at_a_time(p, c):
    """A channels-last max-pool of 19 or 24 channels (whole vectors, the last one overlapping)
    equals the same kernel run channel by channel (one channel: its scalar loop), bit for bit,
    NaN, infinities and signed zeros included (numba's ``max``: the first value when unordered,
    in the same order of pairs)."""
    from znni_core.layers.layout import memory_order
    from znni_core.layers.pool import _mpf_cl

    rng = np.random.default_rng(c)
    x = rng.standard_normal((2, c, 4, 6, 10)).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0], np.float32)
    mask = rng.random(x.shape) < 0.2
    x[mask] = rng.choice(special, mask.sum())
    mem = np.ascontiguousarray(memory_order(x))
    got = memory_order(max_pool(mem.transpose(0, 4, 1, 2, 3), p))
    m = tuple(n // q for n, q in zip(x.shape[2:], p))
    for ch in range(c):
        want = np.empty((2, 1) + m + (1,), np.float32)
        _mpf_cl(np.ascontiguousarray(mem[..., ch : ch + 1]), *p, np.zeros((1, 3), np.int64), want)
        np.testing.assert_array_equal(np.signbit(got[..., ch]), np.signbit(want[:, 0, ..., 0]))
        np.testing.assert_array_equal(got[..., ch], want[:, 0, ..., 0])
