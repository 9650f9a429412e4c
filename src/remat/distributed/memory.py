"""What a rank's step holds, by kind: parameters, gradients, optimizer state, activations, ...

``breakdown`` replays the VM's accounting (storages counted once, outputs allocated before the
dying operands are released; ``remat.plan.liveness``) with a kind on every storage, so its totals
are the VM's measured bytes and the split says where they go.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Function

KINDS = ("parameters", "gradients", "reduced gradients", "optimizer state", "activations", "communication", "inputs")
"""``gradients``: the backward's (this rank's batch); ``reduced gradients``: what the collectives
return (all of them under ``ddp``/``zero1``, this rank's shards under ``zero2``) and their shards;
``communication``: buffers
that exist only to be communicated (padded or sharded parameters, all-gathered parameters);
``inputs``: the batch, buffers, constants, seed and step counter."""

_COMM = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
_MOVES = frozenset({"reshape", "pad", "slice"})


@dataclass
class Breakdown:
    """Bytes per kind: live at the step's peak, and each kind's own peak over the step."""

    at_peak: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    allocated: dict[str, int] = field(default_factory=dict)  # fresh storages over the step (arguments included)


def kinds(fn: Function, n_params: int, state_args: range) -> dict:
    """The kind of every parameter and result value of a straight-line step ``fn``."""
    out: dict = {}
    for i, p in enumerate(fn.params):
        out[p] = "parameters" if i < n_params else "optimizer state" if i in state_args else "inputs"
    instrs = fn.entry.instrs
    # Gradients: what flows (through reshape/pad/slice) into a gradient collective or an update's
    # gradient operand, found backwards; then everything downstream of a collective's result.
    grad: set = set()
    for ins in reversed(instrs):
        name = ins.op.name
        if name in ("all_reduce", "reduce_scatter"):
            grad.update(ins.operands)
        elif name in ("sgd_step", "adam_step"):
            grad.add(ins.operands[1])
        elif name in _MOVES and any(r in grad for r in ins.results):
            grad.update(ins.operands)
    for ins in instrs:
        name = ins.op.name
        for k, r in enumerate(ins.results):
            src = ins.operands[ins.op.aliases[k]] if k in ins.op.aliases else None
            if src is not None and src in out:
                out[r] = out[src]  # views and in-place results share their operand's storage
            elif name in ("all_reduce", "reduce_scatter") or (
                    name in _MOVES and any(out.get(o) == "reduced gradients" for o in ins.operands)):
                out[r] = "reduced gradients"
            elif r in grad:
                out[r] = "gradients"
            elif name == "all_gather" or (name in _MOVES and any(out.get(o) in ("parameters", "communication")
                                                                 for o in ins.operands)):
                out[r] = "communication"
            else:
                out[r] = "activations"
    return out


def breakdown(fn: Function, n_params: int, state_args: range) -> Breakdown | None:
    """Per-kind bytes of ``fn`` (None when it is not straight-line code without calls)."""
    from ..ir.liveness import liveness

    if len(fn.blocks) != 1 or any(i.op.name == "call" for i in fn.entry.instrs):
        return None
    kind_of = kinds(fn, n_params, state_args)
    lv = liveness(fn)
    sid: dict = {}
    storages: dict[int, list] = {}  # id -> [refs, bytes, kind]
    live = {k: 0 for k in KINDS}
    res = Breakdown({k: 0 for k in KINDS}, {k: 0 for k in KINDS}, 0, {k: 0 for k in KINDS})

    def ref(s: int) -> None:
        storages[s][0] += 1

    def new(v) -> None:
        s = len(storages)
        storages[s] = [1, v.type.nbytes, kind_of[v]]
        live[kind_of[v]] += v.type.nbytes
        res.allocated[kind_of[v]] += v.type.nbytes
        sid[v] = s

    def release(v) -> None:
        s = sid.pop(v)
        e = storages[s]
        e[0] -= 1
        if e[0] == 0:
            live[e[2]] -= e[1]

    def note() -> None:
        total = sum(live.values())
        for k in KINDS:
            res.peaks[k] = max(res.peaks[k], live[k])
        if total > res.peak_bytes:
            res.peak_bytes, res.at_peak = total, dict(live)

    for p in fn.params:
        new(p)
    note()
    params = set(fn.params)
    for ins in fn.entry.instrs:
        if ins.op.name == "return":
            break
        if ins.op.name != "free":
            for k, r in enumerate(ins.results):
                if k in ins.op.aliases:
                    s = sid[ins.operands[ins.op.aliases[k]]]
                    ref(s)
                    sid[r] = s
                else:
                    new(r)
        note()
        for v in lv.dies_at.get(ins, ()):
            if v not in params and v in sid:
                release(v)
    return res
