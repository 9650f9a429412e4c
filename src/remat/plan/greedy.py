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
Graphs whose inputs are all pinned (the step's own arguments) are planned as before.

The result is a compute sequence; frees are inserted eagerly (:func:`.graph.eager_frees`),
which frees every value no later than the greedy did, so the simulated peak is
<= the greedy's own accounting <= budget.
"""

from __future__ import annotations

import bisect
import sys
import time
from typing import Sequence

from .record import Solution
from .graph import (
    BudgetTooSmall,
    Graph,
    check_order,
    eager_frees,
    make_plan,
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
        self.pos = {v: p for p, v in enumerate(self.order)}
        # use positions (in the original order) of every value, ascending
        self.use_pos: list[list[int]] = [sorted(self.pos[w] for w in cons[u]) for u in range(n)]
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
        self.pins = [0] * n
        self.seq: list[int] = []
        self.p = 0  # current position in the original order
        self.evictions = 0
        # Eviction candidates that are live (non-input, recomputable, non-empty): the scan in
        # ``_evict_one`` visits these, not every node, so a pass costs O(evictions x resident values).
        self.evictable = [not nd.is_input and nd.recomputable and nd.bytes > 0 for nd in self.nodes]
        self.resident: set[int] = set()
        # Recompute costs of values that are not live, kept across evictions: an entry holds while
        # no ancestor reached through non-live values changes liveness (``_live_changed`` drops it).
        self.rec: dict[int, float] = {}
        self.cons = cons
        self.tiny = budget // NEGLIGIBLE_FRACTION

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
        self.mem -= self.nodes[u].bytes
        self.resident.discard(u)
        self._live_changed(u)

    def _live_changed(self, u: int) -> None:
        """Forget the kept recompute costs that depended on ``u``'s liveness: ``u``'s own and those of
        the non-live values reached from it through non-live consumers. An entry exists only when
        every non-live value it went through has one too, so the walk stops at values without one."""
        rec = self.rec
        rec.pop(u, None)
        stack = [u]
        while stack:
            v = stack.pop()
            for w in self.cons[v]:
                if w in rec and not self.live[w]:
                    del rec[w]
                    stack.append(w)

    def _rec_cost(self, u: int) -> float:
        """Cost of recomputing u now, incl. evicted ancestors (their costs summed along each path)."""
        nd = self.nodes[u]
        c = nd.cost
        live, rec, nodes = self.live, self.rec, self.nodes
        for j in nd.inputs:
            if not live[j]:
                if nodes[j].is_input:
                    return float("inf")  # reads an input freed after its last use, for good: never evicted
                r = rec.get(j)
                c += self._rec_cost_not_live(j) if r is None else r
        return c

    def _rec_cost_not_live(self, u: int) -> float:
        c = self._rec_cost(u)
        self.rec[u] = c
        return c

    def _evict_one(self) -> None:
        best, best_h = -1, float("inf")
        small, small_h = -1, float("inf")  # the best of the negligible values: evicted only when nothing else is left
        last, last_h = -1, float("inf")  # the best of the outputs, with outputs_last: evicted after those
        n_order, p, tiny = len(self.order), self.p, self.tiny
        pins, fut, nodes, use_pos, rec_cost = self.pins, self.fut, self.nodes, self.use_pos, self._rec_cost
        belady, outputs_last = self.score != "raf", self.outputs_last
        for u in self.resident:  # ties keep the lowest index, as a scan of all nodes in order would
            if pins[u]:
                continue
            nd = nodes[u]
            uses = fut[u] + (1 if nd.is_output or self.unpinned and self._read_by_pending(u) else 0)
            if uses == 0:
                h = -1.0  # dead: free for nothing
            else:
                h = rec_cost(u) * uses / nd.bytes
                if belady:
                    ups = use_pos[u]
                    k = bisect.bisect_left(ups, p)
                    nxt = ups[k] if k < len(ups) else n_order + 1  # outputs: needed at the end
                    h /= max(1, nxt - p + 1)
                if outputs_last and nd.is_output:
                    if h < last_h or (h == last_h and u < last):
                        last, last_h = u, h
                    continue
                if nd.bytes <= tiny:
                    if h < small_h or (h == small_h and u < small):
                        small, small_h = u, h
                    continue
            if h < best_h or (h == best_h and u < best):
                best, best_h = u, h
        if best < 0:
            best = small if small >= 0 else last
        if best < 0:
            raise _Stuck
        self._free(best)
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
        self.done[v] = True
        self.mem += nd.bytes
        if self.evictable[v]:
            self.resident.add(v)
        self._live_changed(v)
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
                self.pins[j] += 1
                pinned.append(j)
        first = set(pinned)
        for j in nd.inputs:  # the others, rematerialised unless an earlier one's recomputation made them live
            if j not in first:
                if not self.live[j]:
                    self._materialize(j)
                self.pins[j] += 1
                pinned.append(j)
        self._compute(u)
        for j in pinned:
            self.pins[j] -= 1

    # -------------------------------------------------------------- driver
    def run(self) -> list[int]:
        for u, nd in enumerate(self.nodes):  # unused inputs are freed at the start
            if nd.is_input and self._dead(u):
                self._free(u)
        for p, v in enumerate(self.order):
            self.p = p
            nd = self.nodes[v]
            self._compute_with_inputs(v)
            for j in nd.inputs:
                self.fut[j] -= 1
                if self._dead(j):
                    self._free(j)
            if self._dead(v):
                self._free(v)
        # all outputs must be live at the end: pin them one by one
        self.p = len(self.order)
        outs = [u for u, nd in enumerate(self.nodes) if nd.is_output]
        for u in outs:
            if self.live[u]:
                self.pins[u] += 1
        for u in outs:
            if not self.live[u]:
                self._materialize(u)
                self.pins[u] += 1
        return self.seq


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
