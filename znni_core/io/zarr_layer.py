"""Zarr (v2 or v3) arrays as input layers, (z, y, x) or (c, z, y, x), local ``file://`` only.

Zarr has no standard for resolution and offset: znni reads ``attributes["resolution"]`` (z, y, x nm)
and ``attributes["voxel_offset"]`` (z, y, x voxels) when present, else takes them from the config.
Missing chunks read as the fill value in zarr; znni checks for them first (chunk files, and in a
sharded array its shard files and their indexes) and fails unless ``input.missing: zero`` is
chosen, which records every chunk it filled.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, DataError, InputError, StorageError
from ..geometry import ChunkGrid, Coordinate, Roi
from .paths import LayerURL
from .store import local_size

_EMPTY = (2**64 - 1, 2**64 - 1)  # a shard index's (offset, nbytes) of a chunk not stored


def _shard_index(path, size: int, at_end: bool, where: str):
    """A zarr v3 shard's index as ``[(offset, nbytes), ...]`` per chunk (C order), None when the
    shard's file is absent, empty or shorter than its index.  Anything else in its place, or an
    I/O or permission error, is an error naming ``where`` (:func:`~.store.local_size`): only
    "not found" is missing."""
    total = local_size(path, where)
    if total is None or total < size:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(total - size if at_end else 0)
            raw = f.read(size)
    except FileNotFoundError:  # deleted since: absent
        return None
    except OSError as exc:
        raise StorageError(f"{where}: read failed ({exc.strerror or exc}); fix the storage and re-run") from None
    if len(raw) < size:  # truncated since its size was read
        return None
    v = np.frombuffer(raw[: size - (size % 16)], "<u8").reshape(-1, 2)
    return [(int(a), int(b)) for a, b in v]


def _triple(value, what: str, *, integer: bool):
    """``value`` as 3 finite numbers (z, y, x): integers (an offset) or positive (a resolution);
    a :class:`DataError` naming ``what`` and the value otherwise."""
    ok = isinstance(value, (list, tuple)) and len(value) == 3
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if ok and integer:
        ok = all(float(v).is_integer() and abs(v) < 2**53 for v in value)
    elif ok:
        ok = all(0 < v < 1e12 for v in value)
    if not ok:
        want = "3 integers" if integer else "3 positive numbers (nm)"
        raise DataError(f"{what} is {value!r}; it must be {want}, in (z, y, x) order")
    return value


class ZarrLayer:
    """A local zarr array read as an input layer, geometry in (z, y, x) voxels.

    Resolution and voxel offset come from the array's attributes, else from ``resolution`` /
    ``voxel_offset``; a :class:`DataError` if the array cannot be opened, is not 3-d or 4-d, or has no
    resolution.
    """

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
            raise DataError(
                f"input {url}: no resolution; set input.resolution (z, y, x nm) in the config "
                "or a 'resolution' attribute on the array"
            )
        src = "the array's 'resolution' attribute" if "resolution" in attrs else "input.resolution"
        self.resolution = tuple(float(r) for r in _triple(res, f"input {url}: {src}", integer=False))
        off = attrs.get("voxel_offset", voxel_offset if voxel_offset is not None else (0, 0, 0))
        src = "the array's 'voxel_offset' attribute" if "voxel_offset" in attrs else "the voxel offset"
        off = Coordinate(int(v) for v in _triple(off, f"input {url}: {src}", integer=True))
        self.bounds = Roi(off, shape[-3:])
        self.dtype = str(self.array.dtype)
        self.chunk_shape = Coordinate(self.array.chunks[-3:])
        self.grid = ChunkGrid(self.bounds, self.chunk_shape)
        self.sharded = getattr(self.array, "shards", None) is not None
        self.checksums = "none"  # what verifies a read: "crc32c" (the array's codec) or "none"

    def use_checksums(self, mode: str) -> str:
        """Whether reads are verified: zarr-python checks a crc32c codec on every chunk it
        decodes; ``mode`` ``required`` refuses an array without one (:class:`ConfigError`)."""
        meta = self.array._async_array.metadata
        codecs = list(getattr(meta, "codecs", ()) or ())
        inner = [c for s in codecs for c in (getattr(s, "codecs", ()) or ())]  # a sharded array's chunk codecs
        names = {type(c).__name__ for c in codecs + inner} | {
            getattr(c, "codec_id", "") for c in (getattr(self.array, "compressors", ()) or ())
        }
        self.checksums = "crc32c" if {"Crc32cCodec", "crc32c"} & names else "none"
        if mode == "required" and self.checksums == "none":
            raise ConfigError(
                f"input {self.url}: the zarr array's chunks carry no checksum (no crc32c codec) and "
                "input.checksums is required; rewrite the array with a crc32c codec, or set input.checksums: auto"
            )
        return self.checksums

    def _failing_chunks(self, roi: Roi) -> str:
        """``; chunks that fail: [...]``: the chunks under ``roi`` that fail a read on their own."""
        bad = []
        for idx in self.grid.chunks_in(roi):
            try:
                self.array[(Ellipsis,) + self.grid.chunk_roi(idx).to_slices(self.bounds.offset)]
            except Exception:
                bad.append("/".join(map(str, idx)))
                if len(bad) == 3:
                    break
        return f"; chunks (z/y/x grid index) that fail on their own: {bad}" if bad else ""

    def missing_chunks(self, roi: Roi) -> list[str]:
        """The chunks under ``roi`` that are not stored: their file absent or empty, or (sharded)
        their shard's file absent or empty, or their entry in the shard's index empty (zarr reads
        all of these as the fill value).  A sharded array's names are ``<shard key>[<chunk in
        shard>]``.  Only "not found" is missing: a directory or other non-file in a chunk's or
        shard's place, or a permission or I/O error, is an error naming it."""
        meta = self.array._async_array.metadata
        root = self.url.local_path
        lead = () if self.array.ndim == 3 else (0,)
        if self.sharded:
            return self._missing_in_shards(roi, meta, root, lead)
        leads = [()] if self.array.ndim == 3 else [(c,) for c in range(-(-self.array.shape[0] // self.array.chunks[0]))]
        out = []
        for idx in self.grid.chunks_in(roi):
            for lead in leads:  # every chunk of the channel axis
                key = meta.encode_chunk_key(lead + tuple(idx))
                if not local_size(root / key, f"input {self.url}: chunk {key}"):
                    out.append(key)
        return out

    def _missing_in_shards(self, roi, meta, root, lead) -> list[str]:
        codec = meta.codecs[0]
        per = tuple(int(s) // int(c) for s, c in zip(self.array.shards, codec.chunk_shape))
        crc = any(type(c).__name__ == "Crc32cCodec" for c in codec.index_codecs)
        size = 16 * math.prod(per) + (4 if crc else 0)
        at_end = getattr(codec.index_location, "value", str(codec.index_location)) == "end"
        channel_chunks = range(-(-self.array.shape[0] // int(codec.chunk_shape[0]))) if lead else (None,)
        out, index = [], {}
        for idx in self.grid.chunks_in(roi):
            for cc in channel_chunks:
                full = tuple(int(i) for i in idx) if cc is None else (cc,) + tuple(int(i) for i in idx)
                shard = tuple(i // p for i, p in zip(full, per))
                inner = tuple(i % p for i, p in zip(full, per))
                key = meta.encode_chunk_key(shard)
                if key not in index:
                    index[key] = _shard_index(root / key, size, at_end, f"input {self.url}: shard {key}")
                name = f"{key}[{','.join(map(str, inner))}]"
                if index[key] is None:
                    out.append(name + " (shard missing or empty)")
                    continue
                if index[key][int(np.ravel_multi_index(inner, per))] == _EMPTY:  # C order over the shard's chunks
                    out.append(name)
        return out

    def objects(self, roi: Roi) -> list[str]:
        """The files (keys under the array) a read of ``roi`` opens: its chunks of every channel
        chunk, or in a sharded array their shards."""
        meta = self.array._async_array.metadata
        per = self.array.shards if self.sharded else self.array.chunks
        lead = [] if self.array.ndim == 3 else [range(-(-self.array.shape[0] // per[0]))]
        inner = self.chunk_shape if not self.sharded else Coordinate(per[-3:])
        keys = set()
        for idx in self.grid.chunks_in(roi.intersect(self.bounds)):
            at = tuple(int(i) * int(c) // int(p) for i, c, p in zip(idx, self.chunk_shape, inner))
            for c in lead[0] if lead else [None]:
                keys.add(meta.encode_chunk_key(at if c is None else (c,) + at))
        return sorted(keys)

    def object_versions(self, roi: Roi) -> dict:
        """``{file key: "<bytes>-<mtime ns>" or None if absent}`` of what a read of ``roi`` opens."""
        return self.versions(self.objects(roi))

    def versions(self, keys) -> dict:
        """``{file key: "<bytes>-<mtime ns>" or None if absent}`` (one ``stat`` each)."""
        out = {}
        for key in keys:
            try:
                st = (self.url.local_path / key).stat()
            except FileNotFoundError:
                out[key] = None
                continue
            except OSError as exc:
                raise DataError(f"input {self.url}: {key} cannot be examined ({exc.strerror or exc})") from exc
            out[key] = f"{st.st_size}-{st.st_mtime_ns}"
        return out

    def read(self, roi: Roi, *, fill_missing: bool = False) -> tuple[np.ndarray, list[str]]:
        """``(C, z, y, x)`` array of ``roi`` and the names of the missing chunks (read as the fill value).

        An :class:`InputError` if ``roi`` is outside the bounds; missing chunks raise :class:`DataError`
        unless ``fill_missing``.
        """
        if not self.bounds.contains(roi):
            raise InputError(f"read {roi} is outside the layer bounds {self.bounds} of {self.url}")
        missing = self.missing_chunks(roi)
        if missing and not fill_missing:
            raise DataError(
                f"input {self.url}: {len(missing)} chunk(s) under {roi} are missing or empty "
                f"(first: {missing[:3]}); repair the input, or set input.missing: zero"
            )
        sl = roi.to_slices(self.bounds.offset)
        try:
            arr = self.array[(Ellipsis,) + sl]
        except Exception as exc:
            raise DataError(
                f"input {self.url}: reading {roi} failed: {type(exc).__name__}: {exc}{self._failing_chunks(roi)}"
            ) from exc
        arr = np.asarray(arr)
        if arr.ndim == 3:
            arr = arr[None]
        return np.ascontiguousarray(arr), missing
