"""Exact (bucket-free) variant of the precise DP over Pareto frontiers.

``C(i, j, .)`` is a non-increasing step function of the memory ``m``; it only
changes at the peaks of strategies that are optimal for some ``m``.  Instead of
tabulating every memory unit we keep, per sub-problem, the Pareto frontier of
``(peak bytes, cost)`` pairs (peaks ascending, costs strictly descending) and
``C(i, j, m) = cost of the last entry with peak <= m``.  For a checkpoint ``k``
the frontier of Q(i, j, k, .) is a two-pointer merge of the right frontier
(shifted by ``beta_f[k]``) and the left frontier, each emitted point having peak
``max(peak_F, beta_f[k] + peak_R, peak_L)`` (eq. 3.3) and cost eq. 3.1.  Entries
with a peak above the top-level budget are pruned.  Memory is in exact bytes,
so no bucketing loss; the cost depends on how many distinct frontier points a
chain has, not on the budget's magnitude.
"""

from __future__ import annotations

import numpy as np

from ..._jit import njit


@njit
def _grow(a, need):
    """``a`` with room for ``need`` entries (doubling); Numba compiles one version per dtype."""
    if need <= a.shape[0]:
        return a
    b = np.empty(max(need, 2 * a.shape[0]), a.dtype)
    b[: a.shape[0]] = a
    return b


@njit
def pareto_dp(af, ab, bf, bb, Mcap, pid, npairs):
    """Frontiers of all sub-problems in the thesis model (bytes).

    Returns flat arrays ``(start, length, peaks, costs, ks)``; the frontier of
    pair ``p`` is ``peaks[start[p]: start[p] + length[p]]`` etc.
    """
    n = af.shape[0] - 1
    start = np.zeros(npairs, np.int64)
    length = np.zeros(npairs, np.int64)
    G_p = np.empty(1 << 16, np.int64)
    G_c = np.empty(1 << 16, np.float64)
    G_k = np.empty(1 << 16, np.int64)
    used = 0
    cp = np.empty(1 << 12, np.int64)
    cc = np.empty(1 << 12, np.float64)
    ck = np.empty(1 << 12, np.int64)
    for i in range(n, -1, -1):
        p = pid[i, i + 1]
        leaf = bb[i] + bb[i + 1]
        start[p] = used
        if leaf <= Mcap:
            G_p = _grow(G_p, used + 1)
            G_c = _grow(G_c, used + 1)
            G_k = _grow(G_k, used + 1)
            G_p[used] = leaf
            G_c[used] = ab[i]
            G_k[used] = -1
            used += 1
            length[p] = 1
        for j in range(i + 2, n + 2):
            p = pid[i, j]
            nc = 0
            fcomp = 0.0
            fpk = 0
            for k in range(i + 1, j):
                fcomp += af[k]
                pair = bf[k] + (bf[k - 1] if k - 1 > i else 0)
                if pair > fpk:
                    fpk = pair
                pf = bb[j] + fpk
                if pf > Mcap:
                    break  # larger k only raise the forward peak
                bk = bf[k]
                pr = pid[k, j]
                pl = pid[i, k]
                rs = start[pr]
                rn = length[pr]
                ls = start[pl]
                ln = length[pl]
                if rn == 0 or ln == 0:
                    continue
                cp = _grow(cp, nc + rn + ln)
                cc = _grow(cc, nc + rn + ln)
                ck = _grow(ck, nc + rn + ln)
                a = 0
                b = 0
                while True:
                    t = max(pf, bk + G_p[rs + a], G_p[ls + b])
                    if t > Mcap:
                        break
                    cp[nc] = t
                    cc[nc] = fcomp + G_c[rs + a] + G_c[ls + b]
                    ck[nc] = k
                    nc += 1
                    # advance to the next threshold
                    na = bk + G_p[rs + a + 1] if a + 1 < rn else np.int64(1) << 62
                    nb = G_p[ls + b + 1] if b + 1 < ln else np.int64(1) << 62
                    if na == np.int64(1) << 62 and nb == np.int64(1) << 62:
                        break
                    if na <= nb:
                        a += 1
                    if nb <= na:
                        b += 1
            start[p] = used
            if nc == 0:
                length[p] = 0
                continue
            order = np.argsort(cp[:nc], kind="mergesort")
            G_p = _grow(G_p, used + nc)
            G_c = _grow(G_c, used + nc)
            G_k = _grow(G_k, used + nc)
            cnt = 0
            best = np.inf
            q = 0
            while q < nc:
                # group of equal peaks: keep the cheapest (first k on ties)
                t = cp[order[q]]
                gc = np.inf
                gk = -1
                while q < nc and cp[order[q]] == t:
                    o = order[q]
                    if cc[o] < gc:
                        gc = cc[o]
                        gk = ck[o]
                    q += 1
                if gc < best:
                    best = gc
                    G_p[used + cnt] = t
                    G_c[used + cnt] = gc
                    G_k[used + cnt] = gk
                    cnt += 1
            length[p] = cnt
            used += cnt
    return start, length, G_p[:used], G_c[:used], G_k[:used]
