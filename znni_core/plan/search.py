"""``autotune``: the one entry of the planner, for chains and graphs alike.

It checks the request (effort, device, budget, primitives), puts the host's kernel parameters
in force, looks the plan up in the plan cache (like FFTW wisdom: by network, shape, budget,
device, effort, threads and machine), and else runs the network's search: a chain's
(:mod:`.chain`: patches, pooling modes, a primitive per layer) or a graph's (:mod:`.graph`:
a primitive per convolution, the patch, its tiles and blending).
"""

from __future__ import annotations

import dataclasses

from ..cachedir import cache_dir
from ..errors import PlanError
from ..layers import tuning
from ..net.protocol import AnyNetwork
from . import timing as T
from . import wisdom as W
from .budget import default_budget, default_threads, device_budget
from .candidates import input_patch
from .chain import autotune_chain
from .costs import CostModel, CpuCostModel
from .graph import autotune_graph
from .plan import CONV_PRIMITIVES, CPU_PRIMITIVES, Plan
from .pricing import Pricer
from .primitives import PRIMITIVES, names

EFFORTS = ("estimate", "measure", "exhaustive")
#: conv primitives of GPU plans: the two whose device memory the model predicts (checked on the
#: simulated GPU and on an H100); fft-data, winograd and direct-torch (cuDNN through PyTorch: wrong
#: results now and then on an H100, fixed and not yet verified, layers/torch_conv.py) run on the
#: device when asked for (``primitives=``)
GPU_PRIMITIVES = names("gpu", gpu_default=True)
DEVICES = ("cpu", "gpu", "cpu+gpu")  # cpu+gpu: the first layers on the CPU, the rest on the GPU, pipelined
SEARCH_VERSION = 25  # in the plan cache key: bump when the search or time model changes (stale plans)
PLAN_CACHE_ENTRIES = 256  # newest plans kept on disk (one per network x shape x budget x ...)


def autotune(
    net: AnyNetwork,
    *,
    memory_budget: int | None = None,
    device: str = "cpu",
    effort: str = "estimate",
    threads: int | None = None,
    patch_shape=None,
    primitives=None,
    pool_modes=None,
    input_shape=None,
    use_cache: bool = True,
    overlap=None,
    blend: str = "bump",
    placement: str | None = None,
    cost_model: CostModel | None = None,
) -> Plan:
    """Choose input patch, pool/MPF per pooling layer, primitive and micro-batch per conv layer.

    A graph network (:class:`~znni_core.net.graph.Graph`) is planned by
    :func:`.graph.autotune_graph`: a primitive per convolution and the patch; a padded
    graph's plan also carries its blending (``overlap`` voxels per axis, default a quarter
    of the patch output; ``blend``: bump, gaussian or linear).

    ``input_shape`` (z, y, x): the input the plan is for (a whole array, or a task's read
    shape); no patch larger than it is considered, and the whole input is a candidate.
    Plans are cached on disk by (network, input shape, budget, device, effort, threads,
    machine), like FFTW wisdom.  Raises :class:`MemoryBudgetError` when not even the
    smallest patch fits, naming what it needs.

    ``cost_model``: price the candidates with this model (a :class:`~.costs.CpuCostModel` of a
    given calibration) instead of this host's calibration: the same plan on any host (tests, a
    plan made for another machine).  CPU plans by estimate only; no plan cache.
    """
    if effort not in EFFORTS:
        raise PlanError(f"effort {effort!r} is not one of {EFFORTS}")
    if device not in DEVICES:
        raise PlanError(f"device {device!r} is not one of {DEVICES}")
    if memory_budget is not None and int(memory_budget) <= 0:
        raise PlanError(f"memory budget {memory_budget!r} must be a positive number of bytes")
    # the host's kernel parameters (measured with its calibration): the search prices and sizes
    # every primitive under them, and the plan carries them to the executor
    if cost_model is not None and (device != "cpu" or effort != "estimate"):
        raise PlanError(f"a given cost model plans device 'cpu' by effort 'estimate' (got {device!r}, {effort!r})")
    cal = cost_model.cal if cost_model is not None else T.calibrate(max(1, int(threads or default_threads())))
    tuned = cal.tuned
    with tuning.using(tuned):
        plan = _autotune(
            net,
            memory_budget=memory_budget,
            device=device,
            effort=effort,
            threads=threads,
            patch_shape=patch_shape,
            primitives=primitives,
            pool_modes=pool_modes,
            input_shape=input_shape,
            use_cache=use_cache,
            overlap=overlap,
            blend=blend,
            placement=placement,
            cost_model=cost_model,
            level=cal.level,
        )
    return plan if plan.tuning == tuned else dataclasses.replace(plan, tuning=dict(tuned))


def _autotune(
    net: AnyNetwork,
    *,
    memory_budget,
    device,
    effort,
    threads,
    patch_shape,
    primitives,
    pool_modes,
    input_shape,
    use_cache,
    overlap,
    blend,
    placement,
    cost_model,
    level,
) -> Plan:
    """:func:`autotune` under the host's kernel parameters: resolve the request, look the plan up
    in the cache, else search (a graph's search, or the chain's below)."""
    threads = int(threads or default_threads())
    budget, gpu_cal, gpu_xp, host = _budgets(device, memory_budget, threads)
    prims = _primitives(primitives, device)
    graph = net.kind != "chain"
    if input_shape is not None:
        input_shape = tuple(int(v) for v in input_shape)
        if not graph:
            input_patch(net, input_shape)  # validates
    if graph and device == "cpu+gpu":
        raise PlanError(
            "cpu+gpu (pipelined) plans are for max-pooling (chain) networks; plan a graph network "
            "with device 'gpu' or 'cpu'"
        )
    use_cache = use_cache and cost_model is None
    cache = W.JsonCache(cache_dir() / "plans.json", max_entries=PLAN_CACHE_ENTRIES) if use_cache else None
    ckey = (
        f"{net.digest()}|{budget}|{device}|{placement}|{effort}|{threads}|{prims}|{patch_shape}|{pool_modes}|"
        f"{input_shape}|{SEARCH_VERSION}|{T.machine_key(threads)}|{level}"
        + (f"|{overlap}|{blend}" if graph else "")
        + (f"|{gpu_cal.device}|{gpu_cal.gemm_flops:.3g}" if gpu_cal else "")
    )
    if cache is not None and (hit := cache.get(ckey)):
        return Plan.from_dict(hit)

    timer = Pricer(effort, threads, gpu_cal, gpu_xp, model=cost_model)
    common = dict(
        budget=budget,
        device=device,
        effort=effort,
        threads=threads,
        timer=timer,
        patch_shape=patch_shape,
        input_shape=input_shape,
    )
    if graph:
        plan = autotune_graph(
            net, prims=primitives or (None if device == "cpu" else prims), overlap=overlap, blend=blend, **common
        )
    else:
        plan = autotune_chain(
            net, prims=prims, host=host, pool_modes=pool_modes, placement=placement, gpu_cal=gpu_cal, **common
        )
    if cache is not None:
        cache.put(ckey, plan.to_dict())
    return plan


def _budgets(device, memory_budget, threads) -> tuple:
    """(budget, the GPU's calibration, its array module, the host's budget and cost model) of a
    request; the last three None on the CPU."""
    if device == "cpu":
        return (int(memory_budget) if memory_budget is not None else default_budget()), None, None, None
    budget, gpu_cal, gpu_xp = device_budget(memory_budget)
    host_cal = T.calibrate(threads)
    host = {"budget": default_budget(), "cal": host_cal, "model": CpuCostModel(host_cal), "threads": threads}
    return budget, gpu_cal, gpu_xp, host


def _primitives(primitives, device) -> tuple:
    """The conv primitives a search may use on ``device``, the defaults or the caller's (checked)."""
    # on the GPU the same xp code runs on CuPy; numba's CPU kernel and FFTW threads do not apply
    prims = tuple(primitives or (CPU_PRIMITIVES if device == "cpu" else GPU_PRIMITIVES))
    bad = [p for p in prims if p not in CONV_PRIMITIVES]
    if bad:
        raise PlanError(f"unknown primitives {bad}; choose from {CONV_PRIMITIVES}")
    on = "cpu" if device == "cpu" else "gpu"
    elsewhere = [p for p in prims if on not in PRIMITIVES[p].devices]
    if elsewhere:
        raise PlanError(
            f"primitives {elsewhere} do not run on the {on.upper()}; choose from {names(on)}"
            + (
                "; direct-torch (cuDNN through PyTorch) is a GPU primitive: plan with device 'gpu'"
                if "direct-torch" in elsewhere
                else ""
            )
        )
    return prims
