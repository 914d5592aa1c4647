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
from ..net.graph import Graph, Node
from .graph import chain_after, fuses_next
from .plan import fuse
from .primitives import PRIMITIVES

#: the pooling steps that make fragments (a dense network's pooling, ``plan/chain.py``)
FRAGMENT_MODES = ("mpf", "pool", "slab")


def in_fragments(step) -> bool:
    """Whether ``step`` is a pooling step run in fragments (MPF, depth first or slab)."""
    return step.op == "pool" and step.primitive in FRAGMENT_MODES


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
        return fuse(step, self.nodes[i + 1]["act"]) if i + 1 in self.fused else step

    @property
    def windows(self) -> list:
        """The windows of the pooling nodes run in fragments, in order (what recombines them)."""
        return [n["window"] for n, s in zip(self.nodes, self.steps) if in_fragments(s)]


def program(steps, graph: Graph, xp=np) -> Program:
    """The :class:`Program` of a plan's ``steps`` on ``graph`` (checked: one step per node);
    ``xp``: where it runs (an add's or affine's fused pass is the host's)."""
    if len(steps) != len(graph.nodes):
        raise PlanError(f"the plan has {len(steps)} steps for {len(graph.nodes)} nodes; re-run `znni plan`")
    consumers = graph.consumers()
    nodes, steps = list(graph.nodes), list(steps)
    fused = {i + 1 for i, s in enumerate(steps) if fuses_next(graph, i, s.primitive, consumers)}
    chains = {i: c for i in range(len(nodes)) if (c := chain_after(graph, i, consumers))} if xp is np else {}
    for j in range(len(nodes) - 1):
        a, b = nodes[j], nodes[j + 1]
        if (
            a.op == "act"
            and j not in fused
            and in_fragments(steps[j + 1])
            and b.inputs == (a.output,)
            and consumers[a.output] == 1
            and commutes_with_max(a["act"])
        ):
            nodes[j] = Node("pool", a.inputs, a.output, b.name, b.params)
            nodes[j + 1] = Node("act", (a.output,), b.output, a.name, a.params)
            steps[j], steps[j + 1] = steps[j + 1], steps[j]
    skip = frozenset(fused | {j for c in chains.values() for j in c})
    return Program(tuple(nodes), tuple(steps), graph.input, graph.output, frozenset(fused), chains, skip)


# ---- which tensors are channels last ----------------------------------------------------------

#: nodes that keep their input's layout and run channels last at speed (``add``/``mul``: when
#: every input is channels last)
_KEEPS_LAYOUT = ("act", "affine", "add", "mul", "pool", "resize")


def channels_last_tensors(prog: Program, every: bool = False) -> set:
    """Names of the tensors to write channels last (``layers/layout``): outputs of Winograd convs,
    and fragments a depth-first pooling node copies out (its input is a layer's output).

    A tensor is channels last if such a writer wrote it, or a node that keeps the layout
    (:data:`_KEEPS_LAYOUT`; a max-pool subsampling or in MPF, a nearest upsampling; an add or mul
    of channels-last inputs) made it from one.  A writer is chosen while every channels-last tensor
    that flows from it is read only by untiled Winograd or 1x1x1 convs and such nodes, never
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
        return (
            node.op in _KEEPS_LAYOUT
            and (node.op != "pool" or (node["kind"] == "max" and steps[i].primitive not in ("pool", "slab")))
            and (node.op != "resize" or node["mode"] == "nearest")
        )

    def reads(i):  # reads a channels-last input at speed (a mixed add is checked apart)
        node, step = nodes[i], steps[i]
        if node.op == "conv":  # Winograd, or a 1x1x1 conv (conv_pointwise_chain reads it in place)
            prim = PRIMITIVES.get(step.primitive)
            return (
                prim is not None
                and prim.reads_channels_last(node.conv.kernel)
                and not step.tile
                and not step.micro_batch
            )
        return keeps(i)

    def writes(i):
        node, step = nodes[i], steps[i]
        if node.op == "pool":  # depth first: gather_fragment copies each fragment in the layout asked
            return step.primitive == "pool" and node.inputs[0] != prog.input
        return (
            node.op == "conv"
            and getattr(PRIMITIVES.get(step.primitive), "writes_channels_last", False)
            and not step.tile
            and not step.micro_batch
            and node.conv.out_channels > 1
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
                nodes[i].op in ("add", "mul") and nodes[i].output not in sources for i in readers.get(name, ())
            )  # mixed with a channels-first input
            if bad:
                drop |= src
        if not drop:
            return set(sources) if every else chosen
        chosen -= drop
