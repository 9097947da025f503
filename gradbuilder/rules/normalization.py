"""Normalizations and pools beyond nn's CNN layers: LRN, MeanVarianceNormalization, RMSNormalization, LpPool,
GlobalLpPool, and Shrink.

Statistics are recomputed from X in backward (X is read anyway); the pools read their output Y.
"""

from __future__ import annotations

import numpy as np

from .context import Grad
from .elementwise import keep
from .nn import node_window, spread_windows, window_tails
from .registry import rule


# --- LRN -------------------------------------------------------------------------------------------
def _channel_window_sum(g: Grad, t: str, size: int, before: int, rank: int) -> str:
    """s[n, c] = sum of t[n, c'] for c - before <= c' <= c - before + size - 1 (zero outside): a Conv with a
    ones kernel along channels, over t viewed as [N, 1, C, spatial...]."""
    spatial = rank - 2
    kernel = g.const(np.ones([1, 1, size] + [1] * spatial), like=g.I(0))
    summed = g.Conv(g.unsqueeze(t, [1]), kernel, kernel_shape=[size] + [1] * spatial,
                    pads=[before] + [0] * spatial + [size - 1 - before] + [0] * spatial)
    return g.squeeze(summed, [1])


@rule("LRN", since=13)
def lrn(g: Grad):
    """y = x * d^-beta with d = bias + alpha/size * (sum of x^2 over the channel window
    [c - (size-1)//2, c + ceil((size-1)/2)]); dX = dY d^-beta - 2 alpha beta/size x W^T(dY x d^-beta-1),
    where W^T sums over the mirrored window."""
    x, dy = g.I(0), g.GO(0)
    rank = g.require_rank(x)
    size = int(g.attr("size"))
    alpha, beta, bias = float(g.attr("alpha", 1e-4)), float(g.attr("beta", 0.75)), float(g.attr("bias", 1.0))
    lo = (size - 1) // 2
    d = g.Add(g.Mul(_channel_window_sum(g, g.Mul(x, x), size, lo, rank), g.const(alpha / size, like=x)),
              g.const(bias, like=x))
    scale = g.Pow(d, g.const(-beta, like=x))
    direct = g.Mul(dy, scale)
    back = _channel_window_sum(g, g.Div(g.Mul(direct, x), d), size, size - 1 - lo, rank)
    return (g.Sub(direct, g.Mul(g.Mul(x, back), g.const(2.0 * alpha * beta / size, like=x))),)


# --- mean/variance and RMS normalizations -----------------------------------------------------------------
@rule("MeanVarianceNormalization", since=13)
def mean_variance_normalization(g: Grad):
    """y = (x - m) / (sigma + 1e-9) over `axes` (ONNX's function body: sigma = sqrt(E[x^2] - m^2)), so
    dX = (dY - mean(dY)) / s - (x - m) mean(dY (x - m)) / (sigma s^2) with s = sigma + 1e-9."""
    x, dy = g.I(0), g.GO(0)
    axes = [int(a) for a in g.attr("axes", [0, 2, 3])]
    centered = g.Sub(x, g.reduce("ReduceMean", x, axes))
    sigma = g.Sqrt(g.reduce("ReduceMean", g.Mul(centered, centered), axes))
    s = g.Add(sigma, g.const(1e-9, like=x))
    direct = g.Div(g.Sub(dy, g.reduce("ReduceMean", dy, axes)), s)
    cross = g.Div(g.reduce("ReduceMean", g.Mul(dy, centered), axes), g.Mul(sigma, g.Mul(s, s)))
    return (g.Sub(direct, g.Mul(centered, cross)),)


@rule("RMSNormalization", since=23)
def rms_normalization(g: Grad):
    """y = x r * scale with r = 1/sqrt(mean(x^2) + eps) over axes [axis, rank):
    dX = r (dxhat - xhat mean(dxhat xhat)) for dxhat = dY * scale, xhat = x r."""
    x, scale, dy = g.I(0), g.I(1), g.GO(0)
    rank = g.require_rank(x)
    axes = list(range(g.axis(g.attr("axis", -1), rank), rank))
    inv = g.Reciprocal(g.Sqrt(g.Add(g.reduce("ReduceMean", g.Mul(x, x), axes),
                                    g.const(float(g.attr("epsilon", 1e-5)), like=x))))
    xhat = g.Mul(x, inv)
    dx = dscale = None
    if g.needs(0):
        dxhat = g.Mul(dy, scale)
        dx = g.Mul(inv, g.Sub(dxhat, g.Mul(xhat, g.reduce("ReduceMean", g.Mul(dxhat, xhat), axes))))
    if g.needs(1):
        dscale = g.unbroadcast(g.Mul(dy, xhat), like=scale)
    return (dx, dscale)


# --- Lp pools ----------------------------------------------------------------------------------------

def _lp_factor(g: Grad, x: str, y: str, dy: str, p: int) -> tuple[str, str]:
    """y = (sum |x|^p)^(1/p): dX = sign(x) |x|^(p-1) * spread(dY / y^(p-1)). Returns (the factor of x,
    dY / y^(p-1)), the latter 0 where y is 0 (every |x| in the window 0: the subgradient 0)."""
    if p == 1:
        return g.Sign(x), dy
    zero = g.const(0.0, like=x)
    power = y if p == 2 else g.Pow(y, g.const(float(p - 1), like=x))
    safe = g.Where(g.Equal(y, zero), g.const(1.0, like=x), power)
    per_output = keep(g, g.Not(g.Equal(y, zero)), g.Div(dy, safe), like=x)
    factor = x if p == 2 else g.Mul(g.Sign(x), g.Pow(g.Abs(x), g.const(float(p - 1), like=x)))
    return factor, per_output


def _p(g: Grad) -> int:
    p = int(g.attr("p", 2))
    if p < 1:
        g.fail(f"p must be at least 1, not {p}")
    return p


@rule("LpPool", since=13)
def lp_pool(g: Grad):
    """Each window's Lp norm: dY / y^(p-1) spread over the window, times sign(x)|x|^(p-1)."""
    x, y, dy = g.I(0), g.O(0), g.GO(0)
    win = node_window(g, x, list(g.attr("kernel_shape")))
    tails = window_tails(g, win, x, bool(g.attr("ceil_mode", 0)))
    factor, per_output = _lp_factor(g, x, y, dy, _p(g))
    return (g.Mul(factor, spread_windows(g, per_output, x, win, tails)),)


@rule("GlobalLpPool", since=13)
def global_lp_pool(g: Grad):
    x, y, dy = g.I(0), g.O(0), g.GO(0)
    factor, per_output = _lp_factor(g, x, y, dy, _p(g))
    return (g.Mul(factor, per_output),)


# --- Shrink ----------------------------------------------------------------------------------------
@rule("Shrink", since=13)
def shrink(g: Grad):
    """dY where |x| > lambd (x < -lambd or x > lambd), else 0: the mask is computed in the forward part,
    so backward stashes one byte per element instead of x."""
    x = g.I(0)
    lambd = float(g.attr("lambd", 0.5))
    outside = g.Or(g.Less(x, g.const(-lambd, like=x), forward=True),
                   g.Greater(x, g.const(lambd, like=x), forward=True), forward=True)
    return (keep(g, outside, g.GO(0), like=x),)
