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
  (znni sends no credentials over HTTP: the layer must be public; a bucket's HTTPS endpoint also
  answers 403 for an absent key to readers that may not list it, and the message says so); every other client error
  (400, 405, ...) and a certificate that does not verify fail at once as a
  :class:`~znni_core.errors.StorageError` naming the URL and the fix;
* :data:`CONNECT_TIMEOUT` / :data:`READ_TIMEOUT` seconds per attempt; up to :data:`MAX_REDIRECTS`
  redirects followed (by this module, hop by hop), never one from ``https`` to plain ``http`` (a
  :class:`~znni_core.errors.StorageError` naming both URLs).

Encodings: a ``Content-Encoding`` (gzip, br, zstd, ...) is undone by the store (:mod:`.store`),
never by the transport, so a byte range is a range of the stored bytes.  An object absent under
its name is looked for under the suffixes cloud-volume writes on ``file://`` (``.gz``, ``.br``,
``.zstd``, ``.xz``, ``.bz2``), so a local layer served as it lies on disk (``python -m http.server``)
reads as it does on ``file://``.  An object found under two of them (``x`` and ``x.gz``) is refused,
as on ``file://`` (a :class:`~znni_core.errors.DataError` naming both): which copy is current cannot
be told.  To keep one request per object, suffixes are learnt per directory (a scale's chunks are
stored one way; ``info`` beside them another): the first object found in a directory is looked for
under every suffix, and its suffix is the directory's; each later object there is asked for under
it first, and looked for under all the others only when absent (a missing object costs one request
per suffix).  Once an object turns up under another suffix the directory is mixed, and each object
in it is looked for under every suffix from then on.  An object found under its directory's suffix
is not looked for under the others: a second copy of it is refused only in a mixed directory.  A
``Content-Encoding`` equal to the suffix's (Apache's ``AddEncoding gzip .gz``) labels the stored
encoding, it is not a second one.  Zarr inputs look up their keys under their names only
(:class:`HttpObjects` ``suffixes``).

A server that refuses ``HEAD`` (405, 501) is asked for one byte (``Range: bytes=0-0``) instead:
an object's size and version come from that answer's ``Content-Range``, ``ETag`` and
``Last-Modified``.

HTTPS certificates are verified against the system's CA store (which honours ``SSL_CERT_FILE``
and ``SSL_CERT_DIR``), or against the PEM bundle named by ``ZNNI_CA_BUNDLE`` (else
``REQUESTS_CA_BUNDLE``, else ``CURL_CA_BUNDLE``): a server with its own certificate authority is
trusted by naming it there.  ``http_proxy`` / ``https_proxy`` / ``no_proxy`` are honoured
(loopback addresses never go through a proxy); a proxy must be an ``http://`` or ``https://`` URL
(``https_proxy=proxy:3128`` is a :class:`~znni_core.errors.ConfigError` naming the variable).

The layers are read-only: a write or a delete is a :class:`~znni_core.errors.ConfigError`.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from dataclasses import replace
from urllib.parse import quote, urljoin, urlsplit

from ..errors import ConfigError, DataError, StorageError, StoragePermissionError
from .encodings import ALL_SUFFIXES as SUFFIXES  # the suffixes an object may be stored under, in probe order
from .encodings import ENCODINGS  # suffix -> encoding, as on file://
from .paths import LayerURL, read_only_error
from .retry import attempts_from_env, jittered_backoff

MAX_ATTEMPTS = 5  # first try included; ZNNI_HTTP_MAX_ATTEMPTS overrides (1-20)
BACKOFF_S = 0.1  # first wait; doubles per attempt, jittered (full jitter)
MAX_WAIT_S = 20.0
CONNECT_TIMEOUT = 10.0  # seconds, per attempt
READ_TIMEOUT = 60.0  # seconds without a byte, per attempt
MAX_REDIRECTS = 5
RETRIED = {408, 425, 429, 500, 502, 503, 504}
ABSENT = {404, 410}
NO_HEAD = (405, 501)  # a server that refuses HEAD: asked for one byte instead
CA_ENV = ("ZNNI_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
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


def _proxy_variable(scheme: str, value: str) -> str:
    """The environment variable that set ``value`` as the proxy for ``scheme`` (for messages)."""
    for var in (f"{scheme}_proxy", f"{scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"):
        if os.environ.get(var) == value:
            return var
    return f"{scheme}_proxy"


def check_proxy(scheme: str, proxy: str) -> None:
    """A :class:`ConfigError` naming the variable and the fix when ``proxy`` (the environment's proxy for
    ``scheme``) is no ``http://`` or ``https://`` URL (``https_proxy=proxy:3128``: urllib3 would fail
    with a traceback).  The message shows the proxy without any ``user:password@``."""
    given, _, rest = proxy.rpartition("://")
    if given in ("http", "https") and urlsplit(proxy).hostname:
        return
    host = rest.rpartition("@")[2].split("/", 1)[0]
    shown = f"{given}://{host}" if given else host
    raise ConfigError(
        f"{_proxy_variable(scheme, proxy)}={shown!r} is not an http:// or https:// proxy URL; write it as "
        f"http://{host} (or https://{host} for a TLS proxy), or unset it"
    )


def _pool(scheme: str, host: str):
    """The process's ``urllib3`` pool manager for ``scheme://host`` (a proxy manager where the
    environment names a proxy for it)."""
    # lazy: loads urllib3 only when called
    import urllib3

    ca = ca_bundle()
    proxy = None
    hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if hostname not in _LOOPBACK:
        proxy = urllib.request.getproxies().get(scheme)
        if proxy and urllib.request.proxy_bypass(hostname):
            proxy = None
        if proxy:
            check_proxy(scheme, proxy)
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


def _no_retries():
    """urllib3's own retries: none (this module retries, and follows redirects itself)."""
    # lazy: loads urllib3 only when called
    import urllib3

    return urllib3.Retry(
        total=None, connect=0, read=0, status=0, other=0, redirect=0, raise_on_redirect=False, raise_on_status=False
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
        #: ``{directory: suffix}``: the suffix of the first object found in each directory (looked for
        #: under every suffix), asked for first from then on; set once, never reordered
        self.dir_suffix: dict[str, str] = {}
        #: directories where an object turned up under another suffix than the directory's: each object
        #: there is looked for under every suffix (and refused where two copies exist)
        self.mixed: set[str] = set()
        self._state = threading.Lock()

    def where(self, name: str) -> str:
        """The object's URL."""
        return f"{self.base}/{name}"

    # ---- requests ----------------------------------------------------------------------------------
    def _send(self, method: str, url: str, where: str, headers: dict):
        """One request, its redirects followed hop by hop (at most :data:`MAX_REDIRECTS`); a
        :class:`StorageError` for a redirect from ``https`` to anything else, naming both URLs."""
        pool = self.pool
        for hop in range(MAX_REDIRECTS + 1):
            r = pool.request(
                method,
                url,
                headers=headers,
                preload_content=True,
                decode_content=False,
                redirect=False,
                retries=_no_retries(),
            )
            location = r.get_redirect_location()
            if not location:
                return r
            target = urljoin(url, location)
            if hop == MAX_REDIRECTS:
                raise StorageError(
                    f"{method} {where}: more than {MAX_REDIRECTS} redirects (the last to {target}); not retried: "
                    "check the URL and the server's redirects"
                )
            was, scheme = urlsplit(url).scheme, urlsplit(target).scheme
            if scheme not in ("http", "https") or (was == "https" and scheme != "https"):
                raise StorageError(
                    f"{method} {where} was redirected from {url} to {target}: a redirect from {was}:// to {scheme}:// "
                    "is refused (the bytes would travel unprotected); not retried: fix the server's redirect, or give "
                    "the layer's http:// URL yourself if plain http is intended"
                )
            if r.status == 303 and method != "HEAD":
                method = "GET"
            url = target
            pool = _pool(scheme, urlsplit(url).netloc)  # another host or scheme may go through another proxy
        raise AssertionError("unreachable")  # pragma: no cover

    def _request(self, method: str, name: str, headers: dict, accept=()):
        """One request with bounded retries: the response (2xx, or a status in ``accept``), or None
        when the object is absent (404, 410); a znni error for the others."""
        # lazy: loads urllib3 only when called
        from urllib3.exceptions import HTTPError, MaxRetryError, SSLError

        where = self.where(name)
        url = f"{self.base}/{quote(name, safe='/')}"
        attempt = 0
        while True:
            attempt += 1
            wait = None
            try:
                r = self._send(method, url, where, headers)
            except (MaxRetryError, SSLError) as exc:
                reason = exc.reason if isinstance(exc, MaxRetryError) else exc
                if isinstance(reason, SSLError):
                    raise StorageError(
                        f"{method} {where}: the TLS connection failed ({reason}); this is permanent and was not "
                        "retried. If the server's certificate is signed by your own authority, name its PEM in "
                        "ZNNI_CA_BUNDLE (or SSL_CERT_FILE)"
                    ) from None
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
                        "them, or copy it to file://, s3:// or gs://. A bucket's HTTPS endpoint (S3, GCS) also "
                        "answers 403 for a key that is simply absent when anonymous readers may not list the "
                        "bucket: the object may be missing"
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

    def _head(self, key: str):
        """``(response, ranged)`` of a HEAD of ``key``, or None if absent.  A server that refuses HEAD
        (405, 501), or answers it without a ``Content-Length``, is asked for one byte instead
        (``ranged``: the answer is that GET's: 206, 200 where the range was ignored, 416 for an empty object)."""
        r = self._request("HEAD", key, {"Accept-Encoding": "identity"}, accept=NO_HEAD)
        if r is None:
            return None
        if r.status not in NO_HEAD and r.headers.get("Content-Length") is not None:
            return r, False
        r = self._request("GET", key, {"Range": "bytes=0-0", "Accept-Encoding": "identity"}, accept=(416,))
        return None if r is None else (r, True)

    def _probe(self, fetch, name: str):
        """``(fetch(name + suffix), suffix)`` for the suffix ``name`` is stored under, or None if absent
        under all; a :class:`DataError` where it is found under two (as on ``file://``).

        The suffix of ``name``'s directory (once known, and unless the directory is mixed) is asked for
        first: found there, that is the answer (one request).  Otherwise every suffix is asked for, in
        :data:`SUFFIXES` order (the object fetched under the first found, the others' existence checked)."""
        if len(self.suffixes) == 1:
            got = fetch(name + self.suffixes[0])
            return None if got is None else (got, self.suffixes[0])
        folder = name.rpartition("/")[0]
        first = None if folder in self.mixed else self.dir_suffix.get(folder)
        if first is not None:
            got = fetch(name + first)
            if got is not None:
                return got, first
        found, others = None, []
        for s in self.suffixes:
            if s == first:
                continue
            if found is None:
                got = fetch(name + s)
                if got is not None:
                    found = (got, s)
            elif self._head(name + s) is not None:
                others.append(s)
        if found is None:
            return None
        if others:
            names = [name + s for s in (found[1], *others)]
            raise DataError(
                f"{self.where(name)} is stored as {names}: readers would pick one by probe order; leave exactly "
                "one on the server (re-run the task that writes it, or remove the stale copy)"
            )
        with self._state:
            known = self.dir_suffix.setdefault(folder, found[1])
            if known != found[1]:
                self.mixed.add(folder)
        return found

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
        got = self._probe(lambda key: self._request("GET", key, {"Accept-Encoding": "gzip"}), name)
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
        got = self._probe(self._head, name)
        return None if got is None else _length(*got[0])

    def version(self, name: str) -> str | None:
        """The object's ``ETag``, else its ``Last-Modified`` and length (the suffix it is stored under
        first), or None if absent (a HEAD; a server that refuses HEAD is asked for one byte instead)."""
        got = self._probe(self._head, name)
        if got is None:
            return None
        (r, ranged), suffix = got
        h = r.headers
        length = str(_length(r, ranged)) if ranged else h.get("Content-Length", "")
        return suffix + (h.get("ETag") or f"{h.get('Last-Modified', '')}|{length}")

    def put(self, name: str, data: bytes, **kw) -> bool:
        """Refused: an http(s) layer is read-only (:class:`ConfigError`)."""
        raise read_only_error("PUT", self._object_url(name))

    def delete(self, name: str) -> None:
        """Refused: an http(s) layer is read-only (:class:`ConfigError`)."""
        raise read_only_error("DELETE", self._object_url(name))

    def _object_url(self, name: str) -> LayerURL:
        return replace(self.url, path=f"{self.url.path}/{name}")


def _length(r, ranged: bool) -> int:
    """The object's length from :meth:`HttpObjects._head`'s answer: a HEAD's ``Content-Length``; a
    ranged GET's ``Content-Range`` total (416: empty; 200: the server ignored the range, the body is all)."""
    if not ranged:
        return int(r.headers["Content-Length"])
    if r.status == 416:
        return 0
    total = (r.headers.get("Content-Range") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else len(r.data)


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
