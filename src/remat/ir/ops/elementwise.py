"""Element-wise ops: unary math, binary arithmetic with NumPy broadcasting, comparisons, select, cast."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import away_from, bcast, expect_float, expect_same_dtype, max_numel, per_output, rand

# ---------------------------------------------------------------- unary
_UNARY = {
    # name: (float only?, input sampler, doc)
    "neg": (False, lambda r: rand(r, 3, 4), "-x"),
    "abs": (False, lambda r: away_from(r, 3, 4), "|x|"),
    "sign": (False, lambda r: away_from(r, 3, 4), "sign of x (-1, 0 or 1)"),
    "relu": (False, lambda r: away_from(r, 3, 4), "max(x, 0)"),
    "exp": (True, lambda r: rand(r, 3, 4), "e^x"),
    "log": (True, lambda r: rand(r, 3, 4, low=0.2, high=2.0), "natural log"),
    "sqrt": (True, lambda r: rand(r, 3, 4, low=0.2, high=2.0), "square root"),
    "rsqrt": (True, lambda r: rand(r, 3, 4, low=0.2, high=2.0), "1/sqrt(x)"),
    "tanh": (True, lambda r: rand(r, 3, 4), "hyperbolic tangent"),
    "sigmoid": (True, lambda r: rand(r, 3, 4), "1/(1+e^-x)"),
    "sin": (True, lambda r: rand(r, 3, 4), "sine"),
    "cos": (True, lambda r: rand(r, 3, 4), "cosine"),
    "erf": (True, lambda r: rand(r, 3, 4), "error function"),
    "floor": (True, lambda r: away_from(r, 3, 4) * 3.0, "largest integer <= x (zero gradient)"),
}


def _unary_infer(name: str, float_only: bool):
    def infer(types, attrs):
        (t,) = types
        if float_only:
            expect_float(name, t)
        elif t.dtype == DType.bool:
            raise TypeError(f"'{name}' does not take bool operands, got {t}")
        return t

    return infer


def _unary_sample(fn):
    return lambda rng: [Sample([fn(rng)]), Sample([fn(rng).reshape(12)[:1].reshape(())])]


for _name, (_float, _sampler, _doc) in _UNARY.items():
    declare(OpDef(_name, 1, (), _unary_infer(_name, _float), frozenset({"elementwise", "unary"}),
                  doc=_doc, nondiff=_name in ("sign", "floor"), sample=_unary_sample(_sampler),
                  flops=per_output(8.0) if _name == "erf" else max_numel))


def _gelu_infer(types, attrs):
    (t,) = types
    expect_float("gelu", t)
    if attrs["approximate"] not in ("none", "tanh"):
        raise TypeError(f"'gelu': approximate must be \"none\" or \"tanh\", got {attrs['approximate']!r}")
    return t


declare(OpDef("gelu", 1, (Attr("approximate", "str", "none"),), _gelu_infer, frozenset({"elementwise", "unary"}),
              doc="Gaussian error linear unit (exact with erf, or the tanh approximation)", flops=per_output(8.0),
              sample=lambda r: [Sample([rand(r, 3, 4, low=-3, high=3)]),
                                Sample([rand(r, 2, 5, low=-3, high=3)], {"approximate": "tanh"})]))


def _gelu_grad_infer(types, attrs):
    g, x = types
    expect_same_dtype("gelu_grad", types)
    _gelu_infer([x], attrs)
    if g.shape != x.shape:
        raise TypeError(f"'gelu_grad': gradient {g} and input {x} must have the same shape")
    return x


declare(OpDef("gelu_grad", 2, (Attr("approximate", "str", "none"),), _gelu_grad_infer, frozenset({"elementwise"}),
              doc="gradient of gelu from (grad_output, input): g * gelu'(x) (PyTorch's gelu_backward)",
              flops=lambda ins, outs, attrs: 12.0 * outs[0].numel,
              sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4, low=-3, high=3)]),
                                Sample([rand(r, 2, 5), rand(r, 2, 5, low=-3, high=3)], {"approximate": "tanh"})]))


_HARDTANH_ATTRS = (Attr("min_val", "float", -1.0), Attr("max_val", "float", 1.0))


def _hardtanh_check(name: str, t: TensorType, attrs) -> None:
    expect_float(name, t)
    if not attrs["min_val"] < attrs["max_val"]:
        raise TypeError(f"'{name}': min_val must be below max_val, got min_val={attrs['min_val']} and "
                        f"max_val={attrs['max_val']}")


def _hardtanh_infer(types, attrs):
    (t,) = types
    _hardtanh_check("hardtanh", t, attrs)
    return t


def _hardtanh_grad_infer(types, attrs):
    _hardtanh_check("hardtanh_grad", types[1], attrs)
    return _hardtanh_pair_infer(types, attrs)


def _hardtanh_sample(r: np.random.Generator, *shape: int) -> np.ndarray:
    """Values in (-2.5, 2.5) at least 0.15 away from the default bounds -1 and 1 (the kinks)."""
    x = away_from(r, *shape, gap=0.15) * 2.5
    return np.where(np.abs(np.abs(x) - 1.0) < 0.15, x * 0.5, x)


declare(OpDef("hardtanh", 1, _HARDTANH_ATTRS, _hardtanh_infer, frozenset({"elementwise", "unary"}),
              doc="x clamped to [min_val, max_val] (PyTorch's hardtanh; ReLU6 is hardtanh(0, 6)), its gradient "
                  "passed where min_val < x < max_val, so the output alone gives it",
              flops=max_numel,
              sample=lambda r: [Sample([_hardtanh_sample(r, 3, 4)]),
                                Sample([_hardtanh_sample(r, 2, 5) * 3.0 + 3.0], {"min_val": 0.0, "max_val": 6.0})]))
declare(OpDef("hardtanh_grad", 2, _HARDTANH_ATTRS, _hardtanh_grad_infer, frozenset({"elementwise"}),
              doc="gradient of hardtanh from (grad_output, hardtanh input or output): 0 where the value is "
                  "<= min_val or >= max_val, else the gradient (PyTorch's hardtanh_backward)",
              flops=lambda ins, outs, attrs: 2.0 * outs[0].numel,
              sample=lambda r: [Sample([rand(r, 3, 4), _hardtanh_sample(r, 3, 4)]),
                                Sample([rand(r, 2, 5), _hardtanh_sample(r, 2, 5) * 3.0 + 3.0],
                                       {"min_val": 0.0, "max_val": 6.0})]))


declare(OpDef("silu", 1, (), _unary_infer("silu", True), frozenset({"elementwise", "unary"}),
              doc="x * sigmoid(x) (swish; PyTorch's silu, whose backward keeps only the input)", flops=per_output(4.0),
              sample=_unary_sample(lambda r: rand(r, 3, 4, low=-4, high=4))))


def grad_pair_infer(name: str, what: str):
    """The type rule of a gradient op taking (grad_output, ``what``) of one type: that type (also
    softmax's and log_softmax's, in :mod:`.nn`)."""
    def infer(types, attrs):
        g, v = types
        expect_same_dtype(name, types)
        expect_float(name, g)
        if g.shape != v.shape:
            raise TypeError(f"'{name}': gradient {g} and {what} {v} must have the same shape")
        return g

    return infer


_hardtanh_pair_infer = grad_pair_infer("hardtanh_grad", "hardtanh input or output")


declare(OpDef("silu_grad", 2, (), grad_pair_infer("silu_grad", "input"), frozenset({"elementwise"}),
              doc="gradient of silu from (grad_output, input): g * s (1 + x (1 - s)), s = sigmoid(x) "
                  "(PyTorch's silu_backward)",
              flops=lambda ins, outs, attrs: 8.0 * outs[0].numel,
              sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4, low=-4, high=4)]),
                                Sample([rand(r, 2, 5), rand(r, 2, 5, low=-4, high=4)])]))


declare(OpDef("relu_grad", 2, (), grad_pair_infer("relu_grad", "relu value"), frozenset({"elementwise"}),
              doc="gradient of relu from (grad_output, relu input or output): 0 where the value is <= 0, else "
                  "the gradient (PyTorch's threshold_backward at 0)",
              flops=lambda ins, outs, attrs: float(outs[0].numel),
              sample=lambda r: [Sample([rand(r, 3, 4), away_from(r, 3, 4)]),
                                Sample([rand(r, 2, 5), away_from(r, 2, 5)])]))


def _not_infer(types, attrs):
    (t,) = types
    if t.dtype != DType.bool:
        raise TypeError(f"'not' takes a bool operand, got {t}")
    return t


declare(OpDef("not", 1, (), _not_infer, frozenset({"elementwise", "unary"}), doc="logical not", nondiff=True, flops=max_numel,
              sample=lambda r: [Sample([r.random((3, 4)) > 0.5])]))

# ---------------------------------------------------------------- binary
_BINARY = {
    "add": (lambda r: [rand(r, 3, 4), rand(r, 4)], "a + b"),
    "sub": (lambda r: [rand(r, 3, 1), rand(r, 1, 4)], "a - b"),
    "mul": (lambda r: [rand(r, 2, 3, 4), rand(r, 3, 4)], "a * b"),
    "div": (lambda r: [rand(r, 3, 4), away_from(r, 3, 4, gap=0.5)], "a / b"),
    "pow": (lambda r: [rand(r, 3, 4, low=0.5, high=2.0), rand(r, 3, 4)], "a ** b"),
    "maximum": (lambda r: [rand(r, 3, 4), rand(r, 3, 4)], "element-wise maximum"),
    "minimum": (lambda r: [rand(r, 3, 4), rand(r, 3, 4)], "element-wise minimum"),
}


def _binary_infer(name: str):
    def infer(types, attrs):
        dt = expect_same_dtype(name, types)
        if dt == DType.bool:
            raise TypeError(f"'{name}' does not take bool operands; use 'and'/'or' or cast first")
        return TensorType(dt, bcast(name, types))

    return infer


for _name, (_sampler, _doc) in _BINARY.items():
    declare(OpDef(_name, 2, (), _binary_infer(_name), frozenset({"elementwise", "binary"}), doc=_doc, flops=max_numel,
                  sample=(lambda s: lambda r: [Sample(s(r)), Sample([rand(r), rand(r, 2, 3)])])(_sampler)))


def _cmp_infer(name: str):
    def infer(types, attrs):
        expect_same_dtype(name, types)
        return TensorType(DType.bool, bcast(name, types))

    return infer


for _name, _doc in {"eq": "a == b", "ne": "a != b", "lt": "a < b", "le": "a <= b", "gt": "a > b", "ge": "a >= b"}.items():
    declare(OpDef(_name, 2, (), _cmp_infer(_name), frozenset({"elementwise", "binary", "comparison"}), doc=_doc,
                  nondiff=True, flops=max_numel, sample=lambda r: [Sample([np.round(rand(r, 3, 4)), np.round(rand(r, 4))])]))


def _logic_infer(name: str):
    def infer(types, attrs):
        for t in types:
            if t.dtype != DType.bool:
                raise TypeError(f"'{name}' takes bool operands, got {', '.join(map(str, types))}")
        return TensorType(DType.bool, bcast(name, types))

    return infer


for _name in ("and", "or"):
    declare(OpDef(_name, 2, (), _logic_infer(_name), frozenset({"elementwise", "binary"}), doc=f"logical {_name}",
                  nondiff=True, flops=max_numel, sample=lambda r: [Sample([r.random((3, 4)) > 0.5, r.random((4,)) > 0.5])]))


def _select_infer(types, attrs):
    c, a, b = types
    if c.dtype != DType.bool:
        raise TypeError(f"'select' condition must be bool, got {c}")
    dt = expect_same_dtype("select", [a, b])
    return TensorType(dt, bcast("select", types))


declare(OpDef("select", 3, (), _select_infer, frozenset({"elementwise"}), doc="cond ? a : b, broadcasting", flops=max_numel,
              sample=lambda r: [Sample([r.random((3, 4)) > 0.5, rand(r, 3, 4), rand(r, 4)])]))


def _cast_infer(types, attrs):
    (t,) = types
    return t.with_dtype(attrs["dtype"])


declare(OpDef("cast", 1, (Attr("dtype", "dtype"),), _cast_infer, frozenset({"elementwise", "unary"}),
              doc="convert element type", flops=max_numel,
              sample=lambda r: [Sample([rand(r, 3, 4)], {"dtype": DType.f32}),
                                Sample([rand(r, 2, 2)], {"dtype": DType.f64})]))


def _copy_infer(types, attrs):
    return types[0]


declare(OpDef("copy", 1, (), _copy_infer, frozenset({"elementwise", "unary"}),
              doc="a fresh copy of x (a new buffer)", flops=max_numel, sample=lambda r: [Sample([rand(r, 3, 4)])]))


# ================================================================ VJP rules (reverse mode)
# rule(b, p, g) -> one cotangent per operand; see remat.ir.ops._vjp. ``saves`` is what the
# backward keeps alive from the forward.
import math as _math  # noqa: E402

from ..opdef import def_vjp  # noqa: E402
from ._vjp import def_vjp_variant, scalar_like as _c, unbroadcast as _unb  # noqa: E402


def _mul(b, *vs):
    out = vs[0]
    for v in vs[1:]:
        out = b.op("mul", out, v)
    return out


@def_vjp("neg", saves="none")
def _neg_vjp(b, p, g):
    return [b.op("neg", g)]


@def_vjp("copy", saves="none")
def _copy_vjp(b, p, g):
    return [g]


@def_vjp("abs", saves="inputs")
def _abs_vjp(b, p, g):
    return [b.op("mul", g, b.op("sign", p.x[0]))]


@def_vjp("relu", saves="outputs")
def _relu_vjp(b, p, g):
    return [b.op("relu_grad", g, p.y[0])]


@def_vjp_variant("relu", "inputs", saves="inputs")
def _relu_vjp_in(b, p, g):
    return [b.op("relu_grad", g, p.x[0])]  # relu(x) > 0 exactly where x > 0


@def_vjp("relu_grad", saves=(1,))
def _relu_grad_vjp(b, p, g):
    # Linear in the gradient, piecewise constant in the value: d g = relu_grad(u, y), d y = 0.
    return [b.op("relu_grad", g, p.x[1]), None]


@def_vjp("hardtanh", saves="outputs")
def _hardtanh_vjp(b, p, g):
    # The output is strictly inside (min_val, max_val) exactly where the input is; a ReLU6's output
    # is what the next convolution keeps anyway, so its backward keeps nothing more.
    return [b.op("hardtanh_grad", g, p.y[0], **p.attrs)]


@def_vjp_variant("hardtanh", "inputs", saves="inputs")
def _hardtanh_vjp_in(b, p, g):
    return [b.op("hardtanh_grad", g, p.x[0], **p.attrs)]


@def_vjp("hardtanh_grad", saves=(1,))
def _hardtanh_grad_vjp(b, p, g):
    # Linear in the gradient, piecewise constant in the value.
    return [b.op("hardtanh_grad", g, p.x[1], **p.attrs), None]


@def_vjp("exp", saves="outputs")
def _exp_vjp(b, p, g):
    return [b.op("mul", g, p.y[0])]


@def_vjp_variant("exp", "inputs", saves="inputs")
def _exp_vjp_in(b, p, g):
    return [b.op("mul", g, b.op("exp", p.x[0]))]


@def_vjp("log", saves="inputs")
def _log_vjp(b, p, g):
    return [b.op("div", g, p.x[0])]


@def_vjp("sqrt", saves="outputs")
def _sqrt_vjp(b, p, g):
    # d sqrt(x) = 1 / (2 sqrt(x))
    return [b.op("div", g, b.op("mul", p.y[0], _c(b, 2, g)))]


@def_vjp("rsqrt", saves="outputs")
def _rsqrt_vjp(b, p, g):
    # d x^-1/2 = -1/2 x^-3/2 = -1/2 y^3
    y = p.y[0]
    return [_mul(b, g, _c(b, -0.5, g), y, y, y)]


def _tanh_from_y(b, g, y):
    return b.op("mul", g, b.op("sub", _c(b, 1, g), b.op("mul", y, y)))


@def_vjp("tanh", saves="outputs")
def _tanh_vjp(b, p, g):
    return [_tanh_from_y(b, g, p.y[0])]


@def_vjp_variant("tanh", "inputs", saves="inputs")
def _tanh_vjp_in(b, p, g):
    return [_tanh_from_y(b, g, b.op("tanh", p.x[0]))]


def _sigmoid_from_y(b, g, y):
    return _mul(b, g, y, b.op("sub", _c(b, 1, g), y))


@def_vjp("sigmoid", saves="outputs")
def _sigmoid_vjp(b, p, g):
    return [_sigmoid_from_y(b, g, p.y[0])]


@def_vjp_variant("sigmoid", "inputs", saves="inputs")
def _sigmoid_vjp_in(b, p, g):
    return [_sigmoid_from_y(b, g, b.op("sigmoid", p.x[0]))]


@def_vjp("sin", saves="inputs")
def _sin_vjp(b, p, g):
    return [b.op("mul", g, b.op("cos", p.x[0]))]


@def_vjp("cos", saves="inputs")
def _cos_vjp(b, p, g):
    return [b.op("neg", b.op("mul", g, b.op("sin", p.x[0])))]


@def_vjp("erf", saves="inputs")
def _erf_vjp(b, p, g):
    x = p.x[0]
    e = b.op("exp", b.op("neg", b.op("mul", x, x)))
    return [_mul(b, g, _c(b, 2 / _math.sqrt(_math.pi), g), e)]


@def_vjp("gelu", saves="inputs")
def _gelu_vjp(b, p, g):
    return [b.op("gelu_grad", g, p.x[0], approximate=p.attrs["approximate"])]


@def_vjp("gelu_grad", saves="inputs")
def _gelu_grad_vjp(b, p, g):
    # r = gy * gelu'(x): linear in gy (d gy = gelu_grad(u, x)); d x = u * gy * gelu''(x).
    gy, x = p.x
    if p.attrs["approximate"] == "tanh":
        half, one = _c(b, 0.5, g), _c(b, 1, g)
        # gelu = x/2 (1 + t), t = tanh(v), v = k (x + a x^3):
        # gelu'' = (1 - t^2) (v' + x/2 (v'' - 2 t v'^2)), v' = k (1 + 3 a x^2), v'' = 6 k a x.
        k, a = _math.sqrt(2 / _math.pi), 0.044715
        x2 = b.op("mul", x, x)
        t = b.op("tanh", _mul(b, _c(b, k, g), b.op("add", x, _mul(b, _c(b, a, g), x2, x))))
        dv = _mul(b, _c(b, k, g), b.op("add", one, _mul(b, _c(b, 3 * a, g), x2)))
        ddv = _mul(b, _c(b, 6 * k * a, g), x)
        inner = b.op("sub", ddv, _mul(b, _c(b, 2, g), t, dv, dv))
        d2 = _mul(b, b.op("sub", one, b.op("mul", t, t)), b.op("add", dv, _mul(b, half, x, inner)))
    else:
        # gelu' = Phi(x) + x phi(x), gelu'' = phi(x) (2 - x^2), phi the standard normal density.
        pdf = b.op("mul", _c(b, 1 / _math.sqrt(2 * _math.pi), g),
                   b.op("exp", b.op("mul", _c(b, -0.5, g), b.op("mul", x, x))))
        d2 = b.op("mul", pdf, b.op("sub", _c(b, 2, g), b.op("mul", x, x)))
    return [b.op("gelu_grad", g, x, approximate=p.attrs["approximate"]), _mul(b, g, gy, d2)]


@def_vjp("silu", saves="inputs")
def _silu_vjp(b, p, g):
    return [b.op("silu_grad", g, p.x[0])]


@def_vjp("silu_grad", saves="inputs")
def _silu_grad_vjp(b, p, g):
    # r = gy * silu'(x), silu' = s (1 + x (1 - s)): linear in gy (d gy = silu_grad(u, x));
    # d x = u * gy * silu''(x), silu'' = s (1 - s) (2 + x (1 - 2 s)), s = sigmoid(x).
    gy, x = p.x
    s = b.op("sigmoid", x)
    one, two = _c(b, 1, g), _c(b, 2, g)
    d2 = _mul(b, s, b.op("sub", one, s), b.op("add", two, b.op("mul", x, b.op("sub", one, b.op("mul", two, s)))))
    return [b.op("silu_grad", g, x), _mul(b, g, gy, d2)]


@def_vjp("cast", saves="none")
def _cast_vjp(b, p, g):
    t = p.in_types[0]
    if not t.dtype.is_float:
        return [None]
    return [b.op("cast", g, dtype=t.dtype) if t.dtype != g.type.dtype else g]


@def_vjp("add", saves="none")
def _add_vjp(b, p, g):
    return [_unb(b, g, p.in_types[0].shape), _unb(b, g, p.in_types[1].shape)]


@def_vjp("sub", saves="none")
def _sub_vjp(b, p, g):
    return [_unb(b, g, p.in_types[0].shape), _unb(b, b.op("neg", g), p.in_types[1].shape)]


@def_vjp("mul", saves="inputs")
def _mul_vjp(b, p, g):
    x, y = p.x
    return [_unb(b, b.op("mul", g, y), p.in_types[0].shape), _unb(b, b.op("mul", g, x), p.in_types[1].shape)]


@def_vjp("div", saves="inputs")
def _div_vjp(b, p, g):
    x, y = p.x
    gx = b.op("div", g, y)
    gy = b.op("neg", b.op("div", b.op("mul", gx, x), y))  # -g x / y^2
    return [_unb(b, gx, p.in_types[0].shape), _unb(b, gy, p.in_types[1].shape)]


@def_vjp("pow", saves="inputs")
def _pow_vjp(b, p, g):
    x, y = p.x
    gx = _mul(b, g, y, b.op("pow", x, b.op("sub", y, _c(b, 1, g))))
    gy = _mul(b, g, b.op("pow", x, y), b.op("log", x))
    return [_unb(b, gx, p.in_types[0].shape), _unb(b, gy, p.in_types[1].shape)]


def _minmax_vjp(cmp):
    def rule(b, p, g):
        x, y = p.x
        zero = _c(b, 0, g)
        m = b.op(cmp, x, y)  # ties go to the first operand
        return [_unb(b, b.op("select", m, g, zero), p.in_types[0].shape),
                _unb(b, b.op("select", m, zero, g), p.in_types[1].shape)]

    return rule


def_vjp("maximum", saves="inputs")(_minmax_vjp("ge"))
def_vjp("minimum", saves="inputs")(_minmax_vjp("le"))


@def_vjp("select", saves=(0,))
def _select_vjp(b, p, g):
    c = p.x[0]
    zero = _c(b, 0, g)
    return [None, _unb(b, b.op("select", c, g, zero), p.in_types[1].shape),
            _unb(b, b.op("select", c, zero, g), p.in_types[2].shape)]


# ================================================================ decompositions (composites in primitives)
# rule(b, xs, attrs) -> one value per result; see remat.ir.opdef.def_decomposition.
from math import pi as _pi, sqrt as _sqrt  # noqa: E402

from ..opdef import def_decomposition  # noqa: E402

_GELU_K, _GELU_A = _sqrt(2.0 / _pi), 0.044715  # the tanh approximation's constants


def _gelu_tanh(b, x):
    """tanh(k (x + a x³)) of gelu's tanh approximation."""
    x3 = b.op("mul", b.op("mul", x, x), x)
    return b.op("tanh", b.op("mul", _c(b, _GELU_K, x), b.op("add", x, b.op("mul", _c(b, _GELU_A, x), x3))))


def _gelu_cdf(b, x):
    """Φ(x) = (1 + erf(x / √2)) / 2."""
    return b.op("mul", _c(b, 0.5, x), b.op("add", _c(b, 1.0, x), b.op("erf", b.op("div", x, _c(b, _sqrt(2.0), x)))))


@def_decomposition("gelu")
def _gelu_decomp(b, xs, attrs):
    (x,) = xs
    if attrs["approximate"] == "tanh":
        half_x = b.op("mul", _c(b, 0.5, x), x)
        return [b.op("mul", half_x, b.op("add", _c(b, 1.0, x), _gelu_tanh(b, x)))]
    return [b.op("mul", x, _gelu_cdf(b, x))]


@def_decomposition("gelu_grad")
def _gelu_grad_decomp(b, xs, attrs):
    g, x = xs
    if attrs["approximate"] == "tanh":
        # ½(1 + t) + ½ x (1 − t²) k (1 + 3a x²)
        t = _gelu_tanh(b, x)
        one = _c(b, 1.0, x)
        left = b.op("mul", _c(b, 0.5, x), b.op("add", one, t))
        inner = b.op("add", one, b.op("mul", _c(b, 3 * _GELU_A, x), b.op("mul", x, x)))
        right = b.op("mul", b.op("mul", _c(b, 0.5 * _GELU_K, x), x),
                     b.op("mul", b.op("sub", one, b.op("mul", t, t)), inner))
        return [b.op("mul", g, b.op("add", left, right))]
    # Φ(x) + x φ(x), φ(x) = exp(−x²/2) / √(2π)
    pdf = b.op("div", b.op("exp", b.op("mul", _c(b, -0.5, x), b.op("mul", x, x))), _c(b, _sqrt(2.0 * _pi), x))
    return [b.op("mul", g, b.op("add", _gelu_cdf(b, x), b.op("mul", x, pdf)))]


@def_decomposition("hardtanh")
def _hardtanh_decomp(b, xs, attrs):
    (x,) = xs
    return [b.op("minimum", b.op("maximum", x, _c(b, attrs["min_val"], x)), _c(b, attrs["max_val"], x))]


@def_decomposition("hardtanh_grad")
def _hardtanh_grad_decomp(b, xs, attrs):
    g, v = xs
    out = b.op("or", b.op("le", v, _c(b, attrs["min_val"], v)), b.op("ge", v, _c(b, attrs["max_val"], v)))
    return [b.op("select", out, _c(b, 0.0, g), g)]


@def_decomposition("silu")
def _silu_decomp(b, xs, attrs):
    (x,) = xs
    return [b.op("mul", x, b.op("sigmoid", x))]


@def_decomposition("silu_grad")
def _silu_grad_decomp(b, xs, attrs):
    g, x = xs
    s = b.op("sigmoid", x)
    one = _c(b, 1.0, x)
    return [b.op("mul", g, b.op("mul", s, b.op("add", one, b.op("mul", x, b.op("sub", one, s)))))]


@def_decomposition("relu_grad")
def _relu_grad_decomp(b, xs, attrs):
    g, y = xs
    return [b.op("select", b.op("le", y, _c(b, 0, y)), _c(b, 0, g), g)]
