"""Attributes replaced for the duration of an export (`dropouts`, `losses`, `functions`), then put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

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
