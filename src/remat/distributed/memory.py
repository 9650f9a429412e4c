"""What a step holds, by kind: parameters, gradients, optimizer state, activations, ...

``kinds`` labels every value of a training step from its layout (which arguments are parameters
and optimizer state) and the roles of the values (what flows into a collective or an update's
gradient operand). The VM measures bytes by these labels (``VM.set_kinds``, ``run(...,
by_kind=True)``: ``RunStats.by_kind``); ``predicted`` gives the same split from the simulator of
record, and the two agree byte for byte.
"""
from __future__ import annotations

from ..ir import Function
from ..ir.ops.collective import COLLECTIVES as _COMM
from ..ir.ops.optim import UPDATE_OPS
from ..accounting import KindBytes

KINDS = ("parameters", "gradients", "reduced gradients", "optimizer state", "activations", "communication", "inputs")
"""``gradients``: the backward's (this rank's batch); ``reduced gradients``: what the collectives
return (all of them under ``ddp``/``zero1``, this rank's shards under ``zero2``) and their shards;
``communication``: buffers
that exist only to be communicated (padded or sharded parameters, all-gathered parameters, the
non-finite guard's scalar flag);
``inputs``: the batch, buffers, constants, seed and step counter."""

_MOVES = frozenset({"reshape", "pad", "slice"})


def _guard_flag(operands) -> bool:
    """The operands of the non-finite guard's all_reduce: one scalar selected by a ``nonfinite`` flag."""
    if len(operands) != 1 or operands[0].type.rank != 0:
        return False
    sel = getattr(operands[0], "instr", None)
    cond = getattr(sel.operands[0], "instr", None) if sel is not None and sel.op.name == "select" else None
    return cond is not None and cond.op.name == "nonfinite"


def kinds(fn: Function, n_params: int, state_args: range) -> dict:
    """The kind of every parameter and result value of a straight-line step ``fn``."""
    out: dict = {}
    for i, p in enumerate(fn.params):
        out[p] = "parameters" if i < n_params else "optimizer state" if i in state_args else "inputs"
    instrs = fn.entry.instrs
    # Gradients: what flows (through reshape/pad/slice) into a gradient collective or an update's
    # gradient operand, found backwards; then everything downstream of a collective's result.
    grad: set = set()
    flags = {ins for ins in instrs if ins.op.name == "all_reduce" and _guard_flag(ins.operands)}
    for ins in reversed(instrs):
        name = ins.op.name
        if ins in flags:  # the non-finite guard agreeing on its flag (distributed.passes._agreed_flag)
            continue
        if name in ("all_reduce", "reduce_scatter"):
            grad.update(ins.operands)
        elif name in UPDATE_OPS:
            grad.add(ins.operands[1])
        elif name in _MOVES and any(r in grad for r in ins.results):
            grad.update(ins.operands)
    for ins in instrs:
        name = ins.op.name
        for k, r in enumerate(ins.results):
            src = ins.operands[ins.op.aliases[k]] if k in ins.op.aliases else None
            if src is not None and src in out:
                out[r] = out[src]  # views and in-place results share their operand's storage
            elif ins in flags:
                out[r] = "communication"
            elif name in ("all_reduce", "reduce_scatter") or (
                    name in _MOVES and any(out.get(o) == "reduced gradients" for o in ins.operands)):
                out[r] = "reduced gradients"
            elif r in grad:
                out[r] = "gradients"
            elif name == "all_gather" or (name in _MOVES and any(out.get(o) in ("parameters", "communication")
                                                                 for o in ins.operands)):
                out[r] = "communication"
            else:
                out[r] = "activations"
    return out


def predicted(fn: Function, n_params: int, state_args: range) -> KindBytes | None:
    """Per-kind bytes of ``fn`` predicted by the simulator of record (``remat.plan.simulator.simulate``),
    which the VM measures with ``run(..., by_kind=True)`` (None when ``fn`` is not straight-line)."""
    from ..plan.simulator import simulate

    if len(fn.blocks) != 1:
        return None
    return simulate(fn, kinds=kinds(fn, n_params, state_args)).by_kind
