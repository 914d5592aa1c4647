"""OME-Zarr images (NGFF 0.4 and 0.5) as input layers: which array a mip is, and where it lies.

An OME-Zarr image is a zarr group whose attributes hold ``multiscales`` (0.4: ``.zattrs`` of a
zarr v2 group, ``{"multiscales": [{"version": "0.4", ...}]}``; 0.5: ``zarr.json`` of a zarr v3
group, ``{"attributes": {"ome": {"version": "0.5", "multiscales": [...]}}}``).  znni maps it onto
its own geometry (docs/inputs.md):

* ``mip`` k reads ``datasets[k]`` of the first multiscale (the default one), an array under the
  group at the dataset's ``path``;
* axes: optionally ``t`` (type time, size 1: index 0 is read), optionally ``c`` (type channel: the
  channels), then exactly three space axes named ``z``, ``y``, ``x`` in that order;
* voxel size and position from ``coordinateTransformations``: the dataset's ``scale`` (and
  ``translation``) composed with the multiscale's global ones, ``physical = global_scale *
  (scale * index + translation) + global_translation``; each space axis's ``unit`` converted to
  nanometres.  The voxel offset is ``translation / scale`` rounded to the nearest voxel (the
  half-voxel shifts of pixel-centred pyramids vanish; what is rounded away is kept as
  ``offset_remainder``).  An axis without a unit takes the config's ``resolution`` (z, y, x nm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import DataError
from .paths import LayerURL, check_key

VERSIONS = ("0.4", "0.5")

#: nanometres per unit: the UDUNITS-2 length units OME-Zarr allows, and common abbreviations
UNITS_NM = {
    "yoctometer": 1e-15,
    "zeptometer": 1e-12,
    "attometer": 1e-9,
    "femtometer": 1e-6,
    "picometer": 1e-3,
    "angstrom": 0.1,
    "nanometer": 1.0,
    "micrometer": 1e3,
    "millimeter": 1e6,
    "centimeter": 1e7,
    "decimeter": 1e8,
    "meter": 1e9,
    "hectometer": 1e11,
    "kilometer": 1e12,
    "megameter": 1e15,
    "gigameter": 1e18,
    "terameter": 1e21,
    "petameter": 1e24,
    "exameter": 1e27,
    "zettameter": 1e30,
    "yottameter": 1e33,
    "inch": 2.54e7,
    "foot": 3.048e8,
    "yard": 9.144e8,
    "mile": 1.609344e12,
    "parsec": 3.0856775814913673e25,
}
_ALIASES = {
    "nm": "nanometer",
    "um": "micrometer",
    "µm": "micrometer",
    "μm": "micrometer",
    "micron": "micrometer",
    "mm": "millimeter",
    "pm": "picometer",
    "å": "angstrom",
    "ångström": "angstrom",
    "m": "meter",
}


def unit_nm(unit: str, where: str) -> float:
    """Nanometres per ``unit`` (``micrometer`` -> 1000); a :class:`DataError` for a unit that is not a length.

    >>> unit_nm("micrometer", "x"), unit_nm("angstrom", "x"), unit_nm("nm", "x"), unit_nm("micrometres", "x")
    (1000.0, 0.1, 1.0, 1000.0)
    """
    u = str(unit).strip().lower()
    u = _ALIASES.get(u, u)
    u = u.replace("metre", "meter")  # British spelling first, so "micrometres" loses its plural too
    u = u[:-1] if u.endswith("s") and u[:-1] in UNITS_NM else u  # "micrometers"
    if u not in UNITS_NM:
        raise DataError(f"{where}: unit {unit!r} is not a length unit znni knows ({', '.join(UNITS_NM)})")
    return float(UNITS_NM[u])


@dataclass(frozen=True)
class OmeDataset:
    """One scale of an OME-Zarr image as znni reads it."""

    url: LayerURL  # the dataset's array
    axes: str  # the array's axes: zyx, czyx, tzyx or tczyx
    resolution: tuple | None  # (z, y, x) nm, None where an axis has no unit (the config's resolution then)
    offset: tuple  # (z, y, x) voxels
    offset_remainder: tuple  # what rounding the translation to whole voxels left out, in voxels
    version: str
    num_datasets: int


def ome_attributes(attrs: dict, zarr_format: int) -> tuple[str, dict] | None:
    """``(version, the multiscale read)`` of a group's attributes, or None when it has no
    ``multiscales``; a :class:`DataError` for a version znni does not read."""
    if not isinstance(attrs, dict):
        return None
    ome = attrs.get("ome")
    if isinstance(ome, dict) and "multiscales" in ome:
        version, ms = str(ome.get("version", "")), ome["multiscales"]
    elif "multiscales" in attrs:
        ms = attrs["multiscales"]
        first = ms[0] if isinstance(ms, list) and ms and isinstance(ms[0], dict) else {}
        version = str(first.get("version", ""))
    else:
        return None
    return version, ms


def ome_dataset(url: LayerURL, attrs: dict, zarr_format: int, mip: int, what: str = "input") -> OmeDataset:
    """Dataset ``mip`` of the OME-Zarr image whose group (at ``url``) has ``attrs``; a
    :class:`DataError` naming what is missing or unsupported."""
    where = f"{what} {url}"
    found = ome_attributes(attrs, zarr_format)
    if found is None:
        raise DataError(
            f"{where} is a zarr group without OME-Zarr 'multiscales' metadata; point the path at an array "
            "inside it, or at an OME-Zarr image"
        )
    version, ms = found
    if not version and zarr_format == 2:
        version = "0.4"  # 0.4 requires it, but some writers leave it out; the structure is checked below
    if version not in VERSIONS:
        raise DataError(
            f"{where}: OME-Zarr version {version or '(none given)'!r} is not supported; znni reads OME-Zarr "
            f"{' and '.join(VERSIONS)} (convert the image, e.g. with ome2024-ngff-challenge or ngff-zarr)"
        )
    want = 2 if version == "0.4" else 3
    if zarr_format != want:
        raise DataError(f"{where}: OME-Zarr {version} is stored as zarr v{want}, but this group is zarr v{zarr_format}")
    if not isinstance(ms, list) or not ms or not isinstance(ms[0], dict):
        raise DataError(f"{where}: 'multiscales' must be a non-empty list of objects")
    m = ms[0]  # the first multiscale is the default one
    axes = _axes(m.get("axes"), where)
    datasets = m.get("datasets")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise DataError(f"{where}: multiscales[0].datasets must be a non-empty list of objects")
    if isinstance(mip, bool) or not isinstance(mip, int) or not 0 <= mip < len(datasets):
        paths = [d.get("path") for d in datasets]
        raise DataError(
            f"{where}: mip {mip!r} does not exist; the OME-Zarr image has datasets 0..{len(datasets) - 1} "
            f"(paths {paths}): set {what}.mip to one of them"
        )
    ds = datasets[mip]
    path = check_key(ds.get("path"), f"{where} datasets[{mip}].path")
    n = len(axes)
    scale, trans = _transforms(ds.get("coordinateTransformations"), n, f"{where} datasets[{mip}]", required=True)
    gscale, gtrans = _transforms(m.get("coordinateTransformations"), n, f"{where} multiscales[0]", required=False)
    s = [gs * v for gs, v in zip(gscale, scale)]
    t = [gs * v + gt for gs, v, gt in zip(gscale, trans, gtrans)]
    space = range(n - 3, n)
    if any(s[k] <= 0 for k in space):
        raise DataError(f"{where} datasets[{mip}]: the space axes' scale {[s[k] for k in space]} must be positive")
    exact = [t[k] / s[k] for k in space]
    offset = tuple(int(math.floor(v + 0.5)) for v in exact)
    remainder = tuple(round(v - o, 9) for v, o in zip(exact, offset))
    units = [axes[k].get("unit") for k in space]
    resolution = None
    if all(units):
        # 12 significant digits: 0.004 um is 4 nm, not 4.000000000000001
        nm = [s[k] * unit_nm(u, f"{where} axis {axes[k]['name']!r}") for k, u in zip(space, units)]
        resolution = tuple(float(f"{v:.12g}") for v in nm)
        if not all(0 < r < 1e12 for r in resolution):
            raise DataError(f"{where} datasets[{mip}]: voxel size {resolution} nm is out of range")
    kinds = "".join({"time": "t", "channel": "c"}[_kind(a)] for a in axes[: n - 3]) + "zyx"
    child = url.child(path)
    return OmeDataset(child, kinds, resolution, offset, remainder, version, len(datasets))


def _kind(axis: dict) -> str:
    t = axis.get("type")
    if t:
        return str(t)
    name = str(axis.get("name", "")).lower()
    return {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}.get(name, "")


def _axes(axes, where: str) -> list[dict]:
    """The multiscale's axes, checked: ``[t] [c] z y x``."""
    if not isinstance(axes, list) or not all(isinstance(a, dict) and a.get("name") for a in axes):
        raise DataError(f"{where}: multiscales[0].axes must be a list of objects with a name (OME-Zarr 0.4/0.5)")
    names = [str(a["name"]) for a in axes]
    kinds = [_kind(a) for a in axes]
    lead = kinds[:-3]
    ok = len(axes) >= 3 and kinds[-3:] == ["space"] * 3 and [n.lower() for n in names[-3:]] == ["z", "y", "x"]
    ok = ok and lead in ([], ["time"], ["channel"], ["time", "channel"])
    if not ok:
        raise DataError(
            f"{where}: axes {names} (types {kinds}) are not ones znni reads: a 3-d image whose space axes are "
            "z, y, x in that order, optionally after a time axis t (of size 1) and a channel axis c"
        )
    return axes


def _transforms(cts, n: int, where: str, *, required: bool) -> tuple[list, list]:
    """``(scale, translation)`` of a ``coordinateTransformations`` list (a scale, then optionally a translation)."""
    if cts is None and not required:
        return [1.0] * n, [0.0] * n
    if not isinstance(cts, list) or not cts or not all(isinstance(c, dict) for c in cts):
        raise DataError(f"{where}: coordinateTransformations must be a list beginning with a scale")
    types = [c.get("type") for c in cts]
    if types not in (["scale"], ["scale", "translation"]):
        raise DataError(
            f"{where}: coordinateTransformations {types} are not supported; OME-Zarr 0.4/0.5 allow a scale, "
            "optionally followed by a translation"
        )
    out = []
    for c in cts:
        key = c["type"]
        if "path" in c and key not in c:
            raise DataError(f"{where}: a {key} stored in a file ({c['path']!r}) is not supported; inline it")
        v = c.get(key)
        if not isinstance(v, list) or len(v) != n or not all(_number(x) for x in v):
            raise DataError(f"{where}: {key} {v!r} must be {n} finite numbers, one per axis")
        out.append([float(x) for x in v])
    return out[0], out[1] if len(out) > 1 else [0.0] * n


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
