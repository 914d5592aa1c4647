"""Test-wide settings: isolated caches, numba threading layer, the gpu/slurm markers."""

from __future__ import annotations

import os
import shutil
import tempfile

# before anything imports numba (docs/pitfalls.md: the default workqueue layer crashes under threads)
os.environ.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
_CACHE = tempfile.mkdtemp(prefix="znni-test-cache-")
os.environ.setdefault("ZNNI_CACHE_DIR", _CACHE)
# numba's kernels: one cache for every test process and the commands they start (a folder per
# version of the kernel sources inside it, ``layers/_numba.KERNELS_CACHE``), not one per session
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "znni-tests-numba"))

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


def pytest_configure(config):
    from .other_host import install

    install()  # ZNNI_TEST_HOST: plan under another host's rates (make test-hosts)


#: pytest-timeout's limit for a slow test (pyproject's ``timeout`` is for the others): the fault
#: cases take 0.5-3 minutes each on 2 cores, a module's golden run included in its first test
SLOW_TIMEOUT = 1800


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    sbatch = shutil.which("sbatch") is not None
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))
        if item.get_closest_marker("gpu") and not gpu:  # the marker, not a parameter named gpu
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("slurm") and not sbatch:
            item.add_marker(pytest.mark.skip(reason="no SLURM (sbatch not on PATH)"))


def pytest_runtest_setup(item):
    """``@pytest.mark.real_data(files...)``: skip when a file is absent from the data directory
    (tests/real_data.py), but fail under CI, which must run these tests."""
    mark = item.get_closest_marker("real_data")
    if mark is None:
        return
    from . import real_data

    gone = real_data.missing(*mark.args)
    if gone:
        where = f"{real_data.data_dir()} (${real_data.ENV}, default ../shared/data beside the repository)"
        if real_data.required():
            pytest.fail(f"CI must run the real-data tests: {', '.join(gone)} not found in {where}", pytrace=False)
        pytest.skip(f"real data absent: {', '.join(gone)} in {where}")


def pytest_terminal_summary(terminalreporter):
    """What ran of the real-data tests (``.ci/run`` checks the line), and how much of the suite
    tests/test_hygiene.py checked, when it ran (printed by the main process: under xdist a
    worker's output is not shown)."""
    # test reports only (deselected items are listed too, as items without a phase or outcome)
    reports = [r for rs in terminalreporter.stats.values() for r in rs if hasattr(r, "nodeid") and hasattr(r, "when")]
    real = {}  # nodeid -> outcome: the call's, or the setup's when it did not pass (skipped, failed)
    for r in reports:
        if "real_data" in getattr(r, "keywords", {}) and (r.when == "call" or r.outcome != "passed"):
            real.setdefault(r.nodeid, r.outcome)
    if real:
        from . import real_data

        counts = {k: sum(v == k for v in real.values()) for k in ("passed", "failed", "skipped")}
        terminalreporter.write_line(
            f"real-data tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
            f"(data: {real_data.data_dir()})"
        )
    if any("test_hygiene.py::" in r.nodeid for r in reports):
        from .test_hygiene import scan

        r = scan()
        terminalreporter.write_line(
            f"test hygiene: {r.files} files, {r.asserts} asserts and {r.raises} pytest.raises checked, "
            f"{len(r.offences)} findings"
        )


@pytest.fixture(autouse=True)
def _cold_kernel_spectra():
    """Every test starts without the kernel spectra ``infer`` keeps between calls (and frees
    them after), so counts of spectra built mean the same in any test order."""
    import znni_core

    znni_core.release_cache()
    yield
    znni_core.release_cache()


@pytest.fixture
def moto_s3(monkeypatch):
    """A loopback S3 server (moto) with a bucket ``znni``; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    # moto's store is process-global (shared with every other moto server in this pytest run): reset it.
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).read()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    import boto3

    boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1").create_bucket(Bucket="znni")
    from cloudfiles import secrets

    secrets.AWS_CREDENTIALS_CACHE.clear()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def gcs_emulator(monkeypatch):
    """A loopback Google Cloud Storage server (gcp-storage-emulator, in memory) with a bucket
    ``znni``; ``STORAGE_EMULATOR_HOST`` points znni's GCS client at it.  Yields its URL."""
    import socket

    pytest.importorskip("gcp_storage_emulator", reason="the dev extra installs gcp-storage-emulator")
    from gcp_storage_emulator.server import create_server

    from znni_core.io import gcs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="znni")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    gcs._clients.pop(f"http://127.0.0.1:{port}", None)
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def numba_thread_counts():
    """1 and (where numba has them) 2 threads, set in turn as a test iterates over it: kernels that
    split their rows over numba's thread count (``layers/threads.split_tasks``) run both ways; the
    count is restored after the test."""
    from znni_core.layers._numba import numba

    before = numba.get_num_threads()

    def counts():
        for workers in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(workers)
            yield workers

    yield counts()
    numba.set_num_threads(before)


@pytest.fixture(autouse=True)
def _default_kernel_parameters():
    """Each test starts with the default kernel parameters: a plan run by an earlier test puts
    its host's measured values in force for the process (``layers/tuning.py``)."""
    from znni_core.layers import tuning

    with tuning.using(tuning.DEFAULTS):
        yield
