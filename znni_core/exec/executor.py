"""A plan built for its network once: the object that runs it.

An :class:`Executor` owns what a run keeps from one patch to the next: the program (the plan read
against its network: fused passes, pooling swaps, channels-last tensors), each primitive's built
state (Winograd's transformed kernels, FFT kernel spectra, weights on a device, their call
buffers) and the arena of output buffers.  Build one per plan, run every patch, window or volume
of that plan through it, and close it (or leave a ``with`` block) to release what it holds::

    with Executor(plan, net) as run:
        outs = [run.volume(v) for v in volumes]

``infer`` keeps the last executor it built for the next call with the same plan
(:func:`znni_core.release_cache` closes it); a job keeps one for all its tasks.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..layers import tuning
from ..plan.program import program
from .patch import run_back, run_front, run_patch
from .tiling import run_tiled, run_window


class Executor:
    """``plan`` built for ``net`` on ``xp`` (numpy, or a device's array module); see the module
    docstring.  The plan's kernel parameters are put in force when it is built."""

    def __init__(self, plan, net, *, xp=np):
        if plan.network_digest != net.digest():
            raise PlanError("the plan was made for another network (digest mismatch); re-run `znni plan`")
        self.plan, self.net, self.xp = plan, net, xp
        tuning.apply(plan.tuning)
        self.program = program(plan.steps, net, xp)
        self._state: dict | None = {}  # the primitives' built state and the arena (exec/steps.py)

    @property
    def state(self) -> dict:
        """What the primitives built for this plan (a :class:`PlanError` once closed)."""
        if self._state is None:
            raise PlanError("this executor was closed; build another for the plan")
        return self._state

    def runs(self, plan, xp) -> bool:
        """Whether this executor runs ``plan`` on ``xp`` (the same steps on the same device)."""
        return self._state is not None and xp is self.xp and _key(plan) == _key(self.plan)

    # ---- running --------------------------------------------------------------------------------
    def patch(self, x):
        """The network's output on one admissible patch ``(C, n)`` (:func:`~.patch.run_patch`)."""
        return run_patch(self.plan, self.net, x, xp=self.xp, convs=self.state, prog=self.program)

    def front(self, x):
        """A ``cpu+gpu`` plan's CPU stage on one patch (:func:`~.patch.run_front`)."""
        return run_front(self.plan, self.net, x, convs=self.state.setdefault("front", {}))

    def back(self, h):
        """A ``cpu+gpu`` plan's GPU stage on the CPU stage's result (:func:`~.patch.run_back`)."""
        return run_back(self.plan, self.net, h, xp=self.xp, convs=self.state.setdefault("back", {}))

    def window(self, x, win, *, progress=None) -> np.ndarray:
        """The output over a :class:`~.tiling.Window` from ``x``, the input its patches read."""
        return run_window(self, x, win, progress=progress)

    def volume(self, x, *, progress=None) -> np.ndarray:
        """The network's output on the whole of ``x`` ``(C, Z, Y, X)`` (:func:`~.tiling.run_tiled`)."""
        return run_tiled(self, x, progress=progress)

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the kernels, spectra and buffers it holds (a device's return to its pool)."""
        if self._state is not None:
            self._state.clear()
        self._state = None

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _key(plan) -> tuple:
    """What makes two plans run alike: the network, the device, the kernel parameters, the tiles,
    the placement and every step's choices and shapes."""
    steps = tuple((s.index, s.op, s.primitive, s.in_shape, s.micro_batch, s.tile) for s in plan.steps)
    return (plan.network_digest, plan.device, repr(plan.tuning), plan.tile, plan.placement, plan.split, steps)
