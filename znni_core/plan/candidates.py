"""The search's candidates: input patches, pooling modes, FFT input blocks, micro-batches, and
the rate a candidate is ranked by.

A chain's patch has an output per axis that is a multiple of its pooling product D (max-pooling
fragments then give a dense output); patches come as ascending series, one per aspect ratio, so
the search can stop a series once it stops improving.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..net.chain import Pool
from ..net.graph import Graph
from . import memory as M
from .pooling import MPF, DepthFirst, Slab

SLAB_SLICES = 8  # depth of the thin patches tried for networks flat in z (patch_candidates)
FFT_TILE_EDGES = (32, 48, 64, 96, 128)  # overlap-save block edges tried for FFT convolutions


def input_patch(net: Graph, input_shape) -> tuple:
    """The smallest admissible patch covering ``input_shape`` (z, y, x): output per axis
    rounded up to the pooling product D.  No patch larger than this does useful work."""
    fov, d = net.field_of_view, net.pooling_product
    bad = [(n, f) for n, f in zip(input_shape, fov) if int(n) < f]
    if len(tuple(input_shape)) != 3 or bad:
        raise PlanError(
            f"input shape {tuple(input_shape)} (z, y, x) must be 3 sizes of at least the field of view {fov}"
        )
    return tuple(math.ceil((int(n) - f + 1) / dd) * dd + f - 1 for n, f, dd in zip(input_shape, fov, d))


def patch_candidates(net: Graph, max_voxels: int, input_shape=None, slabs: bool = False) -> list[list[tuple]]:
    """Input patch shapes (output per axis a multiple of the pooling product D), as one
    ascending series per aspect ratio, so the search can stop a series once it stops
    improving.  With ``input_shape`` no patch exceeds the input (rounded up to D) and
    the whole input is a candidate of its own.

    ``slabs``: for a network flat in z (2D kernels and pools), the series of slabs
    SLAB_SLICES thick instead: z costs such a network no halo, so where a patch of the
    input's depth must be narrow in y and x (the budget), a thin slab of wide planes
    wastes less on the y, x halo (the boundary net on 30 x 1024^2 at 2 GiB: 30 x 462^2
    patches predicted 353k output voxels/s, 8 x 590^2 slabs 410k); empty otherwise."""
    fov, d = np.array(net.field_of_view), np.array(net.pooling_product)
    aniso = len(set(net.field_of_view)) > 1 or len(set(net.pooling_product)) > 1
    edges = sorted({int(round(v)) for v in np.geomspace(max(fov.max(), 8), 2048 if slabs else 1024, 40)})
    cap = np.array(input_patch(net, input_shape)) if input_shape is not None else None
    aspects = [1.0, 2.0, 4.0, 8.0] if aniso else [1.0]
    if slabs:
        aspects = [-float(SLAB_SLICES)] if fov[0] == 1 and d[0] == 1 and (cap is None or cap[0] > SLAB_SLICES) else []
    seen, series = set(), []
    for a in aspects:
        out = []
        for edge in edges:
            target = (
                np.array([-a, edge, edge])
                if a < 0
                # a slab of -a slices
                else np.array([edge / a, edge, edge])
                if fov[0] <= fov[1]
                else np.array([edge, edge / a, edge / a])
            )
            m = np.maximum(1, np.floor((target - fov + 1) / d)).astype(int)
            shape = m * d + fov - 1
            if cap is not None:
                shape = np.minimum(shape, cap)
            shape = tuple(int(v) for v in shape)
            if shape not in seen and math.prod(shape) * net.in_channels <= max_voxels:
                seen.add(shape)
                out.append(shape)
        if out:
            series.append(out)
    if cap is not None and not slabs and fov[0] == 1 and d[0] == 1 and cap[0] > 1:
        # flat in z: the input's whole planes, its depth in equal parts (z costs no halo; a
        # 30 x 512^2 input ran as three 10-deep MPF patches in 7.6 s, as one in slab + depth-first pooling 14 s)
        parts = sorted({-(-int(cap[0]) // k) for k in (2, 3, 4, 6, 8, 12, 16) if k <= cap[0]})
        planes = [(z, int(cap[1]), int(cap[2])) for z in parts]
        planes = [p for p in planes if p not in seen and math.prod(p) * net.in_channels <= max_voxels]
        seen.update(planes)
        if planes:
            series.append(planes)
    if cap is not None and tuple(int(v) for v in cap) not in seen and not slabs:
        series.append([tuple(int(v) for v in cap)])
    return series


def pool_mode_candidates(n_pools: int) -> list[tuple]:
    """The pooling-mode combinations the search tries for a net of ``n_pools`` pooling layers."""
    if n_pools <= 2:
        return list(itertools.product((MPF(), DepthFirst()), repeat=n_pools))
    # three or more pooling layers: depth-first on a prefix, MPF after (the ZNNi choices;
    # the other assignments trade memory the same way and took most of the planning time)
    return [(DepthFirst(),) * k + (MPF(),) * (n_pools - k) for k in range(n_pools + 1)]


def slab_modes(net: Graph, patch, mode_sets) -> list[tuple]:
    """Slab variants of the first pooling layer: a few slab heights (fragment rows)."""
    if not net.pools:
        return []
    k = next(i for i, l in enumerate(net.layers) if isinstance(l, Pool))
    rows_total = M.slab_geometry(net.layers, net.in_channels, k, patch, 1)["frag"][0]
    heights = sorted({max(1, rows_total // 8), max(1, rows_total // 2)})
    rests = sorted({m[1:] for m in mode_sets})
    return [(Slab(h),) + rest for h in heights for rest in rests]


class ConvOption(NamedTuple):
    """One way to run a conv layer (of a chain or a graph), priced: ranked by ``(seconds,
    primitive, micro_batch)``, kept where its ``bytes`` fit the room the layer has."""

    seconds: float  # estimated (or measured) for the layer's whole batch
    primitive: str
    micro_batch: int  # 0: the whole batch at once
    tile: tuple  # the FFT input block; () for the whole input
    bytes: int  # the call's peak plus what the primitive keeps for the run
    resident: int  # of ``bytes``, what the primitive keeps for the run


class Candidate(NamedTuple):
    """One priced (patch, pooling modes, placement) of the search: its steps and predictions."""

    voxels_per_s: float  # over the input the plan is for (:func:`rate`)
    patch: tuple
    modes: tuple  # per pooling layer: a :class:`~.pooling.PoolingChoice` (MPF, DepthFirst or Slab)
    steps: tuple
    seconds: float  # per patch
    peak: int  # bytes (the device's for GPU plans)
    notes: list  # what the walk rejected on the way
    placement: str  # "" | gpu+host | cpu+gpu
    split: int  # cpu+gpu: the index of the first GPU step

    def describe(self) -> str:
        """``patch (z, y, x) pools mpf/pool [on placement]``, as rejected candidates are listed."""
        return f"patch {self.patch} pools {'/'.join(map(str, self.modes)) or '-'}" + (
            f" on {self.placement}" if self.placement else ""
        )


def fft_tiles(spatial, kernel) -> list[tuple]:
    """Input blocks for an FFT conv: the whole input, or cubes (clipped to the input) whose
    output is at least the kernel per axis (smaller blocks would be mostly overlap)."""
    out, spatial = [()], tuple(int(s) for s in spatial)
    for e in FFT_TILE_EDGES:
        t = tuple(min(e, s) for s in spatial)
        if t != spatial and t not in out and all(tt - k + 1 >= k for tt, k in zip(t, kernel)):
            out.append(t)
    return out


def flat_axis(kernel, spatial) -> bool:
    """Whether the kernel is 1 deep along an axis the input extends along."""
    return any(k == 1 and s > 1 for k, s in zip(kernel, spatial))


def micro_batches(n: int) -> list[int]:
    """Micro-batch sizes tried for ``n`` fragments: ``n``, then halved (rounded up) down to 1.

    >>> micro_batches(5)
    [5, 3, 2, 1]
    """
    out, mb = [], n
    while mb >= 1:
        out.append(mb)
        if mb == 1:
            break
        mb = (mb + 1) // 2
    return out


def rate(net: Graph, patch, secs: float, input_shape=None) -> float:
    """Output voxels per second of a patch plan.  With ``input_shape``: of that input, covered
    by ``ceil(output / patch output)`` patches per axis (the last one shifted back), so a patch
    just short of the input is charged for the second patch it needs."""
    out = net.output_shape(patch)
    if input_shape is None:
        return math.prod(out) / secs
    need = net.output_shape(input_shape)
    patches = math.prod(-(-n // o) for n, o in zip(need, out))
    return math.prod(need) / (patches * secs)
