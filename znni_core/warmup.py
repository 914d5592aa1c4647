"""``znni warmup``: ready a host for jobs in about half a minute, then refine on demand.

A first warmup (the default, *quick*):

1. **Compile** every numba kernel a chain network's run uses, for the vector width in effect (the
   one measured on this host, else the default), into numba's cache (``$NUMBA_CACHE_DIR``, else
   ``<cache_dir>/numba``: where the workflow's jobs look): two child processes at once, each a
   disjoint group of kernel families (:data:`COMPILE_GROUPS`; numba compiles on one core).  A
   U-Net's own kernels (the residual add and affine epilogues, upsampling, depth-first pooling's
   gathers: about 10 s on one core) compile in its first job.
2. **Calibrate** the time model for each thread count asked for, ``quick``
   (:data:`.plan.timing.LEVELS`: kernel parameters at their defaults, each rate timed once).
   Its process starts with the compiles and meanwhile imports, loads pyFFTW and readies numba's
   code generator (``--after``: it waits for a line), so the calibration itself times kernels only;
   at one thread it times the first group's kernels once that group is done, the rest once both are.

``znni warmup --refine`` (on demand, about a minute on 2 cores) measures what the quick one
takes as given: on an AVX-512 host the **vector width** (:data:`WIDTH_CASES` compiled and timed
both ways, the faster kept, within :data:`WIDTH_TIE` the default), then a ``full`` calibration
(kernel parameters tuned on the host, rates the best of five) replaces the quick one.

Everything lands in ``$ZNNI_CACHE_DIR`` (default ``~/.cache/znni``): on a cluster, point it at a
shared directory and run ``znni warmup`` once per node type (``docs/performance.md``); a first
job that finds nothing there compiles what it runs and calibrates quickly itself.

The driver never compiles anything itself: each step runs in a child process
(``python -m znni_core.warmup --child ...``), so a step's vector width is the one it was given.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import infer
from .cachedir import cache_dir, numba_cache_dir
from .errors import ZnniError
from .net.chain import Activation, Conv, Pool
from .net.graph import Network

__all__ = ["WIDTH_CASES", "warmup"]

#: the kernels the vector width is timed on, a few to a few tens of milliseconds each: the width
#: is chosen on their sum, and Winograd's layers (wide planes and MPF fragments) carry about half
#: of it, as they carry most of a 2D net's or a U-Net's time; then the direct loop of first layers
#: and of MPF fragments, the 1x1x1 register tiles, max-pooling fragments and ELU
WIDTH_CASES = (
    "winograd (1,3,3) 48 maps, 12 x 160^2",
    "winograd (1,3,3) 48 maps, 256 x 4 x 13^2 fragments",
    "winograd 3^3 24 maps, 18 x 40^2",
    "direct 1 -> 48 (1,4,4), 12 x 128^2",
    "direct 24 -> 24 3^3, 64 x 8^3 fragments",
    "1x1x1 chain 48 maps x 4, 16 x 64^2",
    "max-pooling fragments 2^3, 16 x 48^3",
    "elu, 2^22 values",
)


def _width_workload(threads: int, ready=None) -> dict:
    """Best-of-5 seconds of each :data:`WIDTH_CASES` kernel (in a child process); ``ready()`` is
    called once every kernel is compiled, before any is timed."""
    # lazy: loads numba and scipy only when called
    from . import layers as L
    from .layers.threads import run_threads
    from .plan.timing import _best_of

    rng = np.random.default_rng(0)

    def x_of(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def winograd(c, n, spatial, kernel):
        conv = L.WinogradConv(x_of(c, c, *kernel), x_of(c), spatial, threads=threads).configured(
            channels_last=True, keep_buffers=True
        )
        x = x_of(n, *spatial, c).transpose(0, 4, 1, 2, 3)  # channels last, as between Winograd layers
        return lambda: conv(x)

    x1, w1 = x_of(1, 1, 12, 131, 131), x_of(48, 1, 1, 4, 4)
    x2, w2 = x_of(64, 24, 10, 10, 10), x_of(24, 24, 3, 3, 3)
    xp = x_of(1, 48, 16, 64, 64)
    stages = [(x_of(48, 48, 1, 1, 1), x_of(48), ("relu", 0.0))] * 4
    xm = x_of(1, 16, 48, 48, 48)
    big = x_of(2**22)
    calls = (
        winograd(48, 1, (12, 160, 160), (1, 3, 3)),
        winograd(48, 256, (4, 13, 13), (1, 3, 3)),
        winograd(24, 1, (18, 40, 40), (3, 3, 3)),
        lambda: L.conv_direct_numba(x1, w1),
        lambda: L.conv_direct_numba(x2, w2),
        lambda: L.conv_pointwise_chain(xp, stages, threads=threads),
        lambda: L.mpf(xm, (2, 2, 2)),
        lambda: L.apply_activation(big, "elu", 1.0, out=big),
    )
    # lazy: loads numba and scipy only when called
    from .layers._numba import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    with L.arena.using(L.arena.Arena(1 << 30)), run_threads(threads):
        for fn in calls:  # compile (the other width's child compiles beside this one) ...
            fn()
        if ready is not None:
            ready()  # ... then time only when the driver says so: the other child waits meanwhile
        return {name: _best_of(fn) for name, fn in zip(WIDTH_CASES, calls)}


#: the kernel families each compile child runs (:func:`_compile_group`), about half the compile
#: time each (a 2-core Xeon, the two at once: 20 and 22 s; 24 and 29 s while the pooling kernels
#: were parallel numba loops and the FFTs in the second; later 12 and 14 s): Winograd's input
#: transform, the 1x1x1 chains, activations, max-pooling fragments, plain pooling and the max
#: filter, copies, the FFTs and FFT-GEMM (a one-thread calibration times the chains, FFTs,
#: activations and pooling while the second group compiles); Winograd's output transform and
#: products, the direct loops.  No numba function is compiled by both (a function's cache index
#: is written under a lock, ``layers/_numba.py``, but two compilations of one function would only
#: waste a core): Winograd's two transforms, one numba function each, are compiled one in each
#: child (the other, and the products in the first, replaced by no-ops there).
COMPILE_GROUPS = ("winograd-in", "winograd-out")


def _winograd_calls(x_of, skip) -> None:
    """Winograd layers as runs call them (kernels (1,3,3) and 3^3; register tiles and BLAS;
    channels first and last in and out; a fused ELU), with the functions ``skip`` (``(module,
    name)`` pairs: a transform, the products) no-ops: only the others compile here."""
    # lazy: loads numba and scipy only when called
    from . import layers as L

    real = [(m, name, getattr(m, name)) for m, name in skip]
    for m, name, _ in real:
        setattr(m, name, lambda *a: None)
    try:
        for c, n, spatial, kernel in ((8, 1, (2, 12, 12), (1, 3, 3)), (8, 2, (4, 8, 8), (3, 3, 3))):
            w, b = x_of(c, c, *kernel), x_of(c)
            x_first = x_of(n, c, *spatial)
            x_last = x_of(n, *spatial, c).transpose(0, 4, 1, 2, 3)
            for blas in (0, 1):  # the register tiles and BLAS' products
                with L.tuning.using({"winograd.blas": blas}):
                    L.WinogradConv(w, b, spatial, threads=1)(x_first)
                    # the epilogue is a value (code, alpha): one activation compiles them all
                    conv = L.WinogradConv(w, b, spatial, threads=1).configured(
                        act=("elu", 1.0), channels_last=True, keep_buffers=True
                    )
                    conv(x_last)
                    conv(x_first)
    finally:
        for m, name, f in real:
            setattr(m, name, f)


def _compile_group(group: str) -> dict:
    """Run one group of kernels once on small inputs (numba compiles each for the types a run
    passes: layouts and dtypes, not sizes); returns ``{"functions": N compiled here, "s": seconds}``."""
    # lazy: loads numba and scipy only when called
    from . import layers as L
    from .inference import _non_finite
    from .layers.layout import copy_into
    from .layers.threads import run_threads

    rng = np.random.default_rng(0)

    def x_of(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    t0 = time.perf_counter()
    with _compile_count() as compiled, L.arena.using(L.arena.Arena(1 << 28)), run_threads(1):
        if group == "winograd-in":
            _winograd_calls(x_of, [(L.winograd, "_output_transform"), (L.microkernel, "batched_products")])
            stages = [(x_of(8, 8, 1, 1, 1), x_of(8), ("relu", 0.0))] * 2
            L.conv_pointwise_chain(x_of(1, 8, 2, 8, 8), stages, threads=1)
            L.conv_pointwise_chain(x_of(1, 8, 2, 8, 8), [(s[0], None, None) for s in stages], threads=1)
            for act in ("relu", "elu", "sigmoid", "tanh"):
                big = x_of(4096)
                L.apply_activation(big, act, 1.0, out=big)
            _non_finite(big.view(np.uint32))  # the input's check before a run
            xm = x_of(1, 4, 8, 8, 8)
            L.mpf(xm, (2, 2, 2))
            L.mpf(np.ascontiguousarray(xm.transpose(0, 2, 3, 4, 1)).transpose(0, 4, 1, 2, 3), (2, 2, 2))
            L.max_pool(xm, (2, 2, 2))
            L.max_filter_inplace(x_of(1, 4, 8, 8, 8), (2, 2, 2))
            copy_into(np.empty((1, 4, 4, 4, 4), np.float32), xm[:, :, ::2, ::2, ::2])
            w = x_of(4, 4, 3, 3, 3)
            for mode in L.fft.MODES:
                L.FFTConv(w, None, (8, 8, 8), threads=1, mode=mode)(x_of(2, 4, 8, 8, 8))
            L.FFTGemmConv(x_of(4, 4, 1, 3, 3), None, (2, 8, 8), threads=1).configured(keep_buffers=True)(
                x_of(2, 4, 2, 8, 8)
            )
        elif group == "winograd-out":
            _winograd_calls(x_of, [(L.winograd, "_input_transform")])
            conv = L.WinogradConv(x_of(8, 8, 1, 3, 3), None, (2, 12, 12), threads=1)
            V0, M0, _ = conv._buffers(1, False)[1][0]
            L.microkernel.batched_products(
                np.ones_like(V0),
                conv.U,
                np.empty_like(M0),
                V0.shape[1],
                8,
                L.microkernel.Scratch(8, 8, conv.register_tile),
            )
            # direct-numba's register tiles (rows of a tile or more: one signature, both layouts)
            L.conv_direct_numba(x_of(1, 2, 1, 3, L.direct.TILE_WIDTH + 2), x_of(5, 2, 1, 3, 3))
            for x, w in ((x_of(1, 1, 6, 12, 12), x_of(8, 1, 1, 4, 4)), (x_of(2, 8, 6, 6, 6), x_of(8, 8, 3, 3, 3))):
                L.conv_direct_numba(x, w)
                L.conv_direct_numba(x, w, x_of(8), act=("relu", 0.0))
                L.conv_direct_numba(x, w, x_of(8), act=("relu", 0.0), channels_last=True)
                L.conv_direct_gemm(x, w)
                L.conv_direct_gemm(x, w, x_of(8), act=("relu", 0.0))
        else:
            raise ValueError(f"compile group {group!r}: one of {', '.join(COMPILE_GROUPS)}")
    return {"functions": compiled(), "s": round(time.perf_counter() - t0, 2)}


class _compile_count:
    """A context counting znni's numba functions this process compiles (not loads from the
    cache) inside it: ``with _compile_count() as n: ...; n()``."""

    def __enter__(self):
        # lazy: loads numba only when called
        from numba.core import event

        self._listener = event.RecordingListener()
        event.register("numba:compile", self._listener)
        return self.count

    def __exit__(self, *exc):
        # lazy: loads numba only when called
        from numba.core import event

        event.unregister("numba:compile", self._listener)

    def count(self) -> int:
        # the event also wraps loads from the cache: count the functions whose dispatcher missed it
        seen = {}
        for _, e in self._listener.buffer:
            d = e.data.get("dispatcher")
            if d is not None and not e.is_start:
                seen[id(d)] = d
        return sum(
            sum(d.stats.cache_misses.values()) > 0
            for d in seen.values()
            if hasattr(d, "stats") and d.py_func.__module__.startswith("znni_core")
        )


def _warmup_networks(rng) -> tuple:
    """``((network, input shape), ...)``: a 2D chain with two max-poolings and a 3^3 one with one,
    small enough to run through every primitive in a fraction of a second; the 2D chain's rows are
    long enough for direct-numba's register tiles in its first layer (81 values) and short after
    pooling (its grouped rows)."""

    def net(kernels, pools, width=8):
        layers, c = [], 1
        for i, k in enumerate(kernels):
            c_out = 1 if i == len(kernels) - 1 else width
            layers += [
                Conv(
                    rng.standard_normal((c_out, c) + k, dtype=np.float32) * 0.1,
                    rng.standard_normal(c_out, dtype=np.float32) * 0.1,
                    name=f"c{i}",
                )
            ]
            layers += [Activation("sigmoid" if i == len(kernels) - 1 else "relu", name=f"a{i}")]
            if i < len(pools):
                layers += [Pool(pools[i], name=f"p{i}")]
            c = c_out
        return Network(tuple(layers), name="warmup")

    return (
        (net([(1, 4, 4), (1, 5, 5), (1, 3, 3), (1, 1, 1)], [(1, 2, 2), (1, 2, 2)]), (6, 60, 84)),
        (net([(3, 3, 3), (3, 3, 3), (3, 3, 3), (1, 1, 1)], [(2, 2, 2)]), (24, 24, 24)),
    )


def _calibrate(threads_list, level: str = "quick", between=None) -> dict:
    """Calibrate for each thread count at ``level`` (in a child process, after the first compile
    group): ``compiled`` counts what the calibration compiled that the compile groups did not
    (none: ``tests/test_vector_width.py``).  ``between()`` returns once every group has compiled:
    a quick one-thread calibration first calls it halfway (``plan.timing._measure``: the first
    group's kernels timed on one core while the other still compiles), any other before it
    starts; a call after the first returns at once."""
    # lazy: loads numba and scipy only when called
    from .plan.timing import calibrate

    out, tuned, waited = {}, None, 0.0

    def wait():  # between(), its seconds kept apart from the calibration's
        nonlocal waited
        if between is not None:
            t = time.perf_counter()
            between()
            waited += time.perf_counter() - t

    for i, threads in enumerate(threads_list):
        # halfway only for one thread at the quick level: a full one tunes Winograd's blocks first
        halfway = i == 0 and int(threads) == 1 and level == "quick"
        if not halfway:
            wait()
        t0, w0 = time.perf_counter(), waited
        # the kernel parameters are timed once, at the first thread count: they size blocks to one
        # core's caches, and each worker runs its own blocks whatever the count
        with _compile_count() as compiled:
            cal = calibrate(int(threads), tuned=tuned, level=level, between=wait if halfway else None)
        wait()  # (a calibration found in the cache measured nothing)
        tuned = cal.tuned
        seconds = time.perf_counter() - t0 - (waited - w0)
        out[str(threads)] = {"level": cal.level, "calibrate_s": seconds, "compiled": compiled()}
    return out


def _run_networks(threads: int = 1) -> dict:
    """Run small chain networks as jobs run them, through each conv primitive and pooling mode:
    ``compiled`` counts the kernels they compiled (none after a warmup: the compile groups cover
    what chains run; the warmup itself no longer runs them, 1 s of a first one)."""
    # lazy: loads numba and scipy only when called
    from .plan import autotune

    rng = np.random.default_rng(0)
    # each conv primitive (with direct-numba where it cannot run a layer), MPF and plain pooling
    prim_sets = (
        ("winograd", "direct-numba"),
        ("fft-gemm", "direct-numba"),
        ("fft-data", "direct-gemm"),
        ("fft-task", "direct-numba"),
        ("fft-stream", "direct-numba"),
        ("direct-numba",),
    )
    runs = 0
    with _compile_count() as compiled:
        for n, shape in _warmup_networks(rng):
            x = rng.random((1,) + shape, dtype=np.float32)
            for prims in prim_sets:
                for modes in (None, ("mpf",) + ("pool",) * (len(n.pools) - 1)):
                    try:
                        plan = autotune(
                            n,
                            memory_budget=2**30,
                            threads=int(threads),
                            primitives=prims,
                            pool_modes=modes,
                            input_shape=shape,
                            use_cache=False,
                        )
                    except ZnniError:
                        continue  # a combination this network cannot run
                    infer(n, x, plan=plan)
                    runs += 1
    return {"runs": runs, "compiled": compiled()}


#: the other width replaces the default only when faster by more than this: the two sums came
#: within 1-4% of each other on a Zen 4 host, either way from one run to the next, while its
#: Winograd layers ran 1.2-1.5x slower in 256-bit code (``python -m benchmarks.isa``)
WIDTH_TIE = 0.05


def choose_width(seconds: dict) -> str:
    """The width of the least time, unless the default's is within :data:`WIDTH_TIE` of it."""
    # lazy: loads numba and scipy only when called
    from .layers import vector_width as vw

    fastest = min(seconds, key=seconds.get)
    return (
        vw.DEFAULT if vw.DEFAULT in seconds and seconds[vw.DEFAULT] <= (1 + WIDTH_TIE) * seconds[fastest] else fastest
    )


def _width_children(widths, threads: int, base: dict, timeout: float = 1800) -> dict:
    """``{width: {case: seconds}}``: one child per width, all compiling at once (numba compiles on
    one core: two children on two cores take the time of one), then timed one after the other while
    the rest wait, so no child's timing shares the cores with another's compilation.  The width in
    effect compiles into the shared cache, the others into throw-away ones.  A child's stderr goes
    to a file (a full pipe would stop it); a child that fails or passes ``timeout`` seconds stops
    the warmup with its stderr."""
    # lazy: loads numba and scipy only when called
    from .layers import vector_width as vw

    entry = vw.chosen()
    base_width = entry["width"] if entry else vw.DEFAULT

    args = ["width", str(threads)]
    with tempfile.TemporaryDirectory(prefix="znni-warmup-") as tmp:
        procs, errs = {}, {}
        try:
            for w in widths:
                errs[w] = open(os.path.join(tmp, f"{w}.err"), "w+")  # noqa: SIM115 - closed below
                env = dict(base, ZNNI_VECTOR_WIDTH=w)
                if w != base_width:  # compiled for the timing only: a width chosen compiles in the shared cache next
                    env["NUMBA_CACHE_DIR"] = os.path.join(tmp, f"numba-{w}")
                procs[w] = subprocess.Popen(
                    [sys.executable, "-m", "znni_core.warmup", "--child", *args],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errs[w],
                    text=True,
                )
            deadline = time.monotonic() + timeout
            for w, p in procs.items():  # every child compiled
                if _line(p, deadline) != "compiled":
                    _failed(args, p, errs[w])
            out = {}
            for w, p in procs.items():
                p.stdin.write("time\n")
                p.stdin.flush()
                line = _line(p, deadline)
                if not line or p.wait(max(1.0, deadline - time.monotonic())) != 0:
                    _failed(args, p, errs[w])
                out[w] = json.loads(line)
            return out
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
            for f in errs.values():
                f.close()


def _line(p, deadline: float) -> str:
    """The child's next line on stdout that is a protocol line ("compiled" or JSON), skipping any
    other output; "" at its end or past ``deadline`` (then it is killed)."""
    with selectors.DefaultSelector() as sel:
        sel.register(p.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                p.kill()
                return ""
            line = p.stdout.readline()
            if not line:
                return ""
            line = line.strip()
            if line == "compiled" or line.startswith("{"):
                return line


def _failed(args, p, err):
    if p.poll() is None:
        p.kill()
    code = p.wait()
    err.seek(0)
    raise RuntimeError(f"znni warmup: the step {' '.join(args)} failed (exit {code}):\n" + err.read()[-3000:])


def _children(steps, env, timeout: float = 1800, then=None) -> list:
    """Run ``python -m znni_core.warmup --child STEP ARG`` for each of ``steps`` at once and return
    what each printed (JSON); one that fails or passes ``timeout`` seconds stops the warmup with
    its stderr (kept in a file: a full pipe would stop it).  ``then``: one more step, started
    with the others so that its imports overlap their work (``--after``), told on its standard
    input as each of them ends (a line ``done I``; ``all`` for the last): the calibration starts
    after the first compile group and waits for ``all`` halfway; its output is last."""
    with tempfile.TemporaryDirectory(prefix="znni-warmup-") as tmp:
        procs = []
        try:
            for i, args in enumerate(list(steps) + ([then] if then else [])):
                err = open(os.path.join(tmp, f"{i}.err"), "w+")  # noqa: SIM115 - closed below
                last = then is not None and i == len(steps)
                p = subprocess.Popen(
                    [sys.executable, "-m", "znni_core.warmup", "--child", *args] + (["--after"] if last else []),
                    env=env,
                    stdin=subprocess.PIPE if last else None,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
                procs.append((args, p, err))
            deadline = time.monotonic() + timeout
            out, last = [], procs[-1][1]
            for i, (args, p, err) in enumerate(procs):
                line = _line(p, deadline)
                if not line or p.wait(max(1.0, deadline - time.monotonic())) != 0:
                    _failed(args, p, err)
                out.append(json.loads(line))
                if then is not None and i < len(steps):  # step i is done: tell the last one
                    last.stdin.write("all\n" if i == len(steps) - 1 else f"done {i}\n")
                    last.stdin.flush()
            return out
        finally:
            for _, p, err in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                err.close()


def warmup(threads=(1,), *, tune: bool = True, refresh: bool = False, refine: bool = False, echo=print) -> dict:
    """Compile every kernel for the vector width in effect (two processes at once) and calibrate
    for each of ``threads``: quickly, or with ``refine`` (or ``refresh``) the vector width measured
    first (AVX-512 hosts; unless recorded already, or ``refresh``; not with ``tune`` False) and
    a full calibration.  Returns what it did."""
    # lazy: loads numba and scipy only when called
    from .layers import vector_width as vw
    from .layers._numba import VECTOR_WIDTH_SOURCE

    refine = refine or refresh
    base = dict(os.environ, NUMBA_CACHE_DIR=str(numba_cache_dir()), ZNNI_CACHE_DIR=str(cache_dir()))
    base.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
    report = {"cache_dir": base["ZNNI_CACHE_DIR"], "numba_cache_dir": base["NUMBA_CACHE_DIR"]}
    widths = vw.candidates() if VECTOR_WIDTH_SOURCE in ("default", "measured") else ()
    t0 = time.perf_counter()
    if refine and tune and widths and (refresh or vw.chosen() is None):
        t = max(int(x) for x in threads)
        names = " and ".join(w + "-bit" for w in widths)
        echo(f"vector width {names}: compiling znni's kernels side by side, then timing each ({t} threads) ...")
        cases = _width_children(widths, t, base)
        seconds = {w: sum(c.values()) for w, c in cases.items()}
        best = choose_width(seconds)
        vw.record(best, seconds, {"threads": t, "cases": cases})
        echo("vector width: " + ", ".join(f"{w}-bit {s:.3f} s" for w, s in seconds.items()) + f" -> {best}-bit")
        report["vector_width"] = {"chosen": best, "seconds": seconds, "cases": cases}
    elif widths:
        entry = vw.chosen()
        report["vector_width"] = {"chosen": entry["width"] if entry else vw.DEFAULT, "measured": entry is not None}
    report["tune_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    level = "full" if refine else "quick"
    echo(
        f"compiling znni's kernels ({len(COMPILE_GROUPS)} processes), then calibrating ({level}) for "
        f"{', '.join(str(x) for x in threads)} thread(s) ..."
    )
    arg = level + ":" + ",".join(str(int(x)) for x in threads)
    # the calibration's process starts beside the compiles (its imports, about a second, overlap
    # them) and measures once they end
    *groups, report["calibration"] = _children([["compile", g] for g in COMPILE_GROUPS], base, then=["calibrate", arg])
    report["compiled"] = dict(zip(COMPILE_GROUPS, groups))
    report["compile_s"] = report["calibration"].pop("_waited_s", 0.0)
    report["calibrate_s"] = time.perf_counter() - t1 - report["compile_s"]
    total = time.perf_counter() - t0
    echo(f"warm: kernels in {base['NUMBA_CACHE_DIR']}, calibration in {base['ZNNI_CACHE_DIR']} ({total:.0f} s)")
    stray = sum(c.get("compiled", 0) for c in report["calibration"].values() if isinstance(c, dict))
    if stray:  # a kernel no compile group runs, or one the calibration timed before its group ended
        echo(f"note: the calibration compiled {stray} kernel(s) itself, which a compile group should have")
    if not refine:
        echo(
            "refine when there is a minute to spare: `znni warmup --refine` "
            + ("measures the vector width and " if widths and vw.chosen() is None else "")
            + "tunes the kernel parameters with a full calibration"
        )
    return report


def _ready_to_time() -> None:
    """What a calibration would otherwise pay inside its first timed calls, done while the compiles
    run: importing pyFFTW (and the dask it imports) and scipy's FFT, numba's first compilation in
    the process (its code generator's set-up), the calibration's input values (1.5-2 s of a quick
    calibration on a 2-core Xeon)."""
    # lazy: loads pyFFTW and scipy only when called
    import pyfftw  # noqa: F401
    import scipy.fft  # noqa: F401

    # lazy: loads numba only when called
    from .layers._numba import njit
    from .plan.timing import _noise

    njit(lambda a: a + 1)(1.0)  # not cached: compiles here, loads nothing of znni's
    _noise(1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m znni_core.warmup")
    p.add_argument("--child", nargs=2, metavar=("STEP", "ARG"), required=True)
    p.add_argument("--after", action="store_true", help="import, then wait for a line on stdin (and for `all` halfway)")
    a = p.parse_args(argv)
    step, arg = a.child
    waited, between = None, None
    if a.after:
        t0 = time.perf_counter()
        # lazy: loads numba and scipy only when called
        from .plan import autotune  # noqa: F401
        from .plan.timing import calibrate  # noqa: F401

        _ready_to_time()
        first = sys.stdin.readline().strip()
        waited = time.perf_counter() - t0

        def between():
            """Wait until the driver says every step before this one is done (at once after that)."""
            nonlocal waited, first
            t = time.perf_counter()
            while first not in ("all", ""):
                first = sys.stdin.readline().strip()
            waited += time.perf_counter() - t

    if step == "width":  # "compiled" once compiled; times when the driver writes a line

        def ready():
            print("compiled", flush=True)
            sys.stdin.readline()

        got = _width_workload(int(arg), ready)
    elif step == "compile":
        got = _compile_group(arg)
    elif step == "calibrate":  # LEVEL:THREADS,THREADS...
        level, _, counts = arg.partition(":")
        got = _calibrate([int(x) for x in counts.split(",")], level, between)
    else:
        p.error(f"unknown step {step!r}")
    if waited is not None:
        got["_waited_s"] = waited
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
