"""``znni status``: what a run's tasks and jobs are doing, read from what is on disk.

A task is

- **done**: a manifest of this run (its digest; no stored object is read, ``finalize`` checks them);
- **masked**: the mask is 0 over all of it (never run);
- **running**: not done, and the last attempt of its job (the job's record, :mod:`.jobs`) started
  and has not ended: its process is alive (checked on this host; trusted on another);
- **failed**: not done, and its job's last attempt recorded a failure (the task's own error, or the
  job's: an exception, ``MemoryError``, SIGTERM), or died without a record (a process gone on this
  host: SIGKILL, the OOM killer's exit 137), or Snakemake's log says the job failed
  (``znni report --snakemake-log``, which the workflow's ``onerror`` runs);
- **not started**: the rest (made by another run: as ``not done``).

Throughput is over the run's busy time (the union of its done tasks' start-to-end intervals and
its running jobs' time so far: the gaps between two sessions of a resumed run do not count), the
ETA that rate over the tasks left.  :func:`collect` gathers it, :func:`render` prints it,
:func:`watch` redraws it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import ZnniError
from ..io import open_input, parse_layer_url, read_manifest
from ..io.workdir import work_path
from .identity import changed_inputs
from .jobs import PREDICTION_FILE, attempt_alive, duration, job_record, prediction, records_dir
from .mask import load_mask_tasks, open_mask, positions
from .run import location, run_geometry
from .schedule import JobMap
from .tally import DONE, EMPTY, FAILED, MASKED, OTHER, TODO, Tally, busy_seconds

#: seconds between two redraws of ``znni status --watch`` without a value
WATCH_EVERY = 10.0
#: the Snakemake failures ``znni report --snakemake-log`` recorded (``jobs/records/``)
SNAKEMAKE_ERRORS = "snakemake-errors.json"


def run_file_of(path) -> Path:
    """``path`` as a run file: a work directory means its ``run.json``."""
    path = location(path)
    return path / "run.json" if path.is_dir() else path


# ---- tasks ---------------------------------------------------------------------------------------
def task_states(run, blocks, known: Tally | None = None) -> Tally:
    """The tasks' states from the manifests' run digests (no stored object is read), as a
    :class:`~.tally.Tally`: ``done`` (a manifest of this run, with its timing), ``other`` (a
    manifest of another run: not done for this one), ``masked`` (the mask is 0 over the whole
    task, after the mask's scan), ``todo`` (the rest).  ``known``: an earlier call's tally (done is
    permanent for a run digest): its done tasks' manifests are not read again."""
    # lazy: loads numba and scipy only when called
    from .task import manifest_path

    live = None
    if run.mask:
        try:
            live = np.zeros(len(blocks), bool)
            live[list(positions(load_mask_tasks(run)))] = True
        except ZnniError:  # not scanned yet: every task counts
            live = None
    tally = known if known is not None and known.n == len(blocks) else Tally(len(blocks))
    for k, b in enumerate(blocks):
        if tally.state[k] == DONE:
            continue
        if live is not None and not live[k]:
            tally.seen(k, b.id, MASKED)
            continue
        try:
            m = json.loads(manifest_path(run, b.id).read_text())
            digest = m.get("run_digest")
        except (OSError, ValueError, AttributeError):  # none, unreadable or not a manifest: not done
            tally.seen(k, b.id, TODO)
            continue
        if digest != run.digest:
            tally.seen(k, b.id, OTHER)
        elif (t := task_timing(m)) is not None:
            tally.timing(k, b.id, *t)
        else:
            tally.seen(k, b.id, DONE)
    return tally


def task_timing(m: dict) -> tuple | None:
    """``(start, end, voxels, host:pid or slurm job)`` of a done task's manifest, None when it has none."""
    try:
        end, total = float(m["finished"]), float(m["timings"]["total_s"])
        who = str(m.get("slurm_job") or f"{m.get('host', '?')}:{m.get('pid', '?')}")
        return (end - total, end, int(m.get("voxels", 0)), who)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def changed_input_tasks(run, blocks) -> list:
    """``[(task id, [changed object, ...])]`` of the done ``blocks`` whose recorded input versions
    differ from the input's now."""
    # lazy: loads numba and scipy only when called
    from .task import manifest_path

    cfg = run.config
    inp = open_input(
        parse_layer_url(run.input.url, endpoint=cfg.input.endpoint_url),
        run.input.mip,
        resolution=cfg.input.resolution,
        checksums="none",
    )
    mask = open_mask(cfg, inp.resolution) if run.mask else None
    out = []
    for b in blocks:
        changed = changed_inputs(inp, read_manifest(manifest_path(run, b.id)), mask.layer if mask else None)
        if changed:
            out.append((b.id, changed))
    return out


# ---- jobs ----------------------------------------------------------------------------------------
#: what an attempt's ``kind`` means, as the status and the report say it
KINDS = {
    "error": "failed",
    "oom": "out of memory (MemoryError, exit 137 or SLURM OUT_OF_MEMORY)",
    "terminated": "terminated (SIGTERM: a time limit, scancel, or Snakemake stopping)",
    "interrupted": "interrupted (Ctrl-C)",
    "killed": "killed without a record (SIGKILL: exit 137, the OOM killer or a hard time limit)",
    "timeout": "time limit (SLURM TIMEOUT)",
}


def kill_kind(exit_code=None, signal_name=None, slurm_state=None) -> str:
    """An attempt's kind from what Snakemake saw: exit 137/SIGKILL or OUT_OF_MEMORY: ``oom``
    (or ``killed``), TIMEOUT: ``timeout``, SIGTERM/143: ``terminated``, else ``error``.

    >>> kill_kind(137), kill_kind(slurm_state="TIMEOUT"), kill_kind(1)
    ('oom', 'timeout', 'error')
    """
    if slurm_state == "OUT_OF_MEMORY" or exit_code == 137 or signal_name == "SIGKILL":
        return "oom"
    if slurm_state in ("TIMEOUT", "DEADLINE"):
        return "timeout"
    if exit_code == 143 or signal_name == "SIGTERM":
        return "terminated"
    return "error"


def read_records(work, run_digest: str | None = None) -> dict:
    """``{job: record}`` of every job with attempt files under ``<work>/jobs/records/NNNNNN/``
    (:func:`.jobs.job_record`: its attempts of run ``run_digest`` merged; files that are no
    attempt's record skipped)."""

    out = {}
    d = records_dir(work)
    try:
        dirs = sorted(p for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []
    except OSError:
        return {}
    for p in dirs:
        doc = job_record(work, int(p.name), run_digest)
        if doc is not None:
            out[doc["job"]] = doc
    return out


def snakemake_errors(work, run_digest: str | None) -> dict:
    """``{job: error}`` that ``znni report --snakemake-log`` recorded for run ``run_digest`` (the
    last per job); those recorded for another run (a config changed since, in the same work dir),
    or with no run digest, are not this run's: ignored."""

    try:
        doc = json.loads((records_dir(work) / SNAKEMAKE_ERRORS).read_text())
        if run_digest is None or doc.get("run_digest") != run_digest:
            return {}
        return {int(e["job"]): e | {"snakemake_log": doc.get("log"), "time": doc.get("time", 0)} for e in doc["errors"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def job_table(run, now: float | None = None) -> dict:
    """``{job: its state}`` from the job records and Snakemake's recorded failures: ``state``
    (running | done | failed), the last attempt's fields, ``attempts`` (all of them, each with its
    ``state`` and ``kind`` resolved: a running attempt whose process is gone is ``failed``/``killed``,
    as is one a later attempt followed, unless its process is seen alive on this host: two
    processes of one job, a resubmission while the old one still runs), ``attempts_total``.
    Snakemake's failures count when recorded for this run (:func:`snakemake_errors`)."""
    now = time.time() if now is None else now
    work = work_path(run)
    sm = snakemake_errors(work, run.digest)
    jobs = {}
    for job, doc in read_records(work, run.digest).items():
        atts = [dict(a) for a in doc["attempts"]]
        for i, a in enumerate(atts):
            if a.get("state") == "running":
                later, live = i + 1 < len(atts), attempt_alive(a)
                if live is False or (later and live is not True):
                    a.update(state="failed", kind="killed", error=KINDS["killed"])
                else:
                    a["seconds"] = round(now - float(a.get("started", now)), 3)
        last = atts[-1]
        e = sm.get(job)
        if e and last["state"] == "running" and float(e.get("time", 0)) >= float(last.get("started", 0)):
            last.update(state="failed", kind=kill_kind(e.get("exit"), e.get("signal"), e.get("slurm_state")))
            last["error"] = snakemake_error_text(e)
        if e and last["state"] == "failed" and last.get("kind") == "killed":
            k = kill_kind(e.get("exit"), e.get("signal"), e.get("slurm_state"))
            if k != "error":
                last.update(kind=k, error=snakemake_error_text(e))
        jobs[job] = {**last, "job": job, "attempts": atts, "attempts_total": doc["attempts_total"], "snakemake": e}
    for job, e in sm.items():  # a job Snakemake saw fail before it wrote any record
        if job not in jobs:
            jobs[job] = {
                "job": job,
                "state": "failed",
                "kind": kill_kind(e.get("exit"), e.get("signal"), e.get("slurm_state")),
                "error": snakemake_error_text(e),
                "log": e.get("log"),
                "tasks": _scheduled_tasks(run, job),
                "attempts": [],
                "snakemake": e,
            }
    return jobs


def snakemake_error_text(e: dict) -> str:
    """One line for a failure Snakemake logged."""
    how = []
    if e.get("exit") is not None:
        how.append(f"exit {e['exit']}")
    if e.get("signal"):
        how.append(f"killed by {e['signal']}")
    if e.get("slurm_state"):
        how.append(f"SLURM state {e['slurm_state']}")
    kind = kill_kind(e.get("exit"), e.get("signal"), e.get("slurm_state"))
    what = {"oom": "out of memory (or a hard kill)", "timeout": "time limit", "terminated": "terminated"}.get(kind)
    return (
        f"Snakemake: rule {e.get('rule', '?')} failed"
        + (f" ({', '.join(how)})" if how else "")
        + (f": {what}" if what else "")
        + (f"; {e['message']}" if e.get("message") else "")
    )


def _scheduled_tasks(run, job: int) -> list:
    """The tasks of ``job`` by the workflow's schedule (``schedule.json``), [] when unknown."""
    try:
        s = json.loads((work_path(run) / "schedule.json").read_text())
        blocks = run_geometry(run)[3]
        if run.mask:
            order = positions(load_mask_tasks(run))
        else:
            order = range(run.num_tasks)
        jobs = JobMap(int(s["tasks_per_job"]), len(order), None if run.mask else s.get("brick"), tuple(blocks.shape))
        return [blocks[order[i]].id for i in jobs.positions(job)]
    except Exception:  # noqa: BLE001 - no schedule, no mask scan: unknown
        return []


# ---- rates ---------------------------------------------------------------------------------------
# ---- everything --------------------------------------------------------------------------------
def collect(run, *, now: float | None = None, known: Tally | None = None, cache: dict | None = None) -> dict:
    """The run's state (module doc): task ids by state, jobs, throughput, ETA, the slowest jobs.
    ``known``: finalize's check (:func:`.finalize.check_manifests`), used instead of reading the
    manifests again.  ``cache``: a dict kept between calls (``watch``'s): the run's tasks and the
    tally of the last call (done is permanent for a run digest), so a later call reads only the
    manifests of the tasks not done yet.  ``state["tally"]``: the tasks' tally (not serialised)."""
    now = time.time() if now is None else now
    if cache is not None and cache.get("run_digest") != run.digest:
        cache.clear()
        cache.update(run_digest=run.digest, tally=None, blocks=run_geometry(run)[3])
    blocks = cache["blocks"] if cache is not None else run_geometry(run)[3]
    tally = known if known is not None else task_states(run, blocks, cache["tally"] if cache is not None else None)
    if cache is not None:
        cache["tally"] = tally
    by = tally.ids_where
    state = {"done": by(DONE, EMPTY), "other": by(OTHER), "masked": by(MASKED), "todo": by(TODO, FAILED)}
    done = set(state["done"])
    jobs = job_table(run, now)
    running, failed = {}, {}
    for job, j in sorted(jobs.items()):
        if j["state"] == "running":
            for t in j.get("tasks") or []:
                if t not in done:
                    running[t] = job
        elif j["state"] == "failed":
            own = {int(k): v for k, v in (j.get("failed_tasks") or {}).items()}
            for t in j.get("tasks") or []:
                if t not in done:
                    failed[t] = {
                        "job": job,
                        "error": own.get(t) or j.get("error") or "failed",
                        "kind": j.get("kind", "error"),
                        "log": j.get("log"),
                        "host": j.get("host"),
                        "attempt": j.get("attempt"),
                    }
    not_done = [t for t in state["todo"] + state["other"] if t not in running and t not in failed]
    timed = tally.timed()
    live = [(float(j["started"]), now) for j in jobs.values() if j["state"] == "running" and j.get("started")]
    busy = busy_seconds(np.r_[tally.start[timed], [a for a, _ in live]], np.r_[tally.end[timed], [b for _, b in live]])
    voxels = int(tally.voxels[timed].sum())
    tasks_per_h = len(timed) / busy * 3600 if busy > 0 else 0.0
    left = len(running) + len(not_done)
    eta = left / tasks_per_h * 3600 if tasks_per_h > 0 and running else None
    return {
        "time": now,
        "tasks": len(blocks),
        "done": state["done"],
        "masked": state["masked"],
        "other": state["other"],
        "todo": state["todo"],  # no manifest (made by another run: "other")
        "running": running,
        "failed": failed,
        "not_started": not_done,
        "jobs": jobs,
        "throughput": {
            "tasks_per_h": round(tasks_per_h, 3),
            "voxels_per_s": round(voxels / busy, 1) if busy > 0 else 0.0,
            "busy_s": round(busy, 3),
            "voxels": voxels,
        },
        "eta_s": None if eta is None else round(eta, 1),
        "slowest": slowest_jobs(jobs, tally),
        "tally": tally,
    }


def slowest_jobs(jobs: dict, tally: Tally, n: int = 5) -> list:
    """The ``n`` longest jobs (their last attempt; running ones so far); without job records the
    processes that ran the done tasks (a SLURM job, else host:pid), from the manifests."""
    rows = []
    for job, j in jobs.items():
        if j.get("seconds") is None:
            continue
        rows.append(
            {
                "job": job,
                "state": j["state"],
                "seconds": float(j["seconds"]),
                "tasks": len(j.get("ran") or []),
                "voxels": int(j.get("voxels") or 0),
                "host": j.get("host"),
                "slurm_job": j.get("slurm_job"),
                "max_rss_mb": j.get("max_rss_mb"),
                "mem_mb": j.get("mem_mb"),
            }
        )
    if not rows:
        t = tally.timed()
        code = tally.job[t]
        for c in np.unique(code[code >= 0]):
            sel = t[code == c]
            rows.append(
                {
                    "job": tally.job_names[c],
                    "state": "done",
                    "seconds": float(tally.end[sel].max() - tally.start[sel].min()),
                    "tasks": len(sel),
                    "voxels": int(tally.voxels[sel].sum()),
                }
            )
    return sorted(rows, key=lambda r: -r["seconds"])[:n]


def _ids(got: list, limit: int = 50) -> str:
    got = sorted(got)
    return f"{got[:limit]}" + (" ..." if len(got) > limit else "")


def mem_text(max_rss_mb, mem_mb) -> str:
    """``max RSS 512 MiB of 2000 (26%)``, or what is known of it."""
    if max_rss_mb is None:
        return ""
    if mem_mb:
        return f"max RSS {max_rss_mb:,.0f} MiB of {mem_mb:,} ({max_rss_mb / mem_mb:.0%})"
    return f"max RSS {max_rss_mb:,.0f} MiB"


def render(s: dict) -> str:
    """:func:`collect`'s state as ``znni status`` prints it (its first line as it always was)."""

    lines = [
        f"{len(s['done'])} of {s['tasks']} tasks done"
        + (f", {len(s['masked'])} masked (the mask is 0 over them: never run)" if s["masked"] else "")
        + f"; not done: {_ids(s['todo'])}"
        + (
            f"; made by another run (the next run refuses, or recomputes them with recompute: changed): "
            f"{_ids(s['other'])}"
            if s["other"]
            else ""
        )
    ]
    jobs = s["jobs"]
    run_jobs = sorted({j for j in s["running"].values()})
    counts = (
        f"tasks: {len(s['done'])} done, {len(s['running'])} running, {len(s['failed'])} failed, "
        f"{len(s['masked'])} masked, {len(s['not_started'])} not started"
    )
    lines.append(counts)
    for job in run_jobs[:10]:
        j = jobs[job]
        where = f"{j.get('host', '?')} pid {j.get('pid', '?')}" + (
            f", SLURM job {j['slurm_job']}" if j.get("slurm_job") else ""
        )
        checked = "" if attempt_alive(j) is not None else " (another host: not checked)"
        lines.append(
            f"  running job {job}: {len(j.get('ran') or [])} of {len(j.get('tasks') or [])} task(s) done, "
            f"{duration(j.get('seconds'))} so far, attempt {j.get('attempt', 1)}, {where}{checked}"
        )
    if len(run_jobs) > 10:
        lines.append(f"  ... and {len(run_jobs) - 10} more running job(s)")
    failed_jobs: dict = {}
    for t, f in sorted(s["failed"].items()):
        failed_jobs.setdefault(f["job"], []).append(t)
    for job, ts in list(failed_jobs.items())[:10]:
        j = jobs[job]
        f = s["failed"][ts[0]]
        kind = "" if f["kind"] == "error" else f", {KINDS.get(f['kind'], f['kind'])}"
        lines.append(
            f"  failed job {job} (attempt {j.get('attempt', '?')}{kind}): task(s) {_ids(ts, 10)}: "
            f"{_first_line(f['error'])}" + (f"; log {f['log']}" if f.get("log") else "")
        )
    if len(failed_jobs) > 10:
        lines.append(f"  ... and {len(failed_jobs) - 10} more failed job(s)")
    th = s["throughput"]
    if th["busy_s"] > 0:
        left = len(s["running"]) + len(s["not_started"])
        eta = (
            f"ETA {duration(s['eta_s'])} for {left} task(s) left"
            if s["eta_s"] is not None
            else ("nothing left to run" if not left else f"{left} task(s) left, no job running: no ETA")
        )
        lines.append(
            f"throughput: {th['tasks_per_h']:,.1f} tasks/h, {th['voxels_per_s'] / 1e6:,.3g} Mvoxels/s over "
            f"{duration(th['busy_s'])} busy; {eta}"
        )
    else:
        lines.append("throughput: no task done yet")
    if s["slowest"]:
        parts = []
        for r in s["slowest"][:3]:
            rate = r["voxels"] / r["seconds"] / 1e6 if r["seconds"] > 0 else 0
            extra = ", ".join(
                x
                for x in (
                    r.get("host") and str(r["host"]),
                    r.get("slurm_job") and f"SLURM {r['slurm_job']}",
                    mem_text(r.get("max_rss_mb"), r.get("mem_mb")),
                )
                if x
            )
            parts.append(
                f"{'job ' if isinstance(r['job'], int) else ''}{r['job']} {duration(r['seconds'])}"
                f"{' (running)' if r['state'] == 'running' else ''}: {r['tasks']} task(s), {rate:.3g} Mvoxels/s"
                + (f", {extra}" if extra else "")
            )
        lines.append("slowest jobs: " + "; ".join(parts))
    return "\n".join(lines)


def _first_line(text) -> str:
    text = str(text).strip().splitlines()
    return (text[0] if text else "")[:300]


def finished(s: dict) -> bool:
    """Every task done, masked or failed: nothing running and nothing left to start."""
    return not s["running"] and not s["not_started"]


def watch(run, every: float, echo=print, *, max_iterations: int | None = None, sleep=time.sleep, extra=None) -> dict:
    """Print :func:`render` every ``every`` s (the screen cleared first on a terminal) until
    :func:`finished` (or ``max_iterations`` redraws); return the last state.  ``extra(state)``:
    more lines under it (the pyramid's).  The tasks done (and their timings) are kept between
    redraws: each reads only the manifests of the tasks not done yet."""
    tty = sys.stdout.isatty()
    k, cache = 0, {}
    while True:
        s = collect(run, cache=cache)  # the done tasks' manifests are read once
        text = render(s) + (("\n" + extra(s)) if extra else "")
        stamp = time.strftime("%H:%M:%S")
        if tty:
            echo(
                "\x1b[H\x1b[2J" + f"znni status {run.work_dir} at {stamp} (every {every:g} s; Ctrl-C to stop)\n" + text
            )
        else:
            echo(f"--- {stamp} ---\n{text}")
        k += 1
        if finished(s) or (max_iterations is not None and k >= max_iterations):
            return s
        sleep(every)


# ---- the prediction ------------------------------------------------------------------------------
def recorded_prediction(run) -> dict:
    """The prediction recorded for this run (:func:`.jobs.record_prediction`), else computed now
    (and said so)."""
    try:
        doc = json.loads((work_path(run) / PREDICTION_FILE).read_text())
        if doc.get("run_digest") == run.digest:
            return doc
    except (OSError, ValueError):
        pass
    try:  # the jobs the workflow scheduled: what a job's tasks share is fetched once
        s = json.loads((work_path(run) / "schedule.json").read_text())
        per, brick = int(s["tasks_per_job"]), s.get("brick")
    except (OSError, ValueError, KeyError, TypeError):
        per, brick = 1, None
    return prediction(run, per, brick) | {"note": "not recorded before the run: computed when the report was written"}
