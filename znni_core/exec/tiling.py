"""Dense output of an input of any size, by the patches of a plan: one tiler for every network.

A :class:`Window` lists the patches whose outputs cover an output box ``[lo, hi)``::

    output    |<- T ->|<- T ->|<- T ->|        |<- T ->|              T = patch output
              lo     ...                     hi-T     hi             last tile shifted back, never padded

* chain (max-pooling fragments): T a multiple of the pooling product, any start;
* valid graph: patches start on the network's grid (they see the volume's pooling phases);
* padded graph: overlapping patches on the lattice over the whole output, blended
  (``exec/blend.py``).

In a chain or a valid graph each output voxel is computed by exactly one window of the
network, so overlapping tiles write the same values: the result does not depend on the tiling.
Only an input smaller than one chain patch is padded at the end (its outputs are cropped).
"""

from __future__ import annotations

import itertools
import math
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .blend import axis_plan, lattice


@dataclass(frozen=True)
class Window:
    """The patches a network runs to produce the output box ``[lo, hi)`` of a volume
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

    @property
    def count(self) -> int:
        """Patches run."""
        return math.prod(len(s) for s in self.starts)


def input_extent(net, shape) -> tuple:
    """The input extent a network runs on for an input of ``shape`` (z, y, x): a chain or a
    valid graph drops trailing voxels down to the largest admissible shape (as PyTorch's floor
    pooling would; a warning names them), a padded graph pads zeros up to the smallest
    admissible shape and crops its output back."""
    if net.kind != "padded":
        use = net.floor_admissible(shape)
        if not all(use):
            raise InputError(
                f"input shape {tuple(shape)} is smaller than the smallest admissible input "
                f"{net.geometry.n_min} of {net.name} (admissible: n_min + k * {net.grid})"
            )
        return use
    return net.ceil_admissible(shape)


def warn_unused(net, shape, use, stacklevel: int = 2) -> None:
    """The warning that a chain's or valid graph's input of ``shape`` runs as ``use``
    (:func:`input_extent`), naming the trailing voxels left out; ``stacklevel`` as the caller's
    own ``warnings.warn`` would take it."""
    warnings.warn(
        f"input shape {tuple(shape)} is not admissible for {net.name} (n_min {net.geometry.n_min} + k * "
        f"grid {net.grid}): the last {tuple(a - b for a, b in zip(shape, use))} voxels are not used; "
        f"the output covers {tuple(use)}",
        stacklevel=stacklevel + 1,
    )


def window(net, plan, lo, hi, whole_out=None) -> Window:
    """The patches of ``plan`` covering the output box ``[lo, hi)``.  Chain: tiles of the plan's
    output (a multiple of the pooling product) from ``lo``.  Valid graph: tiles on the grid from
    ``lo`` rounded down to it, reaching past ``hi`` by less than the grid (any grid-aligned tiling
    gives the same voxels).  Padded graph: the patches of the lattice over the whole output
    ``whole_out`` (the volume's, padded up to admissible) that touch the window, with the
    lattice's normaliser."""
    c, g = net.context, net.grid
    if net.kind == "chain":
        d = net.pooling_product
        span = tuple(b - a for a, b in zip(lo, hi))
        tile = tuple(min(t, math.ceil(s / dd) * dd) for t, s, dd in zip(plan.output_shape, span, d))
        patch = tuple(t + cc for t, cc in zip(tile, c))
        starts = tuple(tuple(a + s for s in lattice(n, t, 0)) for a, n, t in zip(lo, span, tile))
        return Window(
            tuple(lo), tuple(hi), patch, tile, starts, tuple(lo), tuple(st[-1] + p for st, p in zip(starts, patch))
        )
    if net.kind == "valid":
        a0 = tuple(a - a % gg for a, gg in zip(lo, g))
        extent = net.ceil_admissible(tuple(b - a + cc for a, b, cc in zip(a0, hi, c)))
        patch = tuple(min(p, e) for p, e in zip(plan.patch_shape, extent))
        tile = net.output_shape(patch)
        starts = tuple(
            tuple(a + s for s in lattice(e - cc, t, 0, gg)) for a, e, cc, t, gg in zip(a0, extent, c, tile, g)
        )
        return Window(tuple(lo), tuple(hi), patch, tile, starts, a0, tuple(a + e for a, e in zip(a0, extent)))
    use = net.ceil_admissible(tuple(o + cc for o, cc in zip(whole_out, c)))
    patch = tuple(min(p, u) for p, u in zip(plan.patch_shape, use))
    tile = net.output_shape(patch)
    overlap = plan.overlap or (0, 0, 0)
    axes = [axis_plan(u - cc, t, v, plan.blend or "bump", gg) for u, cc, t, v, gg in zip(use, c, tile, overlap, g)]
    starts = tuple(tuple(s for s in a[0] if s < b and s + t > l) for a, l, b, t in zip(axes, lo, hi, tile))
    return Window(
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


def run_window(run, x: np.ndarray, win: Window, *, progress=None) -> np.ndarray:
    """The output over ``[win.lo, win.hi)`` from ``x``, the input over ``[win.in_lo, win.in_hi)``,
    by ``run`` (an :class:`~.executor.Executor`: what it built stays for its next call)."""
    plan, net, xp = run.plan, run.net, run.xp
    want = tuple(b - a for a, b in zip(win.in_lo, win.in_hi))
    if tuple(x.shape[1:]) != want:
        raise InputError(f"window input has shape {tuple(x.shape[1:])}, the window's patches read {want}")
    blended = bool(win.weights) and any(len(s) > 1 for s in win.starts)
    shape = (net.out_channels,) + tuple(b - a for a, b in zip(win.lo, win.hi))
    result = np.zeros(shape, np.float32) if blended else np.empty(shape, np.float32)
    on_host = xp is np or plan.placement in ("gpu+host", "cpu+gpu")  # where the patch goes in

    def cut(start):
        src = (slice(None),) + tuple(slice(s - a, s - a + p) for s, a, p in zip(start, win.in_lo, win.patch))
        return np.ascontiguousarray(x[src]) if on_host else xp.asarray(x[src])

    def put(start, y):
        if xp is not np:
            y = xp.asnumpy(y)
        lo = [max(s, l) for s, l in zip(start, win.lo)]  # the part of this tile inside the window
        hi = [min(s + t, h) for s, t, h in zip(start, win.tile, win.hi)]
        src = (slice(None),) + tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        dst = (slice(None),) + tuple(slice(a - l, b - l) for a, b, l in zip(lo, hi, win.lo))
        if blended:
            w = [ws[a - s : b - s] for ws, a, b, s in zip(win.weights, lo, hi, start)]
            result[dst] += y[src] * np.einsum("i,j,k->ijk", *w).astype(np.float32)
        else:
            result[dst] = y[src]
        if progress is not None:
            progress(1)

    starts = list(itertools.product(*win.starts))
    if plan.placement == "cpu+gpu":
        _pipelined(run, starts, cut, put)
        return result
    if len(starts) == 1 and not blended:  # one patch: its output is the result when nothing is cropped
        y = run.patch(cut(starts[0]))
        y = xp.asnumpy(y) if xp is not np else y
        if y.shape == result.shape and y.dtype == np.float32 and y.flags.c_contiguous:
            if progress is not None:
                progress(1)
            return y
        put(starts[0], y)
        return result
    for start in starts:
        put(start, run.patch(cut(start)))
    if blended:
        result /= np.einsum("i,j,k->ijk", *win.norms).astype(np.float32)
    return result


def run_tiled(run, x: np.ndarray, *, progress=None) -> np.ndarray:
    """The network's output on the whole of ``x`` (C, Z, Y, X) by ``run`` (an
    :class:`~.executor.Executor`): exact tiles (chain, valid graph) or overlapping patches blended
    on the lattice of ``exec/blend.py`` (padded graph).

    A valid graph's input is cut down to its largest admissible shape (a warning names the
    voxels left out); a padded graph's is padded with zeros up to admissible and its output
    cropped back; an input smaller than one chain patch is padded at the end with its edge
    values (only outputs that are cropped see them)."""
    plan, net = run.plan, run.net
    n = tuple(x.shape[1:])
    use = input_extent(net, n)
    if net.kind == "padded":
        if use != n:
            x = np.pad(x, [(0, 0)] + [(0, u - m) for u, m in zip(use, n)])  # zeros: what the padded net assumes
        win = window(net, plan, (0, 0, 0), net.output_shape(n), whole_out=net.output_shape(n))
        x = x[(slice(None),) + tuple(slice(a, b) for a, b in zip(win.in_lo, win.in_hi))]
        return run_window(run, x, win, progress=progress)
    if use != n:
        warn_unused(net, n, use, stacklevel=3)
        x = x[(slice(None),) + tuple(slice(0, u) for u in use)]
    win = window(net, plan, (0, 0, 0), net.output_shape(use))
    short = [(0, max(0, b - m)) for b, m in zip(win.in_hi, use)]
    if any(p[1] for p in short):  # a chain input smaller than one patch
        x = np.pad(x, [(0, 0)] + short, mode="edge")
    return run_window(run, x, win, progress=progress)


def _pipelined(run, starts, cut, put) -> None:
    """A cpu+gpu plan over its patches: the CPU stage of patch i + 1 (a worker thread) runs
    while the GPU stage of patch i runs here; at most two patches' fragments are alive."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="znni-cpu-stage") as pool:
        pending = None
        for start in starts:
            fut = pool.submit(lambda s: run.front(cut(s)), start)
            if pending is not None:
                put(pending[0], run.back(pending[1].result()))
            pending = (start, fut)
        if pending is not None:
            put(pending[0], run.back(pending[1].result()))
