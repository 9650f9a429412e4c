"""Data-movement ops: transpose, reshape (a view), broadcast, slice, pad, concat, gather/scatter,
and value-producing ops without operands (constant, iota)."""
from __future__ import annotations

from math import prod

import numpy as np

from ..opdef import Attr, IndexBounds, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import check_axis, expect_same_dtype, ints, max_numel, no_flops, norm_axis, rand


def _transpose_infer(types, attrs):
    (t,) = types
    perm = attrs["perm"]
    if sorted(perm) != list(range(t.rank)):
        raise TypeError(f"'transpose': perm {list(perm)} is not a permutation of 0..{t.rank - 1} for {t}")
    return t.with_shape(tuple(t.shape[p] for p in perm))


def _transpose_norm(types, attrs):
    return {**attrs, "perm": tuple(norm_axis(p, types[0].rank) for p in attrs["perm"])} if types else attrs


declare(OpDef("transpose", 1, (ints("perm"),), _transpose_infer, frozenset({"shape"}), normalize=_transpose_norm,
              doc="permute axes (materialises a contiguous result)", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 2, 3, 4)], {"perm": (2, 0, 1)}), Sample([rand(r, 3, 4)], {"perm": (1, 0)})]))


def _reshape_infer(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    if any(d < 0 for d in shape) or prod(shape) != t.numel:
        raise TypeError(f"'reshape': cannot reshape {t} ({t.numel} elements) to {list(shape)} ({prod(shape)} elements)")
    return t.with_shape(shape)


declare(OpDef("reshape", 1, (ints("shape"),), _reshape_infer, frozenset({"shape", "view"}), aliases={0: 0},
              doc="same elements, new shape; shares the operand's storage", flops=no_flops,
              sample=lambda r: [Sample([rand(r, 2, 6)], {"shape": (3, 4)}), Sample([rand(r, 4)], {"shape": (2, 1, 2)}),
                                Sample([rand(r, 1, 1)], {"shape": ()})]))


def _broadcast_infer(types, attrs):
    (t,) = types
    shape = attrs["shape"]
    ok = len(shape) >= t.rank and all(d == s or d == 1 for d, s in zip(t.shape[::-1], shape[::-1]))
    if not ok:
        raise TypeError(f"'broadcast': {t} cannot broadcast to {list(shape)} (dims must match or be 1, aligned right)")
    return t.with_shape(shape)


declare(OpDef("broadcast", 1, (ints("shape"),), _broadcast_infer, frozenset({"shape"}),
              doc="NumPy broadcast_to, materialised", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 3, 1)], {"shape": (2, 3, 4)}), Sample([rand(r)], {"shape": (2, 2)})]))


def _slice_infer(types, attrs):
    (t,) = types
    start, stop, step = attrs["start"], attrs["stop"], attrs["step"] or (1,) * t.rank
    if not (len(start) == len(stop) == len(step) == t.rank):
        raise TypeError(f"'slice': start/stop/step need {t.rank} entries for {t}, got {list(start)}, {list(stop)}, {list(step)}")
    out = []
    for i, (a, b, s, d) in enumerate(zip(start, stop, step, t.shape)):
        if s < 1 or not 0 <= a <= b <= d:
            raise TypeError(f"'slice': axis {i} of {t}: need 0 <= start <= stop <= {d} and step >= 1, got {a}:{b}:{s}")
        out.append(-(-(b - a) // s))
    return t.with_shape(out)


def _slice_norm(types, attrs):
    if not attrs["step"] and types:
        attrs = {**attrs, "step": (1,) * types[0].rank}
    return attrs


declare(OpDef("slice", 1, (ints("start"), ints("stop"), ints("step", ())), _slice_infer, frozenset({"shape"}),
              normalize=_slice_norm, doc="strided slice x[start:stop:step] per axis, materialised", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 4, 6)], {"start": (1, 0), "stop": (3, 6), "step": (1, 2)}),
                                Sample([rand(r, 5)], {"start": (2,), "stop": (5,), "step": (1,)})]))


def _pad_infer(types, attrs):
    (t,) = types
    lo, hi, it = attrs["low"], attrs["high"], attrs["interior"] or (0,) * t.rank
    if not (len(lo) == len(hi) == len(it) == t.rank) or min(lo + hi + it, default=0) < 0:
        raise TypeError(f"'pad': low/high/interior need {t.rank} non-negative entries for {t}, got {list(lo)}, {list(hi)}, {list(it)}")
    return t.with_shape(tuple(a + b + d + max(d - 1, 0) * i for a, b, i, d in zip(lo, hi, it, t.shape)))


def _pad_norm(types, attrs):
    if not attrs["interior"] and types:
        attrs = {**attrs, "interior": (0,) * types[0].rank}
    return attrs


declare(OpDef("pad", 1, (ints("low"), ints("high"), ints("interior", ()), Attr("value", "float", 0.0)), _pad_infer,
              frozenset({"shape"}), normalize=_pad_norm,
              doc="pad with a constant: low/high per axis, interior between elements (XLA's pad)", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 2, 3)], {"low": (1, 0), "high": (0, 2), "interior": (0, 1)}),
                                Sample([rand(r, 3)], {"low": (2,), "high": (1,), "interior": (0,), "value": 0.5})]))


def _concat_infer(types, attrs):
    axis = attrs["axis"]
    t0 = types[0]
    check_axis("concat", axis, t0.rank)
    expect_same_dtype("concat", types)
    for t in types[1:]:
        if t.rank != t0.rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, t0.shape)) if i != axis):
            raise TypeError(f"'concat' along axis {axis}: shapes {', '.join(str(x) for x in types)} differ off that axis")
    return t0.with_shape(t0.shape[:axis] + (sum(t.shape[axis] for t in types),) + t0.shape[axis + 1:])


def _axis_norm(types, attrs):
    return {**attrs, "axis": norm_axis(attrs["axis"], types[0].rank)} if types else attrs


declare(OpDef("concat", None, (Attr("axis", "int"),), _concat_infer, frozenset({"shape", "promote"}), normalize=_axis_norm,
              doc="join along an axis", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 2, 3), rand(r, 2, 1), rand(r, 2, 2)], {"axis": 1}),
                                Sample([rand(r, 1, 2), rand(r, 3, 2)], {"axis": 0})]))


def _gather_infer(types, attrs):
    table, idx = types
    axis = attrs["axis"]
    check_axis("gather", axis, table.rank)
    if not idx.dtype.is_int:
        raise TypeError(f"'gather' indices must be i32 or i64, got {idx}")
    return table.with_shape(table.shape[:axis] + idx.shape + table.shape[axis + 1:])


declare(OpDef("gather", 2, (Attr("axis", "int", 0), Attr("padding_idx", "int", -1)), _gather_infer, frozenset({"shape"}),
              normalize=_axis_norm,
              index_bounds=lambda types, attrs: IndexBounds(1, types[0].shape[attrs["axis"]]),
              doc="numpy take(table, indices, axis): embedding lookup when axis=0; padding_idx >= 0: that index's "
                  "entries get no gradient (nn.Embedding's padding_idx)", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 5, 3), r.integers(0, 5, size=(2, 4))]),
                                Sample([rand(r, 2, 4), r.integers(0, 4, size=(3,))], {"axis": 1})]))


def _scatter_infer(types, attrs):
    idx, upd = types
    shape, axis = attrs["shape"], attrs["axis"]
    check_axis("scatter_add", axis, len(shape))
    if not idx.dtype.is_int:
        raise TypeError(f"'scatter_add' indices must be i32 or i64, got {idx}")
    want = tuple(shape[:axis]) + idx.shape + tuple(shape[axis + 1:])
    if upd.shape != want:
        raise TypeError(f"'scatter_add' updates must have shape {list(want)} for indices {idx} into {list(shape)}, got {upd}")
    return upd.with_shape(shape)


declare(OpDef("scatter_add", 2, (ints("shape"), Attr("axis", "int", 0)), _scatter_infer, frozenset({"shape"}),
              index_bounds=lambda types, attrs: IndexBounds(0, attrs["shape"][attrs["axis"]]),
              doc="zeros(shape) with updates added at indices along axis (the transpose of gather)", flops=max_numel,
              sample=lambda r: [Sample([r.integers(0, 5, size=(2, 4)), rand(r, 2, 4, 3)], {"shape": (5, 3)}),
                                Sample([r.integers(0, 4, size=(3,)), rand(r, 2, 3)], {"shape": (2, 4), "axis": 1})]))


def _constant_infer(types, attrs):
    return TensorType(attrs["dtype"], attrs["shape"])


declare(OpDef("constant", 0, (Attr("value", "scalar"), ints("shape", ()), Attr("dtype", "dtype", DType.f32)),
              _constant_infer, frozenset({"constant"}), nondiff=True, doc="a tensor filled with one value", flops=no_flops,
              sample=lambda r: [Sample([], {"value": 1.5, "shape": (2, 3), "dtype": DType.f32}),
                                Sample([], {"value": 3, "shape": (), "dtype": DType.i64})]))


def _iota_infer(types, attrs):
    shape = attrs["shape"]
    check_axis("iota", attrs["axis"], len(shape))
    return TensorType(attrs["dtype"], shape)


declare(OpDef("iota", 0, (ints("shape"), Attr("axis", "int", 0), Attr("dtype", "dtype", DType.i64)), _iota_infer,
              frozenset({"constant"}), nondiff=True, doc="index along an axis, broadcast over the others (0, 1, 2, …)", flops=no_flops,
              sample=lambda r: [Sample([], {"shape": (3, 4), "axis": 1}), Sample([], {"shape": (5,), "dtype": DType.f32})]))


# ================================================================ VJP rules (reverse mode)
# rule(b, p, g) -> one cotangent per operand; see remat.ir.ops._vjp. Data movement keeps nothing
# from the forward except integer indices.
from ..opdef import def_vjp  # noqa: E402
from ._vjp import const as _const, unbroadcast as _unb  # noqa: E402


@def_vjp("transpose", saves="none")
def _transpose_vjp(b, p, g):
    perm = p.attrs["perm"]
    inv = [0] * len(perm)
    for i, q in enumerate(perm):
        inv[q] = i
    return [b.op("transpose", g, perm=inv)]


@def_vjp("reshape", saves="none")
def _reshape_vjp(b, p, g):
    return [b.op("reshape", g, shape=p.in_types[0].shape)]


@def_vjp("broadcast", saves="none")
def _broadcast_vjp(b, p, g):
    return [_unb(b, g, p.in_types[0].shape)]


@def_vjp("slice", saves="none")
def _slice_vjp(b, p, g):
    # Scatter the slice back with a pad: start zeros, step-1 zeros between elements, the rest after.
    shape = p.in_types[0].shape
    a, s = p.attrs["start"], p.attrs["step"]
    n = g.type.shape
    high = [d - (ai + (ni - 1) * si + 1) if ni else d - ai for d, ai, si, ni in zip(shape, a, s, n)]
    return [b.op("pad", g, low=list(a), high=high, interior=[si - 1 for si in s])]


@def_vjp("pad", saves="none")
def _pad_vjp(b, p, g):
    shape = p.in_types[0].shape
    lo, it = p.attrs["low"], p.attrs["interior"]
    stop = [l + (d - 1) * (i + 1) + 1 if d else l for l, d, i in zip(lo, shape, it)]
    return [b.op("slice", g, start=lo, stop=stop, step=[i + 1 for i in it])]


@def_vjp("concat", saves="none")
def _concat_vjp(b, p, g):
    axis, out, off = p.attrs["axis"], [], 0
    full = g.type.shape
    for t in p.in_types:
        start = [0] * len(full)
        stop = list(full)
        start[axis], stop[axis] = off, off + t.shape[axis]
        off += t.shape[axis]
        out.append(b.op("slice", g, start=start, stop=stop, step=[1] * len(full)))
    return out


@def_vjp("gather", saves=(1,))
def _gather_vjp(b, p, g):
    idx, axis, pad = p.x[1], p.attrs["axis"], p.attrs.get("padding_idx", -1)
    if pad >= 0:  # nn.Embedding(padding_idx=pad): the padding entry's row gets no gradient, as in PyTorch
        keep = b.op("ne", idx, _const(b, pad, idx.type.dtype))
        table = p.in_types[0]
        keep = b.op("reshape", keep, shape=(1,) * axis + idx.type.shape + (1,) * (table.rank - axis - 1))
        g = b.op("select", keep, g, _const(b, 0.0, g.type.dtype))
    return [b.op("scatter_add", idx, g, shape=p.in_types[0].shape, axis=axis), None]


@def_vjp("scatter_add", saves=(0,))
def _scatter_add_vjp(b, p, g):
    return [None, b.op("gather", g, p.x[0], axis=p.attrs["axis"])]
