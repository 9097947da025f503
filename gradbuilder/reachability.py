"""Which tensors get gradients, decided in one pass over the finished forward graph.

A tensor gets a gradient iff it is reachable forward from a `wrt` tensor AND reaches backward to a
seeded output, both walks crossing only differentiable, float-typed edges. Backward nodes are never
part of this graph, so gradients never get gradients of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .graph import CONTROL_FLOW_OPS, ForwardGraph, describe, type_name
from .rules import registry


@dataclass
class Reachability:
    forward: set[str]
    backward: set[str]
    needs: set[str]
    active_inputs: dict[int, list[bool]] = field(default_factory=dict)
    """Node index -> which of its inputs need a gradient, for nodes that must be differentiated."""

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
            loose = _walk_backward(fg, seeds, strict=False)
            if name in loose:
                edge = _first_stop_edge(fg, name, loose)
                where = f": {edge}" if edge else ""
                return ("every path from it to the differentiated outputs crosses a non-differentiable edge"
                        f"{where}")
            return "no differentiated output depends on it"
        return "it is not reachable from any tensor being differentiated"


def edge_is_diff(fg: ForwardGraph, k: int, i: int) -> bool:
    node = fg.nodes[k]
    if i < 0:  # a control-flow body's hidden read: differentiable as far as reachability goes
        return True
    name = node.input[i]
    if not fg.tensor_info(name).is_float:
        return False
    r = registry.lookup(node.op_type, fg.opset, node.domain)
    return r is None or r.input_is_diff(i)


def output_is_diff(fg: ForwardGraph, k: int, j: int) -> bool:
    node = fg.nodes[k]
    name = node.output[j]
    if not name or not fg.tensor_info(name).is_float:
        return False
    r = registry.lookup(node.op_type, fg.opset, node.domain)
    return r is None or r.output_is_diff(j)


def _node_inputs(fg: ForwardGraph, k: int) -> Iterable[tuple[int, str]]:
    node = fg.nodes[k]
    for i, name in enumerate(node.input):
        if name:
            yield i, name
    for name in sorted(fg.hidden_inputs.get(k, ())):
        yield -1, name


def _walk_forward(fg: ForwardGraph, sources: Iterable[str]) -> set[str]:
    reached = {s for s in sources if fg.tensor_info(s).is_float}
    for k, node in enumerate(fg.nodes):
        if any(name in reached and edge_is_diff(fg, k, i) for i, name in _node_inputs(fg, k)):
            reached.update(o for j, o in enumerate(node.output) if output_is_diff(fg, k, j))
    return reached


def _walk_backward(fg: ForwardGraph, seeds: Iterable[str], *, strict: bool = True) -> set[str]:
    reached = set(seeds) if not strict else {s for s in seeds if fg.tensor_info(s).is_float}
    for k in range(len(fg.nodes) - 1, -1, -1):
        node = fg.nodes[k]
        if strict:
            hit = any(o in reached and output_is_diff(fg, k, j) for j, o in enumerate(node.output))
        else:
            hit = any(o in reached for o in node.output)
        if hit:
            reached.update(name for i, name in _node_inputs(fg, k) if not strict or edge_is_diff(fg, k, i))
    return reached


def _first_stop_edge(fg: ForwardGraph, name: str, loose: set[str]) -> str | None:
    frontier = {name}
    for k, node in enumerate(fg.nodes):
        ins = [(i, n) for i, n in _node_inputs(fg, k) if n in frontier]
        if not ins:
            continue
        for i, n in ins:
            if any(o in loose for o in node.output) and not edge_is_diff(fg, k, i):
                kind = "a non-float tensor" if not fg.tensor_info(n).is_float else "a non-differentiable input"
                return f"'{n}' is {kind} (input {i}) of node {describe(node)}"
        frontier.update(o for o in node.output if o)
    return None


def analyze(fg: ForwardGraph, wrt: Sequence[str], seeds: Sequence[str]) -> Reachability:
    fwd = _walk_forward(fg, wrt)
    bwd = _walk_backward(fg, seeds)
    needs = fwd & bwd
    active: dict[int, list[bool]] = {}
    for k, node in enumerate(fg.nodes):
        if not any(o in needs and output_is_diff(fg, k, j) for j, o in enumerate(node.output)):
            continue
        flags = [bool(n) and n in needs and edge_is_diff(fg, k, i) for i, n in enumerate(node.input)]
        hidden = any(n in needs for n in fg.hidden_inputs.get(k, ()))
        if any(flags) or hidden:
            active[k] = flags
    return Reachability(fwd, bwd, needs, active)


def is_control_flow(op_type: str) -> bool:
    return op_type in CONTROL_FLOW_OPS
