"""The tally finalize, verify and status fold the manifests into: bounded memory, the same
checksum index as the whole digest map, a reproducible sample of the empty chunks, the task map
as a raster."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from znni_core.geometry import Coordinate, Roi
from znni_core.io import PrecomputedLayer, ScaleSpec, create_layer, parse_layer_url
from znni_core.io.checksums import ChunkSums, index_keys, write_index
from znni_core.pipeline.tally import MAX_LISTED, Tally, busy_seconds

PROV = {"description": "test", "owners": [], "processing": [], "sources": []}


def _layer(tmp_path, name: str) -> PrecomputedLayer:
    url = parse_layer_url(f"file://{tmp_path / name}")
    spec = ScaleSpec("8_8_40", Roi((0, 0, 0), (40, 160, 176)), Coordinate(4, 8, 8), (40.0, 8.0, 8.0), "uint8", 1)
    create_layer(url, spec, PROV)
    return PrecomputedLayer(url, 0)


def _manifest(task: int, chunks, *, status="written", finished=100.0, host="n1", pid=1) -> dict:
    return {
        "task": task,
        "chunks": [
            {"index": list(c), "status": status}
            | ({"sha256": hashlib.sha256(repr(tuple(c)).encode()).hexdigest()} if status == "written" else {})
            for c in chunks
        ],
        "finished": finished,
        "timings": {"total_s": 2.0},
        "voxels": 64 * len(chunks),
        "host": host,
        "pid": pid,
        "input_read": {"chunks": 2, "voxels": 100},
        "missing_input_filled": [f"in/{task % 3}"],
    }


def test_the_index_from_the_spilled_digests_equals_the_one_from_the_whole_map(tmp_path):
    """Digests spilled by block ranges and read back a block at a time write the same index files
    as the dict of every digest, and every chunk's recorded sha256 reads back through ChunkSums."""
    a, b = _layer(tmp_path, "a"), _layer(tmp_path, "b")
    grid = tuple(a.grid.grid_shape)
    chunks = [tuple(int(v) for v in c) for c in np.ndindex(*grid)]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(chunks))  # tasks finish in any order
    key, _, count = index_keys(a)
    with Tally(len(chunks) // 4 + 1, spill=tmp_path / "spill", index=(key, count)) as tally:
        digests = {}
        for k, lo in enumerate(range(0, len(chunks), 4)):
            part = [chunks[i] for i in order[lo : lo + 4]]
            m = _manifest(k, part)
            tally.add(k, m)
            digests |= {tuple(c["index"]): c["sha256"] for c in m["chunks"]}
        assert tally.digests == len(chunks) == write_index(a, tally)
        spill_dir = tally._dir
    assert not spill_dir.exists()  # the spill goes with the tally
    write_index(b, digests)
    ka, kb = a.url.local_path / a.key / "znni-sha256", b.url.local_path / b.key / "znni-sha256"
    files = sorted(p.name for p in ka.iterdir())
    assert files == sorted(p.name for p in kb.iterdir()) and len(files) > 2
    assert all((ka / f).read_bytes() == (kb / f).read_bytes() for f in files)
    sums = ChunkSums.of(a)
    assert all(sums.expected(c) == digests[c] for c in chunks)


def test_folding_manifests_holds_a_few_numbers_per_task():
    """20,000 manifests of 16 chunks each (about 100 MB as dicts) folded: the tally grows by its
    preallocated arrays only (no digest spill, no empty sample asked for)."""
    n = 20_000
    tracemalloc.start()
    try:
        tally = Tally(n)
        base = tracemalloc.get_traced_memory()[0]
        for k in range(n):
            tally.add(k, _manifest(k, [(k, y, x) for y in range(4) for x in range(4)], host=f"n{k % 50}"))
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 200_000, f"the tally grew {grown} bytes over {n} tasks"
    c = tally.counts()
    assert c["done"] == n and tally.chunks["written"] == 16 * n and tally.reads["voxels"] == 100 * n
    assert len(tally.job_names) == 50 and tally.filled.listed() == ["in/0", "in/1", "in/2"]


def test_lists_that_grow_with_the_run_are_capped_and_say_so():
    tally = Tally(MAX_LISTED + 10)
    for k in range(MAX_LISTED + 10):
        m = _manifest(k, [(k, 0, 0)])
        m["missing_input_filled"] = [f"in/{k}"]
        tally.add(k, m) if k % 2 else tally.fail(k, k, f"task {k} broken")
    assert len(tally.filled.listed()) == (MAX_LISTED + 10) // 2 and tally.filled.complete
    tally.filled.update(f"x/{i}" for i in range(MAX_LISTED))
    assert len(tally.filled.listed()) == MAX_LISTED and not tally.filled.complete
    assert tally.n_failed == (MAX_LISTED + 10) // 2 == len(tally.failed_ids()) and len(tally.errors) <= MAX_LISTED


@pytest.mark.parametrize("count", [0, 5, 500])
def test_the_empty_chunks_sample_is_uniform_sized_and_reproducible(count):
    """verify's empty chunks: ``count`` of them (or all, when fewer), the same for the same seed,
    each of 200 equally likely (every one drawn over 400 seeds)."""

    def sample(seed):
        t = Tally(50, empty_sample=count, rng=np.random.default_rng([seed, 1]))
        for k in range(50):
            t.add(k, _manifest(k, [(k, j, 0) for j in range(4)], status="empty"))
        return sorted(t.empties)

    a = sample(3)
    assert len(a) == min(count, 200) and a == sample(3)
    if count == 5:
        seen = {c for s in range(400) for c in sample(s)}
        assert len(seen) == 200 and sample(4) != a


def test_busy_seconds_is_the_union_of_the_intervals():
    rng = np.random.default_rng(1)
    s = rng.random(300) * 100
    e = s + rng.random(300) * 3
    covered = np.zeros(110_000, bool)  # on a 1 ms grid
    for a, b in zip(s, e):
        covered[int(np.ceil(a * 1000)) : int(np.ceil(b * 1000))] = True
    assert busy_seconds(s, e) == pytest.approx(covered.sum() / 1000, abs=0.01 * 300 / 1000 + 1e-9)
    assert busy_seconds([], []) == 0.0


def test_the_task_map_is_one_raster_whatever_the_number_of_tasks(tmp_path):
    """A task grid wider than MAP_CELLS is drawn in blocks of tasks, the highest state over each."""
    from PIL import Image

    from znni_core.geometry import ChunkGrid, Halo, TaskGrid
    from znni_core.pipeline.report import MAP_CELLS, STATES, task_map

    grid = ChunkGrid(Roi((0, 0, 0), (2, 10, 3000)), (1, 1, 1))
    tasks = TaskGrid(grid, (1, 1, 1), Halo((0, 0, 0), (0, 0, 0)))
    ranks = np.full(len(tasks), STATES.index("done") + 1, np.int8)
    ranks[7] = STATES.index("failed") + 1
    name = task_map(tasks, ranks, tmp_path / "tasks.png")
    assert name == "tasks.png" and len(tasks) == 60_000 > MAP_CELLS
    w, h = Image.open(tmp_path / "tasks.png").size
    assert w * h < 2_000_000
