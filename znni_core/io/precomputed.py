"""Neuroglancer precomputed layers: reading and writing whole chunks through the layer's store.

Reads fetch each chunk object (or its byte range in a shard, :class:`~.sharding.ShardReader`)
through the layer's :class:`~.store.ObjectStore` and decode raw chunks here, other encodings with
cloud-volume's codecs; a missing chunk or shard is named, never read as zeros unless asked.
Writes: one whole output chunk at a time, encoded
``raw`` (C order of (c, z, y, x) == Fortran order of cloud-volume's (x, y, z, c)), written
atomically on ``file://`` (:func:`~znni_core.io.atomic.atomic_write`) or as one object PUT on
``gs://``/``s3://``, then read back and checked against its sha256.  A chunk has exactly one
representation: writing ``name`` removes ``name.gz`` and vice versa (docs/reliability.md, T17).

On ``s3://`` and ``gs://`` every request (chunks, shards, ``info``, ``provenance``) goes through
:mod:`znni_core.io.s3` or :mod:`znni_core.io.gcs` (bounded retries of 5xx/throttling/resets, none
of 403 and other client errors, docs/reliability.md, T7), not cloudfiles, whose fixed 7-attempt
retry of every error cannot be configured.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

import numpy as np

from ..errors import ConfigError, DataError, InputError
from ..geometry import ChunkGrid, Roi
from .checksums import ChunkSums
from .info import ScaleSpec, compare_scale, scale_spec, validate_info
from .mips import layer_info
from .paths import LayerURL, check_key
from .sharding import ShardReader, build_shard, chunk_key, shard_name
from .store import COMPRESSIONS, StoredObjects, read_json, sha256, write_json


def encode_raw(arr: np.ndarray, dtype: str) -> bytes:
    """(C, z, y, x) array -> precomputed raw bytes (little endian)."""
    return np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def decode_raw(data: bytes, dtype: str, shape, *, writable: bool = True) -> np.ndarray:
    """Precomputed raw bytes -> (C, z, y, x) array of ``shape``; a wrong length is a :class:`DataError`.
    ``writable=False``: a read-only view of ``data`` where the byte order allows (no copy)."""
    dt = np.dtype(dtype).newbyteorder("<")
    expected = int(np.prod(shape)) * dt.itemsize
    if len(data) != expected:
        raise DataError(f"chunk holds {len(data)} bytes, expected {expected} for shape {tuple(shape)} {dtype}")
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(dtype, copy=writable)


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
        self.checksums = "none"  # what verifies a read: "sha256" (the layer's sidecar index) or "none"
        self._sums, self._sums_required = None, False
        self._guard_fills = False  # refuse to fill a chunk the sha256 index records (set for inputs)

    def use_checksums(self, mode: str) -> str:
        """Verify reads against the layer's sidecar sha256 index (``io/checksums.py``, written when
        znni finalized it): ``auto`` where there is one, ``required`` refuses a layer without one
        or in an encoding other than raw, ``none`` skips."""
        self._guard_fills = True  # in every mode: a recorded chunk that is absent is lost, never filled
        if mode == "none":
            return "none"
        by_chunk = self._encoding == "raw"
        sums = ChunkSums.of(self) if by_chunk else None
        if sums is None:
            if mode == "required":
                why = "it has no znni sha256 index" if by_chunk else f"its chunks are {self._encoding}-encoded"
                raise ConfigError(
                    f"input {self.url}: raw precomputed chunks carry no checksum and {why}; input.checksums "
                    "is required. Finalize the znni run that wrote it (it records every chunk's sha256), or "
                    "set input.checksums: auto"
                )
            return "none"
        self._sums, self._sums_required, self.checksums = sums, mode == "required", "sha256"
        return self.checksums

    # ---- geometry -------------------------------------------------------------------
    @property
    def bounds(self) -> Roi:
        """The scale's bounds in voxels (z, y, x)."""
        return self.spec.bounds

    @cached_property
    def grid(self) -> ChunkGrid:
        """The scale's chunk grid (z, y, x)."""
        return self.spec.grid

    @property
    def dtype(self) -> str:
        """The layer's data type name, e.g. ``"float32"``."""
        return self.spec.dtype

    @property
    def channels(self) -> int:
        """The number of channels."""
        return self.spec.channels

    @property
    def resolution(self) -> tuple:
        """Voxel size in nm (z, y, x)."""
        return self.spec.resolution

    def chunk_name(self, index) -> str:
        """``<key>/<x0>-<x1>_<y0>-<y1>_<z0>-<z1>`` (absolute voxel coordinates, as cloud-volume names chunks)."""
        b, e = self.grid.chunk_box(index)  # (z, y, x)
        return f"{self.key}/{b[2]}-{e[2]}_{b[1]}-{e[1]}_{b[0]}-{e[0]}"

    # ---- reading ---------------------------------------------------------------------------
    @cached_property
    def _shards(self):

        return ShardReader(self.store, self.key, self.info["scales"][self.mip]["sharding"])

    def _stored(self, index) -> tuple[bytes | None, str]:
        """``(chunk bytes, "")``, or ``(None, name)`` naming an absent or empty chunk (and, in a
        sharded layer, why: its shard is absent or does not list it)."""
        if not self.sharded:
            data = self.read_chunk_bytes(index)
        else:
            data = self._shards.get(chunk_key(index, self.grid.grid_shape))
        if data:
            return data, ""
        return None, (self._absent_in_shard(index) if self.sharded else None) or self.chunk_name(index)

    def _absent_in_shard(self, index) -> str | None:
        """Why chunk ``index`` of a sharded layer cannot be read (``<chunk> (shard <name> missing
        or empty)`` or ``<chunk> (not in shard <name>)``), or None if its shard lists it."""
        shard, offset, size = self._shards.find(chunk_key(index, self.grid.grid_shape))
        if size == "shard":
            return f"{self.chunk_name(index)} (shard {self.key}/{shard} missing or empty)"
        if offset is None or not size:
            return f"{self.chunk_name(index)} (not in shard {self.key}/{shard})"
        return None

    def missing_chunks(self, roi: Roi) -> list[str]:
        """Names of the stored chunks under ``roi`` that are absent or 0 bytes; in a sharded layer,
        those whose shard is absent or empty (``<chunk> (shard <name> missing or empty)``) or
        whose shard's index does not list them (``<chunk> (not in shard <name>)``)."""
        idxs = list(self.grid.chunks_in(roi))
        if not self.sharded:
            names = [self.chunk_name(i) for i in idxs]
            sizes = self.store.sizes(names)
            return [n for n in names if not sizes.get(n)]
        return [why for why in map(self._absent_in_shard, idxs) if why]

    def objects(self, roi: Roi) -> list[str]:
        """The stored objects a read of ``roi`` fetches: its chunks, or in a sharded layer their shards."""
        idxs = list(self.grid.chunks_in(roi.intersect(self.bounds)))
        if not self.sharded:
            return [self.chunk_name(i) for i in idxs]

        shards = {self._shards.location(chunk_key(i, self.grid.grid_shape))[0] for i in idxs}
        return sorted(f"{self.key}/{s}" for s in shards)

    def object_versions(self, roi: Roi) -> dict:
        """``{object: version or None}`` of what a read of ``roi`` fetches (:meth:`objects`;
        :meth:`~.store.ObjectStore.versions`)."""
        return self.versions(self.objects(roi))

    def versions(self, names) -> dict:
        """``{object: version or None if absent}`` now (:meth:`~.store.ObjectStore.versions`)."""
        return self.store.versions(list(names))

    def read(self, roi: Roi, *, fill_missing: bool = False) -> tuple[np.ndarray, list[str]]:
        """``(C, z, y, x)`` array of ``roi`` (inside the bounds) and the chunks filled with zeros.

        Every chunk is read through the layer's store (one object, or byte ranges of its shard):
        on ``s3://`` and ``gs://`` with bounded retries, a permanent refusal (403) failing at once.
        Raw chunks are decoded here, other encodings (jpeg, png, compressed_segmentation, ...)
        by cloud-volume's codecs.  Missing or 0-byte chunks raise :class:`DataError` naming them
        unless ``fill_missing``.
        """
        if not self.bounds.contains(roi):
            raise InputError(f"read {roi} is outside the layer bounds {self.bounds} of {self.url}")
        idxs = list(self.grid.chunks_in(roi))
        if self.url.is_local or len(idxs) < 2:
            stored = [self._stored(i) for i in idxs]
        else:  # remote: requests in flight together; the first error cancels the rest
            with ThreadPoolExecutor(min(8, len(idxs))) as pool:
                futures = [pool.submit(self._stored, i) for i in idxs]
                try:
                    stored = [f.result() for f in futures]
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    raise
        missing = [name for data, name in stored if data is None]
        if missing and not fill_missing:
            raise self._missing_error(roi, missing)
        if missing and self._guard_fills:
            self._refuse_lost(roi, [i for i, (data, _) in zip(idxs, stored) if data is None])
        out = np.zeros((self.channels,) + tuple(roi.shape), self.dtype)
        for idx, (data, _) in zip(idxs, stored):
            if data is None:
                continue
            if self._sums is not None:
                self._sums.check(idx, data, self._sums_required)
            croi = self.grid.chunk_roi(idx)
            chunk = self._decode(idx, data, croi)
            inter = croi.intersect(roi)
            out[(slice(None),) + inter.to_slices(roi.offset)] = chunk[(slice(None),) + inter.to_slices(croi.offset)]
        return out, missing

    @property
    def _encoding(self) -> str:
        return self.info["scales"][self.mip].get("encoding", "raw")

    def _decode(self, index, data: bytes, croi: Roi) -> np.ndarray:
        """One chunk's ``(C, z, y, x)`` array from its stored bytes."""
        shape = (self.channels,) + tuple(croi.shape)
        where = f"input {self.url} mip {self.mip}: chunk {self.chunk_name(index)}"
        if self._encoding == "raw":
            try:
                return decode_raw(data, self.dtype, shape, writable=False)  # copied into the box read
            except DataError as exc:
                raise DataError(f"{where}: {exc}") from None
        # lazy: loads cloudvolume only when called
        from cloudvolume.chunks import decode

        scale = self.info["scales"][self.mip]
        try:
            arr = decode(
                data,
                self._encoding,
                shape=shape[::-1],  # cloud-volume's (x, y, z, c)
                dtype=np.dtype(self.dtype),
                block_size=scale.get("compressed_segmentation_block_size"),
            )
        except Exception as exc:  # each codec raises its own error type
            raise DataError(f"{where}: {self._encoding} chunk does not decode ({type(exc).__name__}: {exc})") from None
        return np.ascontiguousarray(np.asarray(arr).reshape(shape[::-1]).transpose(3, 2, 1, 0))

    def _refuse_lost(self, roi: Roi, idxs: list) -> None:
        """A :class:`DataError` naming the chunks of ``idxs`` (absent or empty) that the layer's
        sha256 index records: they existed when znni wrote the layer, so their absence is data
        loss, which ``input.missing: zero`` never fills.  Nothing without an index (the index is
        read here even under ``input.checksums: none``)."""
        sums = self._sums
        if sums is None:
            sums = self.__dict__.get("_lookup_sums")
            if sums is None:
                sums = self.__dict__["_lookup_sums"] = ChunkSums.of(self) or False
        if not sums:
            return
        lost = [self.chunk_name(i) for i in idxs if sums.expected(i) is not None]
        if lost:
            raise DataError(
                f"input {self.url} mip {self.mip}: {len(lost)} chunk(s) under {roi} are missing or empty but the "
                f"layer's sha256 index ({self.key}/znni-sha256) records them (first: {lost[:3]}): they existed "
                "when znni wrote the layer, so this is data loss, not a gap; input.missing: zero fills only "
                "chunks that were never written. Restore them, or re-run the run that wrote the layer"
            )

    def _missing_error(self, roi: Roi, missing: list) -> DataError:
        return DataError(
            f"input {self.url} mip {self.mip}: {len(missing)} chunk(s) under {roi} are missing or empty "
            f"(first: {missing[:3]}); repair the input, or set input.missing: zero to fill them with 0 "
            "(recorded in the manifests)"
        )

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
        self.store.put(name, raw, compress=compress)  # one representation: the others are removed
        return sha256(raw)

    def read_chunk_bytes(self, index) -> bytes | None:
        """Decoded raw bytes of a stored chunk, or None if absent.  More than one representation is an error."""
        return self.store.get(self.chunk_name(index))

    def verify_chunk(self, index, digest: str) -> None:
        """Read back and compare checksums; raise :class:`DataError` naming the chunk."""
        self.store.verify(self.chunk_name(index), digest)

    def read_chunk(self, index) -> np.ndarray | None:
        """Stored chunk ``index`` as a (C, z, y, x) array, or None if absent; a wrong size is a :class:`DataError`."""
        data = self.read_chunk_bytes(index)
        if data is None:
            return None
        roi = self.grid.chunk_roi(index)
        return decode_raw(data, self.dtype, (self.channels,) + tuple(roi.shape))

    # ---- sharded layers: one object per shard, written whole ------------------------------------
    def shard_name(self, index) -> str:
        """``<key>/<hex>.shard``: the object holding chunk ``index`` of a sharded layer."""
        return f"{self.key}/{shard_name(self.spec.sharding, chunk_key(index, self.grid.grid_shape))}"

    def write_shard(self, chunks: dict) -> dict:
        """Build one shard from ``{chunk index: (C, z, y, x) array}`` (chunks of one shard; the
        absent ones read as 0), write it whole and atomically, read it back and compare.
        Returns ``{"name", "sha256", "nbytes", "chunks": {index: sha256 of the raw chunk}}``."""
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
        self.__dict__.pop("_shards", None)  # the shard indices read so far may describe the old shard
        self.write_object(name, blob)
        self.verify_object(name, sha256(blob))
        return {"name": name, "sha256": sha256(blob), "nbytes": len(blob), "chunks": digests}

    def delete_chunk(self, index) -> None:
        """Remove a chunk in every representation (absent is fine)."""
        self.store.delete(self.chunk_name(index))


def precomputed_differences(url: LayerURL, specs: list[ScaleSpec]) -> list[str] | None:
    """What keeps the precomputed layer at ``url`` from holding ``specs`` (None: no layer)."""
    info = read_json(url, "info")
    if info is None:
        return None
    info = validate_info(info, f"layer {url}")
    return [
        f"mip {k}: {d}"
        for k in range(min(len(info["scales"]), len(specs)))
        for d in compare_scale(scale_spec(info, k, f"layer {url}"), specs[k])
    ]


def create_precomputed(url: LayerURL, specs: list[ScaleSpec], provenance: dict) -> str:
    """Write a precomputed layer's ``info`` (checked by the caller) and ``provenance`` once;
    ``created`` or ``exists``.  On ``file://`` the info is created with an exclusive link, so of
    many simultaneous creators exactly one writes it; a layer of fewer scales gains the others."""
    for spec in specs:
        check_key(spec.key, "output scale key")
    info = layer_info(specs)
    created = write_json(url, "info", info, exclusive=True)
    if not created:
        existing = read_json(url, "info")
        have = existing["scales"]
        if len(have) < len(specs):  # a pyramid added to an earlier run's layer: one writer (create-layer)
            write_json(url, "info", {**existing, "scales": have + info["scales"][len(have) :]})
    if read_json(url, "provenance") is None:
        write_json(url, "provenance", provenance, exclusive=True)
    return "created" if created else "exists"


def open_precomputed_output(url: LayerURL, spec: ScaleSpec, mip: int = 0) -> PrecomputedLayer:
    """Mip ``mip`` of an existing precomputed output, checked against ``spec``."""
    try:
        layer = PrecomputedLayer(url, mip)
    except DataError as exc:
        raise DataError(
            f"{exc}. The output layer is created by `znni create-layer` (rule create_layer) before any task runs."
        ) from None
    diffs = compare_scale(layer.spec, spec)
    if diffs:
        raise DataError(f"output layer {url} mip {mip} does not match this run's config:\n  - " + "\n  - ".join(diffs))
    return layer
