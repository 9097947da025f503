"""Classification losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both pick, per sample (and per spatial position of (N, C, d1, ...) inputs), the class of its label, weight
it by `weights[label]` (0 for `ignore_index`) and reduce with none/sum/mean, mean dividing by the total
weight. So both gradients are `coef * (something - onehot(label))` along the class axis with the same
per-sample coefficient, built once by `_coefficient`.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .context import Grad
from .registry import rule


def _labels(g: Grad) -> str:
    labels = g.I(1)
    return labels if g.dtype(labels) == TensorProto.INT64 else g.Cast(labels, to=TensorProto.INT64)


def _kept(g: Grad, labels: str) -> tuple[str | None, str]:
    """Which labels count (None: all of them, no ignore_index), and the labels with the ignored ones at class 0:
    a valid index everywhere, whose coefficient is 0."""
    ignore = g.attr("ignore_index")
    if ignore is None:
        return None, labels
    kept = g.Not(g.Equal(labels, g.ints(ignore)))
    return kept, g.Where(kept, labels, g.ints(0))


def _coefficient(g: Grad, x: str, kept: str | None, labels: str, dy: str) -> str:
    """dLoss/dloss_i per sample: dY times the sample's weight, over the total weight for mean; shaped
    (N, 1, d1, ...) to broadcast over the class axis, or a scalar when every sample weighs the same.
    `kept`, `labels`: from `_kept`."""
    weights = g.I(2)
    reduction = g.attr("reduction", "mean")
    w = g.cast_like(kept, x) if kept is not None else None
    if weights is not None:
        picked = g.Gather(weights, labels, axis=0)
        w = picked if w is None else g.Mul(picked, w)
    if reduction in ("none", "sum"):
        coef = dy if w is None else g.Mul(dy, w)
    elif reduction == "mean":
        if w is None:
            coef = g.Div(dy, _count(g, x, labels))
        else:  # no sample counted (a batch of ignored labels): torch's gradient is 0, not 0 / 0
            total = g.ReduceSum(w, keepdims=0)
            zero = g.const(0.0, like=x)
            total = g.Where(g.Equal(total, zero), g.const(1.0, like=x), total)
            coef = g.Mul(g.Div(dy, total), w)
    else:
        g.fail(f"unknown reduction '{reduction}'")
    per_sample = w is not None or reduction == "none"
    return g.unsqueeze(coef, [1]) if per_sample else coef


def _count(g: Grad, x: str, labels: str) -> str:
    """Number of labels (N * d1 * ...), as a scalar of x's type."""
    n = g.info(g.I(1)).numel()
    if n is not None:
        return g.const(float(n), like=x)
    size = g.Size(labels)
    return g.cast_like(size, x)


def _scores_rank(g: Grad, x: str) -> int:
    """The rank of the scores (N, C, d1, ...): known, or the labels' (N, d1, ...) plus one (a Reshape of the scores to
    a shape read at run time hides it from onnx's inference, as onnx's own expanded loss functions do)."""
    rank = g.rank(x)
    if rank is None:
        labels = g.rank(g.I(1))
        return labels + 1 if labels is not None else g.require_rank(x)
    return rank


def _onehot(g: Grad, x: str, labels: str) -> str:
    """(N, C, d1, ...) one-hot of the labels along axis 1, in x's type (ignored labels match no class)."""
    rank = _scores_rank(g, x)
    shape = g.info(x).shape
    c = shape[1] if shape is not None else None
    tail = [1] * (rank - 2)
    if isinstance(c, int):
        classes = g.ints(np.arange(c).reshape([1, c, *tail]).tolist())
    else:
        depth = g.Squeeze(g.Gather(g.shape_of(x), g.ints([1])), g.ints([0]))
        classes = g.Reshape(g.Range(g.ints(0), depth, g.ints(1)), g.ints([1, -1, *tail]))
    hit = g.Equal(g.unsqueeze(labels, [1]), classes)
    return g.cast_like(hit, x)


@rule("SoftmaxCrossEntropyLoss", since=13, nondiff=(1, 2))
def softmax_cross_entropy(g: Grad):
    """d scores = coef * (softmax - onehot), plus the log_prob output's own gradient when it has one.

    The softmax is exp of the log_prob output, added to the node when the model left it out: the forward
    computes it anyway, it takes the scores' place in the stash (the same size), and one Exp costs less than a
    Softmax of the scores (onnxruntime, 2 threads: 116 against 125 µs at 512x1000, 1.65 against 2.38 ms at
    128x50257; over the class axis of (N, C, H, W) one pass against the runtime's five, written out since
    onnxruntime's kernel transposes: per-pixel CNN steps 0.96 of before, `benchmarks.ab`). torch's backward, too,
    takes exp of its log-softmax output. Over
    (N, C) scores the onehot is never built: coef * softmax everywhere, then coef * (softmax - 1) written at each
    label (one element a sample instead of three passes over the scores). Over (N, C, d1, ...) scores, a
    per-position loss, onnxruntime's ScatterElements along the class axis is the slower (8x21x64x64: 0.88 ms
    against 0.56 for the onehot's passes; 4x10x32x32: 0.07 against 0.03), so the onehot is subtracted there.
    Over few classes (`_few_classes`) the onehot is onnx's OneHot, and the loss's gradient 8 nodes instead of 17.
    """
    scores = g.I(0)
    prob = g.Exp(g.output(1, "log_prob"))
    grad = None
    classes = _few_classes(g, scores)
    if g.GO(0) is not None and classes is not None:
        grad = _onehot_gradient(g, prob, classes, g.GO(0))
    elif g.GO(0) is not None:
        kept, labels = _kept(g, _labels(g))
        coef = _coefficient(g, scores, kept, labels, g.GO(0))
        if _scores_rank(g, scores) > 2:
            grad = g.Mul(g.Sub(prob, _onehot(g, scores, labels)), coef)
        else:
            index = g.unsqueeze(labels, [1])  # (N, 1) along the class axis
            at_label = g.Mul(g.Sub(g.GatherElements(prob, index, axis=1), g.const(1.0, like=scores)), coef)
            grad = g.ScatterElements(g.Mul(prob, coef), index, at_label, axis=1)
    if g.GO(1) is not None:  # log_softmax's own backward
        dlp = g.GO(1)
        own = g.Sub(dlp, g.Mul(prob, g.reduce_sum(dlp, [1], keepdims=True)))
        grad = own if grad is None else g.Add(grad, own)
    return (grad,)


ONEHOT_CLASSES = 64
"""The most classes for which the loss's gradient is written with onnx's OneHot (`_onehot_gradient`): its three
passes over the (N, C) scores cost less than the scatter's nodes over few classes (each node's dispatch ~1 µs on
the caches a torch step left cold; 10 classes, onnxruntime steps paired against the scatter's, each after a torch
step: MLP 784-128-10 0.986-0.989, 100-200-200-10 0.96-0.99, 784-512-512-10 0.987-0.993, LeNet 0.991-1.0); at a
vocabulary's size one pass and a scatter of N elements win."""


def _few_classes(g: Grad, scores: str) -> int | None:
    """C where `_onehot_gradient` gives the gradient: (N, C) scores, C known and at most `ONEHOT_CLASSES`, no class
    weights, a mean or a sum, and an ignore_index (if any) below -C. OneHot's rows are zero exactly for the labels
    outside [-C, C), and it counts a negative label from the end, as the forward's GatherElements does: so its zero
    rows are the ignored samples (torch's -100 with fewer than 100 classes), and any other label the forward
    accepted picks the class the forward picked (the forward fails on the rest)."""
    shape = g.info(scores).shape
    ignore = g.attr("ignore_index")
    if shape is None or len(shape) != 2 or not isinstance(shape[1], int) or shape[1] > ONEHOT_CLASSES:
        return None
    if g.I(2) is not None or g.attr("reduction", "mean") not in ("mean", "sum"):
        return None
    return shape[1] if ignore is None or ignore < -shape[1] else None


def _onehot_gradient(g: Grad, prob: str, classes: int, dy: str) -> str:
    """d scores = (prob * kept - onehot) * coef (`_onehot_coefficient`); `kept` is 1 on a row with a label, 0 on an
    ignored one."""
    onehot = _labels_onehot(g, classes)
    if g.attr("ignore_index") is not None:
        prob = g.Mul(prob, g.reduce_sum(onehot, [1], keepdims=True))
    return g.Mul(g.Sub(prob, onehot), _onehot_coefficient(g, onehot, dy))


def _labels_onehot(g: Grad, classes: int) -> str:
    """(N, C) one-hot of the labels in the scores' type, zero rows for the labels outside [-C, C) (`_few_classes`)."""
    onehot = g.OneHot(_labels(g), g.ints(classes), g.const([0.0, 1.0], elem_type=TensorProto.FLOAT), axis=-1)
    if g.dtype(g.I(0)) != TensorProto.FLOAT:  # onnxruntime's OneHot makes no doubles
        onehot = g.cast_like(onehot, g.I(0))
    return onehot


def _onehot_coefficient(g: Grad, onehot: str, dy: str) -> str:
    """dLoss/dloss_i of every counted sample: dy, over the number of counted labels for mean (at least 1: a batch of
    ignored labels gets zeros, as torch's)."""
    if g.attr("reduction", "mean") != "mean":
        return dy
    return g.Div(dy, g.Max(g.ReduceSum(onehot, keepdims=0), g.const(1.0, like=g.I(0))))


@rule("NegativeLogLikelihoodLoss", since=13, nondiff=(1, 2))
def negative_log_likelihood(g: Grad):
    """d input = -coef * onehot(label); over few classes (`_few_classes`) with onnx's OneHot, 6 nodes instead of 15."""
    x = g.I(0)
    classes = _few_classes(g, x)
    if classes is not None:
        onehot = _labels_onehot(g, classes)
        return (g.Mul(onehot, g.Neg(_onehot_coefficient(g, onehot, g.GO(0)))),)
    labels = _labels(g)
    kept, safe = _kept(g, labels)
    return (g.Neg(g.Mul(_onehot(g, x, labels), _coefficient(g, x, kept, safe, g.GO(0)))),)
