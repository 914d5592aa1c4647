"""Storage faults of docs/reliability.md: T6 (disk full during a chunk write), T7 (transient and permanent
S3 errors), T8 (corrupted transfers), T28d (no credential leaks).

The cases run with ``make test`` except the end-to-end T7 task (``slow``).  T7's time limits are
loose upper bounds (a permanent 403 takes one request, about 0.05 s here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tests import faults_helpers as H


def _can_mount_tmpfs(tmp_path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    d = tmp_path / "probe"
    d.mkdir()
    ok = (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True).returncode == 0
    )
    if ok:
        subprocess.run(["umount", str(d)], check=True)
    return ok


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A case whose every task ran (chunks + manifests): the uninterrupted layer."""
    case = H.prepare(H.make_case(tmp_path_factory.mktemp("t6") / "base"))
    for t in case.tasks():
        assert H.run_task_proc(case, t["id"]).exitcode == 0
    return case


@pytest.fixture
def small_disk(tmp_path):
    """Mount a small tmpfs; yields a function that fills it up to ``free`` bytes left."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and tmpfs mounts")
    mounts = []

    def mount(where, size_kb):
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)], check=True)
        mounts.append(where)
        return where

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], check=False)


def _fill(directory, leave_bytes: int):
    """Fill the file system of ``directory`` until at most ``leave_bytes`` are free."""
    filler = directory / f".filler-{uuid.uuid4().hex[:6]}"
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave_bytes))
            f.flush()
        except OSError:
            pass
    return filler


def test_t6_disk_full_during_chunk_write(finished, small_disk, tmp_path):
    """ENOSPC while a task rewrites its chunk: CE naming the chunk, no manifest, the previous
    version of the chunk intact; after space is freed the rerun is BI and leaves no temporaries."""
    case = finished.copy(tmp_path / "case")
    golden = H.layer_files(finished.out)
    # the output layer lives on a small tmpfs: a copy of the finished layer, then (almost) full
    shutil.rmtree(case.out)
    small_disk(case.out, 1024)
    shutil.copytree(finished.out, case.out, dirs_exist_ok=True)
    task = 3
    case.manifest(task).unlink()
    filler = _fill(case.out, 2048)  # the chunk (about 21 kB) cannot be written
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode != 0, "a chunk write on a full disk was reported as success"
    err = p.stderr
    assert "Traceback" not in err, err[-3000:]
    assert "space" in err.lower() or "ENOSPC" in err or "errno 28" in err.lower(), err[-3000:]
    chunk_names = {n.split("/")[-1] for n in golden}
    assert any(n in err for n in chunk_names), f"the error does not name the chunk:\n{err[-3000:]}"
    assert not case.manifest(task).exists(), "done-marker written after a failed chunk write"
    filler.unlink()
    H.assert_same_chunks(H.layer_files(case.out), golden, "T6: previous versions after ENOSPC")
    # the next good run: BI and no stray temporaries
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert H.manifest_ok(case, task) is True
    H.assert_same_chunks(H.layer_files(case.out), golden, "T6 after the rerun")
    assert not H.temporaries(case.out)


def test_t6_disk_full_for_manifest(finished, small_disk, tmp_path):
    """ENOSPC while writing the done-marker: CE, no (partial) manifest; rerun completes."""
    case = finished.copy(tmp_path / "case")
    task = 5
    case.manifest(task).unlink()
    mdir = case.work / "manifests"
    saved = tmp_path / "saved-manifests"
    shutil.copytree(mdir, saved)
    shutil.rmtree(mdir)
    small_disk(mdir, 64)
    shutil.copytree(saved, mdir, dirs_exist_ok=True)
    filler = _fill(mdir, 0)
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode != 0, "a manifest write on a full disk was reported as success"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not case.manifest(task).exists(), "partial done-marker left"
    assert not [q for q in mdir.iterdir() if ".znni-tmp." in q.name]
    filler.unlink()
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert H.manifest_ok(case, task) is True


@pytest.fixture
def backoff(monkeypatch):
    """The waits botocore's retries ask for (``botocore.endpoint`` sleeps between attempts),
    recorded instead of slept: a bound is asserted on attempts and waits, never on wall time."""
    import time as real_time

    import botocore.endpoint

    waits = []

    class _Time:
        def __getattr__(self, name):
            return getattr(real_time, name)

        @staticmethod
        def sleep(seconds):
            waits.append(float(seconds))

    monkeypatch.setattr(botocore.endpoint, "time", _Time())
    return waits


#: botocore's standard retry mode caps each wait at 20 s (s3.py's bounded backoff)
MAX_WAIT_S = 20.0


# ---- T7 / T8: a loopback S3 that fails or corrupts on purpose -------------------------------------
@pytest.fixture
def s3(monkeypatch, tmp_path):
    pytest.importorskip("moto")
    from tests.http_faults import S3Faults

    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    from cloudfiles import secrets

    secrets.AWS_CREDENTIALS_CACHE.clear()
    with S3Faults() as srv:
        yield srv


def _s3_layer(endpoint, name="out"):
    from znni_core.geometry import Coordinate, Roi
    from znni_core.io import ScaleSpec, create_layer, open_output
    from znni_core.io.paths import parse_layer_url

    url = parse_layer_url(f"s3://znni/layers/{name}", endpoint=endpoint)
    spec = ScaleSpec("8_8_40", Roi((0, 0, 0), (8, 32, 32)), Coordinate(4, 16, 16), (40.0, 8.0, 8.0), "float32", 1)
    create_layer(url, spec, {"description": "t", "owners": [], "processing": [], "sources": []})
    return open_output(url, spec)


def _arr(layer, idx, seed=0):
    import numpy as np

    shape = (layer.channels,) + tuple(layer.grid.chunk_roi(idx).shape)
    return np.random.default_rng(seed).random(shape).astype(np.float32)


@pytest.mark.parametrize("action", ["503", "500", "reset"])
def test_t7_transient_s3_errors_retried(s3, backoff, action):
    """Transient errors on chunk PUTs and GETs: retried with bounded backoff (one wait per
    failed attempt, each within the cap), chunks BI."""
    layer = _s3_layer(s3.endpoint)
    idxs = list(layer.grid.chunks_in(layer.bounds))
    s3.rule("PUT", "/8_8_40/", action, times=2)
    s3.rule("GET", "/8_8_40/", action, times=2)
    for i, idx in enumerate(idxs):
        d = layer.write_chunk(idx, _arr(layer, idx, i))
        layer.verify_chunk(idx, d)
    assert sum(1 for _, p, a in s3.log if a == action) == 4, s3.log  # the faults did happen
    assert len(backoff) == 4 and all(0 <= w <= MAX_WAIT_S for w in backoff), backoff
    stored = s3.objects()
    for i, idx in enumerate(idxs):
        assert stored["layers/out/" + layer.chunk_name(idx)] == _arr(layer, idx, i).tobytes()


@pytest.mark.parametrize("method", ["PUT", "GET"])
def test_t7_permanent_403_is_a_clear_error_without_retry_storm(s3, backoff, method):
    """A permanent 403 on a chunk PUT (or its read-back GET): a StoragePermissionError naming the key and
    the fix after one request and no wait (no retry storm); nothing counts as written."""
    from znni_core.errors import StoragePermissionError

    layer = _s3_layer(s3.endpoint)
    idx = next(iter(layer.grid.chunks_in(layer.bounds)))
    key = "layers/out/" + layer.chunk_name(idx)
    s3.rule(method, "/8_8_40/", "403")
    with pytest.raises(StoragePermissionError) as ei:
        d = layer.write_chunk(idx, _arr(layer, idx))
        layer.verify_chunk(idx, d)  # the digest a task records only after this returns
    n = s3.requests(method, "/8_8_40/")
    assert n == 1, f"{n} {method}s for a permanent 403 (a retry storm): {s3.log}"
    assert backoff == [], f"waited {backoff} s before giving up on a permanent 403"
    msg = str(ei.value)
    assert "403" in msg and "AccessDenied" in msg, msg
    assert f"s3://znni/{key}" in msg and s3.endpoint in msg, msg
    assert "credentials" in msg and "bucket policy" in msg and "not retried" in msg, msg
    assert "testing" not in msg, msg  # the access key id (and secret) of the environment is never shown
    if method == "PUT":
        assert key not in s3.objects()


def _s3_input(s3):
    """A raw precomputed input layer on the loopback S3, and its (C, z, y, x) data."""
    import numpy as np

    layer = _s3_layer(s3.endpoint, "input")
    data = np.random.default_rng(5).random((1,) + tuple(layer.bounds.shape)).astype(np.float32)
    for idx in layer.grid.chunks_in(layer.bounds):
        roi = layer.grid.chunk_roi(idx)
        layer.write_chunk(idx, np.ascontiguousarray(data[(slice(None),) + roi.to_slices(layer.bounds.offset)]))
    return layer, data


def test_t7_s3_input_reads_through_the_bounded_store(s3, backoff):
    """An s3:// input is read chunk by chunk through znni's S3 store (not cloudfiles' retries):
    equal to what was written; a transient 503 on two GETs is retried with bounded waits."""
    import numpy as np

    from znni_core.io import PrecomputedLayer

    layer, data = _s3_input(s3)
    inp = PrecomputedLayer(layer.url)
    s3.rule("GET", "/8_8_40/", "503", times=2)
    got, missing = inp.read(inp.bounds)
    np.testing.assert_array_equal(got, data)
    assert missing == [] and sum(1 for _, _, a in s3.log if a == "503") == 2, s3.log
    assert len(backoff) == 2 and all(0 <= w <= MAX_WAIT_S for w in backoff), backoff


def test_t7_s3_input_403_fails_at_once(s3, backoff):
    """A permanent 403 on an s3:// input's chunk GET: a StoragePermissionError naming the key after
    one request per chunk in flight and no wait (cloudfiles retried such a GET seven times)."""
    from znni_core.errors import StoragePermissionError
    from znni_core.io import PrecomputedLayer

    layer, _ = _s3_input(s3)
    inp = PrecomputedLayer(layer.url)
    before = s3.requests("GET", "/8_8_40/")
    s3.rule("GET", "/8_8_40/", "403")
    with pytest.raises(StoragePermissionError) as ei:
        inp.read(inp.bounds)
    n = s3.requests("GET", "/8_8_40/") - before
    chunks = layer.grid.num_chunks
    assert 1 <= n <= chunks, f"{n} GETs of {chunks} chunks for a permanent 403: {s3.log}"
    assert backoff == [], backoff
    assert "403" in str(ei.value) and "s3://znni/layers/input/8_8_40/" in str(ei.value), ei.value


def _sharded_input(tmp_path, put, prefix):
    """A sharded precomputed input written by tensorstore (identity hash, gzip chunks and
    minishard indices), copied object by object under ``prefix``; its (C, z, y, x) data."""
    import numpy as np

    from tests.test_sharding import _sharding, ts_layer

    vol = np.random.default_rng(8).integers(1, 60000, (1, 8, 24, 16)).astype(np.uint16)
    url = ts_layer(tmp_path / "sharded", vol, sharding=_sharding("identity", "gzip"))
    for f in sorted(url.local_path.rglob("*")):
        if f.is_file():
            put(f"{prefix}/{f.relative_to(url.local_path)}", f.read_bytes())
    return vol


def test_t7_sharded_s3_input_is_read_by_ranges_through_the_bounded_store(s3, backoff, tmp_path):
    """A sharded s3:// input: shard indices, minishard indices and chunks are ranged GETs through
    znni's S3 store (not cloudfiles'), each index read once; two 503s are retried with bounded
    waits; a permanent 403 fails at once (at most one request per shard, no wait) naming the shard."""
    import numpy as np

    from znni_core.errors import StoragePermissionError
    from znni_core.io import PrecomputedLayer, parse_layer_url

    vol = _sharded_input(tmp_path, s3.put, "layers/sharded")
    layer = PrecomputedLayer(parse_layer_url("s3://znni/layers/sharded", endpoint=s3.endpoint))
    s3.rule("GET", ".shard", "503", times=2)
    got, missing = layer.read(layer.bounds)
    assert missing == [] and np.array_equal(got, vol)
    assert sum(1 for _, _, a in s3.log if a == "503") == 2, s3.log
    assert len(backoff) == 2 and all(0 <= w <= MAX_WAIT_S for w in backoff), backoff
    shards = {p for m, p, _ in s3.log if m == "GET" and ".shard" in p}
    gets = s3.requests("GET", ".shard") - 2
    chunks = layer.grid.num_chunks
    assert len(shards) >= 2 and gets <= chunks + 2 * len(shards) * 2, (gets, chunks, s3.log)

    s3.clear()
    backoff.clear()
    layer = PrecomputedLayer(parse_layer_url("s3://znni/layers/sharded", endpoint=s3.endpoint))
    before = s3.requests("GET", ".shard")
    s3.rule("GET", ".shard", "403")
    with pytest.raises(StoragePermissionError) as ei:
        layer.read(layer.bounds)
    n = s3.requests("GET", ".shard") - before
    assert 1 <= n <= len(shards), f"{n} GETs for a permanent 403 (at most one per shard): {s3.log}"
    assert backoff == [], backoff
    assert "403" in str(ei.value) and ".shard" in str(ei.value), ei.value


@pytest.mark.slow
def test_t7_403_in_a_task_fails_cleanly_and_is_not_marked_done(s3, tmp_path):
    """`znni run-task` writing to S3 that answers 403 to every chunk PUT: exit != 0 after one PUT
    (no retry storm), no traceback, the message names the key and the fix, no manifest; after access is restored
    the rerun completes."""

    import yaml

    case = H.make_case(tmp_path / "case")
    cfg = yaml.safe_load(case.config.read_text())
    cfg["output"]["path"] = "s3://znni/layers/out"
    cfg["output"]["endpoint_url"] = s3.endpoint
    case.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    H.prepare(case)  # info + provenance written through the proxy, no faults yet
    seen = len(s3.log)
    s3.rule("PUT", "/layers/out/", "403")
    p = H.znni("run-task", case.run_file, "--task", 0, "--no-progress")
    err = p.stderr
    assert p.returncode != 0, "a task whose chunk PUT was refused reported success"
    assert "Traceback" not in err, err[-3000:]
    assert "403" in err and "AccessDenied" in err and "credentials" in err and "bucket policy" in err, err[-3000:]
    assert "s3://znni/layers/out/" in err, err[-3000:]
    puts = [q for m, q, _ in s3.log[seen:] if m == "PUT"]
    assert len(puts) == 1, f"{len(puts)} PUTs for a permanent 403: {puts}"
    assert not case.manifest(0).exists(), "done-marker written after a refused chunk PUT"
    assert not [k for k in s3.objects() if k.startswith("layers/out/") and k.count("/") >= 3], s3.objects().keys()
    s3.clear()
    p = H.znni("run-task", case.run_file, "--task", 0, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    from znni_core.io import read_manifest

    chunks = [c for c in read_manifest(case.manifest(0))["chunks"] if c["status"] == "written"]
    stored = s3.objects()
    assert chunks and all(H.digest(stored["layers/out/" + c["name"]]) == c["sha256"] for c in chunks)


def test_t7_5xx_that_never_ends_gives_up_after_bounded_attempts(s3, backoff, monkeypatch):
    """A server that answers 503 SlowDown forever: bounded attempts (ZNNI_S3_MAX_ATTEMPTS) and waits
    (one between attempts, each within the cap), a StorageError naming the key, the attempt count
    and what to do; not a DataError about checksums."""
    from znni_core.errors import StorageError, StoragePermissionError

    monkeypatch.setenv("ZNNI_S3_MAX_ATTEMPTS", "3")
    layer = _s3_layer(s3.endpoint)
    idx = next(iter(layer.grid.chunks_in(layer.bounds)))
    s3.rule("PUT", "/8_8_40/", "503")
    with pytest.raises(StorageError) as ei:
        layer.write_chunk(idx, _arr(layer, idx))
    assert not isinstance(ei.value, StoragePermissionError)
    assert s3.requests("PUT", "/8_8_40/") == 3, s3.log
    assert len(backoff) == 2 and all(0 <= w <= MAX_WAIT_S for w in backoff), backoff
    msg = str(ei.value)
    assert layer.chunk_name(idx) in msg and "after 3 attempts" in msg and "503" in msg, msg


def test_t7_s3_credentials_from_a_secrets_file(s3, monkeypatch, tmp_path):
    """znni's own S3 client finds credentials where cloudfiles does: ``<alias>-secret.json`` in the
    cloud-volume secrets directory first, else the environment (AWS_ACCESS_KEY_ID, ...)."""
    from cloudfiles import secrets

    from znni_core.io.paths import s3_alias

    layer = _s3_layer(s3.endpoint)  # info + provenance, signed with the environment's key
    assert set(s3.access_keys) == {"testing"}, s3.access_keys
    d = tmp_path / "secrets"
    d.mkdir()
    (d / f"{s3_alias(s3.endpoint)}-secret.json").write_text(
        '{"AWS_ACCESS_KEY_ID": "FROMFILE", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}'
    )
    monkeypatch.setattr(secrets, "CLOUD_VOLUME_SECRETS_DIR", str(d))
    from znni_core.io import open_output

    idx = next(iter(layer.grid.chunks_in(layer.bounds)))
    seen = len(s3.log)
    open_output(layer.url, layer.spec).write_chunk(idx, _arr(layer, idx))
    assert set(s3.access_keys[seen:]) == {"FROMFILE"}, list(zip(s3.log[seen:], s3.access_keys[seen:]))


@pytest.mark.parametrize("direction", ["GET", "PUT"])
def test_t8_corrupted_transfer_is_a_clear_error(s3, direction):
    """A flipped byte on the wire (upload or read-back): the chunk's checksum check fails: CE naming it."""
    from znni_core.errors import DataError

    layer = _s3_layer(s3.endpoint)
    idx = next(iter(layer.grid.chunks_in(layer.bounds)))
    s3.rule(direction, "/8_8_40/", "corrupt")
    with pytest.raises(DataError) as ei:
        d = layer.write_chunk(idx, _arr(layer, idx))
        layer.verify_chunk(idx, d)
    msg = str(ei.value)
    assert layer.chunk_name(idx) in msg, msg
    assert "sha256" in msg or "md5" in msg.lower(), msg


# ---- T28d: a canary secret in the credentials file never leaks ------------------------------------
def test_t28d_canary_secret_absent_from_logs_metadata_manifests_provenance(tmp_path, monkeypatch):
    """The whole workflow writes to a loopback S3 with credentials from a cloud-volume secrets file
    holding a canary; afterwards the canary is nowhere: Snakemake's output, job logs, .snakemake
    metadata, manifests, report, and every object of the bucket (info, provenance, chunks)."""
    import json

    import yaml

    pytest.importorskip("moto")
    from tests.http_faults import S3Faults

    canary = "CANARY-" + uuid.uuid4().hex
    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    cvdir = tmp_path / "cv"
    (cvdir / "secrets").mkdir(parents=True)
    secret = json.dumps(
        {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": canary, "AWS_DEFAULT_REGION": "us-east-1"}
    )
    with S3Faults() as s3:
        from znni_core.io.paths import s3_alias

        # cloudfiles looks up <service>-secret.json; with an endpoint the service is znni's alias
        for name in ("aws", s3_alias(s3.direct)):
            (cvdir / "secrets" / f"{name}-secret.json").write_text(secret)
        case = H.make_case(tmp_path / "case", task_chunks=(2, 1, 2))
        cfg = yaml.safe_load(case.config.read_text())
        cfg["output"]["path"] = "s3://znni/layers/out"
        cfg["output"]["endpoint_url"] = s3.direct
        case.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = H.job_env(extra={"CLOUD_VOLUME_DIR": str(cvdir), "CLOUD_FILES_DIR": str(cvdir)})
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            env.pop(k, None)
        p = H.snakemake(case, env=env, timeout=400)
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-4000:]
        objects = s3.objects()
    assert any(k.endswith("provenance") for k in objects) and len(objects) >= 4, sorted(objects)
    assert canary not in out
    leaks = [str(f) for f in case.root.rglob("*") if f.is_file() and canary.encode() in f.read_bytes()]
    assert not leaks, f"the secret leaked into {leaks}"
    assert not [k for k, v in objects.items() if canary.encode() in v], "the secret leaked into the bucket"
    assert (case.work / "manifests").is_dir() and (case.root / ".snakemake" / "metadata").is_dir()


# ---- gs://: znni's own GCS client against a loopback server (gcp-storage-emulator) ------------------


def test_gcs_store_round_trips_objects_and_a_whole_run(gcs_emulator, tmp_path):
    """On a real (loopback) GCS API: put/get (raw and gzip), sizes, delete, JSON; then a whole run
    whose output layer is ``gs://``: every task's chunks written and read back through znni's GCS
    client, finalize verifies them all and writes the sha256 index, and the layer read back
    equals the same run written locally."""
    from tests.pipeline_helpers import base_config, em
    from tests.test_pipeline import prepare, run_all
    from znni_core.io import PrecomputedLayer, parse_layer_url
    from znni_core.io.store import object_store
    from znni_core.pipeline.finalize import finalize

    store = object_store(parse_layer_url("gs://znni/store", what="test"))
    assert store.put("a/raw", b"bytes") and store.put("a/gz", b"zipped" * 100, compress="gzip")
    assert store.get("a/raw") == b"bytes" and store.get("absent") is None
    # a gzip object is stored with Content-Encoding gzip (GCS answers a raw download with that
    # header, which the client reads; the emulator stores it but does not send it back)
    assert _emulator_blob("store/a/gz").content_encoding == "gzip"
    assert store.sizes(["a/raw", "absent"]) == {"a/raw": 5, "absent": None} and store.exists("a/raw")
    store.put_json("j", {"k": [1, 2]})
    assert store.get_json("j") == {"k": [1, 2]}
    store.delete("a/raw")
    store.delete("a/raw")  # absent: fine
    assert not store.exists("a/raw")

    vol = em((8, 32, 32))
    runs = {}
    for name, out in (("gs", "gs://znni/run/out"), ("local", str(tmp_path / "local" / "out"))):
        cfg = base_config(tmp_path / name, vol=vol, output={"path": out, "chunk_size": [4, 8, 8]})
        rf = prepare(cfg)
        run_all(rf)
        summary = finalize(rf, log=lambda *a: None)
        assert summary["done"] == summary["tasks"] and summary["checksum_index_chunks"] > 0
        layer = PrecomputedLayer(parse_layer_url(out), 0)
        runs[name] = layer.read(layer.bounds, fill_missing=True)[0]
    assert runs["gs"].shape == runs["local"].shape and (runs["gs"] == runs["local"]).all()


def test_gcs_sharded_input_is_read_by_ranges(gcs_emulator, tmp_path):
    """A sharded gs:// input read through znni's GCS client by byte ranges equals what was written."""
    import numpy as np

    from znni_core.io import PrecomputedLayer, gcs, parse_layer_url

    bucket = gcs._client().bucket("znni")
    vol = _sharded_input(tmp_path, lambda k, d: bucket.blob(k).upload_from_string(d), "sharded")
    layer = PrecomputedLayer(parse_layer_url("gs://znni/sharded"))
    assert layer.sharded
    got, missing = layer.read(layer.bounds)
    assert missing == [] and np.array_equal(got, vol)


def _emulator_blob(key: str):
    from znni_core.io import gcs

    return gcs._client().bucket("znni").get_blob(key)


@pytest.fixture
def gcs_faults(gcs_emulator, monkeypatch):
    """The loopback GCS emulator behind the fault-injecting proxy (tests/http_faults.py): znni's
    GCS client talks to the proxy (``STORAGE_EMULATOR_HOST``), which answers injected errors as GCS
    does (JSON ``{"error": {"code": N, ...}}``) and logs every request; the waits between attempts
    are counted through ``gcs.sleep`` (znni's own hook), never slept.  Yields ``(proxy, objects
    under gs://znni/faults holding "x" = b"data", waits)``."""
    from tests.http_faults import GcsFaults
    from znni_core.io import gcs
    from znni_core.io.paths import parse_layer_url

    waits = []
    monkeypatch.setattr(gcs, "sleep", waits.append)
    with GcsFaults(int(gcs_emulator.rsplit(":", 1)[1])) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        monkeypatch.delitem(gcs._clients, proxy.endpoint, raising=False)
        objs = gcs.GcsObjects(parse_layer_url("gs://znni/faults", what="test"))
        objs.put("x", b"data", content_type="application/octet-stream", content_encoding=None, exclusive=False)
        assert proxy.get("faults/x") == b"data"
        yield proxy, objs, waits
        gcs._clients.pop(proxy.endpoint, None)


#: the object's download (``GET .../o/faults%2Fx?alt=media``) and any upload, as the proxy sees them
GCS_GET_X = "/download/storage/v1/b/znni/o/faults%2Fx"
GCS_UPLOAD = "/upload/storage/v1/b/znni/o"


def object_requests(log) -> list:
    """The proxy's ``log`` entries about objects: without the client's lookup of the bucket
    itself (``GET /storage/v1/b/znni``), which a new client makes once, in whichever test first
    uses it."""
    return [(m, p, a) for m, p, a in log if p.split("?")[0] != "/storage/v1/b/znni"]


@pytest.mark.parametrize("action", ["429", "500", "503", "reset"])
def test_t7_transient_gcs_errors_are_retried_with_bounded_jittered_backoff(gcs_faults, action):
    """A GET answered ``action`` (an HTTP error in GCS's JSON form, or a connection reset) twice,
    then served: three requests at the server, two waits, each within the backoff's bound (counted,
    never timed).  The library's own retries are off: each attempt is exactly one request."""
    from znni_core.io import gcs

    proxy, objs, waits = gcs_faults
    proxy.rule("GET", GCS_GET_X, action, times=2)
    assert objs.get("x") == (b"data", "")
    assert [a for m, p, a in proxy.log if m == "GET" and GCS_GET_X in p] == [action, action, "ok"], proxy.log
    assert len(waits) == 2 and all(0 <= w <= gcs.BACKOFF_S * 2**k for k, w in enumerate(waits)), waits


@pytest.mark.parametrize("status", ["401", "403"])
def test_t7_gcs_permission_errors_fail_at_once(gcs_faults, status):
    """A 401 or 403 on a read or a write: one request at the server, no wait, a
    StoragePermissionError naming the object and what to check (for a 403 the server's message;
    a 401 makes google-auth refresh the credentials first, which anonymous ones cannot: that
    failure is the error)."""
    from znni_core.errors import StoragePermissionError

    proxy, objs, waits = gcs_faults
    proxy.rule("GET", GCS_GET_X, status)
    proxy.rule("POST", GCS_UPLOAD, status)
    seen = len(proxy.log)
    for op in (
        lambda: objs.get("x"),
        lambda: objs.put("y", b"", content_type="a/b", content_encoding=None, exclusive=False),
    ):
        with pytest.raises(StoragePermissionError, match="gs://znni/faults/[xy] was refused.*not retried") as ei:
            op()
        msg = str(ei.value)
        if status == "403":
            assert "HTTP 403" in msg and "does not have storage.objects access" in msg, msg
        else:
            assert "credentials were not accepted" in msg and "cannot be refreshed" in msg, msg
    got = [(m, a) for m, _, a in object_requests(proxy.log[seen:])]
    assert got == [("GET", status), ("POST", status)], proxy.log[seen:]
    assert waits == [] and proxy.get("faults/y") is None


def test_t7_gcs_5xx_that_never_ends_gives_up_after_bounded_attempts(gcs_faults, monkeypatch):
    """Always 503: ZNNI_GCS_MAX_ATTEMPTS requests at the server, one wait fewer, then a
    StorageError saying so."""
    from znni_core.errors import StorageError
    from znni_core.io import gcs
    from znni_core.io.paths import parse_layer_url

    monkeypatch.setenv("ZNNI_GCS_MAX_ATTEMPTS", "4")
    proxy, _, waits = gcs_faults
    objs = gcs.GcsObjects(parse_layer_url("gs://znni/faults", what="test"))  # reads the setting
    proxy.rule("GET", GCS_GET_X, "503")
    with pytest.raises(StorageError, match="after 4 attempts .*HTTP 503"):
        objs.get("x")
    assert proxy.requests("GET", GCS_GET_X) == 4, proxy.log
    assert len(waits) == 3 and sum(waits) <= gcs.BACKOFF_S * (1 + 2 + 4), waits


def test_gcs_exclusive_write_is_one_conditional_upload(gcs_faults):
    """An exclusive write is one upload asking for ``ifGenerationMatch=0`` (create only): it
    creates an absent object, and reports not written, with no second request and no wait, when
    the server answers 412 because the object exists (the bytes stored stay the first writer's).

    The emulator ignores preconditions: the proxy answers that 412 itself, from the object's
    presence in the emulator (tests/http_faults.py, ``GcsFaults``)."""
    proxy, objs, waits = gcs_faults
    seen = len(proxy.log)
    assert objs.put("new", b"first", content_type="a/b", content_encoding=None, exclusive=True) is True
    assert objs.put("new", b"second", content_type="a/b", content_encoding=None, exclusive=True) is False
    assert objs.put("x", b"other", content_type="a/b", content_encoding=None, exclusive=True) is False
    requests = object_requests(proxy.log[seen:])
    uploads = [(p, a) for m, p, a in requests if m == "POST"]
    assert len(requests) == len(uploads) == 3, proxy.log[seen:]
    assert all("ifGenerationMatch=0" in p for p, _ in uploads) and [a for _, a in uploads] == ["ok", "412", "412"]
    assert proxy.get("faults/new") == b"first" and proxy.get("faults/x") == b"data" and waits == []
    # a plain write is unconditional: it replaces the object
    assert objs.put("new", b"third", content_type="a/b", content_encoding=None, exclusive=False) is True
    assert "ifGenerationMatch" not in proxy.log[-1][1] and proxy.get("faults/new") == b"third"
