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

import numpy as np

from ..geometry.blocks import block_starts
from .engine import kernel_cache, run_patch


def run_tiled(plan, net, x: np.ndarray, *, xp=np, progress=None, cache: dict | None = None) -> np.ndarray:
    """``x``: (C, Z, Y, X) float32 with every axis >= the field of view.

    ``cache``: a dict kept by the caller across calls with the same plan, so resident FFT
    kernel spectra are built once for all of them (e.g. every Dask block of a task)."""
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
