"""``python -m benchmarks.isa``: the same plans built for other instruction sets, side by side.

A lab's CPU may have AVX2 only (16 vector registers of 8 floats: AMD Zen 2/3, Intel before
Skylake-SP) or AVX-512 with a 256-bit preference (Intel server cores, where LLVM picks ymm
registers by the CPU's name). znni's kernels are compiled by numba for the host, so one AVX-512
host reproduces the others by asking numba for another target:

* ``avx512``: the host's own target, 512-bit vectors (``ZNNI_VECTOR_WIDTH=512``);
* ``avx2``: ``NUMBA_CPU_NAME=znver3`` with a Zen 3's features (AVX2, FMA, 16 registers: the
  name alone keeps the host's AVX-512 features) and OpenBLAS' Haswell
  kernels (``OPENBLAS_CORETYPE=Haswell``), as on an AVX2 host;
* ``intel``: ``NUMBA_CPU_NAME=cascadelake`` (AVX-512, LLVM's 256-bit preference for Intel cores);
* ``intel-512``: the same CPU with 512-bit vectors preferred, as on an Intel host whose ``znni warmup``
  measured 512-bit code faster;
* ``avx2-numba`` and ``avx2-blas``: the two halves of ``avx2`` apart (znni's numba kernels built
  for Zen 3; OpenBLAS' Haswell kernels, which run Winograd's batched products, under AVX-512 numba).

FFTW chooses its SIMD codelets at run time from the CPU: no build here changes the FFT layers.

Each case is planned once, in this process, and every build runs that same plan (the same
primitives, patches and kernel parameters), so what differs is only the code the compiler made.
Every build runs in a process of its own (numba's target is fixed per process), rounds
interleaved across builds, a pause before every timed call, medians. Each step is timed on its
own (``exec/patch.profiled``); the table gives each build's seconds and its ratio to ``avx512``,
and flags the steps more than 10% slower.

    python -m benchmarks.isa                      # every case, builds avx512 avx2 intel, 3 rounds
    python -m benchmarks.isa --cases boundary,n337 --builds avx512,avx2 --rounds 5
    python -m benchmarks.isa --run avx2 benchmarks.unets --only detector-whole   # against baselines

``--run`` runs another benchmark in one build, the baselines held to that instruction set too
(:data:`BASELINE_CAPS`: OpenVINO and PyTorch through oneDNN's dispatch limit; ONNX Runtime cannot be).

The boundary net reads the ISBI EM of ``../shared/data`` when it is there (random input otherwise);
the U-Nets need PyTorch (their ONNX export). Results: ``--out`` (default ``benchmarks/isa``):
``ISA.md`` and ``isa.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

#: the baselines held to the same instruction set (``--run``): oneDNN, under OpenVINO and PyTorch,
#: dispatches no further than ``ONEDNN_MAX_CPU_ISA`` (OpenVINO's runtime model then names
#: ``brgconv_avx2_f32`` where it named ``brgconv_avx512_f32``), PyTorch's own kernels no further
#: than ``ATEN_CPU_CAPABILITY``; ONNX Runtime's MLAS has no such switch and runs AVX-512 in every build
BASELINE_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "OV_CPU_MAX_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "intel": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "OV_CPU_MAX_ISA": "AVX512_CORE_VNNI"},
}
#: a Zen 3's vector features (AVX2, no AVX-512): numba passes the host's features with any
#: ``NUMBA_CPU_NAME``, so the name alone (``znver3``) still compiled zmm code on an AVX-512 host
ZEN3_AVX2 = "+64bit,+avx,+avx2,+bmi,+bmi2,+f16c,+fma,+popcnt,+sse4.2,-avx512f"
#: Cascade Lake's vector features as LLVM names them, 512-bit vectors preferred
CASCADELAKE_512 = (
    "+64bit,+avx,+avx2,+bmi,+bmi2,+f16c,+fma,+popcnt,+sse4.2,"
    "+avx512f,+avx512cd,+avx512bw,+avx512dq,+avx512vl,+avx512vnni,-prefer-256-bit"
)
BUILDS = {
    "avx512": {"ZNNI_VECTOR_WIDTH": "512"},
    "avx2": {"NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": ZEN3_AVX2, "OPENBLAS_CORETYPE": "Haswell"}
    | BASELINE_CAPS["avx2"],
    "intel": {"NUMBA_CPU_NAME": "cascadelake"} | BASELINE_CAPS["intel"],
    # Intel code where the host's warmup measured 512-bit vectors faster (LLVM's cascadelake
    # scheduling, its 256-bit preference turned off): what an Intel host that chose 512 runs
    "intel-512": {"NUMBA_CPU_NAME": "cascadelake", "NUMBA_CPU_FEATURES": CASCADELAKE_512} | BASELINE_CAPS["intel"],
    # the two halves of avx2 apart: znni's numba kernels, and OpenBLAS (Winograd's batched products)
    "avx2-numba": {"NUMBA_CPU_NAME": "znver3", "NUMBA_CPU_FEATURES": ZEN3_AVX2},
    "avx2-blas": {"ZNNI_VECTOR_WIDTH": "512", "OPENBLAS_CORETYPE": "Haswell"},
}
#: environment variables a build sets or clears (the user's own choices would mix builds)
TARGET_VARS = (
    "NUMBA_CPU_NAME",
    "NUMBA_CPU_FEATURES",
    "ZNNI_VECTOR_WIDTH",
    "OPENBLAS_CORETYPE",
    "ONEDNN_MAX_CPU_ISA",
    "OV_CPU_MAX_ISA",
    "ATEN_CPU_CAPABILITY",
)
CASES = (
    "boundary",
    "n337",
    "n537",
    "n726",
    "detector",
    "padded-unet",
    "padded-small",
    "padded-small-flat",
    "valid-unet",
)
PAUSE_S = 0.2
#: cases planned as ``infer`` plans a whole volume (one patch), not a task's blended patches
WHOLE = ("padded-small", "padded-small-flat")
SLOWER = 1.10  # a step's time beyond this ratio to avx512's is flagged


def _case(name: str, tmp: Path):
    """``(description, network path, input)`` of a case, or None when it cannot be built here."""
    import znni_core

    from .nets import make_boundary_network, make_network

    rng = np.random.default_rng(0)
    if name == "boundary":
        from .runtimes import ISBI

        if ISBI.is_file():
            import tifffile

            x, src = tifffile.imread(ISBI)[:15, :256, :256].astype(np.float32)[None] / 255, "ISBI EM"
        else:
            x, src = rng.random((1, 15, 256, 256), dtype=np.float32), "random"
        return (
            f"boundary net, {src} 15x256x256",
            znni_core.save_network(make_boundary_network(), tmp / "boundary.yaml"),
            x,
        )
    if name in ("n337", "n537", "n726"):
        edge = {"n337": 48, "n537": 32, "n726": 48}[name]
        net = make_network(name, width=24)
        shape = tuple(f + edge - 1 for f in net.field_of_view)
        return (
            f"{name} width 24, output {edge}^3",
            znni_core.save_network(net, tmp / f"{name}.yaml"),
            rng.random((1,) + shape, dtype=np.float32),
        )
    from . import unets

    if name == "detector":
        if not (unets.DETECTOR.is_file() and unets.ISBI.is_file()):
            return None
        return "real synapse detector, ISBI EM 18x320x320 (whole volume)", unets.DETECTOR, unets.isbi((18, 320, 320))
    try:
        import torch  # noqa: F401  (the U-Nets are exported from PyTorch)
    except ImportError:
        return None
    sys.path.insert(0, str(HERE.parent))
    from tests.unets import admissible, export

    if name == "padded-unet":
        path = export(unets.torch_padded_unet(), tmp / "padded.onnx", (16, 128, 128))
        return "generated padded U-Net (BN, ELU, widths 16-128), 16x256x256", path, unets.isbi((16, 256, 256))
    if name in ("padded-small", "padded-small-flat"):
        kernel = (1, 3, 3) if name == "padded-small-flat" else (3, 3, 3)
        path = export(unets.torch_padded_unet(depth=1, width=24, kernel=kernel), tmp / f"{name}.onnx", (16, 192, 192))
        what = f"generated padded U-Net (1 level, widths 24-48, BN, ELU, {kernel} kernels), 16x192x192 whole"
        return what, path, unets.isbi((16, 192, 192))
    if name == "valid-unet":
        model = unets.torch_valid_unet()
        path = export(model, tmp / "valid.onnx", tuple(admissible(model, a, lo) for a, lo in enumerate((8, 64, 64))))
        shape = tuple(admissible(model, a, lo) for a, lo in enumerate((32, 204, 204)))
        return f"generated valid U-Net (widths 12-48), {shape}", path, unets.isbi(shape)
    raise SystemExit(f"--cases: unknown case {name!r} (one of {', '.join(CASES)})")


def _plan(net_path: Path, x: np.ndarray, budget: int, threads: int, out: Path, whole: bool = False) -> None:
    """The plan ``infer`` would make for ``x`` (estimate effort), saved for every build to run;
    a padded U-Net in a task's blended patches unless ``whole``."""
    import znni_core
    from znni_core.plan import autotune

    net = znni_core.load_network(net_path)
    kw = {}
    if net.kind == "padded" and not whole:  # a padded U-Net in overlapping, blended patches as a task runs it
        kw = {"patch_shape": tuple(min(s, p) for s, p in zip(x.shape[1:], (16, 128, 128))), "overlap": (0, 32, 32)}
    autotune(net, memory_budget=budget, threads=threads, input_shape=x.shape[1:], **kw).save(out)


def child(case_dir: Path) -> dict:
    """Run the case's plan in this process (its build): one warm call, a timed call after a
    pause, then ``calls`` profiled calls (a pause before each); each step's median seconds."""
    import znni_core
    from znni_core.exec.patch import profiled
    from znni_core.plan import Plan

    from .machine import host_class

    meta = json.loads((case_dir / "case.json").read_text())
    net = znni_core.load_network(meta["net"])
    x = np.load(case_dir / "x.npy")
    plan = Plan.load(case_dir / "plan.json")
    znni_core.infer(net, x, plan=plan)
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    znni_core.infer(net, x, plan=plan)
    total = time.perf_counter() - t0
    samples: dict = {}
    for _ in range(meta.get("calls", 1)):
        time.sleep(PAUSE_S)
        with profiled() as seconds:
            znni_core.infer(net, x, plan=plan)
        for k, v in seconds.items():
            samples.setdefault(str(k), []).append(v)
    steps = {k: statistics.median(v) for k, v in samples.items()}
    return {"total_s": total, "steps": steps, "host": host_class()}


def _run_child(case_dir: Path, build: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TARGET_VARS} | BUILDS[build]
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.isa", "--child", str(case_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE.parent,
    )
    if r.returncode != 0:
        raise RuntimeError(f"build {build}, {case_dir.name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(
    cases, builds, rounds: int, budget: int, threads: int, tmp: Path, timeout: float, calls: int = 1, log=print
) -> list:
    from znni_core.plan import Plan

    results = []
    for name in cases:
        d = tmp / name
        d.mkdir()
        made = _case(name, d)
        if made is None:
            log(f"{name}: skipped (its data or PyTorch is not here)")
            continue
        what, net_path, x = made
        np.save(d / "x.npy", x)
        (d / "case.json").write_text(json.dumps({"net": str(net_path), "calls": calls}))
        _plan(net_path, x, budget, threads, d / "plan.json", whole=name in WHOLE)
        plan = Plan.load(d / "plan.json")
        runs = {b: [] for b in builds}
        for r in range(rounds):
            for b in builds if r % 2 == 0 else builds[::-1]:  # interleaved, alternating order
                runs[b].append(_run_child(d, b, timeout))
                log(f"{name} round {r + 1} {b}: {runs[b][-1]['total_s']:.3f} s")
        steps = []
        for st in plan.steps:
            key = str(st.index)
            if st.op == "act" or not all(key in run["steps"] for b in builds for run in runs[b]):
                continue
            steps.append(
                {
                    "step": st.index,
                    "op": st.op,
                    "primitive": st.primitive,
                    "in": list(st.in_shape),
                    "seconds": {b: statistics.median(run["steps"][key] for run in runs[b]) for b in builds},
                }
            )
        results.append(
            {
                "case": name,
                "what": what,
                "total_s": {b: statistics.median(run["total_s"] for run in runs[b]) for b in builds},
                "steps": steps,
                "hosts": {b: runs[b][0]["host"] for b in builds},
            }
        )
    return results


def render(results: list, builds, command: str, host: str) -> str:
    base = builds[0]
    lines = [
        "# The same plans under other instruction sets",
        "",
        f"Host: {host}. Command: `{command}`. Builds: "
        + "; ".join(f"`{b}` = {' '.join(f'{k}={v}' for k, v in BUILDS[b].items())}" for b in builds)
        + f". Seconds are medians; `x` is a build's time over `{base}`'s; **bold**: more than "
        f"{(SLOWER - 1) * 100:.0f}% slower.",
    ]
    for res in results:
        t = res["total_s"]
        lines += [
            "",
            f"## {res['what']}",
            "",
            "whole call: "
            + ", ".join(f"{b} {t[b]:.3f} s" + (f" ({t[b] / t[base]:.2f}x)" if b != base else "") for b in builds),
            "",
            "| step | op | primitive | in (N,C,z,y,x) | "
            + " | ".join(builds)
            + " | "
            + " | ".join(f"x {b}" for b in builds[1:])
            + " |",
            "|" + "---|" * (4 + 2 * len(builds) - 1),
        ]
        for st in res["steps"]:
            s = st["seconds"]
            ratios = []
            for b in builds[1:]:
                x = s[b] / s[base] if s[base] > 0 else float("nan")
                ratios.append(f"**{x:.2f}**" if x > SLOWER else f"{x:.2f}")
            lines.append(
                f"| {st['step']} | {st['op']} | {st['primitive']} | {tuple(st['in'])} | "
                + " | ".join(f"{s[b]:.4f}" for b in builds)
                + " | "
                + " | ".join(ratios)
                + " |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--builds", default="avx512,avx2,intel", help=f"comma-separated, the first is the base: {', '.join(BUILDS)}"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--calls", type=int, default=1, help="profiled calls per build and round (a step's time: their median)"
    )
    ap.add_argument("--memory", default="2GiB", help="the plans' memory budget")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per build's process")
    ap.add_argument("--out", default=str(HERE / "isa"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--run",
        metavar="BUILD",
        help="run another benchmark under BUILD, baselines held to its instruction set: "
        "python -m benchmarks.isa --run avx2 benchmarks.unets --only detector-whole",
    )
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    rest = a.rest
    if a.child:
        print(json.dumps(child(Path(a.child))))
        return
    if a.run:
        if a.run not in BUILDS or not rest:
            raise SystemExit(f"--run BUILD MODULE [ARGS...]: BUILD one of {', '.join(BUILDS)}, then a benchmark module")
        env = {k: v for k, v in os.environ.items() if k not in TARGET_VARS} | BUILDS[a.run]
        print("build " + a.run + ": " + " ".join(f"{k}={v}" for k, v in BUILDS[a.run].items()), flush=True)
        raise SystemExit(subprocess.run([sys.executable, "-m", *rest], env=env).returncode)
    if rest:
        ap.error(f"unrecognised arguments: {' '.join(rest)}")
    from znni_core.units import parse_bytes

    from .machine import host_class, host_line

    builds = [b.strip() for b in a.builds.split(",") if b.strip()]
    unknown = [b for b in builds if b not in BUILDS]
    if unknown:
        raise SystemExit(f"--builds: unknown {unknown} (one of {', '.join(BUILDS)})")
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        results = run(cases, builds, a.rounds, parse_bytes(a.memory), a.threads, Path(tmp), a.timeout, a.calls)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.isa " + " ".join(sys.argv[1:] if argv is None else argv)
    host = host_line(host_class())
    (out / "isa.json").write_text(json.dumps({"host": host, "command": command, "results": results}, indent=1) + "\n")
    text = render(results, builds, command, host)
    (out / "ISA.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
