"""Layers torch's legacy exporter refuses, or refuses for inputs of run-time sizes, written in ops it exports.

The runtime exports with every dimension dynamic (one export serves every batch and image size), and the exporter
then stops at `adaptive_avg_pool2d` and `adaptive_max_pool2d` to any size but 1x1 ("input size not accessible":
VGG's and AlexNet's heads), at a `threshold` other than 0 ("non-zero threshold"), and at `channel_shuffle`
(ShuffleNet), and it has no export for `rms_norm` (nn.RMSNorm, LLaMA-style models), `bilinear` (nn.Bilinear),
`hypot`, `vdot` (spectral norm), `gumbel_softmax` (its in-place exponential draw), `randperm` and `randint` with
bounds read from sizes (a batch shuffled for mixup), `histc`, `copysign` and `searchsorted`, `Tensor.unfold`
(sliding windows: "input size not accessible"), `layer_norm` over a shape read from the input's sizes, pools whose
window sizes are read from the input's (`max_pool2d(y, y.shape[-2:])`, 2-d and 3-d, max and average),
`instance_norm` in training with running statistics ("unknown batch size"), `scatter_reduce` by "mean" or
without self, `embedding` with `scale_grad_by_freq`, `fold` below opset 18, `lgamma` and `digamma`
(torch.distributions' Gamma, Beta, Poisson), or, before opset 20, `affine_grid` (spatial transformers), and it fails
on `max_unpool` (SegNet's decoder) comparing run-time sizes and at `scaled_dot_product_attention` with `enable_gqa`,
and writes a convolution padded "same" with a dilation as an auto_pad onnxruntime refuses at the first run (and
float64 convolutions, transposed ones and average pools as a Conv, a ConvTranspose and an AveragePool, which
onnxruntime has no double kernels of);
`local_response_norm` and `embedding_bag` export with an If or a Loop on the gradient path, which gradbuilder does
not differentiate; and some exports compute something else, without an error: `avg_pool2d` and `avg_pool3d` ignore a
constant `divisor_override`, `pairwise_distance` adds eps to the exponent, `softplus` ignores its threshold,
`logsigmoid` is -inf below -17, `gaussian_nll_loss` and `cosine_similarity` pass no gradient to a variance or norm
below eps (torch clamps them in place under no_grad, which keeps it), the gradients of `cdist` at zero distances, of
`cosine_similarity` at zero vectors, of `std` over constant values and of norms of orders other than 1, 2 and inf
(and the Frobenius norm, and `dist`, which it lacks) at zero are NaN, `hardtanh` and `relu6` pass the gradient at
their bounds (Clip's rule, clamp's), and `interpolate(antialias=True)` (which it lacks; dynamo's Resize) samples by
the output size where torch samples by a given `scale_factor`, and dynamo's float64 1-D linear interpolation weighs
in float32 (and onnxruntime's Resize, the other linear modes, has no double kernel).
While exporting, `exportable_functions` computes them as torch defines them:

- adaptive average pooling to k cells along an axis of n: window i covers [floor(i n / k), ceil((i + 1) n / k)),
  as torch's; written as a product with a [k, n] matrix of 1 / (window size) over each window, built from the
  run-time n (Range, comparisons), once per pooled axis;
- adaptive max pooling: the first maximum of each window in raster order (torch's, and its flat index), as the
  first maximum of each window row (ArgMax over a masked copy, one a column window) then the first among the
  window's rows;
- average pooling by a divisor: the input framed by its padding and zeros where torch's last ceil-mode window
  overhangs (computed in the graph from the run-time sizes: one export for every size), pooled, times the kernel's
  size over the divisor;
- scatter_reduce by mean, or by sum without self: sums and counts scattered by `scatter_add` (self added and
  counted once where included), the mean their quotient, self kept where nothing was scattered to;
- pairwise_distance, cdist and pdist (which neither exporter has; its pairs i < j by a mask of the row count): the
  p-norm of the difference (plus eps for pairwise_distance, which torch's exporter wrote into the exponent) with
  torch's zero gradient at zero distance, and cdist's product form past 25 rows for p = 2, as torch's, chosen in the
  graph from the run-time row counts (the difference form over the first 25 rows of each side, the whole result
  where neither has more): one export for every size;
- vector norms of other orders (`torch.linalg.vector_norm`, through which torch.norm and Tensor.norm go, and
  `torch.linalg.norm` of one axis), `dist` and the Frobenius norm: `vector_norm`'s, 2 as a ReduceL2;
- hardtanh and relu6 (nn.Hardtanh, nn.ReLU6, in place too) where a gradient reaches them: the bound x reached, else
  x, by Where (a Relu for ReLU6's 0), whose rules pass no gradient at the bounds, as torch's; float64 hardsigmoid and
  hardswish so too, as torch's relu6(x + 3) / 6 and x relu6(x + 3) / 6 (the exporters' HardSigmoid holds 1/6 as a
  float32 attribute: 4e-9 off), hardsigmoid's gradient by torch's float32 1/6 as its backward's; float64 celu's
  gradient by its backward's 1 / alpha, alpha rounded to float32;
- diagonals: views of the input where its two axes flatten (as torch's, so writes through them reach it in torch's
  run, and the first call's check sees the export's), else copies that refuse the export if written to;
- antialiased interpolation by a scale factor (bilinear, bicubic): a product with a [n, out] matrix of torch's
  weights per axis, built from the run-time n;
- linear interpolation (linear, bilinear, trilinear) and bicubic in float64, which onnxruntime's Resize lacks (and
  dynamo's 1-D linear form weighted in float32): the same products with torch's linear or cubic weights;
- nearest and nearest-exact interpolation: each axis gathered at torch's source indices (floor(i * scale) in
  float32, as its kernels), where the exporters' Resize reads other pixels at some factors or has no kernel
  (float64);
- a float64 convolution: the input padded, each kernel tap's strided window stacked, times the weight as [out /
  groups, in / groups * taps], one product a group (`_conv_by_taps`);
- a float64 transposed convolution: the convolution it is the adjoint of, over the input with stride - 1 zeros
  between its elements, framed by dilation * (kernel - 1) - padding (and the output padding), the weight's taps
  flipped and its channel axes exchanged within each group;
- a float64 average pool: the windows' sums (a strided slice a tap, added) over torch's divisor (the override, or
  each window's count of input and, with count_include_pad, padding elements, summed the same way over ones);
  global average pooling as a mean; along an axis whose one window spans it and its padding (a kernel as long or
  longer, in ceil mode), a sum over it;
- cosine similarity: each input over its norm clamped to eps (the gradient kept below it, as in gaussian NLL), the
  products summed (torch's; the exporter's sqrt of the product of squared norms has a NaN gradient at a zero vector);
- std (and std_mean) as the root of the variance, with torch's zero gradient where the variance is 0 (a
  constant row: the exporter's sqrt made it NaN);
- an embedding with `scale_grad_by_freq` (refused in training): the rows' gradient divided by their index's
  count in the input;
- an embedding (or bag) with `max_norm`: torch renorms the looked-up rows of a detached alias of the weight, which
  the trace drops as dead code (the rows kept their norms); here the weight itself, in place without grad, which
  the export carries back to the parameter (`stop_gradients.WithoutGrad`);
- layer norm over a shape read from the input's sizes: the sizes as Python ints;
- fold (Col2Im, from opset 18 only): a ConvTranspose of the patches with a one-hot kernel per channel and tap;
- lgamma and digamma (no ONNX ops): Stirling's and the asymptotic series (to the 16th power) past 8, the recurrences
  below, the reflections below 1/2 (from x less its nearest integer), in float64 for float32 too (within 1e-14 of
  torch's float64 lgamma, and of the exact digamma where torch's is 1e-12 off near poles; float32 rounded from it);
- normalize into `out` (spectral norm's power iteration; the exporter read `out` as div's rounding mode):
  computed, then copied in;
- softplus with a threshold below 20 (the exporter drops it): x where beta x exceeds it, else softplus;
- log-sigmoid as -softplus(-x) (the exporter's log of a sigmoid is -inf below x ~ -17);
- threshold(x, t, v): x where x > t, else v;
- nan_to_num of a 0-d tensor (a loss kept finite): on one element, then 0-d (the legacy exporter's is 1-D);
- convolutions padded "same" with a dilation: torch's pads, dilation * (kernel - 1) per axis, half before and the
  rest after, explicit (the odd one a zero Pad);
- gaussian NLL: torch's formula, variances below eps given as eps plus a zero carrying their gradient (a
  StopGradient; the dynamo exporter, which holds none, keeps clamp_min's), without torch's check of negative
  variances (a branch on values, which dynamo cannot export; torch's run before the export makes it);
- max unpooling: each value scattered to its flat index in a zero map of the output's size (given, or the pool's
  input size computed from the run-time input), as torch's kernel;
- attention with fewer key/value heads than query heads (`enable_gqa`, Mistral's and LLaMA 3's grouped-query
  attention): each key and value head repeated for the query heads it serves, as torch's own fallback does (the
  head counts, the weights', read as numbers outside the trace: no traced comparison baked in);
- max, average and lp pools (1-d and 2-d, indices too), F.unfold and pixel (un)shuffling of an unbatched input
  ((C, L), (C, H, W)), which torch accepts: a batch axis of 1 around the call (the exporter wrote ONNX pools and
  im2col's Pad on the unbatched tensor, which ONNX does not allow, and refuses pixel_shuffle but of 4-d inputs;
  pixel shuffling's several batch axes, (B, T, C, H, W), flattened into one);
- pools' window sizes, strides and pads read from the input's sizes: as the Python ints the export keeps;
- cross-entropy and NLL of one sample (1-D scores): a batch axis of 1 around the call, the result 0-d;
- channel shuffle in g groups: channels [g, C/g] transposed to [C/g, g];
- local response norm: x / (k + alpha * mean of x^2 over `size` channels around, zeros past the ends)^beta;
- RMS norm: x * rsqrt(mean of x^2 over the normalized axes + eps) (eps: the dtype's when None) times the weight;
- group norm, and instance norm without running statistics, in float64 (written as an InstanceNormalization, which
  onnxruntime runs in float32 only): each sample's channel groups normalized by their mean and biased variance;
- instance norm in training with running statistics (refused for a run-time batch): each sample's channels
  normalized by their own statistics, the running ones moved towards the batch's mean of them, as torch's;
- bilinear: x1 times the weight, then times x2, summed over their features, plus the bias; hypot: sqrt(a^2 + b^2);
  vdot of real vectors: the sum of their product; gumbel softmax: Gumbel noise as -log(-log(U)) for U uniform
  (torch's -log of an exponential draw, in distribution), hard as torch's straight-through one-hot;
- Tensor.unfold(d, size, step): the windows' elements gathered along d by one index ([windows, size] from the
  run-time length), the window axis moved last;
- affine grid (2-D): each output position's (x, y, 1), x and y evenly spaced over [-1, 1] (pixel centres without
  align_corners), times theta transposed;
- embedding bags (no max_norm): of a 2-D input (fixed-size bags), the rows' embeddings (times their per-sample
  weights) summed, averaged or maxed over each bag; of a 1-D input cut by offsets, summed or averaged
  (`_variable_bags`); entries at `padding_idx` left out, an empty bag zeros; other calls keep torch's function;
- window functions (torch's and torch.signal.windows') and sample frequencies: constants of torch's values
  (`_constant`);
- one-sided transforms of real signals (rfft, rfft2, rfftn, stft): imaginary parts exactly 0 where the transform
  is real, as torch's (`_real_edges`);
- istft to a real signal: each frame's inverse one-sided transform times the window, overlap-added by pads and
  adds, over the window's squares overlap-added, as torch's (`_istft`);
- as_strided under the legacy trace (whose Gather reads the input's elements in logical order as if they were its
  memory: wrong for a transposed input, or an offset counted from the storage's start): a dense input read as a
  copy in its memory order, the offset from its start; memory outside or between its elements refused
  (`_as_strided`);
- as_tensor of a number computed from sizes under the legacy trace, where it is a 0-d tensor that as_tensor
  returns as is: the trace then took the size itself for the new tensor (`return n, torch.as_tensor(n) * 2` gave
  n back as a tensor); a copy (`_as_tensor`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.nn import functional as F
from torch.nn.utils import spectral_norm as spectral_norm_module

from .batchnorm import eps_scale
from .dropouts import memory_order
from .patching import replaced, traced_number, untraced_ints


def _windows(n: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adaptive pooling from n to k cells: [k, n] whether position j is in window i, and the windows' sizes."""
    cells = torch.arange(k)
    start = cells * n // k
    end = ((cells + 1) * n + k - 1) // k
    positions = torch.arange(n)[None, :]
    return (positions >= start[:, None]) & (positions < end[:, None]), end - start


def _pooling_matrix(n: Any, k: int, like: torch.Tensor) -> torch.Tensor:
    """[k, n]: 1 / (window size) over window i of adaptive pooling from n to k, 0 elsewhere."""
    inside, sizes = _windows(n, k)
    return inside.to(like.dtype) / sizes[:, None].to(like.dtype)


def _adaptive_avg_pool(original: Callable[..., torch.Tensor], dims: int) -> Callable[..., torch.Tensor]:
    def pool(x: torch.Tensor, output_size: Sequence[int | None] | int) -> torch.Tensor:
        sizes = [output_size] * dims if isinstance(output_size, int) else list(output_size)
        if all(k == 1 for k in sizes):  # exported as GlobalAveragePool, which onnxruntime lacks in float64
            return x.mean(list(range(x.dim() - dims, x.dim())), keepdim=True) if x.dtype == torch.float64 else \
                original(x, output_size)
        rank = x.dim()
        # non-negative axes: the exporter writes a negative movedim axis into a Transpose's perm as it is
        for axis, k in zip(range(rank - dims, rank), sizes):
            if k is None:  # the input's own size: nothing pooled
                continue
            moved = x.movedim(axis, rank - 2)  # the pooled axis second to last, for the product
            x = torch.matmul(_pooling_matrix(x.shape[axis], k, x), moved).movedim(rank - 2, axis)
        return x

    return pool


def _adaptive_max_pool2d(original: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                         ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def pool(x: torch.Tensor, output_size: Sequence[int] | int) -> tuple[torch.Tensor, torch.Tensor]:
        kh, kw = [output_size] * 2 if isinstance(output_size, int) else output_size
        if kh == 1 and kw == 1:  # exported as GlobalMaxPool
            return original(x, output_size)
        height, width = x.shape[-2], x.shape[-1]
        lowest = torch.full((), float("-inf"), dtype=x.dtype)
        # the first maximum of each window in raster order, as torch's: per row of the window, then over its rows
        cols = torch.where(_windows(width, kw)[0], x.unsqueeze(-2), lowest)  # [..., H, kw, W]
        at_w = cols.argmax(-1)  # [..., H, kw]
        row_max = cols.gather(-1, at_w.unsqueeze(-1)).squeeze(-1)
        rows = torch.where(_windows(height, kh)[0].unsqueeze(-1), row_max.unsqueeze(-3), lowest)  # [..., kh, H, kw]
        at_h = rows.argmax(-2)  # [..., kh, kw]
        return rows.gather(-2, at_h.unsqueeze(-2)).squeeze(-2), at_h * width + at_w.gather(-2, at_h)

    return pool


def _adaptive_max_pool1d(pool2d: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                         ) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The 1-D pool as the 2-D one over a map one row high (its indices, row * width + column, are the columns)."""
    def pool(x: torch.Tensor, output_size: Sequence[int] | int) -> tuple[torch.Tensor, torch.Tensor]:
        size = output_size if isinstance(output_size, int) else output_size[0]
        values, indices = pool2d(x.unsqueeze(-2), (1, size))
        return values.squeeze(-2), indices.squeeze(-2)

    return pool


def _ceil_overhang(size: Any, kernel: int, stride: int, pad: int) -> Any:
    """How far torch's last ceil-mode window reaches past the padded input (its windows start inside the input
    or the left padding): from a traced size (a tensor) as a tensor, computed in the graph (a Python comparison
    of it would be baked into the export, exported again at every new size), else as an int."""
    out = (size + 2 * pad - kernel + stride - 1) // stride + 1
    if isinstance(size, torch.Tensor):
        out = out - ((out - 1) * stride >= size + pad).to(out.dtype)
        return ((out - 1) * stride + kernel - (size + 2 * pad)).clamp(min=0)
    if (out - 1) * stride >= size + pad:
        out -= 1
    return max(0, (out - 1) * stride + kernel - (size + 2 * pad))


def _divided_avg_pool(original: Callable[..., torch.Tensor], dims: int) -> Callable[..., torch.Tensor]:
    def pool(x: torch.Tensor, kernel_size: Sequence[int] | int, stride: Sequence[int] | int | None = None,
             padding: Sequence[int] | int = 0, ceil_mode: bool = False, count_include_pad: bool = True,
             divisor_override: int | None = None) -> torch.Tensor:
        if divisor_override is None and x.dtype != torch.float64:
            return original(x, kernel_size, stride, padding, ceil_mode, count_include_pad)
        kernel, pads = _per_axis(kernel_size, dims), _per_axis(padding, dims)
        strides = _per_axis(stride, dims) if stride else kernel
        lead = x.dim() - dims
        whole = [i for i, n in enumerate(untraced_ints(*x.shape[lead:])) if kernel[i] >= max(n + 2 * pads[i], 2)]
        if whole:  # one window over the padded axis (HF EfficientNet pools a 1x1 map by 1280): a sum, not a frame
            # of kernel - 1 zeros and a slice a tap; torch's divisor there is the axis's length, its padding counted
            axes = [lead + i for i in whole]
            ones = [(1, 1, 0) if i in whole else (kernel[i], strides[i], pads[i]) for i in range(dims)]
            y = pool(x.sum(axes, keepdim=True), *map(list, zip(*ones)), ceil_mode, count_include_pad,
                     divisor_override)
            return y if divisor_override is not None else y / math.prod(
                x.shape[lead + i] + 2 * pads[i] * count_include_pad for i in whole)
        overhang = [_ceil_overhang(x.shape[lead + i], kernel[i], strides[i], pads[i]) if ceil_mode
                    else 0 for i in range(dims)]
        framed = _padded(x, [p for i in reversed(range(dims)) for p in (pads[i], pads[i] + overhang[i])])
        # every window now lies inside the zero-framed input: its mean times its size is the sum torch divides
        if x.dtype != torch.float64:
            return original(framed, kernel, strides, 0, False, True) * (math.prod(kernel) / divisor_override)
        # float64, which onnxruntime's AveragePool lacks: the windows' sums over the count torch divides by, the
        # elements of each window inside the input (and its padding, with count_include_pad), or the override
        sums = _window_sum(framed, kernel, strides)
        if divisor_override is not None:
            return sums / divisor_override
        inside = torch.ones_like(x[0, 0])[None, None]  # (a Gather: inference sizes it whatever the batch)
        if count_include_pad:
            inside = _padded(inside, [p for i in reversed(range(dims)) for p in (pads[i], pads[i])], value=1.0)
            framing = [p for i in reversed(range(dims)) for p in (0, overhang[i])]
        else:
            framing = [p for i in reversed(range(dims)) for p in (pads[i], pads[i] + overhang[i])]
        return sums / _window_sum(_padded(inside, framing), kernel, strides)

    return pool


def _padded(x: torch.Tensor, pads: Sequence[Any], value: float = 0.0) -> torch.Tensor:
    """F.pad, or x where every pad is the int 0: the legacy exporter writes F.pad's pads through a chain of
    shape ops (their reversal into ONNX's order) and a Pad, none of which a zero padding needs."""
    return x if all(isinstance(p, int) and p == 0 for p in pads) else F.pad(x, list(pads), value=value)


def _per_axis(value: Sequence[int] | int, dims: int) -> list[int]:
    """One int an axis; traced sizes (a float64 global pool's kernel `x.shape[-1]`, which failed the export) as the
    ints the export keeps (`_python_int`)."""
    single = isinstance(value, (int, torch.SymInt)) or (isinstance(value, torch.Tensor) and value.dim() == 0)
    ints = [_python_int(v) for v in ([value] if single else value)]
    return ints * (dims if len(ints) == 1 else 1)


def _conv(original: Callable[..., torch.Tensor], dims: int) -> Callable[..., torch.Tensor]:
    """A float64 convolution as `_conv_by_taps` (onnxruntime has no double Conv: such a module was refused at its
    session's load). One padded "same" with a dilation, which the legacy exporter writes as auto_pad SAME_UPPER with
    dilations, which onnxruntime refuses at the first run ("Dilation not supported for AutoPadType"), with torch's
    own padding as explicit pads (`_conv_pads`; a zero Pad of the odd one). Undilated "same" keeps the exporter's
    auto_pad, which onnxruntime computes alike."""
    def conv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             stride: Sequence[int] | int = 1, padding: Any = 0, dilation: Sequence[int] | int = 1,
             groups: int = 1) -> torch.Tensor:
        dilations = _per_axis(dilation, dims)
        if input.dtype == torch.float64:
            return _conv_by_taps(input, weight, bias, _per_axis(stride, dims), padding, dilations, groups)
        if not (isinstance(padding, str) and padding == "same") or all(d == 1 for d in dilations):
            return original(input, weight, bias, stride, padding, dilation, groups)
        begin, end = _conv_pads(padding, dilations, untraced_ints(*weight.shape[2:]))
        odd = [p for b, e in zip(reversed(begin), reversed(end)) for p in (0, e - b)]  # F.pad's order: last axis first
        padded = F.pad(input, odd) if any(odd) else input
        return original(padded, weight, bias, stride, begin, dilation, groups)

    return conv



def _conv_transpose(original: Callable[..., torch.Tensor], dims: int) -> Callable[..., torch.Tensor]:
    """A float64 transposed convolution (onnxruntime has no double ConvTranspose) as the convolution it is the
    adjoint of: the input with stride - 1 zeros between its elements, padded by dilation * (kernel - 1) - padding
    (and the output padding at the end; cropped where negative), convolved by `_conv_by_taps` with the weight's
    taps flipped and its channel axes exchanged within each group."""
    def conv_transpose(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       stride: Sequence[int] | int = 1, padding: Sequence[int] | int = 0,
                       output_padding: Sequence[int] | int = 0, groups: int = 1,
                       dilation: Sequence[int] | int = 1) -> torch.Tensor:
        if input.dtype != torch.float64:
            return original(input, weight, bias, stride, padding, output_padding, groups, dilation)
        strides, pads, extra, dilations = (_per_axis(v, dims) for v in (stride, padding, output_padding, dilation))
        kernel = untraced_ints(*weight.shape[2:])
        x = input
        for a, s in enumerate(strides):  # stride - 1 zeros after each element, the last one's dropped
            if s > 1:
                axis = 2 + a
                x = torch.stack([x, *[torch.zeros_like(x)] * (s - 1)], axis + 1).flatten(axis, axis + 1)
                x = x.narrow(axis, 0, x.shape[axis] - (s - 1))
        frame = [d * (k - 1) - p for d, k, p in zip(dilations, kernel, pads)]
        x = F.pad(x, [q for f, e in zip(reversed(frame), reversed(extra)) for q in (f, f + e)])
        ins, per_group = untraced_ints(*weight.shape[:2])
        flipped = weight.flip(list(range(2, 2 + dims))).reshape(groups, ins // groups, per_group, *kernel)
        swapped = flipped.transpose(1, 2).reshape(groups * per_group, ins // groups, *kernel)
        return _conv_by_taps(x, swapped, bias, [1] * dims, 0, dilations, groups)

    return conv_transpose


def _conv_pads(padding: Any, dilations: Sequence[int], kernel: Sequence[int]) -> tuple[list[int], list[int]]:
    """A convolution's pads before and after, per axis: "same" as torch pads, dilation * (kernel - 1) in all, half
    before (rounded down) and the rest after; "valid" none; numbers both sides."""
    if isinstance(padding, str):
        totals = [d * (k - 1) if padding == "same" else 0 for d, k in zip(dilations, kernel)]
        return [t // 2 for t in totals], [t - t // 2 for t in totals]
    pads = _per_axis(padding, len(kernel))
    return pads, pads


def _tap_windows(t: torch.Tensor, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
                 ) -> list[torch.Tensor]:
    """Per kernel tap, the strided slice of t (spatial axes after two) each window reads there, as many as fit along
    each axis at t's run-time sizes."""
    outs = [_whole_windows(t.shape[2 + a] - d * (k - 1) - 1, s) for a, (k, s, d) in enumerate(zip(kernel, strides,
                                                                                                     dilations))]
    windows = []
    for tap in itertools.product(*[range(k) for k in kernel]):
        window = t
        for a, (i, s, d, o) in enumerate(zip(tap, strides, dilations, outs)):
            window = window.narrow(2 + a, i * d, (o - 1) * s + 1)[(slice(None),) * (2 + a) + (slice(None, None, s),)]
        windows.append(window)
    return windows


def _whole_windows(rest: Any, stride: int) -> Any:
    """rest // stride + 1 windows, rest >= 0 (the input at least one window long): a traced size's by truncating
    division, which agrees there and which the legacy exporter writes as one Div (floor division as seven ops)."""
    if isinstance(rest, torch.Tensor):
        return torch.div(rest, stride, rounding_mode="trunc") + 1
    return rest // stride + 1


def _window_sum(t: torch.Tensor, kernel: Sequence[int], strides: Sequence[int]) -> torch.Tensor:
    """Each window's sum, over undilated windows of t."""
    return functools.reduce(torch.add, _tap_windows(t, kernel, strides, [1] * len(kernel)))


def _conv_by_taps(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, strides: Sequence[int], padding: Any,
                  dilations: Sequence[int], groups: int) -> torch.Tensor:
    """The convolution as one product a group over its kernel's taps: x padded, each tap's strided window (a slice,
    sized from x's run-time sizes: one export for every size) stacked on a new axis after the channels, then the
    weight as [out / groups, in / groups * taps] times those columns: ops onnxruntime runs in double (Pad, Slice,
    Concat, MatMul), and whose gradients are the Slices' and the product's."""
    kernel = untraced_ints(*w.shape[2:])
    out_channels, per_group = untraced_ints(*w.shape[:2])
    begin, end = _conv_pads(padding, dilations, kernel)
    padded = _padded(x, [p for b, e in zip(reversed(begin), reversed(end)) for p in (b, e)])
    windows = _tap_windows(padded, kernel, strides, dilations)
    taps = len(windows)
    cols = torch.stack(windows, 2).reshape(x.shape[0], groups, per_group * taps, -1)  # [N, G, C/G * T, P]
    rows = w.reshape(groups, out_channels // groups, per_group * taps)  # the taps after each channel, as cols
    y = torch.matmul(rows, cols).reshape(x.shape[0], out_channels, *windows[0].shape[2:])
    return y if bias is None else y + bias.reshape(1, -1, *[1] * len(kernel))


EXPORTED_ORDERS = (1, 2, math.inf, -math.inf)
"""Norm orders the exporter writes as ReduceL1, ReduceL2, ReduceMax and ReduceMin of Abs, whose rules give torch's
gradient at a zero vector."""


def vector_norm(d: torch.Tensor, p: float, dim: int | Sequence[int] | None = -1, keepdim: bool = False
                ) -> torch.Tensor:
    """The p-norm (p >= 0) over `dim` (every axis for None) with torch's gradient where it is 0 (zero, as torch's
    norm and cdist backward give; sqrt and pow of 0 would give NaN): `EXPORTED_ORDERS` as the exporter's reductions,
    whose rules mask the zeros; others by a root guarded away from 0, and below 1 each element's power too (its
    derivative is infinite at a zero element, where torch's is 0)."""
    if p in EXPORTED_ORDERS:
        return torch.linalg.vector_norm(d, p, dim=dim, keepdim=keepdim)
    dims = tuple(range(d.dim())) if dim is None else dim
    if p == 0:
        return (d != 0).to(d.dtype).sum(dims, keepdim=keepdim)
    powers = d.abs() ** p if p >= 1 else root(d.abs(), 1 / p)
    return root(powers.sum(dims, keepdim=keepdim), p)


def root(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """x ** (1 / p) (sqrt for 2) with a zero gradient where x is 0, as torch's norm and std backward give (the
    plain root's is infinite there, NaN once multiplied by the zeros below it): the root of 1 there, replaced by
    0; NaN stays NaN. A 0-d x as a 1-element one: the legacy exporter computes a 0-d tensor's comparison with a
    number, and the constants shaped like it, in float32 (a float64 norm of a whole tensor lost half its digits)."""
    if x.dim() == 0:
        return root(x.reshape(1), p).reshape(())
    zero = x == 0
    safe = torch.where(zero, torch.ones_like(x), x)
    return torch.where(zero, torch.zeros_like(x), torch.sqrt(safe) if p == 2 else safe ** (1 / p))


def pairwise_distance(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, eps: float = 1e-6,
                       keepdim: bool = False) -> torch.Tensor:
    """torch's: the p-norm of x1 - x2 + eps over the last axis."""
    return vector_norm(x1 - x2 + eps, p, keepdim=keepdim)


def _guarded_order(x: torch.Tensor, p: Any) -> bool:
    """Whether `vector_norm` writes this norm itself: a real order past the exporter's reductions, of floats."""
    return isinstance(p, (int, float)) and p >= 0 and p not in EXPORTED_ORDERS and x.is_floating_point()


def _linalg_vector_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.linalg.vector_norm, which torch.norm and Tensor.norm of a number p (F.normalize's) call, of an order
    other than 1, 2 and inf: `vector_norm` (the exporter's pow of the sum had NaN gradients at a zero vector, torch's
    are 0); the input cast to `dtype` first, as torch's."""
    def norm(x: torch.Tensor, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,
             dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None or not _guarded_order(x, ord):
            return original(x, ord, dim, keepdim, dtype=dtype, out=out)
        return vector_norm(x if dtype is None else x.to(dtype), ord, dim, keepdim)

    return norm


def _linalg_matrix_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The Frobenius norm as the 2-norm over both axes (a ReduceL2, whose rule gives torch's zero gradient at a zero
    matrix; the exporter's sqrt of the sum of squares gave NaN); other orders torch's."""
    def matrix_norm(x: torch.Tensor, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *,
                    dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if ord != "fro" or out is not None:
            return original(x, ord, dim, keepdim, dtype=dtype, out=out)
        return torch.linalg.vector_norm(x, 2, dim, keepdim, dtype=dtype)

    return matrix_norm


def _linalg_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.linalg.norm (C++, which calls no patched function): a vector norm (an int or one-axis `dim`, or a 1-D
    input without one) of a guarded order as `vector_norm`, and the Frobenius norm as `_linalg_matrix_norm`'s."""
    def norm(x: torch.Tensor, ord: Any = None, dim: Any = None, keepdim: bool = False, *,
             out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        one_axis = isinstance(dim, int) or (dim is not None and len(dim) == 1) or (dim is None and x.dim() == 1)
        if out is None and one_axis and _guarded_order(x, ord):
            return vector_norm(x if dtype is None else x.to(dtype), ord, dim, keepdim)
        if out is None and ord == "fro" and (dim is not None or x.dim() == 2):
            return torch.linalg.vector_norm(x, 2, dim, keepdim, dtype=dtype)
        return original(x, ord, dim, keepdim, out=out, dtype=dtype)

    return norm


def _dist(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.dist (the legacy exporter has none) as the p-norm of the difference over every element: torch's zero
    gradient at zero distance; a negative p torch's."""
    def dist(x: torch.Tensor, other: torch.Tensor, p: float = 2) -> torch.Tensor:
        if not (isinstance(p, (int, float)) and p >= 0 and x.is_floating_point()):
            return original(x, other, p)
        return vector_norm(x - other, p, None)

    return dist


MM_ROWS = 25
"""torch's cdist takes the product form for p = 2 past this many rows on either side (its
`use_mm_for_euclid_dist_if_necessary`)."""


def _size_tensor(n: Any) -> torch.Tensor:
    """A size as a 0-d tensor: the trace's own (so comparisons of it are traced ops, not Python booleans baked in)
    or a number's."""
    if isinstance(n, torch.Tensor):
        return n
    return torch.scalar_tensor(n, dtype=torch.int64) if isinstance(n, torch.SymInt) else torch.tensor(n)


def _euclidean_dist(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """torch's _euclidean_dist: |a|^2 + |b|^2 - 2 a.b in one product, clamped to 1e-30 before the root."""
    n1, n2 = (x1 * x1).sum(-1, keepdim=True), (x2 * x2).sum(-1, keepdim=True)
    a = torch.cat([x1 * -2, n1, torch.ones_like(n1)], -1)
    b = torch.cat([x2, torch.ones_like(n2), n2], -1)
    return torch.matmul(a, b.transpose(-1, -2)).clamp_min(1e-30).sqrt()


def _distance(d: torch.Tensor, p: float) -> torch.Tensor:
    """The p-norms of differences over the last axis, as cdist's and pdist's own backward differentiate them: at
    p = inf the whole gradient to every |difference| tied at the maximum (the norm's ReduceMax split it among them,
    as torch's norm does), under the legacy exporter (the largest a constant: dynamo's export holds no
    stop-gradient, and keeps the split)."""
    if p != math.inf or not torch.jit.is_tracing():
        return vector_norm(d, p)
    size = d.abs()
    largest = size.amax(-1, keepdim=True).detach()
    return (largest + ((size - size.detach()) * (size == largest).to(d.dtype)).sum(-1, keepdim=True)).squeeze(-1)


def _cdist(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, compute_mode: str | None = None) -> torch.Tensor:
    """torch's cdist: for p = 2 its product form past `MM_ROWS` rows on either side (or always, by
    `compute_mode`), else the p-norm of the differences. Past-25 is not branched on in Python (the trace would bake
    the traced sizes' comparison in, and export again at every size across it): the product form is computed at
    every size, the difference form over the first 25 rows of each side only (its cost bounded), and the result's
    top-left corner taken from it where both sides have at most 25 rows (then it is the whole result)."""
    mode = compute_mode or "use_mm_for_euclid_dist_if_necessary"
    if p != 2 or mode == "donot_use_mm_for_euclid_dist":
        return _distance(x1.unsqueeze(-2) - x2.unsqueeze(-3), p)
    product = _euclidean_dist(x1, x2)
    if mode == "use_mm_for_euclid_dist":
        return product
    head1, head2 = x1[..., :MM_ROWS, :], x2[..., :MM_ROWS, :]
    direct = vector_norm(head1.unsqueeze(-2) - head2.unsqueeze(-3), p)
    small = (_size_tensor(x1.shape[-2]) <= MM_ROWS) & (_size_tensor(x2.shape[-2]) <= MM_ROWS)
    corner = torch.where(small, direct, product[..., :MM_ROWS, :MM_ROWS])
    top = torch.cat([corner, product[..., :MM_ROWS, MM_ROWS:]], -1)
    return torch.cat([top, product[..., MM_ROWS:, :]], -2)


def _pdist(input: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    """torch.pdist (which neither exporter has): the p-norms of the rows' differences over the pairs i < j in row-major
    order, with torch's zero gradient at a zero distance (`vector_norm`); the pairs picked by a mask of the run-time
    row count, not by indices from it (which the trace would keep)."""
    rows = torch.arange(input.shape[0])
    above = rows[:, None] < rows[None, :]
    return _distance(input.unsqueeze(1) - input.unsqueeze(0), p)[above]


def _scatter_reduce(original: Callable[..., torch.Tensor], in_place: bool = False) -> Callable[..., torch.Tensor]:
    """`scatter_reduce` by "mean", or by "sum", "amax" or "amin" without self (`include_self=False`: graph
    networks' aggregations), which the exporter refuses: sums and counts scattered with `scatter_add` (positions
    nothing is scattered to keep self), and the extrema over self with -inf / inf scattered in first. Other
    reductions keep torch's function (its export, or its refusal)."""
    def scatter_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, reduce: str, *,
                       include_self: bool = True) -> torch.Tensor:
        if reduce in ("amax", "amin") and not include_self and self.is_floating_point():
            fill = torch.full_like(src, -math.inf if reduce == "amax" else math.inf)
            out = original(self.scatter(dim, index, fill), dim, index, src, reduce, include_self=True)
            return self.copy_(out) if in_place else out
        if reduce not in ("sum", "mean") or (reduce == "sum" and include_self) or not self.is_floating_point():
            return original(self, dim, index, src, reduce, include_self=include_self)
        zeros = torch.zeros_like(self)
        total = zeros.scatter_add(dim, index, src)
        count = zeros.scatter_add(dim, index, torch.ones_like(src))
        if include_self:
            total, count = total + self, count + 1
        if reduce == "mean":
            total = total / count.clamp(min=1)
        out = torch.where(count > 0, total, self)
        return self.copy_(out) if in_place else out

    return scatter_reduce


def _log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """-softplus(-x): the exporter's log of a sigmoid is -inf below x ~ -17 (and its gradient NaN)."""
    return -F.softplus(-x)


def _softplus(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """softplus with a `threshold` below 20: x itself where beta x exceeds it, as torch's (the exporter ignores
    the threshold; from 20 on it changes nothing a float32 holds)."""
    def softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
        if threshold >= 20.0:
            return original(x, beta, threshold)
        return torch.where(x * beta > threshold, x, original(x, beta, threshold))

    return softplus


def _floored(x: torch.Tensor, eps: float) -> torch.Tensor:
    """max(x, eps) with the gradient 1 below eps too, as torch's clamp in place under no_grad of a clone (which changes
    the values and not the gradient; the exported Clip passes none there): eps plus a zero that carries it. Under
    the dynamo exporter, which holds no stop-gradient (`stop_gradients.py` refuses one), clamp_min's."""
    if not torch.jit.is_tracing():
        return x.clamp_min(eps)
    return torch.where(x < eps, x - x.detach() + eps, x)


def exact(value: float, like: torch.Tensor) -> torch.Tensor:
    """A Python number as a tensor of `like`'s dtype and rank (one element) that both exporters keep at its value:
    the legacy exporter writes a number, or a 0-d tensor, met with a traced size in float32, and dynamo's float64
    constants are read back from float32 at their shortest decimal (2 pi becomes 6.2831855): ~1e-8 off in a
    float64 loss. A 1-element `torch.tensor` keeps both (quietly: torch.full's number is float32 too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.tensor([value], dtype=like.dtype).reshape([1] * like.dim())


def _checked_sizes(x: torch.Tensor) -> list[Any]:
    """x's sizes for a check of shapes: Python ints under the legacy trace (quietly), dynamo's symbols else."""
    return [_python_int(n) for n in x.shape] if torch.jit.is_tracing() else list(x.shape)


def _gaussian_nll_loss(input: torch.Tensor, target: torch.Tensor, var: torch.Tensor | float, full: bool = False,
                       eps: float = 1e-6, reduction: str = "mean") -> torch.Tensor:
    """torch's gaussian_nll_loss written out: torch's checks `torch.any(var < 0)`, a branch on values that dynamo
    cannot export (the eager run before its export raises torch's error), and clamps a clone of the variance in
    place under no_grad, so the entries below eps keep the gradient 1 (as if unclamped), where the exported Clip
    passes none (silently, from the first step a variance falls below eps): here `_floored`."""
    if not isinstance(var, torch.Tensor):
        var = var * torch.ones_like(input)
    sizes, var_sizes = _checked_sizes(input), _checked_sizes(var)
    if sizes[:-1] == var_sizes:  # one variance per row
        var = var.unsqueeze(-1)
    elif var_sizes != sizes and (len(var_sizes) != len(sizes) or
                                 sum(v for n, v in zip(sizes, var_sizes) if n != v) != 1):
        raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = _floored(var, eps) if var.requires_grad else var.clamp_min(eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    if full:
        loss = loss + exact(0.5 * math.log(2 * math.pi), loss)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def _cosine_similarity(x1: torch.Tensor, x2: torch.Tensor, dim: int = 1, eps: float = 1e-8) -> torch.Tensor:
    """torch's: each input over its norm (at least eps, `_floored` as torch's: a norm below eps keeps its
    gradient), the products summed. The exporter divides by sqrt(|x1|^2 |x2|^2), whose gradient at a zero vector (a
    padding embedding) is NaN; the norms here are ReduceL2s, whose rule gives 0 there, as torch's norm does."""
    n1 = _floored(torch.linalg.vector_norm(x1, 2, dim=dim, keepdim=True), eps)
    n2 = _floored(torch.linalg.vector_norm(x2, 2, dim=dim, keepdim=True), eps)
    return ((x1 / n1) * (x2 / n2)).sum(dim)


def _std(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return root(torch.var(x, *args, **kwargs))


def _std_mean(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(x, *args, **kwargs)
    return root(var), mean


def _int_windows(original: Callable[..., Any]) -> Callable[..., Any]:
    """A pool whose window sizes the trace holds as tensors (`F.max_pool2d(y, y.shape[-2:])`, a global pool over the
    map's own size) given them as the Python ints the export keeps (`_python_int`): the legacy exporter refused a
    list of them ("Failed to export a node ... because it is not constant")."""
    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return original(x, *map(_untraced_sizes, args), **{k: _untraced_sizes(v) for k, v in kwargs.items()})

    return call


def _untraced_sizes(value: Any) -> Any:
    """A traced size, or a sequence holding one, as Python ints; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        return _python_int(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return [_untraced_sizes(v) for v in value]
    return value


def _python_int(size: Any) -> int:
    """A size the trace holds as a tensor, as the Python int the export keeps (a later call at another size is
    the size check's to find): quietly, this being the export's own choice, not the user's code."""
    if isinstance(size, int):
        return size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return int(size)


def _layer_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """layer_norm over a normalized shape taken from the input's own sizes (`F.layer_norm(x, x.shape[-1:])`,
    MAE's normalized pixel targets): the trace makes those sizes tensors, which the exporter's LayerNormalization
    cannot take ("Failed to export a node"); they are the input's trailing sizes, read as Python ints (another
    size at another call is the size check's to find). In float64, over x scaled by `batchnorm.eps_scale` (torch's
    eps, for one product more and nothing more kept)."""
    def layer_norm(x: torch.Tensor, normalized_shape: Sequence[Any], weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, *rest: Any) -> torch.Tensor:
        shape = [_python_int(d) for d in normalized_shape]
        scale = eps_scale(eps) if x.dtype == torch.float64 else None
        if scale is not None:  # `exact`: both exporters read Python numbers that round to one float32 as one
            x = x * exact(scale, x)
        return original(x, shape, weight, bias, eps, *rest)

    return layer_norm


def _normalize(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """normalize into `out` (spectral norm's power iteration writes its vectors so): computed, then copied in; the
    exporter read `out` as div's rounding mode."""
    def normalize(x: torch.Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        return original(x, p, dim, eps) if out is None else out.copy_(original(x, p, dim, eps))

    return normalize


def _renorm_(ids: torch.Tensor, weight: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """torch's `embedding_renorm_`: each looked-up row whose norm exceeds max_norm scaled in place by
    max_norm / (norm + 1e-7) (the norm in the weight's type, the factor from float64, as its kernel), without
    grad. torch renorms a detached alias of the weight, which the trace reads as dead code (the rows kept their
    norms, silently); here the weight itself, an in-place change of a parameter the export carries back
    (`stop_gradients.WithoutGrad`)."""
    with torch.no_grad():
        flat = ids.reshape(-1)
        rows = weight.index_select(0, flat)
        norms = torch.linalg.vector_norm(rows, norm_type, dim=-1, keepdim=True)
        scaled = rows * (max_norm / (norms.double() + 1e-7)).to(rows.dtype)
        weight.index_copy_(0, flat, torch.where(norms > max_norm, scaled, rows))


def _embedding(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An embedding with `scale_grad_by_freq` (which the exporter refuses in training): each row's gradient divided
    by how often its index occurs in the input, as torch's, by the looked-up rows' values taken without a gradient
    plus their gradient path times 1 / count (counts scatter-added over the vocabulary). With `max_norm`, the rows
    renormed in the weight first (`_renorm_`)."""
    def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
                  max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                  sparse: bool = False) -> torch.Tensor:
        if max_norm is not None:
            _renorm_(ids, weight, max_norm, norm_type)
        rows = original(ids, weight, padding_idx, None, norm_type, False, sparse)
        if max_norm is not None and padding_idx is not None:  # `_embedding_padding` finds Gathers of the weight
            rows = torch.where((ids == padding_idx % weight.shape[0]).unsqueeze(-1), rows.detach(), rows)
        if not scale_grad_by_freq:
            return rows
        flat = ids.reshape(-1)
        ones = torch.ones_like(flat, dtype=rows.dtype)
        counts = torch.zeros(weight.shape[0], dtype=rows.dtype).index_add(0, flat, ones)
        return rows.detach() + (rows - rows.detach()) / counts[ids].unsqueeze(-1)

    return embedding


def _col2im(x: torch.Tensor, output_size: Sequence[int], kernel_size: Sequence[int], dilation: Sequence[int],
            padding: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """F.fold (Col2Im only exists from opset 18): the patches laid back and summed by a ConvTranspose with a
    one-hot kernel per channel and tap (groups = channels), output padding making up the rows and columns no
    window reaches."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
    height, width = output_size
    rows = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    cols = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    batched = x.dim() == 3
    x = x if batched else x.unsqueeze(0)
    channels = _python_int(x.shape[1]) // (kh * kw)  # they make the kernel
    patches = x.reshape(x.shape[0], channels * kh * kw, rows, cols)
    taps = torch.eye(kh * kw, dtype=x.dtype).reshape(kh * kw, 1, kh, kw).repeat(channels, 1, 1, 1)
    spare = [height - ((rows - 1) * sh - 2 * ph + dh * (kh - 1) + 1),
             width - ((cols - 1) * sw - 2 * pw + dw * (kw - 1) + 1)]
    out = F.conv_transpose2d(patches, taps, stride=(sh, sw), padding=(ph, pw), output_padding=spare,
                             groups=channels, dilation=(dh, dw))
    return out if batched else out.squeeze(0)


SHIFT = 8
"""lgamma and digamma of x below this are computed at x + SHIFT and brought back by the recurrences, where their
asymptotic series to the 16th power are exact to float64 (the first term left out ~1e-16 at 8)."""

STIRLING = (1 / 12, 1 / 360, 1 / 1260, 1 / 1680, 1 / 1188, 691 / 360360, 1 / 156, 3617 / 122400)
"""|B(2n)| / (2n (2n - 1)): log Gamma(z)'s asymptotic series is ... + sum of (-1)^(n+1) STIRLING[n-1] / z^(2n-1)."""

DIGAMMA = (1 / 12, 1 / 120, 1 / 252, 1 / 240, 1 / 132, 691 / 32760, 1 / 12, 3617 / 8160)
"""|B(2n)| / (2n): digamma(z)'s is log z - 1 / (2z) - sum of (-1)^(n+1) DIGAMMA[n-1] / z^(2n)."""


def _alternating(inv2: torch.Tensor, coefficients: Sequence[float]) -> torch.Tensor:
    """c0 - c1 u + c2 u^2 - ... at u = inv2, by Horner's rule."""
    total = torch.full_like(inv2, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        total = c - inv2 * total
    return total


def _in_double(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn computed in float64 for other float types: the recurrences' and reflections' cancellations cost float32
    digits (digamma near -3: 1.5e-3 off, torch's 8e-7)."""
    def computed(x: torch.Tensor) -> torch.Tensor:
        return fn(x) if x.dtype == torch.float64 else fn(x.double()).to(x.dtype)

    return functools.wraps(fn)(computed)


def _reflected_pi(x: torch.Tensor, reflect: torch.Tensor, fallback: float) -> torch.Tensor:
    """pi times x less its nearest integer where `reflect`, else pi times `fallback`: sin and tan of pi x (up to a
    sign sin's) without the rounding of pi x, which near a pole is most of the result (x - round(x) is exact)."""
    return math.pi * torch.where(reflect, x - torch.round(x), torch.full_like(x, fallback))


@_in_double
def _lgamma(x: torch.Tensor) -> torch.Tensor:
    """log |Gamma(x)| (no ONNX op): Stirling's series at z = x, or x + SHIFT less the logs of x .. x + SHIFT - 1;
    below 1/2 by the reflection log(pi / |sin(pi x)|) - lgamma(1 - x). Its gradient is the series' own (digamma).
    +inf at 0 and the negative integers, as torch's."""
    reflect = x < 0.5
    y = torch.where(reflect, 1 - x, x)
    small = y < SHIFT
    z = torch.where(small, y + SHIFT, y)
    shifted = sum(torch.log(torch.where(small, y + k, torch.ones_like(y))) for k in range(SHIFT))
    inv = 1 / z
    series = (z - 0.5) * torch.log(z) - z + 0.5 * math.log(2 * math.pi) + inv * _alternating(inv * inv, STIRLING)
    value = series - shifted
    # the reflected branch at 1/2 where not taken: no log(0) to carry an infinity into the gradient's dead branch
    sine = torch.sin(_reflected_pi(x, reflect, 0.5)).abs()
    return torch.where(reflect, math.log(math.pi) - torch.log(sine) - value, value)


@_in_double
def _digamma(x: torch.Tensor) -> torch.Tensor:
    """d/dx log Gamma(x) (no ONNX op): the asymptotic series at z = x, or x + SHIFT less the sum of 1 / (x + k);
    below 1/2 by the reflection digamma(1 - x) - pi / tan(pi x). NaN at the negative integers and -inf at 0 would
    need a branch of their own: there the reflection's tangent gives +-inf as torch's does not (left)."""
    reflect = x < 0.5
    y = torch.where(reflect, 1 - x, x)
    small = y < SHIFT
    z = torch.where(small, y + SHIFT, y)
    shifted = sum(torch.where(small, 1 / (y + k), torch.zeros_like(y)) for k in range(SHIFT))
    inv2 = 1 / (z * z)
    series = torch.log(z) - 0.5 / z - inv2 * _alternating(inv2, DIGAMMA)
    value = series - shifted
    tangent = torch.tan(_reflected_pi(x, reflect, 0.25))  # 1 where not taken
    return torch.where(reflect, value - math.pi / tangent, value)


def _threshold(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def threshold(x: torch.Tensor, t: float, value: float) -> torch.Tensor:
        if t == 0 and value == 0:
            return original(x, t, value)
        return torch.where(x > t, x, torch.full((), value, dtype=x.dtype))

    return threshold


def _strict_clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """clamp(x, low, high) with hardtanh's gradient: 1 strictly between the bounds, 0 at them and past them (torch's
    hardtanh backward compares strictly; the exporter's Clip has clamp's rule, which passes the gradient at the
    bounds, as clamp's must). The bound where x reached it, else x (NaN, past neither, stays NaN): for ReLU6's
    bound of 0 a Relu (whose rule is strict) and one Where, other bounds two Wheres; the graphs onnxruntime runs
    compute those values as Clips (`vectorized`: its Where was ~18x slower), the gradient stays these masks'."""
    below = torch.relu(x) if low == 0 else torch.where(x <= low, torch.full((), low, dtype=x.dtype), x)
    return torch.where(x >= high, torch.full((), high, dtype=x.dtype), below)


def _hardtanh(original: Callable[..., torch.Tensor], in_place: bool = False) -> Callable[..., torch.Tensor]:
    """hardtanh (nn.Hardtanh, nn.ReLU6) as `_strict_clip` where a gradient reaches it, the in-place form written
    back into x (its later readers see the clipped values, as torch's); else the exporter's Clip."""
    def hardtanh(x: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0) -> torch.Tensor:
        if not (x.requires_grad and x.is_floating_point()):
            return original(x, min_val, max_val)
        y = _strict_clip(x, min_val, max_val)
        return x.copy_(y) if in_place else y

    return hardtanh


def _relu6(original: Callable[..., torch.Tensor], in_place: bool = False) -> Callable[..., torch.Tensor]:
    """F.relu6 (its own ATen function, torch's hardtanh from 0 to 6) as `_hardtanh`."""
    strict = _hardtanh(lambda x, low, high: original(x), in_place)
    return lambda x: strict(x, 0.0, 6.0)


TORCH_SIXTH = torch.tensor(1 / 6, dtype=torch.float32).item()
"""The 1/6 torch's hardsigmoid backward multiplies by in every dtype (`1.0f / 6.0f` in its CPU kernel): float64
gradients 3e-8 off the exact 1/6's, relative, its forward exact."""


def _hard(original: Callable[..., torch.Tensor], in_place: bool = False, swish: bool = False
          ) -> Callable[..., torch.Tensor]:
    """F.hardsigmoid (F.hardswish: x times it) in float64 as `_strict_clip`(x + 3, 0, 6) / 6, torch's formula and
    gradient: hardsigmoid's gradient through a product with `TORCH_SIXTH`, the value carried to torch's quotient by
    a detached difference (exact: the two are within a factor of 2)."""
    def hard(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float64:
            return original(x)
        clipped = _strict_clip(x + 3, 0.0, 6.0)
        if swish:
            y = x * clipped / 6
        else:
            sloped = clipped * TORCH_SIXTH
            y = sloped + (clipped / 6 - sloped).detach()
        return x.copy_(y) if in_place else y

    return hard


def _celu(in_place: bool = False) -> Callable[..., torch.Tensor]:
    """F.celu in float64 with torch's gradient, whose backward reads alpha rounded to float32 as r (its forward the
    exact alpha; derivatives.yaml's `1.0 / alpha.toFloat()`): celu's alpha exp(x / r) / r, from x; celu_'s (y +
    alpha) / r = alpha exp(x / alpha) / r, from its result (6e-9 off the formula's at alpha 0.3). The gradient
    through such a form, the value carried to torch's by a detached difference (exact: the two are within a factor
    of 2). Where alpha is a float32 the forms are torch's own."""
    own, original = torch.celu_ if in_place else torch.celu, torch.celu

    def celu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        rounded = float(np.float32(alpha))
        if x.dtype != torch.float64 or rounded == alpha:
            return own(x, alpha)
        value, positive = original(x, alpha), x > 0
        if in_place:
            below = exact(alpha / rounded, x) * value
        else:
            below = exact(alpha, x) * (torch.exp(torch.where(positive, 0.0, x) * exact(1.0 / rounded, x)) - 1)
        sloped = torch.where(positive, x, below)
        y = sloped + (value - sloped).detach()
        return x.copy_(y) if in_place else y

    return celu


def _constant(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Tensors made from Python numbers alone (windows, sample frequencies) as constants of torch's own values, for
    both exporters (the legacy one kept them so): dynamo's conversion wrote Hamming's window as ONNX's
    HammingWindow, whose alpha and beta are 25/46 and 21/46 where torch's are 0.54 and 0.46 (0.6% off: a
    spectrogram's features, and the first call's check refused the module), Blackman's with float32 constants
    (3e-8 off in float64), and had none for symmetric, Bartlett or Kaiser windows (torch.signal.windows' Kaiser:
    no i0) or for fftfreq and rfftfreq; its other windows computed in the graph 1 ulp off in float32. Computed by
    torch outside the export's fake tensors; a size or a parameter the export traces stays torch's call."""
    def constant(*args: Any, **kwargs: Any) -> torch.Tensor:
        if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.Tensor)) for a in (*args, *kwargs.values())):
            return original(*args, **kwargs)
        with unset_fake_temporarily():
            values = original(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return torch.tensor(values.tolist(), dtype=values.dtype, requires_grad=values.requires_grad)

    return constant


def _real_edges(y: torch.Tensor, axes: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """A one-sided transform of a real signal (complex, or its real form [..., 2]) with its imaginary parts exactly
    0 where the transform is real: at bins whose index along every transformed axis is 0 or, for an even length,
    the middle. torch's are; onnxruntime's DFT and STFT leave ~1e-15 of either sign there, which turned angle()
    between pi and -pi where the real part is negative (the first call's check refused phase features). A Where:
    a product by 0 would keep the sign."""
    parts = torch.view_as_real(y) if y.is_complex() else y
    rank = parts.dim() - 1
    edge = torch.tensor([False, True])
    for axis, length in zip(axes, lengths):
        axis = axis % rank
        index = torch.arange(parts.shape[axis])
        # the length as a tensor the graph computes from the sizes (a length read at run time: GFNet's): a Python
        # comparison of it would keep the first call's parity
        samples = torch.arange(length)[-1:] + 1
        real = (index == 0) | (index * 2 == samples)
        edge = edge & real.reshape([-1] + [1] * (rank - 1 - axis) + [1])
    parts = torch.where(edge, 0.0, parts)
    return torch.view_as_complex(parts) if y.is_complex() else parts


def _rfftn(name: str, default_dims: int | None) -> Callable[..., torch.Tensor]:
    """torch.fft.rfft (1 axis), rfft2 (2) and rfftn (all, or as many as `s` gives) with `_real_edges`."""
    original = getattr(torch.fft, name)

    def rfftn(input: torch.Tensor, s: Any = None, dim: Any = None, norm: str | None = None, *,
              out: torch.Tensor | None = None, n: int | None = None) -> torch.Tensor:
        _without_out(out, f"torch.fft.{name}")
        s = n if n is not None else s  # rfft's name for it
        y = original(input, s, dim, norm) if dim is not None else original(input, s, norm=norm)
        if dim is None:
            count = default_dims or (len(s) if s is not None else input.dim())
            dim = list(range(-count, 0))
        dims = [dim] if isinstance(dim, int) else list(dim)
        sizes = [s] if isinstance(s, int) else list(s) if s is not None else [None] * len(dims)
        lengths = [size if size is not None and size != -1 else input.shape[d] for size, d in zip(sizes, dims)]
        return _real_edges(y, [d % input.dim() - input.dim() for d in dims], lengths)

    return rfftn


def _stft(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.stft of a real signal (and window) with `_real_edges` along its bins, one-sided or not (a full
    spectrum's first and middle bins are real too)."""
    def stft(input: torch.Tensor, n_fft: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = original(input, n_fft, *args, **kwargs)
        window = kwargs.get("window", args[2] if len(args) > 2 else None)
        if input.is_complex() or (window is not None and window.is_complex()):
            return y
        return _real_edges(y, [-2], [n_fft])

    return stft


OVERLAP_TERMS = 16
"""`_overlap_added` sums this many shifted copies at most (n_fft / gcd(n_fft, hop)); more go through F.fold."""


def _overlap_added(frames: torch.Tensor, hop: int) -> torch.Tensor:
    """Frames [B, N, F] laid at every hop and summed where they overlap: [B, N + hop (F - 1)]. As R = N / g blocks
    of g = gcd(N, hop) samples: block j of frame f lands at block f hop / g + j, so each j is one strided placement
    (padded to a stride, then shifted), and the R placements are summed: pads and adds, where dynamo wrote torch's
    as a scatter of int32 indices per sample (an invalid ScatterND) and F.fold's one-hot product is N x N a frame."""
    n = _python_int(frames.shape[1])
    g = math.gcd(n, hop)
    terms, stride = n // g, hop // g
    if terms > OVERLAP_TERMS:
        count = _python_int(frames.shape[2])
        return F.fold(frames, (1, n + hop * (count - 1)), (1, n), stride=(1, hop)).flatten(1)
    blocks = frames.transpose(1, 2).unflatten(2, (terms, g))  # [B, F, R, g]
    total = None
    for j in range(terms):
        spread = F.pad(blocks[:, :, j:j + 1], (0, 0, 0, stride - 1)).flatten(1, 2)  # [B, F stride, g]
        placed = F.pad(spread, (0, 0, j, terms - stride - j))  # [B, (F - 1) stride + R, g]
        total = placed if total is None else total + placed
    return total.flatten(1)


ENVELOPE_MIN = 1e-11
"""torch.istft refuses windows whose squares overlap-added fall below this within the signal it returns."""


def _istft(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.istft of a real signal from a complex spectrum [(B,) bins, F], as torch computes it: the inverse
    one-sided transform of each frame (the first n_fft // 2 + 1 bins of a full spectrum), times the window
    (centred in n_fft), overlap-added (`_overlap_added`) and divided by the window's squares overlap-added, cut
    from n_fft // 2 (center) to the length. Dynamo's export of torch's wrote the overlap-add as one scatter a sample
    of the window, with int32 indices no ONNX ScatterND takes; the legacy exporter has no complex tensors.
    Returning a complex signal stays torch's."""
    def istft(input: torch.Tensor, n_fft: int, hop_length: int | None = None, win_length: int | None = None,
              window: torch.Tensor | None = None, center: bool = True, normalized: bool = False,
              onesided: bool | None = None, length: int | None = None, return_complex: bool = False) -> torch.Tensor:
        if return_complex or not input.is_complex() or input.dim() not in (2, 3):
            return original(input, n_fft, hop_length, win_length, window, center, normalized, onesided, length,
                            return_complex)
        batched = input.dim() == 3
        spectrum = input if batched else input.unsqueeze(0)
        hop, width = hop_length or n_fft // 4, win_length or n_fft
        if window is None:
            window = torch.ones(width, dtype=spectrum.real.dtype)
        left = (n_fft - width) // 2
        window = F.pad(window, (left, n_fft - width - left))
        frames = torch.fft.irfft(spectrum[:, :n_fft // 2 + 1], n=n_fft, dim=1, norm="ortho" if normalized else None)
        count = _python_int(spectrum.shape[2])
        signal = _overlap_added(frames * window[:, None], hop)
        envelope = _overlap_added(window.square()[None, :, None].expand(1, n_fft, count), hop)
        start = n_fft // 2 if center else 0
        made = n_fft + hop * (count - 1)
        end = start + length if length is not None else made - start
        if not torch.jit.is_tracing() and not is_fake(envelope) and \
                bool(envelope[:, start:end].abs().min() < ENVELOPE_MIN):  # torch's check, where values are real
            raise RuntimeError(f"istft: the window's squares overlap-added fall below {ENVELOPE_MIN} between "
                               f"samples {start} and {min(end, made)} (torch refuses this too: 'window overlap add "
                               "min'); use a window that overlaps there, or center=True")
        y = signal[:, start:end] / envelope[:, start:end]
        if end > made:
            y = F.pad(y, (0, end - made))
        return y if batched else y.squeeze(0)

    return istft


def _local_response_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def local_response_norm(x: torch.Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0
                            ) -> torch.Tensor:
        if x.dim() < 3:
            return original(x, size, alpha, beta, k)
        squares = F.pad(x * x, [0, 0] * (x.dim() - 2) + [size // 2, (size - 1) // 2])  # zero channels around
        channels = x.shape[1]
        total = squares[:, :channels]
        for j in range(1, size):
            total = total + squares[:, j:j + channels]
        return x / (total / size * alpha + k) ** beta

    return local_response_norm


def _instance_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Instance norm with running statistics (`track_running_stats=True`), which the legacy exporter refuses for a
    run-time batch. In training: each sample and channel normalized by its own mean and biased variance, and the
    running statistics moved towards the batch's mean of them (the variance unbiased), as torch's, which runs a
    batch norm of the samples' channels side by side and averages its statistics over the batch. The buffers change
    in place without grad, so the export carries them back (`export.Exported.updates`)."""
    def instance_norm(x: torch.Tensor, running_mean: torch.Tensor | None = None,
                      running_var: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, use_input_stats: bool = True, momentum: float = 0.1,
                      eps: float = 1e-5) -> torch.Tensor:
        if (running_mean is None or running_var is None) and x.dtype == torch.float64 and use_input_stats:
            return _normalized_groups(x, x.shape[1], weight, bias, eps)  # as `_group_norm`'s, a group a channel
        if running_mean is None or running_var is None:
            return original(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
        axes = list(range(2, x.dim()))
        per_channel = [1, -1] + [1] * len(axes)
        if use_input_stats:
            mean = x.mean(axes, keepdim=True)
            y = (x - mean) * torch.rsqrt(x.var(axes, unbiased=False, keepdim=True) + eps)
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.flatten(1).mean(0), alpha=momentum)
                running_var.mul_(1 - momentum).add_(x.var(axes, unbiased=True).mean(0), alpha=momentum)
        else:  # evaluation: by the running statistics (refused by the exporter alike)
            y = (x - running_mean.reshape(per_channel)) * torch.rsqrt(running_var.reshape(per_channel) + eps)
        if weight is not None:
            y = y * weight.reshape(per_channel)
        return y if bias is None else y + bias.reshape(per_channel)

    return instance_norm


def _normalized_groups(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float) -> torch.Tensor:
    """Each sample's channel groups normalized by their mean and biased variance, then the per-channel affine."""
    grouped = x.reshape(x.shape[0], groups, -1)
    mean, var = grouped.mean(-1, keepdim=True), grouped.var(-1, unbiased=False, keepdim=True)
    y = ((grouped - mean) * torch.rsqrt(var + eps)).reshape(x.shape)
    per_channel = [1, -1] + [1] * (x.dim() - 2)
    if weight is not None:
        y = y * weight.reshape(per_channel)
    return y if bias is None else y + bias.reshape(per_channel)


def _group_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Group norm (and instance norm without running statistics, a group a channel) in float64 as
    `_normalized_groups`: the exporters write it as an InstanceNormalization, which onnxruntime runs in float32 only
    (the module was refused at its session's load)."""
    def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        if input.dtype != torch.float64:
            return original(input, num_groups, weight, bias, eps)
        return _normalized_groups(input, num_groups, weight, bias, eps)

    return group_norm


def _rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x * torch.rsqrt((x * x).mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight


def _bilinear(input1: torch.Tensor, input2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
    """input1 times the weight as [in1, out * in2], then each output's row times input2, summed: an einsum over the
    inputs' leading axes stopped the gradient build where their sizes had different names (slices of one tensor)."""
    out, in1, in2 = untraced_ints(*weight.shape)
    rows = torch.matmul(input1, weight.transpose(0, 1).reshape(in1, out * in2)).unflatten(-1, (out, in2))
    y = (rows * input2.unsqueeze(-2)).sum(-1)
    return y if bias is None else y + bias


def _variable_bags(input: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, mode: str,
                   per_sample_weights: torch.Tensor | None, include_last_offset: bool, padding_idx: int | None
                   ) -> torch.Tensor:
    """Sums, means or maxima of bags of a 1-D input that `offsets` cut: each position's bag is the number of bag
    starts at or before it, less one (ones scatter-added at the starts, then cumsum: empty bags share their start,
    and the elements go to the last of them, as in torch); the rows are scatter-added (or scatter-maxed) into their
    bags."""
    length = input.shape[0]
    starts = offsets[:-1] if include_last_offset else offsets
    bags = starts.shape[0]
    ones = torch.ones_like(starts, dtype=weight.dtype)  # scatter_add: the exporter's 1-D index_add is malformed
    marks = torch.zeros(length + 1, dtype=weight.dtype).scatter_add(0, starts, ones)  # a trailing empty bag: at L
    bag = (torch.cumsum(marks[:length], 0) - 1).to(torch.int64)
    rows = F.embedding(input, weight)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None]
    kept = torch.ones(length, dtype=weight.dtype) if padding_idx is None else (input != padding_idx).to(weight.dtype)
    if padding_idx is not None:
        rows = rows * kept[:, None]
    if mode == "max":  # the rows' maximum per bag (padding rows at -inf); empty bags, and padding-only ones, 0
        if padding_idx is not None:
            rows = torch.where(kept[:, None] > 0, rows, torch.full((), -math.inf, dtype=rows.dtype))
        index = bag[:, None].expand_as(rows)
        peak = torch.zeros(bags, weight.shape[1], dtype=weight.dtype).scatter_reduce(
            0, index, rows, "amax", include_self=False)
        peak = _first_maximum(rows, index, peak)
        # == -inf, not isneginf: the legacy exporter has no isneginf (the module went to dynamo)
        return peak if padding_idx is None else torch.where(peak == -math.inf, torch.zeros_like(peak), peak)
    total = torch.zeros(bags, weight.shape[1], dtype=weight.dtype).scatter_add(0, bag[:, None].expand_as(rows), rows)
    if mode == "sum":
        return total
    count = torch.zeros(bags, dtype=weight.dtype).scatter_add(0, bag, kept)
    return total / count.clamp(min=1)[:, None]


def _first_maximum(rows: torch.Tensor, index: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """`peak` (the rows' maxima scattered into their bags by `index`) as the first of each bag's rows that reach it,
    gathered: torch's backward gives a tie's gradient to that row alone (the scatter's split it among them). A bag
    no row reaches (an empty one) keeps `peak`'s value."""
    length = rows.shape[0]
    position = torch.arange(length)[:, None].expand_as(rows).to(rows.dtype)
    reached = torch.where(rows == peak.gather(0, index), position, torch.full_like(rows, math.inf))
    first = torch.full_like(peak, math.inf).scatter_reduce(0, index, reached, "amin", include_self=True)
    found = first < math.inf
    picked = rows.gather(0, torch.where(found, first, torch.zeros_like(first)).to(torch.int64))
    return torch.where(found, picked, peak)


def _embedding_bag(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def embedding_bag(input: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None,
                      max_norm: float | None = None, norm_type: float = 2, scale_grad_by_freq: bool = False,
                      mode: str = "mean", sparse: bool = False, per_sample_weights: torch.Tensor | None = None,
                      include_last_offset: bool = False, padding_idx: int | None = None) -> torch.Tensor:
        variable = input.dim() == 1 and offsets is not None and mode in ("sum", "mean", "max")
        fixed = input.dim() == 2 and offsets is None and mode in ("sum", "mean", "max")
        if max_norm is not None and (variable or fixed):
            _renorm_(input, weight, max_norm, norm_type)
            max_norm = None
        if not (variable or fixed) or max_norm is not None or (per_sample_weights is not None and mode != "sum"):
            return original(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode, sparse,
                            per_sample_weights, include_last_offset, padding_idx)  # which checks and raises
        if variable:
            return _variable_bags(input, weight, offsets, mode, per_sample_weights, include_last_offset, padding_idx)
        rows = F.embedding(input, weight)  # [bags, bag size, dim]: fixed-size bags, one a row of input
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[..., None]
        kept = None if padding_idx is None else (input != padding_idx)[..., None]
        if mode == "max":
            lowest = torch.full((), float("-inf"), dtype=rows.dtype)
            picked = rows.max(1).values if kept is None else torch.where(kept, rows, lowest).max(1).values
            return picked if kept is None else torch.where(kept.any(1), picked, torch.zeros_like(picked))
        if kept is not None:
            rows = torch.where(kept, rows, torch.zeros_like(rows))
        total = rows.sum(1)
        if mode == "sum":
            return total
        if kept is None:
            return total / rows.shape[1]
        return total / kept.sum(1).to(rows.dtype).clamp(min=1)  # an empty bag: its total, zeros

    return embedding_bag


def _without_out(out: Any, name: str) -> None:
    """The written-out functions return new tensors; an `out=` argument is refused by name."""
    if out is not None:
        raise TypeError(f"ORTModule exports {name} without `out`")


def _hypot(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    _without_out(out, "torch.hypot")
    return torch.sqrt(a * a + b * b)


def _atan2(y: torch.Tensor, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch's atan2 by quadrant, defined where x is 0 (the legacy exporter's atan(y / x) is nan at (0, 0), where
    torch's is 0): atan(y / x), plus or minus pi where x < 0 (by y's sign, a zero's too); sign(y) pi / 2 - x / y
    where x = 0 (its derivatives there are torch's, x / (x^2 + y^2) = 0 and -y / (x^2 + y^2) = -1 / y), 0 at (0, 0),
    with torch's zero gradients there."""
    _without_out(out, "torch.atan2")
    y, x = torch.broadcast_tensors(y, x)
    axis = x == 0
    flat = y == 0
    base = torch.atan(y / torch.where(axis, torch.ones_like(x), x))
    upper = (y > 0) | (flat & (1 / y > 0))  # +0 above the negative x axis, -0 below it (1 / -0 is -inf), as torch's
    turned = torch.where(upper, base + math.pi, base - math.pi)
    # x / inf at the origin: torch's gradient there is 0 (x's through 1 was -1)
    on_axis = torch.sign(y) * (math.pi / 2) - x / torch.where(flat, torch.full_like(y, math.inf), y)
    return torch.where(axis, on_axis, torch.where(x < 0, turned, base))


def _angle(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """angle of a complex tensor as `_atan2`(imag, real): dynamo's conversion took pi for -pi where the imaginary
    part is +0 and the real part negative (a real transform's first and middle bins: phase features)."""
    def angle(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        _without_out(out, "torch.angle")
        return _atan2(x.imag, x.real) if x.is_complex() else original(x)

    return angle


def _expm1(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(x) - 1 as tanh(x / 2) (exp(x) + 1), the same value without exp(x) - 1's cancellation near 0 (whose
    precision is why a module calls expm1); the legacy exporter has no expm1."""
    _without_out(out, "torch.expm1")
    return torch.tanh(x / 2) * (torch.exp(x) + 1)


def _addcdiv(input: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, *, value: float = 1,
             out: torch.Tensor | None = None) -> torch.Tensor:
    _without_out(out, "torch.addcdiv")
    return input + value * (tensor1 / tensor2)


def _sinc(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """sin(pi x) / (pi x), 1 at 0 with torch's derivative there, 0 (SincNet's band-pass filters evaluate it at 0);
    the legacy exporter has no sinc."""
    _without_out(out, "torch.sinc")
    zero = x == 0
    # pi as a tensor (`exact`): dynamo's float64 pi was float32's, sinc ~1e-8 off
    scaled = exact(math.pi, x) * torch.where(zero, torch.ones_like(x), x)  # finite in the branch not taken
    return torch.where(zero, torch.ones_like(x), torch.sin(scaled) / scaled)


def _degrees(original: Callable[..., torch.Tensor], factor: float) -> Callable[..., torch.Tensor]:
    """deg2rad and rad2deg as x times pi / 180 (180 / pi) kept at its value (`exact`): both exporters wrote the
    factor in float32, 8.7e-9 off in float64."""
    def convert(x: torch.Tensor) -> torch.Tensor:
        return x * exact(factor, x) if x.is_floating_point() else original(x)

    return convert


def _diff(x: torch.Tensor, n: int = 1, dim: int = -1, prepend: torch.Tensor | None = None,
          append: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The n-th forward difference along `dim` as torch's: `prepend` and `append` joined first, then n times a
    slice less its neighbour (the legacy exporter has no diff)."""
    _without_out(out, "torch.diff")
    x = torch.cat([t for t in (prepend, x, append) if t is not None], dim) if prepend is not None or \
        append is not None else x
    for _ in range(n):
        x = x.narrow(dim, 1, x.shape[dim] - 1) - x.narrow(dim, 0, x.shape[dim] - 1)
    return x


def _kthvalue(x: torch.Tensor, k: int, dim: int = -1, keepdim: bool = False, *,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
    """The k-th smallest along `dim` and its index, as the last of TopK's k smallest (the legacy exporter has no
    kthvalue); its gradient goes to that index, as torch's does."""
    _without_out(out, "torch.kthvalue")
    values, indices = torch.topk(x, k, dim, largest=False, sorted=True)
    if keepdim:
        return torch.return_types.kthvalue((values.narrow(dim, k - 1, 1), indices.narrow(dim, k - 1, 1)))
    return torch.return_types.kthvalue((values.select(dim, k - 1), indices.select(dim, k - 1)))


def _nansum(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum with NaN taken as 0 (its gradient 0 there, as torch's); the legacy exporter has no nansum."""
    _without_out(out, "torch.nansum")
    kept = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    return kept.sum(dtype=dtype) if dim is None else kept.sum(dim, keepdim, dtype=dtype)


def _nanmean(x: torch.Tensor, dim: Any = None, keepdim: bool = False, *, dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over the elements that are not NaN (NaN where all are, as torch's: 0 / 0), and where all are, NaN
    gradients to them, as torch's (its nansum's gradient, g / 0 times the mask, is NaN there; `_nansum`'s Where
    gave 0): the sum of those elements times 0, over the count 0."""
    _without_out(out, "torch.nanmean")
    present = (~torch.isnan(x)).to(dtype or x.dtype)
    count = present.sum() if dim is None else present.sum(dim, keepdim)
    empty = (x * 0).sum(dtype=dtype) if dim is None else (x * 0).sum(dim, keepdim, dtype=dtype)
    return torch.where(count > 0, _nansum(x, dim, keepdim, dtype=dtype), empty) / count


def _count_nonzero(x: torch.Tensor, dim: Any = None) -> torch.Tensor:
    """The number of non-zero elements (int64), as torch's; the legacy exporter has no count_nonzero."""
    nonzero = (x != 0).to(torch.int64)
    return nonzero.sum() if dim is None else nonzero.sum(dim)


def _histc(x: torch.Tensor, bins: int = 100, min: float = 0.0, max: float = 0.0, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.histc (a mixture-of-experts load-balancing loss counts its routed tokens so; no gradient): element e
    in bin k where edge k <= e < edge k + 1 (the last bin to max included), the edges torch's linspace(min, max,
    bins + 1), elements outside ignored; min == max takes the data's (widened by 1 where equal). A comparison with
    every edge and with every bin (O(elements x bins) booleans); the legacy exporter has no histc."""
    _without_out(out, "torch.histc")
    flat = x.detach().reshape(-1)
    if min == max:
        low, high = flat.min(), flat.max()
        same = (low == high).to(x.dtype)
        low, high = low - same, high + same
        edges = low + (high - low) * (torch.arange(bins + 1, dtype=x.dtype) / bins)
        inside = (flat >= low) & (flat <= high)
    else:
        edges = torch.linspace(min, max, bins + 1, dtype=x.dtype)
        inside = (flat >= min) & (flat <= max)
    index = (flat[:, None] >= edges[1:-1]).sum(1)
    return ((index[:, None] == torch.arange(bins)) & inside[:, None]).sum(0).to(x.dtype)


def _copysign(a: torch.Tensor, b: Any, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """|a| with b's sign, -0.0's included (a float result for integers, as torch's); a's gradient torch's, 0 at
    a = 0, none to b. Neither exporter has copysign."""
    _without_out(out, "torch.copysign")
    a = a if a.is_floating_point() else a.to(torch.get_default_dtype())
    if not isinstance(b, torch.Tensor):
        return a.abs() * math.copysign(1.0, b)
    negative = (b < 0) | ((b == 0) & (1 / b < 0))
    return torch.where(negative, -a.abs(), a.abs())


def _searchsorted(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.searchsorted of a tensor of values (NeRF's hierarchical sampling) as counts of the sorted values below
    each (at most each, `right` or side="right"), along the sequence's last axis (its leading ones the values'),
    after `sorter` where given; int64, or int32 with out_int32. O(values x sequence) booleans; neither exporter
    has searchsorted. A Python number: torch's own."""
    def searchsorted(seq: torch.Tensor, values: Any, *, out_int32: bool = False, right: bool = False,
                     side: str | None = None, sorter: torch.Tensor | None = None, out: Any = None) -> torch.Tensor:
        if not isinstance(values, torch.Tensor):
            return original(seq, values, out_int32=out_int32, right=right, side=side, sorter=sorter)
        _without_out(out, "torch.searchsorted")
        seq = seq if sorter is None else seq.gather(-1, sorter)
        seq = seq if seq.dim() == 1 else seq.unsqueeze(-2)
        before = seq <= values.unsqueeze(-1) if right or side == "right" else seq < values.unsqueeze(-1)
        return before.sum(-1).to(torch.int32 if out_int32 else torch.int64)

    return searchsorted


def _trace(x: torch.Tensor) -> torch.Tensor:
    """The sum of a matrix's diagonal (`_diagonal`); the legacy exporter has no trace."""
    return _diagonal(x).sum()


def _cov(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.cov without weights (rows are variables, columns observations; 0-d for one variable), and corrcoef
    from it, clipped to [-1, 1] as torch's: the legacy exporter has neither. The divisor N - correction is a
    1-element tensor in x's type (a traced size combined with a Python number would be float32)."""
    def cov(x: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
            aweights: torch.Tensor | None = None) -> torch.Tensor:
        if fweights is not None or aweights is not None or x.dim() > 2 or not x.is_floating_point():
            return original(x, correction=correction, fweights=fweights, aweights=aweights)
        rows = x if x.dim() == 2 else x.reshape(1, -1)
        centred = rows - rows.mean(1, keepdim=True)
        divisor = (centred.new_ones(1).mul(rows.shape[1]) - correction).clamp(min=0)
        product = centred @ centred.transpose(0, 1) / divisor
        return product if x.dim() == 2 else product.reshape(())

    return cov


def _corrcoef(x: torch.Tensor) -> torch.Tensor:
    c = torch.cov(x)  # the replaced cov while exporting
    if c.dim() == 0:
        return c / c
    spread = torch.sqrt(_diagonal(c))
    return (c / spread[:, None] / spread[None, :]).clamp(-1, 1)


def _diagonal(x: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> torch.Tensor:
    """torch.diagonal without the legacy exporter's If (which gradients cannot pass): the two axes moved last and
    flattened, every (columns + 1)-th element from the diagonal's first. A view of x, as torch's, where the two
    axes flatten without a copy (a contiguous matrix): writes through it (`u.diagonal(1).copy_(v)`) reach x in
    torch's run, so the first call's check sees whether the export kept them. Otherwise a copy
    (`_diagonal_copy`), and the export refused if anything writes into it (`_written_copies`): torch's view would
    have passed the write on, silently lost in both runs."""
    y = x.movedim((dim1, dim2), (-2, -1))
    flat = y.flatten(-2)
    if not flat._is_view():  # flatten copied (dynamo's fake tensors have no storage to compare)
        return _written_copies.watch(_diagonal_copy(y, offset))
    columns = y.shape[-1]
    if offset >= 0:  # as many as there are columns from `offset` on, or rows (the step stops at the last row)
        left = y[..., offset:].shape[-1]  # Slice clamps: 0 past the matrix, no sizes compared in Python
        return flat[..., offset::columns + 1][..., :left]
    return flat[..., -offset * columns::columns + 1][..., :columns]  # from row -offset, at most a row's worth


def _diagonal_copy(y: torch.Tensor, offset: int) -> torch.Tensor:
    """The diagonal of y's last two axes: the columns from `offset` on (a negative offset is the transpose's), the
    rows cut to as many as columns are left (Slice clamps both ends, so no sizes are compared in Python), and every
    (columns + 1)-th element of that matrix flattened (a copy where the cut matrix is not contiguous)."""
    if offset < 0:
        y, offset = y.transpose(-2, -1), -offset
    if offset:
        y = y[..., offset:]
    columns = y.shape[-1]
    return y[..., :columns, :].flatten(-2)[..., ::columns + 1]


class _WrittenCopies:
    """Copies handed out where torch hands out views, and their versions then: `checked` raises at its end where
    one was written to in place since (the write would have reached the viewed tensor in torch)."""

    def __init__(self) -> None:
        self.watched: list[tuple[torch.Tensor, int]] = []

    def watch(self, copy: torch.Tensor) -> torch.Tensor:
        self.watched.append((copy, copy._version))
        return copy

    @contextlib.contextmanager
    def checked(self) -> Iterator[None]:
        self.watched = []
        try:
            yield
            if any(copy._version != version for copy, version in self.watched):
                raise RuntimeError(
                    "the forward writes in place into a diagonal (x.diagonal(...).copy_(...), fill_, ...) of axes "
                    "that do not flatten without a copy (not contiguous): the export computes it as a copy, which "
                    "the write would not pass through to x as torch's view does. Write it out of place (x + "
                    "torch.diag_embed(...), torch.where with an eye mask) or make x contiguous first")
        finally:
            self.watched = []


_written_copies = _WrittenCopies()


def _diag(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.diag: a matrix's diagonal (`_diagonal`, copied: torch's is no view), or a vector on the diagonal of a
    square matrix (offset 0); the legacy exporter has neither."""
    def diag(x: torch.Tensor, diagonal: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None and x.dim() == 2:
            return _diagonal(x, diagonal).clone()
        if out is None and x.dim() == 1 and diagonal == 0:
            return x.unsqueeze(-1) * torch.eye(x.shape[0], dtype=x.dtype)
        return original(x, diagonal, out=out)

    return diag


def _matrix_transpose(x: torch.Tensor) -> torch.Tensor:
    """x.mT (and mH and adjoint() of real tensors): the last two axes swapped; the legacy exporter has neither."""
    if x.is_complex():
        raise TypeError("ORTModule exports mH and adjoint of real tensors only")
    return x.transpose(-2, -1)


def _tile(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """torch.tile as repeat, its dims padded with ones in front (the legacy exporter writes tile with an If, which
    gradients cannot pass)."""
    dims = tuple(dims)
    return x.repeat((1,) * (x.dim() - len(dims)) + dims)


def _sizes(dims: tuple[Any, ...]) -> tuple[int, ...]:
    """Sizes given as varargs or as one sequence (`x.tile(2, 1)`, `x.tile((2, 1))`)."""
    return tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims


def _take_along_dim(x: torch.Tensor, indices: torch.Tensor, dim: int | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.take_along_dim as a gather of both broadcast to each other but along `dim` (over the flattened input
    without one); the legacy exporter has none."""
    _without_out(out, "torch.take_along_dim")
    if dim is None:
        return x.reshape(-1).gather(0, indices.reshape(-1))
    # broadcast by adding zeros one long along `dim` (sizes compared as Python numbers would bake the trace's in)
    return (x + torch.zeros_like(indices.narrow(dim, 0, 1), dtype=x.dtype)).gather(
        dim, indices + torch.zeros_like(x.narrow(dim, 0, 1), dtype=indices.dtype))


def _vdot(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def vdot(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None or a.is_complex() or b.is_complex():
            return original(a, b, out=out)
        return (a * b).sum()

    return vdot


def _as_tensor(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.as_tensor, given a copy of a number the legacy trace made a 0-d tensor of (`traced_number`): a
    tensor in torch's call, not the number itself, which as_tensor would return (the trace binds its conversion
    to the number's own tensor, so a returned `n` read as that tensor)."""
    def as_tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, torch.Tensor) and torch.jit.is_tracing() and traced_number(data):
            data = data.clone()
        return original(data, *args, **kwargs)

    return as_tensor


def _as_strided(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """as_strided reads its input's memory; the legacy exporter's Gather reads the input's elements in their logical
    order, from the first, at an offset counted from there: the same only for a contiguous input whose memory starts
    its storage, or read from its own start (Longformer chunks a transposed projection so: its local attention 1%
    off, which the first call's check of the logits did not see). Under that trace a dense input is read as a copy
    in its memory order, the offset counted from its start. Memory between or outside the input's elements, which
    torch reads but passes no gradient to (its memory is not the input's), is refused: a graph holds no memory."""
    def as_strided(x: torch.Tensor, size: Sequence[int], stride: Sequence[int],
                   storage_offset: int | None = None) -> torch.Tensor:
        start = x.storage_offset()
        if not torch.jit.is_tracing() or (x.is_contiguous() and (storage_offset is None or start == 0)):
            return original(x, size, stride, storage_offset)
        sizes = untraced_ints(*size)
        if 0 in sizes:  # reads nothing
            return original(x, size, stride, storage_offset)
        offset = start if storage_offset is None else storage_offset
        extents = [(n - 1) * s for n, s in zip(sizes, stride)]
        first, last = offset + sum(min(e, 0) for e in extents), offset + sum(max(e, 0) for e in extents)
        order = list(range(x.dim())) if x.is_contiguous() else memory_order(x)
        if order is None or first < start or last >= start + untraced_ints(x.numel())[0]:
            raise RuntimeError(f"as_strided of a tensor of sizes {list(x.shape)} and strides {list(x.stride())} at "
                               f"offset {start}, reading memory from {first} to {last}, outside or between its "
                               "elements: an ONNX graph holds no memory to read that from. Read such windows from "
                               "a contiguous tensor holding them (as_strided of x.contiguous(), or Tensor.unfold)")
        return original(x.permute(order).clone(memory_format=torch.contiguous_format), size, stride, offset - start)

    return as_strided


def _tensor_unfold(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def unfold(x: torch.Tensor, dimension: int, size: int, step: int) -> torch.Tensor:
        if x.dim() == 0:
            return original(x, dimension, size, step)
        d = dimension % x.dim()
        windows = (x.shape[d] - size) // step + 1
        index = (torch.arange(windows) * step)[:, None] + torch.arange(size)[None, :]  # [windows, size]
        picked = x.index_select(d, index.reshape(-1))
        return picked.reshape(*x.shape[:d], windows, size, *x.shape[d + 1:]).movedim(d + 1, -1)

    return unfold


def _gumbel_softmax(logits: torch.Tensor, tau: float = 1.0, hard: bool = False, eps: float = 1e-10,
                    dim: int = -1) -> torch.Tensor:
    gumbels = -torch.empty_like(logits).exponential_().log()  # torch's (`torch_draws`: its draws under torch_dropout)
    soft = ((logits + gumbels) / tau).softmax(dim)
    if not hard:
        return soft
    index = soft.argmax(dim, keepdim=True)
    return torch.zeros_like(logits).scatter(dim, index, 1.0) - soft.detach() + soft  # straight through


def _randint(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.randint(low, high, size) as floor(low + (high - low) u), u uniform in float64 (the legacy exporter's
    conversion needs constant bounds: `randint(0, x.shape[0], ...)`, indices drawn within the batch, failed). Draws
    of the law torch's have, not its values (other random ops keep onnxruntime's draws, module docstring)."""
    def randint(*args: Any, generator: Any = None, dtype: torch.dtype | None = None, **options: Any) -> torch.Tensor:
        named = {k: options.pop(k) for k in ("low", "high", "size") if k in options}
        if generator is not None or options.get("out") is not None:
            return original(*args, generator=generator, dtype=dtype, **named, **options)
        bound = dict(zip(("low", "high", "size") if len(args) + len(named) == 3 else ("high", "size"), args))
        bound.update(named)  # bounds may be the legacy trace's sizes (0-d tensors)
        u = torch.rand(bound["size"], dtype=torch.float64, device=options.get("device"))
        low = bound.get("low", 0)
        return (low + (bound["high"] - low) * u).floor().to(dtype or torch.int64)

    return randint


def _randperm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.randperm(n) as the order of n uniforms (neither exporter has randperm: a batch shuffled inside the
    forward, mixup's partners); a permutation of the law torch's have, not its values. With a generator or `out`:
    torch's own."""
    def randperm(n: Any, *, generator: Any = None, dtype: torch.dtype | None = None, **options: Any) -> torch.Tensor:
        if generator is not None or options.get("out") is not None:
            return original(n, generator=generator, dtype=dtype, **options)
        return torch.rand(n, device=options.get("device")).argsort().to(dtype or torch.int64)

    return randperm


def _linspace(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.linspace of float64 over a traced number of steps (`torch.linspace(-1, 1, x.shape[1])`): the legacy
    exporter's conversion computes start + step * i in float32 whatever the dtype (5e-8 off); written out as torch's
    kernel computes it, in float64, the first half from start and the rest back from end (a single step is
    start). Other calls keep torch's function (a constant number of steps is folded by the exporter, dynamo's is
    exact)."""
    def linspace(start: Any, end: Any, steps: Any, *args: Any, dtype: torch.dtype | None = None,
                 **options: Any) -> torch.Tensor:
        plain = isinstance(start, (int, float)) and isinstance(end, (int, float)) and not args
        if not (plain and isinstance(steps, torch.Tensor) and options.get("out") is None
                and (dtype or torch.get_default_dtype()) == torch.float64):
            return original(start, end, steps, *args, dtype=dtype, **options)
        n = steps.to(torch.float64).reshape(1)
        i = torch.arange(steps, dtype=torch.float64)
        first, last = exact(start, i), exact(end, i)  # the numbers in float64 (the exporter writes float32 ones)
        step = (last - first) / torch.clamp(n - 1, min=1)
        values = torch.where(i < steps // 2, first + step * i, last - step * (n - 1 - i))
        return torch.where(steps == 1, first, values)

    return linspace


def _linspace_from_neg_one(n: Any, align_corners: bool, dtype: torch.dtype) -> torch.Tensor:
    """torch's affine_grid axis, bit for bit in float32: its linspace(-1, 1, n) (the first half -1 + step*i, the
    rest 1 - step*(n-1-i), each one rounding from float64, as its fused multiply-add), times (n-1)/n without
    align_corners. At the identity transform (the spatial transformer tutorial's start) every sample then lands on
    a pixel exactly where torch's does: bilinear sampling has a kink there, and an ulp either side picked the other
    one-sided difference (theta's gradient 10% off torch's)."""
    if isinstance(n, int) and n <= 1:
        return torch.zeros(n, dtype=dtype)  # torch's single position: the centre
    i = torch.arange(n, dtype=torch.float64)
    # float32's step, kept so as a vector: `double_scalars.sizes_in_double` computes 0-d float32 arithmetic on sizes
    # cast to float64 in float64 (a Python number's, `d ** -0.5`, which torch computes in double)
    step = (torch.tensor(2.0, dtype=torch.float32) / (n - 1)).reshape(1).double()
    axis = torch.where(i < n // 2, step * i - 1, 1 - step * (n - 1 - i)).to(dtype)
    if not align_corners:
        axis = axis * (n - 1) / n
    return axis


def _affine_grid(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def affine_grid(theta: torch.Tensor, size: Sequence[Any], align_corners: bool) -> torch.Tensor:
        if len(size) != 4:
            return original(theta, size, align_corners)
        axes = [_linspace_from_neg_one(n, align_corners, theta.dtype) for n in (size[3], size[2])]  # x, then y
        xs = axes[0][None, :].expand(size[2], size[3])
        ys = axes[1][:, None].expand(size[2], size[3])
        base = torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(1, -1, 3)  # [1, H*W, 3]
        return torch.matmul(base, theta.transpose(1, 2)).reshape(theta.shape[0], size[2], size[3], 2)

    return affine_grid


def _max_unpool(dims: int) -> Callable[..., torch.Tensor]:
    def max_unpool(x: torch.Tensor, indices: torch.Tensor, kernel_size: Sequence[int] | int,
                   stride: Sequence[int] | int | None = None, padding: Sequence[int] | int = 0,
                   output_size: Sequence[int] | None = None) -> torch.Tensor:
        kernel, pads = _per_axis(kernel_size, dims), _per_axis(padding, dims)
        strides = _per_axis(kernel_size if stride is None else stride, dims)
        lead = x.shape[:-dims]
        size = (list(output_size)[-dims:] if output_size is not None else
                [(x.shape[i - dims] - 1) * strides[i] - 2 * pads[i] + kernel[i] for i in range(dims)])
        spread = x.new_zeros(*lead, math.prod(size)).scatter(-1, indices.flatten(-dims), x.flatten(-dims))
        return spread.reshape(*lead, *size)

    return max_unpool


def _attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention` written out as torch defines it: a row that the mask (boolean, causal, or
    float with -inf) leaves no key gets zeros and no gradient, as torch's; the softmax's NaN there had reached the
    output (a float mask's: a padding mask's fully padded sequence) or every gradient (a boolean one's). Such rows
    are read off the mask (smaller than the scores where it broadcasts), unmasked for the softmax and zeroed after,
    as `symbolics._attention`."""
    # in the query's type, not 0-d: the legacy exporter computes 0-d tensors with traced sizes in float32
    factor = query.new_ones(1).mul(query.shape[-1]).rsqrt() if scale is None else scale
    scores = query @ key.transpose(-2, -1) * factor
    allowed = None
    if is_causal:
        allowed = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    empty = None
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        scores = scores.masked_fill(~(allowed | empty), float("-inf"))
    elif attn_mask is not None:
        empty = attn_mask.amax(-1, keepdim=True) == float("-inf")
        scores = scores + attn_mask.masked_fill(empty, 0.0)
    weights = torch.softmax(scores, -1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return weights @ value


def _attention(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Grouped-query attention (`enable_gqa`) with its key and value heads repeated; float64 attention written out
    (`_attention_math`): the legacy exporter's translation takes float32, float16 and bfloat16 only (a float64
    nn.TransformerEncoderLayer with a padding mask failed to export). Under a mask that leaves a query no key (a
    fully padded sequence), torch's attention gives that row zeros and no gradient; both exporters' translations
    gave a float mask's NaN, a boolean one's NaN gradient reaching every key and value (legacy) or the values' mean
    (dynamo): such rows are unmasked for the call and zeroed after, as `_attention_math` does."""
    def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                                     enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
        # head counts as numbers read outside the trace: fixed by the weights, so the choice holds at every size
        # the export serves (a traced comparison would be baked in with a warning, and export again at new sizes)
        heads, kv_heads = untraced_ints(query.shape[-3], key.shape[-3]) if enable_gqa and key.dim() >= 3 else (0, 0)
        if heads != kv_heads:
            groups = heads // kv_heads  # each key/value head serves that many query heads in a row
            key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
        if query.dtype == torch.float64:
            return _attention_math(query, key, value, *args, **kwargs)
        bound = inspect.signature(_attention_math).bind(query, key, value, *args, **kwargs)
        mask = bound.arguments.get("attn_mask")
        if mask is None or bound.arguments.get("is_causal"):  # a causal mask never empties a row
            return original(query, key, value, *args, **kwargs)
        empty = ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else mask.amax(-1, keepdim=True) == -math.inf
        bound.arguments["attn_mask"] = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
        given = {k: v for k, v in bound.arguments.items() if k not in ("query", "key", "value")}  # scale: by keyword
        return original(query, key, value, **given).masked_fill(empty, 0.0)

    return scaled_dot_product_attention


def _bilinear_filter(t: torch.Tensor) -> torch.Tensor:
    """The triangle of antialiased bilinear resampling (torch's and PIL's)."""
    return (1 - t.abs()).clamp(min=0)


def _bicubic_filter(t: torch.Tensor, a: float = -0.5) -> torch.Tensor:
    """Keys' cubic with a = -0.5 (PIL's), which torch's antialiased bicubic takes."""
    t = t.abs()
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = (((t - 5) * t + 8) * t - 4) * a
    return torch.where(t < 1, near, torch.where(t < 2, far, torch.zeros_like(t)))


def _scaled_size(n: Any, factor: float) -> Any:
    """floor(n * factor) in double, as torch's output size: from a traced size (a tensor) as a tensor, else as a
    number (an int in torch's run, a symbolic one in dynamo's); by a whole factor n times it, exactly that (dynamo
    typed a symbolic n * 2.0 as an integer, and its Floor of that failed the gradient build)."""
    if float(factor).is_integer():
        return n * int(factor)
    if isinstance(n, torch.Tensor):
        return torch.floor(n.to(torch.float64) * factor).to(torch.int64)
    return math.floor(n * factor)


def _antialiasing_matrix(n: Any, factor: float, interp: int, kernel: Callable[[torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
    """[n, out]: the weight of input j in output i of torch's antialiased resampling of an axis of n by `factor`
    (its separable kernel), out = floor(n * factor) in double, as torch's. Sampled by the given factor, not by
    n / out: output i centred at (i + 1/2) / factor, its window [trunc(centre - support + 1/2), trunc(centre +
    support + 1/2)) cut to the input, the support interp / 2 widened by 1 / factor when shrinking and the kernel
    stretched as much, the weights over each window normalised to 1. Built from the run-time n (Range,
    comparisons), in double."""
    scale = 1 / factor
    support = interp / 2 * scale if scale >= 1 else interp / 2
    stretch = 1 / scale if scale >= 1 else 1.0
    centre = ((torch.arange(_scaled_size(n, factor), dtype=torch.float64) + 0.5) * scale)[None, :]
    position = torch.arange(n, dtype=torch.float64)[:, None]
    inside = (position >= torch.floor(centre - support + 0.5)) & (position < torch.floor(centre + support + 0.5))
    weights = torch.where(inside, kernel((position - centre + 0.5) * stretch), torch.zeros_like(position))
    return weights / weights.sum(0, keepdim=True)


def _antialiased(original: Callable[..., torch.Tensor], interp: int, kernel: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Callable[..., torch.Tensor]:
    """interpolate(antialias=True, scale_factor=...) of a 4-D input (the legacy exporter has no antialiasing; dynamo's
    Resize takes the output size, sampling by in / out where torch samples by the given factor: wrong wherever the
    size is no multiple, 7 x 0.5): products with each axis's `_antialiasing_matrix`, the last axis first as
    torch's (as adaptive pooling; 6-11x faster here than gathering each output's taps, whose backward scatters
    them, and faster than dynamo's Resize up to ~500 pixels a side). A given size (or recompute_scale_factor=True,
    which gives one), where Resize samples as torch does, and align_corners keep torch's function."""
    def resample(x: torch.Tensor, output_size: Sequence[Any] | None, align_corners: bool,
                 scale_factors: Sequence[float] | None = None) -> torch.Tensor:
        if output_size is not None or scale_factors is None or align_corners or x.dim() != 4 \
                or not x.is_floating_point():
            return original(x, output_size, align_corners, scale_factors)
        columns = _antialiasing_matrix(x.shape[3], scale_factors[1], interp, kernel).to(x.dtype)
        rows = _antialiasing_matrix(x.shape[2], scale_factors[0], interp, kernel).to(x.dtype)
        y = torch.matmul(rows.transpose(0, 1), torch.matmul(x, columns))
        # reshaped to (..., rows, -1): the legacy exporter's inference gave both resampled axes one name where the
        # traced input was square (4 x 4 from 8 x 8), which a later 7 x 5 contradicted; an inferred -1 gets its own
        return y.reshape(x.shape[0], x.shape[1], rows.shape[1], -1)

    return resample


def _sources(n: Any, out: Any, factor: float | None, align_corners: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (n, out, i, source position of output i) of torch's resampling of an axis of n to out
    (`area_pixel_compute_source_index`): i (n - 1) / (out - 1) with align_corners, else (i + 1/2) / factor - 1/2
    (n / out for the factor where none is given)."""
    # the sizes as vectors of one: the legacy exporter computes 0-d arithmetic with Python numbers in float32
    # (align_corners' (n - 1) / (out - 1) was 1e-8 off); dynamo writes the factor's reciprocal as a float32 constant
    size, cells = (_size_tensor(k).to(torch.float64).reshape(1) for k in (n, out))
    i = torch.arange(out, dtype=torch.float64)
    if align_corners:
        return size, cells, i, i * torch.where(cells > 1, (size - 1) / (cells - 1).clamp(min=1), torch.zeros_like(size))
    scale = exact(1 / factor, i) if factor else size / cells
    return size, cells, i, (i + 0.5) * scale - 0.5


def _linear_matrix(n: Any, out: Any, factor: float | None, align_corners: bool) -> torch.Tensor:
    """[n, out] float64: the weights of input j in output i of torch's linear resampling of an axis of n (its
    `compute_source_index_and_lambda`): the source position i (n - 1) / (out - 1) with align_corners, else
    (i + 1/2) / factor - 1/2 (n / out for the factor where none is given) clamped at 0; the two inputs around it
    weighted by their distance, the upper one at the last input the lower one; the identity where out is n."""
    size, cells, i, source = _sources(n, out, factor, align_corners)
    if not align_corners:
        source = source.clamp(min=0)
    lower = torch.minimum(torch.floor(source), size - 1)
    upper_weight = (source - lower).clamp(0, 1)
    upper = torch.where(lower < size - 1, lower + 1, lower)
    position = torch.arange(n, dtype=torch.float64)[:, None]
    weights = (position == lower) * (1 - upper_weight) + (position == upper) * upper_weight
    return torch.where(cells == size, (position == i).to(torch.float64), weights)


def _cubic_matrix(n: Any, out: Any, factor: float | None, align_corners: bool) -> torch.Tensor:
    """[n, out] float64: the weights of input j in output i of torch's bicubic resampling of an axis of n (its
    `upsample_bicubic2d` kernel): the source position as `_linear_matrix`'s but not clamped at 0, the four inputs
    around it (clamped to the axis) weighted by Keys' cubic convolution with A = -0.75, written as torch's."""
    size, _, _, source = _sources(n, out, factor, align_corners)
    floor = torch.floor(source)
    t = source - floor
    a = -0.75
    def near(x: torch.Tensor) -> torch.Tensor:  # cubic_convolution1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x: torch.Tensor) -> torch.Tensor:  # cubic_convolution2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    position = torch.arange(n, dtype=torch.float64)[:, None]
    taps = [(floor + k - 1).clamp(min=0) for k in range(4)]
    taps = [torch.minimum(tap, size - 1) for tap in taps]
    weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    return sum((position == tap) * w for tap, w in zip(taps, weights))


def _per_axis_resampled(x: torch.Tensor, output_size: Sequence[Any] | None, scale_factors: Any, scales: Sequence[Any],
                        dims: int, one_axis: Callable[[torch.Tensor, int, Any, float | None], torch.Tensor]
                        ) -> torch.Tensor | None:
    """x resampled axis by axis by `one_axis(x, axis, out size, factor or None where a size is given)`; None where
    torch's own function runs: unbatched, or the overload of per-axis scales (scales_h, scales_w), which
    F.interpolate does not call."""
    per_axis = bool(scales) or not (scale_factors is None or isinstance(scale_factors, (list, tuple)))
    if x.dim() != dims + 2 or per_axis:
        return None
    for k in range(dims):
        axis = x.dim() - dims + k
        factor = None if output_size is not None or scale_factors is None else scale_factors[k]
        out = output_size[k] if output_size is not None else _scaled_size(x.shape[axis], factor)
        x = one_axis(x, axis, out, factor)
    return x


def _float64_resampling(original: Callable[..., torch.Tensor], dims: int,
                        matrix: Callable[[Any, Any, float | None, bool], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """interpolate(mode="linear", "bilinear", "trilinear" with `_linear_matrix`, "bicubic" with `_cubic_matrix`) in
    float64: a product with each axis's matrix (the exporters' Resize has no double kernel in onnxruntime, and
    dynamo's 1-D linear form computed its weights in float32, 2e-7 off). Other types keep torch's function."""
    def resample(x: torch.Tensor, output_size: Sequence[Any] | None, align_corners: bool,
                 scale_factors: Sequence[float] | None = None, *scales: float | None) -> torch.Tensor:
        def one_axis(x: torch.Tensor, axis: int, out: Any, factor: float | None) -> torch.Tensor:
            weights = matrix(x.shape[axis], out, factor, align_corners)
            return torch.matmul(x.movedim(axis, -1), weights).movedim(-1, axis)

        y = _per_axis_resampled(x, output_size, scale_factors, scales, dims, one_axis) \
            if x.dtype == torch.float64 else None
        return original(x, output_size, align_corners, scale_factors, *scales) if y is None else y

    return resample


def _nearest_axis(x: torch.Tensor, axis: int, out: Any, factor: float | None, exact_mode: bool, halving: bool,
                  wide: bool) -> torch.Tensor:
    """One axis gathered at torch's source indices, floor(i * scale) (nearest-exact: floor((i + 1/2) * scale)) as
    its kernels compute them, with scale the factor's reciprocal (else n / out), clamped to the last input: in
    float32; `wide` (its 1-d and 3-d kernels of float64) the product in float64, rounded to float32 before the
    floor. `halving`: its 2-d nearest kernel (`nearest_idx`) copies where out is n and halves where out is 2 n,
    whatever the factor. (Found by comparing with torch's indices over 2 types, 3 ranks, 280 factors and 7 sizes
    from 6 input sizes.)"""
    n = _size_tensor(x.shape[axis])
    kind = torch.float64 if wide else torch.float32
    scale = torch.tensor([1 / factor], dtype=kind) if factor else n.to(kind) / _size_tensor(out).to(kind)
    if halving:
        cells = _size_tensor(out)
        scale = torch.where(cells == n, 1.0, torch.where(cells == 2 * n, 0.5, scale))
    positions = torch.arange(out, dtype=kind)
    source = ((positions + 0.5 if exact_mode else positions) * scale).to(torch.float32)
    return x.index_select(axis, torch.minimum(torch.floor(source).to(torch.int64), n - 1))


def _has_values(x: torch.Tensor) -> bool:
    """Whether x holds values (not a fake tensor of torch.export's trace)."""
    return torch._C._has_storage(x) and not isinstance(x, torch._subclasses.FakeTensor)


def _same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether two results of a trace are equal (read quietly: the comparison is not part of the graph)."""
    if b is None:
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return a.shape == b.shape and bool(torch.equal(a, b))


def _power_of_two(factor: float) -> bool:
    return factor > 0 and math.frexp(factor)[0] == 0.5


def _nearest(original: Callable[..., torch.Tensor], dims: int, exact_mode: bool) -> Callable[..., torch.Tensor]:
    """interpolate(mode="nearest" / "nearest-exact") of float32 and float64: `_nearest_axis` per axis. The exporters'
    Resize computes the source index as i / factor (nearest-exact: (i + 1/2) / factor - 1/2, rounded half up)
    where torch's kernels multiply by float32(1 / factor) (or n / out) and floor: where i / factor is a whole number
    the two round to either side of it and read the pixel before or after (12 rows scaled by 1.7: 2 of the 20 output
    rows), which the first call's check refused; and onnxruntime's Resize has no float64 kernel. float32 scaled by
    powers of two (x2 upsampling) keeps torch's function: Resize's index is then exact, and its kernel one op.
    Other types keep torch's function.

    torch's 2-d kernels round a few more cases their own way when every axis is scaled (1-4 of ~880 sizes and
    factors a type and mode, at 26 and 33 rows by 1.98 to 2.7): where the export runs on values (the legacy
    exporter's trace), the gathers are compared with torch's function there, and where they differ torch's
    function is exported instead (its Resize, which the first call's check then holds to torch's values)."""
    def resample(x: torch.Tensor, output_size: Sequence[Any] | None, scale_factors: Sequence[float] | None = None,
                 *scales: float | None) -> torch.Tensor:
        y = None
        kept = x.dtype == torch.float32 and output_size is None and isinstance(scale_factors, (list, tuple)) \
            and all(_power_of_two(float(f)) for f in scale_factors)
        if x.dtype in (torch.float32, torch.float64) and not kept:
            y = _per_axis_resampled(x, output_size, scale_factors, scales, dims, functools.partial(
                _nearest_axis, exact_mode=exact_mode, halving=dims == 2 and not exact_mode,
                wide=dims != 2 and x.dtype == torch.float64))
        want = None if y is not None and not _has_values(x) else original(x, output_size, scale_factors, *scales)
        return want if y is None or not _same(y, want) else y

    return resample


def _batched(original: Callable[..., Any], rank: int, leading: bool = False) -> Callable[..., Any]:
    """`original` of an unbatched input (`rank` axes: (C, L) for a 1-d pool, (C, H, W) for a 2-d one, F.unfold and
    pixel shuffling) with a batch axis of 1 added around the call, as torch's kernels treat it: the legacy exporter
    wrote MaxPool / AveragePool / im2col's Pad on the unbatched tensor, which ONNX does not allow (the gradient
    build failed), and refused pixel_shuffle ("only support 4d input"). Every output (a pool's indices too) loses
    the axis again (each has two or more). With `leading` (pixel shuffling, which torch takes with any number of
    batch axes), more than one batch axis flattened into one around the call."""
    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if leading and x.dim() > rank + 1:
            out = original(x.reshape(-1, *x.shape[-rank:]), *args, **kwargs)
            return out.reshape(*x.shape[:-rank], *out.shape[1:])
        if x.dim() != rank:
            return original(x, *args, **kwargs)
        out = original(x.unsqueeze(0), *args, **kwargs)
        # the axis merged into the next (a Reshape): squeeze(0) is an If where the export lost the size 1 (unfold's)
        return tuple(o.flatten(0, 1) for o in out) if isinstance(out, tuple) else out.flatten(0, 1)

    return call


def _unbatched_loss(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """cross_entropy and nll_loss of one sample ((C,) scores, a 0-d class or (C,) probabilities), which torch takes:
    a batch axis of 1 around the call, the result 0-d (as torch's for every reduction). The exporters wrote their
    loss ops on the 1-D input, which ONNX does not allow (the session's load failed at LogSoftmax's axis)."""
    def loss(input: torch.Tensor, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if input.dim() != 1:
            return original(input, target, *args, **kwargs)
        return original(input.unsqueeze(0), target.unsqueeze(0), *args, **kwargs).reshape(())

    return loss


def _nan_to_num(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """nan_to_num of a 0-d tensor (a loss kept finite over a batch of ignored targets): the legacy exporter's is
    1-D, which the first call's check refuses; computed on one element and given torch's 0-d shape back."""
    def nan_to_num(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if x.dim() != 0 or not torch.jit.is_tracing():
            return original(x, *args, **kwargs)
        return original(x.reshape(1), *args, **kwargs).reshape(())

    return nan_to_num


def _channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c = x.shape[0], x.shape[1]
    grouped = x.reshape(n, groups, c // groups, *x.shape[2:])
    return grouped.transpose(1, 2).reshape(x.shape)


@contextlib.contextmanager
def exportable_functions() -> Iterator[None]:
    """The functions above replaced for the duration (the export, under its lock); threshold's in-place form traced
    out of place; diagonals handed out as copies checked for writes at the end (`_written_copies`)."""
    with _replaced_functions(), _written_copies.checked():
        yield


def _replaced_functions() -> contextlib.AbstractContextManager[None]:
    nn_ops = torch._C._nn
    return replaced([
        (nn_ops, "adaptive_avg_pool2d", _adaptive_avg_pool(nn_ops.adaptive_avg_pool2d, 2)),
        *((owner, f"conv{d}d", _conv(getattr(torch, f"conv{d}d"), d)) for d in (1, 2, 3)
          for owner in (torch, F)),
        *((owner, f"conv_transpose{d}d", _conv_transpose(getattr(torch, f"conv_transpose{d}d"), d))
          for d in (1, 2, 3) for owner in (torch, F)),
        *((owner, f"avg_pool{d}d", _batched(_int_windows(_divided_avg_pool(getattr(nn_ops, f"avg_pool{d}d"), d)),
                                             d + 1)) for d in (2, 3) for owner in (nn_ops, F)),
        *((owner, "avg_pool1d", _batched(_int_windows(_divided_avg_pool(torch.avg_pool1d, 1)), 2))
          for owner in (torch, F)),
        *((owner, name, _batched(_int_windows(getattr(owner, name)), rank)) for owner, name, rank in (
            (torch, "max_pool1d", 2), (torch, "max_pool1d_with_indices", 2), (torch, "max_pool2d", 3),
            (nn_ops, "max_pool2d_with_indices", 3))),
        *((owner, name, _int_windows(getattr(owner, name))) for owner, name in (
            (torch, "max_pool3d"), (nn_ops, "max_pool3d_with_indices"))),
        (nn_ops, "im2col", _batched(nn_ops.im2col, 3)),
        *((owner, name, _batched(getattr(torch, name), 3, leading=True)) for owner in (torch, F)
          for name in ("pixel_shuffle", "pixel_unshuffle")),
        (nn_ops, "adaptive_max_pool2d", _adaptive_max_pool2d(nn_ops.adaptive_max_pool2d)),
        (torch, "adaptive_max_pool1d", _adaptive_max_pool1d(_adaptive_max_pool2d(nn_ops.adaptive_max_pool2d))),
        (F, "adaptive_avg_pool1d", _adaptive_avg_pool(F.adaptive_avg_pool1d, 1)),
        (nn_ops, "adaptive_avg_pool3d", _adaptive_avg_pool(nn_ops.adaptive_avg_pool3d, 3)),
        (torch._VF, "threshold", _threshold(torch.threshold)), (torch._VF, "threshold_", _threshold(torch.threshold)),
        (torch, "pairwise_distance", pairwise_distance), (F, "pairwise_distance", pairwise_distance),
        (torch.linalg, "vector_norm", _linalg_vector_norm(torch.linalg.vector_norm)),
        (torch.linalg, "matrix_norm", _linalg_matrix_norm(torch.linalg.matrix_norm)),
        (torch.linalg, "norm", _linalg_norm(torch.linalg.norm)),
        *((owner, "dist", _dist(owner.dist)) for owner in (torch, torch.Tensor)),
        *((nn_ops, name, wrap(getattr(nn_ops, name), name.endswith("_")))
          for wrap, names in ((_hardtanh, ("hardtanh", "hardtanh_")), (_relu6, ("relu6", "relu6_")),
                              (_hard, ("hardsigmoid", "hardsigmoid_")),
                              (functools.partial(_hard, swish=True), ("hardswish", "hardswish_")))
          for name in names),
        (nn_ops, "_upsample_bilinear2d_aa", _antialiased(nn_ops._upsample_bilinear2d_aa, 2, _bilinear_filter)),
        (nn_ops, "_upsample_bicubic2d_aa", _antialiased(nn_ops._upsample_bicubic2d_aa, 4, _bicubic_filter)),
        *((nn_ops, name, _float64_resampling(getattr(nn_ops, name), d, _linear_matrix))
          for d, name in enumerate(("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"), 1)),
        (nn_ops, "upsample_bicubic2d", _float64_resampling(nn_ops.upsample_bicubic2d, 2, _cubic_matrix)),
        *((nn_ops, f"{prefix}{d}d", _nearest(getattr(nn_ops, f"{prefix}{d}d"), d, exact_mode))
          for d in (1, 2, 3)
          for prefix, exact_mode in (("upsample_nearest", False), ("_upsample_nearest_exact", True))),
        (torch, "linspace", _linspace(torch.linspace)),
        (torch, "cdist", _cdist), (torch, "cosine_similarity", _cosine_similarity), (nn_ops, "col2im", _col2im),
        *((owner, "pdist", _pdist) for owner in (torch, F)),
        *((owner, name, fn) for fn, names in ((_lgamma, ("lgamma", "gammaln")), (_digamma, ("digamma", "psi")))
          for owner in (torch, torch.Tensor, torch.special) for name in names if hasattr(owner, name)),
        (F, "embedding", _embedding(F.embedding)),
        *((owner, "normalize", _normalize(F.normalize)) for owner in (F, spectral_norm_module)),
        (torch, "layer_norm", _layer_norm(torch.layer_norm)),
        (torch, "std", _std), (torch.Tensor, "std", _std), (torch, "std_mean", _std_mean),
        (F, "cosine_similarity", _cosine_similarity), (F, "gaussian_nll_loss", _gaussian_nll_loss),
        (nn_ops, "log_sigmoid", _log_sigmoid), (F, "logsigmoid", _log_sigmoid),
        *((owner, "softplus", _softplus(nn_ops.softplus)) for owner in (nn_ops, F)),
        (torch, "scatter_reduce", _scatter_reduce(torch.scatter_reduce)),
        (torch.Tensor, "scatter_reduce", _scatter_reduce(torch.Tensor.scatter_reduce)),
        (torch.Tensor, "scatter_reduce_", _scatter_reduce(torch.Tensor.scatter_reduce_, in_place=True)),
        *((F, f"max_unpool{d}d", _max_unpool(d)) for d in (1, 2, 3)),
        (F, "scaled_dot_product_attention", _attention(F.scaled_dot_product_attention)),
        *((F, name, _unbatched_loss(getattr(F, name))) for name in ("cross_entropy", "nll_loss")),
        *((owner, "nan_to_num", _nan_to_num(owner.nan_to_num)) for owner in (torch, torch.Tensor)),
        (F, "channel_shuffle", _channel_shuffle), (torch, "rms_norm", _rms_norm), (F, "bilinear", _bilinear),
        (F, "embedding_bag", _embedding_bag(F.embedding_bag)), (torch, "hypot", _hypot),
        *((owner, name, _atan2) for owner in (torch, torch.Tensor) for name in ("atan2", "arctan2")),
        *((owner, "angle", _angle(owner.angle)) for owner in (torch, torch.Tensor)),
        *((owner, "expm1", _expm1) for owner in (torch, torch.Tensor, torch.special)),
        (torch, "addcdiv", _addcdiv), (torch.Tensor, "addcdiv", _addcdiv),
        *((owner, "sinc", _sinc) for owner in (torch, torch.Tensor, torch.special)),
        *((owner, name, _degrees(getattr(torch, name), factor)) for owner in (torch, torch.Tensor)
          for name, factor in (("deg2rad", math.pi / 180), ("rad2deg", 180 / math.pi))),
        *((torch.Tensor, name, property(_matrix_transpose)) for name in ("mT", "mH")),
        (torch.Tensor, "adjoint", _matrix_transpose), (torch, "adjoint", _matrix_transpose),
        (torch, "tile", _tile), (torch.Tensor, "tile", lambda x, *dims: _tile(x, _sizes(dims))),
        (torch, "cov", _cov(torch.cov)), (torch.Tensor, "cov", _cov(torch.Tensor.cov)),
        (torch, "diagonal", _diagonal), (torch.Tensor, "diagonal", _diagonal),
        (torch, "diag", _diag(torch.diag)), (torch.Tensor, "diag", _diag(torch.Tensor.diag)),
        (torch, "corrcoef", _corrcoef), (torch.Tensor, "corrcoef", _corrcoef),
        (torch, "take_along_dim", _take_along_dim), (torch.Tensor, "take_along_dim", _take_along_dim),
        (torch, "fliplr", lambda x: x.flip(1)), (torch, "flipud", lambda x: x.flip(0)),
        *((owner, name, fn) for name, fn in (("diff", _diff), ("kthvalue", _kthvalue), ("nansum", _nansum),
                                              ("nanmean", _nanmean), ("count_nonzero", _count_nonzero),
                                              ("histc", _histc),
                                              ("trace", _trace))
          for owner in (torch, torch.Tensor)),
        (torch, "vdot", _vdot(torch.vdot)), (torch.Tensor, "vdot", _vdot(torch.Tensor.vdot)),
        (torch, "copysign", _copysign), (torch.Tensor, "copysign", _copysign),
        (torch, "searchsorted", _searchsorted(torch.searchsorted)),
        (F, "gumbel_softmax", _gumbel_softmax), (torch, "randint", _randint(torch.randint)),
        (torch, "randperm", _randperm(torch.randperm)), (torch.Tensor, "unfold", _tensor_unfold(torch.Tensor.unfold)),
        *((owner, "as_strided", _as_strided(owner.as_strided)) for owner in (torch, torch.Tensor)),
        (torch, "as_tensor", _as_tensor(torch.as_tensor)),
        (torch, "affine_grid_generator", _affine_grid(torch.affine_grid_generator)),
        (torch, "celu", _celu()), (torch, "celu_", _celu(in_place=True)),
        *((torch, f"{name}_window", _constant(getattr(torch, f"{name}_window")))
          for name in ("hann", "hamming", "blackman", "bartlett", "kaiser")),
        *((owner, name, _constant(getattr(owner, name))) for owner, names in (
            (torch.signal.windows, torch.signal.windows.__all__), (torch.fft, ("fftfreq", "rfftfreq")))
          for name in names),
        (torch, "istft", _istft(torch.istft)), (torch.Tensor, "istft", _istft(torch.Tensor.istft)),
        (torch, "stft", _stft(torch.stft)), (torch.Tensor, "stft", _stft(torch.Tensor.stft)),
        *((torch.fft, name, _rfftn(name, dims))
          for name, dims in (("rfft", 1), ("rfft2", 2), ("rfftn", None))),
        (F, "local_response_norm", _local_response_norm(F.local_response_norm)),
        (F, "instance_norm", _instance_norm(F.instance_norm)), (F, "group_norm", _group_norm(F.group_norm))],
        captured=True)
