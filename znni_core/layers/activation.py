"""Element-wise activations and channel softmax, one source for numpy and CuPy."""

from __future__ import annotations

import math

from ..errors import InputError
from ._numba import numba
from .threads import each_worker
from .xp import get_array_module

__all__ = ["ACTIVATIONS", "activation_memory", "apply_activation", "commutes_with_max"]

ACTIVATIONS = ("relu", "leaky_relu", "elu", "sigmoid", "tanh", "softmax", "identity")


#: element-wise activations of several passes, run chunk by chunk of this many values on the CPU
_CHUNKED = ("leaky_relu", "elu", "sigmoid")
CHUNK = 1 << 15


def apply_activation(x, kind, alpha=0.0, *, out=None):
    """Apply an activation; in place when ``out is x``.

    Parameters
    ----------
    x : array, shape (N, C, ...)
    kind : {"relu", "leaky_relu", "elu", "sigmoid", "tanh", "softmax", "identity"}
        ``leaky_relu``: ``x`` if ``x > 0`` else ``alpha * x`` (alpha = negative slope);
        ``elu``: ``x`` if ``x > 0`` else ``alpha * (exp(x) - 1)``;
        ``softmax``: over the channel axis 1, shifted by the channel maximum
        (numerically stable).
    alpha : float
    out : array or None
        Destination (may be ``x``).  ``None`` allocates a new array, except for
        ``identity``, which then returns ``x`` itself.

    Returns
    -------
    array
        ``out`` (or the new array).

    Notes
    -----
    Temporaries: ``leaky_relu`` and ``elu`` use one array the size of ``x`` (on the CPU, of
    a chunk, for contiguous arrays); the others none besides softmax's per-position max and
    sum (``1/C`` of ``x``).

    Examples
    --------
    >>> import numpy as np
    >>> apply_activation(np.array([-2.0, 3.0], np.float32), "leaky_relu", 0.5).tolist()
    [-1.0, 3.0]
    """
    xp = get_array_module(x)
    if kind not in ACTIVATIONS:
        raise InputError(f"unknown activation {kind!r}; supported: {', '.join(ACTIVATIONS)}")
    if kind == "identity":
        if out is None or out is x:
            return x
        out[...] = x
        return out
    if out is None:
        out = xp.empty_like(x)
    alpha = float(alpha)
    if (
        kind in _CHUNKED
        and xp.__name__ == "numpy"
        and x.size > 2 * CHUNK
        and x.flags.c_contiguous
        and out.flags.c_contiguous
    ):
        # several passes each: run them chunk by chunk in cache, not each over the whole array,
        # on the run's threads (numba's count, which the executor sets to the plan's)

        xf, of = x.reshape(-1), out.reshape(-1)
        starts = range(0, xf.size, CHUNK)
        workers = max(1, min(numba.get_num_threads(), len(starts)))

        def work(k):
            for i in starts[k::workers]:
                apply_activation(xf[i : i + CHUNK], kind, alpha, out=of[i : i + CHUNK])

        each_worker(work, workers)
        return out
    return _apply(xp, x, kind, alpha, out)


def _apply(xp, x, kind: str, alpha: float, out):
    """``out = kind(x)`` in one go (:func:`apply_activation` without its chunking)."""
    if kind == "relu":
        xp.maximum(x, 0, out=out)
    elif kind == "tanh":
        xp.tanh(x, out=out)
    elif kind == "sigmoid":
        # 1 / (1 + e^-x) = (1 + tanh(x / 2)) / 2: no overflow for large |x|
        xp.multiply(x, 0.5, out=out)
        xp.tanh(out, out=out)
        out *= 0.5
        out += 0.5
    elif kind == "leaky_relu":
        tmp = xp.multiply(x, alpha)
        # max(x, a x) is leaky ReLU for a <= 1, min(x, a x) for a > 1
        (xp.maximum if alpha <= 1.0 else xp.minimum)(x, tmp, out=out)
    elif kind == "elu":
        tmp = xp.minimum(x, 0)
        # exp(t) - 1, not expm1: numpy's float32 exp is SIMD and expm1 is not (5x slower);
        # the absolute error stays below 2e-7
        xp.exp(tmp, out=tmp)
        tmp -= 1
        tmp *= alpha
        xp.maximum(x, 0, out=out)
        out += tmp
    else:  # softmax over channels
        if x.ndim < 2:
            raise InputError(f"softmax needs a channel axis 1; got shape {x.shape}")
        m = x.max(axis=1, keepdims=True)
        xp.subtract(x, m, out=out)
        del m
        xp.exp(out, out=out)
        s = out.sum(axis=1, keepdims=True)
        out /= s
    return out


def activation_memory(kind, shape, itemsize=4, in_place=True, *, chunked=False) -> int:
    """Peak bytes :func:`apply_activation` allocates (output when not in place).

    ``chunked``: the CPU path on contiguous arrays, whose temporaries are one chunk per worker
    (at most numba's thread count); the default is the whole-array bound, true on any device,
    which the planners use."""
    size = itemsize * math.prod(shape)
    extra = size if kind in ("leaky_relu", "elu") else 0
    if extra and chunked and math.prod(shape) > 2 * CHUNK:
        extra = min(size, numba.config.NUMBA_NUM_THREADS * CHUNK * itemsize)
    if kind == "softmax":
        extra = size // max(1, shape[1])  # the channel max, freed before the sum
    return extra + (0 if in_place or kind == "identity" else size)


def commutes_with_max(layer) -> bool:
    """Non-decreasing activations, which commute with max-pooling exactly:
    ``max(f(a), f(b)) == f(max(a, b))`` (relu, sigmoid, tanh, identity; leaky_relu and elu
    with ``alpha >= 0``).  ``layer``: anything with ``kind`` and ``alpha``."""
    if layer.kind in ("relu", "sigmoid", "tanh", "identity"):
        return True
    return layer.kind in ("leaky_relu", "elu") and float(layer.alpha) >= 0.0
