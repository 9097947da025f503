"""Packed sequences (`pack_padded_sequence` into nn.LSTM, nn.GRU or nn.RNN) written in ops both exporters export.

torch packs variable-length sequences so that its recurrent layers stop at each sequence's end: the outputs past
it are zeros, and the last hidden state is the one at the sequence's own last step (for the reverse direction, the
sequence is read from its own last step). Neither exporter can export that: the legacy one fails inside
`pack_padded_sequence` unless a `pad_packed_sequence` follows the layer at once (no use of its last hidden state),
and torch.export refuses the packed data's size, which depends on the lengths' values.

While the runtime exports, `exportable_packing` keeps the padded tensor instead (time first, in the packed batch
order) and computes each layer's steps with a mask of the steps inside each sequence: a step past a sequence's end
keeps its state and outputs zeros. The input's product with the weights runs once over every step; the recurrence
is unrolled over the padded length T, so an export serves one T (torch.export specializes it; the legacy exporter's
trace is compared at other sizes). `pad_packed_sequence` then returns the longest sequence's steps, or
`total_length`, as torch's does. The packed `batch_sizes` are torch's (the sequences still running at each step),
computed from the lengths; the packed `data` is the padded tensor, so a forward that computes with `.data` itself
(a loss over the packed elements) gets other values, which the export check refuses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from .patching import replaced

_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
"""id(batch_sizes) -> (batch_sizes, lengths) of the packs made during the current export (kept alive with it)."""


def _lengths(packed: Any) -> torch.Tensor | None:
    """The sorted lengths of a pack made by `_pack`, else None."""
    if not isinstance(packed, PackedSequence):
        return None
    hit = _PACKED.get(id(packed.batch_sizes))
    return hit[1] if hit is not None and hit[0] is packed.batch_sizes else None


def _pack_padded(x: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded input time first, and torch's batch sizes (the sequences longer than each step, up to the longest)."""
    data = x.transpose(0, 1) if batch_first else x
    longest: Any = lengths.max()  # traced by the legacy exporter as the run-time value
    if not torch.jit.is_tracing():  # torch.export: a size of its own, at most the padded steps (a constant: the
        longest = longest.item()     # layers' steps are unrolled), which pad_packed_sequence's checks then rely on
        torch._check_is_size(longest)
        torch._check(longest <= int(data.shape[0]))
    steps = torch.arange(longest, device=lengths.device)
    batch_sizes = (lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(1)
    _PACKED[id(batch_sizes)] = (batch_sizes, lengths)
    return data, batch_sizes


def _pad(original: Callable[..., Any]) -> Callable[..., Any]:
    def pad_packed(data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
                   total_length: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The steps up to the longest sequence (`batch_sizes`' length) or `total_length`, padding_value past each
        sequence's end."""
        hit = _PACKED.get(id(batch_sizes))
        if hit is None or hit[0] is not batch_sizes:
            return original(data, batch_sizes, batch_first, padding_value, total_length)
        lengths = hit[1]
        # up to total_length, or the longest sequence (a run-time size): steps past the padded ones repeat its last,
        # which the mask then pads (every sequence ends within the padded steps)
        steps = torch.arange(total_length, device=data.device).clamp(max=data.shape[0] - 1)
        data = data.index_select(0, steps)
        inside = _inside(lengths, data.shape[0], data.dim(), data.device)
        out = torch.where(inside, data, torch.full((), padding_value, dtype=data.dtype, device=data.device))
        return (out.transpose(0, 1) if batch_first else out), lengths

    return pad_packed


def _inside(lengths: torch.Tensor, steps: int, rank: int, device: torch.device) -> torch.Tensor:
    """[T, B, 1, ...] bool: the step lies inside its sequence."""
    mask = torch.arange(steps, device=device).unsqueeze(1) < lengths.to(device).unsqueeze(0)
    return mask.reshape(*mask.shape, *([1] * (rank - 2)))


def _cell(mode: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One step of the recurrence: (projected input, state, weights) -> new state, torch's gate order."""

    def lstm(xw: torch.Tensor, state: tuple[torch.Tensor, ...], w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        h, c = state
        i, f, g, o = _recurrent(xw, h, w).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h if "hr" not in w else h @ w["hr"].t()), c

    def gru(xw: torch.Tensor, state: tuple[torch.Tensor, ...], w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        (h,) = state
        xr, xz, xn = xw.chunk(3, -1)
        hr, hz, hn = _recurrent(None, h, w).chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return ((1 - z) * n + z * h,)

    def rnn(xw: torch.Tensor, state: tuple[torch.Tensor, ...], w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        pre = _recurrent(xw, state[0], w)
        return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre),)

    return {"LSTM": lstm, "GRU": gru}.get(mode, rnn)


def _recurrent(xw: torch.Tensor | None, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """xw + h W_hh^T + b_hh (without xw: GRU's n gate multiplies the recurrent part alone)."""
    out = h @ w["hh"].t()
    if "b_hh" in w:
        out = out + w["b_hh"]
    return out if xw is None else xw + out


def _direction(cell: Callable[..., tuple[torch.Tensor, ...]], x: torch.Tensor, inside: torch.Tensor,
               state: tuple[torch.Tensor, ...], w: dict[str, torch.Tensor], reverse: bool
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One direction of one layer over [T, B, F]: outputs [T, B, H] (zeros past each end) and the final state, each
    sequence's state at its own last step (the reverse direction starts there)."""
    xw = x @ w["ih"].t()
    if "b_ih" in w:
        xw = xw + w["b_ih"]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    outs: list[torch.Tensor] = []
    order = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    for t in order:
        new = cell(xw[t], state, w)
        state = tuple(torch.where(inside[t], n, s) for n, s in zip(new, state))
        outs.append(torch.where(inside[t], new[0], zero))
    if reverse:
        outs.reverse()
    return torch.stack(outs), state


def _weights(module: nn.RNNBase, layer: int, suffix: str) -> dict[str, torch.Tensor]:
    named = dict(zip(module._flat_weights_names, module._flat_weights))
    w = {"ih": named[f"weight_ih_l{layer}{suffix}"], "hh": named[f"weight_hh_l{layer}{suffix}"]}
    if module.bias:
        w["b_ih"], w["b_hh"] = named[f"bias_ih_l{layer}{suffix}"], named[f"bias_hh_l{layer}{suffix}"]
    if getattr(module, "proj_size", 0):
        w["hr"] = named[f"weight_hr_l{layer}{suffix}"]
    return w


def _packed_forward(module: nn.RNNBase, packed: PackedSequence, lengths: torch.Tensor, hx: Any) -> tuple[Any, Any]:
    """torch's forward of the layer on a pack, on the padded steps with masks (module docstring)."""
    module._update_flat_weights()
    x = packed.data
    lstm = module.mode == "LSTM"
    dirs = 2 if module.bidirectional else 1
    batch = x.shape[1]
    if hx is None:
        size = module.proj_size if lstm and module.proj_size else module.hidden_size
        h0 = torch.zeros(module.num_layers * dirs, batch, size, dtype=x.dtype, device=x.device)
        hx = (h0, torch.zeros(module.num_layers * dirs, batch, module.hidden_size, dtype=x.dtype,
                              device=x.device)) if lstm else h0
    else:
        hx = module.permute_hidden(hx, packed.sorted_indices)
    states = hx if lstm else (hx,)
    inside = _inside(lengths, x.shape[0], 3, x.device)
    cell = _cell(module.mode)
    finals: list[tuple[torch.Tensor, ...]] = []
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, final = _direction(cell, x, inside, tuple(s[k] for s in states),
                                    _weights(module, layer, "_reverse" if d else ""), reverse=bool(d))
            outs.append(out)
            finals.append(final)
        x = torch.cat(outs, -1) if dirs > 1 else outs[0]
        if module.dropout and module.training and layer < module.num_layers - 1:
            x = F.dropout(x, module.dropout, training=True)
    hidden = tuple(torch.stack([f[i] for f in finals]) for i in range(len(states)))
    out = PackedSequence(x, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return out, module.permute_hidden(hidden if lstm else hidden[0], packed.unsorted_indices)


def _forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.RNNBase, input: Any, hx: Any = None) -> Any:
        lengths = _lengths(input)
        if lengths is None:
            return original(self, input, hx)
        return _packed_forward(self, input, lengths, hx)

    return forward


@contextlib.contextmanager
def exportable_packing() -> Iterator[None]:
    """Packing, unpacking and the recurrent layers' forwards replaced for the duration (the export, under its lock)."""
    vf = torch._VF
    try:
        with replaced([(vf, "_pack_padded_sequence", _pack_padded),
                       (vf, "_pad_packed_sequence", _pad(vf._pad_packed_sequence)),
                       *((cls, "forward", _forward(vars(cls)["forward"])) for cls in (nn.LSTM, nn.GRU, nn.RNN))]):
            yield
    finally:
        _PACKED.clear()
