"""Small recomputed values read from their first run, where the budget has room for them.

A plan recomputes whole runs of instructions: a chain plan re-executes a block's forward, a graph
plan the producers of a dropped value. Some of what it recomputes is small: a batch norm's
statistics, a weight cast to bf16, a dropout mask's folded seed, a step counter. Recomputing such a
value costs a kernel call (the zoo ResNet's stem statistics at 50%: 0.55 ms of one convolution over
the whole batch), while its first run's value, kept to the recomputation's last read, costs its few
bytes. Runs on final straight-line programs (after planning, before fusion): each recomputed
instruction whose read results take at most :data:`SMALL_BYTES` is dropped, its reads read the first
run's results (their frees in between dropped: they live to their last read), and recomputed
instructions left unread by that are dropped too.

The values are the same bits: a recomputation runs the same kernel on the same values (random ops
replay their draws), so a plan's promises carry over. Keeping a value longer can raise the peak: the
rewritten program's VM peak stays within the budget (without one, within the program's own peak),
and a drop whose span (the first run to the last read of its results) holds an instruction
``judge`` rejects is undone, as :mod:`remat.lower.fuse` does for fused groups, the drops keeping
the most bytes first: a step's scalar constants and dropout seeds stay read from their first runs
where a weight cast or a dropout mask beside them does not fit.
"""
from __future__ import annotations

from typing import Callable

from ..ir import Builder, Function, Instruction, Module, Value
from ..ir.build import clone_into
from .fuse import Judge, keep_accepted, within_peak

SMALL_BYTES = 1 << 16
"""The most bytes of read results a dropped recomputation may keep alive from its first run."""


def _first(ins: Instruction, pos: dict[Instruction, int]) -> Instruction | None:
    """The earlier run ``ins`` recomputes, when it is one of the same op and attributes in ``pos``."""
    if ins.recomputes is None:
        return None
    first = getattr(ins.recomputes, "instr", None)
    if (first is None or first not in pos or pos[first] >= pos[ins] or first.op is not ins.op
            or first.attrs != ins.attrs or len(first.results) != len(ins.results)):
        return None
    return first


def find_small(fn: Function, limit: int = SMALL_BYTES) -> list[Instruction]:
    """The recomputed instructions of ``fn``'s single block whose read results take at most
    ``limit`` bytes and whose first run precedes them (views, which cost nothing, and in-place or
    effectful ops excepted)."""
    src = fn.entry.instrs
    pos = {ins: i for i, ins in enumerate(src)}
    used = {v for ins in src if ins.op.name != "free" for v in ins.operands}
    out = []
    for ins in src:
        if ins.op.has("view") or ins.op.has("inplace") or ins.op.has("effect") or ins.op.has("control"):
            continue
        first = _first(ins, pos)
        if first is None:
            continue
        read = [k for k, r in enumerate(ins.results) if r in used]
        if read and all(first.results[k].type == ins.results[k].type for k in read) \
                and sum(ins.results[k].type.nbytes for k in read) <= limit:
            out.append(ins)
    return out


def read_first_runs(fn: Function, first_of: dict[Value, Value], drop: set[Instruction],
                    emit: Callable[[Builder, Instruction, dict], None] | None = None
                    ) -> tuple[Function, dict[Instruction, int], dict[Value, int]]:
    """``fn`` rebuilt with every read of a value of ``first_of`` reading its first run's value instead
    (whose frees are dropped: it lives to its last read), without the instructions of ``drop`` (whose
    frees go too), and ``emit(builder, ins, vmap)`` building ``ins`` where given (else a clone).
    Returns the program, each old instruction's new index and the new index of each first-run
    value's last read. The rewrite of :func:`reuse_small` and of :mod:`remat.lower.bn_recompute`."""
    kept = set(first_of.values())
    gone = {r for ins in drop for r in ins.results} | set(first_of)
    out = Function(fn.name, fn.param_types, fn.result_types)
    vmap: dict[Value, Value] = dict(zip(fn.params, out.params))
    b = Builder(out.entry)
    new_at: dict[Instruction, int] = {}
    last_read: dict[Value, int] = {}
    for ins in fn.entry.instrs:
        new_at[ins] = len(out.entry.instrs)
        if ins.op.name == "free":
            # (a result ``emit`` no longer makes, such as a rewritten batch norm's running averages, goes)
            keep = [vmap[v] for v in ins.operands if v not in kept and v not in gone and v in vmap]
            if keep:
                b.free(*keep)
            continue
        if ins in drop:
            continue
        for v in ins.operands:
            if v in first_of:
                vmap[v] = vmap[first_of[v]]
                last_read[first_of[v]] = new_at[ins]
        if emit is None:
            clone_into(b, ins, vmap)
        else:
            emit(b, ins, vmap)
    return out, new_at, last_read


def _rewrite(fn: Function, items: list[Instruction]) -> tuple[Function, dict[int, tuple[int, int]]]:
    """``fn`` without ``items`` (and the recomputations only they read), their reads reading their
    first runs' results; per item (by ``id``) the span of new indices where it changed what is live."""
    users: dict[Value, list[Instruction]] = {}
    for ins in fn.entry.instrs:
        for v in ins.operands:
            users.setdefault(v, []).append(ins)
    dead = set(items)
    for ins in reversed(fn.entry.instrs):  # recomputations read only by dropped ones (or frees)
        if (ins in dead or ins.recomputes is None or ins.op.has("effect") or ins.op.has("inplace")
                or ins.op.has("control")):
            continue
        if all(u in dead or u.op.name == "free" for r in ins.results for u in users.get(r, ())):
            dead.add(ins)
    first_of = {ins.results[k]: ins.recomputes.instr.results[k] for ins in items for k in range(len(ins.results))}
    out, new_at, last_read = read_first_runs(fn, first_of, dead)
    spans = {}
    for ins in items:
        first = ins.recomputes.instr
        hi = max([last_read.get(r, 0) for r in first.results] + [new_at[ins]])
        spans[id(ins)] = (new_at[first], hi)
    return out, spans


def reuse_small(fn: Function, judge: Judge | None = None, limit: int | None = None,
                small: int = SMALL_BYTES) -> Function:
    """``fn`` with its small recomputations read from their first runs (single-block functions
    without calls; others are returned unchanged). Its VM peak stays within ``limit`` (the budget;
    None: ``fn``'s own peak), and drops whose span holds an instruction ``judge`` objects to are
    left out."""
    if fn.is_declaration or len(fn.blocks) != 1 or any(i.op.name == "call" for i in fn.entry.instrs):
        return fn
    items = find_small(fn, small)
    if not items:
        return fn
    return keep_accepted(fn, items, _rewrite, within_peak(fn, judge, limit), size=_read_bytes)[0]


def _read_bytes(ins: Instruction) -> int:
    """The bytes a dropped recomputation keeps alive from its first run: its results'."""
    return sum(r.type.nbytes for r in ins.results)


def reuse_small_pass(module: Module) -> Module:
    """Pass: small recomputed values read from their first runs (peak never rises)."""
    return Module([reuse_small(f) for f in module])


__all__ = ["SMALL_BYTES", "find_small", "read_first_runs", "reuse_small", "reuse_small_pass"]
