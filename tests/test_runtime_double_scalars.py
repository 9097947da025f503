"""float64 arithmetic on 0-d tensors through the legacy exporter (runtime/double_scalars.py), which writes
`aux * 3` on a 0-d float64 tensor in float32: ORTModule's outputs and gradients against torch's in float64."""

from __future__ import annotations

import copy

import torch
from torch import nn

from runtime import ORTModule


class Weighted(nn.Module):
    """A float64 module whose output carries 0-d arithmetic with Python numbers: an auxiliary term weighted into
    a tensor, a regularizer, and (with `scalar`) a 0-d result returned as is."""

    def __init__(self, scalar: bool):
        super().__init__()
        self.a, self.b, self.scalar = nn.Linear(8, 16), nn.Linear(16, 8), scalar

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = torch.tanh(self.a(x))
        out = self.b(z) * torch.sigmoid(x.sum(-1, keepdim=True)) + 3 * z.sum() + 0.01 * self.a.weight.square().sum()
        return (out, self.b(z).sum() * 0.5 - 2) if self.scalar else (out,)


def test_zero_d_arithmetic_stays_in_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    for scalar in (False, True):
        reference = Weighted(scalar).double()
        model = ORTModule(copy.deepcopy(reference))
        for _ in range(2):
            results = []
            for m in (reference, model):
                for p in m.parameters():
                    p.grad = None
                outs = m(x)
                sum(o.square().sum() for o in outs).backward()
                results.append((outs, [p.grad for p in m.parameters()]))
            (want, want_grads), (got, got_grads) = results
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype == torch.float64  # the 0-d result came back float32
                torch.testing.assert_close(g, w, rtol=1e-13, atol=0)
            for g, w in zip(got_grads, want_grads, strict=True):  # 6e-8 relative apart in float32
                torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_a_float32_result_the_module_makes_stays_float32() -> None:
    class Demoted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).sum().float() * 3

    x = torch.randn(2, 3, dtype=torch.float64)
    reference = Demoted().double()
    out = ORTModule(copy.deepcopy(reference))(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x))


def test_zero_d_results_stacked_or_unsqueezed_stay_in_float64() -> None:
    """0-d float64 arithmetic then reshaped (`loss[None]`, `torch.stack` of several, a Reshape and a Flatten): the
    stretch runs through those views to the output, which came back float32 (4e-9 off)."""
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.a(x)
            total = h.sum() + h.square().mean()
            return total[None], torch.stack([h.sum() * 3, h.mean() - 1]), total.reshape(1, 1).flatten()

    torch.manual_seed(0)
    reference = Stacked().double()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(4, 6, dtype=torch.float64)
    for got, want in zip(model(x), reference(x), strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def test_sizes_cast_to_float_join_the_stretch() -> None:
    """0-d float64 arithmetic with a size the trace reads (`label_smoothing / classes` in cross_entropy's
    smoothing, a sum over the batch's size): the exporter casts the size to float32 and computes on it in float32
    (the loss came back float32, 4e-8 off). Batches of 3 and 5 rows: the size is read at run time."""
    class Smoothed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.a(x)
            loss = nn.functional.cross_entropy(h, y, label_smoothing=0.1)
            return loss, h.square().sum() / x.shape[0] * 0.3

    torch.manual_seed(0)
    reference = Smoothed().double()
    model = ORTModule(copy.deepcopy(reference))
    for n in (3, 5):
        x, y = torch.randn(n, 6, dtype=torch.float64), torch.randint(0, 4, (n,))
        results = []
        for m in (reference, model):
            for p in m.parameters():
                p.grad = None
            outs = m(x, y)
            sum(outs).backward()
            results.append((outs, [p.grad for p in m.parameters()]))
        (want, want_grads), (got, got_grads) = results
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float64
            torch.testing.assert_close(g, w, rtol=1e-13, atol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
