"""Chains of Linear layers computed feature-major: zᵀ = W hᵀ + b instead of z = h Wᵀ + b.

onnxruntime's SGEMM (MLAS) is faster with the features as rows at MLP shapes. Alone, 2 threads, the three
products of a layer (forward, weight gradient, input gradient) took 0.83-0.98 of the batch-major ones at
batch 32-256 and widths 256-1024; an MLP's whole step 0.89-0.97 (paired against the batch-major export). A
chain pays one Transpose of what enters it (the flattened input) and one of what leaves (the logits), so it
needs two layers at least. And the batch must fill MLAS's strips of `ROW_BLOCK` columns (`fills_strips`): feature-major,
the batch is the products' columns, batch-major the widths are. Two threads, the three products of a layer
feature-major over batch-major (session 51): 0.82-1.01 at batch 64 and 128, but 1.03-1.24 at batch 50, 0.91-1.05
at 100, 1.04-1.40 at 20-72 off the multiples of 16, 1.07-1.13 at 8 and 12; a whole step paired (after torch steps):
784-800-800-10 at batch 50 0.94 batch-major, at 100 even, while at 16, 32, 64, 128, 256 and 512 feature-major
stayed 1-8% faster. (Before: at batch 1 the step was 1.08-1.12 of the batch-major one, at 4 1.00-1.07.)

The rewrite is on the forward source, before the gradient is built: the Gemm rule then differentiates the
feature-major products into products in the same orientation (dW = Gemm(dZᵀ, hᵀ, transB=1),
dhᵀ = Gemm(W, dZᵀ, transA=1)), and the elementwise activations between them do not care about the layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import onnx

from gradbuilder.graph import infer_shapes_safely, subgraph_free_names
from gradbuilder.inference import Dims, tensor_types

from .passes import Nodes, constant_values, forget_types, fresh_name, names_in_use

ELEMENTWISE = frozenset({
    "Relu", "LeakyRelu", "Tanh", "Sigmoid", "Elu", "Selu", "Celu", "Softplus", "Softsign", "HardSigmoid",
    "HardSwish", "Erf", "Gelu", "Mish", "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Identity",
    "ThresholdedRelu", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Clip", "PRelu", "Dropout"})
"""Ops computing each output element from the same element of their inputs: any layout, as long as every
input is in it (the chain's tensors) or is a single value that broadcasts the same either way. A Dropout
draws its mask element by element too (its mask output, in the chain's layout, may only be unread: the
Dropout rule reads it later)."""

TRANSPOSED = "gradbuilder.feature_major"
"""The metadata key of a Dropout computed feature-major: its mask is the transpose of torch's for the same draws
(`host_dropout.Mask.transposed`)."""

MIN_LINEARS = 2
ROW_BLOCK = 16
"""The columns MLAS's SGEMM kernels compute at a time (a strip of its packed B): a last strip holding fewer wastes
the rest of it."""
MIN_FILL = 0.98
"""The least share of its strips a batch must fill to run feature-major: 127 rows (0.99) ran the products at 0.92
of batch-major, 200 rows (0.96) at 1.02, 60, 90 and 150 (0.94) at 1.04-1.05."""


def fills_strips(rows: int) -> bool:
    """Whether `rows` samples, as the columns of feature-major products, fill MLAS's strips (`MIN_FILL`)."""
    return rows >= ROW_BLOCK and rows / (ROW_BLOCK * math.ceil(rows / ROW_BLOCK)) >= MIN_FILL


class _Linear(NamedTuple):
    """z = h op(B) (+ C): the weight B, whether op transposes it, and the Transpose node folded into op."""

    weight: str
    trans_b: int
    folded: int | None = None


def _linear(k: int, n: onnx.NodeProto, g: onnx.GraphProto, dims: dict[str, Dims | None],
            readers: dict[str, list[tuple[int, int]]], producer: dict[str, int]) -> _Linear | None:
    """A Gemm with transA 0, or a MatMul of 2-D activations and a 2-D weight (torch's bias-free Linear: the
    weight through a Transpose nothing else reads, which then folds into the product)."""
    if n.domain not in ("", "ai.onnx") or len(n.output) != 1:
        return None
    if n.op_type == "Gemm":
        if next((a.i for a in n.attribute if a.name == "transA"), 0):
            return None
        return _Linear(n.input[1], next((a.i for a in n.attribute if a.name == "transB"), 0))
    if n.op_type != "MatMul" or any(len(dims.get(x) or ()) != 2 for x in n.input):
        return None
    b = n.input[1]
    t = producer.get(b)
    if t is not None and g.node[t].op_type == "Transpose" and readers.get(b) == [(k, 1)] and \
            [a.ints for a in g.node[t].attribute if a.name == "perm"] in ([], [[1, 0]]):
        return _Linear(g.node[t].input[0], 1, t)
    return _Linear(b, 0)


def feature_major_chains(model: onnx.ModelProto, rows: int | None = None, dropouts: bool = True) -> onnx.ModelProto:
    """Components of at least two Linears (2-D Gemms with transA 0 and a bias of rank at most 1) joined by
    elementwise ops, whose tensors nothing else reads, computed feature-major: `Gemm(h, B, b, transB=t)`
    becomes `Gemm(B, hᵀ, b[:, None], transA=1-t)`. What enters a component as a Linear's activations is
    transposed once; what leaves it (read elsewhere, or a graph output) is transposed back under its own
    name. Only for rows that fill MLAS's column strips (`fills_strips`): those of the entering activations when the
    graph fixes them, else `rows` (the batch the caller expects) when given. `dropouts=False` ends components at
    Dropouts, whose masks then keep torch's layout (`SessionConfig.torch_masks`). Returns a rewritten copy, or
    `model` itself when nothing matches."""
    g = model.graph
    # torch's export declares few intermediate shapes; inference gives the ranks bias-free Linears need
    types = tensor_types(infer_shapes_safely(model) or g)
    dims = {**{k: v[1] for k, v in types.items()}, **{t.name: list(t.dims) for t in g.initializer}}
    consts = constant_values(g, lambda t: int(np.prod(t.dims)) <= 1)
    readers: dict[str, list[tuple[int, int]]] = {}  # tensor -> (node index, input position); -1 for a subgraph
    for k, n in enumerate(g.node):
        for pos, x in enumerate(n.input):
            readers.setdefault(x, []).append((k, pos))
        for x in subgraph_free_names(n):
            readers.setdefault(x, []).append((k, -1))
    outputs = {o.name for o in g.output}

    def single(x: str) -> bool:
        shape = dims.get(x)
        return x in consts or (shape is not None and all(d == 1 for d in shape))

    def bias_ok(n: onnx.NodeProto) -> bool:
        c = n.input[2] if len(n.input) > 2 else ""
        return not c or single(c) or (dims.get(c) is not None and len(dims[c]) == 1)

    def unread(x: str) -> bool:
        return not x or (x not in readers and x not in outputs)

    producer = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    found = {k: _linear(k, n, g, dims, readers, producer) for k, n in enumerate(g.node)}
    linear = {k: lin for k, lin in found.items() if lin is not None and bias_ok(g.node[k])}
    elementwise = {k for k, n in enumerate(g.node) if n.op_type in ELEMENTWISE and n.domain in ("", "ai.onnx")
                   and all(unread(x) for x in n.output[1:]) and (dropouts or n.op_type != "Dropout")}
    member = set(linear) | elementwise

    def layout_free_read(k: int, pos: int) -> bool:
        return (k in elementwise and pos >= 0) or (k in linear and pos == 0)

    # a member's output stays inside the chain when every reader is a member reading it where layout is free
    inner = {n.output[0] for k, n in enumerate(g.node) if k in member and n.output[0] not in outputs
             and readers.get(n.output[0]) and all(layout_free_read(k2, p) for k2, p in readers[n.output[0]])}

    # components: members joined by inner tensors (union-find)
    parent = {k: k for k in member}

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for x in inner:
        for k2, _ in readers[x]:
            parent[find(k2)] = find(producer[x])
    groups: dict[int, list[int]] = {}
    for k in sorted(member):
        groups.setdefault(find(k), []).append(k)

    def rows_fill_strips(ks: list[int]) -> bool:
        entering = [dims.get(g.node[k].input[0]) for k in ks if k in linear and g.node[k].input[0] not in inner]
        first = [d[0] for d in entering if d and isinstance(d[0], int)]
        return all(map(fills_strips, first)) if first else rows is None or fills_strips(rows)

    chosen: set[int] = set()
    for ks in groups.values():
        # an elementwise member must read only chain tensors and single values; a Linear's activations may enter
        if sum(k in linear for k in ks) >= MIN_LINEARS and rows_fill_strips(ks) and all(
                x in inner or single(x) or not x for k in ks if k in elementwise for x in g.node[k].input):
            chosen.update(ks)
    if not chosen:
        return model
    columns = {c for k in chosen & linear.keys() for c in g.node[k].input[2:3] if c and not single(c)}  # rank 1
    return _transpose_chains(model, chosen, {k: v for k, v in linear.items() if k in chosen}, inner, columns)


def _transpose_chains(model: onnx.ModelProto, chosen: set[int], linear: dict[int, _Linear], inner: set[str],
                      columns: set[str]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    taken = names_in_use(g)
    entered: dict[str, str] = {}  # activations entering a chain -> their transpose
    nodes: list[onnx.NodeProto] = []
    relaid: set[str] = set()
    folded = {lin.folded for lin in linear.values() if lin.folded is not None}
    for k, n in enumerate(g.node):
        if k in folded:  # the weight's Transpose, now op's transB
            relaid.update(n.output)
            continue
        if k not in chosen:
            nodes.append(n)
            continue
        emit = Nodes(n.name or n.output[0], taken)
        y = n.output[0]
        if k in linear:
            h = n.input[0]
            if h not in inner:
                if h not in entered:
                    entered[h] = emit("Transpose", h, out=fresh_name(f"{h}/feature_major", taken), perm=[1, 0])
                h = entered[h]
            inputs = [linear[k].weight, h]
            c = n.input[2] if n.op_type == "Gemm" and len(n.input) > 2 else ""
            if c:
                inputs.append(emit("Unsqueeze", c, emit.axes([1]), out=fresh_name(f"{c}/column", taken))
                              if c in columns else c)
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute
                     if a.name in ("alpha", "beta")}
            n = onnx.helper.make_node("Gemm", inputs, [y], name=n.name, transA=1 - linear[k].trans_b, **attrs)
        elif n.op_type == "Dropout":
            n.metadata_props.add(key=TRANSPOSED, value="1")
        relaid.update(n.output)
        nodes.extend(emit.nodes)
        if y not in inner:  # leaves the chain: transposed back under its own name
            n.output[0] = fresh_name(f"{y}/feature_major", taken)
            nodes.append(n)
            nodes.append(onnx.helper.make_node("Transpose", [n.output[0]], [y], name=fresh_name(f"{y}/back", taken),
                                               perm=[1, 0]))
            relaid.discard(y)
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    forget_types(g, relaid)  # same names, transposed shapes
    return out

