"""Tests of the chain checkpointing solvers (remat.plan.chain.solvers) on heterogeneous chains."""

from __future__ import annotations

import math

import numpy as np
import pytest

from remat.plan.chain.costs import BudgetTooSmall, ChainCosts
from remat.plan.chain.schedule import B, F, FT, Free, evaluate_chain
from remat.plan.record import ScheduleError
from remat.plan.chain.solvers import minimum_budget, no_recompute_peak, solve, solve_thesis


def _budgets(c: ChainCosts, k: int = 6) -> list[int]:
    lo, hi = minimum_budget(c), no_recompute_peak(c)
    return sorted({int(round(lo + (hi - lo) * t)) for t in np.linspace(0, 1.1, k)})


def _chains(n_max: int = 12, count: int = 8, extended: bool = False):
    rng = np.random.default_rng(123)
    for s in range(count):
        yield ChainCosts.random(int(rng.integers(2, n_max + 1)), seed=s, max_bytes=500, extended=extended)


# ------------------------------------------------------------------ cost model
@pytest.mark.parametrize("field,idx,value,needle", [
    ("beta_f", 3, -2.0, "beta_f[3] = -2.0 is negative"),
    ("alpha_b", 1, float("nan"), "alpha_b[1] = nan is not finite"),
    ("alpha_f", 0, float("inf"), "alpha_f[0] = inf is not finite"),
    ("beta_b", 2, 1.5, "beta_b[2] = 1.5 is not a whole number"),
])
def test_bad_costs_name_array_and_index(field, idx, value, needle):
    arrs = dict(alpha_f=[1.0] * 5, alpha_b=[1.0] * 6, beta_f=[4] * 5, beta_b=[4] * 6)
    arrs[field] = list(arrs[field])
    arrs[field][idx] = value
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        ChainCosts(**arrs)


def test_wrong_length_named():
    with pytest.raises(ValueError, match="alpha_b has length 5, expected 6"):
        ChainCosts([1.0] * 5, [1.0] * 5, [1] * 5, [1] * 6)
    with pytest.raises(ValueError, match="tape_bytes"):
        ChainCosts([1.0] * 5, [1.0] * 6, [1] * 5, [1] * 6, tape_bytes=[1] * 4)


def test_uniform_switches():
    c = ChainCosts.random(8, seed=3)
    u = ChainCosts.uniform(like=c, compute="profiled", memory="uniform")
    assert np.array_equal(u.alpha_f, c.alpha_f)
    assert len(set(u.beta_f[1:].tolist())) == 1 and u.beta_f[0] == c.beta_f[0]
    u2 = ChainCosts.uniform(like=c, compute="uniform", memory="profiled")
    assert np.array_equal(u2.beta_b, c.beta_b)
    assert np.allclose(u2.alpha_f[1:], c.alpha_f[1:].mean())
    assert ChainCosts.uniform(4).n == 4


# ------------------------------------------------------------------ thesis notation
def test_solve_thesis_hand_worked_example():
    # N = 2, every tensor 1 byte.  alpha_f[0] and alpha_b[3] are never charged.
    af, ab, bf, bb = [9.0, 2.0, 3.0], [1.0, 4.0, 5.0, 7.0], [1, 1, 1], [1, 1, 1, 1]
    # No recomputation: peak is eq. 2.19 at i = 2: f0+f1+f2 + b3 + b2 = 5.
    p = solve_thesis(af, ab, bf, bb, 5)
    assert p.cost == pytest.approx(2 + 3 + 1 + 4 + 5) and p.peak == 5
    # Budget 4: C(0, 3, 3) picks k = 2 (f_1 dropped, recomputed once): 17, B = 3.
    p = solve_thesis(af, ab, bf, bb, 4)
    assert p.cost == pytest.approx(17.0) and p.peak == 4
    assert p.stats["dp_cost"] == pytest.approx(17.0) and p.stats["predicted_peak"] == 4
    assert p.schedule == [F(1), FT(2), Free("f", 1), B(2), Free("b", 3), Free("f", 2),
                          FT(1), B(1), Free("b", 2), Free("f", 1), B(0), Free("b", 1)]
    # Budget 3: below P(0, 3) + beta_f[0] = 4.
    with pytest.raises(BudgetTooSmall) as e:
        solve_thesis(af, ab, bf, bb, 3)
    assert e.value.minimum == 4 and e.value.budget == 3
    assert "4 bytes" in str(e.value) and "3 bytes" in str(e.value)


# ------------------------------------------------------------------ precise DP
def test_precise_plans_valid_and_match_simulator():
    for c in _chains():
        for b in _budgets(c):
            p = solve(c, b, "precise", bucket=1)
            cost, peak = evaluate_chain(c, p.schedule)
            assert peak <= b and p.feasible
            assert cost == pytest.approx(p.cost) and peak == p.peak
            assert p.peak == p.stats["predicted_peak"]  # beta_f[0] + B(0, N+1, M)
            assert p.cost == pytest.approx(p.stats["dp_cost"])


def test_cost_non_increasing_and_no_recompute_at_top():
    for c in _chains(count=5):
        lo, hi = minimum_budget(c), no_recompute_peak(c)
        grid = list(range(lo, hi + 3, max(1, (hi - lo) // 40)))
        for bucket in (1, "exact"):
            costs = [solve(c, b, "precise", bucket=bucket).cost for b in grid]
            assert all(a >= b - 1e-9 for a, b in zip(costs, costs[1:]))
        for b in (hi, hi + 17):
            for bucket in (1, "exact"):
                p = solve(c, b, "precise", bucket=bucket)
                assert p.cost == pytest.approx(c.no_recompute_cost())
        assert solve(c, hi, "none").peak == hi


@pytest.mark.parametrize("bucket", [1, 7, "exact"])
def test_minimum_budget_is_exact(bucket):
    for c in _chains(count=6):
        mn = minimum_budget(c, bucket)
        p = solve(c, mn, "precise", bucket=bucket)
        assert p.peak <= mn
        with pytest.raises(BudgetTooSmall) as e:
            solve(c, mn - 1, "precise", bucket=bucket)
        assert e.value.minimum == mn


def test_minimum_budget_matches_brute_force():
    # The least peak over every strategy of the model, found by the simulator alone.
    for c in _chains(n_max=6, count=6):
        with pytest.raises(BudgetTooSmall) as e:
            solve(c, 0, "exhaustive")
        assert e.value.minimum == minimum_budget(c)


def test_exhaustive_equals_precise_small_chains():
    for c in _chains(n_max=6, count=8):
        for b in _budgets(c, 7):
            ex = solve(c, b, "exhaustive")
            pr = solve(c, b, "precise", bucket=1)
            assert pr.cost == pytest.approx(ex.cost), (c, b)
            assert ex.peak <= b


def test_exact_mode_equals_unit_bucket_and_beats_buckets():
    for c in _chains(count=6):
        for b in _budgets(c):
            one = solve(c, b, "precise", bucket=1)
            ex = solve(c, b, "precise", bucket="exact")
            assert ex.cost == pytest.approx(one.cost)
            assert ex.peak <= b and evaluate_chain(c, ex.schedule) == pytest.approx((ex.cost, ex.peak))
            try:
                coarse = solve(c, b, "precise", bucket=13)
            except BudgetTooSmall:
                continue
            assert coarse.peak <= b  # sizes rounded up, budget down: always valid
            assert coarse.cost >= one.cost - 1e-9


def test_precise_never_worse_than_baselines():
    for c in _chains(count=8):
        for b in _budgets(c):
            pr = solve(c, b, "precise", bucket=1)
            for m in ("uniform", "sqrt", "none"):
                base = solve(c, b, m)
                assert evaluate_chain(c, base.schedule) == pytest.approx((base.cost, base.peak))
                if base.feasible:
                    assert pr.cost <= base.cost + 1e-9, (m, b)


def test_uniform_is_gruslys_on_uniform_chain():
    # On a truly uniform chain, the slot model is exact: the plan fits and is optimal.
    c = ChainCosts.uniform(10, beta_f=4, beta_b=4)
    for b in range(3 * 4 + 4, no_recompute_peak(c) + 1, 4):
        un = solve(c, b, "uniform")
        assert un.feasible
        assert un.cost == pytest.approx(solve(c, b, "precise", bucket=1).cost)


# ------------------------------------------------------------------ extended model
def test_extended_equals_precise_without_extensions():
    for c in _chains(count=5):
        for b in _budgets(c, 4):
            assert solve(c, b, "extended", bucket=1).cost == pytest.approx(solve(c, b, "precise", bucket=1).cost)


def test_extended_never_worse_than_precise_and_valid():
    for c in _chains(count=8, extended=True):
        assert c.has_extended
        for b in _budgets(c):
            ext = solve(c, b, "extended", bucket=1)
            assert evaluate_chain(c, ext.schedule, "extended") == pytest.approx((ext.cost, ext.peak))
            assert ext.peak <= b and ext.peak == ext.stats["predicted_peak"]
            try:
                pr = solve(c, b, "precise", bucket=1)  # thesis model on folded costs
            except BudgetTooSmall:
                continue
            assert ext.cost <= pr.cost + 1e-9
            # a thesis plan is valid in the extended model and never peaks higher there
            assert evaluate_chain(c, pr.schedule, "extended")[1] <= pr.peak


def test_extended_equals_exhaustive_small_chains():
    for c in _chains(n_max=4, count=6, extended=True):
        lo = minimum_budget(c, method="extended")
        hi = no_recompute_peak(c, "extended")
        for b in np.linspace(lo, hi, 5).round():
            ex = solve(c, float(b), "exhaustive-extended")
            assert solve(c, float(b), "extended", bucket=1).cost == pytest.approx(ex.cost)
        with pytest.raises(BudgetTooSmall) as e:
            solve(c, lo - 1, "extended", bucket=1)
        assert e.value.minimum == lo


def test_extended_tables_answer_every_smaller_budget():
    """Tables kept across calls (solved once at the widest budget) give the same plans as solving
    each budget afresh, and the DP runs once for all the smaller budgets."""
    for c in _chains(count=5, extended=True):
        tables: dict = {}
        budgets = _budgets(c, 6)
        solve(c, budgets[-1], "extended", bucket=3, tables=tables)
        widest = tables[("extended", 3)]
        for b in budgets:
            try:
                fresh = solve(c, b, "extended", bucket=3)
            except BudgetTooSmall as e:
                with pytest.raises(BudgetTooSmall) as again:
                    solve(c, b, "extended", bucket=3, tables=tables)
                assert again.value.minimum == e.minimum
                continue
            kept = solve(c, b, "extended", bucket=3, tables=tables)
            assert (kept.schedule, kept.cost, kept.peak, kept.stats) == (fresh.schedule, fresh.cost, fresh.peak,
                                                                        fresh.stats)
        assert tables[("extended", 3)] is widest  # no smaller budget solved the DP again


def _sharing_chain(share: bool) -> ChainCosts:
    """Three stages whose backwards read their inputs (a linear layer's weight gradient): each tape
    is the previous output, 100 bytes."""
    out, tape = [0, 100, 100, 100], [0, 100, 100, 100]
    return ChainCosts([0, 1, 1, 1], [1, 1, 1, 1, 0], out, [0, 10, 10, 10, 10], tape,
                      tape_input=[0, 0, 100, 100] if share else None)


def test_a_tape_holding_its_input_counts_it_once_while_the_previous_output_lives():
    """Keeping f_2 and f_3 with their tapes holds f_1 and f_2 once each, not twice; a tape holding
    its input keeps those bytes after the previous output is freed, until the tape goes."""
    shared, twice = _sharing_chain(True), _sharing_chain(False)
    keep_all = [FT(1), FT(2), FT(3), B(3), Free("b", 4), Free("f", 3), B(2), Free("b", 3), Free("f", 2),
                B(1), Free("b", 2), Free("f", 1), B(0), Free("b", 1)]
    assert evaluate_chain(shared, keep_all, "extended")[1] == evaluate_chain(twice, keep_all, "extended")[1] - 200
    # f_1 freed while f_2's tape (holding it) lives: its bytes stay until that tape is freed
    drop = [F(1), FT(2), Free("f", 1), FT(3), B(3), Free("b", 4), Free("f", 3), B(2), Free("b", 3), Free("f", 2),
            FT(1), B(1), Free("b", 2), Free("f", 1), B(0), Free("b", 1)]
    assert evaluate_chain(shared, drop, "extended")[1] == evaluate_chain(twice, drop, "extended")[1] - 100
    for b in range(minimum_budget(twice, method="extended"), no_recompute_peak(twice, "extended") + 1, 25):
        assert solve(shared, b, "extended", bucket=1).cost <= solve(twice, b, "extended", bucket=1).cost
    assert minimum_budget(shared, method="extended") < minimum_budget(twice, method="extended")
    with pytest.raises(ValueError, match=r"tape_input\[2\] = 150 exceeds tape_bytes\[2\] = 100"):
        ChainCosts([0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 100, 200, 100], [0, 10, 10, 10, 10], [0, 100, 100, 100],
                   tape_input=[0, 0, 150, 0])


# ------------------------------------------------------------------ simulator
def test_simulator_rejects_invalid_schedules():
    c = ChainCosts.uniform(2)
    with pytest.raises(ScheduleError, match="f_1 is not live"):
        evaluate_chain(c, [F(2)])
    with pytest.raises(ScheduleError, match="b_3 is not live"):
        evaluate_chain(c, [F(1), FT(2), Free("b", 3), B(2)])
    with pytest.raises(ScheduleError, match="tape"):
        evaluate_chain(ChainCosts.random(2, 1, extended=True), [F(1), F(2), B(2)], "extended")
    with pytest.raises(ScheduleError, match="unexpected live set"):
        evaluate_chain(c, [FT(1), FT(2), B(2), Free("b", 3), B(1), Free("b", 2), B(0), Free("b", 1)])


def test_plan_str_and_errors():
    c = ChainCosts.random(5, seed=2)
    p = solve(c, no_recompute_peak(c), "precise", bucket=1)
    s = p.describe()
    assert "precise" in s and "B(0)" in s and "feasible" in s
    with pytest.raises(ValueError, match="unknown method"):
        solve(c, 1e6, "magic")
    with pytest.raises(ValueError, match="budget"):
        solve(c, float("nan"))
    assert math.isclose(p.overhead, 0.0, abs_tol=1e-12)  # no recomputation at the no-recompute peak
