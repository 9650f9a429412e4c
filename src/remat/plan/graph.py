"""Abstract computation graph and its exact memory model, which every graph solver plans on.

Every rematerialization solver in this package (MILP, greedy, scheduler) works on
a :class:`Graph` and emits a *schedule*: a list of steps ``("compute", i)`` /
``("free", i)``.  :func:`evaluate` is the solvers' cost model of such a schedule;
every graph solver measures its result with it.  The simulator of record for a program
is :func:`remat.plan.simulator.simulate` (the IR the plan lowers to), which the
portfolio checks every plan against.

Memory model (all sizes in bytes, costs in seconds):

* Nodes are stored in a topological order; ``inputs`` are indices of earlier nodes.
* Nodes with ``is_input`` (parameters, data) are live from the start and count
  toward memory from the start.  They can never be (re)computed.  An input that is
  not also an output may be freed (after its last use); mark it ``is_output`` to pin
  it for the whole run (e.g. parameters that the caller keeps alive).
* ``("compute", i)`` requires every input of ``i`` to be live and ``i`` itself not
  live.  *During* the compute, memory = live bytes + ``bytes[i]`` + ``workspace[i]``;
  afterwards ``i`` is live (``live += bytes[i]``; workspace is released).
* ``("free", i)`` requires ``i`` live and removes it (``live -= bytes[i]``).
* Every non-input node must be computed at least once (nothing is dead-code
  eliminated here); a node with ``recomputable=False`` exactly once.  A node can be
  computed again only after it has been freed.
* At the end every ``is_output`` node must be live.
* peak = max over all moments (the start, during every compute, after every step).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..errors import BudgetTooSmall  # noqa: F401  (raised by every graph solver)
from .record import ScheduleError, Solution

Step = tuple[str, int]  # ("compute" | "free", node index)
Schedule = list[Step]

COMPUTE = "compute"
FREE = "free"


@dataclass(frozen=True)
class Node:
    """One value-producing operation (or an input value) of a :class:`Graph`."""

    name: str
    cost: float  # compute time in seconds, >= 0 (0 for inputs)
    bytes: int  # size of the output value in bytes, >= 0
    inputs: tuple[int, ...] = ()  # indices of earlier nodes (deduplicated, ordered)
    is_input: bool = False  # live from the start, never computed
    is_output: bool = False  # must be live at the end
    recomputable: bool = True  # False: computed exactly once (random/effectful/pinned)
    workspace: int = 0  # transient bytes live only while this node computes
    group: int | None = None  # the first node of the siblings one execution computes (None: alone)


class Graph:
    """A DAG of :class:`Node` in topological order (node ``i`` only reads ``j < i``)."""

    def __init__(self, nodes: Iterable[Node] = ()) -> None:
        self._nodes: list[Node] = []
        self._names: dict[str, int] = {}
        self._consumers: list[list[int]] | None = None
        for nd in nodes:
            self._append(nd)

    # ------------------------------------------------------------------ building
    def add_input(self, name: str, bytes: int, *, is_output: bool = False) -> int:
        """Add an input value (parameter/data) live from the start; returns its index."""
        return self._append(Node(name, 0.0, bytes, (), True, is_output, False, 0))

    def add_node(
        self,
        name: str,
        cost: float,
        bytes: int,
        inputs: Sequence[int] = (),
        *,
        is_output: bool = False,
        recomputable: bool = True,
        workspace: int = 0,
        group: int | None = None,
    ) -> int:
        """Add a computed node reading ``inputs`` (earlier indices); returns its index.

        ``group``: the index of an earlier node that the same execution computes (one result of a
        multi-result instruction per node, :func:`.rematerialize.to_graph`), reading the same
        inputs. Orders keep a group's nodes together (:func:`.scheduling.with_siblings`): apart,
        the later ones would keep the group's inputs alive for a computation that costs nothing."""
        return self._append(
            Node(name, cost, bytes, tuple(inputs), False, is_output, recomputable, workspace, group)
        )

    def _append(self, nd: Node) -> int:
        idx = len(self._nodes)
        nd = self._validated(nd, idx)
        self._nodes.append(nd)
        self._names[nd.name] = idx
        self._consumers = None
        return idx

    def _validated(self, nd: Node, idx: int) -> Node:
        label = f"node {idx} ({nd.name!r})"
        if not isinstance(nd.name, str) or not nd.name:
            raise ValueError(f"node {idx}: name must be a non-empty string, got {nd.name!r}")
        if nd.name in self._names:
            raise ValueError(f"{label}: duplicate name (already node {self._names[nd.name]})")
        try:
            cost = float(nd.cost)
        except (TypeError, ValueError):
            raise ValueError(f"{label}: cost must be a number, got {nd.cost!r}") from None
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"{label}: cost must be finite and >= 0, got {nd.cost!r}")
        size = _as_nonneg_int(nd.bytes, f"{label}: bytes")
        work = _as_nonneg_int(nd.workspace, f"{label}: workspace")
        ins: list[int] = []
        for j in nd.inputs:
            jj = _as_nonneg_int(j, f"{label}: input index")
            if jj >= idx:
                raise ValueError(
                    f"{label}: input {jj} is not an earlier node (graph must be in topological order)"
                )
            if jj not in ins:
                ins.append(jj)
        if nd.is_input:
            if ins:
                raise ValueError(f"{label}: an input node cannot have inputs")
            if cost != 0:
                raise ValueError(f"{label}: an input node must have cost 0, got {cost}")
            if work:
                raise ValueError(f"{label}: an input node cannot have a workspace")
        group = nd.group
        if group is not None:
            group = _as_nonneg_int(group, f"{label}: group")
            if group >= idx or self._nodes[group].is_input or self._nodes[group].group is not None:
                raise ValueError(f"{label}: group {group} is not an earlier computed node leading a group")
            if set(self._nodes[group].inputs) != set(ins):
                raise ValueError(f"{label}: a group's nodes read the same inputs; node {group} reads "
                                 f"{list(self._nodes[group].inputs)}, this one {ins}")
        return Node(
            nd.name,
            cost,
            size,
            tuple(ins),
            bool(nd.is_input),
            bool(nd.is_output),
            bool(nd.recomputable) and not nd.is_input,
            work,
            group,
        )

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._nodes)

    def __getitem__(self, i: int) -> Node:
        return self._nodes[i]

    def __iter__(self) -> Iterator[Node]:
        return iter(self._nodes)

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes)

    def index(self, name: str) -> int:
        return self._names[name]

    @property
    def consumers(self) -> list[list[int]]:
        """``consumers[i]``: indices of the nodes that read node ``i`` (ascending)."""
        if self._consumers is None:
            cons: list[list[int]] = [[] for _ in self._nodes]
            for k, nd in enumerate(self._nodes):
                for j in nd.inputs:
                    cons[j].append(k)
            self._consumers = cons
        return self._consumers

    @property
    def compute_nodes(self) -> list[int]:
        """Indices of the non-input nodes, in topological order."""
        return [i for i, nd in enumerate(self._nodes) if not nd.is_input]

    @property
    def base_cost(self) -> float:
        """Total cost of computing every node exactly once (no rematerialization)."""
        return float(sum(nd.cost for nd in self._nodes))

    def num_edges(self) -> int:
        return sum(len(nd.inputs) for nd in self._nodes)

    def __repr__(self) -> str:
        n_in = sum(nd.is_input for nd in self._nodes)
        n_out = sum(nd.is_output for nd in self._nodes)
        return (
            f"Graph({len(self)} nodes: {n_in} inputs, {len(self) - n_in} computed, "
            f"{n_out} outputs, {self.num_edges()} edges)"
        )

    def permuted(self, order: Sequence[int]) -> tuple["Graph", list[int]]:
        """Relabel so that the compute nodes appear in ``order`` (a topological order).

        Inputs keep their relative order and come first.  Returns the new graph and
        ``old_of_new`` (new index -> old index), used to map schedules back.
        """
        check_order(self, order)
        old_of_new = [i for i, nd in enumerate(self._nodes) if nd.is_input] + list(order)
        new_of_old = {o: k for k, o in enumerate(old_of_new)}
        lead: dict[int, int] = {}  # a group (its old first node) -> its first node in the new order
        for k, o in enumerate(old_of_new):
            key = self._nodes[o].group if self._nodes[o].group is not None else o
            lead.setdefault(key, k)
        g = Graph()
        for k, o in enumerate(old_of_new):
            nd = self._nodes[o]
            first = lead[nd.group if nd.group is not None else o]
            g._append(
                Node(
                    nd.name,
                    nd.cost,
                    nd.bytes,
                    tuple(new_of_old[j] for j in nd.inputs),
                    nd.is_input,
                    nd.is_output,
                    nd.recomputable,
                    nd.workspace,
                    None if first == k else first,
                )
            )
        return g, old_of_new


def _as_nonneg_int(v: object, what: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} must be an integer, got {v!r}")
    try:
        iv = int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer, got {v!r}") from None
    if iv != v:
        raise ValueError(f"{what} must be an integer, got {v!r}")
    if iv < 0:
        raise ValueError(f"{what} must be >= 0, got {v!r}")
    return iv


def check_order(graph: Graph, order: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``order`` lists every compute node once, topologically."""
    order = list(order)
    comp = graph.compute_nodes
    if sorted(order) != comp:
        missing = set(comp) - set(order)
        extra = [o for o in order if o not in set(comp)]
        raise ValueError(
            f"order must list every non-input node exactly once "
            f"(missing {sorted(missing)[:5]}, unexpected/duplicate {extra[:5] or 'duplicates'})"
        )
    pos = {v: k for k, v in enumerate(order)}
    for v in order:
        for u in graph[v].inputs:
            if not graph[u].is_input and pos[u] > pos[v]:
                raise ValueError(
                    f"order is not topological: {graph[v].name!r} comes before its input {graph[u].name!r}"
                )


_NODE_ARRAYS: "weakref.WeakKeyDictionary[Graph, tuple[int, tuple[np.ndarray, ...]]]" = weakref.WeakKeyDictionary()


def node_arrays(graph: Graph) -> tuple[np.ndarray, ...]:
    """The graph as compiled loops (:mod:`._greedy_kernels`, :mod:`._schedule_kernels`) read it: its nodes' inputs (CSR:
    ``indptr``, ``indices``), costs, input and output flags, bytes as floats and as integers,
    workspaces and recomputable flags. Kept per graph (nodes are only ever appended)."""
    kept = _NODE_ARRAYS.get(graph)
    if kept is not None and kept[0] == len(graph):
        return kept[1]
    nodes = graph.nodes
    indptr = np.zeros(len(nodes) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(nd.inputs) for nd in nodes])
    out = (indptr, np.array([j for nd in nodes for j in nd.inputs], dtype=np.int64),
           np.array([nd.cost for nd in nodes], dtype=float), np.array([nd.is_input for nd in nodes], dtype=bool),
           np.array([nd.is_output for nd in nodes], dtype=bool), np.array([nd.bytes for nd in nodes], dtype=float),
           np.array([nd.bytes for nd in nodes], dtype=np.int64), np.array([nd.workspace for nd in nodes], dtype=np.int64),
           np.array([nd.recomputable for nd in nodes], dtype=bool))
    _NODE_ARRAYS[graph] = (len(graph), out)
    return out


# ---------------------------------------------------------------------- simulation
def evaluate(graph: Graph, schedule: Sequence[Step]) -> tuple[float, int]:
    """Validate ``schedule`` and return ``(total_cost_seconds, peak_bytes)``.

    Raises :class:`ScheduleError` naming the offending step and node.
    """
    cost, peak, _ = _run(graph, schedule, want_profile=False)
    return cost, peak


def memory_profile(graph: Graph, schedule: Sequence[Step]) -> list[int]:
    """Bytes in use at every moment: start, then per step (the *during* value for computes)."""
    return _run(graph, schedule, want_profile=True)[2]


def _run(
    graph: Graph, schedule: Sequence[Step], want_profile: bool
) -> tuple[float, int, list[int]]:
    nodes = graph._nodes
    n = len(nodes)
    live = [nd.is_input for nd in nodes]
    times = [0] * n  # number of computes of each node
    mem = sum(nd.bytes for nd in nodes if nd.is_input)  # bytes live now
    peak = mem
    cost = 0.0
    prof = [mem] if want_profile else []
    for t, step in enumerate(schedule):
        try:
            kind, i = step
        except (TypeError, ValueError):
            raise ScheduleError(f"step {t}: expected (kind, index), got {step!r}") from None
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
            raise ScheduleError(f"step {t}: node index {i!r} out of range [0, {n})")
        nd = nodes[i]
        if kind == COMPUTE:
            if nd.is_input:
                raise ScheduleError(f"step {t}: cannot compute input node {i} ({nd.name!r})")
            if live[i]:
                raise ScheduleError(f"step {t}: node {i} ({nd.name!r}) computed while already live")
            if times[i] and not nd.recomputable:
                raise ScheduleError(
                    f"step {t}: node {i} ({nd.name!r}) is not recomputable but is computed again"
                )
            for j in nd.inputs:
                if not live[j]:
                    raise ScheduleError(
                        f"step {t}: computing node {i} ({nd.name!r}) needs input {j} "
                        f"({nodes[j].name!r}) which is not live"
                    )
            during = mem + nd.bytes + nd.workspace
            peak = max(peak, during)
            mem += nd.bytes
            live[i] = True
            times[i] += 1
            cost += nd.cost
            if want_profile:
                prof.append(during)
        elif kind == FREE:
            if not live[i]:
                raise ScheduleError(f"step {t}: freeing node {i} ({nd.name!r}) which is not live")
            live[i] = False
            mem -= nd.bytes
            if want_profile:
                prof.append(mem)
        else:
            raise ScheduleError(f"step {t}: unknown step kind {kind!r}")
    for i, nd in enumerate(nodes):
        if not nd.is_input and times[i] == 0:
            raise ScheduleError(f"node {i} ({nd.name!r}) is never computed")
        if nd.is_output and not live[i]:
            raise ScheduleError(f"output node {i} ({nd.name!r}) is not live at the end")
    return cost, peak, prof


def eager_frees(graph: Graph, compute_order: Sequence[int]) -> Schedule:
    """Turn a sequence of computes (repeats = rematerialization) into a schedule with
    eager frees: every value is freed right after its last use before it is computed
    again (or, for the final instance, after its last use overall) unless it is an
    output.  Inputs that are not outputs are freed after their last use (at the very
    start if unused).  A value with no use in an interval is freed right after it is
    computed.  The result is the lowest-memory schedule for that compute sequence.
    """
    nodes = graph._nodes
    seq = list(compute_order)
    for i in seq:
        if not 0 <= i < len(nodes):
            raise ValueError(f"compute_order: node index {i} out of range")
    # free_after[p]: values to free right after step p (p = -1: before the first compute)
    free_after: dict[int, list[int]] = {}
    last_use: dict[int, int] = {}  # value -> position of last use in its current instance
    # current instance of each value starts at: -1 for inputs, else position of its compute
    start: dict[int, int] = {i: -1 for i, nd in enumerate(nodes) if nd.is_input}

    def close(v: int) -> None:
        """End the current live instance of ``v``: free it after its last use."""
        p = last_use.pop(v, start[v])
        free_after.setdefault(p, []).append(v)

    for p, i in enumerate(seq):
        for j in nodes[i].inputs:
            if j in start:
                last_use[j] = p
        if i in start and not nodes[i].is_input:
            # recomputed: the previous instance must have been freed before here;
            # its last use is strictly before p (uses at p refer to inputs, not i).
            close(i)
        start[i] = p
    for v in list(start):
        if not nodes[v].is_output:
            close(v)
    out: Schedule = []
    for v in free_after.get(-1, []):
        out.append((FREE, v))
    for p, i in enumerate(seq):
        out.append((COMPUTE, i))
        for v in free_after.get(p, []):
            out.append((FREE, v))
    return out


def prune_compute_sequence(graph: Graph, compute_order: Sequence[int]) -> list[int]:
    """Drop computes whose result is never used before the value is computed again
    (or, for the last instance of a non-output, never used afterwards).  Keeps at
    least one compute of every node; never increases cost or peak."""
    nodes = graph._nodes
    seq = list(compute_order)
    changed = True
    while changed:
        changed = False
        count: dict[int, int] = {}
        for i in seq:
            count[i] = count.get(i, 0) + 1
        # scan backwards: used[v] = v is read before its next compute (or needed at end)
        needed = {i for i, nd in enumerate(nodes) if nd.is_output}
        keep = [True] * len(seq)
        for p in range(len(seq) - 1, -1, -1):
            i = seq[p]
            if i not in needed and count[i] > 1:
                keep[p] = False
                count[i] -= 1
                changed = True
                continue
            needed.discard(i)  # earlier instances are not needed by uses after here
            for j in nodes[i].inputs:
                needed.add(j)
        seq = [i for p, i in enumerate(seq) if keep[p]]
    return seq


def schedule_computes(schedule: Sequence[Step]) -> list[int]:
    """The compute steps of a schedule, in order."""
    return [i for k, i in schedule if k == COMPUTE]


def min_memory_lower_bound(graph: Graph) -> int:
    """A valid lower bound (bytes) on the peak of *any* schedule of ``graph``.

    max of: all inputs at the start; all outputs at the end; for every node, its
    inputs + itself + workspace + pinned inputs (inputs that are outputs) at its
    compute moment.
    """
    nodes = graph._nodes
    pinned = {i for i, nd in enumerate(nodes) if nd.is_input and nd.is_output}
    pinned_bytes = sum(nodes[i].bytes for i in pinned)
    lb = sum(nd.bytes for nd in nodes if nd.is_input)
    lb = max(lb, sum(nd.bytes for nd in nodes if nd.is_output))
    for i, nd in enumerate(nodes):
        if nd.is_input:
            continue
        need = pinned_bytes + nd.bytes + nd.workspace
        need += sum(nodes[j].bytes for j in nd.inputs if j not in pinned)
        lb = max(lb, need)
    return lb


def no_remat_schedule(graph: Graph, order: Sequence[int] | None = None) -> Schedule:
    """Every compute node once, in ``order`` (default: index order), eager frees."""
    if order is None:
        order = graph.compute_nodes
    else:
        check_order(graph, order)
    return eager_frees(graph, order)


# ---------------------------------------------------------------------- solutions
def make_plan(
    graph: Graph,
    compute_order: Sequence[int],
    *,
    solver: str,
    status: str,
    seconds: float,
    notes: Sequence[str] = (),
    budget: int | None = None,
    prune: bool = True,
) -> Solution:
    """Build a :class:`~.record.Solution` from a compute sequence: prune, insert eager frees,
    validate and measure with :func:`evaluate` (compiled, :mod:`._schedule_kernels`; the Python
    functions say what is wrong with a sequence that is not valid)."""
    found = _compiled_plan(graph, compute_order, prune)
    if found is None:
        seq = prune_compute_sequence(graph, compute_order) if prune else list(compute_order)
        sched = eager_frees(graph, seq)
        cost, peak = evaluate(graph, sched)
    else:
        sched, cost, peak = found
    return Solution(solver, sched, cost, peak, budget=budget, seconds=seconds, notes=list(notes), status=status,
                    base_cost=graph.base_cost)


def _compiled_plan(graph: Graph, compute_order: Sequence[int], prune: bool) -> tuple[Schedule, float, int] | None:
    """:func:`make_plan`'s schedule, cost and peak by :mod:`._schedule_kernels`, or None when the
    sequence is not valid."""
    from . import _schedule_kernels as k

    seq = np.asarray(list(compute_order), dtype=np.int64)
    if seq.size and (seq.min() < 0 or seq.max() >= len(graph)):
        return None
    indptr, indices, cost, is_input, is_output, _, nbytes, workspace, recomputable = node_arrays(graph)
    if prune:
        seq = k.prune(seq, indptr, indices, is_output)
    kinds, nodes = k.eager_schedule(seq, indptr, indices, is_input, is_output)
    ok, total, peak = k.measure(kinds, nodes, indptr, indices, is_input, is_output, recomputable, nbytes, workspace, cost)
    if not ok:
        return None
    steps = (FREE, COMPUTE)
    return [(steps[a], b) for a, b in zip(kinds.tolist(), nodes.tolist())], float(total), int(peak)
