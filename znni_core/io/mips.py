"""The scales of an output layer's pyramid: mip 0 (the run's) and mips 1..N, each ``factor``
coarser than the one below.

::

    mip k-1   |o . . . . . . . . . . . .|        bounds begin on a multiple of factor
    mip k     |o   .   .   .   .   .   .|        begin / factor, end rounded up

Mip k starts at mip k-1's start divided by the factor, so each of its voxels averages exactly
the ``factor`` block below it (the last block of an axis may be partial).  A start that is not a
multiple of the factor is refused when the run is planned: the pyramid would average the wrong
voxels (``output.align`` puts mip 0 on the chunk grid of absolute coordinates).  Every mip keeps
mip 0's chunk size and kind of storage: a sharded precomputed layer gets a shard spec per mip
(about ``shard_bytes`` a shard), a zarr output one sharded array per mip (arrays ``0``, ``1``, ...)
with mip 0's chunks per shard; a task of a mip writes one shard (or ``task_chunks`` chunks).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from ..geometry import Coordinate, Roi
from .info import ScaleSpec
from .sharding import auto_sharding, check_sharding, shard_chunks
from .zarr_output import ZARR_SHARDING

__all__ = ["mip_specs", "layer_info", "task_chunks_of"]


def _is_zarr(spec: ScaleSpec) -> bool:
    return bool(spec.sharding) and spec.sharding.get("@type") == ZARR_SHARDING


def mip_specs(spec0: ScaleSpec, mips: int, factor, *, shard_bytes: int) -> list[ScaleSpec]:
    """``[spec0, mip 1, ..., mip mips]``; :class:`ConfigError` if a mip would not start on its factor.

    >>> s0 = ScaleSpec("8_8_40", Roi((0, 0, 0), (12, 70, 70)), Coordinate(4, 16, 16), (40., 8., 8.), "float32", 1)
    >>> [(s.key, tuple(s.bounds.shape)) for s in mip_specs(s0, 2, (1, 2, 2), shard_bytes=2**30)]
    [('8_8_40', (12, 70, 70)), ('16_16_40', (12, 35, 35)), ('32_32_40', (12, 18, 18))]
    """
    f = Coordinate(factor)
    if any(v < 1 for v in f):
        raise ConfigError(f"downsample.factor {tuple(f)}: every factor must be >= 1")
    specs = [spec0]
    for k in range(1, int(mips) + 1):
        below = specs[-1]
        b = below.bounds
        if any(o % v for o, v in zip(b.offset, f)):
            raise ConfigError(
                f"downsample: mip {k - 1} starts at {tuple(b.offset)} (z, y, x), not a multiple of the factor {tuple(f)}, "
                f"so mip {k} would average the wrong voxels. Set output.align: true with an output.chunk_size that "
                f"factor^{int(mips)} divides, or ask for fewer mips"
            )
        bounds = Roi.from_bounds(b.begin // f, b.end.ceil_div(f))
        res = tuple(float(r) * v for r, v in zip(below.resolution, f))
        grid_shape = bounds.shape.ceil_div(spec0.chunk_shape)
        if _is_zarr(spec0):
            key, sharding = str(k), dict(spec0.sharding)
        else:
            key = "_".join(f"{v:g}" for v in res[::-1])
            sharding = None
            if spec0.sharding:
                sharding = check_sharding(
                    auto_sharding(
                        bounds.shape,
                        spec0.chunk_shape,
                        spec0.dtype,
                        spec0.channels,
                        shard_bytes,
                        spec0.sharding.get("data_encoding", "raw"),
                    ),
                    f"the shard spec of mip {k}",
                    grid_shape,
                )
        if key in {s.key for s in specs}:
            raise ConfigError(
                f"downsample: mip {k}'s scale key {key!r} is already mip 0's (output.scale_key); "
                "choose another output.scale_key"
            )
        specs.append(replace(spec0, key=key, bounds=bounds, resolution=res, sharding=sharding))
    return specs


def layer_info(specs: list[ScaleSpec]) -> dict:
    """The precomputed ``info`` of a layer whose scales are ``specs`` (mip 0 first)."""
    info = specs[0].to_info()
    info["scales"] = [s.to_scale() for s in specs]
    return info


def task_chunks_of(spec: ScaleSpec, default) -> Coordinate:
    """A task's box in chunks on the scale ``spec``: one shard, or ``default`` (unsharded)."""
    sh = spec.sharding
    if not sh:
        return Coordinate(default)
    if _is_zarr(spec):
        return Coordinate(sh["chunks_per_shard"])
    return shard_chunks(sh, spec.grid.grid_shape)
