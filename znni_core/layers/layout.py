"""Channels-last arrays: ``(N, C, Z, Y, X)`` views of ``(N, Z, Y, X, C)`` memory.

A layer whose inner loops run over the channels (Winograd's transforms, 16 channels per
AVX-512 instruction) reads and writes such a view without the transposes a channels-first
array costs it: on a (1,3,3) layer at 24-28 maps those two transposes took about half of the
layer's time.  The view is an ordinary ``(N, C, Z, Y, X)`` array of other strides, so every
primitive stays correct on it; the executor hands it only to readers that run on it at
speed (:func:`~znni_core.exec.patch.channels_last_tensors` decides, per tensor).

>>> import numpy as np
>>> x = empty_channels_last((1, 3, 2, 2, 2))
>>> x.shape, is_channels_last(x), is_channels_last(np.empty((1, 3, 2, 2, 2), np.float32))
((1, 3, 2, 2, 2), True, False)
"""

from __future__ import annotations

import numpy as np

from . import arena
from ._numba import njit, prange
from .threads import split_tasks
from .transform_vectors import vector_copy
from .xp import get_array_module, with_host_variant

__all__ = [
    "as_contiguous",
    "channels_inner",
    "concat_channels_last",
    "copy_into",
    "empty_channels_last",
    "empty_like_layout",
    "is_channels_last",
    "memory_order",
]


def copy_into(dst, src) -> None:
    """``dst[...] = src`` for 5-D float32 arrays of any strides, rows copied in parallel (numba):
    a pooling fragment gathered from its strided view, a block staged into a pinned buffer and
    back (GPU + host RAM plans).  numpy's strided copy runs on one thread; other arrays take it."""
    if (
        isinstance(dst, np.ndarray)
        and isinstance(src, np.ndarray)
        and dst.ndim == 5
        and dst.shape == src.shape
        and dst.dtype == np.float32
        and src.dtype == np.float32
    ):
        _copy_rows(src, dst)
    else:
        dst[...] = src


def concat_channels_last(parts):
    """``parts`` (5-D float32 arrays, each with its channels innermost: :func:`channels_inner`)
    concatenated along the channels into a new channels-last array: a U-Net's concat of a skip and
    an upsampled tensor, both channels last, hands its reader (a Winograd conv) channels last too.
    Each voxel's channels of each part are one run in both; rows are split over the run's workers
    (:func:`.threads.split_tasks`).  numpy's concatenate wrote channels first, and the Winograd
    conv after it read its 48 maps of 16 x 192^2 in 72 ms, against 37 ms for 24 maps read
    channels last."""
    n, _, z, y, x = parts[0].shape
    out = empty_channels_last((n, sum(p.shape[1] for p in parts), z, y, x))
    dst = memory_order(out)
    offs, c = [], 0
    for p in parts:
        offs.append(c)
        c += p.shape[1]
    whole = all(is_channels_last(p) for p in parts)  # flat runs; else (a part of one) any strides
    srcs = [memory_order(p).reshape(-1) if whole else memory_order(p) for p in parts]
    flat = dst.reshape(-1)

    def rows(r0, r1):
        for src, off, p in zip(srcs, offs, parts):
            if whole:
                _concat_flat(src, p.shape[1], flat, dst.shape[4], off, r0 * x, r1 * x)
            else:
                _concat_rows(src, dst, off, r0, r1)

    split_tasks(rows, n * z * y)
    return out


@njit(nogil=True, cache=True)
def _concat_flat(src, C, dst, D, off, v0, v1):  # pragma: no cover - compiled
    """``dst[v * D + off:][:C] = src[v * C:][:C]`` for the voxels ``v`` in ``[v0, v1)`` (flat,
    C-contiguous): 8 floats at a time, the last 8 overlapping (LLVM's loop over 24 channels left
    most of them to its scalar remainder: 18 against 13 ms for two 24-map parts of 16 x 192^2)."""
    u = np.uint64
    for v in range(u(v0), u(v1)):
        d, s = v * u(D) + u(off), v * u(C)
        if C < 8:
            copy_run(dst, d, src, s, C)
            continue
        for k in range(0, C - 8, 8):
            vector_copy(8, dst, d + u(k), src, s + u(k))
        vector_copy(8, dst, d + u(C - 8), src, s + u(C - 8))


@njit(nogil=True, cache=True)
def _concat_rows(src, dst, off, r0, r1):  # pragma: no cover - compiled
    """``dst[n, z, y, :, off:off + C] = src[n, z, y]`` for the rows ``r`` in ``[r0, r1)`` of
    ``(n, z, y)`` (both ``(N, Z, Y, X, C)``, any strides)."""
    _, Z, Y, X, C = src.shape
    for r in range(r0, r1):
        n, z, y = r // (Z * Y), (r // Y) % Z, r % Y
        s, d = src[n, z, y], dst[n, z, y]
        for i in range(X):
            si, di = s[i], d[i]
            for k in range(C):
                di[off + k] = si[k]


@njit(nogil=True, cache=True, inline="always")
def fill_run(a, lo, hi, value):  # pragma: no cover - compiled
    """``a[lo:hi] = value`` in a numba kernel, as a loop: numba's slice assignment compiles its
    generic setitem with the message of a shape mismatch (string building: 2-2.5 s of a kernel's
    compile, per kernel).  Unsigned indices: with signed ones numba wraps a negative index, and
    LLVM vectorised that select of indices as a scatter in AVX-512 code (microcoded: the Winograd
    input transform's edge rows ran 3-4x slower than in AVX2 code)."""
    for i in range(np.uint64(lo), np.uint64(hi)):
        a[i] = value


@njit(nogil=True, cache=True, inline="always")
def copy_run(dst, d0, src, s0, n):  # pragma: no cover - compiled
    """``dst[d0:d0 + n] = src[s0:s0 + n]`` in a numba kernel, as a loop (:func:`fill_run`; unsigned
    indices, as there)."""
    d0, s0 = np.uint64(d0), np.uint64(s0)
    for i in range(np.uint64(max(n, 0))):
        dst[d0 + i] = src[s0 + i]


@njit(parallel=True, cache=True)
def _copy_rows(v, out):  # pragma: no cover - compiled
    N, C, mz, my, mx = v.shape
    for t in prange(N * C * mz):
        n, c, i = t // (C * mz), (t // mz) % C, t % mz
        for j in range(my):
            src, dst = v[n, c, i, j], out[n, c, i, j]
            for l in range(mx):
                dst[l] = src[l]


def is_channels_last(x) -> bool:
    """Whether the 5-D ``x`` is a whole channels-last view (its ``(N, Z, Y, X, C)`` transpose is
    C-contiguous) with more than one channel (one channel is channels-first too)."""
    return (
        isinstance(x, np.ndarray)
        and x.ndim == 5
        and x.shape[1] > 1
        and not x.flags.c_contiguous
        and memory_order(x).flags.c_contiguous
    )


def memory_order(x):
    """``x`` ``(N, C, Z, Y, X)`` as ``(N, Z, Y, X, C)`` (a view)."""
    return x.transpose(0, 2, 3, 4, 1)


def empty_channels_last(shape, dtype=np.float32):
    """An uninitialised channels-last ``shape`` ``(N, C, Z, Y, X)`` (from the current arena)."""
    n, c, z, y, x = shape
    return arena.empty((n, z, y, x, c), dtype).transpose(0, 4, 1, 2, 3)


def empty_like_layout(x):
    """An uninitialised float32 array of ``x``'s shape in ``x``'s layout (from the current arena)."""
    return empty_channels_last(x.shape) if channels_inner(x) else arena.empty(x.shape)


@with_host_variant
def as_contiguous(x):
    """``x`` if it is C-contiguous, else a C-contiguous copy (on the host: see the host variant)."""
    return get_array_module(x).ascontiguousarray(x)


@as_contiguous.host
def _as_contiguous_host(x):
    """``x`` if it is C-contiguous or a whole channels-last view, else a copy in the layout its
    strides are closest to (a channels-last part of one stays channels last)."""
    if x.flags.c_contiguous or is_channels_last(x):
        return x
    if channels_inner(x):
        return np.ascontiguousarray(memory_order(x)).transpose(0, 4, 1, 2, 3)
    return np.ascontiguousarray(x)


def channels_inner(x) -> bool:
    """Whether ``x`` (5-D) keeps its channels innermost in memory (a channels-last array or a
    part of one)."""
    return x.ndim == 5 and x.shape[1] > 1 and abs(x.strides[1]) == x.itemsize and abs(x.strides[4]) > x.itemsize
