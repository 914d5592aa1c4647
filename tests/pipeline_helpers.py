"""Small volumes, networks and runs for the pipeline and workflow tests (seeded, in tmp_path)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from znni_core.geometry import Coordinate, Roi
from znni_core.io import ScaleSpec, create_layer, parse_layer_url
from znni_core.io.precomputed import PrecomputedLayer
from znni_core.net import save_network

from .nets import make_net

SMALL_NET = [("conv", 2, 3), ("act", "relu"), ("pool", (1, 2, 2)), ("conv", 1, (1, 3, 3)), ("act", "sigmoid")]
RES = (40.0, 8.0, 8.0)


def write_volume(path: Path, vol: np.ndarray, chunk=(4, 16, 16), dtype=None, resolution=RES) -> str:
    """A precomputed layer at ``path`` holding ``vol`` ((z, y, x) or (c, z, y, x))."""
    vol = vol[None] if vol.ndim == 3 else vol
    url = parse_layer_url("file://" + str(path))
    spec = ScaleSpec(
        "k", Roi((0, 0, 0), vol.shape[1:]), Coordinate(chunk), resolution, dtype or str(vol.dtype), vol.shape[0]
    )
    create_layer(url, spec, {"description": "", "owners": [], "processing": [], "sources": []})
    layer = PrecomputedLayer(url, 0)
    for idx in layer.grid.chunks_in(layer.bounds):
        sl = layer.grid.chunk_roi(idx).to_slices()
        layer.write_chunk(idx, np.ascontiguousarray(vol[(slice(None),) + sl]))
    return str(url)


def em(shape=(12, 40, 40), seed=0) -> np.ndarray:
    from znni_core.pipeline.demo import em_volume

    return em_volume(shape, seed, cells=12)


def base_config(tmp_path: Path, *, vol=None, layout=None, seed=0, **over) -> dict:
    vol = em() if vol is None else vol
    inp = write_volume(tmp_path / "em", vol)
    net = make_net(layout or SMALL_NET, seed=seed)
    save_network(net, tmp_path / "net.yaml")
    cfg = {
        "work_dir": str(tmp_path / "work"),
        "input": {"path": inp, "dtype": str(vol.dtype)},
        "network": {"path": str(tmp_path / "net.yaml")},
        "normalize": {"scale": 1 / 255},
        "output": {"path": str(tmp_path / "out"), "chunk_size": [4, 8, 8]},
        "task_chunks": [1, 2, 2],
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def layer_files(url: str) -> dict:
    """{relative path: bytes} of every chunk file of a local layer."""
    root = Path(url.replace("file://", ""))
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("info", "provenance") and "znni-sha256" not in p.parts
    }


def subprocess_env() -> dict:
    """Environment for `znni` / snakemake subprocesses: this venv's bin first on PATH, Python's
    bytecode read and written beside the sources (some machines set PYTHONDONTWRITEBYTECODE: ~5 s
    of compiling per process).  No ``PYTHONPYCACHEPREFIX``: a prefix of its own makes Python ignore
    the venv's compiled bytecode (a first import of znni, Snakemake, cloud-volume, zarr and dask
    took 12 s of CPU under a new prefix, 4 s without)."""
    import sys

    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
    return env


def sharded_input(tmp_path: Path):
    """A sharded precomputed layer's parts, not yet written: ``(url, layer, vol, {shard name:
    {chunk index: array}})`` of a (16, 64, 64) uint8 volume (no zero voxel) in (8, 16, 16) chunks."""
    from znni_core.io.sharding import auto_sharding

    shape, chunk = (16, 64, 64), (8, 16, 16)
    url = parse_layer_url(f"file://{tmp_path}/em")
    spec = ScaleSpec(
        "4_4_40",
        Roi((0, 0, 0), shape),
        Coordinate(chunk),
        (40.0, 4.0, 4.0),
        "uint8",
        1,
        sharding=auto_sharding(shape, chunk, "uint8", 1, 8 * 16 * 16 * 8, "raw"),
    )
    create_layer(url, spec, {"owners": [], "processing": [], "sources": []})
    layer = PrecomputedLayer(url, 0)
    vol = (np.arange(np.prod(shape)) % 250 + 1).astype(np.uint8).reshape((1,) + shape)
    shards = {}
    for idx in layer.grid.chunks_in(layer.bounds):
        shards.setdefault(layer.shard_name(idx), {})[tuple(idx)] = vol[
            (slice(None),) + layer.grid.chunk_roi(idx).to_slices()
        ]
    return url, layer, vol, shards


def fail_task(monkeypatch, victim: int):
    """Make every read of task ``victim``'s input fail with a DataError (the others read as
    before); returns the real reader, to put back for a re-run."""
    from znni_core.errors import DataError
    from znni_core.pipeline import task as T

    real = T.read_task

    def bad(ctx, task_id, **kw):
        if task_id == victim:
            raise DataError(f"injected read failure of task {victim}")
        return real(ctx, task_id, **kw)

    monkeypatch.setattr(T, "read_task", bad)
    return real
