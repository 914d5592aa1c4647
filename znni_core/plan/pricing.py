"""What a candidate's steps cost: the cost model's estimate, or (efforts ``measure`` and
``exhaustive``) the primitive timed on the real shapes; memoised for one search."""

from __future__ import annotations

import math

from . import gpu_timing as G
from . import memory as M
from . import timing as T
from .calibration import GpuCalibration
from .costs import CostModel, CpuCostModel, GpuCostModel
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
