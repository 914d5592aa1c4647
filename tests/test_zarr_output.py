"""zarr v3 output (io/zarr_output.py): one shard per task, the same voxels as a precomputed run,
read by zarr-python, tensorstore and znni's own zarr input; OME-Zarr metadata; finalize verifies
shards; a task re-run rewrites only its shard; a mismatched existing array is refused (T18, T17).
Through Snakemake: tests/test_workflow.py (the masked run writes zarr)."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import ConfigError, DataError
from znni_core.geometry import Roi
from znni_core.io import PrecomputedLayer, open_input, parse_layer_url
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.run import load_run
from znni_core.pipeline.task import run_task

from .pipeline_helpers import RES, base_config, em
from .test_pipeline import QUIET, prepare, run_all


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same volume (a black slab: empty chunks) to precomputed and to zarr v3."""
    tmp = tmp_path_factory.mktemp("zarr_out")
    vol = em((12, 40, 40))
    vol[:, 18:, :] = 0
    out = {}
    for name, path in (("pre", "out_pre"), ("zarr", "out.zarr")):
        cfg = base_config(
            tmp / name, vol=vol, output={"path": str(tmp / name / path), "chunk_size": [4, 8, 8]}, task_chunks=[1, 2, 2]
        )
        rf = prepare(cfg)
        run_all(rf)
        out[name] = (cfg, rf, finalize(rf, log=lambda *a: None))
    return tmp, vol, out


def test_zarr_output_equals_precomputed_read_by_three_readers(runs):
    import tensorstore as ts
    import zarr

    tmp, vol, out = runs
    (_, rf_p, s_p), (cfg_z, rf_z, s_z) = out["pre"], out["zarr"]
    run = load_run(rf_z)
    pre = PrecomputedLayer(parse_layer_url(load_run(rf_p).output.url), 0)
    want, _ = pre.read(pre.bounds, fill_missing=True)
    root = Path(cfg_z["output"]["path"])
    got = np.asarray(zarr.open_array(str(root / "0"), mode="r")[...])
    assert got.shape == want.shape and np.array_equal(got, want)  # same tasks, same plan: same bits
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "0")}}, open=True).result()
    assert np.array_equal(t.read().result(), want)
    back = open_input(parse_layer_url(f"zarr://file://{root}/0"))  # znni reads its own output as an input
    assert back.bounds == pre.bounds and tuple(back.resolution) == RES
    # its empty chunks are not stored (as in the precomputed layer read above): an input needs
    # input.missing: zero for them, and every one of them is named as filled
    with pytest.raises(DataError, match="missing or empty"):
        back.read(back.bounds)
    got, filled = back.read(back.bounds, fill_missing=True)
    assert np.array_equal(got, want) and len(filled) >= s_z["chunks_empty"] > 0
    # one shard per task with a written chunk; empty chunks are absent from the shards
    ms = [json.loads(p.read_text()) for p in sorted((Path(cfg_z["work_dir"]) / "manifests").rglob("*.json"))]
    written = [m for m in ms if m["shard"]["status"] == "written"]
    shards = sorted(p.relative_to(root).as_posix() for p in (root / "0" / "c").rglob("*") if p.is_file())
    assert shards == sorted(m["shard"]["name"] for m in written) and 0 < len(written) < len(ms)
    assert s_z["chunks_empty"] == s_p["chunks_empty"] > 0 and s_z["chunks_written"] == s_p["chunks_written"]
    # OME-Zarr 0.5 metadata: scale = resolution, translation = offset * resolution
    ome = json.loads((root / "zarr.json").read_text())["attributes"]["ome"]
    ct = ome["multiscales"][0]["datasets"][0]["coordinateTransformations"]
    assert ct[0]["scale"] == [1.0, *RES]
    off = Roi.from_dict(run.region).offset  # aligned output: the layer starts on the chunk grid
    assert ct[1]["translation"][1:] == [float(o * r) for o, r in zip(pre.bounds.offset, RES)]
    assert all(o % c == 0 for o, c in zip(pre.bounds.offset, (4, 8, 8))) and off is not None


def test_corrupt_shard_is_named_and_a_rerun_rewrites_only_its_shard(runs):
    tmp, vol, out = runs
    cfg, rf, _ = out["zarr"]
    root = Path(cfg["output"]["path"])
    ms = [json.loads(p.read_text()) for p in sorted((Path(cfg["work_dir"]) / "manifests").rglob("*.json"))]
    m = next(m for m in ms if m["shard"]["status"] == "written")
    shard = root / m["shard"]["name"]
    before = _files(root)
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{m['task']}"):
        finalize(rf, log=lambda *a: None)
    run_task(rf, m["task"], **QUIET)
    after = _files(root)
    assert after[m["shard"]["name"]] == before[m["shard"]["name"]]
    changed = {k for k in before if before[k] != after.get(k)} - {"provenance"}
    assert not changed
    finalize(rf, log=lambda *a: None)


def test_mismatched_zarr_output_and_unsupported_options_are_refused(runs, tmp_path):
    tmp, vol, out = runs
    cfg, rf, _ = out["zarr"]
    gz = json.loads(json.dumps(cfg))
    gz["output"]["compression"] = "gzip"
    gz["work_dir"] = str(tmp_path / "w2")
    with pytest.raises(DataError, match="sharding"):  # T17: another codec is another array
        prepare(gz)
    other = json.loads(json.dumps(cfg))
    other["task_chunks"] = [1, 1, 2]
    other["work_dir"] = str(tmp_path / "w3")
    with pytest.raises(DataError, match="sharding"):  # T18: another shard shape
        prepare(other)
    none = json.loads(json.dumps(cfg))
    none["output"]["sharding"] = "none"
    with pytest.raises(ConfigError, match="always"):
        prepare(none)


def test_float16_zarr_output_is_the_float32_run_rounded_and_verifies(runs, tmp_path):
    """``output.dtype: float16`` (zarr): every stored value is the float32 run's value rounded to
    half precision (read by tensorstore), the mapping is in the provenance, its mip 1 is the
    float mean of mip 0; ``znni verify`` recomputes voxels within float16's rounding and fails on
    a value changed by more; a precomputed float16 output is refused at validate."""
    import tensorstore as ts

    from znni_core.pipeline.finalize import output_mapping
    from znni_core.pipeline.verify import verify_run as verify

    tmp, vol, out = runs
    cfg32, rf32, _ = out["zarr"]
    root32 = Path(cfg32["output"]["path"])
    want = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root32 / "0")}}).result()
    want = want.read().result()
    cfg = json.loads(json.dumps(cfg32))
    cfg["work_dir"] = str(tmp_path / "w16")
    cfg["output"].update(path=str(tmp_path / "out16.zarr"), dtype="float16")
    cfg["downsample"] = {"mips": 1, "factor": [1, 2, 2]}
    rf = prepare(cfg)
    run_all(rf)
    from znni_core.pipeline.pyramid import build_pyramid

    build_pyramid(load_run(rf), log=lambda *a: None)
    finalize(rf, log=lambda *a: None)
    root = tmp_path / "out16.zarr"
    got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "0")}}).result()
    assert got.dtype.numpy_dtype == np.float16
    got = got.read().result()
    assert got.shape == want.shape and np.array_equal(got, want.astype(np.float16))
    mip1 = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "1")}}).result().read().result()
    g = got.astype(np.float64)
    c, z, y, x = g.shape
    mean = g[:, :, : y // 2 * 2, : x // 2 * 2].reshape(c, z, y // 2, 2, x // 2, 2).mean(axis=(3, 5))
    assert np.allclose(mip1[:, :, : y // 2, : x // 2].astype(np.float64), mean, rtol=2**-10, atol=1e-7)
    assert "float16" in output_mapping(load_run(rf).config)
    record = verify(rf, checksums=False, log=lambda *a: None)
    assert record["recomputed"]["passed"] and record["recomputed"]["max_deviation"] <= 2**-11
    # a stored value changed by 1% of the output's scale: the recomputation finds it
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "0")}}).result()
    box = arr[0, :, :, :]
    flat = np.asarray(box.read().result()).astype(np.float32)
    flat += 0.01 * float(np.abs(g).max())
    box.write(flat.astype(np.float16)).result()
    with pytest.raises(DataError, match="verify: task"):
        verify(rf, checksums=False, tasks=10**6, log=lambda *a: None)
    pre = json.loads(json.dumps(cfg))
    pre["work_dir"] = str(tmp_path / "w16p")
    pre["output"]["path"] = str(tmp_path / "out16_pre")
    with pytest.raises(ConfigError, match="float16"):
        prepare(pre)


def test_zarr_output_and_pyramid_on_s3_equal_the_local_run(runs, moto_s3, tmp_path):
    """zarr output on a loopback S3 (moto): one PUT per shard, the same voxels as the local zarr
    run, read by znni and by tensorstore's s3 driver from the stored objects; a pyramid on it too."""
    import boto3
    import tensorstore as ts

    from znni_core.io.zarr_output import ZarrOutput
    from znni_core.pipeline.pyramid import build_pyramid
    from znni_core.pipeline.run import output_spec

    tmp, vol, out = runs
    cfg_l, rf_l, _ = out["zarr"]
    cfg = json.loads(json.dumps(cfg_l))
    cfg.update(work_dir=str(tmp_path / "work"), downsample={"mips": 1})
    cfg["output"].update(path="zarr://s3://znni/runs/out.zarr", endpoint_url=moto_s3)
    rf = prepare(cfg)
    run_all(rf)
    run = load_run(rf)
    build_pyramid(run, log=lambda *a: None)
    summary = finalize(rf, log=lambda *a: None)  # checks every shard's checksum on S3
    assert summary["done"] == summary["tasks"]
    assert "zarr3://s3://znni/runs/out.zarr" in urllib.parse.unquote(summary["neuroglancer"])
    url = parse_layer_url(run.output.url, endpoint=moto_s3)
    s3 = ZarrOutput(url, output_spec(run, 0))
    local = ZarrOutput(parse_layer_url(load_run(rf_l).output.url))
    mip0 = s3.read(s3.bounds)[0]
    np.testing.assert_allclose(mip0, local.read(local.bounds)[0], rtol=1e-5, atol=1e-6)  # another run's plan
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket="znni")["Contents"]]
    shards = sorted(k for k in keys if k.startswith("runs/out.zarr/0/c/"))
    ms = [json.loads(p.read_text()) for p in sorted((tmp_path / "work" / "manifests").glob("0*/*.json"))]
    assert shards == sorted("runs/out.zarr/" + m["shard"]["name"] for m in ms if m["shard"]["status"] == "written")
    assert "runs/out.zarr/zarr.json" in keys and "runs/out.zarr/1/zarr.json" in keys
    t = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {
                "driver": "s3",
                "bucket": "znni",
                "path": "runs/out.zarr/1/",
                "endpoint": moto_s3,
                "aws_region": "us-east-1",
            },
        }
    ).result()
    from znni_core.pipeline.pyramid import downsample

    np.testing.assert_array_equal(np.asarray(t.read().result()), downsample(mip0, (1, 2, 2), "float32"))
