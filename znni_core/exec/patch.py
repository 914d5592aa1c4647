"""Run a plan on one input patch: the executor of every network (``xp``: numpy or CuPy).

Nodes run in topological order; a tensor is dropped after its last reader, and an element-wise
node writes into an input that dies there, as the planner's memory walks count them
(``plan/memory.py`` for a network pooled into fragments, ``plan/graph.py`` for the others).
Each node runs as its plan step says:

- a **convolution** by the step's primitive, in its blocks and micro-batches (``exec/steps.py``),
  on the zero-padded input where the node pads (Winograd reads the zeros in place, no padded
  copy); a run of 1x1x1 convolutions and their activations goes block by block in cache
  (:func:`~znni_core.layers.conv_pointwise_chain`);
- a **max-pooling node in fragments** (a chain's, whose output is dense): ``mpf`` stacks every
  pooling offset into the batch (breadth first); ``pool`` runs each offset's fragment through
  the rest of the network and gathers the results as MPF would (depth first: less memory, the
  same result); ``slab`` (the first pooling node) also recomputes the nodes before it z-slab by
  z-slab, so their full-size output never exists.  The fragments are interleaved back into the
  dense output at the end (:func:`~znni_core.layers.recombine`);
- any other **pooling** (a U-Net's encoder) subsamples; the other operators run as they read.

Passes are fused where a tensor has one reader: a conv applies the activation after it
(``fuses_next``), an add or affine the affine and activation after it (``chain_after``), and a
non-decreasing activation before a pooling node in fragments runs after it, on the pooled
fragments (exact: ``pool(f(x)) == f(pool(x))``).  A Winograd conv whose readers all run
channels last writes its output channels last (``layers/layout``; :func:`channels_last_tensors`).

A patch too large for the budget runs in output **tiles** (``plan.tile``), each computing every
tensor only over the range its voxels depend on (``needed_ranges``): zero padding is applied
where a range meets the patch's border and real neighbouring values elsewhere, so the tiles
together equal the whole patch exactly (halos are recomputed).  The executor never does IO.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from dataclasses import dataclass

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
from ..layers.epilogue import add_affine_act
from ..layers.layout import as_contiguous, channels_inner, concat_channels_last
from ..layers.resample import avg_pool, conv_transpose, interpolate, pad, upsample_nearest
from ..layers.xp import get_array_module
from ..net.graph import Graph
from ..net.ops import Act, Add, Affine, Concat, Convolution, Crop, Deconvolution, Mul, Pad, Pooling, Resize
from ..plan.memory import slab_geometry
from ..plan.plan import fused_act
from ..plan.pooling import MPF, Slab
from ..plan.primitives import PRIMITIVES
from ..plan.program import (
    Program,
    channels_last_tensors,
    fragment_shapes,
    in_fragments,
    in_place_input,
    program,
    readers_left,
)
from ..plan.ranges import needed_ranges, tile_starts
from .steps import conv_fn, plan_arena, run_conv

# ---- one run --------------------------------------------------------------------------------


@dataclass
class _Run:
    """One range of one patch: the program, every tensor's shape and needed range, and the cache."""

    prog: Program
    shapes: dict
    need: dict
    xp: object
    convs: dict
    cl: set


def _whole(shapes: dict) -> dict:
    return {t: ((0, 0, 0), tuple(s[1:])) for t, s in shapes.items()}


def _take(value, lo, hi):
    """The part ``[lo, hi)`` (tensor coordinates) of a computed range ``(array, its lo)``."""
    arr, base = value
    sl = tuple(slice(a - b0, h - b0) for a, h, b0 in zip(lo, hi, base))
    if all(s.start == 0 and s.stop == n for s, n in zip(sl, arr.shape[2:])):
        return arr
    return arr[(slice(None), slice(None)) + sl]


def _release(node, env, remaining) -> None:
    """``node`` has read its inputs: each dies after its last reader."""
    for name in node.inputs:
        remaining[name] -= 1
    for name in set(node.inputs):
        if remaining[name] == 0:
            env.pop(name, None)


def _run_nodes(run: _Run, env: dict, remaining: dict, i: int, stop: int):
    """Nodes ``[i, stop)`` on ``env`` (``{tensor: (array, its lo)}``); the value of the tensor they
    give (:func:`_result`; depth-first pooling runs the rest itself and returns it gathered)."""
    nodes = run.prog.nodes
    while i < stop:
        node = nodes[i]
        if node.output not in run.need:  # does not reach the output
            _release(node, env, remaining)
            i += 1
            continue
        profiling = _PROFILE is not None and threading.get_ident() == _PROFILE_THREAD
        j, done = (_timed_node if profiling else _run_node)(run, env, remaining, i, stop)
        if done is not None:
            return done
        i = j
    return env.pop(_result(run.prog, stop))


def _result(prog: Program, stop: int) -> str:
    """The tensor that running the nodes before ``stop`` gives."""
    if stop == len(prog.nodes):
        return prog.output
    return prog.nodes[stop - 1].output if stop else prog.input


def _run_node(run: _Run, env, remaining, i, stop):
    """Node ``i`` (and what runs with it); ``(the next node, None)``, or ``(stop, the result)``
    when it ran the rest of the network (depth-first pooling)."""
    prog, xp = run.prog, run.xp
    node, step = prog.nodes[i], prog.steps[i]
    a, b = run.need[node.output]
    if i in prog.skip:
        env[node.output] = env[node.inputs[0]]  # the conv or element-wise node before applied it
        _release(node, env, remaining)
        return i + 1, None
    if isinstance(node.op, Convolution) and xp is np:
        j, y = _pointwise_run(run, env, remaining, i, stop)
        if y is not None:
            env[prog.nodes[j - 1].output] = (y, a)
            return j, None
    if in_fragments(step):
        x = env[node.inputs[0]][0]
        _release(node, env, remaining)
        if isinstance(step.pooling, MPF):
            env[node.output] = (mpf(x, node.op.window), a)
            return i + 1, None
        return stop, _depth_first(run, remaining, i, stop, x)
    target = in_place_input(node, remaining, run.need, prog.input)
    if i in prog.chains:
        y = _chain(node, [prog.nodes[j] for j in prog.chains[i]], env, a, b, target)
    else:
        y = _execute(node.op, node, prog.step(i), env, a, b, run, target)
    env[node.output] = (y, a)
    del y
    _release(node, env, remaining)
    return i + 1, None


def _pointwise_run(run: _Run, env, remaining, i, stop):
    """From conv node ``i`` (before ``stop``), the 1x1x1 ``direct-gemm`` convs that :func:`conv_pointwise_chain` runs
    in one pass over the input (each the only reader of the one before, none in blocks or
    micro-batches), each with the activation after it; ``(the next node, the output)``, or
    ``(i, None)`` where node ``i`` is not such a conv."""
    prog, consumers = run.prog, remaining
    nodes, steps = prog.nodes, prog.steps
    n = env[nodes[i].inputs[0]][0].shape[0]
    stages, j, ran = [], i, []

    def pointwise(k):
        node, step = nodes[k], steps[k]
        return (
            isinstance(node.op, Convolution)
            and node.op.plain
            and PRIMITIVES[step.primitive].runs_pointwise_chain(node.op.conv.kernel)
            and not step.tile
            and not 0 < step.micro_batch < n
        )

    def follows(k):  # reads only the node before, its only reader
        return nodes[k].inputs == (nodes[k - 1].output,) and consumers[nodes[k - 1].output] == 1

    while j < stop and pointwise(j) and (j == i or follows(j)):
        conv, act = nodes[j], fused_act(prog.step(j))
        ran.append(conv)
        j += 1
        if j in prog.fused:  # before stop: a conv's fused activation is on its side of any split
            ran.append(nodes[j])
            j += 1
        elif act is None and j < stop and isinstance(nodes[j].op, Act) and follows(j) and j not in prog.skip:
            kind = nodes[j].op.act
            act = None if kind.kind == "identity" else (kind.kind, kind.alpha)
            ran.append(nodes[j])
            j += 1
        stages.append((conv.op.conv.weight, conv.op.conv.bias, act))
    if not stages:
        return i, None
    a, b = run.need[nodes[i].output]
    last = max(k for k in range(i, j) if isinstance(nodes[k].op, Convolution))  # the chain's output is its last conv's
    y = conv_pointwise_chain(
        as_contiguous(_take(env[nodes[i].inputs[0]], a, b)),
        stages,
        threads=steps[i].threads,
        channels_last=nodes[last].output in run.cl,
    )
    for node in ran:
        _release(node, env, remaining)
    return j, y


def _depth_first(run: _Run, remaining, i, stop, x):
    """Pooling node ``i`` depth first: every offset's fragment of ``x`` through nodes ``(i, stop)``,
    the results gathered as MPF would have batched them."""
    node = run.prog.nodes[i]
    window = node.op.window
    offsets = list(itertools.product(*(range(p) for p in window)))
    if (
        get_array_module(x) is np
        and node.inputs[0] != run.prog.input
        and x.dtype == np.float32
        and x.flags.c_contiguous
    ):
        # x is ours (a layer's output): filter it in place once, then every offset's fragment
        # is a strided subsample, copied in the layout its reader runs on
        xf = max_filter_inplace(x, window)
        cl = node.output in run.cl
        frag = lambda off: gather_fragment(xf, window, off, channels_last=cl)  # noqa: E731
    else:
        frag = lambda off: _fragment(x, window, off)  # noqa: E731
    lo = run.need[node.output][0]

    def rest(off):
        return _run_nodes(run, {node.output: (frag(off), lo)}, dict(remaining), i + 1, stop)[0]

    return _gather(x.shape[0], offsets, rest), lo


def _fragment(x, window, offset):
    """The pooled fragment at ``offset``: one slice of :func:`mpf`'s batch."""
    m = [(n - p + 1) // p for n, p in zip(x.shape[2:], window)]
    sl = tuple(slice(o, o + k * p) for o, k, p in zip(offset, m, window))
    return max_pool(x[(slice(None), slice(None)) + sl], window)


def _gather(n, offsets, run_offset):
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


# ---- one operator ------------------------------------------------------------------------------


@functools.singledispatch
def _execute(op, node, step, env, a, b, run: _Run, out):
    """``node``'s output over ``[a, b)`` (operator ``op``, run as ``step`` says); ``out`` is an
    input to overwrite (or None).  One function per operator class."""
    raise PlanError(f"{node.name}: no executor for {type(op).__name__}")


def _input(node, env, a, b, run: _Run):
    """The part of ``node``'s input that its output ``[a, b)`` reads, and that part's origin."""
    name = node.inputs[0]
    n_in = run.shapes[name][1:]
    r = [node.op.in_range(ax, a[ax], b[ax], n_in[ax]) for ax in range(3)]
    lo, hi = tuple(v[0] for v in r), tuple(v[1] for v in r)
    return _take(env[name], lo, hi), lo, hi


@_execute.register
def _(op: Convolution, node, step, env, a, b, run, out):
    name, xp = node.inputs[0], run.xp
    n_in = run.shapes[name][1:]
    raw_lo, raw_hi = op.window(a, b)
    clip_lo = tuple(max(0, v) for v in raw_lo)
    clip_hi = tuple(min(n, v) for n, v in zip(n_in, raw_hi))
    x = _take(env[name], clip_lo, clip_hi)
    low = tuple(c - r for c, r in zip(clip_lo, raw_lo))
    high = tuple(r - c for c, r in zip(clip_hi, raw_hi))
    cl = node.output in run.cl  # a Winograd conv writes it channels last
    pads_input = getattr(PRIMITIVES.get(step.primitive), "pads_input", False)
    if (any(low) or any(high)) and pads_input and not step.tile and get_array_module(x) is xp:
        # zeros read in place of the padding: no padded copy
        spatial = tuple(r1 - r0 for r0, r1 in zip(raw_lo, raw_hi))
        return conv_fn(step, op.layer, spatial, xp, run.convs, cl)(as_contiguous(x), low=low)
    x = pad(x, low, high) if any(low) or any(high) else as_contiguous(x)
    return run_conv(step, op.layer, x, xp, run.convs, channels_last=cl)


def _cut(y, a, b, lo, f):
    """Output ``[a, b)`` of ``y``, the upsampling by ``f`` of an input part starting at ``lo``."""
    sl = tuple(slice(s - l * ff, s - l * ff + (e - s)) for s, e, l, ff in zip(a, b, lo, f))
    if all(s.start == 0 and s.stop == n for s, n in zip(sl, y.shape[2:])):
        return y
    return as_contiguous(y[(slice(None), slice(None)) + sl])


@_execute.register
def _(op: Deconvolution, node, step, env, a, b, run, out):
    xp = run.xp
    x, lo, _ = _input(node, env, a, b, run)
    bias = None if op.bias is None else xp.asarray(op.bias)
    # a channels-last part stays channels last (the host's transposed conv reads and writes it so)
    return _cut(conv_transpose(as_contiguous(x), xp.asarray(op.weight), bias, op.stride), a, b, lo, op.stride)


@_execute.register
def _(op: Resize, node, step, env, a, b, run, out):
    x, lo, _ = _input(node, env, a, b, run)
    if not op.linear:
        return _cut(upsample_nearest(x, op.scale), a, b, lo, op.scale)
    n_in = run.shapes[node.inputs[0]][1:]
    tables = []
    for ax, f in enumerate(op.scale):
        if f == 1:
            tables.append(None)
            continue
        i0, i1, w = op.table(ax, n_in[ax])
        tables.append((i0[a[ax] : b[ax]] - lo[ax], i1[a[ax] : b[ax]] - lo[ax], w[a[ax] : b[ax]]))
    return interpolate(x, tables)


@_execute.register
def _(op: Pooling, node, step, env, a, b, run, out):
    x = _input(node, env, a, b, run)[0]
    return max_pool(x, op.window) if op.kind == "max" else avg_pool(x, op.window)


@_execute.register
def _(op: Crop, node, step, env, a, b, run, out):
    return as_contiguous(_input(node, env, a, b, run)[0])  # a channels-last part stays channels last


@_execute.register
def _(op: Pad, node, step, env, a, b, run, out):
    x, lo, hi = _input(node, env, a, b, run)
    # the padding before the input part (all of the range where the part is empty), then after it
    low = tuple(min(e - s, max(0, c - (s - p))) for s, e, c, p in zip(a, b, lo, op.low))
    high = tuple(e - s - w - (h - c) for s, e, c, h, w in zip(a, b, lo, hi, low))
    return pad(x, low, high, op.value)


@_execute.register
def _(op: Concat, node, step, env, a, b, run, out):
    ins = [_take(env[i], a, b) for i in node.inputs]
    if all(isinstance(v, np.ndarray) and v.dtype == np.float32 and channels_inner(v) for v in ins):
        return concat_channels_last(ins)  # channels last in, channels last out (channels_last_tensors)
    return run.xp.concatenate(ins, axis=1)


@_execute.register
def _(op: Act, node, step, env, a, b, run, out):
    x = _take(env[node.inputs[0]], a, b)
    if op.act.kind == "identity":
        return x if out is not None else x.copy()
    return apply_activation(x, op.act.kind, op.act.alpha, out=x if out is not None else None)


@_execute.register
def _(op: Affine, node, step, env, a, b, run, out):
    xp = run.xp
    x = _take(env[node.inputs[0]], a, b)
    s = xp.asarray(op.scale).reshape(1, -1, 1, 1, 1)
    t = xp.asarray(op.shift).reshape(1, -1, 1, 1, 1)
    if out is None:
        return x * s + t
    x *= s
    x += t
    return x


def _join(op, node, step, env, a, b, run, out):
    """An element-wise add or product of two tensors (into the one that dies here, if any).  An add
    of float32 arrays in host memory runs on the run's threads (:func:`add_affine_act`): numpy's
    add runs on one, and a U-Net's skip add of 24 maps on 16 x 192^2 channels last took 6.6 ms
    there against 4.3 ms on two (28 maps: 10.3 against 7.0)."""
    ins = [_take(env[i], a, b) for i in node.inputs]
    target = None if out is None else env[out][0]
    if (
        isinstance(op, Add)
        and ins[0].shape == ins[1].shape
        and all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in ins)
    ):
        return add_affine_act(ins[0], ins[1], out=target)
    ufunc = run.xp.add if isinstance(op, Add) else run.xp.multiply
    if target is None:
        return ufunc(ins[0], ins[1])
    other = ins[1] if target is ins[0] else ins[0]
    return ufunc(target, other, out=target)


for _cls in (Add, Mul):
    _execute.register(_cls, _join)


def _chain(node, followers, env, a, b, out):
    """An add or affine node and the affine and activation after it (:func:`chain_after`) in
    one pass; ``out``: the input to overwrite, or None."""
    ins = [_take(env[i], a, b) for i in node.inputs]
    affine = next((n.op for n in (node, *followers) if isinstance(n.op, Affine)), None)
    act = next((f.op.act for f in followers if isinstance(f.op, Act)), None)
    return add_affine_act(
        ins[0],
        ins[1] if isinstance(node.op, Add) else None,
        None if affine is None else affine.scale,
        None if affine is None else affine.shift,
        None if act is None else (act.kind, act.alpha),
        out=None if out is None else env[out][0],
    )


# ---- per-step seconds -------------------------------------------------------------------------

#: {step index: seconds} while :func:`profiled` runs, else None; the thread it profiles
_PROFILE: dict | None = None
_PROFILE_THREAD = 0


@contextlib.contextmanager
def profiled():
    """Each step's own seconds, summed over its calls, while the block runs (``with profiled() as
    seconds: infer(...)``): what the benchmarks set against the plan's per-step predictions.  A
    device is synchronised around every step (so a GPU run is slower than without); a run of
    1x1x1 convs is charged to its first step, depth-first pooling its own work only (its offsets'
    steps are charged to themselves), an activation applied by the node before it nothing.  One
    profile at a time, of the calling thread (a cpu+gpu plan's CPU stage runs in a worker: not
    profiled)."""
    global _PROFILE, _PROFILE_THREAD
    if _PROFILE is not None:
        raise RuntimeError("profiled() does not nest")
    seconds = {}
    _PROFILE, _PROFILE_THREAD = seconds, threading.get_ident()
    try:
        yield seconds
    finally:
        _PROFILE = None


def _timed_node(run: _Run, env, remaining, i, stop):
    xp = run.xp
    sync = (lambda: None) if xp is np else xp.cuda.Device().synchronize
    sync()
    before, t0 = sum(_PROFILE.values()), time.perf_counter()
    out = _run_node(run, env, remaining, i, stop)
    sync()
    if i in run.prog.skip:
        return out
    inner = sum(_PROFILE.values()) - before  # steps it ran itself (depth-first pooling's offsets)
    key = run.prog.steps[i].index
    _PROFILE[key] = _PROFILE.get(key, 0.0) + time.perf_counter() - t0 - inner
    return out


# ---- a patch ------------------------------------------------------------------------------------


def _check(plan, net: Graph) -> None:
    if plan.network_digest != net.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")


def _check_dense_patch(net: Graph, spatial) -> None:
    fov, d = net.field_of_view, net.pooling_product
    if any(n < f or (n - f + 1) % dd for n, f, dd in zip(spatial, fov, d)):
        raise PlanError(
            f"patch of shape {tuple(spatial)}: every axis n needs n >= field of view {fov} "
            f"and (n - F + 1) divisible by the pooling product {d}"
        )


def _dense_run(prog: Program, x, xp, convs) -> _Run:
    shapes = fragment_shapes(prog.nodes, tuple(x.shape[1:]))
    return _Run(prog, shapes, _whole(shapes), xp, convs, channels_last_tensors(prog) if xp is np else set())


def _front_stop(prog: Program, plan) -> int:
    """A ``cpu+gpu`` plan's first GPU node (the program's position of ``plan.split``)."""
    return next((j for j, s in enumerate(prog.steps) if s.index >= plan.split), len(prog.steps))


def run_front(plan, net: Graph, x, *, convs=None):
    """A ``cpu+gpu`` plan's CPU stage on one patch ``(C, n)``: the nodes before ``plan.split``,
    on numpy; returns what :func:`run_back` takes (fragments ``(N, C, ...)``)."""
    _check(plan, net)
    prog = program(plan.steps, net)
    _check_dense_patch(net, x.shape[1:])
    tuning.apply(plan.tuning)
    run = _dense_run(prog, x[None], np, {} if convs is None else convs)
    stop = _front_stop(prog, plan)
    return _run_nodes(run, {prog.input: (x[None], (0, 0, 0))}, net.consumers(), 0, stop)[0]


def run_back(plan, net: Graph, h, *, xp, convs=None):
    """A ``cpu+gpu`` plan's GPU stage: the rest of the network on :func:`run_front`'s result
    (moved to the device here), and the recombination; returns the device's ``(C_out, out)``."""
    prog = program(plan.steps, net, xp)
    k = _front_stop(prog, plan)
    remaining = readers_left(net, prog.nodes[:k])
    source = prog.nodes[k].inputs[0] if k < len(prog.nodes) else prog.output
    shapes = fragment_shapes(prog.nodes[k:], tuple(h.shape[1:]))
    run = _Run(prog, shapes, _whole(shapes), xp, {} if convs is None else convs, set())
    y = _run_nodes(run, {source: (xp.asarray(h), (0, 0, 0))}, remaining, k, len(prog.nodes))[0]
    return (recombine(y, prog.windows) if prog.windows else y)[0]


def run_patch(plan, net: Graph, x, *, xp=np, convs=None, prog=None):
    """The network's output on one admissible patch ``(C, n)``: a chain's dense output
    ``(C_out, n - F + 1)``, another graph's ``(C_out, n - context)``, whole or in the plan's exact
    output tiles.

    The plan's choices (primitives, pooling, micro-batches) apply to any admissible patch; a patch
    no larger than the plan's stays within its memory budget.  ``convs``: a dict that keeps what
    the primitives build once per run (kernel spectra, weights on the device, the arena of
    buffers) between calls, and ``prog`` the plan's :class:`Program`: what an
    :class:`~.executor.Executor` holds for its plan and passes here.
    """
    _check(plan, net)
    convs = {} if convs is None else convs
    tuning.apply(plan.tuning)  # the kernel parameters the plan was made with (its host's)
    if plan.placement == "cpu+gpu":  # the two stages in turn (exec/tiling.py overlaps them across patches)
        return run_back(plan, net, run_front(plan, net, x, convs=convs), xp=xp, convs=convs)
    prog = program(plan.steps, net, xp) if prog is None else prog
    with arena.using(plan_arena(plan, convs, xp)):
        if prog.dense:
            return _run_dense(prog, net, x, xp, convs)
        return _run_tiles(plan, prog, net, x, xp, convs)


def _run_dense(prog: Program, net: Graph, x, xp, convs):
    """A program pooled into fragments on the whole patch, recombined."""
    _check_dense_patch(net, x.shape[1:])
    x = x[None]
    run = _dense_run(prog, x, xp, convs)
    k = next(j for j, s in enumerate(prog.steps) if in_fragments(s))
    if isinstance(prog.steps[k].pooling, Slab):
        # the first pooling node in slab mode: the nodes before it are recomputed per offset,
        # z-slab by z-slab, so their full-size output never exists
        window = prog.nodes[k].op.window
        offsets = list(itertools.product(*(range(p) for p in window)))
        remaining = readers_left(net, prog.nodes[: k + 1])
        name = prog.nodes[k].output

        def rest(off):
            frag = _slab_fragment(run, net, k, x, off)
            return _run_nodes(run, {name: (frag, (0, 0, 0))}, dict(remaining), k + 1, len(prog.nodes))[0]

        y = _gather(1, offsets, rest)
    else:
        y = _run_nodes(run, {prog.input: (x, (0, 0, 0))}, net.consumers(), 0, len(prog.nodes))[0]
    return recombine(y, prog.windows)[0]


def _slab_fragment(run: _Run, net: Graph, k, x, offset):
    """Fragment ``offset`` of the pooling node ``k`` (slab mode), computing the nodes before it
    slab by slab in z."""
    prog = run.prog
    step, window = prog.steps[k], prog.nodes[k].op.window
    g = slab_geometry(net.layers, x.shape[1], step.index, x.shape[2:], step.pooling.rows)
    ez = g["extent"][0]
    frag = arena.empty((x.shape[0], g["channels"]) + g["frag"], xp=get_array_module(x))
    oz, oy, ox = offset
    my, mx = g["frag"][1:]
    for j0 in range(0, g["frag"][0], g["rows"]):
        j1 = min(j0 + g["rows"], g["frag"][0])
        j0 = j1 - g["rows"]  # the last slab is shifted back: every slab has one shape (one FFT kernel cache)
        z0 = oz + j0 * window[0]
        slab = x[:, :, z0 : z0 + (j1 - j0) * window[0] + ez - 1]
        shapes = fragment_shapes(prog.nodes, tuple(slab.shape[1:]))
        part = _Run(prog, shapes, _whole(shapes), run.xp, run.convs, run.cl)
        pre = _run_nodes(part, {prog.input: (slab, (0, 0, 0))}, net.consumers(), 0, k)[0]
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


def _run_tiles(plan, prog: Program, graph: Graph, x, xp, convs):
    """A program without fragments on the patch, whole or in the plan's output tiles."""
    shapes = graph.shapes(tuple(x.shape[1:]))  # names the node when the patch is not admissible
    out_n = shapes[graph.output][1:]
    tile = tuple(min(t, o) for t, o in zip(plan.tile or out_n, out_n))
    if tile == out_n:
        return _run_range(prog, graph, x[None], shapes, (0, 0, 0), out_n, xp, convs)[0]
    result = xp.empty((graph.out_channels,) + tuple(out_n), dtype=np.float32)
    for lo in tile_starts(out_n, tile):
        hi = tuple(min(a + t, o) for a, t, o in zip(lo, tile, out_n))
        y = _run_range(prog, graph, x[None], shapes, lo, hi, xp, convs)
        result[(slice(None),) + tuple(slice(a, b) for a, b in zip(lo, hi))] = y[0]
        del y
    return result


def _run_range(prog: Program, graph: Graph, x, shapes, lo, hi, xp, convs):
    """Output voxels ``[lo, hi)`` of the patch ``x`` (1, C, n): every tensor over its range."""
    need = needed_ranges(prog, shapes, lo, hi)
    whole = not any(lo) and tuple(hi) == tuple(shapes[prog.output][1:])  # tiles read parts: not there
    cl = channels_last_tensors(prog) if xp is np and whole else set()
    rlo, rhi = need[prog.input]
    env = {prog.input: (x[(slice(None), slice(None)) + tuple(slice(a, b) for a, b in zip(rlo, rhi))], rlo)}
    run = _Run(prog, shapes, need, xp, convs, cl)
    return _run_nodes(run, env, graph.consumers(), 0, len(prog.nodes))[0]
