"""Liveness of SSA values: per-block live-in/live-out sets by backward data-flow over the CFG and,
from them, where each value dies: after its last use in a block (when it is not live-out), right
after its definition when never used, at block entry for unused block arguments, or on a CFG edge
when it is live out of the predecessor but not live into the successor. Returned values are
outputs and never die inside the function.

A pure IR analysis: the VM (``remat.runtime.vm``) releases values at these points, and the memory
simulator of record (``remat.plan.simulator``) replays that accounting from types.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .core import Block, BlockArg, Function, Instruction, Value


@dataclass
class Liveness:
    """Where every value of a function dies. Value lists follow definition order.

    ``dies_at[ins]``: values whose last use is ``ins`` (not the operands of ``return``, which are
    outputs), followed by ``ins``'s own results that are never used.
    ``dead_args[block]``: block arguments never used (released on entry).
    ``edge_kills[(block, i)]``: values live out of ``block`` but not into its ``i``-th successor.
    """

    fn: Function
    live_in: dict[Block, frozenset[Value]]
    live_out: dict[Block, frozenset[Value]]
    dies_at: dict[Instruction, tuple[Value, ...]]
    dead_args: dict[Block, tuple[BlockArg, ...]]
    edge_kills: dict[tuple[Block, int], tuple[Value, ...]]
    order: dict[Value, int] = field(repr=False, default_factory=dict)

    def last_use(self) -> dict[Value, Instruction | Block | tuple[Block, int] | None]:
        """For each value, where it dies: an instruction, a block (unused argument), an edge, or
        None (returned, or never dies)."""
        out: dict[Value, object] = {v: None for v in self.order}
        for ins, vs in self.dies_at.items():
            for v in vs:
                out[v] = ins
        for b, vs in self.dead_args.items():
            for v in vs:
                out[v] = b
        for e, vs in self.edge_kills.items():
            for v in vs:
                if out[v] is None:
                    out[v] = e
        return out


def _uses(ins: Instruction) -> list[Value]:
    vs = list(ins.operands)
    for s in ins.successors:
        vs.extend(s.args)
    return vs


def liveness(fn: Function) -> Liveness:
    """Backward data-flow liveness over the CFG of ``fn`` and the death point of every value."""
    if fn.is_declaration:
        raise ValueError(f"@{fn.name} is a gradient declaration without a body; run the 'grad' pass first")
    order: dict[Value, int] = {}
    for b in fn.blocks:
        for a in b.args:
            order[a] = len(order)
        for ins in b.instrs:
            for r in ins.results:
                order[r] = len(order)
    live_in, live_out = _block_liveness(fn)
    key = order.__getitem__
    dies_at: dict[Instruction, tuple[Value, ...]] = {}
    dead_args: dict[Block, tuple[BlockArg, ...]] = {}
    edge_kills: dict[tuple[Block, int], tuple[Value, ...]] = {}
    for b in fn.blocks:
        live = set(live_out[b])
        for ins in reversed(b.instrs):
            dead = [r for r in ins.results if r not in live]
            live.difference_update(ins.results)
            last: list[Value] = []
            for v in (_uses(ins) if ins.successors else ins.operands):
                if v not in live:
                    live.add(v)
                    if ins.op.name != "return":
                        last.append(v)
            # Several results can share the slot; sort for a deterministic order.
            vs = (sorted(set(last), key=key) if len(last) > 1 else last) + dead
            if vs:
                dies_at[ins] = tuple(vs)
        dead_args[b] = tuple(a for a in b.args if a not in live)
        if b not in live_in:  # one block, no successors: what it reads before defining, but its arguments
            live_in[b] = live.difference(b.args)
        t = b.terminator
        for i, s in enumerate(t.successors if t is not None else ()):
            ks = live_out[b] - live_in[s.block]
            if ks:
                edge_kills[(b, i)] = tuple(sorted(ks, key=key))
    return Liveness(fn, {b: frozenset(v) for b, v in live_in.items()}, {b: frozenset(v) for b, v in live_out.items()},
                    dies_at, {b: a for b, a in dead_args.items() if a}, edge_kills, order)


def _block_liveness(fn: Function) -> tuple[dict[Block, set[Value]], dict[Block, set[Value]]]:
    """Live-in and live-out sets of ``fn``'s blocks by backward data-flow to a fixed point. A
    function of one block without successors needs none: nothing is live out of it, and its
    live-in set (left out here) is what :func:`liveness`'s backward walk finds live at its start."""
    if len(fn.blocks) == 1 and (fn.entry.terminator is None or not fn.entry.terminator.successors):
        return {}, {fn.entry: set()}
    gen: dict[Block, set[Value]] = {}
    kill: dict[Block, set[Value]] = {}
    succs: dict[Block, list[Block]] = {}
    for b in fn.blocks:
        defined = set(b.args)
        g: set[Value] = set()
        for ins in b.instrs:
            for v in _uses(ins):
                if v not in defined:
                    g.add(v)
            defined.update(ins.results)
        gen[b], kill[b] = g, defined
        t = b.terminator
        succs[b] = [s.block for s in t.successors] if t is not None else []
    live_in: dict[Block, set[Value]] = {b: set(gen[b]) for b in fn.blocks}
    live_out: dict[Block, set[Value]] = {b: set() for b in fn.blocks}
    changed = True
    while changed:
        changed = False
        for b in reversed(fn.blocks):
            out = set().union(*(live_in[s] for s in succs[b])) if succs[b] else set()
            inn = gen[b] | (out - kill[b])
            if out != live_out[b] or inn != live_in[b]:
                live_out[b], live_in[b], changed = out, inn, True
    return live_in, live_out


__all__ = ["Liveness", "liveness"]
