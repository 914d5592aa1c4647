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

import numpy as np

from ..errors import InputError
from ..geometry.blocks import block_starts
from ..net.graph import Graph
from .blend import axis_plan
from .engine import kernel_cache, run_patch
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
    for start in itertools.product(*grids):
        need = [s + t + f - 1 for s, t, f in zip(start, tile, fov)]
        sl = tuple(slice(s, min(e, n)) for s, e, n in zip(start, need, x.shape[1:]))
        patch = x[(slice(None),) + sl]
        pad = [(0, e - min(e, n)) for e, n in zip(need, x.shape[1:])]
        if any(p[1] for p in pad):
            patch = np.pad(patch, [(0, 0)] + pad, mode="edge")  # only affects outputs that are cropped
        patch = np.ascontiguousarray(patch) if xp is np else xp.asarray(patch)
        y = run_patch(plan, net, patch, xp=xp, convs=convs)
        del patch
        if xp is not np:
            y = xp.asnumpy(y)
        keep = tuple(slice(0, min(t, o - s)) for s, t, o in zip(start, tile, out_total))
        dst = tuple(slice(s, s + k.stop) for s, k in zip(start, keep))
        result[(slice(None),) + dst] = y[(slice(None),) + keep]
        del y
        if progress is not None:
            progress(1)
    return result


def graph_extent(net: Graph, shape) -> tuple:
    """The input extent a graph network runs on for an input of ``shape`` (z, y, x): a valid
    graph drops trailing voxels down to the largest admissible shape (as PyTorch's floor
    pooling would; a warning names them), a padded graph pads zeros up to the smallest
    admissible shape and crops its output back."""
    if net.kind == "valid":
        use = net.floor_admissible(shape)
        if not all(use):
            raise InputError(f"input shape {tuple(shape)} is smaller than the smallest admissible input "
                             f"{net.geometry['n_min']} of {net.name} (admissible: n_min + k * {net.grid})")
        return use
    return net.ceil_admissible(shape)


def run_tiled_graph(plan, net: Graph, x: np.ndarray, *, xp=np, progress=None, cache: dict | None = None) -> np.ndarray:
    """A graph network's output on ``x`` (C, Z, Y, X): exact tiles on the grid (valid), or
    overlapping patches blended on the lattice of ``exec/blend.py`` (padded)."""
    n = tuple(x.shape[1:])
    use = graph_extent(net, n)
    if net.kind == "valid" and use != n:
        warnings.warn(f"input shape {n} is not admissible for {net.name} (n_min {net.geometry['n_min']} + k * "
                      f"grid {net.grid}): the last {tuple(a - b for a, b in zip(n, use))} voxels are not used; the "
                      f"output covers {use}", stacklevel=3)
        x = x[(slice(None),) + tuple(slice(0, u) for u in use)]
    elif use != n:
        x = np.pad(x, [(0, 0)] + [(0, u - m) for u, m in zip(use, n)])  # zeros: what the padded net assumes
    patch = tuple(min(p, u) for p, u in zip(plan.patch_shape, use))
    out_total, tile = net.output_shape(use), net.output_shape(patch)
    padded = net.kind == "padded"
    overlap = plan.overlap if padded and plan.overlap else (0, 0, 0)
    axes = [axis_plan(o, t, v, plan.blend or "bump", g) for o, t, v, g in zip(out_total, tile, overlap, net.grid)]
    single = all(len(a[0]) == 1 for a in axes)
    make = np.zeros if padded and not single else np.empty
    result = make((net.out_channels,) + tuple(out_total), dtype=np.float32)
    w3 = None
    if padded and not single:
        w3 = np.einsum("i,j,k->ijk", *(a[1] for a in axes)).astype(np.float32)
    convs = kernel_cache(cache, plan)
    for start in itertools.product(*(a[0] for a in axes)):
        src = (slice(None),) + tuple(slice(s, s + p) for s, p in zip(start, patch))
        part = np.ascontiguousarray(x[src]) if xp is np else xp.asarray(x[src])
        y = run_graph_patch(plan, net, part, xp=xp, convs=convs)
        del part
        if xp is not np:
            y = xp.asnumpy(y)
        dst = (slice(None),) + tuple(slice(s, s + t) for s, t in zip(start, tile))
        if w3 is None:
            result[dst] = y
        else:
            y *= w3
            result[dst] += y
        del y
        if progress is not None:
            progress(1)
    if w3 is not None:
        result /= np.einsum("i,j,k->ijk", *(a[2] for a in axes)).astype(np.float32)
    if padded and use != n:
        result = np.ascontiguousarray(result[(slice(None),) + tuple(slice(0, o) for o in net.output_shape(n))])
    return result
