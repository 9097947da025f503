"""Training programs: a forward source plus build arguments, built and split into two halves.

A `Program` is what a TrainingSession runs. `specialise` builds the backward for the subset of
outputs that actually receive gradients, reusing the full forward: the full forward runs before
anyone knows which outputs will get gradients, so the specialised backward must read only tensors
the full forward already returns. Forward-side helper nodes (Shape, ...) of the subset build are
matched to the full build's by structure (op, attributes, inputs) and renamed; helpers with no
match are moved behind the Yield (recomputed in backward). If the subset backward still needs a
tensor the full forward does not stash, the caller falls back to the full backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

import gradbuilder
from gradbuilder.stop_gradient import identities
from gradbuilder.yield_op import find_yield, read_yield

from . import passes


@dataclass(frozen=True)
class BuildSpec:
    """Arguments of `build_gradient_graph` (names of the forward source)."""

    wrt: tuple[str, ...]
    outputs: tuple[str, ...]
    loss: str | None = None
    freeze: tuple[str, ...] = ()

    def with_outputs(self, outputs: Iterable[str]) -> BuildSpec:
        return BuildSpec(self.wrt, tuple(outputs), self.loss, self.freeze)


@dataclass
class Program:
    """The two halves of one build; `training` is kept (when known) for saving and debugging."""

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    manifest: gradbuilder.Manifest
    training: onnx.ModelProto | None = None

    @property
    def forward_outputs(self) -> list[str]:
        return [e.name for e in self.manifest.forward_outputs]

    @property
    def gradients(self) -> dict[str, str]:
        """wrt tensor -> gradient output name, for the tensors that get a gradient."""
        return {e.wrt: e.name for e in self.manifest.backward_outputs if e.wrt}

    def missing_stash(self, full: Program) -> list[str]:
        """Tensors this program's backward reads that `full`'s forward does not return."""
        have = set(full.forward_outputs) | set(full.manifest.forward_inputs)
        return [e.name for e in self.manifest.backward_inputs if e.role == "stash" and e.name not in have]


def spec_from_metadata(model: onnx.ModelProto) -> BuildSpec:
    meta = gradbuilder.read_metadata(model)
    return BuildSpec(tuple(meta["wrt"]), tuple(meta["outputs"]), meta["loss"])  # type: ignore[arg-type]


def forward_source(model: onnx.ModelProto, module_outputs: Sequence[str] | None = None) -> onnx.ModelProto:
    """The forward graph a training graph (or a split forward half) was built from: every node before the
    Yield, the graph inputs, the initializers those nodes read, and the module outputs as outputs."""
    g = model.graph
    nodes = list(g.node)
    try:
        y = find_yield(nodes)
        outputs = list(read_yield(nodes[y]).outputs)
        nodes = nodes[:y]
    except gradbuilder.GradBuilderError:
        if module_outputs is None:
            raise
        outputs = list(module_outputs)
    reads = {x for n in nodes for x in n.input} | set(outputs)
    typed = {v.name: v for v in [*g.value_info, *g.input, *g.output]}
    outs = [typed[o] if o in typed else helper.make_empty_tensor_value_info(o) for o in outputs]
    produced = {o for n in nodes for o in n.output}
    graph = helper.make_graph(nodes, g.name or "forward", list(g.input), outs,
                              [t for t in g.initializer if t.name in reads],
                              value_info=[v for v in g.value_info if v.name in produced])
    src = helper.make_model(graph, opset_imports=[op for op in model.opset_import
                                                  if op.domain != gradbuilder.YIELD_DOMAIN],
                            ir_version=model.ir_version)
    src.metadata_props.extend(p for p in model.metadata_props if not p.key.startswith("gradbuilder."))
    return src


def build(source: onnx.ModelProto, spec: BuildSpec, shrink: bool = True, torch_masks: bool = False) -> onnx.ModelProto:
    """The training graph of `source`, with the stash shrunk (`passes.shrink_stash`, given `torch_masks`) unless told
    not to."""
    training = gradbuilder.build_gradient_graph(source, wrt=list(spec.wrt), outputs=list(spec.outputs),
                                                loss=spec.loss, freeze=list(spec.freeze))
    if shrink:
        passes.shrink_stash(training, torch_masks=torch_masks)
    return training


def from_training(training: onnx.ModelProto) -> Program:
    forward, backward, manifest = gradbuilder.split(training)
    return Program(forward, backward, manifest, training)


def specialise(source: onnx.ModelProto, spec: BuildSpec, outputs: Sequence[str], full: Program,
               shrink: bool = True, torch_masks: bool = False) -> Program:
    """The program for gradients arriving only for `outputs`, its forward-side names aligned with `full`'s
    forward half; check `missing_stash(full)` before running its backward on `full`'s forward state. Pass
    the `shrink` and `torch_masks` that `full` was built with: the stash decisions must be the same."""
    training = build(source, spec.with_outputs(outputs), shrink, torch_masks)
    _align(training, full.forward)
    return from_training(training)


def _tensor_key(t: onnx.TensorProto) -> bytes:
    return t.SerializeToString(deterministic=True).replace(t.name.encode(), b"", 1)


def _node_key(n: onnx.NodeProto, rename: dict[str, str]) -> tuple:
    attrs = tuple(sorted((a.name, a.SerializeToString(deterministic=True)) for a in n.attribute))
    return n.domain or "", n.op_type, tuple(rename.get(x, x) for x in n.input), attrs, len(n.output)


def _align(sub: onnx.ModelProto, full: onnx.ModelProto) -> None:
    """Rename the forward helper tensors of the training graph `sub` to their equals in the forward half
    `full`, move unmatched helpers behind the Yield, and rename anything of `sub` that would then clash
    with a name taken from `full`."""
    g = sub.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    full_nodes = list(full.graph.node)
    full_inits = {t.name: t for t in full.graph.initializer}
    known = {o for n in full_nodes for o in n.output} | set(full_inits)
    known |= {i.name for i in full.graph.input}
    # the full build's forward starts with the same source nodes: skip them
    n_source = 0
    as_run = identities(nodes[:y])  # the forward half runs StopGradients as Identities: compare those
    while n_source < min(y, len(full_nodes)) and as_run[n_source] == full_nodes[n_source]:
        n_source += 1

    rename: dict[str, str] = {}
    own = {t.name for t in g.initializer}
    by_content = {_tensor_key(t): t.name for t in full.graph.initializer if t.name not in own}
    for t in g.initializer:
        if t.name in full_inits and _tensor_key(full_inits[t.name]) == _tensor_key(t):
            continue
        match = by_content.get(_tensor_key(t))
        if match is not None:
            rename[t.name] = match
    index: dict[tuple, onnx.NodeProto] = {}
    for n in full_nodes:
        index.setdefault(_node_key(n, {}), n)
    matched, moved = [], []
    for n, run in zip(nodes[n_source:y], as_run[n_source:]):
        twin = index.get(_node_key(run, rename))
        if twin is None:
            moved.append(n)
            continue
        matched.append(n)
        rename.update({o: t for o, t in zip(n.output, twin.output) if o and t and o != t})

    # names of `sub` that are not renamed but collide with a rename target would alias two values
    targets = set(rename.values())
    taken = known | {o for n in nodes for o in n.output} | {t.name for t in g.initializer}
    counter = 0
    for name in [o for n in nodes for o in n.output] + [t.name for t in g.initializer]:
        if name and name in targets and name not in rename:
            while f"{name}__s{counter}" in taken:
                counter += 1
            rename[name] = f"{name}__s{counter}"
            taken.add(rename[name])
    out_names = {o.name for o in g.output}
    if any(k in out_names for k in rename):
        raise AssertionError("alignment would rename a graph output")  # gradient names are reserved first

    def fix(seq) -> None:
        for i, x in enumerate(seq):
            if x in rename:
                seq[i] = rename[x]

    for n in nodes:
        fix(n.input)
        fix(n.output)
    seen: set[str] = set()
    inits = []
    for t in g.initializer:
        t.name = rename.get(t.name, t.name)
        if t.name not in seen:
            seen.add(t.name)
            inits.append(t)
    del g.initializer[:]
    g.initializer.extend(inits)
    for vi in g.value_info:
        vi.name = rename.get(vi.name, vi.name)
    del g.node[:]
    g.node.extend([*nodes[:n_source], *matched, nodes[y], *moved, *nodes[y + 1:]])
