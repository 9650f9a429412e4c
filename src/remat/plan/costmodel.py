"""A static cost model: estimated seconds per instruction from its arithmetic and memory traffic.

Plans made with it are deterministic (the same model and budget give the same plan on any
machine), unlike plans made from measured timings. Rates are nominal CPU figures; only ratios
between instructions matter to the planners.
"""
from __future__ import annotations

from ..ir import Function, Instruction

FLOPS_PER_SECOND = 2e10   # nominal sustained arithmetic rate
BYTES_PER_SECOND = 1e10   # nominal memory bandwidth
OVERHEAD_SECONDS = 2e-6   # per-instruction dispatch


def flops(ins: Instruction) -> float:
    """Estimated floating-point operations of one instruction, by its op's declared cost rule
    (``OpDef.flops``; views, constants and control ops declare 0)."""
    rule = ins.op.flops
    if rule is None:
        raise ValueError(f"op '{ins.op.name}' declares no cost rule (OpDef.flops); the planners cannot price it. "
                         "Declare one with the op, e.g. flops=max_numel from remat.ir.ops._util")
    return float(rule([o.type for o in ins.operands], [r.type for r in ins.results], ins.attrs))


def instruction_cost(ins: Instruction) -> float:
    """Estimated seconds: arithmetic or memory traffic, whichever dominates, plus dispatch."""
    if ins.op.has("view") or ins.op.has("control"):
        return 0.0
    traffic = sum(o.type.nbytes for o in ins.operands) + sum(r.type.nbytes for r in ins.results)
    return max(flops(ins) / FLOPS_PER_SECOND, traffic / BYTES_PER_SECOND) + OVERHEAD_SECONDS


def function_cost(fn: Function) -> float:
    return sum(instruction_cost(i) for b in fn.blocks for i in b.instrs)


def static_costs(fn: Function) -> dict[Instruction, float]:
    return {i: instruction_cost(i) for b in fn.blocks for i in b.instrs}
