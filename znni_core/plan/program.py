"""What the executor runs for a plan: its nodes and steps after fusion, and their layouts.

:func:`program` reads a plan against its graph: which activations run inside the conv before
them, which nodes an add or affine runs in its own pass, and every non-decreasing activation
before a pooling node in fragments moved after it (exact: ``pool(f(x)) == f(pool(x))``, and the
activation then runs on the pooled fragments).  :func:`channels_last_tensors` says which tensors
the executor writes channels last.  The executor (``exec/patch.py``) runs the program; the chain's
search prices its pooling steps by the same layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import PlanError
from ..layers.activation import commutes_with_max
from ..layers.epilogue import FUSABLE
from ..net.graph import Graph
from ..net.ops import Act, Add, Affine, Convolution, Pooling
from .plan import fuse, fuses
from .pooling import DepthFirst
from .primitives import PRIMITIVES


def in_place_input(node, remaining: dict, need: dict, graph_input: str):
    """The input an element-wise node overwrites: one it is the last reader of, not the
    caller's array, computed over exactly the output's range (None: a new array)."""
    if not node.op.elementwise:
        return None
    for name in dict.fromkeys(node.inputs):
        if name != graph_input and remaining[name] == node.inputs.count(name) and need[name] == need[node.output]:
            return name
    return None


def fuses_next(nodes, i: int, primitive: str, consumers: dict) -> bool:
    """Whether conv node ``i`` (run by ``primitive``) applies node ``i + 1`` in its output
    pass: an activation of ``FUSABLE`` that is the conv output's only reader (the executor
    then skips it; the walk charges it nothing)."""
    if i + 1 >= len(nodes) or not isinstance(nodes[i].op, Convolution) or not isinstance(nodes[i + 1].op, Act):
        return False
    nxt = nodes[i + 1]
    return fuses(primitive, nxt.op.act.kind) and nxt.inputs == (nodes[i].output,) and consumers[nodes[i].output] == 1


def chain_after(nodes, i: int, consumers: dict) -> list[int]:
    """The nodes that element-wise node ``i`` (an add of two tensors or an affine) runs in its
    own pass (``layers.epilogue.add_affine_act``): an affine (after an add), then an
    activation of ``FUSABLE``, each the only reader of the one before (the executor skips
    them; the walk charges them nothing).  Empty when nothing follows that way."""
    op = nodes[i].op
    if not (isinstance(op, Affine) or (isinstance(op, Add) and len(nodes[i].inputs) == 2)):
        return []
    out, allowed = [], ((Affine, Act) if isinstance(op, Add) else (Act,))
    for j in range(i + 1, len(nodes)):
        prev, nxt = nodes[j - 1], nodes[j]
        kind = next((k for k in allowed if isinstance(nxt.op, k)), None)
        if (
            kind is None
            or nxt.inputs != (prev.output,)
            or consumers[prev.output] != 1
            or (kind is Act and nxt.op.act.kind not in FUSABLE)
        ):
            break
        out.append(j)
        allowed = allowed[allowed.index(kind) + 1 :]
    return out


def readers_left(graph: Graph, ran) -> dict:
    """``{tensor: readers it has left}`` once the nodes ``ran`` have read their inputs (the
    output counts as read once)."""
    remaining = graph.consumers()
    for node in ran:
        for name in node.inputs:
            remaining[name] -= 1
    return remaining


def in_fragments(step) -> bool:
    """Whether ``step`` is a pooling step run in fragments (MPF, depth first or slab: a dense
    network's pooling, :mod:`.pooling`)."""
    pooling = step.pooling
    return pooling is not None and pooling.fragments


@dataclass(frozen=True)
class Program:
    """What the executor runs for a plan: the graph's nodes with their steps, in order, with every
    (monotone activation, pooling in fragments) pair swapped.  ``fused``: positions of the
    activations a conv applies in its output pass; ``chains``: what an add or affine runs in its
    own pass; ``skip``: both (the nodes that run as part of the one before)."""

    nodes: tuple
    steps: tuple
    input: str
    output: str
    fused: frozenset
    chains: dict  # element-wise position -> the positions it runs in its own pass (host only)
    skip: frozenset  # positions applied by the node before (fused and chained)

    @property
    def dense(self) -> bool:
        """Whether some pooling runs in fragments (the output is then recombined)."""
        return any(in_fragments(s) for s in self.steps)

    def step(self, i: int):
        """Node ``i``'s step, applying the activation after it where it fuses it (a
        :class:`~.plan.FusedStep`)."""
        step = self.steps[i]
        return fuse(step, self.nodes[i + 1].op.act) if i + 1 in self.fused else step

    @property
    def windows(self) -> list:
        """The windows of the pooling nodes run in fragments, in order (what recombines them)."""
        return [n.op.window for n, s in zip(self.nodes, self.steps) if in_fragments(s)]


def program(steps, graph: Graph, xp=np) -> Program:
    """The :class:`Program` of a plan's ``steps`` on ``graph`` (checked: one step per node);
    ``xp``: where it runs (an add's or affine's fused pass is the host's)."""
    if len(steps) != len(graph.nodes):
        raise PlanError(f"the plan has {len(steps)} steps for {len(graph.nodes)} nodes; re-run `znni plan`")
    consumers = graph.consumers()
    nodes, steps = list(graph.nodes), list(steps)
    fused = {i + 1 for i, s in enumerate(steps) if fuses_next(graph.nodes, i, s.primitive, consumers)}
    chains = {i: c for i in range(len(nodes)) if (c := chain_after(graph.nodes, i, consumers))} if xp is np else {}
    for j in range(len(nodes) - 1):
        a, b = nodes[j], nodes[j + 1]
        if (
            isinstance(a.op, Act)
            and j not in fused
            and in_fragments(steps[j + 1])
            and b.inputs == (a.output,)
            and consumers[a.output] == 1
            and commutes_with_max(a.op.act)
        ):
            nodes[j] = b.with_op(b.op, a.inputs, a.output)
            nodes[j + 1] = a.with_op(a.op, (a.output,), b.output)
            steps[j], steps[j + 1] = steps[j + 1], steps[j]
    skip = frozenset(fused | {j for c in chains.values() for j in c})
    return Program(tuple(nodes), tuple(steps), graph.input, graph.output, frozenset(fused), chains, skip)


# ---- which tensors are channels last ----------------------------------------------------------


def channels_last_tensors(prog: Program, every: bool = False) -> set:
    """Names of the tensors to write channels last (``layers/layout``): outputs of Winograd convs
    and of 1x1x1 convs run as pointwise chains, and fragments a depth-first pooling node copies
    out (its input is a layer's output).

    A tensor is channels last if such a writer wrote it, or a node that keeps the layout
    (``Operator.keeps_layout``: an activation, an affine; a max-pool subsampling or in MPF, an upsampling; an add, mul
    or concat of channels-last inputs) made it from one.  A writer is chosen while every channels-last tensor
    that flows from it is read only by untiled Winograd or 1x1x1 convs (or direct-numba ones of a few output
    channels: ``layers.direct.reads_channels_last``) and such nodes, never
    mixed with a channels-first input, and is not the network's output; the others are dropped
    until none breaks that.  A one-channel output is channels first anyway.
    ``every``: every tensor that is channels last, not only the writers' (what the layout-keeping
    nodes make of them too)."""
    nodes, steps = prog.nodes, prog.steps
    readers: dict = {}
    for i, node in enumerate(nodes):
        for name in set(node.inputs):
            readers.setdefault(name, []).append(i)

    def keeps(i):
        node = nodes[i]
        return node.op.keeps_layout and not (isinstance(node.op, Pooling) and steps[i].pooling.per_offset)

    def reads(i):  # reads a channels-last input at speed (a mixed add is checked apart)
        node, step = nodes[i], steps[i]
        if isinstance(node.op, Convolution):  # Winograd, a 1x1x1 conv, direct-numba to a few channels
            prim = PRIMITIVES.get(step.primitive)
            conv = node.op.conv
            return (
                prim is not None
                and prim.reads_channels_last(
                    conv.kernel,
                    (conv.in_channels, conv.out_channels),
                    tuple(step.in_shape[2:]) if len(step.in_shape) == 5 else None,  # unknown while priced
                )
                and not step.tile
                and not step.micro_batch
            )
        return keeps(i)

    def writes(i):
        node, step = nodes[i], steps[i]
        if isinstance(node.op, Pooling):  # depth first: gather_fragment copies each fragment in the layout asked
            return isinstance(step.pooling, DepthFirst) and node.inputs[0] != prog.input
        prim = PRIMITIVES.get(step.primitive)
        return (
            isinstance(node.op, Convolution)
            and prim is not None
            and (prim.writes_channels_last or prim.runs_pointwise_chain(node.op.conv.kernel))
            and not step.tile
            and not step.micro_batch
            and node.op.conv.out_channels > 1
        )

    chosen = {nodes[i].output for i in range(len(nodes)) if writes(i)}
    while True:
        sources: dict = {}  # channels-last tensor -> the chosen writers it flows from
        for i, node in enumerate(nodes):
            if writes(i):
                if node.output in chosen:
                    sources[node.output] = {node.output}
            elif keeps(i):
                ins = [sources.get(t) for t in node.inputs]
                if all(v is not None for v in ins):
                    sources[node.output] = set().union(*ins)
        drop = set()
        for name, src in sources.items():
            bad = name == prog.output or not all(reads(i) for i in readers.get(name, ()))
            bad = bad or any(
                nodes[i].op.joins and nodes[i].output not in sources for i in readers.get(name, ())
            )  # an add, mul or concat mixing it with a channels-first input
            if bad:
                drop |= src
        if not drop:
            return set(sources) if every else chosen
        chosen -= drop


def fragment_shapes(nodes, in_shape) -> dict:
    """``{tensor: (C, z, y, x)}`` of a line of ``nodes`` pooled into fragments (every fragment
    alike; their number is the batch), the first reading ``in_shape``."""
    shapes = {nodes[0].inputs[0]: tuple(in_shape)} if nodes else {}
    for node in nodes:
        shapes[node.output] = node.op.fragment_shape(shapes[node.inputs[0]], node.name)
    return shapes
