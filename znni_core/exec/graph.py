"""Run a graph network's plan on one input patch (``xp``: numpy or CuPy).

Nodes run in topological order; a tensor is dropped after its last reader and an
element-wise node writes into an input that dies there, exactly as the planner's walk
(``plan/graph.py``) counts them.  Convolutions reuse the chain engine's primitives
(direct GEMM, FFT with resident kernel spectra, Winograd) on the zero-padded input (Winograd
reads the zeros in place, no padded copy).  Passes are fused where a tensor has one reader: a
conv applies the activation after it (``fuses_next``), an add or affine the affine and
activation after it (``chain_after``).  A Winograd conv whose readers all run channels last
(Winograd convs, element-wise nodes, max-pooling, nearest upsampling, and so on through them:
:func:`channels_last_tensors`) writes its output channels last (``layers/layout``): no
transposes between such layers.

A patch too large for the budget runs in output **tiles** (``plan.tile``), each computing
every tensor only over the range its voxels depend on (``needed_ranges``): zero padding
is applied where a range meets the patch's border and real neighbouring values
elsewhere, so the tiles together equal the whole patch exactly (halos are recomputed).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..layers import apply_activation, arena, max_pool, tuning
from ..layers.epilogue import add_affine_act
from ..layers.layout import as_contiguous
from ..layers.resample import avg_pool, conv_transpose, interpolate, linear_index, pad, upsample_nearest
from ..layers.xp import get_array_module
from ..net.graph import Graph
from ..plan.graph import _in_range, chain_after, conv_window, fuses_next, in_place_input, needed_ranges, tile_starts
from ..plan.primitives import PRIMITIVES
from .steps import conv_fn, fuse, plan_arena, run_conv


def _take(value, lo, hi):
    """The part ``[lo, hi)`` (tensor coordinates) of a computed range ``(array, its lo)``."""
    arr, base = value
    sl = tuple(slice(a - b0, h - b0) for a, h, b0 in zip(lo, hi, base))
    if all(s.start == 0 and s.stop == n for s, n in zip(sl, arr.shape[2:])):
        return arr
    return arr[(slice(None), slice(None)) + sl]


#: nodes that keep their input's layout and run channels last at speed (``add``/``mul``: when
#: every input is channels last)
_KEEPS_LAYOUT = ("act", "affine", "add", "mul", "pool", "resize")


def channels_last_tensors(plan, graph: Graph) -> set:
    """Names of the Winograd conv outputs to write channels last (``layers/layout``).

    A tensor is channels last if a chosen conv wrote it, or a node that keeps the layout
    (:data:`_KEEPS_LAYOUT`; a max-pool, a nearest upsampling; an add or mul of channels-last
    inputs) made it from one.  A conv is chosen while every channels-last tensor that flows
    from it is read only by untiled Winograd or 1x1x1 convs and such nodes, never mixed with a
    channels-first input, and is not the network's output; the others are dropped until
    none breaks that.  A one-channel output is channels first anyway."""
    steps = plan.steps
    readers: dict = {}
    for i, node in enumerate(graph.nodes):
        for name in set(node.inputs):
            readers.setdefault(name, []).append(i)

    def keeps(node):
        return (
            node.op in _KEEPS_LAYOUT
            and (node.op != "pool" or node["kind"] == "max")
            and (node.op != "resize" or node["mode"] == "nearest")
        )

    def reads(i):  # reads a channels-last input at speed (a mixed add is checked apart)
        node, step = graph.nodes[i], steps[i]
        if node.op == "conv":  # Winograd, or a 1x1x1 conv (conv_pointwise_chain reads it in place)
            prim = PRIMITIVES.get(step.primitive)
            return (
                prim is not None
                and prim.reads_channels_last(node.conv.kernel)
                and not step.tile
                and not step.micro_batch
            )
        return keeps(node)

    chosen = {
        node.output
        for node, step in zip(graph.nodes, steps)
        if node.op == "conv"
        and getattr(PRIMITIVES.get(step.primitive), "writes_channels_last", False)
        and not step.tile
        and not step.micro_batch
        and node.conv.out_channels > 1
    }
    while True:
        sources: dict = {}  # channels-last tensor -> the chosen convs it flows from
        for node in graph.nodes:
            if node.op == "conv":
                if node.output in chosen:
                    sources[node.output] = {node.output}
            elif keeps(node):
                ins = [sources.get(i) for i in node.inputs]
                if all(v is not None for v in ins):
                    sources[node.output] = set().union(*ins)
        drop = set()
        for name, src in sources.items():
            bad = name == graph.output or not all(reads(i) for i in readers.get(name, ()))
            bad = bad or any(
                graph.nodes[i].op in ("add", "mul") and graph.nodes[i].output not in sources
                for i in readers.get(name, ())
            )  # mixed with a channels-first input
            if bad:
                drop |= src
        if not drop:
            return chosen
        chosen -= drop


def _node(step, node, env, a, b, shapes, out, xp, convs, cl=False):
    """``node``'s output over ``[a, b)``; ``out`` is an input array to overwrite (or None);
    ``cl``: a Winograd conv writes it channels last."""
    op = node.op
    name = node.inputs[0]
    n_in = shapes[name][1:]
    if op == "conv":
        raw_lo, raw_hi = conv_window(node, a, b)
        clip_lo = tuple(max(0, v) for v in raw_lo)
        clip_hi = tuple(min(n, v) for n, v in zip(n_in, raw_hi))
        x = _take(env[name], clip_lo, clip_hi)
        low = tuple(c - r for c, r in zip(clip_lo, raw_lo))
        high = tuple(r - c for c, r in zip(clip_hi, raw_hi))
        pads_input = getattr(PRIMITIVES.get(step.primitive), "pads_input", False)
        if (any(low) or any(high)) and pads_input and not step.tile and get_array_module(x) is xp:
            # zeros read in place of the padding: no padded copy
            spatial = tuple(r1 - r0 for r0, r1 in zip(raw_lo, raw_hi))
            return conv_fn(step, node.layer, spatial, xp, convs, cl)(as_contiguous(x), low=low)
        x = pad(x, low, high) if any(low) or any(high) else as_contiguous(x)
        return run_conv(step, node.layer, x, xp, convs, channels_last=cl)
    r = [_in_range(node, ax, a[ax], b[ax], n_in[ax]) for ax in range(3)]
    lo, hi = tuple(v[0] for v in r), tuple(v[1] for v in r)
    if op in ("deconv", "resize"):
        x = _take(env[name], lo, hi)
        if op == "resize" and node["mode"] == "linear":
            tables = []
            for ax, f in enumerate(node["scale"]):
                if f == 1:
                    tables.append(None)
                    continue
                i0, i1, w = linear_index(n_in[ax], f, node["coord"])
                tables.append((i0[a[ax] : b[ax]] - lo[ax], i1[a[ax] : b[ax]] - lo[ax], w[a[ax] : b[ax]]))
            return interpolate(xp.ascontiguousarray(x), tables)
        f = node["stride" if op == "deconv" else "scale"]
        y = (
            conv_transpose(
                xp.ascontiguousarray(x),
                xp.asarray(node["weight"]),
                None if node["bias"] is None else xp.asarray(node["bias"]),
                f,
            )
            if op == "deconv"
            else upsample_nearest(x, f)
        )
        sl = tuple(slice(s - l * ff, s - l * ff + (e - s)) for s, e, l, ff in zip(a, b, lo, f))
        return (
            y
            if all(s.start == 0 and s.stop == n for s, n in zip(sl, y.shape[2:]))
            else as_contiguous(y[(slice(None), slice(None)) + sl])
        )
    if op == "pool":
        x = _take(env[name], lo, hi)
        return max_pool(x, node["window"]) if node["kind"] == "max" else avg_pool(x, node["window"])
    if op == "crop":
        return xp.ascontiguousarray(_take(env[name], lo, hi))
    if op == "pad":
        raw_lo = tuple(v - p for v, p in zip(a, node["low"]))
        raw_hi = tuple(v - p for v, p in zip(b, node["low"]))
        return pad(
            _take(env[name], lo, hi),
            tuple(c - r for c, r in zip(lo, raw_lo)),
            tuple(r - c for c, r in zip(hi, raw_hi)),
            node["value"],
        )
    ins = [_take(env[i], a, b) for i in node.inputs]
    if op == "concat":
        return xp.concatenate(ins, axis=1)
    x = ins[0]
    if op == "act":
        act = node["act"]
        if act.kind == "identity":
            return x if out is not None else x.copy()
        return apply_activation(x, act.kind, act.alpha, out=x if out is not None else None)
    if op == "affine":
        s = xp.asarray(node["scale"]).reshape(1, -1, 1, 1, 1)
        t = xp.asarray(node["shift"]).reshape(1, -1, 1, 1, 1)
        if out is None:
            return x * s + t
        x *= s
        x += t
        return x
    if op in ("add", "mul"):
        ufunc = xp.add if op == "add" else xp.multiply
        if out is None:
            return ufunc(ins[0], ins[1])
        target = env[out][0]
        other = ins[1] if target is ins[0] else ins[0]
        return ufunc(target, other, out=target)
    raise PlanError(f"{node.name}: no executor for operator {op!r}")


def _chain(node, followers, env, a, b, out):
    """An add or affine node and the affine and activation after it (:func:`chain_after`) in
    one pass; ``out``: the input to overwrite, or None."""
    ins = [_take(env[i], a, b) for i in node.inputs]
    affine = node if node.op == "affine" else next((f for f in followers if f.op == "affine"), None)
    act = next((f["act"] for f in followers if f.op == "act"), None)
    return add_affine_act(
        ins[0],
        ins[1] if node.op == "add" else None,
        None if affine is None else affine["scale"],
        None if affine is None else affine["shift"],
        None if act is None else (act.kind, act.alpha),
        out=None if out is None else env[out][0],
    )


def _run_range(plan, graph: Graph, x, shapes, lo, hi, xp, convs):
    """Output voxels ``[lo, hi)`` of the patch ``x`` (1, C, n): every tensor over its range.
    A conv applies the activation after it in its output pass where :func:`fuses_next`."""
    need = needed_ranges(graph, shapes, lo, hi)
    remaining = graph.consumers()
    fused = {i for i, s in enumerate(plan.steps) if fuses_next(graph, i, s.primitive, remaining)}
    chains = {i: c for i in range(len(graph.nodes)) if (c := chain_after(graph, i, remaining))} if xp is np else {}
    skip = {i + 1 for i in fused} | {j for c in chains.values() for j in c}
    whole = not any(lo) and tuple(hi) == tuple(shapes[graph.output][1:])  # tiles read parts: not there
    cl = channels_last_tensors(plan, graph) if xp is np and whole else set()
    rlo, rhi = need[graph.input]
    env = {graph.input: (x[(slice(None), slice(None)) + tuple(slice(a, b) for a, b in zip(rlo, rhi))], rlo)}
    for i, (step, node) in enumerate(zip(plan.steps, graph.nodes)):
        if node.output in need:
            target = in_place_input(node, remaining, need, graph.input)
            a, b = need[node.output]
            if i in skip:  # the conv or element-wise node before applied it
                y = env[node.inputs[0]][0]
            elif i in chains:
                y = _chain(node, [graph.nodes[j] for j in chains[i]], env, a, b, target)
            else:
                y = _node(
                    fuse(step, graph.nodes[i + 1]["act"]) if i in fused else step,
                    node,
                    env,
                    a,
                    b,
                    shapes,
                    target,
                    xp,
                    convs,
                    node.output in cl,
                )
            env[node.output] = (y, a)
            del y
        for name in node.inputs:
            remaining[name] -= 1
        for name in set(node.inputs):
            if remaining[name] == 0:
                env.pop(name, None)
    return env.pop(graph.output)[0]


def run_graph_patch(plan, graph: Graph, x, *, xp=np, convs=None):
    """The network's output ``(C_out, n - context)`` on one admissible patch ``(C, n)``,
    whole or in the plan's exact output tiles."""
    if plan.network_digest != graph.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")
    if len(plan.steps) != len(graph.nodes):
        raise PlanError(f"the plan has {len(plan.steps)} steps for {len(graph.nodes)} nodes; re-run `znni plan`")
    convs = {} if convs is None else convs
    tuning.apply(plan.tuning)
    with arena.using(plan_arena(plan, convs, xp)):
        return _run_graph_patch(plan, graph, x, xp, convs)


def _run_graph_patch(plan, graph, x, xp, convs):
    shapes = graph.shapes(tuple(x.shape[1:]))  # names the node when the patch is not admissible
    out_n = shapes[graph.output][1:]
    tile = tuple(min(t, o) for t, o in zip(plan.tile or out_n, out_n))
    if tile == out_n:
        return _run_range(plan, graph, x[None], shapes, (0, 0, 0), out_n, xp, convs)[0]
    result = xp.empty((graph.out_channels,) + tuple(out_n), dtype=np.float32)
    for lo in tile_starts(out_n, tile):
        hi = tuple(min(a + t, o) for a, t, o in zip(lo, tile, out_n))
        y = _run_range(plan, graph, x[None], shapes, lo, hi, xp, convs)
        result[(slice(None),) + tuple(slice(a, b) for a, b in zip(lo, hi))] = y[0]
        del y
    return result
