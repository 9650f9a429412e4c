"""Reductions, matmul, softmax, convolution and pooling (with their backward ops)."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, IndexBounds, OpDef, Sample, declare
from ..types import DType, TensorType
from .elementwise import grad_pair_infer
from ._util import bcast, check_axis, expect_float, expect_same_dtype, ints, max_numel, norm_axis, per_output, rand


# ---------------------------------------------------------------- reductions
def _reduce_infer(name):
    def infer(types, attrs):
        (t,) = types
        axes = attrs["axes"]
        for a in axes:
            check_axis(name, a, t.rank, "axis")
        if len(set(axes)) != len(axes):
            raise TypeError(f"'{name}': repeated axis in {list(axes)}")
        if name == "reduce_mean":
            expect_float(name, t)
        if attrs["keepdims"]:
            shape = tuple(1 if i in axes else d for i, d in enumerate(t.shape))
        else:
            shape = tuple(d for i, d in enumerate(t.shape) if i not in axes)
        return t.with_shape(shape)

    return infer


def _reduce_norm(types, attrs):
    if not types:
        return attrs
    return {**attrs, "axes": tuple(sorted(norm_axis(a, types[0].rank) for a in attrs["axes"]))}


for _name, _doc in {"reduce_sum": "sum over axes", "reduce_mean": "mean over axes", "reduce_max": "max over axes"}.items():
    declare(OpDef(_name, 1, (ints("axes"), Attr("keepdims", "bool", False)), _reduce_infer(_name),
                  frozenset({"reduction"}), normalize=_reduce_norm, doc=_doc, flops=max_numel,
                  sample=lambda r: [Sample([rand(r, 3, 4, 5)], {"axes": (0, 2)}),
                                    Sample([rand(r, 3, 4)], {"axes": (1,), "keepdims": True}),
                                    Sample([rand(r, 6)], {"axes": (0,)})]))


# ---------------------------------------------------------------- cumulative sum
def _cumsum_infer(types, attrs):
    (t,) = types
    check_axis("cumsum", attrs["axis"], t.rank)
    if t.dtype.value == "bool":
        raise TypeError(f"'cumsum' of {t}: cast booleans to an integer dtype first")
    return t


def _cumsum_norm(types, attrs):
    return {**attrs, "axis": norm_axis(attrs["axis"], types[0].rank)} if types else attrs


declare(OpDef("cumsum", 1, (Attr("axis", "int"), Attr("reverse", "bool", False)), _cumsum_infer, frozenset(),
              normalize=_cumsum_norm, flops=lambda ins, outs, attrs: float(outs[0].numel),
              doc="inclusive running sum along an axis (from the end when reverse): position ids, causal masks",
              sample=lambda r: [Sample([rand(r, 3, 5)], {"axis": 1}), Sample([rand(r, 2, 3, 4)], {"axis": 0, "reverse": True}),
                                Sample([r.integers(0, 3, size=(2, 6))], {"axis": -1})]))


# ---------------------------------------------------------------- softmax
def _softmax_infer(name):
    def infer(types, attrs):
        (t,) = types
        expect_float(name, t)
        check_axis(name, attrs["axis"], t.rank)
        return t

    return infer


def _axis_norm(types, attrs):
    return {**attrs, "axis": norm_axis(attrs["axis"], types[0].rank)} if types else attrs


for _name in ("softmax", "log_softmax"):
    declare(OpDef(_name, 1, (Attr("axis", "int"),), _softmax_infer(_name), frozenset(), normalize=_axis_norm,
                  doc=f"{_name.replace('_', '-')} along an axis", flops=per_output(8.0),
                  sample=lambda r: [Sample([rand(r, 3, 5, low=-3, high=3)], {"axis": 1}),
                                    Sample([rand(r, 2, 3, 4)], {"axis": 0})]))


# ---------------------------------------------------------------- softmax / log-softmax backward (native kernels)
def _softmax_grad_infer(name):
    pair = grad_pair_infer(name, "output")

    def infer(types, attrs):
        y = pair(types, attrs)
        check_axis(name, attrs["axis"], y.rank)
        return y

    return infer


def _softmax_sample(log: bool):
    def sample(r):
        out = []
        for shape, axis in (((3, 5), 1), ((2, 3, 4), 0)):
            x = rand(r, *shape, low=-3, high=3)
            e = np.exp(x - x.max(axis=axis, keepdims=True))
            y = e / e.sum(axis=axis, keepdims=True)
            out.append(Sample([rand(r, *shape), np.log(y) if log else y], {"axis": axis}))
        return out

    return sample


for _name, _doc in {"softmax_grad": "gradient of softmax from (grad_output, output): y * (g - sum(g * y, axis))",
                    "log_softmax_grad": "gradient of log_softmax from (grad_output, output): g - exp(y) * sum(g, axis)"
                    }.items():
    declare(OpDef(_name, 2, (Attr("axis", "int"),), _softmax_grad_infer(_name), frozenset(), normalize=_axis_norm,
                  doc=_doc, flops=lambda ins, outs, attrs: 4.0 * outs[0].numel,
                  sample=_softmax_sample(_name.startswith("log"))))


# ---------------------------------------------------------------- negative log-likelihood (cross-entropy after log_softmax)
_REDUCTIONS = ("mean", "sum", "none")


def _nll_check(name, logp_shape, target, attrs):
    if attrs["reduction"] not in _REDUCTIONS:
        raise TypeError(f"'{name}': reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got {attrs['reduction']!r}")
    if not target.dtype.is_int or target.rank < 1:
        raise TypeError(f"'{name}' needs integer class targets [N] or [N, d1, ...] (i32 or i64), got {target}")
    if len(logp_shape) < 2 or (logp_shape[0],) + tuple(logp_shape[2:]) != target.shape:
        raise TypeError(f"'{name}': log-probabilities {list(logp_shape)} and targets {target} do not fit [N, C] and "
                        f"[N] (or [N, C, d1, ...] and [N, d1, ...])")


def _nll_infer(types, attrs):
    logp, target = types
    expect_float("nll_loss", logp)
    _nll_check("nll_loss", logp.shape, target, attrs)
    return logp.with_shape(target.shape if attrs["reduction"] == "none" else ())


def with_class_axis(shape: tuple[int, ...], c: int) -> tuple[int, ...]:
    """Targets' shape [N, d1, ...] -> the log-probabilities' [N, c, d1, ...]."""
    return shape[:1] + (c,) + shape[1:]


def _nll_grad_infer(types, attrs):
    g, target = types
    expect_float("nll_loss_grad", g)
    shape = with_class_axis(target.shape, attrs["num_classes"])
    _nll_check("nll_loss_grad", shape, target, attrs)
    want = target.shape if attrs["reduction"] == "none" else ()
    if g.shape != want:
        raise TypeError(f"'nll_loss_grad': output gradient {g} must have shape {list(want)} for reduction "
                        f"{attrs['reduction']!r}")
    if attrs["num_classes"] < 1:
        raise TypeError(f"'nll_loss_grad': num_classes must be >= 1, got {attrs['num_classes']}")
    return g.with_shape(shape)


def _targets(r, n, c, ignore, *spatial):
    t = r.integers(0, c, size=(n, *spatial))
    t.flat[1] = ignore  # one ignored row (or position) in every sample
    return t


_NLL_ATTRS = (Attr("reduction", "str", "mean"), Attr("ignore_index", "int", -100))
declare(OpDef("nll_loss", 2, _NLL_ATTRS, _nll_infer, frozenset({"autocast_f32"}),
              index_bounds=lambda types, attrs: IndexBounds(1, types[0].shape[1], attrs["ignore_index"]),
              flops=lambda ins, outs, attrs: float(ins[1].numel),
              doc="-logp[n, target[n]] reduced over rows whose target is not ignore_index (mean: divided by "
                  "their count); targets out of [0, C) are an error. Log-probabilities [N, C, d1, ...] and targets "
                  "[N, d1, ...]: one class per position (PyTorch's nll_loss2d), reduced over all of them",
              sample=lambda r: [Sample([rand(r, 4, 5, low=-3, high=0), _targets(r, 4, 5, -100)]),
                                Sample([rand(r, 3, 6, low=-3, high=0), _targets(r, 3, 6, 2)],
                                       {"reduction": "sum", "ignore_index": 2}),
                                Sample([rand(r, 5, 3, low=-3, high=0), _targets(r, 5, 3, -1)],
                                       {"reduction": "none", "ignore_index": -1}),
                                # an image's classes per pixel ([N, C, H, W], PyTorch's nll_loss2d)
                                Sample([rand(r, 2, 3, 4, 5, low=-3, high=0), _targets(r, 2, 3, -100, 4, 5)]),
                                Sample([rand(r, 2, 4, 3, low=-3, high=0), _targets(r, 2, 4, -1, 3)],
                                       {"reduction": "none", "ignore_index": -1})]))
declare(OpDef("nll_loss_grad", 2, (Attr("num_classes", "int"),) + _NLL_ATTRS, _nll_grad_infer, frozenset(),
              index_bounds=lambda types, attrs: IndexBounds(1, attrs["num_classes"], attrs["ignore_index"]),
              flops=lambda ins, outs, attrs: float(outs[0].numel),
              doc="gradient of nll_loss wrt the log-probabilities [N, num_classes, d1, ...], from (grad_output, target)",
              sample=lambda r: [Sample([rand(r), _targets(r, 4, 5, -100)], {"num_classes": 5}),
                                Sample([rand(r), _targets(r, 3, 6, 2)],
                                       {"num_classes": 6, "reduction": "sum", "ignore_index": 2}),
                                Sample([rand(r, 5), _targets(r, 5, 3, -1)],
                                       {"num_classes": 3, "reduction": "none", "ignore_index": -1}),
                                Sample([rand(r), _targets(r, 2, 3, -100, 4, 5)], {"num_classes": 3}),
                                Sample([rand(r, 2, 3), _targets(r, 2, 4, -1, 3)],
                                       {"num_classes": 4, "reduction": "none", "ignore_index": -1})]))


# ---------------------------------------------------------------- matmul
def _mat_dims(t: TensorType, transposed: bool) -> tuple[int, int]:
    """(rows, cols) of an operand's matrix after its optional transpose of the last two dims."""
    r, c = t.shape[-2:]
    return (c, r) if transposed else (r, c)


def _matmul_infer(types, attrs):
    a, b = types
    dt = expect_same_dtype("matmul", types)
    if a.rank < 2 or b.rank < 2:
        raise TypeError(f"'matmul' needs operands of rank >= 2, got {a} and {b}; reshape vectors to [1,n] or [n,1]")
    (m, ka), (kb, n) = _mat_dims(a, attrs["transpose_a"]), _mat_dims(b, attrs["transpose_b"])
    if ka != kb:
        flags = "".join(f" ({w} transposed)" for w, f in (("a", attrs["transpose_a"]), ("b", attrs["transpose_b"])) if f)
        raise TypeError(f"'matmul': contraction mismatch, {a} @ {b}{flags} ({ka} != {kb})")
    batch = bcast("matmul", [TensorType(dt, a.shape[:-2]), TensorType(dt, b.shape[:-2])])
    return TensorType(dt, batch + (m, n))


def _matmul_flops(ins, outs, attrs):
    """2·m·n·k per product: every result element is a k-long dot product."""
    k = _mat_dims(ins[0], attrs["transpose_a"])[1]
    return 2.0 * outs[0].numel * k


declare(OpDef("matmul", 2, (Attr("transpose_a", "bool", False), Attr("transpose_b", "bool", False)), _matmul_infer,
              frozenset({"matmul", "autocast_low"}), flops=_matmul_flops,
              doc="batched matrix product a[..., m, k] @ b[..., k, n] with broadcast batch dims; transpose_a / "
                  "transpose_b swap that operand's last two dims first (a view, never a copy)",
              sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 4, 2)]), Sample([rand(r, 2, 3, 4), rand(r, 4, 5)]),
                                Sample([rand(r, 2, 1, 3, 4), rand(r, 3, 4, 2)]),
                                Sample([rand(r, 4, 3), rand(r, 2, 4)], {"transpose_a": True, "transpose_b": True}),
                                Sample([rand(r, 2, 3, 4), rand(r, 5, 4)], {"transpose_b": True}),
                                Sample([rand(r, 4, 3), rand(r, 2, 4, 5)], {"transpose_a": True}),
                                Sample([rand(r, 2, 4, 3), rand(r, 2, 5, 4)], {"transpose_a": True, "transpose_b": True})]))


# ---------------------------------------------------------------- linear (matmul + bias, one native kernel)
def _linear_infer(types, attrs):
    x, w, bias = types
    dt = expect_same_dtype("linear", types)
    expect_float("linear", x)
    if x.rank < 1 or w.rank != 2 or bias.rank != 1:
        raise TypeError(f"'linear' needs x [..., in], weight [out, in] and bias [out], got {x}, {w} and {bias}")
    if x.shape[-1] != w.shape[1] or bias.shape[0] != w.shape[0]:
        raise TypeError(f"'linear': x {x}, weight {w} and bias {bias} do not fit x [..., in], weight [out, in], bias [out]")
    return TensorType(dt, x.shape[:-1] + (w.shape[0],))


declare(OpDef("linear", 3, (), _linear_infer, frozenset({"matmul", "autocast_low"}),
              flops=lambda ins, outs, attrs: 2.0 * outs[0].numel * ins[1].shape[1] + outs[0].numel,
              doc="x @ weight^T + bias, x [..., in], weight [out, in], bias [out] (PyTorch's linear / addmm)",
              sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 5, 4), rand(r, 5)]),
                                Sample([rand(r, 2, 3, 4), rand(r, 2, 4), rand(r, 2)])]))


# ---------------------------------------------------------------- layouts of image tensors
LAYOUTS = ("NCHW", "NHWC")
"""How a convolution or pooling op stores its [N, C, H, W] tensors: ``NCHW`` (PyTorch's default) or
``NHWC`` (channels last: the shape is [N, H, W, C]; ``remat.passes.layout`` chooses it). Weights stay
OIHW either way."""
TO_NHWC = (0, 2, 3, 1)
"""``transpose`` perm from NCHW to NHWC (physical axis p holds logical axis TO_NHWC[p])."""
TO_NCHW = (0, 3, 1, 2)
"""``transpose`` perm from NHWC back to NCHW."""
_LAYOUT = Attr("layout", "str", "NCHW")
WEIGHT_LAYOUTS = ("OIHW", "OHWI")
"""How a convolution stores its weight (and a weight gradient): ``OIHW`` (PyTorch's) or ``OHWI``
(the weight's channels last: the shape is [O, kH, kW, I], the bytes of a PyTorch weight in
``torch.channels_last`` memory format; ``remat.passes.layout`` chooses it for the weights of NHWC
convolutions, so that oneDNN reads them without a copy)."""
TO_OHWI, TO_OIHW = TO_NHWC, TO_NCHW  # the same moves of axis 1
_WEIGHT_LAYOUT = Attr("weight_layout", "str", "OIHW")
_INPUT_LAYOUT = Attr("input_layout", "str", "")
"""conv2d / conv2d_weight_grad: the layout of the input x when it differs from ``layout`` ("": the
same). An NHWC convolution of a model's NCHW input reads it as it is (ATen converts it on the fly),
so the step does not keep a transposed copy of the input for the weight gradient."""


def _x_attrs(attrs) -> dict:
    """``attrs`` with the input's layout as ``layout`` (for checking the input x)."""
    return {**attrs, "layout": attrs.get("input_layout") or attrs.get("layout", "NCHW")}


LAYOUT_OPERANDS: dict[str, tuple[tuple[int, ...], tuple[int, ...], str | None]] = {
    "conv2d": ((0,), (0,), None),
    "conv2d_input_grad": ((0,), (0,), "input_shape"),
    "conv2d_weight_grad": ((0, 1), (), None),
    "conv2d_grads": ((0, 1), (0,), None),
    "max_pool2d": ((0,), (0,), None),
    "avg_pool2d": ((0,), (0,), None),
    "max_pool2d_with_indices": ((0,), (0, 1), None),
    "max_pool2d_grad": ((0, 1), (0,), None),
    "max_pool2d_index_grad": ((0, 1), (0,), "input_shape"),
    "avg_pool2d_grad": ((0,), (0,), "input_shape"),
    "upsample_bilinear2d": ((0,), (0,), None),  # remat.ir.ops.resize
    "upsample_bilinear2d_grad": ((0,), (0,), "input_shape"),
}
"""What ``layout`` changes of each op that has it: (its activation operands, its activation results,
its activation-shaped attribute). Weights and weight gradients are changed by ``weight_layout``
(``WEIGHT_OPERANDS``). Read by the layout pass, the dialects' kernel wrappers and the decompositions."""

WEIGHT_OPERANDS: dict[str, tuple[int | None, int | None, str | None]] = {
    "conv2d": (1, None, None),
    "conv2d_input_grad": (1, None, None),
    "conv2d_weight_grad": (None, 0, "weight_shape"),
    "conv2d_grads": (2, 1, None),
}
"""What ``weight_layout`` changes of each op that has it: (its weight operand, its weight-gradient
result, its weight-shaped attribute)."""


def nchw(name: str, t: TensorType, attrs) -> tuple[int, ...]:
    """The [N, C, H, W] shape of ``t`` stored in ``attrs['layout']`` (checked: rank 4, a known layout)."""
    layout = attrs.get("layout", "NCHW")
    if layout not in LAYOUTS:
        raise TypeError(f"'{name}': layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if t.rank != 4:
        raise TypeError(f"'{name}' needs an input [N,C,H,W] ({layout}), got {t}")
    return t.shape if layout == "NCHW" else tuple(t.shape[i] for i in TO_NCHW)


def stored(shape: tuple[int, ...], attrs) -> tuple[int, ...]:
    """An [N, C, H, W] shape as ``attrs['layout']`` stores it."""
    return tuple(shape) if attrs.get("layout", "NCHW") == "NCHW" else tuple(shape[i] for i in TO_NHWC)


def nhwc_sample(s: Sample, acts: tuple[int, ...], shape_attr: str | None = None) -> Sample:
    """A sample of an NCHW op as its NHWC twin: the activation operands ``acts`` transposed and the
    shape attribute ``shape_attr`` (an activation's shape) permuted."""
    args = [np.ascontiguousarray(a.transpose(TO_NHWC)) if i in acts else a for i, a in enumerate(s.args)]
    attrs = {**s.attrs, "layout": "NHWC"}
    if shape_attr is not None:
        attrs[shape_attr] = tuple(s.attrs[shape_attr][i] for i in TO_NHWC)
    return Sample(args, attrs)


def ohwi_sample(s: Sample, op: str) -> Sample:
    """A sample of a convolution op as its twin with an OHWI weight (``weight_layout``)."""
    w, _, shape_attr = WEIGHT_OPERANDS[op]
    args = [np.ascontiguousarray(a.transpose(TO_OHWI)) if i == w else a for i, a in enumerate(s.args)]
    attrs = {**s.attrs, "weight_layout": "OHWI"}
    if shape_attr is not None:
        attrs[shape_attr] = tuple(s.attrs[shape_attr][i] for i in TO_OHWI)
    return Sample(args, attrs)


def with_nhwc(samples, acts: tuple[int, ...], shape_attr: str | None = None, weights: str | None = None):
    """``samples`` (a sample function) plus the NHWC twin of its first sample; with ``weights`` (a
    convolution op's name) also the OHWI-weight twins of that NHWC twin and of the first sample."""
    def sample(r):
        ss = samples(r)
        twin = nhwc_sample(ss[0], acts, shape_attr)
        return ss + [twin] + ([ohwi_sample(twin, weights), ohwi_sample(ss[0], weights)] if weights else [])
    return sample


# ---------------------------------------------------------------- convolution (NCHW or NHWC; OIHW or OHWI)
_CONV_ATTRS = (ints("stride", (1, 1)), ints("padding", (0, 0)), ints("dilation", (1, 1)), Attr("groups", "int", 1),
               _LAYOUT, _WEIGHT_LAYOUT)


def oihw(name: str, w: TensorType, attrs) -> tuple[int, ...]:
    """The [O, I, kH, kW] shape of the weight ``w`` stored in ``attrs['weight_layout']`` (checked)."""
    wl = attrs.get("weight_layout", "OIHW")
    if wl not in WEIGHT_LAYOUTS:
        raise TypeError(f"'{name}': weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, got {wl!r}")
    return w.shape if wl == "OIHW" or w.rank != 4 else tuple(w.shape[i] for i in TO_OIHW)


def _pair(name, attrs, key):
    v = attrs[key]
    if len(v) != 2:
        raise TypeError(f"'{name}': {key} needs 2 entries (height, width), got {list(v)}")
    return v


def conv_out_hw(name, hw, k, attrs):
    """Output spatial size of a convolution/pooling window; raises if empty."""
    s, p = _pair(name, attrs, "stride"), _pair(name, attrs, "padding")
    d = _pair(name, attrs, "dilation") if "dilation" in attrs else (1, 1)
    if min(s) < 1 or min(p) < 0 or min(d) < 1:
        raise TypeError(f"'{name}': stride and dilation must be >= 1 and padding >= 0, got {attrs}")
    out = tuple((hw[i] + 2 * p[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(2))
    if min(out) < 1:
        raise TypeError(f"'{name}': window {list(k)} does not fit input {list(hw)} with padding {list(p)}")
    return out


def _conv_check(x, w, attrs):
    expect_same_dtype("conv2d", [x, w])
    expect_float("conv2d", x)
    if x.rank != 4 or w.rank != 4:
        raise TypeError(f"'conv2d' needs input [N,C,H,W] ({attrs.get('layout', 'NCHW')}) and weight "
                        f"[O,C/groups,kH,kW], got {x} and {w}")
    xs = nchw("conv2d", x, _x_attrs(attrs))
    ws = oihw("conv2d", w, attrs)
    g = attrs["groups"]
    if g < 1 or xs[1] % g or ws[0] % g or ws[1] * g != xs[1]:
        raise TypeError(f"'conv2d': {xs[1]} input channels and weight {w} ({attrs.get('weight_layout', 'OIHW')}) "
                        f"do not fit groups={g}")
    return conv_out_hw("conv2d", xs[2:], ws[2:], attrs)


def _conv_infer(types, attrs):
    x, w = types
    oh, ow = _conv_check(x, w, attrs)
    return x.with_shape(stored((x.shape[0], w.shape[0], oh, ow), attrs))


def _conv_flops(ins, outs, attrs):
    return 2.0 * outs[0].numel * _prod(ins[1].shape[1:])  # O*I*kH*kW / O: the same in either weight layout


declare(OpDef("conv2d", 2, _CONV_ATTRS + (_INPUT_LAYOUT,), _conv_infer, frozenset({"conv", "autocast_low"}),
              doc="2-d cross-correlation, NCHW (or NHWC: layout) input, OIHW (or OHWI: weight_layout) weight", flops=_conv_flops,
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 3, 6, 6), rand(r, 4, 3, 3, 3)], {"padding": (1, 1)}),
                  Sample([rand(r, 1, 4, 7, 5), rand(r, 4, 2, 3, 2)], {"stride": (2, 1), "groups": 2}),
                  Sample([rand(r, 1, 2, 7, 7), rand(r, 3, 2, 3, 3)], {"dilation": (2, 2), "padding": (2, 1)}),
                  Sample([rand(r, 2, 3, 6, 5), rand(r, 4, 3, 3, 3)],
                         {"padding": (1, 1), "layout": "NHWC", "input_layout": "NCHW"})], (0,), weights="conv2d")))


def _conv_in_grad_infer(types, attrs):
    gy, w = types
    x = TensorType(gy.dtype, attrs["input_shape"])
    want = _conv_infer([x, w], attrs)
    if want != gy:
        raise TypeError(f"'conv2d_input_grad': output gradient {gy} does not match conv2d output {want} of input {x}")
    return x


def _conv_w_grad_infer(types, attrs):
    x, gy = types
    w = TensorType(x.dtype, attrs["weight_shape"])
    want = _conv_infer([x, w], attrs)
    if want != gy:
        raise TypeError(f"'conv2d_weight_grad': output gradient {gy} does not match conv2d output {want} of weight {w}")
    return w


declare(OpDef("conv2d_input_grad", 2, (ints("input_shape"),) + _CONV_ATTRS, _conv_in_grad_infer, frozenset({"conv", "autocast_low"}),
              doc="gradient of conv2d wrt its input, from (grad_output, weight)",
              flops=lambda ins, outs, attrs: 2.0 * ins[0].numel * _prod(ins[1].shape[1:]),
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 4, 6, 6), rand(r, 4, 3, 3, 3)], {"input_shape": (2, 3, 6, 6), "padding": (1, 1)}),
                  Sample([rand(r, 1, 4, 3, 4), rand(r, 4, 2, 3, 2)], {"input_shape": (1, 4, 7, 5), "stride": (2, 1),
                                                                      "groups": 2}),
                  # input sizes a strided convolution maps to the same output: the kernels' output padding
                  Sample([rand(r, 2, 4, 3, 3), rand(r, 4, 3, 3, 3)], {"input_shape": (2, 3, 6, 6), "stride": (2, 2),
                                                                      "padding": (1, 1)}),
                  Sample([rand(r, 1, 2, 4, 4), rand(r, 2, 2, 3, 3)], {"input_shape": (1, 2, 8, 8), "stride": (2, 2),
                                                                      "padding": (2, 2), "dilation": (2, 2)})],
                  (0,), "input_shape", weights="conv2d_input_grad")))
declare(OpDef("conv2d_weight_grad", 2, (ints("weight_shape"),) + _CONV_ATTRS + (_INPUT_LAYOUT,), _conv_w_grad_infer, frozenset({"conv"}),
              doc="gradient of conv2d wrt its weight, from (input, grad_output)",
              flops=lambda ins, outs, attrs: 2.0 * ins[1].numel * _prod(outs[0].shape[1:]),
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 3, 6, 6), rand(r, 2, 4, 6, 6)], {"weight_shape": (4, 3, 3, 3), "padding": (1, 1)}),
                  Sample([rand(r, 1, 4, 7, 5), rand(r, 1, 4, 3, 4)], {"weight_shape": (4, 2, 3, 2), "stride": (2, 1),
                                                                      "groups": 2}),
                  Sample([rand(r, 2, 3, 6, 5), rand(r, 2, 6, 5, 4)], {"weight_shape": (4, 3, 3, 3), "padding": (1, 1),
                                                                      "layout": "NHWC", "input_layout": "NCHW"})],
                  (0, 1), weights="conv2d_weight_grad")))



def _conv_grads_infer(types, attrs):
    gy, x, w = types
    want = _conv_infer([x, w], attrs)
    if want != gy:
        raise TypeError(f"'conv2d_grads': output gradient {gy} does not match conv2d output {want} of input {x} "
                        f"and weight {w}")
    return (x, w)


declare(OpDef("conv2d_grads", 3, _CONV_ATTRS, _conv_grads_infer, frozenset({"conv"}), num_results=2,
              doc="conv2d_input_grad(gy, w) and conv2d_weight_grad(x, gy) in one kernel call, from (grad_output, "
                  "input, weight): ATen's convolution_backward prepares grad_output once for both. Made by "
                  "lowering (remat.lower.siblings), never by differentiation",
              flops=lambda ins, outs, attrs: 2.0 * ins[0].numel * (_prod(ins[2].shape[1:]) + _prod(outs[1].shape[1:])),
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 4, 6, 6), rand(r, 2, 3, 6, 6), rand(r, 4, 3, 3, 3)], {"padding": (1, 1)}),
                  Sample([rand(r, 1, 4, 3, 4), rand(r, 1, 4, 7, 5), rand(r, 4, 2, 3, 2)],
                         {"stride": (2, 1), "groups": 2})], (0, 1), weights="conv2d_grads")))

# ---------------------------------------------------------------- pooling (NCHW or NHWC)
_POOL_ATTRS = (ints("kernel"), ints("stride", ()), ints("padding", (0, 0)), _LAYOUT)


def _pool_norm(types, attrs):
    if not attrs["stride"]:
        attrs = {**attrs, "stride": attrs["kernel"]}
    return attrs


def _pool_infer(name):
    def infer(types, attrs):
        x = types[0]
        expect_float(name, x)
        xs = nchw(name, x, attrs)
        k = _pair(name, attrs, "kernel")
        if any(2 * p > kk for p, kk in zip(attrs["padding"], k)):
            raise TypeError(f"'{name}': padding {list(attrs['padding'])} must be at most half the kernel {list(k)}")
        oh, ow = conv_out_hw(name, xs[2:], k, attrs)
        return x.with_shape(stored(xs[:2] + (oh, ow), attrs))

    return infer


def _pool_flops(ins, outs, attrs):
    return float(max(outs[0].numel, ins[0].numel) * _prod(attrs["kernel"]))


_POOL_SAMPLES = with_nhwc(lambda r: [Sample([rand(r, 2, 3, 6, 6)], {"kernel": (2, 2)}),
                                    Sample([rand(r, 1, 2, 7, 5)], {"kernel": (3, 3), "stride": (2, 2),
                                                                   "padding": (1, 1)})], (0,))
declare(OpDef("max_pool2d", 1, _POOL_ATTRS, _pool_infer("max_pool2d"), frozenset(), normalize=_pool_norm,
              doc="max over windows (padding never wins)", sample=_POOL_SAMPLES, flops=_pool_flops))
declare(OpDef("avg_pool2d", 1, _POOL_ATTRS, _pool_infer("avg_pool2d"), frozenset(), normalize=_pool_norm,
              doc="mean over windows, padding counted as zeros", sample=_POOL_SAMPLES,
              flops=_pool_flops))


def _max_pool_idx_infer(types, attrs):
    y = _pool_infer("max_pool2d_with_indices")(types, attrs)
    if attrs["index_dtype"] not in (DType.i32, DType.i64):
        raise TypeError(f"'max_pool2d_with_indices': index_dtype must be i32 or i64, got {attrs['index_dtype'].value}")
    return (y, TensorType(attrs["index_dtype"], y.shape))


def _max_pool_index_grad_infer(types, attrs):
    gy, idx = types
    x = TensorType(gy.dtype, attrs["input_shape"])
    want = _pool_infer("max_pool2d_index_grad")([x], attrs)
    if gy != want:
        raise TypeError(f"'max_pool2d_index_grad': output gradient {gy} does not match pooled output {want}")
    if idx.dtype not in (DType.i32, DType.i64) or idx.shape != want.shape:
        raise TypeError(f"'max_pool2d_index_grad': indices must be i32{list(want.shape)} or i64{list(want.shape)}, "
                        f"got {idx}")
    return x


def _idx_samples(r):
    ss = _POOL_SAMPLES(r)
    return ss + [Sample(ss[1].args, {**ss[1].attrs, "index_dtype": DType.i32}),
                 nhwc_sample(Sample(ss[1].args, {**ss[1].attrs, "index_dtype": DType.i32}), (0,))]


declare(OpDef("max_pool2d_with_indices", 1, _POOL_ATTRS + (Attr("index_dtype", "dtype", DType.i64),),
              _max_pool_idx_infer, frozenset(), num_results=2, normalize=_pool_norm, flops=_pool_flops,
              doc="max_pool2d, and per window the flat index (into the input's H*W plane) of its first maximum "
                  "(ATen max_pool2d_with_indices; i64 like ATen, or i32 at half the bytes when the model never "
                  "reads them); its backward keeps only the indices",
              sample=_idx_samples))


def _index_grad_samples(r):
    """Gradients and, per window, the flat index of a random position inside the window and the input."""
    out = []
    for shape, attrs in (((2, 3, 6, 6), {"kernel": (2, 2)}),
                         ((1, 2, 7, 5), {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1)})):
        (kh, kw), (sh, sw) = attrs["kernel"], attrs.get("stride", attrs["kernel"])
        ph, pw = attrs.get("padding", (0, 0))
        n, c, h, w = shape
        oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
        rows = np.clip(np.arange(oh)[:, None] * sh - ph + r.integers(0, kh, (n, c, oh, ow)), 0, h - 1)
        cols = np.clip(np.arange(ow)[None, :] * sw - pw + r.integers(0, kw, (n, c, oh, ow)), 0, w - 1)
        idx_dtype = np.int64 if not out else np.int32  # both index widths are accepted
        out.append(Sample([rand(r, n, c, oh, ow), (rows * w + cols).astype(idx_dtype)], {**attrs, "input_shape": shape}))
    return out + [nhwc_sample(out[1], (0, 1), "input_shape")]


declare(OpDef("max_pool2d_index_grad", 2, (ints("input_shape"),) + _POOL_ATTRS, _max_pool_index_grad_infer,
              frozenset(), normalize=_pool_norm, flops=lambda ins, outs, attrs: float(outs[0].numel),
              doc="gradient of max_pool2d_with_indices from (grad_output, indices): each window's gradient added "
                  "at its index, zeros elsewhere (ATen max_pool2d_with_indices_backward)",
              sample=_index_grad_samples))


def _max_pool_grad_infer(types, attrs):
    x, gy = types
    want = _pool_infer("max_pool2d_grad")([x], attrs)
    if gy != want:
        raise TypeError(f"'max_pool2d_grad': output gradient {gy} does not match pooled output {want}")
    return x


def _avg_pool_grad_infer(types, attrs):
    (gy,) = types
    x = TensorType(gy.dtype, attrs["input_shape"])
    want = _pool_infer("avg_pool2d_grad")([x], attrs)
    if gy != want:
        raise TypeError(f"'avg_pool2d_grad': output gradient {gy} does not match pooled output {want}")
    return x


declare(OpDef("max_pool2d_grad", 2, _POOL_ATTRS, _max_pool_grad_infer, frozenset(), normalize=_pool_norm,
              doc="gradient of max_pool2d from (input, grad_output): routed to the first maximum of each window",
              flops=_pool_flops,
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 3, 6, 6), rand(r, 2, 3, 3, 3)], {"kernel": (2, 2)}),
                  Sample([rand(r, 1, 2, 7, 5), rand(r, 1, 2, 4, 3)], {"kernel": (3, 3), "stride": (2, 2),
                                                                      "padding": (1, 1)})], (0, 1))))
declare(OpDef("avg_pool2d_grad", 1, (ints("input_shape"),) + _POOL_ATTRS, _avg_pool_grad_infer, frozenset(),
              normalize=_pool_norm, doc="gradient of avg_pool2d from grad_output", flops=_pool_flops,
              sample=with_nhwc(lambda r: [
                  Sample([rand(r, 2, 3, 3, 3)], {"kernel": (2, 2), "input_shape": (2, 3, 6, 6)}),
                  Sample([rand(r, 1, 2, 4, 3)], {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1),
                                                 "input_shape": (1, 2, 7, 5)})], (0,), "input_shape")))


# ================================================================ VJP rules (reverse mode)
# rule(b, p, g) -> one cotangent per operand; see remat.ir.ops._vjp.
from math import prod as _prod  # noqa: E402

from ..opdef import def_vjp  # noqa: E402
from ._vjp import Saves, const as _const, def_vjp_variant, expand_to as _expand, scalar_like as _c, unbroadcast as _unb  # noqa: E402

CONV_KEYS = ("stride", "padding", "dilation", "groups", "layout", "weight_layout")
_POOL_KEYS = ("kernel", "stride", "padding", "layout")


def _keepdims_shape(p):
    axes = p.attrs["axes"]
    return tuple(1 if i in axes else d for i, d in enumerate(p.in_types[0].shape))


def _to_keepdims(b, p, g):
    """Reshape a reduction's cotangent so it broadcasts against the input (skipped when it already does)."""
    keep = _keepdims_shape(p)
    lead = len(keep) - g.type.rank
    if keep[lead:] == g.type.shape and all(d == 1 for d in keep[:lead]):
        return g
    return b.op("reshape", g, shape=keep)


@def_vjp("reduce_sum", saves="none")
def _reduce_sum_vjp(b, p, g):
    return [_expand(b, _to_keepdims(b, p, g), p.in_types[0].shape)]


@def_vjp("reduce_mean", saves="none")
def _reduce_mean_vjp(b, p, g):
    n = _prod(p.in_types[0].shape[a] for a in p.attrs["axes"])
    g = b.op("mul", g, _c(b, 1.0 / n, g))
    return [_expand(b, _to_keepdims(b, p, g), p.in_types[0].shape)]


@def_vjp("reduce_max", saves="inputs")
def _reduce_max_vjp(b, p, g):
    # The cotangent is shared evenly between tied maxima; the max is recomputed from the input.
    x = p.x[0]
    ymax = b.op("reduce_max", x, axes=p.attrs["axes"], keepdims=True)
    mask = b.op("eq", x, ymax)
    cnt = b.op("reduce_sum", b.op("cast", mask, dtype=g.type.dtype), axes=p.attrs["axes"], keepdims=True)
    share = b.op("div", _to_keepdims(b, p, g), cnt)
    return [b.op("select", mask, _expand(b, share, p.in_types[0].shape), _c(b, 0, g))]


def _softmax_from_y(b, p, g, y):
    return [b.op("softmax_grad", g, y, axis=p.attrs["axis"])]


def _log_softmax_from_y(b, p, g, y):
    return [b.op("log_softmax_grad", g, y, axis=p.attrs["axis"])]


@def_vjp("softmax", saves="outputs")
def _softmax_vjp(b, p, g):
    return _softmax_from_y(b, p, g, p.y[0])


@def_vjp_variant("softmax", "inputs", saves="inputs")
def _softmax_vjp_in(b, p, g):
    return _softmax_from_y(b, p, g, b.op("softmax", p.x[0], axis=p.attrs["axis"]))


@def_vjp("log_softmax", saves="outputs")
def _log_softmax_vjp(b, p, g):
    return _log_softmax_from_y(b, p, g, p.y[0])


@def_vjp_variant("log_softmax", "inputs", saves="inputs")
def _log_softmax_vjp_in(b, p, g):
    return _log_softmax_from_y(b, p, g, b.op("log_softmax", p.x[0], axis=p.attrs["axis"]))


@def_vjp("softmax_grad", saves="inputs")
def _softmax_grad_vjp(b, p, g):
    # r = y*(gy - s), s = sum(gy*y). Linear and self-adjoint in gy: d gy = softmax_grad(u, y).
    # In y: dr = dy*(gy - s) - y*sum(gy*dy), so d y = u*(gy - s) - gy*sum(u*y).
    gy, y = p.x
    ax = [p.attrs["axis"]]
    s = b.op("reduce_sum", b.op("mul", gy, y), axes=ax, keepdims=True)
    su = b.op("reduce_sum", b.op("mul", g, y), axes=ax, keepdims=True)
    dy = b.op("sub", b.op("mul", g, b.op("sub", gy, s)), b.op("mul", gy, su))
    return [b.op("softmax_grad", g, y, axis=ax[0]), dy]


@def_vjp("log_softmax_grad", saves="inputs")
def _log_softmax_grad_vjp(b, p, g):
    # r = gy - exp(y)*sum(gy): d gy = u - sum(u*exp(y)); d y = -u*exp(y)*sum(gy).
    gy, y = p.x
    ax = [p.attrs["axis"]]
    e = b.op("exp", y)
    dgy = b.op("sub", g, b.op("reduce_sum", b.op("mul", g, e), axes=ax, keepdims=True))
    dy = b.op("neg", b.op("mul", b.op("mul", g, e), b.op("reduce_sum", gy, axes=ax, keepdims=True)))
    return [dgy, dy]


@def_vjp("nll_loss", saves=(1,))
def _nll_loss_vjp(b, p, g):
    a = p.attrs
    return [b.op("nll_loss_grad", g, p.x[1], num_classes=p.in_types[0].shape[1], reduction=a["reduction"],
                 ignore_index=a["ignore_index"]), None]


@def_vjp("nll_loss_grad", saves=(1,))
def _nll_loss_grad_vjp(b, p, g):
    # nll_loss_grad is linear in its output gradient, and its transpose is nll_loss itself:
    # <u, nll_loss_grad(gy)> = <gy, nll_loss(u)> for every reduction.
    a = p.attrs
    return [b.op("nll_loss", g, p.x[1], reduction=a["reduction"], ignore_index=a["ignore_index"]), None]


def _flat_rows(b, v):
    """``v`` [..., r, c] as a 2-D [(...)*r, c] view (a reshape, free in the IR)."""
    t = v.type
    return v if t.rank == 2 else b.op("reshape", v, shape=(_prod(t.shape[:-1]), t.shape[-1]))


def _matmul_grads(b, x, w, g, ta: bool, tb: bool, x_type, w_type):
    """Cotangents of C = op(X) @ op(W) (op: optional swap of the last two dims), as flagged matmuls.

    Never a materialised transpose. When a batched operand multiplies a 2-D one with rows on its
    leading axes (activation @ weight), the 2-D operand's cotangent is one 2-D product over the
    flattened batch, as PyTorch's mm-based backward of linear, instead of a batched product
    followed by a sum.
    """
    def mm(a_, b_, ta_=False, tb_=False):
        return b.op("matmul", a_, b_, transpose_a=ta_, transpose_b=tb_)

    def grad_x():
        return _unb(b, mm(w, g, tb, True) if ta else mm(g, w, False, not tb), x_type.shape)

    def grad_w():
        if w_type.rank == 2 and x_type.rank > 2 and not ta:
            gf, xf = _flat_rows(b, g), _flat_rows(b, x)
            return mm(gf, xf, True, False) if tb else mm(xf, gf, True, False)
        return _unb(b, mm(g, x, True, ta) if tb else mm(x, g, not ta, False), w_type.shape)

    # d op(X) = G @ op(W)^T and d op(W) = op(X)^T @ G; a transposed operand's cotangent is transposed back.
    # The smaller cotangent (usually the weight's) is emitted first: the operands it reads are then
    # needed (or recomputed) before the larger one occupies memory, which lowers the peak of
    # rematerialised plans (a recomputed activation no longer coexists with the input cotangent).
    if w_type.numel <= x_type.numel:
        gw = grad_w()
        return [grad_x(), gw]
    gx = grad_x()
    return [gx, grad_w()]


@def_vjp("cumsum", saves="none")
def _cumsum_vjp(b, p, g):
    # y_i = sum_{j <= i} x_j, so dx_j = sum_{i >= j} g_i: the running sum from the other end.
    return [b.op("cumsum", g, axis=p.attrs["axis"], reverse=not p.attrs["reverse"])]


@def_vjp("matmul", saves="inputs")
def _matmul_vjp(b, p, g):
    x, w = p.x
    return _matmul_grads(b, x, w, g, p.attrs["transpose_a"], p.attrs["transpose_b"], p.in_types[0], p.in_types[1])


@def_vjp("linear", saves=(0, 1))
def _linear_vjp(b, p, g):
    # y = x @ w^T + b: the matmul's cotangents (w's as one 2-D product) and the bias's row sum.
    x, w = p.x[0], p.x[1]
    xt, wt, bt = p.in_types
    if xt.rank == 1:  # a vector input: treat it as one row
        gx, gw = _matmul_grads(b, b.op("reshape", x, shape=(1, xt.shape[0])), w,
                               b.op("reshape", g, shape=(1, wt.shape[0])), False, True,
                               TensorType(xt.dtype, (1, xt.shape[0])), wt)
        return [b.op("reshape", gx, shape=xt.shape), gw, g]
    gx, gw = _matmul_grads(b, x, w, g, False, True, xt, wt)
    gb = b.op("reduce_sum", g, axes=list(range(g.type.rank - 1))) if g.type.rank > 1 else g
    return [gx, gw, gb]


def _conv_attrs(p):
    return {k: p.attrs[k] for k in CONV_KEYS}


def _input_grad(b, g, w, x_type, a, input_layout: str):
    """conv2d_input_grad in the gradients' layout, transposed to the input's when it differs."""
    if not input_layout or input_layout == a["layout"]:
        return b.op("conv2d_input_grad", g, w, input_shape=x_type.shape, **a)
    to, back = (TO_NHWC, TO_NCHW) if a["layout"] == "NHWC" else (TO_NCHW, TO_NHWC)
    gx = b.op("conv2d_input_grad", g, w, input_shape=tuple(x_type.shape[i] for i in to), **a)
    return b.op("transpose", gx, perm=back)


@def_vjp("conv2d", saves="inputs")
def _conv2d_vjp(b, p, g):
    x, w = p.x
    a = _conv_attrs(p)
    il = p.attrs["input_layout"]
    return [_input_grad(b, g, w, p.in_types[0], a, il),
            b.op("conv2d_weight_grad", x, g, weight_shape=p.in_types[1].shape, input_layout=il, **a)]


@def_vjp("conv2d_input_grad", saves="inputs")
def _conv2d_input_grad_vjp(b, p, g):
    # conv2d_input_grad(gy, w) is bilinear: <g, Jx^T gy> = <conv2d(g, w), gy>.
    gy, w = p.x
    a = _conv_attrs(p)
    return [b.op("conv2d", g, w, **a), b.op("conv2d_weight_grad", g, gy, weight_shape=p.in_types[1].shape, **a)]


@def_vjp("conv2d_weight_grad", saves="inputs")
def _conv2d_weight_grad_vjp(b, p, g):
    # <g, Jw^T gy> = <conv2d(x, g), gy>.
    x, gy = p.x
    a = _conv_attrs(p)
    il = p.attrs["input_layout"]
    return [_input_grad(b, gy, g, p.in_types[0], a, il), b.op("conv2d", x, g, input_layout=il, **a)]


def _pool_attrs(p):
    return {k: p.attrs[k] for k in _POOL_KEYS}


@def_vjp("max_pool2d", saves="inputs")
def _max_pool2d_vjp(b, p, g):
    return [b.op("max_pool2d_grad", p.x[0], g, **_pool_attrs(p))]


@def_vjp("max_pool2d_with_indices", saves=Saves(results=(1,)))
def _max_pool2d_with_indices_vjp(b, p, g):
    gy, _ = g  # the indices are integers: no cotangent
    if gy is None:
        return [None]
    return [b.op("max_pool2d_index_grad", gy, p.y[1], input_shape=p.in_types[0].shape, **_pool_attrs(p))]


@def_vjp("conv2d_grads", saves="none")
def _conv2d_grads_vjp(b, p, g):
    raise NotImplementedError("conv2d_grads is made by lowering, after differentiation; differentiate the program "
                              "before remat.lower.siblings.merge_conv_grads")


@def_vjp("max_pool2d_index_grad", saves="none")
def _max_pool2d_index_grad_vjp(b, p, g):
    raise NotImplementedError("second-order differentiation through max_pool2d_index_grad is not supported "
                              "(a native backward kernel); use max_pool2d, whose backward is differentiable")


@def_vjp("avg_pool2d", saves="none")
def _avg_pool2d_vjp(b, p, g):
    return [b.op("avg_pool2d_grad", g, input_shape=p.in_types[0].shape, **_pool_attrs(p))]


@def_vjp("avg_pool2d_grad", saves="none")
def _avg_pool2d_grad_vjp(b, p, g):
    return [b.op("avg_pool2d", g, **_pool_attrs(p))]


@def_vjp("max_pool2d_grad", saves=(0,))
def _max_pool2d_grad_vjp(b, p, g):
    # Piecewise constant in the input; linear in gy. Its transpose picks, per window, the cotangent
    # at the window's (first) maximum: with non-overlapping windows that is a sum-pool of g masked
    # by the routing of ones.
    a = _pool_attrs(p)
    if tuple(a["stride"]) != tuple(a["kernel"]):
        raise NotImplementedError(
            f"second-order differentiation through max_pool2d needs non-overlapping windows "
            f"(stride == kernel), got kernel {list(a['kernel'])}, stride {list(a['stride'])}")
    gy_t = p.in_types[1]
    mask = b.op("max_pool2d_grad", p.x[0], _const(b, 1, gy_t.dtype, gy_t.shape), **a)
    pooled = b.op("avg_pool2d", b.op("mul", g, mask), **a)
    return [None, b.op("mul", pooled, _c(b, float(a["kernel"][0] * a["kernel"][1]), g))]


# ================================================================ decompositions (composites in primitives)
# rule(b, xs, attrs) -> one value per result; see remat.ir.opdef.def_decomposition.
from ..opdef import def_decomposition  # noqa: E402
from ._vjp import const as _k  # noqa: E402


def _lit(b, value: float, like):
    """A rank-0 constant of ``like``'s dtype (element-wise ops broadcast it)."""
    return _k(b, value, like.type.dtype)


@def_decomposition("linear")
def _linear_decomp(b, xs, attrs):
    x, w, bias = xs
    if x.type.rank == 1:  # one row: matmul takes rank >= 2
        y = b.op("matmul", b.op("reshape", x, shape=(1, x.type.shape[0])), w, transpose_b=True)
        y = b.op("reshape", y, shape=(w.type.shape[0],))
    else:
        y = b.op("matmul", x, w, transpose_b=True)
    return [b.op("add", y, bias)]


@def_decomposition("softmax")
def _softmax_decomp(b, xs, attrs):
    (x,) = xs
    ax = [attrs["axis"]]
    e = b.op("exp", b.op("sub", x, b.op("reduce_max", x, axes=ax, keepdims=True)))
    return [b.op("div", e, b.op("reduce_sum", e, axes=ax, keepdims=True))]


@def_decomposition("log_softmax")
def _log_softmax_decomp(b, xs, attrs):
    (x,) = xs
    ax = [attrs["axis"]]
    z = b.op("sub", x, b.op("reduce_max", x, axes=ax, keepdims=True))
    return [b.op("sub", z, b.op("log", b.op("reduce_sum", b.op("exp", z), axes=ax, keepdims=True)))]


@def_decomposition("softmax_grad")
def _softmax_grad_decomp(b, xs, attrs):
    g, y = xs
    s = b.op("reduce_sum", b.op("mul", g, y), axes=[attrs["axis"]], keepdims=True)
    return [b.op("mul", y, b.op("sub", g, s))]


@def_decomposition("log_softmax_grad")
def _log_softmax_grad_decomp(b, xs, attrs):
    g, y = xs
    s = b.op("reduce_sum", g, axes=[attrs["axis"]], keepdims=True)
    return [b.op("sub", g, b.op("mul", b.op("exp", y), s))]


def _nll_rows_ir(b, target, num_classes: int, ignore_index: int):
    """(kept positions [N, d1, ...] bool, one-hot of the targets [N, C, d1, ...] bool) of an nll_loss.

    The targets pass through ``gather`` from ``iota(C)``: an identity on valid targets whose index
    check raises IndexError, as nll_loss's own kernels do, when a kept target is outside [0, C).
    """
    shape, dt = target.type.shape, target.type.dtype
    keep = b.op("ne", target, _k(b, ignore_index, dt))
    t = b.op("select", keep, target, _k(b, 0, dt))
    t = b.op("gather", b.op("iota", shape=(num_classes,), dtype=dt), t, axis=0)
    onehot = b.op("eq", b.op("iota", shape=with_class_axis(shape, num_classes), axis=1, dtype=dt),
                  b.op("reshape", t, shape=with_class_axis(shape, 1)))
    return keep, onehot


def _all_axes(v) -> list[int]:
    return list(range(v.type.rank))


def _kept_count(b, keep, like):
    return b.op("reduce_sum", b.op("cast", keep, dtype=like.type.dtype), axes=_all_axes(keep))


@def_decomposition("nll_loss")
def _nll_loss_decomp(b, xs, attrs):
    logp, target = xs
    keep, onehot = _nll_rows_ir(b, target, logp.type.shape[1], attrs["ignore_index"])
    zero = _lit(b, 0.0, logp)
    picked = b.op("reduce_sum", b.op("select", onehot, logp, zero), axes=[1])
    per_row = b.op("select", keep, b.op("neg", picked), zero)
    if attrs["reduction"] == "none":
        return [per_row]
    total = b.op("reduce_sum", per_row, axes=_all_axes(per_row))
    if attrs["reduction"] == "mean":
        total = b.op("div", total, _kept_count(b, keep, logp))
    return [total]


@def_decomposition("nll_loss_grad")
def _nll_loss_grad_decomp(b, xs, attrs):
    g, target = xs
    shape = target.type.shape
    keep, onehot = _nll_rows_ir(b, target, attrs["num_classes"], attrs["ignore_index"])
    if attrs["reduction"] == "none":
        g = b.op("reshape", g, shape=with_class_axis(shape, 1))
    elif attrs["reduction"] == "mean":
        g = b.op("div", g, _kept_count(b, keep, g))
    hit = b.op("and", onehot, b.op("reshape", keep, shape=with_class_axis(shape, 1)))
    return [b.op("select", hit, b.op("neg", g), _lit(b, 0.0, g))]


# ---------------------------------------------------------------- pooling through strided slices
def _in_nchw(op: str):
    """A decomposition written for NCHW, also for NHWC: ``op``'s activation operands transposed to
    NCHW first (its activation-shaped attribute permuted), its activation results transposed back
    (``LAYOUT_OPERANDS``)."""
    acts, outs, shape_attr = LAYOUT_OPERANDS[op]

    def wrap(rule):
        def rule_any_layout(b, xs, attrs):
            if attrs.get("layout", "NCHW") == "NCHW":
                return rule(b, xs, attrs)
            xs = [b.op("transpose", v, perm=TO_NCHW) if i in acts else v for i, v in enumerate(xs)]
            attrs = {**attrs, "layout": "NCHW"}
            if shape_attr is not None:
                attrs[shape_attr] = tuple(attrs[shape_attr][i] for i in TO_NCHW)
            return [b.op("transpose", v, perm=TO_NHWC) if i in outs else v for i, v in enumerate(rule(b, xs, attrs))]
        return rule_any_layout
    return wrap


def _pool_geometry(x_shape, attrs):
    """(padding, (out_h, out_w)) of a pooling window over an [N, C, H, W] input."""
    return attrs["padding"], conv_out_hw("pool", x_shape[2:], attrs["kernel"], attrs)


def _pad_hw(b, x, padding, value: float):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return x
    return b.op("pad", x, low=(0, 0, ph, pw), high=(0, 0, ph, pw), value=value)


def _window(b, xp, i: int, j: int, out_hw, stride):
    """The input entries at window offset (i, j) of every window: xp[:, :, i::sh, j::sw] cut to the output."""
    n, c = xp.type.shape[:2]
    (oh, ow), (sh, sw) = out_hw, stride
    return b.op("slice", xp, start=(0, 0, i, j), stop=(n, c, i + sh * (oh - 1) + 1, j + sw * (ow - 1) + 1),
                step=(1, 1, sh, sw))


def _unwindow(b, v, i: int, j: int, padded_hw, stride):
    """The transpose of ``_window``: ``v`` [N, C, OH, OW] placed at offset (i, j), stride apart, in
    zeros of the padded input's shape (a pad with interior padding)."""
    (hp, wp), (sh, sw) = padded_hw, stride
    oh, ow = v.type.shape[2:]
    return b.op("pad", v, low=(0, 0, i, j), high=(0, 0, hp - i - sh * (oh - 1) - 1, wp - j - sw * (ow - 1) - 1),
                interior=(0, 0, sh - 1, sw - 1))


def _crop(b, xp, padding, shape):
    ph, pw = padding
    if ph == 0 and pw == 0:
        return xp
    n, c, h, w = shape
    return b.op("slice", xp, start=(0, 0, ph, pw), stop=(n, c, ph + h, pw + w))


def _offsets(attrs):
    kh, kw = attrs["kernel"]
    return [(i, j) for i in range(kh) for j in range(kw)]  # row-major: the order ties are broken in


def _max_pool_ir(b, x, attrs):
    padding, out_hw = _pool_geometry(x.type.shape, attrs)
    xp = _pad_hw(b, x, padding, float("-inf"))  # padding never wins
    wins = [_window(b, xp, i, j, out_hw, attrs["stride"]) for i, j in _offsets(attrs)]
    y = wins[0]
    for w in wins[1:]:
        y = b.op("maximum", y, w)
    return xp, wins, y


@def_decomposition("max_pool2d")
@_in_nchw("max_pool2d")
def _max_pool2d_decomp(b, xs, attrs):
    return [_max_pool_ir(b, xs[0], attrs)[2]]


@def_decomposition("avg_pool2d")
@_in_nchw("avg_pool2d")
def _avg_pool2d_decomp(b, xs, attrs):
    (x,) = xs
    padding, out_hw = _pool_geometry(x.type.shape, attrs)
    xp = _pad_hw(b, x, padding, 0.0)  # padding counts as zeros (count_include_pad)
    total = None
    for i, j in _offsets(attrs):
        w = _window(b, xp, i, j, out_hw, attrs["stride"])
        total = w if total is None else b.op("add", total, w)
    kh, kw = attrs["kernel"]
    return [b.op("div", total, _lit(b, float(kh * kw), x))]


@def_decomposition("avg_pool2d_grad")
@_in_nchw("avg_pool2d_grad")
def _avg_pool2d_grad_decomp(b, xs, attrs):
    (gy,) = xs
    shape = attrs["input_shape"]
    (ph, pw), kernel = attrs["padding"], attrs["kernel"]
    share = b.op("div", gy, _lit(b, float(kernel[0] * kernel[1]), gy))
    padded = (shape[2] + 2 * ph, shape[3] + 2 * pw)
    total = None
    for i, j in _offsets(attrs):
        part = _unwindow(b, share, i, j, padded, attrs["stride"])
        total = part if total is None else b.op("add", total, part)
    return [_crop(b, total, (ph, pw), shape)]


def _first_max_hits(b, wins, y):
    """Per window offset, whether it holds the window's first maximum (row-major order), as bool masks."""
    hits, taken = [], None
    for k, w in enumerate(wins):
        hit = b.op("eq", w, y)
        if taken is not None:
            hit = b.op("and", hit, b.op("not", taken))
        if k + 1 < len(wins):
            taken = hit if taken is None else b.op("or", taken, hit)
        hits.append(hit)
    return hits


@def_decomposition("max_pool2d_grad")
@_in_nchw("max_pool2d_grad")
def _max_pool2d_grad_decomp(b, xs, attrs):
    x, gy = xs
    xp, wins, y = _max_pool_ir(b, x, attrs)
    zero = _lit(b, 0.0, gy)
    total = None
    for (i, j), hit in zip(_offsets(attrs), _first_max_hits(b, wins, y)):
        part = _unwindow(b, b.op("select", hit, gy, zero), i, j, xp.type.shape[2:], attrs["stride"])
        total = part if total is None else b.op("add", total, part)
    return [_crop(b, total, attrs["padding"], x.type.shape)]


@def_decomposition("max_pool2d_with_indices")
@_in_nchw("max_pool2d_with_indices")
def _max_pool2d_with_indices_decomp(b, xs, attrs):
    (x,) = xs
    _, wins, y = _max_pool_ir(b, x, attrs)
    (ph, pw), (sh, sw), w_in = attrs["padding"], attrs["stride"], x.type.shape[3]
    out = y.type.shape
    rows = b.op("iota", shape=out, axis=2)
    cols = b.op("iota", shape=out, axis=3)
    index = None
    for (i, j), hit in zip(_offsets(attrs), _first_max_hits(b, wins, y)):
        # flat index (row * W + col) in the unpadded input of offset (i, j) of each window
        r = b.op("add", b.op("mul", rows, _k(b, sh, DType.i64)), _k(b, i - ph, DType.i64))
        c = b.op("add", b.op("mul", cols, _k(b, sw, DType.i64)), _k(b, j - pw, DType.i64))
        flat = b.op("add", b.op("mul", r, _k(b, w_in, DType.i64)), c)
        index = flat if index is None else b.op("select", hit, flat, index)  # the hits are exclusive
    if attrs["index_dtype"] != DType.i64:
        index = b.op("cast", index, dtype=attrs["index_dtype"])
    return [y, index]


@def_decomposition("max_pool2d_index_grad")
@_in_nchw("max_pool2d_index_grad")
def _max_pool2d_index_grad_decomp(b, xs, attrs):
    gy, idx = xs
    n, c, h, w = attrs["input_shape"]
    out = idx.type.shape
    # one scatter over the flattened input: plane (n, c) starts at (n * C + c) * H * W
    plane = b.op("add", b.op("mul", b.op("iota", shape=out, axis=0), _k(b, c, DType.i64)),
                 b.op("iota", shape=out, axis=1))
    if idx.type.dtype != DType.i64:
        idx = b.op("cast", idx, dtype=DType.i64)
    flat = b.op("add", b.op("mul", plane, _k(b, h * w, DType.i64)), idx)
    size = _prod(out)
    gx = b.op("scatter_add", b.op("reshape", flat, shape=(size,)), b.op("reshape", gy, shape=(size,)),
              shape=(n * c * h * w,))
    return [b.op("reshape", gx, shape=(n, c, h, w))]
