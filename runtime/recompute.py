"""Backward recomputes checkpointed regions instead of reading their activations from the stash, as torch does.

A forward node tagged with a region number (`KEY` in its metadata: `runtime/checkpoints.py` tags torch's
checkpointed calls) makes tensors backward may recompute: the region's own values, not those read outside it
(its outputs, the module's outputs). Where backward first reads one, the nodes making it are copied into backward
just before that reader, from the region's inputs, parameters and constants (`passes.copied_into_backward`); the
stash then keeps the region's inputs instead of its activations, and one region's recomputed values are alive at a
time. Dropouts are not drawn again: their outputs are made from their input and the mask backward keeps. Ops that
draw random numbers or hold subgraphs are not copied: what they make stays in the stash.
"""

from __future__ import annotations

import onnx

from gradbuilder.graph import default_opset, subgraph_free_names
from gradbuilder.yield_op import find_yield

from .passes import constant_values, copied_into_backward, has_subgraph, pointwise, rebuildable_dropout

KEY = "gradbuilder.checkpoint"
"""The node metadata key holding the number of the checkpointed region a forward node belongs to."""
SHAPE_READERS = frozenset({"Shape", "Size"})
RANDOM = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                    "Multinomial"})


def region(node: onnx.NodeProto) -> int | None:
    """The checkpointed region `node` belongs to, if any."""
    for p in node.metadata_props:
        if p.key == KEY:
            return int(p.value)
    return None


def tag(node: onnx.NodeProto, number: int) -> None:
    for p in node.metadata_props:
        if p.key == KEY:
            p.value = str(number)
            return
    node.metadata_props.add(key=KEY, value=str(number))


def recompute_checkpointed(training: onnx.ModelProto, torch_masks: bool = False) -> list[str]:
    """Rewrite `training` (forward, Yield, backward) in place; returns the tensors backward now recomputes.
    `torch_masks`: as `passes.copied_into_backward`'s."""
    g = training.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    regions = {k: r for k, n in enumerate(nodes[:y]) if (r := region(n)) is not None}
    if not regions:
        return []
    consts = constant_values(g)
    opset = default_opset(training)
    made = {o: k for k, n in enumerate(nodes[:y]) for o in n.output if o}
    escaping = set(nodes[y].input) | {o.name for o in g.output}
    for k, n in enumerate(nodes[:y]):
        if n.op_type in SHAPE_READERS and not n.domain:  # the builder's Shapes for backward read no values
            continue
        for x in [*n.input, *subgraph_free_names(n)]:
            if x in made and made[x] in regions and regions[made[x]] != regions.get(k):
                escaping.add(x)

    def inside(x: str) -> bool:
        """Whether backward may make `x` again (else it reads the forward's, from the stash)."""
        k = made.get(x)
        if k is None or k not in regions or x in escaping:
            return False
        n = nodes[k]
        if n.op_type == "Dropout" and not n.domain:
            return x == n.output[0] and len(n.output) > 1 and bool(n.output[1]) \
                and rebuildable_dropout(n, consts, opset) is not None
        return (not n.domain or pointwise(n)) and n.op_type not in RANDOM and not has_subgraph(n)

    makers = {x: nodes[k] for x, k in made.items() if inside(x)}
    if not makers:
        return []
    backward, copied = copied_into_backward(g, nodes, y, makers, wait=True, torch_masks=torch_masks)
    del g.node[:]
    g.node.extend([*nodes[:y + 1], *backward])
    return copied


def region_masks(training: onnx.ModelProto) -> frozenset[str]:
    """The masks of the training Dropouts inside checkpointed regions, which torch draws again in backward."""
    return frozenset(n.output[1] for n in training.graph.node[:find_yield(list(training.graph.node))]
                     if n.op_type == "Dropout" and not n.domain and len(n.output) > 1 and n.output[1]
                     and region(n) is not None)
