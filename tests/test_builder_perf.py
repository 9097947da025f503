"""The shortcuts that keep the builder fast and linear in the graph size must not change what it computes:
the data-propagation pass of shape inference is skipped only when it cannot change anything, and the work
per node does not grow with the graph."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import gradbuilder
from gradbuilder.errors import InvalidModelError
from gradbuilder.graph import ForwardGraph, _data_propagation_matters

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repository root, for benchmarks/
from benchmarks.builder_scaling import residual_mlp


def _reshape_by_computed_shape(declared: list | None = None, via_constant: bool = False) -> onnx.ModelProto:
    """y = Reshape(x, Concat(Shape(x)[0], [4, 4])): y's static dims come only from data propagation."""
    four = numpy_helper.from_array(np.array([4, 4], np.int64), "fourfour")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
             helper.make_node("Concat", ["b1", "fourfour"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "ax0")]
    if via_constant:
        nodes.insert(0, helper.make_node("Constant", [], ["fourfour"], value=four))
    else:
        inits.append(four)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, declared)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("via_constant", [False, True])
def test_data_propagation_still_gives_static_shapes(via_constant):
    m = _reshape_by_computed_shape(via_constant=via_constant)
    assert _data_propagation_matters(m)
    assert ForwardGraph(m).tensor_info("y").shape == ("batch", 4, 4)


def test_conflict_only_data_propagation_sees_is_refused():
    with pytest.raises(InvalidModelError, match=r"inconsistent at node \(Reshape -> y\).*\(4\) vs \(5\)"):
        ForwardGraph(_reshape_by_computed_shape(["batch", 4, 5]))


def _float_only() -> onnx.ModelProto:
    """Add/Mul (ops with data propagation) on float tensors and a float vector initializer: nothing to propagate."""
    nodes = [helper.make_node("Add", ["x", "b"], ["h"]), helper.make_node("Mul", ["h", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                              [numpy_helper.from_array(np.ones(3, np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("make", [_float_only, lambda: residual_mlp(60)])
def test_data_propagation_skipped_only_when_it_changes_nothing(make):
    m = make()
    assert not _data_propagation_matters(m)
    without = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=False)
    with_dp = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    assert without.SerializeToString() == with_dp.SerializeToString()


def test_int_vector_into_an_op_with_data_propagation_counts():
    m = _float_only()
    m.graph.node.append(helper.make_node("Add", ["k", "k"], ["k2"]))
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 2], np.int64), "k"))
    assert _data_propagation_matters(m)


def test_same_bytes_as_a_fresh_build_and_deterministic():
    """Two builds of one model in one process give the same bytes (caches keep no state between builds)."""
    m = residual_mlp(120)
    first = gradbuilder.build_gradient_graph(m).SerializeToString()
    assert gradbuilder.build_gradient_graph(m).SerializeToString() == first
    onnx.checker.check_model(onnx.load_from_string(first), full_check=False)


def _batchnorm_chain(blocks: int) -> onnx.ModelProto:
    """`blocks` inference-mode BatchNormalizations whose running statistics are initializers, each followed by a
    Dropout whose ratio reaches it through an Identity: statistics and ratios are float initializers that get no
    gradient."""
    nodes, inits, x = [], [], "x"
    for k in range(blocks):
        for name, value in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0)):
            inits.append(numpy_helper.from_array(np.full(3, value, np.float32), f"{name}{k}"))
        inits.append(numpy_helper.from_array(np.array(0.1, np.float32), f"p0{k}"))
        nodes += [helper.make_node("BatchNormalization", [x, f"s{k}", f"b{k}", f"m{k}", f"v{k}"], [f"h{k}"],
                                   name=f"bn{k}"),
                  helper.make_node("Identity", [f"p0{k}"], [f"p{k}"]),
                  helper.make_node("Dropout", [f"h{k}", f"p{k}"], [f"y{k}"], name=f"drop{k}")]
        x = f"y{k}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info(x, TP.FLOAT, [2, 3, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_why_no_gradient_names_the_stop_edge_for_every_statistic():
    """Each reason is found from the tensor's own consumers on, not by a walk over the whole graph."""
    blocks = 300
    meta = gradbuilder.read_metadata(gradbuilder.build_gradient_graph(_batchnorm_chain(blocks)))
    no_grad = meta["no_gradient"]
    assert set(meta["gradients"]) == {f"{p}{k}" for p in "sb" for k in range(blocks)}
    crosses = "every path from it to the differentiated outputs crosses a non-differentiable edge: "
    for k in (0, blocks // 2, blocks - 1):
        for stat, i in (("m", 3), ("v", 4)):
            assert no_grad[f"{stat}{k}"] == (f"{crosses}'{stat}{k}' is a non-differentiable input (input {i}) of "
                                              f"node 'bn{k}' (BatchNormalization -> h{k})")
        assert no_grad[f"p0{k}"] == (f"{crosses}'p{k}' is a non-differentiable input (input 1) of node 'drop{k}' "
                                     f"(Dropout -> y{k})")
