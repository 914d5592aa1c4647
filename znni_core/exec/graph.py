"""Run a graph network's plan on one input patch (``xp``: numpy or CuPy).

Nodes run in topological order; a tensor is dropped after its last reader and an
element-wise node writes into an input that dies there, exactly as the planner's walk
(``plan/graph.py``) counts them.  Convolutions reuse the chain engine's primitives
(direct GEMM, FFT with resident kernel spectra) on the zero-padded input.
"""
from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..layers import apply_activation, max_pool
from ..layers.resample import avg_pool, conv_strided, conv_transpose, pad, upsample_linear, upsample_nearest
from ..net.graph import Graph
from ..plan.graph import in_place_input
from .engine import _run_conv


def _const(xp, v):
    return v if xp is np else xp.asarray(v)


def _node(step, node, ins, out, xp, convs):
    """Output of ``node`` on input arrays ``ins``; ``out`` is an input to overwrite (or None)."""
    x = ins[0]
    op = node.op
    if op == "conv":
        lo, hi = node["pads"]
        if any(lo) or any(hi):
            x = pad(x, lo, hi)
        if step.primitive == "strided":
            return conv_strided(x, _const(xp, node.conv.weight), None if node.conv.bias is None else
                                _const(xp, node.conv.bias), node["stride"])
        return _run_conv(step, node.conv, x, xp, convs)
    if op == "deconv":
        return conv_transpose(x, _const(xp, node["weight"]), _const(xp, node["bias"]), node["stride"])
    if op == "pool":
        return max_pool(x, node["window"]) if node["kind"] == "max" else avg_pool(x, node["window"])
    if op == "resize":
        if node["mode"] == "nearest":
            return upsample_nearest(x, node["scale"])
        return upsample_linear(x, node["scale"], node["coord"])
    if op == "crop":
        lo, hi = node["low"], node["high"]
        sl = tuple(slice(a, n - b) for a, b, n in zip(lo, hi, x.shape[2:]))
        return xp.ascontiguousarray(x[(slice(None), slice(None)) + sl])
    if op == "pad":
        return pad(x, node["low"], node["high"], node["value"])
    if op == "concat":
        return xp.concatenate(ins, axis=1)
    if op == "act":
        a = node["act"]
        if a.kind == "identity":
            return x if out is not None else x.copy()
        return apply_activation(x, a.kind, a.alpha, out=x if out is not None else None)
    if op == "affine":
        s = _const(xp, node["scale"]).reshape(1, -1, 1, 1, 1)
        t = _const(xp, node["shift"]).reshape(1, -1, 1, 1, 1)
        if out is None:
            return x * s + t
        x *= s
        x += t
        return x
    if op in ("add", "mul"):
        ufunc = xp.add if op == "add" else xp.multiply
        if out is None:
            return ufunc(ins[0], ins[1])
        other = ins[1] if out is ins[0] else ins[0]
        return ufunc(out, other, out=out)
    raise PlanError(f"{node.name}: no executor for operator {op!r}")


def run_graph_patch(plan, graph: Graph, x, *, xp=np, convs=None):
    """The network's output ``(C_out, n - context)`` on one admissible patch ``(C, n)``."""
    if plan.network_digest != graph.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")
    if len(plan.steps) != len(graph.nodes):
        raise PlanError(f"the plan has {len(plan.steps)} steps for {len(graph.nodes)} nodes; re-run `znni plan`")
    convs = {} if convs is None else convs
    shapes = graph.shapes(tuple(x.shape[1:]))  # names the node when the patch is not admissible
    remaining = graph.consumers()
    env = {graph.input: x[None]}
    for step, node in zip(plan.steps, graph.nodes):
        target = in_place_input(node, remaining, shapes, graph.input)
        ins = [env[i] for i in node.inputs]
        y = _node(step, node, ins, env[target] if target else None, xp, convs)
        del ins
        for name in node.inputs:
            remaining[name] -= 1
        for name in set(node.inputs):
            if remaining[name] == 0:
                del env[name]
        env[node.output] = y
        del y
    y = env.pop(graph.output)
    want = (graph.out_channels,) + graph.output_shape(x.shape[1:])
    if tuple(y.shape[1:]) != want:
        raise PlanError(f"graph output has shape {tuple(y.shape[1:])}, expected {want}")
    return y[0]
