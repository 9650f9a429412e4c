"""Planning speaks one vocabulary, read from the source of ``remat.plan``: two plan records, one
schedule error, and no import cycle between its files (imports inside functions included)."""
from __future__ import annotations

import ast
import graphlib
import pathlib

PLAN = pathlib.Path(__file__).resolve().parents[2] / "src" / "remat" / "plan"


def _trees():
    for path in sorted(PLAN.rglob("*.py")):
        yield path.relative_to(PLAN.parent), ast.parse(path.read_text(), str(path))


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_two_plan_records_and_one_schedule_error():
    """A plan record states which solver made it and what it peaks at: only ``Solution`` (a solver's
    schedule in its model) and ``Plan`` (a lowered program) do."""
    classes = [(str(path), node) for path, tree in _trees() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    records = sorted(f"{p}:{c.name}" for p, c in classes if {"solver", "peak"} <= _fields(c))
    assert records == ["plan/record.py:Plan", "plan/record.py:Solution"], records
    errors = sorted(f"{p}:{c.name}" for p, c in classes if "schedule" in c.name.lower() and c.name.endswith("Error"))
    assert errors == ["plan/record.py:ScheduleError"], errors


def _imports(path: pathlib.Path, tree: ast.Module) -> set[str]:
    """Modules of ``remat.plan`` (as paths relative to src/remat) that a file imports anywhere but
    under ``if TYPE_CHECKING``."""
    typing_only = {id(m) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                   for m in ast.walk(n)}
    here = list(path.parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or id(node) in typing_only or not node.level:
            continue
        base = here[: len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        for name in [a.name for a in node.names] if node.module is None else [None]:
            parts = base + ([name] if name else [])
            for cand in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
                if (PLAN.parent / cand).exists() and cand.startswith("plan/") and cand != str(path):
                    out.add(cand)
    return out


def test_no_import_cycle_between_plan_files():
    edges = {str(path): _imports(path, tree) for path, tree in _trees()}
    try:
        list(graphlib.TopologicalSorter(edges).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_every_solver_states_its_minimum_budget():
    """One way to ask any registered solver for its minimum: ``Solver.minimum``, in its own model."""
    import pytest
    from graphgen import random_graph

    from remat.errors import BudgetTooSmall
    from remat.plan.chain.costs import ChainCosts
    from remat.plan.chain.solvers import solve
    from remat.plan.graph import min_memory_lower_bound
    from remat.plan.registry import SOLVERS

    assert all(s.minimum is not None for s in SOLVERS.values())
    g = random_graph(10, seed=1)
    order = g.compute_nodes
    exact, greedy = SOLVERS["milp"].minimum(g, order, 10.0), SOLVERS["greedy"].minimum(g, order, 10.0)
    assert min_memory_lower_bound(g) <= exact <= greedy
    costs = ChainCosts.random(6, seed=3, extended=True)
    m = SOLVERS["chain"].minimum(costs)
    assert solve(costs, m, "extended", bucket=1).peak <= m
    with pytest.raises(BudgetTooSmall):
        solve(costs, m - 1, "extended", bucket=1)
