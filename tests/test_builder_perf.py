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
