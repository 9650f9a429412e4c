"""Split a joint forward+backward function into a forward part and a backward part.

A *joint* function maps (primal params..., cotangent params...) to (primal outputs...,
gradients...), as the differentiation pass produces for ``value_and_gradient`` with an explicit
output cotangent. Instructions that depend on a cotangent form the backward; the rest form the
forward. The *tape* is the set of forward values the backward reads (RAF's saved values): what a
checkpointing executor must keep — or recompute — between a stage's forward and its backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..ir import Function, Instruction, Value
from ..ir.analysis import ancestors
from ..ir.build import single_block, slice_function


@dataclass
class Split:
    """The parts of a joint function.

    ``forward(primals) -> (outputs..., tape...)``; ``forward_light(primals) -> outputs``
    (no tape kept); ``backward(kept primals..., tape..., cotangents) -> gradients``.
    ``backward_primals`` are the indices of the primal params the backward reads directly
    (weights: always live); other primals it reads (a stage's input activation) go on the tape.
    ``donated``: indices of the backward's parameters it may release at their last use, the caller
    holding them for nothing after it (a block-internal plan's tape and upstream gradient: the chain
    is done with them once the backward runs). Empty: the caller holds every argument throughout.
    """

    forward: Function
    forward_light: Function
    backward: Function
    n_outputs: int
    backward_primals: list[int]
    n_tape: int
    donated: tuple[int, ...] = ()


def released(n_params_read: int, n_args: int) -> tuple[int, ...]:
    """The arguments a backward ``(params read..., [stage input,] tape..., upstream gradient)`` of
    ``n_args`` arguments may release at their last use: all but the parameters it reads."""
    return tuple(range(n_params_read, n_args))


def donating(split: Split) -> Split:
    """``split`` with its backward releasing every argument but the parameters it reads (its tape
    and upstream gradient) at their last use (``Split.donated``)."""
    return replace(split, donated=released(len(split.backward_primals), len(split.backward.params)))


def split_joint(joint: Function, n_primals: int, n_outputs: int, direct: set[int] | None = None) -> Split:
    """Partition ``joint`` (params: ``n_primals`` primals then cotangents; results: ``n_outputs``
    primal outputs then gradients) into forward and backward functions.

    ``direct``: indices of primals the backward may read as its own inputs (default: all);
    other primals it needs are handed over through the tape.
    """
    block = single_block(joint)
    ret = block.terminator
    if ret is None or ret.op.name != "return":
        raise ValueError(f"@{joint.name} does not end with return")
    primals, cots = joint.params[:n_primals], joint.params[n_primals:]
    body = block.instrs[:-1]
    outputs = ret.operands[:n_outputs]
    grads = ret.operands[n_outputs:]
    # Forward = what the primal outputs need; everything else (cotangent-dependent code, and
    # forward-only code whose results only the backward reads, such as a weight transpose or
    # tanh's 1 - y*y) runs in the backward, so the tape holds exactly what the VJP rules save.
    needed = ancestors(outputs)
    is_bwd: set[Value] = set()
    bwd_instrs: list[Instruction] = []
    for ins in body:
        if ins not in needed:
            bwd_instrs.append(ins)
            is_bwd.update(ins.results)
    is_bwd.update(cots)
    # Tape: forward values read by the backward (or returned as gradients directly).
    tape: list[Value] = []
    seen: set[Value] = set()

    def want(v: Value) -> None:
        if v not in is_bwd and v not in seen:
            seen.add(v)
            tape.append(v)

    for ins in bwd_instrs:
        for o in ins.operands:
            want(o)
    for g in grads:
        want(g)
    # Primal params read by the backward are passed to it directly when allowed.
    primal_index = {p: i for i, p in enumerate(primals) if direct is None or i in direct}
    backward_primals = [primal_index[v] for v in tape if v in primal_index]
    tape_vals = [v for v in tape if v not in primal_index]
    fwd_instrs = [i for i in body if i in needed]
    forward = slice_function(f"{joint.name}_fwd", list(primals), fwd_instrs, list(outputs) + tape_vals)
    light = slice_function(f"{joint.name}_fwd_light", list(primals), fwd_instrs, list(outputs))
    bparams = [primals[i] for i in backward_primals] + tape_vals + list(cots)
    backward = slice_function(f"{joint.name}_bwd", bparams, bwd_instrs, list(grads))
    return Split(forward, light, backward, n_outputs, backward_primals, len(tape_vals))
