"""TrainingSession: run a gradbuilder training graph as forward and backward on onnxruntime.

Forward returns the module outputs and a `ForwardState` holding the stashed tensors as OrtValues;
backward takes that state and the output gradients (None allowed, PyTorch's `None`) and returns
the `wrt` gradients. Sessions are created once and cached.

Backward specialisation: the forward always runs the full build (every differentiable output
selected), because which outputs will get gradients is only known at backward time. Backward is
cached per subset of outputs that actually receive a gradient: the first time a subset is seen, the
gradient graph is rebuilt with `outputs=` that subset and its forward-side helpers are aligned with
the full forward (see `programs.specialise`), so an output whose gradient is always None costs no
backward work. If a subset's backward would read a tensor the full forward does not stash, that
subset uses the full backward with scalar zeros (full-shape zeros for `full_shape_outputs`) for the
missing gradients, and returns gradients only for the tensors the subset reaches (torch's `None`).

One run for a loss: where the only differentiable output is a scalar, calls after the first run forward and
backward joined (`fused`), keep the gradients instead of the stash, and backward scales them by the output's
gradient.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnxruntime.capi import _pybind_state as C

import gradbuilder
from gradbuilder.errors import InvalidModelError

from . import checks, declared, exchange, fused, halves, lowering, passes, samples
from .exchange import Tensor
from .host_dropout import Kept, MaskedRunner, Redraw
from .ort_session import BACKWARD_DISABLED_OPTIMIZERS, Runner, SessionConfig
from .programs import BuildSpec, Program, forward_source, from_training, spec_from_metadata, specialise
from .recompute import recompute_checkpointed, region_masks

ModelLike = onnx.ModelProto | str | os.PathLike | bytes


@dataclass
class ForwardState:
    """One forward's values that backward may read: its feeds and forward outputs, as OrtValues."""

    values: dict[str, C.OrtValue]
    outputs: list[C.OrtValue]
    as_torch: bool
    released: bool = False
    gradients: _Gradients | None = None
    """A fused run's gradients (`fused`), kept instead of a stash."""
    redraw: Redraw | Kept | None = None
    """The forward's Dropout masks and fills (None where none was drawn): drawn again where the host drew them, else
    as onnxruntime drew them (the first call at new sizes). Those left out of `values` (of checkpointed regions),
    and the numbers a create_graph backward's recompute in torch must draw (`replay`)."""
    halved: halves.Halved | None = None
    """A forward run as two halves of the batch (`halves.SplitHalves`): each half's values, instead of `values`."""
    timed: tuple[int, bool, float] | None = None
    """The forward's arm and time, for the trial of halves against the whole batch the backward completes."""
    zero_like: dict[str, C.OrtValue] | None = None
    """The feeds of the `wrt` tensors torch may give zeros (`TrainingSession.zero_gradients`): their shapes."""

    def release(self) -> None:
        """Drop the stash (like torch freeing saved tensors after backward)."""
        self.values = {}
        self.gradients = None
        self.redraw = None
        self.halved = None
        self.zero_like = None
        self.released = True


@dataclass
class _Gradients:
    """The gradients a fused run computed for a host gradient of 1: `values[first:]`, one per `wrt`."""

    values: halves.Values
    first: int
    wrt: list[str]
    unused: list[int]
    """The session's count of fused runs in a row whose gradients nobody took (`fused.MAX_UNUSED`), shared."""
    taken: bool = False

    def __del__(self) -> None:
        if not self.taken:
            self.unused[0] += 1

    def nbytes(self) -> int:
        return sum(exchange.nbytes(self.values[i]) for i in range(self.first, len(self.values)))

    def scaled(self, g: Tensor, as_torch: bool, copy: bool) -> dict[str, Any]:
        """wrt -> gradient times the host's scalar g (an OrtValue, or the torch tensor autograd gave), as torch
        tensors or OrtValues: the values themselves when g is 1, unless `copy` (a backward that will run again must
        not hand out what it keeps)."""
        self.taken = True
        self.unused[0] = 0
        vals, k = self.values, self.first
        host = g if isinstance(g, torch.Tensor) else exchange.to_torch(g)
        # a scalar's gradient: one element, read by torch (a LeNet step: 40 µs through numpy's DLPack, which the
        # caches the runs leave made 10x its 3 µs warm)
        one = host.item() == 1
        grads: list[Any]
        if as_torch:
            grads = exchange.vector_to_torch(vals)[k:]
            if not one:
                factor = host.reshape(())
                grads = [t * factor for t in grads]
            elif copy:
                grads = [t.clone() for t in grads]
        elif one and not copy:
            grads = [exchange.to_ortvalue(vals[i]) for i in range(k, len(vals))]
        else:
            scale = host.detach().numpy().reshape(())
            grads = [exchange.to_ortvalue(exchange.to_numpy(vals[i]) * scale) for i in range(k, len(vals))]
        return dict(zip(self.wrt, grads))


@dataclass
class _Backward:
    """A backward session for one subset of outputs receiving gradients, with its feed plan precomputed."""

    program: Program
    runner: Runner | None
    grads: dict[str, str]
    """wrt tensor -> backward output name, restricted to the tensors this subset reaches."""
    consts: dict[str, C.OrtValue] = field(default_factory=dict)
    specialised: bool = True
    lowered: onnx.ModelProto | None = None
    """The graph its runner runs (the halves' sessions run it too)."""

    def __post_init__(self) -> None:
        man = self.program.manifest
        self.out_names = [e.name for e in man.backward_outputs]
        index = {n: i for i, n in enumerate(self.out_names)}
        self.results = [(w, index[g]) for w, g in self.grads.items()]
        # the feed plan, by where each backward input comes from
        self.fixed = {e.name: self.consts[e.name] for e in man.backward_inputs
                      if e.role == "initializer" and e.name in self.consts}
        """Constant feeds (initializers backward reads), the same every step."""
        self.from_grads = [(e.name, e.output_index, e.full_shape) for e in man.backward_inputs
                           if e.role == "output_grad"]
        self.from_state = [e.name for e in man.backward_inputs
                           if e.role != "output_grad" and e.name not in self.fixed]


@dataclass
class _Fused:
    """The session running forward and backward at once (`fused`), its output names (the module's, then the
    gradients of `wrt`)."""

    runner: Runner | MaskedRunner
    names: list[str]
    wrt: list[str]
    random_ops: bool
    """Whether the graph draws random numbers other than host-masked Dropouts (onnxruntime seeds those per session)."""
    halves: halves.Halves | None = None
    """Its runs as two halves of the batch at once, where they pay (`halves`)."""
    checked: bool = False

    def reproducible(self, feeds: Mapping[str, C.OrtValue]) -> bool:
        """Whether a split run of the same call draws the same random numbers (`TrainingSession._composition_check`):
        no random ops of onnxruntime's, the Dropouts' masks drawn on the host."""
        return not self.random_ops and (not isinstance(self.runner, MaskedRunner)
                                        or self.runner.mask_shapes(feeds) is not None)

    def run(self, feeds: Mapping[str, C.OrtValue]) -> halves.Values:
        if self.halves is not None:
            return self.halves.run(feeds, self.whole)
        return self.whole(feeds)

    def whole(self, feeds: Mapping[str, C.OrtValue]) -> halves.Values:
        """The run of the whole batch."""
        if isinstance(self.runner, Runner):
            return self.runner.run_vector(feeds, self.names)
        return self.runner.run(feeds, self.names)


def _backward_constants(program: Program) -> dict[str, np.ndarray]:
    """The values of the forward's initializers that the backward reads (fed to it as constants)."""
    inits = {t.name: t for t in program.forward.graph.initializer}
    return {e.name: onnx.numpy_helper.to_array(inits[e.name])
            for e in program.manifest.backward_inputs if e.role == "initializer" and e.name in inits}


def _drew(runner: Runner | MaskedRunner) -> Redraw | Kept | None:
    """The draws of the call `runner` ran last, taken as the call returns: the runner keeps none after (`Kept`
    holds onnxruntime's masks, which only the call's ForwardState may hold, until its backward)."""
    if not isinstance(runner, MaskedRunner):
        return None
    drew, runner.drew = runner.drew, None
    return drew


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


class TrainingSession:
    """Forward and backward of a training graph on two cached onnxruntime sessions.

    `TrainingSession(training)` takes a graph made by `gradbuilder build` (ModelProto, bytes or path);
    `from_split(forward, backward, manifest)` takes its split files; `from_forward(model, wrt=...)` builds
    the training graph itself. Inputs may be numpy arrays, torch tensors or OrtValues; outputs are
    torch tensors if any input was one, else numpy arrays, in both cases sharing onnxruntime's memory.
    """

    def __init__(self, training: ModelLike, *, threads: int | None = None, specialise: bool = True,
                 config: SessionConfig | None = None, save_dir: str | os.PathLike | None = None):
        model = gradbuilder.load_model(training)
        config = config or SessionConfig(threads=threads)
        source = forward_source(model)  # before the shrink adds forward-side masks
        if config.shrink:
            model = _copy(model)
            passes.shrink_stash(model, torch_masks=config.torch_dropout_outputs)
        self._setup(source, spec_from_metadata(model), from_training(model), config, specialise, save_dir)

    @classmethod
    def from_forward(cls, model: ModelLike, *, wrt: Sequence[str] | None = None,
                     outputs: Sequence[str] | None = None, loss: str | None = None, freeze: Sequence[str] = (),
                     threads: int | None = None, specialise: bool = True, config: SessionConfig | None = None,
                     save_dir: str | os.PathLike | None = None, rows: int | None = None) -> TrainingSession:
        """Build the training graph of a forward model and run it. `rows`: the batch it will mostly run at, where
        the model leaves the batch symbolic (the runtime's rewrites choose layouts by it)."""
        exported = gradbuilder.load_model(model)
        config = config or SessionConfig(threads=threads)
        source = lowering.source(exported, config, rows)
        training = gradbuilder.build_gradient_graph(source, wrt=wrt, outputs=outputs, loss=loss, freeze=freeze)
        recomputes = bool(recompute_checkpointed(training, config.torch_dropout_outputs)) if config.shrink else False
        masks = region_masks(training) if recomputes else frozenset()
        if config.shrink:
            passes.shrink_stash(training, wait=recomputes, torch_masks=config.torch_dropout_outputs)
        self = cls.__new__(cls)
        self._setup(source, spec_from_metadata(training), from_training(training), config, specialise, save_dir, rows)
        self._in_graph_order = recomputes
        self._redrawn = masks & set(self.full.manifest.stashed)
        self._exported = exported
        return self

    @classmethod
    def from_split(cls, forward: ModelLike, backward: ModelLike, manifest: gradbuilder.Manifest | str | os.PathLike,
                   *, threads: int | None = None, specialise: bool = True, config: SessionConfig | None = None,
                   save_dir: str | os.PathLike | None = None) -> TrainingSession:
        """Run the files written by `gradbuilder split` (manifest: a Manifest, its JSON text or a path)."""
        if not isinstance(manifest, gradbuilder.Manifest):
            text = str(manifest)
            if not text.lstrip().startswith("{"):
                text = Path(manifest).read_text(encoding="utf-8")
            manifest = gradbuilder.Manifest.from_json(text)
        fwd, bwd = gradbuilder.load_model(forward), gradbuilder.load_model(backward)
        self = cls.__new__(cls)
        self._setup(forward_source(fwd, manifest.module_outputs), spec_from_metadata(fwd),
                    Program(fwd, bwd, manifest), config or SessionConfig(threads=threads), specialise, save_dir)
        return self

    def _setup(self, source: onnx.ModelProto, spec: BuildSpec, full: Program, config: SessionConfig,
               specialise: bool, save_dir: str | os.PathLike | None, rows: int | None = None) -> None:
        other = next((o for o in source.graph.output if o.type.WhichOneof("value") not in (None, "tensor_type")), None)
        if other is not None:  # DLPack and torch exchange tensors only
            raise InvalidModelError(
                f"graph output '{other.name}' is a {other.type.WhichOneof('value').removesuffix('_type')}, not a "
                "tensor: TrainingSession exchanges tensors only. Leave it out of the graph outputs (or take its "
                "elements out as tensors, SequenceAt), or run the split halves with onnxruntime itself.")
        self.source = source
        self.spec = spec
        self.full = full
        self.config = config
        self._redrawn: frozenset[str] = frozenset()
        """The masks of Dropouts inside checkpointed regions: not kept by the forward where the host drew them
        (`ForwardState.redraw`)."""
        self._in_graph_order = False
        """Whether backward runs in graph order (`SessionConfig.graph_order`): where it recomputes checkpointed
        regions, which onnxruntime's default order would all run first."""
        self.specialise = specialise
        self.save_dir = Path(save_dir) if save_dir is not None else None
        man = full.manifest
        self.input_names: list[str] = list(man.forward_inputs)
        self.output_names: list[str] = list(man.module_outputs)
        self.differentiable: tuple[int, ...] = tuple(sorted(
            e.output_index for e in man.backward_inputs if e.role == "output_grad"))  # type: ignore[misc]
        """The outputs whose gradients backward reads."""
        nondiff = set(man.non_differentiable_outputs)
        self._requiring_grad = frozenset(i for i in range(len(self.output_names)) if i not in nondiff)
        """The outputs torch differentiates: those too that only ops of derivative zero connect to `wrt`."""
        zero_of = man.zero_gradient_of
        self._zeros_of = {i: frozenset(zero_of[n]) for i, n in enumerate(self.output_names) if n in zero_of}
        self._loss_zeros = frozenset(zero_of.get(spec.loss, ())) if spec.loss is not None else frozenset()
        self._zero_names = self._loss_zeros.union(*self._zeros_of.values())
        self._zero_inits = {t.name: (tuple(t.dims), onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
                            for t in full.forward.graph.initializer if t.name in self._zero_names}
        """Shapes and dtypes of those held as initializers (not fed: the session API's constants)."""
        read = {e.name for e in man.backward_inputs if e.role == "stash"}
        self.stashed_outputs: tuple[int, ...] = tuple(i for i, n in enumerate(self.output_names) if n in read)
        """Module outputs backward reads: a caller modifying them in place would corrupt the gradients."""
        self.read_inputs: tuple[str, ...] = tuple(e.name for e in man.backward_inputs if e.role == "input")
        """Graph inputs backward reads (the same hazard, for the caller's input tensors)."""
        self._roles: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._fwd = self._forward_runner()
        self._fwd_names = full.forward_outputs
        self._infer: Runner | MaskedRunner | None = None
        self._backwards: dict[frozenset[int], _Backward] = {}
        self.stats = {"backward_builds": 0, "fallbacks": 0}
        self._outputs_checked = False
        """Whether a forward's outputs were checked against their declared shapes (`declared`), at the first."""
        self._fusing: bool | None = None if config.fuse and self._fusable() else False
        """Whether forward runs the backward too (`fused`): None until the first forward's stash decides."""
        self._fused: _Fused | None = None
        self._unused = [0]
        self._paused = 0
        """While fused runs are paused (`fused.MAX_UNUSED`): split backwards since, counting up to resuming."""
        self.rows = rows
        """The batch the caller expects to run at mostly (`from_forward`), for layout choices in the backward."""
        self._split: halves.SplitHalves | None = None
        """Split steps as two halves of the batch (`halves.SplitHalves`), where they may pay; decided at the first
        split forward after the first call (`_split_decided`)."""
        self._split_decided = False
        self._exported: onnx.ModelProto | None = None
        """The forward as given to `from_forward`, before the runtime's rewrites: where `samples` proves it computes
        sample by sample (`_rows`), steps may run as two halves of the batch (`halves`)."""
        if self.save_dir is not None:
            self._save(full, "")

    def reconfigure(self, config: SessionConfig) -> None:
        """Run with another SessionConfig from the next call on (ORTModule raises its thread count when the
        batch grows): new onnxruntime sessions, the backward ones rebuilt when first needed. Forward states
        already made stay valid (they hold OrtValues, not sessions)."""
        self.config = config
        self._fwd = self._forward_runner()
        self._infer = None
        self._backwards.clear()
        self._fused = None
        self._split, self._split_decided = None, False

    def _forward_runner(self) -> Runner | MaskedRunner:
        return lowering.forward_runner(self.full.forward, self.config, "forward")

    def draw_masks_as_torch(self, state: torch.Tensor) -> bool:
        """Whether the next forward's random numbers are all drawn from torch's generator at `state` as torch draws
        them (Dropout masks, and the fills the export tagged: randn_like, rand, bernoulli_;
        `MaskedRunner.draws_as_torch`): its outputs are then torch's for that RNG state, which the first call's
        check compares. Not where onnxruntime draws any (unmasked Dropouts, untagged random ops), nor without
        `torch_masks` where the next forward runs fused (`forward_ortvalues`: a session an earlier export made,
        whose joined runner draws its own). Split halves cut their masks from `_fwd`'s draws of the whole batch."""
        if not isinstance(self._fwd, MaskedRunner) or not self._fwd.draws_as_torch:
            return False
        if self._fusing and not self._paused:  # decided as the forward would
            return self.config.torch_masks
        self._fwd.torch_once = state
        return True

    @property
    def draws_random(self) -> bool:
        """Whether a forward draws random numbers (Dropout masks, torch's fills, onnxruntime's random ops)."""
        return isinstance(self._fwd, MaskedRunner) or self._fwd.draws_random

    def replay_problem(self, state: ForwardState) -> str | None:
        """Why torch's module computing the call of `state` again (a create_graph backward) could not draw the
        random numbers its forward drew, or None where it can (none drawn, or the masked runner's, each one torch
        draws with one of its fills: `replay`)."""
        if not self.draws_random or (state.redraw is not None and state.redraw.runner.draws_as_torch):
            return None
        return ("onnxruntime drew some of them (random ops inside If or Loop bodies, Dropouts of a ratio computed at "
                "run time, or functions torch draws with other kernels than its fills: randint, rrelu, cauchy_, "
                "log_normal_). Call the module in eval mode, or take the gradients without create_graph.")

    # --- public API ------------------------------------------------------------------------------
    @property
    def wrt(self) -> list[str]:
        """Tensors that get gradients from the full backward, in build order."""
        return list(self.full.gradients)

    @property
    def runs_fused(self) -> bool:
        """Whether the next training forward runs the backward too (`fused`: decided at the first call, paused while
        forwards end without a backward)."""
        return bool(self._fusing) and not self._paused

    @property
    def backwards(self) -> dict[tuple[str, ...], tuple[Program, bool]]:
        """Backward programs built so far, keyed by the outputs that received gradients, with whether each is
        specialised to them (False: the full backward fed zeros). For inspection and tests."""
        return {tuple(self.output_names[i] for i in sorted(k)): (b.program, b.specialised)
                for k, b in self._backwards.items()}

    def forward(self, inputs: Mapping[str, Tensor] | Sequence[Tensor]) -> tuple[list[Tensor], ForwardState]:
        """Run forward, stashing what backward reads. Returns (module outputs, state)."""
        feeds, as_torch = self._feeds(inputs)
        outs, state = self.forward_ortvalues(feeds, as_torch)
        return [self._convert(v, as_torch) for v in outs], state

    def backward(self, state: ForwardState, output_grads: Mapping[str, Tensor | None] | Sequence[Tensor | None],
                 *, retain: bool = False) -> dict[str, Tensor]:
        """Gradients of the `wrt` tensors, given the gradients of the module outputs (None: no gradient).

        Returns {wrt tensor: gradient} for the tensors the given gradients reach, zeros (as torch's) for those
        reached only through ops of derivative zero (`zero_gradients`); `retain` keeps the state for another
        backward.
        """
        if isinstance(output_grads, Mapping):
            unknown = set(output_grads) - set(self.output_names)
            if unknown:
                raise KeyError(f"not module outputs: {sorted(unknown)}; outputs are {self.output_names}")
            grads: list[Tensor | None] = [output_grads.get(n) for n in self.output_names]
        else:
            grads = list(output_grads)
            if len(grads) != len(self.output_names):
                raise ValueError(f"expected {len(self.output_names)} output gradients (None for none), "
                                 f"got {len(grads)}")
        ort_grads = [None if g is None else exchange.to_ortvalue(g) for g in grads]
        result = self.backward_ortvalues(state, ort_grads, retain=retain)
        return {w: self._convert(v, state.as_torch) for w, v in result.items()}

    def zero_gradients(self, grads: Sequence[object | None]) -> frozenset[str]:
        """The `wrt` tensors whose gradient torch gives as zeros for these output gradients (None: none) where
        backward computes none for them (`backward` fills them): connected to the outputs given gradients only
        through ops of derivative zero (Round, Sign; a parameter quantized without a straight-through estimator)."""
        if not self._zeros_of:
            return self._loss_zeros
        return self._loss_zeros.union(*[z for i, z in self._zeros_of.items() if grads[i] is not None])

    def output_roles(self, n_user: int, values: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Of a forward's `values` whose first `n_user` are the caller's: the positions torch must see as not
        differentiable (as torch's: outputs that depend on nothing receiving gradients, such as an input passed
        through or a detached result; ints; BatchNorm statistics), and those to save for backward (outputs backward
        reads share memory with the stash: saving them lets torch detect in-place changes). Found once per
        `n_user` (the outputs' dtypes are the graph's)."""
        roles = self._roles.get(n_user)
        if roles is None:
            fixed = tuple(k for k, t in enumerate(values)
                          if k >= n_user or k not in self._requiring_grad or not t.is_floating_point())
            roles = self._roles[n_user] = fixed, tuple(i for i in self.stashed_outputs if i < n_user)
        return roles

    def run(self, inputs: Mapping[str, Tensor] | Sequence[Tensor]) -> list[Tensor]:
        """Inference: forward only, on the forward graph itself; nothing is stashed."""
        feeds, as_torch = self._feeds(inputs)
        return [self._convert(v, as_torch) for v in self.run_ortvalues(feeds)]

    # --- OrtValue-level API (no conversions; what ORTModule uses) -------------------------------
    def forward_ortvalues(self, feeds: Mapping[str, C.OrtValue], as_torch: bool = True
                          ) -> tuple[list[C.OrtValue], ForwardState]:
        outs, state = self._forward(feeds, as_torch)
        if self._zero_names:
            state.zero_like = {w: feeds[w] for w in self._zero_names if w in feeds}
        return outs, state

    def _forward(self, feeds: Mapping[str, C.OrtValue], as_torch: bool) -> tuple[list[C.OrtValue], ForwardState]:
        if self._fusing and not self._paused:
            return self._fused_forward(feeds, as_torch)
        try:
            if self._split_decided and self._split is None:  # decided against halves: the whole batch, two frames fewer
                outs, state = self._whole_forward(feeds, as_torch)
            else:
                outs, state = self._split_forward(feeds, as_torch)
        except RuntimeError as e:
            problem = None if self._outputs_checked else declared.run_failure(e)
            if problem is not None:
                raise problem from e
            raise
        if not self._outputs_checked:
            declared.check_outputs(self.source.graph, feeds, self.output_names, outs)
            self._outputs_checked = True
        if self._fusing is None:
            self._fusing = self._gradient_bytes(feeds) <= fused.MAX_KEPT * self.stash_bytes(state)
        return outs, state

    def backward_ortvalues(self, state: ForwardState, grads: Sequence[Tensor | None], *,
                           retain: bool = False, as_torch: bool = False) -> dict[str, Any]:
        """Gradients as OrtValues, or as torch tensors on their memory with `as_torch`. `grads`: OrtValues or torch
        tensors, made OrtValues only where a run reads them (a fused run's gradients are only scaled: read from
        torch)."""
        if state.released:
            raise RuntimeError("backward through a ForwardState a second time: its stashed tensors were already "
                               "freed; pass retain=True to the first backward to keep them.")
        if state.gradients is None:  # a run to feed: OrtValues (a torch tensor's memory shared through DLPack)
            grads = [None if g is None else exchange.to_ortvalue(g) for g in grads]
        timed, state.timed = state.timed, None
        like = state.zero_like
        start = time.perf_counter()
        if state.halved is not None:
            result = self._halved_backward(state, grads, retain, as_torch)
        else:
            result = self._backward_run(state, grads, retain, as_torch)
        if timed is not None and self._split is not None:
            self._split.finish(timed, time.perf_counter() - start)
        if self._zero_names:  # torch's zeros, where only ops of derivative zero (Round, Sign) lead to the outputs
            for w in self.zero_gradients(grads):
                if w not in result:
                    result[w] = self._zeros(w, like or {}, as_torch)
        return result

    def _zeros(self, name: str, like: Mapping[str, C.OrtValue], as_torch: bool) -> Any:
        """Zeros of a `wrt` tensor's shape at this call: its feed's, or its initializer's."""
        fed = like.get(name)
        if fed is not None:
            return torch.zeros_like(exchange.to_torch(fed)) if as_torch else exchange.zeros_like(fed)
        zeros = np.zeros(*self._zero_inits[name])
        return torch.from_numpy(zeros) if as_torch else exchange.to_ortvalue(zeros)

    def _backward_run(self, state: ForwardState, grads: Sequence[Tensor | None], retain: bool, as_torch: bool
                      ) -> dict[str, Any]:
        given = frozenset([i for i in self.differentiable if grads[i] is not None])
        if state.gradients is not None:
            g = grads[self.differentiable[0]]
            result = {} if g is None else state.gradients.scaled(g, as_torch, copy=retain)
            if not retain:
                state.release()
            return result
        if not given and self.spec.loss is None:
            if not retain:
                state.release()
            return {}
        if self._paused:
            self._paused += 1
            if self._paused > fused.MAX_UNUSED:  # backwards came back: fused runs pay again
                self._paused, self._unused[0] = 0, 0
        bw = self._backwards.get(given) or self._backward_for(given)
        result: dict[str, Any] = {}
        if bw.runner is not None:
            vector = bw.runner.run_vector(self._backward_feeds(bw, state, grads), bw.out_names)
            values = exchange.vector_to_torch(vector) if as_torch else [vector[i] for i in range(len(vector))]
            result = {w: values[i] for w, i in bw.results}
        if not retain:
            state.release()
        return result

    def run_ortvalues(self, feeds: Mapping[str, C.OrtValue]) -> list[C.OrtValue]:
        if self._infer is None:
            self._infer = lowering.forward_runner(self.source, self.config, "inference")
        return self._infer.run(feeds, self.output_names)

    def stash_bytes(self, state: ForwardState) -> int:
        """Bytes a forward keeps for its backward beyond the caller's tensors: the stash of a split forward, the
        gradients of a fused one (each distinct buffer once)."""
        if state.gradients is not None:
            return state.gradients.nbytes()
        seen: set[int] = set()
        total = 0
        for values in ([state.values] if state.halved is None else state.halved.values):
            fed = {values[n].data_ptr() for n in self.input_names if n in values}
            for name in self.full.manifest.stashed:
                v = values.get(name)
                if v is None or name in self.input_names:
                    continue
                ptr = v.data_ptr()
                if ptr not in seen and ptr not in fed:
                    seen.add(ptr)
                    total += v.tensor_size_in_bytes()
        return total

    # --- internals ----------------------------------------------------------------------------------
    def _fusable(self) -> bool:
        """One differentiable module output, a scalar (a loss), and no `loss` seeded in the graph."""
        if self.spec.loss is not None or len(self.differentiable) != 1:
            return False
        name = self.output_names[self.differentiable[0]]
        vi = next((o for o in self.full.forward.graph.output if o.name == name), None)
        t = vi.type.tensor_type if vi is not None else None
        return t is not None and t.HasField("shape") and len(t.shape.dim) == 0

    def _gradient_bytes(self, feeds: Mapping[str, C.OrtValue]) -> int:
        inits = {t.name: t for t in self.full.forward.graph.initializer}
        total = 0
        for w in self.full.gradients:
            if w in feeds:
                total += feeds[w].tensor_size_in_bytes()
            elif w in inits:
                total += onnx.numpy_helper.to_array(inits[w]).nbytes
        return total

    def _split_forward(self, feeds: Mapping[str, C.OrtValue], as_torch: bool
                       ) -> tuple[list[C.OrtValue], ForwardState]:
        split = self._split_halves()
        if split is None:
            return self._whole_forward(feeds, as_torch)
        outs, state, halved, timed = split.forward(feeds, lambda masks: self._whole_forward(feeds, as_torch, masks),
                                                   self._halves_mismatch)
        if state is None:
            state = ForwardState({}, outs, as_torch, halved=halved, redraw=_drew(self._fwd))
        state.timed = timed
        return outs, state

    def _split_halves(self) -> halves.SplitHalves | None:
        """The split steps' halves (`halves.SplitHalves`), made at the first split forward after the first call
        decided against fusing, where the exported forward computes its loss sample by sample (`samples`), runs may
        use two threads, and the backward has nothing the halves would draw or recompute differently."""
        if self._split_decided or self._fusing is None:
            return self._split
        self._split_decided = True
        if (self._fusing or not self.config.split_batch or self._exported is None or not self.differentiable
                or self._fwd.draws_random or self._redrawn or self._in_graph_order
                or not halves.convolutional(self._exported)):
            return None
        proven = self._rows
        if proven is None:
            return None
        covered = {name for name, _ in proven.outputs} | ({proven.loss.output} if proven.loss else set())
        bw = self._backward_for(frozenset(self.differentiable))
        if (covered != set(self.output_names) or bw.runner is None or bw.lowered is None or bw.runner.draws_random
                or not bw.specialised):
            return None
        self._split = halves.SplitHalves(self.full.forward, bw.lowered, self._backward_config(), proven, self._fwd,
                                         self._fwd_names, self.output_names, bw.out_names,
                                         [i for w, i in bw.results if w in proven.batched])
        return self._split

    @functools.cached_property
    def _rows(self) -> samples.Rows | None:
        """Whether the exported forward computes sample by sample (`samples.proven`), proved once for the fused and
        the split halves alike."""
        return samples.proven(self._exported) if self._exported is not None else None

    def _half_feeds(self, bw: _Backward, values: dict[str, C.OrtValue], grads: list[C.OrtValue | None]
                    ) -> dict[str, C.OrtValue]:
        """A half's backward feeds: its forward's values, its share of the outputs' gradients."""
        return self._backward_feeds(bw, ForwardState(values, [values[n] for n in self.output_names], True), grads)

    def _halved_backward(self, state: ForwardState, grads: Sequence[C.OrtValue | None], retain: bool, as_torch: bool
                         ) -> dict[str, Any]:
        assert state.halved is not None and self._split is not None
        result: dict[str, Any] = {}
        if any(grads[i] is not None for i in self.differentiable):
            bw = self._backward_for(frozenset(self.differentiable))
            together = self._split.backward(state.halved, grads, lambda values, g: self._half_feeds(bw, values, g))
            result = {w: together[i] if as_torch else exchange.to_ortvalue(together[i]) for w, i in bw.results}
        if not retain:
            state.release()
        return result

    def _halves_mismatch(self, outs: list[C.OrtValue], state: ForwardState, half_outs: list[C.OrtValue],
                         halved: halves.Halved) -> str | None:
        """The first halves (forward, and backward for gradients of ones) against the whole batch's: where they
        differ, how (`checks`); None where they agree."""
        seeds: list[C.OrtValue | None] = [None] * len(outs)
        for i in self.differentiable:
            seeds[i] = exchange.to_ortvalue(torch.ones_like(exchange.to_torch(outs[i])))
        want = self._backward_run(state, seeds, retain=True, as_torch=True)
        got = self._halved_backward(ForwardState({}, half_outs, True, halved=halved), seeds, retain=False,
                                    as_torch=True)
        names = [w for w in want if w in got]
        return (checks.mismatch([exchange.to_torch(v) for v in half_outs], [exchange.to_torch(v) for v in outs])
                or checks.gradients_mismatch([got[w] for w in names], [want[w] for w in names]))

    def _whole_forward(self, feeds: Mapping[str, C.OrtValue], as_torch: bool,
                       masks: dict[str, C.OrtValue] | None = None) -> tuple[list[C.OrtValue], ForwardState]:
        """The forward of the whole batch (`masks`: its Dropouts' masks, drawn already)."""
        if masks is not None and isinstance(self._fwd, MaskedRunner):  # the halves' `fresh` set `drew`
            values = self._fwd.run_drawn(feeds, masks, self._fwd_names)
        else:
            values = self._fwd.run(feeds, self._fwd_names)
        redraw = _drew(self._fwd)
        env = dict(feeds)
        env.update(zip(self._fwd_names, values))
        outs = [env[n] for n in self.output_names]
        if redraw is not None and self._redrawn:  # a checkpointed region's masks are drawn again for backward
            for name in self._redrawn:
                env.pop(name, None)
        return outs, ForwardState(env, outs, as_torch, redraw=redraw)

    def _fused_forward(self, feeds: Mapping[str, C.OrtValue], as_torch: bool
                       ) -> tuple[list[C.OrtValue], ForwardState]:
        if self._unused[0] >= fused.MAX_UNUSED:  # forwards whose backward never comes: split until one does
            self._unused[0], self._paused = 0, 1
            return self.forward_ortvalues(feeds, as_torch)
        rng = torch.random.get_rng_state() if self._fused is None or not self._fused.checked else None
        try:
            one = self._fused or self._make_fused(feeds)
            values = one.run(feeds) if one is not None else None
        except RuntimeError as e:  # onnxruntime refusing the joined graph: the split runs are the same math
            warnings.warn(f"the forward and backward joined in one onnxruntime run failed, so they run as two: {e}",
                          RuntimeWarning, stacklevel=2)
            one = values = None
        if one is None or values is None:
            self._fusing = False
            return self.forward_ortvalues(feeds, as_torch)
        k = len(self.output_names)
        outs = [exchange.to_ortvalue(values[i]) for i in range(k)]  # OrtValues, as a split forward's outputs
        if rng is not None:
            one.checked = True
            split = self._composition_check(one, feeds, values, rng, as_torch)
            if split is not None:
                return split
        return outs, ForwardState({}, outs, as_torch, gradients=_Gradients(values, k, one.wrt, self._unused),
                                  redraw=_drew(one.runner))

    def _composition_check(self, one: _Fused, feeds: Mapping[str, C.OrtValue],
                           values: halves.Values, rng: torch.Tensor, as_torch: bool
                           ) -> tuple[list[C.OrtValue], ForwardState] | None:
        """The first fused run against the split runs of the same call (the host's Dropout masks drawn again from
        the same generator state): the joined graph is the composition of the halves, which the first call's checks
        compared with torch, but onnxruntime optimizes across their boundary. None where they agree; else a
        warning, split runs from then on, and this call's split forward (its state kept for the backward)."""
        if not one.reproducible(feeds):
            return None
        after = torch.random.get_rng_state()
        torch.random.set_rng_state(rng)
        try:
            outs, state = self._whole_forward(feeds, as_torch)
        finally:
            torch.random.set_rng_state(after)
        index = self.differentiable[0]
        seeds: list[C.OrtValue | None] = [None] * len(self.output_names)
        seeds[index] = exchange.to_ortvalue(np.ones((), dtype=exchange.to_numpy(outs[index]).dtype))
        split = self.backward_ortvalues(state, seeds, retain=True, as_torch=True)
        k = len(outs)
        ours = exchange.vector_to_torch(values)
        want = [split.get(w) for w in one.wrt]
        got = [g for g, w in zip(ours[k:], want) if w is not None]
        problem = (checks.mismatch(ours[:k], [exchange.to_torch(v) for v in outs])
                   or checks.gradients_mismatch(got, [w for w in want if w is not None]))
        if problem is None:
            state.release()
            return None
        warnings.warn(f"onnxruntime's run of forward and backward joined differs from the two runs it joins "
                      f"({problem}), so they run as two from now on; please report it with the module.",
                      RuntimeWarning, stacklevel=3)
        self._fusing = False
        return outs, state

    def _make_fused(self, feeds: Mapping[str, C.OrtValue]) -> _Fused | None:
        """The joined graph's runner, and its halves (their sessions pinned to the halves of `feeds`' batch)."""
        program, man = self.full, self.full.manifest
        grads = program.gradients
        if not grads:
            return None
        seed = next(e.name for e in man.backward_inputs if e.role == "output_grad")
        arrays = _backward_constants(program)
        backward = lowering.backward(program.backward, arrays, self.config, self.rows, program.forward)
        model = fused.fused_model(lowering.forward(program.forward, self.config), backward, self.output_names, seed,
                                  arrays, list(grads.values()))
        if model is None:
            return None
        runner = lowering.fused_runner(model, backward, self._backward_config(), self._fwd)
        if self.config.torch_masks and runner.draws_random:  # Dropouts onnxruntime draws (the joined graph has an If)
            return None
        names = [o.name for o in model.graph.output]
        self._fused = _Fused(runner, names, list(grads), runner.draws_random,
                             self._halves(model, backward, runner, names, list(grads),
                                          {n: tuple(v.shape()) for n, v in feeds.items()}))
        if self.save_dir is not None:
            gradbuilder.save_model_atomic(model, self.save_dir / "fused.onnx")
        return self._fused

    def _halves(self, model: onnx.ModelProto, backward: onnx.ModelProto, runner: Runner | MaskedRunner,
                names: list[str], wrt: list[str], batch: dict[str, tuple[int, ...]]) -> halves.Halves | None:
        """The fused graph's runs as two halves of the batch (`halves`), where the exported forward computes its loss
        sample by sample (`samples`), runs may use two threads, and onnxruntime draws no random numbers (the host's
        Dropout masks are cut); None otherwise. `names`: the fused outputs, the module's then the gradients of
        `wrt`; `batch`: the call's input sizes, whose halves the halves' sessions are pinned to."""
        config = self._backward_config()
        if not config.split_batch or self._exported is None or runner.draws_random:
            return None
        proven = self._rows
        if proven is None or proven.loss is None or proven.outputs:
            return None
        try:
            first = len(names) - len(wrt)
            joined = [i for i, w in enumerate(wrt, first) if w in proven.batched]
            return halves.Halves(model, backward, config, runner, self._fwd, proven, names, first, joined, batch)
        except RuntimeError:  # onnxruntime refusing a half's session: the whole batch's run serves on
            return None

    def _feeds(self, inputs: Mapping[str, Tensor] | Sequence[Tensor]) -> tuple[dict[str, C.OrtValue], bool]:
        if not isinstance(inputs, Mapping):
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise ValueError(f"expected {len(self.input_names)} inputs {self.input_names}, got {len(inputs)}")
            inputs = dict(zip(self.input_names, inputs))
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise KeyError(f"missing inputs {missing}; the model's inputs are {self.input_names}")
        as_torch = any(exchange.is_torch(v) for v in inputs.values())
        return {n: exchange.to_ortvalue(v) for n, v in inputs.items()}, as_torch

    @staticmethod
    def _convert(v: C.OrtValue, as_torch: bool) -> Any:
        return exchange.to_torch(v) if as_torch else exchange.to_numpy(v)

    def _backward_for(self, given: frozenset[int]) -> _Backward:
        bw = self._backwards.get(given)
        if bw is None:
            bw = self._make_backward(given)
            self._backwards[given] = bw
        return bw

    def _make_backward(self, given: frozenset[int]) -> _Backward:
        program, specialised = self.full, given == frozenset(self.differentiable)
        if self.specialise and not specialised:
            self.stats["backward_builds"] += 1
            outputs = [self.output_names[i] for i in sorted(given)]
            candidate = specialise(self.source, self.spec, outputs, self.full, self.config.shrink,
                                   self.config.torch_dropout_outputs)
            if candidate.missing_stash(self.full):
                self.stats["fallbacks"] += 1
                grads = {w: g for w, g in self.full.gradients.items() if w in candidate.gradients}
                return self._backward(self.full, grads, specialised=False)
            program, specialised = candidate, True
            if self.save_dir is not None:
                self._save(program, "_" + "_".join(str(i) for i in sorted(given)))
        return self._backward(program, program.gradients, specialised=specialised)

    def _backward_config(self) -> SessionConfig:
        return replace(self.config, graph_order=True) if self._in_graph_order else self.config

    def _backward(self, program: Program, grads: dict[str, str], *, specialised: bool) -> _Backward:
        arrays = _backward_constants(program)
        consts = {name: exchange.to_ortvalue(a) for name, a in arrays.items()}
        runner, lowered = None, None
        if grads and program.manifest.backward_outputs:
            lowered = lowering.backward(program.backward, arrays, self.config, self.rows, program.forward)
            runner = Runner(lowered, self._backward_config(), "backward", BACKWARD_DISABLED_OPTIMIZERS)
        return _Backward(program, runner, grads, consts, specialised, lowered if runner is not None else None)

    def _backward_feeds(self, bw: _Backward, state: ForwardState, grads: Sequence[C.OrtValue | None]
                        ) -> dict[str, C.OrtValue]:
        feeds = dict(bw.fixed)
        values = state.values
        if state.redraw is not None and self._redrawn:  # a checkpointed region's masks, drawn again
            values = {**values, **state.redraw([n for n in bw.from_state if n not in values])}
        for name in bw.from_state:
            feeds[name] = values[name]
        for name, index, full_shape in bw.from_grads:
            g = grads[index]
            if g is None:
                out = state.outputs[index]
                g = exchange.zeros_like(out) if full_shape else exchange.scalar_zero(out.element_type())
            feeds[name] = g
        return feeds

    def _save(self, program: Program, suffix: str) -> None:
        assert self.save_dir is not None
        if program.training is not None:
            gradbuilder.save_model_atomic(program.training, self.save_dir / f"training{suffix}.onnx")
        if not suffix:
            gradbuilder.save_model_atomic(program.forward, self.save_dir / "forward.onnx")
        gradbuilder.save_model_atomic(program.backward, self.save_dir / f"backward{suffix}.onnx")
        (self.save_dir / f"manifest{suffix}.json").write_text(program.manifest.to_json(), encoding="utf-8")
