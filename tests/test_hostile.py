"""Hostile and broken inputs, end to end through the CLI and the library.

Every broken model gets one paragraph naming what is wrong and what to do, exit 2, the input untouched and
nothing written (`assert_fails`); the odd but valid ones (control flow off the gradient path, external data,
non-ASCII names) build, split and run on onnxruntime. Also: save_model_atomic's guarantees, determinism across
processes, and a model over protobuf's 2 GB limit (slow: GRADBUILDER_SLOW=1). All models are made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from clihelpers import assert_fails, f32, make_model, run, save, session, snapshot, tiny, with_loss
from fuzz.fuzz_models import seeds
from onnx import TensorProto as TP
from onnx import helper

import gradbuilder
from gradbuilder import graph
from gradbuilder.errors import GradBuilderError, SaveError

V3 = [3]


def vi(name: str, elem_type: int = TP.FLOAT, shape: list | None = V3) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def i64(name: str, value) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(value, np.int64), name)


def node(op: str, ins: list[str], outs: list[str], name: str = "", **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, name=name or None, **attrs)


W3 = [1.5, -2.0, 0.5]


def _params() -> list[onnx.TensorProto]:
    return [f32("W", W3)]


# --------------------------------------------------------------------------------------------------
# broken models: (maker, words the message must contain); every one is refused by build and inspect


def _no_default_opset() -> onnx.ModelProto:
    m = tiny()
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    return m


def _opset(version: int) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        m = tiny()
        m.opset_import[0].version = version
        return m
    return make


def _default_domain_twice() -> onnx.ModelProto:
    """onnx's checker reads the last entry, gradbuilder the first: the model must be refused, not built for one
    opset and checked by the other (a ReduceMean with opset 17's axes attribute under opset 18: found by fuzzing)."""
    m = tiny()
    m.opset_import.append(helper.make_opsetid("", m.opset_import[0].version + 1))
    return m


def _opset_import_cleared() -> onnx.ModelProto:
    m = tiny()
    del m.opset_import[:]
    return m


def _ir_version(version: int) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        m = tiny()
        m.ir_version = version
        return m
    return make


def _no_outputs() -> onnx.ModelProto:
    m = tiny()
    del m.graph.output[:]
    return m


def _duplicate_input() -> onnx.ModelProto:
    m = tiny()
    m.graph.input.append(m.graph.input[0])
    return m


def _output_declared_string() -> onnx.ModelProto:
    m = tiny()
    m.graph.output.append(vi("W", TP.STRING))
    return m


def _output_declared_of_another_shape() -> onnx.ModelProto:
    """W ([3]) returned, declared [3, 1]: the runtime read the declaration (replay fuzz seed 122)."""
    m = tiny()
    m.graph.output.append(vi("W", shape=[3, 1]))
    return m


def _value_info_wrong_shape() -> onnx.ModelProto:
    m = tiny()
    m.graph.value_info.append(vi("u", shape=["batch", 4]))
    return m


def _unknown_attribute() -> onnx.ModelProto:
    m = tiny()
    m.graph.node[1].attribute.append(helper.make_attribute("frobnication", 1))
    return m


def _bad_initializer() -> onnx.ModelProto:
    m = tiny()
    m.graph.initializer[0].raw_data = b"\0" * 5
    return m


def _index_values(constant: bool) -> Callable[[], onnx.ModelProto]:
    """A Gather's constant index holding 3 int64 values in int64_data for its shape [2] (found by the fuzzer): onnx's
    checker takes it, numpy's reshape in the Gather rule did not."""
    def make() -> onnx.ModelProto:
        idx = helper.make_tensor("idx", TP.INT64, [2], [0, 2])
        idx.int64_data.append(1)
        nodes = [node("Gather", ["W", "idx"], ["g"], "gather", axis=0), node("Mul", ["x", "g"], ["y"], "mul")]
        inits = _params()
        if constant:
            nodes.insert(0, node("Constant", [], ["idx"], "index", value=idx))
        else:
            inits.append(idx)
        return make_model(nodes, [vi("x", shape=[2])], [vi("y", shape=[2])], inits)
    return make


def _sparse_initializer() -> onnx.ModelProto:
    m = tiny()
    values = f32("S", [1.0])
    m.graph.sparse_initializer.append(helper.make_sparse_tensor(values, i64("S_idx", [0]), [3]))
    return m


def _einsum_in_if() -> onnx.ModelProto:
    """onnx's inference visits bodies and loops forever on this equation: it must be refused before."""
    body = helper.make_graph([node("Einsum", ["x", "W"], ["a"], "ein", equation="aß")], "then", [], [vi("a")])
    other = helper.make_graph([node("Neg", ["x"], ["b"])], "else", [], [vi("b")])
    nodes = [node("If", ["c"], ["y"], "brancher", then_branch=body, else_branch=other)]
    return make_model(nodes, [vi("x"), vi("c", TP.BOOL, [])], [vi("y")], _params())


def test_split_skips_inference_hazards():
    """split infers shapes on a training graph nobody validated: a hazard means no inference, not a hang."""
    training = gradbuilder.build_gradient_graph(tiny())
    assert graph.infer_shapes_safely(training) is not None
    training.graph.node.insert(0, node("Einsum", ["x", "x"], ["e"], "ein", equation="..i"))
    assert graph.infer_shapes_safely(training) is None
    gradbuilder.split(training)
    huge = gradbuilder.build_gradient_graph(tiny())  # a dimension onnx's inference would abort the process on
    huge.graph.initializer.append(i64("huge_shape", [HUGE, 4]))
    huge.graph.node.insert(0, node("Reshape", ["x", "huge_shape"], ["huge"], "reshaper"))
    assert graph.infer_shapes_safely(huge) is None
    gradbuilder.split(huge)


def _loop_without_body_inputs() -> onnx.ModelProto:
    """onnx's shape inference crashes on this one (vector::reserve): it must be refused before."""
    true = helper.make_tensor("true", TP.BOOL, [], [True])
    body = helper.make_graph([node("Constant", [], ["c_out"], value=true), node("Constant", [], ["k"], value=true)],
                             "body", [], [vi("c_out", TP.BOOL, []), vi("k", TP.BOOL, [])])
    nodes = [node("Loop", ["M", ""], ["ks"], "looper", body=body), node("Mul", ["x", "W"], ["y"], "mul")]
    return make_model(nodes, [vi("x"), vi("M", TP.INT64, [])], [vi("y")], _params())


HUGE = 2**31
"""A dimension onnx's shape inference takes as negative (it computes Split's in 32 bits): Slice's inference after
it then aborts the process on a C++ assertion (std::clamp), so such models must be refused before."""


def _split_then_slice(x: str, first: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
                      inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    nodes = [*first, node("Split", [x], ["parts"], "splitter"), node("Transpose", ["parts"], ["t"], perm=[1, 0]),
             node("Slice", ["t", "zero", "two", "one"], ["s"], "slicer"),
             node("ReduceSum", ["s"], ["total"], keepdims=0), node("Mul", ["total", "w"], ["y"], "mul")]
    consts = [i64("zero", [0]), i64("two", [2]), i64("one", [1]), f32("w", [1.0])]
    return make_model(nodes, inputs, [vi("y", shape=[1])], inits + consts)


def _reshape_to_a_huge_dimension() -> onnx.ModelProto:
    reshape = node("Reshape", ["x", "shape"], ["r"], "reshaper")
    return _split_then_slice("r", [reshape], [vi("x", shape=[2, 6])], [i64("shape", [HUGE, 4])])


def _declared_huge_dimension() -> onnx.ModelProto:
    return _split_then_slice("x", [], [vi("x", shape=[HUGE, 4])], [])


def _declared_negative_dimension() -> onnx.ModelProto:
    return _split_then_slice("x", [], [vi("x", shape=[-5, 4])], [])


def _expand_to_a_negative_dimension() -> onnx.ModelProto:
    """Expand's inference takes -1 as a dimension (Reshape's 'infer' means nothing to Expand) and aborts too."""
    expand = node("Expand", ["x", "shape"], ["r"], "expander")
    return _split_then_slice("r", [expand], [vi("x", shape=[2, 6])], [i64("shape", [-1, 6])])


def _stash_type_outside_onnx_types() -> onnx.ModelProto:
    """onnx's checker takes any number for LayerNormalization's stash_type; its Mean output then has that type."""
    nodes = [node("LayerNormalization", ["x", "W"], ["y", "mean"], "norm", stash_type=-3)]
    return make_model(nodes, [vi("x", shape=[2, 3])], [vi("y", shape=[2, 3])], _params())


def _pad_mode_not_utf8() -> onnx.ModelProto:
    """A string attribute protobuf hands over as bytes that are not UTF-8: the Pad rule reads it."""
    nodes = [node("Pad", ["W", "pads"], ["p"], "padder", mode="XXXX"), node("Mul", ["x", "p"], ["y"], "mul")]
    m = make_model(nodes, [vi("x", shape=[5])], [vi("y", shape=[5])], [*_params(), i64("pads", [1, 1])])
    return onnx.load_from_string(m.SerializeToString().replace(b"XXXX", b"\xc3%%%"))


def _conv_strides_of_another_rank() -> onnx.ModelProto:
    """Two strides for a 1-D kernel: x's rank unknown, onnx's inference cannot tell; the Conv rule can."""
    nodes = [node("Conv", ["x", "Wc"], ["y"], "conv", strides=[1, 1])]
    return make_model(nodes, [vi("x", shape=None)], [vi("y", shape=None)], [f32("Wc", [[[1.0, 2.0, 3.0]]])])


def _conv_on_a_vector() -> onnx.ModelProto:
    """A 2-D kernel with a vector weight over an input of unknown rank: onnx's inference cannot tell (a fuzz find,
    where an IR version of 1 kept inference out)."""
    nodes = [node("Conv", ["x", "Wv"], ["y"], "conv", kernel_shape=[2, 2])]
    return make_model(nodes, [vi("x", shape=None)], [vi("y", shape=None)], [f32("Wv", [1.0, 2.0, 3.0])])


def _layer_norm_axis_out_of_range() -> onnx.ModelProto:
    """axis 5 of a rank-2 input: onnx's inference lets it through, and `axis % rank` took it for axis 1 (a fuzz
    find: a rank-0 input divided by zero there)."""
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("LayerNormalization", ["h", "W", "W"], ["y"], "ln", axis=5)]
    return make_model(nodes, [vi("x", shape=[2, 3])], [vi("y", shape=None)], _params())


def _kernel_past_the_input() -> onnx.ModelProto:
    """A 5-tap kernel over 3 positions: onnx's inference sizes the output -1 without a word (a fuzz find, where the
    weight-gradient rule then made a numpy array of that size)."""
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("Conv", ["h", "Wk"], ["y"], "conv")]
    return make_model(nodes, [vi("x", shape=[1, 1, 3])], [vi("y", shape=None)],
                      [*_params(), f32("Wk", [[[1.0, 2.0, 3.0, 4.0, 5.0]]])])


def _untyped_output_behind_a_custom_op() -> onnx.ModelProto:
    """y = Frob(x) * W, y declared without a type: inference cannot type it past the custom op, and its host
    gradient input was written with element type 0, which onnxruntime refuses to load."""
    nodes = [helper.make_node("Frob", ["x"], ["h"], name="frob", domain="com.example"),
             node("Mul", ["h", "W"], ["y"], "mul")]
    return make_model(nodes, [vi("x")], [vi("y", TP.UNDEFINED, None)], _params(), extra_opsets=["com.example"])


def _cast_to_undefined() -> onnx.ModelProto:
    """Cast to type 0: onnx's checker and inference let it through, onnxruntime runs some cast of its own."""
    nodes = [node("Mul", ["x", "W"], ["y"], "mul"), node("Cast", ["x"], ["n"], "cast", to=0)]
    return make_model(nodes, [vi("x")], [vi("y"), vi("n", TP.INT64)], _params())


def _scalar_reduced_over_computed_axes() -> onnx.ModelProto:
    """Axes only known at run time, of a scalar: onnxruntime runs it until the axes are folded (runtime replay
    seeds 16 and 141)."""
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("ReduceSum", ["h"], ["s"], "all", keepdims=0),
             node("Identity", ["axes"], ["computed"], "copy"), node("ReduceMean", ["s", "computed"], ["y"], "mean")]
    return make_model(nodes, [vi("x", shape=[3])], [vi("y", shape=None)], [*_params(), i64("axes", [0])], opset=18)


def _odd_reduce_and_axis(op: str, **attrs: object) -> Callable[[], onnx.ModelProto]:
    """An attribute onnx and onnxruntime read differently (a Reshape gets a shape)."""
    def make() -> onnx.ModelProto:
        inputs = ["h", "to3"] if op == "Reshape" else ["h"]
        nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node(op, inputs, ["y"], "odd", **attrs)]
        return make_model(nodes, [vi("x", shape=[3])], [vi("y", shape=None)], [*_params(), i64("to3", [3])],
                          opset=18)
    return make


def _softmax_after_squeeze() -> onnx.ModelProto:
    """A Squeeze of a run-time size hides the rank; onnxruntime takes axis 2^40 as 0 (runtime replay seed 104)."""
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("Squeeze", ["h"], ["s"], "squeeze"),
             node("Softmax", ["s"], ["y"], "softmax", axis=1 << 40)]
    return make_model(nodes, [vi("x", shape=["n", 3])], [vi("y", shape=None)], _params(), opset=18)


def _slice_more_starts_than_rank() -> onnx.ModelProto:
    """Two starts computed at run time (so onnx's inference cannot check them) and no axes, over a vector."""
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("Abs", ["s0"], ["s"]), node("Abs", ["e0"], ["e"]),
             node("Slice", ["h", "s", "e"], ["y"], "slicer")]
    return make_model(nodes, [vi("x", shape=[3])], [vi("y", shape=None)],
                      [*_params(), i64("s0", [0, 0]), i64("e0", [2, 2])])


def _empty_initializer_of_huge_dims() -> onnx.ModelProto:
    """No element, but a dimension of 2^56 beside the 0: numpy cannot make the array (a fuzz find, in Gather's rule
    reading it as a constant index)."""
    idx = onnx.TensorProto(name="idx", data_type=TP.INT64, dims=[0, 1 << 56])
    nodes = [node("Mul", ["x", "W"], ["h"], "mul"), node("Gather", ["h", "idx"], ["y"], "gather")]
    return make_model(nodes, [vi("x")], [vi("y", shape=None)], [*_params(), idx])


def _input_returned_as_another_type() -> onnx.ModelProto:
    """x is a float input and an int64 output: the output's declaration overrode the input's (runtime fuzz replay:
    the forward graph then typed a Transpose of x int64, and onnxruntime refused to load it)."""
    nodes = [node("Mul", ["x", "W"], ["y"], "mul")]
    return make_model(nodes, [vi("x")], [vi("y"), vi("x", TP.INT64)], _params())


def _gemm_flag() -> onnx.ModelProto:
    """transB=7: the Gemm rule wrote 1 - 7 as a flag; transA=2^40 onnx's inference reads as 0, onnxruntime as 1."""
    nodes = [node("Gemm", ["x", "Wg"], ["y"], "gemm", transB=7)]
    return make_model(nodes, [vi("x", shape=[2, 3])], [vi("y", shape=None)], [f32("Wg", np.ones((4, 3)))])


def _expand_to_a_matrix_shape() -> onnx.ModelProto:
    """Expand(W, [[1]]): onnxruntime's kernel ran it, its inference refused the same Expand recomputed in backward
    (runtime fuzz replay)."""
    nodes = [node("Expand", ["W", "to"], ["e"], "expander"), node("Mul", ["x", "e"], ["y"], "mul")]
    return make_model(nodes, [vi("x")], [vi("y", shape=None)], [*_params(), i64("to", [[1]])])


def _slice_starts_not_1d() -> onnx.ModelProto:
    nodes = [node("Slice", ["x2", "s0", "e2"], ["y"], "slicer")]
    return make_model([node("Mul", ["x", "W"], ["x2"], "mul"), *nodes], [vi("x", shape=None)], [vi("y", shape=None)],
                      [*_params(), i64("s0", 0), i64("e2", 2)])


def _slice_lengths_differ() -> onnx.ModelProto:
    """Two starts, one end, and steps of 2 (the step rule reads each axis's values by position)."""
    nodes = [node("Mul", ["x", "W"], ["x2"], "mul"), node("Slice", ["x2", "s", "e", "a", "st"], ["y"], "slicer")]
    return make_model(nodes, [vi("x", shape=None)], [vi("y", shape=None)],
                      [*_params(), i64("s", [0, 0]), i64("e", [2]), i64("a", [0, 1]), i64("st", [2, 2])])


def _dropout_ratio_of_three() -> onnx.ModelProto:
    """Three ratios: onnx's inference would refuse them, but it knows nothing of a custom op's output and stops there;
    the Dropout rule meets them."""
    nodes = [helper.make_node("Frob", ["x"], ["h"], name="frob", domain="com.example"),
             node("Mul", ["h", "W"], ["h2"], "mul"), node("Dropout", ["h2", "ratios", "on"], ["y"], "dropper")]
    return make_model(nodes, [vi("x")], [vi("y", shape=None)],
                      [*_params(), f32("ratios", [0.1, 0.2, 0.3]), onnx.numpy_helper.from_array(np.array(True), "on")],
                      extra_opsets=["com.example"])


def _sparse_initializer_in_a_body() -> onnx.ModelProto:
    """A SparseTensorProto keeps its name in `values`: reading the outer names a body uses must look there."""
    body = helper.make_graph([node("Identity", ["S"], ["a"])], "then", [], [vi("a")])
    body.sparse_initializer.append(helper.make_sparse_tensor(f32("S", [1.0]), i64("S_idx", [0]), [3]))
    other = helper.make_graph([node("Neg", ["x"], ["b"])], "else", [], [vi("b")])
    nodes = [node("If", ["c"], ["z"], "brancher", then_branch=body, else_branch=other), node("Mul", ["x", "W"], ["y"])]
    return make_model(nodes, [vi("x"), vi("c", TP.BOOL, [])], [vi("y"), vi("z")], _params())


BROKEN: dict[str, tuple[Callable[[], onnx.ModelProto], list[str]]] = {
    "no default opset": (_no_default_opset, ["no version of the default ONNX domain", "re-export"]),
    "no opset import": (_opset_import_cleared, ["no version of the default ONNX domain"]),
    "default domain imported twice": (_default_domain_twice, ["default ONNX domain at 2 versions",
                                                              "Keep one entry per domain"]),
    "opset 7": (_opset(7), ["opset 7", "13 and later", "convert_version"]),
    "opset 99": (_opset(99), ["opset 99", "newest ONNX opset", "Re-export"]),
    "ir_version 0": (_ir_version(0), ["no IR version", "ir_version"]),
    "ir_version 3": (_ir_version(3), ["IR version 3, older than opset", "untyped", "Set model.ir_version"]),
    "dangling input": (lambda: make_model([node("Add", ["x", "ghost"], ["y"], "adder")], [vi("x")], [vi("y")]),
                       ["'adder'", "'ghost'", "dangling", "Add 'ghost' as a graph input or initializer"]),
    "two nodes write one tensor": (
        lambda: make_model([node("Neg", ["x"], ["y"], "first"), node("Abs", ["x"], ["y"], "second")], [vi("x")],
                           [vi("y")]), ["'y'", "defined twice", "'second'", "Rename"]),
    "initializer and node output": (
        lambda: make_model([node("Neg", ["x"], ["W"], "shadow"), node("Mul", ["W", "x"], ["y"])], [vi("x")],
                           [vi("y")], _params()), ["'W'", "defined twice", "'shadow'"]),
    "cycle": (lambda: make_model([node("Add", ["x", "b"], ["a"], "n1"), node("Mul", ["a", "W"], ["b"], "n2"),
                                  node("Neg", ["b"], ["y"], "n3")], [vi("x")], [vi("y")], _params()),
              ["cycle", "'n1' (Add -> a)", "'n2' (Mul -> b)", "acyclic"]),
    "not in topological order": (
        lambda: make_model([node("Neg", ["a"], ["y"], "late"), node("Mul", ["x", "W"], ["a"], "early")], [vi("x")],
                           [vi("y")], _params()), ["'late'", "'early'", "'a'", "topological order", "m.graph.sort()"]),
    "unknown op on the gradient path": (
        lambda: make_model([node("Frobnicate", ["x", "W"], ["y"], "frob")], [vi("x")], [vi("y")], _params()),
        ["'frob'", "Frobnicate", "No Op registered", "a domain of its own"]),
    "unknown op off the gradient path": (
        lambda: make_model([node("Frobnicate", ["x"], ["z"], "frob"), node("Mul", ["x", "W"], ["y"])], [vi("x")],
                           [vi("y"), vi("z")], _params()), ["'frob'", "Frobnicate", "a domain of its own"]),
    "custom domain without opset import": (
        lambda: make_model([helper.make_node("Frob", ["x"], ["z"], name="frob", domain="com.example"),
                            node("Mul", ["x", "W"], ["y"])], [vi("x")], [vi("y"), vi("z")], _params()),
        ["'frob'", "com.example", "Add an opset_import entry for domain 'com.example'"]),
    "custom domain op on the gradient path": (
        lambda: make_model([helper.make_node("Frob", ["x", "W"], ["y"], name="frob", domain="com.example")],
                           [vi("x")], [vi("y")], _params(), extra_opsets=["com.example"]),
        ["com.example.Frob", "'frob'", "no gradient rule", "--freeze"]),
    "no outputs": (_no_outputs, ["no outputs", "add the loss or the module outputs"]),
    "output produced by nothing": (lambda: make_model([node("Neg", ["x"], ["y"])], [vi("x")], [vi("y"), vi("nope")]),
                                   ["graph output 'nope'", "produced by no node"]),
    "duplicate graph input": (_duplicate_input, ["graph input 'x'", "listed twice"]),
    "declared type contradicts the initializer": (_output_declared_string, ["graph output 'W'", "declared STRING",
                                                                             "initializer of that name is FLOAT"]),
    "declared shape contradicts the initializer": (_output_declared_of_another_shape, [
        "graph output 'W'", "declared of shape [3, 1]", "initializer of that name has [3]"]),
    "declared shape contradicts a node": (_value_info_wrong_shape, ["inconsistent", "'mul'", "(3) vs (4)"]),
    "unknown attribute": (_unknown_attribute, ["'mul'", "Unrecognized attribute: frobnication"]),
    "too many inputs": (lambda: make_model([node("Mul", ["x", "W", "x"], ["y"], "mul3")], [vi("x")], [vi("y")],
                                           _params()), ["'mul3'", "input size 3"]),
    "initializer bytes do not match its shape": (_bad_initializer, ["initializer 'W'", "12 bytes"]),
    "initializer values do not match its shape": (_index_values(False), ["initializer 'idx'", "3 values in int64_data",
                                                                         "shape [2]", "re-export"]),
    "Constant's values do not match its shape": (_index_values(True), ["value of node 'index'", "3 values",
                                                                        "shape [2]"]),
    "sparse initializer": (_sparse_initializer, ["sparse initializers", "dense"]),
    "mixed input types": (lambda: make_model([node("Add", ["x", "d"], ["y"], "adder")], [vi("x"), vi("d", TP.DOUBLE)],
                                             [vi("y")]), ["'adder'", "'x'", "'d'", "same type", "Cast"]),
    "float where the schema wants ints": (
        lambda: make_model([node("Slice", ["x", "W", "W"], ["y"], "slicer")], [vi("x")], [vi("y", shape=None)],
                           _params()), ["'slicer'", "starts", "int64"]),
    "shape conflict": (lambda: make_model([node("Conv", ["x", "W"], ["y"], "conv")], [vi("x")], [vi("y", shape=None)],
                                          _params()), ["inconsistent", "'conv'", "dimensions"]),
    "empty required input": (lambda: make_model([node("Max", ["x", ""], ["y"], "maxer")], [vi("x")], [vi("y")]),
                             ["'maxer'", "input 1 is empty", "not"]),
    "malformed Einsum": (lambda: make_model([node("Einsum", ["x", "W"], ["y"], "ein", equation="..i")], [vi("x")],
                                            [vi("y")], _params()), ["'ein'", "'..i'", "Einsum equation"]),
    "malformed Einsum inside a body": (_einsum_in_if, ["'ein'", "'aß'", "Einsum equation"]),
    "Loop body without inputs": (_loop_without_body_inputs, ["'looper'", "'body' graph has 0 inputs", "needs 2"]),
    "Split with more outputs than num_outputs": (  # onnx's inference (1.23) aborts the process on it
        lambda: make_model([node("Split", ["x"], ["a", "b"], "splitter", axis=0, num_outputs=1)], [vi("x")],
                           [vi("a"), vi("b")], opset=18), ["'splitter'", "num_outputs=1", "2 outputs"]),
    "Split with an unnamed second output": (  # onnxruntime crashed (a segmentation fault) running it
        lambda: make_model([node("Split", ["x"], ["a", ""], "splitter", axis=1)], [vi("x")], [vi("a", shape=None)]),
        ["'splitter'", "output 1 ('outputs') unnamed", "not optional"]),
    "a default-domain op with its domain spelled 'ai.onnx'": (  # was: "if it is a custom op, give it a domain"
        lambda: make_model([node("Mul", ["x", "W"], ["y"], "mul", domain="ai.onnx")], [vi("x")], [vi("y")], _params()),
        ["'mul'", "No Op registered for Mul", "set the node's domain to ''"]),
    "BatchNormalization in training with an unnamed running mean": (  # onnxruntime 1.32 crashes (segfault) on it
        lambda: make_model([node("BatchNormalization", ["x", "W", "W", "W", "W"], ["y", "", "var"], "bn",
                                 training_mode=1)], [vi("x", shape=[2, 3])], [vi("y", shape=[2, 3])], _params()),
        ["'bn'", "output 1 unnamed", "segmentation fault", "Give every output a name"]),
    "Split naming no parts, of an input of unknown shape": (  # loads in onnxruntime only while the shape is unknown
        lambda: make_model([node("Split", ["x"], ["a"], "splitter", axis=0)], [vi("x", shape=None)],
                           [vi("a", shape=None)], opset=18), ["'splitter'", "neither", "num_outputs=1"]),
    "a scalar reduced over computed axes": (_scalar_reduced_over_computed_axes,
                                            ["'mean'", "'s', a scalar", "1 axes in 'computed'", "keepdims"]),
    "Reshape to a dimension above 2^31": (_reshape_to_a_huge_dimension,
                                          ["'reshaper'", str(HUGE), "wrapping", "Fix the shape"]),
    "declared dimension above 2^31": (_declared_huge_dimension, ["graph input 'x'", str(HUGE), "crash the process"]),
    "declared negative dimension": (_declared_negative_dimension, ["graph input 'x'", "dimension of -5", "from 0"]),
    "Expand to a negative dimension": (_expand_to_a_negative_dimension, ["'expander'", "holding -1", "from 0"]),
    "a type attribute outside ONNX's types": (_stash_type_outside_onnx_types,
                                              ["tensor 'mean'", "'norm'", "element type -3", "stash_type"]),
    "string attribute not UTF-8": (_pad_mode_not_utf8, ["'padder'", "attribute 'mode'", "not UTF-8"]),
    "Conv strides of another rank": (_conv_strides_of_another_rank,
                                     ["'conv'", "strides [1, 1]", "1 value of at least"]),
    "Slice starts not 1-D": (_slice_starts_not_1d, ["'slicer'", "starts is a 0-D constant", "1-D"]),
    "Slice inputs of different lengths": (_slice_lengths_differ, ["'slicer'", "ends (1)", "differ in length"]),
    "Dropout ratio of three values": (_dropout_ratio_of_three, ["'dropper'", "ratio is a constant of shape [3]"]),
    "sparse initializer in a body": (_sparse_initializer_in_a_body, ["'brancher'", "inconsistent"]),
    "LayerNormalization axis out of range": (_layer_norm_axis_out_of_range,
                                             ["'ln'", "axis 5 is out of range for an input of rank 2"]),
    "Conv kernel past its input": (_kernel_past_the_input, ["'conv'", "cannot run on its inputs", "[1, 1, -1]"]),
    "untyped output behind a custom op": (_untyped_output_behind_a_custom_op,
                                          ["graph output 'y'", "'mul'", "element type is unknown", "Declare"]),
    "Cast to type 0": (_cast_to_undefined, ["'cast'", "casts to type 0", "not an ONNX type"]),
    "Softmax axis past any rank, behind a Squeeze": (_softmax_after_squeeze,  # rank unknown to the rules
                                                     ["'softmax'", "axis=1099511627776", "32 bits, as 0"]),
    "noop_with_empty_axes of 2": (_odd_reduce_and_axis("ReduceSum", noop_with_empty_axes=2),
                                  ["'odd'", "noop_with_empty_axes=2", "read other values differently"]),
    "Gemm transB of 7": (_gemm_flag, ["'gemm'", "transB=7", "set it to 0 or 1"]),
    "allowzero of 2": (_odd_reduce_and_axis("Reshape", allowzero=2), ["'odd'", "allowzero=2", "set it to 0 or 1"]),
    "Slice of more axes than the rank": (_slice_more_starts_than_rank,
                                         ["'slicer'", "2 starts and no axes", "rank 1"]),
    "empty initializer of huge dimensions": (_empty_initializer_of_huge_dims,
                                             ["initializer 'idx'", "dimension above 2147483647", "re-export"]),
    "input returned as another type": (_input_returned_as_another_type,
                                       ["'x' is declared FLOAT as a graph input and INT64 as a graph output"]),
    "Expand to a matrix shape": (_expand_to_a_matrix_shape, ["'expander'", "'to', of rank 2", "1-D vector"]),
    "Conv on a vector": (_conv_on_a_vector, ["'conv'", "weight 'Wv' has rank 1", "needs a weight of rank 4"]),
}


def _non_utf8_name(tmp: Path) -> Path:
    """Protobuf hands strings that are not UTF-8 to Python as bytes: patch a name in the serialized model."""
    m = tiny()
    m.graph.node[0].name = "XXXXXX"
    data = m.SerializeToString().replace(b"XXXXXX", b"\xff\xfe\xfd\xfc\xfb\xfa")
    return _write(tmp / "non_utf8.onnx", data)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


BUILD_ONLY = {"custom domain op on the gradient path", "string attribute not UTF-8", "Conv strides of another rank",
              "Slice starts not 1-D", "Slice inputs of different lengths", "Dropout ratio of three values",
              "Conv on a vector", "LayerNormalization axis out of range", "untyped output behind a custom op",
              "Slice of more axes than the rank"}
"""Models whose problem only the gradient rules meet (a valid op with no rule, an attribute only a rule reads):
inspect summarises them; build refuses."""


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_model_is_refused(capsys, tmp_path, case):
    make, needles = BROKEN[case]
    path = save(make(), tmp_path / "in" / "model.onnx")
    assert_fails(capsys, tmp_path, ["build", path, "-o", tmp_path / "out.onnx"], *needles)
    if case not in BUILD_ONLY:
        assert_fails(capsys, tmp_path, ["inspect", path], *needles)


def test_non_utf8_names(capsys, tmp_path):
    path = _non_utf8_name(tmp_path / "in")
    assert_fails(capsys, tmp_path, ["build", path, "-o", tmp_path / "o.onnx"], "non_utf8.onnx", "not valid UTF-8",
                 "b'\\xff\\xfe")


def _damage_yield(m: onnx.ModelProto, damage: str) -> None:
    y = next(n for n in m.graph.node if n.op_type == "Yield")
    attr = next(a for a in y.attribute if a.name == "full_shape_outputs")
    if damage == "yield attribute type":
        y.attribute.remove(attr)
        y.attribute.append(helper.make_attribute("full_shape_outputs", 1.5))
    elif damage == "yield index":
        attr.ints[:] = [7]
    else:
        next(p for p in m.metadata_props if p.key == "gradbuilder.gradients").value = "[[1, 2"


@pytest.mark.parametrize("damage,needles", [
    ("yield attribute type", ["Yield", "full_shape_outputs is not a list of ints", "rebuild"]),
    ("yield index", ["Yield", "[7]", "indices of its 1 inputs", "rebuild"]),
    ("metadata", ["gradbuilder.* metadata", "damaged", "rebuild"]),
])
@pytest.mark.parametrize("command", ["split", "inspect"])
def test_damaged_training_graph(capsys, tmp_path, damage, needles, command):
    m = gradbuilder.build_gradient_graph(tiny())
    _damage_yield(m, damage)
    path = save(m, tmp_path / "in" / "t.onnx")
    out = ["-o", tmp_path / "parts"] if command == "split" else []
    assert_fails(capsys, tmp_path, [command, path, *out], *needles)


# --------------------------------------------------------------------------------------------------
# unreadable bytes


def test_unreadable_files(capsys, tmp_path):
    good = tiny().SerializeToString()
    rng = np.random.default_rng(0)
    files = {
        "empty.onnx": b"",
        "half.onnx": good[: len(good) // 2],
        "one_byte.onnx": good[:1],
        "text.onnx": b"this is not a model\n",
        "random1.onnx": rng.bytes(64),
        "random2.onnx": rng.bytes(4096),
        "tensor.onnx": f32("W", np.ones(100)).SerializeToString(),
        "zeros.onnx": bytes(1000),
    }
    for name, data in files.items():
        path = _write(tmp_path / "in" / name, data)
        for command in (["build", path, "-o", tmp_path / "o.onnx"], ["split", path, "-o", tmp_path / "parts"],
                        ["inspect", path]):
            err = assert_fails(capsys, tmp_path, command, name)
            assert any(w in err for w in ("empty", "not a readable ONNX model", "no ONNX graph", "no version")), err


def test_every_truncation_is_refused_or_builds():
    """A protobuf cut anywhere either fails to parse or parses as a shorter model: both must end cleanly."""
    for data in [tiny().SerializeToString(), with_loss().SerializeToString()]:
        for n in range(len(data)):
            with contextlib.suppress(GradBuilderError):
                gradbuilder.build_gradient_graph(data[:n])


# --------------------------------------------------------------------------------------------------
# control flow: refused on the gradient path, built and run when off it


def _branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [vi(out)])


def _if_reading_w() -> onnx.ModelProto:
    """W is read only inside the branches: a hidden input."""
    n = node("If", ["c"], ["y"], "brancher", then_branch=_branch("then", [node("Identity", ["W"], ["a"])], "a"),
             else_branch=_branch("else", [node("Neg", ["W"], ["b"])], "b"))
    return make_model([n], [vi("c", TP.BOOL, [])], [vi("y")], _params())


def _loop_reading_w() -> onnx.ModelProto:
    """acc <- acc * W, M times: W read only inside the body."""
    body = helper.make_graph([node("Identity", ["c_in"], ["c_out"]), node("Mul", ["acc_in", "W"], ["acc_out"])],
                             "body", [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("acc_in")],
                             [vi("c_out", TP.BOOL, []), vi("acc_out")])
    n = node("Loop", ["M", "", "x"], ["y"], "looper", body=body)
    return make_model([n], [vi("x"), vi("M", TP.INT64, [])], [vi("y")], _params())


def _scan_with_w_as_state() -> onnx.ModelProto:
    """W is the Scan's explicit initial state."""
    body = helper.make_graph([node("Add", ["s_in", "row"], ["s_out"])], "body", [vi("s_in"), vi("row")],
                             [vi("s_out")])
    n = node("Scan", ["W", "X"], ["y"], "scanner", body=body, num_scan_inputs=1)
    return make_model([n], [vi("X", shape=[4, 3])], [vi("y")], _params())


def _nested_if_in_loop() -> onnx.ModelProto:
    """W is read two subgraphs deep: an If inside a Loop body."""
    inner = node("If", ["c_in"], ["v"], "inner", then_branch=_branch("t", [node("Identity", ["W"], ["a"])], "a"),
                 else_branch=_branch("e", [node("Neg", ["W"], ["b"])], "b"))
    body = helper.make_graph([inner, node("Identity", ["c_in"], ["c_out"]), node("Add", ["acc_in", "v"], ["acc_out"])],
                             "body", [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("acc_in")],
                             [vi("c_out", TP.BOOL, []), vi("acc_out")])
    n = node("Loop", ["M", "c", "x"], ["y"], "outer", body=body)
    return make_model([n], [vi("x"), vi("M", TP.INT64, []), vi("c", TP.BOOL, [])], [vi("y")], _params())


@pytest.mark.parametrize("make,name,op", [(_if_reading_w, "brancher", "If"), (_loop_reading_w, "looper", "Loop"),
                                          (_scan_with_w_as_state, "scanner", "Scan"),
                                          (_nested_if_in_loop, "outer", "Loop")])
def test_control_flow_on_the_gradient_path(capsys, tmp_path, make, name, op):
    path = save(make(), tmp_path / "in" / "m.onnx")
    assert_fails(capsys, tmp_path, ["build", path, "-o", tmp_path / "o.onnx"], f"'{name}'", f"({op} ->",
                 "control flow", "--freeze")
    rc, out, err = run(capsys, ["build", path, "-o", tmp_path / "frozen.onnx", "--freeze", "W"])
    assert rc == 0, err  # the way out the message offers works
    assert "W: no gradient: frozen" in out


def _control_flow_off_path() -> onnx.ModelProto:
    """If, Loop and Scan on inputs only; y = acc * W + z * W reads their outputs, so gradients cross none of them.

    z = If(c, x * 2, -x); n = Loop(3 times, n + 1); acc = Scan(rows of X, acc + row) from x.
    """
    two = helper.make_tensor("two", TP.FLOAT, [], [2.0])
    then = _branch("then", [node("Constant", [], ["k"], value=two), node("Mul", ["x", "k"], ["a"])], "a")
    other = _branch("else", [node("Neg", ["x"], ["b"])], "b")
    if_ = node("If", ["c"], ["z"], "brancher", then_branch=then, else_branch=other)
    one = helper.make_tensor("one", TP.INT64, [], [1])
    loop_body = helper.make_graph(
        [node("Identity", ["c_in"], ["c_out"]), node("Constant", [], ["inc"], value=one),
         node("Add", ["n_in", "inc"], ["n_out"])], "loop_body",
        [vi("i", TP.INT64, []), vi("c_in", TP.BOOL, []), vi("n_in", TP.INT64, [])],
        [vi("c_out", TP.BOOL, []), vi("n_out", TP.INT64, [])])
    loop = node("Loop", ["M", "", "n0"], ["n"], "counter", body=loop_body)
    scan_body = helper.make_graph([node("Add", ["s_in", "row"], ["s_out"])], "scan_body", [vi("s_in"), vi("row")],
                                  [vi("s_out")])
    scan = node("Scan", ["x", "X"], ["acc"], "scanner", body=scan_body, num_scan_inputs=1)
    nodes = [if_, loop, scan, node("Mul", ["acc", "W"], ["p"]), node("Mul", ["z", "W"], ["q"]),
             node("Add", ["p", "q"], ["y"])]
    inputs = [vi("c", TP.BOOL, []), vi("x"), vi("X", shape=[4, 3])]
    inits = [*_params(), i64("M", 3), i64("n0", 0)]
    return make_model(nodes, inputs, [vi("y"), vi("n", TP.INT64, [])], inits)


def run_split(parts: Path, feeds: dict[str, np.ndarray], params: dict[str, np.ndarray],
              out_grads: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run forward.onnx then backward.onnx the way a host would; return (forward values, gradients by wrt)."""
    manifest = json.loads((parts / "manifest.json").read_text(encoding="utf-8"))
    names = [e["name"] for e in manifest["forward_outputs"]]
    env = dict(zip(names, session(parts / "forward.onnx").run(names, feeds)))
    known = {**feeds, **params, **env}
    bfeeds = {e["name"]: out_grads[manifest["module_outputs"][e["output_index"]]] if e["role"] == "output_grad"
              else known[e["name"]] for e in manifest["backward_inputs"]}
    outs = [e["name"] for e in manifest["backward_outputs"]]
    grads = session(parts / "backward.onnx").run(outs, bfeeds)
    return env, {e["wrt"]: g for e, g in zip(manifest["backward_outputs"], grads)}


def test_control_flow_off_the_gradient_path(capsys, tmp_path):
    path = save(_control_flow_off_path(), tmp_path / "m.onnx")
    rc, out, err = run(capsys, ["build", path, "-o", tmp_path / "t.onnx"])
    assert rc == 0, err
    assert out.startswith("W: gradient W_grad\n")
    assert run(capsys, ["-q", "split", tmp_path / "t.onnx", "-o", tmp_path / "parts"])[0] == 0
    rng = np.random.default_rng(0)
    x, X, dy = (rng.standard_normal(s).astype(np.float32) for s in ([3], [4, 3], [3]))
    W = np.float32(W3)
    for c in (True, False):
        env, grads = run_split(tmp_path / "parts", {"c": np.array(c), "x": x, "X": X}, {"W": W}, {"y": dy})
        acc, z = x + X.sum(0), (2 * x if c else -x)
        np.testing.assert_allclose(env["y"], acc * W + z * W, rtol=1e-5)
        assert env["n"] == 3
        np.testing.assert_allclose(grads["W"], dy * (acc + z), rtol=1e-5)


def test_custom_domain_op_off_the_gradient_path(capsys, tmp_path):
    """A node in a domain nobody here knows, fed only by inputs: kept as is, with its opset import."""
    nodes = [helper.make_node("Frob", ["x"], ["z"], name="frob", domain="com.example"), node("Mul", ["x", "W"], ["y"])]
    path = save(make_model(nodes, [vi("x")], [vi("y"), vi("z")], _params(), extra_opsets=["com.example"]),
                tmp_path / "m.onnx")
    rc, out, err = run(capsys, ["build", path, "-o", tmp_path / "t.onnx"])
    assert rc == 0, err
    assert out.startswith("W: gradient W_grad\n")
    training = onnx.load(str(tmp_path / "t.onnx"))
    assert any(n.domain == "com.example" and n.op_type == "Frob" for n in training.graph.node)
    assert {(o.domain, o.version) for o in training.opset_import} >= {("com.example", 1)}
    forward, _, _ = gradbuilder.split(training)
    assert any(n.op_type == "Frob" for n in forward.graph.node)


# --------------------------------------------------------------------------------------------------
# external data


def _external_model(d: Path) -> Path:
    """tiny() with a second output y2 = x2 * E, E (4 KB) stored in weights.bin beside the model."""
    m = tiny()
    m.graph.initializer.append(f32("E", np.linspace(-1, 1, 1000)))
    m.graph.input.append(vi("x2", shape=[1000]))
    m.graph.output.append(vi("y2", shape=[1000]))
    m.graph.node.append(node("Mul", ["x2", "E"], ["y2"], "mul_e"))
    d.mkdir(parents=True, exist_ok=True)
    onnx.save_model(m, str(d / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=1024)
    assert (d / "weights.bin").stat().st_size == 4000
    return d / "model.onnx"


def test_external_data_works_and_is_untouched(capsys, tmp_path):
    path = _external_model(tmp_path / "in")
    before = snapshot(tmp_path / "in")
    out = tmp_path / "out" / "t.onnx"
    rc, stdout, err = run(capsys, ["build", path, "-o", out, "--freeze", "F"])
    assert rc == 0, err
    assert "E: gradient E_grad" in stdout
    assert snapshot(tmp_path / "in") == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["t.onnx"]  # small: the weights are inline
    assert run(capsys, ["-q", "split", out, "-o", tmp_path / "parts"])[0] == 0
    rng = np.random.default_rng(0)
    x, x2 = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    dy, dy2 = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    E = np.linspace(-1, 1, 1000).astype(np.float32)
    params = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    _, grads = run_split(tmp_path / "parts", {"x": x, "x2": x2}, params, {"y": dy, "y2": dy2})
    np.testing.assert_allclose(grads["E"], dy2 * x2, rtol=1e-6)
    np.testing.assert_allclose(params["E"], E)
    assert snapshot(tmp_path / "in") == before


@pytest.mark.parametrize("command,location,output,linked", [
    ("build", "weights.bin", "weights.bin", False), ("build", "weights.bin", "weights.bin", True),
    ("draw", "sub/weights.dot", "sub/weights.dot", False), ("split", "parts/forward.onnx.data", "parts", False)])
def test_output_never_overwrites_the_inputs_external_data(capsys, tmp_path, command, location, output, linked):
    """The input's data file is part of the input: a build written over it loaded as the input with other weights,
    silently; split replaced a directory holding it. Refused, and nothing changes. `linked`: the input is a link,
    beside the data, to a model elsewhere (its data is read beside the link)."""
    model = onnx.load(str(_external_model(tmp_path / "in")))
    if command == "split":
        model = gradbuilder.build_gradient_graph(model, freeze=["F"])
    path = tmp_path / "in" / "input.onnx"
    (path.parent / location).parent.mkdir(exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location=location, size_threshold=1024)
    if linked:
        (tmp_path / "elsewhere").mkdir()
        path = path.rename(tmp_path / "elsewhere" / "input.onnx")
        (tmp_path / "in" / "input.onnx").symlink_to(path)
        path = tmp_path / "in" / "input.onnx"
    assert_fails(capsys, tmp_path, [command, path, "-o", path.parent / output], "input.onnx",
                 f"external data file {Path(location).name}", "never overwrites its input")


def _retarget(path: Path, **fields: str) -> None:
    m = onnx.load(str(path), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key in fields:
                e.value = fields[e.key]
    path.write_bytes(m.SerializeToString())


@pytest.mark.parametrize("damage,needles", [
    ("missing", ["'E'", "'weights.bin'", "missing", "next to its external data"]),
    ("outside", ["'E'", "'../secret.bin'", "outside the model's directory", "does not read it"]),
    ("absolute", ["'E'", "absolute path", "must name files in the model's directory"]),
    ("beyond the end", ["'E'", "bytes 0..40000 of 'weights.bin'", "holds 4,000 bytes"]),
    ("wrong length", ["'E'", "has 2,000 bytes in 'weights.bin'", "shape [1000] take 4,000"]),
])
@pytest.mark.parametrize("command", ["build", "split", "inspect"])
def test_broken_external_data(capsys, tmp_path, damage, needles, command):
    path = _external_model(tmp_path / "in")
    if damage == "missing":
        (tmp_path / "in" / "weights.bin").unlink()
    elif damage == "outside":
        (tmp_path / "secret.bin").write_bytes(bytes(4000))
        _retarget(path, location="../secret.bin")
    elif damage == "absolute":
        _retarget(path, location=str(tmp_path / "in" / "weights.bin"))
    else:
        _retarget(path, length="40000" if damage == "beyond the end" else "2000")
    out = {"build": ["-o", tmp_path / "o.onnx"], "split": ["-o", tmp_path / "parts"], "inspect": []}[command]
    assert_fails(capsys, tmp_path, [command, path, *out], "model.onnx", *needles)


def test_unloaded_external_data_in_memory():
    """A ModelProto whose weights were never loaded: the library says how to load them, it does not guess."""
    m = tiny()
    t = m.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TP.EXTERNAL
    t.external_data.add(key="location", value="weights.bin")
    with pytest.raises(GradBuilderError, match=r"'W' still refers to external data \('weights.bin'\) that was not"):
        gradbuilder.build_gradient_graph(m)


# --------------------------------------------------------------------------------------------------
# non-ASCII names, end to end


def _non_ascii() -> onnx.ModelProto:
    """y = (входные_данные + 偏置) * 权重; names in Cyrillic, Chinese, Japanese, Greek, with spaces and emoji."""
    x, y = "входные_данные", "出力 ✓"
    nodes = [node("Add", [x, "偏置"], ["сумма"], "узел→1"), node("Mul", ["сумма", "权重"], ["積"], "ノード 2"),
             node("Identity", ["積"], [y], "ταυτότητα 🙂")]
    m = make_model(nodes, [vi(x, shape=["パッチ", 3])], [vi(y, shape=["パッチ", 3])],
                   [f32("权重", W3), f32("偏置", [0.1, 0.2, 0.3])])
    m.graph.name = "グラフ"
    m.doc_string = "modèle d'essai"
    return m


def test_non_ascii_names_end_to_end(capsys, tmp_path):
    d = tmp_path / "données ünïcode"
    path = save(_non_ascii(), d / "モデル.onnx")
    training = d / "学習.onnx"
    rc, out, err = run(capsys, ["build", path, "-o", training])
    assert rc == 0, err
    assert out.splitlines()[:2] == ["权重: gradient 权重_grad", "偏置: gradient 偏置_grad"]
    rc, out, err = run(capsys, ["split", training, "-o", d / "части"])
    assert rc == 0, err
    rc, out, err = run(capsys, ["inspect", training])
    assert rc == 0 and "出力 ✓" in out and "сумма" in out, err
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    W, b = np.float32(W3), np.float32([0.1, 0.2, 0.3])
    env, grads = run_split(d / "части", {"входные_данные": x}, {"权重": W, "偏置": b}, {"出力 ✓": dy})
    np.testing.assert_allclose(env["出力 ✓"], (x + b) * W, rtol=1e-6)
    np.testing.assert_allclose(grads["权重"], (dy * (x + b)).sum(0), rtol=1e-5)
    np.testing.assert_allclose(grads["偏置"], (dy * W).sum(0), rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# save_model_atomic: no mutation, no mismatched pair, nothing left on failure, nothing clobbered


@pytest.fixture
def small_limit(monkeypatch) -> None:
    """Take the over-2-GB path for a few kB: the logic is the same, only the threshold moves."""
    monkeypatch.setattr(graph, "INLINE_LIMIT", 2000)


def _weighty(seed: int = 0) -> onnx.ModelProto:
    """tiny() plus two 4 kB initializers, so it is 'large' under small_limit."""
    m = tiny()
    rng = np.random.default_rng(seed)
    m.graph.initializer.extend([f32("E1", rng.standard_normal(1000)), f32("E2", rng.standard_normal(1000))])
    return m


def _same_weights(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    arrays = [{t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer} for m in (a, b)]
    return arrays[0].keys() == arrays[1].keys() and all(np.array_equal(arrays[0][k], arrays[1][k]) for k in arrays[0])


def test_large_save_leaves_the_model_alone(tmp_path, small_limit):
    m = _weighty()
    before = m.SerializeToString()
    graph.save_model_atomic(m, tmp_path / "m.onnx")
    assert m.SerializeToString() == before  # onnx.save_model(save_as_external_data=True) emptied the caller's tensors
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    stub = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    offsets = [int(e.value) for t in stub.graph.initializer for e in t.external_data if e.key == "offset"]
    assert len(offsets) == 2 and all(o % graph.DATA_ALIGN == 0 for o in offsets)
    assert _same_weights(onnx.load(str(tmp_path / "m.onnx")), m)
    session(tmp_path / "m.onnx")  # onnxruntime reads the pair too


def test_large_overwrite_replaces_the_pair(tmp_path, small_limit):
    path = tmp_path / "m.onnx"
    models = [_weighty(seed) for seed in range(3)]
    names = []
    for m in models:
        graph.save_model_atomic(m, path)
        names.append(sorted(os.listdir(tmp_path)))
        assert _same_weights(onnx.load(str(path)), m)
    # the data file in use is never written over: the name alternates, the old one goes after the rename
    assert names == [["m.onnx", "m.onnx.data"], ["m.onnx", "m.onnx.1.data"], ["m.onnx", "m.onnx.data"]]
    graph.INLINE_LIMIT = 2**40
    graph.save_model_atomic(models[0], path)  # small again: the data file goes
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_large_save_pair_matches_at_every_step(tmp_path, small_limit, monkeypatch):
    """Whatever instant a crash hits, m.onnx loads with the weights of one whole model: the old or the new."""
    path = tmp_path / "m.onnx"
    old, new = _weighty(1), _weighty(2)
    graph.save_model_atomic(old, path)
    real_replace = os.replace
    seen = []

    def checking_replace(src, dst):
        seen.append(_same_weights(onnx.load(str(path)), old))  # just before the switch: still the old pair
        real_replace(src, dst)
        seen.append(_same_weights(onnx.load(str(path)), new))  # just after: the new pair, complete

    monkeypatch.setattr(os, "replace", checking_replace)
    graph.save_model_atomic(new, path)
    assert seen == [True, True]


@pytest.mark.parametrize("where", ["rename", "data"])
def test_failed_large_save_leaves_the_old_pair(tmp_path, small_limit, monkeypatch, where):
    path = tmp_path / "m.onnx"
    old = _weighty(1)
    graph.save_model_atomic(old, path)
    before = snapshot(tmp_path)

    def fail(*_args, **_kw):
        raise OSError(28, "No space left on device")

    if where == "rename":
        monkeypatch.setattr(os, "replace", fail)
    else:  # half-way through the data file
        real = graph._externalize

        def partial(model, location, f):
            f.write(b"\0" * 1000)
            fail()
            return real(model, location, f)

        monkeypatch.setattr(graph, "_externalize", partial)
    with pytest.raises(OSError, match="No space"):
        graph.save_model_atomic(_weighty(2), path)
    assert snapshot(tmp_path) == before  # no new data file, no temp file, the old pair as it was
    assert _same_weights(onnx.load(str(path)), old)


def test_large_save_never_clobbers_a_data_file_in_use(tmp_path, small_limit):
    """Another model reads b.onnx.data; saving b.onnx must not write over it."""
    onnx.save_model(_weighty(5), str(tmp_path / "a.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="b.onnx.data", size_threshold=1024)
    before = (tmp_path / "b.onnx.data").read_bytes()
    graph.save_model_atomic(_weighty(6), tmp_path / "b.onnx")
    assert (tmp_path / "b.onnx.data").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["a.onnx", "b.onnx", "b.onnx.1.data", "b.onnx.data"]
    assert _same_weights(onnx.load(str(tmp_path / "a.onnx")), _weighty(5))
    assert _same_weights(onnx.load(str(tmp_path / "b.onnx")), _weighty(6))


def test_too_large_even_without_weights(tmp_path, small_limit, monkeypatch):
    monkeypatch.setattr(graph, "PROTOBUF_LIMIT", 100)
    with pytest.raises(SaveError, match="over 2 GB even with every initializer"):
        graph.save_model_atomic(_weighty(), tmp_path / "m.onnx")
    assert os.listdir(tmp_path) == []


def test_large_build_through_the_cli(capsys, tmp_path, small_limit):
    """build and split write pairs; a re-split into the same directory replaces them as a whole."""
    src = save(_weighty(), tmp_path / "in" / "m.onnx")
    # E1, E2 are unused: make them matter so they reach forward.onnx and the gradients
    m = onnx.load(str(src))
    m.graph.input.append(vi("e", shape=[1000]))
    m.graph.output.append(vi("f", shape=[1000]))
    m.graph.node.extend([node("Mul", ["e", "E1"], ["g"]), node("Mul", ["g", "E2"], ["f"])])
    save(m, src)
    rc, _, err = run(capsys, ["-q", "build", src, "-o", tmp_path / "t.onnx"])
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "t.onnx", "t.onnx.data"]
    for _ in range(2):
        rc, _, err = run(capsys, ["-q", "split", tmp_path / "t.onnx", "-o", tmp_path / "parts"])
        assert rc == 0, err
        assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
            "backward.onnx", "forward.onnx", "forward.onnx.data", "manifest.json"]
    rng = np.random.default_rng(0)
    e, df = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    x, dy = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    params = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "t.onnx")).graph.initializer}
    _, grads = run_split(tmp_path / "parts", {"x": x, "e": e}, params, {"y": dy, "f": df})
    np.testing.assert_allclose(grads["E2"], df * e * params["E1"], rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# determinism across processes


DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from gradbuilder.cli import main
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    for model in sorted(src.glob("*.onnx")):
        training = out / model.stem / "training.onnx"
        assert main(["-q", "build", str(model), "-o", str(training)]) == 0, model
        assert main(["-q", "split", str(training), "-o", str(out / model.stem / "parts")]) == 0, model
""")


def test_same_input_same_bytes_across_processes(tmp_path):
    """build and split twice, in two interpreters with different hash seeds: byte-identical files."""
    src = tmp_path / "src"
    models = {**seeds(), "non_ascii": _non_ascii(), "control_flow": _control_flow_off_path(),
              "fan_out": _fan_out()}
    for name, m in models.items():
        save(m, src / f"{name}.onnx")
    outs = []
    for hash_seed in ("0", "4242"):
        out = tmp_path / f"out{hash_seed}"
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        p = subprocess.run([sys.executable, "-c", DRIVER, str(src), str(out)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append({str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()})
    assert len(outs[0]) == 4 * len(models)  # training, forward, backward, manifest per model
    assert outs[0].keys() == outs[1].keys()
    differ = [k for k in outs[0] if outs[0][k] != outs[1][k]]
    assert not differ, f"not byte-identical across processes: {differ}"


def _fan_out() -> onnx.ModelProto:
    """One parameter read by many nodes and several outputs: gradient sums whose order must not vary."""
    nodes, outs = [], []
    for k in range(6):
        nodes += [node("Mul", ["x", "W"], [f"m{k}"]), node("Add", [f"m{k}", "b"], [f"a{k}"]),
                  node("Tanh", [f"a{k}"], [f"y{k}"])]
        outs.append(vi(f"y{k}"))
    return make_model(nodes, [vi("x")], outs, [*_params(), f32("b", [0.1, 0.2, 0.3])])


def test_broken_input_in_a_real_process(tmp_path):
    """The console entry point too: exit 2, one message, no traceback, nothing written."""
    path = save(BROKEN["cycle"][0](), tmp_path / "in" / "m.onnx")
    before = snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "gradbuilder", "build", str(path), "-o", str(tmp_path / "o.onnx")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("gradbuilder: error: the graph has a cycle") and "Traceback" not in p.stderr
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------------------------------
# over protobuf's 2 GB limit


BIG = 2**31 + 2**26  # 2.06 GiB of float32 zeros, over protobuf's 2 GB limit


def _big_model(src: Path, parts: int) -> None:
    """y = x * W1 (* W2): the weights, BIG bytes in all, in one sparse file of zeros (no disk until read)."""
    n, size = BIG // 4 // parts, BIG // parts
    weights, nodes, prev = [], [], "x"
    for k in range(parts):
        w = onnx.TensorProto(name=f"W{k + 1}", data_type=TP.FLOAT, dims=[n], data_location=TP.EXTERNAL)
        for key, value in (("location", "W.bin"), ("offset", str(k * size)), ("length", str(size))):
            w.external_data.add(key=key, value=value)
        weights.append(w)
        out = "y" if k == parts - 1 else f"h{k}"
        nodes.append(node("Mul", [prev, w.name], [out], f"scale{k}"))
        prev = out
    save(make_model(nodes, [vi("x", shape=[n])], [vi("y", shape=[n])], weights), src / "big.onnx")
    with open(src / "W.bin", "wb") as f:
        f.truncate(BIG)


def _stat(d: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()}  # 2 GB: no bytes compared


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GRADBUILDER_SLOW") != "1", reason="writes 2-4 GB; set GRADBUILDER_SLOW=1")
@pytest.mark.parametrize("parts", [1, 2])
def test_model_over_2gb(capsys, tmp_path, parts):
    """Weights of 2.06 GiB in external data, as one tensor or two: build writes an .onnx + .data pair, the input
    untouched; with two tensors (each under the limit, as in real models), split does too."""
    src = tmp_path / "in"
    _big_model(src, parts)
    before, stub = _stat(src), (src / "big.onnx").read_bytes()
    t0 = time.perf_counter()
    rc, out, err = run(capsys, ["build", src / "big.onnx", "-o", tmp_path / "out" / "t.onnx"])
    with capsys.disabled():
        print(f"\nbuild of a {BIG / 2**30:.2f} GiB model in {parts} tensor(s): {time.perf_counter() - t0:.1f} s")
    assert rc == 0, err
    assert all(f"W{k + 1}: gradient W{k + 1}_grad" in out for k in range(parts))
    assert _stat(src) == before and (src / "big.onnx").read_bytes() == stub
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t.onnx", "t.onnx.data"]
    training = onnx.load(str(tmp_path / "out" / "t.onnx"), load_external_data=False)
    ext = [{e.key: e.value for e in t.external_data} for t in training.graph.initializer if t.name.startswith("W")]
    assert [e["location"] for e in ext] == ["t.onnx.data"] * parts
    assert sum(int(e["length"]) for e in ext) == BIG
    assert (tmp_path / "out" / "t.onnx.data").stat().st_size == max(int(e["offset"]) + int(e["length"]) for e in ext)
    t0 = time.perf_counter()
    rc, out, err = run(capsys, ["split", tmp_path / "out" / "t.onnx", "-o", tmp_path / "parts"])
    with capsys.disabled():
        print(f"\nsplit: {time.perf_counter() - t0:.1f} s")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == [
        "backward.onnx", "forward.onnx", "forward.onnx.data", "manifest.json"]
