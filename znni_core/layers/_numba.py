"""Numba set-up shared by the CPU kernels (import numba only through here).

docs/pitfalls.md: the default ``workqueue`` threading layer killed the process when
dask threads called a parallel kernel, so unless the user chose a layer we ask
for a thread-safe one (``omp`` or ``tbb``) before the first parallel launch.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path

import numba
from numba.core import caching

from ..cachedir import numba_cache_dir
from . import vector_width

# the environment's NUMBA_ settings first (numba may have been imported before this module), then
# the vector width on numba's config: numba keeps a value set there until a NUMBA_ variable
# changes, and fixes its target at the first compile
numba.config.reload_config()
#: where this process's vector width came from (``user``, ``env``, ``measured``, ``default`` or
#: ``llvm``: :mod:`.vector_width`)
VECTOR_WIDTH_SOURCE = vector_width.apply(numba.config)


def sources_digest(folder: Path | None = None) -> str:
    """A digest of the kernel modules' sources (``folder``'s ``*.py``, this package by default)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder or Path(__file__).parent).glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


#: numba's cache, one folder per version of the kernels' sources: numba checks a cached function
#: against its own file's time stamp only, so a change to a helper it inlines from another module
#: (an activation, a transform, a register tile) left the old machine code in use (seen here:
#: a Winograd layer ran the previous transform after ``transform_vectors.py`` changed); a
#: ``git pull`` or a second znni version on a shared cache would do the same.  Under
#: ``$NUMBA_CACHE_DIR``, else ``<cache_dir>/numba`` (where ``znni warmup`` compiles); numba
#: falls back to its own places where that folder cannot be written.
KERNELS_CACHE = numba_cache_dir() / f"znni-{sources_digest()}"
numba.config.CACHE_DIR = str(KERNELS_CACHE)

if os.environ.get("NUMBA_THREADING_LAYER") is None and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "threadsafe"

#: how long (busy-wait iterations) an idle OpenMP thread of numba's ``omp`` layer spins before it
#: sleeps: libgomp's default, 300,000, kept it on a core for milliseconds after every parallel
#: kernel, and the layer that ran next on znni's own pooled threads (Winograd, the 1x1x1 chain)
#: waited for that core: the input's NaN check before a 1x1x1 chain cost the chain 8 ms of its
#: 20 (a 24-map stack on 32 x 128^2).  libgomp reads it when numba first loads it (the first
#: parallel launch, after this import); a user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
GOMP_SPINCOUNT = "20000"
if os.environ.get("OMP_WAIT_POLICY") is None and os.environ.get("GOMP_SPINCOUNT") is None:
    os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT


def _lock_cache_saves() -> None:
    """Serialise numba's on-disk cache writes between processes (an exclusive ``flock`` per
    function's index).  numba reads a function's index, picks the first free data-file number and
    writes both back without a lock: two processes compiling one function at once (``znni
    warmup``'s parallel compile children, two jobs on a node with a cold shared cache) can give two
    keys the same number, and a later process then loads one signature's code for another's
    (seen: the width children's entries lost, every later job recompiling the Winograd kernels).
    Under the lock each save re-reads the index it extends."""
    save = caching.IndexDataCacheFile.save
    if getattr(save, "_znni_locked", False):
        return

    @functools.wraps(save)
    def locked(self, key, data):
        try:
            lock = open(self._index_path + ".lock", "a")  # noqa: SIM115 - closed below
        except OSError:  # a read-only cache: numba's own save fails alike, and says so
            return save(self, key, data)
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return save(self, key, data)

    locked._znni_locked = True
    caching.IndexDataCacheFile.save = locked


_lock_cache_saves()

njit = numba.njit
prange = numba.prange

#: ``fastmath=True`` less ``nsz`` (no signed zeros): the in-place activations and maxima store a
#: sum of two selects (``epilogue.act_row``, ``pool._max2``); with ``nsz`` LLVM folds the ``+ 0``
#: back into a select of the value it loaded, and compiles that for AVX2 to ``vmaskmovps``, a
#: microcoded store on AMD cores
FAST = {"nnan", "ninf", "arcp", "contract", "afn", "reassoc"}

__all__ = ["FAST", "KERNELS_CACHE", "njit", "numba", "prange", "sources_digest"]
