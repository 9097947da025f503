"""The Python numbers and strings a module's forward reads from its modules' attributes.

An export turns `self.tau` (a float the forward divides by) into a constant of the graph. A training loop that
anneals it (`model.tau = 0.1` after an epoch) then kept training with the exported value, and nothing said so:
torch's eager forward reads the attribute at every call, the graph never does. The export records which such
attributes the forward read (a `__getattribute__` on nn.Module for the duration of one eager run of it), and
`Scalars.changed` compares them at every call: a changed one makes the engine export again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

TRACKED = (bool, int, float, str)
"""The attribute types a forward turns into constants of the graph (tensors are inputs; modules and containers
are structure)."""


@contextlib.contextmanager
def reads() -> Iterator[set[tuple[nn.Module, str]]]:
    """Records (module, attribute) for every instance attribute of a TRACKED type read on any nn.Module while the
    context lasts (`training` aside: the engine keys calls by it), leaving out those the forward assigns (a call
    counter: the graph never changes it again, so it would look changed after every export). For one eager run
    under the export lock."""
    found: set[tuple[nn.Module, str]] = set()
    written: set[tuple[int, str]] = set()
    setattr_ = nn.Module.__setattr__

    def getattribute(self: nn.Module, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if type(value) in TRACKED and name != "training" and not name.startswith("__") and \
                name in object.__getattribute__(self, "__dict__"):
            found.add((self, name))
        return value

    def assign(self: nn.Module, name: str, value: Any) -> None:
        written.add((id(self), name))
        setattr_(self, name, value)

    nn.Module.__getattribute__ = getattribute  # type: ignore[method-assign]
    nn.Module.__setattr__ = assign  # type: ignore[method-assign]
    kept: set[tuple[nn.Module, str]] = set()
    try:
        yield kept
    finally:
        del nn.Module.__getattribute__
        nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
        kept.update(pair for pair in found if (id(pair[0]), pair[1]) not in written)


@dataclass(frozen=True)
class Scalars:
    """The attributes an export read, with their values when it ended (a forward that changes one, a step
    counter, changed it while exporting; the graph keeps whatever it read)."""

    held: tuple[tuple[dict[str, Any], str, Any], ...]
    """(the module's __dict__, the attribute's name, its value)."""
    names: tuple[str, ...]
    """Qualified names, for messages."""

    @classmethod
    def of(cls, found: set[tuple[nn.Module, str]], module: nn.Module) -> Scalars:
        paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
        ordered = sorted((paths.get(id(m), "?"), name, m) for m, name in found if id(m) in paths)
        return cls(tuple((m.__dict__, name, m.__dict__.get(name)) for _, name, m in ordered),
                   tuple(f"{p}.{name}" if p else name for p, name, _ in ordered))

    def changed(self) -> str | None:
        """The first attribute whose value is not the export's, with both values, or None."""
        for k, (held, name, value) in enumerate(self.held):
            now = held.get(name)
            if now is not value and (now != value or type(now) is not type(value)):
                return f"{self.names[k]} ({value!r} -> {now!r})"
        return None
