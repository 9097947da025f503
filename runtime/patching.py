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


PYTHON_ARITHMETIC = frozenset(f"aten::{op}" for op in (
    "add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "pow", "neg", "abs", "reciprocal", "eq", "ne",
    "lt", "le", "gt", "ge", "__and__", "__or__", "__xor__", "bitwise_not", "__lshift__", "__rshift__"))
"""What Python's operators on a traced size record (`n / 2`: aten::div, `2 / n`: reciprocal then mul). A tensor
made of a size (`torch.tensor(n)`: aten::to, `torch.arange(n)`, `torch.scalar_tensor(n)`) records other ops."""


def traced_number(t: torch.Tensor) -> bool:
    """Whether the legacy exporter's trace made `t` of a Python number: sizes (`x.shape[0]`, which tracing returns
    as a tensor) and what Python's arithmetic on them and constants computes (`PYTHON_ARITHMETIC`). Stops at the
    first input that is neither: a tensor made of a size (`torch.tensor(x.shape[0])`) is a tensor in torch's call
    too (it came back as a Python number, and `torch.arange(n)` failed)."""
    try:
        stack = [torch._C._get_value_trace(t).node()]
    except RuntimeError:  # not traced
        return False
    while stack:
        node = stack.pop()
        if node.kind() == "prim::NumToTensor":
            continue
        computed = [i.node() for i in node.inputs() if i.node().kind() != "prim::Constant"]
        if node.kind() not in PYTHON_ARITHMETIC or not computed:
            return False
        stack += computed
    return True
