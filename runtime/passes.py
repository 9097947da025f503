"""Rewrites of a training graph for onnxruntime's CPU provider: stash less, run faster.

`relu_after_pool` rewrites the forward source before the gradient is built;
`shrink_stash` runs between the gradient build and the split (it decides what crosses the Yield); `lower` runs
on each half before its session is created (`lowering` says which runs when). Each rewrite keeps what the
graph computes, except `lower`'s masked multiply (see there). Measured effects are in docs/performance.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from gradbuilder.graph import default_opset, infer_shapes_safely, subgraph_free_names
from gradbuilder.inference import as_floor_mode, ceil_mode_pools, same_values, static_dims, tensor_types
from gradbuilder.rules.linalg import MICROSOFT
from gradbuilder.yield_op import find_yield

CHEAP = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Cast", "Expand", "Shape",
                   "Size", "Constant", "ConstantOfShape"})
"""Ops that only move or reinterpret data: recomputing them from tensors backward has anyway costs one copy
at most, and saves keeping their result alive from forward to backward."""

POINTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Erf", "Tanh", "Sigmoid", "Exp", "Sqrt", "Reciprocal",
                       "Abs", "Relu", "Pow"})
"""Elementwise ops whose results backward recomputes from tensors it keeps anyway (as inductor does)."""
CONTRIB_POINTWISE = frozenset({(MICROSOFT, "Gelu"), (MICROSOFT, "FastGelu")})
"""onnxruntime's elementwise contrib ops the runtime writes (`gelus`), recomputed like `POINTWISE`."""
REMAT_DEPTH = 6


def pointwise(n: onnx.NodeProto) -> bool:
    """An elementwise op of one output that backward may compute again from its inputs."""
    if n.domain:
        return len(n.output) == 1 and (n.domain, n.op_type) in CONTRIB_POINTWISE
    return len(n.output) == 1 and n.op_type in POINTWISE


COMPARE = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal"})

MASKABLE = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "ScatterElements", "ScatterND", "MaxUnpool"})
"""Producers of a Where's kept operand for which `lower` multiplies by the mask (also through rearrangements,
broadcasts, multiplications and divisions by a constant and sums of such): linear maps of the incoming gradient,
which hold inf/nan only when that gradient or a weight already does."""

VIEWS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
"""Ops whose output onnxruntime lays on its input's memory, except when that output is a graph output: then it
copies (the logits of GPT-2's loss, 25 MB: 3 ms alone, 16 ms in the step's profile)."""

REARRANGE = VIEWS | {"Transpose"}

BROADCASTS = frozenset({"Expand", "Tile"})
"""Ops that repeat their input's elements (a mean's gradient, dY / count spread back over the reduced axes)."""

SHAPE_ARITHMETIC = frozenset({"Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Mul", "Div", "Add", "Sub", "Cast",
                              "ReduceProd", "Reshape", "Identity"})
"""Ops that compute a view's target from `Shape` outputs and constants (the exporter's reshapes)."""

FLOATS = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE})


def constant_values(graph: onnx.GraphProto, wanted: Callable[[TensorProto], bool] | None = None
               ) -> dict[str, np.ndarray]:
    """Values of the initializers and Constant nodes (tensor-valued) of a graph; only those `wanted` accepts,
    when given (tested before converting)."""
    tensors = [(t.name, t) for t in graph.initializer]
    tensors += [(n.output[0], a.t) for n in graph.node if n.op_type == "Constant" and not n.domain
                for a in n.attribute if a.name == "value"]
    return {name: onnx.numpy_helper.to_array(t) for name, t in tensors if wanted is None or wanted(t)}


def pads_with_zeros(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> bool:
    """A Pad in constant mode whose fill is absent or a known zero (explicit `axes` allowed)."""
    if node.op_type != "Pad" or node.domain:
        return False
    if next((a.s for a in node.attribute if a.name == "mode"), b"constant") != b"constant":
        return False
    fill = node.input[2] if len(node.input) > 2 else ""
    return not fill or (fill in consts and not consts[fill].any())


def rename_tensors(g: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename tensors produced by nodes (and their uses, including inside subgraphs)."""
    if not mapping:
        return
    for n in g.node:
        for seq in (n.input, n.output):
            for i, x in enumerate(seq):
                if x in mapping:
                    seq[i] = mapping[x]
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                rename_tensors(sub, mapping)
    for vi in g.value_info:
        if vi.name in mapping:
            vi.name = mapping[vi.name]


def forget_types(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Drop the value_info of tensors a rewrite removed (their types would outlive them)."""
    gone = set(names)
    kept = [v for v in graph.value_info if v.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


REMAT = "__remat"
"""The suffix of a forward tensor's copy in backward (`rematerialize`; `fresh_name` may add digits)."""


def forward_name(name: str) -> str:
    """The forward tensor a backward copy (`REMAT`) recomputes; other names as they are."""
    base, found, digits = name.rpartition(REMAT)
    return base if found and (not digits or digits.isdigit()) else name


def fresh_name(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}{k}"
    taken.add(name)
    return name


class Nodes:
    """Emits the nodes of one rewrite, named after `base` (fresh names from `taken`, which `fresh_name` extends);
    `domain` and the attributes go to `helper.make_node`."""

    def __init__(self, base: str, taken: set[str]):
        self.base, self.taken, self.nodes = base, taken, []

    def __call__(self, op: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        name = out or fresh_name(f"{self.base}/{op}", self.taken)  # `out`: the replaced node's own output name
        node_name = fresh_name(f"{name}_node", self.taken)
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=node_name, **attrs))
        return name

    def many(self, op: str, *inputs: str, count: int, **attrs: object) -> list[str]:
        """A node of `count` outputs (a Split); returns their names."""
        names = [fresh_name(f"{self.base}/{op}_{i}", self.taken) for i in range(count)]
        self.nodes.append(helper.make_node(op, list(inputs), names, name=fresh_name(f"{self.base}/{op}_node",
                                                                                  self.taken), **attrs))
        return names

    def const(self, value: int) -> str:
        return self("Constant", value=helper.make_tensor("v", TensorProto.INT64, [], [value]))

    def axes(self, values: list[int]) -> str:
        return self("Constant", value=helper.make_tensor("v", TensorProto.INT64, [len(values)], values))


class Readers(NamedTuple):
    """Who makes and who reads each tensor of a graph: what a rewrite checks the nodes it replaces against."""

    producer: dict[str, onnx.NodeProto]
    reads: Counter[str]
    outputs: set[str]

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> Readers:
        return cls({o: n for n in graph.node for o in n.output}, Counter(i for n in graph.node for i in n.input),
                   {o.name for o in graph.output})

    def sole(self, name: str) -> onnx.NodeProto | None:
        """The producer of `name` when one node alone reads it and it is no graph output."""
        return self.producer.get(name) if self.reads[name] == 1 and name not in self.outputs else None


def names_in_use(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a graph defines: node outputs, inputs, initializers (for picking fresh ones)."""
    return ({o for n in graph.node for o in n.output} | {i.name for i in graph.input} |
            {t.name for t in graph.initializer})


def shrink_stash(training: onnx.ModelProto, wait: bool = False, torch_masks: bool = False) -> None:
    """Make backward keep fewer bytes from forward, in place: `relu_dropout_masks`, `rematerialize` (its copies made
    to `wait` for their readers' inputs: `copied_into_backward`, Dropout outputs in torch's arithmetic with
    `torch_masks`), `hoist_masks`, then `joined_selects`."""
    relu_dropout_masks(training)
    rematerialize(training, wait, torch_masks)
    hoist_masks(training)
    joined_selects(training)


def relu_dropout_masks(training: onnx.ModelProto) -> list[str]:
    """Relu followed by a training Dropout (a feed-forward block's `dropout(relu(h))`): backward masks with
    `d > 0` on the Dropout's output d, which holds exactly where both the Relu and the Dropout let the gradient
    through (the scale is positive), so the Dropout's gradient drops its own mask product: Where(y > 0,
    dd * mask * scale, 0) becomes Where(d > 0, dd * scale, 0). Backward then keeps d, which the next layer's
    weight gradient reads anyway, instead of the Relu's output and the mask (a byte an element less) and runs
    three elementwise nodes fewer (the mask's Cast and product, and recomputing d). Only where the Relu's
    output feeds nothing else, and the mask and Greater nothing but these gradients; an inf or nan gradient
    arriving at a dropped element gives 0 there instead of nan until `lower` makes the Where a product again.
    In place; returns the Relu outputs backward no longer reads."""
    g = training.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    consts = constant_values(g, lambda t: not t.dims)
    forward = nodes[:y]
    in_forward = {id(n) for n in forward}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for x in set(n.input):
            readers.setdefault(x, []).append(n)
    made = {o: n for n in nodes for o in n.output if o}
    outputs = {o.name for o in g.output} | set(nodes[y].input)

    def only(name: str, op: str) -> onnx.NodeProto | None:
        users = readers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and not users[0].domain \
            and name not in outputs else None

    dead: set[int] = set()
    freed = []
    for drop in forward:
        if drop.op_type != "Dropout" or drop.domain or len(drop.output) < 2 or not drop.output[1]:
            continue
        ratio = training_ratio(drop, consts)
        relu = made.get(drop.input[0])
        if ratio is None or not 0.0 <= ratio < 1.0 or relu is None or relu.op_type != "Relu" or relu.domain:
            continue
        h_out, (d, mask) = relu.output[0], drop.output[:2]
        forward_users = [n for n in readers.get(h_out, []) if id(n) in in_forward]
        greater = [n for n in readers.get(h_out, []) if id(n) not in in_forward]
        if len(forward_users) != 1 or forward_users[0] is not drop or h_out in outputs or len(greater) != 1 \
                or greater[0].op_type != "Greater" or greater[0].input[0] != h_out \
                or not _is_zero(consts.get(greater[0].input[1])):
            continue
        where = only(greater[0].output[0], "Where")
        cast = only(mask, "Cast") or only(mask, "CastLike")
        kept = only(cast.output[0], "Mul") if cast is not None else None
        scaled = only(kept.output[0], "Mul") if kept is not None else None
        if where is None or scaled is None or where.input[0] != greater[0].output[0] \
                or where.input[1] != scaled.output[0] or only(scaled.output[0], "Where") is not where:
            continue
        incoming = kept.input[1] if kept.input[0] == cast.output[0] else kept.input[0]
        greater[0].input[0] = d
        scaled.input[list(scaled.input).index(kept.output[0])] = incoming
        dead.update((id(cast), id(kept)))
        freed.append(h_out)
    if dead:
        del g.node[:]
        g.node.extend(n for n in nodes if id(n) not in dead)
    return freed


def _is_zero(value: np.ndarray | None) -> bool:
    return value is not None and value.size == 1 and not value.any()


def rematerialize(training: onnx.ModelProto, wait: bool = False, torch_masks: bool = False) -> list[str]:
    """Backward recomputes instead of reading from the stash: (1) cheap functions (`CHEAP` ops) of graph inputs
    and initializers, such as a flattened input or a transposed weight: feeds are kept by the caller anyway,
    and onnxruntime can fuse the forward's Transpose into its MatMul once the transposed weight is no longer
    a graph output; (2) elementwise results (`POINTWISE`) of tensors the stash keeps anyway, such as GELU's
    x / sqrt(2) and 1 + erf(...) from x, and Dropout outputs from their input and the mask backward keeps,
    at most `REMAT_DEPTH` ops deep; (3) a view (`VIEWS`) of a tensor another op makes in forward: backward
    keeps that tensor instead, the same bytes, and views it itself, so the forward's view is no graph output
    and onnxruntime does not copy it. Nothing else is added to the stash.
    Returns the tensors no longer stashed."""
    g = training.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    free = {i.name for i in g.input} | {t.name for t in g.initializer}
    maker: dict[str, onnx.NodeProto] = {}
    made: dict[str, onnx.NodeProto] = {}
    for n in nodes[:y]:
        cheap = n.op_type in CHEAP and not n.domain and not has_subgraph(n)
        for o in n.output:
            if o:
                made[o] = n
        if cheap and all(not x or x in free for x in n.input):
            for o in n.output:
                if o:
                    free.add(o)
                    maker[o] = n
    module_outputs = set(nodes[y].input)
    stash = {x for n in nodes[y + 1:] for x in n.input if x in made and x not in maker}
    consts = constant_values(g)
    opset = default_opset(training)
    depth: dict[str, int] = {}

    def recomputable(name: str, level: int) -> bool:
        """Whether `name` can be made in backward from the stash, feeds and constants by pointwise ops."""
        if not name or name in free or (name in stash and level > 0):
            return True
        n = made.get(name)
        if n is None or (n.domain and not pointwise(n)) or level >= REMAT_DEPTH or name in module_outputs:
            return False
        if level == 0 and len(n.output) == 1 and viewed(n):  # keep what it views instead
            stash.add(n.input[0])
            depth[name] = level
            return True
        if n.op_type == "Dropout":  # its output again from its input and the mask backward keeps anyway
            inputs = [n.input[0]] if name == n.output[0] and len(n.output) > 1 and n.output[1] in stash \
                and rebuildable_dropout(n, consts, opset) is not None else None
        else:
            inputs = list(n.input) if pointwise(n) else None
        if inputs is None:
            return False
        if name in depth:
            return depth[name] <= level
        if all(recomputable(x, level + 1) for x in inputs):
            depth[name] = level
            return True
        return False

    def viewed(n: onnx.NodeProto) -> bool:
        """A view of a forward tensor that no view makes (a view of a view: that one's source is kept), whose
        target backward can compute again (`sized`): the view's targets are marked for recomputing."""
        source = made.get(n.input[0]) if n.op_type in VIEWS and n.input and n.input[0] not in free else None
        if source is None or (source.op_type in VIEWS and not source.domain):
            return False
        chain: list[str] = []
        if not all(sized(x, n.input[0], chain) for x in n.input[1:]):
            return False
        depth.update((x, 0) for x in chain)
        return True

    def sized(name: str, source: str, chain: list[str]) -> bool:
        """Whether `name` is shape arithmetic (`SHAPE_ARITHMETIC`) over constants, feeds and the `Shape` of a
        tensor backward keeps (or of `source`): then backward redoes it (its nodes go to `chain`) instead of
        keeping the result."""
        if not name or name in free or name in depth:
            return True
        n = made.get(name)
        if n is None or n.domain or has_subgraph(n):
            return False
        if n.op_type == "Shape":
            ok = n.input[0] == source or n.input[0] in free or n.input[0] in stash
        else:
            ok = n.op_type in SHAPE_ARITHMETIC and all(sized(x, source, chain) for x in n.input)
        if ok:
            chain.append(name)
        return ok

    changed = True
    while changed:  # a view kept for another can make a Shape its target reads available: try again
        changed = False
        for t in sorted(stash):
            if t not in depth and recomputable(t, 0):
                stash.discard(t)
                changed = True
    for t, n in made.items():
        if t in depth:
            maker[t] = n
    module_reads = module_outputs
    wanted = [x for n in nodes[y + 1:] for x in n.input if x in maker and x not in module_reads]
    if not wanted:
        return []
    backward, copied = copied_into_backward(g, nodes, y, {x: n for x, n in maker.items() if x not in module_reads},
                                            wait=wait, torch_masks=torch_masks)
    forward = drop_dead(nodes[:y], [nodes[y], *backward], {o.name for o in g.output})
    del g.node[:]
    g.node.extend([*forward, nodes[y], *backward])
    return copied


def rebuildable_dropout(node: onnx.NodeProto, consts: Mapping[str, np.ndarray], opset: int) -> float | None:
    """The ratio of a Dropout whose output backward can make again from its input and mask: in training mode with a
    known ratio below 1, at opset 15+ (below, `training_mode` is not an input)."""
    ratio = training_ratio(node, consts) if opset >= 15 else None
    return ratio if ratio is not None and ratio < 1.0 else None


def copied_into_backward(g: onnx.GraphProto, nodes: list[onnx.NodeProto], y: int,
                         makers: Mapping[str, onnx.NodeProto], *, wait: bool = False, torch_masks: bool = False
                         ) -> tuple[list[onnx.NodeProto], list[str]]:
    """The backward nodes (`nodes` after the Yield at `y`) with what `makers` makes copied in where they read it: each
    group of copies right before its first reader, after the copies of the `makers` tensors it reads; with `wait`,
    each group waits (`waiting_for`) for a backward tensor its reader reads, so that onnxruntime, running the graph in
    its order (`SessionConfig.graph_order`), does not run every group first and hold all they make at once. A Dropout
    (its output in `makers`) is rebuilt from its input and the mask backward keeps (`dropout_output`;
    `rebuildable_dropout`), in the arithmetic its forward computes it with: torch's where the host draws its mask
    as torch's (`torch_masks`; `host_dropout.mask_dropouts` takes every such Dropout of a graph without bodies),
    else onnxruntime's. Readers are rewired to the copies. Returns the new backward nodes and the tensors backward
    first read that it now makes itself."""
    taken = names_in_use(g)
    consts = constant_values(g)
    waits = {o for n in nodes[:y] for o in n.output if o} | {i.name for i in g.input} if wait else set()
    waits -= {t.name for t in g.initializer}
    # the float type backward already casts each Dropout mask to (the Dropout rule's Cast): a recomputed output
    # casting the same way shares that Cast once onnxruntime merges equal nodes
    mask_types = {n.input[0]: a.i for n in nodes[y + 1:] if n.op_type == "Cast" and not n.domain
                  for a in n.attribute if a.name == "to" and a.i in FLOATS}
    as_torch = torch_masks and not any(has_subgraph(n) for n in nodes[:y])
    rename: dict[str, str] = {}

    def copy(name: str, out: list[onnx.NodeProto]) -> None:
        stack = [(name, False)]
        while stack:
            x, ready = stack.pop()
            if x in rename:
                continue
            src = makers[x]
            dropout = src.op_type == "Dropout" and not src.domain
            sources = [src.input[0]] if dropout else [i for i in src.input if i]
            if not ready:
                stack.append((x, True))
                stack.extend((i, False) for i in sources if i in makers and i not in rename)
            elif dropout:
                rename[x] = fresh_name(f"{x}{REMAT}", taken)
                mask = src.output[1]
                ratio = training_ratio(src, consts) or 0.0
                out.extend(dropout_output(rename.get(src.input[0], src.input[0]), mask,
                                          written_rate(ratio) if as_torch else ratio, rename[x], g, taken,
                                          mask_types.get(mask), as_torch))
            else:
                clone = onnx.NodeProto()
                clone.CopyFrom(src)
                del clone.metadata_props[:]
                clone.name = fresh_name(f"{src.name or src.op_type}{REMAT}", taken)
                for i, v in enumerate(clone.input):
                    clone.input[i] = rename.get(v, v)
                for i, o in enumerate(clone.output):
                    if o:
                        rename[o] = clone.output[i] = fresh_name(f"{o}{REMAT}", taken)
                out.append(clone)

    backward: list[onnx.NodeProto] = []
    copied: list[str] = []
    produced = {o for o in nodes[y].output if o}  # the host's gradients first
    latest = next((o for o in reversed(nodes[y].output) if o), "")
    for n in nodes[y + 1:]:
        group: list[onnx.NodeProto] = []
        for x in n.input:
            if x in makers and x not in rename:
                copied.append(x)
                copy(x, group)
        if group:
            anchor = next((x for x in n.input if x in produced), latest)
            earlier = set(rename.values()) - {o for c in group for o in c.output}
            backward.extend(waiting_for(group, anchor, earlier, waits, taken) if anchor and wait else group)
        backward.append(n)
        for i, x in enumerate(n.input):
            if x in rename:
                n.input[i] = rename[x]
        latest = next((o for o in reversed(n.output) if o), latest)
        produced.update(n.output)
    return backward, copied


def waiting_for(group: list[onnx.NodeProto], anchor: str, copies: set[str], waits: set[str], taken: set[str]
                ) -> list[onnx.NodeProto]:
    """`group` made to wait for `anchor`. onnxruntime's default order walks back from the graph's outputs and ran every
    checkpointed region's recomputation first (a stack of 8 checkpointed MLP blocks: 588 MB at the backward's peak
    against 196); its priority-based order (`SessionConfig.graph_order`) takes the ready node first in the graph, but
    the nodes its optimizers make come last. So each copy that reads no waiting copy reads its first input in `waits`
    through a Reshape to that input's own shape joined with an empty slice of `anchor`'s values: a view, no copy, and a
    data dependency on the backward tensor the group's first reader reads (a slice of `anchor`'s shape would not do:
    onnxruntime folds the Shape of a tensor of static shape to a constant)."""
    emit = Nodes(f"{anchor}__wait", taken)
    empty = ""
    waited: dict[str, str] = {}
    waiting = set(copies)  # the copies made after their own anchor, and those of this group that wait
    for c in group:
        if not any(x in waiting for x in c.input):
            k = next((k for k, x in enumerate(c.input) if x in waits), -1)
            if k < 0:
                continue
            x = c.input[k]
            if not empty:
                flat = emit("Reshape", anchor, emit.axes([-1]))
                empty = emit("Cast", emit("Slice", flat, emit.axes([0]), emit.axes([0])), to=TensorProto.INT64)
            if x not in waited:
                waited[x] = emit("Reshape", x, emit("Concat", emit("Shape", x), empty, axis=0))
            c.input[k] = waited[x]
        waiting.update(c.output)
    return [*emit.nodes, *group]


def training_ratio(node: onnx.NodeProto, consts: Mapping[str, np.ndarray]) -> float | None:
    """The ratio of a Dropout known to be in training mode (a constant true `training_mode`) with a known
    ratio (a constant, or the default 0.5), else None."""
    mode = node.input[2] if len(node.input) > 2 else ""
    if not mode or mode not in consts or not bool(consts[mode]):
        return None
    ratio = node.input[1] if len(node.input) > 1 else ""
    if not ratio:
        return 0.5
    return float(consts[ratio]) if ratio in consts else None


def written_rate(ratio: float) -> float:
    """A Dropout's rate as the module wrote it (0.1, not float32's 0.10000000149): torch's dropout draws and
    scales with that double."""
    return float(str(np.float32(ratio)))


def dropout_output(x: str, mask: str, ratio: float, out: str, g: onnx.GraphProto, taken: set[str],
                   elem: int | None = None, as_torch: bool = False) -> list[onnx.NodeProto]:
    """Nodes computing Dropout's output from its input and its boolean mask, bit for bit what onnxruntime's
    Dropout returns: `mask * x / (1 - ratio)`, the divisor taken in float32 (then in x's type). `elem`: x's
    element type when known (plain Casts, a typed divisor), else CastLikes to x. `as_torch`: bit for bit what
    torch's dropout returns instead, `x * (mask * s)` with s = 1 / (1 - ratio) in x's type (its noise, `div_` by the
    double 1 - ratio, which a float32 tensor takes as a float32: a float64 one's s in float32 was 5e-8 off)."""
    nodes = Nodes(out, taken)
    if as_torch:
        if elem is None:  # 1 / (1 - ratio) computed in x's type, from 1 - ratio in double
            one, keep = fresh_name(f"{out}/one", taken), fresh_name(f"{out}/keep", taken)
            g.initializer.extend([helper.make_tensor(one, TensorProto.DOUBLE, [], [1.0]),
                                  helper.make_tensor(keep, TensorProto.DOUBLE, [], [1.0 - ratio])])
            scale = nodes("Div", nodes("CastLike", one, x), nodes("CastLike", keep, x))
            noise = nodes("Mul", nodes("CastLike", mask, x), scale)
        else:
            scale = fresh_name(f"{out}/scale", taken)
            kind = onnx.helper.tensor_dtype_to_np_dtype(elem).type
            g.initializer.append(helper.make_tensor(scale, elem, [], [float(kind(1) / kind(1.0 - ratio))]))
            noise = nodes("Mul", nodes("Cast", mask, to=elem), scale)
        nodes("Mul", x, noise, out=out)
        return nodes.nodes
    keep = fresh_name(f"{out}/keep", taken)
    value = float(np.float32(1) - np.float32(ratio))
    if elem is not None:
        g.initializer.append(helper.make_tensor(keep, elem, [], [value]))
        kept = nodes("Mul", x, nodes("Cast", mask, to=elem))
    else:
        g.initializer.append(helper.make_tensor(keep, TensorProto.FLOAT, [], [value]))
        kept = nodes("Mul", x, nodes("CastLike", mask, x))
        keep = nodes("CastLike", keep, x)
    nodes("Div", kept, keep, out=out)
    return nodes.nodes


def drop_dead(forward: list[onnx.NodeProto], later: Iterable[onnx.NodeProto], outputs: set[str]
               ) -> list[onnx.NodeProto]:
    """Forward nodes whose outputs something still reads (rematerializing can leave helpers unread)."""
    read = set(outputs) | {x for n in later for x in n.input}
    for n in later:  # subgraphs read outer names implicitly
        if has_subgraph(n):
            return forward
    keep = []
    for n in reversed(forward):
        if has_subgraph(n) or any(o in read for o in n.output if o) or n.op_type.startswith("Random") \
                or n.op_type in ("Dropout", "Multinomial"):
            keep.append(n)
            read.update(n.input)
            if has_subgraph(n):  # what its bodies read from outside
                read.update(subgraph_free_names(n))
    return keep[::-1]


def hoist_masks(training: onnx.ModelProto) -> list[str]:
    """Comparisons of a stashed tensor with a constant (Relu's `y > 0`) move into the forward part when
    nothing else in backward reads that tensor: backward then keeps a boolean mask, a byte an element,
    instead of the tensor. Tensors backward reads anyway (Relu's output feeding the next MatMul's weight
    gradient) stay, and their comparison stays in backward. Returns the tensors no longer stashed."""
    g = training.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    consts = constant_values(g)
    forward_made = {o for n in nodes[:y] for o in n.output if o}
    module_outputs = set(nodes[y].input)
    initializers = {t.name for t in g.initializer}
    backward = nodes[y + 1:]
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in backward:
        for x in set(n.input):
            readers.setdefault(x, []).append(n)

    def is_mask(n: onnx.NodeProto, t: str) -> bool:
        if n.op_type not in COMPARE or n.domain or len(n.input) != 2 or t not in n.input:
            return False
        other = n.input[1] if n.input[0] == t else n.input[0]
        value = consts.get(other) if other in initializers else None
        return value is not None and value.size == 1 and value.dtype.itemsize > 1

    moved: list[onnx.NodeProto] = []
    freed = []
    for t, users in readers.items():
        if t in forward_made and t not in module_outputs and all(is_mask(n, t) for n in users):
            moved.extend(users)
            freed.append(t)
    if not moved:
        return []
    ids = {id(n) for n in moved}
    del g.node[:]
    g.node.extend([*nodes[:y], *moved, nodes[y], *(n for n in backward if id(n) not in ids)])
    return freed


def zero_selection(n: onnx.NodeProto, is_zero: Callable[[str], bool]) -> tuple[str, str, str, bool] | None:
    """(condition, kept operand, zero, whether the condition picks the zero) of `Where(c, a, 0)` or
    `Where(c, 0, a)`, the zero an input `is_zero` accepts, else None."""
    if n.op_type != "Where" or n.domain or len(n.input) != 3:
        return None
    for kept, other, negate in ((1, 2, False), (2, 1, True)):
        if is_zero(n.input[other]):
            return n.input[0], n.input[kept], n.input[other], negate
    return None


def _positive_zero(value: np.ndarray | None) -> bool:
    """A rank-0 float +0.0."""
    return value is not None and value.ndim == 0 and value.dtype.kind == "f" and value == 0 and not np.signbit(value)


def joined_selects(training: onnx.ModelProto) -> int:
    """Backward's selections of a selection, `Where(c2, Where(c1, a, 0), 0)` (either condition possibly picking the
    zero: ReLU6's and hardtanh's gradients, a Relu's mask after a bound's), become one `Where(c1 and c2, a, 0)`,
    the same values bit for bit: onnxruntime then runs one mask's Cast and product over the gradient instead of two
    (`masked_products`), and where both conditions are made in the forward part (comparisons `hoist_masks` moved
    there, or the module's own) and backward reads them nowhere else, the joined mask is made there too, so backward
    keeps one boolean an element instead of two. In place; returns how many selections were joined."""
    g = training.graph
    nodes = list(g.node)
    y = find_yield(nodes)
    zeros = constant_values(g, lambda t: not t.dims)
    made = {o: n for n in nodes for o in n.output if o}

    def selection(n: onnx.NodeProto) -> tuple[str, str, str, bool] | None:
        return zero_selection(n, lambda t: _positive_zero(zeros.get(t)))

    forward_made = {o for n in nodes[:y] for o in n.output if o}
    reads = Counter(x for n in nodes for x in n.input)
    backward_reads = Counter(x for n in nodes[y + 1:] for x in n.input)
    outputs = {o.name for o in g.output} | set(nodes[y].input)
    taken = names_in_use(g)
    early: list[onnx.NodeProto] = []  # joined masks made in the forward part
    late: dict[int, list[onnx.NodeProto]] = {}  # joined masks made in backward, before their reader
    dead: set[int] = set()
    joined = 0
    for outer in nodes[y + 1:]:
        out = selection(outer)
        inner = made.get(out[1]) if out is not None else None
        into = selection(inner) if inner is not None and id(inner) not in dead else None
        if into is None or reads[out[1]] != 1 or out[1] in outputs or out[1] in forward_made \
                or zeros[into[2]].dtype != zeros[out[2]].dtype:
            continue
        # made in the forward part only where backward then reads neither condition: else it would keep three
        here = all(c in forward_made and backward_reads[c] == 1 for c in (out[0], into[0]))
        e = Nodes(outer.output[0] + "/joined", taken)
        conds = [e("Not", c) if negate else c for c, negate in ((into[0], into[3]), (out[0], out[3]))]
        mask = e("And", *conds)
        before = late.pop(id(inner), [])  # a joined mask of the inner selection's own, made in backward
        if here:
            early.extend(e.nodes)
            forward_made.add(mask)
            backward_reads[mask] = 1
        else:
            late[id(outer)] = [*before, *e.nodes]  # each outer selection is visited once
        del outer.input[:]
        outer.input.extend([mask, into[1], out[2]])
        dead.add(id(inner))
        joined += 1
    if joined:
        backward = []
        for n in nodes[y + 1:]:
            if id(n) not in dead:
                backward.extend([*late.get(id(n), []), n])
        del g.node[:]
        g.node.extend([*nodes[:y], *early, nodes[y], *backward])
    return joined


GUARD_MIN_ELEMENTS = 512
"""`guarded_selects` rewrites Wheres of at least this many static elements (a sample's, when the batch is
symbolic), where the product, its sum and the If's copy (~1 ns an element and a few kernel calls) cost less
than the Where (3.7-7 ns an element on a sign mask)."""


class Selects(NamedTuple):
    """What the Where rewrites (`masked_products`, `guarded_selects`) look up: constant values (with `known`),
    producers, and the boolean graph inputs (stashed masks)."""

    consts: dict[str, np.ndarray]
    producer: dict[str, onnx.NodeProto]
    booleans: set[str]

    @classmethod
    def of(cls, g: onnx.GraphProto, known: dict[str, np.ndarray] | None) -> Selects:
        return cls({**(known or {}), **constant_values(g)}, {o: n for n in g.node for o in n.output if o},
                   {i.name for i in g.input if i.type.tensor_type.elem_type == TensorProto.BOOL})

    def scalar(self, name: str) -> float | None:
        """The value of a one-element float constant, else None."""
        v = self.consts.get(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 and v.dtype.kind == "f" else None


def guarded_selects(model: onnx.ModelProto, known: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """The large float Wheres `masked_products` keeps, on onnxruntime's fast kernels without changing a value:

    - `Where(c, a, a * s)` with a constant s in [0, 1] (LeakyReLU's gradient) -> `a * Max(Cast(c), s)`: the
      factor is 1 or s exactly, and a * s is the product the Where picks.
    - any other `Where(c, a, b)` -> `a * Cast(c) + b * Cast(Not(c))` (a term less for a zero operand: a
      ReLU's) when a and b are finite, else the Where, as an If on whether the sum of a's and b's elements is
      finite (its difference with itself is nan for an inf or a nan; an overflow only sends a finite case to
      the Where). With finite operands the product is the picked one plus a zero; a zero may change sign (-0.0 for
      0.0, as in `masked_products`). The product is made inside the If's branch, which writes onnxruntime's
      output directly (a product made outside and returned by the branch was copied: 0.55 against 0.39 ms).

    onnxruntime's CPU Where costs ~3.7 ns an element with a scalar operand, ~7 with two tensors, on conditions
    that split the elements unpredictably (a ReLU before a BatchNorm on [64, 16, 28, 28]: 3 ms; ELU's gradient
    there: 5.7 ms), the guarded product ~1 with its If's copy: only Wheres on such conditions (`sign_mask`) of
    `GUARD_MIN_ELEMENTS` elements or more are rewritten."""
    g = model.graph
    candidates = [k for k, n in enumerate(g.node) if n.op_type == "Where" and not n.domain and len(n.input) == 3]
    if not candidates:
        return model
    ctx = Selects.of(g, known)
    producer, scalar = ctx.producer, ctx.scalar
    types = tensor_types(infer_shapes_safely(model) or g)

    def large_float(n: onnx.NodeProto) -> int | None:
        """The element type of a float Where with at least GUARD_MIN_ELEMENTS static elements in its output or
        an input (shape inference often knows only the condition's: a mask stashed from the forward), else None."""
        elem = types.get(n.output[0], (0, None))[0]
        sizes = [known_elements(dims) for _, dims in (types.get(t, (0, None)) for t in (*n.input, n.output[0]))
                 if dims]
        return elem if elem in FLOATS and max(sizes, default=0) >= GUARD_MIN_ELEMENTS else None

    def sign_mask(name: str) -> bool:
        """A condition that splits its elements unpredictably: a comparison with zero (a ReLU's, an ELU's, a
        PReLU's mask) or one made in the forward part (a stashed boolean: the masks `hoist_masks` moves there).
        onnxruntime's Where branches on every element, which costs ~0.6 ns an element for conditions that
        mostly hold the same way (HardSwish's -3 < x < 3) and 3.7-7 ns for these."""
        n = producer.get(name)
        if n is None:
            return name in ctx.booleans
        if n.op_type == "Not" and not n.domain:
            return sign_mask(n.input[0])
        return n.op_type in COMPARE and not n.domain and any(scalar(t) == 0.0 for t in n.input)

    plan = []
    for k in candidates:
        n = g.node[k]
        cond, a, b = n.input
        elem = large_float(n)
        if elem is None or not sign_mask(cond):
            continue
        slope = producer.get(b)
        if slope is not None and slope.op_type == "Mul" and not slope.domain and a in slope.input:
            factor = slope.input[1] if slope.input[0] == a else slope.input[0]
            s = scalar(factor)
            if s is not None and 0.0 <= s <= 1.0:
                plan.append((k, "slope", a, factor, elem))
                continue
        picked = [t if scalar(t) != 0.0 else None for t in (a, b)]
        if any(picked):
            plan.append((k, "select", *picked, elem))

    def build(where: onnx.NodeProto, how: str, a: str | None, b: str | None, elem: int, taken: set[str]
              ) -> list[onnx.NodeProto]:
        base, cond = where.output[0], where.input[0]
        outer = Nodes(base, taken)
        if how == "slope":  # a is the kept tensor, b the slope
            outer("Mul", a, outer("Max", outer("Cast", cond, to=elem), b), out=base)
            return outer.nodes
        fast = Nodes(base, taken)  # the branch's nodes, named fresh across scopes
        terms = [fast("Mul", t, fast("Cast", c, to=elem))
                 for t, c in ((a, cond), (b, fast("Not", cond) if b is not None else None)) if t is not None]
        if len(terms) > 1:
            fast("Add", *terms)
        finite_or_exact(outer, [t for t in (a, b) if t is not None], where, fast, elem)
        return outer.nodes

    return rewrite_nodes(model, plan, build)


def known_elements(dims: Sequence[int | str | None]) -> int:
    """The elements of the dimensions known (a sample's, where the batch is symbolic)."""
    return math.prod(d for d in dims if isinstance(d, int))


def finite_or_exact(outer: Nodes, checked: Iterable[str], exact: onnx.NodeProto, fast: Nodes, elem: int) -> None:
    """`exact`'s output computed by `fast`'s nodes (their last output) where every element of `checked` is finite,
    else by `exact` itself: an If on whether their sum is finite (its difference with itself is nan for an inf or a
    nan; an overflow only sends a finite case to `exact`), emitted by `outer`. The fast nodes write onnxruntime's
    output directly inside their branch (a value made outside and returned by a branch was copied: 0.55 against
    0.39 ms for a Where's product)."""
    out = exact.output[0]
    sums = [outer("ReduceSum", t, keepdims=0) for t in checked]
    total = sums[0] if len(sums) == 1 else outer("Add", *sums)
    broken = outer("IsNaN", outer("Sub", total, total))
    kept = fresh_name(f"{out}/exact", outer.taken)
    branches = [helper.make_graph([helper.make_node(exact.op_type, list(exact.input), [kept], domain=exact.domain)],
                                  kept, [],
                                  [helper.make_tensor_value_info(kept, elem, None)]),
                helper.make_graph(fast.nodes, f"{out}/fast", [],
                                  [helper.make_tensor_value_info(fast.nodes[-1].output[0], elem, None)])]
    branches[0].node[0].attribute.extend(exact.attribute)
    outer("If", broken, out=out, then_branch=branches[0], else_branch=branches[1])


def lower(model: onnx.ModelProto, known: dict[str, np.ndarray] | None = None, keep: Collection[str] = ()
          ) -> onnx.ModelProto:
    """Rewrites for onnxruntime's CPU kernels (`masked_products`, `guarded_selects`, `transposed_products`);
    `known`: values of graph inputs that are constants (a backward half's initializers shared with the
    forward); `keep`: conditions whose Wheres stay (`infinite_fills`). Returns a rewritten copy, or `model`
    itself when nothing changes."""
    out = transposed_products(guarded_selects(masked_products(model, known, keep), known))
    if out is not model:  # the products the rewrites replaced
        drop_unread(out)
    return out


def drop_unread(model: onnx.ModelProto) -> None:
    """Removes, in place, the nodes whose outputs nothing reads: onnxruntime runs them anyway."""
    nodes = drop_dead(list(model.graph.node), [], {o.name for o in model.graph.output})
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def rewrite_nodes(model: onnx.ModelProto, plan: list[tuple], build: Callable[..., list[onnx.NodeProto]]
             ) -> onnx.ModelProto:
    """The skeleton of `lower`'s rewrites: `plan` rows are `(index of a node, *details)` in graph order; a copy
    of `model` gets each planned node replaced by `build(node, *details, taken)` (`taken`: the names in use, for
    `fresh_name`). Returns `model` itself when the plan is empty."""
    if not plan:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    taken = names_in_use(out.graph)
    for k, *details in reversed(plan):  # from the back: a splice leaves the indices before it valid
        nodes[k:k + 1] = build(nodes[k], *details, taken)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def relu_after_pool(model: onnx.ModelProto) -> onnx.ModelProto:
    """`MaxPool(Relu(x))` becomes `Relu(MaxPool(x))` when the Relu output is read by that MaxPool only (no other
    node, no subgraph, not a graph output) and the MaxPool has no Indices output. Both give the same values
    (Relu is monotonic and pads never win a window; bit for bit up to the sign of a zero) and the same
    gradients: when a window's maximum is positive, its first maximum is the same element in x and in Relu(x);
    otherwise relu'(0) = 0 zeroes it either way. For the runtime's forward source, before the gradient is
    built: Relu and its mask then work at the pooled size (a quarter of the elements after a 2x2 pool), the
    Conv before it loses its fused Relu. Output names are kept (the pool's output becomes the new Relu's);
    returns a rewritten copy, or `model` itself when nothing matches."""
    g = model.graph
    reads: dict[str, int] = {}
    for n in g.node:
        for x in [*n.input, *subgraph_free_names(n)]:
            reads[x] = reads.get(x, 0) + 1
    producer = {o: k for k, n in enumerate(g.node) for o in n.output if o}
    outputs = {o.name for o in g.output}
    pairs: dict[int, int] = {}  # MaxPool index -> Relu index
    for k, n in enumerate(g.node):
        if n.op_type != "MaxPool" or n.domain or any(n.output[1:]) or n.input[0] not in producer:
            continue
        relu = g.node[producer[n.input[0]]]
        if relu.op_type == "Relu" and not relu.domain and reads.get(relu.output[0]) == 1 \
                and relu.output[0] not in outputs:
            pairs[k] = producer[n.input[0]]
    if not pairs:
        return model
    gone = {g.node[r].output[0] for r in pairs.values()}

    def build(n: onnx.NodeProto, relu_at: int | None, taken: set[str]) -> list[onnx.NodeProto]:
        if relu_at is None:  # the Relu moves behind its MaxPool
            return []
        relu = onnx.NodeProto()
        relu.CopyFrom(g.node[relu_at])
        y = n.output[0]
        pooled = fresh_name(f"{y}/before_relu", taken)
        n.input[0], n.output[0] = relu.input[0], pooled
        relu.input[0], relu.output[0] = pooled, y
        return [n, relu]

    out = rewrite_nodes(model, sorted([*pairs.items(), *((r, None) for r in pairs.values())]), build)
    forget_types(out.graph, gone)
    return out


def inactive_dropouts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Dropouts of the main graph that drop nothing go, their readers reading the input: in inference mode
    (`training_mode` absent or a constant false) or at a constant ratio of 0 (`nn.Dropout(0.0)`, exported in
    training mode). onnxruntime would otherwise run them, draw a mask at a ratio of 0 (1.7 ms a step on a 3-layer
    encoder of width 192) and backward multiply by it: its `EliminateDropout` is off for the sessions (it removes
    training Dropouts too). A mask that is read becomes all true. Where the output is a graph output, an
    inference-mode Dropout (a copy) stays: onnxruntime 1.32 refused to load a graph whose output was an Identity
    of a parameter's Log that a Gemm also read ("Node input ... is not a graph input, initializer, or output of a
    previous node", from BASIC optimizations on). Opset 12 and later (ratio and training_mode as inputs);
    returns a rewritten copy, or `model` itself when nothing matches."""
    if default_opset(model) < 12:
        return model
    consts = constant_values(model.graph)

    def inactive(n: onnx.NodeProto) -> bool:
        training = n.input[2] if len(n.input) > 2 else ""
        ratio = n.input[1] if len(n.input) > 1 else ""
        if not training or (training in consts and not bool(consts[training])):
            return True
        return bool(ratio) and ratio in consts and float(consts[ratio]) == 0.0

    outputs = {o.name for o in model.graph.output}
    plan = [(k,) for k, n in enumerate(model.graph.node) if n.op_type == "Dropout" and n.domain in ("", "ai.onnx")
            and inactive(n) and not (len(n.input) == 1 and len(n.output) == 1 and n.output[0] in outputs)]

    def build(n: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
        nodes = [helper.make_node("Dropout", [n.input[0]], [n.output[0]], name=n.name)] \
            if n.output[0] in outputs else []  # inference mode: a copy, which the plan above then leaves
        if len(n.output) > 1 and n.output[1]:
            shape = fresh_name(f"{n.output[1]}/shape", taken)
            nodes += [helper.make_node("Shape", [n.input[0]], [shape]),
                      helper.make_node("ConstantOfShape", [shape], [n.output[1]],
                                       value=helper.make_tensor("value", TensorProto.BOOL, [1], [True]))]
        return nodes

    out = rewrite_nodes(model, plan, build)
    # readers of a removed Dropout read its input (through chains of them): an Identity would copy when its
    # output crosses to backward
    bypass = {n.output[0]: n.input[0] for n in (model.graph.node[k] for k, in plan) if n.output[0] not in outputs}
    for name, source in bypass.items():
        while source in bypass:
            source = bypass[source]
        bypass[name] = source
    forget_types(out.graph, bypass)
    rename_tensors(out.graph, bypass)
    return out


def float_attr(node: onnx.NodeProto, name: str, default: float) -> float:
    return next((a.f for a in node.attribute if a.name == name), default)


def int_attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def ints_attr(node: onnx.NodeProto, name: str) -> list[int] | None:
    return next((list(a.ints) for a in node.attribute if a.name == name), None)


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return ints_attr(node, "perm")


def rows_product(node: onnx.NodeProto) -> bool:
    """`Gemm(x, b, transA=1)`: x^T b, a contraction over the rows of both (a weight gradient), nothing added,
    scaled or transposed besides."""
    if node.op_type != "Gemm" or node.domain or len(node.input) != 2:
        return False
    attrs = {a.name: (a.i if a.type == onnx.AttributeProto.INT else a.f) for a in node.attribute}
    return attrs.get("transA") == 1 and not attrs.get("transB") and attrs.get("alpha", 1.0) == 1.0


def transposed_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """`Transpose(Gemm(x, b, transA=1))` and `Transpose(MatMul(Transpose(x), b))` of 2-D operands become
    `Gemm(b, x, transA=1)`: (x^T b)^T = b^T x. The MatMul rule's weight gradient through a transposed weight
    (torch's Linear on a 3-D input exports `MatMul(h, Transpose(W))`) otherwise transposes a weight-sized
    gradient every step (110 ms of GPT-2's backward for the LM head alone). Gemm reads b transposed itself:
    onnxruntime's FusedMatMul with transA (what it makes of a MatMul of a Transpose) was 1.3-1.9x slower alone
    at the shapes of a small transformer."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output if o}

    def swap(name: str) -> onnx.NodeProto | None:
        n = producer.get(name)
        return n if n is not None and n.op_type == "Transpose" and not n.domain and _perm(n) == [1, 0] else None

    def matrix(name: str) -> bool:
        n = producer.get(name)
        return n is not None and not n.domain and (n.op_type == "Flatten" or swap(name) is not None)

    plan = []
    for k, n in enumerate(g.node):
        mm = producer.get(n.input[0]) if swap(n.output[0]) is n else None
        if mm is not None and rows_product(mm):
            plan.append((k, *mm.input))
            continue
        if mm is None or mm.op_type != "MatMul" or mm.domain:
            continue
        a, b = mm.input
        ta = swap(a)
        if ta is not None and matrix(b):
            plan.append((k, ta.input[0], b))

    def build(outer: onnx.NodeProto, x: str, b: str, taken: set[str]) -> list[onnx.NodeProto]:
        target = outer.output[0]
        return [helper.make_node("Gemm", [b, x], [target], transA=1, name=fresh_name(f"{target}/mm_node", taken))]

    return rewrite_nodes(model, plan, build)


def infinite_fills(forward: onnx.ModelProto) -> frozenset[str]:
    """The conditions of the forward's Wheres that pick a non-finite constant (`masked_fill(mask, -inf)`, seen
    through casts and broadcasts): where such a Where picked it, the incoming gradient of what reads the infinity
    can be NaN (a logaddexp or logcumsumexp of two -infs: torch's too), and torch's backward of the Where, a
    `where`, stops it; the backward's Wheres on these conditions stay Wheres (`masked_products` would multiply
    the NaN by 0: a flipped masked_fill's gradient, a scatter, gave NaN weight gradients)."""
    g = forward.graph
    consts = constant_values(g)
    producer = {o: n for n in g.node for o in n.output}

    def constant(name: str) -> np.ndarray | None:
        while name not in consts:
            n = producer.get(name)
            if n is None or n.domain or n.op_type not in ("Cast", "CastLike", "Identity", "Expand"):
                return None
            name = n.input[0]
        return consts[name]

    found = set()
    for n in g.node:
        if n.op_type == "Where" and not n.domain and len(n.input) == 3:
            values = [constant(x) for x in n.input[1:]]
            if any(v is not None and v.dtype.kind == "f" and not np.isfinite(v).all() for v in values):
                found.add(n.input[0])
    return frozenset(found)


def masked_products(model: onnx.ModelProto, known: dict[str, np.ndarray] | None = None,
                    keep: Collection[str] = ()) -> onnx.ModelProto:
    """`Where(c, a, 0)` becomes `a * Cast(c)` (and `Where(c, 0, a)` becomes `a * Cast(Not(c))`) when `a` is
    a float tensor made by `MASKABLE` ops, seen through rearrangements, broadcasts, and multiplications and
    divisions by constants:
    onnxruntime's CPU Where costs ~6 ns an element, Cast + Mul ~0.6 ns. The results differ only where `a`
    holds inf or nan at a masked position, which for these producers means the incoming gradient or a
    weight is non-finite already; Where guarding a singular expression (a division, a log) is kept, and so is a
    Where on a condition of `keep`, or on backward's copy of one (`infinite_fills`: there the incoming gradient
    may be NaN, which torch's Where stops)."""
    g = model.graph
    ctx = Selects.of(g, known)
    consts, producer, booleans = ctx

    def zero(name: str) -> int | None:
        """The element type of a rank-0 float zero constant, else None."""
        v = consts.get(name)
        return helper.np_dtype_to_tensor_dtype(v.dtype) if ctx.scalar(name) == 0.0 and v.ndim == 0 else None

    def is_mask(name: str) -> bool:
        """A 0/1 float: a Cast of a boolean."""
        n = producer.get(name)
        if n is None or n.op_type != "Cast" or n.domain:
            return False
        src = producer.get(n.input[0])
        return n.input[0] in booleans or (src is not None and src.op_type in (*COMPARE, "Not", "And", "Or"))

    memo: dict[str, bool] = {}

    def maskable(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # cycles cannot occur in a graph; this only guards the recursion
            n = producer.get(name)
            if n is None or n.domain:
                ok = False
            elif n.op_type in MASKABLE:
                ok = True
            elif n.op_type in REARRANGE or n.op_type in BROADCASTS:
                ok = maskable(n.input[0])
            elif n.op_type == "Div" and len(n.input) == 2:  # by a constant without zeros (a mean's count)
                d = consts.get(n.input[1])
                ok = d is not None and bool(np.all(d != 0)) and maskable(n.input[0])
            elif n.op_type == "Pad":  # with zeros (MaxPool's gradient onto the rows past its last tile)
                ok = pads_with_zeros(n, consts) and maskable(n.input[0])
            elif n.op_type == "Mul" and len(n.input) == 2:  # by a constant or a 0/1 mask
                a, b = n.input
                ok = (maskable(a) and (b in consts or is_mask(b))) or (maskable(b) and (a in consts or is_mask(a)))
            elif n.op_type in ("Add", "Sum"):
                ok = all(maskable(x) for x in n.input)
            else:  # a Where lowered itself (Dropout's, feeding Relu's) is a masked linear map too
                ok = lowering(n) is not None
            memo[name] = ok
        return memo[name]

    def lowering(n: onnx.NodeProto) -> tuple[str, bool, int] | None:
        """(kept operand, whether the condition selects the zero, element type) for a Where to lower."""
        picked = zero_selection(n, lambda t: zero(t) in FLOATS)
        if picked is None or not maskable(picked[1]):
            return None
        return picked[1], picked[3], zero(picked[2])  # type: ignore[return-value]

    plan = []
    for k, n in enumerate(g.node):
        how = lowering(n) if not n.input or forward_name(n.input[0]) not in keep else None
        if how is not None:
            plan.append((k, n.input[0], *how))

    def build(where: onnx.NodeProto, cond: str, kept: str, negate: bool, elem: int, taken: set[str]
              ) -> list[onnx.NodeProto]:
        e = Nodes(where.output[0], taken)
        e("Mul", kept, e("Cast", e("Not", cond) if negate else cond, to=elem), out=where.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)


EYE_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT32, TensorProto.INT64,
                       TensorProto.UINT64})
"""The element types onnxruntime's CPU EyeLike reads and writes."""


FLAGS_OF_ONE = frozenset({"keepdims", "noop_with_empty_axes", "allowzero"})
"""Int attributes onnxruntime's kernels read as true for 1 only."""


def canonical_forms(model: onnx.ModelProto) -> onnx.ModelProto:
    """Spellings onnxruntime's optimizers or kernels misread, written the way its kernels read them:
    - keepdims, noop_with_empty_axes and allowzero other than 0 or 1 become 0 (its kernels act on 1 only): its
      transpose optimizer reads any nonzero keepdims as 1, and moving a Transpose past ReduceMean(keepdims=2)
      over every axis failed the session load ("Permutation length 2 does not match rank 0"); onnx's shape
      inference reads the other two as 1, so the builder would refuse them (`gradbuilder.graph.DISPUTED_FLAGS`);
    - trailing empty inputs are dropped (an absent optional input): a LayerNormalization(x, scale, "") crashes
      the process while an ORT_ENABLE_ALL session loads (onnxruntime 1.32), one without the "" runs;
    - a Cast's saturate to a type that is not a float8 (or float4) is dropped, as ONNX ignores it there:
      onnxruntime refuses saturate=0 and, for other values than 0 and 1, returns uninitialized memory;
    - a node whose outputs are all unnamed goes (it computes nothing anyone reads): onnxruntime crashed the
      process running a Split with one output "".
    Returns `model` itself when nothing changes."""
    def odd(n: onnx.NodeProto) -> bool:
        if (n.input and not n.input[-1]) or not any(n.output):
            return True
        if n.domain not in ("", "ai.onnx"):
            return False
        return any(a.name in FLAGS_OF_ONE and a.i not in (0, 1) for a in n.attribute) or _idle_saturate(n)

    at = [k for k, n in enumerate(model.graph.node) if odd(n)]
    if not at:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    idle = [k for k in at if not any(out.graph.node[k].output)]
    for k in at:
        node = out.graph.node[k]
        for a in node.attribute:
            if a.name in FLAGS_OF_ONE and a.i not in (0, 1) and node.domain in ("", "ai.onnx"):
                a.i = 0
        while node.input and not node.input[-1]:
            node.input.pop()
        if _idle_saturate(node):
            node.attribute.remove(next(a for a in node.attribute if a.name == "saturate"))
    for k in reversed(idle):
        del out.graph.node[k]
    return out


SATURATING = frozenset({TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
                        TensorProto.FLOAT8E5M2FNUZ, TensorProto.FLOAT4E2M1, TensorProto.FLOAT8E8M0})
"""The Cast targets ONNX's saturate attribute applies to."""


def _idle_saturate(node: onnx.NodeProto) -> bool:
    return (node.op_type == "Cast" and node.domain in ("", "ai.onnx")
            and any(a.name == "saturate" for a in node.attribute) and int_attr(node, "to", 0) not in SATURATING)


def ceil_pools_as_floor(model: onnx.ModelProto) -> onnx.ModelProto:
    """Pools in ceil mode that drop a last window starting in the end padding, as the floor-mode pools of the
    same windows (`gradbuilder.inference.as_floor_mode`): onnxruntime's own shape inference sizes them one
    window too large, as onnx's does, and refuses to load the graph where a later node fixes the size (a
    Linear's weight after a Flatten). Needs the pool's input size. Returns `model` itself when nothing changes."""
    at = ceil_mode_pools(model.graph.node)
    if not at:
        return model
    dims = static_dims(infer_shapes_safely(model) or model.graph)
    plan = []
    for k in at:
        node = model.graph.node[k]
        floor = as_floor_mode(node, dims.get(node.input[0]) or []) if node.input else None
        if floor is not None and same_values(node, floor):
            plan.append((k, floor))
    return rewrite_nodes(model, plan, lambda node, floor, taken: [floor])


def runnable_eyelikes(model: onnx.ModelProto) -> onnx.ModelProto:
    """EyeLikes of other types (torch's `eye(n, dtype=torch.bool)`, a contrastive loss's diagonal mask, exports
    as an EyeLike of a bool ConstantOfShape, which onnxruntime cannot load) made in float and cast, before and
    after. Returns a rewritten copy, or `model` itself when every EyeLike is of a type onnxruntime has."""
    eyes = [n for n in model.graph.node if n.op_type == "EyeLike" and n.domain in ("", "ai.onnx")]
    if not eyes:
        return model
    types = {name: t for name, (t, _) in tensor_types(infer_shapes_safely(model) or model.graph).items()}
    types.update((t.name, t.data_type) for t in model.graph.initializer)
    plan = []
    for k, n in enumerate(model.graph.node):
        if n.op_type != "EyeLike" or n.domain not in ("", "ai.onnx"):
            continue
        given = types.get(n.input[0], TensorProto.UNDEFINED)
        made = int_attr(n, "dtype", given)
        if given and made and (given not in EYE_TYPES or made not in EYE_TYPES):
            plan.append((k, given, made))

    def build(node: onnx.NodeProto, given: int, made: int, taken: set[str]) -> list[onnx.NodeProto]:
        e = Nodes(node.name or node.output[0], taken)
        source = node.input[0] if given in EYE_TYPES else e("Cast", node.input[0], to=TensorProto.FLOAT)
        exact = made in EYE_TYPES
        eye = e("EyeLike", source, k=int_attr(node, "k", 0), dtype=made if exact else TensorProto.FLOAT,
                out=node.output[0] if exact else None)
        if not exact:
            e("Cast", eye, to=made, out=node.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)


def vectors_as_matrices(model: onnx.ModelProto) -> onnx.ModelProto:
    """A MatMul of a Transpose's output and a 1-D operand computed with the operand as a one-column (or one-row)
    matrix: onnxruntime 1.32's MatmulTransposeFusion (ORT_ENABLE_EXTENDED and up) gives wrong values for
    MatMul(Transpose(A), v) with v 1-D (`A.t() @ v`, `torch.mv(W.t(), u)`: spectral norm's power iteration;
    2-D operands are right). Returns a rewritten copy, or `model` itself when no MatMul has such operands."""
    g = model.graph
    made = {o: n for n in g.node for o in n.output}

    def transposed(name: str) -> bool:  # through Identities (StopGradients split as such), which onnxruntime drops
        node = made.get(name)
        while node is not None and node.op_type == "Identity":
            node = made.get(node.input[0])
        return node is not None and node.op_type == "Transpose"

    candidates = [(k, n) for k, n in enumerate(g.node) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")
                  and (transposed(n.input[0]) or transposed(n.input[1]))]
    if not candidates:
        return model
    ranks = {name: len(d) for name, d in _dims_of(model, [x for _, n in candidates for x in n.input[:2]]).items()}
    plan = [(k, 1 if ranks.get(n.input[1]) == 1 else 0) for k, n in candidates
            if ranks.get(n.input[1]) == 1 or ranks.get(n.input[0]) == 1]
    opset = default_opset(model)

    def build(node: onnx.NodeProto, vector: int, taken: set[str]) -> list[onnx.NodeProto]:
        e = Nodes(node.name or node.output[0], taken)
        axis = -1 if vector == 1 else 0

        def along(op: str, x: str, ax: int, out: str | None = None) -> str:
            return e(op, x, e.axes([ax]), out=out) if opset >= 13 else e(op, x, axes=[ax], out=out)

        operands = list(node.input)
        operands[vector] = along("Unsqueeze", operands[vector], axis)
        along("Squeeze", e("MatMul", *operands), -1 if vector == 1 else -2, out=node.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)


def exact_inverse_dfts(model: onnx.ModelProto) -> onnx.ModelProto:
    """float64 inverse DFTs computed by forward ones, n divided in float64: onnxruntime's inverse DFT scales by 1 / n in
    float32 at lengths other than powers of two (1.5e-8 to 5e-8 off at 6, 7, 10, 12, 30 and 100 points, its forward
    DFT within 4e-14), which put float32's rounding into float64 `torch.fft.ifft` and `irfft` (the gradient rules
    write their adjoints with forward DFTs for the same reason). A complete inverse: conj(DFT(conj x)) / n. A
    one-sided one (irfft to L samples, from the spectrum's first L // 2 + 1 bins as numpy reads them): the real part
    of the forward DFT of c_k conj(X_k), zero-padded to L, over L, c_k 1 at bins 0 and L / 2 and 2 elsewhere. Needs
    the input's type, rank and last dim (real or complex), and a static axis; the length is `dft_length` where given.
    Returns a rewritten copy, or `model` itself."""
    candidates = [(k, n) for k, n in enumerate(model.graph.node) if n.op_type == "DFT" and n.domain in ("", "ai.onnx")
                  and int_attr(n, "inverse", 0)]
    if not candidates:
        return model
    types = {name: t for name, (t, _) in tensor_types(infer_shapes_safely(model) or model.graph).items()}
    dims = _dims_of(model, [n.input[0] for _, n in candidates])
    opset = default_opset(model)
    consts = constant_values(model.graph)
    plan = []
    for k, n in candidates:
        x = dims.get(n.input[0])
        if types.get(n.input[0]) != TensorProto.DOUBLE or not x or x[-1] not in (1, 2):
            continue
        if opset >= 20 and len(n.input) > 2 and n.input[2]:
            axis = int(consts[n.input[2]].ravel()[0]) if n.input[2] in consts else None
        else:
            axis = int_attr(n, "axis", -2 if opset >= 20 else 1)
        if axis is not None:
            plan.append((k, len(x), axis % len(x), x[-1]))

    def build(node: onnx.NodeProto, rank: int, axis: int, parts: int, taken: set[str]) -> list[onnx.NodeProto]:
        e = Nodes(node.name or node.output[0], taken)
        x, given = node.input[0], node.input[1] if len(node.input) > 1 and node.input[1] else None
        flip = e("Constant", value=helper.make_tensor("v", TensorProto.DOUBLE, [2], [1.0, -1.0]))
        conj = e("Mul", x, flip) if parts == 2 else x
        bins = e("Gather", e("Shape", x), e.axes([axis]))
        length = e("Reshape", e("Cast", given, to=TensorProto.INT64), e.axes([1])) if given else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
                 if a.name not in ("inverse", "onesided", "axis")}
        if not int_attr(node, "onesided", 0):
            spectrum = e("DFT", conj, *node.input[1:], **attrs, **({"axis": axis} if opset < 20 else {}))
            e("Div", e("Mul", spectrum, flip), e("Cast", length or bins, to=TensorProto.DOUBLE), out=node.output[0])
            return e.nodes
        length = length or e("Mul", e("Sub", bins, e.axes([1])), e.axes([2]))
        kept = e("Add", e("Div", length, e.axes([2])), e.axes([1]))
        conj = e("Slice", conj, e.axes([0]), kept, e.axes([axis]))  # numpy's bins: at most L // 2 + 1
        k = e("Range", e.const(0), e("Squeeze", e("Gather", e("Shape", conj), e.axes([axis])), e.axes([0])),
              e.const(1))
        samples = e("Squeeze", length, e.axes([0]))
        edge = e("Or", e("Equal", k, e.const(0)), e("Equal", e("Mul", k, e.const(2)), samples))
        two = e("Constant", value=helper.make_tensor("v", TensorProto.DOUBLE, [], [2.0]))
        one = e("Constant", value=helper.make_tensor("v", TensorProto.DOUBLE, [], [1.0]))
        weights = e("Reshape", e("Where", edge, one, two), e.axes([-1, *[1] * (rank - 1 - axis)]))
        rest = e("Sub", length, e("Gather", e("Shape", conj), e.axes([axis])))
        pads = e("Concat", e.axes([0] * (rank + axis)), rest, e.axes([0] * (rank - 1 - axis)), axis=0)
        padded = e("Pad", e("Mul", conj, weights), pads)
        spectrum = e("DFT", padded, **attrs, axis=axis) if opset < 20 else e("DFT", padded, "", e.const(axis), **attrs)
        real = e("Slice", spectrum, e.axes([0]), e.axes([1]), e.axes([rank - 1]))
        e("Div", real, e("Cast", length, to=TensorProto.DOUBLE), out=node.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)


def _dims_of(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, list[int | None]]:
    """Dims (None where symbolic) of tensors of `model`: the declared types first (inference over a large backward
    costs a first step ~0.1 s), inferred when one of `names` has none."""
    def known(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
        dims = static_dims(graph)
        dims.update((t.name, list(t.dims)) for t in model.graph.initializer)
        return dims

    dims = known(model.graph)
    if any(x not in dims for x in names):
        dims = known(infer_shapes_safely(model) or model.graph)
    return dims


ORDERED_REDUCTIONS = (b"add", b"mul", b"max", b"min")


def ordered_scatters(model: onnx.ModelProto) -> onnx.ModelProto:
    """ScatterND nodes that reduce (torch's `index_put(..., accumulate=True)`, the builder's counts of ties)
    computed by ScatterElements over the data's rows: onnxruntime's CPU ScatterND splits the updates among its
    threads, which then add into one element at once where indices repeat and lose updates, silently and
    differently at each run (a 1024 x 256 update of one row was off by up to 51), where its ScatterElements applies
    them in order. Indices [N, 1] into any data scatter as they are; longer index tuples become flat row numbers
    of the data seen as [rows, rest]. Needs the ranks of the data and indices and the tuples' length. Returns a
    rewritten copy, or `model` itself when there is nothing to rewrite."""
    candidates = [(k, n) for k, n in enumerate(model.graph.node) if n.op_type == "ScatterND"
                  and n.domain in ("", "ai.onnx") and _reduction(n) in ORDERED_REDUCTIONS]
    if not candidates:
        return model
    dims = _dims_of(model, [x for _, n in candidates for x in n.input[:3]])
    plan = []
    for k, n in candidates:
        data, index, updates = (dims.get(x) for x in n.input[:3])
        if data is None or index is None or not index or index[-1] is None or 0 in (*data, *(updates or [])):
            continue  # an empty scatter adds nothing; onnxruntime's ExpandElimination mis-sizes an Expand to 0
        plan.append((k, len(data), len(index), index[-1]))

    def build(node: onnx.NodeProto, rank: int, index_rank: int, depth: int, taken: set[str]) -> list[onnx.NodeProto]:
        e = Nodes(node.name or node.output[0], taken)
        data, index, updates = node.input[:3]
        reduction = _reduction(node).decode()
        ones = [1] * (rank - depth)
        if depth == 1 and index_rank == 2:  # rows of the data as they are: no reshape of the data
            rows = e("Expand", e("Reshape", index, e.axes([-1, *ones])), e("Shape", updates))
            e("ScatterElements", data, rows, updates, axis=0, reduction=reduction, out=node.output[0])
            return e.nodes
        shape = e("Shape", data)
        head = e("Slice", shape, e.axes([0]), e.axes([depth]))
        rest = e("Slice", shape, e.axes([depth]), e.axes([rank]))
        whole = e("Where", e("Less", index, e.axes([0])), e("Add", index, head), index)
        strides = [e("ReduceProd", e("Slice", head, e.axes([j + 1]), e.axes([depth])), keepdims=1)
                   if j + 1 < depth else e.axes([1]) for j in range(depth)]
        flat = e("ReduceSum", e("Mul", whole, e("Concat", *strides, axis=0) if depth > 1 else strides[0]),
                 e.axes([-1]), keepdims=0)
        table = e("Reshape", data, e("Concat", e("ReduceProd", head, keepdims=1), rest, axis=0))
        values = e("Reshape", updates, e("Concat", e.axes([-1]), rest, axis=0))
        rows = e("Expand", e("Reshape", flat, e.axes([-1, *ones])), e("Shape", values))
        e("Reshape", e("ScatterElements", table, rows, values, axis=0, reduction=reduction), shape,
          out=node.output[0])
        return e.nodes

    return rewrite_nodes(model, plan, build)


def _reduction(node: onnx.NodeProto) -> bytes:
    return next((a.s for a in node.attribute if a.name == "reduction"), b"none")


RESHAPES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def idle_reshapes(model: onnx.ModelProto, known: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Shape ops that leave their input as it is removed, their readers reading the input: a Flatten of a matrix
    (onnx's inference proving the dims equal, symbols included), a Reshape to a constant target spelling the input's
    sizes (`_names_own_sizes`); and a ReduceSum keeping 1-sized axes only for a Reshape to drop them (a bias
    gradient's sum, then the Reshape back to the bias) computed without them instead. onnxruntime runs each such
    node, at ~1 µs on the caches a torch step left cold: an MLP 100-200-200-10's forward 37 -> 34 nodes, its
    backward 40 -> 36 (28 -> 27 with the loss's one-hot gradient), a LeNet's fused run 192 -> 186; steps paired
    against the code without, each after a torch step: mlp-small 0.97-0.99, the MLP 0.98-0.99, the CNN 0.98-0.99
    (benchmarks/notes.md). Graph outputs keep their names. `known`: values of graph inputs that are constants (a
    backward's, fed from the forward's). Returns a rewritten copy, or `model` itself when there is nothing to
    remove."""
    g = model.graph
    if not any(n.op_type in RESHAPES or n.op_type == "ReduceSum" for n in g.node):
        return model
    inferred = infer_shapes_safely(model)
    if inferred is None:
        return model
    dims = {name: d for name, (_, d) in tensor_types(inferred).items()}
    consts = {k: v for k, v in (known or {}).items() if v.ndim <= 1}
    consts.update(constant_values(g, lambda t: len(t.dims) <= 1))
    nodes = [onnx.NodeProto() for _ in g.node]
    for node, new in zip(g.node, nodes):
        new.CopyFrom(node)
    producer = {o: n for n in nodes for o in n.output}
    reads = Counter(x for n in nodes for x in (*n.input, *subgraph_free_names(n)))
    outputs = {o.name for o in g.output}
    renamed: dict[str, str] = {}
    summed: list[str] = []  # the ReduceSums' outputs with keepdims, gone
    dropped: set[int] = set()
    for k, n in enumerate(nodes):
        if n.domain not in ("", "ai.onnx") or not n.input or len(n.output) != 1 or has_subgraph(n):
            continue
        x, y = n.input[0], n.output[0]
        if n.op_type in RESHAPES and y not in outputs and (_same_dims(dims.get(x), dims.get(y))
                                                           or _names_own_sizes(n, dims.get(x), consts)):
            renamed[y] = renamed.get(x, x)
            dropped.add(k)
        elif n.op_type == "Reshape" and reads[x] == 1 and x not in outputs and x in producer:
            total = producer[x]
            if _squeezes_reduced(total, dims, dims.get(y), consts):
                kept = [a for a in total.attribute if a.name != "keepdims"]
                del total.attribute[:]
                total.attribute.extend([*kept, helper.make_attribute("keepdims", 0)])
                total.output[0] = y
                summed.append(x)
                dropped.add(k)
    if not dropped:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(n for k, n in enumerate(nodes) if k not in dropped)
    forget_types(out.graph, [*renamed, *summed])
    rename_tensors(out.graph, renamed)
    return out


def _names_own_sizes(node: onnx.NodeProto, dims: list | None, consts: Mapping[str, np.ndarray]) -> bool:
    """Whether `node` is a Reshape to a constant target that spells its input's own sizes: each a known size, a 0
    (copied) or the one -1 (then the rest of the elements: the input's size there), as torch's exports reshape
    logits to [-1, C] and labels to [-1]."""
    if node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in consts or dims is None \
            or int_attr(node, "allowzero", 0):
        return False
    target = [int(v) for v in np.atleast_1d(consts[node.input[1]])]
    return len(target) == len(dims) and target.count(-1) <= 1 and all(
        t in (-1, 0) or (isinstance(d, int) and d == t) for t, d in zip(target, dims))


def _same_dims(a: list | None, b: list | None) -> bool:
    """Whether two inferred shapes are the same, every dim known: a size or the same symbol."""
    return a is not None and b is not None and a == b and all(d is not None for d in a)


def _squeezes_reduced(total: onnx.NodeProto, dims: Mapping[str, list | None], squeezed: list | None,
                      consts: Mapping[str, np.ndarray]) -> bool:
    """Whether `total` is a ReduceSum with keepdims over constant axes whose output a Reshape to `squeezed` gives
    without those axes (the summed tensor's other dims, in `dims`, known sizes kept in order)."""
    if total.op_type != "ReduceSum" or total.domain not in ("", "ai.onnx") or not int_attr(total, "keepdims", 1) \
            or len(total.input) < 2 or total.input[1] not in consts or int_attr(total, "noop_with_empty_axes", 0):
        return False
    summed = dims.get(total.input[0])
    if not summed or squeezed is None:
        return False
    axes = {int(v) % len(summed) for v in np.atleast_1d(consts[total.input[1]])}
    rest = [d for a, d in enumerate(summed) if a not in axes]
    return bool(axes) and all(isinstance(d, int) for d in rest) and rest == list(squeezed)
