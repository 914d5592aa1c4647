"""znni's own read-only client for ``http://`` and ``https://`` layers (a lab's web server, a
bucket's public HTTPS endpoint): bounded retries of transient errors, none of permanent ones.

Every request about an object (a chunk, a shard's byte range, ``info``, zarr metadata) goes
through one ``urllib3`` pool per process, as the ``s3://`` and ``gs://`` clients do:

* HTTP 408, 425, 429, 500, 502, 503, 504 and connection errors (reset, refused, timeouts, a body
  cut short) are retried, :data:`MAX_ATTEMPTS` attempts in all (``ZNNI_HTTP_MAX_ATTEMPTS``, 1-20),
  waiting a jittered exponential backoff (base :data:`BACKOFF_S`, each wait at most
  :data:`MAX_WAIT_S`; a ``Retry-After`` of the server is honoured up to that bound);
* 404 and 410 are "absent" (a missing chunk, named by the reader, never zeros unless asked);
  401 and 403 fail at the first answer as a :class:`~znni_core.errors.StoragePermissionError`
  (znni sends no credentials over HTTP: the layer must be public); every other client error
  (400, 405, ...) and a certificate that does not verify fail at once as a
  :class:`~znni_core.errors.StorageError` naming the URL and the fix;
* :data:`CONNECT_TIMEOUT` / :data:`READ_TIMEOUT` seconds per attempt; up to 5 redirects followed.

Encodings: a ``Content-Encoding`` (gzip, br, zstd, ...) is undone by the store (:mod:`.store`),
never by the transport, so a byte range is a range of the stored bytes.  An object absent under
its name is looked for under the suffixes cloud-volume writes on ``file://`` (``.gz``, ``.br``,
``.zstd``, ``.xz``, ``.bz2``), so a local layer served as it lies on disk (``python -m http.server``)
reads as it does on ``file://``; the first found is read.  A ``Content-Encoding`` equal to the
suffix's (Apache's ``AddEncoding gzip .gz``) labels the stored encoding, it is not a second one.
Zarr inputs look up their keys under their names only (:class:`HttpObjects` ``suffixes``).

HTTPS certificates are verified against the system's CA store (which honours ``SSL_CERT_FILE``
and ``SSL_CERT_DIR``), or against the PEM bundle named by ``ZNNI_CA_BUNDLE`` (else
``REQUESTS_CA_BUNDLE``, else ``CURL_CA_BUNDLE``): a server with its own certificate authority is
trusted by naming it there.  ``http_proxy`` / ``https_proxy`` / ``no_proxy`` are honoured
(loopback addresses never go through a proxy).

The layers are read-only: a write or a delete is a :class:`~znni_core.errors.ConfigError`.
"""

from __future__ import annotations

import os
import threading
import time
from urllib.parse import quote, urlsplit

from ..errors import ConfigError, DataError, StorageError, StoragePermissionError
from .paths import LayerURL
from .retry import attempts_from_env, jittered_backoff

MAX_ATTEMPTS = 5  # first try included; ZNNI_HTTP_MAX_ATTEMPTS overrides (1-20)
BACKOFF_S = 0.1  # first wait; doubles per attempt, jittered (full jitter)
MAX_WAIT_S = 20.0
CONNECT_TIMEOUT = 10.0  # seconds, per attempt
READ_TIMEOUT = 60.0  # seconds without a byte, per attempt
MAX_REDIRECTS = 5
RETRIED = {408, 425, 429, 500, 502, 503, 504}
ABSENT = {404, 410}
CA_ENV = ("ZNNI_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
#: suffixes an object may be stored under, in probe order (the stored encoding's, as on ``file://``)
SUFFIXES = ("", ".gz", ".br", ".zstd", ".xz", ".bz2")
ENCODINGS = {".gz": "gzip", ".br": "br", ".zstd": "zstd", ".xz": "xz", ".bz2": "bz2"}
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")

_pools: dict = {}
_lock = threading.Lock()
#: the waits between attempts go through this (tests count and bound them)
sleep = time.sleep


def max_attempts() -> int:
    """Attempts per request, first included: ``ZNNI_HTTP_MAX_ATTEMPTS`` or :data:`MAX_ATTEMPTS`."""
    return attempts_from_env("ZNNI_HTTP_MAX_ATTEMPTS", MAX_ATTEMPTS, "HTTP")


def ca_bundle() -> tuple[str, str] | None:
    """``(variable, path)`` of the CA bundle named in the environment, or None (the system's store)."""
    for var in CA_ENV:
        path = os.environ.get(var)
        if path:
            if not os.path.isfile(path):
                raise ConfigError(f"{var}={path!r} is not a file; name a PEM bundle of CA certificates, or unset it")
            return var, path
    return None


def _pool(scheme: str, host: str):
    """The process's ``urllib3`` pool manager for ``scheme://host`` (a proxy manager where the
    environment names a proxy for it)."""
    import urllib.request

    import urllib3

    ca = ca_bundle()
    proxy = None
    hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if hostname not in _LOOPBACK:
        proxy = urllib.request.getproxies().get(scheme)
        if proxy and urllib.request.proxy_bypass(hostname):
            proxy = None
    key = (os.getpid(), ca, proxy, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            kw = {
                "num_pools": 32,
                "maxsize": 8,  # the readers' 8 requests in flight
                "timeout": urllib3.Timeout(connect=CONNECT_TIMEOUT, read=READ_TIMEOUT),
                "cert_reqs": "CERT_REQUIRED",
            }
            if ca:
                kw["ca_certs"] = ca[1]
            pool = urllib3.ProxyManager(proxy, **kw) if proxy else urllib3.PoolManager(**kw)
            _pools[key] = pool
    return pool


def _redirects():
    """urllib3's own retries: none (this module retries), redirects only."""
    import urllib3

    return urllib3.Retry(
        total=None,
        connect=0,
        read=0,
        status=0,
        other=0,
        redirect=MAX_REDIRECTS,
        raise_on_redirect=True,
        raise_on_status=False,
    )


class HttpObjects:
    """Objects under one ``http(s)://host/prefix`` layer, read-only; names are relative to the layer."""

    def __init__(self, url: LayerURL, suffixes=None):
        if url.protocol not in ("http", "https"):
            raise ValueError(f"{url} is not an http(s):// layer")
        self.suffixes = tuple(suffixes) if suffixes is not None else SUFFIXES
        self.url = url
        self.base = f"{url.protocol}://{url.path}"
        self.attempts = max_attempts()
        self.pool = _pool(url.protocol, urlsplit(self.base).netloc)
        self._suffix = ""  # the suffix found last: probed first (a layer stores its chunks one way)

    def where(self, name: str) -> str:
        """The object's URL."""
        return f"{self.base}/{name}"

    # ---- requests ----------------------------------------------------------------------------------
    def _request(self, method: str, name: str, headers: dict, accept=()):
        """One request with bounded retries: the response (2xx, or a status in ``accept``), or None
        when the object is absent (404, 410); a znni error for the others."""
        from urllib3.exceptions import HTTPError, MaxRetryError, ResponseError, SSLError

        where = self.where(name)
        url = f"{self.base}/{quote(name, safe='/')}"
        attempt = 0
        while True:
            attempt += 1
            wait = None
            try:
                r = self.pool.request(
                    method, url, headers=headers, preload_content=True, decode_content=False, retries=_redirects()
                )
            except (MaxRetryError, SSLError) as exc:
                reason = exc.reason if isinstance(exc, MaxRetryError) else exc
                if isinstance(reason, SSLError):
                    raise StorageError(
                        f"{method} {where}: the TLS connection failed ({reason}); this is permanent and was not "
                        "retried. If the server's certificate is signed by your own authority, name its PEM in "
                        "ZNNI_CA_BUNDLE (or SSL_CERT_FILE)"
                    ) from None
                if isinstance(reason, ResponseError):  # too many redirects
                    raise StorageError(f"{method} {where}: {reason}; check the URL") from None
                why = f"{type(reason).__name__}: {reason}"
            except (HTTPError, OSError) as exc:  # a reset, a body cut short, a read timeout
                why = f"{type(exc).__name__}: {exc}"
            else:
                status = r.status
                if status in ABSENT:
                    return None
                if 200 <= status < 300 or status in accept:
                    return r
                if status in (401, 403):
                    raise StoragePermissionError(
                        f"{method} {where} was refused: HTTP {status}. This is permanent and was not retried "
                        "(1 request). znni sends no credentials over http(s): make the layer readable without "
                        "them, or copy it to file://, s3:// or gs://"
                    )
                if status not in RETRIED:
                    raise StorageError(
                        f"{method} {where} was refused: HTTP {status}; not retried (a client error): check the URL "
                        "and that the server serves the layer's files as they are stored"
                    )
                why = f"HTTP {status}"
                wait = _retry_after(r.headers.get("Retry-After"))
            if attempt >= self.attempts:
                raise StorageError(
                    f"{method} {where}: still failing after {attempt} attempts with bounded backoff ({why}); check "
                    "that the URL is right and the server reachable, then re-run"
                )
            backoff = jittered_backoff(attempt, BACKOFF_S, MAX_WAIT_S)
            sleep(backoff if wait is None else max(backoff, wait))

    def _probe(self, method: str, name: str, headers: dict, accept=()):
        """``(response, suffix)`` of ``name`` under the first suffix it is stored with, or None."""
        order = (self._suffix,) + tuple(s for s in self.suffixes if s != self._suffix)
        for s in order:
            r = self._request(method, name + s, headers, accept)
            if r is not None:
                self._suffix = s
                return r, s
        return None

    # ---- objects -------------------------------------------------------------------------------------
    def get(self, name: str, byte_range: tuple[int, int] | None = None) -> tuple[bytes, str] | None:
        """``(bytes as stored, encoding)``, or None if absent; ``byte_range`` ``(start, end)``: only
        those bytes (end exclusive, one ranged GET of ``name`` itself).  An object stored under a
        suffix (``name.gz``) comes back with the suffix's encoding (followed by the server's
        ``Content-Encoding``, if it adds another)."""
        if byte_range is not None:
            start, end = byte_range
            headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
            r = self._request("GET", name, headers, accept=(416,))
            if r is None:
                return None
            if r.status == 416:
                raise DataError(f"GET {self.where(name)}: bytes {byte_range} lie past the object's end")
            body = r.data if r.status == 206 else r.data[start:end]  # 200: the server ignored the range
            return body, _encoding(r)
        got = self._probe("GET", name, {"Accept-Encoding": "gzip"})
        if got is None:
            return None
        r, suffix = got
        body, enc = r.data, _encoding(r)
        if not suffix:
            return body, enc
        stored = ENCODINGS[suffix]
        # a transport encoding over the stored one: both, in the order applied (as Content-Encoding lists them)
        return body, (f"{stored}, {enc}" if enc and enc != stored else stored)

    def size(self, name: str) -> int | None:
        """Bytes stored under ``name`` (any suffix), or None if absent (a HEAD; a server that
        refuses HEAD is asked for one byte instead)."""
        got = self._probe("HEAD", name, {"Accept-Encoding": "identity"}, accept=(405, 501))
        if got is None:
            return None
        r, suffix = got
        length = r.headers.get("Content-Length")
        if r.status in (405, 501) or length is None:
            r = self._request("GET", name + suffix, {"Range": "bytes=0-0", "Accept-Encoding": "identity"}, (416,))
            if r is None:
                return None
            total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
            if r.status == 416 or total == "0":
                return 0
            return int(total) if total.isdigit() else len(r.data)
        return int(length)

    def version(self, name: str) -> str | None:
        """The object's ``ETag``, else its ``Last-Modified`` and length, or None if absent."""
        got = self._probe("HEAD", name, {"Accept-Encoding": "identity"})
        if got is None:
            return None
        r, suffix = got
        h = r.headers
        return suffix + (h.get("ETag") or f"{h.get('Last-Modified', '')}|{h.get('Content-Length', '')}")

    def put(self, name: str, data: bytes, **kw) -> bool:
        """Refused: an http(s) layer is read-only (:class:`ConfigError`)."""
        raise _read_only(self.where(name))

    def delete(self, name: str) -> None:
        """Refused: an http(s) layer is read-only (:class:`ConfigError`)."""
        raise _read_only(self.where(name))


def _read_only(where: str) -> ConfigError:
    return ConfigError(
        f"{where}: http(s):// layers are read-only (znni reads over HTTP, never writes); "
        "write the output to a file://, s3:// or gs:// layer"
    )


def _encoding(r) -> str:
    """The response's ``Content-Encoding`` (``""`` for none or identity)."""
    enc = ",".join(e.strip() for e in (r.headers.get("Content-Encoding") or "").split(",") if e.strip())
    return "" if enc == "identity" else enc


def _retry_after(value) -> float | None:
    """A ``Retry-After`` in seconds (at most :data:`MAX_WAIT_S`), or None (absent, or a date)."""
    try:
        return min(max(float(value), 0.0), MAX_WAIT_S) if value is not None else None
    except ValueError:
        return None
