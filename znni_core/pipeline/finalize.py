"""Finalize a run: check every manifest and chunk, append provenance, write the report.

The report (``<work_dir>/report/``): ``summary.json``, ``report.html``, ``preview.png`` (input | every
output channel, middle z slice of the region), the figures of :mod:`.report` (timeline, task map,
previews at other depths), the plan per layer, the tasks' own verification, and a Neuroglancer link
showing input and output.  A run with a task not done gets ``report.html`` (what failed, why, where
the log is) but no ``summary.json``, and finalize fails as before (:func:`.report.write_report`).
A finished run's ``report.html`` is written before ``summary.json`` (the run's done-marker); a report
that fails is logged as a warning and never fails a run whose every task checked out.
"""

from __future__ import annotations

import datetime
import json
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .. import load_network
from ..errors import DataError, ZnniError
from ..io import (
    atomic_write,
    clean_stale_temporaries,
    open_output,
    parse_layer_url,
    read_json,
    write_json,
)
from ..io.atomic import TMP_DIR, release_tmp_dir
from ..io.checksums import index_keys, write_index
from ..io.workdir import is_remote_work, local_copy, remove_before_rewrite, work_path
from ..progress import bar
from .done import check_task
from .mask import load_mask_tasks, positions
from .network_file import network_file
from .pyramid import require_pyramid
from .report import (
    empty_chunks,
    neuroglancer_link,
    output_on_zeros,
    preview,
    state_ranks,
    task_map,
    timeline,
    write_report,
)
from .run import Run, load_run, output_spec, run_geometry
from .settings import Config
from .tally import MASKED, MAX_LISTED, Tally

#: the report's file finalize writes last: the run's done-marker
SUMMARY = "summary.json"
#: tasks checked at once where the manifests or the output are in object storage
REMOTE_CHECKS = 16


def output_mapping(cfg: Config) -> str:
    """How the stored values relate to the network's output (recorded in the layer's provenance
    when it is created and at every finalize): dtype, scale and offset, test-time augmentation."""
    out, tta = cfg.output, cfg.tta
    if out.dtype == "float32":
        text = "float32: v, the network's output"
    elif out.dtype == "float16":
        text = "float16: v rounded to half precision, v the network's output"
    elif out.scale is None:
        text = "uint8: round(v * 255), v the network's output in [0, 1]"
    else:
        text = f"uint8: round(clip(v * {out.scale:g} + {out.offset:g}, 0, 255)), v the network's output"
    if tta.flips or tta.transpose_xy:
        text += f"; v the mean over test-time augmentation (flips {tta.flips}, transpose_xy {tta.transpose_xy})"
    if tta.variance:
        text += "; then the variance across the variants as more channels"
    return text


def check_manifests(run: Run, out, verify: str, log=print, *, spill: Path | None = None) -> Tally:
    """Every task's manifest and stored objects checked (:func:`.done.check_task`), folded into a
    :class:`~.tally.Tally` one at a time (no manifest is kept): done, ``masked`` (the mask is 0 over
    all of it: never run, by design) or failed with the reason.  Never counts a task without a
    verified manifest as done.  ``spill``: where the written chunks' digests go, by block of the
    layer's checksum index (:func:`~znni_core.io.checksums.write_index`)."""
    _, _, _, tasks = run_geometry(run)
    live = None
    if run.mask:
        live = np.zeros(len(tasks), bool)
        live[list(positions(load_mask_tasks(run)))] = True
    index = None
    if spill is not None:
        key, _, count = index_keys(out)
        index = (key, count)
    tally = Tally(len(tasks), spill=spill, index=index)
    # in object storage (the work directory's manifests, the output's objects) a check is requests
    # that wait: REMOTE_CHECKS tasks at once, folded in task order (a window: memory stays bounded)
    out_url = getattr(out, "url", None)
    remote = is_remote_work(run.work_dir) or (out_url is not None and not out_url.is_local)
    workers = REMOTE_CHECKS if remote else 1

    def check(b):
        try:
            return check_task(run, out, b, verify)
        except DataError as exc:
            return exc

    with bar(len(tasks), "finalize: checking tasks", "task") as progress:

        def to_check():
            for k, b in enumerate(tasks):
                if live is not None and not live[k]:
                    tally.seen(k, b.id, MASKED)
                    progress.update(1)
                else:
                    yield k, b

        for k, b, got in _in_order(to_check(), check, workers):
            progress.update(1)
            if isinstance(got, DataError):
                tally.fail(k, b.id, str(got))
            else:
                tally.add(k, got)
    return tally


def _in_order(items, fn, workers: int):
    """``(k, b, fn(b))`` for ``(k, b)`` of ``items`` in order, ``workers`` calls at once (a bounded window)."""
    if workers <= 1:
        for k, b in items:
            yield k, b, fn(b)
        return

    with ThreadPoolExecutor(workers) as pool:
        window: deque = deque()
        for k, b in items:
            window.append((k, b, pool.submit(fn, b)))
            if len(window) >= 2 * workers:
                k0, b0, f = window.popleft()
                yield k0, b0, f.result()
        while window:
            k0, b0, f = window.popleft()
            yield k0, b0, f.result()


def _figures(run: Run, out, tally: Tally, report_dir: Path) -> list[str]:
    """The report's PNGs besides ``preview.png`` (:mod:`.report`): timeline, task map, previews at a
    quarter and three quarters of the depth (where they differ from the middle)."""
    _, _, _, tasks = run_geometry(run)
    names = [
        timeline(tally, report_dir / "timeline.png"),
        task_map(tasks, state_ranks(tally), report_dir / "tasks.png"),
    ]
    depth = run.region["shape"][0]
    for f in (0.25, 0.75):
        if depth > 2:
            z = run.region["offset"][0] + min(depth - 1, int(depth * f))
            names.append(preview(run, out, report_dir / f"preview_z{z}.png", f).name)
    return [n for n in names if n]


def finalize(run_file, *, verify: str | None = None, log=print) -> dict:
    """Check every task's manifest and chunks, then append provenance and write the report; return the summary.

    ``verify`` overrides ``finalize.verify`` of the run's config.  If any task is not done (masked
    tasks excepted) nothing is finalized: the partial run's ``report.html`` is written (what failed,
    why, where the log is) and a :class:`DataError` lists the failed tasks; otherwise the
    layer's stale temporaries are removed and ``<work_dir>/report/`` gets ``summary.json``,
    ``report.html`` and ``preview.png``.  Memory does not grow with the tasks beyond a few numbers
    each (:mod:`.tally`): the digests of the checksum index are spilled to ``<work_dir>/report``.
    """
    t0 = time.perf_counter()
    run = load_run(run_file)
    cfg = run.config
    verify = verify or cfg.finalize.verify
    out_url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
    out = open_output(out_url, output_spec(run))
    report_at = work_path(run) / "report"
    remote = is_remote_work(report_at)
    remove_before_rewrite(report_at / SUMMARY)  # an earlier finalize's done-marker
    spill = None if out_url.format == "zarr" else Path(tempfile.gettempdir()) if remote else report_at
    # the report is drawn and written in the work directory (s3://, gs://: locally, then uploaded,
    # summary.json last: it is the run's done-marker)
    with check_manifests(run, out, verify, log, spill=spill) as tally, local_copy(report_at, last=SUMMARY) as local:
        return _finalize(run_file, run, out, out_url, tally, verify, (local, report_at), t0, log)


def _finalize(run_file, run: Run, out, out_url, tally: Tally, verify: str, report: tuple, t0: float, log) -> dict:
    # long (one sequence): the summary, the checksum index, provenance, the report and the done
    # marker in the order a finalize must write them (the marker last).  ``report``: (the local
    # directory the report is written in, where it is kept: the same, or an s3:// / gs:// one)
    report_dir, report_at = report
    cfg = run.config
    counts = tally.counts()
    failed = dict(sorted(tally.errors.items()))
    n_failed, n_masked_tasks = counts["failed"], counts["masked"]
    n_written, n_empty, n_masked = tally.chunks["written"], tally.chunks["empty"], tally.chunks["masked"]
    voxels = int(tally.voxels.sum())
    filled = tally.filled.listed()
    mask_filled = tally.mask_filled
    if run.mask:  # the scan's fills too: a task masked as a whole has no manifest
        mask_filled.update(load_mask_tasks(run).get("missing_mask_filled", []))
    removed = clean_stale_temporaries_in_layer(out_url) if not n_failed else []
    summary = {
        "tasks": tally.n,
        "done": tally.n - n_failed - n_masked_tasks,
        "failed": tally.failed_ids(),
        "failures": {str(k): v for k, v in failed.items()},
        "chunks_written": n_written,
        "chunks_empty": n_empty,
        "empty_chunks": empty_chunks(cfg.input.empty, n_empty, _output_on_zeros(run) if n_empty else None),
        "voxels": voxels,
        "task_seconds": round(tally.compute_s, 3),
        "voxels_per_s_per_job": round(voxels / tally.compute_s, 1) if tally.compute_s else 0,
        "wall_seconds": round(tally.wall_seconds(), 3),
        "missing_input_filled": filled,
        "verify": verify,
        "stale_temporaries_removed": len(removed),
        "output": str(out_url),
        "input": run.input.url,
        "run_digest": run.digest,
    }
    if not tally.filled.complete:
        summary["missing_input_filled_listed"] = f"the first {MAX_LISTED} (sorted) of more"
    if n_failed > len(failed):
        summary["failures_listed"] = f"the first {len(failed)} of {n_failed}"
    pyramid = work_path(run) / "pyramid.json"
    if cfg.downsample.mips and pyramid.is_file():  # written by `znni pyramid` after its checks
        summary["pyramid"] = [
            f"mip {m['mip']} {m['key']} {tuple(m['size_zyx'])} (z, y, x): {m['tasks']} task(s) verified"
            for m in json.loads(pyramid.read_text())["mips"]
        ]
    if run.mask:
        summary.update(
            {
                "mask": run.mask.url,
                "tasks_masked": n_masked_tasks,
                "chunks_masked": n_masked,
                "missing_mask_filled": mask_filled.listed(),
            }
        )
    if summary["wall_seconds"] > 0:
        summary["voxels_per_s_wall"] = round(voxels / summary["wall_seconds"], 1)
    if n_failed:
        for t, why in failed.items():
            log(f"FAILED task {t}: {why}")
        if n_failed > len(failed):
            log(f"... and {n_failed - len(failed)} more task(s) not done")
        log(
            f"finalize: {n_failed} of {tally.n} task(s) not done; nothing finalized. "
            f"Re-run the workflow (only those tasks run) or `znni run-task {run_file} --task ID`."
        )
        path = _partial_report(run_file, tally, log)
        raise DataError(
            f"{n_failed} task(s) failed or unverified: {summary['failed'][:20]}"
            + (f"; what failed and why: {path}" if path else "")
        )
    if "pyramid" in summary:  # a mip-0 task re-run since: the mips above it are stale
        require_pyramid(run, log)

    # provenance: an entry for what this run produced; none again when nothing was produced since
    # the last entry of this run (a finalize re-run, a config change that alters no byte)
    prov = read_json(out_url, "provenance") or {"description": "", "owners": [], "processing": [], "sources": []}
    produced = tally.last_finished()
    last = next((e for e in reversed(prov.setdefault("processing", [])) if _method(e) == "znni inference"), None)
    if last is not None and last.get("run_digest") == run.digest and last.get("last_task_finished") == produced:
        log("provenance: this run's entry is there already (nothing produced since)")
    else:
        mf = mask_filled.listed()
        _append_provenance(prov, run, cfg, filled, n_empty, summary, n_masked_tasks, n_masked, mf, produced)
        write_json(out_url, "provenance", prov)
    if out_url.format != "zarr":  # so a later run can verify it as its input
        summary["checksum_index_chunks"] = write_index(out, tally)

    report_dir.mkdir(parents=True, exist_ok=True)
    png = preview(run, out, report_dir / "preview.png")
    summary.update(tally.verification())
    summary["figures"] = _figures(run, out, tally, report_dir)
    link, notes = neuroglancer_link(run, cfg.finalize.neuroglancer, cfg.finalize.serve_port)
    summary.update(
        {
            "preview": str(report_at / png.name),
            "neuroglancer": link,
            "viewer_notes": notes,
            "finalize_seconds": round(time.perf_counter() - t0, 3),
        }
    )
    # the page first: summary.json is the run's done-marker, written last; a report that fails is a
    # warning, never the failure of a run whose every task checked out
    _final_report(run_file, tally, summary, [png.name] + summary["figures"], log)
    atomic_write(report_dir / SUMMARY, (json.dumps(summary, indent=1, sort_keys=True) + "\n").encode())
    log(
        f"finalize: {summary['done']}/{summary['tasks']} tasks done, 0 failed"
        + (f", {n_masked_tasks} masked (the mask is 0 over them)" if run.mask else "")
        + f"; {n_written} chunks written, {n_empty} empty (skipped: all-zero input context, not stored, read as 0)"
        + (f", {n_masked} masked" if run.mask else "")
        + "; "
        f"{voxels:,} voxels, {summary['voxels_per_s_per_job']:,.0f} voxels/s "
        f"per job" + (f", {summary['voxels_per_s_wall']:,.0f} voxels/s wall" if "voxels_per_s_wall" in summary else "")
    )
    return summary


def _output_on_zeros(run: Run) -> list | None:
    """What the network gives on an all-zero raw input (:func:`.report.output_on_zeros`), for the
    report's statement of what the empty chunks do not hold; None when the network cannot be read."""
    try:
        net = load_network(network_file(run.network.path, run.config.network.endpoint_url))
        return output_on_zeros(net, run.config.normalize.shift)
    except (ZnniError, OSError):
        return None


def clean_stale_temporaries_in_layer(url) -> list:
    """Remove temporaries of dead writers on this host from a local layer's directory, its immediate
    subdirectories and their temporaries' directories (:data:`~znni_core.io.atomic.TMP_DIR`, removed
    once empty); return the paths removed ([] for a cloud layer)."""
    if not url.is_local:
        return []
    removed = []
    dirs = [url.local_path] + [p for p in url.local_path.iterdir() if p.is_dir() and p.name != TMP_DIR]
    for d in dirs:
        removed += clean_stale_temporaries(d, all_hosts=False)
        tmp = d / TMP_DIR
        if tmp.is_dir():
            removed += clean_stale_temporaries(tmp, all_hosts=False)
            release_tmp_dir(tmp)
    return removed


def _final_report(run_file, tally: Tally, summary: dict, images: list, log) -> Path | None:
    """The finished run's report (:func:`.report.write_report`), before ``summary.json``; None,
    with a one-line warning, if it fails: every task checked out, so the run is done regardless."""
    try:
        return write_report(run_file, tally=tally, summary=summary, images=images, log=log)
    except Exception as exc:  # noqa: BLE001 - the report is best effort: the run's outcome is the tasks'
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        log(f"finalize: warning: the report was not written ({type(exc).__name__}: {first}); the run is done")
        return None


def _partial_report(run_file, tally: Tally, log) -> Path | None:
    """The report of a run finalize refuses (:func:`.report.write_report`: what failed, why, where
    the log is); None, with a note, if even that fails: finalize's own error comes first."""
    try:
        path = write_report(run_file, tally=tally, log=log)
    except Exception as exc:  # noqa: BLE001 - the report is best effort here
        log(f"finalize: the partial run's report was not written ({type(exc).__name__}: {exc})")
        return None
    if path is not None:
        log(f"finalize: report of the partial run: {path}")
    return path


def _method(entry) -> str | None:
    m = entry.get("method") if isinstance(entry, dict) else None
    return m.get("task") if isinstance(m, dict) else None


def _append_provenance(prov, run, cfg, filled, n_empty, summary, n_masked_tasks, n_masked, mask_filled, produced):
    """Append the run's ``znni inference`` entry to the layer's provenance document ``prov``."""
    prov["processing"].append(
        {
            "method": {
                "task": "znni inference",
                "network": run.network.path,
                "network_digest": run.network.digest,
                "plan_digest": run.plan.digest,
                "region": run.region,
                "edge": cfg.edge,
                "normalize": asdict(cfg.normalize),
                "output_mapping": output_mapping(cfg),
                "missing_input_filled": filled,
                "chunks_empty": n_empty,
                "empty_chunks": summary["empty_chunks"],
                **(
                    {
                        "mask": asdict(run.mask),
                        "tasks_masked": n_masked_tasks,
                        "chunks_masked": n_masked,
                        "missing_mask_filled": mask_filled,
                    }
                    if run.mask
                    else {}
                ),
            },
            "by": "znni",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": run.versions,
            "run_digest": run.digest,
            "last_task_finished": produced,
        }
    )
