"""runtime/functions.py: adaptive average pooling to any size, average pooling by a divisor_override, a non-zero
threshold, channel shuffle, local response norm, Tensor.unfold, sinc, diff, kthvalue and nansum train through ORTModule
like torch (`check_parity`), the adaptive pooling for every input size from one export."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import pytest
import torch
from parity import check_parity, sgd
from torch import nn
from torch.nn import functional as F

from runtime import ExportWarning, ORTModule, ORTModuleError, functions


class Net(nn.Module):
    """A convolution, the layer under test, a Linear and a cross-entropy."""

    def __init__(self, layer: nn.Module, features: int):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.layer = layer
        self.head = nn.Linear(features, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.layer(self.conv(x)).flatten(1)), y)


def _batches(height: int, width: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(height * 100 + width)
    return [(torch.randn(5, 2, height, width, generator=g), torch.randint(0, 3, (5,), generator=g)) for _ in range(n)]


class Hypot(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.hypot(x, x.flip(1) + 0.5)


class OwnSizeNorm(nn.Module):
    """A layer norm over the input's own trailing sizes, as MAE normalizes its pixel targets."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-2:])


class FoldBack(nn.Module):
    """Overlapping 3x3 patches (stride 2, padded) summed back onto the 6x6 map by F.fold (Col2Im from opset 18)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.fold(nn.functional.unfold(x, 3, padding=1, stride=2), (6, 6), 3, padding=1, stride=2)


class Windows(nn.Module):
    """Tensor.unfold: 2x2 patches (two unfolds), or overlapping windows of 3 every 2 along the flattened map."""

    def __init__(self, overlapping: bool):
        super().__init__()
        self.overlapping = overlapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).unfold(-1, 3, 2) if self.overlapping else x.unfold(2, 2, 2).unfold(3, 2, 2)


class OwnSizePool(nn.Module):
    """A global pool written with the map's own traced sizes as its window (and stride): the legacy exporter refused
    a list of them ("Failed to export a node ... because it is not constant")."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind.endswith("3d"):
            x = x.unsqueeze(1)
            pool = F.max_pool3d if self.kind == "max3d" else F.avg_pool3d
            return pool(x, x.shape[-3:])
        if self.kind == "max indices":
            return F.max_pool2d(x, x.shape[-2:], return_indices=True)[0]
        pool = F.max_pool2d if self.kind == "max" else F.avg_pool2d
        return pool(x, x.shape[-2:], stride=[x.shape[-2], x.shape[-1]])


class Unpool(nn.Module):
    """A max pool's values put back where they came from (SegNet's decoder), into the pool's input size or a given
    one; with overlapping windows an element can be several windows' maximum."""

    def __init__(self, dims: int, kernel: int, stride: int, padding: int = 0, size: list[int] | None = None):
        super().__init__()
        pools = {1: (nn.MaxPool1d, nn.MaxUnpool1d), 2: (nn.MaxPool2d, nn.MaxUnpool2d)}[dims]
        self.pool = pools[0](kernel, stride, padding, return_indices=True)
        self.unpool = pools[1](kernel, stride, padding)
        self.dims, self.size = dims, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(2) if self.dims == 1 else x
        y, where = self.pool(x)
        return self.unpool(y, where, output_size=self.size)


class GroupedQueryAttention(nn.Module):
    """The map's 4 channels as 4 query heads of 6 tokens, attending over 2 key/value heads (`enable_gqa`): query
    heads 0-1 read key/value head 0, heads 2-3 head 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(x, x[:, :2], x[:, 2:].flip(-1), enable_gqa=True)


CASES = {
    "adaptive average pool 8x7 -> 3x3": (lambda: nn.AdaptiveAvgPool2d(3), 4 * 9, (8, 7)),
    "adaptive average pool 9x9 -> 2 x input width": (lambda: nn.AdaptiveAvgPool2d((2, None)), 4 * 2 * 9, (9, 9)),
    "adaptive average pool 5x6 -> 8x10": (lambda: nn.AdaptiveAvgPool2d((8, 10)), 4 * 80, (5, 6)),
    "adaptive average pool 1-D": (lambda: nn.Sequential(nn.Flatten(2), nn.AdaptiveAvgPool1d(5)), 4 * 5, (4, 6)),
    "adaptive max pool 8x7 -> 3x2": (lambda: nn.AdaptiveMaxPool2d((3, 2)), 4 * 6, (8, 7)),
    "adaptive max pool 1-D 9 -> 4": (lambda: nn.Sequential(nn.Flatten(2), nn.AdaptiveMaxPool1d(4)), 4 * 4, (3, 3)),
    "adaptive average pool 3-D 4x5x4 -> 3x2x3": (
        lambda: nn.Sequential(nn.Unflatten(1, (1, 4)), nn.AdaptiveAvgPool3d((3, 2, 3))), 18, (5, 4)),
    "adaptive max pool of a ReLU (ties)": (lambda: nn.Sequential(nn.ReLU(), nn.AdaptiveMaxPool2d(4)), 4 * 16, (9, 9)),
    "average pool, divisor_override": (lambda: nn.AvgPool2d(2, divisor_override=3), 4 * 9, (6, 6)),
    "average pool, divisor_override, padded, ceil mode": (
        lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, divisor_override=5), 4 * 25, (9, 9)),
    "threshold 0.1 -> 0.5": (lambda: nn.Threshold(0.1, 0.5), 4 * 36, (6, 6)),
    "softplus, beta 2, threshold 1": (lambda: nn.Softplus(beta=2, threshold=1), 4 * 36, (6, 6)),
    "hypot": (lambda: Hypot(), 4 * 36, (6, 6)),
    "layer norm over the input's own sizes": (lambda: OwnSizeNorm(), 4 * 36, (6, 6)),
    "fold of overlapping patches": (lambda: FoldBack(), 4 * 36, (6, 6)),
    "channel shuffle": (lambda: nn.ChannelShuffle(2), 4 * 36, (6, 6)),
    "grouped-query attention": (lambda: GroupedQueryAttention(), 4 * 36, (6, 6)),
    "max unpool 2x2": (lambda: Unpool(2, 2, 2), 4 * 36, (6, 6)),
    "max unpool, overlapping padded windows": (lambda: Unpool(2, 3, 1, 1), 4 * 36, (6, 6)),
    "max unpool 1-D to a given size": (lambda: Unpool(1, 2, 2, size=[37]), 4 * 37, (6, 6)),
    "local response norm": (lambda: nn.LocalResponseNorm(3, alpha=0.1, beta=0.75, k=2.0), 4 * 36, (6, 6)),
    "Tensor.unfold patches": (lambda: Windows(False), 4 * 36, (6, 6)),
    "Tensor.unfold overlapping windows": (lambda: Windows(True), 4 * 17 * 3, (6, 6)),
    **{f"{kind} pool over the map's own size": (lambda kind=kind: OwnSizePool(kind), 1 if kind.endswith("3d") else 4,
                                                 (6, 7)) for kind in ("max", "avg", "max indices", "max3d", "avg3d")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_trains_like_torch(case: str) -> None:
    layer, features, (height, width) = CASES[case]
    check_parity(lambda: Net(layer(), features), _batches(height, width), lambda m, b: m(*b), threads=1)


class Pair(nn.Module):
    """Token features, a layer under test over them, a head and a cross-entropy over every token."""

    def __init__(self, layer: str):
        super().__init__()
        self.proj = nn.Linear(6, 8)
        self.norm = nn.RMSNorm(8) if layer == "rms" else nn.RMSNorm([4, 8], eps=1e-3) if layer == "rms2" else None
        self.bilinear = None if self.norm is not None else nn.Bilinear(*(8, 8) if layer == "bilinear" else (4, 4), 8)
        self.head = nn.Linear(8, 3)
        self.layer = layer

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        if self.norm is not None:
            h = self.norm(h)
        else:  # "halves": two slices of one tensor, whose sizes the exported graph names apart
            h = self.bilinear(h, h.flip(1)) if self.layer == "bilinear" else self.bilinear(h[..., :4], h[..., 4:])
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@pytest.mark.parametrize("layer", ["rms", "rms2", "bilinear", "bilinear halves"])
def test_token_layer_trains_like_torch(layer: str) -> None:
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, 6, generator=g), torch.randint(0, 3, (5, 4), generator=g)) for _ in range(3)]
    check_parity(lambda: Pair(layer), batches, lambda m, b: m(*b), threads=1)


class Bags(nn.Module):
    """Fixed-size bags of token ids, an EmbeddingBag, a head and a cross-entropy."""

    def __init__(self, mode: str, padding_idx: int | None, weighted: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 6, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(6, 3)
        self.weighted = weighted

    def forward(self, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weights = torch.linspace(0.5, 1.5, tokens.shape[1]).expand(tokens.shape) if self.weighted else None
        return nn.functional.cross_entropy(self.head(self.bag(tokens, per_sample_weights=weights)), y)


@pytest.mark.parametrize("mode, padding_idx, weighted", [("mean", None, False), ("sum", None, True),
                                                         ("max", None, False), ("mean", 0, False), ("max", 0, False)])
def test_embedding_bag_trains_like_torch(mode: str, padding_idx: int | None, weighted: bool) -> None:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        tokens = torch.randint(0, 12, (6, 5), generator=g)
        tokens[0] = 0  # a bag of padding only, where padding_idx is 0
        batches.append((tokens, torch.randint(0, 3, (6,), generator=g)))
    check_parity(lambda: Bags(mode, padding_idx, weighted), batches, lambda m, b: m(*b), threads=1)


class VariableBags(nn.Module):
    """Bags of token ids cut by offsets (an empty bag among them, and a last one when include_last_offset)."""

    def __init__(self, mode: str, padding_idx: int | None, weighted: bool, include_last: bool):
        super().__init__()
        self.bag = nn.EmbeddingBag(12, 6, mode=mode, padding_idx=padding_idx, include_last_offset=include_last)
        self.head = nn.Linear(6, 3)
        self.weighted, self.include_last = weighted, include_last

    def forward(self, tokens: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        weights = torch.linspace(0.5, 1.5, tokens.shape[0]) if self.weighted else None
        return nn.functional.cross_entropy(self.head(self.bag(tokens, offsets, per_sample_weights=weights)), y)


@pytest.mark.parametrize("mode, padding_idx, weighted, include_last",
                         [("mean", None, False, False), ("sum", None, True, True), ("mean", 0, False, True),
                          ("max", None, False, False), ("max", 0, False, True)])
def test_embedding_bag_with_offsets_trains_like_torch(mode: str, padding_idx: int | None, weighted: bool,
                                                      include_last: bool) -> None:
    g = torch.Generator().manual_seed(0)
    batches = []
    for starts in ([0, 3, 3, 7, 9], [0, 1, 5, 5, 8], [0, 2, 4, 6, 12]):  # empty bags, the last one too
        offsets = torch.tensor([*starts, 12] if include_last else starts)
        batches.append((torch.randint(0, 12, (12,), generator=g), offsets, torch.randint(0, 3, (5,), generator=g)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # the legacy exporter's (its max's isneginf went to dynamo)
        check_parity(lambda: VariableBags(mode, padding_idx, weighted, include_last), batches, lambda m, b: m(*b),
                     threads=1)


def test_adaptive_pooling_follows_the_input_size() -> None:
    """One export serves other image sizes: each window is computed from the run-time size, as torch's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.AdaptiveAvgPool2d((3, 4)), nn.AdaptiveMaxPool2d(2))
    model = ORTModule(net, threads=1)
    for height, width in ((9, 9), (12, 7), (5, 14)):
        x = torch.randn(2, 2, height, width)
        torch.testing.assert_close(model(x), net(x), rtol=1e-5, atol=1e-6)
    assert model.stats["exports"] == 1


def test_adaptive_max_pool_picks_torchs_element_among_ties() -> None:
    """The first maximum of each window in raster order, as torch's indices say, on rounded values (many ties)."""
    from runtime import functions

    pool = functions._adaptive_max_pool2d(torch._C._nn.adaptive_max_pool2d)
    g = torch.Generator().manual_seed(0)
    for size, out in (((9, 9), (4, 4)), ((7, 10), (3, 4)), ((8, 8), 2)):
        x = torch.randint(0, 3, (2, 3, *size), generator=g).float()
        values, index = pool(x, out)
        want_values, want_index = nn.functional.adaptive_max_pool2d(x, out, return_indices=True)
        torch.testing.assert_close(values, want_values, rtol=0, atol=0)
        assert torch.equal(index, want_index)


class SpatialTransformer(nn.Module):
    """An affine grid from a localisation layer, bilinear grid sampling (the GridSample rule), a head."""

    def __init__(self, align_corners: bool, identity: bool = False, mode: str = "bilinear", padding: str = "zeros"):
        super().__init__()
        self.mode, self.padding = mode, padding
        self.loc = nn.Linear(64, 6)
        nn.init.normal_(self.loc.weight, std=0.05)
        self.loc.bias.data = torch.tensor([1.0, 0.1, 0.0, -0.1, 0.9, 0.05])
        if identity:  # the tutorial's start: every sample on a pixel, where bilinear sampling has its kinks
            self.loc.weight.data.zero_()
            self.loc.bias.data = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
        self.head = nn.Linear(64, 3)
        self.align_corners = align_corners

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = nn.functional.affine_grid(theta, list(x.shape), align_corners=self.align_corners)
        sampled = nn.functional.grid_sample(x, grid, mode=self.mode, padding_mode=self.padding,
                                            align_corners=self.align_corners)
        return nn.functional.cross_entropy(self.head(sampled.flatten(1)), y)


@pytest.mark.parametrize("identity", [False, True])
@pytest.mark.parametrize("align_corners", [False, True])
def test_spatial_transformer_trains_like_torch(align_corners: bool, identity: bool) -> None:
    """From a random transform, and from the identity, where the grid must be torch's to the bit: a sample an ulp
    off a pixel takes the other one-sided difference (theta's gradient was 10% off torch's there)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    check_parity(lambda: SpatialTransformer(align_corners, identity), batches, lambda m, b: m(*b), threads=1)


@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("mode, padding", [("bicubic", "zeros"), ("bicubic", "reflection"),
                                           ("bilinear", "reflection"), ("bicubic", "border")])
def test_spatial_transformer_modes(mode: str, padding: str, align_corners: bool) -> None:
    """Bicubic sampling and reflection padding through ORTModule, a zoomed-out transform so that
    samples fall outside the image and reflect."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]

    def make() -> SpatialTransformer:
        m = SpatialTransformer(align_corners, mode=mode, padding=padding)
        m.loc.bias.data = torch.tensor([1.6, 0.2, 0.1, -0.1, 1.5, 0.05])
        return m

    check_parity(make, batches, lambda m, b: m(*b), threads=1)


class PerPoint(nn.Module):
    """Embeddings of points, one value each from the function under test, a regression on those values. Zeros
    where sqrt and pow have no finite gradient (torch's is zero there): distances of points to themselves, every
    third embedding zero (padding) for the similarity and the spreads."""

    def __init__(self, case: str):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.case = case

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        e = torch.tanh(self.embed(x))
        padded = e * (torch.arange(len(e))[:, None] % 3 > 0)
        kind, _, p = self.case.partition(" ")
        if kind == "pairwise":
            d = nn.functional.pairwise_distance(e, e.flip(0) * (torch.arange(len(e))[:, None] % 2), p=float(p))
        elif kind == "cdist":
            d = torch.cdist(e, torch.cat([e[:2], e.flip(0)]), p=float(p)).sum(-1)
        elif kind == "cosine":
            d = nn.functional.cosine_similarity(padded, e.flip(0))
        elif kind == "std":
            d = (padded + 1).std(1) + torch.std(padded, 1, correction=0)
        else:
            std, mean = torch.std_mean(padded, dim=1)
            d = std * mean + std
        return ((d - y) ** 2).mean()


@pytest.mark.parametrize("case, points", [("cdist 2", 6), ("cdist 2", 30), ("cdist 1", 6), ("cdist 3", 6),
                                          ("cdist inf", 6), ("pairwise 2", 6), ("pairwise 1", 6), ("pairwise 3", 6),
                                          ("cosine", 6), ("std", 6), ("std_mean", 6)])
def test_per_point_values_train_like_torch(case: str, points: int) -> None:
    """cdist (torch's product form past 25 points), pairwise_distance (torch's exporter adds eps to the exponent,
    not to the difference), cosine similarity and std: values and gradients as torch's, not NaN, at zero
    distances, zero vectors and constant rows."""
    g = torch.Generator().manual_seed(points)
    batches = [(torch.randn(points, 3, generator=g), torch.rand(points, generator=g)) for _ in range(3)]
    check_parity(lambda: PerPoint(case), batches, lambda m, b: m(*b), threads=1)


@pytest.mark.parametrize("kind", ["parametrization", "hook"])
def test_spectral_norm_trains_like_torch(kind: str) -> None:
    """Spectral norm's power iteration (its u and v buffers normalized in place, `out=`, each forward; W^T u a
    transposed matrix times a vector) follows torch's buffers and gradients step by step."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
        if kind == "parametrization":
            torch.nn.utils.parametrizations.spectral_norm(net[0])
        else:
            torch.nn.utils.spectral_norm(net[0])
        return net

    ref, om = make(), ORTModule(make())
    for step in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        got, want = om(x).square().sum(), ref(x).square().sum()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        for (name, a), b in zip(om.module.named_buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, msg=name)
        for (name, p), q in zip(om.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_scaled_by_frequency_trains_like_torch(padding_idx: int | None) -> None:
    """nn.Embedding(scale_grad_by_freq=True), which the exporter refuses in training: rows' gradients divided by
    how often each index occurs in the batch (repeated indices in every batch)."""
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 6, padding_idx=padding_idx, scale_grad_by_freq=True)
            self.head = nn.Linear(6, 3)

        def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.head(self.embed(ids)).mean(1), y)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 5, (4, 7), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(3)]
    check_parity(Tokens, batches, lambda m, b: m(*b), threads=1)


class ChangedInForward(nn.Module):
    """Parameters changed in place without grad inside forward: an embedding's max_norm renorm (a padding row, a
    head tied to the weight) and an embedding bag's, a weight clipped, one scaled (not idempotent: once a call),
    a bias normalized, a weight copied from another."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 6, padding_idx=1, max_norm=1.0)
        self.bag = nn.EmbeddingBag(20, 6, mode="mean", max_norm=0.8)
        self.fc, self.scaled, self.copied = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.3, 0.3)
            self.scaled.weight.mul_(0.9)
            self.scaled.bias.div_(self.scaled.bias.norm())
            self.copied.weight.copy_(self.fc.weight * 0.5)
        h = self.embed(ids) + self.bag(ids)[:, None]
        h = self.copied(torch.tanh(self.scaled(torch.tanh(self.fc(h)))))
        return (h @ self.embed.weight.T).logsumexp(-1).mean()


def test_parameters_changed_in_place_in_forward_train_like_torch() -> None:
    """The new values reach the parameters after each call, once, as torch's forward leaves them, and later reads
    in the forward see them; gradients are the parameters' own (torch's in-place change without grad is not on
    the gradient path). torch's max_norm renorm changes a detached alias of the weight, which the trace had read
    as dead code: the rows kept their norms, and the training drifted from torch's with a warning."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 20, (4, 5), generator=g) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        model, reference, _ = check_parity(ChangedInForward, batches, lambda m, b: m(b), optimizer=sgd, threads=1)
    torch.manual_seed(1)
    model, reference = ORTModule(ChangedInForward(), threads=1), ChangedInForward()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():  # inference calls change them too (norms summed in another order: an ulp apart)
        for ids in (torch.arange(10).reshape(2, 5), torch.arange(5, 15).reshape(5, 2)):
            torch.testing.assert_close(model(ids), reference(ids), rtol=1e-6, atol=0)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=0, msg=name)
    norms = model.embed.weight.norm(dim=1)
    assert norms[:15].max() <= 1.0 < norms[15:].max()


class RunningInstanceNorms(nn.Module):
    """Instance norms keeping running statistics (style transfer's), 2-D with affine weights and 1-D without."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm2d = nn.Conv2d(3, 6, 3), nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        self.norm1d = nn.InstanceNorm1d(6, track_running_stats=True, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1d(torch.relu(self.norm2d(self.conv(x))).flatten(2))
        return (h * torch.linspace(-1, 2, h.shape[-1])).sum(-1).pow(2).mean()  # a normalized row's mean square: 1


def test_instance_norms_with_running_statistics_train_like_torch() -> None:
    """The legacy exporter refuses instance_norm with running statistics for a run-time batch, in training and in
    evaluation: per-sample statistics, the running ones updated as torch's, then evaluation by them."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, 9, 8, generator=g) for n in (4, 2, 4)]
    model, reference, _ = check_parity(RunningInstanceNorms, batches, lambda m, b: m(b), optimizer=sgd, threads=1)
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batches[0]), reference(batches[0]))


class CountModel(nn.Module):
    """A negative binomial likelihood of counts and a Gamma one of rates (torch.distributions: lgamma), a Beta's
    entropy (digamma), each with parameters from a Linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 9)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        mu, a, b = torch.nn.functional.softplus(self.fc(x)).chunk(3, 1)
        theta = 2.0
        nb = (torch.lgamma(counts + theta) - torch.special.gammaln(counts + 1) + theta * torch.log(theta / (theta + mu))
              + counts * torch.log(mu / (theta + mu)))
        gamma = torch.distributions.Gamma(a + 0.1, b + 0.1).log_prob(rates)
        return -nb.mean() - gamma.mean() - torch.distributions.Beta(a + 0.5, b + 0.5).entropy().mean()


def test_lgamma_and_digamma_train_like_torch() -> None:
    """lgamma and digamma (no ONNX op) as series: count likelihoods and distributions' log-probabilities and
    entropies train as torch's."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 30, (8, 3), generator=g).float(),
                torch.rand(8, 3, generator=g) * 3 + 0.05) for _ in range(3)]
    check_parity(CountModel, batches, lambda m, b: m(*b), threads=1)


class Shuffled(nn.Module):
    """Mixup inside the forward: the batch mixed with itself shuffled (randperm) and with rows drawn (randint within
    the batch, a size the trace reads); the draws returned, so that torch's computation can be replayed on them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        perm = torch.randperm(x.shape[0])
        rows = torch.randint(0, x.shape[0], (x.shape[0],))
        return self.mixed(x, perm, rows), perm, rows

    def mixed(self, x: torch.Tensor, perm: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return 0.7 * h + 0.2 * h[perm] + 0.1 * h[rows]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_batch_shuffled_by_randperm_and_randint_trains(exporter: str) -> None:
    """Neither exporter has randperm, and the legacy one takes randint's bounds as constants only: a permutation
    (the order of uniforms) and indices drawn below a size read from the input, one export for every batch size,
    the module's outputs and gradients torch's for the draws made."""
    torch.manual_seed(0)
    reference = Shuffled()
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    for rows in (8, 5, 8):
        x = torch.randn(rows, 6)
        out, perm, drawn = model(x)
        assert sorted(perm.tolist()) == list(range(rows)) and drawn.dtype == perm.dtype == torch.int64
        assert int(drawn.min()) >= 0 and int(drawn.max()) < rows
        want = reference.mixed(x, perm, drawn)
        torch.testing.assert_close(out, want)
        weights = torch.randn(want.shape)
        got = torch.autograd.grad((out * weights).sum(), list(model.parameters()))
        for g, w in zip(got, torch.autograd.grad((want * weights).sum(), list(reference.parameters())), strict=True):
            torch.testing.assert_close(g, w)
    assert model.stats["exports"] == 1, model.stats


class Gammas(nn.Module):
    def __init__(self, points: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(points.clone())

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.lgamma(self.x), torch.digamma(self.x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lgamma_and_digamma_are_torch_s_to_rounding(dtype: torch.dtype) -> None:
    """Values and lgamma's gradient through onnxruntime across poles, reflections and the series' range, against
    torch's (digamma's gradient is not compared: torch's trigamma is 1e-10 off the exact one, ours 1e-16). Before:
    the series stopped at the 8th power (3.5e-12 in float64) and float32 computed the reflections in float32
    (digamma near -3 1.5e-3 off, torch's 8e-7)."""
    points = torch.cat([torch.linspace(-3.3, 10, 997, dtype=torch.float64), torch.linspace(10, 60, 101,
                        dtype=torch.float64), torch.tensor([-3.0001, -2.9999, -1.0000751, -0.4999, 0.49999, 1e-3,
                                                            -1e-3, 7.9999, 8.0, 8.0001], dtype=torch.float64)])
    points = points.to(dtype)
    ours = ORTModule(Gammas(points))
    values = ours()
    (grad,) = torch.autograd.grad(values[0].sum(), ours.x)
    x = points.double()
    # float32: the values as float64 ones rounded (torch's own digamma is 8e-7 off); float64 digamma: torch's own
    # is 1e-12 off near poles (ours 1e-16 of the exact one there)
    lgamma_bound, digamma_bound = (1e-13, 5e-13) if dtype == torch.float64 else (1e-7, 1e-7)

    def off(got: torch.Tensor, want: torch.Tensor) -> float:
        return float(((got.double() - want) / want.abs().clamp(min=1)).abs().max())

    assert off(values[0], torch.lgamma(x)) < lgamma_bound
    assert off(values[1], torch.digamma(x)) < digamma_bound
    assert off(grad, torch.digamma(x)) < digamma_bound


class Attention(nn.Module):
    """scaled_dot_product_attention over projected queries and keys, with a boolean or float mask or causal."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.proj, self.options = nn.Linear(8, 8), options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.proj(q), self.proj(k), v, mask, **self.options)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", ["bool mask", "float mask", "causal", "padded encoder layer"])
def test_float64_attention_trains_like_torch(case: str, exporter: str) -> None:
    """The legacy exporter translates scaled_dot_product_attention for float32, float16 and bfloat16 only: float64
    attention is written out, a mask's empty rows (a boolean mask's, a float mask's -inf row, an encoder layer's
    fully padded sequence, need_weights=False) giving zeros and no gradient as torch's do (a float mask's gave NaN)."""
    g = torch.Generator().manual_seed(0)
    if case == "padded encoder layer":
        pad = torch.zeros(3, 6, dtype=torch.bool)
        pad[1, 4:] = True
        pad[2] = True  # a sequence of padding only: every query of it attends to nothing
        make = lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()  # noqa: E731
        batches = [(torch.randn(3, 6, 8, generator=g, dtype=torch.float64), pad) for _ in range(2)]
        check_parity(make, batches, lambda m, b: m(b[0], src_key_padding_mask=b[1]).square().sum(), rtol=1e-9,
                     exporter=exporter)
        return
    mask = {"bool mask": torch.rand(2, 1, 4, 5, generator=g) > 0.3, "float mask": torch.randn(4, 5, generator=g,
                                                                                            dtype=torch.float64),
            "causal": None}[case]
    if case == "bool mask":
        mask[0, 0, 1] = False  # a query that may attend to nothing
    if case == "float mask":
        mask[2] = -math.inf
        mask[0, 1:3] = -math.inf
    options = {"is_causal": True, "scale": 0.3} if case == "causal" else {}
    batches = [tuple(torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (4, 5, 5))
               for _ in range(2)]
    check_parity(lambda: Attention(**options).double(), batches, lambda m, b: m(*b, mask).square().sum(), rtol=1e-9,
                 exporter=exporter)


@pytest.mark.parametrize("layer", ["adaptive", "area"])
def test_a_pooled_map_of_two_sizes_returned_trains_like_torch(layer: str) -> None:
    """The legacy exporter declared an adaptive average pool to 8 x 10 (and area interpolation, which is one) with
    one dimension name for both axes: returned as the module's output, the backward was built on that shape and
    the first run refused it. Names that the traced call's outputs show to stand for two sizes are cleared."""
    def make() -> nn.Module:
        pool = nn.AdaptiveAvgPool2d((8, 10)) if layer == "adaptive" else nn.Upsample(scale_factor=1.7, mode="area")
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), pool)

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 3, 5, 6, generator=g) for _ in range(2)]
    weights = torch.randn(2, 4, 8, 10, generator=g)
    check_parity(make, batches, lambda m, b: (m(b) * weights).sum())


def test_atan2_is_torch_s_in_every_quadrant_and_on_the_axes() -> None:
    """The legacy exporter writes atan2 as atan(y / x) with quadrant corrections, nan where x = 0 and y = 0 (torch:
    0, so the first call's check refused the module). Values and gradients in the four quadrants, on both axes (the
    negative x axis from above, +0, and from below, -0: pi and -pi, where ours took pi for both) and at the origin
    (torch's zero gradients), as torch's."""
    class Angle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor([1.0, 1.5]))

        def forward(self, p: torch.Tensor) -> torch.Tensor:
            q = p * self.scale
            return torch.atan2(q[:, 1], q[:, 0]) + q[:, 1].arctan2(q[:, 0] - 1)

    g = torch.Generator().manual_seed(0)
    p = torch.cat([torch.randn(16, 2, generator=g),
                   torch.tensor([[0.0, 2.0], [0.0, -3.0], [4.0, 0.0], [-4.0, 0.0], [-4.0, -0.0], [0.0, 0.0],
                                 [1.0, 0.0]])])
    p.requires_grad_()
    ref, om = Angle(), ORTModule(Angle())
    for _ in range(2):
        got, want = om(p), ref(p)
        torch.testing.assert_close(got, want)
        (gp,) = torch.autograd.grad(got.sum(), p)
        (wp,) = torch.autograd.grad(want.sum(), p)
        torch.testing.assert_close(gp, wp)


def test_expm1_and_addcdiv_train_like_torch() -> None:
    """The legacy exporter has neither: expm1 is written as tanh(x / 2) (exp(x) + 1), exact near 0 where
    exp(x) - 1 cancels (1e-6 stays 1e-6 to float32 rounding), and addcdiv as its formula."""
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return torch.expm1(h * 1e-3) * 1e3 + h.addcdiv(h, h.abs() + 1, value=0.5) + torch.expm1(h).sum()

    g = torch.Generator().manual_seed(0)
    check_parity(Small, [torch.randn(5, 4, generator=g) for _ in range(2)], lambda m, b: m(b).square().sum())
    tiny = torch.tensor([1e-6, -3e-7, 0.0, 2.5, -20.0])
    with functions.exportable_functions():
        torch.testing.assert_close(torch.expm1(tiny), tiny.double().expm1().float(), rtol=2e-7, atol=0)


class Projected(nn.Module):
    """A float64 Linear 6 -> 6, then `body`'s tensors, flattened and joined."""

    def __init__(self, body: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
        super().__init__()
        self.proj, self.body = nn.Linear(6, 6, dtype=torch.float64), body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.flatten() for p in self.body(self.proj(x))])


def _trains_under_the_legacy_exporter(make: Callable[[], nn.Module], rows: int) -> None:
    """Two Adam steps of `make()` in float64 on [rows, 6] batches, through ORTModule and torch (`check_parity`),
    the loss a weighted sum of every output element; no ExportWarning: the module keeps the legacy exporter."""
    def weighted(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = m(batch)
        return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()

    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        check_parity(make, [torch.randn(rows, 6, generator=g, dtype=torch.float64) for _ in range(2)], weighted,
                     rtol=1e-10)


def test_functions_the_legacy_exporter_lacks_train_like_torch_under_it() -> None:
    """The legacy exporter has none of them: written out (sinc with torch's value 1 and derivative 0 at 0, as
    SincNet's filters meet it at their centre tap; diff with prepend and append, twice; kthvalue as TopK's k-th
    smallest, its gradient to that element; nansum and nanmean with no gradient to the NaNs; count_nonzero;
    trace; histc, no gradient, as Mixtral's load-balancing loss counts its routed tokens; copysign; searchsorted,
    as NeRF places its samples), so the module keeps the legacy exporter (no warning of a switch to dynamo, which
    would refuse a module with stop-gradients)."""
    class Filters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low = nn.Parameter(torch.linspace(0.05, 0.2, 4, dtype=torch.float64)[:, None])
            self.proj = nn.Linear(6, 6, dtype=torch.float64)
            self.register_buffer("taps", torch.arange(-3, 4, dtype=torch.float64)[None])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            band = torch.sinc(2 * self.low * self.taps) * self.low
            h = self.proj(x)
            steps = torch.diff(h, n=2, dim=1, prepend=h[:, :1], append=h[:, -1:] * 2)
            kth = torch.kthvalue(h, 2, dim=1, keepdim=True).values + h.kthvalue(3, 0).values
            holes = torch.where(h > 0.5, torch.nan, h)  # NaN where the loss is to skip an element
            nan = torch.stack([torch.nansum(holes), holes.nansum(1).sum(), torch.nanmean(holes, 0).sum(),
                               torch.trace(h[:, :5]), torch.trace(h[:4])])
            counted = h[0] * torch.count_nonzero(h > 0, 0)
            # a load-balancing loss's counts of routed tokens (integers, bins of one each), and of values in a range
            # (edges inside the data, values past both ends) and the data's own
            routed = h.argmax(1).double().histc(6, 0, 6) * h.softmax(1).mean(0)
            binned = torch.cat([torch.histc(h, 4, -0.5, 0.5), h.histc(3)]) * h[1, :1]
            # |h| with signs of its rows reversed (a -0.0 in it), and of a number; samples placed by searchsorted
            # (NeRF's hierarchical sampling: bins from sorted values, uniforms placed in them, gathered)
            signs = torch.copysign(h, h.flip(1) * (h.flip(1) > -0.2)) + h.copysign(-2.0)
            cdf = h.detach().sigmoid().sort(1).values
            drawn = torch.linspace(0.1, 0.9, 4, dtype=h.dtype).expand(h.shape[0], 4)
            below = torch.searchsorted(cdf, drawn, right=True).clamp(max=5)
            placed = h.gather(1, below) * (1 + torch.searchsorted(cdf[0], drawn[0], side="left"))
            return torch.cat([band.flatten(), h.diff(dim=1).flatten(), steps.flatten(), kth.flatten(), nan,
                              counted, routed, binned, signs.flatten(), placed.flatten()])

    _trains_under_the_legacy_exporter(Filters, rows=5)
    zero = torch.tensor([0.0, 0.5, -1.25], dtype=torch.float64, requires_grad=True)
    with functions.exportable_functions():
        mine = torch.sinc(zero)
    (got,) = torch.autograd.grad(mine.sum(), zero)
    (want,) = torch.autograd.grad(torch.sinc(zero).sum(), zero)
    torch.testing.assert_close(mine, torch.sinc(zero), rtol=0, atol=1e-15)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_shape_functions_the_legacy_exporter_lacks_train_like_torch_under_it() -> None:
    """x.mT, x.mH and adjoint() (real), tile (varargs, a tuple, fewer dims than the input: written as repeat, where
    the exporter's If stopped the gradient build), take_along_dim (broadcast, and over the flattened input), fliplr
    and flipud: the module keeps the legacy exporter."""
    def shapes(h: torch.Tensor) -> list[torch.Tensor]:
        h = h.view(-1, 2, 3)
        order = h.detach().argsort(-1)
        return [h.mT @ h, h.mH, h.adjoint(), h.tile(2, 1), torch.tile(h, (2,)), h[0].tile((1, 2, 1)),
                h.take_along_dim(order, -1), torch.take_along_dim(h, order[:1], 2),
                torch.take_along_dim(h, order.flatten()[:4]), torch.fliplr(h[0]), torch.flipud(h[1])]

    _trains_under_the_legacy_exporter(lambda: Projected(shapes), rows=4)


def test_cov_and_corrcoef_train_like_torch_under_the_legacy_exporter() -> None:
    """torch.cov (rows are variables; one variable gives a 0-d variance; correction 0 and 1) and corrcoef,
    which the legacy exporter lacks, as a VICReg-style loss uses them, in float64."""
    def redundancy(z: torch.Tensor) -> list[torch.Tensor]:
        off = torch.cov(z.T) * (1 - torch.eye(6, dtype=z.dtype))
        return [off, z.T.cov(correction=0).diagonal(), torch.cov(z[0]), torch.corrcoef(z)]

    _trains_under_the_legacy_exporter(lambda: Projected(redundancy), rows=5)


def test_diagonals_train_like_torch_under_the_legacy_exporter() -> None:
    """torch.diagonal (offsets on both sides and past the matrix, batched axes in any order) and torch.diag: the
    legacy exporter writes diagonal with an If that stopped the gradient build (a CLIP loss's positives, VICReg's
    variances), and has no diag."""
    def diagonals(h: torch.Tensor) -> list[torch.Tensor]:
        logits = h @ h.flip(0).T
        cube = h.view(-1, 2, 3)
        return [logits.diagonal(), torch.diagonal(h, 2), h.diagonal(-1), h.diagonal(9),
                cube.diagonal(dim1=-2, dim2=-1), torch.diagonal(cube, 1, 2, 0), torch.diag(logits),
                torch.diag(h[0]).sum(0), h.T.diag(-2)]

    _trains_under_the_legacy_exporter(lambda: Projected(diagonals), rows=4)


def test_as_strided_reads_memory_like_torch_under_the_legacy_exporter() -> None:
    """as_strided reads memory: of a transposed view (Longformer's overlapping chunks of a transposed projection,
    whose local attention the exporter's Gather made 1% off), of a contiguous slice at an offset counted from the
    storage's start, torch.as_strided of a slice from its own start (the exporter's own form), and an empty read
    (at an offset past the input: nothing read). Reads of memory outside the input (before a slice) or between its
    elements (a slice with gaps), which torch passes no gradient to, are refused by name."""
    def strided(h: torch.Tensor) -> list[torch.Tensor]:
        flat = h.flatten()
        return [h.T.as_strided((5, 2, 4), (1, 1, 6)), flat[5:].as_strided((3, 4), (4, 1), 7),
                torch.as_strided(h[1:], (2, 3), (1, 2)), h.T.as_strided((0, 3), (1, 1), 30)]  # reads nothing

    _trains_under_the_legacy_exporter(lambda: Projected(strided), rows=4)
    before_it, between = (lambda h: h.flatten()[5:].as_strided((2, 2), (1, 3), 2),
                          lambda h: h[:, 1::2].as_strided((2,), (3,)))
    for outside in (before_it, between):
        with functions.exportable_functions(), pytest.raises(RuntimeError, match="outside or between its elements"):
            torch.jit.trace(outside, (torch.zeros(4, 6),))


def _as_torch(make: Callable[[], nn.Module], inputs: Sequence[torch.Tensor], exporter: str = "torchscript",
              **tolerance: float) -> ORTModule:
    """Each input through one ORTModule of `make()` and through a copy in torch: outputs, and the parameters'
    gradients of a weighted sum of them, as torch's (NaN where torch's are, nowhere else; a gradient's absolute
    tolerance scaled by its largest element); then no ExportWarning (the module kept its exporter, and no
    traced value was baked in). Returns the ORTModule."""
    ref = make()
    om = ORTModule(copy.deepcopy(ref), exporter=exporter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        for x in inputs:
            got, want = om(x), ref(x)
            torch.testing.assert_close(got, want, **tolerance)
            weights = torch.linspace(-1, 1, want.numel(), dtype=want.dtype).view(want.shape)
            got_grads = torch.autograd.grad((got * weights).sum(), list(om.parameters()))
            want_grads = torch.autograd.grad((want * weights).sum(), list(ref.parameters()))
            for name, a, b in zip([n for n, _ in ref.named_parameters()], got_grads, want_grads):
                # a sum of many terms near 0 (a bias's) is rounding noise of the largest terms' size
                atol = tolerance["atol"] * max(1.0, float(b.abs().max()))
                torch.testing.assert_close(a, b, rtol=tolerance["rtol"], atol=atol,
                                           msg=lambda m, name=name: f"{name}: {m}")
    assert not [w for w in caught if issubclass(w.category, ExportWarning)], [str(w.message) for w in caught]
    return om


TOLERANCE = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}


class Norms(nn.Module):
    """Norms of w * x whose orders the exporter wrote as a power of a sum (torch.linalg.vector_norm, torch.norm and
    Tensor.norm of 3, 0.5, 1.5 and 4, and torch.linalg.norm of a row), the Frobenius norm (matrix_norm), torch.dist
    with p = 3, and as controls the orders the exporter reduces itself (2, 1, inf)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 12, dtype=dtype).view(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w * x
        return torch.cat([
            torch.linalg.vector_norm(h, 3, dim=1), torch.linalg.vector_norm(h, 0.5, dim=-1, keepdim=True).flatten(),
            h.norm(p=1.5, dim=1), torch.norm(h, 4, dim=(0, 1)).reshape(1), torch.linalg.norm(h, 3, dim=1),
            torch.linalg.matrix_norm(h[:2]).reshape(1), torch.linalg.matrix_norm(h[:2], keepdim=True).flatten(),
            torch.dist(h[0], h[1], p=3).reshape(1), h[1].dist(h[2] * 0, 0.5).reshape(1),
            torch.linalg.vector_norm(h, 2, dim=1), h.norm(p=1, dim=1), torch.linalg.vector_norm(h, math.inf, dim=1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_have_torch_s_zero_gradient_at_zero(dtype: torch.dtype) -> None:
    """torch's norm backward is 0 where the norm is 0 (and, below order 1, at a zero element): an all-zero row under
    orders 3, 0.5, 1.5 and 4, an all-zero matrix under the Frobenius norm, torch.dist at zero distance, and a zero
    element of a non-zero row under order 0.5 got NaN gradients (which poison the parameter at the next step)."""
    g = torch.Generator().manual_seed(0)
    zeros = torch.randn(3, 4, generator=g, dtype=dtype)
    zeros[:2] = 0  # rows 0 and 1 zero: their norms, their matrix's, and their distance
    zeros[2, 1] = 0
    _as_torch(lambda: Norms(dtype), [zeros, torch.randn(3, 4, generator=g, dtype=dtype), zeros * 2],
              **TOLERANCE[dtype])


class Clipped(nn.Module):
    """w * x through relu6, nn.ReLU6, nn.Hardtanh, hardtanh(-0.5, 2), and the in-place forms (read again after),
    with clamp(-1, 1), whose gradient passes at its bounds, as a control."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, dtype=dtype))
        self.relu6, self.hardtanh, self.in_place = nn.ReLU6(), nn.Hardtanh(), nn.ReLU6(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w * x
        copied = h * 1.0
        self.in_place(copied)
        again = h * 1.0
        F.hardtanh(again, -0.5, 2.0, inplace=True)
        return torch.cat([F.relu6(h), self.relu6(h), self.hardtanh(h), F.hardtanh(h, -0.5, 2.0), copied * 2, again,
                          h.clamp(-1, 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hardtanh_and_relu6_pass_no_gradient_at_their_bounds(dtype: torch.dtype) -> None:
    """torch's hardtanh (relu6, nn.ReLU6, nn.Hardtanh) backward compares strictly: 0 at x = min or max, where the
    exported Clip's rule (clamp's, inclusive) passed the gradient. Values unchanged; clamp keeps its own rule."""
    bounds = torch.tensor([0.0, 6.0, -1.0, 1.0, -0.5, 2.0, 3.0, -7.0], dtype=dtype)
    inside = torch.tensor([0.25, 5.5, -0.75, 0.5, 1.5, -0.25, 7.0, 0.0], dtype=dtype)
    _as_torch(lambda: Clipped(dtype), [bounds, inside, bounds.flip(0)], **TOLERANCE[dtype])


def test_diagonal_is_a_view_as_torch_s() -> None:
    """The patched diagonal is a view of its input where the two axes flatten without a copy, as torch's is (a
    copy there, at offsets other than 0, lost `u.diagonal(1).copy_(v)` in torch's run as in the export, which the
    first call's check compared with): the same elements, and writes through it reach the input."""
    g = torch.Generator().manual_seed(0)
    for shape, offset, dims in [((4, 5), 1, (0, 1)), ((4, 5), -2, (0, 1)), ((5, 3), 2, (0, 1)), ((3, 4), 7, (0, 1)),
                                ((4, 4), -5, (0, 1)), ((2, 4, 5), -1, (1, 2)), ((2, 3, 4), 1, (-2, -1))]:
        x = torch.randn(shape, generator=g)
        want, written = x.clone(), x.clone()
        torch.diagonal(want, offset, *dims).mul_(3)
        with functions.exportable_functions():
            view = torch.diagonal(written, offset, *dims)
            torch.testing.assert_close(view, torch.diagonal(x, offset, *dims), rtol=0, atol=0)
            view.mul_(3)
        torch.testing.assert_close(written, want, rtol=0, atol=0, msg=f"{shape}, offset {offset}, dims {dims}")


class WrittenDiagonal(nn.Module):
    def __init__(self, offset: int, transposed: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 5))
        self.offset, self.transposed = offset, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.w * x
        u = t * 1.0
        diagonal = (u.T if self.transposed else u).diagonal(self.offset)
        diagonal.copy_(t[0, :diagonal.shape[0]] * 3)
        return u


@pytest.mark.parametrize("offset, transposed", [(1, False), (-1, False), (0, False), (1, True)])
def test_writes_through_a_diagonal_are_torch_s_or_refused(offset: int, transposed: bool) -> None:
    """`u.diagonal(offset).copy_(v)`: onnxruntime's output is torch's, or the module is refused (the export's first
    check, or a write into a diagonal the export had to copy), never silently u unchanged."""
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    want = WrittenDiagonal(offset, transposed)(x)
    try:
        got = ORTModule(WrittenDiagonal(offset, transposed))(x)
    except ORTModuleError as e:
        assert "export" in str(e)
        return
    torch.testing.assert_close(got, want)


class Antialiased(nn.Module):
    """Each pixel scaled and shifted by its own parameters (a conv has no float64 kernel in onnxruntime), then
    F.interpolate with antialias by a scale factor (the legacy exporter has no antialiasing; dynamo's Resize took
    the output size, so sampled by in / out)."""

    def __init__(self, mode: str, factor: float | tuple[float, float], dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 2 * 20 * 13, dtype=dtype).view(2, 20, 13))
        self.shift = nn.Parameter(torch.linspace(-1, 1, 2 * 20 * 13, dtype=dtype).view(2, 20, 13).cos())
        self.mode, self.factor = mode, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2:]
        h = x * self.scale[:, :height, :width] + self.shift[:, :height, :width]
        return F.interpolate(h, scale_factor=self.factor, mode=self.mode, antialias=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode, factor", [("bilinear", 0.5), ("bicubic", 0.5), ("bilinear", 1.5),
                                          ("bicubic", (0.3, 0.75))])
def test_antialiased_interpolation_by_a_factor_follows_every_size(mode: str, factor: float | tuple[float, float],
                                                                   dtype: torch.dtype) -> None:
    """torch samples by the given factor (not by in / out) and sizes the output floor(size * factor): from one
    export, a first call at a square size that is a multiple of the factor, then sizes that are not (7 x 0.5 -> 3),
    values and gradients as torch's, float64 too (onnxruntime has no float64 Resize). (torch's own kernel repeats
    the first row where the resampled width is 1: no such size here.)"""
    g = torch.Generator().manual_seed(0)
    sizes = [(8, 8), (7, 5), (9, 13), (4, 9), (20, 6)]  # square first: one export for both axes' sizes
    _as_torch(lambda: Antialiased(mode, factor, dtype),
              [torch.randn(2, 2, h, w, generator=g, dtype=dtype) for h, w in sizes], **TOLERANCE[dtype])


class Distances(nn.Module):
    """torch.cdist (p = 2) of projected rows: n rows to every other one, and 4 rows to all n, so that one side or
    both pass torch's 25 rows of its product form, or neither."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        other = h.flip(-1) + 0.25  # no zero distances: the product form's value there is its rounding's
        return torch.cat([torch.cdist(h, other[::2]).flatten(), torch.cdist(h[:4], other).flatten(),
                          torch.cdist(h[None], other[None, 1::3], compute_mode="use_mm_for_euclid_dist").flatten(),
                          torch.cdist(h, h[:3], p=3).flatten()])


def test_cdist_follows_the_row_count_from_one_export() -> None:
    """torch's cdist takes its product form past 25 rows on either side: the export chooses by the run-time row
    counts (no Python comparison of traced sizes, which warned of a baked value and exported again at every size
    across 25), torch's values and gradients on either side of it from one export."""
    g = torch.Generator().manual_seed(0)
    rows = [5, 30, 7, 26, 25, 52, 9]
    om = _as_torch(Distances, [torch.randn(n, 6, generator=g, dtype=torch.float64) for n in rows],
                   **TOLERANCE[torch.float64])
    assert om.stats["exports"] == 1, om.stats


class GroupedAttention(nn.Module):
    """Causal attention with 4 query heads over 2 key/value heads (`enable_gqa`), on [batch, time, 8] inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([8, 4, 4], -1)
        q = q.view(b, t, 4, 2).transpose(1, 2)
        k, v = (z.view(b, t, 2, 2).transpose(1, 2) for z in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_grouped_query_attention_follows_every_length_from_one_export() -> None:
    """The head counts (the weights') decide the repetition of key and value heads without a traced comparison:
    no baked-value warning, one export for every batch and sequence length, torch's values and gradients."""
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 5), (2, 7), (3, 9), (1, 4)]
    om = _as_torch(GroupedAttention, [torch.randn(b, t, 8, generator=g) for b, t in shapes],
                   **TOLERANCE[torch.float32])
    assert om.stats["exports"] == 1, om.stats


class Unbatched(nn.Module):
    """Pools (max with and without indices, put back by max_unpool; average, by a divisor too, ceil mode; lp),
    F.unfold and pixel (un)shuffling of one unbatched map: (C, H, W), or (C, H * W) for the 1-d ones; and pixel
    shuffling with two batch axes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 4).view(4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h2 = x * self.w
        h1 = h2.flatten(1)
        v1, i1 = F.max_pool1d(h1, 2, return_indices=True)
        v2, i2 = nn.MaxPool2d(2, return_indices=True)(h2)
        outs = [nn.MaxPool1d(3, 2, 1)(h1), v1, F.max_unpool1d(v1, i1, 2), F.avg_pool1d(h1, 3, 2, 1),
                nn.AvgPool1d(2, ceil_mode=True)(h1), F.lp_pool1d(h1, 2, 2), F.max_pool2d(h2, 3, 2, 1), v2,
                F.max_unpool2d(v2, i2, 2), F.avg_pool2d(h2, 2), nn.AvgPool2d(3, 2, 1, ceil_mode=True)(h2),
                F.avg_pool2d(h2, 3, 2, 1, divisor_override=2), F.lp_pool2d(h2, 2, 2), F.unfold(h2, 2),
                nn.Unfold(3, padding=1, stride=2)(h2), F.pixel_shuffle(h2, 2), nn.PixelUnshuffle(2)(h2),
                F.pixel_shuffle(torch.stack([h2, h2.flip(0)])[None], 2)]  # two batch axes
        return torch.cat([o.flatten() for o in outs])


def test_unbatched_pools_unfold_and_pixel_shuffle_train_like_torch() -> None:
    """torch takes them on unbatched inputs; the legacy exporter wrote ONNX pools and im2col's Pad on them, which
    ONNX does not allow (the gradient build failed), and refused pixel_shuffle: each with a batch axis of 1 around
    it, torch's values (indices too, through max_unpool) and gradients, from one export for other sizes."""
    g = torch.Generator().manual_seed(0)
    om = _as_torch(Unbatched, [torch.randn(4, h, w, generator=g) for h, w in ((6, 6), (8, 10))],
                   **TOLERANCE[torch.float32])
    assert om.stats["exports"] == 1, om.stats


class DividedCeilPool(nn.Module):
    """Average pooling by a divisor in ceil mode, padded: torch's last windows overhang the padded input by an
    amount that depends on the size."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2).view(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x * self.w, 3, 2, 1, ceil_mode=True, divisor_override=4)


def test_divided_ceil_mode_pool_follows_every_size_from_one_export() -> None:
    """The ceil-mode overhang is computed in the graph from the run-time sizes (it was read as a Python int: a
    baked-value warning and an export per size), torch's values and gradients at each."""
    g = torch.Generator().manual_seed(0)
    sizes = [(6, 6), (7, 8), (9, 5), (10, 11)]
    om = _as_torch(DividedCeilPool, [torch.randn(3, 2, h, w, generator=g) for h, w in sizes],
                   **TOLERANCE[torch.float32])
    assert om.stats["exports"] == 1, om.stats


class DilatedSame(nn.Module):
    """A convolution padded "same" with a dilation (WaveNet's, TCN's), its total padding odd on some axes (an even
    kernel, or an even dilation), which torch puts the extra of after, and a scale before it."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.conv = conv(2, 3, (4, 3, 2)[:dims], padding="same", dilation=(3, 2, 1)[:dims])
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2).view(2, *[1] * dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x * self.w)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_dilated_same_padding_convolutions_train_like_torch(dims: int) -> None:
    """The exporter wrote padding="same" as auto_pad with dilations, which onnxruntime refused at the first run
    ("Dilation not supported for AutoPadType::SAME_UPPER"): torch's pads instead, its values and gradients at
    every size from one export."""
    g = torch.Generator().manual_seed(dims)
    sizes = [(7, 9, 5), (8, 6, 4)]
    om = _as_torch(lambda: DilatedSame(dims), [torch.randn(2, 2, *size[:dims], generator=g) for size in sizes],
                   **TOLERANCE[torch.float32])
    assert om.stats["exports"] == 1, om.stats


class DoubleConvs(nn.Module):
    """float64 convolutions of every kind the layer has: strided, dilated, grouped, padded by numbers, "same" (with a
    dilation and an even kernel: the odd pad after) and "valid", reflected, with and without bias."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.layers = nn.Sequential(
            conv(2, 4, 3, stride=2, padding=1, bias=False),
            conv(4, 4, (2, 3, 2)[:dims], padding="same", dilation=(2, 1, 2)[:dims], groups=2),
            conv(4, 6, (3, 1, 2)[:dims], padding="valid", groups=2, padding_mode="zeros"),
            conv(6, 3, 3, padding=1, padding_mode="reflect"),
        ).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DoubleTransposedConvs(nn.Module):
    """float64 transposed convolutions: strided with an output padding, grouped and dilated, padded past the kernel's
    reach (a crop), without bias."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dims]
        self.layers = nn.Sequential(
            conv(2, 4, 3, stride=2, padding=1, output_padding=1, bias=False),
            conv(4, 4, (2, 3, 2)[:dims], stride=(1, 2, 1)[:dims], dilation=(2, 1, 2)[:dims], groups=2),
            conv(4, 3, 3, padding=3),
        ).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DoubleNearest(nn.Module):
    """float64 nearest interpolation by a whole factor, a fractional one up and down, and to a given size."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float64).view(2, *[1] * dims))
        self.size = (7, 5, 3)[:dims]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        return torch.cat([F.interpolate(h, scale_factor=2.0, mode="nearest").flatten(1),
                          F.interpolate(h, scale_factor=1.5, mode="nearest").flatten(1),
                          F.interpolate(h, scale_factor=0.7, mode="nearest").flatten(1),
                          F.interpolate(h, size=self.size, mode="nearest").flatten(1)], 1)


class DoubleAveragePools(nn.Module):
    """float64 average pools: padded with and without counting the padding, ceil mode (a last window over the edge),
    a divisor override (not in 1-D), overlapping strides, global average pooling, and windows as long as the padded
    axis or longer (in ceil mode: HF EfficientNet pools a 1x1 map by 1280; not in 3-D, which torch refuses), on every
    axis or the first."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        def pool(*args: Any, **kwargs: Any) -> torch.Tensor:  # looked up at the call, as nn.AvgPool1d does
            return getattr(F, f"avg_pool{dims}d")(*args, **kwargs)

        overridden = [] if dims == 1 else [lambda x: pool(x, 3, 2, 0, ceil_mode=False, divisor_override=4)]
        self.pools = [lambda x: pool(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
                      lambda x: pool(x, 2, 1, 1, ceil_mode=True, count_include_pad=True), *overridden,
                      lambda x: pool(x, 2), getattr(nn, f"AdaptiveAvgPool{dims}d")(1)]
        if dims < 3:  # torch's 3-d pool refuses windows past the input
            self.pools += [lambda x: pool(x, 12, ceil_mode=True), lambda x: pool(x, 16, 16, 2, ceil_mode=True),
                           lambda x: pool(x, [16, *[3] * (dims - 1)], [16, *[2] * (dims - 1)],
                                          [2, *[1] * (dims - 1)], ceil_mode=True, count_include_pad=False)]
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float64).view(2, *[1] * dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([pool(x * self.w).flatten(1) for pool in self.pools], 1)


FLOAT64_LAYERS: dict[str, tuple[Callable[[int], nn.Module], list[tuple[int, ...]]]] = {
    "convolutions": (DoubleConvs, [(9, 8, 7), (12, 7, 8)]),
    "transposed convolutions": (DoubleTransposedConvs, [(5, 4, 3), (6, 3, 4)]),
    "average pools": (DoubleAveragePools, [(9, 8, 7), (10, 7, 6)]),
    "nearest interpolation": (DoubleNearest, [(5, 4, 3), (6, 5, 4)]),
}
"""Layers onnxruntime has no double kernel of, and the input sizes they are called at."""



def test_a_float64_pool_over_a_whole_map_is_its_sum(tmp_path: Any) -> None:
    """HF EfficientNet's pooler, AvgPool2d(1280, ceil_mode=True) over a 1x1 map: one window over the whole map,
    which the float64 pool wrote framed by kernel - 1 zeros a side and summed by a slice a tap (1280 x 1280: its
    export ran out of memory). Now a sum over the map: a 40 x 40 window over 3x3 and 4x5 maps, one export, as
    torch's, and no slice a tap."""
    class Pooler(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 3, 1, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(self.conv(x), 40, ceil_mode=True).flatten(1)

    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 2, *size, generator=g, dtype=torch.float64) for size in ((3, 3), (4, 5))]
    check_parity(Pooler, batches, lambda m, x: (m(x) * torch.arange(1.0, 4.0, dtype=x.dtype)).sum(), sgd,
                 rtol=1e-12, exporter="torchscript", save_onnx=tmp_path)
    exported = onnx.load(next(tmp_path.rglob("exported.onnx")))
    assert sum(n.op_type == "Slice" for n in exported.graph.node) < 20  # sizes read, the conv's one tap (6,564 before)

@pytest.mark.parametrize(("layer", "dims", "exporter"), [
    *((layer, dims, "torchscript") for layer in FLOAT64_LAYERS for dims in (1, 2, 3)), ("convolutions", 1, "dynamo")])
def test_float64_layers_train_like_torch(layer: str, dims: int, exporter: str) -> None:
    """onnxruntime has no double Conv, ConvTranspose, AveragePool, GlobalAveragePool or Resize: a float64 CNN,
    decoder or U-Net was refused at its session's load. Written out (products over a kernel's taps, the adjoint
    convolution of the zero-stuffed input, window sums over torch's divisors, gathers at torch's source indices),
    their values and gradients are torch's to float64's tolerance, at two sizes from one export."""
    make, sizes = FLOAT64_LAYERS[layer]
    g = torch.Generator().manual_seed(dims)
    om = _as_torch(lambda: make(dims), [torch.randn(2, 2, *size[:dims], generator=g, dtype=torch.float64)
                                        for size in sizes], exporter, **TOLERANCE[torch.float64])
    assert om.stats["exports"] == 1 and om.stats["fallbacks"] == 0, om.stats

class Nearest(nn.Module):
    """nearest and nearest-exact interpolation by factors whose source indices onnxruntime's Resize rounds to the
    other side of a whole number (1.7, 2.3, 0.6 at 12 or 19 rows), to a given size, by 2 (kept a Resize in float32),
    and in 2-d by 2.01 and 1.05, where torch's 2-d nearest kernel copies (out = n) or halves (out = 2 n)
    whatever the factor."""

    def __init__(self, dims: int, dtype: torch.dtype, modes: Sequence[str] = ("nearest", "nearest-exact")) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=dtype).view(2, *[1] * dims))
        self.size = (7, 5, 3)[:dims]
        self.factors = [1.7, 2.3, 0.6, 2.0, *([2.01, 1.05] if dims == 2 else [])]
        self.modes = modes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        return torch.cat([F.interpolate(h, scale_factor=f, mode=mode).flatten(1) for f in self.factors
                          for mode in self.modes] +
                         [F.interpolate(h, size=self.size, mode=mode).flatten(1) for mode in self.modes], 1)


@pytest.mark.parametrize(("exporter", "dtype", "dims"), [
    ("torchscript", torch.float32, 1), ("torchscript", torch.float32, 2), ("torchscript", torch.float32, 3),
    ("torchscript", torch.float64, 1), ("torchscript", torch.float64, 2), ("dynamo", torch.float32, 2),
    ("dynamo", torch.float64, 3)])
def test_nearest_interpolation_reads_torch_s_pixels(exporter: str, dtype: torch.dtype, dims: int) -> None:
    """The exporters' Resize computes a nearest source index as i / factor, torch's kernels as i * float32(1 /
    factor), floored: at 1.7 from 12 rows 2 of the 20 output rows read the row before or after torch's, and the
    first call's check refused the module (nearest-exact likewise; and onnxruntime has no float64 Resize).
    Gathered at torch's indices, values and gradients are torch's, at two sizes from one export. (torch's float64
    1-d and 3-d nearest-exact kernels compute the forward's indices in float64, which ours follow, and the
    backward's in float32: at 2.3 from 19 rows its gradient is not the adjoint of its output, so only the values
    are compared there.)"""
    g = torch.Generator().manual_seed(dims)
    inputs = [torch.randn(2, 2, *size[:dims], generator=g, dtype=dtype) for size in [(19, 12, 10), (12, 19, 7)]]
    torch_s_own = dims != 2 and dtype == torch.float64
    om = _as_torch(lambda: Nearest(dims, dtype, ("nearest",) if torch_s_own else ("nearest", "nearest-exact")),
                   inputs, exporter, **TOLERANCE[dtype])
    assert om.stats["exports"] == 1 and om.stats["fallbacks"] == 0, om.stats
    if torch_s_own:
        exact = ORTModule(Nearest(dims, dtype, ("nearest-exact",)), exporter=exporter)
        for x in inputs:
            assert torch.equal(exact(x), Nearest(dims, dtype, ("nearest-exact",))(x))


class Ramps(nn.Module):
    """float64 ramps over a number of steps read from the input's sizes (positions, a schedule over a sequence), one
    step among them, weighting the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.linspace(0.1, 2.7, x.shape[0], dtype=torch.float64)[:, None]
        cols = torch.linspace(3, -0.3, x.shape[1] * 3, dtype=torch.float64)[:x.shape[1]]
        return (x * self.w + rows) * cols


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_linspace_over_traced_steps_is_torch_s(exporter: str) -> None:
    """The legacy exporter's linspace computes start + step * i in float32 whatever the dtype (5e-8 off in float64,
    with its numbers written in float32): now torch's kernel, in float64, the second half counted back from end; a
    single step is start."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, 5, generator=g, dtype=torch.float64) for rows in (3, 1, 7)]
    _as_torch(Ramps, inputs if exporter == "torchscript" else inputs[:1], exporter, rtol=1e-13, atol=1e-14)


class Floored(nn.Module):
    """Values torch clamps to eps in place under no_grad, from a Linear of the batch and a scale the batch gives
    (above eps at the first step, below it for some rows at the next ones): a Gaussian NLL's variance (one a
    target, or one shared by a row's targets) and the norms of cosine similarity's inputs."""

    def __init__(self, dtype: torch.dtype, case: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3 if case == "shared variance" else 4, dtype=dtype)
        self.case = case

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.case == "cosine":
            return nn.CosineSimilarity(eps=0.3)(h[:, :2] * scale, h[:, 2:]).sum()
        return nn.GaussianNLLLoss(full=True, eps=0.05)(h[:, :2], y, h[:, 2:] ** 2 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["variance", "shared variance", "cosine"])
def test_values_clamped_under_no_grad_keep_their_gradient(dtype: torch.dtype, case: str) -> None:
    """torch clamps gaussian_nll_loss's variance and cosine_similarity's norms in place under no_grad, so the
    gradient reaches the clamped entries as if unclamped; the exported Clip (and clamp_min) passed none there,
    silently from the first step that had values below eps."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 2, generator=g, dtype=dtype),
                torch.full((1,), scale, dtype=dtype)) for scale in (10.0, 0.1, 0.1)]
    check_parity(lambda: Floored(dtype, case), batches, lambda m, b: m(*b), sgd, rtol=TOLERANCE[dtype]["rtol"])


class GaussianHead(nn.Module):
    """Means and variances (above eps: dynamo keeps clamp_min's gradient below it) from a Linear, a Gaussian NLL
    with the constant term; a variance per target, one per row, or a number."""

    def __init__(self, dtype: torch.dtype, case: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3 if case == "one per row" else 4, dtype=dtype)
        self.case = case

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        var = 0.5 if self.case == "a number" else F.softplus(h[:, 2:].squeeze(-1) if self.case == "one per row"
                                                              else h[:, 2:]) + 0.1
        return F.gaussian_nll_loss(h[:, :2], y, var, full=True, reduction="sum")


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["per target", "one per row", "a number"])
def test_gaussian_nll_trains_under_both_exporters(dtype: torch.dtype, case: str, exporter: str) -> None:
    """torch's gaussian_nll_loss checks `torch.any(var < 0)`, a branch on values: dynamo's export failed ("module
    is not installed as a submodule"). Written out, its constant 0.5 log(2 pi) exact in float64, its checks of
    sizes baking nothing in (no ExportWarning)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 2, generator=g, dtype=dtype))
               for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        check_parity(lambda: GaussianHead(dtype, case), batches, lambda m, b: m(*b), sgd,
                     rtol=TOLERANCE[dtype]["rtol"], exporter=exporter)


class FiniteLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x), y).nan_to_num(0.0)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_nan_to_num_of_a_loss_in_the_forward(exporter: str) -> None:
    """A loss kept finite in the forward over a batch of ignored targets (0 / 0): the legacy exporter's nan_to_num
    of the 0-d loss was 1-D, and the first call's check refused the module."""
    g = torch.Generator().manual_seed(0)
    targets = [torch.full((8,), -100), torch.randint(0, 5, (8,), generator=g), torch.randint(0, 5, (8,), generator=g)]
    batches = [(torch.randn(8, 6, generator=g), y) for y in targets]
    check_parity(FiniteLoss, batches, lambda m, b: m(*b), sgd, exporter=exporter)


class PairDistances(nn.Module):
    """torch.pdist of scaled rows, two of them equal (a zero distance), at several orders."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, x[:1]]) * self.w
        return torch.cat([F.pdist(h), torch.pdist(h, 1), F.pdist(h, 3), F.pdist(h, 0.5), F.pdist(h, math.inf)])


def test_pdist_follows_the_row_count_from_one_export() -> None:
    """Neither exporter has pdist: the norms of the differences over the pairs i < j, picked by a mask of the
    run-time row count; torch's values, and its zero gradient at a zero distance, at every row count."""
    g = torch.Generator().manual_seed(0)
    om = _as_torch(PairDistances, [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (4, 6, 1)],
                   **TOLERANCE[torch.float64])
    assert om.stats["exports"] == 1, om.stats


def test_float64_group_and_instance_norms_train_like_torch() -> None:
    """The exporters write group norm and instance norm without running statistics as InstanceNormalization, which
    onnxruntime runs in float32 only (the module was refused at its session's load): written out in float64, one
    group and three, with and without the per-channel affine, unbatched instance norm too."""
    def norms(h: torch.Tensor) -> list[torch.Tensor]:
        scale = torch.linspace(0.5, 1.5, 2, dtype=h.dtype)
        return [F.group_norm(h.view(-1, 2, 3), 1), F.group_norm(h.view(-1, 6, 1, 1).repeat(1, 1, 2, 2), 3, eps=0.1),
                F.instance_norm(h.view(-1, 2, 3), weight=scale, bias=-scale), nn.InstanceNorm1d(2)(h[0].view(2, 3))]

    _trains_under_the_legacy_exporter(lambda: Projected(norms), rows=5)


class Resampled(nn.Module):
    """float64 linear resampling: 1-D by a factor, 2-D by a factor (a whole one too: a diffusion UNet's upsampling),
    to a size and with align_corners (by a factor too: (n - 1) / (2n - 1) is no float32), 3-D by a factor (1 along
    an axis of 1: torch's identity there)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float64).view(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        return torch.cat([F.interpolate(h.flatten(2), scale_factor=1.3, mode="linear").flatten(),
                          F.interpolate(h, scale_factor=0.6, mode="bilinear").flatten(),
                          F.interpolate(h, scale_factor=2, mode="bilinear").flatten(),
                          F.interpolate(h, size=(5, 3), mode="bilinear", align_corners=True).flatten(),
                          F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=True).flatten(),
                          F.interpolate(h[:, :, None], scale_factor=(1, 1.5, 0.7), mode="trilinear").flatten()])


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_linear_interpolation_follows_every_size(exporter: str) -> None:
    """onnxruntime has no double Resize (the legacy export was refused at its session's load) and dynamo's 1-D form
    computed its weights in float32 (2e-7 off, silently): products with torch's weights per axis, in float64, at
    every size (a square one first) from one legacy export. (dynamo's size n * 2.0 was an integer, whose Floor
    failed the gradient build.)"""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 2, h, w, generator=g, dtype=torch.float64) for h, w in ((4, 4), (7, 5), (3, 8))]
    om = _as_torch(Resampled, inputs if exporter == "torchscript" else inputs[:1], exporter,
                   **TOLERANCE[torch.float64])
    assert om.stats["exports"] == 1, om.stats


class Bicubic(nn.Module):
    """float64 bicubic interpolation to a size and by factors up and down, with and without align_corners."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float64).view(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        return torch.cat([F.interpolate(h, size=(23, 17), mode="bicubic").flatten(1),
                          F.interpolate(h, scale_factor=2.3, mode="bicubic", align_corners=True).flatten(1),
                          F.interpolate(h, scale_factor=(0.6, 1.7), mode="bicubic").flatten(1)], 1)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_bicubic_interpolation_is_torch_s(exporter: str) -> None:
    """onnxruntime has no double Resize (the session refused to load): products with torch's cubic weights per axis
    (A = -0.75, the four inputs around each source position clamped to the axis), in float64, at two sizes from one
    legacy export."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 2, h, w, generator=g, dtype=torch.float64) for h, w in ((19, 12), (13, 16))]
    om = _as_torch(Bicubic, inputs if exporter == "torchscript" else inputs[:1], exporter, **TOLERANCE[torch.float64])
    assert om.stats["exports"] == 1, om.stats


def test_unbatched_cross_entropy_and_nll_train_like_torch() -> None:
    """Losses of one sample ((C,) scores; a 0-d class, or (C,) probabilities), which torch takes: the exporters wrote
    their loss ops on the 1-D scores, which onnxruntime refused at the session's load (LogSoftmax's axis); now
    with a batch axis of 1 around them, every reduction, weights and label smoothing included."""
    def unbatched(h: torch.Tensor) -> list[torch.Tensor]:
        weight, target = torch.linspace(0.5, 1.5, 6, dtype=h.dtype), h[1].argmax()
        return [F.cross_entropy(h[0], target), nn.CrossEntropyLoss()(h[4], target),
                F.cross_entropy(h[0], target, weight=weight, label_smoothing=0.2),
                F.cross_entropy(h[4], target, weight=weight, label_smoothing=0.1, reduction="sum"),
                F.cross_entropy(h[0], h[2].softmax(0), reduction="sum"),
                F.cross_entropy(h[3], target, reduction="none"),
                F.nll_loss(h[3].log_softmax(0), target, weight=weight, reduction="none")]

    _trains_under_the_legacy_exporter(lambda: Projected(unbatched), rows=5)


class OfParameter(nn.Module):
    """`fn` of a parameter, weighted by the input and summed."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], init: torch.Tensor) -> None:
        super().__init__()
        self.p, self.fn = nn.Parameter(init.clone()), fn

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (self.fn(self.p) * w).sum()


_POINTS = torch.tensor([[0.0, 1.0], [2.0, 3.0], [1.0, 2.0], [5.0, 3.0]])
BOTH = ("torchscript", "dynamo")
EDGES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.dtype, tuple[str, ...]]] = {
    # 1 at 0 with the derivative 0 there; float64 pi (dynamo's was float32's: ~1e-8 off)
    "sinc": (lambda p: torch.sinc(p), torch.tensor([0.0, 0.5, -1.25, 0.3]), torch.float64, BOTH),
    # zero gradients at the origin (x's was -g); float32: onnxruntime has no double Atan
    "atan2 at the origin": (lambda p: torch.atan2(p[0], p[1]), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]]),
                            torch.float32, BOTH),
    # a row of NaNs only: NaN gradients to it (they were 0)
    "nanmean of NaNs": (lambda p: torch.nanmean(p.log(), 1).nan_to_num() + torch.nanmean(p[:, :2].log()),
                        torch.tensor([[-1.0, -2.0, -3.0], [1.0, -2.0, 3.0]]), torch.float64, BOTH),
    # the whole gradient to each difference tied at the maximum (it was split); dynamo's export keeps the split
    "cdist, p = inf": (lambda p: torch.cdist(p[:2], p[2:], p=math.inf), _POINTS, torch.float64, ("torchscript",)),
    "pdist, p = inf": (lambda p: F.pdist(p, p=math.inf), _POINTS, torch.float64, ("torchscript",)),
    # a row twice in a bag: the maximum's gradient to its first occurrence (it was split)
    "embedding_bag max, offsets": (
        lambda p: F.embedding_bag(torch.tensor([0, 1, 2, 2, 3, 3, 1]), p, torch.tensor([0, 3, 6, 6]), mode="max"),
        torch.tensor([[1.0, 2.0], [1.0, 0.0], [0.5, 2.0], [3.0, 1.0]]), torch.float64, BOTH),
}


@pytest.mark.parametrize("exporter", BOTH)
@pytest.mark.parametrize("case", list(EDGES))
def test_functions_at_ties_and_edges_give_torch_s_values_and_gradients(case: str, exporter: str) -> None:
    """Values and gradients where the written-out functions' formulas meet their edge cases (zeros, ties, NaNs),
    as torch's own kernels and backward give them, to float64 rounding (NaN where torch's is NaN)."""
    fn, init, dtype, exporters = EDGES[case]
    if exporter not in exporters:
        pytest.skip(f"{case}: {exporter} keeps another gradient")
    w = torch.linspace(-1.0, 2.0, fn(init).numel(), dtype=dtype).reshape(fn(init).shape)
    reference = OfParameter(fn, init.to(dtype))
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    for m in (model, reference):
        m(w).backward()
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(model(w), reference(w), **tol)
    torch.testing.assert_close(model.p.grad, reference.p.grad, equal_nan=True, **tol)


class SmallVarianceNorms(nn.Module):
    """Layer norms over features of variance near their eps (a pre-norm transformer's class token starts so), with
    and without an affine part, of eps 1e-5 and 1e-6 (neither a float32)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.outer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inner(x) * 0.003)
        return self.outer(h + F.layer_norm(h * 0.001, (8,), eps=1e-6))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_layer_norm_has_torchs_eps(exporter: str) -> None:
    """LayerNormalization holds eps as a float32 attribute: 1e-5 was 9.99999975e-6 in the graph, 1e-9 off torch's
    values through a ViT's pre-norms. Over x scaled by sqrt(f / eps) (f the float32), torch's values and gradients to
    1e-13; onnxruntime's NoopElimination had dropped that factor of 1 - 1.3e-8 (it reads a scalar in float32)."""
    g = torch.Generator().manual_seed(4)
    _as_torch(lambda: SmallVarianceNorms().double(), [torch.randn(5, 6, generator=g, dtype=torch.float64)], exporter,
              rtol=1e-13, atol=1e-15)


class Degrees(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.deg2rad(h).sin() + h.rad2deg()


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_float64_degree_conversions_are_exact(exporter: str) -> None:
    """deg2rad and rad2deg multiply by pi / 180 and 180 / pi, which both exporters wrote in float32 (8.7e-9 off in
    float64)."""
    g = torch.Generator().manual_seed(6)
    _as_torch(lambda: Degrees().double(), [torch.randn(5, 6, generator=g, dtype=torch.float64) * 50], exporter,
              **TOLERANCE[torch.float64])


class CapturedReferences(nn.Module):
    """Functions called through references taken before the export: `scaled_dot_product_attention` imported by
    name (as many modules do at import) and `torch.sinc` kept in an attribute."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)
        self.act = torch.sinc

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).reshape(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        o = captured_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.out(self.act(o.transpose(1, 2).reshape(x.shape)))


captured_attention = F.scaled_dot_product_attention


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_functions_called_through_references_taken_before(exporter: str) -> None:
    """The replacements reach calls through earlier references too: such calls ran torch's own conversions, so a
    fully masked row's NaN gradient failed the first call's check (the module could not train) and the legacy
    exporter's missing sinc sent the module to dynamo, whose float64 sinc multiplies by a float32 pi (1.6e-8 off)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, :] = False
    batches = [(torch.randn(3, 5, 8, generator=g, dtype=torch.float64), mask) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # no exporter change on the way
        check_parity(lambda: CapturedReferences().double(), batches, lambda m, b: m(*b).pow(2).sum(), sgd,
                     rtol=1e-12, exporter=exporter)
