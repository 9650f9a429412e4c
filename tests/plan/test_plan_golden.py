"""Regression: the plans ``remat.compile`` makes for the zoo models stay what they were.

For each zoo model (with AdamW) and budget (unconstrained, 50%, the minimum and halfway between), the golden file
``plans.golden.json`` records the solver, the predicted peak, the predicted overhead, the number of
recomputed instructions and a hash of the planned program's printed IR. A change that alters a plan
on purpose (a new op, a cheaper kernel) regenerates it with one command:

    REMAT_UPDATE_GOLDEN=1 PYTHONPATH=src python -m pytest -q tests/plan/test_plan_golden.py
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re

import pytest
import torch

import remat
from remat import zoo
from remat.ir import print_function
from remat.plan.frontier import forget_plans

GOLDEN = pathlib.Path(__file__).with_name("plans.golden.json")
UPDATE = os.environ.get("REMAT_UPDATE_GOLDEN") == "1"
CASES = [(name, "tiny") for name in ("mlp", "resnet", "gpt", "unet")] + [("mlp", "small")]


def _ir_hash(fn) -> str:
    """Hash of the printed program, without trailing comments (provenance, dialects are not plan)."""
    text = "\n".join(re.sub(r"\s*//.*$", "", line) for line in print_function(fn).splitlines())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plans(name: str, size: str) -> dict:
    """The plan records of one zoo model (AdamW) at each budget: none, 50%, halfway between the minimum and the unconstrained peak, the minimum."""
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, inputs, loss_fn = zoo.make(name, size, torch.float32, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def compile_at(budget):
        forget_plans()  # each entry is what a fresh process plans at that budget
        # The planner's own records (the VM's count), from deterministic solvers only: the
        # allocator-aware loop measures on this machine and a time-limited MILP's incumbent depends
        # on its speed, neither of which a golden file can hold (tests/train/test_allocator_budget.py
        # and tests/plan/test_graph_milp.py cover them).
        return remat.compile(model, inputs, loss_fn, optimizer=opt, budget=budget, count_workspaces=False,
                             solver="greedy")

    base = compile_at(None)
    try:
        compile_at(1)
        raise AssertionError("a 1-byte budget fitted")
    except remat.BudgetTooSmall as e:
        minimum = e.minimum
    budgets = {"None": None, "0.5": 0.5, "mid": (minimum + base.unconstrained_peak) // 2, "min": minimum}
    got = {}
    for key, budget in budgets.items():
        try:
            got[key] = _record(base if budget is None else compile_at(budget))
        except remat.BudgetTooSmall as e:  # an infeasible budget is part of the plan too
            got[key] = {"budget_too_small": e.minimum}
    return got


def _record(step) -> dict:
    r = step.report()
    return {"budget": r.budget, "solver": r.solver, "predicted_peak": r.predicted_peak,
            "unconstrained_peak": r.unconstrained_peak,
            "predicted_overhead": round(step.compilation.plan.overhead, 12),  # the planner's (over the joint's compute)
            "recomputed_instructions": r.recomputed_instructions, "ir": _ir_hash(step.program)}


def _load() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name,size", CASES)
def test_zoo_plans_match_golden(name, size):
    got = _plans(name, size)
    key = f"{name}/{size}"
    if UPDATE:
        data = _load()
        data[key] = got
        GOLDEN.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")
        return
    want = _load().get(key)
    assert want is not None, f"no golden plans for {key}; regenerate with REMAT_UPDATE_GOLDEN=1"
    for b in want:
        assert got[b] == want[b], f"{key} at budget {b}: plan changed\n got  {got[b]}\n want {want[b]}"
