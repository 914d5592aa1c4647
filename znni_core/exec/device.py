"""The one place CuPy is imported (lazily).  A GPU request without a usable device
fails with an actionable message."""
from __future__ import annotations

from ..errors import DeviceError


def cupy_module():
    """Return the ``cupy`` module if a CUDA device is usable, else raise :class:`DeviceError`."""
    try:
        import cupy
    except Exception as exc:  # not installed, or broken CUDA libraries
        raise DeviceError(f"device 'gpu' needs CuPy ({exc.__class__.__name__}: {exc}); install znni[gpu] "
                          "(cupy-cuda12x) on a machine with an NVIDIA GPU, or use device='cpu'") from exc
    try:
        if not cupy.is_available():
            raise RuntimeError("cupy.is_available() is False")
    except Exception as exc:
        raise DeviceError(f"device 'gpu' requested but no CUDA device is usable here ({exc}); use device='cpu'") from exc
    return cupy


def require_device(device: str):
    """Validate a device name; returns the array module for it."""
    if device == "cpu":
        import numpy

        return numpy
    if device in ("gpu", "cuda"):
        return cupy_module()
    raise DeviceError(f"unknown device {device!r}; use 'cpu' or 'gpu'")
