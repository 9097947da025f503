"""runtime/symbolics.py: ops torch's legacy exporter has no conversion for ("Exporting the operator ... is not
supported") train through ORTModule like torch, in-place forms and torch.special aliases included, and
interpolate's nearest-exact; so does tensor_split, which it converts into a tensor sequence (no gradient rule)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn
from torch.onnx import _constants
from torch.onnx._internal.torchscript_exporter import registration, utils

from runtime import symbolics

MATRIX = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
ZEROS = torch.tensor([[1.0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0], [0, 1, 0, 1, 1, 1], [1, 1, 1, 0, 1, 1]])
"""Exact zeros for cumprod, one or two per row, one per column (its gradient before a zero, at it, past it)."""


def _tied(h: torch.Tensor) -> torch.Tensor:
    """h rounded, ties between its elements, with h's gradient (straight through): a tie broken the other way sends
    it to another element."""
    return h.round() + (h - h.detach())


def _with_indices(result: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """cummax / cummin's values, shifted by their indices: a tie broken the other way changes the loss."""
    values, indices = result
    return values * (1 + indices.float() / 10) + indices.float()


def _gram(h: torch.Tensor) -> torch.Tensor:
    """A well-conditioned 6x6 matrix of h (its eigenvalues 1 and up): static sizes, the batch axis contracted."""
    return h.T @ h + torch.eye(6)


def _blocks(h: torch.Tensor) -> torch.Tensor:
    """Well-conditioned 2x2 matrices of h: near 2 I, a batch of 6 (the batch axis's 4 rows of 6, regrouped)."""
    return h.reshape(-1, 2, 2) + 2 * torch.eye(2)


def _with_info(result: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """inv_ex's inverse scaled by 1 + info (int32 zeros of the batch shape): info's type and shape must hold."""
    inverse, info = result
    return inverse * (1 + info).float()[..., None, None]


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
    # chunks h[:, :2], h[:, 2:-1], h[:, -1:5] (empty), h[:, 5:]; h[:, :-9] (empty), h[:, -9:3], h[:, 3:30], h[:, 30:]
    # (empty); 4 sections of 6: 2, 2, 1, 1; 3 of the batch's 4 (read at run time): 2, 1, 1
    "tensor_split indices": lambda h: torch.cat([c * (k + 1) for k, c in enumerate(h.tensor_split([2, -1, 5], 1))], 1),
    "tensor_split past the end": lambda h: torch.cat(torch.tensor_split(h, (-9, 3, 30), dim=-1)[::-1], 1).exp(),
    "tensor_split sections": lambda h: torch.cat([c.exp() * (k + 1) for k, c in enumerate(h.T.tensor_split(4))], 0).T,
    "tensor_split sections, batch axis": lambda h: sum(c.sum(0) * (k + 1) for k, c in enumerate(h.tensor_split(3))),
    "cumprod with zeros": lambda h: (h * ZEROS).cumprod(0) + (h * ZEROS).cumprod(1),
    "cumsum of bools, ints, in double": lambda h: (h * (h > 0).cumsum(1) + h.round().int().cumsum(0)
                                                   + torch.cumsum(h, -1, dtype=torch.float64).float()),
    "cumprod in double": lambda h: torch.cumprod(h, -1, dtype=torch.float64).float(),
    "cummax, cummin with ties": lambda h: _with_indices(_tied(h).cummax(1)) + _with_indices(_tied(h).cummin(0)),
    "cummax, cummin of repeats": lambda h: (_with_indices(torch.cat([h, h], 1).cummax(-1))[:, 3:9]
                                            + _with_indices(torch.cat([h, h], 0).cummin(-2))[2:6]),
    # negative determinants too (sign -1), and logdet, det (ONNX's Det, gradbuilder's cofactor rule); matrices of
    # static sizes (the rule needs them), the batch axis contracted or leading
    "slogdet, logdet, det": lambda h: (torch.slogdet(h.reshape(-1, 2, 2) - torch.eye(2)).logabsdet.sum()
                                       + torch.linalg.slogdet(h[:, :4].T @ h[:, 2:]).sign
                                       * torch.logdet(h.T @ h + torch.eye(6))
                                       + torch.linalg.det(h[:, :4].T @ h[:, 2:])),
    # onnxruntime's contrib Inverse (gradbuilder's rule), and solve through it
    "inv": lambda h: h @ torch.linalg.inv(_gram(h)) + torch.linalg.inv(_blocks(h)).reshape(-1, 6),
    "inverse": lambda h: h @ torch.inverse(_gram(h)) + _blocks(h).inverse().reshape(-1, 6),
    "inv_ex": lambda h: h @ _with_info(torch.linalg.inv_ex(_gram(h))) + _with_info(torch.linalg.inv_ex(_blocks(h)))
                        .reshape(-1, 6),
    # [6, 4] (the batch axis in B's columns); [6, 2, 2] by [6, 2, 2]; [6, 2, 2] by [2, 3]: B broadcast (of A's rank
    # less one, but not its shape less one: torch's matrices, not vectors)
    "solve, matrix right side": lambda h: (torch.linalg.solve(_gram(h), h.T).T
                                           + torch.linalg.solve(_blocks(h), h.reshape(-1, 2, 2)).reshape(-1, 6)
                                           + torch.linalg.solve(_blocks(h), h[:2, :3]).reshape(-1, 6).sum(0)),
    # [6] (1-D); [6, 2] (A's shape less one: a batch of vectors); [2] (1-D, broadcast to A's batch); solve_ex's too
    "solve, vector right side": lambda h: (torch.linalg.solve(_gram(h), h[0]) * h
                                           + torch.linalg.solve(_blocks(h), h.reshape(-1, 2, 2)[:, 0]).sum(0).repeat(3)
                                           + torch.linalg.solve_ex(_blocks(h), h[1, :2]).result.reshape(-1, 6).sum(0)),
    # X A = B: [4, 6] by [6, 6]; [6, 1, 2] by [6, 2, 2]
    "solve, left=False": lambda h: (torch.linalg.solve(_gram(h), h, left=False)
                                    + torch.linalg.solve(_blocks(h), h.reshape(-1, 2, 2)[:, :1], left=False)
                                    .reshape(-1, 6).sum(0)),
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


def test_ours_win_at_every_opset() -> None:
    """Each conversion is the one the registry picks at every opset the legacy exporter writes, tensor_split's too
    (torch converts it itself from opset 13, into a tensor sequence)."""
    utils._trigger_symbolic_function_registration()
    with symbolics.exported_symbolics():
        for name, fn in symbolics.MISSING.items():
            group = registration.registry.get_function_group(name)
            for opset in range(symbolics.OPSET, _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET + 1):
                assert group is not None and group.get(opset) is fn, (name, opset)


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
