"""Plan under another host's rates: ``ZNNI_TEST_HOST=gemm-fast`` or ``winograd-fast``.

What a plan test asserts must hold whatever host runs it: CI machines differ (AMD Zen 4 and 5,
Intel AVX-512), and their calibrations rank the primitives differently. With the variable set,
every calibration this host measures is rescaled before the planner sees it, as on a host whose
BLAS is much faster than its Winograd (``gemm-fast``) or the other way round
(``winograd-fast``); ``make test-hosts`` runs the planning and pipeline tests under both.
"""

from __future__ import annotations

import copy
import os

#: per setting: factors on the rates (FLOP/s, bytes/s) and on the FFT-family times per unit
PROFILES = {
    "gemm-fast": {"gemm": 1.4, "numba": 0.6, "mem_bw": 0.8, "winograd_time": 3.0, "fft_gemm_time": 0.7},
    "winograd-fast": {"gemm": 0.6, "numba": 1.5, "mem_bw": 1.3, "winograd_time": 0.4, "fft_gemm_time": 1.5},
}


def rescaled(cal, profile: dict):
    """``cal`` (a :class:`~znni_core.plan.calibration.CpuCalibration`) with ``profile`` applied."""
    d = copy.deepcopy(cal.to_dict())
    d["gemm_flops"] *= profile["gemm"]
    d["numba_flops"] *= profile["numba"]
    d["mem_bw"] *= profile["mem_bw"]
    d["direct_points"] = {
        kind: [[k, rate * profile["numba" if kind == "numba" else "gemm"]] for k, rate in points]
        for kind, points in d["direct_points"].items()
    }
    for kind, factor in (("winograd", profile["winograd_time"]), ("gemm", profile["fft_gemm_time"])):
        part = d["fft"].get(kind) or {}
        for key, value in list(part.items()):
            if key.startswith("s_per") or key == "build_s_per_value":
                part[key] = value * factor
            elif key == "mac_points":
                part[key] = [[n, rate / factor] for n, rate in value]
    return type(cal).from_dict(d)


def install() -> str | None:
    """Rescale every calibration of this process when ``ZNNI_TEST_HOST`` names a profile."""
    name = os.environ.get("ZNNI_TEST_HOST")
    if not name:
        return None
    if name not in PROFILES:
        raise ValueError(f"ZNNI_TEST_HOST={name!r}: one of {sorted(PROFILES)}")
    from znni_core.plan import timing

    measured = timing.calibrate

    def calibrate(threads: int = 1, **kw):
        return rescaled(measured(threads, **kw), PROFILES[name])

    timing.calibrate = calibrate
    return name
