"""Numba hot loops of the greedy rematerialization (:mod:`.greedy`): one eviction's choice
(:func:`pick_eviction`), and a whole pass over a graph whose inputs are all pinned (:func:`greedy_pass`).

The graph is given as arrays over its nodes (topological order): ``indptr``/``indices`` list each
node's inputs in order (CSR), ``cost`` its compute seconds, ``is_input`` / ``is_output`` its flags.
"""

from __future__ import annotations

import numpy as np

from .._jit import njit

STUCK = -1  # greedy_pass: nothing left to evict, an input or a non-recomputable value needed again, or too many steps


@njit
def pick_eviction(indptr, indices, cost, is_input, live, resident, pins, uses, size, nxt, p, belady, outputs_last,
                  is_output, negligible, rec):
    """The node to evict among the resident values without pins, or -1 when none may go.

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
    while hi >= 0 and not (resident[hi] and pins[hi] == 0):
        hi -= 1
    inf = np.inf
    best, best_h = -1, inf
    small, small_h = -1, inf
    last, last_h = -1, inf
    for u in range(hi + 1):  # a node's inputs precede it: their rec_cost is known when it is reached
        cand = resident[u] and pins[u] == 0
        if live[u] and not cand:
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


@njit
def greedy_pass(graph, order, use_ptr, use_pos, budget, belady, outputs_last, max_steps):
    """One greedy pass (:class:`.greedy._Greedy`, whose steps it takes in the same order) over a
    graph whose inputs are all outputs (never freed): ``(seq, n)``, the compute sequence in
    ``seq[:n]``, or ``n == STUCK``. ``graph``: ``(indptr, indices, cost, is_input, is_output, size,
    nbytes, workspace, recomputable, negligible)``, ``size`` the bytes as floats (the score's),
    ``nbytes`` as integers (the accounting's); ``order``: the compute order; ``use_ptr``/``use_pos``:
    each node's use positions in it, ascending (CSR)."""
    indptr, indices, cost, is_input, is_output, size, nbytes, workspace, recomputable, negligible = graph
    n = cost.shape[0]
    n_order = order.shape[0]
    live = is_input.copy()
    pins = np.zeros(n, np.int64)
    fut = np.zeros(n, np.int64)  # first computations still to read each value
    for k in range(indices.shape[0]):
        fut[indices[k]] += 1
    uses = fut.astype(np.float64)  # the score's: reads left, and one for an output
    nxt = np.empty(n, np.int64)  # position of the next use from the current one (none: n_order + 1)
    mem = np.int64(0)  # typed values, not literals: one specialization of _make_live, not one per literal
    for u in range(n):
        if is_output[u]:
            uses[u] += 1.0
        nxt[u] = use_pos[use_ptr[u]] if use_ptr[u] < use_ptr[u + 1] else n_order + 1
        if is_input[u]:
            mem += nbytes[u]
    state = (live, pins, fut, uses, np.zeros(n, np.bool_), nxt, np.empty(max_steps + 1, np.int64), np.empty(n),
             np.zeros(indices.shape[0], np.bool_), np.empty(n + 1, np.int64), np.empty(n + 1, np.int64),
             np.empty(n + 1, np.bool_))
    seq = state[6]
    ns = np.int64(0)
    for p in range(n_order + 1):
        if p:  # the node at p - 1 read these: their next use is further on
            v = order[p - 1]
            for k in range(indptr[v], indptr[v + 1]):
                j = indices[k]
                lo, hi = use_ptr[j], use_ptr[j + 1]
                q = lo + np.searchsorted(use_pos[lo:hi], p)
                nxt[j] = use_pos[q] if q < hi else n_order + 1
        if p == n_order:
            break
        v = order[p]
        mem, ns = _make_live(v, np.bool_(False), p, mem, ns, graph, state, budget, belady, outputs_last, max_steps)
        if ns == STUCK:
            return seq, STUCK
        for k in range(indptr[v], indptr[v + 1]):
            j = indices[k]
            fut[j] -= 1
            uses[j] -= 1.0
            mem = _free_if_dead(j, mem, graph, state)
        mem = _free_if_dead(v, mem, graph, state)
    # all outputs must be live at the end: pin those that are, then make the others live one by one
    for u in range(n):
        if is_output[u] and live[u]:
            pins[u] += 1
    for u in range(n):
        if is_output[u] and not live[u]:
            mem, ns = _make_live(u, np.bool_(True), n_order, mem, ns, graph, state, budget, belady, outputs_last, max_steps)
            if ns == STUCK:
                return seq, STUCK
            pins[u] += 1
    return seq, ns


@njit
def _free_if_dead(u, mem, graph, state):
    """Free ``u`` if it is live, without pins, without reads left, and not an output: the new ``mem``."""
    nbytes, is_output = graph[6], graph[4]
    live, pins, fut, resident = state[0], state[1], state[2], state[4]
    if live[u] and pins[u] == 0 and fut[u] == 0 and not is_output[u]:
        live[u] = False
        resident[u] = False
        mem -= nbytes[u]
    return mem


@njit
def _make_live(root, mat, p, mem, ns, graph, state, budget, belady, outputs_last, max_steps):
    """Compute ``root`` at position ``p`` after making its inputs live, rematerialising the evicted
    ones first (recursively, on an explicit stack), each computation's inputs pinned while it runs;
    ``mat``: ``root`` is itself a rematerialisation (it must be recomputable, and frees the inputs
    it leaves dead). Evicts to make room (:func:`pick_eviction`). Returns ``(mem, ns)``, ``ns`` the
    sequence's new length or ``STUCK``."""
    indptr, indices, cost, is_input, is_output, size, nbytes, workspace, recomputable, negligible = graph
    live, pins, fut, uses, resident, nxt, seq, rec, first, stack_node, stack_edge, stack_mat = state
    top = -1
    u, remat = root, mat
    while True:
        if u >= 0:  # a computation begins: pin the inputs live now, the others are made live in turn
            if remat and (is_input[u] or not recomputable[u]):
                return mem, STUCK
            for k in range(indptr[u], indptr[u + 1]):
                j = indices[k]
                first[k] = live[j]
                if live[j]:
                    pins[j] += 1
            top += 1
            stack_node[top], stack_edge[top], stack_mat[top] = u, indptr[u], remat
        v = stack_node[top]
        k, end = stack_edge[top], indptr[v + 1]
        u = -1
        while k < end:  # the next input not live when v's computation began: rematerialise it unless live now
            if not first[k]:
                j = indices[k]
                if not live[j]:
                    u, remat = j, True
                    break
                pins[j] += 1
            k += 1
        stack_edge[top] = k
        if u >= 0:
            continue
        # v's inputs are live and pinned: make room, compute v
        need = nbytes[v] + workspace[v]
        while mem + need > budget:
            w = pick_eviction(indptr, indices, cost, is_input, live, resident, pins, uses, size, nxt, p, belady,
                              outputs_last, is_output, negligible, rec)
            if w < 0:
                return mem, STUCK
            live[w] = False
            resident[w] = False
            mem -= nbytes[w]
        seq[ns] = v
        ns += 1
        if ns > max_steps:
            return mem, STUCK
        live[v] = True
        mem += nbytes[v]
        if recomputable[v] and not is_input[v] and nbytes[v] > 0:
            resident[v] = True
        for k in range(indptr[v], end):
            pins[indices[k]] -= 1
        if stack_mat[top]:
            for k in range(indptr[v], end):
                mem = _free_if_dead(indices[k], mem, graph, state)
        top -= 1
        if top < 0:
            return mem, ns
        k = stack_edge[top]  # the parent pins the input just made live, and goes on
        pins[indices[k]] += 1
        stack_edge[top] = k + 1
