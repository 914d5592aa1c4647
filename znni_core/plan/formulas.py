"""The functional forms of the time model, shared by the calibration that fits their rates
(:mod:`.timing`, :mod:`.gpu_timing`) and the primitives that price calls with them
(:mod:`.primitives`): work counts of a call, and interpolation between calibrated points.

>>> loglog([[10, 1.0], [1000, 100.0]], 100)
10.0
"""

from __future__ import annotations

import math

from .. import layers as L

F32 = 4
C64 = 8
#: (input, kernel) of the direct-conv calibration, 24 -> 24 maps (its efficiency: the model's reference
#: for direct-numba's grouped rows)
NUMBA_CALIBRATION_SHAPE = ((34, 34, 34), (3, 3, 3))
#: ... and of its register tiles: output rows of 192 values, whole tiles of every build
NUMBA_TILES_CALIBRATION_SHAPE = ((6, 34, 194), (3, 3, 3))
DIRECT_ITEM_S = 6e-5  # direct-gemm's Python work per fragment (see primitives.DirectGemm)
FFT_GEMM_ROWS = 16  # items per product at and above which the calibrated GEMM rate holds
FFT_GEMM_COPY = 6.0  # transposes, padding and cropping, in units of log2(V) per transformed value
LAUNCH_S = 1e-5  # one GPU kernel launch and its Python dispatch


def size_factor(v: float, rates: dict, part: str, mode: str | None = None) -> float:
    """Slow-down of an FFT term at transform volume ``v`` relative to the calibration size:
    interpolated in log(v) between the two calibrated sizes (extrapolated up to 1.5x the span; never faster than at the first size)."""
    sf = rates.get("size")
    if not sf:
        return 1.0
    f = sf[part][mode] if mode else sf[part]
    e = math.log(v / sf["v0"]) / math.log(sf["v1"] / sf["v0"])
    return float(f ** min(max(e, 0.0), 1.5))


def fft_gemm_terms(n, cin, cout, in_spatial, kernel):
    """(transform work, complex multiply-adds, items) of one fft-gemm call: ``items (C_in +
    C_out) V (log2 V + copy)``, ``items C_in C_out F`` and the transform items (rows of
    each frequency's product)."""
    items, v, f = L.fft_gemm_sizes(n, in_spatial, kernel)
    return items * (cin + cout) * v * (math.log2(max(v, 2)) + FFT_GEMM_COPY), float(items) * cin * cout * f, items


def winograd_terms(n, cin, cout, in_spatial, kernel):
    """(transformed values, multiply-adds, channel rows, transform positions) of one winograd
    call: ``tiles T (C_in + C_out)``, ``tiles T C_in C_out``, ``tile rows (C_in + C_out)`` (the
    rows are transposed channels last and back, and carry the per-row work of narrow planes)
    and ``tiles T`` (each position's 1D transforms are calls whatever the channels: a 3^3
    tile's 256 positions cost about 4x a (1,3,3) tile's 64, measured 9-18 ns per position both)."""
    T, tiles, nt = L.winograd_sizes(n, in_spatial, kernel)
    rows = tiles // nt[2]
    return (
        float(tiles) * T * (cin + cout),
        float(tiles) * T * cin * cout,
        float(rows) * (cin + cout),
        float(tiles) * T,
    )


def direct_rate(kind: str, k: int, cal) -> float:
    """FLOP/s of a direct conv with reduction length ``k = C_in * prod(kernel)``."""
    return loglog(cal.direct_points[kind], k)


def loglog(points, k) -> float:
    """The value at ``k`` between two calibrated points ``[[k0, v0], [k1, v1]]``: log-log
    interpolation, clamped outside them."""
    (k0, r0), (k1, r1) = points
    e = min(max(math.log(max(k, 1) / k0) / math.log(k1 / k0), 0.0), 1.0)
    return float(r0 * (r1 / r0) ** e)
