"""Training Dropouts whose masks are drawn on the host, fed to onnxruntime as boolean inputs.

onnxruntime's CPU Dropout draws its mask one element at a time on one thread (a linear congruential
generator behind `std::uniform_real_distribution`): ~7 ns an element here, 7.5 ms of a 2-layer encoder's
21 ms forward, while the other core waits. numpy's SFC64 fills the same mask at ~0.65 ns an element (16 bits
drawn an element, 32 where they tie with the threshold's: `_kept`), and the rewritten node, `mask * x / (1 -
ratio)` (`passes.dropout_output`: bit for bit onnxruntime's Dropout, and the formula backward already recomputes
Dropout outputs with), runs on every intra-op thread.

A mask has its Dropout input's shape, which the host only knows once onnxruntime has run the graph at those
input sizes. So `MaskedRunner` keeps two sessions: the forward as it is, plus a `Shape` output for each
rewritten Dropout's input, runs the first call at each new set of input sizes (its masks drawn by onnxruntime),
without onnxruntime's memory arena (which would hold on to that call's memory); the rewritten forward runs every
later call at sizes already seen. The call that exported runs both: its masks are drawn as torch's dropout
draws them from the state torch's run of the call began with (`MaskedRunner.torch_once`), so that the first
call's check can compare onnxruntime's outputs with torch's (`checks`); a mask held feature-major is the
transpose of torch's (`Mask.transposed`).

A call's masks can be drawn again from its seed (`Redraw`, which the runner hands over as `drew`): a backward
recomputing a checkpointed region gets its Dropouts' masks back without the forward keeping them
(`session.ForwardState.redraw`), as torch's checkpoint does from its saved RNG state, and torch's module computing
the call again for a create_graph backward gets the same numbers (`replay`).

torch's fills the export tagged (`torch_draws`: rand, randn_like, normal_, bernoulli_, exponential_) are fed the
same way, drawn by torch's kernels (from a generator seeded by the call's seed; as torch's from its default
generator under `torch_masks` and at the call that exported).

Each call takes its seed from torch's default generator, as torch's own dropout does, and so do the first
forward's Dropouts and fills (their `seed` attribute, drawn when the runner is made): after `torch.manual_seed`,
ORTModule's masks are the same from run to run. The graph's other random ops (`seeded_random_ops`: randint_like's
uniforms, rrelu's), those inside If and Loop bodies too, and the Dropouts the host does not mask (in graphs with
bodies, or of a non-constant ratio) get their `seed` the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from onnxruntime.capi import _pybind_state as C

from gradbuilder.graph import graph_nodes
from gradbuilder.inference import infer_shapes

from . import exchange, feature_major, torch_draws
from .ort_session import DISABLED_OPTIMIZERS, RANDOM_OPS, Runner, SessionConfig, draws_random
from .passes import (
    FLOATS,
    constant_values,
    default_opset,
    drop_dead,
    dropout_output,
    fresh_name,
    has_subgraph,
    names_in_use,
    tensor_types,
    training_ratio,
    written_rate,
)

MAX_SIZES = 64
"""Sets of input sizes whose mask shapes a runner remembers; calls at further new sizes keep onnxruntime's
Dropout (sequences of ever new lengths would otherwise grow the table without end)."""


@dataclass(frozen=True)
class Mask:
    """One rewritten Dropout: the graph input its mask is fed to, the tensor whose shape it has (the Dropout's
    input), the smallest 32-bit draw that keeps an element (round(ratio * 2^32): drop probability exact to
    2^-33), and the Dropout's output."""

    input: str
    source: str
    threshold: int
    output: str
    ratio: float
    draw: tuple[str, float, float, int] | None = None
    """A random op drawn by the host instead (a tagged fill; under `SessionConfig.torch_masks` any randn_like or
    rand_like): torch's fill ("normal_", "uniform_", "exponential_", or "bernoulli_" for a rand_like compared with
    p), its two parameters and the ONNX element type; its values are fed as the op's output."""
    transposed: bool = False
    """Whether the Dropout's input is the transpose of torch's (`feature_major.TRANSPOSED`): torch's mask for the
    same draws is drawn in the reversed shape, then transposed."""
    known: bool = True
    """Whether the draw is torch's own: a Dropout's mask, or a fill the export tagged (`torch_draws`). An untagged
    randn_like or rand_like may be another function's uniforms (randint's, rrelu's, cauchy_'s), which torch draws
    with other kernels: the host draws it as rand_like, not as torch did."""


LIKE_DRAWS = {"RandomNormalLike": ("normal_", "mean", 0.0, "scale", 1.0),
              "RandomUniformLike": ("uniform_", "low", 0.0, "high", 1.0)}
"""randn_like and rand_like as exported, and torch's fill for each (`torch.empty_like(x).normal_()`)."""


def mask_dropouts(model: onnx.ModelProto, as_torch: bool = False) -> tuple[onnx.ModelProto, list[Mask]]:
    """A copy of `model` whose training Dropouts (main graph, opset 12+, constant ratio strictly between 0 and
    1, no `seed` attribute) take their mask as a new boolean graph input (named as the Dropout's mask output,
    which leaves the graph outputs); returns `model` itself and no masks when none qualifies. torch's fills the
    export tagged (`torch_draws`: rand, randn_like, normal_, bernoulli_, exponential_; main graph, unseeded) are
    fed by the host too, their outputs becoming graph inputs (`Mask.draw`). `as_torch`: torch's arithmetic for the
    kept values, and untagged randn_like and rand_like fed as well; the masks in graph order."""
    if default_opset(model) < 12 or any(has_subgraph(n) for n in model.graph.node):
        return model, []
    consts = constant_values(model.graph, lambda t: not t.dims)
    chosen: list[tuple[int, float, int]] = []
    for k, n in enumerate(model.graph.node):
        if n.op_type != "Dropout" or n.domain not in ("", "ai.onnx") or any(a.name == "seed" for a in n.attribute):
            continue
        ratio = training_ratio(n, consts)
        threshold = round(ratio * 2.0 ** 32) if ratio is not None else 0
        if ratio is not None and 0 < threshold < 2 ** 32:
            chosen.append((k, ratio, threshold))
    fills = [k for k, n in enumerate(model.graph.node) if n.op_type not in LIKE_DRAWS
             and torch_draws.tagged(n) is not None]  # exponential_: fed whole, its uniforms unread then
    likes = sorted([k for k, n in enumerate(model.graph.node) if n.op_type in LIKE_DRAWS
                    and (as_torch or torch_draws.tagged(n) is not None)
                    and n.domain in ("", "ai.onnx") and all(a.name != "seed" for a in n.attribute)
                    and torch_draws.under_a_draw(n) is None] + fills)
    if not chosen and not likes:
        return model, []
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    taken = names_in_use(g)
    types = tensor_types(g)
    nodes = list(g.node)
    if any(nodes[k].input[0] not in types for k in likes):  # a like op's type is its input's, which may be unsaid
        types = {**tensor_types(infer_shapes(out).graph), **types}
    masks: list[Mask] = [_fed_draw(nodes, k, g, types) for k in likes]
    for k in reversed(likes):
        del nodes[k]
    for k, ratio, threshold in reversed(chosen):
        k -= sum(1 for like in likes if like < k)
        if as_torch:
            ratio = written_rate(ratio)
        n = nodes[k]
        x, y = n.input[0], n.output[0]
        mask = n.output[1] if len(n.output) > 1 and n.output[1] else fresh_name(f"{y}/host_mask", taken)
        elem, dims = types.get(x, (0, None))
        nodes[k:k + 1] = dropout_output(x, mask, ratio, y, g, taken, elem if elem in FLOATS else None, as_torch)
        g.input.append(helper.make_tensor_value_info(mask, TensorProto.BOOL, dims))
        masks.append(Mask(mask, x, threshold, y, ratio,
                          transposed=any(p.key == feature_major.TRANSPOSED for p in n.metadata_props)))
    fed = {m.input for m in masks}
    kept = [o for o in g.output if o.name not in fed]
    nodes = [n for n in nodes if torch_draws.under_a_draw(n) not in fed]  # unread: not drawn (drop_dead keeps them)
    del g.node[:]
    g.node.extend(drop_dead(nodes, [], {o.name for o in kept}) if fills else nodes)
    del g.output[:]
    g.output.extend(kept)
    order = {n.output[0]: k for k, n in enumerate(model.graph.node) if n.output}
    return out, sorted(masks, key=lambda m: order.get(m.output, -1))


def _fed_draw(nodes: list[onnx.NodeProto], k: int, g: onnx.GraphProto, types: Mapping) -> Mask:
    """A random op whose values the host draws as torch does: its output becomes a graph input. One of torch's
    fills with parameters (`torch_draws`) is drawn as that fill, with them as written (bernoulli_(p): torch's
    Bernoulli kernel, not its uniforms compared; the op's uniforms are fed as u = 1 - mask, which its `Less(u, p)`
    turns back into the mask); a randn_like or rand_like as `normal_` or `uniform_` from its attributes."""
    n = nodes[k]
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    elem, dims = types.get(n.input[0], (0, None))
    elem = int(attrs.get("dtype", elem or TensorProto.FLOAT))
    g.input.append(helper.make_tensor_value_info(n.output[0], elem, dims))
    torch_fill = torch_draws.tagged(n)
    if torch_fill is None:
        fill, first, first_default, second, second_default = LIKE_DRAWS[n.op_type]
        draw = (fill, float(attrs.get(first, first_default)), float(attrs.get(second, second_default)), elem)
    else:
        draw = (*torch_fill, elem)
    return Mask(n.output[0], n.input[0], 0, n.output[0], 0.0, draw, known=torch_fill is not None)


@dataclass(frozen=True, slots=True)
class Redraw:
    """How one call's host draws are drawn again, the same (its seed and mask shapes), rather than the draws
    themselves: a call's ForwardState keeps it at no memory cost."""

    runner: MaskedRunner
    shapes: Mapping[str, tuple[int, ...]]
    seed: int | torch.Tensor
    """An integer seed (numpy's masks), or torch's generator state the draws were torch's from (`torch_masks`, the
    call that exported)."""

    def __call__(self, only: Collection[str] | None = None) -> dict[str, C.OrtValue]:
        """The masks and fills named (all for None), as the call drew them."""
        return self.runner.draw(self.shapes, self.seed, only)


@dataclass(frozen=True, slots=True)
class Kept:
    """A call's draws as onnxruntime drew them (the first call at new sizes runs the forward as it is), held by the
    call's ForwardState until its backward, in the form the host feeds them (a bernoulli_ fill's as 1 - its draws)."""

    runner: MaskedRunner
    values: Mapping[str, C.OrtValue]

    def __call__(self, only: Collection[str] | None = None) -> dict[str, C.OrtValue]:
        return {name: v for name, v in self.values.items() if only is None or name in only}


class MaskedRunner:
    """A forward's Runner whose training Dropouts take host-drawn masks at input sizes seen before (see the
    module docstring); the same `run` as `Runner`, the masks among the outputs where the graph returned them."""

    def __init__(self, model: onnx.ModelProto, masked: onnx.ModelProto, masks: list[Mask], config: SessionConfig,
                 what: str, disabled: Sequence[str] = DISABLED_OPTIMIZERS,
                 shapes: Mapping[tuple[tuple[int, ...], ...], dict[str, tuple[int, ...]]] | None = None):
        self.masks = masks
        self._drops = [m for m in masks if m.draw is None]
        """The Dropouts' masks, drawn from the call's seed by SFC64 (the fills by torch's kernels)."""
        self.output_names = [o.name for o in model.graph.output]
        self._sources = list(dict.fromkeys(m.source for m in masks))
        self._model: onnx.ModelProto | None = model
        self._plain: Runner | None = None
        inits = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in inits]
        self._masked_model: onnx.ModelProto | None = masked
        self.draws_random = draws_random(masked.graph)
        """Whether onnxruntime draws random numbers beside the host's masks (unmasked Dropouts, random ops)."""
        self.draws_as_torch = not self.draws_random and all(m.known for m in masks)
        """Whether a run's random numbers are all drawn by the host as torch draws them (`Mask.known`), so that from
        the same RNG state its outputs are torch's, and torch's module computing the call again takes each draw
        where it makes it (`replay`)."""
        self.drew: Redraw | Kept | None = None
        """The draws of the call run last: how to draw them again where the host drew them, else as onnxruntime drew
        them; the session takes them for that call's ForwardState as soon as it returns (`session._drew`)."""
        self.torch_once: torch.Tensor | None = None
        """A generator state the next call's masks and fills are drawn from as torch draws them, whatever
        `torch_masks` says (`TrainingSession.draw_masks_as_torch`: the first call's check compares its outputs with
        torch's run from that state)."""
        self._masked: Runner | None = None
        self._config, self._what, self._disabled = config, what, disabled
        self._sized = [i.name for i in model.graph.input if not _static(i)]
        """Graph inputs whose sizes may change between calls: the key of `shapes`."""
        self.shapes: dict[tuple[tuple[int, ...], ...], dict[str, tuple[int, ...]]] = dict(shapes or {})
        """Per set of input sizes, each masked Dropout input's shape (from the forward as it is)."""
        self._fed = {m.input for m in masks}
        self._shape_names: list[str] = []
        self._kept_names: list[str] = []
        """The plain forward's outputs holding its draws, one a mask (`Kept`)."""

    @property
    def torch_masks(self) -> bool:
        """Whether every call draws as torch's (`SessionConfig.torch_masks`; the export laid the masks out as torch
        does: `attention.lean_attention`)."""
        return self._config.torch_masks

    @property
    def plain(self) -> Runner:
        """The forward as it is plus the Dropout inputs' shapes and its draws (`Kept`), made when first needed (its
        Dropouts' seeds drawn then): a runner given every shape it meets never makes it."""
        if self._plain is None:
            assert self._model is not None
            probe = onnx.ModelProto()
            probe.CopyFrom(self._model)
            self._model = None
            masked_outputs = {m.output for m in self.masks}
            for n in probe.graph.node:  # with torch_masks this run only tells shapes: torch's generator untouched
                if n.output and n.output[0] in masked_outputs and n.op_type in ("Dropout", *LIKE_DRAWS):
                    seed = 0 if self._config.torch_masks else _seed()  # RandomUniformLike's seed is a float
                    n.attribute.append(helper.make_attribute("seed", seed if n.op_type == "Dropout"
                                                             else float(seed % (1 << 24))))
            self._keep_draws(probe.graph)
            taken = names_in_use(probe.graph)
            for x in self._sources:
                name = fresh_name(f"{x}/host_mask_shape", taken)
                probe.graph.node.append(helper.make_node("Shape", [x], [name], name=f"{name}_node"))
                probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT64, [None]))
                self._shape_names.append(name)
            self._plain = Runner(probe, dataclasses.replace(self._config, arena=False), self._what, self._disabled)
        return self._plain

    def _keep_draws(self, g: onnx.GraphProto) -> None:
        """The plain forward `g` returning its Dropouts' masks (named as the masked graph's inputs) and its fills."""
        dropped = {m.output: m for m in self._drops}
        for n in g.node:
            m = dropped.get(n.output[0]) if n.op_type == "Dropout" and n.output else None
            if m is not None and (len(n.output) < 2 or not n.output[1]):
                del n.output[1:]
                n.output.append(m.input)
        returned = {o.name for o in g.output}
        for m in self.masks:
            if m.input not in returned:
                elem = TensorProto.BOOL if m.draw is None else m.draw[3]
                g.output.append(helper.make_tensor_value_info(m.input, elem, None))
        self._kept_names = [m.input for m in self.masks]

    def mask_shapes(self, feeds: Mapping[str, C.OrtValue]) -> Mapping[str, tuple[int, ...]] | None:
        """The shapes of a call's masks and fills, by the tensor each has the shape of; None at sizes not seen yet
        (where onnxruntime draws them)."""
        return self.shapes.get(tuple([tuple(feeds[n].shape()) for n in self._sized if n in feeds]))

    @property
    def session(self) -> ort.InferenceSession:
        return self.plain.session

    def run(self, feeds: Mapping[str, C.OrtValue], outputs: Sequence[str] | None = None) -> list[C.OrtValue]:
        """The forward's outputs (`outputs`, all for None); `drew` says how to draw its masks again."""
        names = list(self.output_names if outputs is None else outputs)
        key = tuple([tuple(feeds[n].shape()) for n in self._sized if n in feeds])
        shapes = self.shapes.get(key)
        if shapes is None:
            self.drew = None
            values, shapes = self._recorded(feeds, key, names)
            if shapes is None or not (self._config.torch_masks or self.torch_once is not None):
                return values
            # torch's masks from the first call on: this run only told their shapes (a forward more per new size)
        drawn = self.fresh(shapes)
        try:
            return self.run_drawn(feeds, drawn, names)
        except RuntimeError:  # sizes recorded for these inputs may no longer hold (sizes read from values)
            self.drew = None
            del self.shapes[key]
            if self._recorded(feeds, key, names)[1] == shapes:  # they did hold: the masked session itself failed
                raise
            return self.run(feeds, outputs)  # at the sizes recorded anew

    def _recorded(self, feeds: Mapping[str, C.OrtValue], key: tuple, names: Sequence[str]
                  ) -> tuple[list[C.OrtValue], dict[str, tuple[int, ...]] | None]:
        """A run of the forward as it is (onnxruntime's masks), and the mask shapes it records for `key` (None once
        `MAX_SIZES` are)."""
        plain = self.plain
        fetched = list(dict.fromkeys([*names, *self._kept_names]))
        values = plain.run(feeds, [*fetched, *self._shape_names])
        got = dict(zip(fetched, values))
        self.drew = Kept(self, {m.input: _as_fed(m, got[m.input]) for m in self.masks})
        if len(self.shapes) >= MAX_SIZES:
            return [got[n] for n in names], None
        found = [tuple(exchange.to_numpy(v).tolist()) for v in values[len(fetched):]]
        self.shapes[key] = dict(zip(self._sources, found))
        return [got[n] for n in names], self.shapes[key]

    def fresh(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, C.OrtValue]:
        """A call's masks (of `mask_shapes`), drawn as `run` draws them from a seed taken now from torch's generator
        (`drew`: how to draw them again)."""
        seed = self._call_seed()
        self.drew = Redraw(self, shapes, seed)
        return self.draw(shapes, seed, fresh=True)

    def _call_seed(self) -> int | torch.Tensor:
        """A call's seed: torch's generator state where its masks are torch's (`torch_once`'s, for that call), else
        a seed drawn from it."""
        once, self.torch_once = self.torch_once, None
        if once is not None:  # the state the call began with: the plain run's seeds were drawn since
            torch.default_generator.set_state(once)
            return once
        return torch.default_generator.get_state() if self._config.torch_masks else _seed()

    def drawn_runner(self, names: Sequence[str]) -> Runner | None:
        """The runner `run_drawn` runs where it computes every one of `names` (none a mask it is given), for a caller
        binding its inputs and outputs itself (`halves.FlatOutputs`); None before the first drawn run."""
        return self._masked if self._masked is not None and not self._fed.intersection(names) else None

    def run_drawn(self, feeds: Mapping[str, C.OrtValue], drawn: Mapping[str, C.OrtValue], names: Sequence[str]
                  ) -> list[C.OrtValue]:
        """A run with the masks given (`drawn`, or a half of the batch's cut from them: `halves`)."""
        if self._masked is None:
            assert self._masked_model is not None
            self._masked = Runner(self._masked_model, self._config, self._what, self._disabled)
            self._masked_model = None
        computed = [n for n in names if n not in self._fed]
        values = dict(zip(computed, self._masked.run({**feeds, **drawn}, computed)))
        values.update(drawn)
        return [values[n] for n in names]

    def draw(self, shapes: Mapping[str, tuple[int, ...]], seed: int | torch.Tensor,
             only: Collection[str] | None = None, fresh: bool = False) -> dict[str, C.OrtValue]:
        """The masks of one call (`only` those named), from one stream seeded by `seed` (taken from torch's default
        generator): 16-bit draws for every element of every mask, then each mask's ties (`_kept`); each mask its own
        buffer, so that one dropped frees its bytes. The fed fills (`Mask.draw`) are torch's, from a generator seeded
        by `seed`. With `torch_masks`, `seed` is torch's generator state at the call: `fresh` draws advance the
        default generator as torch's dropouts do, a redraw reads a copy."""
        if isinstance(seed, torch.Tensor):
            return self._draw_as_torch(shapes, seed, only, fresh)
        drops = self._drops
        sizes = [int(np.prod(shapes[m.source])) for m in drops]
        stream = np.random.SFC64(seed)
        high = stream.random_raw((sum(sizes) + 3) // 4).view(np.uint16)
        drawn: dict[str, C.OrtValue] = {}
        start = 0
        for m, size in zip(drops, sizes):  # every mask's ties drawn in order, so a mask is the same redrawn alone
            kept = _kept(stream, high[start:start + size], m.threshold)
            if only is None or m.input in only:
                drawn[m.input] = exchange.to_ortvalue(kept.reshape(shapes[m.source]))
            start += size
        if len(drops) == len(self.masks):
            return drawn
        generator = torch.Generator()
        generator.manual_seed(seed)
        for m in self.masks:  # torch's fills, from a generator of the call's seed, every one in order
            if m.draw is not None:
                values = _torch_draw(m, shapes[m.source], generator)
                if only is None or m.input in only:
                    drawn[m.input] = exchange.to_ortvalue(values)
        return drawn

    def _draw_as_torch(self, shapes: Mapping[str, tuple[int, ...]], state: torch.Tensor,
                       only: Collection[str] | None, fresh: bool) -> dict[str, C.OrtValue]:
        """torch's dropout masks (`_dropout_impl`: `empty_like(x).bernoulli_(1 - p)`), in the forward's order, which
        is the trace's and so torch's: the same generator state gives the same masks, and leaves the generator
        where torch's forward leaves it."""
        generator = torch.default_generator
        if not fresh:
            generator = torch.Generator()
            generator.set_state(state)
        drawn: dict[str, C.OrtValue] = {}
        for m in self.masks:
            if m.draw is None and m.transposed:
                values = torch.empty(shapes[m.source][::-1], dtype=torch.bool).bernoulli_(
                    1.0 - m.ratio, generator=generator).t().contiguous()
            elif m.draw is None:
                values = torch.empty(shapes[m.source], dtype=torch.bool).bernoulli_(1.0 - m.ratio, generator=generator)
            else:
                values = _torch_draw(m, shapes[m.source], generator)
            if only is None or m.input in only:
                drawn[m.input] = exchange.to_ortvalue(values)
        return drawn


def _as_fed(m: Mask, value: C.OrtValue) -> C.OrtValue:
    """onnxruntime's draw for `m` as the host feeds it: a bernoulli_ fill's uniforms u as 1 - (u < p), the host's
    1 - its draws (`_torch_draw`), which the graph's `Less(., p)` reads the same."""
    if m.draw is None or m.draw[0] != "bernoulli_":
        return value
    u = exchange.to_torch(value)
    return exchange.to_ortvalue((u >= m.draw[1]).to(u.dtype))


def _torch_draw(m: Mask, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The values of a random op the host feeds (`Mask.draw`), drawn as torch's fill draws them."""
    assert m.draw is not None
    fill, a, b, elem = m.draw
    empty = torch.empty(shape, dtype=exchange.ONNX_TO_TORCH[elem])
    if fill == "exponential_":
        return empty.exponential_(a, generator=generator)
    if fill == "bernoulli_":  # fed to `Less(u, p)`: u = 1 - mask
        return 1 - empty.bernoulli_(a, generator=generator)
    return getattr(empty, fill)(a, b, generator=generator)


def _kept(stream: np.random.SFC64, high: np.ndarray, threshold: int) -> np.ndarray:
    """Which elements a mask keeps, each as a uniform 32-bit draw u kept where u >= threshold: the high 16 bits of u
    decide, but where they equal the threshold's (one element in 65536), whose low 16 bits are then drawn from
    `stream`. Half the random bits of drawing all 32: 1M elements in 0.65 ms instead of 0.98 (the draw 0.44, the
    passes over the high halves the rest)."""
    top, low = threshold >> 16, threshold & 0xFFFF
    kept = np.greater(high, np.uint16(top))
    ties = np.flatnonzero(high == top)
    if ties.size:
        kept[ties] = stream.random_raw((ties.size + 3) // 4).view(np.uint16)[:ties.size] >= low if low else True
    return kept


def _seed(generator: torch.Generator | None = None) -> int:
    """A seed from torch's default CPU generator (consuming it as torch's own random ops do), or from `generator`."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def _copy_of_default() -> torch.Generator:
    """A generator in the default one's state: seeds drawn from it follow `torch.manual_seed` without moving the
    default generator, whose draws torch's own masks need (`SessionConfig.torch_masks`)."""
    generator = torch.Generator()
    generator.set_state(torch.default_generator.get_state())
    return generator


def _static(value: onnx.ValueInfoProto) -> bool:
    t = value.type.tensor_type
    return t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)


def seeded_random_ops(model: onnx.ModelProto, masked: frozenset[str] = frozenset(),
                      generator: torch.Generator | None = None) -> onnx.ModelProto:
    """`model`, or a copy whose random ops and Dropouts without a `seed`, bodies included, take one from torch's
    default generator (randn_like, rand, bernoulli in a forward; Dropouts the host does not mask: in graphs with
    bodies, or of a non-constant ratio): onnxruntime seeds each op's generator once, when the session is made, and
    advances it run by run, so after `torch.manual_seed` a run draws the same values as the last. `masked`: the
    outputs of the Dropouts (and random ops) the host draws, left unseeded (`mask_dropouts` takes only those).
    `generator`: where the seeds come from instead of the default generator."""
    dropouts = default_opset(model) >= 12  # Dropout's `seed` attribute

    def unseeded(n: onnx.NodeProto) -> bool:
        return (n.domain in ("", "ai.onnx") and all(a.name != "seed" for a in n.attribute)
                and n.output[0] not in masked and (n.op_type in RANDOM_OPS or (dropouts and n.op_type == "Dropout")))

    if not any(unseeded(n) for n in graph_nodes(model.graph)):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in graph_nodes(out.graph):
        if unseeded(n):  # RandomNormal's seed is a float, Dropout's an int
            seed = float(_seed(generator) % (1 << 24)) if n.op_type in RANDOM_OPS else _seed(generator)
            n.attribute.append(helper.make_attribute("seed", seed))
    return out


def forward_runner(model: onnx.ModelProto, config: SessionConfig, what: str,
                   disabled: Sequence[str] = DISABLED_OPTIMIZERS, like: Runner | MaskedRunner | None = None
                   ) -> Runner | MaskedRunner:
    """The Runner for a forward or inference graph (its random ops and unmasked Dropouts seeded from torch's
    generator): a `MaskedRunner` where it has training Dropouts to mask (and `config.lower` is on), else a plain
    one. `like`: a runner of the same forward whose mask shapes this one starts from (a fused forward and backward
    after the split forward's first call: the same masks from the same seeds, no probe session)."""
    masked, masks = mask_dropouts(model, config.torch_masks) if config.lower else (model, [])
    seeded = seeded_random_ops(model, frozenset(m.output for m in masks),
                               _copy_of_default() if config.torch_masks else None)  # host-drawn ones left as they are
    if not masks:
        return Runner(seeded, config, what, disabled)
    if seeded is not model:  # the same Dropouts masked (still unseeded), the seeds of the rest kept
        model = seeded
        masked, masks = mask_dropouts(model, config.torch_masks)
    shapes = like.shapes if isinstance(like, MaskedRunner) else None
    return MaskedRunner(model, masked, masks, config, what, disabled, shapes)
