"""Where patches go, and how overlapping outputs of a padded graph are blended.

Patches lie on a **lattice** fixed by the volume alone (its length ``n``, the patch and
the overlap), never by how a run is cut into tasks, so a task that computes the
patches touching its chunks gets the same voxels as one pass over the whole volume::

    n = 20, patch output t = 8, overlap 2 -> step 6:   starts 0, 6, 12 (the last one
    shifted back to n - t = 12 so no patch leaves the volume)

A voxel's value is ``sum_p w_p y_p / sum_p w_p`` over the patches ``p`` covering it,
with separable weights ``w_p(z, y, x) = w(z) w(y) w(x)`` over the patch output:

* ``bump`` (chunkflow): ``exp(-1 / (u (1 - u)))`` at ``u = (i + 0.5) / t``;
* ``gaussian`` (MONAI): ``exp(-(i + 0.5 - t / 2)^2 / (2 (t / 8)^2))``;
* ``linear``: ``1 - |2u - 1|``;

each scaled to a maximum of 1 and floored at ``1e-4`` so a voxel covered by one patch
only (the volume's corners) keeps its value.  Where one patch covers an axis, its
weight is 1.  The normaliser is the product of the per-axis sums (the lattice is a
product of per-axis lattices), so blending needs no second output-sized array.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError

FLOOR = 1e-4


def lattice(n: int, tile: int, overlap: int, grid: int = 1) -> list[int]:
    """Starts of patch outputs of length ``tile`` covering ``[0, n)`` with at least
    ``overlap`` voxels shared by neighbours; starts are multiples of ``grid`` except a
    last one shifted back to ``n - tile``."""
    if tile >= n:
        return [0]
    step = max(grid, (tile - overlap) // grid * grid)
    if step <= 0:
        raise PlanError(f"overlap {overlap} leaves no step for a patch output of {tile}")
    starts = list(range(0, n - tile, step))
    return starts + [n - tile]


def weights(t: int, kind: str) -> np.ndarray:
    """Per-axis blending weight over a patch output of length ``t`` (float64)."""
    u = (np.arange(t) + 0.5) / t
    if kind == "bump":
        with np.errstate(over="ignore", divide="ignore"):
            w = np.exp(-1.0 / (u * (1 - u)) + 4.0)  # max at u = 1/2 is exp(0) after the shift
    elif kind == "gaussian":
        w = np.exp(-(((u - 0.5) * t) ** 2) / (2 * (t / 8) ** 2))
    elif kind == "linear":
        w = 1 - np.abs(2 * u - 1)
    else:
        raise PlanError(f"blend {kind!r} is not bump, gaussian or linear")
    return np.maximum(w / w.max(), FLOOR)


def axis_plan(n: int, tile: int, overlap: int, kind: str, grid: int = 1):
    """(starts, weight, normaliser over [0, n)) for one axis."""
    starts = lattice(n, tile, overlap, grid)
    w = np.ones(tile) if len(starts) == 1 else weights(tile, kind)
    norm = np.zeros(n)
    for s in starts:
        norm[s : s + tile] += w
    return starts, w, norm
