"""onnx's shape inference, with the pool sizes it gets wrong in ceil mode computed as ONNX defines them.

ONNX's MaxPool, AveragePool and LpPool drop a last window that would start in the end padding ("sliding windows
that would start in the right padded region are ignored", as torch does), and onnxruntime computes them so. onnx's
shape inference (1.23) does not: MaxPool(kernel 2, stride 2, pads 1, ceil_mode 1) over 5 rows gives 3 rows in
torch and onnxruntime and 4 in onnx's inference. A strict inference then reports a conflict further on (the
Gemm after a Flatten) and refuses a valid model; a lenient one hands every later shape out wrong.

`infer_shapes` runs inference with each such pool seen as the floor-mode pool of the same windows
(`as_floor_mode`: ceil_mode 0, the end pad cut to where the last window ends), which onnx sizes right, and hands
back the graph with the pool as it was. The pool's input size must be known for that, so the pools are sized in
lenient rounds first, each round giving later pools their input sizes. onnxruntime's own inference has the same
fault (it refuses such a graph where a Gemm's weight fixes the size), so the runtime gives it the floor-mode
pools themselves: the same windows and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import onnx

POOLS = frozenset({"MaxPool", "AveragePool", "LpPool"})


_P = TypeVar("_P", onnx.NodeProto, onnx.ValueInfoProto)


def infer_shapes(model: onnx.ModelProto, *, strict: bool = False, data_prop: bool = False) -> onnx.ModelProto:
    """onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=data_prop), ceil-mode pools
    sized as ONNX defines them, and declarations with an empty type (`type {}`, which stops onnx's inference
    for the whole graph without a word) read as no declaration. Graph outputs that are initializers are left out
    while it runs: onnx then reads such an initializer as absent where a node takes it as a constant (a Slice's
    axes: [2, 3] instead of [8, 2], replay seed 187). `model` is patched while inference runs and restored
    before this returns."""
    g = model.graph
    constants = {t.name for t in g.initializer}
    outputs = [_copy(vi) for vi in g.output] if any(vi.name in constants for vi in g.output) else None
    if outputs is not None:  # put back whole, after the empty types below
        del g.output[:]
        g.output.extend(vi for vi in outputs if vi.name not in constants)
    empty = []
    for vi in (*g.input, *g.output, *g.value_info):
        if vi.HasField("type") and vi.type.WhichOneof("value") is None:
            saved = onnx.TypeProto()
            saved.CopyFrom(vi.type)  # with any fields this onnx does not know
            empty.append((vi, saved))
            vi.ClearField("type")
    try:
        inferred = _infer_pools(model, strict, data_prop)
    finally:
        for vi, saved in empty:
            vi.type.CopyFrom(saved)
        if outputs is not None:
            del g.output[:]
            g.output.extend(outputs)
    if outputs is not None:  # the outputs in their order, those left out as declared
        typed = {vi.name: vi for vi in inferred.graph.output}
        order = [_copy(typed.get(vi.name, vi)) for vi in outputs]
        del inferred.graph.output[:]
        inferred.graph.output.extend(order)
    return inferred


def _infer_pools(model: onnx.ModelProto, strict: bool, data_prop: bool) -> onnx.ModelProto:
    nodes = model.graph.node
    ceil = ceil_mode_pools(nodes)
    if not ceil:
        return onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=data_prop)
    originals = {i: _copy(nodes[i]) for i in ceil}
    try:
        for _ in range(len(ceil)):  # each round sizes at least the first pool whose input size was unknown
            graph = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=data_prop).graph
            dims = static_dims(graph)
            changed = False
            for i in ceil:
                size = dims.get(originals[i].input[0]) if originals[i].input else None
                floor = as_floor_mode(originals[i], size) if size else None
                if floor is not None and floor != nodes[i]:
                    nodes[i].CopyFrom(floor)
                    changed = True
            if not changed:
                break
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=strict, data_prop=data_prop)
    finally:
        for i, node in originals.items():
            nodes[i].CopyFrom(node)
    for i, node in originals.items():
        inferred.graph.node[i].CopyFrom(node)
    return inferred


def _copy(proto: _P) -> _P:
    out = type(proto)()
    out.CopyFrom(proto)
    return out


def ceil_mode_pools(nodes: Sequence[onnx.NodeProto]) -> list[int]:
    """Positions of the pools in ceil mode among `nodes`."""
    return [i for i, n in enumerate(nodes) if n.op_type in POOLS and n.domain in ("", "ai.onnx")
            and any(a.name == "ceil_mode" and a.i for a in n.attribute)]


Dims = list[int | str | None]
"""A tensor's dims: a size, a symbol's name, or None where unknown."""


def declared_dims(vi: onnx.ValueInfoProto) -> Dims | None:
    """A tensor declaration's dims, or None without a shape."""
    t = vi.type.tensor_type
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in t.shape.dim] if t.HasField("shape") else None


def tensor_types(graph: onnx.GraphProto) -> dict[str, tuple[int, Dims | None]]:
    """(element type, dims or None without a shape) of every graph input, value_info and output; a graph input's
    own declaration over an output's naming the same tensor (the input is what is fed)."""
    return {vi.name: (vi.type.tensor_type.elem_type, declared_dims(vi))
            for vi in (*graph.value_info, *graph.output, *graph.input)}


def static_dims(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """The dims of every shaped tensor `tensor_types` lists, None for a symbolic or unknown one."""
    return {name: [d if isinstance(d, int) else None for d in dims]
            for name, (_, dims) in tensor_types(graph).items() if dims is not None}


def as_floor_mode(node: onnx.NodeProto, size: Sequence[int | None]) -> onnx.NodeProto | None:
    """The floor-mode pool of `node`'s windows over an input of `size`, where `node` (ceil mode) drops a last
    window that would start in the end padding; None where it drops none (onnx sizes it right), the spatial
    sizes are unknown or the pads are not explicit.

    Each end pad becomes where the last window ends: the same windows. On an axis that drops a window that is
    before the old end pad; on another it can be past it, where a ceil-mode window reached past the padding:
    the same values for MaxPool and LpPool, which ignore padding or add its zeros, and for an AveragePool that
    does not count padding (`same_values` tells)."""
    attrs = {a.name: a for a in node.attribute}
    if "auto_pad" in attrs and attrs["auto_pad"].s not in (b"", b"NOTSET"):
        return None
    kernel = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else []
    spatial = size[2:]
    r = len(kernel)
    if not r or len(spatial) != r or any(n is None for n in spatial):
        return None
    strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * r
    dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * r
    pads = list(attrs["pads"].ints) if "pads" in attrs else [0] * (2 * r)
    if len(strides) != r or len(dilations) != r or len(pads) != 2 * r or min(strides + dilations) < 1:
        return None  # malformed: left to inference and the checks that report it
    ends = list(pads[r:])
    drops = False
    for i, (n, k, s, d) in enumerate(zip(spatial, kernel, strides, dilations)):
        span = d * (k - 1) + 1
        begin, end = pads[i], pads[r + i]
        extent = n + begin + end - span  # negative for a kernel past the padded input: one window in ceil mode
        out = -(-extent // s) + 1
        if out < 0:
            return None
        if (out - 1) * s >= n + begin:  # the last window would start in the end padding: ONNX drops it
            out -= 1
            drops = True
        ends[i] = max((out - 1) * s + span - n - begin, 0)  # floor((n + begin + end' - span) / s) + 1 == out
    if not drops:
        return None
    floor = _copy(node)
    for a in floor.attribute:
        if a.name == "ceil_mode":
            a.i = 0
        elif a.name == "pads":
            del a.ints[:]
            a.ints.extend(pads[:r] + ends)
    if "pads" not in attrs:
        floor.attribute.append(onnx.helper.make_attribute("pads", [0] * r + ends))
    return floor


def same_values(ceil: onnx.NodeProto, floor: onnx.NodeProto) -> bool:
    """Whether `floor` (`as_floor_mode(ceil, ...)`) computes `ceil`'s values, not only its sizes: not for an
    AveragePool counting padding whose end pad grew (its last windows would count more padded positions)."""
    if ceil.op_type != "AveragePool" or not any(a.name == "count_include_pad" and a.i for a in ceil.attribute):
        return True
    r = len(_ints(floor, "kernel_shape"))
    old, new = _ints(ceil, "pads") or [0] * (2 * r), _ints(floor, "pads")
    return all(b <= a for a, b in zip(old[r:], new[r:]))


def _ints(node: onnx.NodeProto, name: str) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == name), [])
