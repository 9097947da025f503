"""Ops whose outputs carry no gradient back to their inputs.

Non-float outputs already stop gradients; this list is for the float outputs whose derivative is zero
almost everywhere or undefined (Floor, Round, Sign, random draws, EyeLike, one-hot values) and for the
shape/compare/logic ops, so that `gradbuilder ops` lists them and reachability cuts the edge by name.
Mod is not here: fmod has a gradient (1 for the dividend, -trunc(a/b) for the divisor); see elementwise.
"""

from __future__ import annotations

from ..graph import MIN_OPSET
from ..stop_gradient import OP_TYPE as STOP_GRADIENT
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
    # piecewise constant
    "Floor", "Ceil", "Round", "Sign", "ArgMax", "ArgMin", "Hardmax",
    # random draws
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial",
    "NonMaxSuppression",
)

for _op in NONDIFFERENTIABLE:
    nondifferentiable(_op, since=max(MIN_OPSET, _INTRODUCED.get(_op, MIN_OPSET)))

nondifferentiable(STOP_GRADIENT, domain=DOMAIN)
"""gradbuilder's own identity without a gradient (stop_gradient.py): torch's `detach`."""
