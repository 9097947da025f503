"""float64 arithmetic on 0-d tensors through the legacy exporter (runtime/double_scalars.py), which writes
`aux * 3` on a 0-d float64 tensor in float32, and on numbers computed from sizes through both exporters: ORTModule's
outputs and gradients against torch's in float64."""

from __future__ import annotations

import copy
import io
import math
import warnings
from collections.abc import Callable

import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runtime import ORTModule, double_scalars


class Weighted(nn.Module):
    """A float64 module whose output carries 0-d arithmetic with Python numbers: an auxiliary term weighted into
    a tensor, a regularizer, and (with `scalar`) a 0-d result returned as is."""

    def __init__(self, scalar: bool):
        super().__init__()
        self.a, self.b, self.scalar = nn.Linear(8, 16), nn.Linear(16, 8), scalar

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z = torch.tanh(self.a(x))
        out = self.b(z) * torch.sigmoid(x.sum(-1, keepdim=True)) + 3 * z.sum() + 0.01 * self.a.weight.square().sum()
        return (out, self.b(z).sum() * 0.5 - 2) if self.scalar else (out,)


def test_zero_d_arithmetic_stays_in_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    for scalar in (False, True):
        reference = Weighted(scalar).double()
        model = ORTModule(copy.deepcopy(reference))
        for _ in range(2):
            results = []
            for m in (reference, model):
                for p in m.parameters():
                    p.grad = None
                outs = m(x)
                sum(o.square().sum() for o in outs).backward()
                results.append((outs, [p.grad for p in m.parameters()]))
            (want, want_grads), (got, got_grads) = results
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype == torch.float64  # the 0-d result came back float32
                torch.testing.assert_close(g, w, rtol=1e-13, atol=0)
            for g, w in zip(got_grads, want_grads, strict=True):  # 6e-8 relative apart in float32
                torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_a_float32_result_the_module_makes_stays_float32() -> None:
    class Demoted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).sum().float() * 3

    x = torch.randn(2, 3, dtype=torch.float64)
    reference = Demoted().double()
    out = ORTModule(copy.deepcopy(reference))(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x))



def test_zero_d_float64_and_float32_values_meet_in_float64() -> None:
    """ViTMAE's loss: a float64 per-patch loss weighted by a float32 mask (torch.ones of the default dtype), over the
    mask's float32 sum. torch computes a 0-d float64 value with a 0-d float32 one in float64; the legacy exporter
    cast the float64 one to float32 (the loss came back float32, 3e-9 off). A float32 tensor with dims times a 0-d
    float64 value stays float32, as in torch."""
    class MaskedLoss(nn.Module):
        def __init__(self, dims: bool) -> None:
            super().__init__()
            self.a, self.dims = nn.Linear(4, 4), dims

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.a(x).square().mean(-1)
            if self.dims:
                return self.a(x).float() * loss.sum()
            mask = torch.ones(x.shape[0], device=x.device)
            mask[0] = 0
            return (loss * mask).sum() / mask.sum()

    x = torch.randn(5, 4, dtype=torch.float64)
    for dims, dtype in ((False, torch.float64), (True, torch.float32)):
        torch.manual_seed(0)
        reference = MaskedLoss(dims).double()
        model = ORTModule(copy.deepcopy(reference))
        got, want = model(x), reference(x)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-13 if dtype == torch.float64 else 1e-6, atol=0)
        got.sum().backward()
        want.sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=0)


def test_a_float32_module_s_zero_d_values_meeting_float64_buffers_are_float64() -> None:
    """A float32 module's loss times a 0-d float64 buffer (a weight kept in double), plus another: torch computes
    both in float64 and returns float64; the legacy exporter wrote them in float32 (returned float32, then refused
    by the check's dtypes). The stretch takes in the loss, whose type the export does not declare (inferred)."""
    class Weighted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.register_buffer("weight", torch.tensor(0.1, dtype=torch.float64))
            self.register_buffer("offset", torch.tensor(1 / 3, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.a(x)
            return y, y.square().mean() * self.weight + self.offset

    torch.manual_seed(0)
    reference = Weighted()
    model = ORTModule(copy.deepcopy(reference))
    for _ in range(2):
        x = torch.randn(5, 4)
        got, want = model(x), reference(x)
        assert got[1].dtype == want[1].dtype == torch.float64
        torch.testing.assert_close(got[1], want[1], rtol=1e-7, atol=0)  # the mean's own float32 rounding
        mean = (got[1] - 1 / 3) / 0.1  # a float32 mean, the rest computed in float64
        torch.testing.assert_close(mean, mean.float().double(), rtol=1e-14, atol=0)
        assert got[1] != got[1].float().double()
        (got[0].sum() + got[1]).backward()
        (want[0].sum() + want[1]).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)  # float32 gradients near 1


def test_a_tensor_cast_to_float32_is_computed_in_float32() -> None:
    """A float64 module's own `x.float() * 0.3`, promoted back where it meets float64 tensors: torch computes the
    product in float32, and so must the graph (a stretch started at that Cast computed it in float64, 3e-8 off)."""
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return torch.where(h > 0, h, h.float() * 0.3) + h + h.float() * 0.7

    torch.manual_seed(0)
    reference = Mixed().double()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(4, 6, dtype=torch.float64)
    got, want = model(x), reference(x)
    assert got.dtype == want.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def test_zero_d_results_stacked_or_unsqueezed_stay_in_float64() -> None:
    """0-d float64 arithmetic then reshaped (`loss[None]`, `torch.stack` of several, a Reshape and a Flatten): the
    stretch runs through those views to the output, which came back float32 (4e-9 off)."""
    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.a(x)
            total = h.sum() + h.square().mean()
            return total[None], torch.stack([h.sum() * 3, h.mean() - 1]), total.reshape(1, 1).flatten()

    torch.manual_seed(0)
    reference = Stacked().double()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(4, 6, dtype=torch.float64)
    for got, want in zip(model(x), reference(x), strict=True):
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)


def test_sizes_cast_to_float_join_the_stretch() -> None:
    """0-d float64 arithmetic with a size the trace reads (`label_smoothing / classes` in cross_entropy's
    smoothing, a sum over the batch's size): the exporter casts the size to float32 and computes on it in float32
    (the loss came back float32, 4e-8 off). Batches of 3 and 5 rows: the size is read at run time."""
    class Smoothed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.a(x)
            loss = nn.functional.cross_entropy(h, y, label_smoothing=0.1)
            return loss, h.square().sum() / x.shape[0] * 0.3

    torch.manual_seed(0)
    reference = Smoothed().double()
    model = ORTModule(copy.deepcopy(reference))
    for n in (3, 5):
        x, y = torch.randn(n, 6, dtype=torch.float64), torch.randint(0, 4, (n,))
        results = []
        for m in (reference, model):
            for p in m.parameters():
                p.grad = None
            outs = m(x, y)
            sum(outs).backward()
            results.append((outs, [p.grad for p in m.parameters()]))
        (want, want_grads), (got, got_grads) = results
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float64
            torch.testing.assert_close(g, w, rtol=1e-13, atol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


SCALED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "a power": lambda h: h * h.shape[0] ** -0.5,
    "a reciprocal": lambda h: h * (1.0 / h.shape[0]),
    "a product": lambda h: h * (h.shape[0] * 0.1),
    "a ratio of sums": lambda h: h * (h.shape[-1] / (h.shape[0] + 3)),
}
"""A float64 tensor times a Python number computed from a size read at run time (the batch's; attention's
`d ** -0.5` where d varies): both exporters wrote it in float32 and cast it to float64, 4e-9 to 2.8e-8 off torch's,
relative."""


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("scale", list(SCALED))
def test_sizes_arithmetic_cast_to_float64_is_computed_in_float64(scale: str, exporter: str) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return SCALED[scale](self.a(x)).sum(-1)

    torch.manual_seed(0)
    reference = Scaled().double()
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    for n in (3, 5):
        x = torch.randn(n, 6, dtype=torch.float64)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
        got.square().sum().backward()
        want.square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)


SELECTED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "where of a comparison": lambda h: torch.where(h.sum() > 0.3, h.sum(), 0.3 * h.mean()),
    "a comparison cast to float": lambda h: (h.sum() > 0.3) * h.sum() * 2 + h.mean() * (h.mean() <= 0),
    # our conversions' Wheres (runtime/symbolics.py) on 0-d operands
    "logaddexp, clamp": lambda h: torch.logaddexp(h.sum(), h.mean()) + torch.clamp(h.sum(), h.mean(), h.abs().sum()),
    "max of every element": lambda h: h.amax() + h.max() * 2 - h.min(),
    "floor division, rounding": lambda h: (h.sum() * (h.sum().detach() // 0.3) + h.sum().floor() * 0.3
                                           + torch.remainder(h.sum(), 0.7) + h.mean().round() * h.sum().sign()),
}


@pytest.mark.parametrize("select", list(SELECTED))
def test_zero_d_results_compared_and_selected_stay_in_float64(select: str) -> None:
    """0-d float64 results compared and selected (Where, a comparison's mask cast to float): the stretch runs
    through Where's branches and compares in float64; it stopped there, and the result came back float32 (3e-8
    off). Two calls: the comparisons go both ways."""
    class Selected(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return SELECTED[select](self.a(x))

    torch.manual_seed(0)
    reference = Selected().double()
    model = ORTModule(copy.deepcopy(reference))
    for sign in (1.0, -1.0):
        x = sign * (torch.randn(4, 6, dtype=torch.float64) + 1)
        results = []
        for m in (reference, model):
            for p in m.parameters():
                p.grad = None
            out = m(x)
            out.backward()
            results.append((out, [p.grad for p in m.parameters()]))
        (want, want_grads), (got, got_grads) = results
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_dynamo_constants_read_in_float64() -> None:
    """onnxscript writes a float64 module's Python numbers (`x * 2.7`, clamp's bounds, lerp's weight, where's
    scalar) as float32 Constants cast to float64 (2e-8 off torch's, relative): `constants_in_double` reads them at
    the decimal written. onnxruntime against torch on the dynamo export."""
    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2.7 + torch.where(x > 0.1, x, 0.3) + x.clamp(0.1, 0.7) + torch.lerp(x, x.flip(0), 0.3)
                    + x / 0.3 + (0.3 - x))

    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Scaled(), (x,), dynamo=True, optimize=False, verbose=False)
    model = double_scalars.constants_in_double(program.model_proto)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), Scaled()(x), rtol=1e-15, atol=0)

    class Weighted(Scaled):  # through ORTModule's dynamo export: outputs and gradients
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x * self.w)

    ref = Weighted()
    om = ORTModule(copy.deepcopy(ref), exporter="dynamo")
    for m in (om, ref):
        m(x).square().sum().backward()
    torch.testing.assert_close(om(x), ref(x), rtol=1e-13, atol=0)
    torch.testing.assert_close(om.w.grad, ref.w.grad, rtol=1e-12, atol=0)


class Scaling(nn.Module):
    """float64 ops whose numbers onnxscript writes as float32 attributes (addmm's Gemm) or `value_float` Constants
    (addmv, addcmul, softplus' beta), each 1e-8 to 4e-8 off torch's before."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.3, 36, dtype=torch.float64).reshape(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.addmm(x, x, self.w, beta=0.3, alpha=0.7) + torch.addmm(x, x, self.w, beta=0.0, alpha=1.3)
                + torch.addmv(x[0], self.w, x[1], beta=0.3, alpha=0.7) + torch.addcmul(x, x, self.w, value=0.3)
                + F.softplus(x @ self.w, beta=0.3, threshold=7.0))


def test_dynamo_scalings_read_in_float64() -> None:
    torch.manual_seed(0)
    ref = Scaling()
    om = ORTModule(copy.deepcopy(ref), exporter="dynamo")
    x = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for m in (om, ref):
        m(x).square().sum().backward()
    torch.testing.assert_close(om(x), ref(x), rtol=1e-14, atol=0)
    torch.testing.assert_close(om.w.grad, ref.w.grad, rtol=1e-13, atol=0)


def test_dynamo_constants_read_as_the_program_s_numbers() -> None:
    """A float64 flow's log-likelihood constant, `0.5 * d * math.log(2 * math.pi)` with d a size the export knows:
    dynamo folds it into one float32 Constant, whose shortest decimal (2.7568157) is 3e-8 off the number torch
    adds; `constants_in_double` reads it as the exported program's Python number that rounds to it."""
    class Flow(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.pow(2).sum(1) + 0.5 * h.shape[1] * math.log(2 * math.pi) - 0.01 * h.sum(1)

    h = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Flow(), (h,), dynamo=True, optimize=False, verbose=False)
    numbers = double_scalars.numbers_in(program.exported_program.graph.nodes)
    model = double_scalars.constants_in_double(program.model_proto, numbers)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: h.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), Flow()(h), rtol=1e-15, atol=0)


def test_legacy_constants_read_as_the_trace_s_numbers() -> None:
    """A 0-d float64 loss times math.log(2 * math.pi) through the legacy exporter: a float32 Constant, whose
    shortest decimal is 3e-8 off; `traced_numbers` gathers the trace's float64 numbers, which `in_double` reads
    it as."""
    class Flow(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.pow(2).sum() * math.log(2 * math.pi) + 0.5

    h = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    with warnings.catch_warnings(), double_scalars.traced_numbers() as numbers:
        warnings.simplefilter("ignore")
        torch.onnx.export(Flow(), (h,), buffer, dynamo=False, input_names=["h"], dynamic_axes={"h": {0: "n", 1: "d"}})
    model = onnx.load_from_string(buffer.getvalue())
    model = double_scalars.in_double(model, [model.graph.output[0].name], numbers)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"h": h.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), Flow()(h), rtol=1e-15, atol=0)


def test_zero_d_results_of_captured_tensors_stay_in_float64() -> None:
    """0-d results of tensors the module holds as plain attributes (constants of the trace: neither parameters nor
    buffers), a normalizer `h.sum() / self.counts[self.picked].sum()`: the legacy exporter folded each into a
    float32 constant (7.6e-9 off, relative); `traced_numbers` folds the trace's constants alike, in float64."""
    class Normalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 5)
            self.counts = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
            self.picked = torch.tensor([0, 3, 3, 1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return h.square().sum() / self.counts[self.picked].sum() + h.mean() * self.counts.prod()

    torch.manual_seed(0)
    reference = Normalized().double()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(6, 4, dtype=torch.float64)
    got, want = model(x), reference(x)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    got.backward()
    want.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=0)
