"""Conversions the legacy exporter lacks, written in the ONNX ops they are, registered while exporting.

torch's legacy exporter stops at `sinh`, `cosh`, their inverses, `exp2`, `erfc`, `logaddexp`, `xlogy`,
`addmv`, `addr`, `addbmm`, `sgn`, `fmax`, `fmin`, `trunc`, `frac`, `mH` (spectral norm's parametrization), `copy` (a
buffer's `copy_` whose result is used), `median`, `cumprod`, `cummax`, `cummin`, `logcumsumexp` and interpolate's
nearest-exact ("Exporting the operator ... is not supported"), though ONNX and gradbuilder's rules have what they
compute: each is one op (Sinh, Resize, ...) or a few (median: a TopK of the smaller half; the running ones: a
reduction over a triangle). torch's own `tensor_split` writes a tensor sequence (no gradient rule) or a Split failing
at run time: ours slices. Some of torch's own compute something else than torch, and ours replace them:
`floor_divide` truncates, `index` with two or more index tensors reads negative ones wrongly, and `max` / `min` along
a dim split the gradient of a tie (torch gives it to the index returned) and drop NaNs; `var` / `std` over every
axis compute in float32 (a float64 module's came back float32) and drop keepdim's axes; `log2`, `log10`,
`addcmul`, `elu`, `selu`, `celu`, `leaky_relu`, eval's `rrelu`, `round` to decimals and `addmm`'s beta and alpha
use float32 constants (1e-8 off in float64; `layer_norm`'s eps, LayerNormalization's float32 attribute, is made
torch's by scaling its input, `functions._layer_norm`); `amax`, `amin`, `aminmax` and `max` / `min` of every
element drop a NaN that does not come first (onnxruntime's ReduceMax), `argmax` / `argmin` skip NaNs; `movedim` writes a
negative source dim into perm, and `permute` its negative dims; `embedding` ignores padding_idx (`F.embedding` of a
weight no nn.Embedding owns); `full` without a dtype writes float32 where torch's takes the fill value's kind
(`torch.full((n,), 7)` is int64);
`roll` slices at -shift unwrapped (wrong for |shift| >= size) and fails without dims; `chunk` writes too many chunks
where torch gives fewer (6 into 4); `unique` flattens its inverse; div's floor mode floors a / b; `scatter_reduce`
wraps its scatter in Ifs whose branches declare wrong sizes (the gradient build failed after it), and
`repeat_interleave` by a tensor of repeats is a Loop (no gradient): ours are one ScatterElements and a Gather; by a
count, torch's adds the rank to a negative axis in the constant the trace shares with the graph's other uses of it.
`batch_norm` without running statistics refused a batch sized at run time: ours normalizes by the batch's.
Ties as torch's backward breaks them: `fmax` / `fmin` give a tie's gradient to the first operand, `median` of every
element splits it evenly, `clamp` with tensor bounds gives it to x (torch's Max / Min split it with the bound).
`const_like` writes float constants in float64. `bernoulli_(p)`, `normal_(mean, std)` and `uniform_(a, b)` (torch has
no conversion of the last, and its `normal` wrote a float32 tensor's noise in float64) are `torch_draws`' markers.
`registered` also serves the other symbolics the export installs (`accumulation`, `stop_gradients`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.onnx._internal.torchscript_exporter import (
    _type_utils,
    jit_utils,
    registration,
    symbolic_helper,
    symbolic_opset9,
    symbolic_opset10,
    symbolic_opset11,
    symbolic_opset12,
    symbolic_opset13,
    symbolic_opset14,
    symbolic_opset15,
    symbolic_opset16,
    symbolic_opset18,
)

from gradbuilder.rules.linalg import MICROSOFT
from gradbuilder.stop_gradient import OP_TYPE as STOP_GRADIENT
from gradbuilder.stop_gradient import ZERO_GRADIENT
from gradbuilder.yield_op import DOMAIN

from . import torch_draws
from .batchnorm import eps_scale

OPSET = 9
"""The default-domain opset from which these conversions apply (every opset the legacy exporter writes)."""

TORCH_OWN: dict[str, int | tuple[int, ...]] = {
    "aten::tensor_split": 13, "aten::cumsum": 11, "aten::index": 11, "aten::max": 18, "aten::min": 18,
    "aten::var_mean": 18, "aten::celu": 12, "aten::chunk": 11, "aten::_unique2": 11, "aten::div": 10, "aten::clamp":
    11, "aten::clamp_min": 11, "aten::clamp_max": 11, "aten::scatter_reduce": 16, "aten::repeat_interleave": 13,
    "aten::amax": 18, "aten::amin": 18, "aten::round": 11, "aten::argmax": 12, "aten::argmin": 12, "aten::aminmax":
    18, "aten::split": (11, 13), "aten::fake_quantize_per_tensor_affine": (10, 13),
    "aten::fake_quantize_per_channel_affine": 13, "aten::batch_norm": 14, "aten::bernoulli": 15, "aten::normal": 11,
    "aten::rand": 9, "aten::randn": 9, "aten::rand_like": 9, "aten::randn_like": 9}
"""The opsets of torch's own conversions of a name in `MISSING`: ours is registered from there too, or torch's would
win (the registry picks the latest opset at or below the export's)."""

_END = torch.iinfo(torch.int64).max
"""A Slice end past any size: Slice clamps it to the size, as Python's slicing does."""


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
    """A scalar constant of `like`'s element type, cast to it from float64 (a Python float; `torch.tensor` of it
    is float32: log 2 so rounded was 3e-9 off in a float64 log2) or from the number's own type. A Cast where the
    export knows that type: the exporter's scalar-type pass reads a 0-d Constant as a Python number, float32
    wherever all of an op's operands are 0-d, and a 0-d operand of unknown type (a CastLike's) so too."""
    constant = g.op("Constant", value_t=torch.tensor(value, dtype=torch.float64) if isinstance(value, float)
                    else torch.tensor(value))
    return cast_like(g, constant, like)


def cast_like(g: Any, x: Any, like: Any) -> Any:
    """x in `like`'s element type: a Cast where the export knows it (see `const_like`), else a CastLike."""
    scalar_type = _type_utils.JitScalarType.from_value(like, _type_utils.JitScalarType.UNDEFINED)
    if scalar_type == _type_utils.JitScalarType.UNDEFINED:
        return g.op("CastLike", x, like)
    return g.op("Cast", x, to_i=scalar_type.onnx_type())


def _as_traced(g: Any, value: Any) -> Any:
    """value of the element type of the traced node's (first) output: the exporter's scalar-type pass casts the
    operands of a 0-d Div or Where whose type it does not know to float32 (a float64 var or median came back
    float32). Its sizes stay the converted ones (the traced are the export call's, not symbols)."""
    dtype = g.original_node.outputsAt(0).type().dtype()
    if dtype is not None and isinstance(value.type(), torch._C.TensorType):
        value.setType(value.type().with_dtype(dtype))
    return value


def _scalar(value: Any, default: float = 1.0) -> float:
    got = symbolic_helper._maybe_get_scalar(value)
    return default if got is None else float(symbolic_helper._scalar(got))


def _unary(op: str) -> Callable[[Any, Any], Any]:
    return lambda g, x: g.op(op, x)


def _logaddexp(g: Any, a: Any, b: Any, base: float = 1.0) -> Any:
    """max(a, b) + log(1 + exp(-|a - b|)), in base e or 2 (`base` = ln 2); a where a and b are the same infinity,
    as torch's (-inf for two -infs, the log of two zero probabilities: a - b there is NaN). The gradient there is
    NaN, as torch's (1 / (1 + exp(b - a))): a `where` masking those inputs keeps it out of a parameter's."""
    if base != 1.0:
        a, b = g.op("Mul", a, const_like(g, base, a)), g.op("Mul", b, const_like(g, base, b))
    gap = g.op("Neg", g.op("Abs", g.op("Sub", a, b)))
    out = g.op("Add", g.op("Max", a, b), g.op("Log", g.op("Add", const_like(g, 1.0, a), g.op("Exp", gap))))
    out = g.op("Where", g.op("And", g.op("IsInf", a), g.op("Equal", a, b)), a, out)
    return out if base == 1.0 else g.op("Div", out, const_like(g, base, out))


def _common_type(g: Any, a: Any, b: Any) -> tuple[Any, Any, bool]:
    """a and b in the type torch computes their binary op in, the traced result's (a's floating type, or a's, where
    the trace does not say), and whether it is floating."""
    result = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.UNDEFINED)
    if result == _type_utils.JitScalarType.UNDEFINED:
        result = _type_utils.JitScalarType.from_value(
            b if symbolic_helper._is_fp(b) and not symbolic_helper._is_fp(a) else a, _type_utils.JitScalarType.FLOAT)
    a, b = (v if _type_utils.JitScalarType.from_value(v, _type_utils.JitScalarType.UNDEFINED) == result
            else g.op("Cast", v, to_i=result.onnx_type()) for v in (a, b))
    return a, b, result.dtype().is_floating_point


def _floor_divide(g: Any, a: Any, b: Any) -> Any:
    """torch.floor_divide (`//`) rounding down, as torch's since 1.13 (torch's conversion truncates, its old
    behaviour). Integers: the truncated quotient less one where the signs differ and the division is not exact, as
    torch's integer kernel (exact, no float round trip; the one subtracted as a cast flag: onnxruntime has no int16
    Where). Floats: `_floor_quotient`. No gradient in torch."""
    a, b, floating = _common_type(g, a, b)
    if floating:
        return _floor_quotient(g, a, b)
    zero = const_like(g, 0, a)
    inexact = g.op("Not", g.op("Equal", g.op("Mod", a, b, fmod_i=1), zero))
    opposite = g.op("Xor", g.op("Less", a, zero), g.op("Less", b, zero))
    return g.op("Sub", g.op("Div", a, b), cast_like(g, g.op("And", inexact, opposite), a))


def _floor_quotient(g: Any, a: Any, b: Any) -> Any:
    """torch's floating floor division (c10::div_floor_floating), not floor(a / b), which differs where a / b rounds
    up to an integer (1 // 0.1: torch and Python 9, floor(a / b) 10): d = (a - fmod(a, b)) / b, less one where the
    remainder's sign is not b's, floored and rounded to the nearest integer; a zero with a / b's sign; a / b where b
    is 0. The signed zero comes through Where's second branch (onnxruntime's Where gives +0 for a -0 it picks from
    its first), under a condition without Not (which onnxruntime fuses into Where by swapping its branches)."""
    zero, one = const_like(g, 0.0, a), const_like(g, 1.0, a)
    remainder = g.op("Mod", a, b, fmod_i=1)
    d = g.op("Div", g.op("Sub", a, remainder), b)
    down = g.op("And", g.op("Not", g.op("Equal", remainder, zero)),
                g.op("Xor", g.op("Less", b, zero), g.op("Less", remainder, zero)))
    d = g.op("Where", down, g.op("Sub", d, one), d)
    floor = g.op("Floor", d)
    floor = g.op("Where", g.op("Greater", g.op("Sub", d, floor), const_like(g, 0.5, a)), g.op("Add", floor, one), floor)
    ratio = g.op("Div", a, b)
    nonzero = g.op("Greater", g.op("Abs", d), zero)
    floor = g.op("Where", nonzero, floor, g.op("Mul", ratio, zero))  # copysign(0, a / b) where d is 0
    return g.op("Where", g.op("Equal", b, zero), ratio, floor)


def _index(g: Any, x: Any, index: Any) -> Any:
    """x[i, j, ...] with two or more index tensors: torch's conversion, its indices wrapped first (`_wrapped`), as it
    combines them into one flat index, i * stride + j, where a negative one picks another element or none (a
    Gather out of bounds). A single index (a Gather, which wraps negatives itself) goes to torch's as it is, and so
    do masks (torch's turns them into the non-negative positions of their true entries)."""
    own = symbolic_opset11.index if g.opset >= 11 else symbolic_opset9.index
    indices = symbolic_helper._unpack_list(index) if symbolic_helper._is_packed_list(index) else [index]
    if sum(not symbolic_helper._is_none(i) for i in indices) < 2:
        return own(g, x, index)
    wrapped = [i if symbolic_helper._is_none(i) or _is_mask(i) else _wrapped(g, x, k, i) for k, i in enumerate(indices)]
    return own(g, x, g.op("prim::ListConstruct", *wrapped))


def _is_mask(index: Any) -> bool:
    """Whether an index is a boolean (or uint8, torch's old) mask."""
    scalar_type = _type_utils.JitScalarType.from_value(index, _type_utils.JitScalarType.UNDEFINED)
    return scalar_type in (_type_utils.JitScalarType.BOOL, _type_utils.JitScalarType.UINT8)


def _wrapped(g: Any, x: Any, axis: int, index: Any) -> Any:
    """index into x's axis, its negative entries plus the axis's size (a constant where known at export, read from
    Shape at run time if not)."""
    known = symbolic_helper._get_tensor_dim_size(x, axis)
    n = _run_time_size(g, x, axis, vector=False) if known is None else g.op("Constant", value_t=torch.tensor(known))
    n = cast_like(g, n, index)
    return g.op("Where", g.op("Less", index, const_like(g, 0, index)), g.op("Add", index, n), index)


def _run_time_size(g: Any, x: Any, axis: int, vector: bool = True) -> Any:
    """The size of x's axis read from Shape at run time, as a [1] tensor (or 0-d), where the export does not know it."""
    return g.op("Gather", g.op("Shape", x), g.op("Constant", value_t=torch.tensor([axis] if vector else axis)))


def _xlogy(g: Any, x: Any, y: Any) -> Any:
    """x * log(y), 0 where x is 0 (unless y is NaN), as torch's; and its gradients: x's is log(y) at x = 0 too
    (a Where around the product cut it there), 0 where also y <= 0 (torch's mask) or y = inf (torch's inf: left)."""
    dead = g.op("Or", g.op("LessOrEqual", y, const_like(g, 0.0, y)), g.op("IsInf", y, detect_negative_i=0))
    masked = g.op("And", g.op("Equal", x, const_like(g, 0.0, x)), dead)
    return g.op("Mul", x, g.op("Where", masked, const_like(g, 0.0, y), g.op("Log", y)))


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
    """fmax / fmin: the other operand where one is NaN, a where both are; a tie's whole gradient to a, as torch's
    (a Where, not Max / Min, whose rule splits it)."""
    def convert(g: Any, a: Any, b: Any) -> Any:
        picked = g.op("Where", g.op(op, b, a), b, a)  # b only where strictly better
        return g.op("Where", g.op("IsNaN", b), a, g.op("Where", g.op("IsNaN", a), b, picked))
    return convert


def _clamp(name: str) -> Callable[..., Any]:
    """torch.clamp (clip; `name` also clamp_min, clamp_max) with a tensor bound: the value x, the bound or NaN as
    torch's, and the gradient where torch's backward puts it (torch's conversion writes Max / Min, whose rules split
    a tie's): x's where min <= x <= max, min's where x < min < max, max's where x > max or max < min (none where x <
    min == max: the value then min through a StopGradient), by Wheres on those comparisons. NaN in any of them
    (torch's value then NaN, the gradient still by the comparisons): a term added to the value picked, NaN there
    and -0 elsewhere (x + -0 is x, -0 too), without a gradient. Constant bounds, and integers: torch's (a Clip,
    whose rule passes the gradient at the bounds, as clamp's), integers clamped by floats in the float type torch
    gives (torch's Clip of the integers cast its bounds to them: clamp(-2.5, 3.5) of -4 was -2, torch's -2.5)."""
    def convert(g: Any, x: Any, *bounds: Any) -> Any:
        if not _floating(x):
            x = _in_traced_type(g, x)
        if all(_none(b) or symbolic_helper._is_constant(b) for b in bounds) or not _floating(x):
            return getattr(symbolic_opset11 if g.opset >= 11 else symbolic_opset9, name)(g, x, *bounds)

        def where(c: Any, a: Any, b: Any) -> Any:  # typed: a 0-d Where of no known type is computed in float32
            return _as_traced(g, g.op("Where", c, a, b))

        low, high = (bounds[0], None) if name == "clamp_min" else (None, bounds[0]) if name == "clamp_max" else bounds
        x, low, high = (None if _none(v) else _in_traced_type(g, v) for v in (x, low, high))
        nan = g.op("IsNaN", x)
        for b in (low, high):
            nan = nan if b is None else g.op("Or", nan, g.op("IsNaN", b))
        if high is None:
            picked = where(g.op("GreaterOrEqual", x, low), x,
                           where(g.op("Less", x, low), low, const_like(g, 0.0, x)))
        elif low is None:
            picked = where(g.op("LessOrEqual", x, high), x,
                           where(g.op("Greater", x, high), high, const_like(g, 0.0, x)))
        else:
            inside = g.op("And", g.op("GreaterOrEqual", x, low), g.op("LessOrEqual", x, high))
            above = g.op("Or", g.op("Greater", x, high), g.op("Less", high, low))
            below = g.op("And", g.op("Less", x, low), g.op("Less", low, high))
            tied = g.op(f"{DOMAIN}::{STOP_GRADIENT}", low)
            tied.setType(low.type())
            picked = where(inside, x, where(above, high, where(below, low, tied)))
        poison = where(nan, const_like(g, math.nan, x), const_like(g, -0.0, x))
        return _as_traced(g, g.op("Add", picked, poison))
    return convert


def _fake_quantize(per_channel: bool) -> Callable[..., Any]:
    """fake_quantize_per_tensor_affine / per_channel (FakeQuantize, quantization-aware training): torch's values
    (QuantizeLinear then DequantizeLinear, torch's own conversion) with torch's straight-through gradient, dY where
    round(x / scale) + zero_point lies in [quant_min, quant_max], 0 elsewhere: `y + (x - StopGradient(x)) * inside`,
    exactly y. The integer between the two cut every gradient (the first-gradient check refused the module, or with
    check_export=False the layers before it got none)."""
    own = symbolic_opset13.fake_quantize_per_channel_affine if per_channel else \
        symbolic_opset13.fake_quantize_per_tensor_affine

    def convert(g: Any, x: Any, scale: Any, zero_point: Any, *args: Any) -> Any:
        y = own(g, x, scale, zero_point, *args)
        low, high = (symbolic_helper._get_const(v, "i", name) for v, name in zip(args[-2:], ("quant_min", "quant_max")))
        step, offset = cast_like(g, scale, x), cast_like(g, zero_point, x)
        if per_channel:  # [C] along `axis` of x
            axis, rank = symbolic_helper._get_const(args[0], "i", "axis"), symbolic_helper._get_tensor_rank(x)
            if rank is None:
                return symbolic_helper._unimplemented("fake_quantize_per_channel_affine", "an input of unknown rank", x)
            along = g.op("Constant", value_t=torch.tensor([-1 if k == axis % rank else 1 for k in range(rank)]))
            step, offset = g.op("Reshape", step, along), g.op("Reshape", offset, along)
        level = g.op("Add", g.op("Round", g.op("Mul", x, g.op("Reciprocal", step))), offset)
        inside = g.op("And", g.op("GreaterOrEqual", level, const_like(g, float(low), x)),
                      g.op("LessOrEqual", level, const_like(g, float(high), x)))
        held = g.op(f"{DOMAIN}::{STOP_GRADIENT}", x)
        held.setType(x.type())
        through = g.op("Mul", g.op("Sub", x, held), cast_like(g, inside, x))
        return _as_traced(g, g.op("Add", y, through))
    return convert


def _scatter_reduce(g: Any, x: Any, dim: Any, index: Any, src: Any, reduce: Any, include_self: Any) -> Any:
    """Tensor.scatter_reduce by sum, prod, amax or amin including self, of x of known rank > 0: one ScatterElements
    of that reduction, as torch's conversion computes it without its two Ifs on x being 0-d, whose branches declare
    sizes that are not the tensors' (a [3, 3] one's Identity declared [9]: gradbuilder's shape inference failed at
    the next node). A 0-d or unknown-rank x, mean, and include_self=False: torch's (which refuses the last two;
    ORTModule computes those from scatter_add and include_self=True while tracing: runtime/functions.py)."""
    rank = symbolic_helper._get_tensor_rank(x)
    how = symbolic_helper._get_const(reduce, "s", "reduce")
    own = symbolic_opset16.scatter_reduce if g.opset >= 16 else None
    if own is None:
        return symbolic_helper._unimplemented("scatter_reduce", "opset below 16", x)
    if not rank or how not in _SCATTER_REDUCTIONS or not symbolic_helper._get_const(include_self, "b", "include_self"):
        return own(g, x, dim, index, src, reduce, include_self)
    return g.op("ScatterElements", x, index, src, axis_i=symbolic_helper._get_const(dim, "i", "dim"),
                reduction_s=_SCATTER_REDUCTIONS[how])


_SCATTER_REDUCTIONS = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}
"""torch's reductions and ScatterElements' (torch's conversion writes max and min from opset 16 too)."""


def _repeat_interleave(g: Any, x: Any, repeats: Any = None, dim: Any = None, output_size: Any = None) -> Any:
    """x.repeat_interleave(repeats, dim) with a 1-D tensor of repeats: x gathered along dim (every axis flattened
    where None) at each output position's source position, the number of cumulative repeats (CumSum) at or below
    it, counted over [total, n] (O(total n) memory); gradbuilder's Gather rule sums the copies' gradients back, as
    torch's backward. torch's conversion writes a Loop (no gradient: the gradient build failed) where the repeats
    or the axis's size are known at run time only (every export's here). A repeat count (an int, a 0-d tensor),
    and torch.repeat_interleave(repeats): torch's, given an axis constant of its own: torch's adds the rank to a
    negative axis in place, in the constant node's tensor, which the tracer shares with every other -1 of the graph
    (`torch.stack([-x2, x1], dim=-1)` after Cohere's `repeat_interleave(freqs, 2, dim=-1)` stacked on axis 2)."""
    own = symbolic_opset13.repeat_interleave if g.opset >= 13 else symbolic_opset9.repeat_interleave
    if g.original_node.inputsSize() != 4 or symbolic_helper._get_tensor_rank(repeats) != 1 or g.opset < 11:
        if not _none(dim):
            dim = g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim")))
        return own(g, x, repeats, dim, output_size)
    if _none(dim):
        x, axis = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1]))), 0
    else:
        got = _rank_and_axis(g, x, dim, "repeat_interleave")
        if got is None:
            return None
        axis = got[1]
    n = _run_time_size(g, x, axis)
    int64 = _type_utils.JitScalarType.INT64.onnx_type()
    counts = g.op("Expand", g.op("Cast", repeats, to_i=int64), n)  # one count for every position, as torch's
    ends = g.op("CumSum", counts, g.op("Constant", value_t=torch.tensor(0)))
    total = _reduced(g, "ReduceSum", counts, [0], False)
    zero, one = g.op("Constant", value_t=torch.tensor(0)), g.op("Constant", value_t=torch.tensor(1))
    passed = g.op("GreaterOrEqual", symbolic_helper._unsqueeze_helper(g, g.op("Range", zero, total, one), [1]),
                  symbolic_helper._unsqueeze_helper(g, ends, [0]))
    source = _reduced(g, "ReduceSum", g.op("Cast", passed, to_i=int64), [1], False)
    return g.op("Gather", x, source, axis_i=axis)


def _in_traced_type(g: Any, v: Any) -> Any:
    """v in the element type of the traced node's output: as it is where it has it, else cast."""
    result = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.UNDEFINED)
    if result == _type_utils.JitScalarType.UNDEFINED or \
            _type_utils.JitScalarType.from_value(v, _type_utils.JitScalarType.UNDEFINED) == result:
        return v
    return g.op("Cast", v, to_i=result.onnx_type())


def _copy(g: Any, self: Any, src: Any, non_blocking: Any = None) -> Any:
    """`self.copy_(src)` as the tracer records it (a buffer's new value the forward writes in place and the export
    carries back): src in self's type, broadcast to its shape."""
    return g.op("Expand", cast_like(g, src, self), g.op("Shape", self))


def _full(g: Any, sizes: Any, value: Any, dtype: Any, *rest: Any) -> Any:
    """`torch.full` without a dtype, whose tensor takes the fill value's kind (int64 for an int): torch's conversion
    writes float32 unless the sizes and the value are both constants (`torch.full((n,), 7)` and `torch.full((2,),
    x.shape[0])` came back float32). The traced node's type is torch's."""
    traced = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.UNDEFINED)
    if symbolic_helper._is_none(dtype) and traced != _type_utils.JitScalarType.UNDEFINED:
        dtype = g.op("Constant", value_t=torch.tensor(int(traced)))
    return symbolic_opset9.full(g, sizes, value, dtype, *rest)


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
    got = _rank_and_axis(g, x, dim, "median")
    if got is None:
        return None, None
    axis = got[1]
    keep = bool(symbolic_helper._get_const(keepdim, "i", "keepdim")) if keepdim is not None else False
    one = g.op("Constant", value_t=torch.tensor([1]))
    n = _run_time_size(g, x, axis)
    k = g.op("Add", g.op("Div", g.op("Sub", n, one), g.op("Constant", value_t=torch.tensor([2]))), one)
    values, indices = g.op("TopK", x, k, axis_i=axis, largest_i=0, sorted_i=1, outputs=2)
    last = g.op("Sub", k, one)
    picked = [g.op("Gather", t, last, axis_i=axis) for t in (values, indices)]
    if not keep:
        picked = [symbolic_helper._squeeze_helper(g, t, [axis]) for t in picked]
    return picked[0], picked[1]


def _median(g: Any, x: Any) -> Any:
    """torch.median of every element: the lower median of the flattened tensor, as the ReduceMax of the elements
    equal to it (-inf elsewhere), whose rule splits the gradient evenly among them, as torch's backward does here
    (along a dim it gives it to the index returned). A NaN median (TopK's) stays."""
    flat = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1])))
    median = _median_dim(g, flat, g.op("Constant", value_t=torch.tensor(0)), None)[0]
    if not _floating(x):
        return median
    tied = g.op("Where", g.op("Equal", flat, median), flat, const_like(g, -math.inf, flat))
    out = g.op("Where", g.op("IsNaN", median), median, _reduced(g, "ReduceMax", tied, None, False))  # NaN: as is
    return _as_traced(g, out)


def _trunc(g: Any, x: Any) -> Any:
    return g.op("Mul", g.op("Sign", x), g.op("Floor", g.op("Abs", x)))


def _rank_and_axis(g: Any, x: Any, dim: Any, op: str) -> tuple[int, int] | None:
    """x's rank and `dim` made non-negative; None (the export stops) for an unknown rank."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented(op, "a tensor of unknown rank", x)
    return rank, symbolic_helper._get_const(dim, "i", "dim") % max(rank, 1)


def _slices(g: Any, x: Any, axis: int, bounds: list[Any]) -> Any:
    """x[bounds[k]:bounds[k + 1]] along axis for each k (1-D int64 bounds), as the list the exporter unpacks."""
    axes = g.op("Constant", value_t=torch.tensor([axis]))
    chunks = [g.op("Slice", x, start, end, axes) for start, end in itertools.pairwise(bounds)]
    return g.op("prim::ListConstruct", *chunks)


def _section_bounds(g: Any, x: Any, axis: int, sections: int) -> list[Any]:
    """Where the sections of torch.tensor_split start: the first n % s of size n // s + 1, the rest n // s, so
    bound k is k * (n // s) + min(k, n % s); constants where n is known at export, computed from Shape if not."""
    n = symbolic_helper._get_tensor_dim_size(x, axis)
    if n is not None:
        q, r = divmod(n, sections)
        return [g.op("Constant", value_t=torch.tensor([k * q + min(k, r)])) for k in range(sections + 1)]
    size = _run_time_size(g, x, axis)
    s = g.op("Constant", value_t=torch.tensor([sections]))
    q, r = g.op("Div", size, s), g.op("Mod", size, s)
    ks = [g.op("Constant", value_t=torch.tensor([k])) for k in range(1, sections)]
    inner = [g.op("Add", g.op("Mul", q, k), g.op("Min", r, k)) for k in ks]
    return [g.op("Constant", value_t=torch.tensor([0])), *inner, g.op("Constant", value_t=torch.tensor([_END]))]


def _tensor_split(g: Any, x: Any, indices_or_sections: Any, dim: Any, _outputs: Any = None) -> Any:
    """torch.tensor_split as Slices, which gradbuilder differentiates. Indices idx (a 1-D constant): chunk k is
    x[idx[k-1]:idx[k]], Slice clamping negative, past-the-end and decreasing bounds as Python's slicing does;
    sections (a 0-D constant): `_section_bounds`. Either computed at run time: torch's own (a tensor sequence)."""
    got = _rank_and_axis(g, x, dim, "tensor_split")
    if symbolic_helper._is_packed_list(indices_or_sections) and got is not None:  # indices read from sizes (Hugging
        # Face's Mamba; torch's own took them for a count of sections: a Tile by a rank-2 count, refused)
        items = symbolic_helper._unpack_list(indices_or_sections)
        bounds = [symbolic_helper._unsqueeze_helper(g, i, [0]) for i in items]
        return _slices(g, x, got[1], [g.op("Constant", value_t=torch.tensor([0])), *bounds,
                                      g.op("Constant", value_t=torch.tensor([_END]))])
    value = symbolic_helper._maybe_get_const(indices_or_sections, "t")
    if not isinstance(value, torch.Tensor):
        return symbolic_opset13.tensor_split(g, x, indices_or_sections, dim, _outputs)
    if got is None:
        return None
    axis = got[1]
    if value.dim() == 0:
        return _slices(g, x, axis, _section_bounds(g, x, axis, int(value)))
    bounds = [0, *value.tolist(), _END]
    return _slices(g, x, axis, [g.op("Constant", value_t=torch.tensor([b])) for b in bounds])


def _triangle(g: Any, x: Any, axis: int, rank: int) -> tuple[Any, Any]:
    """A running reduction along axis (length n) as a reduction over a triangle, O(n^2) in memory: with x
    unsqueezed at axis (output position i there, input position j after it), `below` (j <= i, [n, n, 1...]) and the
    positions j ([n, 1...]) broadcast against it. Constants where n is known at export, from Range if not."""
    ones = [1] * (rank - axis - 1)
    n = symbolic_helper._get_tensor_dim_size(x, axis)
    if n is not None:
        below = torch.ones(n, n, dtype=torch.bool).tril().reshape(n, n, *ones)
        return g.op("Constant", value_t=below), g.op("Constant", value_t=torch.arange(n).reshape(n, *ones))
    size = _run_time_size(g, x, axis, vector=False)
    j = g.op("Range", g.op("Constant", value_t=torch.tensor(0)), size, g.op("Constant", value_t=torch.tensor(1)))
    unsqueeze = symbolic_helper._unsqueeze_helper
    below = g.op("LessOrEqual", unsqueeze(g, j, [0]), unsqueeze(g, j, [1]))
    trailing = range(len(ones))
    return unsqueeze(g, below, [2 + k for k in trailing]), unsqueeze(g, j, [1 + k for k in trailing])


def _reduce(g: Any, op: str, x: Any, axis: int) -> Any:
    """`op` over axis, dropped."""
    return _reduced(g, op, x, [axis], False)


def _reduced(g: Any, op: str, x: Any, axes: list[int] | None, keep: bool) -> Any:
    """`op` over `axes` (every axis for None), kept as sizes 1 where `keep`; the axes an attribute or an input
    (from opset 18, ReduceSum's from 13)."""
    if axes is None:
        return g.op(op, x, keepdims_i=int(keep))
    if g.opset >= (13 if op == "ReduceSum" else 18):
        return g.op(op, x, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.int64)), keepdims_i=int(keep))
    return g.op(op, x, axes_i=axes, keepdims_i=int(keep))


def _floating(x: Any) -> bool:
    """Whether x is of a floating type, or of one the export does not know (most likely floating)."""
    scalar_type = _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.UNDEFINED)
    return scalar_type == _type_utils.JitScalarType.UNDEFINED or scalar_type.dtype().is_floating_point


def _accumulated(g: Any, x: Any, dtype: Any) -> Any:
    """x in the type torch's running sums and products give: `dtype` where given, int64 for integers and booleans."""
    if not symbolic_helper._is_none(dtype):
        to = _type_utils.JitScalarType(symbolic_helper._get_const(dtype, "i", "dtype"))
        return g.op("Cast", x, to_i=to.onnx_type())
    if not _floating(x):
        return g.op("Cast", x, to_i=_type_utils.JitScalarType.INT64.onnx_type())
    return x


def _cumprod(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
    """torch.cumprod as y_i = prod_j (x_j where j <= i, else 1) over `_triangle`: gradbuilder's ReduceProd rule is
    exact where x holds zeros, as torch's cumprod backward (ONNX's CumProd comes at opset 26). In `dtype` if given;
    an integer or boolean x in int64, as torch's (`_accumulated`)."""
    x = _accumulated(g, x, dtype)
    got = _rank_and_axis(g, x, dim, "cumprod")
    if got is None or got[0] == 0:
        return None if got is None else x
    rank, axis = got
    below, _ = _triangle(g, x, axis, rank)
    spread = g.op("Where", below, symbolic_helper._unsqueeze_helper(g, x, [axis]), const_like(g, 1, x))
    return _reduce(g, "ReduceProd", spread, axis + 1)


def _logcumsumexp(g: Any, x: Any, dim: Any) -> Any:
    """torch.logcumsumexp as y_i = logsumexp_j (x_j where j <= i, else -inf), a ReduceLogSumExp over `_triangle`
    (the legacy exporter has none; dynamo's, log(cumsum(exp(x - max))), gives NaN gradients everywhere once an
    output is -inf, and underflows to -inf below max - 104 in float32). An output of -inf (all x_j so far -inf)
    gives its x_j NaN gradients, as torch's; the rest stay finite."""
    got = _rank_and_axis(g, x, dim, "logcumsumexp")
    if got is None or got[0] == 0:
        return None if got is None else x
    rank, axis = got
    below, _ = _triangle(g, x, axis, rank)
    spread = g.op("Where", below, symbolic_helper._unsqueeze_helper(g, x, [axis]), const_like(g, -math.inf, x))
    return _reduce(g, "ReduceLogSumExp", spread, axis + 1)


def _never_best(g: Any, x: Any, largest: bool) -> Any:
    """A value no running max (min, `largest` False) prefers to any of x's: -inf (inf), an integer type's least
    (greatest)."""
    if _floating(x):
        return const_like(g, -math.inf if largest else math.inf, x)
    dtype = _type_utils.JitScalarType.from_value(x).dtype()
    if dtype == torch.bool:
        return symbolic_helper._unimplemented("cummax" if largest else "cummin", "a boolean tensor", x)
    info = torch.iinfo(dtype)
    return g.op("Constant", value_t=torch.tensor(info.min if largest else info.max, dtype=dtype))


def _running_extremum(largest: bool) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """torch.cummax (cummin): the index is the last j <= i holding the running max, the last NaN once one is met
    (its value then NaN), as torch's; the value is x gathered there, so the gradient goes where torch's backward
    scatters it. Over `_triangle` (O(n^2) memory)."""
    op = "cummax" if largest else "cummin"

    def convert(g: Any, x: Any, dim: Any) -> tuple[Any, Any]:
        got = _rank_and_axis(g, x, dim, op)
        if got is None:
            return None, None
        if got[0] == 0:
            return x, g.op("Constant", value_t=torch.tensor(0))
        rank, axis = got
        below, j = _triangle(g, x, axis, rank)
        fill, none = _never_best(g, x, largest), g.op("Constant", value_t=torch.tensor(-1))
        nan = g.op("IsNaN", x) if _floating(x) else None
        key = x if nan is None else g.op("Where", nan, fill, x)  # NaNs aside: the running extremum of the rest
        spread = symbolic_helper._unsqueeze_helper(g, key, [axis])
        best = _reduce(g, "ReduceMax" if largest else "ReduceMin", g.op("Where", below, spread, fill), axis + 1)
        hit = g.op("And", below, g.op("Equal", spread, symbolic_helper._unsqueeze_helper(g, best, [axis + 1])))
        index = _reduce(g, "ReduceMax", g.op("Where", hit, j, none), axis + 1)
        if nan is not None:
            at_nan = g.op("And", below, symbolic_helper._unsqueeze_helper(g, nan, [axis]))
            last_nan = _reduce(g, "ReduceMax", g.op("Where", at_nan, j, none), axis + 1)
            index = g.op("Where", g.op("Equal", last_nan, none), index, last_nan)
        return g.op("GatherElements", x, index, axis_i=axis), index
    return convert


_UINT8, _BOOL = _type_utils.JitScalarType.UINT8.onnx_type(), _type_utils.JitScalarType.BOOL.onnx_type()


def _first_index(g: Any, x: Any, axis: int, largest: bool) -> Any:
    """The index along axis (kept, size 1) of the first max (min) of x, as torch's CPU kernel, or of the first NaN
    where there is one (torch's max and min propagate NaN; onnxruntime's ArgMax skips them: an ArgMax of their
    mask finds it). Booleans as uint8 (onnxruntime has no boolean ArgMax)."""
    key = g.op("Cast", x, to_i=_UINT8) if symbolic_helper._is_bool(x) else x
    index = g.op("ArgMax" if largest else "ArgMin", key, axis_i=axis, keepdims_i=1)
    if not _floating(x):
        return index
    nan = g.op("IsNaN", x)
    first_nan = g.op("ArgMax", g.op("Cast", nan, to_i=_UINT8), axis_i=axis, keepdims_i=1)
    return g.op("Where", g.op("GatherElements", nan, first_nan, axis_i=axis), first_nan, index)


def _arg_extremum(largest: bool) -> Callable[..., Any]:
    """torch.argmax (argmin): `_first_index` (torch's conversion, a bare ArgMax, skipped NaNs: 2 for argmax([1, nan,
    2]), torch's 1), along dim or of the flattened x (dim None; keepdim then gives sizes 1 of x's rank)."""
    def convert(g: Any, x: Any, dim: Any = None, keepdim: Any = None) -> Any:
        keep = not _none(keepdim) and bool(symbolic_helper._get_const(keepdim, "b", "keepdim"))
        rank = symbolic_helper._get_tensor_rank(x)
        if not _none(dim) and not rank:
            own = symbolic_opset12 if g.opset >= 12 else symbolic_opset9
            return getattr(own, "argmax" if largest else "argmin")(g, x, dim, keepdim)
        if _none(dim):
            index = _first_index(g, g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1]))), 0, largest)
            if not keep:
                return symbolic_helper._squeeze_helper(g, index, [0])
            ones = g.op("ConstantOfShape", g.op("Shape", g.op("Shape", x)), value_t=torch.tensor([1]))
            return g.op("Reshape", index, ones)
        axis = symbolic_helper._get_const(dim, "i", "dim") % rank
        index = _first_index(g, x, axis, largest)
        return index if keep else symbolic_helper._squeeze_helper(g, index, [axis])
    return convert


def _extremum(largest: bool) -> Callable[..., Any]:
    """torch.max (min) along a dim: the index the first occurrence of the max (ArgMax, as torch's CPU kernel), the
    first NaN where there is one (torch's max and min propagate NaN), and the value x gathered there, so that the
    gradient goes wholly to that index, as torch's backward scatters it (torch's conversion writes the value as a
    ReduceMax, whose rule splits a tie evenly: amax's gradient, not max's). `_first_index`'s NaN search doubles the
    op's time (a row max of [256, 32000] float32, one thread: 16 ms, 7 without, torch's conversion 8). max(x):
    `_every_extremum`; max(x, y): torch's."""
    own = symbolic_helper._max_helper if largest else symbolic_helper._min_helper

    def convert(g: Any, x: Any, dim_or_y: Any = None, keepdim: Any = None) -> Any:
        rank = symbolic_helper._get_tensor_rank(x)
        if _none(dim_or_y) and keepdim is None and _floating(x):
            return _every_extremum(g, x, largest)
        if keepdim is None or rank is None:
            return own(g, x, dim_or_y, keepdim)
        keep = bool(symbolic_helper._get_const(keepdim, "i", "keepdim"))
        if rank == 0:
            return x, g.op("Constant", value_t=torch.tensor(0))
        axis = symbolic_helper._get_const(dim_or_y, "i", "dim") % rank
        index = _first_index(g, x, axis, largest)
        value = g.op("GatherElements", x, index, axis_i=axis)
        if not keep:
            return tuple(symbolic_helper._squeeze_helper(g, t, [axis]) for t in (value, index))
        return value, index
    return convert


def _every_extremum(g: Any, x: Any, largest: bool) -> Any:
    """torch.max (min) of every element: NaN where x holds one, its gradient split evenly among the NaNs, else the
    max of x, its gradient split evenly among the ties, as torch's backward (evenly_distribute_backward).
    onnxruntime's ReduceMax keeps a NaN only where it comes first (torch's conversion, a bare ReduceMax, gave 5 for
    max([1, nan, 5])): the max is taken with NaNs as -inf (+inf), and the NaNs' mean chosen where there are any."""
    def every(op: str, v: Any) -> Any:  # 0-d, typed (`_as_traced`)
        return _as_traced(g, _reduced(g, op, v, None, False))

    nan = g.op("IsNaN", x)
    best = every("ReduceMax" if largest else "ReduceMin",
                 g.op("Where", nan, const_like(g, -math.inf if largest else math.inf, x), x))
    count = every("ReduceSum", cast_like(g, nan, x))
    nans = every("ReduceSum", g.op("Where", nan, x, const_like(g, 0.0, x)))
    mean = _as_traced(g, g.op("Div", nans, _as_traced(g, g.op("Max", count, const_like(g, 1.0, x)))))
    any_nan = g.op("Cast", count, to_i=_BOOL)  # not a 0-d Greater, which the exporter computes in float32
    return _as_traced(g, g.op("Where", any_nan, mean, best))


def _nan_kept(g: Any, x: Any, largest: bool, axes: list[int] | None, keep: bool) -> Any:
    """ReduceMax (ReduceMin) of x plus a term that is NaN over a group holding a NaN and -0 elsewhere (x + -0 is x),
    without a gradient: onnxruntime's reduction keeps a NaN only where it comes first (torch's conversion gave 2 for
    amax([1, nan, 2])). The rule's share over the elements equal to a NaN result, none, is NaN for the whole group,
    as torch's amax backward (grad / count, count 0)."""
    nans = _reduced(g, "ReduceMax", cast_like(g, g.op("IsNaN", x), x), axes, True)
    any_nan = g.op("Cast", nans, to_i=_BOOL)  # not a 0-d Greater, which the exporter computes in float32
    poison = _as_traced(g, g.op("Where", any_nan, const_like(g, math.nan, x), const_like(g, -0.0, x)))
    return _as_traced(g, _reduced(g, "ReduceMax" if largest else "ReduceMin", g.op("Add", x, poison), axes, keep))


def _amax(largest: bool) -> Callable[..., Any]:
    """torch.amax (amin): `_nan_kept`. Integers: torch's."""
    def convert(g: Any, x: Any, dim: Any = None, keepdim: Any = None) -> Any:
        if not _floating(x):
            own = symbolic_opset18 if g.opset >= 18 else symbolic_opset9
            return getattr(own, "amax" if largest else "amin")(g, x, dim, keepdim)
        axes = None if _none(dim) else list(symbolic_helper._get_const(dim, "is", "dim")) or None
        keep = not _none(keepdim) and bool(symbolic_helper._get_const(keepdim, "i", "keepdim"))
        return _nan_kept(g, x, largest, axes, keep)
    return convert


def _aminmax(g: Any, x: Any, dim: Any = None, keepdim: Any = None) -> tuple[Any, Any]:
    """torch.aminmax: `_nan_kept` both ways, along dim or over every axis. Integers: torch's."""
    if not _floating(x):
        return (symbolic_opset18 if g.opset >= 18 else symbolic_opset9).aminmax(g, x, dim, keepdim)
    axes = None if _none(dim) else [symbolic_helper._get_const(dim, "i", "dim")]
    keep = not _none(keepdim) and bool(symbolic_helper._get_const(keepdim, "i", "keepdim"))
    return _nan_kept(g, x, False, axes, keep), _nan_kept(g, x, True, axes, keep)


def _round(g: Any, x: Any, decimals: Any = None) -> Any:
    """torch.round to `decimals` as torch's kernel: Round(x * 10^d) / 10^d, or Round(x / 10^-d) * 10^-d for d < 0,
    10^d a constant of x's type (torch's conversion multiplies by a float32 10^-d: 0.9000000357 for torch's 0.9,
    float32 in float64). No gradient in torch (zeros)."""
    d = 0 if _none(decimals) else symbolic_helper._get_const(decimals, "i", "decimals")
    if not symbolic_helper._is_fp(x):
        return x
    if d == 0:
        return g.op("Round", x)
    scale = const_like(g, 10.0 ** abs(d), x)
    if d > 0:
        return g.op("Div", g.op("Round", g.op("Mul", x, scale)), scale)
    return g.op("Mul", g.op("Round", g.op("Div", x, scale)), scale)


def _addmm(g: Any, base: Any, m1: Any, m2: Any, beta: Any, alpha: Any) -> Any:
    """torch.addmm: in float64, beta and alpha not 1, `_added` (torch's conversion writes them as Gemm's float32
    attributes: 1e-7 off); else torch's (a Gemm)."""
    if _is_double(m1) and (_scalar(beta) != 1.0 or _scalar(alpha) != 1.0):
        return _added(g, base, g.op("MatMul", m1, m2), beta, alpha)
    return symbolic_opset9.addmm(g, base, m1, m2, beta, alpha)


def _addbmm(g: Any, base: Any, b1: Any, b2: Any, beta: Any = None, alpha: Any = None) -> Any:
    """torch.addbmm: beta base + alpha times the sum over the batch of b1 @ b2 (`_added`)."""
    return _added(g, base, _reduced(g, "ReduceSum", g.op("MatMul", b1, b2), [0], False), beta, alpha)


def _movedim(g: Any, x: Any, source: Any, destination: Any) -> Any:
    """torch.movedim (moveaxis) as one Transpose, its dims wrapped first (torch's conversion wrote a negative source
    into perm: `x.movedim(-1, 1)`, channels last to first, failed). Source dims to their destinations, the others
    in their order into the places left, as torch's."""
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented("movedim", "a tensor of unknown rank", x)
    dims = [[int(d) % max(rank, 1) for d in symbolic_helper._get_const(v, "t", name).view(-1).tolist()]
            for v, name in ((source, "source"), (destination, "destination"))]
    perm: list[int | None] = [None] * rank
    for src, dst in zip(*dims, strict=True):
        perm[dst] = src
    rest = iter(d for d in range(rank) if d not in dims[0])
    return _transposed(g, x, [next(rest) if p is None else p for p in perm])


@symbolic_helper.parse_args("v", "is")
def _permute(g: Any, x: Any, dims: list[int]) -> Any:
    """x.permute(dims) with negative dims wrapped (torch's conversion wrote them into perm: Mamba-2's
    `permute(0, -2, -1, 1)` was refused by onnx's inference, "Invalid attribute perm")."""
    return _transposed(g, x, [d % len(dims) for d in dims])


def _transposed(g: Any, x: Any, perm: list[int]) -> Any:
    """x transposed by perm (non-negative), or x itself where perm keeps every axis."""
    return x if perm == list(range(len(perm))) else g.op("Transpose", x, perm_i=perm)


def _split(g: Any, x: Any, split_size_or_sizes: Any, dim: Any, _outputs: int | None = None) -> Any:
    """x.split(k, dim) along an axis the export sizes at run time: torch's conversion took the axis for k times
    the traced chunk count (7 in chunks of 3 written as 3, 3, 3: refused at the first run). The last chunk is
    the rest of the axis, read at run time (the count is the trace's: another count is another graph, which the
    engine's export at new sizes finds)."""
    own = symbolic_opset13.split if g.opset >= 13 else symbolic_opset11.split if g.opset >= 11 else \
        symbolic_opset9.split
    if g.opset < 13 or not symbolic_helper._is_split_static(split_size_or_sizes, _outputs) or _outputs is None or \
            symbolic_helper._node_get(split_size_or_sizes.node(), "value").dim() > 0:
        return own(g, x, split_size_or_sizes, dim, _outputs)
    axis = symbolic_helper._get_const(dim, "i", "dim")
    rank = symbolic_helper._get_tensor_rank(x)
    axis = axis + rank if axis < 0 and rank is not None else axis
    if axis < 0 or symbolic_helper._get_tensor_dim_size(x, axis) is not None:
        return own(g, x, split_size_or_sizes, dim, _outputs)
    k = symbolic_helper._get_const(split_size_or_sizes, "i", "split_size")
    rest = g.op("Sub", _run_time_size(g, x, axis), g.op("Constant", value_t=torch.tensor([k * (_outputs - 1)])))
    sizes = g.op("Concat", g.op("Constant", value_t=torch.tensor([k] * (_outputs - 1), dtype=torch.long)), rest,
                 axis_i=0)
    return g.op("Split", x, sizes, axis_i=axis, outputs=_outputs)


def _embedding(g: Any, weight: Any, ids: Any, padding_idx: Any, *rest: Any) -> Any:
    """torch.embedding with a padding_idx p: the rows looked up through a StopGradient where ids == p, so that row p
    gets no gradient, as torch's (torch's conversion, a plain Gather, ignores p: `F.embedding(ids, w, padding_idx=p)`
    of a weight no nn.Embedding owns, a computed one, gave row p its lookups' gradient; nn.Embedding's too, which
    the legacy exporter's Gathers do not name apart from other reads of its weight: dynamo's are cut after the
    export, `export._embedding_padding`). Without one (p < 0), torch's."""
    rows = symbolic_opset9.embedding(g, weight, ids, padding_idx, *rest)
    p = symbolic_helper._get_const(padding_idx, "i", "padding_idx")
    if p < 0:
        return rows
    frozen = g.op(f"{DOMAIN}::{STOP_GRADIENT}", rows)
    frozen.setType(rows.type())
    is_padding = symbolic_helper._unsqueeze_helper(g, g.op("Equal", ids, const_like(g, p, ids)), [-1])
    return g.op("Where", is_padding, frozen, rows)


def _slogdet(g: Any, x: Any) -> tuple[Any, Any]:
    """torch.linalg.slogdet as the sign and the log of the magnitude of ONNX's Det (the legacy exporter writes Det
    for det and logdet only). torch sums the logs of its LU factors instead: a determinant beyond float's range
    (large matrices) is inf or 0 here; the gradient is the Det rule's cofactors over the determinant."""
    det = g.op("Det", x)
    return g.op("Sign", det), g.op("Log", g.op("Abs", det))


def _inverse(g: Any, a: Any) -> Any:
    """torch.linalg.inv (torch.inverse and Tensor.inverse trace as it, scripted or not) as onnxruntime's contrib
    Inverse: standard ONNX has no inverse. Typed as A, which onnx's shape inference cannot do for an op it does not
    know; the exporter imports com.microsoft at version 1, and gradbuilder's Inverse rule differentiates it. A
    singular matrix gives infs and NaNs where torch raises."""
    out = g.op(f"{MICROSOFT}::Inverse", a)
    out.setType(a.type())
    return out


def _no_errors(g: Any, a: Any) -> Any:
    """The `info` of linalg's `_ex` functions, int32 of A's batch shape: zeros, as for invertible matrices (the
    Inverse reports no singular one: its result holds infs and NaNs instead)."""
    batch = g.op("Slice", g.op("Shape", a), g.op("Constant", value_t=torch.tensor([0])),
                 g.op("Constant", value_t=torch.tensor([-2])))
    return g.op("ConstantOfShape", batch, value_t=torch.tensor([0], dtype=torch.int32))


def _inverse_ex(g: Any, a: Any, check_errors: Any = None) -> tuple[Any, Any]:
    return _inverse(g, a), _no_errors(g, a)


def _sizes(g: Any, i: int, value: Any) -> list[int] | None:
    """Input i's sizes as traced (symbols, negative, where the export made them dynamic: the module's inputs), else
    as converted; None where its rank is unknown."""
    for v in (g.original_node.inputsAt(i), value):
        t = v.type()
        sizes = t.symbolic_sizes() if isinstance(t, torch._C.TensorType) else None
        if sizes is not None:
            return sizes
    return None


def _vector_rhs(a: list[int], b: list[int]) -> bool:
    """torch's reading of B (linalg_solve_is_vector_rhs): a batch of vectors where it is 1-D or of A's shape without
    its last size, else of matrices; from the sizes torch traced. Where symbols keep the export from telling (A and
    B both module inputs, exported with dynamic sizes), vectors: a batch of matrices read so fails in onnxruntime
    (sizes that do not multiply) or in the first call's check against torch (values)."""
    return len(b) == 1 or (len(b) == len(a) - 1 and not any(p >= 0 and q >= 0 and p != q for p, q in zip(a, b)))


def _solve(g: Any, a: Any, b: Any, left: Any = None) -> Any:
    """torch.linalg.solve as A^{-1} B (B A^{-1} where not `left`), with `_inverse`: B broadcast as torch's, its
    vectors (`_vector_rhs`) as columns. Less accurate than torch's LU solve where A is ill-conditioned (a product
    with an explicit inverse is not backward stable: its residual grows with cond(A); float32, 16x16, cond 1e5: 2.3
    times torch's error); for well-conditioned A, float32 agrees with torch to ~1e-5 relative or better."""
    sizes_a, sizes_b = _sizes(g, 0, a), _sizes(g, 1, b)
    if sizes_a is None or sizes_b is None:
        return symbolic_helper._unimplemented("linalg_solve", "an operand of unknown rank", a)
    inverse = _inverse(g, a)
    if not symbolic_helper._is_none(left) and not symbolic_helper._get_const(left, "b", "left"):
        return g.op("MatMul", b, inverse)  # X A = B (torch refuses a batch of vectors there)
    if not _vector_rhs(sizes_a, sizes_b):
        return g.op("MatMul", inverse, b)
    column = symbolic_helper._unsqueeze_helper(g, b, [len(sizes_b)])  # [..., n, 1] (from [n]: broadcast)
    return symbolic_helper._squeeze_helper(g, g.op("MatMul", inverse, column), [len(sizes_a) - 1])


def _solve_ex(g: Any, a: Any, b: Any, left: Any = None, check_errors: Any = None) -> tuple[Any, Any]:
    return _solve(g, a, b, left), _no_errors(g, a)


def _cumsum(g: Any, x: Any, dim: Any, dtype: Any = None) -> Any:
    """torch.cumsum in torch's type: `dtype` where given (torch's conversion drops a constant one), int64 for an
    integer or boolean x (torch's conversion wrote CumSum of BOOL, which ONNX has not: transformers' packed-sequence
    check, `(position_diff != 1).cumsum(-1)`, in every decoder called without a mask or cache). A 0-d x: x, as torch's
    (onnxruntime's CumSum refuses a scalar)."""
    x = _accumulated(g, x, dtype)
    if symbolic_helper._get_tensor_rank(x) == 0:
        return x
    return g.op("CumSum", x, g.op("Constant", value_t=torch.tensor(symbolic_helper._get_const(dim, "i", "dim"))))


def _is_double(x: Any) -> bool:
    return _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.UNDEFINED) == \
        _type_utils.JitScalarType.DOUBLE


def _none(value: Any) -> bool:
    return value is None or symbolic_helper._is_none(value)


def _moments(g: Any, x: Any, *args: Any) -> tuple[Any, Any]:
    """torch.var_mean (var's, std's: `args` either (unbiased) or (dim, correction or unbiased, keepdim)) in x's
    type: the squared deviations from the mean summed over dim (every axis for None or []), over max(0, N -
    correction), N the number of elements reduced (read at run time), as torch's. torch's conversion divides a
    ReduceMean by a float32 N: over every axis, the 0-d float64 sum came back float32 (silently, 3e-8 off), and
    dim=None with keepdim gave shape () for torch's (1, 1, ...)."""
    dim, correction, keepdim = (None, args[0], None) if len(args) == 1 else args
    axes = None if _none(dim) else list(symbolic_helper._get_const(dim, "is", "dim")) or None
    c = 1.0 if _none(correction) else float(symbolic_helper._get_const(correction, "f", "correction"))
    keep = not _none(keepdim) and bool(symbolic_helper._get_const(keepdim, "i", "keepdim"))
    deviation = g.op("Sub", x, _reduced(g, "ReduceMean", x, axes, True))
    squares = _reduced(g, "ReduceSum", g.op("Mul", deviation, deviation), axes, keep)
    if axes is None:
        n = g.op("Size", x)
    else:
        n = g.op("ReduceProd", g.op("Gather", g.op("Shape", x), g.op("Constant", value_t=torch.tensor(axes))),
                 keepdims_i=0)
    divisor = g.op("Max", g.op("Sub", cast_like(g, n, x), const_like(g, c, x)), const_like(g, 0.0, x))
    return _as_traced(g, g.op("Div", squares, divisor)), _reduced(g, "ReduceMean", x, axes, keep)


def _log_base(base: float) -> Callable[[Any, Any], Any]:
    """log2, log10: ln x over ln base, a float64 constant cast to x's type (torch's is float32: 1e-8 off in
    float64)."""
    return lambda g, x: g.op("Div", g.op("Log", x), const_like(g, math.log(base), x))


def _addcmul(g: Any, x: Any, t1: Any, t2: Any, value: Any = None) -> Any:
    """x + value * t1 * t2, value a constant of the product's type (torch's writes it float32)."""
    product = g.op("Mul", t1, t2)
    v = _scalar(value)
    return g.op("Add", x, product if v == 1.0 else g.op("Mul", product, const_like(g, v, product)))


def _elu_of(g: Any, x: Any, alpha: float, scale: float = 1.0, input_scale: float = 1.0) -> Any:
    """torch's elu in elementwise ops, its constants float64: scale x where x > 0, else alpha scale (exp(x
    input_scale) - 1) (exp of x clipped to 0 there, so that a large x gives no inf and no NaN gradient); at 0 the
    negative side's gradient, as torch's. exp - 1 where torch has expm1: 1e-16 apart, absolutely."""
    positive = g.op("Greater", x, const_like(g, 0.0, x))
    negative = g.op("Where", positive, const_like(g, 0.0, x), x)
    if input_scale != 1.0:
        negative = g.op("Mul", negative, const_like(g, input_scale, x))
    below = g.op("Mul", g.op("Sub", g.op("Exp", negative), const_like(g, 1.0, x)), const_like(g, alpha * scale, x))
    above = x if scale == 1.0 else g.op("Mul", x, const_like(g, scale, x))
    return g.op("Where", positive, above, below)


def _leaky_of(g: Any, x: Any, slope: float) -> Any:
    """x where x > 0, else slope x (a float64 constant); at 0 the slope's gradient, as torch's."""
    return g.op("Where", g.op("Greater", x, const_like(g, 0.0, x)), x, g.op("Mul", x, const_like(g, slope, x)))


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _elu(g: Any, x: Any, alpha: Any, scale: Any, input_scale: Any, *rest: Any) -> Any:
    """The activations ONNX has as ops of float32 attributes (Elu's alpha, ...), which float64 computes with
    float32-rounded constants (2e-8 to 4e-8 off): in float64 `_elu_of`, else torch's. So for selu, celu,
    leaky_relu and eval's rrelu below."""
    if not _is_double(x):
        return symbolic_opset9.elu(g, x, alpha, scale, input_scale)
    return _elu_of(g, x, _scalar(alpha), _scalar(scale), _scalar(input_scale))


def _selu(g: Any, x: Any) -> Any:
    return _elu_of(g, x, SELU_ALPHA, SELU_SCALE) if _is_double(x) else symbolic_opset9.selu(g, x)


def _celu(g: Any, x: Any, alpha: Any = None) -> Any:
    """elu(x, alpha, input_scale = 1 / alpha); also below opset 12 (torch has none there)."""
    if g.opset >= 12 and not _is_double(x):
        return symbolic_opset12.celu(g, x, alpha)
    a = _scalar(alpha)
    return _elu_of(g, x, a, 1.0, 1.0 / a)


def _leaky_relu(g: Any, x: Any, slope: Any = None, *rest: Any) -> Any:
    if not _is_double(x):
        return symbolic_opset9.leaky_relu(g, x, slope, *rest)
    return _leaky_of(g, x, _scalar(slope, 0.01))


def _rrelu(g: Any, x: Any, lower: Any, upper: Any, training: Any, generator: Any = None) -> Any:
    """Out of training, leaky_relu of slope (lower + upper) / 2, as torch's."""
    if not _is_double(x) or symbolic_helper._get_const(training, "i", "training"):
        return symbolic_opset9.rrelu(g, x, lower, upper, training, generator)
    return _leaky_of(g, x, (_scalar(lower) + _scalar(upper)) / 2)


def _rolled(g: Any, x: Any, shift: int, axis: int) -> Any:
    """x rolled by shift along axis: its last shift % n entries, then the rest, as torch's (whose conversion
    slices at -shift, not wrapped: any |shift| >= n gave something else). n a constant where known at export,
    read at run time if not."""
    n = symbolic_helper._get_tensor_dim_size(x, axis)
    if n is not None:
        s = shift % n if n else 0
        if s == 0:
            return x
        start = [g.op("Constant", value_t=torch.tensor([n - s]))]
    else:
        size = _run_time_size(g, x, axis)
        start = [g.op("Sub", size, g.op("Mod", g.op("Constant", value_t=torch.tensor([shift])), size))]
    zero, end = g.op("Constant", value_t=torch.tensor([0])), g.op("Constant", value_t=torch.tensor([_END]))
    axes = g.op("Constant", value_t=torch.tensor([axis]))
    return g.op("Concat", g.op("Slice", x, start[0], end, axes), g.op("Slice", x, zero, start[0], axes), axis_i=axis)


def _roll(g: Any, x: Any, shifts: Any, dims: Any) -> Any:
    """torch.roll: each shift wrapped (`_rolled`); without dims, of the flattened tensor, reshaped back (torch's
    conversion asserted a dim for each shift). Slice's starts as inputs: opset 10 and up."""
    if g.opset < 10:
        return symbolic_helper._unimplemented("roll", "opset below 10", x)
    shifts = list(symbolic_helper._get_const(shifts, "is", "shifts"))
    dims = list(symbolic_helper._get_const(dims, "is", "dims"))
    if not dims:
        flat = g.op("Reshape", x, g.op("Constant", value_t=torch.tensor([-1])))
        return g.op("Reshape", _rolled(g, flat, sum(shifts), 0), g.op("Shape", x))
    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        return symbolic_helper._unimplemented("roll", "a tensor of unknown rank", x)
    for shift, dim in zip(shifts, dims, strict=True):
        x = _rolled(g, x, shift, dim % max(rank, 1))
    return x


def _unpacked_count(g: Any) -> int | None:
    """How many tensors the traced list result is unpacked into (a ListUnpack reading it), None if not."""
    for use in g.original_node.output().uses():
        if use.user.kind() == "prim::ListUnpack":
            return use.user.outputsSize()
    return None


def _chunk(g: Any, x: Any, chunks: Any, dim: Any) -> Any:
    """torch.chunk as Slices of ceil(n / chunks) each, as many as the trace unpacks (fewer than chunks where n
    is not a multiple: 6 into 4 gives 3 of 2; torch's conversion wrote 4, one of them of size 0 from a Reshape
    that failed at run time). Bounds constants where n is known at export, from Shape if not."""
    count = _unpacked_count(g)
    got = _rank_and_axis(g, x, dim, "chunk")
    if count is None or got is None:
        return symbolic_opset11.chunk(g, x, chunks, dim) if g.opset >= 11 else None
    axis, c = got[1], symbolic_helper._get_const(chunks, "i", "chunks")
    n = symbolic_helper._get_tensor_dim_size(x, axis)
    if n is not None:
        size = -(-n // c)
        bounds = [g.op("Constant", value_t=torch.tensor([min(k * size, n)])) for k in range(count)]
    else:
        length = _run_time_size(g, x, axis)
        ck = g.op("Constant", value_t=torch.tensor([c]))
        size = g.op("Div", g.op("Add", length, g.op("Constant", value_t=torch.tensor([c - 1]))), ck)
        bounds = [g.op("Mul", size, g.op("Constant", value_t=torch.tensor([k]))) for k in range(count)]
    return _slices(g, x, axis, [*bounds, g.op("Constant", value_t=torch.tensor([_END]))])


def _unique2(g: Any, x: Any, sorted: Any, return_inverse: Any, return_counts: Any) -> tuple[Any, Any, Any]:
    """torch.unique (no dim): torch's Unique, whose inverse (of the flattened input) reshaped to x's shape, as
    torch's (torch's conversion returned it flat)."""
    own = symbolic_opset11._unique2 if g.opset >= 11 else symbolic_opset9._unique2
    values, inverse, counts = own(g, x, sorted, return_inverse, return_counts)
    return values, g.op("Reshape", inverse, g.op("Shape", x)), counts


def _div(g: Any, a: Any, b: Any, *args: Any) -> Any:
    """torch.div: rounding_mode="floor" as `_floor_divide` (torch's conversion floors a / b, which differs from
    torch where the quotient rounds up to an integer: 0.3% of random float32 pairs one off); "trunc" of floats as
    `_trunc` of the quotient (torch's conversion cast it to int64 and back: no gradient where torch's is zeros,
    and wrong beyond 2^63 and at NaN); the rest torch's."""
    mode = symbolic_helper._get_const(args[0], "s", "rounding_mode") if args and not _none(args[0]) else None
    if mode == "floor":
        return _floor_divide(g, a, b)
    if mode == "trunc":
        x, y, floating = _common_type(g, a, b)
        if floating:
            return _trunc(g, g.op("Div", x, y))
    return (symbolic_opset10.div if g.opset >= 10 else symbolic_opset9.div)(g, a, b, *args)


def _batch_norm(g: Any, x: Any, weight: Any, bias: Any, mean: Any, var: Any, training: Any, *rest: Any) -> Any:
    """torch.batch_norm without running statistics (`F.batch_norm(x, None, None, w, b, training=True)`, as functional
    networks call it): stand-ins of x's channel count in their place (and in a missing weight's and bias's) under a
    training-mode node, whose batch statistics normalize and whose running outputs nothing reads (what
    `batchnorm.training_batchnorm` makes of a module's). torch's conversion computed the statistics by a Reshape to
    the batch's size and refused a batch sized at run time ("batch_size and channel_size must be non-None"). The
    rest, torch's. The statistics' stand-ins are ConstantOfShapes and the weight's and bias's Expands: onnxruntime's
    common-subexpression elimination merged a zero bias made as the zero mean is, and the node writes its running
    mean in place (the bias read was then overwritten: outputs off by up to 0.4, differing from run to run)."""
    own = symbolic_opset14.batch_norm if g.opset >= 14 else symbolic_opset9.batch_norm
    if g.opset < 14 or not (_none(mean) or _none(var)) or not symbolic_helper._maybe_get_const(training, "b"):
        return own(g, x, weight, bias, mean, var, training, *rest)
    channels = g.op("Slice", g.op("Shape", x), *[g.op("Constant", value_t=torch.tensor([i])) for i in (1, 2)])
    dtype = _type_utils.JitScalarType.from_value(x).dtype()
    mean, var = (g.op("ConstantOfShape", channels, value_t=torch.tensor([v], dtype=dtype)) for v in (0.0, 1.0))
    weight, bias = (g.op("Expand", g.op("Constant", value_t=torch.tensor(v, dtype=dtype)), channels) if _none(t)
                    else t for t, v in ((weight, 1.0), (bias, 0.0)))
    eps = symbolic_helper._maybe_get_const(rest[1], "f") if len(rest) > 1 else None
    scale = eps_scale(eps) if _is_double(x) and isinstance(eps, float) else None
    if scale is not None:  # torch's eps in float64, its statistics unread (`batchnorm.eps_scale`)
        x = g.op("Mul", x, const_like(g, scale, x))
    return own(g, x, weight, bias, mean, var, training, *rest)


def _draw(g: Any, like: Any, fill: str, *params: float) -> Any:
    """torch's `fill` of a tensor shaped and typed as `like`, as `torch_draws`' marker (expanded after the export
    into the random op, tagged for the host)."""
    dtype = _type_utils.JitScalarType.from_value(like, _type_utils.JitScalarType.FLOAT)
    marker = g.op(f"{DOMAIN}::{torch_draws.OP_TYPE}", like, fill_s=fill, dtype_i=dtype.onnx_type(),
                  params_t=torch.tensor(params, dtype=torch.float64))
    marker.setType(like.type())
    return marker


def _numbers(*values: Any) -> list[float] | None:
    """The Python numbers the values hold; None where one is a tensor."""
    found = [symbolic_helper._maybe_get_const(v, "f") for v in values]
    return None if any(symbolic_helper._is_value(f) for f in found) else [float(f) for f in found]


def _bernoulli(g: Any, x: Any, p: Any = None, generator: Any = None, out: Any = None) -> Any:
    """`x.bernoulli_(p)` of a number p (timm's drop_path) as torch's fill; of probabilities, torch's."""
    number = None if p is None or _none(p) or not _none(generator) else _numbers(p)
    if number is None:
        return (symbolic_opset15.bernoulli if g.opset >= 15 else symbolic_opset9.bernoulli)(g, x, p, generator, out)
    return _draw(g, x, "bernoulli_", *number)


def _normal(g: Any, mean: Any, std: Any, sizes: Any = None, generator: Any = None, *rest: Any) -> Any:
    """`x.normal_(mean, std)` (traced as `normal(mean, std, x.size())`) as torch's fill, in x's type: torch's
    conversion wrote the numbers in float64 and so the noise (onnxruntime refused a float32 tensor's). Of tensors,
    torch's, their gradients zeros (the noise is not reparametrized)."""
    sized = sizes is not None and not _none(sizes)  # the tensor overloads are traced (mean, std, generator)
    numbers = _numbers(mean, std) if sized and _none(generator) else None
    if numbers is not None:
        return _draw(g, _zeros_sized(g, sizes), "normal_", *numbers)
    if sized or not _seeded_by_default(g):
        return symbolic_opset11.normal(g, mean, std, sizes, generator, *rest)
    return _normal_of_tensors(g, *[symbolic_helper._maybe_get_const(v, "f") for v in (mean, std)])


def _normal_of_tensors(g: Any, mean: Any, std: Any) -> Any:
    """torch.normal of a tensor mean or std as torch computes it, `normal_(0, std)` + mean for a number std, else
    `normal_(0, 1)` * std + mean, the fill tagged for the host; the tensors' gradients zeros, as torch's (the noise
    is not reparametrized)."""
    dtype = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.FLOAT).dtype()

    def held(v: Any) -> Any:
        if not symbolic_helper._is_value(v):
            return g.op("Constant", value_t=torch.tensor(v, dtype=dtype))
        out = g.op(f"{DOMAIN}::{ZERO_GRADIENT}", v)
        out.setType(_any_size(v.type()))
        return out

    spread = None if symbolic_helper._is_value(std) else float(std)
    mean, std = held(mean), held(std)
    like = mean if spread is not None else g.op("Add", mean, std)
    like.setType(_any_size(g.original_node.output().type()))
    noise = _draw(g, like, "normal_", 0.0, 1.0 if spread is None else spread)
    return g.op("Add", noise if spread is not None else g.op("Mul", noise, std), mean)


def _any_size(t: Any) -> Any:
    """A traced value's type without its sizes, for a node of gradbuilder's domain, which onnx's shape inference
    cannot type: the traced call's sizes would stay in the graph (its outputs then fixed at the batch it was traced
    at, and a backward refusing another batch's gradients)."""
    rank = t.dim() if isinstance(t, torch._C.TensorType) else None
    return t.with_sizes([None] * rank) if rank is not None else t


def _zeros_sized(g: Any, sizes: Any) -> Any:
    """Zeros of the traced call's result type, sized by a list of ints or a shape tensor: the `like` of a draw."""
    shape = symbolic_helper._maybe_get_const(sizes, "is")
    shape = g.op("Constant", value_t=torch.tensor(shape, dtype=torch.int64)) if isinstance(shape, list) else sizes
    dtype = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.FLOAT)
    return g.op("ConstantOfShape", shape, value_t=torch.zeros(1, dtype=dtype.dtype()))


def _seeded_by_default(g: Any) -> bool:
    """Whether the traced call draws from torch's default generator (no `generator=` among its inputs)."""
    return not any(i.type().kind() == "GeneratorType" for i in g.original_node.inputs())


def _random(fill: str, own: Callable[..., Any], like: bool) -> Callable[..., Any]:
    """torch.rand / randn (`like`: rand_like / randn_like) as torch's fill: torch's conversion wrote the random op
    untagged, as it does randint, rrelu and others' uniforms, which the host cannot tell from these. With a
    generator, torch's."""
    def convert(g: Any, x: Any, *rest: Any) -> Any:
        if not _seeded_by_default(g):
            return own(g, x, *rest)
        dtype = _type_utils.JitScalarType.from_value(g.original_node.output(), _type_utils.JitScalarType.FLOAT)
        if like and dtype == _type_utils.JitScalarType.from_value(x, _type_utils.JitScalarType.UNDEFINED):
            return _draw(g, x, fill, 0.0, 1.0)
        return _draw(g, _zeros_sized(g, g.op("Shape", x) if like else x), fill, 0.0, 1.0)
    return convert


def _exponential(g: Any, x: Any, rate: Any = None, generator: Any = None) -> Any:
    """`x.exponential_(rate)` as torch's fill (torch has no conversion)."""
    numbers = _numbers(rate) if rate is not None and _none(generator) else None
    if numbers is None:
        return symbolic_helper._unimplemented("exponential", "a rate given as a tensor or a generator", x)
    return _draw(g, x, "exponential_", *numbers)


def _uniform(g: Any, x: Any, low: Any, high: Any, generator: Any = None) -> Any:
    """`x.uniform_(low, high)` as torch's fill (torch has no conversion)."""
    numbers = _numbers(low, high) if _none(generator) else None
    if numbers is None:
        return symbolic_helper._unimplemented("uniform", "bounds given as tensors or a generator", x)
    return _draw(g, x, "uniform_", *numbers)


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
    "aten::fmax": _nan_ignoring("Greater"), "aten::fmin": _nan_ignoring("Less"),
    "aten::trunc": _trunc, "aten::fix": _trunc, "aten::frac": lambda g, x: g.op("Sub", x, _trunc(g, x)),
    "aten::copy": _copy, "aten::matrix_H": _matrix_h, "aten::full": _full,
    **{f"aten::_upsample_nearest_exact{d}d": _nearest_exact(d) for d in (1, 2, 3)},
    "aten::median": lambda g, x, *args: _median(g, x) if not args else _median_dim(g, x, *args),
    "aten::tensor_split": _tensor_split, "aten::cumprod": _cumprod,
    "aten::cummax": _running_extremum(True), "aten::cummin": _running_extremum(False),
    "aten::logcumsumexp": _logcumsumexp, "aten::floor_divide": _floor_divide,
    "aten::index": _index, "aten::max": _extremum(True), "aten::min": _extremum(False),
    "aten::linalg_slogdet": _slogdet, "aten::slogdet": _slogdet, "aten::cumsum": _cumsum,
    "aten::linalg_inv": _inverse, "aten::linalg_inv_ex": _inverse_ex,
    "aten::linalg_solve": _solve, "aten::linalg_solve_ex": _solve_ex,
    "aten::var": lambda g, x, *args: _moments(g, x, *args)[0],
    "aten::std": lambda g, x, *args: g.op("Sqrt", _moments(g, x, *args)[0]),
    "aten::var_mean": _moments,
    "aten::std_mean": lambda g, x, *args: (lambda v, m: (g.op("Sqrt", v), m))(*_moments(g, x, *args)),
    "aten::log2": _log_base(2.0), "aten::log10": _log_base(10.0), "aten::addcmul": _addcmul,
    "aten::elu": _elu, "aten::selu": _selu, "aten::celu": _celu, "aten::leaky_relu": _leaky_relu,
    "aten::rrelu": _rrelu, "aten::roll": _roll, "aten::chunk": _chunk, "aten::_unique2": _unique2,
    "aten::div": _div, **{f"aten::{name}": _clamp(name) for name in ("clamp", "clamp_min", "clamp_max")},
    "aten::scatter_reduce": _scatter_reduce, "aten::repeat_interleave": _repeat_interleave,
    "aten::amax": _amax(True), "aten::amin": _amax(False), "aten::round": _round, "aten::addmm": _addmm,
    "aten::addbmm": _addbmm, "aten::movedim": _movedim, "aten::permute": _permute,
    "aten::argmax": _arg_extremum(True), "aten::argmin": _arg_extremum(False), "aten::embedding": _embedding,
    "aten::aminmax": _aminmax, "aten::split": _split, "aten::batch_norm": _batch_norm,
    "aten::fake_quantize_per_tensor_affine": _fake_quantize(False),
    "aten::fake_quantize_per_channel_affine": _fake_quantize(True),
    "aten::bernoulli": _bernoulli, "aten::normal": _normal, "aten::uniform": _uniform,
    "aten::exponential": _exponential, "aten::rand": _random("uniform_", symbolic_opset9.rand, False),
    "aten::randn": _random("normal_", symbolic_opset9.randn, False),
    "aten::rand_like": _random("uniform_", symbolic_opset9.rand_like, True),
    "aten::randn_like": _random("normal_", symbolic_opset9.randn_like, True),
}


@contextlib.contextmanager
def exported_symbolics() -> Iterator[None]:
    """`MISSING` registered while the block lasts, from `OPSET` and from the opsets of `TORCH_OWN`."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(registered(MISSING, OPSET))
        for name, opsets in TORCH_OWN.items():
            for opset in opsets if isinstance(opsets, tuple) else (opsets,):
                stack.enter_context(registered({name: MISSING[name]}, opset))
        yield
