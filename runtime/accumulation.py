"""`index_add` and `index_put(accumulate=True)` exported as scatters that add, so repeated indices sum.

The legacy exporter writes both as a scatter of the values into zeros (or into `self`) without a reduction,
then an Add: where an index repeats (a graph network summing messages into their target nodes with
`out.index_add_(0, dst, msg)`, a histogram with `index_put_(..., accumulate=True)`), onnxruntime keeps one of the
values and drops the others, a wrong result without an error (torch only refuses repeats it can see in a
constant index, and ORTModule's export folds no constants). From opset 16, ScatterElements and ScatterND add
what they scatter (`reduction="add"`), which is what torch computes; below it torch's own symbolics stay.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.onnx._internal.torchscript_exporter import symbolic_helper, symbolic_opset11

from .symbolics import const_like, registered, with_attributes

OPSET = 16
"""The first opset whose scatters take `reduction="add"`."""


def _index_add(g: Any, self: Any, dim: Any, index: Any, source: Any, alpha: Any = None) -> Any:
    """self with source's slices added at index along dim: ScatterElements(add) of source at the index
    broadcast over source's other dims."""
    rank = symbolic_helper._get_tensor_rank(self)
    if not rank:
        return symbolic_helper._unimplemented("index_add", "a self tensor of unknown rank or a 0-d one", self)
    dim = symbolic_helper._get_const(dim, "i", "dim")
    dim = dim + rank if dim < 0 else dim
    source_rank = symbolic_helper._get_tensor_rank(source)
    if source_rank is not None and source_rank < rank:  # a 0-d source for a 1-d self
        source = symbolic_helper._unsqueeze_helper(g, source, list(range(source_rank, rank)))
    factor = 1.0 if alpha is None else symbolic_helper._maybe_get_scalar(alpha)
    if symbolic_helper._is_value(factor):  # alpha computed in the graph
        source = g.op("Mul", source, g.op("CastLike", factor, source))
    elif float(factor) != 1:
        source = g.op("Mul", source, const_like(g, float(factor), source))
    along = g.op("Constant", value_t=torch.tensor([-1 if i == dim else 1 for i in range(rank)]))
    index = g.op("Expand", symbolic_helper._reshape_helper(g, index, along), g.op("Shape", source))
    return g.op("ScatterElements", self, index, source, axis_i=dim, reduction_s="add")


def _index_put(g: Any, self: Any, indices: Any, values: Any, accumulate: Any = False) -> Any:
    """torch's own symbolic, its scatter adding when accumulating. A single boolean mask names each element
    once, and torch's symbolic then overwrites (masked_scatter): the values go into zeros, added to self."""
    if not symbolic_helper._parse_arg(accumulate, "b"):
        return symbolic_opset11.index_put(g, self, indices, values, accumulate)
    listed = symbolic_helper._unpack_list(indices) if symbolic_helper._is_packed_list(indices) else [indices]
    if len(listed) == 1 and symbolic_helper._is_bool(listed[0]):
        zeros = g.op("CastLike", g.op("ConstantOfShape", g.op("Shape", self)), self)
        return g.op("Add", self, symbolic_opset11.index_put(g, zeros, indices, values, False))
    return symbolic_opset11.index_put(with_attributes(g, "ScatterND", reduction_s="add"), self, indices, values,
                                      accumulate)


def exported_accumulation() -> contextlib.AbstractContextManager[None]:
    """The two symbolics registered while the block lasts (from `OPSET`)."""
    return registered({"aten::index_add": _index_add, "aten::index_put": _index_put}, OPSET)
