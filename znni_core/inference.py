"""``infer``: the dense sliding-window output of a network on an array."""

from __future__ import annotations

import contextlib

import numpy as np

from .errors import InputError, PlanError
from .exec.device import device_limits
from .exec.executor import Executor
from .exec.tiling import input_extent
from .layers._numba import njit
from .layers.arena import give_back_memory
from .layers.threads import openmp_limit, run_threads, split_tasks
from .layers.xp import require_device
from .net.protocol import AnyNetwork
from .plan import autotune


def check_input(net: AnyNetwork, shape, dtype) -> tuple:
    """``shape`` as ``(C, Z, Y, X)`` (a ``(Z, Y, X)`` input is one channel) after checking it and
    ``dtype`` against ``net``: an :class:`InputError` names what is wrong and the fix."""
    if np.dtype(dtype).kind != "f":
        raise InputError(
            f"input dtype is {dtype}, expected float32; convert and normalise explicitly "
            "(e.g. x.astype(np.float32) / 255) - znni never rescales silently"
        )
    shape = tuple(int(n) for n in shape)
    if len(shape) == 3:
        shape = (1,) + shape
    if len(shape) != 4:
        raise InputError(f"input must be (C, Z, Y, X) or (Z, Y, X); got shape {shape}")
    if shape[0] != net.in_channels:
        raise InputError(f"input has {shape[0]} channel(s) but the network expects {net.in_channels}")
    fov = net.field_of_view
    if any(n < f for n, f in zip(shape[1:], fov)):
        raise InputError(
            f"input spatial shape {shape[1:]} (z, y, x) is smaller than the field of view {fov}; "
            "give at least one field of view of context on every axis"
        )
    return shape


def as_input(net: AnyNetwork, x) -> np.ndarray:
    """Validate and normalise ``x`` to float32 ``(C, Z, Y, X)`` (no silent rescaling)."""
    if not isinstance(x, np.ndarray):
        raise InputError(f"input must be a numpy array, got {type(x).__name__}")
    x = x.reshape(check_input(net, x.shape, x.dtype))
    with np.errstate(over="ignore"):  # a float64 value beyond float32's range: inf, refused below
        x = np.ascontiguousarray(x, dtype=np.float32)
    if _non_finite(x.reshape(-1).view(np.uint32)):
        z = next(z for z in range(x.shape[1]) if not np.isfinite(x[:, z]).all())
        raise InputError(f"input holds NaN/Inf value(s) (first in z-slice {z}); clean or mask the input")
    return x


#: float32 values per task of the input's check (:func:`_non_finite`)
_CHECK_CHUNK = 1 << 18


@njit(nogil=True, cache=True)
def _exponent_max(bits, k0, k1, found):  # pragma: no cover - compiled
    """``found[k]``: the largest exponent field (bits & 0x7F800000) of float32 values (their bits)
    ``[k * chunk, (k + 1) * chunk)``, for ``k`` in ``[k0, k1)``.  An integer max vectorises (a
    float test does not, its order being fixed): 100 MB in 3 ms, not 7.5."""
    n = np.uint64(bits.size)
    chunk = np.uint64(_CHECK_CHUNK)
    for k in range(k0, k1):
        m = np.uint32(0)
        for i in range(np.uint64(k) * chunk, min(n, np.uint64(k + 1) * chunk)):
            m = max(m, bits[i] & np.uint32(0x7F800000))
        found[k] = m


def _non_finite(bits) -> bool:
    """Whether float32 values (their bits, flat) hold a NaN or an Inf: exponent bits all set.  A
    nogil kernel over chunks on the host's threads (:func:`.layers.threads.split_tasks`): as a
    numba ``prange`` loop it took 3 s of a first ``znni warmup``'s compile, this 0.3 s."""
    found = np.zeros(-(-bits.size // _CHECK_CHUNK), np.uint32)
    split_tasks(lambda k0, k1: _exponent_max(bits, k0, k1, found), found.size)
    return found.size > 0 and int(found.max()) == 0x7F800000


@contextlib.contextmanager
def thread_limits(threads: int):
    """Give numba and OpenMP the plan's thread count for the duration of a run, BLAS one thread
    and znni's GEMMs the plan's threads (:func:`~znni_core.layers.threads.run_threads`)."""
    try:
        import numba  # loaded already (the kernels); the try guards a numba without thread control

        old = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except Exception:  # numba missing or not configurable: nothing to restore
        numba, old = None, None
    try:
        with openmp_limit(threads), run_threads(threads):
            yield
    finally:
        if numba is not None and old is not None:
            numba.set_num_threads(old)


def infer(
    net: AnyNetwork,
    x,
    *,
    device: str = "cpu",
    memory_budget: int | None = None,
    plan=None,
    progress=None,
    cache: dict | None = None,
) -> np.ndarray:
    """Dense sliding-window output of ``net`` on ``x``.

    ``x`` is ``(C, Z, Y, X)`` or ``(Z, Y, X)`` float32; the result is
    ``(C_out, Z - Fz + 1, Y - Fy + 1, X - Fx + 1)`` float32 with
    ``out[:, i, j, k] = net(x[:, i:i+Fz, j:j+Fy, k:k+Fx])``.  Without a ``plan`` one is
    made with ``effort="estimate"`` under ``memory_budget`` (bytes; default a fraction
    of available RAM) for this input's shape (no patch larger than ``x``; an input smaller
    than one good patch runs as one patch) and cached on disk for the next call.  The
    budget bounds the engine's working memory per patch; the whole input and the
    returned array are extra.  What the plan's primitives build (transformed kernels, FFT
    spectra: counted in the plan's budget) and its buffers stay after the call in the
    :class:`~.exec.executor.Executor` it ran, for the next call with the same plan (at most one
    plan's: a call with another plan replaces it; :func:`release_cache` closes it).  ``cache``:
    a dict of the caller's that keeps its own executor instead (e.g. the blocks of a task, or
    several plans at once, one dict each).

    >>> import numpy as np
    >>> from znni_core.net import Network, Conv
    >>> net = Network((Conv(np.ones((1, 1, 2, 2, 2), np.float32)),))
    >>> infer(net, np.ones((3, 3, 3), np.float32)).shape
    (1, 2, 2, 2)
    """
    xp = require_device(device)
    x = as_input(net, x)
    input_extent(net, x.shape[1:])  # names the smallest admissible input when x is below it
    if plan is None:
        # bounded by the work: no patch larger than this input (cached by shape, like FFTW wisdom)
        plan = autotune(net, memory_budget=memory_budget, device=device, effort="estimate", input_shape=x.shape[1:])
    elif plan.network_digest != net.digest():
        raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")
    elif plan.device != device:
        raise PlanError(f"the plan is for device {plan.device!r} but device={device!r} was requested")
    run = executor_for(_LAST if cache is None else cache, plan, net, xp)
    with run_limits(plan, xp):
        return run.volume(x, progress=progress)


@contextlib.contextmanager
def run_limits(plan, xp=np):
    """A run of ``plan``: its thread count (:func:`thread_limits`) and, on a device (``xp`` not
    numpy), the device's memory pool capped at the plan's budget (:func:`.exec.device.device_limits`)."""
    with thread_limits(plan.threads), contextlib.nullcontext() if xp is np else device_limits(xp, plan):
        yield


#: the executor of the last plan ``infer`` ran without a ``cache`` of its caller's
_LAST: dict = {}


def executor_for(holder: dict, plan, net, xp=np) -> Executor:
    """The :class:`~.exec.executor.Executor` ``holder`` keeps for ``plan``, built (and the one it
    kept for another plan closed) when it keeps none for it."""
    run = holder.get("executor")
    if run is None or not run.runs(plan, xp):
        if run is not None:
            run.close()
        run = holder["executor"] = Executor(plan, net, xp=xp)
    return run


def release_cache() -> None:
    """Close the executor ``infer`` keeps between calls (its kernels, spectra and buffers) and hand
    the memory the process keeps for reuse back to the OS (``layers.arena.give_back_memory``)."""
    run = _LAST.pop("executor", None)
    if run is not None:
        run.close()
    give_back_memory()
