"""How much arithmetic one forward does: whether onnxruntime's intra-op threads pay for a model.

onnxruntime splits every GEMM and convolution it can over its thread pool; for small kernels the hand-offs cost more
than they save (torch, by contrast, runs an op below its grain size on one thread), and a run on two threads also
pays fixed costs (waking onnxruntime's worker, parking torch's spinning ones: `openmp`). Measured on the 2-core
benchmark machine, ORTModule steps with 1 intra-op thread against 2, paired, interleaved with torch: a 64-128-64-10
MLP at batch 64 0.67-0.81x; LeNets at batch 4-8 (2-3M units) 0.88-0.98x, at batch 16 (7M) 0.94-1.06x, at batch 32
(14M) 1.04x; MLPs of 13-22M multiply-adds 0.81-1.12x (median 0.95, one thread faster in 20 of 26 pairs over six
shapes, the two modules in one process; one module a process, median ratios to torch 0.84 against 0.93 for
784-256x4-10 at batch 32, 0.85 against 0.85 for 784-512-512-10), of 26M 0.99-1.03x, of 32-34M 1.08-1.13x, of 52-60M
1.10-1.29x. So a product's multiply-adds gain less from a second thread than a convolution's (crossovers near 25M
for MLPs, 10M units for LeNets), and count at `GEMM_WEIGHT`: below `SMALL` units of forward work a session gets one
thread, or, from `SMALL / TRIAL_BOTTOM` up to `SMALL * TRIAL_TOP`, the thread count its runs measure faster on this
machine.
"""

from __future__ import annotations

import functools
import math

import onnx
from onnx import helper

from gradbuilder.inference import infer_shapes

from . import nchwc
from .export import pin_dims
from .passes import has_subgraph

SMALL = 12_000_000
"""Forward work (multiply-adds of convolutions, of products at `GEMM_WEIGHT`, plus elements every other node
writes) under which one intra-op thread beats two."""

TRIAL_BOTTOM = 8.0
"""Forward work from `SMALL` divided by this factor up to `SMALL` times `TRIAL_TOP` leaves the thread count to the
machine: runs time their first steps on both and keep the faster (`ort_session.Trial`). Below it one thread, above
it the configured threads, without a trial. `SMALL` and `mac_weight` were measured on two machines and the
crossovers moved by 3x between them (a third, an AVX-512 EPYC, put MLPs of 8-11M units faster on two threads,
0.81-0.91 of one thread's step), where a wrong guess cost up to a third of a step; a trial costs its slower arm's
extra time over a few steps and a one-thread session (`ort_session.Runner`, which makes it for crowded runs anyway)."""

TRIAL_TOP = 12.0
"""The top of the band that trials the thread count, as a multiple of `SMALL` (session 46, 8 before). Up to it,
LeNets whose two-thread runs lose most when the VM's two CPUs sit far apart on the host (`ort_session.TRIAL_DRIFT`):
at batch 256 (101M units) and with 16 and 32 channels at batch 64 (107M), one module a process against torch's
step (`benchmarks.ab`, 4 rounds, the top at 64 / at 8): 0.89-1.19 / 0.88-1.65 and 1.00-1.03 / 0.96-1.41, the
highest of each the far placement's. Where the CPUs sat near, the trial's slower runs cost those 30-step cases
3-4%, and 6% the MLP 784-512-512-10 at batch 512 (172M), a product-bound model that two threads keep faster
(the transformer, 150M, far: 23.4 ms on two threads, 25.6 on one), so the band stops below it."""

BAND = (1 / TRIAL_BOTTOM, TRIAL_TOP)
"""The band, as multiples of `SMALL`, for forwards other than `DENSE_SPLIT`'s (`trial_band`)."""

DENSE_SPLIT = 1 / 3
"""An MLP (`gemms_only`) on a machine at `mac_weight` 1 (AVX-512) gets no trial: one thread below this multiple of
`SMALL` (4M units), the configured threads from it (and from `STREAMED_ROWS` rows where its weights outgrow a core's
cache: `STREAMED_BYTES`). Session 53 (a trial band from a quarter of `SMALL` before, two
threads above it), the same module on one thread and on two in one process, steps paired, each right after torch's
(3 blocks of 400): 784-128-10 at batch 64 (3.2M units) 0.86-0.91 of the two-thread step with the CPUs far, 0.95-1.02
near; 100-200-200-10 at 64 (2M) 0.93-0.99 near; above it two threads stayed ahead or even: 784-512-512-10 at 16
(5.4M) 0.92-0.98 far but 1.00-1.09 near, 784-300-100-10 at 64 (8.5M) 1.10-1.13, 784-256x4-10 at 32 (6.4M) 0.97-1.16.
Before that, a trial band for MLPs up to a quarter of `SMALL`: two threads had won every trial measured from there
up, near and far, so the trial's one-thread runs were a loss in a run's first steps. Session 50 (the band's top 1.0
before), trials' medians on two threads / one (µs): 784-512-512-10 at batch 32 (10.7M units) forward 413 / 563,
backward 638 / 990; 784-300-100-10 at 64 (8.5M) 292 / 368, 322 / 450; 784-256x4-10 at 32 (6.4M) 263 / 394, 384 /
716, 349 / 364; 784-512-512-10 at 16 (5.4M) 405 / 609, 304 / 317, 508 / 501; 784-128-10 at 64 (3.2M) even (155 /
160, 147 / 169, 207 / 174, 196 / 160, 169 / 172). `benchmarks.ab` over the benchmark's 60 steps (4 processes each,
ratios to torch's step, the band to 1.0 / to 0.5 or 0.25): 784-512-512-10 at 32 1.095 / 0.994, 784-300-100-10 1.040
/ 0.985, 784-512-512-10 at 16 1.100 / 1.045, 784-128-10 1.265 / 1.212, 784-256x4-10 1.044 / 1.067 and 1.029 / 0.999.
Session 49 (the band's top from `TRIAL_TOP` to 1.0), `benchmarks.ab` (3 processes each, no trial above `SMALL /
TRIAL_BOTTOM` / the band to `TRIAL_TOP`, ratios to torch's step): 784-256-10 at batch 128 (13M units) 0.901 / 0.969
far, 784-512-512-10 at 64 (21M) 0.971 / 0.980, 784-1024-10 at 64 (26M) 0.999 / 1.130, 784-800-800-10 at 50 (32M)
1.008 / 1.098, 784-512-512-10 at 100 (33M) 1.035 / 1.062, 3072-512-256-10 at 64 (55M) 0.936 / 0.932. In that band the
trial chose one thread for the forward of 100-200-200-10 at batch 64 (2M units; 1.19 of torch's step with the
trial, 1.24 on two)."""

STREAMED_BYTES = 2 * 2**20
"""An MLP whose products' weights take more than this many bytes gets the configured threads from
`STREAMED_ROWS` rows, whatever its work (`trial_band`): at small batches its products stream the weights from
beyond a core's cache (1 MB of L2 on the AVX-512 EPYC), and two cores read them faster than one. Session 54, the same
module on one thread and on two in one process, steps paired, each right after torch's (3 blocks of 400; one
thread's step over two's): 784-512-512-10 (2.7 MB) at batch 1 0.86-0.91, 2 1.02-1.04, 4 1.05-1.08, 6 1.07-1.12, 8
1.10-1.15; 784-1024-10 (3.3 MB) at 4 1.08-1.13; 3072-256-10 (3.2 MB) at 8 1.05-1.08; 784-1024-1024-10 (7.4 MB) at 1
1.09-1.15, at 2 1.18-1.24; below: 784-384-384-10 (1.8 MB) at 8 0.98-0.99, 784-256-256-10 (1.1 MB) at 8 0.89-0.91, at
16 0.95-0.97."""

STREAMED_ROWS = 2
"""The rows from which `STREAMED_BYTES`' MLPs take the configured threads: one row is a product with a vector,
which two threads made slower at 2.7 MB (above)."""

GEMM_WEIGHT = 0.5
"""What a MatMul's or Gemm's multiply-add counts for against a convolution's (the crossovers above: MLPs at
~25M multiply-adds, LeNets at ~10M units)."""

AVX2_WEIGHT = 3.0
"""`mac_weight` on AVX2 machines (2 measured: the 11M MLP still 1.14x torch's step on one thread)."""

RECURRENT = frozenset({"LSTM", "GRU", "RNN"})
"""Counted as products: uncounted, a bidirectional LSTM classifier (20 steps of 128) ran on one thread, 17.9 ms a
step against 11.9 on two."""
PRODUCTS = frozenset({"MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose", "Einsum", *RECURRENT})


@functools.cache
def mac_weight() -> float:
    """What a convolution's multiply-add counts for on this machine. `SMALL` and `GEMM_WEIGHT` were measured on an
    AVX-512 machine; on an AVX2 one (a Zen 3 EPYC; onnxruntime's NCHWc block of 8 floats instead of 16 tells it),
    products ran at the same speed alone but whole steps took 1.4-1.8x longer, and models gained from a second
    thread at a third of the work. One module a process against torch (`benchmarks.ab`, one thread / two): LeNet
    at batch 16 (6.3M multiply-adds) 0.88 / 0.84, MLPs 784-512-512-10 at batch 32 (21M) 1.27 / 1.06, at batch 16
    (11M) 1.14 / 0.97, 784-300-100-10 at batch 64 (17M) 1.24 / 1.08; 784-128-10 (6.5M) and 100-200-200-10 (4M)
    still run faster on one (1.19 / 1.33, 1.25 / 1.32). Machines of other widths, unmeasured, keep 1."""
    return AVX2_WEIGHT if nchwc.vector_extension() == "AVX2" else 1.0


def trial_band(model: onnx.ModelProto, per_row: float) -> tuple[float, float]:
    """The band whose thread count a trial decides, as multiples of `SMALL`, for this forward of `per_row` work a
    row of its batch: one thread below it, the configured threads above."""
    if mac_weight() == 1.0 and gemms_only(model):
        split = DENSE_SPLIT
        if gemm_weight_bytes(model) > STREAMED_BYTES:  # half a row below STREAMED_ROWS: no rounding at the edge
            split = min(split, (STREAMED_ROWS - 0.5) * per_row / SMALL)
        return split, split
    return BAND


def gemm_weight_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the Gemms' weights (second inputs) that are graph inputs or initializers of static sizes."""
    g = model.graph
    static = {vi.name: (_dims(vi), vi.type.tensor_type.elem_type) for vi in g.input}
    static.update({t.name: (list(t.dims), t.data_type) for t in g.initializer})
    weights = [static.get(n.input[1], (None, 0)) for n in g.node if n.op_type == "Gemm" and len(n.input) > 1]
    return sum(math.prod(dims) * helper.tensor_dtype_to_np_dtype(elem).itemsize
               for dims, elem in weights if dims is not None and elem)


def gemms_only(model: onnx.ModelProto) -> bool:
    """Whether the forward's products are all Gemms (torch's Linear on a batch of vectors: an MLP), none in a
    subgraph, and there is one."""
    kinds = {n.op_type for n in model.graph.node if n.op_type in PRODUCTS}
    return kinds == {"Gemm"} and not any(map(has_subgraph, model.graph.node))


def _dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    return None if any(d < 0 for d in dims) else dims


def forward_work(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> float | None:
    """Forward work for inputs of these shapes (every graph input named in `shapes` gets all its dims):
    multiply-adds of Conv/ConvTranspose, and of MatMul/Gemm and the recurrent layers at `GEMM_WEIGHT` (output
    elements times the reduced length; steps times batch times the gates' products), all at this machine's
    `mac_weight`, and the element count of every other node's outputs. Other
    nodes shape inference cannot size count nothing (a slice with computed bounds, as `pos[:tokens.shape[1]]`,
    left a whole encoder unsized); None when a product cannot be sized."""
    sized = pin_dims(model, shapes, batch=True)
    del sized.graph.value_info[:]  # the exporter's own, with symbolic dims inference would keep
    try:
        inferred = infer_shapes(sized, data_prop=True).graph
    except Exception:  # onnx raises several types; an unsized model keeps the configured threads
        return None
    known = {vi.name: _dims(vi) for vi in [*inferred.input, *inferred.value_info, *inferred.output]}
    known.update({t.name: list(t.dims) for t in inferred.initializer})
    total, macs = 0.0, 0.0
    for n in inferred.node:
        outs = [known.get(o) for o in n.output if o]
        if any(d is None for d in outs):
            if n.op_type in PRODUCTS:
                return None
            continue
        out_elems = sum(math.prod(d) for d in outs)  # type: ignore[arg-type]
        if n.op_type not in PRODUCTS:
            total += out_elems
            continue
        a, w = known.get(n.input[0]), known.get(n.input[1]) if len(n.input) > 1 else None
        if a is None or w is None:
            return None
        if n.op_type == "Conv":  # per output element: C/group * kernel taps
            macs += out_elems * math.prod(w[1:])
        elif n.op_type == "ConvTranspose":  # per input element: M/group * kernel taps
            macs += math.prod(a) * math.prod(w[1:])
        elif n.op_type in RECURRENT:  # each step and direction: the gates' products with the input and the state
            r = known.get(n.input[2])
            if r is None:
                return None
            macs += GEMM_WEIGHT * a[0] * a[1] * w[0] * w[1] * (w[2] + r[2])
        elif n.op_type == "Gemm":
            trans_a = next((x.i for x in n.attribute if x.name == "transA"), 0)
            macs += GEMM_WEIGHT * out_elems * (a[0] if trans_a else a[-1])
        else:  # MatMul, FusedMatMul, Einsum: the reduced length is A's last dim (an estimate for Einsum)
            macs += GEMM_WEIGHT * out_elems * (a[-1] if a else 1)
    return total + mac_weight() * macs
