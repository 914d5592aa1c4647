"""One error hierarchy for znni.

Every error subclasses :class:`ZnniError` *and* the matching built-in, so callers
can catch either.  Messages state the offending value, why it is refused, and the fix.
"""

from __future__ import annotations


class ZnniError(Exception):
    """Base class of every error znni raises on purpose.

    ``exit_code``: what the CLI exits with on it: 2 for a wrong input or request (the config, a
    network, an argument, a plan that cannot fit: fix it and re-run), 1 for a failure while
    running (stored data missing or corrupt, storage refusing, no device).
    """

    exit_code = 1


class NetworkError(ZnniError, ValueError):
    """A network file or spec is malformed, unsafe or uses something znni does not support."""

    exit_code = 2


class UnsupportedOperatorError(NetworkError):
    """An ONNX node (or spec layer) is outside the supported chain of operators."""


class InputError(ZnniError, ValueError):
    """An input array does not match what the network or plan expects."""

    exit_code = 2


class PlanError(ZnniError, ValueError):
    """No plan satisfies the constraints, or a plan does not fit the network/input."""

    exit_code = 2


class MemoryBudgetError(PlanError):
    """Nothing fits in the memory budget."""


class DeviceError(ZnniError, RuntimeError):
    """A GPU was requested but is not usable here."""


class ConfigError(ZnniError, ValueError):
    """The workflow configuration is invalid."""

    exit_code = 2


class DataError(ZnniError, RuntimeError):
    """Stored data is missing, corrupt or inconsistent (chunks, manifests, layers)."""


class NonFiniteError(DataError):
    """NaN or Inf appeared where only finite values are allowed."""


class StorageError(DataError):
    """A storage request failed: refused by the server, or still failing after bounded retries."""


class StoragePermissionError(StorageError):
    """The storage refused access (HTTP 403, bad or missing credentials): permanent, never retried."""
