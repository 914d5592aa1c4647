"""Zarr (v2 or v3) arrays as input layers, (z, y, x) or (c, z, y, x), local ``file://`` only.

Zarr has no standard for resolution and offset: znni reads ``attributes["resolution"]`` (z, y, x nm)
and ``attributes["voxel_offset"]`` (z, y, x voxels) when present, else takes them from the config.
Missing chunks read as the fill value in zarr; znni checks for them first and fails unless
``input.missing: zero`` is chosen (RELIABILITY T26).
"""
from __future__ import annotations

import numpy as np

from ..errors import DataError, InputError
from ..geometry import ChunkGrid, Coordinate, Roi
from .paths import LayerURL


class ZarrLayer:
    def __init__(self, url: LayerURL, *, resolution=None, voxel_offset=None):
        import zarr

        self.url = url
        try:
            self.array = zarr.open_array(str(url.local_path), mode="r")
        except Exception as exc:
            raise DataError(f"input {url}: cannot open as a zarr array ({type(exc).__name__}: {exc})") from exc
        shape = self.array.shape
        if len(shape) not in (3, 4):
            raise DataError(f"input {url}: zarr array has shape {shape}; expected (z, y, x) or (c, z, y, x)")
        self.channels = 1 if len(shape) == 3 else int(shape[0])
        attrs = dict(self.array.attrs)
        res = attrs.get("resolution", resolution)
        if res is None:
            raise DataError(f"input {url}: no resolution; set input.resolution (z, y, x nm) in the config "
                            "or a 'resolution' attribute on the array")
        self.resolution = tuple(float(r) for r in res)
        off = Coordinate(attrs.get("voxel_offset", voxel_offset if voxel_offset is not None else (0, 0, 0)))
        self.bounds = Roi(off, shape[-3:])
        self.dtype = str(self.array.dtype)
        self.chunk_shape = Coordinate(self.array.chunks[-3:])
        self.grid = ChunkGrid(self.bounds, self.chunk_shape)
        self.sharded = getattr(self.array, "shards", None) is not None

    def missing_chunks(self, roi: Roi) -> list[str]:
        if self.sharded:
            return []
        meta = self.array._async_array.metadata
        root = self.url.local_path
        out = []
        for idx in self.grid.chunks_in(roi):
            coords = tuple(idx) if self.array.ndim == 3 else (0,) + tuple(idx)
            key = meta.encode_chunk_key(coords)
            p = root / key
            if not p.is_file() or p.stat().st_size == 0:
                out.append(key)
        return out

    def read(self, roi: Roi, *, fill_missing: bool = False) -> tuple[np.ndarray, list[str]]:
        if not self.bounds.contains(roi):
            raise InputError(f"read {roi} is outside the layer bounds {self.bounds} of {self.url}")
        missing = self.missing_chunks(roi)
        if missing and not fill_missing:
            raise DataError(f"input {self.url}: {len(missing)} chunk(s) under {roi} are missing or empty "
                            f"(first: {missing[:3]}); repair the input, or set input.missing: zero")
        sl = roi.to_slices(self.bounds.offset)
        try:
            arr = self.array[(Ellipsis,) + sl]
        except Exception as exc:
            raise DataError(f"input {self.url}: reading {roi} failed: {type(exc).__name__}: {exc}") from exc
        arr = np.asarray(arr)
        if arr.ndim == 3:
            arr = arr[None]
        return np.ascontiguousarray(arr), missing
