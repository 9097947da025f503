"""Elementwise arithmetic and math with numpy broadcasting: one small function per op.

Rules read a node's output where the derivative is a function of it (Exp, Sqrt, Reciprocal, Tan), so
backward stashes one tensor instead of recomputing. Masked selections and comparisons go through
`where`/`compare`, which keep bfloat16 graphs valid at opsets whose Where/GreaterOrEqual/LessOrEqual
lack a bfloat16 type (< 16); activations.py shares these helpers.
"""

from __future__ import annotations

import math

from onnx import TensorProto

from .context import Grad
from .registry import rule

Grads = tuple["str | None", ...]

_BF16_SINCE = {"Where": 16, "GreaterOrEqual": 16, "LessOrEqual": 16}
"""Opset from which these ops accept bfloat16; below it they run through an exact detour via float32."""


def _via_float(g: Grad, op: str, like: str) -> bool:
    return g.dtype(like) == TensorProto.BFLOAT16 and g.opset < _BF16_SINCE[op]


def where(g: Grad, cond: str, a: str, b: str, like: str) -> str:
    """Where(cond, a, b) for a and b of `like`'s dtype; bfloat16 below opset 16 goes through float32
    (both casts are exact), since Where has no bfloat16 there."""
    if not _via_float(g, "Where", like):
        return g.Where(cond, a, b)
    f32 = [g.Cast(t, to=TensorProto.FLOAT) for t in (a, b)]
    return g.Cast(g.Where(cond, *f32), to=TensorProto.BFLOAT16)


def keep(g: Grad, cond: str, dy: str, like: str) -> str:
    """`dy` where `cond` holds, else 0 (a Where, not a multiply by the mask: inf/nan outside stay out)."""
    return where(g, cond, dy, g.const(0.0, like=like), like)


def compare(g: Grad, op: str, a: str, b: str, like: str | None = None) -> str:
    """GreaterOrEqual/LessOrEqual of tensors of `like`'s dtype (default a's), through float32 for
    bfloat16 below opset 16 (exact, and NaN still compares false, unlike Not(Less))."""
    if not _via_float(g, op, like or a):
        return g.op(op, a, b)
    return g.op(op, *(g.Cast(t, to=TensorProto.FLOAT) for t in (a, b)))



def _sq(g: Grad, x: str) -> str:
    return g.Mul(x, x)


def _each_input(g: Grad, grad_of: dict[int, str] | str) -> Grads:
    """Per-input gradients of a variadic broadcasting op: `grad_of` (one for all, or per input) summed
    down to each needed input's shape."""
    out: list[str | None] = []
    for i in range(g.n_inputs):
        x = g.I(i)
        if x is None or not g.needs(i):
            out.append(None)
            continue
        grad = grad_of if isinstance(grad_of, str) else grad_of[i]
        out.append(g.unbroadcast(grad, like=x))
    return tuple(out)


# --- arithmetic ---------------------------------------------------------------------------------

@rule("Identity", since=13)
def identity(g: Grad) -> Grads:
    return (g.GO(0),)


@rule("Add", since=13)
def add(g: Grad) -> Grads:
    dy = g.GO(0)
    return (g.unbroadcast(dy, like=g.I(0)) if g.needs(0) else None,
            g.unbroadcast(dy, like=g.I(1)) if g.needs(1) else None)


@rule("Sub", since=13)
def sub(g: Grad) -> Grads:
    dy = g.GO(0)
    return (g.unbroadcast(dy, like=g.I(0)) if g.needs(0) else None,
            g.unbroadcast(g.Neg(dy), like=g.I(1)) if g.needs(1) else None)


@rule("Mul", since=13)
def mul(g: Grad) -> Grads:
    a, b, dy = g.I(0), g.I(1), g.GO(0)
    return (g.unbroadcast(g.Mul(dy, b), like=a) if g.needs(0) else None,
            g.unbroadcast(g.Mul(dy, a), like=b) if g.needs(1) else None)


@rule("Div", since=13)
def div(g: Grad) -> Grads:
    a, b, y, dy = g.I(0), g.I(1), g.O(0), g.GO(0)
    da = g.Div(dy, b) if g.needs(0) else None
    # d(a/b)/db = -y/b: reads the output instead of squaring b
    db = g.unbroadcast(g.Neg(g.Mul(dy, g.Div(y, b))), like=b) if g.needs(1) else None
    return (g.unbroadcast(da, like=a) if da is not None else None, db)


@rule("Mod", since=13)
def mod(g: Grad) -> Grads:
    """a - n*b with n = trunc(a/b) (fmod=1, like torch.fmod) or, for floats from opset 28, floor(a/b) (fmod=0, like
    torch.remainder); before 28 a float Mod must have fmod=1."""
    floor = g.attr("fmod", 0) != 1
    if floor and g.opset < 28:
        g.fail("integer Mod (fmod=0) carries no gradient; a float Mod must have fmod=1 before opset 28")
    a, b, dy = g.I(0), g.I(1), g.GO(0)
    da = g.unbroadcast(dy, like=a) if g.needs(0) else None
    if not g.needs(1):
        return (da, None)
    q = g.Div(a, b)
    n = g.Floor(q) if floor else g.Sub(q, g.Mod(q, g.const(1.0, like=q), fmod=1))  # trunc(q) = q - fmod(q, 1)
    return (da, g.unbroadcast(g.Neg(g.Mul(dy, n)), like=b))


@rule("Neg", since=13)
def neg(g: Grad) -> Grads:
    return (g.Neg(g.GO(0)),)


@rule("Sum", since=13)
def sum_(g: Grad) -> Grads:
    return _each_input(g, g.GO(0))


@rule("Mean", since=13)
def mean(g: Grad) -> Grads:
    return _each_input(g, g.Div(g.GO(0), g.const(float(g.n_inputs), like=g.O(0))))


@rule("Abs", since=13)
def abs_(g: Grad) -> Grads:
    # Sign(0) = 0: torch's subgradient at the kink
    return (g.Mul(g.GO(0), g.Sign(g.I(0))),)


# --- exponentials and powers ----------------------------------------------------------------------

@rule("Exp", since=13)
def exp(g: Grad) -> Grads:
    return (g.Mul(g.GO(0), g.O(0)),)


@rule("Log", since=13)
def log(g: Grad) -> Grads:
    return (g.Div(g.GO(0), g.I(0)),)


@rule("Sqrt", since=13)
def sqrt(g: Grad) -> Grads:
    y = g.O(0)
    return (g.Div(g.GO(0), g.Add(y, y)),)


@rule("Reciprocal", since=13)
def reciprocal(g: Grad) -> Grads:
    return (g.Neg(g.Mul(g.GO(0), _sq(g, g.O(0)))),)


@rule("Pow", since=13)
def pow_(g: Grad) -> Grads:
    """Like torch: d/da = b*a^(b-1), 0 where b == 0; d/db = y*log(a), 0 where a == 0 and b >= 0."""
    a, b, y, dy = g.I(0), g.I(1), g.O(0), g.GO(0)
    da = db = None
    if g.needs(0):
        da = g.unbroadcast(_pow_base_grad(g, a, b, dy), like=a)
    if g.needs(1):
        zero = g.const(0.0, like=a)
        base_zero = g.And(g.Equal(a, zero), compare(g, "GreaterOrEqual", b, g.const(0.0, like=b)))
        dlog = keep(g, g.Not(base_zero), g.Mul(y, g.Log(a)), like=a)
        db = g.unbroadcast(g.cast_like(g.Mul(dy, dlog), like=b, x_like=a), like=b)
    return (da, db)


def _pow_base_grad(g: Grad, a: str, b: str, dy: str) -> str:
    c = None if g.needs(1) else g.const_input(1)  # a trained exponent changes: never bake its value in
    if c is not None and c.size == 1 and (g.rank(a) or 0) >= c.ndim:  # constant scalar exponent: x**2, x**0.5
        c = float(c.reshape(()))
        if c == 0:
            return g.zeros_like(a)
        if c == 1:
            return dy
        coef = g.Mul(a, g.const(2.0, like=a)) if c == 2 else g.Mul(g.Pow(a, g.const(c - 1, like=a)),
                                                                   g.const(c, like=a))
        return g.Mul(dy, coef)
    # b - 1 stays in the exponent's own type (int, or float where Pow-13 takes no bfloat16 exponent)
    full = g.Mul(dy, g.Mul(g.cast_like(b, like=a), g.Pow(a, g.Sub(b, g.const(1, like=b)))))
    return keep(g, g.Not(g.Equal(b, g.const(0, like=b))), full, like=a)


@rule("Erf", since=13)
def erf(g: Grad) -> Grads:
    x = g.I(0)
    return (g.Mul(g.GO(0), g.Mul(g.Exp(g.Neg(_sq(g, x))), g.const(2 / math.sqrt(math.pi), like=x))),)


# --- trigonometric and hyperbolic --------------------------------------------------------------------

def _one_minus_sq(g: Grad, x: str) -> str:
    return g.Sub(g.const(1.0, like=x), _sq(g, x))


def _one_plus_sq(g: Grad, x: str) -> str:
    return g.Add(_sq(g, x), g.const(1.0, like=x))


@rule("Sin", since=13)
def sin(g: Grad) -> Grads:
    return (g.Mul(g.GO(0), g.Cos(g.I(0))),)


@rule("Cos", since=13)
def cos(g: Grad) -> Grads:
    return (g.Neg(g.Mul(g.GO(0), g.Sin(g.I(0)))),)


@rule("Tan", since=13)
def tan(g: Grad) -> Grads:
    return (g.Mul(g.GO(0), _one_plus_sq(g, g.O(0))),)


@rule("Sinh", since=13)
def sinh(g: Grad) -> Grads:
    return (g.Mul(g.GO(0), g.Cosh(g.I(0))),)


@rule("Cosh", since=13)
def cosh(g: Grad) -> Grads:
    return (g.Mul(g.GO(0), g.Sinh(g.I(0))),)


@rule("Asin", since=13)
def asin(g: Grad) -> Grads:
    return (g.Div(g.GO(0), g.Sqrt(_one_minus_sq(g, g.I(0)))),)


@rule("Acos", since=13)
def acos(g: Grad) -> Grads:
    return (g.Neg(g.Div(g.GO(0), g.Sqrt(_one_minus_sq(g, g.I(0))))),)


@rule("Atan", since=13)
def atan(g: Grad) -> Grads:
    return (g.Div(g.GO(0), _one_plus_sq(g, g.I(0))),)


@rule("Atanh", since=13)
def atanh(g: Grad) -> Grads:
    return (g.Div(g.GO(0), _one_minus_sq(g, g.I(0))),)


@rule("Asinh", since=13)
def asinh(g: Grad) -> Grads:
    return (g.Div(g.GO(0), g.Sqrt(_one_plus_sq(g, g.I(0)))),)


@rule("Acosh", since=13)
def acosh(g: Grad) -> Grads:
    x = g.I(0)
    return (g.Div(g.GO(0), g.Sqrt(g.Sub(_sq(g, x), g.const(1.0, like=x)))),)


# --- selections -------------------------------------------------------------------------------

def _extremum(g: Grad, beaten: str) -> Grads:
    """Min/Max: the gradient goes to the inputs equal to the result, split equally among ties.

    Two inputs follow torch.maximum/minimum exactly (NaN included) and compare the inputs, so backward keeps
    no copy of the output; more inputs follow amax/amin over the stacked inputs. `beaten` is the comparison
    under which the first input loses (Less for Max)."""
    y, dy = g.O(0), g.GO(0)
    xs = [g.I(i) for i in range(g.n_inputs)]
    if len(xs) == 1:
        return (dy,)
    zero = g.const(0.0, like=y)
    if len(xs) == 2:
        a, b = xs
        half = where(g, g.Equal(a, b), g.Mul(dy, g.const(0.5, like=y)), dy, like=y)
        pairs = {0: (a, b), 1: (b, a)}
        return _each_input(g, {i: where(g, g.op(beaten, *pairs[i]), zero, half, like=y) for i in (0, 1) if g.needs(i)})
    hits = [g.Equal(x, y) for x in xs]
    share = g.Div(dy, g.Sum(*(g.cast_like(h, like=y) for h in hits)))
    return _each_input(g, {i: keep(g, h, share, like=y) for i, h in enumerate(hits) if g.needs(i)})


@rule("Max", since=13)
def max_(g: Grad) -> Grads:
    return _extremum(g, "Less")


@rule("Min", since=13)
def min_(g: Grad) -> Grads:
    return _extremum(g, "Greater")


@rule("Clip", since=13)
def clip(g: Grad) -> Grads:
    """Like torch.clamp: x's gradient passes where min <= x <= max, boundaries included; a bound that gets a
    gradient (a learnable clipping level) takes dY where x is past it, summed: min's where x < min while
    min < max, max's where x > max or max < min (torch's, where min > max clamps everything to max)."""
    x, lo, hi, dy = g.I(0), g.I(1), g.I(2), g.GO(0)
    dx = None
    if g.needs(0):
        masks = [compare(g, op, x, bound) for op, bound in (("GreaterOrEqual", lo), ("LessOrEqual", hi))
                 if bound is not None]
        dx = dy if not masks else keep(g, masks[0] if len(masks) == 1 else g.And(*masks), dy, like=x)
    dlo = dhi = None
    if lo is not None and g.needs(1):
        below = g.Less(x, lo)
        below = g.And(below, g.Less(lo, hi)) if hi is not None else below
        dlo = g.unbroadcast(keep(g, below, dy, like=x), like=lo)
    if hi is not None and g.needs(2):
        above = g.Greater(x, hi)
        above = g.Or(above, g.Less(hi, lo)) if lo is not None else above
        dhi = g.unbroadcast(keep(g, above, dy, like=x), like=hi)
    return (dx, dlo, dhi)


@rule("Where", since=13, nondiff=(0,))
def where_(g: Grad) -> Grads:
    c, dy = g.I(0), g.GO(0)
    zero = g.const(0.0, like=g.O(0))
    return (None,
            g.unbroadcast(g.Where(c, dy, zero), like=g.I(1)) if g.needs(1) else None,
            g.unbroadcast(g.Where(c, zero, dy), like=g.I(2)) if g.needs(2) else None)


# --- type conversion -------------------------------------------------------------------------------

@rule("Cast", since=13)
def cast(g: Grad) -> Grads:
    """Float to float only (reachability stops at integer ends): the gradient is cast back."""
    return (g.cast_like(g.GO(0), like=g.I(0), x_like=g.O(0)),)


@rule("CastLike", since=15, nondiff=(1,))
def cast_like(g: Grad) -> Grads:
    return (*cast(g), None)
