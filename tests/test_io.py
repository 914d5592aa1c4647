"""io: chunk round trips (cloud-volume, tensorstore), atomicity (T2, T10), one representation per chunk
(T17), unsafe info keys (T28c), zarr input, manifests, s3:// against a loopback moto server."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import DataError
from znni_core.geometry import Coordinate, Roi
from znni_core.io import (
    PrecomputedLayer,
    ScaleSpec,
    ZarrLayer,
    atomic_write,
    check_key,
    clean_stale_temporaries,
    create_layer,
    open_output,
    parse_layer_url,
    read_manifest,
    write_manifest,
)

from .pipeline_helpers import sharded_input

PROV = {"description": "test", "owners": [], "processing": [], "sources": []}


def make_layer(
    tmp_path, name="out", dtype="float32", channels=2, bounds=Roi((2, 3, 4), (10, 20, 30)), chunk=(4, 8, 16)
):
    url = parse_layer_url("file://" + str(tmp_path / name))
    spec = ScaleSpec("8_8_40", bounds, Coordinate(chunk), (40.0, 8.0, 8.0), dtype, channels)
    create_layer(url, spec, PROV)
    return url, spec, PrecomputedLayer(url, 0)


def fill(layer, arr, compress="none"):
    for idx in layer.grid.chunks_in(layer.bounds):
        sl = layer.grid.chunk_roi(idx).to_slices(layer.bounds.offset)
        d = layer.write_chunk(idx, np.ascontiguousarray(arr[(slice(None),) + sl]), compress=compress)
        layer.verify_chunk(idx, d)


def test_roundtrip_cloudvolume_and_tensorstore(tmp_path):
    import tensorstore as ts

    url, spec, layer = make_layer(tmp_path)
    arr = np.random.default_rng(0).random((2, 10, 20, 30)).astype(np.float32)
    fill(layer, arr)
    got, missing = layer.read(layer.bounds)
    assert missing == [] and np.array_equal(got, arr)
    t = ts.open({"driver": "neuroglancer_precomputed", "kvstore": str(url).replace("file://", "file://")}).result()
    b, e = layer.bounds.begin.xyz(), layer.bounds.end.xyz()
    ts_arr = t[b[0] : e[0], b[1] : e[1], b[2] : e[2], :].read().result()  # (x, y, z, c)
    assert np.array_equal(np.asarray(ts_arr).transpose(3, 2, 1, 0), arr)
    # a sub-box that crosses chunk borders
    r = Roi((5, 9, 17), (3, 7, 9))
    sub, _ = layer.read(r)
    assert np.array_equal(sub, arr[(slice(None),) + r.to_slices(layer.bounds.offset)])


def test_create_layer_once_and_mismatch_is_an_error(tmp_path):
    url, spec, _ = make_layer(tmp_path)
    assert create_layer(url, spec, PROV) == "exists"
    other = ScaleSpec(spec.key, Roi((0, 0, 0), (10, 20, 30)), spec.chunk_shape, spec.resolution, "uint8", 2)
    with pytest.raises(DataError) as e:
        create_layer(url, other, PROV)
    assert "dtype" in str(e.value) and "bounds" in str(e.value)
    with pytest.raises(DataError, match="does not match"):  # T18: a worker opening a mismatched layer
        open_output(url, other)


def test_T18_many_creators_write_info_once(tmp_path):
    url = parse_layer_url("file://" + str(tmp_path / "out"))
    spec = ScaleSpec("k", Roi((0, 0, 0), (4, 4, 4)), Coordinate(2, 2, 2), (1.0, 1.0, 1.0), "float32", 1)
    results = []
    ts = [threading.Thread(target=lambda: results.append(create_layer(url, spec, PROV))) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(results) == ["created"] + ["exists"] * 7


def test_T17_one_representation_per_chunk(tmp_path):
    url, spec, layer = make_layer(tmp_path, channels=1)
    idx = Coordinate(0, 0, 0)
    a = np.ones((1, 4, 8, 16), np.float32)
    b = np.full((1, 4, 8, 16), 2, np.float32)
    name = layer.chunk_name(idx)
    layer.write_chunk(idx, a, compress="gzip")
    assert (url.local_path / (name + ".gz")).is_file()
    layer.write_chunk(idx, b, compress="none")
    files = sorted(p.name for p in (url.local_path / spec.key).iterdir())
    assert files == [name.split("/")[1]]
    got, _ = layer.read(layer.grid.chunk_roi(idx))
    assert np.array_equal(got, b)
    layer.write_chunk(idx, a, compress="gzip")
    assert sorted(p.name for p in (url.local_path / spec.key).iterdir()) == [name.split("/")[1] + ".gz"]
    got, _ = layer.read(layer.grid.chunk_roi(idx))
    assert np.array_equal(got, a)
    # two representations planted by another tool: verification refuses to guess
    (url.local_path / name).write_bytes(b.tobytes())
    with pytest.raises(DataError, match="stored as"):
        layer.read_chunk_bytes(idx)


@pytest.mark.parametrize("key", ["../../evil", "/abs/path", "a/../../b", "..", "c:\\x", "a\\b", ""])
def test_T28c_unsafe_keys_refused_before_any_write(tmp_path, key):
    layer_dir = tmp_path / "nest" / "layer"
    layer_dir.mkdir(parents=True)
    info = {
        "type": "image",
        "data_type": "uint8",
        "num_channels": 1,
        "scales": [
            {
                "key": key,
                "size": [4, 4, 4],
                "voxel_offset": [0, 0, 0],
                "chunk_sizes": [[2, 2, 2]],
                "resolution": [1, 1, 1],
                "encoding": "raw",
            }
        ],
    }
    (layer_dir / "info").write_text(json.dumps(info))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(DataError):
        PrecomputedLayer(parse_layer_url("file://" + str(layer_dir)), 0)
    url = parse_layer_url("file://" + str(tmp_path / "new"))
    spec = ScaleSpec(key, Roi((0, 0, 0), (4, 4, 4)), Coordinate(2, 2, 2), (1.0, 1.0, 1.0), "uint8", 1)
    with pytest.raises(DataError):
        create_layer(url, spec, PROV)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_check_key_accepts_normal_keys():
    assert check_key("8_8_40") == "8_8_40"
    assert check_key("mip/0") == "mip/0"


def _cloudvolume(url, **kw):
    """cloud-volume's own reader of a layer: the independent reference of znni's reads."""
    from cloudvolume import CloudVolume

    return CloudVolume(url.cloudpath(), parallel=1, progress=False, cache=False, **kw)


def test_local_raw_reads_equal_cloudvolume(tmp_path):
    """A local raw layer is read from its chunk files (no cloud-volume import); the result equals
    cloud-volume's own read on boxes crossing chunk borders, raw and gzip chunks mixed, and a
    missing chunk is named (or zero-filled) the same way."""
    url, spec, layer = make_layer(tmp_path, dtype="uint16", channels=2)
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 60000, (2, 10, 20, 30)).astype(np.uint16)
    fill(layer, arr)
    for k, idx in enumerate(layer.grid.chunks_in(layer.bounds)):  # every other chunk gzip
        if k % 2:
            sl = layer.grid.chunk_roi(idx).to_slices(layer.bounds.offset)
            layer.write_chunk(idx, np.ascontiguousarray(arr[(slice(None),) + sl]), compress="gzip")
    for _ in range(6):
        lo = [int(rng.integers(b, e)) for b, e in zip(layer.bounds.begin, layer.bounds.end)]
        shape = [int(rng.integers(1, e - v + 1)) for v, e in zip(lo, layer.bounds.end)]
        r = Roi(lo, shape)
        got, missing = layer.read(r)
        b, e = r.begin.xyz(), r.end.xyz()
        ref = np.asarray(_cloudvolume(url)[b[0] : e[0], b[1] : e[1], b[2] : e[2]]).transpose(3, 2, 1, 0)
        assert missing == [] and got.dtype == np.uint16 and np.array_equal(got, ref)
        assert np.array_equal(got, arr[(slice(None),) + r.to_slices(layer.bounds.offset)])
    idx = Coordinate(0, 1, 1)
    for s in ("", ".gz"):
        (url.local_path / (layer.chunk_name(idx) + s)).unlink(missing_ok=True)
    with pytest.raises(DataError, match="missing or empty"):
        layer.read(layer.bounds)
    got, missing = layer.read(layer.bounds, fill_missing=True)
    ref = np.asarray(_cloudvolume(url, fill_missing=True)[:, :, :]).transpose(3, 2, 1, 0)
    assert missing == [layer.chunk_name(idx)] and np.array_equal(got, ref)


def test_local_chunks_in_other_compressions_equal_cloudvolume(tmp_path):
    """Chunks cloud-volume (or igneous) stored as ``*.br``, ``*.zstd``, ``*.xz``, ``*.bz2`` are
    decoded by znni's store; the read equals cloud-volume's."""
    from cloudfiles.compression import compress

    url, spec, layer = make_layer(tmp_path, dtype="uint16", channels=1)
    arr = np.random.default_rng(4).integers(0, 60000, (1, 10, 20, 30)).astype(np.uint16)
    fill(layer, arr)
    codecs = ("br", "zstd", "xz", "bz2")
    for k, idx in enumerate(layer.grid.chunks_in(layer.bounds)):
        path = url.local_path / layer.chunk_name(idx)
        enc = codecs[k % len(codecs)]
        (path.parent / (path.name + "." + enc)).write_bytes(compress(path.read_bytes(), enc))
        path.unlink()
    got, missing = PrecomputedLayer(url, 0).read(layer.bounds)
    ref = np.asarray(_cloudvolume(url)[:, :, :]).transpose(3, 2, 1, 0)
    assert missing == [] and np.array_equal(got, arr) and np.array_equal(got, ref)


def test_missing_input_chunks_are_named(tmp_path):
    url, spec, layer = make_layer(tmp_path, dtype="uint8", channels=1)
    arr = np.full((1, 10, 20, 30), 7, np.uint8)
    fill(layer, arr)
    idx = Coordinate(1, 1, 0)
    name = layer.chunk_name(idx)
    (url.local_path / name).write_bytes(b"")  # 0-byte chunk
    with pytest.raises(DataError, match="missing or empty") as e:
        layer.read(layer.bounds)
    assert name in str(e.value)
    got, missing = layer.read(layer.bounds, fill_missing=True)
    assert missing == [name]
    assert (got == 0).sum() == layer.grid.chunk_roi(idx).size


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from znni_core.io import parse_layer_url, PrecomputedLayer
    layer = PrecomputedLayer(parse_layer_url(sys.argv[1]), 0)
    a = [np.full((1, 64, 128, 128), v, np.float32) for v in (1.0, 2.0)]
    print("ready", flush=True)
    i = 0
    while True:
        layer.write_chunk((0, 0, 0), a[i % 2]); i += 1
""")


T2_TRIALS = 20  # kills at seeded random moments, every one must leave a whole chunk or none


def test_T2_sigkill_during_writes_never_leaves_a_torn_chunk_20_trials(tmp_path):
    url, spec, layer = make_layer(tmp_path, channels=1, bounds=Roi((0, 0, 0), (64, 128, 128)), chunk=(64, 128, 128))
    valid = {np.full((1, 64, 128, 128), v, np.float32).tobytes() for v in (1.0, 2.0)}
    rng = np.random.default_rng(1234)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for trial in range(T2_TRIALS):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(url)], stdout=subprocess.PIPE, env=env)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.02, 0.3)))
        p.send_signal(signal.SIGKILL)
        p.wait()
        data = layer.read_chunk_bytes((0, 0, 0))
        assert data is None or data in valid, f"trial {trial}: torn chunk readable"
    # the next good write leaves no temporary file of the killed writers behind
    layer.write_chunk((0, 0, 0), np.zeros((1, 64, 128, 128), np.float32))
    assert [p.name for p in (url.local_path / spec.key).iterdir()] == [layer.chunk_name((0, 0, 0)).split("/")[1]]


def test_T10_concurrent_identical_writers(tmp_path):
    url, spec, layer = make_layer(tmp_path, channels=1, bounds=Roi((0, 0, 0), (16, 64, 64)), chunk=(16, 64, 64))
    a = np.random.default_rng(0).random((1, 16, 64, 64)).astype(np.float32)
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            d = layer.read_chunk_bytes((0, 0, 0))
            if d is not None:
                seen.append(d == a.tobytes())

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=lambda: [layer.write_chunk((0, 0, 0), a) for _ in range(10)]) for _ in range(4)]
    [w.start() for w in ws]
    [w.join() for w in ws]
    stop.set()
    r.join()
    assert seen and all(seen)
    assert layer.read_chunk_bytes((0, 0, 0)) == a.tobytes()


def test_atomic_write_exclusive_and_stale_cleanup(tmp_path):
    p = tmp_path / "f"
    assert atomic_write(p, b"one", exclusive=True)
    assert not atomic_write(p, b"two", exclusive=True)
    assert p.read_bytes() == b"one"
    dead = tmp_path / f".f.znni-tmp.{os.uname().nodename.split('.')[0]}.999999999.abcd"
    dead.write_bytes(b"x")
    other = tmp_path / ".f.znni-tmp.otherhost.1.abcd"
    other.write_bytes(b"x")
    removed = clean_stale_temporaries(tmp_path)
    assert dead in removed and other.exists()
    assert other in clean_stale_temporaries(tmp_path, all_hosts=True)


def test_a_chunk_write_lists_only_the_writes_in_flight_not_the_layer(tmp_path, monkeypatch):
    """A layer's object goes through a temporary in its directory's ``.znni-tmp``: a write looks
    for dead writers' temporaries there (and removes one of its own name), never listing the
    directory of the layer's chunks (a million shards: listing it at every write made a run
    quadratic); the emptied ``.znni-tmp`` goes too."""
    import znni_core.io.atomic as atomic

    url, spec, layer = make_layer(tmp_path, channels=1)
    idx = Coordinate(0, 0, 0)
    name = layer.chunk_name(idx)
    chunks_dir = url.local_path / spec.key
    chunks_dir.mkdir(parents=True, exist_ok=True)
    for k in range(50):  # other chunks beside it
        (chunks_dir / f"other-{k}").write_bytes(b"x")
    host = os.uname().nodename.split(".")[0]
    dead = chunks_dir / atomic.TMP_DIR / f".{name.split('/')[1]}.znni-tmp.{host}.999999999.abcd"
    dead.parent.mkdir()
    dead.write_bytes(b"torn")
    listed = []
    real = os.scandir
    monkeypatch.setattr(atomic.os, "scandir", lambda d: listed.append(Path(d)) or real(d))
    layer.write_chunk(idx, np.ones((1, 4, 8, 16), np.float32), compress="none")
    assert listed == [chunks_dir / atomic.TMP_DIR], listed
    assert not dead.exists() and not dead.parent.exists()
    got, _ = layer.read(layer.grid.chunk_roi(idx))
    assert (got == 1).all()


def test_manifest_roundtrip_and_errors(tmp_path):
    m = {
        "task": 3,
        "chunks": [{"name": "k/0-1_0-1_0-1", "status": "written", "sha256": "ab"}],
        "run_digest": "r",
        "plan_digest": "p",
        "network_digest": "n",
        "layer": "file:///x",
    }
    p = write_manifest(tmp_path / "m.json", m)
    assert read_manifest(p)["task"] == 3
    with pytest.raises(DataError, match="missing"):
        read_manifest(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DataError, match="not valid JSON"):
        read_manifest(tmp_path / "bad.json")
    write_manifest(tmp_path / "inc.json", dict(m, chunks=[{"name": "x", "status": "written"}]))
    with pytest.raises(DataError, match="incomplete"):
        read_manifest(tmp_path / "inc.json")


@pytest.mark.parametrize("fmt", [2, 3])
def test_zarr_input(tmp_path, fmt):
    import zarr

    path = tmp_path / "em.zarr"
    arr = np.random.default_rng(0).integers(0, 255, (10, 20, 30), dtype=np.uint8)
    z = zarr.create_array(str(path), shape=arr.shape, chunks=(4, 8, 8), dtype="uint8", zarr_format=fmt)
    z[:] = arr
    z.attrs["resolution"] = [40, 8, 8]
    layer = ZarrLayer(parse_layer_url(str(path)))
    assert layer.bounds == Roi((0, 0, 0), (10, 20, 30)) and layer.channels == 1
    r = Roi((1, 2, 3), (5, 9, 11))
    got, missing = layer.read(r)
    assert missing == [] and np.array_equal(got[0], arr[r.to_slices()])
    # delete one chunk: missing data is an error, not silent fill values (T26)
    key = z._async_array.metadata.encode_chunk_key((0, 0, 0))
    os.unlink(path / key)
    with pytest.raises(DataError, match="missing"):
        layer.read(r)
    got, missing = layer.read(r, fill_missing=True)
    assert missing == [key]


@pytest.mark.parametrize("channels", [None, 2])
def test_sharded_zarr_input_names_a_missing_shard_and_a_chunk_its_index_lacks(tmp_path, channels):
    """A sharded zarr v3 input (shards of 2 x 2 x 2 chunks): one shard file deleted, and one
    chunk of another shard never stored (all zeros: zarr writes no empty chunk).  Both are
    refused, each chunk named; with filling, every one is listed and only they read as 0."""
    import zarr

    path = tmp_path / "em.zarr"
    lead = () if channels is None else (channels,)
    arr = np.random.default_rng(0).integers(1, 255, lead + (16, 16, 16), dtype=np.uint8)
    arr[(Ellipsis, slice(8, 12), slice(0, 4), slice(4, 8))] = 0  # chunk (2, 0, 1): shard (1, 0, 0)
    z = zarr.create_array(
        str(path), shape=arr.shape, chunks=lead + (4, 4, 4), shards=lead + (8, 8, 8), dtype="uint8", fill_value=0
    )
    z[:] = arr
    z.attrs["resolution"] = [40, 8, 8]
    layer = ZarrLayer(parse_layer_url(str(path)))
    assert layer.sharded and layer.missing_chunks(Roi((0, 0, 0), (8, 16, 16))) == []
    meta = z._async_array.metadata
    key = meta.encode_chunk_key((0,) * len(lead) + (0, 1, 1))  # chunks (0-1, 2-3, 2-3)
    os.unlink(path / key)
    with pytest.raises(DataError, match="missing or empty") as e:
        layer.read(layer.bounds)
    assert key in str(e.value)
    got, missing = layer.read(layer.bounds, fill_missing=True)
    gone = [m for m in missing if "shard missing" in m]
    assert len(gone) == 8 and all(m.startswith(key + "[") for m in gone)
    inner = ",".join(["0"] * len(lead) + ["0", "0", "1"])
    hole = meta.encode_chunk_key((0,) * len(lead) + (1, 0, 0)) + f"[{inner}]"
    assert sorted(set(missing) - set(gone)) == [hole]
    expect = arr.copy()
    expect[(Ellipsis, slice(0, 8), slice(8, 16), slice(8, 16))] = 0
    assert np.array_equal(got.reshape(expect.shape), expect)


def test_sharded_precomputed_input_names_a_missing_shard_and_a_chunk_its_index_lacks(tmp_path):
    """The same for a sharded precomputed input (cloud-volume fills its absent chunks with 0
    whatever ``fill_missing`` says): a shard deleted, a chunk left out of another shard."""
    url, layer, vol, shards = sharded_input(tmp_path)
    names = sorted(shards)
    left_out = sorted(shards[names[1]])[-1]
    for name, chunks in shards.items():
        layer.write_shard({i: a for i, a in chunks.items() if not (name == names[1] and i == left_out)})
    assert layer.missing_chunks(layer.bounds) == [f"{layer.chunk_name(left_out)} (not in shard {names[1]})"]
    (url.local_path / names[0]).unlink()
    layer = PrecomputedLayer(url, 0)
    with pytest.raises(DataError, match="missing or empty") as e:
        layer.read(layer.bounds)
    assert names[0] in str(e.value)
    got, missing = layer.read(layer.bounds, fill_missing=True)
    assert len(missing) == len(shards[names[0]]) + 1
    expect = vol.copy()
    for i in list(shards[names[0]]) + [left_out]:
        expect[(slice(None),) + layer.grid.chunk_roi(i).to_slices()] = 0
    assert np.array_equal(got, expect)


def test_urls():
    from znni_core.errors import ConfigError

    assert parse_layer_url("/a/b").cloudpath() == "file:///a/b"
    assert parse_layer_url("gs://bucket/x/").path == "bucket/x"
    assert parse_layer_url("/a/b.zarr").format == "zarr"
    for bad in ("ftp://x/y", "file://rel/path", "s3://bucket/../x", ""):
        with pytest.raises(ConfigError):
            parse_layer_url(bad)


def test_s3_output_against_loopback_server(moto_s3):
    url = parse_layer_url("s3://znni/layers/out", endpoint=moto_s3)
    spec = ScaleSpec("8_8_40", Roi((0, 0, 0), (6, 20, 20)), Coordinate(4, 16, 16), (40.0, 8.0, 8.0), "float32", 1)
    assert create_layer(url, spec, PROV) == "created"
    assert create_layer(url, spec, PROV) == "exists"
    layer = open_output(url, spec)
    arr = np.random.default_rng(0).random((1, 6, 20, 20)).astype(np.float32)
    fill(layer, arr, compress="gzip")
    got, _ = layer.read(layer.bounds)
    assert np.array_equal(got, arr)
    import boto3

    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket="znni")["Contents"]]
    assert "layers/out/info" in keys and "layers/out/8_8_40/0-16_0-16_0-4" in keys


def test_s3_sharded_output_one_put_per_shard(moto_s3):
    from znni_core.io.sharding import shard_chunks

    url = parse_layer_url("s3://znni/layers/sharded", endpoint=moto_s3)
    sharding = {
        "@type": "neuroglancer_uint64_sharded_v1",
        "preshift_bits": 2,
        "hash": "identity",
        "minishard_bits": 0,
        "shard_bits": 3,
        "minishard_index_encoding": "gzip",
        "data_encoding": "gzip",
    }
    spec = ScaleSpec(
        "8_8_40", Roi((0, 0, 0), (6, 20, 20)), Coordinate(4, 8, 8), (40.0, 8.0, 8.0), "float32", 1, sharding=sharding
    )
    create_layer(url, spec, PROV)
    layer = open_output(url, spec)
    arr = np.random.default_rng(0).random((1, 6, 20, 20)).astype(np.float32)
    grid = layer.grid
    box = shard_chunks(sharding, grid.grid_shape)
    names = []
    for s in itertools.product(*(range(0, n, b) for n, b in zip(grid.grid_shape, box))):
        idxs = [
            Coordinate(i)
            for i in itertools.product(*(range(a, min(a + b, n)) for a, b, n in zip(s, box, grid.grid_shape)))
        ]
        chunks = {i: np.ascontiguousarray(arr[(slice(None),) + grid.chunk_roi(i).to_slices()]) for i in idxs}
        names.append(layer.write_shard(chunks)["name"])
    got, _ = layer.read(layer.bounds)  # cloud-volume through the endpoint alias
    assert np.array_equal(got, arr)
    import boto3

    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=moto_s3).list_objects_v2(Bucket="znni")["Contents"]]
    assert sorted(k for k in keys if k.endswith(".shard")) == sorted("layers/sharded/" + n for n in names)
    assert len(set(names)) == len(names) > 1 and not any(k.endswith("-4") for k in keys)


def test_s3_exclusive_writes_are_conditional_puts(moto_s3):
    """Creating a layer's info on S3 is a conditional PUT (If-None-Match: *): of eight creators
    racing from threads exactly one stores its body, the others are told it exists (no
    check-then-PUT window)."""
    from concurrent.futures import ThreadPoolExecutor

    from znni_core.io.store import object_store

    url = parse_layer_url("s3://znni/layers/race", endpoint=moto_s3)
    won = list(
        ThreadPoolExecutor(8).map(lambda i: object_store(url).put_json("info", {"writer": i}, exclusive=True), range(8))
    )
    assert won.count(True) == 1, won
    assert object_store(url).get_json("info") == {"writer": won.index(True)}
    assert object_store(url).put_json("info", {"writer": 99}) is True  # an unconditional write replaces it
    assert object_store(url).get_json("info") == {"writer": 99}
