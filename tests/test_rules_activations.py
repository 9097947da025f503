"""Activation rules against torch. onnxruntime has double kernels for few of these (LeakyRelu and PRelu only at
some opsets, Mish through a Softplus it lacks in double), so most run in float32."""

import numpy as np
import pytest
import test_rules_elementwise as ew
import torch
import torch.nn.functional as F
from harness import check_op, single_op_model
from onnx import TensorProto

import gradbuilder

rng = np.random.default_rng(1)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


def f32(x):
    return np.asarray(x, dtype=np.float32)


def a32(v):
    """An attribute value as onnxruntime sees it (attributes are float32)."""
    return float(np.float32(v))


def with_values(x, values):
    """x with its first entries replaced by `values` (kinks, boundaries)."""
    x = np.array(x, dtype=float)
    x.flat[: len(values)] = values
    return x


def off(x, points, near=0.1):
    """fd_mask: keep the finite-difference probe (float32 steps of 1e-2 times a normal) off the kinks."""
    return np.all(np.abs(np.subtract.outer(x, np.asarray(points, dtype=float))) >= near, axis=-1).astype(float)


X = with_values(r(4, 5) * 2, [0.0, -0.0, 0.0, 1.0, -1.0])


@pytest.mark.parametrize("opset", [13, 14, 17, 20])
def test_relu(opset):
    grads = check_op("Relu", [("x", X)], torch.relu, opset=opset, fd_mask={"x": off(X, [0.0])})
    assert np.all(grads["x"][X == 0] == 0)


@pytest.mark.parametrize("opset", [13, 16, 20])
@pytest.mark.parametrize("alpha", [None, 0.2, 0.0, -0.5, 1.5])
def test_leaky_relu(alpha, opset):
    attrs = {} if alpha is None else {"alpha": alpha}
    slope = a32(0.01 if alpha is None else alpha)
    check_op("LeakyRelu", [("x", f32(X))], lambda x: F.leaky_relu(x, slope), opset=opset, fd_mask={"x": off(X, [0.0])},
             **attrs)


PRELU_SHAPES = [((2, 3, 4), (3, 1)), ((2, 3, 4), (4,)), ((2, 3, 4), (1,)), ((2, 3, 4), (2, 3, 4)), ((3, 4), ())]


@pytest.mark.parametrize("opset", [13, 16, 20])
@pytest.mark.parametrize("sx,ss", PRELU_SHAPES)
def test_prelu(sx, ss, opset):
    """torch's prelu kernel: at x == 0 the input gets slope*dy and the slope 0."""
    x = f32(with_values(r(*sx), [0.0, 0.0, 1.0]))
    check_op("PRelu", [("x", x), ("s", f32(r(*ss)))], lambda x, s: torch.where(x > 0, x, s * x), opset=opset,
             fd_mask={"x": off(x, [0.0])})


def test_prelu_matches_torch_prelu():
    x = f32(with_values(r(2, 3, 4), [0.0]))
    check_op("PRelu", [("x", x), ("s", f32([0.25]))], F.prelu, fd_mask={"x": off(x, [0.0])})


def test_prelu_slope_only_and_dynamic():
    x, s = f32(r(2, 3, 4)), f32(r(3, 1))
    check_op("PRelu", [("x", x), ("s", s)], lambda x, s: torch.where(x > 0, x, s * x), wrt=["s"])
    ew.check_dynamic("PRelu", [("x", x), ("s", s)])


@pytest.mark.parametrize("alpha", [None, 0.0, 0.5, -0.5])
def test_thresholded_relu(alpha):
    t = a32(1.0 if alpha is None else alpha)
    x = f32(with_values(r(4, 5), [t, 0.0, t + 0.5, -1.0]))
    attrs = {} if alpha is None else {"alpha": alpha}
    check_op("ThresholdedRelu", [("x", x)], lambda x: torch.threshold(x, t, 0.0), fd_mask={"x": off(x, [t])},
             **attrs)


@pytest.mark.parametrize("opset", [13, 17, 20])
@pytest.mark.parametrize("op,fn", [("Sigmoid", torch.sigmoid), ("Tanh", torch.tanh)])
def test_sigmoid_tanh(op, fn, opset):
    check_op(op, [("x", with_values(r(4, 5) * 3, [0.0, 8.0, -8.0]))], fn, opset=opset)


@pytest.mark.parametrize("opset", [13, 17, 20])
@pytest.mark.parametrize("axis", [None, -1, 0, 1, -2, 2])
@pytest.mark.parametrize("op,fn", [("Softmax", torch.softmax), ("LogSoftmax", torch.log_softmax)])
def test_softmax(op, fn, axis, opset):
    attrs = {} if axis is None else {"axis": axis}
    check_op(op, [("x", r(2, 3, 4) * 2)], lambda x: fn(x, -1 if axis is None else axis), opset=opset, **attrs)


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
@pytest.mark.parametrize("opset", [20, 23])
def test_gelu(approximate, opset):
    attrs = {} if approximate is None else {"approximate": approximate}
    check_op("Gelu", [("x", f32(with_values(r(4, 5) * 2, [0.0, 4.0, -4.0])))],
             lambda x: F.gelu(x, approximate=approximate or "none"), opset=opset, **attrs)


@pytest.mark.parametrize("op,approximate,bias", [("Gelu", "none", False), ("FastGelu", "tanh", False),
                                                  ("FastGelu", "tanh", True)])
def test_gelu_contrib(op, approximate, bias):
    """onnxruntime's contrib Gelu (erf) and FastGelu (tanh, an optional bias added first), what the runtime writes
    torch's GELU as: torch's gradients, the bias's summed over the rows."""
    inputs = [("x", f32(with_values(r(4, 5) * 2, [0.0, 4.0, -4.0])))] + ([("b", f32(r(5)))] if bias else [])
    check_op(op, inputs, lambda x, b=None: F.gelu(x if b is None else x + b, approximate=approximate),
             domain="com.microsoft", out_ranks={"y0": 2})


@pytest.mark.parametrize("alpha", [None, 0.5, 0.0, -0.3])
def test_elu(alpha):
    a = a32(1.0 if alpha is None else alpha)
    x = f32(X)
    attrs = {} if alpha is None else {"alpha": alpha}
    check_op("Elu", [("x", x)], lambda x: F.elu(x, a), fd_mask={"x": off(x, [0.0])}, **attrs)


@pytest.mark.parametrize("op,attrs,masked", [("Elu", {}, False), ("Celu", {}, False), ("Celu", {"alpha": 2.0}, False),
                                              ("Elu", {"alpha": 0.5}, True), ("Selu", {}, True)])
def test_elu_family_without_mask_where_the_slope_is_continuous(op, attrs, masked):
    """Where the negative side's slope reaches the positive side's at 0 (ELU with alpha 1, CELU), the gradient is
    dy * Min(slope, scale) with no Where (onnxruntime's costs 4-7 ns an element); tiny inputs of either sign and
    zeros get torch's gradient."""
    x = f32([1e-30, 1e-7, -1e-7, 0.0, -0.0, 3.0, -3.0, 0.5])
    model = single_op_model(op, [("x", x)], **attrs)
    ops = {n.op_type for n in gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"]).graph.node}
    assert ("Where" in ops) == masked and ("Min" in ops) != masked
    a = a32(attrs.get("alpha", 1.0))
    fn = {"Elu": lambda x: F.elu(x, a), "Celu": lambda x: F.celu(x, a), "Selu": torch.selu}[op]
    check_op(op, [("x", x)], fn, fd_mask={"x": off(x, [0.0])}, **attrs)


@pytest.mark.parametrize("alpha,gamma", [(None, None), (1.0, 2.0), (0.5, -1.0), (-0.5, 1.0)])
def test_selu(alpha, gamma):
    x = f32(X)
    attrs = {k: v for k, v in (("alpha", alpha), ("gamma", gamma)) if v is not None}
    if not attrs:
        fn = torch.selu
    else:
        def fn(x):
            return a32(gamma) * F.elu(x, a32(alpha))
    check_op("Selu", [("x", x)], fn, fd_mask={"x": off(x, [0.0])}, **attrs)


@pytest.mark.parametrize("alpha", [None, 0.5, 2.0, -1.5])
def test_celu(alpha):
    a = a32(1.0 if alpha is None else alpha)
    x = f32(X)
    attrs = {} if alpha is None else {"alpha": alpha}
    if a > 0:
        fn = lambda x: F.celu(x, a)  # noqa: E731
    else:  # torch's celu refuses alpha < 0; ONNX defines it (and it is still x for x > 0)
        def fn(x):
            return torch.where(x > 0, x, a * torch.expm1(x / a))
    check_op("Celu", [("x", x)], fn, fd_mask={"x": off(x, [0.0])}, **attrs)


def test_softplus_softsign():
    x = f32(with_values(r(4, 5) * 3, [0.0, 15.0, -15.0, -30.0]))
    check_op("Softplus", [("x", x)], F.softplus)
    check_op("Softsign", [("x", x)], F.softsign, fd_mask={"x": off(x, [0.0])})


@pytest.mark.parametrize("alpha,beta", [(None, None), (1 / 6, 0.5), (0.25, 0.25)])
def test_hard_sigmoid(alpha, beta):
    """0 at the corners, like torch's hardsigmoid."""
    al, be = a32(0.2 if alpha is None else alpha), a32(0.5 if beta is None else beta)
    corners = [(0 - be) / al, (1 - be) / al]
    x = f32(with_values(r(4, 5) * 3, [*corners, 0.0]))
    attrs = {k: v for k, v in (("alpha", alpha), ("beta", beta)) if v is not None}

    def fn(x):
        h = al * x + be
        return torch.where((h > 0) & (h < 1), h, torch.clamp(h, 0, 1).detach())

    grads = check_op("HardSigmoid", [("x", x)], fn, fd_mask={"x": off(x, f32(corners))}, **attrs)
    assert np.all(grads["x"].flat[:2] == 0)
    if alpha is not None and abs(alpha - 1 / 6) < 1e-9:
        check_op("HardSigmoid", [("x", x)], F.hardsigmoid, fd_mask={"x": off(x, f32(corners))}, **attrs)


@pytest.mark.parametrize("opset", [14, 17, 20])
def test_hard_swish(opset):
    x = f32(with_values(r(4, 5) * 3, [-3.0, 3.0, 0.0, -4.0, 4.0]))
    check_op("HardSwish", [("x", x)], F.hardswish, opset=opset, fd_mask={"x": off(x, [-3.0, 3.0])})


@pytest.mark.parametrize("opset", [18, 20, 22])
def test_mish(opset):
    x = f32(with_values(r(4, 5) * 3, [0.0, 30.0, -30.0, 12.0, -12.0]))
    check_op("Mish", [("x", x)], F.mish, opset=opset)


@pytest.mark.parametrize("alpha", [1.0, 1.702, -0.5])
@pytest.mark.parametrize("double", [False, True])
def test_swish(alpha, double):
    """Swish (opset 24, which onnxruntime runs through its function body), tails included."""
    x = with_values(r(4, 5) * 3, [0.0, 30.0, -30.0, 12.0, -12.0])
    check_op("Swish", [("x", x if double else f32(x))], lambda t: t * torch.sigmoid(alpha * t), opset=24,
             alpha=alpha)


@pytest.mark.parametrize("op,attrs,want", [
    ("Relu", {}, ["y0"]), ("Sigmoid", {}, ["y0"]), ("Tanh", {}, ["y0"]), ("Softmax", {}, ["y0"]),
    ("LogSoftmax", {}, ["y0"]), ("LeakyRelu", {}, ["y0"]), ("LeakyRelu", {"alpha": -0.5}, ["x0"])])
def test_backward_reads(op, attrs, want):
    assert ew.backward_reads(op, [("x0", r(3))], **attrs) == want


# op, inputs, first opset with bfloat16
TYPED = [("Relu", 1, 13), ("LeakyRelu", 1, 16), ("PRelu", 2, 16), ("Sigmoid", 1, 13), ("Tanh", 1, 13),
         ("Softmax", 1, 13), ("LogSoftmax", 1, 13), ("Gelu", 1, 20), ("Elu", 1, 22), ("Selu", 1, 22),
         ("Softplus", 1, 22), ("Softsign", 1, 22), ("HardSigmoid", 1, 22), ("HardSwish", 1, 22), ("Mish", 1, 22),
         ("ThresholdedRelu", 1, 22)]
SINCE = {"Gelu": 20, "HardSwish": 14, "Mish": 18}


@pytest.mark.parametrize("elem_type", [TensorProto.BFLOAT16, TensorProto.FLOAT16])
@pytest.mark.parametrize("op,n_in,bf16_since", TYPED, ids=[t[0] for t in TYPED])
def test_low_precision_graphs_are_valid(op, n_in, bf16_since, elem_type):
    first = bf16_since if elem_type == TensorProto.BFLOAT16 else SINCE.get(op, 13)
    for opset in sorted({first, 20 if first <= 20 else first, 23}):
        ew.check_typed(op, elem_type, n_in, opset=opset)
    if op in ("Elu", "Selu", "LeakyRelu", "ThresholdedRelu"):  # the input-probing branch too
        ew.check_typed(op, elem_type, n_in, opset=first, alpha=-0.5)
