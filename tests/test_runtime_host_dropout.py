"""runtime/host_dropout.py: training Dropouts fed masks drawn on the host keep torch's semantics (gradients of
their masks, drop rates, fresh masks, torch's seed), run onnxruntime's Dropout at new input sizes, and leave
alone the Dropouts they cannot mask."""

import copy
from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
from harness import random_body_model
from onnx import TensorProto, helper
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from runtime import ORTModule, fused, host_dropout
from runtime.exchange import to_numpy, to_ortvalue
from runtime.host_dropout import MaskedRunner, mask_dropouts
from runtime.ort_session import Runner, SessionConfig
from runtime.session import TrainingSession


class TwoDrops(nn.Module):
    def __init__(self, p1: float = 0.3, p2: float = 0.6):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 5)
        self.drop1, self.drop2 = nn.Dropout(p1), nn.Dropout(p2)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (self.drop2(self.fc2(self.drop1(torch.relu(self.fc1(x))))) * c).sum()


def _keep(ratio: float) -> float:
    """1 - ratio as onnxruntime's Dropout divides by it: in float32."""
    return float(torch.tensor(1.0) - torch.tensor(ratio))


def _runner(om: ORTModule) -> MaskedRunner:
    (session,) = om.training_sessions()
    runner = session._fwd
    assert isinstance(runner, MaskedRunner)
    return runner


def test_masked_steps_have_the_gradients_of_their_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "MAX_KEPT", -1.0)  # the split forward's stash, which this reads
    """The masks come from the host (the first call's drawn as torch's for its check, after a run at its sizes
    that tells their shapes); each step's outputs and gradients are torch's for the masks backward kept
    (float64, so the comparison is tight; the divisor 1 - ratio in float32, as onnxruntime's own Dropout has
    it)."""
    torch.manual_seed(0)
    model = TwoDrops().double()
    ref = copy.deepcopy(model)
    om = ORTModule(model, threads=1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 6, generator=g, dtype=torch.float64)
    c = torch.randn(32, 5, generator=g, dtype=torch.float64)
    for _ in range(3):
        om.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        loss = om(x, c)
        runner = _runner(om)
        assert runner._masked is not None
        state = loss.grad_fn.state.values
        m1, m2 = (torch.from_dlpack(state[m.input]).clone() if m.input in state else
                  torch.from_dlpack(state[m.output]) != 0 for m in runner.masks)  # see `relu_dropout_masks`
        assert m1.shape == (32, 16) and m2.shape == (32, 5) and m1.dtype == torch.bool
        loss.backward()
        h = torch.relu(ref.fc1(x)) * m1 / _keep(0.3)
        expected = (ref.fc2(h) * m2 / _keep(0.6) * c).sum()
        expected.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_drop_rates_and_fresh_masks(ratio: float) -> None:
    """Drop rates within 5 standard deviations of the ratio, kept values exactly 1 / (1 - ratio) in float32, a
    new mask each call, and two Dropouts of one call masked independently."""
    class Drops(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dropout(ratio), nn.Dropout(ratio)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x)

    n = 100_000
    x = torch.ones(4, n // 4, requires_grad=True)
    om = ORTModule(Drops(), threads=1)
    outs = [om(x) for _ in range(3)]
    assert len(_runner(om).shapes) == 1 and _runner(om)._masked is not None
    bound = 5 * (ratio * (1 - ratio) / n) ** 0.5
    masks = []
    for a, b in outs[1:]:
        for y in (a, b):
            kept = y.detach() != 0
            assert abs(1 - float(kept.float().mean()) - ratio) < bound
            value = 1 / torch.tensor(_keep(ratio))
            torch.testing.assert_close(y.detach()[kept], value.expand(int(kept.sum())), rtol=0, atol=0)
            masks.append(kept)
    agree = [float((u == v).float().mean()) for u, v in ((masks[0], masks[1]), (masks[0], masks[2]))]
    expected = ratio ** 2 + (1 - ratio) ** 2  # two independent masks agree this often
    assert all(abs(a - expected) < 5 * (expected * (1 - expected) / n) ** 0.5 for a in agree)


def test_torch_seed_reproduces_the_masks() -> None:
    """After torch.manual_seed, a new ORTModule draws the same masks in every call, the first one (onnxruntime's
    Dropout, seeded when the runner is made) included; another seed draws others, and each call new ones."""
    g = torch.Generator().manual_seed(2)
    x, c = torch.randn(8, 6, generator=g), torch.randn(8, 5, generator=g)
    torch.manual_seed(0)
    model = TwoDrops()

    def losses(seed: int) -> list[float]:
        torch.manual_seed(seed)
        om = ORTModule(copy.deepcopy(model), threads=1)
        return [float(om(x, c)) for _ in range(4)]

    first = losses(5)
    assert losses(5) == first and losses(6) != first
    assert len(set(first)) == 4


@pytest.mark.parametrize("dropout", [False, True])
def test_torch_seed_reproduces_draws_in_bodies_and_unmasked_dropouts(dropout: bool) -> None:
    """The same after torch.manual_seed for random ops inside an If's body and for Dropouts the host cannot mask
    (the graph has a body): their seeds come from torch's generator too, not from onnxruntime's clock. The first
    step runs split, the later ones fused; each draw gives the gradient of its own loss."""
    rows = 256
    x = np.random.default_rng(0).random((rows, 3), dtype=np.float32)

    def losses(seed: int) -> list[float]:
        torch.manual_seed(seed)
        session = TrainingSession.from_forward(random_body_model(rows, dropout), wrt=["w"], threads=1)
        out = []
        for _ in range(4):
            (loss,), state = session.forward([x])
            grad = session.backward(state, [np.float32(1.0)])["w"]
            np.testing.assert_allclose(2 * grad[:, 0].sum(), loss, rtol=1e-5)
            out.append(float(loss))
        return out

    first = losses(5)
    assert losses(5) == first and losses(6) != first
    assert len(set(first)) == 4


def test_new_sizes_run_onnxruntime_dropout_first(monkeypatch) -> None:
    """Each new batch size runs the forward as it is once (its Shape outputs give the masks' shapes); at most
    MAX_SIZES sizes are remembered, further ones keep onnxruntime's Dropout, with the same semantics."""
    torch.manual_seed(0)
    om = ORTModule(TwoDrops(p1=0.5, p2=0.5), threads=1)
    for batch in (4, 4, 7, 7, 7):
        x, c = torch.randn(batch, 6), torch.ones(batch, 5)
        om(x, c).backward()
    runners = [s._fwd for s in om.training_sessions()]
    shapes = [dict(r.shapes) for r in runners]
    assert sum(len(s) for s in shapes) == 2
    assert {v for s in shapes for sizes in s.values() for v in sizes.values()} >= {(4, 16), (7, 5)}
    monkeypatch.setattr(host_dropout, "MAX_SIZES", 0)
    dynamic = next(r for r in runners if any(key[0][0] == 7 for key in r.shapes))
    known = len(dynamic.shapes)
    for batch in (9, 9, 11):
        y = om(torch.randn(batch, 6), torch.ones(batch, 5))
        assert torch.isfinite(y)
    assert len(dynamic.shapes) == known


def test_stale_sizes_fall_back_to_onnxruntime_dropout() -> None:
    """Recorded shapes that no longer fit (as after a parameter of another shape) make the call run the forward
    as it is and record them anew, instead of failing."""
    torch.manual_seed(0)
    om = ORTModule(TwoDrops(), threads=1)
    x, c = torch.randn(8, 6), torch.randn(8, 5)
    om(x, c)
    runner = _runner(om)
    (key,) = runner.shapes
    runner.shapes[key] = {s: (3, 3) for s in runner.shapes[key]}
    om(x, c).backward()
    assert runner.shapes[key] == {m.source: s for m, s in zip(runner.masks, [(8, 16), (8, 5)])}


@pytest.mark.parametrize("torch_dropout", [False, True])
def test_a_failing_masked_session_is_not_hidden(monkeypatch, torch_dropout: bool) -> None:
    """When the sizes recorded still hold and the masked session fails anyway, its error reaches the caller
    instead of every call quietly running the forward twice (with torch's masks, which draw again after recording
    the sizes, the retry recursed until Python's limit)."""
    torch.manual_seed(0)
    om = ORTModule(TwoDrops(), threads=1, torch_dropout=torch_dropout)
    x, c = torch.randn(8, 6), torch.randn(8, 5)
    om(x, c)
    runner = _runner(om)
    om(x, c)  # the masked session exists now
    (key,) = runner.shapes

    def broken(feeds, outputs=None):
        raise RuntimeError("masked session broken")

    monkeypatch.setattr(runner._masked, "run", broken)
    with pytest.raises(RuntimeError, match="masked session broken"):
        om(x, c)
    assert key in runner.shapes  # recorded anew by the forward as it is, which ran fine


def test_no_grad_in_training_mode_masks_too() -> None:
    torch.manual_seed(0)
    om = ORTModule(nn.Sequential(nn.Linear(6, 4000), nn.Dropout(0.5)), threads=1)
    x = torch.randn(16, 6)
    with torch.no_grad():
        ys = [om(x) for _ in range(3)]
    infer = next(iter(om._engine.schemas.values()))._infer
    assert isinstance(infer, MaskedRunner) and infer._masked is not None
    fractions = [float((y == 0).float().mean()) for y in ys]
    assert all(0.47 < f < 0.53 for f in fractions) and not torch.equal(ys[1], ys[2])


def _dropout_graph(invalid: bool = True) -> onnx.ModelProto:
    """Dropouts of every kind on x; `invalid` adds one of ratio 1, which onnxruntime refuses to run."""
    f, b = TensorProto.FLOAT, TensorProto.BOOL
    nodes = [helper.make_node("Dropout", ["x", "r3", "on"], ["y1", "m1"], name="const"),
             helper.make_node("Dropout", ["x", "", "on"], ["y2"], name="default_ratio"),
             helper.make_node("Dropout", ["x", "r_in", "on"], ["y3", "m3"], name="ratio_input"),
             helper.make_node("Dropout", ["x", "r3", "mode_in"], ["y4"], name="mode_input"),
             helper.make_node("Dropout", ["x", "r3", "on"], ["y5"], name="seeded", seed=7),
             helper.make_node("Dropout", ["x", "r3", "off"], ["y7"], name="inference")]
    nodes += [helper.make_node("Dropout", ["x", "r1", "on"], ["y6"], name="all")] if invalid else []
    inputs = [helper.make_tensor_value_info("x", f, ["n", 4]), helper.make_tensor_value_info("r_in", f, []),
              helper.make_tensor_value_info("mode_in", b, [])]
    outputs = [helper.make_tensor_value_info(n, f, ["n", 4]) for n in ("y1", "y2", "y3", "y4", "y5", "y7")]
    outputs += [helper.make_tensor_value_info("y6", f, ["n", 4])] if invalid else []
    outputs += [helper.make_tensor_value_info(n, b, ["n", 4]) for n in ("m1", "m3")]
    inits = [helper.make_tensor("r3", f, [], [0.3]), helper.make_tensor("r1", f, [], [1.0]),
             helper.make_tensor("on", b, [], [True]), helper.make_tensor("off", b, [], [False])]
    return helper.make_model(helper.make_graph(nodes, "drops", inputs, outputs, inits),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_mask_dropouts_takes_only_training_dropouts_of_known_ratio() -> None:
    model = _dropout_graph()
    masked, masks = mask_dropouts(model)
    assert [(m.input, m.source, m.threshold, m.output) for m in masks] == [
        ("m1", "x", round(float(np.float32(0.3)) * 2 ** 32), "y1"), ("y2/host_mask", "x", 2 ** 31, "y2")]
    left = {n.name for n in masked.graph.node if n.op_type == "Dropout"}
    assert left == {"ratio_input", "mode_input", "seeded", "all", "inference"}
    assert {i.name for i in masked.graph.input} >= {"m1", "y2/host_mask"}
    assert "m1" not in {o.name for o in masked.graph.output} and "m3" in {o.name for o in masked.graph.output}
    onnx.checker.check_model(masked, full_check=True)
    assert mask_dropouts(masked)[1] == [] and len(model.graph.node) == 7  # the input is left as it was


def test_runner_returns_fed_masks_among_outputs() -> None:
    """The plain Runner where nothing is masked or `lower` is off; otherwise the masks the caller asked for come
    back among the outputs, in order, with the outputs they gate."""
    model = _dropout_graph(invalid=False)
    assert isinstance(host_dropout.forward_runner(model, SessionConfig(threads=1, lower=False), "f"), Runner)
    runner = host_dropout.forward_runner(model, SessionConfig(threads=1), "f")
    assert isinstance(runner, MaskedRunner)
    feeds = {"x": to_ortvalue(np.ones((50, 4), np.float32)), "r_in": to_ortvalue(np.array(0.5, np.float32)),
             "mode_in": to_ortvalue(np.array(True))}
    for _ in range(2):
        y1, m1, y2 = (to_numpy(v) for v in runner.run(feeds, ["y1", "m1", "y2"]))
        np.testing.assert_array_equal(y1 != 0, m1)
        assert y2.shape == (50, 4) and 0 < (y2 == 0).mean() < 1
    assert runner._masked is not None


def test_training_session_masks_from_its_second_step() -> None:
    """TrainingSession users (no ORTModule) get the masks too, with gradients of the kept mask."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Dropout", ["h", "r", "on"], ["d", "m"]),
             helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("x", f, ["n", 3]), helper.make_tensor_value_info("w", f, [3, 5])]
    consts = [helper.make_tensor("r", f, [], [0.25]), helper.make_tensor("on", TensorProto.BOOL, [], [True])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", f, [])], consts)
    session = TrainingSession.from_forward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                                           wrt=["w"], loss="loss", config=SessionConfig(threads=1))
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((40, 3)).astype(np.float32), rng.standard_normal((3, 5)).astype(np.float32)
    for _ in range(2):
        _, state = session.forward({"x": x, "w": w})
        mask = np.from_dlpack(state.values["m"]).copy()
        grads = session.backward(state, [None])
        np.testing.assert_allclose(grads["w"], x.T @ (mask / np.float32(0.75)), rtol=1e-5, atol=1e-6)
    assert session._fwd._masked is not None


class ConvDrops(nn.Module):
    """Dropout2d after a ReLU and a cross-entropy inside: the fused run's graph has an If, so onnxruntime would draw."""

    def __init__(self):
        super().__init__()
        self.conv, self.drop, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Dropout2d(0.3), nn.Linear(8 * 36, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool2d(self.drop(torch.relu(self.conv(x))), 2)
        return torch.nn.functional.cross_entropy(self.fc(h.flatten(1)), y)


class Checkpointed(nn.Module):
    """A dropout inside a checkpointed region (its mask drawn again for backward) and one after it."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))
        self.out = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


class Reparameterized(nn.Module):
    """A VAE's loss: randn_like for the sample, rand_like for input noise, a functional and a module dropout."""

    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.log_var = nn.Linear(10, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.dec = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(torch.relu(self.enc(x)), 0.1, self.training)
        mu, log_var = self.mu(h), self.log_var(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)
        target = x + torch.rand_like(x) * 0.01
        kl = -0.5 * torch.sum(1 + log_var - mu.pow(2) - log_var.exp())
        return torch.nn.functional.mse_loss(self.dec(z), target, reduction="sum") + kl


class StochasticDepth(nn.Module):
    """Residual branches dropped per sample as timm's drop_path does (`new_empty(...).bernoulli_(keep)`), which
    exports as a rand_like compared with keep."""

    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for branch, keep in zip(self.branches, (0.7, 0.8)):
            kept = x.new_empty((x.shape[0], 1)).bernoulli_(keep).div_(keep)
            x = x + torch.relu(branch(x)) * kept
        return x


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


TRACKED = {  # (module, inputs of each step: batch sizes change, loss)
    "mlp": (lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Tanh(),
                                  nn.Dropout(0.1), nn.Linear(32, 4)),
            lambda g, k: (torch.randn((16, 9, 16, 16)[k], 16, generator=g),)),
    "encoder": (_encoder, lambda g, k: (torch.randn((4, 3, 4, 4)[k], 6, 16, generator=g),)),
    "conv, loss inside": (ConvDrops, lambda g, k: (torch.randn(6, 3, 12, 12, generator=g),
                                                   torch.randint(0, 5, (6,), generator=g))),
    "checkpointed": (Checkpointed, lambda g, k: (torch.randn(12, 16, generator=g),)),
    "drop_path": (StochasticDepth, lambda g, k: (torch.randn((12, 7, 12, 12)[k], 16, generator=g),)),
    "randn_like and rand_like": (Reparameterized, lambda g, k: (torch.randn((7, 5, 7, 7)[k], 10, generator=g),)),
}


def _training_run(name: str, engine: str) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    make, inputs = TRACKED[name]
    torch.manual_seed(0)
    model = make()
    if engine != "torch":
        model = ORTModule(model, torch_dropout=engine == "torch masks")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(42)
    losses = []
    for k in range(4):
        opt.zero_grad()
        out = model(*inputs(data, k))
        loss = out if out.dim() == 0 else out.square().mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in model.parameters()], torch.rand(4)


@pytest.mark.parametrize("name", list(TRACKED))
def test_torch_dropout_masks_track_torch_s_training_run(name: str) -> None:
    """ORTModule(torch_dropout=True) draws torch's own masks (`bernoulli_` from the default generator, in the memory
    order of each dropout's input, as torch's dropout does) and randn_like / rand_like values, from the first call
    at each size: a training run with dropout follows torch's step for step, and leaves torch's generator where
    torch's run does. The default masks (another stream of the same law) do not follow it."""
    losses, params, after = _training_run(name, "torch")
    ours, our_params, our_after = _training_run(name, "torch masks")
    np.testing.assert_allclose(ours, losses, rtol=1e-5, atol=1e-7)
    for p, q in zip(our_params, params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert torch.equal(our_after, after)
    if name == "mlp":
        default, _, _ = _training_run(name, "default")
        assert not np.allclose(default, losses, rtol=1e-3)


class Drops(nn.Module):
    """A dropout of a transposed view (its mask drawn in memory order) and a channel dropout."""

    def __init__(self):
        super().__init__()
        self.drop, self.channels = nn.Dropout(0.3), nn.Dropout2d(0.25)

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drop((x * 2.0).t()), self.channels(image * 1.5)


def test_torch_dropout_outputs_and_gradients_are_torch_s_bit_for_bit() -> None:
    """The kept values are torch's `x * (mask * s)` (s = 1 / (1 - p) in float32): `x * mask / (1 - p)`, as
    onnxruntime's Dropout computes it, was an ulp off at ~6% of the elements."""
    torch.manual_seed(0)
    ref, om = Drops(), ORTModule(Drops(), torch_dropout=True)
    x, image = torch.randn(48, 32, requires_grad=True), torch.randn(4, 6, 5, 5, requires_grad=True)
    for call in range(3):
        results = []
        for m in (ref, om):
            torch.manual_seed(call)
            out = m(x, image)
            results.append((*out, *torch.autograd.grad(out, (x, image), (out[0] * 0.37, out[1] - 0.5))))
        for got, want in zip(results[1], results[0]):
            assert torch.equal(got, want)


class AttentionDrop(nn.Module):
    """Attention dropping probabilities (`dropout_p`): the values' gradient reads the dropped probabilities."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(6, 18), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(*x.shape[:2], 3, 2, 3).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)
        return self.out(o.transpose(1, 2).reshape(x.shape))


class CheckpointedDrop(nn.Module):
    """Dropouts inside a checkpointed region, whose backward recomputes the region from its input."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Dropout(0.3), nn.Linear(6, 6), nn.Dropout(0.2))
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(checkpoint(self.inner, x, use_reentrant=False))


DROPPING: dict[str, Callable[[], nn.Module]] = {
    "output": lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3)),
    "read by a weight's gradient": lambda: nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Dropout(0.3), nn.Linear(6, 4)),
    "attention": AttentionDrop,
    "checkpointed": CheckpointedDrop,
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("where", list(DROPPING))
def test_float64_dropout_follows_torch_exactly(where: str, exporter: str) -> None:
    """torch_dropout=True in float64: torch scales by 1 / (1 - p) in double from p as written, forward and backward.
    Ours took the forward's in float32 and the backward's from the graph's float32 rate (0.30000001): 5e-8 apart.
    The export writes a float64 Dropout's rate as the double it stands for; the host's output scales in x's type,
    and so does backward's own copy of it where a gradient reads it (a Linear's weight's, attention's values') or a
    checkpointed region is recomputed: that copy was onnxruntime's arithmetic, its divisor the float32 0.7, 2.6e-8
    apart."""
    from parity import check_parity, sgd

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 3, 6, generator=g, dtype=torch.float64) for _ in range(3)]
    check_parity(lambda: DROPPING[where]().double(), batches, lambda m, x: m(x).pow(2).sum(), sgd, rtol=1e-12,
                 exporter=exporter, torch_dropout=True)


class Fills(nn.Module):
    """torch's fills with parameters (multiplicative and additive noise, drop_path's bernoulli_, exponential waits
    and gumbel_softmax's) and a dropout written by hand as uniforms compared with keep, which exports as bernoulli_
    does."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h = h * torch.empty_like(h).normal_(1.0, 0.1) + torch.empty_like(h).uniform_(-0.05, 0.05)
        by_hand = (torch.rand_like(h) < 0.8).to(h.dtype)
        per_sample = h.new_empty((h.shape[0], 1)).bernoulli_(0.7)
        waits = torch.empty_like(h).exponential_(2.5)
        relaxed = F.gumbel_softmax(h, tau=0.7)
        return self.out(h * by_hand * per_sample / 0.56 + waits + relaxed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_torch_dropout_draws_torch_s_fills(exporter: str, dtype: torch.dtype) -> None:
    """Under torch_dropout, `normal_(mean, std)`, `uniform_(a, b)`, `bernoulli_(p)`, `exponential_(rate)` (and
    gumbel_softmax, which draws with it) and `rand_like(x) < p` are drawn as torch draws them, with the numbers as
    written: outputs and gradients are torch's to rounding at each call (batch sizes changing). Before:
    `rand_like(x) < p` was drawn as bernoulli_(p) (another mask in float32), the legacy exporter's normal_ could
    not load, neither exporter converted uniform_ or exponential_, gumbel_softmax drew uniforms, and float64
    normal_ drew with float32's 0.1 (2e-9 off)."""
    torch.manual_seed(0)
    ref = Fills().to(dtype)
    om = ORTModule(copy.deepcopy(ref), torch_dropout=True, exporter=exporter)
    tol = {"rtol": 1e-13, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for call, rows in enumerate((6, 4, 6)):
        x = torch.randn(rows, 6, dtype=dtype)
        results = []
        for m in (ref, om):
            torch.manual_seed(call)
            out = m(x)
            results.append((out, *torch.autograd.grad(out.square().sum(), list(m.parameters()))))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, **tol)


def test_fills_as_onnxruntime_draws_them() -> None:
    """Without torch_dropout onnxruntime draws the fills, in the tensor's type and within the bounds given (the legacy
    exporter's normal_ returned float64 for a float32 module, and uniform_ did not export)."""
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (x * torch.empty_like(x).normal_(3.0, 0.5), x * torch.empty_like(x).uniform_(2.0, 2.5),
                    x * torch.empty_like(x).exponential_(2.0))

    x = torch.ones(400, 50, requires_grad=True)
    normal, uniform, waits = ORTModule(Noise())(x)
    assert normal.dtype == uniform.dtype == waits.dtype == torch.float32
    assert float(waits.min()) >= 0 and bool(waits.isfinite().all()) and abs(float(waits.mean()) - 0.5) < 0.01
    assert abs(float(normal.mean()) - 3.0) < 0.01 and abs(float(normal.std()) - 0.5) < 0.01
    assert float(uniform.min()) >= 2.0 and float(uniform.max()) < 2.5 and abs(float(uniform.mean()) - 2.25) < 0.01
    (grad,) = torch.autograd.grad((normal + uniform).sum(), x)
    torch.testing.assert_close(grad, (normal + uniform).detach())


def test_masks_keep_each_element_as_its_32_bit_draw_would() -> None:
    """A mask element is kept where its uniform 32-bit draw is at least the threshold: the high 16 bits decide
    alone above or below the threshold's, and where they tie, the low 16 bits come next from the same stream (none
    drawn where the threshold's low bits are 0: every tie is kept)."""
    top, low = 1234, 40000
    high = np.random.default_rng(0).integers(top - 2, top + 3, 200_000).astype(np.uint16)
    ties = high == top
    kept = host_dropout._kept(np.random.SFC64(5), high, (top << 16) | low)
    assert not kept[high < top].any() and kept[high > top].all()
    drawn = np.random.SFC64(5).random_raw((int(ties.sum()) + 3) // 4).view(np.uint16)[:int(ties.sum())]
    np.testing.assert_array_equal(kept[ties], drawn >= low)
    assert abs(kept[ties].mean() - (65536 - low) / 65536) < 0.01
    stream = np.random.SFC64(5)
    assert host_dropout._kept(stream, high, top << 16)[ties].all()
    assert stream.random_raw() == np.random.SFC64(5).random_raw(), "a tie drew bits it does not need"
