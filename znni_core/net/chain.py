"""The network as data: a chain of convolution, max-pooling and activation layers.

All shapes are in voxels, axis order (z, y, x).  Weights are float32 numpy arrays
of shape ``(C_out, C_in, kz, ky, kx)``; they are correlated (PyTorch ``Conv3d``
semantics, no kernel flip).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Union

import numpy as np

from ..errors import NetworkError
from .geometry import Geometric, NetGeometry

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


@dataclass(frozen=True, eq=False)
class Network(Geometric):
    """A validated chain of layers.

    >>> import numpy as np
    >>> net = Network((Conv(np.ones((2, 1, 3, 3, 3), np.float32)), Pool((2, 2, 2)),
    ...                Conv(np.ones((1, 2, 3, 3, 3), np.float32))))
    >>> net.field_of_view
    (8, 8, 8)
    """

    layers: tuple[Layer, ...]
    name: str = "network"
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        convs = [l for l in layers if isinstance(l, Conv)]
        if not convs:
            raise NetworkError(f"{self.name}: the network has no convolution layer")
        channels = convs[0].in_channels
        for layer in layers:
            if isinstance(layer, Conv):
                if layer.in_channels != channels:
                    raise NetworkError(
                        f"{layer.name}: expects {layer.in_channels} input channels but the previous layer gives {channels}"
                    )
                channels = layer.out_channels

    # ---- geometry -------------------------------------------------------
    @property
    def in_channels(self) -> int:
        """Input channels of the first convolution."""
        return next(l for l in self.layers if isinstance(l, Conv)).in_channels

    @property
    def out_channels(self) -> int:
        """Output channels of the last convolution."""
        return [l for l in self.layers if isinstance(l, Conv)][-1].out_channels

    @property
    def pools(self) -> tuple[Pool, ...]:
        """The pooling layers, in order."""
        return tuple(l for l in self.layers if isinstance(l, Pool))

    @cached_property
    def geometry(self) -> NetGeometry:
        """Any input of at least the field of view is admissible (max-pooling fragments give the
        dense output); the output is centred on it (a :class:`~.geometry.NetGeometry`)."""
        fov = np.ones(3, dtype=np.int64)
        d = np.ones(3, dtype=np.int64)
        for layer in self.layers:  # F = 1 + sum (k-1) d + sum_pool (p-1) d, d = product of earlier windows
            if isinstance(layer, Conv):
                fov += (np.array(layer.kernel) - 1) * d
            elif isinstance(layer, Pool):
                fov += (np.array(layer.window) - 1) * d
                d *= np.array(layer.window)
        return NetGeometry.dense(tuple(int(v) for v in fov))

    @property
    def pooling_product(self) -> Shape3:
        """``D``: product of all pooling windows; MPF yields dense output in multiples of D."""
        d = np.ones(3, dtype=np.int64)
        for p in self.pools:
            d *= np.array(p.window)
        return tuple(int(v) for v in d)  # type: ignore[return-value]

    #: a chain is read from its file at any input shape
    export_shape = None
    #: how the network is tiled (a graph's is ``"valid"`` or ``"padded"``)
    kind = "chain"

    def describe_kind(self) -> str:
        """One sentence on the network's kind and what it means for tiling."""
        return (
            f"chain (max-pooling fragments): convolutions, max-pooling and activations in a line; any input of at "
            f"least the field of view {self.field_of_view} gives dense output (pooling product {self.pooling_product})"
        )

    def digest(self) -> str:
        """A content hash of structure and weights (sha256 hex), stable across loaders."""
        return self._digest

    @cached_property
    def _digest(self) -> str:
        h = hashlib.sha256()
        for layer in self.layers:
            if isinstance(layer, Conv):
                h.update(b"conv" + str(layer.weight.shape).encode())
                h.update(layer.weight.tobytes())
                h.update(b"bias" + (layer.bias.tobytes() if layer.bias is not None else b"none"))
            elif isinstance(layer, Pool):
                h.update(b"pool" + str(layer.window).encode())
            else:
                h.update(f"act{layer.kind}{layer.alpha!r}".encode())
        return h.hexdigest()

    def describe(self) -> str:
        """One line per layer, then the field of view and the channels in and out."""
        rows = []
        for layer in self.layers:
            if isinstance(layer, Conv):
                rows.append(
                    f"{layer.name}: conv {layer.in_channels}->{layer.out_channels} k={layer.kernel}"
                    f"{' +bias' if layer.bias is not None else ''}"
                )
            elif isinstance(layer, Pool):
                rows.append(f"{layer.name}: maxpool {layer.window}")
            else:
                rows.append(
                    f"{layer.name}: {layer.kind}"
                    + (f"({layer.alpha:g})" if layer.kind in ("leaky_relu", "elu") else "")
                )
        rows.append(f"field of view {self.field_of_view}, in {self.in_channels} ch, out {self.out_channels} ch")
        return "\n".join(rows)
