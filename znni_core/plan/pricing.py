"""What a candidate's steps cost, for both searches (the chain's and the graph's).

:class:`Pricer` times a convolution: the cost model's estimate, or (efforts ``measure`` and
``exhaustive``) the primitive timed on the real shapes; memoised for one search.
:func:`priced_steps` turns a candidate's memory walk (:func:`.memory.walk`) into the plan's
steps, each priced by :func:`step_of`, one function per operator class; what a search knows
beyond the walk's records (repeats per pooling offset, the pooling choices and their layouts,
convolutions streamed through a GPU) comes in a :class:`StepContext`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..net.ops import Act, Add, Affine, Concat, Convolution, Crop, Deconvolution, Mul, Pad, Pooling, Resize
from . import gpu_timing as G
from . import memory as M
from . import timing as T
from .calibration import GpuCalibration
from .costs import CostModel, CpuCostModel, GpuCostModel
from .plan import Step
from .pooling import DepthFirst, PoolingChoice, Subsample
from .primitives import primitive

MAX_MEASURE_SECONDS = 2.0  # longer runs keep their estimate: measuring stays bounded
#: fixed costs the rates do not see (Python, dispatch): per primitive call and per patch
#: (tiny patches of a 1x1x1 stack: 0.08 ms per conv call, 2.8 ms per 8-step patch)
CALL_OVERHEAD_S = 1e-4
PATCH_OVERHEAD_S = 1e-3


class Pricer:
    """Prices the search's candidates: the cost model's estimates, or (``effort`` measure and
    exhaustive) primitives timed on the real shapes; memoised for one search."""

    def __init__(
        self, effort: str, threads: int, cal: GpuCalibration | None = None, xp=None, model: CostModel | None = None
    ):
        self.model = model or (GpuCostModel(cal) if cal else CpuCostModel(T.calibrate(threads)))
        self.cal = self.model.cal
        if effort == "estimate":
            self.meas = None
        elif cal is None:
            self.meas = T.Measurements(threads)
        else:  # a GPU's calibration: timed on the device
            self.meas = G.DeviceMeasurements(cal, xp)
        self.measure_all = effort == "exhaustive"
        self._memo: dict = {}  # (primitive, n, layer, shapes, ...) -> seconds, for this search only

    def estimate(self, prim, n, layer, spatial, micro_batch=None) -> float:
        """The cost model's seconds for ``n`` fragments of ``layer`` on ``spatial`` in micro-batches."""
        return self.model.conv(prim, n, layer, spatial, micro_batch)

    def layer(self, prim, n, layer, spatial, micro_batch, reps, measure=False, tile=()) -> float:
        """Seconds of a conv step over the whole patch: ``reps`` runs (pooling offsets, slabs),
        each in micro-batches and input blocks, plus the one-off build of resident kernel spectra."""
        key = (prim, n, id(layer), tuple(spatial), micro_batch, reps, measure, tuple(tile or ()))
        if (hit := self._memo.get(key)) is None:
            hit = self._memo[key] = self._layer(prim, n, layer, spatial, micro_batch, reps, measure, tile)
        return hit

    def _layer(self, prim, n, layer, spatial, micro_batch, reps, measure, tile) -> float:
        shape, origins = M.conv_blocks(tuple(spatial), layer.kernel, tile)
        if len(origins) == 1:
            calls = reps * math.ceil(n / (micro_batch or n))
            return (
                reps * self.conv(prim, n, layer, spatial, micro_batch, measure)
                + self.model.setup(prim, layer, spatial)
                + calls * CALL_OVERHEAD_S
            )
        mb = micro_batch or n
        copy = self.model.elementwise(M.nbytes((mb, layer.in_channels) + shape), 2.0)
        slow = primitive(prim).block_slowdown if not measure else 1.0
        per_call = self.conv(prim, mb, layer, shape, mb, measure) * slow + copy + CALL_OVERHEAD_S
        return reps * math.ceil(n / mb) * len(origins) * per_call + self.model.setup(prim, layer, shape)

    def conv(self, prim, n, layer, spatial, micro_batch, measure=False) -> float:
        """Seconds for ``n`` fragments in micro-batches: measured (scaled per call) or estimated."""
        mb = micro_batch or n
        est = self.estimate(prim, n, layer, spatial, mb)
        if self.meas is not None and (measure or self.measure_all) and est < MAX_MEASURE_SECONDS:
            return self.meas.conv(prim, mb, layer, spatial) * math.ceil(n / mb)
        return est


def streamed_seconds(timer: Pricer, prim, n, layer, spatial, mb, reps, tile, host_cal) -> float:
    """Seconds of a conv streamed through the device block by block (GPU + host RAM): the
    transfers of every block in and out and the host's copies of them into and out of the
    pinned buffers overlap the compute (two streams), and the first block's transfer does not.
    The copies are a read and a write of each block at the host's calibrated bandwidth; on
    the H100 they were not priced, and the plans ran 4-6x their prediction."""
    compute = timer.layer(prim, n, layer, spatial, mb, reps, tile=tile)
    shape, origins = M.conv_blocks(tuple(spatial), layer.kernel, tile)
    calls = reps * math.ceil(n / (mb or n)) * len(origins)
    one = M.nbytes(((mb or n), layer.in_channels) + shape) + M.nbytes(
        ((mb or n), layer.out_channels) + tuple(s - k + 1 for s, k in zip(shape, layer.kernel))
    )
    moved = timer.model.transfer(calls * one, pinned=True)
    staged = 2 * calls * one / host_cal.mem_bw
    return max(compute, moved, staged) + timer.model.transfer(one, pinned=True) + 2 * one / host_cal.mem_bw


# ---- a candidate's steps, priced ----------------------------------------------------------------


@dataclass(frozen=True)
class StepContext:
    """What a search knows of one candidate beyond its memory walk's records.

    A graph's search gives the pricer and its threads only: every node runs once per patch and
    its pooling nodes subsample.  A chain's also gives each layer's runs per patch (``reps``: per
    pooling offset after a depth-first pooling layer, per z-slab before a slab), each pooling
    layer's choice and which of them read a channels-last input, whether its convolutions are
    timed (``measure``), and for a GPU + host RAM candidate ``host`` (``{"cal": the CPU's
    calibration, "model": its cost model}``): convolutions streamed through the device, every
    other step on the host."""

    timer: Pricer
    threads: int
    reps: Mapping[int, int] = field(default_factory=dict)  # node index -> runs per patch (absent: 1)
    pooling: Mapping[int, PoolingChoice] = field(default_factory=dict)  # absent: the node subsamples
    channels_last: frozenset = frozenset()  # pooling nodes whose input the executor holds channels last
    measure: bool = False
    host: dict | None = None

    @property
    def model(self) -> CostModel:
        """The cost model of the steps other than convolutions."""
        return self.host["model"] if self.host else self.timer.model

    def runs(self, r) -> int:
        """Times the node of walk record ``r`` runs per patch."""
        return self.reps.get(r.index, 1)


def priced_steps(net, records, ctx: StepContext) -> tuple[list[Step], float]:
    """The plan's steps of one candidate from its memory walk's ``records``
    (:class:`.memory.StepMemory`), each priced by :func:`step_of`; and their total seconds."""
    steps = [step_of(net.nodes[r.index].op, r, ctx) for r in records]
    return steps, sum(s.seconds for s in steps)


@functools.singledispatch
def step_of(op, r, ctx: StepContext) -> Step:
    """The plan's step of walk record ``r`` of a node with operator ``op``, with its predicted
    seconds.  One function per operator class (``tests/test_ops.py`` fails on a class without
    one).  A step the node before applies in its own pass (``r.skipped``: an activation in a
    conv's output pass) costs nothing; every other pass costs its time plus
    :data:`CALL_OVERHEAD_S`, per run."""
    raise TypeError(f"the cost model has no rule for {type(op).__name__}")


def _step(r, ctx: StepContext, prim: str, seconds: float, micro_batch: int = 0) -> Step:
    """A step of one pass of ``seconds`` (none when skipped), run ``ctx.runs(r)`` times."""
    seconds = 0.0 if r.skipped else (seconds + CALL_OVERHEAD_S) * ctx.runs(r)
    return Step(r.index, r.op, prim, r.in_shape, r.out_shape, micro_batch, ctx.threads, seconds, int(r.peak))


def _one_pass(r, ctx: StepContext) -> float:
    """A pass reading the input and writing the output."""
    return ctx.model.elementwise(M.nbytes(r.in_shape) + M.nbytes(r.out_shape), 1.0)


@step_of.register
def _(op: Convolution, r, ctx):
    # the primitive, micro-batch and input blocks the search chose (the walk keeps them); the
    # call overhead is in Pricer.layer's time, per call
    prim, mb, tile = r.choice[:3]
    n, spatial, reps = r.in_shape[0], r.spatial or r.in_shape[2:], ctx.runs(r)
    if ctx.host:
        secs = streamed_seconds(ctx.timer, prim, n, op.layer, spatial, mb, reps, tile, ctx.host["cal"])
    else:
        secs = ctx.timer.layer(prim, n, op.layer, spatial, mb, reps, ctx.measure, tile)
    if r.copy_bytes:  # its padded copy of the input
        secs += ctx.model.elementwise(r.copy_bytes, 2.0)
    blocks = M.conv_blocks(spatial, op.layer.kernel, tile)[0] if tile else ()
    mbv = 0 if mb >= n else mb
    return Step(r.index, r.op, prim, r.in_shape, r.out_shape, mbv, ctx.threads, secs, int(r.peak), blocks)


@step_of.register
def _(op: Act, r, ctx):
    return _step(r, ctx, op.act.kind, ctx.model.activation(op.act.kind, M.nbytes(r.in_shape)))


@step_of.register
def _(op: Pooling, r, ctx):
    mode = ctx.pooling.get(r.index) or Subsample(op.kind)
    if isinstance(mode, Subsample):  # one pass, no fragments
        secs = _one_pass(r, ctx)
    else:  # in fragments, at the calibrated rate of the layout it reads
        depth_first = isinstance(mode, DepthFirst)
        secs = ctx.model.pool(M.nbytes(r.in_shape), depth_first, channels_last=r.index in ctx.channels_last)
    return _step(r, ctx, mode.primitive, secs, mode.micro_batch)


@step_of.register
def _(op: Deconvolution, r, ctx):
    src, out = r.in_shape[1:], r.out_shape[1:]
    flops = 2.0 * r.in_shape[0] * math.prod(src) * out[0] * math.prod(op.stride)
    return _step(r, ctx, "gemm", flops / ctx.timer.cal.gemm_flops + ctx.model.elementwise(M.nbytes(r.out_shape), 3.0))


@step_of.register
def _(op: Resize, r, ctx):
    # one pass over the output either way (layers/resample: a linear voxel from up to 8 neighbours in
    # cache, 1.6-1.8x the nearest copy's time: 48 maps of 16 x 192^2, 8.4 against 4.6-5.4 ms)
    return _step(r, ctx, op.mode, ctx.model.elementwise(M.nbytes(r.out_shape), 3.0 if op.linear else 2.0))


def _passed(op, r, ctx):
    return _step(r, ctx, op.label, _one_pass(r, ctx))


for _cls in (Crop, Pad, Add, Mul, Affine, Concat):
    step_of.register(_cls, _passed)
