"""``python -m benchmarks.layers``: a U-Net layer by layer, znni against OpenVINO f32.

The whole volume in one call, as ``benchmarks.unets`` runs it (znni ``infer`` with 2 GiB, OpenVINO
with the f32 hint reshaped to the volume), and each conv node's own seconds in one process: znni's
from its executor's profile (``exec/patch.profiled``: a step's own time, with the activation it
applies in its output pass) and OpenVINO's from its performance counters (``PERF_COUNT``: each
compiled node's real time, its fused post-ops included), matched by the ONNX node names.  Medians
of interleaved rounds, a pause before every call; the other nodes (adds, pooling, upsampling,
OpenVINO's slices) are summed into one row per tool.  Where a network wins or loses, a layer at a
time: ``python -m benchmarks.layers --cases detector-whole --rounds 3``; under another instruction
set, OpenVINO held to it: ``python -m benchmarks.isa --run avx2 benchmarks.layers``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .unets import DETECTOR, ISBI, SMALL, isbi, openvino_f32, torch_padded_unet

HERE = Path(__file__).resolve().parent
PAUSE_S = 0.3
CASES = ("detector-whole", "padded-small-whole", "padded-small-flat-whole")


def _case(name: str, tmp: Path, whole=None):
    """``(onnx path, input (1, z, y, x))`` of a case (a generated U-Net's on ``whole``, default 16 x
    192^2 as ``benchmarks.unets``)."""
    if name == "detector-whole":
        return DETECTOR, isbi((18, 320, 320))
    sys.path.insert(0, str(HERE.parent))
    from tests.unets import export

    (_, kernel, merge, up) = next(c for c in SMALL if c[0] == name)
    whole = tuple(whole or (16, 192, 192))
    model = torch_padded_unet(depth=1, width=24, kernel=kernel, merge=merge, up=up)
    return export(model, tmp / f"{name}.onnx", whole), isbi(whole)


def _openvino(path: Path, shape, threads: int):
    """``run(x) -> (seconds, {node name: (node type, exec type, seconds)})``: OpenVINO f32 (as
    ``benchmarks.unets`` runs it, every convolution checked f32) with its counters."""
    cm, _ = openvino_f32(path, threads, shape, PERF_COUNT="YES")
    req = cm.create_infer_request()

    def run(x):
        t0 = time.perf_counter()
        req.infer({0: x[None]})
        total = time.perf_counter() - t0
        nodes = {}
        for p in req.get_profiling_info():
            s = p.real_time.total_seconds()
            if s > 0:
                nodes[p.node_name] = (p.node_type, p.exec_type, s)
        return total, nodes

    return run


def _znni(path: Path, x, threads: int):
    """``(run, net, plan)``: ``run(x) -> (seconds, {step index: seconds})``, the plan ``infer``
    makes for the whole volume."""
    import znni_core
    from znni_core.exec.patch import profiled
    from znni_core.plan import autotune

    net = znni_core.load_network(path)
    plan = autotune(net, memory_budget=2 * 2**30, threads=threads, input_shape=x.shape[1:])

    def run(x, profile):
        if not profile:
            t0 = time.perf_counter()
            znni_core.infer(net, x, plan=plan)
            return time.perf_counter() - t0, {}
        with profiled() as seconds:
            t0 = time.perf_counter()
            znni_core.infer(net, x, plan=plan)
            total = time.perf_counter() - t0
        return total, dict(seconds)

    return run, net, plan


def measure(name: str, rounds: int, threads: int, tmp: Path, whole=None) -> dict:
    path, x = _case(name, tmp, whole)
    zrun, net, plan = _znni(path, x, threads)
    orun = _openvino(path, x.shape[1:], threads)
    zrun(x, False)  # warm: compiled kernels, buffers, transformed weights
    orun(x)
    whole = {"znni": [], "openvino": []}
    zsteps, onodes = {}, {}
    for _ in range(rounds):
        time.sleep(PAUSE_S)
        whole["znni"].append(zrun(x, False)[0])
        time.sleep(PAUSE_S)
        for k, v in zrun(x, True)[1].items():
            zsteps.setdefault(k, []).append(v)
        time.sleep(PAUSE_S)
        total, nodes = orun(x)
        whole["openvino"].append(total)
        for k, v in nodes.items():
            onodes.setdefault(k, []).append(v)
    prim = {s.index: s.primitive for s in plan.steps}
    rows, z_other, used = [], 0.0, set()
    for k, v in sorted(zsteps.items()):
        node = net.nodes[k]
        z = statistics.median(v)
        if type(node.op).__name__ != "Convolution":
            z_other += z
            continue
        hit = next((n for n in (node.name, node.name + "/WithoutBiases") if n in onodes), None)
        conv = node.op.conv
        row = {
            "node": node.name,
            "kernel": "x".join(map(str, conv.kernel)),
            "maps": f"{conv.in_channels} -> {conv.out_channels}",
            "znni": prim.get(k, "?"),
            "znni_s": z,
            "openvino": onodes[hit][0][1] if hit else None,
            "openvino_s": statistics.median(s for *_, s in onodes[hit]) if hit else None,
        }
        used.add(hit)
        rows.append(row)
    o_other = sum(statistics.median(s for *_, s in v) for k, v in onodes.items() if k not in used)
    return {
        "case": name,
        "shape": list(x.shape[1:]),
        "rows": rows,
        "other": {"znni_s": z_other, "openvino_s": o_other},
        "whole": {k: statistics.median(v) for k, v in whole.items()},
    }


def render(results: list, command: str, threads: int, rounds: int) -> str:
    from .machine import host_class, host_line

    lines = [
        "# U-Nets layer by layer: znni against OpenVINO f32",
        "",
        f"Host: {host_line(host_class())}, {threads} threads, fp32. Command: `{command}`. Medians of "
        f"{rounds} interleaved rounds (a pause before each call); `x` is OpenVINO's seconds over "
        "znni's (> 1: znni faster). A step's seconds are its own (znni: its activation included; "
        "OpenVINO: its fused post-ops).",
    ]
    for r in results:
        w = r["whole"]
        lines += [
            "",
            f"## {r['case']}, {'x'.join(map(str, r['shape']))}, the whole volume in one call",
            "",
            f"Whole call (not profiled): znni {w['znni']:.3f} s, OpenVINO {w['openvino']:.3f} s: "
            f"**{w['openvino'] / w['znni']:.2f}x**.",
            "",
            "| conv | kernel | maps | znni | ms | OpenVINO | ms | x |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            o = row["openvino_s"]
            x = f"{o / row['znni_s']:.2f}x" if o else ""
            if o and o < row["znni_s"]:
                x = f"**{x}**"
            lines.append(
                f"| {row['node']} | {row['kernel']} | {row['maps']} | {row['znni']} | {row['znni_s'] * 1e3:.1f} | "
                f"{row['openvino'] or '-'} | {o * 1e3 if o else 0:.1f} | {x} |"
            )
        zc = sum(row["znni_s"] for row in r["rows"])
        oc = sum(row["openvino_s"] or 0 for row in r["rows"])
        zo, oo = r["other"]["znni_s"], r["other"]["openvino_s"]
        lines += [
            f"| all convs | | | | {zc * 1e3:.1f} | | {oc * 1e3:.1f} | {oc / zc:.2f}x |",
            f"| everything else | | | | {zo * 1e3:.1f} | | {oo * 1e3:.1f} | {oo / zo if zo else 0:.2f}x |",
        ]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.layers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    if "detector-whole" in cases and not (DETECTOR.is_file() and ISBI.is_file()):
        ap.error(f"detector-whole needs the real network and EM: {DETECTOR}, {ISBI}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            results.append(measure(c, a.rounds, a.threads, Path(tmp)))
    text = render(
        results, "python -m benchmarks.layers " + " ".join(sys.argv[1:] if argv is None else argv), a.threads, a.rounds
    )
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
