"""In-process measurements: step and forward times of ORTModule against torch eager, and saved bytes.

Timings interleave the engines in one process at the same thread count (the machine is shared: a
slower minute slows both), alternating which engine goes first, and report medians. A step is
forward + backward with gradients set to None before it (no optimizer, no accumulation).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from onnxruntime.capi import _pybind_state as C
from torch import nn

from runtime import ORTModule, exchange
from runtime.session import TrainingSession

from .models import Case

WARMUP = 3


@dataclass
class Timing:
    """Medians (seconds) of interleaved runs, with the 25th-75th percentile spread of the step."""

    step: float
    forward: float
    step_iqr: tuple[float, float]
    samples: int

    @property
    def backward_ratio(self) -> float:
        """(forward + backward) / forward."""
        return self.step / self.forward


@dataclass
class Result:
    """Everything measured in-process for one model."""

    name: str
    ort: Timing
    torch: Timing
    ort_stash: int
    torch_saved: int
    ratio: float
    """Median over runs of the paired ratio ORTModule step / torch step."""
    fused: bool = False
    """Whether ORTModule's steps ran forward and backward as one run (runtime/fused.py): its stash is then the
    gradients it kept; its forwards alone (no backward after them) run split, as ORTModule pauses fusing for
    them."""
    extra: dict[str, float] = field(default_factory=dict)


def _quantiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def stepper(model: nn.Module, args: tuple[torch.Tensor, ...]) -> Callable[[], float]:
    """A function timing one forward + backward of `model` on `args`."""
    params = _params(model)

    def step() -> float:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        model(*args).backward()
        return time.perf_counter() - t0

    return step


def forwarder(model: nn.Module, args: tuple[torch.Tensor, ...]) -> Callable[[], float]:
    """A function timing one training forward (grad enabled, so the stash is made; then dropped). A module that
    fuses its steps' runs (runtime/fused.py) pauses that after a few of these in a row (`MAX_UNUSED`): what is
    timed is its split forward."""

    def forward() -> float:
        t0 = time.perf_counter()
        out = model(*args)
        dt = time.perf_counter() - t0
        del out
        return dt

    return forward


def interleave(fns: list[Callable[[], float]], reps: int) -> list[list[float]]:
    """Run every function `reps` times, in rotating order, and return the times per function."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            times[i].append(fns[i]())
    return times


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def torch_saved_bytes(model: nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    """Bytes torch eager saves for backward in one forward: parameters and inputs excluded, deduplicated
    by storage (views of one tensor count once, with their whole storage)."""
    excluded = {storage_key(t) for t in [*model.parameters(), *model.buffers(), *args]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in excluded:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*args)
    del loss
    return sum(seen.values())


def graph_saved_bytes(loss: torch.Tensor, excluded: Iterable[torch.Tensor]) -> int:
    """Bytes saved by the autograd nodes behind `loss` that expose `saved_tensors` (torch.compile's
    CompiledFunctionBackward does), parameters and inputs excluded, deduplicated by storage."""
    skip = {storage_key(t) for t in excluded}
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in visited:
            continue
        visited.add(fn)
        try:
            saved = fn.saved_tensors
        except (AttributeError, RuntimeError):
            saved = ()
        for t in saved:
            if isinstance(t, torch.Tensor) and storage_key(t) not in skip:
                seen[storage_key(t)] = t.untyped_storage().nbytes()
        stack.extend(n for n, _ in fn.next_functions)
    return sum(seen.values())


def ort_stash_bytes(model: ORTModule, args: tuple[torch.Tensor, ...]) -> int:
    """Bytes one ORTModule forward keeps for its backward beyond its inputs and parameters
    (`TrainingSession.stash_bytes`): the stash of a split forward, the gradients of a fused one."""
    loss = model(*args)
    nbytes = loss.grad_fn.call.session.stash_bytes(loss.grad_fn.state)
    del loss
    return nbytes


def _pair(case: Case, threads: int, seed: int) -> tuple[ORTModule, nn.Module, tuple[torch.Tensor, ...]]:
    """The model on ORTModule and in torch eager with the same weights, and one batch, at `threads`."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    reference = case.make()
    args = case.batch(torch.Generator().manual_seed(seed))
    return ORTModule(copy.deepcopy(reference), threads=threads), reference, args


def measure(case: Case, threads: int = 2, reps: int | None = None, seed: int = 0) -> Result:
    """Step and forward times of ORTModule and torch eager on the same weights and batch, and their
    saved bytes."""
    ort_model, reference, args = _pair(case, threads, seed)
    reps = reps or case.steps
    steps = [stepper(ort_model, args), stepper(reference, args)]
    forwards = [forwarder(ort_model, args), forwarder(reference, args)]
    interleave(steps + forwards, WARMUP)
    step_times = interleave(steps, reps)
    # what the steps kept, before forwards alone (a fused session pauses after forwards without backward)
    fused = any(s.runs_fused for s in ort_model.training_sessions())
    stash = ort_stash_bytes(ort_model, args)
    fwd_times = interleave(forwards, reps)
    timings = [Timing(statistics.median(s), statistics.median(f), _quantiles(s), reps)
               for s, f in zip(step_times, fwd_times)]
    ratio = statistics.median(a / b for a, b in zip(*step_times))
    return Result(case.name, timings[0], timings[1], stash, torch_saved_bytes(reference, args), ratio, fused)


def step_ratio(case: Case, threads: int = 2, reps: int | None = None, seed: int = 0) -> dict[str, float]:
    """Step times alone (interleaved, medians) and their paired ratio: for the `shapes` part."""
    ort_model, reference, args = _pair(case, threads, seed)
    steps = [stepper(ort_model, args), stepper(reference, args)]
    interleave(steps, WARMUP)
    ort, eager = interleave(steps, reps or case.steps)
    return {"ort_step": statistics.median(ort), "torch_step": statistics.median(eager),
            "ratio": statistics.median(a / b for a, b in zip(ort, eager))}


class _Replay(torch.autograd.Function):
    """A custom Function handing back gradients made before the step: what torch itself costs per step for one
    such Function (the floor under ORTModule's overhead). The gradients are handed over, not kept, so
    AccumulateGrad steals them into `.grad` as it does ORTModule's (a kept one would be cloned: ~10 µs a
    parameter more than ORTModule ever pays)."""

    @staticmethod
    def forward(ctx, grads: list[tuple[torch.Tensor, ...]], *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.grads.pop())


_REPLAY = super(torch.autograd.Function, _Replay).apply
"""The C++ apply ORTModule calls too (`runtime.function._APPLY`), without `Function.apply`'s Python layer."""


def _bare_split(session: TrainingSession, feeds: dict[str, C.OrtValue]) -> Callable[[], float]:
    """The split sessions run on prepared OrtValues, the forward's stash fed straight to the backward."""
    backward = next(iter(session._backwards.values()))
    fwd, bwd = session._fwd, backward.runner
    assert bwd is not None
    one = exchange.to_ortvalue(torch.ones(()))
    grad_names = [e.name for e in backward.program.manifest.backward_inputs if e.role == "output_grad"]

    def bare() -> float:
        t0 = time.perf_counter()
        values = fwd.run(feeds, session._fwd_names)
        env = dict(zip(session._fwd_names, values))
        env.update(feeds)
        env.update((g, one) for g in grad_names)
        bwd.run({n: env[n] if n in env else backward.consts[n] for n in bwd.input_names}, backward.out_names)
        return time.perf_counter() - t0

    return bare


def bare_overhead(case: Case, threads: int = 2, reps: int | None = None) -> dict[str, float]:
    """ORTModule's step against its onnxruntime runs made directly on prepared OrtValues (the split sessions',
    or the fused one's): what the Python side adds per step; `autograd` is torch's
    own share of it (a custom Function returning precomputed gradients, no onnxruntime)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = ORTModule(case.make(), threads=threads)
    args = case.batch(torch.Generator().manual_seed(0))
    step = stepper(model, args)
    step()
    session = model.training_sessions()[0]
    loss = model(*args)
    feeds = dict(loss.grad_fn.call.feeds)
    if session.runs_fused and session._fused is not None:  # one run does both (runtime/fused.py)
        fused = session._fused

        def bare() -> float:
            t0 = time.perf_counter()
            fused.run(feeds)
            return time.perf_counter() - t0
    else:
        bare = _bare_split(session, feeds)

    params = _params(model)

    def replay() -> float:
        for p in params:
            p.grad = None
        grads = [tuple(torch.zeros_like(p) for p in params)]
        t0 = time.perf_counter()
        _REPLAY(grads, *params).backward()
        return time.perf_counter() - t0

    del loss
    interleave([step, bare, replay], WARMUP)
    times = interleave([step, bare, replay], reps or case.steps)
    a, b, c = (statistics.median(t) for t in times)
    return {"ortmodule": a, "bare": b, "overhead": a - b, "autograd": c}
