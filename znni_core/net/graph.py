"""The network: a fully convolutional DAG of operators, chains and U-Nets alike (docs/engine.md).

A :class:`Graph` is a list of :class:`Node` in topological order; each node reads named
tensors and writes one.  Tensors are ``(C, z, y, x)``.  A **chain** is a graph whose nodes
form a line of stride-1 unpadded convolutions, max-pooling and activations (``kind ==
"chain"``, :attr:`Graph.layers`; :class:`Network` builds one from layers): its max-pooling
is read as a dense sliding filter, run through max-pooling fragments (``net/chain.py``), so
its output is dense whatever its pooling.  A node's operator (``Node.op``) is an instance of
a class of :mod:`.ops` (its label in YAML specs and plans):

==================  ========================================================================
``Convolution``     ``conv``: a :class:`~.chain.Conv` with ``stride`` and zero ``pads`` (low, high)
``Deconvolution``   ``deconv``: transposed convolution, stride = kernel (``weight``, ``bias``)
``Pooling``         ``pool``: ``kind`` max or avg, window = stride, no padding
``Resize``          ``resize``: integer ``scale`` per axis, ``mode`` nearest or linear (``coord``:
                    half_pixel, align_corners)
``Crop``            ``crop``: removes ``low``/``high`` voxels per axis (a Slice, relative to its input)
``Pad``             ``pad``: adds ``low``/``high`` voxels of ``value`` per axis
``Add`` ``Mul``     ``add``, ``mul``: element-wise on two tensors
``Affine``          ``affine``: ``x * scale[c] + shift[c]`` (BatchNorm not foldable into a conv)
``Concat``          ``concat``: along channels
``Act``             ``act``: an :class:`~.chain.Activation`
==================  ========================================================================

In any other graph, geometry is propagated axis by axis (every operator is separable): the **context** ``c``
(output = input - c), the **grid** ``g`` (product of the downsampling factors: patches
that start on it see the same pooling phases as the whole volume) and the **kind**:

* ``valid``: no padding anywhere, so an output voxel depends on its input window only;
  tiles on the grid give exactly the whole-volume output.  ``field_of_view = c + 1``.
* ``padded``: zero padding (or a border-clamped linear resize) makes voxels near a patch
  border depend on where the patch is; overlapping patches are blended (``exec/blend``).

An input length ``n`` is **admissible** when skip connections meet with equal shapes and,
in a valid graph, every pooling and strided layer divides its input exactly (a padded
graph floors like PyTorch): ``n = n_min + k g``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from ..errors import InputError, NetworkError
from .chain import (
    Activation,
    Conv,
    Layer,
    Pool,
    chain_digest,
    chain_geometry,
    check_chain,
    describe_layers,
    line_layers,
    pooling_product,
)
from .geometry import Geometric, NetGeometry
from .ops import Act, Convolution, Inadmissible, Operator, Pooling

Shape3 = tuple[int, int, int]
#: operators whose output depends on the whole patch: no sliding-window meaning
PATCH_DEPENDENT = {
    "InstanceNormalization": "normalises each channel over the whole patch",
    "GroupNormalization": "normalises groups of channels over the whole patch",
    "LayerNormalization": "normalises over the whole patch",
    "MeanVarianceNormalization": "normalises over the whole patch",
    "GlobalAveragePool": "averages over the whole patch",
    "GlobalMaxPool": "takes the maximum over the whole patch",
    "ReduceMean": "reduces over the patch",
}
_MAX_SCAN = 4096  # longest admissible length searched for (per axis)


@dataclass(frozen=True, eq=False)
class Node:
    """One operator of a :class:`Graph`: reads the tensors ``inputs``, writes the tensor ``output``.

    ``op`` is the operator, an instance of a class of :mod:`.ops` (made by a loader or by hand).
    """

    op: Operator
    inputs: tuple
    output: str
    name: str

    def __post_init__(self):
        if not isinstance(self.op, Operator):
            raise NetworkError(f"{self.name}: {self.op!r} is not a graph operator (one of znni_core.net.ops)")
        object.__setattr__(self, "inputs", tuple(self.inputs))

    def length(self, axis: int, sizes: list, exact: bool = True) -> int:
        """The output length on ``axis`` for input lengths ``sizes`` (:meth:`.ops.Operator.length`)."""
        return self.op.length(axis, sizes, exact, self.name)

    def with_op(self, op: Operator, inputs=None, output=None) -> Node:
        """This node (its name) running ``op``, optionally on other tensors."""
        return Node(op, self.inputs if inputs is None else inputs, self.output if output is None else output, self.name)


@dataclass(frozen=True, eq=False)
class Graph(Geometric):
    """A validated DAG; see the module docstring.

    >>> import numpy as np
    >>> net = Network((Conv(np.ones((2, 1, 3, 3, 3), np.float32)), Pool((2, 2, 2)),
    ...                Conv(np.ones((1, 2, 3, 3, 3), np.float32))))
    >>> net.kind, net.field_of_view, [n.op.label for n in net.nodes]
    ('chain', (8, 8, 8), ['conv', 'pool', 'conv'])
    """

    nodes: tuple
    input: str
    output: str
    in_channels: int
    name: str = "graph"
    metadata: dict = field(default_factory=dict)
    export_shape: tuple | None = None  # (z, y, x) the ONNX file was exported at, if static

    def __post_init__(self):
        nodes = tuple(self.nodes)
        object.__setattr__(self, "nodes", nodes)
        if not any(isinstance(n.op, Convolution) for n in nodes):
            raise NetworkError(f"{self.name}: the network has no convolution")
        channels = {self.input: int(self.in_channels)}
        for node in nodes:
            missing = [i for i in node.inputs if i not in channels]
            if missing:
                raise NetworkError(f"{node.name}: reads {missing}, which no earlier node writes")
            cin = [channels[i] for i in node.inputs]
            channels[node.output] = node.op.channels(cin, node.name)
        if self.output not in channels:
            raise NetworkError(f"{self.name}: the output {self.output!r} is not computed by any node")
        object.__setattr__(self, "channels", channels)
        _ = self.geometry  # validates admissibility and the output resolution now, at load

    # ---- geometry --------------------------------------------------------
    def axis_lengths(self, axis: int, n: int) -> dict:
        """Every tensor's length on ``axis`` for an input of length ``n``."""
        lens = {self.input: int(n)}
        for node in self.nodes:
            lens[node.output] = node.length(axis, [lens[i] for i in node.inputs], self.kind == "valid")
        return lens

    def shapes(self, in_shape) -> dict:
        """``{tensor: (C, z, y, x)}`` for an input patch ``in_shape`` (z, y, x), pooling subsampling (for a
        chain, as its strided form computes them; its dense output is larger, see :attr:`geometry`).

        Raises :class:`~znni_core.errors.InputError` naming the node and the nearest
        admissible lengths when ``in_shape`` is not admissible."""
        per_axis = []
        for axis, n in enumerate(in_shape):
            try:
                per_axis.append(self.axis_lengths(axis, n))
            except Inadmissible as exc:
                lo, hi = self.admissible_around(axis, n)
                raise InputError(
                    f"input length {n} on axis {'zyx'[axis]} is not admissible for {self.name}: node {exc}. "
                    f"Admissible lengths are {self.geometry.n_min[axis]} + k * {self.grid[axis]}"
                    f"{f'; nearest {lo} or {hi}' if lo else f'; the smallest is {hi}'}"
                ) from None
        return {t: (self.channels[t],) + tuple(a[t] for a in per_axis) for t in per_axis[0]}

    # ---- a chain's line of layers ----------------------------------------
    @functools.cached_property
    def _line(self) -> tuple | None:
        return line_layers(self.nodes, self.input, self.output)

    @functools.cached_property
    def layers(self) -> tuple[Layer, ...]:
        """A chain's nodes as layers (:class:`Conv`, :class:`Pool`, :class:`Activation`), in order;
        a :class:`~znni_core.errors.NetworkError` for a graph that is not a chain."""
        if self._line is None:
            raise NetworkError(f"{self.name}: a {self.kind} graph is not a chain of layers")
        return self._line

    @functools.cached_property
    def pools(self) -> tuple[Pool, ...]:
        """A chain's pooling layers, in order."""
        return tuple(l for l in self.layers if isinstance(l, Pool))

    @functools.cached_property
    def geometry(self) -> NetGeometry:
        """The admissible input lengths, context and halo (a :class:`~.geometry.NetGeometry`).

        A chain's is dense (any input of at least its field of view, through max-pooling
        fragments).  Otherwise ``n_min`` is the smallest admissible input length, ``grid`` the admissible step, ``context`` the
        voxels the output loses, ``low`` the part of them below the output.  Raises
        :class:`~znni_core.errors.NetworkError` if the output's resolution differs from the input's, no
        length below 4096 is admissible, or the downsampling is irregular.
        """
        if self._line is not None:
            return chain_geometry(self._line)
        n_min, context, grid, low = [], [], [], []
        for axis in range(3):
            step, origin = {self.input: Fraction(1)}, {self.input: Fraction(0)}
            for node in self.nodes:
                step[node.output], origin[node.output] = node.op.step_origin(
                    axis, step[node.inputs[0]], origin[node.inputs[0]]
                )
            if step[self.output] != 1:
                raise NetworkError(
                    f"{self.name}: the output is at {step[self.output]} input voxels per voxel on axis {'zyx'[axis]}; "
                    "znni runs graphs whose output has the input's resolution, and chains of convolutions, "
                    "max-pooling and activations (run dense through max-pooling fragments)"
                )
            g = math.lcm(*(s.numerator for s in step.values()))
            first, reason = None, None
            for n in range(1, _MAX_SCAN):
                try:
                    out = self.axis_lengths(axis, n)[self.output]
                except Inadmissible as exc:
                    reason = str(exc)
                    continue
                first = (n, out)
                break
            if first is None:
                raise NetworkError(
                    f"{self.name}: no input length up to {_MAX_SCAN} is admissible on axis {'zyx'[axis]} ({reason})"
                )
            n0, out0 = first
            try:
                out1 = self.axis_lengths(axis, n0 + g)[self.output]
            except Inadmissible as exc:
                raise NetworkError(
                    f"{self.name}: input lengths {n0} and {n0 + g} are not both admissible on axis "
                    f"{'zyx'[axis]} ({exc}); the graph's downsampling is irregular"
                ) from None
            if out1 - out0 != g:
                raise NetworkError(
                    f"{self.name}: the output grows by {out1 - out0} when the input grows by {g} on "
                    f"axis {'zyx'[axis]}; znni runs networks whose output has the input's resolution"
                )
            n_min.append(n0)
            grid.append(g)
            context.append(n0 - out0)
            low.append(max(0, min(n0 - out0, math.floor(origin[self.output]))))
        return NetGeometry(tuple(n_min), tuple(grid), tuple(context), tuple(low))  # type: ignore[arg-type]

    @property
    def pooling_product(self) -> Shape3:
        """A chain's product of pooling windows (its fragments' step); another graph's translation
        :attr:`grid`."""
        return pooling_product(self._line) if self._line is not None else self.grid

    @property
    def out_channels(self) -> int:
        """Channels of the output tensor."""
        return self.channels[self.output]

    @functools.cached_property
    def padded_by(self) -> list[str]:
        """Nodes that make the output depend on the patch position (empty for a valid graph)."""
        return [f"{n.name} ({n.op.padding})" for n in self.nodes if n.op.padding]

    @property
    def kind(self) -> str:
        """``"chain"`` for a line of layers (run dense through max-pooling fragments); else
        ``"padded"`` if some node makes the output depend on the patch position, else ``"valid"``."""
        if self._line is not None:
            return "chain"
        return "padded" if self.padded_by else "valid"

    def describe_kind(self) -> str:
        """One sentence on the network's kind and what it means for tiling (up to three padding nodes named)."""
        if self.kind == "chain":
            return (
                f"chain (max-pooling fragments): convolutions, max-pooling and activations in a line; any input of "
                f"at least the field of view {self.field_of_view} gives dense output (pooling product "
                f"{self.pooling_product})"
            )
        if self.kind == "valid":
            return (
                f"valid graph: no padding, so tiles on the grid {self.grid} give exactly the whole-volume output "
                f"(context {self.context})"
            )
        shown = ", ".join(self.padded_by[:3]) + (
            f" and {len(self.padded_by) - 3} more" if len(self.padded_by) > 3 else ""
        )
        return (
            f"padded graph: {shown} make voxels near a patch border depend on the patch, so overlapping patches "
            "are blended"
        )

    # ---- identity ---------------------------------------------------------
    def digest(self) -> str:
        """A content hash of structure and weights (sha256 hex); a chain's hashes its layers only, so
        it is the same whichever loader or tensor names made it."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        if self._line is not None:
            return chain_digest(self._line)
        h = hashlib.sha256(f"graph|{self.input}|{self.output}|{self.in_channels}".encode())
        for node in self.nodes:
            h.update(f"|{node.op.label}|{node.inputs}|{node.output}|".encode())
            params = node.op.params()
            for key in sorted(params):
                v = params[key]
                if isinstance(v, Conv):
                    h.update(b"conv" + str(v.weight.shape).encode() + v.weight.tobytes())
                    h.update(v.bias.tobytes() if v.bias is not None else b"none")
                elif isinstance(v, Activation):
                    h.update(f"act{v.kind}{v.alpha!r}".encode())
                elif isinstance(v, np.ndarray):
                    h.update(key.encode() + str(v.shape).encode() + np.ascontiguousarray(v).tobytes())
                else:
                    h.update(f"{key}={v!r}".encode())
        return h.hexdigest()

    def describe(self) -> str:
        """One line per node (operator and its non-array parameters; a chain's per layer, then its
        field of view), then the channels in and out."""
        if self._line is not None:
            rows = describe_layers(self._line)
            rows.append(f"field of view {self.field_of_view}, in {self.in_channels} ch, out {self.out_channels} ch")
            return "\n".join(rows)
        rows = [f"{n.name}: {n.op.describe()}" for n in self.nodes]
        rows.append(f"in {self.in_channels} ch, out {self.out_channels} ch")
        return "\n".join(rows)

    def consumers(self) -> dict:
        """``{tensor: number of nodes reading it}`` (the output counts as read once)."""
        count = {self.input: 0}
        for node in self.nodes:
            count[node.output] = 0
            for i in node.inputs:
                count[i] += 1
        count[self.output] += 1
        return count


def _chain_node(layer: Layer, i: int, source: str) -> Node:
    """The graph node of ``layer``, the ``i``-th of a chain, reading ``source``."""
    if isinstance(layer, Conv):
        return Node(Convolution(layer), (source,), f"t{i}", layer.name)
    if isinstance(layer, Pool):
        return Node(Pooling(layer.window), (source,), f"t{i}", layer.name)
    if isinstance(layer, Activation):
        return Node(Act(layer), (source,), f"t{i}", layer.name)
    raise NetworkError(f"layer {i} is a {type(layer).__name__}; a chain holds Conv, Pool and Activation layers")


class _ChainType(type):
    """The type of :class:`Network`: calling it builds a chain's graph, and ``isinstance`` holds for
    every graph that is a chain, whichever loader made it."""

    def __call__(cls, layers, name: str = "network", metadata: dict | None = None) -> Graph:
        layers = tuple(layers)
        check_chain(layers, name)
        nodes, source = [], "input"
        for i, layer in enumerate(layers):
            nodes.append(_chain_node(layer, i, source))
            source = nodes[-1].output
        first = next(l for l in layers if isinstance(l, Conv))
        return Graph(tuple(nodes), "input", source, first.in_channels, name=name, metadata=dict(metadata or {}))

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, Graph) and obj.kind == "chain"


class Network(metaclass=_ChainType):
    """A chain: ``Network(layers, name=..., metadata=...)`` builds the :class:`Graph` of ``layers``
    (:class:`Conv`, :class:`Pool`, :class:`Activation`) in a line; ``isinstance(net, Network)``
    tells whether a graph is a chain (``net.kind == "chain"``).

    >>> import numpy as np
    >>> net = Network((Conv(np.ones((2, 1, 3, 3, 3), np.float32)), Pool((2, 2, 2)),
    ...                Conv(np.ones((1, 2, 3, 3, 3), np.float32))))
    >>> type(net).__name__, isinstance(net, Network), net.field_of_view, net.pooling_product
    ('Graph', True, (8, 8, 8), (2, 2, 2))
    """
