"""Running on a device: the memory pool capped at the plan's budget, the peak meter, and the
claim on a GPU shared by jobs.  Choosing the array module is :func:`znni_core.layers.xp.require_device`."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

from ..errors import MemoryBudgetError
from ..layers.xp import require_device
from ..plan.budget import device_headroom


@contextlib.contextmanager
def device_limits(xp, plan):
    """Run a GPU plan with the device's memory pool capped at the plan's budget plus the
    headroom the planner left (CUDA context, cuFFT plans): an allocation past it is the
    plan's fault, reported as a :class:`MemoryBudgetError` naming the plan's prediction,
    never a crash with the pool grown into the rest of the device."""
    pool = xp.get_default_memory_pool()
    old = pool.get_limit()
    total = int(xp.cuda.runtime.memGetInfo()[1])
    # CuPy's limit caps the bytes the pool holds, its cached free blocks too, and a block reused
    # from its cache is never checked against it: release them, so the cap bounds this run
    pool.free_all_blocks()
    pool.set_limit(size=min(total, pool.used_bytes() + plan.memory_budget + device_headroom(total)))
    try:
        yield
    except xp.cuda.memory.OutOfMemoryError as exc:
        raise MemoryBudgetError(
            f"the GPU ran out of memory running a plan that predicted {plan.predicted_peak_bytes / 1e6:.1f} MB "
            f"within a budget of {plan.memory_budget / 1e6:.1f} MB ({exc}); re-plan with a smaller memory budget "
            "(--memory) and report the plan (`znni plan`) as a memory-model error"
        ) from exc
    finally:
        pool.set_limit(size=old)


class PeakMeter:
    """The device memory a run takes from the pool: ``with PeakMeter(xp) as m: ...; m.peak``
    (bytes above what was in use on entry, at the highest point).  On CuPy a
    ``cupy.cuda.MemoryHook`` counts every block handed out and returned (arrays, cuFFT work
    areas, library workspaces: all come from the pool); the simulated GPU counts its own."""

    def __init__(self, xp):
        self.xp, self.peak, self._hook = xp, 0, None

    def __enter__(self):
        pool = self.xp.get_default_memory_pool()
        if getattr(self.xp, "simulated", False):
            pool.reset_peak()
            self._base = pool.used_bytes()
        else:
            self._hook = _cupy_hook(self.xp)()
            self._hook.__enter__()
        return self

    def __exit__(self, *exc):
        if self._hook is None:
            pool = self.xp.get_default_memory_pool()
            self.peak = pool.peak_bytes() - self._base
        else:
            self._hook.__exit__(*exc)
            self.peak = self._hook.peak
        return False


def _cupy_hook(cupy):
    class Hook(cupy.cuda.MemoryHook):
        name = "znni-peak"

        def __init__(self):
            self.used = self.peak = 0

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            self.used += mem_size
            self.peak = max(self.peak, self.used)

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            self.used -= mem_size

    return Hook


#: where the per-GPU lock files live (one task per GPU on a node); default: the temp directory
LOCK_DIR = "ZNNI_GPU_LOCK_DIR"
_HELD: list = []  # the GPU this process holds (nested claims reuse it)


@contextlib.contextmanager
def claimed_gpu(device: str, *, poll_s: float = 1.0):
    """One task per GPU on a node.  For a GPU device, take the first visible GPU no other
    znni process on this machine holds (an ``flock`` per device index, released with the
    process if it dies) and make it current; yields its index (``None`` for the CPU).
    Under SLURM ``--gpus=1`` a job sees one device, and takes it.  With every GPU taken
    (more jobs than GPUs: the workflow's ``gpu`` resource should prevent it) it waits."""
    if device == "cpu":
        yield None
        return
    xp = require_device(device)
    if _HELD:
        yield _HELD[-1]
        return
    n = int(xp.cuda.runtime.getDeviceCount())
    folder = Path(os.environ.get(LOCK_DIR) or tempfile.gettempdir())
    while True:
        for i in range(n):
            f = open(folder / f"znni-gpu{i}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            _HELD.append(i)
            try:
                with xp.cuda.Device(i):
                    yield i
            finally:
                _HELD.pop()
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        time.sleep(poll_s)
