"""What a machine's plans, calibrations and measurements are keyed by, and the small JSON files
they are kept in (like FFTW's wisdom): the CPU model, library versions, and :class:`JsonCache`.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from ..version import __version__


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def dist_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (None if absent): importing a
    package to read ``__version__`` costs its import (pyfftw: dask.array and scipy.fftpack, 0.6 s)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    """Versions in the machine key (a cached plan lookup imports none of these packages); read
    once per process (the metadata lookups took 6 ms of every ``infer`` call)."""
    return dict(_versions())


@functools.lru_cache(maxsize=1)
def _versions() -> tuple:
    found = {"znni": __version__, "numpy": np.__version__, "python": platform.python_version()} | {
        d: dist_version(d) for d in ("scipy", "pyfftw", "numba")
    }
    return tuple(found.items())


_PARSED: dict = {}  # path -> ((inode, size, mtime), parsed entries): JsonCache's memo


class JsonCache:
    """A tiny persistent key -> value store (JSON), written atomically.

    Processes share it (a workflow's jobs, test workers): :meth:`put` re-reads the file under an
    exclusive lock (``<name>.lock``, ``fcntl.flock``) and adds its entry to what is there, so an
    entry another process wrote since this one read the file is kept, not overwritten by a stale
    copy."""

    def __init__(self, path: Path, max_entries: int | None = None):
        self.path, self.max_entries = Path(path), max_entries
        self.data = self._read(memo=True)

    def _read(self, memo: bool = False) -> dict:
        """The file's entries.  ``memo``: the process's last parse of it while the file is the
        same (inode, size, mtime): ``infer`` looks its plan up at every call, and re-parsing the
        plan cache took 1.6 ms of a 30 ms call.  A writer replaces the file (a new inode), so a
        stale parse is never returned.  Callers treat what :meth:`get` returns as read-only."""
        try:
            st = os.stat(self.path)
        except OSError:
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _PARSED.get(self.path)
        if memo and hit is not None and hit[0] == stamp:
            return hit[1]
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}  # a corrupt cache is only a cache: start over
        _PARSED[self.path] = (stamp, data)
        return dict(data)  # put() adds to its own copy, never to the memo

    def get(self, key):
        """The value stored under ``key``, or None."""
        return self.data.get(key)

    def put(self, key, value):
        """Store ``value`` under ``key`` (newest last; the oldest dropped past ``max_entries``)."""
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self.data = self._read()
            self.data.pop(key, None)
            self.data[key] = value  # newest last (JSON objects keep their order)
            if self.max_entries is not None:
                for old in list(self.data)[: max(0, len(self.data) - self.max_entries)]:
                    del self.data[old]
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)
