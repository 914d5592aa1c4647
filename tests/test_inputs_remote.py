"""Inputs as labs hold them (docs/inputs.md): precomputed layers over http(s), anonymous reads of
public s3:// and gs:// buckets, zarr v2/v3 arrays and OME-Zarr 0.4/0.5 images on every protocol,
as inputs and as masks; each against a loopback server (``http.server``, moto, the GCS emulator)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import gzip
import http.server
import ipaddress
import os
import ssl
import threading
from pathlib import Path

import numpy as np
import pytest

from znni_core.errors import ConfigError, DataError, StorageError, StoragePermissionError
from znni_core.geometry import Roi
from znni_core.io import create_layer, object_store, open_input, parse_layer_url
from znni_core.io.precomputed import PrecomputedLayer

from .pipeline_helpers import RES, base_config, em, sharded_input, write_volume

# ---------------------------------------------------------------------------------------------- servers


class _Handler(http.server.SimpleHTTPRequestHandler):
    """A static file server with byte ranges (``http.server`` has none) and scripted answers:
    ``server.script[path]``: statuses (or ``(status, headers)``) answered, then removed, before the file is served;
    ``server.refuse``: paths answered 403; ``server.gzip``: paths sent gzip-encoded on the wire;
    ``server.labelled``: paths sent as stored with ``Content-Encoding: gzip`` (a ``.gz`` file under Apache);
    ``server.no_head``: every HEAD answered 405 (a server that refuses HEAD);
    ``server.requests``: ``(method, path)`` of every request.  Files are sent with ``Last-Modified``."""

    def log_message(self, *a):
        pass

    def _scripted(self) -> bool:
        srv, path = self.server, self.path.split("?")[0]
        srv.requests.append((self.command, path))
        if path in srv.refuse:
            self.send_error(403)
            return True
        queue = srv.script.get(path)
        if queue:
            status, headers = (queue.pop(0), {}) if isinstance(queue[0], int) else queue.pop(0)
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        return False

    def do_HEAD(self):
        if self._scripted():
            return
        if self.server.no_head:
            self.send_response(405)
            self.send_header("Allow", "GET")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_HEAD()

    def do_GET(self):
        if self._scripted():
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            return super().do_GET()  # 404s and directories as http.server answers them
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a), min(int(b) + 1, len(data))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body, status = data[start:end], 206
        else:
            body, status = data, 200
        enc = "gzip" if status == 200 and self.path in self.server.labelled else None
        if status == 200 and self.path in self.server.gzip:
            body, enc = gzip.compress(body), "gzip"
        self.send_response(status)
        self.send_header("Last-Modified", self.date_time_string(int(path.stat().st_mtime)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        if enc:
            self.send_header("Content-Encoding", enc)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serve(root: Path, tls: ssl.SSLContext | None = None):
    """``http(s)://127.0.0.1:port`` serving ``root`` (scripted through the yielded server)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    srv.script, srv.refuse, srv.gzip, srv.labelled, srv.requests = {}, set(), set(), set(), []
    srv.no_head = False
    if tls is not None:
        srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        srv.url = f"{'https' if tls else 'http'}://127.0.0.1:{srv.server_address[1]}"
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def no_waits(monkeypatch):
    """The HTTP client's waits between attempts, recorded instead of slept."""
    from znni_core.io import http as H

    waits = []
    monkeypatch.setattr(H, "sleep", waits.append)
    return waits


def _read_all(url: str, mip: int = 0, **kw):
    layer = open_input(parse_layer_url(url, **kw), mip)
    return layer, layer.read(layer.bounds)[0]


# ---------------------------------------------------------------------------------------------- http(s)


def test_precomputed_over_http_reads_as_on_file(tmp_path, no_waits):
    """A precomputed layer served as it lies on disk: raw chunks, a ``.gz`` chunk (cloud-volume's
    file:// convention, also served labelled Content-Encoding: gzip), a chunk gzip-encoded on the wire, and a
    sharded layer (byte ranges)."""
    vol = em((8, 32, 32))
    local = write_volume(tmp_path / "em", vol)
    layer = PrecomputedLayer(parse_layer_url(local), 0)
    first = next(iter(layer.grid.chunks_in(layer.bounds)))
    layer.write_chunk(first, layer.read_chunk(first), compress="gzip")  # stored as <name>.gz
    assert (Path(local[7:]) / (layer.chunk_name(first) + ".gz")).is_file()
    url, slayer, svol, shards = sharded_input(tmp_path / "sh")
    for chunks in shards.values():
        slayer.write_shard(chunks)
    with serve(tmp_path) as srv:
        srv.gzip.add(f"/em/{layer.chunk_name(list(layer.grid.chunks_in(layer.bounds))[1])}")
        srv.labelled.add(f"/em/{layer.chunk_name(first)}.gz")  # Apache's AddEncoding: the file, labelled gzip
        got_layer, got = _read_all(f"{srv.url}/em")
        assert got_layer.bounds == layer.bounds and got_layer.resolution == RES
        assert np.array_equal(got[0], vol)
        assert got_layer.object_versions(got_layer.bounds)[layer.chunk_name(first)] is not None
        _, got = _read_all(f"precomputed://{srv.url}/sh/em")
        assert np.array_equal(got, svol)
        assert any(m == "GET" and "shard" in p for m, p in srv.requests)
    assert no_waits == []


def test_http_bounded_retries_permanent_refusals_and_missing_chunks(tmp_path, no_waits, monkeypatch):
    """503s are retried with jittered backoff (Retry-After honoured) up to ZNNI_HTTP_MAX_ATTEMPTS;
    a 403 fails at its first answer; a 404 chunk is named as missing, never zeros unless asked;
    an unreachable host fails after the bounded attempts, naming the URL."""
    from znni_core.io import http as H

    vol = em((4, 32, 32))
    write_volume(tmp_path / "em", vol)
    layer = PrecomputedLayer(parse_layer_url(f"file://{tmp_path}/em"), 0)
    names = [layer.chunk_name(i) for i in layer.grid.chunks_in(layer.bounds)]
    with serve(tmp_path) as srv:
        srv.script[f"/em/{names[0]}"] = [503, 503]
        _, got = _read_all(f"{srv.url}/em")
        assert np.array_equal(got[0], vol) and len(no_waits) == 2
        assert all(0 <= w <= H.MAX_WAIT_S for w in no_waits)

        srv.refuse.add(f"/em/{names[1]}")
        srv.requests.clear()
        with pytest.raises(StoragePermissionError, match="HTTP 403.*not retried") as e:
            _read_all(f"{srv.url}/em")
        assert "\n" not in str(e.value) and srv.requests.count(("GET", f"/em/{names[1]}")) == 1
        srv.refuse.clear()

        (tmp_path / "em" / names[2]).unlink()
        with pytest.raises(DataError, match="missing or empty") as e:
            _read_all(f"{srv.url}/em")
        assert names[2] in str(e.value)
        remote = open_input(parse_layer_url(f"{srv.url}/em"))
        got, missing = remote.read(remote.bounds, fill_missing=True)
        assert missing == [names[2]] and remote.missing_chunks(remote.bounds) == [names[2]]

        monkeypatch.setenv("ZNNI_HTTP_MAX_ATTEMPTS", "3")
        srv.script["/em/info"] = [503] * 3
        no_waits.clear()
        with pytest.raises(StorageError, match="still failing after 3 attempts"):
            _read_all(f"{srv.url}/em")
        assert len(no_waits) == 2
        srv.script["/em/info"] = [(429, {"Retry-After": "7"})]
        no_waits.clear()
        assert open_input(parse_layer_url(f"{srv.url}/em")).bounds == layer.bounds
        assert no_waits == [7.0]
    monkeypatch.setenv("ZNNI_HTTP_MAX_ATTEMPTS", "2")
    with pytest.raises(StorageError, match=r"still failing after 2 attempts.*reachable") as e:
        _read_all(f"{srv.url}/em")  # the server is gone: connection refused
    assert "\n" not in str(e.value)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (``cert.pem``, ``key.pem``): its own authority."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "znni test server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_pem, key_pem = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_pem, key_pem


def test_https_verifies_certificates_and_trusts_a_named_bundle(tmp_path, monkeypatch, no_waits):
    """https:// is the same client with TLS: a certificate the system does not trust fails at
    once (not retried), naming ZNNI_CA_BUNDLE; with the server's authority named there it reads."""
    for var in ("ZNNI_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(var, raising=False)
    vol = em((4, 16, 16))
    write_volume(tmp_path / "www" / "em", vol)
    cert, key = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    with serve(tmp_path / "www", tls) as srv:
        assert srv.url.startswith("https://")
        with pytest.raises(StorageError, match="TLS.*not retried.*ZNNI_CA_BUNDLE") as e:
            _read_all(f"{srv.url}/em")
        assert "\n" not in str(e.value) and no_waits == []
        monkeypatch.setenv("ZNNI_CA_BUNDLE", str(cert))
        _, got = _read_all(f"{srv.url}/em")
        assert np.array_equal(got[0], vol)
    monkeypatch.setenv("ZNNI_CA_BUNDLE", str(tmp_path / "absent.pem"))
    with pytest.raises(ConfigError, match="ZNNI_CA_BUNDLE"):
        _read_all(f"{srv.url}/em")


def test_http_urls_and_read_only_layers(tmp_path):
    """http(s) URLs parse as layers; writing one (an output, create-layer) or a URL as work_dir is
    a ConfigError at validate time, before anything is read."""
    from znni_core.pipeline.resolve import resolve

    u = parse_layer_url("https://data.example.org:8443/em/layer/")
    assert (u.protocol, u.path, u.format, u.writable) == (
        "https",
        "data.example.org:8443/em/layer",
        "precomputed",
        False,
    )
    assert str(u) == "https://data.example.org:8443/em/layer"
    assert parse_layer_url("zarr://http://host/a/img").format == "zarr"
    assert parse_layer_url("http://host/a/img.ome.zarr").format == "zarr"
    for bad in ("http://host/layer?sig=1", "https:///no-host", "http://host/../x", "ftp://host/x"):
        with pytest.raises(ConfigError):
            parse_layer_url(bad)
    spec = PrecomputedLayer(parse_layer_url(write_volume(tmp_path / "small", em((4, 16, 16)))), 0).spec
    with pytest.raises(ConfigError, match="read-only"):
        create_layer(u, spec, {})
    with pytest.raises(
        ConfigError, match=r"PUT https://data.example.org:8443/em/layer/info: http\(s\):// layers are read-only"
    ):
        object_store(u).put("info", b"{}")
    cfg = base_config(tmp_path, output={"path": "https://host/out"})
    with pytest.raises(ConfigError, match=r"output.path https://host/out: http\(s\):// layers are read-only"):
        resolve(cfg, progress=lambda *a: None)
    cfg = base_config(tmp_path, work_dir="https://host/work")  # s3:// and gs:// are (test_cloud.py)
    with pytest.raises(ConfigError, match=r"work_dir 'https://host/work'.*http\(s\):// is read-only"):
        resolve(cfg, progress=lambda *a: None)


def test_http_server_refusing_head_reads_sizes_and_versions(tmp_path, no_waits):
    """A server that answers HEAD with 405: reads, sizes and the versions tasks record before reading
    still work (one ranged GET each, for raw and .gz objects alike), equal to what HEAD gives."""
    vol = em((4, 32, 32))
    local = write_volume(tmp_path / "em", vol)
    layer = PrecomputedLayer(parse_layer_url(local), 0)
    names = [layer.chunk_name(i) for i in layer.grid.chunks_in(layer.bounds)]
    first = next(iter(layer.grid.chunks_in(layer.bounds)))
    layer.write_chunk(first, layer.read_chunk(first), compress="gzip")  # stored as <name>.gz
    gz_size = (tmp_path / "em" / (names[0] + ".gz")).stat().st_size
    with serve(tmp_path) as srv:
        url = parse_layer_url(f"{srv.url}/em")
        with_head = object_store(url).versions(names)
        srv.no_head = True
        remote, got = _read_all(f"{srv.url}/em")
        assert np.array_equal(got[0], vol)
        versions = remote.object_versions(remote.bounds)
        assert versions == with_head and all(versions.values())
        assert versions[names[0]].startswith(".gz") and versions[names[0]].endswith(f"|{gz_size}")
        srv.requests.clear()
        store = object_store(url)
        sizes = store.sizes([names[0], names[1], "absent"])
        assert sizes == {names[0]: gz_size, names[1]: (tmp_path / "em" / names[1]).stat().st_size, "absent": None}
        assert store.versions(["absent"]) == {"absent": None}
        assert ("GET", f"/em/{names[0]}.gz") in srv.requests and ("HEAD", f"/em/{names[0]}.gz") in srv.requests
    assert no_waits == []


def test_http_two_copies_of_an_object_are_refused_and_suffixes_are_learnt_per_directory(tmp_path, no_waits):
    """``x`` and ``x.gz`` both served: refused naming both (as on file://) wherever both are looked for;
    a directory's suffix, learnt from its first object, makes each later object one request; an object
    under another suffix makes the directory mixed (every suffix looked for, copies refused)."""
    from znni_core.io.http import SUFFIXES, HttpObjects

    d = tmp_path / "l" / "s"
    d.mkdir(parents=True)
    (tmp_path / "l" / "info").write_bytes(b"{}")
    for n in ("a", "b", "dup"):
        (d / f"{n}.gz").write_bytes(gzip.compress(n.encode()))
    (d / "dup").write_bytes(b"stale")
    (d / "raw").write_bytes(b"raw")
    with serve(tmp_path) as srv:
        url = parse_layer_url(f"{srv.url}/l")
        with pytest.raises(DataError, match=r"s/dup is stored as \['s/dup', 's/dup.gz'\].*leave exactly one") as e:
            HttpObjects(url).get("s/dup")
        assert "\n" not in str(e.value)
        objects = HttpObjects(url)
        assert objects.get("info") == (b"{}", "")  # the root directory's suffix: none
        srv.requests.clear()
        assert objects.get("s/a") == ((d / "a.gz").read_bytes(), "gzip")
        assert len(srv.requests) == len(SUFFIXES)  # the first object of s/: every suffix
        srv.requests.clear()
        assert objects.get("s/b") == ((d / "b.gz").read_bytes(), "gzip") and srv.requests == [("GET", "/l/s/b.gz")]
        assert objects.get("s/dup")[0] == (d / "dup.gz").read_bytes()  # the directory's suffix, whatever was read last
        srv.requests.clear()
        assert objects.get("s/raw") == (b"raw", "") and objects.mixed == {"s"}
        assert srv.requests[:2] == [("GET", "/l/s/raw.gz"), ("GET", "/l/s/raw")]
        with pytest.raises(DataError, match="stored as"):
            objects.get("s/dup")
        with pytest.raises(DataError, match="stored as"):
            object_store(url).versions(["s/dup"])
        assert objects.get("s/absent") is None
    assert no_waits == []


def test_http_credentials_redirect_downgrades_and_proxies_are_refused_in_one_line(tmp_path, monkeypatch, no_waits):
    """user:password@ in a URL is refused without echoing the password; a redirect is followed, one from
    https to http is refused naming both URLs, a loop is bounded; a proxy without a scheme names its
    variable and the fix; a 403 says the object may simply be absent (S3 endpoints answer 403 for it)."""
    from znni_core.io import http as H

    with pytest.raises(ConfigError, match=r"https://host/em: credentials in URLs .* not supported") as e:
        parse_layer_url("https://alice:s3cret@host/em", what="input")
    assert "s3cret" not in str(e.value) and "alice" not in str(e.value) and "\n" not in str(e.value)
    assert parse_layer_url("http://host/a@b/em").path == "host/a@b/em"  # an @ in the path is a path

    (tmp_path / "www" / "em").mkdir(parents=True)
    (tmp_path / "www" / "em" / "info").write_bytes(b"{}")
    for var in ("ZNNI_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(var, raising=False)
    cert, key = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    monkeypatch.setenv("ZNNI_CA_BUNDLE", str(cert))
    with serve(tmp_path / "www") as plain, serve(tmp_path / "www", tls) as secure:
        plain.script["/old/info"] = [(302, {"Location": "/em/info"})]
        assert object_store(parse_layer_url(f"{plain.url}/old")).get("info") == b"{}"
        secure.script["/old/info"] = [(301, {"Location": "/em/info"})]
        assert object_store(parse_layer_url(f"{secure.url}/old")).get("info") == b"{}"
        secure.script["/em/info"] = [(302, {"Location": f"{plain.url}/em/info"})]
        plain.requests.clear()
        with pytest.raises(
            StorageError, match=rf"{secure.url}/em/info to {plain.url}/em/info.*https:// to http://"
        ) as e:
            object_store(parse_layer_url(f"{secure.url}/em")).get("info")
        assert "\n" not in str(e.value) and plain.requests == []
        plain.script["/loop/info"] = [(302, {"Location": "/loop/info"})] * (H.MAX_REDIRECTS + 1)
        with pytest.raises(StorageError, match=rf"more than {H.MAX_REDIRECTS} redirects"):
            object_store(parse_layer_url(f"{plain.url}/loop")).get("info")
        plain.refuse.add("/em/info")
        with pytest.raises(StoragePermissionError, match="HTTP 403.*simply absent.*may not list the bucket"):
            object_store(parse_layer_url(f"{plain.url}/em")).get("info")
    assert no_waits == []

    monkeypatch.setattr(H, "_pools", {})
    for var in (
        "http_proxy",
        "HTTP_PROXY",
        "https_proxy",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
        "no_proxy",
        "NO_PROXY",
    ):
        monkeypatch.delenv(var, raising=False)
    remote = parse_layer_url("https://data.example.org/em")
    monkeypatch.setenv("https_proxy", "proxy:3128")
    with pytest.raises(
        ConfigError,
        match=r"https_proxy='proxy:3128' is not an http:// or https:// proxy URL; write it as http://proxy:3128",
    ):
        H.HttpObjects(remote)
    monkeypatch.setenv("https_proxy", "me:pw@proxy:3128")
    with pytest.raises(ConfigError, match="https_proxy='proxy:3128'") as e:
        H.HttpObjects(remote)
    assert "pw" not in str(e.value)
    monkeypatch.setenv("https_proxy", "http://proxy:3128")
    assert H.HttpObjects(remote).pool.proxy.host == "proxy"  # no request is sent


# ---------------------------------------------------------------------------------------------- anonymous


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No cloud credentials anywhere: AWS_* unset, empty AWS credential and config files, no
    instance metadata, empty cloud-volume secrets directories, no Google default credentials."""
    from cloudfiles import secrets

    for var in list(os.environ):
        if var.startswith("AWS_") or var in ("GOOGLE_APPLICATION_CREDENTIALS", "ZNNI_SIGN_REQUESTS"):
            monkeypatch.delenv(var)
    empty = tmp_path / "empty-credentials"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    (tmp_path / "secrets").mkdir()
    monkeypatch.setattr(secrets, "CLOUD_VOLUME_SECRETS_DIR", str(tmp_path / "secrets"))
    monkeypatch.setattr(secrets, "CLOUD_FILES_SECRETS_DIR", str(tmp_path / "secrets"))
    secrets.AWS_CREDENTIALS_CACHE.clear()


def _upload(local_dir: Path, url) -> None:
    """Every file under ``local_dir`` stored as is under ``url`` (one PUT each)."""
    store = object_store(url)
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            store.put(str(p.relative_to(local_dir)), p.read_bytes())


def test_s3_public_bucket_reads_unsigned_without_credentials(tmp_path, moto_s3, no_credentials, monkeypatch):
    """No credentials anywhere: reads go unsigned (no more 'no usable S3 credentials'), writes
    are refused before any request; ZNNI_SIGN_REQUESTS=always restores the requirement."""
    from znni_core.io.s3 import S3Objects

    vol = em((4, 32, 32))
    write_volume(tmp_path / "em", vol)
    import boto3

    url = parse_layer_url("s3://znni/public/em", endpoint=moto_s3)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # the upload is signed
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    _upload(tmp_path / "em", url)  # private objects (the ACL znni's writes set)
    assert not S3Objects(url).unsigned
    client = boto3.client("s3", endpoint_url=moto_s3)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")

    objects = S3Objects(url)
    assert objects.unsigned
    with pytest.raises(
        StoragePermissionError, match="unsigned.*no S3 credentials were found.*not public.*simply absent"
    ) as e:
        _read_all("s3://znni/public/em", endpoint=moto_s3)
    assert "\n" not in str(e.value)
    for p in sorted((tmp_path / "em").rglob("*")):  # the same objects made public, as open datasets are
        if p.is_file():
            key = f"public/em/{p.relative_to(tmp_path / 'em')}"
            client.put_object(Bucket="znni", Key=key, Body=p.read_bytes(), ACL="public-read")
    _, got = _read_all("s3://znni/public/em", endpoint=moto_s3)
    assert np.array_equal(got[0], vol)
    with pytest.raises(StoragePermissionError, match="no credentials were found.*cannot write.*AWS_ACCESS_KEY_ID"):
        object_store(url).put("x", b"1")
    with pytest.raises(StoragePermissionError, match="cannot write"):
        object_store(url).delete("info")
    assert object_store(url).exists("info")
    monkeypatch.setenv("ZNNI_SIGN_REQUESTS", "always")
    with pytest.raises(StoragePermissionError, match="no usable S3 credentials"):
        _read_all("s3://znni/public/em", endpoint=moto_s3)
    monkeypatch.setenv("ZNNI_SIGN_REQUESTS", "sometimes")
    with pytest.raises(ConfigError, match="ZNNI_SIGN_REQUESTS='sometimes' must be one of auto, always, never"):
        S3Objects(url)
    monkeypatch.setenv("ZNNI_SIGN_REQUESTS", "never")  # credentials present, requests unsigned all the same
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert S3Objects(url).unsigned
    with pytest.raises(StoragePermissionError, match="ZNNI_SIGN_REQUESTS=never"):
        object_store(url).put("x", b"1")


def test_gcs_reads_anonymously_without_credentials(tmp_path, gcs_emulator, no_credentials, monkeypatch):
    """The emulator read with no credentials anywhere; outside an emulator, no credentials found
    means an anonymous client whose writes are refused before any request, and an unusable
    GOOGLE_APPLICATION_CREDENTIALS is an error, never 'anonymous'."""
    import google.auth
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError

    from znni_core.io import gcs

    vol = em((4, 32, 32))
    write_volume(tmp_path / "em", vol)
    _upload(tmp_path / "em", parse_layer_url("gs://znni/public/em"))
    _, got = _read_all("gs://znni/public/em")
    assert np.array_equal(got[0], vol)

    def no_default(*a, **kw):
        raise DefaultCredentialsError("no default credentials (test)")

    monkeypatch.setattr(google.auth, "default", no_default)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setattr(gcs, "_clients", {})
    monkeypatch.setattr(gcs, "_unsigned", set())
    objects = gcs.GcsObjects(parse_layer_url("gs://public-bucket/em"))
    assert objects.unsigned and isinstance(objects.bucket.client._credentials, AnonymousCredentials)
    with pytest.raises(StoragePermissionError, match="no credentials were found.*cannot write.*google-secret.json"):
        objects.put("info", b"{}", content_type="application/json")
    monkeypatch.setenv("ZNNI_SIGN_REQUESTS", "always")
    with pytest.raises(StoragePermissionError, match="no usable Google Cloud credentials"):
        gcs.GcsObjects(parse_layer_url("gs://public-bucket/em"))
    monkeypatch.setenv("ZNNI_SIGN_REQUESTS", "auto")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    with pytest.raises(StoragePermissionError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        gcs.GcsObjects(parse_layer_url("gs://public-bucket/em"))


# ---------------------------------------------------------------------------------------------- zarr


def _zarr_array(path: Path, arr: np.ndarray, fmt: int, chunks, shards=None, attrs=None):
    import zarr

    kw = {"shards": shards} if shards else {}
    z = zarr.create_array(
        str(path), shape=arr.shape, chunks=chunks, dtype=arr.dtype, zarr_format=fmt, fill_value=0, **kw
    )
    z[:] = arr
    if attrs:
        z.attrs.update(attrs)
    return z


@pytest.fixture(params=["http", "s3", "gs"])
def remote(request, tmp_path):
    """``(base URL, publish(local dir, name), endpoint)``: a remote place for a local zarr tree."""
    if request.param == "http":
        with serve(tmp_path) as srv:
            yield srv.url, lambda d, name: None, None  # tmp_path is served as it is
        return
    if request.param == "s3":
        endpoint = request.getfixturevalue("moto_s3")
        yield "s3://znni", lambda d, name: _upload(d, parse_layer_url(f"s3://znni/{name}", endpoint=endpoint)), endpoint
        return
    request.getfixturevalue("gcs_emulator")
    yield "gs://znni", lambda d, name: _upload(d, parse_layer_url(f"gs://znni/{name}")), None


@pytest.mark.parametrize("fmt", [2, 3])
def test_zarr_arrays_on_remote_stores(tmp_path, remote, fmt):
    """zarr v2 and v3 arrays (one with channels) read from http, s3 and gs through znni's own
    clients; a deleted chunk is named as missing, and filled only when asked."""
    base, publish, endpoint = remote
    arr = np.random.default_rng(fmt).integers(1, 255, (2, 10, 20, 30), dtype=np.uint8)
    z = _zarr_array(tmp_path / "em.zarr", arr, fmt, (1, 4, 8, 8), attrs={"resolution": [40, 8, 8]})
    key = z._async_array.metadata.encode_chunk_key((1, 0, 0, 0))
    (tmp_path / "em.zarr" / key).unlink()
    publish(tmp_path / "em.zarr", "em.zarr")
    layer = open_input(parse_layer_url(f"{base}/em.zarr", endpoint=endpoint))
    assert (layer.channels, layer.resolution, layer.bounds) == (2, (40.0, 8.0, 8.0), Roi((0, 0, 0), (10, 20, 30)))
    assert layer.store is not None  # znni's own client, not zarr's
    r = Roi((1, 2, 3), (5, 9, 11))
    with pytest.raises(DataError, match="missing or empty") as e:
        layer.read(r)
    assert key in str(e.value)
    got, missing = layer.read(r, fill_missing=True)
    expect = arr[(slice(None),) + r.to_slices()].copy()
    expect[1, :3, :6, :5] = 0  # chunk (1, 0, 0, 0) covers z 0-4, y 0-8, x 0-8
    assert missing == [key] and np.array_equal(got, expect)
    versions = layer.object_versions(r)
    assert versions[key] is None and all(v for k, v in versions.items() if k != key)


def test_sharded_zarr_on_a_remote_store_names_a_missing_shard_and_a_hole(tmp_path, remote):
    """A sharded zarr v3 input on http / s3 / gs: shard indexes read by byte range."""
    base, publish, endpoint = remote
    arr = np.random.default_rng(0).integers(1, 255, (16, 16, 16), dtype=np.uint8)
    arr[8:12, 0:4, 4:8] = 0  # chunk (2, 0, 1), never stored
    z = _zarr_array(tmp_path / "sh.zarr", arr, 3, (4, 4, 4), shards=(8, 8, 8), attrs={"resolution": [40, 8, 8]})
    meta = z._async_array.metadata
    gone = meta.encode_chunk_key((0, 1, 1))
    (tmp_path / "sh.zarr" / gone).unlink()
    publish(tmp_path / "sh.zarr", "sh.zarr")
    layer = open_input(parse_layer_url(f"zarr://{base}/sh.zarr", endpoint=endpoint))
    got, missing = layer.read(layer.bounds, fill_missing=True)
    assert sorted(m for m in missing if "shard missing" not in m) == [meta.encode_chunk_key((1, 0, 0)) + "[0,0,1]"]
    assert len([m for m in missing if m.startswith(gone + "[")]) == 8
    expect = arr.copy()
    expect[0:8, 8:16, 8:16] = 0
    assert np.array_equal(got[0], expect)


# ---------------------------------------------------------------------------------------------- OME-Zarr


def write_ome(
    path: Path,
    vol: np.ndarray,
    version: str,
    *,
    axes: str = "zyx",
    unit: str | None = "micrometer",
    scale=(0.02, 0.004, 0.004),
    translation=(0.0, 0.0, 0.0),
    global_scale=None,
    global_translation=None,
    chunks=(4, 8, 8),
    levels: int = 2,
):
    """An OME-Zarr image of ``vol`` (its axes ``axes``): dataset k is ``vol`` downsampled 2^k in y and
    x (every other voxel), with the pixel-centred half-voxel shift of such pyramids in its translation."""
    import zarr

    fmt = 2 if version == "0.4" else 3
    g = zarr.open_group(str(path), mode="w", zarr_format=fmt)
    lead = len(axes) - 3
    names = {"t": ("t", "time"), "c": ("c", "channel")}
    ax = [
        {"name": names[a][0], "type": names[a][1]}
        if a in names
        else {"name": a, "type": "space", **({"unit": unit} if unit else {})}
        for a in axes
    ]
    datasets = []
    for k in range(levels):
        f = 2**k
        data = vol[(Ellipsis, slice(None), slice(None, None, f), slice(None, None, f))]
        a = g.create_array(str(k), shape=data.shape, chunks=(1,) * lead + tuple(chunks), dtype=data.dtype, fill_value=0)
        a[:] = data
        s = [1.0] * lead + [scale[0], scale[1] * f, scale[2] * f]
        t = [0.0] * lead + [
            translation[0],
            translation[1] + (f - 1) * scale[1] / 2,
            translation[2] + (f - 1) * scale[2] / 2,
        ]
        datasets.append(
            {
                "path": str(k),
                "coordinateTransformations": [{"type": "scale", "scale": s}, {"type": "translation", "translation": t}],
            }
        )
    ms = {"axes": ax, "datasets": datasets, "name": "em"}
    if global_scale is not None:
        ms["coordinateTransformations"] = [{"type": "scale", "scale": [1.0] * lead + list(global_scale)}]
        if global_translation is not None:
            ms["coordinateTransformations"].append(
                {"type": "translation", "translation": [0.0] * lead + list(global_translation)}
            )
    if version == "0.4":
        g.attrs["multiscales"] = [{"version": "0.4", **ms}]
    else:
        g.attrs["ome"] = {"version": "0.5", "multiscales": [ms]}
    return g


@pytest.mark.parametrize(
    "version, axes", [("0.4", "zyx"), ("0.4", "czyx"), ("0.5", "tczyx"), ("0.5", "zyx"), ("0.5", "tzyx")]
)
def test_ome_zarr_datasets_units_transforms_and_axes(tmp_path, version, axes):
    """mip k is datasets[k]; voxel size = global scale x dataset scale in nm; the offset is the
    translation in voxels (global and per dataset composed), a pyramid's half-voxel shift rounded away."""
    rng = np.random.default_rng(1)
    shape = {"zyx": (), "czyx": (2,), "tczyx": (1, 2), "tzyx": (1,)}[axes] + (8, 32, 32)
    vol = rng.integers(1, 255, shape, dtype=np.uint8)
    # dataset 0: (0.02, 0.004, 0.004) um x global 2 = (40, 8, 8) nm; translation (0.06, 0.02, 0) um x 2
    # + global (0, 0, 0.008) um = (3, 5, 1) voxels
    write_ome(
        tmp_path / "img.ome.zarr",
        vol,
        version,
        axes=axes,
        translation=(0.06, 0.02, 0.0),
        global_scale=(2, 2, 2),
        global_translation=(0, 0, 0.008),
    )
    url = f"file://{tmp_path}/img.ome.zarr"
    layer = open_input(parse_layer_url(url), 0)
    channels = 2 if "c" in axes else 1
    assert layer.resolution == pytest.approx((40.0, 8.0, 8.0)) and layer.channels == channels
    assert layer.bounds == Roi((3, 5, 1), (8, 32, 32))
    got = layer.read(Roi((4, 6, 2), (3, 10, 12)))[0]
    flat = vol.reshape((channels, 8, 32, 32))
    assert np.array_equal(got, flat[:, 1:4, 1:11, 1:13])
    mip1 = open_input(parse_layer_url(url), 1)
    # y: 2 x (0.02 + 0.002) um / 0.016 um = 2.75 voxels -> 3; x: (2 x 0.002 + 0.008) / 0.016 = 0.75 -> 1
    assert mip1.resolution == pytest.approx((40.0, 16.0, 16.0)) and mip1.bounds == Roi((3, 3, 1), (8, 16, 16))
    assert mip1.ome.offset_remainder == pytest.approx((0.0, -0.25, -0.25))
    assert np.array_equal(mip1.read(mip1.bounds)[0], flat[:, :, ::2, ::2])
    with pytest.raises(DataError, match=r"mip 2 does not exist; the OME-Zarr image has datasets 0..1"):
        open_input(parse_layer_url(url), 2)


def test_ome_zarr_refusals_are_one_line(tmp_path):
    """Unsupported versions, a group without multiscales, other axes, no units, missing metadata:
    each a one-line error naming the fix; no units is fine with a config resolution."""
    import zarr

    vol = np.ones((8, 16, 16), np.uint8)
    g = write_ome(tmp_path / "old.zarr", vol, "0.4", levels=1)
    ms = dict(g.attrs)["multiscales"]
    g.attrs["multiscales"] = [{**ms[0], "version": "0.3"}]
    g5 = write_ome(tmp_path / "new.zarr", vol, "0.5", levels=1)
    g5.attrs["ome"] = {**dict(g5.attrs)["ome"], "version": "0.6"}
    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w", zarr_format=3)
    g = write_ome(tmp_path / "xyz.zarr", vol, "0.5", levels=1)
    ome = dict(g.attrs)["ome"]
    ome["multiscales"][0]["axes"] = ome["multiscales"][0]["axes"][::-1]
    g.attrs["ome"] = ome
    write_ome(tmp_path / "nounit.zarr", vol, "0.5", unit=None, scale=(4, 1, 1), levels=1)
    write_ome(tmp_path / "ang.zarr", vol, "0.4", unit="angstrom", scale=(400, 80, 80), levels=1)
    (tmp_path / "empty.zarr").mkdir()
    cases = {
        "old.zarr": r"OME-Zarr version '0.3' is not supported; znni reads OME-Zarr 0.4 and 0.5",
        "new.zarr": r"OME-Zarr version '0.6' is not supported",
        "plain.zarr": r"zarr group without OME-Zarr 'multiscales' metadata",
        "xyz.zarr": r"axes \['x', 'y', 'z'\].*space axes are z, y, x in that order",
        "nounit.zarr": r"have no unit.*set input.resolution",
        "empty.zarr": r"no zarr metadata there \(zarr.json, .zarray, .zgroup or .zattrs\)",
    }
    for name, match in cases.items():
        with pytest.raises(DataError, match=match) as e:
            open_input(parse_layer_url(str(tmp_path / name)))
        assert "\n" not in str(e.value), name
    assert open_input(parse_layer_url(str(tmp_path / "nounit.zarr")), resolution=[40, 8, 8]).resolution == (40, 8, 8)
    assert open_input(parse_layer_url(str(tmp_path / "ang.zarr"))).resolution == pytest.approx((40.0, 8.0, 8.0))
    with pytest.raises(ConfigError, match="a zarr array has no mips"):
        open_input(parse_layer_url("zarr://" + str(tmp_path / "ang.zarr" / "0")), 1)


# ---------------------------------------------------------------------------------------------- end to end


def test_pipeline_inputs_over_http_and_ome_zarr_on_s3_equal_the_local_run(tmp_path, moto_s3):
    """The in-process pipeline with input.path an http URL (and the mask an http OME-Zarr), and
    an OME-Zarr 0.5 on S3: the output equals the run from the local file:// input, byte for byte."""
    from .test_pipeline import prepare, read_out, run_all

    vol = em((8, 40, 40))
    mask = np.zeros((8, 40, 40), np.uint8)
    mask[:, :20] = 1

    def run(name, **over):
        d = tmp_path / name
        d.mkdir()
        cfg = base_config(d, vol=vol, task_chunks=[2, 4, 4], **over)
        run_all(rf := prepare(cfg))
        return read_out(rf)[0]

    write_ome(tmp_path / "mask.ome.zarr", mask, "0.4", unit="nanometer", scale=RES, levels=1)
    # zarr stores no chunk of zeros: the mask's absent chunks are masked (mask.missing: zero)
    local = run("local", mask={"path": f"file://{tmp_path}/mask.ome.zarr", "missing": "zero"})
    write_volume(tmp_path / "em", vol)
    write_ome(tmp_path / "em.ome.zarr", vol, "0.5", unit="nanometer", scale=RES, levels=1)
    _upload(tmp_path / "em.ome.zarr", parse_layer_url("s3://znni/em.ome.zarr", endpoint=moto_s3))
    with serve(tmp_path) as srv:
        mask_http = {"path": f"zarr://{srv.url}/mask.ome.zarr", "missing": "zero"}
        over_http = run("http", input={"path": f"{srv.url}/em"}, mask=mask_http)
        assert any(p.startswith("/mask.ome.zarr/0/") for _, p in srv.requests)
    on_s3 = run("s3", input={"path": "s3://znni/em.ome.zarr", "endpoint_url": moto_s3})
    assert local.any() and np.array_equal(over_http, local)
    full = run("full")
    assert np.array_equal(on_s3, full)
    assert not np.array_equal(local, full)  # the mask left chunks out


def test_validate_names_an_unreachable_input_in_one_line(tmp_path, monkeypatch, no_waits):
    """`znni validate` (resolve) on an input URL nobody serves: one line naming the URL."""
    from znni_core.pipeline.resolve import resolve

    monkeypatch.setenv("ZNNI_HTTP_MAX_ATTEMPTS", "2")
    with serve(tmp_path) as srv:
        dead = srv.url
    cfg = base_config(tmp_path, input={"path": f"{dead}/em"})
    with pytest.raises(StorageError, match=rf"GET {dead}/em/info: still failing after 2 attempts") as e:
        resolve(cfg, progress=lambda *a: None)
    assert "\n" not in str(e.value) and len(no_waits) == 1
