"""Predicted memory of running a chain's plan: a symbolic walk of ``exec/patch.py`` on a line
of layers pooled into fragments.

The walk mirrors the executor step by step: what is alive (the caller's patch, the
pre-pool tensors held by depth-first pooling, partial results) plus the chosen
primitive's own peak (its output and workspace, from ``layers``' memory formulas).
Shapes are ``(N, C, z, y, x)``; bytes are float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .. import layers as L
from ..geometry.blocks import conv_blocks
from ..net.chain import Activation, Conv, Pool
from ..net.graph import Graph
from .primitives import primitive as primitive_of

F32 = 4
MAX_PATCH_VOXELS = 512**3  # the largest patch the planner considers


def nbytes(shape) -> int:
    """Bytes of a float32 array of ``shape``."""
    return F32 * math.prod(shape)


def conv_primitive_bytes(primitive: str, n: int, layer: Conv, in_spatial, threads: int = 1) -> int:
    """Peak bytes one primitive call allocates (output + workspace, not its input)."""
    return primitive_of(primitive).call_bytes(n, layer, tuple(in_spatial), threads)


def conv_step_bytes(primitive: str, n: int, mb: int, layer: Conv, spatial, tile=(), threads: int = 1) -> int:
    """Peak bytes of a conv step over ``n`` fragments on top of its input: in micro-batches
    of ``mb`` (0 = all) and input blocks ``tile`` (overlap-save; () = whole), the output is
    allocated first and each call adds its own peak plus a contiguous copy of its block."""
    return _conv_step_bytes(primitive, n, mb, _Shape(layer), tuple(spatial), tuple(tile or ()), threads)


@dataclass(frozen=True)
class _Shape:
    """What the memory formulas read of a conv layer (hashable, holds no weights)."""

    in_channels: int
    out_channels: int
    kernel: tuple
    stride: tuple

    def __init__(self, layer):
        object.__setattr__(self, "in_channels", layer.in_channels)
        object.__setattr__(self, "out_channels", layer.out_channels)
        object.__setattr__(self, "kernel", tuple(layer.kernel))
        object.__setattr__(self, "stride", tuple(getattr(layer, "stride", (1, 1, 1))))


@functools.lru_cache(maxsize=1 << 16)  # the planner asks the same questions for every pool-mode candidate
def _conv_step_bytes(primitive, n, mb, layer, spatial, tile, threads) -> int:
    mb = mb or n
    tile, _ = conv_blocks(tuple(spatial), layer.kernel, tile)
    if mb >= n and tile == tuple(spatial):
        return conv_primitive_bytes(primitive, n, layer, spatial, threads)
    block = nbytes((mb, layer.in_channels) + tile) if tile != tuple(spatial) else 0
    out = nbytes((n, layer.out_channels) + tuple(s - k + 1 for s, k in zip(spatial, layer.kernel)))
    return out + block + conv_primitive_bytes(primitive, mb, layer, tile, threads)


def device_call_bytes(primitive: str, mb: int, layer: Conv, spatial, tile=(), threads: int = 1) -> int:
    """Device bytes of a conv streamed from host memory (GPU + host RAM, ``exec/stream.py``):
    while one call runs, the previous block's input and output (until their copy back is
    done) and the call's own input and peak (its output block and workspace)."""
    tile, _ = conv_blocks(tuple(spatial), layer.kernel, tile)
    block_in = nbytes((mb, layer.in_channels) + tuple(tile))
    block_out = nbytes((mb, layer.out_channels) + tuple(t - k + 1 for t, k in zip(tile, layer.kernel)))
    return 2 * block_in + block_out + conv_primitive_bytes(primitive, mb, layer, tile, threads)


def resident_bytes(primitive: str, layer: Conv, in_spatial) -> int:
    """Bytes a conv step keeps for the whole run: the kernel spectra of ``fft-data`` /
    ``fft-task`` / ``fft-gemm`` and Winograd's kernel transform (the executor builds them on
    first use and reuses them for every pooling offset, slab, micro-batch and patch)."""
    return primitive_of(primitive).resident_bytes(layer, tuple(in_spatial))


def act_extra_bytes(kind: str, shape) -> int:
    """Temporaries of an in-place activation."""
    return int(L.activation_memory(kind, shape))


@dataclass
class StepMemory:
    """One step of the memory walk: its shapes and the live bytes at its peak."""

    index: int
    op: str
    in_shape: tuple
    out_shape: tuple
    peak: int  # live bytes at this step's peak (max over repeats in depth-first pooling)


def out_spatial(layer, spatial):
    """The spatial shape (z, y, x) ``layer`` makes of ``spatial`` (a conv's valid output, a
    pooling layer's windows, an activation's input)."""
    if isinstance(layer, Conv):
        return tuple(n - k + 1 for n, k in zip(spatial, layer.kernel))
    if isinstance(layer, Pool):
        return tuple((n - p + 1) // p for n, p in zip(spatial, layer.window))
    return tuple(spatial)


def walk(
    net: Graph, patch_shape, pool_modes, conv_choice, threads: int = 1, resident: int = 0
) -> tuple[list[StepMemory], int]:
    """Simulate the executor on ``patch_shape``.

    ``resident``: bytes held for the whole run on top (the resident FFT kernel spectra of
    the plan's conv choices, :func:`resident_bytes`).

    ``pool_modes``: per pooling layer (network order) ``"mpf"`` or ``"pool"``;
    ``conv_choice(layer_index, n, c_in, in_spatial, live) -> (primitive, micro_batch[, tile])`` where
    ``live`` is what is alive before the call (independent of the choices: shapes only).
    Returns per-step records and the overall predicted peak in bytes.
    """
    layers = net.layers
    records: dict[int, StepMemory] = {}
    modes = iter(pool_modes)
    mode_of = {i: next(modes) for i, l in enumerate(layers) if isinstance(l, Pool)}
    patch = (1, net.in_channels) + tuple(patch_shape)

    def note(i, op, sin, sout, peak):
        r = records.get(i)
        if r is None or peak > r.peak:
            records[i] = StepMemory(i, op, sin, sout, peak)

    def sim(i, shape, held, x_bytes, stop=len(layers)):
        """Run layers [i, stop) with current x of ``shape``; ``held`` bytes alive outside;
        ``x_bytes`` = bytes of x owned here (0 if x is a view of someone else's array).
        Returns (final shape, peak, bytes owned by the result)."""
        peak = held + x_bytes
        while i < stop:
            layer = layers[i]
            n, c = shape[0], shape[1]
            if isinstance(layer, Conv):
                choice = conv_choice(i, n, c, shape[2:], held + x_bytes)
                prim, mb, tile = choice if len(choice) == 3 else (*choice, ())
                out = (n, layer.out_channels) + out_spatial(layer, shape[2:])
                p = held + x_bytes + conv_step_bytes(prim, n, mb, layer, shape[2:], tile, threads)
                note(i, "conv", shape, out, p)
                shape, x_bytes = out, nbytes(out)
            elif isinstance(layer, Activation):
                p = held + x_bytes + act_extra_bytes(layer.kind, shape)
                note(i, "act", shape, shape, p)
            elif mode_of[i] == "mpf":
                sp = out_spatial(layer, shape[2:])
                out = (n * math.prod(layer.window), c) + sp
                p = held + x_bytes + nbytes(out)
                note(i, "pool", shape, out, p)
                shape, x_bytes = out, nbytes(out)
            elif mode_of[i].startswith("slab"):
                raise ValueError("slab mode is only for the first pooling layer")
            else:  # depth-first: every offset through the rest, results gathered
                nfrag = math.prod(layer.window)
                frag = (n, c) + out_spatial(layer, shape[2:])
                note(i, "pool", shape, frag, held + x_bytes + nbytes(frag))
                # first offset: no gather buffer yet; the result then the buffer coexist
                fshape, p0, y_bytes = sim(i + 1, frag, held + x_bytes, nbytes(frag))
                gather = nfrag * y_bytes
                first = max(p0, held + x_bytes + y_bytes + gather)
                # later offsets run while the gather buffer is alive
                _, p1, _ = sim(i + 1, frag, held + x_bytes + gather, nbytes(frag))
                peak = max(peak, first, p1 if nfrag > 1 else 0)
                out = (fshape[0] * nfrag,) + fshape[1:]
                return out, peak, gather
            peak = max(peak, p)
            i += 1
        return shape, peak, x_bytes

    def sim_slab(k, rows, patch, base):
        """First pooling layer ``k`` in slab mode: per offset, layers [0, k) run on z-slabs
        giving ``rows`` fragment rows each, pooled straight into one fragment."""
        g = slab_geometry(layers, net.in_channels, k, patch[2:], rows)
        pool = layers[k]
        frag = (1, g["channels"]) + g["frag"]
        fb = nbytes(frag)
        slab = (1, patch[1], g["slab_in_z"]) + tuple(patch[3:])

        def prefix(extra):
            pshape, pp, pbytes = sim(0, slab, base + extra + fb, 0, stop=k)
            pooled = nbytes((1, g["channels"], rows) + g["frag"][1:])
            p = max(pp, base + extra + fb + pbytes + pooled)
            note(k, "pool", pshape, frag, p)
            return p

        nfrag = math.prod(pool.window)
        p_pre0 = prefix(0)
        fshape, p0, y_bytes = sim(k + 1, frag, base, fb)
        gather = nfrag * y_bytes
        p_pre1 = prefix(gather)
        _, p1, _ = sim(k + 1, frag, base + gather, fb)
        peak = max(p_pre0, p0, base + y_bytes + gather, p_pre1, p1)
        return (fshape[0] * nfrag,) + fshape[1:], peak, gather

    # held throughout: the input patch and the dense result array the tiler fills
    dense = nbytes((net.out_channels,) + tuple(net.output_shape(patch_shape)))
    base = nbytes(patch) + dense + int(resident)
    first_pool = next((i for i, l in enumerate(layers) if isinstance(l, Pool)), None)
    if first_pool is not None and mode_of[first_pool].startswith("slab"):
        final, peak, y_bytes = sim_slab(first_pool, int(mode_of[first_pool].split(":")[1]), patch, base)
    else:
        final, peak, y_bytes = sim(0, patch, base, 0)
    if net.pools:  # recombine: fragments -> dense copy
        peak = max(peak, base + y_bytes + dense)
    steps = [records[i] for i in sorted(records)]
    return steps, int(peak)


def slab_geometry(layers, in_channels: int, k: int, spatial, rows: int) -> dict:
    """Shapes of slab mode at the first pooling layer ``k`` (layers before it: conv/act only).

    ``extent``: receptive extent of layers [0, k) per axis; ``frag``: fragment shape;
    ``slab_in_z``: input rows of one slab giving ``rows`` fragment rows; ``n_slabs``.
    """
    extent = [1, 1, 1]
    channels = in_channels
    for layer in layers[:k]:
        if isinstance(layer, Conv):
            extent = [e + kk - 1 for e, kk in zip(extent, layer.kernel)]
            channels = layer.out_channels
    window = layers[k].window
    pre = [n - e + 1 for n, e in zip(spatial, extent)]
    frag = tuple((n - p + 1) // p for n, p in zip(pre, window))
    rows = max(1, min(rows, frag[0]))
    return {
        "extent": tuple(extent),
        "channels": channels,
        "frag": frag,
        "rows": rows,
        "slab_in_z": rows * window[0] + extent[0] - 1,
        "n_slabs": math.ceil(frag[0] / rows),
    }
