"""The benchmark models, each a module that returns its training loss, and one batch of inputs for it.

The loss is part of the module so that ORTModule and torch eager differentiate the same graph (the
cross-entropy runs on onnxruntime too); both are handed the same module and the same batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


class WithLoss(nn.Module):
    """A classifier and its mean cross-entropy (over the batch, or over every token for a sequence model)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def mlp(sizes: tuple[int, ...] = (784, 512, 512, 10)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def lenet(channels: tuple[int, int, int] = (1, 6, 16), size: int = 28, kernel: int = 5,
          hidden: tuple[int, ...] = (120, 84), activation: Callable[[], nn.Module] = nn.ReLU,
          pool: Callable[[int], nn.Module] = nn.MaxPool2d, pad: int | None = None) -> nn.Module:
    """LeNet-5 (on 1x28x28 by default): conv-activation-pool twice, then fully connected layers. The first conv
    keeps the size (same padding) on 28x28 images, as LeNet on MNIST does, unless `pad` says otherwise."""
    c0, c1, c2 = channels
    pad = (kernel // 2 if size == 28 else 0) if pad is None else pad
    side = ((size + 2 * pad - kernel + 1) // 2 - kernel + 1) // 2
    sizes = (c2 * side * side, *hidden, 10)
    dense: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        dense += [nn.Linear(a, b), activation()] if i < len(sizes) - 2 else [nn.Linear(a, b)]
    return nn.Sequential(
        nn.Conv2d(c0, c1, kernel, padding=pad), activation(), pool(2),
        nn.Conv2d(c1, c2, kernel), activation(), pool(2), nn.Flatten(), *dense)


def small_vgg() -> nn.Module:
    """Three 3x3 conv-relu layers with two 2x2 pools on 3x32x32 (CIFAR-sized)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))


class Encoder(nn.Module):
    """Token + learned position embeddings, pre-LN encoder layers (causal when asked), final LN, LM head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int, ff: int, dropout: float,
                 causal: bool, activation: str = "relu"):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout, activation=activation, batch_first=True,
                                           norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq) if causal else None,
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos[:tokens.shape[1]]
        return self.head(self.norm(self.layers(h, mask=self.mask, is_causal=self.mask is not None)))


@dataclass(frozen=True)
class Case:
    """One benchmark model: how to build it and a batch, and how many timed steps it affords."""

    name: str
    description: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    steps: int
    """Interleaved timed repetitions (each one step of each engine)."""


def _images(n: int, shape: tuple[int, ...], classes: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda gen: (torch.randn(n, *shape, generator=gen), torch.randint(0, classes, (n,), generator=gen))


def _tokens(n: int, seq: int, vocab: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda gen: (torch.randint(0, vocab, (n, seq), generator=gen),
                        torch.randint(0, vocab, (n, seq), generator=gen))


GPT_VOCAB = 50257

CASES: dict[str, Case] = {c.name: c for c in [
    Case("tiny-mlp", "MLP 64-128-64-10, batch 64 (per-step overhead)", lambda: WithLoss(mlp((64, 128, 64, 10))),
         _images(64, (64,), 10), 400),
    Case("mlp", "MLP 784-512-512-10, batch 64", lambda: WithLoss(mlp()), _images(64, (1, 28, 28), 10), 200),
    Case("cnn", "LeNet-5, batch 64, 1x28x28", lambda: WithLoss(lenet()), _images(64, (1, 28, 28), 10), 100),
    Case("transformer", "pre-LN encoder, 2 layers, d=128, 4 heads, ff 512, seq 64, batch 8, vocab 1000",
         lambda: WithLoss(Encoder(1000, 128, 4, 2, 64, 512, 0.1, causal=False)), _tokens(8, 64, 1000), 60),
    Case("gpt2", f"GPT-2-small shape: 12 layers, d=768, 12 heads, ff 3072, GELU, causal, seq 128, batch 1, "
         f"vocab {GPT_VOCAB}",
         lambda: WithLoss(Encoder(GPT_VOCAB, 768, 12, 12, 128, 3072, 0.1, causal=True, activation="gelu")),
         _tokens(1, 128, GPT_VOCAB), 6),
]}
"""Models of the benchmark table, in table order."""

SHAPES: dict[str, Case] = {c.name: c for c in [
    Case("mlp-wide", "MLP 784-1024-1024-10, batch 128", lambda: WithLoss(mlp((784, 1024, 1024, 10))),
         _images(128, (784,), 10), 40),
    Case("mlp-deep", "MLP 784-256-256-256-256-10, batch 32", lambda: WithLoss(mlp((784, 256, 256, 256, 256, 10))),
         _images(32, (784,), 10), 100),
    Case("mlp-b256", "MLP 784-512-256-10, batch 256", lambda: WithLoss(mlp((784, 512, 256, 10))),
         _images(256, (784,), 10), 60),
    Case("mlp-small", "MLP 784-128-10, batch 64 (a 0.5 ms step)", lambda: WithLoss(mlp((784, 128, 10))),
         _images(64, (784,), 10), 200),
    Case("mlp-b16", "MLP 784-512-512-10, batch 16", lambda: WithLoss(mlp()), _images(16, (784,), 10), 200),
    Case("cnn-b128", "LeNet-5, batch 128", lambda: WithLoss(lenet()), _images(128, (1, 28, 28), 10), 30),
    Case("cnn-b16", "LeNet-5, batch 16", lambda: WithLoss(lenet()), _images(16, (1, 28, 28), 10), 100),
    Case("cnn-wide", "LeNet-5 with 32 and 64 channels, dense 128, batch 32",
         lambda: WithLoss(lenet((1, 32, 64), hidden=(128,))), _images(32, (1, 28, 28), 10), 30),
    Case("cnn-rgb", "LeNet-5 on 3x32x32 (no padding), batch 64", lambda: WithLoss(lenet((3, 6, 16), size=32)),
         _images(64, (3, 32, 32), 10), 30),
    Case("cnn-caffe", "Caffe's LeNet: 20 and 50 channels, dense 500, batch 64",
         lambda: WithLoss(lenet((1, 20, 50), hidden=(500,))), _images(64, (1, 28, 28), 10), 30),
    Case("cnn-3x3", "three 3x3 convs 16-32-64 on 3x32x32, batch 64", lambda: WithLoss(small_vgg()),
         _images(64, (3, 32, 32), 10), 20),
    Case("transformer-d256", "pre-LN encoder, 2 layers, d=256, 8 heads, ff 1024, seq 128, batch 8, vocab 2000",
         lambda: WithLoss(Encoder(2000, 256, 8, 2, 128, 1024, 0.1, causal=False)), _tokens(8, 128, 2000), 10),
    Case("transformer-causal", "pre-LN causal encoder, 4 layers, d=128, 4 heads, ff 512, seq 64, batch 16, vocab 1000",
         lambda: WithLoss(Encoder(1000, 128, 4, 4, 64, 512, 0.1, causal=True)), _tokens(16, 64, 1000), 10),
    Case("transformer-small", "pre-LN encoder, 2 layers, d=64, 2 heads, ff 256, seq 32, batch 16, vocab 500",
         lambda: WithLoss(Encoder(500, 64, 2, 2, 32, 256, 0.1, causal=False)), _tokens(16, 32, 500), 30),
    Case("transformer-nodrop", "the reference encoder without dropout (p=0)",
         lambda: WithLoss(Encoder(1000, 128, 4, 2, 64, 512, 0.0, causal=False)), _tokens(8, 64, 1000), 20),
    Case("gpt2-4l", "GPT-2 width, 4 layers: d=768, 12 heads, ff 3072, GELU, causal, seq 64, batch 2, "
         f"vocab {GPT_VOCAB}",
         lambda: WithLoss(Encoder(GPT_VOCAB, 768, 12, 4, 64, 3072, 0.1, causal=True, activation="gelu")),
         _tokens(2, 64, GPT_VOCAB), 4),
]}
"""Other shapes of the reference models' families (the `shapes` part): step-time ratios only."""


def _mlp_case(sizes: tuple[int, ...], batch: int) -> Case:
    return Case(f"mlp-{'-'.join(map(str, sizes))}-b{batch}", f"MLP {'-'.join(map(str, sizes))}, batch {batch}",
                lambda: WithLoss(mlp(sizes)), _images(batch, (sizes[0],), 10), 60)


def _lenet_case(channels: tuple[int, int, int], size: int, kernel: int, hidden: tuple[int, ...], batch: int) -> Case:
    c0, c1, c2 = channels
    return Case(f"lenet-{c0}-{c1}-{c2}-s{size}-k{kernel}-b{batch}",
                f"LeNet {c0}x{size}x{size} -> {c1} -> {c2} channels, {kernel}x{kernel}, dense "
                f"{'-'.join(map(str, hidden))}, batch {batch}",
                lambda: WithLoss(lenet(channels, size, kernel, hidden)), _images(batch, (c0, size, size), 10), 30)


def _encoder_case(vocab: int, d: int, heads: int, layers: int, seq: int, ff: int, dropout: float, causal: bool,
                  batch: int, activation: str = "relu") -> Case:
    kind = "causal " if causal else ""
    return Case(f"enc-d{d}-h{heads}-l{layers}-s{seq}-b{batch}{'-causal' if causal else ''}-v{vocab}",
                f"pre-LN {kind}encoder, {layers} layers, d={d}, {heads} heads, ff {ff} ({activation}), dropout "
                f"{dropout}, seq {seq}, batch {batch}, vocab {vocab}",
                lambda: WithLoss(Encoder(vocab, d, heads, layers, seq, ff, dropout, causal=causal,
                                         activation=activation)), _tokens(batch, seq, vocab), 12)


GRID: dict[str, Case] = {c.name: c for c in [
    *(_mlp_case(sizes, batch) for sizes, batch in [
        ((784, 300, 100, 10), 64), ((784, 512, 512, 10), 32), ((784, 512, 512, 10), 100), ((784, 1024, 10), 64),
        ((784, 256, 10), 128), ((3072, 512, 256, 10), 64), ((784, 2048, 2048, 10), 64), ((784, 512, 512, 10), 512),
        ((100, 200, 200, 10), 64), ((784, 800, 800, 10), 50)]),
    *(_lenet_case(*params) for params in [
        ((1, 6, 16), 28, 5, (120, 84), 32), ((1, 6, 16), 28, 5, (120, 84), 256), ((1, 16, 32), 28, 5, (120, 84), 64),
        ((1, 6, 16), 28, 3, (120, 84), 64), ((3, 6, 16), 32, 5, (120, 84), 32), ((3, 16, 32), 32, 5, (256,), 64),
        ((1, 8, 16), 28, 5, (64,), 64), ((3, 32, 64), 32, 5, (128,), 32), ((1, 6, 16), 32, 5, (120, 84), 64),
        ((3, 6, 16), 32, 3, (120, 84), 64)]),
    *(_encoder_case(*params) for params in [
        (1000, 128, 4, 2, 128, 512, 0.1, False, 8), (1000, 128, 4, 2, 32, 512, 0.1, False, 8),
        (1000, 128, 8, 2, 64, 512, 0.1, False, 8), (1000, 192, 6, 3, 64, 768, 0.1, False, 8, "gelu"),
        (5000, 128, 4, 2, 64, 512, 0.1, True, 8), (1000, 128, 4, 2, 64, 512, 0.1, False, 32),
        (1000, 128, 4, 2, 64, 512, 0.1, False, 1), (1000, 512, 8, 2, 64, 2048, 0.1, True, 4, "gelu"),
        (1000, 64, 4, 4, 128, 256, 0.0, True, 8), (1000, 128, 4, 1, 64, 512, 0.2, False, 8)]),
]}
"""A grid over the three reference families' parameters (the `grid` part): ten shapes each of the MLP (widths,
depths, inputs, batch 32-512), LeNet (1 or 3 input channels, 6-32 and 16-64 channels, 3x3 or 5x5 kernels,
28x28 or 32x32 inputs, batch 32-256) and the pre-LN encoder (width, heads, depth, sequence, batch 1-32, vocab,
causal, GELU, dropout), none of them a reference model: where the reference ratios hold and where not."""

FAMILIES = {"mlp": "MLP", "lenet": "LeNet", "enc": "encoder"}
"""The grid's name prefixes and the families they stand for."""


def _small_cnn(activation: Callable[..., nn.Module], norm: bool = False, size: int = 28, channels: int = 1,
               pool: str = "max", channelwise: bool = False) -> nn.Module:
    """Two 3x3 'same' convolutions (16 and 32 channels), each followed by the activation (given the channels when
    `channelwise`: PReLU's slope a channel) (then a BatchNorm when `norm`, the Conv-ReLU-BN order) and a 2x2 pool,
    or global average pooling after the second (`pool='global'`), then a Linear."""
    layers: list[nn.Module] = []
    for c_in, c_out in ((channels, 16), (16, 32)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), activation(c_out) if channelwise else activation()]
        if norm:
            layers.append(nn.BatchNorm2d(c_out))
        if pool == "max" or c_out == 16:
            layers.append(nn.MaxPool2d(2))
    side = size // 4 if pool == "max" else 1
    if pool == "global":
        layers.append(nn.AdaptiveAvgPool2d(1))
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(32 * side * side, 10))


def _mlp_with(activation: Callable[[], nn.Module], norm: Callable[[int], nn.Module] | None = None) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in ((784, 512), (512, 512)):
        layers += [nn.Linear(a, b), activation()]
        if norm is not None:
            layers.append(norm(b))
    return nn.Sequential(*layers, nn.Linear(512, 10))


class PixelLoss(WithLoss):
    """A per-pixel classifier and its mean cross-entropy over the class axis of its [N, C, H, W] scores."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def _pixels(n: int, side: int, classes: int) -> Callable[[torch.Generator], tuple[torch.Tensor, ...]]:
    return lambda gen: (torch.randn(n, 3, side, side, generator=gen),
                        torch.randint(0, classes, (n, side, side), generator=gen))


class PostLN(nn.Module):
    """The reference encoder's shape with post-LN layers (torch's default `norm_first=False`)."""

    def __init__(self, vocab: int = 1000, d: int = 128, seq: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 512, 0.1, batch_first=True), 2,
                                            enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.tok(tokens) + self.pos[:tokens.shape[1]]))


VARIANTS: dict[str, Case] = {c.name: c for c in [
    Case("cnn-relu-bn", "3x3 CNN 1 -> 16 -> 32, Conv-ReLU-BatchNorm, max pools, batch 64",
         lambda: WithLoss(_small_cnn(nn.ReLU, norm=True)), _images(64, (1, 28, 28), 10), 30),
    Case("cnn-leaky", "the same CNN with LeakyReLU, no BatchNorm", lambda: WithLoss(_small_cnn(nn.LeakyReLU)),
         _images(64, (1, 28, 28), 10), 30),
    Case("cnn-elu", "the same CNN with ELU", lambda: WithLoss(_small_cnn(nn.ELU)), _images(64, (1, 28, 28), 10), 30),
    Case("cnn-prelu", "the same CNN with PReLU, a slope a channel",
         lambda: WithLoss(_small_cnn(nn.PReLU, channelwise=True)), _images(64, (1, 28, 28), 10), 30),
    Case("cnn-gap", "3x3 CNN 3 -> 16 -> 32 on 3x32x32, ReLU, a max pool, then global average pooling, batch 64",
         lambda: WithLoss(_small_cnn(nn.ReLU, size=32, channels=3, pool="global")), _images(64, (3, 32, 32), 10), 30),
    Case("mlp-relu-ln", "MLP 784-512-512-10, ReLU then LayerNorm, batch 64",
         lambda: WithLoss(_mlp_with(nn.ReLU, nn.LayerNorm)), _images(64, (784,), 10), 60),
    Case("mlp-relu-bn", "MLP 784-512-512-10, ReLU then BatchNorm, batch 64",
         lambda: WithLoss(_mlp_with(nn.ReLU, nn.BatchNorm1d)), _images(64, (784,), 10), 60),
    Case("mlp-prelu", "MLP 784-512-512-10, PReLU, batch 64", lambda: WithLoss(_mlp_with(nn.PReLU)),
         _images(64, (784,), 10), 60),
    Case("mlp-softplus", "MLP 784-512-512-10, Softplus, batch 64", lambda: WithLoss(_mlp_with(nn.Softplus)),
         _images(64, (784,), 10), 60),
    Case("lenet-classic", "LeNet-5 as first drawn: tanh, 2x2 average pools, batch 64",
         lambda: WithLoss(lenet(activation=nn.Tanh, pool=nn.AvgPool2d)), _images(64, (1, 28, 28), 10), 30),
    Case("lenet-valid", "LeNet 1x28x28 -> 16 -> 32 channels, 5x5 without padding (12x12 to 8x8 maps), batch 64",
         lambda: WithLoss(lenet((1, 16, 32), pad=0)), _images(64, (1, 28, 28), 10), 30),
    Case("cnn-seg", "3x3 CNN 3 -> 16 channels and a 1x1 head to 21 classes on 3x64x64, per-pixel cross-entropy, "
         "batch 8", lambda: PixelLoss(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 21, 1))),
         _pixels(8, 64, 21), 30),
    Case("enc-post-ln", "the reference encoder with post-LN layers", lambda: WithLoss(PostLN()),
         _tokens(8, 64, 1000), 12),
]}
"""The reference families with other activations, pools, normalizations and their order, and a per-pixel loss (the
`grid` part, a table of its own): the Wheres of their gradients (ReLU before a BatchNorm, LeakyReLU, ELU, PReLU,
global average pooling) ran at up to 1.9x torch's step before `runtime.passes.guarded_selects`; ELU, Softplus and
the per-pixel loss's softmax over the class axis run element by element in onnxruntime's own kernels
(`runtime.vectorized`: the per-pixel loss stepped at 3.6x torch's before); the classic LeNet's average pools
spread their gradient by a ConvTranspose (a GEMM a pooled element) before `spread_windows` tiled them; the
unpadded LeNet's second input gradient maps 12x12 from 8x8, which `runtime.nchwc.MAX_SPREAD` leaves unblocked."""

ALL: dict[str, Case] = {**CASES, **SHAPES, **GRID, **VARIANTS}
"""Every case by name (`benchmarks.ab` takes any of them)."""
