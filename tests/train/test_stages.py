"""``remat.compile`` as named stages: each timed in the report, printable after it, and the
report's measured overhead honest (0 when nothing is recomputed, None without a measurement)."""
from __future__ import annotations

import copy

import pytest

import remat
from remat.train.api import STAGES
from _train_util import make


def test_print_after_plan_prints_the_planned_step(capsys):
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn, print_after="plan")
    out = capsys.readouterr().out
    assert "// ---- after plan" in out and "func @train_step(" in out
    assert set(step.report().stage_seconds) == set(STAGES) - {"profile"}


def test_print_after_rejects_unknown_stage():
    model, inputs, loss_fn = make("mlp")
    with pytest.raises(ValueError, match="unknown stage.*stages: capture"):
        remat.compile(model, inputs, loss_fn, print_after="plann")


@pytest.mark.parametrize("cost_model", ["static", "profiled"])
def test_overhead_is_zero_when_nothing_is_recomputed(cost_model):
    model, inputs, loss_fn = make("mlp")
    step = remat.compile(model, inputs, loss_fn, cost_model=cost_model)
    step(*inputs)
    r = step.report()
    assert r.solver == "none" and r.recomputed_instructions == 0
    assert r.overhead == 0.0 and r.predicted_overhead == 0.0
    assert ("profile" in r.stage_seconds) == (cost_model == "profiled")


def test_profiled_overhead_compares_step_programs():
    """With measurements, the overhead compares the budgeted step with the unconstrained step
    program (both with the same updates), never the step with a joint lacking them."""
    from _train_util import make_deep_mlp

    model, inputs, loss_fn = make_deep_mlp()
    step = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=0.5, cost_model="profiled")
    step(*inputs)
    r = step.report()
    assert r.recomputed_instructions > 0 and r.unconstrained_step_seconds > 0
    assert r.overhead == pytest.approx(r.step_seconds / r.unconstrained_step_seconds - 1.0)
