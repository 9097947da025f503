"""Small int64, bool and float tensors computed from shapes and constants, with the elements the known dims leave
unknown marked, and the ONNX ops torch's exporters write over them evaluated as onnxruntime computes them.

Shape arithmetic decides what the gradient build and onnxruntime's constant folding cannot see: a Reshape's target,
the pads F.pad writes through a 2-D Reshape, a reversing Slice and a Transpose, a squeeze's condition behind an
Expand's sizes, a floor division's seven ops, a Resize's scales. Where the batch is symbolic, every element
computed from it is unknown, and only those: the rest is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from .passes import int_attr, ints_attr

MAX_ELEMENTS = 16
"""Most elements evaluated in one tensor (shape vectors are as long as a tensor's rank)."""


@dataclass(frozen=True)
class Value:
    """An int64, bool, float32 or float64 tensor; `known` (of its shape) marks the elements decided, `data` holds
    them (anything elsewhere)."""

    data: np.ndarray
    known: np.ndarray

    @staticmethod
    def of(data: object) -> Value:
        array = np.asarray(data)
        return Value(array, np.ones(array.shape, dtype=bool))

    @staticmethod
    def partly(items: Sequence[int | None]) -> Value:
        """A vector of ints, None where unknown."""
        return Value(np.array([0 if v is None else v for v in items], dtype=np.int64),
                     np.array([v is not None for v in items], dtype=bool))

    @property
    def scalar(self) -> bool:
        return self.data.ndim == 0

    @property
    def boolean(self) -> bool:
        return self.data.dtype == np.bool_

    @property
    def integral(self) -> bool:
        return self.data.dtype == np.int64

    @property
    def complete(self) -> bool:
        return bool(self.known.all())

    def items(self) -> list[int | None]:
        """The elements in order as Python numbers, None where unknown."""
        return [v if k else None for v, k in zip(self.data.ravel().tolist(), self.known.ravel().tolist())]

    def moved(self, f: Callable[[np.ndarray], np.ndarray]) -> Value:
        """The same rearrangement of data and of what is known."""
        return Value(np.asarray(f(self.data)), np.asarray(f(self.known)))


Args = list[Value | None]
Dims = Mapping[str, list[int | None]]


def evaluate(node: onnx.NodeProto, values: Mapping[str, Value], dims: Dims) -> Value | None:
    """The node's single output as a Value, or None when it is not one (another type, too large, an op not
    evaluated, inputs not known enough, or input onnxruntime would refuse)."""
    op = OPS.get(node.op_type)
    if op is None or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    args = [values.get(i) if i else None for i in node.input]
    if not args or (args[0] is None and op not in (_shape, _size)):  # (most nodes: no numpy set-up for them)
        return None
    try:
        with np.errstate(all="ignore"):  # int64 wraps around as onnxruntime's does
            out = op(node, args, dims)
    except (ValueError, IndexError):  # sizes that do not fit: onnxruntime refuses the node at run time
        return None
    return out if out is not None and out.data.size <= MAX_ELEMENTS else None


def _vector(v: Value | None) -> list[int] | None:
    """A complete int64 vector's (or scalar's) elements."""
    return None if v is None or not v.complete or not v.integral or v.data.ndim > 1 else v.data.ravel().tolist()


def _fits(shape: Sequence[int]) -> bool:
    return all(d >= 0 for d in shape) and int(np.prod(shape)) <= MAX_ELEMENTS


def _dims_of(node: onnx.NodeProto, args: Args, dims: Dims) -> list[int | None] | None:
    """The dims of the node's first input: a Value's own (a constant's, which inference does not list), else what
    inference found."""
    return list(args[0].data.shape) if args[0] is not None else dims.get(node.input[0])


def _shape(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    shape = _dims_of(node, args, dims)
    if shape is None:
        return None
    n = len(shape)
    return Value.partly(shape[onnx_slice(n, int_attr(node, "start", 0), int_attr(node, "end", n), 1)])


def _size(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    shape = _dims_of(node, args, dims)
    if shape is None:
        return None
    return Value(np.array(0 if None in shape else int(np.prod(shape)), dtype=np.int64), np.array(None not in shape))


def _gather(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    data, indices = args[0], args[1]
    if data is None or indices is None or not indices.complete or not indices.integral or data.scalar:
        return None
    axis = int_attr(node, "axis", 0) % data.data.ndim
    n = data.data.shape[axis]
    if ((indices.data < -n) | (indices.data >= n)).any():
        return None
    picked = np.where(indices.data < 0, indices.data + n, indices.data)
    return data.moved(lambda a: np.take(a, picked, axis=axis))


def _slice(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    data = args[0]
    starts, ends = _vector(args[1]), _vector(args[2])
    if data is None or data.scalar or starts is None or ends is None:
        return None
    rank = data.data.ndim
    axes = _vector(args[3]) if len(args) > 3 and node.input[3] else list(range(len(starts)))
    steps = _vector(args[4]) if len(args) > 4 and node.input[4] else [1] * len(starts)
    if axes is None or steps is None or 0 in steps:
        return None
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis % rank] = onnx_slice(data.data.shape[axis % rank], start, end, step)
    return data.moved(lambda a: a[tuple(index)])


def onnx_slice(n: int, start: int, end: int, step: int) -> slice:
    """The Python slice of an axis of n elements that ONNX's Slice takes: negative bounds count from the end, then
    are clamped (to [0, n] stepping forward, to [-1, n - 1] stepping back, -1 before the first element)."""
    start, end = (v + n if v < 0 else v for v in (start, end))
    if step > 0:
        return slice(max(0, min(n, start)), max(0, min(n, end)), step)
    end = max(-1, min(n - 1, end))
    return slice(max(0, min(n - 1, start)), None if end < 0 else end, step)


def _axes(node: onnx.NodeProto, args: Args) -> list[int] | None:
    """Unsqueeze's and Squeeze's axes: an input from opset 13, an attribute before; [] when absent."""
    if len(node.input) > 1 and node.input[1]:
        return _vector(args[1])
    return ints_attr(node, "axes") or []


def _unsqueeze(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    axes = _axes(node, args)
    if args[0] is None or not axes:
        return None
    rank = args[0].data.ndim + len(axes)
    return args[0].moved(lambda a: np.expand_dims(a, tuple(sorted(x % rank for x in axes))))


def _squeeze(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    axes = _axes(node, args)
    if args[0] is None or axes is None:
        return None
    chosen = tuple(x % args[0].data.ndim for x in axes) if axes else None
    return args[0].moved(lambda a: np.squeeze(a, axis=chosen))


def _concat(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    if any(a is None or a.scalar for a in args) or not _alike(args):
        return None
    axis = int_attr(node, "axis", 0)
    return Value(np.concatenate([a.data for a in args], axis), np.concatenate([a.known for a in args], axis))


def _reshape(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    target = _vector(args[1]) if len(args) > 1 else None
    if args[0] is None or target is None:
        return None
    if not int_attr(node, "allowzero", 0):
        target = [args[0].data.shape[i] if v == 0 else v for i, v in enumerate(target)]
    return args[0].moved(lambda a: a.reshape(target))


def _transpose(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    return None if args[0] is None else args[0].moved(lambda a: np.transpose(a, ints_attr(node, "perm")))


def _expand(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    target = _vector(args[1])
    if args[0] is None or target is None:
        return None
    shape = np.broadcast_shapes(args[0].data.shape, tuple(target))
    return args[0].moved(lambda a: np.broadcast_to(a, shape).copy()) if _fits(shape) else None


def _filled(node: onnx.NodeProto, shape: Sequence[int]) -> Value | None:
    """ConstantOfShape's fill (a float32 0 when not given)."""
    fill = next((a.t for a in node.attribute if a.name == "value"), None)
    if (fill is not None and fill.data_type not in TYPES) or not _fits(shape):
        return None
    value = np.float32(0) if fill is None else onnx.numpy_helper.to_array(fill).ravel()[0]
    return Value.of(np.full(tuple(shape), value))


def _constant_of_shape(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    shape = _vector(args[0])
    return None if shape is None or args[0].data.ndim != 1 else _filled(node, shape)


def _range(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    ends = [_vector(a) for a in args]
    if len(ends) != 3 or any(e is None or len(e) != 1 for e in ends):
        return None
    (start,), (limit,), (delta,) = ends
    length = range_length(start, limit, delta)
    if length is None or not _fits([length]):
        return None
    return Value.of(np.arange(start, limit, delta, dtype=np.int64))


def range_length(start: Any, limit: Any, delta: Any) -> int | None:
    """ONNX Range's element count, max(ceil((limit - start) / delta), 0), ints or floats; None for a zero or
    non-finite step."""
    with np.errstate(all="ignore"):
        length = np.ceil((limit - start) / delta) if delta else np.nan
    return int(max(length, 0)) if np.isfinite(length) else None


TYPES = {TensorProto.INT64: np.int64, TensorProto.BOOL: np.bool_, TensorProto.FLOAT: np.float32,
         TensorProto.DOUBLE: np.float64}
"""The element types evaluated, by ONNX's number."""


def _cast(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    """To bool as != 0, floats to ints toward zero (onnxruntime's static_cast)."""
    to = TYPES.get(int_attr(node, "to", 0))
    if args[0] is None or to is None:
        return None
    return Value(args[0].data != 0 if to is np.bool_ else args[0].data.astype(to), args[0].known)


def _identity(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    return args[0]


def _broadcast(args: Sequence[Value]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    shape = np.broadcast_shapes(*(a.data.shape for a in args))
    return [np.broadcast_to(a.data, shape) for a in args], [np.broadcast_to(a.known, shape) for a in args]


def _alike(args: Args) -> bool:
    """All given, of one element type (as ONNX's elementwise ops take them)."""
    return all(a is not None for a in args) and len({a.data.dtype for a in args}) == 1


def _numbers(args: Args) -> bool:
    return bool(args) and _alike(args) and not args[0].boolean


def _elementwise(f: Callable[[np.ndarray, np.ndarray], np.ndarray], divides: bool = False):
    """A binary op over numbers (variadic for Min and Max); `divides`: over ints, unknown where the divisor is 0
    (onnxruntime refuses it)."""
    def op(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
        if not _numbers(args) or (divides and not args[0].integral):
            return None
        (first, *rest), (known, *rest_known) = _broadcast(args)
        out, decided = first, known
        for b, kb in zip(rest, rest_known):
            if divides:
                decided, b = decided & kb & (b != 0), np.where(b == 0, 1, b)
            else:
                decided = decided & kb
            out = f(out, b)
        return Value(np.asarray(out, dtype=first.dtype), np.asarray(decided))
    return op


def _div(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    return (_INT_DIV if _numbers(args) and args[0].integral else _FLOAT_DIV)(node, args, dims)


def _divided(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer Div, which truncates toward zero (numpy's floors)."""
    q = a // b
    return q + ((a % b != 0) & ((a < 0) != (b < 0)))


def _mod(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    return (_FMOD if int_attr(node, "fmod", 0) else _PYTHON_MOD)(node, args, dims)


_FMOD = _elementwise(np.fmod, divides=True)
_PYTHON_MOD = _elementwise(np.mod, divides=True)  # the divisor's sign, as ONNX's integer Mod
_INT_DIV = _elementwise(_divided, divides=True)
_FLOAT_DIV = _elementwise(np.divide)


def _compared(f: Callable[[np.ndarray, np.ndarray], np.ndarray]):
    def op(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
        if len(args) != 2 or not _alike(args):
            return None
        (a, b), (ka, kb) = _broadcast(args)
        return Value(np.asarray(f(a, b)), np.asarray(ka & kb))
    return op


def _logical(op_type: str):
    """And, Or, Xor over bools; And with a known False and Or with a known True decided whatever the other."""
    def op(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
        if len(args) != 2 or any(a is None or not a.boolean for a in args):
            return None
        (a, b), (ka, kb) = _broadcast(args)
        known = ka & kb
        if op_type == "And":
            return Value(a & b, known | (ka & ~a) | (kb & ~b))
        if op_type == "Or":
            return Value(a | b, known | (ka & a) | (kb & b))
        return Value(a ^ b, known)
    return op


def _not(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    return None if args[0] is None or not args[0].boolean else Value(~args[0].data, args[0].known)


def _unary(f: Callable[[np.ndarray], np.ndarray], floats: bool = False):
    """A unary op over numbers; `floats`: over floats only (Floor, Ceil)."""
    def op(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
        if not _numbers(args[:1]) or (floats and args[0].integral):
            return None
        return Value(np.asarray(f(args[0].data), dtype=args[0].data.dtype), args[0].known)
    return op


def _where(node: onnx.NodeProto, args: Args, dims: Dims) -> Value | None:
    """Decided where the condition is and the branch it takes is: the legacy exporter writes an Expand's sizes as
    Where(sizes == -1, 1, sizes), with the batch's size unknown."""
    if len(args) != 3 or args[0] is None or not args[0].boolean or not _alike(args[1:]):
        return None
    (c, x, y), (kc, kx, ky) = _broadcast(args)
    return Value(np.where(c, x, y), kc & np.where(c, kx, ky))


OPS: dict[str, Callable[[onnx.NodeProto, Args, Dims], Value | None]] = {
    "Shape": _shape, "Size": _size, "Gather": _gather, "Slice": _slice, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Concat": _concat, "Reshape": _reshape, "Transpose": _transpose, "Expand": _expand,
    "ConstantOfShape": _constant_of_shape, "Range": _range, "Cast": _cast, "Identity": _identity,
    "Add": _elementwise(np.add), "Sub": _elementwise(np.subtract), "Mul": _elementwise(np.multiply),
    "Div": _div, "Mod": _mod, "Floor": _unary(np.floor, floats=True), "Ceil": _unary(np.ceil, floats=True),
    "Min": _elementwise(np.minimum), "Max": _elementwise(np.maximum), "Neg": _unary(np.negative),
    "Abs": _unary(np.abs),
    "Equal": _compared(np.equal), "Greater": _compared(np.greater), "Less": _compared(np.less),
    "GreaterOrEqual": _compared(np.greater_equal), "LessOrEqual": _compared(np.less_equal),
    "And": _logical("And"), "Or": _logical("Or"), "Xor": _logical("Xor"), "Not": _not, "Where": _where,
}
"""The ops evaluated, by type (default domain, any opset torch's exporters write)."""
