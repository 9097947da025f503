"""torch's random fills with parameters, `bernoulli_(p)`, `normal_(mean, std)` and `uniform_(a, b)`, exported
as onnxruntime's random ops that say which fill they stand for.

The ONNX forms lose what torch drew: `x.bernoulli_(p)` exports as `Less(RandomUniformLike(x), p)`, as
`torch.rand_like(x) < p` does, but torch draws the two differently in float32 (its Bernoulli kernel is not its
uniforms compared), and the ops' float attributes are float32 (a float64 `normal_(0, 0.1)` read back as
0.10000000149). Under `torch_dropout` the host draws such ops as torch does (`host_dropout`), so it must know.
Both exporters go through ours (`symbolics`, `dynamo_translations`): each fill becomes one marker node (`OP_TYPE`
in gradbuilder's domain) holding torch's fill and its parameters in float64, which `expand` replaces after the
export by the random op, tagged with them in its metadata (`KEY`; read back by `tagged`).

Besides: the legacy exporter's own `normal` wrote a float32 tensor's noise in float64 (a Mul of two types, which
onnxruntime refused to load), and neither exporter converted `uniform_`."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
from onnx import defs, helper

from gradbuilder.graph import graph_nodes
from gradbuilder.stop_gradient import register_identity_schema
from gradbuilder.yield_op import DOMAIN

from .passes import FLOATS, fresh_name, names_in_use

OP_TYPE = "TorchDraw"
"""The marker: input a tensor of the fill's shape and element type; attributes `fill`, `params` (float64) and
`dtype` (the ONNX element type of the result)."""

_attribute = defs.OpSchema.Attribute
register_identity_schema(OP_TYPE, "torch's fill of a tensor shaped and typed as its input (expanded after the export).",
                         [_attribute("fill", defs.OpSchema.AttrType.STRING,
                                     "bernoulli_, normal_, uniform_ or exponential_"),
                          _attribute("params", defs.OpSchema.AttrType.TENSOR, "its numbers, float64"),
                          _attribute("dtype", defs.OpSchema.AttrType.INT, "the input's element type")])

KEY = "gradbuilder.torch_draw"
"""The metadata key of an expanded draw: torch's fill and its parameters, as `Draw` writes them."""

UNDER = "gradbuilder.under_torch_draw"
"""The metadata key of a random op an expanded draw computes from (exponential_'s uniforms), valued the draw's
output: where the host feeds that output, the op is unread and not drawn."""

class Draw(NamedTuple):
    """One of torch's fills: `torch.empty(shape, dtype).<fill>(a, b)` (`bernoulli_` and `exponential_` take a
    alone)."""

    fill: str
    a: float
    b: float = 0.0

    def tag(self) -> str:
        return f"{self.fill} {self.a!r} {self.b!r}"


def tagged(node: onnx.NodeProto) -> Draw | None:
    """The fill an expanded random op stands for; None for one that is not (torch's own randn_like, rand_like)."""
    for p in node.metadata_props:
        if p.key == KEY:
            fill, a, b = p.value.split()
            return Draw(fill, float(a), float(b))
    return None


def under_a_draw(node: onnx.NodeProto) -> str | None:
    """The output of the expanded draw `node` is a random op of (`UNDER`), or None."""
    return next((p.value for p in node.metadata_props if p.key == UNDER), None)


def expand(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each marker (in bodies too) replaced by the ops it stands for, in place: bernoulli_ as
    `Cast(Less(RandomUniformLike(x), p))` (the legacy exporter's form), normal_ as `RandomNormalLike(x, mean,
    scale)`, uniform_ as `RandomUniformLike(x, low, high)`, the random op tagged (`KEY`); exponential_ as
    `Log(1 - RandomUniformLike(x)) / -rate`, the quotient tagged."""
    if not any(_is_marker(n) for n in graph_nodes(model.graph)):
        return model
    taken = names_in_use(model.graph)
    for g in _graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            nodes.extend(_expanded(n, taken) if _is_marker(n) else [n])
        del g.node[:]
        g.node.extend(nodes)
    return model


def _graphs(g: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [g]
    for n in g.node:
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                found.extend(_graphs(sub))
    return found


def _is_marker(n: onnx.NodeProto) -> bool:
    return n.op_type == OP_TYPE and n.domain == DOMAIN


def _expanded(n: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    fill = attrs["fill"].decode()
    params = [float(v) for v in onnx.numpy_helper.to_array(attrs["params"]).ravel()]
    dtype = int(attrs["dtype"])
    draw = Draw(fill, *params)
    x, y = n.input[0], n.output[0]
    if fill == "normal_":
        random = helper.make_node("RandomNormalLike", [x], [y], name=fresh_name(f"{y}/normal", taken), dtype=dtype,
                                  mean=draw.a, scale=draw.b)
        extra: list[onnx.NodeProto] = []
    elif fill == "exponential_":  # -log(1 - u) / rate (finite: u < 1); the host feeds the quotient (`host_dropout`)
        u, one, rest, logged, rate = (fresh_name(f"{y}/{part}", taken) for part in ("uniform", "one", "rest", "log",
                                                                                   "rate"))
        numpy_type = helper.tensor_dtype_to_np_dtype(dtype)
        uniforms = helper.make_node("RandomUniformLike", [x], [u], name=f"{u}_node", dtype=dtype)
        uniforms.metadata_props.add(key=UNDER, value=y)
        nodes = [uniforms,
                 helper.make_node("Constant", [], [one], name=f"{one}_node",
                                  value=onnx.numpy_helper.from_array(np.array(1, numpy_type))),
                 helper.make_node("Sub", [one, u], [rest], name=f"{rest}_node"),
                 helper.make_node("Log", [rest], [logged], name=f"{logged}_node"),
                 helper.make_node("Constant", [], [rate], name=f"{rate}_node",
                                  value=onnx.numpy_helper.from_array(np.array(-draw.a, numpy_type)))]
        random = helper.make_node("Div", [logged, rate], [y], name=fresh_name(f"{y}/exponential", taken))
        random.metadata_props.add(key=KEY, value=draw.tag())
        return [*nodes, random]
    else:
        u = y if fill == "uniform_" else fresh_name(f"{y}/uniform", taken)
        low, high = (draw.a, draw.b) if fill == "uniform_" else (0.0, 1.0)
        floating = dtype if dtype in FLOATS else onnx.TensorProto.FLOAT  # a boolean or integer tensor's bernoulli_
        random = helper.make_node("RandomUniformLike", [x], [u], name=fresh_name(f"{u}/node", taken),
                                  dtype=floating, low=low, high=high)
        extra = [] if fill == "uniform_" else _below(u, draw.a, floating, dtype, y, taken)
    random.metadata_props.add(key=KEY, value=draw.tag())
    return [random, *extra]


def _below(u: str, p: float, floating: int, dtype: int, y: str, taken: set[str]) -> list[onnx.NodeProto]:
    """y = (u < p) in `dtype`: a Bernoulli draw of the uniforms u (of type `floating`)."""
    p_name, less = fresh_name(f"{y}/p", taken), fresh_name(f"{y}/kept", taken)
    p_value = np.array(p, helper.tensor_dtype_to_np_dtype(floating))
    return [helper.make_node("Constant", [], [p_name], name=f"{p_name}_node",
                             value=onnx.numpy_helper.from_array(p_value)),
            helper.make_node("Less", [u, p_name], [less], name=f"{less}_node"),
            helper.make_node("Cast", [less], [y], name=f"{y}/cast", to=dtype)]
