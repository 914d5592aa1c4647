"""Max-pooling, max-pooling fragments (MPF) and their recombination.

All functions take batched 5-D arrays ``(N, C, Z, Y, X)`` and work for numpy and
CuPy alike (``xp = get_array_module(x)``).

MPF in one dimension, window ``p = 2`` (``m = (n - p + 1) // p``)::

    x            : 0 1 2 3 4 5 6 7 8      n = 9
    offset 0     : [0 1][2 3][4 5][6 7]   -> m = 4 values
    offset 1     :   [1 2][3 4][5 6][7 8] -> m = 4 values
    recombined   : f0[0] f1[0] f0[1] f1[1] ... = dense stride-1 max filter[:2m]
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from ..errors import InputError
from . import arena
from ._numba import FAST, njit, prange
from .layout import copy_into, copy_run, is_channels_last, memory_order
from .microkernel import VL
from .threads import split_tasks
from .transform_vectors import MAX4, MAX8, vector_transform
from .xp import get_array_module, with_host_variant

__all__ = [
    "fragment_of_filtered",
    "gather_fragment",
    "max_filter_dense",
    "max_filter_inplace",
    "max_pool",
    "max_pool_memory",
    "mpf",
    "mpf_memory",
    "recombine",
    "recombine_memory",
]

F32 = 4


def _window(p, name="window"):
    """Normalise a pooling window / dilation to a 3-tuple of positive ints."""
    if isinstance(p, int):
        p = (p, p, p)
    p = tuple(int(v) for v in p)
    if len(p) != 3 or any(v < 1 for v in p):
        raise InputError(f"{name} {p!r} must be three positive integers (z, y, x)")
    return p


def _check5(x):
    if x.ndim != 5:
        raise InputError(f"expected a 5-D (N, C, Z, Y, X) array, got shape {x.shape}")


_ZERO = np.float32(0.0)


@njit(cache=True, fastmath=FAST, inline="always")
def _max2(a, b):  # pragma: no cover - compiled
    """``max(a, b)`` as a sum of two selects, each zero where the other holds: stored back where
    ``a`` was read, a plain select is a conditional store of ``b``, which LLVM compiles for AVX2
    to ``vmaskmovps`` (microcoded on AMD cores: every in-place maximum ran at a fraction of the
    AVX-512 code's speed on Zen 4)."""
    c = b > a
    return (b if c else _ZERO) + (_ZERO if c else a)


@njit(cache=True, fastmath=FAST, inline="always")
def _max_into(row, src):  # pragma: no cover - compiled
    """row = max(row, src) elementwise, in place (1-D, same length)."""
    for i in range(row.shape[0]):
        row[i] = _max2(row[i], src[i])


@njit(nogil=True, cache=True, fastmath=FAST)
def _pool_offsets_kernel(x, p0, p1, p2, offs, out, t0, t1):  # pragma: no cover - compiled
    """``out[n, k, c] = max_pool(x[n, c, oz:, oy:, ox:], p)`` for every offset ``offs[k]``.

    Tasks ``t0 .. t1`` of (item, channel) (:func:`.threads.split_tasks`).  Per fragment plane:
    the max over the ``p0`` input planes into a plane buffer that stays in cache, shared by the
    consecutive offsets with the same ``oz``; then, shared by the offsets with the same ``(oz,
    oy)``, the max over ``p1`` rows and the running max over ``p2`` neighbouring columns
    (``cm[j, q] = max(row[q : q + p2])``); every offset then only picks its columns ``ox + p2 *
    l``.  All maxima run on contiguous rows (vectorised); the one strided step is a copy.  The
    plane, row and column buffers are allocated once per range.
    """
    N, C, Z, Y, X = x.shape
    K, m0, m1, m2 = out.shape[1], out.shape[3], out.shape[4], out.shape[5]
    L = X - p2 + 1  # columns with a full window to their right
    plane = np.empty((Y, X), np.float32)
    row = np.empty(X, np.float32)
    cm = np.empty((m1, L), np.float32)
    for t in range(t0, t1):
        n = t // C
        c = t % C
        for i in range(m0):
            for k in range(K):
                oz, oy, ox = offs[k, 0], offs[k, 1], offs[k, 2]
                new_z = k == 0 or oz != offs[k - 1, 0]
                if new_z:  # offsets sharing oz share the plane max
                    z0 = oz + i * p0
                    src = x[n, c, z0]
                    for yy in range(Y):
                        for q in range(X):
                            plane[yy, q] = src[yy, q]
                    for u in range(1, p0):
                        src = x[n, c, z0 + u]
                        for yy in range(Y):
                            _max_into(plane[yy], src[yy])
                if new_z or oy != offs[k - 1, 1]:  # ... and (oz, oy) the row and column maxima
                    for j in range(m1):
                        y0 = oy + j * p1
                        copy_run(row, 0, plane[y0], 0, X)
                        for w in range(1, p1):
                            _max_into(row, plane[y0 + w])
                        cj = cm[j]
                        copy_run(cj, 0, row, 0, L)
                        for s in range(1, p2):
                            _max_into(cj, row[s : s + L])
                dst = out[n, k, c, i]
                for j in range(m1):
                    cj = cm[j]
                    drow = dst[j]
                    for l in range(m2):
                        drow[l] = cj[ox + l * p2]


@njit(nogil=True, cache=True, fastmath=FAST)
def _max_filter_inplace_kernel(x, p0, p1, p2, t0, t1):  # pragma: no cover - compiled
    """x[..., i, j, k] = max of the window starting there (valid part), in place, for the
    (item, channel) tasks ``t0 .. t1``.

    Axis by axis, ascending: position i reads i..i+p-1, which are not yet overwritten."""
    N, C, Z, Y, X = x.shape
    for t in range(t0, t1):
        a = x[t // C, t % C]
        for z in range(Z - p0 + 1):
            for u in range(1, p0):
                for yy in range(Y):
                    _max_into(a[z, yy], a[z + u, yy])
        for z in range(Z - p0 + 1):
            pl = a[z]
            for yy in range(Y - p1 + 1):
                for w in range(1, p1):
                    _max_into(pl[yy], pl[yy + w])
            for yy in range(Y - p1 + 1):
                row = pl[yy]
                for xx in range(X - p2 + 1):
                    v = row[xx]
                    for s in range(1, p2):
                        v = _max2(v, row[xx + s])
                    row[xx] = v


def max_filter_inplace(x, p):
    """Overwrite ``x`` (float32 numpy, ``(N, C, Z, Y, X)``) with its stride-1 max filter of
    window ``p``: afterwards ``x[..., :Z-pz+1, :Y-py+1, :X-px+1]`` holds it (the rest is
    stale).  Every pooling offset's fragment is then a strided subsample of ``x``
    (:func:`fragment_of_filtered`), so depth-first pooling reads the big array 3 times
    instead of once per offset."""
    _check5(x)
    p = _window(p)
    split_tasks(lambda t0, t1: _max_filter_inplace_kernel(x, p[0], p[1], p[2], t0, t1), x.shape[0] * x.shape[1])
    return x


def fragment_of_filtered(xf, p, offset):
    """The pooled fragment at ``offset`` (as :func:`mpf` cuts it) from an array filtered by
    :func:`max_filter_inplace`: a strided view."""
    p = _window(p)
    m = mpf_shape(xf.shape[2:], p)
    sl = tuple(slice(o, o + k * q, q) for o, k, q in zip(offset, m, p))
    return xf[(slice(None), slice(None)) + sl]


@njit(parallel=True, cache=True)
def _gather_channels_last(v, out):  # pragma: no cover - compiled
    """``out`` (N, mz, my, mx, C) = the strided view ``v`` (N, C, mz, my, mx), row by row of
    ``v``'s x axis (a channels-last row is a small transpose that stays in cache)."""
    N, C, mz, my, mx = v.shape
    for t in prange(N * mz * my):
        n, i, j = t // (mz * my), (t // my) % mz, t % my
        dst = out[n, i, j]
        for c in range(C):
            src = v[n, c, i, j]
            for l in range(mx):
                dst[l, c] = src[l]


def gather_fragment(xf, p, offset, channels_last=False):
    """:func:`fragment_of_filtered` as a new array (from the current arena), channels first or
    last: depth-first pooling's copy of each offset's fragment, in parallel (the four 94 MB
    fragments of a (1,2,2) pool: 0.12 s on two cores, numpy's strided copy 0.20 s)."""
    v = fragment_of_filtered(xf, p, offset)
    if not (isinstance(v, np.ndarray) and v.dtype == np.float32):
        return get_array_module(v).ascontiguousarray(v)
    if channels_last and v.shape[1] > 1:
        n, c, z, y, x = v.shape
        out = arena.empty((n, z, y, x, c), np.float32)
        _gather_channels_last(v, out)
        return out.transpose(0, 4, 1, 2, 3)
    out = arena.empty(v.shape, np.float32)
    copy_into(out, v)
    return out


def _pool_offsets(x, p, m, offsets, out):
    """numpy fast path: ``out`` (N, K, C, *m) gets the pooled fragment of every offset."""
    # views (a slab, a shifted window) are read in place: numba takes any strides
    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 3)
    split_tasks(lambda t0, t1: _pool_offsets_kernel(x, p[0], p[1], p[2], offs, out, t0, t1), x.shape[0] * x.shape[1])
    return out


def _pool_into(x, p, m, out):
    """``out = max over the window`` of non-overlapping windows starting at 0.

    One strided view per window offset, accumulated with ``maximum(..., out=out)``:
    no temporary larger than ``out`` (the generic ``xp`` path; numpy uses the numba
    kernel above).
    """
    xp = get_array_module(x)
    first = True
    for a, b, c in itertools.product(range(p[0]), range(p[1]), range(p[2])):
        v = x[:, :, a : a + m[0] * p[0] : p[0], b : b + m[1] * p[1] : p[1], c : c + m[2] * p[2] : p[2]]
        if first:
            out[...] = v
            first = False
        else:
            xp.maximum(out, v, out=out)
    return out


@njit(nogil=True, cache=True)
def _mpf_cl_kernel(x, pz, py, px, offs, out, t0, t1):  # pragma: no cover - compiled
    """:func:`mpf` channels last: ``out[n, k, i, j, l] = max over the window at offset
    ``offs[k]`` of ``x`` (N, Z, Y, X, C), a vector of channels per voxel; ``out`` (N, P, mz,
    my, mx, C) (both C-contiguous).  Windows of 2 x 2 x 2 and 1 x 2 x 2 take their values in
    one expression, stored once: accumulating into the output (which may alias the input, so
    every step was stored) ran n337's 16-map MPF of 8 x 63^3 fragments in 55 ms, this 14 ms;
    48 maps on 4 x 129^3 332 -> 172 ms, (1,2,2) on 4 x 15 x 129^2 24 -> 14 ms.  Flat
    unsigned offsets (numba checks a signed index for wrap-around).  With a vector of channels
    or more, each voxel's channels go a vector at a time (the same maxima, in the same order)."""
    N, Z, Y, X, C = x.shape
    _, K, mz, my, mx, _ = out.shape
    xf = x.reshape(-1)
    of = out.reshape(-1)
    u = np.uint64
    C_, sY, sZ, sN = u(C), u(X * C), u(Y * X * C), u(Z * Y * X * C)
    cube = pz == 2 and py == 2 and px == 2
    square = pz == 1 and py == 2 and px == 2
    # the window's points from its first (x, y, z neighbours): per voxel, runs of C channels,
    # which LLVM's loops left to their scalar remainder in AVX2 code (vectors of VL instead)
    o4 = (C_, sY, sY + C_)
    o8 = (C_, sY, sY + C_, sZ, sZ + C_, sZ + sY, sZ + sY + C_)
    for t in range(t0, t1):  # rows (n, i, j) of the fragments (:func:`.threads.split_tasks`)
        n, i, j = t // (mz * my), (t // my) % mz, t % my
        for k in range(K):
            src0 = u(n) * sN + u(offs[k, 0] + i * pz) * sZ + u(offs[k, 1] + j * py) * sY + u(offs[k, 2]) * C_
            dst0 = u((((n * K + k) * mz + i) * my + j) * mx) * C_
            if cube and C >= VL:  # a voxel's channels a vector at a time, the last one overlapping
                for l in range(u(mx)):
                    s, d = src0 + l * u(2) * C_, dst0 + l * C_
                    for q in range(0, C - VL, VL):
                        vector_transform(MAX8, VL, xf, s + u(q), o8, of, d + u(q), C_)
                    vector_transform(MAX8, VL, xf, s + u(C - VL), o8, of, d + u(C - VL), C_)
            elif square and C >= VL:
                for l in range(u(mx)):
                    s, d = src0 + l * u(2) * C_, dst0 + l * C_
                    for q in range(0, C - VL, VL):
                        vector_transform(MAX4, VL, xf, s + u(q), o4, of, d + u(q), C_)
                    vector_transform(MAX4, VL, xf, s + u(C - VL), o4, of, d + u(C - VL), C_)
            elif cube:
                for l in range(u(mx)):
                    s, d = src0 + l * u(2) * C_, dst0 + l * C_
                    for q in range(C_):
                        a = max(max(xf[s + q], xf[s + C_ + q]), max(xf[s + sY + q], xf[s + sY + C_ + q]))
                        b = max(
                            max(xf[s + sZ + q], xf[s + sZ + C_ + q]), max(xf[s + sZ + sY + q], xf[s + sZ + sY + C_ + q])
                        )
                        of[d + q] = max(a, b)
            elif square:
                for l in range(u(mx)):
                    s, d = src0 + l * u(2) * C_, dst0 + l * C_
                    for q in range(C_):
                        of[d + q] = max(max(xf[s + q], xf[s + C_ + q]), max(xf[s + sY + q], xf[s + sY + C_ + q]))
            else:
                for l in range(u(mx)):
                    src, dst = src0 + l * u(px) * C_, dst0 + l * C_
                    for q in range(C_):
                        of[dst + q] = xf[src + q]
                    for a in range(u(pz)):
                        for b in range(u(py)):
                            for c in range(u(px)):
                                s = src + a * sZ + b * sY + c * C_
                                for q in range(C_):
                                    of[dst + q] = _max2(of[dst + q], xf[s + q])


def _mpf_cl(x, pz, py, px, offs, out):
    """:func:`_mpf_cl_kernel` over the run's threads, a range of fragment rows each."""
    rows = out.shape[0] * out.shape[2] * out.shape[3]
    split_tasks(lambda t0, t1: _mpf_cl_kernel(x, pz, py, px, offs, out, t0, t1), rows)


@with_host_variant
def max_pool(x, p):
    """Plain max-pooling, kernel = stride = ``p``; output ``floor(n / p)`` per axis.

    Parameters
    ----------
    x : array, shape (N, C, Z, Y, X)
    p : int or 3-tuple of int

    Returns
    -------
    array, shape (N, C, Z // pz, Y // py, X // px)

    Examples
    --------
    >>> import numpy as np
    >>> x = np.arange(8, dtype=np.float32).reshape(1, 1, 1, 1, 8)
    >>> max_pool(x, (1, 1, 2))[0, 0, 0, 0].tolist()
    [1.0, 3.0, 5.0, 7.0]
    """
    p, m = _pooled(x, p)
    out = arena.empty(x.shape[:2] + m, x.dtype, xp=get_array_module(x))
    return _pool_into(x, p, m, out)


@max_pool.host
def _max_pool_host(x, p):
    """Host variant: float32 by the numba kernels; a channels-last input stays so (MPF's one offset)."""
    if x.dtype != np.float32:
        return max_pool.generic(x, p)
    p, m = _pooled(x, p)
    if is_channels_last(x):
        out = arena.empty((x.shape[0], 1) + m + (x.shape[1],), np.float32)
        _mpf_cl(np.ascontiguousarray(memory_order(x)), p[0], p[1], p[2], np.zeros((1, 3), np.int64), out)
        return out[:, 0].transpose(0, 4, 1, 2, 3)
    out = arena.empty((x.shape[0], 1, x.shape[1]) + m, np.float32)
    return _pool_offsets(x, p, m, [(0, 0, 0)], out)[:, 0]


def _pooled(x, p):
    """``(window, output shape)`` of a max-pooling of ``x``, checked."""
    _check5(x)
    p = _window(p)
    m = tuple(n // q for n, q in zip(x.shape[2:], p))
    if min(m) < 1:
        raise InputError(f"input spatial shape {x.shape[2:]} is smaller than the pooling window {p}")
    return p, m


def mpf_shape(spatial, p):
    """Common fragment size ``m = (n - p + 1) // p`` per axis."""
    p = _window(p)
    return tuple((n - q + 1) // q for n, q in zip(spatial, p))


@with_host_variant
def mpf(x, p):
    """Max-pooling fragments: every pooling offset, stacked into the batch axis.

    For offset ``o`` in ``product(range(pz), range(py), range(px))`` (C order, index
    ``k``), fragment ``k`` of batch item ``i`` is ``max_pool(x[i, :, oz:, oy:, ox:], p)``
    cut to the common size ``m = (n - p + 1) // p``; it lands at batch index
    ``i * P + k`` with ``P = pz * py * px`` (old batch major).

    Parameters
    ----------
    x : array, shape (N, C, Z, Y, X)
    p : int or 3-tuple of int

    Returns
    -------
    array, shape (N * P, C, mz, my, mx)
    """
    p, m, offsets = _fragments(x, p)
    n, c = x.shape[:2]
    out = arena.empty((n, len(offsets), c) + m, x.dtype, xp=get_array_module(x))
    for k, (a, b, d) in enumerate(offsets):
        _pool_into(x[:, :, a:, b:, d:], p, m, out[:, k])
    return out.reshape((n * len(offsets), c) + m)


@mpf.host
def _mpf_host(x, p):
    """Host variant: float32 by the numba kernels, all offsets in one pass; channels-last input
    gives channels-last fragments."""
    if x.dtype != np.float32:
        return mpf.generic(x, p)
    p, m, offsets = _fragments(x, p)
    n, c = x.shape[:2]
    P = len(offsets)
    if is_channels_last(x):
        out = arena.empty((n, P) + m + (c,), np.float32)
        _mpf_cl(np.ascontiguousarray(memory_order(x)), p[0], p[1], p[2], np.asarray(offsets, np.int64), out)
        return out.reshape((n * P,) + m + (c,)).transpose(0, 4, 1, 2, 3)
    out = arena.empty((n, P, c) + m, np.float32)
    return _pool_offsets(x, p, m, offsets, out).reshape((n * P, c) + m)


def _fragments(x, p):
    """``(window, fragment shape, offsets in C order)`` of MPF on ``x``, checked."""
    _check5(x)
    p = _window(p)
    m = mpf_shape(x.shape[2:], p)
    if min(m) < 1:
        raise InputError(f"input spatial shape {x.shape[2:]} is too small for MPF with window {p}")
    return p, m, list(itertools.product(range(p[0]), range(p[1]), range(p[2])))


def recombine(y, pools):
    """Interleave MPF fragments back into the dense (stride-1) output.

    Parameters
    ----------
    y : array, shape (N0 * prod_l P_l, C, mz, my, mx)
        Fragments after applying :func:`mpf` for every window in ``pools`` (network
        order) followed by shape-preserving or valid layers.
    pools : sequence of 3-tuples
        The MPF windows, in network order.

    Returns
    -------
    array, shape (N0, C, mz * Dz, my * Dy, mx * Dx) with ``D = prod_l p_l``.
        Dense position along z is ``q * Dz + r_L * d_L + ... + r_1 * d_1`` where
        ``r_l`` is the offset of pooling layer ``l`` and ``d_l`` the product of the
        windows before it (``d_1 = 1``).

    Notes
    -----
    One reshape/transpose; the final reshape copies unless every window is 1.
    """
    _check5(y)
    pools = [_window(p, "pooling window") for p in pools]
    if not pools:
        return y
    Ptot = math.prod(math.prod(p) for p in pools)
    nf, c = y.shape[:2]
    if nf % Ptot:
        raise InputError(f"batch {nf} is not a multiple of the {Ptot} fragments of pools {pools}")
    n0 = nf // Ptot
    m = y.shape[2:]
    L = len(pools)
    # batch index = ((n0 * P1 + o1) * P2 + o2) ...; o_l = (rz_l, ry_l, rx_l) in C order
    shape = (n0,) + tuple(v for p in pools for v in p) + (c,) + m
    v = y.reshape(shape)
    # axis of r_{l, a} (layer l, spatial axis a) in v
    r_ax = lambda l, a: 1 + 3 * l + a  # noqa: E731
    c_ax, m_ax = 1 + 3 * L, 2 + 3 * L
    order = [0, c_ax]
    for a in range(3):
        order.append(m_ax + a)
        order.extend(r_ax(l, a) for l in reversed(range(L)))
    D = tuple(math.prod(p[a] for p in pools) for a in range(3))
    return v.transpose(order).reshape((n0, c) + tuple(mi * d for mi, d in zip(m, D)))


def max_filter_dense(x, p, dilation=(1, 1, 1)):
    """Stride-1 max filter of window ``p`` with ``dilation``, valid output.

    Output size per axis ``n - (p - 1) * dilation``.  Separable: one pass per axis,
    each a running maximum over ``p`` shifted views.

    Parameters
    ----------
    x : array, shape (N, C, Z, Y, X)
    p, dilation : int or 3-tuple of int

    Returns
    -------
    array
    """
    _check5(x)
    p, d = _window(p), _window(dilation, "dilation")
    xp = get_array_module(x)
    for ax in range(3):
        if p[ax] == 1:
            continue
        n_out = x.shape[2 + ax] - (p[ax] - 1) * d[ax]
        if n_out < 1:
            raise InputError(f"axis {ax} of size {x.shape[2 + ax]} is smaller than window {p} with dilation {d}")

        def sl(j):
            s = [slice(None)] * 5
            s[2 + ax] = slice(j * d[ax], j * d[ax] + n_out)
            return tuple(s)

        out = x[sl(0)].copy()
        for j in range(1, p[ax]):
            xp.maximum(out, x[sl(j)], out=out)
        x = out
    return x


def max_pool_memory(n, c, in_shape, p) -> int:
    """Peak bytes of :func:`max_pool` (its float32 output; the input excluded)."""
    p = _window(p)
    return F32 * n * c * math.prod(s // q for s, q in zip(in_shape, p))


def mpf_memory(n, c, in_shape, p) -> int:
    """Peak bytes of :func:`mpf` (its float32 output; the input excluded)."""
    p = _window(p)
    return F32 * n * math.prod(p) * c * math.prod(mpf_shape(in_shape, p))


def recombine_memory(nf, c, frag_shape, pools) -> int:
    """Peak bytes of :func:`recombine`: one dense copy of the fragments (float32)."""
    return F32 * nf * c * math.prod(frag_shape)
