"""Independent references for the engine, written for the tests only.

* :func:`naive_window` applies the network to ONE window (plain numpy: a direct convolution,
  pooling by reshape) - the definition itself.
* :func:`naive_dense` applies it at every (or at sampled) window positions.
* :func:`torch_dense` is PyTorch's dense formulation: pooling as a stride-1 max
  filter, later layers dilated by the product of earlier pooling windows.
"""

from __future__ import annotations

import itertools

import numpy as np

from znni_core.net.chain import Conv, Pool


def naive_window(net, w):
    """Network output (C_out,) for one window (C, Fz, Fy, Fx), in float64: the definition, as
    ``znni verify`` computes it (:func:`znni_core.net.definition.plain_forward`, itself checked
    against PyTorch in ``test_engine.py::test_the_definition_equals_torch``)."""
    from znni_core.net.definition import plain_forward

    return plain_forward(net, np.asarray(w)[None])[0]


def naive_dense(net, x, positions=None):
    """Dense output by applying the network at every window (or only at ``positions``)."""
    if x.ndim == 3:
        x = x[None]
    f = net.field_of_view
    out_shape = tuple(n - fv + 1 for n, fv in zip(x.shape[1:], f))
    if positions is None:
        positions = list(itertools.product(*(range(o) for o in out_shape)))
    vals = {}
    for p in positions:
        win = x[:, p[0] : p[0] + f[0], p[1] : p[1] + f[1], p[2] : p[2] + f[2]]
        vals[tuple(p)] = naive_window(net, win)
    return vals


def torch_dense(net, x):
    import torch
    import torch.nn.functional as F

    if x.ndim == 3:
        x = x[None]
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))[None]
    d = (1, 1, 1)
    with torch.no_grad():
        for layer in net.layers:
            if isinstance(layer, Conv):
                b = None if layer.bias is None else torch.from_numpy(layer.bias)
                t = F.conv3d(t, torch.from_numpy(layer.weight), b, dilation=d)
            elif isinstance(layer, Pool):
                t = F.max_pool3d(t, layer.window, stride=1, dilation=d)
                d = tuple(a * b for a, b in zip(d, layer.window))
            else:
                k, a = layer.kind, layer.alpha
                t = {
                    "relu": F.relu,
                    "sigmoid": torch.sigmoid,
                    "tanh": torch.tanh,
                    "identity": lambda v: v,
                    "softmax": lambda v: torch.softmax(v, dim=1),
                    "leaky_relu": lambda v: F.leaky_relu(v, a),
                    "elu": lambda v: F.elu(v, a),
                }[k](t)
    return t[0].numpy()


def max_rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
