"""runtime.attention: nn.MultiheadAttention exported with its activations copied once per projection and once for
the result, computing what torch computes; every other call left to torch's own forward."""

from __future__ import annotations

import contextlib
import copy
import warnings

import onnx
import pytest
import torch
from torch import nn
from zoo_models import PaddedEncoder, padded_tokens

from runtime import ORTModule, attention

B, T, D, H = 3, 5, 12, 3


def _mask(kind: str) -> dict:
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64)
    padding = torch.arange(T) >= torch.tensor([T, T - 2, 2]).unsqueeze(1)  # [B, T]: True past each length
    per_head = torch.randn(B * H, T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return {"none": {}, "float": {"attn_mask": causal}, "causal": {"attn_mask": causal, "is_causal": True},
            "bool": {"attn_mask": torch.rand(T, T, generator=torch.Generator().manual_seed(1)) > 0.6},
            "per-head": {"attn_mask": per_head},
            "padding": {"key_padding_mask": padding},
            "padding-float": {"key_padding_mask": torch.zeros(B, T, dtype=torch.float64).masked_fill(padding, -1e9)},
            "padding-causal": {"attn_mask": causal, "is_causal": True, "key_padding_mask": padding},
            "padding-per-head": {"attn_mask": per_head, "key_padding_mask": padding}}[kind]


def _run(m: nn.MultiheadAttention, x: torch.Tensor, lean: bool, **kw) -> tuple[torch.Tensor, ...]:
    """Output, attention weights (or None) and the gradients of x and every parameter for sum(out^2)."""
    x = x.detach().clone().requires_grad_()
    m.zero_grad()
    if lean:
        with attention.lean_attention():
            out, weights = m(x, x, x, **kw)
    else:
        out, weights = m(x, x, x, **kw)
    out.square().sum().backward()
    return out.detach(), weights, x.grad, *[p.grad for p in m.parameters()]


@pytest.mark.parametrize("mask", ["none", "float", "causal", "bool", "per-head", "padding", "padding-float",
                                  "padding-causal", "padding-per-head"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_lean_forward_computes_torchs(mask: str, bias: bool, training: bool, monkeypatch) -> None:
    """In float64 the lean forward gives torch's output and gradients (dropout 0), and it is what ran."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(D, H, bias=bias, batch_first=True).double().train(training)
    x = torch.randn(B, T, D, dtype=torch.float64)
    calls = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *a: calls.append(1) or forward(*a))
    want = _run(m, x, False, need_weights=False, **_mask(mask))
    got = _run(m, x, True, need_weights=False, **_mask(mask))
    assert calls == [1] and got[1] is None
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", ["none", "float", "per-head", "padding", "padding-float"])
@pytest.mark.parametrize("bias", [True, False])
def test_lean_cross_attention_computes_torchs(mask: str, bias: bool, monkeypatch) -> None:
    """Attention of x [B, T, d] to a memory [B, S, d] (a decoder's cross-attention, S != T) in float64: torch's
    output and the gradients of x, the memory and every parameter, from the lean forward."""
    torch.manual_seed(0)
    S = T + 2
    m = nn.MultiheadAttention(D, H, bias=bias, batch_first=True).double()
    padding = torch.arange(S) >= torch.tensor([S, S - 3, 2]).unsqueeze(1)
    kw = {"none": {}, "float": {"attn_mask": torch.randn(T, S, dtype=torch.float64)},
          "per-head": {"attn_mask": torch.randn(B * H, T, S, dtype=torch.float64)},
          "padding": {"key_padding_mask": padding},
          "padding-float": {"attn_mask": torch.randn(T, S, dtype=torch.float64), "key_padding_mask": padding}}[mask]
    calls = []
    forward = attention._forward
    monkeypatch.setattr(attention, "_forward", lambda *a: calls.append(1) or forward(*a))
    results = []
    for lean in (False, True):
        x, memory = (torch.randn(B, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
                     .requires_grad_() for n in (T, S))
        m.zero_grad()
        with attention.lean_attention() if lean else contextlib.nullcontext():
            out, weights = m(x, memory, memory, need_weights=False, **kw)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, memory.grad, *[p.grad for p in m.parameters()]))
    assert calls == [1] and weights is None
    for a, b in zip(*results):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["weights", "sequence-first", "key-not-value", "bias_kv"])
def test_other_calls_run_torchs_forward(case: str, monkeypatch) -> None:
    """Attention weights asked for, sequence-first inputs, keys and values of different tensors and extra key/value
    biases: torch's own forward runs, with its results."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(D, H, batch_first=case != "sequence-first", add_bias_kv=case == "bias_kv").double()
    x = torch.randn(B, T, D, dtype=torch.float64)
    monkeypatch.setattr(attention, "_forward", lambda *a: pytest.fail("the lean forward ran"))
    kw = {"need_weights": case == "weights"}
    if case == "key-not-value":
        y, z = torch.randn(2, B, T, D, dtype=torch.float64)
        with attention.lean_attention():
            out = m(x, y, z, **kw)[0]
        torch.testing.assert_close(out, m(x, y, z, **kw)[0])
        return
    got, want = _run(m, x, True, **kw), _run(m, x, False, **kw)
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name,shape", [("attn_mask", (T, T + 1)), ("attn_mask", (B, T, T)), ("attn_mask", (1, T, T)),
                                        ("key_padding_mask", (B, T + 1)), ("key_padding_mask", (1, T))])
def test_masks_of_other_sizes_refused_as_torch_does(name: str, shape: tuple[int, ...]) -> None:
    """A mask of sizes torch refuses is refused with torch's error."""
    m = nn.MultiheadAttention(D, H, batch_first=True)
    x = torch.randn(B, T, D)
    kind = RuntimeError if name == "attn_mask" else AssertionError
    with pytest.raises(kind) as want:
        m(x, x, x, need_weights=False, **{name: torch.zeros(shape)})
    with attention.lean_attention(), pytest.raises(kind) as got:
        m(x, x, x, need_weights=False, **{name: torch.zeros(shape)})
    assert str(got.value) == str(want.value)


def test_encoder_exports_five_activation_transposes_a_layer(tmp_path) -> None:
    """A pre-LN encoder layer on ORTModule, without warnings: the exported self-attention transposes q, k (twice:
    onnxruntime merges the two), v and the result, where torch's own forward exports 8 Transposes of activations a
    layer; torch's class is restored after the export, and two steps of gradients (causal mask) match torch's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(7)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = copy.deepcopy(encoder)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.encoder(x, mask=mask, is_causal=True).square().mean()

    reference = Model()
    ours = ORTModule(copy.deepcopy(reference), threads=1, save_onnx=tmp_path)
    original = nn.MultiheadAttention.forward
    for step in range(2):
        x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(step))
        for m in (reference, ours):
            m.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                m(x).backward()
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert nn.MultiheadAttention.forward is original
    exported = onnx.load(next(tmp_path.rglob("exported.onnx")))
    params = {i.name for i in exported.graph.input if "." in i.name}
    activations = [n for n in exported.graph.node if n.op_type == "Transpose" and n.input[0] not in params]
    assert len(activations) == 5 * 2, [n.name for n in activations]


def test_an_encoder_with_a_key_padding_mask_exports_once_for_every_length() -> None:
    """nn.TransformerEncoder over padded batches of three lengths: the lean forward takes the key padding mask,
    so one export serves every length (torch's own forward reshaped by the traced length: onnxruntime refused
    other lengths, then every length needed an export of its own), with torch's gradients."""
    torch.manual_seed(0)
    model = PaddedEncoder()
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    g = torch.Generator().manual_seed(0)
    for length in (10, 12, 9):
        batch = padded_tokens(g, length=length)
        for m in (wrapped, reference):
            m.zero_grad()
            nn.functional.cross_entropy(m(batch["tokens"], batch["padding"]), batch["labels"]).backward()
        for p, q in zip(wrapped.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert wrapped.stats == {"exports": 1, "builds": 2, "fallbacks": 0}


class PaddedDecoder(nn.Module):
    """nn.TransformerDecoder with a causal mask and padding masks on the target and on the memory."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1)
        self.out = nn.Linear(16, 20)

    def forward(self, tgt, memory, tgt_padding, memory_padding):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.decoder(self.embed(tgt), memory, tgt_mask=causal, tgt_key_padding_mask=tgt_padding,
                                     memory_key_padding_mask=memory_padding))


def test_a_decoder_with_padding_masks_exports_once_for_every_length() -> None:
    """Its self- and cross-attention both take the lean forward: one export for target and memory lengths of
    (6, 5), (8, 7) and (6, 5) again, with torch's gradients."""
    torch.manual_seed(0)
    model = PaddedDecoder()
    reference, wrapped = copy.deepcopy(model), ORTModule(model)
    g = torch.Generator().manual_seed(0)
    for t, s in ((6, 5), (8, 7), (6, 5)):
        tgt_padding = torch.arange(t) >= torch.tensor([t, t - 2]).unsqueeze(1)
        memory_padding = torch.arange(s) >= torch.tensor([s - 1, s]).unsqueeze(1)
        batch = (torch.randint(0, 20, (2, t), generator=g), torch.randn(2, s, 16, generator=g), tgt_padding,
                 memory_padding)
        for m in (wrapped, reference):
            m.zero_grad()
            m(*batch).square().mean().backward()
        for p, q in zip(wrapped.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    assert wrapped.stats == {"exports": 1, "builds": 2, "fallbacks": 0}


class CrossAttention(nn.Module):
    """Queries attending to one tensor as keys and values, with add_bias_kv's extra key and value."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(D, H, add_bias_kv=True).double()

    def forward(self, q: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.attention(q, memory, memory)[0]


@pytest.mark.parametrize("lengths", [(T, T + 1), (T + 2, T)])
def test_extra_key_value_biases_train_as_torch(lengths: tuple[int, int]) -> None:
    """add_bias_kv with keys that are the values: the legacy export's unflatten(-1) of their packed projection
    slices its shape at bounds computed by Mod, which onnx's data propagation takes for the whole shape (a rank-4
    Reshape inferred rank 7), and the gradient build refused the export's own declared shapes. Trained through
    ORTModule, outputs and gradients are torch's, at two query lengths from one export."""
    torch.manual_seed(0)
    ref = CrossAttention()
    om = ORTModule(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    for length in lengths:
        q, memory = (torch.randn(n, B, D, generator=g, dtype=torch.float64) for n in (length, T))
        got, want = om(q, memory), ref(q, memory)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, a), b in zip(om.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert om.stats["exports"] == 1 and om.stats["fallbacks"] == 0, om.stats
