"""The rule table: op type (and opset range) -> gradient function plus its stop edges.

Rules register at import time of their family module; the table is immutable data after that,
so the builder stays a pure function of its inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx

if TYPE_CHECKING:
    from .context import Grad

MAX_OPSET = 28
"""Highest default-domain opset the rules are written and tested for (onnx 1.23's newest). From 24 to 28 ONNX
changed the ops the rules cover only by new element types, but for Attention (new inputs: its rule stops at 23),
SpaceToDepth (a `mode`) and Mod (float `fmod=0`), whose rules read them."""

RuleFn = Callable[["Grad"], Sequence["str | None"] | None]
StopFn = Callable[[onnx.NodeProto, int, Callable[[str], bool]], Iterable[int]]
"""(node, opset, is_computed) -> which of the rule's `nondiff` inputs stop gradients at this node."""


@dataclass(frozen=True)
class Rule:
    op_type: str
    fn: RuleFn | None
    since: int
    until: int
    domain: str = ""
    nondiff_inputs: frozenset[int] = field(default_factory=frozenset)
    nondiff_outputs: frozenset[int] = field(default_factory=frozenset)
    all_nondiff: bool = False
    family: str = ""
    nondiff_if: StopFn | None = None
    zero_derivative: bool = False
    """Its float outputs' derivative is zero (Round, Sign: torch's `zeros_like(grad)`): no gradient flows through
    it, but a tensor reaching a differentiated output only through such ops gets torch's zeros, not None."""

    def stop_inputs(self, node: onnx.NodeProto, opset: int, is_computed: Callable[[str], bool]) -> frozenset[int]:
        """Input positions that carry no gradient at this node."""
        if self.all_nondiff:
            return frozenset(range(len(node.input)))
        if self.nondiff_if is None:
            return self.nondiff_inputs
        return frozenset(self.nondiff_if(node, opset, is_computed)) & self.nondiff_inputs

    def output_is_diff(self, j: int) -> bool:
        return not self.all_nondiff and j not in self.nondiff_outputs

    @property
    def opset_range(self) -> str:
        return f"{self.since}-{self.until}"


_RULES: dict[tuple[str, str], list[Rule]] = {}


def _family_of(fn: Callable) -> str:
    return fn.__module__.rsplit(".", 1)[-1]


def _add(rule: Rule) -> None:
    rules = _RULES.setdefault((rule.domain, rule.op_type), [])
    for other in rules:
        if not (rule.until < other.since or other.until < rule.since):
            raise ValueError(f"overlapping rules for {rule.op_type}: {other.opset_range} and {rule.opset_range}")
    rules.append(rule)
    rules.sort(key=lambda r: r.since)
    lookup.cache_clear()


def rule(
    op_type: str,
    *,
    since: int = 13,
    until: int = MAX_OPSET,
    nondiff: Iterable[int] = (),
    nondiff_outputs: Iterable[int] = (),
    nondiff_if: StopFn | None = None,
    domain: str = "",
) -> Callable[[RuleFn], RuleFn]:
    """Register `fn(g) -> (grad of input 0, grad of input 1, ...)` for `op_type` at opsets since..until.

    `nondiff` lists input positions that never get a gradient (indices, shapes, axes, masks);
    `nondiff_outputs` the output positions gradients never flow back from (indices, masks);
    `nondiff_if(node, opset, is_computed)`, when given, says which of `nondiff` apply at a given node (a
    BatchNormalization's statistics are buffers, except when the graph computes them in inference mode).
    """

    def deco(fn: RuleFn) -> RuleFn:
        _add(Rule(op_type, fn, since, until, domain, frozenset(nondiff), frozenset(nondiff_outputs),
                  family=_family_of(fn), nondiff_if=nondiff_if))
        return fn

    return deco


def nondifferentiable(*op_types: str, since: int = 1, until: int = MAX_OPSET, family: str = "",
                      domain: str = "", zero_derivative: bool = False) -> None:
    """Declare ops whose outputs never carry a gradient to their inputs (Shape, Equal, ...); `zero_derivative`
    for those whose float outputs are differentiable with derivative zero (Floor, Round, Sign)."""
    for op in op_types:
        _add(Rule(op, None, since, until, domain, all_nondiff=True, family=family or "nondiff",
                  zero_derivative=zero_derivative))


@functools.lru_cache(maxsize=4096)
def lookup(op_type: str, opset: int, domain: str = "") -> Rule | None:
    """The rule for `op_type` at `opset` (cached: the table only changes while rules register, which clears it)."""
    for r in _RULES.get(("" if domain == "ai.onnx" else domain, op_type), ()):
        if r.since <= opset <= r.until:
            return r
    return None


def known_opsets(op_type: str, domain: str = "") -> list[str]:
    return [r.opset_range for r in _RULES.get((domain, op_type), ())]


def all_rules() -> list[Rule]:
    return sorted((r for rs in _RULES.values() for r in rs), key=lambda r: (r.domain, r.op_type, r.since))
