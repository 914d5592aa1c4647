"""``znni serve``: a run's layers and the bundled Neuroglancer client over HTTP, nothing else.

URLs: ``/v/znni/`` (``/`` redirects there) is the Neuroglancer client of the PyPI
``neuroglancer`` package, so a report's link works with no internet; its build talks to a
Python server, so ``/events/znni`` holds an empty state stream open and ``POST /state/znni``
acknowledges state reports (the state stays in the page's URL). ``/layers/<name>/<key>`` is
file ``<key>`` of layer ``<name>`` (by default ``input`` and ``output`` of a run, when they
are ``file://``). Everything else is 404.

What it refuses, because any web page open in the user's browser can send it requests:

* paths outside the served layers: ``..``, encoded separators, dot-files (zarr v2's
  ``.zarray``/``.zattrs``/``.zgroup``/``.zmetadata`` excepted), directories (no listings)
  and symlinks whose target leaves the layer;
* a ``Host`` other than the address it is bound to on loopback (DNS rebinding);
* CORS to any origin but its own and those given with ``--allow-origin`` (a remote viewer).

It serves ``Range`` requests (Neuroglancer reads sharded layers by byte ranges) and a key
stored compressed as ``<key>.gz`` / ``<key>.br`` (cloud-volume's and igneous' convention)
with the matching ``Content-Encoding``.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import socket
import threading
import urllib.parse
from pathlib import Path

from ..errors import ConfigError
from ..io.paths import parse_layer_url
from .run import Run

__all__ = ["VIEWER_TOKEN", "LayerServer", "run_layers", "viewer_dir"]

ZARR_DOTFILES = {".zarray", ".zattrs", ".zgroup", ".zmetadata"}
ENCODINGS = ((".gz", "gzip"), (".br", "br"))
MIME = {
    ".html": "text/html; charset=utf-8",
    ".js": "application/javascript",
    ".css": "text/css",
    ".map": "application/json",
    ".wasm": "application/wasm",
    ".json": "application/json",
}
VIEWER_TOKEN = "znni"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def viewer_dir() -> Path | None:
    """The Neuroglancer client bundled in the ``neuroglancer`` package (None when not installed)."""
    try:
        # lazy: loads neuroglancer only when called
        import neuroglancer
    except ImportError:
        return None
    d = Path(neuroglancer.__file__).parent / "static" / "client"
    return d if (d / "index.html").is_file() else None


def run_layers(run: Run) -> dict[str, Path]:
    """``{name: directory}`` of a run's local layers (``input``, ``output``)."""
    layers = {}
    for name, layer in (("input", run.input), ("output", run.output)):
        url = parse_layer_url(layer.url)
        if url.is_local:
            layers[name] = url.local_path
    return layers


def _segments(path: str) -> list[str] | None:
    """The decoded segments of a URL path; None when any could step outside (``..``, dot-files,
    encoded separators, NUL)."""
    parts = path.split("/")[1:]
    if parts and parts[-1] == "":  # a trailing slash
        parts.pop()
    out = []
    for raw in parts:
        seg = urllib.parse.unquote(raw, errors="strict") if "%" in raw else raw
        if seg == "" or "/" in seg or "\\" in seg or "\x00" in seg:
            return None
        if seg.startswith(".") and seg not in ZARR_DOTFILES:
            return None
        out.append(seg)
    return out


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "znni-serve"
    protocol_version = "HTTP/1.1"

    @property
    def owner(self) -> "LayerServer":
        return self.server.owner

    def log_message(self, fmt, *args):
        self.owner.log(f"{self.address_string()} {fmt % args}")

    # ---- routing -------------------------------------------------------------------------
    def _target(self) -> tuple[Path, str | None] | None:
        """(file, content encoding) for the request path, or None (404)."""
        path = urllib.parse.urlsplit(self.path).path
        try:
            segs = _segments(path)
        except UnicodeDecodeError:
            return None
        if segs is None:
            return None
        if segs[:2] == ["v", VIEWER_TOKEN]:  # the client (its build expects /v/<token>/)
            name = "/".join(segs[2:]) or "index.html"
            v = self.owner.viewer
            if v is None or name not in self.owner.viewer_files:
                return None
            return v / name, None
        if len(segs) < 3 or segs[0] != "layers" or segs[1] not in self.owner.layers:
            return None
        root = self.owner.layers[segs[1]]
        for suffix, enc in (("", None),) + ENCODINGS:
            f = root.joinpath(*segs[2:-1], segs[-1] + suffix)
            try:
                real = Path(os.path.realpath(f))
            except OSError:
                return None
            if real.is_file():
                # a symlink (anywhere on the way) leading out of the layer is refused
                return (real, enc) if real.is_relative_to(root) else None
        return None

    def _host_ok(self) -> bool:
        allowed = self.owner.allowed_hosts
        return allowed is None or (self.headers.get("Host") or "").lower() in allowed

    def _cors(self):
        origin = self.headers.get("Origin")
        if origin and origin in self.owner.origins:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Expose-Headers", "Content-Range, Content-Length, Content-Encoding")
        self.send_header("Vary", "Origin")

    def _fail(self, code: int, why: str):
        body = (why + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self._cors()
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    # ---- methods -------------------------------------------------------------------------
    def do_OPTIONS(self):  # noqa: N802 (http.server's naming)
        if not self._host_ok():
            return self._fail(403, "host not allowed")
        origin = self.headers.get("Origin")
        if not origin or origin not in self.owner.origins:
            return self._fail(403, "origin not allowed")
        self.send_response(204)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD")
        self.send_header("Access-Control-Allow-Headers", "Range")
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self):  # noqa: N802
        self.do_GET()

    def do_POST(self):  # noqa: N802
        # The client's build reports its state to a Python server (POST /state/<token>); here the
        # state lives in the browser (the URL), so the report is read, bounded, and dropped.
        if not self._host_ok() or urllib.parse.urlsplit(self.path).path != f"/state/{VIEWER_TOKEN}":
            return self._fail(404 if self._host_ok() else 403, "not found")
        try:  # a negative length made rfile.read wait for the client to close (a thread held)
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._fail(400, "Content-Length is not a number")
        if n < 0:
            return self._fail(400, "negative Content-Length")
        if n > 1 << 20:
            return self._fail(413, "too large")
        try:
            g = json.loads(self.rfile.read(n) or b"{}").get("g", 0)
        except (ValueError, AttributeError):
            return self._fail(400, "not JSON")
        body = json.dumps({"g": g if isinstance(g, int) else 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _events(self):
        """The client's state channel (an event stream): held open, never sends a state, so
        the viewer keeps the one in its URL."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.close_connection = True
        try:
            self.wfile.write(b": znni serve\n\n")
            self.wfile.flush()
            while not self.owner.stopping.wait(15):
                self.wfile.write(b": keepalive\n\n")
                self.wfile.flush()
        except OSError:  # the page went away
            pass

    def do_GET(self):  # noqa: N802
        if not self._host_ok():
            return self._fail(403, "host not allowed (DNS rebinding?): use http://127.0.0.1:<port>/")
        if urllib.parse.urlsplit(self.path).path in ("/", "/index.html"):
            self.send_response(302)
            self.send_header("Location", f"/v/{VIEWER_TOKEN}/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if urllib.parse.urlsplit(self.path).path == f"/events/{VIEWER_TOKEN}":
            return self._events()
        if urllib.parse.urlsplit(self.path).path == "/favicon.ico":  # every full browser asks: no icon, no error
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        target = self._target()
        if target is None:
            return self._fail(404, "not found")
        path, enc = target
        try:
            f = open(path, "rb")
        except OSError:
            return self._fail(404, "not found")
        with f:
            self._send_file(f, path, enc)

    def _send_file(self, f, path: Path, enc: str | None):
        size = os.fstat(f.fileno()).st_size
        status, lo, hi = 200, 0, size
        rng = self.headers.get("Range")
        if rng and enc is None:
            parsed = _parse_range(rng, size)
            if parsed == "invalid":
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self._cors()
                self.end_headers()
                return
            if parsed is not None:
                status, (lo, hi) = 206, parsed
        self.send_response(status)
        self.send_header("Content-Type", MIME.get(path.suffix if enc is None else "", "application/octet-stream"))
        self.send_header("Content-Length", str(hi - lo))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Cache-Control", "no-cache")
        if status == 206:
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}")
        if enc:
            self.send_header("Content-Encoding", enc)
        self._cors()
        self.end_headers()
        if self.command == "HEAD":
            return
        f.seek(lo)
        left = hi - lo
        while left > 0:  # a shard may be gigabytes: stream it, never read it whole
            block = f.read(min(left, 1 << 20))
            if not block:
                break
            self.wfile.write(block)
            left -= len(block)


def _parse_range(header: str, size: int):
    """(lo, hi) of one ``bytes=`` range; None: serve whole (several ranges, other units);
    ``"invalid"``: unsatisfiable (416)."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not m or (m[1] == "" and m[2] == ""):
        return None
    if m[1] == "":  # suffix: the last n bytes
        n = int(m[2])
        return (max(0, size - n), size) if n > 0 and size > 0 else "invalid"
    lo = int(m[1])
    hi = size if m[2] == "" else min(size, int(m[2]) + 1)
    if lo >= size or hi <= lo:
        return "invalid"
    return lo, hi


class _Server6(http.server.ThreadingHTTPServer):
    """The threading server on an IPv6 address (``::1``, ``::``)."""

    address_family = socket.AF_INET6


class LayerServer:
    """Serve ``layers`` (``{name: directory}``) and the viewer on ``host:port`` (0: any free port).

    ``allow_origins``: origins besides the server's own granted CORS (a remote Neuroglancer).
    """

    def __init__(self, layers: dict, *, host: str = "127.0.0.1", port: int = 1337, allow_origins=(), log=None):
        self.layers = {}
        for name, d in layers.items():
            real = Path(os.path.realpath(d))
            if real == Path(real.anchor):
                raise ConfigError(
                    f"layer {name or d}: refusing to serve the filesystem root {d}; give the layer directory"
                )
            if not real.is_dir():
                raise ConfigError(f"layer {name}: {d} is not a directory")
            if not _NAME.match(name):
                raise ConfigError(f"layer name {name!r}: use letters, digits, '_', '-' and '.' (--layer NAME=PATH)")
            self.layers[name] = real
        self.viewer = viewer_dir()
        self.viewer_files = set(os.listdir(self.viewer)) if self.viewer else set()
        self._log = log
        server = _Server6 if ":" in host else http.server.ThreadingHTTPServer  # an IPv6 literal
        self.httpd = server((host, port), _Handler)
        self.httpd.owner = self
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        own = {f"http://127.0.0.1:{self.port}", f"http://localhost:{self.port}"}
        if host not in ("127.0.0.1", "localhost", "::1"):
            own.add(f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}")
        if host == "::1":
            own.add(f"http://[::1]:{self.port}")
        self.origins = own | {o.rstrip("/") for o in allow_origins}
        loopback = host in ("127.0.0.1", "localhost", "::1")
        self.allowed_hosts = (
            {f"127.0.0.1:{self.port}", f"localhost:{self.port}", f"[::1]:{self.port}"} if loopback else None
        )
        self._thread = None
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        """The server's base URL, ``http://host:port`` (``localhost`` given as ``127.0.0.1``)."""
        host = "127.0.0.1" if self.host in ("127.0.0.1", "localhost") else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def log(self, line: str):
        """Pass ``line`` to the ``log`` callable given at construction, if any."""
        if self._log:
            self._log(line)

    def start(self) -> "LayerServer":
        """Serve in a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self):
        """Serve in the calling thread until interrupted (``znni serve``: Ctrl-C, then :meth:`close`)."""
        self.httpd.serve_forever()

    def close(self):
        """Stop serving (if started by :meth:`start`) and close the listening socket."""
        self.stopping.set()
        self.httpd.shutdown() if self._thread else None
        self.httpd.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
