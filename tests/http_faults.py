"""Loopback object stores behind a small HTTP proxy that fails or corrupts requests on purpose
(docs/reliability.md, T7, T8, T28d).

    with S3Faults() as s3:              # moto on 127.0.0.1:<port>, proxy on 127.0.0.1:<port>
        s3.rule("PUT", "8_8_40/", "503", times=2)   # the first two chunk PUTs answer 503
        ... use s3.endpoint (the proxy) as endpoint_url ...
        s3.log                          # [(method, path, action)] of every request seen
        s3.access_keys                  # the access key id (never the secret) that signed each of them

    with GcsFaults(emulator_port) as gs:  # in front of a gcp-storage-emulator (tests/conftest.py)
        gs.rule("GET", "/o/faults%2Fx", "503", times=2)
        ... STORAGE_EMULATOR_HOST=gs.endpoint ...

One proxy (:class:`FaultProxy`) serves both: it forwards each request to the upstream server on
``upstream_port``, unless a rule says otherwise, and answers injected errors in the protocol's own
form: an S3 XML ``<Error>``, or a GCS JSON ``{"error": {"code": N, "message": ...}}``, so the
client under test parses a real HTTP answer.

Actions: an HTTP status (``"401"``, ``"403"``, ``"412"``, ``"429"``, ``"500"``, ``"503"``, ...: the
error, request not forwarded), ``reset`` (the connection is closed without an answer), ``corrupt``
(forwarded; one byte of the response body, or of a PUT body, is flipped: headers such as ETag are
left as they were).
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import urllib.parse
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: the error each protocol answers for a status: S3's XML code, GCS's JSON reason; and the message
_S3 = {
    401: ("Unauthorized", "Unauthorized"),
    403: ("AccessDenied", "Access Denied"),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
    429: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
_GCS = {
    401: ("required", "Anonymous caller does not have storage.objects access to the Google Cloud Storage object."),
    403: ("forbidden", "Caller does not have storage.objects access to the Google Cloud Storage object."),
    412: ("conditionNotMet", "At least one of the pre-conditions you specified did not hold."),
    429: ("rateLimitExceeded", "The rate of change requests to the object exceeds the rate limit."),
    500: ("backendError", "Backend Error"),
    503: ("backendError", "Service Unavailable"),
}


def error_body(protocol: str, status: int) -> tuple[str, bytes]:
    """``(Content-Type, body)`` of an error answer with ``status`` in ``protocol`` ("s3" or "gcs")."""
    if protocol == "s3":
        code, msg = _S3.get(status, (HTTPStatus(status).phrase.replace(" ", ""), HTTPStatus(status).phrase))
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
            f"<RequestId>znni-test</RequestId></Error>"
        )
        return "application/xml", body.encode()
    if protocol == "gcs":
        reason, msg = _GCS.get(status, ("backendError", HTTPStatus(status).phrase))
        doc = {
            "error": {
                "code": status,
                "message": msg,
                "errors": [{"message": msg, "domain": "global", "reason": reason}],
            }
        }
        return "application/json; charset=UTF-8", json.dumps(doc).encode()
    raise ValueError(f"unknown protocol {protocol!r}")


class _Rule:
    def __init__(self, method, contains, action, times):
        self.method, self.contains, self.action, self.left = method, contains, action, times

    def take(self, method, path) -> bool:
        if self.method not in ("*", method) or self.contains not in path or self.left == 0:
            return False
        if self.left is not None:
            self.left -= 1
        return True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _error(self, status: int):
        ctype, data = error_body(self.server.owner.protocol, status)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self):
        s: FaultProxy = self.server.owner
        body = self._body()
        action = s._action(self.command, self.path)
        m = re.search(r"Credential=([^/,\s]+)/", self.headers.get("Authorization", ""))
        with s._lock:
            s.access_keys.append(m.group(1) if m else None)
        if action is None:
            with s._conditional(self.command, self.path, body) as status:
                if status is not None:
                    s._record(self.command, self.path, str(status))
                    return self._error(status)
                s._record(self.command, self.path, "ok")
                return self._forward(body, None)
        s._record(self.command, self.path, action)
        if action == "reset":
            self.close_connection = True
            self.connection.close()
            return
        if action.isdigit():
            return self._error(int(action))
        return self._forward(body, action)

    def _forward(self, body: bytes, action):
        s: FaultProxy = self.server.owner
        if action == "corrupt" and self.command in ("PUT", "POST") and body:
            body = _flip(body)
        r, data = s.upstream(self.command, self.path, body, self.headers.items())
        if action == "corrupt" and self.command == "GET" and data and r.status in (200, 206):
            data = _flip(data)
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                self.send_header(k, v)
        # a HEAD answer has no body but the object's length
        length = r.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up (after a reset): quiet
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _flip(b: bytes) -> bytes:
    i = len(b) // 2
    return b[:i] + bytes([b[i] ^ 0x5A]) + b[i + 1 :]


class _NoCondition:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class FaultProxy:
    """A fault-injecting HTTP proxy on 127.0.0.1 in front of a loopback server on ``upstream_port``;
    injected errors are answered in ``protocol``'s form ("s3" or "gcs").  ``endpoint`` is the
    proxy's URL, ``direct`` the upstream's; ``log`` holds ``(method, path, action)`` of every request
    the proxy saw, ``action`` "ok" for one forwarded as it was."""

    protocol = "s3"

    def __init__(self, upstream_port: int | None = None, protocol: str | None = None):
        self.upstream_port = upstream_port
        self.protocol = protocol or self.protocol
        self.log: list[tuple[str, str, str]] = []
        self.access_keys: list[str | None] = []  # the access key id that signed each request of ``log``
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()

    def rule(self, method: str, contains: str, action: str, times: int | None = None) -> None:
        """Apply ``action`` to the next ``times`` requests (None: all) of ``method`` whose path contains ``contains``."""
        with self._lock:
            self._rules.append(_Rule(method, contains, action, times))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def _action(self, method, path):
        with self._lock:
            for r in self._rules:
                if r.take(method, path):
                    return r.action
        return None

    def _record(self, method, path, action):
        with self._lock:
            self.log.append((method, path, action))

    def _conditional(self, method, path, body):
        """A context whose value is the status a precondition of the request fails with, or None
        (hook for servers that ignore preconditions: :class:`GcsFaults`)."""
        return _NoCondition()

    def requests(self, method: str, contains: str) -> int:
        """How many requests of ``method`` whose path contains ``contains`` the proxy saw."""
        return sum(1 for m, p, _ in self.log if m == method and contains in p)

    def upstream(self, method: str, path: str, body: bytes = b"", headers=()):
        """Send a request to the upstream server directly: ``(response, body)``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            host = False
            for k, v in headers:
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    conn.putheader(k, v)
                    host = host or k.lower() == "host"
            if not host:
                conn.putheader("Host", f"127.0.0.1:{self.upstream_port}")
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            r = conn.getresponse()
            return r, r.read()
        finally:
            conn.close()

    def start(self) -> FaultProxy:
        self._proxy = _Server(("127.0.0.1", 0), _Handler)
        self._proxy.owner = self
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self.direct = f"http://127.0.0.1:{self.upstream_port}"
        return self

    def stop(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class S3Faults(FaultProxy):
    """moto (in this process) behind the proxy, with an empty bucket ``bucket``."""

    protocol = "s3"

    def __init__(self, bucket: str = "znni"):
        super().__init__()
        self.bucket = bucket

    def __enter__(self):
        from moto.server import ThreadedMotoServer

        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self._moto.start()
        _, self.upstream_port = self._moto.get_host_and_port()
        self.start()
        # moto's backends are process-global: every ThreadedMotoServer in this pytest process shares
        # one store, so a bucket another test filled would leak in here.  Start from an empty store.
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.direct}/moto-api/reset", method="POST")).read()
        self._client().create_bucket(Bucket=self.bucket)
        return self

    def _client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.direct, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` directly in moto (no faults, not logged)."""
        self._client().put_object(Bucket=self.bucket, Key=key, Body=data)

    def objects(self) -> dict[str, bytes]:
        """Every stored object (key -> bytes), read directly from moto."""
        c = self._client()
        out = {}
        for o in c.list_objects_v2(Bucket=self.bucket).get("Contents", []):
            out[o["Key"]] = c.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
        return out

    def __exit__(self, *exc):
        self.stop()
        self._moto.stop()


class GcsFaults(FaultProxy):
    """The proxy in front of a running GCS emulator (gcp-storage-emulator) on ``upstream_port``.

    The emulator ignores preconditions: it would overwrite an object an upload asked to create
    only (``ifGenerationMatch=0``).  The proxy enforces that one itself, as GCS does: such an
    upload of an object the emulator holds is answered 412 ``conditionNotMet`` (logged as "412"),
    not forwarded; the check and the forwarded upload hold one lock, so of simultaneous creators
    exactly one wins."""

    protocol = "gcs"

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port, "gcs")
        self._create_lock = threading.Lock()

    def _conditional(self, method, path, body):
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        if method != "POST" or "/upload/storage/v1/b/" not in path or q.get("ifGenerationMatch") != ["0"]:
            return _NoCondition()
        bucket = path.split("/upload/storage/v1/b/", 1)[1].split("/", 1)[0]
        name = q.get("name", [None])[0]
        if name is None:  # a multipart upload: the name is in its JSON metadata part
            m = re.search(rb'"name"\s*:\s*"((?:[^"\\]|\\.)*)"', body)
            name = json.loads(b'"' + m.group(1) + b'"') if m else None
        proxy = self

        class _Check:
            def __enter__(self):
                proxy._create_lock.acquire()
                if name is None:
                    return None
                key = urllib.parse.quote(name, safe="")
                r, _ = proxy.upstream("GET", f"/storage/v1/b/{bucket}/o/{key}")
                return 412 if r.status == 200 else None

            def __exit__(self, *exc):
                proxy._create_lock.release()
                return False

        return _Check()

    def get(self, key: str, bucket: str = "znni") -> bytes | None:
        """The bytes of ``key`` read directly from the emulator (no faults, not logged), or None."""
        r, data = self.upstream(
            "GET", f"/download/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}?alt=media"
        )
        return data if r.status == 200 else None
