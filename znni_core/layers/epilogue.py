"""The activation a convolution applies in its own output pass (a fused activation).

A conv's last pass writes every output value once (bias added); applying the activation
that follows it there saves the activation's own pass over the layer's output, a full
read and write of memory.  An epilogue is ``(code, alpha)``: ``0`` none, ``1`` ReLU,
``2`` leaky ReLU of slope ``alpha``, ``3`` ELU ``alpha (e^x - 1)`` below 0.  The numba
primitives call :func:`act` per value; its ``exp`` (:func:`exp_neg`) is plain arithmetic
so their loops stay vectorised (numba's ``math.exp`` is a scalar libm call without SVML).

The reference is :func:`~znni_core.layers.activation.apply_activation`
(``tests/test_epilogue.py`` checks every primitive against it).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ._numba import njit

__all__ = ["FUSABLE", "NONE", "act", "epilogue", "exp_neg"]

#: activations a conv's output pass applies itself
FUSABLE = {"relu": 1, "leaky_relu": 2, "elu": 3}
#: no activation
NONE = (0, 0.0)


def epilogue(kind, alpha=0.0) -> tuple:
    """``(code, alpha)`` of an activation for the primitives' output pass; :data:`NONE` for
    None or ``identity``.  Raises ``KeyError`` for one that cannot be fused (sigmoid,
    softmax...)."""
    if kind is None or kind == "identity":
        return NONE
    return FUSABLE[kind], float(alpha)


@intrinsic
def _as_f32(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bit pattern is the int32 ``bits`` (a vectorisable bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


_LOG2E = np.float32(1.0 / math.log(2.0))
_LN2_HI = np.float32(0.693145751953125)  # ln 2 in 16 bits: n * _LN2_HI is exact for |n| < 2^8
_LN2_LO = np.float32(math.log(2.0) - 0.693145751953125)
#: Taylor coefficients 1 / k!, k = 7 .. 2 (|r| <= ln2 / 2: truncation 5e-9 relative)
_C7, _C6, _C5, _C4, _C3, _C2 = (np.float32(1.0 / math.factorial(k)) for k in (7, 6, 5, 4, 3, 2))


@njit(nogil=True, cache=True, inline="always")
def exp_neg(x):  # pragma: no cover - compiled
    """``e^x`` for float32 ``x <= 0`` within 3e-7 relative (below -87: 2^-126 instead of
    a subnormal).  ``x = n ln2 + r``, ``|r| <= ln2 / 2``: a degree-7 polynomial of ``r``
    times ``2^n`` built from its exponent bits."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _C7
    p = p * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * _as_f32(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@njit(nogil=True, cache=True, inline="always")
def act(v, code, alpha):  # pragma: no cover - compiled
    """The epilogue ``(code, alpha)`` of one float32 value (branch-free per code: the
    callers' loops over values vectorise)."""
    zero = np.float32(0.0)
    if code == 1:
        return max(v, zero)
    if code == 2:
        return v if v > zero else alpha * v
    if code == 3:
        return v if v > zero else alpha * (exp_neg(min(v, zero)) - np.float32(1.0))
    return v
