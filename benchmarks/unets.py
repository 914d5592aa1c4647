"""``python -m benchmarks.unets``: graph networks (U-Nets) against PyTorch patch inference.

Every tool computes the same thing: the same patches, the same blending (``exec/blend.py``'s
lattice and weights) or, for a valid U-Net, the exact output.  In one process, interleaved
rounds, medians; peak memory is the RSS rise during one call (``memwatch``), for znni the
larger of that and the tracemalloc peak.

* ``detector``: the real trained synapse detector (seung-lab modelzoo, a padded residual
  U-Net) on its real 18 x 160 x 160 EM sample, one patch: znni ``infer`` vs ONNX Runtime
  and OpenVINO (``INFERENCE_PRECISION_HINT=f32``) on the same ONNX file.
* ``detector-whole``: the detector on 18 x 320 x 320 of real ISBI EM, the whole volume in one
  call: znni ``infer`` (2 GiB) vs ONNX Runtime and OpenVINO f32 on the same volume at once.
* ``detector-blend``: the detector over 18 x 288 x 288 of real ISBI EM, patches of
  18 x 160 x 160 overlapping by 32 in y and x, bump-blended: znni vs the same lattice run
  patch by patch through ONNX Runtime and OpenVINO.
* ``padded-unet``: a generated RSUNet-like padded U-Net (BatchNorm, 3 levels, (1,2,2)
  pooling, widths 16-64) on 16 x 256 x 256, patches of 16 x 128 x 128, overlap 32: znni vs
  PyTorch eager on the same lattice, and MONAI ``sliding_window_inference`` (Gaussian
  weights, overlap 0.25) if MONAI is installed.
* ``padded-small-whole``, ``padded-small-flat-whole``, ``padded-small-concat-whole``,
  ``padded-small-deconv-whole`` and ``padded-small-trilinear-whole`` (:data:`SMALL`): a generated
  padded U-Net (1 level, widths 24-48, BN, ELU; 3^3 or 1x3x3 kernels; the skip added or
  concatenated; nearest or trilinear upsampling and a 1x1x1 conv, or a transposed conv) on 16 x
  192 x 192 of ISBI EM, the whole volume in one call: znni ``infer`` vs ONNX Runtime and OpenVINO
  f32 on the same volume (a small net: narrow layers, whose Winograd transforms weigh most, and
  memory-bound passes count).
* ``valid-unet``: a MALA-style valid U-Net (3^3 kernels, 2 levels) on a 32 x 204 x 204
  volume: znni (exact tiles) vs PyTorch on the whole volume in one pass.

``pip install -e '.[bench]' torch==2.13.0 monai``; results to ``benchmarks/UNETS.md`` and
``unets.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "data"
DETECTOR = SHARED / "models" / "modelzoo_iarpa1_synapse_detection.onnx"
SAMPLE = SHARED / "models" / "modelzoo_iarpa1_synapse_detection_sample1_reference.npz"
ISBI = SHARED / "isbi2012" / "test-volume.tif"


def isbi(shape) -> np.ndarray:
    import tifffile

    v = tifffile.imread(ISBI).astype(np.float32) / 255
    reps = [-(-s // n) for s, n in zip(shape, v.shape)]
    return np.ascontiguousarray(np.tile(v, reps)[tuple(slice(0, s) for s in shape)])[None]


def lattice_run(fn, x, patch, overlap, blend="bump"):
    """Blend ``fn`` (one patch (C, p) -> (C_out, p)) over ``x`` exactly as znni's lattice does."""
    from znni_core.exec.blend import axis_plan

    n = x.shape[1:]
    axes = [axis_plan(m, p, o, blend) for m, p, o in zip(n, patch, overlap)]
    acc, w3 = None, np.einsum("i,j,k->ijk", *(a[1] for a in axes)).astype(np.float32)
    for start in itertools.product(*(a[0] for a in axes)):
        sl = tuple(slice(s, s + p) for s, p in zip(start, patch))
        y = fn(np.ascontiguousarray(x[(slice(None),) + sl]))
        if acc is None:
            acc = np.zeros((y.shape[0],) + n, np.float32)
        acc[(slice(None),) + sl] += y * w3
    return acc / np.einsum("i,j,k->ijk", *(a[2] for a in axes)).astype(np.float32)


def _symbolic_spatial_dims(path, tmp: Path) -> Path:
    """A copy of the ONNX file whose input and output spatial dims are symbolic (ONNX Runtime
    refuses a shape other than the file's fixed one)."""
    import onnx

    m = onnx.load(str(path))
    for io in (m.graph.input[0], m.graph.output[0]):
        for d, name in zip(io.type.tensor_type.shape.dim[2:], ("z", "y", "x")):
            d.ClearField("dim_value")
            d.dim_param = name
    del m.graph.value_info[:]
    out = tmp / ("dynamic-" + Path(path).name)
    onnx.save(m, str(out))
    return out


def openvino_f32(path, threads, shape=None, **config):
    """``(compiled model, {runtime precisions of its convolutions})``: OpenVINO on the CPU with the
    f32 hint (``config``: more of its settings), reshaped to ``(1, 1, *shape)`` when given; an error
    unless every convolution runs f32.  ``ImportError`` without OpenVINO."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(path))
    if shape is not None:
        model.reshape([1, 1, *shape])
    hints = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    cm = core.compile_model(model, "CPU", hints | config)
    prec = {
        op.get_rt_info()["runtimePrecision"].astype(str)
        for op in cm.get_runtime_model().get_ops()
        if op.get_rt_info()["layerType"].astype(str) == "Convolution"
    }
    if prec != {"f32"}:
        raise RuntimeError(f"OpenVINO did not run f32 convolutions: {prec}")
    return cm, prec


def onnx_runners(path, threads, shape=None, tmp: Path | None = None):
    """{name: fn((C, z, y, x)) -> (C_out, z, y, x)} for ONNX Runtime and OpenVINO f32 on ``path``;
    with ``shape`` (z, y, x), on a whole volume of that shape in one call (OpenVINO's model
    reshaped to it, ONNX Runtime on a copy with symbolic spatial dims, written to ``tmp``)."""
    out, notes = {}, {}
    try:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        src = path if shape is None else _symbolic_spatial_dims(path, tmp)
        sess = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        out["onnxruntime"] = lambda x: sess.run(None, {name: x[None]})[0][0]
    except ImportError:
        notes["onnxruntime"] = "not installed"
    try:
        cm, prec = openvino_f32(path, threads, shape)
        req = cm.create_infer_request()
        out["openvino-f32"] = lambda x: req.infer({0: x[None]})[cm.output(0)][0].copy()
        notes["openvino-f32"] = (
            "" if shape is None else "reshaped to the whole volume, "
        ) + f"Convolution runtimePrecision {sorted(prec)}"
    except ImportError:
        notes["openvino-f32"] = "not installed"
    return out, notes


def torch_padded_unet(depth=3, width=16, kernel=(3, 3, 3), merge="add", up="nearest"):
    import torch

    sys.path.insert(0, str(HERE.parent))
    from tests.unets import UNet, randomise_bn

    torch.manual_seed(0)
    return randomise_bn(
        UNet(
            valid=False,
            depth=depth,
            kernel=kernel,
            pool=(1, 2, 2),
            width=width,
            bn=True,
            up=up,
            merge=merge,
            act="elu",
            c_out=3,
        ),
        0,
    )


def torch_valid_unet():
    import torch

    sys.path.insert(0, str(HERE.parent))
    from tests.unets import UNet

    torch.manual_seed(0)
    return UNet(valid=True, depth=2, kernel=(3, 3, 3), pool=(1, 2, 2), width=12, c_out=3).eval()


def predicted_seconds(net, plan, shape) -> float:
    """The time model's seconds for ``infer`` on ``shape``: the plan's per-patch prediction x
    the patches the tiling runs (``exec/tiling.window`` over the whole output)."""
    from znni_core.exec.tiling import window

    out = tuple(shape) if net.kind == "padded" else net.output_shape(net.floor_admissible(tuple(shape)))
    win = window(net, plan, (0, 0, 0), out, whole_out=out)
    return plan.predicted_seconds * math.prod(len(s) for s in win.starts)


def torch_fn(model):
    import torch

    def fn(x):
        with torch.no_grad():
            return model(torch.from_numpy(x[None])).numpy()[0]

    return fn


#: the small padded U-Nets run on a whole volume: (case, kernel, skip merge, decoder upsampling)
SMALL = (
    ("padded-small-whole", (3, 3, 3), "add", "nearest"),
    ("padded-small-flat-whole", (1, 3, 3), "add", "nearest"),
    ("padded-small-concat-whole", (1, 3, 3), "concat", "nearest"),
    ("padded-small-deconv-whole", (1, 3, 3), "concat", "transpose"),
    ("padded-small-trilinear-whole", (1, 3, 3), "concat", "linear"),
)
UPSAMPLING = {
    "nearest": "nearest upsampling + 1x1x1 conv",
    "transpose": "transposed conv",
    "linear": "trilinear upsampling + 1x1x1 conv",
}


def build(tmp: Path, threads: int, quick: bool, only=None):
    import torch

    import znni_core
    from znni_core.plan import autotune

    sys.path.insert(0, str(HERE.parent))
    from tests.unets import admissible, export

    torch.set_num_threads(threads)
    budget = 4 * 2**30
    out = []
    if DETECTOR.is_file():
        net = znni_core.load_network(DETECTOR)
        x = np.load(SAMPLE)["input"][None]
        runners, notes = onnx_runners(DETECTOR, threads)
        fns = {"znni": lambda n=net: znni_core.infer(n, x, memory_budget=budget)}
        fns.update({k: (lambda f=f: f(x)) for k, f in runners.items()})
        plan = autotune(net, memory_budget=budget, input_shape=x.shape[1:])  # the plan infer makes (cached)
        notes = dict(notes, predicted_s=predicted_seconds(net, plan, x.shape[1:]))
        out.append(("detector", "real synapse detector, real EM 18x160x160, one patch", fns, notes))
        if not quick and ISBI.is_file():
            whole = (18, 320, 320)
            xw = isbi(whole)
            runners_w, notes_w = onnx_runners(DETECTOR, threads, whole, tmp)
            fns = {"znni": lambda n=net: znni_core.infer(n, xw, memory_budget=2 * 2**30)}
            fns.update({k: (lambda f=f: f(xw)) for k, f in runners_w.items()})
            plan = autotune(net, memory_budget=2 * 2**30, input_shape=whole)
            out.append(
                (
                    "detector-whole",
                    "synapse detector on ISBI EM 18x320x320, the whole volume in one call "
                    "(znni: infer with 2 GiB, as a user calls it)",
                    fns,
                    dict(notes_w, predicted_s=predicted_seconds(net, plan, whole)),
                )
            )
            xb = isbi((18, 288, 288))
            plan = autotune(
                net, memory_budget=budget, patch_shape=(18, 160, 160), overlap=(0, 32, 32), input_shape=xb.shape[1:]
            )
            fns = {"znni": lambda n=net, p=plan: znni_core.infer(n, xb, plan=p)}
            fns.update({k: (lambda f=f: lattice_run(f, xb, (18, 160, 160), (0, 32, 32))) for k, f in runners.items()})
            out.append(
                (
                    "detector-blend",
                    "synapse detector, ISBI EM 18x288x288, patches 18x160x160 overlap (0,32,32), bump",
                    fns,
                    dict(notes, predicted_s=predicted_seconds(net, plan, xb.shape[1:])),
                )
            )
    model = torch_padded_unet()
    patch = (16, 128, 128)
    path = export(model, tmp / "padded.onnx", patch)
    net = znni_core.load_network(path)
    xp = isbi((16, 256, 256) if not quick else (16, 128, 192))
    plan = autotune(net, memory_budget=budget, patch_shape=patch, overlap=(0, 32, 32), input_shape=xp.shape[1:])
    tf = torch_fn(model)  # every closure below binds its own net and plan (the names are reused)
    fns = {
        "znni": lambda n=net, p=plan: znni_core.infer(n, xp, plan=p),
        "pytorch": lambda: lattice_run(tf, xp, patch, (0, 32, 32)),
    }
    notes = {}
    try:
        import torch
        from monai.inferers import sliding_window_inference

        t = torch.from_numpy(xp[None])

        def monai(m=model):
            with torch.no_grad():
                return sliding_window_inference(t, patch, 1, m, overlap=0.25, mode="gaussian").numpy()[0]

        fns["monai-gaussian"] = monai
        notes["monai-gaussian"] = "MONAI sliding_window_inference, overlap 0.25, gaussian (its own lattice)"
    except ImportError:
        notes["monai-gaussian"] = "not installed"
    notes["predicted_s"] = predicted_seconds(net, plan, xp.shape[1:])
    out.append(
        (
            "padded-unet",
            f"generated padded U-Net (3 levels, widths 16-128, BN, ELU), ISBI {xp.shape[1:]}, "
            "patches 16x128x128 overlap (0,32,32), bump",
            fns,
            notes,
        )
    )
    whole = (16, 192, 192)
    xs = isbi(whole)
    for case, kernel, merge, up in SMALL:
        if only and case not in only:
            continue
        model = torch_padded_unet(depth=1, width=24, kernel=kernel, merge=merge, up=up)
        path = export(model, tmp / f"{case}.onnx", whole)
        net = znni_core.load_network(path)
        runners, notes = onnx_runners(path, threads)
        fns = {"znni": lambda n=net: znni_core.infer(n, xs, memory_budget=2 * 2**30)}
        fns.update({k: (lambda f=f: f(xs)) for k, f in runners.items()})
        plan = autotune(net, memory_budget=2 * 2**30, input_shape=whole)  # the plan infer makes (cached)
        out.append(
            (
                case,
                f"generated padded U-Net (1 level, {'x'.join(map(str, kernel))} kernels, widths 24-48, BN, ELU, "
                f"skip {'added' if merge == 'add' else 'concatenated'}, {UPSAMPLING[up]}), "
                f"ISBI {whole}, the whole volume in one call (znni: infer with 2 GiB, as a user calls it)",
                fns,
                dict(notes, predicted_s=predicted_seconds(net, plan, whole)),
            )
        )
    model = torch_valid_unet()
    exported = tuple(admissible(model, a, lo) for a, lo in enumerate((8, 64, 64)))
    net = znni_core.load_network(export(model, tmp / "valid.onnx", exported))
    shape = tuple(admissible(model, a, lo) for a, lo in enumerate((32, 204, 204) if not quick else (24, 100, 100)))
    xv = isbi(shape)
    tv = torch_fn(model)
    fns = {"znni": lambda n=net: znni_core.infer(n, xv, memory_budget=budget), "pytorch": lambda: tv(xv)}
    plan = autotune(net, memory_budget=budget, input_shape=shape)  # the plan infer makes (cached)
    out.append(
        (
            "valid-unet",
            f"generated valid U-Net (2 levels, 3^3 kernels, widths 12-48), ISBI {shape}, exact",
            fns,
            {"predicted_s": predicted_seconds(net, plan, shape)},
        )
    )
    return out


#: seconds of rest before every timed call: runtimes leave worker threads spinning after a call,
#: and on 2 cores the next tool paid for them (1.5-2.4x)
PAUSE_S = 0.2


def run_case(name, what, fns, notes, rounds):
    from .memwatch import measure

    notes = dict(notes)
    predicted = notes.pop("predicted_s", None)

    outs, times = {}, {k: [] for k in fns}
    for k, f in fns.items():  # warm-up: plans, compilation, first-call costs
        outs[k] = f()
    for _ in range(rounds):
        for k, f in fns.items():
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    mem = {k: measure(f)[2] for k, f in fns.items()}
    # numpy's large buffers are reused from the heap after the warm-up, so znni's RSS hardly rises;
    # tracemalloc sees every numpy allocation (and none of torch's, ORT's or OpenVINO's)
    import tracemalloc

    import znni_core

    znni_core.release_cache()  # the arena starts empty: what it holds is counted too
    tracemalloc.start()
    fns["znni"]()
    mem["znni"] = max(mem["znni"], tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    ref = outs.get("pytorch", outs.get("onnxruntime"))
    res = {"what": what, "notes": notes, "tools": {}, "znni_predicted_s": predicted}
    for k in fns:
        err = float(np.abs(outs[k] - ref).max()) if ref is not None and outs[k].shape == ref.shape else None
        res["tools"][k] = {
            "median_s": statistics.median(times[k]),
            "times_s": times[k],
            "peak_rss_mib": mem[k] / 2**20,
            "max_abs_diff_vs_ref": err,
        }
    med = {k: v["median_s"] for k, v in res["tools"].items()}
    others = [v for k, v in med.items() if k != "znni" and not k.startswith("monai")]
    res["znni_speedup_vs_strongest"] = min(others) / med["znni"] if others else None
    return res


def render(res: dict) -> str:
    m = res["machine"]
    host = ""
    if m.get("host"):
        from .machine import host_line

        host = f"Host: {host_line(m['host'])}. "
    lines = [
        "# Graph networks (U-Nets): znni against PyTorch patch inference",
        "",
        f"Machine: {m['cpu']}, {m['threads']} threads, fp32. {host}Command: `{res['command']}`. "
        f"Medians of {res['rounds']} interleaved rounds after a warm-up call (planning excluded); "
        "peak memory = RSS rise during one call (znni: tracemalloc peak, numpy reuses freed heap "
        "memory so its RSS barely rises).",
        "",
        "| case | tool | median s | tool s / znni s (> 1: znni faster) | peak MiB | max abs diff vs reference |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in res["cases"].items():
        zn = c["tools"]["znni"]["median_s"]
        for tool, t in c["tools"].items():
            diff = "" if t["max_abs_diff_vs_ref"] is None else f"{t['max_abs_diff_vs_ref']:.1e}"
            lines.append(
                f"| {name} | {tool} | {t['median_s']:.3f} | {t['median_s'] / zn:.2f}x | "
                f"{t['peak_rss_mib']:.0f} | {diff} |"
            )
    lines.append("")
    for name, c in res["cases"].items():
        lines.append(f"* **{name}**: {c['what']}." + "".join(f" {k}: {v}." for k, v in c["notes"].items()))
        if c.get("znni_predicted_s"):
            zn = c["tools"]["znni"]["median_s"]
            lines.append(
                f"  Time model: predicted {c['znni_predicted_s']:.2f} s for znni, measured {zn:.2f} s "
                f"({c['znni_predicted_s'] / zn - 1:+.0%})."
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller inputs, fewer cases (smoke test)")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    from znni_core.plan.wisdom import cpu_model

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("ZNNI_CACHE_DIR", tmp)
        built = build(Path(tmp), args.threads, args.quick, args.only.split(",") if args.only else None)
        from .machine import host_class

        res = {
            "machine": {
                "cpu": cpu_model(),
                "host": host_class(),
                "threads": args.threads,
                "python": platform.python_version(),
            },
            "command": "python -m benchmarks.unets " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rounds": args.rounds,
            "cases": {},
        }
        for name, what, fns, notes in built:
            if args.only and name not in args.only.split(","):
                continue
            print(f"{name}: {what}", flush=True)
            res["cases"][name] = run_case(name, what, fns, notes, args.rounds)
            for k, t in res["cases"][name]["tools"].items():
                print(f"  {k:<16} {t['median_s']:8.3f} s  {t['peak_rss_mib']:7.0f} MiB", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unets.json").write_text(json.dumps(res, indent=1))
    (args.out / "UNETS.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
