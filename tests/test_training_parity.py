"""20 Adam steps through ORTModule next to the same model in torch eager, from the same initial weights on
the same batches: per-step losses, gradients and final parameters within 1e-4 relative, BatchNorm buffers
equal (tests/parity.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn

STEPS = 20


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


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (32, 64)),
    "cnn-batchnorm": (CNN, (16, 1, 8, 8)),
    "transformer-encoder": (Encoder, (8, 6, 8)),
}


def classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize("case", list(CASES))
def test_adam_parity(case: str) -> None:
    make, shape = CASES[case]
    data = batches(shape, STEPS)
    # the last batch is smaller: a new batch size must not re-export
    data[-1] = (data[-1][0][: shape[0] // 2], data[-1][1][: shape[0] // 2])
    ort_model, reference, _ = check_parity(make, data, classify)
    ort_model.eval()
    reference.eval()
    x = data[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ort_model(x), reference(x), rtol=1e-4, atol=1e-5)
