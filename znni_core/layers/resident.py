"""What the convolutions with a resident kernel transform share (:class:`FFTGemmConv`,
:class:`WinogradConv`): argument checks, the call contract (``out=`` of any strides, numpy
to the CPU path, CuPy to the ``xp`` path) and the per-call buffers kept between calls."""

from __future__ import annotations

import copy

import numpy as np

from ..errors import InputError
from .activation import apply_activation
from .buffers import CallBuffers
from .epilogue import epilogue
from .xp import get_array_module


class ResidentConv(CallBuffers):
    """Base of a valid 3-D convolution built once per layer and input shape.

    A subclass builds its kernel transform in ``__init__`` after :meth:`_setup`, and
    implements ``_call_cpu(x, out, low)`` (numpy; ``out`` may be None) and ``_call_xp(x, low)``
    (``low``: where ``x`` starts inside the zero-padded input, when :attr:`PADS_INPUT`).
    Per-call buffers live in ``self._work = (n, buffers)``: kept for the next
    call of the same size while ``keep_buffers`` is set (the executor's blocks and
    micro-batches; it then calls :meth:`release`).
    """

    def _setup(self, w, b, in_spatial, threads, xp):
        """Checks and the shapes every subclass needs; returns ``w`` as float32."""
        w = xp.asarray(w, dtype=xp.float32)
        if w.ndim != 5:
            raise InputError(f"w must be 5-D (C_out, C_in, kz, ky, kx); got shape {w.shape}")
        self.in_spatial = tuple(int(v) for v in in_spatial)
        self.kernel = tuple(int(k) for k in w.shape[2:])
        self.out_spatial = tuple(n - k + 1 for n, k in zip(self.in_spatial, self.kernel))
        if len(self.in_spatial) != 3 or min(self.out_spatial) < 1:
            raise InputError(f"kernel {self.kernel} does not fit the input {self.in_spatial}")
        self.c_out, self.c_in = int(w.shape[0]), int(w.shape[1])
        self.threads, self.xp = max(1, int(threads)), xp
        self.bias = None
        if b is not None:
            self.bias = xp.ascontiguousarray(xp.asarray(b), dtype=xp.float32)
            if self.bias.shape != (self.c_out,):
                raise InputError(f"bias must have shape ({self.c_out},); got {self.bias.shape}")
        self.keep_buffers = False
        #: while set, ``(kind, alpha)`` of the activation the output pass applies (a fused
        #: activation, :mod:`~znni_core.layers.epilogue`)
        self.act = None
        self._work = None
        return w

    #: whether a call can return its output channels last (:mod:`.layout`; numpy only)
    WRITES_CHANNELS_LAST = False

    def configured(self, act=None, channels_last: bool = False, keep_buffers: bool = False):
        """This convolution with a fused activation ``act`` (``(kind, alpha)`` or None) and, where
        :attr:`WRITES_CHANNELS_LAST`, a channels-last output: a view that shares the kernel
        transform and has its own per-call buffers (``keep_buffers``: kept between its calls,
        as a measurement repeating one call wants; a run keeps them with :meth:`buffers_kept`)."""
        view = copy.copy(self)
        view.act, view.keep_buffers, view._work = act, bool(keep_buffers), None
        if self.WRITES_CHANNELS_LAST:
            view.channels_last = bool(channels_last)
        return view

    #: whether the call takes ``low``: an input smaller than ``in_spatial``, zero-padded as it is read
    PADS_INPUT = False

    def __call__(self, x, out=None, low=None):
        """Convolve ``x`` ``(N, C_in, *in_spatial)`` -> ``(N, C_out, *out_spatial)``;
        ``out``: a destination of any strides (a block of a larger array).  ``low`` (where
        :attr:`PADS_INPUT`): ``x`` is the part of the input from ``low`` on, zero around it
        (a zero-padded convolution without a padded copy)."""
        xp = get_array_module(x)
        if xp is not self.xp:
            raise InputError(
                f"{type(self).__name__} was built for {self.xp.__name__} arrays, got a {xp.__name__} array"
            )
        low = (0, 0, 0) if low is None else tuple(int(v) for v in low)
        if any(low) and not self.PADS_INPUT:
            raise InputError(f"{type(self).__name__} takes no implicit padding (low={low})")
        fits = x.ndim == 5 and all(0 <= lo and lo + n <= s for lo, n, s in zip(low, x.shape[2:], self.in_spatial))
        if not fits or x.shape[1] != self.c_in or (not self.PADS_INPUT and tuple(x.shape[2:]) != self.in_spatial):
            raise InputError(f"x has shape {x.shape} at {low}; expected (N, {self.c_in}) + {self.in_spatial}")
        shape = (x.shape[0], self.c_out) + self.out_spatial
        if out is not None and tuple(out.shape) != shape:
            raise InputError(f"out has shape {out.shape}; expected {shape}")
        if xp is not np:
            y = self._call_xp(x, low)
            if self.act is not None:
                apply_activation(y, *self.act, out=y)
            if out is None:
                return y
            out[...] = y
            return out
        return self._call_cpu(x, out, low)

    @property
    def epilogue(self) -> tuple:
        """``(code, alpha)`` of :attr:`act` for the numba output pass."""
        code, alpha = epilogue(self.act)
        return code, np.float32(alpha)

    def _call_cpu(self, x, out, low):  # pragma: no cover - abstract
        raise NotImplementedError

    def _call_xp(self, x, low):  # pragma: no cover - abstract
        raise NotImplementedError
