"""Numba hot loop of the greedy rematerialization (:mod:`.greedy`): one eviction's choice.

The graph is given as arrays over its nodes (topological order): ``indptr``/``indices`` list each
node's inputs in order (CSR), ``cost`` its compute seconds, ``is_input`` whether it is a graph input.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def pick_eviction(indptr, indices, cost, is_input, live, cand, uses, size, nxt, p, belady, outputs_last,
                  is_output, negligible, rec):
    """The node to evict among ``cand`` (live, unpinned eviction candidates), or -1 when none may go.

    Score (the lowest goes; ties: the lowest index) ``rec_cost * uses / size``, divided with
    ``belady`` by ``max(1, nxt - p + 1)`` (``nxt``: the position of the next use, ``p`` the current
    one); -1 for a dead value (``uses`` 0). ``rec_cost`` of a node: its cost plus, for each input
    that is not live, in input order, that input's own ``rec_cost`` (infinite for a graph input
    gone for good): recomputing it recomputes its evicted ancestors, summed along each path. A
    value of infinite score is never evicted. With ``outputs_last`` outputs (with uses) go only when
    nothing else can, negligible values (with uses) before them and after everything else.
    ``rec``: scratch, one float per node (the non-live values' ``rec_cost``, in topological order)."""
    n = cost.shape[0]
    hi = n - 1
    while hi >= 0 and not cand[hi]:
        hi -= 1
    inf = np.inf
    best, best_h = -1, inf
    small, small_h = -1, inf
    last, last_h = -1, inf
    for u in range(hi + 1):  # a node's inputs precede it: their rec_cost is known when it is reached
        if live[u] and not cand[u]:
            continue
        c = cost[u]
        for k in range(indptr[u], indptr[u + 1]):
            j = indices[k]
            if not live[j]:
                c += inf if is_input[j] else rec[j]
        if not live[u]:
            rec[u] = c
            continue
        if uses[u] == 0:
            h = -1.0
        else:
            h = c * uses[u] / size[u]
            if belady:
                h /= max(1, nxt[u] - p + 1)
            if outputs_last and is_output[u]:
                if h < last_h:
                    last, last_h = u, h
                continue
            if negligible[u]:
                if h < small_h:
                    small, small_h = u, h
                continue
        if h < best_h:
            best, best_h = u, h
    if best < 0:
        best = small if small >= 0 else last
    return best
