"""Spectral ops: DFT, STFT.

The DFT is linear: Y = F X along one axis, with F_kn = exp(-2 pi i k n / L) over the transform's length L, and the
inverse (1 / L) F^H. Its adjoint over the real and imaginary parts is then the other transform with the other scale:
F^H dY = L * IDFT(dY) = conj(F conj(dY)), and (1 / L) F dY = DFT(dY) / L (forward DFTs only: an inverse one scales by
1 / L, which onnxruntime computes in float32 off powers of two). What sits around F adjoins as usual: a real input
(its imaginary part zero) takes the real part, a one-sided output (the first L // 2 + 1 bins) is zero-padded back to
L bins, and a dft_length that padded or truncated the signal crops or pads the gradient back. The inverse one-sided
transform (IRFFT) is real-linear only: its adjoint is the one-sided forward transform, weighted.

The STFT is that transform over windowed frames of the signal, x[f s + n] w[n] for frame f: the adjoint takes the
DFT's adjoint of each frame, weights it by the window, and sums it back where frames overlap.
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


def _parts(g: Grad, x: str, r: int) -> tuple[int | None, str]:
    """x's last dim, 1 (real) or 2 (complex): as an int where the graph says (None where it does not), and as an
    int64 [1] tensor, read at run time where it does not (a transform of a transform's output: rfft2)."""
    shape = g.info(x).shape
    last = shape[-1] if shape is not None and isinstance(shape[-1], int) else None
    if last not in (None, 1, 2):
        g.fail("the last dim (1: real, 2: complex) must be 1 or 2")
    return last, g.ints([last]) if last is not None else g.Gather(g.shape_of(x), g.ints([r - 1]))


def _as_parts(g: Grad, t: str, last: int | None, parts: str, r: int) -> str:
    """A complex gradient t ([..., 2]) as the input's parts: its real part for a real input."""
    return t if last == 2 else g.Slice(t, g.ints([0]), parts, g.ints([r - 1]))


def _irfft_adjoint(g: Grad, r: int, axis: int | None, axes: str, last: int | None, parts: str) -> str:
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
    return _as_parts(g, t, last, parts, r)


def _forward_dft(g: Grad, t: str, axis: int | None, axes: str) -> str:
    return g.DFT(t, None, g.Reshape(axes, g.ints([]))) if g.opset >= 20 else g.DFT(t, axis=axis)


def _kept_bins(g: Grad, length: str) -> str:
    """The bins a one-sided transform of `length` (int64 [1]) samples keeps: length // 2 + 1."""
    return g.Add(g.Div(length, g.ints([2])), g.ints([1]))


def _forward_adjoint(g: Grad, dy: str, like: str, r: int, axis: int | None, axes: str, length: str,
                     onesided: bool) -> str:
    """F^H dY for a forward transform of `length` samples along the axis, complex ([..., 2]): a one-sided output's
    dropped bins come back as zeros (they get no gradient), then conj(F conj(dY)), not onnxruntime's inverse DFT,
    which scales by 1 / L in float32 off powers of two."""
    if onesided:
        dy = _pad_end(g, dy, r, axis, axes, g.Sub(length, _kept_bins(g, length)))
    conjugate = g.const(np.array([1.0, -1.0]), like=like)
    return g.Mul(_forward_dft(g, g.Mul(dy, conjugate), axis, axes), conjugate)


@rule("DFT", since=17, nondiff=(1, 2))
def dft(g: Grad):
    x, dy = g.I(0), g.GO(0)
    r = g.require_rank(x)
    last, parts = _parts(g, x, r)
    inverse, onesided = bool(g.attr("inverse", 0)), bool(g.attr("onesided", 0))
    axis, axes = _axis(g, r)
    if inverse and onesided:
        return (_irfft_adjoint(g, r, axis, axes, last, parts), None, None)
    n = g.Gather(g.shape_of(x), axes)
    length = n if g.I(1) is None else g.Reshape(g.Cast(g.I(1), to=TensorProto.INT64), g.ints([1]))
    if inverse:  # (one-sided inverses returned above)
        t = g.Div(_forward_dft(g, dy, axis, axes), g.Cast(length, to=g.dtype(x)))
    else:
        t = _forward_adjoint(g, dy, x, r, axis, axes, length, onesided)
    if g.I(1) is not None:  # the signal was zero-padded or truncated to L: back to its n
        t = _pad_end(g, t, r, axis, axes, g.Sub(n, length))
    return (_as_parts(g, t, last, parts, r), None, None)


@rule("STFT", since=17, nondiff=(1, 3))
def stft(g: Grad):
    """Y[b, f, k] = sum_n x[b, f s + n] w[n] exp(-2 pi i k n / N) for N = frame_length (the window's length, or
    the signal's without either): each frame's gradient is the DFT's adjoint (`_forward_adjoint`) along n; x's is
    that times w, scatter-added back at f s + n (overlapping frames sum; samples past the last frame get none);
    w's is it times the frames, summed over the batch, the frames and a complex signal's parts."""
    x, window = g.I(0), g.I(2)
    r = g.require_rank(x)
    if r not in (2, 3):
        g.fail("the signal must be [batch, length, 1 or 2], or [batch, length] (real, as onnxruntime reads it)")
    int64 = TensorProto.INT64
    last, parts = _parts(g, x, r) if r == 3 else (1, g.ints([1]))
    if g.I(3) is not None:
        length = g.Reshape(g.Cast(g.I(3), to=int64), g.ints([1]))
    else:
        length = g.shape_of(window) if window is not None else g.Gather(g.shape_of(x), g.ints([1]))
    step = g.Reshape(g.Cast(g.I(1), to=int64), g.ints([]))
    frames = g.Gather(g.shape_of(g.O(0)), g.ints(1))
    starts = g.Mul(g.Range(g.ints(0), frames, g.ints(1)), step)
    positions = g.Add(g.Unsqueeze(starts, g.ints([1])),
                      g.Unsqueeze(g.Range(g.ints(0), g.Reshape(length, g.ints([])), g.ints(1)), g.ints([0])))
    t = _forward_adjoint(g, g.GO(0), x, 4, 2, g.ints([2]), length, bool(g.attr("onesided", 1)))
    t = _as_parts(g, t, last, parts, 4)
    dx = dw = None
    if g.needs(0):
        spread = t if window is None else g.Mul(t, g.Unsqueeze(window, g.ints([1])))
        updates = g.Reshape(spread, g.Concat(g.ints([0, -1]), parts, axis=0))
        at = g.Expand(g.Reshape(positions, g.ints([1, -1, 1])), g.shape_of(updates))
        zeros = g.zeros_like(x) if r == 3 else g.Unsqueeze(g.zeros_like(x), g.ints([2]))
        dx = g.ScatterElements(zeros, at, updates, axis=1, reduction="add")
        dx = dx if r == 3 else g.Squeeze(dx, g.ints([2]))
    if window is not None and g.needs(2):
        framed = g.Gather(x, positions, axis=1)  # [batch, frames, N, parts]
        framed = framed if r == 3 else g.Unsqueeze(framed, g.ints([3]))
        dw = g.ReduceSum(g.Mul(t, framed), g.ints([0, 1, 3]), keepdims=0)
    return (dx, None, dw, None)
