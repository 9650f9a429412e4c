"""Scaled dot-product attention as one op (RAF §3.2.1: a composite with a native kernel).

``attention(q, k, v[, mask])`` computes ``softmax(q @ kᵀ · scale [masked]) @ v`` over the last
two axes, with leading batch axes shared by q, k and v. It also returns the row-wise logsumexp of
the masked scores, which is all the backward needs besides q, k, v and the output: the backward
op ``attention_grad`` recomputes the probabilities from it (the flash-attention trade: O(T) saved
per row instead of the O(T·S) probability matrix).

Masks follow ``torch.nn.functional.scaled_dot_product_attention``: a bool mask keeps the scores
where it is true, a float mask (same dtype as q) is added to them; either broadcasts to
``[..., T, S]``. ``is_causal`` keeps the lower triangle (top-left aligned, as PyTorch). A row
whose scores are all masked has no defined softmax (NaN, as the explicit formula gives).
``seq_first`` (``attention`` and ``attention_grad``): q, k, v, the output and the gradients are
``[..., T, H, D]``, the sequence axis before the heads axis, as a projection reshaped to heads
gives them; the op computes on their ``[..., H, T, D]`` transposes, read in place (the logsumexp
stays ``[..., H, T]``). ``remat.passes.attention.fold_head_transposes`` sets it where a model
transposes heads in and out of attention, so no transposed copy is made either way.
``chunks`` (``attention`` and ``attention_grad``, default 1): kernels that hold the scores as a
workspace may compute over this many slices of the leading axis, one after the other, with the
same values as over the whole of it (every leading index is computed alone either way); it bounds
the workspace, not the result. ``remat.passes.attention.chunk_attention`` sets it, and the planner
keeps it only where it makes a plan cheaper (``remat.plan.algorithms``).
Grouped-query attention (``attention`` and ``attention_grad``): k and v may have fewer heads (axis
-3) than q, a divisor of them; query head ``h`` reads key/value head ``h // (H / H_kv)``, as
Hugging Face's ``repeat_kv`` lays the repeated heads out (``remat.passes.attention.fold_kv_repeats``
folds that repeat into the op), with a bool mask or none. The gradients of k and v are summed over
their query heads.
``attention`` has no dropout. ``dropout_attention(q, k, v, seed[, mask])`` is the same with inverted
dropout on the probabilities, its keep mask drawn from the seed operand exactly as the explicit form's
``bernoulli(seed, shape=scores, p=1-p)`` draws it (SplitMix64 words are counter-based, so a kernel
draws any block of rows on its own): a recomputation, or the backward, replays the same mask. The
frontend keeps attention with dropout explicit (bit-identical to the unconstrained step); the planner
chooses this op only where the explicit form cannot fit (``remat.passes.attention``,
``remat.plan.algorithms``).
"""
from __future__ import annotations

from math import prod

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import bcast, expect_float, rand

_ATTRS = (Attr("scale", "float"), Attr("is_causal", "bool", False))
_SEQ_ATTRS = _ATTRS + (Attr("seq_first", "bool", False), Attr("chunks", "int", 1))


def swap_heads(t: TensorType) -> TensorType:
    """``t`` with its axes -3 and -2 swapped: ``[..., T, H, D]`` <-> ``[..., H, T, D]``."""
    s = t.shape
    return TensorType(t.dtype, s[:-3] + (s[-2], s[-3], s[-1]))


def _heads_first(name: str, types, attrs):
    """The operand types as the op computes on them: with ``seq_first``, [..., T, H, D] -> [..., H, T, D]."""
    if not attrs.get("seq_first", False):
        return list(types)
    if any(t.rank < 3 for t in types):
        raise TypeError(f"'{name}' with seq_first=true needs operands [..., T, H, D] of rank >= 3, "
                        f"got {', '.join(map(str, types))}")
    return [swap_heads(t) for t in types]


def lse_dtype(dt: DType) -> DType:
    """The logsumexp result's dtype: f32 for f16/bf16 inputs (as PyTorch's kernels), else the input's."""
    return DType.f32 if dt.is_low else dt


def _check_qkv(name: str, q: TensorType, k: TensorType, v: TensorType, mask: TensorType | None,
               attrs, grouped: bool = False) -> None:
    for t, what in ((q, "query"), (k, "key"), (v, "value")):
        expect_float(name, t, what)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"'{name}': query, key and value must have the same dtype, got {q}, {k}, {v}")
    if q.rank < 2 or not (q.rank == k.rank == v.rank):
        raise TypeError(f"'{name}' needs query [..., T, D], key [..., S, D] and value [..., S, Dv] of the same "
                        f"rank >= 2, got {q}, {k}, {v}")
    gqa = (grouped and q.rank >= 3 and q.shape[:-3] == k.shape[:-3] == v.shape[:-3] and k.shape[-3] == v.shape[-3]
           and 0 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0)
    if not gqa and not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        more = (" (or, grouped-query, key and value heads dividing the query's at axis -3)" if grouped else "")
        raise TypeError(f"'{name}': query, key and value must have the same batch axes{more}, got {q}, {k}, {v}")
    if gqa and mask is not None and mask.dtype != DType.bool:
        raise TypeError(f"'{name}': grouped-query attention takes a bool mask or none, got {mask}")
    if k.shape[-1] != q.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise TypeError(f"'{name}': key must be [..., S, {q.shape[-1]}] and value [..., S, Dv] with the same S, "
                        f"got {k} and {v}")
    if mask is not None:
        if attrs["is_causal"]:
            raise TypeError(f"'{name}' takes either a mask or is_causal=true, not both")
        if mask.dtype != DType.bool and mask.dtype != q.dtype:
            raise TypeError(f"'{name}': the mask must be bool (keep where true) or {q.dtype} (added to the scores), "
                            f"got {mask}")
        scores = q.shape[:-1] + (k.shape[-2],)
        if mask.rank > len(scores) or bcast(name, [mask, TensorType(mask.dtype, scores)]) != scores:
            raise TypeError(f"'{name}': mask {mask} does not broadcast to the scores' shape {list(scores)}")


def _check_chunks(name: str, q: TensorType, attrs) -> None:
    """``chunks`` slices a batch axis: the leading one, before [T, D] (or [T, H, D] with ``seq_first``)."""
    n = attrs.get("chunks", 1)
    rank = 4 if attrs.get("seq_first", False) else 3
    if n < 1 or n > 1 and (q.rank < rank or n > q.shape[0]):
        raise TypeError(f"'{name}': chunks must be 1, or at most the leading axis ({q.shape[0] if q.rank >= rank else 1}) "
                        f"of a query of rank >= {rank} (a batch axis before [T, {'H, ' if rank == 4 else ''}D]), "
                        f"got {n} for {q}")


def _attention_infer(types, attrs):
    if len(types) not in (3, 4):
        raise TypeError(f"'attention' takes query, key, value and an optional mask, got {len(types)} operands")
    q, k, v = _heads_first("attention", types[:3], attrs)
    _check_qkv("attention", q, k, v, types[3] if len(types) == 4 else None, attrs, grouped=True)
    _check_chunks("attention", types[0], attrs)
    out = TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))
    return (swap_heads(out) if attrs.get("seq_first", False) else out), TensorType(lse_dtype(q.dtype), q.shape[:-1])


def _attention_grad_infer(types, attrs):
    if len(types) not in (6, 7):
        raise TypeError(f"'attention_grad' takes (grad_out, query, key, value, out, logsumexp[, mask]), "
                        f"got {len(types)} operands")
    g, q, k, v, out = _heads_first("attention_grad", types[:5], attrs)
    lse = types[5]
    _check_qkv("attention_grad", q, k, v, types[6] if len(types) == 7 else None, attrs, grouped=True)
    _check_chunks("attention_grad", types[1], attrs)
    want_out = TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],))
    if g != want_out or out != want_out:
        raise TypeError(f"'attention_grad': grad_out and out must be {want_out}, got {g} and {out}")
    if not lse.dtype.is_float or lse.shape != q.shape[:-1]:  # attention gives lse_dtype(q); any float is read
        raise TypeError(f"'attention_grad': logsumexp must be {TensorType(lse_dtype(q.dtype), q.shape[:-1])}, "
                        f"got {lse}")
    return tuple(types[1:4])


def _scores(types) -> float:
    q, k = types[0], types[1]
    return float(prod(q.shape[:-1]) * k.shape[-2])


def _attention_flops(types, results, attrs) -> float:
    # q @ kᵀ, softmax, p @ v
    return _scores(types) * (2.0 * types[0].shape[-1] + 2.0 * types[2].shape[-1] + 5.0)


def _attention_grad_flops(types, results, attrs) -> float:
    # recompute q @ kᵀ; dv = pᵀ g; dp = g vᵀ; dq = ds k; dk = dsᵀ q; the softmax backward
    q, v = types[1], types[3]
    return _scores(types[1:]) * (6.0 * q.shape[-1] + 4.0 * v.shape[-1] + 8.0)


# ---------------------------------------------------------------- NumPy reference (explicit softmax)
# Used by the numpy dialect's kernels and by the samples; arrays in f32 or f64.
def reference_scores(q: np.ndarray, k: np.ndarray, mask: np.ndarray | None, scale: float,
                     is_causal: bool) -> np.ndarray:
    """The masked, scaled scores q @ kᵀ · scale (-inf where masked out)."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.asarray(scale, q.dtype)
    if is_causal:
        t, n = s.shape[-2:]
        s = np.where(np.tril(np.ones((t, n), dtype=bool)), s, np.asarray(-np.inf, s.dtype))
    if mask is not None:
        s = np.where(mask, s, np.asarray(-np.inf, s.dtype)) if mask.dtype == np.bool_ else s + mask.astype(s.dtype)
    return s


def _repeat_kv(x, q):
    """Grouped-query key/value heads repeated to the query's (head h reads head h // groups)."""
    if x.ndim >= 3 and x.shape[-3] != q.shape[-3]:
        return np.repeat(x, q.shape[-3] // x.shape[-3], axis=-3)
    return x


def _sum_groups(g, like):
    """A gradient over the repeated heads summed back to ``like``'s heads (grouped-query attention)."""
    if g.shape == like.shape:
        return g
    n = g.shape[-3] // like.shape[-3]
    return g.reshape(g.shape[:-3] + (like.shape[-3], n) + g.shape[-2:]).sum(axis=-3)


def reference_forward(q, k, v, mask=None, *, scale: float, is_causal: bool = False):
    """(softmax(scores) @ v, logsumexp of the scores' rows)."""
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    prob, lse = _reference_softmax(reference_scores(q, k, mask, scale, is_causal))
    return np.matmul(prob, v), lse


def _reference_softmax(s):
    """The scores' row softmax (stabilised; a fully masked row gives NaN) and the rows' logsumexp."""
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, np.zeros((), m.dtype))
    e = np.exp(s - m)
    tot = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return e / tot, (m + np.log(tot))[..., 0]


def reference_backward(g, q, k, v, out, lse, mask=None, *, scale: float, is_causal: bool = False):
    """(dq, dk, dv) from the probabilities recomputed as exp(scores - logsumexp)."""
    k0, v0 = k, v
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    s = reference_scores(q, k, mask, scale, is_causal)
    p = np.exp(s - lse[..., None].astype(s.dtype))
    dv = np.matmul(np.swapaxes(p, -1, -2), g)
    dp = np.matmul(g, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(g * out, axis=-1, keepdims=True))
    sc = np.asarray(scale, q.dtype)
    return np.matmul(ds, k) * sc, _sum_groups(np.matmul(np.swapaxes(ds, -1, -2), q) * sc, k0), _sum_groups(dv, v0)


def _keep_mask(r: np.random.Generator, *shape: int) -> np.ndarray:
    """A random bool mask that keeps at least one entry per row (so every softmax is defined)."""
    m = r.random(shape) > 0.4
    m[..., 0] = True
    return m


def _attention_samples(r: np.random.Generator) -> list[Sample]:
    return [
        Sample([rand(r, 2, 3, 4), rand(r, 2, 5, 4), rand(r, 2, 5, 3)], {"scale": 0.5}),
        Sample([rand(r, 2, 2, 4, 4), rand(r, 2, 2, 6, 4), rand(r, 2, 2, 6, 4), _keep_mask(r, 4, 6)], {"scale": 0.5}),
        Sample([rand(r, 1, 2, 5, 4), rand(r, 1, 2, 5, 4), rand(r, 1, 2, 5, 4)], {"scale": 0.3, "is_causal": True}),
        Sample([rand(r, 2, 2, 4, 4), rand(r, 2, 2, 6, 4), rand(r, 2, 2, 6, 4), rand(r, 2, 1, 4, 6)], {"scale": 0.7}),
    ] + _seq_first_samples(r)


def _seq_first_samples(r: np.random.Generator) -> list[Sample]:
    """[B, T, H, D] operands (``seq_first``): a bool mask over [B, 1, T, S], causal, rank 3."""
    return [
        Sample([rand(r, 2, 4, 3, 4), rand(r, 2, 6, 3, 4), rand(r, 2, 6, 3, 4), _keep_mask(r, 2, 1, 4, 6)],
               {"scale": 0.5, "seq_first": True}),
        Sample([rand(r, 1, 5, 2, 4), rand(r, 1, 5, 2, 4), rand(r, 1, 5, 2, 3)], {"scale": 0.3, "is_causal": True,
                                                                               "seq_first": True}),
        Sample([rand(r, 4, 2, 4), rand(r, 5, 2, 4), rand(r, 5, 2, 4)], {"scale": 0.6, "seq_first": True}),
        # grouped-query: 4 query heads over 2 key/value heads; a bool mask, causal
        Sample([rand(r, 2, 4, 3, 4), rand(r, 2, 2, 5, 4), rand(r, 2, 2, 5, 4), _keep_mask(r, 2, 1, 3, 5)], {"scale": 0.5}),
        Sample([rand(r, 1, 6, 4, 4), rand(r, 1, 2, 4, 4), rand(r, 1, 2, 4, 3)], {"scale": 0.4, "is_causal": True}),
        # an additive float mask (a learned position bias, Swin's or T5's) over [H, T, S], seq_first
        Sample([rand(r, 2, 4, 3, 4), rand(r, 2, 6, 3, 4), rand(r, 2, 6, 3, 4), rand(r, 1, 3, 4, 6)],
               {"scale": 0.5, "seq_first": True}),
        # over slices of the batch (3 rows in 2), a mask sliced with it
        Sample([rand(r, 3, 4, 2, 4), rand(r, 3, 5, 2, 4), rand(r, 3, 5, 2, 4), _keep_mask(r, 3, 1, 4, 5)],
               {"scale": 0.5, "seq_first": True, "chunks": 2}),
    ]


def seq_first_args(arrays, attrs):
    """NumPy operands in the layout the reference computes on: [..., H, T, D] (swapped when ``seq_first``)."""
    return [np.swapaxes(a, -3, -2) for a in arrays] if attrs.get("seq_first", False) else list(arrays)


def _attention_grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    samples = _attention_samples(r)
    for s in samples[:3] + samples[4:]:
        attrs = {"is_causal": False, **s.attrs}
        seq_first = attrs.pop("seq_first", False)
        attrs.pop("chunks", None)  # the same values over the whole batch
        o, lse = reference_forward(*seq_first_args(s.args[:3], s.attrs), *s.args[3:], **attrs)
        if seq_first:
            o = np.swapaxes(o, -3, -2)
        g = rand(r, *o.shape)
        args = [g, *s.args[:3], o, lse] + s.args[3:]
        out.append(Sample(args, s.attrs))
    return out


declare(OpDef("attention", None, _SEQ_ATTRS, _attention_infer, frozenset({"dense", "autocast_low"}), num_results=2, min_operands=3,
              doc="softmax(q @ kᵀ · scale, masked) @ v and the scores' row logsumexp; mask: bool (keep) or additive",
              sample=_attention_samples, flops=_attention_flops))
declare(OpDef("attention_grad", None, _SEQ_ATTRS, _attention_grad_infer, frozenset({"dense"}), num_results=3, min_operands=6,
              doc="gradients of attention wrt q, k, v from (grad_out, q, k, v, out, logsumexp[, mask])",
              sample=_attention_grad_samples, flops=_attention_grad_flops))


# ---------------------------------------------------------------- attention with dropout on the probabilities
_DROP_ATTRS = _ATTRS + (Attr("p", "float"),)
SEED = TensorType(DType.i64, ())


def scores_shape(q: TensorType, k: TensorType) -> tuple[int, ...]:
    """The scores' (and the dropout keep mask's) shape ``[..., T, S]``."""
    return q.shape[:-1] + (k.shape[-2],)


def _check_drop(name: str, seed: TensorType, attrs) -> None:
    if seed != SEED:
        raise TypeError(f"'{name}' takes its dropout seed as an i64[] operand after the value, got {seed}")
    if not 0.0 <= attrs["p"] < 1.0:
        raise TypeError(f"'{name}': p (the drop probability) must be in [0, 1), got {attrs['p']}")


def _dropout_attention_infer(types, attrs):
    if len(types) not in (4, 5):
        raise TypeError(f"'dropout_attention' takes query, key, value, seed and an optional mask, "
                        f"got {len(types)} operands")
    q, k, v, seed = types[:4]
    _check_qkv("dropout_attention", q, k, v, types[4] if len(types) == 5 else None, attrs)
    _check_drop("dropout_attention", seed, attrs)
    return TensorType(q.dtype, q.shape[:-1] + (v.shape[-1],)), TensorType(lse_dtype(q.dtype), q.shape[:-1])


def _dropout_attention_grad_infer(types, attrs):
    if len(types) not in (7, 8):
        raise TypeError(f"'dropout_attention_grad' takes (grad_out, query, key, value, out, logsumexp, seed[, mask]), "
                        f"got {len(types)} operands")
    _check_drop("dropout_attention_grad", types[6], attrs)
    return _attention_grad_infer(types[:6] + types[7:], attrs)


def workspace_bytes(t: int, s: int, itemsize: int) -> int:
    """A bound on the torch kernels' temporaries beyond their results (bytes): they work on one
    ``[T, S]`` score matrix of one batch element at a time (scores, probabilities, their gradient
    and a product, in f32 or wider, and the bool keep mask), never on the whole ``[..., T, S]``."""
    return t * s * (5 * max(itemsize, 4) + 1)


def reference_dropout_forward(q, k, v, keep, mask=None, *, scale: float, is_causal: bool = False, p: float):
    """(dropout(softmax(scores)) @ v, logsumexp of the scores' rows): ``keep`` is the bool keep mask
    of the scores' shape; kept probabilities are scaled by 1/(1-p), as the explicit form does."""
    prob, lse = _reference_softmax(reference_scores(q, k, mask, scale, is_causal))
    pd = np.where(keep, prob * np.asarray(1.0 / (1.0 - p), q.dtype), np.zeros((), q.dtype))
    return np.matmul(pd, v), lse


def reference_dropout_backward(g, q, k, v, out, lse, keep, mask=None, *, scale: float, is_causal: bool = False,
                               p: float):
    """(dq, dk, dv) of :func:`reference_dropout_forward`, the probabilities recomputed from the logsumexp."""
    s = reference_scores(q, k, mask, scale, is_causal)
    prob = np.exp(s - lse[..., None].astype(s.dtype))
    c, zero = np.asarray(1.0 / (1.0 - p), q.dtype), np.zeros((), q.dtype)
    dv = np.matmul(np.swapaxes(np.where(keep, prob * c, zero), -1, -2), g)
    dp = np.where(keep, np.matmul(g, np.swapaxes(v, -1, -2)) * c, zero)
    ds = prob * (dp - np.sum(g * out, axis=-1, keepdims=True))
    sc = np.asarray(scale, q.dtype)
    return np.matmul(ds, k) * sc, np.matmul(np.swapaxes(ds, -1, -2), q) * sc, dv


def _seed(r: np.random.Generator) -> np.ndarray:
    return np.array(r.integers(0, 2**31), dtype=np.int64)


def _dropout_attention_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s, p in zip(_attention_samples(r), (0.3, 0.5, 0.2, 0.4)):
        out.append(Sample(s.args[:3] + [_seed(r)] + s.args[3:], {**s.attrs, "p": p}))
    # an odd number of scores per row and per batch element (keep-mask words straddle rows)
    out.append(Sample([rand(r, 3, 3, 4), rand(r, 3, 5, 4), rand(r, 3, 5, 2), _seed(r)], {"scale": 0.6, "p": 0.25}))
    return out


def _dropout_attention_grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _dropout_attention_samples(r)[:3] + _dropout_attention_samples(r)[4:]:
        q, k, v, seed = s.args[:4]
        attrs = {"is_causal": False, **s.attrs}
        o, lse = reference_forward(q, k, v, *s.args[4:], scale=attrs["scale"], is_causal=attrs["is_causal"])
        out.append(Sample([rand(r, *o.shape), q, k, v, rand(r, *o.shape), lse, seed] + s.args[4:], s.attrs))
    return out


declare(OpDef("dropout_attention", None, _DROP_ATTRS, _dropout_attention_infer, frozenset({"dense", "autocast_low"}), num_results=2,
              min_operands=4,
              doc="attention with inverted dropout (drop probability p, keep mask from the seed) on the probabilities",
              sample=_dropout_attention_samples, flops=lambda t, r, a: _attention_flops(t, r, a) + _scores(t)))
declare(OpDef("dropout_attention_grad", None, _DROP_ATTRS, _dropout_attention_grad_infer, frozenset({"dense"}),
              num_results=3, min_operands=7,
              doc="gradients of dropout_attention wrt q, k, v from (grad_out, q, k, v, out, logsumexp, seed[, mask])",
              sample=_dropout_attention_grad_samples,
              flops=lambda t, r, a: _attention_grad_flops(t, r, a) + 2.0 * _scores(t[1:])))


# ================================================================ VJP rules (reverse mode)
from ..opdef import def_vjp  # noqa: E402
from ._vjp import Saves, cast_to as _wide, const as _const, unbroadcast as _unb  # noqa: E402


def _swap_heads(b, v):
    r = v.type.rank
    return b.op("transpose", v, perm=list(range(r - 3)) + [r - 2, r - 3, r - 1])


def _mask_cotangent(b, p, g, q, k, v, out, lse, mask, seq_first=False):
    """The cotangent of an additive float mask: dS = P ⊙ (g vᵀ − rowsum(g ⊙ out)), summed back to
    the mask's shape. Emitted from primitives; dead (and removed by DCE) unless the mask needs it.
    The products read kᵀ and vᵀ as transposed operands (no copy); with ``seq_first`` the scores'
    operands are swapped to [..., H, T, D] (copies) and the row sums computed on [..., T, H, D], then
    swapped (a [..., T, H, 1] copy), so ``out`` is never copied. In f16/bf16 the products run in
    that dtype and the rest in f32 (the logsumexp is f32 already), the sum over the mask's broadcast
    axes too, then the cotangent is rounded to the mask's dtype once: in bf16 throughout, a relative
    position bias's gradient was 1.7x as far from the f32 one as eager autocast's."""
    dt = q.type.dtype
    wt = lse.type.dtype  # the compute dtype: f32 for f16/bf16 (ops.attention.lse_dtype), else dt
    if seq_first:
        g0, out0 = g, out
        q, k, v, g = (_swap_heads(b, x) for x in (q, k, v, g))
    s = b.op("mul", _wide(b, b.op("matmul", q, k, transpose_b=True), wt), _const(b, p.attrs["scale"], wt))
    s = b.op("add", s, _wide(b, mask, wt))
    lse_k = b.op("reshape", lse, shape=lse.type.shape + (1,))
    prob = b.op("exp", b.op("sub", s, lse_k))
    dp = _wide(b, b.op("matmul", g, v, transpose_b=True), wt)
    if seq_first:
        rows = _swap_heads(b, b.op("reduce_sum", b.op("mul", _wide(b, g0, wt), _wide(b, out0, wt)),
                                   axes=[g0.type.rank - 1], keepdims=True))
    else:
        rows = b.op("reduce_sum", b.op("mul", _wide(b, g, wt), _wide(b, out, wt)), axes=[g.type.rank - 1],
                    keepdims=True)
    ds = b.op("mul", prob, b.op("sub", dp, rows))
    return _wide(b, _unb(b, ds, mask.type.shape), mask.type.dtype)


@def_vjp("attention", saves=Saves(operands=(0, 1, 2, 3), results=(0, 1)))
def _attention_vjp(b, p, g):
    g_out, g_lse = g
    if g_lse is not None:
        raise NotImplementedError("the logsumexp result of 'attention' is not differentiable; "
                                  "use only its first result (the attention output)")
    q, k, v = p.x[:3]
    mask = p.x[3] if len(p.x) == 4 else None
    out, lse = p.y
    seq_first = p.attrs.get("seq_first", False)
    attrs = {"scale": p.attrs["scale"], "is_causal": p.attrs["is_causal"], "seq_first": seq_first,
             "chunks": p.attrs.get("chunks", 1)}
    extra = [mask] if mask is not None else []
    gq, gk, gv = b.op("attention_grad", g_out, q, k, v, out, lse, *extra, **attrs)
    cts = [gq, gk, gv]
    if mask is not None:
        if mask.type.dtype.is_float:
            cts.append(_mask_cotangent(b, p, g_out, q, k, v, out, lse, mask, seq_first))
        else:
            cts.append(None)
    return cts


@def_vjp("attention_grad", saves="none")
def _attention_grad_vjp(b, p, g):
    raise NotImplementedError("second-order differentiation through attention is not supported "
                              "(attention_grad has no VJP rule)")


def _dropout_keep(b, seed, q, k, p: float):
    """The dropout keep mask as the explicit form draws it: ``bernoulli(seed, scores' shape, 1 - p)``."""
    return b.op("bernoulli", seed, shape=scores_shape(q.type, k.type), p=1.0 - p)


def _dropout_mask_cotangent(b, p, g, q, k, v, out, lse, seed, mask):
    """The cotangent of an additive float mask under dropout: dS = P ⊙ (dropout(g vᵀ) − rowsum(g ⊙ out)),
    in f32 for f16/bf16 operands as :func:`_mask_cotangent`."""
    wt = lse.type.dtype
    s = b.op("add", b.op("mul", _wide(b, b.op("matmul", q, k, transpose_b=True), wt), _const(b, p.attrs["scale"], wt)),
             _wide(b, mask, wt))
    prob = b.op("exp", b.op("sub", s, b.op("reshape", lse, shape=lse.type.shape + (1,))))
    keep = _dropout_keep(b, seed, q, k, p.attrs["p"])
    dp = b.op("select", keep, b.op("mul", _wide(b, b.op("matmul", g, v, transpose_b=True), wt),
                                   _const(b, 1.0 / (1.0 - p.attrs["p"]), wt)), _const(b, 0.0, wt))
    rows = b.op("reduce_sum", b.op("mul", _wide(b, g, wt), _wide(b, out, wt)), axes=[g.type.rank - 1], keepdims=True)
    return _wide(b, _unb(b, b.op("mul", prob, b.op("sub", dp, rows)), mask.type.shape), mask.type.dtype)


@def_vjp("dropout_attention", saves=Saves(operands=(0, 1, 2, 3, 4), results=(0, 1)))
def _dropout_attention_vjp(b, p, g):
    g_out, g_lse = g
    if g_lse is not None:
        raise NotImplementedError("the logsumexp result of 'dropout_attention' is not differentiable; "
                                  "use only its first result (the attention output)")
    q, k, v, seed = p.x[:4]
    mask = p.x[4] if len(p.x) == 5 else None
    out, lse = p.y
    attrs = {a: p.attrs[a] for a in ("scale", "is_causal", "p")}
    gq, gk, gv = b.op("dropout_attention_grad", g_out, q, k, v, out, lse, seed, *([mask] if mask is not None else []),
                      **attrs)
    cts = [gq, gk, gv, None]
    if mask is not None:
        cts.append(_dropout_mask_cotangent(b, p, g_out, q, k, v, out, lse, seed, mask)
                   if mask.type.dtype.is_float else None)
    return cts


@def_vjp("dropout_attention_grad", saves="none")
def _dropout_attention_grad_vjp(b, p, g):
    raise NotImplementedError("second-order differentiation through attention is not supported "
                              "(dropout_attention_grad has no VJP rule)")


# ================================================================ decompositions (composites in primitives)
# rule(b, xs, attrs) -> one value per result; see remat.ir.opdef.def_decomposition.
from ..opdef import def_decomposition  # noqa: E402


def _masked_scores(b, q, k, mask, attrs):
    """q @ kᵀ · scale, -inf where masked out (bool mask, causal) or plus an additive mask (as ``reference_scores``)."""
    dt = q.type.dtype
    s = b.op("mul", b.op("matmul", q, k, transpose_b=True), _const(b, attrs["scale"], dt))
    if attrs["is_causal"]:
        t, n = s.type.shape[-2:]
        keep = b.op("ge", b.op("iota", shape=(t, n), axis=0), b.op("iota", shape=(t, n), axis=1))
        s = b.op("select", keep, s, _const(b, float("-inf"), dt))
    if mask is not None:
        s = (b.op("select", mask, s, _const(b, float("-inf"), dt)) if mask.type.dtype == DType.bool
             else b.op("add", s, mask))
    return s


def _softmax_parts(b, s):
    """The scores' stabilised exponentials, their row sums and the rows' logsumexp (in the dtype
    :func:`lse_dtype` gives), as the forward kernels compute them."""
    last = s.type.rank - 1
    m = b.op("reduce_max", s, axes=[last], keepdims=True)
    zero = _const(b, 0.0, m.type.dtype)
    m = b.op("select", b.op("eq", m, _const(b, float("-inf"), m.type.dtype)), zero, m)  # a fully masked row
    e = b.op("exp", b.op("sub", s, m))
    tot = b.op("reduce_sum", e, axes=[last], keepdims=True)
    lse = b.op("reshape", b.op("add", m, b.op("log", tot)), shape=s.type.shape[:-1])
    want = lse_dtype(s.type.dtype)
    return e, tot, lse if want == lse.type.dtype else b.op("cast", lse, dtype=want)


def repeat_kv(b, x, q):
    """Grouped-query key/value heads repeated to the query's, as HF's ``repeat_kv`` (unsqueeze, expand,
    reshape); ``b``: anything with ``op(name, *operands, **attrs)`` (a Builder, the importer's Lowerer)."""
    sh = x.type.shape
    if x.type.rank < 3 or sh[-3] == q.type.shape[-3]:
        return x
    n = q.type.shape[-3] // sh[-3]
    x5 = b.op("reshape", x, shape=sh[:-3] + (sh[-3], 1) + sh[-2:])
    x5 = b.op("broadcast", x5, shape=sh[:-3] + (sh[-3], n) + sh[-2:])
    return b.op("reshape", x5, shape=sh[:-3] + (sh[-3] * n,) + sh[-2:])


def _sum_groups_ir(b, g, like):
    """A gradient over repeated heads summed back to ``like``'s (grouped-query attention)."""
    if g.type.shape == like.type.shape:
        return g
    sh = like.type.shape
    n = g.type.shape[-3] // sh[-3]
    g5 = b.op("reshape", g, shape=sh[:-3] + (sh[-3], n) + g.type.shape[-2:])
    return b.op("reduce_sum", g5, axes=[len(sh) - 2])


@def_decomposition("attention")
def _attention_decomp(b, xs, attrs):
    seq_first = attrs.get("seq_first", False)
    q, k, v = [_swap_heads(b, x) for x in xs[:3]] if seq_first else xs[:3]
    k, v = repeat_kv(b, k, q), repeat_kv(b, v, q)
    s = _masked_scores(b, q, k, xs[3] if len(xs) == 4 else None, attrs)
    e, tot, lse = _softmax_parts(b, s)
    out = b.op("matmul", b.op("div", e, tot), v)
    return [_swap_heads(b, out) if seq_first else out, lse]


@def_decomposition("attention_grad")
def _attention_grad_decomp(b, xs, attrs):
    seq_first = attrs.get("seq_first", False)
    g, q, k0, v0, out = [_swap_heads(b, x) for x in xs[:5]] if seq_first else xs[:5]
    k, v = repeat_kv(b, k0, q), repeat_kv(b, v0, q)
    lse = xs[5]
    dt = q.type.dtype
    s = _masked_scores(b, q, k, xs[6] if len(xs) == 7 else None, attrs)
    lse = b.op("cast", lse, dtype=dt) if lse.type.dtype != dt else lse
    p = b.op("exp", b.op("sub", s, b.op("reshape", lse, shape=lse.type.shape + (1,))))
    dv = b.op("matmul", p, g, transpose_a=True)
    rows = b.op("reduce_sum", b.op("mul", g, out), axes=[g.type.rank - 1], keepdims=True)
    ds = b.op("mul", p, b.op("sub", b.op("matmul", g, v, transpose_b=True), rows))
    scale = _const(b, attrs["scale"], dt)
    grads = [b.op("mul", b.op("matmul", ds, k), scale),
             _sum_groups_ir(b, b.op("mul", b.op("matmul", ds, q, transpose_a=True), scale), k0), _sum_groups_ir(b, dv, v0)]
    return [_swap_heads(b, x) for x in grads] if seq_first else grads


@def_decomposition("dropout_attention")
def _dropout_attention_decomp(b, xs, attrs):
    q, k, v, seed = xs[:4]
    s = _masked_scores(b, q, k, xs[4] if len(xs) == 5 else None, attrs)
    e, tot, lse = _softmax_parts(b, s)
    dt = q.type.dtype
    pd = b.op("select", _dropout_keep(b, seed, q, k, attrs["p"]),
              b.op("mul", b.op("div", e, tot), _const(b, 1.0 / (1.0 - attrs["p"]), dt)), _const(b, 0.0, dt))
    return [b.op("matmul", pd, v), lse]


@def_decomposition("dropout_attention_grad")
def _dropout_attention_grad_decomp(b, xs, attrs):
    g, q, k, v, out, lse, seed = xs[:7]
    dt = q.type.dtype
    s = _masked_scores(b, q, k, xs[7] if len(xs) == 8 else None, attrs)
    lse = b.op("cast", lse, dtype=dt) if lse.type.dtype != dt else lse
    prob = b.op("exp", b.op("sub", s, b.op("reshape", lse, shape=lse.type.shape + (1,))))
    keep = _dropout_keep(b, seed, q, k, attrs["p"])
    c, zero = _const(b, 1.0 / (1.0 - attrs["p"]), dt), _const(b, 0.0, dt)
    dv = b.op("matmul", b.op("select", keep, b.op("mul", prob, c), zero), g, transpose_a=True)
    rows = b.op("reduce_sum", b.op("mul", g, out), axes=[g.type.rank - 1], keepdims=True)
    dp = b.op("select", keep, b.op("mul", b.op("matmul", g, v, transpose_b=True), c), zero)
    ds = b.op("mul", prob, b.op("sub", dp, rows))
    scale = _const(b, attrs["scale"], dt)
    return [b.op("mul", b.op("matmul", ds, k), scale), b.op("mul", b.op("matmul", ds, q, transpose_a=True), scale), dv]
