"""Measured vs predicted peak memory of autotuned plans on the ZNNi networks.

Each case runs in a fresh subprocess: plan under the budget, one patch through
``znni_core.infer``, peak RSS growth (``ru_maxrss`` after minus RSS before the run,
so imports and FFTW/numba set-up are excluded by a warm-up on a tiny patch) and the
tracemalloc peak.  Usage::

    python -m benchmarks.bench_memory [--networks n337,n726] [--widths 24] [--budgets 0.5,2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, os, resource, sys, tracemalloc, psutil
os.environ["ZNNI_REUSE_BUFFERS"] = "0"  # the engine's own live set, as the model predicts (no arena)
import numpy as np
from benchmarks.nets import make_network
import znni_core
from znni_core.plan import autotune
name, width, budget = sys.argv[1], int(sys.argv[2]), int(float(sys.argv[3]))
net = make_network(name, width=width)
plan = autotune(net, memory_budget=budget)
x = np.random.default_rng(0).standard_normal((1,) + plan.patch_shape).astype(np.float32)
small = tuple(f + d - 1 for f, d in zip(net.field_of_view, net.pooling_product))
znni_core.infer(net, x[:, :small[0], :small[1], :small[2]].copy(), plan=plan)  # warm-up
before = psutil.Process().memory_info().rss - x.nbytes
tracemalloc.start()
znni_core.infer(net, x, plan=plan)
traced = tracemalloc.get_traced_memory()[1] + x.nbytes
tracemalloc.stop()
rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"net": name, "width": width, "budget": budget, "predicted": plan.predicted_peak_bytes,
                  "traced": traced, "rss_growth": rss_peak - before, "patch": plan.patch_shape,
                  "modes": plan.pool_modes}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--networks", default="n337,n537,n726,n926")
    ap.add_argument("--widths", default="24")
    ap.add_argument("--budgets", default="0.5", help="GiB, comma separated")
    args = ap.parse_args(argv)
    print(
        f"{'net':<6}{'w':>4}{'budget GiB':>11}{'predicted':>11}{'traced':>9}{'RSS growth':>11}  ratio(traced/pred)  patch  modes"
    )
    for name in args.networks.split(","):
        for width in args.widths.split(","):
            for gib in args.budgets.split(","):
                r = subprocess.run(
                    [sys.executable, "-c", CHILD, name, width, str(float(gib) * 2**30)], capture_output=True, text=True
                )
                if r.returncode:
                    print(f"{name} w{width} {gib} GiB failed: {r.stderr.strip().splitlines()[-1:]}")
                    continue
                d = json.loads(r.stdout.strip().splitlines()[-1])
                g = 2**30
                print(
                    f"{name:<6}{width:>4}{float(gib):>11.2f}{d['predicted'] / g:>11.3f}{d['traced'] / g:>9.3f}"
                    f"{d['rss_growth'] / g:>11.3f}  {d['traced'] / d['predicted']:>6.2f}  {tuple(d['patch'])}  {d['modes']}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
