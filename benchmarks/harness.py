"""The comparison: znni's autotuned plan vs PyTorch (a) dense dilated and (b) naive all-offsets.

Per network, in one process:

1. correctness: znni's dense output on a small input equals PyTorch's dense output
   (max relative error <= 1e-4), and the naive baseline agrees on the offsets it ran;
2. sizes: znni's plan under the budget (``autotune``); PyTorch dense at the largest input
   edges whose peak fits the budget (a byte model scaled by the measured/model ratio, a few
   candidates, the fastest one that measured within the budget wins); the naive baseline at
   the largest edge that fits, output a multiple of D;
3. timing: ``repeats`` rounds, each running every method once (order rotated per round),
   median seconds -> output voxels/s; peak memory = max over rounds of the RSS rise during
   the call (see :mod:`benchmarks.memwatch`);
4. a budget sweep (one timed run per method and budget) for the throughput-vs-memory plot.

Everything is plain data (dicts) so :mod:`benchmarks.report` can render it and it can be
saved as JSON.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from .baselines import TorchDense, TorchNaive
from .memwatch import measure
from .nets import direct_flops_per_voxel, make_network

GIB = 2**30
VERIFY_TOL = 1e-4


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Config:
    """What to benchmark and how: networks, memory budgets in bytes, repeats, threads, tuner effort, caps."""

    networks: tuple = ("n337", "n537", "n726", "n926")
    width: int = 24
    budget: int = 2 * GIB  # the side-by-side comparison
    sweep_budgets: tuple = (GIB // 2, GIB, 2 * GIB)
    repeats: int = 3
    threads: int = 2
    effort: str = "estimate"  # znni autotuner effort
    dense_candidates: int = 1  # input edges PyTorch dense tries under the budget
    dense_safety: float = 1.8  # first guess of measured peak / byte model for PyTorch dense
    naive_time_limit: float = 4.0  # seconds of naive offsets per timed run before extrapolating
    max_patch_seconds: float | dict | None = None  # cap znni's predicted seconds per patch (bounds wall time)
    sweep_warmup_below_s: float = 15.0  # sweep points warm znni up only if its plan predicts less
    profile: bool = True  # per-layer times of znni and PyTorch dense, taken on round 0
    seed: int = 0
    extra: dict = field(default_factory=dict)


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _input(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(tuple(shape), dtype=np.float32)


def _cube_edges_dense(net, model, budget, safety, count):
    """Largest ``count`` cube edges whose model peak x safety fits, spaced ~7% apart."""
    f = max(net.field_of_view)
    lo, hi = f, 4096
    if model.peak_bytes(lo) * safety > budget:
        return []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if model.peak_bytes(mid) * safety <= budget:
            lo = mid
        else:
            hi = mid
    edges, n = [], lo
    for _ in range(count):
        if n < f:
            break
        edges.append(n)
        n = f - 1 + max(1, int((n - f + 1) * 0.85))
    return edges


def _edge_naive(net, model: TorchNaive, budget, safety=1.8):
    f, d = max(net.field_of_view), max(net.pooling_product)
    best = None
    m = 1
    while True:
        n = f - 1 + m * d
        if model.peak_bytes(n) * safety > budget or n > 4096:
            break
        best = n
        m += 1
    return best


# ---------------------------------------------------------------- znni ---------
class ZnniRunner:
    """znni's method: the plan ``autotune`` picks under ``budget`` bytes (optionally capped in seconds per patch)
    and a random input patch; ``run(x)`` -> the dense output.
    """

    name = "znni"

    def __init__(self, net, budget, effort, threads, max_patch_seconds=None):
        from znni_core.plan import autotune

        self.net = net
        self.capped = None
        t0 = time.perf_counter()
        plan = autotune(net, memory_budget=budget, device="cpu", effort=effort, threads=threads)
        if max_patch_seconds and plan.predicted_seconds > max_patch_seconds:
            # bound the benchmark's wall time: the best plan (by the same autotuner, same budget)
            # among smaller cube patches whose predicted time per patch is under the cap.  A smaller
            # patch only loses throughput (more border work), so this never flatters znni.
            f, d = max(net.field_of_view), max(net.pooling_product)
            m = (plan.patch_shape[0] - f + 1) // d
            best, quickest = None, None
            while m >= 1:
                p = autotune(
                    net,
                    memory_budget=budget,
                    device="cpu",
                    effort="estimate",
                    threads=threads,
                    patch_shape=(f - 1 + m * d,) * 3,
                )
                if quickest is None or p.predicted_seconds < quickest.predicted_seconds:
                    quickest = p
                if p.predicted_seconds <= max_patch_seconds:
                    if best is None or p.predicted_voxels_per_s > best.predicted_voxels_per_s:
                        best = p
                    if p.predicted_seconds < 0.25 * max_patch_seconds:
                        break
                m -= 1
            best = best or quickest  # nothing under the cap: the quickest patch the tuner found
            if best is not None:
                self.capped = {
                    "uncapped_patch": list(plan.patch_shape),
                    "uncapped_predicted_voxels_per_s": plan.predicted_voxels_per_s,
                    "uncapped_predicted_seconds": plan.predicted_seconds,
                    "max_patch_seconds": max_patch_seconds,
                }
                plan = (
                    best
                    if effort == "estimate"
                    else autotune(
                        net,
                        memory_budget=budget,
                        device="cpu",
                        effort=effort,
                        threads=threads,
                        patch_shape=best.patch_shape,
                    )
                )
        self.plan = plan
        self.plan_seconds = time.perf_counter() - t0
        self.x = _input((net.in_channels,) + tuple(self.plan.patch_shape))
        self.out_voxels = math.prod(self.plan.output_shape)

    def run(self, x=None):
        import znni_core

        return znni_core.infer(self.net, self.x if x is None else x, plan=self.plan)

    def profile(self) -> list[dict]:
        """Per conv step: measured seconds (wrapping the executor's conv call) vs predicted."""
        from znni_core.exec import patch as chain

        orig = chain.run_conv
        acc: dict[int, float] = {}

        def timed(step, layer, x, xp, convs, **kw):
            t0 = time.perf_counter()
            y = orig(step, layer, x, xp, convs, **kw)
            acc[step.index] = acc.get(step.index, 0.0) + time.perf_counter() - t0
            return y

        chain.run_conv = timed
        try:
            t0 = time.perf_counter()
            self.run()
            total = time.perf_counter() - t0
        finally:
            chain.run_conv = orig
        rows, conv_sum = [], 0.0
        for s in self.plan.steps:
            if s.op == "conv":
                # a conv after a depth-first pool is called once per offset: predicted covers all
                rows.append(
                    {
                        "layer": s.index,
                        "op": "conv",
                        "primitive": s.primitive,
                        "in": list(s.in_shape),
                        "measured_s": acc.get(s.index, 0.0),
                        "predicted_s": s.seconds,
                    }
                )
                conv_sum += acc.get(s.index, 0.0)
        rows.append(
            {
                "layer": "-",
                "op": "pool/act/recombine/copies",
                "primitive": "",
                "in": [],
                "measured_s": total - conv_sum,
                "predicted_s": self.plan.predicted_seconds - sum(s.seconds for s in self.plan.steps if s.op == "conv"),
            }
        )
        rows.append(
            {
                "layer": "total",
                "op": "",
                "primitive": "",
                "in": [],
                "measured_s": total,
                "predicted_s": self.plan.predicted_seconds,
            }
        )
        self.last_profile = rows
        return rows


# --------------------------------------------------------------- one net ------
def verify(net, zr: ZnniRunner | None, dense: TorchDense, naive: TorchNaive) -> dict:
    f, d = net.field_of_view, net.pooling_product
    shape = tuple(ff - 1 + 2 * dd + 1 for ff, dd in zip(f, d))  # output 2D+1: not a multiple of D on purpose
    x = _input((net.in_channels,) + shape, seed=7)
    ref = dense.run(x)
    out = {"input_shape": list(shape), "tolerance": VERIFY_TOL}
    if zr is not None:
        try:
            z = zr.run(x)
            out["znni_vs_dense_max_rel_err"] = _rel_err(z, ref)
        except Exception as exc:
            out["znni_error"] = f"{exc.__class__.__name__}: {exc}"
    # naive: output a multiple of D, a few offsets only (each is a whole strided pass)
    nshape = tuple(ff - 1 + 2 * dd for ff, dd in zip(f, d))
    xn = x[(slice(None),) + tuple(slice(0, s) for s in nshape)]
    ref_n = ref[(slice(None),) + tuple(slice(0, s - ff + 1) for s, ff in zip(nshape, f))]
    y, _, done = naive.run(xn, max_offsets=3)
    errs = []
    for off in naive.offsets[:done]:
        sl = (slice(None),) + tuple(slice(o, None, dd) for o, dd in zip(off, d))
        errs.append(_rel_err(y[sl], ref_n[sl]))
    out["naive_vs_dense_max_rel_err"] = max(errs)
    out["naive_offsets_checked"] = done
    out["ok"] = (
        out.get("znni_vs_dense_max_rel_err", float("inf")) <= VERIFY_TOL
        and out["naive_vs_dense_max_rel_err"] <= VERIFY_TOL
    )
    return out


def _summ(times, peaks, out_voxels, flops_per_voxel, gemm):
    med = statistics.median(times)
    vps = out_voxels / med
    return {
        "seconds": times,
        "median_s": med,
        "voxels_per_s": vps,
        "peak_bytes": max(peaks),
        "out_voxels": out_voxels,
        "gemm_fraction": flops_per_voxel * vps / gemm if gemm else None,
    }


def bench_budget(net, cfg: Config, budget: int, gemm: float, repeats: int, do_verify: bool, do_profile: bool) -> dict:
    """All three methods at one memory budget."""
    flops = direct_flops_per_voxel(net)
    res: dict = {"budget": budget, "repeats": repeats}
    dense, naive = TorchDense(net), TorchNaive(net)

    # znni plan
    zr = None
    try:
        cap = cfg.max_patch_seconds
        if isinstance(cap, dict):
            cap = cap.get(net.name.split("-w")[0], cap.get("*"))
        zr = ZnniRunner(net, budget, cfg.effort, cfg.threads, cap)
        res["znni_plan"] = {
            "patch_shape": list(zr.plan.patch_shape),
            "output_shape": list(zr.plan.output_shape),
            "pool_modes": list(zr.plan.pool_modes),
            "primitives": [s.primitive for s in zr.plan.steps if s.op == "conv"],
            "predicted_voxels_per_s": zr.plan.predicted_voxels_per_s,
            "predicted_peak_bytes": zr.plan.predicted_peak_bytes,
            "plan_seconds": zr.plan_seconds,
            "describe": zr.plan.describe(max_rejected=4),
            "capped": zr.capped,
        }
        log(
            f"  znni plan: patch {zr.plan.patch_shape} pools {zr.plan.pool_modes} "
            f"predicted {zr.plan.predicted_voxels_per_s:,.0f} vox/s (planned in {zr.plan_seconds:.1f}s)"
        )
    except Exception as exc:
        res["znni_error"] = f"{exc.__class__.__name__}: {exc}"
        res["znni_traceback"] = traceback.format_exc(limit=6)
        log(f"  znni unavailable: {res['znni_error']}")

    if do_verify:
        res["verify"] = verify(net, zr, dense, naive)
        log(f"  verify: {res['verify']}")
        if zr is not None and res["verify"].get("znni_vs_dense_max_rel_err", float("inf")) > VERIFY_TOL:
            res["znni_error"] = res["verify"].get("znni_error", "znni output differs from PyTorch dense")
            log("  znni NOT timed: its output does not match")
            zr = None

    # sizes for the baselines
    edges = _cube_edges_dense(net, dense, budget, cfg.dense_safety, cfg.dense_candidates)
    n_naive = _edge_naive(net, naive, budget)
    res["dense_candidates"] = edges
    res["naive_edge"] = n_naive

    runs: dict[str, dict] = {
        "znni": {"t": [], "p": []},
        "dense": {"t": [], "p": []},
        "naive": {"t": [], "p": [], "done": []},
    }
    dense_trials = {}
    # warm-up (FFT plans, numba compile, page faults), reported, not counted; in the sweep (one
    # round) only when the plan predicts a short run, else the single timed run is also the first
    if zr is not None and (do_verify or zr.plan.predicted_seconds < cfg.sweep_warmup_below_s):
        _, dt, pk = measure(zr.run)
        res["znni_warmed_up"] = True
        res["znni_cold_s"] = dt
        log(f"  znni warm-up {dt:.2f}s, peak +{pk / GIB:.2f} GiB")

    # PyTorch warm-up on a small input: oneDNN kernels JIT-compiled and library pages touched
    # once, so neither counts in a timed run or its memory
    dense.run(_input((net.in_channels,) + tuple(f + d for f, d in zip(net.field_of_view, net.pooling_product))))
    x_dense, dense_edge = None, None
    # choose the dense edge on round 0: try candidates, drop those over budget, keep the fastest
    ratio = cfg.dense_safety
    while edges and dense_edge is None:
        for n in list(edges):
            x = _input((net.in_channels, n, n, n))
            prof: list = []
            try:
                y, dt, pk = measure(dense.run, x, prof)
            except RuntimeError as exc:  # allocation failure
                dense_trials[n] = {"error": str(exc)[:200]}
                edges.remove(n)
                continue
            vps = y[0].size / dt
            dense_trials[n] = {
                "seconds": dt,
                "peak_bytes": pk,
                "voxels_per_s": vps,
                "model_bytes": dense.peak_bytes(n),
                "profile": prof,
            }
            log(
                f"  dense edge {n}: {dt:.1f}s {vps:,.0f} vox/s peak +{pk / GIB:.2f} GiB "
                f"(model {dense.peak_bytes(n) / GIB:.2f})"
            )
            ratio = max(ratio, pk / dense.peak_bytes(n))
            del y
        fitting = [
            n
            for n in edges
            if n in dense_trials and "peak_bytes" in dense_trials[n] and dense_trials[n]["peak_bytes"] <= budget
        ]
        if fitting:
            dense_edge = max(fitting, key=lambda n: dense_trials[n]["voxels_per_s"])
        else:  # all over budget: re-derive edges with the measured ratio
            new = _cube_edges_dense(net, dense, budget, ratio * 1.05, cfg.dense_candidates)
            edges = [n for n in new if n not in dense_trials]
    res["dense_trials"] = {str(k): v for k, v in dense_trials.items()}  # same dicts: profiles dropped below
    res["dense_edge"] = dense_edge
    if dense_edge is not None:
        x_dense = _input((net.in_channels,) + (dense_edge,) * 3)
        runs["dense"]["t"].append(dense_trials[dense_edge]["seconds"])  # round 0 is the chosen trial
        runs["dense"]["p"].append(dense_trials[dense_edge]["peak_bytes"])
    x_naive = _input((net.in_channels,) + (n_naive,) * 3) if n_naive else None

    methods = []
    if zr is not None:
        methods.append("znni")
    if x_dense is not None:
        methods.append("dense")
    if x_naive is not None:
        methods.append("naive")
    for r in range(repeats):
        order = methods[r % len(methods) :] + methods[: r % len(methods)] if methods else []
        for m in order:
            if m == "znni":
                # round 0 is the profiled run (the wrapper only reads a clock around each conv call)
                _, dt, pk = measure(zr.profile if (r == 0 and do_profile) else zr.run)
            elif m == "dense":
                if r == 0:
                    continue  # round 0 already timed while choosing the edge
                _, dt, pk = measure(dense.run, x_dense)
            else:
                (_, dt, done), _, pk = measure(naive.run, x_naive, time_limit=cfg.naive_time_limit)
                runs["naive"]["done"].append(done)
            runs[m]["t"].append(dt)
            runs[m]["p"].append(pk)
            log(f"  round {r} {m}: {dt:.2f}s peak +{pk / GIB:.2f} GiB")

    if runs["znni"]["t"]:
        res["znni"] = _summ(runs["znni"]["t"], runs["znni"]["p"], zr.out_voxels, flops, gemm)
    if runs["dense"]["t"]:
        res["dense"] = _summ(
            runs["dense"]["t"], runs["dense"]["p"], (dense_edge - max(net.field_of_view) + 1) ** 3, flops, gemm
        )
        res["dense"]["input_edge"] = dense_edge
    if runs["naive"]["t"]:
        ov = math.prod(naive.out_shape((n_naive,) * 3))
        res["naive"] = _summ(runs["naive"]["t"], runs["naive"]["p"], ov, flops, gemm)
        res["naive"]["input_edge"] = n_naive
        res["naive"]["offsets_run"] = runs["naive"]["done"]
        res["naive"]["offsets_total"] = len(naive.offsets)
        res["naive"]["extrapolated"] = any(d < len(naive.offsets) for d in runs["naive"]["done"])
    if "znni" in res:
        for m in ("dense", "naive"):
            if m in res:
                res[f"ratio_vs_{m}"] = res["znni"]["voxels_per_s"] / res[m]["voxels_per_s"]

    if do_profile:
        if zr is not None and getattr(zr, "last_profile", None):
            res["znni_profile"] = zr.last_profile
        if dense_edge is not None:
            res["dense_profile"] = dense_trials[dense_edge]["profile"]
    for t in dense_trials.values():
        t.pop("profile", None)
    return res


def bench_network(name_or_net, cfg: Config, gemm: float) -> dict:
    net = make_network(name_or_net, cfg.width, cfg.seed) if isinstance(name_or_net, str) else name_or_net
    name = name_or_net if isinstance(name_or_net, str) else net.name
    log(
        f"{name} width {cfg.width}: FoV {net.field_of_view}, D {net.pooling_product}, "
        f"{direct_flops_per_voxel(net) / 1e6:.2f} MFLOP/voxel"
    )
    out = {
        "network": name,
        "width": cfg.width,
        "field_of_view": list(net.field_of_view),
        "pooling_product": list(net.pooling_product),
        "flops_per_voxel": direct_flops_per_voxel(net),
        "architecture": net.describe(),
    }
    t0 = time.perf_counter()
    log(f"  main comparison at budget {cfg.budget / GIB:.2f} GiB")
    out["main"] = bench_budget(net, cfg, cfg.budget, gemm, cfg.repeats, do_verify=True, do_profile=cfg.profile)
    out["sweep"] = []
    for b in cfg.sweep_budgets:
        if b == cfg.budget:
            out["sweep"].append(out["main"])
            continue
        log(f"  sweep: budget {b / GIB:.2f} GiB")
        out["sweep"].append(bench_budget(net, cfg, b, gemm, 1, do_verify=False, do_profile=False))
    out["seconds"] = time.perf_counter() - t0
    return out


def run(cfg: Config, machine: dict) -> dict:
    import torch

    torch.set_num_threads(cfg.threads)
    gemm = machine["gemm_flops"]
    results = {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
        "machine": machine,
        "networks": [],
    }
    for name in cfg.networks:
        results["networks"].append(bench_network(name, cfg, gemm))
    results["machine"]["loadavg_at_end"] = [round(v, 2) for v in __import__("os").getloadavg()]
    return results
