"""The run: what ``znni validate`` resolved from a config, and every later step reads.

``validate`` opens the network and the layers, makes the plan and writes the run to
``<work_dir>/run.json`` (:func:`save_run`); tasks, jobs, the pyramid, finalize, verify and serve
read it back with :func:`load_run` as a :class:`Run`, and recompute its grid of chunks and tasks
with :func:`run_geometry`. Its parts are typed records; the
config is a :class:`~.settings.Config` (checked again when read: an older run's config gets
the defaults of keys added since); the values that are themselves documents (a layer's ``info``
and scale, boxes as ``{"offset", "shape"}``) stay JSON objects.

>>> run = Run.from_json(EXAMPLE, "example")
>>> run.output.url, run.plan.patch_shape, run.mask is None
('file:///data/out', [32, 64, 64], True)
>>> Run.from_json(run.to_json(), "again") == run
True
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..geometry import ChunkGrid, Coordinate, Halo, Roi, TaskGrid
from ..io import ScaleSpec, atomic_write
from ..io.info import scale_spec
from ..io.workdir import WorkPath, is_remote_work, work_path
from .identity import IDENTITY_FILE, identity_document
from .settings import Config, load_config, parse_config

RUN_FORMAT = "znni-run/1"


@dataclass(frozen=True)
class NetworkRecord:
    """The network a run computes: its file, digest and geometry."""

    path: str
    digest: str
    field_of_view: list
    kind: str  # chain | valid | padded
    halo: dict  # {"low": [z, y, x], "high": [z, y, x]}
    in_channels: int
    out_channels: int


@dataclass(frozen=True)
class InputRecord:
    """The input layer as validate found it."""

    url: str
    mip: int
    bounds: dict  # Roi.to_dict()
    resolution: list
    dtype: str
    channels: int


@dataclass(frozen=True)
class MaskRecord:
    """The mask layer (``mask:`` in the config)."""

    url: str
    mip: int
    bounds: dict
    resolution: list


@dataclass(frozen=True)
class OutputRecord:
    """The output layer: its URL, the scale it is written at and its whole ``info``."""

    url: str
    scale: dict
    info: dict


@dataclass(frozen=True)
class PlanRecord:
    """The plan every task runs (``plan.json``) and what identifies it."""

    path: str
    digest: str
    patch_shape: list
    memory_budget: int


@dataclass(frozen=True)
class Run:
    """A resolved run (``run.json``). ``digest`` is that of its ``identity`` (:mod:`.identity`:
    everything that can change an output byte): a task or manifest of another digest belongs to
    another run, and is never taken as done for this one."""

    config: Config
    work_dir: str
    network: NetworkRecord
    input: InputRecord
    output: OutputRecord
    region: dict  # Roi.to_dict() of the output region
    mask: MaskRecord | None
    task_chunks: list
    num_tasks: int
    num_chunks: int
    plan: PlanRecord
    mem_mb: int | None
    created: str
    versions: dict
    digest: str
    input_checksums: str = "none"  # what verifies every input read: sha256 | crc32c | none
    identity: dict | None = None  # what the output bytes depend on (:mod:`.identity`); digest covers it
    format: str = RUN_FORMAT

    @classmethod
    def from_json(cls, doc, where: str) -> Run:
        """The run of a ``run.json`` document; a :class:`ConfigError` naming ``where`` and the key
        when it is not one (missing or mistyped keys: an edited or foreign file)."""
        if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
            raise ConfigError(f"{where} is not a znni run file ({RUN_FORMAT}); re-run `znni validate`")
        return _record(cls, doc, where, "")

    def to_json(self) -> dict:
        """The ``run.json`` document."""
        return dataclasses.asdict(self) | {"config": self.config.to_dict()}


_RECORDS = (NetworkRecord, InputRecord, MaskRecord, OutputRecord, PlanRecord)


def _record(cls, doc: dict, where: str, prefix: str):
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if f.name not in doc:
            if f.default is not dataclasses.MISSING:
                continue
            raise ConfigError(f"{where}: key {key!r} is missing; re-run `znni validate` to write the run again")
        v, hint = doc[f.name], hints[f.name]
        optional = type(None) in typing.get_args(hint)
        kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint) if optional else hint
        if v is None and optional:
            values[f.name] = None
        elif kind is Config:
            try:
                values[f.name] = parse_config(v)
            except ConfigError as exc:
                raise ConfigError(f"{where}: key {key!r}: {exc}; re-run `znni validate`") from None
        elif kind in _RECORDS:
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: key {key!r} is {type(v).__name__}, not an object; re-run `znni validate`")
            values[f.name] = _record(kind, v, where, key + ".")
        else:
            # kind: str, int, list or dict (typing.get_type_hints resolved the annotations)
            if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
                raise ConfigError(
                    f"{where}: key {key!r} is {type(v).__name__}, not {kind.__name__}; re-run `znni validate`"
                )
            values[f.name] = v
    return cls(**values)


def save_run(run: Run, plan, work=None) -> Path:
    """Save ``plan`` to ``run.plan.path`` and ``run`` atomically to ``<work>/run.json`` (``work``:
    the run's work directory unless given; its identity to ``identity.json``, :mod:`.identity`);
    return the run file's path."""
    work = work_path(run) if work is None else work_path(work)
    plan.save(plan_path(run))
    path = work / "run.json"
    atomic_write(path, (json.dumps(run.to_json(), indent=1, sort_keys=True) + "\n").encode())
    atomic_write(work / IDENTITY_FILE, identity_document(run))
    return path


def load_run(path) -> Run:
    """Read a run file (``<work_dir>/run.json``, on a file system or an ``s3://``/``gs://`` work
    directory); a config.yaml is accepted and mapped to its run file."""
    path = location(path)
    if path.suffix in (".yaml", ".yml"):
        cfg = load_config(path)
        path = work_path(cfg) / "run.json"
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: run `znni validate CONFIG` (or the workflow) first") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); re-run `znni validate`") from exc
    except OSError as exc:  # a directory in its place, unreadable
        raise ConfigError(
            f"{path} cannot be read ({exc.strerror or exc}); give the run file <work_dir>/run.json"
        ) from exc
    return Run.from_json(run, str(path))


def location(path):
    """A path given on a command line or in a file: a local :class:`Path`, or a :class:`WorkPath`
    for an ``s3://`` / ``gs://`` URL (also as a shell or ``Path`` leaves it: ``s3:/bucket/key``)."""
    if isinstance(path, WorkPath):
        return path
    s = re.sub(r"^(s3|gs):/(?=[^/])", r"\1://", str(path))
    return work_path(s) if is_remote_work(s) else Path(path)


def plan_path(run: Run):
    """Where the run's plan is: ``run.plan.path``, under the run's work directory when that is a URL."""
    work = work_path(run)
    base = str(work)
    if is_remote_work(work) and run.plan.path.startswith(base + "/"):
        return work / run.plan.path[len(base) + 1 :]
    return location(run.plan.path)


def run_geometry(run: Run):
    """(region, grid, halo, tasks) of a run, recomputed deterministically.  The grid spans the
    output layer (``region``, or aligned below it); the tasks (a :class:`TaskGrid`, made on
    demand) cover the chunks the region touches."""
    region = Roi.from_dict(run.region)
    scale = run.output.scale
    bounds = Roi(Coordinate.from_xyz(scale["voxel_offset"]), Coordinate.from_xyz(scale["size"]))
    grid = ChunkGrid(bounds, Coordinate.from_xyz(scale["chunk_sizes"][0]))
    halo = Halo(run.network.halo["low"], run.network.halo["high"])
    return region, grid, halo, TaskGrid(grid, run.task_chunks, halo, region)


def output_spec(run: Run, mip: int = 0) -> ScaleSpec:
    """Mip ``mip`` of the run's output layer."""
    return scale_spec(run.output.info, mip, "run output")


def output_specs(run: Run) -> list[ScaleSpec]:
    """Every scale of the run's output layer (mip 0, then the pyramid's)."""
    return [output_spec(run, k) for k in range(len(run.output.info["scales"]))]


EXAMPLE = {  # the shape of a run.json, for the doctest above
    "format": RUN_FORMAT,
    "config": {
        "input": {"path": "file:///data/em", "dtype": "uint8"},
        "network": {"path": "/data/net.onnx"},
        "output": {"path": "file:///data/out"},
    },
    "work_dir": "/data/work",
    "network": {
        "path": "/data/net.onnx",
        "digest": "0" * 64,
        "field_of_view": [9, 9, 9],
        "kind": "chain",
        "halo": {"low": [4, 4, 4], "high": [4, 4, 4]},
        "in_channels": 1,
        "out_channels": 3,
    },
    "input": {
        "url": "file:///data/em",
        "mip": 0,
        "bounds": {"offset": [0, 0, 0], "shape": [64, 256, 256]},
        "resolution": [40.0, 4.0, 4.0],
        "dtype": "uint8",
        "channels": 1,
    },
    "output": {"url": "file:///data/out", "scale": {}, "info": {}},
    "region": {"offset": [4, 4, 4], "shape": [56, 248, 248]},
    "mask": None,
    "task_chunks": [1, 4, 4],
    "num_tasks": 8,
    "num_chunks": 128,
    "plan": {"path": "/data/work/plan.json", "digest": "1" * 64, "patch_shape": [32, 64, 64], "memory_budget": 2**30},
    "mem_mb": 2000,
    "created": "2026-11-28T00:00:00+00:00",
    "versions": {},
    "digest": "2" * 64,
}
