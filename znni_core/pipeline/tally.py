"""A run's tasks folded from their manifests one at a time, in memory that does not grow with them.

``finalize``, ``znni verify``, ``znni status`` and the report read every task's manifest; a run of
10^6 tasks and 10^7 chunks held as dicts took tens of GB.  A :class:`Tally` keeps per task only a
few numbers in arrays (id, state, start, end, voxels, the job that ran it: 37 bytes a task), sums and
counts, the first :data:`MAX_LISTED` of each list that can grow with the run (failures, input
chunks read as zero), a fixed-size random sample of the chunks recorded ``empty`` (verify checks
them), and spills every written chunk's sha256 to files by ranges of checksum-index block
(:meth:`Tally.index_blocks` reads them back a block at a time).

>>> t = Tally(2)
>>> m = {"task": 7, "chunks": [{"index": [0, 0, 0], "status": "written", "sha256": "ab" * 32}],
...      "finished": 10.0, "timings": {"total_s": 2.0}, "voxels": 8, "host": "n1", "pid": 1}
>>> t.add(0, m)
>>> t.fail(1, 8, "manifest missing")
>>> t.counts(), t.chunks["written"], t.wall_seconds()
({'done': 1, 'empty': 0, 'masked': 0, 'failed': 1, 'todo': 0}, 1, 2.0)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

#: a task's state in :attr:`Tally.state`
#: (OTHER: a manifest of another run, ``znni status``: not done for this one)
TODO, DONE, EMPTY, MASKED, FAILED, OTHER = 0, 1, 2, 3, 4, 5
NAMES = {TODO: "todo", DONE: "done", EMPTY: "empty", MASKED: "masked", FAILED: "failed", OTHER: "other"}
#: lists that grow with the run (failures, input chunks read as zero) keep this many entries and a count
MAX_LISTED = 1000
#: files the digests are spilled to, by ranges of index block: one is sorted in memory at a time
#: (10^7 chunks: 160k digests, 7 MB, each)
BUCKETS = 64
#: a spilled digest: chunk index (z, y, x) as int32, then the sha256's 32 bytes
_RECORD = np.dtype([("index", "<i4", (3,)), ("sha256", "u1", (32,))])


class Capped:
    """The distinct strings seen, at most :data:`MAX_LISTED` of them kept (sorted by :meth:`listed`);
    :attr:`complete` is False once one was left out."""

    def __init__(self):
        self.items: set = set()
        self.complete = True

    def update(self, values) -> None:
        """Add ``values`` (beyond the cap: only noted)."""
        for v in values:
            if v not in self.items:
                if len(self.items) < MAX_LISTED:
                    self.items.add(v)
                else:
                    self.complete = False

    def listed(self) -> list:
        """The kept values, sorted."""
        return sorted(self.items)


class Tally:
    """The tasks of a run, position ``k`` in the run's task order (module doc).

    ``spill``: a directory for the written chunks' digests (None: not kept); ``empty_sample``:
    how many of the chunks recorded ``empty`` to keep, chosen uniformly by ``rng`` (reservoir
    sampling: the same manifests and seed, the same sample)."""

    def __init__(self, n: int, *, spill: Path | None = None, index=None, empty_sample: int = 0, rng=None):
        self.n = int(n)
        self.ids = np.full(self.n, -1, np.int64)
        self.state = np.zeros(self.n, np.uint8)
        self.start = np.full(self.n, np.nan)
        self.end = np.full(self.n, np.nan)
        self.voxels = np.zeros(self.n, np.int64)
        self.job = np.full(self.n, -1, np.int32)
        self.job_names: list = []
        self._job_codes: dict = {}
        self.errors: dict = {}  # task id -> why it is not done (the first MAX_LISTED)
        self.chunks = {"written": 0, "empty": 0, "masked": 0}
        self.shards = 0
        self.compute_s = 0.0
        self.reads = {"tasks": 0, "chunks": 0, "voxels": 0}
        self.filled, self.mask_filled = Capped(), Capped()
        self.recomputed = {"voxels": 0, "tasks": 0, "max_deviation": 0.0, "tolerance": float("inf")}
        self.empty_sample, self._rng, self.empties, self._empty_seen = int(empty_sample), rng, [], 0
        self.digests = 0
        self._spill = None
        if spill is not None:
            # the digests in BUCKETS files by ranges of index block (``index``: (key of (z, y, x)
            # arrays, number of keys)): each sorted alone, in order, at the end
            self._key, self._keys = index
            Path(spill).mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix=".digests-", dir=spill))
            self._spill = [open(self._dir / f"{b:03d}", "w+b") for b in range(BUCKETS)]

    # ---- folding ------------------------------------------------------------------------------
    def _job(self, name: str) -> int:
        """The code of the job ``name`` (a SLURM job id, else host:pid), given on first sight."""
        code = self._job_codes.get(name)
        if code is None:
            code = self._job_codes[name] = len(self.job_names)
            self.job_names.append(name)
        return code

    def add(self, k: int, m: dict) -> None:
        """Task ``k``'s manifest, checked: done (``empty`` when every chunk is)."""
        self.ids[k] = int(m["task"])
        written = []
        statuses = {"written": 0, "empty": 0, "masked": 0}
        for c in m["chunks"]:
            s = c["status"]
            statuses[s] = statuses.get(s, 0) + 1
            if s == "written":
                written.append(c)
            elif s == "empty" and self.empty_sample:
                self._sample_empty(int(m["task"]), c["index"])
        for s, v in statuses.items():
            self.chunks[s] = self.chunks.get(s, 0) + v
        self.state[k] = EMPTY if m["chunks"] and statuses["empty"] == len(m["chunks"]) else DONE
        if m.get("shard"):
            self.shards += 1
        try:
            total, end = float(m["timings"]["total_s"]), float(m["finished"])
            self.start[k], self.end[k] = end - total, end
            self.compute_s += total
        except (KeyError, TypeError, ValueError):
            pass
        self.voxels[k] = int(m.get("voxels") or 0)
        self.job[k] = self._job(str(m.get("slurm_job") or f"{m.get('host', '?')}:{m.get('pid', '?')}"))
        r = m.get("input_read")
        if r:
            self.reads["tasks"] += 1
            self.reads["chunks"] += int(r.get("chunks", 0))
            self.reads["voxels"] += int(r.get("voxels", 0))
        self.filled.update(m.get("missing_input_filled") or [])
        self.mask_filled.update(m.get("missing_mask_filled") or [])
        rec = m.get("recomputed") or {}
        if rec.get("voxels"):
            q = self.recomputed
            q["voxels"] += int(rec["voxels"])
            q["tasks"] += 1
            q["max_deviation"] = max(q["max_deviation"], float(rec["max_deviation"]))
            q["tolerance"] = min(q["tolerance"], float(rec["tolerance"]))
        if self._spill is not None and written:
            rows = np.zeros(len(written), _RECORD)
            rows["index"] = [c["index"] for c in written]
            rows["sha256"] = np.frombuffer(b"".join(bytes.fromhex(c["sha256"]) for c in written), np.uint8).reshape(
                -1, 32
            )
            idx = rows["index"].astype(np.int64)
            bucket = self._key(idx[:, 0], idx[:, 1], idx[:, 2]) * BUCKETS // max(self._keys, 1)
            for b in np.unique(bucket):
                self._spill[int(b)].write(rows[bucket == b].tobytes())
            self.digests += len(written)

    def _sample_empty(self, task: int, index) -> None:
        self._empty_seen += 1
        item = (task, tuple(int(v) for v in index))
        if len(self.empties) < self.empty_sample:
            self.empties.append(item)
            return
        j = int(self._rng.integers(self._empty_seen))
        if j < self.empty_sample:
            self.empties[j] = item

    def fail(self, k: int, task: int, why: str) -> None:
        """Task ``k`` (id ``task``) is not done: ``why``."""
        self.ids[k] = int(task)
        self.state[k] = FAILED
        if len(self.errors) < MAX_LISTED:
            self.errors[int(task)] = why

    def seen(self, k: int, task: int, state: int) -> None:
        """Task ``k`` (id ``task``) is in ``state``, nothing else known of it (masked as a whole;
        ``znni status``'s todo and other)."""
        self.ids[k] = int(task)
        self.state[k] = state

    def timing(self, k: int, task: int, start: float, end: float, voxels: int, who: str) -> None:
        """Task ``k`` is done, with only its timing known (``znni status``)."""
        self.ids[k] = int(task)
        self.state[k] = DONE
        self.start[k], self.end[k], self.voxels[k] = start, end, voxels
        self.job[k] = self._job(who)

    # ---- reading ------------------------------------------------------------------------------
    def counts(self) -> dict:
        """Tasks per state name."""
        c = np.bincount(self.state, minlength=len(NAMES))
        return {NAMES[s]: int(c[s]) for s in (DONE, EMPTY, MASKED, FAILED, TODO)}

    @property
    def n_failed(self) -> int:
        """Tasks whose check failed."""
        return int(np.count_nonzero(self.state == FAILED))

    def failed_ids(self) -> list:
        """The ids of the tasks whose check failed, sorted (every one: an int each)."""
        return sorted(int(v) for v in self.ids[self.state == FAILED])

    def ids_where(self, *states) -> list:
        """The ids of the tasks in any of ``states``, in task order."""
        return [int(v) for v in self.ids[np.isin(self.state, states)]]

    def timed(self) -> np.ndarray:
        """Positions of the tasks with a timing."""
        return np.flatnonzero(~np.isnan(self.end))

    def wall_seconds(self) -> float:
        """From the first timed task's start to the last one's end."""
        t = self.timed()
        return float(self.end[t].max() - self.start[t].min()) if len(t) else 0.0

    def last_finished(self) -> float:
        """The last timed task's end (0 without one)."""
        t = self.timed()
        return float(self.end[t].max()) if len(t) else 0.0

    def verification(self) -> dict:
        """What the tasks' own checks recomputed, summed."""
        q = self.recomputed
        if not q["voxels"]:
            return {"recomputed_voxels": 0}
        return {
            "recomputed_voxels": q["voxels"],
            "recomputed_tasks": q["tasks"],
            "recomputed_max_deviation": q["max_deviation"],
            "recomputed_tolerance": q["tolerance"],
        }

    def index_blocks(self):
        """``(block key, [(chunk index, sha256 hex), ...])`` of the spilled digests, block by block
        in key order, one bucket of them in memory at a time."""
        if self._spill is None:
            return
        for f in self._spill:
            f.flush()
            f.seek(0)
            rows = np.frombuffer(f.read(), _RECORD)
            if not len(rows):
                continue
            idx = rows["index"].astype(np.int64)
            keys = self._key(idx[:, 0], idx[:, 1], idx[:, 2])
            order = np.argsort(keys, kind="stable")
            keys, rows = keys[order], rows[order]
            cuts = np.flatnonzero(np.diff(keys)) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(keys)]):
                yield (
                    int(keys[lo]),
                    [(tuple(int(v) for v in r["index"]), bytes(r["sha256"]).hex()) for r in rows[lo:hi]],
                )

    def close(self) -> None:
        """Remove the spilled digests."""
        if self._spill is not None:
            for f in self._spill:
                f.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._spill = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def busy_seconds(start, end) -> float:
    """Length of the union of the intervals ``[start[i], end[i])``.

    >>> busy_seconds([0, 1, 10], [2, 3, 11])
    4.0
    """
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    if not len(start):
        return 0.0
    o = np.argsort(start, kind="stable")
    s, e = start[o], np.maximum.accumulate(end[o])
    # a new run of overlapping intervals starts where an interval begins after every earlier end
    new = np.r_[True, s[1:] > e[:-1]]
    firsts = np.flatnonzero(new)
    lasts = np.r_[firsts[1:] - 1, len(s) - 1]
    return float(np.sum(e[lasts] - s[firsts]))
