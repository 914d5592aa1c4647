"""What a run fetches from its input: read amplification predicted at a petavoxel, measured on a real run.

    python -m benchmarks.reads                      # both parts
    python -m benchmarks.reads --skip-run           # the petavoxel predictions only (seconds)

Part 1 (predicted): a 25,000 x 200,000 x 200,000 uint8 input (10^15 voxels; only an ``info``
file, nothing is read) under the shipped ``config.yaml`` (output chunks 8 x 64 x 64, sharded, a
task one shard) and the demo network, for several input chunkings: the input bytes the run's
tasks fetch over the region's unique input, each task alone (``jobs.cache_gb: 0``, znni before
job caches) and with the shipped ``jobs.cache_gb`` (a job's tasks, a box of them, fetch each
chunk they share once).  ``--rate`` is one job's output voxels/s (it sizes the jobs; the demo
network ran 4 x 10^7 on one Zen 4 core).

Part 2 (measured): the workflow (``snakemake --profile profiles/local``) on a real EM-like volume
in small tasks, once with ``jobs.cache_gb: 0`` and once with the default: the chunk reads the
tasks' manifests record (what the input reader fetched) against the prediction the first job
recorded, and the two outputs byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PETAVOXEL = (25000, 200000, 200000)


def shipped_config(root: Path, inp: str, **over) -> Path:
    """The shipped config.yaml with the paths of ``root`` and the overrides ``over`` (by section)."""
    cfg = yaml.safe_load((REPO / "config.yaml").read_text())
    cfg["work_dir"] = str(root / "work")
    cfg["input"]["path"] = inp
    cfg["network"]["path"] = str(root / "net.yaml")
    cfg["output"]["path"] = f"file://{root}/out"
    for key, value in over.items():
        if isinstance(value, dict):
            cfg[key] = {**(cfg.get(key) or {}), **value}
        else:
            cfg[key] = value
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def predicted(input_chunk, rate: float, cache_gb) -> dict:
    """The schedule of the shipped config on the petavoxel with ``input_chunk`` chunks."""
    from znni_core.geometry import Coordinate, Roi
    from znni_core.io import ScaleSpec, create_layer, parse_layer_url
    from znni_core.net import save_network
    from znni_core.pipeline.demo import DEMO_RESOLUTION, demo_network
    from znni_core.pipeline.schedule import compute_schedule

    with tempfile.TemporaryDirectory(prefix="znni-reads-") as tmp:
        root = Path(tmp)
        key = "_".join(f"{v:g}" for v in DEMO_RESOLUTION[::-1])
        spec = ScaleSpec(key, Roi((0, 0, 0), PETAVOXEL), Coordinate(input_chunk), DEMO_RESOLUTION, "uint8", 1)
        prov = {"description": "read amplification benchmark: info only", "owners": [], "processing": [], "sources": []}
        create_layer(parse_layer_url(f"file://{root}/em"), spec, prov)
        save_network(demo_network(), root / "net.yaml")
        cfg = yaml.safe_load(shipped_config(root, f"file://{root}/em").read_text())
        cfg["jobs"]["cache_gb"] = cache_gb
        t0 = time.perf_counter()
        s = compute_schedule(cfg, rate=rate)
        s["seconds"] = time.perf_counter() - t0
        return s


def measured(root: Path, cache_gb, shape, input_chunk, rate: float) -> dict:
    """The workflow on a ``shape`` EM-like volume: the report's reads and the output's files."""
    from znni_core.pipeline.demo import write_demo

    root.mkdir(parents=True)
    write_demo(root, shape=shape, chunk=input_chunk)
    cfg = shipped_config(
        root,
        f"file://{root}/em",
        output={"chunk_size": [8, 32, 32], "sharding": "none"},
        task_chunks=[1, 2, 2],
        jobs={"cache_gb": cache_gb, "voxels_per_second": rate},
    )
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "workflow" / "Snakefile"), "--configfile", str(cfg)]
    cmd += ["--profile", str(REPO / "profiles" / "local"), "--cores", "2", "--quiet", "rules"]
    t0 = time.perf_counter()
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"snakemake failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    report = json.loads((root / "work" / "report" / "report.json").read_text())
    sched = json.loads((root / "work" / "schedule.json").read_text())
    out = root / "out"
    files = {
        str(f.relative_to(out)): f.read_bytes() for f in out.rglob("*") if f.is_file() and "provenance" not in f.name
    }
    return {"reads": report["cost"]["reads"], "schedule": sched, "files": files, "wall": wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4e7, help="output voxels/s of one job (sizes the jobs)")
    ap.add_argument("--skip-run", action="store_true", help="only the petavoxel predictions")
    ap.add_argument("--shape", default="48,512,512", help="z,y,x of the measured run's volume")
    ap.add_argument("--run-rate", type=float, default=2e4, help="the measured run's jobs.voxels_per_second")
    a = ap.parse_args(argv)
    shipped = yaml.safe_load((REPO / "config.yaml").read_text())["jobs"]["cache_gb"]
    print(f"petavoxel {PETAVOXEL} uint8, shipped config.yaml, demo network, {a.rate:.3g} output voxels/s per job")
    print(
        "| input chunk | tasks | jobs (each task alone) | amplification | jobs (cache) | a job | amplification | schedule s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for chunk in ((16, 128, 128), (64, 64, 64), (64, 128, 128), (128, 128, 128)):
        alone, cached = predicted(chunk, a.rate, 0), predicted(chunk, a.rate, shipped)
        box = (
            "x".join(map(str, cached["brick"])) + " tasks" if cached["brick"] else f"{cached['tasks_per_job']} in a row"
        )
        print(
            f"| {'x'.join(map(str, chunk))} | {alone['num_tasks']:,} | {alone['num_jobs']:,} | "
            f"{alone['input_reads']['amplification']:.2f}x | {cached['num_jobs']:,} | {box} | "
            f"{cached['input_reads']['amplification']:.2f}x | {cached['seconds']:.1f} |"
        )
    if a.skip_run:
        return
    shape = tuple(int(v) for v in a.shape.split(","))
    with tempfile.TemporaryDirectory(prefix="znni-reads-run-") as tmp:
        runs = {gb: measured(Path(tmp) / f"cache{gb}", gb, shape, (16, 64, 64), a.run_rate) for gb in (0, shipped)}
    print(
        f"\nmeasured: the workflow on {shape} EM-like uint8 in 16x64x64 chunks, output chunks 8x32x32, tasks of 1x2x2 chunks"
    )
    print(
        "| jobs.cache_gb | tasks | jobs | a job | chunk reads (measured / predicted) | amplification (measured / predicted) | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for gb, r in runs.items():
        s, reads = r["schedule"], r["reads"]
        box = "x".join(map(str, s["brick"])) + " tasks" if s["brick"] else f"{s['tasks_per_job']} in a row"
        print(
            f"| {gb} | {s['num_tasks']} | {s['num_jobs']} | {box} | {reads['chunk_reads']:,} / "
            f"{reads['predicted_chunk_reads']:,} | {reads['amplification']:.3f}x / {reads['predicted_amplification']:.3f}x | "
            f"{r['wall']:.0f} |"
        )
    same = runs[0]["files"] == runs[shipped]["files"]
    print(f"outputs byte-identical with and without the cache: {same} ({len(runs[0]['files'])} files)")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
