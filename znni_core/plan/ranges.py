"""Which part of each tensor a graph's output voxels depend on: exact output tiles.

A patch too large for the budget runs in output tiles, each computing every tensor only over the
range its voxels depend on (:func:`needed_ranges`, walking the graph backwards through padding,
strides, crops and the linear-resize index tables), so halos are recomputed and the tiles join
into exactly the whole patch's output.  The executor computes those ranges; the memory walk
counts them.
"""

from __future__ import annotations

import itertools

from ..layers.resample import linear_index
from ..net.graph import Graph


def in_range(node, axis: int, a: int, b: int, n_in: int) -> tuple[int, int]:
    """Input voxels ``[lo, hi)`` on ``axis`` that ``node``'s output voxels ``[a, b)`` read
    (zero padding and clamping supply the rest)."""
    op = node.op
    if op == "conv":
        k, s, pl = node.conv.kernel[axis], node["stride"][axis], node["pads"][0][axis]
        return max(0, a * s - pl), min(n_in, (b - 1) * s - pl + k)
    if op == "pool":
        p = node["window"][axis]
        return a * p, b * p
    if op == "resize" and node["mode"] == "linear" and node["scale"][axis] > 1:
        i0, i1, _ = linear_index(n_in, node["scale"][axis], node["coord"])
        return int(i0[a]), int(i1[b - 1]) + 1
    if op in ("deconv", "resize"):
        f = node["stride" if op == "deconv" else "scale"][axis]
        return a // f, -(-b // f)
    if op == "crop":
        return a + node["low"][axis], b + node["low"][axis]
    if op == "pad":
        return max(0, a - node["low"][axis]), min(n_in, b - node["low"][axis])
    return a, b


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
            r = [in_range(node, ax, a[ax], b[ax], n_in[ax]) for ax in range(3)]
            rlo, rhi = tuple(v[0] for v in r), tuple(v[1] for v in r)
            if name in need:
                rlo = tuple(map(min, rlo, need[name][0]))
                rhi = tuple(map(max, rhi, need[name][1]))
            need[name] = (rlo, rhi)
    return need


def conv_window(node, a, b):
    """Per axis (raw lo, raw hi): the zero-padded input a conv's output ``[a, b)`` reads."""
    k, s, pl = node.conv.kernel, node["stride"], node["pads"][0]
    return (
        tuple(x * st - p for x, st, p in zip(a, s, pl)),
        tuple((y - 1) * st - p + kk for y, st, p, kk in zip(b, s, pl, k)),
    )


def tile_starts(out, tile) -> list[tuple]:
    """The origins (z, y, x) of the output tiles of shape ``tile`` covering ``out``, in C order."""
    return list(itertools.product(*(range(0, o, t) for o, t in zip(out, tile))))
