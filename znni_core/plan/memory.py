"""Predicted memory of running a plan: a symbolic walk of ``exec/patch.py``, for every network.

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
from ..net.chain import Conv
from ..net.graph import Graph
from ..net.ops import Act, Add, Affine, Concat, Convolution, Crop, Deconvolution, Mul, Pad, Pooling, Resize
from .pooling import MPF, DepthFirst, Slab
from .primitives import primitive as primitive_of
from .program import chain_after, fuses_next, in_place_input, readers_left
from .ranges import needed_ranges

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
    """One node of the memory walk: its shapes and the live bytes at its peak (the largest over
    its repeats: a depth-first pooling node's offsets, slab mode's slabs)."""

    index: int
    op: str
    in_shape: tuple  # (N, C, z, y, x)
    out_shape: tuple
    peak: int
    choice: tuple = ()  # a conv: (primitive, micro_batch, tile, resident bytes) as chosen
    spatial: tuple = ()  # a conv: the input extent it convolves (zero padding included)
    copy_bytes: int = 0  # a conv: its padded copy of the input (or of the part it reads)
    skipped: bool = False  # applied in the pass of the node before (no pass, no bytes of its own)


def walk(
    net: Graph, patch, choose, *, pooling=None, threads: int = 1, held: int = 0, tile=None, host: bool = True
) -> tuple[list[StepMemory], int]:
    """Simulate the executor (``exec/patch.py``) on one ``patch``: what is alive at each node.

    A tensor is alive from the node that writes it to its last reader; the caller's patch is
    alive throughout; each node adds its own output and workspace (a conv its primitive's peak,
    from ``layers``' memory formulas, and its padded copy of the input; an activation a conv
    applies in its output pass, or an affine and activation an add runs in its pass, nothing).

    ``choose(index, n, in_spatial, live) -> (primitive, micro_batch, tile[, resident])``: a conv
    node's choice on ``n`` fragments of ``in_spatial`` with ``live`` bytes alive before it (shapes
    only, independent of the choices); ``resident`` bytes (its kernel transforms) stay from there
    on.  ``pooling``: ``{node index: MPF() | DepthFirst() | Slab(rows)}`` (:mod:`.pooling`), the pooling nodes run in
    fragments (a chain's: then every node is a conv, an activation or a max-pool; the layers
    after a depth-first pooling node run once per offset, and in slab mode the first pooling
    node's predecessors once per offset and z-slab); other pooling subsamples.  ``held``: bytes
    alive throughout on top (resident kernel spectra chosen before, the result the tiler fills).
    ``tile``: exact output tiles (a graph's: the walk follows an interior tile, the largest).
    ``host``: an add or affine runs the affine and activation after it in its pass (the CPU's).
    Returns one record per node reached and the predicted peak in bytes.
    """
    return _Walk(net, patch, choose, pooling or {}, threads, held, tile, host).run()


class _Walk:
    """:func:`walk`'s state: the nodes, which tensors each needs, and the records kept."""

    def __init__(self, net, patch, choose, pooling, threads, held, tile, host):
        self.net, self.nodes, self.choose, self.pooling = net, net.nodes, choose, pooling
        self.threads, self.held = threads, int(held)
        self.patch = (net.in_channels,) + tuple(patch)
        self.records: dict[int, StepMemory] = {}
        consumers = net.consumers()
        self.consumers = consumers
        self.skip = (
            {j for i in range(len(self.nodes)) for j in chain_after(self.nodes, i, consumers)} if host else set()
        )
        if pooling:  # fragments: every tensor whole
            self.shapes = None
            self.need = None
        else:
            shapes = net.shapes(tuple(patch))
            out_n = shapes[net.output][1:]
            tile = tuple(min(t, o) for t, o in zip(tile or out_n, out_n))
            lo = tuple((o - t) // 2 for o, t in zip(out_n, tile))
            self.shapes = shapes
            self.need = needed_ranges(net, shapes, lo, tuple(a + t for a, t in zip(lo, tile)))

    def note(self, rec: StepMemory) -> None:
        r = self.records.get(rec.index)
        if r is None or rec.peak > r.peak:
            self.records[rec.index] = rec

    def run(self) -> tuple[list[StepMemory], int]:
        net, nodes = self.net, self.nodes
        patch_b = nbytes((1,) + self.patch)
        shape = {net.input: (1,) + self.patch}
        live = {net.input: patch_b}
        first = min(self.pooling, default=None)  # slab mode is the first pooling node's only
        if first is not None and isinstance(self.pooling[first], Slab):
            _, peak, y_bytes = self.slab(first, self.pooling[first].rows, patch_b)
        else:
            _, peak, y_bytes = self.nodes_from(0, len(nodes), shape, live, self.held, self.consumers.copy())
        if self.pooling:  # recombine: fragments -> dense copy
            dense = nbytes((net.out_channels,) + tuple(net.output_shape(self.patch[1:])))
            peak = max(peak, self.held + patch_b + y_bytes + dense)
        return [self.records[i] for i in sorted(self.records)], int(peak)

    def out_shape(self, node, src) -> tuple:
        """``(N, C, z, y, x)`` of ``node``'s output for an input of ``src``."""
        if self.need is not None:
            a, b = self.need[node.output]
            return (src[0], self.shapes[node.output][0]) + tuple(h - l for l, h in zip(a, b))
        return (src[0],) + node.op.fragment_shape(src[1:], node.name)

    def nodes_from(self, i, stop, shape, live, held, remaining):
        """Nodes ``[i, stop)`` with tensors of ``shape`` alive (``live``: bytes each owns) on top of
        ``held``: (the last tensor's shape, the peak, the bytes it owns)."""
        nodes = self.nodes
        resident = 0
        peak = held + sum(live.values())
        fused = False
        name = self.net.input
        while i < stop:
            node = nodes[i]
            if self.need is not None and node.output not in self.need:  # does not reach the output
                self.release(node, live, remaining)
                i += 1
                continue
            src = shape[node.inputs[0]]
            mode = self.pooling.get(i)
            if isinstance(mode, DepthFirst):  # depth first: every offset through the rest, results gathered
                x_total = held + sum(live.values()) + resident
                self.release(node, live, remaining, keep=node.inputs[0])
                shape_out, p, gather = self.depth_first(i, stop, src, x_total, remaining)
                return shape_out, max(peak, p), gather
            out = self.out_shape(node, src)
            if isinstance(mode, MPF):
                out = (src[0] * math.prod(node.op.window),) + out[1:]
            elif mode is not None:
                raise ValueError("slab mode is only for the first pooling node")
            out_b = nbytes(out)
            base = held + sum(live.values())
            rec = StepMemory(i, node.op.label, src, out, 0)
            if fused or i in self.skip:  # applied in the pass of the conv or element-wise node before
                extra, rec.skipped = 0, True
            else:
                extra = node_bytes(node.op, self, rec, node, base + resident, remaining)
                resident += rec.choice[3] if rec.choice else 0  # a conv's kernel transforms stay
            rec.peak = base + resident + extra
            self.note(rec)
            peak = max(peak, rec.peak)
            fused = bool(rec.choice) and fuses_next(self.nodes, i, rec.choice[0], self.consumers)
            self.release(node, live, remaining)
            shape[node.output], live[node.output] = out, out_b
            name = node.output
            i += 1
        name = self.net.output if stop == len(nodes) else name
        return shape[name], peak, live.get(name, 0)

    def depth_first(self, i, stop, src, x_total, remaining):
        """Pooling node ``i`` depth first on an input of ``src`` with ``x_total`` bytes alive (the
        input among them): the first offset through nodes ``(i, stop)`` before the gathered
        result exists, the others beside it; (the gathered shape, the peak, its bytes)."""
        node = self.nodes[i]
        out = self.out_shape(node, src)
        self.note(StepMemory(i, node.op.label, src, out, x_total + nbytes(out)))

        def rest(held):
            return self.nodes_from(i + 1, stop, {node.output: out}, {node.output: nbytes(out)}, held, dict(remaining))

        fshape, p0, y_bytes = rest(x_total)
        nfrag = math.prod(node.op.window)
        gather = nfrag * y_bytes
        peak = max(p0, x_total + y_bytes + gather)
        if nfrag > 1:
            peak = max(peak, rest(x_total + gather)[1])
        return (fshape[0] * nfrag,) + fshape[1:], peak, gather

    def conv(self, rec: StepMemory, node, live: int) -> int:
        """A conv node's choice (kept in ``rec``) with ``live`` bytes alive before it, and the bytes
        it adds: its padded copy of the input (or of the part it reads) and its primitive's peak."""
        spatial, copy = self.conv_input(node, rec.in_shape)
        prim, mb, tl, *kept = self.choose(rec.index, rec.in_shape[0], spatial, live)
        if copy and getattr(primitive_of(prim), "pads_input", False):  # zeros read in place: a copy of the part only
            n_in = self.shapes[node.inputs[0]][1:]
            raw_lo, raw_hi = node.op.window(*self.need[node.output])
            part = tuple(min(n, h) - max(0, l) for n, l, h in zip(n_in, raw_lo, raw_hi))
            copy_b = nbytes(rec.in_shape[:2] + part) if part != rec.in_shape[2:] else 0
        else:
            copy_b = nbytes(rec.in_shape[:2] + spatial) if copy else 0
        rec.choice, rec.spatial, rec.copy_bytes = (prim, mb, tl, kept[0] if kept else 0), spatial, copy_b
        return copy_b + conv_step_bytes(prim, rec.in_shape[0], mb, node.op.layer, spatial, tl, self.threads)

    def conv_input(self, node, src) -> tuple[tuple, bool]:
        """(the extent a conv node convolves, whether that is a padded copy of its input)."""
        if self.need is None:
            return tuple(src[2:]), False
        raw_lo, raw_hi = node.op.window(*self.need[node.output])
        spatial = tuple(b - a for a, b in zip(raw_lo, raw_hi))
        return spatial, spatial != tuple(src[2:]) or self.need[node.inputs[0]][0] != raw_lo

    def in_place(self, node, remaining):
        need = self.need if self.need is not None else _Whole()
        return in_place_input(node, remaining, need, self.net.input)

    def release(self, node, live, remaining, keep=None) -> None:
        """``node`` has read its inputs: each dies after its last reader (the caller's patch,
        and ``keep``, stay counted)."""
        for name in node.inputs:
            remaining[name] -= 1
        for name in set(node.inputs):
            if remaining[name] == 0 and name != self.net.input and name != keep:
                live.pop(name, None)

    def slab(self, k, rows, patch_b):
        """The first pooling node ``k`` in slab mode: per offset, nodes ``[0, k)`` run on z-slabs
        giving ``rows`` fragment rows each, pooled straight into one fragment."""
        net, nodes = self.net, self.nodes
        g = slab_geometry(net.layers, net.in_channels, k, self.patch[1:], rows)
        frag = (1, g["channels"]) + g["frag"]
        fb = nbytes(frag)
        slab = (1, self.patch[0], g["slab_in_z"]) + tuple(self.patch[2:])
        base = self.held + patch_b
        after = readers_left(net, nodes[: k + 1])

        def prefix(extra):
            pshape, pp, pbytes = self.nodes_from(
                0, k, {net.input: slab}, {net.input: 0}, base + extra + fb, self.consumers.copy()
            )
            pooled = nbytes((1, g["channels"], rows) + g["frag"][1:])
            p = max(pp, base + extra + fb + pbytes + pooled)
            self.note(StepMemory(k, "pool", pshape, frag, p))
            return p

        name = nodes[k].output
        nfrag = math.prod(nodes[k].op.window)
        p_pre0 = prefix(0)
        fshape, p0, y_bytes = self.nodes_from(k + 1, len(nodes), {name: frag}, {name: fb}, base, dict(after))
        gather = nfrag * y_bytes
        p_pre1 = prefix(gather)
        _, p1, _ = self.nodes_from(k + 1, len(nodes), {name: frag}, {name: fb}, base + gather, dict(after))
        peak = max(p_pre0, p0, base + y_bytes + gather, p_pre1, p1)
        return (fshape[0] * nfrag,) + fshape[1:], peak, gather


# ---- what each operator adds beside its inputs -------------------------------------------------


@functools.singledispatch
def node_bytes(op, walk: _Walk, rec: StepMemory, node, live: int, remaining: dict) -> int:
    """Bytes node ``node`` (operator ``op``, its record ``rec``) adds beside its inputs while it
    runs, with ``live`` bytes alive before it: its output (none where it overwrites an input
    that dies there) and its working arrays.  One function per operator class."""
    raise TypeError(f"{node.name}: the memory walk has no rule for {type(op).__name__}")


@node_bytes.register
def _(op: Convolution, walk, rec, node, live, remaining):
    return walk.conv(rec, node, live)  # the primitive chosen here, its copy of the input and its peak


@node_bytes.register
def _(op: Act, walk, rec, node, live, remaining):
    own = 0 if walk.in_place(node, remaining) else nbytes(rec.out_shape)
    return act_extra_bytes(op.act.kind, rec.out_shape) + own


@node_bytes.register
def _(op: Deconvolution, walk, rec, node, live, remaining):
    return 2 * nbytes(rec.out_shape)  # the output and the product before it is scattered


@node_bytes.register
def _(op: Resize, walk, rec, node, live, remaining):
    return nbytes(rec.out_shape) * (3 if op.linear else 1)  # linear: one temporary per axis pass


def _output(op, walk, rec, node, live, remaining):
    """The output, unless it overwrites an input that dies there."""
    return 0 if walk.in_place(node, remaining) else nbytes(rec.out_shape)


for _cls in (Pooling, Crop, Pad, Add, Mul, Affine, Concat):
    node_bytes.register(_cls, _output)


class _Whole(dict):
    """Every tensor's needed range is all of it (a network pooled into fragments)."""

    def __missing__(self, key):
        return None


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
