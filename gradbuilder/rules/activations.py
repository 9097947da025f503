"""Activation functions: one small function per op, each matching torch's gradient at the kinks.

Where the derivative is a function of the output (Relu's mask, Sigmoid, Tanh, Softmax, the ELU family
with a sign-preserving slope), rules read the output, so backward stashes the activation the next layer
keeps anyway rather than the pre-activation too.
"""

from __future__ import annotations

import math

from .context import Grad
from .elementwise import Grads, keep, where
from .linalg import MICROSOFT
from .registry import rule


def _positive(g: Grad, t: str) -> str:
    return g.Greater(t, g.const(0.0, like=t))


def _slope_where(g: Grad, mask: str, dy: str, slope: str, like: str) -> str:
    """dy where `mask` holds, dy * slope elsewhere."""
    return where(g, mask, dy, g.Mul(dy, slope), like)


@rule("Relu", since=13)
def relu(g: Grad) -> Grads:
    y = g.O(0)
    return (keep(g, _positive(g, y), g.GO(0), like=y),)


@rule("LeakyRelu", since=13)
def leaky_relu(g: Grad) -> Grads:
    """x > 0 passes dy, else alpha*dy (alpha at 0, like torch); y > 0 iff x > 0 when alpha > 0."""
    x, y = g.I(0), g.O(0)
    alpha = g.attr("alpha", 0.01)
    probe = y if alpha > 0 else x
    return (_slope_where(g, _positive(g, probe), g.GO(0), g.const(alpha, like=x), like=x),)


@rule("PRelu", since=13)
def prelu(g: Grad) -> Grads:
    """Like torch: dx = dy where x > 0 else slope*dy; dslope = dy*min(x, 0), summed to the slope's shape."""
    x, s, dy = g.I(0), g.I(1), g.GO(0)
    dx = _slope_where(g, _positive(g, x), dy, s, like=x) if g.needs(0) else None
    ds = g.unbroadcast(g.Mul(dy, g.Min(x, g.const(0.0, like=x))), like=s) if g.needs(1) else None
    return (dx, ds)


@rule("ThresholdedRelu", since=13)
def thresholded_relu(g: Grad) -> Grads:
    """dy where x > alpha; for alpha >= 0 that is exactly where y > 0."""
    x, y = g.I(0), g.O(0)
    alpha = g.attr("alpha", 1.0)
    mask = _positive(g, y) if alpha >= 0 else g.Greater(x, g.const(alpha, like=x))
    return (keep(g, mask, g.GO(0), like=x),)


@rule("Sigmoid", since=13)
def sigmoid(g: Grad) -> Grads:
    y = g.O(0)
    return (g.Mul(g.GO(0), g.Mul(y, g.Sub(g.const(1.0, like=y), y))),)


@rule("Tanh", since=13)
def tanh(g: Grad) -> Grads:
    y = g.O(0)
    return (g.Mul(g.GO(0), g.Sub(g.const(1.0, like=y), g.Mul(y, y))),)


@rule("Softmax", since=13)
def softmax(g: Grad) -> Grads:
    """Opset 13+: normalised over one axis. dx = y * (dy - sum(dy * y, axis))."""
    y, dy = g.O(0), g.GO(0)
    axis = g.axis_of(g.attr("axis", -1), y)
    return (g.Mul(y, g.Sub(dy, g.reduce_sum(g.Mul(dy, y), [axis]))),)


@rule("LogSoftmax", since=13)
def log_softmax(g: Grad) -> Grads:
    """dx = dy - exp(y) * sum(dy, axis)."""
    y, dy = g.O(0), g.GO(0)
    axis = g.axis_of(g.attr("axis", -1), y)
    return (g.Sub(dy, g.Mul(g.Exp(y), g.reduce_sum(dy, [axis]))),)


GELU_BETA, GELU_KAPPA = math.sqrt(2 / math.pi), 0.044715
"""The tanh form's constants: 0.5 x (1 + tanh(beta (x + kappa x^3)))."""


def _gelu_erf(g: Grad, x: str, dy: str) -> str:
    """dy * (cdf(x) + x pdf(x)): torch's GeluBackward for approximate='none'."""
    def c(v: float) -> str:
        return g.const(v, like=x)

    cdf = g.Mul(c(0.5), g.Add(c(1.0), g.Erf(g.Mul(x, c(math.sqrt(0.5))))))
    pdf = g.Mul(c(1 / math.sqrt(2 * math.pi)), g.Exp(g.Mul(g.Mul(x, x), c(-0.5))))
    return g.Mul(dy, g.Add(cdf, g.Mul(x, pdf)))


def _gelu_tanh(g: Grad, x: str, dy: str) -> str:
    """torch's GeluBackward for approximate='tanh', 0.5 (1 + t) + 0.5 x (1 - t^2) beta (1 + 3 kappa x^2) with
    t = tanh(beta (x + kappa x^3)), factored as (1 + t) (1/2 + (1 - t) w), w = x (beta/2 + 3/2 beta kappa x^2):
    14 elementwise passes."""
    def c(v: float) -> str:
        return g.const(v, like=x)

    beta, kappa = GELU_BETA, GELU_KAPPA
    x_sq = g.Mul(x, x)
    t = g.Tanh(g.Mul(x, g.Add(g.Mul(x_sq, c(beta * kappa)), c(beta))))
    w = g.Mul(x, g.Add(g.Mul(x_sq, c(1.5 * beta * kappa)), c(0.5 * beta)))
    slope = g.Mul(g.Add(c(1.0), t), g.Add(g.Mul(w, g.Sub(c(1.0), t)), c(0.5)))
    return g.Mul(dy, slope)


@rule("Gelu", since=20)
def gelu(g: Grad) -> Grads:
    """torch's GeluBackward formulas for approximate='none' and 'tanh'."""
    form = _gelu_tanh if g.attr("approximate", "none") == "tanh" else _gelu_erf
    return (form(g, g.I(0), g.GO(0)),)


@rule("Gelu", domain=MICROSOFT)
def gelu_contrib(g: Grad) -> Grads:
    """onnxruntime's contrib Gelu (the erf form; the runtime writes torch's GELU as it, `runtime/gelus.py`)."""
    return (_gelu_erf(g, g.I(0), g.GO(0)),)


@rule("FastGelu", domain=MICROSOFT)
def fast_gelu(g: Grad) -> Grads:
    """Y = GELU_tanh(X + B), B optional: dB is dX summed over what B broadcasts along."""
    x, bias = g.I(0), g.I(1)
    dx = _gelu_tanh(g, x if bias is None else g.Add(x, bias), g.GO(0))
    return (dx, None if bias is None or not g.needs(1) else g.unbroadcast(dx, bias))


def _elu_like(g: Grad, scale: float, neg_coef: float, input_scale: float) -> Grads:
    """torch's elu_backward: y = scale*x for x > 0, neg_coef*(exp(input_scale*x) - 1) else.

    The negative-side slope is input_scale*(y + neg_coef), read from the output when y > 0 exactly
    where x > 0 (scale > 0, neg_coef >= 0); otherwise from the input. Where the slope is continuous at 0
    (input_scale*neg_coef == scale: ELU with alpha 1, CELU), it rises to `scale` at y = 0 and beyond on the
    positive side, so it is `Min(slope, scale)` with no mask: a Where there costs 4-7 ns an element on
    onnxruntime's CPU (ELU's gradient over [64, 16, 28, 28]: ~1 ms as a guarded select, 3 passes this way).
    """
    x, y, dy = g.I(0), g.O(0), g.GO(0)

    def c(v: float) -> str:
        return g.const(v, like=x)

    if scale > 0 and neg_coef >= 0:
        neg = g.Add(y, c(neg_coef))
        if math.isclose(input_scale * neg_coef, scale, rel_tol=1e-12):
            slope = neg if input_scale == 1 else g.Mul(neg, c(input_scale))
            return (g.Mul(dy, g.Min(slope, c(scale))),)
        mask = _positive(g, y)
    else:
        neg = g.Mul(c(neg_coef), g.Exp(g.Mul(x, c(input_scale))))
        mask = _positive(g, x)
    if input_scale != 1:
        neg = g.Mul(neg, c(input_scale))
    pos = dy if scale == 1 else g.Mul(dy, c(scale))
    return (g.Where(mask, pos, g.Mul(dy, neg)),)


@rule("Elu", since=13)
def elu(g: Grad) -> Grads:
    return _elu_like(g, 1.0, g.attr("alpha", 1.0), 1.0)


@rule("Selu", since=13)
def selu(g: Grad) -> Grads:
    alpha, gamma = g.attr("alpha", 1.67326319217681884765625), g.attr("gamma", 1.05070102214813232421875)
    return _elu_like(g, gamma, alpha * gamma, 1.0)


@rule("Celu", since=13)
def celu(g: Grad) -> Grads:
    alpha = g.attr("alpha", 1.0)
    return _elu_like(g, 1.0, alpha, 1.0 / alpha)


@rule("Softplus", since=13)
def softplus(g: Grad) -> Grads:
    """dy * sigmoid(x): from the input, since 1 - exp(-y) loses all precision where y is tiny."""
    return (g.Mul(g.GO(0), g.Sigmoid(g.I(0))),)


@rule("Softsign", since=13)
def softsign(g: Grad) -> Grads:
    """dy / (1 + |x|)^2: from the input, since (1 - |y|)^2 cancels where |x| is large."""
    x = g.I(0)
    d = g.Add(g.const(1.0, like=x), g.Abs(x))
    return (g.Div(g.GO(0), g.Mul(d, d)),)


@rule("HardSigmoid", since=13)
def hard_sigmoid(g: Grad) -> Grads:
    """alpha*dy strictly inside the linear part, 0 < y < 1 (torch's hardsigmoid: 0 at the corners)."""
    y, dy = g.O(0), g.GO(0)
    inside = g.And(_positive(g, y), g.Less(y, g.const(1.0, like=y)))
    return (keep(g, inside, g.Mul(dy, g.const(g.attr("alpha", 0.2), like=y)), like=y),)


@rule("HardSwish", since=14)
def hard_swish(g: Grad) -> Grads:
    """torch's hardswish_backward: 0 for x <= -3, dy*(x/3 + 1/2) for -3 < x < 3, dy for x >= 3; the factor as
    (x/3 + 1/2) [|x| < 3] + [x >= 3] in products of the masks, since onnxruntime's Where costs 0.6-7 ns an
    element (the two Wheres of a select took ~1.1 ms over [64, 16, 28, 28])."""
    x, dy = g.I(0), g.GO(0)

    def c(v: float) -> str:
        return g.const(v, like=x)

    def indicator(cond: str) -> str:
        return g.Cast(cond, to=g.dtype(x))

    ramp = g.Mul(g.Add(g.Div(x, c(3.0)), c(0.5)), indicator(g.Less(g.Abs(x), c(3.0))))
    return (g.Mul(dy, g.Add(ramp, indicator(g.GreaterOrEqual(x, c(3.0))))),)


@rule("Swish", since=24)
def swish(g: Grad) -> Grads:
    """y = x sigmoid(a x), onnx's SiLU with a slope (opset 24): dy s (1 + a x (1 - s)) with s = sigmoid(a x)."""
    x, dy = g.I(0), g.GO(0)
    alpha = g.const(float(g.attr("alpha", 1.0)), like=x)
    ax = g.Mul(alpha, x)
    s = g.Sigmoid(ax)
    return (g.Mul(dy, g.Mul(s, g.Add(g.const(1.0, like=x), g.Mul(ax, g.Sub(g.const(1.0, like=x), s))))),)


@rule("Mish", since=18)
def mish(g: Grad) -> Grads:
    """dy * (t + x*s*(1 - t^2)) with s = sigmoid(x) and t = tanh(softplus(x)) = s(2-s) / (s(2-s) + 2(1-s)^2):
    one transcendental, exact at both tails, and no Softplus (onnxruntime has no double kernel for it)."""
    x, dy = g.I(0), g.GO(0)
    one = g.const(1.0, like=x)
    s = g.Sigmoid(x)
    q = g.Sub(one, s)
    p = g.Mul(s, g.Add(one, q))
    t = g.Div(p, g.Add(p, g.Mul(g.const(2.0, like=x), g.Mul(q, q))))
    return (g.Mul(dy, g.Add(t, g.Mul(g.Mul(x, s), g.Sub(one, g.Mul(t, t))))),)
