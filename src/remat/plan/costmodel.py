"""A static cost model: estimated seconds per instruction from its arithmetic and memory traffic.

Plans made with it are deterministic (the same model and budget give the same plan on any
machine), unlike plans made from measured timings. Rates are nominal CPU figures; only ratios
between instructions matter to the planners.
"""
from __future__ import annotations

from math import prod

from ..ir import Function, Instruction

FLOPS_PER_SECOND = 2e10   # nominal sustained arithmetic rate
BYTES_PER_SECOND = 1e10   # nominal memory bandwidth
OVERHEAD_SECONDS = 2e-6   # per-instruction dispatch


def flops(ins: Instruction) -> float:
    """Estimated floating-point operations of one instruction."""
    op = ins.op
    if not ins.results:
        return 0.0
    out = ins.results[0].type
    if op.has("view") or op.has("constant") or op.name in ("free", "return", "call"):
        return 0.0
    if op.flops is not None:  # the op's own cost rule, declared with it
        return float(op.flops([o.type for o in ins.operands], [r.type for r in ins.results], ins.attrs))
    if op.name == "conv2d":
        w = ins.operands[1].type.shape
        return 2.0 * out.numel * prod(w[1:])
    if op.name == "conv2d_input_grad":
        w = ins.operands[1].type.shape
        return 2.0 * ins.operands[0].type.numel * prod(w[1:])
    if op.name == "conv2d_weight_grad":
        return 2.0 * ins.operands[1].type.numel * prod(out.shape[1:])
    if op.name in ("max_pool2d", "avg_pool2d", "max_pool2d_grad", "avg_pool2d_grad"):
        k = ins.attrs.get("kernel", (1, 1))
        return float(max(out.numel, ins.operands[0].type.numel) * prod(k))
    if op.name in ("softmax", "log_softmax", "gelu", "erf", "adam_step"):
        return 8.0 * out.numel
    return float(max([out.numel] + [o.type.numel for o in ins.operands]))


def instruction_cost(ins: Instruction) -> float:
    """Estimated seconds: arithmetic or memory traffic, whichever dominates, plus dispatch."""
    if ins.op.has("view") or ins.op.name in ("free", "return"):
        return 0.0
    traffic = sum(o.type.nbytes for o in ins.operands) + sum(r.type.nbytes for r in ins.results)
    return max(flops(ins) / FLOPS_PER_SECOND, traffic / BYTES_PER_SECOND) + OVERHEAD_SECONDS


def function_cost(fn: Function) -> float:
    return sum(instruction_cost(i) for b in fn.blocks for i in b.instrs)


def static_costs(fn: Function) -> dict[Instruction, float]:
    return {i: instruction_cost(i) for b in fn.blocks for i in b.instrs}
