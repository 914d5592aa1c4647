"""``python -m benchmarks.gpu``: znni's GPU plans against PyTorch CUDA dense, on one GPU.

For each network (the ZNNi nets at width 80, the 2D boundary-detector class) and each plan
kind (GPU-only, GPU + host RAM, CPU -> GPU), in one process, interleaved rounds, medians:

* znni: ``infer(net, x, device=..., plan=...)`` with the plan kind forced
  (``autotune(placement=...)``; GPU + host RAM under a budget of a quarter of the
  GPU-only plan's peak, so it must stream);
* PyTorch CUDA: the same dense formulation as ``benchmarks/runtimes.py`` (cuDNN, fp32,
  TF32 off) on the whole input, synchronised;

and reports output voxels/s, the ratio to PyTorch and to ZNNi's Titan X figure for the
net and kind (``TITAN_X``: the ZNNi paper's table), and the predicted against the measured device peak
(``PeakMeter``: every block the CuPy pool hands out, cuFFT work areas included).

``--smoke``: tiny shapes on the simulated GPU (``ZNNI_SIMULATED_GPU``) with PyTorch on
the CPU: checks that this script runs, measures nothing (CI runs it).
Run once on an H100: ``benchmarks/GPU-H100.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

#: ZNNi on a Titan X + 72-core Xeon, width 80, output voxels/s (paper's comparison table)
TITAN_X = {
    "n337": {"gpu": 671_782, "gpu+host": 727_103, "cpu+gpu": 1_059_910},
    "n537": {"gpu": 29_352, "gpu+host": 147_965, "cpu+gpu": 334_163},
    "n726": {"gpu": 97_257, "gpu+host": 148_194, "cpu+gpu": 470_166},
    "n926": {"gpu": 35_051, "gpu+host": 104_946, "cpu+gpu": 375_295},
}
KINDS = {"gpu": ("gpu", ""), "gpu+host": ("gpu", "gpu+host"), "cpu+gpu": ("cpu+gpu", None)}


def cases(smoke: bool, size: int = 320):
    from .nets import make_boundary_network, make_network

    if smoke:
        return [("n337", make_network("n337", width=4), None)]
    out = [(name, make_network(name, width=80), None) for name in ("n337", "n537", "n726", "n926")]
    return out + [("boundary", make_boundary_network(), (32, 1024 * size // 320, 1024 * size // 320))]


def _input(net, shape, smoke, size=320):
    if shape is None:  # output size^3 (smoke: 16^3)
        shape = tuple(f - 1 + (16 if smoke else size) for f in net.field_of_view)
    return np.random.default_rng(0).standard_normal((net.in_channels,) + tuple(shape)).astype(np.float32)


def _sync(xp):
    xp.cuda.Device().synchronize()


_T0 = time.perf_counter()


def _log(*what):
    print(f"[{time.perf_counter() - _T0:7.1f} s]", *what, file=sys.stderr, flush=True)


def bench(name, net, x, rounds, smoke, steps=False, cudnn_search=False):
    import torch

    import znni_core
    from znni_core.exec.device import PeakMeter
    from znni_core.layers.xp import require_device
    from znni_core.plan import autotune

    from .runtimes import dense_module, predicted_seconds, step_profile

    xp = require_device("gpu")
    cuda = torch.cuda.is_available() and not smoke
    if cuda:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.benchmark = cudnn_search  # off by default: 90 s before n337 w80's first run
    dev = "cuda" if cuda else "cpu"
    module = dense_module(net).to(dev)
    tx = torch.from_numpy(x[None]).to(dev)
    out_vox = int(np.prod([n - f + 1 for n, f in zip(x.shape[1:], net.field_of_view)]))
    plans, row = {}, {"net": name, "input": list(x.shape[1:]), "output_voxels": out_vox, "kinds": {}}
    for kind, (device, placement) in KINDS.items():
        try:
            if kind == "gpu+host":  # a budget the GPU-only plan does not fit: it must stream
                budget = max(2**20, plans["gpu"].predicted_peak_bytes // 4) if "gpu" in plans else None
                plans[kind] = autotune(
                    net,
                    device=device,
                    memory_budget=budget,
                    input_shape=x.shape[1:],
                    placement=placement,
                    use_cache=False,
                )
            else:
                plans[kind] = autotune(
                    net, device=device, input_shape=x.shape[1:], placement=placement, use_cache=False
                )
        except Exception as exc:  # a kind that does not fit this net: say so, go on
            row["kinds"][kind] = {"error": f"{type(exc).__name__}: {exc}"}
        _log(name, kind, "planned:", plans[kind].describe().splitlines()[1] if kind in plans else row["kinds"][kind])
    times = {k: [] for k in plans} | {"pytorch": []}
    peaks, outs = {}, {}
    for r in range(rounds + 1):  # round 0: warm-up (kernel compilation, cuFFT plans, cudnn.benchmark)
        with torch.no_grad():
            t0 = time.perf_counter()
            ref = module(tx)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        _log(name, "round", r, f"pytorch {dt:.3f} s")
        if r:
            times["pytorch"].append(dt)
            del ref
        else:
            ref = ref[0].cpu().numpy()
        if cuda:  # its cached blocks would shrink the device memory znni's plans were made for
            torch.cuda.empty_cache()
        for kind, plan in list(plans.items()):
            znni_core.release_cache()
            try:
                with PeakMeter(xp) as meter:
                    t0 = time.perf_counter()
                    y = znni_core.infer(net, x, device=plan.device, plan=plan)
                    _sync(xp)
                    dt = time.perf_counter() - t0
            except Exception as exc:  # a kind that fails on this net: say so, go on with the others
                row["kinds"][kind] = {"error": f"{type(exc).__name__}: {exc}", "plan": plan.describe()}
                _log(name, "round", r, kind, "failed:", row["kinds"][kind]["error"])
                del plans[kind]
                continue
            peaks[kind] = max(peaks.get(kind, 0), meter.peak)
            _log(name, "round", r, f"{kind} {dt:.3f} s, peak {meter.peak / 1e6:.0f} MB")
            if r:
                times[kind].append(dt)
            else:  # exactness against PyTorch's dense result, once
                outs[kind] = float(np.abs(y - ref).max() / max(float(np.abs(ref).max()), 1e-30))
            del y
        if not r:
            del ref
    # one more run per kind, each step timed on its own (the device synchronised around it)
    profiles = {kind: step_profile(net, x, plan) for kind, plan in plans.items()} if steps else {}
    torch_s = statistics.median(times["pytorch"])
    row["pytorch_s"] = torch_s
    row["pytorch_voxels_per_s"] = out_vox / torch_s
    for kind, plan in plans.items():
        s = statistics.median(times[kind])
        titan = TITAN_X.get(name, {}).get(kind)
        row["kinds"][kind] = {
            "seconds": s,
            "voxels_per_s": out_vox / s,
            "vs_pytorch": torch_s / s,
            "vs_titan_x": (out_vox / s) / titan if titan else None,
            "predicted_s": predicted_seconds(plan, net, x.shape[1:]),
            "patch": list(plan.patch_shape),
            "predicted_peak": plan.predicted_peak_bytes,
            "measured_peak": peaks[kind],
            "max_rel_err_vs_pytorch": outs[kind],
            "budget": plan.memory_budget,
            "split": plan.split,
            "placement": plan.placement,
            "primitives": sorted({st.primitive for st in plan.steps if st.op == "conv"}),
        }
        if kind in profiles:
            row["kinds"][kind]["steps"] = profiles[kind]
    return row


def render(res) -> str:
    lines = [
        f"# znni on {res['device']} against PyTorch CUDA dense (fp32, TF32 off)",
        "",
        f"`{res['command']}`, {res['date']}; medians of {res['rounds']} rounds.",
        "",
        "| net | kind | voxels/s | vs PyTorch | vs ZNNi Titan X | predicted / measured s | "
        "predicted / measured peak (MB) | max rel. err. vs PyTorch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        if "error" in row:
            lines.append(f"| {row['net']} | - | - | - | - | - | - | {row['error'][:80]} |")
        for kind, k in row["kinds"].items():
            if "error" in k:
                lines.append(f"| {row['net']} | {kind} | - | - | - | - | - | {k['error'][:80]} |")
                continue
            vt = f"{k['vs_titan_x']:.1f}x" if k["vs_titan_x"] else "-"
            lines.append(
                f"| {row['net']} | {kind} | {k['voxels_per_s']:,.0f} | {k['vs_pytorch']:.2f}x | {vt} | "
                f"{k['predicted_s']:.3g} / {k['seconds']:.3g} | "
                f"{k['predicted_peak'] / 1e6:,.0f} / {k['measured_peak'] / 1e6:,.0f} | "
                f"{k['max_rel_err_vs_pytorch']:.1e} |"
            )
    from .runtimes import render_steps

    for row in res["rows"]:
        for kind, k in row["kinds"].items():
            if k.get("steps"):
                lines += render_steps(f"{row['net']}, {kind}", k["steps"])
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the simulated GPU (CI)")
    ap.add_argument("--nets", default="", help="comma-separated subset (n337,n537,n726,n926,boundary)")
    ap.add_argument(
        "--size",
        type=int,
        default=320,
        help="output edge of the ZNNi nets' input (boundary: 32 x 1024 x 1024 at 320, scaled in y, x)",
    )
    ap.add_argument("--steps", action="store_true", help="also time each step on its own (one more run per kind)")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="let cuDNN search its algorithms (slow first run)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("ZNNI_SIMULATED_GPU", "1GiB")
    from znni_core.layers.xp import require_device
    from znni_core.plan.gpu_timing import device_name

    xp = require_device("gpu")
    rows = []
    todo = cases(a.smoke, a.size)
    if a.nets:  # in the order given
        order = a.nets.split(",")
        todo = sorted((c for c in todo if c[0] in order), key=lambda c: order.index(c[0]))
    for name, net, shape in todo:
        try:
            rows.append(
                bench(name, net, _input(net, shape, a.smoke, a.size), a.rounds, a.smoke, a.steps, a.cudnn_benchmark)
            )
        except Exception as exc:  # PyTorch out of memory, say: report it, go on with the next net
            rows.append({"net": name, "kinds": {}, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(rows[-1]), flush=True)
    res = {
        "device": device_name(xp),
        "host": platform.node(),
        "rounds": a.rounds,
        "rows": rows,
        "command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / ("gpu-smoke.json" if a.smoke else "gpu.json")).write_text(json.dumps(res, indent=1))
    (a.out / ("GPU-smoke.md" if a.smoke else "GPU.md")).write_text(render(res))
    return res


if __name__ == "__main__":
    main()
