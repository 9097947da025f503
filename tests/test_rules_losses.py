import harness
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from harness import Trainer, check_op, single_op_model
from test_rules_linalg import symbolic

import gradbuilder

rng = np.random.default_rng(0)


def r(*shape):
    return np.asarray(rng.standard_normal(shape))


SHAPES = [(5, 4), (3, 4, 6), (2, 3, 2, 4)]  # (N, C), (N, C, d1), (N, C, d1, d2)


def _labels(shape, ignore=None):
    c = shape[1]
    labels = rng.integers(0, c, size=(shape[0], *shape[2:])).astype(np.int64)
    if ignore is not None:  # a few ignored samples, never all of them
        labels.flat[::3] = ignore
    return labels


def _attrs(reduction, ignore):
    return {"reduction": reduction} | ({"ignore_index": ignore} if ignore is not None else {})


CASES = [(red, ign, w) for red in ("mean", "sum", "none") for ign in (None, -100, 1) for w in (False, True)]


def _check_loss(op, torch_loss, shape, reduction, ignore, weighted):
    """One CASES row of a class-weighted loss over labels (some ignored), against `torch_loss`."""
    labels = _labels(shape, ignore)
    weights = np.abs(r(shape[1])) + 0.1 if weighted else None
    inputs = [("x", r(*shape)), ("labels", labels)] + ([("w", weights)] if weighted else [])
    tw = torch.from_numpy(weights) if weighted else None

    def ref(x, lab, *_):
        return torch_loss(x, lab, weight=tw, reduction=reduction, ignore_index=ignore if ignore is not None else -100)

    # weights are graph inputs here (not constants): they still get no gradient
    check_op(op, inputs, ref, wrt=["x"], **_attrs(reduction, ignore))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction,ignore,weighted", CASES)
def test_softmax_cross_entropy(shape, reduction, ignore, weighted):
    _check_loss("SoftmaxCrossEntropyLoss", F.cross_entropy, shape, reduction, ignore, weighted)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softmax_cross_entropy_log_prob_output(reduction):
    """Both outputs carry a gradient: the loss and the log-probabilities (log_softmax over axis 1)."""
    shape = (3, 4, 5)
    labels = _labels(shape, -1)
    check_op("SoftmaxCrossEntropyLoss", [("x", r(*shape)), ("labels", labels)],
             lambda x, lab: (F.cross_entropy(x, lab, reduction=reduction, ignore_index=-1),
                             F.log_softmax(x, dim=1)),
             n_out=2, reduction=reduction, ignore_index=-1)


def test_softmax_cross_entropy_only_log_prob_differentiated():
    check_op("SoftmaxCrossEntropyLoss", [("x", r(4, 5)), ("labels", _labels((4, 5)))],
             lambda x, lab: (F.cross_entropy(x, lab), F.log_softmax(x, dim=1)), n_out=2, diff_outputs=[1])


def test_softmax_cross_entropy_labels_as_initializer_float32_int32():
    labels = _labels((6, 3)).astype(np.int32)
    check_op("SoftmaxCrossEntropyLoss", [("x", r(6, 3).astype(np.float32)), ("labels", labels)],
             lambda x: F.cross_entropy(x, torch.from_numpy(labels).long()), consts=["labels"])


def test_softmax_cross_entropy_symbolic_batch(monkeypatch):
    """Mean over a batch whose size is only known at run time: the count is computed from the labels."""
    symbolic(monkeypatch, x={0: "N"}, labels={0: "N"})
    model = single_op_model("SoftmaxCrossEntropyLoss", [("x", r(5, 4)), ("labels", _labels((5, 4)))])
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], loss="y0")
    onnx.checker.check_model(training, full_check=True)
    trainer = Trainer(training)
    for n in (5, 2):
        xs, ls = r(n, 4), _labels((n, 4))
        _, grads = trainer.step({"x": xs, "labels": ls})
        tx = torch.from_numpy(xs).requires_grad_()
        F.cross_entropy(tx, torch.from_numpy(ls)).backward()
        np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("reduction,ignore,weighted", CASES)
def test_negative_log_likelihood(shape, reduction, ignore, weighted):
    _check_loss("NegativeLogLikelihoodLoss", F.nll_loss, shape, reduction, ignore, weighted)


def test_losses_give_labels_and_weights_no_gradient():
    """Asking for the weights' gradient yields none: they are a non-differentiable input (like torch)."""
    model = single_op_model("SoftmaxCrossEntropyLoss", [("x", r(4, 3)), ("labels", _labels((4, 3))),
                                                         ("w", np.ones(3))])
    training = gradbuilder.build_gradient_graph(model, wrt=["x", "w"], loss="y0")
    meta = gradbuilder.read_metadata(training)
    assert set(meta["gradients"]) == {"x"}
    assert "non-differentiable" in meta["no_gradient"]["w"]


@pytest.mark.parametrize("op", ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_scores_of_unknown_rank_take_the_labels_rank(monkeypatch, op, shape):
    """Scores reshaped to a shape read at run time (onnx's own expanded SoftmaxCrossEntropyLoss) have no rank for
    onnx's inference; the labels', plus the class axis, gives it."""
    make = onnx.helper.make_tensor_value_info
    monkeypatch.setattr(harness.helper, "make_tensor_value_info",
                        lambda name, elem_type, dims, *a, **k: make(name, elem_type, None if name == "x" else dims,
                                                                    *a, **k))
    xs, labels = r(*shape), _labels(shape, 1)
    model = single_op_model(op, [("x", xs), ("labels", labels)], ignore_index=1)
    assert not model.graph.input[0].type.tensor_type.HasField("shape")
    _, grads = Trainer(gradbuilder.build_gradient_graph(model, wrt=["x"], loss="y0")).step({"x": xs, "labels": labels})
    tx = torch.from_numpy(xs).requires_grad_()
    (F.nll_loss if op == "NegativeLogLikelihoodLoss" else F.cross_entropy)(
        tx, torch.from_numpy(labels), ignore_index=1).backward()
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("opset", [13, 22])
def test_nll_opsets(opset):
    shape = (4, 3)
    labels = _labels(shape)
    check_op("NegativeLogLikelihoodLoss", [("x", r(*shape)), ("labels", labels)],
             lambda x, lab: F.nll_loss(x, lab), opset=opset)


def test_softmax_cross_entropy_symbolic_classes(monkeypatch):
    """The class count is symbolic too: the one-hot classes come from the run-time shape."""
    symbolic(monkeypatch, x={0: "N", 1: "C", 2: "D"}, labels={0: "N", 1: "D"})
    shape = (3, 4, 5)
    labels = _labels(shape, -1)
    check_op("SoftmaxCrossEntropyLoss", [("x", r(*shape)), ("labels", labels)],
             lambda x, lab: F.cross_entropy(x, lab, ignore_index=-1, reduction="sum"), reduction="sum",
             ignore_index=-1)


@pytest.mark.parametrize("opset", [13, 23, 28])
def test_opset_range_ends(opset):
    shape = (4, 3, 2)
    labels = _labels(shape, 0)
    w = np.abs(r(3)) + 0.1
    tw = torch.from_numpy(w)
    check_op("SoftmaxCrossEntropyLoss", [("x", r(*shape)), ("labels", labels), ("w", w)],
             lambda x, lab: F.cross_entropy(x, lab, weight=tw, ignore_index=0), opset=opset, consts=["w"],
             ignore_index=0)
    check_op("NegativeLogLikelihoodLoss", [("x", r(*shape)), ("labels", labels), ("w", w)],
             lambda x, lab: F.nll_loss(x, lab, weight=tw, ignore_index=0), opset=opset, consts=["w"],
             ignore_index=0)


def test_float16_losses():
    shape = (4, 3)
    labels = _labels(shape)
    x = r(*shape).astype(np.float16)
    check_op("SoftmaxCrossEntropyLoss", [("x", x), ("labels", labels)], lambda x, lab: F.cross_entropy(x, lab),
             fd=False, rtol=1e-2, atol=1e-3)
    check_op("NegativeLogLikelihoodLoss", [("x", x), ("labels", labels)], lambda x, lab: F.nll_loss(x, lab),
             fd=False, rtol=1e-2, atol=1e-3)


def _gradient_ops(model: onnx.ModelProto) -> set[str]:
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], loss="y0")
    return {n.op_type for n in training.graph.node}


@pytest.mark.parametrize("op,torch_loss", [("SoftmaxCrossEntropyLoss", F.cross_entropy),
                                           ("NegativeLogLikelihoodLoss", F.nll_loss)], ids=["sce", "nll"])
@pytest.mark.parametrize("classes,ignore,onehot", [(4, None, True), (4, -100, True), (64, -100, True),
                                                   (100, -100, False), (65, None, False), (4, -4, False),
                                                   (4, 1, False)])
def test_losses_over_few_classes_take_onehot_form(op, torch_loss, classes, ignore, onehot):
    """(N, C) scores of at most ONEHOT_CLASSES classes, an ignore_index (if any) outside OneHot's [-C, C): the
    gradient is written with OneHot, else as before (a scatter, a comparison with the classes); torch's gradients
    either way (float64 and float32)."""
    for dtype in (np.float64, np.float32):
        shape = (6, classes)
        labels = _labels(shape, ignore)
        xs = r(*shape).astype(dtype)
        attrs = {} if ignore is None else {"ignore_index": ignore}
        model = single_op_model(op, [("x", xs), ("labels", labels)], **attrs)
        assert ("OneHot" in _gradient_ops(model)) == onehot
        check_op(op, [("x", xs), ("labels", labels)],
                 lambda x, lab: torch_loss(x, lab, ignore_index=-100 if ignore is None else ignore), **attrs)


def test_cross_entropy_with_every_label_ignored_has_zero_gradient():
    """A batch of ignored labels: torch's loss is nan (0 / 0) and its gradient zeros; the one-hot form's count is
    held at 1, so its gradient is zeros too, not nan."""
    xs, labels = r(5, 4), np.full(5, -100, np.int64)
    model = single_op_model("SoftmaxCrossEntropyLoss", [("x", xs), ("labels", labels)], ignore_index=-100)
    assert "OneHot" in _gradient_ops(model)
    _, grads = Trainer(gradbuilder.build_gradient_graph(model, wrt=["x"], loss="y0")).step({"x": xs, "labels": labels})
    tx = torch.from_numpy(xs).requires_grad_()
    F.cross_entropy(tx, torch.from_numpy(labels)).backward()
    np.testing.assert_array_equal(grads["x"], tx.grad.numpy())
    assert not np.any(grads["x"])


def test_a_negative_label_picks_the_class_the_forward_picked():
    """A label in [-C, 0) other than ignore_index (torch refuses it): onnxruntime's forward gathers the class it
    counts from the end, and the one-hot gradient's OneHot counts the same way, so loss and gradient agree (those
    of the label C - 1)."""
    xs, labels = r(5, 4), np.array([0, -1, 2, -100, 1])
    model = single_op_model("SoftmaxCrossEntropyLoss", [("x", xs), ("labels", labels)], ignore_index=-100)
    (loss,), grads = Trainer(gradbuilder.build_gradient_graph(model, wrt=["x"], loss="y0")).step(
        {"x": xs, "labels": labels})
    tx = torch.from_numpy(xs).requires_grad_()
    want = F.cross_entropy(tx, torch.from_numpy(np.where(labels == -1, 3, labels)))
    want.backward()
    np.testing.assert_allclose(loss, want.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-10, atol=1e-14)
