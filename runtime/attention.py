"""nn.MultiheadAttention exported with 5 Transposes of activations a layer instead of 8.

torch's `nn.MultiheadAttention.forward` (batch first) transposes its input to [T, B, d], projects q, k and v in
one product, then `F.multi_head_attention_forward` unflattens, unsqueezes, transposes (5-D) and squeezes the
packed result, gathers q, k and v from it, transposes each to [B*H, T, dh], and after attention transposes the
result twice more on its way back to [B, T, d]. Eager torch makes most of those views; an ONNX export makes
each a copy (of a [B, T, d] tensor, or three of them), in the forward and again in the backward.

While the runtime exports, `lean_attention` has the self-attention that `nn.TransformerEncoderLayer` and
decoder-style models run, and `nn.TransformerDecoderLayer`'s attention to its memory (batch first, packed
projection weights, a key padding mask or none, no attention weights returned) computed the way it is defined
instead: one product by the packed weight (two for attention to a memory: q, then k and v), split into q, k and
v, each viewed as [B, T, H, dh] and transposed once to [B, H, T, dh] for `scaled_dot_product_attention` (whose
export transposes k once more; onnxruntime merges the two), and the result transposed once back. The views take
their sizes from the inputs, so the export's shape arithmetic folds and one export serves every length (torch's own
forward with a key padding mask, or to a memory, reshapes by the lengths it was traced at). Same values, masks,
dropout and causal flag as torch's forward; every other call runs torch's own forward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F


@contextlib.contextmanager
def lean_attention(torch_layout: bool = False) -> Iterator[None]:
    """`nn.MultiheadAttention.forward` replaced by `_forward` for the duration (the export, under its lock);
    `torch_layout`: its result stored as torch's is (`_forward`)."""
    original = nn.MultiheadAttention.forward

    def forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _lean(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
            return _forward(self, query, key, attn_mask, is_causal, key_padding_mask, torch_layout), None
        return original(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                        is_causal)

    nn.MultiheadAttention.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.MultiheadAttention.forward = original  # type: ignore[method-assign]


def _lean(m: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          key_padding_mask: torch.Tensor | None, need_weights: bool, attn_mask: torch.Tensor | None,
          is_causal: bool) -> bool:
    """Whether `_forward` computes this call: batched self-attention or attention to one memory (key is value, a
    decoder's cross-attention), batch first, packed projections without extra key/value biases, no weights
    returned, a key padding mask of [B, S] or none, a mask of [T, S] or [B*H, T, S] (their sizes are checked in
    `_forward`, as torch checks them) and one given with the causal flag, as torch requires."""
    if not (m.batch_first and m._qkv_same_embed_dim and m.in_proj_weight is not None and m.bias_k is None
            and m.bias_v is None and not m.add_zero_attn and not need_weights
            and query.dim() == 3 and key.dim() == 3 and key is value
            and (key_padding_mask is None or key_padding_mask.dim() == 2)):
        return False
    return attn_mask is not None if is_causal else attn_mask is None or attn_mask.dim() in (2, 3)


def _forward(m: nn.MultiheadAttention, x: torch.Tensor, memory: torch.Tensor, attn_mask: torch.Tensor | None,
             is_causal: bool, key_padding_mask: torch.Tensor | None = None, torch_layout: bool = False
             ) -> torch.Tensor:
    """Attention of x [B, T, d] to itself or to a memory [B, S, d] as `F.multi_head_attention_forward` computes it
    for these calls, with one transpose each for q, k, v and the result: self-attention projects q, k and v in one
    product, cross-attention q alone and k, v from the memory in another, as torch does. A key padding mask is
    added to the mask as [B, 1, 1, S] (torch expands it to every head first: the same sums, broadcast).
    `torch_layout`: the result stored time-major, as torch's is (a transposed view of its [T, B, d] product), where
    a dropout reading it must draw its mask in that order to draw torch's (`dropouts._drawn_in_memory_order`)."""
    heads, width, d = m.num_heads, m.head_dim, m.embed_dim
    batch, length, _ = x.shape
    if memory is x:
        packed = F.linear(x, m.in_proj_weight, m.in_proj_bias)  # [B, T, 3d]: one product
        q, k, v = (t.view(batch, length, heads, width).transpose(1, 2) for t in packed.split(d, dim=-1))
        span = length
    else:
        bias = m.in_proj_bias
        span = memory.shape[1]
        q = F.linear(x, m.in_proj_weight[:d], None if bias is None else bias[:d])
        kv = F.linear(memory, m.in_proj_weight[d:], None if bias is None else bias[d:])  # [B, S, 2d]
        q = q.view(batch, length, heads, width).transpose(1, 2)
        k, v = (t.view(batch, span, heads, width).transpose(1, 2) for t in kv.split(d, dim=-1))
    padding = None
    if key_padding_mask is not None:
        padding = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                    other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                    target_type=x.dtype)
        _check_mask(padding, (batch, span), "key_padding_mask")
        padding = padding.view(batch, 1, 1, span)
        is_causal = False  # torch's rule: the merged mask is no longer causal; the mask given with the flag serves
    if is_causal:  # torch's rule without a key padding mask or weights: the causal flag stands for the mask
        mask = None
    else:
        mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                 target_type=x.dtype, check_other=False)
        if mask is not None:
            _check_mask(mask, (length, span) if mask.dim() == 2 else (batch * heads, length, span))
            if mask.dim() == 3:  # one for every sample and head
                mask = mask.view(batch, heads, length, span)
        if padding is not None:
            mask = padding if mask is None else mask + padding
    out = F.scaled_dot_product_attention(q, k, v, mask, m.dropout if m.training else 0.0, is_causal)
    if torch_layout:
        out = F.linear(out.permute(2, 0, 1, 3).reshape(length, batch, d), m.out_proj.weight, m.out_proj.bias)
        return out.transpose(0, 1)
    return F.linear(out.transpose(1, 2).reshape(batch, length, d), m.out_proj.weight, m.out_proj.bias)


def _check_mask(mask: torch.Tensor, want: tuple, name: str = "attn_mask") -> None:
    """torch's own error (`F.multi_head_attention_forward`'s) for a mask of other sizes. While tracing, sizes
    compare as traced values and the result is baked into the export, as it is for torch's own checks; the
    tracer's warning about it is for the caller's code, so it is silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        if mask.shape != want:
            if name != "attn_mask":  # torch asserts this one, dim by dim
                dim = next(i for i, (n, w) in enumerate(zip(mask.shape, want)) if n != w)
                raise AssertionError(f"Expected key_padded_mask.shape[{dim}] to be {want[dim]}, but got "
                                     f"{mask.shape[dim]}")
            raise RuntimeError(f"The shape of the {mask.dim()}D attn_mask is {mask.shape}, but should be {want}.")
