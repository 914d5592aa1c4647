"""Array-module dispatch: one source for numpy (CPU) and CuPy (GPU).

CuPy is never imported when this module is imported; :func:`cupy_or_none` imports
it lazily and :func:`get_array_module` only looks at CuPy when the array's type
comes from it, so CPU-only runs never pay for (or fail on) a CuPy import.

An operation is written once against the array module of its input; where the host has a
faster way (a numba kernel, the threaded GEMM), that is a *host variant* registered beside it
with :func:`with_host_variant`, not a branch inside it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import numpy

from ..errors import DeviceError

__all__ = [
    "SIMULATED",
    "cupy_module",
    "cupy_or_none",
    "empty_pinned",
    "get_array_module",
    "is_numpy",
    "require_device",
    "with_host_variant",
]

_CUPY = None
_CUPY_TRIED = False


def cupy_or_none():
    """Return the ``cupy`` module if it imports, else ``None``.

    The import is attempted once per process; any failure (not installed, CUDA
    libraries missing) gives ``None``.  Whether a device is usable is a separate
    question: see ``cupy.is_available()``.

    Returns
    -------
    module or None
    """
    global _CUPY, _CUPY_TRIED
    if not _CUPY_TRIED:
        _CUPY_TRIED = True
        try:
            _CUPY = importlib.import_module("cupy")
        except Exception:  # ImportError, or CUDA runtime errors raised at import
            _CUPY = None
    return _CUPY


def get_array_module(x):
    """The array module (``numpy`` or ``cupy``) that owns ``x``.

    Parameters
    ----------
    x : array-like
        A numpy array, a CuPy array, or anything numpy accepts.

    Returns
    -------
    module
        ``cupy`` when ``x`` is a CuPy array, else ``numpy``.

    Examples
    --------
    >>> import numpy as np
    >>> get_array_module(np.zeros(3)) is np
    True
    """
    mod = type(x).__module__
    if mod.startswith("cupy") and "cupy" in sys.modules:
        return sys.modules["cupy"]
    if mod == "znni_core.layers.simdevice":  # the simulated GPU of the tests
        return sys.modules[mod].module()
    return numpy


def is_numpy(xp) -> bool:
    """True when ``xp`` is numpy (the CPU fast paths apply)."""
    return xp is numpy


def with_host_variant(generic):
    """An operation written once against its input's array module (``generic``), with a place
    for a host variant: ``@op.host`` registers it, and a call whose first argument is a plain
    ``numpy.ndarray`` runs it; any other (a CuPy array, the simulated device's arrays, a numpy
    subclass) runs ``generic``.  A host variant calls
    ``op.generic`` for the inputs it does not cover (another dtype).

    >>> import numpy as np
    >>> @with_host_variant
    ... def double(x):
    ...     return x * 2
    >>> @double.host
    ... def _(x):
    ...     return np.multiply(x, 2, out=x)  # in place: the host's way
    >>> a = np.ones(2)
    >>> double(a) is a, double.generic(a) is a
    (True, False)
    """
    host = None

    @functools.wraps(generic)
    def call(x, *args, **kwargs):
        if host is not None and type(x) is numpy.ndarray:
            return host(x, *args, **kwargs)
        return generic(x, *args, **kwargs)

    def register(fn):
        nonlocal host
        host = fn
        return fn

    call.host, call.generic = register, generic
    return call


def empty_pinned(xp, shape, dtype=numpy.float32):
    """An uninitialised page-locked host array for copies to and from ``xp``'s device:
    ``cupyx.empty_pinned`` on CuPy (CuPy itself has none), the simulated device's own."""
    alloc = getattr(xp, "empty_pinned", None) or importlib.import_module("cupyx").empty_pinned
    return alloc(shape, dtype=dtype)


#: set to a size (``2GiB``) to run ``device="gpu"`` on the simulated GPU (layers/simdevice.py): tests only
SIMULATED = "ZNNI_SIMULATED_GPU"


def cupy_module():
    """Return the ``cupy`` module if a CUDA device is usable, else raise :class:`DeviceError`."""
    try:
        import cupy  # optional: only where a GPU is asked for
    except Exception as exc:  # not installed, or broken CUDA libraries
        raise DeviceError(
            f"device 'gpu' needs CuPy ({exc.__class__.__name__}: {exc}); install znni[gpu] "
            "(cupy-cuda12x) on a machine with an NVIDIA GPU, or use device='cpu'"
        ) from exc
    try:
        if not cupy.is_available():
            raise RuntimeError("cupy.is_available() is False")
    except Exception as exc:
        raise DeviceError(
            f"device 'gpu' requested but no CUDA device is usable here ({exc}); use device='cpu'"
        ) from exc
    return cupy


def require_device(device: str):
    """Validate a device name; returns the array module for it."""
    if device == "cpu":
        return numpy
    if device in ("gpu", "cuda", "cpu+gpu"):  # cpu+gpu: the GPU stage's module
        if os.environ.get(SIMULATED):
            # lazy: loads charset_normalizer only when called
            from . import simdevice

            return simdevice.module()
        return cupy_module()
    raise DeviceError(f"unknown device {device!r}; use 'cpu', 'gpu' or 'cpu+gpu'")
