"""20 Adam steps through ORTModule next to the same model in torch eager, from the same initial weights on
the same batches: per-step losses and final parameters within 1e-4 relative, BatchNorm buffers equal."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from runtime import ORTModule

STEPS = 20
RTOL = 1e-4


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """torchvision style: conv without bias before BatchNorm (a bias there has no gradient to follow)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def batches(shape: tuple[int, ...], n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)) for _ in range(n)]


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def comparable(name: str, p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's key bias has an exactly zero gradient (softmax ignores a per-query constant), so Adam
    steps it along rounding noise (~1e-9) in torch and onnxruntime alike: leave that slice out."""
    if name.endswith("in_proj_bias"):
        d = p.shape[0] // 3
        keep = torch.cat([torch.arange(d), torch.arange(2 * d, 3 * d)])
        return p[keep], q[keep]
    return p, q


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (32, 64)),
    "cnn-batchnorm": (CNN, (16, 1, 8, 8)),
    "transformer-encoder": (Encoder, (8, 6, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adam_parity(case: str) -> None:
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    ort_model = ORTModule(model)
    data = batches(shape, STEPS)
    # the last batch is smaller: a new batch size must not re-export
    data[-1] = (data[-1][0][: shape[0] // 2], data[-1][1][: shape[0] // 2])
    ort_losses = train(ort_model, data)
    torch_losses = train(reference, data)
    for step, (a, b) in enumerate(zip(ort_losses, torch_losses)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: loss {a} vs torch {b}"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        p, q = comparable(name, p.detach(), q.detach())
        assert relative(p, q) <= RTOL, f"{name}: {relative(p, q)}"
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        if b.is_floating_point():
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(b, c), name
    assert ort_model.stats["exports"] == 1 and ort_model.stats["fallbacks"] == 0
    ort_model.eval()
    reference.eval()
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ort_model(x), reference(x), rtol=1e-4, atol=1e-5)
