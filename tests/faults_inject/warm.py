"""Forkserver preload for the fault suite: import znni and its slow dependencies once, so forked
task runs start in well under a second. No engine call here (thread pools must not exist before
a fork; tests/faults_helpers.py)."""

import cloudvolume  # noqa: F401
import dask.array  # noqa: F401

import znni_core.layers  # noqa: F401
import znni_core.pipeline.task  # noqa: F401

from . import sitecustomize  # noqa: F401
