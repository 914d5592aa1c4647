"""How much memory and how many threads a plan may use when the caller does not say.

CPU plans default to :data:`DEFAULT_BUDGET_FRACTION` of the RAM available when planning and to
the cores of this process's affinity; GPU plans to the device's free memory less a headroom for
the CUDA context, libraries and cuFFT plans.
"""

from __future__ import annotations

import os

from ..errors import MemoryBudgetError
from ..layers.xp import require_device
from ..units import format_bytes
from . import gpu_timing as G

DEFAULT_BUDGET_FRACTION = 0.5  # of the RAM available when planning
DEVICE_HEADROOM = 512 * 2**20  # device memory left to the CUDA context, library handles and cuFFT plans
GPU_BUDGET_FRACTION = 0.9  # of the device memory free when planning (after the headroom)


def device_headroom(total: int) -> int:
    """Device memory no plan may use: :data:`DEVICE_HEADROOM`, at most an eighth of a small device."""
    return min(DEVICE_HEADROOM, int(total) // 8)


def default_budget() -> int:
    """The memory budget without one given: :data:`DEFAULT_BUDGET_FRACTION` of the RAM available now."""
    # lazy: loads psutil only when called
    import psutil

    return int(psutil.virtual_memory().available * DEFAULT_BUDGET_FRACTION)


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def device_budget(memory_budget):
    """The device memory budget (bytes), the device's calibration and its array module.  The default is the
    free memory less :data:`DEVICE_HEADROOM`, times :data:`GPU_BUDGET_FRACTION`; a budget
    larger than the device (less the headroom) is refused here, at plan time."""
    xp = require_device("gpu")
    free, total = (int(v) for v in xp.cuda.runtime.memGetInfo())
    headroom = device_headroom(total)
    if memory_budget is not None:
        if int(memory_budget) > total - headroom:
            raise MemoryBudgetError(
                f"memory budget {format_bytes(int(memory_budget))} is more than the GPU holds: {format_bytes(total)} less "
                f"{format_bytes(headroom)} for the CUDA context and libraries; give at most {format_bytes(total - headroom)}"
            )
        budget = int(memory_budget)
    else:
        budget = int(max(0, free - headroom) * GPU_BUDGET_FRACTION)
    return budget, G.calibrate_device(xp), xp
