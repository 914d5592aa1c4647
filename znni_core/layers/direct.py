"""Direct ("valid", stride-1, PyTorch Conv3d semantics) 3-D convolution.

Two CPU paths:

* :func:`conv_direct_gemm` lowers the convolution to BLAS products.  It uses the
  *full-width* lowering: in the flattened input of one item, the value under kernel
  offset ``(dz, dy, dx)`` for output position ``j = z*Y*X + y*X + x`` sits at
  ``j + dz*Y*X + dy*X + dx``, so every row of the lowered matrix is a *contiguous*
  slice of the input (one memcpy-speed copy instead of a 3-D gather).  Output
  positions with ``y >= Yo`` or ``x >= Xo`` are computed and thrown away (a few
  percent of the work).  The lowered matrix is built for a block of output rows at
  a time, a few MiB so that it stays in cache, never more than ``max_bytes``::

        input plane (Y x X)          lowered block (C*kz*ky*kx, rows*X)
        +-----------------+          row (c,dz,dy,dx) = x[c].flat[base+off : +L]
        |####### valid    |  ---->   result = W (C_out, C*k^3) @ block
        |#######  ..      |          keep [:, :, :Xo] of every row
        +-----------------+

* :func:`conv_direct_numba` runs numba loops: register tiles of output channels x a row's
  values, summed over every tap in registers (rows of a tile or more), else a loop over grouped
  rows (a few-voxel row of an MPF fragment).

Both are CPU-only; ``conv_direct_gemm`` is written against ``xp`` and runs on CuPy
too (``as_strided`` and ``matmul`` exist there).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from . import arena, microkernel, tuning
from ._numba import FAST, njit
from .activation import apply_activation
from .epilogue import FUSABLE, act_row, epilogue
from .layout import empty_channels_last, is_channels_last, memory_order
from .threads import matmul, split_tasks
from .transform_vectors import transpose_block
from .xp import get_array_module, with_host_variant

__all__ = [
    "conv_direct_gemm",
    "conv_direct_gemm_memory",
    "conv_direct_numba",
    "conv_direct_numba_memory",
    "conv_out_shape",
    "reads_channels_last",
]

F32 = 4
DEFAULT_MAX_BYTES = 256 * 2**20
#: lowered blocks of about this size ran fastest (64^3 x 24 maps, 3^3: 8 MiB blocks
#: 52 ms, one 600 MiB block 110 ms; benchmarks/bench_primitives.py)
_BLOCK_TARGET = 8 * 2**20


def conv_out_shape(in_shape, kernel):
    """Valid output spatial shape ``n - k + 1`` per axis."""
    return tuple(int(n) - int(k) + 1 for n, k in zip(in_shape, kernel))


def _validate(x, w, b):
    """Normalise to contiguous float32 and check the shapes; returns (xp, x, w, b)."""
    xp = get_array_module(x)
    if getattr(x, "ndim", None) != 5:
        raise InputError(f"x must be 5-D (N, C_in, Z, Y, X); got shape {getattr(x, 'shape', None)}")
    if getattr(w, "ndim", None) != 5:
        raise InputError(f"w must be 5-D (C_out, C_in, kz, ky, kx); got shape {getattr(w, 'shape', None)}")
    if w.shape[1] != x.shape[1]:
        raise InputError(f"w expects {w.shape[1]} input channels but x has {x.shape[1]} (x {x.shape}, w {w.shape})")
    if min(conv_out_shape(x.shape[2:], w.shape[2:])) < 1:
        raise InputError(f"kernel {w.shape[2:]} is larger than the input {x.shape[2:]}")
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    w = xp.ascontiguousarray(xp.asarray(w), dtype=xp.float32)
    if b is not None:
        b = xp.ascontiguousarray(xp.asarray(b), dtype=xp.float32)
        if b.shape != (w.shape[0],):
            raise InputError(f"bias must have shape ({w.shape[0]},); got {b.shape}")
    return xp, x, w, b


def _gemm_blocks(in_shape, kernel, c_in, c_out, max_bytes):
    """Block geometry ``(tz, ty, tw)`` of the lowered matrix.

    ``tz > 1``: whole planes (``ty = Y``, ``tw = X``); ``tz == 1``: ``ty`` full rows
    (``tw = X``) or, when one row is over budget, ``ty = 1`` and ``tw`` columns.
    """
    Z, Y, X = in_shape
    Zo, Yo, Xo = conv_out_shape(in_shape, kernel)
    k = c_in * math.prod(kernel)
    per_pos = F32 * (k + c_out)  # lowered column + result column
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    if per_pos > max_bytes:
        raise InputError(
            f"max_bytes={max_bytes} cannot hold one lowered column ({per_pos} bytes for "
            f"{c_in} x {kernel} -> {c_out}); raise max_bytes to at least {per_pos}"
        )
    target = min(max_bytes, _BLOCK_TARGET)
    row, plane = per_pos * X, per_pos * Y * X
    if plane <= target and Zo > 1:
        return min(Zo, target // plane), Y, X
    if row <= max_bytes:
        return 1, max(1, min(Yo, target // row)), X
    return 1, 1, min(Xo, max_bytes // per_pos)


def conv_direct_gemm(x, w, b=None, *, max_bytes=None, out=None, act=None):
    """Valid 3-D convolution (cross-correlation) lowered to BLAS products.

    Parameters
    ----------
    x : array, shape (N, C_in, Z, Y, X), float32
    w : array, shape (C_out, C_in, kz, ky, kx)
    b : array, shape (C_out,), or None
    max_bytes : int, optional
        Cap on the workspace (lowered block + its product); default 256 MiB.  Blocks
        are a few MiB anyway (cache), so this only binds when one row is larger.
    out : array, shape (N, C_out, Zo, Yo, Xo), optional
        Destination.
    act : ``(kind, alpha)`` or None
        An activation applied to each block while it is in cache (a fused activation).

    Returns
    -------
    array, shape (N, C_out, Z - kz + 1, Y - ky + 1, X - kx + 1), float32

    Examples
    --------
    >>> import numpy as np
    >>> x = np.ones((1, 2, 4, 4, 4), np.float32); w = np.ones((3, 2, 3, 3, 3), np.float32)
    >>> conv_direct_gemm(x, w).shape, float(conv_direct_gemm(x, w)[0, 0, 0, 0, 0])
    ((1, 3, 2, 2, 2), 54.0)
    """
    xp, x, w, b = _validate(x, w, b)
    N, C, Z, Y, X = x.shape
    O, kernel = w.shape[0], w.shape[2:]
    kz, ky, kx = kernel
    Zo, Yo, Xo = conv_out_shape((Z, Y, X), kernel)
    if out is None:
        out = arena.empty((N, O, Zo, Yo, Xo), xp=xp)
    elif out.shape != (N, O, Zo, Yo, Xo):
        raise InputError(f"out has shape {out.shape}; expected {(N, O, Zo, Yo, Xo)}")
    if kz == ky == kx == 1:  # 1x1x1: GEMMs straight on the input, no lowering
        w2, P = w.reshape(O, C), Z * Y * X
        for n in range(N):
            direct = out[n].flags.c_contiguous  # else a strided block of a larger output: via a temporary
            dst = out[n].reshape(O, P) if direct else None
            o2 = matmul(w2, x[n].reshape(C, P), dst)
            bias_act(o2, b, act)
            if not direct:
                out[n] = o2.reshape(O, Z, Y, X)
        return out
    tz, ty, tw = _gemm_blocks((Z, Y, X), kernel, C, O, max_bytes)
    blen = tz * ty * tw
    K = C * kz * ky * kx
    cols = xp.empty((C, kz, ky, kx, blen), dtype=xp.float32)
    cols2 = cols.reshape(K, blen)
    res = xp.empty((O, blen), dtype=xp.float32)
    w2 = w.reshape(O, K)
    YX, it = Y * X, x.itemsize
    as_strided = xp.lib.stride_tricks.as_strided
    if tz > 1:
        blocks = [(z0, 0, 0, min(tz, Zo - z0), Yo, Xo) for z0 in range(0, Zo, tz)]
    else:
        blocks = [
            (z0, y0, x0, 1, min(ty, Yo - y0), min(tw, Xo - x0))
            for z0 in range(Zo)
            for y0 in range(0, Yo, ty)
            for x0 in range(0, Xo, tw)
        ]
    for n in range(N):
        xf = x[n].reshape(C, Z * YX)
        for z0, y0, x0, nz, vy, vx in blocks:
            # rows of the last plane past vy and columns past vx are never read
            L = (nz - 1) * ty * tw + (vy - 1) * tw + vx
            src = xf[:, z0 * YX + y0 * X + x0 :]
            view = as_strided(src, shape=(C, kz, ky, kx, L), strides=(xf.strides[0], YX * it, X * it, it, it))
            cols[..., :L] = view
            if L < blen:
                cols[..., L:] = 0  # garbage columns are discarded, but keep them finite
            matmul(w2, cols2, res)
            bias_act(res, b, act, parallel=False)
            # a short last block of planes: only its first nz * ty * tw columns matter
            done = res[:, : nz * ty * tw].reshape(O, nz, ty, tw)
            out[n, :, z0 : z0 + nz, y0 : y0 + vy, x0 : x0 + vx] = done[:, :, :vy, :vx]
    return out


def conv_direct_gemm_memory(n, c_in, c_out, in_shape, kernel, max_bytes=None) -> int:
    """Predicted peak bytes of :func:`conv_direct_gemm`: output + lowered block + product.

    Assumes a contiguous float32 input (otherwise a converted copy is added) and
    ``out=None``.
    """
    if math.prod(kernel) == 1:  # no lowering: the output only
        return F32 * n * c_out * math.prod(in_shape)
    tz, ty, tw = _gemm_blocks(tuple(in_shape), tuple(kernel), c_in, c_out, max_bytes)
    blen = tz * ty * tw
    work = F32 * blen * (c_in * math.prod(kernel) + c_out)
    return F32 * n * c_out * math.prod(conv_out_shape(in_shape, kernel)) + work


@with_host_variant
def bias_act(y, b, act, parallel: bool = True):
    """``y[o] = act(y[o] + b[o])`` in place on an ``(O, P)`` array (``b`` or ``act`` None: not
    applied); ``parallel``: the host variant may use its threads (not between BLAS calls)."""
    if b is not None:
        y += b.reshape(-1, 1)
    if act is not None:
        apply_activation(y, *act, out=y)
    return y


@bias_act.host
def _bias_act_host(y, b, act, parallel: bool = True):
    """Host variant: bias and activation in one numba pass (the fused epilogues; others in two)."""
    if act is not None and act[0] not in FUSABLE:
        return bias_act.generic(y, b, act)
    if b is None and act is None:
        return y
    code, alpha = epilogue(act)
    bias = np.zeros(y.shape[0], np.float32) if b is None else b
    (_bias_act if parallel else _bias_act_block)(y, bias, code, np.float32(alpha))
    return y


# ----------------------------------------------------------------------------- numba
@njit(nogil=True, cache=True, inline="always")
def _bias_act_row(row, add, j0, j1, code, alpha):  # pragma: no cover - compiled
    for j in range(np.uint64(j0), np.uint64(j1)):
        row[j] = row[j] + add
    act_row(row, j0, j1, code, alpha)


_BIAS_CHUNK = 1 << 14


@njit(nogil=True, cache=True, fastmath={"contract"})
def _bias_act_tasks(y, b, code, alpha, t0, t1):  # pragma: no cover - compiled
    """y[o] = act(y[o] + b[o]) (the epilogue ``(code, alpha)``), in place (y: (O, P) contiguous),
    for the tasks [t0, t1) of O x ceil(P / _BIAS_CHUNK) (a row's chunk each)."""
    O, P = y.shape
    nc = (P + _BIAS_CHUNK - 1) // _BIAS_CHUNK
    for t in range(t0, t1):
        o, j0 = t // nc, (t % nc) * _BIAS_CHUNK
        _bias_act_row(y[o], b[o], j0, min(P, j0 + _BIAS_CHUNK), code, alpha)


def _bias_act(y, b, code, alpha):
    """:func:`_bias_act_tasks` over the whole output, on the run's threads."""
    tasks = y.shape[0] * (-(-y.shape[1] // _BIAS_CHUNK))
    split_tasks(lambda t0, t1: _bias_act_tasks(y, b, code, alpha, t0, t1), tasks)


@njit(nogil=True, cache=True, fastmath={"contract"})
def _bias_act_block(y, b, code, alpha):  # pragma: no cover - compiled
    """:func:`_bias_act` on one thread: for the lowered path's blocks, between BLAS calls (a
    parallel region there waited on OpenBLAS's spinning threads: the detector's 1 -> 28 (1,5,5)
    layer with a fused ELU took 160 ms against 21)."""
    O, P = y.shape
    for o in range(O):
        _bias_act_row(y[o], b[o], 0, P, code, alpha)


_OB = 4  # output channels per task: each loaded input value feeds 4 accumulators
#: input values per row the numba loop runs at once: output rows shorter than this are grouped
#: (the host's own value is measured: :mod:`.tuning` ``direct.row_group``)
#: a row's fixed cost (its taps' weights, the loop's start and vector remainder) in values of the
#: row: 24 -> 24 3^3 convs on 1 x 34^3 ... 512 x 6^3 inputs ran at 0.94 ... 0.42 of the long-row rate
ROW_OVERHEAD = 30


def _row_group(in_spatial, kernel) -> tuple[int, int]:
    """``(rows, values)``: output rows per grouped row and its length (gaps included)."""
    y, x = int(in_spatial[1]), int(in_spatial[2])
    yo, xo = y - int(kernel[1]) + 1, x - int(kernel[2]) + 1
    rows = max(1, min(yo, tuning.get("direct.row_group") // x))
    return rows, (rows - 1) * x + xo


def direct_numba_tiles(in_spatial, kernel) -> bool:
    """Whether :func:`conv_direct_numba` runs this layer on register tiles (output rows of at least
    one tile, :data:`TILE_WIDTH` values) rather than on its loop of grouped rows."""
    return int(in_spatial[2]) - int(kernel[2]) + 1 >= TILE_WIDTH


def direct_numba_efficiency(c_out, in_spatial, kernel) -> float:
    """The fraction of :func:`conv_direct_numba`'s full rate that is useful output on this layer.
    On register tiles (:func:`direct_numba_tiles`): the row's values over its tiles' (the last
    one shifted back recomputes some), times the channels over the blocks' (a lone channel's tile
    is bound by its loads: :data:`LONE_CHANNEL` of a block's rate per channel).  On grouped rows:
    the output values a grouped row keeps over the values it computes plus its fixed cost, times
    the real channels over the padded ones (whole blocks of 4)."""
    xo = int(in_spatial[2]) - int(kernel[2]) + 1
    if direct_numba_tiles(in_spatial, kernel):
        c = int(c_out)
        blocks = c // _TR + (c % _TR) / (_TR * LONE_CHANNEL)
        return xo / (-(-xo // TILE_WIDTH) * TILE_WIDTH) * c / (blocks * _TR)
    rows, values = _row_group(in_spatial, kernel)
    channels = int(c_out) / (-(-int(c_out) // _OB) * _OB)
    return channels * rows * xo / (values + ROW_OVERHEAD)


# One input row's kx taps into _OB output rows, the taps written out: each output value is
# loaded and stored once per row, not once per tap (with one FMA per store the loop ran at a
# quarter of the FMA rate: n337's 1 -> 24 3^3 layer 42 GF/s on 2 cores).
@njit(nogil=True, cache=True, fastmath=FAST, inline="always")
def _taps3(acc, row, w, n):  # pragma: no cover - compiled
    a0, a1, a2 = w[0, 0], w[0, 1], w[0, 2]
    b0, b1, b2 = w[1, 0], w[1, 1], w[1, 2]
    c0, c1, c2 = w[2, 0], w[2, 1], w[2, 2]
    d0, d1, d2 = w[3, 0], w[3, 1], w[3, 2]
    for i in range(np.uint64(n)):
        r0, r1, r2 = row[i], row[i + np.uint64(1)], row[i + np.uint64(2)]
        acc[0, i] += a0 * r0 + a1 * r1 + a2 * r2
        acc[1, i] += b0 * r0 + b1 * r1 + b2 * r2
        acc[2, i] += c0 * r0 + c1 * r1 + c2 * r2
        acc[3, i] += d0 * r0 + d1 * r1 + d2 * r2


@njit(nogil=True, cache=True, fastmath=FAST, inline="always")
def _taps4(acc, row, w, n):  # pragma: no cover - compiled
    a0, a1, a2, a3 = w[0, 0], w[0, 1], w[0, 2], w[0, 3]
    b0, b1, b2, b3 = w[1, 0], w[1, 1], w[1, 2], w[1, 3]
    c0, c1, c2, c3 = w[2, 0], w[2, 1], w[2, 2], w[2, 3]
    d0, d1, d2, d3 = w[3, 0], w[3, 1], w[3, 2], w[3, 3]
    for i in range(np.uint64(n)):
        r0, r1, r2, r3 = row[i], row[i + np.uint64(1)], row[i + np.uint64(2)], row[i + np.uint64(3)]
        acc[0, i] += a0 * r0 + a1 * r1 + a2 * r2 + a3 * r3
        acc[1, i] += b0 * r0 + b1 * r1 + b2 * r2 + b3 * r3
        acc[2, i] += c0 * r0 + c1 * r1 + c2 * r2 + c3 * r3
        acc[3, i] += d0 * r0 + d1 * r1 + d2 * r2 + d3 * r3


@njit(nogil=True, cache=True, fastmath=FAST, inline="always")
def _taps5(acc, row, w, n):  # pragma: no cover - compiled
    a0, a1, a2, a3, a4 = w[0, 0], w[0, 1], w[0, 2], w[0, 3], w[0, 4]
    b0, b1, b2, b3, b4 = w[1, 0], w[1, 1], w[1, 2], w[1, 3], w[1, 4]
    c0, c1, c2, c3, c4 = w[2, 0], w[2, 1], w[2, 2], w[2, 3], w[2, 4]
    d0, d1, d2, d3, d4 = w[3, 0], w[3, 1], w[3, 2], w[3, 3], w[3, 4]
    for i in range(np.uint64(n)):
        r0, r1, r2 = row[i], row[i + np.uint64(1)], row[i + np.uint64(2)]
        r3, r4 = row[i + np.uint64(3)], row[i + np.uint64(4)]
        acc[0, i] += a0 * r0 + a1 * r1 + a2 * r2 + a3 * r3 + a4 * r4
        acc[1, i] += b0 * r0 + b1 * r1 + b2 * r2 + b3 * r3 + b4 * r4
        acc[2, i] += c0 * r0 + c1 * r1 + c2 * r2 + c3 * r3 + c4 * r4
        acc[3, i] += d0 * r0 + d1 * r1 + d2 * r2 + d3 * r3 + d4 * r4


@njit(nogil=True, cache=True, fastmath=FAST)
def _sums(acc, x, w, b, n, o0, z, y0, L, X):  # pragma: no cover - compiled
    """acc[q, :L] = b[o0 + q] + the taps over every input row of the grouped output row from y0
    of plane z, for the _OB output channels from o0 (both kernels' inner loops).  Called, not
    inlined: compiled once for the two kernels (inlined in each, it took 2.7-3.1 s of a first
    warmup's compiling twice; a call per row group and block of channels sums C x kz x ky rows)."""
    C = x.shape[1]
    kz, ky, kx = w.shape[2], w.shape[3], w.shape[4]
    for q in range(_OB):
        for i in range(L):
            acc[q, i] = b[o0 + q]
    for c in range(C):
        for dz in range(kz):
            plane = x[n, c, z + dz]
            for dy in range(ky):
                s = (y0 + dy) * X
                row = plane[s : s + L + kx - 1]
                if kx == 3:  # a row's taps summed in registers: 3 FMAs per store
                    _taps3(acc, row, w[o0 : o0 + _OB, c, dz, dy], L)
                    continue
                if kx == 4:
                    _taps4(acc, row, w[o0 : o0 + _OB, c, dz, dy], L)
                    continue
                if kx == 5:
                    _taps5(acc, row, w[o0 : o0 + _OB, c, dz, dy], L)
                    continue
                for dx in range(kx):
                    w0 = w[o0, c, dz, dy, dx]
                    w1 = w[o0 + 1, c, dz, dy, dx]
                    w2 = w[o0 + 2, c, dz, dy, dx]
                    w3 = w[o0 + 3, c, dz, dy, dx]
                    for i in range(L):
                        v = row[i + dx]
                        acc[0, i] += w0 * v
                        acc[1, i] += w1 * v
                        acc[2, i] += w2 * v
                        acc[3, i] += w3 * v


@njit(nogil=True, cache=True, fastmath=FAST)
def _conv_numba_kernel(x, w, b, out, X, G, code, alpha, t0, t1):  # pragma: no cover - compiled
    # x: (N, C, Z, Y * X), each plane flattened.  G output rows at a time run as one row of
    # (G - 1) * X + Xo values (the X - Xo values between two rows are computed and dropped):
    # short rows (a fragment's 6-8 voxels) then still fill the vector registers.
    # w and b have whole blocks of _OB output channels (zero-padded): a last, partial block runs
    # the same register loops and stores its real channels only.
    _, O, Zo, Yo, Xo = out.shape
    nob = w.shape[0] // _OB
    for t in range(t0, t1):  # tasks N * nob * Zo (:func:`.threads.split_tasks`)
        n = t // (nob * Zo)
        o0 = ((t // Zo) % nob) * _OB
        z = t % Zo
        no = min(_OB, O - o0)
        acc = np.empty((_OB, (G - 1) * X + Xo), np.float32)
        for y0 in range(0, Yo, G):
            g = min(G, Yo - y0)
            L = (g - 1) * X + Xo
            _sums(acc, x, w, b, n, o0, z, y0, L, X)
            for q in range(no):
                act_row(acc[q], 0, L, code, alpha)
                for r in range(g):  # unsigned: numba's check for negative indices kept this loop scalar
                    base = np.uint64(r * X)
                    for xx in range(np.uint64(Xo)):
                        out[n, o0 + q, z, y0 + r, xx] = acc[q, base + xx]


@njit(nogil=True, cache=True, fastmath=FAST)
def _conv_numba_kernel_cl(x, w, b, out, X, G, code, alpha, t0, t1):  # pragma: no cover - compiled
    # :func:`_conv_numba_kernel` writing channels last: ``out`` is the (N, Zo, Yo, Xo, O) memory.
    # A task is one group of G output rows of a plane, every block of _OB channels in turn: its
    # output rows are one run of memory no other task writes (a task per channel block would
    # write every cache line of the output from several threads, 4 of its 24-48 channels each).
    _, Zo, Yo, Xo, O = out.shape
    nob = w.shape[0] // _OB
    ng = (Yo + G - 1) // G
    of = out.reshape(-1)
    for t in range(t0, t1):  # tasks N * Zo * ng
        n = t // (Zo * ng)
        z = (t // ng) % Zo
        y0 = (t % ng) * G
        g = min(G, Yo - y0)
        L = (g - 1) * X + Xo
        acc = np.empty((_OB, (G - 1) * X + Xo), np.float32)
        for ob in range(nob):
            o0 = ob * _OB
            no = min(_OB, O - o0)
            _sums(acc, x, w, b, n, o0, z, y0, L, X)
            for q in range(no):
                act_row(acc[q], 0, L, code, alpha)
            u, O_ = np.uint64, np.uint64(O)
            for r in range(g):
                base = u(r * X)
                dst = u(((n * Zo + z) * Yo + y0 + r) * Xo) * O_ + u(o0)
                if no == _OB:  # unsigned indices, one flat array: LLVM interleaves the 4 rows in vectors
                    for xx in range(u(Xo)):
                        d = dst + xx * O_
                        of[d] = acc[0, base + xx]
                        of[d + u(1)] = acc[1, base + xx]
                        of[d + u(2)] = acc[2, base + xx]
                        of[d + u(3)] = acc[3, base + xx]
                else:
                    for xx in range(u(Xo)):
                        for q in range(no):
                            of[dst + xx * O_ + u(q)] = acc[q, base + xx]


# ----------------------------------------------------------------------------- register tiles
# Output rows of at least one tile run on register tiles (:func:`.microkernel.fma_taps`): a tile
# keeps ``rows`` output channels x ``nv`` vectors along x in registers over every tap (input
# channel, kernel row, shift along x), loads each input vector once per shift for all its
# channels and stores once.  The loop above keeps its sums in memory rows (a load and a store of
# each per kernel row) and blocks of 4 channels (one output channel ran 4 times its work): the
# 28 -> 1 (1,5,5) last layer of the synapse detector ran at 5 GMAC/s on one Xeon core, 1 -> 28 at
# 12-17.  Blocks of 4 channels, the rest one at a time; ``nv`` the most vectors (up to 4) that
# leave a block's sums, its loads and a broadcast in the registers (4 with AVX-512, 3 with AVX2);
# the last tile of a row shifted back to end with it.
_TR = 4
_TNV = min(4, (microkernel.REGISTERS - 1) // (_TR + 1))
(_R0, _N0, _V0), (_R1, _N1, _V1) = (_TR, _TNV, microkernel.VL), (1, _TNV, microkernel.VL)
#: output values along x per register tile: rows of at least this many run on tiles
TILE_WIDTH = _TNV * microkernel.VL
#: a lone channel's tile (1 x ``nv`` vectors: a load per multiply-add) against a block of 4's rate
#: per channel: 17 against 43 GMAC/s on one Xeon core (28 -> 1 and 28 -> 4 (1,5,5), 16 x 128^2)
LONE_CHANNEL = 0.4


@njit(nogil=True, cache=True)
def _conv_taps_kernel(x, w, b, offs, out, dims, cl, code, alpha, t0, t1):  # pragma: no cover - compiled
    """Output rows ``[t0, t1)`` of ``N * Zo * Yo`` on register tiles: ``x`` the flat input
    (N, C, Z, Y, X), ``w`` the flat weights (O, K1 * kx), ``offs`` the K1 input rows' offsets,
    ``out`` the flat output, channels first (N, O, Zo, Yo, Xo) or with ``cl`` last (N, Zo, Yo, Xo,
    O: a tile's every channel into a scratch, then written voxel by voxel, each voxel's channels
    one run; strided stores of each channel's row ran the layer 1.5x slower); ``dims`` (O, Zo,
    Yo, Xo, kx, input item, plane and row strides).  ELU (code 3) runs on each tile's rows after
    it (the tile's epilogue: ReLU, leaky)."""
    O, Zo, Yo, Xo, kx, sn, sz, sy = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7]
    K1, ar = offs.size, offs.size * kx
    tcode = code if code < 3 else 0
    W = TILE_WIDTH
    scratch = np.empty(O * W if cl else 0, np.float32)
    plane = Zo * Yo * Xo
    for t in range(t0, t1):
        n, zy = t // (Zo * Yo), t % (Zo * Yo)
        xin = n * sn + (zy // Yo) * sz + (zy % Yo) * sy
        for x0 in range(0, Xo, W):
            x0 = min(x0, Xo - W)  # the last tile ends with the row
            o = 0
            while o < O:
                rows = _TR if O - o >= _TR else 1
                c, co, ldc = (scratch, o * W, W) if cl else (out, (n * O + o) * plane + zy * Xo + x0, plane)
                if rows == _TR:
                    microkernel.fma_taps(
                        _R0, _N0, _V0, w, o * ar, ar, x, xin + x0, offs, K1, kx, c, co, ldc, b, o, tcode, alpha
                    )
                else:
                    microkernel.fma_taps(
                        _R1, _N1, _V1, w, o * ar, ar, x, xin + x0, offs, K1, kx, c, co, ldc, b, o, tcode, alpha
                    )
                if code == 3:
                    for r in range(rows):
                        act_row(c, co + r * ldc, co + r * ldc + W, code, alpha)
                o += rows
            if cl:  # the tile's channel rows to voxels of O channels
                transpose_block(scratch, 0, W, out, ((n * Zo * Yo + zy) * Xo + x0) * O, O, O, W)


def _conv_taps(x, w, b, code, alpha, out, channels_last):
    """:func:`conv_direct_numba` on register tiles (output rows of at least :data:`TILE_WIDTH`)."""
    n, c, z, y, xw = x.shape
    o, _, kz, ky, kx = w.shape
    xf = np.ascontiguousarray(x).reshape(-1)
    offs = np.array(
        [ci * z * y * xw + dz * y * xw + dy * xw for ci in range(c) for dz in range(kz) for dy in range(ky)], np.int64
    )
    _, zo, yo, xo = out.shape[1:]
    dims = np.array([o, zo, yo, xo, kx, c * z * y * xw, y * xw, xw], np.int64)
    dst = memory_order(out).reshape(-1) if channels_last else out.reshape(-1)
    wf = np.ascontiguousarray(w).reshape(-1)
    args = (xf, wf, b, offs, dst, dims, channels_last, code, np.float32(alpha))
    split_tasks(lambda t0, t1: _conv_taps_kernel(*args, t0, t1), n * zo * yo)
    return out


# ----------------------------------------------------------------------------- channels-last input
# A few output channels on a channels-last input (a U-Net's last layer after a channels-last
# decoder: the synapse detector's 28 -> 1 (1,5,5)) run on :func:`.microkernel.fma_channels`: a
# voxel's input channels as whole vectors, a tile of voxels along x in registers, each output
# channel's row in turn.  The register tiles above need the input channels first: the layer
# before then wrote a channels-first output, the transposition 30-60 ms of a 110 ms layer on
# 18 x 320^2.  A tile's voxels: the most (up to 12) whose sums, a kernel row's weights and a
# voxel's vectors fit the registers; one compiled kernel per (vectors a voxel, taps along x),
# made on first use.
_CV = microkernel.VL
#: at most this many output channels: each runs over the input rows on its own
CHANNELS_LAST_MAX_OUT = 4


def _channels_rows(nv: int, kx: int) -> int:
    """Voxels per :func:`.microkernel.fma_channels` tile of ``nv`` vectors a voxel, ``kx`` taps: the
    most whose sums fit the registers beside a kernel row's weights and a voxel's vectors, with
    three to spare (with one to spare, 28 -> 1 (1,5,5) tiles of 9 voxels spilled their sums and ran
    1.6x slower than tiles of 8 on one Xeon core)."""
    return max(1, min(12, (microkernel.REGISTERS - nv * (kx + 1) - 4) // nv))


def reads_channels_last(c_in, c_out, in_spatial, kernel) -> bool:
    """Whether :func:`conv_direct_numba` reads this layer's input channels last in place
    (:func:`.microkernel.fma_channels`): a few output channels, one to four vectors of input
    channels a voxel, 1-5 taps along x, tiles of at least 4 voxels (AVX2's 16 registers hold
    fewer beside two vectors a voxel and 5 taps: the channels-first tiles then), output rows of a
    tile or more."""
    nv, kx = -(-int(c_in) // _CV), int(kernel[2])
    if not (int(c_out) <= CHANNELS_LAST_MAX_OUT and _CV <= int(c_in) and nv <= 4 and 1 <= kx <= 5):
        return False
    rows = _channels_rows(nv, kx)
    return rows >= 4 and int(in_spatial[2]) - kx + 1 >= rows


def _channels_kernel(nv: int, kx: int):
    """``kernel(x, w, b, offs, out, dims, code, alpha, t0, t1)``: output rows ``[t0, t1)`` of
    ``N * Zo * Yo`` on tiles of ``nv`` vectors a voxel and ``kx`` taps: ``x`` the flat channels-last
    input (N, Z, Y, X, C), ``w`` the packed weights (O, K1, kx, nv, vl), ``offs`` the K1 kernel
    rows' offsets, ``out`` the flat output (N, O, Zo, Yo, Xo); ``dims`` (O, Zo, Yo, Xo, C, input
    item, plane and row strides).  Each output channel's row in tiles (the last shifted back to
    end with it), then its epilogue."""
    R = _channels_rows(nv, kx)

    @njit(nogil=True, cache=True)
    def kernel(x, w, b, offs, out, dims, code, alpha, t0, t1):  # pragma: no cover - compiled
        O, Zo, Yo, Xo, C = dims[0], dims[1], dims[2], dims[3], dims[4]
        sn, sz, sy = dims[5], dims[6], dims[7]
        K1 = offs.size
        ar = K1 * kx * nv * _CV
        for t in range(t0, t1):
            n, zy = t // (Zo * Yo), t % (Zo * Yo)
            xin = n * sn + (zy // Yo) * sz + (zy % Yo) * sy
            for o in range(O):
                row = ((n * O + o) * Zo * Yo + zy) * Xo
                for x0 in range(0, Xo, R):
                    x0 = min(x0, Xo - R)
                    microkernel.fma_channels(
                        R, nv, _CV, kx, w, o * ar, x, xin + x0 * C, offs, K1, C, out, row + x0, 1, b[o]
                    )
                if code:
                    act_row(out, row, row + Xo, code, alpha)

    return kernel


_CHANNELS_KERNELS: dict = {}


def _conv_channels(x, w, b, code, alpha, out):
    """:func:`conv_direct_numba` on a channels-last input ``x`` (:func:`reads_channels_last`)."""
    n, c, z, y, xw = x.shape
    o, _, kz, ky, kx = w.shape
    nv = -(-c // _CV)
    # per output channel and tap, nv vectors of weights: the last one's first channel C - VL, its
    # lanes counted by the vector before zero
    packed = np.zeros((o, kz, ky, kx, nv, _CV), np.float32)
    wt = np.ascontiguousarray(w.transpose(0, 2, 3, 4, 1))  # (O, kz, ky, kx, C)
    for v in range(nv - 1):
        packed[..., v, :] = wt[..., v * _CV : (v + 1) * _CV]
    done = (nv - 1) * _CV
    packed[..., nv - 1, done - (c - _CV) :] = wt[..., done:]
    offs = np.array([(dz * y + dy) * xw * c for dz in range(kz) for dy in range(ky)], np.int64)
    _, zo, yo, xo = out.shape[1:]
    dims = np.array([o, zo, yo, xo, c, z * y * xw * c, y * xw * c, xw * c], np.int64)
    xf = memory_order(x).reshape(-1)
    args = (xf, packed.reshape(-1), b, offs, out.reshape(-1), dims, code, np.float32(alpha))
    kernel = _CHANNELS_KERNELS.get((nv, kx))
    if kernel is None:
        kernel = _CHANNELS_KERNELS[nv, kx] = _channels_kernel(nv, kx)
    split_tasks(lambda t0, t1: kernel(*args, t0, t1), n * zo * yo)
    return out


def conv_direct_numba(x, w, b=None, *, act=None, channels_last=False, tiles=None):
    """Valid 3-D convolution by numba loops on the run's threads (numpy arrays only).

    Output rows of at least :data:`TILE_WIDTH` values run on register tiles (4 output channels,
    or one, x a tile of the row summed over every tap in registers; a task an output row).
    Otherwise parallel over (item, block of 4 output channels, output plane); each task keeps
    one output row per channel in registers/L1 and streams the input rows.  Rows shorter
    than ``direct.row_group`` input values run several at a time as one row with gaps (MPF
    fragments' rows are 6-8 voxels); a last block of fewer than 4 channels runs on
    zero-padded weights.  With ``channels_last`` the output is a channels-last array
    (:mod:`.layout`), a task then a group of output rows over every block of channels.  A
    channels-last input of a layer with a few output channels (:func:`reads_channels_last`) is
    read in place, a voxel's channels as whole vectors; any other is read channels first.

    Parameters
    ----------
    x : ndarray, shape (N, C_in, Z, Y, X)
    w : ndarray, shape (C_out, C_in, kz, ky, kx)
    b : ndarray, shape (C_out,), or None
    act : ``(kind, alpha)`` or None
        An activation applied as the output is written (a fused activation).
    channels_last : bool
        Write the output channels last (``(N, Z, Y, X, C)`` memory).
    tiles : bool or None
        Run on register tiles or on grouped rows; None: tiles where the output rows are at least
        :data:`TILE_WIDTH` long (:func:`direct_numba_tiles`).  Tiles need such rows.

    Returns
    -------
    ndarray, shape (N, C_out, Zo, Yo, Xo), float32
    """
    if (
        isinstance(x, np.ndarray)
        and is_channels_last(x)
        and x.dtype == np.float32
        and getattr(w, "ndim", None) == 5
        and w.shape[1] == x.shape[1]
        and tiles is None
        and min(conv_out_shape(x.shape[2:], w.shape[2:])) >= 1
        and reads_channels_last(x.shape[1], w.shape[0], x.shape[2:], w.shape[2:])
    ):
        o = w.shape[0]
        shape = (x.shape[0], o) + conv_out_shape(x.shape[2:], w.shape[2:])
        w = np.ascontiguousarray(w, dtype=np.float32)
        bias = np.zeros(o, np.float32) if b is None else np.ascontiguousarray(b, dtype=np.float32)
        if bias.shape != (o,):
            raise InputError(f"bias must have shape ({o},); got {bias.shape}")
        y = _conv_channels(x, w, bias, *epilogue(act), arena.empty(shape))
        if channels_last and o > 1:
            out = empty_channels_last(shape)
            out[...] = y
            return out
        return y
    xp, x, w, b = _validate(x, w, b)
    if xp is not np:
        raise InputError("conv_direct_numba runs on numpy arrays only; use conv_direct_gemm or FFTConv on the GPU")
    o = w.shape[0]
    shape = (x.shape[0], o) + conv_out_shape(x.shape[2:], w.shape[2:])
    out = empty_channels_last(shape) if channels_last else arena.empty(shape)
    code, alpha = epilogue(act)
    fits = direct_numba_tiles(x.shape[2:], w.shape[2:])
    if tiles and not fits:  # a tile reaching past the row would read and write beyond the arrays
        raise InputError(
            f"conv_direct_numba(tiles=True): output rows of {shape[4]} values are shorter than a register tile "
            f"({TILE_WIDTH}); leave tiles=None to choose"
        )
    if fits if tiles is None else tiles:
        bias = np.zeros(o, np.float32) if b is None else np.ascontiguousarray(b, dtype=np.float32)
        return _conv_taps(x, w, bias, code, alpha, out, channels_last)
    pad = -o % _OB  # a partial last block of output channels: zero weights, never stored
    if pad:
        w = np.concatenate([w, np.zeros((pad,) + w.shape[1:], np.float32)])
    bp = np.zeros(o + pad, np.float32)
    if b is not None:
        bp[:o] = b
    n, c, z, y, xw = x.shape
    rows, _ = _row_group(x.shape[2:], w.shape[2:])
    zo, yo = out.shape[2], out.shape[3]
    if channels_last:
        kernel, dst, tasks = _conv_numba_kernel_cl, memory_order(out), n * zo * (-(-yo // rows))
    else:
        kernel, dst, tasks = _conv_numba_kernel, out, n * ((o + pad) // _OB) * zo
    args = (x.reshape(n, c, z, y * xw), np.ascontiguousarray(w), bp, dst, xw, rows, code, np.float32(alpha))
    split_tasks(lambda t0, t1: kernel(*args, t0, t1), tasks)
    return out


def conv_direct_numba_memory(n, c_in, c_out, in_shape, kernel) -> int:
    """Predicted peak bytes of :func:`conv_direct_numba`: its output (per-thread row
    buffers are a few KiB), contiguous float32 input assumed."""
    return F32 * n * c_out * math.prod(conv_out_shape(in_shape, kernel))
