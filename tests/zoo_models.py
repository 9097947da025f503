"""Small members of the model families users train: each a module, batches and the loss a user would write.

The models are written the way their libraries write them (torch.nn blocks, Hugging Face transformers
built from small configs, no weight download) so the exports contain the ops those families produce, at
sizes that train a few steps in seconds. Dropout is 0 where a model has it, so parity can be exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = dict[str, torch.Tensor]


# --- torch.nn.TransformerEncoder with a padding mask ---------------------------------------------------
class PaddedEncoder(nn.Module):
    """Token classifier over padded sequences: the padding mask reaches attention and the mean pooling."""

    def __init__(self, vocab: int = 50, d: int = 32, classes: int = 5, max_len: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(max_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def padded_tokens(g: torch.Generator, batch: int = 6, length: int = 12, vocab: int = 50, classes: int = 5) -> Batch:
    """Tokens with per-row lengths (at least 2), padding id 0 and mask True past each length."""
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    padding = torch.arange(length)[None, :] >= lengths[:, None]
    tokens = torch.randint(1, vocab, (batch, length), generator=g).masked_fill(padding, 0)
    return {"tokens": tokens, "padding": padding, "labels": torch.randint(0, classes, (batch,), generator=g)}


class Seq2Seq(nn.Module):
    """nn.Transformer encoder-decoder: causal target mask, source padding mask on encoder and cross-attention."""

    def __init__(self, vocab: int = 40, d: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.transformer = nn.Transformer(d, 4, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                             src_key_padding_mask=src_padding, memory_key_padding_mask=src_padding)
        return self.out(h)


def translation_batch(g: torch.Generator) -> Batch:
    source = padded_tokens(g, 4, 9, 40)
    return {"src": source["tokens"], "src_padding": source["padding"], "tgt": torch.randint(1, 40, (4, 7), generator=g)}


def translation_loss(m: nn.Module, b: Batch) -> torch.Tensor:
    """Teacher forcing with label smoothing."""
    logits = m(b["src"], b["tgt"][:, :-1], b["src_padding"])
    return F.cross_entropy(logits.transpose(1, 2), b["tgt"][:, 1:], label_smoothing=0.1)


# --- GPT-style causal language model with rotary embeddings --------------------------------------------
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) in plain torch ops: sin/cos of position x inverse frequency."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(q.shape[-2], dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.rotary = Rotary(d // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        q, k = self.rotary(q, k)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = scores.masked_fill(future, float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class RotaryGPT(nn.Module):
    """Pre-norm decoder; the output projection is the token embedding (tied weights)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


class NanoGPT(nn.Module):
    """nanoGPT's layout: learned positions, fused qkv split, F.scaled_dot_product_attention(is_causal=True),
    tied head, the loss computed inside forward with ignore_index."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, max_len: int = 16):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t))
        q, k, v = self.c_attn(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, -1))
        logits = self.lm_head(self.ln_f(x + self.mlp(self.ln2(x))))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def shifted_batch(g: torch.Generator) -> Batch:
    idx = torch.randint(0, 64, (4, 12), generator=g)
    return {"idx": idx, "targets": torch.cat([idx[:, 1:], torch.full((4, 1), -1)], 1)}


# --- ViT-style patch model -----------------------------------------------------------------------------
class TinyViT(nn.Module):
    """Conv2d patchify, class token, learned positions, pre-norm encoder layers, head on the class token."""

    def __init__(self, image: int = 16, patch: int = 4, d: int = 32, classes: int = 10, layers: int = 2):
        super().__init__()
        self.patchify = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


# --- ResNet-style CNN with BatchNorm -------------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 conv-BN, a 1x1 conv-BN shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.layer2(self.layer1(self.stem(x)))).flatten(1))


# --- U-Net-style segmentation model --------------------------------------------------------------------
def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class TinyUNet(nn.Module):
    """Three resolutions; upsampling by ConvTranspose2d, nearest and bilinear F.interpolate (ONNX Resize)."""

    def __init__(self, classes: int = 3, width: int = 8):
        super().__init__()
        self.enc1 = conv_block(3, width)
        self.enc2 = conv_block(width, 2 * width)
        self.bottom = conv_block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = conv_block(4 * width, 2 * width)
        self.dec1 = conv_block(2 * width + width, width)
        self.out = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        b = self.bottom(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(b), e2], 1))
        d2 = d2 + F.interpolate(b, scale_factor=2, mode="nearest").mean(1, keepdim=True)
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False), e1], 1))
        return self.out(d1)


class NormUNet(nn.Module):
    """Diffusion-style choices: GroupNorm + SiLU, strided conv down, nn.Upsample(align_corners=True),
    ConvTranspose2d with output_padding, InstanceNorm, F.interpolate to the skip's size."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.upsample = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.up = nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1)
        self.dec = nn.Sequential(nn.Conv2d(32, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True), nn.LeakyReLU(0.1))
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.enc(x)
        b = self.down(a)
        y = self.dec(torch.cat([a, self.upsample(b), self.up(b)], 1))
        return self.out(y + F.interpolate(b, size=a.shape[2:], mode="nearest")[:, :8])


class M5(nn.Module):
    """torchaudio's speech-command tutorial net, smaller: an 80-tap strided first Conv1d over raw audio, Conv-BN-
    ReLU-pool blocks, then an average pool over the whole remaining length squeezed away (the legacy exporter
    writes that squeeze as an If on the length) and log-probabilities."""

    def __init__(self, classes: int = 5, width: int = 8):
        super().__init__()
        blocks: list[nn.Module] = []
        for cin, cout, k, stride in ((1, width, 80, 16), (width, width, 3, 1), (width, 2 * width, 3, 1)):
            blocks += [nn.Conv1d(cin, cout, k, stride=stride), nn.BatchNorm1d(cout), nn.ReLU(), nn.MaxPool1d(4)]
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = self.features(audio)
        x = F.avg_pool1d(x, x.shape[-1]).squeeze(-1)
        return F.log_softmax(self.head(x), dim=-1)


def audio_batch(g: torch.Generator) -> Batch:
    return {"audio": torch.randn(4, 1, 2000, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}


# --- LSTM sequence classifier --------------------------------------------------------------------------
class Siamese(nn.Module):
    """One encoder (Conv-BatchNorm-ReLU, a pool, a projection) applied to both images of a pair: its BatchNorm
    runs twice a forward, its statistics updated once a call."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                     nn.Flatten(), nn.Linear(8 * 8 * 8, 16))

    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return F.pairwise_distance(self.encoder(left), self.encoder(right))


def pairs_batch(g: torch.Generator) -> Batch:
    return {"left": torch.randn(6, 3, 16, 16, generator=g), "right": torch.randn(6, 3, 16, 16, generator=g),
            "same": torch.randint(0, 2, (6,), generator=g).float()}


def contrastive_loss(m: nn.Module, b: Batch) -> torch.Tensor:
    """Hadsell et al.'s: pull pairs of a class together, push others past a margin of 1."""
    d = m(b["left"], b["right"])
    return (b["same"] * d.square() + (1 - b["same"]) * F.relu(1 - d).square()).mean()


class LSTMClassifier(nn.Module):
    """Embedding with a padding row, two-layer bidirectional LSTM over right-padded sequences (no packing: the
    padding steps reach the final states), linear head on both directions' last hidden states."""

    def __init__(self, vocab: int = 40, d: int = 16, hidden: int = 24, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(self.embed(tokens))
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


class GRUTagger(nn.Module):
    """Time-major two-layer bidirectional GRU, a label per step."""

    def __init__(self, vocab: int = 40, d: int = 16, hidden: int = 24, tags: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, hidden, num_layers=2, bidirectional=True)
        self.head = nn.Linear(2 * hidden, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


class PackedLSTM(nn.Module):
    """The packed-sequence way to skip padding steps (pack_padded_sequence)."""

    def __init__(self, vocab: int = 40, d: int = 16, hidden: int = 24, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.lstm = nn.LSTM(d, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(torch.cat([h[-2], h[-1]], dim=-1))


def packed_batch(g: torch.Generator) -> Batch:
    b = padded_tokens(g, 4, 9, 40, 4)
    return {"tokens": b["tokens"], "lengths": (~b["padding"]).sum(1), "labels": b["labels"]}


# --- Hugging Face transformers -------------------------------------------------------------------------
TEXT = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def hf(model: str, config: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A transformers model class built from a small config (random weights, nothing downloaded); eager
    attention unless the case asks for another."""

    def make() -> nn.Module:
        import transformers

        kwargs.setdefault("attn_implementation", "eager")
        return getattr(transformers, model)(getattr(transformers, config)(**kwargs))

    return make


def checkpointed(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model with Hugging Face's activation checkpointing on, reentrant (torch's CheckpointFunction)."""

    def make_checkpointed() -> nn.Module:
        model = make()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model

    return make_checkpointed


def text_batch(g: torch.Generator, batch: int = 4, length: int = 10, vocab: int = 99, classes: int = 3) -> Batch:
    """Token ids, an attention mask with right padding on some rows, class labels."""
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": torch.randint(0, vocab, (batch, length), generator=g), "attention_mask": mask,
            "labels": torch.randint(0, classes, (batch,), generator=g)}


def span_batch(g: torch.Generator) -> Batch:
    """Question answering: start and end positions, some past the sequence (clamped to it and ignored)."""
    batch = text_batch(g)
    del batch["labels"]
    return {**batch, "start_positions": torch.randint(0, 14, (4,), generator=g),
            "end_positions": torch.randint(0, 14, (4,), generator=g)}


def lm_batch(g: torch.Generator, batch: int = 4, length: int = 10, vocab: int = 99) -> Batch:
    """Causal LM: labels are the input ids (the model shifts them), the same tensor as users pass it."""
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return {"input_ids": ids, "labels": ids}


def mlm_batch(g: torch.Generator) -> Batch:
    return {**text_batch(g), "labels": torch.randint(0, 99, (4, 10), generator=g)}


def seq2seq_batch(g: torch.Generator) -> Batch:
    return {"input_ids": torch.randint(3, 99, (4, 10), generator=g),
            "labels": torch.randint(3, 99, (4, 7), generator=g)}


def speech_batch(g: torch.Generator) -> Batch:
    """Log-mel features (8 bins, 32 frames) and the transcript's token ids."""
    return {"input_features": torch.randn(2, 8, 32, generator=g), "labels": torch.randint(1, 99, (2, 6), generator=g)}


def pixel_batch(size: int, classes: int = 10) -> Callable[[torch.Generator], Batch]:
    return lambda g: {"pixel_values": torch.randn(4, 3, size, size, generator=g),
                      "labels": torch.randint(0, classes, (4,), generator=g)}


def segmentation_batch(g: torch.Generator) -> Batch:
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g),
            "labels": torch.randint(0, 3, (2, 32, 32), generator=g)}


def clip_batch(g: torch.Generator) -> Batch:
    return {"input_ids": torch.randint(0, 99, (4, 8), generator=g),
            "pixel_values": torch.randn(4, 3, 16, 16, generator=g), "return_loss": True}


DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "activation_dropout", "dropout_p")
"""Float attributes that models built on functional dropout read their rate from (Hugging Face's BART, LLaMA)."""


def dropouts_on(module: nn.Module, p: float = 0.1) -> nn.Module:
    """`module` with every dropout it has at rate `p`: its `nn.Dropout`s and the float rates of functional ones."""
    for m in module.modules():
        if isinstance(m, nn.Dropout | nn.Dropout1d | nn.Dropout2d):
            m.p = p
        for attr in DROPOUT_ATTRIBUTES:
            if type(getattr(m, attr, None)) is float:
                setattr(m, attr, p)
    return module


# --- the cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A model, its batches (from a seeded generator) and the training loss."""

    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    needs: str | None = None
    """A package the case imports (skipped without it)."""

    def batches(self, steps: int, seed: int = 0) -> list[Batch]:
        g = torch.Generator().manual_seed(seed)
        return [self.batch(g) for _ in range(steps)]


def _classify(inputs: str) -> Callable[[nn.Module, Batch], torch.Tensor]:
    return lambda m, b: F.cross_entropy(m(b[inputs]), b["labels"])


def _hf_loss(m: nn.Module, b: Batch) -> torch.Tensor:
    """What Hugging Face users write: keyword batch in, ModelOutput out, its `.loss`."""
    return m(**b, return_dict=True).loss


def _images(size: int, classes: int) -> Callable[[torch.Generator], Batch]:
    return lambda g: {"images": torch.randn(4, 3, size, size, generator=g),
                      "labels": torch.randint(0, classes, (4,), generator=g)}


def _masks(g: torch.Generator) -> Batch:
    return {"images": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.randint(0, 3, (2, 16, 16), generator=g)}


def _hf(model: str, config: str, batch: Callable[[torch.Generator], Batch], **kwargs: Any) -> Case:
    return Case(hf(model, config, **kwargs), batch, _hf_loss, needs="transformers")


CASES: dict[str, Case] = {
    "transformer-encoder": Case(PaddedEncoder, padded_tokens,
                                lambda m, b: F.cross_entropy(m(b["tokens"], b["padding"]), b["labels"])),
    "gpt-rotary": Case(RotaryGPT, lambda g: {"idx": torch.randint(0, 64, (4, 12), generator=g)},
                       lambda m, b: next_token_loss(m(b["idx"]), b["idx"])),
    "gpt-sdpa": Case(NanoGPT, shifted_batch, lambda m, b: m(**b)[1]),
    "transformer-seq2seq": Case(Seq2Seq, translation_batch, translation_loss),
    "vit": Case(TinyViT, _images(16, 10), _classify("images")),
    "resnet": Case(TinyResNet, _images(16, 10), _classify("images")),
    "unet": Case(TinyUNet, _masks, _classify("images")),
    "unet-norms": Case(NormUNet, _masks, _classify("images")),
    "siamese": Case(Siamese, pairs_batch, contrastive_loss),
    "m5-audio": Case(M5, audio_batch, lambda m, b: F.nll_loss(m(b["audio"]), b["labels"])),
    "lstm": Case(LSTMClassifier, lambda g: padded_tokens(g, 4, 9, 40, 4), _classify("tokens")),
    "lstm-packed": Case(PackedLSTM, packed_batch,
                        lambda m, b: F.cross_entropy(m(b["tokens"], b["lengths"]), b["labels"])),
    "gru-tagger": Case(GRUTagger, lambda g: {"tokens": torch.randint(0, 40, (9, 4), generator=g),
                                             "labels": torch.randint(0, 5, (9, 4), generator=g)},
                       lambda m, b: F.cross_entropy(m(b["tokens"]).flatten(0, 1), b["labels"].flatten())),
    # encoders
    "hf-bert": _hf("BertForSequenceClassification", "BertConfig", text_batch, **TEXT, **NO_DROPOUT, num_labels=3),
    "hf-bert-sdpa": _hf("BertForSequenceClassification", "BertConfig", text_batch, **TEXT, **NO_DROPOUT, num_labels=3,
                        attn_implementation="sdpa"),
    "hf-bert-checkpointing": Case(checkpointed(hf("BertForSequenceClassification", "BertConfig", **TEXT,
                                                  **NO_DROPOUT, num_labels=3)), text_batch, _hf_loss,
                                  needs="transformers"),
    "hf-bert-mlm": _hf("BertForMaskedLM", "BertConfig", mlm_batch, **TEXT, **NO_DROPOUT),
    "hf-distilbert": _hf("DistilBertForSequenceClassification", "DistilBertConfig", text_batch, vocab_size=99, dim=32,
                         n_layers=2, n_heads=2, hidden_dim=37, dropout=0.0, attention_dropout=0.0,
                         seq_classif_dropout=0.0, num_labels=3),
    "hf-roberta": _hf("RobertaForSequenceClassification", "RobertaConfig", text_batch, **TEXT, **NO_DROPOUT,
                      num_labels=3, max_position_embeddings=64),
    # relative attention; its position terms detached: the backward for the loss alone (logits are returned too)
    "hf-deberta-v2": _hf("DebertaV2ForSequenceClassification", "DebertaV2Config", text_batch, **TEXT, **NO_DROPOUT,
                         num_labels=3, relative_attention=True, pos_att_type=["c2p", "p2c"],
                         max_relative_positions=16),
    # span extraction: the positions past the sequence ignored by an ignore_index read from the scores' size
    "hf-bert-qa": _hf("BertForQuestionAnswering", "BertConfig", span_batch, **TEXT, **NO_DROPOUT),
    # decoders
    "hf-gpt2": _hf("GPT2LMHeadModel", "GPT2Config", lm_batch, vocab_size=99, n_embd=32, n_layer=2, n_head=2,
                   n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "hf-llama": _hf("LlamaForCausalLM", "LlamaConfig", lm_batch, **TEXT, num_key_value_heads=1,
                    max_position_embeddings=64, tie_word_embeddings=True),
    "hf-mistral-sdpa": _hf("MistralForCausalLM", "MistralConfig", lm_batch, **TEXT, num_key_value_heads=1,
                           max_position_embeddings=64, attn_implementation="sdpa"),
    # its GELU is a torch.autograd.Function whose backward is its forward's derivative
    "hf-bloom": _hf("BloomForCausalLM", "BloomConfig", lm_batch, vocab_size=99, hidden_size=32, n_layer=2, n_head=2,
                    hidden_dropout=0.0, attention_dropout=0.0),
    "hf-gptneox": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", lm_batch, **TEXT, max_position_embeddings=64,
                      hidden_dropout=0.0, attention_dropout=0.0),
    # a mixture of experts: top-2 routing, its experts as Hugging Face's eager loop (its default, grouped_mm, has no
    # export), the load-balancing loss counting routed tokens by histc
    "hf-mixtral": _hf("MixtralForCausalLM", "MixtralConfig", lm_batch, vocab_size=99, hidden_size=32,
                      intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.02, experts_implementation="eager"),
    # a state-space model: its scan a Python loop over the steps, its inputs cut by tensor_split at a size read
    "hf-mamba": _hf("MambaForCausalLM", "MambaConfig", lm_batch, vocab_size=99, hidden_size=32, state_size=4,
                    num_hidden_layers=2, expand=2, conv_kernel=4),
    # Mamba-2's chunked scan: permutes by negative dims
    "hf-mamba2": _hf("Mamba2ForCausalLM", "Mamba2Config", lm_batch, vocab_size=99, hidden_size=32, state_size=4,
                     num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, n_groups=1, chunk_size=8),
    # rotary angles repeated pairwise (repeat_interleave by a count), queries rotated by stack and flatten
    "hf-cohere": _hf("CohereForCausalLM", "CohereConfig", lm_batch, **TEXT, num_key_value_heads=1,
                     max_position_embeddings=64),
    # encoder-decoders
    "hf-t5": _hf("T5ForConditionalGeneration", "T5Config", seq2seq_batch, vocab_size=99, d_model=32, d_kv=16, d_ff=37,
                 num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
    # its decoder positions repeated over the batch: ranks inference leaves unknown, declared from the evaluation
    "hf-whisper": _hf("WhisperForConditionalGeneration", "WhisperConfig", speech_batch, vocab_size=99, d_model=32,
                      encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                      encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8, max_source_positions=16,
                      max_target_positions=32, dropout=0.0, decoder_start_token_id=0, pad_token_id=0),
    "hf-bart": _hf("BartForConditionalGeneration", "BartConfig", seq2seq_batch, vocab_size=99, d_model=32,
                   encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                   encoder_ffn_dim=37, decoder_ffn_dim=37, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                   max_position_embeddings=64),
    # vision
    "hf-vit": _hf("ViTForImageClassification", "ViTConfig", pixel_batch(16), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=37, image_size=16, patch_size=4, num_labels=10,
                  **NO_DROPOUT),
    "hf-resnet": _hf("ResNetForImageClassification", "ResNetConfig", pixel_batch(32), embedding_size=8,
                     hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck", num_labels=10),
    "hf-convnext": _hf("ConvNextForImageClassification", "ConvNextConfig", pixel_batch(32), hidden_sizes=[8, 16],
                       depths=[1, 1], num_stages=2, num_labels=10, drop_path_rate=0.0),
    "hf-swin": _hf("SwinForImageClassification", "SwinConfig", pixel_batch(32), image_size=32, patch_size=2,
                   embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=10, drop_path_rate=0.0,
                   **NO_DROPOUT),
    "hf-segformer": _hf("SegformerForSemanticSegmentation", "SegformerConfig", segmentation_batch,
                        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], decoder_hidden_size=16,
                        num_labels=3, classifier_dropout_prob=0.0, drop_path_rate=0.0, **NO_DROPOUT),
    # multimodal
    "hf-clip": _hf("CLIPModel", "CLIPConfig", clip_batch,
                   text_config={"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                                "num_attention_heads": 2, "max_position_embeddings": 32},
                   vision_config={"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
                   projection_dim=16),
}
