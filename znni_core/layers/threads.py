"""Threads of layers that run their own workers: BLAS thread control and the worker fan-out."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

_CONTROLLER = None


def blas_limit(threads: int):
    """A context giving BLAS ``threads`` threads (threadpoolctl; its library scan done once)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=threads, user_api="blas")


def each_worker(fn, workers: int) -> None:
    """``fn(0)`` .. ``fn(workers - 1)``, on that many threads (inline for one)."""
    if workers <= 1:
        fn(0)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(fn, range(workers)))
