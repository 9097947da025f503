"""The Yield op: the boundary between forward and backward in a training graph.

Inputs: every module output, in order. Outputs: the host's gradient of each differentiable module
output, in order. Attributes (indices into the module outputs):
- `non_differentiable_outputs`: outputs with no Yield output (non-float, not selected, not depending
  on any differentiated tensor, or the loss, whose gradient is seeded with 1 inside the graph);
- `full_shape_outputs`: outputs whose gradient must arrive with the output's full shape; for every
  other differentiable output a scalar zero stands for "no gradient" (PyTorch's `None`).
Invariant: `#inputs == #outputs + len(non_differentiable_outputs)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import AttributeProto, helper

from .errors import SplitError

DOMAIN = "ai.gradbuilder"
VERSION = 1
OP_TYPE = "Yield"


@dataclass(frozen=True)
class YieldSignature:
    outputs: tuple[str, ...]
    """Module outputs (Yield inputs), in order."""
    grads: tuple[str, ...]
    """Yield outputs: the host gradients of the differentiable module outputs, in order."""
    non_differentiable: tuple[int, ...]
    full_shape: tuple[int, ...]

    @property
    def differentiable(self) -> tuple[int, ...]:
        nd = set(self.non_differentiable)
        return tuple(i for i in range(len(self.outputs)) if i not in nd)

    def grad_of(self) -> dict[int, str]:
        """Module output index -> name of its host gradient."""
        return dict(zip(self.differentiable, self.grads))


def make_yield(sig: YieldSignature, name: str) -> onnx.NodeProto:
    node = helper.make_node(OP_TYPE, list(sig.outputs), list(sig.grads), name=name, domain=DOMAIN)
    node.attribute.append(helper.make_attribute("non_differentiable_outputs", list(sig.non_differentiable),
                                                attr_type=AttributeProto.INTS))
    node.attribute.append(helper.make_attribute("full_shape_outputs", list(sig.full_shape),
                                                attr_type=AttributeProto.INTS))
    return node


def is_yield(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def read_yield(node: onnx.NodeProto) -> YieldSignature:
    attrs = {a.name: a for a in node.attribute}
    lists = {}
    for key in ("non_differentiable_outputs", "full_shape_outputs"):
        a = attrs.get(key)
        if a is not None and a.type != AttributeProto.INTS:
            raise SplitError(f"Yield node '{node.name}': attribute {key} is not a list of ints; the training graph "
                             "is damaged: rebuild it with `gradbuilder build`.")
        values = list(a.ints) if a is not None else []
        if len(set(values)) != len(values) or any(not 0 <= i < len(node.input) for i in values):
            raise SplitError(f"Yield node '{node.name}': {key} {values} are not distinct indices of its "
                             f"{len(node.input)} inputs; the training graph is damaged: rebuild it with "
                             "`gradbuilder build`.")
        lists[key] = tuple(values)
    sig = YieldSignature(tuple(node.input), tuple(node.output), lists["non_differentiable_outputs"],
                         lists["full_shape_outputs"])
    if len(sig.outputs) != len(sig.grads) + len(sig.non_differentiable):
        raise SplitError(
            f"Yield node '{node.name}' is inconsistent: {len(sig.outputs)} inputs but {len(sig.grads)} outputs "
            f"and {len(sig.non_differentiable)} non-differentiable outputs."
        )
    return sig


def find_yield(nodes: Sequence[onnx.NodeProto]) -> int:
    found = [k for k, n in enumerate(nodes) if is_yield(n)]
    if len(found) != 1:
        what = "none" if not found else f"{len(found)}"
        raise SplitError(
            f"expected exactly one {DOMAIN}.Yield node, found {what}: this is not a training graph made by "
            "`gradbuilder build` (build one first)."
        )
    return found[0]
