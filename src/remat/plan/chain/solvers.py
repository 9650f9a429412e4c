"""Chain checkpointing solvers: precise (thesis §3.1), uniform (Gruslys), sqrt, none,
exhaustive, and an extended model.  Entry point: :func:`solve`.

Memory model (thesis, §2.4.3 / §3.1; bytes).  ``f_0`` is live throughout; a
sub-problem ``C(i, j, m)`` is given ``f_i`` (outside its memory ``m``) and owns
``b_j`` (inside ``m``) and must produce ``b_i``.  A forward ``f_l`` is computed
from ``f_{l-1}`` with both live (``beta_f[l-1] + beta_f[l]``, except ``f_i`` which
is outside ``m``) and ``f_{l-1}`` is then freed unless it is a checkpoint.
Choice ``k``: run forwards ``f_{i+1}..f_k`` while holding ``b_j``, keep ``f_k``,
solve ``(k, j)`` in ``m - beta_f[k]``, free ``f_k``, solve ``(i, k)`` in ``m``.
Leaf ``(i, i+1)``: ``B(i)`` with ``b_{i+1}`` and ``b_i`` live, then free
``b_{i+1}``.  The top level is ``C(0, N+1, budget - beta_f[0])``.

Extended model (``method="extended"``, simulated with ``model="extended"``).
Each ``f_i`` has an output part (``beta_f[i]``; what the next forward needs) and
a tape (``tape_bytes[i]``; what only ``b_i`` additionally needs).  Computing
``f_l`` transiently needs ``out_l + tape_l + fwd_overhead_l`` on top of what is
live; computing ``b_i`` needs ``beta_b[i] + bwd_overhead[i]`` (less the bytes of ``f_i``'s output
it does not read, ``out_unread[i]``: freed before it runs).  Intermediate
forwards keep only the output (``F``).  Two families of sub-problems:

* family 1, ``C1(i, j, m)``: given ``f_i`` *with its tape*, produce ``b_i``;
* family 0, ``C0(i, j, m)``: given ``f_i`` output only, produce ``b_{i+1}``
  (``C0(i, i+1) = 0``: nothing to do).

Choice ``(k, s)`` in ``C_t(i, j, m)``: forwards to ``f_k`` holding ``b_j``, then
``s = 1``: keep ``f_k`` with its tape (``FT(k)``), right ``C1(k, j, m - out_k -
tape_k)``, free, left ``C_t(i, k, m)``; or ``s = 0`` (``k + 1 < j``): keep only
``f_k``'s output (``F(k)``), right ``C0(k, j, m - out_k)`` giving ``b_{k+1}``,
free, left ``C_t(i, k+1, m)`` (which recomputes ``f_k`` with its tape later).
Family 1 with ``s = 1`` only is exactly the thesis DP; the thesis's accounting
on :meth:`ChainCosts.folded` costs upper-bounds the extended accounting of the
same schedule, so the extended optimum is never worse than ``precise`` run on
the folded measurements (and equal when there are no tapes / overheads).

Bucketing (``bucket`` = bytes per memory unit): every size is rounded *up* to
whole units and the budget *down*, so plans are always valid in exact bytes
(``Solution.peak`` is the simulated exact peak); the price is a possibly higher
cost (thesis §4.2).  ``bucket="exact"`` runs the frontier DP of
:mod:`._pareto` in exact bytes (no bucketing loss); ``bucket=None`` picks a
bucket giving about ``DEFAULT_UNITS`` units.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Literal, Sequence

import numpy as np

from . import _kernels as K
from ._pareto import pareto_dp
from .costs import BudgetTooSmall, ChainCosts
from ..record import Solution
from .schedule import B, F, FT, ChainStep, Free, evaluate_chain

__all__ = [
    "solve", "solve_thesis", "minimum_budget", "no_recompute_peak", "METHODS",
    "DEFAULT_UNITS", "Tree",
]

METHODS = ("precise", "uniform", "sqrt", "none", "exhaustive", "extended")
DEFAULT_UNITS = 4000  # memory units used when bucket=None

# A strategy tree: ("leaf",) | ("quad",) | ("split", k, s, right, left).
Tree = tuple

_LEAF: Tree = ("leaf",)
_QUAD: Tree = ("quad",)


# ---------------------------------------------------------------- emission
def _emit_forwards(i: int, k: int, keep_tape: bool, out: list[ChainStep]) -> None:
    """Forwards f_{i+1}..f_k in place: each intermediate is freed once the next exists."""
    for l in range(i + 1, k + 1):
        out.append(FT(l) if (l == k and keep_tape) else F(l))
        if l - 1 > i:
            out.append(Free("f", l - 1))


def _emit(tree: Tree, t: int, i: int, j: int, out: list[ChainStep]) -> None:
    """Append the steps of strategy ``tree`` for family-``t`` sub-problem (i, j)."""
    kind = tree[0]
    if kind == "leaf":
        if j != i + 1:
            raise AssertionError(f"leaf on ({i}, {j})")
        if t == 1:
            out.append(B(i))
            out.append(Free("b", i + 1))
        return
    if kind == "quad":
        # "recompute everything" (thesis §2.5.2, eq. 3.4/3.5); family 1 only.
        for jp in range(j - 1, i - 1, -1):
            if jp > i:
                _emit_forwards(i, jp, True, out)
            out.append(B(jp))
            out.append(Free("b", jp + 1))
            if jp > i:
                out.append(Free("f", jp))
        return
    _, k, s, right, left = tree
    _emit_forwards(i, k, s == 1, out)
    _emit(right, s, k, j, out)
    out.append(Free("f", k))
    _emit(left, t, i, k if s == 1 else k + 1, out)


def tree_to_schedule(tree: Tree, n: int) -> list[ChainStep]:
    """Schedule of a strategy tree for the whole chain (0, N+1), family 1."""
    out: list[ChainStep] = []
    lim = sys.getrecursionlimit()
    if lim < 4 * n + 100:
        sys.setrecursionlimit(4 * n + 100)
    _emit(tree, 1, 0, n + 1, out)
    return out


def _store_all(i: int, j: int) -> Tree:
    """No-recompute strategy on (i, j): checkpoint every forward."""
    if j == i + 1:
        return _LEAF
    return ("split", i + 1, 1, _store_all(i + 1, j), _LEAF)


# ---------------------------------------------------------------- helpers
def _ceil_div(a: np.ndarray, u: int) -> np.ndarray:
    return -((-np.asarray(a, np.int64)) // u)


def _auto_bucket(budget: float, units: int = DEFAULT_UNITS) -> int:
    return max(1, math.ceil(budget / units))


def _check_budget(budget: float) -> None:
    if not (isinstance(budget, (int, float, np.integer, np.floating)) and math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget must be a finite number of bytes >= 0, got {budget!r}")


def no_recompute_peak(costs: ChainCosts, model: Literal["thesis", "extended"] = "thesis") -> int:
    """Peak bytes of the store-everything schedule (eq. 2.19 plus the forward phase)."""
    n = costs.n
    return evaluate_chain(costs, tree_to_schedule(_store_all(0, n + 1), n), model)[1]


def _thesis_units(costs: ChainCosts, bucket: int):
    c = costs.folded()
    return _ceil_div(c.beta_f, bucket), _ceil_div(c.beta_b, bucket), c


def minimum_budget(costs: ChainCosts, bucket: int | str = 1,
                   method: Literal["precise", "extended"] = "precise") -> int:
    """Least budget (bytes) for which ``solve(costs, ., method, bucket)`` is feasible.

    Exact: feasibility is monotone in the memory, and the per-sub-problem
    minimum peak obeys the same recurrence as the DP with ``min``/``max`` in
    place of cost (computed in O(N^3)).  With ``bucket > 1`` it is the minimum
    under that bucketing (a multiple of ``bucket``).
    """
    u = 1 if bucket == "exact" else int(bucket)
    n = costs.n
    if method == "extended":
        a = _ext_units(costs, u)
        P, _, _ = K.ext_bounds(costs.alpha_f, costs.alpha_b, *a)
        return u * int(a[1][0] + P[1, 0, n + 1])
    bf, bb, c = _thesis_units(costs, u)
    P, _, _ = K.thesis_bounds(bf, bb, c.alpha_f, c.alpha_b)
    return u * int(bf[0] + P[0, n + 1])


def _finish(method: str, costs: ChainCosts, budget: float, tree_or_sched, model: str,
            bucket, t0: float, stats: dict, expect_cost: float | None = None) -> Solution:
    sched = tree_or_sched if isinstance(tree_or_sched, list) else tree_to_schedule(tree_or_sched, costs.n)
    cost, peak = evaluate_chain(costs, sched, model)  # exact bytes, validates the schedule
    if expect_cost is not None and not math.isclose(cost, expect_cost, rel_tol=1e-9, abs_tol=1e-9):
        raise AssertionError(f"{method}: DP cost {expect_cost} != simulated {cost}")
    return Solution(method, sched, cost, int(peak), budget=int(budget), seconds=time.perf_counter() - t0,
                    base_cost=costs.no_recompute_cost(), stats=stats, model=model, bucket=bucket)


# ---------------------------------------------------------------- precise
def _solve_precise(costs: ChainCosts, budget: float, bucket, t0: float) -> Solution:
    n = costs.n
    if bucket == "exact":
        return _solve_exact(costs, budget, t0)
    u = int(bucket)
    if u < 1:
        raise ValueError(f"bucket must be >= 1 byte, got {bucket}")
    bf, bb, c = _thesis_units(costs, u)
    P, NR, LIN = K.thesis_bounds(bf, bb, c.alpha_f, c.alpha_b)
    need = int(bf[0] + P[0, n + 1])
    units = int(budget // u)
    if units < need:
        raise BudgetTooSmall(budget, u * need, detail=f"bucket {u} B")
    M = units - int(bf[0])
    # Memory above the no-recompute peak is never needed: cap the table width.
    M = min(M, int(NR[0, n + 1]))
    pid, npairs = K.pair_ids(n)
    C, Bt, D = K.thesis_dp(c.alpha_f, c.alpha_b, bf, bb, M, pid, npairs, P, NR, LIN)

    def tree(i: int, j: int, m: int) -> Tree:
        if j == i + 1:
            return _LEAF
        d = int(D[pid[i, j], m])
        if d == K.QUAD:
            return _QUAD
        if d < 0:
            raise AssertionError(f"no decision for ({i}, {j}, {m})")
        return ("split", d, 1, tree(d, j, m - int(bf[d])), tree(i, d, m))

    if sys.getrecursionlimit() < 4 * n + 100:
        sys.setrecursionlimit(4 * n + 100)
    p0 = pid[0, n + 1]
    stats = {"units": M, "bucket_bytes": u, "dp_cost": float(C[p0, M]),
            "predicted_peak": u * int(bf[0] + Bt[p0, M]), "minimum_budget": u * need,
            "no_recompute_peak_units": int(bf[0] + NR[0, n + 1])}
    return _finish("precise", costs, budget, tree(0, n + 1, M), "thesis", u, t0, stats,
                   expect_cost=float(C[p0, M]))


def _solve_exact(costs: ChainCosts, budget: float, t0: float) -> Solution:
    n = costs.n
    c = costs.folded()
    bf, bb = c.beta_f, c.beta_b
    P, NR, _ = K.thesis_bounds(bf, bb, c.alpha_f, c.alpha_b)
    need = int(bf[0] + P[0, n + 1])
    if budget < need:
        raise BudgetTooSmall(budget, need, detail="exact")
    mcap = int(math.floor(budget)) - int(bf[0])
    mcap = min(mcap, int(NR[0, n + 1]))
    pid, npairs = K.pair_ids(n)
    start, length, gp, gc, gk = pareto_dp(c.alpha_f, c.alpha_b, bf, bb, mcap, pid, npairs)

    def lookup(i: int, j: int, m: int) -> int:
        p = pid[i, j]
        s, ln = int(start[p]), int(length[p])
        q = int(np.searchsorted(gp[s:s + ln], m, side="right")) - 1
        if q < 0:
            raise AssertionError(f"exact: ({i}, {j}) infeasible at {m}")
        return s + q

    def tree(i: int, j: int, m: int) -> Tree:
        if j == i + 1:
            return _LEAF
        e = lookup(i, j, m)
        k, pk = int(gk[e]), int(gp[e])
        return ("split", k, 1, tree(k, j, pk - int(bf[k])), tree(i, k, pk))

    if sys.getrecursionlimit() < 4 * n + 100:
        sys.setrecursionlimit(4 * n + 100)
    e0 = lookup(0, n + 1, mcap)
    stats = {"dp_cost": float(gc[e0]), "predicted_peak": int(bf[0] + gp[e0]), "minimum_budget": need,
            "frontier_points": int(length.sum()), "top_frontier": int(length[pid[0, n + 1]])}
    return _finish("precise", costs, budget, tree(0, n + 1, mcap), "thesis", "exact", t0, stats,
                   expect_cost=float(gc[e0]))


def solve_thesis(alpha_f: Sequence[float], alpha_b: Sequence[float], beta_f: Sequence[int],
                 beta_b: Sequence[int], budget: float, bucket: int | str = 1) -> Solution:
    """The thesis's solver in its own notation (Alg. 3.4).

    ``alpha_f``/``beta_f`` over f_0..f_N, ``alpha_b``/``beta_b`` over b_0..b_{N+1},
    ``budget`` M in bytes.  ``plan.cost == C(0, N+1, M - beta_f[0])`` and
    ``plan.peak == beta_f[0] + B(0, N+1, M - beta_f[0])`` (for ``bucket=1``).
    """
    costs = ChainCosts(alpha_f, alpha_b, beta_f, beta_b)
    return solve(costs, budget, "precise", bucket=bucket)


# ---------------------------------------------------------------- extended
def _ext_units(costs: ChainCosts, u: int):
    """The extended model's sizes in units of ``u`` bytes, rounded up: ``f_i``'s output (``fo``),
    output and tape (``ft``), the same less the tape's share of ``f_{i-1}``'s output (``fs``: what
    keeping ``f_i`` with its tape adds while ``f_{i-1}`` stays live), a forward's transient bytes
    beyond its live input (``fx``), and ``b_i`` and a backward's transient bytes (``bb``, ``bx``)."""
    out, tape, share = costs.beta_f, costs.tape_bytes, costs.tape_input
    fo = _ceil_div(out, u)
    ft = _ceil_div(out + tape, u)
    fs = _ceil_div(out + tape - share, u)
    fx = _ceil_div(out + tape + costs.fwd_overhead - share, u)
    bb = _ceil_div(costs.beta_b, u)
    bx = _ceil_div(costs.backward_transient(), u)
    return fo, ft, fs, fx, bb, bx


def _solve_extended(costs: ChainCosts, budget: float, bucket, t0: float, tables: dict | None = None) -> Solution:
    n = costs.n
    u = 1 if bucket == "exact" else int(bucket)
    fo, ft, fs, fx, bb, bx = _ext_units(costs, u)
    hit = None if tables is None else tables.get(("extended", u))
    if hit is None:
        P, NR, LIN = K.ext_bounds(costs.alpha_f, costs.alpha_b, fo, ft, fs, fx, bb, bx)
    else:
        P, NR, LIN = hit[1:4]
    need = int(ft[0] + P[1, 0, n + 1])
    units = int(budget // u)
    if units < need:
        raise BudgetTooSmall(budget, u * need, detail=f"extended model, bucket {u} B")
    M = min(units - int(ft[0]), int(NR[1, 0, n + 1]))
    pid, npairs = K.pair_ids(n)
    if hit is not None and hit[0] >= M:
        # Entries for memory m <= M do not depend on the table's width: a wider table answers M too.
        C, Bt, D = hit[4:]
    else:
        C, Bt, D = K.ext_dp(costs.alpha_f, costs.alpha_b, fo, ft, fs, fx, bb, bx, M, pid, npairs, P, NR, LIN)
        if tables is not None:
            tables[("extended", u)] = (M, P, NR, LIN, C, Bt, D)

    def tree(t: int, i: int, j: int, m: int) -> Tree:
        if j == i + 1:
            return _LEAF
        d = int(D[t, pid[i, j], m])
        if d < 0:
            raise AssertionError(f"extended: no decision for {t}({i}, {j}, {m})")
        k, s = divmod(d, 2)
        if s == 1:
            return ("split", k, 1, tree(1, k, j, m - int(fs[k] if k == i + 1 else ft[k])), tree(t, i, k, m))
        return ("split", k, 0, tree(0, k, j, m - int(fo[k])), tree(t, i, k + 1, m))

    if sys.getrecursionlimit() < 4 * n + 100:
        sys.setrecursionlimit(4 * n + 100)
    p0 = pid[0, n + 1]
    stats = {"units": M, "bucket_bytes": u, "dp_cost": float(C[1, p0, M]),
            "predicted_peak": u * int(ft[0] + Bt[1, p0, M]), "minimum_budget": u * need}
    return _finish("extended", costs, budget, tree(1, 0, n + 1, M), "extended", u, t0, stats,
                   expect_cost=float(C[1, p0, M]))


def extended_levels(costs: ChainCosts, lo: int, hi: int, bucket: int, tables: dict) -> list[tuple[int, int]]:
    """The distinct plans of the extended DP between budgets ``lo`` and ``hi`` (bytes): for each
    cost level, the smallest budget reaching it and its model peak bound (bytes), in increasing
    budget (so decreasing cost). Read from ``tables`` (solved at ``hi`` here if needed), so a
    search over plans needs no DP per probe."""
    u = int(bucket)
    solve(costs, hi, "extended", bucket=u, tables=tables)
    M_top, P, NR, LIN, C, Bt, D = tables[("extended", u)]
    n = costs.n
    ft0 = int(_ext_units(costs, u)[1][0])
    p0 = K.pair_ids(n)[0][0, n + 1]
    cap = int(NR[1, 0, n + 1])
    m_lo, m_hi = min(lo // u - ft0, cap), min(hi // u - ft0, cap, M_top)
    if m_lo < 0 or m_lo > m_hi:
        return []
    row = C[1, p0, m_lo:m_hi + 1]
    first = [0] + [int(k) for k in np.flatnonzero(row[1:] < row[:-1]) + 1]
    return [((m_lo + k + ft0) * u, u * int(ft0 + Bt[1, p0, m_lo + k])) for k in first]


# ---------------------------------------------------------------- baselines
def _solve_uniform(costs: ChainCosts, budget: float, t0: float) -> Solution:
    """Gruslys et al. (Alg. 2.1) on averaged costs, evaluated under precise costs.

    Memory slots: one slot per average forward tensor after reserving ``f_0`` and
    two average backward tensors (the live gradient and the one being computed):
    ``m = floor((budget - beta_f[0] - 2 * mean(beta_b)) / mean(beta_f))``, at least
    1.  The resulting schedule is simulated under the real (folded) costs; it
    may exceed the budget (``plan.feasible`` is then False).
    """
    n = costs.n
    c = costs.folded()
    mf = float(c.beta_f[1:].mean())
    mb = float(c.beta_b[:-1].mean())
    slots = int(math.floor((budget - c.beta_f[0] - 2 * mb) / max(mf, 1e-12)))
    slots = max(1, min(slots, n + 1))
    t_max = n + 1
    Cg, Dg = K.gruslys_dp(t_max, slots)

    def tree(i: int, j: int, m: int) -> Tree:
        t = j - i
        if t == 1:
            return _LEAF
        y = int(Dg[t, m])
        if y == 0:
            return _QUAD
        k = i + y
        return ("split", k, 1, tree(k, j, m - 1), tree(i, k, m))

    stats = {"slots": slots, "predicted_forwards": float(Cg[t_max, slots]),
            "slot_bytes": mf}
    return _finish("uniform", costs, budget, tree(0, n + 1, slots), "thesis", None, t0, stats)


def _solve_sqrt(costs: ChainCosts, budget: float, t0: float) -> Solution:
    """Chen et al.'s sqrt(N) segments: checkpoint every L-th forward, L = ceil(sqrt(N+1)),
    and backprop each segment with everything stored (one recomputation)."""
    n = costs.n
    L = max(1, math.ceil(math.sqrt(n + 1)))
    cuts = list(range(L, n + 1, L))

    def tree(idx: int, i: int) -> Tree:
        if idx == len(cuts):
            return _store_all(i, n + 1)
        k = cuts[idx]
        return ("split", k, 1, tree(idx + 1, k), _store_all(i, k))

    return _finish("sqrt", costs, budget, tree(0, 0), "thesis", None, t0, {"segment": L})


def _solve_none(costs: ChainCosts, budget: float, t0: float) -> Solution:
    return _finish("none", costs, budget, _store_all(0, costs.n + 1), "thesis", None, t0, {})


def _enum_trees(t: int, i: int, j: int, model: str, memo: dict) -> list[Tree]:
    key = (t, i, j)
    if key in memo:
        return memo[key]
    if j == i + 1:
        res = [_LEAF]
    else:
        res = []
        if model == "thesis":
            res.append(_QUAD)
        for k in range(i + 1, j):
            for s in ((1,) if model == "thesis" else (1, 0)):
                if s == 0 and k + 1 >= j:
                    continue
                rights = _enum_trees(s, k, j, model, memo)
                lefts = _enum_trees(t, i, k if s == 1 else k + 1, model, memo)
                res.extend(("split", k, s, r, l) for r in rights for l in lefts)
    memo[key] = res
    return res


def _solve_exhaustive(costs: ChainCosts, budget: float, t0: float,
                      model: Literal["thesis", "extended"] = "thesis") -> Solution:
    """Brute force: evaluate every strategy of the model (checkpoint trees, plus the
    quadratic strategy in the thesis model) and keep the cheapest within budget.
    Independent of the DP's formulas (uses only the simulator).  N <= 7."""
    n = costs.n
    if n > 7:
        raise ValueError(f"exhaustive search is limited to N <= 7 layers (got N={n})")
    best = None
    trees = _enum_trees(1, 0, n + 1, model, {})
    min_peak = None
    for tr in trees:
        sched = tree_to_schedule(tr, n)
        cost, peak = evaluate_chain(costs, sched, model)
        min_peak = peak if min_peak is None else min(min_peak, peak)
        if peak <= budget and (best is None or cost < best[0] - 1e-12):
            best = (cost, peak, sched)
    if best is None:
        raise BudgetTooSmall(budget, int(min_peak), detail=f"exhaustive over {len(trees)} strategies")
    return _finish("exhaustive", costs, budget, best[2], model, None, t0,
                   {"strategies": len(trees), "minimum_budget": int(min_peak)})


# ---------------------------------------------------------------- entry point
def solve(costs: ChainCosts, budget: float, method: str = "precise",
          bucket: int | str | None = None, tables: dict | None = None) -> Solution:
    """Solve for a checkpointing plan of ``costs`` within ``budget`` bytes.

    ``method``: ``precise`` | ``extended`` | ``uniform`` | ``sqrt`` | ``none`` |
    ``exhaustive`` (thesis model) | ``exhaustive-extended``.  ``bucket``: bytes per
    memory unit for the DP methods (int), ``"exact"`` (precise: frontier DP in
    exact bytes; extended: bucket 1), or ``None`` (about ``DEFAULT_UNITS`` units).
    Raises :class:`BudgetTooSmall` for infeasible budgets (DP/exhaustive methods);
    baselines return plans with ``feasible == False`` instead.
    ``tables``: a dict owned by the caller, kept across calls on the same ``costs`` so that the
    extended DP's tables are computed once (at the widest budget seen) and read at every smaller one.
    """
    _check_budget(budget)
    if not isinstance(costs, ChainCosts):
        raise TypeError(f"costs must be a ChainCosts, got {type(costs).__name__}")
    t0 = time.perf_counter()
    if method in ("precise", "extended"):
        if bucket is None:
            bucket = _auto_bucket(budget)
        elif bucket != "exact" and (not isinstance(bucket, (int, np.integer)) or bucket < 1):
            raise ValueError(f"bucket must be a positive int, 'exact' or None, got {bucket!r}")
        if method == "precise":
            return _solve_precise(costs, budget, bucket, t0)
        return _solve_extended(costs, budget, bucket, t0, tables)
    if method == "uniform":
        return _solve_uniform(costs, budget, t0)
    if method == "sqrt":
        return _solve_sqrt(costs, budget, t0)
    if method == "none":
        return _solve_none(costs, budget, t0)
    if method == "exhaustive":
        return _solve_exhaustive(costs, budget, t0, "thesis")
    if method == "exhaustive-extended":
        return _solve_exhaustive(costs, budget, t0, "extended")
    raise ValueError(f"unknown method {method!r}; choose from {METHODS + ('exhaustive-extended',)}")

