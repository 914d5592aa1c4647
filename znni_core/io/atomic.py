"""Atomic file writes on a local file system (``file://`` layers, manifests, reports).

A chunk is written to a temporary name in the same directory, flushed and fsync'ed, then
``os.replace``'d over the final name, and the directory is fsync'ed: a reader sees the old
bytes or the new bytes, never a torn file, whatever kills the writer (docs/reliability.md, T2, T10).

Temporary names are ``.<name>.znni-tmp.<host>.<pid>.<random>``; :func:`clean_stale_temporaries`
removes those whose writer is dead (same host) so a crash leaves nothing behind after the next
good run (T6).
"""

from __future__ import annotations

import errno
import os
import secrets
import socket
from pathlib import Path

TMP_MARK = ".znni-tmp."


def _host() -> str:
    return socket.gethostname().split(".")[0].replace(".", "_") or "host"


def temp_name(path: Path) -> Path:
    """A fresh temporary name next to ``path``: ``.<name>.znni-tmp.<host>.<pid>.<random>``."""
    return path.with_name(f".{path.name}{TMP_MARK}{_host()}.{os.getpid()}.{secrets.token_hex(4)}")


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


def atomic_write(path, data: bytes, *, exclusive: bool = False) -> bool:
    """Write ``data`` to ``path`` atomically.

    With ``exclusive=True`` the file is only created if absent (``os.link`` fails on an existing
    name): returns False and leaves the existing file alone when someone was first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
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
    if not directory.is_dir():
        return removed
    host = _host()
    for entry in os.scandir(directory):
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
