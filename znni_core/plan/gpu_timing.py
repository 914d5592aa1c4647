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

from .. import layers as L
from ..cachedir import cache_dir
from ..layers.xp import empty_pinned
from ..net.spec import Conv
from . import timing as T
from .wisdom import JsonCache

F32, C64 = 4, 8
GPU_CALIBRATION_VERSION = 2
LAUNCH_S = 1e-5  # one kernel launch and its Python dispatch


def device_name(xp) -> str:
    if getattr(xp, "simulated", False):
        return "simulated"
    props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def synchronize(xp) -> None:
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


def calibrate_device(xp, *, refresh: bool = False) -> dict:
    """GEMM FLOP/s, memory and host-transfer bytes/s and FFT seconds per ``v log2 v`` on ``xp``'s device."""
    name = device_name(xp)
    cache = JsonCache(cache_dir() / "calibration-gpu.json")
    key = f"{GPU_CALIBRATION_VERSION}|{name}"
    if not refresh and (hit := cache.get(key)):
        return hit
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
    cal = {
        "device": name,
        "gemm_flops": gemm,
        "mem_bw": bw,
        "h2d_bw": h2d,
        "h2d_pinned_bw": h2d_pinned,
        "fft_s_per_vlogv": fft,
        "numba_flops": gemm,
        "threads": 1,
    }
    cache.put(key, cal)
    return cal


def estimate_conv(primitive: str, n: int, layer: Conv, in_spatial, cal: dict, micro_batch: int | None = None) -> float:
    """Seconds for a conv layer over ``n`` fragments on the device, in micro-batches."""
    cin, cout, k = layer.in_channels, layer.out_channels, tuple(layer.kernel)
    out = [s - kk + 1 for s, kk in zip(in_spatial, k)]
    calls = math.ceil(n / micro_batch) if micro_batch and micro_batch < n else 1
    bw, gemm = cal["mem_bw"], cal["gemm_flops"]
    flops = 2.0 * n * cin * cout * math.prod(k) * math.prod(out)
    x_bytes, y_bytes = F32 * n * cin * math.prod(in_spatial), F32 * n * cout * math.prod(out)
    if primitive in ("direct-gemm", "direct-torch"):
        lowered = 2 * F32 * n * cin * math.prod(k) * math.prod(out)  # im2col written and read
        if math.prod(k) == 1 or primitive == "direct-torch":
            lowered = 0
        return flops / gemm + (x_bytes + y_bytes + lowered) / bw + calls * LAUNCH_S * (1 if math.prod(k) == 1 else 8)
    if primitive == "winograd":
        values, macs, *_ = T.winograd_terms(n, cin, cout, in_spatial, k)
        return 2.0 * macs / gemm + 6 * F32 * values / bw + calls * 12 * LAUNCH_S
    if primitive in ("fft-gemm", "fft-data"):
        tshape = L.fft_gemm_transform_shape(in_spatial, k) if primitive == "fft-gemm" else L.fft_shape(in_spatial)
        items, v, f = L.fft_gemm_sizes(n, in_spatial, k) if primitive == "fft-gemm" else (n, math.prod(tshape), None)
        f = f or math.prod(tshape[:2]) * (tshape[2] // 2 + 1)
        vlog = v * math.log2(max(v, 2))
        transforms = items * (cin + cout) * vlog * cal["fft_s_per_vlogv"]
        macs = 8.0 * items * cin * cout * f  # complex multiply-adds, as real FLOPs
        spectra = C64 * items * f * (2 * cin + 3 * cout)  # transposes to and from frequency-major
        return transforms + macs / gemm + (spectra + x_bytes + 2 * y_bytes) / bw + calls * 10 * LAUNCH_S
    raise ValueError(f"no GPU time model for primitive {primitive!r}")


def estimate_setup(primitive: str, layer: Conv, in_spatial, cal: dict) -> float:
    """Building resident kernel transforms on the device: a few passes over them."""
    if primitive == "fft-gemm":
        b = L.fft_gemm_kernel_bytes(layer.in_channels, layer.out_channels, tuple(in_spatial), layer.kernel)
    elif primitive == "winograd":
        b = L.winograd_kernel_bytes(layer.in_channels, layer.out_channels, layer.kernel, tuple(in_spatial))
    elif primitive == "fft-data":
        b = L.fft_kernel_cache_bytes(layer.in_channels, layer.out_channels, tuple(in_spatial))
    else:
        return 0.0
    return 4.0 * b / cal["mem_bw"] + 1e-3


def transfer_seconds(nbytes: int, cal: dict, pinned: bool = False) -> float:
    """Host to device (or back) of ``nbytes``, from pageable or pinned host memory."""
    return nbytes / cal["h2d_pinned_bw" if pinned else "h2d_bw"] + LAUNCH_S


class DeviceMeasurements:
    """``effort="measure"`` on the GPU: a primitive timed on the real shapes on the device
    (synchronised, best of 2 after a warm-up: cuFFT plans and kernels compiled first),
    cached by device name like the CPU's measurements."""

    def __init__(self, cal: dict, xp):
        self.xp = xp
        self.cache = JsonCache(cache_dir() / "measure-gpu.json")
        self.prefix = f"{GPU_CALIBRATION_VERSION}|{cal['device']}"

    def conv(self, primitive: str, n: int, layer: Conv, in_spatial) -> float:
        key = (
            f"{self.prefix}|{primitive}|{n}|{layer.in_channels}|{layer.out_channels}|{tuple(in_spatial)}|{layer.kernel}"
        )
        if (hit := self.cache.get(key)) is not None:
            return hit
        xp = self.xp
        x = xp.asarray(
            np.random.default_rng(0).standard_normal((n, layer.in_channels) + tuple(in_spatial), dtype=np.float32)
        )
        w = xp.asarray(layer.weight)
        b = None if layer.bias is None else xp.asarray(layer.bias)
        sp = tuple(in_spatial)
        if primitive == "direct-gemm":
            fn = lambda v: L.conv_direct_gemm(v, w, b)  # noqa: E731
        elif primitive == "direct-torch":
            from ..layers.torch_conv import TorchConv

            fn = TorchConv(w, b, xp)
        elif primitive in ("fft-gemm", "winograd"):
            fn = (L.FFTGemmConv if primitive == "fft-gemm" else L.WinogradConv)(w, b, sp, xp=xp)
        else:
            fn = L.FFTConv(w, b, sp, mode=primitive[4:], xp=xp)
        t = _best_of(xp, lambda: fn(x), repeats=2)
        self.cache.put(key, t)
        return t
