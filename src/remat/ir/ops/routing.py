"""Routing ops: sorting, top-k, histograms, ``index_put`` and grouped matmuls.

What a mixture-of-experts layer's dispatch is made of (pick each token's experts with ``topk``,
group the token-expert pairs by expert with ``sort``, count each expert's rows with ``histc``, run
each expert's rows through its own weight with ``grouped_mm``, put the rows back in token order
with ``index_put``), and what a masked autoencoder's random masking is made of (``sort`` of noise).
Shapes are static; only values depend on the data, and every op here is a deterministic function
of its operands (ties broken by position), so a recomputed routing picks the same experts.
"""
from __future__ import annotations

import math

import numpy as np

from ..opdef import Attr, IndexBounds, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import check_axis, expect_float, expect_same_dtype, max_numel, norm_axis, rand

_INDEX_DTYPES = (DType.i32, DType.i64)


def _axis_norm(types, attrs):
    return {**attrs, "axis": norm_axis(attrs["axis"], types[0].rank)} if types else attrs


def _distinct(r: np.random.Generator, *shape: int) -> np.ndarray:
    """Distinct values 0.25 apart, exact in bf16 and f16 (no ties after rounding; up to 256 of them)."""
    n = math.prod(shape)
    return ((r.permutation(n) - n // 2) * 0.25).reshape(shape).astype(np.float64)


# ---------------------------------------------------------------- sort and top-k
def _sort_infer(types, attrs):
    (t,) = types
    check_axis("sort", attrs["axis"], t.rank)
    if t.dtype == DType.bool:
        raise TypeError(f"'sort' of {t}: cast booleans to an integer dtype first")
    return t, t.with_dtype(DType.i64)


declare(OpDef("sort", 1, (Attr("axis", "int", -1), Attr("descending", "bool", False)), _sort_infer, frozenset(),
              num_results=2, normalize=_axis_norm,
              flops=lambda ins, outs, attrs: float(outs[0].numel * max(1, math.ceil(math.log2(max(2, ins[0].shape[attrs["axis"]]))))),
              doc="stable sort along an axis: (values, i64 indices into the axis); equal values keep their order, "
                  "NaN sorts as the largest (ATen's sort and argsort)",
              sample=lambda r: [Sample([_distinct(r, 3, 6)], {"axis": 1}),
                                Sample([_distinct(r, 2, 5)], {"axis": 0, "descending": True}),
                                Sample([r.integers(0, 3, size=(12,))], {"descending": True}),
                                Sample([r.integers(0, 4, size=(2, 9))], {})]))


def _topk_infer(types, attrs):
    (t,) = types
    check_axis("topk", attrs["axis"], t.rank)
    if t.dtype == DType.bool:
        raise TypeError(f"'topk' of {t}: cast booleans to an integer dtype first")
    n, k = t.shape[attrs["axis"]], attrs["k"]
    if not 0 <= k <= n:
        raise TypeError(f"'topk': k={k} is out of range for an axis of {n}; valid: 0..{n}")
    shape = list(t.shape)
    shape[attrs["axis"]] = k
    return t.with_shape(tuple(shape)), TensorType(DType.i64, tuple(shape))


declare(OpDef("topk", 1, (Attr("k", "int"), Attr("axis", "int", -1), Attr("largest", "bool", True)), _topk_infer,
              frozenset(), num_results=2, normalize=_axis_norm, flops=max_numel,
              doc="the k largest (or smallest) values along an axis, in order, and their i64 indices; equal values "
                  "in order of position (the first k of a stable sort)",
              sample=lambda r: [Sample([_distinct(r, 5, 6)], {"k": 2}),
                                Sample([_distinct(r, 4, 3)], {"k": 3, "axis": 0, "largest": False}),
                                Sample([r.integers(0, 3, size=(3, 8))], {"k": 4})]))


# ---------------------------------------------------------------- histogram
def _histc_infer(types, attrs):
    (t,) = types
    expect_float("histc", t)
    if attrs["bins"] < 1:
        raise TypeError(f"'histc': bins must be at least 1, got {attrs['bins']}")
    if not attrs["min"] < attrs["max"]:
        raise TypeError(f"'histc': min ({attrs['min']}) must be below max ({attrs['max']}); a range taken from the "
                        "data (PyTorch's min == max) is not supported")
    return TensorType(t.dtype, (attrs["bins"],))


def _histc_sample(r):
    return [Sample([r.integers(-2, 12, size=(4, 5)) * 0.5], {"bins": 4, "min": 0.0, "max": 4.0}),
            Sample([r.integers(0, 4, size=(16,)).astype(np.float64)], {"bins": 4, "min": 0.0, "max": 3.0}),
            Sample([r.integers(-3, 9, size=(10,)) * 0.5], {"bins": 3, "min": -1.0, "max": 2.0})]


declare(OpDef("histc", 1, (Attr("bins", "int"), Attr("min", "float"), Attr("max", "float")), _histc_infer,
              frozenset({"reduction"}), nondiff=True, flops=max_numel,
              doc="counts of the elements in bins equal-width bins over [min, max] (max falls in the last bin, "
                  "elements outside are not counted), in the operand's dtype (ATen's histc)",
              sample=_histc_sample))


# ---------------------------------------------------------------- index_put
def _index_put_infer(types, attrs):
    x, idx, upd = types
    axis = attrs["axis"]
    check_axis("index_put", axis, x.rank)
    if idx.dtype not in _INDEX_DTYPES:
        raise TypeError(f"'index_put' indices must be i32 or i64, got {idx}")
    want = x.shape[:axis] + idx.shape + x.shape[axis + 1:]
    if upd.shape != want or upd.dtype != x.dtype:
        raise TypeError(f"'index_put' values must be {x.dtype}{list(want)} for indices {idx} into {x}, got {upd}")
    return x


def _index_put_sample(r):
    return [Sample([rand(r, 5, 3), r.permutation(5)[:3], rand(r, 3, 3)], {}),
            Sample([rand(r, 5, 3), r.integers(0, 5, size=(2, 4)), rand(r, 2, 4, 3)], {"accumulate": True}),
            Sample([rand(r, 2, 6), r.permutation(6)[:4].reshape(2, 2), rand(r, 2, 2, 2)], {"axis": 1}),
            Sample([np.zeros(6, np.int64), r.permutation(6), np.arange(6)], {})]


declare(OpDef("index_put", 3, (Attr("axis", "int", 0), Attr("accumulate", "bool", False)), _index_put_infer,
              frozenset(), normalize=_axis_norm, flops=max_numel,
              index_bounds=lambda types, attrs: IndexBounds(1, types[0].shape[attrs["axis"]]),
              doc="x with the values put at indices along axis (added when accumulate; with repeated indices and "
                  "no accumulate, the last one written wins): ATen's index_put and index_add",
              sample=_index_put_sample))


# ---------------------------------------------------------------- grouped matmul
def _grouped_mm_infer(types, attrs):
    x, w, offs = types
    tw = attrs["transpose_w"]
    if x.rank != 2 or w.rank != 3:
        raise TypeError(f"'grouped_mm' takes rows [S, K] and weights [E, K, N] ([E, N, K] with transpose_w), got {x} and {w}")
    expect_float("grouped_mm", x)
    expect_same_dtype("grouped_mm", [x, w])
    if offs.dtype not in _INDEX_DTYPES or offs.shape != (w.shape[0],):
        raise TypeError(f"'grouped_mm' offsets must be i32[{w.shape[0]}] or i64[{w.shape[0]}] (one per group), got {offs}")
    k = w.shape[2] if tw else w.shape[1]
    if x.shape[1] != k:
        raise TypeError(f"'grouped_mm': rows {x} do not match weights {w}{' (transposed)' if tw else ''}")
    return x.with_shape((x.shape[0], w.shape[1] if tw else w.shape[2]))


def _grouped_mm_weight_grad_infer(types, attrs):
    x, g, offs = types
    if x.rank != 2 or g.rank != 2 or x.shape[0] != g.shape[0]:
        raise TypeError(f"'grouped_mm_weight_grad' takes rows [S, K] and output gradients [S, N], got {x} and {g}")
    expect_float("grouped_mm_weight_grad", x)
    expect_same_dtype("grouped_mm_weight_grad", [x, g])
    if offs.dtype not in _INDEX_DTYPES or offs.rank != 1:
        raise TypeError(f"'grouped_mm_weight_grad' offsets must be i32[E] or i64[E], got {offs}")
    e, k, n = offs.shape[0], x.shape[1], g.shape[1]
    return x.with_shape((e, n, k) if attrs["transpose_w"] else (e, k, n))


def _offsets(r: np.random.Generator, s: int, e: int, full: bool) -> np.ndarray:
    """Nondecreasing group ends in [0, s] (the last one s when ``full``), with an empty group."""
    cuts = np.sort(r.integers(0, s + 1, size=e))
    cuts[1] = cuts[0]  # an empty group
    if full:
        cuts[-1] = s
    return cuts


def _grouped_mm_sample(r):
    return [Sample([rand(r, 7, 4), rand(r, 3, 4, 5), _offsets(r, 7, 3, True)], {}),
            Sample([rand(r, 6, 3), rand(r, 4, 2, 3), _offsets(r, 6, 4, False).astype(np.int32)], {"transpose_w": True})]


def _grouped_mm_weight_grad_sample(r):
    return [Sample([rand(r, 7, 4), rand(r, 7, 5), _offsets(r, 7, 3, True)], {}),
            Sample([rand(r, 6, 3), rand(r, 6, 2), _offsets(r, 6, 4, False).astype(np.int32)], {"transpose_w": True})]


_TW = Attr("transpose_w", "bool", False)
declare(OpDef("grouped_mm", 3, (_TW,), _grouped_mm_infer, frozenset({"matmul"}),
              flops=lambda ins, outs, attrs: 2.0 * outs[0].numel * ins[0].shape[1],
              doc="rows grouped by offsets times each group's weight: rows offs[e-1]:offs[e] times w[e] (w[e]^T "
                  "with transpose_w), rows past the last offset zero (transformers' grouped_mm of its experts)",
              sample=_grouped_mm_sample))
declare(OpDef("grouped_mm_weight_grad", 3, (_TW,), _grouped_mm_weight_grad_infer, frozenset({"matmul"}),
              flops=lambda ins, outs, attrs: 2.0 * ins[0].numel * ins[1].shape[1],
              doc="the weight gradient of grouped_mm from (rows, output gradient, offsets): x_e^T g_e per group "
                  "(g_e^T x_e with transpose_w), zero for an empty group",
              sample=_grouped_mm_weight_grad_sample))


# ================================================================ VJP rules and decompositions
from ..opdef import def_decomposition, def_vjp  # noqa: E402
from ._vjp import Saves, const as _const  # noqa: E402


def scatter_along(b, idx, g, shape, axis):
    """zeros(shape) with ``g[..., j, ...]`` added at ``idx[..., j, ...]`` along ``axis`` (``g`` and
    ``idx`` of one shape, equal to ``shape`` off the axis): the transpose of take-along-axis, as one
    flat ``scatter_add``."""
    shape = tuple(shape)
    n = math.prod(g.type.shape)
    out = b.op("scatter_add", flat_along(b, idx, shape, axis), b.op("reshape", g, shape=(n,)),
               shape=(math.prod(shape),), axis=0)
    return b.op("reshape", out, shape=shape)


def flat_along(b, idx, shape, axis):
    """i64[idx.numel]: the flat positions in an array of ``shape`` that ``idx`` points at along
    ``axis`` (the other coordinates: idx's own, each below ``shape``'s): take-along-axis as one
    flat ``gather``, its transpose as one flat ``scatter_add``."""
    shape = tuple(shape)
    ishape = idx.type.shape
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    flat = None
    for d in range(len(shape)):
        term = b.op("cast", idx, dtype=DType.i64) if d == axis and idx.type.dtype != DType.i64 else idx
        if d != axis:
            if ishape[d] == 1:
                continue
            term = b.op("iota", shape=ishape, axis=d, dtype=DType.i64)
        if strides[d] != 1:
            term = b.op("mul", term, _const(b, strides[d], DType.i64))
        flat = term if flat is None else b.op("add", flat, term)
    return b.op("reshape", flat, shape=(math.prod(ishape),))


@def_vjp("sort", saves=Saves(results=(1,)))
def _sort_vjp(b, p, g):
    gv = g[0]
    if gv is None:
        return [None]
    return [scatter_along(b, p.y[1], gv, p.in_types[0].shape, p.attrs["axis"])]


@def_vjp("topk", saves=Saves(results=(1,)))
def _topk_vjp(b, p, g):
    gv = g[0]
    if gv is None:
        return [None]
    return [scatter_along(b, p.y[1], gv, p.in_types[0].shape, p.attrs["axis"])]


@def_decomposition("topk")
def _topk_decompose(b, xs, attrs):
    (x,) = xs
    axis, k = attrs["axis"], attrs["k"]
    values, indices = b.op("sort", x, axis=axis, descending=attrs["largest"])
    start, stop = [0] * x.type.rank, list(x.type.shape)
    stop[axis] = k
    return [b.op("slice", values, start=start, stop=stop), b.op("slice", indices, start=start, stop=stop)]


@def_decomposition("histc")
def _histc_decompose(b, xs, attrs):
    """One-hot of each element's bin, summed: bin = floor((x - min) * bins / (max - min)), the last
    bin for x == max, none outside [min, max] (ATen's formula, in x's dtype)."""
    (x,) = xs
    dt, bins, lo, hi = x.type.dtype, attrs["bins"], attrs["min"], attrs["max"]
    flat = b.op("reshape", x, shape=(x.type.numel, 1))
    pos = b.op("floor", b.op("div", b.op("mul", b.op("sub", flat, _const(b, lo, dt)), _const(b, bins, dt)),
                                 _const(b, hi - lo, dt)))
    pos = b.op("select", b.op("eq", flat, _const(b, hi, dt)), _const(b, bins - 1, dt), pos)
    inside = b.op("and", b.op("ge", flat, _const(b, lo, dt)), b.op("le", flat, _const(b, hi, dt)))
    hit = b.op("and", inside, b.op("eq", pos, b.op("iota", shape=(x.type.numel, bins), axis=1, dtype=dt)))
    return [b.op("reduce_sum", b.op("cast", hit, dtype=dt), axes=[0])]


@def_vjp("index_put", saves=(1,))
def _index_put_vjp(b, p, g):
    idx, axis = p.x[1], p.attrs["axis"]
    gx = g if p.attrs["accumulate"] else b.op("index_put", g, idx, _const(b, 0, g.type.dtype, p.in_types[2].shape),
                                              axis=axis)
    return [gx, None, b.op("gather", g, idx, axis=axis)]


@def_decomposition("grouped_mm")
def _grouped_mm_decompose(b, xs, attrs):
    """Each row times its own group's weight, gathered ([S, K, N]: the memory the op saves)."""
    x, w, offs = xs
    s, e = x.type.shape[0], w.type.shape[0]
    group = _row_groups(b, offs, s, e)
    valid = b.op("lt", group, _const(b, e, DType.i64))
    wr = b.op("gather", w, b.op("minimum", group, _const(b, e - 1, DType.i64)), axis=0)
    y = b.op("matmul", b.op("reshape", x, shape=(s, 1, x.type.shape[1])), wr, transpose_b=attrs["transpose_w"])
    y = b.op("reshape", y, shape=(s, y.type.shape[-1]))
    return [b.op("select", b.op("reshape", valid, shape=(s, 1)), y, _const(b, 0, y.type.dtype))]


@def_decomposition("grouped_mm_weight_grad")
def _grouped_mm_weight_grad_decompose(b, xs, attrs):
    """x spread over its group's block of an [S, E*K] matrix (zeros elsewhere), times g."""
    x, g, offs = xs
    (s, k), e, n = x.type.shape, offs.type.shape[0], g.type.shape[1]
    group = _row_groups(b, offs, s, e)
    onehot = b.op("eq", b.op("reshape", group, shape=(s, 1, 1)), b.op("iota", shape=(1, e, 1), axis=1, dtype=DType.i64))
    spread = b.op("select", onehot, b.op("reshape", x, shape=(s, 1, k)), _const(b, 0, x.type.dtype))
    dw = b.op("reshape", b.op("matmul", b.op("reshape", spread, shape=(s, e * k)), g, transpose_a=True), shape=(e, k, n))
    return [b.op("transpose", dw, perm=(0, 2, 1)) if attrs["transpose_w"] else dw]


def _row_groups(b, offs, s: int, e: int):
    """i64[S]: each row's group, the number of offsets <= the row (E for rows past the last offset)."""
    rows = b.op("iota", shape=(s, 1), axis=0, dtype=DType.i64)
    ends = b.op("reshape", b.op("cast", offs, dtype=DType.i64), shape=(1, e))
    group = b.op("reduce_sum", b.op("cast", b.op("le", ends, rows), dtype=DType.i64), axes=[1])
    return group


@def_vjp("grouped_mm", saves="inputs")
def _grouped_mm_vjp(b, p, g):
    x, w, offs = p.x
    tw = p.attrs["transpose_w"]
    return [b.op("grouped_mm", g, w, offs, transpose_w=not tw),
            b.op("grouped_mm_weight_grad", x, g, offs, transpose_w=tw), None]


@def_vjp("grouped_mm_weight_grad", saves="inputs")
def _grouped_mm_weight_grad_vjp(b, p, c):
    x, g, offs = p.x
    tw = p.attrs["transpose_w"]
    return [b.op("grouped_mm", g, c, offs, transpose_w=not tw), b.op("grouped_mm", x, c, offs, transpose_w=tw), None]
