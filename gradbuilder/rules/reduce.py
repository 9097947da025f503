"""Reductions, CumSum and CumProd: the output gradient is broadcast back over the reduced axes, times the local
derivative, which every rule reads off the forward output where it can.

Axes come as an attribute (opset < 18, except ReduceSum) or as an input (ReduceSum from 13, the others from
18), constant or computed at run time; `_Axes` hides the difference. Reducing over no axes with
`noop_with_empty_axes` is, in onnxruntime, the reduction of each element alone (ReduceL1 gives |x|,
ReduceSumSquare x*x), so the general formulas cover it without a special case.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from .context import Grad
from .registry import rule


@dataclass(frozen=True)
class _Axes:
    """The reduced axes of one Reduce node."""

    const: tuple[int, ...] | None
    """The axes when known at build time (() when none are given); None when computed at run time."""
    tensor: str | None
    """The axes input, read at run time when `const` is None."""
    keepdims: bool
    noop: bool


def _axes(g: Grad) -> _Axes:
    as_input = g.op_type == "ReduceSum" or g.opset >= 18
    keepdims = int(g.attr("keepdims", 1)) == 1  # onnx and onnxruntime keep dims for 1 only (keepdims=2 drops)
    rank = g.rank(g.I(0))
    scalar = rank == 0  # reduces to itself, whatever axes onnxruntime is given
    if not as_input:
        axes = g.attr("axes", None) or ()
        if axes and rank is None:  # maybe a scalar at run time
            return _at_run_time(g, g.ints(list(axes)), keepdims, False)
        return _Axes(() if scalar else _distinct(g, axes, rank), None, keepdims, False)
    noop = int(g.attr("noop_with_empty_axes", 0)) == 1  # 0 or 1: the forward graph refuses others
    if g.I(1) is None or scalar:
        return _Axes((), None, keepdims, noop)
    value = g.const_input(1)
    if value is None or rank is None:
        return _at_run_time(g, g.I(1), keepdims, noop)
    return _Axes(_distinct(g, value.ravel().tolist(), rank), g.I(1), keepdims, noop)


def _at_run_time(g: Grad, axes: str, keepdims: bool, noop: bool) -> _Axes:
    """Axes computed at run time, or given for an input whose rank the build does not know: made non-negative and
    distinct there, and none for an input that is a scalar at run time, which onnxruntime reduces to itself
    whatever the axes (given [0, 1] for one, the gradient was unsqueezed to [1, 1] and spread over four axes
    after: runtime replay fuzz, seed 104)."""
    r = g.Size(g.shape_of(g.I(0)))
    distinct = g.op("Unique", g.Mod(g.Add(axes, r), g.Max(r, g.ints(1))), sorted=1)
    return _Axes(None, g.Slice(distinct, g.ints([0]), g.unsqueeze(r, [0])), keepdims, noop)


def _distinct(g: Grad, axes: Iterable[int], rank: int | None) -> tuple[int, ...]:
    """The axes once each (onnxruntime reduces over [0, 0] as over [0]; the Unsqueeze putting them back refuses
    a repeat), non-negative where the rank is known."""
    if rank is None:
        return tuple(dict.fromkeys(int(a) for a in axes))
    return tuple(sorted({g.axis(a, rank, "axes value") for a in axes}))



def _kept(g: Grad, t: str, ax: _Axes) -> str:
    """`t`, shaped like the node's output, with the reduced axes back as size 1 so it broadcasts against the
    input. With keepdims=0 and no axes the output is a scalar (all reduced) or the input itself (noop): both
    broadcast already; run-time axes go straight to Unsqueeze, whose negative axes count like Reduce's."""
    if ax.keepdims or ax.const == ():
        return t
    return g.Unsqueeze(t, g.ints(list(ax.const)) if ax.const is not None else ax.tensor)


def _reduce_kept(g: Grad, op: str, t: str, ax: _Axes) -> str:
    """`op` over the node's own axes with keepdims=1, in the form valid at this opset."""
    if op == "ReduceSum" or g.opset >= 18:
        axes = ax.tensor if ax.const is None else (g.ints(list(ax.const)) if ax.const else None)
        inputs = [t] if axes is None else [t, axes]
        return g.op(op, *inputs, keepdims=1, noop_with_empty_axes=int(ax.noop))
    return g.op(op, t, keepdims=1, axes=list(ax.const) if ax.const else None)


def _count(g: Grad, x: str, y: str) -> str:
    """How many input elements fold into each output element, as a scalar of x's type: numel(x)/numel(y),
    from shapes only (computed in the forward part, so nothing big is stashed)."""
    xs, ys = g.info(x).static_shape, g.info(y).static_shape
    if xs is not None and ys is not None:
        return g.const(np.prod(xs, dtype=np.int64) / max(int(np.prod(ys, dtype=np.int64)), 1), like=x)
    nx = g.ReduceProd(g.shape_of(x), keepdims=0)
    ny = g.Max(g.ReduceProd(g.shape_of(y), keepdims=0), g.ints(1))
    return g.cast_like(g.Div(nx, ny), x)


@rule("ReduceSum", nondiff=(1,))
def reduce_sum(g: Grad):
    return (g.Expand(_kept(g, g.GO(0), _axes(g)), g.shape_of(g.I(0))),)


@rule("ReduceMean", nondiff=(1,))
def reduce_mean(g: Grad):
    x = g.I(0)
    dy = g.Div(g.GO(0), _count(g, x, g.O(0)))
    return (g.Expand(_kept(g, dy, _axes(g)), g.shape_of(x)),)


def _extremum(g: Grad):
    """Max/Min: the gradient is split evenly between tied extrema, as torch.amax/amin do."""
    ax = _axes(g)
    x = g.I(0)
    hit = g.cast_like(g.Equal(x, _kept(g, g.O(0), ax)), x)
    share = g.Div(_kept(g, g.GO(0), ax), _reduce_kept(g, "ReduceSum", hit, ax))
    return (g.Mul(share, hit),)


rule("ReduceMax", nondiff=(1,))(_extremum)
rule("ReduceMin", nondiff=(1,))(_extremum)


@rule("ReduceProd", nondiff=(1,))
def reduce_prod(g: Grad):
    """d prod / d x_i = product of the others, computed without dividing by zero: with no zero it is
    p/x_i, with exactly one zero it is p (of the non-zeros) at the zero and 0 elsewhere, else 0."""
    ax = _axes(g)
    x = g.I(0)
    zero, one = g.const(0, like=x), g.const(1, like=x)
    is_zero = g.Equal(x, zero)
    n_zero = _reduce_kept(g, "ReduceSum", g.cast_like(is_zero, x), ax)
    x_nz = g.Where(is_zero, one, x)
    p_nz = _reduce_kept(g, "ReduceProd", x_nz, ax)
    at_zero = g.Where(g.Equal(n_zero, one), p_nz, zero)
    elsewhere = g.Where(g.Equal(n_zero, zero), g.Div(p_nz, x_nz), zero)
    return (g.Mul(g.Where(is_zero, at_zero, elsewhere), _kept(g, g.GO(0), ax)),)


@rule("ReduceL2", nondiff=(1,))
def reduce_l2(g: Grad):
    """x / ||x||, with 0 where the norm is 0 (torch's convention)."""
    ax = _axes(g)
    x = g.I(0)
    norm = _kept(g, g.O(0), ax)
    zero = g.const(0, like=x)
    ratio = g.Where(g.Equal(norm, zero), zero, g.Div(_kept(g, g.GO(0), ax), norm))
    return (g.Mul(x, ratio),)


@rule("ReduceL1", nondiff=(1,))
def reduce_l1(g: Grad):
    return (g.Mul(g.Sign(g.I(0)), _kept(g, g.GO(0), _axes(g))),)


@rule("ReduceSumSquare", nondiff=(1,))
def reduce_sum_square(g: Grad):
    x = g.I(0)
    return (g.Mul(g.Add(x, x), _kept(g, g.GO(0), _axes(g))),)


@rule("ReduceLogSumExp", nondiff=(1,))
def reduce_log_sum_exp(g: Grad):
    """softmax(x) over the axes, read off the output: exp(x - y)."""
    ax = _axes(g)
    return (g.Mul(g.Exp(g.Sub(g.I(0), _kept(g, g.O(0), ax))), _kept(g, g.GO(0), ax)),)


@rule("ReduceLogSum", nondiff=(1,))
def reduce_log_sum(g: Grad):
    """1 / sum(x) over the axes, read off the output as exp(-y)."""
    ax = _axes(g)
    return (g.Expand(g.Div(_kept(g, g.GO(0), ax), g.Exp(_kept(g, g.O(0), ax))), g.shape_of(g.I(0))),)


@rule("CumSum", nondiff=(1,))
def cumsum(g: Grad):
    """The adjoint of a running sum is the running sum the other way, equally exclusive."""
    return (g.CumSum(g.GO(0), g.I(1), exclusive=int(g.flag("exclusive")), reverse=int(not g.flag("reverse"))),)


@rule("CumProd", since=26, nondiff=(1,))
def cumprod(g: Grad):
    """Exact where x has zeros (as torch's cumprod_backward), and read off x alone. With z the first zero of x the
    way the product runs, d/dx_k sums g times the product without x_k over the outputs covering k:

    - before z: the adjoint running sum of g*y over the outputs holding no zero (the others are 0), over x_k (not 0);
    - at z: the adjoint running sum of g*y', y' the running product with x_z made 1 (y' is y where y holds no
      zero, so one running product serves both sums);
    - past z: 0, since every output covering k covers z too.
    """
    x, axis = g.I(0), g.I(1)
    exclusive, reverse = int(g.flag("exclusive")), int(g.flag("reverse"))
    zero, one = g.const(0, like=x), g.const(1, like=x)
    is_zero = g.Equal(x, zero)
    seen = g.CumSum(g.Cast(is_zero, to=TensorProto.INT32), axis, reverse=reverse)  # zeros up to k: exact counts
    before = g.Equal(seen, g.const(0, elem_type=TensorProto.INT32))
    first = g.And(is_zero, g.Equal(seen, g.const(1, elem_type=TensorProto.INT32)))
    gy = g.Mul(g.GO(0), g.CumProd(g.Where(first, one, x), axis, exclusive=exclusive, reverse=reverse))
    no_zero = g.Or(before, first) if exclusive else before  # the outputs whose product holds no zero
    up_to_z = g.CumSum(g.Where(no_zero, gy, zero), axis, exclusive=exclusive, reverse=1 - reverse)
    from_z = g.CumSum(gy, axis, exclusive=exclusive, reverse=1 - reverse)  # read at z only
    return (g.Where(before, g.Div(up_to_z, g.Where(before, x, one)), g.Where(first, from_z, zero)),)
