"""Nested Python values <-> a flat list of tensors plus a hashable spec.

Inputs and outputs of a module can be tensors inside tuples, lists, dicts, namedtuples, dataclasses
and Hugging Face `ModelOutput`s (an OrderedDict subclass dataclass). Everything that is not a tensor
is a constant of the export and is kept in the spec, so it is part of the cache key and comes back
unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Leaf:
    """A tensor: position `index` in the flat list."""

    index: int


@dataclass(frozen=True)
class Number(Leaf):
    """A Python number the legacy exporter's trace made a 0-d tensor of (`x.shape[0]`, arithmetic on sizes): given
    back as the `kind` (int, float or bool) eager torch returns."""

    kind: type


@dataclass(frozen=True)
class Const:
    value: Any

    def __hash__(self) -> int:
        return hash(_hashable(self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Const) and type(self.value) is type(other.value) and \
            _hashable(self.value) == _hashable(other.value)


@dataclass(frozen=True)
class Node:
    """A container: its type, keys (dicts and dataclasses) and children specs."""

    kind: type
    keys: tuple[Any, ...] | None
    children: tuple[Spec, ...]

    def __post_init__(self) -> None:
        # specs key the schema cache on every call: hash the tree once, not recursively per lookup
        object.__setattr__(self, "_hash", hash((self.kind, self.keys, self.children)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]


Spec = Leaf | Const | Node


def _hashable(value: Any) -> Any:
    """The value as a cache key: numpy arrays by their contents (keyed by identity, an array changed in place kept
    its export's values, and each fresh array of the same values exported again), other unhashable values by
    identity."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    try:
        hash(value)
        return value
    except TypeError:
        return ("unhashable", type(value).__qualname__, id(value))


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def flatten(value: Any) -> tuple[list[torch.Tensor], Spec]:
    """Tensors of `value` in depth-first order, and the spec to rebuild it."""
    leaves: list[torch.Tensor] = []
    return leaves, _spec(value, leaves)


def _spec(x: Any, leaves: list[torch.Tensor]) -> Spec:
    """`x`'s spec, its tensors appended to `leaves`. A function of its own, not a closure calling itself: that
    closure and its cell made a cycle holding `leaves` until Python's cyclic collector ran, so the outputs of the
    export's torch run, with their autograd graph and its saved activations, outlived the call (and a parameter's
    gradient accumulator with its old sizes: `weight.data = bigger` then failed at the next backward)."""
    if isinstance(x, torch.Tensor):
        leaves.append(x)
        return Leaf(len(leaves) - 1)
    if isinstance(x, Mapping):
        keys = tuple(x.keys())
        return Node(type(x), keys, tuple(_spec(x[k], leaves) for k in keys))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        keys = tuple(f.name for f in dataclasses.fields(x))
        return Node(type(x), keys, tuple(_spec(getattr(x, k), leaves) for k in keys))
    if isinstance(x, (tuple, list)):
        return Node(type(x), None, tuple(_spec(v, leaves) for v in x))
    return Const(x.copy() if isinstance(x, np.ndarray) else x)  # as it is now: a key compares contents


def unflatten(spec: Spec, leaves: Sequence[Any]) -> Any:
    """Rebuild the value `flatten` took apart, with `leaves` in place of its tensors."""
    if isinstance(spec, Leaf):
        value = leaves[spec.index]
        return spec.kind(value) if isinstance(spec, Number) and isinstance(value, torch.Tensor) else value
    if isinstance(spec, Const):
        return spec.value
    items = [unflatten(c, leaves) for c in spec.children]
    kind = spec.kind
    if spec.keys is not None:
        pairs = dict(zip(spec.keys, items))
        if dataclasses.is_dataclass(kind):  # dataclasses, including ModelOutput (an OrderedDict subclass)
            return _dataclass(kind, pairs)
        if kind is dict:
            return pairs
        return kind(pairs)
    if kind is tuple or kind is list:
        return kind(items)
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return kind(*items)
    return kind(items)


def numbers_marked(spec: Spec, numbers: Mapping[int, type]) -> Spec:
    """`spec` with the leaves at these positions `Number`s of these kinds."""
    if isinstance(spec, Leaf):
        return Number(spec.index, numbers[spec.index]) if spec.index in numbers else spec
    if isinstance(spec, Const):
        return spec
    return Node(spec.kind, spec.keys, tuple(numbers_marked(c, numbers) for c in spec.children))


NUMBER_KINDS: tuple[tuple[tuple[type, ...], type, torch.dtype], ...] = (
    ((bool, torch.SymBool), bool, torch.bool), ((int, torch.SymInt), int, torch.int64),
    ((float, torch.SymFloat), float, torch.float64))
"""Python numbers (and torch.export's symbolic ones) by the kind returned and the dtype they travel in."""


def numbers_as_leaves(spec: Spec, leaves: list[torch.Tensor], numbers: dict[int, type] | None = None
                      ) -> tuple[Spec, dict[int, type]]:
    """`spec` with each Python number among its constants a `Number` leaf, its 0-d tensor appended to `leaves`;
    and the kinds by leaf. torch.export traces sizes as symbols: `return y, x.shape[0]` kept the export's
    symbolic int as a constant, and every call returned that expression (`s28`) where torch returns an int. (Not a
    closure calling itself: see `_spec`.)"""
    numbers = {} if numbers is None else numbers
    if isinstance(spec, Node):
        return Node(spec.kind, spec.keys, tuple(numbers_as_leaves(c, leaves, numbers)[0] for c in spec.children)), \
            numbers
    for types, kind, dtype in NUMBER_KINDS if isinstance(spec, Const) else ():
        if isinstance(spec.value, types):
            leaves.append(torch.scalar_tensor(spec.value, dtype=dtype))
            numbers[len(leaves) - 1] = kind
            return Number(len(leaves) - 1, kind), numbers
    return spec, numbers


def _dataclass(kind: type, values: dict[str, Any]) -> Any:
    """An instance with these field values: fields with init=False (computed in __post_init__) set after."""
    later = {f.name for f in dataclasses.fields(kind) if not f.init}
    made = kind(**{k: v for k, v in values.items() if k not in later})
    for k in later:
        object.__setattr__(made, k, values[k])
    return made


def _walk(spec: Spec, path: str = "") -> Iterator[tuple[str, Leaf | Const]]:
    """(readable path, spec) for each tensor and constant, depth first."""
    if isinstance(spec, Node):
        keys = spec.keys if spec.keys is not None else range(len(spec.children))
        if spec.keys is None and _is_namedtuple_type(spec.kind):
            keys = spec.kind._fields  # type: ignore[attr-defined]
        for k, c in zip(keys, spec.children):
            yield from _walk(c, f"{path}.{k}" if path else str(k))
    else:
        yield path, spec


def tensor_paths(spec: Spec, prefix: str = "") -> list[str]:
    """A readable name per leaf (`x`, `inputs.1`, `out.logits`), in leaf order, for ONNX names and messages."""
    names = [(s.index, path) for path, s in _walk(spec, prefix) if isinstance(s, Leaf)]
    return [p for _, p in sorted(names)]


def constants(spec: Spec) -> list[tuple[str, Any]]:
    """(readable path, value) of each non-tensor value of a spec, depth first."""
    return [(path, s.value) for path, s in _walk(spec) if isinstance(s, Const)]


def without_numbers(spec: Spec) -> Spec:
    """The spec with each Python number (int or float, not bool) replaced by its type: calls that only a changed
    number tells apart (flags and strings pick modes; numbers may change at every call)."""
    if isinstance(spec, Const) and isinstance(spec.value, int | float) and not isinstance(spec.value, bool):
        return Const(type(spec.value))
    if isinstance(spec, Node):
        return Node(spec.kind, spec.keys, tuple(without_numbers(c) for c in spec.children))
    return spec


def numbers(spec: Spec) -> dict[str, int | float | str]:
    """The Python numbers among a spec's constants by path (NaN as "nan", so that it equals itself): a forward's
    result holds them as the call that exported computed them (`.item()`), where torch's are each call's."""
    return {path: "nan" if v != v else v for path, v in constants(spec) if isinstance(v, int | float)}


def _is_namedtuple_type(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")
