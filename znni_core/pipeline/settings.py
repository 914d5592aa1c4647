"""The workflow configuration: its schema, its validation, and the typed :class:`Config` it becomes.

``config.yaml`` is checked against ``config.schema.yaml`` (JSON schema, defaults filled in) by
:func:`validate_config`; :func:`parse_config` turns the checked mapping into a frozen
:class:`Config` of sections (``cfg.output.chunk_size``, ``cfg.plan.effort``), which every later
step reads. The schema stays the one source of names, defaults and bounds: a test checks that
every section here has exactly the schema's keys. ``Config.to_dict`` gives the checked mapping
back (it is what ``run.json`` records and what a run's digest covers).

>>> cfg = parse_config({"input": {"path": "file:///em", "dtype": "uint8"},
...                     "network": {"path": "net.onnx"}, "output": {"path": "file:///out"}})
>>> cfg.output.chunk_size, cfg.plan.effort, cfg.mask is None, cfg.tta.flips
([16, 64, 64], 'estimate', True, [])
>>> parse_config(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import ConfigError
from ..io.chunk_cache import MEMORY_BYTES

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


@dataclass(frozen=True)
class LayerSettings:
    """Where a layer read lies: its URL, scale, S3 endpoint and (zarr) resolution."""

    path: str
    mip: int
    endpoint_url: str | None
    resolution: list | None


@dataclass(frozen=True)
class InputSettings(LayerSettings):
    """``input:`` the EM layer read."""

    dtype: str
    checksums: str  # auto | required | none
    missing: str  # fail | zero
    empty: str  # skip | compute


@dataclass(frozen=True)
class MaskSettings(LayerSettings):
    """``mask:`` only output chunks a non-zero mask voxel overlaps are computed."""

    missing: str  # fail | zero


@dataclass(frozen=True)
class NetworkSettings:
    """``network:`` the trained network and the resolution it was trained at."""

    path: str
    resolution: list | None
    endpoint_url: str | None = None  # an s3:// network's endpoint


@dataclass(frozen=True)
class Normalize:
    """``normalize:`` network input = raw * scale + shift."""

    scale: float
    shift: float


@dataclass(frozen=True)
class OutputSettings:
    """``output:`` the layer written."""

    path: str
    dtype: str
    scale: float | None
    offset: float
    chunk_size: list
    encoding: str
    compression: str
    endpoint_url: str | None
    scale_key: str | None
    sharding: str | dict  # auto | none | sharded, or a sharding spec
    shard_bytes: str | int  # auto, or bytes
    align: bool


@dataclass(frozen=True)
class Downsample:
    """``downsample:`` the pyramid built after the tasks."""

    mips: int
    factor: list


@dataclass(frozen=True)
class Region:
    """``region:`` the output box, (z, y, x) voxels."""

    offset: list
    shape: list


@dataclass(frozen=True)
class Jobs:
    """``jobs:`` how tasks are grouped into Snakemake jobs."""

    tasks_per_job: str | int
    minutes: float
    max_jobs: int
    voxels_per_second: float | None
    cache_gb: float = 4.0

    @property
    def cache_bytes(self) -> int:
        """What a job's input cache may hold: ``cache_gb`` on disk and its share in memory; 0: none."""
        return int(self.cache_gb * 2**30) + MEMORY_BYTES if self.cache_gb else 0


@dataclass(frozen=True)
class PlanSettings:
    """``plan:`` how the engine's plan is made."""

    effort: str  # estimate | measure | exhaustive
    memory_fraction: float
    file: str | None
    gpu_memory: str | None


@dataclass(frozen=True)
class Blend:
    """``blend:`` patches of zero-padded graph networks."""

    mode: str
    overlap: list | None
    patch_shape: list | None


@dataclass(frozen=True)
class Tta:
    """``tta:`` test-time augmentation."""

    flips: list
    transpose_xy: bool
    variance: bool

    @property
    def on(self) -> bool:
        """Whether any augmentation (or the variance) is asked for."""
        return bool(self.flips or self.transpose_xy or self.variance)


@dataclass(frozen=True)
class FinalizeSettings:
    """``finalize:`` the last check and the report."""

    verify: str  # checksum | exists
    neuroglancer: str
    serve_port: int


@dataclass(frozen=True)
class Config:
    """A checked ``config.yaml``: one attribute per top-level key, sections as records."""

    work_dir: str
    input: InputSettings
    network: NetworkSettings
    normalize: Normalize
    output: OutputSettings
    downsample: Downsample
    region: Region | None
    task_chunks: str | list  # auto, or (z, y, x) chunks
    jobs: Jobs
    edge: str  # valid | mirror | zero
    device: str  # cpu | gpu | cpu+gpu
    plan: PlanSettings
    blend: Blend
    verify_voxels: str | int
    tta: Tta
    recompute: str  # none | changed | inputs
    finalize: FinalizeSettings
    mask: MaskSettings | None = None
    work_endpoint_url: str | None = None  # an s3:// work_dir's endpoint
    container: str | None = None  # the rules' container: directive (docs/cloud.md)

    def to_dict(self) -> dict:
        """The checked mapping this config was made from (``mask`` left out when there is none)."""
        doc = dataclasses.asdict(self)
        if doc["mask"] is None:
            del doc["mask"]
        return doc


def schema() -> dict:
    """The config's JSON schema (libyaml's loader where PyYAML has it: the pure-Python one took
    0.1 s per parse, and ``validate`` checked the config three times)."""
    return yaml.load(SCHEMA_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.lru_cache(maxsize=1)
def _validator():
    # lazy: loads jsonschema only when called
    import jsonschema

    base = jsonschema.Draft202012Validator

    def set_defaults(validator, properties, instance, sch):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from base.VALIDATORS["properties"](validator, properties, instance, sch)

    cls = jsonschema.validators.extend(base, {"properties": set_defaults})
    return cls(schema())


def _non_finite(obj, path="") -> list:
    """``[(dotted key, value)]`` of the NaN and infinite numbers in a config (YAML reads ``.nan``
    and ``.inf``; JSON schema bounds never refuse a NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return [(path or "<top>", obj)]
    if isinstance(obj, dict):
        return [b for k, v in obj.items() for b in _non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, list):
        return [b for i, v in enumerate(obj) for b in _non_finite(v, f"{path}[{i}]")]
    return []


def validate_config(cfg: dict) -> dict:
    """Schema check with defaults filled in; :class:`ConfigError` lists every problem with its key."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"the configuration must be a mapping, got {type(cfg).__name__}")
    cfg = copy.deepcopy(cfg)
    bad = _non_finite(cfg)
    if bad:
        raise ConfigError(
            "invalid configuration: " + ", ".join(f"{k} is {v}" for k, v in bad) + "; every number must be finite"
        )
    v = _validator()
    errors = sorted(v.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {'.'.join(str(p) for p in e.absolute_path) or '<top>'}: {e.message}" for e in errors]
        raise ConfigError(
            "invalid configuration (see config.yaml comments / docs/configuration.md):\n" + "\n".join(lines)
        )
    # a second pass fills defaults inside objects that were themselves defaulted
    list(v.iter_errors(cfg))
    return cfg


def parse_config(cfg: dict | Config) -> Config:
    """The typed :class:`Config` of a mapping, checked by :func:`validate_config` first (a
    :class:`Config` is returned as it is)."""
    if isinstance(cfg, Config):
        return cfg
    return _build(Config, validate_config(cfg))


def load_config(path) -> Config:
    """Read a config.yaml and check it (:func:`parse_config`, defaults filled in).

    A missing or unreadable file (a directory, not UTF-8) or invalid YAML is a :class:`ConfigError`;
    an empty file is an empty config.
    """
    path = Path(path)
    try:
        cfg = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:  # a directory, a permission or I/O error
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    return parse_config(cfg or {})


def sections() -> dict:
    """``{record: schema properties}`` for :class:`Config` and each of its sections (what the
    test that keeps them equal compares)."""
    props = schema()["properties"]
    out = {Config: props}
    for f in dataclasses.fields(Config):
        kind = _record_type(typing.get_type_hints(Config)[f.name])
        if kind is not None:
            out[kind] = props[f.name]["properties"]
    return out


def _record_type(hint):
    """The record class in a field's type (``Region | None`` -> ``Region``), or None."""
    return next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)


def _build(cls, doc: dict):
    """``cls`` from a schema-checked mapping (sections built recursively; keys are the schema's)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in doc:
            continue  # optional sections (mask) keep their default
        v, kind = doc[f.name], _record_type(hints[f.name])
        values[f.name] = _build(kind, v) if kind is not None and v is not None else v
    return cls(**values)
