"""A loopback S3 (moto) behind a small HTTP proxy that fails or corrupts requests on purpose
(docs/reliability.md, T7, T8, T28d).

    with S3Faults() as s3:              # moto on 127.0.0.1:<port>, proxy on 127.0.0.1:<port>
        s3.rule("PUT", "8_8_40/", "503", times=2)   # the first two chunk PUTs answer 503
        ... use s3.endpoint (the proxy) as endpoint_url ...
        s3.log                          # [(method, path, action)] of every request seen
        s3.access_keys                  # the access key id (never the secret) that signed each of them

Actions: ``503`` / ``500`` / ``403`` (an S3 XML error, request not forwarded), ``reset`` (the
connection is closed without an answer), ``corrupt`` (forwarded; one byte of the response body,
or of a PUT body, is flipped: headers such as ETag are left as they were).
"""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_ERR = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "AccessDenied", "Access Denied"),
}


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

    def _handle(self):
        s: S3Faults = self.server.owner
        body = self._body()
        action = s._action(self.command, self.path)
        s.log.append((self.command, self.path, action or "ok"))
        m = re.search(r"Credential=([^/,\s]+)/", self.headers.get("Authorization", ""))
        s.access_keys.append(m.group(1) if m else None)
        if action == "reset":
            self.close_connection = True
            self.connection.close()
            return
        if action in _ERR:
            code, name, msg = _ERR[action]
            data = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{name}</Code><Message>{msg}</Message>'
                f"<RequestId>znni-test</RequestId></Error>"
            ).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if action == "corrupt" and self.command == "PUT" and body:
            body = _flip(body)
        conn = http.client.HTTPConnection("127.0.0.1", s.upstream_port, timeout=30)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for k, v in self.headers.items():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                conn.putheader(k, v)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        data = r.read()
        if action == "corrupt" and self.command == "GET" and data and r.status == 200:
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
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def _flip(b: bytes) -> bytes:
    i = len(b) // 2
    return b[:i] + bytes([b[i] ^ 0x5A]) + b[i + 1 :]


class S3Faults:
    def __init__(self, bucket: str = "znni"):
        self.bucket = bucket
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

    def requests(self, method: str, contains: str) -> int:
        return sum(1 for m, p, _ in self.log if m == method and contains in p)

    def __enter__(self):
        from moto.server import ThreadedMotoServer

        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self._moto.start()
        _, self.upstream_port = self._moto.get_host_and_port()
        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._proxy.daemon_threads = True
        self._proxy.owner = self
        self._thread = threading.Thread(target=self._proxy.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"
        self.direct = f"http://127.0.0.1:{self.upstream_port}"
        # moto's backends are process-global: every ThreadedMotoServer in this pytest process shares
        # one store, so a bucket another test filled would leak in here.  Start from an empty store.
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(f"{self.direct}/moto-api/reset", method="POST")).read()
        import boto3

        boto3.client(
            "s3", endpoint_url=self.direct, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        ).create_bucket(Bucket=self.bucket)
        return self

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` directly in moto (no faults, not logged)."""
        import boto3

        boto3.client(
            "s3", endpoint_url=self.direct, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        ).put_object(Bucket=self.bucket, Key=key, Body=data)

    def objects(self) -> dict[str, bytes]:
        """Every stored object (key -> bytes), read directly from moto."""
        import boto3

        c = boto3.client(
            "s3", endpoint_url=self.direct, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        out = {}
        for o in c.list_objects_v2(Bucket=self.bucket).get("Contents", []):
            out[o["Key"]] = c.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
        return out

    def __exit__(self, *exc):
        self._proxy.shutdown()
        self._proxy.server_close()
        self._moto.stop()
