"""Test-only crash injection for znni jobs (never installed; tests put this directory on PYTHONPATH).

``ZNNI_FAULT=point[:task[:arg]]`` (see tests/faults_helpers.py) patches
``znni_core.pipeline.task`` right after it is imported, so a ``znni run-task`` started by Snakemake
(locally or through SLURM) kills itself with SIGKILL, or fails, at a chosen point.

With ``ZNNI_FAULT_DIR`` set, every kill first appends one line to ``$ZNNI_FAULT_DIR/kills.log``
saying where it landed (``after-chunk task 3: after chunk 1 of 2``): a test asserts the kill
happened, and where, instead of inferring it.
"""

import os
import signal
import sys


def _parse(spec):
    parts = spec.split(":")
    point = parts[0]
    task = parts[1] if len(parts) > 1 and parts[1] not in ("", "*") else None
    arg = int(parts[2]) if len(parts) > 2 and parts[2] else 1
    return point, task, arg


def _die(where=None):
    """SIGKILL this process, after recording ``where`` in ``$ZNNI_FAULT_DIR/kills.log``."""
    d = os.environ.get("ZNNI_FAULT_DIR")
    if where and d:
        with open(os.path.join(d, "kills.log"), "a") as f:
            f.write(where + "\n")
            f.flush()
            os.fsync(f.fileno())
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _TornWrite:
    """A file opened for writing whose ``write`` stores the first half of its bytes, makes them
    durable and then kills the process: the writer dies in the middle of the write."""

    def __init__(self, f, path, where):
        self._f, self._path, self._where = f, path, where

    def write(self, data):
        half = len(data) // 2
        self._f.write(data[:half])
        self._f.flush()
        os.fsync(self._f.fileno())
        _die(f"{self._where}: {half} of {len(data)} bytes in {os.path.basename(self._path)}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()
        return False

    def __getattr__(self, name):
        return getattr(self._f, name)


def patch_task_module(T, spec):
    """Wrap the task's stages (read_task, compute_task, store_task: a job overlaps them across
    its tasks, so every fault is keyed by the task it concerns, never by "the current task").

    Points that write: ``after-chunk:T:N`` kills once N chunks of task T are on storage (in a
    sharded precomputed or zarr output a task's chunks are stored at once, in its shard: the
    kill follows the shard's write); ``mid-write:T:N`` kills inside the N-th object write of task
    T (its chunk, or its shard), with half of the object's bytes written to the temporary file
    the atomic write renames only when whole (``file://`` layers: znni_core/io/atomic.py)."""
    point, task, arg = _parse(spec)
    state = {"chunks": 0, "writes": 0, "storing": None, "total": 0, "armed": None}
    orig_read, orig_compute, orig_store = T.read_task, T.compute_task, T.store_task
    orig_open, orig_manifest = T.open_output, T.write_manifest

    def hit(task_id):
        return task is None or (task_id is not None and int(task) == int(task_id))

    def read_task(ctx, task_id, **kw):
        ti = orig_read(ctx, task_id, **kw)
        if point == "fail" and hit(ti.task_id):
            from znni_core.errors import DataError

            raise DataError(f"injected failure of task {ti.task_id} (ZNNI_FAULT={spec})")
        return ti

    def compute_task(ctx, ti, **kw):
        on = hit(ti.task_id)
        if on and point == "compute":
            _die(f"compute task {ti.task_id}: before its compute")
        if on and point == "sleep-once":  # first run of the task only (a TIMEOUT, then fine)
            marker = os.path.join(os.environ.get("ZNNI_FAULT_DIR", "/tmp"), f"slept-{task}")
            if not os.path.exists(marker):
                open(marker, "w").close()
                import time

                time.sleep(arg)
        if on and point == "hog":  # hold `arg` MB for 4 s (over a job's --mem: OUT_OF_MEMORY)
            import time

            block = bytearray(arg * 2**20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            time.sleep(4)
            del block
        y, t = orig_compute(ctx, ti, **kw)
        if on and point == "nan" and y is not None:
            y.flat[y.size // 2] = float("nan")
        return y, t

    def store_task(ctx, ti, *a, **kw):  # stores run one at a time: the chunks written are this task's
        state["storing"], state["chunks"], state["writes"] = ti.task_id, 0, 0
        state["total"] = len(ti.todo)
        try:
            return orig_store(ctx, ti, *a, **kw)
        finally:
            state["storing"] = None

    def chunks_stored(n):
        """``n`` more chunks of the task being stored are on storage: kill once ``arg`` are."""
        if state["storing"] is None or not hit(state["storing"]):
            return
        state["chunks"] += n
        if state["chunks"] < arg:
            return
        where = f"task {state['storing']} after chunk {state['chunks']} of {state['total']}"
        if point == "after-chunk-once":  # the first attempt only; the marker proves where
            marker = os.path.join(os.environ.get("ZNNI_FAULT_DIR", "/tmp"), f"killed-{task}")
            if os.path.exists(marker):
                return
            with open(marker, "w") as f:
                f.write(where + "\n")
        _die(f"{point} {where}")

    def torn_open(file, mode="r", *oa, **ok):  # znni_core.io.atomic's `open` while mid-write is set
        f = open(file, mode, *oa, **ok)
        if state["armed"] and "w" in mode and ".znni-tmp." in os.path.basename(str(file)):
            return _TornWrite(f, str(file), state["armed"])
        return f

    def writing(write, what):
        """``write`` (a chunk's or a shard's), armed for mid-write when it is the N-th of the task."""

        def wrapped(*wa, **wk):
            on = state["storing"] is not None and hit(state["storing"])
            if on:
                state["writes"] += 1
            if on and point == "mid-write" and state["writes"] == arg:
                state["armed"] = f"mid-write task {state['storing']} {what} {state['writes']}"
                try:
                    write(*wa, **wk)
                finally:
                    state["armed"] = None
                raise RuntimeError(f"ZNNI_FAULT={spec}: the {what} write opened no local file (file:// only)")
            r = write(*wa, **wk)
            if on and point in ("after-chunk", "after-chunk-once"):
                chunks_stored(len(wa[0]) if what == "shard" else 1)
            return r

        return wrapped

    def open_output(*a, **k):
        out = orig_open(*a, **k)  # opened once per job (open_run), before its tasks run
        if point in ("after-chunk", "after-chunk-once", "mid-write"):
            if getattr(out, "sharded", False):  # sharded precomputed and zarr: one shard per task
                out.write_shard = writing(out.write_shard, "shard")
            else:
                out.write_chunk = writing(out.write_chunk, "chunk")
        if point == "mid-write":
            import znni_core.io.atomic as atomic

            atomic.open = torn_open
        return out

    def write_manifest(path, doc, *a, **k):
        if point == "before-manifest" and hit(doc.get("task", state["storing"])):
            _die(f"before-manifest task {doc.get('task', state['storing'])}")
        if point == "hold" and hit(doc.get("task", state["storing"])):
            import time  # wait here for the test's kill: a kill at a seeded moment cannot miss the task

            time.sleep(600)
        return orig_manifest(path, doc, *a, **k)

    T.read_task, T.compute_task, T.store_task = read_task, compute_task, store_task
    T.open_output, T.write_manifest = open_output, write_manifest


_SPEC = os.environ.get("ZNNI_FAULT")
if _SPEC and __name__ == "sitecustomize":
    import importlib.abc
    import importlib.util

    class _Patcher(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "znni_core.pipeline.task":
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                for one in _SPEC.split(","):  # several faults: "sleep-once:5:80,hog:2:1200"
                    patch_task_module(module, one)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _Patcher())
