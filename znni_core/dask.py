"""``infer_dask``: a network's dense output on a dask array, as a lazy dask array.

For a lab that holds its volume as a dask array (``dask.array.from_zarr``, a precomputed layer
read through cloud-volume, a notebook's array on a ``dask.distributed`` cluster or
``dask-jobqueue`` on SLURM)::

    import dask.array as da
    import znni_core
    from znni_core.dask import infer_dask

    net = znni_core.load_network("net.onnx")
    x = da.from_zarr("em.zarr", component="raw").astype("float32") / 255
    y = infer_dask(net, x, chunks=(64, 512, 512))      # lazy, (C_out, Z', Y', X')
    y.to_zarr("out.zarr", component="pred")            # or y.compute()

Each output block is computed from the input box its patches read (:func:`~.exec.tiling.window`:
the block plus the network's halo; for a valid U-Net widened down to the network's grid, for a
padded one the patches of the lattice over the *whole* output that touch the block, blended with
the whole volume's weights), so the result equals :func:`znni_core.infer` on the whole array: exactly
for chains and valid U-Nets, and for padded U-Nets when both run one plan (the default plan here
is the one ``infer`` makes for the whole input).  One plan is made on the client, for the largest
block, and shipped to the workers with the network (each once, under a key of its digest): no
worker calibrates or plans.

Blocks of the output are the units of work: make them large (10^7-10^8 voxels) so that the halo
read again around each is small; with threads, run one block per worker process and give the
plan the worker's cores (``threads=``).
"""

from __future__ import annotations

import functools
import itertools
import threading

import dask
import dask.array as da
import numpy as np
from dask.highlevelgraph import HighLevelGraph

from .errors import InputError, PlanError
from .exec.tiling import input_extent, warn_unused, window
from .geometry import Roi
from .inference import as_input, check_input, executor_for, thread_limits
from .io import open_input, parse_layer_url
from .net.protocol import AnyNetwork
from .plan import autotune

__all__ = ["block_shape", "infer_dask", "read_layer"]

#: each worker thread's resident kernel spectra (one plan's), kept across its blocks
_LOCAL = threading.local()


def read_layer(
    url: str, *, mip: int = 0, chunks=None, fill_missing: bool = False, endpoint: str | None = None
) -> da.Array:
    """A precomputed or zarr layer (``file://``, ``gs://``, ``s3://``, ``http(s)://``; OME-Zarr
    too) as a lazy ``(C, Z, Y, X)`` dask array over its bounds (index 0 is the bounds' offset),
    in blocks of ``chunks`` voxels (z, y, x; default the layer's chunks), read by znni's own
    readers: checksums verified where the layer carries them, a missing chunk a
    :class:`~znni_core.errors.DataError` naming it unless ``fill_missing``.  Workers open the
    layer themselves (from ``url``, once per process): nothing but the URL is shipped.

    >>> import tempfile, numpy as np
    >>> from znni_core.pipeline.demo import write_demo
    >>> d = tempfile.mkdtemp()
    >>> _ = write_demo(d, shape=(8, 32, 32), chunk=(4, 16, 16))
    >>> x = read_layer("file://" + d + "/em")
    >>> x.shape, x.dtype, x.chunks[1]
    ((1, 8, 32, 32), dtype('uint8'), (4, 4))
    """
    layer = _layer(url, int(mip), endpoint)
    bounds = layer.bounds
    block = tuple(layer.grid.chunk_shape) if chunks is None else tuple(int(c) for c in chunks)
    if len(block) != 3 or min(block) < 1:
        raise InputError(f"chunks={chunks!r}: give the block's voxels per axis (z, y, x), each >= 1")
    edges = [list(range(0, n, b)) + [n] for n, b in zip(bounds.shape, block)]
    name = "znni-read-" + dask.base.tokenize(url, mip, block, fill_missing, endpoint)
    layer_dict = {}
    for idx in itertools.product(*(range(len(e) - 1) for e in edges)):
        lo = tuple(int(o) + e[i] for o, e, i in zip(bounds.offset, edges, idx))
        hi = tuple(int(o) + e[i + 1] for o, e, i in zip(bounds.offset, edges, idx))
        layer_dict[(name, 0) + idx] = (_read_box, url, int(mip), endpoint, lo, hi, fill_missing)
    chunks_ = ((layer.channels,),) + tuple(tuple(np.diff(e)) for e in edges)
    return da.Array(
        HighLevelGraph.from_collections(name, layer_dict), name, chunks=chunks_, dtype=np.dtype(layer.dtype)
    )


@functools.lru_cache(maxsize=8)
def _layer(url: str, mip: int, endpoint):
    """The input layer at ``url`` (each process opens it once)."""
    return open_input(parse_layer_url(url, endpoint=endpoint, what="layer"), mip)


def _read_box(url, mip, endpoint, lo, hi, fill_missing) -> np.ndarray:
    """The layer's voxels in ``[lo, hi)`` (absolute coordinates), on a worker."""
    return _layer(url, mip, endpoint).read(Roi.from_bounds(lo, hi), fill_missing=fill_missing)[0]


def block_shape(net: AnyNetwork, chunks, out_shape) -> tuple:
    """The output block shape (z, y, x) for ``chunks`` (an int or a 3-tuple of voxels per axis):
    within the output, and for a valid U-Net a multiple of the network's grid (blocks then start
    on it and no patch is run past a block's edge for want of alignment)."""
    if isinstance(chunks, (int, np.integer)):
        chunks = (int(chunks),) * 3
    chunks = tuple(int(c) for c in chunks)
    if len(chunks) != 3 or min(chunks) < 1:
        raise InputError(f"chunks={chunks!r}: give the output block's voxels per axis (z, y, x), each >= 1")
    if net.kind == "valid":
        chunks = tuple(-(-c // g) * g for c, g in zip(chunks, net.grid))
    return tuple(min(c, n) for c, n in zip(chunks, out_shape))


def infer_dask(
    net: AnyNetwork,
    x,
    *,
    chunks=None,
    plan=None,
    memory_budget: int | None = None,
    threads: int | None = None,
) -> da.Array:
    """Lazy dense output of ``net`` on the dask array ``x`` (``(C, Z, Y, X)`` or ``(Z, Y, X)``,
    floating point; a numpy array is wrapped), blocks of ``chunks`` output voxels per axis (default:
    ``x``'s own chunks).  The output's shape is :func:`znni_core.infer`'s: ``(C_out, Z - Fz + 1,
    Y - Fy + 1, X - Fx + 1)`` (a valid network drops the trailing voxels its grid cannot use, with a
    warning naming them); a padded network's output has the input's shape.

    ``plan``: the plan every block runs (default: :func:`~znni_core.plan.autotune`'s for the
    largest block, or for a padded network the one ``infer`` makes for the whole input, so that
    both blend on the same lattice), under ``memory_budget`` bytes per block's patch and
    ``threads`` threads per block.

    >>> import numpy as np, dask.array as da
    >>> from znni_core.net import Network, Conv
    >>> net = Network((Conv(np.ones((1, 1, 2, 2, 2), np.float32)),))
    >>> y = infer_dask(net, da.ones((6, 6, 6), dtype=np.float32, chunks=3), chunks=3)
    >>> y.shape, y.chunks[1], float(y.sum().compute())
    ((1, 5, 5, 5), (3, 2), 1000.0)
    """
    if not isinstance(x, da.Array):
        if not isinstance(x, np.ndarray):
            raise InputError(f"input must be a dask or numpy array, got {type(x).__name__}")
        x = da.from_array(x, chunks=x.shape)
    shape = check_input(net, x.shape, x.dtype)
    x = x.reshape(shape).astype(np.float32)
    n = shape[1:]
    use = input_extent(net, n)
    if net.kind == "padded":
        out = whole_out = net.output_shape(n)
        if use != n:  # zeros up to an admissible input, as infer pads (its output is cropped back)
            x = da.pad(x, [(0, 0)] + [(0, u - m) for u, m in zip(use, n)])
    else:
        if use != n:
            warn_unused(net, n, use, stacklevel=2)
            x = x[(slice(None),) + tuple(slice(0, u) for u in use)]
        out, whole_out = net.output_shape(use), None
    block = block_shape(net, tuple(max(c) for c in x.chunks[1:]) if chunks is None else chunks, out)
    if plan is None:
        if net.kind == "padded":
            plan = autotune(net, memory_budget=memory_budget, threads=threads, effort="estimate", input_shape=n)
        else:
            extent = tuple(min(u, b + c) for u, b, c in zip(use, block, net.context))
            plan = autotune(
                net,
                memory_budget=memory_budget,
                threads=threads,
                effort="estimate",
                input_shape=net.ceil_admissible(extent) if net.kind == "valid" else extent,
            )
    elif plan.network_digest != net.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")
    if plan.device != "cpu":
        raise PlanError(f"infer_dask runs CPU plans; this plan is for {plan.device!r}")
    return _graph(net, plan, x, use, out, block, whole_out)


def _graph(net, plan, x: da.Array, use, out, block, whole_out) -> da.Array:
    """The output as one graph layer: per output block one task that reads the parts of the input
    chunks its window covers (no per-block slicing of ``x``'s graph: building that took about 17 ms
    a block, 3 minutes for 10^4 blocks).  The network and the plan are one key each."""
    if len(x.chunks[0]) > 1:
        x = x.rechunk({0: -1})
    token = dask.base.tokenize(x.name, net.digest(), plan.to_json(), block)
    name = f"znni-infer-{token}"
    net_key, plan_key = f"znni-network-{net.digest()[:16]}", f"znni-plan-{token}"
    layer = {net_key: net, plan_key: plan}
    bounds = [np.cumsum((0,) + tuple(c)) for c in x.chunks[1:]]
    edges = [list(range(0, o, b)) + [o] for o, b in zip(out, block)]
    for idx in np.ndindex(*(len(e) - 1 for e in edges)):
        lo = tuple(e[i] for e, i in zip(edges, idx))
        hi = tuple(e[i + 1] for e, i in zip(edges, idx))
        win = window(net, plan, lo, hi, whole_out=whole_out)
        # a chain input smaller than one patch reads past the input's end: edge values, as infer pads
        short = tuple(max(0, b - u) for b, u in zip(win.in_hi, use))
        box = [(a, b - s) for a, b, s in zip(win.in_lo, win.in_hi, short)]
        keys, where = [], []
        spans = [
            [(i, max(a, int(bd[i])), min(b, int(bd[i + 1]))) for i in range(len(bd) - 1) if bd[i] < b and bd[i + 1] > a]
            for (a, b), bd in zip(box, bounds)
        ]
        for parts in itertools.product(*spans):
            keys.append((x.name, 0) + tuple(i for i, _, _ in parts))
            src = tuple((p0 - int(bd[i]), p1 - int(bd[i])) for (i, p0, p1), bd in zip(parts, bounds))
            dst = tuple((p0 - a, p1 - a) for (_, p0, p1), (a, _) in zip(parts, box))
            where.append((src, dst))
        shape = (x.shape[0],) + tuple(b - a for a, b in box)
        layer[(name, 0) + idx] = (_block, net_key, plan_key, keys, where, shape, win, short)
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    chunks = ((net.out_channels,),) + tuple(tuple(np.diff(e)) for e in edges)
    return da.Array(graph, name, chunks=chunks, dtype=np.float32)


def _block(net, plan, parts: list, where: list, shape: tuple, win, short: tuple) -> np.ndarray:
    """One output block, on a worker: its input box put together from the input chunks' parts,
    then its patches run as :func:`znni_core.infer` runs them."""
    x = np.empty(shape, np.float32)
    for part, (src, dst) in zip(parts, where):
        x[(slice(None),) + tuple(slice(a, b) for a, b in dst)] = part[
            (slice(None),) + tuple(slice(a, b) for a, b in src)
        ]
    x = as_input(net, x)  # NaN and Inf refused, naming the z-slice of the block's input
    if any(short):
        x = np.pad(x, [(0, 0)] + [(0, s) for s in short], mode="edge")
    holder = getattr(_LOCAL, "holder", None)
    if holder is None:
        holder = _LOCAL.holder = {}
    with thread_limits(plan.threads):
        return executor_for(holder, plan, net).window(x, win)
