"""Sharded precomputed output: keys and shard boxes against cloud-volume's own code, tasks that
write whole shards, read back by cloud-volume and tensorstore equal to the unsharded layer,
verification, a task re-run rewriting only its shard, and a petavoxel layer's file count."""

from __future__ import annotations

import itertools
import json
import types
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import ConfigError, DataError
from znni_core.geometry import Coordinate, Roi
from znni_core.io import PrecomputedLayer, parse_layer_url
from znni_core.io.sharding import _bits, auto_sharding, check_sharding, chunk_key, shard_chunks, shard_name
from znni_core.pipeline.finalize import check_manifests
from znni_core.pipeline.resolve import output_sharding
from znni_core.pipeline.run import load_run, run_geometry
from znni_core.pipeline.settings import parse_config
from znni_core.pipeline.task import manifest_path, run_task

from .pipeline_helpers import base_config, em
from .test_pipeline import QUIET, prepare, read_out, run_all


def test_chunk_keys_are_cloudvolumes_compressed_morton_codes():
    from cloudvolume.datasource.precomputed.common import compressed_morton_code

    rng = np.random.default_rng(0)
    for _ in range(300):
        grid = tuple(int(v) for v in rng.integers(1, 70, 3))  # z, y, x
        idx = tuple(int(rng.integers(0, n)) for n in grid)
        assert chunk_key(idx, grid) == int(compressed_morton_code([idx[::-1]], grid[::-1])[0])


def test_shard_boxes_hold_exactly_one_shard_each():
    from cloudvolume.datasource.precomputed.sharding import image_shard_shape_from_spec

    rng = np.random.default_rng(1)
    for _ in range(150):
        grid = tuple(int(v) for v in rng.integers(1, 17, 3))
        pre, mini = int(rng.integers(0, 6)), int(rng.integers(0, 3))
        spec = {
            "preshift_bits": pre,
            "minishard_bits": mini,
            "hash": "identity",
            "shard_bits": max(0, sum(_bits(n) for n in grid) - pre - mini),
        }
        box = shard_chunks(spec, grid)
        ref = image_shard_shape_from_spec(spec, grid[::-1], (1, 1, 1))[::-1]
        assert tuple(box) == tuple(min(int(r), n) for r, n in zip(ref, grid))
        names = {}
        for i in itertools.product(*map(range, grid)):
            names.setdefault(tuple(a // b for a, b in zip(i, box)), set()).add(shard_name(spec, chunk_key(i, grid)))
        assert all(len(v) == 1 for v in names.values())
        assert len({min(v) for v in names.values()}) == len(names)


def test_bad_sharding_specs_are_refused():
    good = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "preshift_bits": 3,
        "hash": "identity",
        "minishard_bits": 1,
        "shard_bits": 4,
        "minishard_index_encoding": "gzip",
        "data_encoding": "raw",
    }
    assert check_sharding(good, "x") == good
    with pytest.raises(ConfigError, match="hash: identity"):
        check_sharding({**good, "hash": "murmurhash3_x86_128"}, "output.sharding")
    with pytest.raises(ConfigError, match="preshift_bits"):
        check_sharding({**good, "preshift_bits": -1}, "output.sharding")
    # too few bits: two boxes of chunks would share one shard file (two writers)
    with pytest.raises(ConfigError, match="raise shard_bits to 14"):
        check_sharding(good, "output.sharding", (40, 40, 40))  # 18 key bits, 3 + 1 + 4 given


def sharded_config(tmp_path, vol, **out):
    return base_config(tmp_path, vol=vol, output={"sharding": "sharded", "shard_bytes": 4 * 8 * 8 * 4 * 8, **out})


def test_sharded_output_equals_unsharded_and_is_read_by_cloudvolume_and_tensorstore(tmp_path):
    import tensorstore as ts

    vol = em((12, 40, 40))
    vol[:, :, 24:] = 0  # empty chunks: absent from their shards, read as 0
    (tmp_path / "s").mkdir()
    rf = prepare(sharded_config(tmp_path / "s", vol))
    run = load_run(rf)
    spec = run.output.info["scales"][0]["sharding"]
    _, grid, _, blocks = run_geometry(run)
    assert len(blocks) > 2 and Coordinate(run.task_chunks) == shard_chunks(spec, grid.grid_shape)
    run_all(rf)
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    shards = sorted(p.name for p in (Path(layer.url.local_path) / layer.key).iterdir())
    manifests = [json.loads(manifest_path(run, b.id).read_text()) for b in blocks]
    written = [m["shard"]["name"].split("/")[-1] for m in manifests if m["shard"]["status"] == "written"]
    assert shards == sorted(written) and len(shards) == len(set(shards)) >= 2  # one file per shard, no chunk files
    assert any(c["status"] == "empty" for m in manifests for c in m["chunks"])
    assert all(c["sha256"] for m in manifests for c in m["chunks"] if c["status"] == "written")

    # the same tasks unsharded: the same patches, so the same bytes
    (tmp_path / "u").mkdir()
    cfg_u = base_config(tmp_path / "u", vol=vol, output={"sharding": "none"}, task_chunks=run.task_chunks)
    rf_u = prepare(cfg_u)
    run_all(rf_u)
    want, _ = read_out(rf_u)
    got, _ = read_out(rf)  # znni reading the shards
    assert np.array_equal(got, want)
    kv = "file://" + str(layer.url.local_path)
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": kv}).result()
    b, e = layer.bounds.begin.xyz(), layer.bounds.end.xyz()
    arr = np.asarray(t[b[0] : e[0], b[1] : e[1], b[2] : e[2], :].read().result()).transpose(3, 2, 1, 0)
    region = Roi.from_dict(run.region)
    assert np.array_equal(arr[(slice(None),) + region.to_slices(layer.bounds.offset)], want)


def test_sharded_tasks_verify_and_rerun_rewrites_only_their_shard(tmp_path):
    rf = prepare(sharded_config(tmp_path, em((12, 40, 40))))
    run = load_run(rf)
    ids = run_all(rf)
    layer = PrecomputedLayer(parse_layer_url(run.output.url), 0)
    with check_manifests(run, layer, "checksum", log=lambda *a: None) as tally:
        assert tally.counts()["done"] == len(ids) == tally.n and not tally.errors
    _, _, _, blocks = run_geometry(run)
    root = Path(layer.url.local_path)
    mtimes = {p: p.stat().st_mtime_ns for p in (root / layer.key).iterdir()}
    victim = blocks[1]
    name = layer.shard_name(victim.chunks[0])
    data = bytearray((root / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a corrupted shard is found by finalize, naming the task
    (root / name).write_bytes(bytes(data))
    with check_manifests(run, layer, "checksum", log=lambda *a: None) as tally:
        assert list(tally.errors) == [victim.id] and "read-back sha256" in tally.errors[victim.id]
        assert tally.counts()["done"] == len(ids) - 1
    run_task(rf, victim.id, **QUIET)  # re-run: rewrites its shard whole, no other
    changed = [p for p in (root / layer.key).iterdir() if p.stat().st_mtime_ns != mtimes.get(p)]
    assert [p.name for p in changed] == [name.split("/")[-1]]
    assert check_manifests(run, layer, "checksum", log=lambda *a: None).counts()["done"] == len(ids)
    # a re-run of one chunk of a sharded layer runs its whole shard
    chunk = layer.chunk_name(victim.chunks[-1]).split("/")[-1]
    m = run_task(rf, chunk=chunk, **QUIET)
    assert m["shard"]["name"] == name and len(m["chunks"]) == len(victim.chunks)


def test_petavoxel_layer_has_a_bounded_number_of_shards():
    shape = Coordinate((25_000, 200_000, 200_000))
    out = parse_config(
        {
            "input": {"path": "file:///em", "dtype": "uint8"},
            "network": {"path": "net.onnx"},
            "output": {"path": "file:///out", "chunk_size": [64, 128, 128], "shard_bytes": 2**30},
        }
    ).output
    spec = output_sharding(out, Roi((0, 0, 0), shape), 1)
    grid = shape.ceil_div(Coordinate(out.chunk_size))
    box = shard_chunks(spec, grid)
    shards = grid.ceil_div(box).prod()
    print(
        f"petavoxel layer (z, y, x) {tuple(shape)}: {grid.prod():,} chunks -> {shards:,} shard files "
        f"of {tuple(box)} chunks ({box.prod() * 64 * 128 * 128 * 4 / 2**30:.2f} GiB each)"
    )
    assert grid.prod() > 9 * 10**8 and shards < 10**7
    assert box.prod() * 64 * 128 * 128 * 4 <= 2**30
    assert output_sharding(out, Roi((0, 0, 0), (64, 512, 512)), 1) is None  # few chunks
    assert auto_sharding(shape, out.chunk_size, "float32", 1, 2**30, "raw")["hash"] == "identity"
    # its pyramid (5 mips of 1 x 2 x 2): every mip sharded, all of them fewer files than mip 0 again
    from znni_core.io import ScaleSpec
    from znni_core.io.mips import mip_specs, task_chunks_of

    s0 = ScaleSpec(
        "8_8_40", Roi((0, 0, 0), shape), Coordinate(out.chunk_size), (40.0, 8.0, 8.0), "float32", 1, sharding=spec
    )
    counts = []
    for k, s in enumerate(mip_specs(s0, 5, (1, 2, 2), shard_bytes=2**30)):
        assert s.sharding and (k == 0 or s.bounds.shape[1] == -(-shape[1] // 2**k))
        counts.append(int(s.grid.grid_shape.ceil_div(task_chunks_of(s, (1, 1, 1))).prod()))
    print(f"pyramid mips 0-5: {counts} shard files")
    assert counts[0] == shards and sum(counts[1:]) < shards


# ---- docs/reliability.md cases redone for shards ----------------------------------------------------
SPEC1 = {
    "@type": "neuroglancer_uint64_sharded_v1",
    "preshift_bits": 2,
    "hash": "identity",
    "minishard_bits": 0,
    "shard_bits": 0,
    "minishard_index_encoding": "gzip",
    "data_encoding": "raw",
}


def one_shard_layer(tmp_path, chunk=(32, 64, 64)):
    """A layer of 2 x 2 chunks in one shard."""
    from znni_core.io import ScaleSpec, create_layer, open_output

    url = parse_layer_url("file://" + str(tmp_path / "l"))
    spec = ScaleSpec(
        "k",
        Roi((0, 0, 0), (chunk[0], 2 * chunk[1], 2 * chunk[2])),
        Coordinate(chunk),
        (40.0, 8.0, 8.0),
        "float32",
        1,
        sharding=SPEC1,
    )
    create_layer(url, spec, {"processing": []})
    return url, open_output(url, spec)


def shard_of(layer, value):
    return {
        Coordinate(i): np.full((1,) + tuple(layer.grid.chunk_shape), value, np.float32)
        for i in itertools.product(*map(range, layer.grid.grid_shape))
    }


_SHARD_WRITER = """
import sys, itertools, numpy as np
from znni_core.io import parse_layer_url, PrecomputedLayer
from znni_core.geometry import Coordinate
layer = PrecomputedLayer(parse_layer_url(sys.argv[1]), 0)
shards = [{Coordinate(i): np.full((1,) + tuple(layer.grid.chunk_shape), v, np.float32)
           for i in itertools.product(*map(range, layer.grid.grid_shape))} for v in (1.0, 2.0)]
print("ready", flush=True)
i = 0
while True:
    layer.write_shard(shards[i % 2]); i += 1
"""


def test_T2_sigkill_during_shard_writes_never_leaves_a_torn_shard_20_trials(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    url, layer = one_shard_layer(tmp_path)
    rng = np.random.default_rng(7)
    for trial in range(20):  # kills at seeded random moments: 20 of 20 leave a whole shard or none
        p = subprocess.Popen(
            [sys.executable, "-c", _SHARD_WRITER, str(url)],
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=os.getcwd()),
        )
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.4)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        fresh = PrecomputedLayer(url, 0)
        got, _ = fresh.read(fresh.bounds, fill_missing=True)
        values = set(np.unique(got).tolist())
        assert values in ({0.0}, {1.0}, {2.0}), f"trial {trial}: torn shard readable ({values})"
    layer.write_shard(shard_of(layer, 3.0))  # the next good write leaves no temporaries behind
    assert [q.name for q in (url.local_path / "k").iterdir()] == ["0.shard"]


def test_T10_concurrent_identical_shard_writers(tmp_path):
    import threading

    url, layer = one_shard_layer(tmp_path, chunk=(16, 32, 32))
    chunks = shard_of(layer, 0.5)
    want = layer.write_shard(chunks)["sha256"]
    stop, seen = threading.Event(), []

    def reader():
        from znni_core.io.store import sha256

        while not stop.is_set():
            d = layer.read_object("k/0.shard")
            if d is not None:
                seen.append(sha256(d) == want)

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=lambda: [layer.write_shard(chunks) for _ in range(8)]) for _ in range(4)]
    [w.start() for w in ws]
    [w.join() for w in ws]
    stop.set()
    r.join()
    assert seen and all(seen)


def test_T17_other_compression_is_another_spec_refused_on_an_existing_layer(tmp_path):
    from znni_core.errors import DataError

    vol = em((12, 40, 40))
    rf = prepare(sharded_config(tmp_path, vol))
    run_all(rf)
    cfg = sharded_config(tmp_path, vol, compression="gzip")
    with pytest.raises(DataError, match="sharding"):
        prepare(cfg)  # a shard is never half raw, half gzip: the existing layer is refused, not mixed


def test_T3_sigkill_after_the_shard_write_before_the_manifest_then_rerun(tmp_path):
    """A task killed between its verified shard write and its manifest: not done (no manifest);
    its re-run writes the same shard bytes, then the manifest, and verifies; no temporaries."""
    from tests import faults_helpers as H
    from znni_core.io import open_output
    from znni_core.pipeline.done import check_task
    from znni_core.pipeline.run import load_run, output_spec, run_geometry

    chunk_bytes = 8 * 32 * 32 * 4
    case = H.prepare(H.make_case(tmp_path / "c", output__sharding="sharded", output__shard_bytes=2 * chunk_bytes))
    run = load_run(case.run_file)
    tasks = run_geometry(run)[3]
    assert len(tasks) > 1 and len(tasks[0].chunks) > 1  # several shards of several chunks
    block = tasks[1]
    r = H.run_task_proc(case, block.id, fault="before-manifest")
    assert r.killed and not case.manifest(block.id).exists()
    shards = [p for p in case.out.rglob("*.shard")]
    assert len(shards) == 1 and not H.temporaries(case.out)
    first = shards[0].read_bytes()
    r2 = H.run_task_proc(case, block.id)
    assert r2.exitcode == 0 and case.manifest(block.id).exists()
    assert shards[0].read_bytes() == first and [p for p in case.out.rglob("*.shard")] == shards
    out = open_output(parse_layer_url(run.output.url), output_spec(run))
    assert check_task(run, out, block, "checksum")["shard"]["name"].endswith(shards[0].name)


def test_a_petavoxel_with_the_shipped_config_validates_and_estimates(tmp_path):
    """10^15 voxels (200k x 200k x 25k, only the input's info exists) with the project's
    config.yaml: validate resolves it (a plan, no data read) and the schedule and estimate count
    it; ``output.shard_bytes: auto`` picks shards whose task fits the 2000 MB infer job the shipped
    profiles give, and says so."""
    import yaml

    from znni_core import load_network
    from znni_core.pipeline.demo import write_demo
    from znni_core.pipeline.estimate import describe, estimate
    from znni_core.pipeline.resolve import JOB_MEM_MB, net_halo, resolve, task_bytes
    from znni_core.pipeline.schedule import compute_schedule

    (tmp_path / "em").mkdir()
    scale = {"key": "8_8_40", "size": [200000, 200000, 25000], "resolution": [8, 8, 40], "voxel_offset": [0, 0, 0]}
    info = {"type": "image", "data_type": "uint8", "num_channels": 1, "scales": [scale]}
    scale.update({"chunk_sizes": [[128, 128, 16]], "encoding": "raw"})
    (tmp_path / "em" / "info").write_text(json.dumps(info))
    write_demo(tmp_path / "data", shape=(16, 64, 64), chunk=(8, 32, 32))
    cfg = yaml.safe_load((Path(__file__).parent.parent / "config.yaml").read_text())
    cfg["input"]["path"] = f"file://{tmp_path}/em"
    cfg["network"]["path"] = str(tmp_path / "data" / "net.yaml")
    cfg["output"]["path"] = f"file://{tmp_path}/out"
    cfg["work_dir"] = str(tmp_path / "work")
    notes = []
    run, plan = resolve(cfg, mem_mb=JOB_MEM_MB, progress=notes.append)
    assert any("output.shard_bytes auto" in n for n in notes), notes
    assert not (tmp_path / "out").exists()
    s = compute_schedule(cfg, rate=1e7)
    assert s["sharded"] and s["shard_bytes"] < 2**30 and s["region_voxels"] > 10**15 * 0.99, s
    write = Coordinate(s["task_chunks"]) * Coordinate(cfg["output"]["chunk_size"])
    need = task_bytes(write, net_halo(load_network(cfg["network"]["path"])), 1, 1, 1, 4)
    assert need + plan.memory_budget <= JOB_MEM_MB * 2**20, (need, plan.memory_budget)
    e = estimate(parse_config(cfg), s, rate=1e7, rate_source="given", threads=1, device="cpu", out_channels=1)
    text = describe(e)
    assert "shards of about" in text and "sharding       output.shard_bytes auto" in text, text
    assert e["tasks"] == s["num_tasks"] > 10**6
    # what the tasks read: at least the unique input once, the requests are chunk reads
    assert e["input_read_bytes"] >= e["input_unique_bytes"] > 10**15 * 0.99
    assert "input reads" in text and "requests" in text and e["input_requests"] >= s["input_reads"]["unique_chunks"]


@pytest.mark.parametrize(
    "offset,chunk,task,halo",
    [
        ((0, 0, 0), (4, 8, 8), (1, 2, 2), ((1, 3, 3), (1, 3, 3))),
        ((3, 5, 7), (3, 6, 5), (2, 1, 3), ((0, 2, 1), (2, 0, 3))),
    ],
)
def test_input_reads_count_what_every_task_reads(offset, chunk, task, halo):
    """``input_reads`` (per-axis sums) against every task of the grid read chunk by chunk: each task
    the voxels it computes (its write box in the region) plus the halo, clipped to the input, grown
    to the input's chunks; with jobs of a brick of tasks, each chunk once per job."""
    from znni_core.geometry import ChunkGrid, Halo, Roi, TaskGrid
    from znni_core.pipeline.schedule import JobMap, input_reads

    inp = ChunkGrid(Roi(offset, (13, 50, 47)), chunk)
    h = Halo(*halo)
    out = ChunkGrid(Roi(Coordinate(offset) + h.low, Coordinate((13, 50, 47)) - h.low - h.high), (2, 7, 9))
    tasks = TaskGrid(out, task, h, Roi(out.bounds.offset + (1, 3, 2), (9, 30, 33)))
    layer = types.SimpleNamespace(grid=inp, channels=2, dtype="uint16")  # what input_reads reads of a layer
    shape = tuple(int(v) for v in tasks.shape)
    n = len(tasks)
    maps = [JobMap(1, n), JobMap(3, n), JobMap(7, n)] + [JobMap(1, n, b, shape) for b in ((1, 1, 2), (2, 2, 1), shape)]
    for jobs in (None, *maps):
        voxels = chunks = 0
        for j in range(jobs.num_jobs) if jobs else range(n):
            fetched = set()  # a job fetches each chunk once (its cache); no jobs: each task alone
            for k in jobs.positions(j) if jobs else [j]:
                block = tasks[k]
                read = h.read_roi(block.write_roi.intersect(tasks.region)).intersect(inp.bounds)
                now = {tuple(i) for i in inp.chunks_in(read)}
                chunks += len(now - fetched)
                voxels += sum(int(inp.chunk_roi(i).shape.prod()) for i in now - fetched)
                fetched |= now
        got = input_reads(tasks, layer, jobs)
        assert (got["voxels"], got["chunks"], got["voxel_bytes"]) == (voxels, chunks, 4), jobs
        assert got["amplification"] == pytest.approx(voxels / got["unique_voxels"])
        assert got["amplification"] > 1 if jobs is None else got["amplification"] >= 1
    assert input_reads(tasks, layer, maps[-1])["amplification"] == 1.0  # one job: the unique input


# ---- sharded (and otherwise encoded) inputs, written by tensorstore, read by znni ----------------------
def ts_layer(path, vol, *, chunk=(4, 8, 8), encoding="raw", sharding=None):
    """A precomputed layer written by tensorstore (an independent writer) holding ``vol`` (c, z, y, x)."""
    import tensorstore as ts

    c, z, y, x = vol.shape
    scale = {
        "size": [x, y, z],
        "voxel_offset": [3, 5, 7],
        "chunk_size": list(chunk[::-1]),
        "resolution": [4, 4, 40],
        "encoding": encoding,
    }
    if encoding == "compressed_segmentation":
        scale["compressed_segmentation_block_size"] = [4, 4, 2]
    if sharding:
        scale["sharding"] = sharding
    t = ts.open(
        {
            "driver": "neuroglancer_precomputed",
            "kvstore": f"file://{path}",
            "multiscale_metadata": {"type": "image", "data_type": str(vol.dtype), "num_channels": c},
            "scale_metadata": scale,
        },
        create=True,
    ).result()
    t[3 : 3 + x, 5 : 5 + y, 7 : 7 + z, :].write(vol.transpose(3, 2, 1, 0)).result()
    return parse_layer_url(f"file://{path}")


def _sharding(hash_, data_encoding, minishard_bits=1, preshift_bits=1, shard_bits=2):
    return {
        "@type": "neuroglancer_uint64_sharded_v1",
        "hash": hash_,
        "preshift_bits": preshift_bits,
        "minishard_bits": minishard_bits,
        "shard_bits": shard_bits,
        "minishard_index_encoding": "gzip",
        "data_encoding": data_encoding,
    }


@pytest.mark.parametrize(
    "hash_,data_encoding", [("identity", "raw"), ("identity", "gzip"), ("murmurhash3_x86_128", "raw")]
)
def test_sharded_input_read_by_byte_range_equals_what_tensorstore_wrote(tmp_path, hash_, data_encoding):
    """A sharded input (either hash, raw or gzip data, gzip minishard indices) is read through the
    layer's store by byte ranges, on boxes crossing chunk and shard borders; a deleted shard and
    a chunk tensorstore never wrote (all zeros) are named, or filled when asked."""
    rng = np.random.default_rng(11)
    vol = rng.integers(1, 60000, (2, 12, 40, 36)).astype(np.uint16)
    vol[:, :4, :8, :8] = 0  # tensorstore leaves an all-zero (fill value) chunk out of its shard
    url = ts_layer(tmp_path / "em", vol, sharding=_sharding(hash_, data_encoding))
    layer = PrecomputedLayer(url, 0)
    assert layer.sharded
    off = layer.bounds.offset
    for _ in range(8):
        lo = [int(rng.integers(0, n)) for n in vol.shape[1:]]
        shape = [int(rng.integers(1, n - v + 1)) for v, n in zip(lo, vol.shape[1:])]
        r = Roi(tuple(a + b for a, b in zip(lo, off)), shape)
        if r.intersect(Roi(off, (4, 8, 8))).size:  # the absent chunk: named, filled on request
            continue
        got, missing = layer.read(r)
        assert missing == [] and np.array_equal(got, vol[(slice(None),) + r.to_slices(off)])
    first = layer.chunk_name(Coordinate(0, 0, 0))
    with pytest.raises(DataError, match="missing or empty") as e:
        layer.read(layer.bounds)
    assert f"{first} (not in shard" in str(e.value)
    got, missing = layer.read(layer.bounds, fill_missing=True)
    assert [m.split()[0] for m in missing] == [first] and np.array_equal(got, vol)
    shards = sorted((url.local_path / layer.key).glob("*.shard"))
    assert len(shards) >= 2
    whole = shards[0].read_bytes()  # T9: a shard cut short at rest is an error naming it, not zeros
    shards[0].write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError) as e:
        PrecomputedLayer(url, 0).read(layer.bounds, fill_missing=True)
    assert shards[0].name in str(e.value), str(e.value)
    shards[0].write_bytes(whole)
    shards[-1].unlink()
    layer = PrecomputedLayer(url, 0)
    named = layer.missing_chunks(layer.bounds)
    assert any(f"shard {layer.key}/{shards[-1].name} missing or empty" in m for m in named), named
    got, missing = layer.read(layer.bounds, fill_missing=True)
    assert missing == named


@pytest.mark.parametrize("encoding,dtype", [("compressed_segmentation", "uint32"), ("jpeg", "uint8")])
def test_other_encodings_read_through_the_store_equal_cloudvolume(tmp_path, encoding, dtype):
    """A compressed_segmentation or jpeg input: chunks fetched through the store, decoded by
    cloud-volume's codecs; equal to cloud-volume's own read (and, lossless, to what was written)."""
    from cloudvolume import CloudVolume

    rng = np.random.default_rng(2)
    vol = rng.integers(0, 5, (1, 8, 16, 24)).astype(dtype) * 40
    url = ts_layer(tmp_path / encoding, vol, encoding=encoding)
    layer = PrecomputedLayer(url, 0)
    got, missing = layer.read(layer.bounds)
    b, e = layer.bounds.begin.xyz(), layer.bounds.end.xyz()
    ref = np.asarray(CloudVolume(url.cloudpath(), progress=False)[b[0] : e[0], b[1] : e[1], b[2] : e[2]])
    assert missing == [] and np.array_equal(got, ref.transpose(3, 2, 1, 0))
    if encoding == "compressed_segmentation":
        assert np.array_equal(got, vol)
