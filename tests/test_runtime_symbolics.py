"""runtime/symbolics.py: ops torch's legacy exporter has no conversion for ("Exporting the operator ... is not
supported") train through ORTModule like torch, in-place forms and torch.special aliases included, and interpolate's
nearest-exact; so does tensor_split, which it converts into a tensor sequence (no gradient rule), and so do the ops
it converts into something else than torch computes: floor_divide (truncated), index with two or more index tensors
(negative ones read wrongly), max / min along a dim (ties' gradient split, NaNs dropped), var / std over every axis
(float32 in float64), float32 constants in float64 (log2, elu, ...), roll, chunk, unique's inverse, fmax / fmin,
median's and clamp's ties (tensor bounds), div's floor mode, scatter_reduce (Ifs declaring wrong sizes),
repeat_interleave by a tensor (a Loop) and by a count (other ops' axes changed), amax / amin, max of every element
and argmax (NaN dropped), round to decimals and addmm (float32 constants in float64), addbmm, frac, movedim (negative
dims), embedding's padding_idx, integers clamped by floats, cumsum of a 0-d tensor, attention with a query masked out
and xlogy's gradient at x = 0, and batch_norm without running statistics (a batch sized at run time refused). The
float64 entries hold to `DOUBLE_RTOL`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity, sgd
from torch import nn
from torch.nn import functional as F
from torch.onnx import _constants
from torch.onnx._internal.torchscript_exporter import registration, utils

from runtime import symbolics

MATRIX = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
ZEROS = torch.tensor([[1.0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0], [0, 1, 0, 1, 1, 1], [1, 1, 1, 0, 1, 1]])
"""Exact zeros for cumprod, one or two per row, one per column (its gradient before a zero, at it, past it)."""


INF = float("inf")
NAN = float("nan")
NO_PROBABILITY = torch.tensor([[1, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 0]]).bool()
"""Where `_log_masked` puts -inf: leading runs (logcumsumexp's outputs -inf), and pairs both -inf under flip(1) (row 0,
positions 0 and 5) and flip(0) (rows 0 and 3, position 0)."""
NANS = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]]).bool()
INFS = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0]]).bool()
"""Where `_with_nans` puts NaN (two in a row: the first is max's and min's) and inf (a row with NaNs too; a tie)."""


def _log_masked(h: torch.Tensor) -> torch.Tensor:
    """h with -inf (log-probabilities of 0) where `NO_PROBABILITY`: its gradient there (NaN in torch's logaddexp and
    logcumsumexp of two -infs) never reaches a parameter, masked_fill's backward selects."""
    return h.masked_fill(NO_PROBABILITY, -INF)


def _with_nans(h: torch.Tensor) -> torch.Tensor:
    return h.masked_fill(NANS, NAN).masked_fill(INFS, INF)


def _finite(result: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """max / min's values (NaN and inf as 0, no gradient there) shifted by their indices."""
    values, indices = result
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0) * (1 + indices / 10) + indices


def _ints(h: torch.Tensor) -> torch.Tensor:
    """h rounded to int64, without a gradient (torch's floor_divide has none)."""
    return h.detach().round().long()


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


IDS = torch.tensor([[0, 1, 5], [1, 2, 1]])
"""Rows of a [6, 4] weight, the padding rows 0 and 1 among them."""
ROWS = torch.tensor([True, False, True, False])
"""The rows of `NANS` that hold NaNs."""


def _nan_rows(h: torch.Tensor) -> torch.Tensor:
    """h with `NANS`' NaNs, its rows holding them detached: torch's amax gives each element of a group whose result
    is NaN a NaN gradient (0 / 0), which must not reach a parameter."""
    return torch.where(ROWS[:, None], h.detach().masked_fill(NANS, NAN), h)


ATTEND = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4, [False, False, False, True]])
"""Which keys each of 4 queries attends to: the second none (torch's attention gives it zeros, and no gradient)."""


def _attended(h: torch.Tensor) -> torch.Tensor:
    """Attention of h's 4 rows (queries and keys from halves of them) under `ATTEND`, as a boolean and as a float
    mask (-inf)."""
    q, k, v = h[None, :, :3], h[None, :, 3:], h[None]
    blocked = torch.zeros(4, 4, dtype=h.dtype).masked_fill(~ATTEND, -INF)
    return (F.scaled_dot_product_attention(q, k, v, attn_mask=ATTEND)
            + F.scaled_dot_product_attention(q, k, v, attn_mask=blocked, scale=0.7))[0]


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
    # x = 0 with a gradient (straight through): x's is log(y) there, 0 where also y <= 0
    "xlogy at x = 0": lambda h: torch.xlogy(h - h.detach(), h.abs() + 0.1) + torch.xlogy(h - h.detach(), h),
    "attention with a query masked out": _attended,
    "addmv": lambda h: torch.addmv(h[0], MATRIX, h[1], beta=0.5, alpha=3) + torch.addmv(h[2], MATRIX, h[3], beta=0),
    "addr": lambda h: torch.addr(MATRIX, h[0], h[1], beta=2, alpha=0.5),
    "sgn": lambda h: torch.sgn(h) * h,
    "fmax, fmin": lambda h: torch.fmax(h, h.flip(1)) + torch.fmin(h, h.flip(0)),
    "trunc, fix": lambda h: (torch.trunc(3 * h) + torch.fix(h)) * h,
    # no conversion: dynamo's export, whose Python numbers are float32 in float64 (2.7 * h)
    "frac": lambda h: torch.frac(2.7 * h) * h + h.frac(),
    "median": lambda h: h.median(1, keepdim=True).values * h + torch.median(h) + h[:, :4].median(1).values[:, None],
    # chunks h[:, :2], h[:, 2:-1], h[:, -1:5] (empty), h[:, 5:]; h[:, :-9] (empty), h[:, -9:3], h[:, 3:30], h[:, 30:]
    # (empty); 4 sections of 6: 2, 2, 1, 1; 3 of the batch's 4 (read at run time): 2, 1, 1
    "tensor_split indices": lambda h: torch.cat([c * (k + 1) for k, c in enumerate(h.tensor_split([2, -1, 5], 1))], 1),
    "tensor_split past the end": lambda h: torch.cat(torch.tensor_split(h, (-9, 3, 30), dim=-1)[::-1], 1).exp(),
    "tensor_split sections": lambda h: torch.cat([c.exp() * (k + 1) for k, c in enumerate(h.T.tensor_split(4))], 0).T,
    "tensor_split sections, batch axis": lambda h: sum(c.sum(0) * (k + 1) for k, c in enumerate(h.tensor_split(3))),
    "cumprod with zeros": lambda h: (h * ZEROS).cumprod(0) + (h * ZEROS).cumprod(1),
    # and of a 0-d tensor (onnxruntime's CumSum refuses a scalar)
    "cumsum of bools, ints, in double": lambda h: (h * (h > 0).cumsum(1) + h.round().int().cumsum(0)
                                                   + torch.cumsum(h, -1, dtype=torch.float64).float()
                                                   + h * h.sum().cumsum(0)),
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
    # floor division rounds down (torch's conversion truncates): floats, tenths by a tenth (0.3 // 0.1 is 2, floor of
    # the rounded quotient 3), ints by a negative scalar and by ints of both signs; no gradient in torch (detached)
    "floor_divide": lambda h: h * ((3 * h.detach()) // 0.7 + (h.detach() * 10).round() / 10 // 0.1
                                   + torch.floor_divide(-h.detach(), h.detach().flip(1))),
    "floor_divide of ints": lambda h: h * (_ints(7 * h) // -3 + _ints(5 * h) // _ints(3 * h.flip(0)).masked_fill(
        _ints(3 * h.flip(0)) == 0, -2)),
    # -inf and -inf: -inf, as torch's (NaN before); the output through exp (0 at -inf, no gradient)
    "logaddexp of -infs": lambda h: (torch.logaddexp(_log_masked(h), _log_masked(h).flip(1)).exp()
                                     + torch.logaddexp2(_log_masked(h), _log_masked(h).flip(0)).exp2()
                                     + torch.logaddexp(_log_masked(h), torch.full_like(h, -INF)).exp()),
    # along the 6 and the batch axis (its length read at run time), leading -infs; spread out values (dynamo's
    # max-shifted conversion underflows them)
    "logcumsumexp": lambda h: (_log_masked(h).logcumsumexp(1).exp() + _log_masked(h).logcumsumexp(0).exp()
                               + torch.logcumsumexp(30 * h, -1) / 30 + torch.logcumsumexp(h.T, 1).T),
    # reversed: the flip's gradient a scatter, whose NaNs at the -infs the masked_fill's backward, a Where, stops (a
    # product by its mask did not; its condition recomputed in backward)
    "logcumsumexp reversed": lambda h: _log_masked(h).flip(1).logcumsumexp(1).exp(),
    # ties: the whole gradient to the first occurrence, as torch's (ReduceMax splits it)
    "max, min along a dim with ties": lambda h: (_with_indices(_tied(h).max(1)).unsqueeze(1)
                                                 + _with_indices(_tied(h).min(0, keepdim=True))
                                                 + _with_indices(torch.max(_tied(h), -2))
                                                 + _with_indices(_tied(h).min(-1, True))),
    # NaN propagates: its value, the first NaN's index; inf ties a NaN-free row's max
    "max, min along a dim with NaN": lambda h: (_finite(_with_nans(h).max(1)).unsqueeze(1)
                                                + _finite(_with_nans(h).min(1, keepdim=True))
                                                + _finite(_with_nans(h).max(0)) + _finite(_with_nans(-h).min(0))),
    # every axis (torch's conversion: float32 in float64, shape () for keepdim's (1, 1)), some, with corrections
    "var, std over every axis": lambda h: (h.var() * h + h.std() + torch.var_mean(h)[0] + h.var(dim=(0, 1))
                                           + torch.cat([h.var(None, keepdim=True), h[:, :1]]).mean()
                                           + torch.std_mean(h, correction=0)[0]),
    "var, std along dims": lambda h: (h.var(1, keepdim=True) * h + h.std(0, unbiased=False)
                                      + torch.var_mean(h, -1, correction=2)[1][:, None]
                                      + h.var([0, 1], keepdim=True)),
    # torch's log2, log10, addcmul, elu, selu, leaky_relu and rrelu constants were float32 (1e-8 off in float64)
    "log2, log10, addcmul": lambda h: (torch.log2(h.abs() + 0.1) + torch.log10(h.abs() + 0.1)
                                       + torch.addcmul(h, h, h.flip(1), value=0.1) + torch.addcmul(h, h, h)),
    "elu, selu, leaky_relu, rrelu": lambda h: (F.elu(h, 0.3) + F.selu(h) + F.leaky_relu(h, 0.1)
                                               + F.rrelu(h, training=False) + F.elu(800 * h) / 800
                                               + F.elu(h.clone(), 1.5, inplace=True)),
    "celu": lambda h: F.celu(h, 0.3) + F.celu(2 * h),
    # |shift| >= size wraps (torch's conversion sliced at -shift); no dims: the flattened tensor's
    "roll": lambda h: (h.roll(13, 1) + 2 * h.roll(-7, 1) + 3 * h.roll(1, 1) + 4 * h.roll(7)
                       + 5 * h.roll((-9, 2), (1, 0)) + 6 * h.roll(6, -1)),
    # fewer chunks than asked where torch gives fewer: 6 into 4 and 5 is 3 of 2; the batch's 4 into 3: 2 of 2
    "chunk": lambda h: (torch.cat([c * (k + 1) for k, c in enumerate(h.chunk(4, 1))], 1)
                        + torch.cat([c.exp() * (k + 1) for k, c in enumerate(h.chunk(5, -1))], 1)
                        + torch.cat([c * (k + 1) for k, c in enumerate(h.chunk(3, 0))], 0)),
    # the inverse in the input's shape (torch's conversion returned it flat)
    "unique": lambda h: h * torch.unique(_ints(2 * h), return_inverse=True)[1] + h * torch.unique(
        _ints(h), sorted=True, return_inverse=True, return_counts=True)[2].sum(),
    # ties: the whole gradient to the first argument, as torch's (Max / Min split it); NaNs: the other one's
    "fmax, fmin with ties": lambda h: (torch.fmax(_tied(h), _tied(h).flip(1)) + torch.fmin(_tied(h), _tied(h).flip(0))
                                       + 2 * torch.fmax(_tied(h).flip(1), _tied(h))
                                       + torch.fmin(_tied(h), torch.zeros(()))),
    "fmax, fmin with NaN": lambda h: (torch.fmax(_with_nans(h), _with_nans(h).flip(1)).nan_to_num(0.0, 0.0, 0.0)
                                      + torch.fmin(_with_nans(h), h.flip(0)).nan_to_num(0.0, 0.0, 0.0)),
    # div(rounding_mode="floor") rounds as floor_divide (torch's conversion floors a / b: 0.3 / 0.1 to 3); trunc
    "div floor": lambda h: h * (torch.div(3 * h.detach(), 0.7, rounding_mode="floor")
                                + torch.div((h.detach() * 10).round() / 10, 0.1, rounding_mode="floor")
                                + torch.div(_ints(7 * h), -3, rounding_mode="floor")
                                + torch.div(h.detach(), 0.3, rounding_mode="trunc")),
    # ties: the gradient split evenly among the elements equal to the median, as torch's (along a dim: one)
    "median with ties": lambda h: torch.median(_tied(h)) * h + torch.median(_tied(h)[:, :3]),
    # tensor bounds (broadcast, a 0-d one, min above max, min == max): the gradient of a tie wholly to x, as torch's
    # (Max / Min split it); past them the bound's, none where x < min == max
    "clamp with tensor bounds, ties": lambda h: (torch.clamp(_tied(h), _tied(h)[:, :1], _tied(h)[:, 1:2])
                                                 + 2 * torch.clip(_tied(h), min=_tied(h).flip(1))
                                                 + 3 * _tied(h).clamp_max(_tied(h).flip(0))
                                                 + 4 * torch.clamp(_tied(h), _tied(h).flip(1), _tied(h).flip(0))
                                                 + 5 * _tied(h).clamp(max=_tied(h).mean())
                                                 + 6 * _tied(h).clamp_min(_tied(h)[:1]).clone().clamp_(max=h)),
    # integers clamped by floats: in floats, as torch's (torch's Clip cast the bounds to the integers' type)
    "clamp of integers by floats": lambda h: h * (_ints(3 * h).clamp(-2.5, 3.5) + _ints(h).clamp(min=0.5)
                                                  + torch.clamp(_ints(2 * h), max=h.detach().flip(0))),
    # NaN in x or in a bound: NaN, as torch's
    "clamp with tensor bounds, NaN": lambda h: (torch.clamp(_with_nans(h), _with_nans(h).flip(1), h.flip(0))
                                                + torch.clamp(h, min=_with_nans(h).flip(0))
                                                + torch.clamp(h.flip(1), max=_with_nans(h))).nan_to_num(0.0, 0.0, 0.0),
    # NaN propagates (onnxruntime's ReduceMax keeps one only where it comes first: row 0's [x, nan, ...]); every
    # element's max: NaN's gradient split among the NaNs, masked_fill's backward drops it; ties split evenly
    "amax, amin, aminmax, max of every element with NaN": lambda h: (
        sum(t.nan_to_num(0.0) for t in (_nan_rows(h).amax(1, keepdim=True), _nan_rows(h).amin(-1)[:, None],
                                         sum(torch.aminmax(_nan_rows(h), dim=1))[:, None],
                                         h.detach().masked_fill(NANS, NAN).amax((0, 1)))) * h
        + _with_nans(h).max().nan_to_num(0.0) + _with_nans(-h).min().nan_to_num(0.0) * h
        + _tied(h).amax() * h + _tied(h).min() + _tied(h).amin(0)),
    # the first NaN's index (onnxruntime's ArgMax skips NaNs), along a dim and of the flattened tensor
    "argmax, argmin with NaN": lambda h: h * (_with_nans(h).argmax(1, keepdim=True) + _with_nans(h).argmin(0)
                                              + _with_nans(h).argmax() / 10 + h.argmin(keepdim=True)),
    # row p of a weight no nn.Embedding owns (computed here) gets no gradient (torch's conversion ignored p)
    "embedding with padding_idx": lambda h: (F.embedding(IDS, h.T, padding_idx=1) + F.embedding(IDS, h.T.exp(), 0)
                                             + F.embedding(IDS, h.T)).reshape(-1, 6),
    # torch's kernel divides by 10^d (torch's conversion multiplied by a float32 0.1); no gradient in torch
    "round with decimals": lambda h: h * (torch.round(h.detach() * 3, decimals=1)
                                          + torch.round(h.detach() * 300, decimals=-2) + h.detach().round()),
    # float64: beta and alpha were Gemm's float32 attributes; addbmm: no conversion (dynamo's: float32 constants)
    "addmm, addbmm": lambda h: (torch.addmm(h, h, h.T @ h, beta=0.3, alpha=1.7) + torch.addmm(h, h, h.T @ h)
                                + torch.addbmm(h[:2, :2], h.reshape(-1, 2, 6), h.reshape(-1, 6, 2).flip(0), beta=0.7,
                                               alpha=0.1).sum()),
    # no running statistics, a batch sized at run time (torch's conversion refused it); no weight, no bias
    "batch_norm without running statistics": lambda h: (
        F.batch_norm(h, None, None, training=True) + F.batch_norm(h, None, None, h[0].exp(), h[1], True, 0.1, 1e-3)
        + F.batch_norm(h.reshape(-1, 3, 2), None, None, h[2, :3], None, training=True).reshape(-1, 6)
        # a variance near eps: float64's torch eps, not the attribute's float32 (9e-9 off)
        + F.batch_norm(h * 0.003, None, None, training=True, eps=1e-5).square()),
    # a negative source dim (torch's conversion wrote it into Transpose's perm: onnxruntime refused the model)
    "movedim with negative dims": lambda h: (h.reshape(-1, 2, 3).movedim(-1, 1).reshape(-1, 6)
                                             + torch.moveaxis(h.reshape(-1, 2, 3), (0, -1), (-1, 1)).reshape(6, -1).T),
    # Mamba-2's permute(0, -2, -1, 1): torch's conversion wrote the negative dims into perm (refused by onnx)
    "permute with negative dims": lambda h: (h.reshape(-1, 2, 3, 1).permute(0, -2, -1, 1).reshape(-1, 6) * h
                                             + h.reshape(-1, 3, 2).permute(-1, 0, -2).reshape(-1, 6)[: h.shape[0]]),
}
DOUBLE = ["frac", "xlogy at x = 0", "clamp of integers by floats", "amax, amin, aminmax, max of every element with NaN",
          "round with decimals", "addmm, addbmm", "floor_divide", "floor_divide of ints",
          "logaddexp of -infs", "logcumsumexp", "logcumsumexp reversed", "max, min along a dim with ties",
          "max, min along a dim with NaN",
          "logaddexp2", "var, std over every axis", "var, std along dims", "log2, log10, addcmul",
          "elu, selu, leaky_relu, rrelu", "roll", "chunk", "unique", "fmax, fmin with ties", "fmax, fmin with NaN",
          "div floor", "median with ties", "clamp with tensor bounds, ties", "clamp with tensor bounds, NaN",
          "batch_norm without running statistics"]
"""The entries also run in float64, to `DOUBLE_RTOL`."""
DOUBLE_RTOL = 1e-10
"""float64's tolerance: a float32 constant or step puts ~1e-8 into it."""


class Op(nn.Module):
    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.op = op

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return (self.op(self.fc(x)) * r).sum()


@pytest.mark.parametrize("op, dtype", [pytest.param(op, torch.float32, id=op) for op in OPS]
                         + [pytest.param(op, torch.float64, id=f"{op}, float64") for op in DOUBLE])
def test_converted_ops_train_like_torch(op: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 6, generator=g, dtype=dtype), torch.randn(1, 6, generator=g, dtype=dtype))
               for _ in range(3)]
    rtol = {"rtol": DOUBLE_RTOL} if dtype == torch.float64 else {}
    check_parity(lambda: Op(OPS[op]).to(dtype), batches, lambda m, b: m(*b), threads=1, **rtol)


RUN_TIME: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "roll along the batch axis": lambda h: h.roll(5, 0) + 2 * h.roll(-3, 0) + 3 * h.roll((2, 7), (0, 1)),
    "var over the batch axis": lambda h: (h.var(0) + h.var() * h + h.var(None, keepdim=True)
                                          + h.std(1, keepdim=True) * h + torch.var_mean(h, 1)[0][:, None]
                                          + torch.median(h)),
    "unique of the batch": lambda h: h * torch.unique(_ints(2 * h), return_inverse=True)[1],
    # 6 in chunks of 4 along an axis the graph sizes at run time (torch's conversion: 4 and 4)
    "split unevenly": lambda h: torch.cat([c.sin() * (i + 1) for i, c in enumerate(h.split(4, 1))], 1),
    # Hugging Face's Mamba: indices read from a size (torch's conversion took them for a count of sections)
    "tensor_split at a size": lambda h: torch.cat([c.exp() * (i + 1) for i, c in enumerate(
        torch.tensor_split(h, [h.shape[0] - 1], dim=0))], 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", list(RUN_TIME))
def test_sizes_read_at_run_time(op: str, dtype: torch.dtype) -> None:
    """Batches of 4, 5 and 7 rows through one export: the batch axis's size read at run time (a shift of 5 wraps
    to 1, 0 and 5)."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(1, 6, generator=g, dtype=dtype))
               for n in (4, 5, 7)]
    rtol = {"rtol": DOUBLE_RTOL} if dtype == torch.float64 else {}
    check_parity(lambda: Op(RUN_TIME[op]).to(dtype), batches, lambda m, b: m(*b), threads=1, **rtol)


MASK = torch.tensor([True, False, True, True])
"""Three of axis 1's four."""

INDEXING: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "w[i, j]": lambda w, i, j: w[i, j],
    "w[:, i, j]": lambda w, i, j: w[:, i, j],
    "w[i, :, j]": lambda w, i, j: w[i, :, j],
    "w[i, j, i]": lambda w, i, j: w[i, j, i],
    "w[i[:, None], j] (broadcast)": lambda w, i, j: w[i[:, None], j],
    "w[:, mask, j]": lambda w, i, j: w[:, MASK, j[:3]],
    "w[i] (one index)": lambda w, i, j: w[:, i],
}


class Indexed(nn.Module):
    """An index of h = fc(x), [2, 4, 6] (sizes read at run time), and of a parameter of the same static sizes."""

    def __init__(self, index: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(2, 4, 6))
        self.index = index

    def forward(self, x: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (self.index(h, i, j).exp() * (1 + self.index(self.w, i, j))).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("index", list(INDEXING))
def test_advanced_indexing_with_negative_indices_trains_like_torch(index: str, dtype: torch.dtype) -> None:
    """Two or more index tensors with negative entries: torch's conversion combines them as i * stride + j without
    wrapping them (wrong elements, or a Gather out of bounds). i indexes axes of 2 (and 4), j of 4 (and 6): every
    value from -2 (-4) on; more indices at each call."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, 6, generator=g, dtype=dtype), torch.randint(-2, 2, (n,), generator=g),
                torch.randint(-4, 4, (n,), generator=g)) for n in (5, 7, 9)]
    check_parity(lambda: Indexed(INDEXING[index]).to(dtype), batches, lambda m, b: m(*b), threads=1)


class Scattered(nn.Module):
    """h = fc(x) rounded (ties, `_tied`) scattered into its first 3 columns at positions i (a module input) by
    `reduce`, then one op, whose result the module returns. Without self, into values no element of h ties."""

    def __init__(self, reduce: str, include_self: bool):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.reduce, self.include_self = reduce, include_self

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        h = _tied(self.fc(x))
        into = h[:, :3] if self.include_self else h[:, :3] * 2 + 0.5
        return into.scatter_reduce(1, i, h, self.reduce, include_self=self.include_self).clamp_min(-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("include_self", [True, False], ids=["self", "without self"])
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_scatter_reduce_with_index_input_trains_like_torch(reduce: str, include_self: bool, dtype: torch.dtype) -> None:
    """torch's conversion wraps the scatter in Ifs on self being 0-d, whose branches declare sizes that are not the
    tensors' ([12] for [4, 3]): the gradient build failed at the next node. Batches of 4, 5 and 7 rows; ties among
    self and the values scattered (amax, amin: the gradient shared)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n, 6), generator=g),
                torch.randn(1, 3, generator=g, dtype=dtype)) for n in (4, 5, 7)]
    check_parity(lambda: Scattered(reduce, include_self).to(dtype), batches, lambda m, b: (m(*b[:2]) * b[2]).sum(),
                 threads=1)


class Repeated(nn.Module):
    """h = fc(x) repeated along its batch axis (`rows` repeats, a module input, zeros among them), along its axis of
    6 (a buffer's, and a single repeat broadcast), flattened (`flat` repeats) and by an int (torch's)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("columns", torch.tensor([1, 0, 2, 3, 1, 1]))

    def forward(self, x: torch.Tensor, rows: torch.Tensor, flat: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return ((h.repeat_interleave(rows, dim=0).exp() * torch.arange(6)).sum()
                + (h.repeat_interleave(self.columns, dim=1) ** 2).sum()
                + 2 * torch.repeat_interleave(h, flat).tanh().cumsum(0).sum()
                + 3 * h.repeat_interleave(one, dim=-1).sin().sum() + h.repeat_interleave(2, dim=0).square().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_repeat_interleave_by_tensor_trains_like_torch(dtype: torch.dtype) -> None:
    """A tensor of repeats: a gather (torch's conversion writes a Loop, which has no gradient, where the repeats or
    the axis's size are read at run time). Batches of 4, 5 and 7 rows, repeats 0 to 3."""
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g),
                torch.randint(0, 4, (n * 6,), generator=g), torch.randint(1, 4, (1,), generator=g)) for n in (4, 5, 7)]
    check_parity(lambda: Repeated().to(dtype), batches, lambda m, b: m(*b), threads=1,
                 **({"rtol": DOUBLE_RTOL} if dtype == torch.float64 else {}))


class InterleavedRotary(nn.Module):
    """Cohere's rotary embedding: angles repeated pairwise by an int (`repeat_interleave(freqs, 2, dim=-1)`, rank 3),
    then each query rotated pairwise (`torch.stack([-x2, x1], dim=-1).flatten(-2)`, rank 4) and a softmax over the
    last axis: torch's conversion of the repeat added the rank to the -1 that the trace shares between them, in
    place (the stack went to axis 2: onnxruntime refused the session, "Incompatible dimensions")."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 16)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4) / 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq.to(x.dtype)  # [L, 4]
        emb = torch.repeat_interleave(angles[None].expand(x.shape[0], -1, -1), 2, dim=-1)[:, None]  # [B, 1, L, 8]
        q = self.q(x).unflatten(-1, (2, 8)).transpose(1, 2)  # [B, 2, L, 8]
        rotated = torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).flatten(-2)
        return (q * emb.cos() + rotated * emb.sin()).softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_repeat_count_leaves_the_other_axes_alone(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(3, n, 8, generator=g, dtype=dtype), torch.randn(3, 2, n, 8, generator=g, dtype=dtype))
               for n in (5, 7, 5)]
    check_parity(lambda: InterleavedRotary().to(dtype), batches, lambda m, b: (m(b[0]) * b[1]).sum(), threads=1,
                 **({"rtol": DOUBLE_RTOL} if dtype == torch.float64 else {}))


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


def test_encoder_layer_with_a_padded_out_sequence_trains_like_torch() -> None:
    """A batch with a sequence all padding (nn.MultiheadAttention's float -inf mask empties its rows): torch's
    attention gives its queries zeros (no NaN), and so must ours, at the first call (the export's check) and at
    later ones with other lengths. SGD: Adam's first step turns rounding noise into full-size steps."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
            return self.layer(x, src_key_padding_mask=padded).square().mean()

    g = torch.Generator().manual_seed(3)
    lengths = [(3, 0), (0, 5), (2, 0)]
    batches = [(torch.randn(2, 5, 8, generator=g), torch.arange(5)[None, :] >= torch.tensor(n)[:, None])
               for n in lengths]
    check_parity(Net, batches, lambda m, b: m(*b), sgd, threads=1)
