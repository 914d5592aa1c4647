"""The vector width numba compiles znni's kernels for: chosen per host, by measurement.

LLVM picks a preferred vector width from the CPU's name, not from a measurement: for Intel
server cores (``skylake-avx512``, ``cascadelake``, ``icelake-server``, ``sapphirerapids``) it
prefers 256-bit vectors (the ``prefer-256-bit`` tuning flag), so a float32 loop there compiles to
ymm registers although the core has two 512-bit FMA ports; for AMD Zen 4 and Zen 5 it emits zmm
code.  Which one is faster depends on the kernel and the host (frequency licences, one or two
512-bit units), so on a host with AVX-512 ``znni warmup`` compiles and times znni's kernels both
ways (:mod:`znni_core.warmup`) and keeps the faster; every later process on that host compiles
for it (:func:`apply`, before numba compiles anything).  Hosts without AVX-512 have one variant.

Precedence, first wins:

1. ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES`` set by the user: left as they are;
2. ``ZNNI_VECTOR_WIDTH=512|256``: that width; ``host``: LLVM's own choice;
3. the width ``znni warmup`` measured best on this host (``<cache_dir>/vector_width.json``);
4. on an AVX-512 host not measured yet, 512-bit (:data:`DEFAULT`); elsewhere LLVM's own choice.

The choice changes only how loops are vectorised: every variant computes the same sums
(``tests/test_vector_width.py`` runs the kernels compiled for 512-bit, 256-bit and AVX2-only
targets against the reference).  numba keys its cached kernels by the feature string, so the
variants' caches never mix.  This module imports no numba (``layers/_numba.py`` applies it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from importlib.metadata import PackageNotFoundError, version

import llvmlite.binding as ll

from ..cachedir import cache_dir

__all__ = [
    "VARIANTS",
    "apply",
    "candidates",
    "choice_path",
    "chosen",
    "effective",
    "features_for",
    "host_features",
    "host_key",
    "record",
    "target",
]

#: width -> the tuning flag added to the host's feature string
VARIANTS = {"512": "-prefer-256-bit", "256": "+prefer-256-bit"}
CHOICE_FILE = "vector_width.json"
#: the width of an AVX-512 host before ``znni warmup`` measured it
DEFAULT = "512"


@functools.lru_cache(maxsize=1)
def host_features() -> str:
    """The host's CPU features as LLVM names them (``+avx512f,...``), as numba reads them."""
    try:
        return ll.get_host_cpu_features().flatten()
    except RuntimeError:  # LLVM cannot read this CPU's features: numba uses none either
        return ""


@functools.lru_cache(maxsize=1)
def host_cpu_name() -> str:

    return ll.get_host_cpu_name()


def _dist(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def host_key() -> str:
    """Keys a measured choice: LLVM's CPU name and features, numba's and llvmlite's versions
    (another LLVM may vectorise otherwise)."""
    raw = json.dumps([host_cpu_name(), host_features(), _dist("numba"), _dist("llvmlite")])
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def candidates() -> tuple:
    """The widths worth measuring here: both on AVX-512 hosts, none elsewhere (AVX2 has one)."""
    return tuple(VARIANTS) if "+avx512f" in host_features().split(",") else ()


def features_for(width: str) -> str:
    """The ``NUMBA_CPU_FEATURES`` string of a width on this host."""
    if width not in VARIANTS:
        raise ValueError(f"vector width {width!r}: choose one of {', '.join(VARIANTS)} or 'host'")
    base = [f for f in host_features().split(",") if f and not f.endswith("prefer-256-bit")]
    return ",".join(base + [VARIANTS[width]])


def choice_path():
    """The JSON file of measured choices, one entry per host: ``vector_width.json`` in the cache directory."""
    return cache_dir(create=False) / CHOICE_FILE


def _read() -> dict:
    try:
        data = json.loads(choice_path().read_text())
    except (OSError, ValueError):
        return {}  # no choice yet, or an unreadable file (only a cache): LLVM's own choice
    return data if isinstance(data, dict) else {}


def chosen() -> dict | None:
    """This host's measured choice ``{"width", "seconds", ...}``, or None."""
    entry = _read().get(host_key())
    return entry if isinstance(entry, dict) and entry.get("width") in VARIANTS else None


def record(width: str, seconds: dict, detail: dict | None = None) -> dict:
    """Store this host's choice (atomically; other hosts' entries kept)."""
    if width not in VARIANTS:
        raise ValueError(f"vector width {width!r}: choose one of {', '.join(VARIANTS)}")
    entry = {"width": width, "seconds": seconds, "cpu": host_cpu_name(), **(detail or {})}
    path = choice_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read()
    data[host_key()] = entry
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return entry


def target(environ=None) -> tuple[str, str | None]:
    """``(source, features)``: where the width comes from (``user``, ``env``, ``measured``,
    ``default``, ``llvm``) and the ``NUMBA_CPU_FEATURES`` to set (None: leave numba's default)."""
    env = os.environ if environ is None else environ
    if env.get("NUMBA_CPU_NAME") or env.get("NUMBA_CPU_FEATURES"):
        return "user", None
    want = (env.get("ZNNI_VECTOR_WIDTH") or "auto").strip().lower()
    if want == "host":
        return "llvm", None
    if want != "auto":
        if want not in VARIANTS:
            warnings.warn(
                f"ZNNI_VECTOR_WIDTH={want!r} is not one of 512, 256, host, auto: ignored (LLVM's own choice)",
                stacklevel=2,
            )
            return "llvm", None
        if not candidates():
            return "llvm", None  # one width on this host: nothing to choose
        return "env", features_for(want)
    if not candidates():
        return "llvm", None
    entry = chosen()
    if entry is None:  # not measured here yet: 512-bit (LLVM's own choice on Zen 4 and 5; on the
        return "default", features_for(DEFAULT)  # Cascade Lake host 8-22% faster than its 256)
    return "measured", features_for(entry["width"])


#: the feature string :func:`apply` gave numba in this process (None: numba's own)
APPLIED: str | None = None


def apply(config=None, environ=None) -> str:
    """Give numba's ``config`` (``numba.config``) the features of :func:`target`'s width, before
    numba compiles anything.  The process's environment is left alone: a Snakemake process that
    imports znni must not pass a NUMBA_ setting to its other rules; every znni process applies
    its own.  Returns the source of the choice."""
    global APPLIED
    source, feats = target(environ)
    if feats is not None and config is not None:
        config.CPU_FEATURES = feats
        APPLIED = feats
    return source


def effective() -> str:
    """What numba compiles for in this process: the user's ``NUMBA_CPU_NAME``/``FEATURES``, the
    applied width's features, or the host's (keys the calibration: :func:`plan.timing.machine_key`)."""
    env = os.environ
    return f"{env.get('NUMBA_CPU_NAME', '')}|{env.get('NUMBA_CPU_FEATURES') or APPLIED or ''}"


def describe() -> str:
    """One line for reports: the width numba compiles for here and why."""
    feats = os.environ.get("NUMBA_CPU_FEATURES") or APPLIED
    entry = chosen()
    if feats is None:
        width = "LLVM's choice for " + host_cpu_name()
    elif feats.endswith("-prefer-256-bit"):
        width = "512-bit"
    elif feats.endswith("+prefer-256-bit"):
        width = "256-bit"
    else:
        width = "NUMBA_CPU_FEATURES as set"
    if entry:
        return f"{width} (measured here: " + ", ".join(f"{w}-bit {s:.3f} s" for w, s in entry["seconds"].items()) + ")"
    return width
