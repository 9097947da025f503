"""Which tensors get gradients, decided in one pass over the finished forward graph.

A tensor gets a gradient iff it is reachable forward from a `wrt` tensor AND reaches backward to a
seeded output, both walks crossing only differentiable, float-typed edges. Backward nodes are never
part of this graph, so gradients never get gradients of their own.

torch also differentiates through ops of derivative zero (Round, Sign: `zeros_like(grad)`), which carry no
gradient here: a `wrt` tensor whose every path to the seeds crosses one gets zeros from torch, not None, and an
output computed from `wrt` only through one requires grad in torch. The same two walks crossing those edges too
find both (`zero_of`, `zero_seeds`), only where the graph has such an op.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .graph import CONTROL_FLOW_OPS, ForwardGraph, TensorInfo, describe, type_name
from .rules import registry


@dataclass
class Reachability:
    forward: set[str]
    backward: set[str]
    needs: set[str]
    edges: Edges
    active_inputs: dict[int, list[bool]] = field(default_factory=dict)
    """Node index -> which of its inputs need a gradient, for nodes that must be differentiated."""
    zero_of: dict[str, set[str]] = field(default_factory=dict)
    """Seed -> the `wrt` tensors torch differentiates from it that get no gradient from it here: connected to it
    only through ops of derivative zero (torch's gradient from it is zeros). A tensor's gradient for a set of
    seeds is zeros where one of them lists it and none gives it a gradient."""
    zero_seeds: set[str] = field(default_factory=set)
    """Seeds without a gradient path from `wrt` that torch differentiates: computed from `wrt` only through ops of
    derivative zero (their gradient reaches nothing)."""
    _loose: dict[tuple[str, ...], set[str]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def zero_wrt(self) -> set[str]:
        """`wrt` tensors without a gradient whose gradient is torch's zeros for all the seeds at once."""
        return set().union(*self.zero_of.values()) - self.needs

    def reason(self, fg: ForwardGraph, name: str, seeds: Sequence[str]) -> str | None:
        """Why `name` gets no gradient, in words, or None when it gets one."""
        if name in self.needs:
            return None
        info = fg.tensor_info(name)
        if not info.is_float:
            return f"it is {type_name(info.elem_type)}; only float tensors get gradients"
        if not fg.consumers.get(name) and name not in fg.outputs:
            return "no node reads it and it is not an output (unused)"
        if name not in self.backward:
            key = tuple(seeds)
            loose = self._loose.get(key)
            if loose is None:  # once per build, not once per tensor without a gradient
                loose = self._loose[key] = _walk_backward(fg, self.edges, seeds, strict=False)
            if name in loose:
                edge = _first_stop_edge(fg, self.edges, name, loose)
                where = f": {edge}" if edge else ""
                return ("every path from it to the differentiated outputs crosses a non-differentiable edge"
                        f"{where}")
            return "no differentiated output depends on it"
        return "it is not reachable from any tensor being differentiated"


class Edges:
    """Per node: which input edges and outputs are differentiable (rule stop edges, float types)."""

    def __init__(self, fg: ForwardGraph):
        self.fg = fg
        self.inputs: list[list[tuple[int, str, bool]]] = []
        self.outputs: list[list[tuple[str, bool]]] = []
        self.zero: dict[int, tuple[list[str], list[str]]] = {}
        """Nodes of derivative zero (`Rule.zero_derivative`) -> their float inputs and float outputs."""
        floats: dict[str, bool] = {}
        info, unknown = fg.info, TensorInfo()

        def is_float(name: str) -> bool:
            f = floats.get(name)
            if f is None:
                f = floats[name] = info.get(name, unknown).is_float
            return f

        is_computed = fg.producer.__contains__
        opset, lookup, hidden = fg.opset, registry.lookup, fg.hidden_inputs
        no_stops: frozenset[int] = frozenset()
        for k, (node, inputs, outputs, op, dom) in enumerate(zip(fg.nodes, fg.node_inputs, fg.node_outputs,
                                                                 fg.node_ops, fg.node_domains)):
            r = lookup(op, opset, dom)
            stops = r.stop_inputs(node, opset, is_computed) if r is not None else no_stops
            ins = [(i, n, (i not in stops) and is_float(n)) for i, n in enumerate(inputs) if n]
            if k in hidden:  # a control-flow body's hidden reads count as differentiable for reachability
                ins += [(-1, n, True) for n in sorted(hidden[k])]
            self.inputs.append(ins)
            if r is not None and r.zero_derivative:
                self.zero[k] = ([n for n in inputs if n and is_float(n)], [o for o in outputs if o and is_float(o)])
            if r is None or not (r.all_nondiff or r.nondiff_outputs):
                self.outputs.append([(o, bool(o) and is_float(o)) for o in outputs])
            else:
                self.outputs.append([(o, bool(o) and r.output_is_diff(j) and is_float(o))
                                     for j, o in enumerate(outputs)])


def _walk_forward(fg: ForwardGraph, edges: Edges, sources: Iterable[str], *, zeros: bool = False) -> set[str]:
    """`zeros`: crossing the edges of derivative zero too (torch's requires_grad)."""
    reached = {s for s in sources if fg.tensor_info(s).is_float}
    zero = edges.zero if zeros else {}
    for k in range(len(fg.nodes)):
        if any(d and name in reached for _, name, d in edges.inputs[k]):
            reached.update(o for o, d in edges.outputs[k] if d)
        elif k in zero and any(name in reached for name in zero[k][0]):
            reached.update(zero[k][1])
    return reached


def _walk_backward(fg: ForwardGraph, edges: Edges, seeds: Iterable[str], *, strict: bool = True,
                   zeros: bool = False) -> set[str]:
    reached = set(seeds) if not strict else {s for s in seeds if fg.tensor_info(s).is_float}
    zero = edges.zero if zeros else {}
    for k in range(len(fg.nodes) - 1, -1, -1):
        if any((d or not strict) and o in reached for o, d in edges.outputs[k]):
            reached.update(name for _, name, d in edges.inputs[k] if d or not strict)
        elif k in zero and any(o in reached for o in zero[k][1]):
            reached.update(zero[k][0])
    return reached


def _first_stop_edge(fg: ForwardGraph, edges: Edges, name: str, loose: set[str]) -> str | None:
    """The first stop edge, in node order, on the paths from `name` forward (only the nodes downstream of it are
    visited, in order: a heap of node positions fed by the consumers of what they produce)."""
    frontier = {name}
    heap = sorted({k for k, _ in fg.consumers.get(name, ())})
    queued = set(heap)
    while heap:
        k = heapq.heappop(heap)
        node = fg.nodes[k]
        ins = [(i, n, d) for i, n, d in edges.inputs[k] if n in frontier]
        if not ins:
            continue
        for i, n, d in ins:
            if any(o in loose for o in node.output) and not d:
                kind = "a non-float tensor" if not fg.tensor_info(n).is_float else "a non-differentiable input"
                return f"'{n}' is {kind} (input {i}) of node {describe(node)}"
        for o in node.output:
            if o:
                frontier.add(o)
                for j, _ in fg.consumers.get(o, ()):
                    if j not in queued:
                        queued.add(j)
                        heapq.heappush(heap, j)
    return None


def analyze(fg: ForwardGraph, wrt: Sequence[str], seeds: Sequence[str]) -> Reachability:
    edges = Edges(fg)
    fwd = _walk_forward(fg, edges, wrt)
    bwd = _walk_backward(fg, edges, seeds)
    needs = fwd & bwd
    active: dict[int, list[bool]] = {}
    for k, inputs in enumerate(fg.node_inputs):
        if not any(d and o in needs for o, d in edges.outputs[k]):
            continue
        flags = [False] * len(inputs)
        hidden = False
        for i, n, d in edges.inputs[k]:
            if d and n in needs:
                if i < 0:
                    hidden = True
                else:
                    flags[i] = True
        if any(flags) or hidden:
            active[k] = flags
    reach = Reachability(fwd, bwd, needs, edges, active)
    torch_fwd = _walk_forward(fg, edges, wrt, zeros=True) if edges.zero else fwd
    if any(n in torch_fwd for ins, _ in edges.zero.values() for n in ins):  # (not a Floor of sizes alone)
        differentiated = {w for w in wrt if w in torch_fwd}
        for s in seeds:  # one seed at a time: which outputs receive gradients is the host's choice at each step
            if s in torch_fwd:
                zeros = differentiated & _walk_backward(fg, edges, [s], zeros=True)
                if zeros:
                    zeros -= _walk_backward(fg, edges, [s])
                if zeros:
                    reach.zero_of[s] = zeros
        reach.zero_seeds = {s for s in seeds if s in torch_fwd} - needs
    return reach


def is_control_flow(op_type: str) -> bool:
    return op_type in CONTROL_FLOW_OPS
