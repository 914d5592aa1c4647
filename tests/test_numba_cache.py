"""numba's on-disk cache written by several processes at once (``layers/_numba.py``): ``znni
warmup``'s compile children, jobs on a node with a cold shared cache.  Every entry written
survives, and each signature loads its own code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULE = textwrap.dedent("""
    import znni_core.layers._numba  # noqa: F401 - installs the lock on cache writes
    from numba import njit

    @njit(cache=True)
    def twice(x):
        return x + x
""")

WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from numba.core import caching
    import racy

    read = caching.IndexDataCacheFile._load_index

    def slow_read(self):  # widens the window between reading the index and writing it back
        got = read(self)
        time.sleep(0.5)
        return got

    caching.IndexDataCacheFile._load_index = slow_read
    dtype = np.dtype(sys.argv[1])
    while time.time() < float(sys.argv[2]):  # start together
        pass
    assert racy.twice(dtype.type(2)) == 4
    assert sum(racy.twice.stats.cache_misses.values()) == 1
""")

READER = textwrap.dedent("""
    import sys
    import numba
    import numpy as np
    import racy
    VALUES = {"int64": 3, "float32": 1.25, "float64": 1.125, "complex64": 1.25 + 1j, "complex128": 0.5 - 2j}
    for name in sys.argv[1:]:
        x = np.dtype(name).type(VALUES[name])
        got = racy.twice(x)
        assert got == 2 * VALUES[name] and type(got) is type(x.item()), (name, got)
        assert any(s.args[0] == numba.typeof(x) for s in racy.twice.nopython_signatures), name
    assert sum(racy.twice.stats.cache_misses.values()) == 0, racy.twice.stats
    assert sum(racy.twice.stats.cache_hits.values()) == len(sys.argv) - 1
""")

DTYPES = ("int64", "float32", "float64", "complex64", "complex128")


def test_processes_saving_one_function_at_once_keep_every_signature(tmp_path):
    """Five processes compile five signatures of one function into one cache at the same moment;
    a new process then finds all six cached, each with its own code (unlocked, numba gave two
    keys one data file: entries lost, or one signature's code loaded for another)."""
    import time

    (tmp_path / "racy.py").write_text(MODULE)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    start = str(time.time() + 8)  # past every interpreter's start-up
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, d, start], env=env, stderr=subprocess.PIPE, text=True)
        for d in DTYPES
    ]
    for p in writers:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    r = subprocess.run([sys.executable, "-c", READER, *DTYPES], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_kernels_cache_folder_follows_every_kernel_source(tmp_path):
    """numba checks a cached function against its own file only: a helper changed in another
    module (an inlined activation, a transform intrinsic) must move every kernel to a new folder."""
    import shutil

    import numba

    from znni_core.layers import _numba

    assert numba.config.CACHE_DIR == str(_numba.KERNELS_CACHE)
    assert _numba.KERNELS_CACHE.name == f"znni-{_numba.sources_digest()}"
    copy = tmp_path / "layers"
    shutil.copytree(ROOT / "znni_core" / "layers", copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = _numba.sources_digest(copy)
    assert before == _numba.sources_digest()
    helper = copy / "transform_vectors.py"
    helper.write_text(helper.read_text() + "\n# changed\n")
    assert _numba.sources_digest(copy) != before
