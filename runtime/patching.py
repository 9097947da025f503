"""Attributes replaced for the duration of an export (`dropouts`, `losses`, `functions`), then put back; and the
legacy tracer paused for reads that must not enter the trace."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_MISSING = object()


@contextlib.contextmanager
def replaced(replacements: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each (owner, name, value) set while the body runs; afterwards the owner's own attribute is restored, or
    deleted where it had none (torch._VF finds its functions through `__getattr__`)."""
    replacements = list(replacements)
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """The legacy tracer paused while the body runs: sizes read as numbers (traced sizes compare as tensors, a
    TracerWarning and a value baked in), copies kept out of the graph."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


def untraced_ints(*sizes: Any) -> list[int]:
    """Sizes as Python ints read outside the legacy tracer: only for choices that hold at every size the export
    serves (head counts, a parameter's shape)."""
    with untraced():
        return [int(n) for n in sizes]
