"""Demo data: an EM-like volume (cells with dark membranes, mitochondria-ish blobs, noise) as a
precomputed layer, and a small membrane-detecting network with deterministic weights.

Everything is generated from a seed on this machine: no network access, no GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from ..geometry import Coordinate, Roi
from ..io import ScaleSpec, atomic_write, parse_layer_url
from ..io.layers import create_layer
from ..io.precomputed import PrecomputedLayer
from ..net import save_network
from ..net.chain import Activation, Conv, Pool
from ..net.graph import Network
from .settings import validate_config

DEMO_SHAPE = (24, 160, 160)  # z, y, x
DEMO_RESOLUTION = (40.0, 8.0, 8.0)  # nm, z, y, x (anisotropic like serial-section EM)


def em_volume(shape=DEMO_SHAPE, seed: int = 0, cells: int = 60) -> np.ndarray:
    """uint8 (z, y, x): Voronoi cells (bright, textured) separated by dark membranes, plus noise."""
    # lazy: loads scipy only when called
    from scipy import ndimage
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(seed)
    z, y, x = shape
    aniso = np.array([DEMO_RESOLUTION[0] / DEMO_RESOLUTION[1], 1.0, 1.0])  # physical distances
    seeds = rng.random((cells, 3)) * np.array(shape)
    grid = np.stack(np.meshgrid(np.arange(z), np.arange(y), np.arange(x), indexing="ij"), -1).reshape(-1, 3)
    _, label = cKDTree(seeds * aniso).query(grid * aniso, workers=1)
    label = label.reshape(shape)
    boundary = np.zeros(shape, bool)
    for ax in (1, 2):  # membranes seen in-plane; thin in z like real sections
        d = np.diff(label, axis=ax) != 0
        sl_a = [slice(None)] * 3
        sl_b = [slice(None)] * 3
        sl_a[ax] = slice(0, -1)
        sl_b[ax] = slice(1, None)
        boundary[tuple(sl_a)] |= d
        boundary[tuple(sl_b)] |= d
    boundary = ndimage.binary_dilation(boundary, structure=np.ones((1, 2, 2), bool))
    interior = 150 + 30 * rng.random(cells)[label]  # per-cell brightness
    texture = ndimage.gaussian_filter(rng.standard_normal(shape), (0.5, 2.0, 2.0)) * 25
    img = interior + texture
    img[boundary] = 45
    blobs = ndimage.gaussian_filter((rng.random(shape) > 0.9993).astype(np.float32), (0.7, 3, 3))
    img -= 90 * blobs / max(float(blobs.max()), 1e-6)  # dark organelles
    img = ndimage.gaussian_filter(img, (0.3, 1.0, 1.0)) + rng.normal(0, 12, shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def demo_network():
    """A hand-made membrane detector: FOV (5, 10, 10) with one (1, 2, 2) max-pool; sigmoid output."""
    g = np.exp(-0.5 * ((np.arange(3) - 1) ** 2)).astype(np.float32)
    blur = g[:, None, None] * g[None, :, None] * g[None, None, :]
    blur /= blur.sum()
    lap = -np.ones((3, 3, 3), np.float32) / 26
    lap[1, 1, 1] = 1.0
    w1 = np.stack([-blur, lap, blur])[:, None]  # (3, 1, 3, 3, 3): darkness, edges, brightness
    b1 = np.array([0.55, 0.0, -0.45], np.float32)
    w2 = np.zeros((2, 3, 1, 3, 3), np.float32)
    w2[0, 0] = 1.0 / 9  # pooled darkness
    w2[0, 1] = -0.5 / 9
    w2[1, 2] = 1.0 / 9  # pooled brightness
    b2 = np.array([0.0, 0.0], np.float32)
    w3 = np.zeros((1, 2, 3, 3, 3), np.float32)
    w3[0, 0, 1] = 12.0 / 9
    w3[0, 1, 1] = -12.0 / 9
    b3 = np.array([-0.5], np.float32)
    return Network(
        (
            Conv(w1, b1, "conv1"),
            Activation("relu"),
            Pool((1, 2, 2)),
            Conv(w2, b2, "conv2"),
            Activation("relu"),
            Conv(w3, b3, "conv3"),
            Activation("sigmoid"),
        ),
        name="znni-demo-membranes",
        metadata={"resolution": list(DEMO_RESOLUTION)},
    )


def write_demo(out_dir, *, shape=DEMO_SHAPE, seed: int = 0, chunk=(8, 64, 64)) -> dict:
    """Write ``<out_dir>/em`` (precomputed uint8) and ``<out_dir>/net.yaml`` (+ safetensors)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    vol = em_volume(tuple(shape), seed)
    url = parse_layer_url("file://" + str(out_dir / "em"))
    key = "_".join(f"{v:g}" for v in DEMO_RESOLUTION[::-1])
    spec = ScaleSpec(key, Roi((0, 0, 0), shape), Coordinate(chunk), DEMO_RESOLUTION, "uint8", 1)
    create_layer(
        url,
        spec,
        {
            "description": "znni demo: synthetic EM-like volume",
            "owners": [],
            "processing": [{"method": {"task": "znni demo-data", "seed": seed}}],
            "sources": [],
        },
    )
    layer = PrecomputedLayer(url, 0)
    for idx in layer.grid.chunks_in(layer.bounds):
        roi = layer.grid.chunk_roi(idx)
        layer.write_chunk(idx, np.ascontiguousarray(vol[None][(slice(None),) + roi.to_slices()]))
    net_path = out_dir / "net.yaml"
    save_network(demo_network(), net_path)
    return {"input": str(url), "network": str(net_path), "volume": vol}


def write_demo_config(path, data_dir, *, work_dir, output, task_chunks=(2, 2, 2), chunk=(8, 64, 64)) -> Path:
    """Write a validated config (every key, defaults included) for the demo data in ``data_dir``; return its path.

    ``chunk`` is the output chunk shape and ``task_chunks`` the task size in chunks, both (z, y, x).
    """
    data_dir = Path(data_dir).resolve()
    cfg = {
        "work_dir": str(work_dir),
        "input": {"path": "file://" + str(data_dir / "em"), "mip": 0, "dtype": "uint8"},
        "network": {"path": str(data_dir / "net.yaml")},
        "normalize": {"scale": 1 / 255, "shift": 0.0},
        "output": {"path": str(output), "dtype": "float32", "chunk_size": list(chunk)},
        "task_chunks": list(task_chunks),
        "edge": "valid",
    }

    cfg = validate_config(cfg)  # every key written out, defaults included
    head = "# znni demo configuration (generated by `znni demo-data`); keys documented in config.yaml\n"
    atomic_write(Path(path), (head + yaml.safe_dump(cfg, sort_keys=False)).encode())
    return Path(path)
