"""runtime/passes.py: the stash shrinks (rematerialized inputs, boolean masks) and the Where lowering keep the
gradients, and keep a Where that guards a singular expression; Dropouts that drop nothing go."""

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from parity import check_parity
from torch import nn

import gradbuilder
from runtime import ORTModule, fused, passes
from runtime.exchange import to_numpy, to_ortvalue
from runtime.ort_session import Runner, SessionConfig
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


def _stepped() -> tuple[ConvNet, ConvNet, ORTModule, torch.Tensor, torch.Tensor]:
    """ConvNet, a torch copy and the ORTModule on the first, after one ORTModule step on `_batch()`."""
    torch.manual_seed(0)
    model = ConvNet()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    x, y = _batch()
    ort(x, y).backward()
    return model, reference, ort, x, y


def test_gradients_match_torch_with_every_pass():
    _, reference, ort, x, y = _stepped()
    reference(x, y).backward()
    for p, q in zip(ort.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class PooledNet(nn.Module):
    """A Relu read only by a global average pool, whose gradient does not read its input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(torch.relu(self.conv(x)).mean((2, 3))), y)


def _stash(model: nn.Module) -> tuple[onnx.ModelProto, list[str]]:
    """The forward graph of `model`'s training session after one step on `_batch()`, and what it stashes."""
    torch.manual_seed(0)
    ort = ORTModule(model, threads=1)
    x, y = _batch()
    ort(x, y).backward()
    session = ort.training_sessions()[0]
    return session.full.forward, [e.name for e in session.full.manifest.backward_inputs if e.role == "stash"]


def test_stash_keeps_masks():
    forward, stash = _stash(PooledNet())
    types = {o.name: o.type.tensor_type.elem_type for o in forward.graph.output}
    made_by = {o: n.op_type for n in forward.graph.node for o in n.output}
    # the Relu output is read in backward only by its mask: a bool is stashed instead
    assert any(types[n] == TensorProto.BOOL for n in stash)
    assert not any(made_by.get(n) == "Relu" and types[n] == TensorProto.FLOAT for n in stash)


def test_stash_keeps_no_views_and_no_input_copies():
    forward, stash = _stash(ConvNet())
    made_by = {o: n for n in forward.graph.node for o in n.output}
    # fc1 reads the pooled Relu output through a Flatten: backward keeps the Relu output and flattens it itself,
    # so the forward's Flatten is no graph output (onnxruntime would copy it); the Relu's mask comes from it too
    # (4 bytes an element kept instead of a float view and a bool mask)
    views = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}
    assert not any(made_by[n].op_type in views for n in stash if n in made_by)
    [flatten] = [n for n in forward.graph.node if n.op_type == "Flatten"]
    assert flatten.input[0] in stash and made_by[flatten.input[0]].op_type == "Relu"
    assert not any(o.type.tensor_type.elem_type == TensorProto.BOOL for o in forward.graph.output if o.name in stash)
    # nothing stashed is a cheap function of the feeds alone (the reshaped labels): backward recomputes it
    free = {i.name for i in forward.graph.input} | {t.name for t in forward.graph.initializer}
    for n in forward.graph.node:
        if n.op_type in passes.CHEAP and all(not i or i in free for i in n.input):
            free.update(n.output)
    assert not free & set(stash)


class SeqNet(nn.Module):
    """Logits reshaped for the loss to a target the export computes from their shape at run time, then squared:
    the square's backward reads the view (the loss's own reads its log-probabilities)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens, y):
        logits = self.head(torch.tanh(self.emb(tokens)))
        flat = logits.reshape(-1, logits.shape[-1])
        return nn.functional.cross_entropy(flat * flat, y.reshape(-1))


def test_a_view_with_a_run_time_target_is_redone_in_backward():
    torch.manual_seed(0)
    model = SeqNet()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    g = torch.Generator().manual_seed(0)
    for batch in (3, 4):  # one session, a symbolic batch
        tokens, y = torch.randint(0, 20, (batch, 6), generator=g), torch.randint(0, 5, (batch, 6), generator=g)
        for m in (ort, reference):
            m.zero_grad()
            m(tokens, y).backward()
        for p, q in zip(ort.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    session = ort.training_sessions()[0]
    forward = session.full.forward
    made_by = {o: n.op_type for n in forward.graph.node for o in n.output}
    types = {o.name: o.type.tensor_type.elem_type for o in forward.graph.output}
    stash = [e.name for e in session.full.manifest.backward_inputs if e.role == "stash"]
    # the logits are kept as the Linear made them; neither their reshaped view nor its int64 target is kept
    assert not any(made_by.get(n) == "Reshape" or types[n] == TensorProto.INT64 for n in stash)
    assert any(n.endswith("head/Add_output_0") or made_by.get(n) in ("Add", "Gemm", "MatMul") for n in stash)


def test_group_norm_keeps_no_view():
    """torch exports GroupNorm as Reshape -> InstanceNormalization -> Reshape (to the input's Shape); backward
    keeps the normalized tensor and views it itself: the second Reshape's target is the Shape of a tensor kept
    only once the first Reshape's source is (a second round of the view search)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 36, 3))
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 3, (5,))
    for m in (ort, reference):
        nn.functional.cross_entropy(m(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    session = ort.training_sessions()[0]
    made_by = {o: n.op_type for n in session.full.forward.graph.node for o in n.output}
    stash = [e.name for e in session.full.manifest.backward_inputs if e.role == "stash"]
    assert not any(made_by.get(n) == "Reshape" for n in stash), stash


def _where_model() -> onnx.ModelProto:
    """Wheres over a product, a mean's gradient (a product's column sums over a count, spread back), the same
    over a count that may be zero, and a division."""
    f = TensorProto.FLOAT
    zero = helper.make_tensor("zero", f, [], [0.0])
    count = helper.make_tensor("count", f, [], [2.0])
    maybe = helper.make_tensor("maybe", f, [2], [2.0, 0.0])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 2])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    nodes = [helper.make_node("MatMul", ["a", "b"], ["m"]),
             helper.make_node("Where", ["c", "m", "zero"], ["masked"]),
             helper.make_node("ReduceSum", ["m", "axes"], ["s"]),
             helper.make_node("MatMul", ["s", "b"], ["sb"]),
             helper.make_node("Div", ["sb", "count"], ["mean"]),
             helper.make_node("Expand", ["mean", "shape"], ["spread"]),
             helper.make_node("Where", ["c", "spread", "zero"], ["spread_masked"]),
             helper.make_node("Div", ["sb", "maybe"], ["unsafe_mean"]),
             helper.make_node("Expand", ["unsafe_mean", "shape"], ["unsafe_spread"]),
             helper.make_node("Where", ["c", "unsafe_spread", "zero"], ["spread_guarded"]),
             helper.make_node("Div", ["a", "b2"], ["d"]),
             helper.make_node("Where", ["c", "d", "zero"], ["guarded"])]
    outputs = ["masked", "spread_masked", "spread_guarded", "guarded"]
    graph = helper.make_graph(nodes, "w", [helper.make_tensor_value_info("a", f, [2, 2]),
                                           helper.make_tensor_value_info("b", f, [2, 2]),
                                           helper.make_tensor_value_info("b2", f, [2, 2]),
                                           helper.make_tensor_value_info("c", TensorProto.BOOL, [2, 2])],
                              [helper.make_tensor_value_info(o, f, [2, 2]) for o in outputs],
                              [zero, count, maybe, shape, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_lower_multiplies_linear_maps_and_keeps_guards():
    lowered = passes.lower(_where_model())
    ops = {n.output[0]: n.op_type for n in lowered.graph.node}
    assert ops["masked"] == "Mul" and ops["spread_masked"] == "Mul"
    assert ops["spread_guarded"] == "Where" and ops["guarded"] == "Where"
    import onnxruntime as ort

    feeds = {"a": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": np.eye(2, dtype=np.float32),
             "b2": np.array([[0.0, 1.0], [1.0, 0.0]], np.float32), "c": np.array([[False, True], [True, False]])}
    want = ort.InferenceSession(_where_model().SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(lowered.SerializeToString()).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)  # the guarded Div's inf stays masked


def _select_model(rows: int) -> onnx.ModelProto:
    """A ReLU's Where over a non-linear gradient (a - b: no linear map of the incoming gradient), a LeakyReLU's
    Where(c, a, a * 0.1), an ELU's Where(c, a, a * b), a HardSwish-like Where on a < 3 (a condition that mostly
    holds, which onnxruntime's Where branches on cheaply), and the same ReLU Where on a tensor too small to
    rewrite."""
    f = TensorProto.FLOAT
    consts = [helper.make_tensor("zero", f, [], [0.0]), helper.make_tensor("slope", f, [], [0.1]),
              helper.make_tensor("three", f, [], [3.0])]
    nodes = [helper.make_node("Sub", ["a", "b"], ["d"]),
             helper.make_node("Where", ["c", "d", "zero"], ["relu"]),
             helper.make_node("Where", ["c", "zero", "d"], ["relu_not"]),
             helper.make_node("Mul", ["a", "slope"], ["as"]),
             helper.make_node("Where", ["c", "a", "as"], ["leaky"]),
             helper.make_node("Mul", ["a", "b"], ["ab"]),
             helper.make_node("Where", ["c", "a", "ab"], ["elu"]),
             helper.make_node("Less", ["a", "three"], ["below"]),
             helper.make_node("Where", ["below", "a", "ab"], ["range"]),
             helper.make_node("Sub", ["a_small", "a_small"], ["ds"]),
             helper.make_node("Where", ["c_small", "ds", "zero"], ["small"])]
    shape, small = [rows, 1024], [2, 3]
    inputs = [helper.make_tensor_value_info(n, f, shape) for n in ("a", "b")]
    inputs += [helper.make_tensor_value_info("c", TensorProto.BOOL, shape),
               helper.make_tensor_value_info("a_small", f, small),
               helper.make_tensor_value_info("c_small", TensorProto.BOOL, small)]
    names = ("relu", "relu_not", "leaky", "elu", "range", "small")
    outputs = [helper.make_tensor_value_info(n, f, None) for n in names]
    graph = helper.make_graph(nodes, "s", inputs, outputs, consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_guarded_selects_keep_every_value():
    """Large Wheres become a product guarded by an If (or, for a slope, a product with Max(mask, slope)) whose
    results equal the Where's, non-finite inputs included; a small one stays."""
    import onnxruntime as ort

    model = _select_model(8)
    lowered = passes.guarded_selects(model)
    ops = {o: n.op_type for n in lowered.graph.node for o in n.output}
    assert [ops[n] for n in ("relu", "relu_not", "leaky", "elu", "range", "small")] == \
        ["If", "If", "Mul", "If", "Where", "Where"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 8, 1024), dtype=np.float32)
    c = rng.random((8, 1024)) > 0.5
    small = {"a_small": np.ones((2, 3), np.float32), "c_small": np.ones((2, 3), bool)}
    want_session = ort.InferenceSession(model.SerializeToString())
    got_session = ort.InferenceSession(lowered.SerializeToString())
    for case in ("finite", "inf masked", "nan kept", "inf in the operand not picked"):
        a_case, b_case = a.copy(), b.copy()
        if case == "inf masked":
            a_case[~c] = np.inf  # relu: inf * 0 would be nan; the If runs the Where instead
        elif case == "nan kept":
            a_case[c] = np.nan
        elif case == "inf in the operand not picked":
            b_case[c] = -np.inf  # elu: a * b is -inf where a is picked
        feeds = {"a": a_case, "b": b_case, "c": c, **small}
        for w, g in zip(want_session.run(None, feeds), got_session.run(None, feeds)):
            np.testing.assert_array_equal(w, g)


class SignMaskNet(nn.Module):
    """Activations whose gradient Wheres `guarded_selects` rewrites: a ReLU before a BatchNorm, an ELU with alpha
    0.5, a LeakyReLU and a PReLU, each over 8 x 10 x 10 elements a sample; then an ELU with alpha 1, whose gradient
    has no Where (dy * Min(y + 1, 1))."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.prelu = nn.PReLU(8)
        self.fc = nn.Linear(8 * 10 * 10, 3)

    def forward(self, x, y):
        h = nn.functional.elu(self.bn(torch.relu(self.conv(x))), 0.5)
        h = nn.functional.elu(self.prelu(nn.functional.leaky_relu(self.conv2(h), 0.2)))
        return nn.functional.cross_entropy(self.fc(h.flatten(1)), y)


def test_guarded_selects_match_torch_through_ortmodule():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 2, 10, 10, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]
    ort, _, _ = check_parity(SignMaskNet, batches, lambda m, b: m(*b), threads=2)
    runner = next(iter(ort.training_sessions()[0]._backwards.values())).runner
    lowered = onnx.load_from_string(runner.session._model_bytes)  # what onnxruntime was given
    guards = [n for n in lowered.graph.node if n.op_type == "If"]
    assert len(guards) >= 3, "the ReLU's, the ELU's and the PReLU's Wheres run guarded"


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


def _relu_pool_model(dtype, extra_reader=False, relu_output=False, indices=False) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["y", "i"] if indices else ["y"], name="pool", kernel_shape=[2, 2],
                              strides=[2, 2])]
    outputs = [helper.make_tensor_value_info("y", elem, None)]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["r"], ["n"]))
        outputs.append(helper.make_tensor_value_info("n", elem, None))
    if relu_output:
        outputs.append(helper.make_tensor_value_info("r", elem, None))
    graph = helper.make_graph(nodes, "rp", [helper.make_tensor_value_info("x", elem, ["n", "c", "h", "w"])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_relu_after_pool_same_values_and_gradients(dtype):
    """MaxPool(Relu(x)) -> Relu(MaxPool(x)): the same output values (bit for bit up to the sign of a zero: the
    pool of a -0.0 may stay -0.0) and torch's gradients, on values with ties, zeros and all-negative windows (a
    7x9 plane: the floor-mode rows get no gradient either way)."""
    import onnxruntime as ort
    from harness import Trainer

    model = _relu_pool_model(dtype)
    swapped = passes.relu_after_pool(model)
    assert [n.op_type for n in swapped.graph.node] == ["MaxPool", "Relu"]
    assert swapped.graph.node[1].output[0] == "y" and [o.name for o in swapped.graph.output] == ["y"]
    assert passes.relu_after_pool(_relu_pool_model(dtype)) is not model  # a copy; the input is left alone
    assert [n.op_type for n in model.graph.node] == ["Relu", "MaxPool"]
    rng = np.random.default_rng(0)
    x = (np.round(rng.standard_normal((2, 3, 7, 9)) * 1.5) / 2).astype(dtype)
    x[:, :, :2, :2] = -1.0
    x[0, 0, 2:4, 2:4] = 0.0
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    got = ort.InferenceSession(swapped.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(want, got)
    assert (want + 0.0).tobytes() == (got + 0.0).tobytes()
    trainer = Trainer(gradbuilder.build_gradient_graph(swapped, wrt=["x"], outputs=["y"]))
    dy = rng.standard_normal(want.shape).astype(dtype)
    _, grads = trainer.step({"x": x}, [dy])
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    nn.functional.max_pool2d(torch.relu(tx), 2).backward(torch.tensor(dy, dtype=torch.float64))
    np.testing.assert_array_equal(grads["x"], tx.grad.numpy().astype(dtype))


@pytest.mark.parametrize("case", [{"extra_reader": True}, {"relu_output": True}, {"indices": True}])
def test_relu_after_pool_only_for_a_private_relu(case):
    """Not when something else reads the Relu output, it is a graph output, or the MaxPool has Indices."""
    model = _relu_pool_model(np.float32, **case)
    assert passes.relu_after_pool(model) is model


def test_relu_after_pool_in_a_training_session():
    """ORTModule runs ConvNet's forward with its Relu moved behind the MaxPool, through every pass (stash
    shrink, lowering); a TrainingSession on the swapped graph gives torch's gradients, and ORTModule too."""
    model, reference, ort, x, y = _stepped()
    source = ort.training_sessions()[0].source
    ops = [n.op_type for n in source.graph.node]
    assert ops.index("MaxPool") < ops.index("Relu")  # swapped by the runtime
    assert passes.relu_after_pool(source) is source  # nothing left to swap
    wrt = [i.name for i in source.graph.input if "." in i.name]
    session = TrainingSession.from_forward(source, wrt=wrt, loss="output", config=SessionConfig(threads=1))
    params = dict(reference.named_parameters())
    feeds = {"x": x.numpy(), "y": y.numpy(), **{n: params[n].detach().numpy() for n in wrt}}
    _, state = session.forward(feeds)
    grads = session.backward(state, [None])
    reference(x, y).backward()
    ours = dict(model.named_parameters())
    for n in wrt:
        np.testing.assert_allclose(grads[n], params[n].grad.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ours[n].grad.numpy(), params[n].grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_statistics_read_by_backward(dtype):
    """The LayerNormalization rule gives the node its Mean/InvStdDev outputs; for float32 backward reads them
    (stashed: two values a row) instead of recomputing, for float64 (float statistics) it recomputes. The
    gradients are torch's either way."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info(n, elem, s) for n, s in
                                            (("x", ["n", 6]), ("w", [6]), ("b", [6]))],
                              [helper.make_tensor_value_info("loss", elem, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = TrainingSession.from_forward(model, wrt=["x", "w", "b"], loss="loss", config=SessionConfig(threads=1))
    stash = {e.name for e in session.full.manifest.backward_inputs if e.role == "stash"}
    assert {name.endswith("_inv_std_dev") for name in stash} == {dtype == np.float32, False}
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal([5, 6]).astype(dtype), rng.random(6).astype(dtype) + 0.5, rng.random(6).astype(dtype)
    _, state = session.forward({"x": x, "w": w, "b": b})
    grads = session.backward(state, [None])
    tx, tw, tb = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w, b))
    (torch.nn.functional.layer_norm(tx, [6], tw, tb, 1e-5) ** 2).sum().backward()
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for name, t in (("x", tx), ("w", tw), ("b", tb)):
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=tol, atol=tol)


def test_inactive_dropouts_go():
    """Dropouts at a constant ratio of 0 (the mask read) and in inference mode go (the mask all true; an
    inference-mode Dropout for a graph output, which the pass then leaves); a training Dropout at 0.3 stays.
    onnxruntime gives the same values before and after."""
    f, b = TensorProto.FLOAT, TensorProto.BOOL
    consts = [helper.make_tensor("zero", f, [], [0.0]), helper.make_tensor("third", f, [], [0.3]),
              helper.make_tensor("on", b, [], [True]), helper.make_tensor("off", b, [], [False])]
    nodes = [helper.make_node("Dropout", ["x", "zero", "on"], ["a", "mask"]),
             helper.make_node("Dropout", ["a", "third", "off"], ["c"]),
             helper.make_node("Dropout", ["c"], ["d"]),
             helper.make_node("Dropout", ["d", "third", "on"], ["e"])]
    graph = helper.make_graph(nodes, "drop", [helper.make_tensor_value_info("x", f, ["n", 4])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in (("d", f), ("mask", b), ("e", f))],
                              consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = passes.inactive_dropouts(model)
    assert [(n.op_type, list(n.input)) for n in rewritten.graph.node] == [
        ("Shape", ["x"]), ("ConstantOfShape", ["mask/shape"]), ("Dropout", ["x"]), ("Dropout", ["d", "third", "on"])]
    assert passes.inactive_dropouts(rewritten) is rewritten
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    config = SessionConfig(threads=1)  # onnxruntime's EliminateDropout off, as for every session of ours
    before, after = ([v.numpy() for v in Runner(m, config, "dropouts").run({"x": to_ortvalue(torch.from_numpy(x))})]
                     for m in (model, rewritten))
    np.testing.assert_array_equal(after[0], x)
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(after[1], np.ones((3, 4), bool))
    np.testing.assert_array_equal(before[1], after[1])


def test_zero_dropout_in_ortmodule():
    """`nn.Dropout(0.0)` in a training module leaves no Dropout in the graph ORTModule builds from, and the
    gradients are torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    ort = ORTModule(model, threads=1)
    x = torch.randn(5, 6)
    ort(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert "Dropout" not in [n.op_type for n in ort.training_sessions()[0].source.graph.node]
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("form", ["gemm", "matmul"])
def test_transposed_products(form):
    """`Transpose(Gemm(x, b, transA=1))` (the MatMul rule's weight gradient) and `Transpose(MatMul(Transpose(x),
    b))` of 2-D operands become one `Gemm(b, x, transA=1)` with the same values; a Gemm that scales is left
    alone."""
    f = TensorProto.FLOAT
    if form == "gemm":
        product = [helper.make_node("Gemm", ["x", "b"], ["p"], transA=1)]
    else:
        product = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                   helper.make_node("MatMul", ["xt", "b"], ["p"])]
    nodes = [helper.make_node("Flatten", ["b0"], ["b"]), *product,
             helper.make_node("Transpose", ["p"], ["y"], perm=[1, 0]),
             helper.make_node("Gemm", ["x", "b"], ["q"], transA=1, alpha=2.0),
             helper.make_node("Transpose", ["q"], ["z"], perm=[1, 0])]
    graph = helper.make_graph(nodes, "tp", [helper.make_tensor_value_info("x", f, ["n", 3]),
                                            helper.make_tensor_value_info("b0", f, ["n", 4])],
                              [helper.make_tensor_value_info(n, f, None) for n in ("y", "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rewritten = passes.transposed_products(model)
    made = {n.output[0]: n for n in rewritten.graph.node}
    assert made["y"].op_type == "Gemm" and list(made["y"].input) == ["b", "x"]
    assert made["z"].op_type == "Transpose"
    rng = np.random.default_rng(0)
    feeds = {k: to_ortvalue(torch.from_numpy(rng.standard_normal((5, n)).astype(np.float32)))
             for k, n in (("x", 3), ("b0", 4))}
    config = SessionConfig(threads=1)
    before, after = ([v.numpy() for v in Runner(m, config, "products").run(feeds)] for m in (model, rewritten))
    for want, got in zip(before, after):
        np.testing.assert_allclose(got, want, rtol=1e-6)


class FeedForward(nn.Module):
    def __init__(self, residual: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.drop, self.residual = nn.Linear(6, 16), nn.Linear(16, 6), nn.Dropout(0.4), residual

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        out = self.fc2(self.drop(h))
        return ((out + h[:, :6] if self.residual else out) * c).sum()


def _record_masks(runner, drawn: dict) -> None:
    """Make a MaskedRunner keep in `drawn` the masks it draws (backward does not read them: the stash lacks them)."""
    draw = runner.draw

    def recorded(shapes, seed, only=None, fresh=False):
        out = draw(shapes, seed, only, fresh)
        drawn.update(out)
        return out

    runner.draw = recorded


def test_relu_dropout_masks_from_the_dropout_output(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fused, "MAX_KEPT", -1.0)  # the split forward's stash, which this reads
    """dropout(relu(h)): backward keeps the Dropout's output d, not the Relu's output and the mask; d > 0 is where
    both passed, and the gradients are torch's with the masks drawn (float64, three steps, the first one with
    onnxruntime's own Dropout)."""
    torch.manual_seed(0)
    model = FeedForward().double()
    ref = copy.deepcopy(model)
    om = ORTModule(model, threads=1)
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randn(40, 6, generator=g, dtype=torch.float64)
    keep = float(torch.tensor(1.0) - torch.tensor(0.4))  # in float32, as onnxruntime's Dropout divides
    drawn: dict = {}
    for step in range(3):
        om.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        if step == 1:
            _record_masks(om.training_sessions()[0]._fwd, drawn)
        loss = om(x, c)
        (session,) = om.training_sessions()
        stash = {e.name for e in session.full.manifest.backward_inputs if e.role == "stash"}
        drop = next(n for n in session.full.forward.graph.node if n.op_type == "Dropout")
        relu = next(n for n in session.full.forward.graph.node if n.op_type == "Relu")
        assert drop.output[0] in stash and drop.output[1] not in stash and relu.output[0] not in stash
        d = torch.from_dlpack(loss.grad_fn.state.values[drop.output[0]]).clone()
        h = torch.relu(ref.fc1(x))
        if step > 0:  # the host-drawn mask is among the feeds: d > 0 exactly where it and the Relu pass
            mask = torch.from_dlpack(to_numpy(drawn[session._fwd.masks[0].input]).copy())
            assert torch.equal(d > 0, mask & (h > 0))
        loss.backward()
        expected = (ref.fc2(h * (d != 0) / keep) * c).sum()  # where h = 0 the mask does not matter
        expected.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):  # the Dropout rule scales by
            # 1 / (1 - ratio) exactly, the forward divides by 1 - ratio rounded to float32: 4e-8 apart at 0.4
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-12, msg=name)


def _relu_dropout_training(extra_reader: bool = False, mask_output: bool = False) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Dropout", ["r", "ratio", "train"], ["d", "mask"]),
             helper.make_node("MatMul", ["d", "w2"], ["o"])]
    nodes += [helper.make_node("Add", ["o", "r"], ["s"])] if extra_reader else []
    nodes += [helper.make_node("ReduceSum", ["s" if extra_reader else "o"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("loss", f, [])]
    outputs += [helper.make_tensor_value_info("mask", TensorProto.BOOL, [4, 4])] if mask_output else []
    graph = helper.make_graph(nodes, "ff", [helper.make_tensor_value_info("x", f, [4, 4]),
                                            helper.make_tensor_value_info("w1", f, [4, 4]),
                                            helper.make_tensor_value_info("w2", f, [4, 4])], outputs,
                              [helper.make_tensor("ratio", f, [], [0.3]),
                               helper.make_tensor("train", TensorProto.BOOL, [], [True])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return gradbuilder.build_gradient_graph(model, wrt=["w1", "w2"], loss="loss")


@pytest.mark.parametrize("case", [{}, {"extra_reader": True}, {"mask_output": True}])
def test_relu_dropout_masks_only_where_nothing_else_reads(case):
    training = _relu_dropout_training(**case)
    before = copy.deepcopy(training)
    freed = passes.relu_dropout_masks(training)
    if not case:
        assert freed == ["r"]
        ops = [n.op_type for n in training.graph.node]
        assert len(ops) == len(before.graph.node) - 2
        assert ops.count("Cast") == [n.op_type for n in before.graph.node].count("Cast") - 1
        greater = next(n for n in training.graph.node if n.op_type == "Greater")
        assert greater.input[0] == "d"
    else:
        assert freed == [] and training == before


@pytest.mark.parametrize("vector_first", [False, True])
def test_vectors_times_transposed_matrices_as_onnxruntime_should(vector_first: bool) -> None:
    """onnxruntime 1.32's MatmulTransposeFusion gives wrong values for MatMul(Transpose(A), v) with v 1-D (through an
    Identity too, a StopGradient split): `vectors_as_matrices` makes v a column, which it fuses right; both orders,
    the graph's output as numpy's."""
    rng = np.random.default_rng(0)
    a, v = rng.standard_normal((6, 5), np.float32), rng.standard_normal(6 if not vector_first else 5, np.float32)
    operands = ["v", "t"] if vector_first else ["t", "v"]
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0]), helper.make_node("Identity", ["at"], ["t"]),
         helper.make_node("MatMul", operands, ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [6, 5]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [len(v)])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fixed = passes.vectors_as_matrices(model)
    assert fixed is not model
    got = Runner(fixed, SessionConfig(threads=1), "test").run({"a": to_ortvalue(a), "v": to_ortvalue(v)}, ["y"])[0]
    np.testing.assert_allclose(to_numpy(got), v @ a.T if vector_first else a.T @ v, rtol=1e-5, atol=1e-6)
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["a", "v"], ["y"])], "g", [graph.input[0], helper.make_tensor_value_info(
            "v", TensorProto.FLOAT, [5])], graph.output), opset_imports=[helper.make_opsetid("", 17)])
    assert passes.vectors_as_matrices(plain) is plain  # no Transpose: left alone


def _canonical_case(case: str) -> onnx.ModelProto:
    """Spellings onnxruntime misreads (found by tests/fuzz/test_runtime_replay.py): a mean over both axes with
    keepdims=-2 after a Linear chain made feature-major, a LayerNormalization with an empty bias, a Cast to int64
    with saturate=7, a Split whose one output is unnamed."""
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "W")
    axes = onnx.numpy_helper.from_array(np.array([0, 1]), "axes")
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W"], ["z"])]
    if case == "keepdims":
        nodes.append(helper.make_node("Tanh", ["z"], ["t"]))  # a Transpose moves past it onto the mean
        nodes.append(helper.make_node("ReduceMean", ["t", "axes"], ["loss"], keepdims=-2))
    elif case == "empty bias":
        nodes.append(helper.make_node("LayerNormalization", ["z", "scale", ""], ["n"]))
        nodes.append(helper.make_node("ReduceSum", ["n"], ["loss"], keepdims=0))
    elif case == "saturate":
        nodes.append(helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0))
        nodes.append(helper.make_node("Cast", ["z"], ["ints"], to=TensorProto.INT64, saturate=7))
    else:
        nodes.append(helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0))
        nodes.append(helper.make_node("Split", ["z"], [""], axis=1))
    outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    if case == "saturate":
        outputs.append(helper.make_tensor_value_info("ints", TensorProto.INT64, ["N", 4]))
    scale = onnx.numpy_helper.from_array(np.full(4, 1.5, np.float32), "scale")
    b = onnx.numpy_helper.from_array(np.full(4, 0.25, np.float32), "b")
    graph = helper.make_graph(nodes, case, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              outputs, [w, axes, scale, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("case", ["keepdims", "empty bias", "saturate", "unnamed output"])
def test_spellings_onnxruntime_misreads(case: str) -> None:
    """Each loads, runs the values an unoptimized onnxruntime session gives for the ONNX-equivalent spelling,
    and gets the gradient torch gives. Before `passes.canonical_forms`: a failed session load, a crash of the
    process, uninitialized memory for the integers, a crash of the process."""
    model = _canonical_case(case)
    x = np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32)
    session = TrainingSession.from_forward(model, config=SessionConfig(threads=1))
    outs, state = session.forward({"x": x})
    grads = session.backward(state, [np.array(1.0, np.float32)] + [None] * (len(outs) - 1))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    want = ort.InferenceSession(passes.canonical_forms(model).SerializeToString(), options).run(None, {"x": x})
    for got, expected in zip(outs, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
    w = torch.tensor(onnx.numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    z = torch.relu(torch.from_numpy(x) @ w + 0.25) @ w
    loss = {"keepdims": lambda: z.tanh().mean(), "saturate": lambda: z.sum(), "unnamed output": lambda: z.sum(),
            "empty bias": lambda: (torch.nn.functional.layer_norm(z, (4,), eps=1e-5) * 1.5).sum()}[case]()
    loss.backward()
    np.testing.assert_allclose(np.asarray(grads["W"]), w.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_inactive_dropout_of_a_folded_parameter_as_an_output() -> None:
    """n = Dropout(log(W1)) returned beside a loss whose Gemm reads log(W1) (the chain made feature-major): as an
    Identity, onnxruntime's optimizations made the forward unloadable ("Node input 'e' is not a graph input,
    initializer, or output of a previous node"; found by tests/fuzz/test_runtime_replay.py)."""
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array(np.abs(rng.standard_normal(s)).astype(np.float32) + 0.5, n)
             for n, s in (("W1", (4, 5)), ("b1", (5,)), ("W2", (5, 3)))]
    inits.append(onnx.numpy_helper.from_array(np.array([0, 1]), "axes"))
    nodes = [helper.make_node("Log", ["W1"], ["e"]), helper.make_node("Gemm", ["x", "e", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["z"]),
             helper.make_node("Softmax", ["z"], ["p"]), helper.make_node("Dropout", ["e"], ["n"]),
             helper.make_node("ReduceMean", ["p", "axes"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                               helper.make_tensor_value_info("n", TensorProto.FLOAT, None)], inits)
    session = TrainingSession.from_forward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                                           threads=1)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    (_, n), state = session.forward({"x": x})
    w1, b1, w2 = (torch.tensor(onnx.numpy_helper.to_array(t), requires_grad=True) for t in inits[:3])
    np.testing.assert_allclose(np.asarray(n), w1.detach().log().numpy(), rtol=1e-6)
    grads = session.backward(state, [np.array(1.0, np.float32), None])
    torch.softmax(torch.relu(torch.from_numpy(x) @ w1.log() + b1) @ w2, -1).mean().backward()
    np.testing.assert_allclose(np.asarray(grads["W1"]), w1.grad.numpy(), rtol=1e-4, atol=1e-6)


def _in_order(data: np.ndarray, index: np.ndarray, updates: np.ndarray, reduction: str) -> np.ndarray:
    """ScatterND with a reduction, one update after the other (index tuples over the leading axes)."""
    out = data.copy()
    combine = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction]
    tuples = index.reshape(-1, index.shape[-1])
    values = updates.reshape(len(tuples), *data.shape[index.shape[-1]:])
    for t, v in zip(tuples, values):
        out[tuple(t)] = combine(out[tuple(t)], v)
    return out


@pytest.mark.parametrize("data_shape,index,reduction", [
    ((3, 256), np.where(np.arange(4096) % 7 == 0, 2, 0)[:, None], "add"),  # token types: one row, over and over
    ((4, 8, 16), np.array([[1], [-1], [1], [0]] * 64), "add"),  # rows of a 3-D table; a negative row
    ((5, 6, 32), np.array([[1, 2], [4, -1], [1, 2], [0, 5]] * 64), "add"),  # (row, column) pairs: flat rows
    ((3, 4, 64), np.array([[[2], [0]], [[2], [2]]] * 32), "add"),  # a batch of index rows, [B, L, 1]
    ((3, 64), np.array([[1], [1], [0]] * 100), "max"),
    ((3, 64), np.array([[1], [1], [0]] * 100), "mul"),
])
def test_ordered_scatters(data_shape, index, reduction) -> None:
    """A reducing ScatterND computes what one update after the other gives, bit for bit, on four onnxruntime
    threads: its ScatterND split the updates among them and lost some where indices repeat (up to 51 off for the
    first case on a quiet machine); the rewrite is a ScatterElements over the data's rows."""
    rng = np.random.default_rng(0)
    data = rng.standard_normal(data_shape).astype(np.float32)
    depth = index.shape[-1]
    updates = rng.standard_normal((*index.shape[:-1], *data_shape[depth:])).astype(np.float32)
    if reduction == "mul":
        updates = 1 + updates / 100
    node = helper.make_node("ScatterND", ["data", "index", "updates"], ["out"], reduction=reduction)
    batch = [f"n{j}" for j in range(index.ndim - 1)]
    graph = helper.make_graph([node], "scatter", [
        helper.make_tensor_value_info("data", TensorProto.FLOAT, ["r", *data_shape[1:]]),
        helper.make_tensor_value_info("index", TensorProto.INT64, [*batch, depth]),
        helper.make_tensor_value_info("updates", TensorProto.FLOAT, [*batch, *data_shape[depth:]])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["r", *data_shape[1:]])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    ordered = passes.ordered_scatters(model)
    assert "ScatterND" not in {n.op_type for n in ordered.graph.node}
    onnx.checker.check_model(ordered, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 4
    session = ort.InferenceSession(ordered.SerializeToString(), options, providers=["CPUExecutionProvider"])
    want = _in_order(data, index, updates, reduction)
    for _ in range(5):
        np.testing.assert_array_equal(session.run(None, {"data": data, "index": index, "updates": updates})[0], want)
    plain = copy.deepcopy(model)
    plain.graph.node[0].attribute.pop()  # no reduction: left alone
    assert passes.ordered_scatters(plain) is plain


class Bounded(nn.Module):
    """Two bounded activations back to back with a linear layer between (each exported as a Relu or a bound's
    Where under a bound's Where: two selections in backward)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x):
        return nn.functional.hardtanh(self.fc2(nn.functional.relu6(self.fc1(x))), -0.5, 0.75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_joined_selects_one_mask_an_activation_and_the_same_gradients(monkeypatch: pytest.MonkeyPatch, dtype):
    """Backward keeps one boolean an activation, and its gradients are the ones the two selections give, bit for bit:
    at the bounds, where the gradient is zero as torch's, and with inf and nan incoming."""
    monkeypatch.setattr(fused, "MAX_KEPT", -1.0)  # the split forward's stash, which this reads
    torch.manual_seed(0)
    model = Bounded().to(dtype)
    with torch.no_grad():  # inputs landing exactly on the bounds 0, 6, -0.5 and 0.75
        model.fc1.weight.zero_()
        model.fc1.bias.copy_(torch.tensor([0.0, 6.0, 3.0, -1.0, 7.0, 0.5, 6.0, 0.0]))
        model.fc1.weight[:, 0] = 1.0
        model.fc2.weight.normal_()
    x = torch.zeros(9, 6, dtype=dtype)
    x[:, 0] = torch.tensor([0.0, -1.0, 1.0, 2.0, -6.0, 5.5, 0.25, 3.0, -3.0])
    c = torch.randn(9, 5, dtype=dtype)
    c[0, 0], c[1, 1], c[2, 2] = float("inf"), float("nan"), -float("inf")
    grads = {}
    for joined in (True, False):
        if not joined:
            monkeypatch.setattr(passes, "joined_selects", lambda training: 0)
        om = ORTModule(copy.deepcopy(model), threads=1)
        (om(x) * c).sum().backward()
        grads[joined] = [p.grad for p in om.parameters()]
        (session,) = om.training_sessions()
        types = {o.name: o.type.tensor_type.elem_type for o in session.full.forward.graph.output}
        stash = [e.name for e in session.full.manifest.backward_inputs if e.role == "stash"]
        assert sum(types.get(n) == TensorProto.BOOL for n in stash) == (2 if joined else 4)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    reference = copy.deepcopy(model)
    finite = c.nan_to_num(0.0, 0.0, 0.0)
    om = ORTModule(copy.deepcopy(model), threads=1)
    (om(x) * finite).sum().backward()
    (reference(x) * finite).sum().backward()
    for p, q in zip(om.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-7)


@pytest.mark.parametrize("shared", [False, True])
def test_joined_selects_made_in_the_forward_only_where_backward_reads_no_condition_else(shared: bool) -> None:
    """ReLU6 written out (Relu, then a bound's Where on x >= 6); with `shared`, a second output selects by the same
    x >= 6, so backward reads that mask anyway: the joined mask is then made in backward (made in the forward, it
    would be a third boolean kept)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("GreaterOrEqual", ["x", "six"], ["ge"]),
             helper.make_node("Where", ["ge", "six", "r"], ["o1"])]
    nodes += [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Where", ["ge", "six", "sq"], ["o2"]),
              helper.make_node("Add", ["o1", "o2"], ["o"])] if shared else [helper.make_node("Identity", ["o1"], ["o"])]
    nodes += [helper.make_node("ReduceSum", ["o"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "relu6", [helper.make_tensor_value_info("x", f, [4, 5])],
                              [helper.make_tensor_value_info("loss", f, [])], [helper.make_tensor("six", f, [], [6.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], loss="loss")
    passes.hoist_masks(training)
    assert passes.joined_selects(training) == 1
    names = [n.op_type for n in training.graph.node]
    y = next(k for k, n in enumerate(training.graph.node) if n.op_type == "Yield")
    assert ("And" in names[y:]) == shared and ("And" in names[:y]) != shared
    xs = np.array([[-1.0, 0.0, 3.0, 6.0, 7.0]] * 4, np.float32)  # the bounds themselves, nan, -0, inf
    xs[1, 0], xs[2, 1], xs[3, 2] = np.nan, -0.0, np.inf
    grads = []
    for joined in (passes.joined_selects, lambda training: 0):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(passes, "joined_selects", joined)
            session = TrainingSession.from_forward(model, wrt=["x"], loss="loss", config=SessionConfig(threads=1))
            _, state = session.forward({"x": xs})
            grads.append(session.backward(state, [None])["x"])
    np.testing.assert_array_equal(grads[0], grads[1])
    assert np.array_equal(np.signbit(grads[0]), np.signbit(grads[1]))


def _idle_reshapes_case() -> onnx.ModelProto:
    """x [N, 4]: a Flatten of a matrix (idle), read by a Relu and by an If's branch; a bias-gradient-like sum with
    keepdims then a Reshape to the bias (an output); a sum read twice; a Reshape to a size computed at run time
    (unprovable); an Unsqueeze that changes the shape; an Identity that is an output."""
    f32 = TensorProto.FLOAT
    axes0 = onnx.numpy_helper.from_array(np.array([0]), "axes0")
    four = onnx.numpy_helper.from_array(np.array([4]), "four")
    branch = helper.make_graph([helper.make_node("Neg", ["f"], ["b_out"])], "branch", [],
                               [helper.make_tensor_value_info("b_out", f32, ["N", 4])])
    nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=1), helper.make_node("Relu", ["f"], ["r"]),
             helper.make_node("ReduceSum", ["r", "axes0"], ["s"], keepdims=1),
             helper.make_node("Reshape", ["s", "four"], ["bias_grad"]),
             helper.make_node("ReduceSum", ["r", "axes0"], ["twice"]),
             helper.make_node("Reshape", ["twice", "four"], ["twice_flat"]),
             helper.make_node("Mul", ["twice", "twice"], ["twice_sq"]),
             helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Reshape", ["r", "shape"], ["same"]),
             helper.make_node("Unsqueeze", ["same", "axes0"], ["u"]),
             helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
             helper.make_node("Greater", ["m", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["picked"], then_branch=branch, else_branch=branch),
             helper.make_node("Identity", ["r"], ["r_out"])]
    zero = onnx.numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    outputs = [helper.make_tensor_value_info(n, f32, None)
               for n in ("bias_grad", "twice_flat", "twice_sq", "u", "picked", "r_out")]
    graph = helper.make_graph(nodes, "idle", [helper.make_tensor_value_info("x", f32, ["N", 4])], outputs,
                              [axes0, four, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_idle_reshapes_are_removed_and_values_kept() -> None:
    """The Flatten goes (its readers, the If's branch too, read x), the bias-gradient sum drops its kept axis
    instead of a Reshape doing so; the sum read twice, the Reshape to a run-time size, the Unsqueeze and the
    output's Identity stay. onnxruntime gives the same values at two batch sizes (no optimizations)."""
    model = _idle_reshapes_case()
    out = passes.idle_reshapes(model)
    assert [n.op_type for n in out.graph.node] == [
        "Relu", "ReduceSum", "ReduceSum", "Reshape", "Mul", "Shape", "Reshape", "Unsqueeze", "ReduceMax", "Greater",
        "If", "Identity"]
    summed = out.graph.node[1]
    assert list(summed.output) == ["bias_grad"] and passes.int_attr(summed, "keepdims", 1) == 0
    assert out.graph.node[0].input[0] == "x" and out.graph.node[10].attribute[0].g.node[0].input[0] == "x"
    assert passes.idle_reshapes(out) is out
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    names = [o.name for o in model.graph.output]
    for rows in (3, 8):
        x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
        want = ort.InferenceSession(model.SerializeToString(), options).run(names, {"x": x})
        got = ort.InferenceSession(out.SerializeToString(), options).run(names, {"x": x})
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w)


def test_idle_reshapes_read_a_backwards_constant_inputs() -> None:
    """A backward's ReduceSum whose axes are a graph input fed from the forward's constants (onnx's inference
    cannot size its output): with the value `known`, the sum drops the axis itself and the Reshape goes; without,
    both stay. The same values from onnxruntime."""
    f32 = TensorProto.FLOAT
    four = onnx.numpy_helper.from_array(np.array([4]), "four")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["dy", "axes"], ["s"], keepdims=1),
         helper.make_node("Reshape", ["s", "four"], ["bias_grad"])], "bias",
        [helper.make_tensor_value_info("dy", f32, [4, "N"]), helper.make_tensor_value_info("axes", TensorProto.INT64,
                                                                                          [1])],
        [helper.make_tensor_value_info("bias_grad", f32, [4])], [four])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert passes.idle_reshapes(model) is model
    out = passes.idle_reshapes(model, {"axes": np.array([1])})
    assert [n.op_type for n in out.graph.node] == ["ReduceSum"] and list(out.graph.node[0].output) == ["bias_grad"]
    feeds = {"dy": np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32), "axes": np.array([1])}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_array_equal(ort.InferenceSession(out.SerializeToString()).run(None, feeds)[0], want)


def test_idle_reshapes_pass_over_a_reshaped_constant() -> None:
    """A Reshape of a Constant node's output (no inputs to look at) stays, and nothing fails."""
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.ones((2, 3), np.float32))),
         helper.make_node("Reshape", ["c", "six"], ["flat"]), helper.make_node("Mul", ["flat", "x"], ["y"])], "c",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])], [onnx.numpy_helper.from_array(np.array([6]),
                                                                                                    "six")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert passes.idle_reshapes(model) is model


def test_reshapes_to_their_own_sizes_are_idle() -> None:
    """Reshapes whose constant target spells the input's sizes (torch's exports: logits to [-1, C], labels to [-1];
    a 0 copies a size) go; one that moves elements between axes ([-1, 2] of [N, 4]) stays. The same values from
    onnxruntime at two batch sizes."""
    f32 = TensorProto.FLOAT
    consts = [onnx.numpy_helper.from_array(np.array(v), name) for name, v in
              (("logits_shape", [-1, 4]), ("flat", [-1]), ("copy", [0, -1]), ("pairs", [-1, 2]))]
    nodes = [helper.make_node("Reshape", ["x", "logits_shape"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Reshape", ["b", "copy"], ["c"]), helper.make_node("Reshape", ["c", "pairs"], ["y"]),
             helper.make_node("Reshape", ["labels", "flat"], ["l"]), helper.make_node("Neg", ["l"], ["m"])]
    graph = helper.make_graph(nodes, "own", [helper.make_tensor_value_info("x", f32, ["N", 4]),
                                             helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])],
                              [helper.make_tensor_value_info("y", f32, None),
                               helper.make_tensor_value_info("m", TensorProto.INT64, None)], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out = passes.idle_reshapes(model)
    assert [n.op_type for n in out.graph.node] == ["Relu", "Reshape", "Neg"]
    assert [list(n.input) for n in out.graph.node] == [["x"], ["b", "pairs"], ["labels"]]
    for rows in (3, 8):
        feeds = {"x": np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32),
                 "labels": np.arange(rows)}
        want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
        for got, expected in zip(ort.InferenceSession(out.SerializeToString()).run(None, feeds), want, strict=True):
            np.testing.assert_array_equal(got, expected)


class Spectral(nn.Module):
    """FNet's mixing (`fftn(...).real` over the positions and features) and a filter applied between a DFT and an
    inverse one, over 10 positions (not a power of two)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real
        filtered = torch.fft.ifft(torch.fft.fft(h, dim=1) * torch.arange(1.0, 11.0, dtype=h.dtype)[:, None], dim=1)
        return mixed + torch.view_as_real(filtered).sum(-1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_inverse_dfts_are_exact(exporter: str) -> None:
    """onnxruntime's inverse DFT scales by 1 / n in float32 at lengths other than powers of two: float64 ifft was
    1.5e-8 off torch's, and the gradient of every forward DFT (its adjoint is an inverse one) too."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 10, 8, generator=g, dtype=torch.float64),) for _ in range(2)]
    weights = torch.randn(3, 10, 8, generator=g, dtype=torch.float64)
    check_parity(lambda: Spectral().double(), batches, lambda m, b: (m(*b) * weights).sum(), rtol=1e-12,
                 exporter=exporter)


class GlobalFilter(nn.Module):
    """GFNet's token mixing: the positions' one-sided spectrum times a learned complex filter per channel and a ramp
    over the bins, back by irfft to the run-time length (`n=h.shape[1]`, symbolic in the graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.filter = nn.Parameter(torch.randn(8, 2) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        spectrum = torch.fft.rfft(h, dim=1, norm="ortho") * torch.view_as_complex(self.filter)
        ramp = torch.arange(spectrum.shape[1], dtype=h.dtype)[:, None] + 1
        return torch.fft.irfft(spectrum * ramp, n=h.shape[1], dim=1, norm="ortho")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_inverse_one_sided_dft_over_a_run_time_length(exporter: str) -> None:
    """irfft to a length the graph reads at run time had no gradient ("needs a constant dft_length"): its adjoint's
    bin weights are computed from the sizes. Float64, an even and an odd length from one export."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, n, 8, generator=g, dtype=torch.float64),) for n in (10, 7, 10)]
    check_parity(lambda: GlobalFilter().double(), batches, lambda m, b: (m(*b) * b[0].flip(1)).sum(), rtol=1e-12,
                 exporter=exporter)
