"""Kernel parameters chosen per host by measurement: one registry, read by the kernels.

A block of Winograd tiles that stays in a Zen 4 core's cache (its 32 MiB L3 is close) spills to
an Intel core's slower mesh L3; a row group or a block of voxels that suits one cache hierarchy
does not suit another.  So, as FFTW's planner and oneDNN's dispatcher do, the calibration
(:func:`znni_core.plan.timing.calibrate`) times each parameter's candidates on the host, keeps the
fastest with the host's calibration, and the planner writes them into the plan
(``Plan.tuning``); the executor runs a plan under its own values (:func:`using`), so every node
of a cluster computes a plan's output with the same parameters, whichever node it runs on.

Outside a plan (a layer called directly) the defaults below hold: the values measured best on a
Zen 4 host, each with its candidates.  The parameters change how work is blocked, never the sums
a value is made of, except ``winograd.large_tile_gain`` (which tile size a layer runs: both are
exact to 1e-4, ``tests/test_winograd.py``).
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["CANDIDATES", "DEFAULTS", "apply", "current", "get", "using"]

#: name -> default value
DEFAULTS = {
    # bytes of V and M per block of Winograd tiles (layers/winograd.py)
    "winograd.block_bytes": 3 * 2**20,
    # 8-point tiles where they need at most this fraction of 6-point tiles' transform positions
    # (0: 6-point tiles only)
    "winograd.large_tile_gain": 1.0,
    # the products of a Winograd block on BLAS (1) instead of znni's register tiles (0,
    # layers/microkernel.py): OpenBLAS's Haswell kernel ran them 1.1-1.4x slower on AVX2, its
    # SkylakeX kernel as fast or up to 1.3x faster on AVX-512
    "winograd.blas": 0,
    # the register tiles of Winograd's products (layers/microkernel.py, tile_shape): 0 the fewest
    # padded columns (8-float vectors for 24, 36 or 40 maps in a 512-bit build), 1 the fewest
    # vectors per row (16-float ones, padded: 36 maps as 48 columns).  A Zen 4 core runs a 16-float
    # multiply-add as two 8-float halves, so padding costs there; an Intel server core has two
    # 512-bit ports (36 maps' products alone 1.2-1.65x faster as 16-float tiles on an Emerald Rapids)
    "winograd.wide_tiles": 0,
    # voxels per block of a 1x1x1 chain (layers/pointwise.py; a multiple of 32)
    "pointwise.block": 1024,
    # input values per grouped row of the direct loop (layers/direct.py)
    "direct.row_group": 512,
}
#: name -> the values a calibration times
CANDIDATES = {
    "winograd.block_bytes": (2**19, 2**20, 3 * 2**20, 6 * 2**20),
    "winograd.large_tile_gain": (0.0, 1.0),
    "winograd.blas": (0, 1),
    "winograd.wide_tiles": (0, 1),
    "pointwise.block": (512, 1024, 2048),
    "direct.row_group": (256, 512, 1024),
}

_LOCK = threading.Lock()
_VALUES = dict(DEFAULTS)


def get(name: str):
    """The value in force (a plan's while it runs, else the default)."""
    return _VALUES[name]


def current() -> dict:
    """A copy of every parameter's value in force, ``{name: value}``."""
    return dict(_VALUES)


def check(values: dict) -> dict:
    """``values`` with unknown names refused and numbers of the defaults' types."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown kernel parameters {unknown}; known: {sorted(DEFAULTS)}")
    out = {}
    for k, v in values.items():
        t = type(DEFAULTS[k])
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"kernel parameter {k}={v!r}: a number >= 0")
        out[k] = t(v)
    return out


def apply(values: dict | None) -> None:
    """Set ``values`` (others keep theirs) for the process, as an executor does before it runs a
    plan.  Not restored: runs in several threads of one process (a job's pipelined tasks) carry
    one host's values, and a restore by the first to finish would change them under the others."""
    if values:
        values = check(values)
        with _LOCK:
            _VALUES.update(values)


@contextlib.contextmanager
def using(values: dict | None):
    """Run with ``values`` (others keep theirs), restored after: the calibration's timings and
    tests, in one thread (the engine's pooled worker threads read them too)."""
    if not values:
        yield
        return
    values = check(values)
    with _LOCK:
        old = {k: _VALUES[k] for k in values}
        _VALUES.update(values)
    try:
        yield
    finally:
        with _LOCK:
            _VALUES.update(old)
