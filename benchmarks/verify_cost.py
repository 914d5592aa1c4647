"""``python -m benchmarks.verify_cost``: what a task's own check and ``znni verify`` cost.

The boundary-detector class of network on real ISBI 2012 EM (the demo's synthetic EM when
``../shared/data`` is absent), written as a precomputed layer, its tasks run in this process
(``run_task``, after one warm-up task) with ``verify_voxels`` at ``auto`` (at most 2% of a
task's predicted time) and at a fixed count; per setting: the median task's compute seconds, its
check's seconds and voxels, and the check's share. Then ``znni verify`` on the finished run
(8 tasks, 64 voxels each plus corners) against the run's summed task time.

    python -m benchmarks.verify_cost --shape 15,320,320 --fixed 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _run(root: Path, vol, setting) -> dict:
    import yaml

    from znni_core.io import create_layer, parse_layer_url, read_manifest
    from znni_core.pipeline.resolve import resolve
    from znni_core.pipeline.run import load_run, output_specs, run_geometry, save_run
    from znni_core.pipeline.task import manifest_path, run_task

    from .workflow import write_case

    cfg = yaml.safe_load(write_case(root, vol).read_text())
    cfg["verify_voxels"] = setting
    run, plan = resolve(cfg, mem_mb=2000, threads=2, progress=lambda *a: None)
    rf = save_run(run, plan, Path(run.work_dir))
    create_layer(parse_layer_url(run.output.url), output_specs(run), {"processing": []})
    run = load_run(rf)
    ids = [b.id for b in run_geometry(run)[3]]
    run_task(rf, ids[0], show_progress=False, log=lambda *a: None)  # warm-up: kernels, spectra
    rows = []
    for tid in ids:
        run_task(rf, tid, show_progress=False, log=lambda *a: None)
        m = read_manifest(manifest_path(run, tid))
        rec = m.get("recomputed") or {}
        rows.append((m["timings"]["compute_s"], rec.get("seconds", 0.0), rec.get("voxels", 0), m["voxels"]))
    return {"run_file": str(rf), "rows": rows}


def main(argv=None) -> None:
    """Run the measurement (see the module's doc) and print a table."""
    from benchmarks.machine import host_class, host_line

    from .workflow import volume

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="15,320,320", help="Z,Y,X of the volume")
    ap.add_argument("--fixed", type=int, default=16, help="the fixed verify_voxels setting compared with auto")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "znni-bench-verify")
    a = ap.parse_args(argv)
    vol, source = volume(tuple(int(v) for v in a.shape.split(",")))
    a.out.mkdir(parents=True, exist_ok=True)
    print(host_line(host_class()))
    print(f"volume {vol.shape} ({source}), boundary net, 2 threads")
    print("| verify_voxels | tasks | task compute (median s) | check (median s) | voxels checked per task | share |")
    print("|---|---|---|---|---|---|")
    result, last = {"volume": list(vol.shape), "source": source, "settings": {}}, None
    for setting in ("auto", a.fixed):
        r = _run(Path(tempfile.mkdtemp(prefix="znni-verify-")), vol, setting)
        comp = statistics.median(c for c, _, _, _ in r["rows"])
        check = statistics.median(s for _, s, _, _ in r["rows"])
        vox = statistics.median(v for _, _, v, _ in r["rows"])
        share = sum(s for _, s, _, _ in r["rows"]) / sum(c for c, _, _, _ in r["rows"])
        print(f"| {setting} | {len(r['rows'])} | {comp:.3f} | {check:.4f} | {vox:.0f} | {share:.2%} |")
        result["settings"][str(setting)] = {"rows": r["rows"], "share": share}
        last = r
    from znni_core.pipeline.verify import verify_run

    t0 = time.perf_counter()
    rec = verify_run(last["run_file"], log=lambda *a: None)
    dt = time.perf_counter() - t0
    total = sum(c for c, _, _, _ in last["rows"])
    print(
        f"znni verify: {dt:.2f} s ({rec['recomputed']['voxels']} voxels recomputed, every stored object read back) "
        f"against {total:.2f} s of task compute: {dt / total:.1f}x"
    )
    result["verify"] = {"seconds": dt, "voxels": rec["recomputed"]["voxels"], "task_compute_s": total}
    (a.out / "verify_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
