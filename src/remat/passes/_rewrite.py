"""Small helpers shared by the rewriting passes: use counting, value replacement, purity."""
from __future__ import annotations

from collections import defaultdict

from ..ir import Function, Instruction, Module, Value


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
