"""A graph network's output recomputed without the run's choices: one of a task's patches, alone.

A U-Net's voxel has no small window of its own, so its check recomputes a whole patch of the
task, chosen at random, under a plan of direct convolutions only (no FFT, no Winograd, no tiling
of the patch, no neighbours) on the input the run's plan gave that patch, and compares every
voxel of its tile that no other patch blends into. ``znni verify`` does it in sampled tasks of a
finished run; a running task does it when ``verify_voxels`` allows (:func:`check_graph_task`).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import DataError, ZnniError
from ..geometry import Coordinate, Roi
from ..net.definition import TOLERANCE


def reference_plan(ctx):
    """(plan, what it is): the run's patch with every convolution direct (no FFT, no Winograd),
    on the CPU; the run's own plan where that one cannot be made (a primitive the network needs)."""
    # lazy: loads numba and scipy only when called
    from ..plan import autotune

    plan = ctx.plan
    try:
        ref = autotune(
            ctx.net,
            patch_shape=plan.patch_shape,
            primitives=("direct-gemm",),
            device="cpu",
            effort="estimate",
            threads=plan.threads,
            use_cache=False,
            overlap=plan.overlap,
            blend=plan.blend or "bump",
        )
        return ref, "direct convolutions, the patch alone"
    except ZnniError:
        return plan, "the run's plan, the patch alone"


def graph_sample(ctx, ti, x: np.ndarray, rng, ref_plan) -> tuple[np.ndarray, np.ndarray]:
    """(voxels (K, 3), their output (K, C)): one of the task's patches, chosen at random, computed
    alone by ``ref_plan``; the voxels of its tile inside the task's live chunks that no other
    patch of the lattice covers (a valid graph: the whole tile; a padded graph: not the blended
    margins, whose value mixes neighbours)."""
    # lazy: loads numba and scipy only when called
    from ..exec.executor import Executor
    from ..inference import thread_limits

    win, region = ti.window, ctx.region
    empty = np.zeros((0, 3), np.int64), np.zeros((0, ctx.net.out_channels))
    for _ in range(8):  # a patch whose own voxels meet the task's live chunks
        pick = [int(rng.integers(len(s))) for s in win.starts]
        start = tuple(s[i] for s, i in zip(win.starts, pick))
        lo, hi = list(start), [s + t for s, t in zip(start, win.tile)]
        if win.weights:  # padded: leave out what a neighbour also covers
            for a, (s, i) in enumerate(zip(win.starts, pick)):
                if i > 0:
                    lo[a] = max(lo[a], s[i - 1] + win.tile[a])
                if i + 1 < len(s):
                    hi[a] = min(hi[a], s[i + 1])
        if any(b <= a for a, b in zip(lo, hi)):
            continue
        box = Roi(region.offset + Coordinate(lo), Coordinate(hi) - Coordinate(lo)).intersect(ti.comp)
        mask = np.zeros(tuple(box.shape), bool) if not box.empty else None
        if mask is None:
            continue
        for i in ti.todo:
            r = ctx.grid.chunk_roi(i).intersect(box)
            if not r.empty:
                mask[r.to_slices(box.offset)] = True
        if not mask.any():
            continue
        src = (slice(None),) + tuple(slice(s - a, s - a + p) for s, a, p in zip(start, win.in_lo, win.patch))
        with thread_limits(ref_plan.threads), Executor(ref_plan, ctx.net) as ref:
            y = ref.patch(np.ascontiguousarray(x[src]))
        points = np.argwhere(mask) + np.array(tuple(box.offset))
        rel = points - (np.array(tuple(region.offset)) + np.array(start))
        return points, y[:, rel[:, 0], rel[:, 1], rel[:, 2]].T.astype(np.float64)
    return empty


def check_graph_task(ctx, ti, x: np.ndarray, y: np.ndarray, setting, share: float) -> dict:
    """The running task's check for a graph network: one patch recomputed alone
    (:func:`graph_sample`) against the task's output ``y`` (over its computed box), before
    anything is written; a :class:`DataError` on a deviation. ``setting`` (``verify_voxels``): a
    positive number checks one patch; ``auto`` checks one where the reference plan's predicted time
    is within ``share`` of the task's. Returns the record kept in the manifest."""
    t0 = time.perf_counter()
    if setting != "auto" and int(setting) <= 0:
        return {"voxels": 0}
    if getattr(ctx, "reference", None) is None:
        ctx.reference = reference_plan(ctx)
    ref_plan, how = ctx.reference
    task_s = ctx.plan.predicted_seconds * ti.window.count
    if setting == "auto" and ref_plan.predicted_seconds > share * task_s:
        return {
            "voxels": 0,
            "skipped": f"verify_voxels auto: a patch alone ({ref_plan.predicted_seconds:.2g} s) costs more than "
            f"{share:.0%} of the task ({task_s:.2g} s); `znni verify` checks graph runs after they finish",
        }
    rng = np.random.default_rng([int(ti.task_id), 20261128])
    points, ref = graph_sample(ctx, ti, x, rng, ref_plan)
    if not len(points):
        return {"voxels": 0}
    rel = points - np.array(tuple(ti.comp.offset))
    got = y[:, rel[:, 0], rel[:, 1], rel[:, 2]].T.astype(np.float64)
    record = judge(ti.task_id, points, got, ref, "the patch computed alone gives")
    return record | {"how": how, "seconds": round(time.perf_counter() - t0, 4)}


def judge(task_id, points, got: np.ndarray, ref: np.ndarray, gives: str) -> dict:
    """A running task's computed output ``got`` (K, C) at ``points`` against the recomputed
    ``ref``: the record for its manifest, or a :class:`DataError` naming the worst voxel (the task
    then writes nothing). Non-finite output is left to the store stage, which names its chunks.

    >>> judge(7, [(0, 0, 0)], np.array([[1.0]]), np.array([[1.00001]]), "the network gives")["voxels"]
    1
    """
    if not np.isfinite(got).all():  # the store stage refuses the task, naming its chunks (T20)
        return {"voxels": 0, "skipped": "non-finite output"}
    dev = np.abs(got - ref)
    tol = TOLERANCE * max(1.0, float(np.abs(ref).max()))
    if dev.max() > tol:
        k = int(np.argmax(dev.max(axis=1)))
        raise DataError(
            f"task {task_id}: the computed output at voxel {tuple(int(v) for v in points[k])} (z, y, x) is "
            f"{got[k].tolist()} but {gives} {np.round(ref[k], 6).tolist()} there (deviation {dev.max():.3g} > "
            f"{tol:.3g}); nothing was written for this task. Report this with the plan (plan.json)"
        )
    return {"voxels": len(points), "max_deviation": float(dev.max()), "tolerance": tol}
