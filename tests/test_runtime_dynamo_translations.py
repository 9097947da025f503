"""runtime/dynamo_translations.py: under the dynamo exporter, ops onnxscript translates into something else than torch
computes give torch's outputs and gradients, at exact ties and NaNs: max / min along a dim and global adaptive max
pooling (a tie's gradient to the index returned; NaN kept), amax / amin (NaN kept), clamp with tensor bounds (a bound
reached: x's gradient; float64 clamps' bounds are tensors, margin losses' clamp_min too), attention under a boolean
mask leaving a query no key, binary cross-entropy at p = target = 0 or 1 (runtime's replacement detaches, which
onnxscript drops), xlogy's gradient at x = 0, and float64 activations' constants (elu, selu, leaky_relu, log2),
logaddexp and logcumsumexp of -infs (onnxscript's gave NaN gradients, which masked_fill's backward, once a product by
its mask, did not stop either), a number minus integers (torch's decomposition failed); bernoulli_(p) under
`torch_dropout` draws torch's mask; conv3d without bias runs; ifft of a real tensor trains. Every entry of `OPS` runs
in float32 and in float64, the latter to `DOUBLE_RTOL`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from parity import check_parity
from torch import nn
from torch.nn import functional as F

from runtime import ORTModule

NAN = float("nan")
H = [[1.0, 3, 3, 0, -2, 1], [2, 2, 1, 2, 0, -1], [0, 0, 0, 0, 0, 0], [-1, 4, 4, -3, -2, 2]]
"""Integer-valued: ties along rows and columns, zeros, and values on `BOUND`, `BOUND` + 1 and `BOUND` - 1."""
BOUND = [[1.0, 2, 3, 0, -2, 0.5]]
NANS = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]]).bool()
Y = torch.tensor([[2.0, 0.5, 3, 1.5, 2, 0.25], [0.5, 2, 3, 1.5, 2.5, 4], [2, 0, -1, 1e-3, 0.5, 3], [1, 2, 3, 4, 5, 6]])
"""xlogy's y: at x = 0 (`H`'s zeros) torch's gradient of x is log(y), 0 where y <= 0 (row 2). (At y = inf torch's
is inf, ours 0: the value 0 * log(inf) there would be NaN, torch's 0.)"""
KEYS = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]]).bool()
"""An attention mask leaving query 1 no key: torch's output there is zeros, without a gradient."""
NO_PROBABILITY = torch.tensor([[1, 0, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 1, 0]]).bool()
"""Log-probabilities of 0 (-inf): leading runs (logcumsumexp's outputs -inf) and pairs both -inf under flip(1) (row 0)
and flip(0) (rows 0 and 3): torch's gradients there are NaN, which masked_fill's backward stops."""
DOUBLE_RTOL = 1e-10

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _max_and_index(h: torch.Tensor, dim: int, largest: bool = True, keepdim: bool = False) -> torch.Tensor:
    values, indices = h.max(dim, keepdim) if largest else h.min(dim, keepdim)
    return values * (1 + indices / 10)


def _log_masked(h: torch.Tensor) -> torch.Tensor:
    return h.masked_fill(NO_PROBABILITY, -float("inf"))


def _pooled(h: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """adaptive_max_pool2d of h as two channels of 2 x 6 (each with a tie at its max), shifted by the indices."""
    values, indices = F.adaptive_max_pool2d(h.reshape(2, 2, 6), size, return_indices=True)
    return values * (1 + indices / 10)


OPS: dict[str, Op] = {
    "max_dim": lambda h, b: _max_and_index(h, 1),
    "min_dim_keepdim": lambda h, b: _max_and_index(h, 0, largest=False, keepdim=True),
    "max_dim_nan": lambda h, b: _max_and_index(h.masked_fill(NANS, NAN), -1),
    "amax_nan": lambda h, b: h.masked_fill(NANS, NAN).amax(1),
    "amin_nan_every": lambda h, b: h.masked_fill(NANS, NAN).amin((0, 1), keepdim=True),
    "adaptive_max_pool_global": lambda h, b: _pooled(h, 1),
    "adaptive_max_pool_divided": lambda h, b: _pooled(h, (1, 3)),
    "clamp": lambda h, b: torch.clamp(h, b, b + 1),
    "clamp_crossed": lambda h, b: torch.clamp(h, b, b - 1),
    "clamp_equal": lambda h, b: torch.clamp(h, b, b * 1),
    "clamp_min": lambda h, b: torch.clamp_min(h, b) * torch.arange(1.0, 7.0, dtype=h.dtype),
    "clamp_max": lambda h, b: h.clamp(max=b) * torch.arange(1.0, 7.0, dtype=h.dtype),
    "clamp_nan": lambda h, b: torch.clamp(h.masked_fill(NANS, NAN), b.masked_fill(NANS[:1], NAN), b + 1),
    "clamp_numbers": lambda h, b: torch.clamp(h, -1.0, 2.0) * b,
    "margin_ranking": lambda h, b: F.margin_ranking_loss(h[0], h[1], torch.ones_like(b[0]), margin=1.0,
                                                          reduction="none"),
    "hinge_embedding": lambda h, b: F.hinge_embedding_loss(h, -torch.ones_like(h), margin=2.0, reduction="none"),
    "attention_masked_query": lambda h, b: F.scaled_dot_product_attention(
        h[None, None] / 4, h.flip(0)[None, None] / 4, (h * b)[None, None], KEYS),
    "binary_cross_entropy_saturated": lambda h, b: F.binary_cross_entropy(
        (h.clamp(-1, 1) + 1) / 2, (h > 0).to(h.dtype)),
    "xlogy": lambda h, b: torch.xlogy(h, Y.to(h.dtype)),
    "xlogy_number": lambda h, b: torch.xlogy(h, 2.5),
    "elu": lambda h, b: F.elu(h / 2, 0.7),
    "selu": lambda h, b: F.selu(h / 2),
    "leaky_relu": lambda h, b: F.leaky_relu(h / 3, 0.1),
    "log2": lambda h, b: torch.log2(h + 5),
    "logaddexp_of_neg_infs": lambda h, b: (torch.logaddexp(_log_masked(h), _log_masked(h).flip(1)).exp()
                                           + torch.logaddexp2(_log_masked(h), _log_masked(h).flip(0)).exp2()),
    "logcumsumexp_of_neg_infs": lambda h, b: (_log_masked(h).logcumsumexp(1).exp()
                                              + _log_masked(h / 4).logcumsumexp(0).exp()),
    # a number minus an integer mask (XLNet's `1.0 - attention_mask`): torch's decomposition failed the export
    "rsub_of_integers": lambda h, b: (h * (1.0 - (h > 0).long()) + (3 - (h > b).long()) * h
                                      + torch.rsub(h, 2.5, alpha=3) + (1 - h) * b),
}


class Applied(nn.Module):
    """OPS[name] of parameters holding `H` and `BOUND` (times the input, ones: the values exactly)."""

    def __init__(self, op: Op, dtype: torch.dtype) -> None:
        super().__init__()
        self.op = op
        self.h = nn.Parameter(torch.tensor(H, dtype=dtype))
        self.b = nn.Parameter(torch.tensor(BOUND, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.h * x, self.b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(OPS))
def test_ops_at_ties_and_nans_train_like_torch(name: str, dtype: torch.dtype) -> None:
    """Two calls (the second at twice the values: ties stay ties), outputs and every parameter's gradient as torch's,
    NaNs where torch's are."""
    rtol, atol = (DOUBLE_RTOL, 0.0) if dtype == torch.float64 else (1e-5, 1e-6)
    ours, reference = Applied(OPS[name], dtype), Applied(OPS[name], dtype)
    model = ORTModule(ours, exporter="dynamo")
    for scale in (1.0, 2.0):
        x = torch.full((4, 6), scale, dtype=dtype)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
        weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(int(scale)), dtype=dtype)
        (got * weights).nansum().backward()
        (want * weights).nansum().backward()
        for (key, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), key
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, equal_nan=True, msg=key)
    assert model.stats["exports"] == 1 and model.stats["fallbacks"] == 0, model.stats


class DropPath(nn.Module):
    """timm's drop_path: a per-sample mask from `bernoulli_(keep)` (aten bernoulli.p), scaled by 1 / keep."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.7
        mask = x.new_empty((x.shape[0], 1)).bernoulli_(keep) / keep
        return x + self.linear(x) * mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_bernoulli_of_a_number_draws_torchs_mask(dtype: torch.dtype) -> None:
    """Under `torch_dropout` the host draws bernoulli_(p) as torch's Bernoulli kernel does (onnxscript's p, a
    CastLike, hid it: onnxruntime's uniforms gave another mask, silently); three calls, the batch changing."""
    rtol, atol = (DOUBLE_RTOL, 0.0) if dtype == torch.float64 else (1e-5, 1e-6)
    torch.manual_seed(0)
    ours = DropPath(dtype)
    reference = DropPath(dtype)
    reference.load_state_dict(ours.state_dict())
    model = ORTModule(ours, exporter="dynamo", torch_dropout=True)
    for step, batch in enumerate((8, 5, 8)):
        x = torch.randn(batch, 4, dtype=dtype)
        state = torch.random.get_rng_state()
        got = model(x)
        torch.random.set_rng_state(state)
        want = reference(x)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"call {step}")
        got.square().sum().backward()
        want.square().sum().backward()
        for (key, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=f"call {step}: {key}")
    assert model.stats["exports"] == 1 and model.stats["fallbacks"] == 0, model.stats


class Conv3d(nn.Module):
    """Two 3-D convolutions, without and with a bias (strided, padded, dilated, grouped)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv3d(2, 4, 3, padding=1, bias=False)
        self.second = nn.Conv3d(4, 4, (2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 0), dilation=(2, 1, 1), groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu())


def test_conv3d_without_bias_trains_like_torch() -> None:
    """onnxscript gave a 3-D convolution without bias a zero bias of the wrong rank: onnxruntime refused the first
    run (3-D CNNs convolve without bias before a BatchNorm3d). Two calls, the batch changing."""
    torch.manual_seed(0)
    ours, reference = Conv3d(), Conv3d()
    reference.load_state_dict(ours.state_dict())
    model = ORTModule(ours, exporter="dynamo")
    for batch in (2, 3):
        x = torch.randn(batch, 2, 5, 6, 4)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.square().sum().backward()
        want.square().sum().backward()
    for (key, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=key)
    assert model.stats["fallbacks"] == 0, model.stats


class InverseOfReal(nn.Module):
    """torch.fft.ifft of a real tensor, which torch computes as its forward transform conjugated over n (a negated
    view of the imaginary part), along the positions and along the features."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return torch.fft.ifft(h, dim=1).imag + torch.fft.ifft(h, dim=2).real * h


def test_ifft_of_a_real_tensor() -> None:
    """onnxscript had no translation for the negated view ("No ONNX function found for aten._neg_view"), and the
    legacy exporter has no fft at all: the module could not train. Float64, to 1e-12 of the largest."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, n, 8, generator=g, dtype=torch.float64),) for n in (10, 7)]
    weights = torch.randn(8, generator=g, dtype=torch.float64)
    check_parity(lambda: InverseOfReal().double(), batches, lambda m, b: (m(*b) * weights).sum(), rtol=1e-12,
                 exporter="dynamo")
