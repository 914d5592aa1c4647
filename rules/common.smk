# Shared definitions: work directory, the config as JSON for the CLI, input functions (get_*),
# and the end-of-run summary.
import json
import os
import sys
import time
from pathlib import Path

WORK = str(Path(config["work_dir"]))
CONFIG_JSON = json.dumps(config, sort_keys=True)
STARTED = time.time()

# numba's default threading layer kills the process when called from threads (PITFALLS);
# compiled kernels are cached in the work directory so every job after the first starts warm.
shell.prefix(
    "set -euo pipefail; "
    "export NUMBA_THREADING_LAYER=${{NUMBA_THREADING_LAYER:-threadsafe}}; "
    f"export NUMBA_CACHE_DIR=${{{{NUMBA_CACHE_DIR:-{os.path.abspath(WORK)}/.cache/numba}}}}; "
)

wildcard_constraints:
    task=r"\d{6}",


def get_manifests(wildcards):
    """Every task's manifest, once the task list (checkpoint) exists."""
    tasks_file = checkpoints.tasks.get().output[0]
    with open(tasks_file) as f:
        ids = [t["id"] for t in json.load(f)["tasks"]]
    return [f"{WORK}/manifests/{i:06d}.json" for i in ids]


def print_summary(ok):
    """End-of-run summary: tasks done now / already done (skipped) / failed, voxels per second."""
    tasks_file = Path(WORK) / "tasks.json"
    if not tasks_file.is_file():
        return
    ids = [t["id"] for t in json.loads(tasks_file.read_text())["tasks"]]
    done_now, skipped, failed, voxels, seconds = 0, 0, [], 0, 0.0
    for i in ids:
        p = Path(WORK) / "manifests" / f"{i:06d}.json"
        if not p.is_file():
            failed.append(i)
            continue
        try:
            m = json.loads(p.read_text())
        except (OSError, ValueError):
            failed.append(i)
            continue
        if p.stat().st_mtime >= STARTED:
            done_now += 1
            voxels += m.get("voxels", 0)
            seconds += m.get("timings", {}).get("total_s", 0.0)
        else:
            skipped += 1
    wall = time.time() - STARTED
    print(f"\nznni summary: {len(ids)} tasks: {done_now} done now, {skipped} skipped (already done), "
          f"{len(failed)} not done" + (f" {failed[:20]}" if failed else ""), file=sys.stderr)
    if done_now:
        print(f"  {voxels:,} voxels in {wall:.1f} s wall ({voxels / wall:,.0f} voxels/s), "
              f"{voxels / max(seconds, 1e-9):,.0f} voxels/s per job", file=sys.stderr)
    report_html = Path(WORK) / "report" / "report.html"
    if ok and report_html.is_file():
        print(f"  report: {report_html}\n  preview: {report_html.with_name('preview.png')}", file=sys.stderr)
    if not ok:
        print(f"  re-run the same command to retry only the unfinished tasks; logs: {WORK}/logs/tasks/", file=sys.stderr)
