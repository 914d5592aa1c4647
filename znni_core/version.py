"""znni's version (also in ``pyproject.toml``)."""

__version__ = "0.2.0"

#: The engine's arithmetic: raised whenever a change can alter an output byte of the same
#: network, plan and input (an operation's order, a kernel's rounding, a format's encoding), so
#: that a work directory of an earlier version is never taken as done for this one.
NUMERICS_VERSION = 1
