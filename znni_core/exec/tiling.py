"""Dense output of an input of any size >= the field of view, by patches of a plan.

::

    input  |<------------------------- n ------------------------->|
    output    |<- T ->|<- T ->|<- T ->|        |<- T ->|              T = patch output (multiple of D)
              0       T       2T     ...    O-T        O            last tile shifted back, never padded
                                                                   (only an input smaller than one patch
                                                                    is padded at the end, then cropped)
Each output voxel is computed by exactly one window of the network, so overlapping
tiles write identical values: the result does not depend on the tiling.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..geometry.blocks import block_starts
from ..net.graph import Graph
from .blend import axis_plan, lattice
from .engine import kernel_cache, run_back, run_front, run_patch
from .graph import run_graph_patch


def run_tiled(plan, net, x: np.ndarray, *, xp=np, progress=None, cache: dict | None = None) -> np.ndarray:
    """``x``: (C, Z, Y, X) float32 with every axis >= the field of view.

    ``cache``: a dict kept by the caller across calls with the same plan, so resident FFT
    kernel spectra are built once for all of them (e.g. every Dask block of a task)."""
    if isinstance(net, Graph):
        return run_tiled_graph(plan, net, x, xp=xp, progress=progress, cache=cache)
    fov, d = net.field_of_view, net.pooling_product
    out_total = [n - f + 1 for n, f in zip(x.shape[1:], fov)]
    # tile output: the plan's, or the smallest multiple of D covering a small input
    tile = [min(t, math.ceil(o / dd) * dd) for t, o, dd in zip(plan.output_shape, out_total, d)]
    result = np.empty((net.out_channels,) + tuple(out_total), dtype=np.float32)
    grids = [block_starts(o, t) for o, t in zip(out_total, tile)]
    convs = kernel_cache(cache, plan)  # FFT kernel spectra, shared by every tile (all of one shape)
    on_host = xp is np or plan.placement in ("gpu+host", "cpu+gpu")  # where the patch goes in

    def cut(start):
        need = [s + t + f - 1 for s, t, f in zip(start, tile, fov)]
        sl = tuple(slice(s, min(e, n)) for s, e, n in zip(start, need, x.shape[1:]))
        patch = x[(slice(None),) + sl]
        pad = [(0, e - min(e, n)) for e, n in zip(need, x.shape[1:])]
        if any(p[1] for p in pad):
            patch = np.pad(patch, [(0, 0)] + pad, mode="edge")  # only affects outputs that are cropped
        return np.ascontiguousarray(patch) if on_host else xp.asarray(patch)

    def put(start, y):
        if xp is not np:
            y = xp.asnumpy(y)
        keep = tuple(slice(0, min(t, o - s)) for s, t, o in zip(start, tile, out_total))
        dst = tuple(slice(s, s + k.stop) for s, k in zip(start, keep))
        result[(slice(None),) + dst] = y[(slice(None),) + keep]
        if progress is not None:
            progress(1)

    starts = list(itertools.product(*grids))
    if plan.placement == "cpu+gpu":
        _pipelined(plan, net, starts, cut, put, xp, convs)
        return result
    if len(starts) == 1:  # one patch: its output is the result when nothing is cropped
        y = run_patch(plan, net, cut(starts[0]), xp=xp, convs=convs)
        y = xp.asnumpy(y) if xp is not np else y
        if y.shape == result.shape and y.dtype == np.float32 and y.flags.c_contiguous:
            if progress is not None:
                progress(1)
            return y
        put(starts[0], y)
        return result
    for start in starts:
        put(start, run_patch(plan, net, cut(start), xp=xp, convs=convs))
    return result


def _pipelined(plan, net, starts, cut, put, xp, convs) -> None:
    """A cpu+gpu plan over its patches: the CPU stage of patch i + 1 (a worker thread) runs
    while the GPU stage of patch i runs here; at most two patches' fragments are alive."""
    from concurrent.futures import ThreadPoolExecutor

    front_convs = convs.setdefault("front", {})
    back_convs = convs.setdefault("back", {})
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="znni-cpu-stage") as pool:
        pending = None
        for start in starts:
            fut = pool.submit(lambda s: run_front(plan, net, cut(s), convs=front_convs), start)
            if pending is not None:
                put(pending[0], run_back(plan, net, pending[1].result(), xp=xp, convs=back_convs))
            pending = (start, fut)
        if pending is not None:
            put(pending[0], run_back(plan, net, pending[1].result(), xp=xp, convs=back_convs))


def graph_extent(net: Graph, shape) -> tuple:
    """The input extent a graph network runs on for an input of ``shape`` (z, y, x): a valid
    graph drops trailing voxels down to the largest admissible shape (as PyTorch's floor
    pooling would; a warning names them), a padded graph pads zeros up to the smallest
    admissible shape and crops its output back."""
    if net.kind == "valid":
        use = net.floor_admissible(shape)
        if not all(use):
            raise InputError(
                f"input shape {tuple(shape)} is smaller than the smallest admissible input "
                f"{net.geometry['n_min']} of {net.name} (admissible: n_min + k * {net.grid})"
            )
        return use
    return net.ceil_admissible(shape)


@dataclass(frozen=True)
class GraphWindow:
    """The patches a graph network runs to produce the output window ``[lo, hi)`` of a volume
    (coordinates: output voxel ``i`` is computed from input voxels ``[i, i + F)`` of the
    whole volume's input array)."""

    lo: tuple
    hi: tuple
    patch: tuple  # input patch (z, y, x)
    tile: tuple  # its output
    starts: tuple  # per axis: output starts of the patches that touch the window
    in_lo: tuple  # input range the patches read, [in_lo, in_hi)
    in_hi: tuple
    weights: tuple = ()  # padded: per axis, the blending weight over a tile
    norms: tuple = ()  # padded: per axis, the normaliser over [lo, hi)


def graph_window(net: Graph, plan, lo, hi, whole_out=None) -> GraphWindow:
    """Valid graph: tiles on the grid from ``lo`` rounded down to it, reaching past ``hi`` by
    less than the grid (any grid-aligned tiling gives the same voxels).  Padded graph: the
    patches of the lattice over the whole output ``whole_out`` (the volume's, padded up to
    admissible) that touch the window, with the lattice's normaliser."""
    c, g = net.context, net.grid
    if net.kind == "valid":
        a0 = tuple(a - a % gg for a, gg in zip(lo, g))
        extent = net.ceil_admissible(tuple(b - a + cc for a, b, cc in zip(a0, hi, c)))
        patch = tuple(min(p, e) for p, e in zip(plan.patch_shape, extent))
        tile = net.output_shape(patch)
        starts = tuple(
            tuple(a + s for s in lattice(e - cc, t, 0, gg)) for a, e, cc, t, gg in zip(a0, extent, c, tile, g)
        )
        return GraphWindow(tuple(lo), tuple(hi), patch, tile, starts, a0, tuple(a + e for a, e in zip(a0, extent)))
    use = net.ceil_admissible(tuple(o + cc for o, cc in zip(whole_out, c)))
    patch = tuple(min(p, u) for p, u in zip(plan.patch_shape, use))
    tile = net.output_shape(patch)
    overlap = plan.overlap or (0, 0, 0)
    axes = [axis_plan(u - cc, t, v, plan.blend or "bump", gg) for u, cc, t, v, gg in zip(use, c, tile, overlap, g)]
    starts = tuple(tuple(s for s in a[0] if s < b and s + t > l) for a, l, b, t in zip(axes, lo, hi, tile))
    return GraphWindow(
        tuple(lo),
        tuple(hi),
        patch,
        tile,
        starts,
        tuple(st[0] for st in starts),
        tuple(st[-1] + p for st, p in zip(starts, patch)),
        tuple(a[1] for a in axes),
        tuple(a[2][l:b] for a, l, b in zip(axes, lo, hi)),
    )


def run_graph_window(
    plan, net: Graph, x: np.ndarray, win: GraphWindow, *, xp=np, progress=None, cache: dict | None = None
) -> np.ndarray:
    """The output over ``[win.lo, win.hi)`` from ``x``, the input over ``[win.in_lo, win.in_hi)``."""
    want = tuple(b - a for a, b in zip(win.in_lo, win.in_hi))
    if tuple(x.shape[1:]) != want:
        raise InputError(f"window input has shape {tuple(x.shape[1:])}, the window's patches read {want}")
    blended = bool(win.weights) and any(len(s) > 1 for s in win.starts)
    shape = (net.out_channels,) + tuple(b - a for a, b in zip(win.lo, win.hi))
    result = np.zeros(shape, np.float32) if blended else np.empty(shape, np.float32)
    convs = kernel_cache(cache, plan)
    for start in itertools.product(*win.starts):
        src = (slice(None),) + tuple(slice(s - a, s - a + p) for s, a, p in zip(start, win.in_lo, win.patch))
        part = np.ascontiguousarray(x[src]) if xp is np else xp.asarray(x[src])
        y = run_graph_patch(plan, net, part, xp=xp, convs=convs)
        del part
        if xp is not np:
            y = xp.asnumpy(y)
        # the part of this tile inside the window
        lo = [max(s, l) for s, l in zip(start, win.lo)]
        hi = [min(s + t, h) for s, t, h in zip(start, win.tile, win.hi)]
        src = (slice(None),) + tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        dst = (slice(None),) + tuple(slice(a - l, b - l) for a, b, l in zip(lo, hi, win.lo))
        if blended:
            w = [ws[a - s : b - s] for ws, a, b, s in zip(win.weights, lo, hi, start)]
            result[dst] += y[src] * np.einsum("i,j,k->ijk", *w).astype(np.float32)
        else:
            result[dst] = y[src]
        del y
        if progress is not None:
            progress(1)
    if blended:
        result /= np.einsum("i,j,k->ijk", *win.norms).astype(np.float32)
    return result


def run_tiled_graph(plan, net: Graph, x: np.ndarray, *, xp=np, progress=None, cache: dict | None = None) -> np.ndarray:
    """A graph network's output on ``x`` (C, Z, Y, X): exact tiles on the grid (valid), or
    overlapping patches blended on the lattice of ``exec/blend.py`` (padded)."""
    n = tuple(x.shape[1:])
    use = graph_extent(net, n)
    if net.kind == "valid":
        if use != n:
            warnings.warn(
                f"input shape {n} is not admissible for {net.name} (n_min {net.geometry['n_min']} + k * "
                f"grid {net.grid}): the last {tuple(a - b for a, b in zip(n, use))} voxels are not used; "
                f"the output covers {use}",
                stacklevel=3,
            )
            x = x[(slice(None),) + tuple(slice(0, u) for u in use)]
        win = graph_window(net, plan, (0, 0, 0), net.output_shape(use))
    else:
        if use != n:
            x = np.pad(x, [(0, 0)] + [(0, u - m) for u, m in zip(use, n)])  # zeros: what the padded net assumes
        win = graph_window(net, plan, (0, 0, 0), net.output_shape(n), whole_out=net.output_shape(n))
        x = x[(slice(None),) + tuple(slice(a, b) for a, b in zip(win.in_lo, win.in_hi))]
    return run_graph_window(plan, net, x, win, xp=xp, progress=progress, cache=cache)
