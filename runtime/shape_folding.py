"""Shape arithmetic folded to constants where only some dims (the batch) are unknown.

Exported models compute reshape targets and scales from `Shape` at run time because the batch is a symbolic
dimension: in a 2-layer encoder exported from torch, 140 of the 246 forward nodes onnxruntime runs are Shape,
Gather, Unsqueeze, Concat and their arithmetic. onnxruntime folds a Shape only when every dim of its input is
known. Here every small tensor computed from shapes and constants is evaluated (`partial_ints`) with the dims ONNX
shape inference knows: the entirely known int64 and bool ones become initializers (onnxruntime then folds the
float arithmetic after them, such as attention's 1/sqrt(head size)), and a Reshape target unknown in one entry
only gets -1 there.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import numpy as np
import onnx

from gradbuilder.inference import infer_shapes, static_dims

from .partial_ints import MAX_ELEMENTS, TYPES, Value, evaluate, onnx_slice, range_length
from .passes import constant_values, drop_dead, forget_types, fresh_name, int_attr, ints_attr, names_in_use


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
    """The graph's constant small tensors of the types evaluated."""
    def small(t: onnx.TensorProto) -> bool:
        return t.data_type in TYPES and math.prod(t.dims) <= MAX_ELEMENTS

    return {name: Value.of(a) for name, a in constant_values(graph, small).items()}


MAX_HINTS = 256
"""Most dims found by evaluation fed back to inference while an If is undecided, and most rounds of inference
that feeding takes (one each time the dims found grow)."""

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
    folded = {name: v for name, v in values.items()  # float arithmetic left to onnxruntime
              if name not in constant and name not in outputs and v.complete and v.data.dtype.kind != "f"}
    targets = {}
    for n in graph.node:
        if n.op_type == "Reshape" and len(n.input) > 1 and n.input[1] not in folded and not int_attr(n, "allowzero", 0):
            v = values.get(n.input[1])
            items = [] if v is None or v.data.ndim != 1 or not v.integral else v.items()
            if items.count(None) == 1 and -1 not in items:
                targets[n.input[1]] = [-1 if d is None else d for d in items]
    if not folded and not targets:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = names_in_use(out.graph)
    renamed = {name: fresh_name(f"{name}/batch_as_-1", taken) for name in targets}
    for name, v in folded.items():
        out.graph.initializer.append(onnx.numpy_helper.from_array(np.array(v.data), name))
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


def _evaluated(model: onnx.ModelProto, hints: dict[str, list[int | None]] | None = None
               ) -> tuple[dict[str, Value], set[str], dict[str, bool], dict[str, list[int | None]]]:
    """One pass over the graph with the dims shape inference knows (and `hints`): the shape arithmetic's values
    (`partial_ints.evaluate`), the names already constant before it (initializers, Constants), the one-element
    booleans known (a squeeze's condition), and the dims found on the way where inference left them unknown: Slices
    sized from their computed starts and ends (torch exports them computed), Expands and Reshapes from their
    computed targets (torch's broadcast_tensors, a float64 convolution's columns), ConstantOfShapes from their
    computed shapes (`ones_like`), Pads from their computed pads (F.pad), Resizes from their computed scales or
    sizes (interpolate), Ranges from their computed bounds."""
    graph = model.graph
    dims = _known_dims(model, hints)
    values = _constant_values(graph)
    constant = set(values)
    sized: dict[str, list[int | None]] = {}
    for n in graph.node:
        if n.op_type == "Split" and n.domain in ("", "ai.onnx"):
            for name, found in zip(n.output, _split_dims(n, dims.get(n.input[0]), values)):
                if None in dims.get(name, [None]) and found != dims.get(name):
                    dims[name] = sized[name] = found
        if len(n.output) != 1 or n.domain not in ("", "ai.onnx") or n.output[0] in constant:
            continue
        if n.op_type in SIZED and n.input and None in dims.get(n.output[0], [None]):
            found = _sized(n, dims, values)
            if found is not None and found != dims.get(n.output[0]):
                dims[n.output[0]] = sized[n.output[0]] = found
        v = evaluate(n, values, dims)
        if v is not None:
            values[n.output[0]] = v
    truth = {name: bool(v.data.ravel()[0]) for name, v in values.items()
             if v.boolean and v.data.size == 1 and v.complete}
    return values, constant, truth, sized


def _expanded_dims(shape: list[int | None] | None, target: Value | None) -> list[int | None] | None:
    """An Expand's output dims from its input's and its computed target (numpy broadcasting, from the right): a
    target dim of 1 gives the input's, an unknown one the input's where that is not 1 (else unknown: it was 1,
    a batch broadcast from 1 taken for 1)."""
    if shape is None or target is None or target.data.ndim != 1:
        return None
    sizes = target.items()
    rank = max(len(shape), len(sizes))
    ins = [1] * (rank - len(shape)) + list(shape)
    outs = [1] * (rank - len(sizes)) + sizes
    return [d if t == 1 else (d if d != 1 else None) if t is None else t if d in (None, 1, t) else None
            for d, t in zip(ins, outs)]


SIZED = frozenset({"Slice", "Expand", "Reshape", "ConstantOfShape", "Pad", "Resize", "Range"})
"""Ops whose output dims `_evaluated` finds from their computed inputs where inference leaves them unknown."""


def _sized(n: onnx.NodeProto, dims: dict[str, list[int | None]], values: dict[str, Value]) -> list[int | None] | None:
    shape = dims.get(n.input[0])
    if n.op_type == "Resize":
        return _resized_dims(n, shape, [values.get(i) if i else None for i in n.input])
    if n.op_type == "Range":
        return _range_dims([values.get(i) for i in n.input])
    args = [v if v is not None and v.integral else None for v in (values.get(i) if i else None for i in n.input)]
    if n.op_type == "ConstantOfShape":
        return None if args[0] is None or args[0].data.ndim != 1 else _sizes(args[0].items())
    if len(args) < 2:
        return None
    if n.op_type == "Slice":
        return _sliced_dims(shape, [a.items() if a is not None and a.complete else None for a in args[1:]],
                            [bool(i) for i in n.input[1:]])
    if n.op_type == "Expand":
        return _expanded_dims(shape, args[1])
    if n.op_type == "Pad":
        if len(n.input) <= 3 or not n.input[3]:
            return _padded_dims(shape, args[1], None)
        axes = args[3]
        return None if axes is None or not axes.complete else _padded_dims(shape, args[1], axes.items())
    return _reshaped_dims(shape, args[1], bool(int_attr(n, "allowzero", 0)))


def _resized_dims(n: onnx.NodeProto, shape: list[int | None] | None, args: list[Value | None]
                  ) -> list[int | None] | None:
    """A Resize's output dims from its computed sizes, or its scales (each dim times its scale in float32, rounded
    down, as onnxruntime sizes it), over `axes` (opset 18) or every axis: torch's exporters write interpolate's
    scales as a Concat, which inference does not read."""
    if shape is None or next((a.s for a in n.attribute if a.name == "keep_aspect_ratio_policy"), b"stretch") \
            != b"stretch":
        return None
    axes = ints_attr(n, "axes") or list(range(len(shape)))
    sizes = args[3] if len(args) > 3 else None
    scales = args[2] if len(args) > 2 else args[1] if len(args) == 2 else None  # opset 10: (X, scales)
    if sizes is not None and sizes.integral and sizes.data.shape == (len(axes),):
        found = sizes.items()
    elif sizes is None and scales is not None and scales.data.dtype == np.float32 and \
            scales.data.shape == (len(axes),):
        found = [None if shape[a] is None or f is None else int(np.float32(shape[a]) * np.float32(f))
                 for a, f in zip(axes, scales.items())]
    else:
        return None
    out = list(shape)
    for a, v in zip(axes, found):
        out[a] = v
    return _sizes(out)


def _range_dims(args: list[Value | None]) -> list[int | None] | None:
    """A Range's length from its computed start, limit and delta, in their type (ints or floats: a float64
    interpolation's sample positions), where inference reads constants only."""
    if len(args) != 3 or any(a is None or not a.complete or a.data.size != 1 or a.boolean for a in args):
        return None
    length = range_length(*(a.data.ravel()[0] for a in args))
    return None if length is None else [length]


def _split_dims(n: onnx.NodeProto, shape: list[int | None] | None, values: dict[str, Value]
                ) -> list[list[int | None]]:
    """A Split's outputs' dims from its computed sizes (an input from opset 13, an attribute before): torch.split
    by a size read from the input writes them as a Concat of its whole parts and the remainder, which inference
    does not read. [] where they are not known."""
    given = values.get(n.input[1]) if len(n.input) > 1 and n.input[1] else None
    sizes = given.items() if given is not None and given.integral and given.data.ndim == 1 else ints_attr(n, "split")
    if shape is None or not sizes or len(sizes) != len(n.output):
        return []
    axis = int_attr(n, "axis", 0) % len(shape)
    return [[v if a == axis else d for a, d in enumerate(shape)] for v in _sizes(list(sizes))]


def _sizes(items: list[int | None]) -> list[int | None]:
    """Dims from computed sizes: a negative one (a bad graph, or -1 for "infer") as unknown."""
    return [v if v is not None and v >= 0 else None for v in items]


def _reshaped_dims(shape: list[int | None] | None, target: Value | None, allowzero: bool) -> list[int | None] | None:
    """A Reshape's output dims from its computed target: a 0 copies the input's dim (unless allowzero), a -1 is
    what the other dims leave of the input's size where all are known."""
    if target is None or target.data.ndim != 1:
        return None
    out = target.items()
    for i, v in enumerate(out):
        if v == 0 and not allowzero:  # a copy of the input's dim
            out[i] = shape[i] if shape is not None and i < len(shape) else None
    if out.count(-1) == 1 and shape is not None and None not in shape and None not in out:
        rest = math.prod(v for v in out if v != -1)
        out[out.index(-1)] = math.prod(shape) // rest if rest else None  # type: ignore[type-var]
    return _sizes(out)


def _sliced_dims(shape: list[int | None] | None, args: list[list[int | None] | None], given: list[bool]
                 ) -> list[int | None] | None:
    """A Slice's output dims from its input's and its starts, ends, axes and steps (`given`: which inputs are)
    where those are known (torch exports them computed: inference alone does not size the output)."""
    if shape is None or len(args) < 2 or any(a is None and g for a, g in zip(args, given)):
        return None
    starts, ends = args[0], args[1]
    axes = args[2] if len(args) > 2 and given[2] else list(range(len(starts)))
    steps = args[3] if len(args) > 3 and given[3] else [1] * len(starts)
    out = list(shape)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        n = shape[axis]
        if n is None or step == 0:
            return None
        out[axis] = len(range(n)[onnx_slice(n, start, end, step)])
    return out


def _padded_dims(shape: list[int | None] | None, pads: Value | None, axes: list[int | None] | None
                 ) -> list[int | None] | None:
    """A Pad's output dims from its input's and its computed pads (all begins, then all ends, over `axes` or every
    axis): F.pad's pads are computed through a chain of shape ops that inference does not follow."""
    if shape is None or pads is None or pads.data.ndim != 1:
        return None
    axes = list(range(len(shape))) if axes is None else axes
    amounts = pads.items()
    if len(amounts) != 2 * len(axes):
        return None
    out = list(shape)
    for axis, begin, end in zip(axes, amounts, amounts[len(axes):]):
        d = out[axis]
        out[axis] = None if d is None or begin is None or end is None else d + begin + end
    return _sizes(out)


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
    average pool), which the gradient builder cannot differentiate, while the pinned build knows that size. Where
    inference leaves a tensor's rank unknown, the dims the evaluation finds are declared (`_declare_found`).
    Returns a rewritten copy, or `model` itself when nothing changes."""
    for _ in range(ROUNDS):
        graph = model.graph
        ifs = [n for n in graph.node if n.op_type == "If" and n.domain in ("", "ai.onnx")]
        if not ifs:
            return _ranked(model)
        truth, found = _found(model, ifs)
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
        _declare_found(out, found)
        model = out
    return model


def _found(model: onnx.ModelProto, ifs: Sequence[onnx.NodeProto] = ()
           ) -> tuple[dict[str, bool], dict[str, list[int | None]]]:
    """The booleans the evaluation decides and the dims it finds, fed back to inference while they grow (they size
    what follows them), until every If of `ifs` is decided."""
    hints: dict[str, list[int | None]] = {}
    for _ in range(MAX_HINTS):
        _, _, truth, sized = _evaluated(model, hints)
        grown = {name: found for name, found in sized.items() if hints.get(name) != found}
        if (ifs and all(n.input[0] in truth for n in ifs)) or not grown or len(hints) > MAX_HINTS:
            break
        hints.update(grown)
    return truth, {**hints, **sized}


def _ranked(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model`, or a copy with the dims the evaluation finds declared where inference leaves the rank of a node's
    output unknown: the gradient build infers shapes anew, and Whisper's decoder positions (an Expand to a
    ConstantOfShape of a Shape), ViTMAE's decoder, lost the rank of everything after them, which a MatMul's rule
    needs."""
    outputs = [o for n in model.graph.node for o in n.output if o]
    declared = static_dims(model.graph)
    if all(o in declared for o in outputs):  # as the exporter declared them (no inference: GPT-2's takes 27 ms)
        return model
    try:
        ranked = static_dims(infer_shapes(model).graph)
    except Exception:  # a model inference cannot follow keeps what it declares
        return model
    if all(o in ranked for o in outputs):
        return model
    _, found = _found(model)
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _declare_found(out, found)
    return out


def _declare_found(model: onnx.ModelProto, found: dict[str, list[int | None]]) -> None:
    """The dims the evaluation found written into the model's value_info (typed by inference), in place: the
    gradient build infers shapes anew and, without them, did not know the rank of a Split's outputs sized by a
    computed Concat (torch.split by a size read from the input), which a MaxPool's rule needs."""
    made = {o for n in model.graph.node for o in n.output}
    wanted = {name: dims for name, dims in found.items() if name in made}
    try:
        inferred = {vi.name: vi for vi in infer_shapes(model).graph.value_info if vi.name in wanted}
    except Exception:  # a model inference cannot follow keeps what it declares
        return
    declared = []
    for name, vi in inferred.items():
        if vi.type.HasField("tensor_type"):
            declared.append(onnx.ValueInfoProto())
            declared[-1].CopyFrom(vi)
            _declare(declared[-1], wanted[name])
    replaced = {vi.name for vi in declared}
    kept = [vi for vi in model.graph.value_info if vi.name not in replaced]
    del model.graph.value_info[:]
    model.graph.value_info.extend([*kept, *declared])
