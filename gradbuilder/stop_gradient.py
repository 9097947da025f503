"""StopGradient: the identity whose output carries no gradient back (torch's `detach`, JAX's `stop_gradient`).

ONNX has no such op, and torch's exporters drop `detach`, so a detached tensor would pass gradients on. In
gradbuilder's own domain (Yield's), registered as non-differentiable (rules/nondiff.py): reachability cuts the
edge in its one pass. `split` writes it as an Identity, so both halves run on stock onnxruntime; `as_identity`
does the same for a forward model run without a split.

ZeroGradient is the identity of derivative zero (the mean and std of torch.normal, whose formula is
`zeros_like(grad)`): no gradient flows through it either, but what reaches a differentiated output only through
it gets zeros, as torch gives, not None (reachability's `zero_of`). Both are written as Identities alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import defs, helper

from .yield_op import DOMAIN

OP_TYPE = "StopGradient"
ZERO_GRADIENT = "ZeroGradient"


def register_identity_schema(op_type: str, doc: str, attributes: Sequence[defs.OpSchema.Attribute] = ()) -> None:
    """onnx's schema for an op of gradbuilder's domain typed as Identity (once): so the checker accepts it, shape
    inference types (and sizes) its output, which the rules after it read, and onnxscript can write it."""
    try:
        defs.get_schema(op_type, 1, DOMAIN)
        return
    except defs.SchemaError:
        pass
    identity = defs.get_schema("Identity", defs.onnx_opset_version())
    types = sorted({t for c in identity.type_constraints for t in c.allowed_type_strs if t.startswith("tensor(")})
    schema = defs.OpSchema(op_type, DOMAIN, 1, doc, inputs=[defs.OpSchema.FormalParameter("input", "T")],
                           outputs=[defs.OpSchema.FormalParameter("output", "T")],
                           type_constraints=[("T", types, "any tensor type")], attributes=list(attributes))
    schema.set_type_and_shape_inference_function(identity.get_type_and_shape_inference_function())
    defs.register_schema(schema)


register_identity_schema(OP_TYPE, "The identity, with no gradient (torch's detach).")
register_identity_schema(ZERO_GRADIENT, "The identity, of derivative zero (torch's zeros_like(grad)).")


def is_stop_gradient(node: onnx.NodeProto) -> bool:
    """Whether `node` is a StopGradient or a ZeroGradient (either an Identity once split)."""
    return node.op_type in (OP_TYPE, ZERO_GRADIENT) and node.domain == DOMAIN


def make_node(x: str, y: str, name: str = "") -> onnx.NodeProto:
    return helper.make_node(OP_TYPE, [x], [y], name=name or None, domain=DOMAIN)


def identities(nodes: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` with every StopGradient replaced by an Identity of the same name (the others as they are)."""
    return [helper.make_node("Identity", list(n.input), list(n.output), name=n.name or None) if is_stop_gradient(n)
            else n for n in nodes]


def reading_sources(nodes: Iterable[onnx.NodeProto], stops: Iterable[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` reading, for every StopGradient output of `stops`, its input instead (the same values): backward
    then stashes one tensor, not it and its copy. Nodes that read none are returned as they are."""
    source = {n.output[0]: n.input[0] for n in stops if is_stop_gradient(n)}
    if not source:
        return list(nodes)

    def root(name: str) -> str:
        while name in source:
            name = source[name]
        return name

    out = []
    for n in nodes:
        if any(x in source for x in n.input):
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.input[:] = [root(x) for x in n.input]
            n = copy
        out.append(n)
    return out


def as_identity(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself when it has no StopGradient, else a copy with Identities (and without gradbuilder's domain
    import when nothing else of that domain is left)."""
    if not any(is_stop_gradient(n) for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = identities(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    if not any(n.domain == DOMAIN for n in nodes):
        kept = [op for op in out.opset_import if op.domain != DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(kept)
    return out
