"""Checksums an input layer carries, so that a byte flipped at rest fails a read instead of
becoming a wrong voxel.

A raw precomputed chunk carries no checksum of its own. When znni writes a precomputed layer,
``finalize`` records the sha256 of every chunk it verified in a sidecar index beside the chunks
(or shards)::

    <scale key>/znni-sha256/index.json          {"format": "znni-sha256/1", "block": [8, 8, 8]}
    <scale key>/znni-sha256/<bz>_<by>_<bx>.json {chunk name: sha256 of its raw bytes}, the chunks
                                                 of grid indices [b * block, (b + 1) * block)

(in a sharded layer a block is a whole number of shards' boxes of chunks, :func:`index_block`)

and a later run that reads the layer as its input compares every chunk it reads with it
(``input.checksums``). zarr arrays carry their own: the crc32c codec, which zarr-python checks
on every read (znni's zarr outputs write it per chunk).
"""

from __future__ import annotations

import json

from ..errors import DataError
from .sharding import shard_chunks
from .store import sha256

INDEX_DIR = "znni-sha256"
FORMAT = "znni-sha256/1"
BLOCK = (8, 8, 8)  # chunks per index file (z, y, x): 512 entries, about 50 KB


def _block(index, block) -> tuple:
    return tuple(int(i) // b for i, b in zip(index, block))


def index_block(layer) -> tuple:
    """Chunks per index file (z, y, x) of ``layer``: :data:`BLOCK`, or in a sharded layer its
    shards' box of chunks doubled along its shortest axes until it holds as many (a petavoxel
    run's 10^6 shards are then 10^4-odd index files, not one file per shard)."""
    if not layer.sharded:
        return BLOCK

    block = [int(v) for v in shard_chunks(layer.spec.sharding, layer.grid.grid_shape)]
    grid = [int(v) for v in layer.grid.grid_shape]
    target = BLOCK[0] * BLOCK[1] * BLOCK[2]
    while block[0] * block[1] * block[2] < target:
        grow = [a for a in range(3) if block[a] < grid[a]]
        if not grow:
            break
        a = min(grow, key=lambda a: block[a])
        block[a] *= 2
    return tuple(block)


def index_keys(layer):
    """``(key, unravel, count)``: the index block of chunk indices as one int64 per chunk
    (``key(z, y, x)`` on int arrays, C order over the blocks), its inverse, and the number of
    blocks, for a layer's :func:`index_block`."""
    block = index_block(layer)
    grid = tuple(-(-int(g) // b) for g, b in zip(layer.grid.grid_shape, block))

    def key(z, y, x):
        return ((z // block[0]) * grid[1] + y // block[1]) * grid[2] + x // block[2]

    def unravel(k: int) -> tuple:
        return (k // (grid[1] * grid[2]), k // grid[2] % grid[1], k % grid[2])

    return key, unravel, grid[0] * grid[1] * grid[2]


def write_index(layer, digests) -> int:
    """Write the sidecar index of ``layer`` (a :class:`~.precomputed.PrecomputedLayer`):
    ``digests`` is ``{chunk grid index: sha256}`` or a :class:`~znni_core.pipeline.tally.Tally`
    made with this layer's :func:`index_keys`, whose spilled digests are read back a block at a
    time (bounded memory).  The block files first, then ``index.json`` (its presence says the
    index is whole).  Returns the number of chunks indexed.  One writer: ``finalize``."""
    block = index_block(layer)
    if isinstance(digests, dict):
        blocks: dict = {}
        for idx, digest in digests.items():
            blocks.setdefault(_block(idx, block), []).append((tuple(idx), digest))
        items = sorted(blocks.items())
    else:
        _, unravel, _ = index_keys(layer)
        items = ((unravel(k), entries) for k, entries in digests.index_blocks())
    n = 0
    for b, entries in items:
        doc = {layer.chunk_name(idx): digest for idx, digest in entries}
        name = f"{layer.key}/{INDEX_DIR}/{'_'.join(map(str, b))}.json"
        layer.write_object(name, json.dumps(dict(sorted(doc.items())), indent=0).encode())
        n += len(entries)
    head = {"format": FORMAT, "block": [int(b) for b in block], "chunks": n}
    layer.write_object(f"{layer.key}/{INDEX_DIR}/index.json", json.dumps(head).encode())
    return n


class ChunkSums:
    """The sha256 a layer's sidecar index records per chunk (block files read once, on demand)."""

    def __init__(self, layer, head: dict):
        self.layer, self.block = layer, tuple(int(v) for v in head["block"])
        self._blocks: dict = {}

    @classmethod
    def of(cls, layer) -> ChunkSums | None:
        """The layer's index, or None if it has none; a malformed one is a :class:`DataError`."""
        data = layer.read_object(f"{layer.key}/{INDEX_DIR}/index.json")
        if data is None:
            return None
        try:
            head = json.loads(data)
            ok = head.get("format") == FORMAT and len(head["block"]) == 3 and all(int(v) > 0 for v in head["block"])
        except (ValueError, TypeError, KeyError, AttributeError):
            ok = False
        if not ok:
            raise DataError(f"input {layer.url}: {layer.key}/{INDEX_DIR}/index.json is not a {FORMAT} index")
        return cls(layer, head)

    def expected(self, index) -> str | None:
        """The recorded sha256 of chunk ``index``, or None if the index has no entry for it."""
        b = _block(index, self.block)
        if b not in self._blocks:
            data = self.layer.read_object(f"{self.layer.key}/{INDEX_DIR}/{'_'.join(map(str, b))}.json")
            try:
                self._blocks[b] = json.loads(data) if data is not None else {}
            except ValueError:
                raise DataError(
                    f"input {self.layer.url}: checksum index block {'_'.join(map(str, b))}.json is not JSON"
                ) from None
        return self._blocks[b].get(self.layer.chunk_name(index))

    def check(self, index, data: bytes, required: bool) -> None:
        """Compare chunk ``index``'s raw bytes with the recorded sha256: a :class:`DataError` naming
        the chunk on a mismatch, or (``required``) when none is recorded."""
        want = self.expected(index)
        name = self.layer.chunk_name(index)
        if want is None:
            if required:
                raise DataError(
                    f"input {self.layer.url} mip {self.layer.mip}: chunk {name} has no recorded sha256 "
                    "(input.checksums: required); re-finalize the run that wrote it, or set input.checksums: auto"
                )
            return
        got = sha256(data)
        if got != want:
            raise DataError(
                f"input {self.layer.url} mip {self.layer.mip}: chunk {name} changed at rest: its bytes' sha256 "
                f"{got[:16]}... differs from {want[:16]}... recorded when znni wrote it; restore the chunk or "
                "re-run the run that produced it"
            )
