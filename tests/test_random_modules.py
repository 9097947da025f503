"""Random torch modules through ORTModule: outputs and every gradient against torch eager.

The rule tests check each rule alone and the zoo checks fixed models; neither tries the runtime's graph
rewrites (`runtime/passes.py`, `nchwc.py`, `reductions.py`, `shape_folding.py`, the fused runs) on layer
combinations nobody wrote down. Here hypothesis stacks layers (convolutions of any stride, padding, dilation
and groups, pools with ceil mode and padding, norms, activations, residual blocks, concatenations, linear
layers, attention), picks a head (the output itself, a cross-entropy, a loss returned beside an output that
is also used inside), which parameters train, and whether the input needs a gradient. Each module runs three
calls, the last at another batch size: float64 compares tightly, float32 covers the kernels onnxruntime has
only for float (blocked convolutions). `HYPOTHESIS_PROFILE=large` explores many more.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parity import GRAD_FLOOR, relative
from torch import nn

from runtime import ORTModule

settings.register_profile("ci", max_examples=int(os.environ.get("GRADBUILDER_RANDOM_MODULES", "25")),
                          deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
settings.register_profile("large", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TOLERANCE = {torch.float64: 1e-7, torch.float32: 2e-4}
EXACT_ZERO = 1e-6
"""A float64 truth at most this fraction of the comparison's floor is a gradient that is zero in exact arithmetic
(a conv's bias before a training BatchNorm, whose output no per-channel shift changes; anything after a softmax over
one channel, a constant): a float32 result there is the rounding of terms that cancel, at any scale torch's own
happens to reach (two such biases found by the large profile: ours 6.5e-4 and 3.3e-3 of the floor, torch's
3.2e-5 and 2.7e-4, the truth 1e-14), so it is held to `ZERO_NOISE` of the floor instead of to 10x torch's."""
ZERO_NOISE = 1e-2


@dataclass(frozen=True)
class Layer:
    """One layer of the stack: what it is and the keyword arguments that make it."""

    kind: str
    args: tuple = ()

    def __repr__(self) -> str:
        return f"{self.kind}{dict(self.args)}"


class Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Branches(nn.Module):
    """Two branches of one input concatenated on the channels (the input read twice)."""

    def __init__(self, a: nn.Module, b: nn.Module):
        super().__init__()
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x)], 1)


class Gate(nn.Module):
    """x * sigmoid(conv(x)): the input read by a product and by the branch that scales it."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.conv(x))


class ChannelSoftmax(nn.Module):
    def __init__(self, log: bool):
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, 1) if self.log else torch.softmax(x, 1)


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1) if self.causal else None
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


class Stack(nn.Module):
    """The layers, then a head: 'out' (the host's cotangent), 'ce' (cross-entropy on labels), 'both' (the loss
    and the output it came from, which the host also differentiates), 'argmax' (the output and its argmax, an
    integer output that gets no gradient)."""

    def __init__(self, layers: list[nn.Module], head: str):
        super().__init__()
        self.layers = nn.Sequential(*layers)
        self.head = head

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        out = self.layers(x)
        if self.head == "out":
            return out
        if self.head == "argmax":
            return out, out.argmax(1)
        loss = nn.functional.cross_entropy(out, y)
        return loss if self.head == "ce" else (loss, out)


ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "silu": nn.SiLU,
               "leaky": lambda: nn.LeakyReLU(0.125), "elu": nn.ELU, "softplus": nn.Softplus}
"""LeakyReLU's slope is exact in float32: ONNX keeps it in a float attribute, so 0.1 would differ from torch's
double 0.1 by 1.5e-8, relatively."""
VOCABULARY = 11
DOUBLE_ACTIVATIONS = sorted(set(ACTIVATIONS) - {"gelu"})
"""onnxruntime has no double Erf kernel, so a double GELU cannot run."""


@st.composite
def conv(draw, c: int, h: int, w: int) -> tuple[Layer, tuple[int, int, int]] | None:
    k = draw(st.sampled_from([1, 2, 3, 5]))
    dilation = draw(st.sampled_from([1, 1, 1, 2]))
    stride = draw(st.sampled_from([1, 1, 2]))
    padding = draw(st.integers(0, (k * dilation) // 2))
    groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
    # up to 16 channels a group: onnxruntime's blocked kernels take 8 and 16 (runtime/nchwc.py)
    out = groups * draw(st.sampled_from([1, 2, 3, 4, 8, 16] if groups == 1 else [1, 2, 3]))
    span = dilation * (k - 1) + 1
    oh, ow = (h + 2 * padding - span) // stride + 1, (w + 2 * padding - span) // stride + 1
    if oh < 1 or ow < 1:
        return None
    args = (("in_channels", c), ("out_channels", out), ("kernel_size", k), ("stride", stride), ("padding", padding),
            ("dilation", dilation), ("groups", groups), ("bias", draw(st.booleans())))
    return Layer("conv", args), (out, oh, ow)


@st.composite
def pool(draw, c: int, h: int, w: int, average: bool) -> tuple[Layer, tuple[int, int, int]] | None:
    kind = draw(st.sampled_from(["maxpool", "maxpool", "avgpool"] if average else ["maxpool"]))
    k = draw(st.sampled_from([2, 2, 3]))
    stride = draw(st.sampled_from([k, k, 1, 2]))
    padding = draw(st.integers(0, k // 2))
    ceil = draw(st.booleans())
    args = [("kernel_size", k), ("stride", stride), ("padding", padding), ("ceil_mode", ceil)]
    if kind == "avgpool":
        args.append(("count_include_pad", draw(st.booleans())))

    def size(n: int) -> int:
        span = n + 2 * padding - k
        o = (-(-span // stride) if ceil else span // stride) + 1
        return o - 1 if ceil and (o - 1) * stride >= n + padding else o

    if min(h, w) < k or size(h) < 1 or size(w) < 1:
        return None
    return Layer(kind, tuple(args)), (c, size(h), size(w))


@st.composite
def image_layers(draw, c: int, h: int, w: int, depth: int, convs: bool, acts: list[str]
                 ) -> tuple[list[Layer], tuple[int, int, int]]:
    layers: list[Layer] = []
    kinds = (["conv", "conv", "conv", "pool", "pool", "pool", "act", "act", "bn", "residual", "branches", "convt",
              "upsample", "groupnorm", "gate", "shuffle", "softmax"] if convs else ["pool", "act", "bn", "softmax"])
    for _ in range(depth):
        choice = draw(st.sampled_from(kinds))
        if choice == "conv":
            made = draw(conv(c, h, w))
        elif choice == "pool":
            made = draw(pool(c, h, w, convs))
        elif choice == "act":
            made = Layer("act", (("name", draw(st.sampled_from(acts))),)), (c, h, w)
        elif choice == "bn":
            made = Layer("bn2d", (("num_features", c),)), (c, h, w)
        elif choice == "residual":
            k = draw(st.sampled_from([1, 3]))
            act = draw(st.sampled_from(acts))
            made = Layer("residual", (("channels", c), ("kernel_size", k), ("act", act))), (c, h, w)
        elif choice == "branches":
            a, b = draw(st.integers(1, 4)), draw(st.integers(1, 4))
            pooled = draw(st.booleans())
            made = Layer("branches", (("in_channels", c), ("a", a), ("b", b), ("pooled", pooled))), (a + b, h, w)
        elif choice == "convt":
            k, stride = draw(st.sampled_from([2, 3])), draw(st.sampled_from([1, 2]))
            padding = draw(st.integers(0, k // 2))
            out_pad = draw(st.integers(0, stride - 1))
            out = draw(st.integers(1, 6))
            args = (("in_channels", c), ("out_channels", out), ("kernel_size", k), ("stride", stride),
                    ("padding", padding), ("output_padding", out_pad))
            size = [(n - 1) * stride - 2 * padding + k + out_pad for n in (h, w)]
            made = (Layer("convt", args), (out, *size)) if min(size) >= 1 and max(size) <= 24 else None
        elif choice == "upsample":
            mode = draw(st.sampled_from(["nearest", "bilinear"]))
            made = Layer("upsample", (("scale_factor", 2), ("mode", mode))), (c, 2 * h, 2 * w)
            made = made if 2 * max(h, w) <= 24 else None
        elif choice == "groupnorm":
            groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
            made = Layer("groupnorm", (("num_groups", groups), ("num_channels", c))), (c, h, w)
        elif choice == "gate":
            made = Layer("gate", (("c", c),)), (c, h, w)
        elif choice == "shuffle":
            made = (Layer("shuffle", (("upscale_factor", 2),)), (c // 4, 2 * h, 2 * w)) if c % 4 == 0 else None
        else:
            made = Layer("softmax", (("log", draw(st.booleans())),)), (c, h, w)
        if made is not None:
            layers.append(made[0])
            c, h, w = made[1]
    return layers, (c, h, w)


@st.composite
def flat_layers(draw, d: int, depth: int, classes: int, acts: list[str]) -> list[Layer]:
    layers: list[Layer] = []
    for _ in range(depth):
        choice = draw(st.sampled_from(["linear", "linear", "act", "ln", "bn", "dropout"]))
        if choice == "linear":
            out = draw(st.integers(2, 12))
            layers.append(Layer("linear", (("in_features", d), ("out_features", out), ("bias", draw(st.booleans())))))
            d = out
        elif choice == "act":
            layers.append(Layer("act", (("name", draw(st.sampled_from(acts))),)))
        elif choice == "ln" and d >= 4:  # over 2 features its Jacobian is zero: every gradient before it is noise
            layers.append(Layer("ln", (("normalized_shape", d), ("elementwise_affine", draw(st.booleans())))))
        elif choice == "bn":
            layers.append(Layer("bn1d", (("num_features", d),)))
        else:
            layers.append(Layer("dropout", (("p", draw(st.sampled_from([0.0, 0.5]))),)))
    layers.append(Layer("linear", (("in_features", d), ("out_features", classes), ("bias", True))))
    return layers


@st.composite
def sequence_layers(draw, d: int, depth: int, double: bool, acts: list[str]) -> list[Layer]:
    layers: list[Layer] = []
    for _ in range(depth):
        choice = draw(st.sampled_from(["attn", "ff", "ln", "act"] + ([] if double else ["conv1d"])))
        if choice == "attn":
            heads = draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0]))
            causal = False if double else draw(st.booleans())
            layers.append(Layer("attn", (("d", d), ("heads", heads), ("causal", causal))))
        elif choice == "ff":
            layers.append(Layer("ff", (("d", d), ("hidden", draw(st.integers(4, 16))),
                                       ("act", draw(st.sampled_from(acts))))))
        elif choice == "ln":
            layers.append(Layer("ln", (("normalized_shape", d), ("elementwise_affine", draw(st.booleans())))))
        elif choice == "act":
            layers.append(Layer("act", (("name", draw(st.sampled_from(acts))),)))
        else:
            layers.append(Layer("conv1d_seq", (("d", d), ("kernel_size", draw(st.sampled_from([1, 3]))))))
    return layers


@dataclass(frozen=True)
class Spec:
    """A whole random case: input kind and shape, the layers, the head, what trains."""

    kind: str
    shape: tuple[int, ...]
    layers: tuple[Layer, ...]
    head: str
    classes: int
    frozen: tuple[int, ...]
    input_grad: bool
    seed: int
    training: bool = True
    threads: int = 1


@st.composite
def specs(draw, double: bool = False) -> Spec:
    """double: no GELU (onnxruntime has no double Erf) and no causal masks (torch's exporter has no double attention
    mask); convolutions, transposed ones and average pools are the runtime's written-out forms there
    (`runtime.functions`)."""
    acts = DOUBLE_ACTIVATIONS if double else sorted(ACTIVATIONS)
    kind = draw(st.sampled_from(["image", "image", "flat", "sequence", "tokens"]))
    classes = draw(st.integers(2, 5))
    if kind == "image":
        c, h, w = draw(st.sampled_from([1, 2, 3, 4, 8, 16])), draw(st.integers(4, 12)), draw(st.integers(4, 12))
        layers, (c2, h2, w2) = draw(image_layers(c, h, w, draw(st.integers(1, 5)), True, acts))
        last = layers[-1] if layers else None
        per_channel_norm = last is not None and last.kind == "groupnorm" and dict(last.args)["num_groups"] == c2
        if not per_channel_norm and draw(st.booleans()):  # the mean of a plane normalized alone is
            # its bias whatever the input: every gradient before it is zero in exact arithmetic, and a BatchNorm
            # after it scales rounding noise up to the outputs
            layers, h2, w2 = [*layers, Layer("adaptive", (("output_size", 1),))], 1, 1
        layers = [*layers, Layer("flatten"), *draw(flat_layers(c2 * h2 * w2, draw(st.integers(0, 2)), classes, acts))]
        shape: tuple[int, ...] = (c, h, w)
    elif kind == "flat":
        d = draw(st.integers(2, 16))
        layers, shape = draw(flat_layers(d, draw(st.integers(1, 4)), classes, acts)), (d,)
    else:  # a sequence of vectors, or of tokens embedded first; the last call is one step longer
        d, t = draw(st.sampled_from([4, 8])), draw(st.integers(2, 6))
        layers = [*draw(sequence_layers(d, draw(st.integers(1, 3)), double, acts)), Layer("mean_seq"),
                  Layer("linear", (("in_features", d), ("out_features", classes), ("bias", True)))]
        shape = (t, d)
        if kind == "tokens":
            layers = [Layer("embedding", (("num_embeddings", VOCABULARY), ("embedding_dim", d))), *layers]
            shape = (t,)
    head = draw(st.sampled_from(["out", "ce", "both", "argmax"]))
    frozen = tuple(draw(st.lists(st.integers(0, 40), max_size=3)))
    input_grad = kind != "tokens" and draw(st.booleans())
    return Spec(kind, shape, tuple(layers), head, classes, frozen, input_grad, draw(st.integers(0, 2**16)),
                draw(st.sampled_from([True, True, False])), draw(st.sampled_from([1, 1, 2])))


PLAIN: dict[str, type[nn.Module]] = {
    "conv": nn.Conv2d,
    "maxpool": nn.MaxPool2d,
    "avgpool": nn.AvgPool2d,
    "bn2d": nn.BatchNorm2d,
    "bn1d": nn.BatchNorm1d,
    "embedding": nn.Embedding,
    "convt": nn.ConvTranspose2d,
    "upsample": nn.Upsample,
    "groupnorm": nn.GroupNorm,
    "shuffle": nn.PixelShuffle,
    "adaptive": nn.AdaptiveAvgPool2d,
    "linear": nn.Linear,
    "ln": nn.LayerNorm,
    "dropout": nn.Dropout,
}
"""Layers made from their arguments alone."""


def make(layer: Layer) -> nn.Module:
    a = dict(layer.args)
    if layer.kind in PLAIN:
        return PLAIN[layer.kind](**a)
    match layer.kind:
        case "act":
            return ACTIVATIONS[a["name"]]()
        case "residual":
            c, k = a["channels"], a["kernel_size"]
            return Residual(nn.Sequential(nn.Conv2d(c, c, k, padding=k // 2), ACTIVATIONS[a["act"]]()))
        case "branches":
            c = a["in_channels"]
            first = nn.Sequential(nn.Conv2d(c, a["a"], 1), nn.ReLU())
            second = nn.Sequential(nn.ReLU(), nn.MaxPool2d(3, 1, 1)) if a["pooled"] else nn.Identity()
            return Branches(first, nn.Sequential(second, nn.Conv2d(c, a["b"], 3, padding=1)))
        case "flatten":
            return nn.Flatten()
        case "gate":
            return Gate(a["c"])
        case "softmax":
            return ChannelSoftmax(a["log"])
        case "attn":
            return Residual(SelfAttention(a["d"], a["heads"], a["causal"]))
        case "ff":
            d = a["d"]
            hidden = a["hidden"]
            return Residual(nn.Sequential(nn.Linear(d, hidden), ACTIVATIONS[a["act"]](), nn.Linear(hidden, d)))
        case "conv1d_seq":
            return SeqConv(a["d"], a["kernel_size"])
        case "mean_seq":
            return MeanSeq()
    raise AssertionError(layer.kind)


class SeqConv(nn.Module):
    """A Conv1d over the time axis of [N, T, D] (two transposes around it)."""

    def __init__(self, d: int, k: int):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, padding=k // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class MeanSeq(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


def build(spec: Spec, dtype: torch.dtype) -> Stack:
    torch.manual_seed(spec.seed)
    model = Stack([make(layer) for layer in spec.layers], spec.head).to(dtype).train(spec.training)
    for m in model.modules():
        if isinstance(m, nn.Dropout) and spec.training:
            m.p = 0.0  # a Dropout that drops draws other numbers than torch: only an inactive one compares
    params = list(model.parameters())
    for i in spec.frozen:
        if params:
            params[i % len(params)].requires_grad_(False)
    return model


@dataclass
class Call:
    """One call of one copy: its input (for the input gradient), outputs, then gradients and buffers."""

    x: torch.Tensor
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _call(model: nn.Module, params: nn.Module, spec: Spec, batch: int, dtype: torch.dtype, step: int,
          grid: torch.dtype | None = None) -> Call:
    """Call `model` on the step's batch and backpropagate a fixed random cotangent per output that requires grad
    (the loss gets 1). Values are drawn in float64 and rounded to `grid` (default: dtype), so a float64 copy
    sees exactly the float32 copies' values."""
    grid = grid or dtype
    for p in params.parameters():
        p.grad = None
    g = torch.Generator().manual_seed(spec.seed + step)
    shape = (batch, spec.shape[0] + (step == 2), *spec.shape[1:]) if spec.kind in ("sequence", "tokens") else (
        batch, *spec.shape)
    if spec.kind == "tokens":
        x = torch.randint(0, VOCABULARY, shape, generator=g)
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(grid).to(dtype)
        x.requires_grad_(spec.input_grad)
    y = torch.randint(0, spec.classes, (batch,), generator=g)
    result = model(x, y)
    outputs = list(result) if isinstance(result, tuple) else [result]
    live = [o for o in outputs if o.requires_grad]
    cotangents = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(grid).to(dtype) if o.dim() else
                  torch.ones((), dtype=dtype) for o in live]
    if live:
        torch.autograd.backward(live, cotangents)
    grads = {f"gradient of {n}": p.grad for n, p in params.named_parameters()} | {"input gradient": x.grad}
    buffers = {f"buffer {n}": b.detach().clone() for n, b in params.named_buffers() if b.is_floating_point()}
    return Call(x, outputs, grads, buffers)


def _compare(what: str, ours: torch.Tensor | None, theirs: torch.Tensor | None, truth: torch.Tensor | None,
             tol: float, floor: float) -> None:
    """ours against theirs (torch at the same precision) relative to the largest reference value, floored.

    With a float64 `truth`, float32 is judged as torch's own float32 is: ours may be as far from the truth as
    `tol` or 10x torch's own distance from it, whichever is more (a batch-of-3 norm or a sum that cancels to
    zero amplifies rounding in both); where the truth is zero in exact arithmetic, `ZERO_NOISE` of the floor."""
    assert (ours is None) == (theirs is None), f"{what}: {'missing' if ours is None else 'unexpected'}"
    if ours is None or theirs is None:
        return
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, f"{what}: {ours.shape} vs torch's {theirs.shape}"
    assert torch.isfinite(theirs).all(), f"{what}: torch's value is not finite"
    if truth is None:
        err = relative(ours, theirs, floor)
        assert err <= tol, f"{what}: relative difference {err:.2e} > {tol:.0e}"
        return
    err, torch_err = relative(ours, truth, floor), relative(theirs, truth, floor)
    zero = truth.numel() == 0 or float(truth.abs().max()) <= EXACT_ZERO * floor
    allowed = max(tol, 10 * torch_err, ZERO_NOISE if zero else 0.0)
    assert err <= allowed, (
        f"{what}: relative difference from float64 {err:.2e}, torch's float32 {torch_err:.2e} (allowed {tol:.0e} "
        f"or 10x torch's{f', or {ZERO_NOISE:.0e} for a gradient zero in exact arithmetic' if zero else ''})")


def _floor(values: list[torch.Tensor | None]) -> float:
    """GRAD_FLOOR of the largest of `values` (at least 1e-12)."""
    scale = max((float(v.abs().max()) for v in values if v is not None and v.numel()), default=0.0)
    return max(GRAD_FLOOR * scale, 1e-12)


def check(spec: Spec, dtype: torch.dtype) -> None:
    """Three calls (batch 3, 3, then 5) of the ORTModule and of torch eager from the same weights, each compared
    after its backward: outputs, whether they require grad, every gradient, the buffers (BatchNorm's
    statistics). float32 also runs a float64 copy, the truth both are measured against."""
    model = build(spec, dtype)
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double() if dtype != torch.float64 else None
    ort = ORTModule(model, threads=spec.threads, check_export=False)
    tol = TOLERANCE[dtype]
    for step, batch in enumerate((3, 3, 5)):
        ours = _call(ort, model, spec, batch, dtype, step)
        theirs = _call(reference, reference, spec, batch, dtype, step)
        truth = None if exact is None else _call(exact, exact, spec, batch, torch.float64, step, dtype)
        for i, (o, t) in enumerate(zip(ours.outputs, theirs.outputs, strict=True)):
            assert o.requires_grad == t.requires_grad, f"step {step}: output {i} requires_grad {o.requires_grad}"
            _compare(f"step {step}: output {i}", o.detach(), t.detach(),
                     None if truth is None else truth.outputs[i].detach().to(dtype), tol, 1e-6)
        for part in ("grads", "buffers"):
            got, want = getattr(ours, part), getattr(theirs, part)
            assert got.keys() == want.keys()
            floor = _floor(list(want.values()))
            for what, g in got.items():
                exact_value = None if truth is None else getattr(truth, part)[what]
                _compare(f"step {step}: {what}", g, want[what], None if exact_value is None else exact_value.to(dtype),
                         tol, floor)
    assert ort.stats.get("fallbacks", 0) == 0


@given(spec=specs(double=True))
def test_random_modules_match_torch_float64(spec: Spec) -> None:
    check(spec, torch.float64)


@given(spec=specs())
def test_random_modules_match_torch_float32(spec: Spec) -> None:
    check(spec, torch.float32)


def test_generator_reaches_every_layer() -> None:
    """The strategy draws each layer kind and head (a test of the test: nothing silently never drawn)."""
    seen: set[str] = set()
    heads: set[str] = set()

    @settings(max_examples=300, derandomize=True, database=None)
    @given(spec=specs())
    def collect(spec: Spec) -> None:
        seen.update(layer.kind for layer in spec.layers)
        heads.add(spec.head)

    collect()
    kinds = {"conv", "maxpool", "avgpool", "act", "bn2d", "bn1d", "residual", "branches", "flatten", "linear",
             "ln", "dropout", "attn", "ff", "conv1d_seq", "mean_seq", "convt", "upsample", "groupnorm", "gate",
             "shuffle", "softmax", "adaptive", "embedding"}
    assert kinds <= seen and heads == {"out", "ce", "both", "argmax"}, (kinds - seen, heads)
