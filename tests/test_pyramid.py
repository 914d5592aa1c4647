"""`znni pyramid`: igneous builds mips of znni's output; on the aligned layer every mip equals the
mean of the blocks below it (checked here independently, and by tensorstore as a second reader);
on an unaligned layer the same check catches igneous averaging the wrong voxels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("igneous", reason="pip install 'znni[pyramid]'")

from znni_core.errors import DataError  # noqa: E402
from znni_core.io import PrecomputedLayer, parse_layer_url  # noqa: E402
from znni_core.pipeline.config import load_run  # noqa: E402
from znni_core.pipeline.pyramid import block_mean, build_pyramid  # noqa: E402

from .pipeline_helpers import base_config, em  # noqa: E402
from .test_pipeline import prepare, run_all  # noqa: E402


def run_pyramid(tmp_path, **out):
    cfg = base_config(tmp_path, vol=em((12, 70, 70)), output={"chunk_size": [4, 16, 16], **out},
                      downsample={"mips": 2})
    rf = prepare(cfg)
    run_all(rf)
    return load_run(rf)


def test_block_mean():
    a = np.arange(2 * 4 * 6, dtype=np.float32).reshape(1, 2, 4, 6)
    assert block_mean(a, (1, 2, 2))[0, 0, 0, 0] == np.mean([0, 1, 6, 7])
    assert block_mean(a, (1, 3, 4)).shape == (1, 2, 1, 1)


def test_pyramid_of_the_aligned_output_is_exact(tmp_path):
    import tensorstore as ts

    run = run_pyramid(tmp_path)
    rec = build_pyramid(run, log=lambda *a: None)
    assert [m["mip"] for m in rec["mips"]] == [1, 2] and (Path(run["work_dir"]) / "pyramid.json").is_file()
    url = parse_layer_url(run["output"]["url"])
    mip0 = PrecomputedLayer(url, 0)
    full = mip0.read(mip0.bounds, fill_missing=True)[0]
    assert tuple(mip0.bounds.offset) == (0, 0, 0)
    mip2 = PrecomputedLayer(url, 2)
    got = mip2.read(mip2.bounds, fill_missing=True)[0]
    want = block_mean(full, (1, 4, 4))  # two mips of 2 x 2 = one of 4 x 4, from mip 0 directly
    np.testing.assert_allclose(got[:, :, :want.shape[2], :want.shape[3]], want, rtol=1e-5, atol=1e-6)
    # raw chunks (no *.gz that tensorstore reads as zeros on file://), read by tensorstore alike
    assert not list((url.local_path / mip2.key).glob("*.gz"))
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": "file://" + str(url.local_path),
                 "scale_index": 2}).result()
    b, e = mip2.bounds.begin.xyz(), mip2.bounds.end.xyz()
    arr = np.asarray(t[b[0]:e[0], b[1]:e[1], b[2]:e[2], :].read().result()).transpose(3, 2, 1, 0)
    assert np.array_equal(arr, got)


def test_pyramid_check_catches_an_unaligned_layer(tmp_path):
    run = run_pyramid(tmp_path, align=False)
    assert run["output"]["scale"]["voxel_offset"][0] % 2  # the network's halo: an odd x offset
    with pytest.raises(DataError, match="differs from the mean of mip 0"):
        build_pyramid(run, log=lambda *a: None)
    assert not (Path(run["work_dir"]) / "pyramid.json").exists()


def test_pyramid_of_a_sharded_output(tmp_path):
    cfg = base_config(tmp_path, vol=em((12, 70, 70)), downsample={"mips": 1},
                      output={"chunk_size": [4, 16, 16], "sharding": "sharded", "shard_bytes": 4 * 16 * 16 * 4 * 4})
    rf = prepare(cfg)
    run_all(rf)
    run = load_run(rf)
    rec = build_pyramid(run, log=lambda *a: None)
    url = parse_layer_url(run["output"]["url"])
    mip1 = PrecomputedLayer(url, 1)
    assert mip1.sharded and rec["mips"][0]["max_abs_error"] < 1e-6
    assert sorted(p.suffix for p in (url.local_path / mip1.key).iterdir()) == [".shard"] * 2
