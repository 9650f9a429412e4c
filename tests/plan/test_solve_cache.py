"""The on-disk cache of node-limited HiGHS solves (``remat.plan.solve_cache``): a solve asked again,
in this process or another, is answered from its entry without HiGHS, with HiGHS's own answer; a
solve the time guard stopped, or one without a node limit, is never kept; the key is the whole
MILP and its options; ``REMAT_SOLVE_CACHE=0`` turns it off. (Damaged entries:
``tests/train/test_cache_entries.py``.)"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize

from graphgen import random_graph, synthetic_training_graph
from remat.plan import milp, solve_cache
from remat.plan.graph import evaluate, no_remat_schedule
from remat.plan.greedy import greedy_min_budget, try_greedy_best
from remat.plan.registry import neighbourhood_passes
from remat.plan.scheduling import memory_aware_order


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REMAT_SOLVE_CACHE", "1")
    monkeypatch.setattr(solve_cache, "MIN_SECONDS", 0.0)  # keep every solve, however quick


@pytest.fixture
def highs_calls(monkeypatch) -> list:
    """Each call of SciPy's MILP solver (HiGHS), recorded."""
    calls: list = []
    real = scipy.optimize.milp
    monkeypatch.setattr(scipy.optimize, "milp", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _problem():
    """A synthetic U-Net of 22 nodes near its floor and the greedy's plan: its neighbourhood search
    solves a few dozen node-limited windows, narrow and wide."""
    g = synthetic_training_graph("unet", 2, seed=0)
    order = memory_aware_order(g)
    lo, hi = greedy_min_budget(g, order), evaluate(g, no_remat_schedule(g))[1]
    budget = lo + (hi - lo) // 10
    return g, try_greedy_best(g, budget, order), budget


def _small():
    """A random graph of 8 nodes at the middle of its budgets, and its whole MILP."""
    g = random_graph(8, 3, n_inputs=2, max_fanin=2)
    lo, hi = greedy_min_budget(g, memory_aware_order(g)), evaluate(g, no_remat_schedule(g))[1]
    budget = (lo + hi) // 2
    return milp._build(g, budget, budget / 1000.0), milp._build(g, budget - 1, budget / 1000.0)


def _search(g, plan, budget):
    return milp.improve_in_windows(g, plan, budget, passes=neighbourhood_passes(len(g.compute_nodes)))


def test_solves_asked_again_are_answered_from_the_cache_as_highs_answers_them(highs_calls, monkeypatch):
    g, greedy, budget = _problem()
    first = _search(g, greedy, budget)
    solved = len(highs_calls)
    assert first.plan is not None and solved == len(first.statuses) > 0
    assert len(list(solve_cache.cache_dir().glob("*.json"))) == solved  # one entry per distinct window model
    again = _search(g, greedy, budget)  # as in another process: the cache holds nothing in memory
    assert len(highs_calls) == solved, "HiGHS ran for a kept solve"
    assert again.statuses == first.statuses and again.plan.schedule == first.plan.schedule
    monkeypatch.setenv("REMAT_SOLVE_CACHE", "0")
    fresh = _search(g, greedy, budget)
    assert len(highs_calls) == 2 * solved  # off: solved afresh, nothing read
    assert fresh.statuses == first.statuses and fresh.plan.schedule == first.plan.schedule


def test_a_kept_result_has_every_field_highs_gave(highs_calls):
    model, _ = _small()
    got = milp._solve(model, 30.0, 1e-4, node_limit=50)
    kept = milp._solve(model, 30.0, 1e-4, node_limit=50)
    assert len(highs_calls) == 1
    for f in ("status", "message", "fun", "success", "mip_node_count", "mip_dual_bound", "mip_gap"):
        assert kept[f] == got[f] or (np.isnan(kept[f]) and np.isnan(got[f])), f
    assert kept.x.dtype == np.float64 and np.array_equal(kept.x, got.x)


def test_guarded_and_time_limited_solves_are_never_kept(monkeypatch):
    model, _ = _small()
    stopped = scipy.optimize.OptimizeResult(status=1, message="Time limit reached. (HiGHS Status 13: Time limit reached)",
                                            x=None, fun=None, success=False, mip_node_count=3, mip_dual_bound=1.0,
                                            mip_gap=np.inf)
    real = scipy.optimize.milp
    monkeypatch.setattr(scipy.optimize, "milp", lambda *a, **k: stopped)
    assert milp._solve(model, 30.0, 1e-4, node_limit=50) is stopped  # its answer depends on the machine's load
    monkeypatch.setattr(scipy.optimize, "milp", real)
    milp._solve(model, 30.0, 1e-4)  # no node limit: a time-limited solve (solver="milp")
    assert not solve_cache.cache_dir().exists() or not list(solve_cache.cache_dir().iterdir())
    milp._solve(model, 30.0, 1e-4, node_limit=50)
    assert len(list(solve_cache.cache_dir().iterdir())) == 1  # the same solve node-limited is kept


def test_the_key_is_the_whole_model_and_its_options_but_the_guard():
    a, b = _small()

    def key(m, **options):
        return solve_cache.key(m.c, m.A.tocsr(), m.row_lb, m.row_ub, m.lb, m.ub, m.integrality,
                               {"mip_rel_gap": 1e-4, "node_limit": 50, **options})

    assert key(a) == key(a, time_limit=1.0) == key(a, time_limit=60.0)
    assert len({key(a), key(b), key(a, node_limit=51), key(a, mip_rel_gap=0.0),
                key(a, **milp.WINDOW_HIGHS_OPTIONS)}) == 5


def test_a_whole_entry_that_is_not_a_solve_is_named_removed_and_solved_again(highs_calls):
    from remat import cache as rcache

    model, _ = _small()
    milp._solve(model, 30.0, 1e-4, node_limit=50)
    (entry,) = solve_cache.cache_dir().glob("*.json")
    rcache.write_entry(entry, f"solve:{entry.stem}", solve_cache.FORMAT, b'{"x": [1.0]}')  # checksum and all
    with pytest.warns(RuntimeWarning, match=str(entry)):
        milp._solve(model, 30.0, 1e-4, node_limit=50)
    assert len(highs_calls) == 2 and solve_cache.load(entry.stem) is not None  # solved again, written again
