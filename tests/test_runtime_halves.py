"""runtime/samples.py and runtime/halves.py: a loss computed sample by sample is proven so from the graph, and its
fused step run as two halves of the batch at once gives torch's loss and gradients (unequal halves, ignored labels,
sums), falling back to the whole batch where halves cannot be weighed or differ."""

from __future__ import annotations

import copy
import multiprocessing
import os
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from runtime import ORTModule, exchange, halves, openmp, samples
from runtime.ort_session import Runner
from runtime.session import TrainingSession


def _graph(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto],
           outputs: tuple[str, ...] = ("loss",)) -> onnx.ModelProto:
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [] if o in ("loss", "total") else ["N", 3])
            for o in outputs]
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outs, inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def _const(name: str, values: list[int] | np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64 if isinstance(values, list) else None), name)


def _classifier(*middle: onnx.NodeProto, reduction: str = "mean", weights: bool = False, seq: int = 0,
                outputs: tuple[str, ...] = ("loss",), tail: tuple[onnx.NodeProto, ...] = ()) -> onnx.ModelProto:
    """x [N, 4] (or [N, seq, 4]) -> `middle` from 'x' to 'h' (Identity where empty) -> Gemm -> a loss against y."""
    rng = np.random.default_rng(0)
    x_shape, y_shape = (["N", seq, 4], ["N", seq]) if seq else (["N", 4], ["N"])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
              helper.make_tensor_value_info("y", TensorProto.INT64, y_shape)]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w"),
             _const("rows", [-1, 4]), _const("flat", [-1])]
    nodes = list(middle) or [helper.make_node("Identity", ["x"], ["h"])]
    nodes += [helper.make_node("Reshape", ["h", "rows"], ["h2"]), helper.make_node("MatMul", ["h2", "w"], ["s"]),
              helper.make_node("Reshape", ["y", "flat"], ["t"])]
    loss_in = ["s", "t"]
    if weights:
        inits.append(numpy_helper.from_array(np.ones(3, np.float32), "cw"))
        loss_in.append("cw")
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", loss_in, ["loss"], reduction=reduction,
                                  ignore_index=-100))
    return _graph(nodes + list(tail), inputs, inits, outputs)


PROVEN = {
    "plain": _classifier(),
    "relu and a fixed bias": _classifier(helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "w0"],
                                                                                                   ["h"])),
    "tokens: rows of a sequence": _classifier(seq=5),
    "softmax along features": _classifier(helper.make_node("Softmax", ["x"], ["h"], axis=-1)),
    "sum": _classifier(reduction="sum"),
    "positions from the sequence's length": _classifier(
        helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "i1"], ["length"]),
        helper.make_node("Range", ["i0", "length", "i1"], ["steps"]),
        helper.make_node("Cast", ["steps"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["f", "i1_1d"], ["positions"]),
        helper.make_node("Add", ["x", "positions"], ["h"]), seq=5),
    "a dropout that drops nothing": _classifier(helper.make_node("Dropout", ["x", "zero_ratio", "yes"], ["h"])),
    "the loss and the scores": _classifier(outputs=("loss", "s")),
    "a dropout (the runtime cuts its mask)": _classifier(helper.make_node("Dropout", ["x", "half", "yes"], ["h"])),
}
SCORES = {"the loss and the scores": (("s", 1),)}
"""The cases' outputs holding the batch besides the loss."""
REFUSED = {
    "softmax along the batch": (_classifier(helper.make_node("Softmax", ["x"], ["h"], axis=0)), "batch's axis"),
    "mean over the batch": (_classifier(helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
                                        helper.make_node("Sub", ["x", "m"], ["h"])), "reduces over the batch"),
    "batch statistics": (_classifier(helper.make_node("BatchNormalization", ["x", "one", "zero", "zero", "one"],
                                                      ["h"], training_mode=1)), "batch statistics"),
    "transposed": (_classifier(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                               helper.make_node("Transpose", ["xt"], ["h"], perm=[1, 0])), "first axis"),
    "rows stacked": (_classifier(helper.make_node("Concat", ["x", "x"], ["h"], axis=0)), "batch's axis"),
    "weighted": (_classifier(weights=True), "weighted"),
    "an output of the whole batch": (_classifier(outputs=("loss", "total"), tail=(
        helper.make_node("ReduceSum", ["s"], ["total"], keepdims=0),)), "reduces every axis"),
    "the loss computed with further": (_classifier(outputs=("total",), tail=(
        helper.make_node("Mul", ["loss", "loss"], ["total"]),)), "computed with further"),
    "each sample's position in the batch": (_classifier(
        helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "i0"], ["n"]),
        helper.make_node("Range", ["i0", "n", "i1"], ["steps"]),
        helper.make_node("Cast", ["steps"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["f", "i1_1d"], ["positions"]),
        helper.make_node("Add", ["x", "positions"], ["h"])), "batch's size"),
    "a dropout's mask read": (_classifier(
        helper.make_node("Dropout", ["x", "half", "yes"], ["d", "m"]),
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["d", "mf"], ["h"])),
        "mask is read"),
    "the batch's size as a number": (_classifier(
        helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Cast", ["shape"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["f"], ["n"], keepdims=0), helper.make_node("Div", ["x", "n"], ["h"])),
        "batch's size"),
}


def _with_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """The fixed tensors the middles read: w0 [4], one/zero [4], index scalars, dropout ratios and mode."""
    g = model.graph
    g.initializer.extend([numpy_helper.from_array(np.full(4, v, np.float32), n)
                          for n, v in (("w0", 0.5), ("one", 1.0), ("zero", 0.0))])
    g.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), "i0"),
                          numpy_helper.from_array(np.array(1, np.int64), "i1"), _const("i1_1d", [1]),
                          numpy_helper.from_array(np.array(0.0, np.float32), "zero_ratio"),
                          numpy_helper.from_array(np.array(0.5, np.float32), "half"),
                          numpy_helper.from_array(np.array(True), "yes")])
    return model


@pytest.mark.parametrize("case", PROVEN)
def test_proven(case: str) -> None:
    model = _with_constants(PROVEN[case])
    onnx.checker.check_model(model, full_check=True)
    assert samples.prove(model) == samples.Rows(("x", "y"), SCORES.get(case, ()),
                                                samples.Loss("loss", "y", -100, case != "sum"))


@pytest.mark.parametrize("case", REFUSED)
def test_refused(case: str) -> None:
    model, why = REFUSED[case]
    model = _with_constants(model)
    with pytest.raises(samples.NotRows, match=why):
        samples.prove(model)
    assert samples.proven(model) is None


@pytest.fixture
def free(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine read as free with two cores (the halves would step aside for a crowd, as tests running beside
    these make, and need a second core), and split steps halved from the fused steps' `MIN_ROWS` (these batches are
    small)."""
    monkeypatch.setattr(openmp, "room", lambda threads: (False, False))
    monkeypatch.setattr(openmp, "usable_cores", lambda: 2)
    monkeypatch.setattr(halves, "SPLIT_MIN_ROWS", halves.MIN_ROWS)


class Net(nn.Module):
    """Conv, pool and linear layers, then cross-entropy (mean, ignoring -100, or a sum): its activations outweigh
    its weights, so its step runs fused (`halves.Halves`)."""

    def __init__(self, reduction: str = "mean"):
        super().__init__()
        self.reduction = reduction
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(4 * 6 * 6, 5), nn.Tanh(), nn.Linear(5, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y, reduction=self.reduction)


class Wide(Net):
    """A convolution and dense layers whose weights outweigh the activations, so its step runs split
    (`halves.SplitHalves`)."""

    def __init__(self, reduction: str = "mean"):
        nn.Module.__init__(self)
        self.reduction = reduction
        self.net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(288, 96), nn.ReLU(),
                                 nn.Linear(96, 5))


KINDS = {"fused": Net, "split": Wide}


def _halves_of(om: ORTModule, kind: str) -> halves.Halves | halves.SplitHalves:
    """The halves of the module's session (made at its second call: the first decides whether to fuse)."""
    (session,) = om.training_sessions()
    if kind == "fused":
        assert session._fused is not None and session._split is None, "the step is not fused"
        got = session._fused.halves
    else:
        assert session._fused is None, "the step is fused"
        got = session._split
    assert got is not None, "the step did not get halves"
    return got


def _step(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    loss = module(x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


def _like_torch(net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor, grads: list[torch.Tensor]
                ) -> None:
    """ORTModule's loss and gradients against torch's step of `net` in float32."""
    want_loss, want = _step(net, x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def _batch(rows: int, seed: int, ignored: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(rows, 1, 12, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)
    y[ignored] = -100
    return x, y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("reduction", "rows", "ignored"), [
    ("mean", 16, []), ("mean", 13, [0, 1, 2, 9]), ("sum", 11, [4])])
def test_halves_match_torch(kind: str, reduction: str, rows: int, ignored: list[int], free: None) -> None:
    """The halves' loss and gradients against torch's in float64: halves of unequal rows and unequal counts of
    labels not ignored, weighed by those counts (mean) or added (sum); and along a random direction of the
    parameters, the loss's change matches the gradient (finite differences)."""
    torch.manual_seed(0)
    net = KINDS[kind](reduction)
    om = ORTModule(KINDS[kind](reduction), threads=2)
    om.load_state_dict(net.state_dict())
    x, y = _batch(rows, 1, ignored)
    _step(om, x, y)  # the first call: export, checks, the decision to fuse
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(om, x, y)  # the halves made, and compared with the whole batch's run
        h = _halves_of(om, kind)
        h.pin(True)
        runs = h.runs
        loss, grads = _step(om, x, y)
    assert h.checked and not h.off and h.runs == runs + 1
    double = net.double()
    want_loss, want = _step(double, x.double(), y)
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=1e-6)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=2e-6)
    direction = [torch.randn_like(p) for p in double.parameters()]
    eps = 1e-6
    with torch.no_grad():
        for p, t in zip(double.parameters(), direction):
            p.add_(t, alpha=eps)
        up = double(x.double(), y)
        for p, t in zip(double.parameters(), direction):
            p.sub_(t, alpha=2 * eps)
        down = double(x.double(), y)
    slope = float((up - down) / (2 * eps))
    along = sum(float((g.double() * t).sum()) for g, t in zip(grads, direction))
    assert along == pytest.approx(slope, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("reduction", "rows", "ignored"), [("mean", 16, [3]), ("sum", 19, [])])
def test_halves_give_the_inputs_their_rows_gradient(kind: str, reduction: str, rows: int, ignored: list[int],
                                                     free: None) -> None:
    """An input requiring grad (a saliency map, an adversarial step) gets each half's rows of its gradient from that
    half's run, weighed as the half's loss is, joined along the batch; its parameters' gradients are added as
    without. Against torch's in float64, with the halves running (no warning of a mismatch: they once added the two
    halves' input gradients, so the first check turned them off with a warning)."""
    torch.manual_seed(0)
    net = KINDS[kind](reduction)
    om = ORTModule(KINDS[kind](reduction), threads=2)
    om.load_state_dict(net.state_dict())
    x, y = _batch(rows, 4, ignored)

    def step(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        module(x, y).backward()
        return x.grad, [p.grad.clone() for p in module.parameters()]

    step(om, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(om, x)
        h = _halves_of(om, kind)
        h.pin(True)
        runs = h.runs
        got, grads = step(om, x)
    assert h.checked and not h.off and h.runs == runs + 1
    want, want_grads = step(net.double(), x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-7)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_half_with_every_label_ignored(kind: str, free: None) -> None:
    """A half whose labels are all ignored has no mean of its own (its loss 0 / 0): split steps run the batch whole;
    fused halves count their labels in their runs, and the batch's loss and gradients are the other half's (its
    weight 1, the empty half's 0). A batch with every label ignored: torch's nan loss and zero gradients."""
    torch.manual_seed(0)
    net = KINDS[kind]()
    om = ORTModule(KINDS[kind](), threads=2)
    om.load_state_dict(net.state_dict())
    _step(om, *_batch(12, 2, []))
    _step(om, *_batch(12, 2, []))
    h = _halves_of(om, kind)
    h.pin(True)
    for ignored in (list(range(6)), list(range(6, 12))):
        x, y = _batch(12, 2, ignored)
        runs = h.runs
        loss, grads = _step(om, x, y)
        assert h.runs == runs + (kind == "fused")
        cut = halves.cut({"x": exchange.to_ortvalue(x), "y": exchange.to_ortvalue(y)}, h.rows, counted=h.counted)
        assert (cut is None) == (kind == "split") and h.counted == (kind == "fused")
        _like_torch(net, x, y, loss, grads)
    x, y = _batch(12, 2, list(range(12)))
    loss, grads = _step(om, x, y)
    want_loss, want = _step(net, x, y)
    assert torch.isnan(loss) and torch.isnan(want_loss)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("kind", KINDS)
def test_second_caller_runs_whole(kind: str, free: None) -> None:
    """While one thread's halves run (their lock held), another thread's step runs its batch whole: the worker takes
    one job at a time."""
    torch.manual_seed(0)
    om = ORTModule(KINDS[kind](), threads=2)
    x, y = _batch(16, 5, [])
    _step(om, x, y)
    _step(om, x, y)
    h = _halves_of(om, kind)
    h.pin(True)
    runs = h.runs
    _step(om, x, y)
    assert h.runs == runs + 1
    with h._busy:
        _step(om, x, y)
    assert h.runs == runs + 1


class BatchStats(nn.Module):
    """A loss over batch statistics (BatchNorm in training mode): halves would each normalize by their own."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Flatten(), nn.Linear(4 * 6 * 6, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


class WideStats(BatchStats):
    """Batch statistics in a step that runs split."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(288, 96), nn.BatchNorm1d(96),
                                 nn.ReLU(), nn.Linear(96, 5))


@pytest.mark.parametrize("kind", KINDS)
def test_batch_statistics_get_no_halves(kind: str, monkeypatch: pytest.MonkeyPatch, free: None) -> None:
    """The proof refuses a BatchNorm in training mode; forced past it, the first halves' run differs from the whole
    run: a warning, the whole batch from then on, and torch's gradients all along."""
    make = BatchStats if kind == "fused" else WideStats
    torch.manual_seed(0)
    om = ORTModule(make(), threads=2)
    x, y = _batch(16, 3, [])
    _step(om, x, y)
    _step(om, x, y)
    (session,) = om.training_sessions()
    assert session._split is None and (session._fused is None or session._fused.halves is None)
    def forced(model: onnx.ModelProto) -> samples.Rows:  # a split step's running statistics taken for the batch's
        others = tuple((o.name, 1) for o in model.graph.output if o.name != "output" and kind == "split")
        return samples.Rows(("x", "y"), others, samples.Loss("output", "y", -100, True))

    monkeypatch.setattr(samples, "proven", forced)
    torch.manual_seed(0)
    net = make()
    om = ORTModule(make(), threads=2)
    om.load_state_dict(net.state_dict())
    _step(om, x, y)
    with pytest.warns(RuntimeWarning, match="halves of the batch"):
        _step(om, x, y)
    h = _halves_of(om, kind)
    assert h.off and h.runs == 1
    h.pin(True)
    loss, grads = _step(om, x, y)
    assert h.runs == 1
    net.load_state_dict(om.state_dict())  # the running statistics both calls updated
    net.train()
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d | nn.BatchNorm1d):
            m.momentum = 0.0
    _like_torch(net, x, y, loss, grads)


@pytest.mark.parametrize("kind", KINDS)
def test_halves_only_with_two_threads(kind: str, free: None) -> None:
    """On one thread the session gets no halves (their point is the second core)."""
    om = ORTModule(KINDS[kind](), threads=1)
    _step(om, *_batch(16, 4, []))
    _step(om, *_batch(16, 4, []))
    (session,) = om.training_sessions()
    assert session._split is None and (session._fused is None or session._fused.halves is None)


class Scores(nn.Module):
    """A classifier returning its scores (the loss computed outside, as most training loops do), and optionally its
    loss beside them."""

    def __init__(self, with_loss: bool = False):
        super().__init__()
        self.with_loss = with_loss
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(4 * 6 * 6, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scores = self.net(x)
        if self.with_loss:
            return nn.functional.cross_entropy(scores, y), scores
        return scores


def _scores_step(module: nn.Module, x: torch.Tensor, y: torch.Tensor, with_loss: bool
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss outside: cross-entropy of the scores, plus the module's own loss and a term in every score where it
    returns both (gradients into both outputs)."""
    module.zero_grad(set_to_none=True)
    out = module(x, y)
    if with_loss:
        inner, scores = out
        loss = inner + 0.1 * scores.square().mean()
    else:
        scores = out
        loss = nn.functional.cross_entropy(scores, y.clamp(min=0))
    loss.backward()
    return scores.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("with_loss", [False, True])
def test_halves_of_outputs_match_torch(with_loss: bool, free: None) -> None:
    """Outputs holding the batch: the halves' joined (scores equal torch's), their gradients cut at the halves' rows;
    with a loss beside them, the loss weighed; parameter gradients against torch's in float64."""
    torch.manual_seed(0)
    net = Scores(with_loss)
    om = ORTModule(Scores(with_loss), threads=2)
    om.load_state_dict(net.state_dict())
    x, y = _batch(15, 8, [2, 3] if with_loss else [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _scores_step(om, x, y, with_loss)
        _scores_step(om, x, y, with_loss)
        h = _halves_of(om, "split")
        h.pin(True)
        runs = h.runs
        scores, grads = _scores_step(om, x, y, with_loss)
    assert h.checked and not h.off and h.runs == runs + 1
    want_scores, want = _scores_step(net.double(), x.double(), y, with_loss)
    torch.testing.assert_close(scores.double(), want_scores, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=2e-6)


class Dropped(Net):
    """Dropout before the dense layers (most classifiers have one); weights outweighing the activations where
    `wide` (a split step)."""

    def __init__(self, wide: bool = False):
        nn.Module.__init__(self)
        self.reduction = "mean"
        hidden = 96 if wide else 8
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Dropout(0.3), nn.Linear(144, hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, 5))


@pytest.mark.parametrize("torch_masks", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_halves_cut_the_dropout_masks(kind: str, torch_masks: bool, free: None) -> None:
    """Dropouts whose masks the host draws: the halves run on the whole batch's masks cut at their rows (the first
    halves' check runs the whole batch on the same masks), so with torch's own masks (`torch_dropout`) the step is
    torch's, the same generator state giving the same loss and gradients."""
    torch.manual_seed(0)
    net = Dropped(wide=kind == "split")
    om = ORTModule(Dropped(wide=kind == "split"), threads=2, torch_dropout=torch_masks)
    om.load_state_dict(net.state_dict())
    x, y = _batch(16, 9, [5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in (1, 2):
            torch.manual_seed(seed)
            _step(om, x, y)
        h = _halves_of(om, kind)
        h.pin(True)
        runs = h.runs
        torch.manual_seed(3)
        loss, grads = _step(om, x, y)
    assert h.checked and not h.off and h.runs == runs + 1 and h.masked is not None
    assert kind != "fused" or all(f.checked for f in h.flats), "the fused halves did not run bound, masks fed"
    if not torch_masks:  # numpy's masks: not torch's
        return
    torch.manual_seed(3)
    _like_torch(net, x, y, loss, grads)


@pytest.mark.parametrize("kind", KINDS)
def test_training_in_halves_follows_torch(kind: str, free: None) -> None:
    """Twenty Adam steps in halves (torch's Dropout masks, labels partly ignored) against torch's: the same losses
    and parameters to float rounding, step after step."""
    torch.manual_seed(0)
    net = Dropped(wide=kind == "split")
    om = ORTModule(Dropped(wide=kind == "split"), threads=2, torch_dropout=True)
    om.load_state_dict(net.state_dict())
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (om, net)]
    for step in range(20):
        x, y = _batch(32, 100 + step, [step % 32, (7 * step) % 32])
        losses = []
        for module, opt in zip((om, net), opts):
            torch.manual_seed(step)
            loss, _ = _step(module, x, y)
            opt.step()
            losses.append(loss)
        if step == 2:
            h = _halves_of(om, kind)
            h.pin(True)
            runs = h.runs
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-5, atol=1e-6)
    assert h.runs == runs + 17 and not h.off
    for p, q in zip(om.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)


def test_split_halves_only_for_convolutions(free: None) -> None:
    """An MLP's split steps stay whole: its matrix products lost to the whole batch's run as halves."""
    mlp = Wide()
    mlp.net = nn.Sequential(nn.Flatten(), nn.Linear(144, 96), nn.ReLU(), nn.Linear(96, 5))
    om = ORTModule(mlp, threads=2)
    _step(om, *_batch(16, 7, []))
    _step(om, *_batch(16, 7, []))
    (session,) = om.training_sessions()
    assert session._fused is None and session._split is None and session._split_decided


def test_split_halves_keep_their_stash(free: None) -> None:
    """A split step's halves keep each half's stash for its backward: as many bytes as the whole batch's, and a
    backward that keeps them (retain_graph) can run again."""
    torch.manual_seed(0)
    net = Wide()
    om = ORTModule(Wide(), threads=2)
    om.load_state_dict(net.state_dict())
    x, y = _batch(16, 6, [3])
    _step(om, x, y)
    _step(om, x, y)
    h = _halves_of(om, "split")
    (session,) = om.training_sessions()
    h.pin(False)
    whole = om(x, y)
    h.pin(True)
    halved = om(x, y)
    assert halved.grad_fn.state.halved is not None and whole.grad_fn.state.halved is None
    assert session.stash_bytes(halved.grad_fn.state) == session.stash_bytes(whole.grad_fn.state)
    om.zero_grad(set_to_none=True)
    halved.backward(retain_graph=True)
    halved.backward()
    twice = [p.grad.clone() for p in om.parameters()]
    _, want = _step(net, x, y)
    for g, w in zip(twice, want, strict=True):
        torch.testing.assert_close(g, 2 * w, rtol=1e-4, atol=1e-6)



def test_fused_halves_run_on_sessions_pinned_to_their_rows(free: None) -> None:
    """The fused halves' sessions take the halves of the batch that made them as fixed sizes (so onnxruntime folds the
    shape arithmetic written for a symbolic batch: the MaxPool gradient's plane indices); a batch of other sizes runs
    on symbolic sessions made when it comes, and both give torch's loss and gradients."""
    torch.manual_seed(0)
    net = Net()
    om = ORTModule(copy.deepcopy(net), threads=2)
    x, y = _batch(13, 0, [1])
    for _ in range(2):  # the first call decides to fuse, the second makes the halves
        _like_torch(net, x, y, *_step(om, x, y))
    h = _halves_of(om, "fused")
    h.pin(True)

    def rows(runner: Runner) -> int | str:
        return next(i.shape[0] for i in runner.session.get_inputs() if i.name == "x")

    assert h.sizes == (6, 7) and [rows(r) for r in h.runners] == [6, 7] and h._others is None
    runs = h.runs
    x2, y2 = _batch(10, 1, [2])
    _like_torch(net, x2, y2, *_step(om, x2, y2))
    assert h.runs == runs + 1 and h._others is not None and all(isinstance(rows(r), str) for r in h._others)
    _like_torch(net, x, y, *_step(om, x, y))
    assert h.runs == runs + 2


def test_fused_halves_hand_their_gradients_over(free: None) -> None:
    """A fused step's halves combine their gradients into torch tensors that the backward hands to `.grad` as they
    are (no copy); kept for another backward (retain_graph), they are copied, so the first backward's `.grad` does
    not accumulate into what the second hands over. The bytes kept from forward to backward are the gradients'."""
    torch.manual_seed(0)
    om = ORTModule(Net(), threads=2)
    x, y = _batch(16, 2, [5])
    _step(om, x, y)
    _, want = _step(om, x, y)
    h = _halves_of(om, "fused")
    h.pin(True)
    (session,) = om.training_sessions()
    om.zero_grad(set_to_none=True)
    loss = om(x, y)
    kept = loss.grad_fn.state.gradients
    assert session.stash_bytes(loss.grad_fn.state) == sum(p.numel() * p.element_size() for p in om.parameters())
    pointers = {kept.values[i].data_ptr() for i in range(kept.first, len(kept.values))}
    del kept  # a tensor referenced elsewhere is copied into .grad, as torch copies any gradient it cannot steal
    loss.backward()
    assert {p.grad.data_ptr() for p in om.parameters()} == pointers
    assert h.flats is not None and all(f.buffer is not None and f.checked for f in h.flats), "not from one buffer"
    first = min(p.grad.data_ptr() for p in om.parameters())  # the buffer: the loss, then the gradients
    end = max(p.grad.data_ptr() + p.grad.nbytes for p in om.parameters())
    assert not first - loss.nbytes <= loss.data_ptr() < end, "a loss kept would keep the gradients' memory"
    om.zero_grad(set_to_none=True)
    runs = h.runs
    loss = om(x, y)
    loss.backward(retain_graph=True)
    loss.backward()
    assert h.runs == runs + 1
    for p, w in zip(om.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, 2 * w, rtol=1e-5, atol=1e-7)
    net = Net()
    net.load_state_dict(om.state_dict())
    for k, rows in enumerate((22, 16)):  # other batches, the same buffers (the gradients' sizes are the parameters')
        x, y = _batch(rows, rows, [1])
        loss, grads = _step(om, x, y)
        assert h.runs == runs + 2 + k
        _like_torch(net, x, y, loss, grads)

def test_halves_off_by_config() -> None:
    from runtime.ort_session import SessionConfig

    model = onnx.load_from_string(_with_constants(_classifier()).SerializeToString())
    session = TrainingSession.from_forward(model, wrt=["w"], config=SessionConfig(threads=2, halves=False))
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    y = np.arange(16) % 3
    for _ in range(2):
        session.forward({"x": x, "y": y})
    assert session._fused is not None and session._fused.halves is None


def test_one_worker_thread(free: None) -> None:
    """Every session's halves share the process's one worker thread (a thread each would outlive its session), made
    once: steps of several sessions leave one thread running their second halves."""
    seen = set()
    for kind in KINDS:
        for rows in (16, 18):
            om = ORTModule(KINDS[kind](), threads=2)
            for _ in range(3):
                _step(om, *_batch(rows, 10, []))
            h = _halves_of(om, kind)
            assert h.runs >= 1 and h.worker is halves.WORKER
            seen.add(halves.WORKER._pid)
    assert seen == {os.getpid()}


def _raises() -> None:
    raise ValueError("from the worker")


def test_worker_errors_reach_the_caller() -> None:
    w = halves.Worker()
    w.start(_raises)
    with pytest.raises(ValueError, match="from the worker"):
        w.result()
    w.start(sum, [1, 2])
    assert w.result() == 3


def _child(w: halves.Worker, out: multiprocessing.SimpleQueue) -> None:
    w.start(sum, [3, 4])
    out.put(w.result())


def _child_lock(out: multiprocessing.SimpleQueue) -> None:
    out.put(halves.BUSY.acquire(blocking=False))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_fork_frees_the_lock() -> None:
    """A child forked while the halves' lock is held (by a thread that does not exist there) gets a free one."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    with halves.BUSY:
        p = ctx.Process(target=_child_lock, args=(out,))
        p.start()
        p.join(30)
    assert p.exitcode == 0 and out.get() is True


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")
def test_worker_survives_fork() -> None:
    """A child forked after the worker ran gets a thread of its own (the parent's does not exist there)."""
    w = halves.Worker()
    w.start(sum, [1])
    assert w.result() == 1
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_child, args=(w, out))
    p.start()
    p.join(30)
    assert p.exitcode == 0 and out.get() == 7


def test_flat_outputs_write_one_buffer() -> None:
    """A runner's outputs written into one buffer (`FlatOutputs`): each at its offset, inputs bound again only when
    fed another OrtValue; outputs of other sizes than the buffer's fail the run (the halves then lay it out again)."""
    from runtime.ort_session import SessionConfig

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 3]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    runner = Runner(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), SessionConfig(threads=1),
                    "test")
    flat = halves.FlatOutputs(runner, ["r", "s"])
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    feeds = {"x": exchange.to_ortvalue(a)}
    flat.lay_out(exchange.vector_to_torch(runner.run_vector(feeds, ["r", "s"])))
    for t in (a, b):
        r, s = map(torch.from_numpy, flat.views(flat.run(feeds if t is a else {"x": exchange.to_ortvalue(t)}, {})))
        torch.testing.assert_close(r, t.relu())
        torch.testing.assert_close(s, t.sum())
    assert flat.checked
    with pytest.raises(RuntimeError, match="onnxruntime failed running the test model"):
        flat.run({"x": exchange.to_ortvalue(torch.randn(5, 3))}, {})
