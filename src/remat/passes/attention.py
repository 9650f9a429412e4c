"""Recognise attention written out explicitly and replace it by the ``attention`` op (RAF §3.2.2:
a pattern and a rule).

The pattern, read backwards from the second matmul (reshapes that only regroup the leading batch
axes may sit between any two steps, as ``torch.export`` leaves around ``bmm``)::

    s = matmul(q, transpose(k))             # or a matmul flagged transpose_b=true with k itself
    s = mul(s, c) | mul(c, s) | div(s, c)   # optional, c a scalar constant
    s = select(keep, s, -inf) | select(drop, -inf, s) | add(s, m) | add(m, s)   # optional mask
    p = softmax(s, axis=last)
    y = matmul(p, v)

Every intermediate (the scores, the scaled and masked scores, the probabilities, and the reshapes
between them) must have no other user, so nothing else reads what the op no longer materialises.
A ``select`` whose drop condition is ``not(keep)`` passes ``keep`` itself as the op's bool mask;
the mask must have the shape the softmax sees broadcast against, so the op's broadcasting is the
same. Dropout between the softmax and the second matmul does not match here (the import pass),
so models with attention dropout keep their explicit, replayable form by default.

``recognise_dropout_attention`` also matches that dropout, as the frontend writes it::

    keep = bernoulli(seed, shape=[..., T, S], p=1-p)
    p = select(keep, mul(p, 1/(1-p)), 0)

and gives ``dropout_attention``, whose keep mask is drawn from the same seed with the same bits.
Its values equal the explicit form's up to summation order, so it is no import pass: the planner
applies it as a memory-lean algorithm where the explicit form cannot fit (``remat.plan.algorithms``).

Only the numbers change in one place: a row whose scores are all masked (no defined softmax)
gives NaN in both forms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from math import prod

import numpy as np

from ..ir import Block, Builder, Function, Instruction, Module, Value
from ..ir.ops.attention import scores_shape, swap_heads
from ..ir.types import DType
from ._rewrite import apply_replacements, splat_value, use_counts


@dataclass
class Match:
    """One recognised attention: its operands, attributes and the instructions it replaces."""

    q: Value
    kt: Value           # the scores matmul's second operand (kᵀ, or k when flagged transpose_b)
    k_transposed: bool  # kt is k itself (matmul flagged transpose_b)
    v: Value
    mask: Value | None
    mask_negated: bool  # mask is the drop condition (select(drop, -inf, s)): the op wants keep
    scale: float
    shape: tuple[int, ...]  # the softmax's shape [..., T, S]
    replaced: list[Instruction]
    anchor: Instruction  # the matmul with v, whose result the op's output replaces
    seed: Value | None = None  # the dropout keep mask's seed (None: no dropout)
    p: float = 0.0             # the drop probability


def _def(v: Value, op: str) -> Instruction | None:
    ins = getattr(v, "instr", None)
    return ins if ins is not None and ins.op.name == op else None


def _flag(ins: Instruction, name: str) -> bool:
    return bool(ins.attrs.get(name, False))


def _peel_reshapes(v: Value, uses: dict[Value, int], chain: list[Instruction]) -> Value:
    """Follow single-use ``reshape`` instructions back from ``v``, keeping the last two axes."""
    while True:
        r = _def(v, "reshape")
        if r is None or uses.get(v, 0) != 1:
            return v
        src = r.operands[0]
        if src.type.rank < 2 or src.type.shape[-2:] != v.type.shape[-2:]:
            return v
        chain.append(r)
        v = src


def _scalar(v: Value) -> float | None:
    c = splat_value(v)
    if c is None or isinstance(c, bool) or not v.type.dtype.is_float or v.type.numel != 1:
        return None
    return float(c)


def _is_neg_inf(v: Value) -> bool:
    c = splat_value(v)
    return c is not None and not isinstance(c, bool) and v.type.dtype.is_float and c == -math.inf


def _dropout(y: Value, uses: dict[Value, int]) -> tuple[Value, Value, float, list[Instruction]] | None:
    """``(probabilities, seed, drop probability, instructions)`` when ``y`` is the frontend's inverted
    dropout of single-use probabilities: ``select(bernoulli(seed, p=1-p), mul(x, 1/(1-p)), 0)``, with a
    scale equal to the op's own (so the values agree) and a keep probability the op redraws exactly."""
    sel = _def(y, "select")
    if sel is None or uses.get(y, 0) != 1:
        return None
    keep, scaled, zero = sel.operands
    bern, mul = _def(keep, "bernoulli"), _def(scaled, "mul")
    if bern is None or mul is None or uses.get(scaled, 0) != 1 or splat_value(zero) != 0:
        return None
    x, c = mul.operands
    keep_p = float(bern.attrs["p"])
    drop = 1.0 - keep_p
    if (not 0.0 < keep_p <= 1.0 or 1.0 - drop != keep_p or tuple(bern.attrs["shape"]) != x.type.shape
            or _scalar(c) is None or x.type != y.type):
        return None
    dt = x.type.dtype.numpy  # the constant's kernel value is its attribute rounded to the dtype
    if np.asarray(_scalar(c), dt) != np.asarray(1.0 / (1.0 - drop), dt):
        return None
    chain = [sel, mul] + ([bern] if uses.get(keep, 0) == 1 else [])
    return x, bern.operands[0], drop, chain


def match(pv: Instruction, uses: dict[Value, int], dropout: bool = False, low_precision: bool = True) -> Match | None:
    """The attention ending at ``pv`` (a matmul of probabilities with v), or None; with ``dropout``,
    also one with the frontend's dropout on its probabilities; without ``low_precision``, only one
    whose query is not f16/bf16."""
    if pv.op.name != "matmul" or any(_flag(pv, a) for a in ("transpose_a", "transpose_b")):
        return None
    chain: list[Instruction] = []
    p = _peel_reshapes(pv.operands[0], uses, chain)
    seed, drop = None, 0.0
    if dropout:
        d = _dropout(p, uses)
        if d is not None:
            p, seed, drop = d[0], d[1], d[2]
            chain.extend(d[3])
    sm = _def(p, "softmax")
    if sm is None or uses.get(p, 0) != 1 or sm.attrs["axis"] != p.type.rank - 1 or p.type.rank < 2:
        return None
    chain.append(sm)
    shape = p.type.shape
    s = sm.operands[0]
    # optional mask, at the softmax's own shape
    mask, negated = None, False
    sel, add = _def(s, "select"), _def(s, "add")
    if (sel or add) and uses.get(s, 0) == 1 and s.type.shape == shape:
        ins = sel or add
        if sel is not None:
            c, a, b = sel.operands
            if _is_neg_inf(b) and a.type.shape == shape:
                mask, s = c, a
            elif _is_neg_inf(a) and b.type.shape == shape:
                mask, negated, s = c, True, b
        else:
            a, b = add.operands
            for scores, m in ((a, b), (b, a)):
                if scores.type.shape == shape and m.type.dtype == scores.type.dtype and _reaches_scores(scores, uses):
                    mask, s = m, scores
                    break
        if mask is not None:
            chain.append(ins)
    s = _peel_reshapes(s, uses, chain)
    # optional scale by a scalar constant
    scale = 1.0
    mul, div = _def(s, "mul"), _def(s, "div")
    if (mul or div) and uses.get(s, 0) == 1:
        a, b = (mul or div).operands
        if mul is not None and _scalar(b) is not None and a.type == s.type:
            scale, s = _scalar(b), a
            chain.append(mul)
        elif mul is not None and _scalar(a) is not None and b.type == s.type:
            scale, s = _scalar(a), b
            chain.append(mul)
        elif div is not None and _scalar(b) not in (None, 0.0) and a.type == s.type:
            scale, s = 1.0 / _scalar(b), a
            chain.append(div)
    s = _peel_reshapes(s, uses, chain)
    qk = _def(s, "matmul")
    if qk is None or uses.get(s, 0) != 1 or _flag(qk, "transpose_a"):
        return None
    chain.append(qk)
    q, kt = qk.operands
    batch = prod(shape[:-2])
    t, n = shape[-2:]
    d = q.type.shape[-1]
    v = pv.operands[1]
    if (q.type.numel != batch * t * d or kt.type.numel != batch * d * n or v.type.shape[-2] != n
            or v.type.numel != batch * n * v.type.shape[-1] or q.type.shape[-2] != t
            or not q.type.dtype.is_float or pv.results[0].type.numel != batch * t * v.type.shape[-1]):
        return None  # e.g. a key or value shared across the batch (matmul broadcasting)
    if not low_precision and q.type.dtype.is_low:
        return None
    if mask is not None and mask.type.dtype != DType.bool and mask.type.dtype != q.type.dtype:
        return None
    return Match(q, kt, _flag(qk, "transpose_b"), v, mask, negated, scale, shape, chain, pv, seed, drop)


def _reaches_scores(v: Value, uses: dict[Value, int]) -> bool:
    """True if ``v`` is (through single-use reshapes and a scalar scale) a matmul: the scores."""
    v = _peel_reshapes(v, uses, [])
    for op in ("mul", "div"):
        ins = _def(v, op)
        if ins is not None and uses.get(v, 0) == 1 and any(_scalar(o) is not None for o in ins.operands):
            v = _peel_reshapes(next(o for o in ins.operands if _scalar(o) is None), uses, [])
    return _def(v, "matmul") is not None and uses.get(v, 0) == 1


def _to_shape(b: Builder, v: Value, shape: tuple[int, ...]) -> Value:
    """``v`` regrouped to ``shape``: an existing value of that shape up its reshape chain, else a reshape."""
    x = v
    while x.type.shape != shape and _def(x, "reshape") is not None:
        x = x.instr.operands[0]
    return x if x.type.shape == shape else b.op("reshape", v, shape=shape)


def _emit(b: Builder, m: Match) -> Value:
    batch, (t, n) = m.shape[:-2], m.shape[-2:]
    d = m.q.type.shape[-1]
    q = _to_shape(b, m.q, batch + (t, d))
    if m.k_transposed:
        k = _to_shape(b, m.kt, batch + (n, d))
    else:
        kt = _to_shape(b, m.kt, batch + (d, n))
        tr = _def(kt, "transpose")
        r = kt.type.rank
        swap = list(range(r - 2)) + [r - 1, r - 2]
        k = tr.operands[0] if tr is not None and list(tr.attrs["perm"]) == swap else b.op("transpose", kt, perm=swap)
    v = _to_shape(b, m.v, batch + (n, m.v.type.shape[-1]))
    extra = []
    if m.mask is not None:
        mask = m.mask
        if m.mask_negated:
            inner = _def(mask, "not")
            mask = inner.operands[0] if inner is not None else b.op("not", mask)
        extra = [mask]
    if m.seed is not None:
        out, _ = b.op("dropout_attention", q, k, v, m.seed, *extra, scale=m.scale, p=m.p)
    else:
        out, _ = b.op("attention", q, k, v, *extra, scale=m.scale)
    want = m.anchor.results[0].type.shape
    return out if out.type.shape == want else b.op("reshape", out, shape=want)


def recognise_attention(f: Function, dropout: bool = False, low_precision: bool = True) -> tuple[Function, int]:
    """A copy of ``f`` with every explicit attention replaced by the op; also the number replaced.
    ``dropout``: attention with dropout on its probabilities too (as ``dropout_attention``);
    ``low_precision`` False: not attention in f16/bf16 (the import pass)."""
    g, made = _recognise(f, dropout, low_precision)
    return g, len(made)


def _recognise(f: Function, dropout: bool, low_precision: bool) -> tuple[Function, list[Instruction]]:
    """``recognise_attention``, with the attention instructions it made."""
    g = f.clone()
    if g.is_declaration:
        return g, []
    uses = use_counts(g)
    repl: dict[Value, Value] = {}
    made: list[Instruction] = []
    for blk in g.blocks:
        matches = {}
        for ins in blk.instrs:
            m = match(ins, uses, dropout, low_precision)
            if m is not None and all(c.block is blk for c in m.replaced):
                matches[ins] = m
        dead = {c for m in matches.values() for c in m.replaced}
        matches = {a: m for a, m in matches.items() if a not in dead}  # one attention's output scoring another's
        if not matches:
            continue
        dead = {c for m in matches.values() for c in m.replaced}
        out: list[Instruction] = []
        for ins in blk.instrs:
            if ins in matches:
                scratch = Block()
                new = _emit(Builder(scratch), matches[ins])
                for ni in scratch.instrs:
                    ni.block = blk
                out.extend(scratch.instrs)
                made += [ni for ni in scratch.instrs if ni.op.name in ("attention", "dropout_attention")]
                repl[ins.results[0]] = new
            elif ins not in dead:
                out.append(ins)
        blk.instrs = out
    apply_replacements(g, repl)
    return g, made


def attention_pass(module: Module) -> Module:
    """Replace explicit attention (matmul, scale, mask, softmax, matmul) by the ``attention`` op,
    except in f16/bf16."""
    return Module([recognise_attention(f, low_precision=False)[0] for f in module])


@dataclass
class Site:
    """One explicit attention rewritten: its scores' shape, its dropout probability (0: none, an
    ``attention`` in f16/bf16) and the bytes of one [..., T, S] tensor (the explicit form holds the
    scores, probabilities, any keep mask and their gradients at that size)."""

    shape: tuple[int, ...]
    p: float
    scores_bytes: int


def recognise_dropout_attention(f: Function) -> tuple[Function, list[Site]]:
    """A copy of ``f`` with every explicit attention the import pass leaves replaced by the op: with
    dropout on its probabilities by ``dropout_attention``, and without, in f16/bf16, by ``attention``
    (as eager PyTorch, the import pass keeps those explicit: on the CPU their low-precision matmuls
    and softmax with the probabilities kept run faster than the fused kernels, ``bench/speed.py
    --precision bf16``); also one :class:`Site` per rewritten attention (none when nothing was)."""
    g, made = _recognise(f, True, True)
    return g, [Site(scores_shape(ins.operands[0].type, ins.operands[1].type), ins.attrs.get("p", 0.0),
                    prod(scores_shape(ins.operands[0].type, ins.operands[1].type)) * ins.operands[0].type.dtype.itemsize)
               for ins in made]


# ---------------------------------------------------------------- heads transposed in and out of attention
def _heads_swapped(v: Value) -> Value | None:
    """x when ``v = transpose(x)`` swaps only x's axes -3 and -2 ([..., T, H, D] <-> [..., H, T, D])."""
    d = _def(v, "transpose")
    if d is None:
        return None
    r = len(d.attrs["perm"])
    return d.operands[0] if r >= 3 and list(d.attrs["perm"]) == list(range(r - 3)) + [r - 2, r - 3, r - 1] else None


_SINKS = frozenset({"add", "sub", "mul", "div", "neg"})


class _SeqFirst:
    """Rebuilds a heads-first value ``[..., H, T, D]`` in the sequence-first layout ``[..., T, H, D]``
    from the transposes it was computed from, through element-wise ops (operands broadcasting over
    the heads or the sequence read as reshapes), slices and concatenations: a rotary embedding of
    the query and key (``q * cos + rotate_half(q) * sin``) becomes the same ops on [..., T, H, D].
    ``tree``: the instructions the rebuilt values replace."""

    def __init__(self, b: Builder) -> None:
        self.b = b
        self.memo: dict[Value, Value | None] = {}
        self.tree: set[Instruction] = set()

    def __call__(self, v: Value) -> Value | None:
        if v not in self.memo:
            self.memo[v] = self._rebuild(v)
        return self.memo[v]

    def _operand(self, o: Value, like: Value) -> Value | None:
        """An operand of an element-wise op on ``like``: rebuilt when it has ``like``'s shape, else
        (a broadcasting operand) viewed in the other layout when that is a reshape."""
        if o.type.shape == like.type.shape:
            return self(o)
        r = like.type.rank
        full = (1,) * (r - o.type.rank) + o.type.shape
        if o.type.rank > r or 1 not in full[-3:-1]:
            return None  # swapping two axes longer than 1 would be a copy
        return self.b.op("reshape", o, shape=swap_heads(o.type.with_shape(full)).shape)

    def _rebuild(self, v: Value) -> Value | None:
        r = v.type.rank
        src = _heads_swapped(v) if r >= 3 else None
        if src is not None:
            self.tree.add(v.instr)
            return src
        ins = getattr(v, "instr", None)
        if r < 3 or ins is None or len(ins.results) != 1:
            return None
        name = ins.op.name
        if name in _SINKS:
            ops = [self._operand(o, v) for o in ins.operands]
            if None in ops or not any(o.type.shape == v.type.shape for o in ins.operands):
                return None
            out = self.b.op(name, *ops, **ins.attrs)
        elif name == "slice":
            x = self(ins.operands[0])
            if x is None:
                return None
            start, stop, step = (list(ins.attrs[a] or (1,) * r) for a in ("start", "stop", "step"))
            for a in (start, stop, step):
                a[-3], a[-2] = a[-2], a[-3]
            out = self.b.op("slice", x, start=start, stop=stop, step=step)
        elif name == "concat":
            xs = [self(o) for o in ins.operands]
            if None in xs:
                return None
            axis = ins.attrs["axis"] % r
            out = self.b.op("concat", *xs, axis={r - 3: r - 2, r - 2: r - 3}.get(axis, axis))
        else:
            return None
        self.tree.add(ins)
        return out


def fold_head_transposes(f: Function) -> tuple[Function, int]:
    """A copy of ``f`` where each ``attention`` whose query, key and value are all transposes of
    ``[..., T, H, D]`` values (a projection reshaped to heads, then ``transpose(1, 2)``) reads those
    values itself (``seq_first``), its output transposed back for its users; also how many. An
    operand computed from such transposes by element-wise ops, slices and concatenations (a rotary
    embedding) is computed on the [..., T, H, D] values instead (:class:`_SeqFirst`), when nothing
    else reads what it replaces.

    ``simplify`` then cancels that transpose against the model's own transpose of the output, and
    DCE drops the operands' transposes: the flash kernels read [B, T, H, D] through views and write
    their output (and, in the backward, the gradients) [B, T, H, D]-contiguous, so the copies the
    transposes and the kernels' own layout changes made are gone (bit-identical results). With an
    additive (float) mask, a learned position bias, the mask's cotangent computes on [..., H, T, D]:
    it swaps the query, key, value and output gradient back (four copies in the backward, where
    the heads-first form copied them in the forward, the output both ways and the three gradients
    back: eight)."""
    def rewrite(ins: Instruction, b: Builder, users: dict[Value, list[Instruction]]):
        if ins.attrs.get("seq_first", False) or ins.operands[0].type.rank < 3:
            return None
        seq_first = _SeqFirst(b)
        srcs = [seq_first(v) for v in ins.operands[:3]]
        inside = seq_first.tree | {ins}
        if None in srcs or any(u not in inside for t in seq_first.tree for u in users.get(t.results[0], ())):
            return None  # not all rebuilt, or something else reads what would be replaced
        o, lse = b.op("attention", *srcs, *ins.operands[3:], **{**ins.attrs, "seq_first": True})
        r = o.type.rank
        return b.op("transpose", o, perm=list(range(r - 3)) + [r - 2, r - 3, r - 1]), lse

    return _rewrite_attentions(f, rewrite)


def _rewrite_attentions(f: Function, rewrite) -> tuple[Function, int]:
    """A copy of ``f`` with each ``attention`` for which ``rewrite(ins, builder, users)`` returns the
    values replacing its two results (emitted through the builder, in its place) rewritten; also how
    many. ``users``: each value's reading instructions in ``f``'s copy."""
    g = f.clone()
    if g.is_declaration:
        return g, 0
    repl: dict[Value, Value] = {}
    count = 0
    users: dict[Value, list[Instruction]] = {}
    for ins in g.instructions():
        for v in ins.operands:
            users.setdefault(v, []).append(ins)
    for blk in g.blocks:
        out: list[Instruction] = []
        for ins in blk.instrs:
            new = None
            if ins.op.name == "attention":
                scratch = Block()  # what a rewrite that gives up emitted is dropped with it
                new = rewrite(ins, Builder(scratch), users)
            if new is None:
                out.append(ins)
                continue
            repl[ins.results[0]], repl[ins.results[1]] = new
            for ni in scratch.instrs:
                ni.block = blk
            out.extend(scratch.instrs)
            count += 1
        blk.instrs = out
    apply_replacements(g, repl)
    return g, count


def fold_head_transposes_pass(module: Module) -> Module:
    """Attention reads heads-transposed operands in place (``seq_first``); see :func:`fold_head_transposes`."""
    return Module([fold_head_transposes(f)[0] for f in module])


# ---------------------------------------------------------------- key/value heads repeated for grouped-query attention
def _repeated_heads(v: Value) -> tuple[Value, int] | None:
    """``(x, n)`` when ``v`` repeats each of the heads of ``x`` ``[..., Hkv, S, D]`` n times in place:
    Hugging Face's ``repeat_kv``, ``v = reshape(broadcast(x5))`` with x5 ``[..., Hkv, 1, S, D]``
    broadcast to ``[..., Hkv, n, S, D]`` and merged to ``[..., Hkv * n, S, D]`` (x is x5 viewed
    ``[..., Hkv, S, D]``); or multi-query attention's ``v = broadcast(x)`` of one head ``[..., 1, S, D]``
    (Falcon). ``x`` may be a value to view so (a reshape the caller emits): see :func:`fold_kv_repeats`."""
    d = _def(v, "broadcast")
    if d is not None:  # one shared head
        x, full = d.operands[0], v.type.shape
        sh = x.type.shape
        if len(sh) >= 3 and len(sh) == len(full) and sh[-3] == 1 and sh[-2:] == full[-2:] and sh[:-3] == full[:-3]:
            return x, full[-3]
        return None
    r = _def(v, "reshape")
    d = _def(r.operands[0], "broadcast") if r is not None else None
    if d is None:
        return None
    x5 = d.operands[0]
    sh, full = x5.type.shape, d.results[0].type.shape
    if (len(sh) < 4 or len(full) != len(sh) or sh[-4] != full[-4] or sh[-3] != 1 or sh[-2:] != full[-2:]
            or sh[:-4] != full[:-4] or v.type.shape != full[:-4] + (full[-4] * full[-3],) + full[-2:]):
        return None
    return x5, full[-3]


def fold_kv_repeats(f: Function) -> tuple[Function, int]:
    """A copy of ``f`` where each ``attention`` whose key and value repeat their heads for grouped-query
    attention (``repeat_kv``), or broadcast one head to all (multi-query), reads the shared heads
    itself; also how many.

    PyTorch's CPU flash kernels read a grouped key and value as they are (eager's SDPA path with
    ``enable_gqa``), so the repeated copies, which the backward also kept alive, and the sums of their
    gradients over the repeats go; the key and value gradients are summed over query heads inside the
    kernel, in another order (values equal to rounding). Bool masks or none (the grouped op takes no
    additive mask), heads-first operands."""
    def rewrite(ins: Instruction, b: Builder, users) -> tuple[Value, Value] | None:
        if ins.attrs.get("seq_first", False) or (len(ins.operands) == 4 and ins.operands[3].type.dtype != DType.bool):
            return None
        rk, rv = _repeated_heads(ins.operands[1]), _repeated_heads(ins.operands[2])
        if rk is None or rv is None or rk[1] != rv[1]:
            return None
        kv = [x if x.type.rank == ins.operands[1].type.rank else
              b.op("reshape", x, shape=x.type.shape[:-3] + x.type.shape[-2:]) for x, _ in (rk, rv)]
        return tuple(b.op("attention", ins.operands[0], *kv, *ins.operands[3:], **ins.attrs))

    return _rewrite_attentions(f, rewrite)


def fold_kv_repeats_pass(module: Module) -> Module:
    """Grouped-query attention reads its shared key/value heads in place; see :func:`fold_kv_repeats`."""
    return Module([fold_kv_repeats(f)[0] for f in module])


# ---------------------------------------------------------------- attention over slices of the batch
CHUNK_SCORES = 1 << 16
"""Scores per slice of the batch that :func:`chunk_attention` aims for: 256 KiB of f32 scores, about
the workspace of the explicit kernels over one slice (HF ViT's [16, 4, 65, 65] scores: 5 slices);
each further slice runs the kernel's operations again."""


@dataclass
class ChunkSite:
    """One attention set to run over slices of its batch: its scores' shape and the slices."""

    shape: tuple[int, ...]
    chunks: int


def _sliceable_scores(ins: Instruction, max_queries: int) -> tuple[int, ...] | None:
    """The scores' shape of an ``attention`` or ``attention_grad`` in low precision over fewer than
    ``max_queries`` queries per head, with a leading (batch) axis; None for any other."""
    first = 0 if ins.op.name == "attention" else 1
    q, k = ins.operands[first].type, ins.operands[first + 1].type
    seq_first = ins.attrs.get("seq_first", False)
    if (not q.dtype.is_low or q.rank < (4 if seq_first else 3) or q.shape[0] < 2
            or (q.shape[-3] if seq_first else q.shape[-2]) >= max_queries):
        return None  # (the leading axis must be a batch axis: not [T, H, D]'s T)
    return scores_shape(swap_heads(q) if seq_first else q, swap_heads(k) if seq_first else k)


def slices(ins: Instruction, max_queries: int, scores_per_chunk: int = CHUNK_SCORES) -> int:
    """How many slices of the batch :func:`chunk_attention` computes an ``attention`` or
    ``attention_grad`` over: 1 unless it is in low precision, over fewer than ``max_queries`` queries
    per head, with a leading (batch) axis."""
    scores = _sliceable_scores(ins, max_queries)
    return 1 if scores is None else min(scores[0], -(-prod(scores) // scores_per_chunk))


def chunk_attention(f: Function, max_queries: int, scores_per_chunk: int = CHUNK_SCORES
                    ) -> tuple[Function, list[ChunkSite]]:
    """A copy of ``f`` whose low-precision ``attention`` over fewer than ``max_queries`` queries per
    head (those whose kernels hold the [..., T, S] scores as their workspace) computes over slices of
    its leading (batch) axis of about ``scores_per_chunk`` scores each (the ``chunks`` attribute,
    which the VJP gives its ``attention_grad``): the same values, a workspace a slice's size. Also
    one :class:`ChunkSite` per attention set (none when nothing was)."""
    sites: list[ChunkSite] = []

    def rewrite(ins: Instruction, b: Builder, users) -> tuple[Value, Value] | None:
        n = slices(ins, max_queries, scores_per_chunk)
        if n < 2 or ins.attrs.get("chunks", 1) > 1:
            return None
        sites.append(ChunkSite(_sliceable_scores(ins, max_queries), n))
        return tuple(b.op("attention", *ins.operands, **{**ins.attrs, "chunks": n}))

    g, _ = _rewrite_attentions(f, rewrite)
    return g, sites
