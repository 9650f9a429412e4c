"""The solver registry: every planner by name, with what it plans and on what size.

``remat.compile(..., solver=)`` names a graph solver here (or ``"auto"``); the portfolio asks the
registry which solver runs at a budget probe instead of spelling the policy out in branches.
A new solver is one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal, Sequence

from .graph import Graph
from .record import Solution
from .milp import MILP_MAX_NODES, MILP_NODE_LIMIT, WIDE_WINDOW_PASS, WINDOW_PASSES, WindowPass

if TYPE_CHECKING:
    from .chain.costs import ChainCosts


@dataclass(frozen=True)
class Solver:
    """A planner. ``plans``: ``"chain"`` (a chain of blocks, by its :class:`ChainCosts`) or ``"graph"``
    (the instruction graph). ``max_nodes``: under ``"auto"`` it runs only on graphs of at most this
    many compute nodes (None: any size). ``main_probe_only``: costly solvers run once, at the main
    budget probe; the others run at every probe. Graph solvers: ``solve(graph, budget, order,
    time_limit)`` solves as when named (returning the plan, or None / ``BudgetTooSmall`` when it
    finds none at the budget), ``solve_auto`` as under ``"auto"`` (None: the same). Chain
    solvers: ``method``, the chain DP's cost model (``remat.plan.chain.solvers.solve``).
    ``minimum``: the least budget (bytes) at which the solver finds a plan in its own model, the one
    way to ask any solver for it: ``minimum(graph, order, time_limit)`` for a graph solver (the MILP,
    when its time limit leaves the optimum unproven: a lower bound), ``minimum(costs, bucket)`` for
    the chain DP (the exact minimum under that bucketing)."""

    name: str
    plans: Literal["chain", "graph"]
    what: str
    max_nodes: int | None = None
    main_probe_only: bool = False
    solve: Callable[[Graph, int, Sequence[int], float], Solution | None] | None = None
    solve_auto: Callable[[Graph, int, Sequence[int], float], Solution | None] | None = None
    method: str | None = None
    minimum: Callable[..., int] | None = None

    def admits(self, option: str, n_nodes: int) -> bool:
        """Whether this solver runs for ``solver=option`` on a graph of ``n_nodes`` compute nodes."""
        if option == self.name:
            return True
        return option == "auto" and (self.max_nodes is None or n_nodes <= self.max_nodes)


def _milp(graph: Graph, budget: int, order: Sequence[int], time_limit: float) -> Solution:
    from .milp import solve_milp

    return solve_milp(graph, budget, time_limit=time_limit, order=order)


def _milp_or_greedy(graph: Graph, budget: int, order: Sequence[int], time_limit: float) -> Solution:
    from . import milp

    return milp.solve_with_fallback(graph, budget, time_limit=time_limit, order=order, milp_max_nodes=MILP_MAX_NODES,
                                    node_limit=MILP_NODE_LIMIT, max_vars=milp.MILP_MAX_VARS)


def _greedy(graph: Graph, budget: int, order: Sequence[int], time_limit: float) -> Solution | None:
    from .greedy import try_greedy_best

    return try_greedy_best(graph, budget, order)  # bounded passes: a failed probe stays cheap


def _chain_minimum(costs: ChainCosts, bucket: int | str = 1) -> int:
    from .chain.solvers import minimum_budget

    return minimum_budget(costs, bucket=bucket, method="extended")


def _milp_minimum(graph: Graph, order: Sequence[int], time_limit: float) -> int:
    from .milp import milp_min_peak

    return milp_min_peak(graph, time_limit=time_limit, order=order).minimum


def _greedy_minimum(graph: Graph, order: Sequence[int], time_limit: float) -> int:
    from .greedy import greedy_min_budget

    # to 2%, each pass bounded (a pass that recomputes without end counts as failing): the budget
    # probes' precision, a few dozen greedy passes on a large graph
    return greedy_min_budget(graph, order, rel_tol=0.02, max_steps=20 * len(graph) + 1000)


SOLVERS: dict[str, Solver] = {s.name: s for s in (
    Solver("chain", "chain", "the thesis DP over blocks cut at separators (extended model: per block, keep "
           "output or whole tape)", method="extended", minimum=_chain_minimum),
    # Graph solvers, tried in this order: the first one admitted at a probe runs.
    Solver("milp", "graph", "Checkmate MILP (HiGHS), optimal under a time limit when named; under 'auto' "
           "bounded by a node limit instead (deterministic) and by its size (MILP_MAX_VARS), with the greedy as "
           "fallback", max_nodes=MILP_MAX_NODES, main_probe_only=True, solve=_milp, solve_auto=_milp_or_greedy,
           minimum=_milp_minimum),
    Solver("greedy", "graph", "RAF greedy: recompute latency x remaining uses / size", solve=_greedy,
           minimum=_greedy_minimum),
)}

GRAPH_SOLVERS: tuple[Solver, ...] = tuple(s for s in SOLVERS.values() if s.plans == "graph")

SOLVER_OPTIONS: tuple[str, ...] = ("auto", *sorted(s.name for s in GRAPH_SOLVERS))
"""Values of ``remat.compile(..., solver=)``: which instruction-level solver may run."""


NEIGHBOURHOOD_OPTIONS: tuple[str, ...] = ("auto", "milp")
"""Options under which a costly greedy plan is improved by the MILP on its neighbourhood
(:func:`.milp.improve_in_windows`, its work bounded by node counts, so deterministic); ``"greedy"``
skips it (golden plans use it)."""

NEAR_FLOOR_OVERHEAD = 0.15
"""The greedy's predicted overhead above which the neighbourhood MILP runs on a graph too large for
the whole-graph MILP (:func:`improves_neighbourhood`): high recomputation happens near the minimum
budget, where the greedy pays most; below it setup time does not grow."""

NEIGHBOURHOOD_TIME_LIMIT = 30.0
"""Wall seconds after which the neighbourhood MILP stops, as a guard only: its work is bounded by
node counts (:data:`.milp.WINDOW_NODE_LIMIT`), and a window the guard stops is discarded."""


def improves_neighbourhood(option: str, greedy_overhead: float, n_nodes: int) -> bool:
    """Whether the MILP searches the neighbourhood of a greedy plan with this predicted overhead on
    a graph of ``n_nodes`` compute nodes: near the floor, or on any graph small enough for the
    whole-graph MILP. That one may prove nothing (synthetic graphs of 22-32 nodes: HiGHS reaches
    its 10 s guard before its 2,000 nodes on a loaded machine, and its plan is discarded), and the
    windows, their work bounded by node counts, then find the same optimum deterministically."""
    return option in NEIGHBOURHOOD_OPTIONS and (greedy_overhead > NEAR_FLOOR_OVERHEAD or small_for_exact(n_nodes))


def neighbourhood_passes(n_nodes: int) -> tuple[WindowPass, ...]:
    """The window passes of the neighbourhood MILP on a graph of ``n_nodes`` compute nodes: the
    default ones, and wide windows too on a graph small enough for the whole-graph MILP
    (:data:`.milp.WIDE_WINDOW_PASS`)."""
    return WINDOW_PASSES + ((WIDE_WINDOW_PASS,) if small_for_exact(n_nodes) else ())


def check_option(option: str) -> None:
    """A ValueError naming the valid options when ``option`` is not one."""
    if option not in SOLVER_OPTIONS:
        raise ValueError(f"unknown solver {option!r}; valid: {', '.join(SOLVER_OPTIONS)}")


def graph_solver(option: str, n_nodes: int, main: bool) -> Callable[[Graph, int, Sequence[int], float], Solution | None]:
    """The solve function that runs at one budget probe (``main``: the probe at the budget itself)."""
    for s in GRAPH_SOLVERS:
        if s.admits(option, n_nodes) and (main or not s.main_probe_only):
            return s.solve_auto if option == "auto" and s.solve_auto is not None else s.solve
    return SOLVERS["greedy"].solve  # a named costly solver off its probe: the heuristic covers the others


def small_for_exact(n_nodes: int) -> bool:
    """Whether a graph is small enough for some size-limited (exact) graph solver under ``"auto"``."""
    return any(s.max_nodes is not None and n_nodes <= s.max_nodes for s in GRAPH_SOLVERS)


__all__ = ["GRAPH_SOLVERS", "NEAR_FLOOR_OVERHEAD", "NEIGHBOURHOOD_OPTIONS", "NEIGHBOURHOOD_TIME_LIMIT", "SOLVERS",
           "SOLVER_OPTIONS", "Solver", "check_option", "graph_solver", "improves_neighbourhood", "neighbourhood_passes",
           "small_for_exact"]
