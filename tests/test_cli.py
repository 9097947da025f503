"""The `gradbuilder` command: results, summaries, and a clear message and exit code for every bad input.

Models are made here with onnx.helper (nothing binary is committed). Most runs call `main([...])` in
process; a few go through `python -m gradbuilder` and the installed console script.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from clihelpers import OPSET, assert_fails, run, snapshot, tiny, with_loss
from clihelpers import f32 as _f32
from clihelpers import make_model as _model
from clihelpers import save as _save
from clihelpers import session as _session
from onnx import TensorProto as TP
from onnx import helper

from gradbuilder import cli
from gradbuilder.graph import UMASK, TensorInfo
from gradbuilder.inspect_model import format_bytes, inspect_model, tensor_bytes
from gradbuilder.rules import registry

# --------------------------------------------------------------------------------------------------
# models


def custom_op(on_path: bool = True) -> onnx.ModelProto:
    """A com.example.Frobnicate node: reading W (on the gradient path) or only the input x (not on it)."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [3])
    outs = [helper.make_tensor_value_info("y", TP.FLOAT, [3]), helper.make_tensor_value_info("z", TP.FLOAT, [3])]
    frob_in = ["x", "W"] if on_path else ["x"]
    nodes = [helper.make_node("Frobnicate", frob_in, ["y"], name="frob", domain="com.example"),
             helper.make_node("Mul", ["x", "W"], ["z"], name="mul")]
    return _model(nodes, [x], outs, [_f32("W", [1, 2, 3])], extra_opsets=["com.example"])


def future_opset() -> onnx.ModelProto:
    """Attention at opset 24, met by a rule table that ends Attention at 23 (`attention_until_23`): how a model
    of an ONNX newer than the rules is met."""
    shape = [1, 1, 2, 3]
    x = helper.make_tensor_value_info("x", TP.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TP.FLOAT, shape)
    return _model([helper.make_node("Attention", ["x", "W", "W"], ["y"], name="attend")], [x], [y],
                  [_f32("W", np.ones(shape))], opset=24)


def control_flow() -> onnx.ModelProto:
    """An If whose branches read the parameter W from the outer scope."""
    def branch(op: str, out: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["W"], [out])], f"{op}_branch", [],
                                 [helper.make_tensor_value_info(out, TP.FLOAT, [3])])

    c = helper.make_tensor_value_info("c", TP.BOOL, [])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [3])
    node = helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch("Identity", "a"),
                            else_branch=branch("Neg", "b"))
    return _model([node], [c], [y], [_f32("W", [1, 2, 3])])


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Every model and broken file the tests use, written under tmp_path/in."""
    d = tmp_path / "in"
    d.mkdir()
    f = {name: _save(make(), d / f"{name}.onnx") for name, make in [
        ("tiny", tiny), ("loss", with_loss), ("custom", custom_op), ("future", future_opset),
        ("control", control_flow)]}
    good = f["tiny"].read_bytes()
    f["truncated"] = d / "truncated.onnx"
    f["truncated"].write_bytes(good[: len(good) // 2])
    f["random"] = d / "random.onnx"
    f["random"].write_bytes(np.random.default_rng(0).bytes(600))
    f["empty"] = d / "empty.onnx"
    f["empty"].write_bytes(b"")
    f["directory"] = d / "dir.onnx"
    f["directory"].mkdir()
    f["missing"] = d / "missing.onnx"
    f["a_file"] = d / "notes.txt"
    f["a_file"].write_text("not a directory")
    f["training"] = d / "training.onnx"
    assert cli.main(["-q", "build", str(f["tiny"]), "-o", str(f["training"]), "--freeze", "F"]) == 0
    return f


# --------------------------------------------------------------------------------------------------
# success paths


def test_version_and_usage(capsys):
    rc, out, _ = run(capsys, ["--version"])
    assert rc == 0 and out.strip() == f"gradbuilder {cli.version()}"
    assert cli.version() != "unknown"  # the package is installed (editable) in the venv
    rc, _, err = run(capsys, [])
    assert rc == 2 and "COMMAND" in err
    rc, _, err = run(capsys, ["build", "x.onnx"])
    assert rc == 2 and "-o" in err
    rc, _, err = run(capsys, ["inspect", "x.onnx", "--dim", "batch"])
    assert rc == 2 and "NAME=N" in err


def test_build_prints_one_line_per_parameter(capsys, files, tmp_path):
    before = snapshot(files["tiny"].parent)
    out_path = tmp_path / "out" / "t.onnx"
    rc, out, err = run(capsys, ["build", files["tiny"], "-o", out_path, "--freeze", "F"])
    assert rc == 0, err
    assert snapshot(files["tiny"].parent) == before  # the input is never touched
    lines = out.splitlines()
    assert lines[:4] == [
        "W: gradient W_grad",
        "b: gradient b_grad",
        "U: no gradient: no node reads it and it is not an output (unused)",
        "F: no gradient: frozen",
    ]
    assert lines[4].startswith(f"wrote {out_path}: 4 forward nodes, ")
    assert sorted(p.name for p in out_path.parent.iterdir()) == ["t.onnx"]  # no temp file left
    onnx.checker.check_model(onnx.load(str(out_path)))


def test_build_wrt_and_quiet(capsys, files, tmp_path):
    rc, out, _ = run(capsys, ["build", files["tiny"], "-o", tmp_path / "t.onnx", "--wrt", "W", "--wrt", "b"])
    assert rc == 0 and out.splitlines()[:2] == ["W: gradient W_grad", "b: gradient b_grad"]
    assert "F: no gradient: not differentiated (not in --wrt)" in out
    rc, out, err = run(capsys, ["-q", "build", files["tiny"], "-o", tmp_path / "q.onnx"])
    assert (rc, out, err) == (0, "", "")
    rc, out, err = run(capsys, ["build", files["tiny"], "-o", tmp_path / "q2.onnx", "-q"])  # after the command too
    assert (rc, out, err) == (0, "", "")
    assert (tmp_path / "q.onnx").is_file() and (tmp_path / "q2.onnx").is_file()


def test_build_split_run_on_onnxruntime(capsys, files, tmp_path):
    training = tmp_path / "training.onnx"
    assert run(capsys, ["build", files["tiny"], "-o", training, "--freeze", "F"])[0] == 0
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, ["split", training, "-o", tmp_path / "parts"])
    assert rc == 0, err
    assert re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'parts'))}/: forward.onnx \(4 nodes\), "
                        r"backward.onnx \(\d+ nodes\), manifest.json \(1 stashed tensor\)", out.strip()), out
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("parts")} == before
    parts = tmp_path / "parts"
    assert sorted(p.name for p in parts.iterdir()) == ["backward.onnx", "forward.onnx", "manifest.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left beside it

    manifest = json.loads((parts / "manifest.json").read_text())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    dy = rng.standard_normal((5, 3)).astype(np.float32)
    fwd_names = [e["name"] for e in manifest["forward_outputs"]]
    env = dict(zip(fwd_names, _session(parts / "forward.onnx").run(fwd_names, {"x": x})))
    W, b, F = np.float32([1.5, -2.0, 0.5]), np.float32([0.1, 0.2, 0.3]), np.float32([3, 3, 3])
    np.testing.assert_allclose(env["y"], (x + b) * W - F, rtol=1e-6)

    known = {"x": x, "W": W, "b": b, "F": F, **env}  # inputs, parameters, stashed tensors
    feeds = {e["name"]: dy if e["role"] == "output_grad" else known[e["name"]] for e in manifest["backward_inputs"]}
    assert {e["role"] for e in manifest["backward_inputs"]} >= {"output_grad", "stash"}
    names = [e["name"] for e in manifest["backward_outputs"]]
    grads = dict(zip([e["wrt"] for e in manifest["backward_outputs"]],
                     _session(parts / "backward.onnx").run(names, feeds)))
    assert sorted(grads) == ["W", "b"]
    np.testing.assert_allclose(grads["W"], (dy * (x + b)).sum(0), rtol=1e-5)
    np.testing.assert_allclose(grads["b"], (dy * W).sum(0), rtol=1e-5)

    # outputs get the modes of any new file or directory, not mkstemp/mkdtemp's private 0600/0700
    assert (parts / "forward.onnx").stat().st_mode & 0o777 == 0o666 & ~UMASK
    assert parts.stat().st_mode & 0o777 == 0o777 & ~UMASK
    assert training.stat().st_mode & 0o777 == 0o666 & ~UMASK

    # splitting again into the same directory replaces the earlier split as a whole
    (parts / "manifest.json").write_text("stale")
    assert run(capsys, ["-q", "split", training, "-o", parts])[0] == 0
    assert json.loads((parts / "manifest.json").read_text()) == manifest


def test_split_without_gradients_says_backward_is_empty(capsys, files, tmp_path):
    """Everything frozen: backward.onnx has no outputs, which onnxruntime refuses to load with an obscure message
    ("OrtValue indexes should have been populated"); split says so."""
    training = tmp_path / "training.onnx"
    assert run(capsys, ["-q", "build", files["tiny"], "-o", training, "--freeze", "W", "b", "F", "U"])[0] == 0
    rc, out, err = run(capsys, ["split", training, "-o", tmp_path / "parts"])
    assert rc == 0, err
    assert "note: no tensor gets a gradient" in out and "run forward.onnx alone" in out
    rc, out, err = run(capsys, ["split", files["training"], "-o", tmp_path / "other"])
    assert rc == 0 and "note" not in out, err


def test_build_of_weights_in_constant_nodes_says_why_nothing_is_differentiated(capsys, tmp_path):
    """Weights written as Constant nodes (some exporters'): the default build differentiates float initializers, so
    it made no gradient and printed only "wrote ...: 0 backward nodes"."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [2, 4])
    nodes = [helper.make_node("Constant", [], ["W"], value=_f32("w", np.ones((3, 4)))),
             helper.make_node("MatMul", ["x", "W"], ["y"])]
    path = _save(_model(nodes, [x], [y]), tmp_path / "m.onnx")
    rc, out, err = run(capsys, ["build", path, "-o", tmp_path / "t.onnx"])
    assert rc == 0, err
    assert out.startswith("note: nothing was differentiated: the model has no float initializer") and (
        "1 Constant node holds float values (W), perhaps its weights" in out and "--wrt" in out), out
    rc, out, err = run(capsys, ["build", path, "-o", tmp_path / "t.onnx", "--wrt", "W"])
    assert rc == 0 and out.startswith("W: gradient W_grad"), err


def test_loss_and_outputs(capsys, files, tmp_path):
    rc, out, err = run(capsys, ["build", files["loss"], "-o", tmp_path / "l.onnx", "--loss", "loss",
                                "--outputs", "y"])
    assert rc == 0, err
    assert out.splitlines()[0] == "a: gradient a_grad"
    rc, out, _ = run(capsys, ["inspect", tmp_path / "l.onnx"])
    assert rc == 0
    assert "loss 'loss'" in out.splitlines()[0]
    assert "Yield (ai.gradbuilder): 3 module outputs, 1 host gradient" in out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("  ") and line.split()[0].isdigit()}
    assert "loss: gradient seeded with 1 in the graph" in rows["loss"]
    assert "not differentiable" in rows["n"]
    assert "host gradient y_host_grad" in rows["y"]


# --------------------------------------------------------------------------------------------------
# inspect


def test_inspect_forward(capsys, files):
    rc, out, err = run(capsys, ["inspect", files["tiny"]])
    assert rc == 0, err
    assert out.startswith("forward model: opset 17, ")
    assert "  x  FLOAT  [batch, 3]" in out
    assert "plus 1 non-float initializer)" in out
    param = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "B " in line}
    assert param["W"].split()[1:4] == ["FLOAT", "[3]", "12"] and param["W"].endswith("gets a gradient")
    assert param["U"].endswith("no gradient: no node reads it and it is not an output (unused)")
    assert "parameters (4, 44 B;" in out
    assert "ops without a gradient rule: none" in out


def test_inspect_source_ops_need_no_rule(capsys, tmp_path):
    """A Constant has no inputs, so no gradient could ever have to cross it: not a missing rule."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TP.FLOAT, [3])
    nodes = [helper.make_node("Constant", [], ["c"], value=_f32("v", [1, 2, 3])),
             helper.make_node("Add", ["x", "c"], ["s"]), helper.make_node("Mul", ["s", "W"], ["y"])]
    path = _save(_model(nodes, [x], [y], [_f32("W", [1, 1, 1])]), tmp_path / "m.onnx")
    rc, out, _ = run(capsys, ["inspect", path])
    assert rc == 0
    constant = next(line for line in out.splitlines() if line.split()[:1] == ["Constant"])
    assert "NO GRADIENT RULE" not in constant
    assert "ops without a gradient rule: none" in out


@pytest.mark.parametrize("on_path", [True, False])
def test_inspect_names_ops_without_rule(capsys, tmp_path, on_path):
    path = _save(custom_op(on_path), tmp_path / "m.onnx")
    rc, out, _ = run(capsys, ["inspect", path])
    assert rc == 0
    assert "ops without a gradient rule: com.example.Frobnicate" in out
    assert ("NO GRADIENT RULE (on the gradient path)" in out) == on_path
    assert ("note: a default build stops at com.example.Frobnicate" in out) == on_path


def test_inspect_training(capsys, files):
    rc, out, err = run(capsys, ["inspect", files["training"]])
    assert rc == 0, err
    assert out.startswith("training graph: opset 17, IR ")
    assert "4 forward nodes" in out
    assert "  F: no gradient: frozen" in out
    assert "  U: no gradient: no node reads it and it is not an output (unused)" in out
    assert "  W: gradient W_grad" in out
    assert "gradients (2 of 4):" in out
    assert "0  y  host gradient y_host_grad, full shape" in out
    assert "stashed for backward (1 tensor, 12*batch B):" in out
    assert "  t  FLOAT  [batch, 3]  12*batch B" in out
    assert "backward also reads: parameters W" in out

    rc, out, _ = run(capsys, ["inspect", files["training"], "--dim", "batch=1000"])
    assert "stashed for backward (1 tensor, 12,000 B (11.7 KiB) at batch=1000):" in out


def test_inspect_dim_named_with_an_equals_sign(capsys, tmp_path):
    """`--dim NAME=N` splits at the last '=': symbolic dims may be named anything, 'a=b' too."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["a=b", 3])
    m = _model([helper.make_node("Mul", ["x", "W"], ["y"])], [x], [helper.make_tensor_value_info("y", TP.FLOAT, None)],
               [_f32("W", [1, 2, 3])])
    rc, out, err = run(capsys, ["inspect", _save(m, tmp_path / "m.onnx"), "--dim", "a=b=10"])
    assert rc == 0, err
    assert "  x  FLOAT  [a=b, 3]  120 B" in out


def test_inspect_json(capsys, files):
    rc, out, _ = run(capsys, ["inspect", files["training"], "--json"])
    assert rc == 0
    report = json.loads(out)
    assert report["kind"] == "training"
    assert report["stashed"] == [{"name": "t", "dtype": "FLOAT", "shape": ["batch", 3], "bytes": "12*batch"}]
    by_name = {g["name"]: g for g in report["gradients"]}
    assert by_name["W"]["gradient"] == "W_grad" and by_name["W"]["reason"] is None
    assert by_name["F"]["reason"] == "frozen" and by_name["F"]["gradient"] is None
    rc, out, _ = run(capsys, ["inspect", files["tiny"], "--json"])
    report = json.loads(out)
    assert report["kind"] == "forward"
    assert [o["op"] for o in report["ops"]] == ["Add", "Mul", "Sub", "Identity"]
    assert report["inputs"] == [{"name": "x", "dtype": "FLOAT", "shape": ["batch", 3], "bytes": "12*batch"}]


def test_tensor_bytes():
    assert tensor_bytes(TensorInfo(TP.FLOAT, ("batch", "seq", 4))) == "16*batch*seq"
    assert tensor_bytes(TensorInfo(TP.FLOAT, ("batch", "seq", 4)), {"seq": 8}) == "128*batch"
    assert tensor_bytes(TensorInfo(TP.DOUBLE, (2, 3))) == 48
    assert tensor_bytes(TensorInfo(TP.FLOAT16, ())) == 2
    assert tensor_bytes(TensorInfo(TP.FLOAT, (None, 3))) is None
    assert tensor_bytes(TensorInfo(TP.FLOAT, None)) is None
    assert tensor_bytes(TensorInfo(0, (3,))) is None
    assert format_bytes(3 * 2**20) == "3,145,728 B (3.0 MiB)"
    report = inspect_model(tiny())
    assert report.kind == "forward" and [p.name for p in report.parameters] == ["W", "b", "F", "U"]


# --------------------------------------------------------------------------------------------------
# ops


def test_ops_lists_every_rule(capsys):
    rc, out, _ = run(capsys, ["ops"])
    assert rc == 0
    listed = {line.split()[0] for line in out.splitlines()[1:-1]}
    rules = registry.all_rules()
    assert listed == {r.op_type if not r.domain else f"{r.domain}.{r.op_type}" for r in rules}
    add = next(line for line in out.splitlines() if line.split()[0] == "Add").split()
    assert add[1:3] == [registry.lookup("Add", OPSET).opset_range, "elementwise"]


def test_ops_markdown(capsys):
    rc, out, _ = run(capsys, ["ops", "--markdown"])
    assert rc == 0 and out.startswith("# Supported ops\n")
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0] == ("| op | opsets | family | non-differentiable inputs | non-differentiable outputs "
                        "| gradient dtypes | ORT training |")
    assert len(table) == 2 + len(registry.all_rules())
    assert (f"| `Add` | {registry.lookup('Add', OPSET).opset_range} | elementwise |  |  "
            "| float16, bfloat16, float, double | yes |") in table
    assert any(line.startswith("| `Reshape` |") and "| 1 (shape) |" in line for line in table)


# --------------------------------------------------------------------------------------------------
# bad input: a message, exit 2, nothing written, input untouched


@pytest.mark.parametrize("name,needles", [
    ("truncated", ["truncated.onnx", "not a readable ONNX model", "truncated"]),
    ("random", ["random.onnx", "not a readable ONNX model"]),
    ("empty", ["empty.onnx", "empty"]),
    ("directory", ["dir.onnx", "is a directory"]),
    ("missing", ["missing.onnx", "no such file"]),
])
@pytest.mark.parametrize("command", ["build", "split", "inspect"])
def test_unreadable_input(capsys, files, tmp_path, name, needles, command):
    out = {"build": ["-o", tmp_path / "out.onnx"], "split": ["-o", tmp_path / "out"], "inspect": []}[command]
    assert_fails(capsys, tmp_path, [command, files[name], *out], *needles)


@pytest.mark.parametrize("model,flags,needles", [
    ("custom", [], ["com.example.Frobnicate", "'frob'", "opset 17", "`gradbuilder ops`"]),
    ("control", [], ["'branchy'", "If", "control flow"]),
    ("tiny", ["--loss", "y"], ["loss 'y'", "scalar"]),
    ("tiny", ["--loss", "t"], ["loss 't'", "not a graph output"]),
    ("tiny", ["--loss", "nope"], ["'nope'", "not a tensor"]),
    ("loss", ["--loss", "n"], ["loss 'n'", "INT64", "float"]),
    ("tiny", ["--wrt", "Wx"], ["wrt tensor 'Wx'", "Did you mean", "'W'"]),
    ("tiny", ["--freeze", "nope"], ["frozen tensor 'nope'"]),
    ("tiny", ["--outputs", "t"], ["'t'", "not a graph output"]),
    ("training", [], ["Yield", "training graph", "forward"]),
])
def test_build_rejects(capsys, files, tmp_path, model, flags, needles):
    assert_fails(capsys, tmp_path, ["build", files[model], "-o", tmp_path / "out.onnx", *flags], *needles)


@pytest.fixture
def attention_until_23(monkeypatch):
    """The rule table with Attention's rule ending at opset 23 (as it did before opsets 24 and 25 had a rule)."""
    key = ("", "Attention")
    monkeypatch.setitem(registry._RULES, key, [dataclasses.replace(r, until=min(r.until, 23))
                                               for r in registry._RULES[key]])
    registry.lookup.cache_clear()
    yield
    monkeypatch.undo()
    registry.lookup.cache_clear()


def test_build_rejects_an_opset_past_the_rules(capsys, files, tmp_path, attention_until_23):
    """A node of an opset the op's rules end before: named with the opset and the ranges the rules cover, and
    not because ONNX does not know that opset."""
    assert registry.lookup("Attention", 23) is not None and registry.lookup("Attention", 24) is None
    assert onnx.defs.get_schema("Attention", 24).since_version == 24, "the test model needs an opset ONNX knows"
    assert_fails(capsys, tmp_path, ["build", files["future"], "-o", tmp_path / "out.onnx"],
                 "Attention", "opset 24", "rules exist for opsets 23-23", "`gradbuilder ops`")


def test_split_rejects_forward_graph(capsys, files, tmp_path):
    assert_fails(capsys, tmp_path, ["split", files["tiny"], "-o", tmp_path / "out"],
                 "Yield", "not a training graph", "build one first")


@pytest.mark.parametrize("command", ["split", "inspect"])
def test_damaged_training_graph(capsys, files, tmp_path, command):
    """A backward node reading a name nothing defines: bad input (exit 2), not an internal error."""
    m = onnx.load(str(files["training"]))
    m.graph.node.append(helper.make_node("Neg", ["ghost"], ["ghost_neg"], name="haunted"))
    path = _save(m, tmp_path / "in" / "damaged.onnx")
    out = ["-o", tmp_path / "parts"] if command == "split" else []
    assert_fails(capsys, tmp_path, [command, path, *out], "'ghost'", "'haunted'", "damaged")


def test_bad_output_paths(capsys, files, tmp_path):
    tiny_, training = files["tiny"], files["training"]
    assert_fails(capsys, tmp_path, ["build", tiny_, "-o", files["a_file"] / "out.onnx"], "is a file, not a directory")
    assert_fails(capsys, tmp_path, ["build", tiny_, "-o", files["directory"]], "is a directory")
    assert_fails(capsys, tmp_path, ["build", tiny_, "-o", tiny_], "is the input file")
    assert_fails(capsys, tmp_path, ["split", training, "-o", files["a_file"]], "not a directory")
    assert_fails(capsys, tmp_path, ["split", training, "-o", files["a_file"] / "d"], "is a file, not a directory")
    assert_fails(capsys, tmp_path, ["split", training, "-o", training.parent], "lies inside the output directory")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    assert_fails(capsys, tmp_path, ["split", training, "-o", tmp_path / "busy"], "keep.txt", "already holds")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory(capsys, files, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert_fails(capsys, tmp_path, ["build", files["tiny"], "-o", ro / "t.onnx"], "is not writable")
        assert_fails(capsys, tmp_path, ["split", files["training"], "-o", ro / "parts"], "is not writable")
    finally:
        ro.chmod(0o755)


def test_failed_write_leaves_nothing(capsys, files, tmp_path, monkeypatch):
    def no_space(*_args, **_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)  # the last step of every atomic write
    assert_fails(capsys, tmp_path, ["build", files["tiny"], "-o", tmp_path / "t.onnx"],
                 "cannot write output", "No space left on device")
    assert_fails(capsys, tmp_path, ["split", files["training"], "-o", tmp_path / "parts"],
                 "cannot write output directory", "No space left on device")


def test_failed_split_keeps_earlier_split(capsys, files, tmp_path, monkeypatch):
    parts = tmp_path / "parts"
    assert run(capsys, ["split", files["training"], "-o", parts])[0] == 0
    (parts / "manifest.json").write_text("earlier")

    def fail(*_args, **_kw):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cli, "save_text_atomic", fail)  # fails after both models are written
    assert_fails(capsys, tmp_path, ["split", files["training"], "-o", parts], "Input/output error")
    assert (parts / "manifest.json").read_text() == "earlier"


# --------------------------------------------------------------------------------------------------
# bugs: exit 1, "please report", traceback only with --debug


def test_internal_error(capsys, files, tmp_path, monkeypatch):
    def boom(*_args, **_kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "split", boom)
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, ["split", files["training"], "-o", tmp_path / "parts"])
    assert rc == 1 and out == ""
    assert err.startswith("gradbuilder: error: internal error: RuntimeError: boom")
    assert "This is a bug in gradbuilder" in err and "please report it" in err and "--debug" in err
    assert "Traceback" not in err and err.strip().count("\n") == 0
    assert snapshot(tmp_path) == before
    rc, _, err = run(capsys, ["--debug", "split", files["training"], "-o", tmp_path / "parts"])
    assert rc == 1 and "Traceback (most recent call last)" in err and "RuntimeError: boom" in err


def test_debug_shows_traceback_of_user_errors(capsys, files, tmp_path):
    rc, _, err = run(capsys, ["build", files["random"], "-o", tmp_path / "o.onnx", "--debug"])
    assert rc == 2 and "Traceback" in err and "ModelLoadError" in err


# --------------------------------------------------------------------------------------------------
# real processes


def _console_script() -> Path:
    path = Path(sys.executable).parent / "gradbuilder"
    if not path.exists():
        pytest.skip("the gradbuilder console script is not installed next to this interpreter")
    return path


def test_python_dash_m(files, tmp_path):
    out = tmp_path / "t.onnx"
    p = subprocess.run([sys.executable, "-m", "gradbuilder", "build", str(files["tiny"]), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "W: gradient W_grad" in p.stdout and out.is_file()
    p = subprocess.run([sys.executable, "-m", "gradbuilder", "inspect", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "stashed for backward" in p.stdout


def test_console_script(files, tmp_path):
    script = str(_console_script())
    p = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("gradbuilder ")
    p = subprocess.run([script, "build", str(files["random"]), "-o", str(tmp_path / "o.onnx")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("gradbuilder: error: ") and "Traceback" not in p.stderr
    assert not (tmp_path / "o.onnx").exists()
