"""``znni verify RUN``: check a finished run's output against the network's definition.

Two checks, both independent of how the output was computed:

1. **Stored objects**: every task's manifest and every chunk or shard it records are read back
   and compared with the recorded sha256 (as ``finalize`` does); a changed, missing or torn
   object fails.
2. **Recomputed voxels** (chain networks): in a sample of tasks, output voxels at random
   positions (a recorded seed) and at each task's corners are computed from the definition --
   the network applied to the voxel's field of view, with plain strided pooling and a direct
   convolution written here in numpy (no planner, no MPF, no FFT, no Winograd) -- and compared
   with what is stored (float32: within ``1e-4`` of the output's scale; float16: also its rounding,
   2^-11 of the scale; uint8: within 1 after the run's mapping).
   Graph networks: in each sampled task one of its patches, chosen at random, is computed alone
   by the executor under a plan of direct convolutions (no FFT, no Winograd, no neighbours,
   no tiling) with the context the run's plan gives it, and every voxel of its tile inside the
   task's written chunks that no other patch blends into is compared the same way.
3. **Empty chunks** (``input.empty: skip``): a sample of the chunks the manifests record
   ``empty`` (a recorded seed) is checked against the definition: the chunk's input context
   (:func:`~.task.empty_context`, read again through the run's edge policy) is all 0 in the raw
   input, and the stored chunk is absent (reads as 0).

The result is written to ``<work_dir>/verify.json``; a failure is a
:class:`~znni_core.errors.DataError` naming the task, the voxel and the two values.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..geometry import Coordinate, Roi
from ..io import atomic_write
from ..io.workdir import work_path
from ..net.definition import DEFINITION_FLOPS, TOLERANCE, flops_per_voxel, sample_voxels
from ..progress import bar
from .recompute import graph_sample, reference_plan
from .report import EMPTY_DEFINITION
from .run import Run
from .tally import DONE, EMPTY, Tally


def verify_run(
    run_file,
    *,
    tasks: int = 8,
    samples: int = 64,
    seed: int = 0,
    checksums: bool = True,
    empty: int = 64,
    log=print,
):
    """Check a finished run (see the module's doc): ``empty`` of its empty chunks are checked;
    returns the record written to ``<work_dir>/verify.json`` and raises :class:`DataError` when a
    check fails."""
    # long (one sequence): the stored objects, the empty chunks and the recomputed voxels checked
    # in turn, every result into the one verify.json record
    # lazy: loads numba and scipy only when called
    from .done import check_task
    from .task import normalise, open_run, quantise, read_task, window_input

    t0 = time.perf_counter()
    ctx = open_run(run_file)
    run, out = ctx.run, ctx.out
    cfg = run.config
    record = {"run_digest": run.digest, "seed": seed, "checksums": None, "empty": None, "recomputed": None}
    # the manifests folded one at a time (:mod:`.tally`): a fixed-size sample of the empty chunks kept
    tally = Tally(len(ctx.tasks), empty_sample=max(0, empty), rng=np.random.default_rng([seed, 1]))
    with bar(len(ctx.tasks), "verify: stored objects", "task") as progress:
        for k, block in enumerate(ctx.tasks):
            progress.update(1)
            try:
                tally.add(k, check_task(run, out, block, "checksum" if checksums else "exists"))
            except DataError as exc:
                record["checksums"] = {"passed": False, "task": block.id, "error": str(exc)}
                _write(run, record)
                raise DataError(f"verify: task {block.id}: {exc}") from None
    done = tally.ids_where(DONE, EMPTY)
    record["checksums"] = {"passed": True, "tasks": len(done), "mode": "checksum" if checksums else "exists"}
    log(f"verify: {len(done)} task(s): every manifest and stored object checks out")
    rng = np.random.default_rng(seed)
    record["empty"] = _check_empty(ctx, tally, record)
    if record["empty"]["chunks"]:
        log(
            f"verify: {record['empty']['checked']} of {record['empty']['chunks']} empty chunk(s): input context "
            "all 0, nothing stored"
        )
    chosen = sorted(rng.choice(done, size=min(tasks, len(done)), replace=False).tolist()) if done else []
    graph = ctx.net.kind != "chain"
    if graph:
        ref_plan, how = reference_plan(ctx)
        log(f"verify: recomputing one patch alone ({how}) in each of {len(chosen)} task(s)")
    else:
        how = "the network's definition (numpy, float64)"
        guess = len(chosen) * (samples + 8) * flops_per_voxel(ctx.net) / DEFINITION_FLOPS
        log(
            f"verify: recomputing up to {len(chosen) * (samples + 8)} voxel(s) in {len(chosen)} task(s), "
            f"about {guess:.0f} s"
        )
    worst, n_vox, scale = 0.0, 0, 1.0
    progress = bar(len(chosen), "verify: recomputing voxels", "task")
    for tid in chosen:
        progress.update(1)
        ti = read_task(ctx, tid, log=lambda *a: None)
        if not ti.todo:
            continue
        x = normalise(ti.raw, cfg.normalize.scale, cfg.normalize.shift, ti.inner)
        if graph:
            points, ref = graph_sample(ctx, ti, window_input(ti, x), rng, ref_plan)
        else:
            points, ref = _chain_sample(ctx, ti, x, rng, samples)
        if not len(points):
            continue
        stored = out.read(ti.comp, fill_missing=True)[0]
        rel = points - np.array(tuple(ti.comp.offset))
        got = stored[:, rel[:, 0], rel[:, 1], rel[:, 2]].T  # (K, C)
        if out.dtype == "uint8":
            want = quantise(ref, "uint8", "verify", cfg.output.scale, cfg.output.offset)
            dev = np.abs(got.astype(np.int64) - want.astype(np.int64))
            tol = 1.0
        else:
            scale = max(scale, float(np.abs(ref).max()))
            dev, tol = np.abs(got.astype(np.float64) - ref), _float_tolerance(out.dtype, scale)
        k = int(np.argmax(dev.max(axis=1)))
        worst, n_vox = max(worst, float(dev.max())), n_vox + len(points)
        if dev.max() > tol:
            voxel = tuple(int(v) for v in points[k])
            record["recomputed"] = {"passed": False, "task": tid, "voxel_zyx": list(voxel), "tolerance": tol}
            _write(run, record)
            raise DataError(
                f"verify: task {tid}: the stored output at voxel {voxel} (z, y, x) is {got[k].tolist()} "
                f"but the network gives {np.round(ref[k], 6).tolist()} there (deviation {dev.max():.3g} > "
                f"{tol:.3g}); re-run task {tid} (`znni run-task RUN --task {tid}`)"
            )
    progress.close()
    record["recomputed"] = {
        "passed": True,
        "how": how,
        "tasks": chosen,
        "voxels": n_vox,
        "max_deviation": worst,
        "tolerance": 1.0 if out.dtype == "uint8" else _float_tolerance(out.dtype, scale),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    log(f"verify: {n_vox} voxel(s) in {len(chosen)} task(s) recomputed ({how}): max deviation {worst:.3g}")
    _write(run, record)
    return record


def _check_empty(ctx, tally: Tally, record: dict) -> dict:
    """The tally's sample of the chunks the manifests record ``empty`` (chosen uniformly with the
    recorded seed), each against the definition (:data:`~.report.EMPTY_DEFINITION`): its input
    context read again through the run's edge policy is all 0, and the stored chunk reads as 0.
    A :class:`DataError` naming the task and chunk when one is not (``record`` written first)."""
    # lazy: loads numba and scipy only when called
    from .task import empty_context, gather, read_task

    cfg, out = ctx.run.config, ctx.out
    result = {"chunks": tally.chunks["empty"], "checked": 0, "definition": EMPTY_DEFINITION}
    if not tally.empties:
        return result | {"passed": True}
    fill = cfg.input.missing == "zero"
    windows = {}  # a graph task's patch window (its read stage), once per task
    for tid, idx in sorted(tally.empties):
        name = out.chunk_name(idx)
        if ctx.net.kind == "chain":
            croi = empty_context(ctx.grid, ctx.region, ctx.halo, idx)
        else:
            if tid not in windows:
                ti = read_task(ctx, tid, log=lambda *a: None)
                windows[tid] = (ti.window, ti.extent, ti.block.read_roi)
            croi = empty_context(ctx.grid, ctx.region, ctx.halo, idx, *windows[tid])
        raw = gather(ctx.inp, croi, cfg.edge, fill)[0]
        why = None
        if raw.any():
            why = (
                f"its input context {croi} holds {int(np.count_nonzero(raw))} non-zero raw value(s): the input "
                "changed since the run, or the manifest is wrong"
            )
        else:
            box = ctx.grid.chunk_roi(idx).intersect(out.bounds)
            if out.read(box, fill_missing=True)[0].any():
                why = "it holds non-zero values"
        if why:
            result |= {"passed": False, "task": tid, "chunk": name, "error": why}
            record["empty"] = result
            _write(ctx.run, record)
            raise DataError(
                f"verify: task {tid}: chunk {name} is recorded empty (not computed, reads as 0) but {why}; "
                f"re-run task {tid} (`znni run-task RUN --task {tid}`)"
            )
        result["checked"] += 1
    return result | {"passed": True}


def _chain_sample(ctx, ti, x: np.ndarray, rng, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(voxels (K, 3), their output (K, C) from the definition): the task's corners and random
    voxels of its live chunks, each from its own field of view."""
    fov, low = Coordinate(ctx.net.field_of_view), ctx.halo.low
    live = [ctx.grid.chunk_roi(i).intersect(ti.comp) for i in ti.todo]
    points = [p for p in sample_voxels(ti.comp, samples + 8, rng) if any(r.contains(Roi(p, (1, 1, 1))) for r in live)]
    if not points:
        return np.zeros((0, 3), np.int64), np.zeros((0, ctx.net.out_channels))
    # lazy: loads numba and scipy only when called
    from .task import definition_tta

    origin = ti.block.read_roi.offset
    wins = np.stack([x[(slice(None),) + Roi(p - low - origin, fov).to_slices()] for p in points])
    ref = definition_tta(ctx.net, wins, ctx.run.config.tta)  # without augmentation: the plain forward pass
    return np.array([tuple(p) for p in points], np.int64), ref


def _write(run: Run, record: dict) -> Path:
    path = work_path(run) / "verify.json"
    atomic_write(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return path


def _float_tolerance(dtype: str, scale: float) -> float:
    """The deviation a stored float value may show from the recomputed one: the engine's
    tolerance relative to the output's scale, plus float16's rounding (2^-11 of it)."""
    tol = TOLERANCE * max(1.0, scale)
    return tol + (2.0**-11 * scale if dtype == "float16" else 0.0)
