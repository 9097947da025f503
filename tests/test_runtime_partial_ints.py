"""runtime/partial_ints.py: every op evaluated computes what onnxruntime computes, shapes, types and elements alike,
and an element it calls known is the same whatever the unknown elements of its inputs hold."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from runtime.partial_ints import OPS, Value, evaluate

INT, BOOL = TensorProto.INT64, TensorProto.BOOL


def _ints(rng, shape, low=-6, high=7, nonzero=False):
    a = rng.integers(low, high, size=shape)
    return np.where(a == 0, 1, a) if nonzero else a


def _cases(rng):
    """(op, inputs, attributes, indices of inputs that must stay known: sizes, axes, indices, divisors)."""
    i = lambda *shape, **k: _ints(rng, shape, **k)  # noqa: E731
    b = lambda *shape: rng.random(shape) < 0.5  # noqa: E731
    yield from [(op, [i(2, 3), i(3)], {}, []) for op in ("Add", "Sub", "Mul")]
    yield from [(op, [i(2, 3, low=-40, high=40), i(2, 1, nonzero=True)], {}, [1]) for op in ("Div",)]
    yield "Mod", [i(4, 3, low=-40, high=40), i(3, nonzero=True)], {"fmod": 0}, [1]
    yield "Mod", [i(4, 3, low=-40, high=40), i(3, nonzero=True)], {"fmod": 1}, [1]
    yield from [(op, [i(3), i(1, 3), i()], {}, []) for op in ("Min", "Max")]
    yield from [(op, [i(5)], {}, []) for op in ("Neg", "Abs", "Identity")]
    yield from [(op, [i(2, 4, low=-2, high=3), i(4, low=-2, high=3)], {}, [])
                for op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual")]
    yield from [(op, [b(2, 3), b(3)], {}, []) for op in ("And", "Or", "Xor")]
    yield "Equal", [b(4), b(4)], {}, []
    yield "Not", [b(6)], {}, []
    yield "Where", [b(2, 3), i(3), i(2, 1)], {}, []
    yield "Cast", [b(5)], {"to": INT}, []
    yield "Cast", [i(5, low=-2, high=3)], {"to": BOOL}, []
    yield "Gather", [i(5), i(3, low=-5, high=5)], {"axis": 0}, [1]
    yield "Gather", [i(2, 4), i(low=-4, high=4)], {"axis": 1}, [1]
    yield "Gather", [i(3, 2), i(2, 2, low=-3, high=3)], {"axis": -2}, [1]
    for starts, ends, axes, steps in [([1], [4], [0], [1]), ([-1], [-(2 ** 63)], [0], [-1]), ([9], [-9], [1], [-2]),
                                      ([0, -2], [2 ** 62, 100], [1, 0], [2, 1]), ([4], [1], [0], [1])]:
        yield "Slice", [i(5, 3), np.array(starts), np.array(ends), np.array(axes), np.array(steps)], {}, [1, 2, 3, 4]
    yield "Slice", [i(6), np.array([-4]), np.array([5])], {}, [1, 2]
    yield "Unsqueeze", [i(2, 3), np.array([-1, 0])], {}, [1]
    yield "Unsqueeze", [i(), np.array([0])], {}, [1]
    yield "Squeeze", [i(1, 3, 1), np.array([2])], {}, [1]
    yield "Squeeze", [i(1, 3, 1)], {}, []
    yield "Squeeze", [i(1)], {}, []
    yield "Concat", [i(2, 1), i(2, 3)], {"axis": -1}, []
    yield "Concat", [b(2), b(1)], {"axis": 0}, []
    yield "Reshape", [i(6), np.array([-1, 2])], {}, [1]
    yield "Reshape", [i(2, 3), np.array([0, 3, 1])], {}, [1]
    yield "Reshape", [i(2, 3), np.array([3, 2])], {"allowzero": 1}, [1]
    yield "Transpose", [i(2, 3, 1)], {"perm": [2, 0, 1]}, []
    yield "Transpose", [i(2, 3)], {}, []
    yield "Expand", [i(3, 1), np.array([2, 1, 2])], {}, [1]
    yield "Expand", [i(1, 2), np.array([3, 1])], {}, [1]
    yield "Range", [np.array(-3), np.array(9), np.array(4)], {}, [0, 1, 2]
    yield "Range", [np.array(5), np.array(-4), np.array(-3)], {}, [0, 1, 2]
    yield "Range", [np.array(5), np.array(1), np.array(2)], {}, [0, 1, 2]
    yield "ConstantOfShape", [np.array([2, 3])], {"value": onnx.numpy_helper.from_array(np.array([7]))}, [0]
    yield "ConstantOfShape", [np.array([4])], {"value": helper.make_tensor("v", BOOL, [1], [True])}, [0]
    yield "ConstantOfShape", [np.array([2, 2])], {}, [0]
    f = lambda *shape, dtype=np.float32: (rng.standard_normal(shape) * 4).astype(dtype)  # noqa: E731
    yield from [(op, [f(2, 3), f(3)], {}, []) for op in ("Add", "Sub", "Mul", "Div", "Max")]
    yield from [(op, [f(5, dtype=np.float64)], {}, []) for op in ("Floor", "Ceil", "Neg", "Abs")]
    yield "Less", [f(4), f(1)], {}, []
    yield "Concat", [f(2), f(3)], {"axis": 0}, []
    yield "Where", [b(3), f(3), f(1)], {}, []
    yield from [("Cast", [f(5)], {"to": to}, []) for to in (INT, BOOL, TensorProto.DOUBLE)]
    yield "Cast", [i(4)], {"to": TensorProto.FLOAT}, []


def _run(op, inputs, attrs, n_outputs=1):
    names = [f"in{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, ["out"], **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                      for n, a in zip(names, inputs)], [helper.make_empty_tensor_value_info("out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return node, session.run(None, dict(zip(names, inputs)))[0]


CASES = list(_cases(np.random.default_rng(0)))


def test_every_op_evaluated_is_checked():
    assert {c[0] for c in CASES} | {"Shape", "Size"} == set(OPS)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_known_inputs_give_what_onnxruntime_computes(case):
    op, inputs, attrs, _ = CASES[case]
    node, want = _run(op, inputs, attrs)
    got = evaluate(node, {n: Value.of(a) for n, a in zip(node.input, inputs)}, {})
    assert got is not None and got.complete
    assert got.data.shape == want.shape and got.data.dtype == want.dtype
    np.testing.assert_array_equal(got.data, want)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_what_is_called_known_holds_whatever_the_unknown_elements_hold(case):
    """Some elements of the data inputs unknown, filled three ways: the known output elements match onnxruntime's
    every time, and the known-only ones are found (an unknown never leaks into an element it does not reach)."""
    op, inputs, attrs, fixed = CASES[case]
    rng = np.random.default_rng(case)
    masks = [np.ones(a.shape, bool) if k in fixed else rng.random(a.shape) < 0.6 for k, a in enumerate(inputs)]
    names = [f"in{k}" for k in range(len(inputs))]
    values = {n: Value(a, m) for n, a, m in zip(names, inputs, masks)}
    node = helper.make_node(op, names, ["out"], **attrs)
    got = evaluate(node, values, {})
    assert got is not None
    for _ in range(3):
        filled = [np.where(m, a, rng.random(a.shape) < 0.5 if a.dtype == bool else
                           _ints(rng, a.shape, nonzero=op in ("Div", "Mod") and k == 1)).astype(a.dtype)
                  for k, (a, m) in enumerate(zip(inputs, masks))]
        _, want = _run(op, filled, attrs)
        assert got.data.shape == want.shape
        np.testing.assert_array_equal(got.data[got.known], want[got.known])
    if all(m.all() for m in masks):
        assert got.complete


@pytest.mark.parametrize("op, attrs", [("Add", {}), ("Sub", {}), ("Mul", {}), ("Div", {}), ("Mod", {}),
                                       ("Mod", {"fmod": 1})])
def test_integer_arithmetic_over_every_sign_as_onnxruntime_computes_it(op, attrs):
    """Every pair of signs and zeros (Div truncates, Mod takes the divisor's sign, fmod the dividend's); a zero
    divisor unknown."""
    values = [-7, -3, -1, 0, 1, 2, 5, 9]
    pairs = np.array([(u, v) for u in values for v in values])
    a, b = pairs[:, 0], pairs[:, 1]
    keep = b != 0 if op in ("Div", "Mod") else np.ones_like(b, dtype=bool)
    _, want = _run(op, [a, np.where(keep, b, 1)], attrs)
    node = helper.make_node(op, ["a", "b"], ["c"], **attrs)
    got = OPS[op](node, [Value.of(a), Value.of(b)], {})  # 64 pairs: more than `evaluate` keeps
    assert got.known.tolist() == keep.tolist()
    np.testing.assert_array_equal(got.data[keep], want[keep])


def test_elements_decided_by_one_side_are_known():
    """A known False decides an And, a known True an Or, a known condition the Where's branch it takes; a zero
    divisor (onnxruntime refuses it) leaves the quotient unknown."""
    both = {"a": Value(np.array([False, True, True]), np.array([True, True, False])),
            "b": Value(np.array([True, True, True]), np.array([False, False, True]))}
    assert evaluate(helper.make_node("And", ["a", "b"], ["c"]), both, {}).known.tolist() == [True, False, False]
    assert evaluate(helper.make_node("Or", ["a", "b"], ["c"]), both, {}).known.tolist() == [False, True, True]
    picks = {"c": Value(np.array([True, False]), np.array([True, True])), "x": Value.partly([1, None]),
             "y": Value.partly([None, 2])}
    assert evaluate(helper.make_node("Where", ["c", "x", "y"], ["z"]), picks, {}).items() == [1, 2]
    zero = {"a": Value.of(np.array([6, 7])), "b": Value.of(np.array([2, 0]))}
    for op in ("Div", "Mod"):
        assert evaluate(helper.make_node(op, ["a", "b"], ["c"]), zero, {}).items()[1] is None


def test_shapes_read_known_dims_and_constants():
    dims = {"x": [None, 3, 5]}
    shape = helper.make_node("Shape", ["x"], ["s"], start=1)
    assert evaluate(shape, {}, dims).items() == [3, 5]
    assert evaluate(helper.make_node("Shape", ["x"], ["s"], end=-1), {}, dims).items() == [None, 3]
    assert evaluate(helper.make_node("Size", ["x"], ["s"]), {}, dims).items() == [None]
    assert evaluate(helper.make_node("Size", ["x"], ["s"]), {}, {"x": [2, 4]}).items() == [8]
    constant = {"k": Value.of(np.zeros((2, 3), dtype=np.int64))}  # a constant's dims, which inference does not list
    assert evaluate(helper.make_node("Shape", ["k"], ["s"]), constant, {}).items() == [2, 3]


def test_large_and_refused_results_are_not_values():
    big = {"t": Value.of(np.array([3, 5]))}
    fill = onnx.numpy_helper.from_array(np.array([1]))
    assert evaluate(helper.make_node("ConstantOfShape", ["t"], ["o"], value=fill), big, {}) is not None
    assert evaluate(helper.make_node("ConstantOfShape", ["t"], ["o"], value=fill),
                    {"t": Value.of(np.array([4, 5]))}, {}) is None  # 20 elements
    half = onnx.numpy_helper.from_array(np.array([1], dtype=np.float16))
    assert evaluate(helper.make_node("ConstantOfShape", ["t"], ["o"], value=half), big, {}) is None  # not evaluated
    bad = {"x": Value.of(np.arange(6)), "t": Value.of(np.array([4, -1]))}
    assert evaluate(helper.make_node("Reshape", ["x", "t"], ["o"]), bad, {}) is None  # 6 does not split by 4
    outside = {"x": Value.of(np.arange(3)), "i": Value.of(np.array([3]))}
    assert evaluate(helper.make_node("Gather", ["x", "i"], ["o"]), outside, {}) is None
