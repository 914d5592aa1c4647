"""Planning: memory and time models, the measurement cache, the autotuner and the Plan value."""

from .plan import Plan, Rejected, Step
from .search import autotune

__all__ = ["Plan", "Rejected", "Step", "autotune"]
