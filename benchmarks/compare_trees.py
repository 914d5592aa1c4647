"""Two revisions of znni, the same cases, alternated on one host: is a change slower?

    python -m benchmarks.compare_trees 1dea866 HEAD            # 3 rounds, each case in both trees
    python -m benchmarks.compare_trees main my-branch --rounds 5

Each revision is checked out in a temporary git worktree and run in its own process (the two
trees cannot share one), rounds alternating A, B, A, B so drifting load hits both alike; each
case is the median of 5 calls after a warm call and a 0.2 s pause, with the revision's own plan
(both read the same machine caches). Cases: the boundary net on 15 x 256^2, ZNNi n337 at width 24
(output 48^3), and the synapse detector U-Net on 18 x 320^2 when its file is found
(``$ZNNI_DATA``, default ``../shared/data`` beside the repository). Prints each case's medians per
revision, the ratio B / A, and the host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, statistics, sys, time
import numpy as np
sys.path.insert(0, os.getcwd())
import znni_core
from benchmarks.nets import make_boundary_network, make_network
from znni_core.plan import autotune

rng = np.random.default_rng(0)
cases = [("boundary net 15 x 256^2", make_boundary_network(), (15, 256, 256))]
n337 = make_network("n337", 24)
cases.append(("n337 w24, output 48^3", n337, tuple(f + 47 for f in n337.field_of_view)))
det = os.path.join(os.environ.get("ZNNI_DATA", ""), "models", "modelzoo_iarpa1_synapse_detection.onnx")
if os.path.isfile(det):
    cases.append(("synapse detector 18 x 320^2", znni_core.load_network(det), (18, 320, 320)))
out = {}
for name, net, shape in cases:
    x = rng.random((1,) + shape, dtype=np.float32)
    plan = autotune(net, memory_budget=8 * 2**30, threads=2, input_shape=shape)
    znni_core.infer(net, x, plan=plan)
    ts = []
    for _ in range(5):
        time.sleep(0.2)
        t0 = time.perf_counter()
        znni_core.infer(net, x, plan=plan)
        ts.append(time.perf_counter() - t0)
    out[name] = statistics.median(ts)
print(json.dumps(out))
"""


def run_tree(path: Path, env: dict) -> dict:
    """The cases' medians (seconds) with the tree at ``path``."""
    p = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=path,
        env=env | {"PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    """Run the comparison (see the module's doc)."""
    from benchmarks.machine import host_class, host_line

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    env = dict(os.environ)
    env.setdefault("ZNNI_DATA", str(REPO.parent / "shared" / "data"))
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for rev in (args.a, args.b):
            path = Path(tmp) / rev.replace("/", "_")
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
            trees[rev] = path
        try:
            got = {rev: [] for rev in trees}
            for _ in range(args.rounds):
                for rev, path in trees.items():
                    got[rev].append(run_tree(path, env))
        finally:
            for path in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
    print(host_line(host_class()))
    print(f"| case | {args.a} (s) | {args.b} (s) | {args.b} / {args.a} |")
    print("|---|---|---|---|")
    for case in got[args.a][0]:
        a = statistics.median(r[case] for r in got[args.a])
        b = statistics.median(r[case] for r in got[args.b])
        print(f"| {case} | {a:.3f} | {b:.3f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
