"""The run report's figures (static PNGs beside ``report.html``, drawn with matplotlib):

- ``timeline.png``: output voxels done over the run's wall time (every task's finish), each
  job's throughput over time (a job: a SLURM job id, else a host and process; a slow node stands
  out), and the distribution of task times;
- ``tasks.png``: the tasks over the volume seen from above (y, x): done, masked, or all-empty
  input; each cell shows the state of the tasks stacked in z there;
- ``preview_z<Z>.png``: input | output at a quarter, half and three quarters of the region's depth.

Also the verification the tasks did (:func:`verification`) and what the run's empty chunks are
and hold (:func:`empty_chunks`), for the summary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import atomic_write

#: task states in the map, drawn in this order (a later one wins where tasks are stacked in z)
STATES = ("done", "empty", "masked")
COLOURS = {"done": "#2ca02c", "empty": "#c7e9c0", "masked": "#bdbdbd"}


def verification(manifests: dict) -> dict:
    """What the tasks' own checks recomputed (``recomputed`` of each manifest), summed."""
    recs = [m["recomputed"] for m in manifests.values() if m.get("recomputed", {}).get("voxels")]
    if not recs:
        return {"recomputed_voxels": 0}
    return {
        "recomputed_voxels": int(sum(r["voxels"] for r in recs)),
        "recomputed_tasks": len(recs),
        "recomputed_max_deviation": float(max(r["max_deviation"] for r in recs)),
        "recomputed_tolerance": float(min(r["tolerance"] for r in recs)),
    }


#: what an ``empty`` chunk is (``input.empty: skip``), as the report and docs/configuration.md state it
EMPTY_DEFINITION = (
    "its whole input context (the chunk's read ROI with the network's halo, read through the run's edge "
    "policy; a graph network's: every patch that reaches it) is 0 in the raw input; it is not computed "
    "and not stored: it reads as 0"
)


def output_on_zeros(net, shift: float) -> list | None:
    """The network's output (per channel) where the raw input is all 0 (its normalised input is
    ``shift`` everywhere): a chain network's definition on one field of view, when that costs
    under a second; None otherwise (a graph network's output there depends on the position)."""
    from ..net.definition import DEFINITION_FLOPS, flops_per_voxel, plain_forward

    if net.kind != "chain" or flops_per_voxel(net) / DEFINITION_FLOPS > 1.0:
        return None
    x = np.full((1, net.in_channels) + tuple(net.field_of_view), np.float32(shift), np.float32)
    return [float(np.float32(v)) for v in plain_forward(net, x)[0]]


def empty_chunks(setting: str, n_empty: int, value: list | None = None) -> str:
    """The summary's ``empty_chunks``: how many chunks ``input.empty`` (``setting``) skipped, what
    they are and what they hold (``value``: the network's output on an all-zero input, which they
    do not hold).

    >>> text = empty_chunks("skip", 3, [0.5])
    >>> text[:38], "it reads as 0, not [0.5]" in text
    ('3 chunk(s) skipped (input.empty: skip)', True)
    """
    if setting != "skip":
        return f"input.empty: {setting}: every live chunk was computed, none skipped"
    text = f"{n_empty} chunk(s) skipped (input.empty: skip): each is a chunk whose {EMPTY_DEFINITION}"
    if value is not None:
        text += f", not {value}, the network's output (per channel) on an all-zero input"
    return text + " (`znni verify` checks a sample of them)"


def _save(fig, path: Path) -> str:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    atomic_write(path, buf.getvalue())
    return path.name


def timeline(manifests: dict, path: Path) -> str | None:
    """``timeline.png`` (see the module's doc); None without finished tasks."""
    if not manifests:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(manifests.values(), key=lambda m: m["finished"])
    t0 = min(m["finished"] - m["timings"]["total_s"] for m in ms)
    t = np.array([m["finished"] - t0 for m in ms])
    done = np.cumsum([m["voxels"] for m in ms])
    secs = np.array([m["timings"]["total_s"] for m in ms])
    fig, (a, j, b) = plt.subplots(1, 3, figsize=(15, 3.2))
    fig.subplots_adjust(wspace=0.35)
    a.step(np.r_[0, t], np.r_[0, done], where="post")
    a.set_xlabel("wall seconds since the first task started")
    a.set_ylabel("output voxels done")
    a.set_title(f"{done[-1]:,} voxels in {t[-1]:.1f} s ({done[-1] / max(t[-1], 1e-9):,.0f} voxels/s)")
    jobs = job_throughput(ms, t0)
    for name, (tt, vps) in sorted(jobs.items(), key=lambda kv: kv[1][0][0])[:20]:
        j.plot(tt, vps, marker=".", label=name)
    j.set_xlabel("wall seconds since the first task started")
    j.set_ylabel("voxels/s of each task")
    rates = np.concatenate([v for _, v in jobs.values()])
    j.set_title(f"{len(jobs)} job(s): task throughput {np.min(rates):,.0f}-{np.max(rates):,.0f} voxels/s")
    if 1 < len(jobs) <= 8:
        j.legend(fontsize=7)
    b.hist(secs, bins=min(30, max(5, len(secs) // 2)))
    b.set_xlabel("seconds per task (read, compute, write, verify)")
    b.set_ylabel("tasks")
    b.set_title(f"{len(secs)} tasks: median {np.median(secs):.2f} s, max {secs.max():.2f} s")
    name = _save(fig, path)
    plt.close(fig)
    return name


def job_throughput(manifests, t0: float) -> dict:
    """``{job: (finish times since t0, voxels/s of each task)}``: a job is the task's SLURM job id,
    else its host and process (one Snakemake job of a local run).

    >>> m = {"finished": 12.0, "voxels": 100, "timings": {"total_s": 2.0}, "host": "n1", "pid": 7}
    >>> job_throughput([m], 10.0)
    {'n1:7': ([2.0], [50.0])}
    """
    out: dict = {}
    for m in manifests:
        name = str(m.get("slurm_job") or f"{m.get('host', '?')}:{m.get('pid', '?')}")
        tt, vps = out.setdefault(name, ([], []))
        tt.append(round(m["finished"] - t0, 6))
        vps.append(m["voxels"] / max(m["timings"]["total_s"], 1e-9))
    return out


def task_map(tasks, states: dict, path: Path) -> str | None:
    """``tasks.png``: each task's (y, x) box coloured by its state (``states``: task id -> one of
    :data:`STATES`); None without tasks."""
    if not len(tasks):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    blocks = list(tasks)
    lo = np.min([tuple(b.write_roi.begin) for b in blocks], axis=0)
    hi = np.max([tuple(b.write_roi.end) for b in blocks], axis=0)
    fig, ax = plt.subplots(figsize=(5, 5 * (hi[1] - lo[1]) / max(hi[2] - lo[2], 1) + 0.6))
    for state in STATES:
        for b in blocks:
            if states.get(b.id) == state:
                (_, y0, x0), (_, y1, x1) = tuple(b.write_roi.begin), tuple(b.write_roi.end)
                ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=COLOURS[state], edgecolor="white", lw=0.5))
    ax.set_xlim(lo[2], hi[2])
    ax.set_ylim(hi[1], lo[1])
    ax.set_aspect("equal")
    ax.set_xlabel("x (voxels)")
    ax.set_ylabel("y (voxels)")
    counts = {s: sum(1 for v in states.values() if v == s) for s in STATES}
    ax.set_title(f"{len(blocks)} tasks seen from above (z stacked)")
    ax.legend(
        handles=[Patch(color=COLOURS[s], label=f"{s}: {counts[s]}") for s in STATES if counts[s]],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    name = _save(fig, path)
    plt.close(fig)
    return name
