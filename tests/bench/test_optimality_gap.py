"""The optimality-gap benchmark (bench/optimality_gap.py) on one small synthetic graph: the MILP proves
the optimum, and the portfolio's solvers are within the target of it (never below it, on one order)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import optimality_gap  # noqa: E402


def test_a_small_synthetic_graph_is_proven_and_within_the_target():
    (row,) = optimality_gap.graph_rows("residual-2", [0.6], time_limit=60.0)
    assert row["proven"] and row["milp_status"] == "optimal"
    assert -1e-9 <= row["gap"] <= optimality_gap.TARGET_GAP and row["within_target"]
