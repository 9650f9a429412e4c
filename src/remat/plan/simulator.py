"""The memory simulator of record: static peak prediction from IR types, and explicit frees.

Values die where the IR analysis ``remat.ir.liveness`` says: after their last use in a block
(when not live-out), right after their definition when never used, at block entry for unused block
arguments, or on a CFG edge when live out of the predecessor but not into the successor. Returned
values are outputs and never die inside the function.

The VM (``remat.runtime.vm``) releases values exactly at these points, and ``predict_peak``
replays the VM's accounting from IR types alone, counting on the same
:class:`remat.accounting.StorageCounter` as the VM's tracker, so the two agree byte for byte:

* a value's storage is a fresh buffer of ``type.nbytes`` bytes, except results that the op
  ``aliases`` to an operand (``reshape`` views, in-place optimizer updates), which share it, and
  element-wise results written over a dying operand (``remat.ir.reuse.buffer_reuse``);
* a storage counts while any live value references it;
* per instruction, outputs are allocated while the operands are still live (the peak is measured
  there), then the values dying at that instruction are released;
* function parameters belong to the caller and stay live for the whole run unless donated; a
  callee's parameters are references that die at their last use inside the callee.

``simulate(fn, kinds=...)`` also splits the bytes by the kinds given to the values, as the VM
measures them with ``run(..., by_kind=True)``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Collection, Iterator, Mapping

from ..accounting import OTHER, KindBytes, KindCounter, StorageCounter, TimelineEntry
from ..ir import Block, Builder, Function, Instruction, Module, Successor, Value
from ..ir.liveness import liveness
from ..ir.reuse import buffer_reuse


# ---------------------------------------------------------------- explicit frees
def insert_frees(fn: Function, donate: bool = False) -> Function:
    """A copy of ``fn`` with an explicit ``free`` wherever the VM would release a value.

    Frees go right after the dying instruction (after its block's leading arguments for unused
    arguments); values dying at a branch go to the start of the successor, on a new edge block
    when the successor has several predecessors. Parameters are freed only when ``donate``.
    Values already freed by an explicit ``free`` are left alone. The VM's accounting of the result
    equals that of ``fn`` (same release points).
    """
    g = fn.clone()
    lv = liveness(g)
    params = set(g.params) if not donate else set()
    preds: dict[Block, int] = {b: 0 for b in g.blocks}
    for b in g.blocks:
        t = b.terminator
        for s in (t.successors if t is not None else ()):
            preds[s.block] += 1

    def keep(vs):
        return [v for v in vs if v not in params]

    entry_frees: dict[Block, list[Value]] = {b: keep(lv.dead_args.get(b, ())) for b in g.blocks}
    new_blocks: list[tuple[Block, Block]] = []  # (edge block, insert before this block)
    for b in list(g.blocks):
        pos = 0  # position just after ``ins`` in the growing list
        for ins in list(b.instrs):
            pos += 1
            vs = keep(lv.dies_at.get(ins, ()))
            if ins.op.name == "free":
                vs = [v for v in vs if v not in ins.operands]
            if not ins.op.has("terminator"):
                if vs:
                    Builder(b, pos).free(*vs)
                    pos += 1
                continue
            for i, s in enumerate(ins.successors):
                kills = vs + keep(lv.edge_kills.get((b, i), ()))
                kills = sorted(set(kills), key=lv.order.__getitem__)
                if not kills:
                    continue
                if preds[s.block] == 1:
                    entry_frees[s.block] = kills + entry_frees[s.block]
                else:  # split the edge: a block that frees, then jumps on with the same arguments
                    e = Block([a.type for a in s.block.args])
                    e.function = g
                    eb = Builder(e)
                    eb.free(*kills)
                    eb.br(s.block, *e.args)
                    ins.successors[i] = Successor(e, list(s.args))
                    new_blocks.append((e, s.block))
    for b, vs in entry_frees.items():
        if vs:
            Builder(b, 0).free(*sorted(set(vs), key=lv.order.__getitem__))
    for e, before in new_blocks:
        g.blocks.insert(g.blocks.index(before), e)
    return g


def insert_frees_pass(module: Module) -> Module:
    """Pass: make every release explicit with ``free`` in every function (parameters are kept)."""
    return Module([insert_frees(f) if not f.is_declaration else f.clone() for f in module])


# ---------------------------------------------------------------- static prediction
@dataclass
class MemoryPrediction:
    """What ``predict_peak`` simulates: the same quantities the VM measures (bytes)."""

    peak_bytes: int
    timeline: list[TimelineEntry]
    live_bytes_at_end: int
    peak_index: int | None  # instruction index where the peak is first reached (None: at entry)
    by_kind: KindBytes | None = None  # simulate(..., kinds=...): as the VM's RunStats.by_kind


def _straight_line(fn: Function) -> None:
    if fn.is_declaration:
        raise ValueError(f"@{fn.name} is a gradient declaration without a body; run the 'grad' pass first")
    if len(fn.blocks) != 1:
        raise NotImplementedError(
            f"predict_peak: @{fn.name} has {len(fn.blocks)} blocks; its peak depends on the branches taken at run "
            f"time. Static prediction covers straight-line functions (calls are inlined); measure branching code "
            f"with remat.run")


def _kept_params(fn: Function, donate: bool | Collection[int]) -> set[Value]:
    """The parameters of ``fn`` its caller keeps: all without ``donate``, none with ``donate=True``,
    else those whose index is not in ``donate`` (the donated ones are released at their last use)."""
    if donate is True:
        return set()
    if not donate:
        return set(fn.params)
    given = set(donate)
    return {p for i, p in enumerate(fn.params) if i not in given}


def _simulate(fn: Function, counter: StorageCounter, keys: Iterator[int], kind_index: Mapping[Value, int] | None,
              arg_keys: list[int] | None, donate: bool | Collection[int],
              timeline: list[TimelineEntry] | None) -> list[int]:
    """Run ``fn``'s accounting on ``counter``; returns the storages of the returned values (one
    reference each, owned by the caller). Fresh storages take the next of ``keys``; ``kind_index``:
    each labelled value's kind index (others: 0, ``OTHER``). ``arg_keys`` None: top level,
    parameters are fresh storages."""
    _straight_line(fn)
    lv = liveness(fn)
    reuse = buffer_reuse(fn)  # element-wise results written over a dying operand (as the VM does)
    add, ref, release = counter.add, counter.acquire_key, counter.release

    def fresh(v: Value) -> int:
        key = next(keys)
        add(key, v.type.nbytes, None, 0 if kind_index is None else kind_index.get(v, 0))
        return key

    env: dict[Value, int] = {}
    top = arg_keys is None
    for i, p in enumerate(fn.params):
        if top:
            env[p] = fresh(p)
        else:
            ref(arg_keys[i])
            env[p] = arg_keys[i]
    keep = _kept_params(fn, donate) if top else set()
    for a in lv.dead_args.get(fn.entry, ()):
        if a not in keep:
            release(env.pop(a))
    for idx, ins in enumerate(fn.entry.instrs):
        if timeline is not None:
            saved = counter.begin_instruction()
        name = ins.op.name
        if name == "return":
            out = [env[v] for v in ins.operands]
            for s in out:
                ref(s)  # the caller's reference
            if not top:
                for s in env.values():
                    release(s)
                env.clear()
            if timeline is not None:
                timeline.append(TimelineEntry(idx, counter.live_bytes, counter.end_instruction(saved)))
            return out
        if name == "call":
            callee = fn.module[ins.attrs["callee"]] if fn.module is not None else None
            if callee is None:
                raise ValueError(f"call to @{ins.attrs['callee']} in @{fn.name}, which belongs to no module")
            outs = _simulate(callee, counter, keys, kind_index, [env[v] for v in ins.operands], True, None)
            for r, s in zip(ins.results, outs):
                env[r] = s
        elif name != "free":
            aliases = ins.op.aliases
            if ins in reuse:
                aliases = {**aliases, 0: reuse[ins]}
            for k, r in enumerate(ins.results):
                if k in aliases:
                    s = env[ins.operands[aliases[k]]]
                    ref(s)
                    env[r] = s
                else:
                    env[r] = fresh(r)
        for v in lv.dies_at.get(ins, ()):
            if v not in keep and v in env:
                release(env.pop(v))
        if timeline is not None:
            timeline.append(TimelineEntry(idx, counter.live_bytes, counter.end_instruction(saved)))
    raise ValueError(f"@{fn.name} does not end with return")


def simulate(fn: Function, donate: bool | Collection[int] = False, kinds: Mapping[Value, str] | None = None,
             granularity: int = 1) -> MemoryPrediction:
    """Simulate the VM's memory accounting of ``fn`` from IR types (straight-line code, calls inlined).

    Assumes each argument is a dense buffer of its parameter type, distinct from the others.
    ``kinds``: labels of ``fn``'s values (as given to ``VM.set_kinds``; values of callees and
    unlabelled ones are ``"other"``) to split the bytes by kind (``MemoryPrediction.by_kind``).
    ``donate``: the parameters released at their last use: none (False), all (True), or those at
    these indices (a block-internal plan's backward, ``partition.Split.donated``).
    ``granularity``: every storage counted rounded up to a multiple of it (bytes; a device
    allocator's rounding, :class:`remat.plan.device.DeviceSpec`); 1 counts as the VM does.
    """
    if granularity > 1:
        if kinds is not None:
            raise ValueError("simulate: kinds and granularity are not counted together")
        counter = _Rounding(granularity)
        kind_index = None
    elif kinds is None:
        counter = StorageCounter()
        kind_index = None
    else:
        names = [OTHER] + sorted(set(kinds.values()) - {OTHER})
        index = {k: i for i, k in enumerate(names)}
        counter = KindCounter(names)
        kind_index = {v: index[k] for v, k in kinds.items()}
    timeline: list[TimelineEntry] = []
    _simulate(fn, counter, itertools.count(), kind_index, None, donate, timeline)
    live = counter.live_bytes
    peak = max([live] + [t.high_water for t in timeline]) if timeline else live
    args = sum(p.type.nbytes for p in fn.params)
    peak = max(peak, args)
    at = next((t.index for t in timeline if t.high_water == peak), None)
    if at is not None and args == peak:
        at = None
    return MemoryPrediction(peak, timeline, live, at, counter.by_kind() if kinds is not None else None)


class _Rounding(StorageCounter):
    """A storage counter whose storages take their bytes rounded up to a multiple of ``granularity``."""

    __slots__ = ("granularity",)

    def __init__(self, granularity: int) -> None:
        super().__init__()
        self.granularity = granularity

    def add(self, key, nbytes: int, owner=None, kind: int = 0) -> None:
        g = self.granularity
        super().add(key, -(-nbytes // g) * g, owner, kind)


def predict_peak(fn: Function, donate: bool | Collection[int] = False) -> int:
    """The peak live bytes the VM will measure when running ``fn`` (see :func:`simulate`): the
    counter's high-water mark over the whole run, without :func:`simulate`'s per-instruction
    timeline (the planners call this for every candidate program)."""
    counter = StorageCounter()
    _simulate(fn, counter, itertools.count(), None, None, donate, None)
    return max(counter.peak_bytes, sum(p.type.nbytes for p in fn.params))


__all__ = ["MemoryPrediction", "TimelineEntry", "insert_frees", "insert_frees_pass", "predict_peak", "simulate"]
