"""The run report for every run (pipeline/report.py): a failed run's says which task failed, why
and where its log is; retries, OOMs, timeouts, predicted against measured node-hours, memory
efficiency, previews of every channel, the config; ``znni report`` never fails on partial state."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from znni_core.cli import app
from znni_core.errors import DataError
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.jobs import run_job
from znni_core.pipeline.run import load_run

from .pipeline_helpers import SMALL_NET, base_config, em, fail_task
from .test_pipeline import prepare

CHROMIUM = os.environ.get("ZNNI_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium-headless-shell", "chromium", "google-chrome")) if p), None
)
SECTIONS = ("outcome", "failures", "jobs", "cost", "previews", "config")


def _run_jobs(rf, per: int, log_dir: Path, jobs) -> dict:
    """Run ``jobs`` in-process, each logging to ``<log_dir>/NNNNNN.log`` as the workflow's rule
    does; ``{job: error}`` of those that failed."""
    failed = {}
    log_dir.mkdir(parents=True, exist_ok=True)
    for j in jobs:
        path = log_dir / f"{j:06d}.log"
        path.touch()
        with open(path, "a") as f:
            try:
                run_job(rf, j, per, log=lambda m, f=f: print(m, file=f, flush=True))
            except DataError as exc:
                print(f"error: {exc}", file=f)
                failed[j] = str(exc)
    return failed


def _open_in_browser(page_file: Path, shot: Path) -> tuple[list, str, list]:
    """(``[src, naturalWidth]`` of each image, the page's text, its sections' ids); a full-page
    screenshot saved at ``shot``."""
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright (dev extra)")
    if CHROMIUM is None:
        pytest.skip("no Chromium: apt-get install chromium-headless-shell (or set ZNNI_CHROMIUM)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto("file://" + str(page_file))
            page.wait_for_load_state("load")
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => [i.getAttribute('src'), i.naturalWidth])")
            ids = page.eval_on_selector_all("section", "ss => ss.map(s => s.id)")
            text = page.inner_text("body")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    return widths, text, ids


def test_a_failed_run_reports_the_task_its_error_and_log(tmp_path, monkeypatch):
    """A small run where task 5 fails: finalize writes the report, then fails as before (no
    summary.json); the report, opened in Chromium, names the task, the error and the job's log,
    has every section and its images load. Fixed and re-run, the job's retry shows, and the
    finished run's report too has every section."""
    from znni_core.pipeline import task as T

    cfg = base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 2])
    rf = prepare(cfg)
    run = load_run(rf)
    work, per, victim = Path(run.work_dir), 4, 5
    real = fail_task(monkeypatch, victim)
    jobs = range(-(-run.num_tasks // per))
    assert list(_run_jobs(rf, per, work / "logs" / "jobs", jobs)) == [1]
    with pytest.raises(DataError, match=r"1 task\(s\) failed or unverified: \[5\]; what failed and why: .*report.html"):
        finalize(rf, log=lambda *a: None)
    report = work / "report"
    assert not (report / "summary.json").exists()  # finalize's done-marker: only for a finished run
    doc = json.loads((report / "report.json").read_text())
    assert doc["outcome"] == "failed" and doc["counts"]["failed"] == 1 and doc["counts"]["done"] == run.num_tasks - 1
    (f,) = doc["failures"]
    log = str(work / "logs" / "jobs" / "000001.log")
    assert (
        f["tasks"] == [victim] and f["job"] == 1 and f["error"] == "injected read failure of task 5" and f["log"] == log
    )
    assert f"task {victim} FAILED: injected read failure" in Path(log).read_text()
    widths, text, ids = _open_in_browser(report / "report.html", tmp_path / "failed.png")
    assert (tmp_path / "failed.png").stat().st_size > 0
    assert set(SECTIONS) <= set(ids), ids
    assert widths and all(w > 0 for _, w in widths), widths
    assert {"preview.png", "tasks.png"} <= {s for s, _ in widths}
    failures = text[text.index("Failures") : text.index("Jobs: retries")]
    assert "job 1" in failures and "injected read failure of task 5" in failures and log in failures, failures
    assert re.search(r"predicted node-hours \(whole run\)\s+[\d.e-]+", text) and "measured node-hours" in text, text
    assert "Memory efficiency" in text and "normalize:" in text and "scale: 0.00392" in text  # the config that ran

    # `znni report` (what the workflow's onerror runs) writes the same from what is on disk
    r = CliRunner().invoke(app, ["report", str(work)])
    assert r.exit_code == 0 and "report.html" in r.output, r.output
    doc = json.loads((report / "report.json").read_text())
    assert doc["written_by"] == "znni report" and doc["failures"][0]["log"] == log

    # fixed and re-run: the job's second attempt runs only the failed task; the report says so
    monkeypatch.setattr(T, "read_task", real)
    assert _run_jobs(rf, per, work / "logs" / "jobs", [1]) == {}
    s = finalize(rf, log=lambda *a: None)
    assert s["failed"] == [] and (report / "summary.json").is_file()
    doc = json.loads((report / "report.json").read_text())
    assert doc["outcome"] == "complete" and doc["failures"] == []
    assert doc["attempts"]["retried_jobs"] == [{"job": 1, "attempts": ["failed (error)", "done"]}]
    assert doc["attempts"]["retried_tasks"] == [victim]
    assert all(r["max_rss_mb"] > 0 for r in doc["memory"]) and len(doc["memory"]) == len(jobs)
    assert doc["cost"]["measured"] > 0 and doc["cost"]["predicted"] > 0
    widths, text, ids = _open_in_browser(report / "report.html", tmp_path / "complete.png")
    assert set(SECTIONS) | {"summary"} <= set(ids) and all(w > 0 for _, w in widths), (ids, widths)
    assert "nothing failed" in text and "recomputed_voxels" in text


def test_report_of_a_run_that_never_ran_or_was_never_validated(tmp_path):
    """``znni report`` never fails: a validated run with nothing run yet is ``partial`` (its
    preview shows the empty layer); a work dir whose validation failed gets the logged error;
    a path that is no run at all, a message."""
    rf = prepare(base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 2]))
    run = load_run(rf)
    r = CliRunner().invoke(app, ["report", str(rf)])
    assert r.exit_code == 0, r.output
    doc = json.loads((Path(run.work_dir) / "report" / "report.json").read_text())
    assert doc["outcome"] == "partial" and doc["counts"]["not started"] == run.num_tasks and doc["failures"] == []
    assert (Path(run.work_dir) / "report" / "preview.png").stat().st_size > 0
    bad = tmp_path / "bad"
    (bad / "logs").mkdir(parents=True)
    (bad / "logs" / "validate.log").write_text("planning ...\nerror: input.path: no such layer file:///nowhere\n")
    r = CliRunner().invoke(app, ["report", str(bad)])
    assert r.exit_code == 0, r.output
    page = (bad / "report" / "report.html").read_text()
    assert "not validated" in page and "no such layer file:///nowhere" in page and "validate.log" in page
    r = CliRunner().invoke(app, ["report", str(tmp_path / "no" / "such" / "dir")])
    assert r.exit_code == 0 and "no run to report on" in r.output, r.output


@pytest.mark.parametrize("channels", [3, 2])
def test_previews_show_every_channel_within_a_bounded_window(tmp_path, monkeypatch, channels):
    """Affinities (3 channels) are one RGB panel; other counts one panel per channel; the preview
    reads a window of at most PREVIEW_SIDE voxels (y, x) about the region's centre."""
    from PIL import Image

    from znni_core.pipeline import report as R
    from znni_core.pipeline.run import output_spec

    layout = SMALL_NET[:-2] + [("conv", channels, (1, 3, 3)), ("act", "sigmoid")]
    rf = prepare(base_config(tmp_path, vol=em((8, 32, 32)), layout=layout))
    run = load_run(rf)
    _run_jobs(rf, run.num_tasks, Path(run.work_dir) / "logs" / "jobs", [0])
    from znni_core.io import open_output, parse_layer_url

    out = open_output(parse_layer_url(run.output.url), output_spec(run))
    reads = []
    real = type(out).read

    def spy(self, roi, **kw):
        reads.append(tuple(roi.shape))
        return real(self, roi, **kw)

    monkeypatch.setattr(type(out), "read", spy)
    monkeypatch.setattr(R, "PREVIEW_SIDE", 6)
    png = R.preview(run, out, tmp_path / "p.png")
    assert reads and set(reads) == {(1, 6, 6)}, reads  # input and output: one window each
    img = np.asarray(Image.open(png).convert("RGB")).astype(int)
    panels = 2 if channels == 3 else 1 + channels
    scale = 512 // 6
    assert img.shape[1] == panels * (6 * scale + 8) - 8, img.shape
    out_panel = img[16:, (6 * scale + 8) : 2 * (6 * scale + 8) - 8]
    spread = np.abs(out_panel[..., 0] - out_panel[..., 1]).max()
    assert (spread > 0) == (channels == 3)  # RGB only for affinities


@pytest.mark.slow  # one Snakemake run (~25 s on 2 cores)
def test_the_workflow_writes_the_failed_runs_report_on_error(tmp_path):
    """Through Snakemake: task 5 always fails (retried once); ``onerror`` runs ``znni report``
    with Snakemake's log: the report names job 5's task, its error and its log, and the retry."""
    from tests import faults_helpers as H

    case = H.make_case(tmp_path / "case")
    p = H.snakemake(case, "--retries", 1, profile="profiles/local", env=H.fault_env("fail:5"))
    assert p.returncode != 0
    assert re.search(r"report: job 5 failed \(task\(s\) 5\): injected failure of task 5", p.stderr), p.stderr[-3000:]
    doc = json.loads((case.work / "report" / "report.json").read_text())
    (f,) = doc["failures"]
    assert f["tasks"] == [5] and "injected failure of task 5" in f["error"]
    assert f["log"] == str(case.work / "logs" / "jobs" / "000005.log")
    assert doc["attempts"]["retried_jobs"] == [{"job": 5, "attempts": ["failed (error)", "failed (error)"]}]
    assert json.loads((case.work / "jobs" / "records" / "snakemake-errors.json").read_text())["errors"][0]["job"] == 5
    r = CliRunner().invoke(app, ["status", str(case.work)])
    assert "failed job 5 (attempt 2): task(s) [5]: injected failure of task 5" in r.output, r.output


def test_finalize_writes_the_report_before_its_done_marker_and_a_broken_report_only_warns(tmp_path, monkeypatch):
    """A finished run: finalize writes the page (every section, in order) before ``summary.json``,
    and warns of nothing; ``znni report`` on it writes the page too.  A report that fails is one
    warning line, and the run whose every task checked out is finalized all the same."""
    from znni_core.pipeline import finalize as F
    from znni_core.pipeline.report import write_report

    rf = prepare(base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 2]))
    run = load_run(rf)
    work = Path(run.work_dir)
    report = work / "report"
    assert _run_jobs(rf, 4, work / "logs" / "jobs", range(4)) == {}
    seen, real = [], F.write_report

    def spy(*a, **kw):
        seen.append((report / "summary.json").exists())
        return real(*a, **kw)

    monkeypatch.setattr(F, "write_report", spy)
    lines = []
    assert finalize(rf, log=lines.append)["failed"] == [] and (report / "summary.json").is_file()
    assert seen == [False] and not [line for line in lines if "warning" in line or "report" in line], lines
    doc = json.loads((report / "report.json").read_text())
    assert doc["written_by"] == "znni finalize" and doc["outcome"] == "complete" and doc["notes"] == [], doc["notes"]
    ids = re.findall(r'<section id="?(\w+)', (report / "report.html").read_text())
    assert ids == ["outcome", "failures", "jobs", "cost", "previews", "summary", "config"], ids
    # `znni report` on the finished run: its own page (no summary: that is finalize's)
    path = write_report(work, log=lines.append)
    doc = json.loads((report / "report.json").read_text())
    assert doc["written_by"] == "znni report" and doc["outcome"] == "complete" and doc["notes"] == [], doc["notes"]
    ids = re.findall(r'<section id="?(\w+)', path.read_text())
    assert ids == ["outcome", "failures", "jobs", "cost", "previews", "config"], ids

    def broken(*a, **kw):
        raise RuntimeError("a bug in the report\nits second line")

    monkeypatch.setattr(F, "write_report", broken)
    (report / "summary.json").unlink()
    lines.clear()
    assert finalize(rf, log=lines.append)["failed"] == [] and (report / "summary.json").is_file()
    warnings = [line for line in lines if "warning" in line]
    assert warnings == [
        "finalize: warning: the report was not written (RuntimeError: a bug in the report); the run is done"
    ]


def test_the_report_counts_what_the_tasks_read_and_wrote_against_the_prediction(tmp_path, monkeypatch):
    """Each task's manifest records the input chunks its read fetched: the report's sum equals the
    chunk fetches counted at the reader, the read amplification is the voxels read over the region's
    unique input, beside the prediction the first job recorded (``znni estimate``'s count)."""
    from znni_core.io.precomputed import PrecomputedLayer

    rf = prepare(base_config(tmp_path, vol=em((8, 32, 32)), task_chunks=[1, 1, 1]))
    run = load_run(rf)
    work = Path(run.work_dir)
    fetched = []
    real = PrecomputedLayer._stored

    def spy(self, index):
        if str(self.url).rstrip("/").endswith("/em"):  # the input, not the output's read-back
            fetched.append(tuple(index))
        return real(self, index)

    monkeypatch.setattr(PrecomputedLayer, "_stored", spy)
    from znni_core.pipeline.run import run_geometry

    n = len(run_geometry(run)[3])
    per = 3  # jobs of 3 consecutive tasks: a job fetches the chunks they share once (its cache)
    assert _run_jobs(rf, per, work / "logs" / "jobs", range(-(-n // per))) == {}
    monkeypatch.setattr(PrecomputedLayer, "_stored", real)
    summary = finalize(rf, log=lambda *a: None)
    reads = json.loads((work / "report" / "report.json").read_text())["cost"]["reads"]
    assert reads["chunk_reads"] == len(fetched) > 0 and reads["tasks"] == summary["tasks"]
    assert reads["bytes_read"] == reads["voxels_read"]  # one uint8 channel
    assert reads["amplification"] == pytest.approx(reads["voxels_read"] / reads["unique_voxels"])
    assert reads["amplification"] > 1  # tasks of different jobs read each other's halo chunks again
    assert len(set(fetched)) < len(fetched) < n * 8  # no chunk fetched by each of its 8 readers
    # every task done, no mask: what znni estimate predicted is what the tasks read
    assert reads["predicted_chunk_reads"] == reads["chunk_reads"]
    assert reads["predicted_amplification"] == pytest.approx(reads["amplification"])
    assert reads["objects_written"] == summary["chunks_written"] + summary["tasks"]
    assert "read amplification" in (work / "report" / "report.html").read_text()
