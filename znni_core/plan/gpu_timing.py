"""The GPU's time model: a roofline of four rates measured on the device once.

A GPU runs the ``xp`` code paths: cuBLAS GEMMs, cuFFT transforms and element-wise
kernels, each near its own roof once the arrays are large.  So a conv's time is its
GEMM FLOPs at the measured GEMM rate, plus its transforms at the measured FFT rate,
plus the bytes it moves (lowering, transposes, crops) at the measured memory
bandwidth, plus a launch cost per kernel call; host transfers go at the measured
host-to-device rate.  The rates are measured on the device by :func:`calibrate_device`
(about 1 s on a GPU) and cached by device name, like the CPU calibration.

The model has not been checked against a GPU yet (no device was lent when it was
written): ``benchmarks/gpu.py`` prints predicted against measured seconds per net.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..cachedir import cache_dir
from ..layers.xp import empty_pinned
from ..net.chain import Conv
from .calibration import GpuCalibration
from .formulas import LAUNCH_S
from .primitives import primitive
from .wisdom import JsonCache

GPU_CALIBRATION_VERSION = 2


def device_name(xp) -> str:
    """The device's name (``simulated`` for the simulated GPU): keys its calibration and measurements."""
    if getattr(xp, "simulated", False):
        return "simulated"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def synchronize(xp) -> None:
    """Wait for the device's queued work (before reading a timer)."""
    xp.cuda.Device().synchronize()


def _best_of(xp, fn, repeats=3) -> float:
    fn()
    synchronize(xp)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(xp)
        ts.append(time.perf_counter() - t0)
    return float(min(ts))


def calibrate_device(xp, *, refresh: bool = False) -> GpuCalibration:
    """GEMM FLOP/s, memory and host-transfer bytes/s and FFT seconds per ``v log2 v`` on ``xp``'s device."""
    name = device_name(xp)
    cache = JsonCache(cache_dir() / "calibration-gpu.json")
    key = f"{GPU_CALIBRATION_VERSION}|{name}"
    if not refresh and (hit := cache.get(key)):
        return GpuCalibration.from_dict(hit, str(cache.path))
    small = name == "simulated"  # numpy speed: small shapes keep the calibration short
    n = 512 if small else 4096
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    gemm = 2.0 * n**3 / _best_of(xp, lambda: xp.matmul(a, a))
    big = xp.zeros(2 ** (22 if small else 26), dtype=np.float32)
    bw = 2.0 * big.nbytes / _best_of(xp, lambda: xp.maximum(big, 0, out=big))
    host = np.zeros(big.shape, np.float32)
    h2d = host.nbytes / _best_of(xp, lambda: xp.asarray(host))  # pageable: the CPU -> GPU stage's hand-over
    pinned = empty_pinned(xp, big.shape)
    pinned[...] = 0
    h2d_pinned = pinned.nbytes / _best_of(xp, lambda: big.set(pinned))  # GPU + host RAM's staged blocks
    e = 32 if small else 64
    vol = xp.zeros((8, e, e, e), dtype=np.float32)
    v = e**3
    fft = _best_of(xp, lambda: xp.fft.rfftn(vol, axes=(1, 2, 3))) / (8 * v * math.log2(v))
    cal = GpuCalibration(
        device=name,
        gemm_flops=gemm,
        mem_bw=bw,
        h2d_bw=h2d,
        h2d_pinned_bw=h2d_pinned,
        fft_s_per_vlogv=fft,
        numba_flops=gemm,
    )
    cache.put(key, cal.to_dict())
    return cal


def transfer_seconds(nbytes: int, cal: GpuCalibration, pinned: bool = False) -> float:
    """Host to device (or back) of ``nbytes``, from pageable or pinned host memory."""
    return nbytes / (cal.h2d_pinned_bw if pinned else cal.h2d_bw) + LAUNCH_S


class DeviceMeasurements:
    """``effort="measure"`` on the GPU: a primitive timed on the real shapes on the device
    (synchronised, best of 2 after a warm-up: cuFFT plans and kernels compiled first),
    cached by device name like the CPU's measurements."""

    def __init__(self, cal: GpuCalibration, xp):
        self.xp = xp
        self.cache = JsonCache(cache_dir() / "measure-gpu.json")
        self.prefix = f"{GPU_CALIBRATION_VERSION}|{cal.device}"

    def conv(self, primitive_name: str, n: int, layer: Conv, in_spatial) -> float:
        """Seconds of one call of ``primitive_name`` on the device (synchronised), cached."""
        key = f"{self.prefix}|{primitive_name}|{n}|{layer.in_channels}|{layer.out_channels}|{tuple(in_spatial)}|{layer.kernel}"
        if (hit := self.cache.get(key)) is not None:
            return hit
        xp = self.xp
        x = xp.asarray(
            np.random.default_rng(0).standard_normal((n, layer.in_channels) + tuple(in_spatial), dtype=np.float32)
        )
        fn = primitive(primitive_name).build(layer, tuple(in_spatial), xp=xp)
        t = _best_of(xp, lambda: fn(x), repeats=2)
        self.cache.put(key, t)
        return t
