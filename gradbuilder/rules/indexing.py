"""Gather/Scatter/TopK: gradients of reads go back by scatter-adding, gradients of writes by reading.

Several reads may hit one element, so the adjoints of the gathers must add, not overwrite: ScatterND and
ScatterElements only learned `reduction="add"` at opset 16. Before that, the sum is a MatMul with a one-hot
matrix built from the indices (Equal against a Range): more memory, the same numbers. Rows are added with
ScatterElements, not ScatterND: onnxruntime's CPU ScatterND splits the updates among its threads, so two threads
add into one row at once and lose updates, silently and at random (an embedding's gradient where a token repeats:
BERT's token types, padding; a 1024 x 256 update of one row was off by up to 51), where its ScatterElements adds
in index order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from onnx import TensorProto, helper

from .context import Grad
from .registry import rule

SCATTER_ADD_OPSET = 16
LOW_PRECISION = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


def zeros(g: Grad, shape: str, like: str, elem_type: int | None = None) -> str:
    """Zeros of the run-time `shape` with the element type of the forward tensor `like` (or `elem_type`)."""
    elem_type = elem_type or g.dtype(like)
    if elem_type:
        return g.ConstantOfShape(shape, value=helper.make_tensor("value", elem_type, [1], [0]))
    if g.opset < 15:
        g.fail(f"the element type of '{like}' is unknown")
    return g.CastLike(g.ConstantOfShape(shape), like)


def size_along(g: Grad, x: str, axis: int) -> int | str:
    """x's size along `axis` (may be negative): an int when static, else a 1-element int64 tensor."""
    shape = g.info(x).shape
    if shape is not None and -len(shape) <= axis < len(shape) and isinstance(shape[axis], int):
        return shape[axis]
    return g.Gather(g.shape_of(x), g.ints([axis]))


def as_tensor(g: Grad, v: int | str) -> str:
    """A size from `size_along` as a 1-element int64 tensor."""
    return g.ints([v]) if isinstance(v, int) else v


def dims_of(g: Grad, x: str, order: Sequence[int]) -> str:
    """x's sizes in `order` as a 1-D int64 tensor (a constant when static)."""
    static = g.info(x).static_shape
    if static is not None:
        return g.ints([static[a] for a in order])
    return g.Gather(g.shape_of(x), g.ints(list(order)))


def arange(g: Grad, d: int | str) -> str:
    """0..d-1 (int64) for a size from `size_along`."""
    n = g.ints(d) if isinstance(d, int) else g.squeeze(d, [0])
    return g.Range(g.ints(0), n, g.ints(1))


def int64(g: Grad, t: str) -> str:
    """Indices as int64, the one index type ScatterND and the Range comparisons accept."""
    return t if g.dtype(t) == TensorProto.INT64 else g.Cast(t, to=TensorProto.INT64)


def nonneg(g: Grad, index: str, size: int | str) -> str:
    """Indices with negative values counted from the end, as the gather did."""
    size_t = g.ints(size) if isinstance(size, int) else size
    return g.Where(g.Less(index, g.ints(0)), g.Add(index, size_t), index)


def _widen(g: Grad, t: str, like: str) -> tuple[str, int | None]:
    """16-bit floats are scatter-added in float32: onnxruntime's CPU ScatterND/ScatterElements cannot add
    them, and many small contributions would round away. Returns t (cast up or not) and the type to cast
    the sum back to (None: no cast)."""
    elem_type = g.dtype(like)
    if elem_type in LOW_PRECISION:
        return g.Cast(t, to=TensorProto.FLOAT), elem_type
    return t, None


def _narrow(g: Grad, t: str, back: int | None) -> str:
    return g.Cast(t, to=back) if back else t


def rows_adjoint(g: Grad, t: str, src: str, d: int | str, like: str, *, add: bool = True) -> str:
    """Adjoint of reading rows: `t` [L, Q] holds rows `src` [L] (int64 in [0, d)) of a [d, Q] matrix;
    return that [d, Q] matrix's gradient, rows read several times summed (in their order, by ScatterElements:
    see the module's docstring). `add=False` promises the rows are distinct, so a plain ScatterND, which moves
    whole rows, does at every opset."""
    if add and g.opset < SCATTER_ADD_OPSET:
        onehot = g.cast_like(g.Equal(g.unsqueeze(arange(g, d), [1]), g.unsqueeze(src, [0])), like)  # [d, L]
        return g.MatMul(onehot, t)
    shape = g.Concat(as_tensor(g, d), g.Slice(g.Shape(t), g.ints([1]), g.ints([2])), axis=0)
    if not add:
        return g.ScatterND(zeros(g, shape, like), g.unsqueeze(src, [1]), t)
    if 0 in (g.info(like).shape or ()):  # nothing to add, and onnxruntime's ExpandElimination drops an Expand to [L, 0]
        return zeros(g, shape, like)
    t, back = _widen(g, t, like)
    rows = g.Expand(g.unsqueeze(src, [1]), g.Shape(t))
    summed = g.ScatterElements(zeros(g, shape, like, TensorProto.FLOAT if back else None), rows, t, axis=0,
                               reduction="add")
    return _narrow(g, summed, back)


def axis_adjoint(g: Grad, t: str, axis: int, rank: int, src: str, d: int | str, like: str, *,
                 add: bool = True) -> str:
    """Adjoint of reading positions `src` along `axis` (of size d) of a rank-`rank` tensor: `t` is the
    gradient of what was read; `rows_adjoint` with that axis moved to the front."""
    front = [axis, *[j for j in range(rank) if j != axis]]
    moved = g.Transpose(t, perm=front) if axis else t
    if rank == 2:  # already rows: no Reshape, which onnxruntime would copy into an embedding table's gradient
        summed = rows_adjoint(g, moved, src, d, like, add=add)
    else:
        summed = rows_adjoint(g, g.Flatten(moved, axis=1), src, d, like, add=add)
        rest = g.Slice(g.Shape(moved), g.ints([1]), g.ints([rank]))
        summed = g.reshape_exact(summed, g.Concat(as_tensor(g, d), rest, axis=0))
    return g.Transpose(summed, perm=[int(p) for p in np.argsort(front)]) if axis else summed


def _constant_position(g: Grad, d: int | str) -> int | None:
    """The position Gather reads when its index is one constant (a scalar), within a static size `d` or, for a
    size known only at run time, when it is not negative."""
    index = g.const_input(1)
    if index is None or index.ndim != 0:
        return None
    i = int(index)
    if isinstance(d, int):
        return i % d if -d <= i < d else None
    return i if i >= 0 else None


def placement_pads(g: Grad, rank: int, axis: int, i: int, d: int | str) -> str:
    """Pad's pads putting one slice (size 1 along `axis`) at position i of an axis of size d: a constant, or
    `Concat(begins, d - (i + 1), zeros)` when d is known at run time only (`runtime.reductions` reads this
    layout back to join such placements into a Concat)."""
    if isinstance(d, int):
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = i, d - 1 - i
        return g.ints(pads)
    begins = [0] * rank
    begins[axis] = i
    parts = [g.ints(begins + [0] * axis), g.Sub(d, g.ints([i + 1]))]
    if axis + 1 < rank:
        parts.append(g.ints([0] * (rank - axis - 1)))
    return g.Concat(*parts, axis=0)


@rule("Gather", nondiff=(1,))
def gather(g: Grad):
    """The gradient is data[:a] + indices + data[a+1:]: flatten the index dims into one axis and
    scatter-add along it. One constant position (a scalar index: q, k and v of a packed projection, a CLS
    token) is padded back into place instead: no zero table, no scatter; and the placements of a Sum
    covering the whole axis become one Concat downstream (`runtime.reductions`)."""
    data, dy = g.I(0), g.GO(0)
    r = g.require_rank(data)
    a = g.axis(g.attr("axis", 0), r)
    if 0 in (g.info(data).static_shape or ()):  # empty: so is its gradient (a Reshape's target of 0 copies a size)
        return (g.zeros_like(data),)
    d = size_along(g, data, a)
    i = _constant_position(g, d)
    if i is not None and g.dtype(data) != TensorProto.BFLOAT16:  # onnxruntime's CPU Pad has no bfloat16
        return (g.Pad(g.unsqueeze(dy, [a]), placement_pads(g, r, a, i, d)),)
    src = g.Reshape(nonneg(g, int64(g, g.I(1)), d), g.ints([-1]))
    index_shape = g.info(g.I(1)).static_shape  # the count read, rather than -1: a 0 beside -1 is refused
    count = [int(np.prod(index_shape, dtype=np.int64))] if index_shape is not None else [-1]
    parts = [dims_of(g, data, range(a))] if a else []
    parts += [g.ints(count)] + ([dims_of(g, data, range(a + 1, r))] if a + 1 < r else [])
    one_axis = g.reshape_exact(dy, g.Concat(*parts, axis=0) if len(parts) > 1 else parts[0])
    return (axis_adjoint(g, one_axis, a, r, src, d, like=data),)


@rule("GatherND", nondiff=(1,))
def gather_nd(g: Grad):
    """Each index tuple (plus its batch position) is one row of data viewed as [B*D, R]: turn the tuples
    into flat row numbers and scatter-add the gradient's rows there."""
    data, index, dy = g.I(0), g.I(1), g.GO(0)
    q = g.require_rank(index)
    b = int(g.attr("batch_dims", 0))
    k = (g.info(index).shape or (None,))[-1]
    if not isinstance(k, int):
        g.fail("the last dimension of the indices must be static")
    sizes = g.info(data).shape
    static = sizes is not None and all(isinstance(s, int) for s in sizes[: b + k])
    block = dims_of(g, data, range(b, b + k))
    index = nonneg(g, index, block)
    if static:
        rows_per_batch = int(np.prod(sizes[b : b + k], dtype=np.int64))
        strides = g.ints([int(np.prod(sizes[b + j + 1 : b + k], dtype=np.int64)) for j in range(k)])
    else:
        rows_per_batch = g.ReduceProd(block, keepdims=1)
        inner = [g.ReduceProd(dims_of(g, data, range(b + j + 1, b + k)), keepdims=1) for j in range(k - 1)]
        strides = g.Concat(*inner, g.ints([1]), axis=0)
    flat = g.ReduceSum(g.Mul(index, strides), g.ints([-1]), keepdims=0)
    total: int | str = rows_per_batch
    if b:
        batch = dims_of(g, data, range(b))
        n_batch = g.ReduceProd(batch, keepdims=1)
        grid = g.Reshape(arange(g, n_batch), g.Concat(batch, g.ints([1] * (q - 1 - b)), axis=0))
        flat = g.Add(flat, g.Mul(grid, as_tensor(g, rows_per_batch)))
        total = g.Mul(n_batch, as_tensor(g, rows_per_batch))
    summed = rows_adjoint(g, g.Flatten(dy, axis=q - 1), g.Reshape(flat, g.ints([-1])), total, like=data)
    return (g.reshape_like(summed, data),)


def _scatter_add_elements_onehot(g: Grad, data: str, index: str, dy: str, axis: int) -> str:
    """GatherElements' adjoint before opset 16: compare each index with 0..d-1 along a new last axis,
    weight by the gradient, sum over the gathered axis, move the new axis into its place, and pad the
    other axes when the indices were smaller than the data."""
    r = g.require_rank(data)
    ds, ids = g.info(data).shape, g.info(index).shape
    d = size_along(g, data, axis)
    position = nonneg(g, int64(g, index), d)
    onehot = g.cast_like(g.Equal(g.unsqueeze(position, [r]), arange(g, d)), data)
    summed = g.reduce_sum(g.Mul(onehot, g.unsqueeze(dy, [r])), [axis], keepdims=True)
    perm = list(range(r + 1))
    perm[axis], perm[r] = r, axis
    out = g.squeeze(g.Transpose(summed, perm=perm), [r])
    if ds is not None and ds == ids and all(isinstance(s, int) for s in ds):
        return out
    short = g.Sub(g.shape_of(data), g.Shape(out))
    return g.Pad(out, g.Concat(g.ints([0] * r), short, axis=0))


@rule("GatherElements", nondiff=(1,))
def gather_elements(g: Grad):
    data, index, dy = g.I(0), g.I(1), g.GO(0)
    axis = g.axis_of(g.attr("axis", 0), data)
    if g.opset >= SCATTER_ADD_OPSET:
        dy, back = _widen(g, dy, data)
        start = zeros(g, g.shape_of(data), data, TensorProto.FLOAT if back else None)
        return (_narrow(g, g.ScatterElements(start, index, dy, axis=axis, reduction="add"), back),)
    return (_scatter_add_elements_onehot(g, data, index, dy, g.axis(axis, g.require_rank(data))),)


def _scatter_reduction(g: Grad) -> str:
    reduction = g.attr("reduction", "none")
    if reduction not in ("none", "add", "max", "min"):
        g.fail(f"reduction='{reduction}' has no gradient rule (only 'none', 'add', 'max' and 'min')")
    return reduction


def _scatter_extremum(g: Grad, gather: Callable[[str, str], str],
                      scatter_add: Callable[[str, str, str], str]) -> tuple[str | None, None, str | None]:
    """reduction='max' or 'min' (opset 18): dY goes to whichever of data and the updates scattered to an element
    equal the result there, shared evenly among ties, as torch's scatter_reduce amax/amin (include_self) does."""
    data, index, updates, y, dy = g.I(0), g.I(1), g.I(2), g.O(0), g.GO(0)
    self_is = g.Cast(g.Equal(data, y), to=TensorProto.FLOAT)
    src_is = g.Cast(g.Equal(updates, gather(y, index)), to=TensorProto.FLOAT)
    share = g.Div(dy, g.cast_like(scatter_add(self_is, index, src_is), data))  # counts in float32: exact
    d_data = g.Mul(share, g.cast_like(self_is, data)) if g.needs(0) else None
    d_updates = g.Mul(gather(share, index), g.cast_like(src_is, data)) if g.needs(2) else None
    return (d_data, None, d_updates)


@rule("ScatterND", nondiff=(1,))
def scatter_nd(g: Grad):
    """Overwritten elements of data get no gradient (with reduction='add' they all do); updates get the
    gradient read back where they were written."""
    dy, index = g.GO(0), g.I(1)
    reduction = _scatter_reduction(g)
    if reduction in ("max", "min"):
        return _scatter_extremum(g, g.GatherND, lambda t, i, u: g.ScatterND(t, i, u, reduction="add"))
    d_data = None
    if g.needs(0):
        d_data = dy if reduction == "add" else g.ScatterND(dy, index, g.zeros_like(g.I(2)))
    return (d_data, None, g.GatherND(dy, index) if g.needs(2) else None)


@rule("ScatterElements", nondiff=(1,))
def scatter_elements(g: Grad):
    dy, index = g.GO(0), g.I(1)
    axis = g.axis_of(g.attr("axis", 0), g.I(0))
    reduction = _scatter_reduction(g)
    if reduction in ("max", "min"):
        return _scatter_extremum(g, lambda t, i: g.GatherElements(t, i, axis=axis),
                                 lambda t, i, u: g.ScatterElements(t, i, u, axis=axis, reduction="add"))
    d_data = None
    if g.needs(0):
        d_data = dy if reduction == "add" else g.ScatterElements(dy, index, g.zeros_like(g.I(2)), axis=axis)
    return (d_data, None, g.GatherElements(dy, index, axis=axis) if g.needs(2) else None)


@rule("TopK", nondiff=(1,), nondiff_outputs=(1,))
def topk(g: Grad):
    """The values' gradient goes back to the positions the Indices output names (all distinct)."""
    x = g.I(0)
    return (g.ScatterElements(g.zeros_like(x), g.O(1), g.GO(0), axis=g.axis_of(g.attr("axis", -1), x)),)
