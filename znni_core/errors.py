"""One error hierarchy for znni.

Every error subclasses :class:`ZnniError` *and* the matching built-in, so callers
can catch either.  Messages state the offending value, why it is refused, and the fix.
"""

from __future__ import annotations


class ZnniError(Exception):
    """Base class of every error znni raises on purpose."""


class NetworkError(ZnniError, ValueError):
    """A network file or spec is malformed, unsafe or uses something znni does not support."""


class UnsupportedOperatorError(NetworkError):
    """An ONNX node (or spec layer) is outside the supported chain of operators."""


class InputError(ZnniError, ValueError):
    """An input array does not match what the network or plan expects."""


class PlanError(ZnniError, ValueError):
    """No plan satisfies the constraints, or a plan does not fit the network/input."""


class MemoryBudgetError(PlanError):
    """Nothing fits in the memory budget."""


class DeviceError(ZnniError, RuntimeError):
    """A GPU was requested but is not usable here."""


class ConfigError(ZnniError, ValueError):
    """The workflow configuration is invalid."""


class DataError(ZnniError, RuntimeError):
    """Stored data is missing, corrupt or inconsistent (chunks, manifests, layers)."""


class NonFiniteError(DataError):
    """NaN or Inf appeared where only finite values are allowed."""


class StorageError(DataError):
    """A storage request failed: refused by the server, or still failing after bounded retries."""


class StoragePermissionError(StorageError):
    """The storage refused access (HTTP 403, bad or missing credentials): permanent, never retried."""
