"""The dynamo exporter's translations (its `custom_translation_table`) where onnxscript's compute something else than
torch, written in standard ONNX ops that gradbuilder's rules differentiate as torch's backward does.

onnxscript writes `max` / `min` along a dim as ReduceMax, whose rule splits a tie's gradient evenly (amax's; torch's
max gives it to the index it returns) and which keeps a NaN only where it comes first (torch's propagates it; so
for `amax` / `amin`), and `clamp` with tensor bounds (float64 clamps' bounds are 0-d tensors, `clamp_min` in torch's
margin losses) as Max / Min, which split a gradient at a bound reached (torch's gives it to x, bounds inclusive).
`xlogy` cut x's gradient at x = 0, `detach` was an Identity, and float64 `elu`, `selu`, `celu`, `leaky_relu` and
`log2` computed with float32 constants (or in float32); `bernoulli_(p)`, `normal_(mean, std)` and `uniform_(a, b)`
(which onnxscript lacks) are `torch_draws`' markers, as under the legacy exporter;
`conv3d` without a bias gave its Conv a bias of the wrong rank; a number minus an integer tensor failed torch's
decomposition (`rsub`), and a lazy conjugate's negated view (`_neg_view`: ifft of a real tensor) had no translation.
The legacy exporter's conversions of the same ops (`symbolics.py`) follow torch: these follow the same
conventions. (Attention under a mask emptying a row is mended before either exporter sees it, in `functions.py`.)
Where onnxscript's are right (scalar bounds: a Clip; float32 activations) they are kept."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradbuilder.stop_gradient import OP_TYPE as STOP_GRADIENT
from gradbuilder.stop_gradient import ZERO_GRADIENT
from gradbuilder.yield_op import DOMAIN

from . import torch_draws


@functools.cache
def _op() -> Any:
    """onnxscript's opset 18 (the dynamo exporter's least), imported when a dynamo export first needs it."""
    from onnxscript import opset18
    return opset18


def _tensor(array: np.ndarray) -> Any:
    from onnxscript import ir
    return _op().Constant(value=ir.tensor(array))


def _const(value: Any, like: Any) -> Any:
    """A constant of like's element type, written in it (not a float32 constant cast: 1e-8 off in float64)."""
    return _tensor(np.array(value, dtype=like.dtype.numpy()))


def _axes(*axes: int) -> Any:
    return _tensor(np.array(axes, dtype=np.int64))


def _floating(x: Any) -> bool:
    return x.dtype is not None and x.dtype.is_floating_point()


def _stop_gradient(x: Any, op_type: str = STOP_GRADIENT) -> Any:
    """x without a gradient (gradbuilder's StopGradient, which the session removes; ZeroGradient: of derivative
    zero, whose tensors get torch's zeros)."""
    from onnxscript import values
    return getattr(values.Opset(DOMAIN, 1), op_type)(x)


def _first_index(x: Any, axis: int, largest: bool) -> Any:
    """The index along axis (kept, size 1) of the first max (min) of x, as torch's CPU kernel, or of the first NaN
    where there is one (torch's max and min propagate NaN; ArgMax skips them: an ArgMax of their mask finds it)."""
    op = _op()
    key = op.Cast(x, to=2) if x.dtype is not None and x.dtype.name == "BOOL" else x  # uint8: no boolean ArgMax
    index = (op.ArgMax if largest else op.ArgMin)(key, axis=axis, keepdims=1)
    if not _floating(x):
        return index
    nan = op.IsNaN(x)
    first_nan = op.ArgMax(op.Cast(nan, to=2), axis=axis, keepdims=1)
    return op.Where(op.GatherElements(nan, first_nan, axis=axis), first_nan, index)


def _extremum(largest: bool) -> Callable[..., Any]:
    """aten max.dim (min.dim): the index of `_first_index` and the value x gathered there, so that the gradient goes
    wholly to that index, as torch's backward scatters it (onnxscript's ReduceMax splits a tie's, and drops NaNs)."""
    def translate(x: Any, dim: int, keepdim: bool = False) -> tuple[Any, Any]:
        op = _op()
        rank = len(x.shape)
        if rank == 0:
            return op.Identity(x), _tensor(np.array(0, dtype=np.int64))
        axis = dim % rank
        index = _first_index(x, axis, largest)
        value = op.GatherElements(x, index, axis=axis)
        if keepdim:
            return value, index
        return op.Squeeze(value, _axes(axis)), op.Squeeze(index, _axes(axis))
    return translate


def _adaptive_max_pool2d(x: Any, output_size: Any) -> tuple[Any, Any]:
    """aten adaptive_max_pool2d. To one value per channel: the max of the flattened plane at `_first_index` (its
    flat index, as torch's), where torch's decomposition writes amax, whose rule splits a tie's gradient (torch's
    kernel gives it to the index returned). To sizes dividing the input's: a max pool of that kernel, as torch's
    decomposition (which refuses other sizes)."""
    op = _op()
    h_out, w_out = output_size
    if (h_out, w_out) == (1, 1):
        axis = len(x.shape) - 2
        flat = op.Reshape(x, _axes(*[0] * axis, -1))
        index = _first_index(flat, axis, True)
        value = op.GatherElements(flat, index, axis=axis)
        return op.Unsqueeze(value, _axes(-1)), op.Unsqueeze(index, _axes(-1))
    h_in, w_in = x.shape[-2], x.shape[-1]
    if not (isinstance(h_in, int) and isinstance(w_in, int) and h_in % h_out == 0 and w_in % w_out == 0):
        raise NotImplementedError(f"adaptive_max_pool2d of a {x.shape} input to {list(output_size)}: only to sizes "
                                  "dividing the input's known sizes; use exporter='torchscript'")
    return _torchlib_nn().aten_max_pool2d_with_indices(x, [h_in // h_out, w_in // w_out])


def _clamp(x: Any, low: Any = None, high: Any = None) -> Any:
    """aten clamp.Tensor (clamp_min.Tensor, clamp_max.Tensor): the value x, the bound or NaN as torch's, and the
    gradient where torch's backward puts it: x's where low <= x <= high, low's where x < low < high, high's where x
    > high or high < low (none where x < low == high: the value low through a StopGradient), by Wheres on those
    comparisons (onnxscript's Max / Min split a tie's). NaN in any of them: a term added to the value picked, NaN
    there and -0 elsewhere (x + -0 is x), without a gradient. Integers: onnxscript's Max / Min."""
    op = _op()
    low, high = (None if b is None else op.CastLike(b, x) for b in (low, high))
    if not _floating(x):
        clamped = x if low is None else op.Max(x, low)
        return clamped if high is None else op.Min(clamped, high)
    if high is None:
        picked = op.Where(op.GreaterOrEqual(x, low), x, op.Where(op.Less(x, low), low, _const(0.0, x)))
    elif low is None:
        picked = op.Where(op.LessOrEqual(x, high), x, op.Where(op.Greater(x, high), high, _const(0.0, x)))
    else:
        inside = op.And(op.GreaterOrEqual(x, low), op.LessOrEqual(x, high))
        above = op.Or(op.Greater(x, high), op.Less(high, low))
        below = op.And(op.Less(x, low), op.Less(low, high))
        picked = op.Where(inside, x, op.Where(above, high, op.Where(below, low, _stop_gradient(low))))
    nan = op.IsNaN(x)
    for b in (low, high):
        nan = nan if b is None else op.Or(nan, op.IsNaN(b))
    return op.Add(picked, op.Where(nan, _const(math.nan, x), _const(-0.0, x)))


def _clamp_min(x: Any, low: Any) -> Any:
    return _clamp(x, low, None)


def _clamp_max(x: Any, high: Any) -> Any:
    return _clamp(x, None, high)


def _reduce_nan_kept(largest: bool) -> Callable[..., Any]:
    """aten amax (amin): ReduceMax (ReduceMin) of x plus a term that is NaN over a group holding a NaN and -0
    elsewhere (x + -0 is x), without a gradient: onnxruntime's reduction keeps a NaN only where it comes first
    (onnxscript's gave 2 for amax([1, nan, 2]), torch's NaN). The rule's share over the elements equal to a NaN
    result, none, is NaN for the group, as torch's backward (grad / count, count 0). Integers: ReduceMax alone."""
    def translate(x: Any, dim: Any = (), keepdim: bool = False) -> Any:
        op = _op()
        axes = _axes(*dim) if dim else None
        if _floating(x):
            nans = op.ReduceMax(op.CastLike(op.IsNaN(x), x), axes, keepdims=1)
            x = op.Add(x, op.Where(op.Cast(nans, to=9), _const(math.nan, x), _const(-0.0, x)))
        return (op.ReduceMax if largest else op.ReduceMin)(x, axes, keepdims=int(keepdim))
    return translate


def _xlogy(x: Any, y: Any) -> Any:
    """aten xlogy.Tensor: x * log(y), 0 where x is 0 (unless y is NaN), as torch's; and its gradients: x's is log(y)
    at x = 0 too (onnxscript's Where around the product cut it there), 0 where also y <= 0 (torch's) or y = inf
    (torch's inf: the value there, 0 * log(y), would be NaN, torch's 0)."""
    op = _op()
    y = op.CastLike(y, x)
    dead = op.Or(op.LessOrEqual(y, _const(0.0, x)), op.IsInf(y, detect_negative=0))
    masked = op.And(op.Equal(x, _const(0.0, x)), dead)
    return op.Mul(x, op.Where(masked, _const(0.0, x), op.Log(y)))


def _xlogy_of_number(x: Any, y: float) -> Any:
    """aten xlogy.Scalar_Other: `_xlogy` of y written in x's type."""
    return _xlogy(x, _const(y, x))


def _is_double(x: Any) -> bool:
    return x.dtype is not None and x.dtype.name == "DOUBLE"


@functools.cache
def _torchlib_nn() -> Any:
    from onnxscript.function_libs.torch_lib.ops import nn
    return nn


def _elu_of(x: Any, alpha: float, scale: float = 1.0, input_scale: float = 1.0) -> Any:
    """torch's elu in elementwise ops, its constants float64 (ONNX's Elu, Selu, Celu and LeakyRelu take
    float32 attributes: 1e-8 off in float64; onnxscript computes celu in float32): scale x where x > 0, else alpha
    scale (exp(x input_scale) - 1) (exp of x clipped to 0 there, so that a large x gives no inf and no NaN
    gradient); at 0 the negative side's gradient, as torch's."""
    op = _op()
    positive = op.Greater(x, _const(0.0, x))
    negative = op.Where(positive, _const(0.0, x), x)
    if input_scale != 1.0:
        negative = op.Mul(negative, _const(input_scale, x))
    below = op.Mul(op.Sub(op.Exp(negative), _const(1.0, x)), _const(alpha * scale, x))
    return op.Where(positive, x if scale == 1.0 else op.Mul(x, _const(scale, x)), below)


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _elu(x: Any, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Any:
    if not _is_double(x):
        return _torchlib_nn().aten_elu(x, alpha, scale, input_scale)
    return _elu_of(x, alpha, scale, input_scale)


def _selu(x: Any) -> Any:
    return _elu_of(x, SELU_ALPHA, SELU_SCALE) if _is_double(x) else _op().Selu(x)


def _celu(x: Any, alpha: float = 1.0) -> Any:
    return _elu_of(x, alpha, 1.0, 1.0 / alpha) if _is_double(x) else _torchlib_nn().aten_celu(x, alpha)


def _leaky_relu(x: Any, slope: float = 0.01) -> Any:
    """x where x > 0, else slope x; at 0 the slope's gradient, as torch's."""
    op = _op()
    if not _is_double(x):
        return op.LeakyRelu(x, alpha=slope)
    return op.Where(op.Greater(x, _const(0.0, x)), x, op.Mul(x, _const(slope, x)))


def _log2(x: Any) -> Any:
    """log(x) / log(2), the constant in x's type (onnxscript's Log(2.0) computed in float32)."""
    op = _op()
    return op.Div(op.Log(x), _const(math.log(2.0), x))


def _detach(x: Any) -> Any:
    """aten detach: gradbuilder's StopGradient (onnxscript's Identity let gradients through, where runtime's own
    replacements of torch's functions detach: binary cross-entropy's value at p held constant (NaN gradients at a
    saturated sigmoid), straight-through and clamped-below-eps terms). A user's detach is kept as torch's."""
    return _stop_gradient(x)


def _logaddexp(a: Any, b: Any, base: float = 1.0) -> Any:
    """aten logaddexp (logaddexp2: `base` ln 2): max(a, b) + log(1 + exp(-|a - b|)), a where a and b are the same
    infinity (`symbolics`' form; onnxscript's gave two -infs, the log of two zero probabilities, a NaN gradient that
    a masked_fill before did not stop)."""
    op = _op()
    scale, one = _const(base, a), _const(1.0, a)  # (a's type, which the ops' results do not carry here)
    if base != 1.0:
        a, b = op.Mul(a, scale), op.Mul(b, scale)
    out = op.Add(op.Max(a, b), op.Log(op.Add(one, op.Exp(op.Neg(op.Abs(op.Sub(a, b)))))))
    out = op.Where(op.And(op.IsInf(a), op.Equal(a, b)), a, out)
    return out if base == 1.0 else op.Div(out, scale)


def _logcumsumexp(x: Any, dim: int) -> Any:
    """aten logcumsumexp: y_i = logsumexp_j (x_j where j <= i, else -inf), a ReduceLogSumExp over a triangle
    (`symbolics`' form; onnxscript's, log(cumsum(exp(x - max))), gave NaN gradients to every element before an
    output of -inf, a run of leading -infs: log-probabilities of 0)."""
    op = _op()
    rank = len(x.shape)
    if rank == 0:
        return op.Identity(x)
    axis = dim % rank
    trailing = list(range(rank - axis - 1))
    n = op.Squeeze(op.Shape(x, start=axis, end=axis + 1), _axes(0))
    j = op.Range(_tensor(np.array(0, np.int64)), n, _tensor(np.array(1, np.int64)))
    below = op.LessOrEqual(op.Unsqueeze(j, _axes(0)), op.Unsqueeze(j, _axes(1)))  # [i, j]: j <= i
    if trailing:
        below = op.Unsqueeze(below, _axes(*[2 + k for k in trailing]))
    spread = op.Where(below, op.Unsqueeze(x, _axes(axis)), _const(-math.inf, x))
    return op.ReduceLogSumExp(spread, _axes(axis + 1), keepdims=0)


def _draw(like: Any, fill: str, *params: float, dtype: Any = None) -> Any:
    """torch's `fill` of a tensor shaped and typed as `like` (or of type `dtype`, where like's is not known yet), as
    `torch_draws`' marker (expanded after the export into the random op, tagged for the host)."""
    from onnxscript import ir, values
    if dtype is None:
        dtype = like.dtype if _floating(like) or fill == "bernoulli_" else None
    if dtype is None:
        raise TypeError(f"torch's {fill} of a {like.dtype} tensor")
    return getattr(values.Opset(DOMAIN, 1), torch_draws.OP_TYPE)(
        like, fill=fill, params=ir.tensor(np.array(params, np.float64)), dtype=int(dtype))


def _bernoulli_p(x: Any, p: float, generator: Any = None) -> Any:
    """aten bernoulli.p (`x.new_empty(n, 1).bernoulli_(keep)`, timm's drop_path): torch's fill, which the host
    draws as torch's Bernoulli kernel under `torch_dropout` (onnxscript's compared uniforms with a CastLike of p,
    which it did not read as p: onnxruntime's uniforms then stood for torch's mask, silently another one)."""
    return _draw(x, "bernoulli_", float(p))


def _normal(x: Any, mean: float = 0.0, std: float = 1.0, generator: Any = None) -> Any:
    """aten normal_functional (`x.normal_(mean, std)`): torch's fill (onnxscript's wrote the numbers as float32
    attributes, which the host read back as other numbers in float64)."""
    return _draw(x, "normal_", float(mean), float(std))


def _exponential(x: Any, rate: float = 1.0, generator: Any = None) -> Any:
    """aten exponential (`x.exponential_(rate)`, torch's gumbel_softmax): torch's fill (onnxscript has none)."""
    return _draw(x, "exponential_", float(rate))


def _uniform(x: Any, low: float = 0.0, high: float = 1.0, generator: Any = None) -> Any:
    """aten uniform (`x.uniform_(low, high)`): torch's fill (onnxscript has no translation)."""
    return _draw(x, "uniform_", float(low), float(high))


def _random(fill: str, like: bool) -> Callable[..., Any]:
    """aten rand / randn (`like`: rand_like / randn_like): torch's fill (onnxscript's wrote the random op untagged,
    as its randint and others' uniforms, which the host cannot tell from these). The generator overloads are
    onnxscript's."""
    def convert(x: Any, dtype: int = -1, *rest: Any, **options: Any) -> Any:
        from onnxscript import ir
        if like and dtype in (-1, None, x.dtype):
            return _draw(x, fill, 0.0, 1.0)
        kind = ir.DataType(dtype) if dtype not in (-1, None) else x.dtype if like else _default_float()
        shape = _op().Shape(x) if like else _sizes(x)
        zeros = _op().ConstantOfShape(shape, value=ir.tensor(np.zeros(1, kind.numpy())))
        return _draw(zeros, fill, 0.0, 1.0, dtype=kind)
    return convert


def _sizes(sizes: Any) -> Any:
    """A size argument (ints and the symbolic sizes of other tensors) as a 1-D INT64 tensor."""
    if not isinstance(sizes, (list, tuple)):
        return sizes
    if all(isinstance(v, int) for v in sizes):
        return _tensor(np.array(sizes, np.int64))
    return _op().Concat(*[_tensor(np.array([v], np.int64)) if isinstance(v, int) else _op().Reshape(v, _axes(1))
                          for v in sizes], axis=0)


def _normal_of_tensors(mean: Any, std: Any = 1.0, generator: Any = None) -> Any:
    """aten normal of a tensor mean or std (torch.normal(mean, std)) as torch computes it, `normal_(0, std)` + mean
    for a number std (1 where the call leaves it out), else `normal_(0, 1)` * std + mean, the fill tagged for the
    host; the tensors' gradients zeros, as torch's (onnxscript's passed gradients, and its draw was untagged)."""
    op = _op()
    tensor = std if isinstance(mean, (int, float)) else mean
    held = [_stop_gradient(v, ZERO_GRADIENT) if not isinstance(v, (int, float)) else _const(float(v), tensor)
            for v in (mean, std)]
    if isinstance(std, (int, float)):
        return op.Add(_draw(held[0], "normal_", 0.0, float(std), dtype=tensor.dtype), held[0])
    like = held[1] if isinstance(mean, (int, float)) else op.Add(*held)
    return op.Add(op.Mul(_draw(like, "normal_", 0.0, 1.0, dtype=tensor.dtype), held[1]), held[0])


def _cauchy(x: Any, median: float = 0.0, sigma: float = 1.0, generator: Any = None) -> Any:
    """aten cauchy (`x.cauchy_(median, sigma)`): median + sigma tan(pi (u - 1/2)), u from an untagged
    RandomUniformLike. torch's decomposition drew u by rand_like, which `_random` tags as torch's own fill, and the
    host would then draw uniforms where torch's kernel drew Cauchy variates otherwise: a draw of the law torch's
    has, not its values (the first call's check does not compare it). So log_normal and geometric."""
    op = _op()
    u = op.RandomUniformLike(x)
    return op.Add(_const(median, x), op.Mul(_const(sigma, x), op.Tan(op.Mul(_const(math.pi, x),
                                                                          op.Sub(u, _const(0.5, x))))))


def _log_normal(x: Any, mean: float = 1.0, std: float = 2.0, generator: Any = None) -> Any:
    """aten log_normal (`x.log_normal_(mean, std)`): exp of an untagged RandomNormalLike (`_cauchy`)."""
    return _op().Exp(_op().RandomNormalLike(x, mean=float(mean), scale=float(std)))


def _geometric(x: Any, p: float, generator: Any = None) -> Any:
    """aten geometric (`x.geometric_(p)`): ceil(log(u) / log(1 - p)) for u from an untagged RandomUniformLike in
    (0, 1] (`_cauchy`), the number of trials to the first success."""
    op = _op()
    u = op.Sub(_const(1.0, x), op.RandomUniformLike(x))
    return op.Ceil(op.Div(op.Log(u), _const(math.log1p(-float(p)), x)))


def _default_float() -> Any:
    from onnxscript import ir
    return ir.DataType.DOUBLE if torch.get_default_dtype() == torch.float64 else ir.DataType.FLOAT


def _conv3d(x: Any, w: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
            groups: int = 1) -> Any:
    """aten conv3d: one Conv, without a bias input where there is none (onnxscript's made a zero bias shaped
    [out channels, 3], which onnxruntime refused at the first run: 3-D convolutions without bias, as before a
    BatchNorm3d, failed under dynamo)."""
    def three(v: Any) -> list[int]:
        return [int(v)] * 3 if isinstance(v, int) else [int(e) for e in v]

    pads = three(padding)
    inputs = [x, w] if bias is None else [x, w, bias]
    return _op().Conv(*inputs, strides=three(stride), pads=[*pads, *pads], dilations=three(dilation), group=groups)


def _rsub(x: Any, other: float, alpha: float = 1) -> Any:
    """aten rsub.Scalar (`1.0 - mask`): other - alpha x, in torch's result type (an integer x with a float number:
    the default float type). torch's decomposition writes it as sub(number, tensor), which no overload of sub takes
    ("Cannot find a compatible OpOverload for aten.sub": XLNet's `1.0 - attention_mask` of an int64 mask)."""
    op = _op()
    dtype = x.dtype
    if not _floating(x) and not (isinstance(other, int) and isinstance(alpha, int)):
        dtype = _default_float()
        x = op.Cast(x, to=dtype)

    def number(value: float) -> Any:
        return _tensor(np.array(value, dtype=dtype.numpy()))

    return op.Sub(number(other), x if alpha == 1 else op.Mul(x, number(alpha)))


def _neg_view(x: Any) -> Any:
    """aten _neg_view: -x. torch writes a lazy conjugate's imaginary part so (`torch.fft.ifft` of a real tensor, its
    conjugated forward transform over n), which onnxscript has no translation for ("No ONNX function found for
    aten._neg_view")."""
    return _op().Neg(x)


@functools.cache
def translations() -> dict[Any, Any]:
    """aten overload -> translation, for `torch.onnx.export(..., custom_translation_table=)`."""
    aten = torch.ops.aten
    return {
        aten.max.dim: _extremum(True), aten.min.dim: _extremum(False),
        aten.amax.default: _reduce_nan_kept(True), aten.amin.default: _reduce_nan_kept(False),
        aten.xlogy.Tensor: _xlogy, aten.xlogy.Scalar_Other: _xlogy_of_number,
        aten.elu.default: _elu, aten.selu.default: _selu, aten.celu.default: _celu,
        aten.leaky_relu.default: _leaky_relu, aten.log2.default: _log2,
        aten.adaptive_max_pool2d.default: _adaptive_max_pool2d,
        aten.detach.default: _detach, aten.bernoulli.p: _bernoulli_p, aten.conv3d.default: _conv3d,
        aten.normal_functional.default: _normal, aten.uniform.default: _uniform,
        aten.exponential.default: _exponential, aten.rand.default: _random("uniform_", False),
        aten.randn.default: _random("normal_", False), aten.rand_like.default: _random("uniform_", True),
        aten.randn_like.default: _random("normal_", True), aten.normal.Tensor_float: _normal_of_tensors,
        aten.normal.float_Tensor: _normal_of_tensors, aten.normal.Tensor_Tensor: _normal_of_tensors,
        aten.cauchy.default: _cauchy, aten.log_normal.default: _log_normal, aten.geometric.default: _geometric,
        aten.logaddexp.default: _logaddexp, aten.logcumsumexp.default: _logcumsumexp,
        aten.logaddexp2.default: lambda a, b: _logaddexp(a, b, math.log(2.0)),
        aten.clamp.Tensor: _clamp, aten.clamp_min.Tensor: _clamp_min, aten.clamp_max.Tensor: _clamp_max,
        aten.rsub.Scalar: _rsub, aten._neg_view.default: _neg_view,
    }
