"""docs/performance.md from benchmark results: the tables and goals are computed; the account of the levers
(benchmarks/notes.md) is written by hand, since it records measurements made while choosing them, which
`python -m benchmarks` does not repeat."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from . import report

NOTES = Path(__file__).with_name("notes.md")

def _measured(results: dict[str, Any]) -> str:
    """When each part was measured, when a partial re-run carried some over from an earlier run."""
    when = results.get("measured") or {}
    if len(set(when.values())) <= 1:
        return ""
    return "Parts measured at different times: " + ", ".join(f"{p} {w}" for p, w in when.items()) + "."


def _allocator(results: dict[str, Any]) -> str:
    """How glibc's allocator was set for the in-process timings (`benchmarks/allocator.py`), as a bullet's text
    wrapped like the page's others."""
    if results.get("allocator") == "steady":
        text = ("glibc's mmap and trim thresholds fixed high before anything ran (`benchmarks/allocator.py`): torch's "
                "tensors come from malloc, and with glibc's defaults every step of a small CNN faulted its larger "
                "tensors in anew until some earlier model's freed blocks had raised both thresholds, so torch's step "
                "depended on what ran before it in the process (LeNets: 4.9-5.2 ms first, 3.2-3.5 ms later); fixed, "
                "torch runs at its best throughout. onnxruntime's arena keeps its memory either way.")
    else:
        text = ("glibc's allocator left at its defaults (`--allocator default`): torch's larger tensors may be "
                "faulted in anew each step, depending on what ran earlier in the process (`benchmarks/allocator.py`).")
    return textwrap.fill(text, width=113, subsequent_indent="  ")


def _goal(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "**no**"


def goals(results: dict[str, Any]) -> str:
    models = {n: r for n, r in results["models"].items() if r.get("timing")}
    small = [n for n in ("mlp", "cnn", "transformer") if n in models]
    ratios = {n: models[n]["timing"]["ratio"] for n in small}
    stash = {n: (r["timing"]["ort_stash"], r["timing"]["torch_saved"], r.get("compile_saved"))
             for n, r in models.items()}
    over = results.get("overhead", {}).get("overhead")
    firsts = {n: ((r.get("first") or {}).get("ortmodule", {}).get("first_step"),
                  (r.get("first") or {}).get("compile", {}).get("first_step")) for n, r in models.items()}
    measured = ", ".join(f"{n} {v:.2f}" for n, v in ratios.items())
    spun = results.get("passive") or {}
    ten_k = next((row for row in results.get("builder") or [] if 5_000 <= row["forward_nodes"] <= 20_000), None)
    rows = [
        ("step time <= 1.0x torch eager (MLP, CNN, transformer)",
         all(v <= 1.0 for v in ratios.values()) if ratios else None, measured),
        ("step time <= 0.8x torch eager", all(v <= 0.8 for v in ratios.values()) if ratios else None, measured),
        ("(for reference) step time <= 1.0x torch eager with torch's OpenMP threads passive",
         all(t["ratio"] <= 1.0 for t in spun.values()) if spun else None,
         ", ".join(f"{n} {t['ratio']:.2f}" for n, t in spun.items())),
        ("per-step overhead within 0.1 ms of bare onnxruntime", None if over is None else over <= 1e-4,
         "-" if over is None else f"{over * 1e3:.3f} ms"),
        ("stash <= torch eager's saved bytes", all(o <= t for o, t, _ in stash.values()) if stash else None,
         ", ".join(f"{n} {o / 1e6:.3g}/{t / 1e6:.3g} MB" for n, (o, t, _) in stash.items())),
        ("stash <= torch.compile's saved bytes", all(o <= c for o, _, c in stash.values() if c) if any(
            c for *_, c in stash.values()) else None,
         ", ".join(f"{n} {o / 1e6:.3g}/{c / 1e6:.3g} MB" for n, (o, _, c) in stash.items() if c)),
        ("time to first step <= 1/10 of torch.compile's", all(o <= c / 10 for o, c in firsts.values() if o and c)
         if any(o and c for o, c in firsts.values()) else None,
         ", ".join(f"{n} {o:.2f}/{c:.1f} s" for n, (o, c) in firsts.items() if o and c)),
        ("10k-node graph built in at most 1 s", None if ten_k is None else ten_k["seconds"] <= 1.0,
         "-" if ten_k is None else f"{ten_k['seconds']:.2f} s ({ten_k['forward_nodes']:,} forward nodes)"),
    ]
    families = report.family_ratios(results)
    for bound in (1.0, 0.8):
        rows.append((f"the grid's other shapes of the three families: step time <= {bound}x torch eager",
                     all(v <= bound for r in families.values() for v in r) if families else None,
                     ", ".join(f"{f} {sum(v <= bound for v in r)} of {len(r)}" for f, r in families.items())))
    lines = ["| goal | reached | measured |", "|---|---|---|"]
    lines += [f"| {g} | {_goal(ok)} | {m} |" for g, ok, m in rows]
    return "\n".join(lines)


def before_after(results: dict[str, Any]) -> str:
    before = results.get("before")
    if not before or before.get("omp_wait_policy") != results.get("omp_wait_policy"):
        return ""  # measured with torch's threads set up differently: not comparable
    lines = ["| model | ratio before | ratio now | stash before (MB) | stash now (MB) | torch saved (MB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results["models"].items():
        b = before.get("models", {}).get(name, {}).get("timing")
        t = r.get("timing")
        if not b or not t:
            continue
        lines.append(f"| {name} | {b['ratio']:.2f} | {t['ratio']:.2f} | {b['ort_stash'] / 1e6:.3g} | "
                     f"{t['ort_stash'] / 1e6:.3g} | {t['torch_saved'] / 1e6:.3g} |")
    return "\n".join(lines)


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    models = "\n".join(f"- **{n}**: {r['description']}" for n, r in results["models"].items())
    ba = before_after(results)
    before_note = ""
    if ba:
        b = results["before"]
        before_note = (f"\n## Before and after the levers\n\nBefore: the runtime and rules as they were when this work "
                       f"started, measured {b.get('started', '?')} (load {b.get('load_start', 0):.1f}) with the same "
                       f"script.\n\n{ba}\n")
    return f"""# Performance: ORTModule against torch eager and torch.compile

Regenerate with `python -m benchmarks --write-docs` (measures; 8-15 minutes here with GPT-2 and three cold
torch.compile runs) or `python -m benchmarks --from-json benchmarks/results.json --write-docs` (rewrites this
page from saved results). `make bench` prints the tables without writing. A lever is measured against the code as it
is by `python -m benchmarks.ab CASE --set MODULE:ATTR=EXPR` (one ORTModule a process, the two settings' processes
alternating: two modules in one process disturb each other's timings); one read at every step (not when the module
is built) by `--paired` too, the two settings alternating step by step in each process, every step right after a
torch step.

## Machine and method

- {m['cpu']} ({m.get('vectors', 'vector extension not recorded')}), {m['cores']} cores, {m['memory_gb']} GB;
  Python {m['python']}, torch {m['torch']}, onnxruntime {m['onnxruntime']}.
  Measured {results.get('started', '?')}. {results.get('timing_note', '')}
  {_measured(results)}
- **Shared machine**: other developers' test suites ran at the same time; one-minute load average
  {results.get('load_start', 0):.1f} at the start and {results.get('load_end', 0):.1f} at the end (per model
  in the tables). Absolute times are therefore several times the quiet-machine numbers; ratios come from
  interleaved runs in one process (the engines alternate step by step, the order rotating), so both see the
  same load. The ratio is the median of the per-pair ratios.
- {results['threads']} intra-op threads for both (`torch.set_num_threads`, `ORTModule(threads=...)`), each
  engine with its defaults, as a user runs them: torch's OpenMP pool
  (`OMP_WAIT_POLICY={results.get('omp_wait_policy') or 'unset'}`) keeps its idle threads spinning for a while
  after each parallel region (~10 ms of a core here), which makes torch faster and would slow whatever runs next
  on the same cores (here ORTModule's step, right after torch's): ORTModule parks those workers while its runs
  last, when nothing else runs on the machine (`runtime/openmp.py`: with another process running, letting them
  go waits for a core); onnxruntime's threads spin while a run lasts and stop at its end
  (`session.force_spinning_stop`). The second table repeats the step times with torch's threads passive (torch
  then pays a wake-up per parallel op), for comparison. `threads` is the most ORTModule uses: a model whose
  forward work is small for its batch (below `runtime.workload.SMALL` by `TRIAL_BOTTOM`, the tiny MLP) runs on one,
  as torch runs ops below its grain size on one; near that crossover (up to `SMALL` times `TRIAL_TOP`), each of
  its sessions times its runs on both after its first 8 and keeps the faster (`runtime.ort_session.Trial`), so a
  case's first ~25 steps hold 6-10 of the trial's runs on the slower one; a trial is made again when the chosen
  session's runs slow down (on this machine class, two threads slow by up to 2.4x while the VM's two CPUs sit far
  apart on the host, which changes every 10-70 s and moves a case's ratio by as much).
- **Where the VM's CPUs sat** (the "CPUs" columns): before and after each case, `benchmarks/placement.py` times a
  cache line's round trip between two threads pinned one to each of the first two CPUs (a small C program in its
  own process, so that no spinning worker of this one holds a CPU). On this machine class it reads one of two
  levels, which change every 10-70 s: "near" (55-70 ns), or "far" (330-370 ns), where two-thread runs of both
  engines slow down (onnxruntime's by up to 2.4x, torch's by less), so a ratio read "far" or "mixed" (one
  reading each) says more about the placement than about ORTModule. Empty where results predate the reading or
  no C compiler was found.
- {_allocator(results)}
- A step is forward + backward of the module returning its loss (cross-entropy inside the module, so it runs
  on onnxruntime too), gradients set to None before it, no optimizer. Forward = the training forward alone
  (grad enabled, stash made, then dropped). "(fused)": ORTModule ran each step's forward and backward as one
  onnxruntime run (`runtime/fused.py`: a module whose only differentiable output is a scalar, where its
  gradients are no larger than the split forward's stash); its forwards alone run split (fusing pauses after
  forwards without a backward), so the forward column times the split forward.
- Saved bytes: torch eager's through `torch.autograd.graph.saved_tensors_hooks`, torch.compile's from its
  `CompiledFunctionBackward.saved_tensors`, ORTModule's from the OrtValues its forward stashes (a fused step's:
  the gradients it keeps until backward); parameters, buffers and inputs excluded (tensors sharing their memory
  too), deduplicated by storage.
- Peak RSS: fresh process per engine, glibc's mmap threshold fixed at 64 KB so freed tensors leave RSS, two
  warm-up steps, then the peak (VmHWM, reset through /proc/self/clear_refs) of a forward and of a step above
  the RSS before each. onnxruntime's arena is switched off for this measurement only (it keeps the largest
  step's memory mapped, which would read as zero growth).
- Time to first step: fresh process each (imports done before the clock starts), cold inductor cache for
  torch.compile (a new `TORCHINDUCTOR_CACHE_DIR`); "steady" is the median of the next 5 steps (not
  interleaved).

Models (`benchmarks/models.py`):

{models}

The `shapes` part times other shapes of the same families (`SHAPES` in `benchmarks/models.py`: wider, deeper and
larger-batch MLPs, LeNets with other channels, inputs and batch, a 3x3 net, transformers of other widths,
causal or without dropout, a 4-layer GPT-2-width model) the same way, step times only, fewer repetitions: a
check that the reference models' ratios are not particular to their shapes. The `grid` part (`GRID`) does the
same for thirty more: ten MLPs, ten LeNets and ten encoders, none a reference model, spread over widths, depths,
channels, kernels, input sizes, sequence lengths and batches of 1 to 512, as a benchmark of other shapes of
these families would pick them; it also times variants of the families (`VARIANTS`: other activations,
pools, normalizations and their order, and a per-pixel loss), whose gradients' Wheres once ran at up to 1.9x torch's
step, whose activations and class-axis softmax onnxruntime's own kernels run element by element, and whose
average pools' gradient a ConvTranspose spread.

![step time and saved memory](performance.png)

## Goals

{goals(results)}

{report.text(results)}
{before_note}
{NOTES.read_text(encoding="utf-8")}"""
