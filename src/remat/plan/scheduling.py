"""Memory-aware operator scheduling without rematerialization (RAF paper, §3.1.4).

Any topological order is a correct execution order, but the peak memory depends
on it: an op that produces a large tensor early keeps it alive for long.  RAF moves
an op forward when it releases more than it produces (``p - c < 0``) and backward
otherwise.  We implement this as a list scheduler: among the ready ops, pick the
one with the smallest net effect ``p - c`` (bytes produced minus bytes released
by running it), with variants that also weigh the transient peak of the op and a
one-step lookahead (an op with ``p - c > 0`` that enables a large release).  Every
candidate order is measured with :func:`evaluate` and the best one is returned,
the original order included, so the result is never worse than the input order.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Sequence

import numpy as np

from .record import Solution
from .graph import Graph, check_order, eager_frees, evaluate, node_arrays

__all__ = ["memory_aware_order", "memory_aware_orders", "order_peak", "schedule_plan", "no_remat_plan", "with_siblings"]


def with_siblings(graph: Graph, order: Sequence[int]) -> list[int]:
    """``order`` with each group of sibling nodes (the results of one execution, ``Node.group``)
    together where its first node comes: still topological, since siblings read the same inputs.

    Apart, a later sibling keeps the group's inputs alive until it comes, although computing it
    costs nothing (the execution already ran). The list scheduler separates them whenever
    something else looks cheaper in between (zoo U-Net at 50%: a convolution's weight gradient,
    whose recomputed input then peaked with a batch norm backward's 2 MiB of inputs still held)."""
    nodes = graph.nodes
    members: dict[int, list[int]] = {}  # a group's first node (or a lone node) -> its nodes, in order
    for v in order:
        g = nodes[v].group
        members.setdefault(v if g is None else g, []).append(v)
    if len(members) == len(order):
        return list(order)
    out: list[int] = []
    for v in order:
        g = nodes[v].group
        out.extend(members.pop(v if g is None else g, ()))
    return out


def order_peak(graph: Graph, order: Sequence[int]) -> int:
    """Peak bytes of running ``order`` once (no remat) with eager frees."""
    return evaluate(graph, eager_frees(graph, order))[1]


def _list_schedule(graph: Graph, key_kind: str, lookahead: bool) -> list[int]:
    """One list-scheduling pass; ``key_kind`` selects the priority of ready ops.

    ``delta``: net bytes p - c;  ``peak``: (transient bytes while running, delta);
    ``delta_peak``: delta, then transient bytes.  Ties break on the original index,
    so the pass is deterministic.  With ``lookahead``, an op with p - c > 0 is ranked by
    the combined effect of running it and then a consumer it makes ready, when that consumer
    releases much (one step of lookahead).  Compiled (:func:`._schedule_kernels.list_schedule`):
    each step weighs every ready op.
    """
    from ._schedule_kernels import LIST_KEYS, list_schedule

    indptr, indices, _, is_input, is_output, _, nbytes, workspace, _ = node_arrays(graph)
    cons = graph.consumers
    cons_ptr = np.zeros(len(cons) + 1, dtype=np.int64)
    cons_ptr[1:] = np.cumsum([len(c) for c in cons])
    flat = np.array([w for c in cons for w in c], dtype=np.int64)
    order = list_schedule(indptr, indices, cons_ptr, flat, is_input, is_output, nbytes, workspace,
                          LIST_KEYS[key_kind], lookahead)
    return [int(v) for v in order]


def _dfs_order(graph: Graph) -> list[int]:
    """Depth-first-like order: always continue from the most recently produced value
    (shortens lifetimes on branchy graphs such as U-Nets)."""
    nodes = graph.nodes
    cons = graph.consumers
    missing = [sum(1 for j in nd.inputs if not nodes[j].is_input) for nd in nodes]
    # heap keyed by -(time the op became ready), then index
    heap: list[tuple[int, int]] = []
    t = 0
    for v, nd in enumerate(nodes):
        if not nd.is_input and missing[v] == 0:
            heapq.heappush(heap, (0, v))
    order: list[int] = []
    while heap:
        _, v = heapq.heappop(heap)
        order.append(v)
        t += 1
        for w in cons[v]:
            missing[w] -= 1
            if missing[w] == 0:
                heapq.heappush(heap, (-t, w))
    return order


def memory_aware_order(
    graph: Graph, order: Sequence[int] | None = None, *, lookahead: bool = True
) -> list[int]:
    """A topological order of the compute nodes with a low no-remat peak, each group of
    sibling nodes together (:func:`with_siblings`).

    Tries several list-scheduling priorities and returns the order with the lowest
    simulated peak; ``order`` (default: index order) is a candidate too, so the
    result's peak is never higher than that of ``order``.  Ties keep ``order``.
    """
    return memory_aware_orders(graph, order, lookahead=lookahead)[0]


def memory_aware_orders(
    graph: Graph, order: Sequence[int] | None = None, *, lookahead: bool = True
) -> list[list[int]]:
    """:func:`memory_aware_order`, then, when it differs, the lowest-peak order as the list
    schedulers made it, siblings where they put them: a plan walking it holds a group's inputs
    until its last node, yet a heuristic walking it sometimes recomputes less (the greedy on
    Hugging Face GPT-2 at 45%: +2.5% against +4.4%; BERT at 50%: +11.6% against +13.6%), so the
    portfolio plans on both. Each distinct order's peak is simulated once."""
    base = list(order) if order is not None else graph.compute_nodes
    check_order(graph, base)
    raw = [base]
    makers: list[Callable[[], list[int]]] = [
        lambda: _list_schedule(graph, "delta", False),
        lambda: _list_schedule(graph, "delta_peak", False),
        lambda: _list_schedule(graph, "peak", False),
        _dfs_order_factory(graph),
    ]
    if lookahead:
        makers += [
            lambda: _list_schedule(graph, "delta", True),
            lambda: _list_schedule(graph, "delta_peak", True),
        ]
    raw += [make() for make in makers]
    peaks: dict[tuple[int, ...], int] = {}  # without groups, the grouped orders are the raw ones

    def peak(o: list[int]) -> int:
        key = tuple(o)
        if key not in peaks:
            peaks[key] = order_peak(graph, o)
        return peaks[key]

    out: list[list[int]] = []
    for cands in ([with_siblings(graph, c) for c in raw], raw):
        best = min(cands, key=peak)  # the first of the lowest: ties keep ``order``
        if best not in out:
            out.append(list(best))
    return out


def _dfs_order_factory(graph: Graph) -> Callable[[], list[int]]:
    return lambda: _dfs_order(graph)


def no_remat_plan(graph: Graph, order: Sequence[int] | None = None) -> Solution:
    """Run every node once in ``order`` (default index order) with eager frees."""
    t0 = time.perf_counter()
    base = list(order) if order is not None else graph.compute_nodes
    check_order(graph, base)
    sched = eager_frees(graph, base)
    cost, peak = evaluate(graph, sched)
    return Solution("no_remat", sched, cost, peak, seconds=time.perf_counter() - t0, status="exact",
                    notes=["no rematerialization: each node computed once in the given order, eager frees"],
                    base_cost=graph.base_cost)


def schedule_plan(
    graph: Graph, order: Sequence[int] | None = None, *, lookahead: bool = True
) -> Solution:
    """:func:`memory_aware_order` as a :class:`Solution` (no recomputation)."""
    t0 = time.perf_counter()
    base = list(order) if order is not None else graph.compute_nodes
    base_peak = order_peak(graph, base)
    best = memory_aware_order(graph, base, lookahead=lookahead)
    sched = eager_frees(graph, best)
    cost, peak = evaluate(graph, sched)
    note = (
        f"memory-aware list scheduling (RAF §3.1.4): peak {base_peak} B -> {peak} B"
        if peak < base_peak
        else f"memory-aware list scheduling found no better order; kept the given order ({peak} B)"
    )
    return Solution("schedule", sched, cost, peak, seconds=time.perf_counter() - t0, status="heuristic", notes=[note],
                    base_cost=graph.base_cost)
