"""runtime/forward_hooks.py: the user's forward hooks run at each call on onnxruntime's values, as torch runs them
(they ran only while exporting, on the export's tensors: a feature-matching loss read stale activations, or failed
with "backward through the graph a second time"); what they cannot follow is refused, naming the hook's tensor."""

from __future__ import annotations

import collections
import copy
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from runtime import ExportWarning, FallbackWarning, ORTModule, ORTModuleError


class Hooked(nn.Module):
    """A conv followed by an in-place ReLU (a hook's stored reference to the conv's output reads the ReLU's values
    by the end of the forward), a layer called twice, a GRU (a tuple output), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.act = nn.ReLU(inplace=True)
        self.a, self.shared, self.head = nn.Linear(12, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.rnn = nn.GRU(6, 6, batch_first=True)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.act(self.conv(x)).flatten(1)
        h = self.shared(self.shared(torch.tanh(self.a(h)))) * scale
        r, _ = self.rnn(h.unsqueeze(1).repeat(1, 2, 1))
        return self.head(r[:, -1])


def _hook_everything(model: nn.Module, store: dict[str, Any], seen: list[tuple[str, torch.Tensor]]) -> None:
    """Hooks as users write them: recording into a dict, a list, a module attribute; a pre-hook on the input; one
    with keyword arguments; one changing the output besides recording; a global one."""
    model.conv.register_forward_hook(lambda m, args, out: store.__setitem__("conv", out))
    model.conv.register_forward_pre_hook(lambda m, args: store.__setitem__("x", args[0]))
    model.shared.register_forward_hook(lambda m, args, out: seen.append(("shared", out)))  # pairs, as feature lists
    model.head.register_forward_hook(lambda m, args, kwargs, out: store.__setitem__("head", (args[0], out)),
                                     with_kwargs=True)
    model.rnn.register_forward_hook(lambda m, args, out: store.__setitem__("state", out[1]))

    def doubled(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        store["a"] = out
        return out * 2

    def kept(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        m.features = out.detach()

    model.a.register_forward_hook(doubled)
    model.head.register_forward_hook(kept)


def _loss(y: torch.Tensor, store: dict[str, Any], seen: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return (y.square().sum() + store["conv"].square().mean() + store["x"].sin().sum() + store["head"][0].cos().sum()
            + store["state"].sum() + store["a"].pow(2).sum() + sum(t.square().mean() for _, t in seen))


def _train(model: Hooked, exporter: str | None) -> list[tuple[dict[str, torch.Tensor], torch.Tensor, list]]:
    """An evaluation call, then three training steps of `model` (through ORTModule with `exporter` unless None):
    what the hooks recorded, the input's and the parameters' gradients at each."""
    store: dict[str, Any] = {}
    seen: list[tuple[str, torch.Tensor]] = []
    by_module: dict[str, torch.Tensor] = {}
    names = {m: n for n, m in model.named_modules()}
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, args, out: by_module.__setitem__(names[m], out) if m in names else None)
    try:
        run = ORTModule(model, exporter=exporter) if exporter else model
        _hook_everything(model, store, seen)
        opt = torch.optim.SGD(run.parameters(), lr=0.05)
        results = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", ExportWarning)  # nothing warned: no hook is left out
            with torch.no_grad():
                run(torch.ones(4, 1, 4, 4), scale=0.5)  # exported, then again for training
            for step in range(3):
                seen.clear()
                opt.zero_grad()
                x = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(step)).requires_grad_()
                y = run(x, scale=0.5)
                _loss(y, store, seen).backward()
                values = {"conv": store["conv"], "a": store["a"], "features": model.head.features,
                          "shared": by_module["shared"], "head": by_module["head"],
                          "seen": torch.stack([t for _, t in seen])}
                results.append(({k: v.detach().clone() for k, v in values.items()}, x.grad.clone(),
                                [p.grad.clone() for p in model.parameters()]))
                opt.step()
    finally:
        handle.remove()
    return results


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_forward_hooks_run_at_each_call_on_onnxruntime_s_values(exporter: str) -> None:
    torch.manual_seed(0)
    model = Hooked()
    want = _train(copy.deepcopy(model), None)
    for step, (got, expected) in enumerate(zip(_train(model, exporter), want)):
        for name in expected[0]:
            torch.testing.assert_close(got[0][name], expected[0][name], msg=f"step {step}: {name}")
        torch.testing.assert_close(got[1], expected[1], msg=f"step {step}: input gradient")
        for g, w in zip(got[2], expected[2]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=f"step {step}: parameter gradient")


def test_forward_hooks_whose_tensors_cannot_be_followed_are_refused() -> None:
    """A gradient hook put on a hooked tensor (Grad-CAM) would see only the gradient from outside the module, and
    a tensor changed in place by the hook would be changed twice: refused, naming them; with fallback, torch's."""
    def grad_cam(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        grads["conv"] = None
        out.register_hook(lambda g: grads.__setitem__("conv", g))

    grads: dict[str, torch.Tensor | None] = {}
    torch.manual_seed(0)
    model = Hooked()
    ref = copy.deepcopy(model)
    for m in (model, ref):  # as pytorch-grad-cam: the activation kept by one hook, its gradient by another
        m.conv.register_forward_hook(lambda mod, args, out: grads.__setitem__("activation", out))
        m.conv.register_forward_hook(grad_cam)
    x = torch.randn(2, 1, 4, 4)
    with pytest.raises(ORTModuleError, match=r"gradient hook or retain_grad\(\) is on hooked.conv"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        ORTModule(copy.deepcopy(model))(x)
    om = ORTModule(model, fallback=True)
    with pytest.warns(FallbackWarning, match="forward hooks"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        om(x).sum().backward()
    got = grads["conv"]
    ref(x).sum().backward()
    torch.testing.assert_close(got, grads["conv"])

    store: dict[str, torch.Tensor] = {}  # retain_grad() after the call: the backward refuses
    model = Hooked()
    model.conv.register_forward_hook(lambda m, args, out: store.__setitem__("conv", out))
    y = ORTModule(model)(x)
    store["conv"].retain_grad()
    with pytest.raises(RuntimeError, match=r"gradient hook or retain_grad\(\) is on hooked.conv"):
        (y.sum() + store["conv"].sum()).backward()

    def clamped(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.clamp_(-0.1, 0.1)

    model = Hooked()
    model.a.register_forward_hook(clamped)
    with pytest.raises(ORTModuleError, match="changed a tensor it received in place"):
        ORTModule(model)(x)


def test_a_forward_hook_returning_a_value_where_it_did_not_exports_again() -> None:
    """An ablation switched on in the hook's closure after the export: the graph held the export's None (the replay
    drops what hooks return), so the ablation never took effect. The replay sees the change and exports again."""
    switch = {"on": False}

    def ablated(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        return out * 0 if switch["on"] else None

    torch.manual_seed(0)
    model = Hooked()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.a.register_forward_hook(ablated)
    om, x = ORTModule(model), torch.randn(2, 1, 4, 4)
    for _ in range(2):  # the export, and the second call's (exported again, the same graph)
        torch.testing.assert_close(om(x), ref(x))
    switch["on"] = True
    with pytest.warns(ExportWarning, match=r"a forward hook on a returned a value where it returned None"):
        got = om(x)
    torch.testing.assert_close(got, ref(x))
    torch.testing.assert_close(om(x), ref(x))


def test_an_error_the_forward_raises_at_its_export_is_torch_s() -> None:
    """A pre-hook refusing a batch (an input-range check) at the call that exports: torch raises its ValueError for
    that batch only, and a training loop catching it goes on. The export wrapped it as a failed export: the error
    is now the forward's own, and the next call exports."""
    def in_range(m: nn.Module, args: tuple) -> None:
        if args[0].abs().max() > 10:
            raise ValueError("input out of range")

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.register_forward_pre_hook(in_range)
    om = ORTModule(model)
    with pytest.raises(ValueError, match="input out of range"):
        om(torch.full((3, 4), 100.0))
    x = torch.randn(3, 4)
    torch.testing.assert_close(om(x), model(x))
    with pytest.raises(ValueError, match="input out of range"):  # run again at each call, on onnxruntime's values
        om(torch.full((3, 4), 100.0))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_hook_removing_itself_runs_once(exporter: str) -> None:
    """A one-shot hook (log a shape, then remove its handle) removed itself during the export: the second call's
    re-export lacked its output and was refused as a trace keeping values, and the replay would have run it at every
    call. It runs at the call that met it, as torch's, and the module is exported again without it."""
    def run(wrap: bool) -> list:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        shapes: list = []

        def once(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            shapes.append(tuple(out.shape))
            handle.remove()

        handle = net[0].register_forward_hook(once)
        model = ORTModule(net, exporter=exporter) if wrap else net
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
        return shapes

    assert run(True) == run(False) == [(3, 8)]


def test_a_hook_failing_on_dynamo_s_fake_tensors_is_named() -> None:
    """A hook branching on its tensor's values runs on dynamo's fake tensors while exporting, and fails there: the
    export's error named neither the hook nor why."""
    def guarded(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.abs().max() > 10:
            raise ValueError("activations out of range")

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].register_forward_hook(guarded)
    with pytest.raises(ORTModuleError, match=r"a forward hook on 0 failed while exporting.*dynamo's are fake"):
        ORTModule(model, exporter="dynamo")(torch.randn(3, 4))


def test_a_statistic_a_hook_rebinds_is_no_fake_tensor_under_dynamo() -> None:
    """`st["dead"] = st["dead"] + ...` ran on dynamo's fake tensors while exporting: the dict kept a FakeTensor,
    which every replay built on (no values; `.tolist()` failed). It holds the torch run's tensor instead, and each
    later call adds torch's count (the export's runs count too, as for any statistic a hook keeps)."""
    st = {"dead": torch.zeros(8)}

    def count(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        st["dead"] = st["dead"] + (out <= 0).float().sum(0)

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[1].register_forward_hook(count)
    om, x = ORTModule(model, exporter="dynamo"), torch.randn(5, 4)
    om(x)
    assert type(st["dead"]) is torch.Tensor
    before = st["dead"].clone()
    om(x)
    torch.testing.assert_close(st["dead"] - before, (model[:2](x) <= 0).float().sum(0))


_CALLS = 0
"""A module-level counter a hook bumps through `global`."""


class _Monitor(nn.Module):
    """A feature extractor holding its statistics, its hook a bound method (no submodules of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.means: list[float] = []
        self.calls = 0

    def hook(self, m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.calls += 1
        self.means.append(float(out.detach().mean()) if not _fake(out) else 0.0)


def _fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_what_hooks_keep_counts_each_call_once(exporter: str) -> None:
    """Hooks counting calls and summing statistics (monitoring dead units, activation means) also counted the
    export's runs of the forward, which happen at the first call, at the second (checked on its values) and at each
    new batch size: 5 counts for 3 calls. The state they reach is put back after those runs: a nonlocal and a global
    counter, a dict, a defaultdict of lists, a plain object, a module's attribute, a bound method's object, a
    one-shot hook and a running sum changed in place."""
    def run(wrap: bool) -> list[Any]:
        global _CALLS
        _CALLS = 0
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        count = 0
        store: dict[str, Any] = {"n": 0, "sum": torch.zeros(())}
        per = collections.defaultdict(list)
        stats = types.SimpleNamespace(dead=0)
        monitor = _Monitor()

        def counting(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            nonlocal count
            global _CALLS
            count += 1
            _CALLS += 1
            store["n"] += 1
            per["relu"].append(tuple(out.shape))
            if not _fake(out):
                stats.dead += int((out == 0).all(0).sum())
                if exporter == "torchscript":  # dynamo: a real tensor cannot take a fake one in place
                    store["sum"] += out.detach().sum()

        def tagged(m: nn.Module, args: tuple) -> None:
            m.seen = getattr(m, "seen", 0) + 1

        def once(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
            per["once"].append(tuple(out.shape))
            handle.remove()

        net[1].register_forward_hook(counting)
        net[2].register_forward_pre_hook(tagged)
        net[2].register_forward_hook(monitor.hook)
        handle = net[0].register_forward_hook(once)
        model = ORTModule(net, exporter=exporter) if wrap else net
        for batch in (5, 5, 3, 3):
            model(torch.randn(batch, 4)).sum().backward()
        with torch.no_grad():
            model.eval()(torch.randn(2, 4))
        return [count, _CALLS, store["n"], dict(per), stats.dead, net[2].seen, monitor.calls,
                [float(store["sum"]), *monitor.means]]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(True)
    want = run(False)
    assert got[:-1] == want[:-1] and got[-1] == pytest.approx(want[-1], rel=1e-5)
    assert got[0] == 5 and got[3]["once"] == [(5, 8)]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_global_forward_hooks_run_once_per_module(exporter: str) -> None:
    """A global forward hook (`register_module_forward_hook`: a FLOP counter, an output rescaling) runs for each
    module of the wrapped one, as torch runs it, and not once more for the ORTModule: one that doubled every
    output doubled the result twice, and counters saw a module torch never calls."""
    from torch.nn.modules import module as nn_module

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    ref, om = copy.deepcopy(net), ORTModule(net, exporter=exporter)
    seen: list[str] = []

    def hook(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        seen.append(type(m).__name__)
        return out * 2.0

    handle = nn_module.register_module_forward_hook(hook)
    try:
        x = torch.randn(4, 6)
        for _ in range(3):
            seen.clear()
            want, calls = ref(x), list(seen)
            seen.clear()
            torch.testing.assert_close(om(x), want)
            assert seen == calls == ["Linear", "Tanh", "Linear", "Sequential"]
    finally:
        handle.remove()
