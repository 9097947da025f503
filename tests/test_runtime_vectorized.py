"""runtime/vectorized.py: Softplus, Elu, Selu, Celu and Mish written out in vectorized ops give onnxruntime's own
kernels' values (float32 and double, nan and infinities included), Sigmoid torch's values where onnxruntime's
kernel is off, and models using them train like torch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from parity import check_parity
from torch import nn

from runtime import lowering, vectorized
from runtime.ort_session import SessionConfig

EDGES = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 30.0, -30.0, 88.0, -88.0, 100.0, -100.0]


def _model(op: str, elem: int, opset: int, **attrs: float) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", elem, ["n"])],
                              [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _torch(op: str, attrs: dict[str, float], x: np.ndarray) -> np.ndarray:
    """The activation in torch, double precision (onnxruntime has no double kernel for these)."""
    t, f = torch.from_numpy(x), nn.functional
    alpha = attrs.get("alpha")
    if op == "Elu":
        return f.elu(t, alpha or 1.0).numpy()
    if op == "Selu":
        return (attrs.get("gamma", vectorized.SELU_GAMMA) * f.elu(t, alpha or vectorized.SELU_ALPHA)).numpy()
    if op == "Celu":
        return f.celu(t, alpha or 1.0).numpy()
    return (f.softplus(t, threshold=1e9) if op == "Softplus" else f.mish(t)).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op,attrs", [("Elu", {}), ("Elu", {"alpha": 0.5}), ("Selu", {}),
                                      ("Selu", {"alpha": 1.5, "gamma": 2.0}), ("Celu", {"alpha": 2.0}),
                                      ("Softplus", {}), ("Mish", {})])
def test_written_out_like_onnxruntimes_kernels(op, attrs, dtype):
    """float32 against onnxruntime's own kernel; double, which onnxruntime has no kernel for (the rewrite lets such
    models run), against torch."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    model = _model(op, elem, 18 if op == "Mish" else 17, **attrs)
    rewritten = vectorized.vectorized_ops(model)
    assert op not in [n.op_type for n in rewritten.graph.node]
    x = np.concatenate([np.array(EDGES), np.random.default_rng(0).standard_normal(4000) * 6]).astype(dtype)
    got = _run(rewritten, x)
    want = _run(model, x) if dtype == np.float32 else _torch(op, attrs, x)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite])  # nan, inf and -inf where the kernel has them
    # exp(x) - 1 near 0 and the kernels' own exp/log differ by a few units of x's precision, scaled by alpha
    eps = np.finfo(dtype).eps * max(1.0, attrs.get("alpha", 1.0), attrs.get("gamma", 1.0))
    np.testing.assert_allclose(got[finite], want[finite], rtol=64 * eps, atol=4 * eps)
    tiny = x == -30.0  # softplus(-30) = 9.4e-14: log(1 + e) alone would give 0
    if op == "Softplus":
        np.testing.assert_allclose(got[tiny], np.log1p(np.exp(x[tiny].astype(np.float64))), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_exact_in_relative_terms(dtype):
    """1 / (1 + exp(-x)) within a few units of the last place of torch's double sigmoid everywhere it is a normal
    number (onnxruntime's kernel was 0 below -18 and 4.5x off at -17.9), nan and infinities as torch's."""
    rewritten = vectorized.vectorized_ops(_model("Sigmoid", TensorProto.FLOAT if dtype == np.float32
                                                 else TensorProto.DOUBLE, 17))
    assert "Sigmoid" not in [n.op_type for n in rewritten.graph.node]
    x = np.concatenate([np.array(EDGES), np.linspace(-87, 87, 20001), [-17.93, -18.5, -50.0]]).astype(dtype)
    got = _run(rewritten, x)
    want = torch.sigmoid(torch.from_numpy(x.astype(np.float64))).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    normal = want > np.finfo(dtype).tiny
    np.testing.assert_allclose(got[normal], want[normal], rtol=8 * np.finfo(dtype).eps)


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax's axes an attribute, then an input
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [1, -3, 2])
def test_softmax_over_an_inner_axis_written_out(op, axis, opset):
    model = _model(op, TensorProto.FLOAT, opset, axis=axis)
    model.graph.input[0].type.tensor_type.shape.Clear()
    for d in (4, 7, 5, 6):
        model.graph.input[0].type.tensor_type.shape.dim.add().dim_value = d
    rewritten = vectorized.vectorized_ops(model)
    assert op not in [n.op_type for n in rewritten.graph.node]
    x = np.random.default_rng(0).standard_normal((4, 7, 5, 6)).astype(np.float32) * 10
    x[0, :, 0, 0] = -np.inf  # a row of -inf: nan, as the kernel gives
    x[1, 3, 1, 1] = np.inf
    x[2, 2, 2, 2] = np.nan
    got, want = _run(rewritten, x), _run(model, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_softmax_over_the_last_axis_or_of_unknown_rank_stays():
    last = _model("Softmax", TensorProto.FLOAT, 17, axis=-1)
    last.graph.input[0].type.tensor_type.shape.dim.add().dim_value = 8
    assert vectorized.vectorized_ops(last) is last
    unknown = _model("LogSoftmax", TensorProto.FLOAT, 17, axis=0)
    unknown.graph.input[0].type.tensor_type.ClearField("shape")
    assert vectorized.vectorized_ops(unknown) is unknown


def test_other_graphs_stay():
    relu = _model("Relu", TensorProto.FLOAT, 17)
    assert vectorized.vectorized_ops(relu) is relu
    old = _model("Elu", TensorProto.FLOAT, 13)  # no CastLike for the constants before opset 15
    assert vectorized.vectorized_ops(old) is old


def _channels(body: list[onnx.NodeProto], elem: int, slope: bool) -> onnx.ModelProto:
    """x of [n, 16, 6, 6] (576 known elements a sample) through `body`, with a per-channel slope input."""
    inputs = [helper.make_tensor_value_info("x", elem, ["n", 16, 6, 6])]
    if slope:
        inputs.append(helper.make_tensor_value_info("s", elem, [16, 1, 1]))
    graph = helper.make_graph(body, "g", inputs, [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _edged(dtype: type) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((3, 16, 6, 6)) * 4
    x.reshape(-1)[:len(EDGES)] = EDGES
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sign_written_out_as_torch_s(dtype):
    """(x > 0) - (x < 0): torch's sign, nan -> 0 included (onnxruntime's kernel gives nan), about 2x faster over
    large tensors; a small tensor keeps the kernel."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    model = _channels([helper.make_node("Sign", ["x"], ["y"])], elem, slope=False)
    rewritten = vectorized.vectorized_ops(model)
    assert "Sign" not in [n.op_type for n in rewritten.graph.node]
    x = _edged(dtype)
    got = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, torch.sign(torch.from_numpy(x)).numpy())
    small = _model("Sign", elem, 17)
    assert vectorized.vectorized_ops(small) is small


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_prelu_with_a_slope_a_channel_written_out(dtype):
    """Relu(x) + s min(x, 0) where every slope is finite: onnxruntime's kernel's values bit for bit (nan and
    infinities of x included), ~5x faster; a slope holding an infinity or a nan runs the kernel (the formula's
    s * 0 would be nan where x > 0). A single slope keeps the kernel, as fast."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    model = _channels([helper.make_node("PRelu", ["x", "s"], ["y"])], elem, slope=True)
    rewritten = vectorized.vectorized_ops(model)
    assert "PRelu" not in [n.op_type for n in rewritten.graph.node]
    x = _edged(dtype)
    for s in (np.linspace(-0.5, 1.5, 16), np.array([0.25] * 15 + [np.inf]), np.array([np.nan] + [-0.1] * 15)):
        feeds = {"x": x, "s": s.reshape(16, 1, 1).astype(dtype)}
        got = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        if dtype == np.float32:
            want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
        else:  # no double kernel in onnxruntime: torch's
            want = [torch.nn.functional.prelu(torch.from_numpy(x), torch.from_numpy(feeds["s"].reshape(16))).numpy()]
        finite = bool(np.isfinite(s).all())
        if finite or dtype == np.float32:
            np.testing.assert_array_equal(got[0], want[0])
    single = _channels([helper.make_node("PRelu", ["x", "s"], ["y"])], elem, slope=True)
    single.graph.input[1].type.tensor_type.shape.Clear()
    single.graph.input[1].type.tensor_type.shape.dim.add().dim_value = 1
    assert vectorized.vectorized_ops(single) is single


class L1Net(nn.Module):
    """A per-channel PReLU and an L1 loss (its Abs's gradient a Sign) over [N, 16, 6, 6] maps."""

    def __init__(self):
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, 16, 3, padding=1), nn.PReLU(16, init=0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.l1_loss(self.act(self.conv(x)), y)


def test_prelu_and_l1_models_train_like_torch():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 16, 6, 6, generator=g)) for _ in range(3)]
    ort_model, _, _ = check_parity(L1Net, batches, lambda m, b: m(*b), threads=1)
    [session] = ort_model.training_sessions()
    runs = lowering.forward(session.full.forward, SessionConfig())
    assert "PRelu" not in {n.op_type for n in runs.graph.node}
    back = lowering.backward(session.full.backward, {}, SessionConfig())
    assert "Sign" not in {n.op_type for n in back.graph.node}


class Net(nn.Module):
    def __init__(self, activation: nn.Module):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 32), activation, nn.Linear(32, 32), activation, nn.Linear(32, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


class Segmenter(nn.Module):
    """Cross-entropy over the class axis of [N, C, H, W] scores: its LogSoftmax, and its gradient's Softmax, are
    over axis 1 of 4."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.conv(x), y)


def test_segmentation_loss_trains_like_torch():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4, 6, 6), generator=g)) for _ in range(3)]
    ort_model, _, _ = check_parity(Segmenter, batches, lambda m, b: m(*b), threads=1)
    [session] = ort_model.training_sessions()
    runs = lowering.forward(session.full.forward, SessionConfig())
    assert not vectorized.SOFTMAX & {n.op_type for n in runs.graph.node}


@pytest.mark.parametrize("activation", [nn.ELU(), nn.ELU(0.3), nn.SELU(), nn.CELU(1.7), nn.Softplus(), nn.Mish()],
                         ids=["elu", "elu-0.3", "selu", "celu", "softplus", "mish"])
def test_models_train_like_torch(activation):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 6, generator=g) * 3, torch.randint(0, 3, (16,), generator=g)) for _ in range(3)]
    ort_model, _, _ = check_parity(lambda: Net(activation), batches, lambda m, b: m(*b), threads=1)
    [session] = ort_model.training_sessions()
    runs = lowering.forward(session.full.forward, SessionConfig())  # the forward graph onnxruntime runs
    assert not vectorized.SLOW & {n.op_type for n in runs.graph.node}


def _bounded(form: str, elem: int, low: float = -2.0, high: float = 6.0, picked: float | None = None
             ) -> onnx.ModelProto:
    """x through a Where that picks a bound, as `functions._strict_clip` exports hardtanh and ReLU6."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    inits = [onnx.numpy_helper.from_array(np.array(v, dtype), n) for n, v in
             (("low", low), ("high", high), ("picked", high if picked is None else picked))]
    ge = helper.make_node("GreaterOrEqual", ["x", "high"], ["ge"])
    nodes = {
        "relu6": [helper.make_node("Relu", ["x"], ["b"]), ge, helper.make_node("Where", ["ge", "picked", "b"], ["y"])],
        "hardtanh": [helper.make_node("LessOrEqual", ["x", "low"], ["le"]),
                     helper.make_node("Where", ["le", "low", "x"], ["b"]), ge,
                     helper.make_node("Where", ["ge", "picked", "b"], ["y"])],
        "upper": [ge, helper.make_node("Where", ["ge", "picked", "x"], ["y"])],
        "lower": [helper.make_node("LessOrEqual", ["x", "low"], ["le"]),
                  helper.make_node("Where", ["le", "low", "x"], ["y"])],
    }[form]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, ["n"])],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("form", ["relu6", "hardtanh", "upper", "lower"])
def test_wheres_picking_a_bound_become_clips_of_the_same_values(form, dtype):
    """ReLU6 and hardtanh as exported for torch's strict gradient at the bounds: the same values bit for bit (nan,
    infinities, the bounds themselves, the sign of a zero), as one Clip where onnxruntime's Where was ~18x slower."""
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
    model = _bounded(form, elem)
    rewritten = vectorized.vectorized_ops(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Where" not in ops and ops.count("Clip") == (2 if form == "hardtanh" else 1)
    x = np.concatenate([np.array([*EDGES, 6.0, -2.0, 5.999, -1.999]),
                        np.random.default_rng(0).standard_normal(4000) * 6]).astype(dtype)
    got, want = _run(rewritten, x), _run(model, x)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("case", ["a negative bound over a Relu", "another value picked", "a floor above the bound",
                                  "a bound of one element", "a bound of 0"])
def test_wheres_that_pick_no_bound_stay(case):
    model = {
        "a negative bound over a Relu": lambda: _bounded("relu6", TensorProto.FLOAT, high=-1.0),
        "another value picked": lambda: _bounded("upper", TensorProto.FLOAT, picked=5.0),
        "a floor above the bound": lambda: _bounded("hardtanh", TensorProto.FLOAT, low=7.0),
        "a bound of one element": lambda: _bounded("upper", TensorProto.FLOAT),
        "a bound of 0": lambda: _bounded("upper", TensorProto.FLOAT, high=0.0),  # picks +0 where x is -0
    }[case]()
    if case == "a bound of one element":
        for t in model.graph.initializer:
            t.dims.append(1)
    rewritten = vectorized.vectorized_ops(model)
    wheres = [n for n in rewritten.graph.node if n.op_type == "Where"]
    assert len(wheres) == (1 if case == "a floor above the bound" else len(
        [n for n in model.graph.node if n.op_type == "Where"]))
    x = np.concatenate([np.array(EDGES), np.random.default_rng(1).standard_normal(100) * 8]).astype(np.float32)
    np.testing.assert_array_equal(_run(rewritten, x), _run(model, x))


class Mobile(nn.Module):
    """ReLU6 after a BatchNorm (MobileNet's; its Conv without a bias, whose gradient is zero by the math and which
    Adam would move by its rounding noise), then a hardtanh, into a classifier."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(), nn.Flatten(),
                                 nn.Linear(8 * 6 * 6, 16), nn.Hardtanh(-0.5, 0.5), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_relu6_and_hardtanh_models_train_like_torch_without_wheres(exporter):
    """Under both exporters: dynamo writes the bounds as torch.full((), v), a Cast scalar Expanded to no dims."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, 6, 6, generator=g) * 4, torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    ort_model, _, _ = check_parity(Mobile, batches, lambda m, b: m(*b), threads=1, exporter=exporter)
    [session] = ort_model.training_sessions()
    runs = lowering.forward(session.full.forward, SessionConfig())
    compared = {o for n in runs.graph.node if n.op_type in ("GreaterOrEqual", "LessOrEqual") for o in n.output}
    assert not [n for n in runs.graph.node if n.op_type == "Where" and n.input[0] in compared]  # (the loss's stay)
    if exporter == "torchscript":
        wheres = [n.name for n in runs.graph.node if n.op_type == "Where"]
        assert all("CrossEntropy" in name for name in wheres)  # (the loss's, over the labels)
    assert [n.op_type for n in runs.graph.node].count("Clip") == 3
