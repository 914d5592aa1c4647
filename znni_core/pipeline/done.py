"""Whether a task is done: its manifest names this run and every object it records checks out.

The done-check every step shares (a job deciding which of its tasks to skip, a pyramid job,
``finalize``, ``znni verify``): a task is done only when its manifest

- names this run's digest (:mod:`.identity`: a task of other settings, input, network, plan or
  encoding is never done for this run),
- lists exactly the chunks the task owns,
- and every chunk (or the task's shard) it records is stored as recorded: its sha256 read back
  (``finalize.verify: checksum``) or its presence (``exists``); ``empty`` and ``masked`` chunks
  are absent.

Anything else is a :class:`~znni_core.errors.DataError` naming the manifest and the task.
"""

from __future__ import annotations

from ..errors import DataError
from ..io import read_manifest
from .run import Run
from .task import manifest_path


def _check_stored(what: str, entry: dict, read, check, verify: str, task: int) -> None:
    """One stored object (chunk or shard) against its manifest entry."""
    if entry["status"] in ("empty", "masked"):
        if read() is not None:
            raise DataError(f"{what} is recorded {entry['status']} but exists; re-run task {task}")
    elif verify == "checksum":
        check(entry["sha256"])
    elif read() is None:
        raise DataError(f"{what} of task {task} is missing; re-run task {task}")


def this_runs_manifest(run: Run, block, mip: int = 0) -> dict:
    """A task's manifest (of mip ``mip``: a pyramid's) when it names this run and lists exactly the
    task's chunks, without reading any stored object; DataError naming what is wrong otherwise."""
    mp = manifest_path(run, block.id, mip)
    m = read_manifest(mp)
    if m.get("run_digest") != run.digest:  # another run's settings, input, network, plan or encoding
        raise DataError(
            f"manifest {mp} was written by another run (digest {str(m.get('run_digest'))[:12]}, this run "
            f"{run.digest[:12]}); re-run task {block.id}"
        )
    if [c["index"] for c in m["chunks"]] != [list(i) for i in block.chunks]:
        raise DataError(f"manifest {mp} lists other chunks than task {block.id} owns; re-run it")
    return m


def check_task(run: Run, out, block, verify: str, mip: int = 0) -> dict:
    """A task's manifest (:func:`this_runs_manifest`), once every object it records checks out
    against the store (``verify``: checksum | exists); DataError naming what is wrong otherwise."""
    mp = manifest_path(run, block.id, mip)
    m = this_runs_manifest(run, block, mip)
    if out.sharded:  # the shard object is what was written: its checksum covers every chunk
        sh = m.get("shard") or {}
        name = out.shard_name(block.chunks[0])
        if sh.get("name") != name:
            raise DataError(f"manifest {mp} names shard {sh.get('name')!r}, task {block.id} owns {name}; re-run it")
        _check_stored(
            f"shard {name}", sh, lambda: out.read_object(name), lambda d: out.verify_object(name, d), verify, block.id
        )
    for c in [] if out.sharded else m["chunks"]:
        idx = tuple(c["index"])
        _check_stored(
            f"chunk {c['name']}",
            c,
            lambda: out.read_chunk_bytes(idx),
            lambda d: out.verify_chunk(idx, d),
            verify,
            block.id,
        )
    return m
