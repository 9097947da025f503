"""LRN, MeanVarianceNormalization, RMSNormalization, LpPool, GlobalLpPool, Shrink.

The references are the ONNX formulas in float64 torch (torch's own LRN centres even windows the other way,
and its lp_pool does not take |x|). onnxruntime has no double LRN, LpPool or MeanVarianceNormalization
kernels: those run in float32.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import check_op, single_op_model

import gradbuilder

rng = np.random.default_rng(0)


def r64(*shape):
    return np.asarray(rng.standard_normal(shape))


def f32(*shape):
    return r64(*shape).astype(np.float32)


# --- LRN -------------------------------------------------------------------------------------------
def lrn_ref(size, alpha, beta, bias):
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2

    def fn(x):
        sq = F.pad(x * x, [0, 0] * (x.dim() - 2) + [lo, hi])  # pad the channel axis
        window = sum(sq[:, k:k + x.shape[1]] for k in range(size))
        return x / (bias + alpha / size * window) ** beta
    return fn


@pytest.mark.parametrize("shape", [(2, 6, 3, 4), (1, 3, 2, 5)])  # onnxruntime runs 4-D LRN only
@pytest.mark.parametrize("size,alpha,beta,bias", [(3, 1e-4, 0.75, 1.0), (3, 0.5, 0.6, 2.0), (1, 0.3, 1.0, 1.5),
                                                  (5, 2.0, 0.75, 1.0)])  # onnxruntime: odd sizes only
def test_lrn(shape, size, alpha, beta, bias):
    check_op("LRN", [("x", f32(*shape))], lrn_ref(size, alpha, beta, bias), size=size, alpha=alpha, beta=beta,
             bias=bias)


def test_lrn_symbolic():
    check_op("LRN", [("x", f32(2, 6, 3, 4))], lrn_ref(3, 0.5, 0.75, 1.0), size=3, alpha=0.5,
             symbolic={"x": [0, 1, 2, 3]})


def test_lrn_float16():
    check_op("LRN", [("x", f32(2, 6, 3, 4).astype(np.float16))], lrn_ref(3, 0.5, 0.75, 1.0), size=3, alpha=0.5,
             fd=False, rtol=3e-2, atol=3e-2)


def test_lrn_matches_torch_for_odd_sizes():
    check_op("LRN", [("x", f32(2, 6, 3, 4))], lambda x: F.local_response_norm(x, 5, 0.5, 0.75, 2.0), size=5,
             alpha=0.5, beta=0.75, bias=2.0)


# --- MeanVarianceNormalization ------------------------------------------------------------------------------
def mvn_ref(axes):
    def fn(x):
        m = x.mean(dim=axes, keepdim=True)
        sigma = ((x * x).mean(dim=axes, keepdim=True) - m * m).sqrt()
        return (x - m) / (sigma + 1e-9)
    return fn


@pytest.mark.parametrize("shape,axes", [((2, 3, 4, 5), [0, 2, 3]), ((2, 3, 4, 5), [1]), ((3, 4, 5), [0, 2]),
                                        ((2, 3, 4, 5), [1, 2, 3])])
def test_mean_variance_normalization(shape, axes):
    """axes given: onnx 1.23's shape inference fails on the function body of the default axes."""
    check_op("MeanVarianceNormalization", [("x", f32(*shape))], mvn_ref(axes), axes=axes)


def test_mean_variance_normalization_symbolic():
    check_op("MeanVarianceNormalization", [("x", f32(2, 3, 4, 5))], mvn_ref([0, 2, 3]), axes=[0, 2, 3],
             symbolic={"x": [0, 2]})


# --- RMSNormalization --------------------------------------------------------------------------------
def rms_ref(axis, eps):
    def fn(x, scale):
        axes = list(range(axis % x.dim(), x.dim()))
        return x / ((x * x).mean(dim=axes, keepdim=True) + eps).sqrt() * scale
    return fn


@pytest.mark.parametrize("shape,scale_shape,axis", [((2, 5, 4), (4,), -1), ((2, 5, 4), (5, 4), 1),
                                                    ((2, 5, 4), (5, 1), 1), ((3, 4), (4,), 1),
                                                    ((2, 3, 4), (1,), -1)])
def test_rms_normalization(shape, scale_shape, axis):
    check_op("RMSNormalization", [("x", r64(*shape)), ("scale", r64(*scale_shape))], rms_ref(axis, 1e-5), opset=23,
             axis=axis)


def test_rms_normalization_epsilon_symbolic_and_frozen_scale():
    check_op("RMSNormalization", [("x", r64(2, 5, 4)), ("scale", r64(4))], rms_ref(-1, 0.3), opset=23,
             epsilon=0.3, symbolic={"x": [0, 1]})
    check_op("RMSNormalization", [("x", r64(2, 5, 4)), ("scale", r64(4))], rms_ref(-1, 1e-5), opset=23,
             wrt=["x"])


def test_rms_normalization_float16():
    x = r64(2, 5, 8).astype(np.float16)
    check_op("RMSNormalization", [("x", x), ("scale", r64(8).astype(np.float16))], rms_ref(-1, 1e-5), opset=23,
             rtol=3e-2, atol=3e-2, fd=False)


def test_rms_normalization_matches_torch():
    check_op("RMSNormalization", [("x", r64(2, 5, 4)), ("scale", r64(4))],
             lambda x, s: F.rms_norm(x, (4,), s, eps=1e-5), opset=23)


# --- LpPool ------------------------------------------------------------------------------------------
def lp_pool_ref(p, kernel, strides, dilations, begin, end, ceil):
    """(sum over the window of |x|^p)^(1/p), zeros outside the input (pads and ceil_mode's partial windows)."""
    def fn(x):
        n, c, *sizes = x.shape
        outs = []
        for sz, k, s, dl, b, e in zip(sizes, kernel, strides, dilations, begin, end):
            span = sz + b + e - (k - 1) * dl - 1
            o = (-(-span // s) if ceil else span // s) + 1
            if ceil and (o - 1) * s >= sz + b:
                o -= 1
            outs.append(o)
        need = [max(e, (o - 1) * s + (k - 1) * dl + 1 - sz - b)
                for sz, k, s, dl, b, e, o in zip(sizes, kernel, strides, dilations, begin, end, outs)]
        pads = []
        for b, e in zip(reversed(begin), reversed(need)):
            pads += [b, e]
        t = F.pad(x.abs() ** p, pads).reshape(n * c, 1, *[sz + b + e for sz, b, e in zip(sizes, begin, need)])
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(sizes) - 1]
        s = conv(t, torch.ones(1, 1, *kernel, dtype=x.dtype), stride=strides, dilation=dilations)
        s = s[(slice(None), slice(None), *[slice(0, o) for o in outs])]
        return s.reshape(n, c, *outs) ** (1.0 / p)
    return fn


LP = [
    # shape, kernel, strides, dilations, pads, ceil_mode
    ((2, 3, 7, 6), [3, 2], [2, 2], [1, 1], [0, 0, 0, 0], 0),
    ((2, 3, 7, 6), [3, 3], [1, 1], [1, 1], [1, 1, 1, 1], 0),
    ((2, 3, 7, 6), [3, 2], [2, 3], [1, 1], [1, 0, 0, 1], 0),
    ((2, 3, 7, 6), [2, 2], [2, 2], [1, 1], [0, 0, 0, 0], 1),
    ((2, 3, 8, 7), [2, 3], [2, 2], [2, 1], [1, 0, 1, 1], 1),
    ((2, 3, 9), [3], [2], [1], [1, 1], 0),
    ((1, 2, 4, 5, 4), [2, 2, 2], [1, 2, 1], [1, 1, 1], [0, 0, 1, 0, 0, 0], 0),
]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("shape,kernel,strides,dilations,pads,ceil", LP)
def test_lp_pool(shape, kernel, strides, dilations, pads, ceil, p):
    nd = len(kernel)
    attrs = dict(kernel_shape=kernel, strides=strides, pads=pads, p=p)
    if ceil or any(d != 1 for d in dilations):
        attrs.update(ceil_mode=ceil, dilations=dilations)
    x = f32(*shape)
    check_op("LpPool", [("x", x)], lp_pool_ref(p, kernel, strides, dilations, pads[:nd], pads[nd:], ceil),
             opset=18, fd_mask={"x": (np.abs(x) > 0.05).astype(np.float64)}, **attrs)


@pytest.mark.parametrize("auto_pad,begin,end", [("SAME_UPPER", [0, 0], [1, 1]), ("SAME_LOWER", [1, 1], [0, 0]),
                                               ("VALID", [0, 0], [0, 0])])
def test_lp_pool_auto_pad_opset_13(auto_pad, begin, end):
    check_op("LpPool", [("x", f32(2, 3, 7, 6))], lp_pool_ref(2, [2, 3], [2, 2], [1, 1], begin, end, False),
             opset=13, kernel_shape=[2, 3], strides=[2, 2], auto_pad=auto_pad)


def test_lp_pool_float16():
    check_op("LpPool", [("x", f32(2, 3, 6, 6).astype(np.float16))],
             lp_pool_ref(2, [2, 2], [2, 2], [1, 1], [0, 0], [0, 0], False), kernel_shape=[2, 2], strides=[2, 2],
             fd=False, rtol=3e-2, atol=3e-2)


def test_lp_pool_symbolic_batch():
    check_op("LpPool", [("x", f32(2, 3, 7, 6))], lp_pool_ref(2, [3, 2], [2, 2], [1, 1], [0, 0], [0, 0], False),
             kernel_shape=[3, 2], strides=[2, 2], symbolic={"x": [0]})


def test_lp_pool_zero_window_gets_zero_gradient():
    """A window of zeros: y = 0, where d|x|_2 has no derivative; the rule gives 0 rather than NaN."""
    x = f32(1, 1, 4, 4)
    x[0, 0, :2, :2] = 0
    def ref(t):  # torch's sqrt has an infinite derivative at 0 (NaN here): take 0 there
        s = F.avg_pool2d(t * t, 2) * 4
        return torch.where(s > 0, s, torch.ones_like(s)).sqrt() * (s > 0)
    grads = check_op("LpPool", [("x", x)], ref, kernel_shape=[2, 2], strides=[2, 2],
                     fd_mask={"x": (x != 0).astype(np.float64)})
    assert not np.any(grads["x"][0, 0, :2, :2])


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (2, 3, 6)])
def test_global_lp_pool(shape, p):
    def ref(x):
        return (x.abs() ** p).sum(dim=list(range(2, x.dim())), keepdim=True) ** (1.0 / p)
    x = f32(*shape)
    check_op("GlobalLpPool", [("x", x)], ref, p=p, fd_mask={"x": (np.abs(x) > 0.05).astype(np.float64)})


# --- Shrink ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lambd,bias", [(0.5, 0.0), (0.5, 0.2), (1.0, 1.0), (0.0, 0.3)])
def test_shrink(lambd, bias):
    """float32: onnxruntime's double Shrink computes in float, too coarse for float64 finite differences."""
    x = f32(3, 20)
    x[np.abs(np.abs(x) - lambd) < 0.05] += 0.2  # away from the kinks

    def ref(t):
        return torch.where(t < -lambd, t + bias, torch.where(t > lambd, t - bias, torch.zeros_like(t)))
    check_op("Shrink", [("x", x)], ref, lambd=lambd, bias=bias)


def test_shrink_stashes_a_mask_not_x():
    model = single_op_model("Shrink", [("x", r64(3, 4))], lambd=0.5)
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    manifest = gradbuilder.split(training)[2]
    reads = {e.name for e in manifest.backward_inputs if e.role in ("stash", "input")}
    assert "x" not in reads and len(reads) == 1
