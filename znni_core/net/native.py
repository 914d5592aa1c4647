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
YAML is read with ``safe_load`` (no object construction) and npz with ``allow_pickle=False``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from ..errors import NetworkError
from .spec import ACTIVATIONS, Activation, Conv, Network, Pool

FORMAT = "znni-network/1"
_DEFAULT_ALPHA = {"leaky_relu": 0.01, "elu": 1.0}


def _load_weights(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise NetworkError(f"weights file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.numpy import load_file

            return dict(load_file(str(path)))
        if suffix == ".npz":
            with np.load(str(path), allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
    except NetworkError:
        raise
    except Exception as exc:
        raise NetworkError(f"weights file {path} cannot be read safely ({exc}); object arrays and pickles are refused") from exc
    raise NetworkError(f"weights file {path}: unsupported format {suffix!r}; use .safetensors or .npz")


def load_native(path) -> Network:
    path = Path(path)
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise NetworkError(f"{path}: not a safe YAML network spec ({exc.__class__.__name__}: {exc}); "
                           "tags that construct Python objects are refused") from exc
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise NetworkError(f"{path}: expected a mapping with 'format: {FORMAT}', got "
                           f"{spec.get('format') if isinstance(spec, dict) else type(spec).__name__!r}")
    layers_spec = spec.get("layers")
    if not isinstance(layers_spec, list) or not layers_spec:
        raise NetworkError(f"{path}: 'layers' must be a non-empty list")
    weights = _load_weights(path.parent / str(spec.get("weights", "")) ) if spec.get("weights") else {}
    layers = []
    for i, entry in enumerate(layers_spec):
        if not isinstance(entry, dict) or "type" not in entry:
            raise NetworkError(f"{path}: layer {i} must be a mapping with a 'type', got {entry!r}")
        kind = str(entry["type"]).lower()
        name = str(entry.get("name", f"{kind}{i}"))
        if kind == "conv":
            key = entry.get("weight")
            if key not in weights:
                raise NetworkError(f"{path}: layer {i} ({name}) weight key {key!r} not in the weights file "
                                   f"(has {sorted(weights)[:8]})")
            bkey = entry.get("bias")
            if bkey is not None and bkey not in weights:
                raise NetworkError(f"{path}: layer {i} ({name}) bias key {bkey!r} not in the weights file")
            layers.append(Conv(weights[key], weights[bkey] if bkey is not None else None, name=name))
        elif kind in ("maxpool", "pool"):
            layers.append(Pool(entry.get("window"), name=name))
        elif kind in ACTIVATIONS:
            alpha = float(entry.get("alpha", _DEFAULT_ALPHA.get(kind, 0.0)))
            layers.append(Activation(kind, alpha, name=name))
        else:
            raise NetworkError(f"{path}: layer {i} ({name}) has unsupported type {kind!r}; use conv, maxpool or one of "
                               f"{ACTIVATIONS}")
    return Network(tuple(layers), name=str(spec.get("name", path.stem)),
                   metadata={"source": str(path), "format": FORMAT})


def save_network(net: Network, path) -> Path:
    """Write ``net`` as ``path`` (YAML) plus ``<stem>.safetensors`` beside it; returns the YAML path."""
    from safetensors.numpy import save_file

    path = Path(path)
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
