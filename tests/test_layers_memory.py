"""Each primitive's memory formula against its measured peak (tracemalloc sees numpy's
allocations, including pyfftw.empty_aligned; numba kernels here allocate their outputs
with numpy outside the jit)."""

import tracemalloc

import numpy as np
import pytest

from znni_core import layers as L


def measured_peak(fn):
    """Peak bytes allocated while ``fn`` runs, over what was live before; result kept."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del result
    return peak


def check(predicted, measured):
    assert measured > 10 * 2**20, "shape too small for the comparison to mean anything"
    assert abs(predicted - measured) <= 0.2 * measured, (predicted, measured)


def data(n, c, shape, seed=0):
    return np.random.default_rng(seed).standard_normal((n, c) + shape, dtype=np.float32)


@pytest.mark.parametrize(
    "n,ci,co,shape,kernel,max_bytes",
    [
        (1, 16, 16, (48, 48, 48), (3, 3, 3), None),
        (2, 8, 24, (30, 40, 36), (2, 4, 1), None),
        (1, 8, 48, (40, 40, 40), (3, 3, 3), 50_000),  # column blocks
        (1, 4, 12, (64, 64, 64), (1, 1, 1), 2**30),
    ],
)
def test_gemm_memory(n, ci, co, shape, kernel, max_bytes):
    x, w = data(n, ci, shape), data(co, ci, kernel, 1)
    pred = L.conv_direct_gemm_memory(n, ci, co, shape, kernel, max_bytes)
    check(pred, measured_peak(lambda: L.conv_direct_gemm(x, w, max_bytes=max_bytes)))


@pytest.mark.parametrize(
    "n,ci,co,shape,kernel", [(1, 4, 32, (48, 48, 48), (3, 3, 3)), (3, 2, 20, (40, 44, 36), (2, 1, 4))]
)
def test_numba_memory(n, ci, co, shape, kernel):
    x, w = data(n, ci, shape), data(co, ci, kernel, 1)
    L.conv_direct_numba(x[:, :, :8, :8, :8], w)  # compile / load outside the measurement
    pred = L.conv_direct_numba_memory(n, ci, co, shape, kernel)
    check(pred, measured_peak(lambda: L.conv_direct_numba(x, w)))


@pytest.mark.parametrize("mode,threads", [("data", 2), ("task", 1), ("task", 3), ("stream", 2)])
@pytest.mark.parametrize(
    "n,ci,co,shape,kernel",
    [
        (2, 8, 8, (60, 62, 63), (5, 5, 5)),
        (1, 4, 16, (48, 50, 41), (3, 2, 4)),
        (6, 2, 4, (48, 40, 40), (3, 3, 3)),
    ],
)
def test_fft_memory_including_kernel_cache(mode, threads, n, ci, co, shape, kernel):
    x, w = data(n, ci, shape), data(co, ci, kernel, 1)
    b = np.ones(co, np.float32)

    L.fft_conv(x[:1, :, :6, :6, :6], w, b, mode=mode, threads=threads, effort="estimate")  # load numba kernels

    def run():
        conv = L.FFTConv(w, b, shape, mode=mode, threads=threads, effort="estimate")
        return conv, conv(x)

    pred = L.fft_conv_memory(n, ci, co, shape, kernel, mode=mode, threads=threads)
    check(pred, measured_peak(run))
    if mode == "stream":  # no kernel cache: at most one channel's C_in spectra per worker
        assert pred < L.fft_conv_memory(n, ci, co, shape, kernel, mode="task", threads=threads)
    else:
        assert L.fft_kernel_cache_bytes(ci, co, shape) <= pred


@pytest.mark.parametrize("n,c,shape,p", [(1, 32, (96, 96, 96), (2, 2, 2)), (2, 16, (64, 81, 90), (1, 2, 2))])
def test_pool_memory(n, c, shape, p):
    x = data(n, c, shape)
    check(L.max_pool_memory(n, c, shape, p), measured_peak(lambda: L.max_pool(x, p)))
    check(L.mpf_memory(n, c, shape, p), measured_peak(lambda: L.mpf(x, p)))
    f = L.mpf(x, p)
    check(L.recombine_memory(f.shape[0], c, f.shape[2:], [p]), measured_peak(lambda: L.recombine(f, [p])))


@pytest.mark.parametrize("kind", ["relu", "elu", "softmax", "sigmoid"])
def test_activation_memory(kind):
    x = data(1, 12, (64, 64, 64))
    shape = x.shape
    check(
        L.activation_memory(kind, shape, in_place=False, chunked=True) or 1,
        measured_peak(lambda: L.apply_activation(x, kind, 0.5)),
    )
    if kind in ("elu",):
        # in place on the CPU, chunk by chunk: the temporaries are a chunk per worker, not the array
        peak = measured_peak(lambda: L.apply_activation(x, kind, 0.5, out=x))
        assert peak <= 1.25 * L.activation_memory(kind, shape, chunked=True) < L.activation_memory(kind, shape) / 8
        # a strided view takes the whole-array path: one temporary the size of the input (the bound)
        v = x[..., :60]
        check(L.activation_memory(kind, v.shape), measured_peak(lambda: L.apply_activation(v, kind, 0.5, out=v)))


@pytest.mark.parametrize(
    "n,ci,co,shape,kernel",
    [
        (4, 8, 8, (12, 96, 96), (1, 5, 5)),  # 2D transforms per z slice
        (64, 8, 16, (6, 30, 30), (1, 3, 3)),  # many small planes: several blocks of items
        (2, 6, 6, (40, 44, 41), (3, 3, 2)),  # 3D transforms
    ],
)
def test_fft_gemm_memory_including_kernel_spectra(n, ci, co, shape, kernel):
    x, w = data(n, ci, shape), data(co, ci, kernel, 1)
    L.FFTGemmConv(w, None, shape, threads=2)(x)  # numba kernels loaded, FFTW wisdom

    def run():
        conv = L.FFTGemmConv(w, np.ones(co, np.float32), shape, threads=2)
        return conv, conv(x)

    spectra = L.fft_gemm_kernel_bytes(ci, co, shape, kernel)
    check(L.fft_gemm_memory(n, ci, co, shape, kernel, threads=2) + spectra, measured_peak(run))


def test_arena_returns_a_buffer_only_after_its_last_view_and_holds_at_most_cap():
    """A buffer goes back to the arena when the last view of it dies (not when the handed-out
    array does); a freed buffer serves a request up to SLACK smaller, not a larger or a much
    smaller one; the arena never holds more than ``cap``; small requests bypass it."""
    from znni_core.layers.arena import MIN_BYTES, SLACK, Arena

    mib = MIN_BYTES  # 1 MiB
    four = 4 * mib // 4  # float32 elements of 4 MiB
    a = Arena(cap=10 * mib)
    x = a.empty(four)
    x[:] = 7
    view = x[::2]
    del x
    assert a.held_bytes == 0  # the view still uses the buffer
    y = a.empty(four)  # so this one is new
    y[:] = 0
    assert (a.hits, a.misses) == (0, 2) and float(view.sum()) == 7 * view.size
    del view, y
    assert a.held_bytes == 8 * mib  # both back
    smaller = a.empty(int(four / (1 + SLACK)) + 16)  # within SLACK below 4 MiB: reused
    assert (a.hits, a.misses, a.held_bytes) == (1, 2, 4 * mib)
    much_smaller = a.empty(int(four / (1 + SLACK)) - 4096)  # a 4 MiB buffer would waste too much
    bigger = a.empty(5 * mib // 4)  # 5 MiB: no held buffer is large enough
    tiny = a.empty(16)  # below MIN_BYTES: numpy's own allocation
    assert (a.hits, a.misses) == (1, 4) and tiny.base is None
    del smaller, much_smaller, bigger  # 4 + 2 + 5 MiB back, with 4 MiB held: over the cap
    assert 0 < a.held_bytes <= a.cap
    a.clear()
    assert a.held_bytes == 0
