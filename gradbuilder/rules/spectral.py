"""Spectral ops: DFT.

The DFT is linear: Y = F X along one axis, with F_kn = exp(-2 pi i k n / L) over the transform's length L, and the
inverse (1 / L) F^H. Its adjoint over the real and imaginary parts is then the other transform with the other scale:
F^H dY = L * IDFT(dY) = conj(F conj(dY)), and (1 / L) F dY = DFT(dY) / L (forward DFTs only: an inverse one scales by
1 / L, which onnxruntime computes in float32 off powers of two). What sits around F adjoins as usual: a real input
(its imaginary part zero) takes the real part, a one-sided output (the first L // 2 + 1 bins) is zero-padded back to
L bins, and a dft_length that padded or truncated the signal crops or pads the gradient back. The inverse one-sided
transform (IRFFT) is real-linear only: its adjoint is the one-sided forward transform, weighted.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .context import Grad
from .registry import rule


def _axis(g: Grad, r: int) -> tuple[int | None, str]:
    """(the transformed axis when static, else None; the axis as an int64 [1] tensor). Opset 20 made it an input
    (default -2), which a graph may feed at run time; before, an attribute (default 1)."""
    if g.opset >= 20 and g.I(2) is not None:
        given = g.const_input(2)
        if given is None:
            return None, g.Reshape(g.Cast(g.I(2), to=TensorProto.INT64), g.ints([1]))
        axis = int(given.ravel()[0])
    else:
        axis = -2 if g.opset >= 20 else int(g.attr("axis", 1))
    axis = axis + r if axis < 0 else axis
    if not 0 <= axis < r - 1:
        g.fail(f"axis {axis} is not a signal axis of a rank-{r} input")
    return axis, g.ints([axis])


def _pad_end(g: Grad, t: str, r: int, axis: int | None, axes: str, amount: str) -> str:
    """t zero-padded by `amount` (int64 [1]; negative crops) at the end of the axis."""
    if g.opset >= 18:
        return g.Pad(t, g.Concat(g.ints([0]), amount, axis=0), None, axes)
    assert axis is not None  # before opset 20 the axis is an attribute
    zeros = g.ints([0] * (r - 1 - axis))
    return g.Pad(t, g.Concat(g.ints([0] * (r + axis)), amount, zeros, axis=0))


def _irfft_adjoint(g: Grad, r: int, axis: int | None, axes: str) -> str:
    """The inverse one-sided transform (IRFFT) reads bins 0..L//2 of its input as a Hermitian spectrum of L real
    samples, ignoring the imaginary parts of bins 0 and L/2: y[t] = (1/L) sum_k c_k Re(X[k] e^(2 pi i k t / L)),
    c_k = 2 but 1 for those two. Its adjoint is the forward one-sided transform of dY times c_k / L: constants
    where the bins and L are known, else computed at run time from them (`irfft(X, n=x.shape[1])` over a length
    the graph leaves symbolic: GFNet's global filters). Known spectra of other than L//2 + 1 bins are refused:
    onnxruntime's kernel does not read them as numpy's irfft does."""
    x = g.I(0)
    shape = g.info(x).shape
    if axis is None or shape is None:
        g.fail("the inverse one-sided transform needs a static axis")
    bins = shape[axis]
    given = g.const_input(1) if g.I(1) is not None else None
    if given is not None:
        length = int(given.ravel()[0])
    elif g.I(1) is None and isinstance(bins, int):
        length = 2 * (bins - 1)
    else:
        length = None
    if isinstance(bins, int) and length is not None:
        kept = length // 2 + 1
        if kept != bins:  # onnxruntime then neither pads nor crops the spectrum as numpy's irfft does
            g.fail(f"an inverse one-sided transform of {bins} bins to {length} samples (it reads {kept} bins) has "
                   "no gradient rule; slice or pad the spectrum to dft_length // 2 + 1 bins first")
        weights = np.full(kept, 2.0 / length)
        weights[0] = 1.0 / length
        if length % 2 == 0:
            weights[-1] = 1.0 / length
        weights = g.const(weights.reshape(kept, *[1] * (r - 1 - axis)), like=x)
    else:
        n = g.Gather(g.shape_of(x), g.ints(axis))
        samples = g.Mul(g.Sub(n, g.ints(1)), g.ints(2)) if g.I(1) is None else g.Reshape(
            g.Cast(g.I(1), to=TensorProto.INT64), g.ints([]))
        k = g.Range(g.ints(0), n, g.ints(1))
        edge = g.Or(g.Equal(k, g.ints(0)), g.Equal(g.Mul(k, g.ints(2)), samples))  # bins 0 and L/2
        weights = g.Div(g.Where(edge, g.const(1.0, like=x), g.const(2.0, like=x)), g.Cast(samples, to=g.dtype(x)))
        weights = g.Reshape(weights, g.ints([-1, *[1] * (r - 1 - axis)]))
    t = g.DFT(g.GO(0), None, g.Reshape(axes, g.ints([])), onesided=1) if g.opset >= 20 else g.DFT(
        g.GO(0), axis=axis, onesided=1)
    t = g.Mul(t, weights)
    return g.Slice(t, g.ints([0]), g.ints([1]), g.ints([r - 1])) if shape[-1] == 1 else t


@rule("DFT", since=17, nondiff=(1, 2))
def dft(g: Grad):
    x, dy = g.I(0), g.GO(0)
    r = g.require_rank(x)
    shape = g.info(x).shape
    if shape is None or shape[-1] not in (1, 2):
        g.fail("the last dim (1: real, 2: complex) must be static")
    inverse, onesided = bool(g.attr("inverse", 0)), bool(g.attr("onesided", 0))
    axis, axes = _axis(g, r)
    if inverse and onesided:
        return (_irfft_adjoint(g, r, axis, axes), None, None)
    n = g.Gather(g.shape_of(x), axes)
    length = n if g.I(1) is None else g.Reshape(g.Cast(g.I(1), to=TensorProto.INT64), g.ints([1]))
    t = dy
    if onesided:  # the bins past L // 2 were dropped: they get no gradient
        kept = g.Add(g.Div(length, g.ints([2])), g.ints([1]))
        t = _pad_end(g, t, r, axis, axes, g.Sub(length, kept))
    def forward_dft(t: str) -> str:
        return g.DFT(t, None, g.Reshape(axes, g.ints([]))) if g.opset >= 20 else g.DFT(t, axis=axis)

    if inverse:
        t = g.Div(forward_dft(t), g.Cast(length, to=g.dtype(x)))
    else:  # conjugates instead of onnxruntime's inverse DFT, which scales by 1 / L in float32 off powers of two
        conjugate = g.const(np.array([1.0, -1.0]), like=x)
        t = g.Mul(forward_dft(g.Mul(t, conjugate)), conjugate)
    if g.I(1) is not None:  # the signal was zero-padded or truncated to L: back to its n
        t = _pad_end(g, t, r, axis, axes, g.Sub(n, length))
    if shape[-1] == 1:  # a real input: the real part
        t = g.Slice(t, g.ints([0]), g.ints([1]), g.ints([r - 1]))
    return (t, None, None)
