"""``python -m benchmarks``: znni vs PyTorch CPU on the ZNNi networks; writes benchmarks/RESULTS.md.

Default run (about 20 min on 2 cores): all four networks, width 24, main budget 2 GiB,
sweep 0.5/1/2 GiB, 3 rounds.  ``--quick`` is a minutes-long sanity run into a temporary folder.

OpenBLAS reads ``OPENBLAS_CORETYPE`` when it loads; these machines preset it to Haswell,
which halves numpy's float32 GEMM on an AVX-512 CPU.  Unless ``--keep-coretype`` is given,
the benchmark re-executes itself without it (before numpy is imported) and records both
the original setting and the GEMM rate with it.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

GIB = 2 ** 30


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--networks", default="n337,n537,n726,n926", help="comma-separated subset of n337,n537,n726,n926")
    p.add_argument("--width", type=int, default=24, help="hidden maps per layer (paper: 80)")
    p.add_argument("--budget", type=float, default=2.0, help="memory budget of the side-by-side comparison, GiB")
    p.add_argument("--budgets", default="0.5,1,2", help="budget sweep, comma-separated GiB ('' for none)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--effort", default="measure", choices=("estimate", "measure", "exhaustive"))
    p.add_argument("--dense-candidates", type=int, default=2, help="input edges PyTorch dense tries per budget")
    p.add_argument("--naive-time", type=float, default=6.0,
                   help="seconds of naive offsets per run before extrapolating to all prod(D) offsets")
    p.add_argument("--no-profile", action="store_true", help="skip the per-layer profile runs")
    p.add_argument("--quick", action="store_true",
                   help="fast sanity run: 1 round, 0.25 GiB, no sweep, no profile, output to a temp folder")
    p.add_argument("--out", default=None, help="folder for results_w<W>.json, sweep_w<W>.png, RESULTS.md "
                                                "(default: benchmarks/, or a temp folder with --quick)")
    p.add_argument("--keep-coretype", action="store_true", help="keep OPENBLAS_CORETYPE as set in the environment")
    return p.parse_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if os.environ.get("OPENBLAS_CORETYPE") and not args.keep_coretype and "numpy" not in sys.modules:
        env = dict(os.environ)
        env["ZNNI_BENCH_ORIG_CORETYPE"] = env.pop("OPENBLAS_CORETYPE")
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks"] + argv, env)
    os.environ.setdefault("NUMBA_THREADING_LAYER", "threadsafe")

    import json
    import tempfile

    from . import harness, machine, plot, report

    cfg = harness.Config(
        networks=tuple(s for s in args.networks.split(",") if s), width=args.width, budget=int(args.budget * GIB),
        sweep_budgets=tuple(int(float(b) * GIB) for b in args.budgets.split(",") if b.strip()),
        repeats=args.repeats, threads=args.threads, effort=args.effort, dense_candidates=args.dense_candidates,
        naive_time_limit=args.naive_time, profile=not args.no_profile)
    if args.quick:
        cfg.budget = int(0.25 * GIB) if args.budget == 2.0 else cfg.budget
        cfg.sweep_budgets, cfg.repeats, cfg.dense_candidates = (), 1, 1
        cfg.naive_time_limit, cfg.profile, cfg.effort = 1.0, False, "estimate"
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="znni-bench-")) if args.quick
                                           else Path(__file__).resolve().parent)
    out.mkdir(parents=True, exist_ok=True)
    cfg.extra["command"] = " ".join(["python -m benchmarks"] + [shlex.quote(a) for a in argv])

    harness.log(f"benchmark -> {out}; config {cfg}")
    m = machine.describe(measure_haswell=not args.quick)
    harness.log(f"machine: {m['cpu']}, {m['cores']} cores, GEMM {m['gemm_flops'] / 1e9:.0f} GFLOP/s, "
                f"BLAS {[b['architecture'] for b in m['blas']]}, load {m['loadavg_at_start']}")
    res = harness.run(cfg, m)
    jpath = out / f"results_w{cfg.width}.json"
    jpath.write_text(json.dumps(res, indent=1, default=str))
    if cfg.sweep_budgets:
        plot.sweep_plot(res, out / f"sweep_w{cfg.width}.png")
    rpath = report.write_report(out)
    harness.log(f"wrote {jpath} and {rpath}")
    return res


if __name__ == "__main__":
    main()
