"""Exhaustive search over rematerialization schedules of tiny graphs (tests/bench).

Dijkstra over explicit schedule states (live set as a bitmask); after every
compute any subset of the live values may be freed (freeing earlier than right
after a compute never helps).  Two schedule spaces:

* ``"checkmate"``: first computations in index order; between two of them, any
  earlier recomputable nodes recomputed in index order, each at most once (the
  space the MILP in :mod:`.milp` optimises over).
* ``"any"``: every valid schedule of the memory model in :mod:`.graph`.

Exponential: meant for <= ~8 nodes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from .graph import Graph

__all__ = ["exhaustive_optimum", "exhaustive_min_peak"]


def _subsets(mask: int) -> Iterator[int]:
    """All sub-masks of ``mask`` (including 0 and ``mask``)."""
    sub = mask
    while True:
        yield sub
        if sub == 0:
            return
        sub = (sub - 1) & mask


def _search(graph: Graph, budget: float, space: str, metric: str) -> tuple[float, list[int]] | None:
    """Best schedule as (value, compute sequence); value = total cost (metric
    ``cost``, peak <= budget) or peak bytes (metric ``peak``).  None: infeasible."""
    nodes = graph.nodes
    n = len(nodes)
    if n > 20:
        raise ValueError("exhaustive search is for tiny graphs only")
    size = [nd.bytes for nd in nodes]
    in_mask = [sum(1 << j for j in nd.inputs) for nd in nodes]
    inputs = sum(1 << i for i, nd in enumerate(nodes) if nd.is_input)
    pinned = sum(1 << i for i, nd in enumerate(nodes) if nd.is_input and nd.is_output)
    outputs = sum(1 << i for i, nd in enumerate(nodes) if nd.is_output)
    comp = graph.compute_nodes
    all_comp = sum(1 << i for i in comp)
    T = len(comp)

    def mem(mask: int) -> int:
        return sum(size[i] for i in range(n) if mask >> i & 1)

    start_mem = mem(inputs)
    if start_mem > budget and metric == "cost":
        return None

    # state: checkmate -> (s, j, live); any -> (computed, live)
    counter = itertools.count()
    heap: list = []
    best: dict = {}
    parent: dict = {}

    def push(val: float, state: tuple, par: tuple | None, comp_node: int | None) -> None:
        if state not in best or val < best[state]:
            best[state] = val
            parent[state] = (par, comp_node)
            heapq.heappush(heap, (val, next(counter), state))

    for sub in _subsets(inputs & ~pinned):
        live = inputs & ~sub
        st = (0, 0, live) if space == "checkmate" else (0, live)
        push(start_mem if metric == "peak" else 0.0, st, None, None)

    def cands(s: int) -> list[int]:
        return [v for v in comp[: s + 1] if v == comp[s] or nodes[v].recomputable]

    cand_cache = [cands(s) for s in range(T)]
    while heap:
        val, _, st = heapq.heappop(heap)
        if best.get(st, None) != val:
            continue
        if space == "checkmate":
            s, j, live = st
            if s == T:
                if live & outputs == outputs:
                    return val, _trace(parent, st)
                continue
            cand = cand_cache[s]
            k = cand[j]
            nxt = (s, j + 1) if j + 1 < len(cand) else (s + 1, 0)
            if k != comp[s]:
                push(val, (*nxt, live), st, None)
            options = [k]
        else:
            computed, live = st
            if computed == all_comp and live & outputs == outputs:
                return val, _trace(parent, st)
            options = [k for k in comp if nodes[k].recomputable or not computed >> k & 1]
        for k in options:
            if live >> k & 1 or in_mask[k] & ~live:
                continue
            during = mem(live) + size[k] + nodes[k].workspace
            if metric == "cost":
                if during > budget:
                    continue
                nval = val + nodes[k].cost
            else:
                nval = max(val, during)
            live2 = live | 1 << k
            for sub in _subsets(live2 & ~pinned):
                l3 = live2 & ~sub
                if space == "checkmate":
                    push(nval, (*nxt, l3), st, k)
                else:
                    push(nval, (computed | 1 << k, l3), st, k)
    return None


def _trace(parent: dict, st: tuple) -> list[int]:
    seq: list[int] = []
    while st is not None:
        par, k = parent[st]
        if k is not None:
            seq.append(k)
        st = par
    return seq[::-1]


def exhaustive_optimum(
    graph: Graph, budget: int, space: str = "checkmate"
) -> tuple[float, list[int]] | None:
    """Minimum total cost (seconds) of a schedule with peak <= ``budget``, and its
    compute sequence; None if no schedule in ``space`` fits."""
    if space not in ("checkmate", "any"):
        raise ValueError(f"unknown space {space!r}")
    return _search(graph, budget, space, "cost")


def exhaustive_min_peak(graph: Graph, space: str = "checkmate") -> int:
    """The minimum peak (bytes) over all schedules in ``space``."""
    if space not in ("checkmate", "any"):
        raise ValueError(f"unknown space {space!r}")
    res = _search(graph, float("inf"), space, "peak")
    assert res is not None
    return int(res[0])
