"""The activation a convolution applies in its own output pass (a fused activation).

A conv's last pass writes every output value once (bias added); applying the activation
that follows it there saves the activation's own pass over the layer's output, a full
read and write of memory.  An epilogue is ``(code, alpha)``: ``0`` none, ``1`` ReLU,
``2`` leaky ReLU of slope ``alpha``, ``3`` ELU ``alpha (e^x - 1)`` below 0.  The numba
primitives call :func:`act_row` on each output row while it is in cache; its ``exp``
(:func:`exp_neg`) is plain arithmetic so the loops stay vectorised (numba's ``math.exp`` is a
scalar libm call without SVML).

The reference is :func:`~znni_core.layers.activation.apply_activation`
(``tests/test_epilogue.py`` checks every primitive against it).
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ._numba import njit, prange
from .layout import empty_like_layout, is_channels_last, memory_order
from .transform_vectors import TRANSFORM_POINTS, transform_codegen

__all__ = ["FUSABLE", "NONE", "act_row", "add_affine_act", "epilogue", "exp_neg", "vector_transform_act"]

#: activations a conv's output pass applies itself
FUSABLE = {"relu": 1, "leaky_relu": 2, "elu": 3}
#: no activation
NONE = (0, 0.0)


def epilogue(activation) -> tuple:
    """``(code, alpha)`` of an activation ``(kind, alpha)`` for the primitives' output pass;
    :data:`NONE` for None or ``identity``.  Raises ``KeyError`` for one that cannot be fused
    (sigmoid, softmax...)."""
    if activation is None or activation[0] == "identity":
        return NONE
    return FUSABLE[activation[0]], float(activation[1])


@intrinsic
def _as_f32(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bit pattern is the int32 ``bits`` (a vectorisable bitcast)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def _fmuladd(typingctx, a, b, c):  # pragma: no cover - compiled
    """``a * b + c`` for float32 values as one multiply-add where the CPU has them (``llvm.fmuladd``,
    one rounding): :func:`exp_neg`'s polynomial contracted whatever fastmath flags the loop it is
    inlined into was compiled with (without contraction, ELU ran 0.56 ns a value in the first-level
    cache on one Xeon core, with it 0.36).  Vectorised like any arithmetic."""
    if not all(isinstance(t, types.Float) for t in (a, b, c)):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fmuladd.f32")
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, signature.args)]
        return builder.call(fn, vals)

    return types.float32(a, b, c), codegen


_LOG2E = np.float32(1.0 / math.log(2.0))
_LN2_HI = np.float32(0.693145751953125)  # ln 2 in 16 bits: n * _LN2_HI is exact for |n| < 2^8
_LN2_LO = np.float32(math.log(2.0) - 0.693145751953125)
#: Taylor coefficients 1 / k!, k = 7 .. 2 (|r| <= ln2 / 2: truncation 5e-9 relative)
_C7, _C6, _C5, _C4, _C3, _C2 = (np.float32(1.0 / math.factorial(k)) for k in (7, 6, 5, 4, 3, 2))
#: the polynomial's coefficients from the highest power down, the last two (1/1!, 1/0!) included
_EXP_TAYLOR = (_C7, _C6, _C5, _C4, _C3, _C2, np.float32(1.0), np.float32(1.0))


@njit(nogil=True, cache=True, inline="always")
def exp_neg(x):  # pragma: no cover - compiled
    """``e^x`` for float32 ``x <= 0`` within 3e-7 relative (below -87: 2^-126 instead of
    a subnormal).  ``x = n ln2 + r``, ``|r| <= ln2 / 2``: a degree-7 polynomial of ``r``
    times ``2^n`` built from its exponent bits."""
    x = max(x, np.float32(-87.0))
    n = np.floor(_fmuladd(x, _LOG2E, np.float32(0.5)))
    r = _fmuladd(n, -_LN2_LO, _fmuladd(n, -_LN2_HI, x))
    p = _C7
    p = _fmuladd(p, r, _C6)
    p = _fmuladd(p, r, _C5)
    p = _fmuladd(p, r, _C4)
    p = _fmuladd(p, r, _C3)
    p = _fmuladd(p, r, _C2)
    p = _fmuladd(p, r, np.float32(1.0))
    p = _fmuladd(p, r, np.float32(1.0))
    return p * _as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@njit(nogil=True, cache=True, inline="always")
def act_row(r, lo, hi, code, alpha):  # pragma: no cover - compiled
    """``r[lo:hi] = act(r[lo:hi])`` in place, one loop per code.  Unsigned indices: numba wraps
    negative ones, and that check alone kept the loops scalar (ELU 7 ns a value, not 0.4).

    Each stores a sum of selects, each term zero where the other holds: exact (the other term adds
    +0; ReLU of -0 is +0), NaN kept, and a plain store.  ``v if v > 0 else f(v)`` stored back where ``v`` came
    from is a conditional store of ``f(v)``, which LLVM compiles for AVX2 to ``vmaskmovps``, a
    microcoded store on AMD cores: ELU ran 2.1x slower than this form as AVX2 code on Zen 4 (AVX-512
    has native masked stores)."""
    zero = np.float32(0.0)
    lo, hi = np.uint64(lo), np.uint64(hi)
    if code == 1:
        for i in range(lo, hi):
            v = r[i]
            m = max(v, zero)  # NaN kept: numba's max returns its first argument when unordered
            r[i] = m + (zero if v > zero else m - m)  # m - m: +0, or NaN for NaN
    elif code == 2:
        for i in range(lo, hi):
            v = r[i]
            pos = v > zero
            r[i] = (v if pos else zero) + (zero if pos else alpha * v)
    elif code == 3:
        for i in range(lo, hi):
            v = r[i]
            pos = v > zero
            f = alpha * (exp_neg(min(v, zero)) - np.float32(1.0))
            r[i] = (v if pos else zero) + (zero if pos else f)


def _exp_neg(b, x, const):
    """``e^x`` for ``x <= 0``, as :func:`exp_neg` computes it (the same operations, so the
    same values): ``x = n ln2 + r``, a degree-7 polynomial of ``r`` times ``2^n``."""
    vt = x.type
    W = vt.count
    fmuladd = cgutils.get_or_insert_function(b.module, ir.FunctionType(vt, [vt] * 3), f"llvm.fmuladd.v{W}f32")
    floor = cgutils.get_or_insert_function(b.module, ir.FunctionType(vt, [vt]), f"llvm.floor.v{W}f32")

    def fma(p, q, r):
        return b.call(fmuladd, [p, q, r])

    lo = const(-87.0)
    x = b.select(b.fcmp_ordered(">", lo, x), lo, x)
    n = b.call(floor, [fma(x, const(_LOG2E), const(0.5))])
    r = fma(n, const(-_LN2_LO), fma(n, const(-_LN2_HI), x))
    p = const(_EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        p = fma(p, r, const(c))
    it = ir.VectorType(ir.IntType(32), W)
    bits = b.shl(b.add(b.fptosi(n, it), ir.Constant(it, [127] * W)), ir.Constant(it, [23] * W))
    return b.fmul(p, b.bitcast(bits, vt))


def _activation(b, v, code, alpha, const):
    """``act(v)`` for the epilogue ``code`` (a constant: 0 none, 1 ReLU, 2 leaky ReLU, 3 ELU of
    ``alpha``, a vector), as :func:`act_row` computes it: NaN kept, ReLU of -0 is +0."""
    zero = const(0.0)
    if code == 0:
        return v
    pos = b.fcmp_ordered(">", v, zero)
    if code == 1:  # max(v, 0) + (0 if v > 0 else m - m)
        m = b.select(b.fcmp_ordered(">", zero, v), zero, v)
        return b.fadd(m, b.select(pos, zero, b.fsub(m, m)))
    if code == 2:
        f = b.fmul(alpha, v)
    else:  # alpha (e^min(v, 0) - 1)
        f = b.fmul(alpha, b.fsub(_exp_neg(b, b.select(b.fcmp_ordered("<", zero, v), zero, v), const), const(1.0)))
    return b.fadd(b.select(pos, v, zero), b.select(pos, zero, f))


@intrinsic
def vector_transform_act(typingctx, kind, vl, d, j, o, v, k, vs, bias, bo, code, alpha):
    """``vector_transform_act(kind, vl, d, j, o, v, k, vs, bias, bo, code, alpha)``: as
    :func:`vector_transform`, each output then ``act(y + bias[bo + i])`` before its store, ``act``
    the epilogue ``code`` (a constant: 0 none, 1 ReLU, 2 leaky ReLU, 3 ELU, slope or scale
    ``alpha``; the same values as :func:`act_row`): the output
    transform's last pass writes finished values, with no pass of its own for bias and activation."""
    lits = (kind, vl, code)
    if not all(isinstance(t, types.IntegerLiteral) for t in lits):
        return None
    K, W, C = (int(t.literal_value) for t in lits)
    points = TRANSFORM_POINTS.get(K, 8)
    if len(o) != points - 1 or C not in (0, 1, 2, 3):
        return None
    sig = types.void(kind, vl, d, j, o, v, k, vs, bias, bo, code, alpha)

    def codegen(context, builder, signature, args):  # pragma: no cover - runs in the compiler
        st = signature.args

        def finish(b, ys, load, const):
            bias = load(
                context.make_array(st[8])(context, b, args[8]).data, context.cast(b, args[9], st[9], types.int64)
            )
            alpha = const(0.0)
            a = context.cast(b, args[11], st[11], types.float32)
            alpha = b.shuffle_vector(
                b.insert_element(alpha, a, ir.Constant(ir.IntType(32), 0)),
                alpha,
                ir.Constant(ir.VectorType(ir.IntType(32), W), [0] * W),
            )
            return [_activation(b, b.fadd(y, bias), C, alpha, const) for y in ys]

        return transform_codegen(context, builder, signature, args, K, W, points, finish)

    return sig, codegen


# the two below stay numba prange loops: as nogil loops over task ranges (the other kernels') they
# ran 1.7-2x slower, on one thread too (LLVM vectorised the parallel form's loop body better)
@njit(parallel=True, cache=True, fastmath={"contract"})
def _add_affine_act_cl(a, b, has_b, s, t, code, alpha, out):  # pragma: no cover - compiled
    """:func:`_add_affine_act` on channels-last memory (flat, C-contiguous) in runs of
    ``len(s)`` values: ``s`` and ``t`` hold the channels' scale and shift repeated over a
    whole number of voxels, so each run is one plain vector loop (activation in L1)."""
    L, size = np.uint64(s.size), np.uint64(a.size)
    for k in prange((size + L - np.uint64(1)) // L):
        v0 = np.uint64(k) * L
        n = min(L, size - v0)
        if has_b:
            for j in range(n):
                out[v0 + j] = s[j] * (a[v0 + j] + b[v0 + j]) + t[j]
        else:
            for j in range(n):
                out[v0 + j] = s[j] * a[v0 + j] + t[j]
        act_row(out, v0, v0 + n, code, alpha)


@njit(parallel=True, cache=True, fastmath={"contract"})
def _add_affine_act(a, b, has_b, s, t, code, alpha, out):  # pragma: no cover - compiled
    N, C, Z, Y, X = a.shape
    for k in prange(N * C * Z):
        n, c, z = k // (C * Z), (k // Z) % C, k % Z
        sc, sh = s[c], t[c]
        for y in range(Y):
            ra, ro = a[n, c, z, y], out[n, c, z, y]
            if has_b:
                rb = b[n, c, z, y]
                for i in range(X):
                    ro[i] = sc * (ra[i] + rb[i]) + sh
            else:
                for i in range(X):
                    ro[i] = sc * ra[i] + sh
            act_row(ro, 0, X, code, alpha)  # on the row in L1


def add_affine_act(a, b=None, scale=None, shift=None, activation=None, *, out=None):
    """``act(scale[c] * (a + b) + shift[c])`` in one pass (a residual add, the BatchNorm
    after it and its activation: three passes over memory as separate nodes).

    ``a``, ``b``, ``out``: float32 ``(N, C, Z, Y, X)`` of any strides (``out`` may be ``a`` or
    ``b``); ``b``, ``scale``, ``shift`` optional (``scale``/``shift``: ``C`` values or one);
    ``activation``: ``(kind, alpha)`` of :data:`FUSABLE`, or None.

    >>> import numpy as np
    >>> a = np.full((1, 2, 1, 1, 2), -1.0, np.float32)
    >>> add_affine_act(a, a, np.array([1, 2], np.float32), None, ("relu", 0.0))[0, :, 0, 0].tolist()
    [[0.0, 0.0], [0.0, 0.0]]
    """
    C = a.shape[1]
    s = np.broadcast_to(np.asarray(1.0 if scale is None else scale, np.float32).reshape(-1), (C,))
    t = np.broadcast_to(np.asarray(0.0 if shift is None else shift, np.float32).reshape(-1), (C,))
    code, alpha = epilogue(activation)
    if out is None:
        out = empty_like_layout(a)
    s, t, b2 = np.ascontiguousarray(s), np.ascontiguousarray(t), a if b is None else b
    if all(is_channels_last(v) for v in (a, b2, out)):  # channels last: runs of whole voxels
        flat = lambda v: memory_order(v).reshape(-1)  # noqa: E731
        reps = max(1, 1024 // C)
        _add_affine_act_cl(
            flat(a), flat(b2), b is not None, np.tile(s, reps), np.tile(t, reps), code, np.float32(alpha), flat(out)
        )
        return out
    _add_affine_act(a, b2, b is not None, s, t, code, np.float32(alpha), out)
    return out
