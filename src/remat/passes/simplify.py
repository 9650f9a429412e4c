"""Algebraic simplification as declarative rule tables: ``RULES[op]`` lists small functions
``rule(ins, b) -> Value | None`` that return a replacement for the instruction's result (emitting
any new instruction through the builder ``b``) or None when they do not apply. The pass applies the
rules until nothing changes.

Every rule is exact for all inputs, NaN and infinities included: ``x*1 -> x`` holds for every
float, while ``x*0 -> 0`` or ``x-x -> 0`` do not (NaN, inf) and are deliberately absent.
"""
from __future__ import annotations

from typing import Callable

from ..ir import OPS, Block, Builder, Function, Instruction, Module, Value
from ..ir.types import broadcast_shapes
from ._rewrite import apply_replacements, constant_value, resolve, splat_value, view_root, view_step

Rule = Callable[[Instruction, Builder], "Value | None"]


_splat = splat_value


def _is(v: Value, value: float) -> bool:
    c = _splat(v)
    return c is not None and not isinstance(c, bool) and v.type.dtype.value != "bool" and c == value


def _def(v: Value, op: str) -> Instruction | None:
    ins = getattr(v, "instr", None)
    return ins if ins is not None and ins.op.name == op else None


def _same(ins: Instruction, v: Value) -> Value | None:
    """``v`` if it can stand for the result (same type), else None."""
    return v if v.type == ins.results[0].type else None


def _right_identity(value: float) -> Rule:
    def rule(ins, b):
        x, y = ins.operands
        return _same(ins, x) if _is(y, value) else None

    rule.__name__ = f"x_op_{value:g}"
    return rule


def _left_identity(value: float) -> Rule:
    def rule(ins, b):
        x, y = ins.operands
        return _same(ins, y) if _is(x, value) else None

    rule.__name__ = f"{value:g}_op_x"
    return rule


def neg_neg(ins, b):
    d = _def(ins.operands[0], "neg")
    return d.operands[0] if d else None


def transpose_identity(ins, b):
    return ins.operands[0] if list(ins.attrs["perm"]) == list(range(len(ins.attrs["perm"]))) else None


def transpose_transpose(ins, b):
    d = _def(ins.operands[0], "transpose")
    if not d:
        return None
    p1, p2 = d.attrs["perm"], ins.attrs["perm"]
    perm = [p1[i] for i in p2]
    x = d.operands[0]
    return x if perm == list(range(len(perm))) else b.op("transpose", x, perm=perm)


_PER_AXIS = {"pad": ("low", "high", "interior"), "slice": ("start", "stop", "step")}
"""Ops that treat each axis alone, with their per-axis attributes: a transpose commutes with them."""


def transpose_per_axis_transpose(ins, b):
    """``transpose(op(transpose(x, p)), q)`` with ``q`` undoing ``p`` and ``op`` a pad or slice ->
    ``op(x)``, its per-axis attributes permuted: a layout change around an op that reads each axis
    alone, such as the NCHW round trip the layout pass puts around a TF-style ``F.pad`` before a
    channels-last convolution (MobileNetV2: four transposed copies per padded convolution, two of
    them in the backward the pad's slice gets)."""
    d = getattr(ins.operands[0], "instr", None)
    if d is None or d.op.name not in _PER_AXIS:
        return None
    inner = _def(d.operands[0], "transpose")
    if inner is None:
        return None
    p, q = inner.attrs["perm"], ins.attrs["perm"]
    if [p[i] for i in q] != list(range(len(q))):
        return None
    attrs = dict(d.attrs)
    for a in _PER_AXIS[d.op.name]:
        vals = attrs.get(a)
        if vals and len(vals) != len(p):
            return None
        if vals:  # axis j of the transposed operand is axis p[j] of x
            moved = [0] * len(vals)
            for j, v in enumerate(vals):
                moved[p[j]] = v
            attrs[a] = moved
    return _same(ins, b.op(d.op.name, inner.operands[0], **attrs))


def same_shape(ins, b):
    return _same(ins, ins.operands[0])


def reshape_reshape(ins, b):
    d = _def(ins.operands[0], "reshape")
    return b.op("reshape", d.operands[0], shape=ins.attrs["shape"]) if d else None


def view_chain(ins, b):
    """A transpose or reshape at the end of a chain of transposes and reshapes (at least one a transpose)
    that gives the chain's root in its stored order -> one reshape of the root, no copy. A channels-last
    value read as a sequence: ``transpose(x_nhwc, [0, 3, 1, 2])`` (to NCHW), ``reshape [N, C, H*W]``,
    ``transpose [0, 2, 1]`` (``flatten(2).transpose(1, 2)``) is ``reshape(x_nhwc, [N, H*W, C])``."""
    found = view_root(ins.operands[0], [view_step(ins)])
    if found is None:
        return None
    v, steps = found
    if not any(kind == "transpose" for kind, _ in steps):
        return None  # reshapes alone: reshape_reshape's
    t = ins.results[0].type
    return v if v.type == t else b.op("reshape", v, shape=t.shape)


def broadcast_broadcast(ins, b):
    d = _def(ins.operands[0], "broadcast")
    return b.op("broadcast", d.operands[0], shape=ins.attrs["shape"]) if d else None


def cast_same(ins, b):
    return _same(ins, ins.operands[0])


def select_constant(ins, b):
    c, x, y = ins.operands
    cv = constant_value(c)
    if cv is None:
        return None
    v = x if cv else y
    t = ins.results[0].type
    if v.type == t:
        return v
    return b.op("broadcast", v, shape=t.shape)


def reduce_nothing(ins, b):
    return _same(ins, ins.operands[0]) if not ins.attrs["axes"] else None


def slice_full(ins, b):
    t = ins.operands[0].type
    a = ins.attrs
    if all(s == 0 and e == d and st == 1 for s, e, st, d in zip(a["start"], a["stop"], a["step"], t.shape)):
        return ins.operands[0]
    return None


def pad_nothing(ins, b):
    a = ins.attrs
    return ins.operands[0] if not any(a["low"]) and not any(a["high"]) and not any(a["interior"]) else None


def concat_one(ins, b):
    return ins.operands[0] if len(ins.operands) == 1 else None


def concat_concat(ins, b):
    """concat(a, concat(b, c), d) along one axis -> concat(a, b, c, d) (the inner join never held)."""
    axis = ins.attrs["axis"]
    inner = [_def(v, "concat") for v in ins.operands]
    if not any(d is not None and d.attrs["axis"] == axis for d in inner):
        return None
    ops = [x for v, d in zip(ins.operands, inner)
           for x in (d.operands if d is not None and d.attrs["axis"] == axis else [v])]
    return b.op("concat", *ops, axis=axis)


def _zero_pad_span(v: Value) -> tuple[Value, int, int, int] | None:
    """(x, axis, low, high) when ``v = pad(x)`` with zeros on one axis only, no interior padding."""
    d = _def(v, "pad")
    if d is None or d.attrs["value"] != 0.0 or any(d.attrs["interior"]):
        return None
    axes = [k for k, (lo, hi) in enumerate(zip(d.attrs["low"], d.attrs["high"])) if lo or hi]
    if len(axes) != 1 or d.attrs["low"][axes[0]] < 0 or d.attrs["high"][axes[0]] < 0:
        return None
    k = axes[0]
    return d.operands[0], k, d.attrs["low"][k], d.attrs["high"][k]


def add_adjacent_pads(ins, b):
    """pad(a) + pad(c) over adjacent spans of one axis -> pad(concat(a, c)): the gradient of a
    tensor split into slices (q, k, v of one projection), summed from zero-padded pieces, as one
    join; each piece is read once instead of padding every piece to the whole shape. Exact but for
    the sign of zero (x + 0 gives +0 for x = -0; the join keeps -0), as ``x + 0 -> x``."""
    x, y = ins.operands
    sx, sy = _zero_pad_span(x), _zero_pad_span(y)
    if sx is None or sy is None or sx[1] != sy[1] or x.type != ins.results[0].type or y.type != x.type:
        return None
    k = sx[1]
    if sx[2] > sy[2]:
        sx, sy = sy, sx
    (a, _, lo_a, _), (c, _, lo_c, hi_c) = sx, sy
    if lo_a + a.type.shape[k] != lo_c:
        return None  # overlapping or with a gap between
    joined = b.op("concat", a, c, axis=k)
    low = [0] * x.type.rank
    high = [0] * x.type.rank
    low[k], high[k] = lo_a, hi_c
    if not lo_a and not hi_c:
        return joined
    return b.op("pad", joined, low=low, high=high, interior=[0] * x.type.rank)


def _swapped_last_two(v: Value) -> Value | None:
    """x when ``v = transpose(x)`` swaps only x's last two dims, else None."""
    d = _def(v, "transpose")
    if d is None:
        return None
    r = len(d.attrs["perm"])
    return d.operands[0] if r >= 2 and list(d.attrs["perm"]) == list(range(r - 2)) + [r - 1, r - 2] else None


def matmul_transposed_operand(ins, b):
    """matmul(transpose(x), y) -> matmul(x, y, transpose_a flipped) (and likewise for y): the
    product reads the operand as a view instead of a materialised copy; dce drops the dead transpose."""
    (a, c), at = ins.operands, dict(ins.attrs)
    xa, xc = _swapped_last_two(a), _swapped_last_two(c)
    if xa is None and xc is None:
        return None
    if xa is not None:
        a, at["transpose_a"] = xa, not at["transpose_a"]
    if xc is not None:
        c, at["transpose_b"] = xc, not at["transpose_b"]
    return b.op("matmul", a, c, **at)


def grouped_mm_transposed_weight(ins, b):
    """grouped_mm(x, transpose(w), offs) -> grouped_mm(x, w, offs, transpose_w flipped) (transformers
    transposes its experts' [E, out, in] weights before each grouped matmul): the weights are read
    in place instead of copied every step."""
    x, w, offs = ins.operands
    src = _swapped_last_two(w)
    if src is None:
        return None
    return b.op("grouped_mm", x, src, offs, transpose_w=not ins.attrs["transpose_w"])


def matmul_broadcast_operand(ins, b):
    """matmul(a, broadcast(w)) -> matmul(a, w) when the broadcast only adds or expands batch axes
    (PyTorch's matmul decomposition: ``expand(weight, [b, in, out])`` + ``bmm``): the product
    broadcasts batch axes itself, so no expanded copy exists, and the backward of a 2-D weight is
    one 2-D product over the flattened batch instead of a batched product and a sum."""
    ops = list(ins.operands)
    for i, v in enumerate(ops):
        d = _def(v, "broadcast")
        if d is not None and d.operands[0].type.rank >= 2 and d.operands[0].type.shape[-2:] == v.type.shape[-2:]:
            ops[i] = d.operands[0]
    if ops == list(ins.operands):
        return None
    return _same(ins, b.op("matmul", *ops, **ins.attrs))


def elementwise_broadcast_operand(ins, b):
    """op(.., broadcast(x), ..) -> op(.., x, ..) for an element-wise op whose result keeps its shape
    without the broadcast (its other operands span it): element-wise ops broadcast their operands
    (NumPy rules, as ``broadcast`` itself), so the expanded copy need not exist. Such broadcasts
    come from VJPs (a mean's cotangent spread over its input, RMSNorm's backward) and feed fused
    kernels, which read a broadcasting operand in place."""
    ops = list(ins.operands)
    shape = ins.results[0].type.shape
    for i, v in enumerate(ops):
        d = _def(v, "broadcast")
        if d is None:
            continue
        trial = ops[:i] + [d.operands[0]] + ops[i + 1:]
        try:
            if broadcast_shapes(*(o.type.shape for o in trial)) == shape:
                ops = trial
        except ValueError:
            continue
    if ops == list(ins.operands):
        return None
    try:  # ops that pair a gradient with a value (relu_grad, ...) want equal shapes: no broadcasting
        ins.op.result_types([o.type for o in ops], ins.attrs)
    except TypeError:
        return None
    return _same(ins, b.op(ins.op.name, *ops, **ins.attrs))


RULES: dict[str, list[Rule]] = {
    "matmul": [matmul_transposed_operand, matmul_broadcast_operand],
    "grouped_mm": [grouped_mm_transposed_weight],
    "mul": [_right_identity(1), _left_identity(1)],
    "add": [_right_identity(0), _left_identity(0), add_adjacent_pads],
    "sub": [_right_identity(0)],
    "div": [_right_identity(1)],
    "pow": [_right_identity(1)],
    "neg": [neg_neg],
    "transpose": [transpose_identity, transpose_transpose, view_chain, transpose_per_axis_transpose],
    "reshape": [same_shape, reshape_reshape, view_chain],
    "broadcast": [same_shape, broadcast_broadcast],
    "cast": [cast_same],
    "select": [select_constant],
    "reduce_sum": [reduce_nothing],
    "reduce_mean": [reduce_nothing],
    "reduce_max": [reduce_nothing],
    "slice": [slice_full],
    "pad": [pad_nothing],
    "concat": [concat_one, concat_concat],
}
for _name, _op in OPS.items():  # every element-wise op reads a broadcast operand in place
    if "elementwise" in _op.tags and _op.num_results == 1 and not _op.aliases:
        RULES[_name] = RULES.get(_name, []) + [elementwise_broadcast_operand]


def rewrite_function(f: Function, rules: dict[str, list[Rule]], max_rounds: int = 20) -> tuple[Function, list[str]]:
    """Apply ``rules`` to a copy of ``f`` until none fires; also returns the names of the rules that fired."""
    g = f.clone()
    fired: list[str] = []
    if g.is_declaration:
        return g, fired
    for _ in range(max_rounds):
        repl: dict[Value, Value] = {}
        changed = False
        for blk in g.blocks:
            out: list[Instruction] = []
            for ins in blk.instrs:
                ins.operands = [resolve(repl, v) for v in ins.operands]
                for s in ins.successors:
                    s.args = [resolve(repl, v) for v in s.args]
                new = None
                if len(ins.results) == 1:
                    scratch = Block()
                    bld = Builder(scratch, loc=ins.loc)  # what replaces an instruction comes from where it did
                    for rule in rules.get(ins.op.name, ()):
                        new = rule(ins, bld)
                        if new is not None:
                            fired.append(f"{ins.op.name}:{rule.__name__}")
                            break
                        scratch.instrs.clear()
                    if new is not None:
                        for ni in scratch.instrs:
                            ni.block = blk
                        out.extend(scratch.instrs)
                        repl[ins.results[0]] = new
                        changed = True
                        continue
                out.append(ins)
            blk.instrs = out
        apply_replacements(g, repl)
        if not changed:
            break
    return g, fired


def simplify(module: Module) -> Module:
    """Algebraic simplification with :data:`RULES` in every function."""
    return Module([rewrite_function(f, RULES)[0] for f in module])
