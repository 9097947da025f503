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


def lenet() -> nn.Module:
    """LeNet-5 on 1x28x28: conv-relu-pool twice, then three fully connected layers."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


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
