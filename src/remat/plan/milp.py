"""Optimal rematerialization for general DAGs as a MILP (Checkmate, Jain et al. 2020).

Formulation (stage-based, for a fixed topological order of first computations).
Let ``C = [c_0, ..., c_{T-1}]`` be the compute (non-input) nodes in order; stage
``s`` is where ``c_s`` is computed for the first time, preceded by any
recomputations of earlier nodes, in index order, each at most once per stage.

Variables (``s`` stage, ``v``/``k`` nodes):

* ``R[s,v]`` binary: compute ``v`` in stage ``s`` (``v <= c_s``); ``R[s,c_s] = 1``;
  a non-recomputable ``v`` only has ``R[pos(v),v]``.
* ``S[s,v]`` binary: ``v`` is live at the start of stage ``s`` (``s = T``: at the
  end of the run).  Inputs that are not outputs get ``S`` variables too
  (``S[0,v] = 1``, non-increasing: they can be freed but never recomputed).
* ``FREE[s,v,k]`` continuous in [0,1]: free ``v`` right after computing ``k``
  (``k`` reads ``v`` or ``k = v``) in stage ``s``.  Upper bounds make it 0 unless
  ``R[s,k] = 1``, ``S[s+1,v] = 0`` and no later reader of ``v`` runs in stage
  ``s``; since those bounds are disaggregated and binaries are integral, FREE is
  effectively 0/1 and may be continuous.
* ``U[s,j]`` continuous: bytes live just before the ``j``-th candidate of stage ``s``.

Constraints: dependencies ``R[s,k] <= R[s,v] + S[s,v]`` for ``v`` in inputs(k);
storage ``S[s+1,v] <= S[s,v] + R[s,v]``; outputs ``S[T,v] = 1``; memory
``U[s,0] = pinned + sum_v S[s,v] b_v``,
``U[s,j+1] = U[s,j] + R[s,k_j] b_{k_j} - sum_v FREE[s,v,k_j] b_v`` and
``U[s,j] + R[s,k_j] (b_{k_j} + w_{k_j}) <= budget`` (the *during* moment of the
memory model in :mod:`.graph`).  Objective: ``min sum R[s,v] cost_v``.

The model's memory is an upper bound on the memory of the extracted schedule
(the compute sequence with eager frees, :func:`.graph.eager_frees`), and is exact
for an optimal choice of FREE/S, so the optimum equals the best schedule in this
space (verified against exhaustive search in the tests).  The reported peak/cost
are always re-measured with :func:`.graph.evaluate`.

Size: O(T^2) binaries (T = compute nodes); under a 10 s limit HiGHS proves small graphs
(tens of nodes) optimal and finds nothing on graphs of ~100 (:data:`MILP_MAX_NODES`).
:func:`solve_with_fallback` uses the greedy above that.

On larger graphs :func:`improve_in_windows` searches the neighbourhood of a given plan (the
greedy's): the same model restricted to a few consecutive stages (a window, with what is live at
its start bounded by the plan's prefix and what is live at its end fixed to what the plan's
suffix reads), re-solved with the rest of the schedule fixed, window after window.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .record import Solution
from .graph import (
    COMPUTE,
    BudgetTooSmall,
    Graph,
    check_order,
    eager_frees,
    make_plan,
    min_memory_lower_bound,
    evaluate,
    schedule_computes,
)

__all__ = [
    "NoSolutionFound",
    "solve_milp",
    "milp_min_peak",
    "MinPeak",
    "solve_with_fallback",
    "MILP_MAX_VARS",
    "MILP_NODE_LIMIT",
    "improve_in_windows",
    "WindowSearch",
    "WindowPass",
    "WINDOW_PASSES",
    "WIDE_WINDOW_PASS",
]


class NoSolutionFound(RuntimeError):
    """The MILP found no feasible schedule within its time limit (not proven
    infeasible).  The caller should fall back to the greedy solver."""

    def __init__(self, budget: int, time_limit: float, seconds: float, detail: str) -> None:
        self.budget = budget
        self.time_limit = time_limit
        self.seconds = seconds
        super().__init__(
            f"MILP found no feasible schedule for budget {budget} B within "
            f"{time_limit:g}s (ran {seconds:.2f}s): {detail}"
        )


@dataclass
class _Model:
    """The assembled MILP plus the bookkeeping to read a solution back."""

    c: np.ndarray
    integrality: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    A: object  # scipy.sparse.coo_matrix
    row_lb: np.ndarray
    row_ub: np.ndarray
    R: dict[tuple[int, int], int]  # (stage, node) -> column
    T: int
    comp: list[int]  # compute nodes in order
    peak_col: int | None  # column of the peak variable (min-peak mode)
    unit: float  # bytes per model memory unit
    n_vars: int
    n_rows: int
    cost_scale: float  # seconds per objective unit


MILP_NODE_LIMIT = 2000
"""Branch-and-bound nodes the whole-graph MILP may explore under ``"auto"``: its deterministic work
limit (the time limit then only guards against a runaway solve, whose answer is discarded)."""

MILP_MAX_NODES = 64
"""Largest instruction graph (compute nodes) the whole-graph MILP is tried on under ``"auto"``:
beyond it the greedy alone runs (and the MILP only on its neighbourhood, :func:`improve_in_windows`).
Measured with HiGHS's default 10 s limit on this project's 2-core machines: on synthetic graphs of
13-25 nodes it proves optimal plans in 0.6-7 s, cheaper than the greedy's or where the greedy finds
none; at 32-74 nodes (``bench/results/graph_solvers.json``, 15 s) it finds a cheaper plan in 2 of 10
cases and none at all in 4; on real steps of 98 and 147 nodes (zoo ResNet tiny at 80%, Hugging Face
ConvNeXt tiny at 50%) it finds no feasible plan in 10 s (none in 60 s for the second), which cost
each ``remat.compile`` 10-20 s for the greedy's plan."""

MILP_MAX_VARS = 1000
"""Largest whole-graph MILP (variables) :func:`solve_with_fallback` solves; above it the greedy alone.
The model grows as the square of the graph's stages (~2.5 T^2 variables on real steps), and HiGHS's
root node alone outgrows the time limit first: over the test suite, every whole-graph solve under
``"auto"`` of 2,179-6,860 variables (real steps of 29-52 nodes) stopped at the 10 s guard and was
discarded (a 37-node MLP's step with 3,541 variables: 6 s at the root node, 430 of its 2,000
nodes in 60 s, gap 8.7%; a 29-node one of 2,179 variables: proven optimal after 36 s), while those
of 899-925 variables (19 nodes) finished in under 0.5 s. Skipping them changed no plan there (each
was discarded; the windows, deterministic, still search the greedy's neighbourhood) and saves those
10 s of every such compile."""


@dataclass(frozen=True)
class _Window:
    """Stages ``[a, b)`` of the MILP, the rest of the schedule fixed (a neighbourhood search).
    ``allowed``: the only nodes the window may hold or compute; ``live_a``: what may be live at
    the start of stage ``a`` (the fixed prefix holds it); ``live_b``: exactly what must be live at
    the start of stage ``b`` (what the fixed suffix reads); ``recompute``: the only nodes the
    window may compute again (a subset of ``allowed``)."""

    a: int
    b: int
    allowed: frozenset[int]
    live_a: frozenset[int]
    live_b: frozenset[int]
    recompute: frozenset[int]


def _memory_vars(nodes, comp, a: int, b: int, R: dict, S: dict, const_live: set) -> int:
    """The continuous variables :func:`_build` adds with its constraints: per stage, the memory
    level before each computation and after each but the last, and one free flag per value each
    but the last computation may free (counted as the memory recurrence creates them)."""
    n = 0
    for s in range(a, b):
        cand = [v for v in comp[: s + 1] if (s, v) in R]
        n += 1
        for k in cand[:-1]:
            n += 1 + sum(1 for v in list(nodes[k].inputs) + [k] if v not in const_live and (s + 1, v) in S)
    return n


def _build(graph: Graph, budget: int | None, unit: float, peak_lb: float = 0.0, window: _Window | None = None,
           max_vars: int | None = None) -> _Model | None:
    """Assemble the Checkmate MILP.  ``budget=None``: minimise the peak instead
    (a continuous peak variable replaces the budget, objective = peak).  ``window``: only its
    stages, between fixed live sets (the whole run when None). None when the model would have more
    than ``max_vars`` variables (known before its constraints, most of the work, are built)."""
    nodes = graph.nodes
    cons = graph.consumers
    comp = graph.compute_nodes
    T = len(comp)
    a, b = (0, T) if window is None else (window.a, window.b)
    ok = (lambda v: True) if window is None else window.allowed.__contains__
    again = ok if window is None else window.recompute.__contains__
    size = [nd.bytes / unit for nd in nodes]  # memory in model units
    pinned = [i for i, nd in enumerate(nodes) if nd.is_input and nd.is_output]
    pinned_mem = sum(size[i] for i in pinned)
    # inputs that may be freed: used, not outputs (unused ones are freed at the start)
    free_in = [i for i, nd in enumerate(nodes) if nd.is_input and not nd.is_output and cons[i] and ok(i)]
    const_live = set(pinned)  # always live: no variables, constant memory

    col_lb: list[float] = []
    col_ub: list[float] = []
    col_c: list[float] = []
    col_int: list[int] = []

    def new(lo: float, hi: float, cost: float, integer: bool) -> int:
        col_lb.append(lo)
        col_ub.append(hi)
        col_c.append(cost)
        col_int.append(1 if integer else 0)
        return len(col_lb) - 1

    R: dict[tuple[int, int], int] = {}
    S: dict[tuple[int, int], int] = {}
    for s in range(a, b):
        cs = comp[s]
        for v in comp[: s + 1]:
            if v == cs:
                R[s, v] = new(1.0, 1.0, nodes[v].cost, True)
            elif nodes[v].recomputable and again(v):
                R[s, v] = new(0.0, 1.0, nodes[v].cost, True)
    for s in range(a, b + 1):
        for v in comp[:s] + free_in:
            if not ok(v):
                continue
            if window is not None and s == a:  # the prefix may hold it; dropping it frees it earlier
                S[s, v] = new(0.0, 1.0 if v in window.live_a else 0.0, 0.0, True)
            elif window is not None and s == b:  # the suffix needs exactly these
                S[s, v] = new(*((1.0, 1.0) if v in window.live_b else (0.0, 0.0)), 0.0, True)
            elif v in free_in:
                S[s, v] = new(1.0 if s == 0 else 0.0, 0.0 if s == T else 1.0, 0.0, True)
            elif s == T:  # the end: exactly the outputs are kept
                S[s, v] = new(1.0, 1.0, 0.0, True) if nodes[v].is_output else new(0.0, 0.0, 0.0, True)
            else:
                S[s, v] = new(0.0, 1.0, 0.0, True)
    peak_col = None
    if budget is None:
        peak_col = new(peak_lb, np.inf, 1.0, False)
    if max_vars is not None and len(col_lb) + _memory_vars(nodes, comp, a, b, R, S, const_live) > max_vars:
        return None

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    r_lb: list[float] = []
    r_ub: list[float] = []

    def row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(r_lb)
        for c_, v_ in entries:
            rows.append(r)
            cols.append(c_)
            vals.append(v_)
        r_lb.append(lo)
        r_ub.append(hi)

    cap = np.inf if budget is None else budget / unit
    for s in range(a, b):
        cand = [v for v in comp[: s + 1] if (s, v) in R]
        # dependencies: R[s,k] <= R[s,v] + S[s,v]
        for k in cand:
            for v in nodes[k].inputs:
                if v in const_live:
                    continue
                ent = [(R[s, k], 1.0)]
                if (s, v) in R:
                    ent.append((R[s, v], -1.0))
                if (s, v) in S:
                    ent.append((S[s, v], -1.0))
                row(ent, -np.inf, 0.0)
        # storage: S[s+1,v] <= S[s,v] + R[s,v]
        for v in comp[: s + 1]:
            if (s + 1, v) not in S:
                continue  # outside the window's nodes
            ent = [(S[s + 1, v], 1.0)]
            if (s, v) in S:
                ent.append((S[s, v], -1.0))
            if (s, v) in R:
                ent.append((R[s, v], -1.0))
            row(ent, -np.inf, 0.0)
        for v in free_in:  # inputs are only ever dropped
            row([(S[s + 1, v], 1.0), (S[s, v], -1.0)], -np.inf, 0.0)
        # no waste (tightens the LP, removes symmetric solutions): recompute v only
        # if a reader runs in this stage or v is kept; keep v into stage s+1 only if
        # it is read there or kept further
        for v in comp[:s]:
            if (s, v) not in R:
                continue
            ent = [(R[s, v], 1.0), (S[s + 1, v], -1.0)]
            ent += [(R[s, w], -1.0) for w in cons[v] if (s, w) in R]
            row(ent, -np.inf, 0.0)
        if s + 1 < b:
            for v in comp[: s + 1] + free_in:
                if (s + 1, v) not in S:
                    continue
                ent = [(S[s + 1, v], 1.0), (S[s + 2, v], -1.0)]
                ent += [(R[s + 1, w], -1.0) for w in cons[v] if (s + 1, w) in R]
                row(ent, -np.inf, 0.0)
        # memory recurrence through the stage
        live_vars = [v for v in comp[:s] if (s, v) in S] + free_in
        u_prev = new(-np.inf, np.inf, 0.0, False)
        row([(u_prev, 1.0)] + [(S[s, v], -size[v]) for v in live_vars], pinned_mem, pinned_mem)
        for j, k in enumerate(cand):
            during = size[k] + nodes[k].workspace / unit
            ent = [(u_prev, 1.0), (R[s, k], during)]
            if peak_col is not None:
                ent.append((peak_col, -1.0))
                row(ent, -np.inf, 0.0)
            else:
                row(ent, -np.inf, cap)
            if j == len(cand) - 1:
                break  # memory after the stage is S[s+1]-accounted
            # frees after k: v in inputs(k) (not pinned) or v = k
            frees: list[tuple[int, int]] = []
            for v in list(nodes[k].inputs) + [k]:
                if v in const_live or (s + 1, v) not in S:
                    continue  # pinned, or outside the window's nodes (then k cannot run here)
                f = new(0.0, 1.0, 0.0, False)
                frees.append((v, f))
                row([(f, 1.0), (R[s, k], -1.0)], -np.inf, 0.0)
                row([(f, 1.0), (S[s + 1, v], 1.0)], -np.inf, 1.0)
                for w in cons[v]:
                    if w > k and (s, w) in R:
                        row([(f, 1.0), (R[s, w], 1.0)], -np.inf, 1.0)
            u_next = new(-np.inf, np.inf, 0.0, False)
            ent = [(u_next, 1.0), (u_prev, -1.0), (R[s, k], -size[k])]
            ent += [(f, size[v]) for v, f in frees]
            row(ent, 0.0, 0.0)
            u_prev = u_next

    n = len(col_lb)
    if peak_col is None:  # objective in units of the mean positive cost (HiGHS dislikes 1e-6)
        pos_costs = [c_ for c_ in col_c if c_ > 0]
        scale = (sum(pos_costs) / len(pos_costs)) if pos_costs else 1.0
        col_c = [c_ / scale for c_ in col_c]
    else:
        scale = 1.0
    from scipy.sparse import coo_matrix  # imported on use: SciPy's import is slow, and many steps never solve a MILP

    A = coo_matrix((vals, (rows, cols)), shape=(len(r_lb), n))
    return _Model(
        np.array(col_c), np.array(col_int), np.array(col_lb), np.array(col_ub), A,
        np.array(r_lb), np.array(r_ub), R, T, comp, peak_col, unit, n, len(r_lb), scale,
    )


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library of this process (for ``fflush``), loaded once."""
    return ctypes.CDLL(None)


@contextlib.contextmanager
def _native_stdout_silenced() -> Iterator[None]:
    """File descriptor 1 points at the null device meanwhile: the HiGHS built into SciPy prints
    debugging lines (``HighsMipSolverData::transformNewIntegerFeasibleSolution ...``) with C's
    ``printf``, whatever ``disp`` says, into a user's output. C's buffer is flushed before fd 1 is
    given back, so nothing it printed meanwhile surfaces later; Python's ``sys.stdout`` is flushed
    first, so nothing of the program's own is lost."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        null = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no fd 1 (an embedding host): nothing to silence
        yield
        return
    try:
        os.dup2(null, 1)
        yield
    finally:
        _libc().fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _solve(model: _Model, time_limit: float, mip_rel_gap: float, node_limit: int | None = None,
           highs: dict | None = None):  # -> OptimizeResult
    """HiGHS on ``model``. ``node_limit``: branch-and-bound nodes, a deterministic bound on the work
    (HiGHS runs single-threaded, so the same model gives the same answer under any machine load);
    ``time_limit`` (seconds) then only guards against a runaway solve (:func:`_timed_out`).
    ``highs``: further HiGHS options by their HiGHS names (e.g. :data:`WINDOW_HIGHS_OPTIONS`), which
    SciPy passes on verbatim. A node-limited solve's answer is read from, and kept in, the on-disk
    :mod:`.solve_cache` (the same answer HiGHS would give; one the guard stopped is never kept)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    from . import solve_cache

    options = {"time_limit": max(0.05, time_limit), "mip_rel_gap": mip_rel_gap, "disp": False}
    if node_limit is not None:
        options["node_limit"] = int(node_limit)
    options.update(highs or {})
    A = model.A.tocsr()
    key = None
    if node_limit is not None and solve_cache.enabled():
        key = solve_cache.key(model.c, A, model.row_lb, model.row_ub, model.lb, model.ub, model.integrality, options)
        kept = solve_cache.load(key)
        if kept is not None:
            why = _not_a_solution(model, A, kept)
            if why is None:
                return kept
            solve_cache.reject(key, why)  # another writer's, or a bug's: warned of, solved again
    t0 = time.perf_counter()
    with _native_stdout_silenced(), warnings.catch_warnings():
        # SciPy warns that it passes options it does not know to HiGHS verbatim, which is the intent.
        warnings.filterwarnings("ignore", message="Unrecognized options detected", category=RuntimeWarning)
        res = milp(
            model.c,
            constraints=LinearConstraint(A, model.row_lb, model.row_ub),
            integrality=model.integrality,
            bounds=Bounds(model.lb, model.ub),
            options=options,
        )
    if key is not None and not _timed_out(res) and time.perf_counter() - t0 >= solve_cache.MIN_SECONDS:
        solve_cache.store(key, res)
    return res


def _not_a_solution(model, A, res) -> str | None:
    """Why a kept result is not a solution of ``model`` (None: it is, or it kept no solution): its
    values must be one per variable, within their bounds, integral where asked, and meet every row."""
    x = res.get("x")
    if x is None:
        return None
    if x.shape != model.c.shape:
        return f"{x.size} values for {model.c.size} variables"
    tol = 1e-6
    if np.any(x < model.lb - tol * (1 + np.abs(model.lb))) or np.any(x > model.ub + tol * (1 + np.abs(model.ub))):
        return "values outside their bounds"
    ints = np.asarray(model.integrality).astype(bool)
    if np.any(np.abs(x[ints] - np.round(x[ints])) > tol):
        return "fractional values of integer variables"
    ax = A @ x
    if np.any(ax < model.row_lb - tol * (1 + np.abs(model.row_lb))) \
            or np.any(ax > model.row_ub + tol * (1 + np.abs(model.row_ub))):
        return "values that break its constraints"
    return None


def _timed_out(res) -> bool:
    """Whether HiGHS stopped at its time limit: what it found then depends on the machine's load."""
    return res.status == 1 and "time limit" in str(res.message).lower()


def _extract(model: _Model, x: np.ndarray) -> list[int]:
    """The compute sequence: per stage, the nodes with R = 1, in index order."""
    seq: list[int] = []
    for s in range(model.T):
        for v in model.comp[: s + 1]:
            col = model.R.get((s, v))
            if col is not None and x[col] > 0.5:
                seq.append(v)
    return seq


@dataclass
class MinPeak:
    """Result of :func:`milp_min_peak`.  ``minimum``: the minimum peak (bytes) over
    schedules in the Checkmate space of the given order when ``exact``; otherwise a
    valid lower bound on it.  ``plan``: the best schedule found (its peak may be
    above ``minimum`` when not exact), or None."""

    minimum: int
    exact: bool
    plan: Solution | None
    seconds: float


def milp_min_peak(
    graph: Graph, *, time_limit: float = 10.0, order: Sequence[int] | None = None,
    node_limit: int | None = None,
) -> MinPeak:
    """Minimise the peak memory (ignoring cost) with the same MILP.

    The minimum is over schedules whose first computations follow ``order``
    (default: index order), like :func:`solve_milp`. ``node_limit``: branch-and-bound nodes
    (deterministic work); with it, a solve the time limit stops gives no plan (``plan`` None, the
    bound from :func:`.graph.min_memory_lower_bound`), so the answer never depends on the machine.
    """
    t0 = time.perf_counter()
    g, back = _maybe_permute(graph, order)
    lb = min_memory_lower_bound(g)
    if not g.compute_nodes:
        return MinPeak(lb, True, None, 0.0)
    unit = max(lb, 1) / 1000.0
    model = _build(g, None, unit, peak_lb=lb / unit)
    res = _solve(model, time_limit - (time.perf_counter() - t0), 0.0, node_limit=node_limit)
    if node_limit is not None and _timed_out(res):
        return MinPeak(lb, False, None, time.perf_counter() - t0)
    plan = None
    if res.x is not None:
        seq = [back[v] for v in _extract(model, res.x)]
        plan = make_plan(
            graph, seq, solver="milp", status="optimal" if res.status == 0 else "time_limit_feasible",
            seconds=time.perf_counter() - t0, notes=["MILP minimising the peak"],
        )
    if res.status == 0 and plan is not None:
        # the model value is conservative; the simulated peak is exact
        return MinPeak(plan.peak, True, plan, time.perf_counter() - t0)
    bound = getattr(res, "mip_dual_bound", None)
    minimum = lb
    if bound is not None and np.isfinite(bound):
        # floor: the model counts memory conservatively only above the optimum;
        # allow for solver tolerances (1e-6 relative)
        minimum = max(lb, int(np.floor(bound * unit * (1 - 1e-6))))
    return MinPeak(minimum, False, plan, time.perf_counter() - t0)


def _maybe_permute(graph: Graph, order: Sequence[int] | None) -> tuple[Graph, list[int]]:
    if order is None:
        return graph, list(range(len(graph)))
    check_order(graph, order)
    return graph.permuted(order)


def solve_milp(
    graph: Graph,
    budget: int,
    *,
    time_limit: float = 30.0,
    order: Sequence[int] | None = None,
    mip_rel_gap: float = 1e-4,
    min_peak_time_limit: float | None = None,
    node_limit: int | None = None,
    highs: dict | None = None,
) -> Solution:
    """Minimum-recomputation schedule with peak <= ``budget`` bytes (Checkmate MILP).

    ``order``: topological order of first computations (default: index order; pass
    :func:`.scheduling.memory_aware_order` for a lower-memory one).  ``time_limit``
    (seconds) bounds model building + HiGHS.  Status in the plan: ``optimal`` (to
    ``mip_rel_gap``) or ``time_limit_feasible`` (best incumbent when time ran out).

    Raises :class:`BudgetTooSmall` when the budget is infeasible: if it is below
    :func:`.graph.min_memory_lower_bound`, ``minimum`` is that bound; if HiGHS
    proves infeasibility, ``minimum`` comes from :func:`milp_min_peak` (the exact
    minimum in this schedule space when solved within ``min_peak_time_limit``,
    default ``time_limit``, else a valid lower bound).  Raises
    :class:`NoSolutionFound` when no feasible schedule was found in time.

    ``highs``: further HiGHS options (see :func:`_solve`).
    ``node_limit``: branch-and-bound nodes HiGHS may explore (deterministic work); with it, the
    answer is a function of the inputs: a solve the time limit stops is discarded
    (:class:`NoSolutionFound`) rather than returning a load-dependent incumbent (status ``node_limit``
    when the node limit stopped it with a plan).
    """
    t0 = time.perf_counter()
    budget = int(budget)
    g, back = _maybe_permute(graph, order)
    lb = min_memory_lower_bound(g)
    if budget < lb:
        raise BudgetTooSmall(
            budget, lb,
            detail=f"memory budget {budget} B is below the lower bound {lb} B "
            "(inputs at the start / outputs at the end / some node's inputs+output+workspace)",
        )
    base_order = g.compute_nodes
    base_peak = evaluate(g, eager_frees(g, base_order))[1]
    if budget >= base_peak:
        # every node must be computed once, so no-remat is optimal
        return make_plan(
            graph, [back[v] for v in base_order], solver="milp", status="optimal",
            seconds=time.perf_counter() - t0, budget=budget,
            notes=[f"budget >= no-remat peak {base_peak} B: no recomputation needed (MILP skipped)"],
        )
    notes: list[str] = []
    cap = budget
    for attempt in range(3):
        model = _build(g, cap, max(cap, 1) / 1000.0)
        t_build = time.perf_counter() - t0
        left = time_limit - t_build
        res = _solve(model, left, mip_rel_gap, node_limit=node_limit, highs=highs)
        elapsed = time.perf_counter() - t0
        if node_limit is not None and _timed_out(res):
            raise NoSolutionFound(budget, time_limit, elapsed, "stopped by the time limit before its node limit "
                                  "(its incumbent would depend on the machine's load)")
        if res.status == 2:
            mp = milp_min_peak(
                graph, order=order,
                time_limit=min_peak_time_limit if min_peak_time_limit is not None else time_limit,
                node_limit=node_limit,
            )
            if mp.plan is not None and mp.plan.peak <= budget:
                # only reachable through solver tolerances: the peak-optimal plan fits
                mp.plan.budget = budget
                mp.plan.notes = notes + ["budget MILP reported infeasible but the peak-minimising plan fits"]
                return mp.plan
            what = "exact minimum" if mp.exact else "lower bound on the minimum"
            raise BudgetTooSmall(
                budget, mp.minimum,
                detail=f"memory budget {budget} B is infeasible (proven by the MILP); "
                f"{what} peak for schedules in this order: {mp.minimum} B",
            )
        if res.x is None:
            raise NoSolutionFound(budget, time_limit, elapsed, str(res.message))
        seq = [back[v] for v in _extract(model, res.x)]
        status = "optimal" if res.status == 0 else "node_limit_feasible" if node_limit is not None else "time_limit_feasible"
        plan = make_plan(graph, seq, solver="milp", status=status, seconds=elapsed, budget=budget)
        plan.objective = float(res.fun) * model.cost_scale
        gap = getattr(res, "mip_gap", None)
        notes.append(
            f"Checkmate MILP ({model.n_vars} vars, {model.n_rows} rows, T={model.T} stages): "
            f"build {t_build:.2f}s, HiGHS {elapsed - t_build:.2f}s, status {status}"
            + (f", gap {gap:.2e}" if gap is not None and np.isfinite(gap) else "")
            + f", model objective {res.fun * model.cost_scale:.6g}s"
        )
        if plan.peak <= budget:
            plan.notes = notes
            return plan
        # solver tolerance let the model exceed the budget by a few bytes: tighten
        notes.append(f"simulated peak {plan.peak} B > budget; re-solving with a tighter cap")
        cap -= plan.peak - budget
        if time.perf_counter() - t0 > time_limit:
            break
    raise NoSolutionFound(budget, time_limit, time.perf_counter() - t0, "tolerance retries exhausted")


def solve_with_fallback(
    graph: Graph,
    budget: int,
    *,
    time_limit: float = 30.0,
    milp_max_nodes: int = MILP_MAX_NODES,
    order: Sequence[int] | None = None,
    node_limit: int | None = None,
    max_vars: int | None = MILP_MAX_VARS,
) -> Solution:
    """The recommended entry point.  Runs the RAF-style greedy (fast) and, when the
    graph has at most ``milp_max_nodes`` compute nodes and its MILP at most ``max_vars``
    variables (None: any number), the MILP under ``time_limit``; returns the cheaper valid
    plan.  Falls back to the greedy when the MILP is too large or finds nothing in time.
    The plan's notes say which solver ran and why.  Raises :class:`BudgetTooSmall` when
    neither meets the budget (``minimum``: the smaller of the two solvers' minimums)."""
    from .greedy import solve_greedy
    from .scheduling import memory_aware_order

    T = len(graph.compute_nodes)
    if order is None:
        order = memory_aware_order(graph)
    greedy_plan: Solution | None = None
    errors: list[BudgetTooSmall] = []
    try:
        greedy_plan = solve_greedy(graph, budget, order=order)
    except BudgetTooSmall as e:
        errors.append(e)
    too_large = f"{T} compute nodes > milp_max_nodes={milp_max_nodes}" if T > milp_max_nodes else None
    if too_large is None and max_vars is not None:
        g, _ = _maybe_permute(graph, order)
        if _build(g, int(budget), max(int(budget), 1) / 1000.0, max_vars=max_vars) is None:
            too_large = f"its model has more than max_vars={max_vars} variables"
    if too_large is not None:
        if greedy_plan is None:
            raise errors[0]
        greedy_plan.notes.insert(0, f"greedy chosen: {too_large} (MILP too large)")
        return greedy_plan
    try:
        plan = solve_milp(graph, budget, time_limit=time_limit, order=order, node_limit=node_limit)
    except NoSolutionFound as e:
        if greedy_plan is None:
            raise errors[0] from e
        greedy_plan.notes.insert(0, f"fell back to greedy: {e}")
        return greedy_plan
    except BudgetTooSmall as e:
        if greedy_plan is not None:  # cannot happen for an exact MILP answer; be safe
            greedy_plan.notes.insert(0, f"MILP reported the budget infeasible ({e}); greedy plan fits")
            return greedy_plan
        raise BudgetTooSmall(budget, min(e.minimum, errors[0].minimum) if errors else e.minimum, detail=e.detail) from e
    if greedy_plan is not None and greedy_plan.cost < plan.cost - 1e-12:
        greedy_plan.notes.insert(
            0, f"greedy chosen: cheaper ({greedy_plan.cost:.6g}s) than the MILP's "
            f"{plan.status} solution ({plan.cost:.6g}s)"
        )
        return greedy_plan
    plan.notes.insert(0, f"MILP chosen: {T} compute nodes <= milp_max_nodes={milp_max_nodes}"
                      + (f"; greedy cost {greedy_plan.cost:.6g}s" if greedy_plan else "; greedy failed"))
    return plan


# ---------------------------------------------------------------- neighbourhood search
WINDOW_STAGES = 4
"""Stages a small neighbourhood MILP frees at once (the rest of the schedule stays fixed)."""

MAX_WINDOWS = 8
"""Windows one pass of :func:`improve_in_windows` solves at most (costliest recomputation first)."""


@dataclass(frozen=True)
class WindowPass:
    """One pass of :func:`improve_in_windows`: at most ``windows`` windows of at most ``stages``
    consecutive stages each, halved until a window's MILP has at most ``max_vars`` variables."""

    stages: int
    max_vars: int
    windows: int = MAX_WINDOWS


WINDOW_PASSES: tuple[WindowPass, ...] = (WindowPass(WINDOW_STAGES, 300), WindowPass(WINDOW_STAGES, 800))
"""The passes of :func:`improve_in_windows` by default: first small windows (solved to optimality in
milliseconds), then the same with larger models allowed (where live sets are large)."""

WIDE_WINDOW_PASS = WindowPass(16, 2000, windows=2)
"""A last pass of wide windows, for graphs small enough for the whole-graph MILP
(:data:`MILP_MAX_NODES`, ``registry.neighbourhood_passes``): it reaches plans that keep a value across
many stages to recompute something else (synthetic U-Net of 22 nodes at 65% of its peak: keeping the
first encoder's output over 16 stages, +23.3% for the greedy's +30.6%, the proven optimum; residual
chain of 32 nodes at 80%: +1.7% for +7.9%, where the 4-stage windows improve neither). A window of
~1,800 variables may take HiGHS 5-12 s to its node limit, so larger graphs, whose windows are
wider in variables, do without it (zoo ResNet tiny near its floor: 2.5 s of planning became 14 s),
and it solves at most two windows: on a synthetic chain of 37 nodes near its floor each takes HiGHS
3-8 s, most of it at the root node, for +51.8% instead of +52.3%."""

WINDOW_NODE_LIMIT = 30
"""Branch-and-bound nodes one window's HiGHS may explore: the search's work limit. A node count,
not seconds, so the search, and the plan, are the same on any machine under any load."""

WINDOW_HIGHS_OPTIONS = {"mip_pscost_minreliable": 0}
"""HiGHS options of a window's solve: branching on pseudo-costs from the first node, without the
strong branching HiGHS does until a variable's pseudo-cost is reliable (8 branchings by default).
Within a window's node limit strong branching is most of the work and rarely pays: a 1,153-variable
window of a four-layer MLP's step with AdamW at its floor spent 84,000 of its 98,000 simplex
iterations on it, 17 s where pseudo-costs alone take 3.8 s and reach the same objective. Still a
deterministic search (HiGHS single-threaded, node-limited). The block MILP's whole-block solves
(``inner.milp_recipes``, node-limited too) use them as well: ``tests/plan/test_block_milp.py``'s
solves 59 -> 46 s."""

WINDOW_SAFETY_SECONDS = 60.0
"""Wall seconds after which :func:`improve_in_windows` stops as a guard against a runaway solve (a
window stopped by it is discarded). With the node limit it is not reached on this project's models;
were it reached, the plan would depend on the machine, and the notes say so."""


@dataclass
class WindowSearch:
    """What :func:`improve_in_windows` did. ``plan``: the improved plan, None when no window
    lowered the cost. ``statuses``: per window solved, ``optimal`` / ``node_limit`` (HiGHS stopped
    at its node limit with a solution, used) / ``no_solution`` (none found within the node limit) /
    ``infeasible`` (the window's model has no schedule, e.g. the fixed schedule's order inside a
    stage differs) / ``time_limit`` (the wall-clock guard stopped it: discarded, the search ends)."""

    plan: Solution | None
    statuses: list[str]
    improved: int
    seconds: float

    @property
    def status(self) -> str:
        """One word for the whole search: ``optimal`` when every window was, else the worst seen
        (``time_limit``: the wall-clock guard stopped a window, whose answer was discarded;
        ``node_limit``: a window's HiGHS stopped at its node limit, deterministically)."""
        for s in ("time_limit", "no_solution", "node_limit", "infeasible"):
            if s in self.statuses:
                return "node_limit" if s == "no_solution" else s
        return "optimal" if self.statuses else "not_run"


def _stage_ends(g: Graph, seq: Sequence[int]) -> list[int] | None:
    """Position in ``seq`` of each compute node's first computation (stage ``s`` ends at the first
    computation of ``comp[s]``); None unless first computations follow index order."""
    first: dict[int, int] = {}
    for p, v in enumerate(seq):
        first.setdefault(v, p)
    comp = g.compute_nodes
    if any(c not in first for c in comp):
        return None
    ends = [first[c] for c in comp]
    return ends if all(x < y for x, y in zip(ends, ends[1:])) else None


def _live_at_stages(g: Graph, seq: Sequence[int], ends: Sequence[int]) -> list[frozenset[int]]:
    """``live[s]``: the values live (eager frees) at the start of stage ``s``, ``s = 0 .. T``."""
    boundary = {e: s + 1 for s, e in enumerate(ends)}
    live: set[int] = {i for i, nd in enumerate(g.nodes) if nd.is_input}
    out: list[frozenset[int]] = [frozenset()] * (len(ends) + 1)
    p = -1
    started = False
    for kind, i in eager_frees(g, seq):
        if kind == COMPUTE:
            if not started:
                out[0], started = frozenset(live), True
            elif p in boundary:
                out[boundary[p]] = frozenset(live)
            p += 1
            live.add(i)
        else:
            live.discard(i)
    if p in boundary:
        out[boundary[p]] = frozenset(live)
    return out


def improve_in_windows(graph: Graph, plan: Solution, cap: int, *, time_limit: float = WINDOW_SAFETY_SECONDS,
                       passes: Sequence[WindowPass] = WINDOW_PASSES,
                       node_limit: int | None = WINDOW_NODE_LIMIT) -> WindowSearch:
    """The MILP on the neighbourhood of ``plan`` (a large-neighbourhood search): a window of at
    most ``stages`` consecutive stages of its schedule (per :class:`WindowPass`) is re-solved by
    HiGHS with everything before and after it fixed, peak <= ``cap`` bytes, the window of the costliest
    recomputation first, each improvement kept. Stages follow the order of ``plan``'s first
    computations. One pass per entry of ``passes``, each of at most its ``windows`` windows:
    a window's stages are halved until its model has at most the pass's ``max_vars`` variables
    (small models are solved to optimality in milliseconds; the later, larger ones may stop at the node limit).
    The work is bounded by counts (windows, variables, ``node_limit`` branch-and-bound nodes per
    window), so the result is a function of the inputs alone; ``time_limit`` (seconds) is only a
    guard against a runaway solve: a window it stops is discarded and the search ends there."""
    t0 = time.perf_counter()
    computes = schedule_computes(plan.schedule)
    g, back = graph.permuted(list(dict.fromkeys(v for v in computes if not graph[v].is_input)))
    new_of_old = {o: k for k, o in enumerate(back)}
    seq = [new_of_old[v] for v in computes]
    cost = evaluate(g, eager_frees(g, seq))[0]
    T = len(g.compute_nodes)
    nodes = g.nodes
    statuses: list[str] = []
    improved = 0
    solved: set[tuple[int, int, int]] = set()  # windows (a, b) solved, with the count of improvements before
    for step in passes:
        visited: set[int] = set()
        for _ in range(step.windows):
            if "time_limit" in statuses:
                break
            ends = _stage_ends(g, seq)
            if ends is None:
                break
            live = _live_at_stages(g, seq, ends)
            starts = [0] + [e + 1 for e in ends[:-1]]
            recompute = [sum(nodes[v].cost for v in seq[starts[s]:ends[s]]) for s in range(T)]
            todo = [s for s in range(T) if s not in visited and recompute[s] > 0]
            if not todo:
                break
            s_hot = max(todo, key=lambda s: (recompute[s], -s))
            width = step.stages
            while True:  # the widest window up to ``step.stages`` whose model stays small
                a = max(0, min(s_hot - width // 2, T - width))
                b = min(T, a + width)
                inside = seq[starts[a]:ends[b - 1] + 1]
                # recomputed: what the plan computes here, and one step further back
                again = set(inside) | {u for v in inside for u in nodes[v].inputs if not nodes[u].is_input}
                win = _Window(a, b, frozenset(set(live[a]) | again), live[a], live[b], frozenset(again))
                model = _build(g, cap, max(cap, 1) / 1000.0, window=win, max_vars=None if width == 1 else step.max_vars)
                if model is not None:
                    break
                width //= 2
            visited.update(range(a, b))
            if (a, b, improved) in solved:
                continue  # an earlier pass solved this very model (the same schedule): the same answer
            solved.add((a, b, improved))
            res = _solve(model, time_limit - (time.perf_counter() - t0), 1e-4, node_limit=node_limit,
                         highs=WINDOW_HIGHS_OPTIONS)
            if _timed_out(res):
                statuses.append("time_limit")  # load-dependent: discarded
                break
            if res.status == 2:
                statuses.append("infeasible")
                continue
            if res.x is None:
                statuses.append("no_solution")
                continue
            statuses.append("optimal" if res.status == 0 else "node_limit")
            cand_seq = seq[:starts[a]] + _extract(model, res.x) + seq[ends[b - 1] + 1:]
            cand_cost, cand_peak = evaluate(g, eager_frees(g, cand_seq))
            if cand_peak <= cap and cand_cost < cost * (1 - 1e-9):
                seq, cost, improved = cand_seq, cand_cost, improved + 1
    seconds = time.perf_counter() - t0
    search = WindowSearch(None, statuses, improved, seconds)
    if not improved:
        return search
    out = make_plan(graph, [back[v] for v in seq], solver="milp window", status=search.status,
                    seconds=seconds, budget=cap)
    out.notes = [f"MILP on the neighbourhood of the {plan.solver} plan: {len(statuses)} windows of at most "
                 f"{max(q.stages for q in passes)} stages (of {T}), {improved} improved it, HiGHS statuses: "
                 + ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses)) + f"; {seconds:.2f} s"]
    search.plan = out if out.peak <= cap else None  # pruning never raises the peak: a guard on the model
    return search
