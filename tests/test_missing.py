"""Missing means missing: only "not found" is a missing chunk (``input.missing``, ``mask.missing``).

- a chunk the input layer's own sha256 index records certainly existed: its absence is data loss,
  an error naming it even under ``input.missing: zero``;
- a directory, FIFO or file in the place of a chunk, a shard or a scale's folder is an error naming
  it (precomputed through ``LocalStore``, zarr through its own probes), never a chunk filled with 0;
- a missing mask chunk fails naming it unless ``mask.missing: zero``, which records it;
- ``input.empty: skip``: the report states how many chunks were skipped and what they hold, and
  ``znni verify`` checks a sample of them against the definition (input context all 0, nothing
  stored).

Real files throughout (tests run as root, so permission bits stop nothing: the faults are things
in an object's place).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from znni_core.errors import DataError, StorageError
from znni_core.geometry import Roi
from znni_core.io import PrecomputedLayer, open_input, parse_layer_url
from znni_core.io.checksums import write_index
from znni_core.io.store import sha256
from znni_core.pipeline.finalize import finalize
from znni_core.pipeline.mask import mask_tasks_path, scan
from znni_core.pipeline.run import load_run, run_geometry
from znni_core.pipeline.task import empty_context, manifest_path, open_run, run_task

from .pipeline_helpers import base_config, em, sharded_input, write_volume
from .test_mask import _masked_case
from .test_pipeline import QUIET, prepare, run_all

NOLOG = dict(log=lambda *a: None)


def _indexed_layer(tmp_path, leave_out=()):
    """A raw precomputed layer (12, 40, 40) in (4, 16, 16) chunks with a znni sha256 index of
    every chunk but ``leave_out``; returns (url, layer, volume)."""
    vol = em()
    url = parse_layer_url(write_volume(tmp_path / "em", vol))
    layer = PrecomputedLayer(url, 0)
    digests = {
        tuple(i): sha256(layer.read_chunk_bytes(i))
        for i in layer.grid.chunks_in(layer.bounds)
        if tuple(i) not in leave_out
    }
    write_index(layer, digests)
    return url, layer, vol


@pytest.mark.parametrize("checksums", ["auto", "none"])
def test_a_chunk_the_sha256_index_records_is_never_filled(tmp_path, checksums):
    recorded, unrecorded, emptied = (1, 1, 1), (2, 0, 2), (0, 2, 0)
    url, layer, vol = _indexed_layer(tmp_path, leave_out={unrecorded})
    root = url.local_path
    for idx in (recorded, unrecorded):
        (root / layer.chunk_name(idx)).unlink()
    (root / layer.chunk_name(emptied)).write_bytes(b"")  # 0 bytes: as lost as absent
    inp = open_input(url, checksums=checksums)
    with pytest.raises(DataError, match="data loss") as e:
        inp.read(inp.bounds, fill_missing=True)
    assert layer.chunk_name(recorded) in str(e.value) and layer.chunk_name(emptied) in str(e.value)
    assert layer.chunk_name(unrecorded) not in str(e.value)
    with pytest.raises(DataError, match="data loss"):  # one recorded chunk alone
        inp.read(layer.grid.chunk_roi(recorded), fill_missing=True)
    # a chunk the index does not list was never written: a gap, filled and named
    got, missing = inp.read(layer.grid.chunk_roi(unrecorded), fill_missing=True)
    assert missing == [layer.chunk_name(unrecorded)] and not got.any()
    # the chunks present still read (and verify, under auto)
    roi = layer.grid.chunk_roi((0, 0, 0))
    np.testing.assert_array_equal(inp.read(roi)[0][0], vol[roi.to_slices()])


def test_a_sharded_input_s_recorded_chunks_are_never_filled(tmp_path):
    url, layer, vol, shards = sharded_input(tmp_path)
    digests = {}
    for chunks in shards.values():
        digests |= layer.write_shard(chunks)["chunks"]
    write_index(layer, digests)
    names = sorted(shards)
    (url.local_path / names[0]).unlink()
    inp = open_input(url)
    with pytest.raises(DataError, match="data loss") as e:
        inp.read(inp.bounds, fill_missing=True)
    assert layer.chunk_name(sorted(shards[names[0]])[0]) in str(e.value)
    # a directory in a shard's place is not a missing shard
    os.mkdir(url.local_path / names[0])
    with pytest.raises(DataError, match="is a directory") as e:
        open_input(url, checksums="none").read(inp.bounds, fill_missing=True)
    assert names[0] in str(e.value)


def test_missing_zero_run_refuses_a_chunk_its_input_s_index_records(tmp_path):
    """Through a task: ``input.missing: zero`` fills nothing the input's index records; the task
    fails naming the chunk and leaves no manifest."""
    cfg = base_config(tmp_path, input={"missing": "zero"})
    url = parse_layer_url(cfg["input"]["path"])
    layer = PrecomputedLayer(url, 0)
    write_index(layer, {tuple(i): sha256(layer.read_chunk_bytes(i)) for i in layer.grid.chunks_in(layer.bounds)})
    gone = (1, 1, 1)
    (url.local_path / layer.chunk_name(gone)).unlink()
    rf = prepare(cfg)
    run = load_run(rf)
    block = next(b for b in run_geometry(run)[3] if b.read_roi.intersects(layer.grid.chunk_roi(gone)))
    with pytest.raises(DataError, match="data loss") as e:
        run_task(rf, block.id, **QUIET)
    assert layer.chunk_name(gone) in str(e.value)
    assert not manifest_path(run, block.id).exists()


def _fault(path, kind: str) -> None:
    """Put a real fault in the place of the file ``path``: a directory or a FIFO."""
    path.unlink()
    if kind == "directory":
        path.mkdir()
        (path / "x").write_bytes(b"not a chunk")
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_thing_in_a_precomputed_chunk_s_place_is_not_a_missing_chunk(tmp_path, kind):
    vol = em()
    url = parse_layer_url(write_volume(tmp_path / "em", vol))
    layer = open_input(url)
    name = layer.chunk_name((1, 1, 1))
    _fault(url.local_path / name, kind)
    what = "a directory" if kind == "directory" else "not a regular file"
    for read in (
        lambda: layer.read(layer.bounds, fill_missing=True),
        lambda: layer.read(layer.bounds),
        lambda: layer.missing_chunks(layer.bounds),
    ):
        with pytest.raises(DataError, match=what) as e:
            read()
        assert name in str(e.value)


def test_a_file_in_a_precomputed_scale_folder_s_place_is_a_storage_error(tmp_path):
    url = parse_layer_url(write_volume(tmp_path / "em", em()))
    layer = open_input(url)
    shutil.rmtree(url.local_path / "k")
    (url.local_path / "k").write_bytes(b"")
    with pytest.raises(StorageError, match="Not a directory") as e:
        layer.read(layer.bounds, fill_missing=True)
    assert "k/" in str(e.value)


def _zarr_input(tmp_path, **kw):
    import zarr

    from znni_core.io import ZarrLayer

    path = tmp_path / "in.zarr"
    arr = zarr.create_array(str(path), shape=(8, 16, 16), dtype="uint8", zarr_format=3, **kw)
    arr[...] = 7
    arr.attrs.update({"resolution": [40.0, 4.0, 4.0], "voxel_offset": [0, 0, 0]})
    return path, ZarrLayer(parse_layer_url(f"file://{path}", what="input"))


def test_a_directory_or_file_in_a_zarr_chunk_s_place_is_not_a_missing_chunk(tmp_path):
    path, layer = _zarr_input(tmp_path, chunks=(4, 8, 8))
    chunk = path / "c" / "1" / "1" / "1"
    _fault(chunk, "directory")
    with pytest.raises(DataError, match="a directory") as e:
        layer.read(layer.bounds, fill_missing=True)
    assert "c/1/1/1" in str(e.value)
    shutil.rmtree(chunk)
    got, missing = layer.read(layer.bounds, fill_missing=True)  # now absent: filled and named
    assert missing == ["c/1/1/1"]
    shutil.rmtree(path / "c" / "0")
    (path / "c" / "0").write_bytes(b"")  # a file where the chunks' folder belongs
    with pytest.raises(StorageError, match="Not a directory") as e:
        layer.read(layer.bounds, fill_missing=True)
    assert "c/0/" in str(e.value)


def test_a_directory_in_a_zarr_shard_s_place_is_not_a_missing_shard(tmp_path):
    path, layer = _zarr_input(tmp_path, chunks=(4, 8, 8), shards=(8, 8, 8))
    assert layer.sharded
    shard = path / "c" / "0" / "0" / "1"
    _fault(shard, "directory")
    with pytest.raises(DataError, match="a directory") as e:
        layer.read(layer.bounds, fill_missing=True)
    assert "c/0/0/1" in str(e.value)
    shutil.rmtree(shard)
    _, missing = layer.read(layer.bounds, fill_missing=True)
    assert all("c/0/0/1" in m for m in missing) and len(missing) == 2


# ---- masks --------------------------------------------------------------------------------------------


def test_a_missing_mask_chunk_fails_unless_filling_is_chosen(tmp_path):
    cfg, _, _, _ = _masked_case(tmp_path / "fail")
    gone = "k/8-16_8-16_0-4"  # mask voxels x 8-16, y 8-16, z 0-4: the disc's chunk
    mask_root = parse_layer_url(cfg["mask"]["path"]).local_path
    (mask_root / gone).unlink()
    rf = prepare(cfg)
    ctx = open_run(rf)
    with pytest.raises(DataError, match="mask.missing") as e:
        scan(ctx.tasks, ctx.mask)
    assert gone in str(e.value) and "mask " in str(e.value)
    under = Roi((0, 16, 16), (4, 16, 16))  # the lost mask chunk in input voxels
    block = next(b for b in ctx.tasks if b.write_roi.intersect(ctx.region).intersects(under))
    with pytest.raises(DataError, match=gone):  # a task reads the mask too: it fails, no manifest
        run_task(rf, block.id, **QUIET)
    assert not manifest_path(ctx.run, block.id).exists()

    cfg, _, _, _ = _masked_case(tmp_path / "zero")
    cfg["mask"]["missing"] = "zero"
    (parse_layer_url(cfg["mask"]["path"]).local_path / gone).unlink()
    rf = prepare(cfg)
    ctx = open_run(rf)
    doc = scan(ctx.tasks, ctx.mask) | {"run_digest": ctx.run.digest}
    assert doc["missing_mask_filled"] == [gone]
    mask_tasks_path(ctx.run).write_text(json.dumps(doc))
    from znni_core.pipeline.mask import positions

    recorded = set()
    for k in positions(doc):
        m = run_task(rf, ctx.tasks[k].id, **QUIET)
        assert "missing_mask_filled" in m
        recorded |= set(m["missing_mask_filled"])
    assert recorded <= {gone}
    s = finalize(rf, **NOLOG)
    assert s["missing_mask_filled"] == [gone]
    prov = json.loads((parse_layer_url(ctx.run.output.url).local_path / "provenance").read_text())
    assert prov["processing"][-1]["method"]["missing_mask_filled"] == [gone]


# ---- empty chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("edge", ["valid", "mirror"])
def test_empty_chunks_are_reported_and_verified_against_their_definition(tmp_path, edge):
    """A black half: its chunks are recorded ``empty``; the report says how many, that they read
    as 0 and what the network (a sigmoid) would give there; ``znni verify`` re-reads their input
    context through the edge policy and finds it all 0 and nothing stored.  A manifest that
    calls a computed chunk empty (its chunk deleted) fails verify, named."""
    import znni_core
    from znni_core.io import read_manifest
    from znni_core.net.definition import plain_forward
    from znni_core.pipeline.verify import verify_run

    vol = em()
    vol[:, :, :20] = 0
    cfg = base_config(tmp_path, vol=vol, edge=edge)
    rf = prepare(cfg)
    run_all(rf)
    s = finalize(rf, **NOLOG)
    n = s["chunks_empty"]
    assert n > 0 and s["chunks_written"] > 0
    net = znni_core.load_network(cfg["network"]["path"])
    f0 = plain_forward(net, np.zeros((1, 1) + tuple(net.field_of_view), np.float32))[0]
    assert f0[0] > 0  # a sigmoid: what the network gives there is not what an empty chunk holds
    text = s["empty_chunks"]
    assert text.startswith(f"{n} chunk(s) skipped") and "it reads as 0" in text, text
    assert f"not [{float(np.float32(f0[0]))}]" in text, text
    assert "chunks_empty (input.empty: skip" in (tmp_path / "work/report/report.html").read_text()

    rec = verify_run(rf, tasks=1, samples=2, empty=10_000, **NOLOG)
    assert rec["empty"]["passed"] and rec["empty"]["chunks"] == n and rec["empty"]["checked"] == n, rec["empty"]
    run = load_run(rf)
    ctx = open_run(rf)
    region = Roi.from_dict(run.region)
    # every empty chunk's context, read independently here through the edge policy, is all 0
    for b in ctx.tasks:
        for c in read_manifest(manifest_path(run, b.id))["chunks"]:
            if c["status"] == "empty":
                croi = empty_context(ctx.grid, region, ctx.halo, tuple(c["index"]))
                if edge == "valid":
                    assert not vol[croi.to_slices()].any()
    # a computed chunk recorded empty (and deleted) is caught: its input context is not 0
    m0 = None
    for b in ctx.tasks:
        m = read_manifest(manifest_path(run, b.id))
        if any(c["status"] == "written" for c in m["chunks"]):
            m0, mp = m, manifest_path(run, b.id)
            break
    c = next(c for c in m0["chunks"] if c["status"] == "written")
    c["status"] = "empty"
    mp.write_text(json.dumps(m0))
    ctx.out.delete_chunk(tuple(c["index"]))
    with pytest.raises(DataError, match="recorded empty") as e:
        verify_run(rf, tasks=0, empty=10_000, **NOLOG)
    assert c["name"] in str(e.value) and f"task {m0['task']}" in str(e.value)
    assert json.loads((tmp_path / "work/verify.json").read_text())["empty"]["passed"] is False
