"""Run a chain network's :class:`~znni_core.plan.Plan` on one input patch.

The executor follows the plan literally: per layer the chosen primitive, per pooling
layer either MPF (all fragments batched, breadth first) or ``pool`` (one pooling
offset at a time through the rest of the network, depth first: less memory, same
result), conv layers in micro-batches of fragments.  It never does IO.

Memory discipline matters: the planner's memory model (``plan/memory.py``) simulates
exactly this code, so references to dead arrays are dropped as soon as possible.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import numpy as np

from ..errors import PlanError
from ..layers import (
    apply_activation,
    arena,
    conv_pointwise_chain,
    gather_fragment,
    max_filter_inplace,
    max_pool,
    mpf,
    recombine,
    tuning,
)
from ..layers.activation import commutes_with_max
from ..layers.xp import get_array_module
from ..net.chain import Pool
from ..net.graph import Graph
from ..plan.memory import slab_geometry
from ..plan.plan import fuses
from ..plan.primitives import primitive
from .steps import fuse, fused_act, plan_arena, run_conv


def _fragment(x, window, offset):
    """The pooled fragment at ``offset``: one slice of :func:`mpf`'s batch."""
    m = [(n - p + 1) // p for n, p in zip(x.shape[2:], window)]
    sl = tuple(slice(o, o + k * p) for o, k, p in zip(offset, m, window))
    return max_pool(x[(slice(None), slice(None)) + sl], window)


def _gather(n, offsets, run_offset, xp):
    """Run every pooling offset through the rest; interleave as MPF would (old batch major)."""
    out = None
    for k, off in enumerate(offsets):
        y = run_offset(off)
        if out is None:
            r = y.shape[0] // n
            out = arena.empty((n, len(offsets), r) + y.shape[1:], y.dtype, xp=get_array_module(y))
        out[:, k] = y.reshape((n, -1) + y.shape[1:])
        del y
    return out.reshape((-1,) + out.shape[3:])


def _slab_fragment(steps, layers, k, x, offset, rows, xp, convs):
    """Fragment ``offset`` of pooling layer ``k``, computing layers [0, k) slab by slab in z."""
    window = layers[steps[k].index].window
    g = slab_geometry(layers, x.shape[1], steps[k].index, x.shape[2:], rows)
    ez = g["extent"][0]
    frag = arena.empty((x.shape[0], g["channels"]) + g["frag"], xp=get_array_module(x))
    oz, oy, ox = offset
    my, mx = g["frag"][1:]
    for j0 in range(0, g["frag"][0], g["rows"]):
        j1 = min(j0 + g["rows"], g["frag"][0])
        j0 = j1 - g["rows"]  # the last slab is shifted back: every slab has one shape (one FFT kernel cache)
        z0 = oz + j0 * window[0]
        pre = _run(steps[:k], layers, 0, x[:, :, z0 : z0 + (j1 - j0) * window[0] + ez - 1], xp, convs)
        sl = (
            slice(None),
            slice(None),
            slice(0, (j1 - j0) * window[0]),
            slice(oy, oy + my * window[1]),
            slice(ox, ox + mx * window[2]),
        )
        frag[:, :, j0:j1] = max_pool(pre[sl], window)
        del pre
    return frag


def _pointwise_stages(steps, layers, i, n):
    """The steps from ``i`` on that :func:`conv_pointwise_chain` runs in one pass: 1x1x1
    ``direct-gemm`` convs on whole inputs (no blocks, no micro-batches), each with the
    activation after it (fused or its own step).  Returns ``(stages, next step)``."""
    stages = []
    while i < len(steps):
        s = steps[i]
        if (
            s.op != "conv"
            or not primitive(s.primitive).runs_pointwise_chain(layers[s.index].kernel)
            or s.tile
            or 0 < s.micro_batch < n
        ):
            break
        conv, act, i = layers[s.index], fused_act(s), i + 1
        if act is None and i < len(steps) and steps[i].op == "act":
            a = layers[steps[i].index]
            act, i = (None if a.kind == "identity" else (a.kind, a.alpha)), i + 1
        stages.append((conv.weight, conv.bias, act))
    return stages, i


def _reads_channels_last(steps, layers, i) -> bool:
    """Whether the output of the step before ``i`` reaches only an untiled Winograd conv, or a
    run of 1x1x1 convs (:func:`_pointwise_stages`), through activations (in place) and MPF: it
    may be channels last (``layers/layout``), which both read at speed."""
    while i < len(steps) and (steps[i].op == "act" or steps[i].primitive == "mpf"):
        i += 1
    if i == len(steps) or steps[i].op != "conv" or steps[i].tile or steps[i].micro_batch:
        return False
    return primitive(steps[i].primitive).reads_channels_last(layers[steps[i].index].kernel)


def _run(steps, layers, i, x, xp, convs):
    while i < len(steps):
        profiling = _PROFILE is not None and threading.get_ident() == _PROFILE_THREAD
        x, i, done = (_timed_step if profiling else _step)(steps, layers, i, x, xp, convs)
        if done:
            return x
    return x


def _step(steps, layers, i, x, xp, convs):
    """Step ``i`` on ``x``: ``(its output, the next step, whether it ran the rest too)``."""
    step = steps[i]
    layer = layers[step.index]
    stages, j = _pointwise_stages(steps, layers, i, x.shape[0]) if xp is np else ([], i)
    if stages:  # 1x1x1 convs and their activations, block by block in cache
        return conv_pointwise_chain(x, stages, threads=step.threads), j, False
    if step.op == "conv":
        x = run_conv(step, layer, x, xp, convs, channels_last=xp is np and _reads_channels_last(steps, layers, i + 1))
    elif step.op == "act":
        if layer.kind != "identity":
            x = apply_activation(x, layer.kind, layer.alpha, out=x)
    elif step.primitive == "mpf":
        x = mpf(x, layer.window)
    else:  # depth-first pooling: each offset through the rest of the network
        offsets = list(itertools.product(*(range(p) for p in layer.window)))
        if get_array_module(x) is np and i > 0 and x.dtype == np.float32 and x.flags.c_contiguous:
            # x is ours (a layer's output): filter it in place once, then every offset's
            # fragment is a strided subsample, copied in the layout its reader runs on
            xf = max_filter_inplace(x, layer.window)
            cl = _reads_channels_last(steps, layers, i + 1)
            frag = lambda off: gather_fragment(xf, layer.window, off, channels_last=cl)  # noqa: E731
        else:
            frag = lambda off: _fragment(x, layer.window, off)  # noqa: E731
        return _gather(x.shape[0], offsets, lambda off: _run(steps, layers, i + 1, frag(off), xp, convs), xp), i, True
    return x, i + 1, False


#: {step index: seconds} while :func:`profiled` runs, else None; the thread it profiles
_PROFILE: dict | None = None
_PROFILE_THREAD = 0


@contextlib.contextmanager
def profiled():
    """Each step's own seconds, summed over its calls, while the block runs (``with profiled() as
    seconds: infer(...)``): what the benchmarks set against the plan's per-step predictions.  A
    device is synchronised around every step (so a GPU run is slower than without); a run of
    1x1x1 convs is charged to its first step, depth-first pooling its own work only (its offsets'
    steps are charged to themselves).  One profile at a time, of the calling thread (a cpu+gpu
    plan's CPU stage runs in a worker: not profiled)."""
    global _PROFILE, _PROFILE_THREAD
    if _PROFILE is not None:
        raise RuntimeError("profiled() does not nest")
    seconds = {}
    _PROFILE, _PROFILE_THREAD = seconds, threading.get_ident()
    try:
        yield seconds
    finally:
        _PROFILE = None


def _timed_step(steps, layers, i, x, xp, convs):
    sync = (lambda: None) if xp is np else xp.cuda.Device().synchronize
    sync()
    before, t0 = sum(_PROFILE.values()), time.perf_counter()
    out = _step(steps, layers, i, x, xp, convs)
    sync()
    inner = sum(_PROFILE.values()) - before  # steps it ran itself (depth-first pooling's offsets)
    key = steps[i].index
    _PROFILE[key] = _PROFILE.get(key, 0.0) + time.perf_counter() - t0 - inner
    return out


def fuse_activations(steps, layers) -> tuple:
    """The plan's steps with every activation that directly follows a conv that :func:`fuses`
    it folded into that conv (a :class:`FusedStep`): one pass over the layer's
    output less."""
    out = []
    for s in steps:
        prev = out[-1] if out else None
        if (
            s.op == "act"
            and prev is not None
            and prev.op == "conv"
            and fuses(prev.primitive, layers[s.index].kind)
            and not getattr(prev, "fused", "")
        ):
            out[-1] = fuse(prev, layers[s.index])
            continue
        out.append(s)
    return tuple(out)


def pool_before_activation(steps, layers) -> tuple:
    """The plan's steps with every (monotone activation, pooling) pair swapped.

    ``pool(f(x)) == f(pool(x))`` exactly for a non-decreasing ``f``, and the activation
    then runs on the pooled fragments, ``prod(window)`` times fewer voxels in depth-first
    and slab mode (where the pre-pool tensor is produced once per offset).
    """
    out = list(steps)
    for j in range(len(out) - 1):
        a, b = out[j], out[j + 1]
        if a.op == "act" and b.op == "pool" and commutes_with_max(layers[a.index]):
            out[j], out[j + 1] = b, a
    return tuple(out)


def _front_steps(plan, layers):
    """The executor's steps (fused, pools before activations) and the first one on the GPU."""
    steps = pool_before_activation(fuse_activations(plan.steps, layers), layers)
    if plan.placement != "cpu+gpu":
        return steps, 0
    return steps, next((j for j, s in enumerate(steps) if s.index >= plan.split), len(steps))


def run_front(plan, net: Graph, x, *, convs=None):
    """A ``cpu+gpu`` plan's CPU stage on one patch ``(C, n)``: the layers before ``plan.split``,
    on numpy; returns what :func:`run_back` takes (fragments ``(N, C, ...)``)."""
    _check_patch(plan, net, x)
    tuning.apply(plan.tuning)
    steps, k = _front_steps(plan, net.layers)
    x = x[None].copy() if steps and steps[0].op == "act" else x[None]
    return _run(steps[:k], net.layers, 0, x, np, {} if convs is None else convs)


def run_back(plan, net: Graph, h, *, xp, convs=None):
    """A ``cpu+gpu`` plan's GPU stage: the rest of the network on :func:`run_front`'s result
    (moved to the device here), and the recombination; returns the device's ``(C_out, out)``."""
    steps, k = _front_steps(plan, net.layers)
    y = _run(steps, net.layers, k, xp.asarray(h), xp, {} if convs is None else convs)
    pools = [l.window for l in net.layers if isinstance(l, Pool)]
    return (recombine(y, pools) if pools else y)[0]


def _check_patch(plan, net, x):
    fov, d = net.field_of_view, net.pooling_product
    if any(n < f or (n - f + 1) % dd for n, f, dd in zip(x.shape[1:], fov, d)):
        raise PlanError(
            f"patch of shape {tuple(x.shape[1:])}: every axis n needs n >= field of view {fov} "
            f"and (n - F + 1) divisible by the pooling product {d}"
        )
    if plan.network_digest != net.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")


def run_patch(plan, net: Graph, x, *, xp=np, convs=None):
    """Dense output ``(C_out, n - F + 1)`` of one input patch ``(C, n)``.

    The plan's choices (primitives, pool modes, micro-batches) apply to any patch whose
    output is a multiple of the pooling product; a patch no larger than the plan's stays
    within its memory budget.  ``convs``: a dict that keeps the FFT layers (their kernel
    spectra) between calls, one per step; pass the same one for every patch of a run
    of this plan (:func:`kernel_cache` gives the one for a plan).
    """
    convs = {} if convs is None else convs
    tuning.apply(plan.tuning)  # the kernel parameters the plan was made with (its host's)
    if plan.placement == "cpu+gpu":  # the two stages in turn (exec/tiling.py overlaps them across patches)
        return run_back(plan, net, run_front(plan, net, x, convs=convs), xp=xp, convs=convs)
    _check_patch(plan, net, x)
    with arena.using(plan_arena(plan, convs, xp)):
        return _run_patch(plan, net, x, xp, convs)


def _run_patch(plan, net, x, xp, convs):
    layers = net.layers
    if plan.steps and plan.steps[0].op == "act":
        x = x.copy()  # activations run in place; never modify the caller's input
    steps = pool_before_activation(fuse_activations(plan.steps, layers), layers)
    k = next((j for j, s in enumerate(steps) if s.op == "pool"), None)
    if k is not None and steps[k].primitive == "slab":
        # first pooling layer in slab mode: the layers before it are recomputed per offset,
        # z-slab by z-slab, so their full-size output never exists
        window = layers[steps[k].index].window
        offsets = list(itertools.product(*(range(p) for p in window)))
        xb = x[None]
        y = _gather(
            1,
            offsets,
            lambda off: _run(
                steps,
                layers,
                k + 1,
                _slab_fragment(steps, layers, k, xb, off, steps[k].micro_batch, xp, convs),
                xp,
                convs,
            ),
            xp,
        )
    else:
        y = _run(steps, layers, 0, x[None], xp, convs)
    pools = [l.window for l in layers if isinstance(l, Pool)]
    if pools:
        y = recombine(y, pools)
    return y[0]
