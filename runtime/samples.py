"""Whether a forward computes sample by sample: every op maps each sample's rows to its own rows, and only a loss (a
mean or sum of per-row terms) mixes them. Such a step can run as two halves of the batch (`halves`): outputs that
hold the batch are the halves' joined, a loss is the halves' weighed or added, and so are the gradients.

The proof reads the graph twice, its batch pinned to two sizes (`PINS`), through onnx's shape inference: a tensor
computed from the batch's inputs must hold each sample in `k` consecutive rows of its first axis, `k` the same at
both sizes and the other axes of fixed size (so a Transpose, Flatten or Reshape that moved the batch, a Concat or a
reduction over it shows), and its op must be one that keeps rows apart (an allowlist with each op's axis conditions:
a Softmax over axis 0 keeps the shape and mixes). Integers computed from the batch's shapes may only size a Reshape
or an Expand (those of the other axes, a sequence's length, are fixed sizes). Every graph output holds the batch,
or is the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, shape_inference

from .passes import constant_values

PINS = (7, 11)
"""The two batch sizes the graph is read at: primes, unlikely to equal a model's own sizes."""

LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
ELEMENTWISE = frozenset({
    "Identity", "Cast", "CastLike", "Clip", "Relu", "LeakyRelu", "PRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Erf", "Softplus", "Softsign", "Elu", "Selu", "Celu", "Gelu",
    "Mish", "ThresholdedRelu", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    "Floor", "Ceil", "Round", "Sign", "Not", "IsNaN", "IsInf", "Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min",
    "Sum", "Mean", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where",
})
"""Ops computing each element from the elements at its position (broadcast operands of fixed size)."""
PER_SAMPLE = frozenset({
    "Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
    "InstanceNormalization", "GroupNormalization", "LRN", "MaxRoiPool", "SpaceToDepth", "DepthToSpace", "Resize",
    "Upsample", "Pad",
})
"""Ops over one sample at a time of their first input (axis 0 is N), the other inputs fixed."""
AXIS_OPS = {"Softmax": -1, "LogSoftmax": -1, "Hardmax": -1, "LayerNormalization": -1, "LpNormalization": -1,
            "ArgMax": 0, "ArgMin": 0, "Concat": None, "Split": 0, "Gather": 0, "GatherElements": 0, "CumSum": None}
"""Ops along one axis (their default), which must not be the batch's."""
REDUCE = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"})
LAYOUT = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice", "Expand"})
"""Ops that move elements: the shapes decide (a sample's rows stay consecutive where they keep `k` rows a sample,
Reshape and Flatten where any `k` results, since they keep the elements' order)."""
SHAPE_ARITHMETIC = frozenset({"Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Mul", "Div", "Add", "Sub",
                              "Identity", "Reshape"})
"""Ops that compute with a shape's integers (a Reshape's target from a `Shape`)."""
LABEL_VIEWS = frozenset({"Reshape", "Flatten", "Identity", "Squeeze", "Unsqueeze", "Cast"})


class NotRows(Exception):
    """Why a graph does not compute its loss sample by sample."""


@dataclass(frozen=True)
class Loss:
    """A loss over the batch's rows: how the halves' losses and gradients combine."""

    output: str
    labels: str
    """The graph input holding the loss's targets (a half's weight in a mean counts those not ignored)."""
    ignore_index: int | None
    mean: bool
    """The loss averages over its rows (else it sums them)."""


@dataclass(frozen=True)
class Rows:
    """A forward computed sample by sample."""

    batched: tuple[str, ...]
    """Graph inputs whose axis 0 is the batch (cut in halves); the others (parameters) go whole to each half."""
    outputs: tuple[tuple[str, int], ...]
    """Graph outputs holding the batch, each with its rows a sample (the halves' are joined; their gradients cut)."""
    loss: Loss | None = None
    """The graph output that is a loss over the batch, if one is."""


def proven(model: onnx.ModelProto) -> Rows | None:
    """`Rows` where the model computes sample by sample, else None."""
    try:
        return prove(model)
    except NotRows:
        return None


def prove(model: onnx.ModelProto) -> Rows:
    """`Rows` for the model, or NotRows saying which node or tensor mixes samples."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    batched = tuple(i.name for i in g.input if i.name not in inits and _batch_dim(i))
    if not batched:
        raise NotRows("no graph input has a symbolic first axis (a batch)")
    shapes = [_shapes(model, batched, pin) for pin in PINS]
    constants = constant_values(g, lambda t: t.data_type == onnx.TensorProto.INT64)  # axes, indices
    k: dict[str, int] = dict.fromkeys(batched, 1)  # batched tensor -> rows a sample
    for name in batched:
        _check_rows(name, shapes, k[name])
    sizes: dict[str, tuple[bool, ...]] = {}  # integers computed from the batch's shapes -> which depend on the batch
    consumed = {x for n in g.node for x in n.input}
    read = consumed | {o.name for o in g.output}
    loss = None
    for node in g.node:
        ins = [x for x in node.input if x]
        if not any(x in k or x in sizes for x in ins):
            continue
        where = f"node '{node.name or node.output[0]}' ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            raise NotRows(f"{where}: an op of domain '{node.domain}' reads the batch")
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise NotRows(f"{where}: a subgraph reads the batch")
        if node.op_type in LOSSES:
            if loss is not None:
                raise NotRows(f"{where}: a second loss (only one is weighed)")
            loss = _loss(node, k, read, where)
            if loss[0] in consumed:
                raise NotRows(f"{where}: its loss is computed with further (each half's would be)")
            continue
        if node.op_type in ("Shape", "Size"):
            flags = _shape_flags(node, shapes)
            if any(flags):
                sizes[node.output[0]] = flags
            continue
        read_size = [i for i, x in enumerate(node.input) if x in sizes]
        if read_size:
            if node.op_type in ("Reshape", "Expand") and read_size == [1]:
                pass
            elif node.op_type in SHAPE_ARITHMETIC and not any(x in k for x in ins):
                flags = _picked(node, sizes, constants) or (True,)
                if any(flags):
                    sizes.update((o, flags) for o in node.output if o)
                continue
            else:
                raise NotRows(f"{where}: computes with the batch's size")
        _check_op(node, k, constants, read, len(shapes[0].get(node.input[0], ())), where)
        ks = {k[x] for x in ins if x in k}
        regroups = node.op_type in ("Reshape", "Flatten") or (
            node.op_type in ("Gather", "Expand") and node.input[0] not in k)  # rows from the indices or the shape
        for j, out in enumerate(node.output):
            if not out:
                continue
            if node.op_type == "MaxPool" and j == 1 and out in read:
                raise NotRows(f"{where}: its indices count the samples before")
            rows_out = _check_rows(out, shapes, None, where)
            if not regroups and ks != {rows_out}:
                raise NotRows(f"{where}: regroups the batch's rows ({sorted(ks)} rows a sample in, {rows_out} out)")
            k[out] = rows_out
    found: Loss | None = None
    outputs: list[tuple[str, int]] = []
    for out in g.output:
        if loss is not None and out.name == loss[0]:
            node = loss[1]
            found = Loss(out.name, _source(node.input[1], g, batched),
                         next((a.i for a in node.attribute if a.name == "ignore_index"), None),
                         _attr(node, "reduction", b"mean") == b"mean")
        elif out.name in k:
            outputs.append((out.name, k[out.name]))
        else:
            raise NotRows(f"the graph output '{out.name}' neither holds the batch nor is a "
                          "SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss over it")
    return Rows(batched, tuple(outputs), found)


def _shape_flags(node: onnx.NodeProto, shapes: list[dict[str, tuple[int | None, ...]]]) -> tuple[bool, ...]:
    """Which elements of a Shape's output depend on the batch (those that differ at the two pins); a Size's one."""
    if node.op_type == "Size":
        return (True,)
    a, b = (s.get(node.input[0]) for s in shapes)
    if a is None or b is None:
        return (True,)
    flags = tuple(p is None or q is None or p != q for p, q in zip(a, b))
    start, end = _attr(node, "start", 0), _attr(node, "end", None)
    return flags[start:end]  # type: ignore[misc]


def _picked(node: onnx.NodeProto, sizes: dict[str, tuple[bool, ...]], constants: dict[str, np.ndarray]
            ) -> tuple[bool, ...] | None:
    """Which elements of a shape computation's output depend on the batch, where it picks elements of one size
    tensor at constant positions (a Gather or Slice along axis 0) or keeps them in place; None where unknown."""
    flags = sizes.get(node.input[0])
    if flags is None or any(x in sizes for x in node.input[1:]):
        return None
    op = node.op_type
    if op in ("Identity", "Cast", "Squeeze", "Unsqueeze"):
        return flags
    index = [constants[x].reshape(-1).tolist() if x in constants else None
             for x in node.input[1:]]
    if any(i is None for i in index):
        return None
    if op == "Gather" and _attr(node, "axis", 0) == 0:
        return tuple(flags[i] for i in index[0])  # type: ignore[union-attr]
    if op == "Slice" and len(index) >= 2 and index[2:3] in ([], [[0]], [[-1]]) and index[3:4] in ([], [[1]]):
        return flags[index[0][0]:index[1][0]]  # type: ignore[index]
    return None


def _batch_dim(vi: onnx.ValueInfoProto) -> bool:
    t = vi.type.tensor_type
    return t.HasField("shape") and len(t.shape.dim) > 0 and not t.shape.dim[0].HasField("dim_value")


def _shapes(model: onnx.ModelProto, batched: Iterable[str], pin: int) -> dict[str, tuple[int | None, ...]]:
    """Every tensor's shape with the batch pinned to `pin` (None for a size inference leaves open)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.value_info[:]
    names = set(batched)
    for vi in m.graph.input:
        if vi.name in names:
            vi.type.tensor_type.shape.dim[0].Clear()
            vi.type.tensor_type.shape.dim[0].dim_value = pin
    try:
        inferred = shape_inference.infer_shapes(m, data_prop=True)
    except Exception as e:  # onnx raises its own types
        raise NotRows(f"shape inference failed: {e}") from e
    g = inferred.graph
    out: dict[str, tuple[int | None, ...]] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
    return out


def _check_rows(name: str, shapes: list[dict[str, tuple[int | None, ...]]], want: int | None, where: str = "") -> int:
    """The rows a sample holds in tensor `name`: its first axis `k` times the batch at both pins, the other axes
    fixed; NotRows otherwise."""
    a, b = (s.get(name) for s in shapes)
    at = where or f"input '{name}'"
    if a is None or b is None or None in a or None in b or not a or len(a) != len(b):
        raise NotRows(f"{at}: the sizes of '{name}' are not known at a fixed batch")
    if a[0] % PINS[0] or b[0] % PINS[1] or a[0] // PINS[0] != b[0] // PINS[1] or a[1:] != b[1:]:
        raise NotRows(f"{at}: '{name}' ({a} at batch {PINS[0]}) does not hold the batch in its first axis")
    k = a[0] // PINS[0]
    if want is not None and k != want:
        raise NotRows(f"{at}: '{name}' holds {k} rows a sample")
    return k


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


def _check_op(node: onnx.NodeProto, k: dict[str, int], constants: dict[str, np.ndarray], read: set[str],
              rank: int, where: str) -> None:
    """NotRows unless the op keeps each sample's rows apart, given which inputs hold the batch (`rank`: its first
    input's; `read`: the tensors read in the graph)."""
    op, first = node.op_type, node.input[0] if node.input else ""
    if op in ELEMENTWISE or op in LAYOUT:
        return
    if op in PER_SAMPLE:
        if any(x in k for x in node.input[1:]):
            raise NotRows(f"{where}: a parameter input holds the batch")
        return
    if op == "BatchNormalization":
        if _attr(node, "training_mode", 0) or sum(1 for o in node.output if o) > 1 or any(
                x in k for x in node.input[1:]):
            raise NotRows(f"{where}: batch statistics mix the samples")
        return
    if op == "Gemm":
        if _attr(node, "transA", 0) or any(x in k for x in node.input[1:]):
            raise NotRows(f"{where}: a product over the batch")
        return
    if op == "MatMul":
        return  # the shapes decide: a product over the batch leaves no batch axis first
    if op == "Dropout":  # each element its own draw: the runtime cuts the whole batch's mask (`halves`)
        if any(o in read for o in node.output[1:]):
            raise NotRows(f"{where}: its mask is read")
        return
    if op in REDUCE:
        axes = _attr(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            t = constants.get(node.input[1])
            if t is None:
                raise NotRows(f"{where}: its axes are computed")
            axes = t.tolist()
        if not axes and not _attr(node, "noop_with_empty_axes", 0):
            raise NotRows(f"{where}: reduces every axis")
        if axes and 0 in _normal(axes, rank):
            raise NotRows(f"{where}: reduces over the batch")
        return
    if op in AXIS_OPS:
        if op in ("Gather", "GatherElements") and first not in k:
            return  # an embedding: rows picked by the batch's indices
        default = AXIS_OPS[op]
        if op == "CumSum":
            t = constants.get(node.input[1])
            if t is None:
                raise NotRows(f"{where}: its axis is computed")
            axis = int(t)
        else:
            axis = _attr(node, "axis", default)
        if axis is None or 0 in _normal([axis], rank):
            raise NotRows(f"{where}: works along the batch's axis")
        if op in ("Gather", "GatherElements") and node.input[1] in k:
            raise NotRows(f"{where}: indices from the batch pick from the batch")
        return
    raise NotRows(f"{where}: {op} is not known to keep samples apart")


def _normal(axes: list[int], rank: int) -> list[int]:
    return [a + rank if a < 0 else a for a in axes]


def _loss(node: onnx.NodeProto, k: dict[str, int], read: set[str], where: str) -> tuple[str, onnx.NodeProto]:
    if node.op_type not in LOSSES or len([x for x in node.input if x]) != 2:
        raise NotRows(f"{where}: a weighted loss (its weights would count in each half's mean)")
    if node.input[0] not in k or node.input[1] not in k or k[node.input[0]] != k[node.input[1]]:
        raise NotRows(f"{where}: its scores and labels do not both hold the batch")
    reduction = _attr(node, "reduction", b"mean")
    if reduction not in (b"mean", b"sum"):
        raise NotRows(f"{where}: reduction '{reduction}' is not a mean or a sum")
    if any(o in read for o in node.output[1:]):
        raise NotRows(f"{where}: its log-probabilities are read")
    return node.output[0], node


def _source(name: str, g: onnx.GraphProto, batched: tuple[str, ...]) -> str:
    """The graph input a loss's labels are a view of (through reshapes and casts)."""
    producers = {o: n for n in g.node for o in n.output}
    seen = name
    while seen not in batched:
        n = producers.get(seen)
        if n is None or n.op_type not in LABEL_VIEWS:
            raise NotRows(f"the loss's labels '{name}' are computed, not a view of a graph input")
        seen = n.input[0]
    return seen
