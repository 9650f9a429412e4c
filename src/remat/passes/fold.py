"""Constant folding of ops whose operands are all splat constants: the result is again a splat
``constant`` of the result type, computed with NumPy in the result's dtype (so the folded value is
exactly what the kernel would produce for every element). Random ops are never folded, even with a
constant seed: their values are not splats."""
from __future__ import annotations

import math
from math import prod
from typing import Any, Callable

import numpy as np

from ..ir import Builder, Instruction, Module
from ._rewrite import constant_value
from .simplify import rewrite_function


def _erf(x):
    return np.asarray(math.erf(float(x)), dtype=np.asarray(x).dtype)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


_UNARY: dict[str, Callable] = {
    "neg": np.negative, "abs": np.abs, "sign": np.sign, "relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: x.dtype.type(1) / np.sqrt(x),
    "tanh": np.tanh, "sigmoid": _sigmoid, "sin": np.sin, "cos": np.cos, "erf": _erf, "not": np.logical_not,
    "copy": lambda x: x,
}
_BINARY: dict[str, Callable] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "and": np.logical_and, "or": np.logical_or,
}
_FLOAT_ONLY_BINARY: dict[str, Callable] = {"div": np.divide, "pow": np.power}
_SHAPE_OPS = {"reshape", "broadcast", "transpose", "slice"}


def _scalar(v: Any, dtype) -> np.ndarray:
    return np.asarray(v, dtype=dtype.numpy)


def _to_attr(x: np.ndarray, dtype) -> Any:
    x = np.asarray(x).astype(dtype.numpy)
    if dtype.value == "bool":
        return bool(x)
    if dtype.is_int:
        return int(x)
    return float(x)


def fold_instruction(ins: Instruction, b: Builder):
    """The folded constant for ``ins`` (emitted through ``b``), or None if it does not fold."""
    name = ins.op.name
    if not ins.operands or len(ins.results) != 1 or ins.op.has("random"):
        return None
    vals = [constant_value(v) for v in ins.operands]
    if any(v is None for v in vals):
        return None
    t = ins.results[0].type
    ins_t = [v.type for v in ins.operands]
    with np.errstate(all="ignore"):
        if name in _UNARY:
            r = _UNARY[name](_scalar(vals[0], ins_t[0].dtype))
        elif name in _BINARY or (name in _FLOAT_ONLY_BINARY and t.dtype.is_float):
            fn = _BINARY.get(name) or _FLOAT_ONLY_BINARY[name]
            r = fn(_scalar(vals[0], ins_t[0].dtype), _scalar(vals[1], ins_t[1].dtype))
        elif name == "select":
            r = _scalar(vals[1], ins_t[1].dtype) if vals[0] else _scalar(vals[2], ins_t[2].dtype)
        elif name == "cast":
            r = _scalar(vals[0], ins_t[0].dtype)
        elif name in _SHAPE_OPS:
            r = _scalar(vals[0], ins_t[0].dtype)
        elif name == "pad":
            if ins.attrs["value"] != vals[0] and t.numel != ins_t[0].numel:
                return None
            r = _scalar(vals[0], ins_t[0].dtype)
        elif name == "concat":
            if len(set(map(repr, vals))) != 1:
                return None
            r = _scalar(vals[0], ins_t[0].dtype)
        elif name in ("reduce_sum", "reduce_mean", "reduce_max"):
            n = prod(ins_t[0].shape[a] for a in ins.attrs["axes"])
            if n == 0:
                return None
            x = _scalar(vals[0], ins_t[0].dtype)
            if name == "reduce_sum":
                # Summing n equal values: exact only when n*x is what the kernel gets; it is up to rounding.
                if t.dtype.is_float and n > 1:
                    r = np.sum(np.full(n, x, dtype=x.dtype), dtype=x.dtype)
                else:
                    r = x * x.dtype.type(n) if n != 1 else x
            else:
                r = x
        else:
            return None
    return b.op("constant", value=_to_attr(r, t.dtype), shape=t.shape, dtype=t.dtype)


def _fold_rule(ins, b):
    return fold_instruction(ins, b)


_fold_rule.__name__ = "fold"


class _AllOps(dict):
    def get(self, key, default=None):  # every op is offered to the folding rule
        return [_fold_rule]


def fold(module: Module) -> Module:
    """Fold every instruction computing on splat constants into a splat constant."""
    return Module([rewrite_function(f, _AllOps())[0] for f in module])
