"""Where znni keeps what it measures and compiles: ``$ZNNI_CACHE_DIR``, else ``~/.cache/znni``.

One directory for the calibration, the plan cache, FFTW's wisdom, the vector width chosen for
the host and (in the workflow, and for ``znni warmup``) numba's compiled kernels.  On a cluster
point it at a shared file system: every node then finds what one node measured and compiled
(entries are keyed by CPU model and versions, so mixed nodes keep their own).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "numba_cache_dir"]


def cache_dir(create: bool = True) -> Path:
    """``$ZNNI_CACHE_DIR``, else ``~/.cache/znni`` (made if missing)."""
    d = Path(os.environ.get("ZNNI_CACHE_DIR") or Path.home() / ".cache" / "znni")
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def numba_cache_dir() -> Path:
    """Where the workflow's jobs and ``znni warmup`` keep numba's compiled kernels:
    ``$NUMBA_CACHE_DIR``, else ``<cache_dir>/numba`` (``rules/common.smk`` gives jobs the same)."""
    return Path(os.environ.get("NUMBA_CACHE_DIR") or cache_dir(create=False) / "numba")
