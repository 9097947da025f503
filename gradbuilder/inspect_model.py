"""Summaries for people: what a forward model holds, what a training graph costs, which ops have rules.

Each summary is plain data (dataclasses; `--json` prints their `asdict`) built from the library's own
answers -- reachability for "why no gradient", `split` for what backward stashes -- so the CLI and the
builder can never disagree. `render_*` turn the data into the text `gradbuilder` prints.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

import numpy as np
import onnx
from onnx import TensorProto, helper

from .builder import read_metadata, resolve_request
from .coverage import FLOAT_TYPES, ORT_TRAINING_OPS
from .graph import ForwardGraph, TensorInfo, default_opset, info_from_type, inline_functions, load_model, type_name
from .reachability import analyze, is_control_flow
from .rules import registry
from .split import split
from .yield_op import DOMAIN, find_yield, is_yield, read_yield

Dim = int | str | None
Bytes = int | str | None
"""Exact bytes, a formula over symbolic dims ("12*batch + 64"), or None when a size is unknown."""
NO_DIMS: Mapping[str, int] = MappingProxyType({})

# --------------------------------------------------------------------------------------------------
# sizes: a byte count is a polynomial in the symbolic dims, {(sorted dim names): coefficient}


Poly = dict[tuple[str, ...], int]


def _itemsize(elem_type: int) -> int | None:
    if not elem_type or elem_type == TensorProto.STRING:
        return None
    try:
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:  # a type numpy has no dtype for
        return None


def _size_poly(info: TensorInfo, dims: Mapping[str, int]) -> Poly | None:
    """Bytes of one tensor; None when its type or any dim is unknown."""
    item = _itemsize(info.elem_type)
    if item is None or info.shape is None:
        return None
    coeff, symbols = item, []
    for d in info.shape:
        if isinstance(d, int):
            coeff *= d
        elif isinstance(d, str) and d in dims:
            coeff *= dims[d]
        elif isinstance(d, str) and d:
            symbols.append(d)
        else:
            return None
    return {tuple(sorted(symbols)): coeff} if coeff else {}


def _add_poly(total: Poly, p: Poly) -> None:
    for k, v in p.items():
        total[k] = total.get(k, 0) + v


def _poly_value(p: Poly) -> int | str:
    """An int when no symbol is left, else a formula with the highest-degree terms first."""
    if not p or set(p) == {()}:
        return p.get((), 0)
    terms = []
    for syms, c in sorted(p.items(), key=lambda kv: (-len(kv[0]), kv[0])):
        if c:
            terms.append("*".join(([str(c)] if c != 1 or not syms else []) + list(syms)))
    return " + ".join(terms)


def tensor_bytes(info: TensorInfo, dims: Mapping[str, int] = NO_DIMS) -> Bytes:
    p = _size_poly(info, dims)
    return None if p is None else _poly_value(p)


def format_bytes(n: Bytes) -> str:
    if n is None:
        return "? B"
    if isinstance(n, str):
        return f"{n} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.1f} {unit})"
    return f"{n} B"


def format_shape(shape: Sequence[Dim] | None) -> str:
    if shape is None:
        return "[?...]"
    return "[" + ", ".join("?" if d is None or d == "" else str(d) for d in shape) + "]"


# --------------------------------------------------------------------------------------------------
# report data


@dataclass
class TensorSummary:
    name: str
    dtype: str
    shape: list[Dim] | None
    bytes: Bytes


@dataclass
class GradientStatus(TensorSummary):
    """One differentiable candidate (parameter or wrt input): its gradient output, or why it has none."""

    gradient: str | None = None
    """Name of the gradient output in a training graph; for a forward model, None (see `reason`)."""
    reason: str | None = None
    """Why no gradient; None when it gets one."""


@dataclass
class OpSummary:
    op: str
    count: int
    rule: str
    """"yes", "missing", "non-differentiable" (gradients stop there), "control flow" or "no inputs" (needs none)."""
    blocking: bool
    """Whether a default build (every float parameter, every float output) would stop on this op."""


@dataclass
class YieldOutput:
    index: int
    name: str
    differentiable: bool
    full_shape: bool
    host_gradient: str | None
    loss: bool


@dataclass
class ForwardReport:
    opset: int
    ir_version: int
    producer: str
    nodes: int
    ops: list[OpSummary]
    inputs: list[TensorSummary]
    outputs: list[TensorSummary]
    parameters: list[GradientStatus]
    parameter_bytes: int
    constants: int
    """Non-float initializers (indices, shapes): never differentiated."""
    notes: list[str] = field(default_factory=list)
    kind: str = "forward"


@dataclass
class TrainingReport:
    opset: int
    ir_version: int
    forward_nodes: int
    backward_nodes: int
    loss: str | None
    gradients: list[GradientStatus]
    yield_outputs: list[YieldOutput]
    stashed: list[TensorSummary]
    stash_bytes: Bytes
    backward_reads_inputs: list[str]
    backward_reads_parameters: list[str]
    dims: dict[str, int]
    notes: list[str] = field(default_factory=list)
    kind: str = "training"


Report = ForwardReport | TrainingReport


# --------------------------------------------------------------------------------------------------
# building the reports


def is_training_graph(model: onnx.ModelProto) -> bool:
    return any(is_yield(n) for n in model.graph.node)


def inspect_model(model: onnx.ModelProto | str | os.PathLike | bytes, dims: Mapping[str, int] = NO_DIMS) -> Report:
    """Summarise a forward model or a training graph; `dims` gives values to symbolic dims for byte counts."""
    m = load_model(model, copy=False)
    return training_report(m, dims) if is_training_graph(m) else forward_report(m, dims)


def _summary(name: str, info: TensorInfo, dims: Mapping[str, int] = NO_DIMS) -> TensorSummary:
    return TensorSummary(name, type_name(info.elem_type), None if info.shape is None else list(info.shape),
                         tensor_bytes(info, dims))


def _status(name: str, info: TensorInfo, gradient: str | None, reason: str | None) -> GradientStatus:
    return GradientStatus(**asdict(_summary(name, info)), gradient=gradient, reason=reason)


def _qualified(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def _rule_status(fg: ForwardGraph, k: int) -> str:
    node = fg.nodes[k]
    if is_control_flow(node.op_type) or k in fg.hidden_inputs:
        return "control flow"
    rule = registry.lookup(node.op_type, fg.opset, node.domain)
    if rule is None and not any(node.input):
        return "no inputs"  # Constant, RandomNormal...: nothing upstream could want a gradient through it
    if rule is None:
        return "missing"
    return "yes" if rule.fn is not None else "non-differentiable"


def forward_report(m: onnx.ModelProto, dims: Mapping[str, int] = NO_DIMS) -> ForwardReport:
    fg = ForwardGraph(inline_functions(m))
    # the request a plain `gradbuilder build` makes: every float parameter, every float output
    req = resolve_request(fg, None, None, None, ())
    seeds = list(req.outputs)
    reach = analyze(fg, req.wrt, seeds)

    counts: Counter[str] = Counter()
    status: dict[str, str] = {}
    blocking: set[str] = set()
    for k, node in enumerate(fg.nodes):
        op = _qualified(node)
        counts[op] += 1
        s = status[op] = _rule_status(fg, k)
        if k in reach.active_inputs and s in ("missing", "control flow"):
            blocking.add(op)
    ops = [OpSummary(op, n, status[op], op in blocking) for op, n in sorted(counts.items(), key=lambda kv: -kv[1])]

    params = []
    for name, t in fg.initializers.items():
        info = fg.tensor_info(name)
        if info.is_float and t.data_type:
            params.append(_status(name, info, None, reach.reason(fg, name, seeds)))
    inits = set(fg.initializers)
    notes = []
    if m.producer_name == "gradbuilder.split":
        notes.append("made by `gradbuilder split`: one half of a training graph, not a model to build from")
    if blocking:
        notes.append(f"a default build stops at {', '.join(sorted(blocking))}: no gradient rule on the gradient "
                     "path (freeze the parameters that feed those nodes, or see `gradbuilder ops`)")
    return ForwardReport(
        opset=fg.opset,
        ir_version=m.ir_version,
        producer=" ".join(x for x in (m.producer_name, m.producer_version) if x),
        nodes=len(fg.nodes),
        ops=ops,
        inputs=[_summary(n, fg.tensor_info(n), dims) for n in fg.inputs if n not in inits],
        outputs=[_summary(n, fg.tensor_info(n), dims) for n in fg.outputs],
        parameters=params,
        parameter_bytes=sum(p.bytes for p in params if isinstance(p.bytes, int)),
        constants=sum(1 for n in fg.initializers if n not in {p.name for p in params}),
        notes=notes,
    )


def _declared_info(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    g = model.graph
    info = {vi.name: info_from_type(vi.type) for vi in [*g.value_info, *g.input, *g.output]}
    info.update({t.name: TensorInfo(t.data_type, tuple(t.dims)) for t in g.initializer})
    return info


def gradient_table(model: onnx.ModelProto) -> list[GradientStatus]:
    """Per differentiable candidate of a training graph: its gradient output or why it has none.

    Rows follow `wrt`, then the frozen tensors, then float parameters the build was not asked about.
    """
    meta = read_metadata(model)
    grads: dict[str, str] = meta["gradients"]  # type: ignore[assignment]
    no_grad: dict[str, str] = meta["no_gradient"]  # type: ignore[assignment]
    no_grad.update({w: ("torch's is zeros: it reaches the differentiated outputs only through ops of derivative zero "
                        "(Round, Sign), so backward computes none and the host fills the zeros")
                    for w in meta["zero_gradient"]})  # type: ignore[union-attr]
    info = _declared_info(model)
    y = find_yield(model.graph.node)
    forward_reads = {x for n in model.graph.node[:y] for x in n.input} | set(model.graph.node[y].input)
    inits = [t.name for t in model.graph.initializer if t.name in forward_reads]
    names = list(dict.fromkeys([*meta["wrt"], *no_grad, *inits]))  # type: ignore[misc]
    rows = []
    for name in names:
        i = info.get(name, TensorInfo())
        if name not in grads and name not in no_grad and not i.is_float:
            continue
        reason = None if name in grads else no_grad.get(name, "not differentiated (not in --wrt)")
        rows.append(_status(name, i, grads.get(name), reason))
    return rows


def training_report(m: onnx.ModelProto, dims: Mapping[str, int] = NO_DIMS) -> TrainingReport:
    sig = read_yield(m.graph.node[find_yield(m.graph.node)])
    n_forward, n_backward = node_counts(m)
    meta = read_metadata(m)
    loss = meta["loss"]
    grad_of = sig.grad_of()
    yields = [YieldOutput(i, name, i in grad_of, i in set(sig.full_shape), grad_of.get(i), name == loss)
              for i, name in enumerate(sig.outputs)]

    forward, _, manifest = split(m)
    out_info = {o.name: info_from_type(o.type) for o in forward.graph.output}
    stashed = [_summary(n, out_info.get(n, TensorInfo()), dims) for n in manifest.stashed]
    total: Poly = {}
    unknown = 0
    for n in manifest.stashed:
        p = _size_poly(out_info.get(n, TensorInfo()), dims)
        if p is None:
            unknown += 1
        else:
            _add_poly(total, p)
    notes = []
    if unknown:
        notes.append(f"{unknown} stashed tensor(s) of unknown size are not in the stash total")
    return TrainingReport(
        opset=default_opset(m),
        ir_version=m.ir_version,
        forward_nodes=n_forward,
        backward_nodes=n_backward,
        loss=loss,  # type: ignore[arg-type]
        gradients=gradient_table(m),
        yield_outputs=yields,
        stashed=stashed,
        stash_bytes=None if unknown == len(manifest.stashed) and unknown else _poly_value(total),
        backward_reads_inputs=[e.name for e in manifest.backward_inputs if e.role == "input"],
        backward_reads_parameters=[e.name for e in manifest.backward_inputs if e.role == "initializer"],
        dims=dict(dims),
        notes=notes,
    )


def node_counts(model: onnx.ModelProto) -> tuple[int, int]:
    """(forward, backward) node counts of a training graph."""
    y = find_yield(model.graph.node)
    return y, len(model.graph.node) - y - 1


# --------------------------------------------------------------------------------------------------
# text


def _table(rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [list(r) for r in rows]
    if not rows:
        return []
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def plural(count: int, word: str) -> str:
    """"1 tensor", "2 tensors"."""
    return f"{count} {word}" + ("" if count == 1 else "s")


def gradient_line(row: GradientStatus) -> str:
    if row.reason is None:
        return f"{row.name}: gradient {row.gradient}" if row.gradient else f"{row.name}: gets a gradient"
    return f"{row.name}: no gradient: {row.reason}"


def render_gradients(rows: Sequence[GradientStatus]) -> str:
    """One line per parameter: the lines `gradbuilder build` prints."""
    return "\n".join(gradient_line(r) for r in rows)


def _tensor_rows(ts: Sequence[TensorSummary], with_bytes: bool = False) -> list[str]:
    return _table([t.name, t.dtype, format_shape(t.shape)] + ([format_bytes(t.bytes)] if with_bytes else [])
                  for t in ts)


def _render_forward(r: ForwardReport) -> list[str]:
    out = [f"forward model: opset {r.opset}, IR {r.ir_version}, {plural(r.nodes, 'node')}"
           + (f", producer {r.producer}" if r.producer else "")]
    out.append(f"inputs ({len(r.inputs)}):")
    out += _tensor_rows(r.inputs, with_bytes=True) or ["  (none)"]
    out.append(f"outputs ({len(r.outputs)}):")
    out += _tensor_rows(r.outputs, with_bytes=True) or ["  (none)"]
    out.append(f"parameters ({len(r.parameters)}, {format_bytes(r.parameter_bytes)}"
               + (f"; plus {plural(r.constants, 'non-float initializer')}" if r.constants else "") + "):")
    out += _table([p.name, p.dtype, format_shape(p.shape), format_bytes(p.bytes),
                   "gets a gradient" if p.reason is None else f"no gradient: {p.reason}"]
                  for p in r.parameters) or ["  (none)"]
    out.append("ops:")
    labels = {"yes": "rule", "missing": "NO GRADIENT RULE", "no inputs": "no rule needed (no inputs)"}
    out += _table([o.op, str(o.count), labels.get(o.rule, o.rule)
                   + (" (on the gradient path)" if o.blocking else "")] for o in r.ops) or ["  (none)"]
    missing = [o.op for o in r.ops if o.rule in ("missing", "control flow")]
    out.append("ops without a gradient rule: " + (", ".join(missing) if missing else "none"))
    return out


def _render_training(r: TrainingReport) -> list[str]:
    out = [f"training graph: opset {r.opset}, IR {r.ir_version}, {plural(r.forward_nodes, 'forward node')}, "
           f"{plural(r.backward_nodes, 'backward node')}" + (f", loss '{r.loss}'" if r.loss else "")]
    got = sum(1 for g in r.gradients if g.reason is None)
    out.append(f"gradients ({got} of {len(r.gradients)}):")
    out += ["  " + gradient_line(g) for g in r.gradients] or ["  (none)"]
    out.append(f"Yield ({DOMAIN}): {plural(len(r.yield_outputs), 'module output')}, "
               f"{plural(sum(y.differentiable for y in r.yield_outputs), 'host gradient')}")
    rows = []
    for y in r.yield_outputs:
        if y.differentiable:
            what = f"host gradient {y.host_gradient}, " + ("full shape" if y.full_shape else "scalar 0 allowed")
        elif y.loss:
            what = "loss: gradient seeded with 1 in the graph"
        else:
            what = "not differentiable"
        rows.append([str(y.index), y.name, what])
    out += _table(rows)
    at = ", ".join(f"{k}={v}" for k, v in r.dims.items())
    out.append(f"stashed for backward ({plural(len(r.stashed), 'tensor')}, {format_bytes(r.stash_bytes)}"
               + (f" at {at}" if at else "") + "):")
    out += _tensor_rows(r.stashed, with_bytes=True) or ["  (none)"]
    if r.backward_reads_inputs or r.backward_reads_parameters:
        reads = [f"inputs {', '.join(r.backward_reads_inputs)}"] if r.backward_reads_inputs else []
        reads += [f"parameters {', '.join(r.backward_reads_parameters)}"] if r.backward_reads_parameters else []
        out.append("backward also reads: " + "; ".join(reads))
    return out


def render_text(report: Report) -> str:
    lines = _render_training(report) if isinstance(report, TrainingReport) else _render_forward(report)
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def render_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2)


# --------------------------------------------------------------------------------------------------
# the rule registry


@dataclass
class OpRow:
    op: str
    opsets: str
    family: str
    nondiff_inputs: str
    nondiff_outputs: str
    dtypes: str = ""
    in_ort: bool = False


def _positions(op: str, domain: str, until: int, idx: Iterable[int], outputs: bool) -> str:
    """'1 (shape), 2 (axes)': indices with the schema's names when ONNX knows the op."""
    try:
        schema = onnx.defs.get_schema(op, until, domain)
        formal = schema.outputs if outputs else schema.inputs
    except Exception:  # custom domains have no schema
        formal = []
    parts = []
    for i in sorted(idx):
        name = formal[min(i, len(formal) - 1)].name if formal else ""
        parts.append(f"{i} ({name})" if name else str(i))
    return ", ".join(parts)


def op_table() -> list[OpRow]:
    rows = []
    for r in registry.all_rules():
        op = r.op_type if not r.domain else f"{r.domain}.{r.op_type}"
        if r.all_nondiff:
            ins = outs = "all (derivative 0)" if r.zero_derivative else "all"
        else:
            ins = _positions(r.op_type, r.domain, r.until, r.nondiff_inputs, outputs=False)
            outs = _positions(r.op_type, r.domain, r.until, r.nondiff_outputs, outputs=True)
        rows.append(OpRow(op, r.opset_range, r.family, ins, outs, "-" if r.all_nondiff else FLOAT_TYPES,
                          not r.domain and r.op_type in ORT_TRAINING_OPS))
    return rows


_HEADERS = ("op", "opsets", "family", "non-differentiable inputs", "non-differentiable outputs")
_MD_HEADERS = (*_HEADERS, "gradient dtypes", "ORT training")


def render_ops_text(rows: Sequence[OpRow]) -> str:
    lines = _table([list(_HEADERS)] + [[r.op, r.opsets, r.family, r.nondiff_inputs or "-", r.nondiff_outputs or "-"]
                                       for r in rows], indent="")
    return "\n".join([*lines, f"{len(rows)} rules; ops not listed have no gradient rule."])


def render_ops_markdown(rows: Sequence[OpRow]) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [
        "# Supported ops",
        "",
        "<!-- generated by `gradbuilder ops --markdown`; do not edit by hand -->",
        "",
        "Ops with a gradient rule, the default-domain opsets the rule covers, and the inputs and outputs",
        "gradients never flow through (indices, shapes, masks). A row with *all* is an op that is allowed on",
        "the gradient path but stops gradients (Shape, comparisons). An op that is not listed has no rule:",
        "a model using it builds only if no gradient has to cross it (freeze the parameters that feed it).",
        "*all (derivative 0)* marks those torch differentiates to zeros (Round, Sign): a tensor that reaches the",
        "differentiated outputs only through them gets zeros (the manifest's `zero_gradient`), not None.",
        "",
        "The last column says whether ONNX Runtime's old training stack had a gradient for the op",
        "(from its `gradient_builder_registry.cc`; its com.microsoft-only entries are left out).",
        "",
        "| " + " | ".join(_MD_HEADERS) + " |",
        "|" + "---|" * len(_MD_HEADERS),
    ]
    for r in rows:
        cells = [f"`{r.op}`", r.opsets, r.family, r.nondiff_inputs, r.nondiff_outputs, r.dtypes,
                 "yes" if r.in_ort else ""]
        lines.append("| " + " | ".join(esc(c) for c in cells) + " |")
    ours = {r.op for r in rows if r.dtypes != "-"}
    missing = sorted(ORT_TRAINING_OPS - ours)
    extra = len(ours - ORT_TRAINING_OPS)
    lines += ["", f"{len(ours)} differentiable ops; ONNX Runtime training had {len(ORT_TRAINING_OPS)} of the default "
              f"domain. Ours and not theirs: {extra}. Theirs and not ours: {', '.join(missing) or 'none'}."]
    return "\n".join(lines) + "\n"
