"""runtime.ORTModule against torch eager: argument and output structures, gradients landing like torch,
export caching, grad modes, train/eval, state_dict, errors and fallback."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import gc
import inspect
import io
import pickle
import re
import threading
import types
import warnings
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn
from torch.autograd import forward_ad as fwAD
from torch.nn import functional as F
from torch.nn.utils import prune
from torch.utils.checkpoint import checkpoint

from gradbuilder.rules import registry
from runtime import ExportWarning, FallbackWarning, ORTModule, ORTModuleError, checks
from runtime import export as export_module
from runtime.export import _split_sequences_to_slices

torch.manual_seed(0)


def pair(module: nn.Module, **kw) -> tuple[nn.Module, ORTModule]:
    """(torch reference, ORTModule) from the same initial weights."""
    ref = copy.deepcopy(module)
    return ref, ORTModule(module, **kw)


def assert_grads_equal(a: nn.Module, b: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: {p.grad is None} vs torch {q.grad is None}"
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# --- arguments ------------------------------------------------------------------------------------------
class Mixed(nn.Module):
    """Positional, keyword, default, *args and **kwargs inputs; a non-tensor flag."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y=None, *extra, scale: float = 2.0, shift=None, **named):
        h = self.fc(x) * scale
        if y is not None:
            h = h + y
        for e in extra:
            h = h * e
        if shift is not None:
            h = h - shift
        for key in sorted(named):
            h = h + named[key].sum()
        return h


def test_signature_is_the_modules() -> None:
    m = Mixed()
    om = ORTModule(m)
    assert inspect.signature(om.forward) == inspect.signature(m.forward)
    assert inspect.signature(ORTModule(MLP()).forward) == inspect.signature(MLP().forward)


@pytest.mark.parametrize("call", [
    lambda x, y: ((x,), {}),
    lambda x, y: ((x, y), {}),
    lambda x, y: ((x,), {"y": y, "scale": 0.5}),
    lambda x, y: ((x, y, y.sigmoid(), y.tanh()), {"shift": y}),
    lambda x, y: ((x,), {"shift": y, "extra_a": y, "extra_b": y * 2}),
], ids=["positional", "two-positional", "keyword", "varargs", "kwargs"])
def test_argument_kinds_match_torch(call) -> None:
    ref, om = pair(Mixed())
    x = torch.randn(5, 4, requires_grad=True)
    y = torch.randn(5, 3)
    args, kwargs = call(x, y)
    out = om(*args, **kwargs)
    expected = ref(*args, **kwargs)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    out.backward(g)
    xg = x.grad.clone()
    x.grad = None
    expected.backward(g)
    assert_grads_equal(om, ref)
    torch.testing.assert_close(xg, x.grad)


def test_inputs_requiring_grad_get_grad() -> None:
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, a, b):
            return (a * self.w + b.exp()).sum()

    ref, om = pair(Two())
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    om(a, b).backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    ref(a, b).backward()
    torch.testing.assert_close(ga, a.grad)
    torch.testing.assert_close(gb, b.grad)
    assert_grads_equal(om, ref)
    c = torch.randn(2, 3)  # not requiring grad: a different session, no gradient for it
    om(a, c).backward()
    assert c.grad is None


def test_parameterless_module() -> None:
    class Gate(nn.Module):
        def forward(self, x, y):
            return torch.softmax(x, -1) * torch.tanh(y)

    om = ORTModule(Gate())
    x, y = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    g = torch.randn(3, 5)
    om(x, y).backward(g)
    gx, gy = x.grad, y.grad
    x.grad = y.grad = None
    (torch.softmax(x, -1) * torch.tanh(y)).backward(g)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gy, y.grad)
    assert list(om.parameters()) == []


# --- outputs --------------------------------------------------------------------------------------------
Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class ModelOutput(OrderedDict):
    """Hugging Face style: a dataclass that is also an OrderedDict of its non-None fields."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: tuple | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return {
            "pair": Pair(h, [h.relu(), 3]),
            "out": ModelOutput(logits=h * 2, hidden=(h, h.sum())),
            "label": "constant",
            "none": None,
        }


def test_nested_outputs_keep_their_structure() -> None:
    ref, om = pair(Nested())
    x = torch.randn(2, 4)
    out, expected = om(x), ref(x)
    assert out.keys() == expected.keys()
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].second, list)
    assert out["pair"].second[1] == 3 and out["label"] == "constant" and out["none"] is None
    assert isinstance(out["out"], ModelOutput) and list(out["out"].keys()) == ["logits", "hidden"]
    assert out["out"].loss is None and isinstance(out["out"].hidden, tuple)
    torch.testing.assert_close(out["out"].logits, expected["out"].logits)
    torch.testing.assert_close(out["pair"].second[0], expected["pair"].second[0])
    (out["out"].logits.sum() + out["out"].hidden[1]).backward()
    (expected["out"].logits.sum() + expected["out"].hidden[1]).backward()
    assert_grads_equal(om, ref)


@dataclass
class Scores:
    """A field computed in __post_init__ (init=False): rebuilding passed it to the constructor (a TypeError)."""

    logits: torch.Tensor
    probs: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.probs = self.logits.softmax(-1)


def test_dataclass_outputs_with_fields_outside_init() -> None:
    class WithScores(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> Scores:
            return Scores(self.fc(x))

    ref, om = pair(WithScores())
    x = torch.randn(5, 3)
    out, want = om(x), ref(x)
    assert type(out) is Scores
    torch.testing.assert_close(out.probs, want.probs)
    out.probs[:, 0].sum().backward()
    want.probs[:, 0].sum().backward()
    assert_grads_equal(om, ref)


class WithMasks(nn.Module):
    """Float, bool, int and float outputs: non-differentiable ones in the middle."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        return h.tanh(), h > 0, h.argmax(-1), (h * h).mean()


def test_non_differentiable_outputs_in_the_middle() -> None:
    ref, om = pair(WithMasks())
    x = torch.randn(5, 4)
    a, mask, idx, b = om(x)
    ea, emask, eidx, eb = ref(x)
    assert mask.dtype == torch.bool and idx.dtype == torch.int64
    assert not mask.requires_grad and not idx.requires_grad
    torch.testing.assert_close(mask, emask)
    torch.testing.assert_close(idx, eidx)
    (a.sum() * 3 + b).backward()
    (ea.sum() * 3 + eb).backward()
    assert_grads_equal(om, ref)


class ThreeHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.score = nn.Linear(8, 3)
        self.aux_head = nn.Linear(8, 5)

    def forward(self, x, target):
        h = torch.relu(self.body(x))
        scores = self.score(h)
        loss = nn.functional.cross_entropy(scores, target)
        return loss, scores, self.aux_head(h).sigmoid()


def test_multi_output_aux_gradient_is_never_materialised() -> None:
    ref, om = pair(ThreeHeads())
    x, t = torch.randn(7, 6), torch.randint(0, 3, (7,))
    loss, scores, aux = om(x, t)
    assert aux.requires_grad  # differentiable, it just receives no gradient in this backward
    (loss + scores.sum()).backward()
    eloss, escores, _ = ref(x, t)
    (eloss + escores.sum()).backward()
    assert_grads_equal(om, ref)
    assert om.aux_head.weight.grad is None and ref.aux_head.weight.grad is None  # torch: None, not zeros
    (session,) = om.training_sessions()
    (outputs, (program, specialised)), = session.backwards.items()
    assert specialised and "output.2" not in outputs
    aux_index = session.output_names.index("output.2")
    assert all(e.output_index != aux_index for e in program.manifest.backward_inputs if e.role == "output_grad")
    assert session.stats["fallbacks"] == 0


def test_gradients_accumulate_until_zeroed() -> None:
    ref, om = pair(MLP())
    x1, x2 = torch.randn(3, 8), torch.randn(5, 8)
    for m in (om, ref):
        m(x1).sum().backward()
        m(x2).pow(2).mean().backward()
    assert_grads_equal(om, ref)
    om.zero_grad()
    assert all(p.grad is None for p in om.parameters())


def test_retain_graph_like_torch() -> None:
    ref, om = pair(MLP())
    x = torch.randn(3, 8)
    out = om(x).sum()
    out.backward(retain_graph=True)
    out.backward()  # the stash survived the first backward
    expected = ref(x).sum()
    expected.backward(retain_graph=True)
    expected.backward()
    assert_grads_equal(om, ref)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


class Critic(nn.Module):
    """A smooth critic (Softplus, LayerNorm, a BatchNorm in training) for gradient penalties."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 16), nn.Softplus(), nn.LayerNorm(16), nn.Linear(16, 8),
                                 nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_create_graph_gives_gradients_that_differentiate_again_as_torch_s() -> None:
    """backward(create_graph=True) computes the call again in torch (warned once), so the gradients have a graph:
    a WGAN-GP penalty ((|d critic / dx| - 1)^2) and a physics-informed loss (the Laplacian of u(x), through two
    create_graph gradients) train the parameters as torch's do, in float64; the BatchNorm statistics are updated
    once a call, as in torch; jacobians (vectorized too: a batch of gradients under vmap) and hessians are
    torch's; an input changed in place before such a backward is refused."""
    torch.manual_seed(0)
    ref = Critic().double()
    om = ORTModule(copy.deepcopy(ref))
    for step in range(2):
        x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
        for m in (ref, om):
            m.zero_grad()
            (g,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
            penalty = (g.norm(dim=1) - 1).square().mean()
            lap = sum(torch.autograd.grad(g[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(3))
            (penalty + lap.square().mean() + m(x).mean()).backward()
        assert_grads_equal(om, ref, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(om.module.net[4].running_mean, ref.net[4].running_mean, rtol=1e-9, atol=1e-12)
        assert int(om.module.net[4].num_batches_tracked) == int(ref.net[4].num_batches_tracked) == 2 * (step + 1)
    om.eval()
    ref.eval()
    x = torch.randn(2, 3, dtype=torch.float64)
    for vectorize in (False, True):  # a vectorized jacobian's backward gets a batch of gradients under vmap
        torch.testing.assert_close(torch.autograd.functional.jacobian(om, x, vectorize=vectorize),
                                   torch.autograd.functional.jacobian(ref, x), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.autograd.functional.hessian(lambda v: om(v).square().sum(), x),
                               torch.autograd.functional.hessian(lambda v: ref(v).square().sum(), x), rtol=1e-9,
                               atol=1e-12)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    out = om(x).sum()
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(RuntimeError, match="changed in place since the forward"):
        torch.autograd.grad(out, x, create_graph=True)


def test_second_order_meta_gradients_through_functional_call_follow_torch() -> None:
    """MAML: two inner steps' gradients taken with create_graph=True through torch.func.functional_call, fast
    weights from them, and the outer loss's backward through all the calls: the meta-gradients are torch's (a
    call is computed again with the weights it was fed, not the module's after functional_call swapped them
    back)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    om = ORTModule(copy.deepcopy(ref))
    x, y, x2, y2 = (torch.randn(5, k, dtype=torch.float64) for k in (3, 1, 3, 1))
    for m in (ref, om):
        fast = dict(m.named_parameters())
        for _ in range(2):  # the second step differentiates a call fed the first step's fast weights
            inner = F.mse_loss(torch.func.functional_call(m, fast, (x,)), y)
            grads = torch.autograd.grad(inner, list(fast.values()), create_graph=True)
            fast = {k: p - 0.1 * g for (k, p), g in zip(fast.items(), grads)}
        F.mse_loss(torch.func.functional_call(m, fast, (x2,)), y2).backward()
    assert_grads_equal(om, ref, rtol=1e-9, atol=1e-12)


def test_calls_under_torch_func_transforms_run_in_torch() -> None:
    """Per-sample gradients (vmap of grad over functional_call) and torch.func.grad: onnxruntime cannot compute on
    functorch's wrapped tensors (they failed with "Cannot access data pointer"), so such calls run in PyTorch,
    warned once; a plain call afterwards runs on onnxruntime again."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(5, 3)
    om(x)
    results = []
    for m in (ref, om):
        params = {k: v.detach() for k, v in m.named_parameters()}
        loss = lambda p, xi, m=m: torch.func.functional_call(m, p, (xi[None],)).square().sum()  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x))
        assert (m is om) == any(issubclass(w.category, FallbackWarning) for w in caught)
    for name, per_sample in results[0].items():
        torch.testing.assert_close(results[1][name], per_sample)
    exports = om.stats["exports"]
    om(x).sum().backward()
    assert om.stats["exports"] == exports and om.stats["fallbacks"] == 0


def test_forward_mode_ad_runs_in_torch() -> None:
    """Dual tensors (torch.autograd.forward_ad) went to onnxruntime through DLPack, which dropped their tangents:
    the output's tangent was None, silently. Such calls run in PyTorch, warned once."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    om = ORTModule(copy.deepcopy(ref))
    x, v = torch.randn(5, 3), torch.randn(5, 3)
    om(x)
    tangents = []
    for m in (ref, om):
        with fwAD.dual_level(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tangents.append(fwAD.unpack_dual(m(fwAD.make_dual(x, v))).tangent)
        assert (m is om) == any(issubclass(w.category, FallbackWarning) for w in caught)
    torch.testing.assert_close(tangents[1], tangents[0])


def test_create_graph_gradients_are_the_call_s_alone() -> None:
    """backward(create_graph=True) recomputes the call in torch and took its gradients with respect to the caller's
    tensors, which also took the paths reaching them outside the call, as the first-call check once did: `m(x, x)`
    got both positions' sum at each (a gradient penalty 15 off), and a parameter shared by two ORTModules got the
    first one's gradient twice. Each tensor is now differentiated through an alias of its own."""
    torch.manual_seed(0)
    ref, om = pair(Product())
    x = torch.randn(3, 4)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for m in (ref, om):
            leaf = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(m(leaf, leaf).tanh().square().sum(), leaf, create_graph=True)
            g.square().sum().backward()
            results.append((g.detach(), leaf.grad))
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        second.weight = first.weight
        ours = [ORTModule(copy.deepcopy(m)) for m in (first, second)]
        ours[1].weight = ours[0].weight
        for a, b in ((first, second), ours):
            (g,) = torch.autograd.grad(b(torch.tanh(a(x))).square().sum(), a.weight, create_graph=True)
            results.append((g.detach(), torch.autograd.grad(g.sum(), a.bias)[0]))
    for got, want in ((results[1], results[0]), (results[3], results[2])):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert_grads_equal(om, ref)


class _NoisyCritic(nn.Module):
    """A critic with a Dropout and a randn_like (a tagged fill), for a gradient penalty; the Dropout's layer in an
    activation checkpoint, which torch's backward computes again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def dropped(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(F.dropout(h, 0.4, self.training)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.c(checkpoint(self.dropped, h, use_reentrant=False) + 0.1 * torch.randn_like(h))


def _penalty(m: nn.Module, x: torch.Tensor, seed: int, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A WGAN-GP gradient penalty of critic `m` at `x`, its random numbers drawn after `torch.manual_seed(seed)`; and
    the input gradient (from onnxruntime's backward without create_graph)."""
    leaf = x.clone().requires_grad_()
    torch.manual_seed(seed)
    y = m(leaf)
    (g,) = torch.autograd.grad(y.sum(), leaf, create_graph=create_graph)
    return g.norm(dim=1).sub(1).square().mean(), g


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("torch_dropout", [True, False])
def test_create_graph_through_dropout_differentiates_the_forward_s_masks(exporter: str, torch_dropout: bool) -> None:
    """backward(create_graph=True) computes the call again in torch, which drew other masks than the forward's: the
    gradient penalty differentiated another function (its gradients 0.4-0.5 off onnxruntime's own of the same call).
    Now torch's module gets the forward's draws: under torch_dropout from the state they were drawn from as torch's
    (each WGAN-GP step is torch's: outputs, penalty and parameters' gradients); in the default mode, whose masks
    numpy draws, each of its random ops hands back the host's draw (the penalty's parameter gradients against
    finite differences of penalties from onnxruntime's own backward, float64), its checkpoint run plainly (torch's
    would compute the Dropout again in backward, drawing anew: 0.23-0.33 off), and at the first call at new sizes
    onnxruntime's own draws, kept (refused before). A batched backward (a jacobian) takes the same way."""
    torch.manual_seed(0)
    ref, om = pair(_NoisyCritic(), exporter=exporter, torch_dropout=torch_dropout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(3):
            x = torch.randn(12, 6)
            results = []
            for m in (ref, om):
                leaf = x.clone().requires_grad_()
                torch.manual_seed(10 + step)
                y = m(leaf)
                plain = torch.autograd.grad(y.sum(), leaf, retain_graph=True)[0]
                if m is om:  # torch's own refuses: its checkpoint draws again under the jacobian's vmap
                    (jacobian,) = torch.autograd.grad(y, leaf, torch.eye(12).reshape(12, 12, 1), retain_graph=True,
                                                      is_grads_batched=True)
                    torch.testing.assert_close(jacobian.sum(0), plain, rtol=1e-5, atol=1e-6)
                (g,) = torch.autograd.grad(y.sum(), leaf, create_graph=True)
                torch.testing.assert_close(g, plain, rtol=1e-5, atol=1e-6)
                (y.mean() + g.norm(dim=1).sub(1).square().mean()).backward()
                results.append((y.detach(), g.detach()))
            if torch_dropout or not step:  # the default mode's later masks are numpy's, not torch's
                for got, want in zip(results[1], results[0]):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
                assert_grads_equal(om, ref)
            for m in (ref, om):
                m.zero_grad(set_to_none=True)
        if torch_dropout:
            return
        om.double()
        x = torch.randn(12, 6, dtype=torch.float64)
        _penalty(om, x, 0, False)  # the export's call, whose masks are torch's
        _penalty(om, x, 1, True)[0].backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in om.parameters()]  # b.bias: None, as torch
        direction = [torch.randn_like(p) for p in om.parameters()]
        sides = []
        for sign in (1, -1):
            with torch.no_grad():
                for p, t in zip(om.parameters(), direction):
                    p.add_(sign * 1e-6 * t)
            sides.append(_penalty(om, x, 1, False)[0].item())
            with torch.no_grad():
                for p, t in zip(om.parameters(), direction):
                    p.sub_(sign * 1e-6 * t)
        along = sum(float((g * t).sum()) for g, t in zip(grads, direction))
        assert along == pytest.approx((sides[0] - sides[1]) / 2e-6, rel=1e-6)
        leaf = x[:7].clone().requires_grad_()
        y = om(leaf)  # the first call at new sizes: onnxruntime's draws, which the runner keeps for it
        plain = torch.autograd.grad(y.sum(), leaf, retain_graph=True)[0]
        torch.testing.assert_close(torch.autograd.grad(y.sum(), leaf, create_graph=True)[0], plain)


class _Drawing(nn.Module):
    """A Linear-Tanh-Linear drawing one of torch's kinds of random numbers between its layers."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.kind == "normal of tensors":  # torch.normal(mean, std): mean + std * its draws
            h = h * torch.normal(h, F.softplus(h)) + torch.normal(h, 0.3)
        elif self.kind == "fills":
            h = h * torch.empty_like(h).bernoulli_(0.7) + torch.empty_like(h).exponential_(2.0)
            h = h * torch.rand_like(h) + torch.empty_like(h).uniform_(-1, 1)
        elif self.kind == "drawn otherwise when exporting" and not torch.onnx.is_in_onnx_export():
            h = h + 0 * torch.rand_like(h)
        elif self.kind == "rrelu":  # its noise drawn by onnxruntime in the export
            h = F.rrelu(h, training=self.training)
        elif self.kind == "transposed view":  # torch draws the mask in memory order, the export so too
            h = F.dropout(h.t(), 0.2, self.training).t()
        return self.b(F.dropout(h, 0.3, self.training))


class _Encoder(nn.Module):
    """A batch-first encoder layer, whose dropout1 reads the attention's output transposed: torch draws its mask in
    that memory order, the export's run (and the host's as torch's) in the logical one."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.e(x).mean(1)


class _ConvDropout(nn.Module):
    """A convolution, a channel dropout and a dropout: at 32 rows or more, its split steps may run as halves of the
    batch, whose masks are cut from the whole batch's draws."""

    def __init__(self, size: int = 8, classes: int = 2, channels: float = 0.3) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 4, 3), nn.Linear(4 * (size - 2) ** 2, classes)
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout2d(torch.tanh(self.conv(x)), self.channels, self.training)
        return self.head(F.dropout(h.flatten(1), 0.4, self.training))


@pytest.mark.parametrize(("kind", "torch_dropout"), [
    ("normal of tensors", False), ("fills", False), ("transposed view", False), ("encoder", False),
    ("encoder", True), ("convolution at 64 rows", False), ("drawn otherwise when exporting", False),
    ("rrelu", False)])
def test_create_graph_hands_torch_s_module_the_forward_s_draws(kind: str, torch_dropout: bool) -> None:
    """The create_graph backward's recompute gets each kind of the forward's draws at its place (torch.normal of
    tensors, bernoulli_, exponential_, rand_like and uniform_ fills, Dropout masks): its gradients are those of
    onnxruntime's own backward, at the call that exported (the host drew as torch's) and later (numpy's masks).
    The encoder's first call: torch's generator set back drew dropout1's mask in another order (0.09 off); the
    recompute runs as the export did (`lean_attention`: batch-major outside torch_dropout, as torch's inside).
    Where torch's module draws otherwise than the export did, refused with the op named; where onnxruntime's random
    ops drew (rrelu's noise), refused. torch.normal of tensors at another batch: the legacy export had typed its
    ZeroGradient nodes with the traced sizes, and the backward refused the new batch's gradients."""
    refused = {"drawn otherwise when exporting": r"drew with aten\.rand_like.*where the forward drew a Dropout",
               "rrelu": r"onnxruntime drew some of them.*rrelu"}
    torch.manual_seed(0)
    made = {"encoder": _Encoder, "convolution at 64 rows": _ConvDropout}.get(kind, functools.partial(_Drawing, kind))
    om = ORTModule(made(), torch_dropout=torch_dropout)
    shape = {"encoder": (4, 10, 16), "convolution at 64 rows": (64, 1, 8, 8)}.get(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for rows in (12, 7, 12):  # 7: the first call at new sizes (onnxruntime's draws, kept)
            x = torch.randn(*(shape or (rows, 6)), requires_grad=True)
            y = om(x)
            w = torch.randn_like(y)
            (plain,) = torch.autograd.grad(y, x, w, retain_graph=True)
            if kind in refused:
                with pytest.raises(RuntimeError, match=refused[kind]):
                    torch.autograd.grad(y, x, w, create_graph=True)
                continue
            (g,) = torch.autograd.grad(y, x, w, create_graph=True)
            torch.testing.assert_close(g, plain, rtol=1e-5, atol=1e-6)


class Head(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body, self.post = body, nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.tanh(self.body(x)))


def test_a_module_compiled_around_an_ortmodule_trains_as_torch() -> None:
    """torch.compile of a model holding an ORTModule (and of an ORTModule itself) breaks its graph at the call,
    which runs on onnxruntime as outside a compile; dynamo used to trace into the export and fail in it."""
    torch.manual_seed(0)
    ref = Head(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))
    inner = ORTModule(copy.deepcopy(ref.body))
    ours = Head(inner)
    ours.post.load_state_dict(ref.post.state_dict())
    compiled = torch.compile(ours, backend="eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours)]
    for _ in range(3):
        x = torch.randn(5, 6)
        for call, opt in zip((ref, compiled), opts):
            opt.zero_grad()
            call(x).square().sum().backward()
            opt.step()
        assert_grads_equal(ours, ref)
        torch.testing.assert_close(inner[1].running_var, ref.body[1].running_var)
    assert inner.stats == {"exports": 1, "builds": 1, "fallbacks": 0}
    torch.testing.assert_close(torch.compile(inner, backend="eager")(x), ref.body(x))


class Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(y)


def test_the_gradient_check_differentiates_the_call_alone() -> None:
    """The first gradients' check took torch's gradients of the call with respect to the caller's tensors, which
    also took the paths reaching them outside the call: one tensor passed twice got the sum of both paths at each
    position, and a parameter shared by two ORTModules, the second fed the first's output, got the first's
    gradient too. Both modules were refused; they now train as torch."""
    torch.manual_seed(0)
    ref, om = pair(Product())
    x = torch.randn(3, 4)
    grads = []
    for m in (ref, om):
        leaf = x.clone().requires_grad_()
        m(leaf, leaf).square().sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert_grads_equal(om, ref)

    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    ours = [ORTModule(copy.deepcopy(m)) for m in (first, second)]
    ours[1].weight = ours[0].weight
    for a, b in ((first, second), ours):
        b(torch.relu(a(x))).square().sum().backward()
    assert_grads_equal(ours[0], first)
    assert_grads_equal(ours[1], second)


def test_an_ortmodule_inside_an_exported_module_is_traced_as_its_module() -> None:
    """An ORTModule inside a module that ORTModule wraps (or that the user exports to ONNX) stands for its module:
    the export traces the module. Its own export inside the outer one waited for the export lock forever, and a
    user's export met an autograd Function."""
    torch.manual_seed(0)
    ref = Head(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    nested = copy.deepcopy(ref)
    nested.body = ORTModule(nested.body)
    outer = ORTModule(nested)
    x = torch.randn(5, 6)
    for m in (ref, outer):
        m(x).square().sum().backward()
    assert_grads_equal(outer, ref)
    assert outer.stats["exports"] == 1 and nested.body.stats["exports"] == 0
    nested.body(x).sum().backward()  # and on its own it trains on onnxruntime
    assert nested.body.stats["exports"] == 1
    for dynamo in (False, True):
        if dynamo:
            proto = torch.onnx.export(nested, (x,), dynamo=True, optimize=False, verbose=False).model_proto
        else:
            buffer = io.BytesIO()
            torch.onnx.export(nested, (x,), buffer, dynamo=False)
            proto = onnx.load_from_string(buffer.getvalue())
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), ref(x).detach())


def test_threads_making_their_first_calls_at_once_export_and_build_once() -> None:
    """Each of several threads calling a new ORTModule at once exported it (and built its backward) for itself;
    one thread's call could also take the export check made for another's inputs, and refuse the module."""
    torch.manual_seed(0)
    ref, om = pair(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    xs = [torch.randn(5 + k, 8) for k in range(4)]
    start, errors = threading.Barrier(len(xs)), []

    def step(x: torch.Tensor) -> None:
        start.wait()
        try:
            om(x).square().sum().backward()
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=step, args=(x,)) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for x in xs:
        ref(x).square().sum().backward()
    assert_grads_equal(om, ref)
    assert om.stats == {"exports": 1, "builds": 1, "fallbacks": 0}


def test_in_place_change_of_a_stashed_output_is_detected() -> None:
    om = ORTModule(nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()))  # Sigmoid's gradient reads its output
    out = om(torch.randn(2, 4))
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_in_place_change_of_an_input_backward_reads_is_detected() -> None:
    om = ORTModule(MLP())
    x = torch.randn(2, 8)
    out = om(x)
    x.add_(1)  # the weight gradient of fc1 reads x
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_equal_initial_weights_stay_distinct_parameters() -> None:
    """Two LayerNorms start identical (ones, zeros): the exporter must not merge them into one tensor."""

    class Twins(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.LayerNorm(6), nn.LayerNorm(6)

        def forward(self, x):
            return self.b(self.a(x) * 2)

    ref, om = pair(Twins())
    x, w = torch.randn(4, 6), torch.randn(4, 6)
    (om(x) * w).sum().backward()
    (ref(x) * w).sum().backward()
    assert_grads_equal(om, ref)
    (session,) = om.training_sessions()
    assert {"a.weight", "b.weight", "a.bias", "b.bias"} <= set(session.wrt)


# --- parameters -----------------------------------------------------------------------------------------
class PartlyUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x, use_b: bool = True):
        h = self.a(x)
        return self.b(h) if use_b else h


def test_unused_parameters_get_none() -> None:
    ref, om = pair(PartlyUsed())
    x = torch.randn(2, 4)
    om(x, use_b=False).sum().backward()
    ref(x, use_b=False).sum().backward()
    assert_grads_equal(om, ref)
    assert om.b.weight.grad is None and om.unused.weight.grad is None


def test_frozen_parameters_get_nothing_and_changes_rebuild() -> None:
    ref, om = pair(PartlyUsed())
    for m in (ref, om):
        m.a.requires_grad_(False)
    x = torch.randn(3, 4)
    om(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(om, ref)
    assert om.a.weight.grad is None
    (session,) = om.training_sessions()
    assert "a.weight" not in session.wrt  # frozen: not differentiated at all
    for m in (ref, om):
        m.a.requires_grad_(True)
    om(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1 and om.stats["builds"] == 2


# --- caching ----------------------------------------------------------------------------------------------
class Flexible(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x, mode: str = "sum"):
        h = self.fc(x.float().reshape(-1, 4))
        return h.sum() if mode == "sum" else h.mean()


def test_reexport_on_schema_change_only() -> None:
    om = ORTModule(Flexible())
    ref = copy.deepcopy(om.module)
    x = torch.randn(3, 4)
    om(x)
    om(torch.randn(7, 4))  # batch size: dynamic
    assert om.stats["exports"] == 1
    om(x, mode="mean")  # a non-tensor argument is a constant of the export
    assert om.stats["exports"] == 2
    om(x, "sum")
    assert om.stats["exports"] == 2
    om(x.double())  # dtype
    assert om.stats["exports"] == 3
    x3 = torch.randn(2, 5, 4)
    out = om(x3)  # rank
    assert om.stats["exports"] == 4
    torch.testing.assert_close(out, ref(x3))
    om(torch.randn(6, 3, 4))
    om(torch.randn(1, 4))  # back to rank 2, batch 1: cached
    assert om.stats["exports"] == 4


def test_to_dtype_reexports_and_matches() -> None:
    ref, om = pair(MLP())
    x = torch.randn(4, 8)
    om(x)
    om.double()
    ref.double()
    xd = x.double()
    torch.testing.assert_close(om(xd), ref(xd))
    om(xd).sum().backward()
    ref(xd).sum().backward()
    assert_grads_equal(om, ref, rtol=1e-10, atol=1e-12)
    assert om.fc1.weight.grad.dtype == torch.float64 and om.stats["exports"] == 2


# --- modes ------------------------------------------------------------------------------------------------
class DropNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.bn(self.fc(x)))


def test_no_grad_and_inference_mode_stash_nothing() -> None:
    ref, om = pair(MLP())
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = om(x)
    with torch.inference_mode():
        out2 = om(x)
    assert out.grad_fn is None and out2.grad_fn is None
    assert om.training_sessions() == [] and om.stats["builds"] == 0
    torch.testing.assert_close(out, ref(x).detach())
    torch.testing.assert_close(out2, out)


def test_an_export_under_inference_mode_runs_as_torch() -> None:
    """A validation batch made under inference_mode, on a schema not exported yet (eval after training): reading
    the inference tensor's version counter failed the export ("Inference tensors do not track version counter")."""
    ref, om = pair(MLP())
    om(torch.randn(4, 8)).sum().backward()
    om.eval()
    ref.eval()
    with torch.inference_mode():
        x = torch.randn(4, 8)
        torch.testing.assert_close(om(x), ref(x))


def test_apply_and_the_training_flag_reach_the_wrapped_module() -> None:
    """`model.apply(init)` called `init` on the wrapper, never on the wrapped module itself (an init matching the
    module's own class did nothing), and `model.training = False` set on the wrapper only (its forward read True)."""
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.shift = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return self.fc(x) + (self.shift if self.training else -self.shift)

    def init(m: nn.Module) -> None:
        if isinstance(m, Shifted):
            nn.init.zeros_(m.shift)
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 0.5)

    om = ORTModule(Shifted())
    assert om.apply(init) is om
    assert not om.module.shift.any() and (om.module.fc.weight == 0.5).all()
    lone = ORTModule(nn.Linear(3, 2))
    lone.apply(init)
    assert (lone.module.weight == 0.5).all()
    om.shift.data.fill_(1.0)
    x = torch.randn(4, 3)
    om(x)
    om.training = False
    assert not om.module.training
    torch.testing.assert_close(om(x), om.module.fc(x) - 1)
    # an init loop over modules() (a wrapped nn.Linear was never among them) and a module nested in torch's
    for m in lone.modules():
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, -1.0)
    assert (lone.module.weight == -1).all()
    outer = nn.Sequential(om, nn.ReLU())
    assert [(name, type(m).__name__) for name, m in outer.named_modules()] == [
        ("", "Sequential"), ("0", "Shifted"), ("0.fc", "Linear"), ("1", "ReLU")]
    assert [name for name, _ in outer.named_parameters()] == ["0.shift", "0.fc.weight", "0.fc.bias"]


def test_train_and_eval_modes() -> None:
    torch.manual_seed(1)
    ref, om = pair(DropNorm())
    x = torch.randn(64, 8) * 3 + 1
    om.train()
    y = om(x)
    dropped = float((y == 0).float().mean())
    assert 0.35 < dropped < 0.65  # Dropout active in training
    ref.train()
    ref(x)
    torch.testing.assert_close(om.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(om.bn.running_var, ref.bn.running_var)  # unbiased, like torch
    assert int(om.bn.num_batches_tracked) == 1
    with torch.no_grad():  # still training mode: statistics update under no_grad, as in torch
        om(x)
        ref(x)
    torch.testing.assert_close(om.bn.running_var, ref.bn.running_var)
    assert int(om.bn.num_batches_tracked) == 2
    om.eval()
    ref.eval()
    assert not om.module.training and not om.bn.training
    torch.testing.assert_close(om(x), ref(x))  # running statistics, no Dropout
    assert int(om.bn.num_batches_tracked) == 2
    om.train()
    assert om.module.training and om.drop.training


def test_batchnorm_cumulative_momentum() -> None:
    ref, om = pair(nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4, momentum=None)))
    for _ in range(3):
        x, w = torch.randn(6, 3), torch.randn(6, 4)
        (om(x) * w).sum().backward()
        (ref(x) * w).sum().backward()
    torch.testing.assert_close(om[1].running_var, ref[1].running_var)
    torch.testing.assert_close(om[1].running_mean, ref[1].running_mean)
    assert_grads_equal(om, ref)


def test_batchnorm_equal_widths_keep_their_statistics() -> None:
    """Two BatchNorms of equal width: their stand-in running inputs are equal constants, which onnxruntime's
    ConstantSharing would merge into one buffer that both nodes write their batch statistics into."""
    ref, om = pair(nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4, bias=False),
                                 nn.BatchNorm1d(4)))
    x = torch.randn(6, 3)
    om(x).sum().backward()
    ref(x).sum().backward()
    with torch.no_grad():
        om(x)
        ref(x)
    for k in (1, 4):
        torch.testing.assert_close(om[k].running_mean, ref[k].running_mean)
        torch.testing.assert_close(om[k].running_var, ref[k].running_var)


class SharedNorms(nn.Module):
    """BatchNorms of three momenta (one cumulative), one of them called twice a forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.a, self.b = nn.BatchNorm1d(4, momentum=0.3), nn.BatchNorm1d(4, momentum=None)
        self.c = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.c(self.a(self.fc1(x)).relu())
        return self.c(self.b(self.fc2(h)))


@pytest.mark.parametrize("shared,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.float64)])
def test_batchnorm_running_statistics_over_steps(shared, dtype) -> None:
    """Every module's running statistics and count as torch's after each step, whatever its momentum, and a
    module called twice a forward counted and updated once a call, in order; in double too (the batch statistics'
    outputs were declared float, so the build failed)."""
    ref, om = pair(SharedNorms().to(dtype))
    if not shared:
        for m in (ref, om.module):
            m.forward = types.MethodType(lambda self, x: self.b(self.fc2(self.c(self.a(self.fc1(x)).relu()))), m)
    for _ in range(3):
        x = torch.randn(6, 3, dtype=dtype) * 2 + 1
        om(x).square().sum().backward()
        ref(x).square().sum().backward()
        for name in ("a", "b", "c"):
            mine, theirs = getattr(om.module, name), getattr(ref, name)
            assert int(mine.num_batches_tracked) == int(theirs.num_batches_tracked), name
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-6, atol=1e-7, msg=name)
            torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-6, atol=1e-7, msg=name)
    assert int(om.module.c.num_batches_tracked) == (6 if shared else 3)


def test_steady_steps_update_the_running_statistics_as_one_tensor() -> None:
    """Steady steps of BatchNorms with one momentum update their statistics as views of one tensor (four torch ops
    a step, `FlatStatistics`): the same bits and counter versions as `update_running_stats`, torch's statistics
    step by step, and a momentum changed (a schedule) or a buffer put in a module's place behind the engine's back
    (its `_buffers` entry) still followed, by the per-tensor path."""
    from runtime.batchnorm import BatchStats, FlatStatistics, update_running_stats

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5), nn.BatchNorm1d(5, momentum=0.3),
                        nn.ReLU(), nn.Linear(5, 2))
    ref, om = pair(nn.Sequential(*[copy.deepcopy(m) for m in net]))
    om.module[4].momentum = ref[4].momentum = 0.1
    x = torch.randn(6, 3) * 2 + 1
    for step in range(7):
        if step == 4:
            om.module[4].momentum = ref[4].momentum = 0.2
        if step == 5:  # a new tensor in the slot, behind the engine's back
            for m in (om.module[1], ref[1]):
                m._buffers["running_mean"] = torch.full((8,), 0.5)
        with pytest.warns(RuntimeWarning, match="momentum") if step == 4 else contextlib.nullcontext():
            for m in (om, ref):  # a changed momentum: exported again (the graph holds it), as warned
                m(x).square().sum().backward()
        for k in (1, 4):
            mine, theirs = om.module[k], ref[k]
            assert int(mine.num_batches_tracked) == int(theirs.num_batches_tracked) == step + 1
            torch.testing.assert_close(mine.running_mean, theirs.running_mean, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(mine.running_var, theirs.running_var, rtol=1e-6, atol=1e-7)
        if step == 2:
            flat = om._engine._steady.statistics
            assert flat is not None and flat.holds()
            storages = {om.module[k]._buffers[n].untyped_storage().data_ptr()
                        for k in (1, 4) for n in ("running_mean", "running_var")}
            assert len(storages) == 1
        if step == 4:
            assert not flat.holds()

    mods = {"a": nn.BatchNorm1d(5), "b": nn.BatchNorm2d(3), "c": nn.BatchNorm1d(4)}
    for m in mods.values():
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    theirs = copy.deepcopy(mods)
    stats = [BatchStats(k, "", "") for k in "abc"]
    draw = lambda: [t for s in stats for t in (torch.randn(mods[s.module].num_features),  # noqa: E731
                                               torch.rand(mods[s.module].num_features))]
    flat = FlatStatistics.of(mods, stats, draw())
    versions = [[(m.num_batches_tracked._version, m.running_mean._version) for m in d.values()] for d in (mods, theirs)]
    for _ in range(3):
        values = draw()
        assert FlatStatistics.of(mods, stats, values, flat) is flat
        flat.update(values)
        update_running_stats(theirs, stats, values)
    for k in mods:
        for n in ("running_mean", "running_var", "num_batches_tracked"):
            assert torch.equal(getattr(mods[k], n), getattr(theirs[k], n)), (k, n)
    for d, before in zip((mods, theirs), versions):
        assert [(m.num_batches_tracked._version - c, m.running_mean._version - r)
                for m, (c, r) in zip(d.values(), before)] == [(3, 0)] * 3


def test_training_batchnorm_graphs_take_no_running_statistics() -> None:
    """In training, the BatchNorm nodes read constants (their running outputs are the batch's statistics) and the
    module's running buffers are updated from Python: the graph leaves them out of its inputs (they were fed at
    every step, unread). In eval mode the graph reads them."""
    ref, om = pair(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(6, 3)
    for m in (om, ref):
        m(x).square().sum().backward()
    [schema] = om._engine.schemas.values()
    fed = {fqn for _, fqn in schema.exported.state}
    assert {"1.weight", "1.bias"} <= fed and not fed & {"1.running_mean", "1.running_var"}, fed
    assert not {i.name for i in schema.exported.model.graph.input} & {"1.running_mean", "1.running_var"}
    torch.testing.assert_close(om[1].running_var, ref[1].running_var)
    om.eval()
    ref.eval()
    torch.testing.assert_close(om(x), ref(x))
    assert any({"1.running_mean", "1.running_var"} <= {fqn for _, fqn in s.exported.state}
               for s in om._engine.schemas.values() if s is not schema)


def test_running_statistics_update_is_the_module_by_module_one_bit_for_bit() -> None:
    """`update_running_stats` updates all modules by foreach ops, in rounds where a module is called twice: the
    same bits, counts and version bumps as torch's ops module by module and call by call (momenta 0.1, 0.3 and
    cumulative, a float64 module fed float32 statistics, one module called three times)."""
    from runtime.batchnorm import BatchStats, update_running_stats

    def by_module(modules, stats, values):
        for s, mean, var in zip(stats, values[0::2], values[1::2]):
            mod = modules[s.module]
            mod.num_batches_tracked.add_(1)
            t = mod.momentum if mod.momentum is not None else 1.0 / float(mod.num_batches_tracked)
            for running, batch in ((mod.running_mean.data, mean), (mod.running_var.data, var)):
                running.mul_(1 - t).add_(batch.to(running.dtype), alpha=t)

    torch.manual_seed(0)
    ours = {"a": nn.BatchNorm1d(5), "b": nn.BatchNorm2d(3, momentum=None),
            "c": nn.BatchNorm1d(4, momentum=0.3).double(), "d": nn.BatchNorm1d(5, momentum=0.3)}
    for m in ours.values():
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    theirs = copy.deepcopy(ours)
    names = ("running_mean", "running_var", "num_batches_tracked")
    before = {(k, n): (getattr(ours[k], n)._version, getattr(theirs[k], n)._version) for k in ours for n in names}
    stats = [BatchStats(k, "", "") for k in "abacda"]
    for _ in range(3):
        values = [t for s in stats for t in (torch.randn(ours[s.module].num_features),
                                             torch.rand(ours[s.module].num_features))]
        update_running_stats(ours, stats, values)
        by_module(theirs, stats, values)
    for k in ours:
        for n in names:
            mine, want = getattr(ours[k], n), getattr(theirs[k], n)
            assert mine.dtype == want.dtype and torch.equal(mine, want), (k, n)
            assert mine._version - before[k, n][0] == want._version - before[k, n][1], (k, n)
    assert int(ours["a"].num_batches_tracked) == 9


class StopGradients(nn.Module):
    """torch's stop-gradients in a forward: a GAN-style detach, a teacher under no_grad, VQ's straight-through
    estimator (z + (q - z).detach()) and a no_grad block that only reads a buffer (harmless either way)."""

    def __init__(self):
        super().__init__()
        self.gen, self.disc, self.teacher = nn.Linear(4, 6), nn.Linear(6, 1), nn.Linear(4, 6)
        self.codes = nn.Parameter(torch.randn(5, 6))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        fake = torch.tanh(self.gen(x))
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
            s = self.scale * 1.5 + target.max(-1).values.mean() * 0  # results with fields keep them
        q = self.codes[torch.cdist(fake, self.codes).argmin(-1)]
        straight = fake + (q - fake).detach()
        return (self.disc(fake.detach()).mean() + (straight - target).square().mean() * s
                + (q - fake.detach()).square().mean())


def test_stop_gradients_as_torch() -> None:
    """No gradient flows back through a detach or what a no_grad block computed: the teacher gets none (None,
    as in torch), the discriminator's loss term none to the generator, the codebook only its own term."""
    ref, om = pair(StopGradients())
    for _ in range(2):
        om.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x = torch.randn(8, 4)
        om(x).backward()
        ref(x).backward()
        assert_grads_equal(om, ref)
    assert om.teacher.weight.grad is None and ref.teacher.weight.grad is None
    with torch.no_grad():
        torch.testing.assert_close(om(x), ref(x))


class MeanTeacher(nn.Module):
    """A student and an EMA of its weights updated in place inside forward under no_grad (mean teacher's, BYOL's
    target), the EMA then read as the teacher's weights; a step count kept the same way."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(3, 4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(self.student.weight, alpha=0.1)
            self.ema += 0.01 * self.ema.sign()
            self.steps += 1
        return (self.student(x) - F.linear(x, self.ema).softmax(-1)).square().mean()


def test_buffers_changed_in_place_without_grad_stop_gradients_as_torch() -> None:
    """torch's autograd sees the EMA as a constant: no gradient reaches the student through the teacher's weights
    (the trace recorded their arithmetic, and onnxruntime's first gradients failed the check), and the buffers
    follow torch's over the steps of an optimizer."""
    ref, om = pair(MeanTeacher())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, om)]
    for step in range(3):
        x = torch.randn(6, 4)
        for m, opt in zip((ref, om), opts):
            opt.zero_grad()
            m(x).backward()
            opt.step()
        assert_grads_equal(om, ref)
        torch.testing.assert_close(om.module.ema, ref.ema, rtol=1e-6, atol=1e-7)
        assert int(om.module.steps) == int(ref.steps) == step + 1


class DetachedFeatures(nn.Module):
    """A loss and features computed after a detach(), returned together."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        features = h.detach() * h
        return self.b(features).sum(), features


def test_outputs_after_a_stop_gradient_left_without_gradient() -> None:
    """Only the loss gets a gradient: the backward built for it alone lines its forward names up with the full
    build's, whose forward half runs the StopGradient as an Identity (compared as one: they differed, and the
    features' node was renamed to itself, an AssertionError)."""
    ref, om = pair(DetachedFeatures())
    x = torch.randn(3, 4)
    (loss, features), (want, want_features) = om(x), ref(x)
    loss.backward()
    want.backward()
    assert_grads_equal(om, ref)
    torch.testing.assert_close(features, want_features)


class Detached(StopGradients):
    """StopGradients' detaches without its no_grad block: a GAN-style detach, VQ's straight-through estimator."""

    def forward(self, x):
        fake = torch.tanh(self.gen(x))
        q = self.codes[torch.cdist(fake, self.codes).argmin(-1)]
        straight = fake + (q - fake).detach()
        return self.disc(fake.detach()).mean() + straight.square().mean() + (q - fake.detach()).square().mean()


def test_dynamo_keeps_detach_and_refuses_no_grad_blocks() -> None:
    """The dynamo exporter loses a no_grad block: refused, naming the cause, before it exports. Its detach() is a
    StopGradient (`dynamo_translations`): such modules were refused too, and now train as torch's (unchecked, so
    that the graph's own gradients are compared)."""
    om = ORTModule(StopGradients(), exporter="dynamo")
    with pytest.raises(ORTModuleError, match=r"no_grad blocks.*no_grad"):
        om(torch.randn(8, 4))
    torch.manual_seed(0)
    model = Detached()
    ref, om = copy.deepcopy(model), ORTModule(model, exporter="dynamo", check_export=False)
    for _ in range(2):
        x = torch.randn(8, 4)
        for m in (om, ref):
            m.zero_grad()
            m(x).backward()
        assert_grads_equal(om, ref)


def test_dynamo_names_a_cumulative_batchnorm_it_cannot_trace() -> None:
    """BatchNorm with momentum=None takes its factor from num_batches_tracked as a Python number, which torch.export
    cannot trace: the error names the module and what to do, ahead of torch's own message; the default exporter
    trains it as torch does."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None), nn.Linear(4, 2))

    x = torch.randn(8, 4)
    with pytest.raises(ORTModuleError, match=r"BatchNorm '1' has momentum=None .* use exporter='torchscript'"):
        ORTModule(make(), exporter="dynamo")(x)
    ref, om = make(), ORTModule(make())
    for _ in range(2):
        for m in (ref, om):
            m(x).square().sum().backward()
    assert_grads_equal(om, ref)
    torch.testing.assert_close(om.module[1].running_var, ref[1].running_var)


def test_an_export_onnxruntime_cannot_run_on_its_own_inputs_is_named_as_the_export_s_fault() -> None:
    """torch's legacy exporter translates AdaptiveLogSoftmaxWithLoss (an index_copy_ of a one-row cluster) into a
    ScatterElements onnxruntime refuses on the very inputs traced; the error says so and names the node, where it
    used to blame an unknown rank on the model's inputs."""
    torch.manual_seed(0)
    head = nn.AdaptiveLogSoftmaxWithLoss(8, 20, [5, 10], div_value=2.0)
    with pytest.raises(ORTModuleError, match=r"the export failed.*cannot run the exported graph on the inputs it was "
                       r"traced with .*ScatterElements.*translated the module wrongly"):
        ORTModule(head)(torch.randn(6, 8), torch.tensor([0, 4, 7, 12, 19, 3]))


class Differences(nn.Module):
    """kron, an operator torch's legacy exporter has no translation of (torch.export decomposes it), with diff and
    nansum (which the runtime writes out for it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        steps = torch.diff(h, dim=-1)
        kept = torch.nansum(torch.where(h > 0, h, torch.nan), -1, keepdim=True)
        return torch.cat([(steps * kept).flatten(), torch.kron(h[:2, :2], h[2:4, 1:3]).flatten()])


def test_operators_the_legacy_exporter_lacks_are_exported_by_dynamo_with_a_warning(
        capfd: pytest.CaptureFixture[str]) -> None:
    """The module is exported by dynamo from its first call on, with a warning naming the operator, and trains as
    torch does; an operator neither exporter translates keeps the legacy exporter's error, with dynamo's added,
    and nothing printed (torch's export turned its log on for good, and printed the whole graph on failure)."""
    torch.manual_seed(0)
    ref = Differences().double()
    om = ORTModule(copy.deepcopy(ref))
    x = torch.randn(4, 5, dtype=torch.float64)
    with pytest.warns(ExportWarning, match=r"no ONNX translation of aten::kron, so this module is exported by dynamo"):
        om(x)
    assert "exporter='dynamo'" in repr(om)
    for batch in (4, 7):
        x = torch.randn(batch, 5, dtype=torch.float64)
        for m in (ref, om):
            m.zero_grad()
            out = m(x)
            (out * torch.linspace(-1, 2, out.numel(), dtype=torch.float64).view(out.shape)).sum().backward()
        torch.testing.assert_close(om(x), ref(x), rtol=1e-12, atol=1e-12)
        assert_grads_equal(om, ref, rtol=1e-12, atol=1e-12)

    class MatrixExp(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.linalg.matrix_exp(x)

    class Gaussian(nn.Module):  # torch.export fails on its data-dependent check, and printed its partial graph
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = torch.diag_embed(x[:, 2:].exp())
            return torch.distributions.MultivariateNormal(x[:, :2], scale_tril=scale).log_prob(x[:, :2]).sum()

    capfd.readouterr()
    for log in (False, True):  # torch's own exports leave it on: as it was after ours
        torch._C._jit_set_onnx_log_enabled(log)
        with pytest.raises(ORTModuleError, match=r"aten::linalg_matrix_exp.*\n.*exporter='dynamo', tried next"):
            ORTModule(MatrixExp())(torch.randn(3, 4, 4, requires_grad=True))
        with pytest.raises(ORTModuleError, match=r"aten::diag_embed.*\n.*exporter='dynamo', tried next"):
            ORTModule(Gaussian())(torch.randn(3, 4, requires_grad=True))
        printed = capfd.readouterr()
        assert "aten" not in printed.out + printed.err and torch._C._jit_is_onnx_log_enabled() == log  # no graph


class Counting(nn.Module):
    """A forward that changes buffers in place: a step count, an EMA of its inputs the output reads, and a queue
    of past features (MoCo's, shifted by tensor ops)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.full((4,), float("nan")))
        self.register_buffer("queue", torch.zeros(4, 6))

    def forward(self, x):
        self.steps += 1
        with torch.no_grad():
            self.ema.copy_(torch.where(self.ema.isnan(), x.mean(0), 0.9 * self.ema + 0.1 * x.mean(0)))
        h = self.fc(x - self.ema)
        out = (h @ self.queue.clone()).sum() + h.square().sum()
        with torch.no_grad():
            self.queue.copy_(torch.cat([h.detach().T[:, :2], self.queue[:, :-2]], 1))
        return out


class Pointer(Counting):
    """The queue written at a pointer read as a Python number: the export would keep that number."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.fc(x)
        with torch.no_grad():
            p = int(self.ptr)
            self.queue[:, p:p + 2] = h.T[:, :2]
            self.ptr.fill_((p + 2) % 6)
        return h.sum()


def test_buffers_changed_in_forward_follow_torch() -> None:
    """Buffers the forward changes in place get torch's values after every call (exported again with their new
    values as outputs, written back), the queue's gradient path included; one read as a Python number is
    refused by name; a NaN buffer left alone is not changed (parameters changed in place: below)."""
    ref, om = pair(Counting())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        for _ in range(3):
            x = torch.randn(3, 4)
            om(x).backward()
            ref(x).backward()
            for name, b in ref.named_buffers():
                torch.testing.assert_close(om.module.get_buffer(name), b, msg=name)
            assert_grads_equal(om, ref)
    with pytest.raises(ORTModuleError, match=r"changes ptr in place and reads it as a Python number"):
        ORTModule(Pointer())(torch.randn(3, 4))
    quiet = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    quiet.register_buffer("unused", torch.full((2,), float("nan")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        ORTModule(quiet)(torch.randn(3, 4)).sum().backward()


class RunningPeak(nn.Module):
    """A running maximum the forward keeps in place, and a mean teacher starting as an exact copy of its student
    (0.9 t + 0.1 s == t bitwise at the first call)."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.register_buffer("peak", torch.tensor(10.0))
        self.register_buffer("teacher", self.student.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.peak.copy_(torch.maximum(self.peak, x.abs().max()))
            self.teacher.mul_(0.9).add_(0.1 * self.student.weight)
            target = F.linear(x, self.teacher).softmax(-1)
        return -(target * self.student(x / self.peak).log_softmax(-1)).sum(-1).mean()


def test_buffers_changed_in_place_to_the_same_value_at_the_export_follow_torch() -> None:
    """Changes found by value only: a change leaving the exporting call's value as it was (the maximum not
    exceeded yet, the teacher equal to its student) was dropped from the graph for good, silently (the peak then
    never moved) or refused at the second call."""
    ref, om = pair(RunningPeak())
    opt, ref_opt = torch.optim.SGD(om.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    for scale in (1.0, 1.0, 50.0, 1.0):
        x = torch.randn(5, 4) * scale
        for model, o in ((om, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).backward()
            o.step()
        torch.testing.assert_close(om.module.peak, ref.peak)
        torch.testing.assert_close(om.module.teacher, ref.teacher)
        assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1


class Bank(nn.Module):
    """A memory bank of negatives the forward grows to a cap by putting a new tensor in the buffer's slot."""

    def __init__(self, start: int):
        super().__init__()
        self.f = nn.Linear(6, 4)
        self.register_buffer("bank", torch.randn(start, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.f(x), dim=-1)
        self.bank = torch.cat([z.detach(), self.bank], 0)[:10]
        return -z.sum()


@pytest.mark.parametrize("start", [0, 2])
def test_a_buffer_replaced_by_a_larger_one_follows_torch(start: int) -> None:
    """The new value was copied into the old tensor where the call's backward does not read the buffer: "The size
    of tensor a (0) must match the size of tensor b (4)" at the first call."""
    ref, om = pair(Bank(start))
    for _ in range(4):
        x = torch.randn(4, 6)
        om(x).backward()
        ref(x).backward()
        torch.testing.assert_close(om.module.bank, ref.bank)
        assert_grads_equal(om, ref)


class Truncated(nn.Module):
    """Truncated backpropagation through time: the GRU's last state kept in a buffer from call to call
    (`self.h = h.detach()`, a new tensor in the buffer's slot), and a non-persistent scale the training loop sets
    between calls."""

    def __init__(self, persistent: bool):
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 2)
        self.register_buffer("h", torch.zeros(1, 2, 5), persistent=persistent)
        self.register_buffer("scale", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.rnn(x, self.h)
        self.h = h.detach()
        return self.head(out) * self.scale


@pytest.mark.parametrize("persistent", [True, False])
def test_state_carried_in_buffers_from_call_to_call_follows_torch(persistent: bool) -> None:
    """A buffer the forward replaces is carried to the next call as torch's module carries it (it was taken as
    unchanged: the second call's export differed and was refused); a non-persistent buffer is fed at each call
    (the exporters took it for a constant, since the state_dict leaves it out), so changes between calls are
    seen."""
    ref, om = pair(Truncated(persistent))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, om)]
    for step in range(4):
        x = torch.randn(2, 4, 3)
        for m, opt in zip((ref, om), opts):
            m.scale.fill_(1.0 + step)
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        assert_grads_equal(om, ref)
        torch.testing.assert_close(om.module.h, ref.h, rtol=1e-5, atol=1e-6)
    assert om.stats["exports"] == 1
    assert ("h" in om.state_dict()) == persistent and "scale" not in om.state_dict()


class Encoded(nn.Module):
    """CTRL's positional encoding: an `nn.Buffer(persistent=False)` the forward assigns again, moved to the input's
    device and type (the same tensor here)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.pe = nn.Buffer(torch.randn(10, 6), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pe = self.pe.to(device=x.device, dtype=x.dtype)
        return self.fc(x) + self.pe[: x.shape[1]]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_non_persistent_buffer_assigned_again_in_forward(exporter: str) -> None:
    """The tensor's own flag made the assignment non-persistent again while the export had every buffer persistent
    (to feed them), and the legacy exporter refused: "state_dict changed after running the tracer"."""
    ref, om = pair(Encoded(), exporter=exporter)
    for n in (4, 7):
        x = torch.randn(3, n, 6)
        for m in (ref, om):
            m(x).square().sum().backward()
        assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1 and "pe" not in om.state_dict() and "pe" not in om.module.state_dict()


class NamedLikeOps(nn.Module):
    """Parameters named as the ops of the forward: a temperature `t` beside `z.t()`, a gate `mul` beside a product."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.t = nn.Parameter(torch.tensor(0.7))
        self.mul = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x) * self.mul
        return (z @ z.t()) * self.t


def test_parameters_named_as_the_forward_s_ops() -> None:
    """The dynamo exporter names a parameter by its qualified name and a node's output by its op: a parameter `t`
    and a transpose were both 't', which the gradient build refused ("tensor 't' is defined twice")."""
    ref, om = pair(NamedLikeOps(), exporter="dynamo")
    for n in (4, 5):
        x = torch.randn(n, 6)
        for m in (ref, om):
            m(x).square().sum().backward()
        assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1


class _MoE(nn.Module):
    """A gated layer keeping its load-balancing loss and its routing (for plotting) in plain attributes, as MoE and
    VQ layers do: the training loop reads them after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4), nn.Linear(8, 8)
        self.maps: list[tuple[str, torch.Tensor]] = []
        self.load: dict[str, torch.Tensor] = {}
        self.outs: list[torch.Tensor] = []  # a hook's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        self.aux_loss = probs.mean(0).pow(2).sum() * 4
        self.routing = probs.argmax(-1)  # the expert each token went to
        self.maps.append(("probs", probs))
        self.load["mean"] = probs.mean(0)
        self.top = [probs.max(-1).values]  # a list made afresh at each call
        return self.experts(x) * probs.max(-1, keepdim=True).values


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tensors_the_forward_stores_in_attributes_are_each_call_s(exporter: str) -> None:
    """`self.aux_loss = ...` in a forward kept the export's tensor (dynamo's a FakeTensor): stale from the third call,
    and a loss adding it failed with "backward through the graph a second time"; a list it appended to grew once.
    Tensors stored in attributes, appended to lists and set in dicts the modules hold are now outputs of the graph,
    stored after each call before the hooks run (one collecting every layer's aux loss reads them; one appending to
    a module's list does it itself), and their gradients join the graph's."""
    torch.manual_seed(0)
    net = nn.Sequential(_MoE(), nn.ReLU(), _MoE())
    ref, om = copy.deepcopy(net), ORTModule(copy.deepcopy(net), exporter=exporter)
    collected: dict[str, list[torch.Tensor]] = {"ours": [], "torch": []}
    for who, model in (("ours", om.module), ("torch", ref)):
        model[2].register_forward_hook(lambda m, args, out, who=who: collected[who].append(m.aux_loss))
        model[0].register_forward_hook(lambda m, args, out: m.outs.append(out))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        for batch in (16, 16, 16, 9):
            x = torch.randn(batch, 8)
            for m in (om, ref):
                m.zero_grad()
                layers = m.module if m is om else m
                out = m(x)
                (out.square().mean() + 0.1 * (layers[0].aux_loss + layers[2].aux_loss)
                 + layers[0].maps[-1][1].std() + layers[2].load["mean"].max() + layers[0].outs[-1].mean()).backward()
                assert not layers[0].routing.requires_grad
            assert_grads_equal(om, ref, rtol=1e-4, atol=1e-6)
            for ours, theirs in zip(om.module, ref):
                if isinstance(ours, _MoE):
                    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss)
                    torch.testing.assert_close(ours.routing, theirs.routing)
                    assert [name for name, _ in ours.maps] == [name for name, _ in theirs.maps]
                    torch.testing.assert_close([t for _, t in ours.maps], [t for _, t in theirs.maps])
                    torch.testing.assert_close(ours.load, theirs.load)
                    torch.testing.assert_close(ours.top, theirs.top)
                    torch.testing.assert_close(ours.outs, theirs.outs)
    torch.testing.assert_close(torch.stack(collected["ours"]), torch.stack(collected["torch"]))


def test_a_tensor_stored_in_a_plain_attribute_is_named_with_the_way_out() -> None:
    """The same state in a plain attribute: the graph cannot carry it, and the warning says to make it a buffer;
    an attribute the forward only reads stays quiet. A buffer registered as None fails the legacy trace, which
    takes the buffers before the call: the error says so."""
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.h, self.scale = nn.GRU(3, 5, batch_first=True), None, torch.ones(5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, h = self.rnn(x, self.h)
            self.h = h.detach()
            return out * self.scale

    with pytest.warns(ExportWarning, match=r"replaces the tensor in h, a plain attribute.*Register it in __init__ as a "
                      r"buffer"):
        ORTModule(Plain())(torch.randn(2, 4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        ORTModule(Truncated(True))(torch.randn(2, 4, 3))
    unset = Truncated(False)
    unset.h = None  # a buffer registered as None that the first call sets: named, and left as it was
    with pytest.raises(ORTModuleError, match=r"sets h, registered as None.*register it holding its first value"):
        ORTModule(unset)(torch.randn(2, 4, 3))
    assert unset.h is None


class ThroughData(nn.Module):
    """A weight clipped or renormalized through `.data` inside forward (WGAN's clipping, NormFace's class
    centres), or only read through it."""

    def __init__(self, change: str):
        super().__init__()
        self.fc, self.change = nn.Linear(4, 3), change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.change == "clamped":
            self.fc.weight.data.clamp_(-0.1, 0.1)
        elif self.change == "replaced":
            self.fc.weight.data = F.normalize(self.fc.weight.data, dim=1)
        if self.fc.weight.data.dtype != x.dtype:  # a read
            raise TypeError("x must have the weights' dtype")
        return self.fc(x)


class Momentum(nn.Module):
    """MoCo's key encoder as its code writes it: frozen parameters moved towards the query encoder's inside forward,
    through `.data` in place ("inplace") or by assignment ("assigned")."""

    def __init__(self, how: str):
        super().__init__()
        self.q, self.how = nn.Linear(6, 4), how
        self.k = copy.deepcopy(self.q).requires_grad_(False)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                if self.how == "inplace":
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
                else:
                    pk.data = pk.data * 0.9 + pq.data * 0.1
            k = self.k(x2)
        return ((self.q(x1) - k) ** 2).sum()


@pytest.mark.parametrize("make", [lambda: ThroughData("clamped"), lambda: ThroughData("replaced"),
                                  lambda: ThroughData("read"), lambda: Momentum("inplace"),
                                  lambda: Momentum("assigned")],
                         ids=["clamped", "renormalized", "read", "momentum-inplace", "momentum-assigned"])
def test_parameters_changed_through_data_in_forward_train_like_torch(make: Callable[[], nn.Module]) -> None:
    """WGAN's clipping and NormFace's renormalized centres in forward, and MoCo's momentum encoder: changes through
    `.data`, untraced, were only warned about, and the exports' own runs applied them twice before the graph held
    the trace's values for good (the key encoder stopped moving; losses apart from step 2)."""
    torch.manual_seed(0)
    ref, om = pair(make())
    opt, ref_opt = torch.optim.SGD(om.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        for _ in range(4):
            inputs = (torch.randn(3, 4),) if isinstance(ref, ThroughData) else (torch.randn(4, 6), torch.randn(4, 6))
            for model, o in ((om, opt), (ref, ref_opt)):
                o.zero_grad()
                model(*inputs).sum().backward()
                o.step()
            assert_grads_equal(om, ref, rtol=1e-4, atol=1e-5)  # sums of squares: gradients of ~10
            for p, q in zip(om.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q)


def test_outputs_require_grad_where_torch_s_do() -> None:
    """An output that depends on nothing receiving gradients (an input passed through, a detached result, a
    constant) does not require grad, as in torch; a parameter returned as is does."""
    class Outputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.fc(x)
            return h, x, h.detach() * 2, torch.ones(3) * 5.0, self.scale, h.argmax(-1)

    x, om = torch.randn(3, 4), ORTModule(Outputs())
    for _ in range(2):  # the export's call, then one on the built sessions
        got = [t.requires_grad for t in om(x)]
        assert got == [t.requires_grad for t in Outputs()(x)] == [True, False, False, False, True, False]


def test_gradient_hooks_on_parameters_and_inputs_run_as_in_torch() -> None:
    """Hooks on the tensors receiving gradients (`register_hook`: gradient scaling or clipping; the
    post-accumulate hooks of optimizers in backward) act on onnxruntime's gradients as on torch's, once a step:
    the check of the export's first gradients compares onnxruntime's with torch's before such hooks."""
    def run(model: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
        calls = [0, 0, 0]
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def scaled(g: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return g * 3

        def clipped(g: torch.Tensor) -> torch.Tensor:
            calls[1] += 1
            return g.clamp(-0.05, 0.05)

        def accumulated(p: torch.Tensor) -> None:
            calls[2] += 1

        model[0].weight.register_hook(scaled)
        x.register_hook(clipped)
        model[2].bias.register_post_accumulate_grad_hook(accumulated)
        for _ in range(2):
            model(x).square().sum().backward()
        return [*(p.grad for p in model.parameters()), x.grad], calls

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    want, want_calls = run(make())
    got, got_calls = run(ORTModule(make()))
    assert got_calls == want_calls == [2, 2, 2]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


class Editable(nn.Module):
    """A forward reading what later edits change: a submodule, a bias, a buffer it may not have yet."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc = nn.Linear(6, 6)
        self.act = nn.ReLU()
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(self.emb(ids).mean(1)))
        if hasattr(self, "shift"):
            h = h + self.shift
        return self.head(h)


def test_module_edited_after_export_is_exported_again() -> None:
    """What torch reads at every call and an export holds: hooks registered or removed, submodules replaced, a
    buffer registered, a bias removed, a vocabulary grown (a new Parameter, or `.data` as Hugging Face's
    resize_token_embeddings does), pruning, attributes set on the ORTModule. Each edit, made to both modules after
    two steps, gives torch's outputs and gradients from the next call on (the old graph ran without a word, or
    failed naming a parameter)."""
    def grow(m: nn.Module) -> None:
        m.emb.weight = nn.Parameter(torch.cat([m.emb.weight.detach(), torch.ones(5, 6)]))

    hooks: list = []
    edits = {
        "forward hook": lambda m: m.fc.register_forward_hook(lambda mod, args, out: out * 2),
        "forward pre-hook": lambda m: m.head.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,)),
        "global forward hook": lambda m: hooks.append(nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out + 1 if mod is m.head else None)),
        "submodule": lambda m: setattr(m, "act", nn.Tanh()),
        "buffer": lambda m: m.register_buffer("shift", torch.full((6,), 0.25)),
        "bias removed": lambda m: setattr(m.fc, "bias", None),
        "vocabulary grown": grow,
        "pruned": lambda m: prune.l1_unstructured(m.fc, "weight", amount=0.5),
    }
    ids = torch.randint(0, 10, (4, 5))
    for what, edit in edits.items():
        torch.manual_seed(0)
        ref = Editable()
        model = ORTModule(copy.deepcopy(ref))
        for step in range(4):
            if step == 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ExportWarning)
                    edit(model.module)
                    edit(ref)
            for m in (model, ref):
                m.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExportWarning)
                got = model(ids)
            want = ref(ids)
            got.square().sum().backward()
            want.square().sum().backward()
            torch.testing.assert_close(got, want, msg=f"{what}, step {step}")
            assert_grads_equal(model, ref)
        for h in hooks:
            h.remove()
        assert model.stats["exports"] == 2, (what, model.stats)

    torch.manual_seed(0)
    ref = Editable()
    model = ORTModule(copy.deepcopy(ref))
    with torch.no_grad():
        model(ids)  # torch's own backward fails after `.data` resizes a parameter it differentiated before
    for m in (model.module, ref):
        m.emb.weight.data = torch.cat([m.emb.weight.detach(), torch.full((5, 6), 0.5)])
    model(ids + 5).sum().backward()
    ref(ids + 5).sum().backward()
    assert_grads_equal(model, ref)

    torch.manual_seed(0)
    ref = Editable()
    model = ORTModule(copy.deepcopy(ref))
    handle = model.module.fc.register_forward_hook(lambda mod, args, out: out * 2)
    ref.fc.register_forward_hook(lambda mod, args, out: out * 2).remove()
    model(ids)
    handle.remove()  # removed after the export that held it
    torch.testing.assert_close(model(ids), ref(ids))

    class Annealed(Editable):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) / self.tau

    model = ORTModule(Annealed())
    model.tau = 1.0
    model(ids)
    model.tau = 0.25  # set through the wrapper: the wrapped forward reads its own attribute
    assert model.module.tau == 0.25 and "tau" not in model.__dict__
    with pytest.warns(RuntimeWarning, match=r"tau \(1.0 -> 0.25\)"):
        torch.testing.assert_close(model(ids), model.module(ids))
    del model.tau
    assert not hasattr(model.module, "tau")


def test_calls_leave_no_reference_cycles() -> None:
    """Nothing a call makes waits for Python's cyclic collector: the export's torch run leaves no autograd graph
    alive (its outputs, with their saved activations, were held by a cycle in `structure.flatten`, as was every
    call's input list), and training and inference steps make no garbage cycles."""
    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn, self.head = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            h = self.head(torch.relu(self.bn(self.fc(x))))
            return {"loss": F.cross_entropy(h, y), "scores": h}

    model = ORTModule(Keyed())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    def graphs() -> list[torch.Tensor]:
        return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    gc.collect()
    gc.disable()
    try:
        before = {id(t) for t in graphs()}  # other tests' (one process runs many)
        model(x, y=y)  # exports
        assert not [t for t in graphs() if id(t) not in before]
        for mode in (True, False, True, False):  # the second round: sessions made
            model.train(mode)
            gc.collect()
            for _ in range(10):
                with torch.set_grad_enabled(mode):
                    out = model(x, y=y)
                if mode:
                    out["loss"].backward()
                    opt.step()
                    opt.zero_grad()
            found = gc.collect()
        assert found == 0
    finally:
        gc.enable()


def test_module_hooks_are_named() -> None:
    """Backward hooks, which onnxruntime's backward cannot run, are warned about, naming each (forward hooks run at
    each call: `test_forward_hooks_run_at_each_call_on_onnxruntime_s_values`); torch's own weight-norm pre-hook (a
    weight computed in the graph) is not."""
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    module[0].register_forward_hook(lambda mod, args, out: None)  # runs at each call (test_forward_hooks_...)
    module[2].register_full_backward_hook(lambda mod, grad_in, grad_out: None)
    with pytest.warns(ExportWarning, match=r"\): a backward hook on 2 will not run at each step"):
        ORTModule(module)(torch.randn(3, 4))

    class Clipped(nn.Module):  # a gradient hook inside forward: not in onnxruntime's gradient
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            h.register_hook(lambda g: g.clamp(-0.01, 0.01))
            return h

    with pytest.warns(ExportWarning, match=r"a gradient hook on a tensor inside forward \(register_hook\) will not"):
        ORTModule(Clipped())(torch.randn(3, 4))

    class Reversed(nn.Module):  # a gradient reversal written as a hook
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc(x)
            if h.requires_grad:
                h.register_hook(lambda g: -g)
            return self.head(h)

    # exported by an evaluation call (no backward to check at), it trained unreversed without a word: the first
    # call with a backward exports again and is checked
    om = ORTModule(Reversed())
    with pytest.warns(ExportWarning, match="gradient hook"), torch.no_grad():
        om(torch.randn(3, 4))
    with pytest.warns(ExportWarning, match="gradient hook"), \
            pytest.raises(ORTModuleError, match="has a gradient hook on a tensor inside forward"):
        om(torch.randn(3, 4)).sum().backward()

    # one changing the gradients fails the first backward's check, naming it as the cause
    module = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    module[2].register_full_backward_hook(lambda mod, grad_in, grad_out: (grad_in[0] * 3,))
    with pytest.warns(ExportWarning), \
            pytest.raises(ORTModuleError, match="has a backward hook on 2, which changed torch's gradients"):
        ORTModule(module)(torch.randn(3, 4)).sum().backward()

    def normed() -> nn.Module:  # weight_norm's modules refuse deepcopy: made twice from one seed
        with torch.random.fork_rng():
            torch.manual_seed(3)
            made = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(made[0])
        return made

    ref, om = normed(), ORTModule(normed())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        x = torch.randn(3, 4)
        om(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(om, ref)


def test_autocast_runs_in_float32() -> None:
    """Under CPU autocast the module runs as exported without it (float32; onnxruntime's CPU kernels have no
    bfloat16 products): gradients as torch's in float32, a warning once."""
    ref, om = pair(nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2)))
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match="float32 under torch.autocast"):
            out = om(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            om(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(om, ref)

    class Inside(nn.Linear):  # an autocast inside the forward: onnxruntime's kernels refused "Gemm(13)", nothing more
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(x).float()

    with pytest.raises(ORTModuleError, match=r"Gemm.*computes in bfloat16 or float16 \(a torch.autocast"):
        ORTModule(Inside(6, 2))(x).sum().backward()


def test_sparse_embedding_gradients_as_torch() -> None:
    """nn.Embedding(sparse=True) and EmbeddingBag(sparse=True): sparse gradients, as torch's, so SparseAdam
    steps them alike; an embedding tied to a head gets a dense one, as torch's sum of both does."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(12, 4, sparse=True)
            self.bag = nn.EmbeddingBag(12, 4, mode="sum", sparse=True)
            self.head = nn.Linear(4, 3)

        def forward(self, ids):
            return self.head(self.embed(ids).mean(1) + self.bag(ids))

    ref, om = pair(Model())
    mine = [torch.optim.SparseAdam([om.embed.weight, om.bag.weight]), torch.optim.Adam(om.head.parameters())]
    theirs = [torch.optim.SparseAdam([ref.embed.weight, ref.bag.weight]), torch.optim.Adam(ref.head.parameters())]
    for _ in range(2):
        ids = torch.randint(0, 12, (5, 3))
        for model, opts in ((om, mine), (ref, theirs)):
            model.zero_grad(set_to_none=True)
            model(ids).square().sum().backward()
            for opt in opts:
                opt.step()
        assert om.embed.weight.grad.is_sparse and om.bag.weight.grad.is_sparse
        torch.testing.assert_close(om.embed.weight.grad.to_dense(), ref.embed.weight.grad.to_dense())
        torch.testing.assert_close(om.bag.weight.grad.to_dense(), ref.bag.weight.grad.to_dense())
        for p, q in zip(om.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    tied = nn.Sequential(nn.Embedding(12, 4, sparse=True), nn.Linear(4, 12, bias=False))
    tied[1].weight = tied[0].weight
    ref, om = pair(tied)
    ids = torch.randint(0, 12, (2, 3))
    om(ids).sum().backward()
    ref(ids).sum().backward()
    assert not om[0].weight.grad.is_sparse and not ref[0].weight.grad.is_sparse
    torch.testing.assert_close(om[0].weight.grad, ref[0].weight.grad)


def test_random_ops_follow_torch_seed() -> None:
    """randn_like, rand and bernoulli in a forward draw anew each step, and the same values after the same
    torch.manual_seed (their onnxruntime seeds come from torch's generator)."""
    class Noisy(Nested):  # Nested's Linear(4, 4), another forward
        def forward(self, x):
            h = self.fc(x)
            return h + torch.randn_like(h) + torch.rand(h.shape[0], 1) + torch.bernoulli(torch.full_like(h, 0.5))

    def run() -> list[torch.Tensor]:
        torch.manual_seed(5)
        om = ORTModule(Noisy())
        x = torch.ones(3, 4)
        return [om(x).detach() for _ in range(3)]

    first, again = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


class Gumbel(nn.Module):
    def __init__(self, hard: bool):
        super().__init__()
        self.fc, self.hard = nn.Linear(6, 5), hard

    def forward(self, x):
        return F.gumbel_softmax(self.fc(x), tau=0.5, hard=self.hard)


def test_gumbel_softmax_soft_and_straight_through() -> None:
    """F.gumbel_softmax (its exponential draw has no export) as torch defines it: the soft sample's gradient is
    torch's for the noise it drew (recovered from the sample), and the hard sample, drawn with the same noise after
    the same seed, is the soft one's one-hot with the soft one's gradient."""
    x, c = torch.randn(4, 6), torch.randn(4, 5)
    runs = {}
    for hard in (False, True):
        torch.manual_seed(11)
        ref, om = pair(Gumbel(hard))
        y = om(x)
        (y * c).sum().backward()
        runs[hard] = (ref, om, y.detach())
    ref, om, soft = runs[False]
    logits = ref.fc(x)
    noise = (0.5 * soft.log() - logits).detach()  # the Gumbel noise up to a constant a row, which softmax drops
    ((logits + noise) / 0.5).softmax(-1).mul(c).sum().backward()
    assert_grads_equal(om, ref, rtol=1e-4, atol=1e-5)
    _, hard_om, hard = runs[True]
    torch.testing.assert_close(hard, F.one_hot(soft.argmax(-1), 5).float())
    assert_grads_equal(hard_om, om)


def test_spectral_norm_in_eval() -> None:
    """spectral_norm's sigma is a vdot (no ONNX export in torch): exported as the sum of a product."""
    module = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    torch.nn.utils.parametrizations.spectral_norm(module[0])
    ref, om = pair(module)
    om.eval()
    ref.eval()
    x = torch.randn(5, 6)
    om(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert_grads_equal(om, ref)


def test_gradients_read_on_outputs_other_outputs_depend_on_are_refused() -> None:
    """`feats.retain_grad()` or a gradient hook on an output the module's other outputs are computed from: torch
    gives it the gradient through them too, onnxruntime's backward only the part reaching it directly (None or 0
    here, silently). The backward refuses, naming the output; outputs nothing else reads are left alone."""
    class Featured(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(4, 3), nn.Linear(3, 2)

        def forward(self, x):
            feats = torch.tanh(self.body(x))
            return feats, self.head(feats)

    om, x = ORTModule(Featured()), torch.randn(5, 4)
    for read in ("retain_grad", "hook"):
        feats, logits = om(x)
        if read == "retain_grad":
            feats.retain_grad()
        else:
            feats.register_hook(lambda g: None)
        with pytest.raises(RuntimeError, match=r"retain_grad\(\) is on output.0, which other outputs"):
            logits.sum().backward()
    feats, logits = om(x)
    logits.retain_grad()  # nothing in the graph reads the logits: their gradient is the caller's alone
    (feats.sum() + logits.square().sum()).backward()
    torch.testing.assert_close(logits.grad, 2 * logits.detach())


def test_lazy_modules_train_like_torch() -> None:
    """nn.LazyLinear's parameters are sized by its first call: ORTModule(lazy) failed at construction (reading their
    sizes). The first call runs in torch, as it must to size them; the next are exported."""
    torch.manual_seed(0)
    om = ORTModule(nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.LazyLinear(2)))
    x = torch.randn(4, 3)
    om(x).sum().backward()
    assert om.stats["exports"] == 0 and [tuple(p.shape) for p in om.parameters()] == [(5, 3), (5,), (2, 5), (2,)]
    ref = copy.deepcopy(om.module)
    for m in (om, ref):
        m.zero_grad()
        m(x).square().sum().backward()
    assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1


def test_calls_under_cached_parametrizations_train_like_torch() -> None:
    """`with parametrize.cached():` around a step (a parametrized weight computed once for two calls): the trace
    refused to run under it ("Cannot trace a model while caching parametrizations"); the export runs outside it."""
    module = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.nn.utils.parametrizations.weight_norm(module[0])
    ref, om = pair(module)
    x = torch.randn(5, 6)
    for m in (ref, om):
        with torch.nn.utils.parametrize.cached():
            (m(x) + m(2 * x)).square().sum().backward()
    assert_grads_equal(om, ref)


class TiedPadded(nn.Module):
    """A language-model head tied to an embedding with a padding row (BertForMaskedLM's layout)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4, padding_idx=-1)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_embedding_padding_row_gets_no_gradient_from_lookups(dtype) -> None:
    """nn.Embedding's padding_idx (lost by both exporters' plain Gather): the padding row's gradient comes from
    the tied head alone, and forward values are unchanged."""
    ref, om = pair(TiedPadded())
    ids = torch.tensor([[5, 1, 5, 2], [3, 5, 0, 5]], dtype=dtype)
    w = torch.randn(2, 4, 6)
    (om(ids) * w).sum().backward()
    (ref(ids) * w).sum().backward()
    assert_grads_equal(om, ref)
    with torch.no_grad():
        torch.testing.assert_close(om(ids), ref(ids))


class PaddedElsewhere(nn.Module):
    """Embeddings with padding rows nested in a ModuleList and a Sequential, one weight also read by indexing and by
    F.embedding without padding_idx (whose row 1 torch gives its gradient)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"emb": nn.Embedding(10, 4, padding_idx=0)}) for _ in range(2)])
        self.seq = nn.Sequential(nn.Embedding(10, 4, padding_idx=1))
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0]["emb"](ids) + self.blocks[1]["emb"](ids) + self.seq(ids)
        w = self.seq[0].weight
        return self.head(h).sum() + w[ids].sum() * 0.5 + F.embedding(ids, w).sum() * 0.25


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_padding_rows_cut_only_the_embeddings_own_lookups(exporter: str) -> None:
    """Every Gather of a padded embedding's weight lost row p's gradient: the module's own lookups as torch's, but
    also `weight[ids]` and `F.embedding(ids, weight)` elsewhere, where torch keeps it (refused by the first
    backward's check; silent with check_export=False)."""
    ref, om = pair(PaddedElsewhere(), exporter=exporter, check_export=False)
    ids = torch.tensor([[0, 1, 2, 1], [1, 0, 0, 3]])
    om(ids).backward()
    ref(ids).backward()
    assert_grads_equal(om, ref)
    assert float(ref.seq[0].weight.grad[1].abs().sum()) > 0 and float(ref.blocks[0]["emb"].weight.grad[0].sum()) == 0


@pytest.mark.parametrize("frozen", [False, True])
def test_batchnorm_without_running_stats(frozen: bool) -> None:
    """track_running_stats=False: batch statistics in training, and in evaluation too where the module has no
    running statistics; with them (`frozen`: the flag turned off to fine-tune with frozen statistics) evaluation
    reads them and training leaves them alone. The legacy exporter cannot export batch statistics with a dynamic
    batch. Every call of each mode is checked: the second refused the export ("another graph": the stand-in
    statistics the trace changed were constants of the graph), and onnxruntime wrote batch statistics into the
    frozen buffers at every training step."""
    module = nn.Sequential(nn.Linear(3, 4, bias=False), nn.BatchNorm1d(4, track_running_stats=frozen), nn.ReLU(),
                           nn.Linear(4, 2))
    if frozen:
        module[1].running_mean.uniform_(-1, 1)
        module[1].running_var.uniform_(0.5, 2)
        module[1].track_running_stats = False
    ref, om = pair(module)
    for mode in (True, False, True):
        om.train(mode)
        ref.train(mode)
        for rows in (6, 5, 6):
            om.zero_grad()
            ref.zero_grad()
            x, w = torch.randn(rows, 3), torch.randn(rows, 2)
            got, want = om(x), ref(x)
            torch.testing.assert_close(got, want)
            (got * w).sum().backward()
            (want * w).sum().backward()
            assert_grads_equal(om, ref)
    assert list(om.state_dict()) == list(ref.state_dict())
    if frozen:
        for b, c in zip(om.buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=0, atol=0)
    else:
        assert om[1].running_mean is None
    assert om.stats["exports"] == 2, om.stats



class FunctionalNorm(nn.Module):
    """A normalization layer of its own (a conditional or meta-learned BatchNorm's shape): F.batch_norm on its own
    buffers, which torch updates in place."""

    def __init__(self, channels: int, momentum: float):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(channels) + 0.5)
        self.bias = nn.Parameter(torch.randn(channels))
        self.register_buffer("running_mean", torch.randn(channels))
        self.register_buffer("running_var", torch.rand(channels) + 0.5)
        self.momentum = momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                            self.momentum, 1e-5)


@pytest.mark.parametrize("dims", [1, 2])
def test_batch_norm_called_on_a_modules_own_buffers_updates_them_as_torch(dims: int) -> None:
    """ONNX's training BatchNormalization updates the running variance by the batch's biased variance, torch by the
    unbiased one: the first call's check refused such a module (its buffers' new values differed). Now its
    statistics follow torch's over training steps, and evaluation reads them."""
    conv = dims == 2
    module = nn.Sequential(nn.Conv2d(2, 3, 3) if conv else nn.Linear(5, 3), FunctionalNorm(3, 0.3), nn.ReLU(),
                           nn.Flatten(), nn.Linear(3 * 4 * 4 if conv else 3, 2))
    ref, om = pair(module)
    for mode in (True, True, False, True):
        om.train(mode)
        ref.train(mode)
        om.zero_grad()
        ref.zero_grad()
        x, w = torch.randn(4, 2, 6, 6) if conv else torch.randn(6, 5), torch.randn(1, 2)
        got, want = om(x), ref(x)
        torch.testing.assert_close(got, want)
        (got * w).sum().backward()
        (want * w).sum().backward()
        assert_grads_equal(om, ref)
        for (name, b), c in zip(om.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-6, atol=1e-7, msg=name)


def test_batch_norm_called_on_a_modules_own_buffers_is_refused_under_dynamo() -> None:
    """dynamo writes that call in inference mode (normalizing by the running statistics) and drops the update; the
    first call's check cannot run where a buffer's change is lost, so its steps computed something else, silently."""
    om = ORTModule(nn.Sequential(nn.Linear(5, 3), FunctionalNorm(3, 0.3)), exporter="dynamo")
    with pytest.raises(ORTModuleError, match=r"batch_norm on 1.running_mean, 1.running_var in training .*dynamo "
                                             r"exporter writes in inference mode"):
        om(torch.randn(6, 5))

def test_batchnorm_without_affine_or_running_stats_in_float64() -> None:
    """Its stand-in statistics were torch.zeros' float32 (no weight to take the type from): the float64 module's
    export failed ("mixed dtype")."""
    ref, om = pair(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False),
                                 nn.Tanh(), nn.Linear(4, 2)).double())
    x = torch.randn(6, 3, dtype=torch.float64)
    for m in (om, ref):
        m(x).square().sum().backward()
    assert_grads_equal(om, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_batchnorm_has_torchs_eps(exporter: str) -> None:
    """BatchNormalization holds eps as a float32 attribute (1e-5 is 9.99999975e-6 there): 4e-10 off torch's
    gradients through a float64 CNN whose channels vary little. Over inputs scaled by sqrt(f / eps) (the running
    statistics too, in evaluation) and batch statistics scaled back: torch's outputs, gradients and running
    statistics to 1e-11 (they were 3e-8 off; the rest is rounding, which centering inputs this small amplifies), in
    training (tracked statistics, none) and in evaluation."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, eps=1e-5), nn.Tanh(), nn.Conv2d(4, 3, 1),
                        nn.BatchNorm2d(3, eps=3e-4, track_running_stats=False)).double()
    ref, om = pair(net, exporter=exporter)
    for training in (True, True, False):
        for m in (ref, om):
            m.train(training)
        x = torch.randn(3, 2, 5, 5, dtype=torch.float64) * 0.003
        got, want = om(x), ref(x)
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)
        got.square().sum().backward()
        want.square().sum().backward()
        assert_grads_equal(om, ref, rtol=1e-11, atol=1e-11)  # the biases before a norm: 0 but for rounding
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(om.module[1], name), getattr(ref[1], name), rtol=1e-11, atol=1e-16)


def test_batchnorm_on_one_value_per_channel_raises_as_torch() -> None:
    """A last batch of one in training: torch raises; the graph computed its unbiased variance as NaN (0 * n / (n -
    1)) and wrote it into the running variance, so every evaluation after it was NaN."""
    ref, om = pair(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)))
    om(torch.randn(8, 5)).sum().backward()
    ref(torch.randn(8, 5))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        ref(torch.randn(1, 5))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        om(torch.randn(1, 5))
    assert torch.isfinite(om[1].running_var).all()
    om.eval()
    assert torch.isfinite(om(torch.randn(3, 5))).all()


# --- nn.Module behaviour ---------------------------------------------------------------------------------------
def test_the_module_s_state_dict_hooks_run_for_the_ortmodule() -> None:
    """A key-renaming shim, metadata added by a post hook and unexpected keys cleared on load: the wrapper's
    state_dict skipped the module's own hooks (other keys than the module's; a load the module accepts raised)."""
    class Shimmed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 2)
            self._register_state_dict_hook(Shimmed._renamed)
            self._register_load_state_dict_pre_hook(Shimmed._unrenamed)
            self.register_load_state_dict_post_hook(Shimmed._unexpected_cleared)

        @staticmethod
        def _renamed(module, state, prefix, local) -> None:
            for k in [k for k in state if k.startswith(prefix + "a.")]:
                state[k.replace(prefix + "a.", prefix + "old_a.")] = state.pop(k)

        @staticmethod
        def _unrenamed(state, prefix, local, strict, missing, unexpected, errors) -> None:
            for k in [k for k in state if k.startswith(prefix + "old_a.")]:
                state[k.replace(prefix + "old_a.", prefix + "a.")] = state.pop(k)

        @staticmethod
        def _unexpected_cleared(module, keys) -> None:
            keys.unexpected_keys.clear()

    plain, om = Shimmed(), ORTModule(Shimmed())
    assert list(om.state_dict()) == list(plain.state_dict()) == ["old_a.weight", "old_a.bias"]
    state = {**plain.state_dict(), "junk": torch.zeros(1)}
    om.load_state_dict(state)
    plain.load_state_dict(state)
    torch.testing.assert_close(om.module.a.weight, plain.a.weight)


def test_state_dict_round_trip() -> None:
    m = MLP()
    om = ORTModule(m)
    assert list(om.state_dict()) == list(m.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [n for n, _ in om.named_parameters()] == [n for n, _ in m.named_parameters()]
    fresh = MLP()
    fresh.load_state_dict(om.state_dict())
    x = torch.randn(2, 8)
    torch.testing.assert_close(fresh(x), om(x))
    other = MLP()
    om.load_state_dict(other.state_dict())
    torch.testing.assert_close(om(x), other(x))  # the cached parameter OrtValues see the new values
    parent = nn.Sequential(om, nn.ReLU())
    assert list(parent.state_dict()) == ["0.fc1.weight", "0.fc1.bias", "0.fc2.weight", "0.fc2.bias"]
    parent.load_state_dict(nn.Sequential(MLP(), nn.ReLU()).state_dict())
    copied = copy.deepcopy(om)
    torch.testing.assert_close(copied(x), om(x))
    unpickled = pickle.loads(pickle.dumps(om))  # sessions are not pickled, they are rebuilt
    torch.testing.assert_close(unpickled(x), om(x))


def test_optimizer_and_scheduler_unchanged() -> None:
    ref, om = pair(MLP())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (om, ref)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    for _ in range(5):
        for m, opt, sched in zip((om, ref), opts, scheds):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            sched.step()
    for p, q in zip(om.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_attribute_passthrough() -> None:
    m = MLP()
    m.config = {"hidden": 16}
    om = ORTModule(m)
    assert om.config == {"hidden": 16} and om.fc1 is m.fc1 and om.module is m


# --- errors, fallback, debugging ------------------------------------------------------------------------
class WithSTFT(nn.Module):
    """A short-time Fourier transform's power (ONNX's STFT), for an op on the gradient path without a gradient rule
    under `without_rule` (the standard ops torch's exporters write all have one)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(16) + 0.1 * torch.randn(16))

    def forward(self, x):
        frames = torch.stft(self.w * x, 8, hop_length=4, window=torch.hann_window(8), center=False,
                            return_complex=False)
        return frames.pow(2).sum()


@contextlib.contextmanager
def without_rule(op_type: str) -> Iterator[None]:
    """The rule table without `op_type`'s rules while the body runs."""
    saved = registry._RULES.pop(("", op_type))
    registry.lookup.cache_clear()
    try:
        yield
    finally:
        registry._RULES[("", op_type)] = saved
        registry.lookup.cache_clear()


def test_unsupported_op_is_a_clear_error() -> None:
    """At every call: the one after the failed build ran in torch without a word."""
    with without_rule("STFT"):
        om = ORTModule(WithSTFT())
        for _ in range(2):
            with pytest.raises(ORTModuleError, match=r"ORTModule\(WithSTFT\).*\bSTFT\b.*no gradient rule"):
                om(torch.randn(2, 16)).backward()
    assert om.stats["fallbacks"] == 0


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_call_without_grad_after_a_refused_gradient_build_runs_on_onnxruntime(exporter: str) -> None:
    """The refused build's call left torch's outputs of its export behind: the next call, without grad, compared its
    own outputs with them and refused the module as computing something else."""
    ref, om = pair(WithSTFT(), exporter=exporter)
    with without_rule("STFT"):
        with pytest.raises(ORTModuleError, match="no gradient rule"):
            om(torch.randn(2, 16)).backward()
        x = torch.randn(2, 16)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(om(x), ref(x))


class STFTThroughView(WithSTFT):
    """WithSTFT over `ThroughView`'s features (a ReLU in place through a view, which the export leaves out)."""

    def __init__(self):
        super().__init__()
        self.features = ThroughView()

    def forward(self, x):
        return super().forward(self.features(x).repeat(1, 3)[:, :16])


def test_a_call_after_a_refused_gradient_build_is_checked_in_its_place() -> None:
    """The export's check, which the refused call never reached, is the next call's: on its own outputs."""
    om = ORTModule(STFTThroughView())
    with without_rule("STFT"):
        with pytest.raises(ORTModuleError, match="no gradient rule"):
            om(torch.randn(4, 4)).backward()
        with torch.no_grad(), pytest.raises(ORTModuleError, match=r"export check failed.*output 0 of 1 \(\) differs"):
            om(torch.randn(4, 4))


def test_a_failed_export_is_tried_again_at_the_next_call() -> None:
    """Refusals by the checks hold for the schema; a failed export does not: the module may be fixed in between (an
    attribute turning off what has no export)."""
    class Switched(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.exotic = nn.Linear(4, 4), True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return torch.linalg.matrix_exp(h.reshape(-1, 2, 2)).sum() if self.exotic else h.sum()

    om = ORTModule(Switched())
    with pytest.raises(ORTModuleError, match="export failed"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        om(torch.randn(2, 4))
    om.exotic = False
    om(torch.randn(2, 4)).backward()
    assert om.module.fc.weight.grad is not None


def test_quantization_aware_training_is_refused_by_its_operator_with_the_buffers_put_back() -> None:
    """torch.ao's QAT observers size their per-channel statistics at the first call (resize_ in place): putting the
    buffers back after the failed trace failed on the new size ("size of tensor a (8) must match ... (0)"), which
    hid the operator neither exporter translates. Now that operator is named and the buffers are as they were."""
    from torch.ao import quantization

    model = nn.Sequential(quantization.QuantStub(), nn.Linear(6, 8), quantization.DeQuantStub())
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantization.prepare_qat(model.train())
    before = {name: b.clone() for name, b in model.named_buffers()}
    with pytest.raises(ORTModuleError, match="fused_moving_avg_obs_fake_quant"):
        ORTModule(model)(torch.randn(5, 6))
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, before[name], msg=name)


class Scored(nn.Module):
    """A loss with its accuracy (`how` it is returned), a literal and the count of calls so far."""

    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how, self.calls = nn.Linear(4, 3), how, 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        logits = self.fc(x)
        accuracy = (logits.argmax(1) == y).float().mean()
        if self.how == "counted":
            self.calls += 1
        returned = {"item": accuracy.item(), "tensor": accuracy, "counted": self.calls}[self.how]
        return F.cross_entropy(logits, y), returned, 0.5


@pytest.mark.parametrize("how", ["item", "tensor", "counted"])
def test_python_numbers_a_forward_returns_are_each_call_s(how: str) -> None:
    """`loss, acc.item()` returned the first call's accuracy at every step, silently (the trace keeps the number).
    A number a conversion made is now refused at the export, and one that differs at the second call (a count kept
    in a Python attribute) when that call exports again; a tensor and a literal are returned as torch's."""
    torch.manual_seed(0)
    ref, om = pair(Scored(how))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(4)]
    if how != "tensor":
        with pytest.raises(ORTModuleError, match=r"returns Python numbers (computed from tensors|that differ)"):
            for x, y in batches:
                om(x, y)
        return
    for x, y in batches:
        want, got = ref(x, y), om(x, y)
        torch.testing.assert_close(got[:2], want[:2])
        assert got[2] == 0.5


def test_fallback_warns_and_matches_torch() -> None:
    ref, om = pair(WithSTFT(), fallback=True)
    x = torch.randn(2, 16)
    with without_rule("STFT"):
        with pytest.warns(FallbackWarning, match="FALLBACK"):
            out = om(x)
        out.backward()
        ref(x).backward()
        assert_grads_equal(om, ref)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # inference needs no gradient rule: runs on onnxruntime
            torch.testing.assert_close(om(x), ref(x))


def test_a_bfloat16_computation_is_refused_by_name() -> None:
    """Falcon's alibi (`slopes.bfloat16() * positions`): the legacy exporter wrote the cast to ONNX's COMPLEX128 and
    the first run failed naming that type, pointing the wrong way."""
    class Alibi(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            alibi = (torch.tensor([0.5, 0.25])[:, None].bfloat16() * ids[:, None, :]).float()
            return (self.fc(x) * alibi.sum(1)[..., None]).sum()

    with pytest.raises(ORTModuleError, match=r"computes in bfloat16 \(node .*COMPLEX128\).*compute it in float32"):
        ORTModule(Alibi())(torch.randn(2, 5, 4), torch.arange(5).expand(2, 5))


def test_export_failure_is_a_clear_error() -> None:
    class Cholesky(nn.Module):
        def forward(self, x):
            return torch.linalg.cholesky(x @ x.T + torch.eye(3))  # no ONNX export for aten::linalg_cholesky

    with pytest.raises(ORTModuleError, match=r"ORTModule\(Cholesky\): the export failed.*linalg_cholesky"):
        ORTModule(Cholesky())(torch.randn(3, 3))


class ProjectedLSTM(nn.Module):
    """dynamo exports an LSTM with projections (proj_size) as ONNX's LSTM, whose cell state is then sized by the
    projection: onnxruntime refuses the graph's first run (the runtime unrolls such layers while exporting,
    `runtime/packed.py`; the test below turns that off to get an export onnxruntime cannot run)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 6, proj_size=2, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def test_an_export_onnxruntime_cannot_run_fails_as_an_export_does(monkeypatch) -> None:
    """The first run of an export fails only where the export is wrong (torch ran the same call): an ORTModuleError
    naming the stage and onnxruntime's reason, or with fallback torch's result and a warning; later calls the same."""
    monkeypatch.setattr(export_module, "exportable_packing", contextlib.nullcontext)
    x = torch.randn(4, 5, 3)
    with pytest.raises(ORTModuleError, match=r"ProjectedLSTM\): the first onnxruntime run of the export failed.*"
                                             r"initial_c"):
        ORTModule(ProjectedLSTM(), exporter="dynamo")(x)
    model = ProjectedLSTM()
    om = ORTModule(copy.deepcopy(model), exporter="dynamo", fallback=True)
    for _ in range(2):
        with pytest.warns(FallbackWarning) if om.stats["fallbacks"] == 0 else contextlib.nullcontext():
            torch.testing.assert_close(om(x), model(x))
    assert om.stats["fallbacks"] == 1 and om.stats["exports"] == 1


class Checkpointed(nn.Module):
    """A block under reentrant activation checkpointing (torch's CheckpointFunction), then a head."""

    def __init__(self):
        super().__init__()
        self.block, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(torch.utils.checkpoint.checkpoint(lambda h: torch.tanh(self.block(h)), x,
                                                           use_reentrant=True))


@pytest.mark.parametrize("input_grad", [True, False])
def test_reentrant_checkpointing_as_torch(input_grad: bool) -> None:
    """The checkpointed function runs as it is; where no input requires grad, torch's reentrant checkpoint gives
    its outputs none, so the block's parameters get None and only the head trains (torch warns of it at each
    call; the export, which runs the module once, does not)."""
    model = Checkpointed()
    om = ORTModule(copy.deepcopy(model))
    x = torch.randn(4, 6, requires_grad=input_grad)
    om(x).square().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x.detach().requires_grad_(input_grad)).square().sum().backward()
    for (name, p), q in zip(om.named_parameters(), model.parameters()):
        assert (p.grad is None) == (q.grad is None) == (name.startswith("block") and not input_grad), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


class RoundStraightThrough(torch.autograd.Function):
    """Quantization-aware training's straight-through estimator: round, pass the gradient on unchanged."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class FastTanh(torch.autograd.Function):
    """A Function whose backward is its forward's own derivative (as transformers' Bloom GELU)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Quantized(nn.Module):
    """Rounds its features by the Function, by the same estimator written with detach() ("trick"), or rounds its
    input by the Function ("input": nothing there requires grad); "exact" takes FastTanh instead of rounding."""

    def __init__(self, how: str = "function"):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        if self.how == "input":
            return (self.fc(RoundStraightThrough.apply(x * 4)) * x).sum()
        h = self.fc(x) * 4
        if self.how == "exact":
            return (FastTanh.apply(h) * x).sum()
        rounded = h + (torch.round(h) - h).detach() if self.how == "trick" else RoundStraightThrough.apply(h)
        return (rounded * x).sum()


def test_custom_autograd_functions_are_refused() -> None:
    """A Function's own backward is not in the exported graph (onnxruntime would differentiate its forward: zero
    gradients through the round): one whose backward differs from its forward's derivative is refused by name;
    fallback runs it in torch; one computing its forward's derivative, the detach() form of the estimator, and
    the Function on tensors that need no gradient train on onnxruntime with torch's gradients."""
    x = torch.randn(3, 4)
    with pytest.raises(ORTModuleError, match=r"the export failed.*Quantized applies torch.autograd.Function "
                                             r"test_ortmodule.RoundStraightThrough to tensors that require grad"):
        ORTModule(Quantized())(x)
    for module, kwargs, expected in ((Quantized(), {"fallback": True}, FallbackWarning),
                                     (Quantized("trick"), {}, None), (Quantized("input"), {}, None),
                                     (Quantized("exact"), {}, None)):
        ref, om = pair(module, **kwargs)
        with pytest.warns(expected, match="RoundStraightThrough") if expected else contextlib.nullcontext():
            om(x).backward()
        ref(x).backward()
        assert_grads_equal(om, ref)
        assert ref.fc.weight.grad.abs().sum() > 0

    # exported with every parameter frozen (a warm-up), the Function was applied to nothing requiring grad and
    # went unchecked: unfrozen, the same export trained with zero gradients through the round, silently. A
    # gradient build exports again first, checking it
    om = ORTModule(Quantized())
    om.requires_grad_(False)
    om(x)
    om.requires_grad_(True)
    for _ in range(2):
        with pytest.raises(ORTModuleError, match=r"export failed.*RoundStraightThrough to tensors that require"):
            om(x).backward()
    ref, frozen = pair(Quantized("input"))  # on the input: never differentiated, trains as above
    frozen.requires_grad_(False)
    frozen(x)
    frozen.requires_grad_(True)
    frozen(x).backward()
    ref(x).backward()
    assert_grads_equal(frozen, ref)
    assert frozen.stats["exports"] == 2


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_custom_functions_under_either_exporter(exporter: str) -> None:
    """Under dynamo too, a Function whose backward is its forward's derivative (Bloom's GELU) trains with torch's
    gradients, and a straight-through estimator is refused by name. Dynamo's check for lost no_grad blocks had
    refused both, reading the Function's forward (which torch runs without grad) as one."""
    x = torch.randn(3, 4)
    with pytest.raises(ORTModuleError, match=r"RoundStraightThrough to tensors that require grad"):
        ORTModule(Quantized(), exporter=exporter)(x)
    ref, om = pair(Quantized("exact"), exporter=exporter)
    for _ in range(2):
        om(x).backward()
        ref(x).backward()
    assert_grads_equal(om, ref, rtol=1e-4, atol=1e-5)  # float32 tanh: onnxruntime's and torch's differ by an ulp


class ThroughView(nn.Module):
    """ReLU applied in place through a view of the features, the features returned: torch's tracer records the
    ReLU on the view only, so the export returns the features without it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        F.relu_(h.view(-1, 2, 3))
        return h


def test_export_computing_something_else_is_refused() -> None:
    """onnxruntime's outputs of the exporting call are compared with torch's: a graph that differs fails as an
    export does (named, fallback runs torch); check_export=False skips the comparison."""
    x = torch.randn(5, 4)
    with pytest.raises(ORTModuleError, match=r"export check failed.*output 0 of 1 \(5, 6\) differs by up to"):
        ORTModule(ThroughView())(x)
    ref, om = pair(ThroughView(), fallback=True)
    with pytest.warns(FallbackWarning, match="differ from torch's"):
        out = om(x)
    torch.testing.assert_close(out, ref(x))
    assert (ORTModule(ThroughView(), check_export=False)(x) < 0).any()  # the export's graph: no ReLU


class CountsThroughView(nn.Linear):
    """Counts of positive features, one added in place through a view: torch's tracer records the addition on
    the view only, so the legacy export returns the counts without it (dynamo's functionalization keeps it)."""

    def __init__(self) -> None:
        super().__init__(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = super().forward(x)
        n = (h > 0).sum(-1)
        n.view(-1, 1).add_(1)
        return h, n


def test_integer_outputs_computing_something_else_are_refused() -> None:
    """The check compares integer and boolean outputs exactly: a count off by one passed before (floats only)."""
    x = torch.randn(5, 4)
    with pytest.raises(ORTModuleError, match=r"export check failed.*output 1 of 2 \(5,\) differs at 5 of 5 elements "
                                             r"\(at \(0,\): \d on onnxruntime, \d in torch\)"):
        ORTModule(CountsThroughView())(x)
    ref, om = pair(CountsThroughView(), exporter="dynamo")
    assert torch.equal(om(x)[1], ref(x)[1])


def test_an_output_of_another_dtype_than_torch_s_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check compares dtypes before values: a float32 model's sum times a 0-d float64 buffer is float64 in
    torch, and the legacy exporter writes it in float32 (`double_scalars` keeps it float64). Without that pass,
    the float32 output within rounding of torch's float64 one passed the check."""
    class Scaled(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 3)
            self.register_buffer("scale", torch.tensor(0.1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = super().forward(x)
            return y, y.sum() * self.scale

    from runtime import double_scalars
    x = torch.randn(5, 4)
    assert ORTModule(Scaled())(x)[1].dtype == torch.float64
    monkeypatch.setattr(double_scalars, "in_double", lambda model, *args: model)
    with pytest.raises(ORTModuleError, match=r"export check failed.*output 1 of 2 \(\) is float32 on onnxruntime, "
                                             r"float64 in torch. The export computes it in another type"):
        ORTModule(Scaled())(x)


def test_dynamo_export_computing_something_else_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's exports are checked too, against the call torch runs before exporting (dynamo's trace runs fake
    tensors): a graph whose output is off (here made so after the export) fails as an export does; a right one,
    BatchNorm switched to training mode included, passes, and its running statistics move once a call, as torch's."""
    def scaled(g: onnx.GraphProto) -> None:
        _split(g)
        out = g.output[0].name
        for n in g.node:
            n.output[:] = [o + "/right" if o == out else o for o in n.output]
        g.node.append(helper.make_node("Mul", [out + "/right", "one_and_a_half"], [out]))
        g.initializer.append(onnx.numpy_helper.from_array(np.array(1.5, dtype=np.float32), "one_and_a_half"))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))

    from runtime import export as export_module
    _split = export_module._split_sequences_to_slices
    x = torch.randn(5, 4)
    ref, om = pair(net(), exporter="dynamo")
    for _ in range(2):
        om(x).sum().backward()
        ref(x).sum().backward()
    assert_grads_equal(om, ref)
    torch.testing.assert_close(om.module[1].running_mean, ref[1].running_mean)
    assert om.stats["fallbacks"] == 0
    monkeypatch.setattr(export_module, "_split_sequences_to_slices", scaled)
    with pytest.raises(ORTModuleError, match=r"export check failed.*output 0 of 1 \(5, 3\) differs by up to"):
        ORTModule(net(), exporter="dynamo")(x)


def test_empty_batch_computes_as_torch() -> None:
    """A batch of 0 (the last of a filtered dataset) gives torch's empty outputs, gradients and BatchNorm
    statistics between full batches (a Conv's backward reshaped it by -1, which cannot size an empty tensor)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(4 * 9, 3))

    ref, om = net(), ORTModule(net())
    for n in (4, 0, 3):
        x = torch.randn(n, 1, 8, 8)
        om.zero_grad()
        ref.zero_grad()
        got, want = om(x), ref(x)
        assert got.shape == want.shape == (n, 3)
        (got.sum() + sum(p.sum() for p in om.parameters()) * 0.1).backward()
        (want.sum() + sum(p.sum() for p in ref.parameters()) * 0.1).backward()
        assert_grads_equal(om, ref)
        torch.testing.assert_close(om.module[1].running_mean, ref[1].running_mean)


class FakeQuantized(nn.Module):
    """Quantization-aware training's fake quantization (steps of 1/64, the gradient straight through) of two
    layers' outputs: float rounding moves a few of them across a .5 boundary in onnxruntime, a step apart."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 1024)

    @staticmethod
    def quantized(x):
        return x + (torch.round(x * 64) / 64 - x).detach()

    def forward(self, x):
        return self.quantized(self.b(self.quantized(torch.relu(self.a(x)))))


def test_export_check_passes_rounding_tipped_the_other_way() -> None:
    """The check fails an output only where more than 0.1% of it differs: fake quantization's few elements a
    step apart pass (a check on the largest difference alone refused this model), as its gradients do."""
    ref, om = pair(FakeQuantized())
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0)) * 3
    got, want = om(x), ref(x)
    apart = (got - want).abs() > 1e-4
    assert int(apart.sum()) <= 1e-3 * got.numel()
    torch.testing.assert_close(got[apart].sub(want[apart]).abs(), torch.full((int(apart.sum()),), 1 / 64))
    got.square().mean().backward()
    want.square().mean().backward()
    assert_grads_equal(om, ref, rtol=1e-3, atol=1e-5)


def test_export_check_passes_outputs_zero_by_the_math() -> None:
    """An output zero by the math (a normalized activation's mean, returned as a statistic next to the logits) is
    rounding noise in torch and onnxruntime alike: checked against the call's largest output, not its own (which
    refused such modules for most seeds), while an output that is wrong still fails."""
    class Monitored(nn.Module):
        def __init__(self, norm: nn.Module, wrong: bool = False):
            super().__init__()
            self.fc, self.norm, self.head, self.wrong = nn.Linear(16, 32), norm, nn.Linear(32, 4), wrong

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.norm(self.fc(x))
            means = h.mean(-1)
            if self.wrong:  # an in-place change through a view, which the tracer misses
                means.view(-1)[:1].add_(1e-3)
            return self.head(torch.relu(h)), means.mean()

    for seed in range(5):
        for norm in (lambda: nn.LayerNorm(32, elementwise_affine=False), lambda: nn.BatchNorm1d(32)):
            torch.manual_seed(seed)
            ref, om = pair(Monitored(norm()))
            x = torch.randn(8, 16)
            for got, want in zip(om(x), ref(x)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ORTModuleError, match="output 1 of 2"):
        ORTModule(Monitored(nn.LayerNorm(32, elementwise_affine=False), wrong=True))(torch.randn(8, 16))


@contextlib.contextmanager
def wrong_tanh_rule() -> Iterator[None]:
    """Tanh's gradient rule without its 1 - y^2 while the block runs (the rule table and its lookup cache)."""
    from gradbuilder.rules import registry

    [tanh] = registry._RULES["", "Tanh"]
    registry._RULES["", "Tanh"] = [dataclasses.replace(tanh, fn=lambda g: (g.GO(0),))]
    registry.lookup.cache_clear()
    try:
        yield
    finally:
        registry._RULES["", "Tanh"] = [tanh]
        registry.lookup.cache_clear()


class _Scaled(nn.Module):
    """A read-only buffer multiplied in (a scale, a mask, RoPE's cos/sin cache): the trace's graph saves it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("layer", ["batchnorm", "batchnorm-eval", "buffer"])
def test_the_first_gradients_are_checked_where_the_backward_reads_a_buffer(exporter: str, layer: str) -> None:
    """The export put every buffer back with an in-place copy (and the running statistics were updated in place),
    bumping version counters the trace's graph had saved: torch refused to differentiate it, and the first-gradient
    check was skipped without a word for most CNNs and many transformers (a wrong rule passed). Buffers are put back
    and updated as torch's BatchNorm kernel updates them, their versions left as they were."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        middle = nn.BatchNorm1d(8) if layer.startswith("batchnorm") else _Scaled()
        return nn.Sequential(nn.Linear(4, 8), middle, nn.Tanh(), nn.Linear(8, 2)).train(layer != "batchnorm-eval")

    with wrong_tanh_rule(), pytest.raises(ORTModuleError, match="gradient check failed"):
        ORTModule(net(), exporter=exporter)(torch.randn(5, 4)).sum().backward()



class _FlippedRelu(torch.autograd.Function):
    """ReLU whose gradient passes at one element where the forward's sign says it should not, or the reverse: what
    a float32 run whose rounding took a pre-activation within rounding of 0 to the other side computes."""

    @staticmethod
    def forward(ctx, s: torch.Tensor, index: int) -> torch.Tensor:
        mask = s > 0
        mask.view(-1)[index] = ~mask.view(-1)[index]
        ctx.save_for_backward(mask)
        return s.clamp(min=0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.saved_tensors[0], None


def test_the_gradient_check_lets_float64_arbitrate_a_relu_flipped_by_rounding() -> None:
    """A ResNet's ReLU after a BatchNorm whose input is within float32 rounding of 0 passes its gradient in one run
    and not in the other; the BatchNorm spreads that element over its channel and every layer below, and the
    float32 comparison refused ResNet-18s half the time. torch's float64 gradients of the call now arbitrate:
    onnxruntime's as such a run computes them pass, a wrong gradient still fails, named with both distances, and
    so does a NaN where torch's gradient is finite."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 4))
    x = torch.randn(128, 8)
    net64 = copy.deepcopy(net).double()
    incoming = [torch.randn(128, 4)]

    def float64_call() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [net64(x.double())], list(net64.parameters())

    s = net64[1](net64[0](x.double()))
    y = net64[3](_FlippedRelu.apply(s, int(s.abs().argmin())))
    flipped = [g.float() for g in torch.autograd.grad(y, list(net64.parameters()), incoming[0].double())]
    refusals: list[Exception] = []

    def check(ours: list[torch.Tensor], arbiter: bool) -> list[torch.Tensor | None]:
        refusals.clear()  # a fresh float32 reference each time: the check differentiates it once
        gradient_check = checks.gradient_check([net(x)], list(net.parameters()), refusals.append, (),
                                               float64_call if arbiter else None)
        return gradient_check(incoming, ours)

    assert check(flipped, arbiter=False) is not flipped and "float64" not in str(refusals[0])
    assert check(flipped, arbiter=True) is flipped and not refusals
    wrong = [g.clone() for g in flipped]
    wrong[0] = wrong[0] * 1.1  # the first layer's weight 10% off
    check(wrong, arbiter=True)
    assert re.search(r"gradient 0 of 6 .* \(from torch's float64 gradients of the call, onnxruntime's are up to "
                     r"0\.\d+ apart relatively in L2, torch's float32 ones \d", str(refusals[0]))
    nan = [g.clone() for g in flipped]
    nan[2][3] = float("nan")  # one NaN where torch's gradient is finite (the arbiter read NaNs as no distance)
    assert check(nan, arbiter=True) is not nan
    assert "from torch's float64 gradients of the call, onnxruntime's are up to inf apart" in str(refusals[0])


def test_a_resnet_with_a_relu_flipped_by_rounding_trains() -> None:
    """A small ResNet whose first gradients, on this machine, come from a run that flipped one pre-activation of
    7e-7 (the float64 gradients with that ReLU flipped match onnxruntime's to 7e-7): refused by the float32
    comparison, it trains, its gradients as close to float64's as the arbitration allows."""
    class Basic(nn.Module):
        def __init__(self, i: int, o: int, stride: int) -> None:
            super().__init__()
            self.f = nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU(),
                                   nn.Conv2d(o, o, 3, 1, 1, bias=False), nn.BatchNorm2d(o))
            self.sc = nn.Sequential(nn.Conv2d(i, o, 1, stride, bias=False), nn.BatchNorm2d(o)) if stride > 1 \
                else nn.Sequential()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.f(x) + self.sc(x))

    torch.manual_seed(6)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), Basic(16, 16, 1),
                        Basic(16, 32, 2), Basic(32, 64, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    exact = copy.deepcopy(net).double()
    F.cross_entropy(exact(x.double()), y).backward()
    reference = copy.deepcopy(net)
    reference(x)
    om = ORTModule(net)
    F.cross_entropy(om(x), y).backward()
    for p, q in zip(om.parameters(), exact.parameters()):
        assert float((p.grad.double() - q.grad).norm() / q.grad.norm()) < checks.KINK_TOLERANCE
    for (name, b), c in zip(om.module.named_buffers(), reference.buffers()):  # the float64 call left them alone
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)

def test_an_eval_call_and_a_training_call_share_one_backward() -> None:
    """A consistency loss between an eval-mode and a training-mode call of one BatchNorm network: the training
    call's running-statistics update bumped the version of the statistics the eval call's graph had saved, and the
    backward raised torch's "modified by an inplace operation" on a tensor the user never touched."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ref, om = copy.deepcopy(net), ORTModule(net)
    for _ in range(3):
        x = torch.randn(32, 8)
        for m in (om, ref):
            m.zero_grad()
            teacher = m.eval()(x)
            student = m.train()(x)
            (student - teacher).pow(2).mean().backward()
        assert_grads_equal(om, ref)
        torch.testing.assert_close(om.module[1].running_var, ref[1].running_var)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_first_gradients_checked_against_torch(exporter: str) -> None:
    """The first backward of an export is compared with torch's gradients of the traced call (dynamo's: the call
    torch ran before exporting): a wrong gradient rule fails it from backward, named, and every later call of the
    refused graph fails too (the next one ran it); with fallback that step gets torch's gradients and later calls
    run in torch; check_export=False leaves onnxruntime's."""
    x = torch.randn(5, 4)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    ref = net()
    with wrong_tanh_rule():
        refused = ORTModule(net(), exporter=exporter)
        for _ in range(2):
            with pytest.raises(ORTModuleError, match=r"gradient check failed.*gradients of the call that exported "
                                                     r"the module differ from torch's: gradient \d+ of 4 \(8, 4\)"):
                refused(x).sum().backward()
        om = ORTModule(net(), fallback=True, exporter=exporter)
        with pytest.warns(FallbackWarning, match="gradient check"):
            om(x).sum().backward()
        ref(x).sum().backward()
        assert_grads_equal(om, ref)
        om(x).sum().backward()  # in torch now
        ref(x).sum().backward()
        assert_grads_equal(om, ref)
        unchecked = ORTModule(net(), check_export=False, exporter=exporter)
        unchecked(x).sum().backward()
    assert not torch.allclose(unchecked.module[0].weight.grad, ref[0].weight.grad / 2, rtol=1e-3)


class DroppedTransposed(nn.Linear):
    """A dropout of a transposed view: torch draws its mask in memory order (`dropouts._drawn_in_memory_order`)."""

    def __init__(self) -> None:
        super().__init__(4, 64)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.dropout(torch.tanh(super().forward(x)).t(), 0.5, self.training)).t()


DROPOUT_NETS = {
    "feature-major chain": lambda: nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 3)),
    "transposed view": DroppedTransposed,
}


@pytest.mark.parametrize("torch_dropout", [True, False])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", DROPOUT_NETS)
def test_dropout_models_are_checked_with_torch_s_masks(kind: str, exporter: str, torch_dropout: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The call that exported draws its Dropout masks from torch's generator as torch's dropout does, from the
    state the trace began with (every call does under torch_dropout), so its outputs and gradients are checked as a
    deterministic graph's: a wrong gradient rule fails, and the check's float64 arbiter draws the same masks again
    (its outputs are the call's, as are torch's). Also where the graph holds the mask in another layout than
    torch's: a Linear chain computed feature-major (without torch_dropout), a dropout of a transposed view."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return DROPOUT_NETS[kind]()

    x = torch.randn(16, 4)
    arbiters = []

    def recording(*args):
        arbiters.append(args[-1])
        return gradient_check(*args)

    gradient_check = checks.gradient_check
    monkeypatch.setattr(checks, "gradient_check", recording)
    ref, om = pair(net(), exporter=exporter, torch_dropout=torch_dropout)
    torch.manual_seed(1)
    want = ref(x)
    torch.manual_seed(1)
    y = om(x)
    y.sum().backward()
    [arbiter] = arbiters
    [again], _ = arbiter()
    assert again.dtype == torch.float64 and (y == 0).sum() < y.numel()
    for other in (again.float(), want):  # the same masks: half the units dropped
        torch.testing.assert_close(other, y, rtol=1e-5, atol=1e-6)
    with wrong_tanh_rule(), pytest.raises(ORTModuleError, match=r"gradient check failed.*gradient \d+ of 4 \(64, 4\)"):
        ORTModule(net(), exporter=exporter, torch_dropout=torch_dropout)(x).sum().backward()


class Noised(nn.Module):
    """A Tanh between two Linears and a random function of its output: `noise(h)`."""

    def __init__(self, noise: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.a, self.b, self.noise = nn.Linear(4, 8), nn.Linear(8, 3), noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.noise(torch.tanh(self.a(x))))


DRAWN_AS_TORCH = {  # random functions the host draws as torch under torch_dropout
    "randn_like": lambda h: h + torch.randn_like(h),
    "Hugging Face's drop_path": lambda h: h * (0.7 + torch.rand((h.shape[0], 1), dtype=h.dtype)).floor() / 0.7,
    "normal of a tensor": lambda h: h + torch.normal(h, 0.5) + torch.normal(0.0, torch.sigmoid(h)),
    "gumbel_softmax": lambda h: h + F.gumbel_softmax(h, tau=0.5),
}

DRAWN_OTHERWISE = {  # random functions torch draws with kernels of its own, which the graph draws otherwise
    "cauchy_": lambda h: h + torch.empty_like(h).cauchy_(),
    "log_normal_": lambda h: h * torch.empty_like(h).log_normal_(0.0, 0.25),
    "geometric_": lambda h: h * torch.empty_like(h).geometric_(0.5),
    "randint_like": lambda h: h * torch.randint_like(h, 0, 3),
}


@pytest.mark.parametrize("torch_dropout", [True, False])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", DRAWN_AS_TORCH)
def test_random_functions_drawn_as_torch_are_checked(kind: str, exporter: str, torch_dropout: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The host draws randn_like, rand, torch.normal and exponential_ (gumbel_softmax's) with torch's kernels, as
    torch does at the call that exported (at every call under torch_dropout), so that call is checked as a
    deterministic graph: its outputs are torch's from the same seed, and so are the float64 arbiter's, which draws
    them in float32 (`checks.float32_draws`: float64 draws are other numbers); a wrong rule fails. Later calls
    without torch_dropout draw from the call's seed: the same from run to run. Before, any random op but Dropout
    skipped the check (and exponential_'s uniforms stayed in the graph, unread but drawn by onnxruntime).
    torch.normal gives its tensor mean and std no gradient, as torch does (the graph's mean + std z passed them
    one)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return Noised(DRAWN_AS_TORCH[kind])

    def calls(m: nn.Module) -> list[torch.Tensor]:
        outputs = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            y = m(x)
            y.square().sum().backward()
            outputs.append(y.detach())
        return outputs

    x = torch.randn(16, 4)
    arbiters = []
    gradient_check = checks.gradient_check
    monkeypatch.setattr(checks, "gradient_check", lambda *args: arbiters.append(args[-1]) or gradient_check(*args))
    ref, om = pair(net(), exporter=exporter, torch_dropout=torch_dropout)
    torch.manual_seed(1)
    ref(x).square().sum().backward()
    torch.manual_seed(1)
    got = om(x)
    got.square().sum().backward()
    assert_grads_equal(om, ref)
    [arbiter] = arbiters
    [again], _ = arbiter()
    torch.manual_seed(1)
    want = ref(x)
    assert again.dtype == torch.float64
    for other in (again.float(), want):
        torch.testing.assert_close(other, got, rtol=1e-5, atol=1e-6)
    first, second = (calls(ORTModule(net(), exporter=exporter, torch_dropout=torch_dropout)) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    with wrong_tanh_rule(), pytest.raises(ORTModuleError, match=r"gradient check failed.*gradient \d+ of 4 \(8, 4\)"):
        ORTModule(net(), exporter=exporter, torch_dropout=torch_dropout)(x).sum().backward()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", DRAWN_OTHERWISE)
def test_random_functions_drawn_otherwise_are_not_compared(kind: str, exporter: str, monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Fills torch draws with kernels of its own (Cauchy, log-normal, geometric variates, randint_like) export as
    formulas of uniforms or normals, of the law torch's have and not its values, which the host cannot draw as
    torch's: not compared with torch, so not refused. Before, dynamo's decompositions drew them by rand_like and
    randn_like, which the export tags as torch's own, and the first call's check refused the module."""
    compared = []
    monkeypatch.setattr(checks, "outputs_error", lambda *args: compared.append(args))
    torch.manual_seed(0)
    om = ORTModule(Noised(DRAWN_OTHERWISE[kind]), exporter=exporter, torch_dropout=True)
    x = torch.randn(16, 4)
    for _ in range(2):
        om(x).square().sum().backward()
    assert not compared and all(torch.isfinite(p.grad).all() for p in om.parameters())


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_convolutional_first_call_with_dropout_is_checked(exporter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 32 rows or more a convolutional forward's split steps may run as halves of the batch, whose masks are cut
    from the whole batch's draws: the first call's masks were then not drawn as torch's and its check was skipped.
    They are drawn so (the halves would cut theirs from them), and its outputs compared with torch's."""
    compared = []
    original = checks.outputs_error
    monkeypatch.setattr(checks, "outputs_error", lambda *args: compared.append(args) or original(*args))
    torch.manual_seed(0)
    ref, om = pair(_ConvDropout(28, 1, 0.0), exporter=exporter, threads=2)  # split steps (one output), halves
    x = torch.randn(64, 1, 28, 28, requires_grad=True)
    torch.manual_seed(1)
    ours = om(x)
    torch.manual_seed(1)
    torch.testing.assert_close(ours, ref(x))
    assert compared


def test_python_random_draws_in_forward_warn() -> None:
    """A forward drawing from Python's or numpy's random functions (a LayerDrop written with random.uniform): the
    export keeps the draws, so it is warned, naming them; the functions are torch's own again after."""
    import random

    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                if not (self.training and random.uniform(0, 1) < 0.5):
                    x = torch.tanh(layer(x))
            return x * float(np.random.rand() >= 0)

    uniform = random.uniform
    with pytest.warns(ExportWarning, match=r"draws Python random numbers \(random.uniform, numpy.random.rand\)"):
        ORTModule(LayerDrop())(torch.randn(2, 4))
    assert random.uniform == uniform


class Annealed(nn.Module):
    """A weight annealed in a Python attribute the forward changes: the trace keeps the first call's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * min(1.0, self.calls / 10)


def test_values_kept_by_the_trace_are_refused_at_the_second_call() -> None:
    """The second call of an export is exported again and compared: another graph (a Python number that changed
    between the calls) fails as an export does; with fallback the module runs in torch from there, as torch
    computes it; the same graph (any module that computes with tensors) goes on unchanged."""
    x = torch.randn(3, 4)
    om = ORTModule(Annealed())
    om(x)
    with pytest.raises(ORTModuleError, match=r"exported again at its second call, the module gives another graph"):
        om(x)
    om = ORTModule(Annealed(), fallback=True)
    om(x)
    with pytest.warns(FallbackWarning, match="second call"):
        out = om(x)
    module = om.module  # exports run the forward too: its count is the module's own, torch computes with it
    torch.testing.assert_close(out, module.fc(x) * min(1.0, module.calls / 10))
    assert om.stats["exports"] == 1 and om.stats["fallbacks"] == 1
    plain = ORTModule(nn.Linear(4, 2))
    for _ in range(3):
        plain(x)
    assert plain.stats["exports"] == 1 and plain.stats["fallbacks"] == 0


def test_data_dependent_trace_warns() -> None:
    class Branchy(nn.Module):
        def forward(self, x):
            return x * 2 if bool(x.sum() > 0) else x * 3

    with pytest.warns(ExportWarning, match=r"ORTModule\(Branchy\).*Python boolean"):
        ORTModule(Branchy())(torch.ones(2))


def test_result_objects_holding_tensors_warn() -> None:
    """An object ORTModule cannot take apart (a Hugging Face DynamicCache) is returned as traced, with stale tensors."""
    class Cache:
        def __init__(self, layers):
            self.layers = layers

    class WithCache(nn.Module):
        def forward(self, x):
            return {"out": x * 2, "cache": Cache([{"keys": x + 1}]), "note": "plain constants are fine"}

    with pytest.warns(ExportWarning, match=r"ORTModule\(WithCache\): the result's cache is a Cache holding tensors"):
        out = ORTModule(WithCache())(torch.ones(2))
    assert out["note"] == "plain constants are fine"


def test_save_onnx_env_writes_all_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GRADBUILDER_SAVE_ONNX", str(tmp_path))
    om = ORTModule(MLP())
    om(torch.randn(2, 8)).sum().backward()
    files = {p.name for p in tmp_path.rglob("*.onnx")}
    assert {"exported.onnx", "training.onnx", "forward.onnx", "backward.onnx"} <= files


def test_split_sequences_become_slices() -> None:
    """The dynamo exporter's torch.split/chunk/unbind (SplitToSequence + SequenceAt, no gradient rule) as Slices
    and Gathers: chunks of a constant size (uneven last), of a computed size, of listed sizes, of sizes computed at
    run time (nn.MultiheadAttention's in-projection split by [E, 2E] when the query is not the key: read as one
    chunk size, the run failed in a Reshape), a negative index, items of size 1 (unbind: the axis dropped, or
    kept); same values."""
    def const(name: str, value: list[int] | int) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(value, np.int64)))

    nodes = [const("five", 5), const("sizes", [2, 7, 3]), const("i0", 0), const("i1", 1), const("i2", 2),
             const("im1", -1), const("two", 2),
             helper.make_node("SplitToSequence", ["x", "five"], ["even"], axis=1),
             helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Gather", ["shape", "two"], ["rows"]),
             helper.make_node("Div", ["rows", "two"], ["half"]),
             helper.make_node("SplitToSequence", ["x", "half"], ["halves"], axis=-1),
             helper.make_node("SplitToSequence", ["x", "sizes"], ["listed"], axis=1),
             helper.make_node("SplitToSequence", ["x"], ["unbound"], axis=1, keepdims=0),
             helper.make_node("SplitToSequence", ["x"], ["ones"], axis=2),
             const("twelve", 12), const("one", [1]), helper.make_node("Sub", ["twelve", "half"], ["rest"]),
             helper.make_node("Reshape", ["half", "one"], ["half_1d"]),
             helper.make_node("Reshape", ["rest", "one"], ["rest_1d"]),
             helper.make_node("Concat", ["half_1d", "rest_1d"], ["computed_sizes"], axis=0),
             helper.make_node("SplitToSequence", ["x", "computed_sizes"], ["computed"], axis=1)]
    outs = []
    for seq, index in [("even", "i0"), ("even", "i2"), ("halves", "i1"), ("listed", "i1"), ("listed", "im1"),
                       ("unbound", "i2"), ("unbound", "im1"), ("ones", "i1"), ("ones", "im1"), ("computed", "i0"),
                       ("computed", "i1")]:
        outs.append(f"{seq}_{index}")
        nodes.append(helper.make_node("SequenceAt", [seq, index], [outs[-1]]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12, 6])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.random.default_rng(0).standard_normal((2, 12, 6)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    _split_sequences_to_slices(model.graph)
    assert not {"SplitToSequence", "SequenceAt"} & {n.op_type for n in model.graph.node}
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_dynamo_exporter() -> None:
    """BatchNorm (emitted in inference mode by dynamo, switched to training mode) and two LayerNorms with equal
    initial weights (optimize=False keeps them apart); a tied weight, which dynamo names by its last alias
    (`named_parameters()` by its first)."""
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.LayerNorm(8),
                          nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    model[6].weight = model[5].weight
    ref, om = pair(model, exporter="dynamo")
    x = torch.randn(6, 4)
    om(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert_grads_equal(om, ref)
    torch.testing.assert_close(om[1].running_var, ref[1].running_var)
    om(torch.randn(9, 4))  # dynamic batch
    assert om.stats["exports"] == 1


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_attention_dropout_drops_with_one_mask(exporter) -> None:
    """scaled_dot_product_attention's dropout (nn.MultiheadAttention's in training) drops on onnxruntime as in
    torch, with the forward's mask in backward. Both exporters emit it without a training mode (an identity in
    ONNX). With q = k = 0 the attention is uniform (1/S) and v = I makes the output the dropped attention:
    0 or 2/S at p = 0.5, and dV = out^T c for the loss sum(out * c)."""

    class Attend(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    s = 64
    q = k = torch.zeros(2, 3, s, 8)
    v = torch.eye(s).expand(2, 3, s, s).clone().requires_grad_()
    out = ORTModule(Attend(), threads=1, exporter=exporter)(q, k, v)
    kept = out.detach() != 0
    assert 0.45 < float(kept.float().mean()) < 0.55
    torch.testing.assert_close(out.detach()[kept], torch.full((int(kept.sum()),), 2 / s))
    c = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * c).sum().backward()
    torch.testing.assert_close(v.grad, out.detach().transpose(-1, -2) @ c)


class HalvesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x.mul_(0.5)
        return self.fc(x)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_forward_changing_its_input_in_place(exporter: str) -> None:
    """torch halves the caller's tensor; the export's runs used to halve it too (once a run), the graph then halved
    it again, and the export check blamed a view. Now refused by name with the caller's tensor put back, and with
    fallback torch's own call gives the caller torch's result and tensor."""
    model = HalvesItsInput()
    x = torch.ones(3, 4)
    with pytest.raises(ORTModuleError, match="changes its input x in place"):
        ORTModule(copy.deepcopy(model), exporter=exporter)(x)
    assert torch.equal(x, torch.ones(3, 4))
    ours, theirs = torch.ones(3, 4), torch.ones(3, 4)
    with pytest.warns(FallbackWarning):
        got = ORTModule(copy.deepcopy(model), exporter=exporter, fallback=True)(ours)
    torch.testing.assert_close(got, model(theirs))
    assert torch.equal(ours, theirs) and ours[0, 0] == 0.5


class Tempered(nn.Module):
    """A softmax with a temperature kept as a Python float, and a call counter the forward updates."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.tau = 1.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.softmax(self.fc(x) / self.tau, -1)


def test_a_python_attribute_the_forward_reads_is_followed() -> None:
    """Annealing `tau` after the export kept training with tau = 1 (0.53 off torch): the graph holds it as a
    constant. A change now exports again (warned once); the counter the forward updates does not."""
    model = Tempered()
    ref, om = copy.deepcopy(model), ORTModule(model)
    x = torch.randn(5, 4)
    with pytest.warns(RuntimeWarning, match=r"tau \(1.0 -> 0.1\)") as caught:
        for step in range(6):
            if step == 3:
                ref.tau = om.module.tau = 0.1
            for m in (ref, om):
                m.zero_grad()
                m(x).square().sum().backward()
            torch.testing.assert_close(om(x), ref(x), msg=f"step {step}")
            torch.testing.assert_close(om.module.fc.weight.grad, ref.fc.weight.grad, msg=f"step {step}")
    assert om.stats["exports"] == 2
    assert sum("Python value the exported graph" in str(w.message) for w in caught) == 1


class Mode(enum.Enum):
    TANH = "tanh"
    RELU = "relu"


@dataclass
class Settings:
    temperature: float = 1.0
    act: str = "tanh"


class Configured(nn.Module):
    """A forward reading its hyperparameters from settings objects, containers, numpy, an Enum, an optional value
    and a plain tensor attribute (not a buffer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cfg, self.hp, self.scales = Settings(), {"shift": 0.0}, [1.0, 2.0]
        self.gain, self.mode, self.clip = np.float64(1.0), Mode.TANH, None
        self.bias2 = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) / self.cfg.temperature * self.scales[1] * float(self.gain) + self.hp["shift"] + self.bias2
        h = torch.tanh(h) if (self.cfg.act == "tanh") == (self.mode is Mode.TANH) else torch.relu(h)
        return h if self.clip is None else h.clamp(-self.clip, self.clip)


def test_settings_read_through_containers_are_followed() -> None:
    """A config object's field, a dict's or list's item, a numpy number, an Enum, None becoming a number and a plain
    tensor attribute changed in place or rebound: held as constants of the graph and followed only as bare Python
    numbers were (0.4-2.9 off torch, without a word)."""
    def set_bias(m: nn.Module) -> None:
        m.bias2 = torch.ones(4)

    edits = [lambda m: setattr(m.cfg, "temperature", 0.5), lambda m: setattr(m.cfg, "act", "relu"),
             lambda m: m.hp.update(shift=1.0), lambda m: m.scales.__setitem__(1, 3.0),
             lambda m: setattr(m, "gain", np.float64(2.0)), lambda m: setattr(m, "mode", Mode.RELU),
             lambda m: setattr(m, "clip", 0.1), lambda m: m.bias2.add_(0.5), set_bias]
    x = torch.randn(5, 4)
    for group in (edits[:5], edits[5:]):  # at most SCALAR_EXPORTS exports for changed attributes
        ref, om = pair(Configured())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # exported again: warned once
            om(x)
            for edit in group:
                edit(ref)
                edit(om.module)
                torch.testing.assert_close(om(x), ref(x))
        assert om.stats["exports"] == 1 + len(group)


def test_a_python_attribute_changing_at_every_call_fails_as_an_export_does() -> None:
    om = ORTModule(Tempered())
    x = torch.randn(5, 4)
    with pytest.raises(ORTModuleError, match="tau"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(12):
            om.module.tau = 1.0 + step
            om(x)
    assert om.stats["exports"] == 9


def test_a_python_number_argument_changing_at_every_call_is_warned_then_refused() -> None:
    """A float argument (a diffusion timestep) is a constant of the export: each new value exported again, with
    nothing said and sessions piling up (30 exports in 30 steps). Now warned at its first change, naming it, and
    refused after `SCALAR_EXPORTS` values; values seen before reuse their graphs, and flags pick among graphs
    without a word."""
    class Timed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, t: float, gelu: bool = False) -> torch.Tensor:
            h = self.fc(x) * t
            return F.gelu(h) if gelu else torch.tanh(h)

    ref, om = pair(Timed())
    x = torch.randn(5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for gelu in (False, True, False):
            torch.testing.assert_close(om(x, 0.5, gelu=gelu), ref(x, 0.5, gelu=gelu))
    with pytest.warns(RuntimeWarning, match=r"argument t \(0.5 -> 0.75\) is a constant") as caught:
        for t in (0.75, 0.5, 0.75, 1.0):
            torch.testing.assert_close(om(x, t), ref(x, t))
    assert sum("argument" in str(w.message) for w in caught) == 1
    assert om.stats["exports"] == 4
    with pytest.raises(ORTModuleError, match=r"argument t \(.*\) took 9 values.*as a tensor"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(10):
            om(x, 2.0 + step)
    assert om.stats["exports"] == 9


def test_numpy_arguments_are_constants_by_their_values() -> None:
    """A numpy array argument (turned into a tensor inside forward) was keyed by identity: the same array changed
    in place kept its export's values, and each fresh array of equal values exported again."""
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
            return self.fc(x) * torch.as_tensor(w, dtype=torch.float32)

    ref, om = pair(Weighted())
    x, w = torch.randn(4, 3), np.array([1.0, 2.0, 3.0])
    for values in ([1.0, 2.0, 3.0], [5.0, -1.0, 0.5], [1.0, 2.0, 3.0]):
        w[:] = values
        torch.testing.assert_close(om(x, w), ref(x, w))
        torch.testing.assert_close(om(x, np.array(values)), ref(x, w))
    assert om.stats["exports"] == 2


def _default_from_kwargs(forward):
    """transformers' merge_with_config_defaults, reduced: an argument not among the positionals it sees (behind
    another decorator's *args) gets its default put in **kwargs."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("scale") is None:
            kwargs["scale"] = self.default_scale
        return forward(self, *args, **kwargs)
    return wrapper


def _passed_through(forward):
    @functools.wraps(forward)
    def inner(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return inner


class Decorated(nn.Module):
    default_scale = 2.0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    @_default_from_kwargs
    @_passed_through
    def forward(self, x, scale=None, shift=0.0):
        return (self.fc(x) * scale + shift).sum()


def test_keyword_arguments_reach_forward_as_keywords() -> None:
    """The export and the create_graph recomputation called forward with every argument positional, defaults
    included: such a decorator then met `scale` twice ("got multiple values for argument"), where torch's call works
    (XGLM, M2M100 and Llava in transformers)."""
    ref, om = pair(Decorated())
    for kwargs in ({"x": torch.randn(5, 4)}, {"x": torch.randn(5, 4), "shift": 1.0}):
        for m in (ref, om):
            m.zero_grad()
            m(**kwargs).backward()
        torch.testing.assert_close(om(**kwargs), ref(**kwargs))
        assert_grads_equal(om, ref)
    x = torch.randn(5, 4, requires_grad=True)  # backward(create_graph=True) computes the call again in torch
    with pytest.warns(RuntimeWarning, match="create_graph"):
        (grad,) = torch.autograd.grad(om(x=x), x, create_graph=True)
    torch.testing.assert_close(grad, torch.autograd.grad(ref(x=x), x)[0])


def test_the_module_s_own_forward_pre_hooks_see_its_positional_inputs() -> None:
    """Passed by keyword to the module's forward, `model(x)`'s input was not in the `args` of its own forward
    pre-hooks ("tuple index out of range" at the export); required arguments go in position again, those with
    defaults by keyword (as the test above needs)."""
    def halved(mod: nn.Module, args: tuple) -> tuple:
        return (args[0] * 0.5, *args[1:])

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        model.register_forward_pre_hook(halved)
        models.append(model)
    ref, om = models[0], ORTModule(models[1])
    x = torch.randn(4, 5)
    torch.testing.assert_close(om(x), ref(x))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_python_numbers_from_sizes_are_returned_as_numbers(exporter: str) -> None:
    """`return y, x.shape[0]` (a token count beside the output): the legacy trace made the size a tensor, and every
    call returned a 0-d tensor where torch returns an int (json.dumps failed, `total += n` became a tensor); dynamo's
    export kept its symbol (`s28`), returned by every call. Numbers computed from sizes come back as the int, float
    or bool torch returns; a 0-d tensor stays one, and so do tensors made of sizes (`torch.tensor(n)` came back an
    int, `torch.arange(n)` failed, `torch.full((2,), n)` and `torch.full((n,), 7)` came back float32), each of
    torch's dtype."""
    class Counted(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple:
            y = super().forward(x)
            n = x.shape[0]
            return (y, n, x.shape[1] * 2 + 1, n / 4, n > 3, 1 - n * x.shape[1], 2 / n, (y.argmax(-1) == 0).sum(),
                    torch.tensor(n), torch.as_tensor(n) * 1.5, torch.scalar_tensor(n), y.new_tensor(n / 2),
                    torch.tensor(n, dtype=torch.float64), torch.arange(n), torch.arange(n).sum(),
                    torch.full((2,), n), torch.full((), n / 3), torch.full((n,), 7))

    model = Counted(4, 2)
    ref, om = copy.deepcopy(model), ORTModule(model, exporter=exporter)
    for batch in (3, 3, 5):
        x = torch.randn(batch, 4)
        got, want = om(x), ref(x)
        assert [type(v) for v in got] == [type(v) for v in want] == \
            [torch.Tensor, int, int, float, bool, int, float] + [torch.Tensor] * 11
        assert got[1:7] == want[1:7]
        for g, w in zip(got[7:], want[7:]):
            assert g.dtype == w.dtype
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[7:], want[7:], rtol=0, atol=0)


def test_dynamo_exports_a_call_with_non_contiguous_inputs() -> None:
    """A non-contiguous input (a slice of a bigger batch) made torch.export read its strides as symbols, which the
    ONNX translation has no function for ("aten.sym_stride"): the export failed. Traced on a contiguous copy, as
    onnxruntime is fed one; the input's own gradient is torch's."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 5, 1)
    ref, om = copy.deepcopy(model), ORTModule(model, exporter="dynamo")
    for _ in range(2):
        x = torch.randn(2, 3, 4, 4)[:, :, 0, 0].reshape(2, 3, 1, 1).requires_grad_()
        assert not x.is_contiguous()
        grads = []
        for m in (om, ref):
            m.zero_grad()
            m(x).square().sum().backward()
            grads.append(x.grad)
            x.grad = None
        torch.testing.assert_close(grads[0], grads[1])
        assert_grads_equal(om, ref)


class HyperTarget(nn.Module):
    """A hypernetwork's target: its weight is set from outside before each call, computed by another network."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        self.weight: torch.Tensor | None = None

    def forward(self, x):
        return x @ self.weight + self.bias


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_tensors_set_in_attributes_from_outside_get_their_gradients(exporter: str) -> None:
    """A tensor requiring grad in a plain attribute (a hypernetwork's `target.weight = hyper(z)`, pruning's
    `weight = weight_orig * mask` when pruning the ORTModule itself) is an input of the graph, whose gradient goes
    back through it as torch's: the legacy exporter refused it ("Cannot insert a Tensor that requires grad as a
    constant"), dynamo's graph held it as a constant, exported again at each call, and gave the hypernetwork and
    weight_orig no gradient, silently. Parametrizing the ORTModule itself is refused by name."""
    hyper = nn.Linear(2, 12)
    ref_hyper, target = copy.deepcopy(hyper), HyperTarget()
    ref_target, om = copy.deepcopy(target), ORTModule(target, exporter=exporter)
    g = torch.Generator().manual_seed(1)
    for batch in (5, 5, 3):
        z, x = torch.randn(2, generator=g), torch.randn(batch, 4, generator=g)
        for h, m in ((hyper, om), (ref_hyper, ref_target)):
            m.weight = h(z).view(4, 3)
            m(x).square().sum().backward()
    assert_grads_equal(hyper, ref_hyper)
    assert_grads_equal(om, ref_target)
    assert hyper.weight.grad.abs().sum() > 0 and om.stats["exports"] == 1

    ref, pruned = pair(nn.Linear(6, 3), exporter=exporter)
    for m in (pruned, ref):
        prune.l1_unstructured(m, "weight", amount=0.5)
    x = torch.randn(8, 6)
    for _ in range(2):
        pruned(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert_grads_equal(pruned, ref)
    assert pruned.weight_orig.grad.abs().sum() > 0

    parametrized = ORTModule(nn.Linear(6, 3), exporter=exporter)
    nn.utils.parametrizations.weight_norm(parametrized)
    with pytest.raises(ORTModuleError, match=r"is parametrized itself \(weight.*weight_norm\(model.module\)"):
        parametrized(x)
    ref, inner = pair(nn.Linear(6, 3), exporter=exporter)
    for m in (inner.module, ref):  # the wrapped module parametrized after wrapping: trains as torch's
        nn.utils.parametrizations.weight_norm(m)
    for _ in range(2):
        inner(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert_grads_equal(inner, ref)


def test_dynamo_exports_a_call_with_plain_tensors_in_parameter_slots() -> None:
    """`functional_call` with fast weights (plain tensors computed from the parameters, as MAML's inner loop and
    hypernetworks make them) at the call that exports: torch.export refused them ("State dict entry for parameter
    2.bias is not an instance of torch.nn.Parameter"); now they are exported as Parameters of their values and each
    call feeds the tensors, whose gradients reach the parameters they came from."""
    ref, om = pair(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)), exporter="dynamo")
    x = torch.randn(8, 6)
    for m in (om, ref):
        for scale in (0.9, 0.8):
            fast = {k: v * scale for k, v in m.named_parameters()}
            torch.func.functional_call(m, fast, (x,)).square().sum().backward()
    assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1


class HandWrittenQAT(nn.Module):
    """Quantization-aware training as written by hand: activations through fake_quantize_per_tensor_affine, weights
    through a per-channel FakeQuantize module (calibrated once, then frozen)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 10), nn.Linear(10, 3)
        self.wq = torch.ao.quantization.FakeQuantize(
            observer=torch.ao.quantization.PerChannelMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
            qscheme=torch.per_channel_symmetric, ch_axis=0)
        self.wq(self.l2.weight.detach())
        self.wq.disable_observer()

    def forward(self, x):
        h = torch.fake_quantize_per_tensor_affine(self.l1(x), 0.05, 3, -128, 127).relu()
        return F.linear(h, self.wq(self.l2.weight), self.l2.bias)


def test_fake_quantization_passes_gradients_straight_through() -> None:
    """torch's fake quantization (per tensor and per channel) has a straight-through gradient: dY where the value
    lies inside the quantized range. The export's QuantizeLinear -> DequantizeLinear holds an integer between them,
    which cut every gradient before it: the first-gradient check refused the module ("differ ... float rounding"),
    and with check_export=False the first layer got none."""
    ref, om = pair(HandWrittenQAT())
    for batch in (8, 8, 5):
        x = torch.randn(batch, 6) * 3  # some activations beyond the range: no gradient there
        om(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert_grads_equal(om, ref, rtol=1e-5, atol=1e-5)
    assert om.l1.weight.grad.abs().sum() > 0


class TiedDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.decode = nn.Embedding(12, 6), nn.Linear(6, 12, bias=False)
        self.decode.weight = self.embed.weight

    def forward(self, ids):
        return self.decode(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_functional_call_that_unties_weights(exporter: str) -> None:
    """`functional_call(..., tie_weights=False)` replaces one name of a tied weight only, and torch reads each name's
    own tensor; the graph fed one input for both names (6-12 off, silently). A call whose tied names hold different
    tensors exports again, with an input each; later tied calls feed both from the one tensor."""
    ref, om = pair(TiedDecoder(), exporter=exporter)
    ids = torch.randint(0, 12, (4, 3))
    calls = [(None, True), ("embed.weight", False), ("decode.weight", False), ("embed.weight", True), (None, True)]
    for key, tie in calls:
        new = torch.randn(12, 6, requires_grad=True)
        out = []
        for m in (om, ref):
            y = m(ids) if key is None else torch.func.functional_call(m, {key: new}, (ids,), tie_weights=tie)
            y.square().sum().backward()
            out.append(y)
        torch.testing.assert_close(*out)
    assert_grads_equal(om, ref, rtol=1e-4, atol=1e-5)  # float32 sums of ~50 over five steps


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_dynamo_recurrent_layers_follow_the_sequence_length(kind: str) -> None:
    """dynamo declared a GRU's or LSTM's output with the traced sequence's length (no guard: the ONNX op takes any),
    so another length ran the forward and failed in backward ("Got invalid dimensions for input:
    output_host_grad ... Got: 5 Expected: 6"). Output dims onnx's inference derives from a symbolic input dim take
    the symbol; one export serves every length, with torch's gradients."""
    ref, om = pair(getattr(nn, kind)(4, 5), exporter="dynamo")
    for steps in (6, 5, 7):
        x = torch.randn(steps, 3, 4)
        got, want = om(x)[0], ref(x)[0]
        torch.testing.assert_close(got, want)
        got.square().mean().backward()
        want.square().mean().backward()
    assert_grads_equal(om, ref)
    assert om.stats["exports"] == 1


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_channels_last_cnn_trains_as_torch(exporter: str) -> None:
    """A CNN and its images in channels_last memory (`.to(memory_format=torch.channels_last)`, torch's fast layout
    for convolutions): float64 outputs, gradients and BatchNorm statistics as torch's over SGD steps, and each
    gradient in its parameter's layout, as torch's AccumulateGrad lays it out (an optimizer's in-place update then
    keeps the weights channels_last)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 6, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)
                             ).double().to(memory_format=torch.channels_last)

    ref, om = net(), ORTModule(net(), exporter=exporter)
    assert om.module[0].weight.stride() != om.module[0].weight.contiguous().stride()
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ref, om)]
    for _ in range(3):
        x = torch.randn(5, 3, 10, 10, dtype=torch.float64).to(memory_format=torch.channels_last)
        outs = []
        for m, opt in zip((ref, om), opts):
            opt.zero_grad()
            out = m(x)
            out.square().sum().backward()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-13)
        largest = max(float(q.grad.abs().max()) for q in ref.parameters())  # the first conv's bias: zero by the
        assert_grads_equal(om, ref, rtol=1e-10, atol=1e-13 * largest)  # math, rounding noise of the others
        for p, q in zip(om.parameters(), ref.parameters()):
            assert p.grad.stride() == q.grad.stride()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(om.module[1].running_var, ref[1].running_var, rtol=1e-12, atol=0)
    assert om.module[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert om.stats["fallbacks"] == 0
