"""Numba set-up shared by the CPU kernels (import numba only through here).

PITFALLS: the default ``workqueue`` threading layer killed the process when
dask threads called a parallel kernel, so unless the user chose a layer we ask
for a thread-safe one (``omp`` or ``tbb``) before the first parallel launch.
OpenMP's threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``, below).
"""
from __future__ import annotations

import os

import numba

if os.environ.get("NUMBA_THREADING_LAYER") is None and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"

# OpenMP's threads (the omp layer) spin for a while after each parallel kernel, and OpenBLAS's and
# Winograd's threads run between two kernels: on 2 cores they took each other's cores.  A valid
# U-Net patch's pools, upsamplings and bias passes ran 5-20x their time alone (the patch 0.12-0.14
# against 0.08 s passive); the real detector 0.75 -> 0.66-0.70 s; chain networks the same.
# Read when OpenMP starts (the first parallel launch); a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

njit = numba.njit
prange = numba.prange

__all__ = ["njit", "prange", "numba"]
