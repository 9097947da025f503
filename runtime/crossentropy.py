"""Classification losses written out for onnxruntime: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Stock onnxruntime has no CPU kernel for either; it inlines their ONNX function bodies, which reshape and
transpose to three dimensions, slice and squeeze around the gather: ~24 nodes that cost 44 µs of a 118 µs
tiny-MLP forward and 1.4 ms of the transformer's 17.6 ms forward (2 threads, this machine). Written out
here, the loss is a LogSoftmax, one GatherElements of each sample's class and a handful of per-sample ops.
Values match the function bodies' (and torch's) up to the order of the final sums; ignored samples are
selected away (`Where`), never multiplied by zero, so a -inf log-probability at an ignored label stays out.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from gradbuilder.graph import default_opset

from .passes import Nodes, rewrite_nodes

LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
MIN_OPSET = 15
"""CastLike (opset 15) casts the ignore mask to the scores' type without a shape-inference pass."""


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _negative_log_likelihood(e: Nodes, logp: str, labels: str, weights: str | None, node: onnx.NodeProto,
                             out: str) -> None:
    """`out` = the loss of log-probabilities `logp` (N, C, d1, ...) at `labels` (N, d1, ...), as the ONNX
    operator defines it: -logp[label] * weights[label], 0 for `ignore_index`, reduced by none/sum/mean (mean
    over the total weight of the counted samples)."""
    attrs = _attrs(node)
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    ignore = attrs.get("ignore_index")
    y = e("Cast", labels, to=TensorProto.INT64)  # onnxruntime drops it when labels are int64 already
    kept = None
    if ignore is not None:
        kept = e("Not", e("Equal", y, e.const(int(ignore))))
        y = e("Where", kept, y, e.const(0))
    picked = e("Squeeze", e("GatherElements", logp, e("Unsqueeze", y, e.axes([1])), axis=1), e.axes([1]))
    w = e("Gather", weights, y, axis=0) if weights is not None else None
    term = e("Mul", picked, w) if w is not None else picked
    if kept is not None:
        zero = e("CastLike", e.const(0), logp)
        term = e("Where", kept, term, zero)
        w = e("Where", kept, w, zero) if w is not None else e("CastLike", kept, logp)
    if reduction == "none":
        e("Neg", term, out=out)
        return
    total = e("ReduceSum", term, keepdims=0)
    if reduction == "sum":
        e("Neg", total, out=out)
        return
    count = e("ReduceSum", w, keepdims=0) if w is not None else e("CastLike", e("Size", y), logp)
    e("Neg", e("Div", total, count), out=out)


def _build(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    e = Nodes(node.name or node.output[0], taken)
    inputs = [*node.input, "", ""]
    weights = inputs[2] or None
    if node.op_type == "SoftmaxCrossEntropyLoss":
        log_prob = node.output[1] if len(node.output) > 1 and node.output[1] else None
        logp = e("LogSoftmax", inputs[0], axis=1, out=log_prob)
    else:
        logp = inputs[0]
    _negative_log_likelihood(e, logp, inputs[1], weights, node, node.output[0])
    return e.nodes


def lower_losses(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss of the main graph written out in standard
    ops (module docstring); returns a rewritten copy, or `model` itself when there is none (or its opset is
    below 15)."""
    if default_opset(model) < MIN_OPSET:
        return model
    plan = [(k,) for k, n in enumerate(model.graph.node) if n.op_type in LOSSES and n.domain in ("", "ai.onnx")]
    return rewrite_nodes(model, plan, _build)
