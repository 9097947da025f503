"""runtime/dropouts.py: channel (Dropout1d/2d/3d) and alpha dropouts train on onnxruntime with torch's arithmetic;
their masks are random, so each output is checked against the mask it shows and the gradients against that mask."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runtime import ORTModule
from runtime.dropouts import ALPHA

P = 0.3


class Scaled(nn.Module):
    """dropout(x * w): w gets the gradient, through the dropout's mask."""

    def __init__(self, dropout: nn.Module, shape: tuple[int, ...]):
        super().__init__()
        self.w = nn.Parameter(torch.rand(shape[1:]) + 0.5)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x * self.w)


def _run(dropout: nn.Module, shape: tuple[int, ...]
         ) -> tuple[ORTModule, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's output y for x and the gradient of sum(y * g) in its weight; h = x * w, y's input."""
    torch.manual_seed(0)
    model = ORTModule(Scaled(dropout, shape), threads=1)
    x, g = torch.randn(shape), torch.randn(shape)
    y = model(x)
    (y * g).sum().backward()
    assert model.stats["fallbacks"] == 0 and "feature_dropout" not in torch._VF.__dict__
    return model, x, x * model.module.w.detach(), y.detach(), g


@pytest.mark.parametrize("dropout, shape", [(nn.Dropout1d(P), (40, 50, 7)), (nn.Dropout2d(P), (40, 50, 4, 5)),
                                            (nn.Dropout3d(P), (20, 50, 2, 3, 3))])
def test_channel_dropout(dropout: nn.Module, shape: tuple[int, ...]) -> None:
    model, x, h, y, g = _run(dropout, shape)
    kept = y.flatten(2) != 0
    assert (kept.all(2) | ~kept.any(2)).all(), "a channel is dropped or kept whole"
    assert abs(float((~kept[:, :, 0]).float().mean()) - P) < 0.05
    factor = (y != 0).to(y.dtype) / (1 - P)
    torch.testing.assert_close(y, h * factor, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.module.w.grad, (g * x * factor).sum(0), rtol=1e-5, atol=1e-5)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), h)  # eval: no dropout


@pytest.mark.parametrize("dropout, shape, feature", [(nn.AlphaDropout(P), (200, 50), False),
                                                     (nn.FeatureAlphaDropout(P), (40, 50, 3, 3), True)])
def test_alpha_dropout(dropout: nn.Module, shape: tuple[int, ...], feature: bool) -> None:
    model, x, h, y, g = _run(dropout, shape)
    a = 1 / math.sqrt((ALPHA * ALPHA * P + 1) * (1 - P))
    dropped_value = torch.tensor(ALPHA * a * (P - 1), dtype=y.dtype)
    keep = ~torch.isclose(y, dropped_value, rtol=1e-6, atol=0)
    if feature:
        flat = keep.flatten(2)
        assert (flat.all(2) | ~flat.any(2)).all(), "a channel is dropped or kept whole"
    assert abs(1 - float(keep.float().mean()) - P) < 0.05
    torch.testing.assert_close(y, torch.where(keep, h * a + ALPHA * a * P, dropped_value), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.module.w.grad, (g * x * keep * a).sum(0), rtol=1e-5, atol=1e-5)
