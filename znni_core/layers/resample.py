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
from .layout import empty_channels_last, is_channels_last, memory_order
from .threads import matmul
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
    and the input copied once; ``np.pad`` took 3x as long on U-Net layers)."""
    xp = get_array_module(x)
    low, high = tuple(int(a) for a in low), tuple(int(b) for b in high)
    shape = x.shape[:2] + tuple(s + a + b for s, a, b in zip(x.shape[2:], low, high))
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
