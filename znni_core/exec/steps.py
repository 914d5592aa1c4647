"""What the executor runs per conv step: the primitive, fused activations, buffers.

The executor (:mod:`.patch`) runs a plan's conv steps this way, for every network: the step's
primitive built once per run for its input size (:func:`conv_fn`, what it keeps, kernel
transforms and weights on the device, found in the run's cache), called in the step's blocks
and micro-batches (:func:`run_conv`), with the activation after it applied in its output pass
where the plan fused it (:class:`~..plan.plan.FusedStep`); outputs come from the run's arena of buffers
(:func:`plan_arena`) within the plan's budget.
"""

from __future__ import annotations

import os

import numpy as np

from ..geometry.blocks import conv_blocks
from ..layers import arena
from ..layers.buffers import CallBuffers
from ..layers.xp import get_array_module, is_numpy
from ..net.chain import Conv
from ..plan.plan import fused_act
from ..plan.primitives import primitive
from .stream import stream_blocks


def conv_fn(step, layer: Conv, in_spatial, xp, convs, channels_last=False):
    """The step's primitive built for ``in_spatial`` inputs (what it keeps for the run, kernel
    transforms and weights on the device, is found in ``convs`` under the step's index), with
    the step's fused activation; ``channels_last``: the output written channels last where
    the primitive can."""
    return primitive(step.primitive).build(
        layer,
        in_spatial,
        xp=xp,
        threads=step.threads,
        act=fused_act(step),
        channels_last=channels_last,
        cache=convs,
        key=step.index,
    )


def run_conv(step, layer: Conv, x, xp, convs, channels_last=False):
    """``layer`` on ``x`` by the step's primitive, blocks and micro-batches; ``channels_last``:
    a one-call Winograd step returns its output channels last (``layers/layout``)."""
    n, spatial = x.shape[0], tuple(x.shape[2:])
    mb = step.micro_batch or n
    tile, origins = conv_blocks(spatial, layer.kernel, step.tile)
    fn = conv_fn(step, layer, tile, xp, convs, channels_last)
    streamed = xp is not np and get_array_module(x) is np  # GPU + host RAM: x lives on the host
    if not streamed and mb >= n and tile == spatial:
        return fn(x)
    shape = (n, layer.out_channels) + tuple(s - k + 1 for s, k in zip(spatial, layer.kernel))
    ob = [t - k + 1 for t, k in zip(tile, layer.kernel)]
    blocks = [
        (
            (slice(i, i + mb), slice(None)) + tuple(slice(a, a + t) for a, t in zip(o, tile)),
            (slice(i, i + mb), slice(None)) + tuple(slice(a, a + b) for a, b in zip(o, ob)),
        )
        for i in range(0, n, mb)
        for o in origins
    ]
    if streamed:
        out = np.empty(shape, np.float32)
        stream_blocks(fn, x, out, blocks, xp)
        return out
    out = arena.empty(shape, xp=xp)
    if not isinstance(fn, CallBuffers):
        for src, dst in blocks:
            out[dst] = fn(x[src])
        return out
    with fn.buffers_kept():  # one set of call buffers for all blocks of this step
        for src, dst in blocks:
            fn(x[src], out=out[dst])  # straight into the output block
    return out


def plan_arena(plan, convs, xp=np) -> arena.Arena | None:
    """The run's output buffers on the host (kept in ``convs`` with the kernel spectra): it holds
    at most the slack the plan leaves in its budget, so the run stays within the budget.  None
    (fresh pages for every output, as the memory model counts them) with
    ``ZNNI_REUSE_BUFFERS=0``, and on a device (its memory pool reuses blocks itself)."""
    if not is_numpy(xp):
        return None
    arena.avoid_huge_page_stalls()  # once per process: no synchronous compaction on first touch
    if os.environ.get("ZNNI_REUSE_BUFFERS", "1") == "0":
        return None
    arena.retain_freed_memory()  # what exceeds the arena's slack is reused from malloc's heap
    if "arena" not in convs:
        convs["arena"] = arena.Arena(plan.memory_budget - plan.predicted_peak_bytes)
    return convs["arena"]
