"""Planning: memory and time models, the measurement cache, the autotuner and the Plan value."""
from .plan import Plan, Rejected, Step

__all__ = ["Plan", "Rejected", "Step", "autotune"]


def autotune(net, **kw):
    """See :func:`znni_core.plan.autotune.autotune`."""
    from .autotune import autotune as _autotune

    return _autotune(net, **kw)
