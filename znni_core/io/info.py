"""Neuroglancer precomputed ``info`` files: build, validate, compare (axis order converted here).

The info file stores (x, y, z); everything returned from here is (z, y, x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import DataError
from ..geometry import ChunkGrid, Coordinate, Roi
from .paths import check_key
from .sharding import check_spec

DTYPES = ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "float32", "float64")
#: chunk encodings of Neuroglancer precomputed that znni reads (raw itself, the others through
#: cloud-volume's codecs); znni writes raw
READ_ENCODINGS = (
    "raw",
    "jpeg",
    "png",
    "compressed_segmentation",
    "compresso",
    "crackle",
    "fpzip",
    "kempressed",
    "zfpc",
    "jxl",
)


@dataclass(frozen=True)
class ScaleSpec:
    """One scale of an image layer, in (z, y, x) voxels and nanometres."""

    key: str
    bounds: Roi
    chunk_shape: Coordinate
    resolution: tuple  # (z, y, x) nm
    dtype: str
    channels: int
    encoding: str = "raw"
    sharding: dict | None = None  # neuroglancer_uint64_sharded_v1 spec (io/sharding.py), None: a file per chunk

    @property
    def grid(self) -> ChunkGrid:
        """The chunk grid of this scale: chunks of ``chunk_shape`` (z, y, x) over ``bounds``."""
        return ChunkGrid(self.bounds, self.chunk_shape)

    def to_scale(self) -> dict:
        """This scale as an entry of the info file's ``scales`` (axes in (x, y, z) order)."""
        scale = {
            "key": self.key,
            "size": list(self.bounds.shape.xyz()),
            "voxel_offset": list(self.bounds.offset.xyz()),
            "chunk_sizes": [list(self.chunk_shape.xyz())],
            "resolution": [float(v) for v in self.resolution[::-1]],
            "encoding": self.encoding,
        }
        if self.sharding:
            scale["sharding"] = dict(self.sharding)
        return scale

    def to_info(self) -> dict:
        """A whole image-layer info file with this scale as its only one."""
        return {
            "type": "image",
            "data_type": self.dtype,
            "num_channels": int(self.channels),
            "scales": [self.to_scale()],
        }


#: the largest magnitude of an info's integers (sizes, offsets, chunk sizes): exact in float64,
#: and far beyond any volume (2^53 voxels per axis)
MAX_INT = 2**53


def _integer(x) -> bool:
    """Whether ``x`` is an integer value of magnitude below :data:`MAX_INT` (NaN, Infinity, a
    fraction, a bool, a huge integer or a non-number are not)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    if isinstance(x, float) and not (math.isfinite(x) and x.is_integer()):
        return False
    return abs(x) < MAX_INT


def _ints(v, n, what, where):
    if not isinstance(v, (list, tuple)) or len(v) != n or not all(_integer(x) for x in v):
        raise DataError(f"{where}: {what} must be {n} integers (each below 2^53 in magnitude), got {_short(v)}")
    return [int(x) for x in v]


def _short(v) -> str:
    """``repr(v)`` for a message, at most 200 characters."""
    text = repr(v)
    return text if len(text) <= 200 else text[:197] + "..."


def _positive(x) -> bool:
    """Whether ``x`` is a finite positive number below 1e12 (a resolution in nm)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x)) and 0 < float(x) < 1e12
    except OverflowError:  # an integer beyond float's range
        return False


def validate_info(info, where: str) -> dict:
    """Structure and safety checks before anything reads or writes the layer (docs/reliability.md, T28c)."""
    if not isinstance(info, dict):
        raise DataError(f"{where}: info is not a JSON object")
    if info.get("type") not in ("image", "segmentation"):
        raise DataError(f"{where}: layer type {info.get('type')!r} is not an image layer")
    if info.get("data_type") not in DTYPES:
        raise DataError(f"{where}: data_type {info.get('data_type')!r} is not one of {DTYPES}")
    nc = info.get("num_channels")
    if not isinstance(nc, int) or isinstance(nc, bool) or nc < 1:
        raise DataError(f"{where}: num_channels must be a positive integer, got {nc!r}")
    scales = info.get("scales")
    if not isinstance(scales, list) or not scales:
        raise DataError(f"{where}: info has no scales")
    keys = set()
    for i, s in enumerate(scales):
        w = f"{where} scale {i}"
        if not isinstance(s, dict):
            raise DataError(f"{w}: not a JSON object")
        check_key(s.get("key"), f"{w} key")
        if s["key"] in keys:
            raise DataError(f"{w}: duplicate key {s['key']!r}")
        keys.add(s["key"])
        if any(v < 1 for v in _ints(s.get("size"), 3, "size", w)):
            raise DataError(f"{w}: size must be positive, got {s.get('size')}")
        _ints(s.get("voxel_offset", [0, 0, 0]), 3, "voxel_offset", w)
        cs = s.get("chunk_sizes")
        if not isinstance(cs, list) or not cs:
            raise DataError(f"{w}: chunk_sizes missing")
        if any(v < 1 for v in _ints(cs[0], 3, "chunk_sizes[0]", w)):
            raise DataError(f"{w}: chunk_sizes[0] must be positive, got {cs[0]}")
        res = s.get("resolution")
        if not isinstance(res, list) or len(res) != 3 or not all(_positive(r) for r in res):
            raise DataError(f"{w}: resolution must be 3 finite positive numbers (nm, below 1e12), got {_short(res)}")
        enc = s.get("encoding", "raw")
        if enc not in READ_ENCODINGS:
            raise DataError(f"{w}: encoding {enc!r} is not one znni reads ({', '.join(READ_ENCODINGS)})")
        if "sharding" in s and s["sharding"]:
            check_spec(s["sharding"], f"{w} sharding")
    return info


def scale_spec(info: dict, mip: int, where: str) -> ScaleSpec:
    """Scale ``mip`` of a validated info file, in (z, y, x); DataError if the layer has no such mip."""
    scales = info["scales"]
    if not isinstance(mip, int) or mip < 0 or mip >= len(scales):
        raise DataError(f"{where}: mip {mip!r} does not exist; the layer has mips 0..{len(scales) - 1}")
    s = scales[mip]
    size = Coordinate.from_xyz(s["size"])
    off = Coordinate.from_xyz(s.get("voxel_offset", [0, 0, 0]))
    return ScaleSpec(
        key=s["key"],
        bounds=Roi(off, size),
        chunk_shape=Coordinate.from_xyz(s["chunk_sizes"][0]),
        resolution=tuple(float(r) for r in s["resolution"][::-1]),
        dtype=info["data_type"],
        channels=int(info["num_channels"]),
        encoding=s.get("encoding", "raw"),
        sharding=s.get("sharding") or None,
    )


def compare_scale(existing: ScaleSpec, wanted: ScaleSpec) -> list[str]:
    """Differences that make an existing output layer unusable for this run (empty = compatible)."""
    diffs = []
    for name in ("key", "dtype", "channels", "encoding"):
        a, b = getattr(existing, name), getattr(wanted, name)
        if a != b:
            diffs.append(f"{name}: layer has {a!r}, config needs {b!r}")
    if existing.bounds != wanted.bounds:
        diffs.append(
            f"bounds (voxel_offset/size, z,y,x): layer has {existing.bounds!r}, config needs {wanted.bounds!r}"
        )
    if existing.chunk_shape != wanted.chunk_shape:
        diffs.append(
            f"chunk size (z,y,x): layer has {tuple(existing.chunk_shape)}, config needs {tuple(wanted.chunk_shape)}"
        )
    if (existing.sharding or None) != (wanted.sharding or None):
        diffs.append(f"sharding: layer has {existing.sharding!r}, config needs {wanted.sharding!r}")
    if not np.allclose(existing.resolution, wanted.resolution, rtol=1e-6):
        diffs.append(f"resolution (z,y,x nm): layer has {existing.resolution}, config needs {wanted.resolution}")
    return diffs
