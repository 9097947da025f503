"""A lever against the code as it is, one module a process:
`python -m benchmarks.ab CASE [CASE ...] --set MODULE:ATTR=EXPR [--set ...] [--rounds 4] [--reps 150]`.

Two ORTModules in one process mislead: three identical modules made one after the other stepped at 1.0, 0.96 and
0.90-0.96 of the first's time, and pinning onnxruntime's workers to CPUs measured 0.96-0.99 against an unpinned
module in the same process but was worse one module a process (benchmarks/notes.md, session 15). So here each
measurement is a fresh process holding one ORTModule and torch eager, stepped in turn (`measure.step_ratio`, glibc's
allocator steady as in the benchmark), and the lever's processes alternate with the baseline's. The report gives each
setting's median ratio to torch's step over the rounds, and their spread: the machine moves a process's ratio by
0.1-0.4, so a lever worth a few percent needs several rounds.

A setting is `module:attribute=expression`: the expression is evaluated in the module's namespace and assigned
before the case is built, e.g. `runtime.workload:GEMM_WEIGHT=1.0`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from . import report


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
        mod = importlib.import_module(self.module)
        if not hasattr(mod, self.attr):
            raise AttributeError(f"{self.module} has no attribute {self.attr!r}")
        setattr(mod, self.attr, eval(self.expr, vars(mod)))  # the developer's own expression

    def value(self) -> object:
        """The attribute's value in this process (after `apply`, the setting's)."""
        return getattr(importlib.import_module(self.module), self.attr)

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


def _child(case_name: str, settings: list[Setting], reps: int | None, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.ab", case_name, "--child", "--threads", str(threads)]
    cmd += [arg for s in settings for arg in ("--set", str(s))] + (["--reps", str(reps)] if reps else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=report.ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the process measuring {case_name} with {[str(s) for s in settings]} failed:\n"
                           f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(cases: list[str], settings: list[Setting], rounds: int, reps: int | None, threads: int
            ) -> dict[str, dict[str, list[float]]]:
    """Per case, the ratios to torch of the baseline's and the lever's processes, `rounds` of each, alternating
    (which goes first alternates too)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name in cases:
        ratios: dict[str, list[float]] = {"baseline": [], "lever": []}
        for r in range(rounds):
            order = ("baseline", "lever") if r % 2 == 0 else ("lever", "baseline")
            for which in order:
                result = _child(name, settings if which == "lever" else [], reps, threads)
                ratios[which].append(result["ratio"])
                print(f"{name} {which}: {result['ratio']:.3f}", file=sys.stderr, flush=True)
        out[name] = ratios
    return out


def table(results: dict[str, dict[str, list[float]]]) -> str:
    rows = ["| case | baseline: median (range) | lever: median (range) | lever / baseline |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        base, lever = statistics.median(r["baseline"]), statistics.median(r["lever"])
        rows.append(f"| {name} | {base:.3f} ({min(r['baseline']):.2f}-{max(r['baseline']):.2f}) | {lever:.3f} "
                    f"({min(r['lever']):.2f}-{max(r['lever']):.2f}) | {lever / base:.3f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("cases", nargs="+", help="benchmark cases (benchmarks/models.py)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="MODULE:ATTR=EXPR",
                   help="the lever (repeatable)")
    p.add_argument("--rounds", type=int, default=4, help="processes of each setting per case")
    p.add_argument("--reps", type=int, default=None, help="interleaved steps a process (default: the case's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    settings = [Setting.parse(s) for s in args.settings]
    if args.child:
        print(json.dumps(measure_here(args.cases[0], settings, args.reps, args.threads)))
        return 0
    if not settings:
        p.error("give the lever as --set MODULE:ATTR=EXPR")
    print(table(compare(args.cases, settings, args.rounds, args.reps, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
