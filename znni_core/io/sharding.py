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

from ..errors import ConfigError
from ..geometry import Coordinate

__all__ = ["SHARD_TYPE", "auto_sharding", "build_shard", "check_sharding", "chunk_key", "shard_chunks", "shard_name"]

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
    return format(number, "x").zfill(math.ceil(int(sharding["shard_bits"]) / 4)) + ".shard"


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
    for k in ("preshift_bits", "minishard_bits", "shard_bits"):
        v = sharding.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 64:
            raise ConfigError(f"{where}: {k} must be an integer in [0, 64), got {v!r}")
    for k in ("minishard_index_encoding", "data_encoding"):
        if sharding.get(k, "raw") not in ("raw", "gzip"):
            raise ConfigError(f"{where}: {k} must be raw or gzip, got {sharding.get(k)!r}")
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
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    spec = ShardingSpecification.from_dict(dict(sharding))
    names = {shard_name(sharding, k) for k in chunks}
    if len(names) != 1:
        raise ValueError(f"chunks of {len(names)} shards ({sorted(names)[:4]}) given as one shard")
    return bytes(spec.synthesize_shard(dict(chunks)))
