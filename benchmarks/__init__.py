"""Benchmarks: znni vs PyTorch CPU on the four ZNNi networks (``python -m benchmarks``).

Modules: :mod:`.nets` (ZNNi Table III networks), :mod:`.baselines` (PyTorch dense dilated and
naive all-offsets), :mod:`.memwatch` (measured peak RSS), :mod:`.machine` (CPU, versions,
BLAS kernel, GEMM peak), :mod:`.harness` (the comparison), :mod:`.plot`, :mod:`.report`.
Results: ``benchmarks/RESULTS.md``.
"""
