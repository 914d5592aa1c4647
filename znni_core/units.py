"""Sizes as people write them (``"2GiB"``, ``"500MB"``, ``"1e9"``) and as messages print them."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text) -> int:
    """``"2GiB"``, ``"500MB"``, ``"1e6"`` -> bytes; ``ValueError`` names the text otherwise."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes or a unit like 512MiB, 2GiB, 8GB")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except OverflowError:  # 1e400 is inf as a float
        raise ValueError(f"{text!r} is too large a size; use bytes or a unit like 512MiB, 2GiB, 8GB") from None
    except ValueError:
        raise ValueError(f"{text!r} is not a size; use bytes or a unit like 512MiB, 2GiB, 8GB") from None


def format_bytes(b: float) -> str:
    """A size as messages print it: GiB from a quarter GiB up, else MiB.

    >>> format_bytes(2**30), format_bytes(3 * 2**20)
    ('1.000 GiB', '3.0 MiB')
    """
    return f"{b / 2**30:.3f} GiB" if b >= 2**28 else f"{b / 2**20:.1f} MiB"
