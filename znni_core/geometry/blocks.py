"""Covering a range with equal blocks, the last one shifted back (never padded).

Used by the tiler (patches of a plan over an input) and by blocked convolution
(overlap-save: a conv layer run on input blocks, each giving an output block)::

    output   |<------------------- total ------------------->|
             |<- b ->|<- b ->|<- b ->|        |<- b ->|
             0       b       2b              total-b          the last block overlaps the one before
"""

from __future__ import annotations

import functools
import itertools


def block_starts(total: int, block: int) -> list[int]:
    """Start offsets of blocks of size ``block`` covering ``[0, total)``; the last is shifted back.

    >>> block_starts(10, 4)
    [0, 4, 6]
    """
    if total <= block:
        return [0]
    starts = list(range(0, total - block, block))
    starts.append(total - block)
    return starts


@functools.lru_cache(maxsize=65536)
def _conv_blocks(spatial: tuple, kernel: tuple, tile: tuple) -> tuple[tuple, tuple]:
    tile = tuple(min(int(t), int(s)) for t, s in zip(tile or spatial, spatial))
    outs = [int(s) - int(k) + 1 for s, k in zip(spatial, kernel)]
    obl = [t - int(k) + 1 for t, k in zip(tile, kernel)]
    return tile, tuple(itertools.product(*(block_starts(o, b) for o, b in zip(outs, obl))))


def conv_blocks(spatial, kernel, tile=None) -> tuple[tuple, list[tuple]]:
    """Input block shape and block origins of a valid convolution run block by block.

    Blocks of input ``tile`` (clipped to ``spatial``) give outputs ``tile - k + 1`` that
    cover the output ``spatial - k + 1``; an empty ``tile`` means one block, the whole input.

    >>> conv_blocks((10, 10, 10), (3, 3, 3), (6, 10, 10))
    ((6, 10, 10), [(0, 0, 0), (4, 0, 0)])
    """
    tile, origins = _conv_blocks(tuple(int(v) for v in spatial), tuple(int(v) for v in kernel), tuple(tile or ()))
    return tile, list(origins)
