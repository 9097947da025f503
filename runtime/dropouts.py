"""Dropout variants torch's legacy exporter refuses in training mode, written in ops it exports.

`nn.Dropout1d/2d/3d` (torch's `feature_dropout`: whole channels) and `nn.AlphaDropout` / `nn.FeatureAlphaDropout`
(SELU's dropout, which keeps the mean and the variance) export only in eval mode: in training the exporter stops
at `aten::feature_dropout, training mode` (and its alpha variants). While the runtime exports, `exportable_dropouts`
has them computed from a plain dropout of ones, which exports as an ONNX Dropout in training mode (whose mask the
runtime then draws on the host like any other's, `host_dropout`), with torch's own arithmetic (`_dropout_impl`):

- feature dropout: `x * dropout(ones[N, C, 1, ...], p)`, kept channels scaled by 1 / (1 - p);
- alpha dropout: `x * (keep * a) + ((keep - 1) * alpha a + alpha a p)` with `keep = dropout(ones) > 0` (a value
  an element, or a channel for the feature variant), `a = ((alpha^2 p + 1)(1 - p))^-1/2`, alpha = 1.7580993408473766.

As in torch, p = 0 or eval mode returns the input and p = 1 multiplies it by zero.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch.nn import functional as F

from .patching import replaced

ALPHA = 1.7580993408473766
"""SELU's scale times its alpha: the value alpha dropout sets dropped elements to, before its affine correction."""

def _noise_shape(x: torch.Tensor, feature: bool) -> tuple[int, ...]:
    """One draw an element, or one a channel (the first two dims, as torch's `make_feature_noise`)."""
    return (*x.shape[:2], *[1] * (x.dim() - 2)) if feature else tuple(x.shape)


def _keep(x: torch.Tensor, p: float, feature: bool) -> torch.Tensor:
    """dropout(ones): 1 / (1 - p) where kept, 0 where dropped (an ONNX Dropout in training mode)."""
    return F.dropout(x.new_ones(_noise_shape(x, feature)), p, True)


def _dropout(feature: bool, alpha: bool) -> Callable[[torch.Tensor, float, bool], torch.Tensor]:
    def dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if p == 0 or not train:
            return x
        if p == 1:
            return x * torch.zeros((), dtype=x.dtype)
        if not alpha:
            return x * _keep(x, p, feature)
        a = 1.0 / math.sqrt((ALPHA * ALPHA * p + 1) * (1 - p))
        keep = (_keep(x, p, feature) > 0).to(x.dtype)
        b = (keep - 1) * (ALPHA * a) + ALPHA * a * p
        return x * (keep * a) + b

    return dropout


_REPLACED = {name: _dropout(feature, alpha) for name, feature, alpha in (
    ("feature_dropout", True, False), ("alpha_dropout", False, True), ("feature_alpha_dropout", True, True))}


def memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of a dense tensor stored in another order than its own (a transposed view), outermost first; None
    where its memory order is its dims' order (or it is not dense: torch's `empty_like` then makes it so)."""
    if x.is_contiguous():
        return None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d)))
    return order if x.permute(order).is_contiguous() else None


def _drawn_in_memory_order(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """torch's dropout draws its mask in the memory order of its input (`empty_like` keeps the strides, `bernoulli_`
    fills memory in order): a transposed view is dropped as the permutation that stores it contiguously, so the
    exported Dropout's mask, drawn in its input's logical order, is torch's (`host_dropout.Mask`)."""
    order = memory_order(x) if train and 0 < p < 1 else None
    if order is None:
        return torch._C._VariableFunctions.dropout(x, p, train)
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return torch._C._VariableFunctions.dropout(x.permute(order), p, train).permute(inverse)


def exportable_dropouts() -> contextlib.AbstractContextManager[None]:
    """torch's `_VF` feature and alpha dropouts (and their in-place forms, traced out of place) replaced for the
    duration (the export, under its lock), and plain dropouts of transposed views (`_drawn_in_memory_order`: the
    masks of the first call, drawn as torch's for its check, and of every call under `torch_masks`)."""
    replacements = [(torch._VF, variant, fn) for name, fn in _REPLACED.items() for variant in (name, name + "_")]
    replacements += [(torch._VF, name, _drawn_in_memory_order) for name in ("dropout", "dropout_")]
    return replaced(replacements)
