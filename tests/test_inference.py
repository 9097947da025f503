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
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import gradbuilder
from gradbuilder.inference import as_floor_mode, infer_shapes, same_values
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


def test_floor_mode_pools_compute_the_same_values() -> None:
    """`as_floor_mode` over random 2-D pools (each axis its own kernel, stride, pads), run by onnxruntime: the
    floor-mode pool gives the ceil-mode pool's values wherever `same_values` allows the swap."""
    rng = np.random.default_rng(0)
    swapped = 0
    for _ in range(400):
        op = str(rng.choice(["MaxPool", "AveragePool", "LpPool"]))
        k, s = rng.integers(1, 4, 2).tolist(), rng.integers(1, 4, 2).tolist()
        pads = [int(rng.integers(0, k[i % 2])) for i in range(4)]
        size = [1, 2, *rng.integers(2, 10, 2).tolist()]
        attrs = {"kernel_shape": k, "strides": s, "pads": pads, "ceil_mode": 1}
        if op == "AveragePool":
            attrs["count_include_pad"] = int(rng.integers(0, 2))
        node = helper.make_node(op, ["x"], ["y"], **attrs)
        floor = as_floor_mode(node, size)
        if floor is None or not same_values(node, floor):
            continue
        x = rng.standard_normal(size).astype(np.float32)
        runs = []
        for n in (node, floor):
            graph = helper.make_graph([n], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, size)],
                                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
            runs.append(ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0])
        np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6, atol=1e-6, err_msg=str(attrs))
        swapped += 1
    assert swapped > 100


@pytest.mark.parametrize("first", [False, True], ids=["after-conv", "first"])
@pytest.mark.parametrize("pool", [nn.MaxPool2d(2, 2, 1, ceil_mode=True),
                                  nn.AvgPool2d(2, 2, 1, ceil_mode=True, count_include_pad=True)],
                         ids=["max", "average"])
def test_ceil_mode_pool_trains(pool: nn.Module, first: bool) -> None:
    """5 x 12 pooled to 3 x 7 (onnx's inference: 4 x 7), then flattened into a Linear of 3 * 7 inputs: the build
    refused this as inconsistent at the Gemm, a second pool after the first failed in backward, and onnxruntime
    refused to load the forward where the pool reads the graph input (its own inference is onnx's)."""
    torch.manual_seed(0)
    if first:  # 9 x 4 pooled to 5 x 3 (onnx: 6 x 3), then to 2 x 1 (onnx: 3 x 1)
        model = nn.Sequential(pool, nn.MaxPool2d(2), nn.SiLU(), nn.BatchNorm2d(2), nn.Flatten(), nn.Tanh(),
                              nn.Linear(2 * 2 * 1, 3))
        model[3].requires_grad_(False)  # a frozen BatchNorm: the graph onnxruntime refused
        shape = (2, 9, 4)
    else:
        model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), pool, copy.deepcopy(pool), nn.Flatten(), nn.Linear(16, 3))
        shape = (1, 5, 12)
    reference = copy.deepcopy(model)
    ort_model = ORTModule(model, threads=1)
    for batch in (4, 2):
        x = torch.randn(batch, *shape)
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


def test_an_empty_declared_type_does_not_stop_inference() -> None:
    """An output declared `type {}` (no tensor type) made onnx's inference type nothing at all: the gradient
    input of another output was then written untyped (a fuzz corpus model)."""
    nodes = [helper.make_node("Concat", ["W", "x"], ["n"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                              [onnx.ValueInfoProto(name="W"), onnx.ValueInfoProto(name="n")],
                              [onnx.numpy_helper.from_array(np.ones(3, np.float32), "W")])
    graph.output[0].type.SetInParent()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    inferred = infer_shapes(model, strict=True).graph
    assert model.SerializeToString() == before
    assert {v.name: v.type.tensor_type.elem_type for v in inferred.output}["n"] == TensorProto.FLOAT
    training = gradbuilder.build_gradient_graph(model)
    host = {v.name: v.type.tensor_type.elem_type for v in training.graph.value_info if v.name.endswith("_host_grad")}
    assert host == {"W_host_grad": TensorProto.FLOAT, "n_host_grad": TensorProto.FLOAT}


def test_an_initializer_that_is_also_a_graph_output_stays_a_constant() -> None:
    """onnx's inference reads a Slice's axes as absent when their initializer is also a graph output, and sized
    the slice [2, 3] instead of [8, 2]; the backward then declared the host's gradient so (replay seed 187).
    The model is as it was after inference, its outputs in their order."""
    g = helper.make_graph(
        [helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["s"])], "g",
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [8, 3])],
        [helper.make_tensor_value_info("axes", TensorProto.INT64, None),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([v]), n) for n, v in (("starts", 0), ("ends", 2), ("axes", 1))])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    before = model.SerializeToString()
    inferred = infer_shapes(model)
    assert model.SerializeToString() == before
    assert [o.name for o in inferred.graph.output] == ["axes", "s"]
    assert [d.dim_value for d in inferred.graph.output[1].type.tensor_type.shape.dim] == [8, 2]
    training = gradbuilder.build_gradient_graph(model, wrt=["c"], outputs=["s"])
    host = next(i for i in training.graph.node if i.op_type == "Yield").output[0]
    declared = {vi.name: vi for vi in (*training.graph.value_info, *training.graph.input, *training.graph.output)}
    assert [d.dim_value for d in declared[host].type.tensor_type.shape.dim] == [8, 2]
