"""Cost models: seconds for each step of a plan, behind one interface for the CPU and the GPU.

The search asks a :class:`CostModel` what a convolution, its one-off kernel build, an
element-wise pass, an activation, a pooling step and a host-device transfer cost; it never looks
at which device the model is for.  :class:`CpuCostModel` prices from the machine's calibration
(:mod:`.timing`), :class:`GpuCostModel` from the device's (:mod:`.gpu_timing`); a convolution's
price is its primitive's formula (:mod:`.primitives`).  A test passes
its own calibration dict to either class, so what a plan test expects does not depend on the host
it runs on.

>>> model = CpuCostModel({"mem_bw": 1e10})
>>> model.elementwise(10**9, passes=2.0)
0.2
>>> model.device
'cpu'
"""

from __future__ import annotations

from typing import Protocol

from ..net.spec import Conv
from . import gpu_timing as G
from . import timing as T
from .primitives import primitive as primitive_of


class CostModel(Protocol):
    """What the search prices a plan with; ``cal`` is the calibration it prices from."""

    device: str
    cal: dict

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
    """The CPU's time model, from :func:`.timing.calibrate`'s dict."""

    device = "cpu"

    def __init__(self, cal: dict):
        self.cal = cal

    def conv(self, primitive, n, layer, in_spatial, micro_batch=None) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).cpu_seconds(self.cal, n, layer, in_spatial, micro_batch)

    def setup(self, primitive, layer, in_spatial) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).cpu_setup_seconds(self.cal, layer, in_spatial)

    def elementwise(self, nbytes, passes=2.0) -> float:
        """See :class:`CostModel`."""
        return T.estimate_elementwise(nbytes, self.cal, passes)

    def activation(self, kind, nbytes) -> float:
        """See :class:`CostModel`."""
        return T.estimate_activation(kind, nbytes, self.cal)

    def pool(self, in_bytes, depth_first=False, channels_last=False) -> float:
        """See :class:`CostModel`."""
        return T.estimate_pool(in_bytes, self.cal, depth_first=depth_first, channels_last=channels_last)

    def transfer(self, nbytes, pinned=False) -> float:
        """See :class:`CostModel`: nothing moves."""
        return 0.0


class GpuCostModel(CpuCostModel):
    """The GPU's time model, from :func:`.gpu_timing.calibrate_device`'s dict: its own convolution,
    kernel-build and transfer prices; element-wise passes, activations and pooling at the device's
    memory bandwidth, as on the CPU."""

    device = "gpu"

    def conv(self, primitive, n, layer, in_spatial, micro_batch=None) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).gpu_seconds(self.cal, n, layer, in_spatial, micro_batch)

    def setup(self, primitive, layer, in_spatial) -> float:
        """See :class:`CostModel`."""
        return primitive_of(primitive).gpu_setup_seconds(self.cal, layer, in_spatial)

    def transfer(self, nbytes, pinned=False) -> float:
        """See :class:`CostModel`."""
        return G.transfer_seconds(nbytes, self.cal, pinned=pinned)
