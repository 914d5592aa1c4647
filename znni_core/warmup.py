"""``znni warmup``: make a host ready before its first job, as FFTW's planner and oneDNN's
dispatcher do: measure, choose, compile and cache.

1. **Vector width** (AVX-512 hosts only, :mod:`znni_core.layers.vector_width`): znni's kernels
   are compiled for 512-bit and for 256-bit vectors, each in a process of its own (numba fixes its
   target per process), side by side (numba compiles on one core), then timed one process at a
   time; the faster is recorded for this host, the default unless the other wins by
   :data:`WIDTH_TIE`.
2. **Compile**: every numba kernel a run uses is compiled for the chosen width into numba's
   cache (``$NUMBA_CACHE_DIR``, else ``<cache_dir>/numba``: where the workflow's jobs look).
3. **Calibrate** the time model for each thread count asked for (``<cache_dir>/calibration.json``).

Everything lands in ``$ZNNI_CACHE_DIR`` (default ``~/.cache/znni``): on a cluster, point it at a
shared directory and run ``znni warmup`` once per node type (``docs/performance.md``); a first
job that finds nothing there compiles and calibrates itself (about a minute on 2 cores).

The driver never compiles anything itself: each step runs in a child process
(``python -m znni_core.warmup --child ...``), so a step's vector width is the one it was given.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from .cachedir import cache_dir, numba_cache_dir

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
    import numpy as np

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
    from .layers._numba import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    with L.arena.using(L.arena.Arena(1 << 30)), run_threads(threads):
        for fn in calls:  # compile (the other width's child compiles beside this one) ...
            fn()
        if ready is not None:
            ready()  # ... then time only when the driver says so: the other child waits meanwhile
        return {name: _best_of(fn) for name, fn in zip(WIDTH_CASES, calls)}


def _compile_and_calibrate(threads_list) -> dict:
    """Compile what a run uses (the calibration's kernels, then small chain networks run as the
    executor runs them) and calibrate for each thread count (in a child process)."""
    import numpy as np

    from . import infer
    from .errors import ZnniError
    from .net.chain import Activation, Conv, Pool
    from .net.graph import Network
    from .plan import autotune
    from .plan.timing import calibrate

    out = {}
    rng = np.random.default_rng(0)

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

    nets = (
        (net([(1, 4, 4), (1, 5, 5), (1, 3, 3), (1, 1, 1)], [(1, 2, 2), (1, 2, 2)]), (6, 60, 60)),
        (net([(3, 3, 3), (3, 3, 3), (3, 3, 3), (1, 1, 1)], [(2, 2, 2)]), (24, 24, 24)),
    )
    # each conv primitive (with direct-numba where it cannot run a layer), MPF and plain pooling
    prim_sets = (
        ("winograd", "direct-numba"),
        ("fft-gemm", "direct-numba"),
        ("fft-data", "direct-gemm"),
        ("fft-task", "direct-numba"),
        ("fft-stream", "direct-numba"),
        ("direct-numba",),
    )
    tuned = None
    for threads in threads_list:
        t0 = time.perf_counter()
        # the kernel parameters are timed once, at the first thread count: they size blocks to one
        # core's caches, and each worker runs its own blocks whatever the count
        tuned = calibrate(int(threads), tuned=tuned).tuned
        t1 = time.perf_counter()
        runs = 0
        for n, shape in nets:
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
        out[str(threads)] = {"calibrate_s": t1 - t0, "networks_s": time.perf_counter() - t1, "runs": runs}
    return out


#: the other width replaces the default only when faster by more than this: the two sums came
#: within 1-4% of each other on a Zen 4 host, either way from one run to the next, while its
#: Winograd layers ran 1.2-1.5x slower in 256-bit code (``python -m benchmarks.isa``)
WIDTH_TIE = 0.05


def choose_width(seconds: dict) -> str:
    """The width of the least time, unless the default's is within :data:`WIDTH_TIE` of it."""
    from .layers import vector_width as vw

    fastest = min(seconds, key=seconds.get)
    return (
        vw.DEFAULT if vw.DEFAULT in seconds and seconds[vw.DEFAULT] <= (1 + WIDTH_TIE) * seconds[fastest] else fastest
    )


def _width_children(widths, threads: int, base: dict, timeout: float = 1800) -> dict:
    """``{width: {case: seconds}}``: one child per width, all compiling at once (numba compiles on
    one core: two children on two cores take the time of one), then timed one after the other while
    the rest wait, so no child's timing shares the cores with another's compilation.  A child's
    stderr goes to a file (a full pipe would stop it); a child that fails or passes ``timeout``
    seconds stops the warmup with its stderr."""
    import tempfile

    args = ["width", str(threads)]
    with tempfile.TemporaryDirectory(prefix="znni-warmup-") as tmp:
        procs, errs = {}, {}
        try:
            for w in widths:
                errs[w] = open(os.path.join(tmp, f"{w}.err"), "w+")  # noqa: SIM115 - closed below
                procs[w] = subprocess.Popen(
                    [sys.executable, "-m", "znni_core.warmup", "--child", *args],
                    env=dict(base, ZNNI_VECTOR_WIDTH=w),
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
    import selectors

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


def _child(args, env) -> dict:
    """Run ``python -m znni_core.warmup --child ...`` and return what it printed (JSON)."""
    r = subprocess.run(
        [sys.executable, "-m", "znni_core.warmup", "--child", *args], env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise RuntimeError(f"znni warmup: the step {' '.join(args)} failed (exit {r.returncode}):\n" + r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def warmup(threads=(1,), *, tune: bool = True, refresh: bool = False, echo=print) -> dict:
    """Measure the vector width (AVX-512 hosts; unless recorded already, or ``refresh``), compile
    every kernel for the chosen one, calibrate for each of ``threads``.  Returns what it did."""
    from .layers import vector_width as vw
    from .layers._numba import VECTOR_WIDTH_SOURCE

    base = dict(os.environ, NUMBA_CACHE_DIR=str(numba_cache_dir()), ZNNI_CACHE_DIR=str(cache_dir()))
    base.setdefault("NUMBA_THREADING_LAYER", "threadsafe")
    report = {"cache_dir": base["ZNNI_CACHE_DIR"], "numba_cache_dir": base["NUMBA_CACHE_DIR"]}
    widths = vw.candidates() if VECTOR_WIDTH_SOURCE in ("default", "measured") else ()
    t0 = time.perf_counter()
    if tune and widths and (refresh or vw.chosen() is None):
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
    echo(f"compiling and calibrating for {', '.join(str(x) for x in threads)} thread(s) ...")
    report["calibration"] = _child(["compile", ",".join(str(int(x)) for x in threads)], base)
    report["compile_calibrate_s"] = time.perf_counter() - t1
    echo(
        f"warm: kernels in {base['NUMBA_CACHE_DIR']}, calibration in {base['ZNNI_CACHE_DIR']} "
        f"({report['tune_s'] + report['compile_calibrate_s']:.0f} s)"
    )
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m znni_core.warmup")
    p.add_argument("--child", nargs=2, metavar=("STEP", "ARG"), required=True)
    a = p.parse_args(argv)
    step, arg = a.child
    if step == "width":  # "compiled" once compiled; times when the driver writes a line

        def ready():
            print("compiled", flush=True)
            sys.stdin.readline()

        got = _width_workload(int(arg), ready)
    elif step == "compile":
        got = _compile_and_calibrate([int(x) for x in arg.split(",")])
    else:
        p.error(f"unknown step {step!r}")
    print(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
