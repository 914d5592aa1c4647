"""Small random networks for the engine tests (seeded, He-scaled weights)."""

from __future__ import annotations

import numpy as np

from znni_core.net import Activation, Conv, Network, Pool


def make_net(layout, c_in=1, seed=0, bias=True):
    """``layout``: list of ("conv", c_out, kernel) | ("pool", window) | ("act", kind[, alpha])."""
    rng = np.random.default_rng(seed)
    layers, c = [], c_in
    for item in layout:
        if item[0] == "conv":
            _, c_out, k = item
            k = (k,) * 3 if isinstance(k, int) else tuple(k)
            fan_in = c * int(np.prod(k))
            w = (rng.standard_normal((c_out, c) + k) * np.sqrt(2.0 / fan_in)).astype(np.float32)
            b = (rng.standard_normal(c_out) * 0.1).astype(np.float32) if bias else None
            layers.append(Conv(w, b))
            c = c_out
        elif item[0] == "pool":
            w = item[1]
            layers.append(Pool((w,) * 3 if isinstance(w, int) else tuple(w)))
        else:
            layers.append(Activation(item[1], item[2] if len(item) > 2 else 0.0))
    return Network(tuple(layers))


NETS = {
    "iso2pool": [
        ("conv", 3, 3),
        ("act", "relu"),
        ("pool", 2),
        ("conv", 4, 3),
        ("act", "elu", 0.7),
        ("pool", 2),
        ("conv", 2, 2),
        ("act", "sigmoid"),
    ],
    "aniso": [
        ("conv", 3, (1, 3, 3)),
        ("act", "leaky_relu", 0.1),
        ("pool", (1, 2, 2)),
        ("conv", 4, (2, 3, 2)),
        ("act", "tanh"),
        ("pool", (1, 3, 2)),
        ("conv", 3, (1, 2, 2)),
        ("act", "softmax"),
    ],
    "nopool": [("conv", 4, 3), ("act", "elu", 1.0), ("conv", 2, (2, 1, 3))],
    "deep": [
        ("conv", 2, 2),
        ("act", "relu"),
        ("pool", 2),
        ("conv", 3, 2),
        ("act", "relu"),
        ("pool", (2, 1, 2)),
        ("conv", 3, 2),
        ("act", "relu"),
        ("pool", (1, 2, 1)),
        ("conv", 2, 1),
    ],
}
