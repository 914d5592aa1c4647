"""Threads of layers that run their own workers: BLAS thread control, the worker fan-out, and
the run's GEMMs split over the run's threads.

Workers are the caller and persistent pooled threads (:func:`each_worker`): a layer's call
starts no thread.  A pool per call cost a thread start per worker per layer (38 in the synapse
detector's 0.52 s patch; each waits until the new thread runs, which on a busy host is late).

Inside a run (:func:`run_threads`) BLAS stays single-threaded and :func:`gemm` gives each of the
run's threads its own slab of a product.  A threaded OpenBLAS call leaves its idle workers
spinning for about 0.1 s (``2^28`` cycles) before they sleep, and they took the cores of the
next step's own workers: a valid U-Net's Winograd layers after a 1x1x1 conv ran 1.7-1.8x their
time alone (47 against 27 ms), the whole patch 0.43 s against 0.33 s with the spin off.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._numba import numba
from .xp import get_array_module, with_host_variant

_CONTROLLER = None
_RUN = threading.local()
_POOLS: dict = {}
_POOLS_LOCK = threading.Lock()
_POOLED = threading.local()  # set in the pools' own threads
#: columns per worker below which :func:`gemm` makes one call (a split costs a few microseconds)
MIN_COLUMNS = 256


def blas_limit(threads: int):
    """A context giving BLAS ``threads`` threads (threadpoolctl)."""
    return _controller().limit(limits=threads, user_api="blas")


def openmp_limit(threads: int):
    """A context giving OpenMP runtimes ``threads`` threads (threadpoolctl)."""
    return _controller().limit(limits=threads, user_api="openmp")


def _controller():
    """threadpoolctl's controller.  Its scan of the loaded libraries (about 1 ms, a third of a
    small call's overhead) is redone only after new modules were imported: a library is loaded
    by an import (numba's OpenMP pool and SciPy's OpenBLAS arrive at numba's first compiled call)."""
    global _CONTROLLER
    if _CONTROLLER is None or _CONTROLLER[0] != len(sys.modules):
        # lazy: loads threadpoolctl only when called
        from threadpoolctl import ThreadpoolController

        controller = ThreadpoolController()
        _CONTROLLER = (len(sys.modules), controller)
    return _CONTROLLER[1]


def each_worker(fn, workers: int) -> None:
    """``fn(0)`` .. ``fn(workers - 1)`` at once: ``fn(0)`` on the caller, the others on
    persistent pooled threads; returns when all have (the first error raised after all end).
    Inline for one worker, and one after another when called from a pooled thread (no pooled
    task waits on the pool)."""
    if workers <= 1 or getattr(_POOLED, "on", False):
        for w in range(workers):
            fn(w)
        return
    rest = [_pool(workers - 1).submit(fn, w) for w in range(1, workers)]
    try:
        fn(0)
    finally:
        errors = [f.exception() for f in rest]  # waits for every worker before any error propagates
    for e in errors:
        if e is not None:
            raise e


def kernel_threads() -> int:
    """Workers for a compiled kernel's tasks: numba's thread count (the plan's inside a run,
    :func:`znni_core.inference.thread_limits`; else numba's default, the host's CPUs)."""
    return max(1, int(numba.get_num_threads()))


#: ranges per worker :func:`split_tasks` cuts a kernel's tasks into, taken in turn by whichever
#: worker is free (a worker slowed by another process does not hold the others up)
RANGES_PER_WORKER = 4


def split_tasks(fn, tasks: int, workers: int | None = None) -> None:
    """``fn(t0, t1)`` over ``[0, tasks)``, on the run's workers (:func:`each_worker`), cut into
    :data:`RANGES_PER_WORKER` contiguous ranges per worker, each taken by the next free one.

    For a kernel compiled ``nogil`` over a range of its tasks in place of a ``prange`` loop
    (numba's parallel compilation took 3-5 s more per kernel: most of a first ``znni warmup``):
    the direct loops, the FFT products, and the pooling kernels a chain's warmup compiles (MPF,
    plain pooling, the max filter: 11.6 s of compiling with ``prange``, 4.5 s here).  A call of a
    few milliseconds pays for it: ``prange``'s threads wake sooner (MPF of 24 maps on 16 x 130^2
    channels last, 2 threads: 3.9 ms here, 3.4 ms with ``prange``; 48 maps on 8 x 30^2: 0.46
    against 0.20 ms).  Copies, upsampling and the epilogues, compiled in a U-Net's first job, keep
    ``prange``."""
    if tasks <= 0:
        return
    w = max(1, min(kernel_threads() if workers is None else int(workers), int(tasks)))
    if w == 1:
        fn(0, tasks)
        return
    parts = min(int(tasks), w * RANGES_PER_WORKER)
    taken = itertools.count()  # next() is atomic under the GIL

    def worker(_):
        while (k := next(taken)) < parts:
            fn(k * tasks // parts, (k + 1) * tasks // parts)

    each_worker(worker, w)


@contextlib.contextmanager
def run_threads(threads: int):
    """A run on ``threads`` threads: BLAS single-threaded, :func:`gemm` on ``threads`` workers
    (for the calling thread; nested runs restore the outer count)."""
    old = getattr(_RUN, "threads", 1)
    _RUN.threads = max(1, int(threads))
    try:
        with blas_limit(1):
            yield
    finally:
        _RUN.threads = old


def _mark_pooled():
    _POOLED.on = True


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads (made once)."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="znni-worker", initializer=_mark_pooled
            )
        return _POOLS[workers]


@with_host_variant
def matmul(a, b, out=None):
    """``a @ b`` (into ``out`` when given) on ``a``'s array module; on the host :func:`gemm`
    (the run's threads)."""
    return get_array_module(a).matmul(a, b, out=out)


@matmul.host
def gemm(a, b, out=None):
    """``a @ b`` as ``numpy.matmul`` (float32; 2-D, or stacked with the batch first), on the
    run's threads (:func:`run_threads`; outside a run one call on BLAS's own threads): each
    worker (the caller and ``threads - 1`` pooled threads) one single-threaded call on its
    share of the batch, or else of the columns."""
    if out is None:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        out = np.empty(batch + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
    workers = getattr(_RUN, "threads", 1)
    if workers > 1 and out.ndim == 3 and out.shape[0] >= workers:
        n, at, bt = out.shape[0], a.ndim == 3, b.ndim == 3

        def part(w):
            s = slice(w * n // workers, (w + 1) * n // workers)
            np.matmul(a[s] if at else a, b[s] if bt else b, out=out[s])
    elif workers > 1 and out.shape[-1] >= workers * MIN_COLUMNS:
        n = out.shape[-1]

        def part(w):
            s = slice(w * n // workers, (w + 1) * n // workers)
            np.matmul(a, b[..., s], out=out[..., s])
    else:
        return np.matmul(a, b, out=out)
    each_worker(part, workers)  # the caller is a worker too: one thread fewer to wake
    return out
