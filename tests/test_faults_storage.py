"""Storage faults of RELIABILITY.md: T6 (disk full during a chunk write).

Fast, deterministic cases (no timing): they run with ``make test``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tests import faults_helpers as H


def _can_mount_tmpfs(tmp_path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    d = tmp_path / "probe"
    d.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(d)], check=True)
    return ok


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A case whose every task ran (chunks + manifests): the uninterrupted layer."""
    case = H.prepare(H.make_case(tmp_path_factory.mktemp("t6") / "base"))
    for t in case.tasks():
        assert H.run_task_proc(case, t["id"]).exitcode == 0
    return case


@pytest.fixture
def small_disk(tmp_path):
    """Mount a small tmpfs; yields a function that fills it up to ``free`` bytes left."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("needs root and tmpfs mounts")
    mounts = []

    def mount(where, size_kb):
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)], check=True)
        mounts.append(where)
        return where

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], check=False)


def _fill(directory, leave_bytes: int):
    """Fill the file system of ``directory`` until at most ``leave_bytes`` are free."""
    filler = directory / f".filler-{uuid.uuid4().hex[:6]}"
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave_bytes))
            f.flush()
        except OSError:
            pass
    return filler


def test_t6_disk_full_during_chunk_write(finished, small_disk, tmp_path):
    """ENOSPC while a task rewrites its chunk: CE naming the chunk, no manifest, the previous
    version of the chunk intact; after space is freed the rerun is BI and leaves no temporaries."""
    case = finished.copy(tmp_path / "case")
    golden = H.layer_files(finished.out)
    # the output layer lives on a small tmpfs: a copy of the finished layer, then (almost) full
    shutil.rmtree(case.out)
    small_disk(case.out, 1024)
    shutil.copytree(finished.out, case.out, dirs_exist_ok=True)
    task = 3
    case.manifest(task).unlink()
    filler = _fill(case.out, 2048)           # the chunk (about 21 kB) cannot be written
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode != 0, "a chunk write on a full disk was reported as success"
    err = p.stderr
    assert "Traceback" not in err, err[-3000:]
    assert "space" in err.lower() or "ENOSPC" in err or "errno 28" in err.lower(), err[-3000:]
    chunk_names = {n.split("/")[-1] for n in golden}
    assert any(n in err for n in chunk_names), f"the error does not name the chunk:\n{err[-3000:]}"
    assert not case.manifest(task).exists(), "done-marker written after a failed chunk write"
    filler.unlink()
    H.assert_same_chunks(H.layer_files(case.out), golden, "T6: previous versions after ENOSPC")
    # the next good run: BI and no stray temporaries
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert H.manifest_ok(case, task) is True
    H.assert_same_chunks(H.layer_files(case.out), golden, "T6 after the rerun")
    assert not H.temporaries(case.out)


def test_t6_disk_full_for_manifest(finished, small_disk, tmp_path):
    """ENOSPC while writing the done-marker: CE, no (partial) manifest; rerun completes."""
    case = finished.copy(tmp_path / "case")
    task = 5
    case.manifest(task).unlink()
    mdir = case.work / "manifests"
    saved = tmp_path / "saved-manifests"
    shutil.copytree(mdir, saved)
    shutil.rmtree(mdir)
    small_disk(mdir, 64)
    shutil.copytree(saved, mdir, dirs_exist_ok=True)
    filler = _fill(mdir, 0)
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode != 0, "a manifest write on a full disk was reported as success"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not case.manifest(task).exists(), "partial done-marker left"
    assert not [q for q in mdir.iterdir() if ".znni-tmp." in q.name]
    filler.unlink()
    p = H.znni("run-task", case.run_file, "--task", task, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert H.manifest_ok(case, task) is True
