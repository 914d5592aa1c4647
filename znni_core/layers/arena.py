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
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import weakref

import numpy as np

__all__ = ["Arena", "empty", "using"]

#: below this, numpy's allocator (glibc's heap) already reuses memory
MIN_BYTES = 1 << 20
#: a freed buffer serves a request up to this fraction smaller (the shapes of successive layers)
SLACK = 0.125

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
