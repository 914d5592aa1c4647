"""Read a chain network from ONNX as exported by ``torch.onnx.export(..., dynamo=False)``.

Only protobuf is parsed (never pickle).  Anything outside the supported chain is
refused with a message naming the node, the operator and the attribute.
"""
from __future__ import annotations

import numpy as np

from ..errors import NetworkError, UnsupportedOperatorError
from .spec import Activation, Conv, Network, Pool

_ACT = {"Relu": "relu", "LeakyRelu": "leaky_relu", "Elu": "elu", "Sigmoid": "sigmoid",
        "Tanh": "tanh", "Softmax": "softmax", "Identity": "identity", "Dropout": "identity"}
_DEFAULT_ALPHA = {"LeakyRelu": 0.01, "Elu": 1.0}
SUPPORTED = ("Conv", "MaxPool") + tuple(_ACT)


def _attrs(node) -> dict:
    import onnx

    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _label(node) -> str:
    return f"node {node.name or '<unnamed>'!r} ({node.op_type})"


def _require(node, attrs: dict, key: str, ok, want: str) -> None:
    if key in attrs and not ok(attrs[key]):
        raise UnsupportedOperatorError(
            f"{_label(node)}: attribute {key}={attrs[key]!r} is not supported; znni needs {want}. "
            "Re-export the model with that setting (dense inference derives padding from the field of view).")


def _is_all(v, value) -> bool:
    return all(int(x) == value for x in v)


def load_onnx(path) -> Network:
    import onnx
    from onnx import numpy_helper

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf decode errors have many types
        raise NetworkError(f"{path}: not a readable ONNX file ({exc}); export with torch.onnx.export(..., dynamo=False)") from exc
    graph = model.graph
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in consts]
    if len(real_inputs) != 1:
        raise NetworkError(f"{path}: expected exactly one graph input, found {[i.name for i in real_inputs]}")
    elem = real_inputs[0].type.tensor_type.elem_type
    if elem not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE):
        raise NetworkError(f"{path}: graph input has ONNX element type {elem}; znni runs float networks")
    current = real_inputs[0].name
    layers = []
    for node in graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(_attrs(node)["value"])
            continue
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedOperatorError(f"{_label(node)}: custom domain {node.domain!r} is not supported")
        if node.op_type not in SUPPORTED:
            raise UnsupportedOperatorError(
                f"{_label(node)}: operator {node.op_type} is not supported; znni runs chains of "
                f"{', '.join(SUPPORTED)}")
        data_inputs = [i for i in node.input if i and i not in consts]
        if data_inputs != [current]:
            raise UnsupportedOperatorError(
                f"{_label(node)}: reads {list(node.input)}, but znni runs a single chain and expected it to read "
                f"{current!r} (branches, skips and concatenations are not supported)")
        attrs = _attrs(node)
        name = node.name or f"{node.op_type.lower()}{len(layers)}"
        if node.op_type == "Conv":
            w = consts.get(node.input[1])
            if w is None or w.ndim != 5:
                raise UnsupportedOperatorError(
                    f"{_label(node)}: needs a constant 5-D weight (Conv3d); got "
                    f"{'a computed weight' if w is None else f'{w.ndim}-D'}")
            b = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            _require(node, attrs, "strides", lambda v: _is_all(v, 1), "stride 1")
            _require(node, attrs, "dilations", lambda v: _is_all(v, 1), "dilation 1")
            _require(node, attrs, "group", lambda v: int(v) == 1, "groups=1")
            _require(node, attrs, "pads", lambda v: _is_all(v, 0), "padding 0 (valid convolution)")
            _require(node, attrs, "auto_pad", lambda v: v in (b"NOTSET", b"VALID", "NOTSET", "VALID"), "no auto padding")
            layers.append(Conv(np.asarray(w, np.float32), None if b is None else np.asarray(b, np.float32), name=name))
        elif node.op_type == "MaxPool":
            k = [int(v) for v in attrs.get("kernel_shape", [])]
            if len(k) != 3:
                raise UnsupportedOperatorError(f"{_label(node)}: kernel_shape {k} is not 3-D (MaxPool3d)")
            _require(node, attrs, "strides", lambda v: [int(s) for s in v] == k, f"stride equal to the kernel {k}")
            _require(node, attrs, "pads", lambda v: _is_all(v, 0), "padding 0")
            _require(node, attrs, "dilations", lambda v: _is_all(v, 1), "dilation 1")
            _require(node, attrs, "ceil_mode", lambda v: int(v) == 0, "ceil_mode=False")
            _require(node, attrs, "auto_pad", lambda v: v in (b"NOTSET", b"VALID", "NOTSET", "VALID"), "no auto padding")
            if len(node.output) > 1 and node.output[1]:
                raise UnsupportedOperatorError(f"{_label(node)}: pooling indices output is not supported")
            if "strides" not in attrs and k != [1, 1, 1]:
                raise UnsupportedOperatorError(f"{_label(node)}: stride 1 with kernel {k}; znni needs stride == kernel")
            layers.append(Pool(tuple(k), name=name))
        else:
            kind = _ACT[node.op_type]
            if node.op_type == "Softmax":
                axis = int(attrs.get("axis", 1 if opset < 13 else -1))
                if axis != 1 or opset < 13:
                    raise UnsupportedOperatorError(
                        f"{_label(node)}: softmax over axis {axis} (opset {opset}); znni supports Softmax(dim=1) "
                        "over channels at opset >= 13")
            if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
                raise UnsupportedOperatorError(f"{_label(node)}: dropout mask output is not supported")
            alpha = float(attrs.get("alpha", _DEFAULT_ALPHA.get(node.op_type, 0.0)))
            layers.append(Activation(kind, alpha, name=name))
        current = node.output[0]
    outputs = [o.name for o in graph.output]
    if outputs != [current]:
        raise NetworkError(f"{path}: graph outputs {outputs} are not the end of the chain ({current!r})")
    return Network(tuple(layers), name=graph.name or str(path), metadata={"source": str(path), "format": "onnx",
                                                                         "opset": opset})
