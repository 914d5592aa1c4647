"""``znni serve``: only a run's layers and the bundled viewer; no listings, nothing outside the
layers, CORS only for its own viewer, Range requests, compressed chunks; the report's link."""

from __future__ import annotations

import gzip
import http.client
import os
import urllib.request

import pytest
from typer.testing import CliRunner

from znni_core.cli import app
from znni_core.pipeline.finalize import neuroglancer_link
from znni_core.pipeline.serve import LayerServer, _parse_range, viewer_dir

SECRET = b"aws_secret_access_key = do-not-leak\n"


@pytest.fixture()
def served(tmp_path):
    """A layer directory beside a secrets file, served on a free port."""
    secrets = tmp_path / "home" / ".cloudvolume" / "secrets"
    secrets.mkdir(parents=True)
    (secrets / "aws-secret.json").write_bytes(SECRET)
    (tmp_path / "home" / "notes.txt").write_bytes(SECRET)
    layer = tmp_path / "home" / "out"
    (layer / "8_8_40").mkdir(parents=True)
    (layer / "info").write_bytes(b'{"type": "image"}')
    shard = bytes(range(256)) * 40
    (layer / "8_8_40" / "0.shard").write_bytes(shard)
    (layer / "8_8_40" / "0-64_0-64_0-16.gz").write_bytes(gzip.compress(b"chunk bytes"))
    (layer / ".hidden").write_bytes(SECRET)
    os.symlink(tmp_path / "home" / "notes.txt", layer / "8_8_40" / "link_out")
    os.symlink(layer / "info", layer / "8_8_40" / "link_in")
    logs = []
    with LayerServer({"out": layer}, port=0, log=logs.append) as srv:
        yield srv, layer, shard, logs


def get(srv, path, headers=None, method="GET"):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request(method, path, headers={"Host": f"127.0.0.1:{srv.port}", **(headers or {})})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, body


def test_serves_layer_files_with_ranges_and_encodings(served):
    srv, layer, shard, _ = served
    status, h, body = get(srv, "/layers/out/info")
    assert (status, body) == (200, b'{"type": "image"}')
    status, h, body = get(srv, "/layers/out/8_8_40/0.shard", {"Range": "bytes=100-299"})
    assert status == 206 and body == shard[100:300] and h["content-range"] == f"bytes 100-299/{len(shard)}"
    status, h, body = get(srv, "/layers/out/8_8_40/0.shard", {"Range": "bytes=-16"})
    assert status == 206 and body == shard[-16:]
    status, h, body = get(srv, "/layers/out/8_8_40/0.shard", {"Range": "bytes=10000000-"})
    assert status == 416 and h["content-range"] == f"bytes */{len(shard)}"
    # cloud-volume / igneous store a gzip chunk as <key>.gz: served under <key> with its encoding
    status, h, body = get(srv, "/layers/out/8_8_40/0-64_0-64_0-16")
    assert status == 200 and h["content-encoding"] == "gzip" and gzip.decompress(body) == b"chunk bytes"
    status, h, body = get(srv, "/layers/out/8_8_40/0.shard", method="HEAD")
    assert status == 200 and body == b"" and int(h["content-length"]) == len(shard)
    # a symlink staying inside the layer is fine
    assert get(srv, "/layers/out/8_8_40/link_in")[2] == b'{"type": "image"}'


@pytest.mark.parametrize(
    "path",
    [
        "/etc/hostname",
        "/etc/passwd",
        "/",
        "/layers/",
        "/layers/out",
        "/layers/out/",
        "/layers/out/8_8_40/",
        "/layers/out/../notes.txt",
        "/layers/out/%2e%2e/notes.txt",
        "/layers/out/..%2fnotes.txt",
        "/layers/out/%2e%2e%2f.cloudvolume/secrets/aws-secret.json",
        "/layers/out/.hidden",
        "/layers/out/8_8_40/link_out",
        "/layers/other/info",
        "/layers/out/8_8_40/%00",
        "/..%5c..%5cnotes.txt",
        "/layers/out//info",
        "/v/znni/../../etc/passwd",
        "/v/other/index.html",
        "/v/znni/%2e%2e/%2e%2e/etc/passwd",
        "/state/znni",
        "/events/other",
    ],
)
def test_nothing_outside_the_layers_is_served(served, path):
    srv, *_ = served
    status, h, body = get(srv, path)
    if path == "/":
        assert status == 302 and h["location"] == "/v/znni/"  # the viewer
        return
    assert status == 404 and SECRET not in body, (path, status)


def test_cors_only_for_its_own_viewer_and_loopback_hosts(served):
    srv, *_ = served
    status, h, _ = get(srv, "/layers/out/info", {"Origin": "https://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in h
    status, h, _ = get(srv, "/layers/out/info", {"Origin": "https://evil.example"}, method="OPTIONS")
    assert status == 403 and "access-control-allow-origin" not in h
    own = f"http://127.0.0.1:{srv.port}"
    status, h, _ = get(srv, "/layers/out/info", {"Origin": own})
    assert h["access-control-allow-origin"] == own
    status, h, _ = get(
        srv, "/layers/out/info", {"Origin": own, "Access-Control-Request-Headers": "range"}, method="OPTIONS"
    )
    assert status == 204 and "Range" in h["access-control-allow-headers"]
    # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends its own Host
    status, _, body = get(srv, "/layers/out/info", {"Host": f"evil.example:{srv.port}"})
    assert status == 403 and b"image" not in body


def test_an_allowed_remote_viewer_gets_cors(tmp_path):
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "info").write_text("{}")
    with LayerServer({"l": tmp_path / "l"}, port=0, allow_origins=["https://neuroglancer-demo.appspot.com/"]) as srv:
        _, h, _ = get(srv, "/layers/l/info", {"Origin": "https://neuroglancer-demo.appspot.com"})
        assert h["access-control-allow-origin"] == "https://neuroglancer-demo.appspot.com"


def test_the_viewer_is_bundled_and_served(served):
    srv, *_ = served
    assert viewer_dir() is not None, "the neuroglancer package (a dependency) bundles the client"
    status, h, body = get(srv, "/v/znni/")
    assert status == 200 and h["content-type"].startswith("text/html") and b"main." in body
    js = next(f for f in os.listdir(viewer_dir()) if f.startswith("main.") and f.endswith(".js"))
    status, h, body = get(srv, "/v/znni/" + js)
    assert status == 200 and h["content-type"] == "application/javascript" and len(body) > 100_000


def test_a_browsers_favicon_request_is_answered_without_an_error(served):
    """Full Chromium asks for /favicon.ico on every page: 204, nothing sent, no 4xx in the log (a
    viewer test that reads the log for errors failed where full Chromium is installed)."""
    srv, _, _, logs = served
    status, h, body = get(srv, "/favicon.ico")
    assert (status, body, h["content-length"]) == (204, b"", "0")
    assert get(srv, "/favicon.png")[0] == 404  # only the icon's own name
    assert not [line for line in logs if "favicon.ico" in line and '" 4' in line], logs


@pytest.mark.parametrize("length,status", [("-5", 400), ("x", 400), (str(2 << 20), 413), ("2", 200)])
def test_the_state_report_is_bounded_and_a_bad_length_is_refused(served, length, status):
    """The viewer's state POST: a negative length (read() would wait for the client to close,
    holding a thread) or one that is no number is 400, a huge one 413; a good one is answered."""
    from znni_core.pipeline.serve import VIEWER_TOKEN

    srv, *_ = served
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.putrequest("POST", f"/state/{VIEWER_TOKEN}")
    conn.putheader("Host", f"127.0.0.1:{srv.port}")
    conn.putheader("Content-Length", length)
    conn.endheaders()
    if status == 200:
        conn.send(b"{}")
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == status


def test_refuses_to_serve_a_filesystem_or_a_directory_tree(tmp_path):
    r = CliRunner().invoke(app, ["serve", "/"])
    assert r.exit_code != 0 and "never a whole directory tree" in r.output
    r = CliRunner().invoke(app, ["serve", "--layer", "/"])
    assert r.exit_code != 0 and "filesystem root" in r.output
    r = CliRunner().invoke(app, ["serve"])
    assert r.exit_code != 0 and "nothing to serve" in r.output


@pytest.mark.parametrize(
    "header,expect",
    [
        ("bytes=0-9", (0, 10)),
        ("bytes=5-", (5, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=90-1000", (90, 100)),
        ("bytes=100-", "invalid"),
        ("bytes=9-3", "invalid"),
        ("bytes=0-1,5-6", None),
        ("items=0-1", None),
    ],
)
def test_range_header_parsing(header, expect):
    assert _parse_range(header, 100) == expect


def test_report_link_uses_the_bundled_viewer_and_served_layers():
    from znni_core.pipeline.run import EXAMPLE, Run

    doc = EXAMPLE | {
        "work_dir": "/w",
        "region": {"offset": [0, 0, 0], "shape": [8, 8, 8]},
        "input": EXAMPLE["input"] | {"url": "file:///data/em", "resolution": [40, 4, 4]},
        "output": EXAMPLE["output"] | {"url": "file:///data/out"},
    }
    run = Run.from_json(doc, "test")
    link, notes = neuroglancer_link(run, "local", 1337)
    assert link.startswith("http://127.0.0.1:1337/v/znni/#!")
    assert "http%3A%2F%2F127.0.0.1%3A1337%2Flayers%2Finput" in link and "%2Flayers%2Foutput" in link
    assert notes == ["file:// layers: run `znni serve /w --port 1337` while viewing"]
    link, notes = neuroglancer_link(run, "https://neuroglancer-demo.appspot.com", 1337)
    assert link.startswith("https://neuroglancer-demo.appspot.com/#!")
    assert "--allow-origin https://neuroglancer-demo.appspot.com" in notes[0]


def test_serves_on_the_ipv6_loopback(tmp_path):
    """``--host ::1``: the server binds the IPv6 loopback and its URL brackets the address."""
    import socket

    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "info").write_text("{}")
    with LayerServer({"l": tmp_path / "l"}, host="::1", port=0) as srv:
        assert srv.url == f"http://[::1]:{srv.port}"
        with urllib.request.urlopen(f"{srv.url}/layers/l/info") as r:
            assert r.status == 200 and r.read() == b"{}"
