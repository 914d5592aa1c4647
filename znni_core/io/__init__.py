"""Storage: precomputed (cloud-volume) and zarr layers, atomic writes, manifests.

The only place where cloud-volume's (x, y, z) order appears; imports :mod:`znni_core.geometry` only
(plus :mod:`znni_core.errors`).
"""
from .atomic import atomic_write, clean_stale_temporaries
from .info import ScaleSpec, compare_scale, validate_info
from .manifest import read_manifest, store_chunks, write_manifest
from .paths import LayerURL, check_key, parse_layer_url
from .precomputed import COMPRESSIONS, PrecomputedLayer, create_layer, open_output, read_json, write_json
from .zarr_layer import ZarrLayer


def open_input(url: LayerURL, mip: int = 0, *, resolution=None, voxel_offset=None):
    """An input layer (precomputed or zarr) with ``bounds``, ``resolution``, ``dtype``, ``channels``, ``read``."""
    if url.format == "zarr":
        from ..errors import ConfigError

        if mip:
            raise ConfigError(f"input {url}: zarr inputs have no mips; set input.mip: 0")
        if not url.is_local:
            raise ConfigError(f"input {url}: zarr inputs (and masks) are read from file:// only (zarr outputs may "
                              "be on s3:// or gs://); copy the array locally or convert it to precomputed")
        return ZarrLayer(url, resolution=resolution, voxel_offset=voxel_offset)
    return PrecomputedLayer(url, mip)


__all__ = ["COMPRESSIONS", "LayerURL", "PrecomputedLayer", "ScaleSpec", "ZarrLayer", "atomic_write", "check_key",
           "clean_stale_temporaries", "compare_scale", "create_layer", "open_input", "open_output",
           "parse_layer_url", "read_json", "read_manifest", "store_chunks", "validate_info", "write_json",
           "write_manifest"]
