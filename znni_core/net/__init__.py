"""Networks: one graph form (a chain is a graph in a line), its geometry, and the loaders (ONNX, YAML + safetensors/npz)."""

from __future__ import annotations

from pathlib import Path

from ..errors import NetworkError
from .chain import Activation, Conv, Layer, Pool
from .geometry import NetGeometry
from .graph import Graph, Network
from .native import load_native, save_network
from .onnx_loader import load_onnx
from .protocol import AnyNetwork

__all__ = [
    "Activation",
    "AnyNetwork",
    "Conv",
    "Graph",
    "Layer",
    "NetGeometry",
    "Network",
    "Pool",
    "load_network",
    "save_network",
]

_PICKLE_SUFFIXES = {".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".bin", ".tar"}


def load_network(path) -> AnyNetwork:
    """Load a network from ``.onnx`` or a znni YAML spec as a :class:`Graph` (``kind == "chain"`` where
    its operators form a line of convolutions, max-pooling and activations); pickle checkpoints are
    refused.

    Raises :class:`~znni_core.errors.NetworkError` naming the file, node or value at fault.
    """
    path = Path(path)
    if not path.is_file():
        raise NetworkError(f"network file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    suffix = path.suffix.lower()
    if suffix in _PICKLE_SUFFIXES or head[:1] == b"\x80" or (head[:2] == b"PK" and suffix != ".npz"):
        raise NetworkError(
            f"{path}: looks like a pickle/PyTorch checkpoint; znni never unpickles (it can run arbitrary code). "
            "Export the model with torch.onnx.export(model, (x,), 'net.onnx') (docs/models.md), or write a znni "
            "YAML spec with safetensors weights."
        )
    if suffix == ".onnx":
        return load_onnx(path)
    if suffix in (".yaml", ".yml"):
        return load_native(path)
    raise NetworkError(f"{path}: unknown network format {suffix!r}; use .onnx or a .yaml spec")
