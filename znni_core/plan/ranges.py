"""Which part of each tensor a graph's output voxels depend on: exact output tiles.

A patch too large for the budget runs in output tiles, each computing every tensor only over the
range its voxels depend on (:func:`needed_ranges`, walking the graph backwards through padding,
strides, crops and the linear-resize index tables: each operator's ``in_range``), so halos are recomputed and the tiles join
into exactly the whole patch's output.  The executor computes those ranges; the memory walk
counts them.
"""

from __future__ import annotations

import itertools

from ..net.graph import Graph


def needed_ranges(graph: Graph, shapes: dict, lo, hi) -> dict:
    """``{tensor: (lo, hi)}``: the part of every tensor that the output voxels ``[lo, hi)``
    depend on (the union over its readers), for a patch whose tensors have ``shapes``.
    Computing each tensor over its range gives exactly the whole patch's values there."""
    need = {graph.output: (tuple(lo), tuple(hi))}
    for node in reversed(graph.nodes):
        if node.output not in need:
            continue
        a, b = need[node.output]
        for name in node.inputs:
            n_in = shapes[name][1:]
            r = [node.op.in_range(ax, a[ax], b[ax], n_in[ax]) for ax in range(3)]
            rlo, rhi = tuple(v[0] for v in r), tuple(v[1] for v in r)
            if name in need:
                rlo = tuple(map(min, rlo, need[name][0]))
                rhi = tuple(map(max, rhi, need[name][1]))
            need[name] = (rlo, rhi)
    return need


def tile_starts(out, tile) -> list[tuple]:
    """The origins (z, y, x) of the output tiles of shape ``tile`` covering ``out``, in C order."""
    return list(itertools.product(*(range(0, o, t) for o, t in zip(out, tile))))
