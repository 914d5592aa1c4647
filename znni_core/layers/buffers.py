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
