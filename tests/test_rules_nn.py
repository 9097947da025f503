import math

import harness
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from harness import Trainer, check_op, single_op_model

import gradbuilder
from gradbuilder.errors import RuleError

rng = np.random.default_rng(0)


def r(*shape, dtype=np.float64):
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def f32(*shape):
    return r(*shape, dtype=np.float32)


def distinct(*shape):
    """float32 values at least 0.1 apart: float32 finite differences (eps 1e-2) never swap a max."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 - 1.0).astype(np.float32)


def torch_pad(x, begin, end, value=0.0):
    """F.pad with ONNX-ordered begin/end pads per spatial dim."""
    pads = []
    for b, e in zip(reversed(begin), reversed(end)):
        pads += [b, e]
    return F.pad(x, pads, value=value)


def same_pads(sizes, kernel, strides, dilations, upper):
    begin, end = [], []
    for n, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
        b = total // 2 if upper else total - total // 2
        begin.append(b)
        end.append(total - b)
    return begin, end


def backward_reads(model, wrt, outputs=("y0",)):
    """Names the backward half reads from the forward half (stash) and the forward inputs it reads."""
    training = gradbuilder.build_gradient_graph(model, wrt=list(wrt), outputs=list(outputs))
    manifest = gradbuilder.split(training)[2]
    return {e.name for e in manifest.backward_inputs if e.role in ("stash", "input")}


# --- Conv ----------------------------------------------------------------------------------------
def conv_ref(strides, dilations, begin, end, group):
    def fn(x, w, b=None):
        conv = (F.conv1d, F.conv2d, F.conv3d)[x.dim() - 3]
        return conv(torch_pad(x, begin, end), w, b, stride=strides, dilation=dilations, groups=group)
    return fn


CONV = [
    # x shape, w shape, strides, dilations, pads, group
    ((2, 4, 9), (6, 4, 3), [2], [1], [1, 2], 1),
    ((2, 4, 9), (6, 2, 3), [1], [2], [0, 0], 2),
    ((2, 3, 7, 8), (5, 3, 3, 3), [1, 1], [1, 1], [0, 0, 0, 0], 1),
    ((2, 3, 7, 8), (5, 3, 3, 3), [2, 2], [1, 1], [1, 1, 1, 1], 1),
    ((2, 3, 7, 8), (5, 3, 3, 2), [2, 3], [1, 1], [1, 0, 2, 1], 1),
    ((2, 3, 8, 8), (4, 3, 3, 3), [3, 3], [1, 1], [0, 0, 0, 0], 1),  # rows no window reaches
    ((2, 3, 9, 8), (4, 3, 3, 3), [2, 1], [2, 2], [2, 1, 0, 2], 1),
    ((2, 4, 7, 7), (6, 2, 3, 3), [1, 2], [1, 1], [1, 1, 1, 1], 2),
    ((2, 4, 7, 7), (4, 1, 3, 3), [1, 1], [1, 1], [1, 1, 1, 1], 4),  # depthwise
    ((2, 4, 7, 7), (8, 1, 3, 3), [2, 2], [2, 1], [2, 2, 2, 2], 4),  # depthwise multiplier 2
    # depthwise, dW a depthwise Conv over the batch stacked along rows: strided with rows the stride's rounding
    # adds (one window more, sliced off), dilated, rows no window reaches, ConvNeXt's 7x7 'same', 1-D, 3-D
    ((2, 4, 7, 7), (4, 1, 3, 3), [2, 2], [1, 1], [1, 1, 1, 1], 4),
    ((2, 4, 10, 7), (4, 1, 2, 3), [3, 2], [1, 1], [0, 1, 1, 0], 4),
    ((2, 8, 9, 8), (8, 1, 3, 3), [2, 1], [2, 1], [2, 1, 0, 2], 8),
    ((2, 4, 8, 8), (4, 1, 3, 3), [3, 3], [1, 1], [0, 0, 0, 0], 4),
    ((3, 8, 5, 6), (8, 1, 7, 7), [1, 1], [1, 1], [3, 3, 3, 3], 8),
    ((2, 6, 11), (6, 1, 5), [2], [1], [2, 1], 6),
    ((2, 3, 5, 4, 5), (3, 1, 3, 2, 3), [2, 1, 2], [1, 1, 1], [1, 0, 1, 1, 1, 0], 3),
    ((1, 2, 5, 6, 5), (4, 1, 3, 2, 3), [2, 1, 2], [1, 1, 1], [1, 0, 1, 1, 1, 0], 2),
    ((2, 2, 4, 5, 4), (3, 2, 2, 2, 2), [1, 1, 1], [1, 2, 1], [0, 0, 0, 0, 0, 0], 1),
    # 1x1 kernels (x is its own unfold): over a small map, strided over one (4x3 positions from 8x6, the last row
    # and column unread), 1-D strided, and padded (the one-hot Conv frames x)
    ((2, 5, 4, 4), (7, 5, 1, 1), [1, 1], [1, 1], [0, 0, 0, 0], 1),
    ((2, 8, 8, 6), (12, 8, 1, 1), [2, 2], [1, 1], [0, 0, 0, 0], 1),
    ((2, 6, 7), (4, 6, 1), [3], [1], [0, 0], 1),
    ((2, 4, 3, 3), (6, 4, 1, 1), [1, 1], [1, 1], [1, 0, 1, 1], 1),
    # 5x5 and larger from 1-3 channels (the weight gradient unfolds x): 'same', strided with uneven pads,
    # dilated, windows reaching past x (pads no output uses), 1-D, 3-D
    ((2, 1, 9, 9), (6, 1, 5, 5), [1, 1], [1, 1], [2, 2, 2, 2], 1),
    ((2, 3, 11, 10), (4, 3, 5, 5), [2, 2], [1, 1], [1, 2, 0, 1], 1),
    ((2, 2, 13, 12), (3, 2, 5, 5), [1, 2], [2, 2], [3, 1, 2, 3], 1),
    ((2, 1, 8, 8), (4, 1, 5, 5), [3, 3], [1, 1], [0, 0, 4, 4], 1),
    ((2, 1, 20), (4, 1, 25), [2], [1], [3, 2], 1),
    ((1, 1, 6, 6, 6), (2, 1, 3, 3, 3), [1, 2, 1], [1, 1, 1], [1, 0, 1, 1, 1, 0], 1),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xs,ws,strides,dilations,pads,group", CONV)
def test_conv(xs, ws, strides, dilations, pads, group, bias):
    nd = len(strides)
    inputs = [("x", f32(*xs)), ("w", f32(*ws))] + ([("b", f32(ws[0]))] if bias else [])
    check_op("Conv", inputs, conv_ref(strides, dilations, pads[:nd], pads[nd:], group), strides=strides,
             dilations=dilations, pads=pads, group=group, kernel_shape=list(ws[2:]))


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("xs,ws,strides", [
    ((2, 3, 7, 8), (4, 3, 3, 2), [1, 1]),
    ((2, 3, 7, 8), (4, 3, 3, 3), [2, 3]),
    ((2, 3, 9), (4, 3, 4), [2]),
])
def test_conv_auto_pad(xs, ws, strides, auto_pad):
    nd = len(strides)
    if auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    else:
        begin, end = same_pads(xs[2:], ws[2:], strides, [1] * nd, auto_pad == "SAME_UPPER")
    check_op("Conv", [("x", f32(*xs)), ("w", f32(*ws)), ("b", f32(ws[0]))],
             conv_ref(strides, [1] * nd, begin, end, 1), strides=strides, auto_pad=auto_pad)


def test_conv_symbolic_batch_no_kernel_shape():
    check_op("Conv", [("x", f32(3, 2, 6, 6)), ("w", f32(4, 2, 3, 3)), ("b", f32(4))],
             conv_ref([2, 2], [1, 1], [1, 1], [1, 1], 1), strides=[2, 2], pads=[1, 1, 1, 1], symbolic={"x": [0]})


def test_conv_weight_only_stashes_no_output():
    """A frozen input: only dW and dB are built, reading X (needed) and nothing else from the forward."""
    model = single_op_model("Conv", [("x", f32(2, 3, 6, 6)), ("w", f32(4, 3, 3, 3)), ("b", f32(4))], pads=[1] * 4)
    assert backward_reads(model, ["w", "b"]) == {"x"}
    check_op("Conv", [("x", f32(2, 3, 6, 6)), ("w", f32(4, 3, 3, 3)), ("b", f32(4))],
             conv_ref([1, 1], [1, 1], [1, 1], [1, 1], 1), pads=[1] * 4, wrt=["w", "b"])


@pytest.mark.parametrize("op,xs,ws,group,unknown", [
    ("Conv", (2, 6, 5, 5), (6, 1, 3, 3), 6, [0, 1]),
    ("Conv", (2, 4, 5, 5), (6, 2, 3, 3), 2, [0, 1]),
    ("ConvTranspose", (2, 4, 4, 4), (4, 3, 3, 3), 2, [0]),
])
def test_conv_weight_of_unknown_shape(op, xs, ws, group, unknown):
    """A weight computed in the graph whose shape inference loses (torch's legacy export of `w.expand(...)`
    targets a Where of its sizes): a Conv's channels per group come from its input's channels."""
    nd = len(xs) - 2
    ref = conv_ref([1] * nd, [1] * nd, [1] * nd, [1] * nd, group) if op == "Conv" else \
        conv_transpose_ref([1] * nd, [1] * nd, [1] * nd, [1] * nd, [0] * nd, group)
    check_op(op, [("x", f32(*xs)), ("w", f32(*ws))], ref, pads=[1] * 2 * nd, group=group,
             kernel_shape=list(ws[2:]), symbolic={"x": [0], "w": unknown})


def test_conv_transpose_weight_of_unknown_channels_fails_clearly():
    """ConvTranspose's channels per group are dim 1 of its weight, which only its output's channels tell."""
    model = single_op_model("ConvTranspose", [("x", f32(2, 4, 4, 4)), ("w", f32(4, 3, 3, 3))], group=2,
                            kernel_shape=[3, 3], symbolic={"w": [1]})
    with pytest.raises(RuleError, match=r"its weight 'w' \(channels per group\) and dim 1 of 'y0' are unknown"):
        gradbuilder.build_gradient_graph(model, wrt=["w"], outputs=["y0"])

# --- ConvTranspose -------------------------------------------------------------------------------
def conv_transpose_ref(strides, dilations, begin, end, extra, group):
    def fn(x, w, b=None):
        nd = x.dim() - 2
        convt = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        full = torch_pad(convt(x, w, None, stride=strides, dilation=dilations, groups=group), [0] * nd, extra)
        y = full[(slice(None), slice(None), *(slice(bg, full.shape[2 + i] - e) for i, (bg, e) in
                                               enumerate(zip(begin, end))))]
        return y if b is None else y + b.view(1, -1, *[1] * nd)
    return fn


CONVT = [
    # x shape, w shape, strides, dilations, pads, output_padding, group
    ((2, 3, 5), (3, 4, 3), [2], [1], [1, 0], [1], 1),
    ((2, 4, 5), (4, 2, 3), [1], [2], [0, 2], [0], 2),
    ((2, 3, 4, 5), (3, 2, 3, 3), [1, 1], [1, 1], [0, 0, 0, 0], [0, 0], 1),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], [1, 1], [1, 1, 1, 1], [1, 1], 1),
    ((2, 3, 4, 5), (3, 2, 3, 2), [2, 3], [2, 1], [1, 0, 2, 1], [1, 2], 1),
    ((2, 4, 4, 5), (4, 3, 3, 3), [2, 1], [1, 2], [1, 2, 0, 1], [1, 0], 2),
    ((2, 4, 4, 4), (4, 1, 3, 3), [2, 2], [1, 1], [1, 1, 1, 1], [1, 1], 4),
    ((2, 4, 6, 5), (4, 1, 3, 3), [1, 1], [1, 1], [1, 1, 1, 1], [0, 0], 4),
    ((2, 4, 4, 4), (4, 1, 3, 2), [3, 2], [2, 1], [0, 1, 2, 0], [2, 1], 4),
    ((1, 2, 3, 4, 3), (2, 2, 2, 3, 2), [2, 1, 2], [1, 1, 1], [0, 1, 1, 0, 0, 1], [1, 0, 0], 2),
    # onto 1-3 channels with a 5x5 kernel (a decoder's last layer): the weight gradient gathers dY's windows
    ((2, 4, 5, 5), (4, 3, 5, 5), [2, 2], [1, 1], [2, 1, 2, 1], [1, 0], 1),
    ((2, 5, 4, 6), (5, 1, 5, 5), [1, 2], [2, 1], [0, 0, 0, 0], [0, 1], 1),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("xs,ws,strides,dilations,pads,extra,group", CONVT)
def test_conv_transpose(xs, ws, strides, dilations, pads, extra, group, bias):
    nd = len(strides)
    inputs = [("x", f32(*xs)), ("w", f32(*ws))] + ([("b", f32(ws[1] * group))] if bias else [])
    check_op("ConvTranspose", inputs, conv_transpose_ref(strides, dilations, pads[:nd], pads[nd:], extra, group),
             strides=strides, dilations=dilations, pads=pads, output_padding=extra, group=group,
             kernel_shape=list(ws[2:]))


@pytest.mark.parametrize("xs,ws,strides,out_shape,auto_pad,begin,end,extra", [
    # output_shape: total padding split with the odd one at the start (begin = total - total // 2)
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], [8, 10], None, [1, 1], [0, 0], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], [7, 9], None, [1, 1], [1, 1], [0, 0]),
    ((2, 3, 5), (3, 2, 4), [3], [13], None, [2], [1], [0]),
    ((2, 3, 5), (3, 2, 3), [2], [12], None, [0], [0], [1]),  # longer than the input reaches: a zero at the end
    # SAME: output = input * stride; SAME_UPPER puts the odd one at the end
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], None, "SAME_UPPER", [0, 0], [1, 1], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], None, "SAME_LOWER", [1, 1], [0, 0], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 4, 3), [1, 2], None, "SAME_UPPER", [1, 0], [2, 1], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], None, "VALID", [0, 0], [0, 0], [0, 0]),
])
def test_conv_transpose_output_shape_auto_pad(xs, ws, strides, out_shape, auto_pad, begin, end, extra):
    attrs = {"strides": strides}
    if out_shape is not None:
        attrs["output_shape"] = out_shape
    if auto_pad is not None:
        attrs["auto_pad"] = auto_pad
    nd = len(strides)
    check_op("ConvTranspose", [("x", f32(*xs)), ("w", f32(*ws)), ("b", f32(ws[1]))],
             conv_transpose_ref(strides, [1] * nd, begin, end, extra, 1), **attrs)


def test_conv_transpose_symbolic_batch():
    check_op("ConvTranspose", [("x", f32(2, 3, 4, 4)), ("w", f32(3, 2, 3, 3))],
             conv_transpose_ref([2, 2], [1, 1], [1, 1], [1, 1], [1, 1], 1), strides=[2, 2], pads=[1] * 4,
             output_padding=[1, 1], symbolic={"x": [0]})


# --- pooling -------------------------------------------------------------------------------------
def out_sizes(sizes, kernel, strides, dilations, begin, end, ceil):
    outs = []
    for n, k, s, d, b, e in zip(sizes, kernel, strides, dilations, begin, end):
        span = n + b + e - (k - 1) * d - 1
        o = (math.ceil(span / s) if ceil else span // s) + 1
        outs.append(o - 1 if ceil and (o - 1) * s >= n + b else o)
    return outs


def windows(x, kernel, strides, dilations, begin, end, outs, fill):
    """(N, C, out..., k...) windows of x padded with `fill` (the end extended for ceil_mode windows)."""
    nd = len(kernel)
    need = [max(e, (o - 1) * s + (k - 1) * d + 1 - n - b)
            for n, k, s, d, b, e, o in zip(x.shape[2:], kernel, strides, dilations, begin, end, outs)]
    xp = torch_pad(x, begin, need, value=fill)
    ceil_extra = [nd_ - e for nd_, e in zip(need, end)]
    if fill == 0.0 and any(ceil_extra):  # positions past the end pad count as nothing
        pass
    for i in range(nd):
        xp = xp.unfold(2 + i, (kernel[i] - 1) * dilations[i] + 1, strides[i])
    return xp[(slice(None), slice(None), *(slice(0, o) for o in outs), *(slice(None, None, d) for d in dilations))]


def pool_ref(kind, kernel, strides, dilations, begin, end, ceil, include_pad=False):
    nd = len(kernel)

    def fn(x):
        outs = out_sizes(x.shape[2:], kernel, strides, dilations, begin, end, ceil)
        dims = tuple(range(-nd, 0))
        if kind == "max":
            return windows(x, kernel, strides, dilations, begin, end, outs, -math.inf).amax(dims)
        total = windows(x, kernel, strides, dilations, begin, end, outs, 0.0).sum(dims)
        # what each window divides by: taps inside x (or inside x plus pads), not past the end pad
        ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype)
        region = torch_pad(ones, begin, end, value=1.0 if include_pad else 0.0)
        count = windows(region, kernel, strides, dilations, [0] * nd, [0] * nd, outs, 0.0).sum(dims)
        return total / count
    return fn


POOL = [
    # x shape, kernel, strides, dilations, pads, ceil_mode
    ((2, 3, 8, 8), [2, 2], [2, 2], [1, 1], [0, 0, 0, 0], 0),
    ((2, 3, 7, 9), [3, 3], [2, 2], [1, 1], [1, 1, 1, 1], 0),
    ((2, 3, 7, 9), [3, 2], [1, 2], [1, 1], [1, 0, 2, 1], 0),
    ((2, 3, 7, 8), [3, 3], [2, 2], [1, 1], [0, 0, 0, 0], 1),
    ((2, 3, 8, 9), [3, 2], [2, 3], [1, 1], [1, 1, 1, 1], 1),
    ((2, 3, 9, 10), [2, 3], [3, 2], [1, 1], [1, 0, 0, 0], 1),
    ((2, 2, 9), [3], [2], [1], [1, 1], 0),
    ((2, 2, 10), [4], [3], [1], [2, 1], 1),
    ((1, 2, 5, 6, 5), [2, 3, 2], [2, 2, 1], [1, 1, 1], [0, 1, 1, 0, 1, 0], 0),
]


@pytest.mark.parametrize("xs,kernel,strides,dilations,pads,ceil", POOL)
def test_max_pool(xs, kernel, strides, dilations, pads, ceil):
    nd = len(kernel)
    check_op("MaxPool", [("x", r(*xs))], pool_ref("max", kernel, strides, dilations, pads[:nd], pads[nd:], ceil),
             kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=ceil)


@pytest.mark.parametrize("xs,kernel,strides,dilations,pads,ceil", [
    ((2, 3, 9, 9), [2, 2], [1, 1], [2, 2], [1, 1, 1, 1], 0),
    ((2, 3, 9, 10), [3, 2], [2, 2], [2, 3], [0, 1, 0, 1], 1),
    ((2, 2, 11), [3], [3], [2], [1, 1], 0),
])
def test_max_pool_dilations(xs, kernel, strides, dilations, pads, ceil):
    nd = len(kernel)
    check_op("MaxPool", [("x", r(*xs))], pool_ref("max", kernel, strides, dilations, pads[:nd], pads[nd:], ceil),
             kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads, ceil_mode=ceil)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("xs,kernel,strides", [((2, 3, 7, 6), [3, 3], [2, 2]), ((2, 2, 6, 5, 4), [2, 2, 2], [1, 2, 2]),
                                                ((2, 3, 7, 6), [2, 2], [2, 2])])
def test_max_pool_indices_output(xs, kernel, strides, storage_order):
    """The node has its Indices output (nondiff): backward reads it, in either storage order."""
    check_op("MaxPool", [("x", r(*xs))], pool_ref("max", kernel, strides, [1] * len(kernel), [0] * len(kernel),
                                                  [0] * len(kernel), 0),
             n_out=2, diff_outputs=[0], kernel_shape=kernel, strides=strides, storage_order=storage_order)


def test_max_pool_stashes_indices_not_input():
    model = single_op_model("MaxPool", [("x", r(2, 3, 8, 8))], kernel_shape=[3, 3], strides=[2, 2])
    reads = backward_reads(model, ["x"])
    assert "x" not in reads and len(reads) == 1


@pytest.mark.parametrize("opset", [13, 15, 16, 22])
@pytest.mark.parametrize("overlap", [False, True])
def test_max_pool_opsets(opset, overlap):
    kernel, strides = ([3, 3], [2, 2]) if overlap else ([2, 2], [2, 2])
    args = ("MaxPool", [("x", r(2, 3, 8, 8))], pool_ref("max", kernel, strides, [1, 1], [0, 0], [0, 0], 0))
    if overlap and opset < 16:
        with pytest.raises(RuleError, match="opset 16"):
            check_op(*args, opset=opset, kernel_shape=kernel, strides=strides)
    else:
        check_op(*args, opset=opset, kernel_shape=kernel, strides=strides)


@pytest.mark.parametrize("output_shape", [None, (2, 3, 7, 7)])
def test_max_unpool(output_shape):
    """MaxUnpool against torch's max_unpool2d, whose indices count within each plane where ONNX's count over the
    whole output (batch and channels too), with an index two pooled values share (overlapping windows); float32
    (onnxruntime's only kernel)."""
    x = np.random.default_rng(5).standard_normal((2, 3, 3, 3)).astype(np.float32)
    plane = 7 * 7 if output_shape else 6 * 6
    local = np.random.default_rng(6).integers(0, plane, (2, 3, 3, 3))
    local[1, 2, 0, 1] = local[1, 2, 0, 0]
    offsets = (np.arange(6) * plane).reshape(2, 3, 1, 1)
    inputs = [("x", x), ("indices", local + offsets)]
    if output_shape:
        inputs.append(("output_shape", np.array(output_shape)))
    size = output_shape[2:] if output_shape else None
    check_op("MaxUnpool", inputs,
             lambda a, *_: F.max_unpool2d(a, torch.as_tensor(local), [2, 2], [2, 2], output_size=size),
             consts=["output_shape"], out_ranks={"y0": 4}, kernel_shape=[2, 2], strides=[2, 2], fd=False)


@pytest.mark.parametrize("kernel,strides", [([3, 3], [2, 2]), ([2, 2], [2, 2])])
def test_max_pool_float16(kernel, strides):
    """onnxruntime has no float16 add-scatter: overlapping windows accumulate in float."""
    x = r(2, 3, 8, 8).astype(np.float16)
    check_op("MaxPool", [("x", x)], pool_ref("max", kernel, strides, [1, 1], [0, 0], [0, 0], 0),
             kernel_shape=kernel, strides=strides, fd=False, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_max_pool_auto_pad(auto_pad):
    sizes, kernel, strides = (7, 8), [3, 2], [2, 3]
    begin, end = ([0, 0], [0, 0]) if auto_pad == "VALID" else same_pads(sizes, kernel, strides, [1, 1],
                                                                           auto_pad == "SAME_UPPER")
    check_op("MaxPool", [("x", r(2, 3, *sizes))], pool_ref("max", kernel, strides, [1, 1], begin, end, 0),
             kernel_shape=kernel, strides=strides, auto_pad=auto_pad)


TILES = [((2, 3, 8, 8), [2, 2]), ((2, 3, 7, 9), [2, 2]), ((2, 2, 9), [3]), ((1, 2, 4, 6, 5), [2, 3, 2]),
         ((2, 3, 6, 6), [3, 2])]


@pytest.mark.parametrize("xs,kernel", TILES)
@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_max_pool_tiles(xs, kernel, symbolic, dtype):
    """Tiling windows (stride = kernel): a uint8 tile offset is stashed instead of int64 indices, the rows past
    the last tile get no gradient. float of static sizes puts dY back by MaxUnpool at indices made from the
    offsets, float of symbolic sizes spreads it by a ConvTranspose, double by a Transpose."""
    x = r(*xs, dtype=dtype)
    check_op("MaxPool", [("x", x)], pool_ref("max", kernel, kernel, [1] * len(kernel), [0] * len(kernel),
                                             [0] * len(kernel), 0),
             kernel_shape=kernel, strides=kernel, fd=False, symbolic={"x": list(range(len(xs)))} if symbolic else None)
    model = single_op_model("MaxPool", [("x", x)], kernel_shape=kernel, strides=kernel,
                            symbolic={"x": list(range(len(xs)))} if symbolic else None)
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    ops = {n.op_type for n in training.graph.node}
    float32 = dtype == np.float32
    assert "ScatterElements" not in ops
    assert ("MaxUnpool" in ops) == (float32 and not symbolic) and ("ConvTranspose" in ops) == (float32 and symbolic)
    manifest = gradbuilder.split(training)[2]
    stash = [e.name for e in manifest.backward_inputs if e.role == "stash"]
    types = {v.name: v.type.tensor_type.elem_type for v in gradbuilder.split(training)[0].graph.output}
    assert "x" not in backward_reads(model, ["x"])
    kinds = [types[n] for n in stash]  # the offsets, and x's shape when it is symbolic
    assert onnx.TensorProto.UINT8 in kinds and set(kinds) <= {onnx.TensorProto.UINT8, onnx.TensorProto.INT64}


@pytest.mark.parametrize("xs,kernel", [((2, 3, 7, 9), [2, 2]), ((2, 2, 9), [3]), ((1, 2, 4, 6, 5), [2, 3, 2])])
def test_max_pool_tiles_nonfinite(xs, kernel):
    """MaxUnpool's gradient is torch's bit for bit, an inf or nan in dY included: each reaches the element
    its window picked and nothing else (a one-hot spread would make the window's others nan)."""
    x = r(*xs, dtype=np.float32)
    model = single_op_model("MaxPool", [("x", x)], kernel_shape=kernel, strides=kernel)
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    assert "MaxUnpool" in {n.op_type for n in training.graph.node}
    xt = torch.from_numpy(x).requires_grad_()
    y = _torch_max_pool(kernel, kernel)(xt)
    dy = torch.from_numpy(r(*y.shape, dtype=np.float32))
    dy.view(-1)[0], dy.view(-1)[-1] = float("inf"), float("nan")
    (expected,) = torch.autograd.grad(y, xt, dy)
    _, grads = Trainer(training).step({"x": x}, [dy.numpy()])
    np.testing.assert_array_equal(grads["x"], expected.numpy())


def _torch_max_pool(kernel, strides):
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[len(kernel)]
    return lambda x: fn(x, kernel, strides)


@pytest.mark.parametrize("xs,kernel,strides", [*((xs, k, k) for xs, k in TILES), ((2, 3, 7, 8), [3, 3], [2, 2]),
                                               ((2, 2, 9), [3], [2])])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_max_pool_ties(xs, kernel, strides, dtype):
    """Equal maxima in a window: torch's CPU max_pool routes the gradient to the first in raster order. Values
    on a coarse grid make ties common; windows of one repeated value, negative or zero, are forced in.
    (NaN is not matched: torch picks the last NaN of a window, onnxruntime's ArgMax and MaxPool skip it.)"""
    x = np.round(r(*xs) * 1.5) / 2
    lead = (slice(None), slice(None))
    x[(*lead, *(slice(0, k) for k in kernel))] = -1.0
    x[(0, 0, *(slice(s, s + k) for s, k in zip(strides, kernel)))] = 0.0
    check_op("MaxPool", [("x", x.astype(dtype))], _torch_max_pool(kernel, strides), kernel_shape=kernel,
             strides=strides, fd=False)


def test_max_pool_symbolic_dims():
    check_op("MaxPool", [("x", r(2, 3, 7, 8))], pool_ref("max", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 1),
             kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, symbolic={"x": [0, 2, 3]})


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("xs,kernel,strides,dilations,pads,ceil", POOL)
def test_average_pool(xs, kernel, strides, dilations, pads, ceil, include_pad):
    nd = len(kernel)
    check_op("AveragePool", [("x", f32(*xs))],
             pool_ref("avg", kernel, strides, dilations, pads[:nd], pads[nd:], ceil, include_pad),
             kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=ceil, count_include_pad=include_pad)


@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_dilations(include_pad):
    """Dilations exist from opset 19."""
    kernel, strides, dilations, pads = [2, 3], [2, 1], [2, 2], [1, 2, 1, 1]
    check_op("AveragePool", [("x", f32(2, 3, 9, 8))],
             pool_ref("avg", kernel, strides, dilations, pads[:2], pads[2:], 1, include_pad), opset=19,
             kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads, ceil_mode=1,
             count_include_pad=include_pad)


TILES = [
    # x, kernel, the op that spreads dY over the tiles
    (f32(2, 3, 9, 7), [2, 3], "MatMul"),  # a row and a column past the last tile
    (f32(2, 3, 8, 8), [2, 2], "MatMul"),
    (f32(2, 2, 11), [3], "MatMul"),
    (f32(1, 2, 7, 41), [2, 2], "Resize"),  # 20 pooled columns
    (f32(1, 2, 5, 6, 9), [2, 3, 2], "Resize"),
]


@pytest.mark.parametrize("x,kernel,spread", TILES)
def test_average_pool_tiles(x, kernel, spread):
    """Windows tiling the input (stride = kernel): dY copied over each tile by a MatMul of few pooled columns or a
    Resize, rows and columns past the last tile zero."""
    nd = len(kernel)
    model = single_op_model("AveragePool", [("x", x)], 1, kernel_shape=kernel, strides=kernel)
    ops = {n.op_type for n in gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"]).graph.node}
    assert spread in ops and not ({"MatMul", "Resize", "ConvTranspose"} - {spread}) & ops
    check_op("AveragePool", [("x", x)], pool_ref("avg", kernel, kernel, [1] * nd, [0] * nd, [0] * nd, 0),
             kernel_shape=kernel, strides=kernel)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_average_pool_auto_pad(auto_pad):
    sizes, kernel, strides = (7, 8), [3, 2], [2, 3]
    begin, end = same_pads(sizes, kernel, strides, [1, 1], auto_pad == "SAME_UPPER")
    check_op("AveragePool", [("x", f32(2, 3, *sizes))], pool_ref("avg", kernel, strides, [1, 1], begin, end, 0),
             kernel_shape=kernel, strides=strides, auto_pad=auto_pad)


def test_average_pool_symbolic_batch():
    check_op("AveragePool", [("x", f32(2, 3, 7, 8))], pool_ref("avg", [2, 2], [2, 2], [1, 1], [0, 0], [0, 0], 1),
             kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1, symbolic={"x": [0, 1]})


@pytest.mark.parametrize("xs", [(2, 3, 5, 4), (2, 3, 6), (1, 2, 3, 4, 2)])
def test_global_pools(xs):
    dims = tuple(range(2, len(xs)))
    check_op("GlobalAveragePool", [("x", f32(*xs))], lambda x: x.mean(dims, keepdim=True))
    check_op("GlobalMaxPool", [("x", distinct(*xs))], lambda x: x.amax(dims, keepdim=True))


def test_global_pools_symbolic():
    dyn = {"x": [0, 2, 3]}
    check_op("GlobalAveragePool", [("x", f32(2, 3, 5, 4))], lambda x: x.mean((2, 3), keepdim=True), symbolic=dyn)
    check_op("GlobalMaxPool", [("x", distinct(2, 3, 5, 4))], lambda x: x.amax((2, 3), keepdim=True), symbolic=dyn)
    model = single_op_model("GlobalMaxPool", [("x", f32(2, 3, 5, 4))])
    assert "x" not in backward_reads(model, ["x"])


# --- symbolic spatial dims: one gradient graph for every input size --------------------------------
def check_sizes(op, cases, torch_fn, symbolic, *, opset=17, rtol=2e-4, atol=1e-4, **attrs):
    """Build one training graph with `symbolic` dims declared, run it on each input set of `cases` (the
    same names, other sizes along the symbolic dims): outputs and every gradient match torch at each size.
    Returns the op types of the training graph."""
    model = single_op_model(op, cases[0], opset=opset, symbolic=symbolic, **attrs)
    names = [n for n, _ in cases[0]]
    training = gradbuilder.build_gradient_graph(model, wrt=names, outputs=["y0"])
    onnx.checker.check_model(training, full_check=True)
    trainer = Trainer(training)
    shapes = set()
    for inputs in cases:
        feeds = dict(inputs)
        (y,), env = trainer.run_forward(feeds)
        cot = np.asarray(rng.standard_normal(y.shape), dtype=y.dtype)
        grads = trainer.run_backward(feeds, env, [cot])
        tin = [torch.from_numpy(v.astype(np.float64)).requires_grad_() for v in feeds.values()]
        ty = torch_fn(*tin)
        np.testing.assert_allclose(y, ty.detach().numpy(), rtol=rtol, atol=atol, err_msg="forward")
        ref = torch.autograd.grad(ty, tin, torch.from_numpy(cot.astype(np.float64)))
        for n, want in zip(names, ref):
            np.testing.assert_allclose(grads[n], want.numpy(), rtol=rtol, atol=atol, err_msg=f"{n} at {y.shape}")
        shapes.add(feeds["x"].shape)
    assert len(shapes) == len(cases)
    return [n.op_type for n in training.graph.node]


def sizes_of(*spatial):
    return [tuple(s) for s in spatial]


CONV_SYMBOLIC = [
    # x shape (batch, channels), spatial sizes, w shape, strides, dilations, pads, group, symbolic axes
    ((2, 4), sizes_of([9], [12]), (6, 4, 3), [2], [1], [1, 2], 1, [0, 2]),
    ((2, 4), sizes_of([11], [8]), (6, 2, 3), [3], [2], [0, 1], 2, [2]),
    ((2, 3), sizes_of([7, 8], [10, 9]), (5, 3, 3, 3), [2, 2], [1, 1], [1, 1, 1, 1], 1, [0, 2, 3]),
    ((2, 3), sizes_of([7, 8], [8, 11]), (5, 3, 3, 2), [2, 3], [1, 1], [1, 0, 2, 1], 1, [2, 3]),
    ((2, 3), sizes_of([8, 8], [9, 10]), (4, 3, 3, 3), [3, 3], [1, 1], [0, 0, 0, 0], 1, [2, 3]),  # rows unreached
    ((2, 3), sizes_of([9, 8], [9, 11]), (4, 3, 3, 3), [2, 1], [2, 2], [2, 1, 0, 2], 1, [3]),  # W only
    ((2, 4), sizes_of([7, 7], [6, 9]), (6, 2, 3, 3), [1, 2], [1, 1], [1, 1, 1, 1], 2, [2, 3]),
    ((2, 4), sizes_of([7, 7], [8, 6]), (8, 1, 3, 3), [2, 2], [2, 1], [2, 2, 2, 2], 4, [2, 3]),  # depthwise x2
    ((1, 2), sizes_of([5, 6, 5], [6, 7, 4]), (4, 1, 3, 2, 3), [2, 1, 2], [1, 1, 1], [1, 0, 1, 1, 1, 0], 2,
     [2, 3, 4]),
    ((2, 2), sizes_of([4, 5, 4], [5, 4, 6]), (3, 2, 2, 2, 2), [1, 1, 1], [1, 2, 1], [0] * 6, 1, [2, 3, 4]),
]


@pytest.mark.parametrize("lead,sizes,ws,strides,dilations,pads,group,axes", CONV_SYMBOLIC)
def test_conv_symbolic_spatial(lead, sizes, ws, strides, dilations, pads, group, axes):
    nd = len(strides)
    cases = [[("x", f32(*lead, *s)), ("w", f32(*ws)), ("b", f32(ws[0]))] for s in sizes]
    check_sizes("Conv", cases, conv_ref(strides, dilations, pads[:nd], pads[nd:], group), {"x": axes},
                strides=strides, dilations=dilations, pads=pads, group=group, kernel_shape=list(ws[2:]))


def same_ref(strides, dilations, kernel, upper, group=1):
    """conv_ref with SAME pads for the call's own size."""
    def fn(x, w, b=None):
        begin, end = same_pads(x.shape[2:], kernel, strides, dilations, upper)
        return conv_ref(strides, dilations, begin, end, group)(x, w, b)
    return fn


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("lead,sizes,ws,strides,dilations,group", [
    ((2, 3), sizes_of([7, 8], [8, 11]), (4, 3, 3, 2), [2, 3], [1, 1], 1),
    ((2, 4), sizes_of([7, 9], [10, 6]), (4, 2, 3, 3), [2, 1], [1, 1], 2),
    ((2, 3), sizes_of([9], [12]), (4, 3, 4), [2], [1], 1),
    ((2, 3), sizes_of([9], [12]), (4, 3, 4), [1], [1], 1),
])  # onnxruntime's Conv has no dilations with SAME
def test_conv_symbolic_auto_pad(lead, sizes, ws, strides, dilations, group, auto_pad):
    cases = [[("x", f32(*lead, *s)), ("w", f32(*ws)), ("b", f32(ws[0]))] for s in sizes]
    nd = len(strides)
    ref = (conv_ref(strides, dilations, [0] * nd, [0] * nd, group) if auto_pad == "VALID" else
           same_ref(strides, dilations, ws[2:], auto_pad == "SAME_UPPER", group))
    check_sizes("Conv", cases, ref, {"x": [0, *range(2, 2 + nd)]}, strides=strides, dilations=dilations,
                group=group, auto_pad=auto_pad)


def test_conv_static_shapes_and_unit_strides_need_no_run_time_pads():
    """Static sizes, or symbolic ones with stride 1 (Conv1d over text): the gradients bake in every pad."""
    static = single_op_model("Conv", [("x", f32(2, 3, 7, 8)), ("w", f32(4, 3, 3, 3))], strides=[2, 2], pads=[1] * 4)
    ops = [n.op_type for n in gradbuilder.build_gradient_graph(static, wrt=["x", "w"], outputs=["y0"]).graph.node]
    assert not {"Pad", "Shape", "Concat"} & set(ops)
    cases = [[("x", f32(2, 4, n)), ("w", f32(6, 4, 3)), ("b", f32(6))] for n in (9, 14)]
    ops = check_sizes("Conv", cases, conv_ref([1], [2], [2], [1], 1), {"x": [0, 2]}, dilations=[2], pads=[2, 1])
    assert not {"Pad", "Shape", "Concat"} & set(ops)
    ops = check_sizes("Conv", cases, same_ref([1], [1], [3], True), {"x": [0, 2]}, auto_pad="SAME_UPPER")
    assert not {"Pad", "Shape", "Concat"} & set(ops)


@pytest.mark.parametrize("xs,ws,strides,dilations,pads,extra,group", CONVT)
def test_conv_transpose_symbolic_spatial(xs, ws, strides, dilations, pads, extra, group):
    nd = len(strides)
    other = tuple(n + 1 + i for i, n in enumerate(xs[2:]))
    cases = [[("x", f32(*xs[:2], *s)), ("w", f32(*ws)), ("b", f32(ws[1] * group))] for s in (xs[2:], other)]
    ref = conv_transpose_ref(strides, dilations, pads[:nd], pads[nd:], extra, group)
    check_sizes("ConvTranspose", cases, ref, {"x": [0, *range(2, 2 + nd)]},
                strides=strides, dilations=dilations, pads=pads, output_padding=extra, group=group,
                kernel_shape=list(ws[2:]))


@pytest.mark.parametrize("xs,ws,strides,auto_pad,begin,end,extra", [
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], "SAME_UPPER", [0, 0], [1, 1], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], "SAME_LOWER", [1, 1], [0, 0], [0, 0]),
    ((2, 3, 4, 5), (3, 2, 4, 3), [1, 2], "SAME_UPPER", [1, 0], [2, 1], [0, 0]),
    ((2, 3, 5), (3, 2, 3), [3], "SAME_LOWER", [0], [0], [0]),
    ((2, 3, 4, 5), (3, 2, 3, 3), [2, 2], "VALID", [0, 0], [0, 0], [0, 0]),
])
def test_conv_transpose_symbolic_auto_pad(xs, ws, strides, auto_pad, begin, end, extra):
    nd = len(strides)
    other = tuple(n + 2 for n in xs[2:])
    cases = [[("x", f32(*xs[:2], *s)), ("w", f32(*ws)), ("b", f32(ws[1]))] for s in (xs[2:], other)]
    check_sizes("ConvTranspose", cases, conv_transpose_ref(strides, [1] * nd, begin, end, extra, 1),
                {"x": list(range(2, 2 + nd))}, strides=strides, auto_pad=auto_pad)


def test_conv_transpose_output_shape_with_symbolic_input_fails_clearly():
    """output_shape fixes the output whatever the input size: its pads need the input size when building."""
    model = single_op_model("ConvTranspose", [("x", f32(2, 3, 4, 5)), ("w", f32(3, 2, 3, 3))], strides=[2, 2],
                            output_shape=[8, 10], symbolic={"x": [2, 3]})
    with pytest.raises(RuleError, match="output_shape needs the spatial dims of 'x' to be static"):
        gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("xs,kernel,strides,dilations,pads,ceil", POOL)
def test_average_pool_symbolic_spatial(xs, kernel, strides, dilations, pads, ceil, include_pad):
    nd = len(kernel)
    other = tuple(n + 1 + i for i, n in enumerate(xs[2:]))
    cases = [[("x", f32(*xs[:2], *s))] for s in (xs[2:], other)]
    ops = check_sizes("AveragePool", cases,
                      pool_ref("avg", kernel, strides, dilations, pads[:nd], pads[nd:], ceil, include_pad),
                      {"x": [0, *range(2, 2 + nd)]}, kernel_shape=kernel, strides=strides, pads=pads, ceil_mode=ceil,
                      count_include_pad=include_pad)
    every_window_counts_all = not ceil and (include_pad or not any(pads))
    assert ("ConstantOfShape" in ops) != every_window_counts_all  # run-time divisors only when they vary


@pytest.mark.parametrize("xs,kernel,strides,pads,ceil,symbolic", [
    ((2, 3, 9, 10), [2, 3], [3, 4], [0, 1, 0, 0], 0, True),  # gaps between the windows
    ((2, 3, 7, 8), [3, 3], [3, 3], [1, 0, 1, 1], 1, True),  # tiles with pads, the last one cut
    ((2, 3, 5, 6), [16, 16], [16, 16], [0, 0, 0, 0], 1, True),  # one window past the whole input (EfficientNet's)
    ((2, 3, 5, 6), [16, 16], [16, 16], [0, 0, 0, 0], 1, False),
    ((2, 2, 11), [2], [5], [1, 0], 0, True),
])
@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_disjoint_windows_spread_by_gathers(xs, kernel, strides, pads, ceil, symbolic, include_pad):
    """Windows sharing no position, over run-time sizes or larger than the input: each input position takes its
    window's gradient by a Gather along each axis, zero outside every window. The ones-kernel ConvTranspose made the
    windows' whole extent first (N*C*1280*1280 floats for EfficientNet's 1280-wide pooler over 8x8 maps)."""
    nd = len(kernel)
    other = tuple(n + 2 + i for i, n in enumerate(xs[2:]))
    cases = [[("x", f32(*xs[:2], *s))] for s in ((xs[2:], other) if symbolic else (xs[2:],))]
    ops = check_sizes("AveragePool", cases,
                      pool_ref("avg", kernel, strides, [1] * nd, pads[:nd], pads[nd:], ceil, include_pad),
                      {"x": [0, *range(2, 2 + nd)]} if symbolic else {}, kernel_shape=kernel, strides=strides,
                      pads=pads, ceil_mode=ceil, count_include_pad=include_pad)
    assert "ConvTranspose" not in ops and "Gather" in ops


@pytest.mark.parametrize("include_pad", [0, 1])
def test_average_pool_symbolic_dilations(include_pad):
    kernel, strides, dilations, pads = [2, 3], [2, 1], [2, 2], [1, 2, 1, 1]
    cases = [[("x", f32(2, 3, *s))] for s in ((9, 8), (12, 11))]
    check_sizes("AveragePool", cases, pool_ref("avg", kernel, strides, dilations, pads[:2], pads[2:], 1, include_pad),
                {"x": [2, 3]}, opset=19, kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads,
                ceil_mode=1, count_include_pad=include_pad)


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_average_pool_symbolic_auto_pad(auto_pad, include_pad):
    kernel, strides = [3, 2], [2, 3]

    def ref(x):
        begin, end = same_pads(x.shape[2:], kernel, strides, [1, 1], auto_pad == "SAME_UPPER")
        return pool_ref("avg", kernel, strides, [1, 1], begin, end, 0, include_pad)(x)

    cases = [[("x", f32(2, 3, *s))] for s in ((7, 8), (8, 10), (9, 11))]  # onnxruntime fails W = 9 (pad -1)
    check_sizes("AveragePool", cases, ref, {"x": [2, 3]}, kernel_shape=kernel, strides=strides, auto_pad=auto_pad,
                count_include_pad=include_pad)


def test_symbolic_spatial_finite_differences():
    """The run-time pads and divisors of the symbolic paths, probed by check_op's finite differences too."""
    check_op("Conv", [("x", f32(2, 3, 7, 8)), ("w", f32(4, 3, 3, 3)), ("b", f32(4))],
             same_ref([2, 3], [1, 1], [3, 3], False), strides=[2, 3], auto_pad="SAME_LOWER",
             symbolic={"x": [0, 2, 3]})
    check_op("AveragePool", [("x", f32(2, 3, 7, 8))], pool_ref("avg", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 1),
             kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4, ceil_mode=1, symbolic={"x": [2, 3]})


@pytest.mark.parametrize("opset", [13, 23, 28])
def test_symbolic_spatial_opset_range_ends(opset):
    """The run-time pads (Pad with a pads input, negative ones cropping) and divisors at both opset ends."""
    dyn = {"x": [0, 2, 3]}
    check_op("Conv", [("x", f32(2, 4, 7, 8)), ("w", f32(4, 2, 3, 3)), ("b", f32(4))],
             conv_ref([2, 2], [1, 1], [1, 1], [1, 1], 2), opset=opset, strides=[2, 2], pads=[1] * 4, group=2,
             symbolic=dyn)
    check_op("Conv", [("x", f32(2, 3, 7, 8)), ("w", f32(4, 3, 3, 3))], same_ref([2, 3], [1, 1], [3, 3], True),
             opset=opset, strides=[2, 3], auto_pad="SAME_UPPER", symbolic=dyn)
    check_op("AveragePool", [("x", f32(2, 3, 7, 7))], pool_ref("avg", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 1),
             opset=opset, kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4, ceil_mode=1, symbolic=dyn)


def test_symbolic_spatial_float16():
    half, dyn = np.float16, {"x": [2, 3]}
    check_op("Conv", [("x", r(2, 3, 7, 7).astype(half)), ("w", (0.3 * r(4, 3, 3, 3)).astype(half))],
             conv_ref([2, 2], [1, 1], [1, 1], [1, 1], 1), strides=[2, 2], pads=[1] * 4, fd=False, rtol=2e-2,
             atol=2e-2, symbolic=dyn)
    check_op("AveragePool", [("x", r(2, 3, 7, 7).astype(half))],
             pool_ref("avg", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 1), kernel_shape=[3, 3], strides=[2, 2],
             pads=[1] * 4, ceil_mode=1, fd=False, rtol=1e-2, atol=1e-2, symbolic=dyn)


# --- normalization -------------------------------------------------------------------------------
def bn_inputs(xs, dtype=np.float64):
    c = xs[1]
    return [("x", r(*xs, dtype=dtype)), ("scale", r(c, dtype=dtype)), ("bias", r(c, dtype=dtype)),
            ("mean", r(c, dtype=dtype)), ("var", (np.abs(r(c)) + 0.5).astype(dtype))]


def type_untyped_outputs(monkeypatch, elem_type, shape):
    """Declare the outputs shape inference leaves untyped (BatchNormalization-9's saved statistics, the
    function op GroupNormalization-21)."""
    make = harness.single_op_model

    def patched(*args, **kwargs):
        model = make(*args, **kwargs)
        for o in model.graph.output:
            if not o.type.HasField("tensor_type"):
                o.CopyFrom(onnx.helper.make_tensor_value_info(o.name, elem_type, shape))
        return model

    monkeypatch.setattr(harness, "single_op_model", patched)


@pytest.mark.parametrize("momentum", [0.9, 0.0])  # 0: the running outputs are the batch statistics, read back
@pytest.mark.parametrize("xs", [(4, 3), (4, 3, 5), (3, 2, 4, 5), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("opset", [13, 15, 17])
def test_batch_norm_training(monkeypatch, xs, opset, momentum):
    inputs = bn_inputs(xs)
    mean, var = (torch.from_numpy(v) for _, v in inputs[3:])

    def ref(x, scale, bias):
        return F.batch_norm(x, mean.clone(), var.clone(), scale, bias, training=True, momentum=0.1, eps=1e-3)

    attrs = {"training_mode": 1} if opset >= 14 else {}
    n_out = 3 if opset >= 14 else 5  # opset 13: the statistics outputs are what make it training mode
    type_untyped_outputs(monkeypatch, onnx.TensorProto.DOUBLE, [xs[1]])
    check_op("BatchNormalization", inputs, ref, n_out=n_out, diff_outputs=[0], consts=["mean", "var"],
             opset=opset, epsilon=1e-3, momentum=momentum, **attrs)


@pytest.mark.parametrize(("momentum", "running", "means"), [
    (0.0, 1.0, 0),          # batch statistics read from the node: no mean over x
    (0.9, 1.0, 2),          # running outputs mix in the running inputs: mean and variance recomputed from x
    (0.0, np.inf, 2),       # 0 * inf is nan: recomputed
])
def test_batch_norm_training_reads_its_statistics(momentum, running, means):
    """Besides the statistics, backward reduces over x's size twice: sum dY and sum dY (x - mean), which dbias
    and dscale are and from which dX follows."""
    inputs = bn_inputs((4, 3, 5))
    inputs[4] = ("var", np.full(3, running))
    model = single_op_model("BatchNormalization", inputs, 3, opset=15, consts=["mean", "var"], training_mode=1,
                            momentum=momentum)
    training = gradbuilder.build_gradient_graph(model, wrt=["x", "scale", "bias"], outputs=["y0"])
    ops = [n.op_type for n in training.graph.node]
    assert ops.count("ReduceMean") == means and ops.count("ReduceSum") == 2


@pytest.mark.parametrize("xs", [(4, 3), (3, 2, 4, 5), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("opset", [13, 15])
def test_batch_norm_inference(xs, opset):
    def ref(x, scale, bias):
        return F.batch_norm(x, mean, var, scale, bias, training=False, eps=1e-3)

    inputs = bn_inputs(xs)
    mean, var = (torch.from_numpy(v) for _, v in inputs[3:])
    check_op("BatchNormalization", inputs, ref, opset=opset, epsilon=1e-3, consts=["mean", "var"])


def test_batch_norm_running_statistics_get_no_gradient():
    """Asked for in wrt, the running mean/var (buffers in PyTorch) get none, in either mode."""
    for attrs in ({"training_mode": 1}, {}):
        model = single_op_model("BatchNormalization", bn_inputs((3, 2, 4)), n_out=3 if attrs else 1,
                                opset=15, **attrs)
        meta = gradbuilder.read_metadata(
            gradbuilder.build_gradient_graph(model, wrt=["x", "scale", "bias", "mean", "var"], outputs=["y0"]))
        assert set(meta["gradients"]) == {"x", "scale", "bias"}
        assert "non-differentiable" in meta["no_gradient"]["mean"]


def test_batch_norm_symbolic_batch():
    inputs = bn_inputs((3, 2, 4, 5))
    mean, var = (torch.from_numpy(v) for _, v in inputs[3:])
    check_op("BatchNormalization", inputs,
             lambda x, s, b: F.batch_norm(x, mean.clone(), var.clone(), s, b, training=True),
             n_out=3, diff_outputs=[0], consts=["mean", "var"], training_mode=1, opset=15, symbolic={"x": [0, 2]})


def test_batch_norm_float32():
    inputs = bn_inputs((4, 3, 5, 5), np.float32)
    mean, var = (torch.from_numpy(v.astype(np.float64)) for _, v in inputs[3:])
    check_op("BatchNormalization", inputs,
             lambda x, s, b: F.batch_norm(x, mean.clone(), var.clone(), s, b, training=True),
             n_out=3, diff_outputs=[0], consts=["mean", "var"], training_mode=1)


@pytest.mark.parametrize("xs,axis", [((3, 4), -1), ((2, 3, 4), -1), ((2, 3, 4), 1), ((2, 3, 4), 0),
                                     ((2, 3, 2, 4), -2)])
@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(xs, axis, n_out, bias):
    norm = xs[axis % len(xs):]
    inputs = [("x", r(*xs)), ("scale", r(*norm))] + ([("bias", r(*norm))] if bias else [])
    check_op("LayerNormalization", inputs, lambda x, s, b=None: F.layer_norm(x, norm, s, b, eps=1e-4),
             n_out=n_out, diff_outputs=[0], axis=axis, epsilon=1e-4)


@pytest.mark.parametrize("n_out", [1, 3])
@pytest.mark.parametrize("dtype,reads", [(np.float32, True), (np.float64, False)])
def test_layer_norm_reads_statistics_not_recomputed(n_out, dtype, reads):
    """Backward reads the node's Mean/InvStdDev (added when the model left them out) and recomputes no
    statistics, unless they are float ones (the only stash_type onnx allows) for a double input: less precise
    than recomputing."""
    attrs = {"stash_type": onnx.TensorProto.FLOAT}
    inputs = [("x", r(2, 3, 4).astype(dtype)), ("s", r(4).astype(dtype)), ("b", r(4).astype(dtype))]
    model = single_op_model("LayerNormalization", inputs, n_out=n_out, **attrs)
    training = gradbuilder.build_gradient_graph(model, wrt=["x", "s", "b"], outputs=["y0"])
    ops = [n.op_type for n in training.graph.node]
    assert ("Sqrt" not in ops) == reads
    assert len([o for o in training.graph.node[0].output if o]) == (3 if reads else n_out)
    check_op("LayerNormalization", inputs, lambda x, s, b: F.layer_norm(x, (4,), s, b), n_out=n_out,
             diff_outputs=[0], rtol=1e-4 if dtype == np.float32 else 1e-7, fd=dtype == np.float64, **attrs)


def test_layer_norm_broadcast_scale_float32_symbolic():
    check_op("LayerNormalization", [("x", f32(2, 3, 4)), ("s", f32(1, 4)), ("b", f32(4))],
             lambda x, s, b: F.layer_norm(x, (3, 4)) * s + b, axis=1, n_out=3, diff_outputs=[0], symbolic={"x": [0]})


@pytest.mark.parametrize("xs", [(2, 3, 5), (2, 3, 4, 5), (1, 2, 3, 2, 3)])
def test_instance_norm(xs):
    c = xs[1]
    check_op("InstanceNormalization", [("x", f32(*xs)), ("s", f32(c)), ("b", f32(c))],
             lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-4), epsilon=1e-4)


@pytest.mark.parametrize("xs,groups", [((2, 4, 5), 2), ((2, 6, 3, 4), 3), ((2, 4, 3, 2), 4), ((2, 4, 3), 1)])
def test_group_norm(monkeypatch, xs, groups):
    """Opset 21: scale and bias are per channel (torch.nn.GroupNorm)."""
    c = xs[1]
    type_untyped_outputs(monkeypatch, onnx.TensorProto.DOUBLE, list(xs))
    check_op("GroupNormalization", [("x", r(*xs)), ("s", r(c)), ("b", r(c))],
             lambda x, s, b: F.group_norm(x, groups, s, b, eps=1e-4), opset=21, num_groups=groups, epsilon=1e-4,
             stash_type=onnx.TensorProto.DOUBLE)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("xs,axis", [((3, 4), -1), ((3, 4), 0), ((2, 3, 4), 1)])
def test_lp_normalization(xs, axis, p):
    check_op("LpNormalization", [("x", r(*xs))], lambda x: x / x.norm(p, dim=axis, keepdim=True), axis=axis, p=p)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_of_a_zero_vector(p):
    """onnxruntime's kernel maps a zero vector to zeros; its gradient there is zero too, not 0/0's NaN (which would
    reach every weight before it). Elsewhere as torch's; the probe stays off the zero row (y jumps there)."""
    x = r(3, 4)
    x[1] = 0.0

    def torch_fn(x):
        norm = x.norm(p, dim=1, keepdim=True)
        nonzero = (norm > 0).to(x.dtype)
        return x * nonzero / torch.where(norm > 0, norm, torch.ones_like(norm))

    grads = check_op("LpNormalization", [("x", x)], torch_fn, axis=1, p=p, fd_mask={"x": (x != 0).astype(float)})
    assert np.all(np.isfinite(grads["x"])) and not np.any(grads["x"][1])


# --- Dropout -------------------------------------------------------------------------------------
def dropout_step(model, x, wrt=("x",), feeds=None):
    """One ORT forward+backward; returns (y, grad, the mask ORT drew in that same forward pass)."""
    training = gradbuilder.build_gradient_graph(model, wrt=list(wrt), outputs=["y0"])
    onnx.checker.check_model(training, full_check=True)
    trainer = Trainer(training)
    feeds = {"x": x, **(feeds or {})}
    cot = r(*x.shape).astype(x.dtype)
    outs, env = trainer.run_forward(feeds)
    grads = trainer.run_backward(feeds, env, [cot] + [None] * (len(outs) - 1))
    stash = [n for n in trainer.manifest.stashed if n.endswith("mask") or n == "y1"]
    mask = env[stash[0]] if stash else None
    return outs[0], grads["x"], mask, cot


def dropout_torch(x, mask, ratio, cot):
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    y = tx * torch.from_numpy(mask) / (1.0 - ratio)
    y.backward(torch.from_numpy(cot.astype(np.float64)))
    return y.detach().numpy(), tx.grad.numpy()


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask-output", "no-mask-output"])
@pytest.mark.parametrize("ratio", [0.3, 0.75])
def test_dropout_training(with_mask, ratio):
    """Legacy export: the mask output is there; dynamo export: absent, then added to the node for backward.
    The torch reference uses the very mask onnxruntime drew."""
    x = r(6, 40)
    model = single_op_model("Dropout", [("x", x), ("ratio", np.array(ratio)), ("mode", np.array(True))],
                            n_out=2 if with_mask else 1, consts=["ratio", "mode"])
    y, grad, mask, cot = dropout_step(model, x)
    assert mask is not None and mask.dtype == np.bool_ and 0 < mask.mean() < 1
    ty, tgrad = dropout_torch(x, mask, ratio, cot)
    np.testing.assert_allclose(y, ty, rtol=1e-7)  # onnxruntime scales by 1 / (1 - ratio) in float
    np.testing.assert_allclose(grad, tgrad, rtol=1e-12)


def test_dropout_default_ratio_float32():
    x = f32(6, 40)
    model = single_op_model("Dropout", [("x", x), ("ratio", None), ("mode", np.array(True))], n_out=2,
                            consts=["mode"])
    _, grad, mask, cot = dropout_step(model, x)
    _, tgrad = dropout_torch(x, mask, 0.5, cot)
    np.testing.assert_allclose(grad, tgrad, rtol=1e-6)


def test_dropout_runtime_ratio_and_mode():
    """ratio and training_mode fed at run time: both branches of the mode are built."""
    x = r(6, 40)
    model = single_op_model("Dropout", [("x", x), ("ratio", np.array(0.4)), ("mode", np.array(True))], n_out=2)
    _, grad, mask, cot = dropout_step(model, x, feeds={"ratio": np.array(0.4), "mode": np.array(True)})
    np.testing.assert_allclose(grad, dropout_torch(x, mask, 0.4, cot)[1], rtol=1e-12)
    _, grad, _, cot = dropout_step(model, x, feeds={"ratio": np.array(0.4), "mode": np.array(False)})
    np.testing.assert_allclose(grad, cot)


@pytest.mark.parametrize("mode", [None, False])
def test_dropout_inference_is_identity(mode):
    inputs = [("x", r(3, 4)), ("ratio", np.array(0.5))] + ([("mode", np.array(mode))] if mode is not None else [])
    check_op("Dropout", inputs, lambda x: x, consts=["ratio", "mode"])
    model = single_op_model("Dropout", inputs, consts=["ratio", "mode"])
    assert backward_reads(model, ["x"]) == set()


# --- opsets, dtypes, limits ----------------------------------------------------------------------
def _conv_case(opset):
    check_op("Conv", [("x", f32(2, 4, 6, 6)), ("w", f32(4, 2, 3, 3)), ("b", f32(4))],
             conv_ref([2, 2], [1, 1], [1, 1], [1, 1], 2), opset=opset, strides=[2, 2], pads=[1] * 4, group=2)


def _conv_transpose_case(opset):
    check_op("ConvTranspose", [("x", f32(2, 4, 3, 3)), ("w", f32(4, 2, 3, 3))],
             conv_transpose_ref([2, 2], [1, 1], [1, 1], [1, 1], [1, 1], 2), opset=opset, strides=[2, 2],
             pads=[1] * 4, output_padding=[1, 1], group=2)


def _pool_case(opset):
    check_op("AveragePool", [("x", f32(2, 3, 7, 7))], pool_ref("avg", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 1),
             opset=opset, kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4, ceil_mode=1)
    check_op("MaxPool", [("x", r(2, 3, 7, 7))], pool_ref("max", [2, 2], [2, 2], [1, 1], [1, 1], [1, 1], 0),
             opset=opset, kernel_shape=[2, 2], strides=[2, 2], pads=[1] * 4)  # no overlap: opset 13 has no add-scatter
    check_op("GlobalAveragePool", [("x", f32(2, 3, 4, 4))], lambda x: x.mean((2, 3), keepdim=True), opset=opset)
    check_op("GlobalMaxPool", [("x", distinct(2, 3, 4, 4))], lambda x: x.amax((2, 3), keepdim=True), opset=opset)


def _norm_case(opset):
    check_op("InstanceNormalization", [("x", f32(2, 3, 5)), ("s", f32(3)), ("b", f32(3))],
             lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-5), opset=opset)
    check_op("LpNormalization", [("x", r(3, 4))], lambda x: x / x.norm(2, dim=1, keepdim=True), opset=opset)
    inputs = bn_inputs((3, 2, 4))
    mean, var = (torch.from_numpy(v) for _, v in inputs[3:])
    bn_train = {"training_mode": 1, "n_out": 3, "diff_outputs": [0]} if opset >= 14 else {}
    check_op("BatchNormalization", inputs,
             lambda x, s, b: F.batch_norm(x, mean.clone(), var.clone(), s, b, training=bool(bn_train)),
             consts=["mean", "var"], opset=opset, **bn_train)
    if opset >= 17:
        check_op("LayerNormalization", [("x", r(2, 3, 4)), ("s", r(4))], lambda x, s: F.layer_norm(x, (4,), s),
                 opset=opset)


def _dropout_case(opset):
    model = single_op_model("Dropout", [("x", r(4, 50)), ("ratio", np.array(0.5)), ("mode", np.array(True))],
                            opset=opset, consts=["ratio", "mode"])
    x = r(4, 50)
    _, grad, mask, cot = dropout_step(model, x)
    np.testing.assert_allclose(grad, dropout_torch(x, mask, 0.5, cot)[1], rtol=1e-12)


@pytest.mark.parametrize("opset", [13, 23, 28])
@pytest.mark.parametrize("case", [_conv_case, _conv_transpose_case, _pool_case, _norm_case, _dropout_case],
                         ids=lambda f: f.__name__)
def test_opset_range_ends(case, opset):
    """Every rule at both ends of its declared opset range emits ops valid there (checker + onnxruntime)."""
    case(opset)


def test_group_norm_opset_23(monkeypatch):
    type_untyped_outputs(monkeypatch, onnx.TensorProto.DOUBLE, [2, 4, 3])
    check_op("GroupNormalization", [("x", r(2, 4, 3)), ("s", r(4)), ("b", r(4))],
             lambda x, s, b: F.group_norm(x, 2, s, b), opset=23, num_groups=2, stash_type=onnx.TensorProto.DOUBLE)


def test_float16_conv_and_layer_norm():
    """Half inputs: the rules build their constants in the input's type; LayerNorm reads float statistics."""
    half = np.float16
    check_op("Conv", [("x", r(2, 3, 6, 6).astype(half)), ("w", (0.3 * r(4, 3, 3, 3)).astype(half))],
             conv_ref([2, 2], [1, 1], [1, 1], [1, 1], 1), strides=[2, 2], pads=[1] * 4, fd=False, rtol=2e-2, atol=2e-2)
    check_op("LayerNormalization", [("x", r(3, 8).astype(half)), ("s", r(8).astype(half)), ("b", r(8).astype(half))],
             lambda x, s, b: F.layer_norm(x, (8,), s, b), n_out=3, diff_outputs=[0], fd=False, rtol=2e-2, atol=2e-2)
    check_op("AveragePool", [("x", r(2, 3, 6, 6).astype(half))],
             pool_ref("avg", [3, 3], [2, 2], [1, 1], [1, 1], [1, 1], 0), kernel_shape=[3, 3], strides=[2, 2],
             pads=[1] * 4, fd=False, rtol=1e-2, atol=1e-2)


def test_window_out_sizes_match_onnxruntime():
    """Window.out_sizes against the sizes onnxruntime produces, including ceil_mode windows that would start
    in the end padding (dropped; ONNX shape inference still counts them, so no model test can have them)."""
    from itertools import product

    from gradbuilder.rules.nn import Window

    for n, k, s, d, pb, pe, ceil in product([7, 8], [2, 3], [2, 3], [1, 2], [0, 1], [0, 1, 2], [0, 1]):
        if pb >= k or pe >= k:
            continue
        node = onnx.helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k], strides=[s], dilations=[d],
                                     pads=[pb, pe], ceil_mode=ceil)
        graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info("x", 1, [1, 1, n])],
                                       [onnx.helper.make_tensor_value_info("y", 1, None)])
        sess = harness.session(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 19)]))
        got = sess.run(None, {"x": np.zeros((1, 1, n), np.float32)})[0].shape[2]
        assert Window((k,), (s,), (d,), (pb,), (pe,)).out_sizes([n], bool(ceil)) == [got], (n, k, s, d, pb, pe, ceil)


def test_batch_norm_inference_with_computed_statistics():
    """Inference-mode BatchNormalization fed statistics the graph computes (dynamo's export of a BatchNorm
    without running stats): mean and var carry gradient back to what they are computed from."""
    oh = onnx.helper
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 5, 5))
    scale, bias = rng.standard_normal(3), rng.standard_normal(3)
    mean, var = rng.standard_normal(3), rng.uniform(0.5, 2.0, 3)
    d = onnx.TensorProto.DOUBLE
    nodes = [oh.make_node("Identity", ["m_in"], ["m"]), oh.make_node("Identity", ["v_in"], ["v"]),
             oh.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], epsilon=1e-5)]
    ins = [oh.make_tensor_value_info(n, d, list(a.shape)) for n, a in
           (("x", x), ("s", scale), ("b", bias), ("m_in", mean), ("v_in", var))]
    model = oh.make_model(oh.make_graph(nodes, "bn", ins, [oh.make_tensor_value_info("y", d, list(x.shape))]),
                          opset_imports=[oh.make_opsetid("", 15)])
    names = ["x", "s", "b", "m_in", "v_in"]
    training = gradbuilder.build_gradient_graph(model, wrt=names)
    c = rng.standard_normal(x.shape)
    feeds = dict(zip(names, (x, scale, bias, mean, var)))
    _, grads = Trainer(training).step(feeds, [c])

    t = {n: torch.tensor(a, requires_grad=True) for n, a in feeds.items()}
    shape = (1, -1, 1, 1)
    y = ((t["x"] - t["m_in"].reshape(shape)) / torch.sqrt(t["v_in"].reshape(shape) + 1e-5) * t["s"].reshape(shape)
         + t["b"].reshape(shape))
    ref = torch.autograd.grad(y, list(t.values()), torch.tensor(c))
    for n, r in zip(names, ref):
        np.testing.assert_allclose(grads[n], r.numpy(), rtol=1e-9, atol=1e-12, err_msg=n)


def test_batch_norm_running_statistics_stay_buffers():
    rng = np.random.default_rng(4)
    inputs = [("x", rng.standard_normal((4, 3, 5))), ("s", np.ones(3)), ("b", np.zeros(3)),
              ("m", np.zeros(3)), ("v", np.ones(3))]
    for training in (0, 1):
        model = single_op_model("BatchNormalization", inputs, 1 + 2 * training, opset=15, consts=["m", "v"],
                                training_mode=training)
        meta = gradbuilder.read_metadata(gradbuilder.build_gradient_graph(model, wrt=["x", "m", "v"],
                                                                            outputs=["y0"]))
        assert set(meta["gradients"]) == {"x"}
        assert "non-differentiable" in meta["no_gradient"]["m"]


def test_conv1d_weight_gradient_unfolds_over_few_positions():
    """The small-map swap is 2-D only (onnxruntime's blocked kernels, which make it pay, are 2-D)."""
    rng = np.random.default_rng(0)
    model = single_op_model("Conv", [("x", rng.standard_normal((2, 8, 4)).astype(np.float32)),
                                     ("w", rng.standard_normal((8, 8, 3)).astype(np.float32))], pads=[1, 1])
    ops = [n.op_type for n in gradbuilder.build_gradient_graph(model, wrt=["w"]).graph.node]
    assert "MatMul" in ops and ops.count("Conv") == 2  # the forward and the one-hot unfold


@pytest.mark.parametrize(("kernel", "inputs", "outputs", "size", "group", "expected"), [
    (3, 4, 4, 8, 1, "per sample"),   # 3x3: the input unfolded, against dY sample by sample
    (3, 4, 4, 4, 1, "swapped"),      # 3x3 over 4x4 positions: the unfold's grouped Conv would make N*C tiny calls
    (3, 3, 4, 4, 1, "per sample"),   # ... but from at most 3 channels it unfolds
    (3, 4, 4, None, 1, "swapped"),   # positions unknown when building: the unfolded size is unbounded
    (3, 4, 4, 128, 1, "swapped"),    # 4 x 9 x 128 x 128 unfolded elements a sample: above the bound
    (3, 4, 200, 8, 1, "one GEMM"),   # more outputs than twice the 64 positions
    (5, 4, 32, 8, 1, "swapped"),     # 5x5 from 4 channels, to however many
    (5, 1, 4, 8, 1, "gathered"),     # 5x5 from 1 channel: the windows gathered, one GEMM a chunk of positions
    (5, 1, 6, 28, 1, "gathered"),    # LeNet's first layer: 3 chunks of positions (5 MB gathered at batch 64)
    (5, 1, 4, None, 1, "swapped"),   # ... but only where the positions are known when building
    (7, 1, 8, 32, 1, "gathered"),    # a grey-scale stem's kernel over 32x32: 50k gathered a sample
    (7, 1, 8, 400, 1, "swapped"),    # ... over 400x400: 7.8M a sample, above the bound
    (5, 3, 4, 8, 1, "swapped"),      # 5x5 from 3 channels: blocked in onnxruntime, the images as channels
    (5, 2, 4, 8, 1, "swapped"),      # ... and from 2
    (7, 3, 8, 32, 1, "swapped"),     # a ResNet stem's kernel over 32x32
    (5, 4, 4, 8, 1, "swapped"),      # 5x5 from 4 to 4 channels: the Conv with batch and channels swapped
    (3, 4, 6, 8, 2, "swapped"),      # grouped
    (1, 32, 96, 4, 1, "one GEMM"),   # 1x1 over 4x4: x is its own unfold (no grouped Conv), one GEMM for 96 outputs
    (1, 32, 16, 4, 1, "per sample"),  # ... per sample for 16
])
def test_conv_weight_gradient_formulation(kernel: int, inputs: int, outputs: int, size: int | None, group: int,
                                          expected: str) -> None:
    """Which weight-gradient formulation a Conv gets (every one is checked against torch by the Conv tests)."""
    rng = np.random.default_rng(0)
    side = size or 8
    model = single_op_model("Conv", [("x", rng.standard_normal((2, inputs, side, side)).astype(np.float32)),
                                     ("w", rng.standard_normal((outputs, inputs // group, kernel, kernel)).astype(
                                         np.float32))],
                            pads=[kernel // 2] * 4, group=group, symbolic={"x": [0] if size else [0, 2, 3]})
    training = gradbuilder.build_gradient_graph(model, wrt=["w"])
    ops = [n.op_type for n in training.graph.node]
    formulation = ("gathered" if "Gather" in ops else "one GEMM" if "Gemm" in ops else "per sample" if "MatMul" in ops
                   else "swapped" if ops.count("Conv") == 2 else "?")
    assert formulation == expected
    if expected == "gathered":
        chunks = -(-inputs * kernel**2 * side**2 * 64 * 4 // (2 << 20))  # ~2 MB a chunk at a batch of 64
        assert ops.count("Gemm") == ops.count("Gather") == chunks
    elif kernel == 1:  # no unfolding Conv: the forward's is the only one
        assert ops.count("Conv") == 1
    elif expected != "swapped":  # the one-hot unfolding Conv has a group per input channel
        assert [a.i for n in training.graph.node if n.op_type == "Conv" for a in n.attribute
                if a.name == "group"][-1] == inputs
    else:  # dY as the kernel, its type declared (dims of the forward output, batch and channels swapped)
        kernel_of = next(n for n in training.graph.node if n.op_type == "Conv" and n.input[0] != "x").input[1]
        declared = {v.name: v.type.tensor_type for v in training.graph.value_info}[kernel_of]
        dims = [d.dim_value or d.dim_param for d in declared.shape.dim]
        assert declared.elem_type == onnx.TensorProto.FLOAT and len(dims) == 4
        assert dims[0] == outputs and isinstance(dims[1], str)
        if size:
            assert dims[2:] == [side, side]
