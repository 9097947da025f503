"""runtime.crossentropy: the classification losses written out in standard ops give torch's values."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from runtime.crossentropy import lower_losses
from runtime.lowering import forward as runnable_forward
from runtime.ort_session import SessionConfig

N, C = 7, 5


def _model(op: str, rank: int, weighted: bool, ignore: int | None, reduction: str, log_prob: bool,
           elem: int, label_elem: int, opset: int = 17) -> onnx.ModelProto:
    tail = [3] * (rank - 2)
    inputs = [helper.make_tensor_value_info("x", elem, ["n", C, *tail]),
              helper.make_tensor_value_info("y", label_elem, ["n", *tail])]
    if weighted:
        inputs.append(helper.make_tensor_value_info("w", elem, [C]))
    attrs: dict[str, object] = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    outs = {"loss": ["n", *tail] if reduction == "none" else []}
    if log_prob:
        outs["log_prob"] = ["n", C, *tail]
    node = helper.make_node(op, [i.name for i in inputs], list(outs), name="loss_node", **attrs)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, elem, s) for o, s in outs.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


CASES = [c for c in itertools.product(
    ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"], [2, 4], [False, True], [None, 2, -100],
    ["none", "sum", "mean"], [False, True]) if not (c[5] and c[0] == "NegativeLogLikelihoodLoss")]


@pytest.mark.parametrize(("op", "rank", "weighted", "ignore", "reduction", "log_prob"), CASES)
def test_torch_values(op: str, rank: int, weighted: bool, ignore: int | None, reduction: str, log_prob: bool) -> None:
    """float64 against torch's cross_entropy / nll_loss, with ignored samples and, for NLL, a -inf
    log-probability where only ignored samples gather (selected away, not multiplied by zero)."""
    label_elem = TensorProto.INT32 if weighted else TensorProto.INT64
    model = _model(op, rank, weighted, ignore, reduction, log_prob, TensorProto.DOUBLE, label_elem)
    lowered = lower_losses(model)
    assert {n.op_type for n in lowered.graph.node}.isdisjoint({op}), "the loss was not written out"
    onnx.checker.check_model(lowered, full_check=True)
    rng = np.random.default_rng(rank * 7 + len(reduction))
    shape = [N, C] + [3] * (rank - 2)
    x = torch.tensor(rng.standard_normal(shape), dtype=torch.float64)
    y = torch.tensor(rng.integers(0, C, [N] + [3] * (rank - 2)))
    if ignore is not None:
        y[y == 0] = 1 if ignore != 1 else 3
        y.view(-1)[::3] = ignore
        if op == "NegativeLogLikelihoodLoss":
            x[:, 0] = -torch.inf  # where ignored samples gather (class 0), and no other sample
    w = torch.tensor(rng.random(C) + 0.5, dtype=torch.float64) if weighted else None
    feeds = {"x": x.numpy(), "y": y.numpy().astype(np.int32 if weighted else np.int64)}
    if w is not None:
        feeds["w"] = w.numpy()
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    kwargs = {"weight": w, "ignore_index": -100 if ignore is None else ignore, "reduction": reduction}
    if op == "SoftmaxCrossEntropyLoss":
        want = [F.cross_entropy(x, y, **kwargs), F.log_softmax(x, dim=1)]
    else:
        want = [F.nll_loss(x, y, **kwargs)]
    for g, t in zip(got, want):
        assert g.shape == tuple(t.shape)
        np.testing.assert_allclose(g, t.numpy(), rtol=1e-12, atol=1e-14)


def test_same_as_function_body_in_float32() -> None:
    """float32, int32 labels: the written-out loss against onnxruntime's own inlined function body."""
    model = _model("SoftmaxCrossEntropyLoss", 3, True, 1, "mean", True, TensorProto.FLOAT, TensorProto.INT32)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal([N, C, 3]).astype(np.float32),
             "y": rng.integers(0, C, [N, 3]).astype(np.int32), "w": rng.random(C).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    lowered = lower_losses(model)
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, t in zip(got, want):
        np.testing.assert_allclose(g, t, rtol=2e-6, atol=1e-7)


def test_left_alone() -> None:
    """Below opset 15 (no CastLike) and without a loss the model is returned as it is; without `lower` the
    sessions get the exported loss node."""
    old = _model("SoftmaxCrossEntropyLoss", 2, False, None, "mean", False, TensorProto.FLOAT, TensorProto.INT64,
                 opset=13)
    assert lower_losses(old) is old
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17)])
    assert lower_losses(plain) is plain
    new = _model("SoftmaxCrossEntropyLoss", 2, False, None, "mean", False, TensorProto.FLOAT, TensorProto.INT64)
    assert runnable_forward(new, SessionConfig(lower=False)) is new
    assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in runnable_forward(new, SessionConfig()).graph.node}
