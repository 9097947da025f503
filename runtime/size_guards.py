"""The input sizes a dynamo export holds for.

torch.export traces with symbolic sizes and records what the graph assumes of them: a range per symbol (a branch on
`x.shape[1] > 8` leaves [9, oo]), one symbol for sizes it found equal (`x + y` makes the two batches one symbol),
and runtime asserts for the rest (`x.shape[0] % 3 == 0`). torch.onnx keeps only the symbols in the ONNX graph's
declarations (its `_guards_code` is empty, the asserts' nodes dangle), so a call outside those assumptions ran
the traced branch silently. These guards are read off the ExportedProgram once and checked once per new input
shapes (`Engine`); a call they refuse is exported anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SizeGuards:
    dims: tuple[tuple[Any, ...], ...]
    """Per input leaf, per axis: an int, or the sympy expression torch.export traced that size as."""
    ranges: tuple[tuple[Any, int, int | None], ...]
    """(symbol, lowest, highest or None for unbounded) of each symbol bounded beyond [0, oo]."""
    asserts: tuple[Any, ...]
    """sympy relations between input symbols that must hold."""

    @classmethod
    def of(cls, program: Any, leaves: int) -> SizeGuards | None:
        """The guards of a `torch.export.ExportedProgram` whose user inputs are the `leaves` input tensors, in
        order; None where its inputs are not those (the engine then exports other sizes again and compares)."""
        from torch.utils._sympy.numbers import int_oo

        users = set(program.graph_signature.user_inputs)
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in users]
        dims = []
        env = None
        for node in placeholders:
            val = node.meta.get("val")
            shape = val.shape if isinstance(val, torch.Tensor) else ()
            dims.append(tuple(d.node.expr if isinstance(d, torch.SymInt) else int(d) for d in shape))
            env = env or getattr(getattr(val, "fake_mode", None), "shape_env", None)
        if len(dims) != leaves:
            return None
        ranges = []
        for symbol, r in program.range_constraints.items():
            low = int(r.lower) if r.lower != -int_oo else 0
            high = None if r.upper == int_oo else int(r.upper)
            if low > 0 or high is not None:
                ranges.append((symbol, low, high))
        bound = {s for axes in dims for d in axes if not isinstance(d, int) for s in d.free_symbols}
        asserts = [] if env is None else [
            ra.expr for found in getattr(env, "deferred_runtime_asserts", {}).values() for ra in found
            if ra.expr.free_symbols and ra.expr.free_symbols <= bound]  # unbacked symbols' asserts run in the graph
        return cls(tuple(dims), tuple(ranges), tuple(asserts))

    def refusal(self, shapes: Sequence[Sequence[int]]) -> str | None:
        """Why the export does not hold for inputs of these shapes (leaf order), or None where it does."""
        import sympy

        if len(shapes) != len(self.dims):
            return f"{len(shapes)} inputs where the export has {len(self.dims)}"
        values: dict[Any, int] = {}
        derived: list[tuple[int, int, Any, int]] = []
        for k, (declared, shape) in enumerate(zip(self.dims, shapes)):
            if len(declared) != len(shape):
                return f"input {k} has rank {len(shape)}, the export {len(declared)}"
            for axis, (d, n) in enumerate(zip(declared, shape)):
                if isinstance(d, int) or d.is_Integer:
                    if int(d) != n:
                        return f"input {k} has size {n} on axis {axis}, which the export fixed at {int(d)}"
                elif d.is_Symbol:
                    if values.setdefault(d, n) != n:
                        return (f"input {k} has size {n} on axis {axis}, which the export takes as equal to "
                                f"another size, {values[d]}")
                else:
                    derived.append((k, axis, d, n))
        binding = {s: sympy.Integer(n) for s, n in values.items()}
        for k, axis, d, n in derived:
            value = d.xreplace(binding)
            if not value.is_Integer or int(value) != n:
                return f"input {k} has size {n} on axis {axis}, which the export traced as {d}"
        for symbol, low, high in self.ranges:
            n = values.get(symbol)
            if n is not None and (n < low or (high is not None and n > high)):
                return f"a size of {n} where the export holds for {low} to {'oo' if high is None else high}"
        for relation in self.asserts:
            if relation.xreplace(binding) is not sympy.true:
                return f"the sizes break the export's assumption {relation}"
        return None
