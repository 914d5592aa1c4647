"""Zarr (v2 or v3) arrays as input layers, (z, y, x) or (c, z, y, x), on ``file://``, ``s3://``,
``gs://`` or ``http(s)://``; and OME-Zarr images (0.4, 0.5), whose mips are their datasets (:mod:`.ome`).

A plain zarr array has no standard for resolution and offset: znni reads ``attributes["resolution"]``
(z, y, x nm) and ``attributes["voxel_offset"]`` (z, y, x voxels) when present, else takes them from
the config; an OME-Zarr image's come from its ``coordinateTransformations``.
Missing chunks read as the fill value in zarr; znni checks for them first (chunk files, and in a
sharded array its shard files and their indexes) and fails unless ``input.missing: zero`` is
chosen, which records every chunk it filled.

A remote array is read through znni's own clients (:mod:`.zarr_store` over :mod:`.store`): the
same bounded retries and errors as a precomputed input; a local one through zarr's own store.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..errors import ConfigError, DataError, InputError, StorageError, ZnniError
from ..geometry import ChunkGrid, Coordinate, Roi
from .ome import ome_dataset
from .paths import LayerURL
from .store import local_size, object_store
from .zarr_store import ObjectZarrStore

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
    return _parse_index(raw, size)


def _parse_index(raw: bytes, size: int):
    """A shard index's bytes as ``[(offset, nbytes), ...]`` (a trailing crc32c left out)."""
    v = np.frombuffer(raw[: size - (size % 16)], "<u8").reshape(-1, 2)
    return [(int(a), int(b)) for a, b in v]


def _node(store, url: LayerURL, what: str) -> tuple[int, str, dict]:
    """``(zarr format, node type, attributes)`` of the zarr node at ``url``, from its metadata
    objects; a :class:`DataError` when there is none."""
    meta = store.get_json("zarr.json")
    if meta is not None:
        if (
            not isinstance(meta, dict)
            or meta.get("zarr_format") != 3
            or meta.get("node_type") not in ("array", "group")
        ):
            raise DataError(f"{what} {url}: zarr.json is not zarr v3 array or group metadata")
        attrs = meta.get("attributes") or {}
        return 3, meta["node_type"], attrs if isinstance(attrs, dict) else {}
    if store.get_json(".zarray") is not None:
        return 2, "array", {}
    zattrs, zgroup = store.get_json(".zattrs"), store.get_json(".zgroup")
    if zattrs is None and zgroup is None:
        raise DataError(
            f"{what} {url}: no zarr metadata there (zarr.json, .zarray, .zgroup or .zattrs); check the path "
            "(a zarr array, or an OME-Zarr image's group)"
        )
    return 2, "group", zattrs if isinstance(zattrs, dict) else {}


def open_zarr_input(url: LayerURL, mip: int = 0, *, resolution=None, voxel_offset=None, what: str = "input"):
    """The zarr array at ``url``, or dataset ``mip`` of the OME-Zarr image at ``url``, as a :class:`ZarrLayer`."""
    fmt, node, attrs = _node(object_store(url, raw_names=True), url, what)
    if node == "array":
        if mip:
            raise ConfigError(
                f"{what} {url}: a zarr array has no mips; set {what}.mip: 0 (an OME-Zarr image's mips are its "
                "datasets: give the image's group as the path)"
            )
        return ZarrLayer(url, resolution=resolution, voxel_offset=voxel_offset, what=what)

    return ZarrLayer(None, resolution=resolution, ome=ome_dataset(url, attrs, fmt, mip, what), what=what)


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
    """A zarr array read as an input layer, geometry in (z, y, x) voxels.

    Resolution and voxel offset come from ``ome`` (an OME-Zarr image's dataset, :mod:`.ome`: its
    array is read), else from the array's attributes, else from ``resolution`` / ``voxel_offset``;
    a :class:`DataError` if the array cannot be opened, is not (z, y, x) or (c, z, y, x) (with an
    OME-Zarr time axis of size 1 in front), or has no resolution.
    """

    def __init__(self, url: LayerURL | None, *, resolution=None, voxel_offset=None, ome=None, what: str = "input"):
        # lazy: loads zarr only when called
        import zarr

        url = ome.url if ome is not None else url
        self.url, self.ome = url, ome
        self.store = None if url.is_local else object_store(url, raw_names=True)
        try:
            if self.store is None:
                self.array = zarr.open_array(str(url.local_path), mode="r")
            else:
                self.array = zarr.open_array(store=ObjectZarrStore(self.store), mode="r")
        except ZnniError:
            raise
        except Exception as exc:
            raise DataError(f"{what} {url}: cannot open as a zarr array ({type(exc).__name__}: {exc})") from exc
        shape = self.array.shape
        axes = ome.axes if ome is not None else {3: "zyx", 4: "czyx"}.get(len(shape), "")
        if len(axes) != len(shape):
            named = f" but its OME-Zarr axes are {tuple(axes)}" if ome is not None else ""
            raise DataError(f"{what} {url}: zarr array has shape {shape}{named}; expected (z, y, x) or (c, z, y, x)")
        if "t" in axes and shape[0] != 1:
            raise DataError(
                f"{what} {url}: the time axis t has {shape[0]} points; znni reads 3-d images (t of size 1): "
                "write the time point to read as an image of its own"
            )
        self.axes = axes
        #: the index of the axes before z: t's only point, all of c
        self._lead = ((0,) if "t" in axes else ()) + ((slice(None),) if "c" in axes else ())
        self.channels = int(shape[axes.index("c")]) if "c" in axes else 1
        if ome is not None:
            self.offset_remainder = ome.offset_remainder
            res = ome.resolution if ome.resolution is not None else resolution
            if res is None:
                raise DataError(
                    f"{what} {url}: the OME-Zarr axes z, y, x have no unit, so their scale is no voxel size; set "
                    f"{what}.resolution (z, y, x nm) in the config"
                )
            src = "the OME-Zarr scale" if ome.resolution is not None else f"{what}.resolution"
            self.resolution = tuple(float(r) for r in _triple(list(res), f"{what} {url}: {src}", integer=False))
            off = Coordinate(ome.offset)
        else:
            attrs = dict(self.array.attrs)
            res = attrs.get("resolution", resolution)
            if res is None:
                raise DataError(
                    f"{what} {url}: no resolution; set {what}.resolution (z, y, x nm) in the config "
                    "or a 'resolution' attribute on the array"
                )
            src = "the array's 'resolution' attribute" if "resolution" in attrs else f"{what}.resolution"
            self.resolution = tuple(float(r) for r in _triple(res, f"{what} {url}: {src}", integer=False))
            off = attrs.get("voxel_offset", voxel_offset if voxel_offset is not None else (0, 0, 0))
            src = "the array's 'voxel_offset' attribute" if "voxel_offset" in attrs else "the voxel offset"
            off = Coordinate(int(v) for v in _triple(off, f"{what} {url}: {src}", integer=True))
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
                self.array[self._lead + self.grid.chunk_roi(idx).to_slices(self.bounds.offset)]
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
        if self.sharded:
            return self._missing_in_shards(roi, meta)
        leads = self._leads(self.array.chunks)  # every chunk of the channel axis
        keys = [
            meta.encode_chunk_key(lead + tuple(int(i) for i in idx))
            for idx in self.grid.chunks_in(roi)
            for lead in leads
        ]
        sizes = self._sizes(keys, "chunk")
        return [k for k in keys if not sizes[k]]

    def _leads(self, per) -> list[tuple]:
        """The chunk (or shard, ``per``: their shape) indices of the axes before z: the time
        axis's only one, every one of the channel axis."""
        ranges = [
            range(1) if a == "t" else range(-(-self.array.shape[k] // int(per[k])))
            for k, a in enumerate(self.axes[:-3])
        ]
        return [tuple(p) for p in itertools.product(*ranges)]

    def _sizes(self, keys, what: str) -> dict:
        """``{key: bytes stored, or None if absent}`` of objects under the array (a ``stat`` each
        on ``file://``; HEAD requests, 8 in flight, elsewhere)."""
        if self.store is not None:
            return self.store.sizes(list(keys))
        root = self.url.local_path
        return {k: local_size(root / k, f"input {self.url}: {what} {k}") for k in keys}

    def _shard_indexes(self, keys, size: int, at_end: bool) -> dict:
        """``{shard key: its index, or None when the shard is absent, empty or shorter than its index}``."""
        if self.store is None:
            root = self.url.local_path
            return {k: _shard_index(root / k, size, at_end, f"input {self.url}: shard {k}") for k in keys}
        totals = self.store.sizes(list(keys))

        def index(key):
            total = totals[key]
            if total is None or total < size:
                return None
            raw = self.store.get_range(key, total - size if at_end else 0, total if at_end else size)
            return None if raw is None else _parse_index(raw, size)

        keys = list(keys)
        with ThreadPoolExecutor(min(8, max(len(keys), 1))) as pool:
            return dict(zip(keys, pool.map(index, keys)))

    def _missing_in_shards(self, roi, meta) -> list[str]:
        codec = meta.codecs[0]
        per = tuple(int(s) // int(c) for s, c in zip(self.array.shards, codec.chunk_shape))
        crc = any(type(c).__name__ == "Crc32cCodec" for c in codec.index_codecs)
        size = 16 * math.prod(per) + (4 if crc else 0)
        at_end = getattr(codec.index_location, "value", str(codec.index_location)) == "end"
        leads = self._leads(codec.chunk_shape)
        entries = []
        for idx in self.grid.chunks_in(roi):
            for lead in leads:
                full = lead + tuple(int(i) for i in idx)
                shard = tuple(i // p for i, p in zip(full, per))
                inner = tuple(i % p for i, p in zip(full, per))
                entries.append((meta.encode_chunk_key(shard), inner))
        index = self._shard_indexes(dict.fromkeys(k for k, _ in entries), size, at_end)
        out = []
        for key, inner in entries:
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
        leads = self._leads(per)
        inner = self.chunk_shape if not self.sharded else Coordinate(per[-3:])
        keys = set()
        for idx in self.grid.chunks_in(roi.intersect(self.bounds)):
            at = tuple(int(i) * int(c) // int(p) for i, c, p in zip(idx, self.chunk_shape, inner))
            for lead in leads:
                keys.add(meta.encode_chunk_key(lead + at))
        return sorted(keys)

    def object_versions(self, roi: Roi) -> dict:
        """``{file key: "<bytes>-<mtime ns>" or None if absent}`` of what a read of ``roi`` opens."""
        return self.versions(self.objects(roi))

    def versions(self, keys) -> dict:
        """``{file key: "<bytes>-<mtime ns>" or None if absent}`` (one ``stat`` each); remote:
        ``{key: ETag, generation or HTTP validator, or None}`` (:meth:`~.store.ObjectStore.versions`)."""
        if self.store is not None:
            return self.store.versions(list(keys))
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
            arr = self.array[self._lead + sl]
        except ZnniError:  # a storage error names its object
            raise
        except Exception as exc:
            raise DataError(
                f"input {self.url}: reading {roi} failed: {type(exc).__name__}: {exc}{self._failing_chunks(roi)}"
            ) from exc
        arr = np.asarray(arr)
        if "c" not in self.axes:
            arr = arr[None]
        return np.ascontiguousarray(arr), missing
