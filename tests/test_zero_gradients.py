"""Tensors torch differentiates to zeros: reached only through ops of derivative zero (Round, Floor, Sign, Bernoulli,
torch.normal's mean). torch gives them zero gradients, not None, and an output computed only through such ops
requires grad: the builder lists them (`zero_gradient`, a Yield output for such an output) and ORTModule hands torch
the zeros, so `.grad` and an optimizer's steps (AdamW's weight decay, Adam's momentum) are torch's."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torch.nn import functional as F

import gradbuilder
from gradbuilder.inspect_model import gradient_table
from runtime import ORTModule

EXPORTERS = ["torchscript", "dynamo"]


def _graph() -> onnx.ModelProto:
    """o = (u > x) * x * Round(w), s = Sign(x @ v): w reaches o only through Round, v reaches s only through Sign,
    u only through a comparison (bool: None in torch), x both directly and through Sign."""
    nodes = [helper.make_node("Round", ["w"], ["rw"]), helper.make_node("Mul", ["x", "rw"], ["y"]),
             helper.make_node("MatMul", ["x", "v"], ["z"]), helper.make_node("Sign", ["z"], ["s"]),
             helper.make_node("Greater", ["u", "x"], ["gt"]), helper.make_node("Cast", ["gt"], ["gf"], to=1),
             helper.make_node("Mul", ["gf", "y"], ["o"])]
    inits = [numpy_helper.from_array(np.ones(2, np.float32), "w"),
             numpy_helper.from_array(np.ones((2, 2), np.float32), "v"),
             numpy_helper.from_array(np.ones((2, 2), np.float32), "u")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in ("o", "s")],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


_PER_OUTPUT = {"o": ["w"], "s": ["v", "x"]}
"""Per output: the tensors it reaches only through ops of derivative zero (x reaches o directly, s through Sign)."""


@pytest.mark.parametrize(("outputs", "grads", "zeros", "none", "seeds"), [
    (None, ["x"], ["w", "v"], ["u"], ["o", "s"]),
    (["o"], ["x"], ["w"], ["v", "u"], ["o"]),
    (["s"], [], ["v", "x"], ["w", "u"], ["s"]),
])
def test_builder_lists_zero_gradients_and_gives_their_outputs_a_host_gradient(
        outputs: list[str] | None, grads: list[str], zeros: list[str], none: list[str], seeds: list[str]) -> None:
    training = gradbuilder.build_gradient_graph(_graph(), outputs=outputs, wrt=["w", "v", "u", "x"])
    meta = gradbuilder.read_metadata(training)
    assert sorted(meta["gradients"]) == grads
    assert sorted(meta["zero_gradient"]) == sorted(zeros)
    assert meta["zero_gradient_of"] == {o: _PER_OUTPUT[o] for o in seeds}
    assert sorted(meta["no_gradient"]) == sorted(none)
    _, _, manifest = gradbuilder.split(training)
    assert sorted(manifest.zero_gradient) == sorted(zeros)
    assert manifest.zero_gradient_of == meta["zero_gradient_of"]
    decoded = json.loads(manifest.to_json())
    assert (decoded["zero_gradient"], decoded["zero_gradient_of"]) == (manifest.zero_gradient,
                                                                       manifest.zero_gradient_of)
    differentiable = [o for i, o in enumerate(manifest.module_outputs) if i not in manifest.non_differentiable_outputs]
    assert differentiable == seeds  # s is an output torch differentiates (Sign's derivative is zero), so it has one
    read = {e.output_index for e in manifest.backward_inputs if e.role == "output_grad"}
    assert read == ({0} if "o" in seeds else set())  # s's host gradient reaches nothing: backward does not read it
    rows = {r.name: r for r in gradient_table(training)}
    for w in zeros:
        assert "zeros" in str(rows[w]), rows[w]


def test_builder_without_zero_derivative_ops_is_unchanged() -> None:
    """A Relu in Round's place: w gets its gradient, nothing is listed as zeros."""
    m = _graph()
    m.graph.node[0].op_type = "Relu"
    meta = gradbuilder.read_metadata(gradbuilder.build_gradient_graph(m, outputs=["o"], wrt=["w", "v", "u", "x"]))
    assert sorted(meta["gradients"]) == ["w", "x"] and meta["zero_gradient"] == []


class _RoundedScale(nn.Module):
    """A parameter quantized without a straight-through estimator: torch's gradient is zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.randn(5) * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.round(self.scale)


class _Binarized(nn.Module):
    """Its output computed from the parameters only through sign(): requires grad in torch, all gradients zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(self.lin(x))


class _TwoOutputs(nn.Module):
    """A loss and a floored code: w reaches the second output only (zeros from it), lin the first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.w = nn.Parameter(torch.randn(5) * 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x).pow(2).mean(), torch.floor(self.w) * 2


class _Sampled(nn.Module):
    """torch.normal of a learned mean (std left out: 1; the dynamo translation required it): torch gives it zeros
    (the sample is not reparametrized). The host draws it as torch at this call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.mean = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.normal(self.mean)


class _Bernoulli(nn.Module):
    """bernoulli of learned probabilities: torch gives them zeros. Drawn by onnxruntime (other numbers), added:
    lin's gradients do not read the draw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.logit = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.bernoulli(torch.sigmoid(self.logit))


class _TruncatedIndex(nn.Module):
    """torch.div(..., rounding_mode="trunc") of a parameter (the legacy conversion cast it to int64 and back)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.w = nn.Parameter(torch.randn(5) * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.div(self.w, 0.7, rounding_mode="trunc")


def _step(module: nn.Module, x: torch.Tensor, outputs: tuple[int, ...] = (0,)) -> dict[str, torch.Tensor | None]:
    out = module(x)
    out = out if isinstance(out, tuple) else (out,)
    for o in out:
        assert o.requires_grad
    sum(out[i].sum() for i in outputs).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same(ours: dict[str, torch.Tensor | None], theirs: dict[str, torch.Tensor | None]) -> None:
    assert ours.keys() == theirs.keys()
    for n, t in theirs.items():
        o = ours[n]
        assert (o is None) == (t is None), (n, o, t)
        if t is not None:
            torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("cls", [_RoundedScale, _Binarized, _Sampled, _Bernoulli, _TruncatedIndex])
def test_parameters_reached_through_zero_derivative_ops_get_torch_zeros(cls: type[nn.Module], exporter: str) -> None:
    torch.manual_seed(0)
    net = cls()
    ref = copy.deepcopy(net)
    x = torch.randn(8, 6)
    torch.manual_seed(1)
    theirs = _step(ref, x)
    torch.manual_seed(1)
    ours = _step(ORTModule(net, exporter=exporter), x)
    zero = [n for n, g in theirs.items() if g is not None and not g.any()]
    assert zero, "the module has no parameter torch differentiates to zeros"
    _same(ours, theirs)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_zero_gradients_follow_the_outputs_that_receive_gradients(exporter: str) -> None:
    """torch: w's gradient is None after a backward of the loss alone, zeros after one through the floored code;
    lin's None after a backward of the code alone."""
    torch.manual_seed(0)
    net = _TwoOutputs()
    ours = ORTModule(net, exporter=exporter)
    x = torch.randn(8, 6)
    for outputs in ((0,), (1,), (0, 1), (1,)):
        ref = copy.deepcopy(net)
        net.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        _same(_step(ours, x, outputs), _step(ref, x, outputs))


class _LossAndPredictions(nn.Module):
    """A loss and the rounded predictions (a binary classifier's): the predictions require grad in torch, and the
    step still runs forward and backward as one (`fused`: one output whose gradient backward reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lin(x).squeeze(1)
        return F.binary_cross_entropy_with_logits(logits, y), torch.round(torch.sigmoid(logits))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_loss_returned_with_rounded_predictions_still_runs_fused(exporter: str) -> None:
    torch.manual_seed(0)
    net = _LossAndPredictions()
    ours = ORTModule(net, exporter=exporter)
    x, y = torch.randn(16, 6), torch.randint(0, 2, (16,)).float()
    for outputs in ((0,), (0,), (0, 1), (1,)):
        ref = copy.deepcopy(net)
        net.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        got, want = ours(x, y), ref(x, y)
        assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [True, True]
        sum(got[i].sum() for i in outputs).backward()
        sum(want[i].sum() for i in outputs).backward()
        _same({n: p.grad for n, p in net.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})
    [session] = ours.training_sessions()
    assert session.runs_fused


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_an_input_reached_through_ceil_gets_torch_zeros(exporter: str) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ceil(x) * self.w

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 6) * 3
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ORTModule(net, exporter=exporter)(mine).sum().backward()
    copy.deepcopy(net)(theirs).sum().backward()
    assert mine.grad is not None and not mine.grad.any() and mine.grad.shape == x.shape
    assert theirs.grad is not None and torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_adamw_trains_a_rounded_parameter_as_torch(exporter: str) -> None:
    """With None, AdamW skips the parameter; with torch's zeros it decays it and its momentum moves it."""
    torch.manual_seed(0)
    net = _RoundedScale()
    ref = copy.deepcopy(net)
    ours = ORTModule(net, exporter=exporter)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (ours, ref)]
    start = net.scale.detach().clone()
    for _ in range(4):
        x = torch.randn(8, 6)
        for m, opt in zip((ours, ref), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    assert not torch.equal(net.scale, start)
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize(("given", "zeros", "computed"), [
    (("o", "s"), ["v", "w"], ["x"]),
    (("o",), ["w"], ["x"]),
    (("s",), ["v", "x"], []),
])
def test_training_session_returns_torch_zeros_for_the_outputs_given(given: tuple[str, ...], zeros: list[str],
                                                                    computed: list[str]) -> None:
    """The session API too: `backward` returns zeros of each tensor's shape where the outputs given gradients reach
    it only through Round or Sign, and nothing for those they do not reach (u: a comparison; v without s)."""
    from runtime import TrainingSession

    session = TrainingSession.from_forward(_graph(), wrt=["w", "v", "u", "x"])
    x = np.array([[0.5, -2.0], [3.0, 1.5]], np.float32)
    _, state = session.forward({"x": x})
    result = session.backward(state, {name: np.ones((2, 2), np.float32) for name in given})
    assert sorted(result) == sorted(zeros + computed)
    shapes = {"w": (2,), "v": (2, 2), "x": (2, 2)}
    for name in zeros:
        assert result[name].shape == shapes[name] and not result[name].any(), name
    for name in computed:
        assert result[name].any()
