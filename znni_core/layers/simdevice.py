"""A simulated GPU: the device code paths, tested on a machine without one.

``ZNNI_SIMULATED_GPU=<bytes>`` (e.g. ``2GiB``) makes ``device="gpu"`` resolve to this
module instead of CuPy.  It behaves like CuPy where that matters to znni:

- arrays are :class:`DeviceArray` (numpy memory, a distinct type), so the engine takes
  its ``xp`` (GPU) paths, never the CPU fast paths;
- mixing a host (numpy) array into a device computation raises ``TypeError``, as CuPy
  does: a weight never moved to the device or a hidden round trip fails here, not first
  on a GPU.  Moving data is explicit: ``asarray`` (host to device), ``asnumpy`` /
  ``DeviceArray.get`` (device to host);
- FFTs keep single precision (``scipy.fft``, as cuFFT does; ``numpy.fft`` promotes);
- device memory is capped (``get_default_memory_pool().set_limit``, and the capacity
  from the variable): an allocation past it raises :class:`OutOfMemoryError`; the pool
  counts live bytes and their peak (``peak_bytes``), the measured side of the memory
  model's prediction;
- the CuPy names the executor uses exist: ``cuda.runtime.memGetInfo``, ``cuda.Stream``,
  ``cuda.Event``, and ``empty_pinned`` (``cupyx.empty_pinned`` on CuPy).

Speed means nothing here (it is numpy, single-stream).  Nothing in it is imported
unless the variable is set.
"""

from __future__ import annotations

import functools
import os
import threading
import types
import weakref

import numpy as np
import scipy.fft

from ..units import parse_bytes

__all__ = ["DeviceArray", "OutOfMemoryError", "module"]

ENV = "ZNNI_SIMULATED_GPU"
ENV_COUNT = "ZNNI_SIMULATED_GPUS"  # how many devices it reports (one pool for all: memory is not per device)


class OutOfMemoryError(MemoryError):
    """An allocation past the simulated device's memory (CuPy raises ``OutOfMemoryError`` too)."""


def _host(a):
    return type(a) is np.ndarray and a.ndim > 0


def _strip(v):
    """Device arrays as plain numpy views (to call numpy on them), recursively in lists."""
    if isinstance(v, DeviceArray):
        return v.view(np.ndarray)
    if isinstance(v, (list, tuple)):
        return type(v)(_strip(x) for x in v)
    return v


def _dev(v):
    if type(v) is np.ndarray:
        return v.view(DeviceArray)
    if isinstance(v, tuple):
        return tuple(_dev(x) for x in v)
    return v


class Pool:
    """Live and peak device bytes (every array's memory counted once, freed with its last view)."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.limit = 0  # 0: the capacity
        self.used = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()

    def track(self, a):
        root = a
        while getattr(root, "base", None) is not None:  # views (as_strided's too) count their owner's memory
            root = root.base
        if not isinstance(root, np.ndarray):
            return  # memory numpy does not own (a buffer): not a device allocation
        key = id(root)
        if key in self._live:
            return
        n = int(root.nbytes)
        with self._lock:
            cap = min(self.capacity, self.limit or self.capacity)
            if self.used + n > cap:
                raise OutOfMemoryError(
                    f"simulated GPU: out of memory allocating {n:,} bytes ({self.used:,} in use, limit {cap:,})"
                )
            self._live[key] = n
            self.used += n
            self.peak = max(self.peak, self.used)
        weakref.finalize(root, self._free, key)

    def _free(self, key):
        with self._lock:
            self.used -= self._live.pop(key, 0)

    # the CuPy pool API
    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used

    def set_limit(self, size=None, fraction=None):
        self.limit = int(size or 0) if fraction is None else int(fraction * self.capacity)

    def get_limit(self) -> int:
        return self.limit

    def free_all_blocks(self):
        pass

    # not in CuPy: the measurement (exec/device.py gives CuPy the same through an allocator)
    def peak_bytes(self) -> int:
        return self.peak

    def reset_peak(self):
        self.peak = self.used


class DeviceArray(np.ndarray):
    """An array "on the device": numpy memory, CuPy's rules."""

    def __array_finalize__(self, obj):
        _POOL.track(self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        out = kw.get("out") or ()
        if any(_host(a) for a in inputs + tuple(out)):
            raise TypeError(f"{ufunc.__name__}: a host (numpy) array mixed with device arrays; move it with xp.asarray")
        if out:
            kw["out"] = tuple(_strip(o) for o in out)
        r = getattr(ufunc, method)(*_strip(inputs), **kw)
        if out:
            return out[0] if len(out) == 1 else tuple(out)
        return _dev(r)

    def __array_function__(self, func, types_, args, kwargs):
        raise TypeError(
            f"numpy.{func.__name__} called on a device array: call it through xp "
            "(CuPy refuses implicit conversion to numpy)"
        )

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Device to host (CuPy's ``ndarray.get``)."""
        if out is not None:
            out[...] = self.view(np.ndarray)
            return out
        return np.array(self.view(np.ndarray), order=order, copy=True)

    def set(self, arr, stream=None):
        """Host to device into this array (CuPy's ``ndarray.set``)."""
        self.view(np.ndarray)[...] = arr


def _wrap(fn, name):
    @functools.wraps(fn)
    def call(*args, **kw):
        if any(_host(a) for a in args):
            raise TypeError(f"xp.{name}: a host (numpy) array given to a device function; move it with xp.asarray")
        return _dev(fn(*_strip(args), **{k: _strip(v) for k, v in kw.items()}))

    return call


class _Namespace(types.ModuleType):
    """numpy (or a numpy submodule) with every function wrapped for device arrays."""

    def __init__(self, name, base, overrides=None):
        super().__init__(name)
        self._base = base
        self.__dict__.update(overrides or {})

    def __getattr__(self, name):
        v = getattr(self._base, name)
        if isinstance(v, types.ModuleType):
            v = _Namespace(f"{self.__name__}.{name}", v)
        elif callable(v) and not isinstance(v, type):
            v = _wrap(v, name)
        setattr(self, name, v)
        return v


def asarray(a, dtype=None, order=None, blocking=False):
    """Host to device (a copy), or the device array itself."""
    if isinstance(a, DeviceArray) and (dtype is None or a.dtype == np.dtype(dtype)):
        return a
    if isinstance(a, DeviceArray):
        return a.astype(dtype)
    return np.array(a, dtype=dtype, order=order or "K", copy=True).view(DeviceArray)


def array(a, dtype=None, copy=True, order="K"):
    return asarray(a, dtype).copy(order=order) if copy and isinstance(a, DeviceArray) else asarray(a, dtype)


def ascontiguousarray(a, dtype=None):
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """Device to host."""
    return a.get(out=out, order=order) if isinstance(a, DeviceArray) else np.asarray(a, order=order)


def empty_pinned(shape, dtype=np.float32, order="C"):
    """Host staging memory (page-locked on a GPU)."""
    return np.empty(shape, dtype=dtype, order=order)


class _Stream:
    def __init__(self, non_blocking=False, null=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def wait_event(self, event):
        pass

    def record(self, event=None):
        return event or _Event()


class _Event:
    def __init__(self, *a, **kw):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Device:
    def __init__(self, index=0):
        self.id = int(index)

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _mem_get_info():
    cap = _POOL.capacity
    return cap - _POOL.used, cap


def _fft_namespace():
    def single(fn):
        @functools.wraps(fn)
        def call(x, *a, **kw):
            if _host(x):
                raise TypeError(f"xp.fft.{fn.__name__}: a host array; move it with xp.asarray")
            return _dev(fn(_strip(x), *a, **kw))

        return call

    names = ("fft", "ifft", "rfft", "irfft", "fftn", "ifftn", "rfftn", "irfftn", "fft2", "ifft2", "rfft2", "irfft2")
    return _Namespace("znni_simgpu.fft", scipy.fft, {n: single(getattr(scipy.fft, n)) for n in names})


_POOL = Pool(0)
_MODULE = None


def parse_capacity(text: str) -> int:

    n = parse_bytes(text)
    if n <= 0:
        raise ValueError(f"{ENV}={text!r}: give the simulated device memory in bytes, e.g. 2GiB")
    return n


def module(capacity=None):
    """The simulated-GPU array module (one per process; ``capacity`` resets its memory)."""
    global _MODULE
    if capacity is not None:
        _POOL.capacity = int(capacity)
    elif _MODULE is None:
        _POOL.capacity = parse_capacity(os.environ.get(ENV, "0"))
    if _MODULE is None:
        cuda = types.SimpleNamespace(
            runtime=types.SimpleNamespace(
                memGetInfo=_mem_get_info, getDeviceCount=lambda: int(os.environ.get(ENV_COUNT, "1"))
            ),
            Stream=_Stream,
            Event=_Event,
            Device=_Device,
            get_current_stream=lambda: _Stream(),
            memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
        )
        _MODULE = _Namespace(
            "znni_simgpu",
            np,
            {
                "asarray": asarray,
                "array": array,
                "ascontiguousarray": ascontiguousarray,
                "asnumpy": asnumpy,
                "empty_pinned": empty_pinned,
                "fft": _fft_namespace(),
                "cuda": cuda,
                "ndarray": DeviceArray,
                "get_default_memory_pool": lambda: _POOL,
                "is_available": lambda: True,
                "simulated": True,
                "OutOfMemoryError": OutOfMemoryError,
            },
        )
    return _MODULE
