"""ORTModule over inputs whose spatial sizes change from call to call: one export and one gradient build
serve every image size or sequence length (the Conv, ConvTranspose and pooling rules compute what depends
on the sizes at run time)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from gradbuilder.errors import RuleError
from runtime import ORTModule, engine, workload

torch.manual_seed(0)


class SmallCNN(nn.Module):
    """Strided and dilated convs (odd/even sizes change their output_padding), ceil-mode average pooling
    without the pads in its divisors, a depthwise conv and an upsampling ConvTranspose."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
            nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
            nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, groups=4), nn.Tanh(),
            nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class TextCNN(nn.Module):
    """Conv1d over a sequence of embeddings (N, C, L) with a variable length L."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(4, 8, 5, padding=2), nn.ReLU(), nn.Conv1d(8, 8, 3, stride=2),
                                  nn.ReLU(), nn.AvgPool1d(2, ceil_mode=True))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.conv(x).mean(-1))


@pytest.mark.parametrize("make,shapes", [
    (SmallCNN, [(2, 3, 15, 17), (3, 3, 20, 12), (2, 3, 16, 16)]),
    (TextCNN, [(2, 4, 11), (3, 4, 20), (2, 4, 7)]),
], ids=["cnn", "text"])
def test_a_static_build_then_one_dynamic_build_for_every_other_size(make, shapes) -> None:
    """The first size gets a build pinned to it; the second an all-dynamic build, which serves the third too;
    back at the first size, its pinned build runs again. Gradients are torch's throughout."""
    model = make()
    ref, om = copy.deepcopy(model), ORTModule(model)
    opt, ref_opt = torch.optim.SGD(om.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for shape in [*shapes, shapes[0]]:
        x = torch.randn(shape)
        target = torch.randn(shape[0], ref.head.out_features)
        for m, o in ((om, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), target).backward()
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"{name} at {shape}")
        opt.step()
        ref_opt.step()
    assert om.stats == {"exports": 1, "builds": 2, "fallbacks": 0}
    (schema,) = om._engine.schemas.values()
    assert set(sizes for _, sizes in schema.sessions) == {(tuple(shapes[0][1:]),), None}  # one input: x


class BroadcastEinsum(nn.Module):
    """b's second dim broadcasts inside the ellipsis: the Einsum rule needs it static."""

    def forward(self, a, b):
        return torch.einsum("b...ij,b...jk->b...ik", a, b)


def test_rules_needing_static_sizes_fall_back_to_a_build_per_size() -> None:
    om, ref = ORTModule(BroadcastEinsum()), BroadcastEinsum()
    for n in (3, 5, 3):
        a, b = torch.randn(2, n, 3, 4, requires_grad=True), torch.randn(2, 1, 4, 5, requires_grad=True)
        c = torch.randn(2, n, 3, 5)
        got = torch.autograd.grad((om(a, b) * c).sum(), (a, b))
        want = torch.autograd.grad((ref(a, b) * c).sum(), (a, b))
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
    assert om.stats == {"exports": 1, "builds": 2, "fallbacks": 0}  # one per size (the failed dynamic build uncounted)


def test_a_rule_refusing_the_pinned_build_gets_the_dynamic_one(monkeypatch) -> None:
    """Should the pinned first build fail in a rule, the all-dynamic build serves from the first call on."""
    original = engine.Schema._build

    def build(self, model, wrt, rows):
        if model is not self.exported.model:
            raise RuleError("refusing static sizes (test)")
        return original(self, model, wrt, rows)

    monkeypatch.setattr(engine.Schema, "_build", build)
    model = TextCNN()
    ref, om = copy.deepcopy(model), ORTModule(model)
    for shape in [(2, 4, 11), (3, 4, 20)]:
        x = torch.randn(shape)
        for m in (om, ref):
            m.zero_grad()
            m(x).sum().backward()
        for p, q in zip(om.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    (schema,) = om._engine.schemas.values()
    assert om.stats["builds"] == 1 and [sizes for _, sizes in schema.sessions] == [None]


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def test_small_forwards_run_on_one_thread_until_the_batch_grows() -> None:
    """Below the bottom of `workload.trial_band` (`SMALL / TRIAL_BOTTOM` forward work, `SMALL * DENSE_SPLIT` for an
    MLP on AVX-512) the sessions get one intra-op thread (threads cost more than they save there); a batch making the
    work reach it brings back the configured threads (with a trial of one against them where the band has room,
    `ort_session.Trial`), for good, with gradients still torch's; a big model keeps them from the start."""
    model = _mlp(32)
    ref, om = copy.deepcopy(model), ORTModule(model, threads=2)

    def step(batch: int) -> None:
        x = torch.randn(batch, 32)
        for m in (om, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        for p, q in zip(om.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)

    step(8)
    (schema,) = om._engine.schemas.values()
    (session,) = om.training_sessions()
    assert schema.config.threads == 1 and session.config.threads == 1
    ((name, _),) = schema.exported.inputs
    per_sample = workload.forward_work(schema.exported.model, {name: (1, 32)})
    products = workload.GEMM_WEIGHT * workload.mac_weight() * 32 * 42
    assert per_sample is not None and products <= per_sample < products + 200  # two products, a few elementwise
    step(8 * 64)  # still small
    assert session.config.threads == 1
    bottom, top = workload.trial_band(schema.exported.model, per_sample)
    step(int(workload.SMALL * bottom // per_sample) + 1)
    assert schema.config.threads == 2 and session.config.threads == 2
    assert session.config.choose_threads == (bottom < top)
    step(8)  # never back to one thread
    assert session.config.threads == 2
    big = ORTModule(_mlp(2048), threads=2)
    big(torch.randn(64, 2048)).sum().backward()
    assert big.training_sessions()[0].config.threads == 2


class GlobalPoolSqueeze(nn.Module):
    """torchaudio's M5 ending: average pool over the whole remaining length, then squeeze(-1), which the legacy
    exporter writes as If(length == 1, Squeeze, Identity) for a length it cannot size (the pool's kernel is the
    traced length: one length a model)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 25, stride=4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.head(nn.functional.avg_pool1d(h, h.shape[-1]).squeeze(-1))


class FirstStep(nn.Module):
    """The first step of a sequence, squeezed: the legacy exporter writes If(size == 1, Squeeze, Identity) for
    the Slice it cannot size; any length runs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 5, stride=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x))[..., :1].squeeze(-1))


@pytest.mark.parametrize("make,shapes,builds", [
    (GlobalPoolSqueeze, [(2, 1, 101), (5, 1, 101)], 1),
    (FirstStep, [(2, 1, 21), (3, 1, 17), (2, 1, 21), (2, 1, 31)], 3),
], ids=["global-pool", "first-step"])
def test_a_squeeze_the_known_sizes_decide_trains(make, shapes, builds) -> None:
    """Pinned to the first call's sizes, the If takes its branch before the gradient build. The all-dynamic build
    of another size cannot (the builder differentiates no control flow), so each size gets a pinned build."""
    model = make()
    ref, om = copy.deepcopy(model), ORTModule(model)
    for shape in shapes:
        x = torch.randn(shape)
        for m in (om, ref):
            m.zero_grad()
            m(x).square().sum().backward()
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at {shape}")
    assert om.stats == {"exports": 1, "builds": builds, "fallbacks": 0}


def test_sizes_the_trace_turned_into_constants_get_an_export_each() -> None:
    """GlobalPoolSqueeze's pool kernel is the traced length: at a length whose pooled length differs, the one export
    would average the wrong span, silently. Each new size is exported again and compared: the same graph (103
    samples pool to 20 as 101 do) serves it; another (81: 15) makes every size get its own export, warned once."""
    model = GlobalPoolSqueeze()
    ref, om = copy.deepcopy(model), ORTModule(model)
    expected = [(101, 1), (103, 1), (81, 2), (101, 2), (61, 3)]  # (length, exports so far)
    with pytest.warns(RuntimeWarning, match="turns input sizes into constants") as caught:
        for length, exports in expected:
            x = torch.randn(2, 1, length)
            for m in (om, ref):
                m.zero_grad()
                m(x).square().sum().backward()
            for (name, p), q in zip(om.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at {length}")
            assert om.stats["exports"] == exports, length
    assert sum("turns input sizes into constants" in str(w.message) for w in caught) == 1
    with torch.no_grad():  # inference at a fourth length takes its own export too
        torch.testing.assert_close(om(torch.ones(1, 1, 141)), ref(torch.ones(1, 1, 141)), rtol=1e-5, atol=1e-6)
    assert om.stats["exports"] == 4


class BatchAsNumber(nn.Module):
    """What the legacy trace keeps of the batch without a warning: `len(x)` and `numel()` as Python numbers, a
    per-sample loop over `x.size(0)`, a squeeze of (batch, 1) declared at the traced batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        h = self.fc(x).squeeze()
        per_sample = torch.stack([x[i].sum() * (i + 1) for i in range(x.size(0))]) * self.fc.bias
        return ((h - y) ** 2).sum() / len(x) + per_sample.sum() / torch.numel(y), h


def test_the_batch_the_trace_turned_into_a_number_gets_an_export_each() -> None:
    """The batch was left out of the sizes exported again and compared, unless a trace warning named a baked value
    (`len()`'s came from torch's own file and was dropped): a mean by len(x) was the first batch's at every batch,
    a loop over the batch ran the first batch's rows, and a squeezed output declared at the first batch failed the
    backward at the next. Each new batch is now compared as the other sizes are."""
    model = BatchAsNumber()
    ref, om = copy.deepcopy(model), ORTModule(model)
    with pytest.warns(RuntimeWarning, match="turns input sizes into constants"):
        for batch in (4, 4, 8, 1, 4):
            x, y = torch.randn(batch, 4), torch.randn(batch)
            for m in (om, ref):
                m.zero_grad()
                loss, h = m(x, y)
                (loss + h.sum()).backward()
            torch.testing.assert_close(om(x, y), ref(x, y), rtol=1e-5, atol=1e-6, msg=f"outputs at {batch}")
            for (name, p), q in zip(om.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at {batch}")
    assert om.stats["exports"] == 3


def test_a_module_exported_per_size_keeps_the_exports_used_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module exported for each input size kept every export and its sessions: memory grew with each new size
    (a character RNN meeting every length). Past `PER_SIZE_SCHEMAS` the least recently used is dropped, and a size
    coming back is exported again, warned once."""
    monkeypatch.setattr(engine, "PER_SIZE_SCHEMAS", 3)
    model = BatchAsNumber()
    ref, om = copy.deepcopy(model), ORTModule(model)
    exports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (2, 2, 3, 4, 2, 5, 6, 2, 3):
            x, y = torch.randn(batch, 4), torch.randn(batch)
            for m in (om, ref):
                m.zero_grad()
                loss, h = m(x, y)
                (loss + h.sum()).backward()
            for (name, p), q in zip(om.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at {batch}")
            assert len(om._engine.schemas) <= 3
            exports.append(om.stats["exports"])
    # 2 is used again before 5 and 6 arrive, so it stays; 3 and 4 are dropped, and 3 comes back
    assert exports == [1, 1, 2, 3, 3, 4, 5, 5, 6]
    assert sum("only the 3 used last are kept" in str(w.message) for w in caught) == 1


def test_a_squeezed_output_of_a_batch_of_one_trains() -> None:
    """`fc(x).squeeze()` of a (batch, 1) output is 0-d at a batch of one: the same nodes as at a batch of 8, but an
    output of another rank, whose backward reused the one built for rank 1 ("Invalid rank for input")."""
    class Score(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x).squeeze()

    model = Score(4, 1)
    ref, om = copy.deepcopy(model), ORTModule(model)
    for batch in (8, 8, 1, 5):
        x = torch.randn(batch, 4)
        for m in (om, ref):
            m.zero_grad()
            m(x).square().sum().backward()
        torch.testing.assert_close(om.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-6, msg=f"at {batch}")


def test_a_mean_over_the_batch_exports_once_for_every_batch() -> None:
    """A module computing with run-time sizes only: each new batch is exported again and compared, the one export
    serves them all."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    ref, om = copy.deepcopy(model), ORTModule(model)
    for batch in (4, 8, 1, 5):
        x = torch.randn(batch, 4)
        for m in (om, ref):
            m.zero_grad()
            m(x).mean().backward()
        for p, q in zip(om.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert om.stats["exports"] == 1


class RNNSteps(nn.Module):
    """An RNN's outputs at every step: the dynamo exporter unrolls its loop over the traced sequence's length (and
    splits the steps with SplitToSequence, no gradient rule, written as Gathers) but declared that length dynamic."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_sizes_dynamo_fixed_get_an_export_each() -> None:
    """torch.export found the graph holds at the traced length only (its range [10, 10]), and torch.onnx declared
    the length a symbol: 12 steps ran the 10-step graph without a word. Pinned in the inputs' types, another length
    gets its own export (warned once), the traced one and the batch reuse theirs."""
    model = RNNSteps()
    ref, om = copy.deepcopy(model), ORTModule(model, exporter="dynamo")
    with pytest.warns(RuntimeWarning, match="assumes what these sizes break") as caught:
        _train_at_sizes(om, ref, [((4, 10, 3), 1), ((6, 10, 3), 1), ((4, 12, 3), 2), ((2, 7, 3), 3), ((3, 12, 3), 3)])
    assert sum("assumes what these sizes break" in str(w.message) for w in caught) == 1


class SizeBranches(nn.Module):
    """Python branches on input sizes, the batch's included: torch.export keeps the branch taken and records its
    condition as a range (`x.shape[1] > 8`) or a runtime assert (`x.shape[0] % 3 == 0`), which torch.onnx does not
    put in the ONNX graph."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1))

    def forward(self, x):
        if x.shape[1] > 8:
            x = x * 2
        if x.shape[0] % 3 == 0:
            x = x.flip(0)
        return x * self.w + x.sum(1, keepdim=True) * x.shape[0]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_sizes_branches_get_an_export_that_holds(exporter: str) -> None:
    """Before `size_guards`, dynamo ran every shape below after the first with the first export's branches
    without a word: each call now goes to the first export whose guards its sizes meet, else gets a new one
    (warned once). The legacy trace warns that it baked a value in, and the batch then joins the sizes it
    exports again and compares (it ran the traced branch at a batch of 4)."""
    model = SizeBranches()
    ref, om = copy.deepcopy(model), ORTModule(model, exporter=exporter)
    warned = "assumes what these sizes break" if exporter == "dynamo" else "turns input sizes into constants"
    with pytest.warns(RuntimeWarning, match=warned) as caught:
        for shape, exports in [((6, 10), 1), ((9, 12), 1), ((4, 10), 2), ((6, 4), 3), ((5, 11), 3), ((3, 5), 3),
                               ((7, 9), 3), ((6, 10), 3)]:
            x = torch.randn(shape)
            for m in (om, ref):
                m.zero_grad()
                m(x).square().sum().backward()
            torch.testing.assert_close(om(x), ref(x), rtol=1e-5, atol=1e-5, msg=f"outputs at {shape}")
            torch.testing.assert_close(om.w.grad, ref.w.grad, rtol=1e-4, atol=1e-4, msg=f"gradient at {shape}")
            assert om.stats["exports"] == exports or exporter != "dynamo", shape
    assert sum(warned in str(w.message) for w in caught) == 1


class SharedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, y):
        return (x * self.w + y).sum(0) * x.shape[0]


def test_sizes_dynamo_one_symbol_for_two_inputs() -> None:
    """torch.export traced `x + y` at equal batches as one symbol, and the graph reads x's batch from y's Shape:
    x of 1 row broadcast over y's 5 got 5 times torch's result (the batch is not part of a schema's key)."""
    model = SharedBatch()
    ref, om = copy.deepcopy(model), ORTModule(model, exporter="dynamo")
    with pytest.warns(RuntimeWarning, match="assumes what these sizes break"):
        for rows, exports in [((3, 3), 1), ((1, 5), 2), ((4, 4), 2)]:
            x, y = torch.randn(rows[0], 4), torch.randn(rows[1], 4)
            for m in (om, ref):
                m.zero_grad()
                m(x, y).square().sum().backward()
            torch.testing.assert_close(om(x, y), ref(x, y), rtol=1e-5, atol=1e-5, msg=f"outputs at {rows}")
            torch.testing.assert_close(om.w.grad, ref.w.grad, rtol=1e-4, atol=1e-4, msg=f"gradient at {rows}")
            assert om.stats["exports"] == exports, rows


def test_an_export_the_same_at_enough_sizes_serves_every_size(monkeypatch) -> None:
    """Sizes are checked until `SIZE_CHECKS` new ones were all the same graph; then the export serves the rest
    without exporting again (a model padding each batch to its longest sequence meets many lengths)."""
    monkeypatch.setattr(engine, "SIZE_CHECKS", 2)
    exports = []
    real = engine.export
    monkeypatch.setattr(engine, "export", lambda *a, **k: exports.append(1) or real(*a, **k))
    om = ORTModule(TextCNN())
    for length in (7, 8, 9, 10, 11, 12):
        om(torch.randn(2, 4, length)).sum().backward()
    assert len(exports) == 3 and om.stats["exports"] == 1  # the first, then lengths 8 and 9 compared


def test_memory_pattern_for_small_modules_only(monkeypatch) -> None:
    """A small module's sessions plan each run's memory in one block (onnxruntime's memory pattern: an arena
    allocation per node saved); above `MEM_PATTERN_MAX_BYTES` of parameters they allocate node by node, since the
    plan holds more than a run needs at once (the rest of the suite trains with it on)."""
    from runtime import engine

    def trained(model: nn.Module) -> list:
        wrapped = ORTModule(model, threads=1)
        wrapped(torch.randn(3, 16)).square().sum().backward()
        return [s.config.mem_pattern for s in wrapped.training_sessions()]

    assert trained(_mlp(16)) == [True]
    monkeypatch.setattr(engine, "MEM_PATTERN_MAX_BYTES", 100)
    assert trained(_mlp(16)) == [False]


def test_size_guards_refusal() -> None:
    """Each kind of guard `SizeGuards` reads off torch.export refuses the sizes that break it, and only those."""
    import sympy

    from runtime.size_guards import SizeGuards

    s, t = sympy.symbols("s t", integer=True, positive=True)
    g = SizeGuards(dims=((s, 4), (s, 2 * t), (t,)), ranges=((t, 2, 9),), asserts=(sympy.Ne(sympy.Mod(s, 3), 0),))
    assert g.refusal([(4, 4), (4, 6), (3,)]) is None
    assert g.refusal([(5, 4), (5, 18), (9,)]) is None
    for shapes, why in [([(4, 5), (4, 6), (3,)], "fixed at 4"), ([(4, 4), (5, 6), (3,)], "equal to another size"),
                        ([(4, 4), (4, 7), (3,)], "traced as 2*t"), ([(4, 4), (4, 20), (10,)], "for 2 to 9"),
                        ([(4, 4), (4, 2), (1,)], "for 2 to 9"), ([(6, 4), (6, 6), (3,)], "assumption"),
                        ([(4, 4), (4, 6), (3, 1)], "rank"), ([(4, 4), (4, 6)], "2 inputs")]:
        assert why in (g.refusal(shapes) or ""), (shapes, g.refusal(shapes))


class ReversedStrided(nn.Module):
    """A map and its reversal joined, every third position kept, globally pooled and squeezed."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(2, 4, 3, padding=1), nn.Linear(4, 3)

    def forward(self, x):
        y = self.conv(x)
        y = torch.cat([y, y.flip(-1)], -1)[..., ::3]
        return self.head(nn.functional.max_pool1d(y, y.shape[-1]).squeeze(-1))


def test_dynamo_exports_what_torch_export_refuses_with_every_axis_symbolic() -> None:
    """torch.export refused the module with every input axis symbolic ("Eq(((s63 + 1)//18), 4) is inconsistent!");
    with the batch symbolic alone it exports: another batch reuses that export, another length exports again."""
    model = ReversedStrided()
    ref, om = copy.deepcopy(model), ORTModule(model, exporter="dynamo")
    _train_at_sizes(om, ref, [((4, 2, 17), 1), ((6, 2, 17), 1), ((4, 2, 20), 2), ((3, 2, 17), 2)])


def _train_at_sizes(om: ORTModule, ref: nn.Module, steps: list[tuple[tuple[int, ...], int]]) -> None:
    """A step of both at each input shape: outputs and gradients alike, and the exports made so far as given."""
    for shape, exports in steps:
        x = torch.randn(shape)
        for m in (om, ref):
            m.zero_grad()
            m(x).square().sum().backward()
        torch.testing.assert_close(om(x), ref(x), rtol=1e-5, atol=1e-6, msg=f"outputs at {shape}")
        for (name, p), q in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"{name} at {shape}")
        assert om.stats["exports"] == exports, shape
