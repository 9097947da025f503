"""A lever against the code as it is, one module a process:
`python -m benchmarks.ab CASE [CASE ...] --set MODULE:ATTR=EXPR [--set ...] [--rounds 4] [--reps 150] [--paired]`.

Two ORTModules in one process mislead: three identical modules made one after the other stepped at 1.0, 0.96 and
0.90-0.96 of the first's time, and pinning onnxruntime's workers to CPUs measured 0.96-0.99 against an unpinned
module in the same process but was worse one module a process (benchmarks/notes.md, session 15). So here each
measurement is a fresh process holding one ORTModule and torch eager, stepped in turn (`measure.step_ratio`, glibc's
allocator steady as in the benchmark), and the lever's processes alternate with the baseline's. The report gives each
setting's median ratio to torch's step over the rounds, and their spread: the machine moves a process's ratio by
0.1-0.4, so a lever worth a few percent needs several rounds. Where the VM's two CPUs sat is read before and after
each process (`placement`), and the table also gives the medians over the processes that ran with them near
throughout and far throughout: a lever for the far placement shows there, and near-only medians are steadier.

A setting is `module:attribute=expression`: the expression is evaluated in the module's namespace and assigned
before the case is built, e.g. `runtime.workload:GEMM_WEIGHT=1.0`.

`--paired` measures a lever on the per-call path (one the module reads at every step, not when it is built) within
each process instead: one ORTModule and torch eager, every ORTModule step right after a torch step, the setting
assigned for one step and the baseline's value for the next, which goes first alternating by round; the lever's
steps over the baseline's, paired, a process (`rounds` processes). The two share a module and its caches, so a
few percent show that the processes' spread hides. Both must follow the same thing: a rotation of three functions
(baseline, lever, torch) runs the first after torch's step two times in three, and its steps on caches the torch
step left cold: session 43 found that order reading 0.93 where the fair one read 0.986.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from . import placement, report


@dataclass(frozen=True)
class Setting:
    module: str
    attr: str
    expr: str

    @classmethod
    def parse(cls, text: str) -> Setting:
        where, sep, expr = text.partition("=")
        module, colon, attr = where.partition(":")
        if not sep or not colon or not module or not attr or not expr:
            raise ValueError(f"a setting is MODULE:ATTR=EXPR, got {text!r}")
        return cls(module.strip(), attr.strip(), expr.strip())

    def apply(self) -> None:
        self.assign(self.evaluated())

    def value(self) -> object:
        """The attribute's value in this process (after `apply`, the setting's)."""
        return getattr(importlib.import_module(self.module), self.attr)

    def evaluated(self) -> object:
        """The expression's value, without assigning it."""
        mod = importlib.import_module(self.module)
        if not hasattr(mod, self.attr):
            raise AttributeError(f"{self.module} has no attribute {self.attr!r}")
        return eval(self.expr, vars(mod))  # the developer's own expression

    def assign(self, value: object) -> None:
        setattr(importlib.import_module(self.module), self.attr, value)

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}={self.expr}"


def measure_here(case_name: str, settings: list[Setting], reps: int | None, threads: int) -> dict[str, Any]:
    """One case in this process, after the settings: ORTModule's and torch's step medians and their paired ratio,
    and each setting's value as the process saw it after the measurement (`applied`)."""
    from . import allocator, measure
    from .models import ALL

    allocator.steady()
    for s in settings:
        s.apply()
    result: dict[str, Any] = dict(measure.step_ratio(ALL[case_name], threads, reps))
    result["applied"] = {str(s): repr(s.value()) for s in settings}
    return result


PAIRED_WARMUP = 10
"""Rounds of a paired process not counted."""


def paired_here(case_name: str, settings: list[Setting], reps: int | None, threads: int) -> dict[str, Any]:
    """One case in this process, the settings' values and the baseline's alternating step by step (module
    docstring): the median of the lever's steps over the baseline's, paired by round (`ratio`), and each one's
    median step and torch's."""
    from . import allocator, measure
    from .models import ALL

    allocator.steady()
    case = ALL[case_name]
    ort_model, reference, args = measure._pair(case, threads, 0)
    ort_step, torch_step = measure.stepper(ort_model, args), measure.stepper(reference, args)
    values = {"baseline": [s.value() for s in settings], "lever": [s.evaluated() for s in settings]}
    times: dict[str, list[float]] = {"baseline": [], "lever": [], "torch": []}
    try:
        for r in range(PAIRED_WARMUP + (reps or case.steps)):
            for which in ("baseline", "lever") if r % 2 == 0 else ("lever", "baseline"):
                before = torch_step()
                for s, v in zip(settings, values[which]):
                    s.assign(v)
                step = ort_step()
                if r >= PAIRED_WARMUP:
                    times[which].append(step)
                    times["torch"].append(before)
    finally:
        for s, v in zip(settings, values["baseline"]):
            s.assign(v)
    result: dict[str, Any] = {k: statistics.median(v) for k, v in times.items()}
    result["ratio"] = statistics.median(a / b for a, b in zip(times["lever"], times["baseline"]))
    return result


def _child(case_name: str, settings: list[Setting], reps: int | None, threads: int, paired: bool = False
           ) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.ab", case_name, "--child", "--threads", str(threads)]
    cmd += [arg for s in settings for arg in ("--set", str(s))] + (["--reps", str(reps)] if reps else [])
    cmd += ["--paired"] if paired else []
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=report.ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the process measuring {case_name} with {[str(s) for s in settings]} failed:\n"
                           f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(cases: list[str], settings: list[Setting], rounds: int, reps: int | None, threads: int
            ) -> dict[str, dict[str, list[Any]]]:
    """Per case, the ratios to torch of the baseline's and the lever's processes, `rounds` of each, alternating
    (which goes first alternates too), and where the CPUs sat during each (`placement`, read before and after
    it: under `baseline_cpus` and `lever_cpus`)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for name in cases:
        ratios: dict[str, list[Any]] = {"baseline": [], "lever": [], "baseline_cpus": [], "lever_cpus": []}
        for r in range(rounds):
            order = ("baseline", "lever") if r % 2 == 0 else ("lever", "baseline")
            for which in order:
                result, placed = placement.around(functools.partial(
                    _child, name, settings if which == "lever" else [], reps, threads))
                ratios[which].append(result["ratio"])
                ratios[f"{which}_cpus"].append(placed["cpus"])
                print(f"{name} {which}: {result['ratio']:.3f} {placed['cpus']}", file=sys.stderr, flush=True)
        out[name] = ratios
    return out


def compare_paired(cases: list[str], settings: list[Setting], rounds: int, reps: int | None, threads: int
                   ) -> dict[str, list[float]]:
    """Per case, the lever's steps over the baseline's of `rounds` processes, each measuring both (`paired_here`)."""
    out: dict[str, list[float]] = {}
    for name in cases:
        out[name] = []
        for _ in range(rounds):
            ratio = _child(name, settings, reps, threads, paired=True)["ratio"]
            out[name].append(ratio)
            print(f"{name} lever / baseline: {ratio:.3f}", file=sys.stderr, flush=True)
    return out


def paired_table(results: dict[str, list[float]]) -> str:
    rows = ["| case | lever / baseline, paired in each process: median (range) | processes |", "|---|---:|---:|"]
    rows += [f"| {name} | {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) | {len(r)} |"
             for name, r in results.items()]
    return "\n".join(rows)


def table(results: dict[str, dict[str, list[Any]]]) -> str:
    """Medians over all processes; then, where the CPUs were read, over the processes that ran with them near
    throughout and with them far throughout (`placement`), each with its count."""
    rows = ["| case | baseline: median (range) | lever: median (range) | lever / baseline | near: baseline / lever "
            "(processes) | far: baseline / lever (processes) |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        base, lever = statistics.median(r["baseline"]), statistics.median(r["lever"])
        rows.append(f"| {name} | {base:.3f} ({min(r['baseline']):.2f}-{max(r['baseline']):.2f}) | {lever:.3f} "
                    f"({min(r['lever']):.2f}-{max(r['lever']):.2f}) | {lever / base:.3f} | {_placed(r, 'near')} | "
                    f"{_placed(r, 'far')} |")
    return "\n".join(rows)


def _placed(r: dict[str, list[Any]], where: str) -> str:
    """The baseline's and the lever's medians over their processes with the CPUs `where` throughout."""
    picked = {w: [x for x, c in zip(r[w], r.get(f"{w}_cpus", [])) if c == where] for w in ("baseline", "lever")}
    if not picked["baseline"] and not picked["lever"]:
        return ""
    return " / ".join(f"{statistics.median(v):.3f}" if v else "-" for v in picked.values()) + \
        f" ({len(picked['baseline'])} / {len(picked['lever'])})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("cases", nargs="+", help="benchmark cases (benchmarks/models.py)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="MODULE:ATTR=EXPR",
                   help="the lever (repeatable)")
    p.add_argument("--rounds", type=int, default=4, help="processes of each setting per case")
    p.add_argument("--reps", type=int, default=None, help="interleaved steps a process (default: the case's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--paired", action="store_true",
                   help="lever and baseline alternating step by step in each process (per-call levers)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = [Setting.parse(s) for s in args.settings]
    if args.child:
        here = paired_here if args.paired else measure_here
        print(json.dumps(here(args.cases[0], settings, args.reps, args.threads)))
        return 0
    if not settings:
        p.error("give the lever as --set MODULE:ATTR=EXPR")
    if args.paired:
        print(paired_table(compare_paired(args.cases, settings, args.rounds, args.reps, args.threads)))
    else:
        print(table(compare(args.cases, settings, args.rounds, args.reps, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
