"""Planning a graph network: a memory walk with liveness, a primitive per convolution,
and the patch (docs/engine.md, "Graph networks").

The walk follows ``exec/patch.py`` node by node in topological order: a tensor is alive
from the node that writes it to its last reader (skip tensors stay counted while the
decoder runs), element-wise nodes write into an input that dies there
(:func:`in_place_input`), and each node adds its own output and workspace.  The patch is
the largest admissible one (at most the input) whose peak fits the budget; a valid
graph takes the best predicted throughput among the largest few that fit.  A padded
graph's patch also decides its blending, so it is fixed by ``patch_shape`` when given.
"""

from __future__ import annotations

import itertools
import math

from ..errors import MemoryBudgetError, PlanError
from ..layers.epilogue import FUSABLE
from ..layers.resample import linear_index
from ..net.graph import Graph, StridedConv
from ..units import format_bytes
from . import memory as M
from .candidates import Candidate, ConvOption
from .plan import Plan, Rejected, Step, chosen_plan, fuses
from .primitives import FALLBACK, PRIMITIVES, names

ELEMENTWISE = ("add", "mul", "affine", "act")
BLENDS = ("bump", "gaussian", "linear")
DEFAULT_OVERLAP = 0.25  # of the patch, per axis, for padded graphs (MONAI's default)
GRAPH_PRIMITIVES = names("cpu", graph_default=True, strides=False)
SHRINK = 0.88  # each step of the patch search shrinks the longest axis to about this


def in_place_input(node, remaining: dict, need: dict, graph_input: str):
    """The input an element-wise node overwrites: one it is the last reader of, not the
    caller's array, computed over exactly the output's range (None: a new array)."""
    if node.op not in ELEMENTWISE:
        return None
    for name in dict.fromkeys(node.inputs):
        if name != graph_input and remaining[name] == node.inputs.count(name) and need[name] == need[node.output]:
            return name
    return None


def fuses_next(graph: Graph, i: int, primitive: str, consumers: dict) -> bool:
    """Whether conv node ``i`` (run by ``primitive``) applies node ``i + 1`` in its output
    pass: an activation of ``FUSABLE`` that is the conv output's only reader (the executor
    then skips it; the walk charges it nothing)."""
    nodes = graph.nodes
    if i + 1 >= len(nodes) or nodes[i].op != "conv" or nodes[i + 1].op != "act":
        return False
    nxt = nodes[i + 1]
    return fuses(primitive, nxt["act"].kind) and nxt.inputs == (nodes[i].output,) and consumers[nodes[i].output] == 1


def chain_after(graph: Graph, i: int, consumers: dict) -> list[int]:
    """The nodes that element-wise node ``i`` (an add of two tensors or an affine) runs in its
    own pass (``layers.epilogue.add_affine_act``): an affine (after an add), then an
    activation of ``FUSABLE``, each the only reader of the one before (the executor skips
    them; the walk charges them nothing).  Empty when nothing follows that way."""
    nodes = graph.nodes
    if nodes[i].op not in ("add", "affine") or (nodes[i].op == "add" and len(nodes[i].inputs) != 2):
        return []
    out, allowed = [], (("affine", "act") if nodes[i].op == "add" else ("act",))
    for j in range(i + 1, len(nodes)):
        prev, nxt = nodes[j - 1], nodes[j]
        if (
            nxt.op not in allowed
            or nxt.inputs != (prev.output,)
            or consumers[prev.output] != 1
            or (nxt.op == "act" and nxt["act"].kind not in FUSABLE)
        ):
            break
        out.append(j)
        allowed = allowed[allowed.index(nxt.op) + 1 :]
    return out


def _in_range(node, axis: int, a: int, b: int, n_in: int) -> tuple[int, int]:
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
            r = [_in_range(node, ax, a[ax], b[ax], n_in[ax]) for ax in range(3)]
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


def _conv_options(node, spatial, prims, timer, threads) -> list[ConvOption]:
    """The options of a conv node on one patch (the whole batch at once, no input blocks), fastest
    first: a strided conv's among the primitives that run strides, any other's among ``prims``."""
    layer = node.layer
    if isinstance(layer, StridedConv):
        usable = list(names(timer.model.device, strides=True))
    else:
        pointwise = all(k == 1 for k in layer.kernel)
        usable = [
            p
            for p in prims
            if not PRIMITIVES[p].strides
            and PRIMITIVES[p].supports(layer.kernel, (layer.in_channels, layer.out_channels))
            and (PRIMITIVES[p].runs_1x1x1 or not pointwise)
        ] or [FALLBACK]
    opts = []
    for prim in usable:
        t = timer.layer(prim, 1, layer, spatial, 0, 1)
        keep = M.resident_bytes(prim, layer, spatial)
        opts.append(ConvOption(t, prim, 0, (), M.conv_step_bytes(prim, 1, 0, layer, spatial, (), threads) + keep, keep))
    return sorted(opts, key=lambda o: (o.seconds, o.primitive))


def walk(graph: Graph, patch, prims, timer, threads: int, frugal: bool = False, tile=None):
    """(steps, predicted seconds, peak bytes) of running ``graph`` on one ``patch``, in
    output tiles of ``tile`` (exact: each tile computes every tensor over the range it
    needs; the walk follows an interior tile, the largest) or whole (``None``)."""
    shapes = graph.shapes(patch)
    out_n = shapes[graph.output][1:]
    tile = tuple(min(t, o) for t, o in zip(tile or out_n, out_n))
    lo = tuple((o - t) // 2 for o, t in zip(out_n, tile))
    need = needed_ranges(graph, shapes, lo, tuple(a + t for a, t in zip(lo, tile)))
    size = {k: (shapes[k][0],) + tuple(b - a for a, b in zip(*r)) for k, r in need.items()}
    tiles = math.prod(-(-o // t) for o, t in zip(out_n, tile))
    cal, model = timer.cal, timer.model
    remaining = graph.consumers()
    live = {graph.input: M.nbytes(shapes[graph.input])}  # the caller's whole patch
    resident = 0
    peak, total, steps = 0, 0.0, []
    consumers, fused, skip = graph.consumers(), False, set()
    for i, node in enumerate(graph.nodes):
        if node.output not in need:  # does not reach the output
            for name in node.inputs:
                remaining[name] -= 1
            continue
        src = size[node.inputs[0]]
        out = size[node.output]
        out_b = M.nbytes(out)
        prim, secs, extra = node.op, 0.0, out_b
        if node.op == "conv":
            raw_lo, raw_hi = conv_window(node, *need[node.output])
            spatial = tuple(b - a for a, b in zip(raw_lo, raw_hi))
            copy = spatial != src[1:] or need[node.inputs[0]][0] != raw_lo
            pad_b = M.nbytes((src[0],) + spatial) if copy else 0
            opts = _conv_options(node, spatial, prims, timer, threads)
            if frugal:
                opts = sorted(opts, key=lambda o: o.bytes)
            secs, prim, res_b = opts[0].seconds, opts[0].primitive, opts[0].resident
            step_b = opts[0].bytes - res_b
            if getattr(
                PRIMITIVES.get(prim), "pads_input", False
            ):  # no padded copy: a copy of the input's part only where it is one
                n_in = shapes[node.inputs[0]][1:]
                part = tuple(min(n, h) - max(0, l) for n, l, h in zip(n_in, raw_lo, raw_hi))
                pad_b = M.nbytes((src[0],) + part) if part != src[1:] else 0
            resident += res_b
            extra = pad_b + step_b
            secs += model.elementwise(pad_b, 2.0) if pad_b else 0.0
        elif node.op == "deconv":
            flops = 2.0 * math.prod(src) * out[0] * math.prod(node["stride"])
            secs = flops / cal.gemm_flops + model.elementwise(out_b, 3.0)
            extra, prim = 2 * out_b, "gemm"
        elif node.op == "resize":
            prim = node["mode"]
            extra = out_b * (3 if prim == "linear" else 1)
            secs = model.elementwise(out_b, 4.0 if prim == "linear" else 2.0)
        else:
            target = in_place_input(node, remaining, need, graph.input)
            secs = model.elementwise(M.nbytes(src) + out_b, 1.0)
            if fused or i in skip:  # applied in the pass of the conv or element-wise node before
                prim, extra, secs = node["act"].kind if node.op == "act" else node.op, 0, 0.0
            elif node.op == "act":
                prim = node["act"].kind
                extra = M.act_extra_bytes(prim, (1,) + out) + (0 if target else out_b)
                secs = model.activation(prim, out_b)
            elif node.op == "pool":
                prim = node["kind"]
            elif target:
                extra = 0
            if model.device == "cpu":  # the CPU executor runs the chain in one pass (exec/patch.py)
                skip.update(chain_after(graph, i, consumers))
        here = sum(live.values()) + resident + extra
        peak = max(peak, here)
        total += secs
        steps.append(Step(i, node.op, prim, (1,) + src, (1,) + out, 0, threads, secs, int(here)))
        fused = fuses_next(graph, i, prim, consumers)
        for name in node.inputs:
            remaining[name] -= 1
        live[node.output] = out_b
        for name in set(node.inputs):
            if remaining[name] == 0:
                live.pop(name, None)
    total += len(graph.nodes) * 2e-5  # Python and dispatch per node
    return steps, total * tiles, peak


def _shrink(graph: Graph, patch) -> tuple | None:
    """The next smaller admissible patch: the longest axis (relative to its minimum) cut by ~12%."""
    n_min = graph.geometry.n_min
    order = sorted(range(3), key=lambda a: -(patch[a] - n_min[a]) / graph.grid[a])
    for a in order:
        if patch[a] <= n_min[a]:
            continue
        want = max(n_min[a], int(patch[a] * SHRINK))
        lo, _ = graph.admissible_around(a, want)
        lo = min(lo or n_min[a], patch[a] - graph.grid[a])
        if lo >= n_min[a]:
            return tuple(lo if i == a else p for i, p in enumerate(patch))
    return None


def default_overlap(graph: Graph, patch, input_shape, fraction: float = DEFAULT_OVERLAP) -> tuple:
    """Blending overlap per axis: ``fraction`` of the patch output, 0 where one patch covers the input."""
    out = graph.output_shape(patch)
    full = graph.output_shape(graph.ceil_admissible(input_shape)) if input_shape else (None,) * 3
    return tuple(0 if f is not None and o >= f else int(round(o * fraction)) for o, f in zip(out, full))


def _tile_search(graph: Graph, patch, prims, timer, threads, budget, rejected):
    """Exact output tiles for a patch whose whole walk does not fit: the longest tile axis cut
    by about 12% at a time until an interior tile fits.  (steps, seconds, peak, tile) or None."""
    out = graph.output_shape(patch)
    tile = tuple(out)
    while True:
        steps, secs, peak = walk(graph, patch, (FALLBACK,), timer, threads, True, tile)
        if peak <= budget:
            return steps, secs, peak, tile
        rejected.append(
            Rejected(f"patch {patch} in tiles {tile}", f"needs {format_bytes(peak)} > budget {format_bytes(budget)}")
        )
        a = max(range(3), key=lambda i: tile[i])
        if tile[a] <= 2:
            return None
        tile = tuple(max(1, int(t * SHRINK)) if i == a else t for i, t in enumerate(tile))


def autotune_graph(
    graph: Graph,
    *,
    budget: int,
    device: str,
    effort: str,
    threads: int,
    timer,
    prims=None,
    patch_shape=None,
    input_shape=None,
    overlap=None,
    blend: str = "bump",
) -> Plan:
    """The plan of a graph network.  A valid graph: the admissible patch (at most the input)
    with the best predicted throughput among the largest that fit.  A padded graph: the patch
    decides the blending, so it is ``patch_shape``, else the whole input (one patch: exactly the
    network on it), else the shape the file was exported at; the budget never changes it: a
    patch that does not fit whole runs in exact output tiles."""

    prims = tuple(p for p in (prims or GRAPH_PRIMITIVES) if p in PRIMITIVES and PRIMITIVES[p].in_graphs) or (FALLBACK,)
    if blend not in BLENDS:
        raise PlanError(f"blend {blend!r} is not one of {BLENDS}")
    tile = ()
    if patch_shape is not None:
        patch_shape = tuple(int(v) for v in patch_shape)
        graph.shapes(patch_shape)  # names the node and the admissible lengths when not admissible
        if graph.kind == "valid" and any(o < g for o, g in zip(graph.output_shape(patch_shape), graph.grid)):
            raise PlanError(
                f"patch {patch_shape} gives an output {graph.output_shape(patch_shape)} smaller than "
                f"the grid {graph.grid}; tiles could not move on the grid"
            )
        candidates = [patch_shape]
    elif graph.kind == "padded":
        if input_shape is not None:
            top = graph.ceil_admissible(input_shape)
        elif graph.export_shape and graph.is_admissible(graph.export_shape):
            top = tuple(graph.export_shape)
        else:
            top = graph.ceil_admissible(tuple(max(m, 64) for m in graph.geometry.n_min))
        candidates = [top]
    else:
        if input_shape is not None:
            top = graph.floor_admissible(input_shape)
            if not all(top):
                raise PlanError(
                    f"input shape {tuple(input_shape)} is smaller than the smallest admissible "
                    f"input {graph.geometry.n_min} of this network"
                )
        else:
            edge = round(M.MAX_PATCH_VOXELS ** (1 / 3) / 2)
            top = graph.floor_admissible(tuple(max(m, edge) for m in graph.geometry.n_min))
        while math.prod(top) > M.MAX_PATCH_VOXELS and (nxt := _shrink(graph, top)):
            top = nxt
        candidates, p = [], top
        while p is not None:
            if all(o >= g for o, g in zip(graph.output_shape(p), graph.grid)):
                candidates.append(p)
            p = _shrink(graph, p)
    rejected, fits, need = [], [], None
    for patch in candidates:
        for frugal in (False, True):
            steps, secs, peak = walk(graph, patch, prims, timer, threads, frugal)
            vps = math.prod(graph.output_shape(patch)) / secs
            if peak <= budget:
                fits.append(Candidate(vps, patch, (), steps, secs, peak, [], "", 0))
                break
            need = peak if need is None else min(need, peak)
            rejected.append(
                Rejected(
                    f"patch {patch}{' frugal' if frugal else ''}",
                    f"needs {format_bytes(peak)} > budget {format_bytes(budget)}",
                    vps,
                )
            )
        if fits and len(fits) >= 4:  # a valid graph's throughput is compared over the largest few that fit
            break
    if not fits and graph.kind == "padded" or (patch_shape is not None and not fits):
        found = _tile_search(graph, candidates[0], prims, timer, threads, budget, rejected)
        if found is not None:
            steps, secs, peak, tile = found
            vps = math.prod(graph.output_shape(candidates[0])) / secs
            fits.append(Candidate(vps, candidates[0], (), steps, secs, peak, [], "", 0))
    if not fits:
        raise MemoryBudgetError(
            f"no patch of {graph.name} fits the memory budget of {format_bytes(budget)}: the smallest tried, "
            f"{candidates[-1]}, needs {format_bytes(need or 0)} whole and more than the budget in the smallest exact tiles. "
            f"Raise the budget (--memory / mem_mb) to at least {format_bytes((need or 0) * 1.1)}"
        )
    fits.sort(key=lambda r: -r.voxels_per_s)
    best = fits[0]
    vps, patch, steps, secs, peak = best.voxels_per_s, best.patch, best.steps, best.seconds, best.peak
    for r in fits[1:]:
        rejected.append(
            Rejected(f"patch {r.patch}", f"slower: {r.voxels_per_s:,.0f} < {vps:,.0f} voxels/s", r.voxels_per_s)
        )
    if graph.kind == "padded":
        ov = tuple(int(v) for v in overlap) if overlap is not None else default_overlap(graph, patch, input_shape)
        out = graph.output_shape(patch)
        if len(ov) != 3 or any(o < 0 or o >= t for o, t in zip(ov, out)):
            raise PlanError(f"overlap {ov} must be 3 values in [0, patch output {out})")
    else:
        ov, blend = (0, 0, 0), ""
    return chosen_plan(
        graph,
        patch=patch,
        device=device,
        effort=effort,
        threads=threads,
        candidates=len(fits) + len(rejected),
        input_shape=input_shape,
        provenance={"grid": graph.grid},
        memory_budget=budget,
        steps=tuple(steps),
        predicted_seconds=secs,
        predicted_peak_bytes=int(peak),
        rejected=tuple(rejected[:50]),
        kind=graph.kind,
        overlap=ov,
        blend=blend,
        tile=tile,
    )
