"""float64 arithmetic on 0-d tensors kept in float64 through the legacy exporter.

The legacy exporter writes a 0-d float64 tensor combined with a Python number (`0.5 * aux_loss`, `reg * 3`) as a
Cast to float32, the op on a float32 constant, and a Cast back where the result meets a float64 tensor: a float64
module's loss then carried float32 rounding (gradients 6e-8 off torch's, relative, in a module adding `3 * z.sum()`
to its output). `in_double` computes such a stretch in float64: the first Cast kept as the identity, its elementwise
ops on float64 copies of their constants (the decimal written, where float32 rounded it) and of sizes the trace
read (`label_smoothing / classes`, a sum over `x.shape[0]`: an integer Cast to float32), and the views it runs
through (`loss[None]`, `torch.stack` of 0-d results), up to the Casts back to float64. A graph output at the end of
a stretch is kept in float64 where torch's call returned it so (`ORTModule` returned float32 for
`linear(x).sum() * 3`). Only 0-d values (or of unknown rank) start a stretch: a tensor's Cast to float32 is the
module's own (`x.float() * 0.3`, which torch computes in float32). A stretch runs through Where's branches and ends
at comparisons (`torch.where(loss > 0, loss, 0.3)`, read in float64), whose results cast to float32 it takes in,
cast to float64, where it meets them (`(loss > 0) * loss`), and the module's own 0-d float32 values, cast to
float64, which torch promotes against a 0-d float64 one (ViTMAE's `(loss * mask).sum() / mask.sum()`, its mask
float32: the loss came back float32); where it reaches anything else (another op, a float32 tensor with dims, which
torch keeps float32), the model is left as exported.

`sizes_in_double` computes in float64 what both exporters compute from sizes in float32 and cast to float64 at once
(`x * x.shape[0] ** -0.5`, a Python number torch computes in double).

`constants_in_double` does the same for the dynamo exporter's float32 Constants cast to float64 (a float64 module's
`x * 2.7`, 2e-8 off), each read as the Python number of the exported program that rounds to it where one does
(`numbers_in`: a float64 flow's `0.5 * d * math.log(2 * math.pi)`, which no short decimal writes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from gradbuilder.graph import infer_shapes_safely
from gradbuilder.inference import tensor_types

from .passes import fresh_name, names_in_use, rename_tensors

ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Sqrt", "Exp", "Log", "Reciprocal",
                         "Max", "Min", "Floor", "Ceil", "Round", "Sign", "Mod"})
VIEWS = {"Unsqueeze": 1, "Squeeze": 1, "Reshape": 1, "Flatten": 1, "Identity": 1, "Expand": 1, "Concat": None}
"""Ops a stretch passes through, with how many leading inputs carry its values (None: all); the rest are int64
sizes or axes. A 0-d result stacked or unsqueezed (`loss[None]`, `torch.stack([a, b])`) came back float32."""
COMPARISONS = frozenset({"Greater", "Less", "Equal", "GreaterOrEqual", "LessOrEqual"})
"""Ops that read a stretch's values, compared in float64, and end it (their results are booleans): `torch.where(loss
> 0, loss, 0.3)` on a 0-d loss came back float32, and so did our conversions' Wheres (clamp's, logaddexp's)."""


def _values(node: onnx.NodeProto) -> list[str] | None:
    """The inputs of a node a stretch passes through (or ends at, `COMPARISONS`) that carry its values: Where's
    branches (its condition is a boolean), a view's leading ones; None for a node no stretch takes in."""
    if node.domain or len(node.output) != 1:
        return None
    if node.op_type in ELEMENTWISE or node.op_type in COMPARISONS:
        return list(node.input)
    if node.op_type == "Where":
        return list(node.input[1:])
    if node.op_type in VIEWS:
        return list(node.input[:VIEWS[node.op_type]])
    return None


def _cast_to(node: onnx.NodeProto) -> int | None:
    if node.op_type != "Cast" or node.domain:
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


INTEGERS = frozenset({TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT64,
                      TensorProto.UINT32, TensorProto.UINT16, TensorProto.UINT8})


def in_double(model: onnx.ModelProto, doubles: Collection[str] = (), numbers: Collection[float] = ()
              ) -> onnx.ModelProto:
    """`model` with those stretches in float64, in place (see the module docstring): all of them, or, where one
    reaches anything but elementwise ops, Casts back and the graph outputs in `doubles` (those torch's call
    returned in float64), none. A stretch takes in float32 constants and what the graph computes from them and from
    integers cast to float32 (`_sizes`: `label_smoothing / x.shape[1]`, a mean over a size), copied in float64, its
    constants read as `_as_written` (`numbers`: the trace's Python floats, `traced_numbers`)."""
    g = model.graph
    if not doubles and not any(_cast_to(n) == TensorProto.DOUBLE for n in g.node):  # no way back to float64
        return model
    types, constants, floats = _float32_sources(model)
    starts = [n for n in g.node if _cast_to(n) == TensorProto.FLOAT
              and types.get(n.input[0], (0,))[0] == TensorProto.DOUBLE and not types[n.input[0]][1]]
    if not starts:
        return model
    # a stretch takes in the module's own 0-d float32 values, known by their types: `y.sum() * buffer64`
    types = _typed(model, types, [x for n in g.node for x in _values(n) or () if x])
    sizes = _sizes(g, types, floats)
    inside = {n.output[0] for n in starts}
    stretch: list[onnx.NodeProto] = []
    compared: set[str] = set()
    masks: dict[str, onnx.NodeProto] = {}  # a comparison's result cast to float32: `(loss > 0) * loss`
    promoted: set[str] = set()  # the module's own 0-d float32 values met: `loss / mask.sum()`, float64 in torch
    for n in g.node:  # in graph order: inputs first
        values = _values(n)
        if _cast_to(n) == TensorProto.FLOAT and n.input[0] in compared:
            masks[n.output[0]] = n
        elif values and any(x in inside for x in values) and all(
                x in inside or x in floats or x in sizes or x in masks or types.get(x) == (TensorProto.FLOAT, [])
                for x in values):
            stretch.append(n)
            (compared if n.op_type in COMPARISONS else inside).add(n.output[0])
            promoted.update(x for x in values if x not in inside and x not in floats and x not in sizes
                            and x not in masks)
    ok = {id(n) for n in stretch}
    if any(o.name in inside and o.name not in doubles for o in g.output):  # a float32 result torch returns too
        return model
    for n in g.node:
        if id(n) not in ok and _cast_to(n) != TensorProto.DOUBLE and n.op_type not in ("Shape", "Size") and \
                any(x in inside for x in n.input):  # (a shape read does not depend on the type)
            return model  # a float32 value the stretch makes is read by something else: left as exported
    for n in starts:
        next(a for a in n.attribute if a.name == "to").i = TensorProto.DOUBLE
    copies = _Copies(g, constants, floats, {**sizes, **masks}, numbers, promoted)
    for n in g.node:
        if id(n) in ok:
            for k, x in enumerate(n.input):
                if x in (_values(n) or ()) and (x in floats or x in sizes or x in masks or x in promoted):
                    n.input[k] = copies.of(x)
        copies.nodes.append(n)
    del g.node[:]
    g.node.extend(_live(copies.nodes, g, {*sizes, *masks}))
    for vi in (*g.value_info, *g.output):
        if vi.name in inside:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    return model


def sizes_in_double(model: onnx.ModelProto, numbers: Collection[float] = ()) -> onnx.ModelProto:
    """`model` with sizes' arithmetic cast to float64 computed in float64, in place: `x * x.shape[-1] ** -0.5` of a
    float64 x multiplies by a Python number torch computes in double, which both exporters write in float32 (the
    size cast to float32, the op on a float32 constant) and cast to float64 (1.7e-8 off torch's, relative). Each
    such Cast of 0-d values reads a float64 copy of what it cast (`_sizes`, its constants `_as_written`)."""
    g = model.graph
    if not any(_cast_to(n) == TensorProto.DOUBLE for n in g.node):
        return model
    types, constants, floats = _float32_sources(model)
    sizes = _sizes(g, types, floats)

    def scalar(x: str) -> bool:
        """Made of 0-d values only: a tensor cast to float32 (`indices.float() / 10`) is the module's own float32
        arithmetic, which torch computes in float32 too."""
        if x in constants:
            return not constants[x].attribute[0].t.dims
        n = sizes[x]
        if _cast_to(n) == TensorProto.FLOAT and n.input[0] not in sizes and n.input[0] not in constants:
            return types.get(n.input[0], (0, None))[1] == []
        return all(scalar(i) for i in n.input)

    ends = {n.output[0] for n in g.node if _cast_to(n) == TensorProto.DOUBLE and n.input[0] in sizes
            and scalar(n.input[0])}
    if not ends:
        return model
    copies = _Copies(g, constants, floats, sizes, numbers)
    for n in g.node:
        if n.output and n.output[0] in ends:
            n.input[0] = copies.of(n.input[0])
        copies.nodes.append(n)
    del g.node[:]
    g.node.extend(_live(copies.nodes, g, set(sizes)))
    return model


def _typed(model: onnx.ModelProto, types: dict, names: Iterable[str] | None) -> dict:
    """`types`, or the graph's inferred ones where one of `names` has none (the legacy exporter declares no
    intermediate tensors) or `names` is None: inference runs only for graphs that need it."""
    if names is not None and all(x in types for x in names):
        return types
    inferred = infer_shapes_safely(model)
    return types if inferred is None else tensor_types(inferred)


def numbers_in_double(model: onnx.ModelProto, outputs: Collection[str]) -> onnx.ModelProto:
    """`model` with these outputs (Python floats the forward returns, computed from sizes: `2 / x.shape[0]`) cast
    to float64, in place, for `sizes_in_double` to compute them so: the export wrote them in float32 (torch's
    0.6666666666666666 came back 0.6666666865348816)."""
    g = model.graph
    wanted = {o.name for o in g.output if o.name in outputs and o.type.tensor_type.elem_type == TensorProto.FLOAT}
    if not wanted:
        return model
    taken = names_in_use(g)
    renamed = {name: fresh_name(f"{name}/float32", taken) for name in wanted}
    rename_tensors(g, renamed)
    g.node.extend(helper.make_node("Cast", [renamed[name]], [name], to=TensorProto.DOUBLE) for name in wanted)
    for o in g.output:
        if o.name in wanted:
            o.type.tensor_type.elem_type = TensorProto.DOUBLE
    return model


def _float32_sources(model: onnx.ModelProto) -> tuple[dict, dict[str, onnx.NodeProto], set[str]]:
    """The graph's tensor types (inferred where a Cast to float32 reads an untyped tensor), its Constants by
    output, and the names of its float32 ones."""
    g = model.graph
    types = _typed(model, tensor_types(g), [n.input[0] for n in g.node if _cast_to(n) == TensorProto.FLOAT])
    constants = {n.output[0]: n for n in g.node if n.op_type == "Constant" and not n.domain and n.output}
    floats = {name for name, n in constants.items()
              if any(a.name == "value" and a.t.data_type == TensorProto.FLOAT for a in n.attribute)}
    return types, constants, floats


class _Copies:
    """float64 copies of float32 values, each made once, its nodes appended to `nodes` (the rewritten graph's, in
    order): a constant (of `floats`) at the decimal written (`_as_written`), a size or a comparison's mask cast to
    float32 (by the node that made it, of `made`) cast to float64 instead, an elementwise op of such copies."""

    def __init__(self, g: onnx.GraphProto, constants: dict[str, onnx.NodeProto], floats: set[str],
                 made: dict[str, onnx.NodeProto], numbers: Collection[float], promoted: Collection[str] = ()):
        self.constants, self.floats, self.made, self.numbers = constants, floats, made, numbers
        self.promoted = promoted
        self.taken = names_in_use(g)
        self.nodes: list[onnx.NodeProto] = []
        self.copies: dict[str, str] = {}

    def of(self, x: str) -> str:
        if x not in self.copies:
            n = self.made.get(x)
            if n is not None and _cast_to(n) == TensorProto.FLOAT and (n.input[0] in self.made or
                                                                      n.input[0] in self.floats):
                self.copies[x] = self.of(n.input[0])  # a float32 value cast to float32 (dynamo's)
                return self.copies[x]
            name = fresh_name(f"{x}/double", self.taken)
            if x in self.promoted:  # the module's own float32 value, which torch promotes
                self.nodes.append(helper.make_node("Cast", [x], [name], to=TensorProto.DOUBLE))
            elif n is None:
                value = _as_written(numpy_helper.to_array(self.constants[x].attribute[0].t), self.numbers)
                self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
            elif _cast_to(n) == TensorProto.FLOAT:
                self.nodes.append(helper.make_node("Cast", [n.input[0]], [name], to=TensorProto.DOUBLE))
            else:
                inputs = [self.of(i) for i in n.input]
                self.nodes.append(helper.make_node(n.op_type, inputs, [name], domain=n.domain))
                self.nodes[-1].attribute.extend(n.attribute)
            self.copies[x] = name
        return self.copies[x]


def _sizes(g: onnx.GraphProto, types: dict, floats: set[str]) -> dict[str, onnx.NodeProto]:
    """The nodes (by output) of float32 values made of integers cast to float32 (sizes the trace read) and float
    constants through elementwise ops, which a stretch may take in as it takes constants: the exporter writes
    `label_smoothing / classes` as a Reciprocal of the Cast of a Gather of the Shape, times a float32 constant."""
    made: dict[str, onnx.NodeProto] = {}
    for n in g.node:
        if n.domain or len(n.output) != 1:
            continue
        cast = _cast_to(n) == TensorProto.FLOAT and (types.get(n.input[0], (0,))[0] in INTEGERS or n.input[0] in made
                                                     or n.input[0] in floats)  # (dynamo casts float32 to float32)
        if cast or (n.op_type in ELEMENTWISE and any(x in made for x in n.input)
                     and all(x in made or x in floats for x in n.input)):
            made[n.output[0]] = n
    return made


def _live(nodes: list[onnx.NodeProto], g: onnx.GraphProto, made: set[str]) -> list[onnx.NodeProto]:
    """`nodes` without those of `made` (`_sizes`' float32 originals, masks' Casts) whose results nothing reads any
    more."""
    read = {o.name for o in g.output}
    keep: list[onnx.NodeProto] = []
    for n in reversed(nodes):
        if n.output and n.output[0] in made and n.output[0] not in read:
            continue
        read.update(n.input)
        keep.append(n)
    return keep[::-1]


def _as_written(value: np.ndarray, numbers: Collection[float] = ()) -> np.ndarray:
    """float32 constants in float64 as the Python number the module wrote: the one of `numbers` (the exported
    program's) that rounds to it, where exactly one does (math.log(2 * math.pi)), else the shortest decimal that
    rounds to it (0.01, not 0.009999999776482582)."""
    rounded: dict[float, set[float]] = {}
    for n in numbers:
        rounded.setdefault(float(np.float32(n)), set()).add(n)

    def written(v: np.float32) -> float:
        candidates = rounded.get(float(v), set())
        return next(iter(candidates)) if len(candidates) == 1 else float(np.format_float_scientific(v, unique=True))

    return np.array([written(v) for v in value.ravel()], dtype=np.float64).reshape(value.shape)


def numbers_in(nodes: Iterable[Any]) -> set[float]:
    """The Python floats among the arguments of a torch.fx graph's nodes (`ExportedProgram.graph.nodes`), in lists
    and tuples too: the numbers a dynamo export's float32 Constants were made from."""
    found: set[float] = set()

    def visit(a: Any) -> None:
        if isinstance(a, float):
            found.add(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    for n in nodes:
        visit(n.args)
        visit(n.kwargs)
    return found


@contextlib.contextmanager
def traced_numbers() -> Iterator[set[float]]:
    """While the block lasts, the float64 numbers of the legacy exporter's traces (the 0-d constants of its
    TorchScript graphs: `0.5`, `math.log(2 * math.pi)`) gathered into the set it yields, for `in_double`: the ONNX
    graph holds them rounded to float32. Under the export lock (it wraps the exporter's module-level function)."""
    import torch
    from torch.onnx._internal.torchscript_exporter import utils

    found: set[float] = set()
    create = utils._create_jit_graph

    def traced(*args: Any, **kwargs: Any) -> Any:
        result = create(*args, **kwargs)
        folded = result[0].copy()  # 0-d results of constants too (`w[y].sum()` of captured tensors), which the
        torch._C._jit_pass_constant_propagation(folded)  # exporter folds to float32 constants
        for n in (*result[0].nodes(), *folded.nodes()):
            if n.kind() == "prim::Constant" and n.hasAttribute("value") and n.kindOf("value") == "t":
                value = n.t("value")
                if value.numel() == 1 and value.dtype == torch.float64:  # (a float32 one is no Python number)
                    found.add(float(value.item()))
            elif n.kind() == "prim::Constant" and n.hasAttribute("value") and n.kindOf("value") == "f":
                found.add(n.f("value"))
        return result

    utils._create_jit_graph = traced
    try:
        yield found
    finally:
        utils._create_jit_graph = create


def constants_in_double(model: onnx.ModelProto, numbers: Collection[float] = ()) -> onnx.ModelProto:
    """After a dynamo export, in place: the Python numbers of float64 arithmetic read at the decimal written in
    float64. onnxscript writes `x * 2.7` of a float64 x as Mul(x, Cast(Constant(float32 2.7), to=DOUBLE)) (clamp's
    bounds, lerp's and where's scalars, addcmul's value, addmv's and softplus' beta as CastLike of a float32 Constant
    to x, the Constant's `value` or `value_float`): 1e-8 off torch's, relative. Each such Cast or CastLike to float64
    becomes the Identity of a float64 copy of the Constant (`_as_written`, read as the one of `numbers`, the
    exported program's Python floats, that rounds to it). addmm's alpha and beta, a float64 Gemm's float32
    attributes, become products by such copies (`_gemm_in_double`)."""
    g = model.graph
    constants = {n.output[0]: value for n in g.node if (value := _float32_constant(n)) is not None}
    gemms = {k for k, n in enumerate(g.node) if n.op_type == "Gemm" and not n.domain and _scaled(n)}
    if not constants and not gemms:
        return model
    types = tensor_types(g)
    types = _typed(model, types, None if gemms else
                   [n.input[1] for n in g.node if n.op_type == "CastLike" and n.input[0] in constants])
    taken = names_in_use(g)
    copies: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []

    def double(value: np.ndarray, base: str) -> str:
        name = fresh_name(f"{base}/double", taken)
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            _as_written(value, numbers), name)))
        return name

    for k, n in enumerate(g.node):
        to_double = _cast_to(n) == TensorProto.DOUBLE or (
            n.op_type == "CastLike" and not n.domain and types.get(n.input[1], (0,))[0] == TensorProto.DOUBLE)
        if to_double and n.input[0] in constants:
            if n.input[0] not in copies:
                copies[n.input[0]] = double(constants[n.input[0]], n.input[0])
            n.input[0] = copies[n.input[0]]
            del n.input[1:], n.attribute[:]
            n.op_type = "Identity"  # (a CastLike from float64 to float64: onnxruntime warns it cannot fold it)
        if k in gemms and types.get(n.output[0], (0,))[0] == TensorProto.DOUBLE:
            nodes.extend(_gemm_in_double(n, double, taken))
            continue
        nodes.append(n)
    del g.node[:]
    g.node.extend(_live(nodes, g, set(copies)))
    return model


def _float32_constant(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a float32 Constant (its `value` tensor or `value_float`), else None."""
    if node.op_type != "Constant" or node.domain or not node.output:
        return None
    for a in node.attribute:
        if a.name == "value" and a.t.data_type == TensorProto.FLOAT:
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, np.float32)
    return None


def _scaled(gemm: onnx.NodeProto) -> dict[str, float]:
    """A Gemm's alpha and beta where they are not 1 (float32 attributes)."""
    return {a.name: a.f for a in gemm.attribute if a.name in ("alpha", "beta") and a.f != 1.0}


def _gemm_in_double(gemm: onnx.NodeProto, double: Callable[[np.ndarray, str], str], taken: set[str]
                    ) -> list[onnx.NodeProto]:
    """A float64 Gemm's alpha and beta as products by float64 constants at the decimal written (`double` makes
    one, named from its second argument): alpha (A B) + beta C, torch's addmm."""
    scales = _scaled(gemm)
    y = gemm.output[0]
    product = fresh_name(f"{y}/product", taken)
    transposes = [a for a in gemm.attribute if a.name in ("transA", "transB")]
    nodes = [helper.make_node("Gemm", list(gemm.input[:2]), [product], name=f"{product}_node")]
    nodes[0].attribute.extend(transposes)
    terms = [product]
    if "alpha" in scales:
        terms[0] = fresh_name(f"{y}/scaled", taken)
        alpha = double(np.array(scales["alpha"], np.float32), f"{y}/alpha")
        nodes.append(helper.make_node("Mul", [product, alpha], [terms[0]], name=f"{terms[0]}_node"))
    if len(gemm.input) > 2 and gemm.input[2] and scales.get("beta", 1.0) != 0.0:
        c = gemm.input[2]
        if "beta" in scales:
            c = fresh_name(f"{y}/bias", taken)
            beta = double(np.array(scales["beta"], np.float32), f"{y}/beta")
            nodes.append(helper.make_node("Mul", [gemm.input[2], beta], [c], name=f"{c}_node"))
        terms.append(c)
    nodes.append(helper.make_node("Add" if len(terms) == 2 else "Identity", terms, [y], name=gemm.name or f"{y}_node"))
    return nodes
