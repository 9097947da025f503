"""Every notebook in notebooks/ runs green on a real Jupyter kernel, offline, from a clean clone.

Each notebook runs in a temp copy (nothing is written beside the committed one) on a kernel started with this
very interpreter through a kernelspec written for the run, so no user or system kernelspec is needed.
The committed notebooks keep their outputs so they read well on a code host; to refresh them after a change:
`python tests/test_notebooks.py [NAME.ipynb ...]` (or `make notebooks`) executes them in place.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL = "gradbuilder-test"
CELL_TIMEOUT = 180
BUDGET = 90.0
"""Seconds one notebook may take, kernel start included: a guard against growth with room for a busy machine
(each runs in 10-30 s)."""
MAX_BYTES = 600_000
"""Committed notebook size: outputs stay small (modest PNGs, SVG pictures)."""


def execute(path: Path, workdir: Path) -> nbformat.NotebookNode:
    """Run `path` on a fresh kernel of this interpreter with `workdir` as its current directory."""
    kernels = workdir / ".kernels"
    write_kernel_spec(kernels / KERNEL)
    # IPC sockets under the temp dir: nothing listens on the network (and no unencrypted-TCP warning)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
                       transport="ipc", ip=str(kernels / "ipc"))
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, record_timing=False,
                       resources={"metadata": {"path": str(workdir)}}).execute()
    finally:  # a client given its kernel manager leaves the kernel running
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        shutil.rmtree(kernels, ignore_errors=True)
    return nb


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["1-build-and-inspect.ipynb", "2-train-with-ortmodule.ipynb",
                                           "3-multi-output.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    start = time.monotonic()
    nb = execute(copy, tmp_path)  # raises CellExecutionError, with the cell and traceback, on any error
    elapsed = time.monotonic() - start
    assert not _errors(nb)
    assert elapsed < BUDGET, f"{path.name} took {elapsed:.0f} s; keep each notebook well under {BUDGET:.0f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "a notebook left files in its directory"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_with_outputs(path: Path):
    """Committed as executed top to bottom, without errors, and small."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "re-run the notebook top to bottom"
    pictures = [o for c in code for o in c.outputs if {"image/svg+xml", "image/png"} & set(o.get("data", {}))]
    assert pictures, "no picture in the committed outputs: refresh with `make notebooks`"
    assert not _errors(nb)
    assert path.stat().st_size < MAX_BYTES


def main(names: list[str]) -> None:
    for path in [p for p in NOTEBOOKS if not names or p.name in names]:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            nb = execute(path, Path(tmp))
            nbformat.write(nb, path)
            print(f"{path.name}: {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
