"""Loading, validating and indexing an ONNX model; unique names; atomic saves."""

from __future__ import annotations

import functools
import io
import math
import os
import re
import tempfile
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import onnx.inliner
from google.protobuf.message import Message
from onnx import TensorProto

from .errors import InvalidModelError, ModelLoadError, SaveError
from .inference import declared_dims, infer_shapes

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
MIN_OPSET = 13
MIN_IR_VERSION = 7
"""The IR version opset 13 came with (onnx 1.8): no exporter writes an older one beside a supported opset."""

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


KNOWN_TYPES = frozenset(TensorProto.DataType.values()) - {TensorProto.UNDEFINED}


def type_name(elem_type: int) -> str:
    if not elem_type:
        return "unknown"
    return TensorProto.DataType.Name(elem_type) if elem_type in KNOWN_TYPES else f"type {elem_type} (not an ONNX type)"


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


def _infos(memo: dict[Any, TensorInfo], *fields: Iterable[onnx.ValueInfoProto]) -> Iterator[tuple[str, TensorInfo]]:
    """(name, info_from_type) of every value_info in `fields`, each distinct type converted once."""
    for field in fields:
        for vi in field:
            tp = vi.type
            key = tp.SerializeToString()
            info = memo.get(key)
            if info is None:
                info = memo[key] = info_from_type(tp)
            yield vi.name, info


def _initializer_infos(memo: dict[Any, TensorInfo], graph: onnx.GraphProto) -> Iterator[tuple[str, TensorInfo]]:
    for t in graph.initializer:
        key = (t.data_type, tuple(t.dims))
        info = memo.get(key)
        if info is None:
            info = memo[key] = TensorInfo(*key)
        yield t.name, info


def value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name)
    vi.type.CopyFrom(_tensor_type(info))
    return vi


def add_value_info(field: Any, name: str, info: TensorInfo) -> None:
    """Append value_info(name, info) to a repeated ValueInfoProto field without building it twice."""
    field.add(name=name).type.CopyFrom(_tensor_type(info))


@functools.lru_cache(maxsize=4096)
def _tensor_type(info: TensorInfo) -> onnx.TypeProto:
    """The TypeProto onnx.helper makes for `info` (shared: callers only copy from it)."""
    return onnx.helper.make_tensor_type_proto(info.elem_type, None if info.shape is None else list(info.shape))


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
            loaded = onnx.load_from_string(model)
        except Exception as e:  # protobuf raises a zoo of types
            raise ModelLoadError(f"the bytes given are not a serialized ONNX model ({_first_line(e)}).") from e
        return _require_graph(loaded, "the bytes given")
    path = Path(model)
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory; give the path of the .onnx file itself.")
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file.")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file (a device, socket or pipe); give the path of an .onnx file.")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty (0 bytes); it is not an ONNX model.")
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror or e}).") from e
    try:
        loaded = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise ModelLoadError(
            f"{path}: not a readable ONNX model ({type(e).__name__}: {_first_line(e)}). "
            "The file may be truncated or not an ONNX protobuf at all."
        ) from e
    _require_graph(loaded, str(path))
    _load_external_data(loaded, path)
    return loaded


def _all_tensors(graph: onnx.GraphProto) -> Iterable[TensorProto]:
    """Every tensor of a graph, its subgraphs and node attributes: where onnx looks for external data."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _all_tensors(a.g)
            for g in a.graphs:
                yield from _all_tensors(g)


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read each external tensor once, straight into the model.

    onnx.load_external_data_for_model reads every byte twice (once to check the file's bounds), and each
    read of a 2 GB tensor costs a 2 GB allocation; its errors also do not say which file or what to do.
    Like onnx, only regular files inside the model's directory are read.
    """
    base = path.parent.resolve()
    for t in _all_tensors(model.graph):
        if t.data_location != TensorProto.EXTERNAL:
            continue
        fields = {e.key: e.value for e in t.external_data}
        location = fields.get("location", "")
        what = f"{path}: tensor '{t.name}'"
        broken = ("Keep the .onnx file next to its external data files, as they were written: references must "
                  "name files in the model's directory, holding the bytes the model says they do.")
        if not location or os.path.isabs(location):
            how = "names no file" if not location else f"names an absolute path ({location})"
            raise ModelLoadError(f"{what} is stored as external data but {how}. {broken}")
        file = path.parent / location
        if not file.resolve().is_relative_to(base):
            raise ModelLoadError(f"{what} is stored in '{location}', which points outside the model's directory "
                                 f"({path.parent}); gradbuilder does not read it. {broken}")
        if not file.exists():
            raise ModelLoadError(f"{what} is stored in the external data file '{location}', which is missing "
                                 f"(looked for {file}). Keep the .onnx file next to its external data files.")
        if not file.is_file():
            raise ModelLoadError(f"{what} is stored in '{location}', which is not a regular file. {broken}")
        try:
            offset = int(fields.get("offset", "0"))
            length = int(fields["length"]) if "length" in fields else None
        except ValueError:
            raise ModelLoadError(f"{what}: its external data offset or length is not a number. {broken}") from None
        size = file.stat().st_size
        want = fixed_nbytes(t)
        if offset < 0 or (length is not None and length < 0) or offset > size or (
                length is not None and offset + length > size):
            raise ModelLoadError(f"{what} takes bytes {offset}..{offset + (length or 0)} of '{location}', which "
                                 f"holds {size:,} bytes. {broken}")
        if want is not None and (length if length is not None else size - offset) != want:
            got = length if length is not None else size - offset
            raise ModelLoadError(f"{what} has {got:,} bytes in '{location}', but its type {type_name(t.data_type)} "
                                 f"and shape {list(t.dims)} take {want:,}. {broken}")
        try:
            with open(file, "rb") as f:
                f.seek(offset)
                data = f.read(-1 if length is None else length)
        except OSError as e:
            raise ModelLoadError(f"{what}: cannot read '{location}' ({e.strerror or e}).") from e
        t.raw_data = data
        del data
        t.data_location = TensorProto.DEFAULT
        del t.external_data[:]


def external_data_files(path: str | os.PathLike) -> set[Path]:
    """The directory entries of the external data files the model at `path` reads (their directories resolved, as a
    save replaces the entry, not what a link names): part of the model, so never an output. Empty when the file is
    no readable model (loading it says why)."""
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return set()
    locations = {e.value for t in _all_tensors(model.graph) if t.data_location == TensorProto.EXTERNAL
                 for e in t.external_data if e.key == "location" and e.value}
    return {entry(path.parent / loc) for loc in locations}


def entry(path: Path) -> Path:
    """`path` with its directory resolved but not its last part: what a save or a rename replaces."""
    return path.parent.resolve() / path.name


def _first_line(e: BaseException) -> str:
    """onnx's checker messages carry a multi-line context; the CLI prints one paragraph."""
    return str(e).strip().split("\n", 1)[0].rstrip(".")


def _require_graph(model: onnx.ModelProto, what: str) -> onnx.ModelProto:
    # protobuf happily parses many byte strings as a ModelProto full of unknown fields
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelLoadError(f"{what}: the contents parse as protobuf but hold no ONNX graph; is it really an "
                             "ONNX model?")
    bad = _non_utf8(model)
    if bad is not None:
        raise ModelLoadError(f"{what}: {bad} is not valid UTF-8, as every ONNX name must be; the file is damaged.")
    return model


def _non_utf8(msg: Message) -> str | None:
    """The first string field holding invalid UTF-8, which protobuf hands to Python as bytes, not str."""
    if isinstance(msg, TensorProto):  # never list a tensor's fields: that would copy its data
        fields = [("name", msg.name), ("doc_string", msg.doc_string)]
        fields += [("external_data", x) for e in msg.external_data for x in (e.key, e.value)]
        return next((f"a tensor's {f} {v!r}" for f, v in fields if isinstance(v, bytes)), None)
    for fd, value in msg.ListFields():
        if fd.type == fd.TYPE_STRING:
            for v in value if _repeated(fd) else [value]:
                if isinstance(v, bytes):
                    return f"the {fd.containing_type.name} field '{fd.name}' {v!r}"
        elif fd.message_type is not None:
            for m in value if _repeated(fd) else [value]:
                bad = _non_utf8(m)
                if bad is not None:
                    return bad
    return None


def default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    raise InvalidModelError(
        "the model imports no version of the default ONNX domain (opset_import has no '' entry); "
        f"re-export it with an opset between {MIN_OPSET} and {onnx.defs.onnx_opset_version()}."
    )


def subgraph_free_names(node: onnx.NodeProto) -> set[str]:
    """Outer-scope names a control-flow node's bodies read: its hidden inputs."""
    free: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            defined |= {t.values.name for t in g.sparse_initializer}  # a sparse tensor's name is its values''
            for n in g.node:
                for name in n.input:
                    if name and name not in defined:
                        free.add(name)
                free |= {x for x in subgraph_free_names(n) if x not in defined}
                defined.update(o for o in n.output if o)
    return free


class ForwardGraph:
    """A read-only index of a forward graph: producers, consumers, types, initializers.

    Making one validates the model: anything the builder or a rule could mishandle (opsets, names, order,
    schemas, tensor bytes, types and shapes) is refused here with an InvalidModelError that names the node or
    tensor and says what to do, so that no rule ever sees a malformed node.
    """

    def __init__(self, model: onnx.ModelProto, *, infer: bool = True):
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model)
        _check_versions(model, self.opset)
        self.nodes: list[onnx.NodeProto] = list(self.graph.node)
        # every read of a protobuf field costs about a microsecond: the names each node reads and writes, once
        self.node_inputs: list[list[str]] = [n.input[:] for n in self.nodes]
        """Input names of each node (never changed by the build)."""
        self.node_outputs: list[list[str]] = [n.output[:] for n in self.nodes]
        """Output names of each node as loaded (rules may add optional outputs to the nodes later)."""
        self.node_ops: list[str] = [n.op_type for n in self.nodes]
        """op_type of each node."""
        self.node_domains: list[str] = [n.domain for n in self.nodes]
        """domain of each node, as written ("ai.onnx" stays "ai.onnx")."""
        self.initializers: dict[str, TensorProto] = {t.name: t for t in self.graph.initializer}
        self.inputs: list[str] = [i.name for i in self.graph.input]
        self.outputs: list[str] = [o.name for o in self.graph.output]
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[tuple[int, int]]] = {}
        self.hidden_inputs: dict[int, set[str]] = {}
        _check_interface(self.graph)
        self._index()
        _check_nodes(model, self.nodes, self.hidden_inputs, self.node_ops)
        hazard = dimension_hazard(self.graph, self.nodes, self.node_ops, self.hidden_inputs)
        if hazard is not None:
            raise InvalidModelError(
                f"{hazard}: onnx's shape inference would crash the process on this model. Fix the shape (a wrong "
                "constant or declaration) or re-export the model.")
        self._largest = max((_check_tensor(t, f"initializer '{t.name}'") for t in self.graph.initializer), default=0)
        for n, op in zip(self.nodes, self.node_ops):  # a Constant's value is read by rules as an initializer's is
            if op == "Constant":
                for a in n.attribute:
                    if a.type == onnx.AttributeProto.TENSOR:
                        _check_tensor(a.t, f"the {a.name} of node {describe(n)}")
        self.info: dict[str, TensorInfo] = self._infer_types() if infer else self._declared_types()
        self._check_inferred_tensors()
        for node, inputs, op, dom in zip(self.nodes, self.node_inputs, self.node_ops, self.node_domains):
            self._check_input_types(node, inputs, op, dom)
            if dom not in ("", "ai.onnx"):
                continue
            if op == "Cast":
                _check_cast(node)
            elif op in ("Reshape", "Gemm") or op in AXIS_OPS or op.startswith("Reduce"):
                _check_int_attributes(node)
                if op.startswith("Reduce") and len(inputs) > 1 and inputs[1]:
                    self._check_scalar_reduced(node, inputs)
            if op == "Split" and self.opset >= 18:
                _check_split_parts(node)
            if op in SHAPE_INPUTS:
                self._check_shape_input(node, op)

    def _check_shape_input(self, node: onnx.NodeProto, op: str) -> None:
        """A shape input must be a vector (Expand(W, [[1]]) ran in onnxruntime's kernel, its inference refused
        the same node recomputed in backward)."""
        i = SHAPE_INPUTS[op]
        name = node.input[i] if i < len(node.input) else ""
        rank = self.tensor_info(name).rank if name else None
        if rank is not None and rank != 1:
            raise InvalidModelError(
                f"node {describe(node)} takes its output's shape from '{name}', of rank {rank}; {op} takes a 1-D "
                "vector there. Fix the model or re-export it."
            )

    def _check_scalar_reduced(self, node: onnx.NodeProto, inputs: Sequence[str]) -> None:
        """A rank-0 tensor has no axis to reduce, so axes computed at run time (which inference cannot range-check)
        must be empty there: onnxruntime's kernel runs such a node as a copy, but its inference refuses the node as
        soon as the axes are folded to constants, as its optimizers and the runtime do."""
        shape = self.tensor_info(inputs[1]).shape
        count = shape[0] if shape is not None and len(shape) == 1 else None
        if self.tensor_info(inputs[0]).rank == 0 and isinstance(count, int) and count > 0:
            raise InvalidModelError(
                f"node {describe(node)} reduces '{inputs[0]}', a scalar (rank 0), over the {count} axes in "
                f"'{inputs[1]}'; a scalar has no axes. Give it an empty axes input or remove the node (an earlier "
                "reduction probably dropped the dims: check its keepdims).")

    def _check_inferred_tensors(self) -> None:
        """A tensor of a type onnx does not define (an attribute naming a type, such as Cast's 'to' or
        LayerNormalization's 'stash_type', holds a wrong number): no rule could cast to or from it. And a
        negative size, which onnx's inference computes without a word for a node that cannot run (a kernel
        reaching past its padded input, pads cropping more than the input holds): rules would build on it."""
        for name, info in self.info.items():
            shape = info.shape
            if shape is not None and any(isinstance(d, int) and d < 0 for d in shape):
                made = self.producer.get(name)
                if made is not None:
                    raise InvalidModelError(
                        f"node {describe(self.nodes[made])} cannot run on its inputs: onnx's shape inference gives "
                        f"its output '{name}' the shape {list(shape)}, with a negative size (a kernel reaching past "
                        "the padded input, pads cropping more than the input holds, a shape computed wrong). Fix "
                        "the node's attributes or the shapes it reads."
                    )
            if info.elem_type and info.elem_type not in KNOWN_TYPES:
                made = self.producer.get(name)
                by = f", made by node {describe(self.nodes[made])}," if made is not None else ""
                raise InvalidModelError(
                    f"tensor '{name}'{by} has element type {info.elem_type}, which is not an ONNX type: an attribute "
                    "naming a type (Cast's 'to', LayerNormalization's 'stash_type', a dtype) holds a wrong value. "
                    "Fix it or re-export the model.")

    def _index(self) -> None:
        defined = set(self.inputs) | set(self.initializers)
        consumers, producer = self.consumers, self.producer
        for k, (node, inputs, outputs, op) in enumerate(zip(self.nodes, self.node_inputs, self.node_outputs,
                                                            self.node_ops)):
            for i, name in enumerate(inputs):
                if not name:
                    continue
                if name not in defined:
                    self._undefined(node, name)
                uses = consumers.get(name)
                if uses is None:
                    consumers[name] = [(k, i)]
                else:
                    uses.append((k, i))
            if op in CONTROL_FLOW_OPS or (node.attribute and _has_bodies(node)):
                hidden = subgraph_free_names(node)
                for name in sorted(hidden):
                    if name not in defined:
                        self._undefined(node, name, hidden=True)
                    consumers.setdefault(name, []).append((k, -1))
                self.hidden_inputs[k] = hidden
            for name in outputs:
                if not name:
                    continue
                if name in defined:
                    raise InvalidModelError(
                        f"tensor '{name}' is defined twice (again as output of node {describe(node)}); "
                        "ONNX graphs are single-assignment. Rename one of them."
                    )
                defined.add(name)
                producer[name] = k
        for name in self.outputs:
            if name not in defined:
                raise InvalidModelError(
                    f"graph output '{name}' is produced by no node and is neither an input nor an initializer; "
                    "fix its name or remove it from the graph outputs."
                )

    def _undefined(self, node: onnx.NodeProto, name: str, *, hidden: bool = False) -> None:
        reads = f"reads tensor '{name}'" + (" inside its subgraph" if hidden else "")
        later = next((n for n in self.nodes if name in n.output), None)
        if later is None:
            raise InvalidModelError(
                f"node {describe(node)} {reads}, but no node, graph input or initializer defines it (a dangling "
                f"input). Add '{name}' as a graph input or initializer, or fix the node's input name."
            )
        cycle = find_cycle(self.nodes)
        if cycle:
            path = " -> ".join(describe(n) for n in [*cycle, cycle[0]])
            raise InvalidModelError(
                f"the graph has a cycle: {path}. ONNX graphs must be acyclic; the model is damaged or was exported "
                "wrongly (a loop must be a Loop or Scan node)."
            )
        raise InvalidModelError(
            f"node {describe(node)} {reads}, which node {describe(later)} produces after it: the nodes are not in "
            "topological order, as ONNX requires. Sort them, e.g. with onnx_ir: m = onnx_ir.load(path); "
            "m.graph.sort(); onnx_ir.save(m, path)."
        )

    def _declared_types(self) -> dict[str, TensorInfo]:
        memo: dict[Any, TensorInfo] = {}
        info = dict(_infos(memo, self.graph.input, self.graph.value_info, self.graph.output))
        info.update(_initializer_infos(memo, self.graph))
        return info

    def _infer_types(self) -> dict[str, TensorInfo]:
        known = (self.node_ops, self.node_domains)  # of self.model's nodes
        copy, untyped = _for_inference(self.model, self._largest, known)
        graph = self._inferred(copy, untyped, data_prop=False)
        if graph is None:  # inference is a help, never a requirement
            return self._declared_types()
        # values of shape tensors: static shapes through Shape/Concat/Reshape (a second pass, when it can differ)
        matters = _data_propagation_matters(copy, bool(self.hidden_inputs), known if copy is self.model else None)
        if matters and _cheap_data_propagation(graph):
            try:
                graph = self._inferred(copy, untyped, data_prop=True) or graph
            except InvalidModelError:
                if not _computed_slices(copy.graph):
                    raise
                # seen wrong: the legacy export of nn.MultiheadAttention(add_bias_kv=True), whose unflatten(-1)
                # slices a shape at bounds computed by Mod, got rank 7 for a Reshape of rank 4 (as declared, and
                # as the plain pass and onnxruntime have it); where slices are computed, the plain pass's types stand
        memo: dict[Any, TensorInfo] = {}
        info = dict(_infos(memo, graph.value_info))
        for name, declared in _infos(memo, graph.input, graph.output):
            if declared.elem_type or name not in info:
                info[name] = declared
        info.update(_initializer_infos(memo, self.graph))
        return info

    def _inferred(self, copy: onnx.ModelProto, untyped: bool, data_prop: bool) -> onnx.GraphProto | None:
        """Strict shape inference: a conflict it reports is refused, naming the node; None if inference fails."""
        try:
            return infer_shapes(copy, strict=True, data_prop=data_prop).graph
        except onnx.shape_inference.InferenceError as e:
            lines = str(e).replace("[ShapeInferenceError] Inference error(s): ", "").splitlines()
            problems = [line for line in lines if line.strip()
                        and not (untyped and "instead is null" in line)]  # inputs we made untyped
            if problems:
                raise self._inconsistent(problems[0]) from None
            try:
                return infer_shapes(copy, data_prop=data_prop).graph
            except Exception:
                return None
        except Exception:
            return None

    def _check_input_types(self, node: onnx.NodeProto, inputs: Sequence[str] | None = None,
                           op_type: str | None = None, domain: str | None = None) -> None:
        """Every input's element type must be one the op's schema allows, inputs sharing a type parameter must
        agree, and only optional inputs may be empty: rules trust all three, and neither the checker nor strict
        shape inference checks them (Add(float, double) and Max(x, '') pass). `op_type` and `domain`: the
        node's, when already read."""
        if domain is None:
            domain = node.domain
        if domain not in ("", "ai.onnx"):
            return
        if op_type is None:
            op_type = node.op_type
        summary = _input_schema(op_type, self.opset, domain)
        if summary is None:  # check_node has already refused ops ONNX does not know
            return
        formals = summary
        if not formals:
            return
        last = len(formals) - 1
        bound: dict[str, tuple[str, str]] = {}
        for i, name in enumerate(node.input if inputs is None else inputs):
            formal_name, type_str, optional, ok, tensors, shared = formals[i if i < last else last]
            if not name:
                if not optional:
                    raise InvalidModelError(
                        f"node {describe(node)}: input {i} is empty, but only optional inputs may be left out "
                        f"({op_type}'s '{formal_name}' is not); remove it or name a tensor."
                    )
                continue
            elem_type = self.tensor_info(name).elem_type
            if not elem_type:
                continue
            actual = _tensor_type_str(elem_type)
            if actual not in ok and tensors:
                raise InvalidModelError(
                    f"node {describe(node)}: input {i} ('{name}') is {type_name(elem_type)}, but {op_type} "
                    f"at opset {self.opset} takes {' or '.join(sorted(ok))} there; fix the model (a Cast is "
                    "probably missing) or re-export it."
                )
            if shared:
                first = bound.setdefault(type_str, (actual, name))
                if first[0] != actual:
                    raise InvalidModelError(
                        f"node {describe(node)}: inputs '{first[1]}' ({first[0]}) and '{name}' ({actual}) must have "
                        f"the same type ({op_type}'s type parameter {type_str}); fix the model (a Cast "
                        "is probably missing) or re-export it."
                    )

    def _inconsistent(self, line: str) -> InvalidModelError:
        """A type or shape conflict in a node: a rule would build on a wrong shape, so refuse, naming the node."""
        line = re.sub(r"elem type: \((\d+)\) vs \((\d+)\)",
                      lambda m: f"elem type: {type_name(int(m[1]))} vs {type_name(int(m[2]))}", line)
        found = re.search(r"\(op_type:([^,)]*)(?:, node name: ([^)]*))?\): (?:\[\w+\] )?(.*)", line)
        if found is None:  # not about one node: a declared type or shape disagrees with what the nodes compute
            where, why = " between the declared and the computed types", re.sub(r"^\[\w+\] ", "", line.strip())
        else:
            op, name, why = found.groups()
            same = [n for n in self.nodes if n.op_type == op and (name is None or n.name == name)]
            where = f" at node {describe(same[0])}" if len(same) == 1 else f" at a {op} node"
        return InvalidModelError(
            f"the model's types or shapes are inconsistent{where}: {why.strip().rstrip('.')}. Fix the node's inputs "
            "or the declared types and shapes (graph inputs, outputs, value_info), or re-export the model "
            "(onnx.shape_inference.infer_shapes(model, strict_mode=True) reports the same)."
        )

    def tensor_info(self, name: str) -> TensorInfo:
        return self.info.get(name, UNKNOWN)

    def all_names(self) -> set[str]:
        return set(self.inputs) | set(self.initializers) | set(self.producer)


@functools.lru_cache(maxsize=4096)
def _input_schema(op_type: str, opset: int, domain: str) -> tuple[
        tuple[str, str, bool, frozenset[str], bool, bool], ...] | None:
    """What _check_input_types needs of an op's schema, per formal input: its name, type string, whether it is
    optional, the types it takes, whether any of them is a tensor type, and whether inputs of its type parameter
    must agree (homogeneous); None when ONNX has no schema for the op."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:
        return None
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs) for c in schema.type_constraints}
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    formals = []
    for f in schema.inputs:
        ok = allowed.get(f.type_str, frozenset({f.type_str}))
        formals.append((f.name, f.type_str, f.option == optional, ok, any(t.startswith("tensor(") for t in ok),
                        bool(f.is_homogeneous) and f.type_str in allowed))
    return tuple(formals)


@functools.lru_cache(maxsize=256)
def _tensor_type_str(elem_type: int) -> str:
    return f"tensor({TensorProto.DataType.Name(elem_type).lower()})"


def _check_versions(model: onnx.ModelProto, opset: int) -> None:
    versions: dict[str, set[int]] = {}
    for op in model.opset_import:
        versions.setdefault("" if op.domain == "ai.onnx" else op.domain, set()).add(op.version)
    twice = next(((d, sorted(v)) for d, v in versions.items() if len(v) > 1), None)
    if twice is not None:
        domain = f"domain '{twice[0]}'" if twice[0] else "the default ONNX domain"
        raise InvalidModelError(
            f"the model imports {domain} at {len(twice[1])} versions ({', '.join(map(str, twice[1]))}) in "
            "opset_import: tools disagree on which one counts (onnx's checker takes the last entry, others the "
            "first), so the ops would be read by one opset and checked by another. Keep one entry per domain."
        )
    latest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise InvalidModelError(
            f"the model uses opset {opset}; gradbuilder supports opset {MIN_OPSET} and later. "
            "Convert it with onnx.version_converter.convert_version(model, 17)."
        )
    if opset > latest:
        raise InvalidModelError(
            f"the model imports opset {opset} of the default domain, but the newest ONNX opset (onnx "
            f"{onnx.__version__}) is {latest}; the opset_import is wrong. Re-export it with a real opset."
        )
    if model.ir_version <= 0:
        raise InvalidModelError(
            "the model has no IR version (ir_version is 0), so no runtime will load it; set "
            f"model.ir_version (onnx {onnx.__version__} writes {onnx.IR_VERSION}) or re-export it."
        )
    if model.ir_version < MIN_IR_VERSION:
        raise InvalidModelError(
            f"the model has IR version {model.ir_version}, older than opset {opset} allows (opset {MIN_OPSET} came "
            f"with IR version {MIN_IR_VERSION}): tools read a model by its IR version's rules, and below 4 "
            "initializers must also be graph inputs, so onnx's shape inference leaves them untyped and checks "
            f"nothing. Set model.ir_version (onnx {onnx.__version__} writes {onnx.IR_VERSION}) or re-export it."
        )
    if model.ir_version > onnx.IR_VERSION:
        raise InvalidModelError(
            f"the model has IR version {model.ir_version}, newer than onnx {onnx.__version__} reads "
            f"({onnx.IR_VERSION}); upgrade onnx or re-export the model for an older IR version."
        )


def _check_interface(graph: onnx.GraphProto) -> None:
    """Outputs, inputs and declared types: what the builder and the runtime take at face value."""
    if not graph.output:
        raise InvalidModelError(
            "the graph has no outputs, so nothing depends on its parameters and there is nothing to "
            "differentiate; add the loss or the module outputs as graph outputs."
        )
    seen: set[str] = set()
    for vi in graph.input:
        if vi.name in seen:
            raise InvalidModelError(f"graph input '{vi.name}' is listed twice; remove the duplicate.")
        seen.add(vi.name)
    if graph.sparse_initializer:
        raise InvalidModelError(
            f"the graph has sparse initializers ('{graph.sparse_initializer[0].values.name}'), which gradbuilder "
            "does not support; store them as dense initializers."
        )
    init_types = {t.name: t.data_type for t in graph.initializer}
    init_dims = {t.name: list(t.dims) for t in graph.initializer}
    declared: dict[str, tuple[str, int]] = {}
    for kind, vis in (("graph input", graph.input), ("graph output", graph.output), ("value_info", graph.value_info)):
        for vi in vis:
            if not vi.name:
                raise InvalidModelError(f"a {kind} has an empty name; give every graph input and output a name.")
            t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if t is None or not t.elem_type:
                continue
            if t.elem_type not in KNOWN_TYPES:
                raise InvalidModelError(
                    f"{kind} '{vi.name}' has element type {t.elem_type}, which is not an ONNX type; fix its "
                    "declaration or re-export the model."
                )
            if init_types.get(vi.name, t.elem_type) != t.elem_type:
                raise InvalidModelError(
                    f"{kind} '{vi.name}' is declared {type_name(t.elem_type)}, but the initializer of that name is "
                    f"{type_name(init_types[vi.name])}; fix the declaration or re-export the model."
                )
            dims, held = declared_dims(vi), init_dims.get(vi.name)
            if dims is not None and held is not None and (
                    len(dims) != len(held) or any(isinstance(d, int) and d != n for d, n in zip(dims, held))):
                raise InvalidModelError(  # the runtime read the declaration (a Squeeze of it found idle: seed 122)
                    f"{kind} '{vi.name}' is declared of shape {dims}, but the initializer of that name has "
                    f"{list(held)}; fix the declaration or re-export the model."
                )
            first = declared.setdefault(vi.name, (kind, t.elem_type))
            if first[1] != t.elem_type:
                raise InvalidModelError(
                    f"'{vi.name}' is declared {type_name(first[1])} as a {first[0]} and {type_name(t.elem_type)} as a "
                    f"{kind}; a tensor has one type: fix the declarations or re-export the model."
                )


def _checker_context(model: onnx.ModelProto) -> onnx.checker.C.CheckerContext:
    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = model.ir_version
    opsets = {op.domain: op.version for op in reversed(model.opset_import)}  # the first entry wins, as above
    default = opsets.get("", opsets.get("ai.onnx"))
    if default is not None:
        opsets.setdefault("", default)
        opsets.setdefault("ai.onnx", default)
    ctx.opset_imports = opsets
    return ctx


def _check_nodes(model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto],
                 bodies: Container[int] | None = None, op_types: Sequence[str] | None = None) -> None:
    """onnx's schema check per node: unknown ops, attribute names and types, input and output counts.

    The rules read attributes and inputs by position, so a node that breaks its schema must stop here, with
    its name, rather than deep inside a rule. Bodies of control-flow nodes are checked by signature only:
    they read outer names the checker cannot be told about, and they are never differentiated. `bodies`, when
    known, holds the positions of all nodes that may have bodies; `op_types`, when known, the nodes' op_type.
    """
    ctx = _checker_context(model)
    scope = onnx.checker.LEXICAL_SCOPE_CONTEXT
    check_node = onnx.checker.C.check_node  # onnx.checker.check_node without its per-call type check
    for k, node in enumerate(nodes):
        nested = _has_bodies(node) if bodies is None else k in bodies and _has_bodies(node)
        try:
            check_node((_without_bodies(node) if nested else node).SerializeToString(), ctx, scope)
        except Exception as e:  # ValidationError, or whatever else a broken node makes the checker raise
            why = _first_line(e)
            if why.startswith("No Op registered") and node.domain == "ai.onnx" and onnx.defs.has(node.op_type):
                todo = ("The domain is the default one spelled out, which onnx's checker and shape inference know only "
                        "as '': set the node's domain to ''")
            elif why.startswith("No Op registered") and node.domain in ("", "ai.onnx"):
                todo = ("If it is a custom op, give it a domain of its own (and an opset_import for that domain); "
                        "otherwise re-export the model")
            elif why.startswith("No opset import for domain"):
                todo = f"Add an opset_import entry for domain '{node.domain}'"
            else:
                todo = "Fix the node or re-export the model (onnx.checker.check_model reports the same)"
            raise InvalidModelError(f"node {describe(node)} is not valid ONNX: {why}. {todo}.") from None
        if "" in node.output:
            _check_unnamed_outputs(node, ctx.opset_imports)
        _check_inference_hazards(node, None if op_types is None else op_types[k])
        if nested:
            for n in nested_nodes(node):
                _check_inference_hazards(n)


UNNAMED_OUTPUT_CRASHES = frozenset({"BatchNormalization"})
"""Default-domain ops onnxruntime (1.32) crashes on, a segmentation fault, when an output ONNX makes optional is
left out with an empty name (a training BatchNormalization's running mean, before its running variance or not)."""


def _check_unnamed_outputs(node: onnx.NodeProto, opsets: Mapping[str, int]) -> None:
    """An empty name stands for an optional output left out; onnx's checker lets it stand for any output, and
    onnxruntime crashed (a segmentation fault) running a Split whose second output had none."""
    domain = node.domain or ""
    if node.op_type in UNNAMED_OUTPUT_CRASHES and domain in ("", "ai.onnx"):
        i = list(node.output).index("")
        raise InvalidModelError(f"node {describe(node)} leaves its output {i} unnamed: onnxruntime crashes (a "
                                f"segmentation fault) running a {node.op_type} with an output left out that way. Give "
                                "every output a name (graph outputs need not list them).")
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
    except onnx.defs.SchemaError:
        return
    formal = list(schema.outputs)
    for i, name in enumerate(node.output):
        if name or not formal:
            continue
        param = formal[min(i, len(formal) - 1)]
        if param.option != onnx.defs.OpSchema.FormalParameterOption.Optional:
            raise InvalidModelError(f"node {describe(node)} leaves its output {i} ('{param.name}') unnamed, but that "
                                    f"output of {node.op_type} is not optional: give it a name.")


def graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of `graph`, those of its nodes' bodies included, at any depth."""
    for node in graph.node:
        yield node
        yield from nested_nodes(node)


def with_bodies(nodes: Sequence[onnx.NodeProto], ops: Sequence[str]) -> list[int]:
    """Positions of the nodes that have bodies (control flow, or any node with a graph attribute)."""
    return [k for k, (node, op) in enumerate(zip(nodes, ops))
            if op in CONTROL_FLOW_OPS or (node.attribute and _has_bodies(node))]


def nested_nodes(node: onnx.NodeProto) -> Iterable[onnx.NodeProto]:
    """Every node of every body of `node`, at any depth."""
    for a in node.attribute:
        for g in [a.g] if a.HasField("g") else list(a.graphs):
            for n in g.node:
                yield n
                yield from nested_nodes(n)


GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _has_bodies(node: onnx.NodeProto) -> bool:
    for a in node.attribute:  # noqa: SIM110 - a loop: any() over a generator costs more, once per node
        if a.type in GRAPH_ATTRIBUTES:
            return True
    return False


def _check_cast(node: onnx.NodeProto) -> None:
    """Cast's 'to' must name a type: onnx's checker and inference let 0 (UNDEFINED) through, leaving the
    output untyped, and onnxruntime runs it as some cast of its own."""
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    if to is not None and to not in KNOWN_TYPES:
        raise InvalidModelError(
            f"node {describe(node)} casts to type {to}, which is not an ONNX type; set its 'to' attribute to one "
            "(onnx.TensorProto.FLOAT is 1) or re-export the model."
        )


DISPUTED_FLAGS = ("allowzero", "noop_with_empty_axes", "transA", "transB")
"""0/1 attributes whose other values onnx's shape inference and onnxruntime read differently, so the builder
would see one output shape and onnxruntime compute another: inference takes allowzero=2 and
noop_with_empty_axes=2 as 1, onnxruntime as 0; inference truncates transA=2^40 to 0, onnxruntime transposes."""


AXIS_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax", "Concat", "Split", "Gather", "GatherElements",
                      "ScatterElements", "Flatten", "TopK", "ArgMax", "ArgMin", "LayerNormalization", "Compress",
                      "OneHot", "LpNormalization", "Unique"})
"""Ops with an `axis` attribute, which onnxruntime reads in 32 bits for some (Softmax: 2^40 is its axis 0)."""


def _check_int_attributes(node: onnx.NodeProto) -> None:
    """Int attributes onnx's shape inference and onnxruntime read differently: `DISPUTED_FLAGS` other than 0 or
    1, and an axis no tensor can have (past 32 bits: where the rank is known the rules refuse any axis past it,
    but behind a Squeeze of a run-time size it is not, and onnxruntime truncates the axis and reduces over
    another one)."""
    for a in node.attribute:
        if a.name in DISPUTED_FLAGS and a.i not in (0, 1):
            raise InvalidModelError(
                f"node {describe(node)} has {a.name}={a.i}: ONNX defines 0 and 1, and onnx's shape inference and "
                "onnxruntime read other values differently, so they disagree on its output's shape; set it to 0 "
                "or 1."
            )
        if a.name == "axis" and not -MAX_DIM <= a.i <= MAX_DIM:
            raise InvalidModelError(
                f"node {describe(node)} has axis={a.i}, past any tensor's rank (onnxruntime reads it in 32 bits, as "
                f"{((a.i + 2**31) % 2**32) - 2**31}); set it to an axis of its input."
            )


def _check_inference_hazards(node: onnx.NodeProto, op: str | None = None) -> None:
    """What makes onnx's shape inference hang or crash (it visits bodies too): refused before it runs."""
    if op is None:
        op = node.op_type
    if op in ("If", "Loop", "Scan"):
        _check_control_flow(node)
    elif op == "Einsum" and node.domain in ("", "ai.onnx"):
        _check_einsum(node)
    elif op == "Split" and node.domain in ("", "ai.onnx"):
        _check_split(node)


def _check_split(node: onnx.NodeProto) -> None:
    """A Split with more outputs than its `num_outputs` (opset 18+) makes onnx's shape inference (1.23) read past
    the sizes it computed, which aborts the process (onnx/onnx#8255, fixed after 1.23)."""
    parts = next((a.i for a in node.attribute if a.name == "num_outputs"), None)
    if parts is not None and len(node.output) > parts:
        raise InvalidModelError(
            f"node {describe(node)} splits into num_outputs={parts} parts but has {len(node.output)} outputs; make "
            "them agree (trailing outputs may be left out, not added)."
        )


def _check_split_parts(node: onnx.NodeProto) -> None:
    """From opset 18 a Split names its parts, by its `split` input or its `num_outputs` attribute. With neither,
    onnx's and onnxruntime's shape inference refuse it wherever the input's shape is known, so it loads only while
    that shape is unknown, and stops loading once a size is pinned or folded (as the runtime does)."""
    if (len(node.input) < 2 or not node.input[1]) and not any(a.name == "num_outputs" for a in node.attribute):
        raise InvalidModelError(
            f"node {describe(node)} has neither a 'split' input nor a 'num_outputs' attribute, one of which Split "
            f"requires from opset 18; set num_outputs={len(node.output)} for equal parts, or give the sizes as its "
            "second input."
        )


MAX_DIM = 2**31 - 1
"""The largest dimension onnx's shape inference can take: some of it computes dimensions in 32 bits (Split), so a
larger one wraps, and a negative result aborts the whole process in a later node's inference (Slice's std::clamp
asserts), which no exception handler survives. A negative dimension declared, or a negative Expand shape, aborts
it the same way."""
SHAPE_INPUTS = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Tile": 1, "Resize": 3}
"""The input that gives each op's output dimensions (Tile's multiplies them)."""
SHAPE_FLOOR = {"Reshape": -1}
"""The least value each op's shape input takes (Reshape's -1 is inferred; the others' least is 0)."""
SHAPE_PASSING = frozenset({"Concat", "Unsqueeze", "Squeeze", "Identity", "Cast"})
"""Ops through which constant shape values reach those inputs unchanged."""


def dimension_hazard(graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto] | None = None,
                     ops: Sequence[str] | None = None, bodied: Iterable[int] | None = None) -> str | None:
    """What in `graph` (its bodies included) would give onnx's shape inference a dimension it aborts the process
    on: declared negative or above `MAX_DIM`, or a constant out of range that reaches a shape input; None when
    nothing does. `nodes`, their `ops` and the positions of those with bodies (`bodied`), when the caller has read
    them already (a protobuf field read costs about a microsecond)."""
    for kind, vis in (("graph input", graph.input), ("graph output", graph.output), ("value_info", graph.value_info)):
        for vi in vis:
            for d in vi.type.tensor_type.shape.dim:
                if d.dim_value > MAX_DIM or d.dim_value < 0:
                    return f"{kind} '{vi.name}' is declared with a dimension of {d.dim_value} ({_bounds(0)})"
    nodes = list(graph.node) if nodes is None else nodes
    ops = [n.op_type for n in nodes] if ops is None else ops
    takers = [k for k, op in enumerate(ops) if op in SHAPE_INPUTS]
    if takers:
        constants: dict[str, TensorProto] = {t.name: t for t in graph.initializer}
        made: dict[str, onnx.NodeProto] = {}
        for node, op in zip(nodes, ops):
            if op in SHAPE_PASSING or op == "Constant":
                for o in node.output:
                    made[o] = node
                if op == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
                    constants[node.output[0]] = node.attribute[0].t
        for k in takers:
            node, op = nodes[k], ops[k]
            i, floor = SHAPE_INPUTS[op], SHAPE_FLOOR.get(op, 0)
            if node.domain in ("", "ai.onnx") and i < len(node.input) and node.input[i]:
                found = _value_range(node.input[i], constants, made, set())
                bad = found and next((v for v in found if v > MAX_DIM or v < floor), None)
                if bad is not None:
                    return (f"node {describe(node)} takes its output's shape from a constant holding {bad} "
                            f"({_bounds(floor)})")
    if bodied is None:
        bodied = with_bodies(nodes, ops)
    for k in bodied:
        for a in nodes[k].attribute:
            for body in [a.g] if a.HasField("g") else list(a.graphs):
                found_in_body = dimension_hazard(body)
                if found_in_body is not None:
                    return f"{found_in_body}, in a body of node {describe(nodes[k])}"
    return None


def _bounds(floor: int) -> str:
    return f"dimensions run from {floor} to {MAX_DIM} there, the most onnx's shape inference computes without wrapping"


def _value_range(name: str, constants: dict[str, TensorProto], made: dict[str, onnx.NodeProto],
                 seen: set[str]) -> tuple[int, int] | None:
    """The least and largest of the integer constants `name` is made of through `SHAPE_PASSING` ops."""
    if name in seen:
        return None
    seen.add(name)
    t = constants.get(name)
    if t is not None:
        if t.data_type not in (TensorProto.INT32, TensorProto.INT64) or math.prod(t.dims) > DATA_PROP_MAX_LENGTH:
            return None
        try:
            values = onnx.numpy_helper.to_array(t)
        except Exception:  # damaged bytes: the tensor checks name them
            return None
        return (int(values.min()), int(values.max())) if values.size else None
    node = made.get(name)
    if node is None or node.op_type not in SHAPE_PASSING or node.domain not in ("", "ai.onnx"):
        return None
    inputs = node.input if node.op_type == "Concat" else node.input[:1]
    found = [r for x in inputs if x and (r := _value_range(x, constants, made, seen)) is not None]
    return (min(r[0] for r in found), max(r[1] for r in found)) if found else None


def infer_shapes_safely(model: onnx.ModelProto) -> onnx.GraphProto | None:
    """onnx's (lenient) shape inference without its hazards: None when the model has one or inference fails.

    For graphs that are not validated as a ForwardGraph is (a training graph in split): no hang on a malformed
    Einsum, no crash on a Loop body without inputs or a dimension out of range (`dimension_hazard`), no refusal
    above 2 GB, no data propagation over long vectors.
    """
    try:
        nodes = list(model.graph.node)
        ops = [n.op_type for n in nodes]
        bodied = with_bodies(nodes, ops)
        for node, op in zip(nodes, ops):
            _check_inference_hazards(node, op)
        for k in bodied:
            for n in nested_nodes(nodes[k]):
                _check_inference_hazards(n)
        if dimension_hazard(model.graph, nodes, ops, bodied) is not None:
            return None
        return infer_shapes(without_weights(model)).graph
    except Exception:
        return None


def _without_bodies(node: onnx.NodeProto) -> onnx.NodeProto:
    if not _has_bodies(node):
        return node
    probe = onnx.NodeProto()
    _copy_fields(node, probe, frozenset({"attribute"}))
    for a in node.attribute:
        b = probe.attribute.add()
        _copy_fields(a, b, frozenset({"g", "graphs"}))
        if a.HasField("g"):
            b.g.name = a.g.name or "body"
        for g in a.graphs:
            b.graphs.add(name=g.name or "body")
    return probe


def _check_control_flow(node: onnx.NodeProto) -> None:
    """Body signatures of If/Loop/Scan: onnx's shape inference crashes (C++ vector::reserve) on a Loop whose
    body has fewer than two inputs, and the checker cannot look at bodies that read outer names."""
    if node.domain not in ("", "ai.onnx"):
        return
    bodies = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    n_in, n_out = len(node.input), len(node.output)
    if node.op_type == "If":
        want = {"then_branch": (0, n_out), "else_branch": (0, n_out)}
    elif node.op_type == "Loop":
        want = {"body": (2 + max(n_in - 2, 0), 1 + n_out)}
    elif node.op_type == "Scan":
        want = {"body": (n_in, n_out)}
    else:
        return
    for attr, (ins, outs) in want.items():
        g = bodies.get(attr)
        if g is None:
            raise InvalidModelError(f"node {describe(node)} has no '{attr}' graph; fix the node or re-export it.")
        if len(g.input) != ins or len(g.output) != outs:
            raise InvalidModelError(
                f"node {describe(node)}: its '{attr}' graph has {len(g.input)} inputs and {len(g.output)} outputs, "
                f"but a {node.op_type} with {n_in} inputs and {n_out} outputs needs {ins} and {outs}; fix the node "
                "or re-export the model."
            )


_EINSUM_TERM = r"\s*(?:[A-Za-z]\s*)*(?:\.\.\.\s*)?(?:[A-Za-z]\s*)*"
_EINSUM = re.compile(rf"{_EINSUM_TERM}(?:,{_EINSUM_TERM})*(?:->{_EINSUM_TERM})?")


def _check_einsum(node: onnx.NodeProto) -> None:
    """onnx's Einsum shape inference loops forever on some malformed equations ('..i', 'aß'): check them first."""
    eq = next((a.s.decode("utf-8", "replace") for a in node.attribute if a.name == "equation"), "")
    terms = eq.split("->", 1)[0].split(",")
    if _EINSUM.fullmatch(eq) is None or len(terms) != len(node.input):
        raise InvalidModelError(
            f"node {describe(node)} has a malformed Einsum equation {eq!r} for {len(node.input)} inputs: it must be "
            "one term of letters (and at most one '...') per input, separated by commas, optionally followed by "
            "'->' and the output term. Fix the equation or re-export the model."
        )


def fixed_nbytes(t: TensorProto) -> int | None:
    """Bytes of the data of a tensor of a fixed-size type, from its type and shape; None for other types."""
    itemsize = FIXED_SIZE_TYPES.get(t.data_type)
    if itemsize is None:
        return None
    return itemsize * math.prod(t.dims)


def tensor_nbytes(t: TensorProto) -> int:
    """About t.ByteSize(), without encoding the data: upb encodes a message to measure it, which takes seconds
    for big tensors and fails above 2 GB."""
    return _nbytes(t, fixed_nbytes(t), t.HasField("raw_data"))


def _nbytes(t: TensorProto, fixed: int | None, raw: bool) -> int:
    if fixed is None or not raw:
        return t.ByteSize()
    return fixed + len(t.name.encode()) + 11 * len(t.dims) + 32


TENSOR_CHECK_LIMIT = 16 * 2**20
"""Tensors up to this size go through onnx.checker.check_tensor (which copies them); bigger ones get a size check."""


def _check_tensor(t: TensorProto, what: str) -> int:
    """A tensor whose bytes do not match its type and shape would make a rule or the runtime fail obscurely."""
    fix = "the model is damaged; re-export it"
    data_type, dims = t.data_type, t.dims  # each protobuf field read once
    if data_type not in KNOWN_TYPES:
        raise InvalidModelError(f"{what} has element type {type_name(data_type)}; {fix}.")
    if dims and min(dims) < 0:
        raise InvalidModelError(f"{what} has a negative dimension {list(dims)}; {fix}.")
    if dims and max(dims) > MAX_DIM:  # even with no element (a 0 beside it), numpy cannot make the array
        raise InvalidModelError(f"{what} has a dimension above {MAX_DIM} ({list(dims)}); {fix}.")
    if t.data_location == TensorProto.EXTERNAL:
        where = next((e.value for e in t.external_data if e.key == "location"), "?")
        raise InvalidModelError(
            f"{what} still refers to external data ('{where}') that was not loaded; pass the model's path, or "
            "load it with onnx.load(path) (load_external_data=True), so its weights come along."
        )
    itemsize = FIXED_SIZE_TYPES.get(data_type)
    want = None if itemsize is None else itemsize * math.prod(dims)  # fixed_nbytes(t)
    raw = t.HasField("raw_data")
    size = want + len(t.name.encode()) + 11 * len(dims) + 32 if want is not None and raw else t.ByteSize()
    if size > TENSOR_CHECK_LIMIT:
        return size  # a weight: its bytes are checked when read from external data, by the runtime when inline
    if raw and want and len(t.raw_data) == want and not (
            t.float_data or t.int32_data or t.string_data or t.int64_data or t.double_data or t.uint64_data):
        return size  # what onnx.checker.check_tensor accepts: raw_data alone, as many bytes as type and shape take
    try:
        onnx.checker.C.check_tensor(t.SerializeToString(), onnx.checker.DEFAULT_CONTEXT)
    except Exception as e:  # ValidationError, or whatever else a broken tensor makes the checker raise
        raise InvalidModelError(f"{what} is not a valid tensor: {_first_line(e)}; {fix}.") from None
    if not raw:  # values in a typed field (int64_data, ...): the checker takes any count, a rule reading them not
        try:
            onnx.numpy_helper.to_array(t)
        except Exception as e:  # numpy's reshape (a count off), or whatever else the values make numpy raise
            field = next((f for f in _TYPED_FIELDS if len(getattr(t, f))), None)
            held = f"{len(getattr(t, field)):,} values in {field}" if field else "no values"
            raise InvalidModelError(f"{what} holds {held}, which do not fit its type {type_name(data_type)} and "
                                    f"shape {list(dims)} ({_first_line(e)}); {fix}.") from None
    if raw and want is not None:
        have = len(t.raw_data)
        if want != have:
            raise InvalidModelError(
                f"{what} holds {have:,} bytes, but its type {type_name(t.data_type)} and shape {list(t.dims)} take "
                f"{want:,}; {fix}."
            )
    return size


_TYPED_FIELDS = ("float_data", "double_data", "int32_data", "int64_data", "uint64_data", "string_data")
"""Where a tensor without raw_data keeps its values."""


FIXED_SIZE_TYPES = {
    dt: onnx.helper.tensor_dtype_to_np_dtype(dt).itemsize
    for dt in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT8,
               TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.UINT8, TensorProto.UINT16,
               TensorProto.UINT32, TensorProto.UINT64, TensorProto.BOOL, TensorProto.COMPLEX64,
               TensorProto.COMPLEX128)
}


def find_cycle(nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes of one cycle in the producer -> consumer relation, in order; [] when there is none."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    deps = [sorted({producer[x] for x in [*n.input, *subgraph_free_names(n)] if x in producer}) for n in nodes]
    state = [0] * len(nodes)  # 0 new, 1 on the current path, 2 done
    for start in range(len(nodes)):
        if state[start]:
            continue
        path, stack = [], [(start, iter(deps[start]))]
        state[start] = 1
        path.append(start)
        while stack:
            k, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[k] = 2
            elif state[nxt] == 1:
                cycle = path[path.index(nxt):]
                return [nodes[j] for j in reversed(cycle)]
            elif state[nxt] == 0:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(deps[nxt])))
    return []


def _repeated(fd: object) -> bool:
    rep = getattr(fd, "is_repeated", None)
    return bool(rep) if rep is not None else fd.label == fd.LABEL_REPEATED  # type: ignore[attr-defined]


def _copy_fields(src: Message, dst: Message, skip: frozenset[str] = frozenset()) -> None:
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if _repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.message_type is not None:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


WEIGHT_BYTES = 2**20
"""Initializers at least this big are weights, not shape constants: inference does not need their values."""


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` in which big initializers are graph inputs of the same type and shape.

    Shape inference serializes the model, which protobuf refuses above 2 GB, and copying the weights
    only to learn their (already declared) shapes is waste; small constants keep their values for data
    propagation (Reshape shapes, Slice starts).
    """
    out = onnx.ModelProto()
    _copy_fields(model, out, frozenset({"graph"}))
    g = model.graph
    _copy_fields(g, out.graph, frozenset({"initializer", "input"}))
    inputs = {vi.name for vi in g.input}
    out.graph.input.extend(g.input)
    for t in g.initializer:
        if tensor_nbytes(t) < WEIGHT_BYTES:
            out.graph.initializer.append(t)
        elif t.name not in inputs:
            out.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return out


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its model-local functions (onnxscript's, some exporters') expanded where they are called, or
    `model` itself when it has none: rules differentiate the ops of their bodies, and the halves of a split, which
    hold no function definitions, run. Big weights do not go through the inliner (it serializes the model)."""
    if not model.functions:
        return model
    inlined = _inlined(without_weights(model), convert=False)
    if _local_call(inlined) is not None:  # bodies at another opset than the model's: converted, which needs the
        typed = infer_shapes_safely(inlined)  # types of the calls' inputs
        if typed is not None:
            inlined.graph.CopyFrom(typed)
            inlined = _inlined(inlined, convert=True)
    left = _local_call(inlined)
    if left is not None:
        raise InvalidModelError(f"node {describe(left)} calls the model-local function {left.domain}.{left.op_type}, "
                                "which onnx's inliner left in place (its opsets cannot be converted to the model's). "
                                f"{INLINE_TODO}.")
    out = onnx.ModelProto()
    _copy_fields(inlined, out, frozenset({"graph"}))
    _copy_fields(inlined.graph, out.graph, frozenset({"initializer", "input"}))
    out.graph.input.extend(model.graph.input)  # without_weights' stand-ins for the weights go again
    out.graph.initializer.extend(model.graph.initializer)
    return out


INLINE_TODO = "Fix them, or inline them yourself (onnx.inliner.inline_local_functions)"


def _inlined(model: onnx.ModelProto, convert: bool) -> onnx.ModelProto:
    try:
        return onnx.inliner.inline_local_functions(model, convert_version=convert)
    except Exception as e:  # whatever a malformed function (or one inference could not type) makes the inliner raise
        names = ", ".join(f"{f.domain}.{f.name}" for f in model.functions)
        raise InvalidModelError(f"the model's local functions ({names}) cannot be inlined: {_first_line(e)}. "
                                f"{INLINE_TODO}.") from None


def _local_call(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """A node, at any depth, that calls one of the model's local functions."""
    local = {(f.domain, f.name) for f in model.functions}
    return next((n for n in graph_nodes(model.graph) if (n.domain, n.op_type) in local), None) if local else None


DATA_PROP_MAX_LENGTH = 2**16


def _computed_slices(graph: onnx.GraphProto) -> bool:
    """Whether a Slice's starts, ends, axes or steps are computed by nodes other than Constants."""
    constant = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    return any(n.op_type == "Slice" and not n.domain and any(i and i not in constant for i in n.input[1:])
               for n in graph.node)


def _cheap_data_propagation(graph: onnx.GraphProto) -> bool:
    """onnx's data propagation treats every 1-D tensor as a candidate shape and spends time and memory per
    element (10 s and 2 GB for one Mul of two 10M-element vectors): worth it only when all 1-D tensors are short."""
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        shape = vi.type.tensor_type.shape if vi.type.HasField("tensor_type") else None
        if shape is not None and len(shape.dim) == 1 and shape.dim[0].dim_value > DATA_PROP_MAX_LENGTH:
            return False
    return all(len(t.dims) != 1 or t.dims[0] <= DATA_PROP_MAX_LENGTH for t in graph.initializer)


DATA_FROM_INPUTS = frozenset({"Add", "Sub", "Mul", "Cast", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze"})
"""Default-domain ops whose data propagation (onnx shape inference with data_prop) only passes on values it
reads from its inputs; Shape and Size make values from their input's type."""

SHAPE_DATA_TYPES = (TensorProto.INT32, TensorProto.INT64)


@functools.lru_cache(maxsize=4096)
def _propagates_data(op_type: str, version: int, domain: str) -> bool:
    try:
        return bool(onnx.defs.get_schema(op_type, version, domain).has_data_propagation_function)
    except Exception:
        return True  # unsure: as if it did


def _data_propagation_matters(model: onnx.ModelProto, bodies: bool | None = None,
                              known: tuple[list[str], list[str]] | None = None) -> bool:
    """Whether onnx's shape inference with data_prop=True can differ from the pass without it.

    Data propagation only ever starts from the values of int32/int64 scalars and vectors (initializers and
    Constant outputs) or from Shape/Size; when no node with a data propagation function reads one, it stores
    nothing and the two passes are the same. Conservative: bodies and model-local functions count as yes
    (`bodies`: whether any node may have one, when known; `known`: the op_type and domain of every node, when
    already read).
    """
    g = model.graph
    if model.functions or bodies:
        return True
    opsets: dict[str, set[int]] = {}
    for op in model.opset_import:
        opsets.setdefault("" if op.domain == "ai.onnx" else op.domain, set()).add(op.version)
    data = {t.name for t in g.initializer if t.data_type in SHAPE_DATA_TYPES and len(t.dims) <= 1}
    nodes = list(g.node)
    op_types, domains = known if known is not None else ([n.op_type for n in nodes], [n.domain for n in nodes])
    data.update(o for n, op in zip(nodes, op_types) if op == "Constant" for o in n.output)
    propagates: dict[tuple[str, str], bool] = {}
    for n, op, domain in zip(nodes, op_types, domains):
        if bodies is None and _has_bodies(n):
            return True
        found = propagates.get((op, domain))
        if found is None:
            dom = "" if domain == "ai.onnx" else domain
            # (a domain the model does not import: onnx's shape inference skips the node)
            found = propagates[op, domain] = any(_propagates_data(op, v, dom) for v in opsets.get(dom, ()))
        if found and (domain not in ("", "ai.onnx") or op not in DATA_FROM_INPUTS or not data.isdisjoint(n.input)):
            return True
    return False


def _for_inference(model: onnx.ModelProto, largest: int, known: tuple[list[str], list[str]] | None = None
                   ) -> tuple[onnx.ModelProto, bool]:
    """without_unknown_ops(without_weights(model)), or `model` itself when neither would change anything
    (shape inference reads it without modifying it): no copy of every node for the common case. `largest`:
    the largest tensor_nbytes of the initializers; `known`: the op_type and domain of every node, when read."""
    local = {(f.domain, f.name) for f in model.functions}
    ops, doms = known if known is not None else ([n.op_type for n in model.graph.node],
                                                 [n.domain for n in model.graph.node])
    if largest < WEIGHT_BYTES and all(
            _onnx_has(op, dom) or (dom, op) in local for op, dom in zip(ops, doms)):
        return model, False
    return without_unknown_ops(without_weights(model))


def without_unknown_ops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """The model with every node ONNX has no schema for (custom ops) cut out, its outputs made graph inputs of
    their declared type; and whether any output was left untyped.

    onnx's strict shape inference reports no error at all once a graph holds one op it does not know, so a
    Conv on a vector behind a custom op would reach the Conv rule; without them, conflicts are reported.
    """
    local = {(f.domain, f.name) for f in model.functions}
    g = model.graph
    known = [_onnx_has(n.op_type, n.domain) or (n.domain, n.op_type) in local for n in g.node]
    if all(known):
        return model, False
    unknown = [n for n, k in zip(g.node, known) if not k]
    kept = [n for n, k in zip(g.node, known) if k]
    declared = {vi.name: vi for vi in [*g.value_info, *g.output]}
    del g.node[:]
    g.node.extend(kept)
    untyped = False
    for n in unknown:
        for o in n.output:
            if o:
                vi = declared.get(o)
                untyped |= vi is None or not vi.type.tensor_type.elem_type
                g.input.append(vi if vi is not None else onnx.helper.make_empty_tensor_value_info(o))
    return model, untyped


@functools.lru_cache(maxsize=4096)
def _onnx_has(op_type: str, domain: str) -> bool:
    return onnx.defs.has(op_type, domain)


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
        taken = self._taken
        if base not in taken:
            taken.add(base)
            return base
        k = self._next.get(base, 1)
        name = f"{base}_{k}"
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        self._next[base] = k + 1
        taken.add(name)
        return name


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()
"""Read once at import: mkstemp creates 0600 files, and a saved model should get the mode of any new file."""


PROTOBUF_LIMIT = 2**31 - 1
INLINE_LIMIT = PROTOBUF_LIMIT - 2**20
"""Protobuf cannot serialize a message of 2 GB; above this the weights go to a data file beside the model."""
EXTERNAL_MIN_BYTES = 1024
DATA_ALIGN = 4096
"""Offsets of weights in a data file are page-aligned, so a runtime may map them."""


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write next to the target and rename, so a crash never leaves a half-written model.

    Above 2 GB the weights go to `<name>.data` (or `<name>.1.data`, ... when that name is taken): a file
    that did not exist, written and synced before the .onnx naming it is renamed into place. So at every
    instant `path` names a complete, matching pair, no existing file is overwritten but `path`, and the data
    file the replaced model read is removed only after. The caller's model is never modified.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old_data = _own_data_files(path)
    data_path: Path | None = None
    tmp: str | None = None
    try:
        if _serialized_size(model) > INLINE_LIMIT:
            data_path, f = _new_data_file(path)
            with f:
                out = _externalize(model, data_path.name, f)
                f.flush()
                os.fsync(f.fileno())
            if _serialized_size(out) > PROTOBUF_LIMIT:
                raise SaveError(f"cannot write {path}: the model is over 2 GB even with every initializer of "
                                f"{EXTERNAL_MIN_BYTES} bytes or more in a data file (large constants in nodes?).")
            payload = out.SerializeToString()
        else:
            payload = model.SerializeToString()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if data_path is not None:
            data_path.unlink(missing_ok=True)
        raise
    for name in old_data:
        if data_path is None or name != data_path.name:
            (path.parent / name).unlink(missing_ok=True)


def _serialized_size(model: onnx.ModelProto) -> int:
    """About model.ByteSize(), measuring the graph without its initializers and those from their shapes."""
    rest = onnx.ModelProto()
    _copy_fields(model, rest, frozenset({"graph"}))
    _copy_fields(model.graph, rest.graph, frozenset({"initializer"}))
    try:
        n = rest.ByteSize()
    except Exception:  # EncodeError: even the graph without its weights is over 2 GB
        return PROTOBUF_LIMIT + 1
    return n + sum(tensor_nbytes(t) for t in model.graph.initializer)


def _data_names(path: Path) -> Iterable[str]:
    yield f"{path.name}.data"
    k = 1
    while True:
        yield f"{path.name}.{k}.data"
        k += 1


def _is_data_name(path: Path, name: str) -> bool:
    return re.fullmatch(re.escape(path.name) + r"(\.[0-9]+)?\.data", name) is not None


STUB_LIMIT = 64 * 2**20
"""A model we saved with its weights outside is small; a bigger file at the target is not worth parsing."""


def _own_data_files(path: Path) -> set[str]:
    """The data files the model now at `path` reads that bear our names for it: removed once it is replaced.

    Only tidiness depends on this: a new data file never takes an existing name.
    """
    try:
        if not path.is_file() or path.stat().st_size > STUB_LIMIT:
            return set()
        old = onnx.load(str(path), load_external_data=False)
    except Exception:  # unreadable or not a model: it names no data file
        return set()
    return {e.value for t in old.graph.initializer if t.data_location == TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location" and _is_data_name(path, e.value)}


def _new_data_file(path: Path) -> tuple[Path, io.BufferedWriter]:
    """Create the first free data file name for `path` exclusively: never clobber what another model reads."""
    for name in _data_names(path):
        candidate = path.parent / name
        try:
            fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return candidate, os.fdopen(fd, "wb")
    raise AssertionError("unreachable")


def _externalize(model: onnx.ModelProto, location: str, f: io.BufferedWriter) -> onnx.ModelProto:
    """A copy of `model` whose big initializers point into `f`, written as we go; `model` is left as it is."""
    out = onnx.ModelProto()
    _copy_fields(model, out, frozenset({"graph"}))
    _copy_fields(model.graph, out.graph, frozenset({"initializer"}))
    offset = 0
    for t in model.graph.initializer:
        if not t.HasField("raw_data") or tensor_nbytes(t) < EXTERNAL_MIN_BYTES:
            out.graph.initializer.append(t)
            continue
        raw = t.raw_data
        pad = -offset % DATA_ALIGN
        f.write(b"\0" * pad)
        f.write(raw)
        stub = out.graph.initializer.add()
        _copy_fields(t, stub, frozenset({"raw_data"}))
        stub.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset + pad)), ("length", str(len(raw)))):
            stub.external_data.add(key=key, value=value)
        offset += pad + len(raw)
    return out


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
