"""``python -m benchmarks``: znni vs PyTorch CPU on the ZNNi networks; writes benchmarks/RESULTS.md.

Default run: all four networks, width 24, main budget 2 GiB, sweep 0.5/1/2 GiB, 3 rounds,
znni patches capped at 40 s predicted (90 s for n537).  With the engine as of 2026-11-23 03:00 the
main comparison (``--max-patch-seconds 60``) took 29 min on a quiet 2-core machine; the smaller
sweep points take about 1-3 min each per network.  Faster: ``--networks n337,n726
--budgets ''``, or ``--quick`` (a minutes-long sanity run into a temporary folder).  The
committed RESULTS.md came from a main run with ``--budgets ''`` plus ``--sweep-only`` for
three networks (commands recorded in it).

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

GIB = 2**30


def parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--networks", default="n337,n537,n726,n926", help="comma-separated subset of n337,n537,n726,n926")
    p.add_argument("--width", type=int, default=24, help="hidden maps per layer (paper: 80)")
    p.add_argument("--budget", type=float, default=2.0, help="memory budget of the side-by-side comparison, GiB")
    p.add_argument("--budgets", default="0.5,1,2", help="budget sweep, comma-separated GiB ('' for none)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--effort", default="estimate", choices=("estimate", "measure", "exhaustive"))
    p.add_argument("--dense-candidates", type=int, default=1, help="input edges PyTorch dense tries per budget")
    p.add_argument(
        "--naive-time",
        type=float,
        default=4.0,
        help="seconds of naive offsets per run before extrapolating to all prod(D) offsets",
    )
    p.add_argument(
        "--max-patch-seconds",
        default="40,n537=90",
        help="if znni's autotuned plan predicts more seconds per patch, use the autotuner's best "
        "smaller cube patch under this cap (bounds the run time; only lowers znni's "
        "throughput); 0 = no cap; per network: '40,n537=90'",
    )
    p.add_argument("--no-profile", action="store_true", help="skip the per-layer profile runs")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fast sanity run: 1 round, 0.25 GiB, no sweep, no profile, output to a temp folder",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for results_w<W>.json, sweep_w<W>.png, RESULTS.md "
        "(default: benchmarks/, or a temp folder with --quick)",
    )
    p.add_argument(
        "--sweep-only",
        action="store_true",
        help="run only the --budgets points (1 round each) for --networks and add them to the "
        "sweep of the existing results_w<W>.json in --out, then redraw the plot and RESULTS.md",
    )
    p.add_argument("--report-only", action="store_true", help="only re-render RESULTS.md and plots from the JSON")
    p.add_argument("--keep-coretype", action="store_true", help="keep OPENBLAS_CORETYPE as set in the environment")
    return p.parse_args(argv)


def _caps(text: str):
    """'40' -> 40.0; '40,n537=90' -> {'*': 40.0, 'n537': 90.0}; 0 -> None (no cap)."""
    caps = {}
    for part in (t.strip() for t in text.split(",") if t.strip()):
        name, _, val = part.rpartition("=")
        caps[name or "*"] = float(val) or None
    return caps.get("*") if set(caps) <= {"*"} else caps


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
        networks=tuple(s for s in args.networks.split(",") if s),
        width=args.width,
        budget=int(args.budget * GIB),
        sweep_budgets=tuple(int(float(b) * GIB) for b in args.budgets.split(",") if b.strip()),
        repeats=args.repeats,
        threads=args.threads,
        effort=args.effort,
        dense_candidates=args.dense_candidates,
        naive_time_limit=args.naive_time,
        profile=not args.no_profile,
        max_patch_seconds=_caps(args.max_patch_seconds),
    )
    if args.quick:
        cfg.budget = int(0.25 * GIB) if args.budget == 2.0 else cfg.budget
        cfg.sweep_budgets, cfg.repeats, cfg.dense_candidates = (), 1, 1
        cfg.naive_time_limit, cfg.profile, cfg.effort = 1.0, False, "estimate"
    out = (
        Path(args.out)
        if args.out
        else (Path(tempfile.mkdtemp(prefix="znni-bench-")) if args.quick else Path(__file__).resolve().parent)
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg.extra["command"] = " ".join(["python -m benchmarks"] + [shlex.quote(a) for a in argv])

    jpath = out / f"results_w{cfg.width}.json"
    if args.report_only:
        res = json.loads(jpath.read_text())
        if any(len(n["sweep"]) > 1 for n in res["networks"]):
            plot.sweep_plot(res, out / f"sweep_w{cfg.width}.png")
        harness.log(f"wrote {report.write_report(out)}")
        return res
    harness.log(f"benchmark -> {out}; config {cfg}")
    m = machine.describe(measure_haswell=not args.quick)
    if args.sweep_only:
        return sweep_only(cfg, m, jpath, out)
    harness.log(
        f"machine: {m['cpu']}, {m['cores']} cores, GEMM {m['gemm_flops'] / 1e9:.0f} GFLOP/s, "
        f"BLAS {[b['architecture'] for b in m['blas']]}, load {m['loadavg_at_start']}"
    )
    res = harness.run(cfg, m)
    jpath.write_text(json.dumps(res, indent=1, default=str))
    if cfg.sweep_budgets:
        plot.sweep_plot(res, out / f"sweep_w{cfg.width}.png")
    rpath = report.write_report(out)
    harness.log(f"wrote {jpath} and {rpath}")
    return res


def sweep_only(cfg, m, jpath, out):
    import json

    import torch

    from . import harness, plot, report
    from .nets import make_network

    torch.set_num_threads(cfg.threads)
    res = json.loads(jpath.read_text())
    by_name = {n["network"]: n for n in res["networks"]}
    for name in cfg.networks:
        if name not in by_name:
            raise SystemExit(f"{jpath} has no main result for {name}; run the comparison first")
        net = make_network(name, cfg.width, cfg.seed)
        entry = by_name[name]
        main_b = entry["main"]["budget"]
        if not any(s["budget"] == main_b for s in entry["sweep"]):
            entry["sweep"].append(entry["main"])
        for b in cfg.sweep_budgets:
            if b == main_b:
                continue  # the main comparison is that point, with all its rounds
            harness.log(f"{name} sweep: budget {b / GIB:.2f} GiB")
            r = harness.bench_budget(net, cfg, b, res["machine"]["gemm_flops"], 1, do_verify=False, do_profile=False)
            r["sweep_run"] = {
                "command": cfg.extra["command"],
                "loadavg_at_start": m["loadavg_at_start"],
                "date": m["date"],
            }
            entry["sweep"] = [s for s in entry["sweep"] if s["budget"] != b] + [r]
            jpath.write_text(json.dumps(res, indent=1, default=str))
    res["config"].setdefault("extra", {})["sweep_command"] = cfg.extra["command"]
    jpath.write_text(json.dumps(res, indent=1, default=str))
    plot.sweep_plot(res, out / f"sweep_w{cfg.width}.png")
    harness.log(f"wrote {jpath}, {report.write_report(out)}")
    return res


if __name__ == "__main__":
    main()
