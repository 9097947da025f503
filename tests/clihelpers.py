"""Helpers shared by the CLI test files: small models made in code, and running the CLI with its checks.

Every bad-input test ends in `assert_fails`, so "a message, the exit code, nothing written, the input
untouched" is stated once for the whole suite.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper

from gradbuilder import cli

OPSET = 17


def make_model(nodes, inputs, outputs, inits=(), opset=OPSET, extra_opsets=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    return helper.make_model(graph, opset_imports=opsets)


def f32(name: str, value) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(value, np.float32), name)


def save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def tiny() -> onnx.ModelProto:
    """y = (x + b) * W - F; U is unused, idx is an int constant. Backward of W stashes t = x + b."""
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TP.FLOAT, ["batch", 3])
    inits = [f32("W", [1.5, -2.0, 0.5]), f32("b", [0.1, 0.2, 0.3]), f32("F", [3, 3, 3]), f32("U", [1, 1]),
             onnx.numpy_helper.from_array(np.array([1], np.int64), "idx")]
    nodes = [helper.make_node("Add", ["x", "b"], ["t"], name="add"),
             helper.make_node("Mul", ["t", "W"], ["u"], name="mul"),
             helper.make_node("Sub", ["u", "F"], ["v"], name="sub"),
             helper.make_node("Identity", ["v"], ["y"], name="id")]
    return make_model(nodes, [x], [y], inits)


def with_loss() -> onnx.ModelProto:
    """Outputs: loss = sum-free scalar (x0 - a)^2, n (int), y = xv * a (float [3])."""
    inputs = [helper.make_tensor_value_info("x0", TP.FLOAT, []), helper.make_tensor_value_info("xv", TP.FLOAT, [3])]
    outputs = [helper.make_tensor_value_info("loss", TP.FLOAT, []), helper.make_tensor_value_info("n", TP.INT64, [3]),
               helper.make_tensor_value_info("y", TP.FLOAT, [3])]
    nodes = [helper.make_node("Sub", ["x0", "a"], ["d"], name="sub"),
             helper.make_node("Mul", ["d", "d"], ["loss"], name="sq"),
             helper.make_node("Cast", ["xv"], ["n"], name="cast", to=TP.INT64),
             helper.make_node("Mul", ["xv", "a"], ["y"], name="scale")]
    return make_model(nodes, inputs, outputs, [f32("a", 2.0)])


def snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under root with its bytes and mtime: equal snapshots mean nothing was written or left."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
    return out


def run(capsys, args: Sequence[str]) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_fails(capsys, tmp_path: Path, args: Sequence[str], *needles: str, code: int = 2) -> str:
    """The run fails with `code`, one paragraph on stderr naming `needles`, and writes nothing anywhere."""
    before = snapshot(tmp_path)
    rc, out, err = run(capsys, args)
    assert rc == code, err
    assert out == ""
    assert err.startswith("gradbuilder: error: "), err
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0, f"not one paragraph:\n{err}"
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert snapshot(tmp_path) == before, "a failed run changed or left files"
    return err
