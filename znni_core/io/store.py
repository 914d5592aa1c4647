"""Object storage under a layer: one interface for ``file://``, ``s3://``, ``gs://`` and ``http(s)://``.

Every read and write of a layer's objects (info, chunks, shards, zarr metadata) goes through an
:class:`ObjectStore` made by :func:`object_store`:

- :class:`LocalStore` writes atomically (temporary name, fsync, rename: :mod:`.atomic`) and
  keeps a chunk's gzip encoding as a ``.gz`` suffix, as cloud-volume does on ``file://``;
- :class:`S3Store` talks to S3 (or any S3 endpoint) through :class:`~.s3.S3Objects`: one PUT
  per object with Content-MD5, gzip as ``Content-Encoding``;
- :class:`GcsStore` talks to Google Cloud Storage through :class:`~.gcs.GcsObjects`: one upload
  per object (conditional for exclusive writes), gzip as ``Content-Encoding``;
- :class:`HttpStore` reads ``http://`` and ``https://`` layers through :class:`~.http.HttpObjects`
  (read-only: a write is a :class:`~znni_core.errors.ConfigError`).

The remote stores retry transient failures a bounded number of times with jittered backoff and
fail a permanent refusal (403) at its first answer.

``get`` returns the decoded bytes (a gzip encoding undone) or None when the object is absent
(only "not found" is absent); an object that is present but cannot be read (an I/O or
permission error, a refusal) raises :class:`~znni_core.errors.StorageError` naming it, one that
does not decode a :class:`~znni_core.errors.DataError`.  On ``file://`` a directory, FIFO or other
non-file in an object's place is a :class:`~znni_core.errors.DataError` naming it, never "absent"
(so never a missing chunk that ``input.missing: zero`` would fill).

>>> from znni_core.io.paths import parse_layer_url
>>> import tempfile
>>> store = object_store(parse_layer_url("file://" + tempfile.mkdtemp(), what="doctest"))
>>> store.put("a/b", b"bytes", compress="gzip")
True
>>> store.get("a/b"), store.get("absent")
(b'bytes', None)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property

from ..errors import DataError, StorageError
from .atomic import TMP_DIR, atomic_write, clean_stale_temporaries, release_tmp_dir
from .encodings import ALL_SUFFIXES, ENCODINGS
from .gcs import GcsObjects
from .http import HttpObjects
from .paths import LayerURL
from .s3 import S3Objects

COMPRESSIONS = ("none", "gzip")
SUFFIXES = {"none": "", "gzip": ".gz"}


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``: the digest manifests record for a written chunk or shard."""
    return hashlib.sha256(data).hexdigest()


def _gunzip(data: bytes, where: str) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as exc:
        raise DataError(f"{where} is stored with gzip encoding but is not valid gzip: {exc}") from exc


def _decompress(data: bytes, encoding: str, where: str) -> bytes:
    """``data`` stored with ``encoding`` (gzip, br, zstd, xz, bz2: what cloud-volume writes), decoded."""
    if encoding == "gzip":
        return _gunzip(data, where)
    # lazy: loads cloudfiles only when called
    from cloudfiles.compression import decompress

    try:
        return decompress(data, encoding, where)
    except Exception as exc:  # each codec raises its own error type
        raise DataError(f"{where} is stored with {encoding} encoding but does not decode: {exc}") from exc


def local_size(path, where: str) -> int | None:
    """Bytes of the regular file at ``path``, or None when nothing is there (``ENOENT``).  Anything
    else is an error naming ``where``: a directory, FIFO or other non-file in its place (a
    :class:`DataError`; a FIFO is never opened: it would block), a parent that is not a directory,
    a permission or I/O error (a :class:`StorageError`); "missing" means only "not found"."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(
            f"{where}: cannot be looked up ({exc.strerror or exc}); it is not missing but unreadable: "
            "fix the storage (permissions, mounts, disk) and re-run"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise DataError(
            f"{where} is {what}: it is not missing but damaged; remove what is in its place and "
            "restore the object, or re-run the task that writes it"
        )
    return st.st_size


def _read_local(path, where: str, start: int = 0, size: int | None = None) -> bytes | None:
    """The bytes of a local file (``size`` of them from ``start``), None if it vanished since it
    was found (a concurrent delete); other OS errors are a :class:`StorageError` naming ``where``."""
    try:
        with open(path, "rb") as f:
            if start:
                f.seek(start)
            return f.read() if size is None else f.read(size)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError(
            f"{where}: read failed ({exc.strerror or exc}); it is not missing but unreadable: "
            "fix the storage (permissions, mounts, disk) and re-run"
        ) from None


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=6, mtime=0)


class ObjectStore:
    """Whole objects under one layer URL; see the module's docstring.  Subclasses implement
    ``_get``, ``_put``, ``exists``, ``sizes`` and ``delete``."""

    def __init__(self, url: LayerURL):
        self.url = url

    def where(self, name: str) -> str:
        """``name`` as a user finds it: ``<layer url>/<name>``."""
        return f"{self.url}/{name}"

    def get(self, name: str) -> bytes | None:
        """The object's decoded bytes, or None if absent."""
        raise NotImplementedError

    def get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of an object stored unencoded (a shard), or None if absent;
        a range past its end is a :class:`DataError`."""
        raise NotImplementedError

    def put(
        self,
        name: str,
        data: bytes,
        *,
        compress: str = "none",
        content_type: str = "application/octet-stream",
        exclusive: bool = False,
    ) -> bool:
        """Store ``name`` whole (``compress="gzip"``: gzip-encoded); with ``exclusive`` only if
        absent.  Returns False when ``exclusive`` found it present."""
        if compress not in COMPRESSIONS:
            raise DataError(f"compression {compress!r} is not one of {COMPRESSIONS}")
        return self._put(name, data, compress, content_type, exclusive)

    def _put(self, name, data, compress, content_type, exclusive) -> bool:
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        """Whether ``name`` is stored (any encoding)."""
        raise NotImplementedError

    def sizes(self, names: list[str]) -> dict:
        """``{name: bytes stored, or None if absent}``."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove ``name`` in every encoding; absent is fine."""
        raise NotImplementedError

    def versions(self, names: list[str]) -> dict:
        """``{name: version, or None if absent}``: what identifies the stored bytes of each object
        now (``file://``: size and modification time in ns; ``s3://``: the ETag; ``gs://``: the
        generation).  A task records them before it reads its input, so a later change of an
        object in place (same name, new bytes) shows as another version."""
        raise NotImplementedError

    def get_json(self, name: str):
        """A small JSON object, or None if absent; invalid JSON is a :class:`DataError`."""
        data = self.get(name)
        if data is None:
            return None
        try:
            return json.loads(data)
        except json.JSONDecodeError as exc:
            raise DataError(f"{self.where(name)} is not valid JSON: {exc}") from exc

    def put_json(self, name: str, obj, *, exclusive: bool = False) -> bool:
        """Write ``obj`` as indented JSON (``exclusive``: only if absent; returns whether written)."""
        data = json.dumps(obj, indent=2, sort_keys=True).encode()
        return self.put(name, data, content_type="application/json", exclusive=exclusive)

    def verify(self, name: str, digest: str) -> None:
        """Read ``name`` back and compare its sha256 with ``digest``; a :class:`DataError` naming
        the object when it is absent or differs (a torn or corrupted write)."""
        data = self.get(name)
        if data is None:
            raise DataError(
                f"{self.where(name)} is missing after its write (expected sha256 {digest[:12]}); re-run its task"
            )
        got = sha256(data)
        if got != digest:
            raise DataError(
                f"{self.where(name)}: read-back sha256 {got[:12]} != written {digest[:12]} "
                "(torn or corrupted write); re-run its task"
            )


class LocalStore(ObjectStore):
    """``file://``: atomic writes; gzip as a ``.gz`` suffix; exactly one encoding per object."""

    @property
    def root(self):
        """The layer's directory."""
        return self.url.local_path

    def _stored(self, name: str) -> dict:
        """``{suffix: bytes on disk}`` of the files stored for ``name`` (each a regular file; any
        other thing in an object's place, or a failing lookup, is a :class:`DataError`)."""
        base = os.path.join(self.root, name)
        found = {}
        for s in ALL_SUFFIXES:
            size = local_size(base + s, self.where(name + s))
            if size is not None:
                found[s] = size
        return found

    def _found(self, name: str) -> list[str]:
        return list(self._stored(name))

    def get(self, name: str) -> bytes | None:
        """The object's bytes (a ``.gz`` file gunzipped), or None if absent.

        A :class:`DataError` if it is stored in more than one encoding, or in one other than raw and gzip.
        """
        found = self._found(name)
        if not found:
            return None
        if len(found) > 1:
            raise DataError(
                f"{self.where(name)} is stored as {[name + s for s in found]}: readers would pick one "
                "by probe order; re-run its task to leave exactly one"
            )
        data = _read_local(self.root / (name + found[0]), self.where(name + found[0]))
        if data is None or not found[0]:
            return data
        return _decompress(data, ENCODINGS[found[0]], self.where(name + found[0]))

    def get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the file ``name`` (read by seeking), or None if absent."""
        found = self._stored(name)
        if not found:
            return None
        if list(found) == [""]:
            if end > found[""]:  # before reading: a corrupt index may ask for terabytes
                data = b""
            else:
                data = _read_local(self.root / name, self.where(name), start, end - start)
                if data is None:
                    return None
        else:  # an encoded file has no byte ranges of its own
            data = self.get(name)
            if data is None:
                return None
            data = data[start:end]
        if len(data) != end - start:
            raise DataError(
                f"{self.where(name)}: bytes [{start}, {end}) lie past its end: it is truncated or its index is "
                "corrupt; repair or rewrite it"
            )
        return data

    def _put(self, name, data, compress, content_type, exclusive) -> bool:
        path = self.root / (name + SUFFIXES[compress])
        try:
            written = atomic_write(
                path, _gzip(data) if compress == "gzip" else data, exclusive=exclusive, tmp_dir=path.parent / TMP_DIR
            )
        except OSError as exc:  # disk full, quota, I/O error: the previous version stays intact
            raise DataError(
                f"{self.where(name)}: write failed ({exc.strerror or exc}); the previous version, if "
                "any, is intact; free space or fix the storage and re-run its task"
            ) from exc
        if written:
            for s in ALL_SUFFIXES:
                if s != SUFFIXES[compress]:
                    (self.root / (name + s)).unlink(missing_ok=True)
            clean_stale_temporaries(path.parent / TMP_DIR, os.path.basename(name))
            release_tmp_dir(path.parent / TMP_DIR)
        return written

    def exists(self, name: str) -> bool:
        """Whether ``name`` is stored under any suffix."""
        return bool(self._found(name))

    def sizes(self, names: list[str]) -> dict:
        """``{name: bytes on disk, or None if absent}`` (the largest file where several encodings exist)."""
        out = {}
        for n in names:
            sizes = list(self._stored(n).values())
            out[n] = max(sizes) if sizes else None
        return out

    def versions(self, names: list[str]) -> dict:
        """``{name: "<bytes>-<mtime ns>" of its file (``+``-joined where several encodings exist), or None}``
        (one ``stat`` each).  A path that exists but is no file is a :class:`DataError`."""
        out = {}
        for n in names:
            try:
                st = [os.stat(self.root / (n + s)) for s in self._found(n)]
            except OSError as exc:  # removed between the probe and the stat, or unreadable
                raise DataError(f"{self.where(n)} cannot be examined ({exc.strerror or exc})") from exc
            out[n] = "+".join(f"{s.st_size}-{s.st_mtime_ns}" for s in st) or None
        return out

    def delete(self, name: str) -> None:
        """Remove ``name`` under every suffix; absent is fine."""
        for s in ALL_SUFFIXES:
            (self.root / (name + s)).unlink(missing_ok=True)


def _decoded(data: bytes, encoding: str, where: str) -> bytes:
    """A remote object's bytes with its Content-Encoding (none, gzip, br, zstd, xz, bz2) undone; a
    list (``gzip, br``: in the order applied) is undone last to first."""
    if "," in encoding:
        for e in reversed([e.strip() for e in encoding.split(",") if e.strip()]):
            data = _decoded(data, e, where)
        return data
    encoding = "gzip" if encoding == "x-gzip" else encoding
    if encoding in ("", "identity"):
        return data
    if encoding not in ENCODINGS.values():
        raise DataError(f"{where} has Content-Encoding {encoding!r}, which znni does not decode")
    return _decompress(data, encoding, where)


class _RemoteStore(ObjectStore):
    """A store whose objects go through a client with ``where``, ``put``, ``get``, ``size`` and
    ``delete`` (:class:`~.s3.S3Objects`, :class:`~.gcs.GcsObjects`)."""

    @cached_property
    def _objects(self):
        raise NotImplementedError

    def where(self, name: str) -> str:
        """The object's full URL."""
        return self._objects.where(name)

    def _put(self, name, data, compress, content_type, exclusive) -> bool:
        # exclusive: one conditional request (S3 If-None-Match: *, GCS ifGenerationMatch=0), so of
        # simultaneous creators exactly one wins
        return self._objects.put(
            name,
            _gzip(data) if compress == "gzip" else data,
            content_type=content_type,
            content_encoding="gzip" if compress == "gzip" else None,
            exclusive=exclusive,
        )

    def get(self, name: str) -> bytes | None:
        """The object's bytes (a gzip Content-Encoding undone), or None if absent; others are a :class:`DataError`."""
        got = self._objects.get(name)
        return None if got is None else _decoded(got[0], got[1], self.where(name))

    def get_range(self, name: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of ``name`` (one ranged GET), or None if absent."""
        if end <= start:
            return b"" if self._objects.size(name) is not None else None
        got = self._objects.get(name, (start, end))
        if got is None:
            return None
        if got[1] not in ("", "identity"):
            raise DataError(f"{self.where(name)} has Content-Encoding {got[1]!r}: it cannot be read by byte range")
        if len(got[0]) != end - start:
            raise DataError(
                f"{self.where(name)}: bytes [{start}, {end}) lie past its end: it is truncated or its index is "
                "corrupt; repair or rewrite it"
            )
        return got[0]

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (one HEAD request)."""
        return self._objects.size(name) is not None

    def sizes(self, names: list[str]) -> dict:
        """``{name: bytes stored, or None if absent}`` (HEAD requests, 8 in flight)."""
        if len(names) < 2:
            return {n: self._objects.size(n) for n in names}
        with ThreadPoolExecutor(8) as pool:
            return dict(zip(names, pool.map(self._objects.size, names)))

    def versions(self, names: list[str]) -> dict:
        """``{name: ETag or generation, or None if absent}`` (HEAD requests, 8 in flight)."""
        if len(names) < 2:
            return {n: self._objects.version(n) for n in names}
        with ThreadPoolExecutor(8) as pool:
            return dict(zip(names, pool.map(self._objects.version, names)))

    def delete(self, name: str) -> None:
        """Delete ``name``; a failed request is a :class:`~znni_core.errors.StorageError`."""
        self._objects.delete(name)

    def stat(self, name: str) -> tuple[int, float] | None:
        """``(bytes, last-modified as POSIX seconds)`` of ``name``, or None if absent (one HEAD)."""
        return self._objects.stat(name)

    def list(self, prefix: str = "", *, delimiter: str = "", limit: int | None = None) -> tuple[list, list]:
        """``([(name, bytes, last-modified)], [sub-prefixes])`` under ``prefix`` (names relative to
        the store; ``delimiter="/"``: one level; ``limit``: at most that many objects)."""
        return self._objects.list(prefix, delimiter=delimiter, limit=limit)


class S3Store(_RemoteStore):
    """``s3://`` (AWS or any endpoint): one PUT with Content-MD5; retries and errors in :mod:`.s3`."""

    @cached_property
    def _objects(self):

        return S3Objects(self.url)


class GcsStore(_RemoteStore):
    """``gs://``: one upload per object; retries and errors in :mod:`.gcs`."""

    @cached_property
    def _objects(self):

        return GcsObjects(self.url)


class HttpStore(_RemoteStore):
    """``http://`` / ``https://``: read-only; retries, errors and suffixes in :mod:`.http`.
    ``raw_names``: objects are looked up under their names only (a zarr array's), never under
    the encoding suffixes of a precomputed layer."""

    def __init__(self, url: LayerURL, *, raw_names: bool = False):
        super().__init__(url)
        self.raw_names = raw_names

    @cached_property
    def _objects(self):

        return HttpObjects(self.url, suffixes=("",) if self.raw_names else None)


def object_store(url: LayerURL, *, raw_names: bool = False) -> ObjectStore:
    """The store of ``url``'s protocol: :class:`LocalStore`, :class:`S3Store`, :class:`GcsStore` or
    :class:`HttpStore` (``raw_names``: an http store probes no encoding suffixes; zarr's keys)."""
    if url.is_local:
        return LocalStore(url)
    if url.protocol == "s3":
        return S3Store(url)
    if url.protocol in ("http", "https"):
        return HttpStore(url, raw_names=raw_names)
    return GcsStore(url)


def read_json(url: LayerURL, name: str):
    """A small JSON file of the layer at ``url``, or None if absent."""
    return object_store(url).get_json(name)


def write_json(url: LayerURL, name: str, obj, *, exclusive: bool = False) -> bool:
    """Write a small JSON file of the layer at ``url`` (``exclusive``: only if absent)."""
    return object_store(url).put_json(name, obj, exclusive=exclusive)


class StoredObjects:
    """Mixin for a layer at ``self.url`` whose objects (shards) are written whole, read,
    verified and deleted through its :class:`ObjectStore` (``self.store``)."""

    @cached_property
    def store(self) -> ObjectStore:
        """This layer's object store."""
        return object_store(self.url)

    def write_object(self, name: str, data: bytes) -> None:
        """Store ``name`` whole: temporary file + rename on ``file://``, one PUT on ``s3://``/``gs://``."""
        self.store.put(name, data)

    def read_object(self, name: str) -> bytes | None:
        """The object's bytes, or None if absent."""
        return self.store.get(name)

    def verify_object(self, name: str, digest: str) -> None:
        """Read back and compare with ``digest`` (:meth:`ObjectStore.verify`)."""
        self.store.verify(name, digest)

    def delete_object(self, name: str) -> None:
        """Remove ``name``; absent is fine."""
        self.store.delete(name)
