"""A job's input cache (io/chunk_cache.py): the same arrays, missing chunks and object versions as
reads of the layer itself, each shared chunk fetched once, memory then files within a limit."""

from __future__ import annotations

import os

import numpy as np
import pytest

from znni_core.geometry import ChunkGrid, Halo, Roi, TaskGrid
from znni_core.io.chunk_cache import ChunkCache, chunk_uses

from .test_io import fill, make_layer


class Counting:
    """A layer whose chunk fetches are counted (the layer's own ``_stored``, one call a chunk)."""

    def __init__(self, layer):
        self.layer, self.fetched = layer, []
        real = layer._stored

        def stored(index):
            self.fetched.append(tuple(int(i) for i in index))
            return real(index)

        layer._stored = stored


def _tasks(layer, task=(1, 1, 1), halo=((1, 2, 3), (1, 3, 2))):
    """Tasks over the layer's bounds shrunk by the halo (output chunks of 3 x 7 x 9 voxels: off the
    input's chunk grid), and their read boxes."""
    h = Halo(*halo)
    b = layer.bounds
    out = ChunkGrid(Roi(b.offset + h.low, b.shape - h.low - h.high), (3, 7, 9))
    tasks = TaskGrid(out, task, h)
    return tasks, [h.read_roi(t.write_roi) for t in tasks]


@pytest.mark.parametrize("memory", [10**9, 0])
def test_a_job_reads_equal_the_layer_and_fetch_each_shared_chunk_once(tmp_path, memory):
    _, _, layer = make_layer(tmp_path, dtype="uint16", channels=2)
    vol = np.random.default_rng(0).integers(0, 60000, (2,) + tuple(layer.bounds.shape), dtype=np.uint16)
    fill(layer, vol)
    tasks, boxes = _tasks(layer)
    direct = [layer.read(r) for r in boxes]
    versions_direct = [layer.object_versions(r) for r in boxes]
    spy = Counting(layer)
    uses = chunk_uses(layer.grid, boxes)
    spill = tmp_path / "spill"
    spill.mkdir()
    with ChunkCache(layer, uses, limit_bytes=10**9, memory_bytes=memory, spill_dir=spill) as cache:
        reads = {"chunks": 0, "voxels": 0}
        for r, (want, _), vd in zip(boxes, direct, versions_direct):
            versions = {}
            got, missing = cache.read(r, versions=versions, reads=reads)
            assert np.array_equal(got, want) and missing == [] and versions == vd
        if memory == 0:  # every kept chunk went to a file, removed when its last reader read it
            assert cache.stats["peak_bytes"] > 0 and os.listdir(spill) != []
        assert cache.stats["reused_chunks"] == reads["reused"] > 0
    assert not any(spill.iterdir())
    # each chunk fetched once; without the cache once per task that reads it
    assert sorted(spy.fetched) == sorted(set(spy.fetched)) == sorted(uses)
    assert reads["chunks"] == len(uses) < sum(uses.values())
    assert reads["chunks"] + reads["reused"] == sum(uses.values())
    assert reads["voxels"] == sum(int(layer.grid.chunk_roi(i).shape.prod()) for i in uses)


def test_a_cache_past_its_limit_fetches_again_and_a_missing_chunk_stays_named(tmp_path):
    _, _, layer = make_layer(tmp_path, dtype="uint8", channels=1)
    vol = np.random.default_rng(1).integers(1, 255, (1,) + tuple(layer.bounds.shape), dtype=np.uint8)
    fill(layer, vol)
    gone = (0, 1, 1)
    os.unlink(layer.url.local_path / layer.chunk_name(gone))
    tasks, boxes = _tasks(layer)
    uses = chunk_uses(layer.grid, boxes)
    readers = [r for r in boxes if gone in {tuple(i) for i in layer.grid.chunks_in(r)}]
    assert len(readers) > 1  # the missing chunk is shared: served from the cache, still named
    direct = [layer.read(r, fill_missing=True) for r in boxes]
    for limit in (10**9, 1):
        spy = Counting(layer)
        with ChunkCache(layer, uses, limit_bytes=limit) as cache:
            for r, (want, want_missing) in zip(boxes, direct):
                got, missing = cache.read(r, fill_missing=True)
                assert np.array_equal(got, want) and missing == want_missing
        del layer._stored  # the class's own again
        if limit == 1:  # nothing kept: every task fetches its own, as without a cache
            assert len(spy.fetched) == sum(uses.values())
        else:
            assert len(spy.fetched) == len(uses)


@pytest.mark.parametrize("brick", [(2, 2, 2), (1, 3, 2), (3, 1, 1)])
def test_a_box_of_tasks_holds_no_more_than_the_schedule_sized_it_for(tmp_path, brick):
    """The schedule sizes a job's box of tasks by the chunks it holds at once
    (``schedule.cache_chunks``); a job run through the cache, task by task in its order, holds no
    more, and fetches what ``input_reads`` predicts for it."""
    from znni_core.pipeline.schedule import JobMap, _Axes, cache_chunks, input_reads

    _, _, layer = make_layer(tmp_path, dtype="uint8", channels=1, bounds=Roi((0, 0, 0), (20, 40, 60)), chunk=(4, 8, 8))
    fill(layer, np.random.default_rng(2).integers(0, 255, (1, 20, 40, 60), dtype=np.uint8))
    tasks, _ = _tasks(layer, halo=((1, 2, 2), (1, 2, 2)))
    shape = tuple(int(v) for v in tasks.shape)
    jobs = JobMap(1, len(tasks), brick, shape)
    chunk_bytes = 4 * 8 * 8
    fetched = peak = 0
    for j in range(jobs.num_jobs):
        boxes = [tasks.halo.read_roi(tasks[k].write_roi) for k in jobs.positions(j)]
        uses = {k: v for k, v in chunk_uses(layer.grid, boxes).items() if v > 1}
        with ChunkCache(layer, uses, limit_bytes=10**9) as cache:
            for r in boxes:
                cache.read(r)
            fetched += cache.stats["fetched_chunks"]
            peak = max(peak, cache.stats["peak_bytes"])
    assert 0 < peak <= cache_chunks(_Axes(tasks, layer), brick) * chunk_bytes
    assert fetched == input_reads(tasks, layer, jobs)["chunks"]
