"""Which format a layer URL names, in one place: open an input, create or open an output.

A URL ending in ``.zarr`` (or ``zarr://``) is a zarr array or an OME-Zarr image for inputs
(:mod:`.zarr_layer`, :mod:`.ome`), a zarr v3 array for outputs (:mod:`.zarr_output`); any other is a
Neuroglancer precomputed layer (:mod:`.precomputed`).  Inputs may be on ``file://``, ``s3://``,
``gs://`` or ``http(s)://``; outputs on the first three (an http(s) layer is read-only).  Everything
above :mod:`znni_core.io` opens layers through these functions.
"""

from __future__ import annotations

from ..errors import DataError
from .info import ScaleSpec, compare_scale
from .paths import LayerURL, read_only_error
from .precomputed import PrecomputedLayer, create_precomputed, open_precomputed_output, precomputed_differences
from .zarr_layer import open_zarr_input
from .zarr_output import ZarrOutput, create_zarr_output, stored_spec


def open_input(
    url: LayerURL, mip: int = 0, *, resolution=None, voxel_offset=None, checksums: str = "auto", what: str = "input"
):
    """An input layer (precomputed, zarr or OME-Zarr) with ``bounds``, ``resolution``, ``dtype``,
    ``channels``, ``read``; ``what`` (``input``, ``mask``) is how messages name it.

    ``checksums`` (``auto``, ``required``, ``none``): verify every read where the layer carries
    checksums (``io/checksums.py``); ``layer.checksums`` says which (``sha256``, ``crc32c``, ``none``)."""
    layer = _open_input(url, mip, resolution, voxel_offset, what)
    layer.use_checksums(checksums)
    return layer


def _open_input(url: LayerURL, mip, resolution, voxel_offset, what):
    if url.format == "zarr":
        return open_zarr_input(url, mip, resolution=resolution, voxel_offset=voxel_offset, what=what)
    return PrecomputedLayer(url, mip)


def check_writable(url: LayerURL, what: str = "output") -> None:
    """A :class:`ConfigError` for a layer znni cannot write (``http(s)://``: read-only)."""
    if not url.writable:
        raise read_only_error(what, url)


def layer_differences(url: LayerURL, specs: list[ScaleSpec]) -> list[str] | None:
    """What keeps the layer at ``url`` from holding the scales ``specs`` (mip by mip; ``[]``:
    compatible, and a layer of fewer mips may gain the others); None: there is no layer."""
    if url.format != "zarr":
        return precomputed_differences(url, specs)
    have = [stored_spec(url, s.key) for s in specs]
    if all(h is None for h in have):
        return None
    return [f"mip {k}: {d}" for k, (h, s) in enumerate(zip(have, specs)) if h is not None for d in compare_scale(h, s)]


def create_layer(url: LayerURL, specs, provenance: dict) -> str:
    """Write the layer's metadata (every scale of ``specs``: mip 0, then a pyramid's mips) and
    ``provenance`` once; return ``created`` or ``exists``.

    An existing layer must match each spec it has: otherwise :class:`DataError` listing each
    difference; a layer of fewer scales gains the others.
    """
    specs = [specs] if isinstance(specs, ScaleSpec) else list(specs)
    check_writable(url)
    diffs = layer_differences(url, specs)
    if diffs:
        raise DataError(
            f"output layer {url} exists and does not match the config:\n  - "
            + "\n  - ".join(diffs)
            + "\nChoose a new output path, or delete the layer if it is yours to replace."
        )
    if url.format == "zarr":
        return create_zarr_output(url, specs, provenance)
    return create_precomputed(url, specs, provenance)


def open_output(url: LayerURL, spec: ScaleSpec, mip: int = 0):
    """Open mip ``mip`` of an output layer that must already exist and match ``spec`` (a worker's
    check); a zarr output's array is a :class:`~znni_core.io.zarr_output.ZarrOutput`."""
    check_writable(url)
    if url.format == "zarr":
        return ZarrOutput(url, spec)
    return open_precomputed_output(url, spec, mip)
