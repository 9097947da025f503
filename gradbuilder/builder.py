"""Forward graph in, training graph out: forward, one Yield, backward.

The build is a pure function of its arguments: reachability is decided once on the finished
forward graph, then nodes are visited in reverse, each rule emitting only the input gradients that
are needed, and several contributions to one gradient are added with one `Sum`.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from . import rules  # noqa: F401 - registers every rule family
from .errors import (
    ControlFlowError,
    InvalidModelError,
    LossError,
    RuleError,
    SplitError,
    UnknownNameError,
    UnsupportedOpError,
)
from .graph import ForwardGraph, NameAllocator, add_value_info, describe, inline_functions, load_model, type_name
from .reachability import Reachability, analyze, is_control_flow
from .rules import registry
from .rules.context import Emitter, Grad, Node
from .yield_op import DOMAIN, VERSION, YieldSignature, is_yield, make_yield

META_PREFIX = "gradbuilder."


@dataclass(frozen=True)
class BuildRequest:
    wrt: tuple[str, ...]
    outputs: tuple[str, ...]
    loss: str | None
    frozen: tuple[str, ...]


def grad_name(tensor: str) -> str:
    """The documented name of the gradient output of `tensor` (unless the forward graph already uses it)."""
    return f"{tensor}_grad"


def _unknown(kind: str, name: str, choices: Iterable[str]) -> UnknownNameError:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return UnknownNameError(f"{kind} '{name}' is not a tensor of this graph.{hint}")


def _dedupe(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _not_tensors(fg: ForwardGraph) -> dict[str, str]:
    """Graph outputs declared as another kind of value than a tensor (sequence, map, optional, sparse tensor), by
    kind: no gradient flows through them, and their untyped info must not pass for a float tensor's."""
    kinds: dict[str, str] = {}
    for vi in fg.graph.output:
        kind = vi.type.WhichOneof("value")
        if kind not in (None, "tensor_type"):
            kinds[vi.name] = kind.removesuffix("_type").replace("_", " ")
    return kinds


def resolve_request(fg: ForwardGraph, wrt: Sequence[str] | None, outputs: Sequence[str] | None, loss: str | None,
             freeze: Sequence[str]) -> BuildRequest:
    known = fg.all_names()
    kinds = _not_tensors(fg)
    for name in freeze:
        if name not in known:
            raise _unknown("frozen tensor", name, known)
    if isinstance(wrt, str) or isinstance(outputs, str):
        raise TypeError("wrt and outputs take a list of names, not a single string")
    if wrt is None:
        wrt_t = tuple(n for n, t in fg.initializers.items() if fg.tensor_info(n).is_float and t.data_type)
    else:
        for name in wrt:
            if name not in known:
                raise _unknown("wrt tensor", name, known)
        wrt_t = _dedupe(wrt)
    frozen = set(freeze)
    wrt_t = tuple(n for n in wrt_t if n not in frozen)
    if loss is not None:
        if loss not in fg.outputs:
            raise _unknown("loss output", loss, fg.outputs) if loss not in known else LossError(
                f"loss '{loss}' is a tensor of the graph but not a graph output; add it to the outputs.")
        info = fg.tensor_info(loss)
        if loss in kinds:
            raise LossError(f"loss '{loss}' is a {kinds[loss]}, not a tensor; a loss must be a float tensor.")
        if info.elem_type and not info.is_float:
            raise LossError(f"loss '{loss}' is {type_name(info.elem_type)}; a loss must be a float tensor.")
        if info.shape is not None and info.numel() != 1:
            raise LossError(f"loss '{loss}' has shape {list(info.shape)}; a loss must be a scalar "
                            "(reduce it with ReduceMean or ReduceSum first).")
    if outputs is None:
        outs = () if loss is not None else tuple(o for o in fg.outputs if fg.tensor_info(o).is_float and o not in kinds)
    else:
        for name in outputs:
            if name in kinds:
                raise UnknownNameError(f"output '{name}' is a {kinds[name]}, not a tensor: gradients flow only "
                                       "through tensors. Leave it out of the outputs to differentiate.")
            if name not in fg.outputs:
                if name in known:
                    raise UnknownNameError(f"'{name}' is a tensor of the graph but not a graph output; outputs "
                                           f"are taken from the graph outputs ({', '.join(fg.outputs)}).")
                raise _unknown("output", name, fg.outputs)
        outs = _dedupe(outputs)
        if loss is not None and loss in outs:
            raise LossError(f"'{loss}' is given both as the loss (seeded with 1) and as an output whose gradient "
                            "the host supplies; give it as one of the two.")
    return BuildRequest(wrt_t, outs, loss, _dedupe(freeze))


class _Accumulator:
    """Gradient contributions per forward tensor; one Sum per tensor when there are several."""

    def __init__(self, em: Emitter, names: NameAllocator, reserved: dict[str, str]):
        self.em = em
        self.names = names
        self.reserved = reserved
        self.parts: dict[str, list[str]] = {}
        self.final: dict[str, str] = {}
        self.uses: dict[str, int] = {}

    def add(self, tensor: str, grad: str) -> None:
        self.parts.setdefault(tensor, []).append(grad)
        self.uses[grad] = self.uses.get(grad, 0) + 1

    def has(self, tensor: str) -> bool:
        return bool(self.parts.get(tensor))

    def total(self, tensor: str) -> str | None:
        if tensor in self.final:
            return self.final[tensor]
        parts = self.parts.get(tensor)
        if not parts:
            return None
        if len(parts) == 1:
            name = parts[0]
        else:
            out = self.reserved.get(tensor) or self.names.fresh(grad_name(tensor))
            name = self.em.node("Sum", parts, 1, f"grad/{tensor}", outputs=[out])[0]
        self.final[tensor] = name
        return name


def build_gradient_graph(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    *,
    wrt: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    loss: str | None = None,
    freeze: Sequence[str] = (),
) -> onnx.ModelProto:
    """Return the training graph of `model`: forward, a Yield node, backward, and one gradient output per
    differentiable `wrt` tensor, named `<tensor>_grad`, in `wrt` order.

    wrt: tensors to differentiate (default: every float initializer); graph inputs may be named too.
    outputs: graph outputs whose gradients the host supplies through Yield (default: every float output,
        or none when `loss` is given). loss: a scalar float output seeded with gradient 1 in the graph.
    freeze: tensors removed from `wrt`. The metadata key `gradbuilder.gradients` maps each `wrt` tensor to its
    gradient output, `gradbuilder.zero_gradient` lists those whose gradient is zeros in PyTorch (connected to the
    outputs only through ops of derivative zero, such as Round: no output, the host fills the zeros;
    `gradbuilder.zero_gradient_of` the same per output, for a host giving some of them gradients) and
    `gradbuilder.no_gradient` says why the others get none (PyTorch's `None`).
    """
    with _no_gc():
        return _build(model, wrt, outputs, loss, freeze)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The build allocates hundreds of thousands of small objects and frees none: cyclic GC passes over them
    cost a third of the time on large graphs."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build(model: onnx.ModelProto | str | os.PathLike | bytes, wrt: Sequence[str] | None,
           outputs: Sequence[str] | None, loss: str | None, freeze: Sequence[str]) -> onnx.ModelProto:
    m = inline_functions(load_model(model))
    if any(is_yield(n) for n in m.graph.node):
        raise InvalidModelError("the model already contains a Yield node: it is a training graph, not a forward "
                                "graph. Build from the forward model instead.")
    fg = ForwardGraph(m)
    req = resolve_request(fg, wrt, outputs, loss, freeze)
    seeds = list(req.outputs) + ([req.loss] if req.loss else [])
    reach = analyze(fg, req.wrt, seeds)
    names = NameAllocator(fg.all_names())
    reserved = {w: names.fresh(grad_name(w)) for w in req.wrt if w in reach.needs}
    em = Emitter(fg, names)
    acc = _Accumulator(em, names, reserved)

    sig = _seed(fg, req, reach, em, acc, names)
    _reverse_pass(fg, reach, em, acc)
    grads, renames = _finish_wrt(req, em, acc, reserved)
    return _assemble(m, fg, req, reach, em, sig, grads, renames, seeds)


def _seed(fg: ForwardGraph, req: BuildRequest, reach: Reachability, em: Emitter, acc: _Accumulator,
          names: NameAllocator) -> YieldSignature:
    selected = set(req.outputs)
    ins = reach.edges.inputs
    internal = {name for k, flags in reach.active_inputs.items() for i, name, _ in ins[k] if i >= 0 and flags[i]}
    diff, nondiff, full, grads = [], [], [], []
    for i, name in enumerate(fg.outputs):
        if name in selected and (name in reach.needs or name in reach.zero_seeds):
            if not fg.tensor_info(name).elem_type:
                made = fg.producer.get(name)
                by = f" (made by node {describe(fg.nodes[made])})" if made is not None else ""
                raise InvalidModelError(
                    f"graph output '{name}'{by} gets a gradient from the host, but its element type is unknown: "
                    "neither the model declares it nor onnx's shape inference could infer it, so its gradient "
                    "input cannot be typed. Declare the output's type (graph.output), or name the outputs to "
                    "differentiate (outputs=/--outputs) without it."
                )
            diff.append(i)
            g = names.fresh(f"{name}_host_grad")
            grads.append(g)
            if name not in reach.needs:  # torch differentiates it, but through ops of derivative zero only
                continue
            acc.add(name, g)
            if name not in internal and fg.tensor_info(name).rank != 0:
                full.append(i)
        else:
            nondiff.append(i)
    if req.loss is not None and req.loss in reach.needs:
        info = fg.tensor_info(req.loss)
        shape = info.static_shape if info.static_shape is not None else ()
        acc.add(req.loss, em.const(np.ones(shape), info.elem_type or TensorProto.FLOAT))
    return YieldSignature(tuple(fg.outputs), tuple(grads), tuple(nondiff), tuple(full))


def _reverse_pass(fg: ForwardGraph, reach: Reachability, em: Emitter, acc: _Accumulator) -> None:
    needs, outputs, total, active = reach.needs, reach.edges.outputs, acc.total, reach.active_inputs
    ops, domains, lookup, opset = fg.node_ops, fg.node_domains, registry.lookup, fg.opset
    for k in sorted(active, reverse=True):
        node = fg.nodes[k]
        out_grads = [total(o) if d and o in needs else None for o, d in outputs[k]]
        if not any(g is not None for g in out_grads):
            continue
        op_type = ops[k]
        if is_control_flow(op_type) or k in fg.hidden_inputs:
            raise ControlFlowError(
                f"node {describe(node)} is control flow ({node.op_type}) on the gradient path; gradbuilder does "
                "not differentiate If/Loop/Scan bodies. Unroll the loop or take the branch at export time, or "
                "freeze the parameters that feed it (--freeze)."
            )
        rule = lookup(op_type, opset, domains[k])
        if rule is None or rule.fn is None:
            ranges = registry.known_opsets(node.op_type, node.domain)
            have = f" (rules exist for opsets {', '.join(ranges)})" if ranges else ""
            dom = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
            raise UnsupportedOpError(
                f"op {dom}{node.op_type} at opset {fg.opset} has no gradient rule{have}; node {describe(node)} lies "
                "on the gradient path. Run `gradbuilder ops` for the supported ops, or freeze the parameters "
                "that feed this node (--freeze)."
            )
        flags = active[k]
        inputs = fg.node_inputs[k]
        result = rule.fn(Grad(em, node, out_grads, flags, inputs, op_type))
        result = list(result or ())
        for i, needed in enumerate(flags):
            if not needed:
                continue
            g = result[i] if i < len(result) else None
            if g is None:
                raise RuleError(f"the {node.op_type} rule returned no gradient for input {i} ('{node.input[i]}') of "
                                f"node {describe(node)}, which needs one; this is a bug in gradbuilder.")
            acc.add(inputs[i], g)


def _finish_wrt(req: BuildRequest, em: Emitter, acc: _Accumulator, reserved: dict[str, str]) -> tuple[
        dict[str, str], dict[str, str]]:
    """Give each gradient output its documented name: rename the producing node's output when only it
    holds that value (the renames are returned and made by _live), else add an Identity."""
    grads: dict[str, str] = {}
    renames: dict[str, str] = {}
    for w in req.wrt:
        if w not in reserved:
            continue
        total = acc.total(w)
        if total is None:
            continue
        want = reserved[w]
        if total != want:
            owned = total in em.produced and acc.uses.get(total, 0) == 1 and total not in renames
            if owned:
                renames[total] = want
            else:
                em.node("Identity", [total], 1, f"grad/{w}", outputs=[want])
        grads[w] = want
    return grads, renames


def _live(nodes: list[Node], wanted: set[str], renames: dict[str, str]) -> list[Node]:
    """The nodes `wanted` depends on, in order, with their tensors renamed by `renames`."""
    keep = []
    old = renames.keys()
    for n in reversed(nodes):
        if old and not old.isdisjoint(n.output):
            n.output = [renames.get(x, x) for x in n.output]
        if not wanted.isdisjoint(n.output):
            keep.append(n)
            if old and not old.isdisjoint(n.input):
                n.input = [renames.get(x, x) for x in n.input]
            wanted.update(n.input)
            wanted.discard("")  # an empty (left out) input names no tensor
    keep.reverse()
    return keep


def _add_nodes(graph: onnx.GraphProto, nodes: list[Node]) -> None:
    """Append the nodes as NodeProtos, fields set one by one (faster than keyword arguments); `domain` is
    always set, even when empty, as NodeProto(domain="") did."""
    add = graph.node.add
    for n in nodes:
        p = add()
        p.input.extend(n.input)
        p.output.extend(n.output)
        p.name = n.name
        p.op_type = n.op_type
        p.domain = n.domain
        if n.attribute:
            p.attribute.extend(n.attribute)


def _unique_node_names(forward: Sequence[onnx.NodeProto], added: Sequence[Node | onnx.NodeProto]) -> None:
    """onnxruntime refuses a model in which two nodes share a name ("two nodes with same node name"), which ONNX
    forbids but its checker lets through: a forward node's name used twice, or the name a backward node is given
    (after its output) already a forward node's, gets a suffix. Empty names are no one's."""
    seen: set[str] = set()
    repeated: list[onnx.NodeProto] = []
    for n in forward:
        name = n.name
        if name in seen and name:
            repeated.append(n)
        seen.add(name)
    if not repeated and seen.isdisjoint(n.name for n in added):
        return
    names = NameAllocator(seen | {n.name for n in added})
    for n in repeated:
        n.name = names.fresh(n.name)
    for n in added:
        if n.name in seen:
            n.name = names.fresh(n.name)


def _assemble(m: onnx.ModelProto, fg: ForwardGraph, req: BuildRequest, reach: Reachability, em: Emitter,
              sig: YieldSignature, grads: dict[str, str], renames: dict[str, str], seeds: list[str]
              ) -> onnx.ModelProto:
    wanted = set(grads.values())
    backward = _live(em.backward, wanted, renames)
    extra = _live(em.forward_extra, wanted, renames)
    inits = [t for t in em.initializers if t.name in wanted]
    yield_node = make_yield(sig, em.names.fresh("gradbuilder_yield"))

    graph = m.graph  # its nodes are fg.nodes, in order, with the outputs rules added (Grad.output)
    _unique_node_names(fg.nodes, [*extra, yield_node, *backward])
    _add_nodes(graph, extra)
    graph.node.append(yield_node)
    _add_nodes(graph, backward)
    graph.initializer.extend(inits)
    for w, g in grads.items():
        add_value_info(graph.output, g, fg.tensor_info(w))
    if em.declared:
        live = {o for n in backward for o in n.output}
        for name, info in em.declared.items():
            if renames.get(name, name) in live:
                add_value_info(graph.value_info, renames.get(name, name), info)
    full = set(sig.full_shape)
    for i, g in sig.grad_of().items():
        info = fg.tensor_info(fg.outputs[i])
        add_value_info(graph.value_info, g, info if i in full else type(info)(info.elem_type, None))
    if not any(op.domain == DOMAIN for op in m.opset_import):
        m.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))

    zero_wrt = reach.zero_wrt
    no_grad = {w: reach.reason(fg, w, seeds) or "no gradient flows to it" for w in req.wrt
               if w not in grads and w not in zero_wrt}
    no_grad.update({f: "frozen" for f in req.frozen})
    meta = {
        "format": "1",
        "wrt": json.dumps(list(req.wrt)),
        "gradients": json.dumps([[w, g] for w, g in grads.items()]),
        "zero_gradient": json.dumps([w for w in req.wrt if w in zero_wrt]),
        "zero_gradient_of": json.dumps({o: [w for w in req.wrt if w in z] for o, z in reach.zero_of.items()}),
        "no_gradient": json.dumps(no_grad),
        "outputs": json.dumps(list(req.outputs)),
        "loss": req.loss or "",
    }
    kept = [p for p in m.metadata_props if not p.key.startswith(META_PREFIX)]
    del m.metadata_props[:]
    m.metadata_props.extend(kept)
    for k, v in meta.items():
        m.metadata_props.add(key=META_PREFIX + k, value=v)
    return m


def read_metadata(model: onnx.ModelProto) -> dict[str, object]:
    """The build facts stored in a training graph: wrt, gradients (wrt -> output), zero_gradient (and per output:
    zero_gradient_of), no_gradient, outputs, loss."""
    raw = {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
    out: dict[str, object] = {"loss": raw.get("loss") or None}
    try:
        out["wrt"] = [str(w) for w in json.loads(raw.get("wrt", "[]"))]
        out["gradients"] = {str(w): str(g) for w, g in json.loads(raw.get("gradients", "[]"))}
        out["zero_gradient"] = [str(w) for w in json.loads(raw.get("zero_gradient", "[]"))]
        out["zero_gradient_of"] = {str(o): [str(w) for w in ws]
                                   for o, ws in json.loads(raw.get("zero_gradient_of", "{}")).items()}
        out["no_gradient"] = {str(w): str(r) for w, r in json.loads(raw.get("no_gradient", "{}")).items()}
        out["outputs"] = [str(o) for o in json.loads(raw.get("outputs", "[]"))]
    except (ValueError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise SplitError(f"the {META_PREFIX}* metadata of the training graph is damaged ({e}); rebuild it with "
                         "`gradbuilder build`.") from None
    return out
