"""Where the tests find the real data: EM from a public challenge and trained networks.

``$ZNNI_DATA``, else ``../shared/data`` beside the repository. Read only, never copied into the
repository, never needed to install or run znni: a test that uses it is marked
``@pytest.mark.real_data("models/x.onnx", ...)`` (the files it reads, relative to this directory)
and skips when one is absent, except under CI (``CI=true``, or ``ZNNI_REQUIRE_DATA=1``), where a
missing file fails the test: CI must run them (tests/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "ZNNI_DATA"
_HERE = Path(os.path.abspath(__file__)).parent


def data_dir() -> Path:
    """``$ZNNI_DATA``, else ``../shared/data`` beside the repository (the repository as it was
    reached, or, if that has none, as its symbolic links resolve)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    candidates = [_HERE.parent.parent / "shared" / "data", _HERE.resolve().parent.parent / "shared" / "data"]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def required() -> bool:
    """Must the real-data tests run (CI), rather than skip when the data is absent?"""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes") or os.environ.get("ZNNI_REQUIRE_DATA") == "1"


def missing(*relative: str) -> list[str]:
    """The files of ``relative`` (paths under :func:`data_dir`) that are not there."""
    return [r for r in relative if not (data_dir() / r).is_file()]


DATA = data_dir()
DETECTOR = DATA / "models" / "modelzoo_iarpa1_synapse_detection.onnx"
DETECTOR_REFERENCE = DATA / "models" / "modelzoo_iarpa1_synapse_detection_sample1_reference.npz"
#: the marker's arguments for a test of the detector against its reference output
DETECTOR_FILES = (
    "models/modelzoo_iarpa1_synapse_detection.onnx",
    "models/modelzoo_iarpa1_synapse_detection_sample1_reference.npz",
)
