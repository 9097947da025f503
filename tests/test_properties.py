"""Property-based tests: random well-formed forward graphs, random choices of what to differentiate.

For each generated graph the training graph must pass the full checker, run on onnxruntime, agree with
central finite differences along a random direction (<t, J^T c> == <J t, c>), and keep the builder's
invariants. `HYPOTHESIS_PROFILE=large` runs many more examples than CI does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from harness import Trainer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import gradbuilder
from gradbuilder.yield_op import find_yield, read_yield

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("large", max_examples=1500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

D = TensorProto.DOUBLE
OPSET = 17


@dataclass
class Graph:
    """A forward graph under construction: every tensor with its static shape and whether it is float."""

    nodes: list = field(default_factory=list)
    inits: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    floats: list = field(default_factory=list)
    others: list = field(default_factory=list)
    n: int = 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}{self.n}"

    def add(self, op: str, ins: list[str], shape: tuple[int, ...], is_float: bool = True, **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, ins, [out], **attrs))
        self.shapes[out] = shape
        (self.floats if is_float else self.others).append(out)
        return out


def _param(draw, g: Graph, shape: tuple[int, ...], rng: np.random.Generator) -> str:
    name = g.name("w")
    g.inits[name] = rng.standard_normal(shape)
    g.shapes[name] = shape
    g.floats.append(name)
    return name


def _broadcastable(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against `shape`: trailing dims kept or set to 1, some leading dims dropped."""
    drop = draw(st.integers(0, len(shape)))
    return tuple(d if draw(st.booleans()) else 1 for d in shape[drop:])


def _fits(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether `small` broadcasts to exactly `shape`."""
    try:
        return np.broadcast_shapes(small, shape) == shape
    except ValueError:
        return False


@st.composite
def graphs(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    g = Graph()
    b, f = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    x = "x"
    g.inputs[x] = (b, f)
    g.shapes[x] = (b, f)
    g.floats.append(x)
    _param(draw, g, (f,), rng)
    for _ in range(draw(st.integers(2, 9))):
        a = draw(st.sampled_from(g.floats))
        sa = g.shapes[a]
        kind = draw(st.sampled_from(["binary", "unary", "matmul", "reduce", "transpose", "reshape", "concat",
                                     "softmax", "where", "cast", "gather", "pow"]))
        if kind == "binary":
            op = draw(st.sampled_from(["Add", "Sub", "Mul", "Div"]))
            other = [t for t in g.floats if g.shapes[t] == sa or g.shapes[t] == ()]
            if draw(st.booleans()) and other:
                c = draw(st.sampled_from(other))
            else:
                c = _param(draw, g, _broadcastable(draw, sa), rng)
            if op == "Div":  # keep the denominator away from 0: 1.5 + tanh(c)
                t = g.add("Tanh", [c], g.shapes[c])
                c = g.add("Add", [t, _param(draw, g, (), rng)], g.shapes[c])
                g.inits[g.nodes[-1].input[1]] = np.asarray(2.0)
            out_shape = np.broadcast_shapes(sa, g.shapes[c])
            ins = [a, c] if draw(st.booleans()) else [c, a]
            g.add(op, ins, tuple(out_shape))
        elif kind == "unary":
            op = draw(st.sampled_from(["Tanh", "Sigmoid", "Neg", "Sin", "Cos", "Identity", "Exp"]))
            if op == "Exp":  # bounded argument: exp(tanh(a))
                a = g.add("Tanh", [a], sa)
            g.add(op, [a], sa)
        elif kind == "pow":
            base = g.add("Sigmoid", [a], sa)
            g.add("Pow", [base, _param(draw, g, _broadcastable(draw, sa), rng)], sa)
        elif kind == "matmul" and len(sa) >= 1:
            k = sa[-1]
            m = draw(st.integers(1, 4))
            w = _param(draw, g, (k, m), rng)
            g.add("MatMul", [a, w], (*sa[:-1], m))
        elif kind == "reduce" and len(sa) >= 1:
            axis = draw(st.integers(-len(sa), len(sa) - 1))
            keep = draw(st.booleans())
            op = draw(st.sampled_from(["ReduceSum", "ReduceMean"]))
            shape = list(sa)
            if keep:
                shape[axis] = 1
            else:
                del shape[axis]
            if op == "ReduceSum":
                axes = g.name("axes")
                g.inits[axes] = np.array([axis], dtype=np.int64)
                g.add(op, [a, axes], tuple(shape), keepdims=int(keep))
            else:
                g.add(op, [a], tuple(shape), axes=[axis], keepdims=int(keep))
        elif kind == "transpose" and len(sa) >= 2:
            perm = draw(st.permutations(range(len(sa))))
            g.add("Transpose", [a], tuple(sa[p] for p in perm), perm=list(perm))
        elif kind == "reshape":
            shape_name = g.name("shape")
            g.inits[shape_name] = np.array([-1], dtype=np.int64)
            g.add("Reshape", [a, shape_name], (int(np.prod(sa)),))
        elif kind == "concat" and len(sa) >= 1:
            same = [t for t in g.floats if g.shapes[t] == sa]
            c = draw(st.sampled_from(same))
            axis = draw(st.integers(0, len(sa) - 1))
            shape = list(sa)
            shape[axis] *= 2
            g.add("Concat", [a, c], tuple(shape), axis=axis)
        elif kind == "softmax" and len(sa) >= 1:
            g.add(draw(st.sampled_from(["Softmax", "LogSoftmax"])), [a], sa, axis=-1)
        elif kind == "where":
            c = draw(st.sampled_from([t for t in g.floats if _fits(g.shapes[t], sa)]))
            mask = g.add("Greater", [a, c], sa, is_float=False)  # a stop edge: no gradient through the mask
            g.add("Where", [mask, a, c], sa)
        elif kind == "cast":  # float -> int -> float: a stop edge on a float path
            i = g.add("Cast", [a], sa, is_float=False, to=TensorProto.INT64)
            g.add("Cast", [i], sa, to=D)
        elif kind == "gather" and len(sa) >= 1:
            n = sa[0]
            idx = g.name("idx")
            g.inits[idx] = np.asarray(rng.integers(-n, n, size=(draw(st.integers(1, 3)),)), dtype=np.int64)
            g.add("Gather", [a, idx], (len(g.inits[idx]), *sa[1:]), axis=0)
    return g, draw(st.data())


def _model(g: Graph, outputs: list[str]) -> onnx.ModelProto:
    def vi(name: str) -> onnx.ValueInfoProto:
        elem = D if name in g.floats else (TensorProto.BOOL if "greater" in name else TensorProto.INT64)
        return helper.make_tensor_value_info(name, elem, list(g.shapes[name]))

    graph = helper.make_graph(
        g.nodes, "random", [vi(n) for n in g.inputs], [vi(o) for o in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in g.inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


@given(graphs())
def test_random_graphs_match_finite_differences(case):
    g, data = case
    produced = [n.output[0] for n in g.nodes]
    float_out = [t for t in produced if t in g.floats]
    if not float_out:
        return
    outputs = data.draw(st.lists(st.sampled_from(float_out), min_size=1, max_size=3))  # duplicates allowed
    if data.draw(st.booleans()) and [t for t in produced if t in g.others]:
        outputs.insert(data.draw(st.integers(0, len(outputs))), data.draw(st.sampled_from(
            [t for t in produced if t in g.others])))
    params = [k for k, v in g.inits.items() if np.asarray(v).dtype == np.float64]
    frozen = data.draw(st.lists(st.sampled_from(params), unique=True, max_size=2)) if params else []
    wrt = [p for p in params if p not in frozen] + (["x"] if data.draw(st.booleans()) else [])
    selected = data.draw(st.lists(st.sampled_from(sorted(set(outputs) & set(g.floats))), unique=True, min_size=1))

    model = _model(g, outputs)
    training = gradbuilder.build_gradient_graph(model, wrt=wrt, outputs=selected)
    onnx.checker.check_model(training, full_check=True)
    _check_invariants(training, model, g, wrt, selected)

    trainer = Trainer(training)
    rng = np.random.default_rng(12345)  # not the parameters' stream: x == w would sit on Greater's kink
    feeds = {"x": rng.standard_normal(g.inputs["x"])}
    outs, _ = trainer.run_forward(feeds)
    cot = [rng.standard_normal(o.shape) if o.dtype == np.float64 else None for o in outs]
    sig = read_yield(training.graph.node[find_yield(list(training.graph.node))])
    differentiable = set(sig.differentiable)
    cot = [c if i in differentiable else None for i, c in enumerate(cot)]
    _, grads = trainer.step(feeds, cot)

    # finite differences through the forward model, moving every wrt tensor along a random direction
    direction = {w: rng.standard_normal(g.shapes[w]) for w in wrt}
    eps = 1e-6

    def run(sign: float) -> list[np.ndarray]:
        moved = onnx.ModelProto()
        moved.CopyFrom(model)
        for t in moved.graph.initializer:
            if t.name in direction:
                t.CopyFrom(onnx.numpy_helper.from_array(g.inits[t.name] + sign * eps * direction[t.name], t.name))
        f = dict(feeds)
        if "x" in direction:
            f["x"] = feeds["x"] + sign * eps * direction["x"]
        return Trainer(gradbuilder.build_gradient_graph(moved, wrt=[], outputs=[])).run_forward(f)[0]

    plus, minus = run(1.0), run(-1.0)
    lhs = sum(float(np.sum((p - m) * c)) for p, m, c in zip(plus, minus, cot) if c is not None) / (2 * eps)
    rhs = sum(float(np.sum(grads[w] * direction[w])) for w in wrt if w in grads)
    assert abs(lhs - rhs) <= 1e-5 * max(1.0, abs(lhs), abs(rhs)), f"finite differences {lhs} vs gradients {rhs}"


def _check_invariants(training: onnx.ModelProto, model: onnx.ModelProto, g: Graph, wrt: list[str],
                      selected: list[str]) -> None:
    nodes = list(training.graph.node)
    k = find_yield(nodes)
    sig = read_yield(nodes[k])
    outputs = [o.name for o in model.graph.output]
    # Yield: every module output in, the selected float ones out, in order
    assert list(sig.outputs) == outputs
    assert len(sig.outputs) == len(sig.grads) + len(sig.non_differentiable)
    for i in sig.differentiable:
        assert outputs[i] in selected and outputs[i] in g.floats
    assert set(sig.full_shape) <= set(sig.differentiable)
    # gradient outputs: after the module outputs, named <wrt>_grad, in wrt order, float wrt only
    meta = gradbuilder.read_metadata(training)
    grad_outputs = [o.name for o in training.graph.output][len(outputs):]
    assert grad_outputs == [meta["gradients"][w] for w in wrt if w in meta["gradients"]]
    assert all(meta["gradients"][w] == f"{w}_grad" for w in meta["gradients"])
    assert set(meta["gradients"]) | set(meta["no_gradient"]) >= set(wrt)
    # no gradient of a gradient: backward nodes only read forward tensors, host gradients and their own outputs
    forward_names = set(g.inputs) | set(g.inits) | {o for n in nodes[:k] for o in n.output}
    backward_names = set(sig.grads) | {i.name for i in training.graph.initializer}
    for n in nodes[k + 1:]:
        assert all(x in forward_names or x in backward_names for x in n.input if x), n
        backward_names.update(n.output)
    assert not any(o in forward_names for n in nodes[k + 1:] for o in n.output)
    # nothing stashed that backward does not read
    _, backward, manifest = gradbuilder.split(training)
    read = {x for n in backward.graph.node for x in n.input}
    assert all(e.name in read for e in manifest.backward_inputs)
