"""A layer's per-call buffers (FFT and transform workspaces, FFTW plans), kept across a step.

A convolution that keeps state for the run (:class:`~.fft.FFTConv`, the resident layers) also
needs workspace for each call. Alone, a call drops it; the executor runs a step as many calls
of one shape (blocks, micro-batches), and keeps one set for all of them::

    with conv.buffers_kept():
        for block in blocks:
            conv(block, out=...)

after which the buffers are released (the kernel transforms stay).
"""

from __future__ import annotations

import contextlib

import numpy as np

#: the span of addresses an L1 set and the store buffer's alias check see (4 KiB on x86 cores)
PAGE = 4096
#: cache line
LINE = 64


class CallBuffers:
    """Mixin: ``_work`` holds the per-call buffers, dropped after each call unless
    ``keep_buffers`` is set (by :meth:`buffers_kept`)."""

    keep_buffers = False
    _work = None

    def release(self):
        """Drop the per-call buffers (what is kept for the run stays)."""
        self._work = None

    @contextlib.contextmanager
    def buffers_kept(self):
        """Keep one set of call buffers for the calls inside the block, released after it."""
        self.keep_buffers = True
        try:
            yield self
        finally:
            self.keep_buffers = False
            self.release()


def staggered(sizes, dtype=np.float32) -> list:
    """Flat arrays of ``sizes`` elements whose first elements lie at different offsets within a
    4 KiB page, a whole number of cache lines apart (``PAGE / len(sizes)`` rounded down to
    lines, one line more).

    A transform pass reads a few points of one buffer and writes a few of another, each
    ``point`` a multiple of 4 KiB apart in both; large arrays start on a page (``mmap``) or at
    any offset (malloc's heap), so a read and a write stream often shared their address bits
    0-11: every load then waits on the stores it may alias, and the 16 streams fight over one
    L1 set.  A Winograd y pass (8 points, 24 KiB apart) ran 3-4x slower with its two buffers
    at the same offset than half a page apart (``docs/performance.md``).

    >>> a, b, c = staggered([100, 200, 300])
    >>> [x.ctypes.data % PAGE for x in (b, c)] == [(a.ctypes.data + k * 1408) % PAGE for k in (1, 2)]
    True
    """
    dtype = np.dtype(dtype)
    step = (PAGE // max(1, len(sizes))) // LINE * LINE + LINE
    parts, at = [], 0
    for k, n in enumerate(sizes):
        at += (k * step - at) % PAGE  # the next start at offset k * step within a page
        parts.append((at, int(n) * dtype.itemsize))
        at += int(n) * dtype.itemsize
    raw = np.empty(at + PAGE, np.uint8)
    base = -raw.ctypes.data % PAGE  # the first part on a page
    return [raw[base + a : base + a + n].view(dtype) for a, n in parts]
