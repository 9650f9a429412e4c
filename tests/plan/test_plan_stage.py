"""The plan stage on IR alone (no torch): a training joint built from IR text, planned under
budgets by ``plan_step``; and the MILP policy as a plain function."""
from __future__ import annotations

import pytest

from remat.errors import BudgetTooSmall
from remat.ir import parse
from remat.plan.graph import eager_frees, evaluate
from remat.plan.registry import graph_solver
from remat.plan.simulator import predict_peak
from remat.plan.milp import MILP_MAX_NODES
from remat.plan.portfolio import _also_tried, plan_step, uses_milp
from remat.plan.problem import StepProblem
from remat.plan.record import Plan
from remat.plan.costmodel import static_costs
from remat.step.program import Layout, cleanup, step_program, training_graph

DEPTH, WIDTH, BATCH = 6, 32, 64


def _forward_text() -> str:
    """A tanh MLP of DEPTH layers and a sum loss: ``(w0..w{DEPTH-1}, x) -> loss``."""
    ws = ", ".join(f"%w{k}: f32[{WIDTH},{WIDTH}]" for k in range(DEPTH))
    lines = [f"func @f({ws}, %x: f32[{BATCH},{WIDTH}]) -> f32[] {{"]
    h = "%x"
    for k in range(DEPTH):
        lines += [f"  %m{k} = matmul {h}, %w{k} : f32[{BATCH},{WIDTH}]", f"  %h{k} = tanh %m{k} : f32[{BATCH},{WIDTH}]"]
        h = f"%h{k}"
    lines += [f"  %l = reduce_sum {h} {{axes=[0, 1]}} : f32[]", "  return %l", "}"]
    return "\n".join(lines) + "\n"


def _problem(budget: int | None) -> StepProblem:
    forward = parse(_forward_text())["f"]
    joint = cleanup(training_graph(forward, DEPTH))
    layout = Layout(DEPTH, DEPTH, 1, False, 0)

    def finish(fn):
        return step_program(fn, layout, None, [], keep_grads=True, check=False)

    return StepProblem(forward, DEPTH, DEPTH, joint, finish(joint), budget, finish, 0, static_costs(joint))


def test_plan_stage_on_ir_alone():
    base = _problem(None)
    peak = predict_peak(base.unconstrained)
    none = plan_step(base)
    assert isinstance(none, Plan) and none.solver == "none" and none.overhead == 0.0
    assert none.program is base.unconstrained
    with pytest.raises(BudgetTooSmall) as e:
        plan_step(_problem(1))
    minimum = e.value.minimum
    assert 0 < minimum < peak
    tight = plan_step(_problem(minimum))
    assert tight.solver != "none" and tight.overhead > 0
    assert predict_peak(tight.program) <= minimum


def test_unknown_solver_is_named():
    p = _problem(None)
    p.solver = "magic"
    with pytest.raises(ValueError, match="valid: auto, greedy, milp"):
        plan_step(p)


def test_milp_policy():
    assert uses_milp("milp", 10 * MILP_MAX_NODES)
    assert uses_milp("auto", MILP_MAX_NODES) and not uses_milp("auto", MILP_MAX_NODES + 1)
    assert not uses_milp("greedy", 1)


def test_registry_picks_the_solver_of_each_probe():
    from remat.plan.registry import SOLVERS, graph_solver

    milp, greedy = SOLVERS["milp"], SOLVERS["greedy"]
    small, large = MILP_MAX_NODES, MILP_MAX_NODES + 1
    assert graph_solver("auto", small, main=True) is milp.solve_auto
    assert graph_solver("auto", large, main=True) is greedy.solve
    assert graph_solver("auto", small, main=False) is greedy.solve
    assert graph_solver("milp", large, main=True) is milp.solve
    assert graph_solver("milp", small, main=False) is greedy.solve
    assert graph_solver("greedy", small, main=True) is greedy.solve
    assert {s.plans for s in SOLVERS.values()} == {"chain", "graph"}


def test_whole_graph_milp_runs_once_per_step_under_auto(monkeypatch):
    # Under "auto" the MILP's time limit bounds the step's planning: it runs on the first of the
    # memory-aware orders only (two here; it ran on each, 2 x 10 s for nothing on ConvNeXt tiny).
    import remat.plan.milp as milp
    import remat.plan.scheduling as scheduling

    monkeypatch.setattr(milp, "MILP_MAX_VARS", None)  # this step's MILP is larger than "auto" solves
    calls = []
    solve = milp.solve_milp
    monkeypatch.setattr(milp, "solve_milp", lambda *a, **k: calls.append(1) or solve(*a, **k))
    orders = scheduling.memory_aware_orders
    monkeypatch.setattr(scheduling, "memory_aware_orders", lambda g, *a, **k: orders(g, *a, **k) * 2)
    p = _problem(None)
    p = _problem(int(predict_peak(p.unconstrained) * 0.9))
    p.milp_time_limit = 1.0
    assert p.solver == "auto" and len(list(p.joint.instructions())) <= MILP_MAX_NODES  # the MILP is admitted
    plan_step(p)
    assert len(calls) == 1


def test_whole_graph_milp_under_auto_skips_a_model_over_its_size_and_says_so(monkeypatch):
    """Under "auto" a whole-graph MILP of more than ``MILP_MAX_VARS`` variables is not solved (its
    root node alone outlasts the time limit): the greedy's plan, with a note saying why."""
    import remat.plan.milp as milp
    from remat.plan.rematerialize import to_graph
    from remat.plan.scheduling import memory_aware_order

    p = _problem(None)
    p = _problem(int(predict_peak(p.unconstrained) * 0.9))
    g = to_graph(p.joint, p.costs).graph
    order = memory_aware_order(g)
    budget = int(0.9 * max(evaluate(g, eager_frees(g, order))[1], 1))
    calls = []
    solve = milp.solve_milp
    monkeypatch.setattr(milp, "solve_milp", lambda *a, **k: calls.append(1) or solve(*a, **k))
    n_vars = milp._build(g.permuted(order)[0], budget, budget / 1000.0).n_vars
    monkeypatch.setattr(milp, "MILP_MAX_VARS", n_vars - 1)
    plan = graph_solver("auto", len(g.compute_nodes), main=True)(g, budget, order, 10.0)
    assert not calls and plan.solver == "greedy"
    assert f"its model has more than max_vars={n_vars - 1} variables" in plan.describe()
    monkeypatch.setattr(milp, "MILP_MAX_VARS", n_vars)
    graph_solver("auto", len(g.compute_nodes), main=True)(g, budget, order, 0.5)  # called (its answer is not the point)
    assert calls


def test_the_notes_name_each_losing_plan_once_with_its_peak():
    """A plan is told apart by solver, predicted overhead and peak; alike plans (one solver's answer
    from several schedules) are counted in one note, not repeated."""
    forward = parse(_forward_text())["f"]
    plans = [Plan("chain DP (extended)", [], forward, 0.181, peak=453_939),
             Plan("chain DP (extended)", [], forward, 0.181, peak=453_939),
             Plan("greedy (heuristic)", [], forward, 0.181, peak=400_000)]
    assert _also_tried(plans) == [
        "also tried chain DP (extended) (2 plans alike): predicted overhead +18.1% at a peak of 443.30 KiB",
        "also tried greedy (heuristic): predicted overhead +18.1% at a peak of 390.62 KiB"]
    with pytest.raises(BudgetTooSmall) as e:
        plan_step(_problem(1))
    tight = plan_step(_problem(e.value.minimum + (predict_peak(_problem(None).unconstrained) - e.value.minimum) // 3))
    tried = [n for n in tight.notes if n.startswith("also tried")]
    assert len(tried) >= 2 and len(tried) == len(set(tried)) and all(" at a peak of " in n for n in tried)
