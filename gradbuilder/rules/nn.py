"""Convolution, pooling, normalization and dropout: the layers of a CNN.

`Window` resolves a node's kernel, strides, dilations and pads per spatial dim (auto_pad and ceil_mode
included) the way onnxruntime does. The input gradient of a strided window op is a ConvTranspose whose
end pads and output_padding follow from each dim's tail (how far the last window reaches past the input);
a weight gradient is the input unfolded (im2col, a Conv with a one-hot kernel) against the output gradient
in a MatMul, or where that is slower a Conv with batch and channels swapped. Symbolic spatial dims make
tails (and SAME pads) run-time int64 vectors: ConvTranspose then runs without them and a Pad with run-time
pads (negative ones crop) lays its output onto the input, so one gradient graph serves every input size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..graph import TensorInfo
from .context import Grad
from .registry import rule

HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
INT64_MAX = int(np.iinfo(np.int64).max)
FLOAT_EXACT = 2 ** 24
"""float32 holds every integer up to this one exactly."""

Sizes = Sequence[int] | str
"""Per spatial dim: ints known when building, or (str) a 1-D int64 tensor computed at run time."""


# --- shared helpers ------------------------------------------------------------------------------


def _per_channel(g: Grad, t: str, rank: int) -> str:
    """A (C,) tensor shaped (1, C, 1, ...) to broadcast against an (N, C, ...) tensor of rank `rank`."""
    return g.unsqueeze(t, [0, *range(2, rank)])


def _dims(g: Grad, x: str, nd: int) -> list[int | None]:
    """x's nd spatial sizes, None where symbolic."""
    shape = g.info(x).shape
    if shape is None or len(shape) != nd + 2:
        return [None] * nd
    return [d if isinstance(d, int) else None for d in shape[2:]]


def _spatial(g: Grad, x: str, why: str) -> list[int]:
    """x's spatial sizes, for a rule that computes from them at build time."""
    shape = g.info(x).shape
    if shape is None or not all(isinstance(d, int) for d in shape[2:]):
        g.fail(f"{why} needs the spatial dims of '{x}' to be static (they are {shape and list(shape[2:])})")
    return list(shape[2:])  # type: ignore[index, arg-type]


def _vec(g: Grad, v: Sizes) -> str:
    return v if isinstance(v, str) else g.ints(list(v))


def _sizes(g: Grad, x: str, nd: int) -> Sizes:
    """x's spatial sizes: ints when static, else sliced from its run-time shape (a forward tensor)."""
    dims = _dims(g, x, nd)
    if all(d is not None for d in dims):
        return dims  # type: ignore[return-value]
    return g.Slice(g.shape_of(x), g.ints([2]), g.ints([INT64_MAX]))


def _pads(g: Grad, begin: Sizes, end: Sizes) -> str:
    """Pad's run-time `pads` over (N, C, spatial...): nothing added to batch and channels."""
    if not isinstance(begin, str) and not isinstance(end, str):
        return g.ints([0, 0, *begin, 0, 0, *end])
    return g.Concat(g.ints([0, 0]), _vec(g, begin), g.ints([0, 0]), _vec(g, end), axis=0)


def _kernel(g: Grad, w: str) -> list[int]:
    """kernel_shape, which Conv may leave to the weight's shape."""
    kernel = g.attr("kernel_shape")
    if kernel is None:
        shape = g.info(w).shape
        if shape is None or not all(isinstance(d, int) for d in shape[2:]):
            g.fail(f"kernel_shape is absent and the weight '{w}' has no static shape")
        kernel = shape[2:]
    if not kernel:
        g.fail(f"the kernel has no spatial dims (weight '{w}' of rank {g.rank(w)}); a Conv weight is "
               "(M, C/group, k1, ...)")
    rank = g.rank(w)
    if rank is not None and rank != len(kernel) + 2:
        g.fail(f"its weight '{w}' has rank {rank}, but its kernel_shape {list(kernel)} needs a weight of rank "
               f"{len(kernel) + 2} (M, C/group, k1, ...)")
    return list(kernel)


def _per_group(g: Grad, w: str, channels: str, group: int) -> int:
    """The channels a group reads or writes, which the emitted graph bakes in: dim 1 of the weight, or where
    shape inference lost it (a weight computed in the graph) `channels`' dim 1 (Conv's input, ConvTranspose's
    output) over the groups."""
    for t, n in ((w, 1), (channels, group)):
        shape = g.info(t).shape
        if shape is not None and len(shape) > 1 and isinstance(shape[1], int):
            return shape[1] // n
    g.fail(f"dim 1 of its weight '{w}' (channels per group) and dim 1 of '{channels}' are unknown when building; "
           "declare the weight's shape")


def _ends_deficit(tails: Sequence[int]) -> tuple[list[int], list[int]]:
    """Static tails as (end pads, deficit): past the input the end pad cuts, short of it (deficit) no window
    reaches and the gradient there is zero (a ConvTranspose's output_padding)."""
    return [max(t, 0) for t in tails], [max(-t, 0) for t in tails]


@dataclass(frozen=True)
class Window:
    """Per spatial dim: kernel, stride, dilation and the begin/end pads of a window op. The pads are
    run-time vectors (str) only for auto_pad SAME over a symbolic dim with a stride above 1."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...] | str
    end: tuple[int, ...] | str

    @property
    def pads(self) -> list[int]:
        return [*self.begin, *self.end]  # type: ignore[misc]

    def extent(self, i: int) -> int:
        return (self.kernel[i] - 1) * self.dilations[i] + 1

    def out_size(self, i: int, n: int, ceil: bool = False) -> int:
        """Output size as onnxruntime computes it: with ceil_mode, a window may not start in the end pad."""
        s, b = self.strides[i], self.begin[i]  # type: ignore[index]
        span = n + b + self.end[i] - self.extent(i)  # type: ignore[index]
        o = (-(-span // s) if ceil else span // s) + 1
        return o - 1 if ceil and (o - 1) * s >= n + b else o

    def out_sizes(self, sizes: Sequence[int], ceil: bool = False) -> list[int]:
        return [self.out_size(i, n, ceil) for i, n in enumerate(sizes)]

    def tail(self, i: int, n: int, o: int) -> int:
        """How far the windows of dim i reach past an input of size n: (o-1)*s + extent - begin - n."""
        return (o - 1) * self.strides[i] + self.extent(i) - self.begin[i] - n  # type: ignore[index]


def node_window(g: Grad, x: str, kernel: Sequence[int]) -> Window:
    """Public because LpPool (normalization.py) reads its windows as these window ops do.
    The node's window with auto_pad resolved. SAME pads total (ceil(n/s) - 1) * s + extent - n: static
    for stride 1 or a static size, else computed at run time."""
    nd = len(kernel)
    strides = tuple(g.attr("strides", [1] * nd))
    dilations = tuple(g.attr("dilations", [1] * nd))
    for name, values in (("kernel", tuple(kernel)), ("strides", strides), ("dilations", dilations)):
        if len(values) != nd or any(v < 1 for v in values):
            g.fail(f"its {name} {list(values)} must hold {nd} value{'s' if nd != 1 else ''} of at least 1, one "
                   "per spatial axis")
    rank = g.rank(x)
    if rank is not None and rank != nd + 2:
        g.fail(f"its input '{x}' has rank {rank}, but a kernel of {nd} spatial dims needs rank {nd + 2} "
               "(N, C, spatial...)")
    auto = g.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(g.attr("pads", [0] * 2 * nd))
        if len(pads) != 2 * nd:
            g.fail(f"its pads {pads} must hold {2 * nd} values, a begin and an end per spatial axis")
        return Window(tuple(kernel), strides, dilations, tuple(pads[:nd]), tuple(pads[nd:]))
    if auto == "VALID":
        return Window(tuple(kernel), strides, dilations, (0,) * nd, (0,) * nd)
    if auto not in ("SAME_UPPER", "SAME_LOWER"):
        g.fail(f"unknown auto_pad '{auto}'")
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    dims = _dims(g, x, nd)
    if all(n is not None or s == 1 for n, s in zip(dims, strides)):
        total = [e - 1 if s == 1 else max(0, (-(-n // s) - 1) * s + e - n)  # type: ignore[operator]
                 for n, s, e in zip(dims, strides, extents)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
        return Window(tuple(kernel), strides, dilations, tuple(begin), tuple(t - b for t, b in zip(total, begin)))
    n, s = _sizes(g, x, nd), g.ints(list(strides))
    last = g.Mul(g.Div(g.Add(n, g.ints([k - 1 for k in strides])), s), s)  # ceil(n/s) * s
    total_rt = g.Max(g.Sub(g.Add(last, g.ints([e - k for e, k in zip(extents, strides)])), n), g.ints([0] * nd))
    half = g.Div(total_rt, g.ints([2] * nd))
    begin_rt = half if auto == "SAME_UPPER" else g.Sub(total_rt, half)
    return Window(tuple(kernel), strides, dilations, begin_rt, g.Sub(total_rt, begin_rt))


def window_tails(g: Grad, win: Window, x: str, ceil: bool = False) -> Sizes:
    """Public because LpPool (normalization.py) spreads its gradient over windows as AveragePool does.
    Per spatial dim, `Window.tail` of the node's windows over x: ints when x's size is static or the
    stride is 1 (the tail is then the end pad), else computed at run time from x's and y's shapes."""
    nd = len(win.kernel)
    if not isinstance(win.begin, str):
        static: list[int] = []
        for i, n in enumerate(_dims(g, x, nd)):
            if n is not None:
                static.append(win.tail(i, n, win.out_size(i, n, ceil)))
            elif win.strides[i] == 1:  # o - 1 = n + begin + end - extent
                static.append(win.end[i])  # type: ignore[index]
            else:
                break
        else:
            return static
    reach = g.Add(g.Mul(_vec(g, _sizes(g, g.O(0), nd)), g.ints(list(win.strides))),
                  g.ints([win.extent(i) - s for i, s in enumerate(win.strides)]))  # (o-1)*s + extent
    return g.Sub(g.Sub(reach, _vec(g, win.begin)), _vec(g, _sizes(g, x, nd)))


def _onto_input(g: Grad, t: str, w: str, win: Window, tails: Sizes, **attrs: Any) -> str:
    """ConvTranspose of t (shaped like the window op's output) by w, laid onto the input's positions: the
    adjoint of the window op. Run-time tails: the transposed output runs from the static begin pad (or 0)
    to the end of the last window, and a Pad crops or zero-extends it to the input."""
    common = {"strides": list(win.strides), "dilations": list(win.dilations), **attrs}
    if not isinstance(tails, str):
        ends, extra = _ends_deficit(tails)
        return g.ConvTranspose(t, w, pads=[*win.begin, *ends], output_padding=extra if any(extra) else None,
                               **common)
    nd = len(win.kernel)
    if isinstance(win.begin, str):
        full = g.ConvTranspose(t, w, pads=[0] * 2 * nd, **common)
        return g.Pad(full, _pads(g, g.Neg(win.begin), g.Neg(tails)))
    full = g.ConvTranspose(t, w, pads=[*win.begin, *[0] * nd], **common)
    return g.Pad(full, _pads(g, [0] * nd, g.Neg(tails)))


def _framed(g: Grad, t: str, win: Window, tails: Sizes) -> tuple[str, list[int] | None]:
    """t (spatial dims last) and the pads under which a Conv's windows over it are the window op's: static
    tails become end pads (negative ones crop by a Slice: no window reaches there), run-time ones a Pad."""
    if isinstance(tails, str):
        return g.Pad(t, _pads(g, win.begin, tails)), None
    nd = len(win.kernel)
    ends, crop = _ends_deficit(tails)
    if any(crop):
        t = g.Slice(t, g.ints([0] * nd), g.ints([-c if c else INT64_MAX for c in crop]), g.ints(range(2, 2 + nd)))
    return t, [*win.begin, *ends]  # type: ignore[misc]


def _weight_grad(g: Grad, inp: str, sizes: Sizes, dout: str, like: str, win: Window, tails: Sizes, group: int,
                 per_group: int, outputs: int | None, positions: int | None) -> str:
    """dW[m, c, t] = sum over n, o of dout[n, m, o] * inp_padded[n, group(m) * per_group + c, o*s + t*d].

    `_weight_grad_by_gathering` or `_weight_grad_by_unfolding` where they pay and the positions are known when
    building (the gathered or unfolded input's size is then bounded; not for large kernels from 2-3 channels,
    `SWAP_MIN_INPUTS`); otherwise a Conv over `inp` (spatial `sizes`) with batch and channels swapped (the
    group's channels stacked on the batch), `dout` (batch and channels swapped too) as the kernel, strides and
    dilations exchanged. `like` is the forward tensor dout has the type of; `outputs` is dout's channel count
    and `positions` its number of spatial positions, where static. That kernel's type is declared: shape
    inference loses it behind the reshapes of a pooling gradient, and onnxruntime's blocked Conv
    (runtime/nchwc.py) needs its sizes.
    """
    nd = len(win.kernel)
    out_sizes = _dims(g, like, nd)
    few = _swapping_few_channels(g, win, group, per_group)
    if not few and None not in out_sizes and outputs is not None and _gathering(g, win, group, per_group, tails,
                                                                                out_sizes):
        return _weight_grad_by_gathering(g, inp, dout, win, tails, per_group, outputs, out_sizes)  # type: ignore[arg-type]
    if not few and positions is not None and _unfolding(g, inp, win, group, per_group, positions):
        return _weight_grad_by_unfolding(g, inp, dout, win, tails, per_group, outputs, positions)
    if group > 1 and per_group == 1 and outputs == group and None not in out_sizes and not isinstance(tails, str) \
            and not isinstance(win.begin, str):
        return _depthwise_weight_grad(g, inp, dout, like, win, tails, group, out_sizes)  # type: ignore[arg-type]
    spatial = list(range(2, 2 + nd))
    swap = [1, 0, *spatial]
    if group == 1:
        inp_t = g.Transpose(inp, perm=swap)
    else:  # (N, G*Cg, D...) -> (Cg, G*N, D...): channel g*N + n of the grouped Conv is sample n of group g
        inp_t = g.Reshape(inp, g.ints([0, group, per_group, -1]))
        if isinstance(sizes, str):
            target = g.Concat(g.ints([per_group, -1]), sizes, axis=0)
        else:
            target = g.ints([per_group, -1, *sizes])
        inp_t = g.Reshape(g.Transpose(inp_t, perm=[2, 1, 0, 3]), target)
    inp_t, pads = _framed(g, inp_t, win, tails)
    kernel = g.Transpose(dout, perm=swap)
    info = g.info(like)
    if info.shape is not None and len(info.shape) == len(swap):
        g.declare(kernel, TensorInfo(info.elem_type, tuple(info.shape[a] for a in swap)))
    dw_t = g.Conv(inp_t, kernel, strides=list(win.dilations), dilations=list(win.strides), pads=pads, group=group)
    return g.Transpose(dw_t, perm=swap)


def _depthwise_weight_grad(g: Grad, inp: str, dout: str, like: str, win: Window, tails: Sequence[int],
                           channels: int, out_sizes: Sequence[int]) -> str:
    """A depthwise layer's dW (one input and one output channel a group) as a depthwise Conv, group = channels:
    the batch stacked along the first spatial axis of the framed input, and of dout as the kernel, instead of on
    the channels (the swapped Conv's groups of N input channels, which onnxruntime runs on im2col at ~1 GFLOP/s;
    its blocked depthwise kernels run this one 5-8x faster, runtime/nchwc.py). Image n's framed rows start at row
    n*R of the stacked input, its dout rows (zero-padded to R/s) at row n*R/s of the kernel, R the framed rows
    rounded up to the stride: a kernel row's windows stay inside its image, and the padding rows add zeros."""
    nd = len(win.kernel)
    framed = _framed_sizes(win, out_sizes)
    s, d = win.strides[0], win.dilations[0]
    rows = -(-framed[0] // s) * s
    t, pads = _framed(g, inp, win, tails)
    ends = [*pads[nd:]]  # type: ignore[index]
    ends[0] += rows - framed[0]
    if any(pads[:nd]) or any(ends):  # type: ignore[index]
        t = g.Pad(t, _pads(g, pads[:nd], ends))  # type: ignore[index]
    swap = [1, 0, *range(2, 2 + nd)]
    stacked = g.Reshape(g.Transpose(t, perm=swap), g.ints([1, channels, -1, *framed[1:]]))
    spare = rows // s - out_sizes[0]  # dout's padding rows a sample
    kernel = dout
    if spare:
        kernel = g.Pad(kernel, _pads(g, [0] * nd, [spare, *[0] * (nd - 1)]))
    kernel = g.Reshape(g.Transpose(kernel, perm=swap), g.ints([channels, 1, -1, *out_sizes[1:]]))
    if spare:  # the last sample's padding rows reach past the stacked input
        kernel = g.Slice(kernel, g.ints([0]), g.ints([-spare]), g.ints([2]))
    g.declare(kernel, TensorInfo(g.info(like).elem_type, (channels, 1, None, *out_sizes[1:])))
    dw = g.Conv(stacked, kernel, strides=list(win.dilations), dilations=list(win.strides), group=channels)
    if (rows - framed[0]) // d:  # rows the rounding added reach one window further
        dw = g.Slice(dw, g.ints([0]), g.ints([win.kernel[0]]), g.ints([2]))
    return g.Reshape(dw, g.ints([channels, 1, *win.kernel]))


SMALL_KERNEL = 9
"""Kernels of at most this many taps (3x3) always unfold."""
UNFOLD_MAX_INPUTS = 3
"""Larger kernels unfold for at most this many input channels (an image's colours); from more, the Conv with
batch and channels swapped was faster in onnxruntime, whatever the outputs (LeNet's 5x5 layer from 6 to 16
channels: 1.3-1.9 against 1.9-2.5 ms; Caffe's from 20 to 50: 5.1-5.2 against 5.6-8.2 ms; 32 to 64 over 14x14,
batch 32: 6.1-7.5 against 7.2-7.3 ms), the more where its batch runs as blocked channels (runtime/nchwc.py:
0.55, 2.8-3.1 and 2.9-3.8 ms); from 1 to 32 channels the unfold took 1.3-1.7 against 2.3-2.9 ms."""


UNFOLD_MAX_ELEMENTS = 1 << 19
"""The most elements the unfolded input may have a sample (channels x taps x positions, 2 MB of float, 128 MB
for a batch of 64): it is the input times the taps, alive while the weight gradient is computed, where the
swapped Conv's im2col holds one input channel at a time. The benchmark's MNIST- and CIFAR-sized layers need
27k-166k, a 3x3 layer of 32 channels on 32x32 295k; one of 64 channels on 56x56 (ResNet's first stage) would
need 1.8M and takes the swapped Conv."""


SMALL_MAP = 16
"""Small kernels over at most this many output positions a sample (4x4) take the swapped Conv from more than
`UNFOLD_MAX_INPUTS` channels: the unfold's grouped Conv then makes N*C tiny im2col + GEMM calls. Weight
gradients alone, 2 threads, batch 64 (unfold / swapped; torch): 16 -> 32 on 4x4 0.40 / 0.23 ms (0.23),
32 -> 32 on 4x4 0.51 / 0.26 (0.28), 64 -> 64 on 4x4 2.10 / 0.93 (0.92), 128 -> 128 on 2x2 3.06 / 0.72 (0.89);
over 8x8 and more the two are level or the unfold wins (16 -> 16 on 8x8 0.50 / 0.44, 32 -> 64 on 8x8
1.89 / 1.86, 8 -> 16 on 16x16 0.99 / 1.29, 16 -> 16 on 32x32 6.6 / 7.8). 2-D layers only: the swapped Conv's
speed there is onnxruntime's blocked kernels' (runtime/nchwc.py), which 1-D layers lack (64 -> 64 over 16
positions: 0.76 / 1.62 ms). Nor 1x1 kernels: x is their unfold (no grouped Conv), and their swapped Conv has one
output position, which onnxruntime does not block. MobileNetV2's pointwise layers over 4x4 at batch 32 (swapped Conv
/ one GEMM, in its backward's profile): 32 -> 384 1.1 / 0.25 ms, 384 -> 96 2.9 / 0.42; its backward 114 -> 102 ms."""


def _unfolding(g: Grad, inp: str, win: Window, group: int, channels: int, positions: int) -> bool:
    """Whether the weight gradient unfolds the input: ungrouped, a type onnxruntime convolves, an unfolded
    sample of at most `UNFOLD_MAX_ELEMENTS`, and few input channels, or a small kernel (over more than
    `SMALL_MAP` positions in 2-D)."""
    taps = int(np.prod(win.kernel))
    small_map = len(win.kernel) == 2 and positions <= SMALL_MAP and taps > 1  # one tap: no grouped Conv to call
    return (group == 1 and g.dtype(inp) in (TensorProto.FLOAT, TensorProto.FLOAT16)
            and channels * taps * positions <= UNFOLD_MAX_ELEMENTS
            and (channels <= UNFOLD_MAX_INPUTS or (taps <= SMALL_KERNEL and not small_map)))


GATHER_MIN_TAPS = 25
"""Kernels of at least this many taps (5x5) from at most `GATHER_MAX_INPUTS` channels gather their windows
(`_weight_grad_by_gathering`) rather than unfold them by a one-hot Conv, which multiplies by every tap. Weight
gradients alone, 2 threads, batch 64 (gathered / one-hot unfold with its bias gradient; torch): 1 -> 6 'same' over
28x28 0.30 / 0.76 ms (0.20), 3 -> 6 over 32x32 0.79-0.88 / 1.4 (0.45-0.48), 3 -> 32 at batch 32 0.76 / 1.5 (0.37),
1 -> 16 0.44-0.59 / 0.83 (0.19-0.23), LeNet's at batch 256 1.24 / 2.56 (0.78-0.93); 3x3 kernels unfold faster
(3 -> 16 over 32x32 1.0 / 0.87, 16 -> 32 over 16x16 1.33 / 1.27)."""
GATHER_MAX_INPUTS = UNFOLD_MAX_INPUTS
"""From more channels 5x5 layers keep the Conv with batch and channels swapped: gathering them was level in steps
(LeNet's second layer, Caffe's, a 16 -> 32 one: 0.99-1.03 of the swapped Conv's step)."""
SWAP_MIN_INPUTS = 2
"""2-D float layers of at least `GATHER_MIN_TAPS` taps from this many channels up take the Conv with batch and
channels swapped rather than gathering: onnxruntime runs it blocked, the images as its channels and the layer's
channels as its batch (runtime/nchwc.py, `MIN_IMAGES_PADDED`), where the gather's GEMMs are [M, positions] by
[C * taps, positions], thin on both sides. Captured training graphs run alternately, 2 threads (gathered / swapped,
ms): LeNets on 3x32x32, 6 -> 16 channels at batch 32 5.06 / 4.71, 16 -> 32 at batch 64 15.4 / 14.8, 32 -> 64 at
batch 32 14.9 / 14.8, 'same' 5x5 at batch 64 11.9 / 11.5 (backward alone, 16 -> 32 at batch 16: 4.47 / 3.81), a
7x7 stride-2 stem over 3x64x64 at batch 32 22.3 / 20.7, a LeNet on 2x28x28 8.7 / 8.1. From one channel (one image
for the blocked Conv) the two were level on LeNet-5 (6.88 / 6.87 with that image blocked; onnxruntime's im2col Conv
takes twice as long), so it is gathered; so are double and 1-D and 3-D layers, which have no blocked kernels."""
GATHER_CHUNK_BYTES = 2 * 1024 * 1024
GATHER_BATCH = 64
"""Each gather holds about `GATHER_CHUNK_BYTES` (one core's L2 here) at a batch of this many samples (the batch is
symbolic when building), so that its product reads it from the cache: 3 -> 6 over 32x32 at batch 128, positions in
1 / 2 / 4 / 8 gathers: 3.07 / 2.98 / 1.37 / 1.31 ms."""


def _gathering(g: Grad, win: Window, group: int, channels: int | None, tails: Sizes, out_sizes: Sequence[int]
               ) -> bool:
    """Whether the weight gradient gathers the input's windows: ungrouped, float or double (the node's input:
    a ConvTranspose's windows run over dY, whose type may not be known yet), static pads and tails, a large
    kernel over few input channels, and at most `UNFOLD_MAX_ELEMENTS` gathered a sample (a ResNet stem over
    224x224 would gather 1.8M in 229 chunks: it takes the swapped Conv)."""
    taps = int(np.prod(win.kernel))
    return (group == 1 and channels is not None and channels <= GATHER_MAX_INPUTS and taps >= GATHER_MIN_TAPS
            and channels * taps * int(np.prod(out_sizes)) <= UNFOLD_MAX_ELEMENTS and not isinstance(tails, str)
            and not isinstance(win.begin, str) and g.dtype(g.I(0)) in (TensorProto.FLOAT, TensorProto.DOUBLE))


def _swapping_few_channels(g: Grad, win: Window, group: int, channels: int | None) -> bool:
    """Whether a large 2-D float kernel from 2-3 channels takes the swapped Conv (`SWAP_MIN_INPUTS`) where it
    would otherwise gather or unfold."""
    return (group == 1 and channels is not None and SWAP_MIN_INPUTS <= channels <= GATHER_MAX_INPUTS
            and len(win.kernel) == 2 and int(np.prod(win.kernel)) >= GATHER_MIN_TAPS
            and g.dtype(g.I(0)) == TensorProto.FLOAT)


def _framed_sizes(win: Window, out_sizes: Sequence[int]) -> list[int]:
    """The input's sizes framed by the pads and tails: exactly what the windows of `out_sizes` outputs span."""
    return [(o - 1) * s + win.extent(i) for i, (o, s) in enumerate(zip(out_sizes, win.strides))]


def window_indices(win: Window, out_sizes: Sequence[int]) -> np.ndarray:
    """[taps, positions]: the flat index, in the framed input (`_framed_sizes`), of the element each tap of each
    output position's window reads (taps and positions in raster order)."""
    framed = _framed_sizes(win, out_sizes)
    pitch = [int(np.prod(framed[i + 1:])) for i in range(len(framed))]
    taps = np.zeros(win.kernel, np.int64)
    starts = np.zeros(out_sizes, np.int64)
    for i in range(len(framed)):
        shape = [1] * len(framed)
        shape[i] = -1
        taps = taps + (np.arange(win.kernel[i]) * win.dilations[i] * pitch[i]).reshape(shape)
        starts = starts + (np.arange(out_sizes[i]) * win.strides[i] * pitch[i]).reshape(shape)
    return taps.reshape(-1, 1) + starts.reshape(1, -1)


def _weight_grad_by_gathering(g: Grad, inp: str, dout: str, win: Window, tails: Sizes, channels: int,
                              outputs: int, out_sizes: Sequence[int]) -> str:
    """dW[m, c*T + t] = sum over p, n of dout^T[m, p, n] * cols[c*T + t, p, n], one GEMM over positions and batch:
    cols gathers the framed input's windows with the batch innermost (x^T [C, D, N] indexed by `window_indices`
    along D: each index moves a sample-long row), dout^T is a 2-D transpose of dout. The positions run in chunks
    of about `GATHER_CHUNK_BYTES` at a batch of `GATHER_BATCH`, their products summed. No multiplication by
    one-hot taps, as the unfolding Conv does; a batch-sized row per gathered index."""
    nd = len(win.kernel)
    framed, pads = _framed(g, inp, win, tails)
    if pads is not None and any(pads):
        framed = g.Pad(framed, g.ints([0, 0, *win.begin, 0, 0, *pads[nd:]]))  # type: ignore[misc]
    index = window_indices(win, out_sizes)
    taps, positions = index.shape
    rows = g.Transpose(g.Reshape(framed, g.ints([0, -1])), perm=[1, 0])  # (C*D, N)
    rows = g.Reshape(rows, g.ints([channels, int(np.prod(_framed_sizes(win, out_sizes))), -1]))
    dout_t = g.Reshape(g.Transpose(g.Reshape(dout, g.ints([0, -1])), perm=[1, 0]), g.ints([outputs, positions, -1]))
    per_chunk = max(1, GATHER_CHUNK_BYTES // (channels * taps * GATHER_BATCH * 4))
    chunks = -(-positions // per_chunk)
    bounds = np.linspace(0, positions, chunks + 1).astype(int)
    parts = []
    for a, b in itertools.pairwise(bounds):
        cols = g.Reshape(g.Gather(rows, g.ints(index[:, a:b]), axis=1), g.ints([channels * taps, -1]))
        d = dout_t if chunks == 1 else g.Slice(dout_t, g.ints([a]), g.ints([b]), g.ints([1]))
        parts.append(g.Gemm(g.Reshape(d, g.ints([outputs, -1])), cols, transB=1))
    dw = parts[0] if len(parts) == 1 else g.Sum(*parts)
    return g.Reshape(dw, g.ints([outputs, channels, *win.kernel]))


def unfold_kernel(channels: int, kernel: Sequence[int]) -> np.ndarray:
    """The weight of the Conv (group = channels) that unfolds an input: output channel c*T + t holds tap t of
    input channel c, for the T taps of `kernel` in raster order. runtime/nchwc.py recognises it by this value."""
    taps = int(np.prod(kernel))
    return np.tile(np.eye(taps).reshape(taps, 1, *kernel), (channels, 1, *[1] * len(kernel)))


def _weight_grad_by_unfolding(g: Grad, inp: str, dout: str, win: Window, tails: Sizes, channels: int,
                              outputs: int | None, positions: int) -> str:
    """dW[m, c, t] = sum over n, p of dout[n, m, p] * cols[n, c*T + t, p]. cols, the input unfolded (im2col),
    is a Conv of inp with a one-hot kernel per channel and tap (group = channels) over the window op's own
    windows, so strides, dilations and pads need nothing more. Per sample, cols [C*T, P] meets dout [M, P] in
    one batched MatMul summed over the batch; when the outputs are more than twice the positions (deep layers
    of few positions) those per-sample products outgrow cols, and one GEMM over batch and positions runs
    instead. 3x3 layers of CNNs on 8x8 to 32x32 images, batch 64: 1.2-2x faster in onnxruntime than one GEMM
    over the kernel's shifted slices, 1.7-3x faster than the Conv with batch and channels swapped."""
    nd = len(win.kernel)
    taps = int(np.prod(win.kernel))
    framed, pads = _framed(g, inp, win, tails)
    if taps == 1 and pads is not None and not any(pads):  # a 1x1 kernel unfolds x to its every stride-th position
        cols = framed if all(s == 1 for s in win.strides) else g.Slice(
            framed, g.ints([0] * nd), g.ints([INT64_MAX] * nd), g.ints(range(2, 2 + nd)), g.ints(win.strides))
    else:
        cols = g.Conv(framed, g.const(unfold_kernel(channels, win.kernel), like=inp), kernel_shape=list(win.kernel),
                      strides=list(win.strides), dilations=list(win.dilations), pads=pads, group=channels)
    cols = g.Reshape(cols, g.ints([0, channels * taps, -1]))  # (N, C*T, P)
    if outputs is not None and 2 * positions >= outputs:
        per_sample = g.MatMul(g.Reshape(dout, g.ints([0, 0, -1])), g.Transpose(cols, perm=[0, 2, 1]))
        dw = g.reduce_sum(per_sample, [0], keepdims=False)  # (M, C*T)
    else:
        rows = g.Reshape(g.Transpose(dout, perm=[1, 0, *range(2, 2 + nd)]), g.ints([0, -1]))  # (M, N*P)
        flat = g.Reshape(g.Transpose(cols, perm=[1, 0, 2]), g.ints([0, -1]))  # (C*T, N*P)
        dw = g.Gemm(rows, flat, transB=1)
    return g.Reshape(dw, g.ints([0, channels, *win.kernel]))


def _count(g: Grad, t: str, axes: Sequence[int]) -> int | None:
    """The number of elements over t's `axes`, when static."""
    shape = g.info(t).shape
    if shape is None or len(shape) <= max(axes):
        return None
    dims = [shape[a] for a in axes]
    return int(np.prod(dims)) if all(isinstance(d, int) for d in dims) else None


def _channel_sum(g: Grad, dy: str, rank: int) -> str:
    """Bias gradient: dY summed over every axis but the channel axis."""
    return g.reduce_sum(dy, [0, *range(2, rank)], keepdims=False)


# --- convolution ---------------------------------------------------------------------------------
@rule("Conv", since=13)
def conv(g: Grad):
    """dX: ConvTranspose of dY with the same weight; dW: see `_weight_grad`; dB: dY summed per channel."""
    x, w, dy = g.I(0), g.I(1), g.GO(0)
    kernel = _kernel(g, w)
    win = node_window(g, x, kernel)
    group = int(g.attr("group", 1))
    dx = dw = db = None
    if g.needs(0) or g.needs(1):
        tails = window_tails(g, win, x)
    if g.needs(0):  # typed: a pool's gradient before it hides its sizes from shape inference (runtime/nchwc.py)
        dx = g.declare(_onto_input(g, dy, w, win, tails, kernel_shape=kernel, group=group), g.info(x))
    if g.needs(1):
        nd = len(kernel)
        dw = _weight_grad(g, x, _sizes(g, x, nd), dy, g.O(0), win, tails, group, _per_group(g, w, x, group),
                          _count(g, w, [0]), _count(g, g.O(0), range(2, 2 + nd)))
    if g.I(2) is not None and g.needs(2):
        db = _channel_sum(g, dy, len(kernel) + 2)
    return (dx, dw, db)


def _transpose_window(g: Grad, x: str, kernel: Sequence[int]) -> tuple[Window, list[int], list[int]]:
    """ConvTranspose's window; per dim, how many trailing output positions the input does not reach (short);
    and the tails of the adjoint Conv (its weight gradient's), end pad - output_padding.

    The full output is (n-1)*s + extent + output_padding. Pads come from `pads`, or from the excess of the full
    output over `output_shape` or, with auto_pad SAME, over n*s (excess = extent + output_padding - s, static),
    split as onnxruntime does: the odd one at the end for SAME_UPPER, at the start otherwise. An output
    beyond what the input reaches has trailing zeros, whose gradient reaches nothing.
    """
    nd = len(kernel)
    strides = list(g.attr("strides", [1] * nd))
    dilations = list(g.attr("dilations", [1] * nd))
    extra = list(g.attr("output_padding", [0] * nd))
    auto = g.attr("auto_pad", "NOTSET")
    out_shape = g.attr("output_shape")
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if out_shape is not None:
        sizes = _spatial(g, x, "output_shape")
        excess = [(n - 1) * s + e + p - o for n, s, e, p, o in zip(sizes, strides, extents, extra, out_shape[-nd:])]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        excess = [e + p - s for s, e, p in zip(strides, extents, extra)]
    else:
        pads = [0] * 2 * nd if auto == "VALID" else list(g.attr("pads", [0] * 2 * nd))
        win = Window(tuple(kernel), tuple(strides), tuple(dilations), tuple(pads[:nd]), tuple(pads[nd:]))
        return win, [0] * nd, [e - p for e, p in zip(pads[nd:], extra)]
    total = [max(0, t) for t in excess]
    begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
    end = [max(0, t - b) for t, b in zip(excess, begin)]
    short = [b + e - t for b, e, t in zip(begin, end, excess)]
    win = Window(tuple(kernel), tuple(strides), tuple(dilations), tuple(begin), tuple(end))
    return win, short, [e - p for e, p in zip(end, extra)]


@rule("ConvTranspose", since=13)
def conv_transpose(g: Grad):
    """The adjoint of Conv: dX is a Conv of dY with the same weight; dW is Conv's weight gradient with
    the roles of input and output exchanged. Every pad is static whatever the input size."""
    x, w, dy = g.I(0), g.I(1), g.GO(0)
    kernel = _kernel(g, w)
    group = int(g.attr("group", 1))
    nd = len(kernel)
    dx = dw = db = None
    if g.needs(0) or g.needs(1):
        win, short, tails = _transpose_window(g, x, kernel)
        dy_used = dy
        if any(short):
            dy_used = g.Slice(dy, g.ints([0] * nd), g.ints([-c if c else INT64_MAX for c in short]),
                              g.ints(list(range(2, nd + 2))))
    if g.needs(0):
        dx = g.Conv(dy_used, w, kernel_shape=kernel, strides=list(win.strides), dilations=list(win.dilations),
                    group=group, pads=win.pads)
    if g.needs(1):
        outs = _sizes(g, g.O(0), nd)
        reached = g.Sub(outs, g.ints(short)) if isinstance(outs, str) else [o - c for o, c in zip(outs, short)]
        dw = _weight_grad(g, dy_used, reached, x, x, win, tails, group, _per_group(g, w, g.O(0), group),
                          _count(g, w, [0]), _count(g, x, range(2, 2 + nd)))
    if g.I(2) is not None and g.needs(2):
        db = _channel_sum(g, dy, nd + 2)
    return (dx, dw, db)


# --- pooling -------------------------------------------------------------------------------------
def _scatter_flat(g: Grad, x: str, index: str, values: str, accumulate: bool) -> str:
    """Zeros shaped like x, flattened, with `values` scattered (added when indices may repeat) at the
    flat `index`: onnxruntime has no float16 add-scatter, so half types accumulate in float."""
    if accumulate and g.opset < 16:
        g.fail("overlapping windows need ScatterElements with reduction='add' (opset 16); re-export at opset "
               ">= 16")
    dtype = g.dtype(x) or TensorProto.FLOAT
    acc = TensorProto.FLOAT if accumulate and dtype in HALF_TYPES else dtype
    numel = g.ReduceProd(g.shape_of(x), keepdims=1)
    zeros = g.ConstantOfShape(numel, value=helper.make_tensor("value", acc, [1], [0]))
    flat = g.Reshape(values, g.ints([-1]))
    if acc != dtype:
        flat = g.Cast(flat, to=acc)
    out = g.ScatterElements(zeros, g.Reshape(index, g.ints([-1])), flat, axis=0,
                            reduction="add" if accumulate else None)
    return g.Cast(out, to=dtype) if acc != dtype else out


def _tiles(g: Grad, kernel: Sequence[int]) -> bool:
    """Whether MaxPool's windows tile x without overlap, padding or dilation (LeNet's 2x2 stride-2 pool), for
    float inputs and no Indices output in the model."""
    nd = len(kernel)
    outs = g.node.output
    return (list(g.attr("strides", [1] * nd)) == list(kernel) and list(g.attr("dilations", [1] * nd)) == [1] * nd
            and not any(g.attr("pads", [0] * 2 * nd)) and g.attr("auto_pad", "NOTSET") in ("NOTSET", "VALID", "")
            and not g.attr("ceil_mode", 0) and not (len(outs) > 1 and outs[1]) and int(np.prod(kernel)) <= 256
            and g.dtype(g.I(0)) in (TensorProto.FLOAT, TensorProto.DOUBLE))


def _tile_offsets(g: Grad, x: str, kernel: Sequence[int]) -> str:
    """Forward side: the position in its tile (raster order, the first maximum, as torch picks) of the element
    each output took, as uint8. MaxPool then runs without its Indices output (ten times slower in
    onnxruntime) and backward keeps a byte an output element instead of int64 indices."""
    nd = len(kernel)
    fwd = {"forward": True}
    shape = g.shape_of(x)
    lead = g.op("Slice", shape, g.ints([0]), g.ints([2]), **fwd)
    outs = g.op("Div", g.op("Slice", shape, g.ints([2]), g.ints([2 + nd]), **fwd), g.ints(kernel), **fwd)
    static = g.info(x).shape
    if static is None or not all(isinstance(n, int) and n % k == 0 for n, k in zip(static[2:], kernel)):
        x = g.op("Slice", x, g.ints([0] * nd), g.op("Mul", outs, g.ints(kernel), **fwd), g.ints(range(2, 2 + nd)),
                 **fwd)  # floor mode: the rows and columns past the last tile
    dims = [lead]
    for i in range(nd):
        dims += [g.op("Slice", outs, g.ints([i]), g.ints([i + 1]), **fwd), g.ints([kernel[i]])]
    tiled = g.op("Reshape", x, g.op("Concat", *dims, axis=0, **fwd), **fwd)
    perm = [0, 1, *range(2, 2 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2)]
    grouped = g.op("Reshape", g.op("Transpose", tiled, perm=perm, **fwd),
                   g.op("Concat", lead, outs, g.ints([-1]), axis=0, **fwd), **fwd)
    return g.op("Cast", g.op("ArgMax", grouped, axis=-1, keepdims=0, **fwd), to=TensorProto.UINT8, **fwd)


def _tile_spread(g: Grad, x: str, offsets: str, dy: str, kernel: Sequence[int]) -> str:
    """dY put on the elements `_tile_offsets` names, zeros elsewhere. float of static sizes: `_tile_unpool`.
    Otherwise a one-hot of each offset along a new axis (Equal against 0..K-1), times dY, then laid out as x.
    float: one ConvTranspose with stride = kernel and a one-hot weight writes every tile, its input a single
    image of K channels whose first spatial axis runs over batch, channels and the first output axis (one
    GEMM; with N*C images instead, LeNet's second pool took 2.3x longer); other types interleave by a
    Transpose. Rows and columns past the last tile get zeros (Pad). No scatter, no zero-filled plane, no index
    arithmetic. A non-finite dY makes its window's other elements nan (0 * inf) where torch leaves zeros."""
    nd = len(kernel)
    total = int(np.prod(kernel))
    dtype = g.dtype(x)
    static = g.info(x).shape
    if dtype == TensorProto.FLOAT and static is not None and all(isinstance(n, int) for n in static[1:]) \
            and int(np.prod(static[1:])) <= FLOAT_EXACT:
        return _tile_unpool(g, x, offsets, dy, kernel, static[1], static[2:])
    if static is not None and all(isinstance(n, int) for n in static[2:]):
        outs = g.ints([n // k for n, k in zip(static[2:], kernel)])
    else:
        outs = g.Div(g.Slice(g.shape_of(x), g.ints([2]), g.ints([2 + nd])), g.ints(kernel))
    tiled = g.Mul(outs, g.ints(kernel))
    if dtype == TensorProto.FLOAT:  # onnxruntime's ConvTranspose is float only
        hot = g.Equal(g.unsqueeze(offsets, [0]),
                      g.const(np.arange(total).reshape(total, *[1] * (nd + 2)), elem_type=TensorProto.UINT8))
        vals = g.Mul(g.Cast(hot, to=dtype), g.unsqueeze(dy, [0]))  # (K, N, C, out...)
        # one image of K channels whose first spatial axis runs over N, C and the first output axis
        rows = g.Concat(g.ints([1, total, -1]), g.Slice(outs, g.ints([1]), g.ints([nd])), axis=0) if nd > 1 \
            else g.ints([1, total, -1])
        onehot = g.const(np.eye(total).reshape(total, 1, *kernel), like=x)
        spread = g.ConvTranspose(g.Reshape(vals, rows), onehot, kernel_shape=list(kernel), strides=list(kernel))
        out = g.Reshape(spread, g.Concat(g.Slice(g.shape_of(x), g.ints([0]), g.ints([2])), tiled, axis=0))
    else:
        hot = g.Equal(g.unsqueeze(offsets, [2]),
                      g.const(np.arange(total).reshape(total, *[1] * nd), elem_type=TensorProto.UINT8))
        vals = g.Mul(g.Cast(hot, to=dtype), g.unsqueeze(dy, [2]))  # (N, C, K, out...)
        vals = g.Reshape(vals, g.Concat(g.ints([0, 0, *kernel]), outs, axis=0))
        perm = [0, 1, *(a for i in range(nd) for a in (2 + nd + i, 2 + i))]
        out = g.Reshape(g.Transpose(vals, perm=perm), g.Concat(g.ints([0, 0]), tiled, axis=0))
    if static is None or not all(isinstance(n, int) and n % k == 0 for n, k in zip(static[2:], kernel)):
        sizes = _sizes(g, x, nd)
        tail = g.Mod(sizes, g.ints(kernel)) if isinstance(sizes, str) else [n % k for n, k in zip(sizes, kernel)]
        out = g.Pad(out, _pads(g, [0] * nd, tail))
    return out


def _tile_unpool(g: Grad, x: str, offsets: str, dy: str, kernel: Sequence[int], channels: int,
                 sizes: Sequence[int]) -> str:
    """dY put back by MaxUnpool at the flat index in x of the element each window picked: the stashed offset
    f as a displacement in x, `f + sum_i r_i (stride_i - K_i)` (`r_i` its digit along axis i, `K_i` the
    tile's own stride), plus the tile's first element within a sample (a constant), in float32, exact while a
    sample has at most 2^24 elements (onnxruntime's int64 Div and Cast from bytes are slower); the sample's
    start added in int64. Bit for bit torch's backward, non-finite dY included; zeros where no window reaches
    (the rows and columns past the last tile)."""
    nd = len(kernel)
    strides = [int(np.prod(sizes[i + 1:])) for i in range(nd)]
    plane = int(np.prod(sizes))
    start = np.arange(channels).reshape(-1, *[1] * nd) * plane
    for i, (n, k) in enumerate(zip(sizes, kernel)):
        start = start + (np.arange(n // k) * k * strides[i]).reshape(-1, *[1] * (nd - 1 - i))
    f = g.Cast(offsets, to=TensorProto.FLOAT)
    index = f
    for i in range(nd - 1):
        inner = int(np.prod(kernel[i + 1:]))
        digit = g.Floor(g.Div(f, g.const(np.float32(inner))))
        if i:
            digit = g.Mod(digit, g.const(np.float32(kernel[i])), fmod=1)
        index = g.Add(index, g.Mul(digit, g.const(np.float32(strides[i] - inner))))
    index = g.Cast(g.Add(index, g.const(start.astype(np.float32))), to=TensorProto.INT64)
    shape = g.shape_of(x)
    batch = g.Range(g.ints(0), g.Gather(shape, g.ints(0)), g.ints(1))
    first = g.Reshape(g.Mul(batch, g.ints(channels * plane)), g.ints([-1] + [1] * (nd + 1)))
    return g.MaxUnpool(dy, g.Add(index, first), shape, kernel_shape=list(kernel), strides=list(kernel))


@rule("MaxPool", since=13, nondiff_outputs=(1,))
def max_pool(g: Grad):
    """dY goes to the element each window picked (the first maximum, as torch). Tiling windows: found in the
    forward part as a byte per output (`_tile_offsets`), spread back by a one-hot (`_tile_spread`); otherwise
    read from the Indices output (added to the node when absent), so backward stashes int64 indices the size
    of Y rather than X."""
    x, dy = g.I(0), g.GO(0)
    rank = g.require_rank(x)
    kernel = list(g.attr("kernel_shape"))
    if rank == len(kernel) + 2 and _tiles(g, kernel):
        return (_tile_spread(g, x, _tile_offsets(g, x, kernel), dy, kernel),)
    strides = g.attr("strides", [1] * len(kernel))
    dilations = g.attr("dilations", [1] * len(kernel))
    overlap = any((k - 1) * d + 1 > s for k, s, d in zip(kernel, strides, dilations))
    indices = g.output(1, "indices")
    flat = _scatter_flat(g, x, indices, dy, overlap)
    if not int(g.attr("storage_order", 0)):
        return (g.reshape_like(flat, x),)
    # column-major indices: the flat gradient is laid out with the spatial dims reversed
    rev = [0, 1, *range(rank - 1, 1, -1)]
    shape_rev = g.Gather(g.shape_of(x), g.ints(rev))
    return (g.Transpose(g.Reshape(flat, shape_rev), perm=rev),)


def _divisors(win: Window, sizes: Sequence[int], outs: Sequence[int], include_pad: bool) -> np.ndarray:
    """How many elements each average-pool window divides by (product over dims of the window taps that
    fall inside the input, or inside input plus pads with count_include_pad)."""
    per_dim = []
    for i, (n, o) in enumerate(zip(sizes, outs)):
        lo, hi = (-win.begin[i], n + win.end[i]) if include_pad else (0, n)  # type: ignore[index]
        taps = (np.arange(o) * win.strides[i] - win.begin[i])[:, None] + np.arange(win.kernel[i]) * win.dilations[i]
        per_dim.append(((taps >= lo) & (taps < hi)).sum(axis=1))
    return np.maximum(reduce(np.multiply.outer, per_dim), 1)


def _counted(g: Grad, x: str, win: Window, tails: Sizes, include_pad: bool) -> str:
    """`_divisors` at run time, shaped (1, 1, out...): a ones-kernel Conv over the indicator of the counted
    positions (the input, or input plus pads) laid on the padded grid the windows span, which begins at
    -begin and ends at n + tail."""
    nd = len(win.kernel)
    n = _sizes(g, x, nd)
    if include_pad:  # counted: [-begin, n + end)
        end = _vec(g, win.end)
        length, lead, trail = g.Add(g.Add(_vec(g, n), _vec(g, win.begin)), end), [0] * nd, g.Sub(_vec(g, tails), end)
    else:
        length, lead, trail = n, win.begin, tails
    one = helper.make_tensor("value", g.dtype(x) or TensorProto.FLOAT, [1], [1])
    ones = g.cast_like(g.ConstantOfShape(g.Concat(g.ints([1, 1]), _vec(g, length), axis=0), value=one), x, x)
    region = g.Pad(ones, _pads(g, lead, trail))
    return g.Conv(region, g.const(np.ones([1, 1, *win.kernel]), like=x), kernel_shape=list(win.kernel),
                  strides=list(win.strides), dilations=list(win.dilations))


TILE_PRODUCT_MAX = 16
"""Most pooled positions along the last axis for which `_tile_spread_by_product` pays: its MatMul does a
multiply-add per output element and pooled column (a 2x2 pool, alone, 2 threads: 14 columns 0.07-0.13 ms against
the ConvTranspose's 0.14-0.21 and Resize's 0.14-0.23; 16 columns level with Resize; 56 columns Resize 4x faster)."""


def _tiling(win: Window, tails: Sizes) -> bool:
    """Whether the windows tile the input: stride = kernel, no dilation or begin pad, nothing past the input's end
    (floor mode leaves rows and columns short of it, which get zeros)."""
    return (win.strides == win.kernel and all(d == 1 for d in win.dilations) and not isinstance(win.begin, str)
            and not any(win.begin) and not isinstance(tails, str) and all(t <= 0 for t in tails))


def _tile_spread_by_product(g: Grad, t: str, x: str, kernel: Sequence[int], tails: Sequence[int], scale: float
                            ) -> str | None:
    """t's element at (..., i, j) times `scale` over its tile of x, for 1-D and 2-D tilings of static sizes: the
    tiles of one pooled row are kernel[0] whole rows of x, contiguous, so one MatMul of t's rows (pooled
    columns) by a constant [w, kernel[0] * W] spreading matrix writes them, zero columns past the last tile
    (and a Pad of zeros the rows past it)."""
    nd = len(kernel)
    dims = _dims(g, x, nd)
    if nd > 2 or None in dims or g.dtype(x) not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return None
    sizes: list[int] = dims  # type: ignore[assignment]
    outs = [n // k for n, k in zip(sizes, kernel)]
    w, wide, rows = outs[-1], sizes[-1], (kernel[0] if nd == 2 else 1)
    if w > TILE_PRODUCT_MAX:
        return None
    spread = np.zeros((w, rows, wide))
    for j in range(w):
        spread[j, :, j * kernel[-1]:(j + 1) * kernel[-1]] = scale
    out = g.MatMul(g.Reshape(t, g.ints([-1, w])), g.const(spread.reshape(w, rows * wide), like=x))
    lead = g.Slice(g.shape_of(x), g.ints([0]), g.ints([2]))
    if nd == 1:
        return g.Reshape(out, g.Concat(lead, g.ints([wide]), axis=0))
    out = g.Reshape(out, g.Concat(lead, g.ints([outs[0] * kernel[0], wide]), axis=0))
    short = _ends_deficit(tails)[1][0]
    return g.Pad(out, _pads(g, [0, 0], [short, 0])) if short else out


def _tile_spread_by_resize(g: Grad, t: str, x: str, kernel: Sequence[int], tails: Sequence[int], scale: float
                           ) -> str | None:
    """The same by a nearest-neighbour Resize (float32 only in onnxruntime; opset 11 for its floor mapping)."""
    if g.dtype(x) != TensorProto.FLOAT or g.opset < 11:
        return None
    nd = len(kernel)
    if scale != 1.0:
        t = g.Mul(t, g.const(scale, like=x))
    out = g.Resize(t, "", g.const(np.array([1, 1, *kernel], np.float32)), mode="nearest",
                   coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    deficit = _ends_deficit(tails)[1]
    return g.Pad(out, _pads(g, [0] * nd, deficit)) if any(deficit) else out


def _disjoint(win: Window) -> bool:
    """Whether no two windows share a position: no dilation, a stride of at least the kernel."""
    return all(d == 1 for d in win.dilations) and all(s >= k for s, k in zip(win.strides, win.kernel))


def _disjoint_spread_by_gather(g: Grad, t: str, x: str, win: Window, scale: float) -> str:
    """Disjoint windows: input position i of a spatial dim lies in window (i + begin) // s where (i + begin) % s <
    k and that window exists, in none otherwise; t is gathered so along each dim and zeroed outside every window.
    Sized like x from the start, where the ones-kernel ConvTranspose over run-time sizes makes the windows' whole
    extent before cropping it: EfficientNet's pooler, a 1280-wide kernel with ceil_mode over 8x8 maps, asked for
    N*C*1280*1280 floats."""
    nd = len(win.kernel)
    shape, pooled = g.shape_of(x), g.shape_of(g.O(0))  # t is shaped like the pool's output
    zero, one = g.ints(0), g.ints(1)
    out, inside = t, None
    for i in range(2, 2 + nd):
        k, s = win.kernel[i - 2], win.strides[i - 2]
        begin = g.Gather(win.begin, g.ints(i - 2)) if isinstance(win.begin, str) else g.ints(win.begin[i - 2])
        pos = g.Add(g.Range(zero, g.Gather(shape, g.ints(i)), one), begin)
        window, last = g.Div(pos, g.ints(s)), g.Sub(g.Gather(pooled, g.ints(i)), one)
        out = g.Gather(out, g.Min(window, last), axis=i)
        hit = g.LessOrEqual(window, last)
        if s > k:
            hit = g.And(hit, g.Less(g.Mod(pos, g.ints(s)), g.ints(k)))
        hit = g.Reshape(hit, g.ints([1, 1, *[-1 if a == i else 1 for a in range(2, 2 + nd)]]))
        inside = hit if inside is None else g.And(inside, hit)
    kept = g.Where(inside, out, g.const(0.0, like=x))
    return g.Mul(kept, g.const(scale, like=x)) if scale != 1.0 else kept


def spread_windows(g: Grad, t: str, x: str, win: Window, tails: Sizes, scale: float = 1.0) -> str:
    """Adjoint of summing each window of x (times `scale`): t (shaped like the pool's output) added onto every
    position of its window. Tiling windows copy t over each tile by a MatMul or a Resize
    (`_tile_spread_by_product`, `_tile_spread_by_resize`: onnxruntime's ConvTranspose runs a GEMM of one
    column per pooled element there, 2-4x slower); otherwise a ones-kernel ConvTranspose over (N*C, 1, out...)
    shaped back like x."""
    nd = len(win.kernel)
    if _tiling(win, tails):
        ends = [int(e) for e in tails]  # static: `_tiling` checked
        out = _tile_spread_by_product(g, t, x, win.kernel, ends, scale) \
            or _tile_spread_by_resize(g, t, x, win.kernel, ends, scale)
        if out is not None:
            return out
    if _disjoint(win) and (isinstance(tails, str) or any(
            n is not None and k > n for n, k in zip(_dims(g, x, nd), win.kernel))):
        return _disjoint_spread_by_gather(g, t, x, win, scale)
    flat = g.Reshape(t, g.ints([-1, 1, *[0] * nd]))  # 0: the output's spatial sizes, whatever they are
    ones = g.const(np.full([1, 1, *win.kernel], scale), like=x)
    return g.reshape_like(_onto_input(g, flat, ones, win, tails, kernel_shape=list(win.kernel)), x)


@rule("AveragePool", since=13)
def average_pool(g: Grad):
    """dY / divisor spread over each window. The divisors are constants when the sizes are static or every
    window counts all its taps (no ceil_mode, and count_include_pad or no pads), else computed at run time."""
    x, dy = g.I(0), g.GO(0)
    kernel = list(g.attr("kernel_shape"))
    nd = len(kernel)
    ceil, include_pad = bool(g.attr("ceil_mode", 0)), bool(g.attr("count_include_pad", 0))
    win = node_window(g, x, kernel)
    tails = window_tails(g, win, x, ceil)
    sizes = _dims(g, x, nd)
    if not ceil and (include_pad or (not isinstance(win.begin, str) and not any(win.pads))):
        return (spread_windows(g, dy, x, win, tails, 1.0 / float(np.prod(kernel))),)
    elif all(n is not None for n in sizes):
        outs = win.out_sizes(sizes, ceil)  # type: ignore[arg-type]
        inv = 1.0 / _divisors(win, sizes, outs, include_pad)  # type: ignore[arg-type]
        scaled = g.Mul(dy, g.const(inv.flat[0] if np.all(inv == inv.flat[0]) else inv, like=x))
    else:
        scaled = g.Div(dy, _counted(g, x, win, tails, include_pad))
    return (spread_windows(g, scaled, x, win, tails),)


def _spatial_count(g: Grad, x: str) -> str:
    """Number of spatial positions of x, computed at run time, as a scalar of x's type."""
    count = g.ReduceProd(g.Slice(g.shape_of(x), g.ints([2]), g.ints([np.iinfo(np.int64).max])), keepdims=0)
    return g.cast_like(count, x)


@rule("GlobalAveragePool", since=13)
def global_average_pool(g: Grad):
    """dY / count over every position. Static sizes: one broadcasting Mul by a constant plane of 1/count
    (onnxruntime's Expand of [N, C, 1, 1] is 1.7-3.8x slower there)."""
    x, dy = g.I(0), g.GO(0)
    shape = g.info(x).shape
    if shape is not None and len(shape) > 2 and all(isinstance(d, int) for d in shape[2:]):
        spatial = [int(d) for d in shape[2:]]
        return (g.Mul(dy, g.const(np.full([1, 1, *spatial], 1.0 / float(np.prod(spatial))), like=x)),)
    return (g.Expand(g.Div(dy, _spatial_count(g, x)), g.shape_of(x)),)


@rule("GlobalMaxPool", since=13)
def global_max_pool(g: Grad):
    """dY goes to each channel's argmax, found in the forward part so only (N, C, 1) indices are stashed."""
    x, dy = g.I(0), g.GO(0)
    by_channel = g.ints([0, 0, -1])
    index = g.ArgMax(g.Reshape(x, by_channel, forward=True), axis=2, keepdims=1, forward=True)
    zeros = g.Reshape(g.zeros_like(x), by_channel)
    return (g.reshape_like(g.ScatterElements(zeros, index, g.Reshape(dy, by_channel), axis=2), x),)


@rule("MaxUnpool", since=13, nondiff=(1, 2))
def max_unpool(g: Grad):
    """Y places each X at its index (flat over all of Y, batch and channels included, as MaxPool's Indices
    count) among zeros, so dX is dY read at the indices: a Gather, as torch's max_unpool backward (an index two
    elements share gives both its gradient)."""
    return (g.Gather(g.Reshape(g.GO(0), g.ints([-1])), g.I(1)), None, None)


# --- normalization -------------------------------------------------------------------------------
def _centered(g: Grad, x: str, axes: Sequence[int], eps: float) -> tuple[str, str]:
    """(x - mean, invstd) of x over `axes` (biased variance, keepdims), recomputed in backward."""
    centered = g.Sub(x, g.reduce("ReduceMean", x, axes))
    var = g.reduce("ReduceMean", g.Mul(centered, centered), axes)
    return centered, _inv_std(g, var, eps, like=x)


def _standardize(g: Grad, x: str, axes: Sequence[int], eps: float) -> tuple[str, str]:
    """(xhat, invstd) of x over `axes`, recomputed in backward."""
    centered, invstd = _centered(g, x, axes, eps)
    return g.Mul(centered, invstd), invstd


def _inv_std(g: Grad, var: str, eps: float, like: str) -> str:
    """1 / sqrt(var + eps), eps of like's type (a tensor whose type the builder knows)."""
    return g.Reciprocal(g.Sqrt(g.Add(var, g.const(eps, like=like))))


def _standardize_grad(g: Grad, dxhat: str, xhat: str, invstd: str, axes: Sequence[int],
                      means: tuple[str, str] | None = None) -> str:
    """dX for xhat = (x - mean(x)) * invstd over `axes`: invstd * (dxhat - mean(dxhat) - xhat mean(dxhat xhat));
    `means`: those two means made by the caller (kept dims), else reduced here."""
    if means is None:
        means = g.reduce("ReduceMean", dxhat, axes), g.reduce("ReduceMean", g.Mul(dxhat, xhat), axes)
    mean_d, mean_dx = means
    return g.Mul(invstd, g.Sub(g.Sub(dxhat, mean_d), g.Mul(xhat, mean_dx)))


def _is_training_bn(node: onnx.NodeProto, opset: int) -> bool:
    if opset >= 14:
        return any(a.name == "training_mode" and a.i for a in node.attribute)
    return sum(1 for o in node.output if o) > 1  # opset 9-13: the statistics outputs mean training


def _bn_stats_stop(node: onnx.NodeProto, opset: int, is_computed: Callable[[str], bool]) -> list[int]:
    """Mean and var are buffers (no gradient) in training mode, where Y ignores them, and in inference mode
    when they come from outside (running statistics); statistics the graph computes itself carry gradient."""
    if _is_training_bn(node, opset):
        return [3, 4]
    return [i for i in (3, 4) if i < len(node.input) and not is_computed(node.input[i])]


def _readable(g: Grad, stat_type: int, x: str) -> bool:
    """Whether statistics of `stat_type` a node outputs can stand for x's: of x's type, or float ones for a half
    x (cast down); float ones for a double x are less precise than recomputing."""
    return stat_type == g.dtype(x) or g.dtype(x) in HALF_TYPES


def _at_type_of(g: Grad, x: str, mean: str, invstd: str, stat_type: int) -> tuple[str, str]:
    """A forward node's mean and invstd (of `stat_type`) at x's type."""
    if stat_type != g.dtype(x):
        mean, invstd = g.cast_like(mean, x), g.cast_like(invstd, x)
    return mean, invstd


def _from_statistics(g: Grad, x: str, mean: str, invstd: str, stat_type: int) -> tuple[str, str]:
    """(xhat, invstd) at x's type from a mean and invstd the forward node output (broadcastable to x)."""
    mean, invstd = _at_type_of(g, x, mean, invstd, stat_type)
    return g.Mul(g.Sub(x, mean), invstd), invstd


def _batch_statistics(g: Grad, x: str, rank: int, eps: float) -> tuple[str, str] | None:
    """(mean, invstd), per channel at x's type, from a training BatchNormalization's running outputs when they
    are the batch statistics exactly: momentum 0 (running = batch * 1 + input * 0) with finite constant running
    inputs. The runtime exports torch's BatchNorm that way; backward then reads two values a channel instead of
    reducing over x twice again."""
    outs = g.node.output
    if g.opset < 14 or len(outs) < 3 or not outs[1] or not outs[2] or float(g.attr("momentum", 0.9)) != 0.0 \
            or not _readable(g, g.dtype(outs[2]), x):
        return None
    for k in (3, 4):
        value = g.const_input(k)
        if value is None or not np.all(np.isfinite(value)):
            return None
    invstd = _per_channel(g, _inv_std(g, outs[2], eps, like=outs[2]), rank)
    return _at_type_of(g, x, _per_channel(g, outs[1], rank), invstd, g.dtype(outs[2]))


def _grad_from_sums(g: Grad, x: str, dy: str, centered: str, invstd: str, a: str | None, axes: Sequence[int]
                    ) -> tuple[str | None, str, str]:
    """(dX, S1, S2) of a normalization over `axes` followed by a per-channel affine (a = scale * invstd; None: no
    dX wanted), from the two sums over those axes that its dscale and dbias are made of anyway, `S1 = sum dY` and
    `S2 = sum dY (x - mean)`: with M values a statistic, dX = a dY - a S1 / M - (x - mean) a invstd^2 S2 / M (the
    textbook form's means of dxhat are these sums times the scale, which is constant over `axes`)."""
    sum_dy = g.reduce_sum(dy, axes)
    sum_dyc = g.reduce_sum(g.Mul(dy, centered), axes)
    dx = None
    if a is not None:  # dX wanted
        like = g.dtype(x)
        inv_count = g.Div(g.Cast(g.Size(sum_dy), to=like), g.Cast(g.Size(x), to=like))
        b = g.Mul(a, g.Mul(sum_dy, inv_count))
        k = g.Mul(g.Mul(a, g.Mul(invstd, invstd)), g.Mul(sum_dyc, inv_count))
        dx = g.Sub(g.Sub(g.Mul(dy, a), b), g.Mul(centered, k))
    return dx, sum_dy, sum_dyc


def _batch_norm_training(g: Grad, x: str, scale: str, dy: str, rank: int, eps: float
                         ) -> tuple[str | None, str | None, str | None]:
    """(dX, dscale, dbias) of a training BatchNormalization by `_grad_from_sums` over batch and positions: eight
    passes over the input's size instead of thirteen."""
    axes = [0, *range(2, rank)]
    stats = _batch_statistics(g, x, rank, eps)
    if stats is None:  # recomputed from x
        centered, invstd = _centered(g, x, axes, eps)
    else:
        centered, invstd = g.Sub(x, stats[0]), stats[1]
    a = g.Mul(_per_channel(g, scale, rank), invstd) if g.needs(0) else None
    dx, sum_dy, sum_dyc = _grad_from_sums(g, x, dy, centered, invstd, a, axes)
    dscale = g.squeeze(g.Mul(sum_dyc, invstd), axes) if g.needs(1) else None
    dbias = g.squeeze(sum_dy, axes) if g.needs(2) else None
    return dx, dscale, dbias


@rule("BatchNormalization", since=13, nondiff=(3, 4), nondiff_if=_bn_stats_stop, nondiff_outputs=(1, 2, 3, 4))
def batch_norm(g: Grad):
    """Training mode normalizes with the batch statistics (read from the node when `_batch_statistics` can,
    else recomputed from X in backward), inference mode with the given mean/var: running statistics get no
    gradient (buffers in PyTorch), computed ones do."""
    x, scale, dy = g.I(0), g.I(1), g.GO(0)
    rank = g.require_rank(x)
    axes = [0, *range(2, rank)]
    eps = float(g.attr("epsilon", 1e-5))
    if _is_training_bn(g.node, g.opset):
        return (*_batch_norm_training(g, x, scale, dy, rank, eps), None, None)
    # y = scale * (x - mean) * (var + eps)^-1/2 + bias
    invstd = _per_channel(g, g.Reciprocal(g.Sqrt(g.Add(g.I(4), g.const(eps, like=x)))), rank)
    xhat = g.Mul(g.Sub(x, _per_channel(g, g.I(3), rank)), invstd) if g.needs(1) or g.needs(4) else None
    dxhat = g.Mul(dy, _per_channel(g, scale, rank)) if g.needs(0) or g.needs(3) or g.needs(4) else None
    dx = g.Mul(dxhat, invstd) if g.needs(0) else None
    dmean = g.Neg(g.reduce_sum(g.Mul(dxhat, invstd), axes, keepdims=False)) if g.needs(3) else None
    dvar = None
    if g.needs(4):
        half_inv_var = g.Mul(g.const(-0.5, like=x), g.Mul(invstd, invstd))
        dvar = g.reduce_sum(g.Mul(g.Mul(dxhat, xhat), half_inv_var), axes, keepdims=False)
    dscale = g.reduce_sum(g.Mul(dy, xhat), axes, keepdims=False) if g.needs(1) else None
    dbias = g.reduce_sum(dy, axes, keepdims=False) if g.needs(2) else None
    return (dx, dscale, dbias, dmean, dvar)


@rule("LayerNormalization", since=17, nondiff_outputs=(1, 2))
def layer_norm(g: Grad):
    """Normalized over axes [axis, rank). Backward reads the node's Mean/InvStdDev outputs (two values a row,
    as torch saves; added to the node when absent), which the kernel computes anyway, instead of reducing
    over x twice again: eight nodes fewer over the whole input."""
    x, scale, bias, dy = g.I(0), g.I(1), g.I(2), g.GO(0)
    rank = g.require_rank(x)
    axis = g.axis(g.attr("axis", -1), rank)
    axes = list(range(axis, rank))
    stat_type = int(g.attr("stash_type", TensorProto.FLOAT))  # the outputs' type, by the operator's definition
    if _readable(g, stat_type, x):  # float statistics for a float or half x
        xhat, invstd = _from_statistics(g, x, g.output(1, "mean"), g.output(2, "inv_std_dev"), stat_type)
    else:  # float statistics for a double input: recompute at full precision
        xhat, invstd = _standardize(g, x, axes, float(g.attr("epsilon", 1e-5)))
    column = _mean_column(g, scale, x, axes, rank) if g.needs(0) else None
    dy_xhat = g.Mul(dy, xhat) if g.needs(1) or column is not None else None
    dx = None
    if g.needs(0):  # mean(dxhat) = dY @ column, mean(dxhat xhat) = (dY xhat) @ column
        means = (g.MatMul(dy, column), g.MatMul(dy_xhat, column)) if column is not None else None
        dx = _standardize_grad(g, g.Mul(dy, scale), xhat, invstd, axes, means)
    dscale = g.unbroadcast(dy_xhat, like=scale) if g.needs(1) else None
    dbias = g.unbroadcast(dy, like=bias) if bias is not None and g.needs(2) else None
    return (dx, dscale, dbias)


def _mean_column(g: Grad, scale: str, x: str, axes: Sequence[int], rank: int) -> str | None:
    """The column scale / D, with which the two row means of LayerNorm's dX (dxhat = dY scale) are products:
    mean(dxhat) = dY @ column and mean(dxhat xhat) = (dY xhat) @ column, dY xhat being dscale's product anyway.
    Each mean then reads its operand once and writes nothing of its size (a ReduceMean of a Mul writes the
    product first): the backward alone 0.75x at [512, 128], 0.92x at [64, 512] (2 threads, hot). None unless one
    axis (the last, of static size D) is normalized, the scale is a vector of its size, and x is float or double
    (onnxruntime's CPU MatMul has no half kernel everywhere, and half sums would lose precision)."""
    shape, scale_shape = g.info(x).shape, g.info(scale).static_shape
    size = shape[-1] if shape is not None else None
    if list(axes) != [rank - 1] or not isinstance(size, int) or scale_shape != (size,) \
            or g.dtype(x) not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return None
    return g.unsqueeze(g.Div(scale, g.const(float(size), like=x)), [1])


@rule("InstanceNormalization", since=13)
def instance_norm(g: Grad):
    """Per sample and channel over the spatial axes, then a per-channel affine: `_grad_from_sums` over the spatial
    axes (the scale is constant over them), dscale and dbias those sums added over the batch."""
    x, scale, dy = g.I(0), g.I(1), g.GO(0)
    rank = g.require_rank(x)
    spatial = list(range(2, rank))
    centered, invstd = _centered(g, x, spatial, float(g.attr("epsilon", 1e-5)))
    a = g.Mul(_per_channel(g, scale, rank), invstd) if g.needs(0) else None
    dx, sum_dy, sum_dyc = _grad_from_sums(g, x, dy, centered, invstd, a, spatial)
    batch = [0, *spatial]
    dscale = g.reduce_sum(g.Mul(sum_dyc, invstd), batch, keepdims=False) if g.needs(1) else None
    dbias = g.reduce_sum(sum_dy, batch, keepdims=False) if g.needs(2) else None
    return (dx, dscale, dbias)


@rule("GroupNormalization", since=21)
def group_norm(g: Grad):
    """Standardized over (N, G, C/G * spatial), then a per-channel affine (opset 21; GroupNormalization-18,
    with one scale per group, is deprecated and rejected by the ONNX checker)."""
    x, scale, dy = g.I(0), g.I(1), g.GO(0)
    rank = g.require_rank(x)
    grouped = g.ints([0, int(g.attr("num_groups")), -1])
    xhat, invstd = _standardize(g, g.Reshape(x, grouped), [2], float(g.attr("epsilon", 1e-5)))
    dx = dscale = dbias = None
    if g.needs(0):
        dxhat = g.Reshape(g.Mul(dy, _per_channel(g, scale, rank)), grouped)
        dx = g.reshape_like(_standardize_grad(g, dxhat, xhat, invstd, [2]), x)
    if g.needs(1):
        dscale = g.reduce_sum(g.Mul(dy, g.reshape_like(xhat, x)), [0, *range(2, rank)], keepdims=False)
    if g.needs(2):
        dbias = _channel_sum(g, dy, rank)
    return (dx, dscale, dbias)


@rule("LpNormalization", since=13)
def lp_normalization(g: Grad):
    """y = x / |x|_p along axis: dX = (dY - s * sum(dY * y)) / |x|_p with s = y (p=2) or sign(x) (p=1). A zero
    vector, which onnxruntime's kernel (and ONNX's reference) maps to zeros, gets a zero gradient, not 0/0's NaN:
    1/|x|_p is taken as 0 there."""
    x, dy = g.I(0), g.GO(0)
    rank = g.require_rank(x)
    axis = g.axis(g.attr("axis", -1), rank)
    p = int(g.attr("p", 2))
    if p not in (1, 2):
        g.fail(f"p must be 1 or 2, not {p}")
    norm = g.reduce("ReduceL2" if p == 2 else "ReduceL1", x, [axis])
    nonzero = g.cast_like(g.Greater(norm, g.const(0.0, like=x)), x)
    inverse = g.Div(nonzero, g.Add(norm, g.Sub(g.const(1.0, like=x), nonzero)))  # 1 / |x|_p, or 0
    y = g.Mul(x, inverse)
    s = y if p == 2 else g.Sign(x)
    return (g.Mul(g.Sub(dy, g.Mul(s, g.reduce_sum(g.Mul(dy, y), [axis]))), inverse),)


# --- dropout -------------------------------------------------------------------------------------
@rule("Dropout", since=13, nondiff=(1, 2), nondiff_outputs=(1,))
def dropout(g: Grad):
    """Training: dX = dY * mask / (1 - ratio), with the mask the forward op drew (read from its mask
    output, added to the node when absent): a product, as torch's own dropout backward computes it
    (onnxruntime's Where costs ten times a Cast and a Mul). Inference (training_mode absent or false): identity."""
    x, ratio, mode, dy = g.I(0), g.I(1), g.I(2), g.GO(0)
    known_mode = g.const_input(2) if mode is not None else None
    for what, value in (("training_mode", known_mode), ("ratio", g.const_input(1) if ratio is not None else None)):
        if value is not None and value.size != 1:
            g.fail(f"its {what} is a constant of shape {list(value.shape)}; Dropout takes a scalar")
    if mode is None or (known_mode is not None and not bool(known_mode)):
        return (dy,)
    mask = g.output(1, "mask")
    known_ratio = 0.5 if ratio is None else g.const_input(1)
    if known_ratio is not None:
        r = float(known_ratio)
        scale = g.const(1.0 / (1.0 - r) if r < 1.0 else 0.0, like=x)
    else:
        keep = g.Sub(g.const(1.0, like=ratio), ratio)
        scale = g.cast_like(g.Reciprocal(keep), x)
    dropped = g.Mul(g.Mul(dy, g.cast_like(mask, x)), scale)
    return (dropped if known_mode is not None else g.Where(mode, dropped, dy),)
