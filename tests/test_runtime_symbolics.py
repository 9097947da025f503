"""runtime/symbolics.py: ops torch's legacy exporter has no conversion for ("Exporting the operator ... is not
supported") train through ORTModule like torch, in-place forms and torch.special aliases included, and
interpolate's nearest-exact."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn

MATRIX = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))

OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sinh, cosh, asinh": lambda h: torch.sinh(h) + torch.cosh(h) + torch.asinh(h) + h.clone().sinh_(),
    "acosh, atanh": lambda h: torch.acosh(h.abs() + 1.1) + torch.atanh(torch.tanh(h) * 0.9),
    "exp2": torch.exp2,
    "erfc": lambda h: torch.erfc(h) + torch.special.erfc(2 * h),
    "logaddexp": lambda h: torch.logaddexp(h, h.flip(1)) + torch.logaddexp(h, h.clone()),  # ties: half each
    "logaddexp2": lambda h: torch.logaddexp2(h, 3 * h.flip(1)),
    "xlogy": lambda h: torch.special.xlogy(h * (h > 0), h.abs() + 0.1) + torch.xlogy(h, 2.0),
    "addmv": lambda h: torch.addmv(h[0], MATRIX, h[1], beta=0.5, alpha=3) + torch.addmv(h[2], MATRIX, h[3], beta=0),
    "addr": lambda h: torch.addr(MATRIX, h[0], h[1], beta=2, alpha=0.5),
    "sgn": lambda h: torch.sgn(h) * h,
    "fmax, fmin": lambda h: torch.fmax(h, h.flip(1)) + torch.fmin(h, h.flip(0)),
    "trunc, fix": lambda h: (torch.trunc(3 * h) + torch.fix(h)) * h,
    "median": lambda h: h.median(1, keepdim=True).values * h + torch.median(h) + h[:, :4].median(1).values[:, None],
}


class Op(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.op = op

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (self.op(self.fc(x)) * r).sum()


@pytest.mark.parametrize("op", list(OPS))
def test_converted_ops_train_like_torch(op: str) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(1, 6, generator=g)) for _ in range(3)]
    check_parity(lambda: Op(OPS[op]), batches, lambda m, b: m(*b), threads=1)


@pytest.mark.parametrize("dims, resize", [(2, {"size": (7, 5)}), (2, {"size": (3, 2)}), (2, {"scale_factor": 1.5}),
                                          (1, {"size": 11}), (3, {"size": (5, 3, 4)})])
def test_nearest_exact_trains_like_torch(dims: int, resize: dict) -> None:
    """interpolate(mode="nearest-exact"), which the exporter has no conversion for, up and down, 1-D to 3-D."""
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv(2, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.interpolate(self.conv(x), mode="nearest-exact", **resize).square().mean()

    g = torch.Generator().manual_seed(dims)
    batches = [(torch.randn(2, 2, *[9, 8, 6][:dims], generator=g),) for _ in range(3)]
    check_parity(Net, batches, lambda m, b: m(*b), threads=1)
