"""Read a network from ONNX as ``torch.onnx.export`` writes it (docs/models.md): the legacy
exporter (``dynamo=False``) and the dynamo exporter (``dynamo=True``, PyTorch's default; weights
in an external data file beside the ``.onnx``), with static shapes or dynamic axes.

Only protobuf is parsed (never pickle).  The file becomes a :class:`~.graph.Graph`, a
chain where its nodes form a line of valid stride-1 convolutions, max-pools and activations
(the MPF fast path).  Anything outside the supported
operators is refused with a message naming the node, the operator and the attribute.

Slices are read relative to the shape the file was exported at (a crop of ``a`` voxels
at the start and ``b`` at the end stays that crop for any input shape); BatchNorm folds
into the convolution before it, or becomes a per-channel affine map.  An export with dynamic
axes whose crops, pads and resize sizes are computed from tensor shapes (``Shape``, ``Gather``,
``Slice``, ``Cast``, ``Concat``, arithmetic) has that arithmetic evaluated at two input shapes
the network runs on exactly (found by :func:`_search`: at a shape where a pooling floors, a
valid U-Net's skip crops come out wrong); it loads when both give the same crops and scales
(:func:`_load_dynamic`), and is refused naming the node otherwise.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np

from ..errors import NetworkError, UnsupportedOperatorError
from .chain import Activation, Conv, line_layers
from .graph import PATCH_DEPENDENT, Graph, Node
from .ops import Convolution, Inadmissible, Resize, make, replace

_ACT = {
    "Relu": "relu",
    "LeakyRelu": "leaky_relu",
    "Elu": "elu",
    "Sigmoid": "sigmoid",
    "Tanh": "tanh",
    "Softmax": "softmax",
    "Identity": "identity",
    "Dropout": "identity",
}
_DEFAULT_ALPHA = {"LeakyRelu": 0.01, "Elu": 1.0}
_ARITH = ("Add", "Sub", "Mul", "Div")
SUPPORTED = (
    (
        "Conv",
        "ConvTranspose",
        "MaxPool",
        "AveragePool",
        "Resize",
        "Upsample",
        "Slice",
        "Pad",
        "Concat",
        "BatchNormalization",
        "Constant",
    )
    + _ARITH
    + tuple(_ACT)
)
_BIG = 2**62


def _attrs(node) -> dict:
    # lazy: loads onnx only when called
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _label(node) -> str:
    return f"node {node.name or '<unnamed>'!r} ({node.op_type})"


def _refuse(node, why: str):
    raise UnsupportedOperatorError(f"{_label(node)}: {why}")


def _require(node, attrs: dict, key: str, ok, want: str) -> None:
    if key in attrs and not ok(attrs[key]):
        _refuse(
            node,
            f"attribute {key}={attrs[key]!r} is not supported; znni needs {want}. "
            "Re-export the model with that setting.",
        )


def _is_all(v, value) -> bool:
    return all(int(x) == value for x in v)


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pads3(node, pads) -> tuple:
    p = [int(v) for v in pads]
    if len(p) != 6:
        _refuse(node, f"pads {p} are not 3-D")
    if min(p) < 0:
        _refuse(node, f"negative pads {p} are not supported")
    return tuple(p[:3]), tuple(p[3:])


class _Reader:
    """One pass over an ONNX graph, building znni's nodes; ``probe``: the (z, y, x) input shape a
    dynamic-axes export's shape arithmetic is evaluated at (:func:`_load_dynamic`).  ``search``:
    the probe may be inadmissible; where a node would floor, mismatch or get too short an input,
    the first such node per axis is recorded in ``bad`` (``{axis: (grow, short, why)}``: by how
    many voxels the probe should grow on that axis) and the read goes on (:func:`_search`).
    ``like``: an earlier reader of the same file, whose parsed model and weights are reused."""

    def __init__(self, path, probe=None, search=False, like=None):
        # lazy: loads onnx only when called
        import onnx
        from onnx import numpy_helper

        self.numpy_helper = numpy_helper
        try:
            model = like.model if like is not None else onnx.load(str(path))
        except Exception as exc:  # protobuf decode errors have many types
            missing = _missing_external_data(path)
            if missing:
                raise NetworkError(
                    f"{path}: its weights are stored in {', '.join(missing)} beside it (torch.onnx.export(..., "
                    "dynamo=True) writes them there), which cannot be read; copy that file with the .onnx, or "
                    "export with external_data=False"
                ) from exc
            raise NetworkError(
                f"{path}: not a readable ONNX file ({exc}); export it with torch.onnx.export (docs/models.md)"
            ) from exc
        self.path, self.graph, self.model = path, model.graph, model
        self.opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
        self.initial = (
            like.initial if like is not None else {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        )
        self.consts = dict(self.initial)  # with the constants folded while reading
        inputs = [i for i in self.graph.input if i.name not in self.consts]
        if len(inputs) != 1:
            raise NetworkError(f"{path}: expected exactly one graph input, found {[i.name for i in inputs]}")
        tt = inputs[0].type.tensor_type
        if tt.elem_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
            raise NetworkError(f"{path}: graph input has ONNX element type {tt.elem_type}; znni runs float networks")
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
        if len(dims) not in (0, 5):
            raise NetworkError(f"{path}: the input has {len(dims)} dimensions; znni runs 3-D networks (N, C, Z, Y, X)")
        self.input = inputs[0].name
        self.in_channels = int(dims[1]) if len(dims) == 5 and dims[1] else None
        self.export_shape = tuple(int(d) for d in dims[2:]) if len(dims) == 5 and all(dims[2:]) else None
        self.has_shape_ops = any(n.op_type == "Shape" for n in self.graph.node)
        self.probe = tuple(int(v) for v in probe) if probe is not None else None
        self.channels: dict[str, int] = {}  # channels of each tensor, for Shape at the probe
        self.search = search and self.probe is not None
        self.bad: dict[int, tuple] = {}
        self.floored = ""  # the first node that floors at the export shape (a pooling of an odd length)
        self.step: dict[str, tuple] = {}  # input voxels per voxel of each tensor, per axis (search)
        if self.probe is not None:
            self.export_shape = self.probe
            self.channels = like.channels if like is not None and like.channels else _channels(model)
        self.nodes: list[Node] = []
        self.alias: dict[str, str] = {}  # identity-like outputs -> the tensor they stand for
        self.shape: dict[str, tuple] = {}  # spatial shape of each tensor at the export shape
        if self.export_shape:
            self.shape[self.input] = self.export_shape
        self.readers: dict[str, int] = {}
        for n in self.graph.node:
            for i in n.input:
                self.readers[i] = self.readers.get(i, 0) + 1

    # ---- helpers ----------------------------------------------------------
    def data(self, name: str) -> str:
        return self.alias.get(name, name)

    def const(self, node, i: int, what: str, optional=False):
        if len(node.input) <= i or not node.input[i]:
            if optional or optional is None:
                return None
            _refuse(node, f"needs the {what} input")
        name = node.input[i]
        if name not in self.consts:
            if optional is None:
                return None
            _refuse(
                node,
                f"{what} {name!r} is computed in the graph; znni needs a constant. Export with a fixed "
                "input shape (no dynamic_axes) so the exporter folds shape arithmetic into constants",
            )
        return self.consts[name]

    def add(self, label, node, inputs, **params) -> None:
        name = node.name or f"{label}{len(self.nodes)}"
        inputs = [self.data(i) for i in inputs]
        new = Node(make(label, name, params), tuple(inputs), node.output[0], name)
        if self.search and all(i in self.shape for i in inputs):
            self.shape[new.output] = tuple(self.probe_len(new, a, inputs) for a in range(3))
            step = self.step.get(inputs[0], (Fraction(1),) * 3)
            self.step[new.output] = tuple(new.op.step_origin(a, step[a], Fraction(0))[0] for a in range(3))
        elif self.export_shape and all(i in self.shape for i in inputs):
            try:
                self.shape[new.output] = tuple(
                    new.length(a, [self.shape[i][a] for i in inputs], exact=False) for a in range(3)
                )
            except Inadmissible as exc:
                raise NetworkError(f"{self.path}: at the exported input shape {self.export_shape}: {exc}") from None
            for a in range(3):
                try:
                    new.length(a, [self.shape[i][a] for i in inputs])
                except Inadmissible as exc:  # PyTorch floored here when it exported
                    self.floored = self.floored or str(exc)
        self.nodes.append(new)

    def probe_len(self, node: Node, axis: int, inputs: list) -> int:
        """``node``'s output length on ``axis`` at the probe (searching: recording, not raising,
        where the probe is not admissible)."""
        sizes = [self.shape[i][axis] for i in inputs]
        try:
            return node.length(axis, sizes)
        except Inadmissible as exc:
            step = self.step.get(inputs[0], (Fraction(1),) * 3)[axis]
            self.flag(axis, math.ceil(exc.need * step) if exc.need else 1, exc.short, str(exc))
        try:
            return node.length(axis, sizes, exact=False)
        except Inadmissible as exc:
            return 1 if exc.short else sizes[0]

    def flag(self, axis: int, grow: int, short: bool, why: str) -> None:
        """Searching: the probe is not admissible on ``axis`` (the first reason per axis is kept)."""
        self.bad.setdefault(axis, (max(1, int(grow)), short, why))

    def producer(self, tensor: str):
        return next((n for n in reversed(self.nodes) if n.output == tensor), None)

    # ---- operators --------------------------------------------------------
    def conv(self, node, attrs):
        w = self.consts.get(node.input[1]) if len(node.input) > 1 else None
        if w is None or w.ndim != 5:
            _refuse(
                node, f"needs a constant 5-D weight (Conv3d); got {'a computed weight' if w is None else f'{w.ndim}-D'}"
            )
        b = self.const(node, 2, "bias", optional=True)
        _require(node, attrs, "dilations", lambda v: _is_all(v, 1), "dilation 1")
        _require(node, attrs, "group", lambda v: int(v) == 1, "groups=1")
        _require(node, attrs, "auto_pad", lambda v: _str(v) in ("NOTSET", "VALID"), "explicit pads (no auto_pad)")
        stride = tuple(int(v) for v in attrs.get("strides", (1, 1, 1)))
        low, high = _pads3(node, attrs.get("pads", [0] * 6))
        conv = Conv(
            np.asarray(w, np.float32),
            None if b is None else np.asarray(b, np.float32),
            name=node.name or f"conv{len(self.nodes)}",
        )
        self.add("conv", node, [node.input[0]], conv=conv, stride=stride, pads=(low, high))

    def deconv(self, node, attrs):
        w = self.consts.get(node.input[1]) if len(node.input) > 1 else None
        if w is None or w.ndim != 5:
            _refuse(node, "needs a constant 5-D weight (ConvTranspose3d)")
        b = self.const(node, 2, "bias", optional=True)
        k = list(w.shape[2:])
        _require(node, attrs, "strides", lambda v: [int(s) for s in v] == k, f"stride equal to the kernel {k}")
        _require(node, attrs, "pads", lambda v: _is_all(v, 0), "padding 0")
        _require(node, attrs, "output_padding", lambda v: _is_all(v, 0), "output_padding 0")
        _require(node, attrs, "dilations", lambda v: _is_all(v, 1), "dilation 1")
        _require(node, attrs, "group", lambda v: int(v) == 1, "groups=1")
        if "output_shape" in attrs:
            _refuse(node, "attribute output_shape is not supported")
        if "strides" not in attrs and k != [1, 1, 1]:
            _refuse(node, f"stride 1 with kernel {k}; znni needs stride == kernel")
        bias = np.zeros(w.shape[1], np.float32) if b is None else np.asarray(b, np.float32)
        if not (np.isfinite(w).all() and np.isfinite(bias).all()):
            raise NetworkError(f"{_label(node)}: weight or bias holds NaN/Inf; re-export the network")
        self.add(
            "deconv", node, [node.input[0]], weight=np.ascontiguousarray(w, np.float32), bias=bias, stride=tuple(k)
        )

    def pool(self, node, attrs):
        k = [int(v) for v in attrs.get("kernel_shape", [])]
        if len(k) != 3:
            _refuse(node, f"kernel_shape {k} is not 3-D")
        _require(node, attrs, "strides", lambda v: [int(s) for s in v] == k, f"stride equal to the kernel {k}")
        _require(node, attrs, "pads", lambda v: _is_all(v, 0), "padding 0")
        _require(node, attrs, "dilations", lambda v: _is_all(v, 1), "dilation 1")
        _require(node, attrs, "ceil_mode", lambda v: int(v) == 0, "ceil_mode=False")
        _require(node, attrs, "auto_pad", lambda v: _str(v) in ("NOTSET", "VALID"), "no auto padding")
        if len(node.output) > 1 and node.output[1]:
            _refuse(node, "pooling indices output is not supported")
        if "strides" not in attrs and k != [1, 1, 1]:
            _refuse(node, f"stride 1 with kernel {k}; znni needs stride == kernel")
        self.add("pool", node, [node.input[0]], window=tuple(k), kind="max" if node.op_type == "MaxPool" else "avg")

    def resize(self, node, attrs):
        if node.op_type == "Upsample":
            scales, coord = self.const(node, 1, "scales"), "asymmetric"
            mode = _str(attrs.get("mode", "nearest"))
            nearest = "floor"
        else:
            scales = self.const(node, 2, "scales", optional=None)
            sizes = self.const(node, 3, "sizes", optional=None)
            if (scales is None or scales.size == 0) and sizes is not None and sizes.size == 5:
                src = self.shape.get(self.data(node.input[0]))
                if src is None:
                    _refuse(
                        node,
                        "gives output sizes, not scales, and the input shape is not fixed; export "
                        "with nn.Upsample(scale_factor=...)",
                    )
                scales = np.array([1, 1] + [s / n for s, n in zip(sizes[2:], src)])
                for i, (s, n) in enumerate(zip(sizes[2:], src)):
                    if self.search and (s < n or s % n):  # a floored input: not the network's scale
                        self.flag(i, 1, False, f"{_label(node)}: output size {s} is no multiple of {n}")
                        scales[2 + i] = max(1, s // n)
            mode = _str(attrs.get("mode", "nearest"))
            coord = _str(attrs.get("coordinate_transformation_mode", "half_pixel"))
            nearest = _str(attrs.get("nearest_mode", "round_prefer_floor"))
        if scales is None or np.asarray(scales).size != 5:
            _refuse(node, "needs 5 constant scales (N, C, Z, Y, X)")
        scales = [float(s) for s in np.asarray(scales).reshape(-1)]
        if scales[:2] != [1.0, 1.0] or any(s < 1 or s != int(s) for s in scales[2:]):
            _refuse(node, f"scales {scales}: znni supports integer upsampling factors >= 1 on z, y, x")
        scale = tuple(int(s) for s in scales[2:])
        if mode == "nearest":
            repeat = (coord == "asymmetric" and nearest == "floor") or (
                coord in ("half_pixel", "pytorch_half_pixel") and nearest in ("round_prefer_floor", "round_prefer_ceil")
            )
            if not repeat:
                _refuse(
                    node,
                    f"nearest resize with coordinate_transformation_mode={coord}, nearest_mode={nearest} "
                    "is not a plain repetition; export nn.Upsample(mode='nearest')",
                )
        elif mode == "linear":
            if coord not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
                _refuse(
                    node,
                    f"linear resize with coordinate_transformation_mode={coord} is not supported; "
                    "use align_corners True or False",
                )
            coord = "align_corners" if coord == "align_corners" else "half_pixel"
        else:
            _refuse(node, f"resize mode {mode!r} is not supported (nearest, linear)")
        self.add("resize", node, [node.input[0]], scale=scale, mode=mode, coord=coord if mode == "linear" else "")

    def slice(self, node, attrs):
        if self.opset < 10:
            _refuse(node, f"Slice at opset {self.opset}; re-export at opset >= 11")
        starts = [int(v) for v in self.const(node, 1, "starts")]
        ends = [int(v) for v in self.const(node, 2, "ends")]
        axes = self.const(node, 3, "axes", optional=True)
        steps = self.const(node, 4, "steps", optional=True)
        axes = list(range(len(starts))) if axes is None else [int(a) % 5 for a in axes]
        if steps is not None and any(int(s) != 1 for s in steps):
            if not self.undo_repeat(node, axes, starts, ends, [int(s) for s in steps]):
                _refuse(
                    node,
                    f"steps {list(steps)}: only step 1 slices (crops) are supported, and strided "
                    "slices of a nearest upsampling whose factor they divide",
                )
            return
        src = self.shape.get(self.data(node.input[0]))
        low, high = [0, 0, 0], [0, 0, 0]
        for a, s, e in zip(axes, starts, ends):
            if a < 2:
                if s == 0 and e >= _BIG // 4:
                    continue
                _refuse(
                    node, f"slices axis {a} ({'batch' if a == 0 else 'channels'}) [{s}:{e}]; znni crops z, y, x only"
                )
            i = a - 2
            if s < 0 or 0 < e < _BIG // 4:
                if src is None:
                    _refuse(
                        node,
                        f"crop [{s}:{e}] on axis {a} is absolute and the input shape is not fixed; "
                        "export with a fixed input shape",
                    )
            n = src[i] if src else 0
            low[i] = s if s >= 0 else n + s
            high[i] = 0 if e >= _BIG // 4 else (-e if e < 0 else n - min(e, n))
        self.add("crop", node, [node.input[0]], low=tuple(low), high=tuple(high))

    def undo_repeat(self, node, axes, starts, ends, steps) -> bool:
        """``resize(nearest, f)[..., ::s]`` is ``resize(nearest, f / s)`` when ``s`` divides ``f``
        (a PyTorch idiom for upsampling some axes only): fold the slice into the resize."""
        src = self.data(node.input[0])
        prev = self.producer(src)
        resize = None if prev is None else prev.op
        if not isinstance(resize, Resize) or resize.linear or self.readers.get(node.input[0], 0) != 1:
            return False
        scale = list(resize.scale)
        for a, s, e, st in zip(axes, starts, ends, steps):
            if a < 2 or s != 0 or e < _BIG // 4 or scale[a - 2] % st:
                return False
            scale[a - 2] //= st
        self.nodes[self.nodes.index(prev)] = prev.with_op(replace(resize, scale=tuple(scale)))
        if prev.inputs[0] in self.shape:
            self.shape[prev.output] = tuple(n * f for n, f in zip(self.shape[prev.inputs[0]], scale))
            self.shape[node.output[0]] = self.shape[prev.output]
        self.alias[node.output[0]] = prev.output
        return True

    def pad(self, node, attrs):
        mode = _str(attrs.get("mode", "constant"))
        if mode != "constant":
            _refuse(node, f"pad mode {mode!r} is not supported (constant)")
        pads = attrs.get("pads") if self.opset < 11 else self.const(node, 1, "pads")
        value = float(attrs.get("value", 0.0)) if self.opset < 11 else self.const(node, 2, "value", optional=True)
        value = 0.0 if value is None else float(np.asarray(value).reshape(-1)[0])
        p = [int(v) for v in pads]
        if len(node.input) > 3 and node.input[3]:
            _refuse(node, "the axes input is not supported")
        if len(p) != 10 or any(p[i] for i in (0, 1, 5, 6)):
            _refuse(node, f"pads {p}: znni pads z, y, x only")
        if min(p) < 0:
            _refuse(node, f"negative pads {p} are not supported")
        self.add("pad", node, [node.input[0]], low=tuple(p[2:5]), high=tuple(p[7:10]), value=value)

    def arith(self, node, attrs):
        a, b = node.input[0], node.input[1]
        ca, cb = self.consts.get(a), self.consts.get(b)
        if ca is None and cb is None:
            if node.op_type not in ("Add", "Mul"):
                _refuse(node, f"{node.op_type} of two computed tensors is not supported (Add, Mul are)")
            self.add(node.op_type.lower(), node, [a, b])
            return
        if ca is not None and cb is not None:
            _refuse(node, "both inputs are constants (should have been folded)")
        c = np.asarray(cb if ca is None else ca, np.float64)
        data = a if ca is None else b
        if c.ndim > 5 or any(d != 1 for i, d in enumerate(c.shape[::-1]) if i != 3):
            _refuse(node, f"constant of shape {c.shape}: only scalars and per-channel (1, C, 1, 1, 1) constants")
        c = c.reshape(-1)
        one = np.ones_like(c)
        op = node.op_type
        if op == "Add":
            scale, shift = one, c
        elif op == "Sub":
            scale, shift = (one, -c) if ca is None else (-one, c)
        elif op == "Mul":
            scale, shift = c, 0 * c
        else:
            if ca is not None:
                _refuse(node, "division by a computed tensor is not supported")
            scale, shift = 1 / c, 0 * c
        self.affine(node, data, scale, shift)

    def affine(self, node, data, scale, shift):
        scale, shift = np.asarray(scale, np.float64), np.asarray(shift, np.float64)
        if not (np.isfinite(scale).all() and np.isfinite(shift).all()):
            raise NetworkError(f"{_label(node)}: constants hold NaN/Inf; re-export the network")
        prev = self.producer(self.data(data))
        n = max(scale.size, shift.size)
        if (
            prev is not None
            and isinstance(prev.op, Convolution)
            and self.readers.get(data, 0) == 1
            and n in (1, prev.op.conv.out_channels)
        ):
            # fold into the convolution before it: W' = s W, b' = s b + t
            conv = prev.op.conv
            s = np.broadcast_to(scale, (conv.out_channels,))
            t = np.broadcast_to(shift, (conv.out_channels,))
            bias = conv.bias if conv.bias is not None else np.zeros(conv.out_channels, np.float32)
            folded = Conv(
                (conv.weight.astype(np.float64) * s[:, None, None, None, None]).astype(np.float32),
                (bias.astype(np.float64) * s + t).astype(np.float32),
                name=conv.name,
            )
            self.nodes[self.nodes.index(prev)] = prev.with_op(replace(prev.op, conv=folded))
            self.alias[node.output[0]] = self.data(data)
            if prev.output in self.shape:
                self.shape[node.output[0]] = self.shape[prev.output]
            return
        if n == 1:
            scale, shift = scale.reshape(1), shift.reshape(1)
        self.add(
            "affine",
            node,
            [data],
            scale=np.broadcast_to(scale, (n,)).astype(np.float32).copy(),
            shift=np.broadcast_to(shift, (n,)).astype(np.float32).copy(),
        )

    def batchnorm(self, node, attrs):
        if int(attrs.get("training_mode", 0)):
            _refuse(node, "training_mode=1; export the model in eval mode (model.eval())")
        gamma, beta, mean, var = (
            np.asarray(self.const(node, i, w), np.float64)
            for i, w in ((1, "scale"), (2, "bias"), (3, "mean"), (4, "var"))
        )
        eps = float(attrs.get("epsilon", 1e-5))
        scale = gamma / np.sqrt(var + eps)
        self.affine(node, node.input[0], scale, beta - mean * scale)

    def act(self, node, attrs):
        kind = _ACT[node.op_type]
        if node.op_type == "Softmax":
            axis = int(attrs.get("axis", 1 if self.opset < 13 else -1))
            if axis != 1 or self.opset < 13:
                _refuse(
                    node,
                    f"softmax over axis {axis} (opset {self.opset}); znni supports Softmax(dim=1) "
                    "over channels at opset >= 13",
                )
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
            _refuse(node, "dropout mask output is not supported")
        if kind == "identity":
            self.alias[node.output[0]] = self.data(node.input[0])
            if self.data(node.input[0]) in self.shape:
                self.shape[node.output[0]] = self.shape[self.data(node.input[0])]
            return
        alpha = float(attrs.get("alpha", _DEFAULT_ALPHA.get(node.op_type, 0.0)))
        self.add("act", node, [node.input[0]], act=Activation(kind, alpha, name=node.name or kind))

    def concat(self, node, attrs):
        if int(attrs.get("axis", 1)) % 5 != 1:
            _refuse(node, f"concatenation along axis {attrs.get('axis')}; znni concatenates channels (axis 1)")
        self.add("concat", node, list(node.input))

    # ---- the walk ----------------------------------------------------------
    def fold(self, node) -> bool:
        """Evaluate a node whose inputs are all constants (shape arithmetic)."""
        if node.op_type == "Constant":
            attrs = _attrs(node)
            if "value" not in attrs:
                _refuse(node, f"Constant without a tensor value ({list(attrs)}) is not supported")
            self.consts[node.output[0]] = self.numpy_helper.to_array(attrs["value"])
            return True
        if node.op_type == "Shape" and self.probe is not None and node.input[0] not in self.consts:
            return self.fold_shape(node)
        if not node.input or any(i and i not in self.consts for i in node.input):
            return False
        # lazy: loads onnx only when called
        import onnx
        from onnx.reference import ReferenceEvaluator

        g = onnx.helper.make_graph(
            [node],
            "fold",
            [],
            [onnx.helper.make_tensor_value_info(o, 0, None) for o in node.output if o],
            initializer=[
                self.numpy_helper.from_array(np.asarray(self.consts[i]), i) for i in dict.fromkeys(node.input) if i
            ],
        )
        model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", self.opset)])
        try:
            outs = ReferenceEvaluator(model).run(None, {})
        except Exception as exc:
            _refuse(node, f"could not fold this constant computation ({exc})")
        for name, value in zip([o for o in node.output if o], outs):
            self.consts[name] = np.asarray(value)
        return True

    def fold_shape(self, node) -> bool:
        """``Shape`` of a tensor at the probe shape: ``[1, C, z, y, x]`` (then the shape arithmetic
        after it folds like any constant computation)."""
        name = node.input[0]
        spatial, c = self.shape.get(self.data(name)), self.channels.get(name)
        if spatial is None or c is None:
            _refuse(node, f"the shape of {name!r} cannot be told from the input shape alone")
        attrs = _attrs(node)
        full = np.array([1, c, *spatial], np.int64)
        start, end = int(attrs.get("start", 0)), attrs.get("end")
        self.consts[node.output[0]] = full[start : None if end is None else int(end)]
        return True

    def read(self):
        handlers = {
            "Conv": self.conv,
            "ConvTranspose": self.deconv,
            "MaxPool": self.pool,
            "AveragePool": self.pool,
            "Resize": self.resize,
            "Upsample": self.resize,
            "Slice": self.slice,
            "Pad": self.pad,
            "Concat": self.concat,
            "BatchNormalization": self.batchnorm,
            **{k: self.arith for k in _ARITH},
            **{k: self.act for k in _ACT},
        }
        for node in self.graph.node:  # the most telling refusal first (GroupNorm exports Reshape first)
            if node.op_type in PATCH_DEPENDENT:
                _refuse(
                    node,
                    f"operator {node.op_type} {PATCH_DEPENDENT[node.op_type]}, so the output depends on "
                    "the patch and has no exact sliding-window meaning; znni refuses it. Replace it by "
                    "BatchNorm (folded at load) or retrain without it",
                )
        for node in self.graph.node:
            if node.domain not in ("", "ai.onnx"):
                _refuse(node, f"custom domain {node.domain!r} is not supported")
            if self.fold(node):
                continue
            if node.op_type not in handlers:
                _refuse(node, f"operator {node.op_type} is not supported; znni runs {', '.join(SUPPORTED)}")
            handlers[node.op_type](node, _attrs(node))
        outputs = [o.name for o in self.graph.output]
        if len(outputs) != 1:
            raise NetworkError(f"{self.path}: the graph has {len(outputs)} outputs {outputs}; znni runs one")
        return self.data(outputs[0])


def _missing_external_data(path) -> list:
    """The external data files (``location``) a readable ONNX file names but that are not files
    beside it; empty where the file itself is unreadable."""
    # lazy: loads onnx only when called
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return []
    where = set()
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            if not os.path.isfile(os.path.join(os.path.dirname(str(path)), location)):
                where.add(repr(location))
    return sorted(where)


def _channels(model) -> dict:
    """``{tensor: channels}`` from ONNX's shape inference (channels are static even when the
    spatial axes of a dynamic-axes export are not)."""
    # lazy: loads onnx only when called
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model the inference cannot read: Shape nodes are then refused
        return {}
    out = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) == 5 and dims[1].HasField("dim_value"):
            out[vi.name] = int(dims[1].dim_value)
    return out


#: where the search for an input shape to evaluate a dynamic-axes export's shape arithmetic at
#: starts (:func:`_search`): anisotropic EM U-Nets are admissible near it; deeper ones grow it
PROBE = (64, 320, 320)
_MAX_PROBES = 64  # reads of the file while searching
_MAX_PROBE_LEN = 8192  # per axis


def _params(nodes) -> list:
    """What of each node depends on shape arithmetic (crops, scales, pads), for comparison."""
    return [(n.op.label, n.name, {k: v for k, v in n.op.params().items() if isinstance(v, tuple)}) for n in nodes]


_STATIC = (
    "export with static shapes: torch.onnx.export(model, x, path, dynamo=False) without dynamic_axes, "
    "or dynamo=True without dynamic_shapes"
)


def _search(path, start, like=None):
    """A reader of ``path`` at the first admissible input shape from ``start`` on, and its output.

    Shape arithmetic evaluated at an input the network does not run on exactly (a pooling that
    floors, skips that meet with other lengths) gives crops that are not the network's: the
    probe grows, axis by axis, by what the first failing node needs (a pooling's remainder times
    the downsampling before it; twice the length where the input is too short) until every node
    divides and every skip meets."""
    probe, why = [int(v) for v in start], ""
    for _ in range(_MAX_PROBES):
        reader = like = _Reader(path, tuple(probe), search=True, like=like)
        try:
            out = reader.read()
        except NetworkError:
            if not reader.bad:
                raise
            out = None
        if not reader.bad:
            return reader, out
        for axis, (grow, short, why) in sorted(reader.bad.items()):
            probe[axis] = max(2 * probe[axis], probe[axis] + grow) if short else probe[axis] + grow
        if max(probe) > _MAX_PROBE_LEN:
            break
    raise NetworkError(
        f"{path}: found no input shape (searched from {tuple(start)}) that this dynamic-axes export runs on "
        f"exactly, to evaluate its shape arithmetic at (last: {why}); {_STATIC}"
    )


def _pointwise_before_upsampling(nodes, output) -> tuple:
    """``nodes`` with each upsampling followed by a 1x1x1 convolution (its only reader) swapped:
    the convolution first, on the fewer voxels (``prod(scale)`` times fewer; a U-Net's "upsample
    then 1x1x1 conv" decoder step), and the upsampling on its output channels (a U-Net halves
    them there).  Nearest: exact, the upsampling copies voxels and a 1x1x1 convolution computes
    each voxel from that voxel alone, so both orders compute the same sums of the same values.
    Linear: the same to float32 rounding, each output voxel ``(1 - w) a + w b`` per axis with the
    weights summing to one, so ``W interp(x) + bias == interp(W x + bias)`` (a U-Net's trilinear
    decoder step of 48 -> 24 maps on 16 x 96^2: its conv 27 -> 6 ms, the upsampling 13 -> 7).
    The swapped nodes keep their names; the convolution's output gets a new tensor name, the
    upsampling writes the convolution's old output."""
    nodes = list(nodes)
    readers = {}
    for n in nodes:
        for t in n.inputs:
            readers[t] = readers.get(t, 0) + 1
    names = {n.output for n in nodes}
    for i in range(len(nodes) - 1):
        up, conv = nodes[i], nodes[i + 1]
        if not (
            isinstance(up.op, Resize)
            and isinstance(conv.op, Convolution)
            and conv.inputs == (up.output,)
            and readers.get(up.output) == 1
            and up.output != output
            and conv.op.conv.kernel == (1, 1, 1)
            and conv.op.plain
        ):
            continue
        mid = conv.output + "/before-upsampling"
        while mid in names:
            mid += "'"
        names.add(mid)
        nodes[i] = conv.with_op(conv.op, (up.inputs[0],), mid)
        nodes[i + 1] = up.with_op(up.op, (mid,), conv.output)
    return tuple(nodes)


def _first_conv(reader):
    """The first convolution that reads the input (None: none does)."""
    return next((n.op.conv for n in reader.nodes if isinstance(n.op, Convolution) and reader.input in n.inputs), None)


def _load_dynamic(path, like=None):
    """A dynamic-axes export whose crops and resize sizes are computed from tensor shapes: its
    shape arithmetic is evaluated at two admissible input shapes (:func:`_search`, the second
    one grid further); where both give the same graph (crops and scales independent of the input
    size, as in valid U-Nets that crop skips to the decoder's shape) that graph is the network,
    else the node that differs is named."""
    ra, out_a = _search(path, PROBE, like)
    first = _first_conv(ra)
    in_channels = ra.in_channels or (first.in_channels if first is not None else 1)
    grid = Graph(tuple(ra.nodes), ra.input, out_a, in_channels, name=str(path)).grid
    rb, out_b = _search(path, tuple(n + g for n, g in zip(ra.probe, grid)), ra)
    a, b = ra.probe, rb.probe
    for (op, name, pa), (_, _, pb) in zip(_params(ra.nodes), _params(rb.nodes)):
        if pa != pb:
            raise NetworkError(
                f"{path}: node {name!r} ({op}): its shape arithmetic gives {pa} at input {a} but {pb} at {b}; "
                f"znni needs crops and scales that do not depend on the input size; {_STATIC}"
            )
    if len(ra.nodes) != len(rb.nodes) or out_a != out_b:
        raise NetworkError(f"{path}: the graph's structure depends on the input size; {_STATIC}")
    ra.export_shape = None  # the file has none: every admissible shape is the network's
    return ra, out_a


def load_onnx(path):
    """The :class:`~.graph.Graph` of an ONNX file: a chain where its nodes form a line of valid
    stride-1 convolutions, max-pools and activations (run dense through max-pooling fragments)."""
    reader = _Reader(path)
    if reader.export_shape is None and reader.has_shape_ops:  # dynamic axes with shape arithmetic
        reader, output = _load_dynamic(path, reader)
    elif reader.has_shape_ops:  # only the batch axis dynamic: the arithmetic at the export shape
        reader = _Reader(path, reader.export_shape, like=reader)
        output = reader.read()
    else:
        output = reader.read()
    if output == reader.input:
        raise NetworkError(f"{path}: the graph computes nothing (its output is its input)")
    meta = {"source": str(path), "format": "onnx", "opset": reader.opset}
    line = line_layers(reader.nodes, reader.input, output)
    if line is not None:  # a chain takes any input of at least its field of view, whatever the export's
        first = next(l for l in line if isinstance(l, Conv))
        in_channels, export_shape = first.in_channels, None
    else:
        first = _first_conv(reader)
        in_channels = reader.in_channels or (first.in_channels if first is not None else None)
        export_shape = reader.export_shape
    if in_channels is None:
        raise NetworkError(f"{path}: cannot tell the number of input channels; export with a fixed input shape")
    try:
        return Graph(
            _pointwise_before_upsampling(reader.nodes, output),
            reader.input,
            output,
            in_channels,
            name=reader.graph.name or str(path),
            metadata=meta,
            export_shape=export_shape,
        )
    except NetworkError as exc:
        if not reader.floored:
            raise
        raise NetworkError(
            f"{path}: it was exported at input {reader.export_shape}, where the network floors "
            f"({reader.floored}), so its crops are that input's and fit no input it runs on exactly ({exc}); "
            "re-export at an input every pooling divides (e.g. the training patch), or with dynamic axes "
            "(docs/models.md)"
        ) from None
