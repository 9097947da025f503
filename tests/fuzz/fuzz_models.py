"""The fuzzing property, its seed models, and the structural mutator that turns a valid model into a subtly
broken one.

Byte-level mutation alone mostly produces protobufs that do not parse; rewiring names, swapping op types and
changing attributes, types and opsets gets past the parser and into validation, reachability and the rules.
Imported by the atheris harness (fuzz_build.py) and by test_fuzz.py; it needs no atheris itself.
"""

from __future__ import annotations

import contextlib
import random
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for clihelpers when run as a script

from clihelpers import f32, make_model, tiny, with_loss

from gradbuilder import build_gradient_graph, split
from gradbuilder.errors import GradBuilderError
from gradbuilder.inspect_model import inspect_model


def check(data: bytes) -> None:
    """The property: model bytes are either built into a splittable training graph (a valid one whenever the
    input is valid ONNX) or refused with a GradBuilderError; inspect and split likewise (mutated training graphs
    are seeds too). Anything else is a bug."""
    with contextlib.suppress(GradBuilderError):
        inspect_model(data)
    with contextlib.suppress(GradBuilderError):
        split(data)
    try:
        training = build_gradient_graph(data)
    except GradBuilderError:
        return
    split(training)
    if _valid_onnx(data):
        onnx.checker.check_model(training)


def _valid_onnx(data: bytes) -> bool:
    try:
        onnx.checker.check_model(data)
    except Exception:
        return False
    return True


def mlp() -> onnx.ModelProto:
    """Gemm -> Relu -> MatMul -> Softmax -> ReduceMean: a scalar loss over dynamic batch."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 4])
    loss = helper.make_tensor_value_info("loss", TP.FLOAT, [])
    rng = np.random.default_rng(0)
    inits = [f32("W1", rng.standard_normal((4, 5))), f32("b1", rng.standard_normal(5)),
             f32("W2", rng.standard_normal((5, 3))),
             onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "axes")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1", alpha=1.0, transB=0),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W2"], ["z"], name="fc2"),
             helper.make_node("Softmax", ["z"], ["p"], name="softmax", axis=-1),
             helper.make_node("ReduceMean", ["p", "axes"], ["loss"], name="mean", keepdims=0)]
    return make_model(nodes, [x], [loss], inits, opset=18)


def shapes() -> onnx.ModelProto:
    """Reshape / Transpose / Concat / Slice / Gather with constant shape inputs, the rules' const_input path."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [2, 6])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [2, 2])
    i64 = lambda name, v: onnx.numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [f32("W", np.ones((2, 6))), i64("shape", [3, 4]), i64("starts", [0]), i64("ends", [2]),
             i64("axes1", [1]), i64("idx", [2, 0])]
    nodes = [helper.make_node("Mul", ["x", "W"], ["m"], name="scale"),
             helper.make_node("Reshape", ["m", "shape"], ["r"], name="reshape"),
             helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0]),
             helper.make_node("Concat", ["t", "t"], ["c"], name="concat", axis=0),
             helper.make_node("Slice", ["c", "starts", "ends", "axes1"], ["s"], name="slice"),
             helper.make_node("Gather", ["s", "idx"], ["g"], name="gather", axis=0),
             helper.make_node("Tanh", ["g"], ["y"], name="tanh")]
    return make_model(nodes, [x], [y], inits)


def branchy() -> onnx.ModelProto:
    """An If off the gradient path (its branches read only x) beside y = x * W."""
    def branch(op: str, out: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["x"], [out])], f"{op}_branch", [],
                                 [helper.make_tensor_value_info(out, TP.FLOAT, [3])])

    inputs = [helper.make_tensor_value_info("c", TP.BOOL, []), helper.make_tensor_value_info("x", TP.FLOAT, [3])]
    outputs = [helper.make_tensor_value_info("y", TP.FLOAT, [3]), helper.make_tensor_value_info("z", TP.FLOAT, [3])]
    nodes = [helper.make_node("If", ["c"], ["z"], name="branchy", then_branch=branch("Identity", "a"),
                              else_branch=branch("Neg", "b")),
             helper.make_node("Mul", ["x", "W"], ["y"], name="mul")]
    return make_model(nodes, inputs, outputs, [f32("W", [1, 2, 3])])


def seeds() -> dict[str, onnx.ModelProto]:
    return {"tiny": tiny(), "loss": with_loss(), "mlp": mlp(), "shapes": shapes(), "branchy": branchy()}


def training_seeds() -> dict[str, onnx.ModelProto]:
    """Training graphs of two seeds, so that damaged training graphs reach split and inspect."""
    return {"tiny-training": build_gradient_graph(tiny()),
            "loss-training": build_gradient_graph(with_loss(), loss="loss", outputs=["y"])}


# --------------------------------------------------------------------------------------------------
# structural mutation

OPS = ["Add", "Sub", "Mul", "Div", "Relu", "Neg", "Exp", "Log", "Tanh", "Sigmoid", "MatMul", "Gemm", "Softmax",
       "ReduceSum", "ReduceMean", "Reshape", "Transpose", "Concat", "Slice", "Gather", "Identity", "Cast", "Where",
       "Pow", "Sqrt", "Max", "Min", "Clip", "Expand", "Squeeze", "Unsqueeze", "Flatten", "Split", "Pad", "Tile",
       "Einsum", "LayerNormalization", "Conv", "BatchNormalization", "Dropout", "If", "Loop", "Scan", "Frobnicate"]
ATTRS = ["axis", "axes", "keepdims", "perm", "to", "alpha", "beta", "transA", "transB", "mode", "equation",
         "epsilon", "noop_with_empty_axes", "allowzero", "split", "pads", "group", "kernel_shape", "strides"]
DTYPES = [TP.FLOAT, TP.DOUBLE, TP.FLOAT16, TP.BFLOAT16, TP.INT64, TP.INT32, TP.BOOL, TP.STRING, TP.UINT8, 0, 999]


def _attr_value(r: random.Random, kind: int | None = None) -> object:
    """A value for an attribute of type `kind` (AttributeProto type; any when None), edge cases first."""
    A = onnx.AttributeProto
    kind = kind if kind is not None else r.choice([A.INT, A.INTS, A.FLOAT, A.STRING, A.FLOATS, A.TENSOR, A.GRAPH])
    if kind == A.INT:
        return r.choice([-3, -2, -1, 0, 1, 2, 3, 7, 2**40])
    if kind == A.INTS:
        return [r.choice([-2, -1, 0, 1, 2, 3, 5]) for _ in range(r.randrange(1, 5))]
    if kind == A.FLOAT:
        return r.choice([0.0, -1.5, 0.5, 1e30, float("nan"), float("inf")])
    if kind == A.STRING:
        return r.choice(["", "constant", "reflect", "ij,jk->ik", "...i,...i->...", "tanh", "NOTSET", "ß"])
    if kind == A.FLOATS:
        return [r.random() for _ in range(r.randrange(1, 4))]
    if kind == A.TENSOR:
        return f32("t", r.random())
    return helper.make_graph([], "empty", [], [])


def _mutate_attribute(node: onnx.NodeProto, opset: int, r: random.Random) -> None:
    """Set, change or drop one attribute, mostly one the op's schema knows, with a value of its type."""
    try:
        known = onnx.defs.get_schema(node.op_type, opset, node.domain).attributes
    except Exception:  # not an ONNX op (or not at this opset): any name will do
        known = {}
    if known and r.random() < 0.9:
        name = r.choice(sorted(known))
        kind: int | None = int(known[name].type)
    else:
        name, kind = r.choice(ATTRS), None
    for k, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[k]
            break
    if r.random() < 0.85:
        node.attribute.append(helper.make_attribute(name, _attr_value(r, kind)))


def _change_op(node: onnx.NodeProto, opset: int, r: random.Random) -> None:
    """Another op on the same edges, usually with the attributes its schema requires."""
    node.op_type = r.choice(OPS)
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except Exception:
        return
    if r.random() < 0.8:
        kept = [a for a in node.attribute if a.name in schema.attributes]
        del node.attribute[:]
        node.attribute.extend(kept)
        for name, a in sorted(schema.attributes.items()):
            if a.required and name not in {x.name for x in kept}:
                node.attribute.append(helper.make_attribute(name, _attr_value(r, int(a.type))))


def _names(m: onnx.ModelProto, before: int | None = None) -> list[str]:
    """Tensor names defined by the inputs, initializers and the nodes before index `before` (all by default)."""
    g = m.graph
    names = [i.name for i in g.input] + [t.name for t in g.initializer]
    names += [o for n in g.node[:before] for o in n.output]
    return names or ["x"]


def _insert_on_edge(m: onnx.ModelProto, r: random.Random) -> None:
    """Put a random op on one input edge of a node, its other inputs defined earlier: usually still valid."""
    nodes = m.graph.node
    k = r.randrange(len(nodes))
    node = nodes[k]
    if not node.input:
        return
    i = r.randrange(len(node.input))
    earlier = _names(m, k)
    ins = [node.input[i] or r.choice(earlier)] + [r.choice(earlier) for _ in range(r.choice([0, 0, 1, 1, 2]))]
    new = helper.make_node(r.choice(OPS), ins, [f"e{len(nodes)}_{r.randrange(1000)}"], name=f"fz{len(nodes)}")
    node.input[i] = new.output[0]
    nodes.insert(k, new)


def _constant_values(m: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [a.t for n in m.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]


TYPED_FIELDS = {TP.FLOAT: "float_data", TP.DOUBLE: "double_data", TP.INT64: "int64_data", TP.INT32: "int32_data",
                TP.BOOL: "int32_data", TP.FLOAT16: "int32_data", TP.UINT64: "uint64_data"}


def _typed_values(t: onnx.TensorProto, r: random.Random) -> None:
    """`t`'s values moved out of raw_data into the typed field its type uses; onnx's checker does not count them."""
    field = TYPED_FIELDS.get(t.data_type)
    if field is None:
        return
    count = max(0, int(np.prod(t.dims)) + r.choice([0, 0, -1, 1, 3]))
    t.ClearField("raw_data")
    for f in set(TYPED_FIELDS.values()):
        t.ClearField(f)
    getattr(t, field).extend([r.randrange(3) for _ in range(min(count, 64))])


def mutate(m: onnx.ModelProto, r: random.Random) -> None:
    """One random structural change, in place; the kinds that keep a model valid are the likely ones."""
    g = m.graph
    nodes = g.node
    kind = r.choices(range(15), weights=[3, 1, 4, 1, 0.3, 0.3, 1, 2, 2, 0.5, 0.5, 0.3, 0.3, 0.5, 5])[0]
    node = nodes[r.randrange(len(nodes))] if nodes else None
    if kind == 0 and node is not None:
        _change_op(node, m.opset_import[0].version if m.opset_import else 17, r)
    elif kind == 1 and node is not None and node.input:
        node.input[r.randrange(len(node.input))] = r.choice([*_names(m), "", "ghost"])
    elif kind == 2 and node is not None:
        _mutate_attribute(node, m.opset_import[0].version if m.opset_import else 17, r)
    elif kind == 3 and node is not None:
        node.input.append(r.choice([*_names(m), ""]))
    elif kind == 4 and len(nodes) > 1:
        i, j = r.randrange(len(nodes)), r.randrange(len(nodes))
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(nodes[i])
        b.CopyFrom(nodes[j])
        nodes[i].CopyFrom(b)
        nodes[j].CopyFrom(a)
    elif kind == 5 and node is not None:
        nodes.remove(node)
    elif kind == 6:
        new = helper.make_node(r.choice(OPS), [r.choice(_names(m)) for _ in range(r.randrange(1, 4))],
                               [f"n{len(nodes)}"], name=f"fz{len(nodes)}")
        nodes.append(new)
        if r.random() < 0.7:
            g.output.append(helper.make_empty_tensor_value_info(new.output[0]))
    elif kind == 7:
        vis = [*g.input, *g.output, *g.value_info]
        if vis:
            vi = r.choice(vis)
            tt = vi.type.tensor_type
            tt.elem_type = r.choice(DTYPES)
            if r.random() < 0.5:
                tt.ClearField("shape")
                for _ in range(r.randrange(4)):
                    d = tt.shape.dim.add()
                    if r.random() < 0.3:
                        d.dim_param = "n"
                    else:  # the last two: onnx's 32-bit dimensions wrap, and its inference aborts on negatives
                        d.dim_value = r.choice([0, 1, 2, 3, 5, 0, 1, 2, 3, 5, -1, 2**31])
    elif kind == 8 and (tensors := [*g.initializer, *_constant_values(m)]):
        t = r.choice(tensors)
        change = r.randrange(5)
        if change == 0:
            t.data_type = r.choice(DTYPES)
        elif change == 1:
            t.dims.append(r.choice([0, 1, 2, 3]))
        elif change == 2:
            del t.dims[:]
        elif change == 3:
            t.raw_data = bytes(r.randrange(256) for _ in range(r.randrange(16)))
        else:  # the values in the field of their type, as many as the shape takes or a few more or fewer
            _typed_values(t, r)
    elif kind == 9:
        version = r.choice([7, 12, 13, 14, 15, 17, 18, 21, 23, 24, 99])
        if r.random() < 0.2:  # a second entry for the domain: tools disagree on which one counts
            m.opset_import.append(helper.make_opsetid(m.opset_import[0].domain if m.opset_import else "", version))
        elif m.opset_import:
            m.opset_import[0].version = version
    elif kind == 10 and g.output:
        out = r.choice(g.output)
        if r.random() < 0.3:
            g.output.remove(out)
        else:
            out.name = r.choice(_names(m))
    elif kind == 11 and node is not None:
        node.domain = r.choice(["", "com.example", "ai.onnx", "ai.gradbuilder", "ai.onnx.ml"])
    elif kind == 12 and node is not None and node.output:
        node.output[r.randrange(len(node.output))] = r.choice([*_names(m), "", "fresh"])
    elif kind == 13 and node is not None:
        node.output.append(f"extra{r.randrange(3)}")
    elif kind == 14 and nodes:
        _insert_on_edge(m, r)


def mutate_bytes(data: bytes, seed: int, rounds: int = 3) -> bytes | None:
    """Parse, apply a few structural mutations, serialize; None when the bytes are not a model."""
    m = onnx.ModelProto()
    try:
        m.ParseFromString(data)
    except Exception:
        return None
    r = random.Random(seed)
    for _ in range(r.randrange(1, rounds + 1)):
        try:
            mutate(m, r)
        except Exception:  # e.g. a value helper.make_attribute refuses: skip this mutation
            continue
    return m.SerializeToString()


if __name__ == "__main__":  # reproduce a find: python tests/fuzz/fuzz_models.py crash.onnx
    check(Path(sys.argv[1]).read_bytes())
    print(f"{sys.argv[1]}: refused with a GradBuilderError or built, split and checked: no bug")
