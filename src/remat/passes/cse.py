"""Common subexpression elimination by structural hashing: two instructions with the same op,
attributes, operands, result types and dialect compute the same values, so the later one is
replaced by the earlier one when the earlier one dominates it. Effectful instructions (``free``,
``return``, branches, calls to impure functions) are never merged. Random ops are merged only
when their seed operand is the same value (same seed, same attributes: the same samples)."""
from __future__ import annotations

from typing import Any

from ..ir import Block, Function, Instruction, Module, Value
from ..ir.verifier import dominators
from ._rewrite import apply_replacements, is_removable, resolve


def _attr_key(v: Any) -> Any:
    # Distinguish 0 / 0.0 / False and -0.0 / 0.0, and let NaN equal itself.
    return (type(v).__name__, repr(v))


def structural_key(ins: Instruction, repl: dict[Value, Value]) -> tuple:
    """What makes two pure instructions interchangeable."""
    return (ins.op.name, tuple(id(resolve(repl, v)) for v in ins.operands),
            tuple(sorted((k, _attr_key(v)) for k, v in ins.attrs.items())),
            tuple(r.type for r in ins.results), ins.dialect)


def cse_function(f: Function, module: Module | None = None) -> Function:
    """A copy of ``f`` where each repeated pure computation is computed once."""
    g = f.clone()
    if g.is_declaration:
        return g
    dom = dominators(g)
    # Dominator tree children (immediate dominator = the strict dominator dominated by all others).
    children: dict[Block, list[Block]] = {b: [] for b in dom}
    for b, ds in dom.items():
        strict = ds - {b}
        if strict:
            idom = max(strict, key=lambda d: len(dom[d]))
            children[idom].append(b)
    order = {b: i for i, b in enumerate(g.blocks)}
    repl: dict[Value, Value] = {}
    stack = [(g.entry, {})]
    while stack:
        b, inherited = stack.pop()
        table = dict(inherited)
        keep = []
        for ins in b.instrs:
            if ins.results and is_removable(ins, module):
                key = structural_key(ins, repl)
                prev = table.get(key)
                if prev is not None:
                    for r, pr in zip(ins.results, prev.results):
                        repl[r] = pr
                    continue
                table[key] = ins
            keep.append(ins)
        b.instrs = keep
        for c in sorted(children[b], key=order.get, reverse=True):
            stack.append((c, table))
    apply_replacements(g, repl)
    return g


def cse(module: Module) -> Module:
    """Merge structurally equal pure instructions in every function."""
    return Module([cse_function(f, module) for f in module])
