"""Model-zoo parity (issue 4): members of the model families users train (tests/zoo_models.py) take a few
SGD steps through ORTModule next to torch eager, from the same weights on the same batches, with the
losses, gradients, parameters and buffers within 1e-4 relative (tests/parity.py).

Every case runs with the default (legacy) exporter; seven also in float64, to 1e-10 (`IN_FLOAT64`). Dynamo
exports take 4-30 s each here, so CI runs two models with it (`DYNAMO_IN_CI`) and the rest are slow
(GRADBUILDER_SLOW=1).
"""

from __future__ import annotations

import os

import pytest
import torch
from parity import check_parity, sgd
from zoo_models import CASES, Batch, dropouts_on

STEPS = 3
SLOW = [pytest.mark.slow,
        pytest.mark.skipif(os.environ.get("GRADBUILDER_SLOW") != "1", reason="dynamo export; set GRADBUILDER_SLOW=1")]
DYNAMO_IN_CI = {"hf-gpt2", "siamese"}
"""Covers what dynamo exports differently: tied weights named by their last alias, torch.split as sequences, a
BatchNorm's second call reading the running statistics through Identities (4 s)."""
KNOWN: dict[tuple[str, str], str] = {
    ("hf-deberta-v2", "dynamo"): "torch.export cannot trace its forward: it branches on a data-dependent value "
                                 "(modeling_deberta_v2.py, `u0 > 0`); the legacy exporter can",
    ("hf-mixtral", "dynamo"): "torch.export cannot trace its forward: transformers 5's experts loop over the "
                              "experts the routing hit (`nonzero()`, then `expert_idx == self.num_experts` in "
                              "modeling_mixtral.py); the legacy exporter can",
}


def run_case(name: str, exporter: str) -> None:
    case = CASES[name]
    if case.needs:
        pytest.importorskip(case.needs)
    _, _, report = check_parity(case.make, case.batches(STEPS), case.loss, sgd, exporter=exporter)
    print(f"{name} ({exporter}): {report}")


def cases(exporter: str) -> list:
    """Every case, marked xfail where a known limitation stops it (strict: a fix must update the list)."""
    params = []
    for name in CASES:
        marks = list(SLOW) if exporter == "dynamo" and name not in DYNAMO_IN_CI else []
        if (name, exporter) in KNOWN:
            marks.append(pytest.mark.xfail(reason=KNOWN[name, exporter], strict=True))
        params.append(pytest.param(name, marks=marks))
    return params


@pytest.mark.parametrize("name", cases("torchscript"))
def test_zoo_parity(name: str) -> None:
    run_case(name, "torchscript")


@pytest.mark.parametrize("name", cases("dynamo"))
def test_zoo_parity_dynamo(name: str) -> None:
    run_case(name, "dynamo")


WITH_DROPOUT = ["transformer-encoder", "transformer-seq2seq", "vit", "hf-bert", "hf-gpt2", "hf-t5", "hf-bart",
                "hf-llama"]
"""nn.MultiheadAttention (its result a transposed view), Hugging Face's attentions, T5's many dropouts, and
functional dropouts at rates kept in float attributes (BART, LLaMA's attention)."""


@pytest.mark.parametrize("name", WITH_DROPOUT)
def test_zoo_parity_with_dropout_on(name: str) -> None:
    """With every dropout at 0.1 and ORTModule(torch_dropout=True), training follows torch's step for step (its
    masks are torch's own); the default masks, another stream of the same law, would not."""
    case = CASES[name]
    if case.needs:
        pytest.importorskip(case.needs)
    _, _, report = check_parity(lambda: dropouts_on(case.make()), case.batches(STEPS), case.loss, sgd,
                                torch_dropout=True)
    print(f"{name} (dropout 0.1): {report}")


IN_FLOAT64 = ["vit", "hf-bert", "resnet", "unet-norms", "transformer-seq2seq", "siamese", "m5-audio"]
"""Members computing only in float64: GELU (Erf, which onnxruntime computes in float only), layer, batch, group
and instance norms (eps a float32 attribute), float64 convolutions and pools (M5's global one: its kernel a traced
size, the squeeze after it an If decided on the sizes found), upsampling with align_corners.
Hugging Face's causal LMs, T5, its ViT, Swin and CLIP compute parts in float32 on purpose (the loss, a softmax,
T5's norm) and stay out."""


def _in_float64(batch: Batch) -> Batch:
    if isinstance(batch, dict):
        return {k: _in_float64(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_in_float64(v) for v in batch)
    return batch.double() if isinstance(batch, torch.Tensor) and batch.is_floating_point() else batch


@pytest.mark.parametrize("name, exporter", [*((name, "torchscript") for name in IN_FLOAT64), ("siamese", "dynamo"),
                                            ("m5-audio", "dynamo")])
def test_zoo_parity_in_float64(name: str, exporter: str) -> None:
    """Made .double(), they train as torch's to 1e-10 (measured: 5e-14 at most, either exporter): before, the ViT
    and BERT were refused at their sessions' load, the U-Net with norms was 3e-8 off, M5 failed to export (under
    dynamo its pool's kernel is a SymInt), and under dynamo the
    Siamese encoder's second call (its BatchNorms' statistics through Identities) took float32 stand-in
    statistics, for which onnxruntime has no kernel."""
    case = CASES[name]
    if case.needs:
        pytest.importorskip(case.needs)
    batches = [_in_float64(b) for b in case.batches(STEPS)]
    _, _, report = check_parity(lambda: case.make().double(), batches, case.loss, sgd, rtol=1e-10, exporter=exporter)
    print(f"{name} (float64, {exporter}): {report}")
