"""Conversions the legacy exporter lacks, written in the ONNX ops they are, registered while exporting.

torch's legacy exporter stops at `sinh`, `cosh`, their inverses, `exp2`, `erfc`, `logaddexp`, `xlogy`,
`addmv`, `addr`, `sgn`, `fmax`, `fmin`, `trunc`, `mH` (spectral norm's parametrization), `copy` (a buffer's
`copy_` whose result is used), `median` and interpolate's nearest-exact ("Exporting the operator ... is not
supported"), though ONNX and gradbuilder's rules have what they compute: each is one op (Sinh, Resize, ...) or a
few (median: a TopK of the smaller half).
`registered` also serves the other symbolics the export installs (`accumulation`, `stop_gradients`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.onnx._internal.torchscript_exporter import jit_utils, registration, symbolic_helper

OPSET = 9
"""The default-domain opset from which these conversions apply (every opset the legacy exporter writes)."""


@contextlib.contextmanager
def registered(symbolics: Mapping[str, Callable[..., Any]], opset: int) -> Iterator[None]:
    """`symbolics` (aten name -> conversion) override torch's from `opset` while the block lasts. Holds under
    the export lock (the symbolic registry is process-wide)."""
    for name, fn in symbolics.items():
        torch.onnx.register_custom_op_symbolic(name, fn, opset)
    try:
        yield
    finally:
        for name in symbolics:
            torch.onnx.unregister_custom_op_symbolic(name, opset)


def const_like(g: Any, value: float, like: Any) -> Any:
    """A scalar constant of `like`'s element type."""
    return g.op("CastLike", g.op("Constant", value_t=torch.tensor(value)), like)


def _scalar(value: Any, default: float = 1.0) -> float:
    got = symbolic_helper._maybe_get_scalar(value)
    return default if got is None else float(symbolic_helper._scalar(got))


def _unary(op: str) -> Callable[[Any, Any], Any]:
    return lambda g, x: g.op(op, x)


def _logaddexp(g: Any, a: Any, b: Any, base: float = 1.0) -> Any:
    """max(a, b) + log(1 + exp(-|a - b|)), in base e or 2 (`base` = ln 2)."""
    if base != 1.0:
        a, b = g.op("Mul", a, const_like(g, base, a)), g.op("Mul", b, const_like(g, base, b))
    gap = g.op("Neg", g.op("Abs", g.op("Sub", a, b)))
    out = g.op("Add", g.op("Max", a, b), g.op("Log", g.op("Add", const_like(g, 1.0, a), g.op("Exp", gap))))
    return out if base == 1.0 else g.op("Div", out, const_like(g, base, out))


def _xlogy(g: Any, x: Any, y: Any) -> Any:
    """x * log(y), 0 where x is 0 (unless y is NaN), as torch's."""
    zero = g.op("And", g.op("Equal", x, const_like(g, 0.0, x)), g.op("Not", g.op("IsNaN", y)))
    return g.op("Where", zero, const_like(g, 0.0, x), g.op("Mul", x, g.op("Log", y)))


def _added(g: Any, base: Any, product: Any, beta: Any, alpha: Any) -> Any:
    """beta * base + alpha * product; beta 0 ignores base (NaNs in it included), as torch's."""
    b, a = _scalar(beta), _scalar(alpha)
    scaled = product if a == 1.0 else g.op("Mul", product, const_like(g, a, product))
    if b == 0.0:
        return scaled
    return g.op("Add", base if b == 1.0 else g.op("Mul", base, const_like(g, b, base)), scaled)


def _addmv(g: Any, base: Any, mat: Any, vec: Any, beta: Any = None, alpha: Any = None) -> Any:
    return _added(g, base, g.op("MatMul", mat, vec), beta, alpha)


def _addr(g: Any, base: Any, u: Any, v: Any, beta: Any = None, alpha: Any = None) -> Any:
    outer = g.op("Mul", symbolic_helper._unsqueeze_helper(g, u, [1]), symbolic_helper._unsqueeze_helper(g, v, [0]))
    return _added(g, base, outer, beta, alpha)


def _nan_ignoring(op: str) -> Callable[[Any, Any, Any], Any]:
    """fmax / fmin: the other operand where one is NaN."""
    def convert(g: Any, a: Any, b: Any) -> Any:
        picked = g.op(op, a, b)
        return g.op("Where", g.op("IsNaN", a), b, g.op("Where", g.op("IsNaN", b), a, picked))
    return convert


def _copy(g: Any, self: Any, src: Any, non_blocking: Any = None) -> Any:
    """`self.copy_(src)` as the tracer records it (a buffer's new value the forward writes in place and the export
    carries back): src in self's type, broadcast to its shape."""
    return g.op("Expand", g.op("CastLike", src, self), g.op("Shape", self))


def _matrix_h(g: Any, x: Any) -> Any:
    """`x.mH` of a real tensor (spectral norm's parametrization): its last two axes swapped."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None or rank < 2:
        return symbolic_helper._unimplemented("matrix_H", "a tensor of unknown rank or below 2", x)
    return g.op("Transpose", x, perm_i=[*range(rank - 2), rank - 1, rank - 2])


@dataclasses.dataclass
class _Overriding(jit_utils.GraphContext):
    """A graph context whose nodes of one op get attributes of ours: torch's own symbolic, run through it, writes
    that op as we want it (`with_attributes`)."""

    override_op: str = ""
    override_attrs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def op(self, opname: str, *raw_args: Any, outputs: int = 1, **kwargs: Any) -> Any:
        if opname == self.override_op:
            kwargs.update(self.override_attrs)
        return super().op(opname, *raw_args, outputs=outputs, **kwargs)


def with_attributes(g: Any, op: str, **attrs: Any) -> Any:
    """`g` writing every `op` node with `attrs` (in the exporter's `name_s` / `name_i` form)."""
    return _Overriding(**{f.name: getattr(g, f.name) for f in dataclasses.fields(g)}, override_op=op,
                       override_attrs=attrs)


def _nearest_exact(dims: int) -> Callable[..., Any]:
    """torch's `nearest` conversion, its Resize sampling as nearest-exact's floor((i + 1/2) / scale): exactly
    Resize's round_prefer_ceil of half_pixel coordinates, (i + 1/2) / scale - 1/2 rounded half up."""
    def convert(g: Any, *args: Any) -> Any:
        nearest = registration.registry.get_function_group(f"aten::upsample_nearest{dims}d").get(g.opset)
        exact = with_attributes(g, "Resize", coordinate_transformation_mode_s="half_pixel",
                                nearest_mode_s="round_prefer_ceil")
        return nearest(exact, *args)
    return convert


def _median_dim(g: Any, x: Any, dim: Any, keepdim: Any = None) -> tuple[Any, Any]:
    """torch.median along dim: the lower median, the ((n - 1) // 2)-th smallest, and its index, by a TopK of the
    k = (n - 1) // 2 + 1 smallest (n read at run time) and its last entry."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented("median", "a tensor of unknown rank", x)
    axis = symbolic_helper._get_const(dim, "i", "dim") % max(rank, 1)
    keep = bool(symbolic_helper._get_const(keepdim, "i", "keepdim")) if keepdim is not None else False
    one = g.op("Constant", value_t=torch.tensor([1]))
    n = g.op("Gather", g.op("Shape", x), g.op("Constant", value_t=torch.tensor([axis])))
    k = g.op("Add", g.op("Div", g.op("Sub", n, one), g.op("Constant", value_t=torch.tensor([2]))), one)
    values, indices = g.op("TopK", x, k, axis_i=axis, largest_i=0, sorted_i=1, outputs=2)
    last = g.op("Sub", k, one)
    picked = [g.op("Gather", t, last, axis_i=axis) for t in (values, indices)]
    if not keep:
        picked = [symbolic_helper._squeeze_helper(g, t, [axis]) for t in picked]
    return picked[0], picked[1]


def _median(g: Any, x: Any) -> Any:
    """torch.median of every element: the lower median of the flattened tensor."""
    flat = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1])))
    return _median_dim(g, flat, g.op("Constant", value_t=torch.tensor(0)), None)[0]


def _trunc(g: Any, x: Any) -> Any:
    return g.op("Mul", g.op("Sign", x), g.op("Floor", g.op("Abs", x)))


MISSING: dict[str, Callable[..., Any]] = {
    **{f"aten::{name}": _unary(op) for name, op in [
        ("sinh", "Sinh"), ("cosh", "Cosh"), ("asinh", "Asinh"), ("acosh", "Acosh"), ("atanh", "Atanh"),
        ("sgn", "Sign")]},
    "aten::exp2": lambda g, x: g.op("Pow", const_like(g, 2.0, x), x),
    "aten::erfc": lambda g, x: g.op("Sub", const_like(g, 1.0, x), g.op("Erf", x)),
    "aten::special_erfc": lambda g, x: g.op("Sub", const_like(g, 1.0, x), g.op("Erf", x)),
    "aten::logaddexp": _logaddexp,
    "aten::logaddexp2": lambda g, a, b: _logaddexp(g, a, b, math.log(2.0)),
    "aten::xlogy": _xlogy, "aten::special_xlogy": _xlogy,
    "aten::addmv": _addmv, "aten::addr": _addr,
    "aten::fmax": _nan_ignoring("Max"), "aten::fmin": _nan_ignoring("Min"),
    "aten::trunc": _trunc, "aten::fix": _trunc, "aten::copy": _copy, "aten::matrix_H": _matrix_h,
    **{f"aten::_upsample_nearest_exact{d}d": _nearest_exact(d) for d in (1, 2, 3)},
    "aten::median": lambda g, x, *args: _median(g, x) if not args else _median_dim(g, x, *args),
}


def exported_symbolics() -> contextlib.AbstractContextManager[None]:
    """`MISSING` registered while the block lasts."""
    return registered(MISSING, OPSET)
