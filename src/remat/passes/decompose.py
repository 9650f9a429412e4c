"""``decompose``: composite ops expanded into the ops their declaration's decomposition emits.

A composite op (``linear``, ``layer_norm``, ``attention``, ``softmax_grad``, …) has a native
kernel in the dialects that claim it, and a decomposition in its declaration
(:func:`remat.ir.opdef.def_decomposition`). A dialect without a kernel for it runs it through the
decomposition (thunder's executors: unclaimed composites fall back to their decomposition):
:func:`decompose_unclaimed` expands exactly the instructions that no enabled dialect accepts, and
``remat.compile`` and the DSL run it before planning, so the predicted peak is that of the program
the VM runs. The ``decompose`` pass of the registry expands every composite (useful to compare a
composite's kernel with its primitives, or to feed a backend that knows only primitives).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from .. import backends
from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.opdef import DecomposeFn
from ._rewrite import apply_replacements, resolve


def expand_matching(module: Module, match: Callable[[Instruction], bool], rule: DecomposeFn) -> Module:
    """A copy of ``module`` with every instruction ``match`` accepts replaced by what ``rule(b, xs,
    attrs)`` builds (:func:`expand_function`); ``module`` itself when nothing matches."""
    if not any(match(ins) for f in module for ins in f.instructions()):
        return module
    out = module.clone()
    for f in out:
        if not f.is_declaration:
            expand_function(f, match, lambda ins: rule if match(ins) else None)
    return out


def expand_function(f: Function, expand: Callable[[Instruction], bool],
                    rule_of: Callable[[Instruction], DecomposeFn | None] = lambda ins: ins.op.decompose) -> int:
    """Replace, in place, every instruction of ``f`` that has a decomposition and ``expand(ins)`` by
    its decomposition; instructions the expansion emits are considered in turn (a composite made of
    composites expands all the way). Returns how many instructions were expanded. ``rule_of``: an
    instruction's expansion (default: its op's declared decomposition; None: none).

    Each emitted instruction keeps the source location of the one it replaces. Raises TypeError when
    a decomposition returns values of other types than the op's results, and ValueError when one
    emits its own op (it would never finish).
    """
    repl: dict[Value, Value] = {}
    origin: dict[Instruction, frozenset[str]] = {}  # the ops an emitted instruction was expanded from
    count = 0
    for block in f.blocks:
        i = 0
        while i < len(block.instrs):
            ins = block.instrs[i]
            rule = rule_of(ins)
            if rule is None or not expand(ins):
                i += 1
                continue
            came_from = origin.get(ins, frozenset())
            if ins.op.name in came_from:
                raise ValueError(f"the decomposition of '{sorted(came_from)[0]}' emits '{ins.op.name}', "
                                 f"which expands back into itself")
            b = Builder(block, index=i, loc=ins.loc)
            outs = list(rule(b, [resolve(repl, v) for v in ins.operands], dict(ins.attrs)))
            got, want = [v.type for v in outs], [r.type for r in ins.results]
            if got != want:
                raise TypeError(f"the decomposition of '{ins.op.name}' gives {', '.join(map(str, got)) or 'nothing'}; "
                                f"the op's results are {', '.join(map(str, want))}")
            for new in block.instrs[i:b.index]:
                origin[new] = came_from | {ins.op.name}
            del block.instrs[b.index]  # the composite itself, now after its expansion
            origin.pop(ins, None)
            for r, v in zip(ins.results, outs):
                repl[r] = v
            count += 1  # i stays: the emitted instructions are visited next
    apply_replacements(f, repl)
    return count


def decompose(module: Module, ops: Iterable[str] | None = None) -> Module:
    """A copy of ``module`` with the composite ops named in ``ops`` (default: every op that has a
    decomposition) expanded."""
    names = None if ops is None else set(ops)
    out = module.clone()
    for f in out:
        if not f.is_declaration:
            expand_function(f, lambda ins: names is None or ins.op.name in names)
    return out


def decompose_unclaimed(module: Module, dialects: Sequence[str] | str | None = None) -> Module:
    """A copy of ``module`` in which the composite instructions that none of ``dialects`` (default:
    the enabled ones) has a kernel for are expanded; ``module`` itself when there are none."""
    names = backends.resolve(dialects)

    def unclaimed(ins: Instruction) -> bool:
        return not backends.claims(ins, names)

    if not any(ins.op.decompose is not None and unclaimed(ins) for f in module for ins in f.instructions()):
        return module
    out = module.clone()
    for f in out:
        if not f.is_declaration:
            expand_function(f, unclaimed)
    return out


def decompose_pass(module: Module) -> Module:
    """The ``decompose`` pass: every composite op expanded."""
    return decompose(module)


__all__ = ["decompose", "decompose_pass", "decompose_unclaimed", "expand_function"]
