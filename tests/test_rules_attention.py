"""Attention (opsets 23-25), RotaryEmbedding (opset 23), ReverseSequence, Compress.

onnxruntime computes double Attention in float and has no double RotaryEmbedding: those run in float32 against
float64 torch references of the ONNX formulas (torch's SDPA aligns causal masks the same way without a past,
but cannot take a mask and is_causal together).
"""

import io
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import Trainer, check_op, single_op_model

import gradbuilder
from gradbuilder.errors import RuleError

rng = np.random.default_rng(0)


def r64(*shape):
    return np.asarray(rng.standard_normal(shape))


def f32(*shape):
    return r64(*shape).astype(np.float32)


# --- Attention -------------------------------------------------------------------------------------------
def attention_ref(causal=False, scale=None, softcap=0.0, heads=None):
    """The ONNX Attention formula; `heads` = (q_num_heads, kv_num_heads) for 3-D inputs."""
    def fn(q, k, v, mask=None, past_k=None, past_v=None):
        three = q.dim() == 3
        if three:
            hq, hkv = heads
            q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2)
                       for t, h in ((q, hq), (k, hkv), (v, hkv)))
        past = 0
        if past_k is not None:
            past = past_k.shape[2]
            k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        present = (k, v)
        group = q.shape[1] // k.shape[1]
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = q @ kr.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        rows, cols = s.shape[-2:]
        if causal:
            s = s.masked_fill(torch.arange(cols)[None, :] > torch.arange(rows)[:, None] + past, -math.inf)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
        p = torch.softmax(s, -1)
        y = torch.where(torch.isnan(p), torch.zeros_like(p), p) @ vr
        if three:
            y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
        return (y, *present) if past_k is not None else y
    return fn


def qkv(b=2, hq=4, hkv=2, sq=5, skv=6, d=8, dv=8):
    return [("q", f32(b, hq, sq, d)), ("k", f32(b, hkv, skv, d)), ("v", f32(b, hkv, skv, dv))]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("sq,skv,dv", [(5, 6, 8), (4, 4, 3), (1, 7, 5)])
def test_attention_heads(hq, hkv, sq, skv, dv):
    check_op("Attention", qkv(hq=hq, hkv=hkv, sq=sq, skv=skv, dv=dv), attention_ref(), opset=23)


@pytest.mark.parametrize("sq,skv", [(5, 5), (5, 7), (6, 4)])
def test_attention_causal(sq, skv):
    check_op("Attention", qkv(sq=sq, skv=skv), attention_ref(causal=True), opset=23, is_causal=1)


@pytest.mark.parametrize("causal,left,right,nonpad", [(1, -1, -1, [4, 6]), (0, 1, 2, None), (1, 2, -1, None),
                                                      (1, 1, -1, [2, 6]), (0, -1, -1, [2, 5]), (0, 0, 1, [5, 3])])
def test_attention_window_and_padded_keys(causal, left, right, nonpad):
    """Opset 24's valid keys per sample (`nonpad_kv_seqlen`, which also shifts the causal frontier by the keys
    before the queries) and opset 25's sliding window, against the formula with the mask they define written
    out (a first query with no valid key at all gets a zero row)."""
    b, sq, skv = 2, 3, 6
    offset = np.array(nonpad) - sq if nonpad else np.zeros(b, int)
    pos = np.arange(sq)[None, :, None] + offset[:, None, None]  # [B, Sq, 1]
    keys = np.arange(skv)
    allowed = np.ones((b, sq, skv), bool)
    if causal:
        allowed &= keys <= pos
    if left >= 0:
        allowed &= keys >= pos - left
    if right >= 0:
        allowed &= keys <= pos + right
    if nonpad:
        allowed &= keys < np.array(nonpad)[:, None, None]
    inputs = [*qkv(b=b, sq=sq, skv=skv), ("attn_mask", None), ("past_key", None), ("past_value", None)]
    if nonpad:
        inputs.append(("nonpad", np.array(nonpad, np.int64)))
    window = {"left_window_size": left, "right_window_size": right} if max(left, right) >= 0 else {}
    check_op("Attention", inputs,
             lambda q, k, v, *_: attention_ref()(q, k, v, torch.as_tensor(allowed[:, None])),
             consts=["nonpad"], opset=25 if window else 24, is_causal=causal, **window)


def test_attention_causal_like_torch_sdpa():
    check_op("Attention", qkv(hq=4, hkv=2, sq=5, skv=7),
             lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), opset=23,
             is_causal=1)


@pytest.mark.parametrize("shape", [(5, 6), (2, 1, 5, 6), (2, 4, 5, 6), (1, 1, 5, 6)])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_bool_mask(shape, causal):
    mask = rng.random(shape) > 0.3
    if len(shape) > 2 or shape[0] > 1:
        mask[..., 2, :] = False  # a fully masked query row: zeros out, zero gradient
    check_op("Attention", [*qkv(), ("mask", mask)], attention_ref(causal=bool(causal)), opset=23, is_causal=causal)


@pytest.mark.parametrize("shape", [(5, 6), (2, 1, 5, 6), (2, 4, 5, 6), (1, 4, 5, 6)])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_float_mask(shape, causal):
    """The mask is added to the scores: it gets their gradient, summed over the axes it broadcast along."""
    check_op("Attention", [*qkv(), ("mask", f32(*shape))], attention_ref(causal=bool(causal)), opset=23,
             is_causal=causal)


def test_attention_scale_and_softcap():
    check_op("Attention", qkv(), attention_ref(scale=0.3), opset=23, scale=0.3)
    check_op("Attention", [*qkv(), ("mask", f32(5, 6))], attention_ref(scale=0.9, softcap=1.5), opset=23,
             scale=0.9, softcap=1.5)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3)])
def test_attention_3d_inputs(hq, hkv):
    inputs = [("q", f32(2, 5, hq * 8)), ("k", f32(2, 6, hkv * 8)), ("v", f32(2, 6, hkv * 3)),
              ("mask", rng.random((5, 6)) > 0.2)]
    check_op("Attention", inputs, attention_ref(heads=(hq, hkv)), opset=23, q_num_heads=hq, kv_num_heads=hkv)


@pytest.mark.parametrize("three_d", [False, True])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_past_and_present(three_d, causal):
    """present_key/value (past ++ new) are outputs too: their gradients reach past and the new K/V."""
    if three_d:
        inputs = [("q", f32(2, 5, 32)), ("k", f32(2, 5, 16)), ("v", f32(2, 5, 6))]
        attrs = dict(q_num_heads=4, kv_num_heads=2)
    else:
        inputs, attrs = qkv(sq=5, skv=5, dv=3), {}
    inputs += [("mask", None), ("past_k", f32(2, 2, 3, 8)), ("past_v", f32(2, 2, 3, 3))]
    check_op("Attention", inputs, attention_ref(causal=bool(causal), heads=(4, 2)), n_out=3, opset=23,
             is_causal=causal, **attrs)
    check_op("Attention", inputs, attention_ref(causal=bool(causal), heads=(4, 2)), n_out=3, diff_outputs=[0],
             opset=23, is_causal=causal, **attrs)
    for outs in ([1, 2], [1]):
        check_op("Attention", inputs, attention_ref(causal=bool(causal), heads=(4, 2)), n_out=3, diff_outputs=outs,
                 opset=23, is_causal=causal, **attrs)


def test_attention_symbolic_dims():
    check_op("Attention", [*qkv(), ("mask", f32(5, 6))], attention_ref(causal=True), opset=23, is_causal=1,
             symbolic={"q": [0, 2, 3], "k": [0, 2, 3], "v": [0, 2, 3], "mask": [0, 1]}, out_ranks={"y0": 4})


def test_attention_only_query_needed():
    """K and V frozen: no dK/dV MatMuls are built."""
    model = single_op_model("Attention", qkv(), opset=23)
    training = gradbuilder.build_gradient_graph(model, wrt=["q"], outputs=["y0"])
    assert [n.op_type for n in training.graph.node].count("MatMul") == 3  # the scores again, dP, dQ
    check_op("Attention", qkv(), attention_ref(), opset=23, wrt=["q"])


def test_attention_float16():
    inputs = [(n, v.astype(np.float16)) for n, v in qkv()]
    check_op("Attention", inputs, attention_ref(causal=True), opset=23, is_causal=1, fd=False, rtol=3e-2, atol=3e-2)


def test_attention_head_counts_must_be_static():
    model = single_op_model("Attention", qkv(), opset=23, symbolic={"q": [1]}, out_ranks={"y0": 4})
    with pytest.raises(RuleError, match="head counts"):
        gradbuilder.build_gradient_graph(model, wrt=["q"], outputs=["y0"])


class SDPA(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


@pytest.mark.parametrize("kw,mask", [(dict(is_causal=True, enable_gqa=True), None),
                                     (dict(enable_gqa=True, scale=0.3), "float"), (dict(), "bool")])
def test_attention_exported_by_dynamo(kw, mask):
    """torch 2.13's dynamo exporter at opset 23 maps scaled_dot_product_attention to one Attention node."""
    torch.manual_seed(0)
    hkv = 2 if kw.get("enable_gqa") else 4
    args = [torch.randn(2, 4, 5, 8), torch.randn(2, hkv, 6, 8), torch.randn(2, hkv, 6, 8)]
    if mask == "float":
        args.append(torch.randn(5, 6))
    elif mask == "bool":
        args.append(torch.rand(2, 1, 5, 6) > 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with io.StringIO():
            model = torch.onnx.export(SDPA(**kw), tuple(args), dynamo=True, optimize=False, opset_version=23,
                                      verbose=False).model_proto
    assert [n.op_type for n in model.graph.node] == ["Attention"]
    names = [i.name for i in model.graph.input]
    wrt = [n for n, a in zip(names, args) if a.dtype != torch.bool]
    training = gradbuilder.build_gradient_graph(model, wrt=wrt, outputs=[model.graph.output[0].name])
    trainer = Trainer(training)
    targs = [a.clone().requires_grad_(a.dtype != torch.bool) for a in args]
    ty = SDPA(**kw)(*targs)
    cot = torch.randn(ty.shape)
    ty.backward(cot)
    (y,), grads = trainer.step({n: a.numpy() for n, a in zip(names, args)}, [cot.numpy()])
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-5)
    for n, a in zip(names, targs):
        if a.dtype != torch.bool:
            np.testing.assert_allclose(grads[n], a.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=n)


# --- RotaryEmbedding -------------------------------------------------------------------------------------
def rope_ref(interleaved=0, rotary_dim=0, num_heads=0):
    """The ONNX reference algorithm of RotaryEmbedding, in torch."""
    def fn(x, cos, sin, pos=None):
        shape = x.shape
        t = x.transpose(1, 2) if x.dim() == 4 else x.reshape(shape[0], shape[1], num_heads, -1)
        rd = rotary_dim or t.shape[-1]
        rot, rest = t[..., :rd], t[..., rd:]
        if pos is not None:
            cos, sin = cos[pos], sin[pos]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else rot.chunk(2, -1)
        real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
        rot = torch.stack([real, imag], -1).reshape(rot.shape) if interleaved else torch.cat([real, imag], -1)
        out = torch.cat([rot, rest], -1)
        return out.reshape(shape) if x.dim() == 3 else out.transpose(1, 2)
    return fn


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("three_d", [False, True])
def test_rotary_embedding(interleaved, rotary_dim, with_positions, three_d):
    b, h, s, d = 2, 3, 5, 8
    half = (rotary_dim or d) // 2
    x = f32(b, s, h * d) if three_d else f32(b, h, s, d)
    if with_positions:
        caches = [("cos", f32(9, half)), ("sin", f32(9, half)), ("pos", rng.integers(0, 9, (b, s)))]
    else:
        caches = [("cos", f32(b, s, half)), ("sin", f32(b, s, half))]
    attrs = dict(interleaved=interleaved)
    if rotary_dim:
        attrs["rotary_embedding_dim"] = rotary_dim
    if three_d:
        attrs["num_heads"] = h
    check_op("RotaryEmbedding", [("x", x), *caches], rope_ref(interleaved, rotary_dim, h), opset=23, **attrs)


def test_rotary_embedding_repeated_positions_and_frozen_caches():
    """Positions read twice add up in the cache gradient; frozen caches cost only the inverse rotation."""
    pos = np.array([[0, 1, 1, 3], [3, 3, 0, 2]])
    inputs = [("x", f32(2, 2, 4, 6)), ("cos", f32(5, 3)), ("sin", f32(5, 3)), ("pos", pos)]
    check_op("RotaryEmbedding", inputs, rope_ref(), opset=23)
    model = single_op_model("RotaryEmbedding", inputs, opset=23)
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    assert [n.op_type for n in training.graph.node].count("RotaryEmbedding") == 2
    check_op("RotaryEmbedding", inputs, rope_ref(), opset=23, wrt=["x"])


def test_rotary_embedding_symbolic():
    check_op("RotaryEmbedding", [("x", f32(2, 3, 5, 8)), ("cos", f32(7, 4)), ("sin", f32(7, 4)),
                                 ("pos", rng.integers(0, 7, (2, 5)))], rope_ref(), opset=23,
             symbolic={"x": [0, 2], "pos": [0, 1], "cos": [0], "sin": [0]})


# --- ReverseSequence, Compress ----------------------------------------------------------------------------
def reverse_ref(lens, batch_axis, time_axis):
    def fn(x):
        parts = []
        for bi, n in enumerate(lens):
            xb = x.select(batch_axis, bi)
            t = time_axis - (time_axis > batch_axis)
            idx = torch.cat([torch.arange(n - 1, -1, -1), torch.arange(n, xb.shape[t])])
            parts.append(xb.index_select(t, idx))
        return torch.stack(parts, batch_axis)
    return fn


@pytest.mark.parametrize("batch_axis,time_axis,shape", [(1, 0, (5, 3, 2)), (0, 1, (3, 5, 2, 2))])
def test_reverse_sequence(batch_axis, time_axis, shape):
    lens = np.array([1, 5, 3], np.int64)
    check_op("ReverseSequence", [("x", r64(*shape)), ("lens", lens)], reverse_ref(lens, batch_axis, time_axis),
             consts=["lens"], batch_axis=batch_axis, time_axis=time_axis)


def test_reverse_sequence_run_time_lengths():
    lens = np.array([4, 2, 5], np.int64)
    check_op("ReverseSequence", [("x", r64(5, 3, 2)), ("lens", lens)],
             lambda x, _: reverse_ref(lens, 1, 0)(x), symbolic={"x": [0, 1]})


@pytest.mark.parametrize("axis,cond", [(1, [1, 0, 1]), (0, [0, 1, 1, 0]), (-1, [1, 1, 0, 0, 1]), (2, [0, 1]),
                                       (None, [1, 0, 0, 1, 1, 0, 1]), (1, [0, 0, 0])])
def test_compress(axis, cond):
    cond = np.array(cond, bool)
    x = r64(4, 3, 5)

    def ref(t, c):
        idx = torch.nonzero(c).reshape(-1)
        return t.reshape(-1)[idx] if axis is None else t.index_select(axis % 3, idx)
    attrs = {} if axis is None else {"axis": axis}
    check_op("Compress", [("x", x), ("cond", cond)], ref, **attrs)


def test_compress_symbolic():
    cond = np.array([1, 0, 1, 1], bool)
    check_op("Compress", [("x", r64(4, 3)), ("cond", cond)],
             lambda t, c: t.index_select(0, torch.nonzero(c).reshape(-1)), axis=0,
             symbolic={"x": [0, 1], "cond": [0]})
    check_op("Compress", [("x", r64(4, 3)), ("cond", cond)], lambda t, c: t.reshape(-1)[torch.nonzero(c)[:, 0]],
             symbolic={"x": [0, 1], "cond": [0]}, out_ranks={"y0": 1})
