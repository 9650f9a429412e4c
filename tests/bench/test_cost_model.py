"""The cost-model benchmark (bench/cost_model.py) on the zoo ResNet tiny, one round: checked for structure
and for what it can check without timings: both cost models plan a step that fits (predicted peak ==
measured peak), the profiled one prices it by measurement, and the recomputation columns are what
they say (predicted: the report's; measured: the budgeted step less the unconstrained step)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cost_model  # noqa: E402


def test_one_round_on_the_tiny_resnet() -> None:
    rows = cost_model.bench_case(cost_model.Case("resnet", "resnet", "tiny"), "75%", rounds=1, warmup=1,
                                 log=lambda s: None)
    assert [r.cost_model for r in rows] == ["static", "profiled"]
    for r in rows:
        assert r.peak_ok and r.solver != "none"
        assert r.measured_recompute_s == pytest.approx(r.step_s - r.unconstrained_step_s)
        assert r.measured_overhead == pytest.approx(r.step_s / r.unconstrained_step_s - 1.0)
        assert r.measured_recompute_run_s == pytest.approx(r.run_s - r.unconstrained_run_s)
        assert 0 < r.run_s <= r.step_s  # the program's run is part of the step call
        assert r.predicted_recompute_s == pytest.approx(max(0.0, r.predicted_step_s - r.predicted_unconstrained_s))
    static, profiled = rows
    assert static.profile_s is None and static.measured_alone is None
    assert profiled.profile_s > 0 and profiled.measured_alone >= 0
