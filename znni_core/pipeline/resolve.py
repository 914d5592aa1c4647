"""Resolving a configuration: the checks that need the network and the data, and the run.

:mod:`.settings` checks a config's *form* (schema, defaults filled in) and types it as a
:class:`~.settings.Config`; :func:`resolve` opens the network and the layers and refuses, before
anything is scheduled, every run that cannot succeed (docs/reliability.md, T21-T24, T26, T27): it
returns the :class:`~.run.Run` every later step reads.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import load_network
from ..errors import ConfigError, DataError, InputError, PlanError
from ..exec.tiling import window
from ..geometry import EDGE_POLICIES, ChunkGrid, Coordinate, Halo, Roi, TaskGrid, output_bounds
from ..geometry.grid import choose_task_chunks
from ..io import ScaleSpec, open_input, parse_layer_url
from ..io.layers import check_writable, layer_differences
from ..io.mips import layer_info, mip_specs
from ..io.sharding import auto_sharding, check_sharding, shard_chunks
from ..io.workdir import is_remote_work, parse_work_dir, work_endpoint, work_path
from ..io.zarr_output import zarr_sharding
from ..units import parse_bytes
from ..version import __version__
from .identity import digest as run_digest
from .identity import identity
from .mask import check_mask, open_mask
from .network_file import is_remote_network, network_file
from .run import RUN_FORMAT, Run
from .settings import Config, OutputSettings, Tta, parse_config


def versions() -> dict:
    """The versions that shape the output (from metadata: importing cloud-volume, dask and zarr
    to read them cost validate about 1 s)."""
    # lazy: loads numba and scipy only when called
    from ..plan.wisdom import dist_version

    return {"znni": __version__, "numpy": np.__version__} | {
        d: dist_version(d) for d in ("cloud-volume", "dask", "zarr")
    }


def _roi_doc(r: Roi) -> str:
    return f"offset {tuple(r.offset)} shape {tuple(r.shape)} (z, y, x)"


def task_bytes(write_shape, halo: Halo, c_in: int, c_out: int, in_itemsize: int, out_itemsize: int) -> int:
    """Host memory of one task besides the engine: raw + float32 input, float32 output, encoded output."""
    read = int(np.prod(tuple(Coordinate(write_shape) + halo.low + halo.high)))
    write = int(np.prod(tuple(write_shape)))
    return read * c_in * (in_itemsize + 4) + write * c_out * (4 + out_itemsize) * 2


def stored_channels(cfg: Config, net) -> int:
    """Channels of the output layer: the network's, then (``tta.variance``) their variances across
    the test-time augmentation's variants."""
    return net.out_channels * (2 if cfg.tta.variance else 1)


def net_halo(net) -> Halo:
    """The context a network needs around its output (its geometry's halo)."""
    return Halo(*net.halo)


class Layout(NamedTuple):
    """Where a run writes: the region, the output layer's bounds, its sharding, the task size
    and the chunk grid (from the config, the network and the input's bounds alone)."""

    region: Roi
    bounds: Roi
    sharding: dict | None
    task_chunks: Coordinate
    grid: ChunkGrid
    box: Coordinate  # config's task_chunks, ``auto`` resolved (a sharded layer's tasks are its shards)
    shard_bytes: int = 2**30  # output.shard_bytes, ``auto`` resolved
    note: str = ""  # what ``auto`` chose and why, for the user


# the infer_job rule's default mem_mb: an ``auto`` task's buffers stay within half of what the
# plan's budget (plan.memory_fraction) leaves of it
JOB_MEM_MB = 2000
# an ``auto`` task writes at most this many voxels: minutes of compute, the unit a retry redoes
AUTO_TASK_VOXELS = 1 << 26


def auto_task_chunks(cfg: Config, net, inp, halo: Halo, region: Roi, grid: ChunkGrid, slots: int | None) -> Coordinate:
    """``task_chunks: auto``: the box that finishes the region soonest on ``slots`` jobs (default:
    this machine's CPUs), within a job's memory (``choose_task_chunks``)."""
    cap = (1 - cfg.plan.memory_fraction) * JOB_MEM_MB * 2**20 / 2
    in_size, out_size = np.dtype(inp.dtype).itemsize, np.dtype(cfg.output.dtype).itemsize

    def fits(write_shape):
        return task_bytes(write_shape, halo, net.in_channels, stored_channels(cfg, net), in_size, out_size) <= cap

    return choose_task_chunks(grid, region, halo, slots or os.cpu_count() or 1, max_voxels=AUTO_TASK_VOXELS, fits=fits)


def layout(cfg: Config, net, inp, halo: Halo, where: str, slots: int | None = None) -> Layout:
    """The run's geometry, with the region checks (T22); cheap: no plan, no data read."""
    # T22: region vs what the input can produce
    edge = cfg.edge
    assert edge in EDGE_POLICIES
    try:
        producible = output_bounds(inp.bounds, halo, edge)
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None
    if cfg.region is None:
        region = producible
    else:
        region = Roi(cfg.region.offset, cfg.region.shape)
        if not producible.contains(region):
            why = (
                "the region grown by the network's halo " + f"low {tuple(halo.low)} high {tuple(halo.high)}"
                if edge == "valid"
                else "the region"
            )
            raise InputError(
                f"region {_roi_doc(region)} is not covered by {where}: {why} must lie inside the "
                f"input bounds {_roi_doc(inp.bounds)}; the largest possible region under edge={edge} is "
                f"{_roi_doc(producible)} (or use edge: mirror / zero)"
            )
    if net.kind == "valid" and edge == "valid" and cfg.region is None:
        # a valid graph network tiles on its grid: the default region is cut to an admissible input
        # (its last few voxels per axis, fewer than the grid, would need input beyond the bounds)
        use = net.floor_admissible(tuple(region.shape + Coordinate(net.context)))
        if not all(use):
            raise InputError(
                f"{where}: the input {_roi_doc(inp.bounds)} is smaller than the smallest admissible input "
                f"{net.geometry.n_min} of the network (edge=valid); use edge: mirror / zero"
            )
        region = Roi(region.offset, Coordinate(use) - Coordinate(net.context))
    if edge == "mirror" and not inp.bounds.shape.all_ge(halo.high + 1):
        raise InputError(
            f"{where}: edge=mirror needs the input to be larger than the halo {tuple(halo.high)} on "
            f"every axis; it is {tuple(inp.bounds.shape)}"
        )

    layer_bounds = aligned_bounds(region, cfg.output.chunk_size) if cfg.output.align else region
    grid = ChunkGrid(layer_bounds, Coordinate(cfg.output.chunk_size))
    ou = parse_layer_url(cfg.output.path, endpoint=cfg.output.endpoint_url, what="output.path")
    box = (
        auto_task_chunks(cfg, net, inp, halo, region, grid, slots)
        if cfg.task_chunks == "auto"
        else Coordinate(cfg.task_chunks)
    )
    if ou.format == "zarr":  # a zarr output is always sharded: a shard is a task's box of chunks
        if cfg.output.sharding not in ("auto", "sharded"):
            raise ConfigError(
                f"output.sharding {cfg.output.sharding!r}: a zarr output ({ou}) is always "
                "sharded, one shard per task (task_chunks); use auto, or a precomputed output"
            )
        return Layout(region, layer_bounds, zarr_sharding(box, cfg.output.compression), box, grid, box)
    shard_bytes, note = cfg.output.shard_bytes, ""
    if shard_bytes == "auto":
        shard_bytes, note = auto_shard_bytes(cfg, net, inp, halo, layer_bounds, grid)
    sharding = output_sharding(
        dataclasses.replace(cfg.output, shard_bytes=shard_bytes), layer_bounds, stored_channels(cfg, net)
    )
    # a task writes whole shards: with sharding, a task is one shard's box of chunks
    tc = shard_chunks(sharding, grid.grid_shape) if sharding else box
    return Layout(region, layer_bounds, sharding, tc, grid, box, shard_bytes, note if sharding else "")


#: ``output.shard_bytes: auto`` starts here and halves until a task (one shard) fits a job
MAX_AUTO_SHARD_BYTES = 2**30


def auto_shard_bytes(cfg: Config, net, inp, halo: Halo, bounds: Roi, grid: ChunkGrid) -> tuple[int, str]:
    """``output.shard_bytes: auto``: the largest shard size (at most
    :data:`MAX_AUTO_SHARD_BYTES`, halving) whose task, one shard with its input and output held
    in memory (:func:`task_bytes`), fits what the plan leaves of an infer job of
    :data:`JOB_MEM_MB` (``1 - plan.memory_fraction`` of it, 10% kept free); ``(bytes, note)``."""
    cap = 0.9 * (1 - cfg.plan.memory_fraction) * JOB_MEM_MB * 2**20
    in_size, out_size = np.dtype(inp.dtype).itemsize, np.dtype(cfg.output.dtype).itemsize
    chunk_bytes = int(np.prod(tuple(grid.chunk_shape))) * stored_channels(cfg, net) * out_size
    size = MAX_AUTO_SHARD_BYTES
    while True:
        spec = output_sharding(
            dataclasses.replace(cfg.output, shard_bytes=size, sharding="sharded"), bounds, stored_channels(cfg, net)
        )
        write = (shard_chunks(spec, grid.grid_shape) * grid.chunk_shape).min(bounds.shape)
        need = task_bytes(write, halo, net.in_channels, stored_channels(cfg, net), in_size, out_size)
        if need <= cap or size // 2 < chunk_bytes:
            break
        size //= 2
    note = (
        f"output.shard_bytes auto: shards of about {size / 2**20:.0f} MiB (a task is one shard: "
        f"{need / 2**20:.0f} MiB of input and output, within an infer job of {JOB_MEM_MB} MB with "
        f"plan.memory_fraction {cfg.plan.memory_fraction:g}); set output.shard_bytes for larger jobs"
    )
    return size, note


def resolve(
    cfg: dict | Config, *, mem_mb: int | None = None, threads: int | None = None, plan_out=None, progress=print
):
    """All checks that need the network and the layers; autotune or load the plan; return the run.

    Nothing is written to the output layer here.  ``mem_mb`` is the memory of one infer job (the
    plan's budget is ``plan.memory_fraction`` of it).
    """
    cfg = parse_config(cfg)
    if cfg.output.scale is not None and cfg.output.dtype != "uint8":
        raise ConfigError(
            f"output.scale {cfg.output.scale} maps values to uint8; it has no meaning with output.dtype "
            f"{cfg.output.dtype}: set output.dtype: uint8 or remove output.scale"
        )
    _check_destinations(cfg)
    net_path = network_file(cfg.network)
    net_path = net_path if is_remote_network(cfg.network.path) else net_path.resolve()
    net = load_network(net_path)  # T19: NaN/Inf weights refused here
    halo = net_halo(net)
    _check_tta(cfg.tta, net, net_path, halo)
    iu, inp, where = _checked_input(cfg, net, net_path)
    lay = layout(cfg, net, inp, halo, where)
    cfg = dataclasses.replace(cfg, task_chunks=list(lay.box))  # the run records the box ``auto`` chose
    mask = open_mask(cfg, inp.resolution)
    if mask is not None:
        check_mask(mask, lay.region)
    ou, specs = _checked_output(cfg, lay, inp, iu, net)
    task_shape = (lay.task_chunks * specs[0].chunk_shape).min(lay.region.shape)
    budget = _engine_budget(cfg, mem_mb, lay, halo, net, inp, specs[0], task_shape)
    plan = _the_plan(cfg, net, budget, threads, task_shape, lay.region)
    if net.kind == "valid" and cfg.edge == "valid":
        _check_valid_graph_read(net, plan, lay.region, halo, inp)
    tasks = TaskGrid(lay.grid, lay.task_chunks, halo, lay.region)
    if not len(tasks):
        raise ConfigError(f"the region {_roi_doc(lay.region)} holds no output voxel")
    run = _run_record(cfg, net, net_path, halo, iu, inp, ou, specs, lay, mask, len(tasks), plan, plan_out, mem_mb)
    _describe(progress, run, net_path, halo, inp, ou, specs[0], lay, mask, len(tasks))
    return run, plan


def _check_tta(tta: Tta, net, net_path: Path, halo: Halo) -> None:
    """Test-time augmentation runs chain networks, and transposes only where the halo allows it."""
    if tta.on and net.kind != "chain":
        raise ConfigError(
            f"tta {dataclasses.asdict(tta)}: test-time augmentation runs chain networks only ({net_path.name} is a graph network); "
            "remove tta"
        )
    if tta.transpose_xy and (halo.low[1] != halo.low[2] or halo.high[1] != halo.high[2]):
        raise ConfigError(
            f"tta.transpose_xy: the network's halo differs on y and x (low {tuple(halo.low)}, high "
            f"{tuple(halo.high)}), so its output on the transposed input does not line up; use flips only"
        )


def _check_destinations(cfg: Config) -> None:
    """What znni writes must be writable: the output not on http(s):// (read-only), the work
    directory a local path or an s3:// or gs:// prefix, refused before anything is read."""
    check_writable(
        parse_layer_url(cfg.output.path, endpoint=cfg.output.endpoint_url, what="output.path"), "output.path"
    )
    if is_remote_work(cfg.work_dir):
        parse_work_dir(cfg.work_dir, work_endpoint(cfg))  # s3:// or gs:// (docs/cloud.md)
    elif cfg.work_endpoint_url:
        raise ConfigError(
            f"work_endpoint_url {cfg.work_endpoint_url!r} is set but work_dir {cfg.work_dir!r} is a local "
            "directory; remove work_endpoint_url, or give an s3:// work_dir"
        )


def _checked_input(cfg: Config, net, net_path: Path):
    """(URL, layer, how messages name it) of the input, checked against the config and the network
    (T21 dtype, T27 channels, T23 resolution)."""
    iu = parse_layer_url(cfg.input.path, endpoint=cfg.input.endpoint_url, what="input.path")
    inp = open_input(iu, cfg.input.mip, resolution=cfg.input.resolution, checksums=cfg.input.checksums)
    where = f"input {iu} mip {cfg.input.mip}"
    if inp.dtype != cfg.input.dtype:
        raise InputError(
            f"{where} holds {inp.dtype} but input.dtype says {cfg.input.dtype}: znni never "
            "rescales silently; fix input.dtype and normalize.scale/shift together"
        )
    if inp.channels != net.in_channels:
        raise InputError(
            f"{where} has {inp.channels} channel(s) but the network {net_path.name} expects "
            f"{net.in_channels}; pick the matching layer or network"
        )
    net_res = cfg.network.resolution or net.metadata.get("resolution")
    if net_res is not None and not np.allclose(tuple(net_res), inp.resolution, rtol=1e-3):
        raise InputError(
            f"{where} has resolution {inp.resolution} nm (z, y, x) but the network was trained at "
            f"{tuple(float(v) for v in net_res)} nm; choose the input mip with that resolution"
        )
    return iu, inp, where


def _checked_output(cfg: Config, lay: Layout, inp, iu, net):
    """(URL, scales) of the output layer (bounds = region, the input's resolution), checked: its
    format takes the dtype, it is not the input, and an existing layer matches (T21, T22, T24)."""
    ou = parse_layer_url(cfg.output.path, endpoint=cfg.output.endpoint_url, what="output.path")
    if cfg.output.dtype == "float16" and ou.format != "zarr":
        raise ConfigError(
            f"output.dtype float16: a Neuroglancer precomputed layer ({ou}) has no float16 (its types are "
            "uint8-uint64, int8-int64 and float32); write a zarr output (output.path ending .zarr) or use "
            "output.dtype: uint8 with output.scale / offset"
        )
    if cfg.output.compression == "gzip" and ou.is_local and not lay.sharding:
        raise ConfigError(
            "output.compression: gzip on a file:// layer names chunks *.gz; tensorstore and other "
            "readers then see zeros without an error (docs/pitfalls.md). Use compression: none locally."
        )
    if ou.is_local and iu.is_local and ou.local_path == iu.local_path:
        raise ConfigError(f"output.path {ou} is the input layer; choose another directory")
    specs = output_scales(cfg, lay, inp.resolution, stored_channels(cfg, net))
    diffs = layer_differences(ou, specs)
    if diffs:
        raise DataError(
            f"output layer {ou} exists and does not match this config:\n  - "
            + "\n  - ".join(diffs)
            + "\nChoose a new output.path, or delete the layer if it is yours to replace."
        )
    return ou, specs


def _engine_budget(cfg: Config, mem_mb, lay: Layout, halo: Halo, net, inp, out_spec, task_shape) -> int | None:
    """The plan's memory budget: ``plan.memory_fraction`` of the infer job's ``mem_mb``, refused when
    a task's input and output do not fit beside it (T24); on a GPU, ``plan.gpu_memory``."""
    budget = None
    if mem_mb is not None:
        budget = _host_budget(cfg, mem_mb, lay, halo, net, inp, out_spec, task_shape)
    if cfg.device != "cpu":  # mem_mb is the job's host RAM; the plan's budget is the device's memory
        try:
            budget = parse_bytes(cfg.plan.gpu_memory) if cfg.plan.gpu_memory else None
        except ValueError as exc:
            raise ConfigError(f"plan.gpu_memory: {exc}") from None
    return budget


def _host_budget(cfg: Config, mem_mb: int, lay: Layout, halo: Halo, net, inp, out_spec, task_shape) -> int:
    """``plan.memory_fraction`` of ``mem_mb``, refused when a task's input and output do not fit beside it."""
    extra = task_bytes(
        task_shape,
        halo,
        net.in_channels,
        stored_channels(cfg, net),
        np.dtype(inp.dtype).itemsize,
        np.dtype(out_spec.dtype).itemsize,
    )
    budget = int(mem_mb * 2**20 * cfg.plan.memory_fraction)
    if extra + budget > mem_mb * 2**20:
        raise PlanError(
            f"a task of {tuple(lay.task_chunks)} chunks of {tuple(out_spec.chunk_shape)} needs {extra / 2**20:.0f} MiB "
            f"for its input and output plus the engine's {budget / 2**20:.0f} MiB, more than the infer "
            f"job's mem_mb={mem_mb}; lower "
            + ("output.shard_bytes (a task is one shard)" if lay.sharding else "task_chunks")
            + " or output.chunk_size, or raise mem_mb"
        )
    return budget


def _the_plan(cfg: Config, net, budget, threads, task_shape, region):
    """The run's plan (once; every task reuses it): ``plan.file``, checked, or autotuned."""
    # lazy: loads numba and scipy only when called
    from ..plan.plan import Plan

    if not cfg.plan.file:
        return task_plan(net, cfg, budget, threads, task_shape, region)
    plan = Plan.load(cfg.plan.file)
    if plan.network_digest != net.digest():
        raise PlanError(f"plan.file {cfg.plan.file} was made for another network; re-run `znni plan`")
    if plan.device != cfg.device:
        raise PlanError(f"plan.file is for device {plan.device!r}, the config asks {cfg.device!r}")
    return plan


def _check_valid_graph_read(net, plan, region: Roi, halo: Halo, inp) -> None:
    """A valid graph tiles on its grid: with ``edge: valid`` every patch must read inside the input."""
    win = window(net, plan, (0, 0, 0), tuple(region.shape))
    read = Roi(region.offset - halo.low + Coordinate(win.in_lo), Coordinate(win.in_hi) - Coordinate(win.in_lo))
    if not inp.bounds.contains(read):
        raise InputError(
            f"region {_roi_doc(region)}: the valid graph network tiles on its grid {net.grid} and needs input "
            f"{_roi_doc(read)}, which leaves the input bounds {_roi_doc(inp.bounds)} (edge=valid). Shrink the "
            f"region so that its shape + {net.context} is admissible (n_min {net.geometry.n_min} + k * "
            f"{net.grid}), or use edge: mirror / zero"
        )


def _run_record(cfg, net, net_path, halo, iu, inp, ou, specs, lay, mask, num_tasks, plan, plan_out, mem_mb) -> Run:
    """The run (``run.json``): what every later step reads, with its digest."""
    work = work_path(cfg)
    work = work if is_remote_work(work) else work.resolve()
    plan_path = Path(plan_out) if plan_out else work / "plan.json"
    doc = {
        "format": RUN_FORMAT,
        "config": cfg.to_dict(),
        "work_dir": str(work),
        "network": {
            "path": cfg.network.path if is_remote_network(cfg.network.path) else str(net_path),
            "digest": net.digest(),
            "field_of_view": list(net.field_of_view),
            "kind": net.kind,
            "halo": {"low": list(halo.low), "high": list(halo.high)},
            "in_channels": net.in_channels,
            "out_channels": net.out_channels,
        },
        "input": {
            "url": str(iu),
            "mip": cfg.input.mip,
            "bounds": inp.bounds.to_dict(),
            "resolution": list(inp.resolution),
            "dtype": inp.dtype,
            "channels": inp.channels,
        },
        "input_checksums": inp.checksums,  # what verifies every read: sha256 | crc32c | none
        "output": {"url": str(ou), "scale": specs[0].to_scale(), "info": layer_info(specs)},
        "region": lay.region.to_dict(),
        "mask": None
        if mask is None
        else {
            "url": str(mask.url),
            "mip": mask.mip,
            "bounds": mask.layer.bounds.to_dict(),
            "resolution": list(mask.layer.resolution),
        },
        "task_chunks": list(lay.task_chunks),
        "num_tasks": num_tasks,
        "num_chunks": lay.grid.num_chunks,
        "plan": {
            "path": str(plan_path),
            "digest": plan.digest(),
            "patch_shape": list(plan.patch_shape),
            "memory_budget": plan.memory_budget,
        },
        "mem_mb": mem_mb,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
    }
    info = doc["output"]["info"]
    doc["identity"] = identity(
        cfg,
        doc["network"]["digest"],
        doc["plan"]["digest"],
        doc["input"],
        # mip 0's scale: a pyramid's mips are made from it (their tasks pin what they averaged), so
        # adding mips to a finished run is no change of its output
        {"url": doc["output"]["url"], "info": info | {"scales": info["scales"][:1]}, "region": doc["region"]},
    )
    doc["digest"] = run_digest(doc["identity"])
    return Run.from_json(doc, "the resolved run")


def _describe(progress, run, net_path, halo, inp, ou, out_spec, lay, mask, num_tasks) -> None:
    """What ``validate`` tells the user about the run it resolved."""
    fov = tuple(run.network.field_of_view)
    progress(f"network {net_path.name}: field of view {fov}, halo low {tuple(halo.low)} high {tuple(halo.high)}")
    progress(f"input {run.input.url}: {_roi_doc(inp.bounds)}, {inp.dtype}, {inp.channels} ch, {inp.resolution} nm")
    off = getattr(inp, "offset_remainder", None)  # an OME-Zarr translation off the voxel grid
    if off and any(abs(v) > 1e-3 for v in off):
        progress(
            f"input: its OME-Zarr translation lies {tuple(off)} voxels (z, y, x) off the voxel grid; znni places the "
            f"input at the nearest voxel {tuple(inp.bounds.offset)} (a downsampled level's centred voxels do this), "
            "and the output on that grid"
        )
    progress(
        f"output {ou}: {_roi_doc(lay.region)}, chunks {tuple(out_spec.chunk_shape)}, {out_spec.dtype}; "
        f"{lay.grid.num_chunks} chunks in {num_tasks} tasks of up to {tuple(lay.task_chunks)} chunks"
    )
    if lay.note:
        progress(lay.note)
    if mask is not None:
        progress(
            f"mask {mask.url} mip {mask.mip}: {_roi_doc(mask.layer.bounds)} at {tuple(mask.layer.resolution)} nm; "
            "only chunks it overlaps with non-zero voxels are computed (`znni mask-tasks` lists the tasks)"
        )


def task_plan(net, cfg, budget, threads, task_shape, region):
    """The autotuned plan every task of a run uses (``plan.file`` aside): for a chain network the
    autotuner's choice for a task's read (rounded up to the pooling product): one patch of it, or
    smaller patches where they run the task faster (a net flat in z: thinner patches in MPF beat
    one patch in depth-first pooling under a job's budget, 4.2 s against 7.8 s for 15 x 512^2 on
    2 threads at 1 GiB); for a graph network :func:`_graph_plan`."""
    # lazy: loads numba and scipy only when called
    from ..plan import autotune

    if net.kind != "chain":
        return _graph_plan(net, cfg, budget, threads, task_shape, region)
    d = Coordinate(net.pooling_product)
    task_patch = tuple(Coordinate(task_shape).ceil_div(d) * d + Coordinate(net.field_of_view) - 1)
    return autotune(
        net,
        input_shape=task_patch,
        memory_budget=budget,
        device=cfg.device,
        effort=cfg.plan.effort,
        threads=threads,
    )


def _graph_plan(net, cfg, budget, threads, task_shape, region):
    """A graph network's plan: patches no larger than a task's read; a padded graph's default
    overlap is a quarter of the patch wherever one patch does not cover the whole region."""
    # lazy: loads numba and scipy only when called
    from ..plan import autotune
    from ..plan.graph import default_overlap

    b = cfg.blend
    kw = dict(memory_budget=budget, device=cfg.device, effort=cfg.plan.effort, threads=threads, blend=b.mode)
    read = tuple(int(t) + c for t, c in zip(task_shape, net.context))
    plan = autotune(net, input_shape=read, patch_shape=b.patch_shape, overlap=b.overlap, **kw)
    if net.kind == "padded" and b.overlap is None:
        whole = tuple(int(r) + c for r, c in zip(region.shape, net.context))
        overlap = default_overlap(net, plan.patch_shape, whole)
        if overlap != plan.overlap:
            plan = autotune(net, input_shape=read, patch_shape=plan.patch_shape, overlap=overlap, **kw)
    return plan


AUTO_SHARD_CHUNKS = 10_000  # output.sharding: auto shards a layer of more chunks than this


def output_sharding(out: OutputSettings, bounds: Roi, channels: int) -> dict | None:
    """The output's sharding spec (None: a file per chunk) from ``output.sharding``."""
    mode = out.sharding
    grid = bounds.shape.ceil_div(Coordinate(out.chunk_size))
    if isinstance(mode, dict):
        return check_sharding(mode, "output.sharding", grid)
    chunks = grid.prod()
    if mode == "none" or (mode == "auto" and chunks <= AUTO_SHARD_CHUNKS):
        return None
    spec = auto_sharding(
        bounds.shape,
        out.chunk_size,
        out.dtype,
        channels,
        out.shard_bytes,
        "gzip" if out.compression == "gzip" else "raw",
    )
    return check_sharding(spec, "output.sharding: auto", grid)


def aligned_bounds(region: Roi, chunk) -> Roi:
    """The output layer's bounds: ``region`` with its start moved down to the chunk grid of
    absolute coordinates (``output.align``), so chunks, shards and every mip of a pyramid
    start where downsampling expects them; the end stays (the last chunk may be partial).

    >>> aligned_bounds(Roi((2, 5, 5), (12, 90, 90)), (8, 32, 32))
    Roi(offset=(0, 0, 0), shape=(14, 95, 95))
    """
    snapped = region.snap_to_grid(Coordinate(chunk), 0, "grow")
    return Roi.from_bounds(snapped.begin, region.end)


def output_scales(cfg: Config, lay: Layout, resolution, channels: int) -> list[ScaleSpec]:
    """The output layer's scales: mip 0 (the run's) and the pyramid's mips 1..downsample.mips."""
    ou = parse_layer_url(cfg.output.path, endpoint=cfg.output.endpoint_url, what="output.path")
    zarr = ou.format == "zarr"
    key = "0" if zarr else cfg.output.scale_key or "_".join(f"{v:g}" for v in tuple(resolution)[::-1])
    spec0 = ScaleSpec(
        key=key,
        bounds=lay.bounds,
        chunk_shape=Coordinate(cfg.output.chunk_size),
        resolution=tuple(resolution),
        dtype=cfg.output.dtype,
        channels=channels,
        encoding=cfg.output.encoding,
        sharding=lay.sharding,
    )
    return mip_specs(spec0, cfg.downsample.mips, cfg.downsample.factor, shard_bytes=lay.shard_bytes)
