"""Planning a graph network: a primitive per convolution, and the patch (docs/engine.md,
"Graph networks").

Each candidate patch is priced by the memory walk (:func:`.memory.walk`, which follows
``exec/patch.py`` node by node: skip tensors stay counted while the decoder runs) and the cost
model, every conv taking the fastest primitive (or, where that does not fit, the one needing
the least memory).  The patch is
the largest admissible one (at most the input) whose peak fits the budget; a valid
graph takes the best predicted throughput among the largest few that fit.  A padded
graph's patch also decides its blending, so it is fixed by ``patch_shape`` when given.
"""

from __future__ import annotations

import math

from ..errors import MemoryBudgetError, PlanError
from ..net.graph import Graph
from ..net.ops import StridedConv
from ..units import format_bytes
from . import memory as M
from .candidates import Candidate, ConvOption
from .plan import Plan, Rejected, chosen_plan
from .pricing import StepContext, priced_steps
from .primitives import FALLBACK, PRIMITIVES, names

BLENDS = ("bump", "gaussian", "linear")
DEFAULT_OVERLAP = 0.25  # of the patch, per axis, for padded graphs (MONAI's default)
GRAPH_PRIMITIVES = names("cpu", graph_default=True, strides=False)
SHRINK = 0.88  # each step of the patch search shrinks the longest axis to about this


def _conv_options(node, spatial, prims, timer, threads) -> list[ConvOption]:
    """The options of a conv node on one patch (the whole batch at once, no input blocks), fastest
    first: a strided conv's among the primitives that run strides, any other's among ``prims``."""
    layer = node.op.layer
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


def priced(graph: Graph, patch, prims, timer, threads: int, frugal: bool = False, tile=None):
    """(steps, predicted seconds, peak bytes) of running ``graph`` on one ``patch``, in output
    tiles of ``tile`` (exact: each tile computes every tensor over the range it needs; the walk
    follows an interior tile, the largest) or whole (``None``): every conv the fastest of
    ``prims`` (``frugal``: the one needing the least memory), the memory by :func:`.memory.walk`."""
    options = {}

    def choose(i, n, spatial, live):
        opts = _conv_options(graph.nodes[i], spatial, prims, timer, threads)
        options[i] = min(opts, key=lambda o: o.bytes) if frugal else opts[0]
        o = options[i]
        return o.primitive, o.micro_batch, o.tile, o.resident

    cpu = timer.model.device == "cpu"
    records, peak = M.walk(graph, patch, choose, threads=threads, tile=tile, host=cpu)
    out_n = graph.output_shape(patch)
    tile = tuple(min(t, o) for t, o in zip(tile or out_n, out_n))
    tiles = math.prod(-(-o // t) for o, t in zip(out_n, tile))
    steps, total = priced_steps(graph, records, StepContext(timer, threads))
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
        steps, secs, peak = priced(graph, patch, (FALLBACK,), timer, threads, True, tile)
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
    # long (one search): its candidates (patch shapes, overlaps, budget halvings) share the best plan
    # so far, the rejected list and the memory walk's cache; split, they would travel as arguments

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
        if not candidates:
            if input_shape is not None and tuple(top) == tuple(input_shape):
                candidates = [top]  # the whole input in one patch: no tile has to move on the grid
            else:
                raise PlanError(
                    f"every admissible patch of {graph.name} up to {top} gives an output smaller than the network's "
                    f"grid {graph.grid} on some axis, so tiles could not move on the grid: give an input of an "
                    f"admissible shape (e.g. {graph.ceil_admissible(top)}) to run it as one patch, or one at least "
                    f"{tuple(n + g for n, g in zip(graph.geometry.n_min, graph.grid))}"
                )
    rejected, fits, need = [], [], None
    for patch in candidates:
        for frugal in (False, True):
            steps, secs, peak = priced(graph, patch, prims, timer, threads, frugal)
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
