"""Optimizer updates as in-place ops (RAF: the optimizer is generated in the IR).

Each update overwrites the parameter and its state buffers: results alias those operands
(``aliases``), so memory accounting counts them once, and the operands must not be used after
the update (the verifier checks this). ``step`` is the 1-based step count as an i64[] operand;
``hyper`` the param group's hyperparameters as an f64 vector operand (``SGD_HYPER``,
``ADAM_HYPER``: read at every step, so learning-rate schedules and changed settings need no
recompile); ``skip`` a bool[] operand: when true the update changes nothing (``torch.amp.GradScaler``'s
``found_inf``: the step's loss or a gradient was not finite, :func:`nonfinite`); what changes the
update's form (``nesterov``, ``maximize``, ``decoupled``) is an attribute. The formulas follow
torch.optim's single-tensor implementations exactly.
"""
from __future__ import annotations

import numpy as np

from ..opdef import Attr, OpDef, Sample, declare
from ..types import DType, TensorType
from ._util import expect_float, max_numel, per_output, rand

STEP = TensorType(DType.i64, ())
UPDATE_OPS = ("sgd_step", "adam_step")
"""The ops that update a parameter (their first operand) and its optimizer state in place; their
operands end with the 1-based step count, the hyperparameters and the skip flag."""

SKIP = TensorType(DType.bool, ())
"""The ``skip`` operand of the updates: true leaves parameter and state untouched."""

SGD_HYPER = ("lr", "momentum", "dampening", "weight_decay")
"""``sgd_step``'s ``hyper`` operand, in order (torch.optim.SGD's param-group entries)."""
ADAM_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")
"""``adam_step``'s ``hyper`` operand, in order (``betas`` is two entries)."""
HYPER = {"sgd_step": SGD_HYPER, "adam_step": ADAM_HYPER}


def hyper_type(op: str) -> TensorType:
    """The type of the ``hyper`` operand of the update op ``op``."""
    return TensorType(DType.f64, (len(HYPER[op]),))


def _same(name, types, n):
    p = types[0]
    expect_float(name, p, "parameter")
    for t in types[1:n]:
        if t != p:
            raise TypeError(f"'{name}': parameter, gradient and state must share one type, got {', '.join(map(str, types[:n]))}")
    if types[n] != STEP:
        raise TypeError(f"'{name}': step must be i64[], got {types[n]}")
    if types[n + 1] != hyper_type(name):
        raise TypeError(f"'{name}': hyper must be {hyper_type(name)} ({', '.join(HYPER[name])}), got {types[n + 1]}")
    if types[n + 2] != SKIP:
        raise TypeError(f"'{name}': skip must be {SKIP} (true: leave parameter and state untouched), got {types[n + 2]}")
    return p


def _hyper(op: str, **values: float) -> np.ndarray:
    return np.array([values[k] for k in HYPER[op]], dtype=np.float64)


_NO, _YES = np.array(False), np.array(True)  # samples' skip operands


def _nonfinite_infer(types, attrs):
    for t in types:
        expect_float("nonfinite", t)
    return SKIP


declare(OpDef(
    "nonfinite", None, (), _nonfinite_infer, frozenset(), nondiff=True, flops=lambda ins, outs, attrs: float(
        sum(t.numel for t in ins)),
    doc="true when any element of any operand is NaN or infinite (the step's loss and gradients: the "
        "updates' skip operand, as torch.amp.GradScaler's found_inf)",
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 5)]), Sample([rand(r, 2), np.array([1.0, np.inf])]),
                      Sample([np.array(np.nan)]), Sample([rand(r, 3)])]))


declare(OpDef(
    "sgd_step", 6, (Attr("nesterov", "bool", False), Attr("maximize", "bool", False)),
    lambda types, attrs: (_same("sgd_step", types, 3),) * 2, frozenset({"inplace", "effect"}), num_results=2,
    aliases={0: 0, 1: 2}, nondiff=True,
    doc="SGD with momentum on (param, grad, momentum_buffer, step, hyper = [lr, momentum, dampening, "
        "weight_decay], skip): updates param and buffer in place unless skip", flops=max_numel,
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4), rand(r, 3, 4), np.array(3, dtype=np.int64),
                              _hyper("sgd_step", lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01), _NO]),
                      Sample([rand(r, 5), rand(r, 5), np.zeros(5), np.array(1, dtype=np.int64),
                              _hyper("sgd_step", lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.0), _NO]),
                      Sample([rand(r, 5), rand(r, 5), rand(r, 5), np.array(2, dtype=np.int64),
                              _hyper("sgd_step", lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0), _NO],
                             {"nesterov": True}),
                      Sample([rand(r, 5), np.array([1.0, np.nan, 0.0, np.inf, 2.0]), rand(r, 5), np.array(2, dtype=np.int64),
                              _hyper("sgd_step", lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.1), _YES])]))


declare(OpDef(
    "adam_step", 7, (Attr("decoupled", "bool", False), Attr("maximize", "bool", False)),
    lambda types, attrs: (_same("adam_step", types, 4),) * 3, frozenset({"inplace", "effect"}), num_results=3,
    aliases={0: 0, 1: 2, 2: 3}, nondiff=True,
    doc="Adam (decoupled=false) or AdamW (decoupled=true) on (param, grad, exp_avg, exp_avg_sq, step, hyper = "
        "[lr, beta1, beta2, eps, weight_decay], skip), in place unless skip",
    flops=per_output(8.0),
    sample=lambda r: [Sample([rand(r, 3, 4), rand(r, 3, 4), rand(r, 3, 4) * 0.1, rand(r, 3, 4, low=0.0, high=0.1),
                              np.array(2, dtype=np.int64),
                              _hyper("adam_step", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01), _NO],
                             {"decoupled": True}),
                      Sample([rand(r, 4), rand(r, 4), np.zeros(4), np.zeros(4), np.array(1, dtype=np.int64),
                              _hyper("adam_step", lr=0.001, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1), _NO]),
                      Sample([rand(r, 4), np.array([np.nan, 1.0, -np.inf, 0.5]), rand(r, 4) * 0.1,
                              rand(r, 4, low=0.0, high=0.1), np.array(3, dtype=np.int64),
                              _hyper("adam_step", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01), _YES],
                             {"decoupled": True})]))


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
