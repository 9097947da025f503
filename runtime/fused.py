"""One onnxruntime run for the forward and backward of a module whose only differentiable output is a scalar.

A loss's gradient is linear in the gradient the host sends it: for a scalar loss L and host gradient g, every
gradient is g times the gradient for g = 1. So the forward can run the backward too, seeded with 1, keep the
gradients instead of the stash, and backward only scales them by g (nothing at all for `loss.backward()`,
where g is 1). The step then costs one run instead of two: no second session start, no stash written out and
read back, the backward reading what the forward left in the cache, and no backward feeds to assemble in Python.

The fused graph is the composition of the two halves as they run split (each lowered as before): the backward's
host-gradient input becomes a constant 1, its constant feeds initializers, and it reads the forward's values by
name. `TrainingSession` takes this path only where the gradients it keeps are no larger than the stash the split
forward keeps (a LeNet: 0.25 MB of gradients against 0.58 MB of stash; not an MLP, whose weights outweigh its
activations, nor GPT-2), so it never holds more between forward and backward than the split would; it pauses while
forwards keep ending without a backward (`MAX_UNUSED`). Its first fused run is compared with the split runs of the
same call (`TrainingSession._composition_check`): onnxruntime optimizes across the halves' boundary.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .passes import fresh_name, has_subgraph, names_in_use

MAX_KEPT = 1.0
"""A fused forward keeps its gradients until backward: fused only where they are at most this many times the bytes
the split forward stashes."""
MAX_UNUSED = 3
"""Fused runs in a row whose gradients no backward took (a validation loss computed with grad enabled, its outputs
dropped: each paid for a backward nobody wanted) before the session pauses fusing; it resumes after as many split
calls whose backward came."""


def fused_model(forward: onnx.ModelProto, backward: onnx.ModelProto, outputs: list[str], seed: str,
                consts: Mapping[str, np.ndarray], gradients: list[str]) -> onnx.ModelProto | None:
    """The forward and backward halves as one graph returning `outputs` (the module's) then `gradients` (backward
    outputs): the backward's `seed` input (the loss's host gradient) a constant 1, its inputs in `consts` constant,
    its other inputs read from the forward by name. None where the halves cannot be joined by renaming (a backward
    name the forward also defines, read inside a subgraph)."""
    f, b = forward.graph, backward.graph
    seed_type = next((i.type.tensor_type.elem_type for i in b.input if i.name == seed), 0)
    if not seed_type:
        return None
    defined = names_in_use(f)
    inputs = {i.name for i in b.input}
    missing = [n for n in inputs if n != seed and n not in consts and n not in defined]
    if missing:
        return None
    own = [o for n in b.node for o in n.output if o] + [t.name for t in b.initializer if t.name not in inputs]
    clashes = [n for n in own if n in defined]
    if clashes and any(has_subgraph(n) for n in b.node):
        return None
    taken = defined | names_in_use(b)
    renamed = {n: fresh_name(n, taken) for n in clashes}
    renamed[seed] = fresh_name(f"{seed}/one", taken)

    def rn(name: str) -> str:
        return renamed.get(name, name)

    nodes = list(f.node)
    for n in b.node:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.input[:] = [rn(x) for x in n.input]
        m.output[:] = [rn(x) for x in n.output]
        nodes.append(m)
    inits = list(f.initializer)
    for t in b.initializer:
        if t.name not in inputs:
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = rn(t.name)
            inits.append(c)
    dtype = helper.tensor_dtype_to_np_dtype(seed_type)
    inits.append(numpy_helper.from_array(np.ones((), dtype=dtype), renamed[seed]))
    inits.extend(numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items() if k in inputs)
    typed = {v.name: v for v in [*f.value_info, *f.output, *f.input]}
    outs = [typed[o] if o in typed else helper.make_empty_tensor_value_info(o) for o in outputs]
    b_typed = {v.name: v for v in [*b.value_info, *b.output]}
    for g in gradients:
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(b_typed.get(g) or helper.make_empty_tensor_value_info(g))
        vi.name = rn(g)
        outs.append(vi)
    value_info = list(f.value_info)
    for v in b.value_info:
        c = onnx.ValueInfoProto()
        c.CopyFrom(v)
        c.name = rn(v.name)
        value_info.append(c)
    graph = helper.make_graph(nodes, f.name or "forward+backward", list(f.input), outs, inits, value_info=value_info)
    opsets: dict[str, int] = {}
    for op in [*forward.opset_import, *backward.opset_import]:
        opsets[op.domain] = max(opsets.get(op.domain, 0), op.version)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              ir_version=max(forward.ir_version, backward.ir_version))
    seen: set[tuple[str, str]] = set()
    for fn in [*forward.functions, *backward.functions]:
        if (fn.domain, fn.name) not in seen:
            seen.add((fn.domain, fn.name))
            model.functions.append(fn)
    return model
