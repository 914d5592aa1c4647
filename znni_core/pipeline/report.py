"""The run report (``<work_dir>/report/report.html`` and ``report.json``), for every run: a
finished one (``znni finalize``), a partial or failed one (``finalize`` refusing it, or ``znni
report``, which the workflow's ``onerror`` runs; :func:`write_report`, from whatever is on disk).
It shows the outcome; what failed, why and where its log is; retries, OOMs and timeouts; the
predicted against the measured node-hours; each job's memory efficiency (max RSS / mem_mb);
previews of every output channel; and the config that ran.  ``summary.json`` is finalize's alone:
written only when every task checked out (Snakemake's ``finalize`` output, the run's done-marker).

Its figures (static PNGs beside ``report.html``, drawn with matplotlib):

- ``timeline.png``: output voxels done over the run's wall time (every task's finish), each
  job's throughput over time (a job: a SLURM job id, else a host and process; a slow node stands
  out), and the distribution of task times;
- ``tasks.png``: the tasks over the volume seen from above (y, x): done, masked, or all-empty
  input; each cell shows the state of the tasks stacked in z there;
- ``preview_z<Z>.png``: input | output at a quarter, half and three quarters of the region's depth.

Also the verification the tasks did (:meth:`.tally.Tally.verification`) and what the run's empty chunks are
and hold (:func:`empty_chunks`), for the summary.
"""

from __future__ import annotations

import html
import io
import json
import re
import time
import urllib.parse
from dataclasses import asdict
from pathlib import Path

import numpy as np
import yaml

from ..errors import ZnniError
from ..geometry import Coordinate, Roi
from ..io import atomic_write, open_input, open_output, parse_layer_url
from ..io.workdir import local_copy, work_path
from ..net.definition import DEFINITION_FLOPS, flops_per_voxel, plain_forward
from .jobs import duration, records_dir
from .run import load_run, location, output_spec, output_specs, plan_path, run_geometry
from .serve import VIEWER_TOKEN
from .settings import load_config
from .status import KINDS, SNAKEMAKE_ERRORS, collect, mem_text, recorded_prediction, run_file_of, snakemake_error_text
from .tally import DONE, EMPTY, FAILED, MASKED, NAMES

#: task states in the map, drawn in this order (a later one wins where tasks are stacked in z)
STATES = ("done", "empty", "masked", "running", "failed")
COLOURS = {"done": "#2ca02c", "empty": "#c7e9c0", "masked": "#bdbdbd", "running": "#1f77b4", "failed": "#d62728"}
REPORT_FORMAT = "znni-report/1"
#: the timeline draws every task up to this many (more: every k-th, the totals exact)
TIMELINE_POINTS = 20_000


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

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    atomic_write(path, buf.getvalue())
    return path.name


def timeline(tally, path: Path) -> str | None:
    """``timeline.png`` (see the module's doc) from a :class:`~.tally.Tally`'s timed tasks; None
    without finished tasks."""
    k = tally.timed()
    if not len(k):
        return None
    # lazy: loads matplotlib only when called
    import matplotlib

    matplotlib.use("Agg")
    # lazy: loads matplotlib only when called
    import matplotlib.pyplot as plt

    k = k[np.argsort(tally.end[k], kind="stable")]
    t0 = float(tally.start[k].min())
    t = tally.end[k] - t0
    done = np.cumsum(tally.voxels[k])
    secs = tally.end[k] - tally.start[k]
    fig, (a, j, b) = plt.subplots(1, 3, figsize=(15, 3.2))
    fig.subplots_adjust(wspace=0.35)
    every = max(1, len(k) // TIMELINE_POINTS)  # every task's point up to TIMELINE_POINTS, then thinned
    a.step(np.r_[0, t[::every], t[-1]], np.r_[0, done[::every], done[-1]], where="post")
    a.set_xlabel("wall seconds since the first task started")
    a.set_ylabel("output voxels done")
    a.set_title(f"{done[-1]:,} voxels in {t[-1]:.1f} s ({done[-1] / max(t[-1], 1e-9):,.0f} voxels/s)")
    rates = tally.voxels[k] / np.maximum(secs, 1e-9)
    jobs = tally.job[k]
    codes = np.unique(jobs)
    firsts = sorted(codes, key=lambda c: t[np.argmax(jobs == c)])
    for c in firsts[:20]:
        sel = np.flatnonzero(jobs == c)[::every]
        j.plot(t[sel], rates[sel], marker=".", label=tally.job_names[c] if c >= 0 else "?")
    j.set_xlabel("wall seconds since the first task started")
    j.set_ylabel("voxels/s of each task")
    j.set_title(f"{len(codes)} job(s): task throughput {np.min(rates):,.0f}-{np.max(rates):,.0f} voxels/s")
    if 1 < len(codes) <= 8:
        j.legend(fontsize=7)
    b.hist(secs, bins=min(30, max(5, len(secs) // 2)))
    b.set_xlabel("seconds per task (read, compute, write, verify)")
    b.set_ylabel("tasks")
    b.set_title(f"{len(secs)} tasks: median {np.median(secs):.2f} s, max {secs.max():.2f} s")
    name = _save(fig, path)
    plt.close(fig)
    return name


#: the task map's most cells per axis: a larger task grid is drawn in blocks of tasks (each block
#: the state that ranks highest in :data:`STATES` among its tasks)
MAP_CELLS = 600


def state_ranks(tally, running=(), failed=(), tasks=None) -> np.ndarray:
    """Per task position, 1 + the index in :data:`STATES` of its state (0: not drawn: not done
    or another run's) from a :class:`~.tally.Tally`; the task ids ``running`` and ``failed`` (of
    ``znni status``) over it, placed through ``tasks``."""
    table = np.zeros(len(NAMES), np.int8)
    for code, name in ((DONE, "done"), (EMPTY, "empty"), (MASKED, "masked"), (FAILED, "failed")):
        table[code] = STATES.index(name) + 1
    ranks = table[tally.state]
    for ids, name in ((running, "running"), (failed, "failed")):
        for t in ids:
            try:
                ranks[tasks.index(t)] = STATES.index(name) + 1
            except (ValueError, AttributeError):
                continue
    return ranks


def task_map(tasks, ranks, path: Path) -> str | None:
    """``tasks.png``: the tasks seen from above (z stacked), each (y, x) cell coloured by the state
    that ranks highest in :data:`STATES` among the tasks over it; ``ranks``: per task position of
    ``tasks`` (a :class:`~.geometry.TaskGrid`), :func:`state_ranks`.  A raster (one image whatever
    the number of tasks; at most :data:`MAP_CELLS` cells per axis); None without tasks."""
    if not len(tasks):
        return None
    # lazy: loads matplotlib only when called
    import matplotlib

    matplotlib.use("Agg")
    # lazy: loads matplotlib only when called
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    ranks = np.asarray(ranks, np.int8)
    grid = ranks.reshape(tuple(tasks.shape)).max(axis=0)  # (ty, tx): the highest rank over z
    step = [max(1, -(-n // MAP_CELLS)) for n in grid.shape]
    if step != [1, 1]:
        g = np.pad(grid, [(0, -n % k) for n, k in zip(grid.shape, step)])
        grid = g.reshape(g.shape[0] // step[0], step[0], g.shape[1] // step[1], step[1]).max(axis=(1, 3))
    (_, y0, x0), (_, y1, x1) = tuple(tasks.region.begin), tuple(tasks.region.end)
    fig, ax = plt.subplots(figsize=(5, 5 * (y1 - y0) / max(x1 - x0, 1) + 0.6))
    cmap = ListedColormap(["#ffffff"] + [COLOURS[s] for s in STATES])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(STATES) + 0.5, extent=(x0, x1, y1, y0), interpolation="nearest")
    ax.set_xlabel("x (voxels)")
    ax.set_ylabel("y (voxels)")
    counts = np.bincount(ranks, minlength=len(STATES) + 1)
    more = f" in blocks of {step[0]} x {step[1]}" if step != [1, 1] else ""
    ax.set_title(f"{len(tasks)} tasks seen from above (z stacked){more}")
    ax.legend(
        handles=[Patch(color=COLOURS[s], label=f"{s}: {counts[r]}") for r, s in enumerate(STATES, 1) if counts[r]],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
    )
    name = _save(fig, path)
    plt.close(fig)
    return name


# ---- the viewer link and the previews ---------------------------------------------------------
def neuroglancer_link(run, base: str, port: int) -> tuple[str, list[str]]:
    """A link showing input and output.  ``base`` ``local``: the Neuroglancer client that
    ``znni serve`` bundles (works offline); else a viewer's URL.  file:// layers are read
    through ``znni serve`` (notes say how)."""
    notes = []
    local = base == "local"
    server = f"http://127.0.0.1:{port}"
    work = run.work_dir

    def source(name: str, url: str, zarr_scheme: str = "zarr") -> str:
        # zarr3:// for znni's own (v3) output: plain zarr:// makes Neuroglancer probe v2 files first (404s)
        zarr = url.startswith("zarr://")
        if url.startswith("file://") or (zarr and "file://" in url):
            origin = "" if local else f" --allow-origin {_origin(base)}"
            notes.append(f"file:// layers: run `znni serve {work} --port {port}{origin}` while viewing")
            return f"{zarr_scheme if zarr else 'precomputed'}://{server}/layers/{name}"
        if local:
            notes.append(f"the viewer: run `znni serve {work} --port {port}` while viewing")
        return f"{zarr_scheme}://{url[len('zarr://') :]}" if zarr else "precomputed://" + url

    region = run.region
    center = [o + s / 2 for o, s in zip(region["offset"], region["shape"])][::-1]  # x, y, z
    res = run.input.resolution[::-1]
    state = {
        "dimensions": {"x": [res[0] * 1e-9, "m"], "y": [res[1] * 1e-9, "m"], "z": [res[2] * 1e-9, "m"]},
        "position": center,
        "layers": [
            {"type": "image", "source": source("input", run.input.url), "name": "input"},
            {
                "type": "image",
                "source": source("output", run.output.url, "zarr3"),
                "name": "znni output",
                "opacity": 0.6,
                "shader": "#uicontrol invlerp normalized\nvoid main() { emitRGB(vec3(normalized(), 0.0, 0.0)); }",
            },
        ],
        "layout": "4panel",
    }
    link = (
        (f"{server}/v/{VIEWER_TOKEN}" if local else base.rstrip("/"))
        + "/#!"
        + urllib.parse.quote(json.dumps(state, separators=(",", ":")), safe="")
    )
    return link, sorted(set(notes))


def _origin(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


#: the most a preview reads per axis (y, x): a window of the region at mip 0, or with a pyramid
#: the lowest mip whose region fits in twice this (the top mip otherwise, cropped)
PREVIEW_SIDE = 512
#: the most output channels a preview draws (one panel each; 3 channels: one RGB panel)
PREVIEW_CHANNELS = 8


def _preview_source(run, out):
    """``(output layer, box to preview in its voxels, input layer at that resolution or None, mip)``:
    a pyramid's mip where one was built (``pyramid.json``), else mip 0."""
    cfg = run.config
    region = Roi.from_dict(run.region)
    inp_url = parse_layer_url(run.input.url, endpoint=cfg.input.endpoint_url)
    if cfg.downsample.mips and (work_path(run) / "pyramid.json").is_file():
        specs = output_specs(run)
        for k in range(1, len(specs)):
            scale = Coordinate(int(v) ** k for v in cfg.downsample.factor)
            box = Roi.from_bounds(region.begin // scale, -((-region.end) // scale)).intersect(specs[k].bounds)
            if max(tuple(box.shape)[1:]) <= 2 * PREVIEW_SIDE or k == len(specs) - 1:
                url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
                return open_output(url, specs[k], k), box, _input_at(inp_url, specs[k].resolution), k
    return out, region, open_input(inp_url, run.input.mip, resolution=cfg.input.resolution), 0


def _input_at(url, resolution):
    """The input's mip at ``resolution`` (z, y, x nm), or None."""
    for j in range(0, 12):
        try:
            layer = open_input(url, j)
        except Exception:  # noqa: BLE001 - no such mip (or not a precomputed pyramid): none
            return None
        if np.allclose(tuple(layer.resolution), tuple(resolution)):
            return layer
    return None


def _window(box, depth: float, side: int):
    """The z slice at ``depth`` (0-1) of ``box``, at most ``side`` voxels in y and x about its centre."""
    off, shape = tuple(box.offset), tuple(box.shape)
    z = off[0] + min(shape[0] - 1, int(shape[0] * depth))
    h, w = min(shape[1], side), min(shape[2], side)
    y, x = off[1] + (shape[1] - h) // 2, off[2] + (shape[2] - w) // 2
    return Roi((z, y, x), (1, h, w))


def _to8(v, lo=None, hi=None):
    lo = float(v.min()) if lo is None else lo
    hi = float(v.max()) if hi is None else hi
    return np.clip((v - lo) / max(hi - lo, 1e-12) * 255, 0, 255).astype(np.uint8)


def preview(run, out, path: Path, depth: float = 0.5) -> Path:
    """PNG: the region's z slice at ``depth`` (0-1) of its extent, input (left) | every output
    channel: 3 channels (affinities) as one RGB panel, otherwise one panel per channel (at most
    :data:`PREVIEW_CHANNELS`).  Bounded: a pyramid's mip where one was built, else a window of
    :data:`PREVIEW_SIDE` voxels about the region's centre; absent chunks read as 0."""
    # lazy: loads PIL only when called
    from PIL import Image, ImageDraw

    layer, box, inp, mip = _preview_source(run, out)
    sl = _window(box, depth, 2 * PREVIEW_SIDE if mip else PREVIEW_SIDE)
    h, w = tuple(sl.shape)[1:]
    outs = np.zeros((layer.channels,) + (h, w), np.float32)
    inter = sl.intersect(layer.bounds)
    if not inter.empty:
        outs[(slice(None),) + inter.to_slices(sl.offset)[1:]] = layer.read(inter, fill_missing=True)[0][:, 0]
    panels = []  # (label, PIL image)
    if inp is not None:
        a = np.zeros((h, w), np.float32)
        got = sl.intersect(inp.bounds)
        if not got.empty:
            a[got.to_slices(sl.offset)[1:]] = inp.read(got, fill_missing=True)[0][0, 0]
        panels.append((f"input z={sl.offset[0]}" + (f" (mip {mip})" if mip else ""), Image.fromarray(_to8(a))))

    def scaled(v):
        if layer.dtype == "uint8":
            return v.astype(np.uint8)
        if v.size and 0 <= float(v.min()) and float(v.max()) <= 1:  # probabilities: 0-1 as 0-255
            return _to8(v, 0.0, 1.0)
        return _to8(v)

    if layer.channels == 3:
        rgb = np.stack([scaled(outs[c]) for c in range(3)], -1)
        panels.append(("output channels 0-2 as RGB", Image.fromarray(rgb)))
    else:
        for c in range(min(layer.channels, PREVIEW_CHANNELS)):
            more = f" of {layer.channels}" if c == 0 and layer.channels > PREVIEW_CHANNELS else ""
            panels.append((f"output ch {c}{more}", Image.fromarray(scaled(outs[c]))))
    scale = max(1, 512 // max(w, 1))  # small regions drawn larger; the labels at their own size
    pw, ph = w * scale, h * scale
    img = Image.new("RGB", (len(panels) * (pw + 8) - 8, ph + 16), (255, 255, 255))
    d = ImageDraw.Draw(img)
    for i, (label, p) in enumerate(panels):
        img.paste(p.convert("RGB").resize((pw, ph), Image.NEAREST), (i * (pw + 8), 16))
        d.text((i * (pw + 8) + 2, 2), label, fill=(0, 0, 0))
    buf = path.with_suffix(".tmp.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(buf)
    buf.replace(path)
    return path


# ---- Snakemake's log ---------------------------------------------------------------------------
def parse_snakemake_log(text: str, base: Path | None = None) -> list[dict]:
    r"""The failed jobs of a Snakemake log: ``[{rule, job (a job number or None), log, exit,
    signal, slurm_state, message}]`` (``base``: where relative paths are, Snakemake's directory).

    >>> t = ("Command 'znni run-job' returned non-zero exit status 137.\n[Mon]\nError in rule infer_job:\n"
    ...      "    message: None\n    jobid: 4\n    output: w/jobs/000003.json\n    log: w/logs/jobs/000003.log (check)\n")
    >>> e = parse_snakemake_log(t)[0]
    >>> e["rule"], e["job"], e["exit"], e["log"]
    ('infer_job', 3, 137, 'w/logs/jobs/000003.log')
    """
    out = []
    heads = list(re.finditer(r"^Error in rule (\S+?):\s*$", text, re.M))
    prev = 0
    for i, m in enumerate(heads):
        before = text[prev : m.start()]
        rest = text[m.end() : heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        block = []
        for line in rest.splitlines()[1:]:
            if line and not line.startswith((" ", "\t")):
                break
            block.append(line)
        body = "\n".join(block)
        prev = m.end() + len(body)
        job = re.search(r"jobs/(\d{6})\.json", body)
        logm = re.search(r"^\s+log: (\S+)", body, re.M)
        msg = re.search(r"^\s+message: (.*)$", body, re.M)
        exits = re.findall(r"(?:exit status|exit code|exit_code[=:]?)\s*(-?\d+)", before + "\n" + body)
        sig = re.findall(r"died with <Signals\.(\w+)", before)
        slurm = re.findall(r"SLURM status is: '?(\w+)", before + "\n" + body)
        log_path = logm.group(1) if logm else None
        if log_path and base is not None and not log_path.startswith("/"):
            log_path = str(Path(base) / log_path)
        out.append(
            {
                "rule": m.group(1),
                "job": int(job.group(1)) if job else None,
                "log": log_path,
                "exit": int(exits[-1]) if exits else (137 if sig and sig[-1] == "SIGKILL" else None),
                "signal": sig[-1] if sig else None,
                "slurm_state": slurm[-1] if slurm else None,
                "message": msg.group(1).strip() if msg and msg.group(1).strip() != "None" else None,
            }
        )
    return out


def record_snakemake_log(work, log_file, run_digest: str) -> list[dict]:
    """Parse Snakemake's log ``log_file`` and record its failures in ``<work>/jobs/records/`` for
    ``znni status`` and the report, with the run they are of (``run_digest``; those of another
    run are ignored, :func:`.status.snakemake_errors`) and the time they were recorded; returns
    them ([] when it cannot be read)."""
    p = Path(log_file)
    try:
        text = p.read_text(errors="replace")
        when = p.stat().st_mtime
    except OSError:
        return []
    base = p.resolve().parent.parent.parent if p.parent.name == "log" and p.parent.parent.name == ".snakemake" else None
    errors = parse_snakemake_log(text, base)
    doc = {
        "run_digest": run_digest,
        "recorded": time.time(),
        "log": str(p.resolve()),
        "time": when,
        "errors": [e for e in errors if e["job"] is not None],
        "rules": errors,
    }
    atomic_write(records_dir(work) / SNAKEMAKE_ERRORS, (json.dumps(doc, indent=1) + "\n").encode())
    return errors


# ---- what the report says ------------------------------------------------------------------------
def attempts_summary(jobs: dict) -> dict:
    """Retries, OOMs and timeouts from the jobs' attempts (:func:`.status.job_table`).  A task
    is retried when two attempts ran it (or failed it); an attempt killed, terminated or out of
    memory counts every task of its job it had not finished."""
    retried_jobs, ooms, timeouts, seen = [], [], [], {}
    for job, j in sorted(jobs.items()):
        atts = j.get("attempts") or []
        if len(atts) > 1 or int(j.get("attempts_total") or 0) > 1:
            retried_jobs.append(
                {
                    "job": job,
                    "attempts": [f"{a.get('state')}" + (f" ({a['kind']})" if a.get("kind") else "") for a in atts],
                }
            )
        for a in atts or [j]:
            tried = set(a.get("ran") or []) | {int(k) for k in (a.get("failed_tasks") or {})}
            if a.get("kind") in (
                "killed",
                "oom",
                "terminated",
                "timeout",
                "interrupted",
            ):  # each task it had not finished
                tried |= set(a.get("tasks") or []) - set(a.get("skipped") or [])
            for t in tried:
                seen[t] = seen.get(t, 0) + 1
            row = {
                "job": job,
                "attempt": a.get("attempt"),
                "host": a.get("host"),
                "slurm_job": a.get("slurm_job"),
                "error": a.get("error"),
                "log": a.get("log") or j.get("log"),
                "max_rss_mb": a.get("max_rss_mb"),
                "mem_mb": a.get("mem_mb"),
            }
            if a.get("kind") in ("oom", "killed"):
                ooms.append(row | {"kind": a["kind"]})
            elif a.get("kind") in ("timeout", "terminated"):
                timeouts.append(row | {"kind": a["kind"]})
    return {
        "retried_jobs": retried_jobs,
        "retried_tasks": sorted(t for t, n in seen.items() if n > 1),
        "ooms": ooms,
        "timeouts": timeouts,
    }


def measured_reads(tally, pred: dict) -> dict | None:
    """What the done tasks read from the input (their manifests' ``input_read``: whole chunks,
    summed in the :class:`~.tally.Tally`) and wrote (chunks, shards, manifests), against the
    region's unique input and the predicted read amplification (:func:`~.schedule.input_reads`,
    recorded with the prediction)."""
    reads = tally.reads
    if not reads["tasks"]:
        return None
    c = tally.counts()
    out = {
        "tasks": reads["tasks"],
        "chunk_reads": reads["chunks"],
        "voxels_read": reads["voxels"],
        "objects_written": (tally.shards or tally.chunks["written"]) + c["done"] + c["empty"],
    }
    p = pred.get("input_reads") or {}
    if p.get("voxel_bytes"):
        out["bytes_read"] = reads["voxels"] * int(p["voxel_bytes"])
    if p.get("unique_voxels"):
        out["unique_voxels"] = int(p["unique_voxels"])
        out["amplification"] = reads["voxels"] / out["unique_voxels"]
        out["predicted_amplification"] = float(p["amplification"])
        out["predicted_chunk_reads"] = int(p["chunks"])
    return out


def measured_cost(run, jobs: dict, pred: dict, state: dict, tally=None) -> dict:
    """The job-hours the run took (every attempt, failed ones too; a running one so far) and the
    node-hours at the prediction's threads and cores per node, beside the prediction (for the
    whole run, and pro rata for the voxels done); with finalize's ``tally`` of the done tasks'
    manifests, what they read and wrote (:func:`measured_reads`)."""
    secs, source = 0.0, None
    for j in jobs.values():
        for a in j.get("attempts") or []:
            s = a.get("seconds")
            if s is None and a.get("started"):
                s = float(a.get("updated") or a["started"]) - float(a["started"])
            secs += float(s or 0)
    if secs:
        source = "the jobs' records: every attempt, failed ones included"
    else:
        d = work_path(run) / "jobs"
        for p in sorted(d.glob("[0-9]" * 6 + ".json")) if d.is_dir() else []:
            try:
                secs += float(json.loads(p.read_text())["seconds"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        source = "the jobs' markers (finished jobs only)" if secs else "the done tasks' busy time"
        secs = secs or state["throughput"]["busy_s"]
    threads, cores = int(pred.get("threads") or 1), int(pred.get("cores_per_node") or 1)
    gpu = pred.get("device") == "gpu"
    job_hours = secs / 3600
    measured = job_hours if gpu else job_hours * threads / cores
    predicted = pred.get("gpu_hours" if gpu else "node_hours")
    total = max(int(pred.get("voxels") or 0), 1)
    done = state["throughput"]["voxels"]
    return {
        "unit": "GPU-hours" if gpu else "node-hours",
        "measured": measured,
        "measured_job_hours": job_hours,
        "measured_source": source,
        "predicted": predicted,
        "predicted_for_done": predicted * done / total if predicted is not None else None,
        "voxels_done": done,
        "voxels": total,
        "ratio": measured / (predicted * done / total) if predicted and done else None,
        "threads": threads,
        "cores_per_node": cores,
        "prediction": pred,
        "reads": measured_reads(tally, pred) if tally is not None else None,
    }


def memory_rows(jobs: dict) -> list[dict]:
    """Each job's last ended attempt: max RSS, mem_mb and their ratio (the memory efficiency)."""
    rows = []
    for job, j in sorted(jobs.items()):
        ended = [a for a in (j.get("attempts") or []) if a.get("max_rss_mb") is not None]
        if not ended:
            continue
        a = ended[-1]
        mem = a.get("mem_mb")
        rows.append(
            {
                "job": job,
                "state": a.get("state"),
                "max_rss_mb": a["max_rss_mb"],
                "mem_mb": mem,
                "efficiency": round(a["max_rss_mb"] / mem, 3) if mem else None,
                "seconds": a.get("seconds"),
                "host": a.get("host"),
            }
        )
    return rows


def failures(state: dict, tally, rules: list) -> list[dict]:
    """What failed, why and where its log is: the failed tasks grouped by job (their own errors
    first), the tasks finalize found not done with its reason, and other rules Snakemake saw fail."""
    rows, by_job = [], {}
    for t, f in sorted(state["failed"].items()):
        key = (f["job"], f["error"])
        by_job.setdefault(key, {"tasks": [], **f})["tasks"].append(t)
    rows += [v for v in by_job.values()]
    if tally is not None:
        known = set(state["failed"])
        bad = {t: r for t, r in tally.errors.items() if t not in known}
        more = tally.n_failed - len(tally.errors)
        for t, r in sorted(bad.items())[:200]:
            rows.append({"tasks": [t], "job": None, "error": f"finalize: {r}", "kind": "not done", "log": None})
        if len(bad) > 200 or more > 0:
            rows.append(
                {
                    "tasks": [],
                    "job": None,
                    "error": f"... and {max(0, len(bad) - 200) + more} more not done",
                    "kind": "not done",
                }
            )
    for e in rules or []:
        if e.get("job") is None:
            rows.append(
                {"tasks": [], "job": None, "rule": e.get("rule"), "kind": "rule", "log": e.get("log")}
                | {"error": snakemake_error_text(e)}
            )
    return rows


def outcome(state: dict, tally) -> str:
    """``complete`` | ``failed`` (a task failed) | ``running`` | ``partial`` (tasks not done, none
    failed); ``tally``: finalize's check, or None."""
    not_done = tally is not None and tally.n_failed
    if state["failed"]:
        return "failed"
    if state["running"]:
        return "running"
    if not_done or state["not_started"]:
        return "partial"
    return "complete"


# ---- the page ------------------------------------------------------------------------------------
def _esc(v) -> str:
    return html.escape(str(v))


def _table(rows: list[dict], cols: list[tuple[str, str]], empty: str = "none") -> str:
    if not rows:
        return f"<p>{_esc(empty)}</p>"
    head = "".join(f"<th>{_esc(label)}</th>" for _, label in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(k))}</td>" for k, _ in cols) + "</tr>" for r in rows)
    return f"<table class=grid><tr>{head}</tr>{body}</table>"


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, list):
        text = ", ".join(map(str, v[:20])) + (" ..." if len(v) > 20 else "")
        return _esc(text)
    text = str(v)
    if text.startswith("/") and text.endswith((".log", ".out", ".err")):
        return f'<a href="file://{_esc(text)}"><code>{_esc(text)}</code></a>'
    return _esc(text)


#: what a summary row's number is, where its key alone does not say
LABELS = {
    "wall_seconds": "wall_seconds (the first task's start to the last task's end)",
    "task_seconds": "task_seconds (summed over tasks)",
    "voxels_per_s_wall": "voxels_per_s_wall (voxels / wall_seconds)",
    "voxels_per_s_per_job": "voxels_per_s_per_job (voxels / task_seconds)",
    "recomputed_voxels": "recomputed_voxels (by the tasks' own checks, from the network's definition)",
    "chunks_empty": "chunks_empty (input.empty: skip: all-zero input context, not stored, read as 0)",
}


def page(run, doc: dict, summary: dict | None, images: list[str], link: tuple | None, plan_text: str) -> str:
    """``report.html`` of ``doc`` (:func:`write_report`'s document), ``summary`` (finalize's, or
    None), the images beside it (``preview.png`` first) and the Neuroglancer link: one helper per
    section, in order."""
    parts = [_head_html(run, doc), _tasks_html(doc), _failures_html(doc), _jobs_html(doc)]
    if doc.get("cost"):
        parts.append(_cost_html(doc["cost"]))
    parts.append(_previews_html(images, link))
    if summary:
        parts.append(_summary_html(summary))
    parts += _config_html(run, doc, plan_text)
    return "\n".join(parts) + "\n"


def _head_html(run, doc: dict) -> str:
    """The page's head: its style, the outcome, the layers, who wrote it and when."""
    return f"""<!doctype html><meta charset="utf-8"><title>znni report: {_esc(doc["outcome"])}</title>
<style>body{{font-family:sans-serif;max-width:75em;margin:2em auto}}th{{text-align:left;padding-right:1em}}
table.grid td,table.grid th{{border-bottom:1px solid #ddd;padding:2px 8px;vertical-align:top}}
.failed{{color:#b00}} .ok{{color:#070}} pre{{background:#f6f6f6;padding:.5em;overflow:auto}}</style>
<h1>znni run report: <span class="{"ok" if doc["outcome"] == "complete" else "failed"}">{_esc(doc["outcome"])}</span></h1>
<p>input <code>{_esc(run.input.url)}</code> &rarr; output <code>{_esc(run.output.url)}</code><br>
<small>written by {_esc(doc["written_by"])} at {_esc(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["time"])))};
work dir <code>{_esc(run.work_dir)}</code>; run digest {_esc(run.digest[:12])}</small></p>"""


def _tasks_html(doc: dict) -> str:
    """The tasks section: the counts by state and the throughput."""
    st, counts = doc["state"], doc["counts"]
    th = st["throughput"]
    return (
        '<section id="outcome"><h2>Tasks</h2>'
        + _table([counts], [(k, k) for k in counts])
        + (
            f"<p>throughput {th['tasks_per_h']:,.1f} tasks/h, {th['voxels_per_s'] / 1e6:,.3g} Mvoxels/s over "
            f"{_esc(duration(th['busy_s']))} busy"
            + (f"; ETA {_esc(duration(st['eta_s']))}" if st.get("eta_s") is not None else "")
            + "</p>"
            if th["busy_s"]
            else "<p>no task done yet</p>"
        )
        + "</section>"
    )


def _failures_html(doc: dict) -> str:
    """The failures section: per job (or rule, or task) the tasks, the kind, the error, the log."""
    rows = [
        f
        | {
            "what": f"job {f['job']}"
            if f.get("job") is not None
            else (f"rule {f['rule']}" if f.get("rule") else "task"),
            "why": KINDS.get(f.get("kind"), f.get("kind")),
        }
        for f in doc["failures"]
    ]
    cols = [("what", "job / rule"), ("tasks", "task(s)"), ("why", "kind"), ("error", "error"), ("log", "log")]
    return '<section id="failures"><h2>Failures</h2>' + _table(rows, cols, "nothing failed") + "</section>"


#: the columns of the report's OOM and timeout tables
_KILL_COLUMNS = [
    ("job", "job"),
    ("attempt", "attempt"),
    ("kind", "kind"),
    ("error", "error"),
    ("host", "host"),
    ("log", "log"),
]


def _jobs_html(doc: dict) -> str:
    """The jobs section: retries, OOMs, timeouts, the slowest jobs and the memory efficiency."""
    a, st = doc["attempts"], doc["state"]
    slowest = [r | {"mem": mem_text(r.get("max_rss_mb"), r.get("mem_mb"))} for r in st["slowest"]]
    return (
        '<section id="jobs"><h2>Jobs: retries, OOMs, timeouts, memory</h2>'
        + "<h3>Retries</h3>"
        + _table(
            a["retried_jobs"],
            [("job", "job"), ("attempts", "attempts, in order")],
            "no job was attempted more than once",
        )
        + (f"<p>tasks attempted more than once: {_cell(a['retried_tasks'])}</p>" if a["retried_tasks"] else "")
        + "<h3>Out of memory</h3>"
        + _table(a["ooms"], _KILL_COLUMNS, "no job ran out of memory (no MemoryError, no exit 137)")
        + "<h3>Timeouts</h3>"
        + _table(a["timeouts"], _KILL_COLUMNS, "no job hit a time limit")
        + "<h3>Slowest jobs</h3>"
        + _table(
            slowest,
            [("job", "job"), ("state", "state"), ("seconds", "seconds"), ("tasks", "tasks run"), ("voxels", "voxels")]
            + [("host", "host"), ("mem", "memory")],
            "no job recorded",
        )
        + "<h3>Memory efficiency (max RSS / mem_mb)</h3>"
        + _table(
            doc["memory"],
            [("job", "job"), ("state", "state"), ("max_rss_mb", "max RSS (MiB)"), ("mem_mb", "mem_mb")]
            + [("efficiency", "efficiency"), ("host", "host")],
            "no job recorded its memory",
        )
        + "</section>"
    )


def _cost_html(c: dict) -> str:
    """The cost section: predicted against measured node-hours (GPU-hours)."""
    unit, pred = c["unit"], c["prediction"]
    rows = [
        {"what": f"predicted {unit} (whole run)", "value": c["predicted"], "how": pred.get("rate_source")},
        {
            "what": f"predicted {unit} for the voxels done",
            "value": c["predicted_for_done"],
            "how": f"{c['voxels_done']:,} of {c['voxels']:,} voxels",
        },
        {"what": f"measured {unit}", "value": c["measured"], "how": c["measured_source"]},
        {"what": "measured / predicted (voxels done)", "value": c["ratio"], "how": ""},
        {
            "what": "job-hours measured",
            "value": c["measured_job_hours"],
            "how": f"{c['threads']} thread(s) per job, {c['cores_per_node']} cores per node",
        },
        {
            "what": "predicted rate (voxels/s per job)",
            "value": pred.get("voxels_per_second"),
            "how": pred.get("note", "recorded before the run"),
        },
    ]
    r = c.get("reads")
    if r:
        whole = r.get("unique_voxels")
        rows += [
            {
                "what": "input read (measured)",
                "value": (f"{r['bytes_read']:,} bytes, " if "bytes_read" in r else f"{r['voxels_read']:,} voxels, ")
                + f"{r['chunk_reads']:,} chunk reads",
                "how": f"the {r['tasks']:,} done tasks' manifests (whole input chunks, decoded)",
            },
            {
                "what": "read amplification: measured / predicted",
                "value": (f"{r['amplification']:.2f}x / {r['predicted_amplification']:.2f}x" if whole else "n/a"),
                "how": f"voxels read over the region's unique input ({whole:,} voxels)" if whole else "no prediction",
            },
            {
                "what": "objects written",
                "value": f"{r['objects_written']:,}",
                "how": "output chunks or shards, manifests",
            },
        ]
    return (
        '<section id="cost"><h2>Cost: predicted and measured</h2>'
        + _table(rows, [("what", ""), ("value", "value"), ("how", "from")])
        + "</section>"
    )


def _previews_html(images: list[str], link: tuple | None) -> str:
    """The previews section: the Neuroglancer link (and how to serve it) and the images."""
    figs = "".join(f'<figure><img src="{_esc(n)}" alt="{_esc(n)}" style="max-width:100%"></figure>' for n in images)
    link_html = ""
    if link:
        url, notes = link
        link_html = (
            f'<p><a href="{_esc(url)}">Open input and output in Neuroglancer</a>'
            + "".join("<br><small>" + _esc(n) + "</small>" for n in notes)
            + "</p>"
        )
    return f'<section id="previews"><h2>Previews</h2>{link_html}{figs or "<p>no preview</p>"}</section>'


def _summary_html(summary: dict) -> str:
    """finalize's summary, as a table (the link, the failures and the figures are elsewhere)."""
    rows = "".join(
        f"<tr><th>{_esc(LABELS.get(k, str(k)))}</th><td>{_esc(v)}</td></tr>"
        for k, v in summary.items()
        if k not in ("neuroglancer", "failures", "figures")
    )
    return f'<section id="summary"><h2>Summary</h2><table>{rows}</table></section>'


def _config_html(run, doc: dict, plan_text: str) -> list[str]:
    """The config that ran, the network and the plan."""
    return [
        '<section id="config"><h2>Config</h2><pre>' + _esc(_config_text(doc["config"])) + "</pre></section>",
        f"<h2>Network</h2><pre>{_esc(json.dumps(asdict(run.network), indent=1))}</pre>",
        f"<h2>Plan</h2><pre>{_esc(plan_text)}</pre>",
    ]


def _config_text(cfg) -> str:
    """The config that ran (every key, defaults filled in), as YAML."""
    return yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=120)


def _plan_text(run) -> str:
    """The plan per layer, as ``znni plan`` prints it; its record where the plan cannot be read."""
    try:
        # lazy: loads numba and scipy only when called
        from ..plan.plan import Plan

        return Plan.load(plan_path(run)).describe()
    except Exception:  # noqa: BLE001 - a moved work directory: its record
        return json.dumps(asdict(run.plan), indent=1)


def _guard(what: str, fn, notes: list, default=None):
    """``fn()``, or ``default`` with a note: a report section never fails the report."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - partial state: say what is missing and go on
        notes.append(f"{what}: not available ({type(exc).__name__}: {exc})")
        return default


def write_report(
    where,
    *,
    snakemake_logs=(),
    tally=None,
    summary: dict | None = None,
    images: list | None = None,
    log=print,
) -> Path | None:
    """Write ``report.html`` and ``report.json`` under ``<work_dir>/report/`` from what is on disk;
    return the page's path.  ``where``: the work dir, its run.json or the config.  finalize passes
    its check (``tally``, :func:`.finalize.check_manifests`), its ``summary`` (None: the run is not finalized) and
    the ``images`` it drew; otherwise the preview and the task map are drawn here.  Partial state
    (no run file, no layer, no manifests) leaves sections out with a note, never an error.
    :func:`gather_report` reads, :func:`render_report` draws and writes."""
    where = location(where)
    try:
        rf = run_file_of(where)
        if rf.suffix in (".yaml", ".yml"):
            rf = work_path(load_config(rf)) / "run.json"
        run = load_run(rf)
    except (ZnniError, OSError, ValueError) as exc:
        work = where if where.is_dir() else where.parent if where.name == "run.json" else None
        if work is None:
            log(f"report: no run to report on ({exc})")
            return None
        return _unvalidated_report(work, snakemake_logs, str(exc), log)
    doc, state = gather_report(run, snakemake_logs, tally)
    path = render_report(run, doc, state, summary, images)
    for f in doc["failures"][:5]:
        log(
            f"report: {'job ' + str(f['job']) if f.get('job') is not None else 'task'} failed"
            + (f" (task(s) {_cell(f['tasks'])})" if f.get("tasks") else "")
            + f": {f['error']}"
            + (f"; log {f['log']}" if f.get("log") else "")
        )
    return path


def gather_report(run, snakemake_logs=(), tally=None) -> tuple[dict, dict]:
    """``(report.json's document, the run's state)`` of ``run`` from what is on disk (Snakemake's
    logs recorded first; :func:`write_report`'s arguments).  A section that cannot be had is left
    out with a note in ``doc["notes"]``."""
    work = work_path(run)
    notes: list = []
    rules = []
    for sl in snakemake_logs:
        rules += _guard(f"Snakemake log {sl}", lambda sl=sl: record_snakemake_log(work, sl, run.digest), notes, [])
    state = collect(run, known=tally)
    jobs = state["jobs"]
    pred = _guard("the prediction", lambda: recorded_prediction(run), notes, {})
    doc = {
        "format": REPORT_FORMAT,
        "written_by": "znni finalize" if tally is not None else "znni report",
        "time": time.time(),
        "outcome": outcome(state, tally),
        "counts": {
            "tasks": state["tasks"],
            "done": len(state["done"]),
            "running": len(state["running"]),
            "failed": len(state["failed"]),
            "masked": len(state["masked"]),
            "not started": len(state["not_started"]),
        },
        "failures": failures(state, tally, rules),
        "attempts": attempts_summary(jobs),
        "memory": memory_rows(jobs),
        "cost": _guard("the cost", lambda: measured_cost(run, jobs, pred, state, tally), notes, None) if pred else None,
        "config": run.to_json().get("config"),
        "state": {k: v for k, v in state.items() if k not in ("jobs", "tally")},
        "notes": notes,
    }
    return doc, state


def render_report(run, doc: dict, state: dict, summary: dict | None = None, images: list | None = None) -> Path:
    """Draw what :func:`gather_report` found (``images`` None: the previews, the task map and the
    timeline drawn here) and write ``report.json`` and ``report.html``; return the page's path."""
    report_dir = work_path(run) / "report"
    with local_copy(report_dir) as local:  # the work directory's, or (s3://, gs://) uploaded after
        return report_dir / _render(run, doc, state, summary, images, local).name


def _render(run, doc: dict, state: dict, summary: dict | None, images: list | None, report_dir: Path) -> Path:
    notes = doc["notes"]
    if images is None:
        images = _draw(run, state, report_dir, notes)
    link = (summary["neuroglancer"], summary.get("viewer_notes", [])) if summary and "neuroglancer" in summary else None
    if link is None:
        fin = run.config.finalize
        link = _guard("the viewer link", lambda: neuroglancer_link(run, fin.neuroglancer, fin.serve_port), notes)
    text = page(run, doc, summary, images, link, _plan_text(run))
    if notes:
        text += (
            "<section id=notes><h2>Notes</h2><ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul></section>\n"
        )
    atomic_write(report_dir / "report.json", (json.dumps(doc, indent=1, default=str) + "\n").encode())
    path = report_dir / "report.html"
    atomic_write(path, text.encode())
    return path


def _draw(run, state: dict, report_dir: Path, notes: list) -> list[str]:
    """A partial run's images: ``preview.png`` (what is stored so far), the task map, the timeline
    of the done tasks (from their manifests' timings, :func:`.status.collect`'s tally)."""
    names = []

    def prev():
        out = open_output(parse_layer_url(run.output.url, endpoint=run.config.output.endpoint_url), output_spec(run))
        return preview(run, out, report_dir / "preview.png").name

    names.append(_guard("the preview", prev, notes))
    tally = state["tally"]

    def tmap():
        tasks = run_geometry(run)[3]
        ranks = state_ranks(tally, state["running"], state["failed"], tasks)
        return task_map(tasks, ranks, report_dir / "tasks.png")

    names.append(_guard("the task map", tmap, notes))
    names.append(_guard("the timeline", lambda: timeline(tally, report_dir / "timeline.png"), notes))
    return [n for n in names if n]


def _unvalidated_report(work: Path, snakemake_logs, why: str, log) -> Path | None:
    """The report of a run that has no run file (validate failed or never ran): the errors its
    logs say, and Snakemake's."""
    lines = []
    vlog = work / "logs" / "validate.log"
    try:
        lines = [ln for ln in vlog.read_text(errors="replace").splitlines() if ln.startswith("error: ")][-5:]
    except OSError:
        pass
    rules = []
    for sl in snakemake_logs:
        try:
            rules += parse_snakemake_log(Path(sl).read_text(errors="replace"))
        except OSError:
            continue
    if not work.is_dir():
        log(f"report: {work} is not a work directory ({why})")
        return None

    body = "".join(f"<li><code>{_esc(ln)}</code> (<code>{_esc(vlog)}</code>)</li>" for ln in lines)
    body += "".join(
        f"<li>{_esc(snakemake_error_text(e))}"
        + (f"; log <code>{_esc(e['log'])}</code>" if e.get("log") else "")
        + "</li>"
        for e in rules
    )
    text = f"""<!doctype html><meta charset="utf-8"><title>znni report: not validated</title>
<h1>znni run report: not validated</h1>
<p>work dir <code>{_esc(work)}</code>: no run file ({_esc(why)})</p>
<section id="failures"><h2>Failures</h2><ul>{body or "<li>no error logged</li>"}</ul></section>
"""
    path = work / "report" / "report.html"
    atomic_write(path, text.encode())
    for ln in lines:
        log(f"report: validate failed: {ln} (log {vlog})")
    return path
