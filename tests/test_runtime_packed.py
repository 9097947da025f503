"""Recurrent layers through ORTModule's export-time rewrites (runtime/packed.py): packed sequences, double, LSTM
projections and dropout between stacked layers, against torch's outputs, last states and gradients."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from runtime import ORTModule

SLOW = [pytest.mark.slow,
        pytest.mark.skipif(os.environ.get("GRADBUILDER_SLOW") != "1", reason="dynamo export; set GRADBUILDER_SLOW=1")]

LAYERS: dict[str, Callable[[], nn.RNNBase]] = {
    "lstm-2-layers-bidirectional": lambda: nn.LSTM(5, 7, num_layers=2, bidirectional=True, batch_first=True),
    "lstm-projected": lambda: nn.LSTM(5, 7, proj_size=3, batch_first=True),
    "gru-bidirectional": lambda: nn.GRU(5, 7, bidirectional=True, batch_first=True),
    "rnn-relu-2-layers-no-bias": lambda: nn.RNN(5, 7, num_layers=2, nonlinearity="relu", bias=False,
                                                batch_first=True),
}


class Packed(nn.Module):
    """A recurrent layer on a pack: its padded outputs (`pad_packed_sequence`) and its last states, from a learned
    initial state or from zeros."""

    def __init__(self, layer: nn.RNNBase, initial: bool, enforce_sorted: bool, total_length: int | None):
        super().__init__()
        self.layer = layer
        self.enforce_sorted = enforce_sorted
        self.total_length = total_length
        dirs = 2 if layer.bidirectional else 1
        size = getattr(layer, "proj_size", 0) or layer.hidden_size
        self.h0 = nn.Parameter(torch.randn(layer.num_layers * dirs, 1, size) * 0.5) if initial else None
        self.c0 = nn.Parameter(torch.randn(layer.num_layers * dirs, 1, layer.hidden_size) * 0.5) \
            if initial and isinstance(layer, nn.LSTM) else None

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=self.enforce_sorted)
        hx = None
        if self.h0 is not None:
            h0 = self.h0.expand(-1, x.shape[0], -1).contiguous()
            hx = (h0, self.c0.expand(-1, x.shape[0], -1).contiguous()) if self.c0 is not None else h0
        out, last = self.layer(packed, hx)
        padded, out_lengths = pad_packed_sequence(out, batch_first=True, padding_value=-0.5,
                                                  total_length=self.total_length)
        return padded, *(last if isinstance(last, tuple) else (last,)), out_lengths


def _calls(gen: torch.Generator, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 4 sequences padded to 6 steps, lengths in any order, one of length 1, in the second the longest
    shorter than the padding (outputs then stop there); then a batch padded to 8 steps."""
    calls = []
    for lengths, steps in (([3, 6, 1, 4], 6), ([2, 5, 5, 1], 6), ([8, 2, 7, 3], 8)):
        x = torch.randn(4, steps, 5, generator=gen, dtype=dtype)
        calls.append((x, torch.tensor(lengths)))
    return calls


def _sorted(calls: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches sorted longest first (what enforce_sorted=True asks for)."""
    out = []
    for x, lengths in calls:
        order = torch.argsort(lengths, descending=True, stable=True)
        out.append((x[order], lengths[order]))
    return out


def _step(model: nn.Module, x: torch.Tensor, lengths: torch.Tensor, weights: torch.Generator
          ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs, and the gradients of a random weighting of them with respect to x and the parameters."""
    x = x.clone().requires_grad_(True)
    outs = model(x, lengths)
    loss = sum((o * torch.randn(o.shape, generator=weights, dtype=o.dtype)).sum()
               for o in outs if o.is_floating_point())
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return [o.detach() for o in outs], list(grads)


CASES = [("lstm-2-layers-bidirectional", True, False, None), ("lstm-projected", False, True, 10),
         ("gru-bidirectional", True, True, None), ("rnn-relu-2-layers-no-bias", False, False, None)]
"""(layer, learned initial state, enforce_sorted, total_length)"""


@pytest.mark.parametrize(("layer", "initial", "enforce_sorted", "total_length", "exporter", "dtype"), [
    *((*case, "torchscript", dtype) for case in CASES for dtype in (torch.float64, torch.float32)),
    *(pytest.param(*case, "dynamo", torch.float64, marks=() if case[0].startswith("rnn") else SLOW)
      for case in CASES)])
def test_packed_layers_match_torch(layer: str, initial: bool, enforce_sorted: bool, total_length: int | None,
                                   exporter: str, dtype: torch.dtype) -> None:
    """In float64 the steps are unrolled (onnxruntime's recurrent kernels have no double; torch.export too): an
    export for each padded length, to 1e-9 of torch. In float32 the legacy exporter writes the layer's ONNX op
    with sequence_lens (not for projections): one export for both lengths."""
    torch.manual_seed(0)
    reference = Packed(LAYERS[layer](), initial, enforce_sorted, total_length).to(dtype)
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    calls = _calls(torch.Generator().manual_seed(1), dtype)
    tight = dtype == torch.float64
    for x, lengths in _sorted(calls) if enforce_sorted else calls:
        seed = int(lengths.sum())
        got, got_grads = _step(model, x, lengths, torch.Generator().manual_seed(seed))
        want, want_grads = _step(reference, x, lengths, torch.Generator().manual_seed(seed))
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9 if tight else 2e-5, atol=1e-11 if tight else 2e-6)
    assert model.stats["fallbacks"] == 0
    as_op = not tight and exporter == "torchscript" and layer != "lstm-projected"
    assert model.stats["exports"] == (1 if as_op else 2), model.stats
    ops = {n.op_type: n for n in model.training_sessions()[0].source.graph.node}
    kind = type(reference.layer).__name__
    assert (kind in ops and ops[kind].input[4] != "") == as_op, sorted(ops)


class TimeMajor(nn.Module):
    """Time first (the layer's default): the padded length is the inputs' first axis, where the batch usually is."""

    def __init__(self):
        super().__init__()
        self.layer = nn.GRU(5, 7)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, last = self.layer(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return pad_packed_sequence(out)[0], last


@pytest.mark.parametrize(("dtype", "exports"), [(torch.float64, 3), (torch.float32, 1)])
def test_time_first_packs_follow_the_padded_length(dtype: torch.dtype, exports: int) -> None:
    """Unrolled (float64), each padded length gets its export although it is the first axis (the export says it
    unrolled, as a traced size); as the ONNX op (float32) one export serves them all."""
    torch.manual_seed(0)
    reference = TimeMajor().to(dtype)
    model = ORTModule(copy.deepcopy(reference))
    gen = torch.Generator().manual_seed(2)
    for steps, lengths in ((6, [3, 6, 1, 4]), (8, [8, 2, 7, 3]), (5, [5, 5, 2, 1])):
        x = torch.randn(steps, 4, 5, generator=gen, dtype=dtype)
        seed = steps
        got, got_grads = _step(model, x, torch.tensor(lengths), torch.Generator().manual_seed(seed))
        want, want_grads = _step(reference, x, torch.tensor(lengths), torch.Generator().manual_seed(seed))
        for g, w in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9 if dtype == torch.float64 else 2e-5,
                                       atol=1e-11 if dtype == torch.float64 else 2e-6)
    assert model.stats["exports"] == exports, model.stats


class Plain(nn.Module):
    """A recurrent layer on a padded tensor (no pack), from a learned initial state or zeros, one sequence or a
    batch."""

    def __init__(self, layer: nn.RNNBase, initial: bool):
        super().__init__()
        self.layer = layer
        dirs = 2 if layer.bidirectional else 1
        self.h0 = nn.Parameter(torch.randn(layer.num_layers * dirs, 4, layer.hidden_size)) if initial else None

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hx = self.h0 if self.h0 is None or x.dim() == 3 else self.h0[:, 0]
        if isinstance(self.layer, nn.LSTM) and hx is not None:
            hx = (hx, hx.tanh())
        out, last = self.layer(x, hx)
        return out, *(last if isinstance(last, tuple) else (last,))


@pytest.mark.parametrize(("layer", "initial", "unbatched"), [
    ("lstm-2-layers-bidirectional", True, False), ("gru-bidirectional", False, True),
    ("rnn-relu-2-layers-no-bias", True, False)])
def test_double_layers_match_torch(layer: str, initial: bool, unbatched: bool) -> None:
    """onnxruntime's recurrent kernels run float32 only: in double the layers are unrolled (an export for each
    length), to 1e-9 of torch."""
    torch.manual_seed(0)
    reference = Plain(LAYERS[layer](), initial).double()
    model = ORTModule(copy.deepcopy(reference))
    for x, lengths in _calls(torch.Generator().manual_seed(3), torch.float64):
        x = x[0] if unbatched else x
        seed = x.shape[-2]
        got, got_grads = _step(model, x, lengths, torch.Generator().manual_seed(seed))
        want, want_grads = _step(reference, x, lengths, torch.Generator().manual_seed(seed))
        for g, w in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    assert model.stats["exports"] == 2 and model.stats["fallbacks"] == 0, model.stats


@pytest.mark.parametrize("exporter", ["torchscript", pytest.param("dynamo", marks=SLOW)])
def test_projected_lstm_matches_torch(exporter: str) -> None:
    """LSTM projections (the legacy exporter refuses them, torch.export's graph failed to build) are unrolled, and
    the legacy export's warning says so (it named a packed sequence where there is none)."""
    torch.manual_seed(0)
    reference = Plain(nn.LSTM(5, 7, proj_size=3, num_layers=2, batch_first=True), False)
    model = ORTModule(copy.deepcopy(reference), exporter=exporter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, lengths in _calls(torch.Generator().manual_seed(4), torch.float32):
            seed = x.shape[1]
            got, got_grads = _step(model, x, lengths, torch.Generator().manual_seed(seed))
            want, want_grads = _step(reference, x, lengths, torch.Generator().manual_seed(seed))
            for g, w in zip(got + got_grads, want + want_grads):
                torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)
    assert model.stats["fallbacks"] == 0
    baked = [str(w.message) for w in caught if "baked a traced value" in str(w.message)]
    assert (exporter == "dynamo" or any("LSTM unrolls its" in m for m in baked)) and \
        not any("packed sequence" in m for m in baked), baked


@pytest.mark.parametrize(("layer", "unbatched"), [("lstm-2-layers-bidirectional", False),
                                                  ("rnn-relu-2-layers-no-bias", True)])
def test_stacked_layers_with_dropout_export_one_layer_at_a_time(monkeypatch, layer: str, unbatched: bool) -> None:
    """In training, dropout between stacked layers (refused by the legacy exporter) is exported as one ONNX op a
    layer with F.dropout between. With that dropout made the identity, the export computes torch's values and
    gradients for the same layers without dropout."""
    from torch.nn import functional as F

    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, inplace=False: x)
    torch.manual_seed(0)
    reference = Plain(LAYERS[layer](), True)
    model = ORTModule(copy.deepcopy(reference))
    model.module.layer.dropout = 0.5
    for x, lengths in _calls(torch.Generator().manual_seed(5), torch.float32)[:2]:
        x = x[0] if unbatched else x
        got, got_grads = _step(model, x, lengths, torch.Generator().manual_seed(6))
        want, want_grads = _step(reference, x, lengths, torch.Generator().manual_seed(6))
        for g, w in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)
    kind = type(reference.layer).__name__
    ops = [n.op_type for n in model.training_sessions()[0].source.graph.node]
    assert ops.count(kind) == 2 and model.stats["exports"] == 1, (ops, model.stats)


@pytest.mark.parametrize("packed", [True, False])
def test_stacked_layers_with_dropout_train(packed: bool) -> None:
    """torch's word-language-model layers (2 layers, dropout 0.5 between them), packed or not: the module trains
    (its dropout draws other masks than torch's kernel, so only the loss can be compared), and in eval mode it is
    torch's."""
    torch.manual_seed(0)
    if packed:
        reference: nn.Module = Packed(nn.LSTM(5, 7, num_layers=2, dropout=0.5, batch_first=True), False, False, None)
        x, lengths, target = torch.randn(4, 6, 5), torch.tensor([3, 6, 1, 4]), torch.randn(4, 6, 7)
    else:
        reference = Plain(nn.LSTM(5, 7, num_layers=2, dropout=0.5), False)
        x, lengths, target = torch.randn(6, 4, 5), None, torch.randn(6, 4, 7)
    model = ORTModule(copy.deepcopy(reference))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (model(x, lengths)[0] - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    reference.load_state_dict(model.module.state_dict())
    model.eval()
    reference.eval()
    with torch.no_grad():
        for g, w in zip(model(x, lengths), reference(x, lengths)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_packed_stacked_layers_with_dropout_are_one_op_a_layer(monkeypatch) -> None:
    """Packed, with dropout between stacked layers in training: one ONNX op a layer, each fed sequence_lens, with
    F.dropout between (made the identity here, so the values are torch's without dropout); one export serves
    both padded lengths."""
    from torch.nn import functional as F

    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, inplace=False: x)
    torch.manual_seed(0)
    reference = Packed(LAYERS["lstm-2-layers-bidirectional"](), True, False, None)
    model = ORTModule(copy.deepcopy(reference))
    model.module.layer.dropout = 0.5
    for x, lengths in _calls(torch.Generator().manual_seed(7), torch.float32):
        got, got_grads = _step(model, x, lengths, torch.Generator().manual_seed(8))
        want, want_grads = _step(reference, x, lengths, torch.Generator().manual_seed(8))
        for g, w in zip(got + got_grads, want + want_grads):
            torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6)
    lstms = [n for n in model.training_sessions()[0].source.graph.node if n.op_type == "LSTM"]
    assert len(lstms) == 2 and all(n.input[4] for n in lstms) and model.stats["exports"] == 1, model.stats
