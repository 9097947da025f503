"""Run the benchmarks and print one report: `python -m benchmarks [--models mlp,cnn] [--write-docs]`.

Step times are measured in this process (interleaved with torch eager); time to first step and peak RSS
run in fresh processes (benchmarks/probe.py). Results are saved to benchmarks/results.json; with
--write-docs they also become docs/performance.md and docs/performance.png. --from-json rewrites the docs
from saved results without measuring.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import allocator, builder_scaling, placement, report

DEFAULT_MODELS = ("mlp", "cnn", "transformer", "gpt2")
PARTS = ("timing", "memory", "first", "overhead", "builder", "passive", "shapes", "grid")
PASSIVE_MODELS = ("mlp", "cnn", "transformer")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(models: list[str], parts: set[str], threads: int, reps: int | None, glibc: str = "default") -> dict[str, Any]:
    from . import measure, probe
    from .models import CASES, GRID, SHAPES, VARIANTS

    results: dict[str, Any] = {"machine": report.machine(), "threads": threads, "models": {},
                               "started": time.strftime("%Y-%m-%d %H:%M"), "load_start": report.load()}
    for name in models:
        case = CASES[name]
        entry: dict[str, Any] = {"description": case.description}
        results["models"][name] = entry
        if "timing" in parts or "memory" in parts:
            _log(f"{name}: interleaved steps")
            load0 = report.load()
            r, placed = placement.around(functools.partial(measure.measure, case, threads=threads, reps=reps))
            entry["timing"] = {"ort_step": r.ort.step, "torch_step": r.torch.step, "ratio": r.ratio,
                               "ort_forward": r.ort.forward, "torch_forward": r.torch.forward,
                               "ort_iqr": r.ort.step_iqr, "torch_iqr": r.torch.step_iqr, "samples": r.ort.samples,
                               "ort_stash": r.ort_stash, "torch_saved": r.torch_saved, "fused": r.fused,
                               "load": (load0 + report.load()) / 2, **placed}
        if "memory" in parts:
            _log(f"{name}: peak RSS (fresh processes)")
            entry["rss"] = {e: probe.run("rss", name, e, threads) for e in ("ortmodule", "eager")}
        if "first" in parts:
            entry["first"] = {}
            for engine in probe.ENGINES:
                _log(f"{name}: first step, {engine} (fresh process)")
                entry["first"][engine] = probe.run("first", name, engine, threads)
            entry["compile_saved"] = entry["first"]["compile"].get("saved")
    if "overhead" in parts:
        _log("tiny-mlp: ORTModule against bare onnxruntime")
        results["overhead"] = {"model": CASES["tiny-mlp"].description,
                               **measure.bare_overhead(CASES["tiny-mlp"], threads=threads, reps=reps)}
    if "passive" in parts:
        _log("torch with passive OpenMP threads (OMP_WAIT_POLICY=PASSIVE): step times in a fresh process")
        results["passive"] = passive([m for m in models if m in PASSIVE_MODELS], threads, reps, glibc)
    for part, cases in (("shapes", SHAPES), ("grid", GRID)):
        if part in parts:
            results[part] = ratios(cases, threads, reps)
    if "grid" in parts:
        results["variants"] = ratios(VARIANTS, threads, reps)
    if "builder" in parts:
        _log("builder scaling")
        results["builder"] = builder_scaling.measure()
    results["load_end"] = report.load()
    return results


def ratios(cases: dict[str, Any], threads: int, reps: int | None) -> dict[str, Any]:
    """Step times and paired ratio of each case against torch eager, with the load while it ran and where the
    CPUs sat (`placement`)."""
    from . import measure

    out = {}
    for name, case in cases.items():
        _log(f"{name}: interleaved steps")
        load0 = report.load()
        measured, placed = placement.around(functools.partial(measure.step_ratio, case, threads=threads, reps=reps))
        out[name] = {"description": case.description, **measured, "load": (load0 + report.load()) / 2, **placed}
    return out


def passive(models: list[str], threads: int, reps: int | None, glibc: str) -> dict[str, Any]:
    """Step times with torch's idle OpenMP threads sleeping at once instead of spinning (its default) for a
    while after each parallel region, measured in a fresh process: the wait policy is fixed when torch starts
    its pool. Shows how much of the main table's ratio is the two engines' threads competing for the cores."""
    if not models:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "passive.json"
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        cmd = [sys.executable, "-m", "benchmarks", "--models", ",".join(models), "--parts", "timing", "--threads",
               str(threads), "--omp-wait", "PASSIVE", "--allocator", glibc, "--json", str(out)] + \
            (["--reps", str(reps)] if reps else [])
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=report.ROOT)
        spun = json.loads(out.read_text())
    return {name: r["timing"] for name, r in spun["models"].items() if r.get("timing")}


# where each part lands in the results: per model (keys of a model's entry) or for the whole run
_MODEL_KEYS = {"timing": ("timing",), "memory": ("rss",), "first": ("first", "compile_saved")}
_RUN_KEYS = {"overhead": ("overhead",), "builder": ("builder",), "passive": ("passive",), "shapes": ("shapes",),
             "grid": ("grid", "variants")}


def keep_unmeasured(results: dict[str, Any], earlier: dict[str, Any], parts: set[str]) -> None:
    """Carry the parts this run did not measure over from the saved results (a partial re-run keeps the slow
    cold-start and RSS measurements), and the models it did not run (each model records when it was measured),
    and record when each part was measured."""
    fresh = results["models"]
    for entry in fresh.values():
        entry["measured"] = results["started"]
    kept = {name: {"measured": earlier.get("started", "?"), **old}
            for name, old in earlier.get("models", {}).items() if name not in fresh}
    order = [*earlier.get("models", {}), *[name for name in fresh if name not in earlier.get("models", {})]]
    results["models"] = {name: fresh[name] if name in fresh else kept[name] for name in order}
    when = dict(earlier.get("measured", {}))
    for part in PARTS:
        if part in parts:
            when[part] = results["started"]
            continue
        for key in _RUN_KEYS.get(part, ()):
            if key in earlier:
                results[key] = earlier[key]
        for name, entry in results["models"].items():
            old = earlier.get("models", {}).get(name, {})
            for key in _MODEL_KEYS.get(part, ()):
                if key in old and key not in entry:
                    entry[key] = old[key]
        when.setdefault(part, earlier.get("started", "?"))
    results["measured"] = when


def write_docs(results: dict[str, Any]) -> None:
    from . import docs

    report.plot(results)
    report.DOC.write_text(docs.render(results), encoding="utf-8")
    _log(f"wrote {report.DOC.relative_to(report.ROOT)} and {report.PLOT.relative_to(report.ROOT)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated, from benchmarks/models.py")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--threads", type=int, default=2, help="torch and onnxruntime intra-op threads")
    p.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default: per model)")
    p.add_argument("--json", type=Path, default=report.RESULTS, help="where to save the results")
    p.add_argument("--write-docs", action="store_true", help="write docs/performance.md and its plot")
    p.add_argument("--from-json", type=Path, default=None, help="do not measure: use these saved results")
    p.add_argument("--before", type=Path, default=None,
                   help="results measured before the levers, kept in the results and shown next to them in the docs")
    p.add_argument("--omp-wait", default="default",
                   help="OMP_WAIT_POLICY for torch's OpenMP threads ('default': leave torch's default, idle threads "
                        "spin for a while, as users run it; PASSIVE: idle threads sleep at once)")
    p.add_argument("--allocator", choices=("steady", "default"), default="steady",
                   help="steady: glibc's mmap and trim thresholds fixed high before measuring, so torch's tensors "
                        "are not faulted in anew each step (benchmarks/allocator.py); default: leave glibc alone")
    args = p.parse_args(argv)
    glibc = args.allocator if args.allocator == "default" or allocator.steady() else "default"
    if args.omp_wait != "default":
        os.environ.setdefault("OMP_WAIT_POLICY", args.omp_wait)  # read when torch starts its pool: before import

    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
    else:
        earlier = json.loads(args.json.read_text()) if args.json.exists() else {}
        parts = set(args.parts.split(","))
        results = run(args.models.split(","), parts, args.threads, args.reps, glibc)
        results["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
        results["allocator"] = glibc
        keep_unmeasured(results, earlier, parts)
        if "before" in earlier:  # the measurement before the levers stays with the results
            results["before"] = earlier["before"]
    if args.before is not None:
        results["before"] = json.loads(args.before.read_text())
    if args.from_json is None or args.before is not None:
        args.json.write_text(json.dumps(results, indent=1))
    print(report.text(results))
    if args.write_docs:
        write_docs(results)


if __name__ == "__main__":
    main()
