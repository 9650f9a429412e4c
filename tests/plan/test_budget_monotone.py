"""A larger budget never gets a costlier plan (issue 12): sweeps of zoo training steps over budgets,
and the frontier of lowered plans that makes it so."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

import remat
from remat import zoo
from remat.ir import Function
from remat.plan.frontier import Frontier, forget_plans
from remat.plan.portfolio import plan_step
from remat.plan.record import Plan
from remat.train.curve import budget_sweep, default_budgets, minimum_budget


@pytest.mark.parametrize("name,size", [("resnet", "tiny"), ("gpt", "tiny"), ("unet", "tiny")])
def test_sweep_is_monotone_and_exact(name, size):
    """(mlp is left out: without an optimizer its step has nothing to trade, the minimum is the unconstrained peak.)"""
    forget_plans()
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, example, loss_fn = zoo.make(name, size, torch.float32, **kw)
    step = remat.compile(model, example, loss_fn, milp_time_limit=1.0)  # the MILP runs on small graphs
    budgets = default_budgets(step, 10)
    assert len(budgets) >= 10 and budgets[-1] == step.unconstrained_peak
    rows = budget_sweep(step, budgets, repeats=1)
    for r in rows:
        assert r.measured_peak == r.predicted_peak <= r.budget, r
    assert rows[-1].solver == "none" and rows[-1].predicted_overhead == 0.0
    assert any(r.predicted_overhead > 0 for r in rows)  # the sweep does recompute somewhere
    for a, b in zip(rows, rows[1:]):
        assert b.predicted_overhead <= a.predicted_overhead, (name, a, b)


def _cand(peak: int, overhead: float) -> Plan:
    return Plan(f"p{peak}", [], Function("f", [], []), overhead, peak=peak)


def test_frontier_keeps_pareto_plans_and_picks_the_cheapest_that_fits():
    f = Frontier()
    for peak, over in [(100, 0.5), (120, 0.6), (150, 0.1), (130, 0.2), (90, 2.0)]:
        f.add(_cand(peak, over))
    assert [(c.peak, c.overhead) for c in f.plans] == [(90, 2.0), (100, 0.5), (130, 0.2), (150, 0.1)]
    assert f.best(89) is None and f.minimum() == 90
    assert f.best(125).peak == 100 and f.best(140).peak == 130 and f.best(10**6).peak == 150


def _plan(step, budget: int, **kw) -> Plan:
    return plan_step(dataclasses.replace(step.compilation.problem, budget=int(budget), **kw))


def _tiny(name: str):
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, example, loss_fn = zoo.make(name, "tiny", torch.float32, **kw)
    return remat.compile(model, example, loss_fn, milp_time_limit=1.0)


@pytest.mark.parametrize("name", ["gpt"])
def test_any_order_never_answers_costlier_than_an_earlier_smaller_budget(name):
    """Budgets planned in a shuffled order (the time-limited MILPs on): each answer costs no more
    than any answer given before it for a smaller or equal budget (the frontier keeps those plans)."""
    forget_plans()
    step = _tiny(name)
    budgets = default_budgets(step, 10)
    random.Random(12).shuffle(budgets)
    given: list[tuple[int, float]] = []
    for b in budgets:
        c = _plan(step, b)
        assert c.peak <= b
        for b0, o0 in given:
            if b0 <= b:
                assert c.overhead <= o0, (name, b, c.overhead, b0, o0)
        given.append((b, c.overhead))


@pytest.mark.parametrize("name", ["unet"])
def test_deterministic_planners_are_monotone_on_a_second_pass_in_any_order(name):
    """With deterministic planners only (``solver="greedy"``: the chain DP and the greedy), once every
    budget was planned, in any order, planning them again in any other order is monotone in the
    budget and never costlier than the first answer."""
    forget_plans()
    step = _tiny(name)
    budgets = default_budgets(step, 10)
    first_order, second_order = list(budgets), list(budgets)
    random.Random(1).shuffle(first_order)
    random.Random(2).shuffle(second_order)
    first = {b: _plan(step, b, solver="greedy").overhead for b in first_order}
    second = {b: _plan(step, b, solver="greedy").overhead for b in second_order}
    for b in budgets:
        assert second[b] <= first[b]
    for lo, hi in zip(budgets, budgets[1:]):
        assert second[hi] <= second[lo], (name, lo, hi, second)


def test_near_the_floor_the_milp_searches_the_greedys_neighbourhood_and_the_plan_stays_exact(monkeypatch):
    """At the minimum budget of the tiny U-Net the greedy recomputes much (+27%): the MILP searches
    its neighbourhood, the notes say which plan won and the MILP's status, and the winner's program
    is exact (measured == predicted <= budget) with outputs bit-identical to the unconstrained step's.
    (Block-internal plans are off here: with them the chain DP may win at the minimum, and the
    neighbourhood search, the subject of this test, does not run. The tiny GPT served here until its
    attention read [B, T, H, D] in place: its greedy plan at the minimum now recomputes +2%.)"""
    from remat.ir import Module
    from remat.plan import inner
    from remat.runtime.vm import VM

    monkeypatch.setattr(inner, "INNER_PLANS", False)
    forget_plans()
    step = _tiny("unet")
    b = minimum_budget(step)
    c = _plan(step, b)
    notes = "\n".join(c.notes)
    assert "MILP on its neighbourhood" in notes and f"won: {c.solver}" in notes
    assert any(f"status {s}" in notes for s in ("optimal", "time_limit", "infeasible")), notes
    args = step.binding.step_args(step.signature.example, copy=True, step=1)

    def run(program):
        return VM(Module([program]), dialects=step.dialects).run(program.name, *[a.clone() for a in args])

    want, _ = run(step.compilation.problem.unconstrained)
    got, stats = run(c.program)
    assert stats.peak_bytes == c.peak <= b
    assert len(got) == len(want) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(got, want))
