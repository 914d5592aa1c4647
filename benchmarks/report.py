"""Render ``results_w*.json`` into ``RESULTS.md`` (tables, plots, profiles, notes)."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30
# speed targets at width 24, same budget: znni / PyTorch dense and znni / naive
TARGETS_DENSE = {"n337": 1.2, "n537": 4.0, "n726": 8.0, "n926": 20.0}
TARGET_NAIVE = 50.0


def _k(v):
    if v is None:
        return "-"
    return f"{v / 1e3:,.1f}k" if v >= 1e3 else f"{v:,.0f}"


def _g(b):
    return "-" if b is None else f"{b / GIB:.2f}"


def _plan_short(p):
    if not p:
        return "-"
    prims = {}
    for x in p["primitives"]:
        prims[x] = prims.get(x, 0) + 1
    pr = ", ".join(f"{k} x{v}" for k, v in prims.items())
    return f"patch {tuple(p['patch_shape'])}, pools {'/'.join(p['pool_modes']) or '-'}, {pr}"


def machine_section(m: dict, cfg: dict, command: str) -> list[str]:
    blas = "; ".join(
        f"{b['internal_api']} {b['version']} ({b['architecture']}, {b['num_threads']} threads)" for b in m["blas"]
    )
    v = m["versions"]
    lines = [
        "## Machine and software",
        "",
        f"* date (UTC): {m['date']}; git HEAD `{m['git_head']}`",
        f"* CPU: {m['cpu']} (AVX-512: {'yes' if m['avx512'] else 'no'}), {m['cores']} usable cores, "
        f"{m['ram_gib']} GiB RAM ({m['ram_available_gib']} GiB available at start)",
        f"* load average at start {m['loadavg_at_start']}, at end {m.get('loadavg_at_end', '?')} "
        "(the machine is shared; > ~0.5 at start means another process was using the cores)",
        f"* {m['platform']}",
        "* versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"* BLAS as loaded: {blas}",
        f"* `OPENBLAS_CORETYPE` in the environment the benchmark was started from: "
        f"`{m['openblas_coretype_original']}`; while measuring: `{m['openblas_coretype_env']}`",
        f"* measured float32 GEMM peak (numpy, 2048^3, {cfg['threads']} threads): "
        f"**{m['gemm_flops'] / 1e9:.0f} GFLOP/s**"
        + (
            f" (with `OPENBLAS_CORETYPE=Haswell`: {m['gemm_flops_haswell'] / 1e9:.0f} GFLOP/s)"
            if m.get("gemm_flops_haswell")
            else ""
        ),
        f"* PyTorch: `torch.set_num_threads({cfg['threads']})`, inference mode, float32; znni plan threads "
        f"{cfg['threads']}, autotuner effort `{cfg['effort']}`",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
    ]
    return lines


def width_section(res: dict, png: str | None) -> list[str]:
    cfg = res["config"]
    w = cfg["width"]
    budget = cfg["budget"]
    L = [
        f"## Width {w}: side by side at a {budget / GIB:g} GiB budget",
        "",
        f"Median of {cfg['repeats']} interleaved rounds (order rotated per round). "
        "Output voxels/s of the dense output; peak = measured RSS rise during the call; "
        "GEMM fraction = direct-conv FLOPs per output voxel x voxels/s / measured GEMM FLOP/s.",
        "",
        "| network | znni vox/s | znni peak GiB | GEMM frac | PyTorch dense vox/s (input edge) | dense peak GiB "
        "| naive vox/s (input edge, offsets timed) | naive peak GiB | znni / dense (target) | znni / naive (target 50) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in res["networks"]:
        r = n["main"]
        z, d, nv = r.get("znni"), r.get("dense"), r.get("naive")
        tgt = TARGETS_DENSE.get(n["network"]) if w == 24 else None

        def ratio(key, target):
            v = r.get(key)
            if v is None:
                return "-"
            s = f"{v:.2f}x"
            if target:
                s += f" ({target:g}x {'met' if v >= target else 'MISSED'})"
            return s

        naive_off = "-"
        if nv:
            runs = nv["offsets_run"]
            naive_off = (
                f"{_k(nv['voxels_per_s'])} ({nv['input_edge']}, {min(runs)}-{max(runs)} of {nv['offsets_total']}"
                f"{', extrapolated' if nv['extrapolated'] else ''})"
            )
        L.append(
            f"| {n['network']} | {_k(z and z['voxels_per_s'])} | {_g(z and z['peak_bytes'])} | "
            f"{(z['gemm_fraction'] if z else float('nan')):.3f} | "
            f"{_k(d and d['voxels_per_s'])} ({d['input_edge'] if d else '-'}) | {_g(d and d['peak_bytes'])} | "
            f"{naive_off} | {_g(nv and nv['peak_bytes'])} | {ratio('ratio_vs_dense', tgt)} | "
            f"{ratio('ratio_vs_naive', TARGET_NAIVE if w == 24 else None)} |"
        )
    L += [
        "",
        "GEMM fraction of the baselines: "
        + "; ".join(
            f"{n['network']} dense {n['main']['dense']['gemm_fraction']:.3f}, naive {n['main']['naive']['gemm_fraction']:.4f}"
            for n in res["networks"]
            if "dense" in n["main"] and "naive" in n["main"]
        ),
        "",
    ]

    # plans
    L += ["### Plans chosen", ""]
    for n in res["networks"]:
        r = n["main"]
        if "znni_plan" in r:
            p = r["znni_plan"]
            if p.get("capped"):
                c = p["capped"]
                L += [
                    f"**{n['network']}** (time-capped: the uncapped plan's patch {tuple(c['uncapped_patch'])} "
                    f"predicts {c['uncapped_predicted_seconds']:.0f} s per patch, "
                    f"{_k(c['uncapped_predicted_voxels_per_s'])} vox/s; the benchmark used the autotuner's best "
                    f"patch under {c['max_patch_seconds']:g} s predicted)",
                    "",
                ]
            L += [
                f"**{n['network']}**: {_plan_short(p)}; predicted {_k(p['predicted_voxels_per_s'])} vox/s, "
                f"{_g(p['predicted_peak_bytes'])} GiB; planned in {p['plan_seconds']:.1f} s; "
                f"first (cold) run {r.get('znni_cold_s', float('nan')):.2f} s.",
                "",
                "<details><summary>plan.describe()</summary>",
                "",
                "```",
                p["describe"],
                "```",
                "</details>",
                "",
            ]
        else:
            L += [f"**{n['network']}**: no znni plan - {r.get('znni_error', '?')}", ""]

    # verification
    L += [
        "### Correctness (checked before timing)",
        "",
        "| network | input | znni vs PyTorch dense, max rel err | naive vs dense (offsets) | ok |",
        "|---|---|---|---|---|",
    ]
    for n in res["networks"]:
        v = n["main"].get("verify", {})
        ze = v.get("znni_vs_dense_max_rel_err")
        L.append(
            f"| {n['network']} | {tuple(v.get('input_shape', []))} | "
            f"{'%.2e' % ze if ze is not None else v.get('znni_error', '-')} | "
            f"{v.get('naive_vs_dense_max_rel_err', float('nan')):.2e} ({v.get('naive_offsets_checked')}) | "
            f"{'yes' if v.get('ok') else 'NO'} |"
        )
    L.append("")

    # dense size search
    L += ["### PyTorch dense: input edges tried under the budget", ""]
    for n in res["networks"]:
        tr = n["main"].get("dense_trials", {})
        cells = [
            f"{e}: {_k(t.get('voxels_per_s'))} vox/s, {_g(t.get('peak_bytes'))} GiB"
            if "seconds" in t
            else f"{e}: {t.get('error')}"
            for e, t in tr.items()
        ]
        L.append(
            f"* {n['network']}: "
            + ("; ".join(cells) if cells else "nothing fits the budget")
            + f" -> chosen {n['main'].get('dense_edge')}"
        )
    L.append("")

    # sweep
    L += [
        "### Budget sweep",
        "",
        "One timed run per method and budget, except the main budget (its rounds, as above). "
        "Same harness: znni autotuned at each budget, PyTorch dense at its largest fitting edge, naive "
        "extrapolated from the offsets timed.",
    ]
    if cfg.get("extra", {}).get("sweep_command"):
        L += ["", f"Sweep command: `{cfg['extra']['sweep_command']}`"]
    L.append("")
    if png:
        L += [f"![throughput vs memory, width {w}]({png})", ""]
    L += [
        "| network | budget GiB | znni vox/s (patch) | dense vox/s (edge) | naive vox/s (edge) | znni/dense | znni/naive |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in res["networks"]:
        for r in sorted(n["sweep"], key=lambda r: r["budget"]):
            z, d, nv = r.get("znni"), r.get("dense"), r.get("naive")
            pz = tuple(r["znni_plan"]["patch_shape"]) if "znni_plan" in r else "-"
            if z and not r.get("znni_warmed_up"):
                pz = f"{pz}, cold"
            L.append(
                f"| {n['network']} | {r['budget'] / GIB:g} | {_k(z and z['voxels_per_s'])} ({pz}) | "
                f"{_k(d and d['voxels_per_s']) if d else 'does not fit'} ({d['input_edge'] if d else '-'}) | "
                f"{_k(nv and nv['voxels_per_s'])} ({nv['input_edge'] if nv else '-'}) | "
                f"{'%.2fx' % r['ratio_vs_dense'] if 'ratio_vs_dense' in r else '-'} | "
                f"{'%.1fx' % r['ratio_vs_naive'] if 'ratio_vs_naive' in r else '-'} |"
            )
    L += ["", "Sweep points marked *cold* timed znni's first run (no warm-up: its plan predicted a long run).", ""]

    # profiles
    L += ["### Where the time goes (per-layer times of round 0 at the main budget)", ""]
    for n in res["networks"]:
        r = n["main"]
        if "znni_profile" in r:
            L += [
                f"**{n['network']} znni** (conv steps timed by wrapping the executor's conv call; "
                "predicted = the plan's time model)",
                "",
                "| layer | op | primitive | in (N,C,z,y,x) | measured s | predicted s |",
                "|---|---|---|---|---|---|",
            ]
            for row in r["znni_profile"]:
                L.append(
                    f"| {row['layer']} | {row['op']} | {row['primitive']} | {tuple(row['in']) if row['in'] else ''} | "
                    f"{row['measured_s']:.3f} | {row['predicted_s']:.3f} |"
                )
            L.append("")
        if "dense_profile" in r:
            tot = sum(x["seconds"] for x in r["dense_profile"])
            L += [
                f"**{n['network']} PyTorch dense** (input edge {r.get('dense_edge')}, total {tot:.2f} s)",
                "",
                "| op | input (C,z,y,x) | seconds | share |",
                "|---|---|---|---|",
            ]
            for row in r["dense_profile"]:
                L.append(f"| {row['op']} | {tuple(row['in'])} | {row['seconds']:.3f} | {row['seconds'] / tot:.0%} |")
            L.append("")
    return L


def write_report(out_dir: Path, command_by_width: dict | None = None) -> Path:
    out_dir = Path(out_dir)
    files = sorted(out_dir.glob("results_w*.json"), key=lambda p: int(p.stem.split("_w")[1]))
    results = [json.loads(p.read_text()) for p in files]
    L = [
        "# znni vs PyTorch CPU: dense sliding-window inference on the ZNNi networks",
        "",
        "Generated by `python -m benchmarks` (see `benchmarks/report.py`) from "
        + ", ".join(f"`{p.name}`" for p in files)
        + "; hand-written notes at the end (`benchmarks/NOTES.md`).",
        "",
        "Networks: ZNNi Table III (Zlateski, Lee, Seung, *ZNNi: Maximizing the Inference Throughput of 3D "
        "Convolutional Networks on CPUs and GPUs*, SC16, arXiv:1606.05688), architectures taken from the "
        "authors' network files `networks/337.znni`, `357.znni`, `276.znni`, `296.znni` in "
        "github.com/seung-lab/ZNNi (see `benchmarks/nets.py`); random He-scaled weights, seed 0; "
        "ReLU after every conv except the last; 1 input, 3 output maps.",
        "",
    ]
    L += ["| network | layers | field of view | D | direct MFLOP / output voxel (width 24) |", "|---|---|---|---|---|"]
    from .nets import ARCH, direct_flops_per_voxel, make_network

    for name, (k, p, c) in ARCH.items():
        net = make_network(name, 24)
        L.append(
            f"| {name} | {c} x conv {k}^3, 2^3 max-pool after the first {p} | {net.field_of_view[0]} | "
            f"{net.pooling_product[0]} | {direct_flops_per_voxel(net) / 1e6:.2f} |"
        )
    L.append("")
    if results:
        cmd = results[0]["config"].get("extra", {}).get("command", "python -m benchmarks")
        L += machine_section(results[0]["machine"], results[0]["config"], cmd)
    for res in results:
        w = res["config"]["width"]
        png = f"sweep_w{w}.png" if (out_dir / f"sweep_w{w}.png").exists() else None
        if res["config"].get("extra", {}).get("command"):
            L += [
                f"Width {w} command: `{res['config']['extra']['command']}`, machine load at start "
                f"{res['machine']['loadavg_at_start']}, at end {res['machine'].get('loadavg_at_end')}.",
                "",
            ]
        L += width_section(res, png)
    notes = out_dir / "NOTES.md"
    if notes.exists():
        L += ["---", "", notes.read_text()]
    path = out_dir / "RESULTS.md"
    path.write_text("\n".join(L) + "\n")
    return path
