"""onnx's own backend node tests (one model and one set of inputs per op variant, ~1900 cases) through
TrainingSession: every case with a float input either is refused with a GradBuilderError or gives onnxruntime's
outputs and gradients that agree with central finite differences along a random direction.

The reference for the outputs is onnxruntime running the model as it is (its kernels are not under test here; a
few differ from onnx's reference values), and cases onnxruntime cannot run at all are left out. The
differences probe only the inputs that receive a gradient (class weights, running statistics and the like are
non-differentiable, as in torch) and only the outputs that take one.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gradbuilder.errors import GradBuilderError
from runtime.session import TrainingSession

with warnings.catch_warnings(), np.errstate(all="ignore"):
    warnings.simplefilter("ignore")
    import onnx.backend.test.case.node as _node_cases

    CASES = {c.name: c for c in _node_cases.collect_testcases(None)}

FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}
EPS = 1e-3
TOLERANCE = 0.02
"""Of the larger side of <J t, c> and <t, J^T c>: float32 differences over a step of 1e-3."""
NOT_SMOOTH: dict[str, str] = {
    **{name: "an input sits on a kink or a jump of the function, or among ties: the differences see both sides, the "
             "gradient one (torch's)"
       for name in ("test_elu_example", "test_elu_example_expanded_ver18",
                    "test_leakyrelu_example", "test_leakyrelu_example_expanded", "test_selu_example",
                    "test_selu_example_expanded_ver18", "test_thresholdedrelu_example",
                    "test_thresholdedrelu_example_expanded_ver18", "test_maxpool_2d_same_upper",
                    "test_maxpool_2d_same_lower", "test_maxpool_3d_dilations", "test_maxpool_3d_dilations_use_ref_impl",
                    "test_maxpool_3d_dilations_use_ref_impl_large")},
    **{name: "grid positions on the input's lattice, where linear interpolation has kinks and nearest jumps (their "
             "gradients match torch's grid_sampler there, `test_rules_resample.py` compares the rest)"
       for name in ("test_gridsample_bilinear", "test_gridsample_aligncorners_true", "test_gridsample_nearest",
                    "test_gridsample_nearest_align_corners_0_additional_1",
                    "test_gridsample_nearest_align_corners_1_additional_1",
                    "test_gridsample_bilinear_align_corners_1_additional_1",
                    "test_gridsample_volumetric_nearest_align_corners_0",
                    "test_gridsample_volumetric_nearest_align_corners_1",
                    "test_gridsample_volumetric_bilinear_align_corners_0",
                    "test_gridsample_volumetric_bilinear_align_corners_1")},
    "test_dft_irfft_opset19": "float32 outputs up to 99 (an unnormalised spectrum): differences over 1e-3 lose their "
                              "digits (the gradient matches torch's irfft in float64, `test_rules_spectral.py`)",
    "test_l2normalization_axis_0": "a zero vector, where the output jumps (its gradient there is zero)",
    **{name: "inputs of 1e4: float32 differences of the log-softmax lose their digits"
       for name in ("test_logsoftmax_large_number", "test_logsoftmax_large_number_expanded",
                    "test_logsoftmax_large_number_expanded_ver18")},
    **{name: "NaN and infinite inputs or results by design (the edge cases of the op)"
       for name in ("test_pow", "test_mod_float_edge_cases_fmod_0_float32",
                    "test_mod_float_edge_cases_fmod_0_float64")},
}
"""Cases whose gradients are not compared with differences, and why (their outputs still are)."""
NAN_BY_DESIGN: dict[str, str] = {
    "test_acosh_example": "an input of 1, where acosh's derivative is infinite (torch's too)",
    **{name: "rows whose every key is masked: onnx's expanded Attention takes their softmax of -inf (NaN) and zeroes "
             "it after, so its gradient is NaN * 0, as torch's would be"
       for name in ("test_attention_causal_boolmask_nan_robustness_expanded",
                    "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded",
                    "test_attention_4d_causal_nonpad_negative_offset_structural_empty_expanded",
                    "test_attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded",
                    "test_attention_24_fullymasked_qk_matmul_output_mode3_zero_expanded",
                    "test_attention_local_window_gqa_rank4_mask_expanded")},
}
"""Cases whose gradients are infinite or NaN where their outputs are finite, and why."""


def _differentiable_cases() -> list[str]:
    out = []
    for name, case in CASES.items():
        if not case.data_sets:
            continue
        inputs, _ = case.data_sets[0]
        graph_inputs = list(case.model.graph.input)
        if len(inputs) == len(graph_inputs) and all(isinstance(v, np.ndarray) for v in inputs) and any(
                i.type.tensor_type.elem_type in FLOAT and v.size for i, v in zip(graph_inputs, inputs)):
            out.append(name)
    return out


def _plain(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception:  # onnxruntime cannot run the model itself: nothing to compare with
        return None


@pytest.mark.parametrize("name", _differentiable_cases())
def test_node_case(name: str) -> None:
    case = CASES[name]
    model = case.model
    inputs, _ = case.data_sets[0]
    feeds = {i.name: v for i, v in zip(model.graph.input, inputs)}
    want = _plain(model, feeds)
    if want is None:
        return
    wrt = [i.name for i in model.graph.input if i.type.tensor_type.elem_type in FLOAT and feeds[i.name].size]
    try:
        session = TrainingSession.from_forward(model, wrt=wrt, threads=1)
    except GradBuilderError:
        return
    got, state = session.forward(feeds)
    got = [np.asarray(v) for v in got]
    random = any(n.op_type.startswith(("Random", "Bernoulli", "Dropout")) for n in model.graph.node)
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"output {k}: {a.shape} against onnxruntime's {b.shape}"
        if b.dtype.kind == "f" and not random:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"output {k}")
    rng = np.random.default_rng(0)
    cotangents = [rng.standard_normal(a.shape).astype(a.dtype) if k in session.differentiable else None
                  for k, a in enumerate(got)]
    grads = {w: np.asarray(g, np.float64) for w, g in session.backward(state, cotangents).items() if g is not None}
    finite = all(np.all(np.isfinite(a)) for a in got if a.dtype.kind == "f")
    for w, g in grads.items():
        assert not finite or name in NAN_BY_DESIGN or np.all(np.isfinite(g)), \
            f"gradient of '{w}' is not finite where every output is"
    if random or name in NOT_SMOOTH or name in NAN_BY_DESIGN:
        return
    direction = {w: rng.standard_normal(feeds[w].shape) for w in grads}

    def moved(sign: float) -> list[np.ndarray]:
        shifted = dict(feeds)
        for w, t in direction.items():
            shifted[w] = (feeds[w].astype(np.float64) + sign * EPS * t).astype(feeds[w].dtype)
        outs, s = session.forward(shifted)
        s.release()
        return [np.asarray(v, np.float64) for v in outs]

    plus, minus = moved(1.0), moved(-1.0)
    lhs = sum(float(np.sum((p - m) / (2 * EPS) * c)) for p, m, c in zip(plus, minus, cotangents) if c is not None)
    rhs = sum(float(np.sum(grads[w] * t)) for w, t in direction.items())
    if not (np.isfinite(lhs) and np.isfinite(rhs)):
        return
    assert abs(lhs - rhs) <= TOLERANCE * max(1.0, abs(lhs), abs(rhs)), f"<J t, c> = {lhs}, <t, J^T c> = {rhs}"
