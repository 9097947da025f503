"""What a rule sees: the forward node, its output gradients, and helpers that emit backward nodes.

`Emitter` holds the state of one build (names, emitted nodes, constants); `Grad` is the per-node view
handed to a rule as `g`. Rules only call `g`; they never touch protobufs of the graph directly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import InvalidModelError, RuleError
from ..graph import UNKNOWN, ForwardGraph, NameAllocator, TensorInfo, describe


def _attribute(name: str, value: Any) -> onnx.AttributeProto:
    """make_attribute with a fast path for the scalar ints and floats most backward nodes carry."""
    if type(value) is int:
        return onnx.AttributeProto(name=name, type=onnx.AttributeProto.INT, i=value)
    if type(value) is float:
        return onnx.AttributeProto(name=name, type=onnx.AttributeProto.FLOAT, f=value)
    if type(value) in (list, tuple) and value and all(type(v) is int for v in value):
        return onnx.AttributeProto(name=name, type=onnx.AttributeProto.INTS, ints=value)
    return helper.make_attribute(name, value)


class Node:
    """A backward (or forward-side helper) node under construction: plain Python until the model is assembled,
    so that making, pruning and renaming tens of thousands of them does not go through protobuf each time."""

    __slots__ = ("attribute", "domain", "input", "name", "op_type", "output")

    def __init__(self, op_type: str, inputs: list[str], outputs: list[str], name: str, domain: str,
                 attribute: Sequence[onnx.AttributeProto]):
        self.op_type = op_type
        self.input = inputs
        self.output = outputs
        self.name = name
        self.domain = domain
        self.attribute = attribute


class Emitter:
    """Build-wide sink for backward nodes, forward-side helper nodes and constants."""

    def __init__(self, fg: ForwardGraph, names: NameAllocator):
        self.fg = fg
        self.opset = fg.opset
        self.names = names
        self.backward: list[Node] = []
        self.forward_extra: list[Node] = []
        self.initializers: list[TensorProto] = []
        self._consts: dict[tuple, str] = {}
        self._shapes: dict[str, str] = {}
        self._attrs: dict[tuple, tuple[onnx.AttributeProto, ...]] = {}
        self._ints: dict[Any, str] = {}
        self.produced: set[str] = set()
        self.declared: dict[str, TensorInfo] = {}  # backward tensors whose type a rule states (Grad.declare)
        self._taken = names._taken  # the allocator's set, for emit's inline fast path

    def node(self, op_type: str, inputs: Sequence[str | None], n_out: int, hint: str, *, domain: str = "",
             forward: bool = False, outputs: Sequence[str] | None = None, **attrs: Any) -> list[str]:
        return self.emit(op_type, inputs, n_out, hint, domain, forward, outputs, attrs)

    def emit(self, op_type: str, inputs: Sequence[str | None], n_out: int, hint: str, domain: str,
             forward: bool, outputs: Sequence[str] | None, attrs: dict[str, Any]) -> list[str]:
        """`node` with the keywords passed positionally and the attributes as a dict (one call, no repacking)."""
        if outputs is not None:
            outs = list(outputs)
        elif n_out == 1:
            base = f"{hint}/{op_type}"
            taken = self._taken
            if base in taken:
                base = self.names.fresh(base)
            else:  # NameAllocator.fresh's first case, inline
                taken.add(base)
            outs = [base]
        else:
            fresh, base = self.names.fresh, f"{hint}/{op_type}"
            outs = [fresh(base) for _ in range(n_out)]
        try:
            "".join(inputs)  # every input a str (join checks in C)
            ins = list(inputs)
        except TypeError:
            ins = ["" if i is None else i for i in inputs]
            for i in ins:
                if type(i) is not str and not isinstance(i, str):  # what NodeProto(input=...) would refuse
                    raise TypeError(f"{op_type} node input {i!r} is not a tensor name") from None
        node = Node(op_type, ins, outs, f"{outs[0]}_node", domain, self._attributes(attrs) if attrs else ())
        (self.forward_extra if forward else self.backward).append(node)
        if len(outs) == 1:
            self.produced.add(outs[0])
        else:
            self.produced.update(outs)
        return outs

    def _attributes(self, attrs: dict[str, Any]) -> Sequence[onnx.AttributeProto]:
        """The node's attributes, sorted by name; made once per build for each set of int and int-list values
        (nodes share them: they are only copied from, at assembly)."""
        if len(attrs) == 1:  # the common case: one int attribute (axis, keepdims, to), the key made directly
            for k, v in attrs.items():
                if type(v) is int:
                    made = self._attrs.get(((k, v),))
                    if made is not None:
                        return made
        key = []
        for k, v in attrs.items():
            t = type(v)
            if t is int:
                key.append((k, v))
            elif (t is list or t is tuple) and all(type(x) is int for x in v):
                key.append((k, tuple(v)))
            elif v is not None:
                return [_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None]
        key.sort()
        made = self._attrs.get(tuple(key))
        if made is None:
            made = self._attrs[tuple(key)] = tuple(_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None)
        return made

    def const(self, value: Any, elem_type: int) -> str:
        arr = np.asarray(value)
        key = (elem_type, arr.shape, arr.tobytes(), arr.dtype.char)
        name = self._consts.get(key)
        if name is None:
            name = self.names.fresh("gb_const")
            if elem_type in (TensorProto.BFLOAT16, TensorProto.FLOAT16) or arr.dtype.kind == "f":
                tensor = helper.make_tensor(name, elem_type, arr.shape, arr.astype(np.float64).ravel().tolist())
            else:
                np_type = helper.tensor_dtype_to_np_dtype(elem_type)
                tensor = onnx.numpy_helper.from_array(arr.astype(np_type), name)
            self.initializers.append(tensor)
            self._consts[key] = name
        return name

    def ints(self, values: Sequence[int] | int) -> str:
        """An int64 constant (axes, shapes); looked up by value without numpy for plain ints."""
        t = type(values)
        if t is int:
            key: Any = values
        elif (t is list or t is tuple) and all(type(v) is int for v in values):
            key = tuple(values)
        else:
            return self.const(np.array(values, dtype=np.int64), TensorProto.INT64)
        name = self._ints.get(key)
        if name is None:
            name = self._ints[key] = self.const(np.array(values, dtype=np.int64), TensorProto.INT64)
        return name

    def shape_of(self, tensor: str) -> str:
        """Shape of a forward tensor, computed in the forward part: backward stashes 8 bytes a dim, not the tensor."""
        name = self._shapes.get(tensor)
        if name is None:
            static = self.fg.tensor_info(tensor).static_shape
            if static is not None:
                name = self.const(np.array(static, dtype=np.int64), TensorProto.INT64)
            else:
                name = self.node("Shape", [tensor], 1, f"{tensor}", forward=tensor not in self.produced)[0]
            self._shapes[tensor] = name
        return name


def broadcast_axes(small: Sequence[Any] | None, full: Sequence[Any] | None) -> tuple[list[int], int] | None:
    """Axes of `full` that numpy broadcasting stretched `small` along, and how many leading axes it added;
    None when static shapes cannot tell (a symbolic dim that may or may not be 1)."""
    try:
        plan = _broadcast_plan(small, full)  # shapes are tuples of int, str and None: hashable
    except TypeError:  # lists
        plan = _broadcast_plan.__wrapped__(small, full)
    return None if plan is None else (list(plan[0]), plan[1])


@functools.lru_cache(maxsize=4096)
def _broadcast_plan(small: Sequence[Any] | None, full: Sequence[Any] | None) -> tuple[tuple[int, ...], int] | None:
    if small is None or full is None or len(full) < len(small):
        return None
    lead = len(full) - len(small)
    axes = list(range(lead))
    for k, (dx, dy) in enumerate(zip(small, full[lead:])):
        if dx == dy and dx is not None:
            continue
        if dx == 1:
            axes.append(lead + k)
        elif not (isinstance(dx, int) and dx > 1):
            return None
    return tuple(axes), lead


class Grad:
    """The rule's view of one forward node: `I(i)`, `O(j)`, `GO(j)`, `needs(i)`, and emit helpers."""

    def __init__(self, em: Emitter, node: onnx.NodeProto, out_grads: Sequence[str | None],
                 needed: Sequence[bool], inputs: Sequence[str] | None = None, op_type: str | None = None):
        self.em = em
        self._emit = em.emit
        self._info = em.fg.info
        self.node = node
        self._inputs = node.input[:] if inputs is None else inputs  # node.input (ForwardGraph.node_inputs[k])
        self.opset = em.opset
        self.op_type = node.op_type if op_type is None else op_type  # (ForwardGraph.node_ops[k])
        self._go = list(out_grads)
        self._needs = list(needed)
        self._attr_values: dict[str, Any] | None = None  # decoded on the first attr()
        outs = node.output
        first = outs[0] if outs and outs[0] else next((o for o in outs if o), self.op_type)
        self._hint = f"grad/{first}"

    # --- the forward node ------------------------------------------------------------------
    @property
    def n_inputs(self) -> int:
        return len(self._inputs)

    def I(self, i: int) -> str | None:
        inputs = self._inputs
        return inputs[i] if i < len(inputs) and inputs[i] else None

    def O(self, j: int) -> str:
        return self.node.output[j]

    def output(self, j: int, hint: str) -> str:
        """Optional output j, added to the forward node when the model left it out: what the forward op drew or
        chose can only be read, not recomputed (Dropout's mask, MaxPool's Indices), and some of what it computes
        anyway is cheaper read than recomputed (SoftmaxCrossEntropyLoss's log-probabilities)."""
        outs = self.node.output
        if j < len(outs) and outs[j]:
            return outs[j]
        while len(outs) <= j:
            outs.append("")
        outs[j] = self.em.names.fresh(f"{outs[0]}_{hint}")
        return outs[j]

    def GO(self, j: int) -> str | None:
        return self._go[j] if j < len(self._go) else None

    def GO_or_zeros(self, j: int) -> str:
        go = self.GO(j)
        return go if go is not None else self.zeros_like(self.O(j))

    def needs(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def attr(self, name: str, default: Any = None) -> Any:
        if self._attr_values is None:
            self._attr_values = {a.name: helper.get_attribute_value(a) for a in self.node.attribute}
        value = self._attr_values.get(name, default)
        if isinstance(value, bytes):
            return self._text(name, value)
        if isinstance(value, list) and value and isinstance(value[0], bytes):
            return [self._text(name, v) for v in value]
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        """A 0/1 int attribute as a bool, so `1 - flag` arithmetic stays 0 or 1 (Gemm's transA and transB, which
        the forward graph holds to 0 or 1, `graph.DISPUTED_FLAGS`; CumSum's, which onnxruntime holds to them)."""
        return bool(int(self.attr(name, int(default))))

    def _text(self, name: str, value: bytes) -> str:
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise InvalidModelError(f"node {describe(self.node)}: attribute '{name}' is not UTF-8 text "
                                    f"({value[:16]!r}); ONNX strings are UTF-8. Fix the attribute or re-export the "
                                    "model.") from None

    def info(self, name: str) -> TensorInfo:
        return self._info.get(name, UNKNOWN)  # ForwardGraph.tensor_info

    def rank(self, name: str) -> int | None:
        return self._info.get(name, UNKNOWN).rank

    def dtype(self, name: str) -> int:
        return self._info.get(name, UNKNOWN).elem_type

    def require_rank(self, name: str) -> int:
        r = self.rank(name)
        if r is None:
            self.fail(f"the rank of '{name}' is unknown; give the model's inputs a shape (at least their rank)")
        return r  # type: ignore[return-value]

    def axis(self, value: Any, rank: int, what: str = "axis") -> int:
        """`value` (an axis attribute or constant) as a position in [0, rank), refused outside [-rank, rank):
        onnx's inference checks it only where it knows the rank, and `% rank` would wrap it silently."""
        a = int(value)
        if not -rank <= a < rank:
            self.fail(f"its {what} {a} is out of range for an input of rank {rank}" +
                      (f" (from {-rank} to {rank - 1})" if rank else " (which has no axes)"))
        return a % rank

    def axis_of(self, value: Any, t: str, what: str = "axis") -> int:
        """`value` checked by `axis` against t's rank where it is known (onnxruntime reads some axes out of range
        without an error: a Softmax over axis 2^40 ran, its gradient's ReduceSum did not); as given otherwise."""
        rank = self.rank(t)
        return int(value) if rank is None else self.axis(value, rank, what)

    def const_input(self, i: int) -> np.ndarray | None:
        """Value of input i when it is an initializer or a Constant node's output (axes, shapes, pads)."""
        name = self.I(i)
        if name is None:
            return None
        fg = self.em.fg
        if name in fg.initializers and name not in fg.inputs:
            return onnx.numpy_helper.to_array(fg.initializers[name])
        k = fg.producer.get(name)
        if k is not None and fg.nodes[k].op_type == "Constant":
            for a in fg.nodes[k].attribute:
                if a.name == "value":
                    return onnx.numpy_helper.to_array(a.t)
                if a.name in ("value_ints", "value_int", "value_floats", "value_float"):
                    return np.array(helper.get_attribute_value(a))
        return None

    def fail(self, why: str) -> None:
        raise RuleError(f"cannot differentiate node {describe(self.node)} at opset {self.opset}: {why}.")

    # --- emitting ----------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: str | None, n_out: int = 1, domain: str = "", forward: bool = False,
           **attrs: Any) -> Any:
        """Emit a node; `forward=True` puts it in the forward part (it may read forward tensors only), so
        backward stashes its small result (a mask, a shape) instead of the tensors it reads."""
        outs = self._emit(op_type, inputs, n_out, self._hint, domain, forward, None, attrs)
        return outs[0] if n_out == 1 else outs

    def __getattr__(self, op_type: str) -> Any:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    def const(self, value: Any, like: str | None = None, elem_type: int | None = None) -> str:
        """A constant with `like`'s element type (or `elem_type`); CastLike when that type is unknown."""
        if elem_type is None:
            elem_type = self.dtype(like) if like is not None else TensorProto.FLOAT
            if not elem_type:
                if self.opset < 15:
                    self.fail(f"the element type of '{like}' is unknown")
                return self.CastLike(self.em.const(value, TensorProto.FLOAT), like)
        return self.em.const(value, elem_type)

    def ints(self, values: Sequence[int] | int) -> str:
        return self.em.ints(values)

    def shape_of(self, tensor: str) -> str:
        return self.em.shape_of(tensor)

    def zeros_like(self, tensor: str) -> str:
        elem_type = self.dtype(tensor) or TensorProto.FLOAT
        static = self.info(tensor).static_shape
        if static is not None and int(np.prod(static)) <= 1:
            return self.const(np.zeros(static), elem_type=elem_type)
        value = helper.make_tensor("value", elem_type, [1], [0])
        return self.ConstantOfShape(self.shape_of(tensor), value=value)

    def declare(self, name: str, info: TensorInfo) -> str:
        """State the type of an emitted tensor that onnx's shape inference cannot follow (a weight computed from
        a gradient whose producers reshape to sizes read at run time), so passes over the backward graph see
        it as the rule does; returns `name`."""
        self.em.declared[name] = info
        return name

    # --- named helpers for repeated patterns ---------------------------------------------------
    def cast_like(self, x: str, like: str, x_like: str | None = None) -> str:
        """`x` cast to the element type of forward tensor `like` (CastLike when that type is unknown); no cast
        when `x` is known to have it already (it has the type of forward tensor `x_like`, default x itself)."""
        elem_type = self.dtype(like)
        if elem_type and self.dtype(x_like or x) == elem_type:
            return x
        if elem_type:
            return self.Cast(x, to=elem_type)
        if self.opset < 15:
            self.fail(f"the element type of '{like}' is unknown")
        return self.CastLike(x, like)

    def reduce(self, op_type: str, x: str, axes: Sequence[int], keepdims: bool = True) -> str:
        """Any Reduce* over constant axes: an attribute before opset 18 (13 for ReduceSum), an input after."""
        if self.opset >= (13 if op_type == "ReduceSum" else 18):
            return self.op(op_type, x, self.ints(list(axes)), keepdims=int(keepdims))
        return self.op(op_type, x, axes=list(axes), keepdims=int(keepdims))

    def reduce_sum(self, x: str, axes: Sequence[int] | str, keepdims: bool = True) -> str:
        axes_in = axes if isinstance(axes, str) else self.ints(list(axes))
        return self.ReduceSum(x, axes_in, keepdims=int(keepdims))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.Unsqueeze(x, self.ints(list(axes)))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        return self.Squeeze(x, self.ints(list(axes)))

    def reshape_target(self, like: str) -> str:
        """A Reshape target giving a tensor of like's size like's shape: a constant with -1 for its only
        symbolic dim when the others are static and positive (no Shape node, nothing stashed), else its shape."""
        dims = self.info(like).shape
        if dims is not None:
            dynamic = [k for k, d in enumerate(dims) if not isinstance(d, int)]
            if len(dynamic) == 1 and all(d > 0 for d in dims if isinstance(d, int)):
                return self.ints([-1 if k == dynamic[0] else int(d) for k, d in enumerate(dims)])  # type: ignore[arg-type]
        return self.shape_of(like)

    def reshape_exact(self, x: str, shape: str) -> str:
        """x in `shape`, whose 0s are sizes of 0 (allowzero, opset 14+: a 0 otherwise copies x's size there, or
        is refused where x has no such axis)."""
        return self.Reshape(x, shape, allowzero=1 if self.opset >= 14 else None)

    def reshape_like(self, x: str, like: str) -> str:
        """x (of like's size) in like's shape."""
        return self.reshape_exact(x, self.reshape_target(like))

    def unbroadcast(self, grad: str, like: str, grad_like: str | None = None) -> str:
        """Sum `grad` (shaped like `grad_like`, default output 0) down to the shape of `like`.

        Static shapes give one ReduceSum over known axes; symbolic dims that may or may not broadcast
        fall back to axes computed at run time from the two shapes.
        """
        ys = self.info(grad_like or self.O(0)).shape
        xs = self.info(like).shape
        plan = broadcast_axes(xs, ys)
        if plan is not None:
            axes, lead = plan
            if not axes:
                return grad
            if axes == list(range(lead)):  # only leading axes: they vanish in one node
                return self.reduce_sum(grad, axes, keepdims=False)
            r = self.reduce_sum(grad, axes, keepdims=True)
            return self.squeeze(r, list(range(lead))) if lead else r
        return self._unbroadcast_dynamic(grad, like, xs, ys)

    def _unbroadcast_dynamic(self, grad: str, like: str, xs: Any, ys: Any) -> str:
        shape_y = self.Shape(grad)
        shape_x = self.shape_of(like)
        if xs is not None and ys is not None:
            lead = len(ys) - len(xs)
            padded = self.Concat(self.ints([1] * lead), shape_x, axis=0) if lead > 0 else shape_x
        else:
            lead_n = self.Sub(self.Size(shape_y), self.Size(shape_x))
            ones = self.ConstantOfShape(self.Reshape(lead_n, self.ints([1])),
                                        value=helper.make_tensor("value", TensorProto.INT64, [1], [1]))
            padded = self.Concat(ones, shape_x, axis=0)
        return self.Reshape(self.sum_where_sizes_differ(grad, padded, shape_y), shape_x)

    def sum_where_sizes_differ(self, grad: str, sizes: str, grad_sizes: str, among: str | None = None) -> str:
        """`grad` summed, dims kept, over the axes where its run-time `grad_sizes` differ from `sizes` (an operand's, 1
        where it was broadcast), only those marked in the bool vector `among` if given."""
        differ = self.Not(self.Equal(sizes, grad_sizes))
        axes = self.Reshape(self.NonZero(differ if among is None else self.And(differ, among)), self.ints([-1]))
        return self.ReduceSum(grad, axes, keepdims=1, noop_with_empty_axes=1)


def _op_method(op_type: str) -> Any:
    def method(self: Grad, *inputs: str | None, n_out: int = 1, domain: str = "", forward: bool = False,
               **attrs: Any) -> Any:  # Grad.op(op_type, ...), one call less
        outs = self._emit(op_type, inputs, n_out, self._hint, domain, forward, None, attrs)
        return outs[0] if n_out == 1 else outs

    method.__name__ = method.__qualname__ = op_type
    return method


# `g.Mul(...)` without going through __getattr__ for every ONNX op name (what __getattr__ would return, made once)
for _op in sorted({s.name for s in onnx.defs.get_all_schemas() if s.name[:1].isupper()}):
    if not hasattr(Grad, _op):
        setattr(Grad, _op, _op_method(_op))
del _op
