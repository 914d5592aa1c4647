"""Neuroglancer precomputed layers: reading through cloud-volume, writing whole chunks ourselves.

Reads use ``CloudVolume(..., parallel=1)`` (PITFALLS: ``parallel>1`` corrupted uploads and
ignored endpoint aliases).  Writes bypass cloud-volume: one whole output chunk at a time, encoded
``raw`` (C order of (c, z, y, x) == Fortran order of cloud-volume's (x, y, z, c)), written
atomically on ``file://`` (:func:`~znni_core.io.atomic.atomic_write`) or as one object PUT on
``gs://``/``s3://``, then read back and checked against its sha256.  A chunk has exactly one
representation: writing ``name`` removes ``name.gz`` and vice versa (RELIABILITY T17).

On ``s3://`` the chunk, ``info`` and ``provenance`` requests go through :mod:`znni_core.io.s3`
(bounded retries of 5xx/throttling/resets, none of 403 and other client errors, RELIABILITY T7),
not cloudfiles, whose fixed 7-attempt retry of every error cannot be configured.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from functools import cached_property

import numpy as np

from ..errors import DataError, InputError
from ..geometry import ChunkGrid, Roi
from .atomic import atomic_write, clean_stale_temporaries
from .info import ScaleSpec, scale_spec, validate_info
from .paths import LayerURL, check_key
from .s3 import S3Objects

COMPRESSIONS = ("none", "gzip")
_SUFFIXES = {"none": "", "gzip": ".gz"}
_ALL_SUFFIXES = ("", ".gz", ".br", ".zstd", ".xz", ".bz2")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode_raw(arr: np.ndarray, dtype: str) -> bytes:
    """(C, z, y, x) array -> precomputed raw bytes (little endian)."""
    return np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def decode_raw(data: bytes, dtype: str, shape) -> np.ndarray:
    dt = np.dtype(dtype).newbyteorder("<")
    expected = int(np.prod(shape)) * dt.itemsize
    if len(data) != expected:
        raise DataError(f"chunk holds {len(data)} bytes, expected {expected} for shape {tuple(shape)} {dtype}")
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(dtype)


def _cloudfiles(url: LayerURL):
    from cloudfiles import CloudFiles

    return CloudFiles(url.cloudpath(), progress=False)


def _s3_bytes(s3: S3Objects, name: str) -> bytes | None:
    """Decoded body of an object (gzip Content-Encoding undone), or None if absent."""
    got = s3.get(name)
    if got is None:
        return None
    data, enc = got
    if enc in ("gzip", "x-gzip"):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise DataError(f"{s3.where(name)} is stored with gzip encoding but is not valid gzip: {exc}") from exc
    if enc not in ("", "identity"):
        raise DataError(f"{s3.where(name)} has Content-Encoding {enc!r}; znni reads raw and gzip objects only")
    return data


def read_json(url: LayerURL, name: str):
    """A small JSON file of the layer, or None if absent."""
    if url.is_local:
        p = url.local_path / name
        if not p.is_file():
            return None
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{url}/{name} is not valid JSON: {exc}") from exc
    data = _s3_bytes(S3Objects(url), name) if url.protocol == "s3" else _cloudfiles(url).get(name)
    if data is None:
        return None
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise DataError(f"{url}/{name} is not valid JSON: {exc}") from exc


def write_json(url: LayerURL, name: str, obj, *, exclusive: bool = False) -> bool:
    data = json.dumps(obj, indent=2, sort_keys=True).encode()
    if url.is_local:
        return atomic_write(url.local_path / name, data, exclusive=exclusive)
    if url.protocol == "s3":
        s3 = S3Objects(url)
        if exclusive and s3.exists(name):
            return False
        s3.put(name, data, content_type="application/json", cache_control="no-cache")
        return True
    cf = _cloudfiles(url)
    if exclusive and cf.exists(name):
        return False
    cf.put(name, data, content_type="application/json", compress=None, cache_control="no-cache")
    return True


class StoredObjects:
    """Whole objects (shards) of a layer at ``self.url``: written in one piece (temporary file +
    rename on ``file://``, one PUT on ``s3://``/``gs://``), read, verified, deleted."""

    @cached_property
    def _s3(self) -> S3Objects:
        return S3Objects(self.url)

    def write_object(self, name: str, data: bytes) -> None:
        """Store ``name`` whole: temporary file + rename on ``file://``, one PUT on ``s3://``/``gs://``."""
        if self.url.is_local:
            path = self.url.local_path / name
            try:
                atomic_write(path, data)
            except OSError as exc:  # RELIABILITY T6: the previous version stays intact
                raise DataError(f"{name} of {self.url}: write failed ({exc.strerror or exc}); the previous version, "
                                "if any, is intact; free space or fix the storage and re-run its task") from exc
            clean_stale_temporaries(path.parent, os.path.basename(name))
        elif self.url.protocol == "s3":
            self._s3.put(name, data, content_type="application/octet-stream", content_encoding=None,
                         cache_control="no-cache")
        else:
            _cloudfiles(self.url).put(name, data, content_type="application/octet-stream", compress=None,
                                      cache_control="no-cache")

    def read_object(self, name: str) -> bytes | None:
        if self.url.is_local:
            path = self.url.local_path / name
            return path.read_bytes() if path.is_file() else None
        if self.url.protocol == "s3":
            return _s3_bytes(self._s3, name)
        try:
            return _cloudfiles(self.url).get(name)
        except Exception as exc:
            raise DataError(f"{name} of {self.url}: read failed: {type(exc).__name__}: {exc}") from exc

    def verify_object(self, name: str, digest: str) -> None:
        data = self.read_object(name)
        if data is None:
            raise DataError(f"{name} of {self.url} is missing after its write (expected sha256 {digest[:12]}); "
                            "re-run its task")
        if sha256(data) != digest:
            raise DataError(f"{name} of {self.url}: read-back sha256 {sha256(data)[:12]} != written {digest[:12]} "
                            "(torn or corrupted write); re-run its task")

    def delete_object(self, name: str) -> None:
        if self.url.is_local:
            (self.url.local_path / name).unlink(missing_ok=True)
        elif self.url.protocol == "s3":
            self._s3.delete(name)
        else:
            _cloudfiles(self.url).delete(name)


class PrecomputedLayer(StoredObjects):
    """One scale of a precomputed image layer, geometry in (z, y, x) voxels.

    Parameters
    ----------
    url : LayerURL
    mip : int
        Scale index.
    """

    def __init__(self, url: LayerURL, mip: int = 0):
        self.url = url
        self.mip = mip
        info = read_json(url, "info")
        if info is None:
            raise DataError(f"layer {url} has no info file; check the path (create outputs with `znni create-layer`)")
        self.info = validate_info(info, f"layer {url}")
        self.spec: ScaleSpec = scale_spec(self.info, mip, f"layer {url}")
        self.key = check_key(self.spec.key, f"layer {url} scale key")
        self.sharded = bool(self.info["scales"][mip].get("sharding"))

    # ---- geometry -------------------------------------------------------------------
    @property
    def bounds(self) -> Roi:
        return self.spec.bounds

    @property
    def grid(self) -> ChunkGrid:
        return self.spec.grid

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def channels(self) -> int:
        return self.spec.channels

    @property
    def resolution(self) -> tuple:
        return self.spec.resolution

    def chunk_name(self, index) -> str:
        """``<key>/<x0>-<x1>_<y0>-<y1>_<z0>-<z1>`` (absolute voxel coordinates, as cloud-volume names chunks)."""
        b, e = self.grid.chunk_box(index)  # (z, y, x)
        return f"{self.key}/{b[2]}-{e[2]}_{b[1]}-{e[1]}_{b[0]}-{e[0]}"

    # ---- reading through cloud-volume --------------------------------------------------------
    @cached_property
    def _cv(self):
        return self._open_cv(False)

    @cached_property
    def _cv_fill(self):
        return self._open_cv(True)

    def _open_cv(self, fill_missing: bool):
        from cloudvolume import CloudVolume

        return CloudVolume(self.url.cloudpath(), mip=self.mip, parallel=1, fill_missing=fill_missing,
                           bounded=True, progress=False, cache=False, info=self.info, green_threads=False,
                           lru_bytes=0)

    def missing_chunks(self, roi: Roi) -> list[str]:
        """Names of the stored chunks under ``roi`` that are absent or 0 bytes; in a sharded layer,
        those whose shard is absent or empty (``<chunk> (shard <name> missing or empty)``) or
        whose shard's index does not list them."""
        if self.sharded:
            return self._missing_in_shards(roi)
        names = [self.chunk_name(i) for i in self.grid.chunks_in(roi)]
        if self.url.is_local:
            root = self.url.local_path
            return [n for n in names
                    if not any((root / (n + s)).is_file() and (root / (n + s)).stat().st_size > 0
                               for s in _ALL_SUFFIXES)]
        sizes = self._object_sizes(names)
        return [n for n in names if not sizes.get(n)]

    def _object_sizes(self, names: list[str]) -> dict:
        """``{name: bytes or None}`` of stored objects (local files, S3, or cloudfiles for gs)."""
        if self.url.is_local:
            root = self.url.local_path
            return {n: ((root / n).stat().st_size if (root / n).is_file() else None) for n in names}
        return self._s3.sizes(names) if self.url.protocol == "s3" else _cloudfiles(self.url).size(names)

    def _missing_in_shards(self, roi: Roi) -> list[str]:
        """:meth:`missing_chunks` of a sharded layer: the shards' objects first, then, in the
        shards that are there, each chunk's entry in its minishard index (cloud-volume's reader)."""
        from .sharding import chunk_key

        by_shard: dict = {}
        for idx in self.grid.chunks_in(roi):
            by_shard.setdefault(self.shard_name(idx), []).append(tuple(idx))
        sizes = self._object_sizes(sorted(by_shard))
        out = []
        present = {}
        for name, idxs in by_shard.items():
            if not sizes.get(name):
                out += [f"{self.chunk_name(i)} (shard {name} missing or empty)" for i in idxs]
            else:
                present.update({chunk_key(i, self.grid.grid_shape): i for i in idxs})
        if present:
            try:
                found = self._cv.image.shard_reader().exists(list(present), path=self.key)
            except Exception as exc:  # an unreadable shard index: its chunks cannot be read either
                raise DataError(f"input {self.url} mip {self.mip}: the shard index of chunks under {roi} cannot be "
                                f"read ({type(exc).__name__}: {exc}); repair the input") from exc
            out += [f"{self.chunk_name(i)} (not in shard {self.shard_name(i)})"
                    for label, i in present.items() if not found.get(label)]
        return out

    def read(self, roi: Roi, *, fill_missing: bool = False) -> tuple[np.ndarray, list[str]]:
        """``(C, z, y, x)`` array of ``roi`` (inside the bounds) and the chunks filled with zeros.

        Missing or 0-byte chunks raise :class:`DataError` naming them unless ``fill_missing``.
        """
        if not self.bounds.contains(roi):
            raise InputError(f"read {roi} is outside the layer bounds {self.bounds} of {self.url}")
        if self.url.is_local and not self.sharded and self.info["scales"][self.mip].get("encoding", "raw") == "raw":
            got = self._read_local_raw(roi, fill_missing)
            if got is not None:
                return got
        from cloudvolume.exceptions import EmptyVolumeException

        missing = []
        if fill_missing or self.sharded:  # cloud-volume fills a sharded layer's absent chunks itself
            missing = self.missing_chunks(roi)
            if missing and not fill_missing:
                raise self._missing_error(roi, missing)
        b, e = roi.begin.xyz(), roi.end.xyz()
        cv = self._cv_fill if fill_missing else self._cv
        try:
            cut = cv[b[0]:e[0], b[1]:e[1], b[2]:e[2]]
        except EmptyVolumeException:
            raise self._missing_error(roi, self.missing_chunks(roi)) from None
        except DataError:
            raise
        except Exception as exc:  # decoding errors of corrupt chunks
            raise DataError(f"input {self.url} mip {self.mip}: reading {roi} failed: {type(exc).__name__}: {exc}; "
                            f"chunks involved: {[self.chunk_name(i) for i in self.grid.chunks_in(roi)][:4]}") from exc
        arr = np.asarray(cut)  # (x, y, z, c)
        return np.ascontiguousarray(arr.transpose(3, 2, 1, 0)), missing

    def _read_local_raw(self, roi: Roi, fill_missing: bool):
        """``read`` of a local, unsharded, raw-encoded layer from its chunk files (raw or gzip), as
        the writers store them: 0.8 s less start-up per process than importing cloud-volume, and
        no per-chunk overhead of its own.  None (read through cloud-volume) when a chunk is stored
        another way (brotli, zstd, ...)."""
        out = np.zeros((self.channels,) + tuple(roi.shape), self.dtype)
        missing = []
        for idx in self.grid.chunks_in(roi):
            try:
                data = self.read_chunk_bytes(idx)
            except DataError:
                if any((self.url.local_path / (self.chunk_name(idx) + s)).is_file() for s in _ALL_SUFFIXES[2:]):
                    return None
                raise
            if not data:  # absent or 0 bytes
                missing.append(self.chunk_name(idx))
                continue
            croi = self.grid.chunk_roi(idx)
            try:
                chunk = decode_raw(data, self.dtype, (self.channels,) + tuple(croi.shape))
            except DataError as exc:
                raise DataError(f"input {self.url} mip {self.mip}: chunk {self.chunk_name(idx)}: {exc}") from None
            inter = croi.intersect(roi)
            out[(slice(None),) + inter.to_slices(roi.offset)] = chunk[(slice(None),) + inter.to_slices(croi.offset)]
        if missing and not fill_missing:
            raise self._missing_error(roi, missing)
        return out, missing

    def _missing_error(self, roi: Roi, missing: list) -> DataError:
        return DataError(f"input {self.url} mip {self.mip}: {len(missing)} chunk(s) under {roi} are missing or empty "
                         f"(first: {missing[:3]}); repair the input, or set input.missing: zero to fill them with 0 "
                         "(recorded in the manifests)")

    # ---- writing whole chunks ----------------------------------------------------------
    def _check_chunk(self, index, arr) -> Roi:
        roi = self.grid.chunk_roi(index)
        want = (self.channels,) + tuple(roi.shape)
        if arr.shape != want:
            raise DataError(f"chunk {self.chunk_name(index)}: array shape {arr.shape} != {want} (c, z, y, x)")
        if arr.dtype != np.dtype(self.dtype):
            raise DataError(f"chunk {self.chunk_name(index)}: dtype {arr.dtype}, the layer holds {self.dtype}")
        return roi

    def write_chunk(self, index, arr: np.ndarray, *, compress: str = "none") -> str:
        """Write one whole chunk; return the sha256 of its raw bytes.  Other representations are removed."""
        if compress not in COMPRESSIONS:
            raise DataError(f"compression {compress!r} is not one of {COMPRESSIONS}")
        self._check_chunk(index, arr)
        name = self.chunk_name(index)
        raw = encode_raw(arr, self.dtype)
        digest = sha256(raw)
        if self.url.is_local:
            path = self.url.local_path / (name + _SUFFIXES[compress])
            data = gzip.compress(raw, compresslevel=6, mtime=0) if compress == "gzip" else raw
            try:
                atomic_write(path, data)
            except OSError as exc:  # disk full, quota, I/O error (RELIABILITY T6): previous version intact
                raise DataError(f"chunk {name} of {self.url}: write failed ({exc.strerror or exc}); the previous "
                                "version of the chunk, if any, is intact; free space or fix the storage and "
                                "re-run its task") from exc
            for s in _ALL_SUFFIXES:
                if s != _SUFFIXES[compress]:
                    (self.url.local_path / (name + s)).unlink(missing_ok=True)
            clean_stale_temporaries(path.parent, os.path.basename(name))
        elif self.url.protocol == "s3":
            # one PUT (Content-MD5 checked by the server); a failure raises StorageError naming the key
            data = gzip.compress(raw, compresslevel=6, mtime=0) if compress == "gzip" else raw
            self._s3.put(name, data, content_type="application/octet-stream",
                         content_encoding="gzip" if compress == "gzip" else None, cache_control="no-cache")
        else:
            _cloudfiles(self.url).put(name, raw, content_type="application/octet-stream",
                                      compress="gzip" if compress == "gzip" else None, cache_control="no-cache")
        return digest

    def read_chunk_bytes(self, index) -> bytes | None:
        """Decoded raw bytes of a stored chunk, or None if absent.  More than one representation is an error."""
        name = self.chunk_name(index)
        if self.url.is_local:
            found = [s for s in _ALL_SUFFIXES if (self.url.local_path / (name + s)).is_file()]
            if not found:
                return None
            if len(found) > 1:
                raise DataError(f"chunk {name} of {self.url} is stored as {[name + s for s in found]}: readers "
                                "would pick one by probe order; re-run its task to leave exactly one")
            data = (self.url.local_path / (name + found[0])).read_bytes()
            if found[0] == ".gz":
                try:
                    data = gzip.decompress(data)
                except (OSError, EOFError) as exc:
                    raise DataError(f"chunk {name}.gz of {self.url} is not valid gzip: {exc}") from exc
            elif found[0] != "":
                raise DataError(f"chunk {name}{found[0]}: znni only verifies raw and gzip chunks")
            return data
        if self.url.protocol == "s3":
            return _s3_bytes(self._s3, name)  # errors are StorageError / DataError naming the key
        try:
            return _cloudfiles(self.url).get(name)
        except Exception as exc:  # e.g. an MD5 mismatch on the wire (RELIABILITY T8): never silent garbage
            raise DataError(f"chunk {name} of {self.url}: read failed: {type(exc).__name__}: {exc}") from exc

    def verify_chunk(self, index, digest: str) -> None:
        """Read back and compare checksums; raise :class:`DataError` naming the chunk."""
        data = self.read_chunk_bytes(index)
        name = self.chunk_name(index)
        if data is None:
            raise DataError(f"chunk {name} of {self.url} is missing after its write (expected sha256 {digest[:12]})")
        got = sha256(data)
        if got != digest:
            raise DataError(f"chunk {name} of {self.url}: read-back sha256 {got[:12]} != written {digest[:12]} "
                            "(torn or corrupted write); re-run its task")

    def read_chunk(self, index) -> np.ndarray | None:
        data = self.read_chunk_bytes(index)
        if data is None:
            return None
        roi = self.grid.chunk_roi(index)
        return decode_raw(data, self.dtype, (self.channels,) + tuple(roi.shape))

    # ---- sharded layers: one object per shard, written whole ------------------------------------
    def shard_name(self, index) -> str:
        """``<key>/<hex>.shard``: the object holding chunk ``index`` of a sharded layer."""
        from .sharding import chunk_key, shard_name

        return f"{self.key}/{shard_name(self.spec.sharding, chunk_key(index, self.grid.grid_shape))}"

    def write_shard(self, chunks: dict) -> dict:
        """Build one shard from ``{chunk index: (C, z, y, x) array}`` (chunks of one shard; the
        absent ones read as 0), write it whole and atomically, read it back and compare.
        Returns ``{"name", "sha256", "nbytes", "chunks": {index: sha256 of the raw chunk}}``."""
        from .sharding import build_shard, chunk_key

        raw, digests = {}, {}
        for idx, arr in chunks.items():
            self._check_chunk(idx, arr)
            data = encode_raw(arr, self.dtype)
            raw[chunk_key(idx, self.grid.grid_shape)] = data
            digests[tuple(idx)] = sha256(data)
        names = {self.shard_name(i) for i in chunks}
        if len(names) != 1:
            raise DataError(f"{self.url}: chunks of {len(names)} shards given as one shard ({sorted(names)[:3]})")
        name = names.pop()
        blob = build_shard(self.spec.sharding, raw)
        self.write_object(name, blob)
        self.verify_object(name, sha256(blob))
        return {"name": name, "sha256": sha256(blob), "nbytes": len(blob), "chunks": digests}

    def delete_chunk(self, index) -> None:
        name = self.chunk_name(index)
        if self.url.is_local:
            for s in _ALL_SUFFIXES:
                (self.url.local_path / (name + s)).unlink(missing_ok=True)
        elif self.url.protocol == "s3":
            self._s3.delete(name)
        else:
            _cloudfiles(self.url).delete(name)


def layer_differences(url: LayerURL, specs: list[ScaleSpec]) -> list[str] | None:
    """What keeps the layer at ``url`` from holding the scales ``specs`` (mip by mip; ``[]``:
    compatible, and a layer of fewer mips may gain the others); None: there is no layer."""
    from .info import compare_scale, scale_spec

    if url.format == "zarr":
        from .zarr_output import stored_spec

        have = [stored_spec(url, s.key) for s in specs]
        if all(h is None for h in have):
            return None
        return [f"mip {k}: {d}" for k, (h, s) in enumerate(zip(have, specs)) if h is not None
                for d in compare_scale(h, s)]
    info = read_json(url, "info")
    if info is None:
        return None
    info = validate_info(info, f"layer {url}")
    return [f"mip {k}: {d}" for k in range(min(len(info["scales"]), len(specs)))
            for d in compare_scale(scale_spec(info, k, f"layer {url}"), specs[k])]


def create_layer(url: LayerURL, specs, provenance: dict) -> str:
    """Write ``info`` (every scale of ``specs``: mip 0, then a pyramid's mips) and ``provenance``
    once; return ``created`` or ``exists``.

    An existing layer must match each spec it has (RELIABILITY T18, T22): otherwise
    :class:`DataError` listing each difference; a layer of fewer scales gains the others.  On
    ``file://`` the info is created with an exclusive link, so of many simultaneous creators
    exactly one writes it.
    """
    from .mips import layer_info

    specs = [specs] if isinstance(specs, ScaleSpec) else list(specs)
    diffs = layer_differences(url, specs)
    if diffs:
        raise DataError(f"output layer {url} exists and does not match the config:\n  - " + "\n  - ".join(diffs)
                        + "\nChoose a new output path, or delete the layer if it is yours to replace.")
    if url.format == "zarr":
        from .zarr_output import create_zarr_output

        return create_zarr_output(url, specs, provenance)
    for spec in specs:
        check_key(spec.key, "output scale key")
    info = layer_info(specs)
    created = write_json(url, "info", info, exclusive=True)
    if not created:
        existing = read_json(url, "info")
        have = existing["scales"]
        if len(have) < len(specs):  # a pyramid added to an earlier run's layer: one writer (create-layer)
            write_json(url, "info", {**existing, "scales": have + info["scales"][len(have):]})
    if read_json(url, "provenance") is None:
        write_json(url, "provenance", provenance, exclusive=True)
    return "created" if created else "exists"


def open_output(url: LayerURL, spec: ScaleSpec, mip: int = 0):
    """Open mip ``mip`` of an output layer that must already exist and match ``spec`` (a worker's
    check, T18); a zarr output's array is a :class:`~znni_core.io.zarr_output.ZarrOutput`."""
    from .info import compare_scale

    if url.format == "zarr":
        from .zarr_output import ZarrOutput

        return ZarrOutput(url, spec)

    try:
        layer = PrecomputedLayer(url, mip)
    except DataError as exc:
        raise DataError(f"{exc}. The output layer is created by `znni create-layer` (rule create_layer) "
                        "before any task runs.") from None
    diffs = compare_scale(layer.spec, spec)
    if diffs:
        raise DataError(f"output layer {url} mip {mip} does not match this run's config:\n  - " + "\n  - ".join(diffs))
    return layer
