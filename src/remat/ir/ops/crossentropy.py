"""Cross-entropy as single ops: ``cross_entropy`` on logits (``log_softmax -> nll_loss`` as one op whose
backward writes its gradient over the logits), and, fused with the language-model head's matmul in
chunks of rows, ``linear_cross_entropy``: a memory-lean alternative to ``matmul -> log_softmax ->
nll_loss`` (issue 10: per-operator algorithm choice).

``linear_cross_entropy(x [N, d], w [V, d], target [N])`` is ``nll_loss(log_softmax(x @ wᵀ), target)``
computed ``chunk`` rows at a time: it returns the loss and the rows' logsumexp ``[N]``, and never
holds the ``[N, V]`` logits as an IR value. Its backward ``linear_cross_entropy_grad`` recomputes each
chunk's logits from x, w and the logsumexp, and gives ``dx [N, d]`` and ``dw [V, d]`` (accumulated
chunk by chunk), so neither the logits, their log-softmax nor their gradient is ever whole.

Memory, as the VM counts it: the results only (loss, ``[N]`` logsumexp; ``dx`` and ``dw``). The
kernels' own temporaries are one chunk's logits and their gradient, ``chunk × V`` elements each
(:func:`workspace_bytes`), against the ``N × V`` logits that ``cross_entropy`` holds (``3 × N × V`` at
once for ``log_softmax -> nll_loss``).
Time: the backward recomputes the head's matmul (one more ``2·N·d·V`` flops than the reference).
With bf16 or f16 operands each chunk's logits are the head's product in that dtype, as the
reference's matmul computes them, and the loss is computed from them in f32 (an f32 loss with
``upcast``, the fold of an autocast loss); ``dw`` is summed in f32 from each chunk's low-precision
product. Values equal the reference's up to summation order (``dw`` sums chunk by chunk), so the planner
uses it only as a choice it reports (``remat.plan.algorithms``).
"""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, IndexBounds, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import expect_float, rand

_REDUCTIONS = ("mean", "sum", "none")
DEFAULT_CHUNK = 1024
"""Rows per chunk unless the rewrite chooses: 1024 rows of a 50k vocabulary is 200 MB of f32 logits."""

_UPCAST = Attr("upcast", "bool", False)
_ATTRS = (Attr("reduction", "str", "mean"), Attr("ignore_index", "int", -100), Attr("chunk", "int", DEFAULT_CHUNK),
          _UPCAST)


def workspace_bytes(n: int, v: int, itemsize: int, chunk: int, d: int = 0) -> int:
    """A bound on the kernels' temporaries beyond their results (bytes): two chunks of logits (the
    logits and their exponentials, or their gradient), a few row vectors ([N] weights, indices), and
    for low-precision operands (``itemsize`` 2) an f32 chunk and the f32 sum of ``dw`` ([V, d]) with
    one chunk's low-precision share of it."""
    lowp = 3 * min(chunk, n) * v * 4 + 6 * v * d if itemsize < 4 else 0
    return 2 * min(chunk, n) * v * itemsize + 8 * n * max(itemsize, 8) + lowp


def _check_rows(name: str, n: int, target: TensorType, attrs) -> None:
    if not target.dtype.is_int or target.shape != (n,):
        raise TypeError(f"'{name}' needs integer class targets [{n}] (i32 or i64), got {target}")
    if attrs["reduction"] not in _REDUCTIONS:
        raise TypeError(f"'{name}': reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, "
                        f"got {attrs['reduction']!r}")


def _check(name: str, x: TensorType, w: TensorType, target: TensorType, attrs) -> None:
    expect_float(name, x, "input")
    if x.rank != 2 or w.rank != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype:
        raise TypeError(f"'{name}' needs input [N, d] and weight [V, d] of the same dtype, got {x} and {w}")
    _check_rows(name, x.shape[0], target, attrs)
    if attrs["chunk"] < 1:
        raise TypeError(f"'{name}': chunk (rows per chunk) must be >= 1, got {attrs['chunk']}")


def _loss_type(name: str, z: TensorType, attrs) -> TensorType:
    """The dtype of the loss and the logsumexp: the logits', or f32 with ``upcast`` (bf16 or f16 logits)."""
    if not attrs["upcast"]:
        return z
    if not z.dtype.is_low:
        raise TypeError(f"'{name}': upcast computes bf16 or f16 logits in f32, got {z}; without upcast "
                        "the loss is computed in the logits' dtype")
    return z.with_dtype(DType.f32)


def _infer(types, attrs):
    x, w, target = types
    _check("linear_cross_entropy", x, w, target, attrs)
    t = _loss_type("linear_cross_entropy", x, attrs)
    return t.with_shape((x.shape[0],) if attrs["reduction"] == "none" else ()), t.with_shape((x.shape[0],))


def _grad_infer(types, attrs):
    g, x, w, target, lse = types
    _check("linear_cross_entropy_grad", x, w, target, attrs)
    t = _loss_type("linear_cross_entropy_grad", x, attrs)
    want = (x.shape[0],) if attrs["reduction"] == "none" else ()
    if g != t.with_shape(want):
        raise TypeError(f"'linear_cross_entropy_grad': output gradient must be {t.with_shape(want)} for reduction "
                        f"{attrs['reduction']!r}, got {g}")
    if lse != t.with_shape((x.shape[0],)):
        raise TypeError(f"'linear_cross_entropy_grad': logsumexp must be {t.with_shape((x.shape[0],))}, got {lse}")
    return x, w


def _flops(types, results, attrs) -> float:
    x, w = types[0], types[1]
    n, d, v = x.shape[0], x.shape[1], w.shape[0]
    return 2.0 * n * d * v + 4.0 * n * v  # the head's matmul, then logsumexp and the pick


def _grad_flops(types, results, attrs) -> float:
    x, w = types[1], types[2]
    n, d, v = x.shape[0], x.shape[1], w.shape[0]
    return 6.0 * n * d * v + 5.0 * n * v  # recomputed logits, dx, dw; the softmax's gradient


def _bounds(types, attrs) -> IndexBounds:
    return IndexBounds(2, types[1].shape[0], attrs["ignore_index"])


def _bounds_grad(types, attrs) -> IndexBounds:
    return IndexBounds(3, types[2].shape[0], attrs["ignore_index"])


# ---------------------------------------------------------------- NumPy reference (chunked)
def row_scale(g: np.ndarray, keep: np.ndarray, reduction: str) -> np.ndarray:
    """Each row's weight in the loss's gradient: g (per row for "none"), divided by the count of
    kept rows for "mean", 0 on ignored rows."""
    gs = g if reduction == "none" else np.broadcast_to(g, keep.shape)
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            gs = gs / gs.dtype.type(np.count_nonzero(keep))
    return np.where(keep, gs, gs.dtype.type(0))


def reference_forward(x, w, target, *, reduction: str = "mean", ignore_index: int = -100, chunk: int = DEFAULT_CHUNK):
    """(loss, logsumexp [N]) in x's dtype, chunk by chunk."""
    n = x.shape[0]
    keep = target != ignore_index
    t = np.where(keep, target, 0)
    lse = np.empty(n, dtype=x.dtype)
    rows = np.empty(n, dtype=x.dtype)
    for a in range(0, n, chunk):
        z = x[a:a + chunk] @ w.T
        s = _row_logsumexp(z)
        lse[a:a + chunk] = s
        rows[a:a + chunk] = np.where(keep[a:a + chunk], s - z[np.arange(z.shape[0]), t[a:a + chunk]], 0)
    return _reduce_rows(rows, keep, reduction), lse


def _row_logsumexp(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=1, keepdims=True)
    return (m + np.log(np.sum(np.exp(z - m), axis=1, keepdims=True)))[:, 0]


def _reduce_rows(rows: np.ndarray, keep: np.ndarray, reduction: str) -> np.ndarray:
    """The loss from its per-row terms: as they are ("none"), their sum, or their mean over kept rows."""
    if reduction == "none":
        return rows
    total = np.sum(rows)
    if reduction == "mean":
        with np.errstate(invalid="ignore", divide="ignore"):
            total = total / rows.dtype.type(np.count_nonzero(keep))
    return np.asarray(total, dtype=rows.dtype)


def reference_backward(g, x, w, target, lse, *, reduction: str = "mean", ignore_index: int = -100,
                       chunk: int = DEFAULT_CHUNK):
    """(dx, dw): each chunk's softmax recomputed from the logsumexp, minus the one-hot target."""
    keep = target != ignore_index
    t = np.where(keep, target, 0)
    scale = row_scale(g, keep, reduction)
    dx = np.empty_like(x)
    dw = np.zeros_like(w)
    for a in range(0, x.shape[0], chunk):
        xc = x[a:a + chunk]
        p = np.exp(xc @ w.T - lse[a:a + chunk, None])
        p[np.arange(p.shape[0]), t[a:a + chunk]] -= 1
        p *= scale[a:a + chunk, None]
        dx[a:a + chunk] = p @ w
        dw += p.T @ xc
    return dx, dw


def _targets(r, n, v, ignore):
    t = r.integers(0, v, size=(n,))
    t[1] = ignore
    return t


def _samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 7, 4), rand(r, 9, 4), _targets(r, 7, 9, -100)], {"chunk": 3}),
            Sample([rand(r, 5, 3), rand(r, 6, 3), _targets(r, 5, 6, 2)],
                   {"reduction": "sum", "ignore_index": 2, "chunk": 2}),
            Sample([rand(r, 4, 3), rand(r, 5, 3), _targets(r, 4, 5, -1)],
                   {"reduction": "none", "ignore_index": -1, "chunk": 4})]


def _grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _samples(r):
        _, lse = reference_forward(*s.args, **s.attrs)
        g = rand(r, *((s.args[0].shape[0],) if s.attrs.get("reduction") == "none" else ()))
        out.append(Sample([g, *s.args, lse], s.attrs))
    return out


declare(OpDef("linear_cross_entropy", 3, _ATTRS, _infer, frozenset({"dense"}), num_results=2, index_bounds=_bounds,
              flops=_flops, sample=_samples,
              doc="nll_loss(log_softmax(x @ wᵀ), target) and the rows' logsumexp, `chunk` rows at a time "
                  "(never the whole [N, V] logits); with upcast, the bf16 or f16 logits' loss in f32"))
declare(OpDef("linear_cross_entropy_grad", 5, _ATTRS, _grad_infer, frozenset({"dense"}), num_results=2,
              index_bounds=_bounds_grad, flops=_grad_flops, sample=_grad_samples,
              doc="(dx, dw) of linear_cross_entropy from (grad_output, x, w, target, logsumexp), each chunk's "
                  "logits recomputed"))


# ================================================================ cross-entropy on logits (log_softmax -> nll_loss as one op)
# ``cross_entropy(z [N, C], target [N])`` is ``nll_loss(log_softmax(z, axis=1), target)``, and also gives
# the rows' logsumexp. Its backward ``cross_entropy_grad(g, z, lse, target)`` is softmax(z) minus the
# one-hot target, times each row's weight in the loss: one [N, C] result, which may be written over the
# logits it reads (tag "overwrite"), against the reference's log-probabilities, one-hot gradient and
# log-softmax gradient (three [N, C] tensors at once). The import pipeline makes it from the pair
# (``remat.passes.crossentropy.fuse_log_softmax_nll``). With ``upcast``, bf16 or f16 logits are read
# as they are and computed in f32 a chunk of rows at a time: the loss and logsumexp are f32, and the
# gradient is the f32 gradient rounded to the logits' dtype (``fold_upcast`` makes it from a cast).
def _ce_check(name: str, z: TensorType, target: TensorType, attrs) -> None:
    expect_float(name, z, "logits")
    if z.rank != 2:
        raise TypeError(f"'{name}' needs logits [N, C], got {z}")
    _check_rows(name, z.shape[0], target, attrs)


def _ce_infer(types, attrs):
    z, target = types
    _ce_check("cross_entropy", z, target, attrs)
    t = _loss_type("cross_entropy", z, attrs)
    return t.with_shape((z.shape[0],) if attrs["reduction"] == "none" else ()), t.with_shape((z.shape[0],))


def _ce_grad_infer(types, attrs):
    g, z, lse, target = types
    _ce_check("cross_entropy_grad", z, target, attrs)
    t = _loss_type("cross_entropy_grad", z, attrs)
    want = (z.shape[0],) if attrs["reduction"] == "none" else ()
    if g != t.with_shape(want):
        raise TypeError(f"'cross_entropy_grad': output gradient must be {t.with_shape(want)} for reduction "
                        f"{attrs['reduction']!r}, got {g}")
    if lse != t.with_shape((z.shape[0],)):
        raise TypeError(f"'cross_entropy_grad': logsumexp must be {t.with_shape((z.shape[0],))}, got {lse}")
    return z


def logits_forward(z, target, *, reduction: str = "mean", ignore_index: int = -100):
    """NumPy reference of ``cross_entropy``: (loss, logsumexp [N]) in z's dtype."""
    keep = target != ignore_index
    t = np.where(keep, target, 0)
    lse = _row_logsumexp(z)
    rows = np.where(keep, lse - z[np.arange(z.shape[0]), t], 0).astype(z.dtype)
    return _reduce_rows(rows, keep, reduction), lse


def logits_backward(g, z, lse, target, *, reduction: str = "mean", ignore_index: int = -100):
    """NumPy reference of ``cross_entropy_grad``: (softmax(z) - onehot(target)) times each row's weight."""
    keep = target != ignore_index
    t = np.where(keep, target, 0)
    p = np.exp(z - lse[:, None])
    p[np.arange(z.shape[0]), t] -= 1
    p *= row_scale(g, keep, reduction)[:, None]
    return p


def _ce_samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 4, 5, low=-3, high=3), _targets(r, 4, 5, -100)]),
            Sample([rand(r, 3, 6, low=-3, high=3), _targets(r, 3, 6, 2)], {"reduction": "sum", "ignore_index": 2}),
            Sample([rand(r, 5, 3, low=-3, high=3), _targets(r, 5, 3, -1)], {"reduction": "none", "ignore_index": -1})]


def _ce_grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _ce_samples(r):
        _, lse = logits_forward(*s.args, **s.attrs)
        g = rand(r, *((s.args[0].shape[0],) if s.attrs.get("reduction") == "none" else ()))
        out.append(Sample([g, s.args[0], lse, s.args[1]], s.attrs))
    return out


_CE_ATTRS = _ATTRS[:2] + (_UPCAST,)
declare(OpDef("cross_entropy", 2, _CE_ATTRS, _ce_infer, frozenset({"autocast_f32"}), num_results=2,
              index_bounds=lambda types, attrs: IndexBounds(1, types[0].shape[1], attrs["ignore_index"]),
              flops=lambda ins, outs, attrs: 4.0 * ins[0].numel, sample=_ce_samples,
              doc="nll_loss(log_softmax(z, axis=1), target) and the rows' logsumexp [N], from the logits z [N, C]; "
                  "with upcast, of bf16 or f16 logits converted to f32 (loss and logsumexp f32) a chunk at a time"))
declare(OpDef("cross_entropy_grad", 4, _CE_ATTRS, _ce_grad_infer, frozenset({"overwrite"}),
              index_bounds=lambda types, attrs: IndexBounds(3, types[1].shape[1], attrs["ignore_index"]),
              flops=lambda ins, outs, attrs: 4.0 * outs[0].numel, sample=_ce_grad_samples,
              doc="gradient of cross_entropy wrt the logits, from (grad_output, logits, logsumexp, target): "
                  "(softmax(z) - onehot(target)) times each row's weight; may be written over the logits; with "
                  "upcast, computed in f32 (grad_output and logsumexp f32) and rounded to the logits' dtype"))


# ================================================================ VJP rules (reverse mode)
from ..opdef import def_vjp  # noqa: E402
from ._vjp import Saves  # noqa: E402


def _loss_gradient(op: str, g):
    """The loss's output gradient of an op returning (loss, logsumexp); the logsumexp has none."""
    g_loss, g_lse = g
    if g_lse is not None:
        raise NotImplementedError(f"the logsumexp result of '{op}' is not differentiable; "
                                  "use only its first result (the loss)")
    return g_loss


@def_vjp("linear_cross_entropy", saves=Saves(operands=(0, 1, 2), results=(1,)))
def _linear_cross_entropy_vjp(b, p, g):
    g_loss = _loss_gradient("linear_cross_entropy", g)
    if g_loss is None:
        return [None, None, None]
    x, w, target = p.x
    dx, dw = b.op("linear_cross_entropy_grad", g_loss, x, w, target, p.y[1], **p.attrs)
    return [dx, dw, None]


@def_vjp("linear_cross_entropy_grad", saves="none")
def _linear_cross_entropy_grad_vjp(b, p, g):
    raise NotImplementedError("second-order differentiation through linear_cross_entropy is not supported "
                              "(linear_cross_entropy_grad has no VJP rule)")


@def_vjp("cross_entropy", saves=Saves(operands=(0, 1), results=(1,)))
def _cross_entropy_vjp(b, p, g):
    g_loss = _loss_gradient("cross_entropy", g)
    if g_loss is None:
        return [None, None]
    z, target = p.x
    return [b.op("cross_entropy_grad", g_loss, z, p.y[1], target, **p.attrs), None]


@def_vjp("cross_entropy_grad", saves="none")
def _cross_entropy_grad_vjp(b, p, g):
    raise NotImplementedError("second-order differentiation through cross_entropy is not supported "
                              "(cross_entropy_grad has no VJP rule)")


# ================================================================ decompositions (composites in primitives)
from ..opdef import def_decomposition  # noqa: E402


def _row_logsumexp_ir(b, z):
    m = b.op("reduce_max", z, axes=[1], keepdims=True)
    s = b.op("reduce_sum", b.op("exp", b.op("sub", z, m)), axes=[1], keepdims=True)
    return b.op("reshape", b.op("add", m, b.op("log", s)), shape=(z.type.shape[0],))


def _upcast_logits(b, z, attrs):
    """(the logits the loss computes on: converted to f32 with ``upcast``; the other attributes)."""
    rest = {k: v for k, v in attrs.items() if k != "upcast"}
    return (b.op("cast", z, dtype=DType.f32) if attrs.get("upcast") else z), rest


@def_decomposition("cross_entropy")
def _cross_entropy_decomp(b, xs, attrs):
    z, target = xs
    z, attrs = _upcast_logits(b, z, attrs)
    loss = b.op("nll_loss", b.op("log_softmax", z, axis=1), target, **attrs)
    return [loss, _row_logsumexp_ir(b, z)]


@def_decomposition("cross_entropy_grad")
def _cross_entropy_grad_decomp(b, xs, attrs):
    # nll_loss_grad puts -w_n at each kept row's target (w_n: the row's weight), so its row sums are -w.
    g, z0, lse, target = xs
    z, attrs = _upcast_logits(b, z0, attrs)
    n, c = z.type.shape
    hot = b.op("nll_loss_grad", g, target, num_classes=c, **attrs)
    w = b.op("neg", b.op("reduce_sum", hot, axes=[1], keepdims=True))
    p = b.op("exp", b.op("sub", z, b.op("reshape", lse, shape=(n, 1))))
    dz = b.op("add", b.op("mul", p, w), hot)
    return [dz if z is z0 else b.op("cast", dz, dtype=z0.type.dtype)]
