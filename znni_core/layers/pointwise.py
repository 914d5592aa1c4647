"""Runs of 1x1x1 convolutions, block by block in cache, on a register-blocked micro-kernel.

A 1x1x1 convolution is ``W (C_out, C_in) @ x (C_in, voxels)``.  BLAS runs that product well
only for wide layers: at 24 maps OpenBLAS's small GEMM reached 66 GFLOP/s on one core, and
the bias, the activation and the transposes BLAS's layout needs around it added 45% (the
4-layer, 24-map chain ran at 29% of the sgemm peak on 2 cores).  Here one tile of the output,
``OB`` channels x ``TV`` voxels (8 x 32 with AVX-512: 16 vector accumulators), is summed over
all input channels in registers, then gets its bias and activation and is stored once,
channels first: no transposes, no second pass.  The tile is LLVM IR (:func:`~.microkernel.fma_tile`, a numba
intrinsic: ``<VL x float>`` loads, splats and ``llvm.fma``); numba compiles and caches the
loops around it.  On one core the tile ran at 80-100 GFLOP/s at 24, 48 and 80 maps, where
OpenBLAS's product alone ran at 66, 80-92 and 92-96.

:func:`conv_pointwise_chain` copies ``block`` voxels of every input channel into a buffer
and takes them through every stage while they are in cache (two buffers of ``block x C``
floats, rows padded); the last stage's rows are copied out.  The 4-stage chain on 32 x 128^2
voxels, 2 threads, same process, interleaved, medians of 15 (against the OpenBLAS chain it
replaces): 24 maps 18.5 ms (33.7), 48 maps 54.7 ms (79.3), 80 maps 142 ms (197); the best
runs at 78%, 92% and 100% of the 2048^3 sgemm rate.

Reference: ``tests/test_layers_conv.py`` checks it against float64 and PyTorch products (both
vector widths) and ``tests/test_epilogue.py`` against
:func:`~znni_core.layers.activation.apply_activation`.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from . import arena, microkernel, tuning
from ._numba import njit
from .activation import apply_activation
from .epilogue import FUSABLE, act_row
from .layout import empty_channels_last, is_channels_last, memory_order
from .microkernel import fma_tile
from .threads import each_worker
from .transform_vectors import transpose_block

__all__ = ["POINTWISE_BLOCK", "conv_pointwise_chain", "pack_weights"]


#: floats per vector (:mod:`.microkernel`)
VL = microkernel.VL
#: voxels per tile: two vectors
TV = 2 * VL
#: output channels per full tile: 8 x 2 accumulators fit AVX-512's 32 registers, 4 x 2 AVX2's 16
OB = 8 if microkernel.REGISTERS == 32 else 4
#: voxels per block of :func:`conv_pointwise_chain` by default (a multiple of ``TV``; the host's
#: own is measured, :mod:`.tuning` ``pointwise.block``): at 48 maps its two
#: buffers take 384 KiB, half of L2; 2048 ran 2-6% slower at 48 and 80 maps, as fast at 24
POINTWISE_BLOCK = tuning.DEFAULTS["pointwise.block"]
#: floats of padding after each buffer row: rows a power of two apart share the cache's sets
PAD = 16


@njit(nogil=True, cache=True, inline="always")
def _tile(ob, x, xo, ldx, w, wo, b, bo, y, yo, ldy, C, code, alpha):  # pragma: no cover - compiled
    """For ``k < ob`` and ``v < TV``, ``y[yo + k*ldy + v] = act(b[bo + k] + sum_c w[wo + c*ob + k] *
    x[xo + c*ldx + v])`` (:func:`~.microkernel.fma_tile`: ``w`` packed, :func:`pack_weights`;
    ``act`` the epilogue ``code`` 0 none, 1 ReLU, 2 leaky ReLU of slope ``alpha``; ELU runs after it)."""
    if ob == OB:
        fma_tile(OB, 2, VL, w, wo, 1, OB, x, xo, ldx, y, yo, ldy, C, b, bo, code, alpha)
    elif ob == 4:
        fma_tile(4, 2, VL, w, wo, 1, 4, x, xo, ldx, y, yo, ldy, C, b, bo, code, alpha)
    elif ob == 2:
        fma_tile(2, 2, VL, w, wo, 1, 2, x, xo, ldx, y, yo, ldy, C, b, bo, code, alpha)
    else:
        fma_tile(1, 2, VL, w, wo, 1, 1, x, xo, ldx, y, yo, ldy, C, b, bo, code, alpha)


def pack_weights(w) -> np.ndarray:
    """``w`` (C_out, C_in) in the tiles' order: output channels in runs of ``OB`` (then 4, 2,
    1 for the rest), each run ``(C_in, run)`` flat; the run at channel ``o0`` starts at
    ``o0 * C_in``."""
    w = np.asarray(w, np.float32)
    O = w.shape[0]
    out, o0 = [], 0
    for r in _runs(O):
        out.append(w[o0 : o0 + r].T.reshape(-1))
        o0 += r
    return np.concatenate(out) if out else np.empty(0, np.float32)


def _runs(O: int) -> list:
    """The tiles' output-channel counts for ``O`` channels, in order."""
    runs = [OB] * (O // OB)
    rest = O % OB
    for r in (4, 2, 1):
        if r < OB and rest >= r:
            runs.append(r)
            rest -= r
    return runs


@njit(nogil=True, cache=True)
def _stage(x, ldx, wp, wo, b, bo, y, ldy, C, O, nv, code, alpha):  # pragma: no cover - compiled
    """``y[o*ldy + v] = act(b[bo + o] + sum_c W[o, c] x[c*ldx + v])`` for ``v < nv`` (a multiple
    of ``TV``), ``W`` packed at ``wp[wo:]`` (:func:`pack_weights`)."""
    for v0 in range(0, nv, TV):
        o0 = 0
        while o0 + OB <= O:
            _tile(OB, x, v0, ldx, wp, wo + o0 * C, b, bo + o0, y, o0 * ldy + v0, ldy, C, code, alpha)
            o0 += OB
        if OB > 4 and O - o0 >= 4:
            _tile(4, x, v0, ldx, wp, wo + o0 * C, b, bo + o0, y, o0 * ldy + v0, ldy, C, code, alpha)
            o0 += 4
        if O - o0 >= 2:
            _tile(2, x, v0, ldx, wp, wo + o0 * C, b, bo + o0, y, o0 * ldy + v0, ldy, C, code, alpha)
            o0 += 2
        if O - o0 >= 1:
            _tile(1, x, v0, ldx, wp, wo + o0 * C, b, bo + o0, y, o0 * ldy + v0, ldy, C, code, alpha)
        if code == 3:  # ELU: the tile's rows while in L1
            for o in range(O):
                act_row(y, o * ldy + v0, o * ldy + v0 + TV, code, alpha)


@njit(nogil=True, cache=True)
def _chain(
    x, cl, C0, P, wp, b, dims, codes, alphas, y, cl_out, jobs, block, ld, buf0, buf1
):  # pragma: no cover - compiled
    """Every stage on each ``(n, j0)`` of ``jobs``: ``block`` voxels from ``j0`` of item ``n``.
    ``x`` flat, channels-first ``(N, C0, P)`` or (``cl``) channels-last ``(N, P, C0)``; ``y``
    flat ``(N, C_out, P)`` or (``cl_out``) ``(N, P, C_out)``; ``dims[s]`` = (C_in, C_out, weight
    offset, bias offset).  The
    block's channels are copied into ``buf1``, rows ``ld`` apart, zeros after its last voxel up
    to a whole tile (the stages compute whole tiles); stage ``s`` writes ``buf0`` (even ``s``)
    or ``buf1``; the last one's rows are copied into ``y``.  Written in place, ``y``'s rows (a
    volume apart) cost the 4-stage chain 11-19% more at 24-80 maps (2 threads)."""
    S = dims.shape[0]
    O = dims[S - 1, 1]
    zero = np.float32(0.0)
    for t in range(jobs.shape[0]):
        n, j0 = jobs[t, 0], jobs[t, 1]
        nv = min(block, P - j0)
        nt = (nv + TV - 1) // TV * TV
        # unsigned indices: with signed ones numba checks for negative ones and the copies
        # stay scalar (3 GB/s against 10)
        if cl:  # the block's voxels (rows of C0 channels) to channel rows
            transpose_block(x, (n * P + j0) * C0, C0, buf1, 0, ld, nv, C0)
        else:
            for c in range(C0):
                i0, i1 = np.uint64((n * C0 + c) * P + j0), np.uint64(c * ld)
                for v in range(np.uint64(nv)):
                    buf1[i1 + v] = x[i0 + v]
        for c in range(C0):
            for v in range(c * ld + nv, c * ld + nt):
                buf1[v] = zero
        for s in range(S):
            src, dst = (buf1, buf0) if s % 2 == 0 else (buf0, buf1)
            _stage(src, ld, wp, dims[s, 2], b, dims[s, 3], dst, ld, dims[s, 0], dims[s, 1], nt, codes[s], alphas[s])
        fin = buf0 if S % 2 == 1 else buf1
        if cl_out:  # the block's rows transposed while in cache: a voxel's channels are one run
            transpose_block(fin, 0, ld, y, (n * P + j0) * O, O, O, nv)
            continue
        for o in range(O):
            i0, i1 = np.uint64(o * ld), np.uint64((n * O + o) * P + j0)
            for v in range(np.uint64(nv)):
                y[i1 + v] = fin[i0 + v]


def conv_pointwise_chain(x, stages, *, threads=1, block=None, channels_last=False):
    """Consecutive 1x1x1 convolutions, each followed by its activation, block by block of voxels.

    Run layer by layer, every layer would read and write the whole tensor from memory; here
    each block of ``block`` voxels goes through all the stages while it is in cache, and only
    the last stage writes to memory.  Bias and ReLU, leaky ReLU or ELU run in the tile that
    computes the values (module docstring); another activation (sigmoid...) ends a run of
    stages, and applies to that run's whole output.  A channels-last ``x`` (``layers/layout``)
    is read as it is copied into the blocks; ``channels_last``: the output is written channels
    last (each block transposed while in cache).  Workers (``threads``) take whole blocks.

    Parameters
    ----------
    x : ndarray, shape (N, C_in, Z, Y, X), float32
    stages : sequence of ``(w, b, act)``: ``w`` (C_out, C_in, 1, 1, 1), ``b`` (C_out,) or None,
        ``act`` None or ``(kind, alpha)`` (:func:`~znni_core.layers.activation.apply_activation`)

    Returns
    -------
    ndarray, shape (N, C_out of the last stage, Z, Y, X)

    Examples
    --------
    >>> import numpy as np
    >>> x = np.ones((1, 2, 2, 2, 2), np.float32)
    >>> w1, w2 = np.ones((3, 2, 1, 1, 1), np.float32), -np.ones((1, 3, 1, 1, 1), np.float32)
    >>> y = conv_pointwise_chain(x, [(w1, None, ("relu", 0.0)), (w2, np.ones(1, np.float32), None)])
    >>> y.shape, float(y[0, 0, 0, 0, 0])
    ((1, 1, 2, 2, 2), -5.0)
    """
    stages = list(stages)
    c_in = x.shape[1]
    for s, (w, _, _) in enumerate(stages):
        if tuple(w.shape[2:]) != (1, 1, 1) or w.shape[1] != c_in:
            raise InputError(
                f"stage {s}: weights {tuple(w.shape)} do not continue a 1x1x1 chain: expected "
                f"({w.shape[0]}, {c_in}, 1, 1, 1)"
            )
        c_in = w.shape[0]

    def unfused(act):  # an activation the tiles do not apply
        return act is not None and act[0] != "identity" and act[0] not in FUSABLE

    run = next((k + 1 for k, (_, _, a) in enumerate(stages) if unfused(a)), len(stages))
    block = tuning.get("pointwise.block") if block is None else int(block)
    last = run == len(stages)
    y = _fused(x, stages[:run], threads, max(TV, block // TV * TV), channels_last and last)
    if unfused(stages[run - 1][2]):
        apply_activation(y, *stages[run - 1][2], out=y)
    if last:
        return y
    return conv_pointwise_chain(y, stages[run:], threads=threads, block=block, channels_last=channels_last)


def _fused(x, stages, threads, block, cl_out=False):
    """The stages with their activations the tiles apply (another one's: none); ``cl_out``: the
    output channels last."""
    cl = is_channels_last(x) and x.dtype == np.float32
    x = x if cl else np.ascontiguousarray(x, dtype=np.float32)
    N, C = x.shape[:2]
    P = math.prod(x.shape[2:])
    dims, wps, bs = [], [], []
    codes, alphas = [], []
    wo = bo = 0
    for w, b, act in stages:
        w2 = np.asarray(w, np.float32).reshape(w.shape[:2])
        O, Ci = w2.shape
        dims.append((Ci, O, wo, bo))
        wps.append(pack_weights(w2))
        bs.append(np.zeros(O, np.float32) if b is None else np.asarray(b, np.float32).reshape(-1))
        kind, alpha = act if act is not None else ("identity", 0.0)
        codes.append(FUSABLE.get(kind, 0))
        alphas.append(float(alpha))
        wo += O * Ci
        bo += O
    O = dims[-1][1]
    out = empty_channels_last((N, O) + x.shape[2:]) if cl_out else arena.empty((N, O) + x.shape[2:])
    xf = (memory_order(x) if cl else x).reshape(-1)
    yf = (memory_order(out) if cl_out else out).reshape(-1)
    args = (
        np.concatenate(wps),
        np.concatenate(bs),
        np.array(dims, np.int64),
        np.array(codes, np.int64),
        np.array(alphas, np.float32),
    )
    jobs = np.array([(n, j0) for n in range(N) for j0 in range(0, P, block)], np.int64).reshape(-1, 2)
    workers = max(1, min(int(threads), len(jobs)))
    wide = max([C] + [d[1] for d in dims])

    def work(k):
        ld = block + PAD
        bufs = np.empty(ld * wide, np.float32), np.empty(ld * wide, np.float32)
        _chain(xf, cl, C, P, *args, yf, cl_out, np.ascontiguousarray(jobs[k::workers]), block, ld, *bufs)

    each_worker(work, workers)
    return out
