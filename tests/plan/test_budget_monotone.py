"""A larger budget never gets a costlier plan (issue 12): sweeps of zoo training steps over budgets,
and the frontier of lowered plans that makes it so."""
from __future__ import annotations

import time

import pytest
import torch

import remat
from remat import zoo
from remat.ir import Function
from remat.plan.frontier import Frontier, forget_plans
from remat.plan.portfolio import Candidate
from remat.train.curve import budget_sweep, default_budgets


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


def _cand(peak: int, overhead: float) -> Candidate:
    return Candidate(f"p{peak}", [], Function("f", [], []), overhead, peak=peak)


def test_frontier_keeps_pareto_plans_and_picks_the_cheapest_that_fits():
    f = Frontier()
    for peak, over in [(100, 0.5), (120, 0.6), (150, 0.1), (130, 0.2), (90, 2.0)]:
        f.add(_cand(peak, over))
    assert [(c.peak, c.overhead) for c in f.plans] == [(90, 2.0), (100, 0.5), (130, 0.2), (150, 0.1)]
    assert f.best(89) is None and f.minimum() == 90
    assert f.best(125).peak == 100 and f.best(140).peak == 130 and f.best(10**6).peak == 150
