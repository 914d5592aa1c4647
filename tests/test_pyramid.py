"""The pyramid (``downsample.mips``): mips built by znni's tasks of whole shards/chunks equal
igneous' pyramid of the same mip 0 (igneous as the independent reference), are read alike by
cloud-volume and tensorstore, come out identical sharded, unsharded and in zarr, re-run only what
does not verify, and are refused at plan time when they could not be exact.  A pyramid reads only
what the manifests below record (an absent chunk or an incomplete mip 0 is refused, naming it;
empty and masked chunks are 0), pins it, and is stale above a mip-0 task re-run since."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from znni_core.cli import app
from znni_core.errors import ConfigError, DataError
from znni_core.geometry import Coordinate, Roi
from znni_core.io import PrecomputedLayer, parse_layer_url
from znni_core.io.zarr_output import ZarrOutput
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.mask import mask_tasks_path, positions, scan
from znni_core.pipeline.pyramid import build_pyramid, downsample, pyramid_status, run_pyramid_job
from znni_core.pipeline.run import load_run, output_spec, run_geometry
from znni_core.pipeline.schedule import mip_tasks
from znni_core.pipeline.task import manifest_path, open_run, run_task

from .pipeline_helpers import RES, base_config, em, layer_files, write_volume
from .test_pipeline import prepare, run_all

QUIET = {"log": lambda *a: None}
OUT = {"chunk_size": [4, 16, 16]}


def naive_downsample(a, f, integer):
    """Block means by loops over every output voxel (partial last blocks: the voxels they have)."""
    n = [-(-s // k) for s, k in zip(a.shape[1:], f)]
    y = np.zeros((a.shape[0],) + tuple(n))
    for c, i, j, k in itertools.product(range(a.shape[0]), *(range(m) for m in n)):
        blk = a[c, i * f[0] : (i + 1) * f[0], j * f[1] : (j + 1) * f[1], k * f[2] : (k + 1) * f[2]].astype(np.float64)
        y[c, i, j, k] = np.floor(blk.mean()) if integer else blk.mean()
    return y


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("shape,f", [((5, 9, 7), (1, 2, 2)), ((6, 8, 8), (2, 2, 2)), ((3, 5, 6), (1, 3, 4))])
def test_downsample_equals_the_naive_block_mean(shape, f, dtype):
    rng = np.random.default_rng(0)
    a = (rng.random((2,) + shape) * 255).astype(dtype)
    got = downsample(a, f, dtype)
    want = naive_downsample(a, f, dtype == "uint8")
    assert got.dtype == np.dtype(dtype) and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)


def run_pyramid(tmp_path, name="p", mips=2, output=None, **over):
    cfg = base_config(
        tmp_path / name, vol=em((12, 70, 70)), output={**OUT, **(output or {})}, downsample={"mips": mips}, **over
    )
    rf = prepare(cfg)
    run_all(rf)
    return load_run(rf)


def read_mip(run, k):
    url = parse_layer_url(run.output.url)
    layer = ZarrOutput(url, output_spec(run, k)) if url.format == "zarr" else PrecomputedLayer(url, k)
    return layer.read(layer.bounds, fill_missing=True)[0], layer


def igneous_pyramid(run, tmp_path, mips):
    """igneous' own mips 1..N of a copy of the run's (unsharded) mip 0."""
    from igneous import task_creation
    from taskqueue import LocalTaskQueue

    src = parse_layer_url(run.output.url).local_path
    dst = tmp_path / "igneous"
    info = json.loads((src / "info").read_text())
    key = info["scales"][0]["key"]
    info["scales"] = info["scales"][:1]
    shutil.copytree(src / key, dst / key)
    (dst / "info").write_text(json.dumps(info))
    tq = LocalTaskQueue(parallel=1, progress=False)
    tq.insert(
        task_creation.create_downsampling_tasks(
            "file://" + str(dst),
            mip=0,
            num_mips=mips,
            factor=tuple(run.config.downsample.factor)[::-1],
            fill_missing=True,
            compress=False,
            delete_black_uploads=False,
        )
    )
    tq.execute(progress=False)
    return parse_layer_url(str(dst))


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """An unsharded run with two mips, built by `znni pyramid`'s code path."""
    tmp = tmp_path_factory.mktemp("pyr")
    run = run_pyramid(tmp)
    rec = build_pyramid(run, **QUIET)
    return tmp, run, rec


def test_pyramid_equals_igneous_of_the_same_mip0(plain):
    pytest.importorskip("igneous", reason="the dev extra installs igneous (the reference)")
    import tensorstore as ts

    tmp, run, rec = plain
    assert [m["mip"] for m in rec["mips"]] == [1, 2] and (Path(run.work_dir) / "pyramid.json").is_file()
    ref = igneous_pyramid(run, tmp, 2)
    full, mip0 = read_mip(run, 0)
    assert tuple(mip0.bounds.offset) == (0, 0, 0) and full.any()
    for k in (1, 2):
        got, layer = read_mip(run, k)
        want_layer = PrecomputedLayer(ref, k)
        assert want_layer.bounds == layer.bounds
        want = want_layer.read(want_layer.bounds, fill_missing=True)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # and from mip 0 directly: k mips of 2 x 2 are one mean of 2^k x 2^k
        np.testing.assert_allclose(got, naive_downsample(full, (1, 2**k, 2**k), False), rtol=1e-5, atol=1e-6)
    # tensorstore reads the same mip 2 from the raw chunks
    mip2 = PrecomputedLayer(parse_layer_url(run.output.url), 2)
    t = ts.open(
        {
            "driver": "neuroglancer_precomputed",
            "scale_index": 2,
            "kvstore": "file://" + str(parse_layer_url(run.output.url).local_path),
        }
    ).result()
    b, e = mip2.bounds.begin.xyz(), mip2.bounds.end.xyz()
    arr = np.asarray(t[b[0] : e[0], b[1] : e[1], b[2] : e[2], :].read().result()).transpose(3, 2, 1, 0)
    np.testing.assert_array_equal(arr, read_mip(run, 2)[0])


def test_uint8_pyramid_rounds_down_as_igneous_does(tmp_path):
    pytest.importorskip("igneous", reason="the dev extra installs igneous (the reference)")
    run = run_pyramid(tmp_path, mips=1, output={"dtype": "uint8"})
    build_pyramid(run, **QUIET)
    ref = PrecomputedLayer(igneous_pyramid(run, tmp_path, 1), 1)
    got, layer = read_mip(run, 1)
    assert got.dtype == np.uint8 and ref.bounds == layer.bounds
    np.testing.assert_array_equal(got, ref.read(ref.bounds, fill_missing=True)[0])


def test_pyramid_reruns_only_what_does_not_verify(plain):
    tmp, run, _ = plain
    logs = []
    rec = build_pyramid(run, log=logs.append)
    assert [m["run_now"] for m in rec["mips"]] == [0, 0]
    url = parse_layer_url(run.output.url)
    mip1 = PrecomputedLayer(url, 1)
    chunk = next(p for p in (url.local_path / mip1.key).iterdir())
    before = {p.name: p.read_bytes() for p in (url.local_path / mip1.key).iterdir()}
    chunk.write_bytes(b"\0" * len(before[chunk.name]))  # a torn chunk of mip 1
    rec = build_pyramid(run, **QUIET)
    assert rec["mips"][0]["run_now"] == 1 and rec["mips"][1]["run_now"] == 0
    assert {p.name: p.read_bytes() for p in (url.local_path / mip1.key).iterdir()} == before


def test_pyramid_jobs_split_a_mip_and_write_markers(plain, tmp_path):
    _, ref_run, _ = plain
    run = run_pyramid(tmp_path, mips=1)
    rf = Path(run.work_dir) / "run.json"
    n = len(mip_tasks(output_spec(run, 1), run.config.task_chunks))
    assert n > 5
    docs = [run_pyramid_job(rf, 1, j, 5, **QUIET) for j in range(-(-n // 5))]
    assert [len(d["ran"]) for d in docs] == [5] * (n // 5) + ([n % 5] if n % 5 else [])
    assert (Path(run.work_dir) / "pyramid/mip1/000001.json").is_file()
    # each run plans (and may pick another primitive: mip 0 equal to ~1 ulp): bitwise against its own mip 0
    np.testing.assert_array_equal(read_mip(run, 1)[0], downsample(read_mip(run, 0)[0], (1, 2, 2), "float32"))
    np.testing.assert_allclose(read_mip(run, 1)[0], read_mip(ref_run, 1)[0], rtol=1e-5, atol=1e-6)


def test_sharded_and_zarr_pyramids_equal_the_unsharded_one(plain, tmp_path):
    """Each mip is exactly the block mean of the mip below it as stored, and equals the unsharded
    run's (to the last bits of mip 0, which another run's plan may change)."""
    import tensorstore as ts

    _, ref_run, _ = plain
    sharded = run_pyramid(tmp_path, "s", output={"sharding": "sharded", "shard_bytes": 4 * 16 * 16 * 4 * 4})
    zarr = run_pyramid(tmp_path, "z", output={"path": str(tmp_path / "z" / "out.zarr")}, task_chunks=[1, 2, 2])
    for run in (sharded, zarr):
        build_pyramid(run, **QUIET)
        for k in (1, 2):
            got, layer = read_mip(run, k)
            assert layer.sharded
            np.testing.assert_array_equal(got, downsample(read_mip(run, k - 1)[0], (1, 2, 2), "float32"))
            np.testing.assert_allclose(got, read_mip(ref_run, k)[0], rtol=1e-5, atol=1e-6)
    url = parse_layer_url(sharded.output.url)
    mip2 = PrecomputedLayer(url, 2)
    assert mip2.sharded and {p.suffix for p in (url.local_path / mip2.key).iterdir()} == {".shard"}
    # tensorstore reads the zarr mips through the OME group's arrays; the group lists every mip
    root = parse_layer_url(zarr.output.url).local_path
    ome = json.loads((root / "zarr.json").read_text())["attributes"]["ome"]["multiscales"][0]
    assert [d["path"] for d in ome["datasets"]] == ["0", "1", "2"]
    scale1 = ome["datasets"][1]["coordinateTransformations"]
    assert scale1[0]["scale"][1:] == [res * f for res, f in zip(zarr.input.resolution, (1, 2, 2))]
    t = ts.open({"driver": "zarr3", "kvstore": "file://" + str(root / "2")}).result()
    np.testing.assert_array_equal(np.asarray(t.read().result()), read_mip(zarr, 2)[0])


def test_a_pyramid_that_could_not_be_exact_is_refused_when_planned(tmp_path):
    cfg = base_config(tmp_path, vol=em((12, 70, 70)), output={**OUT, "align": False}, downsample={"mips": 1})
    with pytest.raises(ConfigError, match="not a multiple of the factor"):
        prepare(cfg)
    cfg = base_config(
        tmp_path,
        vol=em((12, 70, 70)),
        output={"chunk_size": [4, 4, 4]},
        downsample={"mips": 3},
        region={"offset": [4, 12, 12], "shape": [4, 40, 40]},
    )
    with pytest.raises(ConfigError, match=r"mip 2 starts at \(4, 3, 3\)"):  # mip 1 at (4, 6, 6)
        prepare(cfg)


def test_estimate_counts_the_pyramid(tmp_path):
    from znni_core.pipeline.estimate import describe, run_estimate

    cfg = base_config(tmp_path, vol=em((12, 70, 70)), output=OUT, downsample={"mips": 2})
    e = run_estimate(cfg, mem_mb=2000, threads=1, rate=1e5, cores_per_node=2, log=lambda *a: None)
    run = load_run(prepare(cfg))
    tasks = [mip_tasks(output_spec(run, k), run.config.task_chunks) for k in (1, 2)]
    assert e["pyramid"]["mips"] == 2 and e["pyramid"]["tasks"] == sum(len(t) for t in tasks)
    assert e["pyramid"]["objects"] == sum(output_spec(run, k).grid.num_chunks for k in (1, 2))  # unsharded
    assert "pyramid        mips 1-2" in describe(e)


def mip_files(run, mips) -> dict:
    """{path: bytes} of the stored objects of ``mips`` (precomputed: their scale directories)."""
    url = parse_layer_url(run.output.url)
    keys = [output_spec(run, k).key + "/" for k in mips]
    return {p: b for p, b in layer_files(str(url)).items() if p.startswith(tuple(keys))}


def not_done(run) -> dict:
    return {s["mip"]: set(s["not_done"]) for s in pyramid_status(run) if s["not_done"]}


@pytest.mark.parametrize("fmt", ["precomputed", "zarr"])
def test_a_mip0_chunk_recorded_written_but_absent_is_refused_by_name(tmp_path, fmt):
    """Not averaged as 0: zarr reads an absent shard as 0, so the chunk's sha256 tells."""
    zarr = {"output": {"path": str(tmp_path / "p" / "out.zarr")}, "task_chunks": [1, 2, 2]} if fmt == "zarr" else {}
    run = run_pyramid(tmp_path, mips=1, **zarr)
    task = run_geometry(run)[3][4]
    m = json.loads(manifest_path(run, task.id).read_text())
    chunk = next(c for c in m["chunks"] if c["status"] == "written")
    root = parse_layer_url(run.output.url).local_path
    (root / (m["shard"]["name"] if fmt == "zarr" else chunk["name"])).unlink()
    name = chunk["name"] if fmt == "precomputed" else chunk["name"].split("/")[-1]
    with pytest.raises(
        DataError, match=rf"mip 0 chunk \S*{name} is absent: .*re-run mip 0 task {task.id} \(`znni run-task"
    ):
        build_pyramid(run, **QUIET)


def test_an_incomplete_mip0_is_refused_before_anything_is_written(tmp_path):
    run = run_pyramid(tmp_path, mips=1)
    tid = run_geometry(run)[3][5].id
    manifest_path(run, tid).unlink()
    n = len(run_geometry(run)[3])
    with pytest.raises(DataError, match=rf"mip 0 is incomplete: 1 of {n} task\(s\) .*first: \[{tid}\]; .*--task {tid}"):
        build_pyramid(run, **QUIET)
    rf = Path(run.work_dir) / "run.json"
    with pytest.raises(DataError, match=rf"first: \[{tid}\]"):  # a job whose tasks lie over it, too
        run_pyramid_job(rf, 1, 0, len(mip_tasks(output_spec(run, 1), run.config.task_chunks)), **QUIET)
    assert not mip_files(run, [1]) and not (Path(run.work_dir) / "manifests" / "mip1").exists()
    assert not (Path(run.work_dir) / "pyramid").exists()


def test_a_mip0_task_rerun_with_other_bytes_makes_the_mips_above_it_stale(tmp_path):
    run = run_pyramid(tmp_path)
    rf = Path(run.work_dir) / "run.json"
    build_pyramid(run, **QUIET)
    assert not not_done(run)
    finalize(rf, log=lambda *a: None)
    # new input under task 0, then the task re-run as the workflow runs it: new bytes, new manifest
    task = run_geometry(run)[3][0]
    before = json.loads(manifest_path(run, task.id).read_text())["chunks"]
    inp = PrecomputedLayer(parse_layer_url(run.input.url), 0)
    inp.write_chunk((0, 0, 0), 255 - inp.read_chunk((0, 0, 0)))
    run_task(rf, task.id, show_progress=False, log=lambda *a: None)
    assert json.loads(manifest_path(run, task.id).read_text())["chunks"] != before
    above = {}  # the tasks of mips 1 and 2 over task 0's box of mip 0
    for k in (1, 2):
        scale = Coordinate(v**k for v in run.config.downsample.factor)
        tasks = mip_tasks(output_spec(run, k), run.config.task_chunks)
        box = [Roi.from_bounds(b.write_roi.begin * scale, b.write_roi.end * scale) for b in tasks]
        above[k] = {b.id for b, r in zip(tasks, box) if r.intersects(task.write_roi)}
    assert not_done(run) == above and all(len(v) == 1 for v in above.values())
    status = CliRunner().invoke(app, ["status", str(rf)]).output
    n = len(mip_tasks(output_spec(run, 1), run.config.task_chunks))
    assert f"pyramid mip 1: {n - 1} of {n} tasks done; not done or stale: {sorted(above[1])}" in status
    with pytest.raises(DataError, match=r"the pyramid has 2 task\(s\) not done or stale .*znni pyramid"):
        finalize(rf, log=lambda *a: None)
    rec = build_pyramid(run, **QUIET)
    assert [m["run_now"] for m in rec["mips"]] == [1, 1] and not not_done(run)  # exactly those
    finalize(rf, log=lambda *a: None)
    rebuilt = mip_files(run, [1, 2])
    # a fresh pyramid of the new mip 0: the same bytes
    for k in (1, 2):
        shutil.rmtree(Path(run.work_dir) / "manifests" / f"mip{k}")
        shutil.rmtree(parse_layer_url(run.output.url).local_path / output_spec(run, k).key)
    rec = build_pyramid(run, **QUIET)
    assert [m["run_now"] for m in rec["mips"]] == [m["tasks"] for m in rec["mips"]]
    assert mip_files(run, [1, 2]) == rebuilt and rebuilt


def test_empty_and_masked_mip0_chunks_average_to_0_and_are_pinned(tmp_path):
    """Chunks recorded empty (all-zero input) or masked (in a live task, or every chunk of a masked
    task: no manifest) are not stored; the pyramid averages them as 0 and pins their status."""
    vol = em((12, 48, 48))
    vol[:, 24:, 24:] = 0  # chunk (z, 2, 2) of mip 0 and its context: all zero
    cfg = base_config(tmp_path, vol=vol, output=OUT, downsample={"mips": 2})
    m = np.zeros((12, 24, 24), np.uint8)  # at half the input's x-y resolution: a disc in chunk (z, 0, 0), a corner
    _, yy, xx = np.mgrid[:12, :24, :24]
    m[(yy - 4) ** 2 + (xx - 4) ** 2 < 9] = 1
    m[:3, 20:, 20:] = 255
    mres = (RES[0], RES[1] * 2, RES[2] * 2)
    cfg["mask"] = {"path": write_volume(tmp_path / "mask", m, chunk=(4, 8, 8), resolution=mres), "mip": 0}
    rf = prepare(cfg)
    ctx = open_run(rf)
    doc = scan(ctx.tasks, ctx.mask) | {"run_digest": ctx.run.digest}
    mask_tasks_path(ctx.run).write_text(json.dumps(doc))
    for k in positions(doc):
        run_task(rf, ctx.tasks[k].id, show_progress=False, log=lambda *a: None)
    run = load_run(rf)
    statuses = [
        c["status"]
        for p in (Path(run.work_dir) / "manifests").glob("0*/*.json")
        for c in json.loads(p.read_text())["chunks"]
    ]
    assert {"written", "empty", "masked"} <= set(statuses) and doc["num_masked"]
    build_pyramid(run, **QUIET)
    for k in (1, 2):
        pins = {}
        for p in (Path(run.work_dir) / "manifests" / f"mip{k}").glob("*/*.json"):
            below = json.loads(p.read_text())["below"]
            assert below["mip"] == k - 1
            pins.update(below["chunks"])
        assert len(pins) == output_spec(run, k - 1).grid.num_chunks  # every chunk below, once
        want = {"written", "empty", "masked"} if k == 1 else {"written", "empty"}
        assert {v if v in ("empty", "masked") else "written" for v in pins.values()} == want
        np.testing.assert_array_equal(read_mip(run, k)[0], downsample(read_mip(run, k - 1)[0], (1, 2, 2), "float32"))
    assert not not_done(run)
