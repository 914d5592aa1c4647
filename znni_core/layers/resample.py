"""Primitives graph networks add: resize, transposed and strided convolution, average
pooling, padding.  Arrays are ``(N, C, Z, Y, X)`` float32, written once against ``xp``.

Semantics are PyTorch's (and ONNX's, as exported by it):

* :func:`upsample_nearest`: every voxel repeated ``f`` times per axis (``nn.Upsample``,
  nearest, integer factors).
* :func:`interpolate`: separable linear interpolation by per-axis index tables (a linear
  resize's, ``net.ops.Resize.table``: ``half_pixel``, ``align_corners=False``: source
  ``max(0, (j + 0.5) / f - 0.5)``, clamped at the last voxel, or ``align_corners``: source
  ``j (n - 1) / (m - 1)``).
* :func:`conv_transpose`: ``ConvTranspose3d`` with stride = kernel, no padding: one GEMM.
* :func:`conv_strided`: ``Conv3d`` with any stride (valid; pad first): strided lowering.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from . import arena
from ._numba import njit, prange
from .layout import channels_inner, copy_run, empty_channels_last, is_channels_last, memory_order
from .threads import matmul, split_tasks
from .transform_vectors import vector_copy
from .xp import get_array_module, with_host_variant

__all__ = [
    "avg_pool",
    "conv_strided",
    "conv_strided_memory",
    "conv_transpose",
    "interpolate",
    "pad",
    "upsample_nearest",
]

F32 = 4
_BLOCK_BYTES = 16 * 2**20


@with_host_variant
def upsample_nearest(x, scale):
    """Repeat every voxel ``scale[a]`` times on spatial axis ``a``."""
    xp = get_array_module(x)
    n, c, z, y, w = x.shape
    fz, fy, fx = (int(s) for s in scale)
    if (fz, fy, fx) == (1, 1, 1):
        return x.copy()
    v = x.reshape(n, c, z, 1, y, 1, w, 1)
    out = xp.empty((n, c, z, fz, y, fy, w, fx), dtype=x.dtype)
    out[...] = v
    return out.reshape(n, c, z * fz, y * fy, w * fx)


@upsample_nearest.host
def _upsample_nearest_host(x, scale):
    """Host variant: a numba loop (numpy's broadcast copy runs its innermost axis fx long: 7x
    slower); float32 channels last stays so."""
    n, c, z, y, w = x.shape
    fz, fy, fx = (int(s) for s in scale)
    if (fz, fy, fx) == (1, 1, 1):
        return x.copy()
    if x.dtype == np.float32 and is_channels_last(x):
        out = empty_channels_last((n, c, z * fz, y * fy, w * fx))
        _upsample_nearest_cl(memory_order(x), memory_order(out), fz, fy, fx)
        return out
    out = arena.empty((n, c, z * fz, y * fy, w * fx), x.dtype)
    _upsample_nearest(np.ascontiguousarray(x), out, fz, fy, fx)
    return out


@njit(parallel=True, cache=True)
def _upsample_nearest_cl(x, out, fz, fy, fx):  # pragma: no cover - compiled
    """Channels last: ``x`` (N, Z, Y, X, C), ``out`` (N, Z fz, Y fy, X fx, C), both C-contiguous;
    a run of C channels copied per output voxel (flat unsigned offsets: vector copies)."""
    n, Z, Y, X, C = x.shape
    u = np.uint64
    xf, of = x.reshape(-1), out.reshape(-1)
    C_, X_, fx_ = u(C), u(X), u(fx)
    Yo, Xo, Zo = Y * fy, X * fx, Z * fz
    for t in prange(n * Z * Y):
        i, z, y = t // (Z * Y), (t // Y) % Z, t % Y
        src = u(((i * Z + z) * Y + y) * X * C)
        for dz in range(fz):
            for dy in range(fy):
                dst = u(((i * Zo + z * fz + dz) * Yo + y * fy + dy) * Xo * C)
                for k in range(X_):
                    s0 = src + k * C_
                    for dx in range(fx_):
                        d0 = dst + (k * fx_ + dx) * C_
                        for c in range(C_):
                            of[d0 + c] = xf[s0 + c]


@njit(parallel=True, cache=True)
def _upsample_nearest(x, out, fz, fy, fx):  # pragma: no cover - compiled
    n, c, Z, Y, X = x.shape
    for t in prange(n * c * Z):
        i, ch, z = t // (c * Z), (t // Z) % c, t % Z
        for y in range(Y):
            src = x[i, ch, z, y]
            for dz in range(fz):
                for dy in range(fy):
                    dst = out[i, ch, z * fz + dz, y * fy + dy]
                    for k in range(X):
                        v = src[k]
                        for dx in range(fx):
                            dst[k * fx + dx] = v


@with_host_variant
def interpolate(x, tables):
    """Separable linear interpolation by per-axis ``(i0, i1, w)`` tables (None: axis kept);
    indices are into ``x`` (a slice of a larger tensor takes the slice of its tables)."""
    xp = get_array_module(x)
    for axis, table in enumerate(tables):
        if table is None:
            continue
        i0, i1, w = table
        shape = [1] * 5
        shape[2 + axis] = -1
        w = xp.asarray(w).reshape(shape)
        a = xp.take(x, xp.asarray(i0), axis=2 + axis)
        b = xp.take(x, xp.asarray(i1), axis=2 + axis)
        b -= a
        b *= w
        a += b
        x = a
        del b
    return x if any(t is not None for t in tables) else x.copy()


@interpolate.host
def _interpolate_host(x, tables):
    """Host variant for float32: one pass, each output voxel from its (up to) 8 neighbours, the
    same operations in the same order as the generic path (z, then y, then x: ``a + w (b - a)``),
    so the same values; rows split over the run's workers (:func:`.threads.split_tasks`); channels
    last in, channels last out.  The generic path's gathers and three passes over the output took
    257 ms for a U-Net's (1,2,2) upsampling of 48 maps of 16 x 96^2 channels last."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 5):
        return interpolate.generic(x, tables)

    n, c = x.shape[:2]
    full = []
    for axis, t in enumerate(tables):
        if t is None:
            idx = np.arange(x.shape[2 + axis], dtype=np.int64)
            full.append((idx, idx, np.zeros(idx.size, np.float32), False))
        else:
            i0, i1, w = t
            full.append((np.asarray(i0, np.int64), np.asarray(i1, np.int64), np.asarray(w, np.float32), True))
    (z0, z1, wz, hz), (y0, y1, wy, hy), (x0, x1, wx, hx) = full
    shape = (n, c, z0.size, y0.size, x0.size)
    if not (hz or hy or hx):
        return x.copy()
    if channels_inner(x):
        out = empty_channels_last(shape)
        src, dst = memory_order(x), memory_order(out)

        def rows(r0, r1):
            _lerp_cl(src, dst, z0, z1, wz, hz, y0, y1, wy, hy, x0, x1, wx, hx, r0, r1)

        split_tasks(rows, n * z0.size * y0.size)
        return out
    src, out = np.ascontiguousarray(x), arena.empty(shape, np.float32)

    def rows(r0, r1):
        _lerp_cf(src, out, z0, z1, wz, hz, y0, y1, wy, hy, x0, x1, wx, hx, r0, r1)

    split_tasks(rows, n * c * z0.size)
    return out


@njit(nogil=True, cache=True, inline="always")
def _lerp_zy(a00, a01, a10, a11, wz, hz, wy, hy):  # pragma: no cover - compiled
    """The z then y interpolation of four values (``aZY``), as the generic path computes it."""
    if hz:
        a00 = a00 + wz * (a10 - a00)
        a01 = a01 + wz * (a11 - a01)
    if hy:
        a00 = a00 + wy * (a01 - a00)
    return a00


@njit(nogil=True, cache=True)
def _lerp_cl(x, out, z0, z1, wz, hz, y0, y1, wy, hy, x0, x1, wx, hx, r0, r1):  # pragma: no cover - compiled
    """Output rows ``r = (n, z, y)`` in ``[r0, r1)``, channels last: ``x`` (N, Z, Y, X, C) and
    ``out`` (N, Zo, Yo, Xo, C), any strides; a voxel's channels the inner loop."""
    _, Zo, Yo, Xo, C = out.shape
    for r in range(r0, r1):
        n, zo, yo = r // (Zo * Yo), (r // Yo) % Zo, r % Yo
        fz, fy = wz[zo], wy[yo]
        s00, s01 = x[n, z0[zo], y0[yo]], x[n, z0[zo], y1[yo]]
        s10, s11 = x[n, z1[zo], y0[yo]], x[n, z1[zo], y1[yo]]
        d = out[n, zo, yo]
        for xo in range(Xo):
            i, j, fx = x0[xo], x1[xo], wx[xo]
            for k in range(C):
                v = _lerp_zy(s00[i, k], s01[i, k], s10[i, k], s11[i, k], fz, hz, fy, hy)
                if hx:
                    v1 = _lerp_zy(s00[j, k], s01[j, k], s10[j, k], s11[j, k], fz, hz, fy, hy)
                    v = v + fx * (v1 - v)
                d[xo, k] = v


@njit(nogil=True, cache=True)
def _lerp_cf(x, out, z0, z1, wz, hz, y0, y1, wy, hy, x0, x1, wx, hx, r0, r1):  # pragma: no cover - compiled
    """Output planes ``r = (n, c, z)`` in ``[r0, r1)``, channels first (``x`` C-contiguous)."""
    _, C, Zo, Yo, Xo = out.shape
    for r in range(r0, r1):
        n, c, zo = r // (C * Zo), (r // Zo) % C, r % Zo
        fz = wz[zo]
        pa, pb = x[n, c, z0[zo]], x[n, c, z1[zo]]
        for yo in range(Yo):
            fy = wy[yo]
            s00, s01, s10, s11 = pa[y0[yo]], pa[y1[yo]], pb[y0[yo]], pb[y1[yo]]
            d = out[n, c, zo, yo]
            for xo in range(Xo):
                i, j = x0[xo], x1[xo]
                v = _lerp_zy(s00[i], s01[i], s10[i], s11[i], fz, hz, fy, hy)
                if hx:
                    v1 = _lerp_zy(s00[j], s01[j], s10[j], s11[j], fz, hz, fy, hy)
                    v = v + wx[xo] * (v1 - v)
                d[xo] = v


@with_host_variant
def conv_transpose(x, w, b, stride):
    """``ConvTranspose3d`` with stride equal to the kernel: ``w`` is (C_in, C_out, kz, ky, kx)."""
    xp = get_array_module(x)
    n, ci, z, y, xx = x.shape
    co, k = w.shape[1], tuple(int(v) for v in w.shape[2:])
    if tuple(int(s) for s in stride) != k:
        raise InputError(f"conv_transpose needs stride {tuple(stride)} equal to the kernel {k}")
    wm = xp.asarray(w).reshape(ci, -1).T  # (C_out * K, C_in)
    y_ = matmul(wm, x.reshape(n, ci, -1))  # (N, C_out * K, V)
    y_ = y_.reshape((n, co) + k + (z, y, xx))
    out = xp.empty((n, co, z, k[0], y, k[1], xx, k[2]), dtype=np.float32)
    out[...] = y_.transpose(0, 1, 5, 2, 6, 3, 7, 4)
    del y_
    out = out.reshape(n, co, z * k[0], y * k[1], xx * k[2])
    if b is not None:
        out += xp.asarray(b).reshape(1, -1, 1, 1, 1)
    return out


@conv_transpose.host
def _conv_transpose_host(x, w, b, stride):
    """Host variant for a float32 input with its channels innermost (a U-Net's upsampling after a
    Winograd conv): channels last in, channels last out.  One product per input voxel's channels
    (``(V, C_in) @ (C_in, K C_out)``: row blocks over the run's workers), then each voxel's ``K``
    output vectors, bias added, into their places (a numba loop, rows over the workers).  The
    generic path reads channels first (a transposing copy of a channels-last input), runs one
    product on one thread and scatters on one: 69 ms for 48 -> 24 maps (1,2,2) of 16 x 96^2,
    whose channels-first output then took the concat and the conv after it off channels last."""
    if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and channels_inner(x)):
        return conv_transpose.generic(x, w, b, stride)

    n, ci, z, y, xx = x.shape
    co, k = w.shape[1], tuple(int(v) for v in w.shape[2:])
    if tuple(int(s) for s in stride) != k:
        raise InputError(f"conv_transpose needs stride {tuple(stride)} equal to the kernel {k}")
    K = math.prod(k)
    a = np.ascontiguousarray(memory_order(x)).reshape(-1, ci)  # no copy for a whole channels-last array
    wt = np.ascontiguousarray(np.asarray(w, np.float32).reshape(ci, co, K).transpose(0, 2, 1).reshape(ci, K * co))
    prod = arena.empty((a.shape[0], K * co), np.float32)
    split_tasks(lambda r0, r1: np.matmul(a[r0:r1], wt, out=prod[r0:r1]), a.shape[0])
    out = empty_channels_last((n, co, z * k[0], y * k[1], xx * k[2]))
    bias = np.tile(np.zeros(co, np.float32) if b is None else np.asarray(b, np.float32).reshape(-1), K)
    pf, of = prod.reshape(-1), memory_order(out).reshape(-1)
    split_tasks(lambda r0, r1: _scatter_blocks(pf, bias, of, z, y, xx, k[0], k[1], k[2], r0, r1), n * z * y)
    return out


@njit(nogil=True, cache=True)
def _scatter_blocks(p, bias, out, Z, Y, X, kz, ky, kx, r0, r1):  # pragma: no cover - compiled
    """For the input rows ``r = (n, z, y)`` in ``[r0, r1)``: each voxel's ``kz ky kx`` vectors of
    ``C`` values (``p`` flat ``(V, K, C)``) plus the bias (``bias``: ``K C`` values, the bias
    repeated) into the output block the voxel makes (``out`` flat channels last ``(N, Z kz, Y ky,
    X kx, C)``).  The bias is added to the voxel's ``K C`` values in place (one long loop), then
    each run of ``C`` goes out 8 floats at a time, the last 8 overlapping: LLVM's loop over 24
    channels left most of them to its scalar remainder in AVX2 code."""
    u = np.uint64
    KC = u(bias.size)
    K = u(kz * ky * kx)
    C = KC // K
    Yo, Xo = u(Y * ky), u(X * kx)
    Zo = u(Z * kz)
    for r in range(u(r0), u(r1)):
        n, z, y = r // u(Z * Y), (r // u(Y)) % u(Z), r % u(Y)
        for i in range(u(X)):
            src = (r * u(X) + i) * KC
            for j in range(KC):
                p[src + j] += bias[j]
            for a in range(u(kz)):
                for b in range(u(ky)):
                    for c in range(u(kx)):
                        s0 = src + ((a * u(ky) + b) * u(kx) + c) * C
                        dst = (((n * Zo + z * u(kz) + a) * Yo + y * u(ky) + b) * Xo + i * u(kx) + c) * C
                        if C < u(8):
                            copy_run(out, dst, p, s0, C)
                            continue
                        for q in range(u(0), C - u(8), u(8)):
                            vector_copy(8, out, dst + q, p, s0 + q)
                        vector_copy(8, out, dst + C - u(8), p, s0 + C - u(8))


def avg_pool(x, window):
    """Average pooling, kernel = stride = ``window``, trailing remainder dropped (floor)."""
    n, c = x.shape[:2]
    p = tuple(int(v) for v in window)
    m = tuple(s // q for s, q in zip(x.shape[2:], p))
    if min(m) < 1:
        raise InputError(f"input spatial shape {x.shape[2:]} is smaller than the pooling window {p}")
    v = x[:, :, : m[0] * p[0], : m[1] * p[1], : m[2] * p[2]]
    v = v.reshape(n, c, m[0], p[0], m[1], p[1], m[2], p[2])
    return v.mean(axis=(3, 5, 7), dtype=np.float32)


def pad(x, low, high, value: float = 0.0):
    """Constant padding of the spatial axes (the output from the arena: only the border is filled
    and the input copied once; ``np.pad`` took 3x as long on U-Net layers), in the input's layout
    (a channels-last input copied into a channels-first output took 0.3 s of a 28-channel
    18 x 320^2 layer)."""
    xp = get_array_module(x)
    low, high = tuple(int(a) for a in low), tuple(int(b) for b in high)
    shape = x.shape[:2] + tuple(s + a + b for s, a, b in zip(x.shape[2:], low, high))
    if xp is np and channels_inner(x):
        out = empty_channels_last(shape, x.dtype)
    else:
        out = arena.empty(shape, x.dtype, xp=xp)
    for ax, (a, b) in enumerate(zip(low, high)):
        lead = (slice(None),) * (2 + ax)
        if a:
            out[lead + (slice(0, a),)] = value
        if b:
            out[lead + (slice(shape[2 + ax] - b, None),)] = value
    out[(slice(None), slice(None)) + tuple(slice(a, a + s) for a, s in zip(low, x.shape[2:]))] = x
    return out


def conv_strided_out_shape(in_shape, kernel, stride):
    return tuple((int(n) - int(k)) // int(s) + 1 for n, k, s in zip(in_shape, kernel, stride))


def conv_strided(x, w, b, stride):
    """Valid 3-D correlation with ``stride`` (floor, like PyTorch), lowered in output-z
    blocks: each output voxel's window gathered through a strided view, then one GEMM."""
    xp = get_array_module(x)
    n, ci, Z, Y, X = x.shape
    co, k = w.shape[0], tuple(int(v) for v in w.shape[2:])
    s = tuple(int(v) for v in stride)
    zo, yo, xo = conv_strided_out_shape((Z, Y, X), k, s)
    if min(zo, yo, xo) < 1:
        raise InputError(f"kernel {k} is larger than the input {(Z, Y, X)}")
    x = xp.ascontiguousarray(x)
    wm = xp.asarray(w).reshape(co, -1)
    out = xp.empty((n, co, zo, yo, xo), dtype=np.float32)
    e = x.itemsize
    kk = ci * math.prod(k)
    rows = max(1, min(zo, _BLOCK_BYTES // max(1, F32 * kk * yo * xo)))
    for i in range(n):
        for z0 in range(0, zo, rows):
            z1 = min(zo, z0 + rows)
            base = x[i, :, z0 * s[0] :]
            view = xp.lib.stride_tricks.as_strided(
                base,
                shape=(ci,) + k + (z1 - z0, yo, xo),
                strides=(Z * Y * X * e, Y * X * e, X * e, e, s[0] * Y * X * e, s[1] * X * e, s[2] * e),
            )
            cols = view.reshape(kk, -1)  # a copy: the gathered windows
            out[i, :, z0:z1] = matmul(wm, cols).reshape(co, z1 - z0, yo, xo)
            del cols, view
    if b is not None:
        out += xp.asarray(b).reshape(1, -1, 1, 1, 1)
    return out


def conv_strided_memory(n, c_in, c_out, in_shape, kernel, stride) -> int:
    """Peak bytes of :func:`conv_strided` (output + one lowered block and its product)."""
    zo, yo, xo = conv_strided_out_shape(in_shape, kernel, stride)
    kk = c_in * math.prod(kernel)
    rows = max(1, min(zo, _BLOCK_BYTES // max(1, F32 * kk * yo * xo)))
    return F32 * (n * c_out * zo * yo * xo + (kk + c_out) * rows * yo * xo)
