"""Benchmarks: znni vs PyTorch CPU on the four ZNNi networks (``python -m benchmarks``).

Modules: :mod:`.nets` (ZNNi Table III networks), :mod:`.baselines` (PyTorch dense dilated and
naive all-offsets), :mod:`.memwatch` (measured peak RSS), :mod:`.machine` (CPU, versions,
BLAS kernel, GEMM peak), :mod:`.harness` (the comparison), :mod:`.plot`, :mod:`.report`.
Results: ``benchmarks/RESULTS.md``.
"""

import os
import sys

# a benchmark run (``python -m benchmarks.X``: while the package loads, ``sys.argv[0]`` is "-m")
# plans under a full calibration (the kernel parameters tuned on the host, each rate the best of
# five), as after ``znni warmup --refine``: a host's first plan would otherwise measure the quick
# one (``znni_core/plan/timing.py``); a user's own setting wins.  Importing the package (tests)
# changes nothing.
if sys.argv[:1] == ["-m"]:
    os.environ.setdefault("ZNNI_CALIBRATION", "full")
