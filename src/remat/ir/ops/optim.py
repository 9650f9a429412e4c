"""Optimizer updates as in-place ops (RAF: the optimizer is generated in the IR).

Each update overwrites the parameter and its state buffers: results alias those operands
(``aliases``), so memory accounting counts them once, and the operands must not be used after
the update (the verifier checks this). ``step`` is the 1-based step count as an i64[] operand.
The formulas follow torch.optim's single-tensor implementations exactly.
"""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import expect_float, max_numel, per_output, rand

STEP = TensorType(DType.i64, ())


def _same(name, types, n):
    p = types[0]
    expect_float(name, p, "parameter")
    for t in types[1:n]:
        if t != p:
            raise TypeError(f"'{name}': parameter, gradient and state must share one type, got {', '.join(map(str, types[:n]))}")
    if types[n] != STEP:
        raise TypeError(f"'{name}': step must be i64[], got {types[n]}")
    return p


def _sgd_infer(types, attrs):
    p = _same("sgd_step", types, 3)
    if attrs["nesterov"] and (attrs["momentum"] <= 0 or attrs["dampening"] != 0):
        raise TypeError("'sgd_step': nesterov needs momentum > 0 and dampening = 0 (as in torch.optim.SGD)")
    return (p, p)


declare(OpDef(
    "sgd_step", 4,
    (Attr("lr", "float"), Attr("momentum", "float", 0.0), Attr("dampening", "float", 0.0),
     Attr("weight_decay", "float", 0.0), Attr("nesterov", "bool", False), Attr("maximize", "bool", False)),
    _sgd_infer, frozenset({"inplace", "effect"}), num_results=2, aliases={0: 0, 1: 2}, nondiff=True,
    doc="SGD with momentum on (param, grad, momentum_buffer, step): updates param and buffer in place", flops=max_numel,
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4), rand(r, 3, 4), np.array(3, dtype=np.int64)],
                             {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
                      Sample([rand(r, 5), rand(r, 5), np.zeros(5), np.array(1, dtype=np.int64)],
                             {"lr": 0.05, "momentum": 0.9, "dampening": 0.1})]))


def _adam_infer(types, attrs):
    p = _same("adam_step", types, 4)
    for k in ("beta1", "beta2"):
        if not 0.0 <= attrs[k] < 1.0:
            raise TypeError(f"'adam_step': {k} must be in [0, 1), got {attrs[k]}")
    return (p, p, p)


declare(OpDef(
    "adam_step", 5,
    (Attr("lr", "float"), Attr("beta1", "float", 0.9), Attr("beta2", "float", 0.999), Attr("eps", "float", 1e-08),
     Attr("weight_decay", "float", 0.0), Attr("decoupled", "bool", False), Attr("maximize", "bool", False)),
    _adam_infer, frozenset({"inplace", "effect"}), num_results=3, aliases={0: 0, 1: 2, 2: 3}, nondiff=True,
    doc="Adam (decoupled=false) or AdamW (decoupled=true) on (param, grad, exp_avg, exp_avg_sq, step), in place",
    flops=per_output(8.0),
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4), rand(r, 3, 4) * 0.1, rand(r, 3, 4, low=0.0, high=0.1),
                              np.array(2, dtype=np.int64)], {"lr": 0.01, "weight_decay": 0.01, "decoupled": True}),
                      Sample([rand(r, 4), rand(r, 4), np.zeros(4), np.zeros(4), np.array(1, dtype=np.int64)],
                             {"lr": 0.001, "weight_decay": 0.1})]))


def _assign_infer(types, attrs):
    dst, src = types
    expect_float("assign", dst, "destination")
    if src.dtype != dst.dtype or src.rank != 1 or src.shape[0] < dst.numel:
        raise TypeError(f"'assign': the source must be a flat {dst.dtype} tensor of at least {dst.numel} elements "
                        f"(the destination's), got {src} for {dst}")
    return dst


declare(OpDef(
    "assign", 2, (), _assign_infer, frozenset({"inplace", "effect"}), aliases={0: 0}, nondiff=True,
    flops=max_numel,
    doc="overwrite a parameter in place with the first numel elements of a flat tensor (ZeRO writes the "
        "all-gathered shards back; trailing padding is dropped)",
    sample=lambda r: [Sample([rand(r, 2, 3), rand(r, 8)]), Sample([rand(r, 4), rand(r, 4)])]))
