"""Builder time against graph size: it must grow linearly (a 10k-node graph in about a second)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

import gradbuilder

BLOCK = 6  # nodes per residual block


def residual_mlp(n_nodes: int, width: int = 16) -> onnx.ModelProto:
    """A chain of residual blocks MatMul-Add-Relu-MatMul-Add-LayerNormalization, with a dynamic batch."""
    nodes, inits = [], []
    x = "x"
    rng = np.random.default_rng(0)
    for k in range(max(1, n_nodes // BLOCK)):
        w1, b1, w2, s, t = (f"b{k}.{n}" for n in ("w1", "b1", "w2", "scale", "shift"))
        for name, shape in ((w1, (width, width)), (b1, (width,)), (w2, (width, width)), (s, (width,)),
                            (t, (width,))):
            inits.append(onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name))
        h = f"b{k}"
        nodes += [
            helper.make_node("MatMul", [x, w1], [f"{h}.mm1"]),
            helper.make_node("Add", [f"{h}.mm1", b1], [f"{h}.pre"]),
            helper.make_node("Relu", [f"{h}.pre"], [f"{h}.act"]),
            helper.make_node("MatMul", [f"{h}.act", w2], [f"{h}.mm2"]),
            helper.make_node("Add", [f"{h}.mm2", x], [f"{h}.res"]),
            helper.make_node("LayerNormalization", [f"{h}.res", s, t], [f"{h}.out"], axis=-1),
        ]
        x = f"{h}.out"
    graph = helper.make_graph(nodes, "residual_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def measure(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), repeats: int = 5) -> list[dict[str, float]]:
    """Best of `repeats` (2 above 30k nodes) of the whole public call, `build_gradient_graph(model)` on a
    ModelProto: copy, validation, shape inference, reachability, rules, assembly of the output model.
    Wall and CPU seconds of the same run, and the one-minute load average after it (the machine is shared)."""
    rows = []
    for n in sizes:
        model = residual_mlp(n)
        runs = []
        for _ in range(repeats if n <= 30_000 else min(repeats, 2)):
            t0, c0 = time.perf_counter(), time.process_time()
            training = gradbuilder.build_gradient_graph(model)
            runs.append((time.perf_counter() - t0, time.process_time() - c0, os.getloadavg()[0]))
            nodes = len(training.graph.node)
            del training
        wall, cpu, load = min(runs)
        rows.append({"forward_nodes": len(model.graph.node), "training_nodes": nodes, "seconds": wall,
                     "cpu_seconds": cpu, "load": load, "us_per_node": 1e6 * wall / len(model.graph.node)})
    return rows


def report(rows: list[dict[str, float]]) -> str:
    lines = ["| forward nodes | training nodes | build time (s) | CPU time (s) | us per forward node | load |",
             "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['forward_nodes']:,} | {r['training_nodes']:,} | {r['seconds']:.2f} | "
              f"{_opt(r, 'cpu_seconds', '.2f')} | {r['us_per_node']:.0f} | {_opt(r, 'load', '.1f')} |" for r in rows]
    return "\n".join(lines)


def _opt(row: dict[str, float], key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


if __name__ == "__main__":
    print(report(measure(tuple(int(a) for a in sys.argv[1:]) or (1_000, 10_000, 100_000))))
