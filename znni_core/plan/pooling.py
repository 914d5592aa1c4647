"""How a pooling layer runs: the plan's pooling choice as a type.

A chain's max-pooling layer runs one of three ways (the ZNNi choices, :mod:`.chain` prices each):

* :class:`MPF` (``"mpf"``): max-pooling fragments, every pooling offset's output batched as a
  fragment through the rest of the network (memory for all of them at once);
* :class:`DepthFirst` (``"pool"``): one offset at a time through the rest, results gathered
  (the rest runs once per offset; memory for one);
* :class:`Slab` (``"slab:ROWS"``, the first pooling layer only): as depth first, and the layers
  before it are recomputed per offset in z-slabs of ``ROWS`` fragment rows (the least memory).

A graph's pooling node subsamples (:class:`Subsample`: ``max`` or ``avg``).  A plan's JSON keeps
its words: a pool step's ``primitive`` (``mpf``, ``pool``, ``slab``, ``max``, ``avg``) and, for a
slab, its rows in ``micro_batch``; :func:`of_step` reads them back, :attr:`PoolingChoice.primitive` and
:attr:`PoolingChoice.micro_batch` write them, so plans stay byte for byte what they were.

>>> parse("slab:4"), str(parse("slab:4")), parse("pool").per_offset, MPF().per_offset
(Slab(rows=4), 'slab:4', True, False)
>>> [str(m) for m in (MPF(), DepthFirst(), Slab(2), Subsample("avg"))]
['mpf', 'pool', 'slab:2', 'avg']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from ..net.ops import Pooling


@dataclass(frozen=True)
class PoolingChoice:
    """A pooling layer's way of running (see the module docstring)."""

    #: the layers after it run once per pooling offset
    per_offset: ClassVar[bool] = False
    #: its fragments come out batched (one fragment per offset): the output is recombined
    fragments: ClassVar[bool] = True

    @property
    def primitive(self) -> str:
        """The plan step's ``primitive`` word."""
        raise NotImplementedError

    @property
    def micro_batch(self) -> int:
        """The plan step's ``micro_batch`` (a slab's rows; 0 otherwise)."""
        return 0

    def __str__(self) -> str:
        return self.primitive


@dataclass(frozen=True)
class MPF(PoolingChoice):
    """Max-pooling fragments: every offset batched through the rest."""

    @property
    def primitive(self) -> str:
        """``"mpf"``."""
        return "mpf"


@dataclass(frozen=True)
class DepthFirst(PoolingChoice):
    """One pooling offset at a time through the rest of the network."""

    per_offset: ClassVar[bool] = True

    @property
    def primitive(self) -> str:
        """``"pool"``."""
        return "pool"


@dataclass(frozen=True)
class Slab(PoolingChoice):
    """Depth first, the layers before recomputed per offset in z-slabs of ``rows`` fragment rows."""

    rows: int
    per_offset: ClassVar[bool] = True

    def __post_init__(self):
        if not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1:
            raise ValueError(f"a slab has 1 or more rows, not {self.rows!r}")

    @property
    def primitive(self) -> str:
        """``"slab"``."""
        return "slab"

    @property
    def micro_batch(self) -> int:
        """The rows."""
        return self.rows

    def __str__(self) -> str:
        return f"slab:{self.rows}"


@dataclass(frozen=True)
class Subsample(PoolingChoice):
    """A graph's pooling node: max or average over each window, no fragments."""

    kind: str  # max | avg
    fragments: ClassVar[bool] = False

    @property
    def primitive(self) -> str:
        """The kind: ``"max"`` or ``"avg"``."""
        return self.kind


#: a chain pooling layer's choices by their word (a slab's takes its rows: ``slab:ROWS``)
CHAIN_CHOICES = {"mpf": MPF(), "pool": DepthFirst()}


def parse(text) -> PoolingChoice:
    """The choice a word names (``mpf``, ``pool``, ``slab:ROWS``); a choice is returned as it is;
    ValueError for anything else."""
    if isinstance(text, PoolingChoice):
        return text
    if text in CHAIN_CHOICES:
        return CHAIN_CHOICES[text]
    m = re.fullmatch(r"slab:([1-9][0-9]*)", str(text))
    if m:
        return Slab(int(m.group(1)))
    raise ValueError(f"{text!r} is no pooling choice: mpf, pool or slab:ROWS")


def of_step(step) -> PoolingChoice | None:
    """The pooling a plan's step runs (None for a step that is no pooling)."""
    if not issubclass(step.operator, Pooling):
        return None
    if step.primitive == "slab":
        return Slab(int(step.micro_batch))
    if step.primitive in CHAIN_CHOICES:
        return CHAIN_CHOICES[step.primitive]
    return Subsample(step.primitive)
