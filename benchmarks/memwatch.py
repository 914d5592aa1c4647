"""Peak memory of a call, measured: the process RSS sampled from a thread.

``tracemalloc`` does not see torch's, FFTW's or BLAS's allocations; the resident set does.
The reported number is the peak RSS during the call minus the RSS just before it (so the
interpreter, the libraries and arrays alive before the call do not count), sampled every
``interval`` seconds (2 ms default) and read once more at the end.  Allocations that live
shorter than the interval can be missed; large buffers live much longer than that.
"""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """Context manager sampling the process RSS every ``interval`` seconds; ``extra`` is the peak rise in bytes."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.proc = psutil.Process()
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _sample(self):
        rss = self.proc.memory_info().rss
        if rss > self.peak:
            self.peak = rss

    def _loop(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self):
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()
        return False

    @property
    def extra(self) -> int:
        """Peak bytes above the RSS at entry."""
        return max(0, self.peak - self.base)


def measure(fn, *args, **kw):
    """``(result, seconds, peak_extra_bytes)`` of ``fn(*args, **kw)``."""
    with PeakRSS() as m:
        t0 = time.perf_counter()
        r = fn(*args, **kw)
        dt = time.perf_counter() - t0
    return r, dt, m.extra
