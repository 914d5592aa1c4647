"""Done means done for this run (docs/reliability.md, T29, T30): a finished run re-run in the same
work directory after a change that alters output values is refused before anything is scheduled,
naming the change, or (``recompute: changed``) its tasks are made again and the output equals a
fresh run of the new settings byte for byte; input objects changed in place behind a finished run
are found from the versions each task recorded, and ``recompute: inputs`` makes exactly those
tasks again.  Changes that cannot alter a byte (job sizes, the check's sampling) are no change.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import ConfigError
from znni_core.io import read_manifest
from znni_core.pipeline.identity import changed_inputs, check_rerun, previous_identity
from znni_core.pipeline.jobs import run_job
from znni_core.pipeline.resolve import resolve
from znni_core.pipeline.run import load_run, save_run
from znni_core.pipeline.task import manifest_path, open_run

from .pipeline_helpers import base_config, em, layer_files, write_volume
from .test_pipeline import prepare

QUIET = dict(log=lambda *a: None)
VOL = (8, 32, 32)


def _finished(tmp_path, vol=None, **over):
    """A run made and finished in ``tmp_path`` (every task through ``run_job``): (config, run file)."""
    cfg = base_config(tmp_path, vol=em(VOL) if vol is None else vol, **over)
    rf = prepare(cfg)
    run_job(rf, 0, load_run(rf).num_tasks, **QUIET)
    return cfg, rf


def _revalidate(cfg):
    """What ``znni validate`` does with a changed config in the same work_dir: the new run and
    what changed (a ConfigError when refused)."""
    run, plan = resolve(cfg, mem_mb=2000, threads=1, progress=lambda *a: None)
    return run, plan, check_rerun(previous_identity(run.work_dir), run, run.config.recompute)


def _inverted_layer(tmp_path):
    """Another layer of the same geometry: the EM inverted."""
    return write_volume(tmp_path / "em_inverted", 255 - em(VOL))


CHANGES = {
    "normalize.shift": (lambda c, t: c["normalize"].update(shift=0.5), "science.normalize.shift 0.0 -> 0.5"),
    "input.path": (lambda c, t: c["input"].update(path=_inverted_layer(t)), "input.url"),
    "edge": (lambda c, t: c.update(edge="zero"), 'science.edge "mirror" -> "zero"'),
    "input.empty": (lambda c, t: c["input"].update(empty="compute"), "science.input.empty"),
    "tta": (lambda c, t: c.update(tta={"flips": ["x"]}), "science.tta.flips"),
    "network weights": (lambda c, t: _reweight(c), "network "),
}


def _reweight(cfg):
    """The same network file, other weights (a retrained model saved over the old one)."""
    from znni_core.net import save_network

    from .nets import make_net
    from .pipeline_helpers import SMALL_NET

    save_network(make_net(SMALL_NET, seed=7), cfg["network"]["path"])


@pytest.mark.parametrize("what", sorted(CHANGES))
def test_a_changed_run_is_refused_naming_the_change(tmp_path, what):
    cfg, rf = _finished(tmp_path, edge="mirror")
    before = layer_files(cfg["output"]["path"])
    manifests = {p: p.read_bytes() for p in (Path(cfg["work_dir"]) / "manifests").rglob("*.json")}
    new = copy.deepcopy(cfg)
    change, named = CHANGES[what]
    change(new, tmp_path)
    with pytest.raises(ConfigError) as e:
        _revalidate(new)
    msg = str(e.value)
    assert named in msg and "holds finished tasks of another run" in msg, msg
    assert "recompute: changed" in msg and "new work_dir" in msg and "\n" not in msg
    assert layer_files(cfg["output"]["path"]) == before
    assert {p: p.read_bytes() for p in manifests} == manifests


def test_changes_that_cannot_alter_a_byte_are_no_change(tmp_path):
    cfg, rf = _finished(tmp_path)
    new = copy.deepcopy(cfg)
    new["jobs"] = {"tasks_per_job": 3, "minutes": 5}
    new["verify_voxels"] = 0
    new["finalize"] = {"verify": "exists"}
    new["downsample"] = {"mips": 1}  # a pyramid added to a finished run: made from mip 0 as it is
    run, _, changed = _revalidate(new)
    assert changed == [] and run.digest == load_run(rf).digest
    assert len(run.output.info["scales"]) == 2 and len(load_run(rf).output.info["scales"]) == 1


def _inference_entries(cfg) -> list:
    prov = json.loads((Path(cfg["output"]["path"]) / "provenance").read_text())
    return [e for e in prov["processing"] if e["method"]["task"] == "znni inference"]


def test_provenance_only_for_what_a_run_produced(tmp_path):
    """A finalize run again, or after a change that alters no byte, adds no entry; a recompute
    under new settings adds one, naming them."""
    from znni_core.pipeline.finalize import finalize

    cfg, rf = _finished(tmp_path)
    finalize(rf, **QUIET)
    assert len(_inference_entries(cfg)) == 1
    finalize(rf, **QUIET)
    new = copy.deepcopy(cfg)
    new["verify_voxels"] = 0
    run, plan, changed = _revalidate(new)
    save_run(run, plan, Path(run.work_dir))
    assert changed == [] and run_job(rf, 0, run.num_tasks, **QUIET)["ran"] == []
    finalize(rf, **QUIET)
    assert len(_inference_entries(cfg)) == 1
    new["normalize"]["shift"] = 0.5
    new["recompute"] = "changed"
    run, plan, changed = _revalidate(new)
    save_run(run, plan, Path(run.work_dir))
    run_job(rf, 0, run.num_tasks, **QUIET)
    finalize(rf, **QUIET)
    entries = _inference_entries(cfg)
    assert len(entries) == 2 and entries[-1]["method"]["normalize"]["shift"] == 0.5
    assert entries[-1]["run_digest"] == run.digest != entries[0]["run_digest"]


def test_the_done_check_never_takes_another_runs_task(tmp_path):
    """Even without validate's refusal (a run.json replaced by hand), a task whose manifest names
    another run's digest is not done: the job makes it again."""
    cfg, rf = _finished(tmp_path)
    new = copy.deepcopy(cfg)
    new["normalize"]["shift"] = 0.25
    run, plan = resolve(new, mem_mb=2000, threads=1, progress=lambda *a: None)
    save_run(run, plan, Path(run.work_dir))
    doc = run_job(rf, 0, run.num_tasks, **QUIET)
    assert len(doc["ran"]) == run.num_tasks and doc["skipped"] == []


@pytest.mark.parametrize("what", ["normalize.shift", "input.path"])
def test_recompute_changed_equals_a_fresh_run(tmp_path, what):
    cfg, rf = _finished(tmp_path / "a", edge="mirror")
    new = copy.deepcopy(cfg)
    CHANGES[what][0](new, tmp_path)
    new["recompute"] = "changed"
    run, plan, changed = _revalidate(new)
    assert changed and any(c.startswith(CHANGES[what][1]) for c in changed), changed
    save_run(run, plan, Path(run.work_dir))
    doc = run_job(rf, 0, run.num_tasks, **QUIET)
    assert len(doc["ran"]) == run.num_tasks and doc["skipped"] == []
    # the same settings in a new work_dir and output
    fresh = copy.deepcopy(new)
    fresh.update(work_dir=str(tmp_path / "fresh" / "work"), recompute="none")
    fresh["output"] = dict(fresh["output"], path=str(tmp_path / "fresh" / "out"))
    frf = prepare(fresh)
    run_job(frf, 0, load_run(frf).num_tasks, **QUIET)
    got, want = layer_files(cfg["output"]["path"]), layer_files(fresh["output"]["path"])
    assert got == want and len(got) >= 4
    # the old output differed (the change is real), and a second re-run is done
    assert run_job(rf, 0, run.num_tasks, **QUIET)["ran"] == []


def _overwrite_input_chunk(cfg, vol):
    """Replace one input chunk in place (same name, new bytes); returns its name."""
    from znni_core.io import open_input, parse_layer_url

    inp = open_input(parse_layer_url(cfg["input"]["path"]), 0)
    idx = next(iter(inp.grid.chunks_in(inp.bounds)))
    arr = np.ascontiguousarray(255 - vol[None][(slice(None),) + inp.grid.chunk_roi(idx).to_slices()])
    inp.write_chunk(idx, arr)
    return inp.chunk_name(idx)


def test_input_changed_in_place_is_found_and_recomputed_exactly(tmp_path):
    vol = em((8, 48, 48))  # 3 x 3 input chunks in y, x: a corner chunk is read by some tasks only
    cfg, rf = _finished(tmp_path / "a", vol=vol)
    run = load_run(rf)
    m0 = read_manifest(manifest_path(run, 0))
    assert m0["input_versions"] and all(v for v in m0["input_versions"].values())
    name = _overwrite_input_chunk(cfg, vol)
    ctx = open_run(rf)
    stale = [b.id for b in ctx.tasks if changed_inputs(ctx.inp, read_manifest(manifest_path(run, b.id)))]
    readers = [b.id for b in ctx.tasks if name in read_manifest(manifest_path(run, b.id))["input_versions"]]
    assert stale == readers and 0 < len(stale) < run.num_tasks
    # nothing else changed: the default resume skips everything; recompute: inputs makes exactly those
    assert run_job(rf, 0, run.num_tasks, **QUIET)["ran"] == []
    new = dict(cfg, recompute="inputs")
    r2, plan, changed = _revalidate(new)
    assert changed == []
    save_run(r2, plan, Path(r2.work_dir))
    doc = run_job(rf, 0, r2.num_tasks, **QUIET)
    assert sorted(t["task"] for t in doc["ran"]) == stale
    # equal to a fresh run over the changed input
    fresh = copy.deepcopy(cfg)
    fresh.update(work_dir=str(tmp_path / "fresh" / "work"))
    fresh["output"] = dict(fresh["output"], path=str(tmp_path / "fresh" / "out"))
    frf = prepare(fresh)
    run_job(frf, 0, load_run(frf).num_tasks, **QUIET)
    assert layer_files(cfg["output"]["path"]) == layer_files(fresh["output"]["path"])


def test_status_counts_another_runs_tasks_as_not_done(tmp_path):
    """``znni status``: a manifest of another run is not a done task (it says so and how)."""
    from typer.testing import CliRunner

    from znni_core.cli import app

    cfg, rf = _finished(tmp_path)
    n = load_run(rf).num_tasks
    r = CliRunner().invoke(app, ["status", str(rf)])
    assert r.exit_code == 0 and r.output.startswith(f"{n} of {n} tasks done; not done: []"), r.output
    new = copy.deepcopy(cfg)
    new["normalize"]["shift"] = 0.5
    new["recompute"] = "changed"
    run, plan, _ = _revalidate(new)
    save_run(run, plan, Path(run.work_dir))
    r = CliRunner().invoke(app, ["status", str(rf)])
    assert r.output.startswith(f"0 of {n} tasks done; not done: []; made by another run"), r.output
    assert str(list(range(n))) in r.output


def test_status_check_inputs_lists_the_changed_tasks(tmp_path):
    from typer.testing import CliRunner

    from znni_core.cli import app

    vol = em(VOL)
    cfg, rf = _finished(tmp_path)
    r = CliRunner().invoke(app, ["status", str(rf), "--check-inputs"])
    assert r.exit_code == 0 and "0 done task(s) read input objects that changed" in r.output, r.output
    _overwrite_input_chunk(cfg, vol)
    r = CliRunner().invoke(app, ["status", str(rf), "--check-inputs"])
    assert r.exit_code == 1 and "input object(s) changed since it ran" in r.output, r.output
    assert "recompute: inputs" in r.output


@pytest.mark.slow  # three Snakemake runs (~40 s on 2 idle cores)
def test_the_workflow_refuses_a_changed_rerun_then_recomputes_it(tmp_path):
    """Through Snakemake as users run it: ``validate``'s outputs are deleted before it runs, so
    the identity it compares with lives beside them (identity.json).  The refusal shows on
    Snakemake's stderr, again on the same command; nothing is written, not even provenance;
    ``--config recompute=changed``
    then gives the bytes of a fresh run of the new settings."""
    import yaml

    from .test_workflow import snakemake, write_config

    vol = em((12, 40, 40))
    cfg, path = write_config(tmp_path, "a", vol, jobs={"tasks_per_job": 6})
    snakemake(tmp_path, path)
    out = Path(cfg["output"]["path"])
    before, prov = layer_files(str(out)), (out / "provenance").read_bytes()
    cfg["normalize"]["shift"] = 0.5
    path.write_text(yaml.safe_dump(cfg))
    p = snakemake(tmp_path, path, check=False)
    assert p.returncode != 0
    assert "znni: validate.log: error: work_dir" in p.stderr and "science.normalize.shift 0.0 -> 0.5" in p.stderr
    assert layer_files(str(out)) == before and (out / "provenance").read_bytes() == prov
    # the same command again (Snakemake deleted validate's outputs when it failed): refused again,
    # never "nothing to be done" over the other settings' report
    p = snakemake(tmp_path, path, check=False)
    assert p.returncode != 0 and "Nothing to be done" not in p.stdout + p.stderr
    assert "znni summary: validate refused the run" in p.stderr and "skipped (already done)" not in p.stderr
    p = snakemake(tmp_path, path, "--config", "recompute=changed")
    n = json.loads((Path(cfg["work_dir"]) / "run.json").read_text())["num_tasks"]
    assert f"{n} done now, 0 skipped" in p.stderr, p.stderr[-2000:]
    fresh = copy.deepcopy(cfg)
    fresh.update(work_dir=str(tmp_path / "fresh" / "work"))
    fresh["output"] = dict(fresh["output"], path=str(tmp_path / "fresh" / "out"))
    frf = prepare(fresh)
    run_job(frf, 0, load_run(frf).num_tasks, **QUIET)
    got = layer_files(str(out))
    assert got == layer_files(fresh["output"]["path"]) and got != before


def test_a_mask_changed_in_place_is_found_too(tmp_path):
    """The mask is an input: its objects' versions are recorded per task and checked alike."""
    vol = em(VOL)
    mask = np.ones(VOL, np.uint8)
    cfg = base_config(tmp_path, vol=vol)
    cfg["mask"] = {"path": write_volume(tmp_path / "mask", mask)}
    rf = prepare(cfg)
    from znni_core.pipeline.inspect_commands import _changed_input_tasks  # what `znni status --check-inputs` lists
    from znni_core.pipeline.mask import mask_tasks_path, scan

    ctx = open_run(rf)
    mask_tasks_path(ctx.run).write_text(json.dumps(scan(ctx.tasks, ctx.mask) | {"run_digest": ctx.run.digest}))
    run_job(rf, 0, ctx.run.num_tasks, **QUIET)
    run = load_run(rf)
    blocks = list(ctx.tasks)
    assert all(read_manifest(manifest_path(run, b.id))["mask_versions"] for b in blocks)
    assert _changed_input_tasks(run, blocks) == []
    m = open_run(rf).mask.layer
    idx = next(iter(m.grid.chunks_in(m.bounds)))
    m.write_chunk(idx, np.zeros((1,) + tuple(m.grid.chunk_roi(idx).shape), np.uint8))
    stale = _changed_input_tasks(run, blocks)
    assert stale and all(any(c.startswith("mask ") for c in changed) for _, changed in stale)
