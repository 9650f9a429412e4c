"""Building IR from IR: clone instructions through a value map, slice a function, inline a body.

These are the copying primitives the planners and the training-step builder share, so that every
copy keeps the same op, attributes, result types and dialect.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .analysis import ancestors
from .core import Block, BlockArg, Builder, Function, Instruction, Value


def clone_into(b: Builder, ins: Instruction, vmap: dict[Value, Value]) -> Instruction:
    """Insert at ``b`` a copy of the non-branching ``ins`` with its operands mapped through ``vmap``;
    record its results in ``vmap`` and return the copy."""
    if ins.successors:
        raise ValueError(f"clone_into copies straight-line instructions; '{ins.op.name}' branches")
    # A copy of a built instruction: its attributes are already checked and its result types known,
    # so the type rule and attribute coercion (most of ``Builder.create``'s time) are skipped.
    new = b._insert(Instruction(ins.op, [vmap[o] for o in ins.operands], ins.attrs,
                                [r.type for r in ins.results], dialect=ins.dialect, loc=ins.loc))
    for r, nr in zip(ins.results, new.results):
        vmap[r] = nr
    if ins.recomputes is not None:
        new.recomputes = vmap.get(ins.recomputes)
    return new


def move_into(b: Builder, ins: Instruction, vmap: dict[Value, Value]) -> Instruction:
    """:func:`clone_into` without the copy: insert ``ins`` itself at ``b``, taken over from its
    block, its operands mapped through ``vmap`` and its results recorded there as themselves.
    For a function built only to be rebuilt around (its own block is left unusable): the result
    is the program :func:`clone_into` would give, less one allocation per instruction and value."""
    if ins.successors:
        raise ValueError(f"move_into moves straight-line instructions; '{ins.op.name}' branches")
    ins.operands = [vmap[o] for o in ins.operands]
    b._insert(ins)
    for r in ins.results:
        vmap[r] = r
    if ins.recomputes is not None:
        ins.recomputes = vmap.get(ins.recomputes)
    return ins


def single_block(f: Function, why: str = "stage splitting") -> Block:
    """``f``'s only block, or a ValueError saying that ``why`` needs straight-line code."""
    if len(f.blocks) != 1:
        raise ValueError(f"@{f.name} has {len(f.blocks)} blocks; {why} needs straight-line code "
                         "(inline calls and avoid data-dependent branches inside a stage)")
    return f.entry


def slice_function(name: str, params: Sequence[Value], instrs: Iterable[Instruction],
                   results: Sequence[Value]) -> Function:
    """A new function computing ``results`` from ``params`` with the needed subset of ``instrs``.

    ``params`` are values of the source function that become the new parameters; only the
    instructions that ``results`` transitively need (stopping at ``params``) are copied, in order.
    """
    needed = ancestors(results, stop=params)
    pset = set(params)
    for ins in needed:
        for o in ins.operands:
            if isinstance(o, BlockArg) and o not in pset:
                raise ValueError(f"slice '{name}' needs a parameter of the source function that is not among its inputs")
    for r in results:
        if isinstance(r, BlockArg) and r not in pset:
            raise ValueError(f"slice '{name}' needs a parameter of the source function that is not among its inputs")
    f = Function(name, [p.type for p in params], [r.type for r in results])
    vmap: dict[Value, Value] = dict(zip(params, f.params))
    b = Builder(f.entry)
    for ins in instrs:
        if ins in needed:
            clone_into(b, ins, vmap)
    b.ret(*[vmap[r] for r in results])
    return f


def inline_body(b: Builder, f: Function, args: Sequence[Value]) -> list[Value]:
    """Copy the straight-line body of ``f`` at ``b`` with its params bound to ``args``; return its results.

    (The ``inline`` pass replaces ``call`` instructions in a module; this emits a body while building.)
    """
    block = single_block(f, "inlining")
    if len(args) != len(f.params):
        raise ValueError(f"inlining @{f.name}: {len(args)} arguments for {len(f.params)} parameters")
    vmap: dict[Value, Value] = dict(zip(f.params, args))
    for ins in block.instrs[:-1]:
        clone_into(b, ins, vmap)
    return [vmap[v] for v in block.instrs[-1].operands]


__all__ = ["clone_into", "inline_body", "move_into", "single_block", "slice_function"]
