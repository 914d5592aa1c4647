"""Bounded retries of remote storage requests: how many attempts a request gets.

Both remote clients (``io/s3.py``, ``io/gcs.py``) retry transient failures only, a bounded number
of times; the bound is a default a user may lower or raise through the environment.
"""

from __future__ import annotations

import os

from ..errors import ConfigError


def attempts_from_env(var: str, default: int, service: str) -> int:
    """Attempts per request, the first included: ``$var`` if set (an integer from 1 to 20), else ``default``.

    >>> attempts_from_env("ZNNI_DOCTEST_UNSET_ATTEMPTS", 5, "S3")
    5
    """
    v = os.environ.get(var)
    if not v:
        return default
    try:
        n = int(v)
    except ValueError:
        n = 0
    if not 1 <= n <= 20:
        raise ConfigError(f"{var}={v!r} must be an integer from 1 to 20 (attempts per {service} request)")
    return n
