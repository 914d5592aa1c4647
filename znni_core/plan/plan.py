"""The frozen, serialisable :class:`Plan`: what the autotuner chose and why.

A plan is data: executors take a plan and arrays, nothing else.  It round-trips
through JSON (``Plan.from_json(plan.to_json()) == plan``).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from ..errors import PlanError
from ..layers import tuning
from ..net.ops import BY_LABEL, Convolution
from . import wisdom as W
from .pooling import of_step
from .primitives import PRIMITIVES, names

PLAN_FORMAT = "znni-plan/1"
#: every convolution primitive's name (:data:`.primitives.PRIMITIVES`)
CONV_PRIMITIVES = tuple(PRIMITIVES)
#: the ones that run on the CPU (direct-torch: cuDNN through PyTorch, a GPU primitive)
CPU_PRIMITIVES = names("cpu", strides=False)


def fuses(step_primitive: str, kind: str) -> bool:
    """Whether a step run by ``step_primitive`` (a conv primitive, or any other step's name)
    applies an activation ``kind`` that directly follows it in its own output pass (the executor
    and both searches ask this)."""
    p = PRIMITIVES.get(step_primitive)
    return p is not None and p.fuses(kind)


def _tuple(v):
    return tuple(_tuple(x) for x in v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True)
class Step:
    """One node of the network as the plan runs it."""

    index: int  # position in the graph's nodes (a chain's: in its layers)
    op: str  # the label of the node's operator (conv | pool | act | ...; :attr:`operator` its class)
    # conv: a registered primitive; pool: mpf | pool (depth first) | slab (fragments: a chain's)
    # or max | avg (subsampling: another graph's), read as a type by :attr:`pooling`;
    # act: the activation kind; else the operator
    primitive: str
    in_shape: tuple  # (N, C, z, y, x) as this step sees it (N = fragments in flight)
    out_shape: tuple
    micro_batch: int = 0  # conv: fragments per primitive call (0 = all); a slab: its rows
    threads: int = 1
    seconds: float = 0.0  # predicted time of this step over the whole patch
    bytes: int = 0  # predicted live bytes at this step's peak
    tile: tuple = ()  # conv: input block (z, y, x) per primitive call (overlap-save); () = the whole input

    @property
    def operator(self) -> type:
        """The class of the node's operator (:mod:`znni_core.net.ops`), from its label."""
        cls = BY_LABEL.get(self.op)
        if cls is None:
            raise PlanError(f"step {self.index}: unknown operator {self.op!r}; re-run `znni plan`")
        return cls

    @property
    def pooling(self):
        """A pool step's pooling choice as a type (:mod:`.pooling`: MPF, DepthFirst, Slab,
        Subsample); None for any other step."""
        return of_step(self)

    def __post_init__(self):
        object.__setattr__(self, "in_shape", _tuple(self.in_shape))
        object.__setattr__(self, "out_shape", _tuple(self.out_shape))
        object.__setattr__(self, "tile", _tuple(self.tile))


@dataclass(frozen=True)
class FusedStep(Step):
    """A conv step that applies the activation after it in its own output pass: ``fused``
    names it (``layers.epilogue.FUSABLE``), ``alpha`` its parameter."""

    fused: str = ""
    alpha: float = 0.0


def fused_act(step):
    """``(kind, alpha)`` of the activation a conv step applies itself, or None."""
    kind = getattr(step, "fused", "")
    return (kind, step.alpha) if kind else None


def fuse(step, activation) -> FusedStep:
    """The conv ``step`` applying ``activation`` (an Activation layer) in its output pass."""
    return FusedStep(
        **{f.name: getattr(step, f.name) for f in fields(Step)},
        fused=activation.kind,
        alpha=float(activation.alpha),
    )


@dataclass(frozen=True)
class Rejected:
    """A candidate the search threw away, and why (never silently)."""

    candidate: str
    reason: str
    voxels_per_s: float = 0.0


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 120 else text[:117] + "..."


#: fields holding (z, y, x) shapes: 3 positive integers, or (``()``-able ones) nothing
_SHAPES = {"patch_shape": 1, "output_shape": 1, "field_of_view": 1, "overlap": 0, "tile": 0}


def _ints_within(v) -> bool:
    """Whether ``v`` is a (nested) list of integers in [0, 2^40) (a step's in/out shapes)."""
    if isinstance(v, (list, tuple)):
        return all(_ints_within(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**40


@functools.cache
def _hints(cls) -> dict:
    """``typing.get_type_hints(cls)``, once per class: a plan loaded from the cache on every
    ``infer`` call checked each of its steps' fields (5-7 ms a call on a 19-step U-Net)."""
    return typing.get_type_hints(cls)


def _check_fields(cls, d: dict, where: str) -> None:
    """Every field of ``cls`` without a default is in ``d``, and every field in ``d`` has its
    declared type (str, int: in [0, 2^63), float: finite, tuple: a list, dict); a :class:`PlanError` naming the
    field otherwise.  Shapes (:data:`_SHAPES`, a step's in/out shapes) hold non-negative integers."""
    hints = _hints(cls)
    absent = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in d]
    if absent:
        raise PlanError(f"{where} lacks the field(s) {absent}; re-run `znni plan`")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    for f in fields(cls):
        if f.name not in d:
            continue
        v, kind = d[f.name], hints[f.name]
        ok = {
            str: lambda: isinstance(v, str),
            int: lambda: is_int(v) and 0 <= v < 2**63,
            float: lambda: (is_int(v) and abs(v) < 2**63) or (isinstance(v, float) and math.isfinite(v)),
            tuple: lambda: isinstance(v, (list, tuple)),
            dict: lambda: isinstance(v, dict),
        }.get(kind, lambda: True)()
        if ok and kind is tuple and f.name in _SHAPES and (cls is Plan or f.name == "tile"):
            low = _SHAPES[f.name] if cls is Plan else 0
            ok = (len(v) == 0 and not low) or (len(v) == 3 and all(is_int(x) and low <= x < 2**40 for x in v))
        elif ok and f.name in ("in_shape", "out_shape"):
            ok = _ints_within(v)
        if not ok:
            raise PlanError(f"{where} field {f.name} is {_short(v)}, not a valid {kind.__name__}; re-run `znni plan`")


@dataclass(frozen=True)
class Plan:
    """What the autotuner chose for one network, patch, device and budget, with its predictions
    and the candidates it rejected (each with its reason)."""

    network_digest: str
    device: str
    patch_shape: tuple  # input patch (z, y, x)
    output_shape: tuple  # dense output per patch (z, y, x)
    field_of_view: tuple
    memory_budget: int
    steps: tuple
    predicted_seconds: float
    predicted_peak_bytes: int
    effort: str = "estimate"
    threads: int = 1
    rejected: tuple = ()
    provenance: dict = field(default_factory=dict, compare=False, hash=False)
    format: str = PLAN_FORMAT
    kind: str = "chain"  # chain (MPF) | valid (graph, exact tiles) | padded (graph, blended patches)
    overlap: tuple = ()  # padded: blending overlap of neighbouring patch outputs (z, y, x)
    blend: str = ""  # padded: bump | gaussian | linear (exec/blend.py)
    tile: tuple = ()  # graph: exact output tiles within a patch (halos recomputed); () = the patch whole
    #: GPU plans: "" every tensor on the device; "gpu+host" tensors in host RAM, each conv streamed
    #: through the device in blocks (ZNNi VI-C); "cpu+gpu" layers before ``split`` on the CPU, the
    #: rest on the GPU, the two stages overlapped across patches (ZNNi VI-D)
    placement: str = ""
    split: int = 0  # cpu+gpu: layer index of the first step on the GPU
    #: kernel parameters measured on the planning host (``layers/tuning.py``): the executor runs
    #: the plan under them, so every node computes the same bytes
    tuning: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        for name in ("patch_shape", "output_shape", "field_of_view", "overlap", "tile"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        object.__setattr__(self, "steps", tuple(s if isinstance(s, Step) else Step(**s) for s in self.steps))
        object.__setattr__(
            self, "rejected", tuple(r if isinstance(r, Rejected) else Rejected(**r) for r in self.rejected)
        )
        if self.format != PLAN_FORMAT:
            raise PlanError(f"plan format {self.format!r} is not {PLAN_FORMAT!r}; re-run `znni plan`")
        try:
            object.__setattr__(self, "tuning", tuning.check(dict(self.tuning or {})))
        except (ValueError, TypeError) as exc:
            raise PlanError(f"plan's tuning: {exc}; re-run `znni plan`") from None

    # ---- derived ----------------------------------------------------------
    @property
    def output_voxels(self) -> int:
        """Output voxels of one patch."""
        z, y, x = self.output_shape
        return int(z * y * x)

    @property
    def predicted_voxels_per_s(self) -> float:
        """Output voxels per second the time model predicts (0 when it predicts no time)."""
        return self.output_voxels / self.predicted_seconds if self.predicted_seconds > 0 else 0.0

    @property
    def pool_modes(self) -> tuple:
        """Per pooling layer: ``mpf``, ``pool`` or ``slab:<rows>`` (a graph's: ``max`` or ``avg``)."""
        return tuple(str(s.pooling) for s in self.steps if s.pooling is not None)

    # ---- serialisation --------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as JSON-able data (with its predicted throughput)."""
        d = asdict(self)
        d["predicted_voxels_per_s"] = self.predicted_voxels_per_s
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan of :meth:`to_dict`'s data; unknown or missing fields, and values of the wrong
        type (a step's too), are a :class:`PlanError` naming the field."""
        if not isinstance(d, dict):
            raise PlanError(f"plan is a JSON {type(d).__name__}, not an object; re-run `znni plan`")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names - {"predicted_voxels_per_s"}
        if unknown:
            raise PlanError(f"plan has unknown keys {sorted(unknown)}; was it written by a newer znni?")
        _check_fields(cls, d, "plan")
        steps = d["steps"]
        for i, step in enumerate(steps):
            if not isinstance(step, (dict, Step)):
                raise PlanError(f"plan field steps[{i}] is {_short(step)}, not an object; re-run `znni plan`")
            if isinstance(step, dict):
                _check_fields(FusedStep if "fused" in step else Step, step, f"plan field steps[{i}]")
        for i, r in enumerate(d.get("rejected", ())):
            if isinstance(r, dict):
                _check_fields(Rejected, r, f"plan field rejected[{i}]")
            elif not isinstance(r, Rejected):
                raise PlanError(f"plan field rejected[{i}] is {_short(r)}, not an object; re-run `znni plan`")
        steps = [FusedStep(**s) if isinstance(s, dict) and "fused" in s else s for s in steps]
        return cls(**{k: v for k, v in d.items() if k in names} | {"steps": steps})

    def to_json(self) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan of :meth:`to_json`'s text; invalid JSON is a :class:`PlanError`."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        return cls.from_dict(d)

    def save(self, path) -> Path:
        """Write the plan to ``path`` atomically (an object of a remote work directory: one PUT,
        ``is_remote``); returns the path."""
        if getattr(path, "is_remote", False):
            path.write_text(self.to_json())
            return path
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path) -> "Plan":
        """The plan saved at ``path`` (a file, or an object of a remote work directory); a missing
        or unreadable file is a :class:`PlanError`."""
        path = path if getattr(path, "is_remote", False) else Path(path)
        if not path.is_file():
            raise PlanError(f"plan file {path} does not exist; create it with `znni plan`")
        try:
            return cls.from_json(path.read_text())
        except PlanError as exc:
            raise PlanError(f"plan file {path}: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"plan file {path} cannot be read ({exc}); re-run `znni plan`") from None

    def digest(self) -> str:
        """Hash of what determines the computation (not the provenance or predictions)."""
        key = {
            "net": self.network_digest,
            "device": self.device,
            "patch": self.patch_shape,
            **({"overlap": self.overlap, "blend": self.blend} if self.kind == "padded" else {}),
            **({"placement": self.placement, "split": self.split} if self.placement else {}),
            **({"tuning": self.tuning} if self.tuning else {}),
            "steps": [(s.index, s.op, s.primitive, s.micro_batch, s.threads) for s in self.steps],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    # ---- display ---------------------------------------------------------------
    def describe(self, max_rejected: int = 5) -> str:
        """The plan as a table (per step: primitive, shapes, micro-batch, seconds, GiB), its
        predictions and the first ``max_rejected`` rejected candidates with their reasons."""
        gib = 2**30
        lines = [
            f"plan for network {self.network_digest[:12]} on {self.device} ({self.threads} threads), effort {self.effort}"
            + {
                "": "",
                "gpu+host": "; tensors in host RAM, convolutions streamed through the GPU",
                "cpu+gpu": f"; layers before {self.split} on the CPU, the rest on the GPU, pipelined",
            }[self.placement],
            f"input patch {self.patch_shape} -> dense output {self.output_shape} (field of view {self.field_of_view})"
            + (f"; {self.kind} graph" if self.kind != "chain" else "")
            + (f", {self.blend} blending over {self.overlap}" if self.kind == "padded" else "")
            + (f"; computed in exact output tiles of {self.tile}" if self.tile else ""),
            f"predicted {self.predicted_seconds:.3g} s/patch, {self.predicted_voxels_per_s:,.0f} output voxels/s, "
            f"peak {self.predicted_peak_bytes / gib:.3f} GiB of budget {self.memory_budget / gib:.3f} GiB",
            "",
            f"{'#':>3} {'layer':<6} {'primitive':<13} {'in (N,C,z,y,x)':<28} {'out':<28} {'mb':>4} {'seconds':>9} {'GiB':>8}",
        ]
        for s in self.steps:
            mb = str(s.micro_batch) if issubclass(s.operator, Convolution) and s.micro_batch else ""
            tile = f"  blocks {'x'.join(map(str, s.tile))}" if s.tile else ""
            lines.append(
                f"{s.index:>3} {s.op:<6} {s.primitive:<13} {str(s.in_shape):<28} {str(s.out_shape):<28} "
                f"{mb:>4} {s.seconds:>9.3g} {s.bytes / gib:>8.3f}{tile}"
            )
        if self.rejected:
            lines += [
                "",
                f"rejected alternatives ({len(self.rejected)} in all; top {min(max_rejected, len(self.rejected))}):",
            ]
            for r in self.rejected[:max_rejected]:
                lines.append(f"  {r.candidate}: {r.reason}")
        return "\n".join(lines)


def chosen_plan(net, *, patch, device, effort, threads, candidates, input_shape, provenance=None, **fields) -> Plan:
    """The :class:`Plan` of ``net`` (a chain or a graph) at ``patch``: its output shape and
    field of view from the network, and the provenance every plan records (versions, CPU,
    threads, date, effort, how many candidates were priced, the input shape) plus
    ``provenance``; ``fields`` are the plan's other fields (steps, predictions, ...)."""
    return Plan(
        network_digest=net.digest(),
        device=device,
        patch_shape=patch,
        output_shape=net.output_shape(patch),
        field_of_view=net.field_of_view,
        effort=effort,
        threads=threads,
        provenance={
            "versions": W.versions(),
            "cpu": W.cpu_model(),
            "threads": threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "effort": effort,
            "candidates": candidates,
            "input_shape": input_shape,
            **(provenance or {}),
        },
        **fields,
    )
