"""gradbuilder/inference.py: pools in ceil mode sized as ONNX defines them (and onnxruntime and torch compute
them), where onnx's own shape inference keeps a last window that starts in the end padding."""

import copy
import io
import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import gradbuilder
from gradbuilder.inference import infer_shapes
from runtime import ORTModule

CASES = [(op, n, k, s, d, begin, end)
         for op, n, k, s, d, begin, end in itertools.product(
             ["MaxPool", "AveragePool", "LpPool"], range(2, 9), [1, 2, 3], [1, 2, 3], [1, 2], [0, 1, 2], [0, 1, 2])
         if begin < k and end < k and (d == 1 or op == "MaxPool") and n + begin + end >= d * (k - 1) + 1]


def _pool(op: str, n: int, k: int, s: int, d: int, begin: int, end: int) -> onnx.ModelProto:
    attrs = {"kernel_shape": [k, 1], "strides": [s, 1], "pads": [begin, 0, end, 0], "ceil_mode": 1}
    if d > 1:
        attrs["dilations"] = [d, 1]
    nodes = [helper.make_node(op, ["x"], ["y"], **attrs), helper.make_node("Identity", ["y"], ["z"])]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, n, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_pool_sizes_are_onnxruntimes() -> None:
    """Every ceil-mode pool of the grid is sized as onnxruntime sizes it, the model is left as it was, and the
    grid holds cases onnx's own inference gets wrong (so the test can fail)."""
    wrong = 0
    for case in CASES:
        model = _pool(*case)
        before = model.SerializeToString()
        got = infer_shapes(model, strict=True)
        assert model.SerializeToString() == before
        assert got.graph.node[0] == model.graph.node[0]  # the pool as it was, not the stand-in inference saw
        dims = tuple(d.dim_value for d in got.graph.output[0].type.tensor_type.shape.dim)
        x = np.random.default_rng(0).standard_normal((1, 1, case[1], 3)).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0].shape
        assert dims == want, case
        plain = onnx.shape_inference.infer_shapes(model).graph.output[0].type.tensor_type.shape.dim
        wrong += tuple(d.dim_value for d in plain) != want
    assert wrong > 50


@pytest.mark.parametrize("pool", [nn.MaxPool2d(2, 2, 1, ceil_mode=True),
                                  nn.AvgPool2d(2, 2, 1, ceil_mode=True, count_include_pad=True)],
                         ids=["max", "average"])
def test_ceil_mode_pool_trains(pool: nn.Module) -> None:
    """5 x 12 pooled to 3 x 7 (onnx's inference: 4 x 7), then flattened into a Linear of 3 * 7 inputs: the build
    refused this as inconsistent at the Gemm, and a second pool after the first failed in backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), pool, copy.deepcopy(pool), nn.Flatten(), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    ort_model = ORTModule(model, threads=1)
    for batch in (4, 2):
        x = torch.randn(batch, 1, 5, 12)
        ort_model(x).square().sum().backward()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_ceil_mode_pool_builds() -> None:
    """The builder alone: an exported graph whose Gemm reads 2 * 3 * 7 features. (onnx's full check refuses the
    training graph as it refuses the exported one: its inference gives the pool 4 rows.)"""
    model = nn.Sequential(nn.MaxPool2d(2, 2, 1, ceil_mode=True), nn.Flatten(), nn.Linear(42, 3))
    f = io.BytesIO()
    torch.onnx.export(model, (torch.randn(1, 2, 5, 12),), f, dynamo=False, input_names=["x"],
                      dynamic_axes={"x": {0: "N"}})
    exported = onnx.load_from_string(f.getvalue())
    training = gradbuilder.build_gradient_graph(exported)
    onnx.checker.check_model(training)
    assert {o.name for o in training.graph.output} >= {"2.weight_grad", "2.bias_grad"}
