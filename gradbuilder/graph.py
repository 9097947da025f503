"""Loading, validating and indexing an ONNX model; unique names; atomic saves."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto

from .errors import InvalidModelError, ModelLoadError

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
MIN_OPSET = 13

Dim = int | str | None


@dataclass(frozen=True)
class TensorInfo:
    """Element type (0 when unknown) and shape (None when even the rank is unknown)."""

    elem_type: int = 0
    shape: tuple[Dim, ...] | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_float(self) -> bool:
        # An unknown type is treated as float: refusing a gradient would be silently wrong.
        return self.elem_type == 0 or self.elem_type in FLOAT_TYPES

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return tuple(self.shape)  # type: ignore[arg-type]

    def numel(self) -> int | None:
        s = self.static_shape
        if s is None:
            return None
        n = 1
        for d in s:
            n *= d
        return n


UNKNOWN = TensorInfo()


def type_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type) if elem_type else "unknown"


def info_from_type(tp: onnx.TypeProto) -> TensorInfo:
    if not tp.HasField("tensor_type"):
        return TensorInfo()
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return TensorInfo(tt.elem_type, None)
    dims: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorInfo(tt.elem_type, tuple(dims))


def value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, info.elem_type, None if info.shape is None else list(info.shape))


def load_model(model: onnx.ModelProto | str | os.PathLike | bytes, *, copy: bool = True) -> onnx.ModelProto:
    """Accept a ModelProto, a path or serialized bytes; always return a model we may modify."""
    if isinstance(model, onnx.ModelProto):
        if not copy:
            return model
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    if isinstance(model, bytes):
        try:
            return onnx.load_from_string(model)
        except Exception as e:  # protobuf raises a zoo of types
            raise ModelLoadError(f"the bytes given are not a serialized ONNX model ({e}).") from e
    path = Path(model)
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory; give the path of the .onnx file itself.")
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file.")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty (0 bytes); it is not an ONNX model.")
    try:
        loaded = onnx.load(str(path), load_external_data=True)
    except FileNotFoundError as e:
        raise ModelLoadError(
            f"{path}: the model refers to an external data file that is missing ({e.filename or e}). "
            "Keep the .onnx file next to its external data files."
        ) from e
    except Exception as e:
        raise ModelLoadError(
            f"{path}: not a readable ONNX model ({type(e).__name__}: {e}). "
            "The file may be truncated or not an ONNX protobuf at all."
        ) from e
    if not loaded.HasField("graph") or (not loaded.graph.node and not loaded.graph.output):
        raise ModelLoadError(f"{path}: the file parsed but holds no graph; is it really an ONNX model?")
    return loaded


def default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    raise InvalidModelError(
        "the model imports no version of the default ONNX domain (opset_import has no '' entry); "
        "re-export it with an opset between 13 and the latest."
    )


def subgraph_free_names(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names a control-flow node's bodies read: its hidden inputs."""
    free: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            defined |= {t.name for t in g.sparse_initializer}
            for n in g.node:
                for name in n.input:
                    if name and name not in defined:
                        free.add(name)
                free |= {x for x in subgraph_free_names(n) if x not in defined}
                defined.update(o for o in n.output if o)
    return free


class ForwardGraph:
    """A read-only index of a forward graph: producers, consumers, types, initializers."""

    def __init__(self, model: onnx.ModelProto, *, infer: bool = True):
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model)
        if self.opset < MIN_OPSET:
            raise InvalidModelError(
                f"the model uses opset {self.opset}; gradbuilder supports opset {MIN_OPSET} and later. "
                "Convert it with onnx.version_converter.convert_version(model, 17)."
            )
        self.nodes: list[onnx.NodeProto] = list(self.graph.node)
        self.initializers: dict[str, TensorProto] = {t.name: t for t in self.graph.initializer}
        self.inputs: list[str] = [i.name for i in self.graph.input]
        self.outputs: list[str] = [o.name for o in self.graph.output]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[tuple[int, int]]] = {}
        self.hidden_inputs: dict[int, set[str]] = {}
        self._index()
        self.info: dict[str, TensorInfo] = self._infer_types() if infer else self._declared_types()

    def _index(self) -> None:
        defined = set(self.inputs) | set(self.initializers)
        for k, node in enumerate(self.nodes):
            for i, name in enumerate(node.input):
                if not name:
                    continue
                if name not in defined:
                    self._undefined(node, name)
                self.consumers.setdefault(name, []).append((k, i))
            if node.op_type in CONTROL_FLOW_OPS or any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
            ):
                hidden = subgraph_free_names(node)
                for name in sorted(hidden):
                    if name not in defined:
                        self._undefined(node, name)
                    self.consumers.setdefault(name, []).append((k, -1))
                self.hidden_inputs[k] = hidden
            for name in node.output:
                if not name:
                    continue
                if name in defined:
                    raise InvalidModelError(
                        f"tensor '{name}' is defined twice (again as output of node {describe(node)}); "
                        "ONNX graphs are single-assignment. Rename one of them."
                    )
                defined.add(name)
                self.producer[name] = k
        for name in self.outputs:
            if name not in defined:
                raise InvalidModelError(
                    f"graph output '{name}' is produced by no node and is neither an input nor an initializer."
                )

    def _undefined(self, node: onnx.NodeProto, name: str) -> None:
        later = any(name in n.output for n in self.nodes)
        why = (
            "it is produced later: the nodes are not in topological order, or the graph has a cycle"
            if later
            else "no node, graph input or initializer defines it (a dangling input)"
        )
        raise InvalidModelError(f"node {describe(node)} reads tensor '{name}', but {why}.")

    def _declared_types(self) -> dict[str, TensorInfo]:
        info: dict[str, TensorInfo] = {}
        for vi in [*self.graph.input, *self.graph.value_info, *self.graph.output]:
            info[vi.name] = info_from_type(vi.type)
        for t in self.graph.initializer:
            info[t.name] = TensorInfo(t.data_type, tuple(t.dims))
        return info

    def _infer_types(self) -> dict[str, TensorInfo]:
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=False, data_prop=True)
            graph = inferred.graph
        except Exception:  # inference is a help, never a requirement
            return self._declared_types()
        info = {vi.name: info_from_type(vi.type) for vi in graph.value_info}
        for vi in [*graph.input, *graph.output]:
            declared = info_from_type(vi.type)
            if declared.elem_type or vi.name not in info:
                info[vi.name] = declared
        for t in graph.initializer:
            info[t.name] = TensorInfo(t.data_type, tuple(t.dims))
        return info

    def tensor_info(self, name: str) -> TensorInfo:
        return self.info.get(name, UNKNOWN)

    def all_names(self) -> set[str]:
        return set(self.inputs) | set(self.initializers) | set(self.producer)


def describe(node: onnx.NodeProto) -> str:
    name = f"'{node.name}' " if node.name else ""
    outs = ", ".join(node.output)
    dom = f"{node.domain}." if node.domain not in ("", "ai.onnx") else ""
    return f"{name}({dom}{node.op_type} -> {outs})"


class NameAllocator:
    """Hands out names unused in the graph, deterministically (same graph, same names)."""

    def __init__(self, taken: Iterable[str]):
        self._taken = set(taken)
        self._next: dict[str, int] = {}

    def reserve(self, name: str) -> bool:
        if name in self._taken:
            return False
        self._taken.add(name)
        return True

    def fresh(self, base: str) -> str:
        if self.reserve(base):
            return base
        k = self._next.get(base, 1)
        while f"{base}_{k}" in self._taken:
            k += 1
        self._next[base] = k + 1
        name = f"{base}_{k}"
        self._taken.add(name)
        return name


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()
"""Read once at import: mkstemp creates 0600 files, and a saved model should get the mode of any new file."""


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write next to the target and rename, so a crash never leaves a half-written model."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    large = model.ByteSize() > 2**31 - 2**20
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~UMASK)
    try:
        if large:
            data_name = path.name + ".data"
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name + ".tmp", size_threshold=1024)
            os.replace(path.parent / (data_name + ".tmp"), path.parent / data_name)
            fixed = onnx.load(tmp, load_external_data=False)
            for t in fixed.graph.initializer:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = data_name
            with open(tmp, "wb") as f:
                f.write(fixed.SerializeToString())
        else:
            with open(tmp, "wb") as f:
                f.write(model.SerializeToString())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_text_atomic(text: str, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o666 & ~UMASK)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
