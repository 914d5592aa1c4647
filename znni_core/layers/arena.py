"""Output buffers reused from patch to patch (and layer to layer) instead of fresh pages.

A layer's output is hundreds of MB (the boundary net's first layer: 48 x 15 x 267^2 floats,
205 MB).  Fresh from the OS, every page is zeroed by the kernel on first touch: the boundary
net's 1.8 GB of outputs per patch cost 0.2-0.5 s of system time per call, 15-25% of the call.
An :class:`Arena` keeps the buffers a run has freed and hands them out again, to the same
layer on the next patch (the shapes recur) or to a later layer of a similar size.

Memory stays within the plan: the freed buffers an arena holds never exceed ``cap`` (the plan's
budget less its predicted peak: the slack the budget leaves), so the run's footprint is at most
its predicted peak plus ``cap``.  A buffer returns to the arena when the last array viewing it
is gone (a weakref finalizer; the buffer sits behind a memoryview, so numpy's views keep
the handed-out array alive rather than skipping to the buffer).

Layers ask :func:`empty`; it uses the arena made current by :func:`using` (the executor sets one
per plan around each patch), else ``xp.empty``: the GPU, and layers called directly, are
unchanged.

Buffers larger than that slack still go back to the OS and come back as fresh pages: on a
15 x 526^2 boundary-net patch (peak 1.45 GB of a 2 GiB budget) 6.5 GB per call, 3.5 s of system
time in an 8.5 s call on this VM.  :func:`retain_freed_memory` (the executor calls it once per
process) has glibc keep what the process frees for its next allocations: no ``mmap`` per large
array, no trimming of the heap's top; the same call then took 6.0 s with 0.02 s of system time,
its peak RSS 7% higher.  ``release_cache()`` hands the kept memory back (``malloc_trim``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import math
import os
import sys
import threading
import weakref

import numpy as np

__all__ = ["Arena", "empty", "using"]

#: below this, numpy's allocator (glibc's heap) already reuses memory
MIN_BYTES = 1 << 20
#: a freed buffer serves a request down to 1 / (1 + SLACK) of its size.  A net's outputs shrink
#: layer by layer (the boundary net's 168, 167, 159, 157, 146, 142, 120, 92 MB on an 8 x 334^2
#: patch): at 0.125 most missed the buffers held and took fresh pages, 1.1 GB touched by a
#: job's first call; at 1.0 0.7 GB, its peak RSS 1.6 -> 1.07 GB
SLACK = 1.0

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("znni_arena", default=None)


class Arena:
    """Freed output buffers of one plan's run, at most ``cap`` bytes of them held.

    >>> a = Arena(cap=1 << 30)
    >>> x = a.empty((4, 1 << 18)); x[:] = 1; del x
    >>> y = a.empty((4, 1 << 18)); (a.hits, a.misses, a.held_bytes)
    (1, 1, 0)
    """

    def __init__(self, cap: int):
        self.cap = max(0, int(cap))
        self._free: list = []  # raw uint8 buffers, oldest first
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.hits = self.misses = 0

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``, on a held buffer when one fits.

        Requests under :data:`MIN_BYTES` or over ``cap`` get a plain ``np.empty``; the buffer returns to
        the arena when the last array viewing it is gone.
        """
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.isscalar(shape) else tuple(int(s) for s in shape)
        n = math.prod(shape) * dtype.itemsize
        if n < MIN_BYTES or self.cap < n:
            return np.empty(shape, dtype)
        raw = self._take(n)
        if raw is None:
            self.misses += 1
            raw = np.empty(n, np.uint8)
        else:
            self.hits += 1
        a = np.frombuffer(memoryview(raw), dtype=dtype, count=math.prod(shape))
        weakref.finalize(a, self._give_back, raw)
        return a.reshape(shape)

    def _take(self, n: int):
        """The smallest held buffer of ``n`` to ``n * (1 + SLACK)`` bytes (removed), or None."""
        with self._lock:
            fits = [(r.nbytes, i) for i, r in enumerate(self._free) if n <= r.nbytes <= n * (1 + SLACK)]
            if not fits:
                return None
            raw = self._free.pop(min(fits)[1])
            self.held_bytes -= raw.nbytes
            return raw

    def _give_back(self, raw) -> None:
        with self._lock:
            if raw.nbytes > self.cap:
                return
            self._free.append(raw)
            self.held_bytes += raw.nbytes
            while self.held_bytes > self.cap:  # the oldest go back to the OS
                self.held_bytes -= self._free.pop(0).nbytes

    def clear(self) -> None:
        """Release every held buffer (arrays still in use are unaffected)."""
        with self._lock:
            self._free.clear()
            self.held_bytes = 0


@contextlib.contextmanager
def using(arena: Arena | None):
    """Make ``arena`` the one :func:`empty` draws from, in this thread, for the block."""
    token = _CURRENT.set(arena)
    try:
        yield arena
    finally:
        _CURRENT.reset(token)


def empty(shape, dtype=np.float32, xp=np):
    """``xp.empty(shape, dtype)``, from the current arena when there is one and ``xp`` is numpy."""
    arena = _CURRENT.get()
    if arena is None or xp is not np:
        return xp.empty(shape, dtype=dtype)
    return arena.empty(shape, dtype)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
_RETAINED: list = []
_SMALL_PAGES: list = []


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Once per process: glibc serves large arrays from its heap (no ``mmap`` of their own) and
    never trims the heap's top, so memory freed by one layer serves the next without the kernel
    zeroing fresh pages.  The process's footprint stays at its high-water mark (the plan's
    budget bounds it) until :func:`give_back_memory`.  ``ZNNI_REUSE_BUFFERS=0`` leaves malloc
    as it is; so does a libc other than glibc.  True when in effect.

    Threads keep their own malloc arenas, whose heaps cannot hold such arrays: the engine runs
    in the thread that called it first (the workflow job's too, ``run_pipelined``).  Forcing one
    arena on every thread (``M_ARENA_MAX=1``, done here before) made the FFT workers' FFTW
    executions contend for its lock: n726's 64 x 24 x 26^3 ``fft-gemm`` layer ran 0.76 s against
    0.33 s."""
    if _RETAINED:
        return _RETAINED[0]
    libc = None if os.environ.get("ZNNI_REUSE_BUFFERS", "1") == "0" else _libc()
    ok = bool(libc is not None and libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    _RETAINED.append(ok)
    return ok


def avoid_huge_page_stalls() -> bool:
    """Once per process: numpy stops asking for transparent huge pages on its large arrays
    (``madvise(MADV_HUGEPAGE)``, its default on Linux).  Where THP is ``madvise`` with
    ``defrag`` ``madvise`` (this VM, Debian's and Ubuntu's defaults) every first touch of such
    a 2 MiB page may compact memory synchronously: a process's first boundary-net call on an
    8 x 526^2 patch spent 2.2-2.3 s of system time on 12k huge-page faults (7.3-7.8 s) against
    0.5 s on 277k small ones (5.6-6.0 s); later calls reuse the memory either way (4.8-5.3 s).
    Every workflow job is such a first call.  ``ZNNI_HUGEPAGES=1`` keeps numpy's default.  True
    when in effect."""
    if _SMALL_PAGES:
        return _SMALL_PAGES[0]
    setter = getattr(getattr(getattr(np, "_core", None), "multiarray", None), "_set_madvise_hugepage", None)
    ok = os.environ.get("ZNNI_HUGEPAGES", "0") != "1" and setter is not None
    if ok:
        setter(False)
    _SMALL_PAGES.append(ok)
    return ok


def give_back_memory() -> None:
    """Return the free memory at the top of glibc's heap to the OS (``malloc_trim(0)``)."""
    libc = _libc() if _RETAINED and _RETAINED[0] else None
    if libc is not None:
        libc.malloc_trim(0)
