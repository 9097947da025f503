"""Attributes replaced for the duration of an export (`dropouts`, `losses`, `functions`), then put back; and the
legacy tracer paused for reads that must not enter the trace."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MISSING = object()


@contextlib.contextmanager
def replaced(replacements: Iterable[tuple[Any, str, Any]], captured: bool = False) -> Iterator[None]:
    """Each (owner, name, value) set while the body runs; afterwards the owner's own attribute is restored, or
    deleted where it had none (torch._VF finds its functions through `__getattr__`). `captured`: torch functions
    replaced so are replaced too where the module calls them through a reference it took before (`Captured`)."""
    replacements = list(replacements)
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replacements]
    redirect = {getattr(owner, name): value for owner, name, value in replacements
                if captured and callable(value) and callable(getattr(owner, name, None))}
    for owner, name, value in replacements:
        setattr(owner, name, _Running.wrap(value) if redirect else value)
    try:
        with Captured(redirect) if redirect else contextlib.nullcontext():
            yield
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


class _Running:
    """How many replacements are running: a replacement calling the function it replaces calls torch's."""

    depth = 0

    @classmethod
    def wrap(cls, fn: Any) -> Any:
        if not callable(fn) or isinstance(fn, type):
            return fn

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            cls.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                cls.depth -= 1

        return run


class Captured(TorchFunctionMode):
    """Calls of replaced torch functions through references taken before the replacement, which the replaced
    attributes miss (`from torch.nn.functional import scaled_dot_product_attention` at import, `self.act =
    torch.sinc`): such a call ran torch's own conversion, a fully masked attention row's NaN gradient refused by
    the first call's check, a float64 sinc exported by dynamo with a float32 pi. Sent to the replacement, except
    from within a replacement (which calls torch's function on purpose)."""

    def __init__(self, redirect: dict[Any, Any]):
        super().__init__()
        self.redirect = redirect

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        target = self.redirect.get(func) if not _Running.depth else None
        return (target or func)(*args, **(kwargs or {}))


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
