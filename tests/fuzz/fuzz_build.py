"""atheris harness for fuzz_models.check: model bytes -> inspect, build, split; only GradBuilderError may come out.

Run for a bounded time by test_fuzz.py; by hand, for longer: `python tests/fuzz/fuzz_build.py CORPUS_DIR
-max_total_time=600` (CORPUS_DIR gets the seed models). A crash file it writes is an .onnx model:
`gradbuilder build crash-... -o /tmp/out.onnx --debug` reproduces the failure.
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
