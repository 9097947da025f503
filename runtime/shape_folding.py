"""Shape arithmetic folded to constants where only some dims (the batch) are unknown.

Exported models compute reshape targets and scales from `Shape` at run time because the batch is a symbolic
dimension: in a 2-layer encoder exported from torch, 140 of the 246 forward nodes onnxruntime runs are Shape,
Gather, Unsqueeze, Concat and their arithmetic. onnxruntime folds a Shape only when every dim of its input is
known. Here every small int64 tensor computed from shapes is evaluated with the dims ONNX shape inference
knows: the entirely known ones become initializers (onnxruntime then folds the float arithmetic after them,
such as attention's 1/sqrt(head size)), and a Reshape target unknown in one entry only gets -1 there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from gradbuilder.inference import infer_shapes, static_dims

from .passes import constant_values, drop_dead, forget_types, fresh_name, int_attr, names_in_use

MAX_ELEMENTS = 16
"""Longest int64 vector evaluated (shape vectors are as long as a tensor's rank)."""
Value = tuple[bool, list[int | None]]
"""(is a scalar, elements, None where unknown)."""


def _is_constant(n: onnx.NodeProto) -> bool:
    """A Constant node holding a tensor (`value`)."""
    return n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.attribute) == 1 \
        and n.attribute[0].name == "value"


def _known_dims(model: onnx.ModelProto, hints: dict[str, list[int | None]] | None = None
                ) -> dict[str, list[int | None]]:
    """Dims of every tensor shape inference types, None for symbolic or unknown ones. Constant nodes are read as
    initializers: inference then sizes what they parametrize (a Slice's starts and ends, as torch exports them).
    `hints`: dims of tensors found otherwise (`_evaluated`), declared for inference to carry them on."""
    constants = [n for n in model.graph.node if _is_constant(n)]
    if constants:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        kept = [n for n in copy.graph.node if not _is_constant(n)]
        for n in constants:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(n.attribute[0].t)
            tensor.name = n.output[0]
            copy.graph.initializer.append(tensor)
        del copy.graph.node[:]
        copy.graph.node.extend(kept)
        model = copy
    try:
        inferred = infer_shapes(model)
    except Exception:  # a model inference cannot follow keeps its shape arithmetic
        return {}
    if hints:
        for vi in inferred.graph.value_info:
            if vi.name in hints and vi.type.HasField("tensor_type"):
                _declare(vi, hints[vi.name])
        with contextlib.suppress(Exception):  # inconsistent hints: what inference found alone
            inferred = infer_shapes(inferred)
    return static_dims(inferred.graph)


def _declare(vi: onnx.ValueInfoProto, dims: list[int | None]) -> None:
    shape = vi.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        dim = shape.dim.add()
        if d is not None:
            dim.dim_value = d


def _constant_values(graph: onnx.GraphProto) -> dict[str, Value]:
    """The graph's constant int64 scalars and short vectors."""
    def small_ints(t: onnx.TensorProto) -> bool:
        return t.data_type == TensorProto.INT64 and len(t.dims) <= 1 and np.prod(t.dims) <= MAX_ELEMENTS

    return {name: (a.ndim == 0, [int(v) for v in a.ravel()]) for name, a in constant_values(graph, small_ints).items()}


def _elementwise(op: str, a: Value, b: Value) -> Value | None:
    (sa, xa), (sb, xb) = a, b
    if len(xa) != len(xb) and 1 not in (len(xa), len(xb)):
        return None
    n = max(len(xa), len(xb))
    xa, xb = xa * n if len(xa) == 1 else xa, xb * n if len(xb) == 1 else xb
    out: list[int | None] = []
    for u, v in zip(xa, xb):
        if u is None or v is None or (op in ("Div", "Mod") and v == 0):
            out.append(None)
        elif op == "Div":  # integer Div truncates toward zero
            out.append(abs(u) // abs(v) * (1 if (u < 0) == (v < 0) else -1))
        else:
            out.append(u + v if op == "Add" else u - v if op == "Sub" else u * v if op == "Mul" else u % v)
    return sa and sb, out


def _sliced(values: list[int | None], start: int, end: int) -> list[int | None]:
    """values[start:end] with ONNX's clamping (Shape's start/end, Slice of step 1)."""
    n = len(values)
    return values[slice(*[max(0, min(n, v + n if v < 0 else v)) for v in (start, end)])]


def _evaluate(node: onnx.NodeProto, values: dict[str, Value], dims: dict[str, list[int | None]]) -> Value | None:
    """The node's output as a partially known int64 vector or scalar, or None when it is not one."""
    op, ins = node.op_type, list(node.input)
    args = [values.get(i) for i in ins]
    if op == "Shape":
        shape = dims.get(ins[0])
        if shape is None:
            return None
        return False, _sliced(shape, int_attr(node, "start", 0), int_attr(node, "end", len(shape)))
    if op == "Size":
        shape = dims.get(ins[0])
        return None if shape is None else (True, [None if None in shape else int(np.prod(shape))])
    if any(a is None for a in args[:1]):
        return None
    if op == "Gather" and int_attr(node, "axis", 0) == 0 and args[1] is not None and not args[0][0]:
        data = args[0][1]
        picked = [data[i] if -len(data) <= i < len(data) else None for i in args[1][1]]
        return (args[1][0], picked) if None not in args[1][1] else None
    if op == "Slice" and not args[0][0] and all(a is not None for a in args[1:]):
        data, starts, ends = args[0][1], args[1][1], args[2][1]
        steps = args[4][1] if len(args) > 4 else [1]
        if args[1][0] or args[2][0] or len(starts) != 1 or steps != [1] or None in starts + ends or \
                (len(args) > 3 and args[3][1] != [0]):
            return None
        return False, _sliced(data, starts[0], ends[0])
    if op == "Unsqueeze" and args[0][0] and len(args) > 1 and args[1] is not None and args[1][1] == [0]:
        return False, args[0][1]
    if op == "Squeeze" and not args[0][0] and len(args[0][1]) == 1 and (len(args) < 2 or args[1] is not None):
        return True, args[0][1]
    if op == "Concat" and int_attr(node, "axis", 0) in (0, -1) and all(a is not None and not a[0] for a in args):
        return False, [v for a in args for v in a[1]]
    if op in ("Add", "Sub", "Mul", "Div", "Mod") and len(args) == 2 and args[1] is not None and \
            not (op == "Mod" and int_attr(node, "fmod", 0)):
        return _elementwise(op, args[0], args[1])
    if op in ("Identity", "Cast") and (op == "Identity" or int_attr(node, "to", 0) == TensorProto.INT64):
        return args[0]
    if op == "Reshape" and len(args) > 1 and args[1] is not None and args[1][1] in ([-1], [len(args[0][1])]):
        return False, args[0][1]  # a vector (or a scalar) as a vector: the legacy exporter's Expand targets
    if op == "ConstantOfShape" and not args[0][0] and len(args[0][1]) <= 1 and None not in args[0][1]:
        fill = next((a.t for a in node.attribute if a.name == "value"), None)
        if fill is not None and fill.data_type == TensorProto.INT64 and (args[0][1] or [1])[0] <= MAX_ELEMENTS:
            value = int(onnx.numpy_helper.to_array(fill).ravel()[0])
            return (False, [value] * args[0][1][0]) if args[0][1] else (True, [value])
    return None


Flags = tuple[bool, list[bool | None]]
"""(is a scalar, a comparison's elements, None where unknown)."""


def _broadcast(*lengths: int) -> int | None:
    longest = max(lengths)
    return longest if all(n in (1, longest) for n in lengths) else None


def _compared(op: str, a: Value | None, b: Value | None) -> Flags | None:
    """A comparison of two int64 vectors (or scalars), elementwise, None where an operand is unknown."""
    if a is None or b is None or (n := _broadcast(len(a[1]), len(b[1]))) is None:
        return None
    xa, xb = (x * n if len(x) == 1 else x for x in (a[1], b[1]))
    return a[0] and b[0], [None if u is None or v is None else bool(COMPARISONS[op](u, v)) for u, v in zip(xa, xb)]


def _selected(flags: Flags, a: Value | None, b: Value | None) -> Value | None:
    """Where(flags, a, b) over int64 vectors, elementwise, None where the flag is unknown: the legacy exporter
    writes an Expand's target as Where(target == -1, 1, target)."""
    if a is None or b is None or (n := _broadcast(len(flags[1]), len(a[1]), len(b[1]))) is None:
        return None
    f, xa, xb = (x * n if len(x) == 1 else x for x in (flags[1], a[1], b[1]))
    return flags[0] and a[0] and b[0], [None if c is None else u if c else v for c, u, v in zip(f, xa, xb)]


MAX_HINTS = 256
"""Most dims found by evaluation fed back to inference while an If is undecided (a round of inference each)."""

ROUNDS = 4
"""Rounds of inference and folding: a Reshape whose target was computed at run time hides the shape of
everything after it from inference until its target is folded."""


def fold_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its known shape arithmetic as initializers and its one-unknown Reshape targets as constants
    holding -1 (module docstring); returns a rewritten copy, or `model` itself when nothing folds."""
    for _ in range(ROUNDS):
        folded = _fold_once(model)
        if folded is model:
            break
        model = folded
    return model


def _fold_once(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    if not any(n.op_type in ("Shape", "Size") for n in graph.node):
        return model
    values, constant, _, _ = _evaluated(model)
    outputs = {o.name for o in graph.output}
    folded = {name: v for name, v in values.items()
              if name not in constant and name not in outputs and None not in v[1]}
    targets = {}
    for n in graph.node:
        if n.op_type == "Reshape" and len(n.input) > 1 and n.input[1] not in folded and not int_attr(n, "allowzero", 0):
            v = values.get(n.input[1])
            if v is not None and not v[0] and v[1].count(None) == 1 and -1 not in v[1]:
                targets[n.input[1]] = [-1 if d is None else d for d in v[1]]
    if not folded and not targets:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = names_in_use(out.graph)
    renamed = {name: fresh_name(f"{name}/batch_as_-1", taken) for name in targets}
    for name, v in folded.items():
        out.graph.initializer.append(onnx.numpy_helper.from_array(
            np.array(v[1][0] if v[0] else v[1], dtype=np.int64), name))
    for name, new in renamed.items():
        out.graph.initializer.append(onnx.numpy_helper.from_array(np.array(targets[name], dtype=np.int64), new))
    nodes = [n for n in out.graph.node if not (len(n.output) == 1 and n.output[0] in folded)]
    for n in nodes:
        if n.op_type == "Reshape" and len(n.input) > 1 and n.input[1] in renamed:
            n.input[1] = renamed[n.input[1]]
    nodes = drop_dead(nodes, [], outputs)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


COMPARISONS = {"Equal": lambda a, b: a == b, "Greater": lambda a, b: a > b, "Less": lambda a, b: a < b,
               "GreaterOrEqual": lambda a, b: a >= b, "LessOrEqual": lambda a, b: a <= b}


def _evaluated(model: onnx.ModelProto, hints: dict[str, list[int | None]] | None = None
               ) -> tuple[dict[str, Value], set[str], dict[str, bool], dict[str, list[int | None]]]:
    """One pass over the graph with the dims shape inference knows (and `hints`): the int64 shape arithmetic's
    values (`_evaluate`), the names already constant before it (initializers, Constants), the one-element booleans
    the dims decide (comparisons of that arithmetic, their negations), and the dims found on the way where
    inference left them unknown: Slices sized from their computed starts and ends (torch exports them computed),
    Expands and Reshapes from their computed targets (torch's broadcast_tensors, a float64 convolution's columns),
    ConstantOfShapes from their computed shapes (`ones_like`)."""
    graph = model.graph
    dims = _known_dims(model, hints)
    values = _constant_values(graph)
    constant = set(values)
    truth: dict[str, bool] = {}
    flags: dict[str, Flags] = {}
    sized: dict[str, list[int | None]] = {}
    for n in graph.node:
        if len(n.output) != 1 or n.domain not in ("", "ai.onnx") or n.output[0] in constant:
            continue
        if n.op_type in SIZED and n.input and None in dims.get(n.output[0], [None]):
            found = _sized(n, dims, values)
            if found is not None and found != dims.get(n.output[0]):
                dims[n.output[0]] = sized[n.output[0]] = found
        if n.op_type in COMPARISONS and len(n.input) == 2:
            compared = _compared(n.op_type, values.get(n.input[0]), values.get(n.input[1]))
            if compared is not None:
                flags[n.output[0]] = compared
                if compared[1] in ([True], [False]):
                    truth[n.output[0]] = bool(compared[1][0])
        elif n.op_type == "Not" and n.input[0] in truth:
            truth[n.output[0]] = not truth[n.input[0]]
        elif n.op_type == "Where" and n.input[0] in flags:
            picked = _selected(flags[n.input[0]], values.get(n.input[1]), values.get(n.input[2]))
            if picked is not None:
                values[n.output[0]] = picked
        else:
            v = _evaluate(n, values, dims)
            if v is not None and len(v[1]) <= MAX_ELEMENTS:
                values[n.output[0]] = v
    return values, constant, truth, sized


def _expanded_dims(shape: list[int | None] | None, target: Value | None) -> list[int | None] | None:
    """An Expand's output dims from its input's and its computed target (numpy broadcasting, from the right): a
    target dim of 1 gives the input's, an unknown one the input's where that is not 1 (else unknown: it was 1,
    a batch broadcast from 1 taken for 1)."""
    if shape is None or target is None or target[0]:
        return None
    rank = max(len(shape), len(target[1]))
    ins = [1] * (rank - len(shape)) + list(shape)
    outs = [1] * (rank - len(target[1])) + list(target[1])
    return [d if t == 1 else (d if d != 1 else None) if t is None else t if d in (None, 1, t) else None
            for d, t in zip(ins, outs)]


SIZED = frozenset({"Slice", "Expand", "Reshape", "ConstantOfShape"})
"""Ops whose output dims `_evaluated` finds from their computed inputs where inference leaves them unknown."""


def _sized(n: onnx.NodeProto, dims: dict[str, list[int | None]], values: dict[str, Value]) -> list[int | None] | None:
    args = [values.get(i) for i in n.input[1:]]
    if n.op_type == "ConstantOfShape":
        shape = values.get(n.input[0])
        return None if shape is None or shape[0] else [v if v is not None and v >= 0 else None for v in shape[1]]
    if not args:
        return None
    if n.op_type == "Slice":
        return _sliced_dims(dims.get(n.input[0]), args)
    if n.op_type == "Expand":
        return _expanded_dims(dims.get(n.input[0]), args[0])
    return _reshaped_dims(dims.get(n.input[0]), args[0], bool(int_attr(n, "allowzero", 0)))


def _reshaped_dims(shape: list[int | None] | None, target: Value | None, allowzero: bool) -> list[int | None] | None:
    """A Reshape's output dims from its computed target: a 0 copies the input's dim (unless allowzero), a -1 is
    what the other dims leave of the input's size where all are known."""
    if target is None or target[0]:
        return None
    out = list(target[1])
    for i, v in enumerate(out):
        if v == 0 and not allowzero:  # a copy of the input's dim
            out[i] = shape[i] if shape is not None and i < len(shape) else None
    if out.count(-1) == 1 and shape is not None and None not in shape and None not in out:
        rest = math.prod(v for v in out if v != -1)
        out[out.index(-1)] = math.prod(shape) // rest if rest else None  # type: ignore[type-var]
    return [v if v is not None and v >= 0 else None for v in out]


def _sliced_dims(shape: list[int | None] | None, args: list[Value | None]) -> list[int | None] | None:
    """A Slice's output dims from its input's and its starts, ends, axes and steps where those are known (torch
    exports them computed: inference alone does not size the output); positive steps only."""
    if shape is None or len(args) < 2 or any(a is None or None in a[1] for a in args):
        return None
    starts, ends = args[0][1], args[1][1]
    axes = args[2][1] if len(args) > 2 else list(range(len(starts)))
    steps = args[3][1] if len(args) > 3 else [1] * len(starts)
    out = list(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):  # type: ignore[arg-type]
        n = shape[axis]
        if n is None or step <= 0:
            return None
        first, last = (max(0, min(n, v + n if v < 0 else v)) for v in (start, end))
        out[axis] = max(0, -(-(last - first) // step))
    return out


def _inlined(branch: onnx.GraphProto, outputs: Sequence[str], taken: set[str]) -> list[onnx.NodeProto] | None:
    """The branch's nodes for the outer graph: its own tensors renamed fresh, its results written to `outputs`
    (by an Identity where a result is not made by one of its nodes); None when a node holds a subgraph (its
    implicit reads would need renaming too)."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in branch.node
           for a in n.attribute):
        return None
    results = [o.name for o in branch.output]
    made = {o for n in branch.node for o in n.output if o}
    own = made | {t.name for t in branch.initializer}
    rename = {name: (outputs[results.index(name)] if name in results and name in made
                     and results.count(name) == 1 else fresh_name(f"{name}/inlined", taken)) for name in own}
    nodes = []
    for t in branch.initializer:
        nodes.append(onnx.helper.make_node("Constant", [], [rename[t.name]], value=t))
    for n in branch.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.input[:] = [rename.get(i, i) for i in n.input]
        copy.output[:] = [rename.get(o, o) for o in n.output]
        nodes.append(copy)
    for result, out in zip(results, outputs):
        if rename.get(result) != out:
            nodes.append(onnx.helper.make_node("Identity", [rename.get(result, result)], [out]))
    return nodes


def _forget_shapes(graph: onnx.GraphProto, names: set[str]) -> None:
    """The declared shapes of `names` dropped (graph outputs keep their type), for inference to derive from
    their new nodes: the legacy exporter types an If's outputs by one branch (torch's scatter_reduce writes a
    branch that flattens 0-d operands), which may not be the branch taken."""
    forget_types(graph, names)
    for v in graph.output:
        if v.name in names:
            v.type.tensor_type.ClearField("shape")


def inline_constant_ifs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every If whose condition the known dims decide replaced by the branch it takes: the legacy exporter writes
    `squeeze(d)` of a dim it cannot size as If(shape[d] == 1, Squeeze, Identity) (torchaudio's M5 after its global
    average pool), which the gradient builder cannot differentiate, while the pinned build knows that size. Returns
    a rewritten copy, or `model` itself when no If is decided."""
    for _ in range(ROUNDS):
        graph = model.graph
        ifs = [n for n in graph.node if n.op_type == "If" and n.domain in ("", "ai.onnx")]
        if not ifs:
            return model
        hints: dict[str, list[int | None]] = {}
        while True:  # the dims evaluation found, fed back to inference, size what follows them
            _, _, truth, sized = _evaluated(model, hints)
            if all(n.input[0] in truth for n in ifs) or not sized.keys() - hints.keys() or len(hints) > MAX_HINTS:
                break
            hints.update(sized)
        taken = names_in_use(graph)
        replaced: dict[int, list[onnx.NodeProto]] = {}
        for n in ifs:
            if n.input[0] in truth:
                taken_branch = "then_branch" if truth[n.input[0]] else "else_branch"
                nodes = _inlined(next(a.g for a in n.attribute if a.name == taken_branch), list(n.output), taken)
                if nodes is not None:
                    replaced[id(n)] = nodes
        if not replaced:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        kept = [m for n in graph.node for m in replaced.get(id(n), [n])]
        outputs = {o.name for o in graph.output}
        del out.graph.node[:]
        out.graph.node.extend(drop_dead(kept, [], outputs))
        _forget_shapes(out.graph, {o for n in ifs if id(n) in replaced for o in n.output})
        model = out
    return model
