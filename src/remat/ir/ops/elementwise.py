"""Element-wise ops: unary math, binary arithmetic with NumPy broadcasting, comparisons, select, cast."""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import away_from, bcast, expect_float, expect_same_dtype, rand

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
                  doc=_doc, nondiff=_name == "sign", sample=_unary_sample(_sampler)))


def _gelu_infer(types, attrs):
    (t,) = types
    expect_float("gelu", t)
    if attrs["approximate"] not in ("none", "tanh"):
        raise TypeError(f"'gelu': approximate must be \"none\" or \"tanh\", got {attrs['approximate']!r}")
    return t


declare(OpDef("gelu", 1, (Attr("approximate", "str", "none"),), _gelu_infer, frozenset({"elementwise", "unary"}),
              doc="Gaussian error linear unit (exact with erf, or the tanh approximation)",
              sample=lambda r: [Sample([rand(r, 3, 4, low=-3, high=3)]),
                                Sample([rand(r, 2, 5, low=-3, high=3)], {"approximate": "tanh"})]))


def _not_infer(types, attrs):
    (t,) = types
    if t.dtype != DType.bool:
        raise TypeError(f"'not' takes a bool operand, got {t}")
    return t


declare(OpDef("not", 1, (), _not_infer, frozenset({"elementwise", "unary"}), doc="logical not", nondiff=True,
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
    declare(OpDef(_name, 2, (), _binary_infer(_name), frozenset({"elementwise", "binary"}), doc=_doc,
                  sample=(lambda s: lambda r: [Sample(s(r)), Sample([rand(r), rand(r, 2, 3)])])(_sampler)))


def _cmp_infer(name: str):
    def infer(types, attrs):
        expect_same_dtype(name, types)
        return TensorType(DType.bool, bcast(name, types))

    return infer


for _name, _doc in {"eq": "a == b", "ne": "a != b", "lt": "a < b", "le": "a <= b", "gt": "a > b", "ge": "a >= b"}.items():
    declare(OpDef(_name, 2, (), _cmp_infer(_name), frozenset({"elementwise", "binary", "comparison"}), doc=_doc,
                  nondiff=True, sample=lambda r: [Sample([np.round(rand(r, 3, 4)), np.round(rand(r, 4))])]))


def _logic_infer(name: str):
    def infer(types, attrs):
        for t in types:
            if t.dtype != DType.bool:
                raise TypeError(f"'{name}' takes bool operands, got {', '.join(map(str, types))}")
        return TensorType(DType.bool, bcast(name, types))

    return infer


for _name in ("and", "or"):
    declare(OpDef(_name, 2, (), _logic_infer(_name), frozenset({"elementwise", "binary"}), doc=f"logical {_name}",
                  nondiff=True, sample=lambda r: [Sample([r.random((3, 4)) > 0.5, r.random((4,)) > 0.5])]))


def _select_infer(types, attrs):
    c, a, b = types
    if c.dtype != DType.bool:
        raise TypeError(f"'select' condition must be bool, got {c}")
    dt = expect_same_dtype("select", [a, b])
    return TensorType(dt, bcast("select", types))


declare(OpDef("select", 3, (), _select_infer, frozenset({"elementwise"}), doc="cond ? a : b, broadcasting",
              sample=lambda r: [Sample([r.random((3, 4)) > 0.5, rand(r, 3, 4), rand(r, 4)])]))


def _cast_infer(types, attrs):
    (t,) = types
    return t.with_dtype(attrs["dtype"])


declare(OpDef("cast", 1, (Attr("dtype", "dtype"),), _cast_infer, frozenset({"elementwise", "unary"}),
              doc="convert element type",
              sample=lambda r: [Sample([rand(r, 3, 4)], {"dtype": DType.f32}),
                                Sample([rand(r, 2, 2)], {"dtype": DType.f64})]))


def _copy_infer(types, attrs):
    return types[0]


declare(OpDef("copy", 1, (), _copy_infer, frozenset({"elementwise", "unary"}),
              doc="a fresh copy of x (a new buffer)", sample=lambda r: [Sample([rand(r, 3, 4)])]))
