"""The workspace term of the memory model: bytes kernels allocate beyond their IR results.

The VM counts IR values exactly (``predict_peak`` == measured VM peak), so workspaces are kept
as a separate, clearly named term: ``allocator_bound`` adds each instruction's kernel workspace
(measured per kernel and shape by ``remat.runtime.allocator.kernel_workspace``) to the VM's
high-water mark at that instruction. A plan whose VM peak is at most ``budget - max workspace``
has an allocator bound within the budget, whatever it recomputes: recomputation repeats the
program's own kernels on the same shapes.
"""
from __future__ import annotations

from typing import Collection, Mapping

from ..ir import Function, Instruction
from .simulator import simulate


def allocator_bound(fn: Function, ws: Mapping[Instruction, int], donate: Collection[int] = ()) -> int:
    """The allocator peak of running ``fn`` on the VM (bytes), bounded from the VM's exact
    accounting: the largest of the arguments' bytes and, over the instructions, the high-water
    mark (operands live, results allocated) plus the kernel's workspace ``ws`` (absent: 0).
    ``donate``: indices of parameters released at their last use (``simulator.simulate``)."""
    sim = simulate(fn, donate)
    instrs = fn.entry.instrs
    return max([sum(p.type.nbytes for p in fn.params)]
               + [t.high_water + ws.get(instrs[t.index], 0) for t in sim.timeline])


def allocator_excess(fn: Function, ws: Mapping[Instruction, int], limit: int) -> int | None:
    """The index of the first instruction of ``fn`` whose high-water mark plus workspace (as in
    :func:`allocator_bound`) exceeds ``limit`` bytes, or None."""
    instrs = fn.entry.instrs
    return next((t.index for t in simulate(fn).timeline if t.high_water + ws.get(instrs[t.index], 0) > limit), None)


def workspace_margin(fn: Function, ws: Mapping[Instruction, int]) -> int:
    """The largest workspace of ``fn``'s instructions: what a budget keeps free for kernels."""
    return max([0] + [ws.get(ins, 0) for ins in fn.entry.instrs])


__all__ = ["allocator_bound", "allocator_excess", "workspace_margin"]
