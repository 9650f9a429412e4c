"""Numba hot loops of the chain checkpointing DPs (thesis §3.1, Alg. 3.4).

All memory quantities here are in *units* (bytes / bucket, rounded up by the
caller); compute costs are float64 in the caller's time unit.  Sub-problems are
indexed by a pair id ``pid[i, j]`` (0 <= i < j <= N+1) into 2-D tables of shape
``(npairs, M + 1)`` whose column is the memory ``m`` (units) available to the
sub-problem: ``m`` excludes ``f_i`` (held by the caller) and includes ``b_j``
(owned by the sub-problem, thesis §3.1.6).

Loop order: the thesis iterates ``m`` outermost; we iterate ``i`` (descending),
``j`` (ascending), ``k`` and then ``m`` innermost.  Every sub-problem read,
``(k, j, .)`` with ``k > i`` and ``(i, k, .)`` with ``k < j``, is finished before
``(i, j, .)`` starts, so the recurrences are identical, but the innermost loop
walks contiguous memory.
"""

from __future__ import annotations

import numpy as np

from ..._jit import njit

FAIL = -1  # B table sentinel: the sub-problem cannot be done in m units
QUAD = -2  # D table marker: the "recompute everything" strategy (eq. 3.4/3.5)
NONE = -1  # D table marker: no decision (failed sub-problem or a leaf)


def pair_ids(n: int) -> tuple[np.ndarray, int]:
    """Pair-id matrix for 0 <= i < j <= n+1 (``-1`` elsewhere) and the pair count."""
    pid = np.full((n + 2, n + 2), -1, np.int64)
    c = 0
    for i in range(n + 2):
        for j in range(i + 1, n + 2):
            pid[i, j] = c
            c += 1
    return pid, c


@njit
def thesis_bounds(bf, bb, af, ab):
    """Exact per-sub-problem minimum peak P, no-recompute peak NR and cost LIN.

    ``P[i, j]`` is the least ``m`` for which ``C(i, j, m)`` is feasible (every
    strategy's peak is independent of ``m`` and a strategy fits iff its peak
    <= m, so feasibility is monotone in ``m``).  ``NR[i, j]`` is the peak of the
    store-everything strategy and ``LIN[i, j]`` its (minimal possible) cost.
    """
    n = bf.shape[0] - 1
    P = np.zeros((n + 2, n + 2), np.int64)
    NR = np.zeros((n + 2, n + 2), np.int64)
    LIN = np.zeros((n + 2, n + 2), np.float64)
    for i in range(n, -1, -1):
        leaf = bb[i] + bb[i + 1]
        P[i, i + 1] = leaf
        NR[i, i + 1] = leaf
        LIN[i, i + 1] = ab[i]
        fpk = 0
        for j in range(i + 2, n + 2):
            best = np.int64(1) << 62
            fpk = 0
            for k in range(i + 1, j):
                pair = bf[k] + (bf[k - 1] if k - 1 > i else 0)
                if pair > fpk:
                    fpk = pair
                lo = max(bb[j] + fpk, bf[k] + P[k, j], P[i, k])
                if lo < best:
                    best = lo
            P[i, j] = best
            NR[i, j] = max(bb[j] + bf[i + 1], bf[i + 1] + NR[i + 1, j], NR[i, i + 1])
            LIN[i, j] = LIN[i + 1, j] + af[i + 1] + ab[i]
    return P, NR, LIN


@njit
def thesis_dp(af, ab, bf, bb, M, pid, npairs, P, NR, LIN):
    """Precise-cost policy solver (thesis Alg. 3.4 with the listing slips fixed).

    Returns ``(C, B, D)``: optimal cost, peak (units, ``FAIL`` if infeasible) and
    decision (checkpoint index ``k``, ``QUAD`` or ``NONE``) for every
    sub-problem ``(i, j)`` and memory ``m`` in ``0..M``.

    Equations: Q(i,j,k,m) = sum_{l=i+1..k} af[l] + C(k,j,m-bf[k]) + C(i,k,m)   (3.1)
    peak = max(bb[j] + bf[i+1], bb[j] + max_{i+1<l<=k} bf[l-1]+bf[l],
               bf[k] + B(k,j,m-bf[k]), B(i,k,m))                             (3.3)
    Small m (< P[i,j]) are skipped (they fail: exact form of §3.1.9/3.1.10) and
    m >= NR[i,j] is filled with the no-recompute strategy (§3.1.11).
    """
    n = af.shape[0] - 1
    C = np.full((npairs, M + 1), np.inf)
    B = np.full((npairs, M + 1), FAIL, np.int32)
    D = np.full((npairs, M + 1), NONE, np.int16)
    for i in range(n, -1, -1):
        # Base case (i, i+1): one backward, b_{i+1} and b_i live (f_i outside m).
        p = pid[i, i + 1]
        leaf = bb[i] + bb[i + 1]
        for m in range(leaf, M + 1):
            C[p, m] = ab[i]
            B[p, m] = leaf
        # Memoised "recompute everything" costs (Alg. 3.2 / 3.3; the listing's
        # compute_quad forgets to accumulate the previous value, eq. 3.5 does).
        fcq = 0.0
        cq = ab[i]
        fpq = 0
        pq = leaf
        for j in range(i + 2, n + 2):
            p = pid[i, j]
            fcq += af[j - 1]
            cq = cq + fcq + ab[j - 1]
            fpq = max(fpq, (bf[j - 2] if j - 2 != i else 0) + bf[j - 1])
            pq = max(pq, bb[j] + fpq, bf[j - 1] + bb[j] + bb[j - 1])
            hi = min(NR[i, j], M + 1)  # m in [hi, M]: no recomputation needed
            fcomp = 0.0
            fpk = 0
            for k in range(i + 1, j):
                fcomp += af[k]
                pair = bf[k] + (bf[k - 1] if k - 1 > i else 0)  # beta^f_{k-1} + beta^f_k
                if pair > fpk:
                    fpk = pair
                peak_f = bb[j] + fpk  # stage 1: forwards to f_k while holding b_j
                pr = pid[k, j]
                pl = pid[i, k]
                bk = bf[k]
                lo = max(peak_f, bk + P[k, j], P[i, k])  # all three stages succeed
                for m in range(lo, hi):
                    c = fcomp + C[pr, m - bk] + C[pl, m]
                    if c < C[p, m]:
                        C[p, m] = c
                        D[p, m] = k
                        b = max(peak_f, bk + B[pr, m - bk], B[pl, m])
                        B[p, m] = b
            # Every k failed but "recompute everything" fits (never happens, as the
            # k = j-1 chain reproduces it, but kept as the thesis's fallback).
            for m in range(max(pq, 0), hi):
                if B[p, m] == FAIL:
                    C[p, m] = cq
                    B[p, m] = pq
                    D[p, m] = QUAD
            for m in range(max(hi, 0), M + 1):
                C[p, m] = LIN[i, j]
                B[p, m] = NR[i, j]
                D[p, m] = i + 1
    return C, B, D


@njit
def ext_bounds(af, ab, fo, ft, fs, fx, bb, bx):
    """P/NR/LIN of the extended model for both families (see solvers docstring).

    Family 1: given f_i with its tape, produce b_i.  Family 0: given f_i (output
    only), produce b_{i+1}.  Arrays are indexed ``[t, i, j]``.  Keeping ``f_{i+1}``
    with its tape costs ``fs`` (its tape's share of ``f_i``, held by the caller,
    is not counted twice); keeping a later ``f_k`` costs ``ft`` (``f_{k-1}`` is freed).
    """
    n = fo.shape[0] - 1
    BIG = np.int64(1) << 62
    P = np.full((2, n + 2, n + 2), BIG, np.int64)
    NR = np.zeros((2, n + 2, n + 2), np.int64)
    LIN = np.zeros((2, n + 2, n + 2), np.float64)
    for i in range(n, -1, -1):
        P[1, i, i + 1] = bb[i + 1] + bx[i]
        NR[1, i, i + 1] = bb[i + 1] + bx[i]
        LIN[1, i, i + 1] = ab[i]
        P[0, i, i + 1] = bb[i + 1]
        NR[0, i, i + 1] = bb[i + 1]
        LIN[0, i, i + 1] = 0.0
        for j in range(i + 2, n + 2):
            for t in range(2):
                best = BIG
                fpk = 0
                for k in range(i + 1, j):
                    tr = fx[k] + (fo[k - 1] if k - 1 > i else 0)
                    if tr > fpk:
                        fpk = tr
                    pf = bb[j] + fpk
                    lo = max(pf, (fs[k] if k == i + 1 else ft[k]) + P[1, k, j], P[t, i, k])
                    if lo < best:
                        best = lo
                    if k + 1 < j:
                        lo = max(pf, fo[k] + P[0, k, j], P[t, i, k + 1])
                        if lo < best:
                            best = lo
                P[t, i, j] = best
                NR[t, i, j] = max(bb[j] + fx[i + 1], fs[i + 1] + NR[1, i + 1, j], NR[t, i, i + 1])
                LIN[t, i, j] = af[i + 1] + LIN[1, i + 1, j] + LIN[t, i, i + 1]
    return P, NR, LIN


@njit
def ext_dp(af, ab, fo, ft, fs, fx, bb, bx, M, pid, npairs, P, NR, LIN):
    """Extended-model DP.  Decision code: ``2*k + s`` (s=1: checkpoint f_k with its
    tape, right family 1, left (i, k); s=0: checkpoint f_k's output only, right
    family 0 returns b_{k+1}, left (i, k+1)).  Tables indexed ``[t, pair, m]``."""
    n = fo.shape[0] - 1
    C = np.full((2, npairs, M + 1), np.inf)
    B = np.full((2, npairs, M + 1), FAIL, np.int32)
    D = np.full((2, npairs, M + 1), NONE, np.int16)
    for i in range(n, -1, -1):
        p = pid[i, i + 1]
        for t in range(2):
            leaf = P[t, i, i + 1]
            for m in range(leaf, M + 1):
                C[t, p, m] = LIN[t, i, i + 1]
                B[t, p, m] = leaf
        for j in range(i + 2, n + 2):
            p = pid[i, j]
            for t in range(2):
                hi = min(NR[t, i, j], M + 1)
                fcomp = 0.0
                fpk = 0
                for k in range(i + 1, j):
                    fcomp += af[k]
                    tr = fx[k] + (fo[k - 1] if k - 1 > i else 0)
                    if tr > fpk:
                        fpk = tr
                    pf = bb[j] + fpk
                    pr = pid[k, j]
                    for s in range(1, -1, -1):
                        if s == 1:
                            sz = fs[k] if k == i + 1 else ft[k]
                            kl = k
                        else:
                            if k + 1 >= j:
                                continue
                            sz = fo[k]
                            kl = k + 1
                        pl = pid[i, kl]
                        lo = max(pf, sz + P[s, k, j], P[t, i, kl])
                        for m in range(lo, hi):
                            c = fcomp + C[s, pr, m - sz] + C[t, pl, m]
                            if c < C[t, p, m]:
                                C[t, p, m] = c
                                D[t, p, m] = 2 * k + s
                                B[t, p, m] = max(pf, sz + B[s, pr, m - sz], B[t, pl, m])
                for m in range(max(hi, 0), M + 1):
                    C[t, p, m] = LIN[t, i, j]
                    B[t, p, m] = NR[t, i, j]
                    D[t, p, m] = 2 * (i + 1) + 1
    return C, B, D


@njit
def gruslys_dp(t_max, m_max):
    """Gruslys et al. Alg. 2.1 in forward-count units: C[t, m] = number of forward
    evaluations to backprop a length-t uniform chain with m slots, D[t, m] = y.

    Backward costs are the constant t per chain and added by the caller.
    """
    INF = np.inf
    C = np.full((t_max + 1, m_max + 1), INF)
    D = np.zeros((t_max + 1, m_max + 1), np.int64)
    for t in range(1, t_max + 1):
        if m_max >= 1:
            C[t, 1] = t * (t - 1) / 2.0  # recompute everything (t-1 forwards, then t-2, ...)
            D[t, 1] = 0
        for m in range(max(t, 1), m_max + 1):
            C[t, m] = t - 1.0  # store everything: each forward once
            D[t, m] = 1
    for m in range(2, m_max + 1):
        for t in range(m + 1, t_max + 1):
            cmin = INF
            for y in range(1, t):
                c = y + C[y, m] + C[t - y, m - 1]
                if c < cmin:
                    cmin = c
                    D[t, m] = y
            C[t, m] = cmin
    return C, D
