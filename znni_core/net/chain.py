"""Chains: the layer records (convolution, max-pooling, activation) and what a line of them means.

A chain is a :class:`~.graph.Graph` whose nodes form a line of stride-1 unpadded convolutions,
max-pooling and activations (:func:`line_layers` finds it); build one from layers with
:class:`~.graph.Network`.  Its max-pooling is a dense sliding filter: max-pooling fragments give
an output voxel at every input position, so any input of at least the field of view is
admissible (:func:`chain_geometry`).  The functions here read the line as layers; the graph
holds the nodes.

All shapes are in voxels, axis order (z, y, x).  Weights are float32 numpy arrays
of shape ``(C_out, C_in, kz, ky, kx)``; they are correlated (PyTorch ``Conv3d``
semantics, no kernel flip).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Union

import numpy as np

from ..errors import NetworkError
from .geometry import NetGeometry

Shape3 = tuple[int, int, int]

ACTIVATIONS = ("relu", "leaky_relu", "elu", "sigmoid", "tanh", "softmax", "identity")


def _shape3(value, what: str) -> Shape3:
    if isinstance(value, (int, np.integer)):
        value = (int(value),) * 3
    t = tuple(int(v) for v in value)
    if len(t) != 3 or any(v < 1 for v in t):
        raise NetworkError(f"{what} must be 3 positive integers (z, y, x), got {value!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class Conv:
    """Valid 3D correlation, stride 1, dilation 1, groups 1."""

    weight: np.ndarray  # (C_out, C_in, kz, ky, kx) float32
    bias: np.ndarray | None = None  # (C_out,) float32
    name: str = "conv"

    def __post_init__(self):
        w = np.ascontiguousarray(self.weight, dtype=np.float32)
        if w.ndim != 5:
            raise NetworkError(f"{self.name}: weight must be 5-D (C_out, C_in, kz, ky, kx), got shape {w.shape}")
        if not np.isfinite(w).all():
            bad = int((~np.isfinite(w)).sum())
            raise NetworkError(
                f"{self.name}: weight holds {bad} NaN/Inf value(s); the network file is corrupt or was saved mid-divergence - re-export it"
            )
        object.__setattr__(self, "weight", w)
        if self.bias is not None:
            b = np.ascontiguousarray(self.bias, dtype=np.float32).reshape(-1)
            if b.shape != (w.shape[0],):
                raise NetworkError(
                    f"{self.name}: bias has {b.shape[0]} values but the weight has {w.shape[0]} output channels"
                )
            if not np.isfinite(b).all():
                raise NetworkError(f"{self.name}: bias holds NaN/Inf values; re-export the network")
            object.__setattr__(self, "bias", b)

    @cached_property  # read hundreds of thousands of times while planning
    def kernel(self) -> Shape3:
        """Kernel shape (kz, ky, kx)."""
        return tuple(int(v) for v in self.weight.shape[2:])  # type: ignore[return-value]

    @cached_property
    def in_channels(self) -> int:
        """Input channels ``C_in``."""
        return int(self.weight.shape[1])

    @cached_property
    def out_channels(self) -> int:
        """Output channels ``C_out``."""
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class Pool:
    """Max-pooling with kernel == stride, no padding."""

    window: Shape3
    name: str = "pool"

    def __post_init__(self):
        object.__setattr__(self, "window", _shape3(self.window, f"{self.name}: pooling window"))


@dataclass(frozen=True)
class Activation:
    """Element-wise activation (softmax: over the channel axis)."""

    kind: str
    alpha: float = 0.0  # leaky_relu negative slope, elu alpha
    name: str = "act"

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise NetworkError(f"{self.name}: activation {self.kind!r} is not supported; use one of {ACTIVATIONS}")
        if not np.isfinite(self.alpha):
            raise NetworkError(f"{self.name}: activation parameter alpha={self.alpha} is not finite")


Layer = Union[Conv, Pool, Activation]


def check_chain(layers: tuple, name: str) -> None:
    """Refuse a line of ``layers`` with no convolution, or whose channels do not chain."""
    convs = [l for l in layers if isinstance(l, Conv)]
    if not convs:
        raise NetworkError(f"{name}: the network has no convolution layer")
    channels = convs[0].in_channels
    for layer in layers:
        if isinstance(layer, Conv):
            if layer.in_channels != channels:
                raise NetworkError(
                    f"{layer.name}: expects {layer.in_channels} input channels but the previous layer gives {channels}"
                )
            channels = layer.out_channels


def line_layers(nodes, source: str, output: str) -> tuple | None:
    """The layers of graph ``nodes`` that form a chain from ``source`` to ``output``, else None.

    Each node reads the one before; convolutions have stride 1 and no padding, pooling is max."""
    layers, current = [], source
    for node in nodes:
        if node.inputs != (current,):
            return None
        layer = node.op.chain_layer(node.name)
        if layer is None:
            return None
        layers.append(layer)
        current = node.output
    if current != output or not any(isinstance(l, Conv) for l in layers):
        return None
    return tuple(layers)


def chain_geometry(layers: tuple) -> NetGeometry:
    """Any input of at least the field of view is admissible (max-pooling fragments give the
    dense output); the output is centred on it.

    ``F = 1 + sum (k - 1) d + sum_pool (p - 1) d``, ``d`` the product of earlier pooling windows."""
    fov = np.ones(3, dtype=np.int64)
    d = np.ones(3, dtype=np.int64)
    for layer in layers:
        if isinstance(layer, Conv):
            fov += (np.array(layer.kernel) - 1) * d
        elif isinstance(layer, Pool):
            fov += (np.array(layer.window) - 1) * d
            d *= np.array(layer.window)
    return NetGeometry.dense(tuple(int(v) for v in fov))


def pooling_product(layers: tuple) -> Shape3:
    """``D``: the product of the pooling windows; fragments give dense output in multiples of D."""
    d = np.ones(3, dtype=np.int64)
    for layer in layers:
        if isinstance(layer, Pool):
            d *= np.array(layer.window)
    return tuple(int(v) for v in d)  # type: ignore[return-value]


def chain_digest(layers: tuple) -> str:
    """A content hash of a chain's structure and weights (sha256 hex), stable across loaders."""
    h = hashlib.sha256()
    for layer in layers:
        if isinstance(layer, Conv):
            h.update(b"conv" + str(layer.weight.shape).encode())
            h.update(layer.weight.tobytes())
            h.update(b"bias" + (layer.bias.tobytes() if layer.bias is not None else b"none"))
        elif isinstance(layer, Pool):
            h.update(b"pool" + str(layer.window).encode())
        else:
            h.update(f"act{layer.kind}{layer.alpha!r}".encode())
    return h.hexdigest()


def describe_layers(layers: tuple) -> list[str]:
    """One line per layer."""
    rows = []
    for layer in layers:
        if isinstance(layer, Conv):
            rows.append(
                f"{layer.name}: conv {layer.in_channels}->{layer.out_channels} k={layer.kernel}"
                f"{' +bias' if layer.bias is not None else ''}"
            )
        elif isinstance(layer, Pool):
            rows.append(f"{layer.name}: maxpool {layer.window}")
        else:
            rows.append(
                f"{layer.name}: {layer.kind}" + (f"({layer.alpha:g})" if layer.kind in ("leaky_relu", "elu") else "")
            )
    return rows
