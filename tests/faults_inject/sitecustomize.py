"""Test-only crash injection for znni jobs (never installed; tests put this directory on PYTHONPATH).

``ZNNI_FAULT=point[:task[:arg]]`` (see tests/faults_helpers.py) patches
``znni_core.pipeline.task`` right after it is imported, so a ``znni run-task`` started by Snakemake
(locally or through SLURM) kills itself with SIGKILL, or fails, at a chosen point.
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


def _die():
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def patch_task_module(T, spec):
    """Wrap the task's stages (read_task, compute_task, store_task: a job overlaps them across
    its tasks, so every fault is keyed by the task it concerns, never by "the current task")."""
    point, task, arg = _parse(spec)
    state = {"chunks": 0, "storing": None}
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
            _die()
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
        state["storing"], state["chunks"] = ti.task_id, 0
        try:
            return orig_store(ctx, ti, *a, **kw)
        finally:
            state["storing"] = None

    def open_output(*a, **k):
        out = orig_open(*a, **k)  # opened once per job (open_run), before its tasks run
        if point in ("after-chunk", "after-chunk-once"):
            write = out.write_chunk

            def write_chunk(*wa, **wk):
                r = write(*wa, **wk)
                if state["storing"] is not None and hit(state["storing"]):
                    state["chunks"] += 1
                    if state["chunks"] >= arg:
                        if point == "after-chunk-once":  # the first attempt only; the marker proves where
                            marker = os.path.join(os.environ.get("ZNNI_FAULT_DIR", "/tmp"), f"killed-{task}")
                            if os.path.exists(marker):
                                return r
                            with open(marker, "w") as f:
                                f.write(f"task {state['storing']} after chunk {state['chunks']} of its chunks\n")
                        _die()
                return r

            out.write_chunk = write_chunk
        return out

    def write_manifest(path, doc, *a, **k):
        if point == "before-manifest" and hit(doc.get("task", state["storing"])):
            _die()
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
