"""runtime/passes.py: the stash shrinks (rematerialized inputs, boolean masks) and the Where lowering keep the
gradients, and keep a Where that guards a singular expression."""

import copy

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from torch import nn

from runtime import ORTModule, passes
from runtime.ort_session import SessionConfig
from runtime.session import TrainingSession


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x, y):
        h = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2).flatten(1)
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(h))), y)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 1, 8, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


def test_gradients_match_torch_with_every_pass():
    torch.manual_seed(0)
    model = ConvNet()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    x, y = _batch()
    ort(x, y).backward()
    reference(x, y).backward()
    for p, q in zip(ort.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_stash_keeps_masks_and_no_input_copies():
    torch.manual_seed(0)
    ort = ORTModule(ConvNet(), threads=1)
    x, y = _batch()
    ort(x, y).backward()
    session = ort.training_sessions()[0]
    forward = session.full.forward
    types = {o.name: o.type.tensor_type.elem_type for o in forward.graph.output}
    stash = [e.name for e in session.full.manifest.backward_inputs if e.role == "stash"]
    made_by = {o: n.op_type for n in forward.graph.node for o in n.output}
    # the pre-pool Relu output is read only by its mask: a bool is stashed instead
    assert any(types[n] == TensorProto.BOOL for n in stash)
    assert not any(made_by.get(n) == "Relu" and types[n] == TensorProto.FLOAT and "conv" in n for n in stash)
    # nothing stashed is a cheap function of the feeds alone (the reshaped labels): backward recomputes it
    free = {i.name for i in forward.graph.input} | {t.name for t in forward.graph.initializer}
    for n in forward.graph.node:
        if n.op_type in passes.CHEAP and all(not i or i in free for i in n.input):
            free.update(n.output)
    assert not free & set(stash)


def _where_model() -> onnx.ModelProto:
    f = TensorProto.FLOAT
    zero = helper.make_tensor("zero", f, [], [0.0])
    nodes = [helper.make_node("MatMul", ["a", "b"], ["m"]),
             helper.make_node("Where", ["c", "m", "zero"], ["masked"]),
             helper.make_node("Div", ["a", "b2"], ["d"]),
             helper.make_node("Where", ["c", "d", "zero"], ["guarded"])]
    graph = helper.make_graph(nodes, "w", [helper.make_tensor_value_info("a", f, [2, 2]),
                                           helper.make_tensor_value_info("b", f, [2, 2]),
                                           helper.make_tensor_value_info("b2", f, [2, 2]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [2, 2])],
                              [helper.make_tensor_value_info("masked", f, [2, 2]),
                               helper.make_tensor_value_info("guarded", f, [2, 2])], [zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_lower_multiplies_linear_maps_and_keeps_guards():
    lowered = passes.lower(_where_model())
    ops = {n.output[0]: n.op_type for n in lowered.graph.node}
    assert ops["masked"] == "Mul" and ops["guarded"] == "Where"
    import onnxruntime as ort

    feeds = {"a": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.eye(2, dtype=np.float32),
             "b2": np.array([[0.0, 1.0], [1.0, 0.0]], np.float32), "c": np.array([[False, True], [True, False]])}
    want = ort.InferenceSession(_where_model().SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(lowered.SerializeToString()).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)  # the guarded Div's inf stays masked


def test_passes_can_be_switched_off():
    torch.manual_seed(0)
    model = ConvNet()
    x, y = _batch()
    ort = ORTModule(model, threads=1)
    ort(x, y).backward()
    source = ort.training_sessions()[0].source
    plain = TrainingSession.from_forward(source, wrt=[i.name for i in source.graph.input if "." in i.name],
                                         loss="output", config=SessionConfig(threads=1, shrink=False, lower=False))
    stash = [e.name for e in plain.full.manifest.backward_inputs if e.role == "stash"]
    types = {o.name: o.type.tensor_type.elem_type for o in plain.full.forward.graph.output}
    assert not any(types[n] == TensorProto.BOOL for n in stash)


def test_dropout_output_recomputed_from_its_mask():
    """softmax -> Dropout -> MatMul: backward needs the dropped probabilities; it recomputes them from the
    softmax output and the mask it keeps anyway, and the gradients are those of that mask."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("Dropout", ["p", "ratio", "train"], ["d", "mask"]),
             helper.make_node("MatMul", ["d", "w2"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "drop", [helper.make_tensor_value_info(n, f, s) for n, s in
                                              (("x", [6, 4]), ("w1", [4, 5]), ("w2", [5, 3]))],
                              [helper.make_tensor_value_info("loss", f, [])],
                              [helper.make_tensor("ratio", f, [], [0.3]),
                               helper.make_tensor("train", TensorProto.BOOL, [], [True])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = TrainingSession.from_forward(model, wrt=["w1", "w2"], loss="loss", config=SessionConfig(threads=1))
    stash = {e.name for e in session.full.manifest.backward_inputs if e.role == "stash"}
    assert "d" not in stash and {"p", "mask"} <= stash
    rng = np.random.default_rng(0)
    x, w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (4, 5), (5, 3)))
    _, state = session.forward({"x": x, "w1": w1, "w2": w2})
    mask = torch.from_numpy(np.from_dlpack(state.values["mask"]).copy())
    grads = session.backward(state, [None])
    tw1, tw2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
    p = torch.softmax(torch.tensor(x) @ tw1, -1)
    ((p * mask / 0.7) @ tw2).sum().backward()
    np.testing.assert_allclose(grads["w1"], tw1.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["w2"], tw2.grad.numpy(), rtol=1e-5, atol=1e-6)
