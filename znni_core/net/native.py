"""znni's own network format: a YAML spec plus weights in safetensors or npz.

Example ``net.yaml``::

    format: znni-network/1
    name: demo
    weights: net.safetensors      # relative to this file; .safetensors or .npz
    layers:
      - {type: conv, weight: conv1.weight, bias: conv1.bias}
      - {type: relu}
      - {type: maxpool, window: [1, 2, 2]}
      - {type: conv, weight: conv2.weight}      # no bias
      - {type: leaky_relu, alpha: 0.1}
      - {type: sigmoid}

Layer types: ``conv``, ``maxpool`` (``window``: int or [z, y, x]), and the activations
``relu, leaky_relu, elu, sigmoid, tanh, softmax, identity`` (``alpha`` for leaky_relu/elu).

Any other network (a U-Net, :mod:`.graph`) lists ``nodes`` instead of ``layers``; each reads
named tensors and writes one.  Both load as a :class:`~.graph.Graph`; nodes that form a line of
convolutions, max-pooling and activations are a chain, as the same ``layers`` would be, and
:func:`save_network` writes a chain as ``layers``::

    format: znni-network/1
    weights: unet.safetensors
    input: x
    in_channels: 1
    output: y
    nodes:
      - {op: conv, inputs: [x], output: a, weight: c1.w, bias: c1.b, stride: [1, 1, 1],
         pads: [[0, 1, 1], [0, 1, 1]]}                         # [low, high], zero padding
      - {op: act, inputs: [a], output: b, kind: relu}
      - {op: pool, inputs: [b], output: c, kind: max, window: [1, 2, 2]}      # max | avg
      - {op: resize, inputs: [c], output: d, scale: [1, 2, 2], mode: nearest}  # linear: coord
      - {op: deconv, inputs: [c], output: e, weight: up.w, bias: up.b, stride: [1, 2, 2]}
      - {op: crop, inputs: [b], output: f, low: [0, 2, 2], high: [0, 2, 2]}
      - {op: concat, inputs: [f, e], output: g}                 # also add, mul (two tensors)
      - {op: affine, inputs: [g], output: y, scale: bn.s, shift: bn.t}   # per channel

YAML is read with ``safe_load`` (no object construction) and npz with ``allow_pickle=False``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from ..errors import NetworkError
from .chain import ACTIVATIONS, Activation, Conv, Pool
from .graph import Graph, Network, Node
from .ops import make, shape3

FORMAT = "znni-network/1"
_DEFAULT_ALPHA = {"leaky_relu": 0.01, "elu": 1.0}


def _load_weights(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise NetworkError(f"weights file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            # lazy: loads safetensors only when called
            from safetensors.numpy import load_file

            return dict(load_file(str(path)))
        if suffix == ".npz":
            with np.load(str(path), allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
    except NetworkError:
        raise
    except Exception as exc:
        raise NetworkError(
            f"weights file {path} cannot be read safely ({exc}); object arrays and pickles are refused"
        ) from exc
    raise NetworkError(f"weights file {path}: unsupported format {suffix!r}; use .safetensors or .npz")


#: what a wrong value in a spec raises inside the layer constructors: reported as a NetworkError
_BAD_VALUE = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError)


def _short(entry) -> str:
    """A spec entry for a message: its text, at most 200 characters."""
    text = repr(entry)
    return text if len(text) <= 200 else text[:197] + "..."


def _entries(path: Path, entries: list, what: str, key: str, build, weights: dict) -> list:
    """``build(path, i, entry, weights)`` for each spec entry; an entry that is not a mapping with
    ``key``, or whose values the constructors refuse, is a :class:`NetworkError` naming it."""
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or key not in entry:
            raise NetworkError(f"{path}: {what} {i} must be a mapping with {key!r}, got {_short(entry)}")
        try:
            out.append(build(path, i, entry, weights))
        except _BAD_VALUE as exc:
            raise NetworkError(
                f"{path}: {what} {i} {_short(entry)}: invalid value ({type(exc).__name__}: {exc})"
            ) from None
    return out


def _layer(path: Path, i: int, entry: dict, weights: dict):
    """Layer ``i`` of a chain spec."""
    kind = str(entry["type"]).lower()
    name = str(entry.get("name", f"{kind}{i}"))
    if kind == "conv":
        key = entry.get("weight")
        if key not in weights:
            raise NetworkError(
                f"{path}: layer {i} ({name}) weight key {key!r} not in the weights file (has {sorted(weights)[:8]})"
            )
        bkey = entry.get("bias")
        if bkey is not None and bkey not in weights:
            raise NetworkError(f"{path}: layer {i} ({name}) bias key {bkey!r} not in the weights file")
        return Conv(weights[key], weights[bkey] if bkey is not None else None, name=name)
    elif kind in ("maxpool", "pool"):
        return Pool(entry.get("window"), name=name)
    elif kind in ACTIVATIONS:
        alpha = float(entry.get("alpha", _DEFAULT_ALPHA.get(kind, 0.0)))
        return Activation(kind, alpha, name=name)
    else:
        raise NetworkError(
            f"{path}: layer {i} ({name}) has unsupported type {kind!r}; use conv, maxpool or one of {ACTIVATIONS}"
        )


def load_native(path) -> Graph:
    """Load a ``znni-network/1`` YAML spec and its weights as a :class:`~.graph.Graph`: from
    ``layers`` (a chain) or ``nodes`` (a chain too where they form a line).

    A spec that is not safe YAML, lacks the format, or names a missing weight or an unsupported layer
    is a :class:`NetworkError`.
    """
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise NetworkError(f"{path}: not a YAML network spec (not UTF-8 text: {exc})") from None
    except yaml.YAMLError as exc:
        raise NetworkError(
            f"{path}: not a safe YAML network spec ({exc.__class__.__name__}: {exc}); "
            "tags that construct Python objects are refused"
        ) from exc
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise NetworkError(
            f"{path}: expected a mapping with 'format: {FORMAT}', got "
            f"{spec.get('format') if isinstance(spec, dict) else type(spec).__name__!r}"
        )
    weights = _load_weights(path.parent / str(spec.get("weights", ""))) if spec.get("weights") else {}
    if "nodes" in spec:
        if not isinstance(spec["nodes"], list):
            raise NetworkError(f"{path}: 'nodes' must be a list of mappings, got {_short(spec['nodes'])}")
        try:
            return _load_graph(path, spec, weights)
        except _BAD_VALUE as exc:
            raise NetworkError(f"{path}: invalid graph spec ({type(exc).__name__}: {exc})") from None
    layers_spec = spec.get("layers")
    if not isinstance(layers_spec, list) or not layers_spec:
        raise NetworkError(f"{path}: 'layers' (a chain) or 'nodes' (a graph) must be a non-empty list")
    layers = _entries(path, layers_spec, "layer", "type", _layer, weights)
    return Network(
        tuple(layers), name=str(spec.get("name", path.stem)), metadata={"source": str(path), "format": FORMAT}
    )


_ARRAYS = {"conv": ("weight", "bias"), "deconv": ("weight", "bias"), "affine": ("scale", "shift")}
_SHAPES = ("stride", "window", "scale", "low", "high")


def _node(path: Path, i: int, entry: dict, weights: dict) -> Node:
    """Node ``i`` of a graph spec."""
    op, name = str(entry["op"]), str(entry.get("name", f"{entry['op']}{i}"))
    params = {k: v for k, v in entry.items() if k not in ("op", "name", "inputs", "output")}
    for key in _ARRAYS.get(op, ()):
        ref = params.get(key)
        if ref is None:
            continue
        if ref not in weights:
            raise NetworkError(f"{path}: node {i} ({name}) {key} key {ref!r} is not in the weights file")
        with np.errstate(over="ignore", invalid="ignore"):  # beyond float32: Inf, refused below
            arr = np.asarray(weights[ref], np.float32)
        if not np.isfinite(arr).all():  # a conv's are checked by Conv; deconv and affine arrays here
            raise NetworkError(
                f"{path}: node {i} ({name}) {key} {ref!r} holds {int((~np.isfinite(arr)).sum())} NaN/Inf "
                "value(s); fix or re-export the weights"
            )
        params[key] = arr
    for key in _SHAPES:
        if key in params and not isinstance(params[key], np.ndarray):
            params[key] = shape3(params[key], f"{path}: node {name} {key}")
    if op == "conv":
        if "weight" not in params:
            raise NetworkError(f"{path}: node {i} ({name}) needs a weight")
        params = {
            "conv": Conv(params.pop("weight"), params.pop("bias", None), name=name),
            "stride": params.get("stride", (1, 1, 1)),
            "pads": tuple(shape3(p, f"{path}: node {name} pads") for p in params.get("pads", [[0] * 3] * 2)),
        }
    elif op == "act":
        kind = str(params.get("kind"))
        params = {"act": Activation(kind, float(params.get("alpha", _DEFAULT_ALPHA.get(kind, 0.0))), name=name)}
    try:
        operator = make(op, name, params)
    except NetworkError as exc:
        raise NetworkError(f"{path}: node {i} {exc}") from None
    return Node(operator, tuple(entry.get("inputs", ())), str(entry.get("output", name)), name)


def _load_graph(path: Path, spec: dict, weights: dict) -> Graph:
    nodes = _entries(path, spec["nodes"] or [], "node", "op", _node, weights)
    if not nodes:
        raise NetworkError(f"{path}: 'nodes' must be a non-empty list")
    return Graph(
        tuple(nodes),
        str(spec.get("input", "input")),
        str(spec.get("output", nodes[-1].output)),
        int(spec.get("in_channels", 1)),
        name=str(spec.get("name", path.stem)),
        metadata={"source": str(path), "format": FORMAT},
    )


def _save_graph(net: Graph, path: Path, wpath: Path) -> tuple[dict, dict]:
    tensors, entries = {}, []
    for i, node in enumerate(net.nodes):
        entry = {"op": node.op.label, "name": node.name, "inputs": list(node.inputs), "output": node.output}
        for key, v in node.op.params().items():
            if isinstance(v, Conv):
                tensors[f"n{i}.weight"] = v.weight
                entry["weight"] = f"n{i}.weight"
                if v.bias is not None:
                    tensors[f"n{i}.bias"] = v.bias
                    entry["bias"] = f"n{i}.bias"
            elif isinstance(v, Activation):
                entry["kind"], entry["alpha"] = v.kind, float(v.alpha)
            elif isinstance(v, np.ndarray):
                tensors[f"n{i}.{key}"] = np.ascontiguousarray(v, np.float32)
                entry[key] = f"n{i}.{key}"
            elif key == "pads":
                entry[key] = [list(map(int, p)) for p in v]
            elif isinstance(v, tuple):
                entry[key] = [int(x) for x in v]
            else:
                entry[key] = float(v) if isinstance(v, float) else v
        entries.append(entry)
    spec = {
        "format": FORMAT,
        "name": net.name,
        "weights": wpath.name,
        "input": net.input,
        "in_channels": int(net.in_channels),
        "output": net.output,
        "nodes": entries,
    }
    return spec, tensors


def save_network(net: Graph, path) -> Path:
    """Write ``net`` as ``path`` (YAML) plus ``<stem>.safetensors`` beside it; returns the YAML path."""
    # lazy: loads safetensors only when called
    from safetensors.numpy import save_file

    path = Path(path)
    if net.kind != "chain":
        wpath = path.with_suffix(".safetensors")
        spec, tensors = _save_graph(net, path, wpath)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(wpath))
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path
    wpath = path.with_suffix(".safetensors")
    tensors: dict[str, np.ndarray] = {}
    entries = []
    for i, layer in enumerate(net.layers):
        name = f"l{i}"
        if isinstance(layer, Conv):
            tensors[f"{name}.weight"] = layer.weight
            entry = {"type": "conv", "name": layer.name, "weight": f"{name}.weight"}
            if layer.bias is not None:
                tensors[f"{name}.bias"] = layer.bias
                entry["bias"] = f"{name}.bias"
        elif isinstance(layer, Pool):
            entry = {"type": "maxpool", "name": layer.name, "window": list(layer.window)}
        else:
            entry = {"type": layer.kind, "name": layer.name}
            if layer.kind in _DEFAULT_ALPHA:
                entry["alpha"] = float(layer.alpha)
        entries.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(wpath))
    spec = {"format": FORMAT, "name": net.name, "weights": wpath.name, "layers": entries}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
