"""znni's own object I/O for ``s3://`` layers: bounded retries of transient errors, none of permanent ones.

cloudfiles (under cloud-volume) wraps every ``S3Interface`` call in tenacity ``@retry`` (7 attempts,
random exponential backoff 0.5-60 s, on *every* exception) on top of boto3's own retries, and offers
no setting to change that: a permanent 403 was PUT 7 times over 20-60 s before the error surfaced
(docs/reliability.md, T7).  The objects znni writes and reads itself on ``s3://`` (output chunks, ``info``,
``provenance``) therefore go through one boto3 client per endpoint, bucket and credentials:

* botocore's ``standard`` retry mode, :data:`MAX_ATTEMPTS` attempts in all: HTTP 500/502/503/504,
  throttling (``SlowDown``), ``RequestTimeout`` and connection errors (reset, refused, timeouts) are
  retried with jittered exponential backoff (base 50 ms, 1 s when throttled, each wait capped at 20 s);
* every other answer (403 ``AccessDenied``, 404 ``NoSuchBucket``, 400 ``BadDigest``, ...) fails at the
  first response, as a :class:`~znni_core.errors.StorageError` naming the object and the fix;
* :data:`CONNECT_TIMEOUT` / :data:`READ_TIMEOUT` seconds per attempt.

Credentials are looked up as cloudfiles does (``<bucket>-<service>-secret.json`` then
``<service>-secret.json`` in the cloud-volume / cloudfiles secrets directories, where the service is
znni's endpoint alias or ``aws``), and otherwise from boto3's default chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, profiles, instance roles).  Secrets never appear in
messages.  Inputs are read through it too (chunk objects, or byte ranges of shards).  With no
credentials anywhere, reads go unsigned (a public bucket) and writes are refused; ``ZNNI_SIGN_REQUESTS``
overrides (:mod:`.auth`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import threading

from ..errors import DataError, StorageError, StoragePermissionError
from .auth import sign_mode, unsigned_refusal
from .paths import LayerURL, s3_alias
from .retry import attempts_from_env

MAX_ATTEMPTS = 5  # first try included; ZNNI_S3_MAX_ATTEMPTS overrides (1-20)
CONNECT_TIMEOUT = 10.0  # seconds, per attempt
READ_TIMEOUT = 60.0  # seconds without a byte, per attempt
ACL = "bucket-owner-full-control"  # what cloudfiles sets on its PUTs

_PERMISSION_CODES = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "AccountProblem",
    "InvalidSecurity",
}
_DIGEST_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"}
_MD5_ETAG = re.compile(r"^[0-9a-fA-F]{32}$")

_clients: dict = {}
_lock = threading.Lock()


def max_attempts() -> int:
    """Attempts per S3 request, first included: ``ZNNI_S3_MAX_ATTEMPTS`` or :data:`MAX_ATTEMPTS`."""
    return attempts_from_env("ZNNI_S3_MAX_ATTEMPTS", MAX_ATTEMPTS, "S3")


def _service(url: LayerURL) -> str:
    return s3_alias(url.endpoint) if url.endpoint else "aws"


def _secret_file(bucket: str, service: str) -> dict:
    """The first cloud-volume/cloudfiles secrets file that exists (cloudfiles' own lookup order), or {}."""
    # lazy: loads cloudfiles only when called
    from cloudfiles.secrets import secretpath

    for name in (f"{bucket}-{service}-secret.json", f"{service}-secret.json"):
        p = secretpath(name)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    d = json.load(f)
            except (OSError, ValueError) as exc:
                raise StoragePermissionError(
                    f"S3 credentials file {p} could not be read ({type(exc).__name__}); fix or remove it"
                ) from None
            if not isinstance(d, dict):
                raise StoragePermissionError(f"S3 credentials file {p} must hold a JSON object")
            return d
    return {}


class S3Objects:
    """Objects under one ``s3://bucket/prefix`` layer; keys are relative to the layer."""

    def __init__(self, url: LayerURL):
        if url.protocol != "s3":
            raise ValueError(f"{url} is not an s3:// layer")
        self.url = url
        self.bucket, _, self.prefix = url.path.partition("/")
        self.service = _service(url)
        self.attempts = max_attempts()
        self.client, self.unsigned = self._client()

    # ---- client --------------------------------------------------------------------------------
    def _client(self):
        """``(boto3 client, unsigned)``: one per process, endpoint, region and credentials; unsigned
        when ``ZNNI_SIGN_REQUESTS`` is ``never``, or ``auto`` and no credentials are found (:mod:`.auth`)."""
        mode = sign_mode()
        secrets = {} if mode == "never" else _secret_file(self.bucket, self.service)
        key_id = secrets.get("AWS_ACCESS_KEY_ID")
        secret = secrets.get("AWS_SECRET_ACCESS_KEY")
        token = secrets.get("AWS_SESSION_TOKEN")
        region = secrets.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # the cache key holds a digest of the credentials, never the secret itself
        fp = hashlib.sha256(repr((key_id, secret, token)).encode()).hexdigest()
        env = tuple(
            os.environ.get(k)
            for k in (
                "AWS_ACCESS_KEY_ID",
                "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN",
                "AWS_PROFILE",
                "AWS_ENDPOINT_URL",
                "AWS_ENDPOINT_URL_S3",
                "AWS_SHARED_CREDENTIALS_FILE",
                "AWS_CONFIG_FILE",
            )
        )
        env_fp = hashlib.sha256(repr(env).encode()).hexdigest()
        ck = (os.getpid(), self.url.endpoint, region, fp, env_fp, self.attempts, mode)
        with _lock:
            c = _clients.get(ck)
            if c is None:
                # lazy: loads boto3 only when called
                import boto3
                from botocore import UNSIGNED
                from botocore.config import Config

                # a fresh session per client: boto3's default session is not thread-safe
                session = boto3.session.Session()
                unsigned = mode == "never" or (mode == "auto" and not key_id and session.get_credentials() is None)

                cfg = {
                    "retries": {"mode": "standard", "total_max_attempts": self.attempts},  # first try included
                    "connect_timeout": CONNECT_TIMEOUT,
                    "read_timeout": READ_TIMEOUT,
                }
                if unsigned:
                    cfg["signature_version"] = UNSIGNED
                if self.url.endpoint:
                    # S3-compatible servers often lack the trailing-checksum (aws-chunked) uploads that
                    # botocore sends by default; cloudfiles makes the same choice.  Content-MD5 is sent instead.
                    cfg.update(
                        request_checksum_calculation="when_required", response_checksum_validation="when_required"
                    )
                client = session.client(
                    "s3",
                    endpoint_url=self.url.endpoint or None,
                    region_name=region,
                    aws_access_key_id=key_id,
                    aws_secret_access_key=secret,
                    aws_session_token=token,
                    config=Config(**cfg),
                )
                c = _clients[ck] = (client, unsigned)
        return c

    def key(self, name: str) -> str:
        """The bucket key of object ``name`` (relative to the layer)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def where(self, name: str) -> str:
        """``s3://bucket/key`` of object ``name`` (plus the endpoint, if any), for messages."""
        at = f" (endpoint {self.url.endpoint})" if self.url.endpoint else ""
        return f"s3://{self.bucket}/{self.key(name)}{at}"

    # ---- errors --------------------------------------------------------------------------------
    def _error(self, exc: Exception, op: str, name: str) -> Exception:
        """A znni error for a failed request: what, where, why, how many attempts, the fix."""
        # lazy: loads botocore only when called
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

        where = self.where(name)
        action = {
            "PUT": "s3:PutObject",
            "GET": "s3:GetObject",
            "HEAD": "s3:GetObject (and s3:ListBucket)",
            "DELETE": "s3:DeleteObject",
            "LIST": "s3:ListBucket",
        }[op]
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoragePermissionError(
                f"{op} {where}: no usable S3 credentials ({type(exc).__name__}); set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, or write {self.service}-secret.json in the cloud-volume secrets directory"
                + (
                    " (or unset ZNNI_SIGN_REQUESTS=always to read public buckets unsigned)"
                    if sign_mode() == "always"
                    else ""
                )
            )
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            meta = exc.response.get("ResponseMetadata", {})
            code = str(err.get("Code") or "")
            status = int(meta.get("HTTPStatusCode") or (code if code.isdigit() else 0))
            tries = int(meta.get("RetryAttempts") or 0) + 1
            msg = err.get("Message") or ""
            what = f"HTTP {status} {code}" + (f": {msg}" if msg and msg != code else "")
            if (status == 403 or code in _PERMISSION_CODES) and self.unsigned:
                return StoragePermissionError(
                    f"{op} {where} was refused: {what}. The request was unsigned (anonymous: "
                    + ("ZNNI_SIGN_REQUESTS=never" if sign_mode() == "never" else "no S3 credentials were found")
                    + "), so the bucket is not public, or the key is simply absent (S3 answers 403, not 404, for an "
                    "absent key to a reader that may not list the bucket); set AWS_ACCESS_KEY_ID and "
                    f"AWS_SECRET_ACCESS_KEY (or a profile, or {self.service}-secret.json in the cloud-volume secrets "
                    f"directory) that allow {action}, then re-run. Not retried (permanent)."
                )
            if status == 403 or code in _PERMISSION_CODES:
                return StoragePermissionError(
                    f"{op} {where} was refused: {what}. This is permanent and was not retried "
                    f"({tries} request). Check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or "
                    f"{self.service}-secret.json in the cloud-volume secrets directory) and the bucket policy: "
                    f"they must allow {action} on this key; then re-run the task."
                )
            if code in _DIGEST_CODES:
                return DataError(
                    f"{op} {where}: the server's md5/checksum of the uploaded body did not match ({what}): the "
                    "chunk was corrupted in transit and not stored; re-run its task"
                )
            if code == "NoSuchBucket":
                return StorageError(f"{op} {where}: {what}; check the bucket name in the path and endpoint_url")
            if status >= 500 or status == 429 or code in ("SlowDown", "RequestTimeout", "Throttling"):
                return StorageError(
                    f"{op} {where}: still failing after {tries} attempts with bounded backoff ({what}); the "
                    "server is unavailable or throttling: re-run the task later"
                )
            return StorageError(
                f"{op} {where} was refused: {what}; not retried (a client error); check the path, "
                "endpoint_url and the bucket's configuration"
            )
        if isinstance(exc, BotoCoreError):
            return StorageError(
                f"{op} {where}: {type(exc).__name__}: {exc} (after up to {self.attempts} attempts with bounded "
                "backoff); check that the endpoint is reachable, then re-run the task"
            )
        return StorageError(f"{op} {where}: {type(exc).__name__}: {exc}")

    def _call(self, op: str, name: str, fn, **kw):
        # lazy: loads botocore only when called
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, Key=self.key(name), **kw)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, op, name) from exc

    # ---- objects ---------------------------------------------------------------------------------
    def put(
        self,
        name: str,
        data: bytes,
        *,
        content_type: str,
        content_encoding: str | None = None,
        exclusive: bool = False,
    ) -> bool:
        """One PUT of the whole object (``Cache-Control: no-cache``), with Content-MD5 so the server
        rejects a body corrupted in transit.  ``exclusive``: a conditional PUT (``If-None-Match: *``):
        of simultaneous creators exactly one stores it, the others get False (a server without
        conditional writes ignores the header, and the last writer wins)."""
        # lazy: loads botocore only when called
        from botocore.exceptions import ClientError

        if self.unsigned:
            raise self._refusal("PUT", name)
        kw = {
            "Body": data,
            "ContentType": content_type,
            "ACL": ACL,
            "ContentMD5": base64.b64encode(hashlib.md5(data).digest()).decode(),
        }
        if content_encoding:
            kw["ContentEncoding"] = content_encoding
        kw["CacheControl"] = "no-cache"
        if exclusive:
            kw["IfNoneMatch"] = "*"
        try:
            self._call("PUT", name, self.client.put_object, **kw)
        except StorageError as exc:
            cause = exc.__cause__
            code = cause.response.get("Error", {}).get("Code") if isinstance(cause, ClientError) else None
            if exclusive and code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False  # someone else created it first (or is creating it now)
            raise
        return True

    def get(self, name: str, byte_range: tuple[int, int] | None = None) -> tuple[bytes, str] | None:
        """``(body, content_encoding)`` or None if the object does not exist; ``byte_range``
        ``(start, end)``: only those bytes (end exclusive, one ranged GET).

        A whole body whose md5 differs from a single-part ETag raises :class:`DataError`
        (docs/reliability.md, T8); a range past the object's end is a :class:`DataError` too.
        """
        # lazy: loads botocore only when called
        from botocore.exceptions import BotoCoreError, ClientError

        kw = {} if byte_range is None else {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"}
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(name), **kw)
            body = r["Body"].read()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("NoSuchKey", "404"):
                return None
            if code == "InvalidRange":
                raise DataError(f"GET {self.where(name)}: bytes {byte_range} lie past the object's end") from None
            raise self._error(exc, "GET", name) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "GET", name) from exc
        etag = (r.get("ETag") or "").strip('"')
        if byte_range is None and _MD5_ETAG.match(etag) and r.get("ServerSideEncryption") != "aws:kms":
            got = hashlib.md5(body).hexdigest()
            if got != etag.lower():
                raise DataError(
                    f"GET {self.where(name)}: the body's md5 {got} != the server's ETag {etag} "
                    "(corrupted in transit); retry, or re-run the task that wrote it"
                )
        enc = ",".join(
            e.strip() for e in (r.get("ContentEncoding") or "").split(",") if e.strip() and e.strip() != "aws-chunked"
        )
        return body, enc

    def _head(self, name: str) -> dict | None:
        """The object's HEAD response, or None if it does not exist."""
        # lazy: loads botocore only when called
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error(exc, "HEAD", name) from exc
        except BotoCoreError as exc:
            raise self._error(exc, "HEAD", name) from exc

    def size(self, name: str) -> int | None:
        """Bytes of the object, or None if it does not exist."""
        r = self._head(name)
        return None if r is None else int(r.get("ContentLength") or 0)

    def stat(self, name: str) -> tuple[int, float] | None:
        """``(bytes, last-modified as POSIX seconds)`` of the object, or None if it does not exist."""
        r = self._head(name)
        return None if r is None else (int(r.get("ContentLength") or 0), r["LastModified"].timestamp())

    def list(self, prefix: str = "", *, delimiter: str = "", limit: int | None = None) -> tuple[list, list]:
        """``([(name, bytes, last-modified)], [sub-prefixes])`` of the objects whose names start
        with ``prefix`` (``delimiter="/"``: one level; the levels below as sub-prefixes), names
        relative to the layer, in key order (one LIST request per 1000 keys; ``limit``: at most that many)."""
        # lazy: loads botocore only when called
        from botocore.exceptions import BotoCoreError, ClientError

        base = self.key("")
        objects, prefixes = [], []
        kw = {"Bucket": self.bucket, "Prefix": base + prefix} | ({"Delimiter": delimiter} if delimiter else {})
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(**kw, PaginationConfig={"MaxItems": limit})
            for page in pages:
                objects += [
                    (o["Key"][len(base) :], int(o["Size"]), o["LastModified"].timestamp())
                    for o in page.get("Contents", ())
                ]
                prefixes += [p["Prefix"][len(base) :] for p in page.get("CommonPrefixes", ())]
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, "LIST", prefix) from exc
        return objects, prefixes

    def version(self, name: str) -> str | None:
        """The object's ETag (with its VersionId on a versioned bucket), or None if it does not exist."""
        r = self._head(name)
        if r is None:
            return None
        etag = (r.get("ETag") or "").strip('"')
        return etag + (f"@{r['VersionId']}" if r.get("VersionId") not in (None, "null") else "")

    def delete(self, name: str) -> None:
        """DELETE object ``name``; a failed request raises a :class:`~znni_core.errors.StorageError`."""
        if self.unsigned:
            raise self._refusal("DELETE", name)
        self._call("DELETE", name, self.client.delete_object)

    def _refusal(self, op: str, name: str) -> StoragePermissionError:
        """A write through an unsigned client: refused before any request (:mod:`.auth`)."""
        return unsigned_refusal(
            op,
            self.where(name),
            f"set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, or {self.service}-secret.json in the "
            "cloud-volume secrets directory)",
        )
