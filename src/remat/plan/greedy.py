"""Compile-time greedy rematerialization (RAF paper, §3.1.5).

Walk a fixed execution order with a complete liveness analysis.  Before running a
node, make sure its inputs are live (recomputing evicted ones, recursively) and that
memory during the node (live + output + workspace) fits the budget; while it does
not, evict the live tensor with the lowest score

    score = recompute_cost * remaining_uses / (bytes * distance_to_next_use)

(RAF's cost function: recomputation latency, remaining use count and size; the
next-use distance — known at compile time — breaks ties the Belady way;
``score="raf"`` drops it; ``score="raf_belady_outputs_last"`` evicts outputs last, see
:data:`SCORES`).  ``recompute_cost`` includes the evicted ancestors that
would have to be recomputed too (DTR's e*).  Only recomputable, non-input tensors
not needed by the node(s) being computed are candidates.  Evicting splits a
tensor's liveness in two intervals, the second starting with a replay.

Inputs that are not outputs (a block-internal plan's stage input and upstream gradient, which
its backward may release: ``partition.Split.donated``) are freed after their last use, for good:
no value can be recomputed from them afterwards. So an evicted value that will be recomputed holds
the inputs its recomputation reads (``held_for``), a value such a recomputation reads is not
dead while it waits (``pending``), and a value reading an input already gone is never evicted.
Graphs whose inputs are all pinned (the step's own arguments) are planned as before, by a compiled
pass (:func:`._greedy_kernels.greedy_pass`) that takes the steps :class:`_Greedy` takes; the class
(Python) plans the others and is the reference the compiled pass is tested against.

The result is a compute sequence; frees are inserted eagerly (:func:`.graph.eager_frees`),
which frees every value no later than the greedy did, so the simulated peak is
<= the greedy's own accounting <= budget.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import Sequence

import numpy as np

from ._greedy_kernels import STUCK, greedy_pass, pick_eviction
from .record import Solution
from .graph import (
    BudgetTooSmall,
    Graph,
    check_order,
    eager_frees,
    make_plan,
    node_arrays,
    min_memory_lower_bound,
    evaluate,
)

__all__ = ["SCORES", "solve_greedy", "try_greedy", "try_greedy_best", "greedy_min_budget", "greedy_compute_sequence"]


NEGLIGIBLE_FRACTION = 10_000
"""Values of at most budget / NEGLIGIBLE_FRACTION bytes are evicted only when no larger one can be.
Evicting one frees next to nothing, yet the score (cost per byte) favours it whenever its
recomputation looks cheap. Batch norm's per-channel statistics, say: evicted early for a few hundred
bytes, they cost the statistics pass over a whole activation when the backward needs them (zoo U-Net
at 50%: predicted overhead +68% instead of +21%)."""


class _Stuck(Exception):
    """Internal: nothing left to evict (or the recomputation blew up)."""


class _Greedy:
    """One greedy run at a fixed budget (bytes)."""

    def __init__(self, graph: Graph, order: Sequence[int], budget: int, score: str, max_steps: int):
        self.g = graph
        self.nodes = graph.nodes
        self.order = list(order)
        self.budget = budget
        self.score = score
        self.outputs_last = score.endswith("_outputs_last")
        self.max_steps = max_steps
        n = len(self.nodes)
        cons = graph.consumers
        # use positions (in the original order) of every value, ascending
        self.use_pos: list[list[int]] = [[] for _ in range(n)]
        for p, v in enumerate(self.order):
            for j in self.nodes[v].inputs:
                self.use_pos[j].append(p)
        self.fut = [len(cons[u]) for u in range(n)]  # first-computations still to read u
        self.live = [nd.is_input for nd in self.nodes]
        # An unpinned input stays while an evicted value with uses left needs it to be recomputed:
        # ``held_for[j]`` counts those values, ``needs[u]`` lists the inputs u's eviction holds.
        self.held_for = [0] * n
        self.needs: dict[int, list[int]] = {}
        self.pending: set[int] = set()  # evicted values that will be recomputed (uses left, or read by such)
        self.done = [False] * n  # computed at least once (only those can be pending, or lead to one)
        self.unpinned = any(nd.is_input and not nd.is_output for nd in self.nodes)
        self.mem = sum(nd.bytes for nd in self.nodes if nd.is_input)  # bytes, >= internal truth
        self.pins = np.zeros(n, dtype=np.int64)
        self.seq: list[int] = []
        self.p = 0  # current position in the original order
        self.evictions = 0
        # Eviction candidates that are live (non-input, recomputable, non-empty): ``_evict_one``
        # scores these (:func:`._greedy_kernels.pick_eviction`), from arrays over the nodes kept
        # current here: ``live_now`` mirrors ``live``; ``uses[u]``, u's remaining reads and 1 for an
        # output (the reads by pending recomputations of a graph with unpinned inputs are counted at
        # each eviction); ``nxt[u]``, the position of its next use from the current position on
        # (none left, an output's included: ``len(order) + 1``).
        self.evictable = [not nd.is_input and nd.recomputable and nd.bytes > 0 for nd in self.nodes]
        self.resident = np.zeros(n, dtype=bool)
        self.cons = cons
        self.tiny = budget // NEGLIGIBLE_FRACTION
        self.arrays = node_arrays(graph)
        self.live_now = np.array(self.live, dtype=bool)
        self.uses = np.array([self.fut[u] + nd.is_output for u, nd in enumerate(self.nodes)], dtype=float)
        self.negligible = np.array([nd.bytes <= self.tiny for nd in self.nodes], dtype=bool)
        self.nxt = np.array([ups[0] if ups else len(self.order) + 1 for ups in self.use_pos], dtype=np.int64)
        self.scratch = np.empty(n)

    # -------------------------------------------------------------- helpers
    def _dead(self, u: int) -> bool:
        nd = self.nodes[u]
        return (self.live[u] and not self.pins[u] and self.fut[u] == 0 and not nd.is_output
                and not self.held_for[u] and not (self.unpinned and self._read_by_pending(u)))

    def _hold_inputs(self, u: int) -> None:
        """Freeing ``u``, which will be recomputed: keep the unpinned inputs its recomputation reads
        (through values that are not live) until it is."""
        nodes, live = self.nodes, self.live
        found: list[int] = []
        seen = {u}
        stack = [u]
        while stack:
            v = stack.pop()
            for j in nodes[v].inputs:
                if j in seen:
                    continue
                seen.add(j)
                if nodes[j].is_input:
                    if not nodes[j].is_output:
                        found.append(j)
                elif not live[j]:
                    stack.append(j)
        if found:
            for j in found:
                self.held_for[j] += 1
            self.needs[u] = found

    def _read_by_pending(self, u: int) -> bool:
        """Whether an evicted value to be recomputed reads ``u`` (through values that are not live)."""
        live, cons, pending, done = self.live, self.cons, self.pending, self.done
        seen = set()
        stack = [u]
        while stack:
            v = stack.pop()
            for c in cons[v]:
                if live[c] or c in seen or not done[c]:
                    continue
                if c in pending:
                    return True
                seen.add(c)
                stack.append(c)
        return False

    def _release_inputs(self, u: int) -> None:
        """``u`` is live again: the inputs its eviction held may go once nothing else needs them."""
        for j in self.needs.pop(u, ()):
            self.held_for[j] -= 1
            if self._dead(j):
                self._free(j)

    def _free(self, u: int) -> None:
        nd = self.nodes[u]
        if not nd.is_input and self.unpinned and (self.fut[u] or nd.is_output or self._read_by_pending(u)):
            self.pending.add(u)  # to be recomputed: the unpinned inputs that takes stay
            self._hold_inputs(u)
        self.live[u] = False
        self.live_now[u] = False
        self.mem -= self.nodes[u].bytes
        self.resident[u] = False

    def _evict_one(self) -> None:
        """Free the resident, unpinned value of the lowest score (:func:`._greedy_kernels.pick_eviction`)."""
        uses = self.uses
        if self.unpinned:  # an evicted value to be recomputed reads it: one use more
            uses = uses.copy()
            nodes, pend = self.nodes, self._read_by_pending
            for u in np.flatnonzero(self.resident & (self.pins == 0)).tolist():
                if not nodes[u].is_output and pend(u):
                    uses[u] += 1
        indptr, indices, cost, is_input, is_output, size = self.arrays[:6]
        u = pick_eviction(indptr, indices, cost, is_input, self.live_now, self.resident, self.pins, uses, size,
                          self.nxt, self.p, self.score != "raf", self.outputs_last, is_output, self.negligible,
                          self.scratch)
        if u < 0:
            raise _Stuck
        self._free(int(u))
        self.evictions += 1

    def _make_room(self, extra: int) -> None:
        while self.mem + extra > self.budget:
            self._evict_one()

    def _compute(self, v: int) -> None:
        nd = self.nodes[v]
        self._make_room(nd.bytes + nd.workspace)
        self.seq.append(v)
        if len(self.seq) > self.max_steps:
            raise _Stuck
        self.live[v] = True
        self.live_now[v] = True
        self.done[v] = True
        self.mem += nd.bytes
        if self.evictable[v]:
            self.resident[v] = True
        if v in self.pending:
            self.pending.discard(v)
            self._release_inputs(v)

    def _materialize(self, u: int) -> None:
        """Make u live (recompute it, and its evicted inputs first)."""
        nd = self.nodes[u]
        if nd.is_input or not nd.recomputable:
            raise _Stuck  # never evicted while needed; defensive
        self._compute_with_inputs(u)
        for j in nd.inputs:
            if self._dead(j):
                self._free(j)

    def _compute_with_inputs(self, u: int) -> None:
        """Compute ``u`` after making its inputs live (rematerialising the missing ones), with
        its inputs pinned so that making room never evicts them."""
        nd = self.nodes[u]
        pinned: list[int] = []
        for j in nd.inputs:  # protect inputs that are already live
            if self.live[j]:
                self._pin(j)
                pinned.append(j)
        first = set(pinned)
        for j in nd.inputs:  # the others, rematerialised unless an earlier one's recomputation made them live
            if j not in first:
                if not self.live[j]:
                    self._materialize(j)
                self._pin(j)
                pinned.append(j)
        self._compute(u)
        for j in pinned:
            self.pins[j] -= 1

    def _pin(self, u: int) -> None:
        self.pins[u] += 1

    # -------------------------------------------------------------- driver
    def run(self) -> list[int]:
        for u, nd in enumerate(self.nodes):  # unused inputs are freed at the start
            if nd.is_input and self._dead(u):
                self._free(u)
        for p, v in enumerate(self.order):
            self._advance(p)
            nd = self.nodes[v]
            self._compute_with_inputs(v)
            for j in nd.inputs:
                self.fut[j] -= 1
                self.uses[j] -= 1
                if self._dead(j):
                    self._free(j)
            if self._dead(v):
                self._free(v)
        # all outputs must be live at the end: pin them one by one
        self._advance(len(self.order))
        outs = [u for u, nd in enumerate(self.nodes) if nd.is_output]
        for u in outs:
            if self.live[u]:
                self._pin(u)
        for u in outs:
            if not self.live[u]:
                self._materialize(u)
                self._pin(u)
        return self.seq

    def _advance(self, p: int) -> None:
        """Move to position ``p`` of the order: the values the node at ``p - 1`` read have their
        next use further on (or none: the end)."""
        self.p = p
        if p:
            use_pos, nxt, end = self.use_pos, self.nxt, len(self.order) + 1
            for j in self.nodes[self.order[p - 1]].inputs:
                ups = use_pos[j]
                k = bisect.bisect_left(ups, p)
                nxt[j] = ups[k] if k < len(ups) else end


def _compiled_pass(graph: Graph, order: Sequence[int], budget: int, score: str, max_steps: int) -> list[int] | None:
    """:class:`_Greedy`'s pass, run by :func:`._greedy_kernels.greedy_pass` (a graph whose inputs
    are all outputs)."""
    arrays = node_arrays(graph)
    indptr = arrays[0]
    n = len(indptr) - 1
    order_arr = np.asarray(order, dtype=np.int64)
    pos = np.full(n, -1, dtype=np.int64)
    pos[order_arr] = np.arange(len(order_arr))
    # use positions: for each input edge (consumer c reads j) that the order computes, c's position
    reader = np.repeat(np.arange(n), np.diff(indptr))
    read = arrays[1]
    at = pos[reader]
    keep = at >= 0
    read, at = read[keep], at[keep]
    by = np.lexsort((at, read))
    use_pos = at[by]
    use_ptr = np.zeros(n + 1, dtype=np.int64)
    use_ptr[1:] = np.cumsum(np.bincount(read, minlength=n))
    negligible = arrays[6] <= budget // NEGLIGIBLE_FRACTION
    seq, k = greedy_pass(arrays + (negligible,), order_arr, use_ptr, use_pos, budget, score != "raf",
                         score.endswith("_outputs_last"), max_steps)
    return None if k == STUCK else seq[:k].tolist()


def greedy_compute_sequence(
    graph: Graph,
    budget: int,
    order: Sequence[int] | None = None,
    *,
    score: str = "raf_belady",
    max_steps: int | None = None,
) -> list[int] | None:
    """One greedy pass; the compute sequence, or None if it got stuck (nothing
    evictable, or more than ``max_steps`` computes)."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r} (expected one of {', '.join(map(repr, SCORES))})")
    order = list(order) if order is not None else graph.compute_nodes
    n = len(graph)
    max_steps = max_steps if max_steps is not None else 200 * n + 10_000
    if not any(nd.is_input and not nd.is_output for nd in graph):
        return _compiled_pass(graph, order, int(budget), score, max_steps)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 4 * n + 1000))
    try:
        return _Greedy(graph, order, int(budget), score, max_steps).run()
    except _Stuck:
        return None
    finally:
        sys.setrecursionlimit(old)


def greedy_min_budget(
    graph: Graph, order: Sequence[int] | None = None, *, score: str = "raf_belady", rel_tol: float = 1e-4,
    max_steps: int | None = None,
) -> int:
    """The smallest budget (to ``rel_tol``) at which the greedy finds a schedule,
    by bisection between :func:`.graph.min_memory_lower_bound` and the no-remat
    peak (where the greedy never evicts).  The greedy is a heuristic, so this is
    not the true minimum; :func:`solve_greedy` guarantees success at or above it.
    ``max_steps`` caps each pass (a pass that recomputes without end counts as failing)."""
    order = list(order) if order is not None else graph.compute_nodes
    lo = min_memory_lower_bound(graph) - 1  # fails (strictly below a lower bound)
    hi = evaluate(graph, eager_frees(graph, order))[1]  # succeeds
    if lo >= hi:
        return hi
    while hi - lo > max(1, int(hi * rel_tol)):
        mid = (lo + hi) // 2
        if greedy_compute_sequence(graph, mid, order, score=score, max_steps=max_steps) is not None:
            hi = mid
        else:
            lo = mid
    return hi


SCORES = ("raf_belady", "raf", "raf_belady_outputs_last")
"""The eviction scores, tried in this order. None dominates: on zoo U-Net at 50% ``raf`` predicts
+30% recomputation where ``raf_belady`` predicts +59%, elsewhere the reverse; a pass costs milliseconds.
``raf_belady_outputs_last`` is ``raf_belady`` evicting outputs (a step's gradients) only when nothing
else can go, negligible values included. The score sees an output's one use far off at the end, so
it favours them; but an evicted output is recomputed at the end, when what its recomputation reads
is long gone, so the chain behind it is recomputed too (and in the step program the optimizer
consumes each gradient as soon as it exists). Zoo U-Net at 50%, graph model: the smallest budget
the greedy meets 9.44 -> 8.59 MB, and at 88% of the model budget +44% recomputation instead of
+78%. Elsewhere evicting an output is what fits (zoo U-Net at batch 4: a 14% higher floor without
the other scores), hence a third score rather than a new rule."""

# A greedy probe that needs more computes than this many times the graph's nodes is abandoned:
# its plan would recompute far beyond the overhead plans may have (the portfolio's max_overhead),
# and an unbounded failing pass is what made refusals take minutes.
PROBE_STEPS_PER_NODE = 8


def _cheapest(tried: list[tuple[str, Solution]]) -> Solution:
    best = min(tried, key=lambda t: t[1].cost)[1]  # min keeps the first on ties
    if len(tried) > 1:
        best.notes.append("greedy scores tried: " + ", ".join(f"{sc} cost {q.cost:.4g} s" for sc, q in tried))
    return best


def try_greedy_best(graph: Graph, budget: int, order: Sequence[int]) -> Solution | None:
    """One bounded pass per score at ``budget`` (:data:`PROBE_STEPS_PER_NODE`): the cheapest plan,
    or None when every pass gets stuck. The portfolio's greedy probe."""
    steps = PROBE_STEPS_PER_NODE * len(graph) + 1000
    tried = [(sc, q) for sc in SCORES if (q := try_greedy(graph, budget, order, score=sc, max_steps=steps)) is not None]
    return _cheapest(tried) if tried else None


def try_greedy(graph: Graph, budget: int, order: Sequence[int], *, score: str = "raf_belady",
               max_steps: int | None = None) -> Solution | None:
    """One greedy pass at ``budget``: its plan, or None when it gets stuck (no search for the
    minimum, so a failed probe costs one bounded pass; planners probing many budgets use this)."""
    t0 = time.perf_counter()
    seq = greedy_compute_sequence(graph, int(budget), order, score=score, max_steps=max_steps)
    if seq is None:
        return None
    return make_plan(graph, seq, solver="greedy", status="heuristic", seconds=time.perf_counter() - t0,
                     notes=[f"RAF-style greedy rematerialization (score={score}) over a {len(order)}-node order"],
                     budget=int(budget))


def solve_greedy(
    graph: Graph,
    budget: int,
    *,
    order: Sequence[int] | None = None,
    score: str | None = None,
) -> Solution:
    """RAF-style greedy rematerialization with peak <= ``budget`` bytes.

    ``score``: one of :data:`SCORES`; None (the default) runs each and keeps the cheapest plan
    (ties: the first), refusing only when all refuse, with the smallest of their minimums.

    ``order``: the execution order to walk (default: index order).  If the greedy
    gets stuck at ``budget`` but ``budget >= greedy_min_budget``, the plan found at
    that tighter budget is returned (it fits too), so any budget at or above the
    reported minimum succeeds.  Otherwise raises :class:`BudgetTooSmall` with
    ``minimum = greedy_min_budget(...)``.
    """
    if score is None:
        tried: list[tuple[str, Solution]] = []
        refusals: list[BudgetTooSmall] = []
        for sc in SCORES:
            try:
                tried.append((sc, solve_greedy(graph, budget, order=order, score=sc)))
            except BudgetTooSmall as e:
                refusals.append(e)
        if not tried:
            raise min(refusals, key=lambda e: e.minimum)
        return _cheapest(tried)
    t0 = time.perf_counter()
    budget = int(budget)
    order = list(order) if order is not None else graph.compute_nodes
    check_order(graph, order)
    notes = [f"RAF-style greedy rematerialization (score={score}) over a {len(order)}-node order"]
    seq = greedy_compute_sequence(graph, budget, order, score=score)
    if seq is None:
        m = greedy_min_budget(graph, order, score=score)
        if budget < m:
            raise BudgetTooSmall(
                budget, m,
                detail=f"greedy cannot meet budget {budget} B; smallest budget at which it succeeds: {m} B "
                f"(lower bound for any schedule: {min_memory_lower_bound(graph)} B)",
            )
        seq = greedy_compute_sequence(graph, m, order, score=score)
        assert seq is not None
        notes.append(f"greedy got stuck at {budget} B; used its plan for the tighter budget {m} B")
    plan = make_plan(
        graph, seq, solver="greedy", status="heuristic",
        seconds=time.perf_counter() - t0, notes=notes, budget=budget,
    )
    if plan.peak > budget:  # the eager-free schedule never exceeds the greedy's accounting
        raise AssertionError(f"greedy plan peak {plan.peak} B exceeds budget {budget} B")
    return plan
