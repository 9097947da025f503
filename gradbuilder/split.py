"""Training graph -> forward model + backward model + manifest, each runnable on stock onnxruntime.

The forward model returns the module outputs plus the stashed tensors backward reads; the backward
model takes those, the host's output gradients and the parameters it reads, and returns the
gradients. Nothing is stashed that backward does not read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx
from onnx import helper

from .builder import read_metadata
from .errors import SplitError
from .graph import TensorInfo, describe, infer_shapes_safely, info_from_type, load_model, value_info
from .stop_gradient import identities, reading_sources
from .yield_op import DOMAIN, find_yield, read_yield

ROLES = ("input", "initializer", "stash", "output_grad", "output", "grad")


@dataclass
class Entry:
    name: str
    role: str
    output_index: int | None = None
    """For output_grad: which module output it is the gradient of."""
    wrt: str | None = None
    """For grad: which tensor it is the gradient of."""
    full_shape: bool = False


@dataclass
class Manifest:
    """Every name the two halves exchange, with its role (JSON-serialisable)."""

    module_outputs: list[str]
    forward_inputs: list[str]
    forward_outputs: list[Entry]
    backward_inputs: list[Entry]
    backward_outputs: list[Entry]
    non_differentiable_outputs: list[int]
    full_shape_outputs: list[int]
    loss: str | None = None
    no_gradient: dict[str, str] = field(default_factory=dict)
    zero_gradient: list[str] = field(default_factory=list)
    """wrt tensors whose gradient is zeros (not None) as torch gives it: the backward computes none for them."""
    zero_gradient_of: dict[str, list[str]] = field(default_factory=dict)
    """The same per module output (and the loss): for the outputs a step gives gradients, the tensors one of them
    lists and the backward computes no gradient for get zeros."""
    format: str = "gradbuilder.split/1"

    @property
    def stashed(self) -> list[str]:
        return [e.name for e in self.backward_inputs if e.role == "stash"]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        for key in ("forward_outputs", "backward_inputs", "backward_outputs"):
            d[key] = [Entry(**e) for e in d[key]]
        return cls(**d)


def _infer(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    g = infer_shapes_safely(model) or model.graph
    info = {vi.name: info_from_type(vi.type) for vi in [*g.value_info, *g.input, *g.output]}
    info.update({t.name: TensorInfo(t.data_type, tuple(t.dims)) for t in g.initializer})
    return info


def _add_tensors(field: Any, tensors: list[onnx.TensorProto]) -> None:
    """field.extend(tensors), one tensor at a time: upb refuses to extend a repeated field by a message over
    2 GB (and make_graph then make_model would copy each tensor twice)."""
    for t in tensors:
        field.add().CopyFrom(t)


def split(training_model: onnx.ModelProto | str | os.PathLike | bytes) -> tuple[
        onnx.ModelProto, onnx.ModelProto, Manifest]:
    """Cut a training graph at its Yield node into (forward, backward, manifest)."""
    tm = load_model(training_model)
    g = tm.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    sig = read_yield(nodes[y])
    # StopGradient runs as Identity; backward reads its input, so one tensor is stashed, not it and its copy
    fwd_nodes, bwd_nodes = identities(nodes[:y]), identities(reading_sources(nodes[y + 1:], nodes[:y]))
    info = _infer(tm)
    inits = {t.name: t for t in g.initializer}
    graph_inputs = [i.name for i in g.input]
    graph_input_set = set(graph_inputs)

    fwd_produced = {o for n in fwd_nodes for o in n.output if o}
    fwd_reads = {x for n in fwd_nodes for x in n.input if x} | set(sig.outputs)
    bwd_produced = {o for n in bwd_nodes for o in n.output if o}
    grad_of = {gname: i for i, gname in sig.grad_of().items()}
    meta = read_metadata(tm)
    wrt_of = {gname: w for w, gname in meta["gradients"].items()}  # type: ignore[union-attr]

    bwd_inputs: list[Entry] = []
    bwd_inits: list[onnx.TensorProto] = []
    seen: set[str] = set()
    for n in bwd_nodes:
        for x in n.input:
            if not x or x in bwd_produced or x in seen:
                continue
            seen.add(x)
            if x in grad_of:
                i = grad_of[x]
                bwd_inputs.append(Entry(x, "output_grad", output_index=i, full_shape=i in sig.full_shape))
            elif x in graph_input_set:
                bwd_inputs.append(Entry(x, "input"))
                if x in inits:  # an input with a default (IR < 4 style): what forward read when it was not fed
                    bwd_inits.append(inits[x])
            elif x in inits:
                if x in fwd_reads:
                    bwd_inputs.append(Entry(x, "initializer"))
                else:
                    bwd_inits.append(inits[x])
            elif x in fwd_produced:
                bwd_inputs.append(Entry(x, "stash"))
            else:
                raise SplitError(f"backward node {describe(n)} reads '{x}', which no forward node, input, initializer "
                                 "or Yield output defines: the training graph is damaged; rebuild it with "
                                 "`gradbuilder build`.")

    stash = [e.name for e in bwd_inputs if e.role == "stash"]
    module_outputs = list(sig.outputs)
    fwd_outputs = [Entry(o, "output") for o in module_outputs]
    module_output_set = set(module_outputs)
    fwd_outputs += [Entry(s, "stash") for s in stash if s not in module_output_set]
    bwd_outputs = [Entry(o.name, "grad", wrt=wrt_of.get(o.name)) for o in g.output if o.name in bwd_produced]

    typed: dict[str, onnx.ValueInfoProto] = {}  # the first typed declaration of each name, outputs first
    for cand in (*g.output, *g.input, *g.value_info):
        if cand.type.tensor_type.elem_type or cand.type.WhichOneof("value") not in (None, "tensor_type"):
            typed.setdefault(cand.name, cand)  # a sequence, map or optional keeps its kind

    def vi(name: str) -> onnx.ValueInfoProto:
        cand = typed.get(name)
        return cand if cand is not None else value_info(name, info.get(name, TensorInfo()))

    opsets = [op for op in tm.opset_import if op.domain != DOMAIN]
    fwd_init = [t for n, t in inits.items() if n in fwd_reads]
    forward = helper.make_model(
        helper.make_graph(fwd_nodes, f"{g.name}_forward", list(g.input), [vi(e.name) for e in fwd_outputs],
                          value_info=[v for v in g.value_info if v.name in fwd_produced]),
        opset_imports=opsets, ir_version=tm.ir_version, producer_name="gradbuilder.split")
    backward = helper.make_model(
        helper.make_graph(bwd_nodes, f"{g.name}_backward", [vi(e.name) for e in bwd_inputs],
                          [vi(e.name) for e in bwd_outputs],
                          value_info=[v for v in g.value_info if v.name in bwd_produced]),
        opset_imports=opsets, ir_version=tm.ir_version, producer_name="gradbuilder.split")
    for model, tensors in ((forward, fwd_init), (backward, bwd_inits)):
        _add_tensors(model.graph.initializer, tensors)
        model.metadata_props.extend(tm.metadata_props)

    manifest = Manifest(
        module_outputs=module_outputs,
        forward_inputs=graph_inputs,
        forward_outputs=fwd_outputs,
        backward_inputs=bwd_inputs,
        backward_outputs=bwd_outputs,
        non_differentiable_outputs=list(sig.non_differentiable),
        full_shape_outputs=list(sig.full_shape),
        loss=meta["loss"],  # type: ignore[arg-type]
        no_gradient=meta["no_gradient"],  # type: ignore[arg-type]
        zero_gradient=meta["zero_gradient"],  # type: ignore[arg-type]
        zero_gradient_of=meta["zero_gradient_of"],  # type: ignore[arg-type]
    )
    return forward, backward, manifest
