"""Reachability, the Yield boundary and gradient accumulation, checked against torch.autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from harness import Trainer
from onnx import TensorProto, helper

import gradbuilder
from gradbuilder.errors import GradBuilderError, LossError, UnknownNameError
from gradbuilder.yield_op import find_yield, read_yield

D = TensorProto.DOUBLE
rng = np.random.default_rng(1)


def model(nodes, inputs, outputs, inits=(), opset=17):
    """inputs/outputs: (name, elem_type, shape); inits: name -> array."""
    g = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def yield_sig(training):
    return read_yield(training.graph.node[find_yield(list(training.graph.node))])


def grads_torch(fn, params: dict[str, np.ndarray], feeds: dict[str, np.ndarray], cot):
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tf = {k: torch.tensor(v) for k, v in feeds.items()}
    outs = fn(**tp, **tf)
    pairs = [(o, torch.tensor(c)) for o, c in zip(outs, cot) if c is not None]
    got = torch.autograd.grad([p[0] for p in pairs], list(tp.values()), [p[1] for p in pairs], allow_unused=True)
    return {k: (None if g is None else g.numpy()) for k, g in zip(tp, got)}


def assert_grads(ours: dict, ref: dict):
    for k, r in ref.items():
        if r is None:
            assert k not in ours, f"{k} should get no gradient"
        else:
            np.testing.assert_allclose(ours[k], r, rtol=1e-10, atol=1e-12, err_msg=k)


W1 = rng.standard_normal((3, 4))
W2 = rng.standard_normal((3, 4))
X = rng.standard_normal((3, 4))


def two_layer():
    """y1 = x*W1, y2 = y1*W2 (+ an unused parameter U)."""
    nodes = [helper.make_node("Mul", ["x", "W1"], ["y1"]), helper.make_node("Mul", ["y1", "W2"], ["y2"])]
    return model(nodes, [("x", D, [3, 4])], [("y2", D, [3, 4])], {"W1": W1, "W2": W2, "U": np.ones(2)})


def test_frozen_and_unused_parameters():
    training = gradbuilder.build_gradient_graph(two_layer(), freeze=["W2"])
    onnx.checker.check_model(training, full_check=True)
    meta = gradbuilder.read_metadata(training)
    assert meta["gradients"] == {"W1": "W1_grad"}
    assert meta["no_gradient"]["W2"] == "frozen"
    assert "unused" in meta["no_gradient"]["U"]
    c = rng.standard_normal((3, 4))
    _, grads = Trainer(training).step({"x": X}, [c])
    np.testing.assert_allclose(grads["W1"], c * W2 * X)


def test_frozen_path_costs_nothing():
    """A frozen parameter's own gradient path emits no node: only W1's chain is differentiated."""
    full = gradbuilder.build_gradient_graph(two_layer())
    frozen = gradbuilder.build_gradient_graph(two_layer(), freeze=["W2"])
    n_bwd = lambda m: len(m.graph.node) - find_yield(list(m.graph.node)) - 1  # noqa: E731
    assert n_bwd(frozen) < n_bwd(full)
    bwd_ops = [n.op_type for n in frozen.graph.node[find_yield(list(frozen.graph.node)) + 1:]]
    assert bwd_ops.count("Mul") == 2  # dy*W2 -> dy1, dy1*x -> dW1; nothing for W2


def test_output_consumed_internally_sums_host_and_internal_gradient():
    """outputs (s, t) with t = s*s: the host's gradient of s joins the internal one through a Sum."""
    nodes = [helper.make_node("Mul", ["x", "W1"], ["s"]), helper.make_node("Mul", ["s", "s"], ["t"])]
    m = model(nodes, [("x", D, [3, 4])], [("s", D, [3, 4]), ("t", D, [3, 4])], {"W1": W1})
    training = gradbuilder.build_gradient_graph(m)
    sig = yield_sig(training)
    assert sig.full_shape == (1,)  # s is consumed inside the graph, so a scalar zero is fine there
    assert any(n.op_type == "Sum" and sig.grads[0] in n.input for n in training.graph.node)
    cs, ct = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    trainer = Trainer(training)
    _, grads = trainer.step({"x": X}, [cs, ct])
    ref = grads_torch(lambda W1, x: (x * W1, (x * W1) ** 2), {"W1": W1}, {"x": X}, [cs, ct])
    assert_grads(grads, ref)
    # None for s arrives as a scalar zero and gives t's gradient alone
    _, grads = trainer.step({"x": X}, [None, ct])
    assert_grads(grads, grads_torch(lambda W1, x: (x * W1, (x * W1) ** 2), {"W1": W1}, {"x": X}, [None, ct]))


def test_loss_plus_scores_sum_case():
    """The ORT bug: loss = f(scores) returned with scores; d(loss + scores.sum()) must add both paths."""
    nodes = [
        helper.make_node("Mul", ["x", "W1"], ["scores"]),
        helper.make_node("Mul", ["scores", "scores"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
        helper.make_node("Neg", ["scores"], ["aux"]),
    ]
    m = model(nodes, [("x", D, [3, 4])], [("loss", D, []), ("scores", D, [3, 4]), ("aux", D, [3, 4])],
              {"W1": W1})
    training = gradbuilder.build_gradient_graph(m)
    onnx.checker.check_model(training, full_check=True)
    sig = yield_sig(training)
    assert sig.full_shape == (2,)  # loss is a scalar; scores is consumed inside; aux is not
    trainer = Trainer(training)
    ones = np.ones((3, 4))
    _, grads = trainer.step({"x": X}, [np.array(1.0), ones, None])  # (loss + scores.sum()).backward()
    fn = lambda W1, x: ((x * W1 * x * W1).sum(), x * W1, -(x * W1))  # noqa: E731
    assert_grads(grads, grads_torch(fn, {"W1": W1}, {"x": X}, [np.array(1.0), ones, None]))


def test_non_differentiable_outputs_in_the_middle_and_integer_inputs():
    nodes = [
        helper.make_node("Cast", ["k"], ["kf"], to=D),
        helper.make_node("Mul", ["kf", "W1"], ["a"]),
        helper.make_node("Greater", ["a", "x"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=D),
        helper.make_node("Mul", ["a", "maskf"], ["b"]),
    ]
    m = model(nodes, [("x", D, [3, 4]), ("k", TensorProto.INT64, [3, 4])],
              [("a", D, [3, 4]), ("mask", TensorProto.BOOL, [3, 4]), ("b", D, [3, 4])], {"W1": W1})
    training = gradbuilder.build_gradient_graph(m, wrt=["W1", "k", "x"])
    sig = yield_sig(training)
    assert sig.non_differentiable == (1,) and len(sig.grads) == 2
    meta = gradbuilder.read_metadata(training)
    assert "INT64" in meta["no_gradient"]["k"]
    assert "non-differentiable" in meta["no_gradient"]["x"] or "non-float" in meta["no_gradient"]["x"]
    k = rng.integers(-2, 3, (3, 4))
    ca, cb = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    _, grads = Trainer(training).step({"x": X, "k": k}, [ca, None, cb])
    mask = (k * W1 > X).astype(float)
    np.testing.assert_allclose(grads["W1"], ca * k + cb * k * mask)
    assert set(grads) == {"W1"}


def test_duplicated_output_sums_both_host_gradients():
    nodes = [helper.make_node("Mul", ["x", "W1"], ["y"])]
    m = model(nodes, [("x", D, [3, 4])], [("y", D, [3, 4]), ("y", D, [3, 4])], {"W1": W1})
    training = gradbuilder.build_gradient_graph(m)
    sig = yield_sig(training)
    assert sig.outputs == ("y", "y") and len(sig.grads) == 2
    c1, c2 = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    _, grads = Trainer(training).step({"x": X}, [c1, c2])
    np.testing.assert_allclose(grads["W1"], (c1 + c2) * X)


def test_output_that_is_an_input_or_a_parameter():
    nodes = [helper.make_node("Mul", ["x", "W1"], ["y"])]
    m = model(nodes, [("x", D, [3, 4])], [("y", D, [3, 4]), ("W1", D, [3, 4]), ("x", D, [3, 4])], {"W1": W1})
    training = gradbuilder.build_gradient_graph(m, wrt=["W1", "x"])
    onnx.checker.check_model(training, full_check=True)
    c = [rng.standard_normal((3, 4)) for _ in range(3)]
    _, grads = Trainer(training).step({"x": X}, c)
    np.testing.assert_allclose(grads["W1"], c[0] * X + c[1])
    np.testing.assert_allclose(grads["x"], c[0] * W1 + c[2])
    assert gradbuilder.read_metadata(training)["gradients"] == {"W1": "W1_grad", "x": "x_grad"}


def test_loss_is_seeded_inside_the_graph():
    nodes = [helper.make_node("Mul", ["x", "W1"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    m = model(nodes, [("x", D, [3, 4])], [("loss", D, []), ("y", D, [3, 4])], {"W1": W1})
    training = gradbuilder.build_gradient_graph(m, loss="loss")
    sig = yield_sig(training)
    assert sig.grads == () and sig.non_differentiable == (0, 1)
    _, grads = Trainer(training).step({"x": X})
    np.testing.assert_allclose(grads["W1"], X)


def test_bad_requests_fail_clearly():
    m = two_layer()
    with pytest.raises(UnknownNameError, match=r"W3.*Did you mean"):
        gradbuilder.build_gradient_graph(m, wrt=["W3"])
    with pytest.raises(LossError, match="shape"):
        gradbuilder.build_gradient_graph(m, loss="y2")
    with pytest.raises(UnknownNameError):
        gradbuilder.build_gradient_graph(m, loss="nope")
    with pytest.raises(GradBuilderError, match="already contains a Yield"):
        gradbuilder.build_gradient_graph(gradbuilder.build_gradient_graph(m))


def test_unsupported_op_on_the_path_names_op_and_node():
    nodes = [helper.make_node("Mul", ["x", "W1"], ["a"]), helper.make_node("Frobnicate", ["a"], ["y"],
                                                                           domain="my.ops", name="frob1")]
    m = model(nodes, [("x", D, [3, 4])], [("y", D, [3, 4])], {"W1": W1})
    m.opset_import.append(helper.make_opsetid("my.ops", 1))
    with pytest.raises(gradbuilder.GradBuilderError, match=r"my\.ops\.Frobnicate.*frob1.*gradbuilder ops"):
        gradbuilder.build_gradient_graph(m)
    # off the gradient path it is fine: nothing is differentiated through it
    training = gradbuilder.build_gradient_graph(m, freeze=["W1"])
    assert gradbuilder.read_metadata(training)["gradients"] == {}


def _with_local_functions(big: bool) -> onnx.ModelProto:
    """y = Scaled(x, W1; alpha=0.5) with Scaled(a, b) = alpha * Act(a * b) and Act = Tanh: model-local functions
    (as onnxscript writes them), one calling the other and reading an attribute, Act's body at opset 13 (the
    model's is 17); z = Act(x) is off the gradient path. `big`: an unused 1 MB parameter U, which the inliner is
    not given."""
    local = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    act = helper.make_function("local", "Act", ["a"], ["c"], [helper.make_node("Tanh", ["a"], ["c"])],
                               [helper.make_opsetid("", 13)])
    alpha = helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT)
    alpha.ref_attr_name = "alpha"
    scale = helper.make_node("Constant", [], ["s"])
    scale.attribute.append(alpha)
    scaled = helper.make_function("local", "Scaled", ["a", "b"], ["c"], [
        helper.make_node("Mul", ["a", "b"], ["t"]), helper.make_node("Act", ["t"], ["u"], domain="local"), scale,
        helper.make_node("Cast", ["s"], ["sd"], to=D), helper.make_node("Mul", ["u", "sd"], ["c"])], local, ["alpha"])
    nodes = [helper.make_node("Scaled", ["x", "W1"], ["y"], domain="local", alpha=0.5),
             helper.make_node("Act", ["x"], ["z"], domain="local")]
    inits = {"W1": W1, **({"U": np.ones(2**17)} if big else {})}
    m = model(nodes, [("x", D, [3, 4])], [("y", D, [3, 4]), ("z", D, [3, 4])], inits)
    m.opset_import.append(helper.make_opsetid("local", 1))
    m.functions.extend([act, scaled])
    return m


@pytest.mark.parametrize("big", [False, True])
def test_local_functions_are_inlined(big):
    """Model-local functions were taken for ops without a gradient rule on the path, and split's halves lost their
    definitions (onnxruntime: "local:Act(-1) is not a registered function/op") off it."""
    training = gradbuilder.build_gradient_graph(_with_local_functions(big))
    assert not training.functions
    assert gradbuilder.read_metadata(training)["gradients"] == {"W1": "W1_grad"}
    cy, cz = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    outs, grads = Trainer(training).step({"x": X}, [cy, cz])
    ref = grads_torch(lambda W1, x: (0.5 * torch.tanh(x * W1),), {"W1": W1}, {"x": X}, [cy])
    np.testing.assert_allclose(outs[0], 0.5 * np.tanh(X * W1), rtol=1e-10)
    np.testing.assert_allclose(outs[1], np.tanh(X), rtol=1e-10)
    assert_grads(grads, ref)
    assert {t.name for t in training.graph.initializer} >= ({"W1", "U"} if big else {"W1"})
    assert "U" not in {i.name for i in training.graph.input}


@pytest.mark.parametrize("names,kept", [(["twin", "twin"], ["twin", "twin_1"]),
                                        (["grad/y2/Mul_node", "gradbuilder_yield"], None)])
def test_node_names_are_made_unique(names, kept):
    """onnxruntime refuses a model in which two nodes share a name: forward nodes named alike (which ONNX forbids
    and its checker lets through), or named as the builder names the Yield and backward nodes, were kept so and
    neither half of the split loaded."""
    m = two_layer()
    for n, name in zip(m.graph.node, names):
        n.name = name
    training = gradbuilder.build_gradient_graph(m)
    given = [n.name for n in training.graph.node if n.name]
    assert len(given) == len(set(given)) and given[:2] == (kept or names)
    c = rng.standard_normal((3, 4))
    _, grads = Trainer(training).step({"x": X}, [c])
    assert_grads(grads, grads_torch(lambda W1, W2, x: (x * W1 * W2,), {"W1": W1, "W2": W2}, {"x": X}, [c]))


def test_input_with_a_default_keeps_it_in_backward():
    """W is an initializer also listed as a graph input (an overridable default, as keep_initializers_as_inputs
    writes it): backward declared it a required input, so a host that fed forward nothing for W had nothing to give
    backward either. It keeps the default, and a value fed to both halves still wins."""
    nodes = [helper.make_node("Mul", ["x", "W"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])]
    m = model(nodes, [("x", D, [3, 4]), ("W", D, [3, 4])], [("y", D, [3, 4])], {"W": W1})
    forward, backward, manifest = gradbuilder.split(gradbuilder.build_gradient_graph(m, wrt=["x"]))
    assert ("W", "input") in [(e.name, e.role) for e in manifest.backward_inputs]
    fwd, bwd = (ort.InferenceSession(h.SerializeToString(), providers=["CPUExecutionProvider"])
                for h in (forward, backward))
    c = rng.standard_normal((3, 4))
    for w in (None, W2):
        feeds = {"x": X} if w is None else {"x": X, "W": w}
        env = dict(zip([e.name for e in manifest.forward_outputs], fwd.run(None, feeds)))
        bfeeds = {e.name: c if e.role == "output_grad" else env.get(e.name, feeds.get(e.name))
                  for e in manifest.backward_inputs}
        (dx,) = bwd.run(None, {k: v for k, v in bfeeds.items() if v is not None})
        ref = grads_torch(lambda x, W: (torch.tanh(x * W),), {"x": X}, {"W": W1 if w is None else w}, [c])
        assert_grads({"x": dx}, ref)


def test_sequence_output_gets_no_gradient():
    """A sequence output (SequenceConstruct of y and x): taken for a float tensor of unknown type, the default build
    refused it ("its element type is unknown... Declare the output's type", which it was), and split declared it a
    tensor of type 0 in forward.onnx, which onnxruntime refuses to load."""
    nodes = [helper.make_node("Mul", ["x", "W1"], ["y"]), helper.make_node("SequenceConstruct", ["y", "x"], ["seq"])]
    m = model(nodes, [("x", D, [3, 4])], [("y", D, [3, 4])], {"W1": W1})
    m.graph.output.append(helper.make_tensor_sequence_value_info("seq", D, [3, 4]))
    training = gradbuilder.build_gradient_graph(m)
    assert yield_sig(training).non_differentiable == (1,)
    c = rng.standard_normal((3, 4))
    outs, grads = Trainer(training).step({"x": X}, [c, None])
    np.testing.assert_allclose(outs[1][1], X, rtol=1e-15)
    assert_grads(grads, grads_torch(lambda W1, x: (x * W1,), {"W1": W1}, {"x": X}, [c]))
    with pytest.raises(UnknownNameError, match="'seq' is a sequence, not a tensor"):
        gradbuilder.build_gradient_graph(m, outputs=["y", "seq"])
    with pytest.raises(LossError, match="'seq' is a sequence, not a tensor"):
        gradbuilder.build_gradient_graph(m, loss="seq")


def test_build_is_deterministic():
    a = gradbuilder.build_gradient_graph(two_layer()).SerializeToString()
    b = gradbuilder.build_gradient_graph(two_layer()).SerializeToString()
    assert a == b


def test_stop_gradient_cuts_the_edge_and_splits_to_identity() -> None:
    """y = sum(x * sg(x) + w * sg(x * w)): dx = sg(x) only, dw = sg(x * w) only (not 2x and 2w^2 x...), the
    checker and shape inference know the op, both halves run as standard ONNX (Identity, no own domain), and
    backward reads what a StopGradient copies rather than stashing the copy."""
    from gradbuilder import stop_gradient

    nodes = [stop_gradient.make_node("x", "xs"), helper.make_node("Mul", ["x", "xs"], ["a"]),
             helper.make_node("Mul", ["x", "w"], ["xw"]), stop_gradient.make_node("xw", "xws"),
             helper.make_node("Mul", ["w", "xws"], ["b"]), helper.make_node("Add", ["a", "b"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "n"])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(np.full((3, 1), 0.5, np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(gradbuilder.YIELD_DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    training = gradbuilder.build_gradient_graph(model, wrt=["x", "w"], loss="loss")
    trainer = Trainer(training)
    for half in (trainer.forward, trainer.backward):
        assert all(n.domain in ("", "ai.onnx") for n in half.graph.node)
        assert gradbuilder.YIELD_DOMAIN not in {op.domain for op in half.opset_import}
    assert [n.op_type for n in trainer.forward.graph.node].count("Identity") == 2
    read = {e.name for e in trainer.manifest.backward_inputs}
    assert not read & {"xs", "xws"} and "xw" in trainer.manifest.stashed  # the sources, not their copies
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    _, grads = trainer.step({"x": x})
    np.testing.assert_allclose(grads["x"], x, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], (x * 0.5).sum(axis=1, keepdims=True), rtol=1e-5)
