"""BLAS thread control for layers that run their own workers (each on one BLAS thread)."""
from __future__ import annotations

_CONTROLLER = None


def blas_limit(threads: int):
    """A context giving BLAS ``threads`` threads (threadpoolctl; its library scan done once)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=threads, user_api="blas")
