"""Packed sequences (`pack_padded_sequence` into nn.LSTM, nn.GRU or nn.RNN) written in ops both exporters export,
and those layers in double.

torch packs variable-length sequences so that its recurrent layers stop at each sequence's end: the outputs past
it are zeros, and the last hidden state is the one at the sequence's own last step (for the reverse direction, the
sequence is read from its own last step). Neither exporter can export that: the legacy one fails inside
`pack_padded_sequence` unless a `pad_packed_sequence` follows the layer at once (no use of its last hidden state),
and torch.export refuses the packed data's size, which depends on the lengths' values.

While the runtime exports, `exportable_packing` keeps the padded tensor instead (time first, in the packed batch
order), and the layers compute on it:

- under the legacy exporter, in float32, as their ONNX op fed the lengths as sequence_lens (`_SequenceLengths`,
  torch's own symbolic for a packed call; one op a layer with F.dropout between them where dropout applies in
  training): one export for every padded length, on onnxruntime's recurrent kernels
  and the gradient rules' Scans (a bidirectional LSTM of 128 at batch 32: 12.6-12.9 ms a step against torch's
  16-18 at 20 steps, 31.5-33.4 against 47.6-51.8 at 60; 0.5-1.1 s to the first step);
- otherwise (torch.export, double, LSTM projections) with a mask of the
  steps inside each sequence, a step past a sequence's end keeping its state and giving zeros; the input's
  product with the weights runs once over every step and the recurrence is unrolled over the padded length, so
  an export serves one length (torch.export specializes it; the legacy exporter's trace is compared at other
  sizes), and steps take ~1.4x torch's (23.9 ms at 20 steps above, 3.8 s to the first step).

`pad_packed_sequence` then returns the longest sequence's steps, or `total_length`, with `padding_value` past
each end, as torch's does. The packed `batch_sizes` are torch's (the sequences still running at each step),
computed from the lengths; the packed `data` is the padded tensor, so a forward that computes with `.data` itself
(a loss over the packed elements) gets other values, which the export check refuses.

onnxruntime's LSTM, GRU and RNN kernels run float32 only, so a layer of another element type (double: gradient
checks) is unrolled the same way, without masks, packed or not; so is an LSTM with projections (`proj_size`),
which the legacy exporter refuses and torch.export mis-exports. Stacked layers with dropout between them, in
training, which the legacy exporter also refuses, are exported one layer at a time through torch's own op with an
F.dropout between.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import onnx
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence

from .patching import replaced

_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
"""id(batch_sizes) -> (batch_sizes, lengths) of the packs made during the current export (kept alive with it)."""


def _lengths(packed: Any) -> torch.Tensor | None:
    """The sorted lengths of a pack made by `_pack_padded`, else None."""
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


def _direction(cell: Callable[..., tuple[torch.Tensor, ...]], x: torch.Tensor, inside: torch.Tensor | None,
               state: tuple[torch.Tensor, ...], w: dict[str, torch.Tensor], reverse: bool
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One direction of one layer over [T, B, F]: outputs [T, B, H] (zeros past each end) and the final state, each
    sequence's state at its own last step (the reverse direction starts there); every step counts without a mask."""
    xw = x @ w["ih"].t()
    if "b_ih" in w:
        xw = xw + w["b_ih"]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    outs: list[torch.Tensor] = []
    order = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    for t in order:
        new = cell(xw[t], state, w)
        if inside is None:
            state = new
            outs.append(new[0])
        else:
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


def _layers(module: nn.RNNBase, x: torch.Tensor, lengths: torch.Tensor | None, states: tuple[torch.Tensor, ...],
            layers: range | None = None) -> tuple[torch.Tensor, ...]:
    """Every layer (of `layers`, default all) and direction over [T, B, F] with the steps past each sequence's end
    masked (none without lengths): the padded outputs (zeros there) and the final states ([layers * directions, B,
    H] each; `states` holds those layers' initial ones)."""
    layers = range(module.num_layers) if layers is None else layers
    dirs = 2 if module.bidirectional else 1
    if torch.jit.is_tracing():  # the export then follows the time axis even where it is the batch axis (time first)
        what = "on a packed sequence unrolls its padded" if lengths is not None else "unrolls its"
        warnings.warn(f"{type(module).__name__} {what} {x.shape[0]} steps", torch.jit.TracerWarning, stacklevel=2)
    inside = None if lengths is None else _inside(lengths, x.shape[0], 3, x.device)
    cell = _cell(module.mode)
    finals: list[tuple[torch.Tensor, ...]] = []
    for i, layer in enumerate(layers):
        outs = []
        for d in range(dirs):
            out, final = _direction(cell, x, inside, tuple(s[i * dirs + d] for s in states),
                                    _weights(module, layer, "_reverse" if d else ""), reverse=bool(d))
            outs.append(out)
            finals.append(final)
        x = torch.cat(outs, -1) if dirs > 1 else outs[0]
        if module.dropout and module.training and layer < layers[-1]:
            x = F.dropout(x, module.dropout, training=True)
    return x, *(torch.stack([f[i] for f in finals]) for i in range(len(states)))


class _SequenceLengths(torch.autograd.Function):
    """Under the legacy exporter, layers [first, first + count) as their ONNX op fed the lengths as sequence_lens
    (torch's own symbolic for a packed call): one graph for every padded length, on onnxruntime's recurrent kernels
    (a bidirectional LSTM tagger of 128 at batch 32, 20 steps: 12.6 ms a step against 23.9 unrolled, 0.6 s to the
    first step against 3.8). Its values while tracing are `_layers`'; it only ever runs inside an export."""

    @staticmethod
    def forward(ctx: Any, module: nn.RNNBase, first: int, count: int, x: torch.Tensor, lengths: torch.Tensor,
                n_states: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _layers(module, x, lengths, tensors[:n_states], range(first, first + count))

    @staticmethod
    def symbolic(g: Any, module: nn.RNNBase, first: int, count: int, x: Any, lengths: Any, n_states: int,
                 *tensors: Any) -> Any:
        from torch.onnx._internal.torchscript_exporter import symbolic_opset9

        states, weights = tensors[:n_states], list(tensors[n_states:])
        lens = g.op("Cast", lengths, to_i=onnx.TensorProto.INT32)
        return symbolic_opset9._generic_rnn(g, module.mode, x, list(states) if n_states > 1 else states[0], weights,
                                            module.bias, count, 0.0, module.training, module.bidirectional,
                                            batch_first=False, batch_sizes=lens)


_Group = Callable[[torch.Tensor, range, tuple[torch.Tensor, ...], list[torch.Tensor]], tuple[torch.Tensor, ...]]


def _by_groups(module: nn.RNNBase, x: torch.Tensor, states: tuple[torch.Tensor, ...], run: _Group
               ) -> tuple[torch.Tensor, ...]:
    """The stacked layers through `run` (input, layers, their initial states, their weights -> output and final
    states): all at once, or one at a time with F.dropout between them where dropout applies in training (torch's
    symbolic refuses it inside its ops)."""
    per = len(module._flat_weights) // module.num_layers
    dirs = 2 if module.bidirectional else 1
    split = bool(module.dropout and module.training)
    groups = [range(k, k + 1) for k in range(module.num_layers)] if split else [range(module.num_layers)]
    finals = []
    for group in groups:
        held = tuple(s[group.start * dirs:group.stop * dirs] for s in states)
        x, *last = run(x, group, held, module._flat_weights[group.start * per:group.stop * per])
        finals.append(last)
        if split and group.stop < module.num_layers:
            x = F.dropout(x, module.dropout, training=True)
    return x, *(torch.cat([f[i] for f in finals]) for i in range(len(states)))


def _as_onnx_ops(module: nn.RNNBase, x: torch.Tensor, lengths: torch.Tensor, states: tuple[torch.Tensor, ...]
                 ) -> tuple[torch.Tensor, ...]:
    """The layers as ONNX ops with sequence_lens (`_by_groups`)."""
    return _by_groups(module, x, states, lambda x, group, held, weights: _SequenceLengths.apply(
        module, group.start, len(group), x, lengths, len(held), *held, *weights))


def _as_onnx_op(module: nn.RNNBase, x: torch.Tensor) -> bool:
    """Whether the legacy exporter is tracing a layer its ONNX op computes: float32 (onnxruntime's recurrent
    kernels have no double) and no projections (torch's symbolic refuses them)."""
    return torch.jit.is_tracing() and x.dtype == torch.float32 and not getattr(module, "proj_size", 0)


def _initial_states(module: nn.RNNBase, x: torch.Tensor, hx: Any) -> tuple[torch.Tensor, ...]:
    """hx as a tuple of states, zeros where not given, as torch's forward makes them."""
    if hx is not None:
        return tuple(hx) if module.mode == "LSTM" else (hx,)
    dirs = 2 if module.bidirectional else 1
    size = getattr(module, "proj_size", 0) or module.hidden_size
    h0 = torch.zeros(module.num_layers * dirs, x.shape[1], size, dtype=x.dtype, device=x.device)
    if module.mode != "LSTM":
        return (h0,)
    return h0, torch.zeros(module.num_layers * dirs, x.shape[1], module.hidden_size, dtype=x.dtype, device=x.device)


def _packed_forward(module: nn.RNNBase, packed: PackedSequence, lengths: torch.Tensor, hx: Any) -> tuple[Any, Any]:
    """torch's forward of the layer on a pack, on the padded steps with masks (module docstring)."""
    module._update_flat_weights()
    x = packed.data
    states = _initial_states(module, x, None if hx is None else module.permute_hidden(hx, packed.sorted_indices))
    if _as_onnx_op(module, x):
        out, *hidden = _as_onnx_ops(module, x, lengths, states)
    else:
        out, *hidden = _layers(module, x, lengths, states)
    packed_out = PackedSequence(out, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    lstm = module.mode == "LSTM"
    return packed_out, module.permute_hidden(tuple(hidden) if lstm else hidden[0], packed.unsorted_indices)


def _as_batch(module: nn.RNNBase, x: torch.Tensor, hx: Any) -> tuple[torch.Tensor, Any, bool]:
    """One sequence gets the batch axis torch's forward gives it, and its states theirs; True for a batch."""
    if x.dim() == 3:
        return x, hx, True
    hx = None if hx is None else tuple(h.unsqueeze(1) for h in hx) if isinstance(hx, tuple) else hx.unsqueeze(1)
    return x.unsqueeze(0 if module.batch_first else 1), hx, False


def _outputs(module: nn.RNNBase, out: torch.Tensor, hidden: list[torch.Tensor], batched: bool) -> tuple[Any, Any]:
    """torch's (output, hidden), the batch axis taken away again for one sequence (select, not squeeze: the legacy
    exporter writes a squeeze of a run-time size as an If)."""
    if not batched:
        out, hidden = out.select(0 if module.batch_first else 1, 0), [h.select(1, 0) for h in hidden]
    return out, (tuple(hidden) if module.mode == "LSTM" else hidden[0])


def _unrolled_forward(module: nn.RNNBase, x: torch.Tensor, hx: Any) -> tuple[Any, Any]:
    """torch's forward of the layer on a tensor, its steps unrolled: for what onnxruntime's recurrent kernels or the
    exporters lack (element types other than float32, LSTM projections)."""
    module._update_flat_weights()
    x, hx, batched = _as_batch(module, x, hx)
    steps_first = x.transpose(0, 1) if module.batch_first else x
    out, *hidden = _layers(module, steps_first, None, _initial_states(module, steps_first, hx))
    return _outputs(module, out.transpose(0, 1) if module.batch_first else out, hidden, batched)


_OPS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def _layer_by_layer(module: nn.RNNBase, x: torch.Tensor, hx: Any) -> tuple[Any, Any]:
    """Stacked layers with dropout between them, in training, under the legacy exporter (its symbolic refuses
    "dropout in training mode"): each layer through torch's own op (one ONNX op a layer), the dropout between them
    as F.dropout (`_by_groups`)."""
    module._update_flat_weights()
    x, hx, batched = _as_batch(module, x, hx)
    states = _initial_states(module, x.transpose(0, 1) if module.batch_first else x, hx)
    op = getattr(torch._VF, _OPS[module.mode])

    def run(x: torch.Tensor, group: range, held: tuple[torch.Tensor, ...], weights: list[torch.Tensor]) -> Any:
        return op(x, list(held) if module.mode == "LSTM" else held[0], weights, module.bias, len(group), 0.0,
                  module.training, module.bidirectional, module.batch_first)

    out, *hidden = _by_groups(module, x, states, run)
    return _outputs(module, out, hidden, batched)


def _forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: nn.RNNBase, input: Any, hx: Any = None) -> Any:
        lengths = _lengths(input)
        if lengths is not None:
            return _packed_forward(self, input, lengths, hx)
        if isinstance(input, torch.Tensor):
            if input.dtype != torch.float32 or getattr(self, "proj_size", 0):
                return _unrolled_forward(self, input, hx)
            if torch.jit.is_tracing() and self.dropout and self.training and self.num_layers > 1:
                return _layer_by_layer(self, input, hx)
        return original(self, input, hx)

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
