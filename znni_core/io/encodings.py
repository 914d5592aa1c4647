"""The encodings a layer's object may be stored with, as file-name suffixes (cloud-volume's ``file://``
convention): one table for the ``file://`` store (:mod:`.store`) and the ``http(s)://`` client
(:mod:`.http`), which looks for an object served as it lies on disk under the same suffixes.

>>> [ENCODINGS.get(s, "raw") for s in ALL_SUFFIXES]
['raw', 'gzip', 'br', 'zstd', 'xz', 'bz2']
"""

from __future__ import annotations

#: every suffix an object may be stored under, in probe order (``""``: stored raw)
ALL_SUFFIXES = ("", ".gz", ".br", ".zstd", ".xz", ".bz2")
#: file suffix -> encoding (a ``Content-Encoding`` name)
ENCODINGS = {".gz": "gzip", ".br": "br", ".zstd": "zstd", ".xz": "xz", ".bz2": "bz2"}
