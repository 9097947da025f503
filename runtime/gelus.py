"""torch's GELU as one node: onnxruntime's contrib Gelu (the erf form) or FastGelu (the tanh form).

Before opset 20 ONNX has no GELU, so torch's exporter spells `F.gelu` out: 0.5 x (1 + erf(x / sqrt 2)) in five
elementwise nodes, 0.5 x (1 + tanh(beta (x + kappa x^3))) in nine (Hugging Face's GPT-2 writes the latter itself,
with a Pow, in eight). Built from those, the gradient differentiates each
node and sums the three paths back to x. onnxruntime's contrib kernels compute either form in one vectorized pass,
and gradbuilder's rules for them (`gradbuilder.rules.activations`) write torch's GeluBackward in 11 and 14 passes.
On the source, before the gradient is built: the forward graph runs the contrib node, the backward the rule's
formula. float32 only (FastGelu's CPU kernel is float32's), and only where nothing else reads the pattern's
intermediate values.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from gradbuilder.graph import infer_shapes_safely
from gradbuilder.inference import tensor_types
from gradbuilder.rules.activations import GELU_BETA, GELU_KAPPA
from gradbuilder.rules.linalg import MICROSOFT

from .passes import Readers, constant_values, drop_unread, forget_types


class _Match:
    """Reads the pattern from its last node: each step checks one node and remembers it as the pattern's."""

    def __init__(self, readers: Readers, consts: dict[str, np.ndarray]):
        self.readers, self.consts = readers, consts
        self.nodes: list[onnx.NodeProto] = []

    def node(self, name: str, op: str, inner: bool = True) -> onnx.NodeProto | None:
        """The node making `name` if it is an `op`; an inner one must have no other reader (nor be an output)."""
        n = self.readers.producer.get(name)
        if n is None or n.op_type != op or n.domain not in ("", "ai.onnx"):
            return None
        if inner and (self.readers.reads[name] != 1 or name in self.readers.outputs):
            return None
        self.nodes.append(n)
        return n

    def const(self, name: str, value: float) -> bool:
        v = self.consts.get(name)
        return v is not None and v.size == 1 and v.dtype == np.float32 and \
            math.isclose(float(v.reshape(-1)[0]), value, rel_tol=1e-6)

    def split(self, n: onnx.NodeProto, value: float) -> str | None:
        """The operand of a binary node whose other operand is the constant `value`."""
        a, b = n.input
        return b if self.const(a, value) else a if self.const(b, value) else None

    def tail(self, out: str) -> tuple[str, str] | None:
        """(x, e) of 0.5 * (x * (1 + e)) (torch's exporter) or (x * 0.5) * (e + 1) (Hugging Face's NewGELU), the
        operands of each product and sum in either order."""
        last = self.node(out, "Mul", inner=False)
        if last is None:
            return None
        kept = len(self.nodes)
        product = self.node(self.split(last, 0.5) or "", "Mul")
        for x, rest in (product.input, product.input[::-1]) if product is not None else ():
            e = self.one_plus(rest)
            if e is not None:
                return x, e
        for h, rest in (last.input, last.input[::-1]):
            del self.nodes[kept:]
            half = self.readers.producer.get(h)
            x = self.split(half, 0.5) if half is not None and half.op_type == "Mul" else None
            e = self.one_plus(rest) if x is not None and self.node(h, "Mul") is not None else None
            if e is not None:
                return x, e
        return None

    def one_plus(self, name: str) -> str | None:
        """e where `name` is made by 1 + e."""
        add = self.readers.producer.get(name)
        e = self.split(add, 1.0) if add is not None and add.op_type == "Add" else None
        return e if e is not None and self.node(name, "Add") is not None else None

    def erf_form(self, x: str, e: str) -> bool:
        erf = self.node(e, "Erf")
        div = self.node(erf.input[0], "Div") if erf is not None else None
        return div is not None and div.input[0] == x and self.const(div.input[1], math.sqrt(2))

    def tanh_form(self, x: str, e: str) -> bool:
        tanh = self.node(e, "Tanh")
        scaled = self.node(tanh.input[0], "Mul") if tanh is not None else None
        inner = self.node(self.split(scaled, GELU_BETA) or "", "Add") if scaled is not None else None
        if inner is None or x not in inner.input:
            return False
        cubed = self.node(inner.input[1] if inner.input[0] == x else inner.input[0], "Mul")
        name = (self.split(cubed, GELU_KAPPA) or "") if cubed is not None else ""
        power = self.readers.producer.get(name)
        if power is not None and power.op_type == "Pow":  # x ** 3 (Hugging Face's NewGELU)
            return power.input[0] == x and self.const(power.input[1], 3.0) and self.node(name, "Pow") is not None
        cube = self.node(name, "Mul")
        square = self.node(next((t for t in cube.input if t != x), ""), "Mul") if cube is not None else None
        return square is not None and x in cube.input and list(square.input) == [x, x]


def fused_gelus(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with the exporter's GELU patterns as contrib nodes (a rewritten copy), or `model` itself."""
    g = model.graph
    if not any(n.op_type in ("Erf", "Tanh") for n in g.node):
        return model
    readers, consts = Readers.of(g), constant_values(g)
    found: dict[str, tuple[str, str, list[onnx.NodeProto]]] = {}  # output -> (op, x, nodes)
    for n in g.node:
        if n.op_type != "Mul" or n.domain not in ("", "ai.onnx"):
            continue
        m = _Match(readers, consts)
        parts = m.tail(n.output[0])
        if parts is None:
            continue
        nodes = list(m.nodes)
        for op, form in (("Gelu", m.erf_form), ("FastGelu", m.tanh_form)):
            m.nodes = list(nodes)
            if form(*parts):
                found[n.output[0]] = (op, parts[0], m.nodes)
                break
    if not found:
        return model
    types = tensor_types(infer_shapes_safely(model) or g)
    found = {out: f for out, f in found.items() if types.get(f[1], (0, None))[0] == TensorProto.FLOAT}
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gone = {o for _, _, ns in found.values() for k in ns for o in k.output}
    nodes = []
    for n in out.graph.node:
        if not gone.intersection(n.output):
            nodes.append(n)
        elif n.output[0] in found:
            op, x, _ = found[n.output[0]]
            fused = helper.make_node(op, [x], [n.output[0]], name=f"{n.output[0]}/{op}", domain=MICROSOFT)
            fused.metadata_props.extend(n.metadata_props)  # a checkpointed region's tag (`recompute.region`)
            nodes.append(fused)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    forget_types(out.graph, gone)
    outputs = {o.name for o in out.graph.output}
    for name, (_, x, _) in found.items():  # onnx's inference does not know the contrib ops: declared as x
        if name not in outputs:
            out.graph.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, types[x][1]))
    if not any(o.domain == MICROSOFT for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MICROSOFT, 1))
    drop_unread(out)
    return out
