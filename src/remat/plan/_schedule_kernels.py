"""Numba loops of :func:`.graph.make_plan` on a valid compute sequence: :func:`.graph.prune_compute_sequence`,
:func:`.graph.eager_frees` and :func:`.graph.evaluate`, the same steps in the same order.

The graph is given as :func:`.graph.node_arrays` lays it out (``indptr``/``indices``: each node's
inputs, CSR). A schedule is two arrays: ``kinds`` (1 compute, 0 free) and ``nodes``.
"""

from __future__ import annotations

import numpy as np

from .._jit import njit


@njit
def prune(seq, indptr, indices, is_output):
    """:func:`.graph.prune_compute_sequence`: drop computes whose result is not read before the
    value is computed again (or, for a non-output's last one, never read), until none is."""
    n = is_output.shape[0]
    count = np.zeros(n, np.int64)
    needed = np.zeros(n, np.bool_)
    changed = True
    while changed:
        changed = False
        count[:] = 0
        for i in seq:
            count[i] += 1
        needed[:] = is_output
        keep = np.ones(seq.shape[0], np.bool_)
        for p in range(seq.shape[0] - 1, -1, -1):
            i = seq[p]
            if not needed[i] and count[i] > 1:
                keep[p] = False
                count[i] -= 1
                changed = True
                continue
            needed[i] = False
            for k in range(indptr[i], indptr[i + 1]):
                needed[indices[k]] = True
        seq = seq[keep]
    return seq


@njit
def eager_schedule(seq, indptr, indices, is_input, is_output):
    """:func:`.graph.eager_frees` of ``seq``, whose every compute reads values computed (or inputs)
    before it: ``(kinds, nodes)``. Frees after the same step come in the order the Python version
    appends them: previous instances as their recomputation is met, then the values alive at the
    end, inputs first (by index), then computed values in the order first computed."""
    n = is_input.shape[0]
    m = seq.shape[0]
    start = np.full(n, -2, np.int64)  # position of the current instance's compute (-1: input; -2: none yet)
    last_use = np.full(n, -2, np.int64)  # its last read so far (-2: none)
    first_at = np.full(n, -1, np.int64)
    free_pos = np.empty(m + n, np.int64)  # (position freed after, value), in the order they are decided
    free_val = np.empty(m + n, np.int64)
    nf = 0
    for v in range(n):
        if is_input[v]:
            start[v] = -1
    for p in range(m):
        i = seq[p]
        for k in range(indptr[i], indptr[i + 1]):
            j = indices[k]
            if start[j] != -2:
                last_use[j] = p
        if start[i] != -2 and not is_input[i]:  # recomputed: its previous instance goes after its last use
            free_pos[nf] = last_use[i] if last_use[i] != -2 else start[i]
            free_val[nf] = i
            nf += 1
            last_use[i] = -2
        if start[i] == -2:
            first_at[i] = p
        start[i] = p
    for v in range(n):  # the inputs, in index order
        if is_input[v] and not is_output[v]:
            free_pos[nf] = last_use[v] if last_use[v] != -2 else start[v]
            free_val[nf] = v
            nf += 1
    for p in range(m):  # computed values, in the order first computed
        v = seq[p]
        if first_at[v] == p and not is_input[v] and not is_output[v]:
            free_pos[nf] = last_use[v] if last_use[v] != -2 else start[v]
            free_val[nf] = v
            nf += 1
    order = np.argsort(free_pos[:nf], kind="mergesort")  # stable: each step's frees in decision order
    kinds = np.empty(m + nf, np.int64)
    nodes = np.empty(m + nf, np.int64)
    k = 0
    f = 0
    while f < nf and free_pos[order[f]] == -1:
        kinds[k], nodes[k] = 0, free_val[order[f]]
        k += 1
        f += 1
    for p in range(m):
        kinds[k], nodes[k] = 1, seq[p]
        k += 1
        while f < nf and free_pos[order[f]] == p:
            kinds[k], nodes[k] = 0, free_val[order[f]]
            k += 1
            f += 1
    return kinds, nodes


@njit
def measure(kinds, nodes, indptr, indices, is_input, is_output, recomputable, nbytes, workspace, cost):
    """:func:`.graph.evaluate` of a schedule: ``(valid, cost, peak)``; ``valid`` false where the
    Python version raises (it then says why)."""
    n = is_input.shape[0]
    live = is_input.copy()
    times = np.zeros(n, np.int64)
    mem = 0
    for v in range(n):
        if is_input[v]:
            mem += nbytes[v]
    peak = mem
    total = 0.0
    for t in range(kinds.shape[0]):
        i = nodes[t]
        if kinds[t] == 1:
            if is_input[i] or live[i] or (times[i] > 0 and not recomputable[i]):
                return False, 0.0, 0
            for k in range(indptr[i], indptr[i + 1]):
                if not live[indices[k]]:
                    return False, 0.0, 0
            during = mem + nbytes[i] + workspace[i]
            if during > peak:
                peak = during
            mem += nbytes[i]
            live[i] = True
            times[i] += 1
            total += cost[i]
        else:
            if not live[i]:
                return False, 0.0, 0
            live[i] = False
            mem -= nbytes[i]
    for v in range(n):
        if (not is_input[v] and times[v] == 0) or (is_output[v] and not live[v]):
            return False, 0.0, 0
    return True, total, peak


LIST_KEYS = {"delta": 0, "peak": 1, "delta_peak": 2}
"""The priorities of :func:`list_schedule` by :func:`.scheduling._list_schedule`'s names."""


@njit
def list_schedule(indptr, indices, cons_ptr, cons, is_input, is_output, nbytes, workspace, key_kind, lookahead):
    """:func:`.scheduling._list_schedule`: repeatedly run the ready node of least priority
    (``key_kind``, :data:`LIST_KEYS`; ties on the index). ``cons_ptr``/``cons``: each node's
    consumers, ascending (CSR). Returns the order of the compute nodes."""
    n = is_input.shape[0]
    remaining = cons_ptr[1:] - cons_ptr[:-1]  # consumers not yet run: a value is released at 0
    missing = np.zeros(n, np.int64)  # inputs not yet computed
    for v in range(n):
        for k in range(indptr[v], indptr[v + 1]):
            if not is_input[indices[k]]:
                missing[v] += 1
    ready = np.empty(n, np.int64)
    n_ready = 0
    for v in range(n):
        if not is_input[v] and missing[v] == 0:
            ready[n_ready] = v
            n_ready += 1
    order = np.empty(n, np.int64)
    m = 0
    while n_ready > 0:
        at = -1
        b0 = b1 = b2 = 0
        for p in range(n_ready):
            v = ready[p]
            freed = 0  # net live bytes of running v now: its output, less the inputs it releases
            for k in range(indptr[v], indptr[v + 1]):
                u = indices[k]
                if remaining[u] == 1 and not is_output[u]:
                    freed += nbytes[u]
            own = nbytes[v] if (cons_ptr[v + 1] > cons_ptr[v] or is_output[v]) else 0
            d = own - freed
            if lookahead and d > 0:  # a consumer v makes ready may release much: the two steps' effect
                best = 0
                for kk in range(cons_ptr[v], cons_ptr[v + 1]):
                    w = cons[kk]
                    if missing[w] != 1:
                        continue
                    fr = 0
                    for k2 in range(indptr[w], indptr[w + 1]):
                        u = indices[k2]
                        read = 0
                        for k3 in range(indptr[v], indptr[v + 1]):
                            if indices[k3] == u:
                                read = 1
                                break
                        left = remaining[u] - read
                        if u == v:
                            left = cons_ptr[v + 1] - cons_ptr[v]
                        if left == 1 and not is_output[u]:
                            fr += nbytes[u]
                    if nbytes[w] - fr < best:
                        best = nbytes[w] - fr
                d += best
            transient = nbytes[v] + workspace[v]
            if key_kind == 0:
                k0, k1, k2_ = d, v, 0
            elif key_kind == 1:
                k0, k1, k2_ = transient, d, v
            else:
                k0, k1, k2_ = d, transient, v
            if at < 0 or k0 < b0 or (k0 == b0 and (k1 < b1 or (k1 == b1 and k2_ < b2))):
                at, b0, b1, b2 = p, k0, k1, k2_
        v = ready[at]
        n_ready -= 1
        ready[at] = ready[n_ready]  # the ready set's order does not matter: the least key is unique
        order[m] = v
        m += 1
        for k in range(indptr[v], indptr[v + 1]):
            remaining[indices[k]] -= 1
        for kk in range(cons_ptr[v], cons_ptr[v + 1]):
            w = cons[kk]
            missing[w] -= 1
            if missing[w] == 0:
                ready[n_ready] = w
                n_ready += 1
    return order[:m]
