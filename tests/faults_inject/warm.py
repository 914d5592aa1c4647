"""Forkserver preload for the fault suite: import znni and run one task of a scratch copy of the
case (``ZNNI_WARM_RUN``), so that every forked task starts with numba kernels and lazy imports warm.
Threads are capped to 1 in the server (tests/faults_helpers.py) so forking stays safe."""
import os

import cloudvolume  # noqa: F401  (slow import, done once)
import znni_core.pipeline.task as T

from . import sitecustomize  # noqa: F401

if os.environ.get("ZNNI_WARM_RUN"):
    T.run_task(os.environ["ZNNI_WARM_RUN"], 0, show_progress=False, log=lambda *a, **k: None)
