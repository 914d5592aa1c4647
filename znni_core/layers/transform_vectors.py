"""Winograd's 8-point 1D transforms on whole vectors, written as LLVM IR.

numba's loops over the channels (``winograd._bt8``, ``winograd._at8``) run on short runs: the
x pass of a tile row transforms ``C`` values per tile (24-48 channels), the output transform
``C_out`` per tile.  LLVM vectorises such a loop 8 floats wide and unrolls it, so in
AVX2 code a run of 28 went to the scalar remainder almost whole (AVX-512 has masked vector
remainders): the x pass ran 2.5-3x slower than in AVX-512 code on one Zen 4 core.

Here one call transforms ``vl`` lanes (one vector per point: :data:`.microkernel.VL` floats, or
8) and the numba loop steps over a run in whole vectors; a run that is not a whole number of
vectors ends with one vector that overlaps the one before it (its lanes are computed twice, the
same values: the transforms read one buffer and write another).  Runs shorter than a vector stay
on the scalar loops.  Products are fused into multiply-adds where LLVM's contraction allows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._numba import njit

__all__ = [
    "AT8",
    "BT4",
    "BT6",
    "BT8",
    "MAX4",
    "MAX8",
    "TRANSFORM_POINTS",
    "vector_copy",
    "transform_codegen",
    "transpose_block",
    "vector_transform",
    "vector_transpose8",
]

#: ``kind`` of :func:`vector_transform`: the input transform BT (8 values in, 8 out)
BT8 = 0
#: ... the 6-point input transform (6 in, 6 out: ``F(4,3)``'s points 0, +-1, +-2, infinity)
BT6 = 1
#: ... the 4-point input transform (z's ``F(2,3)``: points 0, +-1, infinity)
BT4 = 2
#: ... the maximum of 4 or 8 points (max pooling's 1x2x2 and 2x2x2 windows), one output:
#: ``max(max(x0, x1), max(x2, x3))`` (and of the two halves), each ``max(a, b)`` numba's: ``b``
#: where ``b > a``, else ``a`` (the first when unordered)
MAX4, MAX8 = 4, 8
#: points read per lane by the kinds that read other than 8
TRANSFORM_POINTS = {BT6: 6, BT4: 4, MAX4: 4}
#: ... and the output transform AT: ``AT8 + m`` for ``m`` outputs (4-7)
AT8 = 10


def _bt8(b, x, c):
    """BT d for the 8 points 0, +-1, +-2, +-1/2, infinity (as ``winograd._bt8``)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    add, sub, mul = b.add, b.sub, b.mul
    out = [add(sub(x0, x6), mul(c(5.25), sub(x4, x2)))]
    for (a2, a6, a4), (a1, a5, a3) in (
        ((1.0, 1.0, 4.25), (1.0, 1.0, 4.25)),
        ((0.25, 1.0, 1.25), (0.5, 2.0, 2.5)),
        ((2.0, 0.5, 2.5), (1.0, 0.25, 1.25)),
    ):
        e = sub(add(mul(c(a2), x2), mul(c(a6), x6)), mul(c(a4), x4))
        o = sub(add(mul(c(a1), x1), mul(c(a5), x5)), mul(c(a3), x3))
        out += [add(e, o), sub(e, o)]
    out.append(add(sub(x7, x1), mul(c(5.25), sub(x3, x5))))
    return out


def _bt6(b, x, c):
    """BT d for the 6 points 0, +-1, +-2, infinity (as ``winograd._bt_rows`` with ``a = 6``)."""
    x0, x1, x2, x3, x4, x5 = x
    add, sub, mul = b.add, b.sub, b.mul
    four, five, two = c(4.0), c(5.0), c(2.0)
    d42, d31 = sub(x4, x2), sub(x3, x1)
    return [
        add(sub(mul(four, x0), mul(five, x2)), x4),
        sub(add(x3, x4), mul(four, add(x1, x2))),
        add(sub(x4, x3), mul(four, sub(x1, x2))),
        add(d42, mul(two, d31)),
        sub(d42, mul(two, d31)),
        add(sub(mul(four, x1), mul(five, x3)), x5),
    ]


def _bt4(b, x, c):
    """BT d for the 4 points 0, +-1, infinity (as ``winograd._bt_rows`` with ``a = 4``)."""
    x0, x1, x2, x3 = x
    return [b.sub(x0, x2), b.add(x1, x2), b.sub(x2, x1), b.sub(x1, x3)]


def _at8(b, x, c, m):
    """AT x for ``m`` outputs (as ``winograd._at8``): row k is sum_p p^k x_p over the points
    0, +-1, +-2, +-1/2, per pair the sum (even k) or difference (odd k) of its two values; the
    infinity value joins row m - 1."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x
    add, sub, mul = b.add, b.sub, b.mul
    s1, d1, s2, d2, s3, d3 = add(x1, x2), sub(x1, x2), add(x3, x4), sub(x3, x4), add(x5, x6), sub(x5, x6)
    out = [add(add(add(x0, s1), s2), s3)]
    for k in range(1, m):
        p, q, r = (d1, d2, d3) if k % 2 else (s1, s2, s3)
        out.append(add(add(p, mul(c(2.0**k), q)), mul(c(0.5**k), r)))
    out[-1] = add(out[-1], x7)
    return out


def _max_tree(builder, x):
    """numba's ``max`` over pairs, then pairs of pairs: ``max(a, b)`` is ``b`` where ``b > a``
    (ordered), else ``a``."""

    def mx(a, b):
        return builder.select(builder.fcmp_ordered(">", b, a), b, a)

    while len(x) > 1:
        x = [mx(x[i], x[i + 1]) for i in range(0, len(x), 2)]
    return x[0]


class _Ops:
    """Vector arithmetic with LLVM's contraction allowed (a product and a sum may fuse)."""

    def __init__(self, builder):
        self.b = builder

    def add(self, x, y):
        return self.b.fadd(x, y, flags=("contract",))

    def sub(self, x, y):
        return self.b.fsub(x, y, flags=("contract",))

    def mul(self, x, y):
        return self.b.fmul(x, y, flags=("contract",))


def transform_codegen(context, builder, signature, args, K, W, points, finish=None):
    """:func:`vector_transform`'s body (arguments 2-7 ``d, j, o, v, k, vs``); ``finish(builder,
    ys, load, const)``, where given, returns the outputs to store instead of ``ys`` (a fused
    epilogue, :func:`.epilogue.vector_transform_act`; ``load(pointer, offset)`` loads a vector,
    ``const(x)`` a vector of ``x``)."""
    st = signature.args
    i64 = ir.IntType(64)
    vt = ir.VectorType(ir.FloatType(), W)

    def idx(val, ty):
        return context.cast(builder, val, ty, types.int64)

    dp = context.make_array(st[2])(context, builder, args[2]).data
    vp = context.make_array(st[5])(context, builder, args[5]).data
    j0, k0, step = idx(args[3], st[3]), idx(args[6], st[6]), idx(args[7], st[7])
    offs = [ir.Constant(i64, 0)] + [idx(builder.extract_value(args[4], p), st[4].types[p]) for p in range(points - 1)]

    def load(base, off):
        ptr = builder.bitcast(builder.gep(base, [off]), vt.as_pointer())
        val = builder.load(ptr)
        val.align = 4
        return val

    def const(x):
        return ir.Constant(vt, [float(x)] * W)

    x = [load(dp, builder.add(j0, off)) for off in offs]
    ops = _Ops(builder)
    if K >= AT8:
        ys = _at8(ops, x, const, K - AT8)
    elif K in (MAX4, MAX8):
        ys = [_max_tree(builder, x)]
    else:
        ys = {BT8: _bt8, BT6: _bt6, BT4: _bt4}[K](ops, x, const)
    if finish is not None:
        ys = finish(builder, ys, load, const)
    for r, y in enumerate(ys):
        at = builder.add(k0, builder.mul(ir.Constant(i64, r), step))
        s = builder.store(y, builder.bitcast(builder.gep(vp, [at]), vt.as_pointer()))
        s.align = 4
    return context.get_dummy_value()


@intrinsic
def vector_transform(typingctx, kind, vl, d, j, o, v, k, vs):
    """``vector_transform(kind, vl, d, j, o, v, k, vs)``: for the ``vl`` lanes ``i`` (constants
    ``kind`` and ``vl``), ``v[k + r * vs + i] = sum_p T[r, p] d[j + o_p + i]``, ``T`` the
    8-point BT (:data:`BT8`) or AT with m outputs (``AT8 + m``), the 6- or 4-point BT
    (:data:`BT6`, :data:`BT4`), or the maximum of 8 or 4 points (:data:`MAX8`, :data:`MAX4`: one
    output); ``o`` the offsets of points 1-7 (1-5, 1-3) from point 0, a tuple; ``d`` and ``v``
    flat float32 arrays, distinct."""
    if not (isinstance(kind, types.IntegerLiteral) and isinstance(vl, types.IntegerLiteral)):
        return None
    K, W = int(kind.literal_value), int(vl.literal_value)
    points = TRANSFORM_POINTS.get(K, 8)
    if len(o) != points - 1:
        return None
    sig = types.void(kind, vl, d, j, o, v, k, vs)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        return transform_codegen(context, builder, signature, args, K, W, points)

    return sig, codegen


@intrinsic
def vector_copy(typingctx, vl, v, k, a, i):
    """``vector_copy(vl, v, k, a, i)``: ``v[k + l] = a[i + l]`` for the ``vl`` lanes ``l`` (a
    constant), ``k`` and ``i`` counted in elements from the arrays' first (any dimensions, the
    lanes contiguous): a voxel's 24-48 channels in one or a few vectors, where LLVM's loop left
    them to a scalar remainder in AVX2 code; a copy, so a last vector may overlap the one before."""
    if not isinstance(vl, types.IntegerLiteral):
        return None
    W = int(vl.literal_value)
    sig = types.void(vl, v, k, a, i)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        st = signature.args
        vt = ir.VectorType(ir.FloatType(), W)

        def ptr(n, at):
            data = context.make_array(st[n])(context, builder, args[n]).data
            off = context.cast(builder, args[at], st[at], types.int64)
            return builder.bitcast(builder.gep(data, [off]), vt.as_pointer())

        x = builder.load(ptr(3, 4))
        x.align = 4
        s = builder.store(x, ptr(1, 2))
        s.align = 4
        return context.get_dummy_value()

    return sig, codegen


#: :func:`vector_transpose8`'s three rounds of two-vector shuffles (``unpcklps``/``unpckhps``, then
#: pairs, then halves): each entry (first vector, second, lanes of the pair low, lanes high)
_T8_ROUNDS = (
    tuple((2 * i, 2 * i + 1, (0, 8, 1, 9, 4, 12, 5, 13), (2, 10, 3, 11, 6, 14, 7, 15)) for i in range(4)),
    tuple((a, a + 2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)) for a in (0, 1, 4, 5)),
    tuple((k, k + 4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)) for k in range(4)),
)
#: the column of the 8 x 8 block each vector holds after the rounds
_T8_COLUMN = (0, 2, 1, 3, 4, 6, 5, 7)


@intrinsic
def vector_transpose8(typingctx, x, xo, xs, y, yo, ys):
    """``vector_transpose8(x, xo, xs, y, yo, ys)``: ``y[yo + j * ys + i] = x[xo + i * xs + j]`` for
    ``i, j < 8``: an 8 x 8 block of float32 transposed in registers (eight 8-float loads, 24
    shuffles, eight stores), where a loop of single values stores through a scatter (a
    channels-last block copied channel-major: the 1x1x1 chains' reads of a decoder's output).
    ``x`` and ``y`` flat float32 arrays, distinct; offsets in elements."""
    sig = types.void(x, xo, xs, y, yo, ys)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        st = signature.args
        i64 = ir.IntType(64)
        vt = ir.VectorType(ir.FloatType(), 8)

        def idx(k):
            return context.cast(builder, args[k], st[k], types.int64)

        def ptr(k, off):
            data = context.make_array(st[k])(context, builder, args[k]).data
            return builder.bitcast(builder.gep(data, [off]), vt.as_pointer())

        x0, sx, y0, sy = idx(1), idx(2), idx(4), idx(5)
        rows = []
        for i in range(8):
            v = builder.load(ptr(0, builder.add(x0, builder.mul(ir.Constant(i64, i), sx))))
            v.align = 4
            rows.append(v)
        for rnd in _T8_ROUNDS:
            out = list(rows)
            for a, b, lo, hi in rnd:
                out[a] = builder.shuffle_vector(rows[a], rows[b], ir.Constant(ir.VectorType(ir.IntType(32), 8), lo))
                out[b] = builder.shuffle_vector(rows[a], rows[b], ir.Constant(ir.VectorType(ir.IntType(32), 8), hi))
            rows = out
        for k, v in enumerate(rows):
            at = builder.add(y0, builder.mul(ir.Constant(i64, _T8_COLUMN[k]), sy))
            s = builder.store(v, ptr(3, at))
            s.align = 4
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, inline="always")
def transpose_block(x, xo, xs, y, yo, ys, R, K):  # pragma: no cover - compiled
    """``y[yo + j * ys + i] = x[xo + i * xs + j]`` for ``i < R``, ``j < K``: whole 8 x 8 blocks by
    :func:`vector_transpose8`, the rest a value at a time (stores along ``i``, contiguous).  Flat
    float32 arrays, distinct; a channels-last block to channels-major rows or back (the 1x1x1
    chains, direct-numba's channels-last output)."""
    u = np.uint64
    xo, xs, yo, ys, R, K = u(xo), u(xs), u(yo), u(ys), u(R), u(K)
    R8, K8 = R // u(8) * u(8), K // u(8) * u(8)
    for i0 in range(u(0), R8, u(8)):
        for j0 in range(u(0), K8, u(8)):
            vector_transpose8(x, xo + i0 * xs + j0, xs, y, yo + j0 * ys + i0, ys)
    for j in range(K):
        for i in range(R8 if j < K8 else u(0), R):
            y[yo + j * ys + i] = x[xo + i * xs + j]
