"""The convolution primitives, one object each, in one registry.

A :class:`Primitive` knows everything the planner and the executor ask of it:

- what it runs: the devices (``cpu``, ``gpu``), the kernels and channel counts it supports;
- its memory: a call's peak (output and workspace) and what it keeps for the whole run (kernel
  transforms built once: FFT spectra, Winograd's ``U``);
- its time under the CPU's calibration and under a GPU's (the rates :mod:`.timing` and
  :mod:`.gpu_timing` measure, in the forms of :mod:`.formulas`), and the one-off build of
  what it keeps;
- how to build a configured callable (weights on the device, the fused activation, the output
  layout) for the executor and the measurements.

The planner iterates :data:`PRIMITIVES` and reads the primitives' attributes; no other module
switches on a primitive's name.  A per-host variant of a primitive (tile sizes, vector widths) is
a kernel parameter chosen by measurement (:mod:`znni_core.layers.tuning`), not a new entry.

>>> [p.name for p in PRIMITIVES.values() if "cpu" in p.devices][:3]
['direct-gemm', 'direct-numba', 'fft-data']
>>> primitive("winograd").supports((1, 3, 3), (24, 24)), primitive("winograd").supports((1, 7, 7))
(True, False)
"""

from __future__ import annotations

import math

import numpy as np

from .. import layers as L
from ..errors import PlanError
from ..layers.direct import reads_channels_last as direct_reads_channels_last
from ..layers.epilogue import FUSABLE
from ..layers.resample import conv_strided, conv_strided_memory, conv_strided_out_shape
from ..layers.torch_conv import TorchConv, torch_conv_memory
from ..layers.winograd import winograd_supports
from . import formulas as F
from .calibration import CpuCalibration, GpuCalibration

# Winograd's saving is in the per-position channel products; with one channel on a side they are
# outer products or dot products, and the transforms (more values than the direct loop touches)
# are the whole cost: the synapse detector's 1 -> 28 (1,5,5) layer ran 90-100 ms in winograd
# (model: 20 ms), 15-30 ms direct; the boundary net's 1 -> 48 (1,4,4) 231 ms against 56 ms in
# direct-numba.  n337's 24 -> 3 3^3 layer still gains (152 ms against 238 ms direct-gemm).
WINOGRAD_MIN_CHANNELS = 2
#: fft-gemm on overlap-save blocks ran this much slower per block than its calibrated
#: estimate (strided pads and crops, short transforms: boundary net (1,5,5) 48 maps on
#: 4 x 15 x 133^2, 48^2 blocks 0.075-0.10 s each against 0.054 predicted, 0.9 s in all
#: against 0.53 s for whole planes, which the model predicts within 15%).  Not applied to
#: the other FFT primitives: n726's first layer ran faster on 48^3 fft-task blocks
#: (4.2 s for the net against 4.7-4.9 s with direct-gemm there)
BLOCK_SLOWDOWN = 1.6


def _shapes(layer, in_spatial):
    """(C_in, C_out, kernel, output spatial) of ``layer`` on ``in_spatial``."""
    k = tuple(int(v) for v in layer.kernel)
    return layer.in_channels, layer.out_channels, k, [s - kk + 1 for s, kk in zip(in_spatial, k)]


class Primitive:
    """A valid 3-D convolution algorithm; subclasses set the attributes and the formulas."""

    name = ""
    #: where it runs
    devices: frozenset = frozenset({"cpu", "gpu"})
    #: kernel transforms built on first use and kept for the whole run (memory: :meth:`resident_bytes`)
    resident = False
    #: applies an activation of ``layers.epilogue.FUSABLE`` that directly follows it in its own
    #: output pass (on data still in cache): the executor fuses it, the planner charges it nothing
    fuses_act = False
    #: reads a zero-padded convolution's input in place (no padded copy: ``ResidentConv.PADS_INPUT``)
    pads_input = False
    #: transforms every axis (an FFT): pays for a kernel 1 deep on an axis for nothing; the search
    #: tries it on overlap-save input blocks
    transforms_all_axes = False
    #: searched on overlap-save input blocks (``plan.candidates.fft_tiles``)
    blocked = False
    #: searched for the convolutions of a graph that is not a chain (padded inputs, strides)
    in_graphs = True
    #: planned for graph networks on the CPU by default
    graph_default = True
    #: planned for the GPU by default (the ones whose device memory the model predicts, checked on
    #: the simulated GPU and an H100); the others run there when asked for
    gpu_default = False
    #: time per block relative to the estimate when run on overlap-save blocks
    block_slowdown = 1.0
    #: considered for 1x1x1 convolutions
    runs_1x1x1 = True
    #: runs convolutions with a stride above 1 (a :class:`~znni_core.net.graph.StridedConv`), and
    #: only those: the graph search gives a strided convolution to these, every other one to the rest
    strides = False

    def supports(self, kernel, channels=None) -> bool:
        """Whether the planner considers it for a convolution with this kernel and ``channels``
        ``(C_in, C_out)`` when given."""
        return True

    def reads_channels_last(self, kernel, channels=None, in_spatial=None) -> bool:
        """Whether an untiled call on one input reads a channels-last input (:mod:`~znni_core.layers.layout`)
        at full speed, so the step before may write one; ``channels`` ``(C_in, C_out)`` and
        ``in_spatial`` the layer's where known (None: not known, as while a step is priced)."""
        return False

    def runs_pointwise_chain(self, kernel) -> bool:
        """Whether a conv with this kernel runs in a chain of 1x1x1 convs, block by block in cache
        (``layers.conv_pointwise_chain``), with the 1x1x1 convs and activations next to it."""
        return False

    #: a call can write its output channels last (``build(channels_last=True)``)
    writes_channels_last = False

    def fuses(self, kind: str) -> bool:
        """Whether it applies an activation ``kind`` that directly follows it in its output pass."""
        return self.fuses_act and kind in FUSABLE

    # ---- memory
    def call_bytes(self, n: int, layer, in_spatial, threads: int = 1) -> int:
        """Peak bytes one call over ``n`` items allocates (output + workspace, not its input)."""
        raise NotImplementedError

    def resident_bytes(self, layer, in_spatial) -> int:
        """Bytes kept for the whole run (kernel transforms), built on first use."""
        return 0

    # ---- time
    def cpu_seconds(self, cal: CpuCalibration, n: int, layer, in_spatial, micro_batch: int | None = None) -> float:
        """Seconds for ``n`` items in micro-batches of ``micro_batch`` under the CPU's calibration."""
        raise NotImplementedError

    def cpu_setup_seconds(self, cal: CpuCalibration, layer, in_spatial) -> float:
        """Seconds to build what it keeps for the run, on the CPU."""
        return 0.0

    def gpu_seconds(self, cal: GpuCalibration, n: int, layer, in_spatial, micro_batch: int | None = None) -> float:
        """Seconds for ``n`` items in micro-batches under a GPU's calibration."""
        raise PlanError(f"no GPU time model for primitive {self.name!r}")

    def gpu_setup_seconds(self, cal: GpuCalibration, layer, in_spatial) -> float:
        """Building the resident kernel transforms on the device: a few passes over them."""
        b = self.resident_bytes(layer, in_spatial)
        return 4.0 * b / cal.mem_bw + 1e-3 if b else 0.0

    # ---- the callable
    def build(self, layer, in_spatial, *, xp=np, threads: int = 1, act=None, channels_last=False, cache=None, key=None):
        """A callable ``y = fn(x)`` over ``(N, C_in) + in_spatial`` arrays of ``xp``: the layer's
        weights (on the device once per run), ``act`` (``(kind, alpha)``, a fused activation, or
        None) applied in its output pass.  ``channels_last``: the output is written channels last
        where the primitive can.  ``cache`` (a dict the caller keeps for the run, keyed by
        ``layer``): what is built once per run (weights on the device, kernel transforms) is
        looked up there first, under ``key`` (the plan step's index; ``id(layer)`` by default)."""
        raise NotImplementedError

    def __repr__(self):
        return f"<primitive {self.name}>"


def _weights(layer, xp, cache, key):
    """``(w, b)`` of ``layer`` as ``xp`` arrays: moved to the device once per run (``cache``)."""
    if xp is np:
        return layer.weight, layer.bias
    key = ("weights", id(layer) if key is None else key)
    if cache is None or key not in cache:
        got = (xp.asarray(layer.weight), None if layer.bias is None else xp.asarray(layer.bias))
        if cache is None:
            return got
        cache[key] = got
    return cache[key]


class DirectGemm(Primitive):
    """Lowering (im2col) and one GEMM per item; a 1x1x1 convolution is a GEMM on the input in
    place (``conv_pointwise_chain`` on the CPU: blocks in cache, channels-last input read in place)."""

    name = "direct-gemm"
    fuses_act = True
    gpu_default = True

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`."""
        return int(L.conv_direct_gemm_memory(n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel))

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`.

        The calibrated rates include writing a 25 MB output that stays near the cache; larger
        outputs pay their passes at memory bandwidth: the lowered block, the product and the
        output (3 passes; a 1x1x1 conv: the product in place).  First layers (C_in = 1) of EM
        nets: 1 x 15 x 270^2 -> 48 maps (1,4,4) ran 15 GFLOP/s here against 37 in direct-numba,
        calibrated 53 and 45 at K = 27.  The fragments are looped over in Python (a matmul call
        and its lowering per fragment: 60-80 us each, on 256-512 fragments of the boundary net
        and n337)."""
        cin, cout, k, out = _shapes(layer, in_spatial)
        flops = 2.0 * n * cin * cout * math.prod(k) * math.prod(out)
        out_bytes = F.F32 * n * cout * math.prod(out)
        if math.prod(k) == 1 and cal.pointwise_points:
            # run in a chain (conv_pointwise_chain): calibrated at 24 and 48 maps (log-log between,
            # clamped outside); memory-bound when the product is thin (200 maps -> 1)
            rate = F.loglog(cal.pointwise_points, cin)
            return max(flops / rate, F.F32 * n * (cin + cout) * math.prod(out) / cal.mem_bw) + n * F.DIRECT_ITEM_S
        # traffic: the lowered block (C_in x kernel values per output voxel, written then read by
        # the product), the product and the output.  Counting the lowering as one output's worth
        # missed thin products: the detector's 28 -> 1 (1,5,5) layer (700 values lowered per
        # voxel) ran 70 ms, modelled 8 ms
        lowered = F.F32 * n * cin * math.prod(k) * math.prod(out)
        return (
            flops / F.direct_rate("gemm", cin * math.prod(k), cal)
            + (lowered + 2 * out_bytes) / cal.mem_bw
            + n * F.DIRECT_ITEM_S
        )

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: im2col written and read, one GEMM."""
        cin, cout, k, out = _shapes(layer, in_spatial)
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        flops = 2.0 * n * cin * cout * math.prod(k) * math.prod(out)
        x_bytes, y_bytes = F.F32 * n * cin * math.prod(in_spatial), F.F32 * n * cout * math.prod(out)
        lowered = 0 if math.prod(k) == 1 else 2 * F.F32 * n * cin * math.prod(k) * math.prod(out)
        launches = 1 if math.prod(k) == 1 else 8
        return flops / cal.gemm_flops + (x_bytes + y_bytes + lowered) / cal.mem_bw + calls * F.LAUNCH_S * launches

    def reads_channels_last(self, kernel, channels=None, in_spatial=None):
        """See :class:`Primitive`: a 1x1x1 conv (a GEMM on the input in place)."""
        return math.prod(kernel) == 1

    def runs_pointwise_chain(self, kernel):
        """See :class:`Primitive`: a 1x1x1 conv."""
        return math.prod(kernel) == 1

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive`."""
        w, b = _weights(layer, xp, cache, key)
        if xp is np and math.prod(layer.kernel) == 1:
            return lambda x: L.conv_pointwise_chain(x, [(w, b, act)], threads=threads, channels_last=channels_last)
        return lambda x: L.conv_direct_gemm(x, w, b, act=act)


class DirectNumba(Primitive):
    """The direct loop nest compiled by numba (CPU only): sums of 3-5 taps of a row in
    registers, whole blocks of 4 output channels, short rows grouped."""

    name = "direct-numba"
    devices = frozenset({"cpu"})
    fuses_act = True
    # a 1x1x1 conv is one GEMM with no lowering in direct-gemm; the loop nest's per-row overhead
    # is not in the rate model (boundary net 200 -> 1 on 256 fragments of 15 x 11^2: 0.08 s
    # against 0.02 s, estimated the other way round)
    runs_1x1x1 = False
    # channels last where every reader takes it (the first layer of a U-Net feeding Winograd: the
    # transposition cost the next layer 8 ms of 34 on 24 maps of 16 x 192^2)
    writes_channels_last = True

    def reads_channels_last(self, kernel, channels=None, in_spatial=None):
        """See :class:`Primitive`: a few output channels (``layers.direct.reads_channels_last``:
        a U-Net's last layer after a channels-last decoder); not where the input's shape is not
        known yet (a step being priced)."""
        return (
            channels is not None
            and in_spatial is not None
            and direct_reads_channels_last(channels[0], channels[1], in_spatial, kernel)
        )

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`."""
        return int(
            L.conv_direct_numba_memory(n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel)
        )

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: the calibrated rate of register tiles at this reduction length,
        for rows too short for them the grouped rows' rate, each scaled by its efficiency on
        these shapes (n337's 24 -> 3 layer on 512 x 8^3 fragments: 4x below the rows' rate), and
        the output written once at memory bandwidth."""
        cin, cout, k, out = _shapes(layer, in_spatial)
        flops = 2.0 * n * cin * cout * math.prod(k) * math.prod(out)
        out_bytes = F.F32 * n * cout * math.prod(out)
        reduction = cin * math.prod(k)
        rate = F.direct_rate("numba", reduction, cal) * L.direct_numba_efficiency(cout, in_spatial, layer.kernel)
        if not L.direct_numba_tiles(in_spatial, layer.kernel):
            # grouped rows: their calibrated rate against the tiles' at the same reduction length
            rows = cal.numba_flops / L.direct_numba_efficiency(24, *F.NUMBA_CALIBRATION_SHAPE)
            rate *= rows / F.direct_rate("numba", 24 * 27, cal)
        return flops / rate + out_bytes / cal.mem_bw

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive`."""
        if xp is not np:
            raise PlanError("direct-numba is a CPU primitive; re-plan for the GPU")
        return lambda x: L.conv_direct_numba(x, layer.weight, layer.bias, act=act, channels_last=channels_last)


class FFT(Primitive):
    """Pruned FFT convolution (ZNNi): ``fft-data`` and ``fft-task`` keep the kernel spectra for the
    run (parallel over data or over tasks), ``fft-stream`` transforms the kernels in every call."""

    transforms_all_axes = True
    blocked = True
    runs_1x1x1 = False  # a 1x1x1 conv is one GEMM: transforms never pay

    def __init__(self, mode: str):
        self.mode = mode
        self.name = f"fft-{mode}"
        self.resident = mode in ("data", "task")
        self.in_graphs = self.graph_default = mode == "data"
        self.devices = frozenset({"cpu", "gpu"}) if mode == "data" else frozenset({"cpu"})

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`: resident spectra are counted once, in :meth:`resident_bytes`."""
        args = (n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel)
        return int(L.fft_conv_memory(*args, mode=self.mode, threads=threads, cache=False))

    def resident_bytes(self, layer, in_spatial):
        """See :class:`Primitive`."""
        if not self.resident:
            return 0
        return int(L.fft_kernel_cache_bytes(layer.in_channels, layer.out_channels, tuple(in_spatial)))

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: transforms (``v log v``) and spectral products, slower at
        sizes away from the calibration's; every micro-batch pays its own transform set-up."""
        cin, cout = layer.in_channels, layer.out_channels
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        rates = cal.fft
        r = rates[self.mode]
        v = math.prod(L.fft_shape(in_spatial))
        vlog = v * math.log2(max(v, 2))
        t = n * (cin + cout) * vlog * r["s_per_vlogv"] + n * cin * cout * (v / 2) * r["s_per_mac"]
        t *= F.size_factor(v, rates, "call", self.mode)
        t += (calls - 1) * 1e-4 * (cin + cout)
        if not self.resident:
            t += calls * cin * cout * vlog * r["s_per_kernel_vlogv"] * F.size_factor(v, rates, "kernel")
        return t

    def cpu_setup_seconds(self, cal, layer, in_spatial):
        """See :class:`Primitive`: the kernel spectra, once per run."""
        if not self.resident:
            return 0.0
        v = math.prod(L.fft_shape(in_spatial))
        rate = cal.fft["build_s_per_kernel_vlogv"] * F.size_factor(v, cal.fft, "build")
        return layer.in_channels * layer.out_channels * v * math.log2(max(v, 2)) * rate

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive` (``fft-data`` only)."""
        if self.mode != "data":
            return super().gpu_seconds(cal, n, layer, in_spatial, micro_batch)
        tshape = L.fft_shape(in_spatial)
        f = math.prod(tshape[:2]) * (tshape[2] // 2 + 1)
        return _gpu_fft_seconds(cal, n, layer, in_spatial, micro_batch, n, math.prod(tshape), f)

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive` (no fused activation: the executor applies it)."""
        shape = tuple(int(v) for v in in_spatial)
        if not self.resident:  # no kernel spectra kept: cheap to build
            return L.FFTConv(layer.weight, layer.bias, shape, threads=threads, mode=self.mode, xp=xp)
        return _resident(
            cache,
            key,
            layer,
            shape,
            lambda: L.FFTConv(layer.weight, layer.bias, shape, threads=threads, mode=self.mode, xp=xp),
        )


def _resident(cache, key, layer, shape, make):
    """The kernel-transform object of ``layer`` on ``shape`` kept in ``cache`` for the run.  One
    entry per layer: another shape (a small input's tile) replaces it, so at most one set of
    transforms per layer is ever alive, as the memory model assumes."""
    if cache is None:
        return make()
    key = ("resident", id(layer) if key is None else key)
    hit = cache.get(key)
    if hit is None or hit.in_spatial != shape:
        cache.pop(key, None)
        del hit
        cache[key] = make()
    return cache[key]


def _gpu_fft_seconds(cal, n, layer, in_spatial, micro_batch, items, v, f) -> float:
    """FFT-based convolution on the device: transforms, complex products as real FLOPs, and the
    transposes to and from frequency-major at memory bandwidth."""
    cin, cout, k, out = _shapes(layer, in_spatial)
    calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
    x_bytes, y_bytes = F.F32 * n * cin * math.prod(in_spatial), F.F32 * n * cout * math.prod(out)
    vlog = v * math.log2(max(v, 2))
    transforms = items * (cin + cout) * vlog * cal.fft_s_per_vlogv
    macs = 8.0 * items * cin * cout * f
    spectra = F.C64 * items * f * (2 * cin + 3 * cout)
    return transforms + macs / cal.gemm_flops + (spectra + x_bytes + 2 * y_bytes) / cal.mem_bw + calls * 10 * F.LAUNCH_S


class FFTGemm(Primitive):
    """FFT convolution whose channel sums are per-frequency GEMMs; axes 1 deep in the kernel are
    folded into the batch (2D transforms per z slice of a (1, k, k) kernel)."""

    name = "fft-gemm"
    resident = True
    fuses_act = True
    blocked = True
    graph_default = False
    gpu_default = True
    block_slowdown = BLOCK_SLOWDOWN

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`."""
        args = (n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel)
        return int(L.fft_gemm_memory(*args, threads=threads))

    def resident_bytes(self, layer, in_spatial):
        """See :class:`Primitive`."""
        return int(L.fft_gemm_kernel_bytes(layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel))

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`.  Each frequency's product has ``items`` rows: below
        ``FFT_GEMM_ROWS`` it runs as a matrix-vector product, memory-bound on the kernel spectra
        (one item of a 40 x 96^2 3^3 layer: 3x slower than at the calibrated 16-32 rows), and
        every call streams all the spectra once."""
        cin, cout = layer.in_channels, layer.out_channels
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        r = cal.fft["gemm"]
        tr, macs, items = F.fft_gemm_terms(n, cin, cout, in_spatial, layer.kernel)
        short = max(1.0, F.FFT_GEMM_ROWS / items)
        stream = calls * L.fft_gemm_kernel_bytes(cin, cout, in_spatial, layer.kernel) / cal.mem_bw
        return tr * r["s_per_transform"] + macs * r["s_per_mac"] * short + stream + (calls - 1) * 1e-4

    def cpu_setup_seconds(self, cal, layer, in_spatial):
        """See :class:`Primitive`."""
        values = L.fft_gemm_kernel_bytes(layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel) / 8
        return values * cal.fft["gemm"]["build_s_per_value"]

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`."""
        k = tuple(layer.kernel)
        tshape = L.fft_gemm_transform_shape(in_spatial, k)
        items, v, f = L.fft_gemm_sizes(n, in_spatial, k)
        f = f or math.prod(tshape[:2]) * (tshape[2] // 2 + 1)
        return _gpu_fft_seconds(cal, n, layer, in_spatial, micro_batch, items, v, f)

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive`."""
        shape = tuple(int(v) for v in in_spatial)
        base = _resident(
            cache, key, layer, shape, lambda: L.FFTGemmConv(layer.weight, layer.bias, shape, threads=threads, xp=xp)
        )
        return base.configured(act=act)


class Winograd(Primitive):
    """Winograd's minimal filtering (kernels of 1-3 in z, 1-5 in y and x): channel sums as
    per-position GEMMs on transformed tiles; reads a zero-padded input in place and can write
    its output channels last."""

    name = "winograd"
    resident = True
    fuses_act = True
    pads_input = True
    writes_channels_last = True

    def reads_channels_last(self, kernel, channels=None, in_spatial=None):
        """See :class:`Primitive`."""
        return True

    def supports(self, kernel, channels=None):
        """See :class:`Primitive`: 1-5 on every axis, not all 1, and at least
        :data:`WINOGRAD_MIN_CHANNELS` on both sides."""
        return winograd_supports(kernel) and (channels is None or min(channels) >= WINOGRAD_MIN_CHANNELS)

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`."""
        args = (n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel)
        return int(L.winograd_memory(*args, threads=threads))

    def resident_bytes(self, layer, in_spatial):
        """See :class:`Primitive`."""
        return int(L.winograd_kernel_bytes(layer.in_channels, layer.out_channels, layer.kernel, tuple(in_spatial)))

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`.  Calibrated on (1,3,3): two 1D transform passes per value each
        way; a 3D kernel makes three (n337's 3^3 layers: measured 1.5-1.8x the two-pass
        prediction)."""
        cin, cout = layer.in_channels, layer.out_channels
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        r = cal.fft["winograd"]
        values, macs, rows, positions = F.winograd_terms(n, cin, cout, in_spatial, layer.kernel)
        passes = sum(1 for k in layer.kernel if int(k) > 1) / 2
        return (
            values * r["s_per_value"] * passes
            + rows * r["s_per_row"]
            + positions * r["s_per_position"]
            + macs * F.loglog(r["mac_points"], cin)
            + calls * 1e-4
        )

    def cpu_setup_seconds(self, cal, layer, in_spatial):
        """See :class:`Primitive`."""
        values = self.resident_bytes(layer, in_spatial) / F.F32
        return values * cal.fft["winograd"]["build_s_per_value"]

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`."""
        cin, cout, k, _ = _shapes(layer, in_spatial)
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        values, macs, *_ = F.winograd_terms(n, cin, cout, in_spatial, k)
        return 2.0 * macs / cal.gemm_flops + 6 * F.F32 * values / cal.mem_bw + calls * 12 * F.LAUNCH_S

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive`."""
        shape = tuple(int(v) for v in in_spatial)
        base = _resident(
            cache, key, layer, shape, lambda: L.WinogradConv(layer.weight, layer.bias, shape, threads=threads, xp=xp)
        )
        return base.configured(act=act, channels_last=channels_last and xp is np)


class DirectTorch(Primitive):
    """cuDNN through PyTorch (GPU only; the weights stay on the device for the run)."""

    name = "direct-torch"
    devices = frozenset({"gpu"})
    fuses_act = True
    graph_default = False

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`."""
        return int(torch_conv_memory(n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel))

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: not a CPU primitive."""
        raise PlanError("direct-torch (cuDNN through PyTorch) is a GPU primitive; plan with device 'gpu'")

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: one GEMM's FLOPs, input and output once."""
        cin, cout, k, out = _shapes(layer, in_spatial)
        calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
        flops = 2.0 * n * cin * cout * math.prod(k) * math.prod(out)
        x_bytes, y_bytes = F.F32 * n * cin * math.prod(in_spatial), F.F32 * n * cout * math.prod(out)
        launches = 1 if math.prod(k) == 1 else 8
        return flops / cal.gemm_flops + (x_bytes + y_bytes) / cal.mem_bw + calls * F.LAUNCH_S * launches

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive`."""
        key = ("torch", id(layer) if key is None else key)
        if cache is None or key not in cache:
            made = TorchConv(layer.weight, layer.bias, xp)
            if cache is None:
                return made.configured(act=act)
            cache[key] = made
        return cache[key].configured(act=act)


def _stride(layer) -> tuple:
    """A :class:`~znni_core.net.graph.StridedConv`'s stride; 1 for a plain :class:`~znni_core.net.chain.Conv`."""
    return tuple(getattr(layer, "stride", (1, 1, 1)))


class StridedGemm(Primitive):
    """A convolution with a stride above 1 (a graph's downsampling conv): each output voxel's
    window gathered through a strided view, then one GEMM per block of output planes
    (``layers.resample.conv_strided``), on any array module."""

    name = "strided"
    strides = True
    #: the gathered (not contiguous) lowering costs this much more than the direct GEMM's
    GATHER_SLOWDOWN = 1.5

    @staticmethod
    def _equivalent(layer, in_spatial):
        """The stride-1 input that gives the same output voxels, which the GEMM's work is priced on."""
        out = conv_strided_out_shape(in_spatial, layer.kernel, _stride(layer))
        return tuple(o + k - 1 for o, k in zip(out, layer.kernel))

    def call_bytes(self, n, layer, in_spatial, threads=1):
        """See :class:`Primitive`: the output, one lowered block and its product."""
        return int(
            conv_strided_memory(
                n, layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel, _stride(layer)
            )
        )

    def cpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: the direct GEMM's time on the same output, gathered."""
        eq = self._equivalent(layer, in_spatial)
        return PRIMITIVES[FALLBACK].cpu_seconds(cal, n, layer, eq, micro_batch) * self.GATHER_SLOWDOWN

    def gpu_seconds(self, cal, n, layer, in_spatial, micro_batch=None):
        """See :class:`Primitive`: the direct GEMM's time on the same output, gathered."""
        eq = self._equivalent(layer, in_spatial)
        return PRIMITIVES[FALLBACK].gpu_seconds(cal, n, layer, eq, micro_batch) * self.GATHER_SLOWDOWN

    def build(self, layer, in_spatial, *, xp=np, threads=1, act=None, channels_last=False, cache=None, key=None):
        """See :class:`Primitive` (``act`` is applied after the call: it does not fuse)."""
        w, b = _weights(layer, xp, cache, key)

        def run(x):
            y = conv_strided(x, w, b, _stride(layer))
            return y if act is None else L.apply_activation(y, act[0], act[1], out=y)

        return run


#: every primitive by name, in the order the planner tries them
PRIMITIVES: dict[str, Primitive] = {
    p.name: p
    for p in (
        DirectGemm(),
        DirectNumba(),
        FFT("data"),
        FFT("task"),
        FFT("stream"),
        FFTGemm(),
        Winograd(),
        DirectTorch(),
        StridedGemm(),
    )
}


#: the primitive every convolution can run on every device: the planner's fallback
FALLBACK = "direct-gemm"


def primitive(name: str) -> Primitive:
    """The registered primitive ``name``; a :class:`PlanError` naming the known ones otherwise."""
    try:
        return PRIMITIVES[name]
    except KeyError:
        raise PlanError(f"unknown convolution primitive {name!r}; choose from {tuple(PRIMITIVES)}") from None


def names(device: str | None = None, **attrs) -> tuple:
    """Names of the primitives that run on ``device`` (any when None) and have the attribute
    values ``attrs`` (``names("gpu", gpu_default=True)``)."""
    return tuple(
        p.name
        for p in PRIMITIVES.values()
        if (device is None or device in p.devices) and all(getattr(p, k) == v for k, v in attrs.items())
    )
