"""Checkmate-style MILP: optimality vs exhaustive search, time limit, infeasibility."""


import pytest

from remat.plan._exhaustive import exhaustive_min_peak, exhaustive_optimum
from remat.plan.graph import (BudgetTooSmall, Graph, min_memory_lower_bound, no_remat_schedule, evaluate, schedule_computes)
from graphgen import random_graph, synthetic_training_graph
from remat.plan.milp import NoSolutionFound, milp_min_peak, solve_milp, solve_with_fallback


def _budgets(g):
    lo = exhaustive_min_peak(g, "checkmate")
    hi = evaluate(g, no_remat_schedule(g))[1]
    return lo, hi, sorted({lo, (lo + hi) // 2, max(lo, hi - 1)})


@pytest.mark.parametrize("seed", range(25))
def test_milp_matches_exhaustive_optimum(seed):
    g = random_graph(6, seed, n_inputs=2, max_fanin=2, p_nonrecomputable=0.1, p_workspace=0.2)
    lo, hi, budgets = _budgets(g)
    for budget in budgets:
        ex = exhaustive_optimum(g, budget, "checkmate")
        assert ex is not None
        plan = solve_milp(g, budget, time_limit=20, mip_rel_gap=0)
        assert plan.status == "optimal"
        # the simulated schedule is valid, within budget, and as cheap as the optimum
        cost, peak = evaluate(g, plan.schedule)
        assert (cost, peak) == (plan.cost, plan.peak)
        assert peak <= budget
        model_cost = plan.objective if plan.objective is not None else plan.cost
        assert model_cost == pytest.approx(ex[0], abs=1e-9)
        # pruning useless computes may only help; nothing beats the unrestricted optimum
        assert plan.cost <= ex[0] + 1e-9
        any_opt = exhaustive_optimum(g, budget, "any")
        assert any_opt is not None and any_opt[0] <= plan.cost + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_milp_budget_below_minimum_raises_with_exact_minimum(seed):
    g = random_graph(6, 100 + seed, n_inputs=2, max_fanin=2, p_workspace=0.2)
    lo = exhaustive_min_peak(g, "checkmate")
    with pytest.raises(BudgetTooSmall) as info:
        solve_milp(g, lo - 1, time_limit=20)
    assert info.value.budget == lo - 1
    assert info.value.minimum == lo
    mp = milp_min_peak(g, time_limit=20)
    assert mp.exact and mp.minimum == lo and mp.plan is not None and mp.plan.peak == lo


def test_budget_below_lower_bound_raises_immediately():
    g = synthetic_training_graph("chain", 4, seed=0)
    lb = min_memory_lower_bound(g)
    with pytest.raises(BudgetTooSmall) as info:
        solve_milp(g, lb - 1)
    assert info.value.minimum == lb


def test_generous_budget_needs_no_recompute():
    g = synthetic_training_graph("residual", 3, seed=0)
    peak = evaluate(g, no_remat_schedule(g))[1]
    plan = solve_milp(g, peak)
    assert plan.cost == pytest.approx(g.base_cost) and plan.peak == peak and plan.status == "optimal"


def test_milp_recomputes_to_fit_a_chain():
    g = synthetic_training_graph("chain", 8, seed=None)
    peak = evaluate(g, no_remat_schedule(g))[1]
    budget = int(0.75 * peak)
    plan = solve_milp(g, budget, time_limit=30, mip_rel_gap=0)
    assert plan.peak <= budget
    assert plan.cost > g.base_cost  # had to recompute something
    assert plan.status in ("optimal", "time_limit_feasible")


def test_milp_respects_time_limit_on_a_large_graph():
    g = synthetic_training_graph("residual", 24, seed=0)  # ~200 nodes, 172 computed
    assert len(g) >= 190
    budget = int(0.5 * evaluate(g, no_remat_schedule(g))[1])
    try:
        plan = solve_milp(g, budget, time_limit=2.0)
    except NoSolutionFound as e:
        assert "no feasible schedule" in str(e) and e.time_limit == 2.0
    else:
        assert plan.status in ("time_limit_feasible", "optimal") and plan.peak <= budget


def test_solve_with_fallback_returns_a_valid_plan_and_explains():
    g = synthetic_training_graph("unet", 3, seed=0)
    budget = int(0.7 * evaluate(g, no_remat_schedule(g))[1])
    plan = solve_with_fallback(g, budget, time_limit=3)
    assert plan.peak <= budget and evaluate(g, plan.schedule) == (plan.cost, plan.peak)
    assert plan.solver in ("milp", "greedy")
    assert "chosen" in plan.describe() or "fell back" in plan.describe()


def test_milp_with_explicit_order_maps_back():
    g = Graph()
    x = g.add_input("x", 4)
    a = g.add_node("a", 1.0, 8, [x])
    b = g.add_node("b", 1.0, 1, [x])
    g.add_node("c", 1.0, 1, [a, b], is_output=True)
    plan = solve_milp(g, 100, order=[2, 1, 3])
    assert schedule_computes(plan.schedule) == [2, 1, 3]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_window_over_every_stage_is_the_whole_milp(seed):
    """The neighbourhood MILP with one window spanning the schedule, between the inputs and the
    outputs, is the Checkmate MILP in the greedy's order: the same optimum, below the greedy's."""
    from remat.plan.graph import schedule_computes
    from remat.plan.greedy import greedy_min_budget, solve_greedy
    from remat.plan.milp import WINDOW_STAGES, WindowPass, improve_in_windows
    from remat.plan.scheduling import memory_aware_order

    g = synthetic_training_graph("chain", 4, seed=seed)
    order = memory_aware_order(g)
    greedy = solve_greedy(g, greedy_min_budget(g, order), order=order)
    T = len(g.compute_nodes)
    search = improve_in_windows(g, greedy, greedy.peak, time_limit=60, passes=(WindowPass(T, 10**9),),
                                node_limit=None)
    assert search.statuses == ["optimal"] and search.status == "optimal" and search.improved == 1
    first = list(dict.fromkeys(schedule_computes(greedy.schedule)))
    whole = solve_milp(g, greedy.peak, time_limit=60, order=first, mip_rel_gap=0)
    assert search.plan.cost == pytest.approx(whole.cost, rel=1e-9) and whole.cost < greedy.cost
    assert evaluate(g, search.plan.schedule) == (search.plan.cost, search.plan.peak)
    assert search.plan.peak <= greedy.peak and search.plan.solver == "milp window"


@pytest.mark.parametrize("kind,n,improves", [("residual", 6, True), ("unet", 3, False)])
def test_neighbourhood_windows_never_cost_more_nor_peak_higher(kind, n, improves):
    """Small windows (re-solved with the rest fixed) keep the schedule valid, within the cap, and
    only ever lower its cost; each window's HiGHS status is recorded."""
    from remat.plan.greedy import greedy_min_budget, solve_greedy
    from remat.plan.milp import WINDOW_STAGES, WindowPass, improve_in_windows
    from remat.plan.scheduling import memory_aware_order

    g = synthetic_training_graph(kind, n, seed=0)
    order = memory_aware_order(g)
    greedy = solve_greedy(g, greedy_min_budget(g, order), order=order)
    search = improve_in_windows(g, greedy, greedy.peak, time_limit=20, passes=(WindowPass(WINDOW_STAGES, 300),))
    assert search.statuses and set(search.statuses) <= {"optimal", "node_limit", "no_solution", "infeasible"}
    again = improve_in_windows(g, greedy, greedy.peak, time_limit=20, passes=(WindowPass(WINDOW_STAGES, 300),))
    assert again.statuses == search.statuses and (again.plan is None) == (search.plan is None)  # node-limited: deterministic
    if search.plan is not None:
        assert again.plan.schedule == search.plan.schedule
    assert (search.plan is not None) == improves  # small windows: solved to optimality, so deterministic
    if search.plan is not None:
        assert evaluate(g, search.plan.schedule) == (search.plan.cost, search.plan.peak)
        assert search.plan.peak <= greedy.peak and search.plan.cost < greedy.cost
    else:
        assert search.improved == 0


def test_highs_native_prints_do_not_reach_the_users_output(capfd) -> None:
    """SciPy's HiGHS prints debugging lines with C's printf whatever ``disp`` says: while it solves, fd 1
    goes to the null device; C's buffer is flushed before it comes back, and Python's output before
    and after is kept."""
    import ctypes

    from remat.plan.milp import _native_stdout_silenced

    libc = ctypes.CDLL(None)
    print("before", flush=True)
    with _native_stdout_silenced():
        libc.printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution\n")
    print("after", flush=True)
    libc.fflush(None)
    out = capfd.readouterr().out
    assert "Highs" not in out and "before" in out and "after" in out


def test_wide_windows_reach_the_optimum_the_small_ones_miss():
    """On a synthetic U-Net of 22 nodes the optimum keeps the first encoder's output over 16 stages:
    no 4-stage window sees that, the wide pass of a small graph's neighbourhood search does, and
    finds the whole-graph MILP's optimum."""
    from remat.plan.greedy import greedy_min_budget, try_greedy_best
    from remat.plan.milp import WINDOW_PASSES, improve_in_windows
    from remat.plan.registry import improves_neighbourhood, neighbourhood_passes
    from remat.plan.scheduling import memory_aware_order

    g = synthetic_training_graph("unet", 2, seed=0)
    order = memory_aware_order(g)
    n = len(g.compute_nodes)
    lo, hi = greedy_min_budget(g, order), evaluate(g, no_remat_schedule(g))[1]
    budget = lo + (hi - lo) // 10
    greedy = try_greedy_best(g, budget, order)
    assert improves_neighbourhood("auto", greedy.overhead, n)
    assert improve_in_windows(g, greedy, budget, passes=WINDOW_PASSES).plan is None
    assert len(neighbourhood_passes(n)) > len(WINDOW_PASSES) == len(neighbourhood_passes(10 * n))
    wide = improve_in_windows(g, greedy, budget, passes=neighbourhood_passes(n)).plan
    best = solve_milp(g, budget, order=order, time_limit=60)
    assert best.status == "optimal" and wide.peak <= budget
    assert wide.cost == pytest.approx(best.cost, rel=1e-9) and wide.cost < greedy.cost


def test_the_neighbourhood_runs_near_the_floor_or_on_small_graphs():
    """Under "auto" and "milp", the MILP searches a greedy plan's neighbourhood when it recomputes much or the
    graph is small enough for the whole-graph MILP; never under "greedy"."""
    from remat.plan.milp import MILP_MAX_NODES
    from remat.plan.registry import NEAR_FLOOR_OVERHEAD, improves_neighbourhood

    cheap, costly = NEAR_FLOOR_OVERHEAD / 2, 2 * NEAR_FLOOR_OVERHEAD
    assert improves_neighbourhood("auto", cheap, MILP_MAX_NODES)
    assert not improves_neighbourhood("auto", cheap, MILP_MAX_NODES + 1)
    assert improves_neighbourhood("auto", costly, 10 * MILP_MAX_NODES) and improves_neighbourhood("milp", costly, 10)
    assert not improves_neighbourhood("greedy", costly, 10)


def test_a_model_over_its_variable_cap_is_refused_before_its_constraints_exactly(monkeypatch):
    """``_build(..., max_vars=k)`` gives None exactly when the whole model would have more than ``k``
    variables, for whole-run models (budget or min-peak) and for every window the neighbourhood
    search builds: the cap decides as the built model's count would, without building it."""
    from remat.plan import milp
    from remat.plan.greedy import greedy_min_budget, try_greedy_best
    from remat.plan.registry import neighbourhood_passes
    from remat.plan.scheduling import memory_aware_order

    def exact(*args, **kw):
        n = build(*args, **{**kw, "max_vars": None}).n_vars
        assert build(*args, **{**kw, "max_vars": n}) is not None and build(*args, **{**kw, "max_vars": n - 1}) is None
        checked.append(n)
        return build(*args, **kw)

    build, checked = milp._build, []
    g = synthetic_training_graph("unet", 2, seed=0)
    order = memory_aware_order(g)
    gp, hi = g.permuted(order)[0], evaluate(g, no_remat_schedule(g))[1]
    exact(gp, hi // 2, hi / 2000)
    exact(gp, None, hi / 2000)
    lo = greedy_min_budget(g, order)
    budget = lo + (hi - lo) // 10
    monkeypatch.setattr(milp, "_build", exact)
    milp.improve_in_windows(g, try_greedy_best(g, budget, order), budget, passes=neighbourhood_passes(10 * len(g)))
    assert len(checked) > 2
