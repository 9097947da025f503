"""The benchmark's table, plot and docs/performance.md, from one results dictionary (saved as JSON so the
docs can be rewritten without measuring again)."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "performance.md"
PLOT = ROOT / "docs" / "performance.png"
RESULTS = ROOT / "benchmarks" / "results.json"

MB = 1e6


def machine() -> dict[str, Any]:
    """CPU, cores, memory and library versions of the machine measuring."""
    import onnxruntime
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        mem = 0
    from runtime import nchwc

    vectors = nchwc.vector_extension() or "no NCHWc kernels"
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem / 2**20), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "vectors": vectors}


def load() -> float:
    """One-minute load average (the machine is shared: other jobs slow every engine)."""
    return os.getloadavg()[0]


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:,.0f}"


def _mb(b: float | None) -> str:
    return "-" if b is None else f"{b / MB:.2f}" if abs(b) < 10 * MB else f"{b / MB:,.0f}"


def _s(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}" if s < 100 else f"{s:,.0f}"


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def step_table(results: dict[str, Any]) -> str:
    head = ("| model | ORTModule step (ms) | torch step (ms) | ratio | ORTModule fwd (ms) | torch fwd (ms) "
            "| (fwd+bwd)/fwd ORT / torch | load | CPUs |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results["models"].items():
        t = r.get("timing")
        if not t:
            continue
        fused = " (fused)" if t.get("fused") else ""
        lines.append(f"| {name}{fused} | {_ms(t['ort_step'])} | {_ms(t['torch_step'])} | **{t['ratio']:.2f}** | "
                     f"{_ms(t['ort_forward'])} | {_ms(t['torch_forward'])} | "
                     f"{t['ort_step'] / t['ort_forward']:.2f} / {t['torch_step'] / t['torch_forward']:.2f} | "
                     f"{t['load']:.1f} | {t.get('cpus', '')} |")
    return "\n".join(lines)


def _table(header: str, align: str, rows: Iterable[str]) -> str:
    """A markdown table: its header, its alignment row and one line a row; "" without rows."""
    lines = list(rows)
    return "\n".join([header, align, *lines]) if lines else ""


def passive_table(results: dict[str, Any]) -> str:
    spun = results.get("passive") or {}
    return _table("| model | ORTModule step (ms) | torch step (ms) | ratio | load |", "|---|---:|---:|---:|---:|",
                  (f"| {name} | {_ms(t['ort_step'])} | {_ms(t['torch_step'])} | **{t['ratio']:.2f}** | "
                   f"{t['load']:.1f} |" for name, t in spun.items()))


def ratio_table(entries: dict[str, Any] | None) -> str:
    """One row a shape (the `shapes` and `grid` parts)."""
    return _table("| model | shape | ORTModule step (ms) | torch step (ms) | ratio | load | CPUs |",
                  "|---|---|---:|---:|---:|---:|---|",
                  (f"| {name} | {t['description']} | {_ms(t['ort_step'])} | {_ms(t['torch_step'])} | "
                   f"**{t['ratio']:.2f}** | {t['load']:.1f} | {t.get('cpus', '')} |"
                   for name, t in (entries or {}).items()))


def family_entries(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The grid's cases by family (`models.FAMILIES`, from the names' prefixes)."""
    from .models import FAMILIES

    out: dict[str, list[dict[str, Any]]] = {family: [] for family in FAMILIES.values()}
    for name, t in (results.get("grid") or {}).items():
        family = FAMILIES.get(name.split("-", 1)[0])
        if family is not None:
            out[family].append(t)
    return {family: entries for family, entries in out.items() if entries}


def family_ratios(results: dict[str, Any]) -> dict[str, list[float]]:
    """The grid's ratios by family."""
    return {family: [t["ratio"] for t in entries] for family, entries in family_entries(results).items()}


def grid_summary(results: dict[str, Any]) -> str:
    """Per family: the ratios' spread, how many reach 1.0 and 0.8, and how many cases had the CPUs far apart for
    some of their run (`placement`; empty for results recorded before it was read)."""
    families = family_entries(results)
    rows = []
    for family, entries in families.items():
        r = [t["ratio"] for t in entries]
        placed = [t.get("cpus", "") for t in entries]
        apart = f"{sum(c in ('far', 'mixed') for c in placed)}" if any(placed) else ""
        rows.append(f"| {family} | {len(r)} | {min(r):.2f} / {statistics.median(r):.2f} / {max(r):.2f} | "
                    f"{sum(v <= 1.0 for v in r)} | {sum(v <= 0.8 for v in r)} | {apart} |")
    return _table("| family | shapes | ratio: lowest / median / highest | at most 1.0 | at most 0.8 | CPUs far for "
                  "some of the case |", "|---|---:|---:|---:|---:|---:|", rows)


def memory_table(results: dict[str, Any]) -> str:
    lines = ["| model | ORT stash (MB) | torch saved (MB) | torch.compile saved (MB) | step peak-RSS growth over "
             "forward (MB): ORTModule / torch |", "|---|---:|---:|---:|---:|"]
    for name, r in results["models"].items():
        t = r.get("timing") or {}
        rss_o, rss_t = _get(r, "rss", "ortmodule", "growth"), _get(r, "rss", "eager", "growth")
        kept = " (its gradients: fused)" if t.get("fused") else ""
        lines.append(f"| {name} | {_mb(t.get('ort_stash'))}{kept} | {_mb(t.get('torch_saved'))} | "
                     f"{_mb(r.get('compile_saved'))} | {_mb(rss_o)} / {_mb(rss_t)} |")
    return "\n".join(lines)


def startup_table(results: dict[str, Any]) -> str:
    lines = ["| model | ORTModule (s) | torch eager (s) | torch.compile (s) | ORTModule / compile |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results["models"].items():
        first = r.get("first") or {}
        o, e, c = (_get(first, k, "first_step") for k in ("ortmodule", "eager", "compile"))
        if o is None and e is None:
            continue
        share = f"{o / c:.3f}" if o and c else "-"
        lines.append(f"| {name} | {_s(o)} | {_s(e)} | {_s(c)} | {share} |")
    return "\n".join(lines)


def overhead_table(results: dict[str, Any]) -> str:
    o = results.get("overhead")
    if not o:
        return ""
    floor = f"{o['autograd'] * 1e3:.3f}" if "autograd" in o else "-"
    return ("| tiny MLP step | ORTModule (ms) | bare onnxruntime forward + backward (ms) | overhead (ms) | of which "
            "torch autograd for one custom Function (ms) |\n|---|---:|---:|---:|---:|\n"
            f"| {o['model']} | {_ms(o['ortmodule'])} | {_ms(o['bare'])} | {o['overhead'] * 1e3:.3f} | {floor} |")


def builder_table(results: dict[str, Any]) -> str:
    rows = results.get("builder")
    if not rows:
        return ""
    from . import builder_scaling

    return builder_scaling.report(rows)


def text(results: dict[str, Any]) -> str:
    """All tables, as printed by `python -m benchmarks`."""
    parts = [("Step time (forward + backward, no optimizer)", step_table(results)),
             ("Step time with torch's OpenMP threads passive (OMP_WAIT_POLICY=PASSIVE, fresh process)",
              passive_table(results)),
             ("Step time on other shapes of the same families (interleaved with torch eager, as above)",
              ratio_table(results.get("shapes"))),
             ("A grid of other shapes of the three reference families, by family", grid_summary(results)),
             ("The grid, shape by shape", ratio_table(results.get("grid"))),
             ("The families with other activations and normalizations, and a per-pixel loss (part of the grid)",
              ratio_table(results.get("variants"))),
             ("Memory saved for backward", memory_table(results)),
             ("Time to first step", startup_table(results)),
             ("Per-step overhead", overhead_table(results)),
             ("Builder time", builder_table(results))]
    return "\n\n".join(f"## {title}\n\n{table}" for title, table in parts if table)


def plot(results: dict[str, Any], path: Path = PLOT) -> None:
    """Two panels: step time relative to torch eager, and bytes saved for backward per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [n for n, r in results["models"].items() if r.get("timing")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(models))
    before = results.get("before", {})
    same_threads = before.get("omp_wait_policy") == results.get("omp_wait_policy")
    before = before.get("models", {}) if same_threads else {}
    width = 0.38
    ratios = [results["models"][m]["timing"]["ratio"] for m in models]
    olds = [_get(before, m, "timing", "ratio") for m in models]
    if any(o is not None for o in olds):
        ax1.bar([x - width / 2 for x in xs], [o or 0 for o in olds], width, label="before the levers",
                color="#bbbbbb")
        ax1.bar([x + width / 2 for x in xs], ratios, width, label="now", color="#1f77b4")
    else:
        ax1.bar(list(xs), ratios, width, color="#1f77b4")
    ax1.axhline(1.0, color="black", lw=0.8)
    ax1.axhline(0.8, color="green", lw=0.8, ls="--", label="0.8x goal")
    ax1.set_xticks(list(xs), models)
    ax1.set_ylabel("ORTModule step / torch eager step\n(torch's default threads)")
    ax1.set_title("Training step time (lower is better)")
    ax1.legend(fontsize=8)
    engines = [("ORTModule stash", lambda r: r["timing"]["ort_stash"], "#1f77b4"),
               ("torch eager saved", lambda r: r["timing"]["torch_saved"], "#ff7f0e"),
               ("torch.compile saved", lambda r: r.get("compile_saved"), "#2ca02c")]
    w = 0.27
    for k, (label, get, color) in enumerate(engines):
        vals = [get(results["models"][m]) for m in models]
        ax2.bar([x + (k - 1) * w for x in xs], [v / MB if v else 0 for v in vals], w, label=label, color=color)
    ax2.set_yscale("log")
    ax2.set_xticks(list(xs), models)
    ax2.set_ylabel("MB kept for backward")
    ax2.set_title("Memory saved for backward (lower is better)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
