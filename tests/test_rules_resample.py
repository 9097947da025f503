"""Resize, DepthToSpace, SpaceToDepth, Col2Im.

onnxruntime has no double Resize kernel, so Resize runs in float32. Torch's interpolate is the reference where
it has ONNX's semantics (what the exporters emit); the other modes are checked against onnx's reference
implementation of Resize, applied to an identity matrix along each axis to get its [out, in] weights (the op is
separable), composed in float64 torch.
"""

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from harness import Trainer, check_op, single_op_model
from onnx import helper
from onnx.reference import ReferenceEvaluator

import gradbuilder
from gradbuilder.errors import RuleError

rng = np.random.default_rng(0)


def f32(*shape):
    return np.asarray(rng.standard_normal(shape), dtype=np.float32)


def r64(*shape):
    return np.asarray(rng.standard_normal(shape))


# --- references ------------------------------------------------------------------------------------
def interpolate(**kw):
    return lambda x: F.interpolate(x, **kw)


def reference_weights(n, attrs, scale=None, size=None, roi=None, opset=19):
    """[out, in] weights of onnx's reference Resize along one axis of length n (extrapolation 0)."""
    ins = ["x", "roi" if roi is not None else "", "scales" if scale is not None else "",
           "sizes" if size is not None else ""]
    while not ins[-1]:
        ins.pop()
    inits = []
    if roi is not None:
        inits.append(onnx.numpy_helper.from_array(np.array([roi[0], 0, roi[1], 1], np.float32), "roi"))
    if scale is not None:
        inits.append(onnx.numpy_helper.from_array(np.array([scale, 1], np.float32), "scales"))
    if size is not None:
        inits.append(onnx.numpy_helper.from_array(np.array([size, n], np.int64), "sizes"))
    attrs = {k: v for k, v in attrs.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    node = helper.make_node("Resize", ins, ["y"], **attrs)
    graph = helper.make_graph([node], "w", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [n, n])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {"x": np.eye(n, dtype=np.float32)})[0].astype(np.float64)


def separable(mats):
    """x -> x with axis a contracted with mats[a] ([out, in]); None leaves an axis alone."""
    def fn(x):
        for a, w in mats.items():
            x = torch.movedim(torch.tensordot(torch.from_numpy(w), torch.movedim(x, a, 0), dims=1), 0, a)
        return x
    return fn


def onnx_reference(shape, attrs, scales=None, sizes=None, roi=None, axes=None, opset=19):
    axes = list(range(len(shape))) if axes is None else axes
    mats = {}
    for k, a in enumerate(axes):
        s = None if scales is None else scales[k]
        z = None if sizes is None else sizes[k]
        rr = None if roi is None else (roi[k], roi[k + len(axes)])
        if (s == 1 or z == shape[a]) and roi is None:
            continue
        mats[a] = reference_weights(shape[a], attrs, s, z, rr, opset)
    return separable(mats)


def resize_inputs(x, scales=None, sizes=None, roi=None):
    return [("x", x), ("roi", None if roi is None else np.array(roi, np.float32)),
            ("scales", None if scales is None else np.array(scales, np.float32)),
            ("sizes", None if sizes is None else np.array(sizes, np.int64))]


CONSTS = ["roi", "scales", "sizes"]


# --- what the exporters emit -------------------------------------------------------------------------
EXPORTED = [
    # attributes (legacy exporter, opset 17), scales or sizes, torch interpolate arguments
    (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     [1, 1, 2, 2], None, dict(scale_factor=2, mode="nearest")),
    (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     [1, 1, 3, 2], None, dict(scale_factor=(3, 2), mode="nearest")),
    (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     None, [2, 3, 7, 9], dict(size=(7, 9), mode="nearest")),
    (dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
     None, [2, 3, 3, 2], dict(size=(3, 2), mode="nearest")),  # downsampling: positions nobody reads
    (dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"),
     None, [2, 3, 7, 9], dict(size=(7, 9), mode="nearest-exact")),
    (dict(mode="linear", coordinate_transformation_mode="align_corners"),
     [1, 1, 2, 2], None, dict(scale_factor=2, mode="bilinear", align_corners=True)),
    (dict(mode="linear", coordinate_transformation_mode="align_corners"),
     None, [2, 3, 7, 3], dict(size=(7, 3), mode="bilinear", align_corners=True)),
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     None, [2, 3, 7, 9], dict(size=(7, 9), mode="bilinear", align_corners=False)),
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     [1, 1, 2, 2], None, dict(scale_factor=2, mode="bilinear", align_corners=False)),
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     None, [2, 3, 3, 2], dict(size=(3, 2), mode="bilinear", align_corners=False)),
    (dict(mode="linear", coordinate_transformation_mode="half_pixel"),
     None, [2, 3, 1, 7], dict(size=(1, 7), mode="bilinear", align_corners=False)),
    (dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
     None, [2, 3, 7, 9], dict(size=(7, 9), mode="bicubic", align_corners=False)),
    (dict(mode="cubic", coordinate_transformation_mode="align_corners", cubic_coeff_a=-0.75),
     None, [2, 3, 7, 3], dict(size=(7, 3), mode="bicubic", align_corners=True)),
]


@pytest.mark.parametrize("attrs,scales,sizes,kw", EXPORTED)
def test_resize_2d_like_torch(attrs, scales, sizes, kw):
    x = f32(2, 3, 4, 5)
    check_op("Resize", resize_inputs(x, scales, sizes), interpolate(**kw), consts=CONSTS, **attrs)


@pytest.mark.parametrize("kw,sizes", [
    (dict(mode="trilinear", align_corners=False), [2, 2, 5, 3, 7]),
    (dict(mode="trilinear", align_corners=True), [2, 2, 5, 3, 7]),
    (dict(mode="nearest"), [2, 2, 6, 6, 3]),
])
def test_resize_3d_like_torch(kw, sizes):
    attrs = dict(mode="linear" if kw["mode"] == "trilinear" else "nearest",
                 coordinate_transformation_mode="align_corners" if kw.get("align_corners") else
                 "half_pixel" if kw["mode"] == "trilinear" else "asymmetric", nearest_mode="floor")
    check_op("Resize", resize_inputs(f32(2, 2, 3, 4, 5), sizes=sizes), interpolate(size=tuple(sizes[2:]), **kw),
             consts=CONSTS, **attrs)


def test_resize_antialias_like_torch():
    """The dynamo exporter maps antialias=True to antialias=1 with exclude_outside=1."""
    check_op("Resize", resize_inputs(f32(2, 3, 9, 8), sizes=[2, 3, 4, 3]),
             interpolate(size=(4, 3), mode="bilinear", antialias=True), consts=CONSTS, opset=18, mode="linear",
             coordinate_transformation_mode="half_pixel", antialias=1, exclude_outside=1)


def test_resize_float16():
    check_op("Resize", resize_inputs(f32(2, 3, 4, 5).astype(np.float16), sizes=[2, 3, 7, 9]),
             interpolate(size=(7, 9), mode="bilinear"), consts=CONSTS, mode="linear", rtol=2e-2, atol=2e-2,
             fd=False)


@pytest.mark.parametrize("mode,attrs", [("nearest", dict(nearest_mode="floor",
                                                         coordinate_transformation_mode="asymmetric")),
                                        ("linear", dict(coordinate_transformation_mode="half_pixel"))])
@pytest.mark.parametrize("opset", [13, 15, 16])
def test_resize_old_opsets(mode, attrs, opset):
    """Before opset 16 the nearest scatter-add is a one-hot MatMul."""
    kw = dict(mode="nearest") if mode == "nearest" else dict(mode="bilinear")
    check_op("Resize", resize_inputs(f32(2, 3, 4, 5), scales=[1, 1, 2, 1.5]), interpolate(scale_factor=(2, 1.5), **kw),
             consts=CONSTS, opset=opset, mode=mode, **attrs)


# --- the other modes, against onnx's reference implementation ------------------------------------------
TRANSFORMS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]
TARGETS = [([1, 1, 1.7, 0.55], None), ([1, 1, 0.5, 3], None), (None, [2, 3, 9, 4]), (None, [2, 3, 2, 7]),
           (None, [2, 3, 1, 7])]


def targets(transform, mode):
    """Scales and sizes to resize a (2, 3, 5, 6) input to. With scales, onnx's reference takes align_corners'
    output length unfloored (5 * 1.7 = 8.5, not 8) where onnxruntime and the spec floor it; for one output
    position its cubic pytorch_half_pixel does not sample input 0 exactly. Those cases are left out."""
    return [(sc, sz) for sc, sz in TARGETS
            if not (transform == "align_corners" and sc is not None)
            and not (transform == "pytorch_half_pixel" and mode == "cubic" and sz is not None and 1 in sz)]


@pytest.mark.parametrize("nearest_mode", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
@pytest.mark.parametrize("transform,scales,sizes", [(t, sc, sz) for t in TRANSFORMS for sc, sz in targets(t, "")])
def test_resize_nearest_modes(transform, nearest_mode, scales, sizes):
    x = f32(2, 3, 5, 6)
    attrs = dict(mode="nearest", coordinate_transformation_mode=transform, nearest_mode=nearest_mode)
    check_op("Resize", resize_inputs(x, scales, sizes), onnx_reference(x.shape, attrs, scales, sizes),
             consts=CONSTS, opset=19, **attrs)


@pytest.mark.parametrize("mode,extra", [("linear", {}), ("cubic", {}), ("cubic", dict(exclude_outside=1)),
                                        ("cubic", dict(cubic_coeff_a=-0.5))])
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_resize_linear_cubic_modes(transform, mode, extra):
    x = f32(2, 3, 5, 6)
    attrs = dict(mode=mode, coordinate_transformation_mode=transform, **extra)
    for scales, sizes in targets(transform, mode):
        check_op("Resize", resize_inputs(x, scales, sizes), onnx_reference(x.shape, attrs, scales, sizes),
                 consts=CONSTS, opset=19, **attrs)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_tf_crop_and_resize(mode):
    x = f32(2, 3, 5, 6)
    roi = [0, 0, 0.1, -0.2, 1, 1, 0.8, 1.1]  # outputs outside the input get the extrapolation value
    attrs = dict(mode=mode, coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=2.5)
    ref = onnx_reference(x.shape, attrs, sizes=[2, 3, 4, 7], roi=roi)
    outside = [reference_weights(x.shape[a], dict(attrs, extrapolation_value=1.0), size=z, roi=(roi[a], roi[a + 4]))
               - reference_weights(x.shape[a], attrs, size=z, roi=(roi[a], roi[a + 4])) for a, z in ((2, 4), (3, 7))]
    mask = torch.from_numpy((outside[0][:, :1] != 0) | (outside[1][:, 0] != 0)[None, :])
    assert mask.any() and not mask.all()
    check_op("Resize", resize_inputs(x, sizes=[2, 3, 4, 7], roi=roi), lambda t: ref(t) * ~mask + 2.5 * mask,
             consts=CONSTS, opset=19, **attrs)


@pytest.mark.parametrize("mode,axes", [("linear", [2, 3]), ("linear", [-1, -2]), ("nearest", [1, 3])])
def test_resize_axes_attribute(mode, axes):
    x = f32(2, 5, 3, 6)
    attrs = dict(mode=mode, coordinate_transformation_mode="half_pixel")
    pos = [a % 4 for a in axes]
    check_op("Resize", resize_inputs(x, scales=[0.6, 1.5]), onnx_reference(x.shape, attrs, [0.6, 1.5], axes=pos),
             consts=CONSTS, opset=18, axes=axes, **attrs)


@pytest.mark.parametrize("policy,sizes,out", [("not_larger", [10, 20], [10, 12]), ("not_smaller", [8, 3], [8, 10])])
def test_resize_keep_aspect_ratio(policy, sizes, out):
    x = f32(2, 3, 5, 6)
    attrs = dict(mode="linear", coordinate_transformation_mode="half_pixel")
    s = np.float32(out[0] / 5)
    ref = onnx_reference(x.shape, attrs, scales=[s, s], axes=[2, 3])
    if policy == "not_smaller":  # scale 1.6 rounds 6 * 1.6 = 9.6 up to 10 but a Resize by it gives 9
        model = single_op_model("Resize", resize_inputs(x, sizes=sizes), consts=CONSTS, opset=18, axes=[2, 3],
                                keep_aspect_ratio_policy=policy, **attrs)
        with pytest.raises(RuleError, match="keep_aspect_ratio_policy=not_smaller rounds axis 3 to 10"):
            gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
        return
    check_op("Resize", resize_inputs(x, sizes=sizes), ref, consts=CONSTS, opset=18, axes=[2, 3],
             keep_aspect_ratio_policy=policy, **attrs)


# --- dynamic shapes, run-time scales and sizes ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_symbolic_spatial_dims(mode):
    """Spatial dims unknown at build time: the per-axis identity and positions are built at run time."""
    attrs = dict(mode=mode, coordinate_transformation_mode="asymmetric" if mode == "nearest" else "half_pixel",
                 nearest_mode="floor")
    kw = dict(mode="nearest") if mode == "nearest" else dict(mode="bilinear")
    check_op("Resize", resize_inputs(f32(2, 3, 4, 5), scales=[1, 1, 2, 1.5]),
             interpolate(scale_factor=(2, 1.5), **kw), consts=CONSTS, symbolic={"x": [0, 2, 3]}, **attrs)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_scales_and_sizes_as_graph_inputs(mode):
    """Scales or sizes fed at run time: every axis is resized by its run-time entry (N and C by 1)."""
    x = f32(2, 3, 4, 5)
    if mode == "linear":
        ref = interpolate(size=(7, 3), mode="bilinear")
        check_op("Resize", resize_inputs(x, sizes=[2, 3, 7, 3]), lambda t, *_: ref(t), wrt=["x"],
                 out_ranks={"y0": 4}, mode="linear")
    else:
        attrs = dict(mode=mode, coordinate_transformation_mode="half_pixel", nearest_mode="floor")
        ref = onnx_reference(x.shape, attrs, scales=[1, 1, 2, 1.5])
        check_op("Resize", resize_inputs(x, scales=[1, 1, 2, 1.5]), lambda t, *_: ref(t), wrt=["x"],
                 out_ranks={"y0": 4}, **attrs)


def test_resize_empty_scales_next_to_sizes():
    model_inputs = resize_inputs(f32(2, 3, 4, 5), sizes=[2, 3, 7, 9])
    model_inputs[2] = ("scales", np.zeros(0, np.float32))
    check_op("Resize", model_inputs, interpolate(size=(7, 9), mode="bilinear"), consts=CONSTS, mode="linear",
             coordinate_transformation_mode="half_pixel")


def test_resize_identity_axes_cost_nothing():
    """N and C keep their size: only the two spatial axes get a MatMul."""
    model = single_op_model("Resize", resize_inputs(f32(2, 3, 4, 5), sizes=[2, 3, 7, 9]), consts=CONSTS,
                            mode="linear")
    training = gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])
    ops = [n.op_type for n in training.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Resize") == 3


class Up(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, **self.kw)


EXPORTS = [dict(scale_factor=2, mode="nearest"), dict(size=(7, 9), mode="nearest"),
           dict(scale_factor=(1.5, 2), mode="bilinear", align_corners=False),
           dict(size=(7, 9), mode="bilinear", align_corners=True),
           dict(size=(7, 9), mode="bicubic", align_corners=False)]


@pytest.mark.parametrize("kw,dynamo", [(kw, False) for kw in EXPORTS] + [(EXPORTS[0], True), (EXPORTS[3], True)])
def test_resize_exported(kw, dynamo):
    """Both exporters, dynamic batch: scales/sizes come from Concat/Shape nodes the rule folds."""
    torch.manual_seed(0)
    module = Up(**kw)
    x = torch.randn(2, 3, 4, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            model = torch.onnx.export(module, (x,), dynamo=True, optimize=False, verbose=False,
                                      dynamic_shapes=({0: "batch"},)).model_proto
        else:
            f = io.BytesIO()
            torch.onnx.export(module, (x,), f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False, opset_version=17, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "batch"}})
            model = onnx.load_from_string(f.getvalue())
    inp, out = model.graph.input[0].name, model.graph.output[0].name
    training = gradbuilder.build_gradient_graph(model, wrt=[inp], outputs=[out])
    # one per resized axis next to the forward one: N and C were found unchanged
    assert [n.op_type for n in training.graph.node].count("Resize") == 3
    trainer = Trainer(training)
    xin = torch.randn(3, 3, 4, 5, requires_grad=True)  # another batch size than at export
    ty = module(xin)
    ty.sum().backward()
    (y,), grads = trainer.step({inp: xin.detach().numpy()}, [np.ones(ty.shape, np.float32)])
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads[inp], xin.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_resize_fails_clearly_on_run_time_roi():
    model = single_op_model("Resize", [("x", f32(2, 3, 4, 5)), ("roi", np.array([0, 0, 0, 0, 1, 1, 1, 1],
                                                                                 np.float32)),
                                       ("scales", np.array([1, 1, 2, 2], np.float32))],
                            consts=["scales"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize")
    with pytest.raises(RuleError, match="roi computed at run time"):
        gradbuilder.build_gradient_graph(model, wrt=["x"], outputs=["y0"])


# --- DepthToSpace, SpaceToDepth, Col2Im ------------------------------------------------------------------
def depth_to_space(b, mode):
    def fn(x):
        n, c, h, w = x.shape
        if mode == "DCR":
            t = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
        else:
            t = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
        return t.reshape(n, c // (b * b), h * b, w * b)
    return fn


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("symbolic", [None, {"x": [0, 1, 2, 3]}])
def test_depth_to_space(mode, symbolic):
    check_op("DepthToSpace", [("x", r64(2, 12, 3, 4))], depth_to_space(2, mode), blocksize=2, mode=mode,
             symbolic=symbolic, out_ranks={"y0": 4})


def space_to_depth(b):
    def fn(x):
        n, c, h, w = x.shape
        t = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
        return t.reshape(n, c * b * b, h // b, w // b)
    return fn


@pytest.mark.parametrize("b", [2, 3])
def test_space_to_depth(b):
    check_op("SpaceToDepth", [("x", r64(2, 2, 6, 3 * b))], space_to_depth(b), blocksize=b)


def test_space_to_depth_crd_is_pixel_unshuffle():
    """From opset 28 SpaceToDepth takes DepthToSpace's `mode`: CRD inverts pixel_shuffle."""
    check_op("SpaceToDepth", [("x", r64(2, 2, 6, 4))], lambda x: F.pixel_unshuffle(x, 2), blocksize=2, mode="CRD",
             opset=28)


def test_depth_to_space_crd_is_pixel_shuffle():
    check_op("DepthToSpace", [("x", r64(2, 8, 3, 4))], lambda x: F.pixel_shuffle(x, 2), blocksize=2, mode="CRD")


@pytest.mark.parametrize("image,block,attrs", [
    ([5, 6], [2, 2], {}),
    ([7, 6], [3, 2], dict(strides=[2, 1], pads=[1, 0, 1, 1], dilations=[1, 2])),
])
def test_col2im(image, block, attrs):
    c = 3
    strides, dilations = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1])
    pads = attrs.get("pads", [0, 0, 0, 0])
    blocks = [(image[i] + pads[i] + pads[i + 2] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
              for i in range(2)]
    x = f32(2, c * block[0] * block[1], blocks[0] * blocks[1])
    if pads[0] != pads[2] or pads[1] != pads[3]:
        def ref(t):
            full = [image[i] + pads[i] + pads[i + 2] for i in range(2)]
            y = F.fold(t, full, block, dilation=dilations, stride=strides)
            return y[:, :, pads[0]:full[0] - pads[2], pads[1]:full[1] - pads[3]]
    else:
        def ref(t):
            return F.fold(t, image, block, dilation=dilations, padding=pads[:2], stride=strides)
    check_op("Col2Im", [("x", x), ("image", np.array(image)), ("block", np.array(block))], ref,
             consts=["image", "block"], opset=18, **attrs)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample(mode: str, align: int, padding: str) -> None:
    """GridSample against torch's grid_sampler gradients (X and grid), the grid reaching past the input on every
    side and reflected up to twice (onnxruntime runs GridSample in float32 only). Opset 16 names the modes as
    torch does; opset 20 calls them linear and cubic."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    grid = rng.uniform(-2.6, 2.6, (2, 4, 7, 2)).astype(np.float32)
    for opset, named in [(16, mode), (20, {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode))]:
        check_op("GridSample", [("x", x), ("grid", grid)],
                 lambda a, b: F.grid_sample(a, b, mode=mode, padding_mode=padding, align_corners=bool(align)),
                 fd=False, opset=opset, mode=named, padding_mode=padding, align_corners=align)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", ["border", "reflection"])
@pytest.mark.parametrize("rank", [2, 3])
def test_grid_sample_on_the_borders(rank: int, align: int, padding: str) -> None:
    """Grid points exactly on the first and last centres (an identity transform's edges) and reflected onto them
    get no grid gradient from border or reflection padding along that axis: torch counts the borders as outside
    (clip_coordinates_set_grad); interior integral points keep theirs."""
    size = 4
    first, last = (-1.0, 1.0) if align else (-1 + 1 / size, 1 - 1 / size)  # the centres of positions 0 and 3
    step = (last - first) / (size - 1)
    beyond = 3.0 if align else 1.25  # positions 6 and -3 (align) or 4 and -1: reflected onto a centre on the border
    values = np.array([first, first + step, last, beyond, -beyond, 0.3], np.float32)
    rng = np.random.default_rng(5)
    grid = rng.choice(values, (2, 3) + (4,) * (rank - 1) + (rank,)).astype(np.float32)
    x = rng.standard_normal((2, 2) + (size,) * rank).astype(np.float32)
    check_op("GridSample", [("x", x), ("grid", grid)],
             lambda a, b: F.grid_sample(a, b, mode="bilinear", padding_mode=padding, align_corners=bool(align)),
             fd=False, opset=20, mode="linear", padding_mode=padding, align_corners=align)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_grid_sample_volumetric(mode: str, align: int, padding: str) -> None:
    """5-D GridSample (opset 20: trilinear, nearest) against torch's 5-D grid_sampler, the grid's last axis
    holding x, y, z for the input's last three axes in reverse."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 2, 3, 4, 5)).astype(np.float32)
    grid = rng.uniform(-1.8, 1.8, (2, 3, 2, 4, 3)).astype(np.float32)
    check_op("GridSample", [("x", x), ("grid", grid)],
             lambda a, b: F.grid_sample(a, b, mode="bilinear" if mode == "linear" else mode, padding_mode=padding,
                                        align_corners=bool(align)),
             fd=False, opset=20, mode=mode, padding_mode=padding, align_corners=align)


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2)])
def test_affine_grid(size, align) -> None:
    """AffineGrid (opset 20) against torch's affine_grid, 2-D and 3-D, float32 (onnxruntime's kernel)."""
    r = len(size) - 2
    theta = np.random.default_rng(7).standard_normal((size[0], r, r + 1)).astype(np.float32)
    check_op("AffineGrid", [("theta", theta), ("size", np.array(size))],
             lambda t: F.affine_grid(t, list(size), align_corners=bool(align)), consts=["size"], opset=20,
             align_corners=align)


def test_grid_sample_refuses_modes_without_a_rule() -> None:
    x = np.zeros((1, 1, 3, 3), np.float32)
    grid = np.zeros((1, 2, 2, 2), np.float32)
    model = single_op_model("GridSample", [("x", x), ("grid", grid)], opset=16, padding_mode="mirror")
    with pytest.raises(gradbuilder.GradBuilderError, match="padding_mode='mirror'"):
        gradbuilder.build_gradient_graph(model, wrt=["x", "grid"], outputs=["y0"])
