"""FFT-based valid 3-D convolution with pruned transforms (ZNNi Sec. III-IV).

Correlation by FFT: with every axis padded to ``m >= n`` (``fft_size``),
``y = irfftn(rfftn(x) * conj(rfftn(w)))[:n - k + 1]`` has no wrap-around in the
valid region, which starts at index 0, so the inverse can be pruned too.

Pruned forward transform of data occupying ``[:ez, :ey, :ex]`` of an
``mz x my x mx`` box, in place in one complex buffer (its real view holds the
data; FFTW r2c in place, rows padded to ``2 * (mx // 2 + 1)`` floats)::

    1. r2c along x on the ez * ey data rows only        [:ez, :ey, :]
    2. c2c along y on the ez data planes only            [:ez, :, :]
    3. c2c along z on everything                         [:, :, :]

The inverse runs the other way and computes only what the valid output needs:
z on everything, y on the ``Zo`` planes kept, x (c2r) on the ``Zo * Yo`` rows kept.
For a 5^3 kernel in a 64^3 box the kernel transform does 1.3% of the x-stage and
7.8% of the y-stage work of a full ``rfftn``.

Kernel transforms are computed once per (layer, padded size), conjugated and
pre-scaled by ``1 / (mz * my * mx)``, and reused for every fragment of the batch and
every call.  The channel sums are complex multiply-accumulates in numba.

Modes (ZNNi Sec. IV-A.3): ``"data"`` runs each batched transform with ``threads``
FFTW threads and the multiply-accumulate parallel over frequency blocks;
``"task"`` gives independent work to a pool of ``threads`` workers (forward
transforms split by image, then one output channel at a time: its
multiply-accumulate, inverse transform and output copy), which also needs less
memory: one output spectrum per worker instead of all of them.  ``"stream"`` is
``"task"`` without the kernel cache: each worker transforms the ``C_in`` kernels of
its output channel when it gets to it (``C_in`` spectra per worker instead of
``C_in * C_out``: 1.7 GB -> 2 x 71 MB for 24 -> 24 maps at 90^3), at the price of
the kernel transforms on every call.  The executor keeps ``"data"`` / ``"task"``
layers (their kernel spectra) alive across calls of the same shape (pooling
offsets, slabs, micro-batches, patches); ``"stream"`` is for the layers whose
spectra would not fit.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
from pathlib import Path

import numpy as np

from ..cachedir import cache_dir
from ..errors import InputError
from . import arena
from ._numba import njit
from .buffers import CallBuffers
from .threads import each_worker, split_tasks
from .xp import get_array_module

__all__ = [
    "FFTConv",
    "default_wisdom_path",
    "fft_conv",
    "fft_conv_memory",
    "fft_kernel_cache_bytes",
    "fft_shape",
    "fft_size",
    "load_wisdom",
    "pruned_rfftn",
    "save_wisdom",
]

C64 = 8
F32 = 4
MODES = ("data", "task", "stream")
_EFFORT = {"estimate": "FFTW_ESTIMATE", "measure": "FFTW_MEASURE", "patient": "FFTW_PATIENT"}


@functools.lru_cache(maxsize=4096)  # asked hundreds of thousands of times while planning
def fft_size(n: int) -> int:
    """Smallest ``m >= n`` of the form ``2^a 3^b 5^c 7^d`` (fast FFTW sizes).

    Examples
    --------
    >>> [fft_size(n) for n in (1, 11, 13, 97)]
    [1, 12, 14, 98]
    """
    n = int(n)
    if n < 1:
        raise InputError(f"fft_size needs a positive size, got {n}")
    m = n
    while True:
        r = m
        for p in (2, 3, 5, 7):
            while r % p == 0:
                r //= p
        if r == 1:
            return m
        m += 1


def fft_shape(shape) -> tuple:
    """:func:`fft_size` of every axis."""
    return tuple(fft_size(n) for n in shape)


def _spec_shape(fshape):
    mz, my, mx = fshape
    return (mz, my, mx // 2 + 1)


# ----------------------------------------------------------------------------- wisdom
def default_wisdom_path() -> Path:
    """``$ZNNI_CACHE_DIR/fftw_wisdom.json``, else ``~/.cache/znni/fftw_wisdom.json``."""
    return cache_dir(create=False) / "fftw_wisdom.json"


def save_wisdom(path=None) -> Path:
    """Write FFTW's accumulated wisdom (``pyfftw.export_wisdom()``) as JSON/base64.

    No pickle: the file holds ``{"format", "pyfftw", "wisdom": [base64, ...]}``.
    Written to a temporary name and renamed, so a crash never leaves half a file.

    Returns
    -------
    pathlib.Path
        Where it was written.
    """
    path = Path(path) if path is not None else default_wisdom_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": "znni-fftw-wisdom/1",
        "pyfftw": _fftw().__version__,
        "wisdom": [base64.b64encode(w).decode("ascii") for w in _fftw().export_wisdom()],
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)
    return path


def load_wisdom(path=None):
    """Import wisdom written by :func:`save_wisdom`.

    Returns
    -------
    tuple of bool or None
        ``pyfftw.import_wisdom``'s result per precision (double, single, long
        double), or ``None`` when the file does not exist.

    Raises
    ------
    InputError
        The file is not znni wisdom.
    """
    path = Path(path) if path is not None else default_wisdom_path()
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        assert doc["format"] == "znni-fftw-wisdom/1"
        wisdom = tuple(base64.b64decode(s) for s in doc["wisdom"])
    except Exception as e:  # noqa: BLE001 - any malformation means the same thing
        raise InputError(f"{path} is not a znni FFTW wisdom file ({e!r}); delete it or pass another path") from e
    return tuple(_fftw().import_wisdom(wisdom))


# ----------------------------------------------------------------------------- pruned transforms
def _fftw():
    """pyfftw, imported on first use: it imports dask.array and scipy.fftpack (0.6 s), which a
    process that only looks up a cached plan (the workflow's parse, validate) never needs."""
    # lazy: loads pyfftw only when called
    import pyfftw

    return pyfftw


def _plan(a, b, axis, direction, threads, effort):
    # plans are always made before the buffers are filled: MEASURE overwrites them
    return _fftw().FFTW(
        a,
        b,
        axes=(axis,),
        direction=direction,
        threads=threads,
        flags=(_EFFORT[effort], "FFTW_DESTROY_INPUT"),
    )


def _forward_plans(buf, extent, fshape, threads, effort):
    """Plans of the pruned in-place r2c of data in ``buf.view(f32)[:, :ez, :ey, :ex]``."""
    ez, ey, _ = extent
    mx = fshape[2]
    real = buf.view(np.float32)
    return [
        _plan(real[:, :ez, :ey, :mx], buf[:, :ez, :ey, :], -1, "FFTW_FORWARD", threads, effort),
        _plan(buf[:, :ez], buf[:, :ez], -2, "FFTW_FORWARD", threads, effort),
        _plan(buf, buf, -3, "FFTW_FORWARD", threads, effort),
    ]


def _inverse_plans(buf, keep, fshape, threads, effort):
    """Plans of the pruned in-place c2r keeping ``[:, :kz, :ky, :kx]`` (unnormalised)."""
    kz, ky, _ = keep
    mx = fshape[2]
    real = buf.view(np.float32)
    return [
        _plan(buf, buf, -3, "FFTW_BACKWARD", threads, effort),
        _plan(buf[:, :kz], buf[:, :kz], -2, "FFTW_BACKWARD", threads, effort),
        _plan(buf[:, :kz, :ky, :], real[:, :kz, :ky, :mx], -1, "FFTW_BACKWARD", threads, effort),
    ]


def _fill(buf, data):
    """Put real ``data`` (B, ez, ey, ex) into the real view of ``buf``, zero the padding
    that the pruned transform reads."""
    ez, ey, ex = data.shape[1:]
    real = buf.view(np.float32)
    real[:, :ez, :ey, :ex] = data
    real[:, :ez, :ey, ex:] = 0
    real[:, :ez, ey:, :] = 0
    real[:, ez:] = 0


def _run(plans):
    for p in plans:
        p.execute()


def _empty_spec(batch, fshape):
    return _fftw().empty_aligned((batch,) + _spec_shape(fshape), dtype=np.complex64)


def pruned_rfftn(a, fshape, *, threads=1, effort="estimate"):
    """``numpy.fft.rfftn(a, s=fshape, axes=(-3, -2, -1))`` by pruned pyfftw transforms.

    Parameters
    ----------
    a : ndarray, shape (..., ez, ey, ex), real
    fshape : 3-tuple, each ``>=`` the data extent

    Returns
    -------
    ndarray, shape (..., mz, my, mx // 2 + 1), complex64
    """
    a = np.asarray(a, dtype=np.float32)
    lead, extent = a.shape[:-3], a.shape[-3:]
    if any(e > m for e, m in zip(extent, fshape)):
        raise InputError(f"data extent {extent} exceeds the transform shape {tuple(fshape)}")
    b = max(1, math.prod(lead))
    buf = _empty_spec(b, fshape)
    plans = _forward_plans(buf, extent, fshape, threads, effort)
    _fill(buf, a.reshape((b,) + extent))
    _run(plans)
    return buf.reshape(lead + buf.shape[1:])


# ----------------------------------------------------------------------------- multiply-accumulate
# 1-D slices in the inner loops and error_model="numpy" let LLVM vectorise the complex
# multiply-add (3-D indexing there ran 1.5-2x slower in /tmp micro-benchmarks, 80x80 maps).
@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _mac_data_blocks(X, K, P, block, b0, b1):  # pragma: no cover - compiled
    """P[n, o] = sum_c X[n, c] * K[o, c] over the frequency blocks [b0, b1) (cache-sized)."""
    N, Ci, F = X.shape
    Co = K.shape[0]
    for bi in range(b0, b1):
        f0 = bi * block
        f1 = min(F, f0 + block)
        m = f1 - f0
        for o in range(Co):
            for n in range(N):
                P[n, o, f0:f1] = 0
            for c in range(Ci):
                k = K[o, c, f0:f1]
                for n in range(N):
                    x = X[n, c, f0:f1]
                    p = P[n, o, f0:f1]
                    for f in range(m):
                        p[f] += x[f] * k[f]


def _mac_data(X, K, P, block):
    """:func:`_mac_data_blocks` over every frequency block, on the run's threads."""
    nb = -(-X.shape[2] // block)
    split_tasks(lambda b0, b1: _mac_data_blocks(X, K, P, block, b0, b1), nb)


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _conj_scale(K, scale):  # pragma: no cover - compiled
    """K = conj(K) * scale, in place (one pass; releases the GIL)."""
    for i in range(K.shape[0]):
        k = K[i]
        for f in range(k.shape[0]):
            k[f] = np.conj(k[f]) * scale


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _mac_task(X, K, o, P, block):  # pragma: no cover - compiled
    """P[n] = sum_c X[n, c] * K[o, c] for one output channel; releases the GIL."""
    N, Ci, F = X.shape
    for f0 in range(0, F, block):
        f1 = min(F, f0 + block)
        m = f1 - f0
        for n in range(N):
            P[n, f0:f1] = 0
        for c in range(Ci):
            k = K[o, c, f0:f1]
            for n in range(N):
                x = X[n, c, f0:f1]
                p = P[n, f0:f1]
                for f in range(m):
                    p[f] += x[f] * k[f]


def _mac_block(n, c_in):
    # 1024 frequencies: P rows stay in L1, the X block (n * c_in rows) in L2/L3; smaller
    # blocks did not help in a sweep (128..4096) and cost loop overhead
    return 1024


# ----------------------------------------------------------------------------- the layer
def _kernel_worker(c_in, kernel, fshape):
    """A buffer and pruned forward plans for the ``c_in`` kernel spectra of one output channel."""
    kb = _empty_spec(c_in, fshape)
    return kb, _forward_plans(kb, kernel, fshape, 1, "estimate")


def _channel_spectra(w_o, fshape, kb, plans):
    """conj(rfftn(w_o padded to fshape)) / prod(fshape) for the ``C_in`` kernels of one
    output channel, in ``kb``; returned as a ``(C_in, F)`` view."""
    _fill(kb, w_o)
    _run(plans)
    K = kb.reshape(kb.shape[0], -1)
    _conj_scale(K, np.float32(1.0 / math.prod(fshape)))
    return K


def _kernel_spectrum(w, fshape, threads):
    """All ``C_out x C_in`` kernel spectra (conj, pre-scaled), computed once.

    One output channel at a time per worker, through a ``C_in``-spectra buffer that stays
    in cache: one batched transform over the whole cache (1.7 GB for 24 -> 24 maps at
    90^3) ran 4-5x slower, bound by first-touch and memory traffic.
    """
    co, ci = w.shape[:2]
    khat = np.empty((co, ci, math.prod(_spec_shape(fshape))), np.complex64)
    nw = max(1, min(int(threads), co))
    work = [_kernel_worker(ci, w.shape[2:], fshape) for _ in range(nw)]

    def fill(i):
        kb, plans = work[i]
        for o in range(i, co, nw):
            khat[o] = _channel_spectra(w[o], fshape, kb, plans)

    each_worker(fill, nw)
    return khat


class FFTConv(CallBuffers):
    """A valid 3-D convolution layer by FFT with cached, pruned kernel transforms.

    Parameters
    ----------
    w : array, shape (C_out, C_in, kz, ky, kx)
    b : array, shape (C_out,), or None
    in_spatial : 3-tuple
        Input spatial shape; the transform size is ``fft_shape(in_spatial)``.
    threads : int
        FFTW threads (``"data"``) or pool workers (``"task"``).
    mode : {"data", "task"}
    xp : module
        ``numpy`` (pyfftw + numba) or ``cupy`` (``cupy.fft``, no pruning).
    effort : {"estimate", "measure", "patient"}
        FFTW planner effort of the per-call transforms; plans come from FFTW's
        in-process wisdom after the first call per shape (persist it with
        :func:`save_wisdom` / :func:`load_wisdom`).  ``"measure"`` cost 4-7 s on the
        first call at 24 maps of 64^3 on 2 busy cores, hence the default
        ``"estimate"``.  The one-off kernel transforms always use ``"estimate"``:
        measuring on the whole kernel cache costs more than it saves.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.ones((2, 1, 3, 3, 3), np.float32)
    >>> conv = FFTConv(w, None, (5, 5, 5), effort="estimate")
    >>> y = conv(np.ones((4, 1, 5, 5, 5), np.float32))
    >>> y.shape, round(float(y[0, 0, 0, 0, 0]), 3)
    ((4, 2, 3, 3, 3), 27.0)
    """

    def __init__(self, w, b, in_spatial, *, threads=1, mode="data", xp=np, effort="estimate"):
        if mode not in MODES:
            raise InputError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "stream" and xp is not np:
            raise InputError("mode 'stream' is a CPU (pyfftw) mode; use 'data' on the GPU")
        if effort not in _EFFORT:
            raise InputError(f"effort must be one of {sorted(_EFFORT)}, got {effort!r}")
        w = xp.ascontiguousarray(xp.asarray(w), dtype=xp.float32)
        if w.ndim != 5:
            raise InputError(f"w must be 5-D (C_out, C_in, kz, ky, kx); got shape {w.shape}")
        self.in_spatial = tuple(int(v) for v in in_spatial)
        self.kernel = tuple(w.shape[2:])
        self.out_spatial = tuple(n - k + 1 for n, k in zip(self.in_spatial, self.kernel))
        if len(self.in_spatial) != 3 or min(self.out_spatial) < 1:
            raise InputError(f"kernel {self.kernel} does not fit the input {self.in_spatial}")
        self.c_out, self.c_in = w.shape[:2]
        self.fshape = fft_shape(self.in_spatial)
        self.threads, self.mode, self.xp, self.effort = max(1, int(threads)), mode, xp, effort
        #: keep the call buffers for the next call of the same size (the caller then calls
        #: :meth:`release`); off by default, so a lone call leaves only the kernel spectra
        self.keep_buffers = False
        self._work = None
        self.bias = None
        if b is not None:
            self.bias = xp.ascontiguousarray(xp.asarray(b), dtype=xp.float32)
            if self.bias.shape != (self.c_out,):
                raise InputError(f"bias must have shape ({self.c_out},); got {self.bias.shape}")
        self.w = w
        if mode == "stream":
            self.khat = None  # transformed per output channel on every call
        elif xp is np:
            self.khat = _kernel_spectrum(w, self.fshape, self.threads)
        else:  # GPU: full cuFFT transforms (unnormalised product, irfftn normalises)
            k = xp.fft.rfftn(w, s=self.fshape, axes=(2, 3, 4))
            self.khat = xp.conj(k).astype(xp.complex64).reshape(self.c_out, self.c_in, -1)

    @property
    def kernel_cache_bytes(self) -> int:
        """Bytes held by the cached kernel transforms (0 in ``"stream"`` mode)."""
        return 0 if self.khat is None else int(self.khat.nbytes)

    def __call__(self, x, out=None):
        """Convolve ``x`` ``(N, C_in, *in_spatial)`` -> ``(N, C_out, *out_spatial)``.

        ``out``: a destination (any strides, e.g. a block of a larger array; ``task`` and
        ``stream`` write into it directly, the other modes copy)."""
        xp = get_array_module(x)
        if xp is not self.xp:
            raise InputError(f"FFTConv was built for {self.xp.__name__} arrays, got a {xp.__name__} array")
        if x.ndim != 5 or x.shape[1] != self.c_in or tuple(x.shape[2:]) != self.in_spatial:
            raise InputError(f"x has shape {x.shape}; expected (N, {self.c_in}) + {self.in_spatial}")
        if out is not None and tuple(out.shape) != (x.shape[0], self.c_out) + self.out_spatial:
            raise InputError(f"out has shape {out.shape}; expected {(x.shape[0], self.c_out) + self.out_spatial}")
        if xp is not np or self.mode == "data":
            y = (
                _fft_conv_xp(x, self.khat, self.bias, self.fshape, self.out_spatial)
                if xp is not np
                else self._call_data(np.ascontiguousarray(x, dtype=np.float32))
            )
            if out is None:
                return y
            out[...] = y
            return out
        # a block view is read in place: the transforms' fill copies it anyway
        return self._call_task(np.asarray(x, dtype=np.float32), out)

    # -- "data": batched transforms, each multithreaded
    def _call_data(self, x):
        n, T, eff = x.shape[0], self.threads, self.effort
        fs, (zo, yo, xo) = self.fshape, self.out_spatial
        xin = _empty_spec(n * self.c_in, fs)
        plans = _forward_plans(xin, self.in_spatial, fs, T, eff)
        _fill(xin, x.reshape((n * self.c_in,) + self.in_spatial))
        _run(plans)
        p = _empty_spec(n * self.c_out, fs)
        inv = _inverse_plans(p, self.out_spatial, fs, T, eff)
        _mac_data(xin.reshape(n, self.c_in, -1), self.khat, p.reshape(n, self.c_out, -1), _mac_block(n, self.c_in))
        del xin, plans
        _run(inv)
        out = arena.empty((n, self.c_out) + self.out_spatial)
        out.reshape((n * self.c_out,) + self.out_spatial)[...] = p.view(np.float32)[:, :zo, :yo, :xo]
        if self.bias is not None:
            out += self.bias.reshape(1, -1, 1, 1, 1)
        return out

    # -- "task": independent transforms / output channels over a pool of workers
    def _task_buffers(self, n):
        """Buffers and FFTW plans of a ``task``/``stream`` call on ``n`` items, reused by the
        next call of the same size (blocks, micro-batches): no fresh pages, no re-planning."""
        hit = getattr(self, "_work", None)
        if hit is not None and hit[0] == n:
            return hit[1]
        self._work = None  # one set at a time
        T, eff, fs = self.threads, self.effort, self.fshape
        B = n * self.c_in
        xin = _empty_spec(B, fs)
        bounds = np.linspace(0, B, min(T, B) + 1).astype(int)
        chunks = [(a, c) for a, c in zip(bounds[:-1], bounds[1:]) if c > a]
        fplans = [_forward_plans(xin[a:c], self.in_spatial, fs, 1, eff) for a, c in chunks]
        nw = min(T, self.c_out)
        work = [_empty_spec(n, fs) for _ in range(nw)]
        iplans = [_inverse_plans(wb, self.out_spatial, fs, 1, eff) for wb in work]
        kwork = [_kernel_worker(self.c_in, self.kernel, fs) for _ in range(nw)] if self.mode == "stream" else None
        bufs = (xin, chunks, fplans, nw, work, iplans, kwork)
        self._work = (n, bufs)
        return bufs

    def _call_task(self, x, out=None):
        n = x.shape[0]
        fs, (zo, yo, xo) = self.fshape, self.out_spatial
        xin, chunks, fplans, nw, work, iplans, kwork = self._task_buffers(n)
        xs = x.reshape((n * self.c_in,) + self.in_spatial)  # a view when N and C merge (blocks do)
        stream = self.mode == "stream"
        if out is None:
            out = arena.empty((n, self.c_out) + self.out_spatial)
        X = xin.reshape(n, self.c_in, -1)
        block = _mac_block(n, self.c_in)

        def forward(i):
            a, c = chunks[i]
            _fill(xin[a:c], xs[a:c])
            _run(fplans[i])

        def channels(i):
            wb, pv = work[i], work[i].reshape(n, -1)
            for o in range(i, self.c_out, nw):
                if stream:
                    _mac_task(X, _channel_spectra(self.w[o], fs, *kwork[i])[None], 0, pv, block)
                else:
                    _mac_task(X, self.khat, o, pv, block)
                _run(iplans[i])
                dst = out[:, o]
                dst[...] = wb.view(np.float32)[:, :zo, :yo, :xo]
                if self.bias is not None:
                    dst += self.bias[o]

        each_worker(forward, len(chunks))
        each_worker(channels, nw)
        if not self.keep_buffers:
            self.release()
        return out


def _fft_conv_xp(x, khat, b, fshape, out_spatial):
    """Generic (any ``xp``) FFT convolution with unnormalised conj kernel spectra."""
    xp = get_array_module(x)
    n, co = x.shape[0], khat.shape[0]
    xh = xp.fft.rfftn(x.astype(xp.float32, copy=False), s=fshape, axes=(2, 3, 4))
    p = xp.einsum("ncf,ocf->nof", xh.reshape(n, x.shape[1], -1), khat)
    del xh
    y = xp.fft.irfftn(p.reshape((n, co) + _spec_shape(fshape)), s=fshape, axes=(2, 3, 4))
    zo, yo, xo = out_spatial
    y = xp.ascontiguousarray(y[:, :, :zo, :yo, :xo], dtype=xp.float32)
    if b is not None:
        y += b.reshape(1, -1, 1, 1, 1)
    return y


def fft_conv(x, w, b=None, **kw):
    """One-shot FFT convolution: ``FFTConv(w, b, x.shape[2:], xp=..., **kw)(x)``."""
    xp = get_array_module(x)
    return FFTConv(w, b, tuple(x.shape[2:]), xp=xp, **kw)(x)


def fft_kernel_cache_bytes(c_in, c_out, in_shape) -> int:
    """Bytes of the cached kernel spectra of one layer (complex64)."""
    return C64 * c_in * c_out * math.prod(_spec_shape(fft_shape(in_shape)))


def fft_conv_memory(n, c_in, c_out, in_shape, kernel, mode="data", threads=None, cache=True) -> int:
    """Predicted peak bytes of :class:`FFTConv` (kernel cache + call), input excluded.

    ``data``: cache + output spectra + max(input spectra, output).
    ``task``: cache + input spectra + one output spectrum per worker + output;
    ``stream``: no cache, ``C_in`` kernel spectra per worker instead;
    ``threads=None`` assumes ``os.cpu_count()`` workers (an upper bound);
    ``cache=False`` leaves out the kernel cache (held elsewhere, e.g. by the executor).
    """
    spec = C64 * math.prod(_spec_shape(fft_shape(in_shape)))
    out = F32 * n * c_out * math.prod(int(s) - int(k) + 1 for s, k in zip(in_shape, kernel))
    cache = fft_kernel_cache_bytes(c_in, c_out, in_shape) if cache else 0
    if mode == "data":
        return cache + n * c_out * spec + max(n * c_in * spec, out)
    t = (os.cpu_count() or 1) if threads is None else int(threads)
    if mode == "task":
        return cache + n * c_in * spec + min(t, c_out) * n * spec + out
    if mode == "stream":  # no cache; each worker holds the C_in kernel spectra of its channel
        return n * c_in * spec + min(t, c_out) * (n + c_in) * spec + out
    raise InputError(f"mode must be one of {MODES}, got {mode!r}")
