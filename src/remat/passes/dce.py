"""Dead code elimination: drop instructions whose results are unused and that have no effects,
unused arguments of non-entry blocks (with the branch arguments feeding them) and unreachable
blocks. Effects (``free``, ``return``, branches, calls to impure functions) are always kept;
random ops are pure (deterministic functions of their seed) and may go."""
from __future__ import annotations

from ..ir import Function, Module
from ..ir.verifier import reachable
from ._rewrite import is_removable, use_counts


def dce_function(f: Function, module: Module | None = None) -> Function:
    """A copy of ``f`` without dead instructions, dead block arguments and unreachable blocks."""
    g = f.clone()
    if g.is_declaration:
        return g
    reach = reachable(g)
    g.blocks = [b for b in g.blocks if b in reach]
    changed = True
    while changed:
        changed = False
        uses = use_counts(g)
        for b in g.blocks:
            keep = []
            for ins in reversed(b.instrs):
                if ins.results and all(uses.get(r, 0) == 0 for r in ins.results) and is_removable(ins, module):
                    for v in ins.operands:
                        uses[v] -= 1
                    changed = True
                    continue
                keep.append(ins)
            b.instrs = keep[::-1]
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


def dce(module: Module) -> Module:
    """Remove dead code from every function (see :func:`dce_function`)."""
    return Module([dce_function(f, module) for f in module])
