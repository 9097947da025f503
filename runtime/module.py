"""ORTModule: a drop-in nn.Module that trains its wrapped module on stock onnxruntime.

ORTModule shares the wrapped module's parameter, buffer and child dicts instead of holding it as a
child, so it *is* the module as far as torch is concerned: `named_parameters()`, `state_dict()` keys,
`load_state_dict()`, optimizers, `.to()` and `train()/eval()` see exactly the module's own names and
tensors (`ORTModule(m).state_dict()` loads into `m` and back). Its `forward` has the module's
signature. Each call is exported once per schema (see `engine`) and runs through an autograd
Function whose forward and backward are onnxruntime sessions.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.nn.utils import parametrize

from .engine import Engine, FallbackWarning, Options, ORTModuleError, default_save_dir, memory_pattern_pays
from .export import ExportOptions, exporting
from .session import TrainingSession

__all__ = ["FallbackWarning", "ORTModule", "ORTModuleError"]


_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def _forward(self: ORTModule, *args: Any, **kwargs: Any) -> Any:
    if type(self) is not ORTModule and parametrize.is_parametrized(self):
        raise ORTModuleError(f"ORTModule({type(self._original).__name__}) is parametrized itself "
                             f"({', '.join(self.parametrizations)}: torch.nn.utils.parametrize changes the wrapper's "
                             "class, which the wrapped module's forward never reads). Parametrize the wrapped module "
                             "instead, e.g. parametrizations.weight_norm(model.module), before or after wrapping.")
    if torch._C._is_tracing() or exporting() or torch.compiler.is_compiling():
        return _traced_call(self, args, kwargs)
    return self._engine(args, kwargs)


def _traced_call(self: ORTModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call some tracer sees. An export (torch.onnx.export of a model holding an ORTModule, an ORTModule around
    one) traces the wrapped module, as the module it stands for; `torch.compile` runs the call on onnxruntime."""
    if torch.jit.is_tracing() or torch.compiler.is_exporting() or exporting():
        return self._original(*args, **kwargs)
    return _eager_call(self._engine, args, kwargs)


@torch.compiler.disable(reason="an ORTModule runs on onnxruntime between compiled graphs; compile without "
                                "fullgraph=True")
def _eager_call(engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call as it runs outside `torch.compile`: a module compiled around an ORTModule breaks its graph
    here, so dynamo never traces the export or the sessions (it failed inside the exporter)."""
    return engine(args, kwargs)


def _bind_forward(obj: ORTModule, module: nn.Module) -> None:
    """`forward` as a bound method whose signature is the module's own (`self` positional-only first)."""
    sig = inspect.signature(module.forward)
    fn = types.FunctionType(_forward.__code__, _forward.__globals__, "forward", None, _forward.__closure__)
    self_param = inspect.Parameter("_ortmodule_self", inspect.Parameter.POSITIONAL_ONLY)
    fn.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])  # type: ignore[attr-defined]
    fn.__doc__ = module.forward.__doc__
    fn.__qualname__ = f"ORTModule({type(module).__name__}).forward"
    bound = types.MethodType(fn, obj)
    object.__setattr__(obj, "forward", bound)
    object.__setattr__(obj, "_own_forward", bound)


_DISTRIBUTED = ("DistributedDataParallel", "FullyShardedDataParallel")


def _refuse_distributed_wrappers(module: nn.Module) -> None:
    """DistributedDataParallel's forward broadcasts buffers and prepares the gradients' reduction at each call,
    in Python: no graph can hold that (the trace failed, "Tried to trace ... ProcessGroup"). Wrapped the other way,
    DDP(ORTModule(model)), it reduces the gradients ORTModule leaves in param.grad, as torch's."""
    for name, m in module.named_modules():
        if type(m).__name__ in _DISTRIBUTED:
            raise TypeError(f"ORTModule cannot export {name or 'the module'}, a {type(m).__name__}: its forward "
                            "synchronises buffers and prepares the gradients' reduction at each call, which a graph "
                            f"cannot do. Wrap it the other way: {type(m).__name__}(ORTModule(model)).")


class ORTModule(nn.Module):
    """Train `module` on onnxruntime with PyTorch semantics (autograd, optimizers, state_dict).

    exporter: "torchscript" (default, fast, keeps BatchNorm/Dropout training semantics) or "dynamo"; a module
        whose first export meets an operator the legacy exporter cannot translate is exported by dynamo (warned).
    fallback: run calls that cannot be exported or differentiated in PyTorch, with a FallbackWarning,
        instead of raising ORTModuleError. threads: the most onnxruntime intra-op threads (default: torch's);
        a model whose forward is small for its batch runs on one until a batch makes it big (`workload`).
    specialise: build backwards specialised to the outputs that receive gradients.
    save_onnx: directory receiving the exported, training, forward and backward ONNX files of every
        schema (default: the GRADBUILDER_SAVE_ONNX environment variable).
    park_torch_threads: while an onnxruntime run on 2+ threads lasts, torch's OpenMP workers that are spinning
        after its last parallel op sleep instead of sharing the cores (`runtime.openmp`); False leaves them be.
    torch_dropout: draw training Dropouts' masks with torch's own generator and kernel, as torch's dropout does: the
        same masks as the module run in torch from the same generator state, so a training run with dropout
        tracks torch's (from `torch.manual_seed`) instead of drawing other masks of the same law, and so do
        randn_like, rand_like, bernoulli_(p), normal_(mean, std), uniform_(a, b) and exponential_(rate) (a VAE's
        sample, drop_path, noise, gumbel_softmax; `runtime.torch_draws`); the masks then cost ~3x the default
        draws, and a forward more runs at each new set of input sizes (to learn their shapes). Other random ops
        keep onnxruntime's draws.
    check_export: compare onnxruntime's outputs of each call that exports, and its first gradients, with
        torch's for the same call (that call's Dropout masks drawn as torch's; skipped where the graph draws
        other random numbers, or onnxruntime draws the masks itself (Dropouts in If or Loop bodies, rates not
        constant), and where the forward changes state in place), and fail as a failed export does where they
        differ (`runtime/checks.py`: wrong conversions, in-place changes through views the tracer misses); and
        export again at each export's second call, failing where the graph differs (values the trace kept as
        constants). False skips them.
    """

    def __init__(self, module: nn.Module, *, exporter: str = "torchscript", opset: int | None = None,
                 fallback: bool = False, threads: int | None = None, specialise: bool = True,
                 save_onnx: str | os.PathLike | None = None, park_torch_threads: bool = True,
                 check_export: bool = True, torch_dropout: bool = False):
        if isinstance(module, ORTModule):
            raise TypeError("the module is already an ORTModule")
        _refuse_distributed_wrappers(module)
        super().__init__()
        options = Options(ExportOptions(exporter, opset, check_export, torch_dropout),
                          threads if threads is not None else torch.get_num_threads(), specialise, fallback,
                          default_save_dir(save_onnx), park_torch_threads, memory_pattern_pays(module))
        object.__setattr__(self, "_options", options)
        self._share(module)
        _bind_forward(self, module)

    def _share(self, module: nn.Module) -> None:
        object.__setattr__(self, "_original", module)
        object.__setattr__(self, "_engine", Engine(module, self._options))
        self.__dict__.update(_parameters=module._parameters, _buffers=module._buffers, _modules=module._modules,
                             _non_persistent_buffers_set=module._non_persistent_buffers_set)
        # the module's own state_dict hooks run for the wrapper, which stands for it (a key-renaming shim, metadata
        # added, unexpected keys cleared on load): torch runs those of each module object it walks
        self.__dict__.update({name: getattr(module, name) for name in _STATE_DICT_HOOKS})
        self.training = module.training

    # --- the wrapped module ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped PyTorch module (same parameters and buffers)."""
        return self._original

    @property
    def stats(self) -> dict[str, int]:
        """Counters: exports (one per schema), builds (one per set of tensors requiring grad), fallbacks."""
        return self._engine.stats

    def training_sessions(self) -> list[TrainingSession]:
        """The TrainingSessions built so far (one per schema and set of tensors requiring grad)."""
        return self._engine.sessions()

    def reset(self) -> None:
        """Forget every export and session (after replacing submodules, for instance)."""
        object.__setattr__(self, "_engine", Engine(self._original, self._options))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """The wrapped module's attributes are set on it (`model.tau = 0.5`: its forward reads its own), as its
        parameters, buffers and submodules already are (their dicts are shared); the wrapper's own state stays."""
        if "_original" not in self.__dict__ or name in self.__dict__ or hasattr(type(self), name):
            super().__setattr__(name, value)
            if name == "training":  # `model.training = False`, as `train()` does: the forward reads its own
                self._original.training = value
        else:
            setattr(self._original, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__ or "_original" not in self.__dict__:
            super().__delattr__(name)
        else:
            delattr(self._original, name)

    # containers (nn.Sequential, nn.ModuleList) keep their indexing; dunders bypass __getattr__
    def __getitem__(self, index: Any) -> Any:
        return self._original[index]

    def __len__(self) -> int:
        return len(self._original)

    def __iter__(self) -> Any:
        return iter(self._original)

    def __bool__(self) -> bool:
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """torch's call (`nn.Module.__call__` into `_call_impl`), in one frame where it would only call `forward`:
        not compiled (`module.compile()`), no hooks on the wrapper nor global backward ones, not traced, `forward` not
        replaced. Two Python frames fewer a step (each step's Python runs with cold caches between torch's work)."""
        if (self._compiled_call_impl is None and self.__dict__.get("forward") is self._own_forward
                and not self._hooked() and not torch._C._get_tracing_state()):
            return _forward(self, *args, **kwargs)
        return super().__call__(*args, **kwargs)

    def _hooked(self) -> bool:
        """Whether torch's call has hooks to run around the wrapper's: its own, or global backward ones."""
        return bool(self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
                    or nn_module._global_backward_pre_hooks or nn_module._global_backward_hooks)

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """torch's call without its global forward hooks (`register_module_forward_hook`) for the wrapper: they run
        for the wrapped module inside the call, as torch runs them for it, and a hook changing outputs changed the
        result twice. Where the wrapper has hooks of its own, torch's call runs them (and the global ones) around."""
        if self._hooked():
            return super()._call_impl(*args, **kwargs)
        return (self._slow_forward if torch._C._get_tracing_state() else self.forward)(*args, **kwargs)

    def apply(self, fn: Callable[[nn.Module], None]) -> ORTModule:
        """`fn` on the wrapped module and its submodules, as torch's walks a module: an initializer matching the
        module's own class (`isinstance(m, Net)`, a wrapped nn.Linear) never met it behind the wrapper."""
        self._original.apply(fn)
        return self

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
                      ) -> Iterator[tuple[str, nn.Module]]:
        """The wrapped module's, which stands in the wrapper's place: `for m in model.modules(): if isinstance(m,
        nn.Linear): init(m)` never met a wrapped nn.Linear. The parameters and buffers are the same."""
        return self._original.named_modules(memo, prefix, remove_duplicate)

    def train(self, mode: bool = True) -> ORTModule:
        super().train(mode)
        self._original.train(mode)
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> ORTModule:
        super()._apply(fn, recurse)
        self._engine.invalidate()
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self._original._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._original._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"module={type(self._original).__name__}, exporter={self._engine.options.export.exporter!r}"

    # --- pickling and deepcopy: sessions are not copyable, they are rebuilt on demand --------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_engine", None)
        state.pop("forward", None)
        state.pop("_own_forward", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_engine", Engine(self._original, self._options))
        _bind_forward(self, self._original)
