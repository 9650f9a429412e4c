"""The abstract graph, its validation, and the exact memory model (evaluate)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat.plan.graph import (BudgetTooSmall, Graph, eager_frees, make_plan, memory_profile, min_memory_lower_bound, no_remat_schedule, prune_compute_sequence, evaluate)
from remat.plan.record import ScheduleError, Solution
from graphgen import random_graph, synthetic_training_graph


def diamond() -> Graph:
    """x(8) -> a(4) -> c(2, ws 3) ; x -> b(6) -> c ; c is the output."""
    g = Graph()
    x = g.add_input("x", 8)
    a = g.add_node("a", 1.0, 4, [x])
    b = g.add_node("b", 2.0, 6, [x])
    g.add_node("c", 3.0, 2, [a, b], is_output=True, workspace=3)
    return g


def test_simulate_hand_computed_diamond():
    g = diamond()
    sched = no_remat_schedule(g)
    # x freed after b (its last use), a and b after c
    assert sched == [("compute", 1), ("compute", 2), ("free", 0), ("compute", 3), ("free", 1), ("free", 2)]
    cost, peak = evaluate(g, sched)
    assert cost == 6.0
    # start 8; a: 8+4=12; b: 12+6=18; free x -> 10; c: 10+2+3=15; frees -> 2
    assert memory_profile(g, sched) == [8, 12, 18, 10, 15, 8, 2]
    assert peak == 18


def test_simulate_remat_schedule_and_peak():
    # chain x -> a -> b -> c, and d reads (a, c): keeping a costs memory, recomputing costs time
    g = Graph()
    x = g.add_input("x", 1, is_output=True)  # pinned input
    a = g.add_node("a", 5.0, 10, [x])
    b = g.add_node("b", 1.0, 10, [a])
    c = g.add_node("c", 1.0, 10, [b])
    g.add_node("d", 1.0, 1, [a, c], is_output=True)
    keep = eager_frees(g, [1, 2, 3, 4])
    assert evaluate(g, keep) == (8.0, 31)  # during c: x + a + b + c = 31
    remat = eager_frees(g, [1, 2, 3, 1, 4])
    assert ("free", 1) in remat[: remat.index(("compute", 3))]
    cost, peak = evaluate(g, remat)
    assert cost == 13.0
    assert peak == 22  # during c: x + b + c = 21; during a's recompute: x + c + a = 21; during d: 1+10+10+1 = 22


def test_simulate_rejects_invalid_schedules():
    g = diamond()
    with pytest.raises(ScheduleError, match="not live"):
        evaluate(g, [("compute", 3)])
    with pytest.raises(ScheduleError, match="input node"):
        evaluate(g, [("compute", 0)])
    with pytest.raises(ScheduleError, match="already live"):
        evaluate(g, [("compute", 1), ("compute", 1)])
    with pytest.raises(ScheduleError, match="never computed"):
        evaluate(g, [("compute", 1)])
    with pytest.raises(ScheduleError, match="not live at the end"):
        evaluate(g, [("compute", 1), ("compute", 2), ("compute", 3), ("free", 3)])
    with pytest.raises(ScheduleError, match="freeing"):
        evaluate(g, [("free", 1)])
    with pytest.raises(ScheduleError, match="unknown step"):
        evaluate(g, [("run", 1)])
    g2 = Graph()
    x = g2.add_input("x", 1)
    r = g2.add_node("rand", 1.0, 1, [x], recomputable=False)
    g2.add_node("y", 1.0, 1, [r], is_output=True)
    with pytest.raises(ScheduleError, match="not recomputable"):
        evaluate(g2, [("compute", 1), ("free", 1), ("compute", 1), ("compute", 2)])


def test_validation_errors_name_the_node():
    g = Graph()
    g.add_input("x", 4)
    with pytest.raises(ValueError, match="'bad'.*earlier"):
        g.add_node("bad", 1.0, 4, [1])
    with pytest.raises(ValueError, match="'neg'.*cost"):
        g.add_node("neg", -1.0, 4, [0])
    with pytest.raises(ValueError, match="'frac'.*bytes"):
        g.add_node("frac", 1.0, 2.5, [0])
    with pytest.raises(ValueError, match="duplicate"):
        g.add_node("x", 1.0, 4, [0])
    with pytest.raises(ValueError, match="'ws'.*workspace"):
        g.add_node("ws", 1.0, 4, [0], workspace=-1)
    assert len(g) == 1  # failed adds leave the graph unchanged


def test_insert_frees_is_eager_and_prune_drops_useless_computes():
    g = diamond()
    # b computed twice, first instance unused -> pruned
    seq = prune_compute_sequence(g, [2, 1, 2, 3])
    assert seq == [1, 2, 3]
    # unused non-output input is freed at the very start
    g2 = Graph()
    g2.add_input("unused", 100)
    x = g2.add_input("x", 1)
    g2.add_node("y", 1.0, 1, [x], is_output=True)
    s = eager_frees(g2, [2])
    assert s[0] == ("free", 0)
    assert evaluate(g2, s)[1] == 101  # the start moment still counts


def test_plan_str_and_describe():
    g = diamond()
    plan = make_plan(g, [1, 2, 3], solver="test", status="exact", seconds=0.0, notes=["why"], budget=20)
    assert isinstance(plan, Solution)
    assert plan.peak == 18 and plan.cost == 6.0 and plan.overhead == 0.0
    assert "test" in str(plan) and "why" in plan.describe()


def test_budget_too_small_attributes():
    e = BudgetTooSmall(10, 20)
    assert isinstance(e, ValueError) and e.budget == 10 and e.minimum == 20


@pytest.mark.parametrize("kind", ["chain", "residual", "unet"])
def test_synthetic_training_graphs_are_valid(kind):
    g = synthetic_training_graph(kind, 5, seed=1)
    cost, peak = evaluate(g, no_remat_schedule(g))
    assert cost == pytest.approx(g.base_cost)
    assert min_memory_lower_bound(g) <= peak
    loss = g.index("loss")
    # most forward activations are saved for (read by) the backward pass
    cons = g.consumers
    fwd = [i for i in range(loss) if not g[i].is_input]
    saved = [i for i in fwd if any(c > loss for c in cons[i])]
    assert len(saved) >= len(fwd) // 2
    # parameter gradients are outputs, parameters are pinned inputs
    assert all(g[i].is_output for i in range(len(g)) if g[i].name.startswith("dW_"))
    assert all(g[i].is_input and g[i].is_output for i in range(len(g)) if g[i].name.startswith("W_"))


def test_lower_bound_is_valid_on_random_graphs():
    for seed in range(20):
        g = random_graph(10, seed, n_inputs=2, max_fanin=3, p_workspace=0.3)
        assert min_memory_lower_bound(g) <= evaluate(g, no_remat_schedule(g))[1]


def test_permuted_round_trip():
    g = diamond()
    g2, back = g.permuted([2, 1, 3])
    assert [g2[i].name for i in range(len(g2))] == ["x", "b", "a", "c"]
    assert back == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="topological"):
        g.permuted([3, 1, 2])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(3, 30), frac=st.floats(0.0, 1.0), prune=st.booleans(),
       extra=st.lists(st.integers(0, 29), max_size=6))
def test_make_plan_is_the_python_steps(seed, n, frac, prune, extra):
    """``make_plan`` runs compiled (``_schedule_kernels``): the schedule, cost and peak of
    ``prune_compute_sequence``, ``eager_frees`` and ``evaluate``, or the error they raise."""
    from remat.plan.greedy import greedy_compute_sequence

    g = random_graph(n, seed, n_inputs=1 + seed % 3, max_fanin=3, p_nonrecomputable=0.1, p_workspace=0.2)
    lo, hi = min_memory_lower_bound(g), evaluate(g, eager_frees(g, g.compute_nodes))[1]
    seq = greedy_compute_sequence(g, int(lo + frac * (hi - lo))) or g.compute_nodes
    for order in (seq, seq + [1 + e % (len(g) - 1) for e in extra]):  # the second is often not valid
        try:
            s = prune_compute_sequence(g, order) if prune else list(order)
            want = (eager_frees(g, s),) + evaluate(g, eager_frees(g, s))
        except Exception as e:
            with pytest.raises(type(e), match=re.escape(str(e))):
                make_plan(g, order, solver="t", status="t", seconds=0.0, prune=prune)
            continue
        got = make_plan(g, order, solver="t", status="t", seconds=0.0, prune=prune)
        assert (got.schedule, got.cost, got.peak) == want
