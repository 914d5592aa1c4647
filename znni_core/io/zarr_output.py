"""zarr v3 output: one ``(c, z, y, x)`` array per mip, with the sharding codec, in an OME-Zarr
(NGFF 0.5) group.

``out.zarr/`` (``file://``, ``s3://``, ``gs://``)::

    zarr.json      the group; attributes ``ome.multiscales``: axes c, z, y, x (nanometre), one
                   dataset per mip: scale = resolution, translation = voxel_offset * resolution
                   (mip 0; a coarser mip's voxel centre is its block's centre, OME's convention)
    0/zarr.json    the array: shape ``(C,) + bounds.shape``, inner chunks ``(C,) + chunk_size``,
                   shards ``(C,) + task box`` (a task is one shard), fill value 0; attributes
                   ``resolution`` and ``voxel_offset`` (z, y, x), which znni's zarr input reads
    0/c/0/i/j/k    one shard per task: written whole (temporary name + rename on ``file://``, one
                   PUT on ``s3://``/``gs://``), read back, compared
    1/, 2/ ...     the pyramid's mips (``downsample.mips``, :mod:`znni_core.io.mips`), alike
    provenance     znni's processing log, as beside a precomputed layer

A shard's bytes are made by zarr-python itself against the array's own metadata in memory (so any
zarr v3 reader, tensorstore included, decodes them), then stored in one atomic write.  Chunks a
task does not give (empty or masked) are absent from the shard and read as 0.  The geometry is a
:class:`ScaleSpec` whose ``sharding`` is ``{"@type": "zarr_sharding_indexed", ...}``, so an
existing array is compared with the run's exactly as a precomputed layer is (T18, T17).
"""

from __future__ import annotations

import json

import numpy as np

from ..errors import DataError
from ..geometry import Coordinate, Roi
from .info import ScaleSpec, compare_scale
from .paths import LayerURL
from .store import StoredObjects, read_json, sha256, write_json

ZARR_SHARDING = "zarr_sharding_indexed"
ARRAY = "0"


def zarr_sharding(task_chunks, compression: str, crc32c: bool = True) -> dict:
    """The spec's ``sharding`` entry of a zarr output: a shard is ``task_chunks`` chunks, each
    ``compression``-ed and (``crc32c``) followed by its crc32c, which readers check."""
    return {
        "@type": ZARR_SHARDING,
        "chunks_per_shard": [int(v) for v in task_chunks],
        "compression": compression,
        "crc32c": bool(crc32c),
    }


def _template(spec: ScaleSpec):
    """The array in a fresh in-memory store, with exactly the metadata of the stored one."""
    # lazy: loads zarr only when called
    import zarr
    from zarr.codecs import Crc32cCodec, GzipCodec
    from zarr.storage import MemoryStore

    sh = spec.sharding
    c = int(spec.channels)
    store = MemoryStore()
    arr = zarr.create_array(
        store,
        name=spec.key,
        shape=(c,) + tuple(spec.bounds.shape),
        dtype=spec.dtype,
        fill_value=0,
        chunks=(c,) + tuple(spec.chunk_shape),
        shards=(c,) + tuple(Coordinate(sh["chunks_per_shard"]) * spec.chunk_shape),
        # crc32c per chunk: a later run reading this array as its input verifies every chunk
        compressors=([GzipCodec(level=6)] if sh["compression"] == "gzip" else [])
        + ([Crc32cCodec()] if sh.get("crc32c") else []),
        dimension_names=["c", "z", "y", "x"],
        zarr_format=3,
        config={"write_empty_chunks": True},
        attributes={"resolution": [float(v) for v in spec.resolution], "voxel_offset": list(spec.bounds.offset)},
    )
    return store, arr


def _group_attributes(specs: list[ScaleSpec], name: str) -> dict:
    axes = [{"name": "c", "type": "channel"}] + [{"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"]
    r0 = specs[0].resolution
    datasets = []
    for spec in specs:
        res = [float(v) for v in spec.resolution]
        # voxel a of a mip covers mip-0 voxels [a f, (a + 1) f): its centre, in mip 0's convention
        shift = [o * r + (r - q) / 2 for o, r, q in zip(spec.bounds.offset, res, r0)]
        datasets.append(
            {
                "path": spec.key,
                "coordinateTransformations": [
                    {"type": "scale", "scale": [1.0] + res},
                    {"type": "translation", "translation": [0.0] + shift},
                ],
            }
        )
    return {"ome": {"version": "0.5", "multiscales": [{"name": name, "axes": axes, "datasets": datasets}]}}


def _spec_of(meta: dict, where: str, key: str = ARRAY) -> ScaleSpec:
    """The ScaleSpec of a stored zarr output array from its ``zarr.json``."""
    try:
        attrs = meta.get("attributes", {})
        shard = meta["chunk_grid"]["configuration"]["chunk_shape"]
        (codec,) = [c for c in meta["codecs"] if c["name"] == "sharding_indexed"]
        inner = codec["configuration"]["chunk_shape"]
        gz = any(c["name"] == "gzip" for c in codec["configuration"]["codecs"])
        crc = any(c["name"] == "crc32c" for c in codec["configuration"]["codecs"])
        shape = meta["shape"]
        per = [s // i for s, i in zip(shard[1:], inner[1:])]
        return ScaleSpec(
            key,
            Roi(attrs["voxel_offset"], shape[1:]),
            Coordinate(inner[1:]),
            tuple(float(v) for v in attrs["resolution"]),
            meta["data_type"],
            int(shape[0]),
            "raw",
            zarr_sharding(per, "gzip" if gz else "none", crc),
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise DataError(
            f"{where}: not a znni zarr output array (sharded, with resolution and voxel_offset "
            f"attributes): {type(exc).__name__}: {exc}"
        ) from None


def stored_spec(url: LayerURL, key: str = ARRAY) -> ScaleSpec | None:
    """The spec of the stored array ``key`` of a zarr output, or None if it has none."""
    meta = read_json(url, f"{key}/zarr.json")
    return None if meta is None else _spec_of(meta, f"output {url} array {key}", key)


def create_zarr_output(url: LayerURL, specs: list[ScaleSpec], provenance: dict) -> str:
    """Write the arrays' metadata (one array per mip; checked against ``specs`` by the caller,
    :func:`~znni_core.io.layers.layer_differences`) and the group's; ``created`` or
    ``exists``.  A group of fewer mips gains the others."""
    created = False
    for spec in specs:
        store, _ = _template(spec)
        meta = json.loads(store._store_dict[f"{spec.key}/zarr.json"].to_bytes())
        created = write_json(url, f"{spec.key}/zarr.json", meta, exclusive=True) or created
    name = url.path.rstrip("/").split("/")[-1]
    group = {"zarr_format": 3, "node_type": "group", "attributes": _group_attributes(specs, name)}
    old = read_json(url, "zarr.json")
    listed = len(((old or {}).get("attributes", {}).get("ome", {}).get("multiscales") or [{}])[0].get("datasets", []))
    if old is None or listed < len(specs):
        write_json(url, "zarr.json", group)
    write_json(url, "provenance", provenance, exclusive=True)
    return "created" if created else "exists"


class ZarrOutput(StoredObjects):
    """An existing zarr output, checked against ``spec``; the writer's and finalize's interface of
    a sharded :class:`~znni_core.io.precomputed.PrecomputedLayer`."""

    sharded = True

    def __init__(self, url: LayerURL, spec: ScaleSpec | None = None):
        self.url = url
        key = spec.key if spec is not None else ARRAY
        try:
            stored = stored_spec(url, key)
        except OSError as exc:
            raise DataError(f"output {url}: {key}/zarr.json cannot be read ({exc})") from exc
        if stored is None:
            raise DataError(
                f"output {url} has no array {key}/zarr.json. The output layer is created by "
                "`znni create-layer` (rule create_layer) before any task runs."
            )
        self.spec = stored
        if spec is not None:
            diffs = compare_scale(self.spec, spec)
            if diffs:
                raise DataError(
                    f"output layer {url} does not match this run's config:\n  - "
                    + "\n  - ".join(diffs)
                    + "\nChoose a new output path, or delete the layer if it is yours to replace."
                )
        self.key = key
        self._mem = self._local = None

    bounds = property(lambda self: self.spec.bounds)
    grid = property(lambda self: self.spec.grid)
    dtype = property(lambda self: self.spec.dtype)
    channels = property(lambda self: self.spec.channels)
    resolution = property(lambda self: self.spec.resolution)

    def chunk_name(self, index) -> str:
        """``x0-x1_y0-y1_z0-z1`` in absolute voxels (as a precomputed chunk is named)."""
        roi = self.grid.chunk_roi(index)
        b, e = roi.begin.xyz(), roi.end.xyz()
        return f"{b[0]}-{e[0]}_{b[1]}-{e[1]}_{b[2]}-{e[2]}"

    def shard_name(self, index) -> str:
        """The key of the shard holding chunk ``index``: ``0/c/0/i/j/k``."""
        s = Coordinate(index) // Coordinate(self.spec.sharding["chunks_per_shard"])
        return f"{self.key}/c/0/" + "/".join(str(v) for v in s)

    def write_shard(self, chunks: dict) -> dict:
        """Encode ``{chunk index: (C, z, y, x) array}`` (chunks of one shard) as zarr-python does,
        store the shard whole, read it back and compare.  Returns ``{"name", "sha256", "nbytes",
        "chunks": {index: sha256 of the raw chunk}}``."""
        names = {self.shard_name(i) for i in chunks}
        if len(names) != 1:
            raise DataError(f"{self.url}: chunks of {len(names)} shards given as one shard ({sorted(names)[:3]})")
        name = names.pop()
        if self._mem is None:
            self._mem = _template(self.spec)
        store, arr = self._mem
        digests = {}
        for idx, a in chunks.items():
            roi = self.grid.chunk_roi(idx)
            want = (self.channels,) + tuple(roi.shape)
            if a.shape != want or a.dtype != np.dtype(self.dtype):
                raise DataError(
                    f"chunk {self.chunk_name(idx)}: array {a.shape} {a.dtype}, the layer holds {want} {self.dtype}"
                )
            arr[(slice(None),) + roi.to_slices(self.bounds.offset)] = a
            digests[tuple(idx)] = sha256(np.ascontiguousarray(a).tobytes())
        try:
            blob = store._store_dict.pop(name).to_bytes()
        finally:
            for k in [k for k in store._store_dict if k.startswith(f"{self.key}/c/")]:
                del store._store_dict[k]
        self.write_object(name, blob)
        self.verify_object(name, sha256(blob))
        return {"name": name, "sha256": sha256(blob), "nbytes": len(blob), "chunks": digests}

    HELD_SHARDS = 8  # remote reads: whole shards kept for the next reads (a pyramid task reads 4 in turn)

    def read(self, roi: Roi, *, fill_missing: bool = True) -> tuple[np.ndarray, list]:
        """``(C, z, y, x)`` of ``roi`` (absent chunks: 0).  ``file://``: zarr-python reads the
        chunks' byte ranges; ``s3://``/``gs://``: the shards under ``roi`` are fetched whole
        through the layer's storage (the last few kept) and decoded by zarr-python."""
        # lazy: loads zarr only when called
        import zarr
        from zarr.core.buffer import default_buffer_prototype

        if not self.bounds.contains(roi):
            raise DataError(f"read {roi} is outside the bounds {self.bounds} of {self.url} array {self.key}")
        sl = (slice(None),) + roi.to_slices(self.bounds.offset)
        if self.url.is_local:
            if self._local is None:  # opened once: a pyramid task reads chunk by chunk
                self._local = zarr.open_array(str(self.url.local_path / self.key), mode="r")
            return np.asarray(self._local[sl]), []
        if self._mem is None:
            self._mem = _template(self.spec)
        store, arr = self._mem
        held = [k for k in store._store_dict if k.startswith(f"{self.key}/c/")]
        for name in sorted({self.shard_name(i) for i in self.grid.chunks_in(roi)}):
            if name in held:
                continue
            blob = self.read_object(name)
            if blob is not None:
                store._store_dict[name] = default_buffer_prototype().buffer.from_bytes(blob)
                held.append(name)
        got = np.asarray(arr[sl])
        for name in held[: -self.HELD_SHARDS]:  # the oldest first (dicts keep insertion order)
            store._store_dict.pop(name, None)
        return got, []

    def read_chunk(self, index) -> np.ndarray:
        """Chunk ``index`` as a (C, z, y, x) array (absent chunks read as 0)."""
        return self.read(self.grid.chunk_roi(index))[0]
