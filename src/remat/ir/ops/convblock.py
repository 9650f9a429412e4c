"""Convolution → training batch norm → ReLU → max pool, tiled over the batch: a memory-lean
alternative for a network's stem (issue 10: per-operator algorithm choice).

``conv_bn_relu_pool(x, w, gamma, beta[, running_mean, running_var])`` is
``max_pool2d(relu(batch_norm(conv2d(x, w), gamma, beta)))`` with batch statistics, computed ``tile``
samples at a time. Batch norm's statistics cover the whole batch, so the kernel makes two passes
over the tiles: the first convolves each tile and accumulates per-channel mean and variance
(combined tile by tile, Chan et al.), the second convolves it again, normalises, applies the ReLU
and pools it into the result. Results: ``(y, mean, invstd[, new running_mean, new running_var])``,
as ``batch_norm``'s (invstd from the biased variance, the unbiased one in the running update).

Its backward is two ops. Batch norm's two sums (Σ dz, Σ dz·x̂: the gamma and beta gradients) are
needed before any tile's convolution-output gradient; ``conv_bn_relu_pool_sums(x, gy, w, gamma,
beta, mean, invstd, y) -> (ggamma, gbeta)`` reads them from the pooled output: max pooling routes
each output's gradient to one input, the maximum of its window, where the ReLU passes it when that
maximum y is positive, and there batch norm's output is y itself, so x̂ = (y - beta) / gamma and
the sums are Σ gy and Σ gy·x̂ over the positive outputs, nothing recomputed. (A channel whose gamma
is zero has no x̂ in its output: then each tile is recomputed as the reference does, from ``x``.)
``y`` dies there, before the gradient's tiles need their temporaries. ``conv_bn_relu_pool_grad(x,
gy, w, gamma, beta, mean, invstd, ggamma, gbeta) -> (gw[, gx])`` then recomputes each tile's
convolution, normalisation, ReLU and pooling (with indices) once, routes ``gy`` back through them,
forms the tile's convolution-output gradient from the sums and adds its weight gradient (and, with
``input_grad``, writes its input gradient).

Memory, as the VM counts it: the results only. The reference holds the convolution's output, the
normalised and rectified activations (input-sized at full resolution, a stem's largest tensors) and
their gradients; here the kernels' temporaries are a few tensors of one tile (measured as kernel
workspaces, ``remat.runtime.allocator``). Time: the forward convolves twice and the backward
recomputes the forward once. Values equal the reference's up to summation order (statistics and
weight gradients sum tile by tile) and rounding (x̂ from the pooled output), so the planner uses it
only as a choice it reports (``remat.plan.algorithms``). ``input_grad=false`` (the rewrite sets it
when x is a model input) gives no input gradient and no input-sized buffer for one.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from ..opdef import REQUIRED, Attr, OpDef, Sample, declare
from ..types import TensorType
from ._util import rand
from .nn import TO_NHWC, _conv_infer, _pool_infer, ints

_ATTRS = (ints("stride", (1, 1)), ints("padding", (0, 0)), ints("dilation", (1, 1)), Attr("layout", "str", "NCHW"),
          Attr("input_layout", "str", ""), Attr("eps", "float", 1e-5), ints("pool_kernel"), ints("pool_stride"),
          ints("pool_padding", (0, 0)), Attr("tile", "int", 1), Attr("input_grad", "bool", True))
_FWD_ATTRS = _ATTRS + (Attr("momentum", "float", 0.1),)
_DEFAULTS = {a.name: a.default for a in _ATTRS if a.default is not REQUIRED}


def conv_attrs(attrs) -> dict:
    """The convolution's attributes (conv2d's) of a conv_bn_relu_pool op."""
    return {"stride": tuple(attrs["stride"]), "padding": tuple(attrs["padding"]), "dilation": tuple(attrs["dilation"]),
            "groups": 1, "layout": attrs["layout"], "input_layout": attrs["input_layout"]}


def pool_attrs(attrs) -> dict:
    """The pooling's attributes (max_pool2d's) of a conv_bn_relu_pool op."""
    return {"kernel": tuple(attrs["pool_kernel"]), "stride": tuple(attrs["pool_stride"]),
            "padding": tuple(attrs["pool_padding"]), "layout": attrs["layout"]}


def _types(name: str, x: TensorType, w: TensorType, vectors: list[TensorType], names: tuple[str, ...],
           attrs) -> tuple[TensorType, TensorType]:
    """(convolution output, pooled output) types, with the operands checked (``vectors``: the
    per-channel operands, called ``names``)."""
    conv = _conv_infer([x, w], conv_attrs(attrs))
    y = _pool_infer(name)([conv], pool_attrs(attrs))
    vec = x.with_shape((w.shape[0],))
    for t, what in zip(vectors, names):
        if t != vec:
            raise TypeError(f"'{name}': {what} must be {vec} (one per output channel of {w}), got {t}")
    if attrs["tile"] < 1:
        raise TypeError(f"'{name}': tile (samples per tile) must be >= 1, got {attrs['tile']}")
    if attrs["input_grad"] and attrs["input_layout"] not in ("", attrs["layout"]):
        raise TypeError(f"'{name}': an input gradient needs the input in the op's layout {attrs['layout']!r}, "
                        f"got input_layout={attrs['input_layout']!r}")
    return conv, y


def _infer(types, attrs):
    if len(types) not in (4, 6):
        raise TypeError(f"'conv_bn_relu_pool' takes (x, w, gamma, beta[, running_mean, running_var]), "
                        f"got {len(types)} operands")
    x, w, *rest = types
    _, y = _types("conv_bn_relu_pool", x, w, rest, ("weight (gamma)", "bias (beta)", "running_mean", "running_var"),
                  attrs)
    vec = x.with_shape((w.shape[0],))
    return (y, vec, vec) + ((vec, vec) if len(rest) == 4 else ())


def _sums_infer(types, attrs):
    if len(types) != 8:
        raise TypeError(f"'conv_bn_relu_pool_sums' takes (x, grad_output, w, gamma, beta, mean, invstd, output), "
                        f"got {len(types)} operands")
    x, gy, w, *rest, out = types
    _, y = _types("conv_bn_relu_pool_sums", x, w, rest, ("weight (gamma)", "bias (beta)", "mean", "invstd"), attrs)
    for t, what in ((gy, "output gradient"), (out, "output")):
        if t != y:
            raise TypeError(f"'conv_bn_relu_pool_sums': {what} must be {y}, got {t}")
    vec = x.with_shape((w.shape[0],))
    return vec, vec


def _grad_infer(types, attrs):
    if len(types) != 9:
        raise TypeError(f"'conv_bn_relu_pool_grad' takes (x, grad_output, w, gamma, beta, mean, invstd, ggamma, "
                        f"gbeta), got {len(types)} operands")
    x, gy, w, *rest = types
    _, y = _types("conv_bn_relu_pool_grad", x, w, rest,
                  ("weight (gamma)", "bias (beta)", "mean", "invstd", "ggamma", "gbeta"), attrs)
    if gy != y:
        raise TypeError(f"'conv_bn_relu_pool_grad': output gradient must be {y}, got {gy}")
    return (w,) + ((x,) if attrs["input_grad"] else ())


def _conv_flops(x: TensorType, w: TensorType, attrs) -> tuple[float, int]:
    """(one convolution's flops, its output's elements)."""
    conv = _conv_infer([x, w], conv_attrs(attrs))
    return 2.0 * conv.numel * float(np.prod(w.shape[1:])), conv.numel


def _flops(types, results, attrs) -> float:
    f, n = _conv_flops(types[0], types[1], attrs)
    return 2 * f + 12.0 * n  # two convolutions (statistics, then output), normalisation, ReLU, pooling


def _sums_flops(types, results, attrs) -> float:
    return 4.0 * types[1].numel  # a compare, a select, a product and two sums over the pooled output


def _grad_flops(types, results, attrs) -> float:
    f, n = _conv_flops(types[0], types[2], attrs)
    return (2 + attrs["input_grad"]) * f + 20.0 * n  # a recomputed convolution, the weight (and input) gradient


def _base(r: np.random.Generator, n: int, layout: str) -> list:
    x = rand(r, n, 3, 6, 5)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(TO_NHWC))
    return [x, rand(r, 4, 3, 3, 3), rand(r, 4, low=0.5, high=1.5), rand(r, 4)]


_POOL = {"pool_kernel": (3, 3), "pool_stride": (2, 2), "pool_padding": (1, 1)}


def _samples(r: np.random.Generator) -> list[Sample]:
    return [Sample(_base(r, 3, "NCHW") + [rand(r, 4), rand(r, 4, low=0.5, high=1.5)],
                   {"padding": (1, 1), "tile": 2, "momentum": 0.2, **_POOL}),
            Sample(_base(r, 2, "NHWC"), {"padding": (1, 1), "layout": "NHWC", "tile": 1, **_POOL}),
            Sample(_base(r, 4, "NCHW"), {"stride": (2, 2), "padding": (1, 1), "tile": 3, "pool_kernel": (2, 2),
                                         "pool_stride": (2, 2), "eps": 1e-3})]


def reference_output(x, w, gamma, beta, mean, invstd, attrs) -> np.ndarray:
    """The pooled output ``y`` in NumPy (float64), as conv_bn_relu_pool_apply computes it, in the op's layout."""
    a = {**_DEFAULTS, **attrs}
    xn = x if (a["input_layout"] or a["layout"]) == "NCHW" else x.transpose(0, 3, 1, 2)
    (sh, sw), (ph, pw), (dh, dw) = a["stride"], a["padding"], a["dilation"]
    kh, kw = w.shape[2:]
    xp = np.pad(xn.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    win = np.lib.stride_tricks.sliding_window_view(xp, ((kh - 1) * dh + 1, (kw - 1) * dw + 1), axis=(2, 3))
    c = np.einsum("ncijhw,ochw->noij", win[:, :, ::sh, ::sw, ::dh, ::dw], w.astype(np.float64))
    ch = (None, slice(None), None, None)
    z = np.maximum((c - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch], 0.0)
    (qh, qw), (th, tw), (pph, ppw) = a["pool_kernel"], a["pool_stride"], a["pool_padding"]
    zp = np.pad(z, ((0, 0), (0, 0), (pph, pph), (ppw, ppw)), constant_values=-np.inf)
    y = np.lib.stride_tricks.sliding_window_view(zp, (qh, qw), axis=(2, 3))[:, :, ::th, ::tw].max(axis=(4, 5))
    return y if a["layout"] == "NCHW" else y.transpose(TO_NHWC)


def _sums_samples(r: np.random.Generator) -> list[Sample]:
    """The forward's samples with an output gradient, statistics (any mean, a positive invstd) and the
    output they give; one with a zero gamma (its sums recomputed)."""
    def sample(args, attrs):
        x, w, gamma, beta = args[:4]
        mean, invstd = rand(r, 4), rand(r, 4, low=0.5, high=1.5)
        y = reference_output(x, w, gamma, beta, mean, invstd, attrs).astype(x.dtype)
        return Sample([x, rand(r, *y.shape), w, gamma, beta, mean, invstd, y], attrs)

    out = [sample(s.args, {k: v for k, v in s.attrs.items() if k != "momentum"}) for s in _samples(r)]
    # a model input (NCHW) under an NHWC stem
    out.append(sample(_base(r, 3, "NCHW"), {"padding": (1, 1), "layout": "NHWC", "input_layout": "NCHW", "tile": 2,
                                            "input_grad": False, **_POOL}))
    x, w, gamma, beta = _base(r, 3, "NCHW")
    gamma[1] = 0.0
    out.append(sample([x, w, gamma, beta], {"padding": (1, 1), "tile": 2, **_POOL}))
    return out


def _grad_samples(r: np.random.Generator) -> list[Sample]:
    """The sums' samples with any sums in the output's place."""
    return [Sample(s.args[:7] + [rand(r, 4), rand(r, 4)], s.attrs) for s in _sums_samples(r)]


declare(OpDef("conv_bn_relu_pool", None, _FWD_ATTRS, _infer, frozenset(), num_results=-1, min_operands=4,
              flops=_flops, sample=_samples,
              doc="max_pool2d(relu(batch_norm(conv2d(x, w), gamma, beta))) with batch statistics, `tile` samples at "
                  "a time in two passes (statistics, then output): (y, mean, invstd[, new running_mean, new "
                  "running_var]); never the full-resolution activations"))
declare(OpDef("conv_bn_relu_pool_sums", 8, _ATTRS, _sums_infer, frozenset(), num_results=2, flops=_sums_flops,
              sample=_sums_samples,
              doc="(ggamma, gbeta) of conv_bn_relu_pool, batch norm's sums Σ dz·x̂ and Σ dz, from (x, grad_output, w, "
                  "gamma, beta, mean, invstd, output): read from the pooled output (x̂ = (y - beta) / gamma where "
                  "y > 0); a zero gamma: recomputed tile by tile"))
declare(OpDef("conv_bn_relu_pool_grad", 9, _ATTRS, _grad_infer, frozenset(), num_results=-1,
              flops=_grad_flops, sample=_grad_samples,
              doc="(gw[, gx]) of conv_bn_relu_pool from (x, grad_output, w, gamma, beta, mean, invstd, ggamma, gbeta): "
                  "each tile's forward recomputed once"))


# ---------------------------------------------------------------- its two passes, apart (after differentiation)
# ``remat.passes.convblock.split_conv_bn_relu_pool`` runs on every differentiated training graph: the
# forward as its statistics pass and its output pass, so that a plan recomputing y (the backward
# keeps the statistics anyway) runs the output pass alone: one convolution per tile, not two.
_STATS_ATTRS = (ints("stride", (1, 1)), ints("padding", (0, 0)), ints("dilation", (1, 1)), Attr("layout", "str", "NCHW"),
                Attr("input_layout", "str", ""), Attr("eps", "float", 1e-5), Attr("momentum", "float", 0.1),
                Attr("tile", "int", 1))


def stats_attrs(attrs) -> dict:
    """The attributes of ``conv_bn_stats`` (the statistics pass) among a conv_bn_relu_pool op's."""
    return {a.name: attrs[a.name] for a in _STATS_ATTRS if a.name in attrs}


def output_attrs(attrs) -> dict:
    """The attributes of ``conv_bn_relu_pool_apply`` (the output pass) among a conv_bn_relu_pool op's."""
    return {a.name: attrs[a.name] for a in _ATTRS if a.name in attrs}


def _stats_infer(types, attrs):
    if len(types) not in (2, 4):
        raise TypeError(f"'conv_bn_stats' takes (x, w[, running_mean, running_var]), got {len(types)} operands")
    x, w, *running = types
    _conv_infer([x, w], conv_attrs({**_DEFAULTS, **attrs}))  # checks x and w
    vec = x.with_shape((w.shape[0],))
    for t, what in zip(running, ("running_mean", "running_var")):
        if t != vec:
            raise TypeError(f"'conv_bn_stats': {what} must be {vec} (one per output channel of {w}), got {t}")
    if attrs["tile"] < 1:
        raise TypeError(f"'conv_bn_stats': tile (samples per tile) must be >= 1, got {attrs['tile']}")
    return (vec,) * (2 + len(running))


def _apply_infer(types, attrs):
    if len(types) != 6:
        raise TypeError(f"'conv_bn_relu_pool_apply' takes (x, w, gamma, beta, mean, invstd), got {len(types)} operands")
    x, w, *rest = types
    return _types("conv_bn_relu_pool_apply", x, w, rest, ("weight (gamma)", "bias (beta)", "mean", "invstd"), attrs)[1]


def _stats_flops(types, results, attrs) -> float:
    f, n = _conv_flops(types[0], types[1], {**_DEFAULTS, **attrs})
    return f + 3.0 * n


def _apply_flops(types, results, attrs) -> float:
    f, n = _conv_flops(types[0], types[1], attrs)
    return f + 9.0 * n


def _stats_samples(r: np.random.Generator) -> list[Sample]:
    keep = {"stride", "padding", "dilation", "layout", "input_layout", "eps", "momentum", "tile"}
    return [Sample(s.args[:2] + s.args[4:], {k: v for k, v in s.attrs.items() if k in keep}) for s in _samples(r)]


def _apply_samples(r: np.random.Generator) -> list[Sample]:
    return [Sample(s.args[:4] + [rand(r, 4), rand(r, 4, low=0.5, high=1.5)],
                   {k: v for k, v in s.attrs.items() if k != "momentum"}) for s in _samples(r)]


declare(OpDef("conv_bn_stats", None, _STATS_ATTRS, _stats_infer, frozenset(), num_results=-1, min_operands=2,
              nondiff=True, flops=_stats_flops, sample=_stats_samples,
              doc="conv_bn_relu_pool's statistics pass: batch norm's (mean, invstd[, new running_mean, new "
                  "running_var]) of conv2d(x, w), `tile` samples at a time (made after differentiation)"))
declare(OpDef("conv_bn_relu_pool_apply", 6, _ATTRS, _apply_infer, frozenset(), nondiff=True, flops=_apply_flops,
              sample=_apply_samples,
              doc="conv_bn_relu_pool's output pass from (x, w, gamma, beta, mean, invstd): each tile convolved, "
                  "normalised, rectified and pooled (made after differentiation)"))

# ================================================================ VJP rules (reverse mode)
from ..opdef import def_vjp  # noqa: E402
from ._vjp import Saves  # noqa: E402


@def_vjp("conv_bn_relu_pool", saves=Saves(operands=(0, 1, 2, 3), results=(0, 1, 2)))
def _conv_bn_relu_pool_vjp(b, p, g):
    g = list(g) if isinstance(g, (list, tuple)) else [g]
    if any(v is not None for v in g[1:]):
        raise NotImplementedError("only the pooled output of 'conv_bn_relu_pool' is differentiable (not its "
                                  "statistics or running statistics)")
    n = len(p.in_types)
    if g[0] is None:
        return [None] * n
    attrs = {k: v for k, v in p.attrs.items() if k != "momentum"}
    x, w, gamma, beta = p.x[:4]
    ggamma, gbeta = b.op("conv_bn_relu_pool_sums", x, g[0], w, gamma, beta, p.y[1], p.y[2], p.y[0], **attrs)
    outs = b.op("conv_bn_relu_pool_grad", x, g[0], w, gamma, beta, p.y[1], p.y[2], ggamma, gbeta, **attrs)
    gw, gx = (outs[0], outs[1]) if attrs["input_grad"] else (outs, None)
    return [gx, gw, ggamma, gbeta] + [None] * (n - 4)


def _second_order(name, b, p, g):
    raise NotImplementedError(f"second-order differentiation through conv_bn_relu_pool is not supported "
                              f"({name} has no VJP rule)")


for _name in ("conv_bn_relu_pool_sums", "conv_bn_relu_pool_grad"):
    def_vjp(_name, saves="none")(partial(_second_order, _name))
