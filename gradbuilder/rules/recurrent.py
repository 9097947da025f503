"""LSTM, GRU and RNN with standard ops: backward rebuilds the gates and runs a Scan back through time.

The ONNX ops output only the hidden states Y (and the last H and C), so backward rebuilds what each step
saw: H_{t-1} is Y shifted by one step (initial_h at the start), which lets every product with X or
H_{t-1} run batched over all steps outside any loop. Only what is truly sequential runs in a Scan:
LSTM's cell state (one forward Scan recomputes it with the gates) and the gradient flowing from H_t to
H_{t-1} (one Scan per direction, whose body multiplies by R once, twice for GRU). Weight gradients are
then one Gemm each over all steps. Scan bodies read nothing from the outer scope, since the split into
forward and backward models sees node inputs only: R and P ride along as loop state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from .context import Grad
from .registry import rule

Grads = tuple["str | None", ...]

_INT_MAX = int(np.iinfo(np.int64).max)


class _Body:
    """A Scan body under construction, with the same `op`/`Op(...)` surface as `Grad`; its names come from
    the build's allocator, so they are unique in the whole model."""

    def __init__(self, g: Grad, elem_type: int):
        self.g = g
        self.elem_type = elem_type
        self.hint = f"grad/{next((o for o in g.node.output if o), g.op_type)}/scan"
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self._consts: dict[tuple, str] = {}

    def _fresh(self, what: str) -> str:
        return self.g.em.names.fresh(f"{self.hint}/{what}")

    def input(self, rank: int, elem_type: int | None = None) -> str:
        """The next body input: loop states first, then one slice of each scanned tensor."""
        name = self._fresh("in")
        self.inputs.append(helper.make_tensor_value_info(name, elem_type or self.elem_type, [None] * rank))
        return name

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs: Any) -> Any:
        outs = [self._fresh(op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{outs[0]}_node", **attrs))
        return outs[0] if n_out == 1 else outs

    def __getattr__(self, op_type: str) -> Any:
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    def const(self, value: Any, elem_type: int | None = None) -> str:
        """A Constant node inside the body (an initializer would be an outer-scope read)."""
        arr = np.asarray(value)
        elem_type = elem_type or self.elem_type
        key = (elem_type, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._fresh("const")
            tensor = helper.make_tensor("value", elem_type, arr.shape, arr.ravel().tolist())
            self.nodes.append(helper.make_node("Constant", [], [name], name=f"{name}_node", value=tensor))
            self._consts[key] = name
        return self._consts[key]

    @property
    def one(self) -> str:
        return self.const(1.0)

    def keep(self, mask: str | None, new: str, old: str) -> str:
        """`new` on the steps inside the sequence, `old` past its end (sequence_lens)."""
        return new if mask is None else self.Where(mask, new, old)

    def split(self, x: str, parts: int, hidden: int) -> list[str]:
        return self.Split(x, self.const(np.full(parts, hidden, np.int64), TensorProto.INT64), axis=-1, n_out=parts)

    def run(self, states: Sequence[str], scanned: Sequence[str | None], state_outs: Sequence[str],
            scan_outs: Sequence[str], reverse: bool) -> list[str]:
        """Emit the Scan: `states` and `scanned` feed the body inputs in creation order (None skipped);
        returns the final states, then the stacked per-step outputs, in natural time order."""
        scanned = [s for s in scanned if s is not None]
        outs: list[str] = []
        for o in [*state_outs, *scan_outs]:  # a value both carried and collected needs two names
            outs.append(self.Identity(o) if o in outs else o)
        body = helper.make_graph(self.nodes, self._fresh("body"), self.inputs,
                                 [helper.make_tensor_value_info(o, self.elem_type, None) for o in outs])
        d = int(reverse)
        res = self.g.op("Scan", *states, *scanned, n_out=len(outs), body=body, num_scan_inputs=len(scanned),
                        scan_input_directions=[d] * len(scanned), scan_output_directions=[d] * len(scan_outs))
        return [res] if len(outs) == 1 else list(res)


# --- activations: forward by op name, derivative from the activation's output y ------------------------

def _slope(e: Any, act: str, y: str, const: Callable[[float], str], elem: int) -> str:
    """f'(x) read off y = f(x); `e` is a Scan body or the Grad itself (batched over every step), `const` makes its
    scalar constants."""
    if act == "Sigmoid":
        return e.Mul(y, e.Sub(const(1.0), y))
    if act == "Tanh":
        return e.Sub(const(1.0), e.Mul(y, y))
    return e.Cast(e.Greater(y, const(0.0)), to=elem)  # Relu: y >= 0, the step; 0 at the kink like torch


_ACTIVATIONS = ("Sigmoid", "Tanh", "Relu")


def _act_grad(b: _Body, act: str, y: str, dy: str) -> str:
    return b.Mul(dy, _slope(b, act, y, b.const, b.elem_type))


def _batched_slope(g: Grad, act: str, y: str) -> str:
    """f'(x) from y over every step at once, outside any Scan (constants typed as X: emitted tensors may have no
    type yet)."""
    x = g.I(0)
    return _slope(g, act, y, lambda v: g.const(v, like=x), g.dtype(x))


# --- the node, read and normalized ------------------------------------------------------------------

@dataclass(frozen=True)
class _Spec:
    gates: int
    hidden: int
    reverse: tuple[bool, ...]
    """Per direction: whether it runs backwards in time."""
    acts: tuple[tuple[str, ...], ...]
    """Per direction: the activations (f, g, h for LSTM; f, g for GRU; f for RNN)."""
    layout: int
    elem_type: int


def _spec(g: Grad, gates: int, default_acts: tuple[str, ...]) -> _Spec:
    direction = g.attr("direction", "forward")
    reverse = {"forward": (False,), "reverse": (True,), "bidirectional": (False, True)}.get(direction)
    if reverse is None:
        g.fail(f"unknown direction '{direction}'")
    if g.attr("clip") is not None:
        g.fail("the clip attribute is not supported (its gradient is a mask on every gate); export without it")
    if g.attr("input_forget", 0):
        g.fail("input_forget=1 (coupled input and forget gates) is not supported")
    given = g.attr("activations", [])
    names = list(given) or list(default_acts) * len(reverse)  # Grad.attr decodes them
    n = len(default_acts)
    if len(names) != n * len(reverse):
        g.fail(f"{len(names)} activations given; {g.op_type} needs {n} per direction")
    canonical = {k.lower(): k for k in _ACTIVATIONS}
    for a in names:
        if a.lower() not in canonical:
            g.fail(f"activation '{a}' is not supported (supported: {', '.join(_ACTIVATIONS)})")
    acts = tuple(tuple(canonical[a.lower()] for a in names[d * n:(d + 1) * n]) for d in range(len(reverse)))
    hidden = g.attr("hidden_size")
    if hidden is None:
        shape = g.info(g.I(2)).static_shape
        if shape is None:
            g.fail("hidden_size is not given and R's shape is unknown")
        hidden = shape[-1]
    elem_type = g.dtype(g.I(0))
    if not elem_type:
        g.fail(f"the element type of '{g.I(0)}' is unknown; the Scan bodies need it")
    return _Spec(gates, int(hidden), reverse, acts, int(g.attr("layout", 0)), elem_type)


@dataclass
class _Seq:
    """One direction of the node, time-major ([T, batch, ...]) and in natural time order."""

    hidden: int
    acts: tuple[str, ...]
    reverse: bool
    x: str
    w: str
    """[G*H, I]"""
    r: str
    """[G*H, H]"""
    wb: str | None
    rb: str | None
    y: str
    """[T, B, H], this direction's hidden states"""
    hprev: str
    """[T, B, H], the hidden state each step read"""
    dy: str | None
    dh: str
    """[B, H], the gradient flowing into the last step processed (from Y_h)"""
    mask: str | None
    """[T, B, 1] bool: the step lies inside its sequence (sequence_lens given)"""
    c0: str | None = None
    dc: str | None = None
    p: str | None = None
    """[3H] peepholes, iof"""


@dataclass
class _Back:
    """What a cell's backward gives the shared weight-gradient code."""

    dpre: str
    """[T, B, G*H]: gradient of the gate pre-activations, the part fed by X W^T + Wb"""
    r_terms: list[tuple[str, str]]
    """(gradient [T, B, k], the [T, B, H] tensor those k rows of R multiply), in R's row order"""
    dh0: str
    dc0: str | None = None
    dp: str | None = None


def _zeros_bh(g: Grad, spec: _Spec) -> str:
    """Zeros of [batch, H]: missing initial states and missing Y_h/Y_c gradients."""
    b_axis = 1 - spec.layout
    batch = g.Slice(g.shape_of(g.I(0)), g.ints([b_axis]), g.ints([b_axis + 1]))
    value = helper.make_tensor("value", spec.elem_type, [1], [0])
    return g.ConstantOfShape(g.Concat(batch, g.ints([spec.hidden]), axis=0), value=value)


def _masks(g: Grad, spec: _Spec) -> tuple[str, str] | tuple[None, None]:
    """[T, B, 1] bool for t < len and for t + 1 < len (the step after t is inside the sequence)."""
    if g.I(4) is None:
        return None, None
    lens = g.Cast(g.I(4), to=TensorProto.INT64)
    steps = g.Gather(g.shape_of(g.I(0)), g.ints(spec.layout))
    out = []
    for start in (0, 1):
        t = g.Range(g.ints(start), g.Add(steps, g.ints(start)) if start else steps, g.ints(1))
        out.append(g.unsqueeze(g.Less(g.unsqueeze(t, [1]), lens), [2]))
    return out[0], out[1]


def _shift(g: Grad, y: str, h0: str, reverse: bool, mask_next: str | None) -> str:
    """The state each step reads: Y one step back in processing order, h0 at the first step. Reverse steps
    at the end of a shorter sequence read h0 too."""
    first = g.unsqueeze(h0, [0])
    if not reverse:
        return g.Concat(first, g.Slice(y, g.ints([0]), g.ints([-1]), g.ints([0])), axis=0)
    shifted = g.Concat(g.Slice(y, g.ints([1]), g.ints([_INT_MAX]), g.ints([0])), first, axis=0)
    return shifted if mask_next is None else g.Where(mask_next, shifted, h0)


def _time_major(g: Grad, t: str | None, perm: list[int], layout: int) -> str | None:
    return t if t is None or layout == 0 else g.Transpose(t, perm=perm)


def _pick(g: Grad, t: str | None, d: int, axis: int) -> str | None:
    return None if t is None else g.Gather(t, g.ints(d), axis=axis)


def _concat(g: Grad, parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else g.Concat(*parts, axis=0)


def _stack(g: Grad, parts: list[str]) -> str:
    """Per-direction gradients into one tensor with the num_directions axis first."""
    return _concat(g, [g.unsqueeze(p, [0]) for p in parts])


def _flat(g: Grad, t: str) -> str:
    return g.Flatten(t, axis=2)


def _recurrent(g: Grad, spec: _Spec, cell: Callable[[Grad, _Seq], _Back]) -> Grads:
    lay = spec.layout
    y_all = g.O(0)
    if not y_all:  # the node does not output Y: backward runs it again for the hidden states
        y_all = g.op(g.op_type, *g.node.input, n_out=1, **{a.name: g.attr(a.name) for a in g.node.attribute})
    x = _time_major(g, g.I(0), [1, 0, 2], lay)
    y = _time_major(g, y_all, [1, 2, 0, 3], lay)
    dy = _time_major(g, g.GO(0), [1, 2, 0, 3], lay)
    h0, c0, dyh, dyc = (_time_major(g, t, [1, 0, 2], lay) for t in (g.I(5), g.I(6), g.GO(1), g.GO(2)))
    mask, mask_next = _masks(g, spec)
    if mask is not None:  # onnxruntime gives Y_h = Y_c = 0 (not the initial state) for an empty sequence
        nonempty = g.Gather(mask, g.ints(0), axis=0)
        zero = g.const(0.0, like=g.I(0))
        dyh, dyc = (t and g.Where(nonempty, t, zero) for t in (dyh, dyc))
    zeros = _zeros_bh(g, spec) if None in (h0, dyh) or (spec.gates == 4 and None in (c0, dyc)) else None
    gh = spec.gates * spec.hidden
    b = g.I(3)
    dirs = []
    for d, reverse in enumerate(spec.reverse):
        bd = _pick(g, b, d, 0)
        y_d = _pick(g, y, d, 1)
        h0_d = _pick(g, h0, d, 0) or zeros
        wb, rb = g.Split(bd, g.ints([gh, gh]), axis=0, n_out=2) if bd else (None, None)
        seq = _Seq(hidden=spec.hidden, acts=spec.acts[d], reverse=reverse, x=x, w=_pick(g, g.I(1), d, 0),
                   r=_pick(g, g.I(2), d, 0), wb=wb, rb=rb, y=y_d, hprev=_shift(g, y_d, h0_d, reverse, mask_next),
                   dy=_pick(g, dy, d, 1), dh=_pick(g, dyh, d, 0) or zeros, mask=mask)
        if spec.gates == 4:
            seq.c0, seq.dc, seq.p = _pick(g, c0, d, 0) or zeros, _pick(g, dyc, d, 0) or zeros, _pick(g, g.I(7), d, 0)
        dirs.append((seq, cell(g, seq)))
    return _weight_grads(g, spec, dirs)


def _weight_grads(g: Grad, spec: _Spec, dirs: list[tuple[_Seq, _Back]]) -> Grads:
    """Input, weight and bias gradients from the gate gradients of every step, batched over time."""
    sums: dict[str, str] = {}

    def total(t: str) -> str:
        if t not in sums:
            sums[t] = g.reduce_sum(t, [0, 1], keepdims=False)
        return sums[t]

    def gemm(a: str, b: str) -> str:
        return g.Gemm(_flat(g, a), _flat(g, b), transA=1)

    out: list[str | None] = [None] * g.n_inputs
    if g.needs(0):
        parts = [g.MatMul(back.dpre, seq.w) for seq, back in dirs]
        dx = parts[0] if len(parts) == 1 else g.Sum(*parts)
        out[0] = _time_major(g, dx, [1, 0, 2], spec.layout)
    if g.needs(1):
        out[1] = _stack(g, [gemm(back.dpre, seq.x) for seq, back in dirs])
    if g.needs(2):
        out[2] = _stack(g, [_concat(g, [gemm(a, h) for a, h in back.r_terms]) for _, back in dirs])
    if g.needs(3):
        out[3] = _stack(g, [g.Concat(total(back.dpre), *(total(a) for a, _ in back.r_terms), axis=0)
                            for _, back in dirs])
    states = [(5, "dh0"), (6, "dc0")] if spec.gates == 4 else [(5, "dh0")]
    for i, field in states:
        if g.needs(i):
            out[i] = _time_major(g, _stack(g, [getattr(back, field) for _, back in dirs]), [1, 0, 2], spec.layout)
    if spec.gates == 4 and g.needs(7):
        out[7] = _stack(g, [back.dp for _, back in dirs])  # type: ignore[misc]
    return tuple(out)


def _linear(g: Grad, x: str, w: str, bias: str | None = None) -> str:
    """x W^T (+ bias) for every step at once."""
    y = g.MatMul(x, g.Transpose(w, perm=[1, 0]))
    return y if bias is None else g.Add(y, bias)


# --- the cells ----------------------------------------------------------------------------------

def _rnn_cell(g: Grad, s: _Seq) -> _Back:
    """H_t = f(X_t W^T + H_{t-1} R^T + Wb + Rb): the derivative of f comes from Y itself."""
    b = _Body(g, g.dtype(g.I(0)))
    dh, r = b.input(2), b.input(2)
    dy_t = s.dy and b.input(2)
    y_t = b.input(2)
    m_t = s.mask and b.input(2, TensorProto.BOOL)
    dh_in = b.Add(dy_t, dh) if dy_t else dh
    dpre = _act_grad(b, s.acts[0], y_t, dh_in)
    dprev = b.keep(m_t, b.MatMul(dpre, r), dh)
    dh0, _, dpre_all = b.run([s.dh, s.r], [s.dy, s.y, s.mask], [dprev, b.Identity(r)],
                             [b.keep(m_t, dpre, b.const(0.0))], not s.reverse)
    return _Back(dpre_all, [(dpre_all, s.hprev)], dh0)


def _gru_cell(g: Grad, s: _Seq) -> _Back:
    """z, r and the candidate all follow from H_{t-1}, so they are rebuilt outside the loop; the body only
    moves the gradient from H_t to H_{t-1}."""
    hid = s.hidden
    f, act_g = s.acts
    split2 = g.ints([2 * hid, hid])
    gx_zr, gx_h = g.Split(_linear(g, s.x, s.w, s.wb), split2, axis=2, n_out=2)
    r_zr, r_h = g.Split(s.r, split2, axis=0, n_out=2)
    rb_zr, rb_h = g.Split(s.rb, split2, axis=0, n_out=2) if s.rb else (None, None)
    z, rg = g.Split(g.op(f, g.Add(gx_zr, _linear(g, s.hprev, r_zr, rb_zr))), g.ints([hid, hid]), axis=2, n_out=2)
    if g.attr("linear_before_reset", 0):
        side = _linear(g, s.hprev, r_h, rb_h)  # a = H_{t-1} Rh^T + Rbh, which r scales
        return _gru_reset_after(g, s, z, rg, side, g.op(act_g, g.Add(gx_h, g.Mul(rg, side))))
    side = g.Mul(rg, s.hprev)  # r * H_{t-1}, which Rh multiplies
    cand = g.op(act_g, g.Add(gx_h, _linear(g, side, r_h, rb_h)))

    b = _Body(g, g.dtype(g.I(0)))
    dh, rz_t, rh_t = b.input(2), b.input(2), b.input(2)
    dy_t = s.dy and b.input(2)
    z_t, r_t, c_t, hp_t = (b.input(2) for _ in range(4))
    m_t = s.mask and b.input(2, TensorProto.BOOL)
    dh_in = b.Add(dy_t, dh) if dy_t else dh
    dcand = _act_grad(b, act_g, c_t, b.Mul(dh_in, b.Sub(b.one, z_t)))
    dz = _act_grad(b, f, z_t, b.Mul(dh_in, b.Sub(hp_t, c_t)))
    ds = b.MatMul(dcand, rh_t)
    dr = _act_grad(b, f, r_t, b.Mul(ds, hp_t))
    dprev = b.Add(b.Mul(dh_in, z_t), b.Mul(ds, r_t))
    dzr = b.Concat(dz, dr, axis=-1)
    dprev = b.keep(m_t, b.Add(dprev, b.MatMul(dzr, rz_t)), dh)
    zero = b.const(0.0)
    res = b.run([s.dh, r_zr, r_h], [s.dy, z, rg, cand, s.hprev, s.mask],
                [dprev, b.Identity(rz_t), b.Identity(rh_t)], [b.keep(m_t, dzr, zero), b.keep(m_t, dcand, zero)],
                not s.reverse)
    dh0, dzr_all, dcand_all = res[0], res[3], res[4]
    return _Back(g.Concat(dzr_all, dcand_all, axis=2), [(dzr_all, s.hprev), (dcand_all, side)], dh0)


def _gru_reset_after(g: Grad, s: _Seq, z: str, rg: str, side: str, cand: str) -> _Back:
    """linear_before_reset (torch's GRU): every gate gradient is dH_t times a factor known before the loop,
    K = [dz, dr, da, dcand] / dH_t, so the body only adds, scales and multiplies by R once:
        d_t = [dh, dh, dh, dh] * K_t,  dh <- dh z_t + d_t[:3H] R
    (6 nodes a step where the body took 20)."""
    hid = s.hidden
    f, act_g = s.acts
    dcand = g.Mul(g.Sub(g.const(1.0, like=g.I(0)), z), _batched_slope(g, act_g, cand))
    factors = g.Concat(g.Mul(g.Sub(s.hprev, cand), _batched_slope(g, f, z)),
                       g.Mul(g.Mul(dcand, side), _batched_slope(g, f, rg)), g.Mul(dcand, rg), dcand, axis=2)

    b = _Body(g, g.dtype(g.I(0)))
    dh, r = b.input(2), b.input(2)
    dy_t = s.dy and b.input(2)
    k_t, z_t = b.input(2), b.input(2)
    m_t = s.mask and b.input(2, TensorProto.BOOL)
    dh_in = b.Add(dy_t, dh) if dy_t else dh
    d = b.Mul(b.Concat(dh_in, dh_in, dh_in, dh_in, axis=-1), k_t)
    three = b.Slice(d, b.const([0], TensorProto.INT64), b.const([3 * hid], TensorProto.INT64),
                    b.const([-1], TensorProto.INT64))
    dprev = b.Add(b.Mul(dh_in, z_t), b.MatMul(three, r))
    res = b.run([s.dh, s.r], [s.dy, factors, z, s.mask], [b.keep(m_t, dprev, dh), b.Identity(r)],
                [b.keep(m_t, d, b.const(0.0))], not s.reverse)
    dh0, d_all = res[0], res[2]
    dzr, dside, dcand_all = g.Split(d_all, g.ints([2 * hid, hid, hid]), axis=2, n_out=3)
    return _Back(g.Concat(dzr, dcand_all, axis=2), [(g.Concat(dzr, dside, axis=2), s.hprev)], dh0)


def _lstm_cell(g: Grad, s: _Seq) -> _Back:
    """The cell state is not an output: a forward Scan rebuilds it, a reverse Scan runs the gradient back. Gates
    are in ONNX order i, o, f, c; peepholes (in order i, o, f) make the gates depend on the cell state, so both
    bodies then rebuild them."""
    assert s.c0 is not None and s.dc is not None
    hid = s.hidden
    f, act_g, act_h = s.acts
    bias = g.Add(s.wb, s.rb) if s.wb else None
    pre = g.Add(_linear(g, s.x, s.w, bias), _linear(g, s.hprev, s.r))
    if not s.p:
        return _lstm_cell_without_peepholes(g, s, pre)
    peep = g.Split(s.p, g.ints([hid] * 3), axis=0, n_out=3)

    fw = _Body(g, g.dtype(g.I(0)))
    c = fw.input(2)
    pi, po, pf = (fw.input(1) for _ in peep)
    pre_t = fw.input(2)
    m_t = s.mask and fw.input(2, TensorProto.BOOL)
    ip, op, fp, cp = fw.split(pre_t, 4, hid)
    ip, fp = fw.Add(ip, fw.Mul(pi, c)), fw.Add(fp, fw.Mul(pf, c))
    i, fg, cc = fw.op(f, ip), fw.op(f, fp), fw.op(act_g, cp)
    c_new = fw.Add(fw.Mul(fg, c), fw.Mul(i, cc))
    o = fw.op(f, fw.Add(op, fw.Mul(po, c_new)))
    passed = [fw.Identity(p) for p in (pi, po, pf)]
    res = fw.run([s.c0, *peep], [pre, s.mask], [fw.keep(m_t, c_new, c), *passed],
                 [fw.Identity(c), c_new, fw.Concat(i, o, fg, cc, axis=-1)], s.reverse)
    cprev_all, c_all, gates_all = res[-3:]

    b = _Body(g, g.dtype(g.I(0)))
    dh, dc, r = b.input(2), b.input(2), b.input(2)
    pi, po, pf = (b.input(1) for _ in peep)
    dy_t = s.dy and b.input(2)
    gates_t, c_t, cprev_t = b.input(2), b.input(2), b.input(2)
    m_t = s.mask and b.input(2, TensorProto.BOOL)
    i, o, fg, cc = b.split(gates_t, 4, hid)
    dh_in = b.Add(dy_t, dh) if dy_t else dh
    hc = b.op(act_h, c_t)
    do = _act_grad(b, f, o, b.Mul(dh_in, hc))
    dct = b.Add(b.Add(dc, _act_grad(b, act_h, hc, b.Mul(dh_in, o))), b.Mul(do, po))
    di = _act_grad(b, f, i, b.Mul(dct, cc))
    df = _act_grad(b, f, fg, b.Mul(dct, cprev_t))
    dcc = _act_grad(b, act_g, cc, b.Mul(dct, i))
    dcprev = b.Add(b.Mul(dct, fg), b.Add(b.Mul(di, pi), b.Mul(df, pf)))
    dpre = b.Concat(di, do, df, dcc, axis=-1)
    dhprev = b.MatMul(dpre, r)
    passed = [b.Identity(p) for p in (pi, po, pf)]
    res = b.run([s.dh, s.dc, s.r, *peep], [s.dy, gates_all, c_all, cprev_all, s.mask],
                [b.keep(m_t, dhprev, dh), b.keep(m_t, dcprev, dc), b.Identity(r), *passed],
                [b.keep(m_t, dpre, b.const(0.0))], not s.reverse)
    dh0, dc0, dpre_all = res[0], res[1], res[-1]
    dp = None
    if g.needs(7):
        di_all, do_all, df_all, _ = g.Split(dpre_all, g.ints([hid] * 4), axis=2, n_out=4)
        dp = g.Concat(*(g.reduce_sum(g.Mul(dgate, cs), [0, 1], keepdims=False)
                        for dgate, cs in ((di_all, cprev_all), (do_all, c_all), (df_all, cprev_all))), axis=0)
    return _Back(dpre_all, [(dpre_all, s.hprev)], dh0, dc0, dp)


def _lstm_cell_without_peepholes(g: Grad, s: _Seq, pre: str) -> _Back:
    """Without peepholes every gate follows from H_{t-1}, so the gates and every factor of the backward that does
    not depend on the incoming gradient are computed over all steps at once; the Scans keep only what is
    sequential: c_t = f_t c_{t-1} + i_t g_t forward (2 nodes a step), and backward (with A = o h'(c) and B the
    gates' local slopes times their other factor)
        dc_t = dc + dh A_t,  dpre_t = [dc_t, dh, dc_t, dc_t] * B_t,  dh <- dpre_t R,  dc <- dc_t f_t
    (7 nodes a step where the gates rebuilt in the body took 30: onnxruntime runs a node of the body as slowly as
    one outside, and these are small)."""
    assert s.c0 is not None and s.dc is not None
    hid = s.hidden
    f, act_g, act_h = s.acts
    ip, op, fp, cp = g.Split(pre, g.ints([hid] * 4), axis=2, n_out=4)
    i, o, fg, cc = g.op(f, ip), g.op(f, op), g.op(f, fp), g.op(act_g, cp)

    fw = _Body(g, g.dtype(g.I(0)))
    c, f_t, u_t = fw.input(2), fw.input(2), fw.input(2)
    m_t = s.mask and fw.input(2, TensorProto.BOOL)
    c_new = fw.Add(fw.Mul(f_t, c), u_t)
    cprev_all, c_all = fw.run([s.c0], [fg, g.Mul(i, cc), s.mask], [fw.keep(m_t, c_new, c)],
                              [fw.Identity(c), c_new], s.reverse)[-2:]

    hc = g.op(act_h, c_all)
    a = g.Mul(o, _batched_slope(g, act_h, hc))
    slopes = g.Concat(g.Mul(cc, _batched_slope(g, f, i)), g.Mul(hc, _batched_slope(g, f, o)),
                      g.Mul(cprev_all, _batched_slope(g, f, fg)), g.Mul(i, _batched_slope(g, act_g, cc)), axis=2)

    b = _Body(g, g.dtype(g.I(0)))
    dh, dc, r = b.input(2), b.input(2), b.input(2)
    dy_t = s.dy and b.input(2)
    a_t, slopes_t, f_t = b.input(2), b.input(2), b.input(2)
    m_t = s.mask and b.input(2, TensorProto.BOOL)
    dh_in = b.Add(dy_t, dh) if dy_t else dh
    dct = b.Add(dc, b.Mul(dh_in, a_t))
    dpre = b.Mul(b.Concat(dct, dh_in, dct, dct, axis=-1), slopes_t)
    res = b.run([s.dh, s.dc, s.r], [s.dy, a, slopes, fg, s.mask],
                [b.keep(m_t, b.MatMul(dpre, r), dh), b.keep(m_t, b.Mul(dct, f_t), dc), b.Identity(r)],
                [b.keep(m_t, dpre, b.const(0.0))], not s.reverse)
    dh0, dc0, dpre_all = res[0], res[1], res[-1]
    return _Back(dpre_all, [(dpre_all, s.hprev)], dh0, dc0)


# --- the rules ----------------------------------------------------------------------------------

@rule("RNN", since=13, nondiff=(4,))
def rnn(g: Grad) -> Grads:
    return _recurrent(g, _spec(g, 1, ("Tanh",)), _rnn_cell)


@rule("GRU", since=13, nondiff=(4,))
def gru(g: Grad) -> Grads:
    return _recurrent(g, _spec(g, 3, ("Sigmoid", "Tanh")), _gru_cell)


@rule("LSTM", since=13, nondiff=(4,))
def lstm(g: Grad) -> Grads:
    return _recurrent(g, _spec(g, 4, ("Sigmoid", "Tanh", "Tanh")), _lstm_cell)
