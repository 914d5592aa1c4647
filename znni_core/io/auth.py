"""When znni signs its ``s3://`` and ``gs://`` requests, and when it sends them anonymously.

Public datasets (open-data buckets on S3 and GCS) are read by anyone, but a signed request needs
credentials; a laptop or a cluster node often has none.  The rule (``ZNNI_SIGN_REQUESTS``):

* ``auto`` (the default): credentials found (a cloud-volume secrets file, the provider's default
  chain: environment variables, profiles, instance roles) -> every request is signed with them;
  none found -> reads are sent unsigned (anonymous), and a write is refused at once with a
  :class:`~znni_core.errors.StoragePermissionError` naming what to set;
* ``always``: credentials are required; none found is an error (reads included);
* ``never``: every request is unsigned, even where credentials exist (a public bucket read from a
  machine whose credentials belong to another account); writes are refused.

An unsigned read of a bucket that is not public is refused by the server (HTTP 403): the message
says the request went unsigned because no credentials were found.  ``http(s)://`` layers are read
without credentials (:mod:`.http`).
"""

from __future__ import annotations

import os

from ..errors import ConfigError, StoragePermissionError

SIGN_ENV = "ZNNI_SIGN_REQUESTS"
MODES = ("auto", "always", "never")


def sign_mode() -> str:
    """``ZNNI_SIGN_REQUESTS`` (``auto``, ``always`` or ``never``; unset: ``auto``).

    >>> sign_mode() in MODES
    True
    """
    v = (os.environ.get(SIGN_ENV) or "auto").strip().lower()
    if v not in MODES:
        raise ConfigError(f"{SIGN_ENV}={os.environ.get(SIGN_ENV)!r} must be one of {', '.join(MODES)}")
    return v


def unsigned_refusal(op: str, where: str, how_to_sign: str) -> StoragePermissionError:
    """The error of a write (or delete) through a client that sends unsigned requests."""
    why = (
        f"{SIGN_ENV}=never makes every request unsigned"
        if sign_mode() == "never"
        else "no credentials were found, so znni reads anonymously (unsigned)"
    )
    return StoragePermissionError(
        f"{op} {where}: {why} and cannot write; {how_to_sign} (and unset {SIGN_ENV}=never if set), then re-run"
    )
