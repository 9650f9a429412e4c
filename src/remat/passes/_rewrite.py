"""Small helpers shared by the rewriting passes: use counting, value replacement, purity."""
from __future__ import annotations

from collections import defaultdict

from typing import Any, Callable

from ..ir import Block, Builder, Function, Instruction, Module, Value


def resolve(repl: dict[Value, Value], v: Value) -> Value:
    """Follow a replacement chain to its end."""
    seen = 0
    while v in repl:
        v = repl[v]
        seen += 1
        if seen > 10_000:
            raise RuntimeError("cycle in value replacements")
    return v


def apply_replacements(f: Function, repl: dict[Value, Value]) -> None:
    """Rewrite every operand and branch argument of ``f`` through ``repl`` (in place, on a clone)."""
    if not repl:
        return
    for ins in f.instructions():
        ins.operands = [resolve(repl, v) for v in ins.operands]
        for s in ins.successors:
            s.args = [resolve(repl, v) for v in s.args]


def rewrite_matches(f: Function, match: Callable[[Instruction, dict[Value, int]], tuple[list[Instruction], Any] | None],
                    emit: Callable[[Builder, Instruction, Any], tuple[Value, Any]]) -> tuple[Function, list]:
    """A copy of ``f`` with each instruction that ``match(ins, uses)`` accepts replaced by what
    ``emit(builder, ins, data)`` builds in its place, and the sites ``emit`` reports.

    ``match`` returns (the other instructions the rewrite removes, all in ``ins``'s block, data for
    ``emit``) or None; ``emit`` returns (the value replacing ``ins``'s first result, a site record).
    ``uses``: each value's use count in ``f``."""
    g = f.clone()
    if g.is_declaration:
        return g, []
    uses = use_counts(g)
    repl: dict[Value, Value] = {}
    sites: list = []
    for blk in g.blocks:
        matches = {}
        for ins in blk.instrs:
            m = match(ins, uses)
            if m is not None and all(d.block is blk for d in m[0]):
                matches[ins] = m
        if not matches:
            continue
        dead = {d for m in matches.values() for d in m[0]}
        out: list[Instruction] = []
        for ins in blk.instrs:
            if ins in matches:
                scratch = Block()
                value, site = emit(Builder(scratch), ins, matches[ins][1])
                for ni in scratch.instrs:
                    ni.block = blk
                out.extend(scratch.instrs)
                repl[ins.results[0]] = value
                sites.append(site)
            elif ins not in dead:
                out.append(ins)
        blk.instrs = out
    apply_replacements(g, repl)
    return g, sites


def use_counts(f: Function) -> dict[Value, int]:
    n: dict[Value, int] = defaultdict(int)
    for ins in f.instructions():
        for v in ins.operands:
            n[v] += 1
        for s in ins.successors:
            for v in s.args:
                n[v] += 1
    return n


def function_is_pure(m: Module | None, name: str, _seen: frozenset[str] = frozenset()) -> bool:
    """True if calling ``name`` has no effect besides its results: no ``free`` and only pure callees.

    Random ops are pure here: they are deterministic functions of their seed operand.
    """
    if m is None or name not in m or name in _seen:
        return False
    f = m[name]
    if f.is_declaration:
        return False
    for ins in f.instructions():
        if ins.op.name == "call":
            if not function_is_pure(m, ins.attrs["callee"], _seen | {name}):
                return False
        elif ins.op.has("effect") and not ins.op.has("terminator"):
            return False
    return True


def is_removable(ins: Instruction, m: Module | None) -> bool:
    """An instruction that may be deleted when its results are unused (and merged by CSE)."""
    if ins.op.has("effect") or ins.op.has("terminator") or ins.successors:
        return False
    if ins.op.name == "call":
        return function_is_pure(m, ins.attrs["callee"])
    return True


def constant_value(v: Value):
    """The splat value of ``v`` if it is defined by a ``constant`` op, else None."""
    ins = getattr(v, "instr", None)
    if ins is not None and ins.op.name == "constant":
        return ins.attrs["value"]
    return None


def splat_value(v: Value):
    """The splat value of a constant, also seen through reshape/broadcast of a constant; else None."""
    ins = getattr(v, "instr", None)
    while ins is not None and ins.op.name in ("reshape", "broadcast"):
        ins = getattr(ins.operands[0], "instr", None)
    return ins.attrs["value"] if ins is not None and ins.op.name == "constant" else None
