"""Test-wide settings: isolated caches, numba threading layer, the gpu/slurm markers."""
from __future__ import annotations

import os
import shutil
import tempfile

# before anything imports numba (PITFALLS: the default workqueue layer crashes under threads)
os.environ.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
_CACHE = tempfile.mkdtemp(prefix="znni-test-cache-")
os.environ.setdefault("ZNNI_CACHE_DIR", _CACHE)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# property tests draw the same examples on every run (CI never fails on a fresh draw, and a failure
# reproduces); HYPOTHESIS_PROFILE=explore draws new ones
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _has_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    sbatch = shutil.which("sbatch") is not None
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if "slurm" in item.keywords and not sbatch:
            item.add_marker(pytest.mark.skip(reason="no SLURM (sbatch not on PATH)"))


@pytest.fixture(autouse=True)
def _cold_kernel_spectra():
    """Every test starts without the kernel spectra ``infer`` keeps between calls (and frees
    them after), so counts of spectra built mean the same in any test order."""
    import znni_core

    znni_core.release_cache()
    yield
    znni_core.release_cache()
