"""Time models for primitives: ``estimate`` (analytic, calibrated once per machine)
and ``measure`` (timed on the real shapes, cached on disk like FFTW wisdom).

Caches live in ``$ZNNI_CACHE_DIR`` (default ``~/.cache/znni``), keyed by CPU model,
thread count and library versions, so a cluster plans once and every node reuses it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np

from .. import layers as L
from ..cachedir import cache_dir
from ..errors import PlanError
from ..layers._numba import numba
from ..layers.threads import blas_limit, each_worker, run_threads
from ..net.chain import Conv
from .calibration import CpuCalibration
from .formulas import NUMBA_CALIBRATION_SHAPE, NUMBA_TILES_CALIBRATION_SHAPE, fft_gemm_terms, loglog, winograd_terms
from .primitives import primitive
from .wisdom import JsonCache, cpu_model, versions

F32 = 4
CALIBRATION_VERSION = 34  # bump when the models or the calibration change (7-8: fft-gemm, 9-12: winograd, 13: pooling,
# 14: outputs from an arena, as the executor runs; 15: larger winograd calls;
# 16: winograd transforms priced per 1D pass; 17: 1x1x1 chains and exp calibrated; 18: winograd blocks of 3 MiB;
# 19: a winograd cost per tile; 20: written-out 8-point transforms; 21: a cost per transform position;
# 22: measured as runs run: BLAS single-threaded, GEMMs split over the threads); 23: winograd transforms channels last,
# best of 5; 24: winograd input transforms a tile row at a time; 25: direct-numba sums 3-5 taps of a row in registers;
# 26: the executor's threads keep their own malloc arenas (one arena slowed FFTW 1.5-3x);
# 27: 1x1x1 chains on register tiles, calibrated at 24 and 48 maps; 28: blocks of 1024 voxels, OpenMP threads
# that stop spinning soon after numba's parallel kernels; 29: direct-numba groups short rows;
# 30: kernel parameters (layers/tuning.py) measured first, the rates under them; 31: MPF channels last;
# 32: Winograd transforms on whole vectors, epilogues contracted, stores without masks (AVX2);
# 33: Winograd output transforms a tile row at a time, channels-last rows read in place;
# 34: direct-numba on register tiles (its points: the tiles' rate; numba_flops: the grouped rows')


def machine_key(threads: int) -> str:
    """Keys calibrations and measurements: the model's version, CPU, threads, versions, the BLAS
    core type and the target numba compiles for (the vector width, :mod:`..layers.vector_width`)."""
    blas = os.environ.get("OPENBLAS_CORETYPE", "")
    target = L.vector_width.effective()
    raw = json.dumps([CALIBRATION_VERSION, cpu_model(), threads, versions(), blas, target], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


#: how thoroughly :func:`calibrate` measures: ``quick`` (the kernel parameters at their defaults,
#: each rate timed once after a warm-up, the FFT size factor on few maps: 3-5 s at one thread on
#: a Zen 4 core, what a first job or a first ``znni warmup`` pays) or ``full`` (the kernel
#: parameters tuned on the host, each rate the best of five: ``znni warmup --refine``, about 25 s)
LEVELS = ("quick", "full")
#: the level being measured in this process (:func:`_best_of` reads it)
_LEVEL = "full"


def _best_of(fn, repeats=5) -> float:
    """Minimum of ``repeats`` timed runs after a warm-up: the least disturbed by other load (on
    a shared 2-core host three left rates 40-70% apart between calibrations minutes apart); one
    run in a ``quick`` calibration."""
    fn()  # warm-up (plans, compiles)
    ts = []
    for _ in range(1 if _LEVEL == "quick" else repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(min(ts))


#: values the timed calls' inputs and weights are cut from: a prime count of float32 normal values,
#: repeated (:func:`_noise`)
_NOISE_VALUES = 1_000_003
_NOISE = []


def _noise(shape) -> np.ndarray:
    """A new float32 array of ``shape`` holding normal values: a fixed draw of
    :data:`_NOISE_VALUES` repeated (drawing every input afresh, about 130 million values, took 3 s
    of each thread count's quick calibration on a 2-core Xeon, 40% of it; no kernel timed here
    runs faster or slower on the values it gets)."""
    if not _NOISE:
        _NOISE.append(np.random.default_rng(0).standard_normal(_NOISE_VALUES, dtype=np.float32))
    return np.resize(_NOISE[0], shape)


# --------------------------------------------------------------------- calibration
def calibrate(
    threads: int = 1, *, refresh: bool = False, tuned: dict | None = None, level: str | None = None, between=None
) -> CpuCalibration:
    """Machine rates for the analytic model, measured once and cached; the kernel parameters
    timed on the host first (``full``), unless ``tuned`` gives them (another thread count's).

    ``level`` (:data:`LEVELS`): None takes the cached calibration of either level and measures
    ``$ZNNI_CALIBRATION`` (default ``quick``) when there is none (a job on a cold host); ``full``
    measures unless a full one is cached, and replaces a quick one; ``refresh`` measures again at
    the level asked.  ``between``: called once measuring is half done (:func:`_measure`)."""
    if level is None and os.environ.get("ZNNI_CALIBRATION"):
        level = os.environ["ZNNI_CALIBRATION"].strip().lower()
        where = "ZNNI_CALIBRATION"
    else:
        where = "calibration level"
    if level is not None and level not in LEVELS:
        raise PlanError(f"{where} {level!r}: one of {', '.join(LEVELS)}")
    cache = JsonCache(cache_dir() / "calibration.json")
    key = machine_key(threads)
    hit = None if refresh else cache.get(key)
    if hit and (level != "full" or hit.get("level", "full") == "full"):
        return CpuCalibration.from_dict(hit, str(cache.path))
    level = level or "quick"
    global _LEVEL
    # every timed call takes its output from an arena, as a run's patches do after the first
    # (fresh pages cost the kernel's zeroing on first touch; the executor reuses buffers)
    # and inside a run's thread setting (BLAS single-threaded, GEMMs split over the threads): a
    # threaded BLAS call before a timed call left OpenBLAS's workers spinning through it
    _LEVEL, before = level, _LEVEL
    try:
        with L.arena.using(L.arena.Arena(1 << 31)), run_threads(threads):
            if tuned is not None:
                tuned, tried = dict(tuned), {}
            elif level == "quick":
                tuned, tried = dict(L.tuning.DEFAULTS), {}
            else:
                tuned, tried = _tune(threads)
            with L.tuning.using(tuned):  # the rates of the kernels as plans will run them
                cal = _measure(threads, between)
    finally:
        _LEVEL = before
    cal = CpuCalibration(**cal, tuned=tuned, tuning_seconds=tried, level=level)
    cache.put(key, cal.to_dict())
    return cal


#: within this fraction of the fastest candidate a parameter keeps its default: noise on a
#: shared host must not move it (at 3%, back-to-back calibrations on one Zen 4 host chose
#: 0.5 MiB Winograd blocks in one and 3 MiB in the next)
TUNING_TIE = 0.08
#: timed rounds per candidate, interleaved (every candidate once per round, after a round that
#: warms them up), the minimum kept: drift of the host's speed hits every candidate alike
TUNING_ROUNDS = 5


def _tuning_cases(threads: int) -> dict:
    """Per kernel parameter (``layers/tuning.py``), the calls it is timed on: factories, so a
    Winograd layer is built under the value being tried (its tile size is chosen when built)."""

    def arr(*shape):
        return _noise(shape)

    def winograd(c, n, spatial, kernel):
        w, x = arr(c, c, *kernel), arr(n, *spatial, c).transpose(0, 4, 1, 2, 3)  # channels last, as between layers

        def make():
            conv = L.WinogradConv(w, None, spatial, threads=threads).configured(channels_last=True, keep_buffers=True)
            return lambda: conv(x)

        return make

    wino = [
        winograd(48, 1, (12, 160, 160), (1, 3, 3)),
        winograd(48, 256, (4, 13, 13), (1, 3, 3)),
        winograd(24, 1, (18, 48, 48), (3, 3, 3)),
    ]
    chains = []
    for c in (24, 48):
        xp, st = arr(1, c, 16, 64, 64), [(arr(c, c, 1, 1, 1), arr(c), ("relu", 0.0))] * 4
        chains.append(lambda xp=xp, st=st: lambda: L.conv_pointwise_chain(xp, st, threads=threads))
    direct = []
    for x, w in ((arr(64, 24, 10, 10, 10), arr(24, 24, 3, 3, 3)), (arr(64, 48, 4, 17, 17), arr(48, 48, 1, 4, 4))):
        direct.append(lambda x=x, w=w: lambda: L.conv_direct_numba(x, w))
    return {
        "winograd.block_bytes": wino,
        "winograd.large_tile_gain": wino,
        "winograd.blas": wino,
        # 36 maps: 40 columns in 8-float tiles, 48 in 16-float ones (48 maps are whole tiles either way)
        "winograd.wide_tiles": [winograd(36, 1, (12, 96, 96), (1, 3, 3)), winograd(36, 1, (12, 40, 40), (3, 3, 3))],
        "pointwise.block": chains,
        "direct.row_group": direct,
    }


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _tune(threads: int) -> tuple[dict, dict]:
    """Each kernel parameter's candidates timed on its cases (summed; the minimum of
    :data:`TUNING_ROUNDS` interleaved rounds), one parameter after another under the values
    already chosen: ``(chosen, {name: [[value, seconds], ...]})``.  A candidate replaces the
    default only when faster by more than :data:`TUNING_TIE`."""
    chosen, tried = {}, {}
    for name, cases in _tuning_cases(threads).items():
        values = L.tuning.CANDIDATES[name]
        calls, rounds = {}, {v: [] for v in values}
        for r in range(TUNING_ROUNDS + 1):
            for value in values:
                with L.tuning.using({**chosen, name: value}):  # built and run under the value
                    if r == 0:
                        calls[value] = [make() for make in cases]
                        for fn in calls[value]:
                            fn()  # warm-up: buffers, first touch
                    else:
                        rounds[value].append(sum(_time_once(fn) for fn in calls[value]))
        times = {v: min(ts) for v, ts in rounds.items()}
        best = min(times, key=times.get)
        default = L.tuning.DEFAULTS[name]
        chosen[name] = default if times[default] <= (1 + TUNING_TIE) * times[best] else best
        tried[name] = [[v, t] for v, t in times.items()]
    return chosen, tried


def _measure(threads: int, between=None) -> dict:
    """The rates of :class:`CpuCalibration`.  Those of the kernels ``znni warmup``'s first compile
    group builds (1x1x1 chains, FFTs, activations, pooling) come first, then ``between()`` (when
    given: the warmup's calibration waits there for its second group, whose direct and Winograd
    kernels the rest time)."""
    # 1x1x1 convs run as chains in cache (conv_pointwise_chain): four stages of 24 and of 48 maps
    # on 16 x 128^2 voxels, the input's read and the output's write shared by the four (the
    # block's copies weigh more on narrow stages: 24 maps ran at 0.75x the 48-map rate)
    pointwise = []
    for c in (24, 48):
        xp1 = _noise((1, c, 16, 128, 128))
        stages = [(_noise((c, c, 1, 1, 1)), None, ("relu", 0.0))] * 4
        pointwise.append(
            [c, 4 * 2 * c * c * xp1[0, 0].size / _best_of(lambda: L.conv_pointwise_chain(xp1, stages, threads=threads))]
        )
    rates = _fft_rates(threads)
    rates["gemm"] = _fft_gemm_rates(threads)
    big = np.empty(2**24, dtype=np.float32)
    bw = big.nbytes * 2 / _best_of(lambda: np.maximum(big, 0, out=big))
    # activations with an exponential (elu, sigmoid, tanh): numpy's exp sets their pace, not memory
    # (a U-Net's elu on 28 x 18 x 160^2: 23 ms, against 7 ms for two passes at memory bandwidth)
    big[:] = _noise(big.size)

    old_threads = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        exp_s = _best_of(lambda: L.apply_activation(big, "elu", 1.0, out=big)) / big.size
    finally:
        numba.set_num_threads(old_threads)
    # pooling: MPF of a 64 MiB layer (the numba kernel, not an elementwise pass: the elementwise
    # rate predicted n337's three MPF layers at 0.04 s where 0.42 s were measured)
    layer_in = _noise((1, 16, 100, 100, 100))
    pool = _best_of(lambda: L.mpf(layer_in, (2, 2, 2))) / layer_in.nbytes
    # ... and channels last (after a Winograd layer): another kernel, 2-4x faster per byte
    layer_cl = np.ascontiguousarray(layer_in.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3)
    pool_cl = _best_of(lambda: L.mpf(layer_cl, (2, 2, 2))) / layer_cl.nbytes
    if between is not None:
        between()
    # direct convolution (BLAS lowering): effective FLOP/s on a mid-size layer
    x = _noise((1, 24) + NUMBA_CALIBRATION_SHAPE[0])
    w = _noise((24, 24) + NUMBA_CALIBRATION_SHAPE[1])
    flops = 2 * 24 * 24 * 27 * 32**3
    gemm = flops / _best_of(lambda: L.conv_direct_gemm(x, w))
    # direct-numba's loop of grouped rows (rows shorter than a register tile: 32 here) ...
    numba_rate = flops / _best_of(lambda: L.conv_direct_numba(x, w, tiles=False))
    # ... and its register tiles, on rows of whole tiles of every build (192 values: 3 of 64,
    # 6 of 32, 8 of 24), at their full rate (the efficiency divided out)
    shape_t, kernel_t = NUMBA_TILES_CALIBRATION_SHAPE
    xt = _noise((1, 24) + shape_t)
    out_t = tuple(s - k + 1 for s, k in zip(shape_t, kernel_t))
    flops_t = 2 * 24 * 24 * math.prod(kernel_t) * math.prod(out_t)
    tiles = flops_t / _best_of(lambda: L.conv_direct_numba(xt, w, tiles=True))
    tiles /= L.direct_numba_efficiency(24, shape_t, kernel_t)
    # a first layer (one input channel): a short reduction (K = 27), far from BLAS peak
    x1 = _noise((1, 1, 66, 66, 66))
    w1 = _noise((24, 1, 3, 3, 3))
    flops1 = 2 * 24 * 27 * 64**3
    first = (
        flops1 / _best_of(lambda: L.conv_direct_numba(x1, w1)) / L.direct_numba_efficiency(24, x1.shape[2:], (3, 3, 3))
    )
    direct_points = {
        "gemm": [[27, flops1 / _best_of(lambda: L.conv_direct_gemm(x1, w1))], [24 * 27, gemm]],
        "numba": [[27, first], [24 * 27, tiles]],
    }
    rates["winograd"] = _winograd_rates(threads)
    return {
        "gemm_flops": gemm,
        "numba_flops": numba_rate,
        "direct_points": direct_points,
        "fft": rates,
        "mem_bw": bw,
        "pointwise_points": pointwise,
        "exp_s_per_value": exp_s,
        "pool_s_per_byte": pool,
        "pool_cl_s_per_byte": pool_cl,
        "cpu": cpu_model(),
        "threads": threads,
    }


# FFT calibration shapes: a 48^3 transform (a typical fragment size), two mixes of
# transforms vs multiply-adds so the two rates separate, kernel 5^3
_FFT_CAL = {
    "size": 48,
    "kernel": 5,
    "mixes": ((1, 24), (16, 4)),  # (N, C) with C_in = C_out = C
    "large": 96,
    "large_mix": (1, 16),
}  # a second size: transforms slow down out of cache
#: a quick calibration's: fewer kernels to transform (the builds took half of the full one)
_FFT_CAL_QUICK = {"mixes": ((1, 16), (16, 4)), "large_mix": (1, 4)}


def _fft_rates(threads: int) -> dict:
    """Per-mode rates of :class:`FFTConv` on realistic shapes.

    Model of one call: ``a * N (C_in + C_out) VlogV + b * N C_in C_out V/2`` (data
    transforms, complex multiply-adds), plus for ``stream`` ``c * C_in C_out VlogV``
    (the kernel transforms it redoes per call); building the resident kernel cache of
    ``data``/``task`` costs ``d * C_in C_out VlogV`` once.
    """
    cfg = dict(_FFT_CAL, **(_FFT_CAL_QUICK if _LEVEL == "quick" else {}))
    m, k = cfg["size"], cfg["kernel"]
    v = float(m**3)
    vlog = v * math.log2(v)
    sp = (m, m, m)
    calls, builds = {}, {}
    for n, c in cfg["mixes"]:
        x = _noise((n, c, m, m, m))
        w = _noise((c, c, k, k, k))
        for mode in L.fft.MODES:
            if mode == "stream" and n != cfg["mixes"][0][0]:
                continue
            t0 = time.perf_counter()
            conv = L.FFTConv(w, None, sp, threads=threads, mode=mode)
            if mode == "task":
                builds[c] = time.perf_counter() - t0
            calls[(mode, n, c)] = _best_of(lambda: conv(x), repeats=2)
    (n1, c1), (n2, c2) = cfg["mixes"]
    rates = {}
    for mode in ("data", "task"):
        a11, a12, b1 = n1 * 2 * c1 * vlog, n1 * c1 * c1 * v / 2, calls[(mode, n1, c1)]
        a21, a22, b2 = n2 * 2 * c2 * vlog, n2 * c2 * c2 * v / 2, calls[(mode, n2, c2)]
        det = a11 * a22 - a12 * a21
        per_vlog = (b1 * a22 - a12 * b2) / det
        per_mac = (a11 * b2 - a21 * b1) / det
        if per_vlog <= 0 or per_mac <= 0:  # noisy timings: split each run's time evenly instead
            per_vlog, per_mac = 0.5 * b1 / a11, 0.5 * b2 / a22
        rates[mode] = {"s_per_vlogv": per_vlog, "s_per_mac": per_mac}
    kern = c1 * c1 * vlog
    task = rates["task"]
    stream_extra = calls[("stream", n1, c1)] - calls[("task", n1, c1)]
    rates["stream"] = dict(task, s_per_kernel_vlogv=max(stream_extra, 0.05 * calls[("task", n1, c1)]) / kern)
    rates["build_s_per_kernel_vlogv"] = builds[c1] / kern
    # the same model at the large size: its error there is the size factor
    m1, (n, c) = cfg["large"], cfg["large_mix"]
    v1 = float(m1**3)
    vlog1 = v1 * math.log2(v1)
    x = _noise((n, c, m1, m1, m1))
    w = _noise((c, c, k, k, k))
    size = {"v0": v, "v1": v1, "call": {}}
    for mode in ("data", "task"):
        t0 = time.perf_counter()
        conv = L.FFTConv(w, None, (m1,) * 3, threads=threads, mode=mode)
        if mode == "task":
            size["build"] = max(1.0, (time.perf_counter() - t0) / (c * c * vlog1 * rates["build_s_per_kernel_vlogv"]))
        t = _best_of(lambda: conv(x), repeats=1)
        r = rates[mode]
        size["call"][mode] = max(1.0, t / (n * 2 * c * vlog1 * r["s_per_vlogv"] + n * c * c * v1 / 2 * r["s_per_mac"]))
    size["call"]["stream"] = size["call"]["task"]
    conv = L.FFTConv(w, None, (m1,) * 3, threads=threads, mode="stream")
    t = _best_of(lambda: conv(x), repeats=1) - t
    size["kernel"] = max(1.0, t / (c * c * vlog1 * rates["stream"]["s_per_kernel_vlogv"]))
    rates["size"] = size
    return rates


#: fft-gemm calibration: 2D transforms of 64^2 planes (16 slices), few maps (transforms) and many (products)
_FFT_GEMM_CAL = {"shape": (16, 64, 64), "kernel": (1, 5, 5), "mixes": ((2, 4), (2, 48))}  # (N, C)


def _fft_gemm_rates(threads: int) -> dict:
    """Seconds per unit of :func:`.formulas.fft_gemm_terms`: the products timed on their own (a batched
    ``cgemm`` of the calibration's shape: a clean rate), the rest of a whole call at few maps
    (transforms, transposes, padding) as the transform rate; and per kernel spectrum value built."""
    sp, k = _FFT_GEMM_CAL["shape"], _FFT_GEMM_CAL["kernel"]
    (n1, c1), (n2, c2) = _FFT_GEMM_CAL["mixes"]
    items2, _, f = L.fft_gemm_sizes(n2, sp, k)
    a = _noise((f, items2, c2)).astype(np.complex64)
    b = _noise((f, c2, c2)).astype(np.complex64)
    out = np.empty((f, items2, c2), np.complex64)
    per_mac = _best_of(lambda: np.matmul(a, b, out=out)) / (f * items2 * c2 * c2)
    x = _noise((n1, c1) + sp)
    w = _noise((c1, c1) + k)
    conv = L.FFTGemmConv(w, None, sp, threads=threads).configured(keep_buffers=True)
    tr1, macs1, _ = fft_gemm_terms(n1, c1, c1, sp, k)
    per_t = max(_best_of(lambda: conv(x)) - macs1 * per_mac, 0.0) / tr1
    w2 = _noise((c2, c2) + k)
    build = _best_of(lambda: L.FFTGemmConv(w2, None, sp, threads=threads), repeats=2)
    return {
        "s_per_transform": per_t,
        "s_per_mac": per_mac,
        "build_s_per_value": build / (L.fft_gemm_kernel_bytes(c2, c2, sp, k) / 8),
    }


#: Winograd calibration: (1,3,3) kernels on 16 x 64^2 (64 transform positions); the GEMM rate
#: at two reduction lengths (C_in); the transforms from whole calls at 48 maps on wide planes
#: and on many narrow ones (MPF fragments), and at few maps on wide planes: a cost per transformed
#: value, one per tile row and one per tile (a tile's work that does not scale with its channels:
#: fit at 48 maps alone, (1,3,3) layers at 8-28 maps ran 1.3-2.6x their prediction)
# wide and narrow calls of 0.2 and 0.03 s: at 0.02 and 0.01 s (8 x 128^2, 64 x 4 x 13^2) the
# per-call costs and the host's noise made the two-point fit 1.5-3x pessimistic per value
_WINOGRAD_CAL = {
    "shape": (16, 64, 64),
    "kernel": (1, 3, 3),
    "channels": (16, 64),
    "transform_channels": 48,
    "few_channels": 8,
    "wide": (1, (16, 256, 256)),
    "narrow": (256, (4, 13, 13)),
}


def _winograd_rates(threads: int) -> dict:
    """Seconds per multiply-add of the per-position GEMMs (timed alone, as a call runs them:
    each worker its own blocks of tiles on one BLAS thread, at two reduction lengths), per
    transformed value and per channel row (the rest of a call, on wide and on narrow planes),
    and per kernel-transform value built."""
    sp, k = _WINOGRAD_CAL["shape"], _WINOGRAD_CAL["kernel"]
    points, blocks = [], 8
    for c in _WINOGRAD_CAL["channels"]:
        conv = L.WinogradConv(_noise((c, c) + k), None, sp, threads=threads)
        blas = bool(L.tuning.get("winograd.blas"))  # the products as the calls run them
        V0, M0, _ = conv._buffers(1, blas)[1][0]
        conv.release()
        sets = [
            (np.ones_like(V0), np.empty_like(M0), L.microkernel.Scratch(c, c, conv.register_tile))
            for _ in range(threads)
        ]

        def worker(w):
            V, M, tail = sets[w]
            for _ in range(blocks):
                if blas:
                    np.matmul(V, conv.U[:, :, :c], out=M)
                else:
                    L.microkernel.batched_products(V, conv.U, M, V.shape[1], c, tail)

        with blas_limit(1):
            seconds = _best_of(lambda: each_worker(worker, threads))
        points.append([c, seconds / (blocks * threads * conv.T * c * c * V0.shape[1])])
    terms, times = [], []
    many, few = _WINOGRAD_CAL["transform_channels"], _WINOGRAD_CAL["few_channels"]
    for c, (n, shape) in ((many, _WINOGRAD_CAL["wide"]), (many, _WINOGRAD_CAL["narrow"]), (few, _WINOGRAD_CAL["wide"])):
        w = _noise((c, c) + k)
        # channels last in and out, as a Winograd layer between Winograd layers (and MPF) runs
        x = _noise((n,) + shape + (c,)).transpose(0, 4, 1, 2, 3)
        conv = L.WinogradConv(w, None, shape, threads=threads).configured(channels_last=True, keep_buffers=True)
        values, macs, rows, positions = winograd_terms(n, c, c, shape, k)
        terms.append((values, rows, positions))
        times.append(max(_best_of(lambda: conv(x), repeats=5) - macs * loglog(points, c), 0.0))
        conv.release()
    try:
        per_value, per_row, per_position = (float(v) for v in np.linalg.solve(np.array(terms), np.array(times)))
    except np.linalg.LinAlgError:
        per_value = per_row = per_position = -1.0
    if min(per_value, per_row, per_position) < 0:
        # noisy timings: the two 48-map calls alone (per value, per row) and the rest per position
        (v1, r1, t1), (v2, r2, t2), (v3, r3, t3) = terms
        det = v1 * r2 - v2 * r1
        per_value, per_row = (times[0] * r2 - times[1] * r1) / det, (v1 * times[1] - v2 * times[0]) / det
        if per_value <= 0 or per_row <= 0:  # the wide call's time per value, the rest per row
            per_value = times[0] / v1
            per_row = max(times[1] - v2 * per_value, 0.0) / r2
        per_position = max(times[2] - v3 * per_value - r3 * per_row, 0.0) / t3
    c = _WINOGRAD_CAL["channels"][1]
    w2 = _noise((c, c) + k)
    build = _best_of(lambda: L.WinogradConv(w2, None, sp, threads=threads), repeats=2)
    return {
        "mac_points": points,
        "s_per_value": per_value,
        "s_per_row": per_row,
        "s_per_position": per_position,
        "build_s_per_value": build / (L.winograd_kernel_bytes(c, c, k, sp) / F32),
    }


# --------------------------------------------------------------------- measurement
class Measurements:
    """Timed primitive runs on real shapes, cached per (primitive, shape, threads, machine)."""

    def __init__(self, threads: int):
        self.threads = threads
        self.cache = JsonCache(cache_dir() / f"measure-{machine_key(threads)}.json")

    def conv(self, primitive_name: str, n: int, layer: Conv, in_spatial) -> float:
        """Seconds of one call of ``primitive_name`` on ``n`` items of ``in_spatial``, timed once
        and kept in the machine's measurement cache."""
        key = f"{primitive_name}|{n}|{layer.in_channels}|{layer.out_channels}|{tuple(in_spatial)}|{layer.kernel}"
        if (hit := self.cache.get(key)) is not None:
            return hit
        x = _noise((n, layer.in_channels) + tuple(in_spatial))
        # the call only: resident kernel transforms are built once per run (their setup's price)
        conv = primitive(primitive_name).build(layer, tuple(in_spatial), threads=self.threads)
        fn = lambda: conv(x)  # noqa: E731
        t = _best_of(fn, repeats=1)
        self.cache.put(key, t)
        return t

    def export(self, path) -> Path:
        """Write this machine's measurements to ``path`` (to seed another node's cache)."""
        path = Path(path)
        path.write_text(json.dumps({"machine": machine_key(self.threads), "data": self.cache.data}, sort_keys=True))
        return path

    def import_(self, path) -> int:
        """Add the measurements of :meth:`export`'s file when they are of this machine; returns
        how many (0 for another machine or version)."""
        d = json.loads(Path(path).read_text())
        if d.get("machine") != machine_key(self.threads):
            return 0  # measurements of another machine/version do not apply
        for k, v in d["data"].items():
            self.cache.put(k, v)
        return len(d["data"])
