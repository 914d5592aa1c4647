"""Winograd minimal-filtering convolution for kernels of 1-5 on every axis.

``F(m, r)`` computes ``m`` outputs of an ``r``-tap correlation from an input tile of
``a = m + r - 1`` values with ``a`` multiplications instead of ``r m``: with the transforms
``BT`` (``a x a``), ``G`` (``a x r``) and ``AT`` (``m x a``)::

    y = AT [ (G g) * (BT d) ]

Every axis uses one set of points, so one ``BT`` per axis whatever the kernel: ``a = 6``
in y and x (``F(4,3)``, ``F(3,4)``, ``F(2,5)``, ``F(5,2)``), or ``a = 8`` where it needs
no more transform positions (``F(6,3)``, ``F(5,4)``, ``F(4,5)``: points +-1/2 added,
``BT`` rows scaled to dyadic constants), ``a = 4`` in z for kernels 2-3 deep (``F(2,3)``,
``F(3,2)``: deeper tiles lost precision there) and 6 or 8 as in y and x for kernels 4-5 deep (a
``5^3`` kernel 512 products per 64 outputs on 8 points every axis, 16x fewer than direct
convolution's 125 per output) (:func:`toom_cook`, :func:`_axis_points`).  Axes nest: a
``(1, 3, 3)`` kernel uses 36 products per 16 outputs (4x fewer than direct convolution's 144), ``(1, 4, 4)`` 36 per 9 (4x fewer),
``(1, 5, 5)`` 36 per 4 (2.8x fewer); a ``3^3`` kernel 144 per 32 (6x fewer); an axis of
size 1 is the identity
(``a = m = 1``).  For ``C_in -> C_out`` maps the products of each of the ``T = prod(a)``
transform positions are one GEMM over the channels::

    M[t] (tiles x C_out) = V[t] (tiles x C_in) @ U[t] (C_in x C_out)

so the work runs as ``T`` BLAS ``sgemm`` calls per block of tiles.  The transforms run
channels last: each 1D transform is a numba loop over a vector of channels (16 per AVX-512
instruction), whatever the width of the plane, so the few-tile-wide planes of MPF fragments
transform as fast as wide ones.  ``U`` (the kernel's transform, ``T x C_in x C_out``
float32) is built once per layer and stays resident (:func:`winograd_kernel_bytes`).  One
call, tiles in blocks of a few MiB::

    x -> rows channels last -> input transform (numba) -> V (T, tiles, C_in)
    M = V @ U                                       (T sgemm calls)
    M -> output transform (numba) -> rows channels first + bias -> out

Precision: the transform points (0, +-1, +-2, infinity) keep float32 errors near 1e-6 relative to
the output's magnitude (``tests/test_winograd.py`` checks 1e-4 against the reference).
Written against ``xp`` for the GPU (:meth:`WinogradConv._call_xp`: strided tile views,
``tensordot`` and ``matmul``).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from . import arena, microkernel, tuning
from ._numba import njit
from .buffers import staggered
from .epilogue import act_row, vector_transform_act
from .layout import channels_inner, copy_run, empty_channels_last, fill_run, is_channels_last, memory_order
from .resident import ResidentConv
from .threads import blas_limit, each_worker, gemm
from .transform_vectors import AT8, BT4, BT6, BT8, vector_copy, vector_transform
from .xp import get_array_module

__all__ = [
    "WinogradConv",
    "winograd_kernel_bytes",
    "winograd_memory",
    "winograd_sizes",
    "winograd_supports",
    "winograd_tiles",
]

F32 = 4
#: V and M of one block of tiles together take about ``winograd.block_bytes`` (:mod:`.tuning`,
#: measured per host; they stay in cache: 3 MiB ran 8-20% faster than 6 MiB on a 1 MiB-L2 Zen 4
#: EPYC, interleaved: (1,3,3) 28 maps on 18 x 162^2 43 against 54 ms, 3^3 36 maps 26 against 28,
#: (1,5,5) 67 against 74; 0.4-1.5 MiB no better there)

# Toom-Cook points: 0, 1, -1, 2, -2 and infinity (a = 6, y and x) or 0, 1, -1 and infinity
# (a = 4, z).  BT depends on the points only (Lavin & Gray 2016's F(4,3) and F(2,3) matrices);
# AT evaluates at the points (row i: powers i, infinity on the last row); G then follows
# from the identity AT[(G g) * (BT d)] == correlation (solved exactly in float64).  Every
# kernel size r of an axis uses the same a: F(7 - r, r) in y and x, F(5 - r, r) in z.
_POINTS = {8: (0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5), 6: (0.0, 1.0, -1.0, 2.0, -2.0), 4: (0.0, 1.0, -1.0)}
_BT = {
    6: np.array(
        [
            [4, 0, -5, 0, 1, 0],
            [0, -4, -4, 1, 1, 0],
            [0, 4, -4, -1, 1, 0],
            [0, -2, -1, 2, 1, 0],
            [0, 2, -1, -2, 1, 0],
            [0, 4, 0, -5, 0, 1],
        ],
        np.float64,
    ),
    4: np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64),
}


# a = 8: inverse(W)^T's rows scaled to dyadic constants (each row of BT may take any scale: G
# follows from BT); rows of a pair +-p differ in the sign of the odd columns, which the written-out
# transform uses (:func:`_bt8`; ``tests/test_winograd.py`` checks the rows against the Vandermonde form)
_BT[8] = np.array(
    [
        [1, 0, -21 / 4, 0, 21 / 4, 0, -1, 0],
        [0, 1, 1, -17 / 4, -17 / 4, 1, 1, 0],
        [0, -1, 1, 17 / 4, -17 / 4, -1, 1, 0],
        [0, 1 / 2, 1 / 4, -5 / 2, -5 / 4, 2, 1, 0],
        [0, -1 / 2, 1 / 4, 5 / 2, -5 / 4, -2, 1, 0],
        [0, 1, 2, -5 / 4, -5 / 2, 1 / 4, 1 / 2, 0],
        [0, -1, 2, 5 / 4, -5 / 2, -1 / 4, 1 / 2, 0],
        [0, -1, 0, 21 / 4, 0, -21 / 4, 0, 1],
    ],
    np.float64,
)
#: a larger tile in y and x (a = 8: F(9 - r, r)) where it needs ``winograd.large_tile_gain``
#: (:mod:`.tuning`, measured per host) of a = 6's transform positions or fewer.  It costs more per transformed value (a general product)
#: but does fewer GEMM products per output: faster wherever it needs no more positions
#: ((1,3,3) 48 maps on 16 x 256^2 0.17 s against 0.21 s; on 13^2 fragments 0.29 against
#: 0.32 s; (1,4,4) on 30^2 0.18 against 0.23 s; 3^3 on 40 x 96^2 0.11 against 0.13 s)
#: kernel sizes per axis (z, y, x) Winograd runs; size 1 is the identity
KERNEL_SIZES = ((1, 2, 3, 4, 5), (1, 2, 3, 4, 5), (1, 2, 3, 4, 5))
_ID = (np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)))


def toom_cook(a: int, r: int) -> tuple:
    """``(BT, G, AT)`` of ``F(a + 1 - r, r)`` on the points of ``a`` (float64)."""
    BT, pts = _BT[a], _POINTS[a]
    m = a + 1 - r
    AT = np.zeros((m, a))
    for i in range(m):
        AT[i, :-1] = [p**i for p in pts]
    AT[m - 1, -1] = 1.0
    G = np.zeros((a, r))
    for k in range(r):  # sum_t AT[i, t] G[t, k] BT[t, :] = e_(i + k) for every output i
        A = np.concatenate([(AT[i][:, None] * BT).T for i in range(m)])
        e = np.zeros(m * a)
        e[[i * a + i + k for i in range(m)]] = 1.0
        G[:, k] = np.linalg.lstsq(A, e, rcond=None)[0]
        if not np.allclose(A @ G[:, k], e, rtol=0, atol=1e-9):
            raise AssertionError(f"no Winograd F({m}, {r}) on {a} points")
    return BT, G, AT


def winograd_supports(kernel) -> bool:
    """True for kernels of 1-5 on every axis, not all 1."""
    k = tuple(int(v) for v in kernel)
    return len(k) == 3 and all(v in s for v, s in zip(k, KERNEL_SIZES)) and max(k) > 1


def _axis_points(axis: int, r: int, out: int) -> int:
    """The tile's input extent ``a`` on an axis: 1 for a kernel of 1; in z 4 for kernels of 2-3
    (``F(3, 2)``, ``F(2, 3)``); otherwise 8 where it needs at most ``winograd.large_tile_gain`` of
    the transform positions of 6 for ``out`` outputs, else 6.

    z tiles of kernels 2-3 deep stay short: 6 or 8 points there made a 3^3 layer 1.27x faster (36
    maps, 18 x 160^2, two Xeon threads) but its float32 error 4-5x larger (3.7-5.3e-5 of the
    output's largest value against 0.9-1.0e-5, 24-48 maps; PyTorch's 6-7e-7), half the 1e-4 the
    networks' outputs are held to.  Kernels 4-5 deep take 8 in z as in y and x: ``F(4, 5)``'s error
    is ``F(2, 5)``'s (2.0e-5 both, 16 maps) with a third fewer products and transformed values per
    output (a 5^3 layer 1.17-1.22x faster there)."""
    if r == 1:
        return 1
    if axis == 0 and r <= 3:
        return 4
    pos = {a: -(-int(out) // (a + 1 - r)) * a for a in (6, 8)}
    return 8 if pos[8] <= tuning.get("winograd.large_tile_gain") * pos[6] else 6


def _axis_transforms(kernel, out_spatial):
    """Per axis ``(BT, G, AT)``: identity for size 1, else ``F(a + 1 - r, r)`` on the points
    of :func:`_axis_points`."""
    if not winograd_supports(kernel):
        raise InputError(f"Winograd convolution takes kernels of 1-5 on every axis; got {tuple(kernel)}")
    return tuple(
        _ID if int(k) == 1 else toom_cook(_axis_points(axis, int(k), o), int(k))
        for axis, (k, o) in enumerate(zip(kernel, out_spatial))
    )


def winograd_tiles(out_spatial, kernel) -> tuple:
    """``(m, a, tiles)`` per axis: outputs per tile, input extent per tile, tiles per axis."""
    al = tuple(_axis_points(axis, int(k), o) for axis, (k, o) in enumerate(zip(kernel, out_spatial)))
    ms = tuple(a + 1 - int(k) for a, k in zip(al, kernel))
    return ms, al, tuple(-(-int(o) // m) for o, m in zip(out_spatial, ms))


def winograd_sizes(n, in_spatial, kernel) -> tuple:
    """``(T, tiles, block_rows)`` of a call on ``n`` items: transform positions, all tiles,
    and the tile rows (each ``tiles_x`` tiles) per block for ``C_in + C_out = 1``
    (divide by the channels; see :func:`_blocks`)."""
    out = tuple(int(s) - int(k) + 1 for s, k in zip(in_spatial, kernel))
    _, al, nt = winograd_tiles(out, kernel)
    return math.prod(al), int(n) * math.prod(nt), nt


def winograd_kernel_bytes(c_in, c_out, kernel, in_spatial) -> int:
    """Bytes of a layer's resident kernel transform ``U`` ``(T, C_in, C_out)`` float32 for
    inputs of ``in_spatial`` (the tile size follows the output's)."""
    T = winograd_sizes(1, in_spatial, kernel)[0]
    return F32 * T * int(c_in) * microkernel.padded_columns(c_out, wide=_wide())


def _wide() -> bool:
    """``winograd.wide_tiles`` in force (:mod:`.tuning`): the register tiles' rule."""
    return bool(tuning.get("winograd.wide_tiles"))


def _blocks(rows, tiles_x, T, c_in, c_out, threads) -> tuple[int, int]:
    """``(tile rows per block, workers)``: blocks of at most ``winograd.block_bytes`` of ``V`` and ``M``, as
    many per worker and of about one size (a small call, one MPF fragment of a depth-first pool,
    had 64 rows in blocks of 14: split 3:2 between two workers)."""
    br = max(1, min(rows, tuning.get("winograd.block_bytes") // max(1, F32 * T * (c_in + c_out) * tiles_x)))
    workers = max(1, min(int(threads), -(-rows // br)))
    per = -(-rows // (br * workers))
    return -(-rows // (per * workers)), workers


def winograd_memory(n, c_in, c_out, in_spatial, kernel, threads=1) -> int:
    """Predicted peak bytes of one :class:`WinogradConv` call, input and ``U`` excluded:
    the output, and per worker one block's ``V`` and ``M`` and its scratch (a tile row's
    input rows channels last, two stage buffers of a tile row, the staged output rows)."""
    out = tuple(int(s) - int(k) + 1 for s, k in zip(in_spatial, kernel))
    ms, al, nt = winograd_tiles(out, kernel)
    T = math.prod(al)
    rows = int(n) * nt[0] * nt[1]
    br, workers = _blocks(rows, nt[2], T, c_in, c_out, threads)
    tile = microkernel.tile_shape(c_out, _wide())
    r = tile[0]  # the register tiles' whole rows and columns of V and M
    ldm = microkernel.padded_columns(c_out, tile)  # the products' columns, padding included
    block = F32 * T * (int(c_in) + ldm) * (-(-br * nt[2] // r) * r)
    width = nt[2] * ms[2]
    scratch = F32 * (
        al[0] * al[1] * (width + al[2] - ms[2]) * c_in + 2 * T * nt[2] * max(c_in, ldm) + ms[0] * ms[1] * width * ldm
    )
    return F32 * int(n) * int(c_out) * math.prod(out) + workers * (block + scratch)


# ----------------------------------------------------------------------------- numba kernels
# The 1D transforms written out, on flat arrays: value k of position i of d sits at
# d[d0 + k * ds + i].  Fused (one load and one store per value), float32 constants (a
# float64 literal would widen every operation), and unsigned offsets: numba wraps negative
# indices, and that check alone kept these loops scalar (18x slower).  The loops over i
# (the channels) then compile to 16-wide vectors.  ``a`` names the points: 1 identity, 4
# (z), 6 or 8 (y and x).
@njit(nogil=True, cache=True, inline="always")
def _strides(d0, ds, v0, vs):  # pragma: no cover - compiled
    u = np.uint64
    return u(d0), u(ds), u(2) * u(ds), u(3) * u(ds), u(v0), u(vs), u(2) * u(vs), u(3) * u(vs)


#: floats per vector of the transforms on whole vectors (:mod:`.transform_vectors`)
_VL = microkernel.VL
#: ``vector_transform`` kinds of the 8-point AT with 4-7 outputs
_AT4, _AT5, _AT6, _AT7 = AT8 + 4, AT8 + 5, AT8 + 6, AT8 + 7


@njit(nogil=True, cache=True, inline="always")
def _bt8_lane(d, j, ds, v, k, vs):  # pragma: no cover - compiled
    """v[k + r * vs] = (BT d)[r] for the 8 values d[j + p * ds], a = 8 (:data:`_BT`): per pair of
    points +-p the even and odd columns' sums E and O, then E + O and E - O (one load per value,
    30 operations instead of 64)."""
    u = np.uint64
    c2, c17, c21 = np.float32(2.0), np.float32(4.25), np.float32(5.25)
    c05, c025, c125, c25 = np.float32(0.5), np.float32(0.25), np.float32(1.25), np.float32(2.5)
    x0, x1, x2, x3 = d[j], d[j + ds], d[j + u(2) * ds], d[j + u(3) * ds]
    x4, x5, x6, x7 = d[j + u(4) * ds], d[j + u(5) * ds], d[j + u(6) * ds], d[j + u(7) * ds]
    v[k] = (x0 - x6) + c21 * (x4 - x2)
    e, o = (x2 + x6) - c17 * x4, (x1 + x5) - c17 * x3
    v[k + vs] = e + o
    v[k + u(2) * vs] = e - o
    e, o = (c025 * x2 + x6) - c125 * x4, (c05 * x1 + c2 * x5) - c25 * x3
    v[k + u(3) * vs] = e + o
    v[k + u(4) * vs] = e - o
    e, o = (c2 * x2 + c05 * x6) - c25 * x4, (x1 + c025 * x5) - c125 * x3
    v[k + u(5) * vs] = e + o
    v[k + u(6) * vs] = e - o
    v[k + u(7) * vs] = (x7 - x1) + c21 * (x3 - x5)


@njit(nogil=True, cache=True, inline="always")
def _bt6_lane(d, j, ds, v, k, vs):  # pragma: no cover - compiled
    """:func:`_bt8_lane` for a = 6."""
    u = np.uint64
    c2, c4, c5 = np.float32(2.0), np.float32(4.0), np.float32(5.0)
    x0, x1, x2, x3 = d[j], d[j + ds], d[j + u(2) * ds], d[j + u(3) * ds]
    x4, x5 = d[j + u(4) * ds], d[j + u(5) * ds]
    v[k] = c4 * x0 - c5 * x2 + x4
    v[k + vs] = (x3 + x4) - c4 * (x1 + x2)
    v[k + u(2) * vs] = (x4 - x3) + c4 * (x1 - x2)
    v[k + u(3) * vs] = (x4 - x2) + c2 * (x3 - x1)
    v[k + u(4) * vs] = (x4 - x2) - c2 * (x3 - x1)
    v[k + u(5) * vs] = c4 * x1 - c5 * x3 + x5


@njit(nogil=True, cache=True, inline="always")
def _bt4_lane(d, j, ds, v, k, vs):  # pragma: no cover - compiled
    """:func:`_bt8_lane` for a = 4 (z's points)."""
    u = np.uint64
    x0, x1, x2, x3 = d[j], d[j + ds], d[j + u(2) * ds], d[j + u(3) * ds]
    v[k] = x0 - x2
    v[k + vs] = x1 + x2
    v[k + u(2) * vs] = x2 - x1
    v[k + u(3) * vs] = x1 - x3


def _transform_runs(kind, lane):
    """``runs(d, d0, ds, dstep, v, v0, vs, vstep, L, nb, offs)``: v[:, i] = BT d[:, i] for i < L on
    ``nb`` runs ``dstep`` and ``vstep`` apart, for the input transform ``kind``
    (:mod:`.transform_vectors`; ``offs``: the points' offsets ``p * ds`` for p >= 1).

    A run of a vector or more goes a vector at a time (``_VL`` floats, or 8 in a 512-bit build when
    the run is shorter than 16), the last vector overlapping the one before; shorter ones a lane at
    a time (``lane``).  The x pass runs on ``C`` channels per tile and the z pass of a tile row a
    few tiles wide on ``ntx * C``: LLVM's own loop (unrolled to 32 floats in AVX2 code) left such
    runs to its scalar remainder (the 6-point input transform of 512 fragments of 10^3, 24 maps:
    32 ms in AVX2 code, 20 in AVX-512, one Zen 4 core).  ``kind`` is a constant of each function
    made (``vector_transform`` takes it as a literal)."""

    @njit(nogil=True, cache=True, inline="always")
    def runs(d, d0, ds, dstep, v, v0, vs, vstep, L, nb, offs):  # pragma: no cover - compiled
        u = np.uint64
        for b in range(u(nb)):
            db, vb = d0 + b * u(dstep), v0 + b * u(vstep)
            if L >= _VL:
                for i in range(0, L - _VL, _VL):
                    vector_transform(kind, _VL, d, db + u(i), offs, v, vb + u(i), vs)
                vector_transform(kind, _VL, d, db + u(L - _VL), offs, v, vb + u(L - _VL), vs)
            elif _VL == 16 and L >= 8:
                for i in range(0, L - 8, 8):
                    vector_transform(kind, 8, d, db + u(i), offs, v, vb + u(i), vs)
                vector_transform(kind, 8, d, db + u(L - 8), offs, v, vb + u(L - 8), vs)
            else:
                for i in range(u(L)):
                    lane(d, db + i, ds, v, vb + i, vs)

    return runs


_bt8 = _transform_runs(BT8, _bt8_lane)
_bt6 = _transform_runs(BT6, _bt6_lane)
_bt4 = _transform_runs(BT4, _bt4_lane)


@njit(nogil=True, cache=True, inline="always")
def _pairs8(x, j, xs):  # pragma: no cover - compiled
    """The 8 values at x[j + k * xs] as (value at 0, sum and difference per pair of points
    +-1, +-2, +-1/2, value at infinity)."""
    u = np.uint64
    a1, a2, a3, a4 = x[j + xs], x[j + u(2) * xs], x[j + u(3) * xs], x[j + u(4) * xs]
    a5, a6 = x[j + u(5) * xs], x[j + u(6) * xs]
    return x[j], a1 + a2, a1 - a2, a3 + a4, a3 - a4, a5 + a6, a5 - a6, x[j + u(7) * xs]


@njit(nogil=True, cache=True)
def _at8_vectors(m, x, x0, xs, y, y0, ys, L):  # pragma: no cover - compiled
    """:func:`_at8` on runs of 8 lanes or more: a vector at a time (``_VL`` floats, or 8 in a
    512-bit build when the run is shorter than 16), the last vector overlapping the one before."""
    u = np.uint64
    offs = (xs, u(2) * xs, u(3) * xs, u(4) * xs, u(5) * xs, u(6) * xs, u(7) * xs)
    w = _VL if L >= _VL else 8
    last = L - w
    for q in range(0, L, w):
        i = u(min(q, last))
        if w == _VL:
            if m == 4:
                vector_transform(_AT4, _VL, x, x0 + i, offs, y, y0 + i, ys)
            elif m == 5:
                vector_transform(_AT5, _VL, x, x0 + i, offs, y, y0 + i, ys)
            elif m == 6:
                vector_transform(_AT6, _VL, x, x0 + i, offs, y, y0 + i, ys)
            else:
                vector_transform(_AT7, _VL, x, x0 + i, offs, y, y0 + i, ys)
        elif m == 4:
            vector_transform(_AT4, 8, x, x0 + i, offs, y, y0 + i, ys)
        elif m == 5:
            vector_transform(_AT5, 8, x, x0 + i, offs, y, y0 + i, ys)
        elif m == 6:
            vector_transform(_AT6, 8, x, x0 + i, offs, y, y0 + i, ys)
        else:
            vector_transform(_AT7, 8, x, x0 + i, offs, y, y0 + i, ys)


@njit(nogil=True, cache=True, inline="always")
def _at8(m, x, x0, xs, y, y0, ys, L):  # pragma: no cover - compiled
    """y[:, i] = AT x[:, i] for i < L, a = 8, m = 4-7 outputs: row k is sum_p p^k x_p over the
    points 0, +-1, +-2, +-1/2, so per pair the sum (even k) or difference (odd k) of its two
    values; the infinity value joins row m - 1.  One loop per m: a branch on m inside the
    loop kept it scalar (9x slower)."""
    u = np.uint64
    c2, c4, c8, c16, c32, c64 = (
        np.float32(2.0),
        np.float32(4.0),
        np.float32(8.0),
        np.float32(16.0),
        np.float32(32.0),
        np.float32(64.0),
    )
    h1, h2, h3, h4, h5, h6 = (
        np.float32(0.5),
        np.float32(0.25),
        np.float32(0.125),
        np.float32(0.0625),
        np.float32(0.03125),
        np.float32(0.015625),
    )
    x0, xs, y0, ys = u(x0), u(xs), u(y0), u(ys)
    if L >= 8 and (L >= _VL or _VL == 16):
        _at8_vectors(m, x, x0, xs, y, y0, ys, L)
        return
    y2, y3, y4, y5, y6 = u(2) * ys, u(3) * ys, u(4) * ys, u(5) * ys, u(6) * ys
    if m == 4:
        for i in range(u(L)):
            a0, s1, d1, s2, d2, s3, d3, a7 = _pairs8(x, x0 + i, xs)
            k = y0 + i
            y[k] = a0 + s1 + s2 + s3
            y[k + ys] = d1 + c2 * d2 + h1 * d3
            y[k + y2] = s1 + c4 * s2 + h2 * s3
            y[k + y3] = d1 + c8 * d2 + h3 * d3 + a7
    elif m == 5:
        for i in range(u(L)):
            a0, s1, d1, s2, d2, s3, d3, a7 = _pairs8(x, x0 + i, xs)
            k = y0 + i
            y[k] = a0 + s1 + s2 + s3
            y[k + ys] = d1 + c2 * d2 + h1 * d3
            y[k + y2] = s1 + c4 * s2 + h2 * s3
            y[k + y3] = d1 + c8 * d2 + h3 * d3
            y[k + y4] = s1 + c16 * s2 + h4 * s3 + a7
    elif m == 6:
        for i in range(u(L)):
            a0, s1, d1, s2, d2, s3, d3, a7 = _pairs8(x, x0 + i, xs)
            k = y0 + i
            y[k] = a0 + s1 + s2 + s3
            y[k + ys] = d1 + c2 * d2 + h1 * d3
            y[k + y2] = s1 + c4 * s2 + h2 * s3
            y[k + y3] = d1 + c8 * d2 + h3 * d3
            y[k + y4] = s1 + c16 * s2 + h4 * s3
            y[k + y5] = d1 + c32 * d2 + h5 * d3 + a7
    else:
        for i in range(u(L)):
            a0, s1, d1, s2, d2, s3, d3, a7 = _pairs8(x, x0 + i, xs)
            k = y0 + i
            y[k] = a0 + s1 + s2 + s3
            y[k + ys] = d1 + c2 * d2 + h1 * d3
            y[k + y2] = s1 + c4 * s2 + h2 * s3
            y[k + y3] = d1 + c8 * d2 + h3 * d3
            y[k + y4] = s1 + c16 * s2 + h4 * s3
            y[k + y5] = d1 + c32 * d2 + h5 * d3
            y[k + y6] = s1 + c64 * s2 + h6 * s3 + a7


def _at8_epilogue(m):
    """``one(code, x, x0, offs, y, y0, ys, bias, b0, alpha)``: one vector of :func:`_at8_act`, AT8
    with ``m`` outputs (a constant of the function made) and a branch per epilogue ``code``
    (:func:`.epilogue.vector_transform_act` takes both as constants)."""
    kind = AT8 + m

    @njit(nogil=True, cache=True, inline="always")
    def one(code, x, x0, offs, y, y0, ys, bias, b0, alpha):  # pragma: no cover - compiled
        if code == 0:
            vector_transform_act(kind, _VL, x, x0, offs, y, y0, ys, bias, b0, 0, alpha)
        elif code == 1:
            vector_transform_act(kind, _VL, x, x0, offs, y, y0, ys, bias, b0, 1, alpha)
        elif code == 2:
            vector_transform_act(kind, _VL, x, x0, offs, y, y0, ys, bias, b0, 2, alpha)
        else:
            vector_transform_act(kind, _VL, x, x0, offs, y, y0, ys, bias, b0, 3, alpha)

    return one


_at4_act, _at5_act, _at6_act, _at7_act = (_at8_epilogue(m) for m in (4, 5, 6, 7))


@njit(nogil=True, cache=True)
def _at8_act(m, x, x0, xs, y, y0, ys, L, bias, code, alpha):  # pragma: no cover - compiled
    """y[r, i] = act(AT x[:, i] + bias[i]) for i < L (``L >= _VL``), a = 8, m = 4-7 outputs: the
    output transform's last pass with the bias and the epilogue ``code`` applied in registers
    (:func:`.epilogue.vector_transform_act`), so the staged rows need no pass of their own for them
    (the same values as :func:`_at8` then :func:`_bias_act`).  A vector at a time, the last one
    overlapping the one before."""
    u = np.uint64
    x0, xs, y0, ys = u(x0), u(xs), u(y0), u(ys)
    offs = (xs, u(2) * xs, u(3) * xs, u(4) * xs, u(5) * xs, u(6) * xs, u(7) * xs)
    last = L - _VL
    for q in range(0, L, _VL):
        i = u(min(q, last))
        if m == 6:  # F(6,3): every 3-tap axis
            _at6_act(code, x, x0 + i, offs, y, y0 + i, ys, bias, i, alpha)
        elif m == 7:
            _at7_act(code, x, x0 + i, offs, y, y0 + i, ys, bias, i, alpha)
        elif m == 5:
            _at5_act(code, x, x0 + i, offs, y, y0 + i, ys, bias, i, alpha)
        else:
            _at4_act(code, x, x0 + i, offs, y, y0 + i, ys, bias, i, alpha)


@njit(nogil=True, cache=True)
def _bt_rows(a, d, d0, ds, dstep, v, v0, vs, vstep, L, nb):  # pragma: no cover - compiled
    """v[:, i] = BT d[:, i] for i < L, on ``nb`` runs ``dstep`` and ``vstep`` apart."""
    u = np.uint64
    d0, ds, v0, vs = u(d0), u(ds), u(v0), u(vs)
    o3 = (ds, u(2) * ds, u(3) * ds)  # points 1-3 (1-5, 1-7) from point 0
    if a == 4:
        _bt4(d, d0, ds, dstep, v, v0, vs, vstep, L, nb, o3)
        return
    o5 = o3 + (u(4) * ds, u(5) * ds)
    if a == 6:
        _bt6(d, d0, ds, dstep, v, v0, vs, vstep, L, nb, o5)
        return
    if a == 8:
        _bt8(d, d0, ds, dstep, v, v0, vs, vstep, L, nb, o5 + (u(6) * ds, u(7) * ds))
        return
    for b in range(np.uint64(nb)):
        db, vb = d0 + b * np.uint64(dstep), v0 + b * np.uint64(vstep)
        for i in range(np.uint64(L)):
            v[vb + i] = d[db + i]


@njit(nogil=True, cache=True, inline="always")
def _pairs6(x, j, xs):  # pragma: no cover - compiled
    """The 6 values at x[j + k * xs] as (value at 0, sum and difference per pair of points
    +-1, +-2, value at infinity)."""
    u = np.uint64
    a1, a2, a3, a4 = x[j + xs], x[j + u(2) * xs], x[j + u(3) * xs], x[j + u(4) * xs]
    return x[j], a1 + a2, a1 - a2, a3 + a4, a3 - a4, x[j + u(5) * xs]


@njit(nogil=True, cache=True)
def _at(a, m, x, x0, xs, y, y0, ys, L):  # pragma: no cover - compiled
    """y[:, i] = AT x[:, i] for i < L: ``a`` values in, ``m`` out (1 and 1: the identity).
    Row k evaluates at the points (powers k); the infinity value joins row m - 1.  One loop
    per (a, m), as in :func:`_at8`."""
    u = np.uint64
    c2, c4, c8, c16 = np.float32(2.0), np.float32(4.0), np.float32(8.0), np.float32(16.0)
    if a == 8:
        _at8(m, x, x0, xs, y, y0, ys, L)
        return
    x0, s1, s2, s3, y0, t1, t2, t3 = _strides(x0, xs, y0, ys)
    if a == 6 and m == 2:
        for i in range(u(L)):
            v0, p1, d1, p2, d2, v5 = _pairs6(x, x0 + i, s1)
            y[y0 + i] = v0 + p1 + p2
            y[y0 + i + t1] = d1 + c2 * d2 + v5
    elif a == 6 and m == 3:
        for i in range(u(L)):
            v0, p1, d1, p2, d2, v5 = _pairs6(x, x0 + i, s1)
            y[y0 + i] = v0 + p1 + p2
            y[y0 + i + t1] = d1 + c2 * d2
            y[y0 + i + t2] = p1 + c4 * p2 + v5
    elif a == 6 and m == 4:
        for i in range(u(L)):
            v0, p1, d1, p2, d2, v5 = _pairs6(x, x0 + i, s1)
            y[y0 + i] = v0 + p1 + p2
            y[y0 + i + t1] = d1 + c2 * d2
            y[y0 + i + t2] = p1 + c4 * p2
            y[y0 + i + t3] = d1 + c8 * d2 + v5
    elif a == 6:
        for i in range(u(L)):
            v0, p1, d1, p2, d2, v5 = _pairs6(x, x0 + i, s1)
            y[y0 + i] = v0 + p1 + p2
            y[y0 + i + t1] = d1 + c2 * d2
            y[y0 + i + t2] = p1 + c4 * p2
            y[y0 + i + t3] = d1 + c8 * d2
            y[y0 + i + t2 + t2] = p1 + c16 * p2 + v5
    elif a == 4 and m == 2:
        for i in range(u(L)):
            j = x0 + i
            v0, v1, v2, v3 = x[j], x[j + s1], x[j + s2], x[j + s3]
            y[y0 + i] = v0 + v1 + v2
            y[y0 + i + t1] = v1 - v2 + v3
    elif a == 4:
        for i in range(u(L)):
            j = x0 + i
            v0, v1, v2, v3 = x[j], x[j + s1], x[j + s2], x[j + s3]
            y[y0 + i] = v0 + v1 + v2
            y[y0 + i + t1] = v1 - v2
            y[y0 + i + t2] = v1 + v2 + v3
    else:
        for i in range(u(L)):
            y[y0 + i] = x[x0 + i]


@njit(nogil=True, cache=True)
def _to_channels_last(x, n, z, y, R, rb):  # pragma: no cover - compiled
    """R[rb + k * C + c] = x[n, c, z, y, k]: one input row, channels last (short rows
    (MPF fragments) gathered along the channels, long ones scattered: 3x faster each)."""
    _, C, Z, Y, X = x.shape
    u = np.uint64
    xf = x.reshape(-1)
    plane, C_, X_ = u(Z * Y * X), u(C), u(X)
    base = u(((n * C * Z + z) * Y + y) * X)
    if X <= 32:
        for k in range(X_):
            dst = u(rb) + k * C_
            for c in range(C_):
                R[dst + c] = xf[base + c * plane + k]
    else:
        for c in range(C_):
            src, dst = base + c * plane, u(rb) + c
            for k in range(X_):
                R[dst + k * C_] = xf[src + k]


@njit(nogil=True, cache=True, inline="always", fastmath={"contract"})
def _bias_act(S, sb, m, bias, code, alpha):  # pragma: no cover - compiled
    """S[sb + j] = act(S[sb + j] + bias[j]) for j < m: a staged output row's bias and epilogue, two
    long loops over the row (the padding columns go along, unread)."""
    for j in range(m):
        S[sb + j] += bias[j]
    act_row(S, sb, sb + m, code, alpha)


@njit(nogil=True, cache=True)
def _to_channels_first(S, sb, ntx, mx, ldm, out, n, z, y):  # pragma: no cover - compiled
    """out[n, o, z, y, i] = S[sb + (k * ntx + t) * ldm + o] for i = t * mx + k: one finished staged
    output row (:func:`_output_transform`'s layout: per x point ``k`` of the tiles, the row's
    ``ntx`` tiles of ``ldm`` channels) back to channels first (``out`` may be a strided view),
    each channel's output row in order, a voxel at a time.  Per
    voxel, its channels loaded as a vector and each lane stored into its own row took 1.2-1.5x as
    long in a whole layer (2026-11-30, interleaved: 28 maps on 18 x 320^2, two threads, 300-330
    against 240-270 ms; 24 maps on 16 x 192^2, one core, 150-160 against 115 ms in 512-bit code and
    155-165 against 105-110 in AVX2 code): one channel's row at a time streams its stores."""
    _, O, _, _, Xo = out.shape
    u = np.uint64
    L, sb = u(ldm), u(sb)
    for o in range(O):
        orow = out[n, o, z, y]
        for t in range(ntx):
            for k in range(mx):
                i = t * mx + k
                if i < Xo:
                    orow[i] = S[sb + u(k * ntx + t) * L + u(o)]


@njit(nogil=True, cache=True)
def _staged_row_out(S, sb, ntx, mx, ldm, out, n, z, y):  # pragma: no cover - compiled
    """out[n, z, y, i, o] = S[sb + (k * ntx + t) * ldm + o] for i = t * mx + k: one finished staged
    output row into a channels-last output's memory ``out`` (N, Z, Y, X, C_out) (a strided view
    allowed), each voxel's ``C_out`` values a vector at a time, the last vector overlapping
    (:func:`.vector_copy`): per voxel, LLVM's loops over 24-48 channels ran as their scalar
    remainder in AVX2 code."""
    _, _, _, Xo, O = out.shape
    u = np.uint64
    L, sb = u(ldm), u(sb)
    orow = out[n, z, y]
    vec = O >= _VL and orow.strides[1] == orow.itemsize
    s0 = u(orow.strides[0] // orow.itemsize)
    for t in range(ntx):
        for k in range(mx):
            i = t * mx + k
            if i < Xo:
                base = sb + u(k * ntx + t) * L
                if vec:
                    d = u(i) * s0
                    for c in range(0, O - _VL, _VL):
                        vector_copy(_VL, orow, d + u(c), S, base + u(c))
                    vector_copy(_VL, orow, d + u(O - _VL), S, base + u(O - _VL))
                    continue
                r = orow[i]
                for o in range(O):
                    r[o] = S[base + u(o)]


@njit(nogil=True, cache=True, inline="always")
def _padded_row(R, rb, xf, src, C, lx, X, p0, p1):  # pragma: no cover - compiled
    """R[rb + p * C + c] for p in [p0, p1): the input row at ``xf[src:]`` (X values of C channels,
    channels last) shifted right by ``lx``, zero outside it."""
    a = min(max(p0, lx), p1)
    b = max(a, min(p1, lx + X))
    fill_run(R, rb + p0 * C, rb + a * C, np.float32(0.0))
    copy_run(R, rb + a * C, xf, src + (a - lx) * C, (b - a) * C)
    fill_run(R, rb + b * C, rb + p1 * C, np.float32(0.0))


@njit(nogil=True, cache=True)
def _input_transform(x, V, r0, r1, nty, ntz, ntx, ms, al, R, P, Q, lz, ly, lx, cl):  # pragma: no cover - compiled
    """V[t, (r - r0) * ntx + i, c] (V flat, C order, ``NT`` tiles per position) = position
    t of the transform of tile i of tile row r, channel c, for tile rows r in [r0, r1);
    ``x`` starts at ``(lz, ly, lx)`` of the input: before it and past its edge reads as 0.
    ``x`` is ``(N, C, Z, Y, X)``, or with ``cl`` the memory of a channels-last input
    ``(N, Z, Y, X, C)`` (C-contiguous both).

    Channels last, so every 1D transform runs on vectors of C channels whatever the width
    of the plane (MPF fragments are a few tiles wide): the tile row's input rows are first
    transposed into ``R`` (az, ay, W, C) (with ``cl``, only the edge tiles' values are copied
    there, zero-padded: the others are read from the input row itself; the copy took a quarter of
    the transform of 24 channels), then the row's tiles together
    (``P`` and ``Q`` (az, ay, ax, ntx, C)): x (into ``P``), y (into ``V`` for one-deep kernels,
    else ``Q``) and z (into ``V``), each a few calls of :func:`_bt_rows` on long runs (per
    tile, about 100 calls of 24 channels each took 1.25x to 1.35x as long, channels last)."""
    if cl:
        _, Z, Y, X, C = x.shape
    else:
        _, C, Z, Y, X = x.shape
    xf = x.reshape(-1)
    mz, my, mx = ms
    az, ay, ax = al
    T = az * ay * ax
    NT = V.shape[0] // (T * C)
    W = R.shape[0] // (az * ay * C)
    RC = ntx * C  # P and Q are (az, ay, ax, ntx, C): a point's tiles and channels are one run
    # the tiles that read inside a channels-last row, straight from it (no copy into R)
    t_lo = min(ntx, (lx + mx - 1) // mx)
    t_hi = max(t_lo, min(ntx, (X + lx - ax) // mx + 1 if X + lx >= ax else 0))
    e0 = 0 if t_lo == 0 else min(W, (t_lo - 1) * mx + ax)  # R's values the edge tiles read
    s1 = W if t_hi == ntx else t_hi * mx
    for r in range(r0, r1):
        n = r // (ntz * nty)
        z0, y0 = ((r // nty) % ntz) * mz, (r % nty) * my
        tb = (r - r0) * ntx  # the row's first tile in V
        for i in range(az):
            for j in range(ay):
                row = i * ay + j
                rb, pb = row * W * C, row * ax * RC
                zz, yy = z0 + i - lz, y0 + j - ly
                if cl and t_hi > t_lo and 0 <= zz < Z and 0 <= yy < Y:
                    # x: the edge tiles from R, the others from the input row itself
                    src = ((n * Z + zz) * Y + yy) * X * C
                    _padded_row(R, rb, xf, src, C, lx, X, 0, e0)
                    _padded_row(R, rb, xf, src, C, lx, X, s1, W)
                    _bt_rows(ax, R, rb, C, mx * C, P, pb, RC, C, C, t_lo)
                    _bt_rows(ax, xf, src + (t_lo * mx - lx) * C, C, mx * C, P, pb + t_lo * C, RC, C, C, t_hi - t_lo)
                    _bt_rows(ax, R, rb + t_hi * mx * C, C, mx * C, P, pb + t_hi * C, RC, C, C, ntx - t_hi)
                    continue
                if 0 <= zz < Z and 0 <= yy < Y:
                    fill_run(R, rb, rb + lx * C, np.float32(0.0))
                    if cl:
                        src = ((n * Z + zz) * Y + yy) * X * C
                        copy_run(R, rb + lx * C, xf, src, X * C)
                    else:
                        _to_channels_last(x, n, zz, yy, R, rb + lx * C)
                    fill_run(R, rb + (lx + X) * C, rb + W * C, np.float32(0.0))
                else:
                    fill_run(R, rb, rb + W * C, np.float32(0.0))
                # x: per input row, its ntx tiles (mx * C apart in R)
                _bt_rows(ax, R, rb, C, mx * C, P, pb, RC, C, C, ntx)
        # no literal arguments: a literal 0 or 1 makes numba compile _bt_rows once more for it
        # (three signatures: a second of a warmup's compile each)
        zero = r - r
        if az == 1:  # y, into V: per x point, a run of the row's tiles
            _bt_rows(ay, P, zero, ax * RC, RC, V, tb * C, ax * NT * C, NT * C, RC, ax)
        else:
            for i in range(az):  # y: per z point, the ax points' runs are one run
                _bt_rows(ay, P, i * ay * ax * RC, ax * RC, zero, Q, i * ay * ax * RC, ax * RC, zero, ax * RC, zero + 1)
            # z, into V: per (y, x) point, a run of the row's tiles
            _bt_rows(az, Q, zero, ay * ax * RC, RC, V, tb * C, ay * ax * NT * C, NT * C, RC, ay * ax)


@njit(nogil=True, cache=True)
def _output_transform(
    M, ldm, out, r0, r1, nty, ntz, ntx, ms, al, bias, code, alpha, P, Q, S, cl
):  # pragma: no cover - compiled
    """out[n, o, tile (r, i)] = act(AT M[:, tile, o] + bias[o]) (the epilogue, M flat:
    (T, NT, ldm) in C order, ``ldm >= C_out``) for tile rows [r0, r1); outputs past the edge are
    dropped; ``bias`` (``ntx * mx * ldm``) is the layer's bias zero-padded to ``ldm`` columns and
    repeated over a staged row's voxels (:func:`_staged_row_out`).  Channels last as in
    :func:`_input_transform`, a tile row at a time: a position's tiles in the row are one run of
    ``ntx * ldm`` values in ``M`` (padding columns go along), so
    each pass is a few calls on long runs: z (into ``P`` (mz, ay, ax, ntx, ldm)), y (into ``Q``
    (mz, my, ax, ntx, ldm)), x (into the staged output rows ``S`` (mz, my, mx, ntx, ldm)); then
    ``S`` is transposed into ``out`` (copied, with ``cl``: ``out`` is then a channels-last
    output's memory ``(N, Z, Y, X, C_out)``).  Per tile, 14-78 calls on runs of ``C_out`` took
    1.6-2x as long."""
    if cl:
        _, Zo, Yo, Xo, O = out.shape
    else:
        _, O, Zo, Yo, Xo = out.shape
    mz, my, mx = ms
    az, ay, ax = al
    T = az * ay * ax
    NT = M.shape[0] // (T * ldm)
    RC = ntx * ldm  # one position's tiles of the row
    u = np.uint64
    finished = ax == 8 and RC >= _VL  # the x pass adds the bias and applies the epilogue
    for r in range(r0, r1):
        n = r // (ntz * nty)
        tz, ty = (r // nty) % ntz, r % nty
        m0 = (r - r0) * ntx * ldm  # the row's first tile in M
        if az > 1:  # z: per (y, x) point, the row's tiles
            for p in range(ay * ax):
                _at(az, mz, M, p * NT * ldm + m0, ay * ax * NT * ldm, P, p * RC, ay * ax * RC, RC)
            for rz in range(mz):  # y: per z output, the ax points' runs are one run
                _at(ay, my, P, rz * ay * ax * RC, ax * RC, Q, rz * my * ax * RC, ax * RC, ax * RC)
        else:  # y straight from M: per x point, the row's tiles
            for bx in range(ax):
                _at(ay, my, M, bx * NT * ldm + m0, ax * NT * ldm, Q, bx * RC, ax * RC, RC)
        for q in range(mz * my):  # x: per (z, y) output, into the staged row
            if finished:  # bias and epilogue in the same pass
                _at8_act(mx, Q, q * ax * RC, RC, S, q * mx * RC, RC, RC, bias, code, alpha)
            else:
                _at(ax, mx, Q, q * ax * RC, RC, S, q * mx * RC, RC, RC)
        for rz in range(mz):
            z = tz * mz + rz
            if z >= Zo:
                break
            for ry in range(my):
                y = ty * my + ry
                if y >= Yo:
                    break
                sb = (rz * my + ry) * mx * RC
                if not finished:
                    _bias_act(S, sb, u(mx * ntx * ldm), bias, code, alpha)
                if cl:
                    _staged_row_out(S, sb, ntx, mx, ldm, out, n, z, y)
                else:
                    _to_channels_first(S, sb, ntx, mx, ldm, out, n, z, y)


# ----------------------------------------------------------------------------- the layer
class WinogradConv(ResidentConv):
    """A valid 3-D convolution by Winograd minimal filtering (kernels of 1-5 on every axis).

    A call may take ``low`` (:attr:`PADS_INPUT`): a zero-padded convolution reads its input
    rows from ``x`` at that offset and zeros elsewhere, with no padded copy of ``x``.

    Parameters
    ----------
    w : array, shape (C_out, C_in, kz, ky, kx), each in 1-5 (not all 1)
    b : array, shape (C_out,), or None
    in_spatial : 3-tuple
        Input spatial shape of the calls.
    threads : int
        Workers, each running whole blocks of tile rows (transforms and single-threaded GEMMs).
    xp : module
        ``numpy`` (numba transforms + BLAS) or ``cupy`` (array operations + cuBLAS).

    Examples
    --------
    >>> import numpy as np
    >>> conv = WinogradConv(np.ones((2, 3, 1, 3, 3), np.float32), None, (4, 6, 6))
    >>> y = conv(np.ones((1, 3, 4, 6, 6), np.float32))
    >>> y.shape, round(float(y[0, 1, 2, 0, 0]), 3)
    ((1, 2, 4, 4, 4), 27.0)
    """

    PADS_INPUT = True
    WRITES_CHANNELS_LAST = True

    def __init__(self, w, b, in_spatial, *, threads=1, xp=np):
        w = self._setup(w, b, in_spatial, threads, xp)
        tr = _axis_transforms(self.kernel, self.out_spatial)
        self.ms, self.al, self.nt = winograd_tiles(self.out_spatial, self.kernel)
        self.T = math.prod(self.al)
        self.BT = tuple(np.ascontiguousarray(t[0], np.float32) for t in tr)
        self.AT = tuple(np.ascontiguousarray(t[2], np.float32) for t in tr)
        # U[t] = (Gz x Gy x Gx) w[o, c] as (C_in, C_out), computed in float64
        wh = w.get() if hasattr(w, "get") else np.asarray(w)
        u = np.einsum("ai,bj,ek,ocijk->abeco", tr[0][1], tr[1][1], tr[2][1], wh.astype(np.float64), optimize=True)
        u = np.ascontiguousarray(u.reshape(self.T, self.c_in, self.c_out), np.float32)
        #: the register tiles' shape (:mod:`.microkernel`); on the CPU ``U`` is kept with whole
        #: tiles of zero columns (the tiles' loads), BLAS and the GPU read its first ``C_out``
        self.register_tile = microkernel.tile_shape(self.c_out, _wide())
        self.U = microkernel.pad_columns(u, self.register_tile) if xp is np else xp.asarray(u)
        #: a call without ``out`` returns a channels-last array (:mod:`.layout`; numpy only);
        #: chosen with ``act`` by :meth:`configured`.  The input may be channels last either way.
        self.channels_last = False

    @property
    def kernel_cache_bytes(self) -> int:
        """Bytes held by the resident transformed kernels ``U`` (T, C_in, C_out)."""
        return int(self.U.nbytes)

    # -- any xp (the GPU): tiles as a strided view, transforms as tensordots
    def _call_xp(self, x, low):
        xp = get_array_module(x)
        n, C, O = x.shape[0], self.c_in, self.c_out
        ms, al, nt = self.ms, self.al, self.nt
        padded = tuple(t * m + a - m for t, m, a in zip(nt, ms, al))  # >= in_spatial
        xpad = xp.zeros((n, C) + padded, xp.float32)
        xpad[(slice(None), slice(None)) + tuple(slice(lo, lo + e) for lo, e in zip(low, x.shape[2:]))] = x
        s = xpad.strides
        tiles = xp.lib.stride_tricks.as_strided(
            xpad, (n, C) + nt + al, s[:2] + tuple(st * m for st, m in zip(s[2:], ms)) + s[2:]
        )
        v = tiles
        for axis in range(3):  # contract each tile axis with its BT: the new axis goes last
            v = xp.tensordot(v, xp.asarray(self.BT[axis]), axes=([5], [1]))
        # v: (n, C, tz, ty, tx, az, ay, ax) -> V (T, C, tiles)
        V = xp.ascontiguousarray(v.transpose(5, 6, 7, 1, 0, 2, 3, 4).reshape(self.T, C, -1))
        del v, tiles, xpad
        M = xp.matmul(self.U[:, :, :O].transpose(0, 2, 1), V).reshape(
            al + (O, n) + nt
        )  # (az, ay, ax, O, n, tz, ty, tx)
        del V
        for axis in range(3):  # contract az, ay, ax in turn with AT: the new (m) axis goes last
            M = xp.tensordot(M, xp.asarray(self.AT[axis]), axes=([0], [1]))
        # M: (O, n, tz, ty, tx, mz, my, mx) -> (n, O, tz, mz, ty, my, tx, mx)
        y = M.transpose(1, 0, 2, 5, 3, 6, 4, 7).reshape((n, O) + tuple(t * m for t, m in zip(nt, ms)))
        zo, yo, xo = self.out_spatial
        y = xp.ascontiguousarray(y[:, :, :zo, :yo, :xo], dtype=xp.float32)
        if self.bias is not None:
            y += self.bias.reshape(1, -1, 1, 1, 1)
        return y

    # -- CPU: numba transforms over blocks of tile rows, T products per block
    def _buffers(self, n, blas):
        """Per worker: its own block of ``V`` and ``M`` and transform scratch (a worker runs
        whole blocks: transforms and products stay on one core's cache).  For the register
        tiles (:mod:`.microkernel`) ``V`` and ``M`` have whole tiles of rows and ``M`` whole
        tiles of columns (``M`` (T, rows, ldm)), so every tile reads and writes in place."""
        hit = self._work
        if hit is not None and hit[0] == (n, blas):
            return hit[1]
        self._work = None
        (mz, my, mx), (az, ay, ax), (ntz, nty, ntx) = self.ms, self.al, self.nt
        rows = n * ntz * nty
        br, workers = _blocks(rows, ntx, self.T, self.c_in, self.c_out, self.threads)
        shape = self.register_tile
        if blas:
            tiles, ldm = br * ntx, self.c_out
        else:
            tiles, ldm = -(-br * ntx // shape[0]) * shape[0], self.U.shape[2]
        c = max(self.c_in, ldm)
        sets = []
        for _ in range(workers):
            # V (per position: tiles x channels) and M; a tile row's input rows channels last, its
            # two stage buffers, staged output rows: each pass reads one and writes another,
            # their starts apart within a page (:func:`.buffers.staggered`)
            V, M, *scratch = staggered(
                (
                    self.T * tiles * self.c_in,
                    self.T * tiles * ldm,
                    az * ay * (ntx * mx + ax - mx) * self.c_in,
                    self.T * ntx * c,
                    self.T * ntx * c,
                    mz * my * ntx * mx * ldm,
                )
            )
            V[:] = 0.0  # rows past a block's tiles are read by whole register tiles
            sets.append((V.reshape(self.T, tiles, self.c_in), M.reshape(self.T, tiles, ldm), tuple(scratch)))
        # the register tiles' scratch, one per thread (one worker splits its products over them)
        tails = [] if blas else [microkernel.Scratch(self.c_in, self.c_out, shape) for _ in range(self.threads)]
        # the bias per staged output row: zero-padded to M's columns, repeated over its voxels
        bias = np.zeros((ntx * mx, ldm), np.float32)
        if self.bias is not None:
            bias[:, : self.c_out] = self.bias
        bufs = (br, sets, tails, bias.reshape(-1))  # run by the caller and pooled threads (each_worker)
        self._work = ((n, blas), bufs)
        return bufs

    def _call_cpu(self, x, out, low):
        if out is not None and out.dtype != np.float32:  # the kernels store float32 values in place
            raise InputError(f"WinogradConv writes float32; got an out of {out.dtype}")
        n, O = x.shape[0], self.c_out
        ntz, nty, ntx = self.nt
        blas = bool(tuning.get("winograd.blas"))
        br, sets, tails, bias = self._buffers(n, blas)
        workers = len(sets)
        cl_in = is_channels_last(x) and x.dtype == np.float32
        xs = memory_order(x) if cl_in else np.ascontiguousarray(x, dtype=np.float32)
        if out is None:
            out = (
                empty_channels_last((n, O) + self.out_spatial)
                if self.channels_last
                else arena.empty((n, O) + self.out_spatial)
            )
        cl_out = channels_inner(out)  # a channels-last destination, whole or a block of one
        dst = memory_order(out) if cl_out else out
        ldm = sets[0][1].shape[2]
        code, alpha = self.epilogue
        rows = n * ntz * nty
        blocks = [(r0, min(rows, r0 + br)) for r0 in range(0, rows, br)]
        T, U = self.T, self.U

        def products(w, V, M, k):
            """M[:, :k] = V[:, :k] @ U: T products on worker ``w``, or split by position over
            the layer's threads when one worker runs every block."""
            if blas:
                (gemm if workers == 1 else np.matmul)(V[:, :k], U[:, :, :O], out=M[:, :k])
            elif workers > 1 or len(tails) == 1:
                microkernel.batched_products(V, U, M, k, O, tails[w])
            else:
                parts = len(tails)
                each_worker(
                    lambda p: microkernel.batched_products(
                        V, U, M, k, O, tails[p], p * T // parts, (p + 1) * T // parts
                    ),
                    parts,
                )

        def work(w):
            V, M, (R, P, Q, S) = sets[w]
            Vf, Mf = V.reshape(-1), M.reshape(-1)
            for r0, r1 in blocks[w::workers]:
                k = (r1 - r0) * ntx
                _input_transform(xs, Vf, r0, r1, nty, ntz, ntx, self.ms, self.al, R, P, Q, *low, cl_in)
                products(w, V, M, k)
                _output_transform(
                    Mf, ldm, dst, r0, r1, nty, ntz, ntx, self.ms, self.al, bias, code, alpha, P, Q, S, cl_out
                )

        if workers == 1:
            work(0)
        else:  # each worker's products on its own thread: no BLAS pool spinning against the workers
            with blas_limit(1):
                each_worker(work, workers)
        if not self.keep_buffers:
            self.release()
        return out
