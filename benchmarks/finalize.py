"""``python -m benchmarks.finalize --tasks N``: finalize, verify and status of a finished run of N tasks.

Builds a *finished* run without computing it: a precomputed input with only its ``info`` (read as
zeros: ``input.missing: zero``), the demo network, a sharded uint8 output of small chunks (a task
is one shard of ``--chunks`` chunks), then for every task what a job leaves: its shard, written
and read back through znni's own writer, holding the network's output on zeros (what the run
would have computed: an all-zero input gives one value per channel, so ``znni verify``'s
recomputation agrees with it), and its manifest. No network runs while it builds. Then each of
``znni finalize``, ``znni verify`` and ``znni status`` runs in its own process, and its peak
resident memory (``ru_maxrss``) and wall time are printed as a table, one row per run size::

    python -m benchmarks.finalize --tasks 10000,100000,1000000 --out benchmarks/finalize.md

The runs are built in ``--dir`` (default: a temporary directory, removed after; a run of 10^6
tasks takes about 8 GB there: its shards and manifests). With ``--keep`` they stay in ``--dir``
and a later call measures them again without building them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
#: output chunk (z, y, x) voxels: small, so that building a run of 10^6 tasks is fast
CHUNK = (4, 8, 8)
STEPS = ("finalize", "verify", "status")


def config(root: Path, tasks: int, chunks: int) -> dict:
    """A run config whose region is ``tasks`` shards of ``chunks`` output chunks (about: the grid is
    cut to whole shards of the shape the sharding picks)."""
    import yaml

    cfg = yaml.safe_load((HERE.parent / "config.yaml").read_text())
    total = tasks * chunks
    # the grid in chunks, near a cube in voxels: z chunks are half as deep as y and x are wide
    gz = max(1, round((total / 4) ** (1 / 3)))
    gy = max(1, round(math.sqrt(total / gz)))
    gx = max(1, -(-total // (gz * gy)))
    size_xyz = [gx * CHUNK[2], gy * CHUNK[1], gz * CHUNK[0]]
    (root / "em").mkdir(parents=True, exist_ok=True)
    scale = {"key": "8_8_40", "size": size_xyz, "resolution": [8, 8, 40], "voxel_offset": [0, 0, 0]}
    scale.update({"chunk_sizes": [[64, 64, 16]], "encoding": "raw"})
    info = {"type": "image", "data_type": "uint8", "num_channels": 1, "scales": [scale]}
    (root / "em" / "info").write_text(json.dumps(info))
    cfg["work_dir"] = str(root / "work")
    cfg["input"].update(path=f"file://{root}/em", missing="zero", empty="compute")
    cfg["network"]["path"] = str(root / "net" / "net.yaml")
    cfg["output"].update(
        path=f"file://{root}/out",
        dtype="uint8",
        chunk_size=list(CHUNK),
        sharding="sharded",
        shard_bytes=int(np.prod(CHUNK)) * chunks,
    )
    cfg["edge"] = "zero"
    cfg["verify_voxels"] = 0
    cfg["jobs"]["tasks_per_job"] = max(1, tasks // 1000)
    return cfg


def build(root: Path, tasks: int, chunks: int, workers: int = 2, log=print) -> Path:
    """The finished run (module doc) in ``root``; returns its run file."""
    import yaml

    from znni_core.pipeline.demo import write_demo

    write_demo(root / "net", shape=(16, 64, 64), chunk=(8, 32, 32))
    cfg = config(root, tasks, chunks)
    cfg_path = root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    run_file = Path(cfg["work_dir"]) / "run.json"
    for args in (["validate", str(cfg_path)], ["create-layer", str(run_file)]):
        r = subprocess.run([sys.executable, "-c", _CLI, *args], capture_output=True, text=True, cwd=HERE.parent)
        if r.returncode:
            raise SystemExit(f"znni {args[0]} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    n = json.loads(run_file.read_text())["num_tasks"]
    log(f"run of {n:,} tasks validated in {time.perf_counter() - t0:.1f} s; writing shards and manifests")
    t0 = time.perf_counter()
    parts = [(str(run_file), k * n // workers, (k + 1) * n // workers) for k in range(workers)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "benchmarks.finalize", "--write", json.dumps(p)], cwd=HERE.parent)
        for p in parts
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("writing the tasks failed")
    log(f"{n:,} tasks written in {time.perf_counter() - t0:.1f} s")
    return run_file


def write_tasks(run_file: str, lo: int, hi: int) -> None:
    """Tasks ``[lo, hi)`` of the run as a job leaves them: shard and manifest (no network runs:
    the output is the network's value on zeros, computed once)."""
    from znni_core.io import atomic_write, store_chunks
    from znni_core.io.manifest import MANIFEST_FORMAT
    from znni_core.pipeline.report import output_on_zeros
    from znni_core.pipeline.task import manifest_path, open_run, quantise

    os.fsync = lambda fd: None  # a fixture, not a run: durability is not what is measured
    ctx = open_run(run_file)
    run, out, grid = ctx.run, ctx.out, ctx.grid
    cfg = run.config
    value = np.asarray(output_on_zeros(ctx.net, cfg.normalize.shift), np.float32)
    versions = run.versions | {"python": platform.python_version()}
    host, pid = socket.gethostname(), os.getpid()
    encoded_by_shape: dict = {}
    for k in range(lo, hi):
        block = ctx.tasks[k]
        if manifest_path(run, block.id).is_file():  # written before this build was interrupted
            continue
        t0 = time.time()
        encoded = {}
        for idx in block.chunks:
            shape = tuple(grid.chunk_roi(idx).shape)
            if shape not in encoded_by_shape:
                y = np.broadcast_to(value.reshape(-1, 1, 1, 1), (len(value),) + shape)
                encoded_by_shape[shape] = quantise(np.ascontiguousarray(y), out.dtype, "synthetic", cfg.output.scale)
            encoded[idx] = encoded_by_shape[shape]
        entries, shard = store_chunks(out, block.chunks, encoded, {}, cfg.output.compression)
        voxels = int(np.prod(tuple(block.write_roi.shape)))
        finished = time.time()
        # compact JSON (a job's manifest is indented; readers parse either): a third of the build
        atomic_write(
            manifest_path(run, block.id),
            json.dumps(
                {
                    "task": block.id,
                    "run_digest": run.digest,
                    "layer": str(ctx.out_url),
                    "write_roi": block.write_roi.to_dict(),
                    "read_roi": block.read_roi.to_dict(),
                    "chunks": [entries[i] for i in block.chunks],
                    "shard": shard,
                    "plan_digest": run.plan.digest,
                    "network_digest": run.network.digest,
                    "missing_input_filled": [],
                    "input_versions": {},
                    "input_read": {"chunks": 1, "voxels": int(np.prod(tuple(block.read_roi.shape)))},
                    "versions": versions,
                    "device": "cpu",
                    "host": host,
                    "pid": pid,
                    "voxels": voxels,
                    "timings": {"read_s": 0.0, "compute_s": 0.0, "write_s": 0.0, "total_s": round(finished - t0, 6)},
                    "finished": finished,
                    "format": MANIFEST_FORMAT,
                }
            ).encode(),
        )


#: ``python -c _CLI ARGS...``: the ``znni`` command line, then its wall seconds and peak resident memory
_CLI = (
    "import resource, sys, time\n"
    "from znni_core.cli import main\n"
    "sys.argv[0] = 'znni'\n"
    "t = time.perf_counter()\n"
    "try:\n"
    "    main()\n"
    "except SystemExit as e:\n"
    "    rc = e.code or 0\n"
    "else:\n"
    "    rc = 0\n"
    "dt = time.perf_counter() - t\n"
    "print('@@', rc, dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)\n"
    "sys.exit(rc)\n"
)


def measure(step: str, run_file: Path) -> dict:
    """One znni command in its own process: its wall seconds and peak resident memory."""
    r = subprocess.run(
        [sys.executable, "-c", _CLI, step, str(run_file)],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        env=os.environ | {"ZNNI_PROGRESS": "0"},
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("@@")]
    if r.returncode or not line:
        raise SystemExit(f"znni {step} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    rc, dt, rss = line[-1].split()[1:]
    return {"rc": int(rc), "seconds": float(dt), "peak_bytes": int(rss), "tail": r.stdout.strip().splitlines()[-3:-1]}


def render(rows: list, command: str) -> str:
    from .machine import host_class

    lines = [
        "# finalize, verify and status of a finished run",
        "",
        "Host: "
        + ", ".join(f"{k} {v}" for k, v in host_class().items())
        + f". Command: `{command}`. Each step is its own process: wall seconds and "
        "peak resident memory (`ru_maxrss`, the interpreter and libraries included).",
        "",
        "| tasks | chunks (16 a task; fewer at the edges) | " + " | ".join(f"{s} s | {s} MiB" for s in STEPS) + " |",
        "|---|---|" + "---|---|" * len(STEPS),
    ]
    for r in rows:
        cells = [f"{r[s]['seconds']:.1f} | {r[s]['peak_bytes'] / 2**20:.0f}" if s in r else "- | -" for s in STEPS]
        lines.append(f"| {r['tasks']:,} | {r['chunks']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tasks", default="10000", help="comma-separated run sizes, e.g. 10000,100000,1000000")
    ap.add_argument("--chunks", type=int, default=16, help="output chunks per task (one shard)")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--dir", type=Path, default=None, help="where the runs are built (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="leave the runs built")
    ap.add_argument("--out", type=Path, default=None, help="write the table (markdown) here too")
    ap.add_argument("--write", default=None, help=argparse.SUPPRESS)  # a worker: (run file, lo, hi)
    a = ap.parse_args(argv)
    if a.write:
        write_tasks(*json.loads(a.write))
        return
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    base = a.dir if a.keep and a.dir else Path(tempfile.mkdtemp(prefix="znni-finalize-", dir=a.dir))
    rows = []
    try:
        for n in (int(v) for v in a.tasks.split(",")):
            root = base / f"run-{n}-{a.chunks}"
            if (root / "built").is_file():  # kept from before (--keep): measured again
                run_file = root / "work" / "run.json"
            else:
                shutil.rmtree(root, ignore_errors=True)
                run_file = build(root, n, a.chunks)
                (root / "built").write_text("")
            doc = json.loads(run_file.read_text())
            row = {"tasks": doc["num_tasks"], "chunks": doc["num_tasks"] * a.chunks}
            for s in steps:
                row[s] = measure(s, run_file)
                print(
                    f"{row['tasks']:,} tasks: {s} {row[s]['seconds']:.1f} s, {row[s]['peak_bytes'] / 2**20:.0f} MiB",
                    flush=True,
                )
            rows.append(row)
            if not a.keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    command = "python -m benchmarks.finalize " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(rows, command)
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
