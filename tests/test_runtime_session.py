"""runtime.TrainingSession on hand-built ONNX graphs: gradients vs torch, numpy and torch tensors, None
gradients, backward specialisation, split files, Dropout kept active, errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import gradbuilder
from gradbuilder.errors import InvalidModelError
from runtime import SessionConfig, TrainingSession
from runtime.exchange import to_numpy, to_ortvalue
from runtime.ort_session import Runner, SessionLoadError

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)


def three_output_model() -> onnx.ModelProto:
    """loss = sum(tanh(x@W+b)^2), mask = x@W+b > b (bool), aux = sigmoid(x@W+b)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Tanh", ["h"], ["y"]),
        helper.make_node("Mul", ["y", "y"], ["yy"]),
        helper.make_node("ReduceSum", ["yy"], ["loss"], keepdims=0),
        helper.make_node("Greater", ["h", "b"], ["mask"]),
        helper.make_node("Sigmoid", ["h"], ["aux"]),
    ]
    graph = helper.make_graph(
        nodes, "three", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 3]),
         helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["N", 3])],
        [onnx.numpy_helper.from_array(W, "w"), onnx.numpy_helper.from_array(B, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def torch_reference(x: np.ndarray, g_loss: float | None, g_aux: np.ndarray | None) -> dict[str, np.ndarray]:
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(W, requires_grad=True)
    bt = torch.tensor(B, requires_grad=True)
    h = xt @ wt + bt
    outs, grads = [], []
    if g_loss is not None:
        outs.append((torch.tanh(h) ** 2).sum())
        grads.append(torch.tensor(g_loss))
    if g_aux is not None:
        outs.append(torch.sigmoid(h))
        grads.append(torch.tensor(g_aux))
    gx, gw, gb = torch.autograd.grad(outs, [xt, wt, bt], grads)
    return {"x": gx.numpy(), "w": gw.numpy(), "b": gb.numpy()}


@pytest.fixture(scope="module")
def session() -> TrainingSession:
    return TrainingSession.from_forward(three_output_model(), wrt=["w", "b", "x"], threads=1)


def test_outputs_and_names(session: TrainingSession) -> None:
    assert session.input_names == ["x"]
    assert session.output_names == ["loss", "mask", "aux"]
    assert session.differentiable == (0, 2)
    assert set(session.wrt) == {"w", "b", "x"}
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    outs, _ = session.forward({"x": x})
    h = x @ W + B
    np.testing.assert_allclose(outs[0], (np.tanh(h) ** 2).sum(), rtol=1e-5)
    np.testing.assert_array_equal(outs[1], h > B)
    np.testing.assert_allclose(outs[2], 1 / (1 + np.exp(-h)), rtol=1e-5)
    assert all(isinstance(o, np.ndarray) for o in outs)


@pytest.mark.parametrize("which", ["loss", "aux", "both"])
def test_gradients_match_torch_for_each_subset(session: TrainingSession, which: str) -> None:
    x = RNG.standard_normal((6, 4)).astype(np.float32)
    g_loss = 1.5 if which in ("loss", "both") else None
    g_aux = RNG.standard_normal((6, 3)).astype(np.float32) if which in ("aux", "both") else None
    _, state = session.forward([torch.from_numpy(x)])
    grads = session.backward(state, [None if g_loss is None else torch.tensor(g_loss, dtype=torch.float32), None,
                                     None if g_aux is None else torch.from_numpy(g_aux)])
    ref = torch_reference(x, g_loss, g_aux)
    for name in ("x", "w", "b"):
        assert isinstance(grads[name], torch.Tensor)
        np.testing.assert_allclose(grads[name].numpy(), ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_backward_is_specialised_per_subset(session: TrainingSession) -> None:
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    for g in ([np.float32(1), None, None], [None, None, np.ones((3, 3), np.float32)]):
        _, state = session.forward({"x": x})
        session.backward(state, g)
    backwards = session.backwards
    for outputs in (("loss",), ("aux",)):
        program, specialised = backwards[outputs]
        assert specialised
        # the backward reads no gradient for the output that got None, and computes nothing for it
        grads_in = {e.output_index for e in program.manifest.backward_inputs if e.role == "output_grad"}
        assert grads_in == {session.output_names.index(outputs[0])}
        assert len(program.backward.graph.node) < len(session.full.backward.graph.node)
    assert session.stats["fallbacks"] == 0


def test_specialised_backward_reuses_forward_helpers() -> None:
    """Dynamic shapes make rules compute Shape nodes in the forward part; a subset build's helpers are
    matched to the full forward's, so the subset backward still runs on the full forward's stash."""
    nodes = [
        helper.make_node("Flatten", ["x"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "w"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        helper.make_node("Sigmoid", ["h"], ["aux"]),
    ]
    graph = helper.make_graph(
        nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "A", 2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("aux", TensorProto.FLOAT, ["N", 3])],
        [onnx.numpy_helper.from_array(W, "w")])
    s = TrainingSession.from_forward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                     wrt=["w", "x"])
    assert any(n.op_type == "Shape" for n in s.full.forward.graph.node)
    x = torch.randn(5, 2, 2, requires_grad=True)
    for which in ("loss", "aux"):
        _, state = s.forward({"x": x})
        g = torch.randn(5, 3)
        grads = s.backward(state, {which: torch.tensor(1.0) if which == "loss" else g})
        h = x.flatten(1) @ torch.from_numpy(W)
        out = h.tanh().sum() if which == "loss" else (h.sigmoid() * g).sum()
        ref = torch.autograd.grad(out, x)[0]
        torch.testing.assert_close(grads["x"], ref)
        program, specialised = s.backwards[(which,)]
        assert specialised and not program.missing_stash(s.full)
    assert s.stats == {"backward_builds": 2, "fallbacks": 0}


def test_alignment_renames_matches_moves_the_rest_and_avoids_clashes() -> None:
    """programs._align on hand-made graphs: a helper equal to one of the full forward's takes its name, a
    helper with no equal moves behind the Yield, and a backward tensor already using a taken name is renamed."""
    from gradbuilder.yield_op import YieldSignature, make_yield
    from runtime.programs import _align

    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)

    source = [helper.make_node("Relu", ["x"], ["r"])]
    full = helper.make_model(helper.make_graph(
        [*source, helper.make_node("Shape", ["r"], ["r/Shape_1"])], "full", [vi("x")], [vi("r"), vi("r/Shape_1")]))
    sub_nodes = [
        *source,
        helper.make_node("Shape", ["r"], ["r/Shape"]),  # equal to full's r/Shape_1
        helper.make_node("Shape", ["x"], ["x/Shape"], start=1),  # no equal: recomputed in backward
        make_yield(YieldSignature(("r",), ("r_host_grad",), (), ()), "y"),
        helper.make_node("Reshape", ["r_host_grad", "r/Shape"], ["r/Shape_1"]),  # clashes with the new name
        helper.make_node("Expand", ["r/Shape_1", "x/Shape"], ["x_grad"]),
    ]
    sub = helper.make_model(helper.make_graph(sub_nodes, "sub", [vi("x")], [vi("x_grad")]))
    _align(sub, full)
    ops = [(n.op_type, list(n.input), list(n.output)) for n in sub.graph.node]
    assert ops[1] == ("Shape", ["r"], ["r/Shape_1"])
    assert ops[2][0] == "Yield" and ops[3] == ("Shape", ["x"], ["x/Shape"])
    reshape, expand = ops[4], ops[5]
    assert reshape[1] == ["r_host_grad", "r/Shape_1"] and reshape[2][0] not in ("r/Shape_1", "r/Shape")
    assert expand[1] == [reshape[2][0], "x/Shape"] and expand[2] == ["x_grad"]


def test_dict_output_grads_and_no_gradient_at_all(session: TrainingSession) -> None:
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    _, state = session.forward({"x": x})
    assert session.backward(state, {"loss": None}) == {}
    _, state = session.forward({"x": x})
    grads = session.backward(state, {"loss": np.float32(1.0)})
    np.testing.assert_allclose(grads["w"], torch_reference(x, 1.0, None)["w"], rtol=1e-5, atol=1e-6)
    with pytest.raises(KeyError, match="not module outputs"):
        session.backward(state, {"nope": np.float32(1.0)})


def test_state_is_freed_unless_retained(session: TrainingSession) -> None:
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    _, state = session.forward({"x": x})
    first = session.backward(state, [np.float32(1.0), None, None], retain=True)
    second = session.backward(state, [np.float32(1.0), None, None])
    np.testing.assert_array_equal(first["w"], second["w"])
    with pytest.raises(RuntimeError, match="second time"):
        session.backward(state, [np.float32(1.0), None, None])


def test_unspecialised_feeds_zeros(session: TrainingSession) -> None:
    plain = TrainingSession.from_forward(three_output_model(), wrt=["w", "b", "x"], specialise=False)
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    _, state = plain.forward({"x": x})
    grads = plain.backward(state, [None, None, np.ones((3, 3), np.float32)])
    np.testing.assert_allclose(grads["w"], torch_reference(x, None, np.ones((3, 3), np.float32))["w"],
                               rtol=1e-5, atol=1e-6)
    assert plain.backwards == {("aux",): (plain.full, False)}  # the full program, fed a zero for the loss
    _, state = plain.forward({"x": x})
    grads = plain.backward(state, [np.float32(1.0), None, None])  # aux gets full-shape zeros (full_shape_outputs)
    assert 2 in plain.full.manifest.full_shape_outputs
    np.testing.assert_allclose(grads["w"], torch_reference(x, 1.0, None)["w"], rtol=1e-5, atol=1e-6)
    assert plain.stats["backward_builds"] == 0


def test_training_graph_and_split_files(tmp_path) -> None:
    training = gradbuilder.build_gradient_graph(three_output_model(), wrt=["w", "b"])
    forward, backward, manifest = gradbuilder.split(training)
    onnx.save(training, tmp_path / "training.onnx")
    onnx.save(forward, tmp_path / "forward.onnx")
    onnx.save(backward, tmp_path / "backward.onnx")
    (tmp_path / "manifest.json").write_text(manifest.to_json())
    x = RNG.standard_normal((4, 4)).astype(np.float32)
    ref = torch_reference(x, 1.0, None)
    for s in (TrainingSession(tmp_path / "training.onnx"), TrainingSession(training),
              TrainingSession.from_split(tmp_path / "forward.onnx", tmp_path / "backward.onnx",
                                         tmp_path / "manifest.json")):
        _, state = s.forward({"x": x})
        grads = s.backward(state, [np.float32(1.0), None, None])  # specialised: only the loss
        assert set(grads) == {"w", "b"}
        np.testing.assert_allclose(grads["w"], ref["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(s.run({"x": x})[2], 1 / (1 + np.exp(-(x @ W + B))), rtol=1e-5)


def test_loss_graph_runs_backward_without_output_grads() -> None:
    s = TrainingSession.from_forward(three_output_model(), wrt=["w"], loss="loss")
    x = RNG.standard_normal((4, 4)).astype(np.float32)
    _, state = s.forward({"x": x})
    grads = s.backward(state, [None, None, None])
    np.testing.assert_allclose(grads["w"], torch_reference(x, 1.0, None)["w"], rtol=1e-5, atol=1e-6)


def test_parameters_fed_as_inputs_see_in_place_updates() -> None:
    """A graph whose weight is an input: updating the torch tensor in place changes the next step."""
    model = three_output_model()
    w = model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.dims)))
    del model.graph.initializer[0]
    s = TrainingSession.from_forward(model, wrt=["w"], outputs=["loss"])
    weight = torch.from_numpy(W.copy())
    x = torch.randn(3, 4)
    before, _ = s.forward({"x": x, "w": weight})
    weight.mul_(0.5)
    after, _ = s.forward({"x": x, "w": weight})
    expected = (torch.tanh(x @ weight + torch.from_numpy(B)) ** 2).sum()
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(after[0], expected)


def dropout_model(ratio: float) -> onnx.ModelProto:
    nodes = [helper.make_node("Dropout", ["x", "ratio", "train"], ["y", "keep"]),
             helper.make_node("Mul", ["y", "w"], ["z"])]
    graph = helper.make_graph(
        nodes, "drop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1000])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 1000])],
        [onnx.numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
         onnx.numpy_helper.from_array(np.array(True), "train"),
         onnx.numpy_helper.from_array(np.ones(1000, np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_training_dropout_really_drops() -> None:
    s = TrainingSession.from_forward(dropout_model(0.5), wrt=["w"])
    x = np.ones((8, 1000), np.float32)
    (z,), state = s.forward({"x": x})
    dropped = float((z == 0).mean())
    assert 0.4 < dropped < 0.6, dropped
    np.testing.assert_allclose(z[z != 0], 2.0)
    grads = s.backward(state, [np.ones_like(z)])
    np.testing.assert_allclose(grads["w"], z.sum(0))  # the same mask in backward
    (zi,) = s.run({"x": x})
    assert 0.4 < float((zi == 0).mean()) < 0.6  # inference on the training graph still drops (training_mode=1)


def test_thread_count_is_set() -> None:
    s = TrainingSession.from_forward(dropout_model(0.0), wrt=["w"], config=SessionConfig(threads=1))
    options = s._fwd.session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.graph_optimization_level != 0


def test_save_dir_writes_every_file(tmp_path) -> None:
    s = TrainingSession.from_forward(three_output_model(), wrt=["w"], save_dir=tmp_path)
    _, state = s.forward({"x": np.ones((2, 4), np.float32)})
    s.backward(state, [None, None, np.ones((2, 3), np.float32)])
    names = {p.name for p in tmp_path.iterdir()}
    assert {"training.onnx", "forward.onnx", "backward.onnx", "manifest.json", "backward_2.onnx"} <= names


def test_input_errors(session: TrainingSession) -> None:
    with pytest.raises(KeyError, match="missing inputs"):
        session.forward({"y": np.ones((1, 4), np.float32)})
    with pytest.raises(ValueError, match="expected 1 inputs"):
        session.forward([])
    _, state = session.forward({"x": np.ones((1, 4), np.float32)})
    with pytest.raises(ValueError, match="expected 3 output gradients"):
        session.backward(state, [None])


def test_backward_sessions_keep_nchw(tmp_path, monkeypatch) -> None:
    """onnxruntime's NCHWc layout takes a Conv with a constant weight and one input channel: the one-hot unfold
    of a 1-channel Conv's weight gradient in backward, whose output it would reorder back at a cost. The
    backward session goes without it (its optimized graph has no NCHWc node); the forward keeps its own."""
    saved = []
    options = SessionConfig.options

    def saving(self):
        so = options(self)
        so.optimized_model_filepath = str(tmp_path / f"{len(saved)}.onnx")
        saved.append(so.optimized_model_filepath)
        return so

    monkeypatch.setattr(SessionConfig, "options", saving)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[2] * 4),
             helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 28, 28]),
                                              helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 1, 5, 5])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = TrainingSession.from_forward(model, wrt=["w"], loss="loss", config=SessionConfig(threads=1))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 1, 28, 28)).astype(np.float32), rng.standard_normal((8, 1, 5, 5)).astype(np.float32)
    _, state = session.forward({"x": x, "w": w})
    grads = session.backward(state, [None])
    tx, tw = torch.from_numpy(x), torch.from_numpy(w).requires_grad_()
    torch.nn.functional.conv2d(tx, tw, padding=2).square().sum().backward()
    np.testing.assert_allclose(grads["w"], tw.grad.numpy(), rtol=1e-3, atol=1e-3)
    optimized = [onnx.load(p) for p in saved]
    backward = [m for m in optimized if any(o.name.startswith("w") or "grad" in o.name for o in m.graph.output)]
    assert backward and all(n.domain != "com.microsoft.nchwc" for m in backward for n in m.graph.node)


def _config_entry(options, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # "does not have configuration with key"
        return None


def test_sessions_share_one_arena() -> None:
    """Forward and backward allocate from onnxruntime's one process-wide arena by default (a backward writes
    where the forward just did, still in the cache); a config opts out, with the same results."""
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    seen = []
    for shared in (True, False):
        s = TrainingSession.from_forward(three_output_model(), wrt=["w"], config=SessionConfig(shared_arena=shared))
        outs, state = s.forward({"x": x})
        grads = s.backward(state, [None, None, np.ones((2, 3), np.float32)])
        runners = [s._fwd, *(b.runner for b in s._backwards.values())]
        options = [r.session.get_session_options() for r in runners]
        assert len(runners) == 2 and all(o.enable_cpu_mem_arena for o in options)
        assert {_config_entry(o, "session.use_env_allocators") for o in options} == {"1" if shared else None}
        seen.append((outs, grads))
    (outs_a, grads_a), (outs_b, grads_b) = seen
    for a, b in zip(outs_a, outs_b):
        np.testing.assert_array_equal(a, b)
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        np.testing.assert_array_equal(grads_a[k], grads_b[k])


@pytest.mark.parametrize("grad", [np.array(2.0, np.float32), np.float32(2.0)], ids=["0-d array", "numpy scalar"])
def test_numpy_scalar_host_gradient_keeps_its_rank(grad) -> None:
    """A loss's host gradient given as a 0-d numpy array reached onnxruntime as shape [1]
    (`np.ascontiguousarray` makes 0-d arrays 1-d): a mean over named axes unsqueezed it to [1, 1, 1] and the
    weight gradient's Gemm failed (found by replaying the fuzz corpus through TrainingSession)."""
    w = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"]),
             helper.make_node("ReduceMean", ["z"], ["loss"], keepdims=0, axes=[0, 1])]
    graph = helper.make_graph(nodes, "mean", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(w, "W")])
    session = TrainingSession.from_forward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                           threads=1)
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    _, state = session.forward({"x": x})
    got = session.backward(state, [grad])["W"]
    np.testing.assert_allclose(np.asarray(got), 2.0 * np.outer(x.sum(0), np.ones(5)) / 15, rtol=1e-6)


def _reshaped_to_run_time_target(x_dims: list, y_dims: list, target: list[int]) -> onnx.ModelProto:
    """y = Reshape(x * W, target), the target's length hidden from inference behind a Slice of computed end."""
    nodes = [helper.make_node("Mul", ["x", "W"], ["h"]), helper.make_node("Identity", ["k"], ["end"]),
             helper.make_node("Slice", ["shape", "zero", "end"], ["target"]),
             helper.make_node("Reshape", ["h", "target"], ["y"], name="reshape")]
    inits = [onnx.numpy_helper.from_array(np.full((2, 3), 2.0, np.float32), "W"),
             onnx.numpy_helper.from_array(np.array([*target, 1], np.int64), "shape"),
             onnx.numpy_helper.from_array(np.array([0], np.int64), "zero"),
             onnx.numpy_helper.from_array(np.array([len(target)], np.int64), "k")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_dims)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize(("x_dims", "y_dims", "target", "said"), [
    ([2, 3], [3, 2], [6], "rank 1 where the model declares rank 2"),
    ([2, 3], [3], [6], "size 6 on axis 0 where the model declares 3"),
    (["b", 3], ["b"], [6], "size 6 on axis 0, declared 'b', which 'x' has as 2"),
    ([2, 3], ["n", "n"], [3, 2], "size 2 on axis 1, declared 'n' like an earlier axis of size 3"),
    ([2, 3], ["n"], [6], None),
    (["b", 3], ["b", 3], [2, 3], None),
], ids=["rank", "size", "symbol of an input", "symbol twice", "fresh symbol", "as declared"])
def test_outputs_are_held_to_their_declared_shapes(x_dims, y_dims, target, said) -> None:
    """Inference cannot size y, so the build takes its declared shape, and the backward its gradient in it: a wrong
    declaration is refused at the first forward, naming the output, not met as onnxruntime refusing the host's
    gradient in backward."""
    session = TrainingSession.from_forward(_reshaped_to_run_time_target(x_dims, y_dims, target), threads=1)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    if said is not None:
        with pytest.raises(InvalidModelError, match=f"graph output 'y' .* shape \\[.*\\]: {said}"):
            session.forward({"x": x})
        return
    (y,), state = session.forward({"x": x})
    assert list(np.asarray(y).shape) == target
    grads = session.backward(state, [np.ones(target, np.float32)])
    np.testing.assert_array_equal(np.asarray(grads["W"]), x)


def test_an_input_returned_as_an_output_of_another_declared_shape_keeps_its_own() -> None:
    """x fed as [5], returned as an output declared [batch, 3], and flattened (to [5, 1]) for an Add with a [3]
    bias: the rewrites took x's shape from the output's declaration, dropped the Flatten as changing nothing, and
    onnxruntime could not load the forward ("Incompatible dimensions" at the Add; runtime replay seed 429). The
    input's declaration holds; the first forward names the output's as the run breaks it."""
    nodes = [helper.make_node("Flatten", ["x"], ["f"]), helper.make_node("Add", ["f", "b"], ["t"]),
             helper.make_node("Mul", ["t", "W"], ["u"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
                               helper.make_tensor_value_info("u", TensorProto.FLOAT, [5, 3])],
                              [helper.make_tensor("b", TensorProto.FLOAT, [3], [0.1, 0.2, 0.3]),
                               helper.make_tensor("W", TensorProto.FLOAT, [3], [1.5, -2.0, 0.5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = TrainingSession.from_forward(model, threads=1)
    with pytest.raises(InvalidModelError, match=r"graph output 'x' came out of the forward with shape \[5\]"):
        session.forward({"x": np.arange(5, dtype=np.float32)})


def test_a_declared_shape_the_run_breaks_before_any_output_is_refused() -> None:
    """y declared [batch, 3] but a Concat along the batch: onnxruntime plans y's consumer's buffer from the
    declaration and fails mid-run ("Shape mismatch attempting to re-use buffer"), before any output exists for the
    check above; the first forward says so as a declaration the run breaks (runtime replay seed 45 met it)."""
    nodes = [helper.make_node("Add", ["x", "b"], ["t"]), helper.make_node("Concat", ["t", "x"], ["y"], axis=0),
             helper.make_node("Neg", ["y"], ["n"], name="negate"), helper.make_node("Min", ["n", "y"], ["m"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
                               helper.make_tensor_value_info("m", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(np.array([0.1, 0.2, 0.3], np.float32), "b")])
    session = TrainingSession.from_forward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                           threads=1)
    with pytest.raises(InvalidModelError, match=r"shapes the model declares, which the run breaks .*re-use buffer"):
        session.forward({"x": np.ones((2, 3), np.float32)})


def test_a_graph_onnxruntime_optimizes_wrong_runs_unoptimized() -> None:
    """onnxruntime's optimizers fail on some graphs its kernels run (here a scalar reduced over axes computed from a
    constant: folding them, its shape inference refuses what the kernel copies; runtime replay seed 155 met its
    GemmTransposeFusion dropping a node): the session runs them without optimizations, warned, as onnxruntime's
    unoptimized session computes them."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Identity", ["axes"], ["a"]),
             helper.make_node("ReduceMean", ["s", "a"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.warns(RuntimeWarning, match="graph optimizations failed on the test model"):
        runner = Runner(model, SessionConfig(threads=1), "test")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert float(to_numpy(runner.run({"x": to_ortvalue(x)})[0])) == 15.0
    unknown = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["y"])], "g", graph.input, graph.output)
    with pytest.raises(SessionLoadError, match=r"cannot load the test model: .*Frobnicate"):  # unoptimized neither
        Runner(helper.make_model(unknown, opset_imports=[helper.make_opsetid("", 18)]), SessionConfig(threads=1),
               "test")



@pytest.mark.parametrize("read", ["x", "m", "o"])
def test_an_op_without_a_float64_kernel_is_refused_as_such(read: str) -> None:
    """onnxruntime's CPU provider has no float64 Det (nor Conv, Atan, Erf, ...; the elementwise ones are written out,
    `double_forms`): a module made .double() learns that this node computes in float64 and what to do, not only
    onnxruntime's "Could not find an implementation"; the Det's input a graph input, a tensor computed before it,
    or one also a graph output (a forward's stashed tensor). The Erf beside it is written out first. In float32
    both load."""
    for elem, refused in ((TensorProto.DOUBLE, True), (TensorProto.FLOAT, False)):
        nodes = [helper.make_node("Mul", ["x", "x"], ["m"]), helper.make_node("Neg", ["x"], ["o"]),
                 helper.make_node("Erf", ["x"], ["e"], name="the_erf"),
                 helper.make_node("Det", [read], ["y"], name="the_det")]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, [3, 3])],
                                  [helper.make_tensor_value_info("y", elem, []),
                                   *(helper.make_tensor_value_info(o, elem, [3, 3]) for o in ("o", "e"))])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        if not refused:
            Runner(model, SessionConfig(threads=1), "test")
            continue
        with pytest.raises(SessionLoadError, match=r"Det.*'the_det'.* That node computes in float64, .*train the "
                                                   r"module in float32"):
            Runner(model, SessionConfig(threads=1), "test")


@pytest.mark.parametrize("op", ["Mul", "Div"])
def test_float64_factors_near_one_are_kept(op: str) -> None:
    """onnxruntime's NoopElimination reads a scalar constant in float32: it removed a float64 Mul by 1 - 1e-9 (and a
    Div by 1 + 1e-9) as a Mul by 1. Sessions of graphs holding such constants run without it."""
    factor = 1 - 1e-9 if op == "Mul" else 1 + 1e-9
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.array(factor))),
             helper.make_node(op, ["r", "c"], ["m"]), helper.make_node("Neg", ["m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])])
    runner = Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), SessionConfig(threads=1),
                    "test")
    x = np.array([1.0, 2.0, 3.0])
    got = to_numpy(runner.run({"x": to_ortvalue(x)}, ["y"])[0])
    np.testing.assert_array_equal(got, -(x * factor if op == "Mul" else x / factor))


def test_an_expand_to_an_empty_size_is_kept() -> None:
    """onnxruntime's ExpandElimination took an Expand of [1, 1] to the constant size [0, 1] for a no-op (its
    result [1, 1], the backward sized [0, 1] by the graph refused it: replay fuzz seed 97); such graphs run
    without it, the result empty as ONNX and numpy broadcast."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["r"]), helper.make_node("Expand", ["r", "size"], ["e"]),
             helper.make_node("Softmax", ["e"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("size", TensorProto.INT64, [2], [0, 1])])
    runner = Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), SessionConfig(threads=1),
                    "test")
    got = to_numpy(runner.run({"x": to_ortvalue(np.ones((2, 3), np.float32))}, ["y"])[0])
    assert got.shape == (0, 1)


def test_a_relu_bounding_a_clip_is_kept() -> None:
    """onnxruntime's FuseReluClip gave a Clip the input of a Relu it read, though as its max: Clip(d, 2, Relu(d))
    ran as Clip(d, 2, d), d below 2 where ONNX's Clip gives its max, Relu(d) (replay fuzz seed 438); such graphs
    run without it. onnxruntime's Clip takes scalar bounds only: one value a run."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Clip", ["x", "two", "r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
                              [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    runner = Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), SessionConfig(threads=1),
                    "test")
    for x in np.array([-3.0, 0.5, 1.5, 2.5, 4.0], np.float32):
        got = to_numpy(runner.run({"x": to_ortvalue(np.array(x))}, ["y"])[0])
        assert got == min(max(x, 2), max(x, 0)), x  # the max, Relu(x), where it is below the min


def test_a_sequence_output_is_refused_by_name() -> None:
    """The builder now leaves a sequence output out of the gradients; the session's forward then failed in DLPack
    ("Only tensor type OrtValues are supported") at its first run. Refused when the session is made, named."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"]), helper.make_node("SplitToSequence", ["y"], ["parts"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None)],
                              [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(InvalidModelError, match="graph output 'parts' is a sequence, not a tensor"):
        TrainingSession.from_forward(model)
