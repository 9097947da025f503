"""The steady path (runtime/steady.py): a call reusing the last training call's decisions runs as the general path
would, and every change that path would notice sends the call back to it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime import ORTModule
from runtime.engine import Engine
from runtime.session import TrainingSession


class Halved(nn.Module):
    """Halves its input in training mode only (a branch on `self.training`, which the export bakes in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 if self.training else x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.halved = Halved()
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("shift", torch.full((8,), 0.1))
        self.temperature = 2.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.halved(torch.relu(self.fc1(x) + self.shift))
        return nn.functional.cross_entropy(self.fc2(h) / self.temperature, y)


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach()


def _same(model: ORTModule, ref: nn.Module, x: torch.Tensor, y: torch.Tensor, general: bool = True) -> None:
    """A step of each gives the same loss and gradients; `general`: and ORTModule's call ran the session and
    differentiated the tensors the general path picks for it."""
    torch.testing.assert_close(_step(model, x, y), _step(ref, x, y))
    if general:
        engine = model._engine
        steady = engine._steady
        loss = model(x, y)
        chosen = loss.grad_fn.call.session, loss.grad_fn.call.wrt
        engine._steady = None  # the general path, deciding afresh
        again = model(x, y).grad_fn.call
        assert (again.session, again.wrt) == chosen, "the steady call ran another session than the general path's"
        engine._steady = engine._steady or steady
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    if x.requires_grad:
        torch.testing.assert_close(*_input_grads(model, ref, x, y))


def _input_grads(model: nn.Module, ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    return [torch.autograd.grad(m(x, y), x)[0] for m in (model, ref)]


def _steady_pair() -> tuple[ORTModule, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ref = Net()
    model = ORTModule(copy.deepcopy(ref))
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    for _ in range(3):
        _same(model, ref, x, y)
    assert model._engine._steady is not None
    return model, ref, x, y


def test_steady_calls_skip_the_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once steady, a call neither binds its arguments nor looks up a schema or session (what it saves), and
    gives torch's loss and gradients."""
    model, ref, x, y = _steady_pair()

    def looked_up(*_: object) -> None:
        raise AssertionError("the steady call took the general path")

    monkeypatch.setattr(Engine, "_flatten", looked_up)
    monkeypatch.setattr(Engine, "_session", looked_up)
    for _ in range(2):
        _same(model, ref, x, y, general=False)


def _data_replaced(m: nn.Module) -> None:
    m.fc1.weight.data = m.fc1.weight.data * 2 + 1


def _slot_replaced(m: nn.Module) -> None:  # past the registration hooks the layout watch relies on
    m.fc2._parameters["bias"] = nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))


def _buffer_replaced(m: nn.Module) -> None:
    m._buffers["shift"] = torch.full((8,), -0.3)


CHANGES: dict[str, Callable[[nn.Module], object]] = {
    "weight .data assigned": _data_replaced,
    "parameter slot replaced": _slot_replaced,
    "buffer slot replaced": _buffer_replaced,
    "parameter frozen": lambda m: m.fc1.weight.requires_grad_(False),
    "eval mode": lambda m: m.eval(),
    "submodule in eval mode": lambda m: m.fc2.eval(),
    "Python attribute changed": lambda m: setattr(m, "temperature", 3.0),
    "parameter updated in place": lambda m: m.fc2.weight.data.mul_(0.5),
}


class Normed(nn.Module):
    def __init__(self, momentum: float | None):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_steady_calls_update_batchnorm_statistics(momentum: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with BatchNorm steps steadily, and its running statistics and counter follow torch's (an
    exponential average, and a cumulative one without a momentum), which eval mode then reads."""
    torch.manual_seed(0)
    ref = Normed(momentum)
    model = ORTModule(copy.deepcopy(ref))
    steady = []
    call = Engine._steady_call
    monkeypatch.setattr(Engine, "_steady_call", lambda self, *a: steady.append(1) or call(self, *a))
    y = torch.randint(0, 3, (5,))
    for _ in range(6):
        _same(model, ref, torch.randn(5, 6), y, general=False)  # a new batch each step
    assert len(steady) >= 3
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model.module.bn, name), getattr(ref.bn, name), msg=name)
    x = torch.randn(5, 6)
    model.eval(), ref.eval()
    torch.testing.assert_close(model(x, y), ref(x, y))


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_after_steady_calls_is_seen(change: str) -> None:
    """Each change the general path follows (new memory, a new tensor in a slot, grad flags, train/eval flags, a
    Python value the export holds), made to both modules after steady calls, gives torch's results at the next
    calls, through the general path and steady again after."""
    model, ref, x, y = _steady_pair()
    for m in (model.module, ref):
        CHANGES[change](m)
    for _ in range(3):
        _same(model, ref, x, y)


@pytest.mark.parametrize("what", ["other sizes", "input requires grad", "another dtype"])
def test_other_arguments_after_steady_calls(what: str) -> None:
    model, ref, x, y = _steady_pair()
    if what == "other sizes":
        x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))
    elif what == "input requires grad":
        x = x.clone().requires_grad_()
    else:
        model, ref = model.double(), ref.double()
        x = x.double()
    for _ in range(3):
        _same(model, ref, x, y)


def test_no_grad_calls_after_steady_calls_keep_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """With grad disabled the forward runs alone (nothing stashed), as it does on the general path."""
    model, ref, x, y = _steady_pair()

    def stashing(*_: object) -> None:
        raise AssertionError("a training forward ran with grad disabled")

    with monkeypatch.context() as patched:
        patched.setattr(TrainingSession, "forward_ortvalues", stashing)
        with torch.no_grad():
            out = model(x, y)
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref(x, y).detach())
    _same(model, ref, x, y)


class Keywords(nn.Module):
    """Keyword arguments, one of them optional (a default the export holds)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc(x)
        return nn.functional.cross_entropy(out if scale is None else out * scale, y)


def test_keyword_calls_are_steady_in_the_order_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls giving the same keywords in the same order reuse the recorded call; another order, another keyword or
    one left to its default take the general path and give torch's results."""
    torch.manual_seed(0)
    ref = Keywords()
    model = ORTModule(copy.deepcopy(ref))
    x, y, scale = torch.randn(5, 6), torch.randint(0, 3, (5,)), torch.tensor(2.0)
    calls = [dict(x=x, y=y), dict(y=y, x=x), dict(x=x, y=y, scale=scale), dict(x=x, y=y)]

    def step(m: nn.Module, kwargs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        m.zero_grad(set_to_none=True)
        loss = m(**kwargs)
        loss.backward()
        return loss.detach(), m.fc.weight.grad, m.fc.bias.grad

    for kwargs in calls:
        for _ in range(3):
            for got, want in zip(step(model, kwargs), step(ref, kwargs)):
                torch.testing.assert_close(got, want)
        assert model._engine._steady is not None and model._engine._steady.keywords == tuple(kwargs)

    def looked_up(*_: object) -> None:
        raise AssertionError("the steady call took the general path")

    monkeypatch.setattr(Engine, "_flatten", looked_up)
    for got, want in zip(step(model, calls[-1]), step(ref, calls[-1])):
        torch.testing.assert_close(got, want)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (self.w * a - b).square().mean()


def test_one_tensor_given_twice_then_two() -> None:
    """A call giving one tensor for two arguments records nothing a call of two tensors could misread."""
    torch.manual_seed(0)
    ref = Pair()
    model = ORTModule(copy.deepcopy(ref))
    t, u = torch.randn(4, 3), torch.randn(4, 3)
    for keyword in (False, True):
        for a, b in [(t, t)] * 3 + [(t, u)] * 3 + [(u, t)]:
            model.zero_grad()
            ref.zero_grad()
            got, want = (m(a, b=b) if keyword else m(a, b) for m in (model, ref))
            torch.testing.assert_close(got, want)
            got.backward()
            want.backward()
            torch.testing.assert_close(model.w.grad, ref.w.grad)


def test_a_view_assigned_to_data_after_steady_calls() -> None:
    """`.data` set to a view of its own memory (the same pointer: rows cut off, or a square weight transposed) is
    seen at the next call, as the general path sees it."""
    model, ref, x, y = _steady_pair()
    y = y.clamp(max=1)
    for _ in range(3):
        _same(model, ref, x, y)
    for m in (model.module, ref):
        m.fc2.weight.data = m.fc2.weight.data[:2]
        m.fc2.bias.data = m.fc2.bias.data[:2]
    for _ in range(3):
        _same(model, ref, x, y)

    torch.manual_seed(0)
    square = nn.Linear(4, 4, bias=False)
    model, ref = ORTModule(copy.deepcopy(square)), square
    x = torch.randn(3, 4)
    for step in range(6):
        if step == 3:
            for m in (model.module, ref):
                m.weight.data = m.weight.data.t()
        got, want = (m(x).square().mean() for m in (model, ref))
        torch.testing.assert_close(got, want)


def test_double_backward_of_a_steady_call() -> None:
    """A steady call's `in_torch` (what backward(create_graph=True) computes again in torch) has the call's own
    tensors: a gradient penalty matches torch's."""
    model, ref, x, y = _steady_pair()
    x = x.clone().requires_grad_()
    for _ in range(3):
        _same(model, ref, x, y)
    grads = []
    for m in (model, ref):
        m.zero_grad()
        (g,) = torch.autograd.grad(m(x, y), x, create_graph=True)
        g.square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)
