"""Masks (pipeline/mask.py): which mask voxels lie under an input box, checked against an upsampled
mask on a common grid; a masked run computes and writes exactly the chunks a non-zero mask voxel
overlaps, equal to whole-volume inference there; masked tasks and chunks are recorded as such."""

from __future__ import annotations

import json
import math
from functools import reduce

import numpy as np
import pytest
from typer.testing import CliRunner

from znni_core.cli import app
from znni_core.errors import ConfigError
from znni_core.geometry import Roi
from znni_core.io import PrecomputedLayer, open_input, parse_layer_url
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.jobs import run_job
from znni_core.pipeline.mask import Mask, live_chunks, mask_tasks_path, positions, scan
from znni_core.pipeline.run import load_run, run_geometry
from znni_core.pipeline.task import RunContext, manifest_path, open_run, run_task

from .pipeline_helpers import RES, base_config, em, write_volume
from .test_pipeline import QUIET, prepare, read_out, reference


def fine_reference(mask_vol, mask_offset, mask_res, in_res, roi: Roi) -> bool:
    """Is a non-zero mask voxel under ``roi`` (input voxels)?  Both grids upsampled to their common
    integer grid (gcd of the resolutions per axis) and compared voxel by voxel there."""
    fine = mask_vol != 0
    sl = []
    for ax in range(3):
        g = math.gcd(int(mask_res[ax]), int(in_res[ax]))
        fm, fi = int(mask_res[ax]) // g, int(in_res[ax]) // g
        fine = np.repeat(fine, fm, axis=ax)
        lo = roi.begin[ax] * fi - mask_offset[ax] * fm
        hi = roi.end[ax] * fi - mask_offset[ax] * fm
        sl.append(slice(max(lo, 0), max(hi, 0)))
    return bool(fine[tuple(sl)].any())


@pytest.mark.parametrize("mask_res", [(40.0, 16.0, 16.0), (40.0, 12.0, 20.0), (80.0, 4.0, 8.0)])
def test_mask_voxels_under_a_box_equal_the_upsampled_mask(tmp_path, mask_res):
    rng = np.random.default_rng(1)
    shape, offset = (5, 9, 11), (1, 2, 3)
    vol = (rng.random(shape) < 0.05).astype(np.uint8)
    url = write_volume(tmp_path / "m", vol, chunk=(2, 4, 4), resolution=mask_res)
    info = json.loads((tmp_path / "m" / "info").read_text())  # move the mask to voxel_offset (x, y, z)
    info["scales"][0]["voxel_offset"] = list(offset[::-1])
    (tmp_path / "m" / "info").write_text(json.dumps(info))
    for p in (tmp_path / "m" / "k").iterdir():  # rename the chunks to the shifted grid
        (x, y, z) = [tuple(int(v) for v in r.split("-")) for r in p.name.split("_")]
        p.rename(
            p.with_name(
                f"{x[0] + offset[2]}-{x[1] + offset[2]}_{y[0] + offset[1]}-{y[1] + offset[1]}_"
                f"{z[0] + offset[0]}-{z[1] + offset[0]}"
            )
        )
    layer = open_input(parse_layer_url(url))
    assert tuple(layer.bounds.offset) == offset
    mask = Mask(layer, RES)
    lo = [int(o * r / i) - 3 for o, r, i in zip(offset, mask_res, RES)]
    hi = [int((o + n) * r / i) + 2 for o, n, r, i in zip(offset, shape, mask_res, RES)]
    hits = 0
    for _ in range(300):
        b = rng.integers(lo, hi)  # around the mask, in input voxels
        s = rng.integers(1, 6, 3)
        roi = Roi(tuple(int(v) for v in b), tuple(int(v) for v in s))
        arr, box = mask.read(roi)
        got = bool(mask.under(arr, box, roi).any())
        assert got == fine_reference(vol, offset, mask_res, RES, roi), roi
        hits += got
    assert 15 < hits < 285  # both answers were exercised


def _masked_case(tmp_path, **over):
    vol = em((12, 48, 48))
    cfg = base_config(tmp_path, vol=vol, **over)
    # a mask at half the input's x-y resolution: a disc plus a far corner; zero elsewhere
    mres = (RES[0], RES[1] * 2, RES[2] * 2)
    m = np.zeros((12, 24, 24), np.uint8)
    zz, yy, xx = np.mgrid[:12, :24, :24]
    m[(yy - 9) ** 2 + (xx - 8) ** 2 < 20] = 1
    m[:3, 20:, 20:] = 255
    cfg["mask"] = {"path": write_volume(tmp_path / "mask", m, chunk=(4, 8, 8), resolution=mres), "mip": 0}
    return cfg, vol, m, mres


def test_masked_run_computes_exactly_the_chunks_the_mask_overlaps(tmp_path):
    cfg, vol, m, mres = _masked_case(tmp_path)
    rf = prepare(cfg)
    run = load_run(rf)
    assert run.mask.resolution == list(mres)
    ctx = open_run(rf)
    with pytest.raises(ConfigError, match="mask-tasks"):  # the checkpoint's list is required
        finalize(rf, log=lambda *a: None)
    doc = scan(ctx.tasks, ctx.mask) | {"run_digest": run.digest}
    mask_tasks_path(run).write_text(json.dumps(doc))

    _, grid, _, tasks = run_geometry(run)
    region = tasks.region

    def naive_live(roi):
        return fine_reference(m, (0, 0, 0), mres, RES, roi.intersect(region))

    want_live = [k for k, b in enumerate(tasks) if naive_live(b.write_roi)]
    assert positions(doc) == want_live
    assert 0 < doc["num_live"] < doc["num_tasks"] and doc["num_masked"] == doc["num_tasks"] - doc["num_live"]
    live_chunk_set = {tuple(i) for b in tasks for i in b.chunks if naive_live(grid.chunk_roi(i))}
    assert doc["chunks_live"] == len(live_chunk_set)

    per = 2
    for j in range(math.ceil(doc["num_live"] / per)):
        marker = run_job(rf, j, per, doc["num_live"], log=lambda *a: None)
        assert marker["tasks"] == [tasks[k].id for k in want_live[j * per : (j + 1) * per]]
    got, layer = read_out(rf)
    ref = reference(cfg, vol)
    partial = 0
    for k, b in enumerate(tasks):
        mp = manifest_path(run, b.id)
        if k not in want_live:
            assert not mp.exists()  # masked tasks never run
            continue
        man = json.loads(mp.read_text())
        statuses = {tuple(c["index"]): c["status"] for c in man["chunks"]}
        for idx in b.chunks:
            cr = grid.chunk_roi(idx).intersect(region)
            sl = (slice(None),) + cr.to_slices(region.offset)
            if tuple(idx) in live_chunk_set:
                assert statuses[tuple(idx)] == "written"
                np.testing.assert_allclose(got[sl], ref[sl], rtol=1e-5, atol=1e-6)
            else:
                assert statuses[tuple(idx)] == "masked"
                assert layer.read_chunk_bytes(tuple(idx)) is None
        # only the box of the live chunks was computed
        live_rois = [grid.chunk_roi(i) for i in b.chunks if tuple(i) in live_chunk_set]
        assert man["voxels"] == reduce(Roi.union, live_rois).intersect(region).size
        partial += man["voxels"] < b.write_roi.intersect(region).size
    assert partial
    s = finalize(rf, log=print)
    assert s["tasks_masked"] == doc["num_masked"] and s["done"] == doc["num_live"] and not s["failed"]
    assert s["chunks_written"] == len(live_chunk_set) and s["chunks_masked"] > 0
    # `znni status` counts the wholly masked tasks as masked, not as "not done"
    from typer.testing import CliRunner

    from znni_core.cli import app

    out = CliRunner().invoke(app, ["status", str(rf)]).output
    assert out.startswith(
        f"{doc['num_live']} of {doc['num_tasks']} tasks done, {doc['num_masked']} masked (the mask is 0 over them: "
        "never run); not done: []"
    ), out


def test_masked_chunk_rerun_and_a_masked_task_run_by_hand(tmp_path):
    cfg, vol, m, mres = _masked_case(tmp_path)
    rf = prepare(cfg)
    ctx = open_run(rf)
    run = ctx.run
    masked_k = next(
        k for k in range(len(ctx.tasks)) if not live_chunks(ctx.mask, ctx.grid, ctx.region, ctx.tasks[k].chunks)
    )
    b = ctx.tasks[masked_k]
    man = run_task(rf, b.id, ctx=ctx, **QUIET)  # by hand: recorded, nothing computed or written
    assert {c["status"] for c in man["chunks"]} == {"masked"} and man["voxels"] == 0
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    assert all(layer.read_chunk_bytes(tuple(i)) is None for i in b.chunks)


def test_a_mask_that_misses_the_region_is_refused_at_validate(tmp_path):
    cfg, vol, m, mres = _masked_case(tmp_path)
    cfg["mask"]["mip"] = 0
    info_p = tmp_path / "mask" / "info"
    info = json.loads(info_p.read_text())
    info["scales"][0]["voxel_offset"] = [1000, 1000, 0]
    info_p.write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="covers none of the region"):
        prepare(cfg)


def test_mask_tasks_cli_writes_the_checkpoint_list(tmp_path):
    cfg, vol, m, mres = _masked_case(tmp_path)
    rf = prepare(cfg)
    r = CliRunner().invoke(app, ["mask-tasks", str(rf)])
    assert r.exit_code == 0, r.output
    doc = json.loads(mask_tasks_path(load_run(rf)).read_text())
    assert doc["run_digest"] == load_run(rf).digest and "masked" in r.output
    ctx = open_run(rf)
    assert doc["live"] == scan(ctx.tasks, ctx.mask)["live"]
    assert isinstance(ctx, RunContext)


def test_estimate_counts_only_the_live_work(tmp_path):
    from znni_core.pipeline.estimate import run_estimate

    cfg, vol, m, mres = _masked_case(tmp_path)
    whole = run_estimate(
        {k: v for k, v in cfg.items() if k != "mask"},
        mem_mb=2000,
        threads=1,
        rate=1e5,
        cores_per_node=2,
        log=lambda *a: None,
    )
    e = run_estimate(cfg, mem_mb=2000, threads=1, rate=1e5, cores_per_node=2, log=lambda *a: None)
    rf = prepare(cfg)
    ctx = open_run(rf)
    doc = scan(ctx.tasks, ctx.mask)
    assert e["tasks"] == doc["num_live"] < whole["tasks"] == doc["num_tasks"]
    assert e["masked_tasks"] == doc["num_masked"] and e["chunks"] == doc["chunks_live"] < whole["chunks"]
    assert e["voxels"] == doc["voxels_live"] < whole["voxels"]
    assert e["job_hours"] == pytest.approx(whole["job_hours"] * doc["voxels_live"] / whole["voxels"])
