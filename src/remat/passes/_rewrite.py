"""Small helpers shared by the rewriting passes: use counting, value replacement, purity, and which
chains of transposes and reshapes move no data (view chains)."""
from __future__ import annotations

from collections import defaultdict

from typing import Any, Callable

from ..ir import Block, Builder, Function, Instruction, Module, Value


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _view_strides(shape: tuple[int, ...], strides: tuple[int, ...],
                  new_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Strides that read the elements laid out by (``shape``, ``strides``), in their row-major order,
    as ``new_shape``, or None when no strides do (ATen's ``computeStride``: when ``reshape`` is a view)."""
    if not shape or 0 in shape:
        return None
    new = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    base, t_numel, v_numel = strides[-1], 1, 1
    for d in range(len(shape) - 1, -1, -1):
        t_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != t_numel * base):
            while view_d >= 0 and (v_numel < t_numel or new_shape[view_d] == 1):
                new[view_d] = v_numel * base
                v_numel *= new_shape[view_d]
                view_d -= 1
            if v_numel != t_numel:
                return None
            if d > 0:
                base, t_numel, v_numel = strides[d - 1], 1, 1
    return tuple(new) if view_d == -1 else None


Step = tuple[str, tuple[int, ...]]
"""One move of a view chain: ("transpose", perm) or ("reshape", new shape)."""


def keeps_order(shape: tuple[int, ...], steps: list[Step]) -> bool:
    """Whether ``steps`` applied in order to a value of ``shape`` give its elements in their stored
    order: their result is then a reshape of the value (no data moves)."""
    strides = _contiguous_strides(shape)
    for kind, arg in steps:
        if kind == "transpose":
            shape, strides = tuple(shape[i] for i in arg), tuple(strides[i] for i in arg)
        else:
            strides = _view_strides(shape, strides, arg)
            if strides is None:
                return False
            shape = arg
    return all(n == 1 or s == c for n, s, c in zip(shape, strides, _contiguous_strides(shape)))


MAX_VIEW_CHAIN = 6
"""How many transposes and reshapes :func:`view_root` follows back."""


def view_step(ins: Instruction) -> Step:
    """The move a transpose or reshape instruction makes."""
    return ("transpose", tuple(ins.attrs["perm"])) if ins.op.name == "transpose" else ("reshape", ins.results[0].type.shape)


def view_root(v: Value, after: list[Step]) -> tuple[Value, list[Step]] | None:
    """(root, its steps) when ``v``, followed by the moves ``after``, is a reshape of a value ``root``
    it is computed from by transposes and reshapes (the nearest such root; the steps from it, in
    order, ``after`` included), else None."""
    steps = list(after)
    for _ in range(MAX_VIEW_CHAIN):
        d = getattr(v, "instr", None)
        if d is None or d.op.name not in ("transpose", "reshape"):
            return None
        steps.insert(0, view_step(d))
        v = d.operands[0]
        if keeps_order(v.type.shape, steps):
            return v, steps
    return None


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
    ``emit``) or None; ``emit`` returns (the value replacing ``ins``'s first result, or a tuple of
    values replacing its results in order, a site record).
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
                value, site = emit(Builder(scratch, loc=ins.loc), ins, matches[ins][1])
                for ni in scratch.instrs:
                    ni.block = blk
                out.extend(scratch.instrs)
                repl.update(zip(ins.results, value) if isinstance(value, tuple) else [(ins.results[0], value)])
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
