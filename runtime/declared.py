"""The first forward's outputs against the shapes the model declares for them.

The backward takes each output's gradient as an input declared like the output, and the gradient graph was built
on the declared dims wherever onnx's shape inference could not compute them (a Reshape to a shape computed at run
time). onnxruntime only logs a warning when an output comes out of another shape than declared, so a wrong
declaration showed first as the backward refusing the host's gradient ("Got invalid dimensions for input:
y_host_grad"). Checked once, at a session's first forward: symbols are bound by the inputs fed, then by the
outputs in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx
from onnxruntime.capi import _pybind_state as C

from gradbuilder.errors import InvalidModelError
from gradbuilder.inference import Dims, declared_dims


def _shape(v: C.OrtValue) -> list[int] | None:
    return list(v.shape()) if v.is_tensor() else None


def _bind(declared: Dims, actual: Sequence[int], symbols: dict[str, tuple[int, str]], name: str) -> str | None:
    """Where `actual` breaks `declared` (binding its symbols to `name`'s sizes on the way), else None."""
    if len(declared) != len(actual):
        return f"rank {len(actual)} where the model declares rank {len(declared)}"
    for axis, (d, n) in enumerate(zip(declared, actual)):
        if isinstance(d, int) and d != n:
            return f"size {n} on axis {axis} where the model declares {d}"
        if isinstance(d, str):
            size, source = symbols.setdefault(d, (n, name))
            if size != n:
                return (f"size {n} on axis {axis}, declared '{d}', which '{source}' has as {size}" if source != name
                        else f"size {n} on axis {axis}, declared '{d}' like an earlier axis of size {size}")
    return None


def _input_symbols(graph: onnx.GraphProto, feeds: Mapping[str, C.OrtValue]) -> dict[str, tuple[int, str]]:
    """Each symbol the inputs fed give one size: (the size, the first input having it). onnxruntime refuses inputs
    that break their static dims but not inputs disagreeing on a symbol, which then binds nothing."""
    seen: dict[str, tuple[int, str]] = {}
    torn: set[str] = set()
    for vi in graph.input:
        dims = declared_dims(vi)
        shape = _shape(feeds[vi.name]) if vi.name in feeds and dims is not None else None
        if dims is None or shape is None or len(dims) != len(shape):
            continue
        for d, n in zip(dims, shape):
            if isinstance(d, str) and seen.setdefault(d, (n, vi.name))[0] != n:
                torn.add(d)
    return {d: bound for d, bound in seen.items() if d not in torn}


def check_outputs(graph: onnx.GraphProto, feeds: Mapping[str, C.OrtValue], names: Sequence[str],
                  outputs: Sequence[C.OrtValue]) -> None:
    """Raise InvalidModelError naming the first output whose shape breaks its declaration. `names`: the graph's
    outputs in order (a name may repeat, declared otherwise each time)."""
    if [vi.name for vi in graph.output] != list(names):
        return  # not the graph's outputs as they are declared: nothing to hold them to
    symbols = _input_symbols(graph, feeds)
    for vi, value in zip(graph.output, outputs):
        name, dims = vi.name, declared_dims(vi)
        shape = _shape(value) if dims is not None else None
        problem = None if shape is None or dims is None else _bind(dims, shape, symbols, name)
        if problem is not None:
            raise InvalidModelError(
                f"graph output '{name}' came out of the forward with shape {shape}: {problem} ({dims}). The "
                "backward takes its gradient in the declared shape and was built on it. Fix the output's declared "
                "shape (or leave the dims unknown) and build again.")


PLAN_BROKEN = "Shape mismatch attempting to re-use buffer"
"""onnxruntime's words when a run's sizes break the dims its memory plan took from the model's declarations (an
output declared [batch, 3] that a Concat along the batch makes [2 batch, 3]): the run fails before any output
exists to hold to its declaration."""


def run_failure(error: Exception) -> InvalidModelError | None:
    """The error a first forward's failed run stands for where onnxruntime's plan from the declared shapes broke,
    else None."""
    said = str(error)
    if PLAN_BROKEN not in said:
        return None
    return InvalidModelError(
        "the forward failed where onnxruntime planned its memory from the shapes the model declares, which the run "
        f"breaks ({said}). Fix the declared shapes of the graph outputs and value_info (or leave the dims unknown) "
        "and build again.")
