"""BatchNorm in training mode with PyTorch's running-statistics semantics.

ONNX BatchNormalization(training_mode=1) updates `running = m*running + (1-m)*batch` with the
BIASED batch variance; torch uses `running = (1-t)*running + t*batch` with the UNBIASED variance,
`t = momentum` (or 1/num_batches_tracked when momentum is None), and counts num_batches_tracked.
So the exported node is set to momentum 0 (its running outputs are then the batch statistics), the
variance is made unbiased in the graph (n/(n-1), n = elements per channel), both become graph
outputs, and the host applies torch's update to the module's buffers after each forward.
The dynamo exporter emits BatchNormalization in inference mode even for train(); such nodes of
modules in training mode are switched to training mode here as well.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper
from torch import nn

from .recompute import region

_ONE = "batchnorm.one"


@dataclass(frozen=True)
class BatchStats:
    """Graph outputs holding one BatchNorm module's batch mean and unbiased batch variance."""

    module: str
    mean: str
    var: str
    region: int | None = None
    """The checkpointed region (`runtime.checkpoints`) the module's call lies in: torch's backward runs that
    region's forward again, and the call updates the running statistics a second time (`second_updates`)."""


def _attr(node: onnx.NodeProto, name: str, value: float | int) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def batch_statistics_only(mod: nn.modules.batchnorm._BatchNorm) -> bool:
    """Whether the module normalizes with its batch's statistics and updates none, as torch's forward decides:
    track_running_stats=False in training, or without running statistics at all (in evaluation too); with them,
    evaluation reads them whatever the flag (frozen statistics: the flag turned off to fine-tune)."""
    return not mod.track_running_stats and (mod.training or mod.running_mean is None)


def _constant_statistics(g: onnx.GraphProto, node: onnx.NodeProto, p: str, channels: int, types: Mapping[str, int]
                         ) -> int:
    """Constants in place of a training node's running-statistic inputs; returns their element type. onnxruntime
    may write the batch statistics in place into those inputs, which share memory with the module's buffers (a
    BatchNorm with track_running_stats=False but buffers, frozen statistics, had them overwritten at every step);
    with momentum 0 or the statistics unused their values do not matter (and stand-in statistics, which the trace
    changed, made each export another graph)."""
    initializers = {t.name: t.data_type for t in g.initializer}
    elem = types.get(node.input[3]) or initializers.get(node.input[3], onnx.TensorProto.FLOAT)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    g.initializer.extend([onnx.numpy_helper.from_array(np.zeros(channels, dtype), f"{p}.zeros"),
                          onnx.numpy_helper.from_array(np.ones(channels, dtype), f"{p}.ones")])
    node.input[3], node.input[4] = f"{p}.zeros", f"{p}.ones"
    return elem


def _drop_unread_constants(g: onnx.GraphProto, names: set[str]) -> None:
    """Stand-in statistics (`stand_in_statistics`: constants of the export, which its trace changed) once no node
    reads them: left in, they made each export of the same module another graph."""
    read = {name for n in g.node for name in n.input}
    unread = {t.name for t in g.initializer if t.name in names and t.name not in read}
    for values in (g.initializer, g.input):
        for v in [v for v in values if v.name in unread]:
            values.remove(v)


def _batch_statistics(g: onnx.GraphProto, node: onnx.NodeProto, p: str, channels: int, types: Mapping[str, int]
                      ) -> tuple[int, list[onnx.NodeProto]]:
    """The training node made to give its batch's mean as `{p}.mean` (its running outputs at momentum 0, over
    constant running inputs) and the nodes giving the unbiased batch variance as `{p}.var` (the biased one times
    n / (n-1), n the elements a channel); returns the statistics' element type and those nodes."""
    elem = _constant_statistics(g, node, p, channels, types)
    _attr(node, "training_mode", 1)
    _attr(node, "momentum", 0.0)
    while len(node.output) < 3:
        node.output.append("")
    node.output[1], node.output[2] = f"{p}.mean", f"{p}.biased_var"
    return elem, [
        helper.make_node("Size", [node.input[0]], [f"{p}.numel"]),
        helper.make_node("Size", [f"{p}.mean"], [f"{p}.channels"]),
        helper.make_node("Div", [f"{p}.numel", f"{p}.channels"], [f"{p}.n_int"]),
        helper.make_node("CastLike", [f"{p}.n_int", f"{p}.mean"], [f"{p}.n"]),
        helper.make_node("CastLike", [_ONE, f"{p}.mean"], [f"{p}.one"]),
        helper.make_node("Sub", [f"{p}.n", f"{p}.one"], [f"{p}.n_minus_1"]),
        helper.make_node("Div", [f"{p}.n", f"{p}.n_minus_1"], [f"{p}.factor"]),
        helper.make_node("Mul", [f"{p}.biased_var", f"{p}.factor"], [f"{p}.var"]),
    ]


def _updated_in_graph(g: onnx.GraphProto, node: onnx.NodeProto, p: str, current: dict[str, str],
                      types: Mapping[str, int]) -> list[onnx.NodeProto] | None:
    """A training node no BatchNorm module owns (`F.batch_norm` on a module's own buffers, which torch updates in
    place: the legacy export carries them out as their unchanged inputs, the update being invisible to its trace):
    the running statistics as torch updates them, `running * (1 - m) + batch * m` with the unbiased batch variance,
    from their values after any earlier such update (`current`, which then names the new ones). None where neither
    statistic is carried out (`current` holds the carried ones) or their length is unknown."""
    old = list(node.input[3:5])
    channels = _length(g, old[0])
    if not any(name in current for name in old) or channels is None or \
            not any(a.name == "training_mode" and a.i for a in node.attribute):
        return None
    kept = next((a.f for a in node.attribute if a.name == "momentum"), 0.9)  # ONNX's: the share of the old value
    elem, nodes = _batch_statistics(g, node, p, channels, types)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    g.initializer.extend([onnx.numpy_helper.from_array(np.array(kept, dtype), f"{p}.kept"),
                          onnx.numpy_helper.from_array(np.array(1.0 - kept, dtype), f"{p}.taken")])
    for running, batch in zip(old, (f"{p}.mean", f"{p}.var")):
        new = f"{batch}/updated"
        nodes += [helper.make_node("Mul", [current.get(running, running), f"{p}.kept"], [f"{new}/kept"]),
                  helper.make_node("Mul", [batch, f"{p}.taken"], [f"{new}/taken"]),
                  helper.make_node("Add", [f"{new}/kept", f"{new}/taken"], [new])]
        current[running] = new
    return nodes


def eps_scale(eps: float) -> float | None:
    """s = sqrt(f / eps), f the float32 that ONNX's epsilon attribute keeps of eps: a normalization of s x with
    epsilon f is one of x with eps (BN(s x, s mean, s^2 var; f) = BN(x, mean, var; eps), layer norm's alike), so
    float64 normalizations get torch's eps to float64's precision (the attribute alone was 4e-10 off through a
    float64 CNN, 1e-9 through a ViT's pre-norms). None where f is eps, or 0."""
    held = float(np.float32(eps))
    return math.sqrt(held / eps) if held != eps and held > 0 else None


def _torchs_eps(g: onnx.GraphProto, nodes: list[onnx.NodeProto], node: onnx.NodeProto, p: str, eps: float,
                elem: int, running: bool = False) -> float | None:
    """A float64 node of a module, last in `nodes`, given torch's eps (`eps_scale`): its input scaled by s
    through a Mul put before it (the running statistics it reads too where `running`, by s and s^2). Returns s,
    by which the batch statistics the node outputs are too large; None where nothing is scaled."""
    scale = eps_scale(eps) if elem == onnx.TensorProto.DOUBLE else None
    if scale is None:
        return None
    scaled = [(0, scale), *(((3, scale), (4, scale * scale)) if running else ())]
    for k, factor in scaled:
        name = f"{p}.eps_scale{k}"
        g.initializer.append(onnx.numpy_helper.from_array(np.array(factor), name))
        nodes.insert(len(nodes) - 1, helper.make_node("Mul", [node.input[k], name], [f"{name}/scaled"]))
        node.input[k] = f"{name}/scaled"
    return scale


def _unscaled_statistics(g: onnx.GraphProto, node: onnx.NodeProto, scale: float) -> list[onnx.NodeProto]:
    """Divs giving the node's batch mean and biased variance (outputs 1 and 2, renamed) of its input before
    `_torchs_eps` scaled it by `scale`."""
    divs = []
    for k, factor in ((1, scale), (2, scale * scale)):
        name = node.output[k]
        g.initializer.append(onnx.numpy_helper.from_array(np.array(factor), f"{name}/eps_scale"))
        node.output[k] = f"{name}/scaled"
        divs.append(helper.make_node("Div", [node.output[k], f"{name}/eps_scale"], [name]))
    return divs


def _length(g: onnx.GraphProto, name: str) -> int | None:
    """The static length of a 1-D graph input, initializer or typed tensor."""
    for t in g.initializer:
        if t.name == name:
            return int(t.dims[0]) if len(t.dims) == 1 else None
    for v in [*g.input, *g.value_info]:
        if v.name == name:
            dims = v.type.tensor_type.shape.dim
            return int(dims[0].dim_value) if len(dims) == 1 and dims[0].HasField("dim_value") else None
    return None


def training_batchnorm(model: onnx.ModelProto, owner: Mapping[str, str], modules: Mapping[str, nn.Module]
                       ) -> list[BatchStats]:
    """Rewrite the BatchNormalization nodes of BatchNorm modules in training mode (see module doc), and those
    updating statistics no BatchNorm module owns as torch updates them (`_updated_in_graph`).

    owner: name of the tensor feeding a BatchNorm module's running mean -> the module's qualified name.
    """
    g = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in g.input}
    stats: list[BatchStats] = []
    nodes: list[onnx.NodeProto] = []
    calls: dict[str, int] = {}
    replaced: set[str] = set()
    outputs = {o.name for o in g.output}
    carriers = [n for n in g.node if n.op_type == "Identity" and n.output and n.output[0] in outputs]
    current = {n.input[0]: n.input[0] for n in carriers}  # statistics carried out -> their latest value
    made = False  # nodes reading `_ONE`
    functional = 0  # the training nodes no BatchNorm module owns, named apart
    # the dynamo exporter feeds a module's second call the running mean through an Identity of the first's input
    alias = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Identity" and n.input and n.output}
    for name in alias:  # typed as their source: a float64 module's second call took float32 stand-ins, no kernel
        source = name
        while source in alias and source not in types:
            source = alias[source]
        if source in types:
            types.setdefault(name, types[source])
    for node in g.node:
        nodes.append(node)
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        running = node.input[3]
        while running in alias and running not in owner:
            running = alias[running]
        fqn = owner.get(running)
        mod = modules.get(fqn) if fqn is not None else None
        if not isinstance(mod, nn.modules.batchnorm._BatchNorm):
            extra = _updated_in_graph(g, node, f"batchnorm.functional{functional}", current, types)
            functional += 1
            if extra is not None:
                nodes += extra
                made = True
            continue
        p = f"batchnorm.{fqn}" if fqn else "batchnorm"
        calls[p] = calls.get(p, 0) + 1
        if calls[p] > 1:  # a module called again in the same forward (a Siamese encoder): its own names
            p = f"{p}.call{calls[p]}"
        if batch_statistics_only(mod):
            _attr(node, "training_mode", 1)
            replaced.update(node.input[3:5])
            _torchs_eps(g, nodes, node, p, mod.eps, _constant_statistics(g, node, p, int(mod.num_features), types))
            for k, what in ((1, "unused_mean"), (2, "unused_var")):
                if len(node.output) <= k:
                    node.output.append(f"{p}.{what}")
            continue
        if not mod.training:
            _torchs_eps(g, nodes, node, p, mod.eps, types.get(node.input[3], 0), running=True)
            continue
        channels = int(mod.num_features)
        elem, extra = _batch_statistics(g, node, p, channels, types)
        scale = _torchs_eps(g, nodes, node, p, mod.eps, elem)
        nodes += (_unscaled_statistics(g, node, scale) if scale is not None else []) + extra
        made = True
        g.output.extend([helper.make_tensor_value_info(f"{p}.mean", elem, [channels]),  # sized, or the backward's
                         helper.make_tensor_value_info(f"{p}.var", elem, [channels])])  # inference loses its sizes
        stats.append(BatchStats(fqn, f"{p}.mean", f"{p}.var", region(node)))  # type: ignore[arg-type]
    for n in carriers:  # the carried statistics' new values
        n.input[0] = current[n.input[0]]
    if made:
        g.initializer.append(onnx.numpy_helper.from_array(np.array(1.0, dtype=np.float32), _ONE))
    del g.node[:]
    g.node.extend(nodes)
    _drop_unread_constants(g, replaced)
    return stats


@contextlib.contextmanager
def stand_in_statistics(module: nn.Module) -> Iterator[dict[str, str]]:
    """BatchNorm without running statistics normalizes with batch statistics in train and eval; the legacy
    exporter cannot export that with a dynamic batch size. During export, such modules get stand-in
    running buffers (constants of the export) and training mode, so they export as training-mode nodes.
    Yields {stand-in running_mean name: module name} for `training_batchnorm`."""
    patched = []
    # without affine parameters, the module's floats' type (torch.zeros' float32 in a float64 module: "mixed dtype")
    floats = next((t.dtype for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()),
                  torch.get_default_dtype())
    for name, mod in module.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and batch_statistics_only(mod):
            patched.append((name, mod, mod.training, dict(mod._buffers)))
            dtype = mod.weight.dtype if mod.weight is not None else floats
            mod._buffers["running_mean"] = torch.zeros(mod.num_features, dtype=dtype)
            mod._buffers["running_var"] = torch.ones(mod.num_features, dtype=dtype)
            mod.track_running_stats, mod.training = True, True
    try:
        yield {f"{name}.running_mean" if name else "running_mean": name for name, *_ in patched}
    finally:
        for _, mod, training, buffers in patched:
            mod._buffers.clear()
            mod._buffers.update(buffers)
            mod.track_running_stats, mod.training = False, training


def update_running_stats(modules: Mapping[str, nn.Module], stats: Sequence[BatchStats],
                         values: Sequence[torch.Tensor], checked: bool = False) -> None:
    """torch's update: num_batches_tracked += 1; running = (1-t)*running + t*batch; a module called twice in a
    forward is counted and updated once a call, in order, as torch does. A batch of one value per channel
    raises torch's error, before any update: its unbiased variance, 0 * n / (n - 1), is NaN in every channel
    (where the mean is finite), which poisoned the running variance and every evaluation after it. `checked`: the
    call's sizes passed that check before (a steady call's are the recorded call's), which they alone decide.

    torch's kernel updates them inside its own op; here every torch op runs cold, right after onnxruntime's run
    has filled the caches, at 2-8 µs a tensor. So the counters and the statistics of all modules are updated by
    three foreach ops (per tensor, the same kernels as the module-by-module ops, bit for bit), the check reads a
    variance's first element through numpy before it looks further, and nothing runs under grad mode's context
    (nothing here requires grad): 20 BatchNorms 0.85-1.00 -> 0.41-0.46 ms, 2 of them 151-185 -> 104-133 µs
    (benchmarks/notes.md)."""
    if not checked:
        for s, mean, var in zip(stats, values[0::2], values[1::2]):
            if var.numel() and _first_is_nan(var) and bool(var.isnan().all()) and bool(mean.isfinite().all()):
                raise ValueError(f"Expected more than 1 value per channel when training (BatchNorm "
                                 f"{s.module or 'module'} got one, as torch's raises): drop the last incomplete "
                                 "batch (DataLoader(drop_last=True)), or call the module in eval mode for it.")
    for calls in _rounds(stats):
        mods = [modules[stats[k].module] for k in calls]
        counters = [c for c in (m._buffers.get("num_batches_tracked") for m in mods) if c is not None]
        if counters:
            torch._foreach_add_(counters, 1)
        blends: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for k, mod in zip(calls, mods):
            t = mod.momentum if mod.momentum is not None else 1.0 / float(mod.num_batches_tracked)
            running, batch = blends.setdefault(t, ([], []))
            for name, value in (("running_mean", values[2 * k]), ("running_var", values[2 * k + 1])):
                # through .data, as torch's kernel updates them: their version counters left as they were, so a
                # graph that saved them (an eval-mode call's, before this call's backward) stays differentiable
                buffer = mod._buffers[name].data
                running.append(buffer)
                batch.append(value if value.dtype == buffer.dtype else value.to(buffer.dtype))
        for t, (running, batch) in blends.items():
            torch._foreach_mul_(running, 1 - t)
            torch._foreach_add_(running, batch, alpha=t)


class FlatStatistics:
    """The running statistics of the BatchNorms a call updates as views of one tensor, and their counters as views
    of another, so that a steady call (`Engine._steady_call`) updates them all with four torch ops, however many
    modules: the batch statistics joined, the counters counted, the running ones scaled and added to. Each torch op
    costs 10-25 µs on the caches onnxruntime's run leaves, and `update_running_stats` takes three of them plus its
    Python a round, and the check for one value a channel (benchmarks/notes.md). The same kernels as there, so the
    same bits; the counters' versions move as torch's, the statistics' do not (updated through `.data`).

    Made only where every call updates a module of its own, all with one momentum (not the cumulative average, whose
    factor is each module's own count) and statistics of the buffers' type. The views take the buffers' place in
    their modules once (their values copied in): a tensor taken from a module before holds the old values from then
    on, as one taken before `module.to()` does."""

    def __init__(self, mods: list[nn.Module], holders: list[dict[str, Any]], names: list[str],
                 views: list[torch.Tensor], flat: torch.Tensor, counters: torch.Tensor | None, momentum: float):
        self.mods, self.holders, self.names, self.views = mods, holders, names, views
        self.data = flat.data  # its own version counter: the views' does not move, as torch's kernel leaves it
        self.counters = counters
        self.momentum = momentum
        self.momenta = [momentum] * len(mods)

    @staticmethod
    def of(modules: Mapping[str, nn.Module], stats: Sequence[BatchStats], values: Sequence[torch.Tensor],
           last: FlatStatistics | None = None) -> FlatStatistics | None:
        """The flat statistics of the modules `stats` names (`last` where it holds the same modules still), or None
        where a module is updated twice a call, momenta differ or are cumulative, or types differ."""
        mods = [modules[s.module] for s in stats]
        if last is not None and len(last.mods) == len(mods) and all(map(operator.is_, last.mods, mods)) and \
                last.holds():
            return last
        if len({id(m) for m in mods}) != len(mods) or any(s.region is not None for s in stats):
            return None
        momenta = {m.momentum for m in mods}
        if len(momenta) != 1 or None in momenta:
            return None
        holders = [m._buffers for m in mods for _ in range(2)]
        slots = ["running_mean", "running_var"] * len(mods)
        running = [h.get(n) for h, n in zip(holders, slots)]
        if any(r is None for r in running):
            return None
        dtype = running[0].dtype
        if any(r.dtype != dtype or r.dim() != 1 or r.requires_grad for r in running) or \
                any(v.dtype != dtype for v in values):
            return None
        counts = [m._buffers.get("num_batches_tracked") for m in mods]
        if any(c is None for c in counts) and any(c is not None for c in counts):
            return None
        flat = torch.empty(sum(r.numel() for r in running), dtype=dtype)
        views, start = [], 0
        for r in running:
            flat.data[start:start + r.numel()].copy_(r)
            views.append(flat[start:start + r.numel()])
            start += r.numel()
        counters = None
        if counts[0] is not None:
            counters = torch.tensor([int(c) for c in counts], dtype=counts[0].dtype)
            holders += [m._buffers for m in mods]
            slots += ["num_batches_tracked"] * len(mods)
            views += [counters.select(0, k) for k in range(len(mods))]
        for h, n, v in zip(holders, slots, views):
            h[n] = v
        return FlatStatistics(mods, holders, slots, views, flat, counters, float(momenta.pop()))

    def holds(self) -> bool:
        """Whether each view is still its module's buffer, and each module's momentum the one recorded (torch reads
        it at every call: a schedule may change it)."""
        return all(map(operator.is_, map(dict.get, self.holders, self.names), self.views)) and \
            list(map(_momentum, self.mods)) == self.momenta

    def update(self, values: Sequence[torch.Tensor]) -> None:
        """torch's update (`update_running_stats`) from a call's batch statistics, mean and variance per module."""
        if self.counters is not None:
            self.counters.add_(1)
        t = self.momentum
        self.data.mul_(1 - t).add_(torch.cat(values), alpha=t)


_momentum = operator.attrgetter("momentum")


def _rounds(stats: Sequence[BatchStats]) -> list[list[int]]:
    """The calls in rounds that hold each module once (its k-th call in the k-th), in order: a foreach op updates
    a round at once, where a module called twice must see its first call's update before its second's."""
    rounds: list[list[int]] = []
    seen: dict[str, int] = {}
    for k, s in enumerate(stats):
        r = seen[s.module] = seen.get(s.module, -1) + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(k)
    return rounds


_NUMPY_TYPES = (torch.float32, torch.float64, torch.float16)


def _first_is_nan(t: torch.Tensor) -> bool:
    """Whether t's first element is NaN, read through numpy's view of it where numpy has its type."""
    if t.dtype in _NUMPY_TYPES and not t.requires_grad:
        return math.isnan(t.numpy().item(0))
    return bool(t.reshape(-1)[0].isnan())


def second_updates(stats: Sequence[BatchStats], values: Sequence[torch.Tensor]
                   ) -> tuple[list[BatchStats], list[torch.Tensor]]:
    """The updates torch's backward makes again, as `update_running_stats` takes them: a BatchNorm call inside a
    checkpointed region runs again when backward recomputes the region, on the same input, so its statistics are
    updated a second time with the same batch mean and variance (torch's documented double update). Regions
    are recomputed last one first; calls within a region in forward order."""
    again = sorted((k for k, s in enumerate(stats) if s.region is not None),
                   key=lambda k: -stats[k].region)  # type: ignore[operator]
    return [stats[k] for k in again], [v for k in again for v in values[2 * k:2 * k + 2]]
