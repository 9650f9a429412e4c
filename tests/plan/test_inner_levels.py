"""Block-internal plans at several option levels (``portfolio._with_inner_plans``): a level whose
lower bound (its stages run once each) cannot beat the best plan found is skipped, which changes
no plan and compiles fewer schedules."""
from __future__ import annotations

import torch

import remat
import remat.plan.chain.planner as chain_planner
import remat.plan.portfolio as portfolio
from remat import zoo
from remat.plan.chain.profile import chain_costs
from remat.plan.frontier import forget_plans
from remat.plan.record import Plan

SLACK = portfolio.LEVEL_BOUND_SLACK


def _compile(monkeypatch, slack: float) -> tuple[str, int, list[tuple[float, float]]]:
    """Zoo ResNet small at half its peak (SGD with momentum, the greedy as graph solver), planned afresh: its program, the schedules compiled, and
    per level planned (lower bound, plan's overhead)."""
    monkeypatch.setattr(portfolio, "LEVEL_BOUND_SLACK", slack)
    calls, levels = [0], []
    compile_schedule, solve_chain = chain_planner.compile_schedule, portfolio._solve_chain

    def counted(*args, **kwargs):
        calls[0] += 1
        return compile_schedule(*args, **kwargs)

    def bounded(p, blocks, stages, profiles, what, t0, inner="", base=None, shared_inputs=False):
        r = solve_chain(p, blocks, stages, profiles, what, t0, inner, base, shared_inputs)
        if inner and isinstance(r, Plan):
            levels.append((chain_costs(profiles).no_recompute_cost() / base - 1.0, r.overhead))
        return r

    monkeypatch.setattr(chain_planner, "compile_schedule", counted)
    monkeypatch.setattr(portfolio, "_solve_chain", bounded)
    forget_plans()
    torch.manual_seed(0)
    model, ex, loss = zoo.make("resnet", "small")
    step = remat.compile(model, ex, loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         budget=0.5, count_workspaces=False, solver="greedy")
    forget_plans()
    return str(step.compilation.plan.program), calls[0], levels


def test_skipped_levels_change_no_plan_and_compile_fewer_schedules(monkeypatch):
    every, n_every, bounds = _compile(monkeypatch, float("inf"))
    assert bounds and all(overhead >= bound - 1e-12 for bound, overhead in bounds)  # the bound holds
    skipping, n_skipping, _ = _compile(monkeypatch, SLACK)
    assert skipping == every
    assert n_skipping < n_every
