"""Layer URLs: parsing, endpoint aliases for S3-compatible servers, key validation.

Accepted: ``file:///abs/path``, ``gs://bucket/path``, ``s3://bucket/path``, and for reading only
``http://host/path`` and ``https://host/path`` (precomputed); ``zarr://`` (or ``zarr2://``,
``zarr3://``) + any of those, or any path or URL ending in ``.zarr`` (a zarr array, or an OME-Zarr
image: :mod:`.ome`).  docs/inputs.md lists the forms.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DataError

PROTOCOLS = ("file", "gs", "s3", "http", "https")
READ_ONLY = ("http", "https")  # znni reads these layers, never writes them


@dataclass(frozen=True)
class LayerURL:
    """A parsed layer URL: format (``precomputed`` or ``zarr``), protocol, path and optional S3 endpoint."""

    format: str  # precomputed | zarr
    protocol: str  # file | gs | s3 | http | https
    path: str  # file: absolute local path; cloud: bucket/path; http(s): host[:port]/path
    endpoint: str | None = None  # S3-compatible endpoint (http://host:port)

    @property
    def is_local(self) -> bool:
        """True for a ``file://`` layer."""
        return self.protocol == "file"

    @property
    def writable(self) -> bool:
        """False for an ``http(s)://`` layer: znni reads it, never writes it."""
        return self.protocol not in READ_ONLY

    @property
    def local_path(self) -> Path:
        """The layer's local directory; ValueError for a cloud layer."""
        if not self.is_local:
            raise ValueError(f"{self} is not a local layer")
        return Path(self.path)

    def child(self, key: str) -> LayerURL:
        """The layer (or array) at ``key`` under this one (an OME-Zarr image's dataset); ``key``
        must stay inside (:func:`check_key`)."""
        check_key(key, f"{self} child path")
        path = os.path.join(self.path, key) if self.is_local else f"{self.path}/{key}"
        return LayerURL(self.format, self.protocol, path.rstrip("/"), self.endpoint)

    def cloudpath(self) -> str:
        """The URL cloud-volume / cloudfiles understand (registers an alias for a custom endpoint)."""
        if self.protocol == "file":
            return "file://" + self.path
        if self.protocol == "s3" and self.endpoint:
            return f"{s3_alias(self.endpoint)}://{self.path}"
        return f"{self.protocol}://{self.path}"

    def __str__(self):
        base = f"{self.protocol}://{self.path}"
        return f"zarr://{base}" if self.format == "zarr" else base


def s3_alias(endpoint: str) -> str:
    """Register (once per process) a cloudfiles alias for an S3-compatible endpoint; return its name.

    ``CloudVolume("s3://http://host:port/...")`` is refused (docs/pitfalls.md); an alias works.
    """
    # lazy: loads cloudfiles only when called
    from cloudfiles import paths as cfpaths

    if not re.match(r"^https?://[^/]+/?$", endpoint):
        raise ConfigError(f"endpoint_url {endpoint!r} must look like http://host:port")
    name = "znnis3" + hashlib.sha1(endpoint.encode()).hexdigest()[:8]
    if name not in cfpaths.ALIASES:
        cfpaths.add_alias(name, "s3://" + endpoint.rstrip("/") + "/")
    return name


def parse_layer_url(url: str, *, endpoint: str | None = None, what: str = "layer") -> LayerURL:
    """Normalise a layer URL; refuses unknown protocols and relative ``file://`` paths."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{what} path must be a non-empty string, got {url!r}")
    s = url.strip()
    fmt = "precomputed"
    for prefix in ("precomputed://", "zarr://", "zarr3://", "zarr2://"):
        if s.startswith(prefix):
            fmt = "zarr" if prefix.startswith("zarr") else "precomputed"
            s = s[len(prefix) :]
    if "://" not in s:
        s = "file://" + os.path.abspath(s)
    proto, rest = s.split("://", 1)
    if proto not in PROTOCOLS:
        raise ConfigError(
            f"{what} {url!r}: protocol {proto!r} is not supported; use one of "
            f"{', '.join(p + '://' for p in PROTOCOLS)} (optionally prefixed by zarr://)"
        )
    if proto == "file":
        if not rest.startswith("/"):
            raise ConfigError(f"{what} {url!r}: file:// paths must be absolute (file:///abs/path)")
        rest = os.path.normpath(rest)
    elif proto in READ_ONLY:
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
        if "@" in authority:  # user[:password]@host: never sent, and the URL is printed and recorded
            raise ConfigError(
                f"{what} {proto}://{authority.rpartition('@')[2]}{rest[len(authority) :]}: credentials in URLs (user:password@host) are "
                "not supported (znni sends no credentials over http(s)); make the layer readable without them, or "
                "copy it to file://, s3:// or gs://"
            )
        if "?" in rest or "#" in rest:
            raise ConfigError(
                f"{what} {url!r}: a layer URL has no query or fragment (znni appends object names to it); "
                "give the layer's base URL"
            )
        if rest.startswith("/") or not rest.strip("/"):
            raise ConfigError(f"{what} {url!r}: needs a host, as in {proto}://host/path/to/layer")
        rest = rest.rstrip("/")
        if ".." in rest.split("/"):
            raise ConfigError(f"{what} {url!r}: the path must not contain '..'")
    else:
        rest = rest.strip("/")
        if not rest or ".." in rest.split("/"):
            raise ConfigError(f"{what} {url!r}: needs a bucket and a path without '..'")
    if rest.rstrip("/").endswith(".zarr"):
        fmt = "zarr"
    if endpoint and proto != "s3":
        raise ConfigError(f"{what} {url!r}: endpoint_url only applies to s3:// layers")
    return LayerURL(fmt, proto, rest, endpoint or None)


def read_only_error(what: str, url) -> ConfigError:
    """The error of a write to a layer (or an object of one) that znni cannot write: ``http(s)://``."""
    return ConfigError(
        f"{what} {url}: http(s):// layers are read-only (znni reads over HTTP, never writes); choose a "
        "file://, s3:// or gs:// layer"
    )


def check_key(key, what: str = "key") -> str:
    """A scale key or chunk path inside a layer: relative, no ``..``, no backslash (docs/reliability.md, T28c)."""
    if not isinstance(key, str) or not key:
        raise DataError(f"{what} {key!r} must be a non-empty string")
    if key.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", key) or "\\" in key or "\x00" in key:
        raise DataError(
            f"{what} {key!r} is absolute or has a backslash/NUL: it would write outside the layer; "
            "fix the layer's info file"
        )
    parts = key.split("/")
    if any(p in ("..", ".") for p in parts) or "://" in key:
        raise DataError(
            f"{what} {key!r} contains '..', '.' or a URL: it would escape the layer directory; "
            "fix the layer's info file"
        )
    if posixpath.normpath(key).startswith(".."):
        raise DataError(f"{what} {key!r} escapes the layer directory")
    return key
