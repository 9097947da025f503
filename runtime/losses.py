"""Losses torch's legacy exporter cannot export, written in ops it exports, while the runtime exports.

`l1_loss`, `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy`, `soft_margin_loss`, `margin_ranking_loss`,
`hinge_embedding_loss`, `poisson_nll_loss`, `cosine_embedding_loss`, `triplet_margin_loss`, `multi_margin_loss`
and `multilabel_margin_loss` have no ONNX symbolic ("Exporting the operator 'aten::l1_loss' ... is not
supported"), `cross_entropy` refuses `label_smoothing` ("ONNX does not support label_smoothing") and exports
probability targets as an invalid graph, and `binary_cross_entropy_with_logits` exports the log of a sigmoid
(-inf past |x| ~ 17): a module returning such a loss could not train, or not at confident logits. While
exporting, `exportable_losses` replaces the `torch._C._nn` and `torch` functions `torch.nn.functional` calls (after
its own argument checks and broadcasting) by torch's own formulas (aten's) in exportable ops:

- l1: |x - y|; smooth l1: 0.5 z^2 / beta where z = |x - y| < beta, else z - 0.5 beta (l1 for beta = 0); huber:
  0.5 z^2 where z < delta, else delta (z - 0.5 delta);
- binary cross-entropy: (y - 1) max(log(1 - p), -100) - y max(log(p), -100), times the weight (torch's log1p(-p)
  as log(1 - p): equal but for p below ~1e-7), with torch's gradient for p, (p - y) / max(p (1 - p), 1e-12),
  finite where p is exactly 0 or 1;
- binary cross-entropy with logits: (1 - y) x + w softplus(-x), w = (pos_weight - 1) y + 1 (torch's);
- multilabel margin: for each target class j (y before its first -1) and each non-target i, max(0, 1 - x[j] +
  x[i]), summed over both and divided by the number of classes;
- soft margin: log(1 + exp(-y x)); margin ranking: max(0, -y (x1 - x2) + margin); hinge embedding: x where
  y != -1 plus max(0, margin - x) where y != 1; Poisson NLL: exp(x) - y x (or x - y log(x + eps)), with the
  Stirling term where y > 1 when `full`; cosine embedding: 1 - cos where y = 1, max(0, cos - margin) where
  y = -1, cos = x1.x2 / sqrt((|x1|^2 + 1e-12)(|x2|^2 + 1e-12)); triplet margin: max(0, margin + d(a, p) - d(a, n))
  with d the p-norm of the difference plus eps (d(a, n) the smaller of it and d(p, n) with `swap`); multi margin
  (a batch of score rows): the mean over classes j != y of max(0, margin - x_y + x_j)^p, times the weight of y;
- cross-entropy with label smoothing e over C classes and class-index targets: (1 - e) nll + e / C times the
  summed negative log-probabilities (weighted, ignored targets left out), normalised as torch does;
- cross-entropy with probability targets (smoothed first, `target (1 - e) + e / C`), with or without label
  smoothing: the exporter writes a SoftmaxCrossEntropyLoss with float labels, which ONNX refuses; written here
  as torch computes it, -sum(target * log_softmax(x)) (weighted), the mean over the samples and positions;
- cross-entropy and NLL with reduction "none", under dynamo: -logp[target] * weight[target], 0 at ignore_index
  (dynamo declares torch's per-sample loss of (N, C) scores 0-d, an inconsistent model the gradient build refuses;
  the legacy exporter's SoftmaxCrossEntropyLoss is right, and cheaper).

Constants that are not float32 numbers (e / C of a traced C, the Stirling term's 2 pi) are `functions.exact`, so
that a float64 loss is torch's to rounding under either exporter.

Each then reduces as asked (none, mean, sum). Gradients are the exported graph's, equal to torch's up to rounding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

from .functions import exact, pairwise_distance
from .patching import replaced

_NONE, _MEAN, _SUM = 0, 1, 2
"""torch's reduction enum (`torch.nn._reduction.get_enum`)."""


def _reduce(loss: torch.Tensor, reduction: int) -> torch.Tensor:
    return loss.mean() if reduction == _MEAN else loss.sum() if reduction == _SUM else loss


def _l1(x: torch.Tensor, y: torch.Tensor, reduction: int) -> torch.Tensor:
    return _reduce((x - y).abs(), reduction)


def _smooth_l1(x: torch.Tensor, y: torch.Tensor, reduction: int, beta: float = 1.0) -> torch.Tensor:
    if beta == 0:
        return _l1(x, y, reduction)
    z = (x - y).abs()
    return _reduce(torch.where(z < beta, 0.5 * z * z / beta, z - 0.5 * beta), reduction)


def _huber(x: torch.Tensor, y: torch.Tensor, reduction: int, delta: float = 1.0) -> torch.Tensor:
    z = (x - y).abs()
    return _reduce(torch.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


def _binary_cross_entropy(p: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None, reduction: int
                          ) -> torch.Tensor:
    """The value from the formula at p held constant (its target gradient is torch's); p's gradient torch's own,
    (p - y) / max(p (1 - p), 1e-12), added by a term that is 0: the formula's own is 0 * inf = nan where p is
    exactly 0 or 1 (a saturated sigmoid), which torch's backward keeps finite."""
    fixed = p.detach()
    loss = (y - 1) * torch.clamp(torch.log(1 - fixed), min=-100) - y * torch.clamp(torch.log(fixed), min=-100)
    slope = ((fixed - y) / torch.clamp(fixed * (1 - fixed), min=1e-12)).detach()
    loss = loss + (p - fixed) * slope
    return _reduce(loss if weight is None else loss * weight, reduction)


def _binary_cross_entropy_with_logits(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None,
                                      pos_weight: torch.Tensor | None, reduction: int) -> torch.Tensor:
    """torch's stable form, (1 - y) x + w_pos (softplus(-x)) with w_pos = (pos_weight - 1) y + 1: the
    exporter's log of a sigmoid is -inf past |x| ~ 17 (NaN gradients), and its gradient at x = 0 is right. torch
    computes it in place on 1 - y, so the loss has the targets' type, each step rounded to it (float32 labels of
    float64 logits, ELECTRA's `labels.float()`: a float32 loss)."""
    kept = (1 - y).dtype

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == kept else t.to(kept)

    softplus = F.softplus(-x)
    loss = rounded(rounded((1 - y) * x) + (softplus if pos_weight is None else ((pos_weight - 1) * y + 1) * softplus))
    return _reduce(loss if weight is None else rounded(loss * weight), reduction)


def _multilabel_margin(x: torch.Tensor, y: torch.Tensor, reduction: int) -> torch.Tensor:
    """torch's: for each target class j (y's entries before its first -1) and each class i not a target,
    max(0, 1 - x[j] + x[i]), summed and divided by the number of classes."""
    single = x.dim() == 1
    x, y = (x.unsqueeze(0), y.unsqueeze(0)) if single else (x, y)
    listed = (y < 0).long().cumsum(-1) == 0  # the entries before the first -1
    index = y.clamp(min=0)
    targets = torch.zeros_like(x).scatter_add(-1, index, listed.to(x.dtype)) > 0
    margins = torch.relu(1 - x.gather(-1, index).unsqueeze(-1) + x.unsqueeze(-2))  # [N, listed j, class i]
    counted = listed.unsqueeze(-1) & ~targets.unsqueeze(-2)
    loss = (margins * counted.to(x.dtype)).sum((-2, -1)) / x.shape[-1]
    return _reduce(loss.squeeze(0) if single else loss, reduction)


def _soft_margin(x: torch.Tensor, y: torch.Tensor, reduction: int) -> torch.Tensor:
    return _reduce(torch.log(1 + torch.exp(-y * x)), reduction)


def _margin_ranking(x1: torch.Tensor, x2: torch.Tensor, y: torch.Tensor, margin: float, reduction: int
                    ) -> torch.Tensor:
    return _reduce(torch.clamp(-y * (x1 - x2) + margin, min=0), reduction)


def _hinge_embedding(x: torch.Tensor, y: torch.Tensor, margin: float, reduction: int) -> torch.Tensor:
    zeros = torch.zeros_like(x)
    loss = torch.where(y != 1, torch.clamp(margin - x, min=0), zeros) + torch.where(y != -1, x, zeros)
    return _reduce(loss, reduction)


def _poisson_nll(x: torch.Tensor, y: torch.Tensor, log_input: bool, full: bool, eps: float, reduction: int
                 ) -> torch.Tensor:
    loss = torch.exp(x) - y * x if log_input else x - y * torch.log(x + eps)
    if full:
        stirling = y * torch.log(y) - y + 0.5 * torch.log(exact(2 * math.pi, y) * y)  # 2 pi exact in float64
        loss = loss + torch.where(y <= 1, torch.zeros_like(stirling), stirling)
    return _reduce(loss, reduction)


def _cosine_embedding(x1: torch.Tensor, x2: torch.Tensor, y: torch.Tensor, margin: float, reduction: int
                      ) -> torch.Tensor:
    dim = 1 if x1.dim() == 2 else 0
    eps = 1e-12
    cos = (x1 * x2).sum(dim) / torch.sqrt(((x1 * x1).sum(dim) + eps) * ((x2 * x2).sum(dim) + eps))
    zeros = torch.zeros_like(cos)
    loss = torch.where(y == 1, 1 - cos, zeros) + torch.where(y == -1, torch.clamp(cos - margin, min=0), zeros)
    return _reduce(loss, reduction)


def _triplet_margin(anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, margin: float, p: float,
                    eps: float, swap: bool, reduction: int) -> torch.Tensor:
    d_pos, d_neg = pairwise_distance(anchor, positive, p, eps), pairwise_distance(anchor, negative, p, eps)
    if swap:
        d_neg = torch.minimum(d_neg, pairwise_distance(positive, negative, p, eps))
    return _reduce(torch.clamp(margin + d_pos - d_neg, min=0), reduction)


def _multi_margin(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def multi_margin(x: torch.Tensor, y: torch.Tensor, p: int, margin: float, weight: torch.Tensor | None,
                     reduction: int) -> torch.Tensor:
        if x.dim() != 2:
            return original(x, y, p, margin, weight, reduction)
        z = torch.relu(margin - x.gather(1, y[:, None]) + x)  # strict, as torch's: no gradient at z = 0 (clamp's)
        z = z * z if p == 2 else z
        if weight is not None:
            z = z * weight[y][:, None]
        picked = torch.arange(x.shape[1])[None, :] == y[:, None]
        return _reduce(torch.where(picked, torch.zeros_like(z), z).sum(1) / x.shape[1], reduction)

    return multi_margin


def _picked_nll(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
                ) -> torch.Tensor:
    """nll_loss's reduction "none" (scores on dim 1): -logp[target] * weight[target], 0 at ignore_index. The dynamo
    exporter declares torch's own 0-d on (N, C) scores, and the gradient build refuses the inconsistent model."""
    ignored = target == ignore_index
    index = torch.where(ignored, torch.zeros_like(target), target)
    loss = -logp.gather(1, index.unsqueeze(1)).squeeze(1)
    loss = loss if weight is None else loss * weight[index]
    return torch.where(ignored, torch.zeros_like(loss), loss)


def _kept(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int | torch.Tensor | torch.SymInt,
          dtype: torch.dtype) -> torch.Tensor:
    """Each sample's weight in nll_loss's mean: its class's weight (1 without), 0 where ignored."""
    ignored = target == ignore_index
    kept = (~ignored).to(dtype)
    return kept if weight is None else kept * weight[torch.where(ignored, torch.zeros_like(target), target)]


def _nll(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
         ignore_index: int | torch.Tensor | torch.SymInt) -> torch.Tensor:
    """nll_loss (scores on dim 1) written out: the picked terms, summed, or over the kept samples' weights."""
    loss = _picked_nll(logp, target, weight, ignore_index)
    if reduction != _MEAN:
        return _reduce(loss, reduction)
    return loss.sum() / _kept(target, weight, ignore_index, loss.dtype).sum()


def _written_out(scores: torch.Tensor, reduction: int, ignore_index: int | torch.Tensor | torch.SymInt) -> bool:
    """Whether the loss on (N, C, ...) scores is written out rather than torch's: where `ignore_index` was read from
    a size (Hugging Face's question answering ignores the positions past the sequence,
    `CrossEntropyLoss(ignore_index=start_logits.size(1))`), which both exporters' losses take only as a number
    (legacy: "i_(): incompatible function arguments"; dynamo: "Unsupported attribute"), and by reduction "none"
    under dynamo."""
    if scores.dim() < 2:
        return False
    if isinstance(ignore_index, torch.Tensor | torch.SymInt):
        return True
    return reduction == _NONE and not torch.jit.is_tracing()


def _nll_loss(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def nll_loss(logp: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                 ignore_index: int) -> torch.Tensor:
        if _written_out(logp, reduction, ignore_index):
            return _nll(logp, target, weight, reduction, ignore_index)
        return original(logp, target, weight, reduction, ignore_index)

    return nll_loss


def _smoothing_share(label_smoothing: float, classes: Any, like: torch.Tensor) -> torch.Tensor:
    """label_smoothing / classes in the scores' dtype and rank: the class count is traced (a tensor), and the legacy
    exporter writes its quotient with a Python number, or a 0-d tensor (folded to a 0-d constant where the count is
    known), in float32: 1e-8 off in a float64 loss."""
    return exact(label_smoothing, like) / classes


def _cross_entropy(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def cross_entropy(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
                      ignore_index: int, label_smoothing: float) -> torch.Tensor:
        dim = 1 if x.dim() >= 2 else 0
        classes = x.shape[dim]
        shape = [1] * x.dim()
        shape[dim] = classes
        if target.is_floating_point():  # probabilities
            if label_smoothing > 0:
                target = target * (1 - label_smoothing) + _smoothing_share(label_smoothing, classes, x)
            terms = torch.log_softmax(x, dim) * target
            terms = terms if weight is None else terms * weight.reshape(shape)
            return _reduce(-terms.sum(dim), reduction)  # a mean over the samples, as torch
        if label_smoothing <= 0:
            if _written_out(x, reduction, ignore_index):
                return _nll(torch.log_softmax(x, 1), target, weight, reduction, ignore_index)
            return original(x, target, weight, reduction, ignore_index, label_smoothing)
        logp = torch.log_softmax(x, dim)
        nll = torch.nn.functional.nll_loss(logp, target, weight, ignore_index=ignore_index,
                                           reduction=("none", "mean", "sum")[reduction])
        ignored = target == ignore_index
        smooth = -(logp if weight is None else logp * weight.reshape(shape)).sum(dim)
        smooth = torch.where(ignored, torch.zeros((), dtype=smooth.dtype), smooth)
        if reduction == _MEAN:
            smooth = smooth.sum() / _kept(target, weight, ignore_index, smooth.dtype).sum()
        elif reduction == _SUM:
            smooth = smooth.sum()
        return ((1 - label_smoothing) * nll + smooth * _smoothing_share(label_smoothing, classes, x)).reshape_as(nll)

    return cross_entropy


def exportable_losses() -> contextlib.AbstractContextManager[None]:
    """The `torch._C._nn` and `torch` losses above replaced for the duration (the export, under its lock)."""
    nn_ops = torch._C._nn
    replacements: list[tuple[Any, str, Any]] = [
        (nn_ops, "l1_loss", _l1), (nn_ops, "smooth_l1_loss", _smooth_l1), (nn_ops, "huber_loss", _huber),
        (nn_ops, "binary_cross_entropy", _binary_cross_entropy), (nn_ops, "soft_margin_loss", _soft_margin),
        (torch, "binary_cross_entropy_with_logits", _binary_cross_entropy_with_logits),
        (nn_ops, "cross_entropy_loss", _cross_entropy(nn_ops.cross_entropy_loss)),
        (torch, "margin_ranking_loss", _margin_ranking), (torch, "hinge_embedding_loss", _hinge_embedding),
        (torch, "poisson_nll_loss", _poisson_nll), (torch, "cosine_embedding_loss", _cosine_embedding),
        (torch, "triplet_margin_loss", _triplet_margin),
        (nn_ops, "multi_margin_loss", _multi_margin(nn_ops.multi_margin_loss)),
        (nn_ops, "nll_loss_nd", _nll_loss(nn_ops.nll_loss_nd)),
        (nn_ops, "multilabel_margin_loss", _multilabel_margin)]
    return replaced(replacements)
