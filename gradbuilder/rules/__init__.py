"""Gradient rules, one module per op family; importing this package registers them all."""

from . import (  # noqa: F401 - each import registers one family
    activations,
    attention,
    elementwise,
    indexing,
    linalg,
    losses,
    nn,
    nondiff,
    normalization,
    recurrent,
    reduce,
    registry,
    resample,
    shape,
    spectral,
)
from .registry import Rule, all_rules, lookup, nondifferentiable, rule

__all__ = ["Rule", "all_rules", "lookup", "nondifferentiable", "registry", "rule"]
