"""``python -m benchmarks.runtimes``: znni against the runtimes a lab could pick instead.

The whole small volume, called as a user calls each tool, in one
process, interleaved rounds, medians.  Every baseline runs the same dense ("filter
rarefaction") formulation: each max-pool a stride-1 max filter dilated by the product of the
earlier pooling windows (separable, ``Max`` over ``Slice``s in ONNX), later convolutions
dilated by that product.  One pass gives every output voxel, as znni's MPF does.

* znni: ``znni_core.infer(net, x, memory_budget=...)``; the first call on the shape plans
  (after a warm-up on another shape: calibration and compilation are not counted) and is
  reported apart; later calls reuse the plan cached for the shape.
* PyTorch eager (separable max), ONNX Runtime (``ORT_ENABLE_ALL``), OpenVINO with
  ``INFERENCE_PRECISION_HINT=f32`` (the runtime model is checked: every Convolution ran f32),
  each with 2 threads; networks whose kernels and pools are all 1 deep in z are also run in
  2D form (z slices as the batch), where ONNX Runtime is fastest.

Also the pool-free stacks (2D, 3D, 1x1x1 kernels): the effective rate (direct-convolution
FLOPs / time) against the float32 sgemm peak measured in the same process.

Install the baselines with ``pip install -e '.[bench]' torch==2.13.0``.  Results go to
``benchmarks/RUNTIMES.md`` and ``runtimes.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from znni_core.net import Activation, Conv, Network, Pool

HERE = Path(__file__).resolve().parent
ISBI = HERE.parent.parent / "shared" / "data" / "isbi2012" / "test-volume.tif"


# ------------------------------------------------------------------ dense formulation in torch
def dense_module(net: Network, two_d: bool = False):
    """The network's dense formulation as a ``torch.nn.Module`` (3D, or 2D with z as batch)."""
    import torch
    import torch.nn.functional as F

    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ops, dil, k = [], [1, 1, 1], 0
            for layer in net.layers:
                if isinstance(layer, Conv):
                    w = torch.from_numpy(layer.weight[:, :, 0] if two_d else layer.weight)
                    b = None if layer.bias is None else torch.from_numpy(layer.bias)
                    self.register_buffer(f"w{k}", w)
                    self.register_buffer(f"b{k}", b)
                    self.ops.append(("conv", k, tuple(dil[1:] if two_d else dil)))
                    k += 1
                elif isinstance(layer, Pool):
                    win = layer.window[1:] if two_d else layer.window
                    self.ops.append(("max", win, tuple(dil[1:] if two_d else dil)))
                    dil = [d * p for d, p in zip(dil, layer.window)]
                elif isinstance(layer, Activation) and layer.kind != "identity":
                    self.ops.append(("act", layer.kind, layer.alpha))

        def forward(self, x):
            off = x.dim() - (2 if two_d else 3)
            for op in self.ops:
                if op[0] == "conv":
                    w, b = getattr(self, f"w{op[1]}"), getattr(self, f"b{op[1]}")
                    x = (F.conv2d if two_d else F.conv3d)(x, w, b, dilation=op[2])
                elif op[0] == "max":  # separable stride-1 dilated max
                    for axis, (p, d) in enumerate(zip(op[1], op[2])):
                        if p > 1:
                            n = x.shape[off + axis] - (p - 1) * d
                            y = x.narrow(off + axis, 0, n)
                            for j in range(1, p):
                                y = torch.maximum(y, x.narrow(off + axis, j * d, n))
                            x = y
                else:
                    kind, alpha = op[1], op[2]
                    x = {
                        "relu": torch.relu,
                        "sigmoid": torch.sigmoid,
                        "tanh": torch.tanh,
                        "softmax": lambda v: torch.softmax(v, dim=1),
                        "leaky_relu": lambda v: F.leaky_relu(v, alpha),
                        "elu": lambda v: F.elu(v, alpha),
                    }[kind](x)
            return x

    return Dense().eval()


def is_2d(net: Network) -> bool:
    return all(
        (l.kernel[0] == 1) if isinstance(l, Conv) else (l.window[0] == 1)
        for l in net.layers
        if isinstance(l, (Conv, Pool))
    )


def _torch_run(module, t):
    import torch

    with torch.no_grad():
        return module(t)[0].numpy()


class Baselines:
    """PyTorch, ONNX Runtime and OpenVINO (f32) on one input shape; ``run(name)`` -> (C, z, y, x)."""

    def __init__(self, net: Network, x: np.ndarray, threads: int, tmp: Path):
        import torch

        torch.set_num_threads(threads)
        self.net, self.x, self.fns, self.notes = net, x, {}, {}
        forms = [("3d", False)] + ([("2d", True)] if is_2d(net) else [])
        for form, two_d in forms:
            mod = dense_module(net, two_d)
            xin = self._form_input(two_d)
            if form == "3d":
                self.fns["pytorch"] = lambda m=mod, t=torch.from_numpy(xin): _torch_run(m, t)
            path = tmp / f"{net.name}-{form}.onnx"
            torch.onnx.export(
                mod,
                torch.from_numpy(xin),
                str(path),
                opset_version=17,
                dynamo=False,
                input_names=["x"],
                output_names=["y"],
            )
            self._ort(path, xin, two_d, f"onnxruntime-{form}", threads)
            self._openvino(path, xin, two_d, f"openvino-f32-{form}", threads)

    def _form_input(self, two_d):
        x = self.x[None]  # (1, C, Z, Y, X)
        return np.ascontiguousarray(x[0].transpose(1, 0, 2, 3)) if two_d else np.ascontiguousarray(x)

    @staticmethod
    def _back(y, two_d):
        return y.transpose(1, 0, 2, 3) if two_d else y[0]

    def _ort(self, path, xin, two_d, name, threads):
        try:
            import onnxruntime as ort
        except ImportError:
            self.notes[name] = "not installed"
            return
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.fns[name] = lambda: self._back(sess.run(None, {"x": xin})[0], two_d)

    def _openvino(self, path, xin, two_d, name, threads):
        try:
            import openvino as ov
        except ImportError:
            self.notes[name] = "not installed"
            return
        core = ov.Core()
        cm = core.compile_model(
            str(path),
            "CPU",
            {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"},
        )
        precisions = {
            op.get_rt_info()["runtimePrecision"].astype(str)
            for op in cm.get_runtime_model().get_ops()
            if op.get_rt_info()["layerType"].astype(str) == "Convolution"
        }
        self.notes[name] = f"Convolution runtimePrecision {sorted(precisions)}"
        if precisions != {"f32"}:
            raise RuntimeError(f"OpenVINO did not run f32 convolutions: {precisions}")
        req = cm.create_infer_request()
        self.fns[name] = lambda: self._back(req.infer({0: xin})[cm.output(0)].copy(), two_d)


# ------------------------------------------------------------------ measurements
def sgemm_peak(threads: int) -> float:
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    c = np.empty_like(a)
    with threadpool_limits(threads):
        np.matmul(a, a, out=c)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.matmul(a, a, out=c)
            ts.append(time.perf_counter() - t0)
    return 2 * 2048**3 / min(ts)


def direct_flops(net: Network, out_shape) -> float:
    """Direct-convolution FLOPs of the dense output (2 per multiply-add, borders ignored)."""
    per = sum(2 * l.in_channels * l.out_channels * math.prod(l.kernel) for l in net.layers if isinstance(l, Conv))
    return float(per * math.prod(out_shape))


#: a pause before each timed call: the previous tool's worker threads (ONNX Runtime's and
#: OpenVINO's spin after a run, as numba's may) go idle first, so no tool pays for the one before
SETTLE_S = 0.2


def timed(fn):
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    y = fn()
    return time.perf_counter() - t0, y


def patches(plan, net, shape) -> int:
    """How many patches of ``plan`` cover an input of ``shape``."""
    out = [n - f + 1 for n, f in zip(shape, net.field_of_view)]
    return math.prod(math.ceil(o / t) for o, t in zip(out, plan.output_shape))


def predicted_seconds(plan, net, shape) -> float:
    """The time model's seconds for ``infer`` on ``shape``: per-patch prediction x patches."""
    return plan.predicted_seconds * patches(plan, net, shape)


def step_profile(net, x, plan) -> list:
    """A warm run of ``plan`` on ``x`` (after one unprofiled run: kernel transforms built, buffers
    touched) with each step timed on its own (``exec/patch.profiled``), set against the plan's
    prediction for the step (x patches).  A cold run's steps took 1.3-2x a warm one's."""
    import znni_core
    from znni_core.exec.patch import profiled

    znni_core.infer(net, x, device=plan.device, plan=plan)
    time.sleep(SETTLE_S)
    with profiled() as seconds:
        znni_core.infer(net, x, device=plan.device, plan=plan)
    k = patches(plan, net, x.shape[1:])
    return [
        {
            "step": st.index,
            "op": st.op,
            "primitive": st.primitive,
            "in": list(st.in_shape),
            "predicted_s": st.seconds * k,
            "measured_s": seconds.get(st.index),
        }
        for st in plan.steps
        if st.op != "act"
    ]


def render_steps(title: str, steps) -> list:
    """Markdown lines of a :func:`step_profile`."""
    lines = [
        "",
        f"{title}: each step on its own (seconds over the input; a 1x1x1 chain is charged to its first step)",
        "",
        "| step | op | primitive | in (N,C,z,y,x) | predicted | measured |",
        "|---|---|---|---|---|---|",
    ]
    for st in steps:
        m = "-" if st["measured_s"] is None else f"{st['measured_s']:.3g}"
        lines.append(
            f"| {st['step']} | {st['op']} | {st['primitive']} | {tuple(st['in'])} | {st['predicted_s']:.3g} | {m} |"
        )
    return lines


def bench_case(name, net, x, budget, threads, rounds, tmp):
    import znni_core

    # warm-up on another shape (the axis with the most room, shortened): calibration,
    # compilation, FFTW are not counted; the first call on x then plans its shape
    slack = [n - f for n, f in zip(x.shape[1:], net.field_of_view)]
    axis = int(np.argmax(slack))
    if slack[axis] == 0:
        raise ValueError(f"{name}: input {x.shape[1:]} is one field of view; no other shape to warm up on")
    warm = np.ascontiguousarray(np.take(x, range(x.shape[1 + axis] - min(16, slack[axis])), axis=1 + axis))
    znni_core.infer(net, warm, memory_budget=budget)
    first, y_znni = timed(lambda: znni_core.infer(net, x, memory_budget=budget))  # plans this shape
    base = Baselines(net, x, threads, tmp)
    fns = {"znni": lambda: znni_core.infer(net, x, memory_budget=budget), **base.fns}
    times = {k: [] for k in fns}
    outs = {"znni": y_znni}
    for k, f in fns.items():  # warm-up round (ORT/OpenVINO first-inference costs)
        outs.setdefault(k, f())
    names = list(fns)
    for r in range(rounds):  # the order rotates: no tool always runs right after the same other
        for k in names[r % len(names) :] + names[: r % len(names)]:
            t, _ = timed(fns[k])
            times[k].append(t)
    ref = outs["pytorch"] if "pytorch" in outs else y_znni
    out_vox = math.prod(y_znni.shape[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    fl = direct_flops(net, y_znni.shape[1:])
    row = {
        "case": name,
        "input": list(x.shape),
        "output": list(y_znni.shape),
        "budget_gib": budget / 2**30,
        "znni_first_call_s": first,
        "median_s": med,
        "all_s": times,
        "voxels_per_s": {k: out_vox / v for k, v in med.items()},
        "gflops_direct": {k: fl / v / 1e9 for k, v in med.items()},
        "max_abs_err_vs_pytorch": {k: float(np.abs(outs[k] - ref).max()) for k in outs},
        "notes": base.notes,
    }
    from znni_core.plan import autotune

    plan = autotune(net, memory_budget=budget, input_shape=x.shape[1:])
    row["znni_plan"] = {
        "patch": list(plan.patch_shape),
        "pools": list(plan.pool_modes),
        "primitives": [s.primitive for s in plan.steps if s.op == "conv"],
        "candidates": plan.provenance.get("candidates"),
    }
    row["znni_predicted_s"] = predicted_seconds(plan, net, x.shape[1:])
    row["znni_steps"] = step_profile(net, x, plan)
    strongest = min((k for k in med if k != "znni"), key=med.get, default=None)
    if strongest:
        row["strongest"] = strongest
        row["znni_vs_strongest"] = med[strongest] / med["znni"]
    return row


def znni_cases(spec: str):
    """``--nets``: ZNNi nets at other widths and output sizes, ``arch:width:edge`` comma-separated
    (``n337:16:48`` = n337 at 16 maps, a 48^3 output), random input."""
    from .nets import ARCH, make_network

    rng = np.random.default_rng(1)
    for item in spec.split(","):
        arch, width, edge = item.split(":")
        if arch not in ARCH:
            raise SystemExit(f"--nets {item}: unknown network {arch!r} (one of {', '.join(ARCH)})")
        net = make_network(arch, width=int(width))
        shape = tuple(f + int(edge) - 1 for f in net.field_of_view)
        yield f"{arch} width {width}, output {edge}^3", net, rng.random((1,) + shape, dtype=np.float32)


def cases(quick: bool, wide: bool = False):
    from .nets import make_boundary_network, make_network, make_stack

    rng = np.random.default_rng(0)
    if ISBI.is_file():
        import tifffile

        em = tifffile.imread(ISBI)
        src = "ISBI 2012 (real EM)"
    else:
        em = (rng.random((15, 512, 512)) * 255).astype(np.uint8)
        src = "random (shared/data absent)"
    em_box = em[:, :256, :256] if not quick else em[:, :160, :160]
    yield "boundary net, " + src + f" {em_box.shape}", make_boundary_network(), em_box.astype(np.float32)[None] / 255
    for arch, edge in (("n337", 48), ("n537", 32), ("n726", 48)):
        net = make_network(arch, width=24)
        edge = edge if not quick else 16
        shape = tuple(f + edge - 1 for f in net.field_of_view)
        yield f"{arch} width 24, output {edge}^3", net, rng.random((1,) + shape, dtype=np.float32)
    for arch, edge in (("n337", 24), ("n726", 16)) if wide else ():  # the ZNNi paper's width
        net = make_network(arch, width=80)
        shape = tuple(f + edge - 1 for f in net.field_of_view)
        yield f"{arch} width 80, output {edge}^3", net, rng.random((1,) + shape, dtype=np.float32)
    for kind, shape, width in (
        ("2d", (16, 256, 256), 48),
        ("3d", (40, 96, 96), 48),
        ("1x1", (32, 128, 128), 48),
        ("1x1", (32, 128, 128), 24),
    ):
        if quick:
            shape = tuple(max(3, s // 4) for s in shape)
        net = make_stack(kind, width=width)
        yield f"pool-free stack {kind} width {width}", net, rng.standard_normal((width,) + shape, dtype=np.float32)


def render(res: dict) -> str:
    lines = [
        "# znni against the runtimes a lab could pick instead",
        "",
        f"Machine: {res['cpu']} ({res['threads']} threads), {res['platform']}; float32 sgemm peak "
        f"{res['sgemm_gflops']:.0f} GFLOP/s (numpy 2048^3, same process; each case's own run: `eff`).  Command: `{res['command']}`.",
        "",
        "Medians of interleaved rounds (seconds); dense output voxels/s; `x` = the tool's time / znni's "
        "(> 1: znni faster).  `eff` = direct-convolution FLOP/s / sgemm peak.",
        "",
    ]
    if res.get("host"):
        from .machine import host_line

        lines[2:2] = [f"Host: {host_line(res['host'])}.", ""]
    for r in res["rows"]:
        lines.append(f"## {r['case']}")
        lines.append("")
        lines.append(
            f"input {tuple(r['input'])}, output {tuple(r['output'])}, znni budget {r['budget_gib']:.1f} GiB; "
            f"znni's first call on this shape (plans it) {r['znni_first_call_s']:.2f} s; plan: patch "
            f"{tuple(r['znni_plan']['patch'])}, pools {r['znni_plan']['pools']}, "
            f"{r['znni_plan']['candidates']} candidates"
        )
        lines.append("")
        lines.append("| tool | median s | voxels/s | x (tool / znni) | eff | max abs err vs PyTorch |")
        lines.append("|---|---|---|---|---|---|")
        for k, v in sorted(r["median_s"].items(), key=lambda kv: kv[1]):
            eff = r["gflops_direct"][k] * 1e9 / r.get("sgemm_flops", res["sgemm_flops"])
            lines.append(
                f"| {k} | {v:.3f} | {r['voxels_per_s'][k]:,.0f} | {v / r['median_s']['znni']:.2f} | "
                f"{eff:.0%} | {r['max_abs_err_vs_pytorch'].get(k, float('nan')):.1e} |"
            )
        if r.get("znni_predicted_s"):
            err = r["znni_predicted_s"] / r["median_s"]["znni"] - 1
            lines.append("")
            lines.append(
                f"time model: predicted {r['znni_predicted_s']:.2f} s for znni, measured "
                f"{r['median_s']['znni']:.2f} s ({err:+.0%})"
            )
        if r.get("strongest"):
            verdict = "faster" if r["znni_vs_strongest"] >= 1 else "SLOWER"
            lines.append("")
            lines.append(
                f"znni vs the strongest baseline ({r['strongest']}): {r['znni_vs_strongest']:.2f}x ({verdict})"
            )
        for k, n in r["notes"].items():
            lines.append(f"- {k}: {n}")
        if r.get("znni_steps"):
            lines += render_steps("znni's plan", r["znni_steps"])
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.runtimes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=2.0, help="znni's memory budget, GiB")
    p.add_argument("--only", default="", help="run only cases whose name contains this")
    p.add_argument(
        "--wide",
        action="store_true",
        help="also n337 and n726 at width 80 (about 20 minutes: the baselines take 50-70 s a call on n726)",
    )
    p.add_argument("--quick", action="store_true", help="small shapes, 1 round (a smoke test)")
    p.add_argument(
        "--nets",
        default="",
        help="instead of the default cases: ZNNi nets at other widths and "
        "output sizes, arch:width:edge,... (e.g. n337:16:48,n537:40:16)",
    )
    p.add_argument("--out", default=None, help="folder for RUNTIMES.md and runtimes.json (default benchmarks/)")
    p.add_argument(
        "--keep-cache",
        action="store_true",
        help="use $ZNNI_CACHE_DIR as is (default: a fresh one, so plans and calibration are not stale)",
    )
    a = p.parse_args(argv)
    from threadpoolctl import threadpool_limits

    import znni_core
    from znni_core.plan.wisdom import cpu_model

    if not a.keep_cache:  # a fresh plan cache: znni's first call on each shape really plans
        os.environ["ZNNI_CACHE_DIR"] = tempfile.mkdtemp(prefix="znni-bench-cache-")

    out = Path(a.out) if a.out else HERE
    rounds = 1 if a.quick else a.rounds
    peak = sgemm_peak(a.threads)
    from .machine import host_class

    res = {
        "cpu": cpu_model(),
        "host": host_class(),
        "threads": a.threads,
        "platform": platform.platform(),
        "sgemm_flops": peak,
        "sgemm_gflops": peak / 1e9,
        "command": "python -m benchmarks.runtimes " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(a.threads):
        for name, net, x in znni_cases(a.nets) if a.nets else cases(a.quick, a.wide):
            if a.only and a.only not in name:
                continue
            print(f"== {name}", flush=True)
            row = bench_case(name, net, x, int(a.budget * 2**30), a.threads, rounds, Path(tmp))
            row["sgemm_flops"] = peak  # the roof of this run (a re-run case keeps its own)
            print(json.dumps({k: row[k] for k in ("median_s", "znni_first_call_s")}, default=float), flush=True)
            res["rows"].append(row)
            # the baselines' sessions go, and the heap znni keeps (arena.retain_freed_memory) goes
            # back to the OS: without this a --wide run was OOM-killed at 24 GB after n726 at width 80
            gc.collect()
            znni_core.release_cache()
    out.mkdir(parents=True, exist_ok=True)
    if a.only and (out / "runtimes.json").is_file():  # keep the other cases of the last full run
        old = json.loads((out / "runtimes.json").read_text())
        fresh = {r["case"] for r in res["rows"]}
        res["rows"] = [
            r if r["case"] not in fresh else next(n for n in res["rows"] if n["case"] == r["case"]) for r in old["rows"]
        ] + [r for r in res["rows"] if r["case"] not in {o["case"] for o in old["rows"]}]
        res["command"] = f"{old['command']}; then {res['command']} (re-ran those cases)"
    (out / "runtimes.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "RUNTIMES.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    os.environ.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
    main()
