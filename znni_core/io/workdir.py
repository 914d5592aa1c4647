"""A run's work directory on a file system or in object storage.

``work_dir`` (manifests, job markers and records, the schedule, the report) is a local directory
(or a shared file system's), or an ``s3://`` / ``gs://`` prefix, so that jobs on machines that
share no file system (cloud batch, Kubernetes) keep one work directory.  :func:`work_path` gives
a :class:`~pathlib.Path` for the first and a :class:`WorkPath` for the second: the part of
``pathlib.Path``'s interface the pipeline uses (``/``, ``name``, ``parent``, ``read_text``,
``is_file``, ``glob``, ``iterdir``, ``stat``, ``unlink``), over znni's own bounded object
stores (:mod:`.store`: retries, permanent refusals at their first answer).  A write is one PUT
(atomic per object); an exclusive one is conditional (S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``), so of two writers racing to create an object exactly one wins.
``"directories"`` are key prefixes: ``mkdir`` does nothing, ``is_dir`` is true where an object
lies below.

A :class:`WorkPath` has no ``__fspath__``: code that would hand it to ``open`` or ``os`` fails
loudly instead of writing a local directory named ``s3:``.  :func:`local_copy` gives a local
directory to draw figures in and uploads what was drawn.

>>> work_path("/data/work") / "run.json"
PosixPath('/data/work/run.json')
>>> p = work_path("s3://bucket/work") / "jobs" / "000001.json"
>>> str(p), p.name, p.stem, str(p.parent)
('s3://bucket/work/jobs/000001.json', '000001.json', '000001', 's3://bucket/work/jobs')
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
import posixpath
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import ConfigError, StorageError
from .paths import LayerURL
from .store import object_store

#: the protocols a work directory may be on besides a file system
REMOTE_WORK = ("s3", "gs")
#: the S3 endpoint of a work directory named by URL alone (a run file on a command line)
ENDPOINT_ENV = "ZNNI_WORK_ENDPOINT_URL"
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/+(.*)$")


def is_remote_work(work_dir) -> bool:
    """Whether ``work_dir`` (a string, Path or WorkPath) names object storage."""
    return isinstance(work_dir, WorkPath) or (bool(_URL.match(str(work_dir))) and not str(work_dir).startswith("file:"))


def parse_work_dir(work_dir: str, endpoint: str | None = None) -> LayerURL:
    """The :class:`LayerURL` of a work directory URL; a :class:`ConfigError` naming the value and
    the fix for anything but ``s3://bucket/path`` or ``gs://bucket/path``."""
    m = _URL.match(str(work_dir))
    proto, rest = (m.group(1), m.group(2).strip("/")) if m else ("", "")
    if proto not in REMOTE_WORK:
        raise ConfigError(
            f"work_dir {work_dir!r}: a work directory is a local path (or file://), s3://bucket/path or "
            "gs://bucket/path; http(s):// is read-only"
        )
    bucket = rest.split("/", 1)[0]
    if not bucket or ".." in rest.split("/"):
        raise ConfigError(f"work_dir {work_dir!r}: needs a bucket and a path without '..', as in {proto}://bucket/work")
    if endpoint and proto != "s3":
        raise ConfigError(f"work_endpoint_url {endpoint!r} only applies to an s3:// work_dir, not {work_dir!r}")
    return LayerURL("precomputed", proto, rest, endpoint or None)


def work_endpoint(cfg) -> str | None:
    """The S3 endpoint of the work directory of ``cfg`` (a config or run, or its dict):
    ``work_endpoint_url``, else, for an ``s3://`` work_dir beside an ``s3://`` output, the
    output's ``endpoint_url`` (one S3-compatible server for both), else None."""
    cfg = getattr(cfg, "config", cfg)

    def get(obj, key):
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    if get(cfg, "work_endpoint_url"):
        return get(cfg, "work_endpoint_url")
    out = get(cfg, "output") or {}
    if str(get(cfg, "work_dir")).startswith("s3://") and "s3://" in str(get(out, "path")):
        return get(out, "endpoint_url") or None
    return None


def work_path(where, endpoint: str | None = None):
    """The work directory of ``where``: a run or config (its ``work_dir``, at
    :func:`work_endpoint`), a config dict, or a path or URL string (its endpoint ``endpoint``, else
    ``$ZNNI_WORK_ENDPOINT_URL``, which the workflow sets for its jobs, else boto3's own chain); a
    local :class:`Path` (``file://`` prefixes removed) or a :class:`WorkPath`."""
    if isinstance(where, (WorkPath, Path)):
        return where
    if isinstance(where, dict) or hasattr(where, "work_dir"):
        where, endpoint = (where.get("work_dir") if isinstance(where, dict) else where.work_dir), work_endpoint(where)
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or None
    s = str(where)
    if s.startswith("file://"):
        return Path(s[len("file://") :])
    if not _URL.match(s):
        return Path(s)
    url = parse_work_dir(s, endpoint)
    bucket, _, key = url.path.partition("/")
    return WorkPath(_store(url.protocol, bucket, url.endpoint, _client_env()), key)


def _matches(names: list, parts: list) -> bool:
    """Whether the levels ``names`` match the pattern's levels ``parts`` (``**``: zero or more)."""
    if not parts:
        return not names
    if parts[0] == "**":
        return any(_matches(names[i:], parts[1:]) for i in range(len(names) + 1))
    return bool(names) and fnmatch.fnmatchcase(names[0], parts[0]) and _matches(names[1:], parts[1:])


#: what else decides which server and credentials a store's client uses
_CLIENT_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "STORAGE_EMULATOR_HOST",
    "ZNNI_SIGN_REQUESTS",
)


def _client_env() -> tuple:
    return (os.getpid(),) + tuple(os.environ.get(k) for k in _CLIENT_ENV)


@functools.lru_cache(maxsize=32)
def _store(protocol: str, bucket: str, endpoint: str | None, env: tuple):
    """One store per bucket, endpoint and client environment (``env``) in a process: its client
    made once, not once per path."""
    return object_store(LayerURL("precomputed", protocol, bucket, endpoint))


@contextlib.contextmanager
def _as_os_error(path):
    """A failed request (:class:`~znni_core.errors.StorageError`: refused, unreachable after its
    retries) as the :class:`OSError` a file system raises, so that the pipeline handles a work
    directory's failures one way whatever holds it; the message is the store's."""
    try:
        yield
    except StorageError as exc:
        raise OSError(errno.EIO, str(exc), str(path)) from exc


def remove_before_rewrite(path) -> None:
    """Remove ``path`` when it is in a bucket, before the work that writes it again: as Snakemake
    removes a rule's output before its job runs (there the rule's output is a flag, and this object
    is znni's), so that an earlier attempt's marker never outlives a failed one."""
    if isinstance(path, WorkPath):
        path.unlink(missing_ok=True)


def as_path(p):
    """``p`` as a path: a :class:`WorkPath` as it is, anything else a :class:`Path`."""
    return p if isinstance(p, WorkPath) else Path(p)


class _Stat:
    def __init__(self, size: int, mtime: float):
        self.st_size, self.st_mtime = size, mtime
        self.st_mtime_ns = int(mtime * 1e9)


class WorkPath:
    """An object (or a prefix of objects) under a remote work directory: see the module docstring."""

    is_remote = True

    def __init__(self, store, name: str, kind: str | None = None):
        # kind: "file" or "dir" where a listing said so (no request to ask again), else None
        self.store, self._name, self._kind = store, name.strip("/"), kind

    # ---- names -----------------------------------------------------------------------------------
    def __truediv__(self, other) -> WorkPath:
        other = str(other)
        if other.startswith("/") or ".." in other.split("/"):
            raise ValueError(f"{other!r} is not a relative name under {self}")
        return WorkPath(self.store, posixpath.join(self._name, other) if other else self._name)

    def __str__(self) -> str:
        url = self.store.url
        return f"{url.protocol}://{url.path}" + (f"/{self._name}" if self._name else "")

    def __repr__(self) -> str:
        return f"WorkPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, WorkPath) and str(self) == str(other)

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        """The last part of the name."""
        return posixpath.basename(self._name)

    @property
    def stem(self) -> str:
        """The name without its suffix."""
        return posixpath.splitext(self.name)[0]

    @property
    def suffix(self) -> str:
        """The name's extension."""
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> WorkPath:
        """The prefix this object lies under."""
        return WorkPath(self.store, posixpath.dirname(self._name))

    def with_name(self, name: str) -> WorkPath:
        """The object beside this one named ``name``."""
        return self.parent / name

    def with_suffix(self, suffix: str) -> WorkPath:
        """This name with another extension."""
        return self.with_name(self.stem + suffix)

    def relative_to(self, other) -> Path:
        """The name below ``other``, as a relative Path."""
        base = other._name if isinstance(other, WorkPath) else str(other)
        if base and not (self._name + "/").startswith(base.rstrip("/") + "/"):
            raise ValueError(f"{self} is not under {other}")
        return Path(self._name[len(base) :].lstrip("/"))

    # ---- contents --------------------------------------------------------------------------------
    def read_bytes(self) -> bytes:
        """The object's bytes; FileNotFoundError when absent."""
        with _as_os_error(self):
            data = self.store.get(self._name)
        if data is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        return data

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        """The object's text; FileNotFoundError when absent."""
        return self.read_bytes().decode(encoding, errors)

    def write_bytes(self, data: bytes, *, exclusive: bool = False) -> bool:
        """Store ``data`` (one PUT); ``exclusive``: only if absent (returns False when it was there)."""
        with _as_os_error(self):
            return self.store.put(self._name, bytes(data), exclusive=exclusive)

    def write_text(self, text: str, encoding: str = "utf-8") -> bool:
        """Store ``text`` (one PUT)."""
        return self.write_bytes(text.encode(encoding))

    def stat(self) -> _Stat:
        """``st_size`` and ``st_mtime`` of the object (one HEAD)."""
        with _as_os_error(self):
            st = self.store.stat(self._name)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        return _Stat(*st)

    def exists(self) -> bool:
        """Whether an object or a prefix of objects is there."""
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        """Whether the object exists (one HEAD)."""
        if self._kind is not None:
            return self._kind == "file"
        with _as_os_error(self):
            return bool(self._name) and self.store.exists(self._name)

    def is_dir(self) -> bool:
        """Whether any object lies below (one LIST)."""
        if self._kind is not None:
            return self._kind == "dir"
        objects, prefixes = self._list(delimiter="/")
        return bool(objects or prefixes)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once an object lies under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        """Delete the object (``missing_ok``: absent is fine)."""
        if not missing_ok and not self.is_file():
            raise FileNotFoundError(errno.ENOENT, "no such object", str(self))
        with _as_os_error(self):
            self.store.delete(self._name)

    def _prefix(self) -> str:
        return self._name + "/" if self._name else ""

    def _list(self, *, delimiter: str = "", limit: int | None = None) -> tuple[list, list]:
        with _as_os_error(self):
            return self.store.list(self._prefix(), delimiter=delimiter, limit=limit)

    def iterdir(self):
        """The objects and prefixes one level below, in name order."""
        objects, prefixes = self._list(delimiter="/")
        names = [(n, "file") for n, _, _ in objects] + [(p.rstrip("/"), "dir") for p in prefixes]
        return iter(WorkPath(self.store, n, kind) for n, kind in sorted(names))

    def glob(self, pattern: str):
        """Objects matching ``pattern``, level by level (``*``, ``?`` and ``[...]`` within a level,
        as pathlib's; a ``**`` level: any number of levels)."""
        objects, _ = self._list()
        base = len(self._prefix())
        parts = pattern.split("/")
        return iter(
            WorkPath(self.store, n, "file") for n, _, _ in sorted(objects) if _matches(n[base:].split("/"), parts)
        )

    def rglob(self, pattern: str):
        """Objects at any depth below whose name matches ``pattern``."""
        return self.glob(f"**/{pattern}")

    def first_file(self, suffix: str = ""):
        """An object below whose name ends with ``suffix`` (the first listed), or None: one LIST."""
        objects, _ = self._list(limit=1000)
        return next((WorkPath(self.store, n) for n, _, _ in objects if n.endswith(suffix)), None)

    def listing(self, *, recursive: bool = True) -> list[tuple[WorkPath, int, float]]:
        """Every object below (``recursive=False``: one level) with its bytes and modification
        time: one listing, no HEAD each."""
        objects, _ = self._list(delimiter="" if recursive else "/")
        return [(WorkPath(self.store, n, "file"), size, mtime) for n, size, mtime in sorted(objects)]


@contextlib.contextmanager
def local_copy(directory, *, last: str | None = None):
    """A local directory to write files of ``directory`` in: ``directory`` itself on a file system;
    for a :class:`WorkPath` a temporary one whose files are uploaded (one PUT each; the file named
    ``last`` after every other) when the block ends without an error, then removed."""
    if not isinstance(directory, WorkPath):
        Path(directory).mkdir(parents=True, exist_ok=True)
        yield Path(directory)
        return
    tmp = Path(tempfile.mkdtemp(prefix="znni-work-"))
    try:
        yield tmp
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in sorted(files, key=lambda p: p.relative_to(tmp).as_posix() == last):
            (directory / p.relative_to(tmp).as_posix()).write_bytes(p.read_bytes())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
