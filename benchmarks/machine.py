"""What machine, what libraries, what BLAS kernel, and how fast its float32 GEMM is."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from znni_core.plan.wisdom import cpu_model  # noqa: F401  (one definition, shared with the planner)


def cpu_flags() -> set:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def blas_info() -> list[dict]:
    from threadpoolctl import threadpool_info

    keep = ("user_api", "internal_api", "version", "architecture", "num_threads", "threading_layer", "prefix")
    return [{k: i.get(k) for k in keep} for i in threadpool_info()]


def gemm_flops(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 GEMM rate of numpy (its BLAS, current thread limits) in FLOP/s."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def gemm_flops_with_coretype(coretype: str | None, n: int = 2048) -> float | None:
    """The same measurement in a fresh interpreter with ``OPENBLAS_CORETYPE`` set (or unset)."""
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    code = f"from benchmarks.machine import gemm_flops; print(gemm_flops({n}))"
    try:
        r = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        return float(r.stdout.strip().splitlines()[-1])
    except Exception:
        return None


_FMA_ENGINES = []  # the compiled loops, kept alive while their functions may run


def _fma_loop_ir(lanes: int, acc: int = 24) -> str:
    """LLVM IR of ``f(n, p)``: ``acc`` independent chains of ``n`` multiply-adds on ``lanes``-float
    vectors held in registers, their sum stored to ``p`` (so none is dropped as unused)."""
    v = f"<{lanes} x float>"
    body = ["define void @f(i64 %n, ptr %p) {", "entry:", f"  %x = load {v}, ptr %p, align 4", "  br label %loop"]
    body += ["loop:", "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    body += [f"  %a{k} = phi {v} [%x, %entry], [%b{k}, %loop]" for k in range(acc)]
    body += [f"  %b{k} = call {v} @llvm.fma.v{lanes}f32({v} %a{k}, {v} %x, {v} %x)" for k in range(acc)]
    body += ["  %i1 = add i64 %i, 1", "  %c = icmp ult i64 %i1, %n", "  br i1 %c, label %loop, label %exit", "exit:"]
    total = "%b0"
    for k in range(1, acc):
        body.append(f"  %s{k} = fadd {v} {total}, %b{k}")
        total = f"%s{k}"
    body += [f"  store {v} {total}, ptr %p, align 4", "  ret void", "}"]
    body.append(f"declare {v} @llvm.fma.v{lanes}f32({v}, {v}, {v})")
    return "\n".join(body)


def fma_peak(bits: int, iterations: int = 4_000_000, repeats: int = 5) -> float | None:
    """One core's peak float32 rate (FLOP/s) of ``bits``-wide multiply-adds (256 or 512): the best of
    ``repeats`` runs of 24 independent chains of ``llvm.fma`` on registers, compiled by llvmlite for
    this host's CPU (whatever ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` a build sets: the
    hardware's roof, not the build's).  None for 512 bits without AVX-512.  The two differ by host:
    a core with two 512-bit FMA units (Intel server cores) peaks twice as high in 512-bit code as
    in 256-bit code, so no AVX2 build of a compute-bound kernel comes within 10% of its AVX-512
    build there; Zen 4 runs AVX-512 on 256-bit units, and its two peaks are equal."""
    import ctypes

    import llvmlite.binding as llvm

    if bits == 512 and "avx512f" not in cpu_flags():
        return None
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=2
    )
    lanes = bits // 32
    mod = llvm.parse_assembly(_fma_loop_ir(lanes))
    mod.verify()
    engine = llvm.create_mcjit_compiler(mod, machine)
    engine.finalize_object()
    _FMA_ENGINES.append(engine)
    f = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)(engine.get_function_address("f"))
    buf = (ctypes.c_float * lanes)(*([1.0] * lanes))
    f(1000, ctypes.addressof(buf))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(iterations, ctypes.addressof(buf))
        best = min(best, time.perf_counter() - t0)
    return iterations * 24 * lanes * 2 / best


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("numpy", "scipy", "torch", "pyfftw", "numba", "threadpoolctl", "psutil", "matplotlib", "znni_core"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # report, do not fail the benchmark
            out[mod] = f"unavailable ({exc.__class__.__name__})"
    return out


def git_head() -> str:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        return r.stdout.strip()
    except Exception:
        return "?"


def describe(measure_haswell: bool = True) -> dict:
    import psutil

    load = os.getloadavg()
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "avx512": "avx512f" in cpu_flags(),
        "cores": usable_cores(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "ram_available_gib": round(psutil.virtual_memory().available / 2**30, 1),
        "loadavg_at_start": [round(v, 2) for v in load],
        "platform": platform.platform(),
        "versions": versions(),
        "git_head": git_head(),
        "blas": blas_info(),
        "openblas_coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
        "openblas_coretype_original": os.environ.get("ZNNI_BENCH_ORIG_CORETYPE", os.environ.get("OPENBLAS_CORETYPE")),
        "gemm_flops": gemm_flops(),
        "fma_peak_flops_per_core": {str(b): fma_peak(b) for b in (256, 512)},
    }
    if measure_haswell and os.environ.get("OPENBLAS_CORETYPE") != "Haswell":
        info["gemm_flops_haswell"] = gemm_flops_with_coretype("Haswell")
    return info


if __name__ == "__main__":
    print(json.dumps(describe(), indent=1))


def host_class() -> dict:
    """Vendor, family, model and the vector flags from /proc/cpuinfo, and the vector width numba
    compiles znni's kernels for (and why): what a figure needs to be compared across hosts."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k = k.strip()
            if k in ("vendor_id", "cpu family", "model", "model name") and k not in info:
                info[k] = v.strip()
    except OSError:
        pass
    flags = cpu_flags()
    vec = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    from znni_core.layers import _numba, vector_width

    return {
        "vendor": info.get("vendor_id", "?"),
        "family": info.get("cpu family", "?"),
        "model": info.get("model", "?"),
        "name": info.get("model name", "?"),
        "flags": vec,
        "vector_width": f"{vector_width.describe()} [{_numba.VECTOR_WIDTH_SOURCE}]",
        "fma_peak_gflops": {str(b): None if (r := fma_peak(b)) is None else round(r / 1e9, 1) for b in (256, 512)},
    }


def host_line(h: dict) -> str:
    peaks = [f"{b}-bit {g}" for b, g in h.get("fma_peak_gflops", {}).items() if g is not None]
    return (
        f"{h['vendor']} family {h['family']} model {h['model']} ({h['name']}), flags {' '.join(h['flags'])}"
        + (f", multiply-add peak per core {', '.join(peaks)} GFLOP/s" if peaks else "")
        + f"; znni's kernels: {h['vector_width']}"
    )
