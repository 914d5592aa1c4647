"""What every network offers the planner, the executors and the pipeline (:class:`AnyNetwork`).

A loader returns a :class:`~.graph.Graph`: a chain where its nodes form a line of convolutions,
max-pooling and activations (run dense through max-pooling fragments), or a U-Net or any other
fully convolutional DAG.  It describes its shape contract with one
:class:`~.geometry.NetGeometry` and identifies itself by a content digest; code that does not
care which kind it holds reads only these names.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .geometry import NetGeometry, Shape3


@runtime_checkable
class AnyNetwork(Protocol):
    """A loaded network, chain or graph.

    >>> import numpy as np
    >>> from znni_core.net import Conv, Network
    >>> isinstance(Network((Conv(np.ones((1, 1, 3, 3, 3), np.float32)),)), AnyNetwork)
    True
    """

    name: str
    metadata: dict

    @property
    def in_channels(self) -> int:
        """Channels of the input."""

    @property
    def out_channels(self) -> int:
        """Channels of the output."""

    @property
    def geometry(self) -> NetGeometry:
        """Admissible input lengths, context and halo."""

    @property
    def kind(self) -> str:
        """``"chain"`` (max-pooling fragments), ``"valid"`` or ``"padded"`` (graphs): how it is tiled."""

    @property
    def export_shape(self) -> tuple | None:
        """The static input shape (z, y, x) its file was exported at, or None."""

    @property
    def field_of_view(self) -> Shape3:
        """``context + 1``."""

    @property
    def halo(self) -> tuple[Shape3, Shape3]:
        """(low, high) input context around the output."""

    @property
    def grid(self) -> Shape3:
        """Step of admissible input lengths and of patch starts."""

    @property
    def context(self) -> Shape3:
        """Voxels the output loses per axis."""

    def output_shape(self, in_shape) -> Shape3:
        """``in_shape - context``."""

    def is_admissible(self, in_shape) -> bool:
        """Whether the network runs on an input of ``in_shape``."""

    def floor_admissible(self, in_shape) -> Shape3:
        """The largest admissible shape within ``in_shape`` (0 on an axis with none)."""

    def ceil_admissible(self, in_shape) -> Shape3:
        """The smallest admissible shape covering ``in_shape``."""

    def digest(self) -> str:
        """A content hash of structure and weights."""

    def describe(self) -> str:
        """One line per layer or node."""

    def describe_kind(self) -> str:
        """One sentence on the kind and what it means for tiling."""
