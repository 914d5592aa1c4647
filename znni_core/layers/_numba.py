"""Numba set-up shared by the CPU kernels (import numba only through here).

PITFALLS: the default ``workqueue`` threading layer killed the process when
dask threads called a parallel kernel, so unless the user chose a layer we ask
for a thread-safe one (``omp`` or ``tbb``) before the first parallel launch.
"""
from __future__ import annotations

import os

import numba

if os.environ.get("NUMBA_THREADING_LAYER") is None and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"

njit = numba.njit
prange = numba.prange

__all__ = ["njit", "prange", "numba"]
