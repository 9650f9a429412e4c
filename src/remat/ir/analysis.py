"""Value-level analyses of straight-line IR: what a set of values depends on.

Block-level analyses (predecessors, reachability, dominators) live with the verifier that uses them.
"""
from __future__ import annotations

from typing import Iterable

from .core import BlockArg, Instruction, Value


def ancestors(values: Iterable[Value], stop: Iterable[Value] = ()) -> set[Instruction]:
    """The instructions ``values`` transitively depend on, not looking past the values in ``stop``."""
    stop = set(stop)
    found: set[Instruction] = set()
    stack = [v for v in values if v not in stop]
    while stack:
        v = stack.pop()
        if isinstance(v, BlockArg) or v.instr in found:
            continue
        found.add(v.instr)
        stack.extend(o for o in v.instr.operands if o not in stop)
    return found


__all__ = ["ancestors"]
