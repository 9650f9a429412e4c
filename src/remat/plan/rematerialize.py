"""Instruction-level rematerialisation of a straight-line IR function on general graphs.

``to_graph`` lowers a function to the abstract :class:`~remat.plan.graph.Graph` the solvers
work on (one node per storage-producing instruction; views such as ``reshape`` are folded into
the storage they alias, so the graph's memory model matches the VM's storage accounting);
``from_schedule`` turns a solver's schedule back into IR: recomputations are clones of the
original instructions, frees are explicit ``free`` instructions, views are re-emitted next to
their uses. The result's peak is then predicted exactly by ``simulator.predict_peak``.

An instruction with several results (e.g. ``batch_norm``: output and statistics) gives one node
per result, each reading the instruction's operands and costing the whole instruction, since
recomputing any one result re-runs it. The first computation of each result comes from one
execution; a result computed again re-runs the instruction, whose other results die unused. The
nodes of one instruction form a group (``Node.group``, led by the first result's node), which
orders keep together (:func:`.scheduling.with_siblings`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Collection

from ..ir import Builder, Function, Instruction, Module, Value, verify
from ..ir.core import BlockArg
from .graph import COMPUTE, FREE, Graph


@dataclass
class Lowered:
    """A function's graph and the correspondence between nodes and IR."""

    fn: Function
    graph: Graph
    node_of: dict[Value, int]                  # storage root value -> node
    instr_of: dict[int, Instruction] = field(default_factory=dict)
    result_of: dict[int, int] = field(default_factory=dict)  # node -> index of its result in instr_of
    arg_of: dict[int, BlockArg] = field(default_factory=dict)
    root: dict[Value, Value] = field(default_factory=dict)  # view value -> its storage root value

    @cached_property
    def peak(self) -> int:
        """The VM's peak of ``fn`` as it is, without recomputation (bytes; ``predict_peak``), computed once."""
        from .simulator import predict_peak

        return predict_peak(self.fn)


def _is_view(ins: Instruction) -> bool:
    return 0 in ins.op.aliases and ins.op.has("view")


def to_graph(fn: Function, costs: dict[Instruction, float] | None = None, pin_args: bool = True,
             workspaces: dict[Instruction, int] | None = None, donated: Collection[int] = (),
             consumed: Collection[int] = ()) -> Lowered:
    """Lower ``fn`` (one block, no calls) to a Graph. ``costs``: seconds per instruction
    (default: 1 per element produced, a stand-in proportional to memory traffic). Arguments are
    inputs live throughout with ``pin_args``, except those at the indices ``donated``, which the
    schedule may release after their last use (``partition.Split.donated``). ``consumed``: indices
    of ``fn``'s results that whatever runs ``fn`` consumes as soon as they are computed (a step's
    gradients, each updating its parameter at once, ``StepProblem.consumed``): their bytes are the
    producing node's workspace, live while it computes, instead of its output's, held to the end."""
    if len(fn.blocks) != 1:
        raise ValueError(f"@{fn.name} has {len(fn.blocks)} blocks; rematerialisation works on straight-line code")
    g = Graph()
    low = Lowered(fn, g, {})
    ret = fn.entry.instrs[-1]
    outputs = set(ret.operands)
    for a in fn.params:
        low.root[a] = a
    out_roots: set[Value] = set()
    # Resolve roots first (views alias their operand's root).
    for ins in fn.entry.instrs[:-1]:
        if ins.op.name in ("free", "call") or len(fn.blocks) != 1:
            raise ValueError(f"@{fn.name}: '{ins.op.name}' is not supported by rematerialisation (run inline first; "
                             "frees are inserted by the planner)")
        for k, r in enumerate(ins.results):
            src = ins.op.aliases.get(k)
            low.root[r] = low.root[ins.operands[src]] if src is not None else r
    out_roots = {low.root[v] for v in outputs}
    # a consumed result is retired when nothing else reads it (or a view of it) and it is returned once
    read = {low.root[o] for ins in fn.entry.instrs[:-1] for o in ins.operands}
    retired = {v for v in (ret.operands[k] for k in consumed) if low.root[v] is v and not isinstance(v, BlockArg)
               and v not in read and sum(1 for w in ret.operands if w is v) == 1}
    for a in fn.params:
        idx = g.add_input(f"arg{a.index}", a.type.nbytes,
                          is_output=pin_args and a.index not in donated or a in out_roots)
        low.node_of[a] = idx
        low.arg_of[idx] = a
    for n, ins in enumerate(fn.entry.instrs[:-1]):
        if _is_view(ins):
            continue
        if len(ins.results) != 1 and ins.op.aliases:
            raise ValueError(f"@{fn.name}: instruction {n} ('{ins.op.name}') updates operands in place; "
                             "plan the function before adding in-place updates")
        inputs = sorted({low.node_of[low.root[o]] for o in ins.operands})
        recomputable = not ins.op.has("effect") and not ins.op.has("inplace")
        lead = None  # the node of the instruction's first result: its siblings' group
        for k, r in enumerate(ins.results):
            cost = costs.get(ins, 0.0) if costs is not None else float(ins.results[0].type.numel)
            name = f"%{n}:{ins.op.name}" + (f"#{k}" if len(ins.results) > 1 else "")
            ws = workspaces.get(ins, 0) if workspaces is not None and k == 0 else 0  # bytes, while it computes
            size = r.type.nbytes
            if r in retired:
                ws, size = ws + size, 0
            idx = g.add_node(name, cost, size, inputs, is_output=r in out_roots, recomputable=recomputable,
                             workspace=ws, group=lead)
            lead = idx if lead is None else lead
            low.node_of[r] = idx
            low.instr_of[idx] = ins
            low.result_of[idx] = k
    return low


def from_schedule(low: Lowered, schedule, name: str | None = None, check: bool = True) -> Function:
    """Build the rematerialised function that executes ``schedule`` on ``low``'s graph."""
    fn = low.fn
    out = Function(name or fn.name, fn.param_types, fn.result_types)
    b = Builder(out.entry)
    current: dict[int, Value] = {}
    for idx, a in low.arg_of.items():
        current[idx] = out.params[a.index]
    # views of a root, in program order, to re-emit next to uses
    view_chain: dict[Value, Instruction] = {}
    for ins in fn.entry.instrs[:-1]:
        if _is_view(ins):
            view_chain[ins.results[0]] = ins

    def value_of(v: Value, cache: dict[Value, Value]) -> Value:
        """The current IR value for original value ``v`` (re-emitting views of live roots)."""
        if v in cache:
            return cache[v]
        if v in view_chain:
            ins = view_chain[v]
            src = value_of(ins.operands[0], cache)
            nv = b.create(ins.op.name, [src], ins.attrs, result_types=[v.type], dialect=ins.dialect,
                          loc=ins.loc).results[0]
        else:
            node = low.node_of[v]
            if node not in current:
                raise ValueError(f"schedule uses node {low.graph[node].name} while it is not live")
            nv = current[node]
        cache[v] = nv
        return nv

    # Per original instruction: its latest execution and the results of it already handed out.
    latest: dict[Instruction, tuple[Instruction, set[int]]] = {}
    first: dict[Instruction, Instruction] = {}  # provenance: the first execution of each instruction
    for step, i in schedule:
        if step == COMPUTE:
            ins, k = low.instr_of[i], low.result_of[i]
            run = latest.get(ins)
            if run is None or k in run[1]:
                cache: dict[Value, Value] = {}
                ops = [value_of(o, cache) for o in ins.operands]
                new = b.create(ins.op.name, ops, ins.attrs, result_types=[r.type for r in ins.results],
                               dialect=ins.dialect, loc=ins.loc)
                if ins in first:
                    new.recomputes = first[ins].results[k]
                else:
                    first[ins] = new
                run = latest[ins] = (new, set())
            run[1].add(k)
            current[i] = run[0].results[k]
        elif step == FREE:
            if i in low.arg_of:
                continue
            v = current.pop(i)
            b.free(v)
        else:
            raise ValueError(f"unknown schedule step {step!r}")
    ret = fn.entry.instrs[-1]
    cache = {}
    b.ret(*[value_of(v, cache) for v in ret.operands])
    if check:
        verify(Module([out]))
    return out
