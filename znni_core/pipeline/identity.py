"""A run's identity: everything that can change an output byte, and what differs between two runs.

A task is done only for the run that made it: its manifest records the digest of the run's
identity (``run_digest``), and a task whose manifest names another digest is not done.  The
identity holds

- the science of the config: ``normalize``, ``edge``, ``input.missing`` / ``input.empty``,
  ``tta``, ``blend``, ``device``, the output's ``scale`` / ``offset`` / ``compression``, the mask;
- the input layer: URL, endpoint, scale, bounds, resolution, dtype, channels;
- the network's digest (its weights and graph) and the plan's (primitives, patch, fragments);
- the output layer: URL and ``info`` (dtype, channels; mip 0's chunks, encoding, sharding) and
  the region (a pyramid's mips are made from mip 0, their tasks pinning the chunks they averaged:
  adding mips to a finished run changes nothing of it);
- :data:`~znni_core.version.NUMERICS_VERSION`, the engine's arithmetic.

It leaves out what cannot change a byte: ``work_dir``, ``jobs``, ``finalize``, ``verify_voxels``,
``recompute``, the network file's path (its digest counts), the plan's settings (its digest
counts) and the task layout (a task computes its chunks as the whole region's run would: a task
whose manifest lists other chunks is made again anyway).  ``znni validate`` compares a new
run's identity with the one a work directory holds (:func:`check_rerun`): a re-run of other
settings is refused before anything is scheduled unless ``recompute`` asks for the tasks to be
made again.

>>> old = {"science": {"normalize": {"scale": 1.0, "shift": 0.0}}, "network": "ab" * 32}
>>> new = {"science": {"normalize": {"scale": 1.0, "shift": 0.5}}, "network": "cd" * 32}
>>> differences(old, new)
['network abababababab.. -> cdcdcdcdcdcd..', 'science.normalize.shift 0.0 -> 0.5']
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import ConfigError
from ..io.workdir import is_remote_work, work_path
from ..version import NUMERICS_VERSION

#: parts of the identity that shape the output layer itself: a change of them is never
#: recomputed in place (the old chunks, shards or mips of the other layout would survive)
LAYOUT = ("output.info", "output.region", "science.mask")


def identity(cfg, network_digest: str, plan_digest: str, inp: dict, out: dict) -> dict:
    """The identity of a resolved run: ``cfg`` a :class:`~.settings.Config`; ``inp`` the run's
    input record (url, mip, bounds, resolution, dtype, channels); ``out`` ``{"url", "info",
    "region", "task_chunks"}``."""
    mask = None if cfg.mask is None else {k: v for k, v in vars(cfg.mask).items()}
    return json.loads(
        json.dumps(
            {
                "numerics": NUMERICS_VERSION,
                "network": network_digest,
                "plan": plan_digest,
                "input": dict(inp) | {"endpoint_url": cfg.input.endpoint_url},
                "science": {
                    "normalize": vars(cfg.normalize),
                    "edge": cfg.edge,
                    "input.missing": cfg.input.missing,
                    "input.empty": cfg.input.empty,
                    "tta": vars(cfg.tta),
                    "blend": vars(cfg.blend),
                    "device": cfg.device,
                    "mask": mask,
                },
                "output": dict(out)
                | {
                    "endpoint_url": cfg.output.endpoint_url,
                    "scale": cfg.output.scale,
                    "offset": cfg.output.offset,
                    "compression": cfg.output.compression,
                },
            },
            sort_keys=True,
            default=str,
        )
    )


def digest(ident: dict) -> str:
    """The run digest: sha256 of the identity's canonical JSON."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _leaves(obj, path: str = "") -> dict:
    if isinstance(obj, dict) and obj:
        return {k: v for key, sub in obj.items() for k, v in _leaves(sub, f"{path}.{key}" if path else key).items()}
    return {path: obj}


def _show(v) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12] + ".."  # a digest
    text = json.dumps(v)
    return text if len(text) <= 80 else text[:77] + "..."


def differences(old: dict, new: dict) -> list[str]:
    """``["<key> <old> -> <new>", ...]`` of the identity entries that differ (sorted)."""
    a, b = _leaves(old), _leaves(new)
    return [f"{k} {_show(a.get(k))} -> {_show(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def first_manifest(work_dir) -> Path | None:
    """A manifest of a finished task in ``work_dir`` (the first found), or None when no task finished."""
    work = work_path(work_dir)
    if is_remote_work(work):
        return (work / "manifests").first_file(".json")
    stack = [work / "manifests"]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    elif e.name.endswith(".json"):
                        return Path(e.path)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


IDENTITY_FILE = "identity.json"  # not run.json: Snakemake deletes a job's outputs before it runs


def identity_document(run) -> bytes:
    """``<work_dir>/identity.json`` of ``run`` (written with ``run.json``): what the next validate
    in this work directory compares with."""
    doc = {"digest": run.digest, "identity": run.identity, "versions": run.versions}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def previous_identity(work_dir) -> dict | None:
    """The identity document ``work_dir`` holds, or None (none yet); a file that does not read as
    one counts as an identity of its own (a run of unknown settings)."""
    try:
        doc = json.loads((work_path(work_dir) / IDENTITY_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"identity": {"unreadable": f"{IDENTITY_FILE}: {exc}"}}
    return doc if isinstance(doc, dict) else {"identity": {"unreadable": f"{IDENTITY_FILE} is no object"}}


def check_rerun(previous: dict | None, run, recompute: str) -> list[str]:
    """What changed since the run ``previous`` (the identity document a work directory holds,
    :func:`previous_identity`) for the new ``run``; ``[]`` when nothing did or no task finished.

    A :class:`ConfigError` in one line names the changes and the ways on when tasks of another
    identity are done and ``recompute`` is ``none``, or when the change is one of the output
    layer's layout (:data:`LAYOUT`), which is never recomputed in place."""
    manifest = first_manifest(run)
    if manifest is None:
        return []
    if previous is None:  # tasks without a recorded identity (an earlier znni): their digest says
        try:
            digest_then = json.loads(manifest.read_text()).get("run_digest")
        except (OSError, ValueError, AttributeError):
            digest_then = None
        old, new = {"run_digest": digest_then}, {"run_digest": run.digest}
    else:
        old, new = previous.get("identity"), run.identity
        old = old if isinstance(old, dict) else {"unreadable": repr(old)}
    changed = differences(old, new)
    if not changed:
        return []
    what = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
    work = run.work_dir
    layout = [c for c in changed if any(c.startswith(k) for k in LAYOUT)]
    same_layer = _leaves(old).get("output.url") == run.identity["output"]["url"]
    if layout and same_layer:
        raise ConfigError(
            f"work_dir {work} holds finished tasks of another run, and the output layer's layout differs: {what}; "
            "nothing was run. Write the new settings to a new output.path and work_dir"
        )
    if recompute == "none":
        raise ConfigError(
            f"work_dir {work} holds finished tasks of another run: {what}; nothing was run. Either use a "
            "new work_dir and output.path for these settings, or recompute the tasks they change: "
            "set recompute: changed (snakemake ... --config recompute=changed)"
        )
    return changed


def changed_inputs(inp, manifest: dict, mask=None) -> list[str]:
    """The input objects a task's ``manifest`` records (``input_versions``; with ``mask``, the
    mask layer's ``mask_versions`` too) whose version differs now (changed in place, deleted or
    created since): ``["<object> <then> -> <now>"]``.  One ``stat`` (``file://``) or HEAD
    request (``s3://``, ``gs://``) per object."""
    out = []
    for key, layer, what in (("input_versions", inp, "input"), ("mask_versions", mask, "mask")):
        if layer is None:
            continue
        then = manifest.get(key)
        if not isinstance(then, dict):
            out.append(f"({what}: the task recorded no versions)")
            continue
        now = layer.versions(sorted(then)) if then else {}
        out += [f"{what} {k} {then[k]} -> {now.get(k)}" for k in sorted(then) if now.get(k) != then[k]]
    return out
