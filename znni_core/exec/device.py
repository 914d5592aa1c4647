"""The one place CuPy is imported (lazily).  A GPU request without a usable device
fails with an actionable message."""
from __future__ import annotations

import contextlib
import os

from ..errors import DeviceError, MemoryBudgetError

#: set to a size (``2GiB``) to run ``device="gpu"`` on the simulated GPU (exec/simdevice.py): tests only
SIMULATED = "ZNNI_SIMULATED_GPU"


def cupy_module():
    """Return the ``cupy`` module if a CUDA device is usable, else raise :class:`DeviceError`."""
    try:
        import cupy
    except Exception as exc:  # not installed, or broken CUDA libraries
        raise DeviceError(f"device 'gpu' needs CuPy ({exc.__class__.__name__}: {exc}); install znni[gpu] "
                          "(cupy-cuda12x) on a machine with an NVIDIA GPU, or use device='cpu'") from exc
    try:
        if not cupy.is_available():
            raise RuntimeError("cupy.is_available() is False")
    except Exception as exc:
        raise DeviceError(f"device 'gpu' requested but no CUDA device is usable here ({exc}); use device='cpu'") from exc
    return cupy


def require_device(device: str):
    """Validate a device name; returns the array module for it."""
    if device == "cpu":
        import numpy

        return numpy
    if device in ("gpu", "cuda", "cpu+gpu"):  # cpu+gpu: the GPU stage's module
        if os.environ.get(SIMULATED):
            from . import simdevice

            return simdevice.module()
        return cupy_module()
    raise DeviceError(f"unknown device {device!r}; use 'cpu', 'gpu' or 'cpu+gpu'")


@contextlib.contextmanager
def device_limits(xp, plan):
    """Run a GPU plan with the device's memory pool capped at the plan's budget plus the
    headroom the planner left (CUDA context, cuFFT plans): an allocation past it is the
    plan's fault, reported as a :class:`MemoryBudgetError` naming the plan's prediction,
    never a crash with the pool grown into the rest of the device."""
    from ..plan.search import DEVICE_HEADROOM

    pool = xp.get_default_memory_pool()
    old = pool.get_limit()
    free, total = xp.cuda.runtime.memGetInfo()
    pool.set_limit(size=min(int(total), pool.used_bytes() + plan.memory_budget + min(DEVICE_HEADROOM, int(total) // 8)))
    try:
        yield
    except xp.cuda.memory.OutOfMemoryError as exc:
        raise MemoryBudgetError(
            f"the GPU ran out of memory running a plan that predicted {plan.predicted_peak_bytes / 1e6:.1f} MB "
            f"within a budget of {plan.memory_budget / 1e6:.1f} MB ({exc}); re-plan with a smaller memory budget "
            "(--memory) and report the plan (`znni plan`) as a memory-model error") from exc
    finally:
        pool.set_limit(size=old)
