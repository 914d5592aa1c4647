"""Storage: precomputed (cloud-volume) and zarr layers, atomic writes, manifests.

The only place where cloud-volume's (x, y, z) order appears; imports :mod:`znni_core.geometry` only
(plus :mod:`znni_core.errors`).
"""

from .atomic import atomic_write, clean_stale_temporaries
from .info import ScaleSpec, compare_scale, validate_info
from .layers import create_layer, layer_differences, open_input, open_output
from .manifest import read_manifest, store_chunks, write_manifest
from .paths import LayerURL, check_key, parse_layer_url
from .precomputed import PrecomputedLayer
from .store import COMPRESSIONS, object_store, read_json, write_json
from .zarr_layer import ZarrLayer

__all__ = [
    "COMPRESSIONS",
    "LayerURL",
    "PrecomputedLayer",
    "ScaleSpec",
    "ZarrLayer",
    "atomic_write",
    "check_key",
    "clean_stale_temporaries",
    "compare_scale",
    "create_layer",
    "layer_differences",
    "object_store",
    "open_input",
    "open_output",
    "parse_layer_url",
    "read_json",
    "read_manifest",
    "store_chunks",
    "validate_info",
    "write_json",
    "write_manifest",
]
