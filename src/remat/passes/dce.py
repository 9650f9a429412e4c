"""Dead code elimination: drop instructions whose results are unused and that have no effects,
unused arguments of non-entry blocks (with the branch arguments feeding them) and unreachable
blocks. Effects (``return``, branches, calls to impure functions) are always kept; a ``free`` is
not a use: a value computed only to be freed (a planned program's recomputation whose result
nothing reads) goes with the instruction computing it, and the ``free`` drops it. Random ops are
pure (deterministic functions of their seed) and may go."""
from __future__ import annotations

from collections import defaultdict

from ..ir import Function, Module, Value
from ..ir.verifier import reachable
from ._rewrite import is_removable, use_counts


def dce_function(f: Function, module: Module | None = None) -> Function:
    """A copy of ``f`` without dead instructions, dead block arguments and unreachable blocks."""
    return dce_in_place(f.clone(), module)


def dce_in_place(g: Function, module: Module | None = None) -> Function:
    """:func:`dce_function` on ``g`` itself (returned): for a function its caller just built, such as
    a planner's compiled schedule, where a copy would cost more than the pass."""
    if g.is_declaration:
        return g
    reach = reachable(g)
    g.blocks = [b for b in g.blocks if b in reach]
    changed = True
    while changed:
        changed = False
        uses = use_counts(g)
        freed = _freed(g)
        for b in g.blocks:
            keep = []
            for ins in reversed(b.instrs):
                if ins.results and all(uses.get(r, 0) == freed.get(r, 0) for r in ins.results) and is_removable(ins, module):
                    for v in ins.operands:
                        uses[v] -= 1
                    changed = True
                    continue
                keep.append(ins)
            b.instrs = keep[::-1]
        _drop_frees_of_undefined(g)
        # Unused arguments of non-entry blocks: remove them and what every branch passes to them.
        uses = use_counts(g)
        for b in g.blocks[1:]:
            dead = [a for a in b.args if uses.get(a, 0) == 0]
            if not dead:
                continue
            changed = True
            keep_idx = [i for i, a in enumerate(b.args) if uses.get(a, 0) != 0]
            for p in g.blocks:
                t = p.terminator
                for s in t.successors if t else ():
                    if s.block is b:
                        s.args = [s.args[i] for i in keep_idx]
            b.args = [b.args[i] for i in keep_idx]
            for k, a in enumerate(b.args):
                a.index = k
    return g


def _freed(f: Function) -> dict[Value, int]:
    """How many of each value's uses are ``free`` instructions."""
    n: dict[Value, int] = defaultdict(int)
    for ins in f.instructions():
        if ins.op.name == "free":
            for v in ins.operands:
                n[v] += 1
    return n


def _drop_frees_of_undefined(f: Function) -> None:
    """Remove from each ``free`` the values whose instruction DCE removed (and a ``free`` left empty)."""
    defined = {v for v in f.params} | {a for b in f.blocks for a in b.args}
    defined |= {r for ins in f.instructions() for r in ins.results}
    for b in f.blocks:
        keep = []
        for ins in b.instrs:
            if ins.op.name == "free" and any(v not in defined for v in ins.operands):
                ins.operands = [v for v in ins.operands if v in defined]
                if not ins.operands:
                    continue
            keep.append(ins)
        b.instrs = keep


def dce(module: Module) -> Module:
    """Remove dead code from every function (see :func:`dce_function`)."""
    return Module([dce_function(f, module) for f in module])
