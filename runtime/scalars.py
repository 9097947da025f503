"""The Python numbers and strings a module's forward reads from its modules' attributes.

An export turns `self.tau` (a float the forward divides by) into a constant of the graph. A training loop that
anneals it (`model.tau = 0.1` after an epoch) then kept training with the exported value, and nothing said so:
torch's eager forward reads the attribute at every call, the graph never does. The export records which such
attributes the forward read (a `__getattribute__` on nn.Module for the duration of one eager run of it), and
`Scalars.changed` compares them at every call: a changed one makes the engine export again.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

TRACKED = (bool, int, float, str, type(None), np.bool_, np.int32, np.int64, np.float32, np.float64)
"""The attribute types a forward turns into constants of the graph (tensors are inputs; modules and containers
are structure): Python's numbers, strings and None, and numpy's scalars (a schedule from np.linspace)."""


SETTINGS_FIELDS = 512
"""The most fields of a settings object compared at each call (a Hugging Face config has 100-200; a vocabulary
held in a dict is no setting)."""


def _tracked(value: Any) -> bool:
    return type(value) in TRACKED or isinstance(value, enum.Enum)


def _settings(value: Any) -> dict[Any, Any] | list[Any] | None:
    """The fields of a settings object a module holds (a dict, a list, a dataclass, a SimpleNamespace, a Hugging
    Face config: `self.cfg.tau`, `self.scales[0]`), whose tracked values the forward may read; None for anything
    else (modules, tensors, functions, classes)."""
    if isinstance(value, dict | list):
        fields = value
    elif isinstance(value, nn.Module | torch.Tensor | type | enum.Enum) or callable(value) or \
            not hasattr(value, "__dict__"):
        return None
    else:
        fields = vars(value)
    return fields if len(fields) <= SETTINGS_FIELDS else None


@dataclass(frozen=True)
class _Seen:
    """A plain tensor attribute (not a buffer) the forward read, which the graph holds as a constant: by identity
    and version counter (rebound, or changed in place)."""

    tensor: torch.Tensor
    version: int


_MISSING = object()


def _read(container: dict[Any, Any] | list[Any], key: Any) -> Any:
    if isinstance(container, dict):
        return container.get(key, _MISSING)
    return container[key] if key < len(container) else _MISSING


@contextlib.contextmanager
def reads() -> Iterator[set[tuple[nn.Module, str]]]:
    """Records (module, attribute) for every instance attribute of a TRACKED type, or settings object
    (`_settings`), read on any nn.Module while the context lasts (`training` aside: the engine keys calls by it),
    leaving out those the forward assigns (a call counter: the graph never changes it again, so it would look
    changed after every export). For one eager run under the export lock."""
    found: set[tuple[nn.Module, str]] = set()
    written: set[tuple[int, str]] = set()
    setattr_ = nn.Module.__setattr__

    def getattribute(self: nn.Module, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if ((_tracked(value) and not name.startswith("__")) or  # nn.Module's own dicts are not settings
                (not name.startswith("_") and (isinstance(value, torch.Tensor) or _settings(value) is not None))) \
                and name != "training" and name in object.__getattribute__(self, "__dict__"):
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

    held: tuple[tuple[Any, Any, Any], ...]
    """(the module's __dict__, the attribute's name, its value or `_Seen` tensor), or a settings object's fields
    (dict or list), a field's name or index and its value."""
    names: tuple[str, ...]
    """Qualified names, for messages."""

    @classmethod
    def of(cls, found: set[tuple[nn.Module, str]], module: nn.Module) -> Scalars:
        """A settings object read is held by its TRACKED fields (which of them the forward read is not known)."""
        paths = {id(m): p for p, m in module.named_modules(remove_duplicate=False)}
        ordered = sorted((paths.get(id(m), "?"), name, m) for m, name in found if id(m) in paths)
        held: list[tuple[Any, Any, Any]] = []
        names: list[str] = []
        seen: set[tuple[int, Any]] = set()  # a config that every layer holds: its fields once
        for path, name, m in ordered:
            qualified = f"{path}.{name}" if path else name
            value = m.__dict__.get(name)
            fields = None if _tracked(value) or isinstance(value, torch.Tensor) else _settings(value)
            if fields is None:
                held.append((m.__dict__, name, _Seen(value, value._version) if isinstance(value, torch.Tensor)
                             else value))
                names.append(qualified)
                continue
            for field, v in (fields.items() if isinstance(fields, dict) else enumerate(fields)):
                if _tracked(v) and (id(fields), field) not in seen:
                    seen.add((id(fields), field))
                    held.append((fields, field, v))
                    names.append(f"{qualified}.{field}" if isinstance(fields, dict) and isinstance(field, str)
                                 and fields is not value else f"{qualified}[{field!r}]")
        return cls(tuple(held), tuple(names))

    def changed(self) -> str | None:
        """The first attribute whose value is not the export's, with both values, or None."""
        for k, (held, name, value) in enumerate(self.held):
            now = held.get(name, _MISSING) if type(held) is dict else _read(held, name)
            if now is value:
                continue
            if isinstance(value, _Seen):
                if now is not value.tensor:
                    return f"{self.names[k]} (another tensor)"
                if now._version != value.version:
                    return f"{self.names[k]} (changed in place)"
            elif type(now) is not type(value) or now != value:
                return f"{self.names[k]} ({value!r} -> {'(deleted)' if now is _MISSING else repr(now)})"
        return None
