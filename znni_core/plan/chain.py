"""The chain's search (ZNNi Sec. VI-A): the memory-aware autotuner of max-pooling networks.

Candidates: every pool/MPF assignment of the pooling layers x input patch shapes
(anisotropic networks get anisotropic patches).  For each, every convolution layer
gets the fastest (primitive, micro-batch) whose peak fits the budget given what is
alive at that point (the memory walk of ``plan/memory.py``).  Objective: dense output
voxels per second = output voxels / sum of step times; constraint: peak <= budget.
Everything thrown away is kept, with its reason, in ``Plan.rejected``.  GPU plans also
weigh tensors in host RAM streamed through the device, and ``cpu+gpu`` a split of the
layers between the CPU and the GPU (:func:`_pipeline`).  :func:`.search.autotune` is the entry.
"""

from __future__ import annotations

import math

from ..errors import MemoryBudgetError, PlanError
from ..net.chain import Conv, Pool
from ..net.graph import Graph
from ..net.ops import Convolution
from ..units import format_bytes
from . import memory as M
from . import pricing as P  # P.streamed_seconds: read at call time (tests replace it)
from .candidates import (
    Candidate,
    ConvOption,
    fft_tiles,
    flat_axis,
    input_patch,
    micro_batches,
    patch_candidates,
    pool_mode_candidates,
    rate,
    slab_modes,
)
from .memory import MAX_PATCH_VOXELS
from .plan import CPU_PRIMITIVES, Plan, Rejected, Step, chosen_plan
from .pooling import MPF, DepthFirst, Slab, parse
from .pricing import PATCH_OVERHEAD_S, Pricer, StepContext, priced_steps
from .primitives import FALLBACK, PRIMITIVES
from .program import channels_last_tensors, program

PATIENCE = 2  # coarse patches in a row without a gain before a series of growing patches stops
COARSE = 3  # a series is first sampled at every COARSE-th patch, then refined around the best
SHORTLIST = 3  # per layer, options measured (the best by estimate, within 3x of it)
SQUEEZES = 3  # re-decisions of a candidate with its excess over the budget kept free (see _evaluate)


def _repeats(net: Graph, patch, modes) -> dict:
    """``{layer index: times it runs per patch}``: the layers after a depth-first pooling layer run
    once per pooling offset; in slab mode the layers before it, and it, also once per z-slab."""
    layers = net.layers
    repeat, reps, mode_iter = 1, {}, iter(modes)
    for i, layer in enumerate(layers):
        reps[i] = repeat
        if isinstance(layer, Pool):
            mode = next(mode_iter)
            if isinstance(mode, Slab):  # layers before, and this max-pool, run per offset and per z-slab
                g = M.slab_geometry(layers, net.in_channels, i, patch, mode.rows)
                for j in range(i + 1):
                    reps[j] = math.prod(layer.window) * g["n_slabs"]
            if mode.per_offset:
                repeat *= math.prod(layer.window)
    return reps


def _ranked_options(timer: Pricer, i, layer, n, spatial, reps, allowed, host, threads) -> list[ConvOption]:
    """Every option of conv layer ``i`` on ``n`` fragments of ``spatial``, fastest first by
    estimate; memoised per search (shared by candidates)."""
    key = ("ranked", i, n, tuple(spatial), reps, allowed, bool(host))
    ranked = timer._memo.get(key)
    if ranked is not None:
        return ranked
    ranked = []
    for prim in allowed:
        for tile in fft_tiles(spatial, layer.kernel) if PRIMITIVES[prim].blocked or host else [()]:
            keep = M.resident_bytes(prim, layer, M.conv_blocks(spatial, layer.kernel, tile)[0])
            for mb in micro_batches(n):
                if host:
                    need = M.device_call_bytes(prim, mb, layer, spatial, tile, threads) + keep
                    t = P.streamed_seconds(timer, prim, n, layer, spatial, mb, reps, tile, host["cal"])
                else:
                    need = M.conv_step_bytes(prim, n, mb, layer, spatial, tile, threads) + keep
                    t = timer.layer(prim, n, layer, spatial, mb, reps, tile=tile)
                ranked.append(ConvOption(t, prim, mb, tile, need, keep))
    ranked.sort(key=lambda o: (o.seconds, o.primitive, o.micro_batch))
    timer._memo[key] = ranked
    return ranked


def _pools_reading_channels_last(net: Graph, modes, steps_mem, decisions) -> set:
    """The pooling layers whose input the executor holds channels last under these choices
    (:func:`.program.channels_last_tensors` of the steps they make)."""
    layers, pool_modes = net.layers, iter(modes)
    steps = []
    for sm in steps_mem:
        layer = layers[sm.index]
        if isinstance(layer, Conv):
            prim, mb, tile = decisions[sm.index]
            tile = M.conv_blocks(sm.in_shape[2:], layer.kernel, tile)[0] if tile else ()
            steps.append(Step(sm.index, sm.op, prim, (), (), 0 if mb >= sm.in_shape[0] else mb, tile=tile))
        elif isinstance(layer, Pool):
            mode = next(pool_modes)
            steps.append(Step(sm.index, sm.op, mode.primitive, (), (), mode.micro_batch))
        else:
            steps.append(Step(sm.index, sm.op, layer.kind, (), ()))
    prog = program(steps, net)
    cl = channels_last_tensors(prog, every=True)
    return {s.index for node, s in zip(prog.nodes, prog.steps) if s.pooling is not None and node.inputs[0] in cl}


def _priced_steps(net: Graph, pooling, steps_mem, decisions, reps, timer: Pricer, host, measure) -> tuple[list, float]:
    """The plan's steps of one candidate from its memory walk and conv choices, each with its time
    (:func:`.pricing.step_of`, as the graph's search prices its steps); and their total."""
    modes = tuple(pooling.values())  # in the pooling layers' order
    ctx = StepContext(
        timer,
        timer.cal.threads,
        reps,
        pooling,
        frozenset(_pools_reading_channels_last(net, modes, steps_mem, decisions)),
        measure,
        host,
    )
    return priced_steps(net, steps_mem, ctx)


def _evaluate(net, patch, modes, budget, timer, primitives, measure=False, host=None):
    """Best choices for one (patch, pool modes) candidate; returns (steps, seconds, peak, notes).

    ``host`` (a GPU + host RAM candidate, ZNNi Sec. VI-C): ``{"budget": host bytes, "cal":
    the CPU's calibration}``.  Every tensor then lives in host memory (the walk's peak must
    fit ``host["budget"]``); each conv streams its input through the device in blocks and
    micro-batches (``budget``: device bytes for one call, double-buffered, plus the resident
    kernel transforms); pooling and activations run on the CPU.  ``peak`` is the device's.
    """
    # long (one candidate): the closures that price each step and record its live memory share the
    # memory walk's state with the loop over layers
    layers = net.layers
    live_max: dict[int, int] = {}

    def record(i, n, spatial, live):
        live_max[i] = max(live_max.get(i, 0), live)
        return FALLBACK, 1, ()

    reps = _repeats(net, patch, modes)
    threads = timer.cal.threads
    pooling = dict(zip((i for i, layer in enumerate(layers) if isinstance(layer, Pool)), modes))
    result = M.nbytes((net.out_channels,) + tuple(net.output_shape(patch)))  # what the tiler fills
    M.walk(net, patch, record, pooling=pooling, threads=threads, held=result)  # pass 1: what is alive before each conv
    no_cache: set[int] = set()  # layers refused resident kernel spectra (they did not fit)
    # bytes every layer's choice leaves free: choices that fit one by one may not fit together
    # (an early call's blocks with a later layer's resident transforms), and which ones are chosen
    # follows the timings, so a tight budget must not depend on the calibration's noise
    squeeze, squeezes = 0, 0
    while True:
        decisions, notes, resident = {}, [], {}

        def decide(i, n, spatial, live):
            if i in decisions:
                return decisions[i]
            layer = layers[i]
            room = budget - (0 if host else live_max[i]) - sum(resident.values()) - squeeze
            usable = tuple(
                p for p in primitives if PRIMITIVES[p].supports(layer.kernel, (layer.in_channels, layer.out_channels))
            ) or (FALLBACK,)
            allowed = tuple(p for p in usable if not (i in no_cache and PRIMITIVES[p].resident)) or usable
            if flat_axis(layer.kernel, spatial):
                # FFTConv transforms every axis: a kernel 1 deep on an axis of extent > 1 (2D
                # kernels in 3D) pays transforms along it for nothing, and the rate model does not
                # see it (boundary net (1,5,5) layer: fft-task 2.0 s where direct-gemm took 1.0 s);
                # fft-gemm folds such axes into its batch (2D transforms per z slice)
                allowed = tuple(p for p in allowed if not PRIMITIVES[p].transforms_all_axes) or allowed
            if math.prod(layer.kernel) == 1:
                # primitives.DirectNumba.runs_1x1x1: its per-row overhead is not in the rate model
                allowed = tuple(p for p in allowed if PRIMITIVES[p].runs_1x1x1) or allowed
            ranked = _ranked_options(timer, i, layer, n, spatial, reps[i], allowed, host, threads)
            est = [o for o in ranked if o.bytes <= room]
            if not est:
                o = min(ranked, key=lambda o: o.bytes)
                decisions[i] = (o.primitive, o.micro_batch, o.tile)
                resident[i] = o.resident
                return decisions[i]
            if timer.meas is not None and (measure or timer.measure_all):
                short = [o for o in est if o.seconds <= 3 * est[0].seconds][:SHORTLIST]
                timed = sorted(
                    (
                        o._replace(
                            seconds=timer.layer(o.primitive, n, layer, spatial, o.micro_batch, reps[i], True, o.tile)
                        )
                        for o in short
                    ),
                    key=lambda o: (o.seconds, o.primitive, o.micro_batch, o.tile),
                )
            else:
                timed = est
            best = timed[0]
            best_t = best.seconds
            decisions[i] = (best.primitive, best.micro_batch, best.tile)
            resident[i] = best.resident
            for p in () if host else usable:  # faster whole-batch alternatives refused for memory
                e = M.conv_primitive_bytes(p, n, layer, spatial, threads) + M.resident_bytes(p, layer, spatial)
                if e > room:
                    t = timer.layer(p, n, layer, spatial, n, reps[i])
                    if t < best_t:
                        notes.append(
                            Rejected(
                                f"layer {i} {p} (batch {n})",
                                f"needs {format_bytes(live_max[i] + e)} > budget {format_bytes(budget)}",
                            )
                        )
            return decisions[i]

        M.walk(net, patch, decide, pooling=pooling, threads=threads, held=result)  # pass 2: choices, layer by layer
        held = sum(resident.values())
        steps_mem, peak = M.walk(
            net,
            patch,
            lambda i, *a: decisions[i],
            pooling=pooling,
            threads=threads,
            held=result + (0 if host else held),
        )
        if host:  # the walk is the host's memory; the device holds one call's blocks and the transforms
            host_peak = peak
            peak = held + max(
                (
                    M.device_call_bytes(p, mb, layers[i], sm.in_shape[2:], tl, threads)
                    for sm in steps_mem
                    if isinstance(layers[sm.index], Conv)
                    for i, (p, mb, tl) in [(sm.index, decisions[sm.index])]
                ),
                default=0,
            )
        if peak <= budget:
            break
        if squeezes < SQUEEZES and peak <= 1.5 * budget:  # close: choose again, the excess kept free
            squeeze, squeezes = squeeze + max(peak - budget, budget // 32), squeezes + 1
            continue
        # the resident spectra chosen layer by layer do not fit together: drop the largest, re-decide
        largest = max(resident, key=resident.get) if held else None
        if largest is None or largest in no_cache:  # nothing left to drop: the candidate does not fit
            break
        no_cache.add(largest)
        squeeze = squeezes = 0
    steps, total = _priced_steps(net, pooling, steps_mem, decisions, reps, timer, host, measure)
    out_vox = math.prod(net.output_shape(patch))
    total += timer.model.elementwise(M.nbytes((net.out_channels, out_vox)), 2.0)  # recombine
    total += PATCH_OVERHEAD_S
    if host and host_peak > host["budget"]:
        notes.append(
            Rejected(
                f"patch {patch} on GPU + host RAM",
                f"host tensors need {format_bytes(host_peak)} > host budget {format_bytes(host['budget'])}",
            )
        )
        peak = max(peak, budget + 1)  # does not fit
    return steps, total, peak, notes


def _chain_patches(net: Graph, patch_shape, input_shape) -> list[list[tuple]]:
    """The series of patches a chain's search walks: the caller's one patch (checked), or
    :func:`.candidates.patch_candidates`."""
    if patch_shape is None:
        return patch_candidates(net, MAX_PATCH_VOXELS, input_shape)
    patch_shape = tuple(int(v) for v in patch_shape)
    fov, d = net.field_of_view, net.pooling_product
    if any(n < f or (n - f + 1) % dd for n, f, dd in zip(patch_shape, fov, d)):
        raise PlanError(
            f"patch shape {patch_shape}: each axis n needs n >= field of view {fov} and "
            f"(n - F + 1) divisible by the pooling product {d}"
        )
    return [[patch_shape]]


def _chain_modes(net: Graph, pool_modes, device) -> tuple[list, tuple | None]:
    """(the pooling-mode assignments to try, the caller's fixed one or None)."""
    mode_sets = pool_mode_candidates(len(net.pools))
    if pool_modes is not None:
        given = tuple(pool_modes)
        try:
            pool_modes = tuple(parse(m) for m in given)
            ok = len(pool_modes) == len(net.pools) and not any(isinstance(m, Slab) for m in pool_modes[1:])
        except ValueError:
            ok = False
        if not ok:
            raise PlanError(
                f"pool_modes {given} must give 'mpf' or 'pool' (first one also 'slab:ROWS') for each of the "
                f"{len(net.pools)} pooling layers"
            )
        mode_sets = [pool_modes]
    if device == "cpu+gpu":  # the pipeline hands MPF fragments from the CPU stage to the GPU stage
        if pool_modes is not None and any(m != MPF() for m in pool_modes):
            raise PlanError(f"pool_modes {tuple(map(str, pool_modes))}: a cpu+gpu plan runs every pooling layer as MPF")
        mode_sets = [(MPF(),) * len(net.pools)]
        pool_modes = mode_sets[0]
    return mode_sets, pool_modes


class _ChainSearch:
    """The walk over a chain's candidates: series of growing patches, each patch with its
    pooling-mode assignments and placements, priced by :func:`_evaluate` (or :func:`_pipeline`);
    what fits is kept as a :class:`~.candidates.Candidate`, what does not is rejected with its need."""

    def __init__(self, net, budget, device, timer, prims, host, input_shape, placement):
        self.net, self.budget, self.timer, self.prims, self.host = net, budget, timer, prims, host
        self.input_shape = input_shape
        self.results: list[Candidate] = []
        self.rejected: list[Rejected] = []
        self.smallest_need = None
        self.evaluated = 0
        self.tried: set = set()
        # GPU plans: all on the device, or tensors in host RAM streamed through it (ZNNi VI-C), chosen by speed
        placements = {"cpu": ("",), "gpu": ("", "gpu+host"), "cpu+gpu": ("cpu+gpu",)}[device]
        if placement is not None:  # one kind only (benchmarks, tests): "" (all on the device) or "gpu+host"
            if placement not in placements:
                raise PlanError(f"placement {placement!r} is not one of {placements} for device {device!r}")
            placements = (placement,)
        self.placements = placements
        self.room = host["budget"] if "gpu+host" in placements else budget  # where a patch's tensors may live

    def run(self, series, mode_sets, pool_modes, whole: bool = True) -> list[Candidate]:
        """Walk every series, then (``whole``) the whole input as one patch and (a net flat in z)
        its slabs; the fitting candidates, fastest first.  Raises :class:`MemoryBudgetError` if
        none fits."""
        net, input_shape = self.net, self.input_shape
        self.mode_sets, self.pool_modes = mode_sets, pool_modes
        self.frugal_first = sorted(mode_sets, key=lambda m: -sum(isinstance(v, DepthFirst) for v in m))
        for patches in series:
            self.walk_series(patches)
        whole = input_patch(net, input_shape) if input_shape is not None and whole else None
        if whole is not None and whole not in self.tried and self.fits_input(whole):
            self.try_patch(whole)  # the input in one patch: the walk may have stopped short of it
        if whole is not None and not any(r.patch == whole for r in self.results):
            for patches in patch_candidates(net, MAX_PATCH_VOXELS, input_shape, slabs=True):
                self.walk_series(patches)  # slabs only add patches to a whole input
        if not self.results:
            need = self.smallest_need or M.nbytes((net.in_channels,) + tuple(net.field_of_view)) * 2
            raise MemoryBudgetError(
                f"no plan fits the memory budget of {format_bytes(self.budget)}: the smallest candidate needs "
                f"{format_bytes(need)}. Raise the budget (--memory / mem_mb) to at least {format_bytes(need * 1.1)}."
            )
        return sorted(self.results, key=lambda r: -r.voxels_per_s)

    def fits_input(self, patch) -> bool:
        """Whether the patch's input and output alone fit where its tensors live."""
        return M.nbytes((self.net.in_channels,) + tuple(patch)) * 2 <= self.room

    def walk_series(self, patches) -> None:
        """Coarse to fine along a series of growing patches: every COARSE-th patch until
        throughput has fallen PATIENCE times in a row or the input alone no longer fits
        (monotone trends), then the neighbours of the best coarse patch."""
        patches = [p for p in patches if self.fits_input(p)]
        if not patches:
            return
        coarse = sorted(set(range(0, len(patches), COARSE)) | {len(patches) - 1})
        seen, best_i, best_vps, worse = {}, None, 0.0, 0
        for i in coarse:
            seen[i] = self.try_patch(patches[i])
            if seen[i] > best_vps:
                best_i, best_vps, worse = i, seen[i], 0
            else:
                worse += 1
                if worse >= PATIENCE:
                    break
        if best_i is not None:
            for i in range(max(0, best_i - COARSE + 1), min(len(patches), best_i + COARSE)):
                if i not in seen:
                    seen[i] = self.try_patch(patches[i])

    def try_patch(self, patch) -> float:
        """Evaluate every pool-mode assignment of ``patch``; the best fitting patch's own
        voxels/s (0: none fits), which grows with the patch (the walk's monotone trend);
        results are ranked by the rate over the input (:func:`.candidates.rate`)."""
        net, budget, input_shape = self.net, self.budget, self.input_shape
        self.tried.add(patch)
        best = 0.0
        # slab modes recompute the first layers (slower, smaller): tried only when no
        # MPF/depth-first assignment fits this patch
        # all-depth-first (the least memory) goes first: if even it does not fit, no other
        # MPF/depth-first assignment does, and only the slab modes remain
        for group in [self.mode_sets] if self.pool_modes is not None else [self.frugal_first, None]:
            if group is None:  # the slab choices
                if best:
                    break
                group = slab_modes(net, patch, [self.frugal_first[0]])
            for j, modes in enumerate(group):
                if j == 1 and group is self.frugal_first and not best:
                    break
                fits = False
                for placement in self.placements:
                    if placement == "gpu+host" and fits:
                        continue  # host RAM is for tensors the device cannot hold
                    split = 0
                    if placement == "cpu+gpu":
                        steps, secs, peak, notes, split = _pipeline(
                            net, patch, modes, budget, self.timer, self.prims, self.host
                        )
                    else:
                        host = self.host if placement == "gpu+host" else None
                        steps, secs, peak, notes = _evaluate(
                            net, patch, modes, budget, self.timer, self.prims, host=host
                        )
                    self.evaluated += 1
                    desc = f"patch {patch} pools {'/'.join(map(str, modes)) or '-'}" + (
                        f" on {placement}" if placement else ""
                    )
                    vps = rate(net, patch, secs, input_shape)
                    if peak > budget:
                        self.rejected.append(
                            Rejected(desc, f"needs {format_bytes(peak)} > budget {format_bytes(budget)}", vps)
                        )
                        self.smallest_need = peak if self.smallest_need is None else min(self.smallest_need, peak)
                    else:
                        fits = True
                        self.results.append(Candidate(vps, patch, modes, steps, secs, peak, notes, placement, split))
                        best = max(best, rate(net, patch, secs))
        return best


def _remeasure(net, results, effort, budget, timer, prims, input_shape) -> list[Candidate]:
    """Re-time the best candidates on real shapes (exhaustive: all were measured already); GPU +
    host RAM and pipelined candidates keep their estimates.  Measured first: an estimate never
    outranks a measurement."""
    top = [r for r in (results if effort == "exhaustive" else results[:3]) if not r.placement]
    rest = [r for r in results if r.placement or not any(r is t for t in top)]
    remeasured = []
    for r in top:
        steps, secs, peak, notes = _evaluate(net, r.patch, r.modes, budget, timer, prims, measure=True)
        vps = rate(net, r.patch, secs, input_shape)
        remeasured.append(Candidate(vps, r.patch, r.modes, steps, secs, peak, notes, "", 0))
    remeasured.sort(key=lambda r: -r.voxels_per_s)
    return remeasured + rest


def _chosen(net, results, search: _ChainSearch, device, effort, threads, input_shape, budget, gpu_cal) -> Plan:
    """The plan of the first candidate, with every other one listed as rejected (slower)."""
    best, rejected = results[0], list(search.rejected)
    for r in results[1:]:
        rejected.append(
            Rejected(r.describe(), f"slower: {r.voxels_per_s:,.0f} < {best.voxels_per_s:,.0f} voxels/s", r.voxels_per_s)
        )
    rejected.sort(key=lambda r: -r.voxels_per_s)
    return chosen_plan(
        net,
        patch=best.patch,
        device=device,
        effort=effort,
        threads=threads,
        candidates=search.evaluated,
        input_shape=input_shape,
        provenance={
            "calibration": {k: getattr(search.timer.cal, k) for k in ("gemm_flops", "numba_flops", "mem_bw")},
            **({"device": gpu_cal.device} if gpu_cal else {}),
        },
        memory_budget=budget,
        steps=tuple(best.steps),
        predicted_seconds=best.seconds,
        predicted_peak_bytes=int(best.peak),
        placement=best.placement,
        split=best.split,
        rejected=tuple(best.notes) + tuple(rejected[:50]),
    )


def _pipeline(net, patch, modes, budget, timer, prims, host):
    """A CPU -> GPU candidate (ZNNi Sec. VI-D): the layers before a conv run on the CPU, the
    rest on the GPU, the two stages overlapped across patches.  The split is the one whose
    slower stage is fastest (Caffe con Troll's split by measured speed: both stages are
    timed by their device's calibrated model).  Returns (steps, seconds per patch in
    steady state, device peak, notes, split: the layer index of the first GPU step)."""
    cpu_timer = host.setdefault("timer", Pricer("estimate", host["threads"]))
    cpu, _, cpu_peak, _ = _evaluate(net, patch, modes, host["budget"], cpu_timer, CPU_PRIMITIVES)
    gpu, _, _, notes = _evaluate(net, patch, modes, budget, timer, prims)
    if cpu_peak > host["budget"]:
        return gpu, math.inf, budget + 1, notes, 0
    out = M.nbytes((net.out_channels,) + tuple(net.output_shape(patch)))
    best = (math.inf, None, budget + 1)
    for k, s in enumerate(gpu):
        if not issubclass(s.operator, Convolution):
            continue
        front = sum(x.seconds for x in cpu[:k])
        back = sum(x.seconds for x in gpu[k:]) + timer.model.transfer(M.nbytes(s.in_shape) + out)
        peak = max(x.bytes for x in gpu[k:])  # the GPU walk from the patch: an upper bound past the split
        if peak <= budget and max(front, back) < best[0]:
            best = (max(front, back) + PATCH_OVERHEAD_S, k, peak)
    secs, k, peak = best
    if k is None:
        return gpu, math.inf, peak, notes, 0
    return tuple(cpu[:k]) + tuple(gpu[k:]), secs, peak, notes, gpu[k].index


def autotune_chain(
    net: Graph,
    *,
    budget: int,
    device: str,
    effort: str,
    threads: int,
    timer: Pricer,
    prims: tuple,
    host: dict | None,
    patch_shape,
    pool_modes,
    input_shape,
    placement,
    gpu_cal,
) -> Plan:
    """A chain network's plan (the request already checked by :func:`.search.autotune`): its
    series of patches, each with its pooling-mode assignments and placements, priced; the
    fastest that fits, every other one listed as rejected."""
    search = _ChainSearch(net, budget, device, timer, prims, host, input_shape, placement)
    series = _chain_patches(net, patch_shape, input_shape)
    results = search.run(series, *_chain_modes(net, pool_modes, device), whole=patch_shape is None)
    if effort in ("measure", "exhaustive"):
        results = _remeasure(net, results, effort, budget, timer, prims, input_shape)
    return _chosen(net, results, search, device, effort, threads, input_shape, budget, gpu_cal)
