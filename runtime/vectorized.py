"""Ops whose onnxruntime CPU kernels run element by element, or row by row over short rows, written out in
vectorized ones (MLAS's Exp, Log, Tanh, Relu, reductions and arithmetic).

Over [64, 16, 28, 28] at 2 threads, onnxruntime's Softplus took 4.8 ms and Mish 5.0, Elu 0.76, Selu 0.78, Celu
0.97, against 0.09 for Exp and 0.11 for Relu; Softmax and LogSoftmax over the class axis of [N, C, H, W] (a
segmentation loss) 6.5 ms, a row of 16 at a time, against 0.46 written out. So the graphs onnxruntime runs get

- Elu(x) = Relu(x) + alpha (exp(min(x, 0)) - 1); Selu = gamma Elu_alpha; Celu(x) = Relu(x) + alpha (exp(min(x, 0)
  / alpha) - 1);
- Sigmoid(x) = 1 / (1 + exp(-x)), torch's formula: onnxruntime's kernel (MLAS's logistic) is accurate in
  absolute terms only, zero below x ~ -18 (`IMPRECISE`); 1.5x its time (0.20 against 0.14 ms over 800k);
- Softplus(x) = Relu(x) + log1p(exp(-|x|)), stable for large |x|, with log1p(e) = log(u) + (e - (u - 1)) / u for
  u = 1 + e (the rounding 1 + e loses, put back: softplus(-30) = 9.4e-14 as in torch, not 0);
- Mish(x) = x tanh(softplus(x)) (an operator from opset 18; before, exporters write Softplus and Tanh);
- Softmax and LogSoftmax over an axis other than the last, x's rank known: c = x - max(x), then exp(c) / sum(exp(c))
  or c - log(sum(exp(c))), the kernels' own algorithm (over the last axis the kernels are faster and stay).
- a bound picked by a Where, as hardtanh and ReLU6 are exported for torch's strict gradient at the bounds
  (`functions._strict_clip`): Where(x >= H, H, b) with b = x, Relu(x) (H > 0) or max(x, L) (L <= H) is
  Clip(b, -inf, H), and Where(x <= L, L, x) is Clip(x, L, inf), for bounds other than 0 (where the Where picks
  +0 for x = -0): onnxruntime's Where takes ~5 ns an element (ReLU6 over [32, 96, 32, 32] as Relu,
  GreaterOrEqual and Where 18.7 ms, as Clip 1.0);
- over tensors of `GUARD_MIN_ELEMENTS` known elements or more (`LARGE`), Sign(x) = (x > 0) - (x < 0), 0 for nan
  as torch's sign (the Abs gradient of an L1 loss), where onnxruntime's kernel gives nan; and PRelu with more than
  one slope (one a channel) = Relu(x) + s min(x, 0), its kernel where a slope is not finite (s 0 would be nan).

The same values up to the last bits of exp and log (and the sign of a zero: Elu(-0) is +0 here), nan and
infinities included (the Clips' values are the Wheres', bit for bit; Sign's nan is torch's). Only the forward and
backward graphs onnxruntime runs change, never the source the gradient is built from: the rules' own gradients
(Elu's from its output, Softplus' a sigmoid, hardtanh's strict masks) stay.
"""

from __future__ import annotations

import functools
import math

import onnx
from onnx import TensorProto, helper

from gradbuilder.graph import default_opset, infer_shapes_safely
from gradbuilder.inference import tensor_types

from .passes import (
    FLOATS,
    GUARD_MIN_ELEMENTS,
    Nodes,
    constant_values,
    drop_unread,
    finite_or_exact,
    float_attr,
    int_attr,
    known_elements,
    rewrite_nodes,
)

SLOW = frozenset({"Elu", "Selu", "Celu", "Softplus", "Mish"})
IMPRECISE = frozenset({"Sigmoid"})
"""MLAS's logistic is accurate to ~1e-7 absolute, not relative: sigmoid(-17.9) came out 8.9e-8 (torch's 1.6e-8)
and below -18 zero, so log(sigmoid(x)) was -inf where torch's is finite."""
SOFTMAX = frozenset({"Softmax", "LogSoftmax"})
LARGE = frozenset({"Sign", "PRelu"})
"""Kernels slow over large tensors only, rewritten from `GUARD_MIN_ELEMENTS` known elements: Sign (~1.2 ns an
element, 0.93-1.2 ms over [64, 16, 28, 28] against 0.61 for its comparisons) and PRelu with a slope of more than one
value (one a channel: its broadcast loop, ~2.5 ns an element, 2.0-2.1 ms against 0.46; a single slope's kernel is
as fast as the formula)."""
MIN_OPSET = 15
"""The constants take x's type through CastLike (opset 15), so the rewrite needs no shape inference."""
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


class _Ops:
    """Emits the formulas' nodes, constants in x's type."""

    def __init__(self, e: Nodes, x: str):
        self.e, self.x = e, x

    def const(self, value: float) -> str:
        return self.e("CastLike", self.e("Constant", value=helper.make_tensor("v", TensorProto.FLOAT, [], [value])),
                      self.x)

    def exp_minus_one(self, scale: float, divisor: float = 1.0, out: str | None = None) -> str:
        """scale (exp(min(x, 0) / divisor) - 1) plus Relu(x): Elu, Selu's inside and Celu."""
        e = self.e
        negative = e("Min", self.x, self.const(0.0))
        if divisor != 1.0:
            negative = e("Div", negative, self.const(divisor))
        tail = e("Sub", e("Exp", negative), self.const(1.0))
        if scale != 1.0:
            tail = e("Mul", tail, self.const(scale))
        return e("Add", e("Relu", self.x), tail, out=out)

    def softplus(self, out: str | None = None) -> str:
        e = self.e
        small = e("Exp", e("Neg", e("Abs", self.x)))  # (0, 1]
        u = e("Add", small, self.const(1.0))
        log1p = e("Add", e("Log", u), e("Div", e("Sub", small, e("Sub", u, self.const(1.0))), u))
        return e("Add", e("Relu", self.x), log1p, out=out)


def _build(node: onnx.NodeProto, axis: int | None, elem: int, taken: set[str], *, opset: int
           ) -> list[onnx.NodeProto]:
    """`node` written out; `axis`: a Softmax's, `elem`: a `LARGE` op's element type (0 for the others)."""
    e = Nodes(node.name or node.output[0], taken)
    ops, y = _Ops(e, node.input[0]), node.output[0]
    if node.op_type == "Sign":  # (x > 0) - (x < 0): 0 for nan, as torch's sign (onnxruntime's kernel gives nan)
        zero = ops.const(0.0)
        e("Sub", *[e("CastLike", e(op, node.input[0], zero), node.input[0]) for op in ("Greater", "Less")], out=y)
    elif node.op_type == "PRelu":  # Relu(x) + s min(x, 0), the kernel where a slope is not finite
        fast = Nodes(y, taken)
        inner = _Ops(fast, node.input[0])
        fast("Add", fast("Relu", node.input[0]), fast("Mul", fast("Min", node.input[0], inner.const(0.0)),
                                                       node.input[1]))
        finite_or_exact(e, [node.input[1]], node, fast, elem)
    elif axis is not None:  # Softmax or LogSoftmax over `axis`
        top = e("ReduceMax", node.input[0], e.axes([axis]), keepdims=1) if opset >= 18 else \
            e("ReduceMax", node.input[0], axes=[axis], keepdims=1)  # axes an input from opset 18
        centered = e("Sub", node.input[0], top)
        exp = e("Exp", centered)
        total = e("ReduceSum", exp, e.axes([axis]), keepdims=1)
        if node.op_type == "Softmax":
            e("Div", exp, total, out=y)
        else:
            e("Sub", centered, e("Log", total), out=y)
    elif node.op_type == "Elu":
        ops.exp_minus_one(float_attr(node, "alpha", 1.0), out=y)
    elif node.op_type == "Celu":
        alpha = float_attr(node, "alpha", 1.0)
        ops.exp_minus_one(alpha, alpha, out=y)
    elif node.op_type == "Selu":
        gamma = float_attr(node, "gamma", SELU_GAMMA)
        e("Mul", ops.exp_minus_one(float_attr(node, "alpha", SELU_ALPHA)), ops.const(gamma), out=y)
    elif node.op_type == "Softplus":
        ops.softplus(out=y)
    elif node.op_type == "Sigmoid":  # 1 / (1 + exp(-x)), torch's: exact in relative terms (0 below x ~ -88)
        e("Div", ops.const(1.0), e("Add", e("Exp", e("Neg", node.input[0])), ops.const(1.0)), out=y)
    else:  # Mish
        e("Mul", node.input[0], e("Tanh", ops.softplus()), out=y)
    return e.nodes


def activation(node: onnx.NodeProto, taken: set[str], opset: int) -> list[onnx.NodeProto]:
    """An Elu, Selu, Celu, Softplus or Mish (`SLOW`) written out, for `double_forms` too (float64 has no kernels)."""
    return _build(node, None, 0, taken, opset=opset)


def _bound_selects(graph: onnx.GraphProto) -> list[tuple[int, str, str | None, str | None]]:
    """Plan rows (Where's index, the Clip's input, its low bound, its high bound) for the Wheres that pick a bound
    (module docstring); the bounds are scalar constants, the one compared with and the one picked equal."""
    producer = {o: n for n in graph.node for o in n.output}
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)
    scalars = constant_values(graph, lambda t: not t.dims and t.data_type in floats)
    empty = set(constant_values(graph, lambda t: list(t.dims) == [0]))
    for n in graph.node:  # dynamo's torch.full((), v): the scalar Cast, Expanded to no dims (shape Cast too)
        if n.domain not in ("", "ai.onnx") or not n.input:
            continue
        if n.op_type == "Cast" and n.input[0] in empty:
            empty.add(n.output[0])
        elif n.input[0] in scalars and ((n.op_type == "Cast" and int_attr(n, "to", 0) in floats) or
                                        (n.op_type == "Expand" and n.input[1] in empty)):
            scalars[n.output[0]] = scalars[n.input[0]]

    def made(name: str, op: str) -> onnx.NodeProto | None:
        n = producer.get(name)
        return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") else None

    def bound(where: onnx.NodeProto, op: str) -> tuple[str, float] | None:
        """(x, the bound) where `where` picks the bound where `op`(x, bound) holds."""
        if where.op_type != "Where" or where.domain not in ("", "ai.onnx") or len(where.input) != 3:
            return None
        cmp = made(where.input[0], op)
        if cmp is None or len(cmp.input) != 2 or cmp.input[1] not in scalars or where.input[1] not in scalars:
            return None
        value = float(scalars[cmp.input[1]])
        same = cmp.input[1] == where.input[1] or float(scalars[where.input[1]]) == value
        return (cmp.input[0], value) if same and math.isfinite(value) and value != 0 else None  # 0: -0 vs +0

    plan: list[tuple[int, str, str | None, str | None]] = []
    for k, n in enumerate(graph.node):
        low = bound(n, "LessOrEqual")
        if low is not None and n.input[2] == low[0]:
            plan.append((k, low[0], n.input[1], None))
            continue
        high = bound(n, "GreaterOrEqual")
        if high is None:
            continue
        x, b = high[0], n.input[2]
        relu, under = made(b, "Relu"), producer.get(b)
        floor = bound(under, "LessOrEqual") if under is not None else None
        if b == x or (relu is not None and relu.input[0] == x and high[1] > 0) or \
                (floor is not None and floor[0] == x and under.input[2] == x and floor[1] <= high[1]):
            plan.append((k, b, None, n.input[1]))
    return plan


def _clip(node: onnx.NodeProto, x: str, low: str | None, high: str | None, taken: set[str]) -> list[onnx.NodeProto]:
    e = Nodes(node.name or node.output[0], taken)
    ops = _Ops(e, x)
    e("Clip", x, low or ops.const(-math.inf), high or ops.const(math.inf), out=node.output[0])
    return e.nodes


def _bound_selects_as_clips(model: onnx.ModelProto) -> onnx.ModelProto:
    """The Wheres that pick a bound as Clips (module docstring); the comparisons nothing else reads dropped.
    `model` itself when there are none."""
    out = rewrite_nodes(model, _bound_selects(model.graph), _clip)
    if out is not model:
        drop_unread(out)
    return out


def vectorized_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every Sigmoid, Softplus, Elu, Selu, Celu and Mish of the main graph, every Softmax and LogSoftmax over
    an axis other than the last, the large Signs and per-channel PRelus, and the Wheres that pick a bound, in the
    formulas above; `model` itself when it has none (or its opset is below `MIN_OPSET`)."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        return model
    nodes = [(k, n) for k, n in enumerate(model.graph.node) if n.domain in ("", "ai.onnx")]
    plan: list[tuple[int, int | None, int]] = [(k, None, 0) for k, n in nodes if n.op_type in IMPRECISE or (
        n.op_type in SLOW and math.isfinite(float_attr(n, "alpha", 1.0)) and float_attr(n, "alpha", 1.0) != 0)]
    shaped = [(k, n) for k, n in nodes if n.op_type in SOFTMAX or n.op_type in LARGE]
    if shaped:
        shapes = tensor_types(model.graph)
        if any(shapes.get(t, (0, None))[1] is None for _, n in shaped for t in n.input):
            shapes = tensor_types(infer_shapes_safely(model) or model.graph)
        for k, n in shaped:
            elem, dims = shapes.get(n.input[0], (0, None))
            if n.op_type in LARGE:
                slope = shapes.get(n.input[1], (0, None))[1] if n.op_type == "PRelu" else None  # one a channel?
                if elem in FLOATS and dims is not None and known_elements(dims) >= GUARD_MIN_ELEMENTS and \
                        (n.op_type == "Sign" or (slope is not None and known_elements(slope) > 1)):
                    plan.append((k, None, elem))
                continue
            axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
            if dims is not None and len(dims) > 1 and axis % len(dims) != len(dims) - 1:
                plan.append((k, axis % len(dims), 0))
    return _bound_selects_as_clips(rewrite_nodes(model, sorted(plan), functools.partial(_build, opset=opset)))

