"""A larger budget never gets a costlier plan, and the plan at a budget is the same whatever was
planned before (issues 12 and 46): sweeps of zoo training steps over budgets, fresh compiles of a
residual CNN, and the ladder of budgets that makes it so."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import remat
from remat import zoo
from remat.ir import print_function
from remat.plan.frontier import forget_plans
from remat.plan.portfolio import ladder_points, plan_step
from remat.plan.record import Plan
from remat.train.curve import budget_sweep, default_budgets, minimum_budget

from residual_cnn import residual_cnn


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


def test_the_ladder_depends_on_the_step_alone():
    """Every budget above a ladder point sees that point: the points are fractions of the
    unconstrained peak, never of the budget asked for."""
    top = 1_000_000
    assert ladder_points(top, top)[:3] == [top * 31 // 32, top * 30 // 32, top * 29 // 32]
    for b in (123_456, 500_000, 999_999):
        assert ladder_points(top, b) == [g for g in ladder_points(top, top) if g < b]


def _plan(step, budget: int, **kw) -> Plan:
    return plan_step(dataclasses.replace(step.compilation.problem, budget=int(budget), **kw))


def _tiny(name: str):
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, example, loss_fn = zoo.make(name, "tiny", torch.float32, **kw)
    return remat.compile(model, example, loss_fn, milp_time_limit=1.0)


def _same(a: Plan, b: Plan) -> bool:
    return a.overhead == b.overhead and a.peak == b.peak and print_function(a.program) == print_function(b.program)


@pytest.mark.parametrize("name", ["gpt", "unet"])
def test_the_plan_at_a_budget_is_the_same_whatever_was_planned_before(name, monkeypatch):
    """Planning b after other budgets (in any order, the MILPs on) gives the plan b alone gets in a
    fresh process with empty caches: what is cached across budgets (in the process, and the HiGHS
    solves on disk) only saves time."""
    forget_plans()
    step = _tiny(name)
    budgets = default_budgets(step, 6)[:-1]
    alone = {}
    monkeypatch.setenv("REMAT_SOLVE_CACHE", "0")
    for b in budgets:
        forget_plans()
        alone[b] = _plan(step, b)
    monkeypatch.setenv("REMAT_SOLVE_CACHE", "1")
    forget_plans()
    shuffled = list(budgets)
    random.Random(12).shuffle(shuffled)
    for b in shuffled:
        c = _plan(step, b)
        assert c.peak <= b and _same(c, alone[b]), (name, b, c.overhead, alone[b].overhead)
    for lo, hi in zip(budgets, budgets[1:]):
        assert alone[hi].overhead <= alone[lo].overhead, (name, lo, hi)


def test_a_budget_asked_again_gets_its_answer_again_without_planning(monkeypatch):
    """The answer at a budget asked before (a plan, or a refusal with its minimum) is given again
    as it was, each time a copy of its own: planning does not run (a planner that would fail shows
    it), the program is a fresh clone, and a refusal a caller changed does not change the next."""
    import remat.plan.portfolio as portfolio

    forget_plans()
    step = _tiny("gpt")
    lo, mid = default_budgets(step, 6)[:2]
    first = _plan(step, mid)
    with pytest.raises(remat.BudgetTooSmall) as refused:
        _plan(step, lo // 2)

    def planned_again(*args, **kwargs):
        raise AssertionError("planned again")
    monkeypatch.setattr(portfolio, "_plan_budget", planned_again)
    again = _plan(step, mid)
    assert _same(again, first) and again.program is not first.program and again.notes == first.notes
    refused.value.minimum = -1  # a caller's change to the error it got
    with pytest.raises(remat.BudgetTooSmall) as twice:
        _plan(step, lo // 2)
    assert twice.value is not refused.value and twice.value.minimum > 0 and str(twice.value) == str(refused.value)
    forget_plans()
    with pytest.raises(AssertionError, match="planned again"):
        _plan(step, mid)


def test_fresh_compiles_of_a_residual_cnn_are_monotone_in_the_budget():
    """Issue 46's reproducer: fresh compiles (an empty plan cache each) at 30/38/45/53% of the
    unconstrained peak; at 38% a time-limited MILP window used to win with +132% though the 30%
    plan fits. Predicted overhead never rises with the budget, and the program is exact (its peak
    as fitted counts kernel workspaces: ``plan.peak`` is the allocator bound)."""
    from remat.ir import Module
    from remat.plan.simulator import predict_peak
    from remat.runtime.vm import VM

    model, example, loss_fn = residual_cnn()
    peak = remat.compile(model, example, loss_fn).unconstrained_peak
    overheads = []
    for f in (0.30, 0.38, 0.45, 0.53):
        forget_plans()
        model, example, loss_fn = residual_cnn()
        step = remat.compile(model, example, loss_fn, budget=int(f * peak))
        plan = step.compilation.plan
        args = step.binding.step_args(step.signature.example, copy=True, step=1)
        _, stats = VM(Module([plan.program]), dialects=step.dialects).run(plan.program.name, *args)
        assert stats.peak_bytes == predict_peak(plan.program) and plan.peak <= int(f * peak)
        overheads.append(plan.overhead)
    assert all(b <= a for a, b in zip(overheads, overheads[1:])), overheads


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
    assert any(f"status {s}" in notes for s in ("optimal", "node_limit", "infeasible")), notes
    args = step.binding.step_args(step.signature.example, copy=True, step=1)

    def run(program):
        return VM(Module([program]), dialects=step.dialects).run(program.name, *[a.clone() for a in args])

    want, _ = run(step.compilation.problem.unconstrained)
    got, stats = run(c.program)
    assert stats.peak_bytes == c.peak <= b
    assert len(got) == len(want) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y)) for x, y in zip(got, want))
