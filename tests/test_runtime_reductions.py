"""runtime.reductions: sums rewritten into MatMuls with ones, scatters into other terms, placements into Concats,
contractions over rows with their transpose made first, with the same values."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime import lowering
from runtime.ort_session import SessionConfig
from runtime.reductions import leading_sums_as_products, placements_into_concats, rows_untransposed, scatters_into_sums
from runtime.session import TrainingSession


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


def _scatter_sum_model(a_dims: list[int], table: list[int], op: str = "ScatterElements") -> onnx.ModelProto:
    """g = a + Scatter(zeros(table), rows, updates, add): an embedding table's gradient beside a tied head's (the
    builder's ScatterElements, or a ScatterND as other producers write it)."""
    elements = op == "ScatterElements"
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims),
              helper.make_tensor_value_info("rows", TensorProto.INT64, ["n", table[1] if elements else 1]),
              helper.make_tensor_value_info("u", TensorProto.FLOAT, ["n", table[1]])]
    out = helper.make_tensor_value_info("g", TensorProto.FLOAT, table)
    shape = numpy_helper.from_array(np.array(table, np.int64), "shape")
    axis = {"axis": 0} if elements else {}
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
             helper.make_node(op, ["zeros", "rows", "u"], ["s"], reduction="add", **axis),
             helper.make_node("Sum", ["a", "s"], ["g"])]
    graph = helper.make_graph(nodes, "g", inputs, [out], initializer=[shape])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_scatter_into_sum(op: str) -> None:
    model = _scatter_sum_model([5, 3], [5, 3], op)
    out = scatters_into_sums(model)
    assert _ops(out) == [op] and out.graph.node[0].input[0] == "a"
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(0)
    rows = np.array([[1], [4], [1]])
    feeds = {"a": rng.standard_normal((5, 3)).astype(np.float32),
             "rows": np.repeat(rows, 3, 1) if op == "ScatterElements" else rows,
             "u": rng.standard_normal((3, 3)).astype(np.float32)}
    want = feeds["a"].copy()
    np.add.at(want, rows[:, 0], feeds["u"])
    for m in (model, out):
        got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_scatter_into_broadcast_sum_left_alone() -> None:
    model = _scatter_sum_model([1, 3], [5, 3])  # the Sum broadcasts a; a scatter into it would not
    assert scatters_into_sums(model) is model


def _rows_model(n: int | str, rows: list[int]) -> onnx.ModelProto:
    """loss = sum_k <x[rows[k]], c_k>: Gathers of constant rows of x [n, 4], whose gradient puts c_k at each row."""
    f = TensorProto.DOUBLE
    nodes, inits, terms = [], [], []
    for k, row in enumerate(rows):
        inits += [numpy_helper.from_array(np.array(row, np.int64), f"i{k}"),
                  numpy_helper.from_array(np.arange(4, dtype=np.float64) + 10 * k + 1, f"c{k}")]
        nodes += [helper.make_node("Gather", ["x", f"i{k}"], [f"r{k}"], axis=0),
                  helper.make_node("Mul", [f"r{k}", f"c{k}"], [f"t{k}"])]
        terms.append(f"t{k}")
    nodes += [helper.make_node("Sum", terms, ["s"]), helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "rows", [helper.make_tensor_value_info("x", f, [n, 4])],
                              [helper.make_tensor_value_info("loss", f, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("n", "rows", "joined"), [
    ("n", [2, 0, 1], True),   # q, k, v of a packed projection: run-time length, padded after the Concat
    (3, [1, 2, 0], True),     # static length: a bare Concat
    ("n", [0, 2], False),     # a gap: the placements stay
    (3, [0, 1], False),       # static length not covered
])
def test_placements_into_concat(n: int | str, rows: list[int], joined: bool) -> None:
    """The Gather rule's placements of constant rows, summed, become one Concat when they cover rows 0..k-1 (and
    the whole axis when its length is static); the gradient is the same, extra rows getting zeros."""
    config = SessionConfig(threads=1)
    session = TrainingSession.from_forward(_rows_model(n, rows), wrt=["x"], loss="loss", config=config)
    backward = session.full.backward
    out = placements_into_concats(backward)
    assert (out is not backward) == joined
    ops = [node.op_type for node in out.graph.node]
    if joined:
        assert "Concat" in ops and ops.count("Pad") == (1 if n == "n" else 0)
    for size in [3, 5] if n == "n" else [3]:
        x = np.random.default_rng(size).standard_normal([size, 4])
        _, state = session.forward({"x": x})
        got = session.backward(state, [None])["x"]
        want = np.zeros([size, 4])
        for k, row in enumerate(rows):
            want[row] += np.arange(4) + 10 * k + 1
        np.testing.assert_array_equal(got, want)


def _rows_product_model(a_dims: list[int | str], b_dims: list[int | str], **attrs: int | float) -> onnx.ModelProto:
    """Gemm(a, b, transA=1) as the weight-gradient rules emit it (a: dY [K, M], b: the layer input [K, N])."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in (("a", a_dims), ("b", b_dims))]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", "n_out"])
    graph = helper.make_graph([helper.make_node("Gemm", ["a", "b"], ["y"], transA=1, **attrs)], "g", ins, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("rows", "columns", "attrs", "applies"), [
    ("n", 800, {}, True),              # the runtime's backward: the batch symbolic
    (128, 768, {}, True),
    (32, 800, {}, False),              # too few rows: the transpose costs more than it saves
    ("n", 512, {}, False),             # too few columns
    ("n", 800, {"transB": 1}, False),
    ("n", 800, {"alpha": 2.0}, False),
])
def test_rows_untransposed(rows: int | str, columns: int, attrs: dict, applies: bool, tmp_path) -> None:
    """a^T b with a transposed first, by a 3-D Transpose that onnxruntime keeps (it would fold a 2-D one back into
    the product, which is what is slow): same values, and the optimized session runs the Transpose and a plain
    MatMul."""
    b_dims = [rows, columns] if not attrs.get("transB") else [columns, rows]
    model = _rows_product_model([rows, 6], b_dims, **attrs)
    out = rows_untransposed(model)
    assert (out is not model) == applies
    if not applies:
        return
    assert _ops(out) == ["Reshape", "Transpose", "Reshape", "MatMul"] and out.graph.output[0].name == "y"
    onnx.checker.check_model(out, full_check=True)
    k = 128 if rows == "n" else rows
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((k, 6)).astype(np.float32),
             "b": rng.standard_normal((k, columns)).astype(np.float32)}
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    got = ort.InferenceSession(out.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, feeds["a"].T.astype(np.float64) @ feeds["b"], rtol=1e-4, atol=1e-4)
    assert "Transpose" in _ops(onnx.load(options.optimized_model_filepath))


def test_rows_untransposed_in_a_training_session() -> None:
    """A Linear of 800 inputs as torch exports it (Gemm with transB): its weight gradient dY^T x is lowered with
    the transpose made first, and the gradients are the same as numpy's in float64."""
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((6, 800)).astype(np.float32), "w")
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], transB=1), helper.make_node("Mul", ["h", "h"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", f, ["n", 800])],
                              [helper.make_tensor_value_info("loss", f, [])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = SessionConfig(threads=1)
    session = TrainingSession.from_forward(model, wrt=["w"], loss="loss", config=config)
    lowered = lowering.backward(session.full.backward, {}, config)
    assert [list(n.attribute[0].ints) for n in lowered.graph.node if n.op_type == "Transpose"] == [[1, 0, 2]]
    x = np.random.default_rng(0).standard_normal((128, 800)).astype(np.float32)
    _, state = session.forward({"x": x})
    got = session.backward(state, [None])["w"]
    x64, w64 = x.astype(np.float64), numpy_helper.to_array(w).astype(np.float64)
    np.testing.assert_allclose(got, 2 * (x64 @ w64.T).T @ x64, rtol=1e-4, atol=1e-3)


def test_batch_norm_sums_over_the_batch_as_products() -> None:
    """A training BatchNorm1d's gradient sums over the batch read its statistics, which the runtime's export
    returns as outputs: declared with their sizes, so that shape inference in the backward knows the summed
    tensors' widths and every sum over the batch (the statistics' terms, the biases' gradients behind the ReLU's
    guarded select) becomes a product with ones; the gradients stay torch's."""
    import torch
    from torch import nn

    from runtime import ORTModule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.ReLU(),
                          nn.BatchNorm1d(16), nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, threads=1)
    x = torch.randn(8, 12)
    for m in (wrapped, reference):
        m(x).square().sum().backward()
    for p, q in zip(wrapped.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    [session] = wrapped.training_sessions()
    [bw] = session._backwards.values()
    lowered = lowering.backward(bw.program.backward, {k: v.numpy() for k, v in bw.consts.items()}, session.config,
                                session.rows)
    sums = [n for n in lowered.graph.node if n.op_type == "ReduceSum"]
    assert all(len(n.input) == 1 and next((a.i for a in n.attribute if a.name == "keepdims"), 1) == 0
               for n in sums), [n.name for n in sums]  # whole-tensor sums only (a guard, the loss's count)
