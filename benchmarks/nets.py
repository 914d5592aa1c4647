"""The four networks of ZNNi's Table III, as :class:`znni_core.net.chain.Network` values.

Architectures from the authors' network files in ``seung-lab/ZNNi`` (``networks/337.znni``,
``357.znni``, ``276.znni``, ``296.znni``; the paper's ``nKPC`` names = kernel K, P pooling
layers, C conv layers, the repository's files are named ``PKC``):

* n337: 7 convs 3^3, a 2^3 max-pool after each of the first 3;  FoV 86,  D = 8
* n537: 7 convs 5^3, a 2^3 max-pool after each of the first 3;  FoV 164, D = 8
* n726: 6 convs 7^3, a 2^3 max-pool after each of the first 2;  FoV 118, D = 4
* n926: 6 convs 9^3, a 2^3 max-pool after each of the first 2;  FoV 156, D = 4

1 input channel, ``width`` hidden maps (80 in the paper, 24 by default here), 3 output maps,
ReLU after every conv except the last.  Weights are He-scaled (std sqrt(2 / fan_in)) and seeded,
biases small, so activations stay O(1) through the net.
"""

from __future__ import annotations

import math

import numpy as np

from znni_core.net import Activation, Conv, Network, Pool

# name -> (kernel edge, pooling layers, conv layers)
ARCH = {
    "n337": (3, 3, 7),
    "n537": (5, 3, 7),
    "n726": (7, 2, 6),
    "n926": (9, 2, 6),
}
NAMES = tuple(ARCH)


def make_network(name: str, width: int = 24, seed: int = 0, out_maps: int = 3) -> Network:
    if name not in ARCH:
        raise ValueError(f"unknown network {name!r}; choose from {NAMES}")
    k, n_pools, n_convs = ARCH[name]
    rng = np.random.default_rng([seed, k, n_pools, n_convs, width])
    layers, c = [], 1
    for i in range(n_convs):
        c_out = out_maps if i == n_convs - 1 else width
        fan_in = c * k**3
        w = (rng.standard_normal((c_out, c, k, k, k)) * math.sqrt(2.0 / fan_in)).astype(np.float32)
        b = (rng.standard_normal(c_out) * 0.05).astype(np.float32)
        layers.append(Conv(w, b, name=f"conv{i + 1}"))
        c = c_out
        if i < n_convs - 1:
            layers.append(Activation("relu", name=f"relu{i + 1}"))
        if i < n_pools:
            layers.append(Pool((2, 2, 2), name=f"pool{i + 1}"))
    return Network(
        tuple(layers),
        name=f"{name}-w{width}",
        metadata={"source": "ZNNi Table III (seung-lab/ZNNi networks/)", "width": width, "seed": seed},
    )


def direct_flops_per_voxel(net: Network) -> float:
    """Direct-convolution FLOPs (2 per multiply-add) per dense output voxel, borders ignored.

    Each conv layer contributes ``2 C_in C_out k^3``: what a dense (dilated or MPF) direct
    convolution does per output voxel on an unbounded volume.
    """
    return float(
        sum(2 * l.in_channels * l.out_channels * math.prod(l.kernel) for l in net.layers if isinstance(l, Conv))
    )


def make_boundary_network(seed: int = 0) -> Network:
    """The EM boundary-detector class (znn-release's N4 on ISBI 2012): 2D kernels in 3D.

    conv (1,4,4) 1->48, pool (1,2,2), conv (1,5,5) 48->48, pool, conv (1,4,4) 48->48, pool,
    conv (1,4,4) 48->48, pool, conv (1,3,3) 48->200, conv 1x1x1 200->1, sigmoid; ReLU after
    every hidden conv.  FoV (1, 95, 95), D = (1, 16, 16); 218,696 multiply-adds per output
    voxel.  Random He-scaled weights (the architecture, not the trained values, sets the speed).
    """
    rng = np.random.default_rng([seed, 4])
    spec = [
        ((1, 4, 4), 48, True),
        ((1, 5, 5), 48, True),
        ((1, 4, 4), 48, True),
        ((1, 4, 4), 48, True),
        ((1, 3, 3), 200, False),
        ((1, 1, 1), 1, False),
    ]
    layers, c = [], 1
    for i, (k, c_out, pool) in enumerate(spec):
        w = (rng.standard_normal((c_out, c) + k) * math.sqrt(2.0 / (c * math.prod(k)))).astype(np.float32)
        b = (rng.standard_normal(c_out) * 0.05).astype(np.float32)
        layers.append(Conv(w, b, name=f"conv{i + 1}"))
        layers.append(Activation("sigmoid" if i == len(spec) - 1 else "relu", name=f"act{i + 1}"))
        if pool:
            layers.append(Pool((1, 2, 2), name=f"pool{i + 1}"))
        c = c_out
    return Network(tuple(layers), name="boundary-n4", metadata={"source": "znn-release N4 class", "seed": seed})


def make_stack(kind: str, width: int = 48, depth: int = 4, seed: int = 0) -> Network:
    """Pool-free stacks for the convolution roof: ``kind`` = ``2d`` ((1,3,3) kernels),
    ``3d`` (3^3) or ``1x1`` (1x1x1); ``width`` maps, ReLU between, one input channel
    widened by the first layer."""
    k = {"2d": (1, 3, 3), "3d": (3, 3, 3), "1x1": (1, 1, 1)}[kind]
    rng = np.random.default_rng([seed, depth, width])
    layers, c = [], width
    for i in range(depth):
        w = (rng.standard_normal((width, c) + k) * math.sqrt(2.0 / (c * math.prod(k)))).astype(np.float32)
        layers.append(Conv(w, (rng.standard_normal(width) * 0.05).astype(np.float32), name=f"conv{i + 1}"))
        layers.append(Activation("relu", name=f"relu{i + 1}"))
    return Network(tuple(layers), name=f"stack-{kind}-w{width}", metadata={"seed": seed})
