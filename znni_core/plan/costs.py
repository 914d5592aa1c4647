"""Cost models: seconds for each step of a plan, behind one interface for the CPU and the GPU.

The search asks a :class:`CostModel` what a convolution, its one-off kernel build, an
element-wise pass, an activation, a pooling step and a host-device transfer cost; it never looks
at which device the model is for.  :class:`CpuCostModel` prices from the machine's calibration
(:mod:`.timing`), :class:`GpuCostModel` from the device's (:mod:`.gpu_timing`), both typed
records (:mod:`.calibration`); a convolution's price is its primitive's formula
(:mod:`.primitives`).  A test passes its own calibration to either class, so what a plan test
expects does not depend on the host it runs on.

>>> from .calibration import GpuCalibration
>>> model = GpuCostModel(GpuCalibration("simulated", 1e12, 1e10, 1e9, 2e9, 1e-10, 1e12))
>>> model.elementwise(10**9, passes=2.0), model.device
(0.2, 'gpu')
"""

from __future__ import annotations

from typing import Protocol

from ..net.chain import Conv
from . import gpu_timing as G
from .calibration import CpuCalibration, GpuCalibration
from .formulas import F32
from .primitives import primitive as primitive_of

#: activations that evaluate an exponential per value
TRANSCENDENTAL = ("elu", "sigmoid", "tanh", "softmax")

# Depth-first pooling against MPF, in memory traffic per input byte: MPF reads the input once
# and writes it once (its fragments); depth-first filters it in place (a read and a write), then
# each offset's copy reads the rows it samples (all offsets together: the input twice) and
# writes its fragment (together: once).  Measured in the engine (boundary net, 5 x 1035^2 at 48
# maps, window (1,2,2)): 0.44 s for the filter and copies where MPF's calibrated rate said 0.26 s
# and MPF itself ran at 0.65 of it.
DEPTH_FIRST_PASSES = 2.5


class CostModel(Protocol):
    """What the search prices a plan with; ``cal`` is the calibration it prices from."""

    device: str
    cal: CpuCalibration | GpuCalibration

    def conv(self, primitive: str, n: int, layer: Conv, in_spatial, micro_batch: int | None = None) -> float:
        """A conv layer over ``n`` fragments in micro-batches of ``micro_batch``."""

    def setup(self, primitive: str, layer: Conv, in_spatial) -> float:
        """Building a primitive's resident kernel transforms (once per run)."""

    def elementwise(self, nbytes: int, passes: float = 2.0) -> float:
        """``passes`` passes over ``nbytes`` at memory bandwidth."""

    def activation(self, kind: str, nbytes: int) -> float:
        """An activation over ``nbytes`` of float32, in place."""

    def pool(self, in_bytes: int, depth_first: bool = False, channels_last: bool = False) -> float:
        """A pooling step (MPF or depth-first) over an input of ``in_bytes``."""

    def transfer(self, nbytes: int, pinned: bool = False) -> float:
        """Host to device (or back) of ``nbytes``; 0 where there is no device."""


class CpuCostModel:
    """The CPU's time model, from :func:`.timing.calibrate`'s :class:`CpuCalibration`."""

    device = "cpu"

    def __init__(self, cal: CpuCalibration):
        self.cal = cal

    def conv(self, primitive, n, layer, in_spatial, micro_batch=None) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).cpu_seconds(self.cal, n, layer, in_spatial, micro_batch)

    def setup(self, primitive, layer, in_spatial) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).cpu_setup_seconds(self.cal, layer, in_spatial)

    def elementwise(self, nbytes, passes=2.0) -> float:
        """See :class:`CostModel`: at the calibrated memory bandwidth."""
        return passes * nbytes / self.cal.mem_bw

    def activation(self, kind, nbytes) -> float:
        """See :class:`CostModel`: a read and a write at memory bandwidth, or the calibrated
        exponential's rate where it has one and that is slower."""
        t = self.elementwise(nbytes, 1.0 if kind == "identity" else 2.0)
        if kind in TRANSCENDENTAL:
            t = max(t, nbytes / F32 * self.cal.exp_s_per_value)
        return t

    def pool(self, in_bytes, depth_first=False, channels_last=False) -> float:
        """See :class:`CostModel`: MPF at the calibrated MPF rate, channels first or
        ``channels_last``; depth-first pooling (the filter and every offset's fragment)
        :data:`DEPTH_FIRST_PASSES` times the channels-first rate."""
        cal = self.cal
        cl = channels_last and not depth_first and cal.pool_cl_s_per_byte is not None
        rate = cal.pool_cl_s_per_byte if cl else cal.pool_s_per_byte
        return in_bytes * rate * (DEPTH_FIRST_PASSES if depth_first else 1.0)

    def transfer(self, nbytes, pinned=False) -> float:
        """See :class:`CostModel`: nothing moves."""
        return 0.0


class GpuCostModel(CpuCostModel):
    """The GPU's time model, from :func:`.gpu_timing.calibrate_device`'s :class:`GpuCalibration`:
    its own convolution, kernel-build and transfer prices; element-wise passes, activations and
    pooling at the device's memory bandwidth (pooling 1.5 passes)."""

    device = "gpu"

    def activation(self, kind, nbytes) -> float:
        """See :class:`CostModel`: a read and a write at the device's bandwidth."""
        return self.elementwise(nbytes, 1.0 if kind == "identity" else 2.0)

    def pool(self, in_bytes, depth_first=False, channels_last=False) -> float:
        """See :class:`CostModel`: 1.5 passes at the device's bandwidth (depth-first
        :data:`DEPTH_FIRST_PASSES` times that)."""
        return self.elementwise(in_bytes, 1.5) * (DEPTH_FIRST_PASSES if depth_first else 1.0)

    def conv(self, primitive, n, layer, in_spatial, micro_batch=None) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).gpu_seconds(self.cal, n, layer, in_spatial, micro_batch)

    def setup(self, primitive, layer, in_spatial) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).gpu_setup_seconds(self.cal, layer, in_spatial)

    def transfer(self, nbytes, pinned=False) -> float:
        """See :class:`CostModel`."""
        return G.transfer_seconds(nbytes, self.cal, pinned=pinned)
