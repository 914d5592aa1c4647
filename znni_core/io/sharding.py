"""Sharded precomputed output (``neuroglancer_uint64_sharded_v1``, identity hash).

A chunk's key is its compressed Morton code in the layer's chunk grid (x bits first, a
dimension dropping out once its bits are spent); with the identity hash, the shard of a key
is ``key >> (preshift_bits + minishard_bits)``, so every shard is an aligned box of
``2^a x 2^b x 2^c`` chunks from the layer's ``voxel_offset`` (clipped at the far end). znni
lays one task on each such box: one writer per shard, the shard built whole in memory and
written once (atomic rename on ``file://``, one PUT on ``s3://``/``gs://``), then read back
and checked.  The spec is cloud-volume's recommendation (the one igneous uses) for a target
uncompressed shard size (``output.shard_bytes``); cloud-volume also assembles the shard's
bytes (indices, minishards), which cloud-volume, tensorstore and Neuroglancer read.

::

    chunk grid (x, y)     shard boxes of 4 x 2 chunks (preshift + minishard bits = 3)
    +--+--+--+--+--+--+
    |0 |1 |4 |5 |8 |9 |   keys (compressed Morton)    shard = key >> 3
    +--+--+--+--+--+--+
    |2 |3 |6 |7 |10|11|   -> shards {0..7} and {8..11}: boxes [0,4) and [4,6) in x
    +--+--+--+--+--+--+
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ..errors import ConfigError, DataError
from ..geometry import Coordinate
from .store import _gunzip

__all__ = [
    "SHARD_TYPE",
    "ShardReader",
    "auto_sharding",
    "build_shard",
    "check_sharding",
    "chunk_key",
    "shard_chunks",
    "shard_name",
]

SHARD_TYPE = "neuroglancer_uint64_sharded_v1"


def _bits(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def chunk_key(index, grid_shape) -> int:
    """Compressed Morton code of chunk ``index`` (z, y, x) in a grid of ``grid_shape`` (z, y, x)."""
    xyz = tuple(int(v) for v in reversed(tuple(index)))
    bits = [_bits(int(n)) for n in reversed(tuple(grid_shape))]
    key, j = 0, 0
    for i in range(max(bits)):
        for d in range(3):
            if i < bits[d]:
                key |= ((xyz[d] >> i) & 1) << j
                j += 1
    return key


def shard_chunks(sharding: dict, grid_shape) -> Coordinate:
    """The shard box in chunks (z, y, x): the first ``preshift_bits + minishard_bits`` bits of
    the compressed Morton code, dealt to x, y, z in turn while each has bits left."""
    left = int(sharding["preshift_bits"]) + int(sharding["minishard_bits"])
    bits = [_bits(int(n)) for n in reversed(tuple(grid_shape))]
    take = [0, 0, 0]
    for i in range(max(bits, default=0)):
        for d in range(3):
            if i < bits[d] and left > 0:
                take[d] += 1
                left -= 1
    return Coordinate(tuple(min(2**t, int(n)) for t, n in zip(take, reversed(tuple(grid_shape))))[::-1])


def shard_name(sharding: dict, key: int) -> str:
    """``<hex shard number>.shard`` (zero-padded to the shard bits, as readers expect)."""
    shift = int(sharding["preshift_bits"]) + int(sharding["minishard_bits"])
    number = (int(key) >> shift) & ((1 << int(sharding["shard_bits"])) - 1)
    return _shard_file(number, int(sharding["shard_bits"]))


def _shard_file(number: int, shard_bits: int) -> str:
    """Shard ``number``'s file name: hex, zero-padded to ``shard_bits`` (as readers expect)."""
    return format(number, "x").zfill(math.ceil(shard_bits / 4)) + ".shard"


def check_spec(sharding, where: str, error=DataError) -> dict:
    """A sharding spec any reader follows (an input's): its type, hash, bit counts and encodings;
    ``error`` (a :class:`~znni_core.errors.DataError` by default) naming the key otherwise."""
    if not isinstance(sharding, dict) or sharding.get("@type") != SHARD_TYPE:
        raise error(f"{where}: must be an object with '@type': '{SHARD_TYPE}', got {sharding!r}"[:300])
    if sharding.get("hash") not in ("identity", "murmurhash3_x86_128"):
        raise error(f"{where}: hash {sharding.get('hash')!r} is not identity or murmurhash3_x86_128"[:300])
    for k in ("preshift_bits", "minishard_bits", "shard_bits"):
        v = sharding.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 64:
            raise error(f"{where}: {k} must be an integer in [0, 64), got {v!r}"[:300])
    for k in ("minishard_index_encoding", "data_encoding"):
        if sharding.get(k, "raw") not in ("raw", "gzip"):
            raise error(f"{where}: {k} must be raw or gzip, got {sharding.get(k)!r}"[:300])
    return sharding


def check_sharding(sharding: dict, where: str, grid_shape=None) -> dict:
    """A sharding spec znni can write: identity hash (shards are boxes), known encodings, and
    (given the layer's ``grid_shape``) enough bits that no two boxes share a shard file."""
    want = {
        "@type",
        "preshift_bits",
        "hash",
        "minishard_bits",
        "shard_bits",
        "minishard_index_encoding",
        "data_encoding",
    }
    if not isinstance(sharding, dict) or set(sharding) - want or sharding.get("@type") != SHARD_TYPE:
        raise ConfigError(
            f"{where}: a sharding spec is {{'@type': '{SHARD_TYPE}', preshift_bits, hash, "
            f"minishard_bits, shard_bits, minishard_index_encoding, data_encoding}}; got {sharding!r}"
        )
    if sharding.get("hash") != "identity":
        raise ConfigError(
            f"{where}: hash {sharding.get('hash')!r}: znni writes shards as boxes of chunks, which "
            "needs hash: identity (murmurhash3 scatters a task's chunks over every shard)"
        )
    check_spec(sharding, where, ConfigError)  # bit counts and encodings, as a reader needs them
    if grid_shape is not None:
        need = sum(_bits(int(n)) for n in grid_shape)
        have = sharding["preshift_bits"] + sharding["minishard_bits"] + sharding["shard_bits"]
        if have < need:
            raise ConfigError(
                f"{where}: preshift_bits + minishard_bits + shard_bits = {have} < {need}, the bits of "
                f"a chunk key in this layer's grid {tuple(int(n) for n in grid_shape)} (z, y, x): "
                f"several boxes of chunks would share one shard file; raise shard_bits to "
                f"{need - have + sharding['shard_bits']}"
            )
    return {"minishard_index_encoding": "raw", "data_encoding": "raw", **sharding}


def auto_sharding(shape_zyx, chunk_zyx, dtype: str, channels: int, shard_bytes: int, data_encoding: str) -> dict:
    """cloud-volume's recommended spec (igneous' defaults: shard index <= 8 KiB, <= 4000 chunks
    per minishard) for shards of about ``shard_bytes`` uncompressed."""
    # lazy: loads cloudvolume only when called
    from cloudvolume.datasource.precomputed.sharding import compute_shard_params_for_image

    spec = compute_shard_params_for_image(
        tuple(int(v) for v in reversed(tuple(shape_zyx))),
        tuple(int(v) for v in reversed(tuple(chunk_zyx))),
        "raw",
        dtype,
        uncompressed_shard_bytesize=max(1, int(shard_bytes) // max(1, int(channels))),
        data_encoding=data_encoding,
        minishard_index_encoding="gzip",
    ).to_dict()
    return {k: (int(v) if k.endswith("_bits") else v) for k, v in spec.items()}


def build_shard(sharding: dict, chunks: dict) -> bytes:
    """The bytes of one shard file from ``{key: encoded chunk bytes}`` (all of one shard)."""
    # lazy: loads cloudvolume only when called
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    spec = ShardingSpecification.from_dict(dict(sharding))
    names = {shard_name(sharding, k) for k in chunks}
    if len(names) != 1:
        raise ValueError(f"chunks of {len(names)} shards ({sorted(names)[:4]}) given as one shard")
    return bytes(spec.synthesize_shard(dict(chunks)))


class ShardReader:
    """Chunks of one sharded precomputed scale, read by byte range through the layer's store.

    A chunk costs at most three ranged reads, the first two cached per shard and minishard: the
    shard index (16 bytes per minishard: where its index lies), the minishard index (the
    chunks' ids, offsets and sizes, delta-encoded) and the chunk's bytes.  Both hashes of the
    spec are read (identity, murmurhash3_x86_128); every request goes through the store's
    bounded retries.

    Parameters
    ----------
    store : ObjectStore
        The layer's store.
    key : str
        The scale's key (the shard files' folder).
    sharding : dict
        The scale's sharding spec.
    """

    def __init__(self, store, key: str, sharding: dict):
        self.store, self.key, self.spec = store, key, sharding
        self.minishard_bits = int(sharding["minishard_bits"])
        self._index_bytes = 16 << self.minishard_bits
        self._indices: dict = {}  # shard name -> (n, 2) array of minishard index ranges, None, or the error
        self._minishards: dict = {}  # (shard, minishard) -> {chunk id: (offset, size)}
        self._lock = threading.Lock()  # chunks are read from several threads: each index once

    def _hash(self, value: int) -> int:
        if self.spec["hash"] == "identity":
            return value
        # lazy: loads cloudvolume only when called
        from cloudvolume.datasource.precomputed import mmh3  # cloud-volume's own murmurhash3

        return mmh3.hash64(int(value).to_bytes(8, "little"), x64arch=False)[0] & (2**64 - 1)

    def location(self, key: int) -> tuple[str, int]:
        """``(shard file name, minishard number)`` of chunk ``key``."""
        h = self._hash(int(key) >> int(self.spec["preshift_bits"]))
        shard = (h >> self.minishard_bits) & ((1 << int(self.spec["shard_bits"])) - 1)
        return _shard_file(shard, int(self.spec["shard_bits"])), h & ((1 << self.minishard_bits) - 1)

    def _path(self, shard: str) -> str:
        return f"{self.key}/{shard}"

    def _decode(self, data: bytes, encoding: str, where: str) -> bytes:

        return data if encoding == "raw" else _gunzip(data, where)

    def shard_index(self, shard: str):
        """The shard's minishard index ranges (absolute byte offsets), or None if the shard is absent or empty."""
        with self._lock:
            if shard not in self._indices:
                try:
                    self._indices[shard] = self._read_shard_index(shard)
                except Exception as exc:  # a refusal or a corrupt index: the other chunks of the shard
                    self._indices[shard] = exc  # fail with it, without asking again
            got = self._indices[shard]
        if isinstance(got, Exception):
            raise got
        return got

    def _read_shard_index(self, shard: str):

        path = self._path(shard)
        if not self.store.sizes([path]).get(path):
            return None
        data = self.store.get_range(path, 0, self._index_bytes)
        if data is None:  # deleted since its size was read
            return None
        idx = np.frombuffer(data, "<u8").reshape(-1, 2).astype(np.int64) + self._index_bytes
        if (idx[:, 1] < idx[:, 0]).any():
            raise DataError(
                f"{self.store.where(path)}: its shard index has a range that ends before it starts; repair the input"
            )
        return idx

    def _minishard(self, shard: str, minishard: int) -> dict:
        index = self.shard_index(shard)
        with self._lock:
            if (shard, minishard) not in self._minishards:
                start, end = (int(v) for v in index[minishard])
                self._minishards[(shard, minishard)] = self._read_minishard(shard, minishard, start, end)
        return self._minishards[(shard, minishard)]

    def _read_minishard(self, shard: str, minishard: int, start: int, end: int) -> dict:
        """``{chunk id: (offset, size)}`` from the minishard index at bytes ``[start, end)``."""
        if end <= start:
            return {}
        where = f"{self.store.where(self._path(shard))} minishard {minishard}"
        data = self.store.get_range(self._path(shard), start, end) or b""
        data = self._decode(data, self.spec.get("minishard_index_encoding", "raw"), where)
        if len(data) % 24:
            raise DataError(f"{where}: its index is {len(data)} bytes, not a multiple of 24; repair the input")
        a = np.frombuffer(data, "<u8").reshape(3, -1)  # delta-encoded ids, offsets (gaps), sizes
        ids = np.cumsum(a[0], dtype=np.uint64)
        sizes = a[2]
        offsets = np.cumsum(a[1], dtype=np.uint64)
        offsets[1:] += np.cumsum(sizes[:-1], dtype=np.uint64)
        offsets += np.uint64(self._index_bytes)
        return {int(i): (int(o), int(n)) for i, o, n in zip(ids, offsets, sizes)}

    def find(self, key: int):
        """``(shard, offset, size)`` of chunk ``key``; ``(shard, None, "shard")`` when its shard is
        absent or empty, ``(shard, None, "chunk")`` when the shard does not list it."""
        shard, minishard = self.location(key)
        if self.shard_index(shard) is None:
            return shard, None, "shard"
        got = self._minishard(shard, minishard).get(int(key))
        return (shard, None, "chunk") if got is None else (shard, got[0], got[1])

    def get(self, key: int) -> bytes | None:
        """Chunk ``key``'s bytes (its data encoding undone), or None when the shard lacks it."""
        shard, offset, size = self.find(key)
        if offset is None:
            return None
        data = self.store.get_range(self._path(shard), offset, offset + size)
        if data is None:
            return None
        return self._decode(
            data, self.spec.get("data_encoding", "raw"), f"{self.store.where(self._path(shard))} chunk {key}"
        )
