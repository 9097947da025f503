"""Training parity of an ORTModule against the same module in torch eager.

Both copies start from the same weights (deep copy before wrapping), see the same batches and the same
optimizer; each step's loss and every parameter's gradient are compared, then the final parameters and
buffers. Tolerances are relative to the reference's own scale:

- a gradient that is exactly zero in exact arithmetic (attention's key bias: softmax ignores a per-query
  constant; a conv bias before BatchNorm) is rounding noise in torch and onnxruntime alike, up to ~1e-6 of
  the step's largest gradient when it sums many terms, so a gradient's scale is floored at `GRAD_FLOOR`
  times the step's largest gradient;
- Adam's first step is lr * g / (|g| + eps), a full-size step of random sign for a noise-level g, so final
  parameters are compared only where the reference gradient stayed above `SETTLED` times the step's
  largest gradient at every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime import ORTModule

RTOL = 1e-4
GRAD_FLOOR = 1e-2
SETTLED = 1e-3

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Steps proportional to the gradients: rounding noise stays noise (Adam scales it up to lr), so a few
    steps keep parameters, losses and later gradients as close as the first step's."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@dataclass
class Run:
    losses: list[float]
    grads: list[dict[str, torch.Tensor | None]]


@dataclass
class Report:
    """The largest relative differences seen (what the assertions bounded)."""

    loss: float = 0.0
    grad: float = 0.0
    param: float = 0.0
    buffer: float = 0.0

    def __str__(self) -> str:
        return f"loss {self.loss:.1e}, grad {self.grad:.1e}, param {self.param:.1e}, buffer {self.buffer:.1e}"


def train(model: nn.Module, batches: Sequence[Batch], loss_fn: LossFn, optimizer: OptimizerFn = adam) -> Run:
    opt = optimizer(model.parameters())
    run = Run([], [])
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        run.grads.append({n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        run.losses.append(loss.item())
    return run


def relative(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    """max |a - b| over max(max |b|, floor); 0 for empty tensors."""
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / max(float(b.abs().max()), floor))


def compare(model: nn.Module, reference: nn.Module, got: Run, want: Run, rtol: float = RTOL) -> Report:
    """Assert parity of two finished runs and the modules they trained; return the worst differences."""
    r = Report()
    for step, (a, b) in enumerate(zip(got.losses, want.losses)):
        r.loss = max(r.loss, abs(a - b) / max(abs(b), 1e-12))
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs torch {b}"
    settled: dict[str, torch.Tensor] = {}
    for step, (ga, gb) in enumerate(zip(got.grads, want.grads)):
        assert ga.keys() == gb.keys()
        scale = max((float(g.abs().max()) for g in gb.values() if g is not None and g.numel()), default=0.0)
        for name, g in gb.items():
            assert (ga[name] is None) == (g is None), f"step {step}: {name} has a gradient in only one of the two"
            if g is None:
                continue
            err = relative(ga[name], g, max(GRAD_FLOOR * scale, 1e-12))
            r.grad = max(r.grad, err)
            assert err <= rtol, f"step {step}: gradient of {name} {err:.2e} apart (relative)"
            above = g.abs() > SETTLED * scale
            settled[name] = above & settled[name] if name in settled else above
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        p, q, keep = p.detach(), q.detach(), settled.get(name)
        err = relative(p, q) if keep is None else relative(p[keep], q[keep], float(q.abs().max()))
        r.param = max(r.param, err)
        assert err <= rtol, f"parameter {name}: {err:.2e} apart (relative)"
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        if b.is_floating_point():
            r.buffer = max(r.buffer, relative(b, c))
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(b, c), name
    return r


def check_parity(make: Callable[[], nn.Module], batches: Sequence[Batch], loss_fn: LossFn,
                 optimizer: OptimizerFn = adam, rtol: float = RTOL, seed: int = 0,
                 **options: Any) -> tuple[ORTModule, nn.Module, Report]:
    """Train `make()` through ORTModule(**options) and a deep copy of it in torch on `batches`, each run from the
    same generator state (their random draws can be the same); assert parity and that one export served every
    step without falling back."""
    torch.manual_seed(seed)
    module = make()
    reference = copy.deepcopy(module)
    ort_model = ORTModule(module, **options)
    start = torch.random.get_rng_state()
    got = train(ort_model, batches, loss_fn, optimizer)
    torch.random.set_rng_state(start)
    want = train(reference, batches, loss_fn, optimizer)
    report = compare(module, reference, got, want, rtol)
    assert ort_model.stats["exports"] == 1 and ort_model.stats["fallbacks"] == 0, ort_model.stats
    return ort_model, reference, report
