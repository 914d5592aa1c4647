"""Atomic file writes on a local file system (``file://`` layers, manifests, reports).

A chunk is written to a temporary name in the same directory, flushed and fsync'ed, then
``os.replace``'d over the final name, and the directory is fsync'ed: a reader sees the old
bytes or the new bytes, never a torn file, whatever kills the writer (docs/reliability.md, T2, T10).

Temporary names are ``.<name>.znni-tmp.<host>.<pid>.<random>``; :func:`clean_stale_temporaries`
removes those whose writer is dead (same host) so a crash leaves nothing behind after the next
good run (T6).  A layer's objects are written through a temporary in the subdirectory
:data:`TMP_DIR` of their directory: a write then looks for its dead writers' temporaries there,
among the writes in flight, not among the million shards beside it (listing the layer's directory
at every write made a petavoxel run quadratic).
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
from pathlib import Path

TMP_MARK = ".znni-tmp."
#: the subdirectory a layer's objects are written through (:func:`atomic_write`'s ``tmp_dir``)
TMP_DIR = ".znni-tmp"


def _host() -> str:
    return socket.gethostname().split(".")[0].replace(".", "_") or "host"


def temp_name(path: Path, tmp_dir: Path | None = None) -> Path:
    """A fresh temporary name next to ``path`` (or in ``tmp_dir``, on the same file system):
    ``.<name>.znni-tmp.<host>.<pid>.<random>``."""
    name = f".{path.name}{TMP_MARK}{_host()}.{os.getpid()}.{secrets.token_hex(4)}"
    return (path.parent if tmp_dir is None else Path(tmp_dir)) / name


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` so a rename in it is durable; does nothing where the OS refuses."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _create(tmp: Path):
    """``open(tmp, "wb")``, its directory made first; made again when another writer removed it
    empty in between (:func:`release_tmp_dir`)."""
    for _ in range(8):
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            return open(tmp, "wb")
        except (FileNotFoundError, FileExistsError):  # exist_ok's check lost the same race
            continue
    return open(tmp, "wb")


def release_tmp_dir(tmp_dir: Path) -> None:
    """Remove a temporaries' directory if it is empty (a write in flight keeps it: :func:`_create`
    makes it again if it goes between its ``mkdir`` and its ``open``)."""
    try:
        os.rmdir(tmp_dir)
    except OSError:
        pass


def atomic_write(path, data: bytes, *, exclusive: bool = False, tmp_dir: Path | None = None) -> bool:
    """Write ``data`` to ``path`` atomically.

    With ``exclusive=True`` the file is only created if absent (``os.link`` fails on an existing
    name): returns False and leaves the existing file alone when someone was first.  ``tmp_dir``:
    where the temporary is written (a directory on the same file system; default ``path``'s).
    An object of a remote work directory (:class:`~.workdir.WorkPath`) is one PUT, atomic per object.
    """
    if getattr(path, "is_remote", False):
        return path.write_bytes(data, exclusive=exclusive)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path, tmp_dir)
    try:
        with _create(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
        else:
            os.replace(tmp, path)
        fsync_dir(path.parent)
        return True
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def clean_stale_temporaries(directory, prefix: str = "", *, all_hosts: bool = False) -> list[Path]:
    """Remove temporary files of dead writers in ``directory`` (names starting ``.<prefix>``).

    Writers on this host are checked by pid; ``all_hosts=True`` (used by finalize, when no
    writer can be running) removes every znni temporary file.
    """
    directory = Path(directory)
    removed = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):  # none, or removed empty by another writer
        return removed
    host = _host()
    for entry in entries:
        name = entry.name
        if not name.startswith("." + prefix) or TMP_MARK not in name:
            continue
        try:
            whost, wpid, _ = name.split(TMP_MARK, 1)[1].rsplit(".", 2)
            stale = all_hosts or (whost == host and not _pid_alive(int(wpid)))
        except ValueError:
            stale = all_hosts
        if stale:
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except FileNotFoundError:
                pass
    return removed
