"""Which rewrites the runtime applies for onnxruntime, at which stage, under `SessionConfig.lower`.

One place for the three stages, so a session and ORTModule's inference path rewrite alike:
- the forward source, before the gradient is built (the rule then sees the rewritten nodes);
- a forward or inference graph, just before its session is created;
- a backward graph, just before its session is created.
"""

from __future__ import annotations

import numpy as np
import onnx

from gradbuilder import stop_gradient

from . import crossentropy, feature_major, gelus, host_dropout, nchwc, passes, reductions, shape_folding, vectorized
from .ort_session import BACKWARD_DISABLED_OPTIMIZERS, DISABLED_OPTIMIZERS, Runner, SessionConfig


def source(model: onnx.ModelProto, config: SessionConfig, rows: int | None = None) -> onnx.ModelProto:
    """Always: Ifs the known sizes decide replaced by their branch (`shape_folding.inline_constant_ifs`: the
    builder differentiates no control flow), EyeLikes of types onnxruntime lacks made in float
    (`passes.runnable_eyelikes`), ceil-mode pools onnxruntime would size wrong made floor-mode
    (`passes.ceil_pools_as_floor`), spellings onnxruntime misreads rewritten (`passes.canonical_forms`). Then
    Dropouts that drop nothing removed (`passes.inactive_dropouts`), Relu at the pooled size
    (`passes.relu_after_pool`), chains of Linear layers computed feature-major (`feature_major`; `rows`: the batch
    expected where the model leaves it symbolic) and torch's GELU as onnxruntime's contrib Gelu or FastGelu (`gelus`:
    after the chains, whose elementwise ops it reads as the exporter wrote them)."""
    model = passes.ceil_pools_as_floor(passes.runnable_eyelikes(shape_folding.inline_constant_ifs(model)))
    model = passes.canonical_forms(model)
    if not config.lower:
        return model
    model = passes.relu_after_pool(passes.inactive_dropouts(model))
    return gelus.fused_gelus(feature_major.feature_major_chains(model, rows, dropouts=not config.torch_masks))


def forward(model: onnx.ModelProto, config: SessionConfig) -> onnx.ModelProto:
    """The classification losses written out in standard ops (`crossentropy`) instead of the ONNX function
    bodies onnxruntime inlines; Dropouts that drop nothing removed (an inference graph's, not yet removed by
    `source`); activations onnxruntime computes element by element vectorized (`vectorized`); shape
    arithmetic folded where only the batch is unknown (`shape_folding`); Convs with weight inputs blocked
    (`nchwc`); shape ops that change nothing removed (`passes.idle_reshapes`). Always: gradbuilder's
    StopGradient as the Identity it is (an inference graph is the exported one, never split), 1-D MatMul
    operands of a Transpose's product as matrices (`passes.vectors_as_matrices`: onnxruntime's
    MatmulTransposeFusion computes those wrong), reducing ScatterNDs as ScatterElements (`passes.ordered_scatters`:
    onnxruntime's threads lose updates of repeated indices), float64 inverse DFTs as forward ones
    (`passes.exact_inverse_dfts`: onnxruntime's scale in float32), and ceil-mode pools and `canonical_forms` as in
    `source` (an inference graph does not pass there)."""
    model = passes.exact_inverse_dfts(stop_gradient.as_identity(model))
    model = passes.ceil_pools_as_floor(passes.ordered_scatters(passes.vectors_as_matrices(model)))
    model = passes.canonical_forms(model)
    if not config.lower:
        return model
    model = vectorized.vectorized_ops(crossentropy.lower_losses(passes.inactive_dropouts(model)))
    return passes.idle_reshapes(nchwc.blocked_convs(shape_folding.fold_shapes(model)))


def forward_runner(model: onnx.ModelProto, config: SessionConfig, what: str) -> Runner | host_dropout.MaskedRunner:
    """The session for a forward or inference graph: `forward`'s rewrites, then training Dropouts fed masks drawn
    on the host (`host_dropout`), which needs a runner of its own."""
    return host_dropout.forward_runner(forward(model, config), config, what)


def fused_runner(model: onnx.ModelProto, backward: onnx.ModelProto, config: SessionConfig,
                 like: Runner | host_dropout.MaskedRunner) -> Runner | host_dropout.MaskedRunner:
    """The session for a forward and `backward` joined (`fused.fused_model`, each half already lowered): its
    training Dropouts fed host masks as a forward's; onnxruntime's NCHWc layout kept for the forward's pools
    unless `backward` has Convs of constant weights (the one-hot unfolds `BACKWARD_DISABLED_OPTIMIZERS` is for);
    `like`: the split forward's runner (its Dropout inputs' shapes). Shape ops that change nothing removed again
    (`passes.idle_reshapes`): the forward's sizes prove more of the backward's (a LeNet's bias gradients)."""
    consts = {t.name for t in backward.graph.initializer}
    unfolds = any(n.op_type == "Conv" and not n.domain and len(n.input) > 1 and n.input[1] in consts
                  for n in backward.graph.node)
    disabled = BACKWARD_DISABLED_OPTIMIZERS if unfolds else DISABLED_OPTIMIZERS
    if config.lower:
        model = passes.idle_reshapes(model)
    return host_dropout.forward_runner(model, config, "forward and backward", disabled, like)


def backward(model: onnx.ModelProto, known: dict[str, np.ndarray], config: SessionConfig, rows: int | None = None,
             forward: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """Slow onnxruntime patterns (`passes.lower`, `vectorized` recomputed in backward), then sums and
    contractions over rows (`reductions.lower_sums`), then large unfolded weight gradients in chunks of the batch
    and the Convs and stride-1 ConvTransposes blocked (`nchwc`), then shape ops that change nothing removed
    (`passes.idle_reshapes`); `known`: values of the initializers backward reads from the forward part; `rows`:
    the batch expected where the graph leaves it symbolic; `forward`: the forward half, whose infinite fills keep
    their gradients' Wheres (`passes.infinite_fills`). Always: 1-D
    MatMul operands of a Transpose's product as matrices (`passes.vectors_as_matrices`), float64 inverse DFTs as
    forward ones (`passes.exact_inverse_dfts`: the rules write none, but a checkpointed region's forward nodes are
    recomputed here) and reducing ScatterNDs as ScatterElements
    (`passes.ordered_scatters`), after the sums, which add into scatters of either kind."""
    model = passes.exact_inverse_dfts(passes.vectors_as_matrices(model))
    if not config.lower:
        return passes.ordered_scatters(model)
    keep = passes.infinite_fills(forward) if forward is not None else frozenset()
    lowered = passes.ordered_scatters(reductions.lower_sums(vectorized.vectorized_ops(passes.lower(model, known,
                                                                                                    keep))))
    return passes.idle_reshapes(nchwc.blocked_convs(nchwc.unfolded_weight_grads(lowered, known, rows=rows)), known)
