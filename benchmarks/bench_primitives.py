"""Convolution primitives against PyTorch's CPU conv3d (median of 3 runs).

    .venv/bin/python benchmarks/bench_primitives.py [--threads 2] [--quick]

Prints one row per (kernel, width): seconds for torch.conv3d, conv_direct_gemm,
conv_direct_numba, FFTConv data/task (kernel spectra precomputed and reused: only
the call is timed), and each primitive's time relative to torch (>1 = slower).
Also prints which OpenBLAS core type numpy uses: ``OPENBLAS_CORETYPE=Haswell`` (set
on these machines) runs float32 GEMM at about half the AVX-512 speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def median_time(fn, reps=3):
    fn()  # warm-up: compile / load numba, plan FFTW, fault pages in
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def blas_info():
    try:
        from threadpoolctl import threadpool_info

        info = [
            f"{d.get('internal_api')}:{d.get('architecture')}:{d.get('num_threads')}t"
            for d in threadpool_info()
            if d.get("user_api") == "blas"
        ]
    except Exception as e:  # noqa: BLE001
        info = [repr(e)]
    return f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')} numpy BLAS {info}"


CASES = [  # (kernel, width, batch, input edge): runs of about 0.1-2 s on 2 cores
    (3, 24, 1, 64),
    (5, 24, 1, 64),
    (7, 24, 1, 64),
    (3, 80, 1, 48),
    (5, 80, 1, 48),
    (7, 80, 1, 48),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="skip conv_direct_numba (slow at large kernels)")
    ap.add_argument("--effort", default="measure", choices=["estimate", "measure"])
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    import torch

    from znni_core.layers import FFTConv, conv_direct_gemm, conv_direct_numba

    torch.set_num_threads(args.threads)
    print(blas_info(), f"| torch {torch.__version__} threads={args.threads}")
    cols = ["torch", "gemm", "numba", "fft-data", "fft-task"]
    print(f"{'case':>22} " + " ".join(f"{c:>9}" for c in cols) + "   ratios to torch")
    rng = np.random.default_rng(0)
    for k, c, n, s in CASES:
        x = rng.standard_normal((n, c, s, s, s), dtype=np.float32)
        w = rng.standard_normal((c, c, k, k, k), dtype=np.float32) * 0.1
        b = rng.standard_normal(c).astype(np.float32)
        xt, wt, bt = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b)
        ref = torch.nn.functional.conv3d(xt, wt, bt).numpy()
        t = {}
        with torch.no_grad():
            t["torch"] = median_time(lambda: torch.nn.functional.conv3d(xt, wt, bt))
        t["gemm"] = median_time(lambda: conv_direct_gemm(x, w, b))
        if not args.quick or k == 3:
            t["numba"] = median_time(lambda: conv_direct_numba(x, w, b))
        for mode in ("data", "task"):
            conv = FFTConv(w, b, (s, s, s), threads=args.threads, mode=mode, effort=args.effort)
            err = np.abs(conv(x) - ref).max() / np.abs(ref).max()
            assert err < 1e-4, (mode, err)
            t[f"fft-{mode}"] = median_time(lambda: conv(x))
        name = f"k={k}^3 C={c} N={n} {s}^3"
        row = " ".join(f"{t[c_]:9.3f}" if c_ in t else f"{'-':>9}" for c_ in cols)
        ratios = " ".join(f"{c_}={t[c_] / t['torch']:.2f}" for c_ in cols[1:] if c_ in t)
        print(f"{name:>22} {row}   {ratios}", flush=True)


if __name__ == "__main__":
    main()
