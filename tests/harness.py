"""Shared test machinery: build single-op models, run training graphs on onnxruntime, compare with torch.

Every rule test goes through `check_op`: torch.autograd in float64 gives the reference gradients, and a
central finite difference along a random direction checks <t, J^T c> == <J t, c> on onnxruntime itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import gradbuilder
from gradbuilder.rules import registry

NP_TO_ONNX = {
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def session(model: onnx.ModelProto, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["EliminateDropout"])


class Trainer:
    """Runs a training graph through its two halves, the way a host would."""

    def __init__(self, training: onnx.ModelProto, threads: int = 1):
        self.training = training
        self.forward, self.backward, self.manifest = gradbuilder.split(training)
        self.fwd = session(self.forward, threads)
        self.bwd = session(self.backward, threads) if self.manifest.backward_outputs else None
        self.initializers = {t.name: onnx.numpy_helper.to_array(t) for t in training.graph.initializer}

    def run_forward(self, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
        names = [e.name for e in self.manifest.forward_outputs]
        values = self.fwd.run(names, feeds)
        env = dict(zip(names, values))
        outs = [env[n] for n in self.manifest.module_outputs]
        return outs, env

    def run_backward(self, feeds: dict[str, np.ndarray], env: dict[str, np.ndarray],
                     out_grads: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
        if self.bwd is None:
            return {}
        bfeeds = {}
        for e in self.manifest.backward_inputs:
            if e.role == "output_grad":
                gv = out_grads[e.output_index]
                if gv is None:
                    like = env[self.manifest.module_outputs[e.output_index]]
                    gv = np.zeros(like.shape if e.full_shape else (), like.dtype)
                bfeeds[e.name] = gv
            elif e.role == "stash":
                bfeeds[e.name] = env[e.name]
            elif e.role == "input":
                bfeeds[e.name] = feeds[e.name]
            else:
                bfeeds[e.name] = feeds.get(e.name, self.initializers.get(e.name))
        names = [e.name for e in self.manifest.backward_outputs]
        vals = self.bwd.run(names, bfeeds)
        return {e.wrt: v for e, v in zip(self.manifest.backward_outputs, vals)}

    def step(self, feeds, out_grads=None):
        outs, env = self.run_forward(feeds)
        if out_grads is None:
            out_grads = [None] * len(outs)
        return outs, self.run_backward(feeds, env, out_grads)


def single_op_model(op_type: str, inputs: Sequence[tuple[str, np.ndarray | None]], n_out: int = 1, *,
                    opset: int = 17, consts: Sequence[str] = (), domain: str = "",
                    symbolic: dict[str, Sequence[int]] | None = None, out_ranks: dict[str, int] | None = None,
                    **attrs: Any) -> onnx.ModelProto:
    """One node; `consts` inputs become initializers (axes, shapes), the others graph inputs.

    `symbolic` names, per input, the axes declared with a symbolic dim (as a dynamic batch would be);
    `out_ranks` gives outputs whose shape inference fails a rank, which the full checker needs (and the first
    input's element type where it fails that too: an op onnx does not know, in a `domain`, imported at version 1,
    such as onnxruntime's com.microsoft).
    """
    symbolic = symbolic or {}
    graph_inputs, inits, names = [], [], []
    for name, value in inputs:
        names.append("" if value is None else name)
        if value is None:
            continue
        value = np.asarray(value)
        if name in consts:
            inits.append(onnx.numpy_helper.from_array(value, name))
        else:
            dims = [f"{name}_{a}" if a in symbolic.get(name, ()) else d for a, d in enumerate(value.shape)]
            graph_inputs.append(helper.make_tensor_value_info(name, NP_TO_ONNX[value.dtype], dims))
    outs = [f"y{j}" for j in range(n_out)]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **attrs)
    graph = helper.make_graph([node], op_type.lower(), graph_inputs,
                              [helper.make_empty_tensor_value_info(o) for o in outs], inits)
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=imports)
    model = onnx.shape_inference.infer_shapes(model)
    del model.graph.output[:]
    for o in outs:  # typed outputs from inference
        vi = next((v for v in model.graph.value_info if v.name == o), None)
        vi = vi if vi is not None else helper.make_empty_tensor_value_info(o)
        if o in (out_ranks or {}) and not vi.type.tensor_type.HasField("shape"):
            dims = [f"{o}_{k}" for k in range(out_ranks[o])]
            elem_type = vi.type.tensor_type.elem_type or graph_inputs[0].type.tensor_type.elem_type
            vi = helper.make_tensor_value_info(o, elem_type, dims)
        model.graph.output.append(vi)
    return model


def _to_torch(x: np.ndarray, requires_grad: bool) -> torch.Tensor:
    """Float inputs go to torch in float64 whatever ONNX ran them in: the reference is exact."""
    x = np.array(x)
    t = torch.from_numpy(x.astype(np.float64) if x.dtype.kind == "f" else x)
    return t.requires_grad_(requires_grad)


def check_op(op_type: str, inputs: Sequence[tuple[str, np.ndarray | None]], torch_fn: Callable[..., Any], *,
             n_out: int = 1, diff_outputs: Sequence[int] | None = None, opset: int = 17,
             consts: Sequence[str] = (), wrt: Sequence[str] | None = None, rtol: float | None = None,
             atol: float | None = None, fd: bool = True, fd_eps: float | None = None, fd_rtol: float | None = None,
             seed: int = 0, fd_mask: dict[str, np.ndarray] | None = None,
             symbolic: dict[str, Sequence[int]] | None = None, out_ranks: dict[str, int] | None = None,
             domain: str = "", **attrs: Any) -> dict[str, np.ndarray]:
    """Check one op's gradients against torch.autograd and finite differences; return ORT's gradients.

    `torch_fn` takes the torch versions (float64, requires_grad for `wrt`) of all non-const inputs, in order,
    None kept for absent optional inputs, and returns the output(s). Tolerances default by the dtype
    ONNX runs in: tight for float64, loose for float32 (for ops onnxruntime has no double kernel for).
    """
    rng = np.random.default_rng(seed)
    low = any(np.asarray(v).dtype in (np.float32, np.float16) for _, v in inputs if v is not None)
    rtol = rtol if rtol is not None else (2e-4 if low else 1e-6)
    atol = atol if atol is not None else (1e-4 if low else 1e-8)
    fd_eps = fd_eps if fd_eps is not None else (1e-2 if low else 1e-6)
    fd_rtol = fd_rtol if fd_rtol is not None else (2e-2 if low else 1e-5)
    model = single_op_model(op_type, inputs, n_out, opset=opset, consts=consts, domain=domain, symbolic=symbolic,
                            out_ranks=out_ranks, **attrs)
    feeds = {n: np.asarray(v) for n, v in inputs if v is not None and n not in consts}
    if wrt is None:
        wrt = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    diff_outputs = list(range(n_out)) if diff_outputs is None else list(diff_outputs)
    outputs = [f"y{j}" for j in diff_outputs]
    training = gradbuilder.build_gradient_graph(model, wrt=wrt, outputs=outputs)
    onnx.checker.check_model(training, full_check=True)
    trainer = Trainer(training)

    outs, _ = trainer.run_forward(feeds)
    cot = [np.asarray(rng.standard_normal(o.shape), dtype=o.dtype) if j in diff_outputs else None
           for j, o in enumerate(outs)]
    _, grads = trainer.step(feeds, cot)

    # torch reference
    tin = {n: _to_torch(v, n in wrt) if n not in consts else _to_torch(v, False) for n, v in inputs if v is not None}
    args = [tin.get(n) if v is not None else None for n, v in inputs]
    args = [a for (n, _), a in zip(inputs, args) if n not in consts]
    ty = torch_fn(*args)
    ty = list(ty) if isinstance(ty, (tuple, list)) else [ty]
    for j, (o, t) in enumerate(zip(outs, ty)):
        if o.dtype.kind == "f":
            np.testing.assert_allclose(o, t.detach().numpy(), rtol=rtol, atol=atol, err_msg=f"forward output {j}")
    ys = [ty[j] for j in diff_outputs]
    cs = [torch.from_numpy(cot[j].astype(np.float64)) for j in diff_outputs]
    xs = [tin[n] for n in wrt]
    ref = torch.autograd.grad(ys, xs, cs, allow_unused=True)
    for n, r in zip(wrt, ref):
        if r is None:
            assert n not in grads or not np.any(grads[n]), f"torch has no gradient for {n}"
            continue
        assert n in grads, f"no gradient for {n}; metadata says: {gradbuilder.read_metadata(training)['no_gradient']}"
        np.testing.assert_allclose(grads[n], r.numpy(), rtol=rtol, atol=atol, err_msg=f"gradient of {n}")

    if fd:
        direction = {n: np.asarray(rng.standard_normal(feeds[n].shape)) for n in wrt}
        if fd_mask is not None:  # ops with kinks: a 0 in the mask keeps the probe off that element
            direction = {n: direction[n] * fd_mask.get(n, 1.0) for n in wrt}
        plus = dict(feeds)
        minus = dict(feeds)
        for n in wrt:
            plus[n] = np.asarray(feeds[n] + fd_eps * direction[n], dtype=feeds[n].dtype)
            minus[n] = np.asarray(feeds[n] - fd_eps * direction[n], dtype=feeds[n].dtype)
        op_, _ = trainer.run_forward(plus)
        om_, _ = trainer.run_forward(minus)
        lhs = sum(float(np.sum((op_[j].astype(np.float64) - om_[j]) * cot[j])) for j in diff_outputs) / (2 * fd_eps)
        rhs = sum(float(np.sum(grads[n] * direction[n])) for n in wrt if n in grads)
        assert abs(lhs - rhs) <= fd_rtol * max(1.0, abs(lhs), abs(rhs)), f"finite differences: {lhs} vs {rhs}"
    return grads


def sweep_tests(sweep: Callable[[int, type[np.floating]], None], float32_opsets: Sequence[int]
                ) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The two tests of a family's `sweep(opset, dtype)`, to assign to `test_every_opset, test_float32` in its
    test module: float64 at every opset from 13 to the rules' newest (one test each), float32 at `float32_opsets`."""
    @pytest.mark.parametrize("opset", range(13, registry.MAX_OPSET + 1))
    def test_every_opset(opset: int) -> None:
        sweep(opset, np.float64)

    def test_float32() -> None:
        for opset in float32_opsets:
            sweep(opset, np.float32)

    return test_every_opset, test_float32


def random_body_model(rows: int, dropout: bool = False) -> onnx.ModelProto:
    """loss = sum((x + noise) @ w) for w (3x2, ones): the noise drawn by RandomUniformLike in an If's body
    (cond True), then a training Dropout (ratio 0.5) where `dropout` (not maskable on the host: the graph has a
    body). The gradient of w is the column sums of what reached the MatMul, so loss = 2 sum of grad[:, 0]."""
    shape = [rows, 3]
    then = helper.make_graph([helper.make_node("RandomUniformLike", ["x"], ["drawn"], dtype=TensorProto.FLOAT)],
                             "then", [], [helper.make_tensor_value_info("drawn", TensorProto.FLOAT, shape)])
    kept = helper.make_graph([helper.make_node("Identity", ["x"], ["same"])], "else", [],
                             [helper.make_tensor_value_info("same", TensorProto.FLOAT, shape)])
    nodes = [helper.make_node("If", ["cond"], ["noise"], then_branch=then, else_branch=kept),
             helper.make_node("Add", ["x", "noise"], ["h"])]
    inits = [onnx.numpy_helper.from_array(np.ones((3, 2), np.float32), "w"),
             onnx.numpy_helper.from_array(np.array(True), "cond")]
    if dropout:
        nodes.append(helper.make_node("Dropout", ["h", "ratio", "cond"], ["kept"]))
        inits.append(onnx.numpy_helper.from_array(np.array(0.5, np.float32), "ratio"))
    nodes += [helper.make_node("MatMul", ["kept" if dropout else "h", "w"], ["y"]),
              helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "random_body", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

