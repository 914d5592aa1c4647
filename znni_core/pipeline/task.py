"""Execute one task: read its read-ROI, split into the plan's patches, run the engine, write whole
chunks atomically, read them back, then write the manifest (the only thing Snakemake sees).

::

    read_roi (input, halo derived from the network)
      -> gather (edge policy: valid | mirror | zero), normalise to float32
      -> the plan's patches over it (``exec/tiling``: each output tile computed from its input
         window, tile + F - 1 for a chain), engine per patch, assembled in place
      -> per chunk: finite? (else NonFiniteError, nothing written) -> encode -> atomic write
         -> read back + sha256 -> manifest
"""

from __future__ import annotations

import itertools
import os
import platform
import socket
import time
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

import numpy as np

from .. import load_network
from ..errors import DataError, InputError, NonFiniteError
from ..exec.tiling import Window, window
from ..geometry import Block, Coordinate, Roi
from ..inference import executor_for, run_limits
from ..io import open_input, open_output, parse_layer_url, read_manifest, store_chunks, write_manifest
from ..io.chunk_cache import ChunkCache, chunk_uses
from ..io.workdir import work_path
from ..layers.xp import require_device
from ..net.definition import DEFINITION_FLOPS, flops_per_voxel, plain_forward, sample_voxels
from ..plan.plan import Plan
from ..progress import bar as progress_bar
from .mask import live_chunks, open_mask
from .network_file import network_file
from .recompute import check_graph_task, judge
from .run import Run, load_run, output_spec, plan_path, run_geometry
from .settings import Tta

MANIFESTS_PER_DIR = 10_000  # manifests/<id // 10^4>/<id>.json: no directory of 10^5+ files at petascale


def manifest_path(run: Run, task_id: int, mip: int = 0) -> Path:
    """``manifests/NNNN/ID.json`` of an inference task; ``manifests/mipK/NNNN/ID.json`` of a pyramid's."""
    base = work_path(run) / "manifests"
    base = base / f"mip{mip}" if mip else base
    return base / f"{task_id // MANIFESTS_PER_DIR:04d}" / f"{task_id:06d}.json"


def _reflect(coords: np.ndarray, begin: int, end: int) -> np.ndarray:
    """numpy ``reflect`` (border voxel not repeated), any distance."""
    n = end - begin
    if n == 1:
        return np.full_like(coords, begin)
    period = 2 * (n - 1)
    t = np.mod(coords - begin, period)
    t = np.where(t >= n, period - t, t)
    return t + begin


def _mirror(bounds: Roi, read_roi: Roi) -> tuple[list, Roi]:
    """Per axis, the input coordinate each coordinate of ``read_roi`` reflects to, and their hull."""
    maps = [
        _reflect(np.arange(b, e), lo, hi)
        for b, e, lo, hi in zip(read_roi.begin, read_roi.end, bounds.begin, bounds.end)
    ]
    return maps, Roi.from_bounds([int(m.min()) for m in maps], [int(m.max()) + 1 for m in maps])


def read_box(bounds: Roi, read_roi: Roi, edge: str) -> Roi:
    """The box of the input a read of ``read_roi`` fetches under the edge policy: ``read_roi``
    inside the input; with ``zero`` its part inside; with ``mirror`` the hull of the voxels its
    reflections land on.  (``valid`` never reads outside: :func:`gather` refuses.)"""
    if bounds.contains(read_roi) or edge == "valid":
        return read_roi
    if edge == "zero":
        return read_roi.intersect(bounds)
    return _mirror(bounds, read_roi)[1]


def gather(inp, read_roi: Roi, edge: str, fill_missing: bool, versions: dict | None = None, reads: dict | None = None):
    """Raw input over ``read_roi`` (C, z, y, x) and a boolean 'inside the input' box for zero padding.

    Returns ``(raw, inner_slices, missing)``; ``inner_slices`` is None when every voxel came from
    the input.  ``inp``: an input layer, or a job's :class:`~znni_core.io.chunk_cache.ChunkCache`
    of one.  ``versions``: filled with ``{object: version}`` of the input objects read, taken
    *before* the read (an object replaced during the read then shows as changed, never the reverse).
    ``reads``: ``chunks`` and ``voxels`` fetched (whole chunks, as the reader fetches them) and
    ``reused`` chunks (served by the job's cache) added up.
    """
    bounds = inp.bounds
    cache = inp if isinstance(inp, ChunkCache) else ChunkCache(inp)

    def read(roi):
        return cache.read(roi, fill_missing=fill_missing, versions=versions, reads=reads)

    if bounds.contains(read_roi):
        raw, missing = read(read_roi)
        return raw, None, missing
    if edge == "valid":
        raise InputError(
            f"read {read_roi} leaves the input bounds {bounds} (edge=valid); this is a bug in "
            "task creation or the input layer changed since `znni validate`"
        )
    if edge == "zero":
        inner = read_roi.intersect(bounds)
        raw_in, missing = read(inner)
        raw = np.zeros((raw_in.shape[0],) + tuple(read_roi.shape), dtype=raw_in.dtype)
        sl = inner.to_slices(read_roi.offset)
        raw[(slice(None),) + sl] = raw_in
        return raw, sl, missing
    # mirror
    maps, hull = _mirror(bounds, read_roi)
    raw_h, missing = read(hull)
    raw = raw_h
    for axis, m in enumerate(maps):
        raw = np.take(raw, m - hull.offset[axis], axis=axis + 1)
    return np.ascontiguousarray(raw), None, missing


def normalise(raw: np.ndarray, scale: float, shift: float, inner=None) -> np.ndarray:
    """``raw * scale + shift`` as float32 (C, z, y, x); voxels outside the slices ``inner`` (z, y, x) are 0.0.

    An :class:`InputError` if the result holds NaN or Inf.
    """
    x = raw.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        x *= np.float32(scale)
        x += np.float32(shift)
    if not np.isfinite(x).all():
        raise InputError(
            f"the input becomes NaN/Inf after normalisation (normalize.scale={scale}, shift={shift}, "
            f"raw range [{raw.min()}, {raw.max()}]); fix normalize in the config"
        )
    if inner is not None:  # zero padding is 0.0 *after* normalisation
        keep = np.zeros(x.shape[1:], dtype=bool)
        keep[inner] = True
        x[:, ~keep] = 0.0
    return x


def tta_variants(tta: Tta | None) -> list[tuple[tuple[int, ...], bool]]:
    """``[(axes to flip, transpose y/x)]`` of ``tta`` (axes of a (C, z, y, x) array), the identity
    first: every subset of ``flips``, each with and without the transpose when ``transpose_xy``.

    >>> tta_variants(Tta(flips=["y", "x"], transpose_xy=False, variance=False))
    [((), False), ((3,), False), ((2,), False), ((2, 3), False)]
    """
    axes = [{"z": 1, "y": 2, "x": 3}[a] for a in (tta.flips if tta else [])]
    subsets = [
        tuple(sorted(a for a, on in zip(axes, pick) if on)) for pick in itertools.product((0, 1), repeat=len(axes))
    ]
    return [(f, t) for t in ((False, True) if tta and tta.transpose_xy else (False,)) for f in subsets]


def definition_tta(net, wins: np.ndarray, tta: Tta | None) -> np.ndarray:
    """What a run with ``tta`` stores at voxels whose fields of view are ``wins`` ``(K, C, *fov)``,
    from the network's definition (:func:`~znni_core.net.definition.plain_forward`, float64):
    ``(K, C_out)``, or with ``tta.variance`` ``(K, 2 C_out)``.  A variant's output at a voxel is
    the network on the voxel's window transformed as the variant transforms the input (the
    valid output of a flipped or transposed input is the flipped or transposed output), so each
    is one more plain forward pass over the transformed windows; mean and variance as
    :func:`compute` forms them.

    >>> from znni_core.net import Conv, Network
    >>> net = Network((Conv(np.arange(4, dtype=np.float32).reshape(1, 1, 1, 1, 4), None),))
    >>> w = np.arange(4, dtype=np.float32).reshape(1, 1, 1, 1, 4)
    >>> definition_tta(net, w, Tta(flips=["x"], transpose_xy=False, variance=True)).tolist()
    [[9.0, 25.0]]
    """
    ys = []
    for flips, transpose in tta_variants(tta):
        w = np.flip(wins, tuple(a + 1 for a in flips)) if flips else wins  # variant axes are of (C, z, y, x)
        ys.append(plain_forward(net, np.ascontiguousarray(w.swapaxes(3, 4) if transpose else w)))
    ys = np.stack(ys)
    mean = ys.mean(axis=0)
    if tta is None or not tta.variance:
        return mean
    return np.concatenate([mean, np.maximum((ys * ys).mean(axis=0) - mean * mean, 0.0)], axis=1)


def fit_window(x: np.ndarray, win: Window) -> np.ndarray:
    """``x`` padded at its end with its edge values up to what ``win``'s patches read: a chain task
    smaller than one patch (only outputs cropped away see them, as ``infer`` pads a small input)."""
    short = [(0, max(0, (b - a) - n)) for a, b, n in zip(win.in_lo, win.in_hi, x.shape[1:])]
    return np.pad(x, [(0, 0)] + short, mode="edge") if any(p for _, p in short) else x


def compute(run, x: np.ndarray, win: Window, tta: Tta | None = None, *, progress=None) -> np.ndarray:
    """The output over ``win`` from ``x`` (the input over the window's reach, :func:`fit_window`) by
    ``run`` (the job's :class:`~znni_core.exec.executor.Executor`), for chains and graphs alike;
    ``progress(1)`` after each patch.

    With ``tta``, the mean over its variants (:func:`tta_variants`): the network on each transformed
    input, its output transformed back (exact per variant; the mean in float64, stored as float32);
    with ``tta.variance`` the per-voxel variance across the variants follows as as many more
    channels.  A variant's window is the plan's tiles over its transformed box: a chain's voxels
    do not depend on where its patches start (a graph's do: its variants would need windows on
    the region's reflected lattice, so the run's settings refuse ``tta`` for graphs)."""
    variants = tta_variants(tta)
    variance = tta is not None and tta.variance
    if len(variants) == 1 and not variance:
        return run.window(fit_window(x, win), win, progress=progress)
    if run.net.kind != "chain":
        raise InputError("tta: test-time augmentation runs chain networks only; remove tta")
    acc = sq = None
    for flips, transpose in variants:
        xv, wv = (np.flip(x, flips) if flips else x), win
        if transpose:
            shape = tuple(b - a for a, b in zip(win.lo, win.hi))
            xv, wv = xv.swapaxes(2, 3), window(run.net, run.plan, (0, 0, 0), (shape[0], shape[2], shape[1]))
        y = run.window(fit_window(np.ascontiguousarray(xv), wv), wv, progress=progress)
        if transpose:
            y = y.swapaxes(2, 3)
        y = (np.flip(y, flips) if flips else y).astype(np.float64)
        acc, sq = (y, y * y) if acc is None else (acc + y, sq + y * y)
    mean = acc / len(variants)
    if not variance:
        return mean.astype(np.float32)
    var = np.maximum(sq / len(variants) - mean * mean, 0.0)
    return np.concatenate([mean, var]).astype(np.float32)


def task_window(net, plan, region: Roi, comp: Roi, halo) -> tuple[Window, Roi, Roi]:
    """``(window, read ROI, extent)`` of a task that computes the voxels ``comp``, for every kind of
    network: the patches it runs, the input it reads and where that input ends.

    Chain: the plan's tiles over the task's own box from its corner (a chain's voxel depends on its
    field of view only: any tiling gives the same values), reading the box grown by the halo;
    ``extent`` is that read.  Graph: the patches a run of ``infer`` over the whole region's input
    would use for these voxels (a graph's voxels depend on the patch lattice); ``extent`` is that
    whole input (the region grown by the halo): a padded network sees zeros beyond it, exactly as
    ``infer`` pads a volume; a valid one reads through the edge policy."""
    if net.kind == "chain":
        read = halo.read_roi(comp)
        return window(net, plan, (0, 0, 0), tuple(comp.shape)), read, read
    lo = tuple(comp.offset - region.offset)
    hi = tuple(Coordinate(lo) + comp.shape)
    win = window(net, plan, lo, hi, whole_out=tuple(region.shape))
    origin = region.offset - halo.low
    read = Roi(origin + Coordinate(win.in_lo), Coordinate(win.in_hi) - Coordinate(win.in_lo))
    extent = halo.read_roi(region) if net.kind == "padded" else read
    return win, read, extent


def quantise(y: np.ndarray, dtype: str, chunk_name: str, scale: float | None = None, offset: float = 0.0) -> np.ndarray:
    """``y`` as stored: float32 unchanged; float16 rounded to nearest, where a value beyond
    float16's range (65504) is a :class:`DataError` naming ``chunk_name``; uint8
    ``round(clip(y * scale + offset, 0, 255))`` with a ``scale``, else ``round(y * 255)`` of
    probabilities, where values outside [0, 1] (by more than 1e-6) are a :class:`DataError`.

    >>> quantise(np.array([-1.0, 0.25, 0.5, 9.0], np.float32), "uint8", "c", scale=100.0, offset=10.0)
    array([  0,  35,  60, 255], dtype=uint8)
    >>> quantise(np.array([0.1, 1.0 / 3.0], np.float32), "float16", "c")
    array([0.1   , 0.3333], dtype=float16)
    """
    if dtype == "float32":
        return np.ascontiguousarray(y, dtype=np.float32)
    if dtype == "float16":
        big = float(np.abs(y).max()) if y.size else 0.0
        if big > float(np.finfo(np.float16).max):
            raise DataError(
                f"chunk {chunk_name}: output dtype float16 holds values up to 65504, but the network gives "
                f"{big:.4g}; use output.dtype: float32 (no silent clipping)"
            )
        return np.ascontiguousarray(y, dtype=np.float16)
    if scale is not None:
        v = y.astype(np.float64) * float(scale) + float(offset)
        return np.rint(np.clip(v, 0.0, 255.0)).astype(np.uint8)
    lo, hi = float(y.min()), float(y.max())
    if lo < -1e-6 or hi > 1 + 1e-6:
        raise DataError(
            f"chunk {chunk_name}: output dtype uint8 stores probabilities in [0, 1], but the network "
            f"gives values in [{lo:.4g}, {hi:.4g}]; set output.scale (and output.offset) to map them to 0-255, "
            "or use output.dtype: float32 (no silent rescale)"
        )
    return np.rint(np.clip(y, 0.0, 1.0) * 255.0).astype(np.uint8)


@dataclass
class RunContext:
    """What every task of a run shares, opened and checked once per process (a job runs many tasks)."""

    run: Run
    region: Roi
    grid: object
    halo: object
    tasks: object  # TaskGrid
    out_url: object
    out: object
    net: object
    plan: object
    inp: object
    mask: object = None  # pipeline.mask.Mask, when the run has one
    reference: object = None  # a graph network's (plan, what it is) for its tasks' checks (pipeline.recompute)
    executors: dict = field(default_factory=dict)  # the plan's executor, kept for the job's next task


def open_run(run_file) -> RunContext:
    """Open a run's output layer, network, plan and input; DataError if any changed since validate."""
    run = load_run(run_file)
    cfg = run.config
    region, grid, halo, tasks = run_geometry(run)
    out_url = parse_layer_url(run.output.url, endpoint=cfg.output.endpoint_url)
    out = open_output(out_url, output_spec(run))  # T18: the layer must exist and match
    net = load_network(network_file(run.network.path, run.config.network.endpoint_url))
    if net.digest() != run.network.digest:
        raise DataError(
            f"network {run.network.path} changed since `znni validate` (digest mismatch); "
            "re-run the workflow from validate (delete the work_dir's run.json)"
        )
    plan = Plan.load(plan_path(run))
    if plan.digest() != run.plan.digest:
        raise DataError(f"plan {run.plan.path} changed since `znni validate`; re-run validate")
    in_url = parse_layer_url(run.input.url, endpoint=cfg.input.endpoint_url)
    # checksums the input carried at validate must still verify every read (a deleted index too)
    verified = run.input_checksums != "none"
    mode = "required" if verified else cfg.input.checksums
    inp = open_input(in_url, run.input.mip, resolution=cfg.input.resolution, checksums=mode)
    if inp.dtype != run.input.dtype or inp.bounds != Roi.from_dict(run.input.bounds):
        raise DataError(
            f"input {in_url} changed since `znni validate` (dtype {inp.dtype}, bounds {inp.bounds}); re-run validate"
        )
    mask = open_mask(cfg, inp.resolution) if run.mask else None
    return RunContext(run, region, grid, halo, tasks, out_url, out, net, plan, inp, mask)


@dataclass
class TaskInput:
    """A task after its read stage: what its compute and store stages need (``raw`` is dropped
    by the compute stage).  ``todo``: the chunks to compute; ``masked`` / ``empty``: recorded only."""

    task_id: int
    block: Block
    chunk_index: object  # Coordinate of a one-chunk re-run, else None
    comp: Roi  # the voxels computed
    live: list
    masked: set
    empty: set
    todo: list
    missing: list
    raw: object = None
    inner: object = None
    window: object = None  # the patches the task runs (:func:`task_window`)
    extent: object = None
    t0: float = 0.0
    t_read: float = 0.0
    recomputed: object = None  # the in-run check of sampled voxels (:func:`check_sample`), for the manifest
    versions: dict = None  # {input object: version} read (:func:`gather`), for the manifest
    reads: dict = None  # input chunks and their voxels read (:func:`gather`), for the manifest
    mask_filled: list = None  # the mask chunks read as 0 (mask.missing: zero), for the manifest
    mask_versions: dict = None  # {mask object: version} read, for the manifest


def run_task(
    run_file,
    task_id: int | None = None,
    *,
    chunk: str | None = None,
    device: str | None = None,
    show_progress: bool = True,
    log=print,
    ctx: RunContext | None = None,
) -> dict:
    """Run one task (or one chunk of it, computed with its whole task so the bytes equal a task run).

    Returns the manifest dict.  Writes the manifest only for a whole-task run; a ``chunk`` run updates the
    chunk's entry of an existing manifest.  ``ctx``: the run already opened (:func:`open_run`).
    The three stages (:func:`read_task`, :func:`compute_task`, :func:`store_task`) run one after
    the other here; a job overlaps them across its tasks (``jobs.run_pipelined``).
    """
    ctx = ctx or open_run(run_file)
    ti = read_task(ctx, task_id, chunk=chunk, log=log)
    y, t_comp = compute_task(ctx, ti, device=device, show_progress=show_progress)
    return store_task(ctx, ti, y, t_comp, device=device, log=log)


def empty_context(grid, region: Roi, halo, idx, window=None, extent=None, read_roi=None) -> Roi:
    """The input context of output chunk ``idx``, which ``input.empty: skip`` requires to be all 0
    in the raw input (read through the edge policy) for the chunk to be ``empty``: the chunk inside
    the region grown by the network's halo; for a graph network every patch of its task's
    ``window`` that reaches the chunk, inside ``extent`` and the task's ``read_roi``."""
    cin = grid.chunk_roi(idx).intersect(region)
    if window is None:
        return halo.read_roi(cin)
    reach = Coordinate(window.patch) - 1
    return cin.grow(reach, reach).intersect(extent).intersect(read_roi)


def input_box(ctx: RunContext, block: Block) -> Roi | None:
    """The box of the input :func:`read_task` fetches for ``block`` without a mask (with one, a
    part of it): its computed voxels grown by the halo (a graph network's patch window), under
    the edge policy; None when it computes nothing."""
    comp = block.write_roi.intersect(ctx.region)
    if comp.empty:
        return None
    _, read_roi, extent = task_window(ctx.net, ctx.plan, ctx.region, comp, ctx.halo)
    return read_box(ctx.inp.bounds, read_roi.intersect(extent), ctx.run.config.edge)


def job_cache(ctx: RunContext, blocks, spill_dir=None) -> ChunkCache:
    """A cache of the input chunks that more than one of ``blocks`` (a job's tasks) reads, within
    ``jobs.cache_gb`` (0: none)."""
    limit = ctx.run.config.jobs.cache_bytes
    if not limit:
        return ChunkCache(ctx.inp)
    uses = chunk_uses(ctx.inp.grid, (input_box(ctx, b) for b in blocks))
    return ChunkCache(ctx.inp, {k: v for k, v in uses.items() if v > 1}, limit_bytes=limit, spill_dir=spill_dir)


def read_task(
    ctx: RunContext, task_id: int | None, *, chunk: str | None = None, log=print, cache: ChunkCache | None = None
) -> TaskInput:
    """Stage 1: the task's block, mask, input (edge policy applied) and empty chunks."""
    t0 = time.perf_counter()
    run, region, grid, halo, tasks = ctx.run, ctx.region, ctx.grid, ctx.halo, ctx.tasks
    out, net, plan, inp = ctx.out, ctx.net, ctx.plan, ctx.inp
    cfg = run.config
    chunk_index = None
    if chunk is not None:
        chunk_index = _find_chunk(out, grid, chunk)
        task_id = tasks.owner(chunk_index).id
    try:
        block: Block = tasks.by_id(task_id)
    except ValueError:
        raise InputError(
            f"task {task_id} does not exist; this run has {len(tasks)} tasks, ids {tasks[0].id} to "
            f"{tasks[-1].id} (`znni tasks {work_path(run) / 'run.json'}` lists them)"
        ) from None
    if chunk_index is not None and out.sharded:
        log(
            f"chunk {out.chunk_name(chunk_index)} lies in shard {out.shard_name(chunk_index)}: a shard is written "
            f"whole, so task {task_id} runs whole"
        )
        chunk_index = None

    # ---- mask: chunks no non-zero mask voxel overlaps are recorded, not computed ---------------
    masked, mask_filled, mask_versions = set(), [], {}
    if ctx.mask is not None:
        masked = set(block.chunks) - live_chunks(ctx.mask, grid, region, block.chunks, mask_filled, mask_versions)
    live = [i for i in block.chunks if i not in masked]

    # ---- read -------------------------------------------------------------------------
    fill = cfg.input.missing == "zero"
    # the voxels computed: an aligned layer's first chunks start below the region (0 there); with a
    # mask, only the box of the live chunks
    comp = block.write_roi.intersect(region)
    if masked and live:
        comp = reduce(Roi.union, (grid.chunk_roi(i) for i in live)).intersect(region)
    win, extent, raw, inner, missing, versions, reads = None, None, None, None, [], {}, {"chunks": 0, "voxels": 0}
    if live:
        win, read_roi, extent = task_window(net, plan, region, comp, halo)
        block = Block(block.id, block.write_roi, read_roi, block.chunks)
        raw, inner, missing = gather(cache or inp, read_roi.intersect(extent), cfg.edge, fill, versions, reads)

    # ---- empty chunks (T26): all-zero input context is skipped and recorded ------------------------
    empty = set()
    if cfg.input.empty == "skip":
        # a chain's chunk depends on the chunk grown by the halo, a graph's on its window's patches
        reach = () if net.kind == "chain" else (win, extent, block.read_roi)
        for idx in live:
            croi = empty_context(grid, region, halo, idx, *reach)
            if not raw[(slice(None),) + croi.to_slices(block.read_roi.offset)].any():
                empty.add(idx)
    todo = [i for i in live if i not in empty and (chunk_index is None or i == chunk_index)]
    return TaskInput(
        block.id,
        block,
        chunk_index,
        comp,
        live,
        masked,
        empty,
        todo,
        missing,
        raw,
        inner,
        win,
        extent,
        t0,
        time.perf_counter() - t0,
        versions=versions,
        reads=reads,
        mask_filled=sorted(set(mask_filled)),
        mask_versions=mask_versions,
    )


#: ``verify_voxels: auto`` spends at most this share of a task's predicted time on its check
VERIFY_SHARE = 0.02


def verify_count(setting, net, plan, voxels: int) -> int:
    """Voxels a task of ``voxels`` output voxels recomputes: ``setting``, or with ``auto`` as many
    as :data:`VERIFY_SHARE` of its predicted time pays for (at most 64)."""
    if setting != "auto":
        return int(setting)
    rate = plan.predicted_voxels_per_s or 0.0
    per_voxel = flops_per_voxel(net) / DEFINITION_FLOPS
    if rate <= 0 or per_voxel <= 0:
        return 0
    return int(min(64, VERIFY_SHARE * voxels / rate / per_voxel))


def check_sample(ctx: RunContext, ti: TaskInput, x: np.ndarray, y: np.ndarray, setting="auto") -> dict:
    """Recompute voxels of the task's output (:func:`verify_count` of them: its corners, then
    random ones seeded by the task id) from the network's definition
    (:func:`znni_core.net.definition.plain_forward`) and compare with ``y``; a :class:`DataError`
    when one deviates by more than the tolerance (the task is then not marked done).  Returns the
    record kept in the manifest."""
    t0 = time.perf_counter()
    n = verify_count(setting, ctx.net, ctx.plan, int(np.prod(tuple(ti.comp.shape))))
    if n <= 0:
        return {
            "voxels": 0,
            "skipped": f"verify_voxels {setting}: no voxel within {VERIFY_SHARE:.0%} of the task's time",
        }
    comp, low, fov = ti.comp, ctx.halo.low, Coordinate(ctx.net.field_of_view)
    live = [ctx.grid.chunk_roi(i).intersect(comp) for i in ti.todo]
    rng = np.random.default_rng([int(ti.task_id), 20261128])
    points = [p for p in sample_voxels(comp, n, rng) if any(r.contains(Roi(p, (1, 1, 1))) for r in live)]
    if not points:
        return {"voxels": 0}
    got = np.stack([y[(slice(None),) + tuple(int(v) for v in p - comp.offset)] for p in points]).astype(np.float64)
    if not np.isfinite(got).all():  # the store stage refuses the task, naming its chunks (T20)
        return {"voxels": 0, "skipped": "non-finite output"}
    origin = ti.block.read_roi.offset
    wins = np.stack([x[(slice(None),) + Roi(p - low - origin, fov).to_slices()] for p in points])
    ref = definition_tta(ctx.net, wins, ctx.run.config.tta)  # without augmentation: the plain forward pass
    record = judge(ti.task_id, points, got, ref, "the network gives")
    return record | {"seconds": round(time.perf_counter() - t0, 4)}


def window_input(ti: TaskInput, x: np.ndarray) -> np.ndarray:
    """A task's normalised input ``x`` (its read inside ``ti.extent``) over the whole of what its
    read covers: a graph's patches beyond the region's input read zeros, as ``infer`` pads a
    volume (a chain's read is its extent: ``x`` as it is)."""
    block = ti.block
    inside = block.read_roi.intersect(ti.extent)
    if inside == block.read_roi:
        return x
    full = np.zeros((x.shape[0],) + tuple(block.read_roi.shape), np.float32)
    full[(slice(None),) + inside.to_slices(block.read_roi.offset)] = x
    return full


def check_task(ctx: RunContext, ti: TaskInput, x: np.ndarray, y: np.ndarray) -> dict:
    """The in-run check of a task's output, the one its network's kind allows
    (``verify_voxels``): a chain's sampled voxels against its definition (:func:`check_sample`:
    any voxel, alone), a graph's recomputed patch by a reference plan over the same lattice
    (:func:`~.recompute.check_graph_task`: a voxel depends on the patch computing it)."""
    setting = ctx.run.config.verify_voxels
    if ctx.net.kind == "chain":
        return check_sample(ctx, ti, x, y, setting)
    return check_graph_task(ctx, ti, x, y, setting, VERIFY_SHARE)


def compute_task(ctx: RunContext, ti: TaskInput, *, device: str | None = None, show_progress: bool = False) -> tuple:
    """Stage 2: ``(output of the task's write box or None, seconds)``; frees the task's input.  One
    path for every network: the input over the task's window (:func:`window_input`), its patches
    on the job's executor (test-time augmentation around them: :func:`compute`), then the check
    of the network's kind (:func:`check_task`)."""
    net, plan, cfg, block = ctx.net, ctx.plan, ctx.run.config, ti.block
    device = device or cfg.device
    comp, raw, inner, win = ti.comp, ti.raw, ti.inner, ti.window
    ti.raw = ti.inner = None
    t_comp = time.perf_counter()
    y = None
    if ti.todo:
        x = window_input(ti, normalise(raw, cfg.normalize.scale, cfg.normalize.shift, inner))
        del raw
        xp = require_device(device)
        run = executor_for(ctx.executors, plan, net, xp)
        bar = None
        if show_progress:
            bar = progress_bar(len(tta_variants(cfg.tta)) * win.count, f"task {ti.task_id} patches", "patch")
        with run_limits(plan, xp):
            y = compute(run, x, win, cfg.tta, progress=bar.update if bar is not None else None)
        if bar is not None:
            bar.close()
        ti.recomputed = check_task(ctx, ti, x, y)
        del x
    if y is not None and comp != block.write_roi:
        full = np.zeros((y.shape[0],) + tuple(block.write_roi.shape), y.dtype)
        full[(slice(None),) + comp.to_slices(block.write_roi.offset)] = y
        y = full
    return y, time.perf_counter() - t_comp


def encode_chunks(ctx: RunContext, ti: TaskInput, y) -> dict:
    """``{chunk index: stored values}`` of the task's chunks to write, each finite (else a
    :class:`NonFiniteError` naming the chunks, before anything is written) and in the output's
    dtype (:func:`quantise`)."""
    cfg, grid, out = ctx.run.config, ctx.grid, ctx.out
    encoded, bad = {}, []
    for idx in ti.todo:
        sl = grid.chunk_roi(idx).to_slices(ti.block.write_roi.offset)
        yc = y[(slice(None),) + sl]
        if not np.isfinite(yc).all():
            bad.append((out.chunk_name(idx), int((~np.isfinite(yc)).sum())))
            continue
        encoded[idx] = quantise(yc, out.dtype, out.chunk_name(idx), cfg.output.scale, cfg.output.offset)
    if bad:
        raise NonFiniteError(
            f"task {ti.task_id}: the network produced NaN/Inf in {len(bad)} chunk(s) "
            + ", ".join(f"{n} ({k} voxels)" for n, k in bad[:5])
            + "; nothing was written for this task. Check input normalisation (normalize.scale/shift) and the weights."
        )
    return encoded


def store_task(ctx: RunContext, ti: TaskInput, y, t_comp: float, *, device: str | None = None, log=print) -> dict:
    """Stage 3: check every chunk is finite (else nothing is written), write and verify the chunks
    (or the shard), then the manifest; returns it."""
    run, out, out_url, net, plan = ctx.run, ctx.out, ctx.out_url, ctx.net, ctx.plan
    cfg, block, task_id, chunk_index = run.config, ti.block, ti.task_id, ti.chunk_index
    device = device or cfg.device
    encoded = encode_chunks(ctx, ti, y)  # every chunk checked before anything is written (T20)

    # ---- write, verify -------------------------------------------------------------------------------
    t_write = time.perf_counter()
    skipped = {i: "masked" for i in ti.masked} | {i: "empty" for i in ti.empty}
    entries, shard = store_chunks(out, block.chunks, encoded, skipped, cfg.output.compression, only=chunk_index)
    t_write = time.perf_counter() - t_write
    total = time.perf_counter() - ti.t0

    mpath = manifest_path(run, task_id)
    voxels = int(np.prod(tuple(ti.comp.shape))) if ti.live else 0
    if chunk_index is not None:
        log(f"chunk {out.chunk_name(chunk_index)} (task {task_id}) rewritten and verified")
        if mpath.is_file():
            m = read_manifest(mpath)
            m["chunks"] = [entries[chunk_index] if c["index"] == list(chunk_index) else c for c in m["chunks"]]
            m.setdefault("reruns", []).append(
                {
                    "chunk": out.chunk_name(chunk_index),
                    "seconds": round(total, 3),
                    "host": socket.gethostname(),
                    "time": time.time(),
                }
            )
            write_manifest(mpath, m)
        return {"chunks": [entries[chunk_index]]}
    manifest = {
        "task": task_id,
        "run_digest": run.digest,
        "layer": str(out_url),
        "write_roi": block.write_roi.to_dict(),
        "read_roi": block.read_roi.to_dict(),
        "chunks": [entries[i] for i in block.chunks],
        **({"shard": shard} if shard is not None else {}),
        "plan_digest": plan.digest(),
        "network_digest": net.digest(),
        "missing_input_filled": ti.missing,
        **(
            {"missing_mask_filled": ti.mask_filled or [], "mask_versions": ti.mask_versions or {}}
            if ctx.mask is not None
            else {}
        ),
        "input_versions": ti.versions or {},
        # the input chunks this task's read fetched and their voxels (whole chunks)
        "input_read": ti.reads or {"chunks": 0, "voxels": 0},
        **({"recomputed": ti.recomputed} if ti.recomputed else {}),
        "versions": run.versions | {"python": platform.python_version()},
        "device": device,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        **({"slurm_job": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}),
        "voxels": voxels,
        # total: from the start of the read to the manifest (a pipelined job overlaps the stages of
        # neighbouring tasks, so its tasks' totals add up to more than the job's wall time)
        "timings": {
            "read_s": round(ti.t_read, 4),
            "compute_s": round(t_comp, 4),
            "write_verify_s": round(t_write, 4),
            "total_s": round(total, 4),
        },
        "finished": time.time(),
    }
    write_manifest(mpath, manifest)
    n_empty = sum(1 for e in entries.values() if e["status"] == "empty")
    log(
        f"task {task_id}: {len(entries) - n_empty - len(ti.masked)} chunk(s) written and verified, {n_empty} empty, "
        + (f"{len(ti.masked)} masked, " if ti.masked else "")
        + f"{voxels:,} voxels in {total:.2f} s ({voxels / max(total, 1e-9):,.0f} voxels/s) -> {mpath}"
    )
    return manifest


def _find_chunk(out, grid, chunk: str):
    """A chunk given as its name (``x0-x1_y0-y1_z0-z1``, with or without the scale key) or ``z,y,x`` index."""
    s = chunk.strip().split("/")[-1]
    if "_" in s and "-" in s:
        for idx in grid.chunks_in(grid.bounds):
            if out.chunk_name(idx).split("/")[-1] == s:
                return idx
        raise InputError(
            f"chunk {chunk!r} is not a chunk of the output grid (names look like "
            f"{out.chunk_name(Coordinate(0, 0, 0)).split('/')[-1]})"
        )
    try:
        idx = Coordinate(int(v) for v in s.split(","))
        grid.chunk_roi(idx)
    except (ValueError, IndexError):
        raise InputError(
            f"chunk {chunk!r}: give a chunk name x0-x1_y0-y1_z0-z1 or an index z,y,x within {tuple(grid.grid_shape)}"
        ) from None
    return idx


def task_list(run: Run) -> list[dict]:
    """Every task of the run in order, as :meth:`~znni_core.geometry.Block.to_dict` data."""
    _, _, _, tasks = run_geometry(run)
    return [b.to_dict() for b in tasks]
