"""Whole volumes for ``znni infer``: an array file (``.npy``, ``.tif``) or a region of a layer
(precomputed on ``file://``/``gs://``/``s3://``, zarr) in; an array file or a new layer out.

A layer output is created with the input's resolution and placed where the network's output
lies in the input's coordinates (the region's offset plus the halo of a valid network), so it
overlays the input in Neuroglancer.  Its chunks (or, for zarr, its shards) are written whole,
atomically, and read back as every znni write is.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from ..geometry import Coordinate, Halo, Roi, TaskGrid
from .info import ScaleSpec
from .layers import create_layer, open_input, open_output
from .manifest import store_chunks
from .mips import task_chunks_of
from .paths import parse_layer_url
from .zarr_output import zarr_sharding

ARRAY_SUFFIXES = (".npy", ".tif", ".tiff")


def is_array_file(path: str) -> bool:
    """True if ``path`` names an array file (``.npy``, ``.tif``, ``.tiff``, any case) rather than a layer."""
    return str(path).lower().endswith(ARRAY_SUFFIXES)


def read_volume(path: str, *, offset=None, shape=None, mip: int = 0, endpoint=None):
    """``(array (z, y, x) or (c, z, y, x), region read or None, resolution (z, y, x) or None)``.

    ``offset``/``shape`` (z, y, x) select a region: absolute voxels of a layer, indices of an array."""
    if is_array_file(path):
        if str(path).endswith(".npy"):
            x = np.load(path, allow_pickle=False)
        else:
            # lazy: loads tifffile only when called
            import tifffile

            x = tifffile.imread(path)
        if offset is None and shape is None:
            return x, None, None
        full = Roi((0, 0, 0), x.shape[-3:])
        roi = _region(full, offset, shape, path)
        return x[(...,) + roi.to_slices()], roi, None
    layer = open_input(parse_layer_url(path, endpoint=endpoint, what="input"), mip)
    roi = _region(layer.bounds, offset, shape, f"{path} mip {mip}")
    raw, _ = layer.read(roi)
    return raw, roi, tuple(layer.resolution)


def _region(bounds: Roi, offset, shape, where: str) -> Roi:
    off = Coordinate(offset) if offset is not None else bounds.offset
    shp = Coordinate(shape) if shape is not None else bounds.end - off
    roi = Roi(off, shp)
    if any(v < 1 for v in shp) or not bounds.contains(roi):
        raise InputError(
            f"region offset {tuple(off)} shape {tuple(shp)} (z, y, x) is not inside {where}, whose "
            f"bounds are offset {tuple(bounds.offset)} shape {tuple(bounds.shape)}"
        )
    return roi


def write_volume(
    path: str, y: np.ndarray, *, offset=(0, 0, 0), resolution=(1.0, 1.0, 1.0), chunk=(64, 64, 64), endpoint=None
) -> str:
    """Save ``y`` (c, z, y, x) float32 as an array file, or as a new layer at ``offset``; returns what was written."""
    if is_array_file(path):
        if str(path).endswith(".npy"):
            np.save(path, y)
        else:
            # lazy: loads tifffile only when called
            import tifffile

            tifffile.imwrite(path, y)
        return f"{path}: {y.shape} float32"
    url = parse_layer_url(path, endpoint=endpoint, what="output")
    bounds = Roi(Coordinate(offset), y.shape[1:])
    chunk = Coordinate(chunk).min(bounds.shape)
    zarr = url.format == "zarr"
    per_shard = bounds.shape.ceil_div(chunk).min(Coordinate(8, 8, 8))  # zarr: shards of up to 8^3 chunks
    spec = ScaleSpec(
        "0" if zarr else "_".join(f"{v:g}" for v in tuple(resolution)[::-1]),
        bounds,
        chunk,
        tuple(float(v) for v in resolution),
        "float32",
        int(y.shape[0]),
        sharding=zarr_sharding(per_shard, "none") if zarr else None,
    )
    create_layer(url, spec, {"description": "znni infer", "owners": [], "processing": [], "sources": []})
    out = open_output(url, spec)
    zero = Halo((0, 0, 0), (0, 0, 0))
    for block in TaskGrid(out.grid, task_chunks_of(spec, per_shard), zero):  # whole shards, or boxes of chunks
        chunks = {
            i: np.ascontiguousarray(y[(slice(None),) + out.grid.chunk_roi(i).to_slices(bounds.offset)])
            for i in block.chunks
        }
        store_chunks(out, block.chunks, chunks, {}, "none")
    return f"{url}: {y.shape} float32 at offset {tuple(bounds.offset)} (z, y, x), {out.grid.num_chunks} chunk(s)"
