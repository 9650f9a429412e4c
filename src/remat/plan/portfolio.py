"""Planning a training step under a byte budget: the planner portfolio behind ``remat.compile``.

Input is IR alone (a :class:`StepProblem`: the forward, the training joint, the unconstrained step
program, the budget, per-instruction costs), so the policy is testable without torch. Every
planner yields a :class:`~.record.Plan` (its program already lowered, so its exact peak is known);
the cheapest candidate whose program fits wins. Overhead means one thing everywhere:
recomputation cost as a fraction of the unconstrained compute cost (0.1 = +10%, 0 = none), scored
on one cost model for every planner (:mod:`.costmodel`).

The answer is a function of the step and the budget alone, whatever was planned before and however
loaded the machine: every planner is deterministic (the MILPs' work is bounded by node counts, not
seconds), and what is cached across budgets (:mod:`.frontier`) does not depend on the budget that
computed it. A larger budget should never get a costlier plan; heuristics are not monotone in the
budget, so the greedy also plans the points of a ladder of budgets fixed by the step
(:func:`ladder_points`) below the budget asked for, and its plans there compete. When the winner
recomputes much (near the floor), block-internal plans and the MILP on the greedy's neighbourhood
(:func:`.milp.improve_in_windows`; on a graph small enough for the whole-graph MILP, at any budget)
may improve it; the notes say which plan won.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import time
from collections import Counter, OrderedDict
from dataclasses import replace
from typing import Sequence

from .._gc import old_objects_frozen
from ..errors import BudgetTooSmall, format_bytes
from ..ir import Function, Module, verify
from .costmodel import CostModel, function_cost, program_overhead, static_costs
from .frontier import PlanCache, frontier_for
from .graph import Graph
from .milp import MILP_MAX_NODES, NoSolutionFound
from .problem import StepProblem, fit_peak
from .record import Plan, Solution
from .registry import (NEAR_FLOOR_OVERHEAD, NEIGHBOURHOOD_TIME_LIMIT, SOLVER_OPTIONS, SOLVERS, check_option, graph_solver,
                       improves_neighbourhood, neighbourhood_passes)


def uses_milp(solver: str, n_nodes: int) -> bool:
    """Whether the MILP runs (once, at the main budget probe): when asked for, or under "auto" on a
    graph of at most ``MILP_MAX_NODES`` compute nodes."""
    return SOLVERS["milp"].admits(solver, n_nodes)


LADDER_STEPS = 32
"""The ladder of a step: the budgets ``top * (1 - k / LADDER_STEPS)``, ``k = 1, 2, ...``, where ``top``
is the unconstrained step's peak (3.1% apart). They depend on the step alone, never on the budget
asked for, so every budget above a ladder point sees the plans made there."""


def ladder_points(top: int, budget: int) -> list[int]:
    """The ladder's budgets (bytes) below ``budget``, highest first (:data:`LADDER_STEPS`)."""
    pts = (top * (LADDER_STEPS - k) // LADDER_STEPS for k in range(1, LADDER_STEPS))
    return [g for g in pts if g < budget]


def plan_step(p: StepProblem) -> Plan:
    """:func:`_plan_step`, with the objects alive before it out of the collector's full collections
    (:func:`remat._gc.old_objects_frozen`): planning builds and drops many candidate programs."""
    with old_objects_frozen():
        return _plan_step(p)


MINIMUM_CHECKS = 8
"""How many budgets a refusal tries, upwards from the least minimum found, for one that plans
(:func:`_plannable_minimum`), before it reports the unconstrained peak."""


def _plannable_minimum(p: StepProblem, m: int) -> int:
    """The least of ``m`` and the budgets above it that plan, tried upwards. ``m`` is the peak of a
    candidate made while planning a lower budget, which need not plan when asked for: the planners
    run differently at another budget (the greedy is not monotone in it; Hugging Face GPT-2 tiny in
    bf16: a greedy plan peaking at 663,044 B made at 640,002 B, none at 663,044 B), so a refusal
    reporting it checks it by planning it (``BudgetTooSmall.minimum``: a budget that plans). A
    solver's own minimum (its bisection, the chain DP's) plans by construction. After
    :data:`MINIMUM_CHECKS` tries, the unconstrained step's peak, which always fits."""
    for _ in range(MINIMUM_CHECKS):
        try:
            _plan_step(replace(p, budget=m), check_minimum=False)
            return m
        except BudgetTooSmall as e:
            m = max(m + 1, int(e.minimum))
    return fit_peak(p, p.unconstrained)


def _plan_step(p: StepProblem, check_minimum: bool = True) -> Plan:
    """The cheapest plan of the training step whose exact program peak fits ``p.budget``.

    No budget, or one the unconstrained step fits, plans no recomputation. Otherwise the chain DP
    over blocks cut at separators and the instruction-level solvers run at the budget, and the
    greedy also at the points of the step's ladder below it (:func:`ladder_points`, while they give
    cheaper plans; the chain DP is monotone in its model already); every candidate is scored on one
    cost model and the cheapest that fits wins. Near the floor, block-internal plans
    and the MILP on the greedy's neighbourhood (deterministic: node limits; on a small graph at any
    budget) may improve it. The
    answer is a function of the step and the budget alone: plans cached from earlier budgets
    (:func:`~.frontier.frontier_for`) only save time, and a budget asked for before gets the answer
    it got then (:data:`MAX_ANSWERS`). Raises ``BudgetTooSmall`` with the smallest
    minimum found that plans (``check_minimum``; :func:`_plannable_minimum`)."""
    t0 = time.perf_counter()
    check_option(p.solver)
    peak = fit_peak(p, p.unconstrained)
    if p.budget is None or peak <= p.budget:
        why = ("no budget given" if p.budget is None else
               f"the unconstrained step ({format_bytes(peak)}) fits the budget")
        return Plan("none", [why + ": no recomputation"], p.unconstrained, 0.0, peak=peak, budget=p.budget)
    frontier = frontier_for(p)
    answers = frontier.cached("answers", OrderedDict)
    planned, refused = ("plan", p.budget), ("refusal", p.budget, check_minimum)
    for key in (planned, refused):
        if key in answers:
            answers.move_to_end(key)
            return _answer(answers[key])
    try:
        best = _plan_budget(p, check_minimum, frontier, peak, t0)
    except BudgetTooSmall as e:
        _remember(answers, refused, copy.copy(e))  # callers may add to theirs
        raise
    _remember(answers, planned, best)
    return _answer(best)


MAX_ANSWERS = 16
"""Plans and refusals :func:`_plan_step` keeps per step (least recently asked for dropped first):
the answer at a budget is a function of the step and the budget alone, so asking again (a retry at
the minimum a refusal checked by planning it, a test compiling a step twice) gets it at once."""


def _remember(answers: OrderedDict, key, answer) -> None:
    answers[key] = answer
    while len(answers) > MAX_ANSWERS:
        answers.popitem(last=False)


def _answer(answer: Plan | BudgetTooSmall) -> Plan:
    """A kept answer given out again: the plan with a program of its own, or the refusal raised."""
    if isinstance(answer, BudgetTooSmall):
        raise copy.copy(answer)
    return replace(answer, notes=list(answer.notes), program=answer.program.clone())


def _plan_budget(p: StepProblem, check_minimum: bool, frontier: PlanCache, peak: int, t0: float) -> Plan:
    """:func:`_plan_step` at a budget below the unconstrained step's ``peak``, not asked before."""
    from .rematerialize import to_graph
    from .scheduling import memory_aware_orders

    model = CostModel(p.costs, p.measured)
    base = model.program_cost(p.unconstrained)
    # The graph model, with the gradients the step consumes at once as transients (``p.consumed``),
    # and when there are such, also the greedy on it with every gradient held to the end: the same
    # nodes (a plan of either runs on both), neither model's heuristic plans always the leaner or the
    # cheaper (zoo U-Net tiny at 60%: only the second fits; GPT tiny between its minimum and its
    # unconstrained peak: the first's plan recomputes +7.6% instead of +16.4%).
    low = to_graph(p.joint, p.costs, workspaces=p.workspaces, consumed=p.consumed)
    lows = [(p, low)]
    if p.consumed and p.solver in ("auto", "greedy"):
        lows.append((replace(p, solver="greedy"), to_graph(p.joint, p.costs, workspaces=p.workspaces)))
    lows = [(q, g, memory_aware_orders(g.graph)) for q, g in lows]  # siblings together, then as scheduled
    lowered: list[Plan] = []
    programs: dict = {}  # step programs lowered from the graph models' schedules, shared by them (plan_graph)
    minimums: list[int] = []
    remarks: list[str] = []
    deferred: list = []  # the cuts' contexts, for block-internal plans when nothing cheap enough fits
    # Differentiated blocks and block recipes depend on the step alone, never on the budget: kept
    # with its other budget-independent results, so planning it again (a retry at the minimum a
    # refusal named, a sweep of budgets) differentiates and plans no block twice.
    chain = plan_blocks(p, lowered, deferred, frontier)
    if isinstance(chain, int):
        minimums.append(chain)
    for q, g, orders in lows:
        for k, order in enumerate(orders):
            # Under "auto" the whole-graph MILP (a small graph's) runs once, on the first order.
            qk = replace(q, solver="greedy") if k and q.solver == "auto" else q
            try:
                plan_graph(qk, g, order, need_minimum=k == 0 and not isinstance(chain, Plan), lowered=lowered,
                           programs=programs)
            except BudgetTooSmall as e:
                minimums.append(e.minimum)

    def score(cands: list[Plan], at: int) -> None:  # one cost model for every planner's program
        for c in cands:
            c.peak = fit_peak(p, c.program) if c.peak is None else c.peak
            c.overhead = program_overhead(model, c.program, base)
            c.notes = c.notes + [f"lowered while planning a budget of {format_bytes(at)} ({at:,} B)"]

    score(lowered, p.budget)
    best = _cheapest(lowered, p.budget)
    ladder = _plan_ladder(p, peak, lows, frontier, score, None if best is None else best.overhead, programs)
    lowered += ladder
    best = _cheapest(lowered, p.budget)
    if ladder:
        n = len({c.budget for c in ladder})
        remarks.append(f"ladder: {n} budget{'s' if n > 1 else ''} below this one planned by the greedy, "
                       f"{sum(1 for c in ladder if c.peak <= p.budget)} of their plans fit"
                       + (f"; one of them won" if best is not None and any(best is c for c in ladder) else ""))
    if deferred and (best is None or best.overhead > NEAR_FLOOR_OVERHEAD):
        # Block-internal plans (.inner) cost a few times the chain DP: tried only when no plan fits
        # or the best one recomputes much (a 64-layer GPT at 50%: the greedy's +9% wins, 19 s of
        # planning instead of 49 s).
        found = plan_inner(p, deferred, frontier)
        news = [r for r in found if isinstance(r, Plan)]
        minimums += [r for r in found if isinstance(r, int)]
        score(news, p.budget)
        lowered += news
        if news:
            chain = min(news + ([chain] if isinstance(chain, Plan) else []), key=lambda c: c.overhead)
        best = _cheapest(lowered, p.budget)
    better = _improve_near_floor(p, low, best, frontier, model, base, remarks, lowered)
    if better is not None:
        lowered.append(better)
        best = _cheapest(lowered, p.budget)
    if p.measured is not None:
        static = _static_plan(p)
        if static is not None:
            score([static], p.budget)
            lowered.append(static)
            best = _cheapest(lowered, p.budget)
    if best is None:
        least = min(minimums + [c.peak for c in lowered])
        if check_minimum and least < min(minimums, default=least + 1):
            least = _plannable_minimum(p, least)  # a candidate's peak, not a solver's minimum: it may not plan
        raise BudgetTooSmall(p.budget, least, "this training step")
    others = [c for c in lowered if c is not best and c.peak <= p.budget]
    fits = 1 + sum(1 for c in others if c.solution is not best.solution)
    remarks.append(f"won: {best.solver}, predicted overhead {best.overhead:+.1%} at a peak of {format_bytes(best.peak)}"
                   f" (the least predicted overhead of {fits} plan{'s' if fits > 1 else ''} that fit)")
    shown = [c for c in others if not any(c is x for x in ladder)]
    best = Plan(best.solver, best.notes + _also_tried(shown) + _why_not_chain(chain, p.budget, best) + remarks,
                best.program.clone(), best.overhead, best.solution, best.peak, p.budget, time.perf_counter() - t0)
    verify(Module([best.program]))
    return best


def _also_tried(plans: list[Plan]) -> list[str]:
    """One note per distinct losing plan that fits: its solver, predicted overhead and peak (plans a
    solver made from several schedules or budgets that came out alike are counted, not repeated)."""
    seen: dict[tuple, int] = {}
    for c in plans:
        key = (c.solver, f"{c.overhead:+.1%}", format_bytes(c.peak))
        seen[key] = seen.get(key, 0) + 1
    return [f"also tried {solver}{f' ({n} plans alike)' if n > 1 else ''}: predicted overhead {overhead} "
            f"at a peak of {peak}" for (solver, overhead, peak), n in seen.items()]


def _static_plan(p: StepProblem) -> Plan | None:
    """A profiled problem's plan as the static cost model makes it (None: none fits), to be priced
    on the measured seconds with the others: the heuristics take other paths on other costs (zoo
    U-Net small at 50%: the greedy recomputes 3.1 ms on measured costs, 2.3 ms on static ones), so a
    profiled compile, which scores every candidate on what it measured, plans no worse than a
    static one by its own prices."""
    try:
        alt = _plan_step(replace(p, costs=static_costs(p.joint), measured=None),
                         check_minimum=False)
    except BudgetTooSmall:
        return None
    return Plan(f"{alt.solver} on the static cost model", [f"planned on the static cost model: {alt.solver}"],
                alt.program, alt.overhead, alt.solution, alt.peak, p.budget)


def _cheapest(cands: Sequence[Plan], budget: int) -> Plan | None:
    """The least predicted overhead among ``cands`` that fit ``budget`` (ties: the lower peak, then the
    first made), or None."""
    fits = [(c.overhead, c.peak, k) for k, c in enumerate(cands) if c.peak <= budget]
    return cands[min(fits)[2]] if fits else None


def _plan_ladder(p: StepProblem, top: int, lows: list, frontier, score, best: float | None,
                 programs: dict | None = None) -> list[Plan]:
    """The greedy's plans (on each graph model, first order) at the ladder points below ``p.budget``
    (:func:`ladder_points`), highest first, while they improve on the best plan so far (``best``: the
    overhead of the cheapest plan made at the budget itself; ``None``, none fits): the descent stops
    after :data:`LADDER_PATIENCE` points in a row whose plans are no cheaper, or at one that fits
    nothing. Each point's plans depend on the step and the point alone (and are cached as such in
    ``frontier``), so a plan a lower budget gets from a point this descent reaches, this budget gets
    too. Scored (``score``) and returned, fitting or not. ``programs``: as :func:`plan_graph`'s."""
    out: list[Plan] = []
    misses = 0
    for g in ladder_points(top, p.budget):
        plans = frontier.ladder.get(g)
        if plans is None:
            plans = []
            for q, low, orders in lows:  # the first order only (siblings together): the ladder is a safety net
                plan_graph(replace(q, budget=g, solver="greedy"), low, orders[0], need_minimum=False, lowered=plans,
                           probes=LADDER_PROBES, programs=programs)
            for c in plans:
                c.budget = g
            score(plans, g)
            frontier.ladder[g] = plans
        out += plans
        here = _cheapest(plans, g)
        if here is None:
            break  # below the greedy's floor
        if best is not None and here.overhead >= best:
            misses += 1
            if misses == LADDER_PATIENCE:
                break  # no cheaper here: lower points, planned for less memory, rarely are
        else:
            best, misses = here.overhead, 0
    return out


def minimum_budget(p: StepProblem) -> int:
    """The smallest budget (bytes) at which :func:`plan_step` plans ``p``'s step: the least of every
    solver's minimum (each through the registry's ``Solver.minimum``) whose program plans; what a
    refusal (``BudgetTooSmall.minimum``) reports."""
    try:
        plan_step(replace(p, budget=1))
    except BudgetTooSmall as e:
        return int(e.minimum)
    return 1


def _improve_near_floor(p: StepProblem, low, best: Plan | None, frontier, model: CostModel, base: float,
                        remarks: list[str], lowered: Sequence[Plan] = ()) -> Plan | None:
    """When the winning plan recomputes much (near the floor), or the graph is small enough for the
    whole-graph MILP (the registry's ``improves_neighbourhood``; wide windows then too), the MILP on
    the neighbourhood of the cheapest greedy plan that fits (the winner itself, or one a chain plan
    beat: the MILP often improves the greedy's past it), its work bounded by node counts and its
    result a function of that plan alone (cached per plan in ``frontier``): its plan, peaking no
    higher in the graph model, lowered and scored on the one cost model, or None. Says what it did
    in ``remarks``."""
    from .milp import improve_in_windows
    from .rematerialize import from_schedule

    n = len(low.graph.compute_nodes)
    if best is None or not improves_neighbourhood(p.solver, best.overhead, n):
        return None
    greedy = [c for c in lowered
              if c.solution is not None and c.solution.solver == "greedy" and c.peak is not None and c.peak <= p.budget]
    if not greedy:
        return None
    start = greedy[min((c.overhead, c.peak, k) for k, c in enumerate(greedy))[2]]
    plan = start.solution
    key = ("windows", tuple(plan.schedule))
    search = frontier.cached(key, lambda: improve_in_windows(low.graph, plan, plan.peak, passes=neighbourhood_passes(n),
                                                             time_limit=NEIGHBOURHOOD_TIME_LIMIT))
    where = "near the floor" if best.overhead > NEAR_FLOOR_OVERHEAD else f"a small graph ({n} nodes)"
    what = (f"{where} (the greedy's plan: predicted overhead {start.overhead:+.1%}): MILP on its neighbourhood, "
            f"{len(search.statuses)} windows in {search.seconds:.2f} s, status {search.status}")
    if search.plan is None:
        remarks.append(what + ", no cheaper plan found")
        return None
    prog = p.finish(from_schedule(low, search.plan.schedule, check=False))
    cand = Plan(f"{search.plan.solver} ({search.plan.status})",
                     [n for n in start.notes if n.startswith("instruction-level")] + search.plan.notes
                     + [f"lowered while planning a budget of {format_bytes(p.budget)} ({p.budget:,} B)"],
                     prog, program_overhead(model, prog, base), search.plan, fit_peak(p, prog))
    remarks.append(what + f", its plan: predicted overhead {cand.overhead:+.1%}"
                   + ("" if cand.peak <= p.budget else ", but its program peaks over the budget"))
    return cand


def _why_not_chain(chain: Plan | int | None, budget: int, best: Plan) -> list[str]:
    """The note saying why a chain of blocks did not win (none when it did)."""
    if isinstance(chain, Plan) and chain.peak is not None and chain.peak > budget:
        return [f"chain of blocks: planned, but its program peaks at {format_bytes(chain.peak)}, over the budget"]
    if isinstance(chain, Plan) and not best.solver.startswith("chain DP"):
        return [f"chain of blocks: planned, predicted overhead {chain.overhead:+.1%} at a peak of "
                f"{format_bytes(chain.peak)}; the winner predicts less recomputation ({best.overhead:+.1%})"]
    if chain is None:
        return ["chain of blocks: not tried (the forward has too few separators to cut it into a chain)"]
    if isinstance(chain, int):
        return [f"chain of blocks: tried, infeasible: its smallest plan needs {format_bytes(chain)} "
                f"(blocks too coarse for this budget: one block's tape and backward do not fit)"]
    return []


# ---------------------------------------------------------------- instruction level
def _solve_graph(graph: Graph, budget: int, order: Sequence[int], solver: str, main: bool,
                 time_limit: float) -> Solution | None:
    """One instruction-level solve at a budget probe, by the solver the registry picks: None (or
    ``BudgetTooSmall`` from the MILP) when it finds no plan at ``budget``; the greedy probes with
    bounded passes (:func:`.greedy.try_greedy_best`), so a failed probe stays cheap."""
    return graph_solver(solver, len(graph.compute_nodes), main)(graph, budget, order, time_limit)


PROBES = ((0.88, 0.92, 0.96, 1.0), (0.1, 0.25, 0.5))
"""The model budgets :func:`plan_graph` probes: fractions of its start (the budget less the step's
extra bytes), and fractions of the way from there to the joint's unconstrained peak."""

LADDER_PATIENCE = 2
"""Ladder points in a row without a cheaper plan after which the descent stops."""

LADDER_PROBES = ((0.88, 1.0), ())
"""The probes at a ladder point (:func:`plan_step`): the grid points below its start, none above."""


MODEL_GRID = 64
"""Model budgets are probed on a grid of the joint's unconstrained peak in steps of 1/MODEL_GRID, fixed by
the step: neighbouring budgets probe the same model budgets, so they see the same greedy plans."""


def model_budgets(start: int, hi: int, probes: tuple[tuple[float, ...], tuple[float, ...]] = PROBES) -> list[int]:
    """The graph-model budgets (bytes) probed for a plan whose model budget is ``start`` (``hi``: the
    joint's unconstrained peak), ascending: the grid points (:data:`MODEL_GRID`) between
    ``min(probes[0]) * start`` and ``start``, always the highest one at most ``start``, and with the
    default probes ``start`` itself (it uses the whole budget: the plan neighbouring budgets share
    may use less), then for each fraction ``f`` of ``probes[1]``, ``start + (hi - start) * f``."""
    grid = [hi * k // MODEL_GRID for k in range(MODEL_GRID + 1)]
    below = [g for g in grid if g <= start]
    lo = min(probes[0]) * start
    out = sorted({g for g in below if g >= lo} | set(below[-1:]) | ({start} if start > 0 and probes is PROBES else set()))
    above = sorted({int(start + (hi - start) * f) for f in probes[1]} - set(out))
    return out + above


def plan_graph(p: StepProblem, low, order: Sequence[int], need_minimum: bool = True,
               max_overhead: float = 2.0, lowered: list[Plan] | None = None,
               probes: tuple[tuple[float, ...], tuple[float, ...]] = PROBES,
               programs: dict | None = None) -> Plan | None:
    """Instruction-level rematerialisation (MILP / RAF greedy) of the joint. None when no plan fits
    and ``need_minimum`` is false; ``BudgetTooSmall`` when none fits and it is true. Every plan
    lowered on the way, fitting or not, is appended to ``lowered`` (for the frontier).
    ``programs``: the step programs (and their peaks) of schedules lowered before, by joint and
    schedule, filled here; the graph models of one joint number their nodes alike, so a schedule
    one of them found lowers to the same program on all (two models' greedy plans often agree)."""
    from .greedy import solve_greedy
    from .rematerialize import from_schedule

    notes = [f"instruction-level plan over {len(low.graph.compute_nodes)} nodes after memory-aware scheduling"]

    def lower(plan: Solution) -> tuple[Solution, Function, int]:
        key = (low.fn, tuple(plan.schedule))
        made = None if programs is None else programs.get(key)
        if made is None:
            prog = p.finish(from_schedule(low, plan.schedule, check=False))
            made = (prog, fit_peak(p, prog))
            if programs is not None:
                programs[key] = made
        prog, peak = made
        if lowered is not None:
            lowered.append(Plan(f"{plan.solver} ({plan.status})", notes + list(plan.notes), prog,
                                     plan.overhead or 0.0, plan, peak))
        return plan, prog, peak

    # The graph model leaves out the optimizer state, and keeps every gradient to the end unless
    # the step consumes it as soon as it exists (``p.consumed``: then it is a transient of the node
    # computing it); the step program adds the state and consumes gradients early, so a plan
    # peaking at ``budget - state`` in the model fits. Heuristic plans are not monotone in the budget, so
    # a portfolio of model budgets around that point, on a grid fixed by the step (neighbouring
    # budgets see the same plans), is solved and the cheapest plan whose exact program peak fits is kept.
    hi = low.peak  # the joint's, without recomputation (``low`` lowers ``p.joint``)
    start = p.budget - p.extra_bytes
    models = model_budgets(start, hi, probes)
    main = max((m for m in models if m <= start), default=None)  # the whole-graph MILP's probe
    plans = []
    for m in models:
        if m <= 0:
            continue
        try:
            plan = _solve_graph(low.graph, m, order, p.solver, m == main, p.milp_time_limit)
        except BudgetTooSmall:
            continue
        except NoSolutionFound as e:  # solver="milp" out of time at this probe: the others may plan
            notes.append(f"MILP at a model budget of {format_bytes(m)}: no schedule within its time limit "
                         f"({e.time_limit:g} s)")
            continue
        if plan is not None:
            plans.append(plan)
    best = None
    for plan in sorted(plans, key=lambda q: q.cost):
        if (plan.overhead or 0.0) > max_overhead:
            break  # runaway recomputation: not worth lowering
        cand = lower(plan)
        if cand[2] <= p.budget:
            best = cand
            break
    if best is None:
        if not need_minimum:  # the chain DP found a plan; its minimum is not needed
            return None
        m = SOLVERS["greedy"].minimum(low.graph, order, p.milp_time_limit)
        cand = lower(solve_greedy(low.graph, m, order=order, score="raf_belady"))  # m is this score's minimum
        if cand[2] > p.budget:
            raise BudgetTooSmall(p.budget, cand[2], "this training step")
        best = cand
    plan, prog, peak = best
    return Plan(f"{plan.solver} ({plan.status})", notes + list(plan.notes), prog, plan.overhead or 0.0, plan, peak)


# ---------------------------------------------------------------- chain of blocks
def plan_blocks(p: StepProblem, lowered: list[Plan] | None = None,
                deferred: list | None = None, frontier: PlanCache | None = None) -> Plan | int | None:
    """Chain of blocks cut at the forward's separators, planned by the chain DP (extended model).

    Two cuts are planned, coarse (only where the backward keeps the value anyway) and fine
    (every separator); the cheaper feasible plan wins. Returns None without a useful cut, the
    smallest minimum (bytes) when no plan fits, else the candidate. Feasible plans are also
    appended to ``lowered``. With ``deferred`` (a list), block-internal plans are not tried here:
    each cut that wants them leaves its context there for :func:`plan_inner`. ``frontier``: the
    step's cache (:func:`~.frontier.frontier_for`), which keeps its differentiated blocks for later
    plans of it."""
    # Identical blocks are differentiated once, across both cuts (and plans of the step).
    cache = {} if frontier is None else _step_cache(p, frontier, "blocks")
    selective: list[Plan] = []  # the cuts' selective plans, candidates beside them (plan_cut)
    results = [r for r in (plan_cut(p, True, cache, deferred, selective), plan_cut(p, False, cache, deferred, selective))
               if r is not None]
    if lowered is not None:
        lowered.extend(selective)
    if not results:
        return None
    ok = [r for r in results if isinstance(r, Plan)]
    if lowered is not None:
        lowered.extend(ok)
    if ok:
        return min(ok, key=lambda c: c.overhead)
    return min(results)


def plan_cut(p: StepProblem, coarse: bool, cache: dict | None = None,
             deferred: list | None = None, selective: list | None = None) -> Plan | int | None:
    """The chain DP over one cut: None without a cut, the minimum (bytes) when no plan fits.
    ``cache``: differentiated blocks shared with other cuts (see ``blocks.cut``). Where the cut's
    plan recomputes too little for block-internal plans, its selective plan (stages keeping the tape
    values dear to recompute, :func:`_selective_plan`) is appended to ``selective`` when one fits:
    planned at every budget, not only near the floor, so that a larger budget never loses the
    selective plan a smaller one found (zoo ResNet small: +9.7% at 55% of its peak, and +12.4%
    at 60% without it)."""
    from .chain.profile import profile_stages
    from .blocks import cut

    t0 = time.perf_counter()
    blocks = cut(p.forward, p.n_state, p.n_params, backward_kept_only=coarse, cache=cache,
                 split_bn_grad=p.split_bn_grad)
    if blocks is None or not _sums_gradients_like_the_step(blocks, p.forward):
        return None
    # Blocks are priced as the portfolio scores every plan: by the static cost model, or a profiled
    # compile's measured instruction seconds (those of the step's own runs, the others timed alone
    # once each), never by running a block once, which would time it as a burst of load finds it.
    profiles = profile_stages(blocks.stages, None, None, None, measure=False, kinds=blocks.kinds,
                              workspace_fn=p.workspace_fn)
    _priced_times(profiles, blocks, CostModel(p.costs, p.measured) if p.measured is not None else None)
    what = f"cut at {'backward-kept' if coarse else 'all'} separators into a chain of {len(blocks.stages)} blocks " \
           f"({blocks.n_distinct} distinct, each differentiated and costed once)"
    best = _solve_chain(p, blocks, blocks.stages, profiles, what, t0)
    from . import inner

    if not inner.INNER_PLANS or isinstance(best, Plan) and best.overhead <= NEAR_FLOOR_OVERHEAD:
        if inner.INNER_PLANS and selective is not None and isinstance(best, Plan) and best.overhead > 0:
            found = _selective_plan(p, blocks, profiles, what, t0, best)
            if found is not None:
                selective.append(found)
        return best
    if deferred is not None:
        deferred.append((blocks, profiles, what, t0, best))
        return best
    r, selective = _with_inner_plans(p, blocks, profiles, what, t0, best)
    return r if selective is None or isinstance(r, Plan) and r.overhead <= selective.overhead else selective


def _sums_gradients_like_the_step(blocks, forward: Function) -> bool:
    """Whether a chain of ``blocks`` (cut from ``forward``) sums each parameter's gradient with the
    same roundings as the step differentiated whole, which adds a parameter's contributions one use
    at a time, the last use first. The chain adds each block's sum, the last block's first
    (``chain.executor``): the same, unless a parameter read in several blocks is read more than once
    in a block before its last (a layer's weights shared by the layers of two blocks; a tied
    embedding and head, one use each, are exact), or the blocks read it more often than ``forward``
    does: an instruction computed in several blocks (a diffusion U-Net's timestep embedding, which
    every block reads), which the step differentiates once, on the sum of its output's gradients,
    and the chain once per block. Such a chain would give other gradient bits than the unconstrained
    step, which a budget must never do: it is not planned."""
    uses: dict[int, list[int]] = {}  # program parameter -> its number of uses in each block reading it
    for stage, lead in zip(blocks.stages, blocks.binding.lead):
        counts = Counter(v for ins in stage.forward.instructions() for v in ins.operands)
        for j in stage.grad_params:
            n = counts.get(stage.forward.params[j], 0)
            if n:
                uses.setdefault(lead[j], []).append(n)
    whole = Counter(v for ins in forward.instructions() for v in ins.operands)
    if any(len(ns) > 1 and sum(ns) > whole.get(forward.params[q], 0) for q, ns in uses.items()):
        return False  # an instruction computed again in another block
    return all(len(ns) < 2 or max(ns[:-1]) < 2 for ns in uses.values())


_SHARED_RECIPES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shared_recipes", default=None)


@contextlib.contextmanager
def sharing_block_recipes():
    """Within it, the steps planned share their block recipes by block text (:func:`plan_inner`):
    for the steps of one compile, the reference and its memory-lean variants, which hold many of
    the same blocks (Hugging Face T5 tiny in bf16: 21 distinct blocks of 33 searched) and are
    planned with the same workspaces. A block's recipes are a function of its text, the static
    costs and the workspaces (the block MILP's solves are node-limited), so sharing them changes
    no plan."""
    token = _SHARED_RECIPES.set({})
    try:
        yield
    finally:
        _SHARED_RECIPES.reset(token)


def plan_inner(p: StepProblem, deferred: list, frontier: PlanCache | None = None) -> list[Plan | int]:
    """Block-internal plans (:func:`_with_inner_plans`) of the cuts :func:`plan_blocks` deferred:
    per cut, its new candidate, or its minimum (bytes) when still none fits; a cut where they do
    no better than the chain as it was gives nothing. ``frontier``: the step's cache, which keeps
    the block recipes and options for later plans of it (the recipes are shared by the cuts, and
    by the steps planned within :func:`sharing_block_recipes`)."""
    out: list[Plan | int] = []
    cache = {} if frontier is None else _step_cache(p, frontier, "recipes")
    shared = _SHARED_RECIPES.get()
    if shared is not None:
        shared = shared.setdefault((p.split_bn_grad, p.workspace_fn is not None), {})
    for blocks, profiles, what, t0, before in deferred:
        r, selective = _with_inner_plans(p, blocks, profiles, what, t0, before, cache, shared)
        if r is not before:
            out.append(r)
        if selective is not None:
            out.append(selective)
    return out


def _step_cache(p: StepProblem, frontier: PlanCache, name: str) -> dict:
    """One of the step's caches of budget-independent planning results: its differentiated blocks
    (``blocks``), or its block recipes and each cut's block options (``recipes``). Planning the step
    again (a retry at the minimum a refusal named, a sweep of budgets) then differentiates and
    searches no block twice. (Chain planners, whose compiled programs would be kept too, are not.)"""
    return frontier.cached((name, p.split_bn_grad), dict)


def _solve_chain(p: StepProblem, blocks, stages: list, profiles: list, what: str, t0: float,
                 inner: str = "", base: float | None = None, shared_inputs: bool = False) -> Plan | int:
    """The chain DP (extended model) over ``stages`` with costs from ``profiles``: its candidate, or
    the minimum (bytes) when no plan fits ``p.budget``. ``inner`` says which stages run
    block-internal plans (notes); ``base``: the compute its overhead is relative to (default: these
    stages' own, without recomputation); ``shared_inputs``: whether the model counts a tape's input
    once (below)."""
    from .chain.planner import ChainPlanner
    from .chain.profile import chain_costs
    from .chain.schedule import n_recomputed

    costs = chain_costs(profiles)

    def finish(fn: Function) -> Function:
        return p.finish(_reorder_aux(fn, blocks.aux_order))

    # With ``shared_inputs`` the chain model counts a block input its tape holds once while the
    # previous block's output is live too (ChainCosts.tape_input): a checkpoint and the next
    # block's tape are one tensor, and a conv or linear block's weight gradient reads its input
    # (zoo ResNet small at 50% with selective blocks: 10 convolutions recomputed instead of 12).
    # Its plans' programs can peak above what it counts, so a plan the search then steps down from
    # may cost more than the other model's (Hugging Face GPT-2 in bf16 at its floor: +100.3%
    # against +94.1%) and its least plan may peak higher (zoo MLP small: 3.6%): it plans the
    # selective levels only, an addition to the levels planned as before.
    planner = ChainPlanner(stages, costs if shared_inputs else costs.without_tape_input(), name="train_joint",
                           binding=blocks.binding, finish=finish, what=f"this model cut into {len(stages)} blocks",
                           peak_fn=lambda fn: fit_peak(p, fn))
    try:
        pol = planner.solve(p.budget, SOLVERS["chain"].method)
    except BudgetTooSmall as e:
        return e.minimum
    notes = [f"{what} in {time.perf_counter() - t0:.2f} s; chain DP (extended model: per block, keep output "
             f"or whole tape{', or a block-internal plan' if inner else ''})",
             f"schedule: {len(pol.solution.schedule)} steps, {n_recomputed(pol.solution, costs)} block recomputations"]
    if inner:
        notes.append(inner)
    base = costs.no_recompute_cost() if base is None else base
    return Plan(f"chain DP ({SOLVERS['chain'].method})", notes, pol.program, pol.solution.cost / base - 1.0, pol.solution,
                pol.peak)  # the planner's peak_fn: fit_peak of this very program


LEVEL_BOUND_SLACK = 1e-9
"""Relative overhead by which an option level's lower bound (its stages' forward and backward run once
each, block-internal recomputation included: no chain plan of the level costs less) must exceed the
best plan's before :func:`_with_inner_plans` skips the level, so that rounding in the DP's sums never
skips a level whose plan would win. Skipping changes no answer (a level wins only by costing strictly
less); it saves the level's chain DP and its compiled probes. At 50%, with the same plans: zoo GPT
small (SGD with momentum) 6 of 8 levels skipped, 33 schedules compiled instead of 45; zoo ResNet
small 2 of 5, 21 instead of 35; Hugging Face T5 tiny 2 of 6, 23 instead of 27."""


def _with_inner_plans(p: StepProblem, blocks, profiles: list, what: str, t0: float,
                      best: Plan | int, cache: dict | None = None,
                      shared: dict | None = None) -> tuple[Plan | int, Plan | None]:
    """The chain DP again with block-internal plans (:mod:`.inner`: stages whose backward recomputes
    part of their tape) at a few levels, when the stages as they are give no plan or one near the
    floor: the cheapest candidate, or the smallest minimum; and apart, the cheapest plan of the
    selective levels (None when they give none), which the portfolio scores with the others.
    (Planned apart: the chain DP's cost and the program's scored overhead can rank two plans
    differently, so a selective plan cheaper to the DP must not stand in for the plan the levels
    before gave.)"""
    from . import inner as inner_mod
    from .chain.profile import chain_costs
    from .costmodel import static_costs
    from .inner import option_levels, selective_levels, stage_options

    base = chain_costs(profiles).no_recompute_cost()  # overheads of every level against the stages as they are
    # Under solver="milp" the block MILP improves the greedy's recipes too (deterministic: node
    # limits); "auto" and "greedy" (golden plans) plan them by the greedy alone.
    milp = inner_mod.BLOCK_MILP and p.solver in inner_mod.BLOCK_MILP_SOLVERS
    key = ("options", what, milp)  # the cut's options depend on the step alone: kept with its recipes
    options = None if cache is None else cache.get(key)
    if options is None:
        options = stage_options(blocks.stages, profiles, blocks.kinds, static_costs, p.workspace_fn, milp=milp,
                                cache=cache, shared=shared)
        if cache is not None:
            cache[key] = options
    # The greedy's options' levels, then those with the block MILP's options too: a superset, so the
    # block MILP never makes the block-internal plan costlier than the greedy's recipes alone.
    greedy = [[k for k, c in enumerate(o) if not c.exact] for o in options]
    levels = [[ks[k] for ks, k in zip(greedy, lv)] for lv in option_levels([[o[k] for k in ks]
                                                                           for o, ks in zip(options, greedy)])]
    levels += [lv for lv in option_levels(options) if lv not in levels]

    def solve(level: list[int], best: Plan | int | None, bound: Plan | int | None,
              shared_inputs: bool = False) -> Plan | int | None:
        """The chain DP at ``level``: its plan when cheaper than ``best``, else ``best`` (or the lesser
        minimum when neither fits); not planned when it cannot beat the plan ``bound``."""
        r = _solve_level(p, blocks, options, level, what, t0, base, bound, shared_inputs)
        if r is None:
            return best
        if isinstance(r, Plan):
            return r if not isinstance(best, Plan) or r.overhead < best.overhead else best
        if best is None:
            return r
        return best if isinstance(best, Plan) else min(best, r)

    for level in levels:
        best = solve(level, best, best)
    # Selective options (stages keeping the tape values dear to recompute) alone and in place of the
    # stages as they are in the floor's level (the first): zoo ResNet small at 50%, +25.0% against
    # +33.8%. (In every level: the same plans there, at twice the chain DPs on zoo GPT.)
    selective = None
    for level in selective_levels(options, levels[:1]):
        selective = solve(level, selective, selective if isinstance(selective, Plan) else best, shared_inputs=True)
    return best, selective if isinstance(selective, Plan) else None


def _solve_level(p: StepProblem, blocks, options: list, level: list[int], what: str, t0: float, base: float,
                 bound: Plan | int | None, shared_inputs: bool = False) -> Plan | int | None:
    """The chain DP with each stage at its option of ``level`` (:func:`_solve_chain`; ``base``: the
    compute of the stages as they are): its plan, or its minimum; None, not planned, when the level
    cannot beat the plan ``bound`` (its stages, each run once, already cost more)."""
    from .chain.profile import chain_costs

    chosen = [o[k] for o, k in zip(options, level)]
    if isinstance(bound, Plan) and chain_costs([c.profile for c in chosen]).no_recompute_cost() / base - 1.0 \
            > bound.overhead + LEVEL_BOUND_SLACK:
        return None
    exact = sum(1 for c in chosen if c.exact)
    selective = sum(1 for c in chosen if c.selective)
    lean = sum(1 for k in level if k) - selective
    parts = ([f"{lean} of {len(level)} blocks keep only their input and recompute the rest of their tape in "
              f"their backward (planned by the greedy on that backward"
              + (f"; {exact} of them improved by the block MILP)" if exact else ")")] if lean else [])
    parts += [f"{selective} of {len(level)} blocks keep their input and the tape values dear to recompute "
              f"(convolution and matrix-product outputs, norm statistics) and recompute the others in their "
              f"backward"] if selective else []
    return _solve_chain(p, blocks, [c.stage for c in chosen], [c.profile for c in chosen], what, t0,
                        "block-internal plans: " + "; ".join(parts), base, shared_inputs)


def _selective_plan(p: StepProblem, blocks, profiles: list, what: str, t0: float, best: Plan) -> Plan | None:
    """The chain DP with every stage that has a selective option on it (:func:`.inner.selective_recipe`),
    the shared-input model counting (:func:`_solve_chain`): its plan when one fits and the level can
    beat ``best`` (its stages' own compute), else None. Without the block-internal plans' greedy
    recipes: a chain DP and one variant per distinct block."""
    from .chain.profile import chain_costs
    from .costmodel import static_costs
    from .inner import selective_levels, stage_options

    options = stage_options(blocks.stages, profiles, blocks.kinds, static_costs, p.workspace_fn, selective_only=True)
    levels = selective_levels(options, [])
    if not levels:
        return None
    r = _solve_level(p, blocks, options, levels[0], what, t0, chain_costs(profiles).no_recompute_cost(), best, True)
    return r if isinstance(r, Plan) else None


def _priced_times(profiles: list, blocks, model: CostModel | None) -> None:
    """Forward/backward seconds of each stage, priced once per distinct block: on ``model`` (a
    profiled compile's measured seconds), else the static estimates."""
    cost = function_cost if model is None else model.program_cost
    by_kind: dict[int, tuple[float, float]] = {}
    for prof, st, kind in zip(profiles, blocks.stages, blocks.kinds):
        if kind not in by_kind:
            by_kind[kind] = (cost(st.split.forward), cost(st.split.backward))
        prof.fwd_time, prof.bwd_time = by_kind[kind]


def _reorder_aux(fn: Function, aux_order: list[int]) -> Function:
    """Put the side outputs of a chain program (in stage order) back in the forward's output order."""
    if not aux_order or aux_order == sorted(aux_order):
        return fn
    out = fn.clone()
    ret = out.entry.instrs[-1]
    ops, types = list(ret.operands), list(out.result_types)
    for t, j in enumerate(aux_order):  # stage-order side output t is the forward's side output j
        ops[1 + j], types[1 + j] = ret.operands[1 + t], fn.result_types[1 + t]
    ret.operands = ops
    out.result_types = types
    return out


__all__ = ["MILP_MAX_NODES", "SOLVER_OPTIONS", "minimum_budget", "plan_blocks", "plan_graph", "plan_inner", "plan_step",
           "uses_milp"]
