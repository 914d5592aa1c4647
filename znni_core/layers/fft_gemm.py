"""FFT convolution whose channel sums are complex GEMMs, one per frequency.

For ``C_in -> C_out`` maps the pointwise stage of an FFT convolution is, at every
frequency ``f``, a matrix product over the channels::

    Y[f] (items x C_out) = X[f] (items x C_in) @ W[f] (C_in x C_out)

so it runs as one batched BLAS ``cgemm`` (``numpy.matmul`` over the frequencies) near the
machine's GEMM rate, instead of a hand-written multiply-accumulate.  The spectra are laid
out frequency-major (``(F, items, C)``) for that product; transforms run batch-major and
a blocked numba transpose moves each block of items between the two layouts.

Kernels one deep in z (``(1, k, k)``, the 2D boundary detectors) use 2D transforms of
each z slice: z joins the items, no transform runs along it.  Other kernels use 3D
transforms.  Against direct convolution at ``k x k`` kernels this does about
``k^2 / 2`` times fewer multiply-adds on large planes (the spectrum of an ``m x m``
plane has ``m (m/2 + 1)`` complex values, 4 real multiply-adds each), which is how it
overtakes runtimes that run direct convolution near the GEMM roof.

Kernel spectra (``(F, C_in, C_out)`` complex64, conjugated: correlation; scaled by
``1 / transform size``) are built once per layer and input shape and stay resident;
the planner counts them (:func:`fft_gemm_kernel_bytes`).  Data flow of one call, items
in blocks of a few MiB::

    x -> pad (numba) -> rfftn (FFTW) -> transpose into X (F, items, C_in)
    Y = X @ W                                       (batched cgemm, all frequencies)
    Y -> transpose block (F -> items) -> irfftn (FFTW) -> crop + bias (numba) -> out

Written against ``xp`` for the GPU too (:meth:`FFTGemmConv._call_xp`: ``xp.fft`` and
``xp.matmul``, no pyfftw, no numba).
"""

from __future__ import annotations

import math

import numpy as np

from . import arena
from ._numba import njit
from .epilogue import act_row
from .fft import fft_size
from .resident import ResidentConv
from .threads import each_worker, gemm
from .xp import get_array_module

__all__ = ["FFTGemmConv", "fft_gemm_kernel_bytes", "fft_gemm_memory", "fft_gemm_sizes", "fft_gemm_transform_shape"]

C64 = 8
F32 = 4
#: items per transform block: about this many bytes of spectra (cache-friendly transposes,
#: enough work per FFTW call for its threads)
BLOCK_BYTES = 4 * 2**20
FFTW_EFFORT = "FFTW_ESTIMATE"  # MEASURE planned for up to 1 s per new shape and ran no faster on 2D batches


def fft_gemm_transform_shape(in_spatial, kernel) -> tuple:
    """Transform shape ``(mz, my, mx)``: ``mz = 1`` (2D transforms per z slice) for kernels
    one deep in z, else the fast FFT size of every axis."""
    Z, Y, X = (int(v) for v in in_spatial)
    return (1 if int(kernel[0]) == 1 else fft_size(Z), fft_size(Y), fft_size(X))


def _freqs(tshape) -> int:
    mz, my, mx = tshape
    return mz * my * (mx // 2 + 1)


def fft_gemm_sizes(n, in_spatial, kernel) -> tuple:
    """``(items, V, F)`` of a call on ``n`` fragments: transform items (every (fragment, z
    slice) for 2D transforms, else fragments: the rows of each frequency's product), the
    transform size and the number of frequencies."""
    ts = fft_gemm_transform_shape(in_spatial, kernel)
    return int(n) * (int(in_spatial[0]) if ts[0] == 1 else 1), math.prod(ts), _freqs(ts)


def fft_gemm_kernel_bytes(c_in, c_out, in_spatial, kernel) -> int:
    """Bytes of a layer's resident kernel spectra ``(F, C_in, C_out)`` complex64."""
    return C64 * c_in * c_out * _freqs(fft_gemm_transform_shape(in_spatial, kernel))


def _block_items(items, channels, F) -> int:
    return max(1, min(items, BLOCK_BYTES // max(1, C64 * channels * F)))


def fft_gemm_memory(n, c_in, c_out, in_spatial, kernel, threads=1) -> int:
    """Predicted peak bytes of one :class:`FFTGemmConv` call, input and kernel spectra excluded.

    The frequency-major spectra ``X`` (items x C_in) and ``Y`` (items x C_out) are alive
    together during the product; ``X`` is dropped before the output is allocated; the
    block buffers of the transforms (in-place: one complex buffer per side and worker) are
    alive throughout.
    """
    B, _, F = fft_gemm_sizes(n, in_spatial, kernel)
    xs, ys = C64 * F * B * c_in, C64 * F * B * c_out
    o = F32 * n * c_out * math.prod(int(s) - int(k) + 1 for s, k in zip(in_spatial, kernel))
    nb = _block_items(B, max(c_in, c_out), F)
    workers = min(max(1, int(threads)), -(-B // nb))
    return max(xs + ys, ys + o) + workers * nb * (c_in + c_out) * C64 * F


# ----------------------------------------------------------------------------- numba kernels
@njit(nogil=True, cache=True)
def _pad_items(x, buf, b0, zb):  # pragma: no cover - compiled
    """buf[j, c] = item b0 + j of x, zero-padded: item b = (n, z) = divmod(b, zb); for 2D
    transforms (zb = Z) one z slice, for 3D (zb = 1) the whole volume."""
    nb, C, mz, my, mx = buf.shape
    _, _, Z, Y, X = x.shape
    ez = Z // zb
    for job in range(nb * C):
        j, c = job // C, job % C
        n, z0 = (b0 + j) // zb, ((b0 + j) % zb) * ez
        for z in range(mz):
            for y in range(my):
                if z < ez and y < Y:
                    for i in range(X):
                        buf[j, c, z, y, i] = x[n, c, z0 + z, y, i]
                    for i in range(X, mx):
                        buf[j, c, z, y, i] = 0.0
                else:
                    for i in range(mx):
                        buf[j, c, z, y, i] = 0.0


@njit(nogil=True, cache=True)
def _crop_items(buf, out, b0, zb, bias, has_bias, code, alpha):  # pragma: no cover - compiled
    """out[item b0 + j] = act(the valid part of buf[j] + bias) (the epilogue ``(code,
    alpha)``): the inverse of _pad_items."""
    nb, O = buf.shape[0], buf.shape[1]
    _, _, Zo, Yo, Xo = out.shape
    ez = Zo if zb == 1 else 1
    for job in range(nb * O):
        j, o = job // O, job % O
        n, z0 = (b0 + j) // zb, ((b0 + j) % zb) * ez
        add = bias[o] if has_bias else np.float32(0.0)
        for z in range(ez):
            for y in range(Yo):
                row = out[n, o, z0 + z, y]
                for i in range(Xo):
                    row[i] = buf[j, o, z, y, i] + add
                act_row(row, 0, Xo, code, alpha)


_T = 16  # frequencies per transpose tile (128 bytes of complex64)


@njit(nogil=True, cache=True)
def _to_freq_major(src, dst, b0):  # pragma: no cover - compiled
    """dst[f, b0 + b, c] = src[b, c, f] (src: a block of items, batch-major)."""
    nb, C, F = src.shape
    nt = (F + _T - 1) // _T
    for job in range(nb * nt):
        b, f0 = job // nt, (job % nt) * _T
        for f in range(f0, min(F, f0 + _T)):
            for c in range(C):
                dst[f, b0 + b, c] = src[b, c, f]


@njit(nogil=True, cache=True)
def _from_freq_major(src, dst, b0):  # pragma: no cover - compiled
    """dst[b, o, f] = src[f, b0 + b, o]: the inverse of _to_freq_major."""
    nb, O, F = dst.shape
    nt = (F + _T - 1) // _T
    for job in range(nb * nt):
        b, f0 = job // nt, (job % nt) * _T
        for o in range(O):
            for f in range(f0, min(F, f0 + _T)):
                dst[b, o, f] = src[f, b0 + b, o]


# ----------------------------------------------------------------------------- the layer
def _kernel_spectra(w, tshape, threads, xp):
    """``(F, C_in, C_out)`` conj spectra scaled by ``1 / prod(tshape)``, built a few output
    channels at a time (the build holds one chunk beside the result, not a second copy)."""
    O, C = w.shape[:2]
    F = _freqs(tshape)
    khat = xp.empty((F, C, O), dtype=xp.complex64)
    if xp is np:  # pocketfft with threads
        # lazy: loads scipy only when called
        import scipy.fft as fft

        kw = {"workers": threads}
    else:
        fft, kw = xp.fft, {}
    step = max(1, 2**20 // (C64 * C * F))  # chunks of about 1 MiB: the build's transient
    for o0 in range(0, O, step):
        wo = w[o0 : o0 + step]
        # pruned: x on the kernel's rows only, then y, then z (each stage zero-pads its axis)
        k = fft.rfft(wo, n=tshape[2], axis=4, **kw)
        k = fft.fft(k, n=tshape[1], axis=3, **kw)
        k = fft.fft(k, n=tshape[0], axis=2, **kw) if tshape[0] > 1 else k
        xp.conjugate(k, out=k)
        k *= 1.0 / math.prod(tshape)
        khat[:, :, o0 : o0 + wo.shape[0]] = k.reshape(wo.shape[0], C, F).transpose(2, 1, 0)
    return khat


class FFTGemmConv(ResidentConv):
    """A valid 3-D convolution by FFT with per-frequency channel GEMMs (resident kernel spectra).

    Parameters
    ----------
    w : array, shape (C_out, C_in, kz, ky, kx)
    b : array, shape (C_out,), or None
    in_spatial : 3-tuple
        Input spatial shape the spectra are built for.
    threads : int
        Workers for the blocks of items (each with single-threaded FFTW plans and its own
        buffers); the batched GEMM uses BLAS's threads.
    xp : module
        ``numpy`` (pyfftw + numba + BLAS) or ``cupy`` (``cupy.fft`` + cuBLAS).

    Examples
    --------
    >>> import numpy as np
    >>> conv = FFTGemmConv(np.ones((2, 3, 1, 3, 3), np.float32), None, (4, 6, 6))
    >>> y = conv(np.ones((1, 3, 4, 6, 6), np.float32))
    >>> y.shape, round(float(y[0, 1, 2, 0, 0]), 3)
    ((1, 2, 4, 4, 4), 27.0)
    """

    def __init__(self, w, b, in_spatial, *, threads=1, xp=np):
        w = xp.ascontiguousarray(self._setup(w, b, in_spatial, threads, xp))
        self.tshape = fft_gemm_transform_shape(self.in_spatial, self.kernel)
        self.zb = self.in_spatial[0] if self.tshape[0] == 1 else 1  # z slices per item
        self.khat = _kernel_spectra(w, self.tshape, self.threads, xp)

    @property
    def kernel_cache_bytes(self) -> int:
        """Bytes held by the resident kernel spectra."""
        return int(self.khat.nbytes)

    # -- any xp (the GPU): whole-batch transforms, transposes by copy
    def _call_xp(self, x, low):
        xp, zb, ts = get_array_module(x), self.zb, self.tshape
        n, C, O = x.shape[0], self.c_in, self.c_out
        Z, Y, X = self.in_spatial
        items = x.reshape(n, C, zb, Z // zb, Y, X).transpose(0, 2, 1, 3, 4, 5).reshape(n * zb, C, Z // zb, Y, X)
        xh = xp.fft.rfftn(items.astype(xp.float32, copy=False), s=ts, axes=(2, 3, 4))
        F, B = _freqs(ts), n * zb
        X_ = xp.ascontiguousarray(xh.reshape(B, C, F).transpose(2, 0, 1))
        del xh
        Y_ = xp.matmul(X_, self.khat)  # (F, B, O)
        del X_
        sp = Y_.transpose(1, 2, 0).reshape((B, O) + ts[:2] + (ts[2] // 2 + 1,))
        y = xp.fft.irfftn(sp, s=ts, axes=(2, 3, 4)) * math.prod(ts)  # khat is pre-scaled
        zo, yo, xo = self.out_spatial
        ez = zo // zb  # per item: one slice (2D transforms) or all of them
        y = y[:, :, :ez, :yo, :xo].reshape(n, zb, O, ez, yo, xo).transpose(0, 2, 1, 3, 4, 5)
        y = xp.ascontiguousarray(y.reshape((n, O) + self.out_spatial), dtype=xp.float32)
        if self.bias is not None:
            y += self.bias.reshape(1, -1, 1, 1, 1)
        return y

    # -- CPU: blocked FFTW transforms, numba pad/transposes/crop, one batched cgemm
    def _buffers(self, n):
        """Per worker: a block of items' real and complex buffers and single-threaded FFTW
        plans (workers never share a buffer; no thread pool fights another)."""
        # lazy: loads pyfftw only when called
        import pyfftw

        hit = self._work
        if hit is not None and hit[0] == n:
            return hit[1]
        self._work = None
        ts, F = self.tshape, _freqs(self.tshape)
        B = n * self.zb
        nb = _block_items(B, max(self.c_in, self.c_out), F)
        workers = min(self.threads, -(-B // nb))
        spec = ts[:2] + (ts[2] // 2 + 1,)
        flags = (FFTW_EFFORT, "FFTW_DESTROY_INPUT")
        sets = []
        mx = ts[2]
        for _ in range(workers):  # in place: the real data in each complex buffer's (padded) rows
            cin = pyfftw.empty_aligned((nb, self.c_in) + spec, "complex64")
            cout = pyfftw.empty_aligned((nb, self.c_out) + spec, "complex64")
            rin, rout = cin.view(np.float32), cout.view(np.float32)
            fwd = pyfftw.FFTW(rin[..., :mx], cin, axes=(2, 3, 4), threads=1, flags=flags)
            inv = pyfftw.FFTW(cout, rout[..., :mx], axes=(2, 3, 4), direction="FFTW_BACKWARD", threads=1, flags=flags)
            sets.append((rin, cin, fwd, cout, rout, inv))
        bufs = (nb, sets)  # run by the caller and pooled threads (each_worker)
        self._work = (n, bufs)
        return bufs

    def _call_cpu(self, x, out, low):
        n, zb, F = x.shape[0], self.zb, _freqs(self.tshape)
        B, C, O = n * zb, self.c_in, self.c_out
        nb, sets = self._buffers(n)
        starts = list(range(0, B, nb))
        xs = np.asarray(x, dtype=np.float32)
        X = np.empty((F, B, C), np.complex64)

        def forward(w):
            rin, cin, fwd = sets[w][:3]
            for b0 in starts[w :: len(sets)]:
                k = min(nb, B - b0)
                _pad_items(xs, rin[:k], b0, zb)
                fwd()  # a short last block transforms stale items too: at most one block of waste
                _to_freq_major(cin[:k].reshape(k, C, F), X, b0)

        each_worker(forward, len(sets))
        Y = np.empty((F, B, O), np.complex64)
        gemm(X, self.khat, Y)  # one batched cgemm over all frequencies (split over the run's threads)
        X = None  # frees the input spectra before the output exists (the memory model assumes it)
        if out is None:
            out = arena.empty((n, O) + self.out_spatial)
        has_bias = self.bias is not None
        code, alpha = self.epilogue
        bias = self.bias if has_bias else np.zeros(O, np.float32)

        def inverse(w):
            cout, rout, inv = sets[w][3:]
            for b0 in starts[w :: len(sets)]:
                k = min(nb, B - b0)
                _from_freq_major(Y, cout[:k].reshape(k, O, F), b0)
                inv(normalise_idft=False)
                _crop_items(rout[:k], out, b0, zb, bias, has_bias, code, alpha)

        each_worker(inverse, len(sets))
        if not self.keep_buffers:
            self.release()
        return out
