"""znni's own object I/O for ``gs://`` layers: bounded retries of transient errors, none of permanent ones.

cloudfiles (under cloud-volume) retries every Google Cloud Storage call 7 times over up to a
minute, whatever the error. The objects znni writes and reads itself on ``gs://`` (output chunks
and shards, ``info``, ``provenance``, raw input chunks) go through the ``google-cloud-storage``
client with the library's own retries off and this module's instead:

* HTTP 408, 429, 500, 502, 503, 504 and connection errors (reset, refused, timeouts) are retried,
  :data:`MAX_ATTEMPTS` attempts in all (``ZNNI_GCS_MAX_ATTEMPTS``, 1-20), waiting a jittered
  exponential backoff (base :data:`BACKOFF_S`, each wait at most :data:`MAX_WAIT_S`);
* 401 and 403 fail at the first answer as a :class:`~znni_core.errors.StoragePermissionError`,
  every other client error (400, 404 on a bucket, ...) as a :class:`~znni_core.errors.StorageError`
  naming the object and the fix; an absent object reads as None;
* an exclusive write is one conditional upload (``ifGenerationMatch=0``): of simultaneous
  creators exactly one wins, the others see HTTP 412.

Credentials are looked up as cloudfiles does (``google-secret.json`` in the cloud-volume /
cloudfiles secrets directory: a service account), else Google's default chain; with
``STORAGE_EMULATOR_HOST`` set (a local emulator) anonymous credentials are used.  With no
credentials anywhere (and ``GOOGLE_APPLICATION_CREDENTIALS`` unset), reads go through an anonymous
client (a public bucket) and writes are refused; ``ZNNI_SIGN_REQUESTS`` overrides (:mod:`.auth`).
"""

from __future__ import annotations

import json
import os
import threading
import time

from ..errors import DataError, StorageError, StoragePermissionError
from .auth import sign_mode, unsigned_refusal
from .paths import LayerURL
from .retry import attempts_from_env, jittered_backoff

MAX_ATTEMPTS = 5  # first try included
BACKOFF_S = 0.1  # first wait; doubles per attempt, jittered (full jitter)
MAX_WAIT_S = 20.0
TIMEOUT_S = (10.0, 60.0)  # connect, read: per attempt
RETRIED = {408, 429, 500, 502, 503, 504}

_clients: dict = {}  # the emulator's URL, or ("", sign mode) -> client
_unsigned: set = set()  # keys of _clients whose client is anonymous outside an emulator (writes refused)
_lock = threading.Lock()
#: the waits between attempts go through this (tests count and bound them)
sleep = time.sleep


def max_attempts() -> int:
    """Attempts per request, first included: ``ZNNI_GCS_MAX_ATTEMPTS`` or :data:`MAX_ATTEMPTS`."""
    return attempts_from_env("ZNNI_GCS_MAX_ATTEMPTS", MAX_ATTEMPTS, "GCS")


def _key():
    """Which client serves now: the emulator's URL, or ``("", sign mode, GOOGLE_APPLICATION_CREDENTIALS)``."""
    return os.environ.get("STORAGE_EMULATOR_HOST", "") or (
        "",
        sign_mode(),
        os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", ""),
    )


def _client():
    """One ``google.cloud.storage.Client`` per process (credentials as cloudfiles finds them; none
    found: an anonymous client, whose key :data:`_unsigned` holds, :mod:`.auth`)."""
    with _lock:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        mode = sign_mode()
        key = _key()
        if key in _clients:
            return _clients[key]
        # lazy: loads google.cloud only when called
        from google.cloud import storage

        if emulator:
            # lazy: loads google.auth only when called
            from google.auth.credentials import AnonymousCredentials

            client = storage.Client(credentials=AnonymousCredentials(), project="znni")
        elif mode == "never":
            client = storage.Client.create_anonymous_client()
            _unsigned.add(key)
        else:
            # lazy: loads cloudfiles only when called
            from cloudfiles.secrets import secretpath

            path = secretpath("google-secret.json")
            if os.path.exists(path):
                # lazy: loads google.oauth2 only when called
                from google.oauth2 import service_account

                try:
                    with open(path) as f:
                        info = json.load(f)
                    creds = service_account.Credentials.from_service_account_info(info)
                except (OSError, ValueError, KeyError) as exc:
                    raise StoragePermissionError(
                        f"GCS credentials file {path} could not be used ({type(exc).__name__}); fix or remove it"
                    ) from None
                client = storage.Client(credentials=creds, project=info.get("project_id"))
            else:
                try:
                    client = storage.Client()
                except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and kin
                    # GOOGLE_APPLICATION_CREDENTIALS set but unusable is a mistake, never "anonymous"
                    if mode == "always" or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
                        raise StoragePermissionError(
                            f"no usable Google Cloud credentials ({type(exc).__name__}); write google-secret.json "
                            "(a service account key) in the cloud-volume secrets directory, or run "
                            "`gcloud auth application-default login`"
                            + (
                                ", or fix GOOGLE_APPLICATION_CREDENTIALS"
                                if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                                else " (or unset ZNNI_SIGN_REQUESTS=always to read public buckets anonymously)"
                            )
                        ) from None
                    client = storage.Client.create_anonymous_client()
                    _unsigned.add(key)
        _clients[key] = client
        return client


class GcsObjects:
    """Objects under one ``gs://bucket/prefix`` layer; names are relative to the layer."""

    def __init__(self, url: LayerURL):
        if url.protocol != "gs":
            raise ValueError(f"{url} is not a gs:// layer")
        self.url = url
        self.bucket_name, _, self.prefix = url.path.partition("/")
        self.attempts = max_attempts()
        self.bucket = _client().bucket(self.bucket_name)
        self.unsigned = _key() in _unsigned

    def key(self, name: str) -> str:
        """The object key of ``name``."""
        return f"{self.prefix.rstrip('/')}/{name}" if self.prefix else name

    def where(self, name: str) -> str:
        """``gs://bucket/key`` of ``name``."""
        return f"gs://{self.bucket_name}/{self.key(name)}"

    def _call(self, op: str, name: str, fn):
        """``fn()`` with bounded retries of transient failures; a znni error for the others."""
        # lazy: loads google.api_core only when called
        from google.api_core import exceptions as E

        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except E.GoogleAPICallError as exc:
                status = int(getattr(exc, "code", 0) or 0)
                if status in (401, 403) and self.unsigned:
                    raise StoragePermissionError(
                        f"{op} {self.where(name)} was refused: HTTP {status} ({exc.message}). The request was "
                        "anonymous ("
                        + (
                            "ZNNI_SIGN_REQUESTS=never"
                            if sign_mode() == "never"
                            else "no Google Cloud credentials were found"
                        )
                        + "), so the bucket is not public; write google-secret.json (a "
                        "service account key) in the cloud-volume secrets directory or run `gcloud auth "
                        "application-default login`, then re-run. Not retried (permanent)."
                    ) from None
                if status in (401, 403):
                    raise StoragePermissionError(
                        f"{op} {self.where(name)} was refused: HTTP {status} ({exc.message}). This is permanent "
                        "and was not retried (1 request). Check the service account (google-secret.json in the "
                        "cloud-volume secrets directory) and the bucket's IAM: it must allow this request; "
                        "then re-run the task."
                    ) from None
                if status not in RETRIED:
                    raise StorageError(
                        f"{op} {self.where(name)} was refused: HTTP {status} ({exc.message}); not retried (a client "
                        "error): check the bucket name and path"
                    ) from None
                why = f"HTTP {status}"
            except (ConnectionError, TimeoutError, OSError) as exc:
                why = f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # requests' and urllib3's connection errors
                if type(exc).__module__.split(".")[0] not in ("requests", "urllib3", "google"):
                    raise
                # lazy: loads google.auth only when called
                from google.auth import exceptions as A

                # a 401 the credentials cannot recover from (google-auth refreshes them and asks
                # again first): anonymous ones cannot refresh, a revoked key is refused; permanent
                if isinstance(exc, A.GoogleAuthError) and not (
                    isinstance(exc, A.TransportError) or getattr(exc, "retryable", False)
                ):
                    raise StoragePermissionError(
                        f"{op} {self.where(name)} was refused: the credentials were not accepted "
                        f"({type(exc).__name__}: {exc}). This is permanent and was not retried. Check the service "
                        "account (google-secret.json in the cloud-volume secrets directory); then re-run the task."
                    ) from None
                why = f"{type(exc).__name__}: {exc}"
            if attempt >= self.attempts:
                raise StorageError(
                    f"{op} {self.where(name)}: still failing after {attempt} attempts with bounded backoff ({why}); "
                    "the service is unavailable or throttling: re-run the task later"
                )
            sleep(jittered_backoff(attempt, BACKOFF_S, MAX_WAIT_S))

    # ---- objects ---------------------------------------------------------------------------------
    def put(
        self, name: str, data: bytes, *, content_type: str, content_encoding: str | None = None, exclusive: bool = False
    ) -> bool:
        """Upload ``data`` whole (``exclusive``: only if absent; returns whether it was written)."""
        # lazy: loads google.api_core only when called
        from google.api_core import exceptions as E

        if self.unsigned:
            raise self._refusal("PUT", name)

        def upload():
            blob = self.bucket.blob(self.key(name))
            blob.cache_control = "no-cache"
            if content_encoding:
                blob.content_encoding = content_encoding
            kw = {"if_generation_match": 0} if exclusive else {}
            try:
                blob.upload_from_string(data, content_type=content_type, retry=None, timeout=TIMEOUT_S, **kw)
            except E.PreconditionFailed:
                return False
            return True

        return self._call("PUT", name, upload)

    def get(self, name: str, byte_range: tuple[int, int] | None = None) -> tuple[bytes, str] | None:
        """``(bytes as stored, Content-Encoding)``, or None if absent; ``byte_range`` ``(start,
        end)``: only those bytes (end exclusive)."""
        # lazy: loads google.api_core only when called
        from google.api_core import exceptions as E

        span = {} if byte_range is None else {"start": byte_range[0], "end": byte_range[1] - 1}

        def download():
            blob = self.bucket.blob(self.key(name))
            try:
                data = blob.download_as_bytes(raw_download=True, retry=None, timeout=TIMEOUT_S, **span)
            except E.NotFound:
                return None
            except E.RequestRangeNotSatisfiable:
                raise DataError(f"GET {self.where(name)}: bytes {byte_range} lie past the object's end") from None
            return data, (blob.content_encoding or "")

        return self._call("GET", name, download)

    def size(self, name: str) -> int | None:
        """Bytes stored under ``name``, or None if absent."""

        def head():
            blob = self.bucket.get_blob(self.key(name), retry=None, timeout=TIMEOUT_S)
            return None if blob is None else int(blob.size or 0)

        return self._call("HEAD", name, head)

    def stat(self, name: str) -> tuple[int, float] | None:
        """``(bytes, last-modified as POSIX seconds)`` of ``name``, or None if absent."""

        def head():
            blob = self.bucket.get_blob(self.key(name), retry=None, timeout=TIMEOUT_S)
            return None if blob is None else (int(blob.size or 0), blob.updated.timestamp())

        return self._call("HEAD", name, head)

    def list(self, prefix: str = "", *, delimiter: str = "", limit: int | None = None) -> tuple[list, list]:
        """``([(name, bytes, last-modified)], [sub-prefixes])`` of the objects whose names start
        with ``prefix`` (``delimiter="/"``: one level; ``limit``: at most that many), names
        relative to the layer."""
        base = self.key("")

        def listing():
            it = self.bucket.client.list_blobs(
                self.bucket,
                prefix=base + prefix,
                delimiter=delimiter or None,
                max_results=limit,
                retry=None,
                timeout=TIMEOUT_S,
            )
            objects = [(b.name[len(base) :], int(b.size or 0), b.updated.timestamp()) for b in it]
            return objects, sorted(p[len(base) :] for p in it.prefixes)

        return self._call("LIST", prefix, listing)

    def version(self, name: str) -> str | None:
        """The object's generation, or None if absent."""

        def head():
            blob = self.bucket.get_blob(self.key(name), retry=None, timeout=TIMEOUT_S)
            return None if blob is None else str(blob.generation)

        return self._call("HEAD", name, head)

    def delete(self, name: str) -> None:
        """Delete ``name``; absent is fine."""
        # lazy: loads google.api_core only when called
        from google.api_core import exceptions as E

        if self.unsigned:
            raise self._refusal("DELETE", name)

        def remove():
            try:
                self.bucket.blob(self.key(name)).delete(retry=None, timeout=TIMEOUT_S)
            except E.NotFound:
                pass

        self._call("DELETE", name, remove)

    def _refusal(self, op: str, name: str) -> StoragePermissionError:
        """A write through an anonymous client: refused before any request (:mod:`.auth`)."""
        return unsigned_refusal(
            op,
            self.where(name),
            "write google-secret.json (a service account key) in the cloud-volume secrets directory or run "
            "`gcloud auth application-default login`",
        )
