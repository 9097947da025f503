"""torch's activation checkpointing kept through the exporters, so that backward recomputes what torch would.

`torch.utils.checkpoint.checkpoint` saves only a region's inputs and runs the region again when backward needs
what it computed. The exporters trace through it: the graph computes the region once, and the runtime's stash kept
its activations, 4x torch's saved bytes on a stack of checkpointed MLP blocks. While exporting, each checkpointed
call is traced plainly between boundary markers (a `CheckpointBoundary` op on every float
tensor going in and coming out); after the export, the nodes between a region's markers are tagged with its
number (`recompute.KEY` in the node's metadata) and the markers removed. `recompute.recompute_checkpointed` then
copies a region's nodes into backward where backward reads what they made, so the stash keeps the region's inputs
instead, as torch's does.

Under the dynamo exporter the marker is a torch custom op (`gradbuilder::checkpoint_boundary`, a copy in eager
runs) translated to the same ONNX op (`translations`). A reentrant checkpoint of inputs none of which requires grad
gives no gradients inside (torch computes it under no_grad): it is exported as torch defines it, unmarked. So are
calls with a `context_fn` (selective checkpointing: which ops to save is torch's policy, not a region's).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import onnx
import torch
import torch.utils.checkpoint as torch_checkpoint
from onnx import defs
from torch.utils import _pytree as pytree

from gradbuilder.stop_gradient import register_identity_schema
from gradbuilder.yield_op import DOMAIN

from .recompute import tag

OP_TYPE = "CheckpointBoundary"


class _Boundary(torch.autograd.Function):
    """The identity, exported as a marker of region `region`'s inputs (`side` "in") or outputs ("out")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, region: int, side: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return dy, None, None

    @staticmethod
    def symbolic(g: Any, x: Any, region: int, side: str) -> Any:
        out = g.op(f"{DOMAIN}::{OP_TYPE}", x, region_i=region, side_s=side)
        out.setType(x.type())
        return out


@torch.library.custom_op("gradbuilder::checkpoint_boundary", mutates_args=())
def _boundary_op(x: torch.Tensor, region: int, side: str) -> torch.Tensor:
    """The marker under torch.export, which keeps custom ops whole (a custom op may not return its input)."""
    return x.clone()


_boundary_op.register_fake(lambda x, region, side: torch.empty_like(x))
_boundary_op.register_autograd(lambda ctx, dy: (dy, None, None))


@functools.cache
def translations() -> dict[Any, Any]:
    """The dynamo exporter's translation of the marker (its `custom_translation_table`). onnxscript loads here,
    not with the runtime (half a second)."""
    from onnxscript import values

    attribute = defs.OpSchema.Attribute
    register_identity_schema(OP_TYPE, "The identity, marking an input or output of a checkpointed region.",
                             [attribute("region", defs.OpSchema.AttrType.INT, "the region's number"),
                              attribute("side", defs.OpSchema.AttrType.STRING, "in or out")])
    opset = values.Opset(DOMAIN, 1)

    def translate(x: Any, region: int, side: str) -> Any:
        return getattr(opset, OP_TYPE)(x, region=region, side=side)

    return {torch.ops.gradbuilder.checkpoint_boundary.default: translate}


def _marked(tree: Any, region: int, side: str, legacy: bool) -> Any:
    mark = _Boundary.apply if legacy else torch.ops.gradbuilder.checkpoint_boundary
    return pytree.tree_map_only(torch.Tensor, lambda t: mark(t, region, side) if t.is_floating_point() else t, tree)


def _marking(original: Any, counter: Iterator[int] | None, legacy: bool) -> Any:
    """`checkpoint` as the export sees it: the function called plainly between markers (no markers without
    `counter`), or torch's own where its semantics differ from a plain call (see the module docstring; a `context_fn`
    only where marking)."""

    def checkpoint(function: Any, *args: Any, use_reentrant: bool | None = None,
                   context_fn: Any = torch_checkpoint.noop_context_fn, **kwargs: Any) -> Any:
        reentrant = True if use_reentrant is None else use_reentrant  # torch's default, which it warns about
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        nothing_requires_grad = not any(t.requires_grad for t in tensors)
        if (reentrant and nothing_requires_grad) or (counter is not None and (
                context_fn is not torch_checkpoint.noop_context_fn or not any(t.is_floating_point() for t in tensors))):
            return original(function, *args, use_reentrant=use_reentrant, context_fn=context_fn, **kwargs)
        for option in ("preserve_rng_state", "determinism_check", "debug", "early_stop"):
            kwargs.pop(option, None)
        if reentrant and kwargs:
            raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))  # as torch's own check
        if counter is None:
            return function(*args, **kwargs)
        region = next(counter)
        return _marked(function(*_marked(args, region, "in", legacy), **kwargs), region, "out", legacy)

    return checkpoint


def exportable_checkpoints(legacy: bool) -> contextlib.AbstractContextManager[None]:
    """Checkpointed calls marked while the block lasts (an export, under its lock)."""
    return _checkpoint_as(lambda original: _marking(original, itertools.count(), legacy))


def plain_checkpoints() -> contextlib.AbstractContextManager[None]:
    """Checkpointed calls run plainly while the block lasts, their activations kept: torch's module computing a
    call again for a create_graph backward (`replay`), whose regions a later backward would otherwise compute again
    drawing their own random numbers, not the forward's."""
    return _checkpoint_as(lambda original: _marking(original, None, False))


@contextlib.contextmanager
def _checkpoint_as(replacement: Any) -> Iterator[None]:
    """torch's `checkpoint` replaced by `replacement(original)` while the block lasts. It is a dynamo-disabling
    wrapper around the function it calls (`fn`, a closure cell): that cell is swapped, so that references taken
    before (Hugging Face's `functools.partial(checkpoint, ...)`) see it too."""
    wrapper = torch_checkpoint.checkpoint
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    cell = cells.get("fn")
    if cell is None or not callable(cell.cell_contents):
        yield
        return
    original = cell.cell_contents
    swapped = replacement(original)
    swapped.__dynamo_disable = swapped  # the wrapper's cache of its disabled fn
    cell.cell_contents = swapped
    try:
        yield
    finally:
        cell.cell_contents = original


def is_boundary(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain == DOMAIN


def _marks(node: onnx.NodeProto) -> tuple[int, bool]:
    """A marker's region, and whether it marks an input of it."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return int(attrs["region"]), attrs["side"] in (b"in", "in")


def tag_regions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exported model without its boundary markers, each region's nodes tagged with its number: the nodes
    after the region's first input marker that its output markers' values depend on, up to its inputs. Nested
    regions take the outermost's number (backward recomputes the outer one from its inputs, as torch does)."""
    g = model.graph
    nodes = list(g.node)
    markers = [(k, n) for k, n in enumerate(nodes) if is_boundary(n)]
    if not markers:
        return model
    start: dict[int, int] = {}
    ends: dict[int, list[str]] = {}
    for k, n in markers:
        r, entering = _marks(n)
        if entering:
            start[r] = min(start.get(r, k), k)
        else:
            ends.setdefault(r, []).append(n.input[0])
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    tags: dict[int, int] = {}
    for r in sorted(ends, reverse=True):  # outer regions (smaller numbers) tag last
        if r not in start:
            continue
        stack = list(ends[r])
        seen: set[int] = set()
        while stack:
            k = producer.get(stack.pop(), -1)
            if k < start[r] or k in seen:
                continue
            seen.add(k)
            n = nodes[k]
            if is_boundary(n) and _marks(n) == (r, True):
                continue
            tags[k] = r
            stack.extend(x for x in n.input if x)
    alias = {n.output[0]: n.input[0] for _, n in markers}
    outputs = {o.name for o in g.output}
    kept: list[onnx.NodeProto] = []
    for k, n in enumerate(nodes):
        if is_boundary(n):
            if n.output[0] in outputs:  # a graph output keeps its name
                kept.append(onnx.helper.make_node("Identity", [_resolved(n.input[0], alias)], [n.output[0]]))
            continue
        _rename_inputs(n, alias)
        if k in tags:
            tag(n, tags[k])
        kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    stale = [vi for vi in g.value_info if vi.name in alias]
    for vi in stale:
        g.value_info.remove(vi)
    return model


def _resolved(name: str, alias: dict[str, str]) -> str:
    while name in alias:
        name = alias[name]
    return name


def _rename_inputs(node: onnx.NodeProto, alias: dict[str, str]) -> None:
    """`node`'s inputs, and those its subgraphs read from outside, through `alias`."""
    for i, x in enumerate(node.input):
        if x in alias:
            node.input[i] = _resolved(x, alias)
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for n in sub.node:
                _rename_inputs(n, alias)
