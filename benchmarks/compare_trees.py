"""Two revisions of znni, the same cases, alternated on one host: is a change slower?

    python -m benchmarks.compare_trees 1dea866 HEAD            # 3 rounds, each case in both trees
    python -m benchmarks.compare_trees main my-branch --rounds 5
    python -m benchmarks.compare_trees HEAD . --plans         # plans only: the work tree's against HEAD's
    python -m benchmarks.compare_trees HEAD . --nets n537:16:24,n337:40:32   # ZNNi nets of your choice

A revision ``.`` is the work tree as it stands (uncommitted changes included); every other is
checked out in a temporary git worktree.  Each runs in its own process (the two trees cannot
share one), rounds alternating A, B, A, B so drifting load hits both alike; each
case is the median of 5 calls after a warm call and a 0.2 s pause, with the revision's own plan
(both read the same machine caches). Cases: the boundary net on 15 x 256^2, ZNNi n337 at width 24
(output 48^3), and the synapse detector U-Net on 18 x 320^2 when its file is found
(``$ZNNI_DATA``, default ``../shared/data`` beside the repository). Prints each case's medians per
revision, the ratio B / A, and the host.

``--plans`` times nothing: both trees plan the same networks under one stored calibration
(``tests/data``'s, as the tests plan) at two budgets, and each plan's JSON is compared: identical,
the same choices with other predicted seconds, or other choices (named).  Networks: the test
chains, ZNNi n337/n537/n726 and the boundary net, small padded and valid U-Nets exported from
PyTorch when it is installed, and the real synapse detector when found.  A refactoring that keeps
the plans byte for byte shows it here.
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
nets = sys.argv[1] if len(sys.argv) > 1 else ""
cases = []
for item in filter(None, nets.split(",")):  # --nets arch:width:edge
    arch, width, edge = item.split(":")
    net = make_network(arch, int(width))
    cases.append((f"{arch} w{width}, output {edge}^3", net, tuple(f + int(edge) - 1 for f in net.field_of_view)))
if not cases:
    cases.append(("boundary net 15 x 256^2", make_boundary_network(), (15, 256, 256)))
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


PLANS_CHILD = r"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import znni_core
from benchmarks.nets import make_boundary_network, make_network
from tests.nets import NETS, make_net
from znni_core.plan import autotune
from znni_core.plan.calibration import CpuCalibration
from znni_core.plan.costs import CpuCostModel

cal_path, graphs = sys.argv[1], json.loads(sys.argv[2])
with open(cal_path) as f:
    model = CpuCostModel(CpuCalibration.from_dict(json.load(f)["calibration"], cal_path))
cases = [(f"tests {k}", make_net(v), (40, 64, 64)) for k, v in NETS.items()]
for name in ("n337", "n537", "n726"):
    net = make_network(name, 24)
    cases.append((f"{name} w24", net, tuple(f + 47 for f in net.field_of_view)))
cases.append(("boundary net", make_boundary_network(), (15, 256, 256)))
cases += [(os.path.basename(p), znni_core.load_network(p), tuple(s)) for p, s in graphs]
out = {}
for name, net, shape in cases:
    for budget in (8 * 2**30, 256 * 2**20):
        key = f"{name} {shape} budget {budget >> 20} MiB"
        try:
            plan = autotune(net, memory_budget=budget, threads=2, input_shape=shape, cost_model=model)
            d = plan.to_dict()
            d.pop("provenance", None)
            out[key] = d
        except Exception as exc:  # a plan refused is a result too
            out[key] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _graphs(tmp: Path, data: Path) -> list:
    """``[(ONNX path, input shape)]``: small U-Nets exported from PyTorch (when it is installed)
    and the real synapse detector (when found under ``data``)."""
    detector = data / "models" / "modelzoo_iarpa1_synapse_detection.onnx"
    out = [(str(detector), (18, 320, 320))] if detector.is_file() else []
    try:
        from tests.unets import UNet, admissible, export, randomise_bn
    except ImportError:  # no PyTorch: the real U-Nets only
        return out
    padded = randomise_bn(UNet(valid=False, depth=3, width=8, bn=True, act="elu"))
    valid = UNet(valid=True, depth=2, width=8)
    for name, model, shape in (
        ("padded-unet", padded, (16, 96, 96)),
        ("valid-unet", valid, tuple(admissible(valid, a, n) for a, n in enumerate((24, 96, 96)))),
    ):
        out.append((str(export(model, tmp / f"{name}.onnx", shape)), shape))
    return out


def plans_of(path: Path, env: dict, cal: Path, graphs: list) -> dict:
    """Every case's plan (its JSON data, provenance dropped) planned by the tree at ``path``."""
    p = subprocess.run(
        [sys.executable, "-c", PLANS_CHILD, str(cal), json.dumps(graphs)],
        cwd=path,
        env=env | {"PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
    )
    if p.returncode:
        raise SystemExit(f"planning in {path} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def plan_difference(a, b) -> str:
    """``identical``, ``predictions only (...)`` (the same choices, other predicted seconds or
    bytes), the first choices that differ, or what one tree did where the other planned (refused
    it: the error; no such case: ``absent``)."""
    if a == b:
        return "identical"
    if not isinstance(a, dict) or not isinstance(b, dict):
        return " / ".join("absent" if v is None else v if isinstance(v, str) else "planned" for v in (a, b))
    predicted = {"predicted_seconds", "predicted_voxels_per_s", "seconds", "rejected", "predicted_peak_bytes", "bytes"}

    def choices(d):
        steps = [{k: v for k, v in s.items() if k not in predicted} for s in d["steps"]]
        return {k: v for k, v in d.items() if k not in predicted} | {"steps": steps}

    ca, cb = choices(a), choices(b)
    if ca == cb:
        return (
            f"predictions only ({a['predicted_seconds']:.4g} -> {b['predicted_seconds']:.4g} s, peak "
            f"{a.get('predicted_peak_bytes', 0) / 2**20:.1f} -> {b.get('predicted_peak_bytes', 0) / 2**20:.1f} MiB)"
        )
    keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
    if keys == ["steps"] and len(ca["steps"]) == len(cb["steps"]):
        i = next(i for i, (x, y) in enumerate(zip(ca["steps"], cb["steps"])) if x != y)
        return f"steps differ from step {i}: {ca['steps'][i]} / {cb['steps'][i]}"
    return "choices differ: " + ", ".join(f"{k} {ca.get(k)} / {cb.get(k)}" for k in keys)


def run_tree(path: Path, env: dict, nets: str = "") -> dict:
    """The cases' medians (seconds) with the tree at ``path`` (``nets``: ``--nets``' cases instead)."""
    p = subprocess.run(
        [sys.executable, "-c", CHILD, nets],
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
    ap.add_argument("--plans", action="store_true", help="compare the two trees' plans instead of their speed")
    ap.add_argument(
        "--nets",
        default="",
        help="instead of the default cases: ZNNi nets, arch:width:edge,... (an edge^3 output; e.g. n537:16:24)",
    )
    args = ap.parse_args(argv)
    env = dict(os.environ)
    env.setdefault("ZNNI_DATA", str(REPO.parent / "shared" / "data"))
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for rev in (args.a, args.b):
            if rev == ".":
                trees[rev] = REPO
                continue
            path = Path(tmp) / rev.replace("/", "_")
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
            trees[rev] = path
        try:
            if args.plans:
                cal = REPO / "tests" / "data" / "calibration-zen4-2threads.json"
                graphs = _graphs(Path(tmp), Path(env["ZNNI_DATA"]))
                plans = {rev: plans_of(path, env, cal, graphs) for rev, path in trees.items()}
                print(f"| case | {args.a} -> {args.b} |\n|---|---|")
                a, b = plans[args.a], plans[args.b]
                for case in list(a) + [c for c in b if c not in a]:
                    print(f"| {case} | {plan_difference(a.get(case), b.get(case))} |")
                return
            got = {rev: [] for rev in trees}
            for _ in range(args.rounds):
                for rev, path in trees.items():
                    got[rev].append(run_tree(path, env, args.nets))
        finally:
            for path in trees.values():
                if path == REPO:
                    continue
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
