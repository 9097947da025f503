"""Sums written the way onnxruntime's CPU kernels run them fastest.

`leading_sums_as_products`: ReduceSum over leading axes as a product with a vector of ones.

Bias gradients are sums over the leading axes of a row-major tensor ([tokens, features] -> [features]).
onnxruntime's ReduceSum walks such a tensor at 1.5-4x the time MLAS takes for the same sum written as
`ones[M] @ x[M, R]` (2 threads, this machine: 64x512 42 -> 11 µs, 512x512 439 -> 120 µs, 128x50257
10.1 -> 2.3 ms; the GPT-2 LM head's bias). The product adds in another order: results differ from
ReduceSum's by float rounding only.

`rows_untransposed`: a contraction over the rows of both operands (a weight gradient: dY^T x, a sum over the
batch) transposes dY itself instead of leaving it to the product.

`scatters_into_sums`: a gradient summed from several contributions, one of them a scatter-add into zeros
(an embedding table tied to its LM head: Gather's adjoint beside MatMul's), scatters into the other
contributions instead: no table-sized zero fill, no table-sized buffer of its own, no Sum pass over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.graph import default_opset
from gradbuilder.inference import Dims, infer_shapes, tensor_types

from .passes import (
    Readers,
    constant_values,
    drop_dead,
    fresh_name,
    int_attr,
    names_in_use,
    pads_with_zeros,
    rewrite_nodes,
    rows_product,
)


def _shapes(model: onnx.ModelProto) -> dict[str, Dims]:
    """Every tensor's dims as shape inference sees them (int, symbol or None), for float32 tensors only."""
    types = tensor_types(infer_shapes(model).graph)
    return {name: dims for name, (elem, dims) in types.items() if elem == TensorProto.FLOAT and dims is not None}


def _axes(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> list[int] | None:
    """ReduceSum's axes (opset 13 on: a constant input), None when they are not known."""
    if len(node.input) < 2 or not node.input[1] or node.input[1] not in consts:
        return None
    return [int(v) for v in consts[node.input[1]].reshape(-1)]


def _leading(node: onnx.NodeProto, dims: Dims | None, axes: list[int] | None) -> int:
    """How many leading axes `node` sums when it sums exactly a proper prefix of x's axes whose
    remaining dims are static; 0 when the rewrite does not apply."""
    if dims is None or not axes:
        return 0
    rank = len(dims)
    k = len(axes)
    if sorted(a % rank for a in axes) != list(range(k)) or k >= rank:
        return 0
    if not all(isinstance(d, int) and d > 0 for d in dims[k:]):
        return 0
    return k


def leading_sums_as_products(model: onnx.ModelProto, shapes: dict[str, Dims] | None = None) -> onnx.ModelProto:
    """A copy of `model` whose float32 ReduceSums over leading axes are MatMuls with ones (the model itself
    when there are none). The ones are a constant when the summed dims are static, else built from x's
    shape (three small nodes). `shapes`: `_shapes(model)`, when the caller has it."""
    opset = default_opset(model)
    graph = model.graph
    if opset < 13 or not any(n.op_type == "ReduceSum" and not n.domain for n in graph.node):
        return model
    if shapes is None:
        shapes = _shapes(model)
    consts = constant_values(graph)
    positions = {}
    for i, n in enumerate(graph.node):
        if n.op_type == "ReduceSum" and not n.domain:
            k = _leading(n, shapes.get(n.input[0]), _axes(n, consts))
            if k:
                positions[i] = k
    if not positions:
        return model
    inits: list[onnx.TensorProto] = []
    out = rewrite_nodes(model, sorted(positions.items()),
                   lambda n, k, taken: _as_product(n, shapes[n.input[0]], k, opset, taken, inits))
    out.graph.initializer.extend(inits)
    return out


def _as_product(node: onnx.NodeProto, dims: Dims, k: int, opset: int, taken: set[str],
                inits: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    x, y = node.input[0], node.output[0]
    rest = [int(d) for d in dims[k:]]
    width = int(np.prod(rest))
    keep = int_attr(node, "keepdims", 1) == 1  # as onnx and onnxruntime read it: keepdims=2 drops the axes
    base = node.name or y

    def name(what: str) -> str:
        return fresh_name(f"{base}/{what}", taken)

    def const(what: str, value: np.ndarray) -> str:
        t = numpy_helper.from_array(value, name(what))
        inits.append(t)
        return t.name

    out: list[onnx.NodeProto] = []
    rows = x
    if len(dims) - k != 1 or k != 1:
        rows = name("rows")
        out.append(helper.make_node("Reshape", [x, const("rows_shape", np.array([-1, width], np.int64))], [rows],
                                    name=rows))
    lead = dims[:k]
    if all(isinstance(d, int) and d > 0 for d in lead):
        ones = const("ones", np.ones(int(np.prod(lead)), np.float32))
    else:
        shape, count, ones = name("rows_dims"), name("count"), name("ones")
        if opset >= 15:
            out.append(helper.make_node("Shape", [rows], [count], name=count, start=0, end=1))
        else:
            out += [helper.make_node("Shape", [rows], [shape], name=shape),
                    helper.make_node("Slice", [shape, const("zero", np.array([0], np.int64)),
                                               const("one_i", np.array([1], np.int64))], [count], name=count)]
        out.append(helper.make_node("Expand", [const("one", np.ones(1, np.float32)), count], [ones], name=ones))
    target = ([1] * k if keep else []) + rest
    if target == [width]:
        out.append(helper.make_node("MatMul", [ones, rows], [y], name=name("sum")))
        return out
    flat = name("sum")
    out += [helper.make_node("MatMul", [ones, rows], [flat], name=flat),
            helper.make_node("Reshape", [flat, const("shape", np.array(target, np.int64))], [y], name=name("shape"))]
    return out



ROWS_UNTRANSPOSED_MIN_COLUMNS = 768
ROWS_UNTRANSPOSED_MIN_ROWS = 96
"""`Gemm(a, b, transA=1)` with b at least this many columns wide and this many rows (or a run-time number: the
batch, which the runtime's backward graphs leave symbolic) transposes a first. MLAS transposes a's blocks as
it multiplies, and a's transpose on its own (a 3-D one, which onnxruntime does not fold back into the product)
then a plain product took 0.66-0.92 of the Gemm's time for the weight gradients of 96-256 rows against
768-3072 inputs (GPT-2's LM head, 128 x 50257 against 768: 82 -> 70 ms; 2 threads, this machine). It was on
par at 64 rows and 1024, slower at 32 rows (1.07-1.14x) and for 128 or 512 columns at 512 rows (a
transformer's d=128 layers: 1.1-1.3x), where the transpose weighs more against the product. A batch of 32
loses ~0.03 ms a layer that way, one of 128 gains 0.1-0.3 ms."""


def rows_untransposed(model: onnx.ModelProto, shapes: dict[str, Dims] | None = None) -> onnx.ModelProto:
    """A copy of `model` whose float32 `Gemm(a, b, transA=1)` (no bias, no scale, b not transposed) with b of at
    least `ROWS_UNTRANSPOSED_MIN_ROWS` (or run-time) rows and `ROWS_UNTRANSPOSED_MIN_COLUMNS` static columns is
    `MatMul(a^T, b)`, a^T made by a Transpose of a viewed as [K, M, 1] (a 2-D one onnxruntime would fuse back
    into the product). The model itself when none applies. `shapes`: `_shapes(model)`, when the caller has it."""
    graph = model.graph
    candidates = [k for k, n in enumerate(graph.node) if rows_product(n)]
    if not candidates:
        return model
    if shapes is None:
        shapes = _shapes(model)
    plan = []
    for k in candidates:
        n = graph.node[k]
        dims = shapes.get(n.input[1])
        if shapes.get(n.input[0]) is not None and dims is not None and len(dims) == 2 \
                and (not isinstance(dims[0], int) or dims[0] >= ROWS_UNTRANSPOSED_MIN_ROWS) \
                and isinstance(dims[1], int) and dims[1] >= ROWS_UNTRANSPOSED_MIN_COLUMNS:
            plan.append((k,))
    if not plan:
        return model
    taken = names_in_use(graph)
    shapes_used = (("column_shape", [0, 0, 1]), ("matrix_shape", [0, -1]))  # one pair for every rewrite
    inits = [numpy_helper.from_array(np.array(v, np.int64), fresh_name(f"rows_untransposed/{name}", taken))
             for name, v in shapes_used]

    def build(n: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
        a, b = n.input
        base = n.name or n.output[0]
        column, swapped, at = (fresh_name(f"{base}/{what}", taken) for what in ("column", "swapped", "a_t"))
        return [helper.make_node("Reshape", [a, inits[0].name], [column], name=column),
                helper.make_node("Transpose", [column], [swapped], name=swapped, perm=[1, 0, 2]),
                helper.make_node("Reshape", [swapped, inits[1].name], [at], name=at),
                helper.make_node("MatMul", [at, b], list(n.output), name=fresh_name(f"{base}/product", taken))]

    out = rewrite_nodes(model, plan, build)
    out.graph.initializer.extend(inits)
    return out


def _zero_fill(node: onnx.NodeProto) -> bool:
    """A ConstantOfShape filling with 0 (its default)."""
    if node.op_type != "ConstantOfShape" or node.domain:
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    return value is None or not numpy_helper.to_array(value).any()


def _same_shapes(shapes: list[Dims | None]) -> bool:
    """Whether tensors of these inferred shapes can only be the same shape: same rank, equal static dims, and no
    static 1 against another dim (a broadcast). Symbolic dims are trusted equal: the terms of a Sum the builder
    emits are one tensor's gradient contributions, each of that tensor's shape."""
    if any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:  # type: ignore[arg-type]
        return False
    for dims in zip(*shapes):  # type: ignore[misc]
        static = {d for d in dims if isinstance(d, int)}
        if len(static) > 1 or (static == {1} and len([d for d in dims if d == 1]) != len(dims)):
            return False
    return True


def _rewrite_sums(model: onnx.ModelProto, match: Callable[[onnx.NodeProto, Readers], tuple | None],
                  build: Callable[..., list[onnx.NodeProto]], inits: list[onnx.TensorProto] | None = None
                  ) -> onnx.ModelProto:
    """The skeleton of the Sum rewrites: each Sum (of two terms or more) for which `match(sum, terms)` gives
    details is replaced by `build(sum, *details, taken)`; nodes nothing reads any more (the replaced terms) are
    dropped and `inits` (filled by `build`) added. Returns `model` itself when nothing matches."""
    graph = model.graph
    sums = [(k, n) for k, n in enumerate(graph.node) if n.op_type == "Sum" and not n.domain and len(n.input) > 1]
    if not sums:
        return model
    terms = Readers.of(graph)
    plan = [(k, *details) for k, n in sums if (details := match(n, terms)) is not None]
    if not plan:
        return model
    out = rewrite_nodes(model, plan, build)
    out.graph.initializer.extend(inits or [])
    nodes = drop_dead(list(out.graph.node), [], terms.outputs)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def scatters_into_sums(model: onnx.ModelProto, shapes: dict[str, Dims] | None = None) -> onnx.ModelProto:
    """A copy of `model` where `Sum(a, ..., Scatter(zeros, i, u, reduction="add"))` is `Scatter(Sum(a, ...),
    i, u, reduction="add")` (the model itself when nothing matches), for ScatterElements (the builder's adjoint of
    a gather) and ScatterND. Only when the zeros and the scatter are read by that Sum alone and no term of the Sum
    can broadcast (`_same_shapes`; a scatter does not broadcast). `shapes`: `_shapes(model)`, when the caller has
    it."""
    known = shapes

    def match(n: onnx.NodeProto, terms: Readers) -> tuple[onnx.NodeProto, int] | None:
        nonlocal known
        for j, name in enumerate(n.input):
            s = terms.sole(name)
            if (s is None or s.op_type not in ("ScatterND", "ScatterElements") or s.domain
                    or next((a.s for a in s.attribute if a.name == "reduction"), b"none") != b"add"):
                continue
            zeros = terms.sole(s.input[0])
            if zeros is None or not _zero_fill(zeros):
                continue
            if known is None:
                known = _shapes(model)
            if _same_shapes([known.get(t) for t in n.input]):
                return s, j
        return None

    def build(n: onnx.NodeProto, scatter: onnx.NodeProto, j: int, taken: set[str]) -> list[onnx.NodeProto]:
        rest = [t for i, t in enumerate(n.input) if i != j]
        nodes, base = [], rest[0]
        if len(rest) > 1:
            base = fresh_name(f"{n.name or n.output[0]}/others", taken)
            nodes.append(helper.make_node("Sum", rest, [base], name=base))
        into = onnx.NodeProto()
        into.CopyFrom(scatter)  # its op and attributes (axis, reduction)
        into.input[0], into.output[0] = base, n.output[0]
        into.name = fresh_name(f"{n.name or n.output[0]}/scatter", taken)
        return [*nodes, into]

    return _rewrite_sums(model, match, build)


class _Placed(NamedTuple):
    """One Sum term that puts a slice at a constant position along an axis, zeros elsewhere (`_placement`)."""

    axis: int
    rank: int
    position: int
    size: int | tuple[str, ...]
    """The axis length: an int, or for a run-time length a key equal for equal lengths."""
    slice: str
    length: str | None
    """The run-time length tensor (None when static)."""


def _length_key(name: str, producer: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray]) -> tuple[str, ...]:
    """A key equal for run-time lengths computed alike: `Gather(s, k)` of one shape s (a tensor's `Shape`, or the
    one a forward computed and backward reads) and one constant k."""
    n = producer.get(name)
    if n is not None and n.op_type == "Gather" and not n.domain and n.input[1] in consts:
        index = str(consts[n.input[1]].reshape(-1).tolist())
        shape = producer.get(n.input[0])
        if shape is not None and shape.op_type == "Shape" and not shape.domain and not shape.attribute:
            return ("dim of", shape.input[0], index)
        return ("element of", n.input[0], index)
    return ("tensor", name)


def _placement(pad: onnx.NodeProto, producer: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray]
               ) -> _Placed | None:
    """How `pad` places a slice when it zero-pads `Unsqueeze(slice, [axis])` along that axis alone, with the
    pads the Gather rule writes (`gradbuilder.rules.indexing.placement_pads`): a constant, or
    `Concat(begins, length - (position + 1), zeros)`."""
    if not pads_with_zeros(pad, consts) or len(pad.input) < 2:
        return None
    if len(pad.input) > 3 and pad.input[3]:  # explicit axes (opset 18)
        return None
    unsq = producer.get(pad.input[0])
    if unsq is None or unsq.op_type != "Unsqueeze" or unsq.domain or len(unsq.input) < 2 or unsq.input[1] not in consts:
        return None
    axes = [int(v) for v in consts[unsq.input[1]].reshape(-1)]
    if len(axes) != 1 or axes[0] < 0:
        return None
    a = axes[0]
    if pad.input[1] in consts:  # static length
        pads = [int(v) for v in consts[pad.input[1]].reshape(-1)]
        r = len(pads) // 2
        if a >= r or any(v for k, v in enumerate(pads) if k not in (a, r + a)) or min(pads[a], pads[r + a]) < 0:
            return None
        return _Placed(a, r, pads[a], pads[a] + pads[r + a] + 1, unsq.output[0], None)
    cat = producer.get(pad.input[1])
    if cat is None or cat.op_type != "Concat" or cat.domain or len(cat.input) not in (2, 3):
        return None
    head, end, *tail = cat.input
    sub = producer.get(end)
    if head not in consts or any(t not in consts for t in tail) or sub is None or sub.op_type != "Sub" \
            or sub.input[1] not in consts:
        return None
    begins = [int(v) for v in consts[head].reshape(-1)]
    r = len(begins) - a
    zeros = [int(v) for t in tail for v in consts[t].reshape(-1)]
    if r <= a or len(zeros) != r - a - 1 or any(zeros) or any(v for k, v in enumerate(begins) if k != a):
        return None
    i = begins[a]
    if consts[sub.input[1]].reshape(-1).tolist() != [i + 1] or i < 0:
        return None
    return _Placed(a, r, i, _length_key(sub.input[0], producer, consts), unsq.output[0], sub.input[0])


def placements_into_concats(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` where the terms of a Sum that place slices into zeros at positions 0..k-1 of one axis
    (`_placement`: the q, k and v gradients of a packed projection) are one Concat of the slices, padded with
    zeros up to the axis length when that is only known at run time (the model itself when nothing matches):
    no zero fill and full-size buffer per slice, no Sum pass over them. Only pads read by that Sum alone;
    other terms of the Sum are added to the result."""
    consts = constant_values(model.graph)
    inits: list[onnx.TensorProto] = []

    def match(n: onnx.NodeProto, terms: Readers) -> tuple[list[_Placed], list[str]] | None:
        groups: dict[tuple[int, int, object], dict[int, tuple[str, _Placed]]] = {}
        for t in n.input:
            p = terms.sole(t)
            at = _placement(p, terms.producer, consts) if p is not None else None
            if at is not None:
                groups.setdefault((at.axis, at.rank, at.size), {})[at.position] = (t, at)
        for (_, _, size), group in groups.items():
            if sorted(group) != list(range(len(group))) or len(group) < 2 or \
                    (isinstance(size, int) and size != len(group)):
                continue
            joined = {t for t, _ in group.values()}
            return [group[i][1] for i in range(len(group))], [t for t in n.input if t not in joined]
        return None

    def build(n: onnx.NodeProto, placed: list[_Placed], others: list[str], taken: set[str]) -> list[onnx.NodeProto]:
        base = n.name or n.output[0]

        def name(what: str) -> str:
            return fresh_name(f"{base}/{what}", taken)

        def ints(what: str, values: list[int]) -> str:
            inits.append(numpy_helper.from_array(np.array(values, np.int64), name(what)))
            return inits[-1].name

        a, length = placed[0].axis, placed[0].length
        result = n.output[0] if not others and length is None else name("concat")
        nodes = [helper.make_node("Concat", [p.slice for p in placed], [result], name=result, axis=a)]
        if length is not None:  # zeros after the k slices, up to the run-time length
            padded = n.output[0] if not others else name("padded")
            rest, pads = name("rest"), name("pads")
            rank = placed[0].rank
            nodes += [helper.make_node("Sub", [length, ints("count", [len(placed)])], [rest], name=rest),
                      helper.make_node("Concat", [ints("before", [0] * (rank + a)), rest,
                                                  *([ints("after", [0] * (rank - a - 1))] if a + 1 < rank else [])],
                                       [pads], name=pads, axis=0),
                      helper.make_node("Pad", [result, pads], [padded], name=padded)]
            result = padded
        if others:
            nodes.append(helper.make_node("Sum", [result, *others], [n.output[0]], name=name("sum")))
        return nodes

    return _rewrite_sums(model, match, build, inits)


def lower_sums(model: onnx.ModelProto) -> onnx.ModelProto:
    """`placements_into_concats`, then `leading_sums_as_products`, `scatters_into_sums` and `rows_untransposed` on
    one shape inference of `model` (each rewrite keeps every tensor it does not add, with its shape), run only
    when any may apply."""
    ops = {n.op_type for n in model.graph.node if not n.domain}
    if not ops & {"ReduceSum", "Sum", "Gemm"}:
        return model
    model = placements_into_concats(model)
    shapes = _shapes(model)
    return rows_untransposed(scatters_into_sums(leading_sums_as_products(model, shapes), shapes), shapes)
