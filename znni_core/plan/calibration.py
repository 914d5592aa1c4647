"""A machine's calibration as typed records: the rates the cost models price a plan from.

:func:`.timing.calibrate` measures a :class:`CpuCalibration` once per machine and thread count,
:func:`.gpu_timing.calibrate_device` a :class:`GpuCalibration` once per device; both are cached as
JSON (``to_dict`` / ``from_dict``). The cost models (:mod:`.costs`) and the primitives' formulas
(:mod:`.primitives`) read their fields; a test builds one from a stored calibration, so what it
expects of a plan does not depend on the host it runs on.

>>> cal = GpuCalibration("simulated", 1e12, 1e11, 1e10, 2e10, 1e-10, 1e12)
>>> GpuCalibration.from_dict(cal.to_dict()) == cal, cal.threads
(True, 1)
>>> CpuCalibration.from_dict({"gemm_flops": 1.0, "threads": 2}, "t")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
znni_core.errors.PlanError: t: the calibration lacks numba_flops, mem_bw, ..., pool_s_per_byte; delete it ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..errors import PlanError


class _Record:
    """``to_dict`` / ``from_dict`` of a calibration record (the JSON of the calibration cache)."""

    def to_dict(self) -> dict:
        """The JSON object cached for this calibration."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict, where: str = "calibration"):
        """The record of a cached JSON object; a :class:`PlanError` naming the fields it lacks
        (a calibration of another version is keyed apart; this catches a hand-made one)."""
        fields = dataclasses.fields(cls)
        required = [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in doc
        ]
        if required:
            raise PlanError(f"{where}: the calibration lacks {', '.join(required)}; delete it to measure again")
        return cls(**{f.name: doc[f.name] for f in fields if f.name in doc})


@dataclass(frozen=True)
class CpuCalibration(_Record):
    """This machine's rates at ``threads`` threads (:func:`.timing.calibrate`)."""

    gemm_flops: float  # FLOP/s of a BLAS-lowered direct convolution
    numba_flops: float  # FLOP/s of the numba direct convolution
    mem_bw: float  # bytes/s of an element-wise pass (read + write)
    threads: int
    direct_points: dict  # {"gemm" | "numba": [[reduction length, FLOP/s], ...]}
    fft: dict  # the FFT, FFT-GEMM and Winograd rates (:func:`.timing._fft_rates` and after)
    pointwise_points: list  # [[maps, FLOP/s]] of 1x1x1 chains
    exp_s_per_value: float  # an activation with an exponential, per value
    pool_s_per_byte: float  # MPF channels first, per input byte
    pool_cl_s_per_byte: float | None = None  # MPF channels last (None: at the channels-first rate)
    cpu: str = ""
    tuned: dict = field(default_factory=dict)  # kernel parameters chosen (:mod:`..layers.tuning`)
    tuning_seconds: dict = field(default_factory=dict)  # each parameter's candidates, timed
    level: str = "full"  # how it was measured: "quick" or "full" (:data:`.timing.LEVELS`)


@dataclass(frozen=True)
class GpuCalibration(_Record):
    """A device's rates (:func:`.gpu_timing.calibrate_device`)."""

    device: str  # the device's name ("simulated" for numpy standing in)
    gemm_flops: float
    mem_bw: float
    h2d_bw: float  # host to device from pageable memory, bytes/s
    h2d_pinned_bw: float  # ... from pinned memory
    fft_s_per_vlogv: float  # a batched real FFT, seconds per V log2 V
    numba_flops: float  # the direct convolution's rate (the device's GEMM)
    threads: int = 1
