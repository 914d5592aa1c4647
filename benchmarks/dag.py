"""How fast Snakemake plans a petavoxel run: `snakemake -n` and a resume with every job done.

    python -m benchmarks.dag                      # 25,000 x 200,000 x 200,000 uint8 (10^15 voxels)
    python -m benchmarks.dag --shape 2500,20000,20000 --max-jobs 50000

Only an ``info`` file describes the input (no chunk exists: a dry run reads none). The network is the
demo's; the output is float32 in 16x64x64 chunks, sharded (``output.sharding: auto``), so a task
is one shard (``output.shard_bytes: auto``: sized to fit the shipped 2000 MB job) and a job runs
``tasks_per_job`` of them (``jobs.max_jobs`` bounds the DAG).
Prints wall time and peak memory (the child's max RSS) of each phase, the schedule, and the job
count Snakemake reports.  The target: < 60 s and < 2 GB for both on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_case(root: Path, shape, max_jobs: int, per_job) -> Path:
    import yaml

    from znni_core.geometry import Coordinate, Roi
    from znni_core.io import ScaleSpec, create_layer, parse_layer_url
    from znni_core.net import save_network
    from znni_core.pipeline.demo import DEMO_RESOLUTION, demo_network

    spec = ScaleSpec(
        "_".join(f"{v:g}" for v in DEMO_RESOLUTION[::-1]),
        Roi((0, 0, 0), shape),
        Coordinate(64, 128, 128),
        DEMO_RESOLUTION,
        "uint8",
        1,
    )
    create_layer(
        parse_layer_url(f"file://{root}/em"),
        spec,
        {"description": "petavoxel dry-run benchmark: info only", "owners": [], "processing": [], "sources": []},
    )
    save_network(demo_network(), root / "net.yaml")
    cfg = {
        "work_dir": str(root / "work"),
        "input": {"path": f"file://{root}/em", "dtype": "uint8"},
        "network": {"path": str(root / "net.yaml")},
        "normalize": {"scale": 1 / 255},
        "output": {"path": f"file://{root}/out", "chunk_size": [16, 64, 64]},
        "jobs": {"max_jobs": max_jobs, "tasks_per_job": per_job},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def timed(cmd, cwd) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall s, peak RSS GiB of the child, result)."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB (max over children)
    return wall, rss, p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="25000,200000,200000", help="input z,y,x voxels")
    ap.add_argument("--max-jobs", type=int, default=10000)
    ap.add_argument("--tasks-per-job", default="auto")
    a = ap.parse_args(argv)
    shape = tuple(int(v) for v in a.shape.split(","))
    per = a.tasks_per_job if a.tasks_per_job == "auto" else int(a.tasks_per_job)
    with tempfile.TemporaryDirectory(prefix="znni-dag-") as tmp:
        root = Path(tmp)
        cfg = write_case(root, shape, a.max_jobs, per)
        snake = [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "workflow" / "Snakefile"),
            "--configfile",
            str(cfg),
            "--cores",
            "2",
            "--quiet",
            "rules",
        ]
        wall, rss, p = timed(snake + ["-n"], root)
        if p.returncode:
            sys.exit(f"snakemake -n failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        sched = json.loads((root / "work" / "schedule.json").read_text())
        counts = dict(re.findall(r"^(\w+)\s+(\d+)$", p.stdout + p.stderr, flags=re.M))
        print(
            f"input {shape} = {sum([0]) + shape[0] * shape[1] * shape[2]:.3e} voxels; {sched['num_chunks']:,} "
            f"chunks; {sched['num_tasks']:,} tasks (shards) in {sched['num_jobs']:,} jobs of "
            f"{sched['tasks_per_job']} ({sched['why']})"
        )
        print(f"dry run (parse + schedule + DAG): {wall:.1f} s, peak RSS {rss:.2f} GiB; jobs by rule: {counts}")
        # a resume with every job done: the markers exist, the DAG has nothing to run
        work = root / "work"
        for name in ("run.json", "plan.json", "layer.json"):
            (work / name).write_text("{}")
        (work / "jobs").mkdir()
        for j in range(sched["num_jobs"]):
            (work / "jobs" / f"{j:06d}.json").write_text("{}")
        (work / "report").mkdir()
        for name in ("summary.json", "report.html", "preview.png"):
            (work / "report" / name).write_text("{}")
        wall2, rss2, p = timed(snake + ["-n"], root)
        if p.returncode:
            sys.exit(f"resume dry run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        print(
            f"resume, every job done: {wall2:.1f} s, peak RSS {rss2:.2f} GiB "
            f"({'nothing to do' if 'Nothing to be done' in p.stdout + p.stderr else 'jobs to run!'})"
        )


if __name__ == "__main__":
    main()
