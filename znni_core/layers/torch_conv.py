"""cuDNN through PyTorch: the optional GPU primitive ``direct-torch``.

CuPy 14 has no cuDNN binding.  PyTorch does: its ``conv3d`` runs on CuPy memory through
DLPack (zero-copy both ways), on CuPy's current stream, with TF32 off (it is on for
convolutions by default and would change the results at the 1e-3 level).  The result,
allocated by PyTorch's caching allocator, is copied into an array of the ``xp`` pool, so the
plan's memory stays in one pool; PyTorch keeps the freed block for the next call (the
planner counts one output of it: :func:`torch_conv_memory`).

On the simulated GPU (CI) the same code runs on PyTorch's CPU kernels.

On an H100 (CuPy 14.2, PyTorch 2.11, CUDA 13; 2026-11-26) this primitive returned wrong results
now and then when CuPy's current stream was the default stream: in the device tests run beside
other processes on the GPU, and in ``benchmarks/gpu.py`` after PyTorch's own dense run (max
relative errors 0.04 to 3.8); run alone, and on an explicit stream (GPU + host RAM plans), it
was exact.  The cause, found afterwards in PyTorch's tracker: ``ExternalStream(0)`` is a
pooled stream, not the null stream (:meth:`TorchConv._stream` maps it now).  Until a run on a GPU
verifies the fix, ``direct-torch`` is no default GPU primitive: it runs when asked for
(``primitives=``).
"""

from __future__ import annotations

import contextlib
import copy
import math

import numpy as np

from ..errors import InputError
from .activation import apply_activation
from .xp import get_array_module

F32 = 4


def torch_available() -> bool:
    """True if ``import torch`` succeeds."""
    try:
        import torch  # noqa: F401
    except Exception:
        return False
    return True


class TorchConv:
    """A valid 3-D convolution by ``torch.nn.functional.conv3d``; ``act``: ``(kind, alpha)`` of
    a fused activation (applied to the copied output, in place), or None."""

    def __init__(self, w, b, xp):
        # lazy: loads torch only when called
        import torch

        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        self.xp, self.torch, self.act = xp, torch, None
        self._w = xp.ascontiguousarray(xp.asarray(w, dtype=np.float32))
        if self._w.ndim != 5:
            raise InputError(f"w must be 5-D (C_out, C_in, kz, ky, kx); got shape {self._w.shape}")
        self._b = None if b is None else xp.ascontiguousarray(xp.asarray(b, dtype=np.float32))
        self.w = torch.from_dlpack(self._w)  # shares the device array's memory
        self.b = None if self._b is None else torch.from_dlpack(self._b)

    def _stream(self):
        """PyTorch's work goes on CuPy's current stream.  The default (legacy null) stream, handle
        0, is PyTorch's default stream: ``torch.cuda.ExternalStream(0)`` would hand back a fresh
        non-blocking stream of PyTorch's pool instead (pytorch/pytorch#182960), unordered with
        CuPy's work."""
        if not self.w.is_cuda:
            return contextlib.nullcontext()
        torch, ptr = self.torch, self.xp.cuda.get_current_stream().ptr
        if ptr in (0, 1):  # 0: the null stream; 1: cudaStreamLegacy, the same one
            stream = torch.cuda.default_stream(self.w.device)
        else:
            stream = torch.cuda.ExternalStream(ptr, device=self.w.device)
        return torch.cuda.stream(stream)

    def configured(self, act=None):
        """This convolution with the fused activation ``act``: a view sharing the weights."""
        view = copy.copy(self)
        view.act = act
        return view

    def __call__(self, x):
        """``(N, C_out, z - kz + 1, y - ky + 1, x - kx + 1)`` float32 output of ``x`` (N, C_in, z, y, x).

        An :class:`InputError` if ``x`` is not of the array module the layer was built for, or of the wrong
        shape.
        """
        xp = get_array_module(x)
        if xp is not self.xp:
            raise InputError(f"TorchConv was built for {self.xp.__name__} arrays, got a {xp.__name__} array")
        if x.ndim != 5 or x.shape[1] != self._w.shape[1]:
            raise InputError(f"x has shape {x.shape}; expected (N, {self._w.shape[1]}, z, y, x)")
        torch = self.torch
        x = xp.ascontiguousarray(x, dtype=np.float32)
        with torch.no_grad(), self._stream():
            y = torch.nn.functional.conv3d(torch.from_dlpack(x), self.w, self.b)
            out = xp.empty(tuple(y.shape), dtype=np.float32)
            torch.from_dlpack(out).copy_(y)
        if self.act is not None:
            apply_activation(out, *self.act, out=out)
        return out


def torch_conv_memory(n, c_in, c_out, in_shape, kernel) -> int:
    """Peak bytes of a :class:`TorchConv` call: PyTorch's output and its copy in the pool."""
    out = F32 * n * c_out * math.prod(int(s) - int(k) + 1 for s, k in zip(in_shape, kernel))
    return 2 * out
