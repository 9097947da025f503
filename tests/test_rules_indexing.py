import harness
import numpy as np
import onnx
import pytest
import torch
from harness import check_op, sweep_tests
from test_rules_shape import check_dynamic

import gradbuilder

rng = np.random.default_rng(0)

OLD, NEW = 13, 16  # before/after ScatterND/ScatterElements learned reduction="add": one-hot MatMul vs scatter-add


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


def idx(values, dtype=np.int64):
    return np.array(values, dtype=dtype)


def _torch_gather(x, index, axis):
    """ONNX Gather: x[..., index, ...] at `axis`; torch advanced indexing wraps negative indices the same way."""
    return x[(slice(None),) * (axis % x.dim()) + (torch.as_tensor(index),)]


GATHERS = [
    ((5, 3), [[0, 4, -1, 0], [2, 2, 0, -5]], 0),  # the embedding case, duplicates and negative indices
    ((2, 5, 3), [[1, -1], [1, 0]], 1),
    ((2, 3, 4), [3, 0, 3], -1),
    ((4, 3), 2, 0),  # scalar index
    ((2, 4, 3), -2, 1),
    ((6, 0), [2, 0], 0),  # nothing after the axis: a Reshape to [-1, 0] was refused (runtime fuzz replay)
    ((0, 2, 3), [[1, 0]], 1),
]


@pytest.mark.parametrize("shape,index,axis", GATHERS)
@pytest.mark.parametrize("opset", [OLD, NEW, 18])
def test_gather(shape, index, axis, opset):
    check_op("Gather", [("x", r(*shape)), ("i", idx(index))], lambda x: _torch_gather(x, index, axis),
             consts=["i"], opset=opset, axis=axis)


@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_runtime_int32_indices(opset):
    index = [[1, -1, 1], [0, 0, 2]]
    check_op("Gather", [("x", r(3, 4)), ("i", idx(index, np.int32))], lambda x, i: _torch_gather(x, index, 1),
             opset=opset, axis=1)


@pytest.mark.parametrize("shape,index,axis", [((4, 0), 1, 0), ((3, 0, 2), [1, 2], 0), ((2, 3, 0), [[0], [2]], 1)])
@pytest.mark.parametrize("opset", [OLD, NEW, 18])
def test_gather_of_an_empty_tensor_by_run_time_indices(shape, index, axis, opset):
    """A size of 0 beside the gathered axis (runtime replay seed 61): the gradient's Reshape took that 0 for "copy
    the input's size" (no allowzero) and failed, or made another shape; where the index is no constant. Known when
    building, then sized at run time (allowzero: opset 14 on)."""
    check_op("Gather", [("x", r(*shape)), ("i", idx(index))], lambda x, i: _torch_gather(x, index, axis),
             opset=opset, axis=axis)
    if opset >= 14:
        check_dynamic({"x": list(range(len(shape)))}, "Gather", [("x", r(*shape)), ("i", idx(index))],
                      lambda x, i: _torch_gather(x, index, axis), opset=opset, axis=axis)

@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_dynamic(opset):
    index = [[0, 2, -1], [1, 1, 0]]
    check_dynamic({"x": [0, 1, 2]}, "Gather", [("x", r(2, 4, 3)), ("i", idx(index))],
                  lambda x, i: _torch_gather(x, index, 1), opset=opset, axis=1)
    check_dynamic({"x": [0], "i": [0, 1]}, "Gather", [("x", r(5, 3)), ("i", idx(index))],
                  lambda x, i: _torch_gather(x, index, 0), opset=opset, axis=0)


def test_gather_adjoint_adds_repeated_rows_in_order_on_threads():
    """Rows read many times (an embedding's repeated tokens: BERT's token types, padding) are added by one
    ScatterElements, in index order, whatever onnxruntime's threads: its ScatterND split the updates among them and
    lost some or added them in another order, differently at each run (off by up to 51 on a quiet machine)."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((3, 256)).astype(np.float32)
    index = np.zeros(4096, np.int64)
    index[::7] = 2
    model = harness.single_op_model("Gather", [("x", table), ("i", index)], opset=NEW)
    training = gradbuilder.build_gradient_graph(model, wrt=["x"])
    ops = [n.op_type for n in training.graph.node]
    assert "ScatterElements" in ops and "ScatterND" not in ops and "MatMul" not in ops and "Transpose" not in ops
    dy = rng.standard_normal((4096, 256)).astype(np.float32)
    want = np.zeros_like(table)
    np.add.at(want, index, dy)  # one update after the other, in float32
    trainer = harness.Trainer(training, threads=4)
    for _ in range(10):
        np.testing.assert_array_equal(trainer.step({"x": table, "i": index}, [dy])[1]["x"], want)


# --- GatherElements --------------------------------------------------------------------------------------
GATHER_ELEMENTS = [
    ((3, 4), [[0, 3, 3, -1], [1, 1, 1, 1]], 1),  # fewer rows than the data, duplicates, negative
    ((3, 4), [[2, 0], [2, -3]], 0),
    ((2, 3, 4), np.array([[[1, 0], [2, 2]], [[0, -1], [1, 1]]]), -2),
]


@pytest.mark.parametrize("shape,index,axis", GATHER_ELEMENTS)
@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_elements(shape, index, axis, opset):
    index = np.asarray(index, dtype=np.int64)
    d = shape[axis]
    check_op("GatherElements", [("x", r(*shape)), ("i", index)],
             lambda x: torch.gather(x, axis, torch.from_numpy(index % d)), consts=["i"], opset=opset, axis=axis)


@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_elements_dynamic(opset):
    index = np.array([[0, 3, 3], [1, -1, 1]], dtype=np.int64)
    check_dynamic({"x": [0, 1], "i": [1]}, "GatherElements", [("x", r(3, 4)), ("i", index)],
                  lambda x, i: torch.gather(x, 1, torch.from_numpy(index % 4)), opset=opset, axis=1)


# --- GatherND --------------------------------------------------------------------------------------------
def _torch_gather_nd(x, index, batch_dims):
    index = np.asarray(index)
    if batch_dims == 0:
        return x[tuple(torch.from_numpy(index[..., j]) for j in range(index.shape[-1]))]
    return torch.stack([_torch_gather_nd(x[b], index[b], batch_dims - 1) for b in range(x.shape[0])])


GATHER_ND = [
    ((4, 3), [[1, 2], [1, 2], [-1, 0]], 0),  # full index tuples, one repeated
    ((4, 3, 2), [[[1], [-1]], [[1], [0]]], 0),  # partial: rows
    ((2, 4, 3), [[[1, 0], [1, 0]], [[3, -1], [0, 2]]], 1),  # batch_dims=1
    ((2, 3, 4, 2), [[[2], [0]], [[1], [1]]], 1),
    ((2, 3, 4), [[2, -1], [0, 1]], 1),  # one tuple per batch entry
    ((2, 2, 3, 4), [[[1, 2], [0, 0]], [[1, 1], [0, 0]]], 2),  # batch_dims=2
]


@pytest.mark.parametrize("shape,index,batch_dims", GATHER_ND)
@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_nd(shape, index, batch_dims, opset):
    check_op("GatherND", [("x", r(*shape)), ("i", idx(index))], lambda x: _torch_gather_nd(x, index, batch_dims),
             consts=["i"], opset=opset, batch_dims=batch_dims)


@pytest.mark.parametrize("opset", [OLD, NEW])
def test_gather_nd_dynamic(opset):
    index = [[[1, 0], [1, 0]], [[3, -1], [0, 2]]]
    check_dynamic({"x": [0, 1, 2], "i": [0, 1]}, "GatherND", [("x", r(2, 4, 3)), ("i", idx(index))],
                  lambda x, i: _torch_gather_nd(x, index, 1), opset=opset, batch_dims=1)


# --- scatters --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [13, 18])
def test_scatter_nd(opset):
    index = idx([[2], [0], [-1]])  # -1 is row 4; distinct rows, as reduction 'none' needs
    fn = lambda x, i, u: x.index_put((torch.tensor([2, 0, 4]),), u)  # noqa: E731
    check_op("ScatterND", [("x", r(5, 3)), ("i", index), ("u", r(3, 3))], fn, opset=opset)
    check_op("ScatterND", [("x", r(5, 3)), ("i", index), ("u", r(3, 3))], fn, opset=opset, wrt=["u"])
    pairs = idx([[1, 2], [0, 0]])
    check_op("ScatterND", [("x", r(2, 3)), ("i", pairs), ("u", r(2))],
             lambda x, i, u: x.index_put((torch.tensor([1, 0]), torch.tensor([2, 0])), u), opset=opset, wrt=["x"])


def test_scatter_nd_add():
    index = idx([[2], [0], [2]])
    check_op("ScatterND", [("x", r(5, 3)), ("i", index), ("u", r(3, 3))],
             lambda x, i, u: x.index_put((torch.tensor([2, 0, 2]),), u, accumulate=True), opset=16,
             reduction="add")


@pytest.mark.parametrize("reduction", ["max", "min"])
@pytest.mark.parametrize("ties", [False, True])
def test_scatter_max_min(reduction, ties):
    """ScatterElements and ScatterND reducing by max or min (opset 18) against torch's scatter_reduce amax/amin
    (include_self): the gradient goes to data or the updates where they equal the result, shared among ties (an
    update equal to data, two equal updates; finite differences only away from ties, where the function has kinks)."""
    x, u = r(5, 3), r(4, 3)
    rows = np.array([2, 0, 2, 4])
    if ties:
        u[0] = x[2]  # an update equal to data where it lands
        u[2, 1] = u[0, 1]  # two equal updates to one element
    index = np.repeat(rows[:, None], 3, axis=1)
    amode = {"max": "amax", "min": "amin"}[reduction]
    fn = lambda x, u: torch.scatter_reduce(x, 0, torch.from_numpy(index), u, amode)  # noqa: E731
    check_op("ScatterElements", [("x", x), ("i", index), ("u", u)], fn, consts=["i"], opset=18, axis=0,
             reduction=reduction, fd=not ties)
    check_op("ScatterND", [("x", x), ("i", idx(rows[:, None].tolist())), ("u", u)], fn, consts=["i"], opset=18,
             reduction=reduction, fd=not ties)


def test_scatter_nd_mul_is_refused():
    model = harness.single_op_model("ScatterND", [("x", r(5, 3)), ("i", idx([[2]])), ("u", r(1, 3))], opset=16,
                                    reduction="mul")
    with pytest.raises(gradbuilder.GradBuilderError, match="reduction='mul'"):
        gradbuilder.build_gradient_graph(model, wrt=["x"])


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("opset", [13, 18])
def test_scatter_elements(axis, opset):
    index = np.array([[1, 0, 2], [2, 1, -3]], dtype=np.int64)  # distinct along every axis
    norm = torch.from_numpy(index % 3)
    check_op("ScatterElements", [("x", r(3, 3)), ("i", index), ("u", r(2, 3))],
             lambda x, u: torch.scatter(x, axis, norm, u), consts=["i"], opset=opset, axis=axis)


def test_scatter_elements_add_dynamic():
    index = np.array([[1, 1, 0], [0, 1, 1]], dtype=np.int64)
    check_dynamic({"x": [0, 1], "u": [1]}, "ScatterElements", [("x", r(2, 3)), ("i", index), ("u", r(2, 3))],
                  lambda x, i, u: torch.scatter_add(x, 1, torch.from_numpy(index), u), opset=18, axis=1,
                  reduction="add")


# --- TopK ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("largest", [0, 1])
def test_topk(axis, largest):
    x = rng.permutation(60).reshape(3, 4, 5) / 7.0  # distinct values: no ties
    check_op("TopK", [("x", x), ("k", idx([2]))],
             lambda x: torch.topk(x, 2, dim=axis, largest=bool(largest)), n_out=2, diff_outputs=[0], consts=["k"],
             axis=axis, largest=largest)


def test_topk_dynamic():
    x = rng.permutation(12).reshape(3, 4) / 5.0
    check_dynamic({"x": [0, 1]}, "TopK", [("x", x), ("k", idx([3]))], lambda x, k: torch.topk(x, 3, dim=-1),
                  n_out=2, diff_outputs=[0])


# --- every opset, float32 ---------------------------------------------------------------------------------
def _sweep(opset, dtype):
    x = np.asarray(rng.permutation(24).reshape(2, 3, 4) / 10.0, dtype=dtype)
    index = [[0, 2], [2, -1]]
    for axis in (0, 1):
        check_op("Gather", [("x", x), ("i", idx([1, -1, 1]))], lambda x, axis=axis: _torch_gather(x, [1, -1, 1], axis),
                 consts=["i"], opset=opset, axis=axis)
    check_op("Gather", [("x", np.asarray(x[0, 0])), ("i", idx(index))], lambda x: _torch_gather(x, index, 0),
             consts=["i"], opset=opset)  # rank-1 data
    ge = np.array([[[1, 0, 2, 2]], [[0, 0, 1, -1]]], dtype=np.int64)
    check_op("GatherElements", [("x", x), ("i", ge)], lambda x: torch.gather(x, 1, torch.from_numpy(ge % 3)),
             consts=["i"], opset=opset, axis=1)
    nd = [[[1, 0], [1, 0]], [[2, -1], [0, 2]]]
    check_op("GatherND", [("x", x), ("i", idx(nd))], lambda x: _torch_gather_nd(x, nd, 1), consts=["i"],
             opset=opset, batch_dims=1)
    check_op("ScatterND", [("x", x), ("i", idx([[1], [0]])), ("u", np.asarray(x[::-1] + 1, dtype=dtype))],
             lambda x, u: x.index_put((torch.tensor([1, 0]),), u), consts=["i"], opset=opset)
    se = np.array([[[1, 0, 2, 2]], [[0, 2, 1, 0]]], dtype=np.int64)
    check_op("ScatterElements", [("x", x), ("i", se), ("u", np.asarray(x[:, :1], dtype=dtype) + 1)],
             lambda x, u: torch.scatter(x, 1, torch.from_numpy(se), u), consts=["i"], opset=opset, axis=1)
    check_op("TopK", [("x", x), ("k", idx([2]))], lambda x: torch.topk(x, 2, dim=1), n_out=2, diff_outputs=[0],
             consts=["k"], opset=opset, axis=1)


test_every_opset, test_float32 = sweep_tests(_sweep, float32_opsets=(14, 18))


@pytest.mark.parametrize("opset", [OLD, NEW])
def test_float16(opset):
    """16-bit floats are scatter-added in float32 (onnxruntime's CPU has no float16 ScatterElements add)."""
    x = r(2, 3, 4).astype(np.float16)
    kw = {"rtol": 1e-2, "atol": 1e-2, "fd": False, "opset": opset}
    check_op("Gather", [("x", x), ("i", idx([1, 1, 0]))], lambda x: x[:, [1, 1, 0]], consts=["i"], axis=1, **kw)
    ge = np.array([[[1, 0, 2, 2]], [[0, 0, 1, -1]]], dtype=np.int64)
    check_op("GatherElements", [("x", x), ("i", ge)], lambda x: torch.gather(x, 1, torch.from_numpy(ge % 3)),
             consts=["i"], axis=1, **kw)
    nd = [[1, 0], [1, 0], [0, 2]]
    check_op("GatherND", [("x", x), ("i", idx(nd))], lambda x: _torch_gather_nd(x, nd, 0), consts=["i"], **kw)


@pytest.mark.parametrize("elem", [onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16])
def test_constant_position_padded_into_place(elem):
    """A scalar constant index: the gradient pads the slice into place (one Pad), except for bfloat16, which
    onnxruntime's CPU Pad does not take (the scatter-add then)."""
    h = onnx.helper
    nodes = [h.make_node("Constant", [], ["i"], value=h.make_tensor("i", onnx.TensorProto.INT64, [], [1])),
             h.make_node("Gather", ["x", "i"], ["y"], axis=0)]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", elem, [3, 4])],
                         [h.make_tensor_value_info("y", elem, [4])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y"])
    ops = {n.op_type for n in training.graph.node}
    assert ("Pad" in ops) == (elem == onnx.TensorProto.FLOAT) and ("ScatterElements" in ops) != ("Pad" in ops)
