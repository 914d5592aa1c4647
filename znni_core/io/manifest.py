"""Per-task manifests: the done-marker Snakemake sees, written only after every chunk verified,
and :func:`store_chunks`, which writes a task's chunks (or its shard) and makes their entries.

A manifest is JSON: task id and ROIs, one entry per chunk (name, status ``written`` with sha256,
``empty`` for chunks skipped because their input was all zero, or ``masked`` for chunks the run's
mask is 0 over), plan and network digests,
versions, device, timings, and any input chunks filled with zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError
from .atomic import atomic_write
from .workdir import as_path

MANIFEST_FORMAT = "znni-manifest/1"
CHUNK_STATUSES = ("written", "empty", "masked")


def write_manifest(path, manifest: dict) -> Path:
    """Write ``manifest`` (plus its ``format``) atomically as JSON to ``path``; return the path.

    Raises :class:`DataError` if the write fails: the task is then not marked done.
    """
    manifest = dict(manifest, format=MANIFEST_FORMAT)
    path = as_path(path)
    try:
        atomic_write(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    except OSError as exc:  # disk full, I/O error (docs/reliability.md, T6): no manifest, so the task is not done
        raise DataError(
            f"manifest {path}: write failed ({exc.strerror or exc}); the task's chunks are written "
            "but it is not marked done; free space or fix the storage and re-run it"
        ) from exc
    return path


def read_manifest(path) -> dict:
    """Load and structurally check a manifest; :class:`DataError` names the file and the problem."""
    path = as_path(path)
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"manifest {path} is missing: its task never finished; run it again") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"manifest {path} is not valid JSON ({exc}); delete it and re-run its task") from exc
    except OSError as exc:  # a directory, unreadable, I/O error: the done-check failed, not 'done' (T16)
        raise DataError(
            f"manifest {path} cannot be read ({exc.strerror or exc}); fix or delete it and re-run its task"
        ) from exc
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise DataError(
            f"manifest {path}: format {m.get('format') if isinstance(m, dict) else None!r} "
            f"is not {MANIFEST_FORMAT!r}; re-run its task"
        )
    for key in ("task", "chunks", "run_digest", "plan_digest", "network_digest", "layer"):
        if key not in m:
            raise DataError(f"manifest {path} lacks {key!r}; re-run its task")
    if not isinstance(m["chunks"], list):
        raise DataError(f"manifest {path}: 'chunks' is not a list; re-run its task")
    for c in m["chunks"]:
        if (
            not isinstance(c, dict)
            or c.get("status") not in CHUNK_STATUSES
            or (c["status"] == "written" and not c.get("sha256"))
        ):
            raise DataError(f"manifest {path}: chunk entry {c!r} is incomplete; re-run its task")
    return m


def store_chunks(out, chunks, encoded: dict, skipped: dict, compress: str, only=None) -> tuple[dict, dict | None]:
    """Write a task's ``chunks`` to ``out`` and read them back: ``encoded`` ``{index: (C, z, y, x)}``
    are written, ``skipped`` ``{index: "empty" | "masked"}`` are deleted (a stale chunk of an
    earlier run must not survive as valid).  A sharded layer gets the task's one shard, built
    whole (no shard at all when nothing is written).  ``only``: rewrite just this chunk (unsharded).
    Returns ``(manifest entries by index, the shard's record or None)``."""
    grid = out.grid
    entries, shard = {}, None

    def entry(idx, **more):
        return {"name": out.chunk_name(idx), "index": list(idx), "roi": grid.chunk_roi(idx).to_dict(), **more}

    if out.sharded:  # the task's chunks are one shard: built whole, written once, read back
        name = out.shard_name(chunks[0])
        digests = {}
        if encoded:
            shard = out.write_shard(encoded)
            digests = shard.pop("chunks")
            shard["status"] = "written"
        else:
            out.delete_object(name)  # every chunk empty or masked: no shard (readers see 0), no stale one
            shard = {"name": name, "status": "empty"}
        for idx in chunks:
            entries[idx] = entry(
                idx,
                shard=name,
                **(
                    {"status": skipped[idx]}
                    if idx in skipped
                    else {"status": "written", "sha256": digests[tuple(idx)], "nbytes": int(encoded[idx].nbytes)}
                ),
            )
        return entries, shard
    for idx in chunks:
        if only is not None and idx != only:
            continue
        if idx in skipped:
            out.delete_chunk(idx)
            entries[idx] = entry(idx, status=skipped[idx])
            continue
        digest = out.write_chunk(idx, encoded[idx], compress=compress)
        out.verify_chunk(idx, digest)
        entries[idx] = entry(idx, status="written", sha256=digest, nbytes=int(encoded[idx].nbytes))
    return entries, shard
