"""The elementwise ops onnxruntime computes in float only, written for float64 in ops it has double kernels of.

onnxruntime's CPU provider has no float64 kernel of Erf, the inverse and hyperbolic trigonometric functions, Tan,
HardSigmoid, HardSwish, Gelu, Softsign, ThresholdedRelu and the activations of float attributes (LeakyRelu, Elu,
Selu, Celu, Softplus, Mish): a float64 module using one (a GELU: a ViT, BERT) could not load its session. When
onnxruntime refuses a graph for a missing kernel, `Runner` has those of float64 inputs written out here and loads
it again: the forward's and the backward's graphs alike, never the source the gradient is built from (the rules'
derivatives stay: erf's is an Exp).

The forms are accurate to a few units in the last place against mpmath at 40 digits (erf 2, atan 3, asin 4, the
rest 1-2; torch's own within 1), nan, infinities and the domains' edges as torch's: erf by its Taylor polynomial
at the nearest quarter (`erf_taylor`); atan by two argument halvings and its series; asin, acos through atan;
tan after a reduction by pi / 2 in two parts; log1p in Kahan's form (the hyperbolic inverses); sinh by its series
below 1. An attribute (a LeakyRelu's slope)
is a float32 as ONNX stores it: torch's exporters write torch's own float64 constants for those (`symbolics`,
`dynamo_translations`), so these meet them only in other graphs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from gradbuilder.graph import default_opset, infer_shapes_safely
from gradbuilder.inference import tensor_types

from . import vectorized
from .passes import Nodes, float_attr, rewrite_nodes

ERF_STEP = 0.25
"""The spacing of `erf_taylor`'s points: |x| at most 1/8 from one."""
ERF_DEGREE = 13
"""The Taylor polynomials' degree: 13 and 14 were within 2 units in the last place of mpmath's erf, 12 within 8."""
ERF_ONE = 6.0
"""erf rounds to 1 in float64 from 5.93 on: |x| beyond this reads the polynomial at it."""
ATAN_HALVINGS = 2
"""atan(u) = 2 atan(u / (1 + sqrt(1 + u^2))), twice: |u| <= 1 becomes at most tan(pi / 16) = 0.199."""
ATAN_SERIES = [(-1) ** k / (2 * k + 1) for k in range(13)]
"""atan(v) = v (1 - v^2 / 3 + ...): the 13th term below 1e-17 of it for |v| <= 0.199."""
SINH_SERIES = [1 / math.factorial(2 * k + 1) for k in range(10)]
"""sinh(x) = x (1 + x^2 / 6 + ...) for |x| < 1, where exp(x) - exp(-x) would cancel."""
HALF_PI_HIGH = math.ldexp(math.floor(math.ldexp(math.pi / 2, 31)), -31)
"""pi / 2 to 32 bits: k times it is exact for |k| < 2^21."""
HALF_PI_LOW = math.pi / 2 - HALF_PI_HIGH + math.sin(math.pi) / 2
"""The rest of pi / 2, pi's own rounding error included (sin(math.pi) is pi - math.pi to float64's precision)."""
HUGE = 2.0 ** 28
"""Beyond it asinh(x) = log(2x) and acosh(x) = log(2x) in float64 (and x^2 would overflow further on)."""


@functools.cache
def erf_taylor() -> np.ndarray:
    """Row k: the k-th Taylor coefficients of erf at the points 0, `ERF_STEP`, ..., `ERF_ONE`. The 0th is libm's
    erf (within one unit in the last place); the others follow from erf' = g = 2 / sqrt(pi) exp(-x^2), whose
    coefficients b at a satisfy (k + 1) b[k + 1] = -2 a b[k] - 2 b[k - 1] (g' = -2 x g)."""
    points = np.arange(round(ERF_ONE / ERF_STEP) + 1) * ERF_STEP
    table = np.zeros((ERF_DEGREE + 1, len(points)))
    for j, a in enumerate(points):
        b = [2 / math.sqrt(math.pi) * math.exp(-a * a)]
        for k in range(ERF_DEGREE - 1):
            b.append((-2 * a * b[k] - 2 * (b[k - 1] if k else 0.0)) / (k + 1))
        table[0, j] = math.erf(a)
        table[1:, j] = [bk / (k + 1) for k, bk in enumerate(b)]
    return table


class _Forms:
    """Emits the forms' nodes over float64 tensors."""

    def __init__(self, e: Nodes):
        self.e = e

    def const(self, value: float | np.ndarray) -> str:
        return self.e("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=np.float64), "v"))

    def where(self, condition: str, a: str, b: str) -> str:
        return self.e("Where", condition, a, b)

    def odd(self, x: str, y: str) -> str:
        """x's sign times y (0 for x = 0, nan for nan)."""
        return self.e("Mul", self.e("Sign", x), y)

    def series(self, x: str, coefficients: list[float]) -> str:
        """x (c0 + c1 x^2 + c2 x^4 + ...), by Horner's rule in x^2."""
        e, square = self.e, self.e("Mul", x, x)
        total = self.const(coefficients[-1])
        for c in coefficients[-2::-1]:
            total = e("Add", e("Mul", total, square), self.const(c))
        return e("Mul", x, total)

    def erf(self, x: str) -> str:
        """The Taylor polynomial of erf at the point of `erf_taylor` nearest |x| (|x| beyond `ERF_ONE`, and nan,
        at `ERF_ONE`), times x's sign."""
        e = self.e
        size = e("Abs", x)
        a = self.where(e("LessOrEqual", size, self.const(ERF_ONE)), size, self.const(ERF_ONE))
        steps = e("Round", e("Div", a, self.const(ERF_STEP)))
        t = e("Sub", a, e("Mul", steps, self.const(ERF_STEP)))
        point = e("Cast", steps, to=TensorProto.INT64)
        table = erf_taylor()
        total = e("Gather", self.const(table[-1]), point)
        for row in table[-2::-1]:
            total = e("Add", e("Mul", total, t), e("Gather", self.const(row), point))
        return self.odd(x, total)

    def atan(self, x: str) -> str:
        """pi / 2 - atan(1 / |x|) beyond 1, the halvings, the series; x's sign."""
        e = self.e
        size = e("Abs", x)
        beyond = e("Greater", size, self.const(1.0))
        u = self.where(beyond, e("Reciprocal", size), size)
        for _ in range(ATAN_HALVINGS):
            u = e("Div", u, e("Add", self.const(1.0), e("Sqrt", e("Add", self.const(1.0), e("Mul", u, u)))))
        inner = e("Mul", self.series(u, ATAN_SERIES), self.const(2.0 ** ATAN_HALVINGS))
        return self.odd(x, self.where(beyond, e("Sub", self.const(math.pi / 2), inner), inner))

    def log1p(self, x: str) -> str:
        """log(1 + x) as log(u) x / (u - 1) for u = 1 + x rounded (Kahan): the rounding's error cancels."""
        e = self.e
        u = e("Add", x, self.const(1.0))
        kahan = e("Mul", e("Log", u), e("Div", x, e("Sub", u, self.const(1.0))))
        return self.where(e("Equal", u, self.const(1.0)), x, kahan)

    def log_of_twice(self, x: str) -> str:
        return self.e("Add", self.e("Log", x), self.const(math.log(2.0)))

    def clipped(self, v: str, top: float) -> str:
        """v clipped to [0, top] by Wheres, which keep nan as torch's."""
        e = self.e
        low = self.where(e("Greater", v, self.const(top)), self.const(top), v)
        return self.where(e("Less", v, self.const(0.0)), self.const(0.0), low)


def _erf(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.erf(x)


def _atan(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.atan(x)


def _asin(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """atan(x / sqrt((1 - x)(1 + x))): +-pi / 2 at +-1 (x / 0), nan beyond."""
    e, one = f.e, f.const(1.0)
    return f.atan(e("Div", x, e("Sqrt", e("Mul", e("Sub", one, x), e("Add", one, x)))))


def _acos(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """2 atan(sqrt((1 - x) / (1 + x))): pi at -1, nan beyond +-1."""
    e, one = f.e, f.const(1.0)
    return e("Mul", f.const(2.0), f.atan(e("Sqrt", e("Div", e("Sub", one, x), e("Add", one, x)))))


def _exps(f: _Forms, x: str) -> tuple[str, str]:
    grown = f.e("Exp", x)
    return grown, f.e("Reciprocal", grown)


def _sinh(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    e = f.e
    grown, shrunk = _exps(f, x)
    wide = e("Mul", e("Sub", grown, shrunk), f.const(0.5))
    return f.where(e("Less", e("Abs", x), f.const(1.0)), f.series(x, SINH_SERIES), wide)


def _cosh(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.e("Mul", f.e("Add", *_exps(f, x)), f.const(0.5))


def _tan(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """sin(r) / cos(r), or -cos(r) / sin(r) for an odd k, where r = x - k pi / 2 is within pi / 4 of 0 (pi / 2
    in `HALF_PI_HIGH` and `HALF_PI_LOW`): onnxruntime's Cos is exact near its zeros in absolute terms only, so
    sin(x) / cos(x) was 1e-14 off there, relatively."""
    e = f.e
    k = e("Round", e("Div", x, f.const(math.pi / 2)))
    r = e("Sub", e("Sub", x, e("Mul", k, f.const(HALF_PI_HIGH))), e("Mul", k, f.const(HALF_PI_LOW)))
    sin, cos = e("Sin", r), e("Cos", r)
    half = e("Mul", k, f.const(0.5))
    odd = e("Not", e("Equal", e("Floor", half), half))
    return f.where(odd, e("Neg", e("Div", cos, sin)), e("Div", sin, cos))


def _asinh(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """log1p(r + r^2 / (1 + sqrt(1 + r^2))) for r = |x|, log(2r) beyond `HUGE`; x's sign."""
    e, one = f.e, f.const(1.0)
    r = e("Abs", x)
    square = e("Mul", r, r)
    near = f.log1p(e("Add", r, e("Div", square, e("Add", one, e("Sqrt", e("Add", one, square))))))
    return f.odd(x, f.where(e("Greater", r, f.const(HUGE)), f.log_of_twice(r), near))


def _acosh(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """log1p(t + sqrt(2t + t^2)) for t = x - 1, log(2x) beyond `HUGE`; nan below 1."""
    e = f.e
    t = e("Sub", x, f.const(1.0))
    near = f.log1p(e("Add", t, e("Sqrt", e("Add", e("Mul", t, f.const(2.0)), e("Mul", t, t)))))
    return f.where(e("Greater", x, f.const(HUGE)), f.log_of_twice(x), near)


def _atanh(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """(log1p(x) - log1p(-x)) / 2: +-inf at +-1, nan beyond."""
    e = f.e
    return e("Mul", e("Sub", f.log1p(x), f.log1p(e("Neg", x))), f.const(0.5))


def _hard_sigmoid(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    v = f.e("Add", f.e("Mul", x, f.const(float_attr(node, "alpha", 0.2))), f.const(float_attr(node, "beta", 0.5)))
    return f.clipped(v, 1.0)


def _hard_swish(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """x clip(x + 3, 0, 6) / 6, torch's: x / 6 + 1 / 2 would cancel near -3."""
    e = f.e
    return e("Div", e("Mul", x, f.clipped(e("Add", x, f.const(3.0)), 6.0)), f.const(6.0))


def _gelu(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    """x (1 + erf(x / sqrt(2))) / 2, or with tanh(sqrt(2 / pi) (x + 0.044715 x^3)) for erf (approximate "tanh")."""
    e = f.e
    if next((a.s for a in node.attribute if a.name == "approximate"), b"none") == b"tanh":
        cube = e("Mul", e("Mul", x, x), x)
        inner = e("Mul", e("Add", x, e("Mul", cube, f.const(0.044715))), f.const(math.sqrt(2 / math.pi)))
        curve = e("Tanh", inner)
    else:
        curve = f.erf(e("Mul", x, f.const(math.sqrt(0.5))))
    return e("Mul", e("Mul", x, e("Add", curve, f.const(1.0))), f.const(0.5))


def _softsign(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.e("Div", x, f.e("Add", f.e("Abs", x), f.const(1.0)))


def _thresholded_relu(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.where(f.e("Greater", x, f.const(float_attr(node, "alpha", 1.0))), x, f.const(0.0))


def _leaky_relu(f: _Forms, x: str, node: onnx.NodeProto) -> str:
    return f.where(f.e("Greater", x, f.const(0.0)), x, f.e("Mul", x, f.const(float_attr(node, "alpha", 0.01))))


FORMS: dict[str, Callable[[_Forms, str, onnx.NodeProto], str]] = {
    "Erf": _erf, "Atan": _atan, "Asin": _asin, "Acos": _acos, "Sinh": _sinh, "Cosh": _cosh, "Tan": _tan,
    "Asinh": _asinh, "Acosh": _acosh, "Atanh": _atanh, "HardSigmoid": _hard_sigmoid, "HardSwish": _hard_swish,
    "Gelu": _gelu, "Softsign": _softsign, "ThresholdedRelu": _thresholded_relu, "LeakyRelu": _leaky_relu}
"""Each op's form: the name of a tensor holding its output."""
VECTORIZED = frozenset({"Elu", "Selu", "Celu", "Softplus", "Mish"})
"""Written out by `vectorized` already (its constants CastLike x: opset 15 and up)."""


def float64_tensors(model: onnx.ModelProto) -> set[str]:
    """The names of the main graph's float64 tensors, as far as shape inference types them."""
    graph = infer_shapes_safely(model) or model.graph
    names = {name for name, (elem, _) in tensor_types(graph).items() if elem == TensorProto.DOUBLE}
    return names | {t.name for t in model.graph.initializer if t.data_type == TensorProto.DOUBLE}


def written_out(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with the main graph's nodes of `FORMS` and `VECTORIZED` reading float64 written out; `model` itself
    when it has none."""
    candidates = [k for k, n in enumerate(model.graph.node)
                  if n.domain in ("", "ai.onnx") and (n.op_type in FORMS or n.op_type in VECTORIZED)]
    if not candidates:
        return model
    doubles = float64_tensors(model)
    opset = default_opset(model)
    plan = [(k,) for k in candidates if model.graph.node[k].input[0] in doubles
            and (model.graph.node[k].op_type in FORMS or opset >= vectorized.MIN_OPSET)]

    def build(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
        if node.op_type in VECTORIZED:
            return vectorized.activation(node, taken, opset)
        e = Nodes(node.name or node.output[0], taken)
        e("Identity", FORMS[node.op_type](_Forms(e), node.input[0], node), out=node.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)
