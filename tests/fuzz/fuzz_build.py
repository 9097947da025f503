"""atheris harness for fuzz_models.check: model bytes -> inspect, build, split; only GradBuilderError may come out.

Run from a fixed seed for a fixed number of inputs by test_fuzz.py; by hand, from a fresh seed, `make fuzz`
(`FUZZ_SECONDS=3600 make fuzz` for longer; fuzz/corpus gets the seed models and keeps what it learns). A crash
file it writes (fuzz/found/) is an .onnx model: `python tests/fuzz/fuzz_models.py crash-...` reproduces the
failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["gradbuilder"]):  # coverage feedback from our code, not onnx's
    import fuzz_models

STRUCTURAL = os.environ.get("GRADBUILDER_FUZZ_STRUCTURAL", "1") == "1"
"""Half the mutations structural (parse, rewire, reserialize), half libFuzzer's byte mutations."""


def mutator(data: bytes, max_size: int, seed: int) -> bytes:
    if STRUCTURAL and seed % 2:
        out = fuzz_models.mutate_bytes(data, seed)
        if out is not None and len(out) <= max_size:
            return out
    return atheris.Mutate(data, max_size)


def write_seeds(corpus: Path) -> None:
    corpus.mkdir(parents=True, exist_ok=True)
    for name, model in {**fuzz_models.seeds(), **fuzz_models.training_seeds()}.items():
        (corpus / f"seed-{name}.onnx").write_bytes(model.SerializeToString())


def main(argv: list[str]) -> None:
    for arg in argv[1:]:
        if not arg.startswith("-"):
            write_seeds(Path(arg))
    atheris.Setup(argv, fuzz_models.check, custom_mutator=mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
