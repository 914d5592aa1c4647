"""Graph operators as types: one frozen class per operator, validated where it is made.

A :class:`~.graph.Node` holds one :class:`Operator` (``node.op``).  Each class carries its own
geometry, per axis (``z, y, x``): the output length for given input lengths (:meth:`~Operator.length`,
raising :class:`Inadmissible` where PyTorch would fail, mismatch or floor), where its output
voxels sit on its input (:meth:`~Operator.step_origin`), the input range an output range reads
(:meth:`~Operator.in_range`), the shape it makes of a pooled fragment (:meth:`~Operator.fragment_shape`),
whether it is element-wise and whether it keeps a channels-last layout.  What an operator costs,
the memory it takes and how it runs are registered by type where they live (``plan/memory``,
``plan/graph``, ``exec/patch``; ``tests/test_ops.py`` fails when one misses a class).

The loaders map ONNX and YAML names to these classes once (:func:`make`, by :attr:`Operator.label`);
the plan records a step's operator by its label.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import ClassVar

import numpy as np

from ..errors import NetworkError
from .chain import Activation, Conv, Pool

Shape3 = tuple[int, int, int]
_AXES = "zyx"


class Inadmissible(Exception):
    """An input length an operator does not run on exactly.  ``need``: how many voxels longer the
    input must be to pass (None: unknown); ``short``: the input is too short (rather than of the
    wrong length)."""

    def __init__(self, node, reason, need=None, short=False):
        super().__init__(f"{node}: {reason}")
        self.node, self.reason, self.need, self.short = node, reason, need, short


def shape3(value, what: str, least: int = 0) -> Shape3:
    """``value`` as 3 ints (z, y, x) of at least ``least``; a :class:`NetworkError` naming ``what`` otherwise."""
    try:
        t = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise NetworkError(f"{what} must have 3 integers (z, y, x), got {value!r}") from None
    if len(t) != 3 or any(v < least for v in t):
        raise NetworkError(f"{what} must have 3 integers (z, y, x) of at least {least}, got {value!r}")
    return t  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class Operator:
    """What every operator answers; the defaults are those of an operator that maps each voxel to
    the voxel at the same place (an activation, an affine, an element-wise add)."""

    #: the operator's name in YAML specs and plans
    label: ClassVar[str] = ""
    #: output voxel from the same voxel of each input (the output may overwrite an input)
    elementwise: ClassVar[bool] = False
    #: several inputs that must meet with equal lengths
    joins: ClassVar[bool] = False

    def params(self) -> dict:
        """The parameters by name (what the YAML spec writes and the network digest hashes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def channels(self, cin: list, name: str) -> int:
        """Output channels for inputs of ``cin`` channels (a :class:`NetworkError` where they do not fit)."""
        return max(cin)

    def length(self, axis: int, sizes: list, exact: bool, name: str) -> int:
        """Output length on ``axis`` for input lengths ``sizes``; :class:`Inadmissible` where PyTorch
        would fail or mismatch, and (``exact``) where it would floor."""
        if self.joins and len(set(sizes)) > 1:
            raise Inadmissible(name, f"inputs meet with lengths {sizes} on axis {_AXES[axis]}")
        return sizes[0]

    def step_origin(self, axis: int, step: Fraction, origin: Fraction) -> tuple[Fraction, Fraction]:
        """(step, origin) of the output on ``axis``: input voxels per output voxel, and the input
        position of output voxel 0, for an input at ``step`` and ``origin``."""
        return step, origin

    def in_range(self, axis: int, a: int, b: int, n_in: int) -> tuple[int, int]:
        """Input voxels ``[lo, hi)`` on ``axis`` that output voxels ``[a, b)`` read, of an input of
        ``n_in`` (zero padding and clamping supply the rest)."""
        return a, b

    def fragment_shape(self, shape: tuple, name: str) -> tuple:
        """The ``(C, z, y, x)`` this operator makes of ``shape`` in a network pooled into fragments."""
        raise NetworkError(f"{name}: a network pooled into fragments runs conv, act and max-pool nodes only")

    @property
    def keeps_layout(self) -> bool:
        """Whether a channels-last input gives a channels-last output at speed (``add``/``mul``:
        when every input is channels last)."""
        return self.elementwise

    @property
    def padding(self) -> str | None:
        """Why the output near a patch border depends on where the patch is (None: it does not)."""
        return None

    def chain_layer(self, name: str):
        """The chain layer this operator is (a valid stride-1 convolution, a max-pooling, an
        activation), else None."""
        return None

    def describe(self) -> str:
        """The operator and its non-array parameters, for one line of a network's description."""
        shown = {k: v for k, v in self.params().items() if not isinstance(v, np.ndarray)}
        return f"{self.label} {shown if shown else ''}".rstrip()


@dataclass(frozen=True, eq=False)
class StridedConv:
    """A valid convolution with a stride above 1 on some axis (a graph's downsampling conv), as the
    primitives read it: the :class:`~.chain.Conv`'s kernel, channels and weights, and the stride."""

    conv: Conv
    stride: Shape3

    kernel = property(lambda self: self.conv.kernel)
    in_channels = property(lambda self: self.conv.in_channels)
    out_channels = property(lambda self: self.conv.out_channels)
    weight = property(lambda self: self.conv.weight)
    bias = property(lambda self: self.conv.bias)
    name = property(lambda self: self.conv.name)


@dataclass(frozen=True, eq=False)
class Convolution(Operator):
    """A :class:`~.chain.Conv` with a ``stride`` and zero ``pads`` (low, high) per axis."""

    label: ClassVar[str] = "conv"
    conv: Conv
    stride: Shape3 = (1, 1, 1)
    pads: tuple = ((0, 0, 0), (0, 0, 0))

    def __post_init__(self):
        if not isinstance(self.conv, Conv):
            raise NetworkError(f"a convolution needs a Conv, got {type(self.conv).__name__}")
        object.__setattr__(self, "stride", shape3(self.stride, f"{self.conv.name}: stride", 1))
        if len(self.pads) != 2:
            raise NetworkError(f"{self.conv.name}: pads must be (low, high), got {self.pads!r}")
        object.__setattr__(self, "pads", tuple(shape3(p, f"{self.conv.name}: pads") for p in self.pads))

    @property
    def padded(self) -> bool:
        """Whether it pads its input with zeros on some side."""
        return any(map(any, self.pads))

    @property
    def plain(self) -> bool:
        """Stride 1 and no padding: a chain's convolution."""
        return self.stride == (1, 1, 1) and not self.padded

    @functools.cached_property
    def layer(self) -> Conv | StridedConv:
        """What a convolution primitive runs: the :class:`~.chain.Conv`, or a :class:`StridedConv`
        where the stride is above 1 on some axis."""
        return self.conv if self.stride == (1, 1, 1) else StridedConv(self.conv, self.stride)

    def channels(self, cin, name):
        if cin[0] != self.conv.in_channels:
            raise NetworkError(f"{name}: convolution expects {self.conv.in_channels} input channels but gets {cin[0]}")
        return self.conv.out_channels

    def length(self, axis, sizes, exact, name):
        n, k, s = sizes[0], self.conv.kernel[axis], self.stride[axis]
        span = n + self.pads[0][axis] + self.pads[1][axis] - k
        if span < 0:
            raise Inadmissible(
                name, f"input length {n} on axis {_AXES[axis]} is shorter than the kernel {k}", -span, True
            )
        if span % s and exact:
            raise Inadmissible(name, f"stride {s} does not divide {span} on axis {_AXES[axis]}", -span % s)
        return span // s + 1

    def step_origin(self, axis, step, origin):
        k, s = self.conv.kernel[axis], self.stride[axis]
        return step * s, origin + step * (Fraction(k - 1, 2) - self.pads[0][axis])

    def in_range(self, axis, a, b, n_in):
        lo, hi = self.window_axis(axis, a, b)
        return max(0, lo), min(n_in, hi)

    def window_axis(self, axis: int, a: int, b: int) -> tuple[int, int]:
        """The zero-padded input ``[lo, hi)`` that output voxels ``[a, b)`` read on ``axis`` (may
        reach below 0 and past the input)."""
        k, s, p = self.conv.kernel[axis], self.stride[axis], self.pads[0][axis]
        return a * s - p, (b - 1) * s - p + k

    def window(self, a, b) -> tuple[tuple, tuple]:
        """Per axis (raw lo, raw hi): the zero-padded input that output ``[a, b)`` reads."""
        r = [self.window_axis(ax, a[ax], b[ax]) for ax in range(3)]
        return tuple(v[0] for v in r), tuple(v[1] for v in r)

    def fragment_shape(self, shape, name):
        return (self.conv.out_channels,) + tuple(n - k + 1 for n, k in zip(shape[1:], self.conv.kernel))

    @property
    def keeps_layout(self):
        return False

    @property
    def padding(self):
        return "zero-padded convolution" if self.padded else None

    def chain_layer(self, name):
        return self.conv if self.plain else None

    def describe(self):
        c = self.conv
        stride = f" stride {self.stride}" if any(s > 1 for s in self.stride) else ""
        pads = f" pads {self.pads}" if self.padded else ""
        return f"conv {c.in_channels}->{c.out_channels} k={c.kernel}{stride}{pads}"


@dataclass(frozen=True, eq=False)
class _Upsampling(Operator):
    """``factor`` output voxels per input voxel on each axis (a transposed convolution, a resize)."""

    @property
    def factor(self) -> Shape3:
        raise NotImplementedError

    def length(self, axis, sizes, exact, name):
        return sizes[0] * self.factor[axis]

    def step_origin(self, axis, step, origin):
        f = self.factor[axis]
        return step / f, origin - step * Fraction(f - 1, 2 * f)

    def in_range(self, axis, a, b, n_in):
        f = self.factor[axis]
        return a // f, -(-b // f)


@dataclass(frozen=True, eq=False)
class Deconvolution(_Upsampling):
    """Transposed convolution with stride = kernel: ``weight`` (C_in, C_out, k), ``bias`` (C_out,)."""

    label: ClassVar[str] = "deconv"
    weight: np.ndarray
    bias: np.ndarray | None = None
    stride: Shape3 = (1, 1, 1)

    def __post_init__(self):
        w = np.asarray(self.weight)
        if w.ndim != 5:
            raise NetworkError(f"a transposed convolution's weight must be 5-D (C_in, C_out, k), got shape {w.shape}")
        object.__setattr__(self, "stride", shape3(self.stride, "transposed convolution stride", 1))
        if self.bias is None:
            object.__setattr__(self, "bias", np.zeros(w.shape[1], np.float32))

    def channels(self, cin, name):
        if cin[0] != self.weight.shape[0]:
            raise NetworkError(
                f"{name}: transposed convolution expects {self.weight.shape[0]} input channels but gets {cin[0]}"
            )
        return int(self.weight.shape[1])

    @property
    def factor(self):
        return self.stride

    @property
    def keeps_layout(self):
        """Channels last in, channels last out on the host (``layers.resample.conv_transpose``)."""
        return True


@dataclass(frozen=True, eq=False)
class Pooling(Operator):
    """Pooling of ``kind`` max or avg, window = stride, no padding."""

    label: ClassVar[str] = "pool"
    window: Shape3
    kind: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "window", shape3(self.window, "pooling window", 1))
        if self.kind not in ("max", "avg"):
            raise NetworkError(f"pooling kind {self.kind!r}: max or avg")

    def length(self, axis, sizes, exact, name):
        n, p = sizes[0], self.window[axis]
        if n < p or (n % p and exact):
            raise Inadmissible(
                name, f"pooling window {p} does not divide length {n} on axis {_AXES[axis]}", -n % p or p, n < p
            )
        return n // p

    def step_origin(self, axis, step, origin):
        p = self.window[axis]
        return step * p, origin + step * Fraction(p - 1, 2)

    def in_range(self, axis, a, b, n_in):
        p = self.window[axis]
        return a * p, b * p

    def fragment_shape(self, shape, name):
        if self.kind != "max":
            return super().fragment_shape(shape, name)
        return (shape[0],) + tuple((n - p + 1) // p for n, p in zip(shape[1:], self.window))

    @property
    def keeps_layout(self):
        return self.kind == "max"

    def chain_layer(self, name):
        return Pool(self.window, name=name) if self.kind == "max" else None


@dataclass(frozen=True, eq=False)
class Resize(_Upsampling):
    """Upsampling by an integer ``scale`` per axis, ``mode`` nearest or linear (``coord``:
    half_pixel or align_corners; empty for nearest)."""

    label: ClassVar[str] = "resize"
    scale: Shape3
    mode: str = "nearest"
    coord: str = ""

    def __post_init__(self):
        object.__setattr__(self, "scale", shape3(self.scale, "resize scale", 1))
        if self.mode not in ("nearest", "linear"):
            raise NetworkError(f"resize mode {self.mode!r}: nearest or linear")
        if self.mode == "linear" and self.coord not in ("half_pixel", "align_corners"):
            raise NetworkError(f"linear resize coordinate mode {self.coord!r}: half_pixel or align_corners")

    @property
    def linear(self) -> bool:
        return self.mode == "linear"

    @property
    def factor(self):
        return self.scale

    def in_range(self, axis, a, b, n_in):
        if self.linear and self.scale[axis] > 1:
            i0, i1, _ = self.table(axis, n_in)
            return int(i0[a]), int(i1[b - 1]) + 1
        return super().in_range(axis, a, b, n_in)

    def table(self, axis: int, n: int):
        """(i0, i1, w) of a linear resize on ``axis`` of an input of ``n`` voxels: output voxel ``j``
        is ``(1 - w[j]) x[i0[j]] + w[j] x[i1[j]]`` (the border clamped)."""
        f = self.scale[axis]
        m = n * f
        j = np.arange(m, dtype=np.float64)
        if self.coord == "align_corners":
            src = j * (n - 1) / (m - 1) if m > 1 else np.zeros(m)
        else:
            src = np.maximum((j + 0.5) / f - 0.5, 0.0)
        i0 = np.minimum(np.floor(src).astype(np.int64), n - 1)
        i1 = np.minimum(i0 + 1, n - 1)
        return i0, i1, (src - i0).astype(np.float32)

    @property
    def keeps_layout(self):
        """Nearest and linear alike (``layers.resample``: channels last in, channels last out)."""
        return True

    @property
    def padding(self):
        return "linear resize clamps at the border" if self.linear else None


@dataclass(frozen=True, eq=False)
class Crop(Operator):
    """Removes ``low``/``high`` voxels per axis (a Slice, relative to its input)."""

    label: ClassVar[str] = "crop"
    low: Shape3
    high: Shape3

    def __post_init__(self):
        object.__setattr__(self, "low", shape3(self.low, "crop low"))
        object.__setattr__(self, "high", shape3(self.high, "crop high"))

    @property
    def keeps_layout(self):
        """A channels-last input's part is copied channels last (``layers.layout.as_contiguous``)."""
        return True

    def length(self, axis, sizes, exact, name):
        n, lo, hi = sizes[0], self.low[axis], self.high[axis]
        if n - lo - hi < 1:
            raise Inadmissible(name, f"crop of {lo}+{hi} leaves nothing of {n}", 1 - (n - lo - hi), True)
        return n - lo - hi

    def step_origin(self, axis, step, origin):
        return step, origin + step * self.low[axis]

    def in_range(self, axis, a, b, n_in):
        return a + self.low[axis], b + self.low[axis]


@dataclass(frozen=True, eq=False)
class Pad(Operator):
    """Adds ``low``/``high`` voxels of ``value`` per axis."""

    label: ClassVar[str] = "pad"
    low: Shape3
    high: Shape3
    value: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "low", shape3(self.low, "pad low"))
        object.__setattr__(self, "high", shape3(self.high, "pad high"))

    def length(self, axis, sizes, exact, name):
        return sizes[0] + self.low[axis] + self.high[axis]

    def step_origin(self, axis, step, origin):
        return step, origin - step * self.low[axis]

    def in_range(self, axis, a, b, n_in):
        lo = min(n_in, max(0, a - self.low[axis]))  # empty where the range is all padding
        return lo, max(lo, min(n_in, b - self.low[axis]))

    @property
    def padding(self):
        return "padding"


@dataclass(frozen=True, eq=False)
class _Join(Operator):
    """Two tensors combined voxel by voxel (one may have one channel: broadcast)."""

    elementwise: ClassVar[bool] = True
    joins: ClassVar[bool] = True

    def channels(self, cin, name):
        if len(cin) == 2 and cin[0] != cin[1] and 1 not in cin:
            raise NetworkError(f"{name}: {self.label} of tensors with {cin[0]} and {cin[1]} channels")
        return max(cin)


@dataclass(frozen=True, eq=False)
class Add(_Join):
    """Element-wise sum of two tensors."""

    label: ClassVar[str] = "add"


@dataclass(frozen=True, eq=False)
class Mul(_Join):
    """Element-wise product of two tensors."""

    label: ClassVar[str] = "mul"


@dataclass(frozen=True, eq=False)
class Concat(Operator):
    """Concatenation along channels."""

    label: ClassVar[str] = "concat"
    joins: ClassVar[bool] = True

    def channels(self, cin, name):
        return sum(cin)

    @property
    def keeps_layout(self):
        """Channels-last inputs give a channels-last concatenation (each voxel's channels, part
        after part: ``layers.layout.concat_channels_last``), when every input is channels last."""
        return True


@dataclass(frozen=True, eq=False)
class Affine(Operator):
    """``x * scale[c] + shift[c]`` (BatchNorm not foldable into a conv, Mul/Add by constants)."""

    label: ClassVar[str] = "affine"
    elementwise: ClassVar[bool] = True
    scale: np.ndarray
    shift: np.ndarray

    def __post_init__(self):
        s, t = np.asarray(self.scale).reshape(-1), np.asarray(self.shift).reshape(-1)
        if s.size != t.size:
            raise NetworkError(f"affine: {s.size} scales and {t.size} shifts")

    def channels(self, cin, name):
        if self.scale.size not in (1, cin[0]):
            raise NetworkError(f"{name}: {self.scale.size} per-channel constants for {cin[0]} channels")
        return cin[0]


@dataclass(frozen=True, eq=False)
class Act(Operator):
    """An :class:`~.chain.Activation`."""

    label: ClassVar[str] = "act"
    elementwise: ClassVar[bool] = True
    act: Activation

    def __post_init__(self):
        if not isinstance(self.act, Activation):
            raise NetworkError(f"an activation node needs an Activation, got {type(self.act).__name__}")

    def fragment_shape(self, shape, name):
        return tuple(shape)

    def chain_layer(self, name):
        return self.act

    def describe(self):
        return self.act.kind


#: every operator class, by label
OPERATORS = (Convolution, Deconvolution, Pooling, Resize, Crop, Pad, Add, Mul, Affine, Concat, Act)
BY_LABEL = {cls.label: cls for cls in OPERATORS}


def make(label: str, name: str, params: dict) -> Operator:
    """The operator ``label`` (its YAML and plan name) with ``params``; a :class:`NetworkError`
    naming the node ``name`` for an unknown operator or parameter."""
    cls = BY_LABEL.get(label)
    if cls is None:
        raise NetworkError(f"{name}: unknown graph operator {label!r}; one of {tuple(BY_LABEL)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise NetworkError(f"{name}: {label} has no parameter {unknown[0]!r}; it takes {sorted(known) or 'none'}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise NetworkError(f"{name}: {label} needs {sorted(known)} ({exc})") from None
    except NetworkError as exc:
        raise NetworkError(f"{name}: {exc}") from None


def replace(op: Operator, **changes) -> Operator:
    """``op`` with some parameters changed."""
    return type(op)(**{**op.params(), **changes})
