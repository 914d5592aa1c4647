"""What a chain network computes at one output voxel, written out in numpy: the definition that
``znni verify`` and every task's check recompute sampled voxels from (no planner, no MPF, no FFT
or Winograd: a direct convolution, strided pooling, the activations, in float64)."""

from __future__ import annotations

import numpy as np

from ..errors import DataError
from ..geometry import Coordinate, Roi
from .chain import Activation, Conv, Pool

#: float32 outputs: a recomputed voxel may differ by this much times the largest |value| (at least 1)
TOLERANCE = 1e-4


def _act(x: np.ndarray, layer: Activation, axis: int = 1) -> np.ndarray:
    """An activation written out in numpy (the definition; float64); ``axis``: the channels'."""
    k, a = layer.kind, float(layer.alpha)
    if k == "relu":
        return np.maximum(x, 0)
    if k == "leaky_relu":
        return np.where(x > 0, x, a * x)
    if k == "elu":
        return np.where(x > 0, x, a * np.expm1(np.minimum(x, 0)))
    if k == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if k == "tanh":
        return np.tanh(x)
    if k == "softmax":
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)
    return x  # identity


def plain_forward(net, x: np.ndarray) -> np.ndarray:
    """The chain ``net`` on ``x`` ``(K, C, *field_of_view)`` with strided pooling: ``(K, C_out)``,
    one output voxel per window, in float64.

    >>> from znni_core.net import Conv, Network
    >>> net = Network((Conv(np.ones((1, 1, 1, 2, 2), np.float32), None),))
    >>> plain_forward(net, np.arange(4, dtype=np.float32).reshape(1, 1, 1, 2, 2))
    array([[6.]])
    """
    y = np.ascontiguousarray(x.astype(np.float64).transpose(1, 0, 2, 3, 4))  # (C, K, z, y, x): one GEMM per offset
    for layer in net.layers:
        if isinstance(layer, Conv):
            w = layer.weight.astype(np.float64)  # (C_out, C_in, kz, ky, kx)
            kz, ky, kx = w.shape[2:]
            oz, oy, ox = (s - k + 1 for s, k in zip(y.shape[2:], w.shape[2:]))
            out = np.zeros((w.shape[0], y.shape[1], oz, oy, ox))
            for a in range(kz):  # a sum over the kernel's offsets: memory of one output, never of windows
                for b in range(ky):
                    for c in range(kx):  # one matrix product (BLAS, float64) per offset
                        out += np.tensordot(w[:, :, a, b, c], y[:, :, a : a + oz, b : b + oy, c : c + ox], ([1], [0]))
            if layer.bias is not None:
                out += layer.bias.astype(np.float64)[:, None, None, None, None]
            y = out
        elif isinstance(layer, Pool):
            wz, wy, wx = layer.window
            c, k, z, yy, xx = y.shape
            y = y[:, :, : z // wz * wz, : yy // wy * wy, : xx // wx * wx]
            y = y.reshape(c, k, z // wz, wz, yy // wy, wy, xx // wx, wx).max(axis=(3, 5, 7))
        else:
            y = _act(y, layer, axis=0)
    y = y.transpose(1, 0, 2, 3, 4)  # (K, C, ...)
    if y.shape[2:] != (1, 1, 1):
        raise DataError(f"the network on its field of view gave {y.shape[2:]} voxels, not one")
    return y[:, :, 0, 0, 0]


def flops_per_voxel(net) -> float:
    """Floating-point operations of :func:`plain_forward` for one output voxel (its convolutions
    on the field of view): what recomputing a voxel costs."""
    shape, total = tuple(net.field_of_view), 0.0
    for layer in net.layers:
        if isinstance(layer, Conv):
            shape = tuple(s - k + 1 for s, k in zip(shape, layer.kernel))
            total += 2.0 * layer.in_channels * layer.out_channels * float(np.prod(layer.kernel)) * float(np.prod(shape))
        elif isinstance(layer, Pool):
            shape = tuple(s // w for s, w in zip(shape, layer.window))
    return total


#: floating-point operations per second :func:`plain_forward` is assumed to run at (numpy, float64,
#: a BLAS product per kernel offset; 6.3-7.5 x 10^9 measured for the boundary net's 16 voxels on 2
#: Zen 4 cores, `python -m benchmarks.verify_cost`): sizes ``verify_voxels: auto``; each task records
#: what its check really took (``recomputed.seconds``)
DEFINITION_FLOPS = 5e9


def sample_voxels(comp: Roi, n: int, rng) -> list[Coordinate]:
    """``n`` voxels of ``comp``: its corners first (up to eight), then random ones."""
    b, e = comp.begin, comp.end
    total = int(np.prod(tuple(comp.shape)))
    if n >= total:  # every voxel
        return [Coordinate(p) + b for p in np.ndindex(*tuple(comp.shape))]
    corners = sorted(
        {tuple(v) for v in np.array(np.meshgrid(*[(lo, hi - 1) for lo, hi in zip(b, e)])).T.reshape(-1, 3)}
    )
    picked = corners[:n]
    seen = set(picked)
    while len(picked) < n:
        p = tuple(int(rng.integers(lo, hi)) for lo, hi in zip(b, e))
        if p not in seen:
            seen.add(p)
            picked.append(p)
    return [Coordinate(p) for p in picked]
