"""Bounded retries of remote storage requests: how many attempts a request gets.

The remote clients (``io/s3.py``, ``io/gcs.py``, ``io/http.py``) retry transient failures only, a bounded number
of times; the bound is a default a user may lower or raise through the environment.
"""

from __future__ import annotations

import os
import random

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


def jittered_backoff(attempt: int, base: float, cap: float, rng=None) -> float:
    """The wait before attempt ``attempt + 1`` (attempt 1 is the first): full jitter over an
    exponential ``base * 2^(attempt - 1)``, at most ``cap`` seconds.

    >>> all(0 <= jittered_backoff(k, 0.1, 20.0) <= min(20.0, 0.1 * 2 ** (k - 1)) for k in range(1, 12))
    True
    """
    return (rng or random).uniform(0, min(cap, base * 2 ** (attempt - 1)))
