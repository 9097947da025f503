"""Ops whose outputs carry no gradient back to their inputs.

Non-float outputs already stop gradients; this list is for the float outputs whose derivative is zero
almost everywhere or undefined (Floor, Round, Sign, random draws, EyeLike, one-hot values) and for the
shape/compare/logic ops, so that `gradbuilder ops` lists them and reachability cuts the edge by name. Those
torch differentiates to zeros (Floor, Round, Sign, Bernoulli) are declared so: what only they connect to a
differentiated output gets torch's zeros rather than None. Mod is not here: fmod has a gradient (1 for the
dividend, -trunc(a/b) for the divisor); see elementwise.
"""

from __future__ import annotations

from ..graph import MIN_OPSET
from ..stop_gradient import OP_TYPE as STOP_GRADIENT
from ..stop_gradient import ZERO_GRADIENT
from ..yield_op import DOMAIN
from .registry import nondifferentiable

_INTRODUCED = {"Bernoulli": 15, "BlackmanWindow": 17, "HammingWindow": 17, "HannWindow": 17,
               "BitwiseAnd": 18, "BitwiseOr": 18, "BitwiseXor": 18, "BitwiseNot": 18}
"""Ops added after the oldest supported opset: their entries start where the op does."""

NONDIFFERENTIABLE = (
    # shapes, sizes and index generation
    "Shape", "Size", "ConstantOfShape", "Range", "OneHot", "NonZero", "EyeLike",
    "BlackmanWindow", "HammingWindow", "HannWindow",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "IsNaN", "IsInf",
    "Not", "And", "Or", "Xor", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    # indices and one-hots
    "ArgMax", "ArgMin", "Hardmax",
    # random draws
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
    "NonMaxSuppression",
)

ZERO_DERIVATIVE = ("Floor", "Ceil", "Round", "Sign", "Bernoulli")
"""Piecewise constant, and Bernoulli's probabilities: torch differentiates them to `zeros_like(grad)`, so a tensor
that reaches a differentiated output only through them gets zeros from torch (not None), and such an output
requires grad."""

for _op in NONDIFFERENTIABLE:
    nondifferentiable(_op, since=max(MIN_OPSET, _INTRODUCED.get(_op, MIN_OPSET)))
for _op in ZERO_DERIVATIVE:
    nondifferentiable(_op, since=max(MIN_OPSET, _INTRODUCED.get(_op, MIN_OPSET)), zero_derivative=True)

nondifferentiable(STOP_GRADIENT, domain=DOMAIN)
"""gradbuilder's own identity without a gradient (stop_gradient.py): torch's `detach`."""
nondifferentiable(ZERO_GRADIENT, domain=DOMAIN, zero_derivative=True)
"""Its identity of derivative zero: the mean and std of torch.normal."""
