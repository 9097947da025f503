"""Convolutions in onnxruntime's blocked NCHWc layout, their filters reordered in the graph at run time.

onnxruntime's CPU provider has direct convolution kernels over blocks of 8 or 16 channels (MLAS NCHWc, the
`com.microsoft.nchwc` ops), 0.45-0.7x the time of its im2col + GEMM `Conv` on mid-network layers here. Its optimizer
(`NchwcTransformer`) uses them only for constant weights, reordering each filter once when the session is made:
never in training, where weights are inputs. Here the reorder is part of the graph (a Pad, Reshapes and one or two
single-axis Transposes of the weight: `_filter`), so a Conv with a weight input runs blocked too, and so does the
input gradient of a stride-1 Conv (a ConvTranspose), as a Conv with the flipped kernel. So does the Conv rule's
weight gradient with batch and channels swapped (x^T convolved by dY^T), whose channel axis is the batch, known only
at run time: it is padded there to a multiple of the block (zero channels add nothing), the filter's reorder leaves
that axis to the Reshapes and reads dY itself, not the rule's swap of it. The same Pad frames that input with the
Conv's own pads, since the blocked kernels take a slower path along padded borders (a 5x5 'same' layer from 8
channels: 0.6x the time). Large unfolds of the Conv rule's weight gradients (3x3 layers over big maps, their
one-hot Conv left to onnxruntime's im2col kernel: 9 taps) are made and multiplied in chunks of the batch, so that
each chunk's products read it from the cache (`unfolded_weight_grads`). 5x5 layers from one channel have no
one-hot Conv to block: the rule gathers their windows (`_weight_grad_by_gathering`), 0.4-0.6x the time of the
blocked one-hot Conv that ran here before; from 2-3 channels it swaps, and the images run as blocked channels here
(nn.py `SWAP_MIN_INPUTS`).

Which layers pay was measured layer by layer (benchmarks/notes.md): input channels a multiple of 4 padded by at most
a quarter to the block (the input is reordered to the blocked layout and back after), or, below one block of input
channels, kernels of at least 25 taps (the plain NCHW input is read directly, one channel too); and at most
3x the layer's multiply-adds once channels are padded to the block. 3x3 kernels over 1-3 channels, heavily padded
channel counts, 1-3 output positions, LeNet's input gradient (6 channels, 10x10 to 14x14) and 5x5 input gradients
onto more than twice dY's positions or onto channels that do not fill whole blocks (`MAX_SPREAD`) stay as they
are. Channels known only at run time take the blocked layout for at least two images (`MIN_IMAGES_PADDED`): a
weight gradient of 5x5 layers from 4+ channels ran at 0.4-0.6x the im2col Conv's time.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from gradbuilder.graph import default_opset, infer_shapes_safely
from gradbuilder.inference import Dims, tensor_types
from gradbuilder.rules.nn import unfold_kernel

from .passes import (
    Nodes,
    Readers,
    constant_values,
    drop_unread,
    int_attr,
    ints_attr,
    rewrite_nodes,
)

DOMAIN = "com.microsoft.nchwc"
MAX_CHANNEL_PADDING = 1.25
"""Blocked input channels at most this many times the layer's: 40 of 48 ran at 0.59x, 36 of 48 at 0.90x,
20 of 32 at 0.96-1.19x."""
MIN_TAPS_UNBLOCKED = 25
"""Below one block of input channels, kernels of at least this many taps (5x5: 0.55-0.81x; 3x3: 0.83-1.26x), from
one channel too (a LeNet's first layer, batch 64: 1 -> 6 'same' 0.88-0.94x, 1 -> 16 0.66-0.73x, 1 -> 32 0.77x;
batch 16 and 256 level)."""
MIN_POSITIONS = 4
"""Output positions a sample at least, when known (a 5x5 input to 1x1 output ran at 1.22x)."""
MAX_WASTE = 3.0
"""Multiply-adds of the blocked Conv at most this many times the layer's own: output channels padded to the block
(6 of 16: 0.69x), and for an input gradient the flipped Conv's positions over dY's (LeNet's second layer, 10x10
to 14x14 from 6 of 16 channels, 5.2 times: 1.0-1.17x; 64 to 32 channels, 10x10 to 14x14, 1.96 times: 0.81x)."""
ASSUMED_SIZE = 8
"""dY's rows and columns when a backward graph does not say (its value_info is empty): the smallest map a 3x3 or
5x5 layer usually sees, so the spread is overestimated, never under."""
MIN_IMAGES_PADDED = 2
"""A Conv whose input channels are known only at run time (a weight gradient with batch and channels swapped:
the batch is the channel axis, the layer's input channels are the images) is blocked for at least this many
images: MLAS splits a blocked Conv by image and output block, and one image (the gradient of a one-channel
layer) ran at 1.2-1.6x the im2col Conv, three at 0.65-0.78x, six to thirty-two at 0.4-0.6x."""
MAX_SPREAD = 2.0
"""A stride-1 ConvTranspose of at least `MIN_TAPS_UNBLOCKED` taps whose dX has more than this many times dY's
positions (known) stays onnxruntime's own: as a blocked Conv over dY framed by K - 1 zeros, most of its positions
sit in the frame. 5x5 'valid' input gradients, 2 threads (ConvTranspose / blocked): 16 of 32 channels, 12x12 from
8x8, batch 64, 0.60-0.70 / 0.92-1.0 ms, from 64 channels 0.88-0.93 / 1.77-1.90, 32 of 64 at batch 32 0.84-0.89 /
1.09-1.19 (spread 2.25); 14x14 from 10x10 (1.96) level, 0.96-1.03 / 1.00-1.08 (64 -> 32: 0.81x blocked, kept);
3x3 ones at 2.25 (6x6 from 4x4) ran blocked as fast or faster (0.11-0.37 / 0.19-0.37), hence the taps.
Nor does one onto output channels that do not fill whole blocks: onnxruntime's own computes over dY's positions
and the layer's channels, and its GEMM is tall there (25 taps a channel). With blocks of 8 (AVX2), 2 threads, batch 64
(ConvTranspose / blocked): 16 -> 6 channels, 14x14 from 10x10 0.66 / 0.80 ms, 'same' over 14x14 1.09 / 1.23, 16x16
from 12x12 0.74 / 1.15, 20 -> 6 0.71 / 1.20; onto whole blocks the blocked Conv wins: 16 -> 8 0.84 / 0.80, 32 -> 16
2.08 / 1.80, 64 -> 32 6.15 / 4.73; 3x3 ones padded from 12 to 16 channels still win (1.01 / 0.63)."""
INT64_MIN = np.iinfo(np.int64).min
CHUNK_BYTES = 2 * 1024 * 1024
"""An unfold of at least `MIN_CHUNKS` times this at the expected batch is made and multiplied chunk by chunk
over the batch, each chunk about this size (one core's L2 here), so that the products read it from the cache rather
than from memory. Steps chunked / whole (paired, both orders): LeNets on 3x32x32, 19 MB unfolded at batch 64, 0.90-0.94
(4 to 16 chunks alike); a ResNet-style CNN's plain 3x3 unfolds (38 MB, 16 channels over 32x32) 0.92; LeNet-5 at batch
256 (26 MB) 0.93-1.0, at 128 (13 MB) 0.985-1.0, at 64 (6.4 MB) 1.02-1.04 in 3 chunks, and 9.6 MB (3x32x32 at batch 32)
0.98-1.02 in 4, hence the floor."""
MIN_CHUNKS = 6
MAX_CHUNKS = 16


@functools.cache
def block_size() -> int:
    """MLAS's channel block on this machine (16 with AVX-512, 8 with AVX2), read from the shape
    `ReorderInput` gives 4 channels; 0 where onnxruntime has no NCHWc kernels."""
    graph = helper.make_graph([helper.make_node("ReorderInput", ["x"], ["y"], domain=DOMAIN)], "block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        block = int(session.run(None, {"x": np.zeros((1, 4, 1, 1), np.float32)})[0].shape[1])
    except Exception:  # any failure means: no NCHWc here
        return 0
    return block if block in (8, 16) else 0


def vector_extension() -> str | None:
    """"AVX-512" or "AVX2", as MLAS's channel block tells them apart (None: no NCHWc kernels, another CPU)."""
    return {16: "AVX-512", 8: "AVX2"}.get(block_size())


def _up(n: int, block: int) -> int:
    return -(-n // block) * block


def _layout(c_in: int | None, c_out: int, taps: int, positions: int | None, spread: float, block: int,
            images: int | None = None) -> str | None:
    """'blocked' (input reordered, OIHWBiBo filter), 'nchw' (NCHW input read directly, OIHWBo filter), 'padded'
    (input channels known only at run time, padded there to the block, then blocked), or None where the im2col
    Conv (or ConvTranspose) is as fast (module docstring); `spread`: output positions per input position of a
    ConvTranspose written as a Conv (1 for a Conv); `images`: the input's batch, where static."""
    if (positions is not None and positions < MIN_POSITIONS) or _up(c_out, block) / c_out * spread > MAX_WASTE:
        return None
    if c_in is None:
        return "padded" if images is not None and images >= MIN_IMAGES_PADDED else None
    if c_in >= block:
        return "blocked" if c_in % 4 == 0 and _up(c_in, block) <= MAX_CHANNEL_PADDING * c_in else None
    return "nchw" if taps >= MIN_TAPS_UNBLOCKED else None


def _static(dims: Dims | None) -> list[int] | None:
    return dims if dims is not None and all(isinstance(d, int) for d in dims) else None  # type: ignore[return-value]


def _weight_dims(dims: Dims | None, conv: bool) -> list[int | None] | None:
    """A 2-D layer's weight dims, static but for a Conv's input channels (None: known at run time)."""
    if dims is None or len(dims) != 4 or not all(isinstance(d, int) for d in (dims[0], *dims[2:])):
        return None
    if isinstance(dims[1], int):
        return list(dims)  # type: ignore[arg-type]
    return [dims[0], None, *dims[2:]] if conv else None  # type: ignore[list-item]


def _positions(shapes: dict[str, tuple[int, Dims | None]], name: str) -> int | None:
    """Positions of a sample of a 4-D tensor, when its spatial dims are known."""
    dims = shapes.get(name, (0, None))[1]
    spatial = _static(dims[2:]) if dims is not None and len(dims) == 4 else None
    return spatial[0] * spatial[1] if spatial else None


def blocked_convs(model: onnx.ModelProto, block: int | None = None) -> onnx.ModelProto:
    """Every 2-D float Conv with a weight input (and ConvTranspose of stride 1, the input gradient of a Conv)
    that pays (`_layout`) rewritten as ReorderInput -> nchwc Conv -> ReorderOutput; returns a rewritten copy,
    or `model` itself when none pays or onnxruntime has no NCHWc kernels (`block` overrides `block_size()`)."""
    block = block_size() if block is None else block
    if not block:
        return model
    graph = model.graph
    given = tensor_types(graph)
    inferred: dict[str, tuple[int, Dims | None]] | None = None
    constant = {t.name for t in graph.initializer}
    constant.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)
    swaps = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Transpose" and n.domain in ("", "ai.onnx")
             and ints_attr(n, "perm") == [1, 0, 2, 3]}
    plan = []
    for k, n in enumerate(graph.node):
        if n.domain not in ("", "ai.onnx") or n.op_type not in ("Conv", "ConvTranspose") or len(n.input) < 2 \
                or n.input[1] in constant:
            continue
        shapes = given
        if n.op_type == "Conv" and _static(given.get(n.input[1], (0, None))[1]) is None:
            if inferred is None:  # a weight computed in the graph (a weight gradient's Conv): its batch, or
                # more, unknown to value_info; the images (its input's batch) are known only to inference
                inferred = tensor_types(infer_shapes_safely(model) or graph)
            shapes = inferred
        elem, dims = shapes.get(n.input[1], (0, None))
        if elem != TensorProto.FLOAT or next((a.s for a in n.attribute if a.name == "auto_pad"), b"NOTSET") != \
                b"NOTSET":
            continue
        group = int_attr(n, "group", 1)
        if group != 1:
            if _depthwise(n, dims, group, block):
                plan.append((k, "depthwise", group, None, dims[2], dims[3], None))  # type: ignore[index]
            continue
        wshape = _weight_dims(dims, n.op_type == "Conv")
        if wshape is None:
            continue
        m, c, kh, kw = wshape  # Conv: [outputs, inputs, kh, kw]; ConvTranspose: [inputs, outputs, kh, kw]
        pads = ints_attr(n, "pads") or [0, 0, 0, 0]
        if n.op_type == "ConvTranspose":
            if any(v != 1 for v in (ints_attr(n, "strides") or []) + (ints_attr(n, "dilations") or [])) or \
                    any(ints_attr(n, "output_padding") or []) or ints_attr(n, "output_shape") is not None or \
                    any(p > size - 1 for p, size in zip(pads, (kh, kw, kh, kw))):
                continue
            m, c = c, m
        positions, spread = _positions(shapes, n.output[0]), 1.0
        if n.op_type == "ConvTranspose":  # dX has `grow` more rows and columns than dY (more positions to compute)
            grow = [size - 1 - b - e for size, b, e in zip((kh, kw), pads[:2], pads[2:])]
            given_positions = _positions(shapes, n.input[0])
            dims = shapes.get(n.output[0], (0, None))[1]
            if given_positions is None and positions and dims is not None:  # dY behind a pool's gradient: by dX's
                given_positions = (dims[2] - grow[0]) * (dims[3] - grow[1])  # type: ignore[operator]
            spread = positions / given_positions if positions and given_positions else \
                (1 + max(grow[0], 0) / ASSUMED_SIZE) * (1 + max(grow[1], 0) / ASSUMED_SIZE)
            too_spread = bool(positions and given_positions and spread > MAX_SPREAD)
            if kh * kw >= MIN_TAPS_UNBLOCKED and (m % block or too_spread):
                continue
        images = (shapes.get(n.input[0], (0, None))[1] or [None])[0]
        layout = _layout(c, m, kh * kw, positions, spread, block, images if isinstance(images, int) else None)
        if layout is not None:
            plan.append((k, layout, m, c, kh, kw, swaps.get(n.input[1]) if n.op_type == "Conv" else None))
    if not plan:
        return model
    out = rewrite_nodes(model, plan, functools.partial(_build, block=block))
    drop_unread(out)  # the swaps the filters read past
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return out


def _depthwise(n: onnx.NodeProto, dims: Dims | None, group: int, block: int) -> bool:
    """Whether `n` is a 2-D depthwise Conv (weight [C, 1, kh, kw], group C, kh possibly known only at run time:
    a depthwise weight gradient's Conv, nn.py `_depthwise_weight_grad`) or the input gradient of one (a
    ConvTranspose of stride and dilation 1, static kernel) over at least half a block of channels (padded with
    zero channels to whole blocks: 12 to 16 with AVX2, 72 or 120 to 80 or 128 with AVX-512). The blocked
    depthwise kernel ran every layer measured at 0.11-0.84x the time of onnxruntime's grouped im2col Conv,
    reorders included (2 threads, batch 16: 3x3 over 48x56x56 0.55, 96x28x28 0.64, the same at stride 2 0.37,
    192x14x14 0.84, 384x7x7 0.18; 5x5 over 96x28x28 0.41; 7x7 over 768x4x4 0.11), and those weight gradients at
    0.13-0.2x the swapped grouped Conv's (7x7 over 48x16x16 1.5 against 11.1 ms, 96x32x32 9.4 against 66)."""
    if dims is None or len(dims) != 4 or dims[0] != group or dims[1] != 1 or 2 * group < block:
        return False
    if n.op_type == "Conv":
        return True
    return isinstance(dims[2], int) and isinstance(dims[3], int) and \
        all(v == 1 for v in (ints_attr(n, "strides") or []) + (ints_attr(n, "dilations") or [])) and \
        not any(ints_attr(n, "output_padding") or []) and ints_attr(n, "output_shape") is None and \
        all(p <= size - 1 for p, size in zip(ints_attr(n, "pads") or [0] * 4, (*dims[2:], *dims[2:])))


def _filter(e: Nodes, w: str, cp_first: bool, flip: bool, pads: str | None, mp: int, taps: int, block: int,
            blocked: bool) -> str:
    """The weight in MLAS's filter layout for mp outputs over cp inputs: OIHWBiBo ([mp/B, cp/B, taps, Bi, Bo])
    when the inputs are blocked (cp a multiple of B), else OIHWBo ([mp/B, cp, taps, Bo]); from w as (mp, cp,
    taps), or as (cp, mp, taps) when `cp_first` (a ConvTranspose's weight; dY under a weight gradient's channel
    swap, read before its Transpose); the taps reversed when `flip` (a ConvTranspose's flipped kernel). `pads`:
    the Pad that brings w to those sizes (None: it has them); cp is left to the Reshapes (-1), so it may be known
    only at run time. Each Transpose moves one axis (onnxruntime copies those 2x faster than one 6-D
    permutation, and a (cp, mp, taps) weight of one output block needs one move: a 16-output weight gradient's
    dY over 10x10 at batch 64 took 40 µs against 110-240 µs as the swap and two moves)."""
    b = block
    if pads is not None:
        w = e("Pad", w, pads)
    if cp_first and blocked:  # (cp/B, Bi, mp/B, Bo, taps) -> (mp/B * cp/B, taps, Bi, Bo)
        if mp > b:
            w = e("Transpose", e("Reshape", w, e.axes([-1, b, mp // b, b * taps])), perm=[2, 0, 1, 3])
        w = e("Transpose", e("Reshape", w, e.axes([-1, b, b, taps])), perm=[0, 3, 1, 2])
    elif cp_first:  # (cp, mp, taps) -> (mp/B, cp, taps, Bo)
        if mp > b:
            w = e("Transpose", e("Reshape", w, e.axes([-1, mp // b, b * taps])), perm=[1, 0, 2])
        w = e("Transpose", e("Reshape", w, e.axes([-1, b, taps])), perm=[0, 2, 1])
    else:  # (mp, cp, taps) -> (mp/B, cp, taps, Bo)
        w = e("Transpose", e("Reshape", w, e.axes([mp // b, b, -1])), perm=[0, 2, 1])
        if blocked:  # (mp/B, cp/B, Bi, taps, Bo) -> (mp/B, cp/B, taps, Bi, Bo)
            w = e("Transpose", e("Reshape", w, e.axes([-1, b, taps, b])), perm=[0, 2, 1, 3])
    if flip:
        w = e("Slice", w, e.axes([-1]), e.axes([INT64_MIN]), e.axes([1]), e.axes([-1]))
    return w


def _build(n: onnx.NodeProto, layout: str, m: int, c: int | None, kh: int, kw: int, unswapped: str | None,
           taken: set[str], *, block: int) -> list[onnx.NodeProto]:
    """The blocked Conv replacing `n` (m outputs, c inputs, as a Conv; c None: known at run time); `unswapped`:
    the tensor whose channel swap (a Transpose) is `n`'s weight, which the filter then reads instead."""
    e = Nodes(n.name or n.output[0], taken)
    if layout == "depthwise":
        return _build_depthwise(n, e, m, (kh, kw), block)
    attrs = {"pads": ints_attr(n, "pads"), "kernel_shape": ints_attr(n, "kernel_shape")}
    transposed = n.op_type == "ConvTranspose"
    if transposed:  # the same map as a Conv over dY: kernel flipped, channels swapped
        attrs["pads"] = [size - 1 - p for p, size in zip(attrs["pads"] or [0, 0, 0, 0], (kh, kw, kh, kw))]
    else:
        attrs.update(strides=ints_attr(n, "strides"), dilations=ints_attr(n, "dilations"))
    mp = _up(m, block)
    x = n.input[0]
    cp_first = transposed or unswapped is not None
    if c is None:  # input channels padded to the block at run time: (-c) mod B zero channels
        extra = e("Mod", e("Neg", e("Slice", e("Shape", x), e.axes([1]), e.axes([2]))), e.axes([block]))
        top, left, bottom, right = attrs.pop("pads") or [0, 0, 0, 0]  # the same Pad frames x: no padded borders
        x = e("Pad", x, e("Concat", e.axes([0, 0, top, left, 0]), extra, e.axes([bottom, right]), axis=0))
        grow: list[str | int] = [extra, mp - m] if cp_first else [mp - m, extra]
        pads: str | None = e("Concat", e.axes([0, 0, 0, 0]), *(g if isinstance(g, str) else e.axes([g])
                                                                for g in grow), e.axes([0, 0]), axis=0)
    else:
        cp = _up(c, block) if layout == "blocked" else c
        grow = [cp - c, mp - m] if cp_first else [mp - m, cp - c]
        pads = e.axes([0, 0, 0, 0, *grow, 0, 0]) if any(grow) else None
    w = _filter(e, unswapped or n.input[1], cp_first, transposed, pads, mp, kh * kw, block, layout != "nchw")
    inputs = [e("ReorderInput", x, domain=DOMAIN, channels_last=0) if layout != "nchw" else x,
              e("Reshape", w, e.axes([mp, -1, kh, kw]))]
    if len(n.input) > 2 and n.input[2]:
        inputs.append(e("Pad", n.input[2], e.axes([0, mp - m])) if mp != m else n.input[2])
    y = e("Conv", *inputs, domain=DOMAIN, group=1, **{k: v for k, v in attrs.items() if v is not None})
    e("ReorderOutput", y, domain=DOMAIN, channels=m, channels_last=0, out=n.output[0])
    return e.nodes


def _build_depthwise(n: onnx.NodeProto, e: Nodes, channels: int, kernel: tuple[int, int], block: int
                     ) -> list[onnx.NodeProto]:
    """The blocked depthwise Conv replacing `n`: its filter [C/B, taps, B] (a ConvTranspose's taps reversed, its
    pads the Conv's over dY), in the weight's own shape; channels that do not fill the last block padded with zero
    channels (input, weight and bias), which ReorderOutput leaves out."""
    x, w, bias = n.input[0], n.input[1], n.input[2] if len(n.input) > 2 and n.input[2] else None
    padded = _up(channels, block)
    if padded != channels:
        extra = padded - channels
        x = e("Pad", x, e.axes([0, 0, 0, 0, 0, extra, 0, 0]))
        w = e("Pad", w, e.axes([0, 0, 0, 0, extra, 0, 0, 0]))
        bias = e("Pad", bias, e.axes([0, extra])) if bias is not None else None
    filt = e("Transpose", e("Reshape", w, e.axes([padded // block, block, -1])), perm=[0, 2, 1])
    attrs = {"pads": ints_attr(n, "pads"), "kernel_shape": ints_attr(n, "kernel_shape")}
    if n.op_type == "ConvTranspose":
        filt = e("Slice", filt, e.axes([-1]), e.axes([INT64_MIN]), e.axes([1]), e.axes([-1]))
        attrs["pads"] = [size - 1 - p for p, size in zip(attrs["pads"] or [0] * 4, (*kernel, *kernel))]
    else:
        attrs.update(strides=ints_attr(n, "strides"), dilations=ints_attr(n, "dilations"))
    inputs = [e("ReorderInput", x, domain=DOMAIN, channels_last=0), e("Reshape", filt, e("Shape", w))]
    if bias is not None:
        inputs.append(bias)
    y = e("Conv", *inputs, domain=DOMAIN, group=padded, **{k: v for k, v in attrs.items() if v is not None})
    e("ReorderOutput", y, domain=DOMAIN, channels=channels, channels_last=0, out=n.output[0])
    return e.nodes


def unfolded_weight_grads(model: onnx.ModelProto, known: dict[str, np.ndarray] | None = None,
                          rows: int | None = None) -> onnx.ModelProto:
    """The Conv rule's unfolded weight gradient (`_weight_grad_by_unfolding`: x convolved with a one-hot kernel per
    channel and tap, then per-sample products with dY summed over the batch) made in chunks of the batch where the
    unfold of `rows` samples (the batch expected) reaches `MIN_CHUNKS` times `CHUNK_BYTES`: sizes computed at run
    time, empty chunks allowed, each unfolded and multiplied after the other. Returns a rewritten copy, or `model`
    itself when nothing changes; `known`: values of graph inputs that are constants (a backward half's
    initializers shared with the forward)."""
    if not rows or default_opset(model) < 13:
        return model
    readers = Readers.of(model.graph)
    consts = {**(known or {}),
              **constant_values(model.graph, lambda t: t.data_type == TensorProto.INT64 or len(t.dims) == 4)}
    found = [(k, *f) for k, n in enumerate(model.graph.node) if (f := _unfolded_weight_grad(n, readers, consts))]
    if not found:
        return model
    shapes = tensor_types(infer_shapes_safely(model) or model.graph)
    plan = []
    for k, conv, dy, c, kernel in found:
        positions = _positions(shapes, conv.output[0])
        chunks = _chunks(rows, c, int(np.prod(kernel)), positions)
        if chunks > 1:  # only with the positions known
            plan.append((k, conv, dy, c, kernel, chunks, positions or 0))
    if not plan:
        return model
    out = rewrite_nodes(model, plan, _build_unfold)
    drop_unread(out)
    return out


def _unfolded_weight_grad(n: onnx.NodeProto, readers: Readers, consts: dict[str, np.ndarray]
                          ) -> tuple[onnx.NodeProto, str, int, list[int]] | None:
    """(the one-hot Conv, dY as [N, M, P], channels, kernel) when `n` ends the rule's per-sample unfolded weight
    gradient: ReduceSum over axis 0 of MatMul(dY, Transpose(Reshape(Conv(x, one-hot), [0, C*T, -1]))), each
    read by the next alone."""
    def const(name: str) -> list[int] | None:
        v = consts.get(name)
        return [int(i) for i in v.reshape(-1)] if v is not None and v.dtype == np.int64 else None

    if n.op_type != "ReduceSum" or n.domain or int_attr(n, "keepdims", 1) != 0 or len(n.input) < 2 \
            or const(n.input[1]) != [0]:
        return None
    product = readers.sole(n.input[0])
    if product is None or product.op_type != "MatMul" or product.domain:
        return None
    moved = readers.sole(product.input[1])
    if moved is None or moved.op_type != "Transpose" or ints_attr(moved, "perm") != [0, 2, 1]:
        return None
    flat = readers.sole(moved.input[0])
    conv = readers.sole(flat.input[0]) if flat is not None and flat.op_type == "Reshape" else None
    if conv is None or conv.op_type != "Conv" or conv.domain or len(conv.input) != 2 or \
            next((a.s for a in conv.attribute if a.name == "auto_pad"), b"NOTSET") != b"NOTSET":
        return None
    w = consts.get(conv.input[1])
    channels = int_attr(conv, "group", 1)
    if w is None or w.dtype != np.float32 or w.ndim != 4 or w.shape[1] != 1:
        return None
    kernel = [int(d) for d in w.shape[2:]]
    onehot = unfold_kernel(channels, kernel)
    if w.shape != onehot.shape or not np.array_equal(w, onehot) or \
            const(flat.input[1]) != [0, channels * kernel[0] * kernel[1], -1]:
        return None
    return conv, product.input[0], channels, kernel


def _batch_chunks(e: Nodes, x: str, dy: str, chunks: int) -> list[tuple[str, str]]:
    """(x, dY) in `chunks` parts along the batch, read off dY's first dim at run time: sample i goes to chunk
    i // ceil(N / chunks), so the first N % chunks chunks are a sample longer and, for fewer samples than chunks,
    the last ones empty."""
    batch = e("Gather", e("Shape", dy), e.const(0))
    longer = e("Cast", e("Less", e.axes(list(range(chunks))), e("Mod", batch, e.const(chunks))), to=TensorProto.INT64)
    sizes = e("Add", e("Div", batch, e.const(chunks)), longer)
    return list(zip(e.many("Split", x, sizes, count=chunks, axis=0), e.many("Split", dy, sizes, count=chunks, axis=0)))


def _chunks(rows: int | None, channels: int, taps: int, positions: int | None) -> int:
    """How many batch chunks an unfold of `rows` samples (`channels` x `taps` x `positions` floats each) is made
    in: about `CHUNK_BYTES` each, at most `MAX_CHUNKS`; 1 below `MIN_CHUNKS` of them or when a size is unknown."""
    chunks = (rows or 0) * channels * taps * (positions or 0) * 4 // CHUNK_BYTES
    return min(MAX_CHUNKS, chunks) if chunks >= MIN_CHUNKS else 1


def _build_unfold(n: onnx.NodeProto, conv: onnx.NodeProto, dy: str, c: int, kernel: list[int], chunks: int,
                  positions: int, taken: set[str]) -> list[onnx.NodeProto]:
    """`n`'s output, [M, C*T], from x's one-hot Conv in `chunks` parts of the batch: the rule's own nodes per chunk,
    P given where an empty chunk cannot resolve -1 (`unfolded_weight_grads`)."""
    e = Nodes(n.name or n.output[0], taken)
    taps = int(np.prod(kernel))
    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    sums = []
    for x, d in _batch_chunks(e, conv.input[0], dy, chunks):
        cols = e("Reshape", e("Conv", x, conv.input[1], **attrs), e.axes([0, c * taps, positions]))
        sums.append(e("ReduceSum", e("MatMul", d, e("Transpose", cols, perm=[0, 2, 1])), e.axes([0]), keepdims=0))
    e("Sum", *sums, out=n.output[0])
    return e.nodes
