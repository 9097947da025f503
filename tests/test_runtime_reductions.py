"""runtime.reductions: ReduceSum over leading axes becomes a MatMul with ones, with the same values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime.reductions import leading_sums_as_products


def _model(dims: list[int | str], axes: list[int], keepdims: int, opset: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    rank = len(dims) - (0 if keepdims else len(axes))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"y{k}" for k in range(rank)])
    axes_t = numpy_helper.from_array(np.array(axes, np.int64), "axes")
    # a consumer after the sum, so the rewritten output is also read inside the graph
    nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=keepdims, name="sum"),
             helper.make_node("Neg", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[axes_t])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(("dims", "axes", "keepdims", "opset"), [
    ([64, 512], [0], 0, 17),           # a Linear's bias gradient
    (["n", 512], [0], 0, 17),          # symbolic batch: the ones are built from x's shape
    (["n", 512], [-2], 1, 13),         # negative axis, keepdims, opset 13 (Shape without start/end)
    (["b", "s", 32], [0, 1], 0, 18),   # tokens of a transformer: [batch, sequence, features]
    ([3, 5, 4, 2], [1, 0], 1, 17),     # unsorted axes, several trailing dims kept
])
def test_same_sums(dims: list[int | str], axes: list[int], keepdims: int, opset: int) -> None:
    model = _model(dims, axes, keepdims, opset)
    out = leading_sums_as_products(model)
    assert "ReduceSum" not in _ops(out) and "MatMul" in _ops(out)
    onnx.checker.check_model(out, full_check=True)
    concrete = [d if isinstance(d, int) else 6 + k for k, d in enumerate(dims)]
    x = np.random.default_rng(0).standard_normal(concrete).astype(np.float32)
    want = -x.astype(np.float64).sum(axis=tuple(axes), keepdims=bool(keepdims))
    got = _run(out, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, _run(model, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("dims", "axes"), [
    ([8, 6], [1]),            # trailing axis: ReduceSum's own fast case
    ([4, 5, 6], [0, 2]),      # not a prefix (a convolution's bias gradient)
    ([4, 5, 6], [0, 1, 2]),   # every axis
    ([4, "f"], [0]),          # the kept dim is not static
])
def test_left_alone(dims: list[int | str], axes: list[int]) -> None:
    model = _model(dims, axes, 0, 17)
    assert leading_sums_as_products(model) is model


def test_double_left_alone() -> None:
    model = _model([8, 6], [0], 0, 17)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    assert leading_sums_as_products(model) is model
