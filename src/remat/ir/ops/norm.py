"""Normalisation as composite ops with native kernels: layer norm and batch norm, with their
backward ops (RAF §3.2.1–3.2.2).

Each forward op returns its statistics as extra results (as ATen's ``native_layer_norm`` and
``native_batch_norm`` do), and its VJP rule emits one backward op that reads exactly what the
native backward kernel needs: the input, the weight and the statistics, never the normalised
output. Optional trailing operands (weight, bias) make the no-affine forms.
"""
from __future__ import annotations

from math import prod

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import check_axis, expect_float, norm_axis, rand


def _stats_shape(x: TensorType, axis: int) -> tuple[int, ...]:
    """Shape of layer norm's mean/rstd: the leading dims, ones over the normalised ones (ATen's)."""
    return x.shape[:axis] + (1,) * (x.rank - axis)


def _axis_norm(types, attrs):
    return {**attrs, "axis": norm_axis(attrs["axis"], types[0].rank)} if types else attrs


def _check_affine(name: str, params: list[TensorType], shape: tuple[int, ...], x: TensorType, what: str) -> None:
    for p, pname in zip(params, ("weight", "bias")):
        if p.shape != shape or p.dtype != x.dtype:
            raise TypeError(f"'{name}': {pname} {p} must be {x.dtype}{list(shape)} ({what} of input {x})")


# ---------------------------------------------------------------- layer norm
def _ln_check(name: str, x: TensorType, attrs) -> tuple[int, ...]:
    expect_float(name, x)
    check_axis(name, attrs["axis"], x.rank)
    return x.shape[attrs["axis"]:]


def _ln_param_dtype(x: TensorType, affine: list[TensorType]) -> DType:
    """The dtype of a layer or group norm's weight and bias, and of its statistics: the input's, or
    f32 for an f16/bf16 input with f32 weight and bias (ATen's mixed-type kernels, as under
    ``torch.autocast``: they compute in f32 and give the output in the input's dtype, the statistics
    and the parameters' gradients in f32)."""
    if affine and affine[0].dtype == DType.f32 and x.dtype.is_low:
        return DType.f32
    return x.dtype


def _check_ln_affine(name: str, params: list[TensorType], shape: tuple[int, ...], x: TensorType,
                     what: str = "the normalised dims") -> DType:
    dt = _ln_param_dtype(x, params)
    for p, pname in zip(params, ("weight", "bias")):
        if p.shape != shape or p.dtype != dt:
            mixed = " (or f32, for an f16/bf16 input)" if x.dtype.is_low else ""
            raise TypeError(f"'{name}': {pname} {p} must be {dt}{list(shape)}{mixed} ({what} of input {x})")
    return dt


def _layer_norm_infer(types, attrs):
    x, *affine = types
    if len(affine) > 2:
        raise TypeError(f"'layer_norm' takes the input, then optionally weight and bias; got {len(types)} operands")
    norm_shape = _ln_check("layer_norm", x, attrs)
    dt = _check_ln_affine("layer_norm", affine, norm_shape, x)
    st = TensorType(dt, _stats_shape(x, attrs["axis"]))
    return x, st, st


def _layer_norm_grad_infer(types, attrs):
    if len(types) not in (4, 5):
        raise TypeError(f"'layer_norm_grad' takes (grad_output, input, mean, rstd[, weight]), got {len(types)} operands")
    gy, x, mean, rstd, *w = types
    norm_shape = _ln_check("layer_norm_grad", x, attrs)
    dt = _check_ln_affine("layer_norm_grad", w, norm_shape, x)
    st = TensorType(dt, _stats_shape(x, attrs["axis"]))
    if gy != x or mean != st or rstd != st:
        raise TypeError(f"'layer_norm_grad': grad_output {gy}, mean {mean} and rstd {rstd} must be {x} and {st} "
                        f"for input {x} normalised from axis {attrs['axis']}")
    return (x, *w, *w)


def _norm_flops(factor: float):
    def flops(ins, outs, attrs):
        return factor * ins[0].numel if ins[0].dtype.is_float else 0.0

    return flops


def _ln_samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 3, 4, 5), rand(r, 5, low=0.5, high=1.5), rand(r, 5)], {"axis": 2}),
            Sample([rand(r, 2, 3, 4)], {"axis": 1, "eps": 1e-3}),
            Sample([rand(r, 4, 6), rand(r, 6, low=0.5, high=1.5)], {"axis": -1})]


def _ln_grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _ln_samples(r):
        x = s.args[0]
        axes = tuple(range(norm_axis(s.attrs["axis"], x.ndim), x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        rstd = 1.0 / np.sqrt(x.var(axis=axes, keepdims=True) + s.attrs.get("eps", 1e-5))
        out.append(Sample([rand(r, *x.shape), x, mean, rstd, *s.args[1:2]], {"axis": s.attrs["axis"]}))
    return out


declare(OpDef("layer_norm", None, (Attr("axis", "int"), Attr("eps", "float", 1e-5)), _layer_norm_infer,
              frozenset(), num_results=3, normalize=_axis_norm, flops=_norm_flops(8.0),
              doc="layer normalisation of x over its dims from `axis` on, then `* weight + bias` when given "
                  "(operands x[, weight[, bias]]); results (y, mean, rstd), statistics with the normalised dims "
                  "kept as 1 (ATen native_layer_norm)",
              sample=_ln_samples))
declare(OpDef("layer_norm_grad", None, (Attr("axis", "int"),), _layer_norm_grad_infer, frozenset(), num_results=-1,
              min_operands=4, normalize=lambda t, a: _axis_norm(t[1:], a), flops=_norm_flops(10.0),
              doc="backward of layer_norm from (grad_output, x, mean, rstd[, weight]): grad_x, and grad_weight, "
                  "grad_bias when a weight is given (ATen native_layer_norm_backward)",
              sample=_ln_grad_samples))


# ---------------------------------------------------------------- batch norm
_BN_AXIS = Attr("axis", "int", 1)
"""The channel axis of batch norm's input: 1 ([N, C, ...], PyTorch's), or the last one of a
channels-last layout ([N, H, W, C], ``remat.passes.layout``)."""
_BN_ATTRS = (Attr("training", "bool", True), Attr("momentum", "float", 0.1), Attr("eps", "float", 1e-5),
             Attr("affine", "bool", True), _BN_AXIS)


def _bn_x(name: str, x: TensorType, attrs) -> int:
    expect_float(name, x)
    if x.rank < 2:
        raise TypeError(f"'{name}' needs an input [N, C, ...] of rank >= 2, got {x}")
    check_axis(name, attrs.get("axis", 1), x.rank, "channel axis")
    if attrs.get("axis", 1) == 0:
        raise TypeError(f"'{name}': the channel axis cannot be the batch axis 0 of {x}")
    return x.shape[attrs.get("axis", 1)]


def _bn_reduced(x: TensorType, axis: int) -> list[int]:
    """The axes batch norm's statistics reduce over: all but the channel axis."""
    return [a for a in range(x.rank) if a != axis]


def _bn_split(types, attrs) -> tuple[TensorType, list[TensorType], list[TensorType]]:
    """(input, [weight, bias], [running_mean, running_var]) from batch_norm's operands."""
    na = 2 if attrs["affine"] else 0
    x, rest = types[0], list(types[1:])
    if len(rest) not in (na, na + 2):
        raise TypeError(f"'batch_norm' takes x, {'weight, bias, ' if na else ''}then optionally running_mean, "
                        f"running_var (affine={str(attrs['affine']).lower()}); got {len(types)} operands")
    return x, rest[:na], rest[na:]


"""Input dtypes batch norm takes with float32 per-channel operands (ATen's mixed-dtype CPU kernel)."""


def stats_dtype(x: TensorType, vectors) -> DType:
    """The dtype of batch norm's per-channel values (weight, bias, running and batch statistics):
    the per-channel operands' (``vectors``), or the input's when there are none. A half-precision
    input (f16, bf16) may come with float32 ones, as under ``torch.autocast``: ATen's mixed-dtype
    CPU kernel reads x in its dtype, computes in float32, keeps the statistics in float32 and
    writes the output (and grad_x) in x's dtype, so no float32 copy of x is ever made."""
    dts = {v.dtype for v in vectors}
    if len(dts) > 1:
        raise TypeError(f"'batch_norm': weight, bias and running statistics must share one dtype, got "
                        f"{', '.join(str(v) for v in vectors)}")
    dt = dts.pop() if dts else x.dtype
    if dt != x.dtype and not (x.dtype.is_low and dt == DType.f32):
        raise TypeError(f"'batch_norm': per-channel operands of {dt} with an input {x}: only an f16/bf16 input "
                        f"may have f32 ones (the mixed-dtype kernel); insert a cast")
    return dt


def _bn_vectors(name: str, x: TensorType, c: int, named) -> TensorType:
    """The [C] type of the per-channel values for input ``x``; ``named``: (type, what) of the
    per-channel operands, each of which must be it."""
    try:
        vec = TensorType(stats_dtype(x, [t for t, _ in named]), (c,))
    except TypeError as e:
        raise TypeError(str(e).replace("'batch_norm'", f"'{name}'")) from None
    for t, what in named:
        if t != vec:
            raise TypeError(f"'{name}': {what} must be {vec} (one per channel of input {x}), got {t}")
    return vec


def _batch_norm_infer(types, attrs):
    x, affine, running = _bn_split(types, attrs)
    c = _bn_x("batch_norm", x, attrs)
    vec = _bn_vectors("batch_norm", x, c, list(zip(affine, ("weight", "bias"))) +
                      list(zip(running, ("running_mean", "running_var"))))
    if not attrs["training"]:
        if not running:
            raise TypeError("'batch_norm' in eval mode (training=false) needs running_mean and running_var operands")
        return x
    return (x, vec, vec) + ((vec, vec) if running else ())


def _batch_norm_grad_infer(types, attrs):
    if len(types) not in (4, 5):
        raise TypeError(f"'batch_norm_grad' takes (grad_output, input, mean, invstd_or_var[, weight]), "
                        f"got {len(types)} operands")
    gy, x, s1, s2, *w = types
    c = _bn_x("batch_norm_grad", x, attrs)
    _bn_vectors("batch_norm_grad", x, c, [(s1, "the first statistic"), (s2, "the second statistic")] +
                [(t, "weight") for t in w])
    if gy != x:
        raise TypeError(f"'batch_norm_grad': grad_output {gy} must be {x}")
    return (x, *w, *w)


def _batch_norm_stats_infer(types, attrs):
    if len(types) not in (1, 3):
        raise TypeError(f"'batch_norm_stats' takes x, then optionally running_mean, running_var; got {len(types)} operands")
    x, *running = types
    vec = _bn_vectors("batch_norm_stats", x, _bn_x("batch_norm_stats", x, attrs),
                      list(zip(running, ("running_mean", "running_var"))))
    return (vec,) * (4 if running else 2)


def _batch_norm_grad_sums_infer(types, attrs):
    if len(types) != 4:
        raise TypeError(f"'batch_norm_grad_sums' takes (grad_output, input, mean, invstd), got {len(types)} operands")
    gy, x, mean, invstd = types
    vec = _bn_vectors("batch_norm_grad_sums", x, _bn_x("batch_norm_grad_sums", x, attrs),
                      [(mean, "mean"), (invstd, "invstd")])
    if gy != x:
        raise TypeError(f"'batch_norm_grad_sums': grad_output {gy} must be {x}")
    return (vec, vec)


def _bn_saves(attrs, n: int):
    from ._vjp import Saves

    affine = (1,) if attrs.get("affine", True) else ()
    if attrs.get("training", True):  # the batch statistics (results 1, 2), not the output
        return Saves(operands=(0,) + affine, results=(1, 2))
    return Saves(operands=(0,) + affine + (n - 2, n - 1))  # eval: the running statistics


def _bn_samples(r: np.random.Generator) -> list[Sample]:
    def pos(*s):
        return rand(r, *s, low=0.5, high=1.5)

    return [Sample([rand(r, 4, 3, 3, 2), pos(3), rand(r, 3), rand(r, 3), pos(3)], {"momentum": 0.2}),
            Sample([rand(r, 5, 2, 3)], {"affine": False, "eps": 1e-3}),
            Sample([rand(r, 6, 4), pos(4), rand(r, 4)], {}),
            Sample([rand(r, 2, 3, 2, 2), pos(3), rand(r, 3), rand(r, 3), pos(3)], {"training": False}),
            Sample([rand(r, 4, 3, 2, 3), pos(3), rand(r, 3), rand(r, 3), pos(3)], {"momentum": 0.2, "axis": 3}),
            Sample([rand(r, 2, 2, 2, 3), pos(3), rand(r, 3), rand(r, 3), pos(3)], {"training": False, "axis": 3})]


def _bn_grad_sums_samples(r: np.random.Generator) -> list[Sample]:
    x, xl, x2 = rand(r, 4, 3, 3, 2), rand(r, 4, 3, 2, 3), rand(r, 6, 4)
    return [Sample([rand(r, *x.shape), x, x.mean(axis=(0, 2, 3)), 1.0 / np.sqrt(x.var(axis=(0, 2, 3)) + 1e-5)], {}),
            Sample([rand(r, *x2.shape), x2, x2.mean(axis=0), 1.0 / np.sqrt(x2.var(axis=0) + 1e-3)], {}),
            Sample([rand(r, *xl.shape), xl, xl.mean(axis=(0, 1, 2)), 1.0 / np.sqrt(xl.var(axis=(0, 1, 2)) + 1e-5)],
                   {"axis": 3})]


def _bn_stats_samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 4, 3, 3, 2), rand(r, 3), rand(r, 3, low=0.5, high=1.5)], {"momentum": 0.2}),
            Sample([rand(r, 5, 2, 3)], {"eps": 1e-3}),
            Sample([rand(r, 6, 4)], {}),
            Sample([rand(r, 4, 3, 2, 3), rand(r, 3), rand(r, 3, low=0.5, high=1.5)], {"momentum": 0.2, "axis": 3})]


def _bn_grad_samples(r: np.random.Generator) -> list[Sample]:
    x = rand(r, 4, 3, 3, 2)
    mean = x.mean(axis=(0, 2, 3))
    invstd = 1.0 / np.sqrt(x.var(axis=(0, 2, 3)) + 1e-5)
    x2 = rand(r, 6, 4)
    xl = rand(r, 4, 3, 2, 3)  # channels last
    return [Sample([rand(r, *x.shape), x, mean, invstd, rand(r, 3, low=0.5, high=1.5)], {}),
            Sample([rand(r, *x2.shape), x2, x2.mean(axis=0), 1.0 / np.sqrt(x2.var(axis=0) + 1e-3)], {"eps": 1e-3}),
            Sample([rand(r, *x.shape), x, rand(r, 3), rand(r, 3, low=0.5, high=1.5), rand(r, 3)], {"training": False}),
            Sample([rand(r, 4, 3, 2, 3), xl, xl.mean(axis=(0, 1, 2)), 1.0 / np.sqrt(xl.var(axis=(0, 1, 2)) + 1e-5),
                    rand(r, 3, low=0.5, high=1.5)], {"axis": 3})]


declare(OpDef("batch_norm", None, _BN_ATTRS, _batch_norm_infer, frozenset(), num_results=-1,
              flops=_norm_flops(8.0),
              doc="batch normalisation over all dims but the channel axis (1, or axis) of x[, weight, bias][, running_mean, running_var]. "
                  "Training: batch statistics; results (y, mean, invstd[, new running_mean, new running_var]) with the "
                  "unbiased variance in the running update. Eval (training=false): running statistics; result y "
                  "(ATen native_batch_norm)",
              sample=_bn_samples))
declare(OpDef("batch_norm_stats", None, (Attr("momentum", "float", 0.1), Attr("eps", "float", 1e-5), _BN_AXIS),
              _batch_norm_stats_infer, frozenset(), num_results=-1, flops=_norm_flops(4.0),
              doc="the statistics half of training-mode batch_norm, over all dims but the channel axis of x[, "
                  "running_mean, running_var]: (mean, invstd[, new running_mean, new running_var]), batch_norm's "
                  "results 1.. (the biased variance in invstd, the unbiased one in the running update). The "
                  "split-batch-norm pass pairs it with the normalisation as one element-wise instruction, so a "
                  "recomputed output costs one pass over x",
              sample=_bn_stats_samples))
declare(OpDef("batch_norm_grad", None, (Attr("training", "bool", True), Attr("eps", "float", 1e-5), _BN_AXIS),
              _batch_norm_grad_infer, frozenset(), num_results=-1, min_operands=4, flops=_norm_flops(10.0),
              doc="backward of batch_norm from (grad_output, x, mean, invstd[, weight]) in training, "
                  "(grad_output, x, running_mean, running_var[, weight]) in eval: grad_x, and grad_weight, grad_bias "
                  "when a weight is given (ATen native_batch_norm_backward)",
              sample=_bn_grad_samples))

declare(OpDef("batch_norm_grad_sums", 4, (_BN_AXIS,), _batch_norm_grad_sums_infer, frozenset(), num_results=2,
              nondiff=True, flops=_norm_flops(3.0),
              doc="the reduction half of training-mode batch_norm_grad from (grad_output, x, mean, invstd), over all "
                  "dims but the channel axis: (Σ grad_output·(x − mean)·invstd, Σ grad_output), which are "
                  "batch_norm_grad's grad_weight and grad_bias. The split-batch-norm-grad pass (a memory-lean algorithm) "
                  "pairs it with grad_x as one element-wise instruction, so no kernel holds a second input-sized buffer "
                  "(ATen native_batch_norm_backward without grad_input)",
              sample=_bn_grad_sums_samples))

# ---------------------------------------------------------------- group norm
def _gn_check(name: str, x: TensorType, attrs) -> int:
    c = _bn_x(name, x, attrs)
    g = attrs["groups"]
    if g < 1 or c % g:
        raise TypeError(f"'{name}': {c} channels do not split into {g} groups")
    return c


def _group_norm_infer(types, attrs):
    x, *affine = types
    if len(affine) not in (0, 2):
        raise TypeError(f"'group_norm' takes x, then optionally weight and bias (both); got {len(types)} operands")
    c = _gn_check("group_norm", x, attrs)
    dt = _check_ln_affine("group_norm", affine, (c,), x, "one per channel")
    st = TensorType(dt, (x.shape[0], attrs["groups"]))
    return x, st, st


def _group_norm_grad_infer(types, attrs):
    if len(types) not in (4, 5):
        raise TypeError(f"'group_norm_grad' takes (grad_output, input, mean, rstd[, weight]), got {len(types)} operands")
    gy, x, mean, rstd, *w = types
    c = _gn_check("group_norm_grad", x, attrs)
    dt = _check_ln_affine("group_norm_grad", w, (c,), x, "one per channel")
    st = TensorType(dt, (x.shape[0], attrs["groups"]))
    if gy != x or mean != st or rstd != st:
        raise TypeError(f"'group_norm_grad': grad_output {gy}, mean {mean} and rstd {rstd} must be {x} and {st}")
    return (x, *w, *w)


def _gn_samples(r: np.random.Generator) -> list[Sample]:
    return [Sample([rand(r, 2, 6, 3, 4), rand(r, 6, low=0.5, high=1.5), rand(r, 6)], {"groups": 3}),
            Sample([rand(r, 3, 4, 5)], {"groups": 2, "eps": 1e-3}),
            Sample([rand(r, 2, 3, 4, 6), rand(r, 6, low=0.5, high=1.5), rand(r, 6)], {"groups": 2, "axis": 3})]


def _gn_grad_samples(r: np.random.Generator) -> list[Sample]:
    out = []
    for s in _gn_samples(r):
        x, g, axis = s.args[0], s.attrs["groups"], s.attrs.get("axis", 1)
        xc = np.moveaxis(x, axis, 1).reshape(x.shape[0], g, -1)
        mean = xc.mean(axis=2)
        rstd = 1.0 / np.sqrt(xc.var(axis=2) + s.attrs.get("eps", 1e-5))
        out.append(Sample([rand(r, *x.shape), x, mean, rstd, *s.args[1:2]], {"groups": g, "axis": axis}))
    return out


_GN_AXIS = Attr("axis", "int", 1)
"""The channel axis: 1 ([N, C, ...], PyTorch's), or the last one of a channels-last layout."""
declare(OpDef("group_norm", None, (Attr("groups", "int"), Attr("eps", "float", 1e-5), _GN_AXIS), _group_norm_infer,
              frozenset(), num_results=3, min_operands=1, flops=_norm_flops(8.0),
              doc="group normalisation of x (channels on `axis`, split into `groups`), then per channel "
                  "`* weight + bias` when given (operands x[, weight, bias]); results (y, mean, rstd), statistics "
                  "[N, groups] (ATen native_group_norm); its backward keeps x and the statistics",
              sample=_gn_samples))
declare(OpDef("group_norm_grad", None, (Attr("groups", "int"), _GN_AXIS), _group_norm_grad_infer, frozenset(),
              num_results=-1, min_operands=4, flops=_norm_flops(10.0),
              doc="backward of group_norm from (grad_output, x, mean, rstd[, weight]): grad_x, and grad_weight, "
                  "grad_bias when a weight is given (ATen native_group_norm_backward)",
              sample=_gn_grad_samples))


# ================================================================ VJP rules (reverse mode)
# rule(b, p, g) -> one cotangent per operand; see remat.ir.ops._vjp. The forward ops have several
# results, so ``g`` is the list of their cotangents (None: zero).
from ..opdef import def_vjp  # noqa: E402
from ._vjp import Saves, cast_to as _to, scalar_like as _c  # noqa: E402


def _add(b, a, c):
    if a is None:
        return c
    return a if c is None else b.op("add", a, c)


def _stats_cotangent(b, x, mean, rstd, g_mean, g_rstd, n: int):
    """Cotangent on x from cotangents on the statistics: mean = Σx/n, rstd = (Σ(x-mean)²/n + eps)^-½.

    ``mean``/``rstd`` broadcast against ``x``; ``g_mean``/``g_rstd`` have their shapes (None: zero).
    """
    gx = None
    if g_mean is not None:
        gx = b.op("broadcast", b.op("mul", g_mean, _c(b, 1.0 / n, g_mean)), shape=x.type.shape)
    if g_rstd is not None:  # d rstd / dx = -rstd³ (x - mean) / n
        r3 = b.op("mul", b.op("mul", rstd, rstd), rstd)
        k = b.op("mul", b.op("mul", g_rstd, r3), _c(b, -1.0 / n, r3))
        gx = _add(b, gx, b.op("mul", b.op("sub", x, mean), k))
    return gx


@def_vjp("layer_norm", saves=Saves(operands=(0, 1), results=(1, 2)))
def _layer_norm_vjp(b, p, g):
    gy, g_mean, g_rstd = g
    x, w = p.x[0], (p.x[1] if len(p.x) > 1 else None)
    mean, rstd = p.y[1], p.y[2]
    axis = p.attrs["axis"]
    gx = gw = gbias = None
    if gy is not None:
        outs = b.op("layer_norm_grad", gy, x, mean, rstd, *([w] if w is not None else []), axis=axis)
        if w is None:
            gx = outs
        else:
            gx, gw, gbias = outs
    n = prod(p.in_types[0].shape[axis:])
    if g_mean is not None or g_rstd is not None:
        xs = x if x.type.dtype == mean.type.dtype else b.op("cast", x, dtype=mean.type.dtype)  # mixed types
        gs = _stats_cotangent(b, xs, mean, rstd, g_mean, g_rstd, n)
        gx = _add(b, gx, gs if gs.type.dtype == x.type.dtype else b.op("cast", gs, dtype=x.type.dtype))
    return [gx, gw, gbias][: len(p.in_types)]


def _channel(b, v, rank: int, axis: int = 1):
    """A per-channel vector [C] shaped to broadcast over a tensor whose channels are on ``axis``
    ([N, C, ...] by default)."""
    return b.op("reshape", v, shape=(1,) * axis + (v.type.shape[0],) + (1,) * (rank - axis - 1))


def _bn_stats_cotangents(b, x, s1, s2, g_mean, g_invstd, g_rmean, g_rvar, m: float, axis: int):
    """(cotangent on x, on running_mean, on running_var) from the cotangents of training batch
    norm's statistics (mean ``s1``, invstd ``s2``) and new running statistics (None: zero)."""
    xt = x.type
    rank, n = xt.rank, xt.numel // xt.shape[axis]
    g_rm = g_rv = gx = None
    if any(g is not None for g in (g_mean, g_invstd, g_rmean, g_rvar)) and s1.type.dtype != xt.dtype:
        x = b.op("cast", x, dtype=s1.type.dtype)  # mixed dtypes: the statistics' cotangents in float32
    if g_rmean is not None:  # new_rm = (1 - m) rm + m mean
        g_rm = b.op("mul", g_rmean, _c(b, 1.0 - m, g_rmean))
        g_mean = _add(b, g_mean, b.op("mul", g_rmean, _c(b, m, g_rmean)))
    if g_rvar is not None:  # new_rv = (1 - m) rv + m n/(n-1) var, d var / dx = 2 (x - mean) / n
        g_rv = b.op("mul", g_rvar, _c(b, 1.0 - m, g_rvar))
        k = b.op("mul", g_rvar, _c(b, 2.0 * m / max(n - 1, 1), g_rvar))
        gx = b.op("mul", b.op("sub", x, _channel(b, s1, rank, axis)), _channel(b, k, rank, axis))
    if g_mean is not None or g_invstd is not None:
        mean_c, rstd_c = _channel(b, s1, rank, axis), _channel(b, s2, rank, axis)
        gm = _channel(b, g_mean, rank, axis) if g_mean is not None else None
        gr = _channel(b, g_invstd, rank, axis) if g_invstd is not None else None
        gx = _add(b, gx, _stats_cotangent(b, x, mean_c, rstd_c, gm, gr, n))
    if gx is not None and gx.type.dtype != xt.dtype:  # a half-precision x with float32 statistics
        gx = b.op("cast", gx, dtype=xt.dtype)
    return gx, g_rm, g_rv


@def_vjp("batch_norm_stats", saves=Saves(operands=(0,), results=(0, 1)))
def _batch_norm_stats_vjp(b, p, g):
    g = list(g) + [None] * (4 - len(g))
    gx, g_rm, g_rv = _bn_stats_cotangents(b, p.x[0], p.y[0], p.y[1], *g, p.attrs["momentum"], p.attrs["axis"])
    return [gx] + ([g_rm, g_rv] if len(p.in_types) == 3 else [])


@def_vjp("batch_norm", saves=_bn_saves)
def _batch_norm_vjp(b, p, g):
    g = ((list(g) if isinstance(g, list) else [g]) + [None] * 4)[:5]  # eval mode has the one result y
    gy, g_mean, g_invstd, g_rmean, g_rvar = g
    x, rank, axis = p.x[0], p.in_types[0].rank, p.attrs["axis"]
    affine = p.attrs["affine"]
    w = p.x[1] if affine else None
    n_ops = len(p.in_types)
    running = n_ops == 1 + 2 * affine + 2
    training = p.attrs["training"]
    if training:
        s1, s2 = p.y[1], p.y[2]
    else:
        s1, s2 = p.x[n_ops - 2], p.x[n_ops - 1]
    gx = gw = gbias = None
    if gy is not None:
        outs = b.op("batch_norm_grad", gy, x, s1, s2, *([w] if affine else []), training=training, eps=p.attrs["eps"],
                    axis=axis)
        if affine:
            gx, gw, gbias = outs
        else:
            gx = outs
    g_rm = g_rv = None
    if training:
        gs, g_rm, g_rv = _bn_stats_cotangents(b, x, s1, s2, g_mean, g_invstd, g_rmean, g_rvar, p.attrs["momentum"],
                                              axis)
        gx = _add(b, gx, gs)
    elif gy is not None:  # eval: y = (x - rm) (rv + eps)^-½ w + b also depends on the running statistics
        axes = _bn_reduced(x.type, axis)
        wide = s2.type.dtype  # float32 for a half-precision x with float32 statistics (the mixed kernel)
        xw, gyw = (x, gy) if wide == x.type.dtype else (b.op("cast", x, dtype=wide), b.op("cast", gy, dtype=wide))
        invstd = b.op("rsqrt", b.op("add", s2, _c(b, p.attrs["eps"], s2)))
        gyw = b.op("mul", gyw, _channel(b, w, rank, axis)) if affine else gyw
        g_rm = b.op("neg", b.op("mul", b.op("reduce_sum", gyw, axes=axes), invstd))
        dvar = b.op("mul", b.op("mul", invstd, b.op("mul", invstd, invstd)), _c(b, -0.5, invstd))
        prod_ = b.op("mul", gyw, b.op("sub", xw, _channel(b, s1, rank, axis)))
        g_rv = b.op("mul", b.op("reduce_sum", prod_, axes=axes), dvar)
    return [gx] + ([gw, gbias] if affine else []) + ([g_rm, g_rv] if running else [])


def _no_second_order(name: str):
    def rule(b, p, g):
        raise NotImplementedError(f"second-order differentiation through {name} is not supported "
                                  f"(its backward op '{name}_grad' has no VJP rule)")

    return rule


def_vjp("layer_norm_grad", saves="none")(_no_second_order("layer_norm"))
def_vjp("batch_norm_grad", saves="none")(_no_second_order("batch_norm"))


@def_vjp("group_norm", saves=Saves(operands=(0, 1), results=(1, 2)))
def _group_norm_vjp(b, p, g):
    gy, g_mean, g_rstd = g
    if g_mean is not None or g_rstd is not None:
        raise NotImplementedError("the statistics (mean, rstd) of group_norm are not differentiable; "
                                  "compute them from x with reductions instead")
    if gy is None:
        return [None] * len(p.in_types)
    x, w = p.x[0], (p.x[1] if len(p.in_types) > 1 else None)
    outs = b.op("group_norm_grad", gy, x, p.y[1], p.y[2], *([w] if w is not None else []),
                groups=p.attrs["groups"], axis=p.attrs["axis"])
    return [outs] if w is None else list(outs)


def_vjp("group_norm_grad", saves="none")(_no_second_order("group_norm"))


# ================================================================ decompositions (composites in primitives)
# rule(b, xs, attrs) -> one value per result; see remat.ir.opdef.def_decomposition.
from ..opdef import def_decomposition  # noqa: E402


def _moments(b, x, axes: list[int], eps: float):
    """(x − mean, mean, rstd) over ``axes`` (dims kept): the biased variance, as the native kernels."""
    mean = b.op("reduce_mean", x, axes=axes, keepdims=True)
    xc = b.op("sub", x, mean)
    var = b.op("reduce_mean", b.op("mul", xc, xc), axes=axes, keepdims=True)
    return xc, mean, b.op("rsqrt", b.op("add", var, _c(b, eps, var))), var


def _norm_grad_x(b, gh, xhat, rstd, axes: list[int]):
    """grad_x of a normalisation over ``axes`` from ĝ = gy · weight: rstd (ĝ − mean ĝ − x̂ mean(ĝ x̂))."""
    m1 = b.op("reduce_mean", gh, axes=axes, keepdims=True)
    m2 = b.op("reduce_mean", b.op("mul", gh, xhat), axes=axes, keepdims=True)
    return b.op("mul", rstd, b.op("sub", b.op("sub", gh, m1), b.op("mul", xhat, m2)))


def _affine_grads(b, gy, xhat, axes: list[int]):
    return [b.op("reduce_sum", b.op("mul", gy, xhat), axes=axes), b.op("reduce_sum", gy, axes=axes)]


@def_decomposition("layer_norm")
def _layer_norm_decomp(b, xs, attrs):
    x, *affine = xs
    dt = _ln_param_dtype(x.type, [a.type for a in affine])  # mixed types compute in f32
    xc, mean, rstd, _ = _moments(b, _to(b, x, dt), list(range(attrs["axis"], x.type.rank)), attrs["eps"])
    y = b.op("mul", xc, rstd)
    if affine:
        y = b.op("mul", y, affine[0])
    if len(affine) > 1:
        y = b.op("add", y, affine[1])
    return [_to(b, y, x.type.dtype), mean, rstd]


@def_decomposition("layer_norm_grad")
def _layer_norm_grad_decomp(b, xs, attrs):
    gy, x, mean, rstd, *w = xs
    axis = attrs["axis"]
    dt = mean.type.dtype  # mixed types compute in f32
    gy = _to(b, gy, dt)
    xhat = b.op("mul", b.op("sub", _to(b, x, dt), mean), rstd)
    gh = b.op("mul", gy, w[0]) if w else gy
    gx = _norm_grad_x(b, gh, xhat, rstd, list(range(axis, x.type.rank)))
    return [_to(b, gx, x.type.dtype)] + (_affine_grads(b, gy, xhat, list(range(axis))) if w else [])


@def_decomposition("batch_norm")
def _batch_norm_decomp(b, xs, attrs):
    x0 = xs[0]
    wide = xs[1].type.dtype if len(xs) > 1 else x0.type.dtype
    if wide != x0.type.dtype:  # mixed: normalise x in float32, the output rounded to x's dtype
        outs = _batch_norm_decomp(b, [_to(b, x0, wide)] + list(xs[1:]), attrs)
        return [b.op("cast", outs[0], dtype=x0.type.dtype)] + list(outs[1:])
    ax = attrs["axis"]
    x, rank, c = xs[0], xs[0].type.rank, xs[0].type.shape[ax]
    affine = attrs["affine"]
    w, bias = (xs[1], xs[2]) if affine else (None, None)
    running = xs[1 + 2 * affine:]
    axes = _bn_reduced(x.type, ax)
    if attrs["training"]:
        xc, mean, rstd, var = _moments(b, x, axes, attrs["eps"])
    else:
        xc = b.op("sub", x, _channel(b, running[0], rank, ax))
        rstd = b.op("rsqrt", b.op("add", _channel(b, running[1], rank, ax), _c(b, attrs["eps"], x)))
    y = b.op("mul", xc, rstd)
    if affine:
        y = b.op("add", b.op("mul", y, _channel(b, w, rank, ax)), _channel(b, bias, rank, ax))
    if not attrs["training"]:
        return [y]
    mean = b.op("reshape", mean, shape=(c,))
    return [y, mean, b.op("reshape", rstd, shape=(c,))] + running_update(
        b, running, mean, var, attrs["momentum"], x.type.numel // c)


@def_decomposition("batch_norm_stats")
def _batch_norm_stats_decomp(b, xs, attrs):
    x, running = xs[0], xs[1:]
    if running:  # mixed: the statistics of x in float32
        x = _to(b, x, running[0].type.dtype)
    c = x.type.shape[attrs["axis"]]
    _, mean, rstd, var = _moments(b, x, _bn_reduced(x.type, attrs["axis"]), attrs["eps"])
    mean = b.op("reshape", mean, shape=(c,))
    return [mean, b.op("reshape", rstd, shape=(c,))] + running_update(b, running, mean, var, attrs["momentum"],
                                                                         x.type.numel // c)


def running_update(b, running, mean, var, m: float, n: int):
    """(1 − m) running + m · batch statistic, the variance unbiased ([] without running statistics).
    ``var``: the biased batch variance, any shape of ``mean``'s size."""
    if not running:
        return []
    var = b.op("reshape", var, shape=mean.type.shape)
    keep = _c(b, 1.0 - m, mean)
    unbiased = b.op("mul", b.op("mul", _c(b, m, var), var), _c(b, n / max(n - 1, 1), var))
    return [b.op("add", b.op("mul", keep, running[0]), b.op("mul", _c(b, m, mean), mean)),
            b.op("add", b.op("mul", keep, running[1]), unbiased)]


@def_decomposition("batch_norm_grad")
def _batch_norm_grad_decomp(b, xs, attrs):
    gy, x, s1, s2, *w = xs
    if s1.type.dtype != x.type.dtype:  # mixed: in float32, grad_x rounded to x's dtype
        outs = _batch_norm_grad_decomp(b, [_to(b, gy, s1.type.dtype), _to(b, x, s1.type.dtype), s1, s2, *w], attrs)
        return [b.op("cast", outs[0], dtype=x.type.dtype)] + list(outs[1:])
    rank, ax = x.type.rank, attrs["axis"]
    axes = _bn_reduced(x.type, ax)
    rstd = _channel(b, s2, rank, ax)
    if not attrs["training"]:  # s2 is the running variance
        rstd = b.op("rsqrt", b.op("add", rstd, _c(b, attrs["eps"], rstd)))
    xhat = b.op("mul", b.op("sub", x, _channel(b, s1, rank, ax)), rstd)
    gh = b.op("mul", gy, _channel(b, w[0], rank, ax)) if w else gy
    gx = _norm_grad_x(b, gh, xhat, rstd, axes) if attrs["training"] else b.op("mul", gh, rstd)
    return [gx] + (_affine_grads(b, gy, xhat, axes) if w else [])
