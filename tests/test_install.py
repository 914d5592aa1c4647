"""A user's install (README's Install): a fresh virtual environment, the project installed from a
copy of this tree with no extras; and pyproject.toml's lower bounds, checked in the environment of
``make test-lowest`` (uv's lowest-direct resolution: each runtime dependency at its bound)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from znni_core.io.volumes import read_volume, write_volume
from znni_core.net import save_network
from znni_core.version import __version__

from .nets import NETS, make_net

ROOT = Path(__file__).resolve().parents[1]

#: what the extras and the tests add (PyTorch: the tests' reference, installed apart): never in a user's install
NOT_FOR_USERS = {
    "torch", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "moto", "gcp-storage-emulator",
    "tensorstore", "igneous-pipeline", "playwright", "ruff", "cupy-cuda12x", "cupy-cuda13x", "onnxruntime", "openvino",
}  # fmt: skip
#: ... unless a runtime dependency of ours requires it itself: compressed-segmentation (cloud-volume's
#: codec) lists pytest among its plain requirements
REQUIRED_BY_OTHERS = {"pytest": {"compressed-segmentation"}}

#: run by the new environment's Python: what is installed, who requires what, znni's metadata
PROBE = """
import json, re, sys
from importlib import metadata as md
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
dists, required_by = {}, {}
for d in md.distributions():
    dists[norm(d.metadata["Name"])] = d.version
    for r in d.requires or []:
        r = Requirement(r)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            required_by.setdefault(norm(r.name), []).append(norm(d.metadata["Name"]))
import znni_core
meta = md.metadata("znni")
json.dump({"dists": dists, "required_by": required_by, "requires": md.requires("znni"),
           "license": meta.get("License-Expression"),
           "license_files": {str(f): f.read_text() for f in md.files("znni") if f.name == "LICENSE"},
           "package": znni_core.__file__, "prefix": sys.prefix}, sys.stdout)
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(requires) -> list[Requirement]:
    """The requirements of ``requires`` that hold with no extra chosen."""
    reqs = [Requirement(r) for r in requires or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def copy_of_the_tree(dest: Path) -> Path:
    """The files a clone of this tree has (tracked ones and new ones git does not ignore)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, out.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_a_user_install_has_the_runtime_dependencies_only_as_ranges(tmp_path):
    """``pip install /path/to/znni`` into a fresh venv (uv's pip when this venv has it: the same
    resolution, seconds instead of minutes): no test package, no exact pin, the MIT license in the
    metadata and its file in the dist-info, and the console script runs from the installed package."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy")
    src = copy_of_the_tree(tmp_path / "src")
    venv = tmp_path / "venv"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    subprocess.run([sys.executable, "-m", "venv", *(["--without-pip"] if uv else []), str(venv)], check=True)
    py = venv / "bin" / "python"
    install = [uv, "pip", "install", "-q", "--python", str(py)] if uv else [str(py), "-m", "pip", "install", "-q"]
    p = subprocess.run([*install, str(src)], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    p = subprocess.run([str(py), "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    got = json.loads(p.stdout)
    assert Path(got["package"]).is_relative_to(got["prefix"]), got["package"]  # installed, not this tree
    unwanted = {}
    for name in NOT_FOR_USERS & set(got["dists"]):
        by = set(got["required_by"].get(name, ()))
        if not by or not by <= REQUIRED_BY_OTHERS.get(name, set()):
            unwanted[name] = sorted(by)
    assert not unwanted, f"installed for a user (package: the packages that require it): {unwanted}"
    runtime = runtime_requirements(got["requires"])
    assert {norm(r.name) for r in runtime} >= {"numpy", "snakemake", "cloud-volume"}, got["requires"]
    pinned = [str(r) for r in runtime if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"exact pins in a user's install: {pinned}"
    assert got["license"] == "MIT"
    assert [t for f, t in got["license_files"].items() if ".dist-info/" in f] == [(ROOT / "LICENSE").read_text()]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    znni = str(venv / "bin" / "znni")
    p = subprocess.run([znni, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"znni {__version__}", p.stdout + p.stderr
    net = save_network(make_net(NETS["iso2pool"], seed=3), tmp_path / "net.yaml")
    p = subprocess.run([znni, "info", str(net)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "field of view" in p.stdout, p.stdout + p.stderr


def test_tif_volumes_round_trip(tmp_path):
    """``znni infer``'s .tif files (tifffile, imported for them alone): written and read back whole
    and as a region."""
    y = np.random.default_rng(0).standard_normal((2, 5, 6, 7)).astype(np.float32)
    write_volume(str(tmp_path / "out.tif"), y)
    x, roi, res = read_volume(str(tmp_path / "out.tif"))
    assert roi is None and res is None
    np.testing.assert_array_equal(x, y)
    x, roi, _ = read_volume(str(tmp_path / "out.tif"), offset=(1, 2, 3), shape=(2, 2, 2))
    np.testing.assert_array_equal(x, y[:, 1:3, 2:4, 3:5])


@pytest.mark.skipif(not os.environ.get("ZNNI_LOWEST"), reason="in make test-lowest's environment only")
def test_the_lowest_environment_is_at_every_lower_bound():
    """``make test-lowest`` resolves with lowest-direct: a runtime dependency installed above its
    lower bound there means the bound is not true (another requirement forces a later version):
    raise it in pyproject.toml."""
    above = {}
    for r in runtime_requirements(metadata.requires("znni")):
        lows = [Version(s.version) for s in r.specifier if s.operator == ">="]
        have = Version(metadata.version(r.name))
        if lows and have != max(lows):
            above[r.name] = f"bound {max(lows)}, installed {have}"
    assert not above, f"above their lower bound (not a true bound: raise it in pyproject.toml): {above}"
