"""PyTorch CPU baselines for dense sliding-window inference.

(a) ``TorchDense``: the dense dilated formulation.  Every conv runs at stride 1 with
    dilation = product of the earlier pooling windows; every max-pool becomes a stride-1
    max filter with that dilation, written as separable ``torch.maximum`` passes over
    shifted views (docs/pitfalls.md: 1.35-2x faster than ``MaxPool3d(dilation=...)``).  One pass
    over an input of edge n gives the whole dense output of edge n - F + 1.
(b) ``TorchNaive``: the all-offsets way.  The ordinary pooled network (stride-p pooling) is
    run once per input offset in [0, D) (D = product of pooling windows), each run giving
    the output on a D-strided grid; the runs are interleaved into the dense output.

Both keep their memory tight (ReLU in place, dead tensors dropped at once) so the budget
comparison with znni is fair, and both have a byte model of their own peak.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from znni_core.net import Activation, Conv, Network, Pool

F4 = 4  # bytes per float32


def _torch():
    import torch

    return torch


def _act(t, layer: Activation):
    torch = _torch()
    k = layer.kind
    if k == "relu":
        return torch.relu_(t)
    if k == "identity":
        return t
    import torch.nn.functional as F

    return {
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "softmax": lambda v: torch.softmax(v, dim=1),
        "leaky_relu": lambda v: F.leaky_relu(v, layer.alpha),
        "elu": lambda v: F.elu(v, layer.alpha),
    }[k](t)


def dilated_max(t, window, dilation):
    """Stride-1 max filter of ``window`` with ``dilation`` over the last 3 axes, separable."""
    torch = _torch()
    for axis, p, d in zip((2, 3, 4), window, dilation):
        if p == 1:
            continue
        n = t.shape[axis] - (p - 1) * d
        out = torch.maximum(t.narrow(axis, 0, n), t.narrow(axis, d, n))
        for j in range(2, p):
            torch.maximum(out, t.narrow(axis, j * d, n), out=out)
        t = out
    return t


def _dilated_max_owned(holder, window, dilation):
    """:func:`dilated_max` that drops each pass's input as soon as the next exists
    (the caller hands over its only reference in ``holder``): 2 tensors live, not 3."""
    torch = _torch()
    t = holder.pop()
    for axis, p, d in zip((2, 3, 4), window, dilation):
        if p == 1:
            continue
        n = t.shape[axis] - (p - 1) * d
        out = torch.maximum(t.narrow(axis, 0, n), t.narrow(axis, d, n))
        for j in range(2, p):
            torch.maximum(out, t.narrow(axis, j * d, n), out=out)
        t = out
        del out
    return t


class TorchDense:
    """(a) dense dilated formulation; ``run(x)`` -> ``(C_out, n - F + 1)`` numpy float32."""

    name = "torch-dense"

    def __init__(self, net: Network):
        torch = _torch()
        self.net = net
        self.ops = []
        d = (1, 1, 1)
        for layer in net.layers:
            if isinstance(layer, Conv):
                b = None if layer.bias is None else torch.from_numpy(layer.bias.copy())
                self.ops.append(("conv", torch.from_numpy(layer.weight.copy()), b, d))
            elif isinstance(layer, Pool):
                self.ops.append(("pool", layer.window, d))
                d = tuple(a * b for a, b in zip(d, layer.window))
            else:
                self.ops.append(("act", layer))

    def forward(self, t, profile: list | None = None):
        """``profile``: if a list, one ``{"op", "in", "seconds"}`` row per op is appended."""
        torch = _torch()
        import torch.nn.functional as F

        with torch.inference_mode():
            for op in self.ops:
                t0 = time.perf_counter()
                shape = list(t.shape[1:])
                if op[0] == "conv":
                    t = F.conv3d(t, op[1], op[2], dilation=op[3])
                    desc = f"conv {op[1].shape[1]}->{op[1].shape[0]} k={tuple(op[1].shape[2:])} dil={op[3]}"
                elif op[0] == "pool":
                    holder = [t]
                    del t
                    t = _dilated_max_owned(holder, op[1], op[2])
                    desc = f"max filter {op[1]} dil={op[2]}"
                else:
                    t = _act(t, op[1])
                    desc = op[1].kind
                if profile is not None:
                    profile.append({"op": desc, "in": shape, "seconds": time.perf_counter() - t0})
        return t

    def run(self, x: np.ndarray, profile: list | None = None) -> np.ndarray:
        torch = _torch()
        if x.ndim == 3:
            x = x[None]
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]
        return self.forward(t, profile)[0].numpy()

    def peak_bytes(self, n) -> int:
        """Model of the peak live bytes for an input of edge(s) ``n`` (input array included)."""
        shape = np.array((n,) * 3 if np.isscalar(n) else n, dtype=np.int64)
        x_in = self.net.in_channels * int(np.prod(shape)) * F4
        live, c, peak = x_in, self.net.in_channels, x_in
        for k, op in enumerate(self.ops):
            held = x_in if k > 0 else 0  # the caller keeps the input array alive throughout
            if op[0] == "conv":
                kern = np.array(op[1].shape[2:])
                shape = shape - (kern - 1) * np.array(op[3])
                c = int(op[1].shape[0])
                out = c * int(np.prod(shape)) * F4
                peak = max(peak, held + live + out)
                live = out
            elif op[0] == "pool":
                for a in range(3):  # one separable pass at a time: its input and its output
                    before = live
                    shape[a] -= (op[1][a] - 1) * op[2][a]
                    live = c * int(np.prod(shape)) * F4
                    peak = max(peak, held + before + live)
        return int(peak)


class TorchNaive:
    """(b) the pooled network run at each of the prod(D) input offsets, interleaved."""

    name = "torch-naive"

    def __init__(self, net: Network):
        torch = _torch()
        self.net = net
        self.D = net.pooling_product
        self.F = net.field_of_view
        self.ops = []
        for layer in net.layers:
            if isinstance(layer, Conv):
                b = None if layer.bias is None else torch.from_numpy(layer.bias.copy())
                self.ops.append(("conv", torch.from_numpy(layer.weight.copy()), b))
            elif isinstance(layer, Pool):
                self.ops.append(("pool", layer.window))
            else:
                self.ops.append(("act", layer))

    @property
    def offsets(self):
        return list(itertools.product(*(range(d) for d in self.D)))

    def forward(self, t):
        torch = _torch()
        import torch.nn.functional as F

        with torch.inference_mode():
            for op in self.ops:
                if op[0] == "conv":
                    t = F.conv3d(t, op[1], op[2])
                elif op[0] == "pool":
                    t = F.max_pool3d(t, op[1], stride=op[1])
                else:
                    t = _act(t, op[1])
        return t

    def out_shape(self, in_shape):
        return tuple(n - f + 1 for n, f in zip(in_shape, self.F))

    def check_shape(self, in_shape):
        out = self.out_shape(in_shape)
        if any(o < 1 or o % d for o, d in zip(out, self.D)):
            raise ValueError(f"naive baseline: output {out} must be a positive multiple of D={self.D} per axis")

    def run_offset(self, x_t, offset, m):
        """Strided-grid output for one offset; ``m`` output points per axis."""
        sl = tuple(slice(o, o + (mm - 1) * d + f) for o, mm, d, f in zip(offset, m, self.D, self.F))
        return self.forward(x_t[(slice(None), slice(None)) + sl])

    def run(self, x: np.ndarray, max_offsets: int | None = None, time_limit: float | None = None):
        """Dense output and timing.  Returns ``(out, seconds_for_all_offsets, offsets_run)``.

        With ``max_offsets`` / ``time_limit`` only the first offsets are run and the time for
        all prod(D) offsets is extrapolated from their mean (every offset does the same work);
        ``out`` is then only partly filled.
        """
        torch = _torch()
        if x.ndim == 3:
            x = x[None]
        self.check_shape(x.shape[1:])
        out_shape = self.out_shape(x.shape[1:])
        m = tuple(o // d for o, d in zip(out_shape, self.D))
        x_t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]
        out = np.zeros((self.net.out_channels,) + out_shape, np.float32)
        offs = self.offsets
        spent, done = 0.0, 0
        for off in offs:
            t0 = time.perf_counter()
            y = self.run_offset(x_t, off, m)
            out[(slice(None),) + tuple(slice(o, None, d) for o, d in zip(off, self.D))] = y[0].numpy()
            spent += time.perf_counter() - t0
            done += 1
            if (max_offsets and done >= max_offsets) or (time_limit and spent >= time_limit):
                break
        return out, spent * len(offs) / done, done

    def peak_bytes(self, n) -> int:
        shape = np.array((n,) * 3 if np.isscalar(n) else n, dtype=np.int64)
        c = self.net.in_channels
        full_in = c * int(np.prod(shape)) * F4
        out_total = self.net.out_channels * int(np.prod(np.array(self.out_shape(shape)))) * F4
        live = full_in
        peak = 0
        for op in self.ops:
            if op[0] == "conv":
                k = np.array(op[1].shape[2:])
                shape = shape - (k - 1)
                nxt = int(op[1].shape[0]) * int(np.prod(shape)) * F4
                peak = max(peak, live + nxt)
                live = nxt
            elif op[0] == "pool":
                shape = shape // np.array(op[1])
                nxt = live // math.prod(op[1])
                peak = max(peak, live + nxt)
                live = nxt
        return int(peak + full_in + out_total)


def dense_input_edge(net: Network, out_edge: int) -> int:
    return out_edge + max(net.field_of_view) - 1
