"""The planning vocabulary: what every solver and every planner returns, and the one schedule error.

A solver works on a model of the step (the instruction :class:`~.graph.Graph`, or a chain's
per-stage :class:`~.chain.costs.ChainCosts`) and returns a :class:`Solution`: its schedule and what
that model predicts for it. A planner lowers a solution to IR and returns a :class:`Plan`: the
program, its exact peak and its overhead on one cost model (:mod:`.costmodel`). Budgets and peaks
are whole bytes, costs and times seconds, in both records.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import format_bytes
from ..ir import Function


class ScheduleError(ValueError):
    """A schedule breaks its model's rules (an input not live, a value computed twice, a leak, ...)."""


@dataclass
class Solution:
    """A solver's schedule and what its model predicts for it.

    ``schedule``: the model's steps (``("compute" | "free", node)`` on a graph, ``F``/``FT``/``B``/
    ``Free`` on a chain); ``cost``: the schedule's seconds in the model (base cost + recomputation);
    ``peak``: its exact peak bytes in the model; ``seconds``: wall seconds spent solving (model
    building included); ``status``: e.g. ``optimal``, ``time_limit_feasible``, ``heuristic``
    (empty when the solver states none); ``stats``: the solver's own numbers (the chain DP's
    ``dp_cost``, ``predicted_peak``, ``minimum_budget``, ...)."""

    solver: str
    schedule: list
    cost: float
    peak: int
    budget: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    status: str = ""
    base_cost: float | None = None  # the model's cost without recomputation
    # the solver's own objective (e.g. MILP model cost before pruning useless computes); ``cost``
    # (re-measured by the model) is never above it
    objective: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    model: str = "graph"            # the model that measured it: "graph", or a chain's "thesis" | "extended"
    bucket: int | str | None = None  # chain DP: bytes per memory unit ("exact": none)

    @property
    def overhead(self) -> float | None:
        """Recomputation cost as a fraction of the base cost (0.1 = +10%), or None without one."""
        if self.base_cost is None or self.base_cost <= 0:
            return None
        return self.cost / self.base_cost - 1.0

    @property
    def feasible(self) -> bool:
        """Whether the peak is within the budget (baselines such as ``sqrt`` ignore the budget)."""
        return self.budget is None or self.peak <= self.budget

    def __str__(self) -> str:
        ov = self.overhead
        ov_s = f" (+{100 * ov:.1f}% recompute)" if ov is not None else ""
        bud = "" if self.budget is None else \
            f" / budget {format_bytes(self.budget)} ({'feasible' if self.feasible else 'INFEASIBLE'})"
        status = f", {self.status}" if self.status else ""
        return (f"Solution[{self.solver}{status}] cost={self.cost:.6g}s{ov_s} peak={format_bytes(self.peak)}{bud} "
                f"model={self.model} steps={len(self.schedule)} solve={self.seconds:.3f}s")

    def describe(self) -> str:
        """Multi-line explanation: the record's line, why the solver ran and what it found, the schedule."""
        return "\n".join([str(self)] + [f"  - {n}" for n in self.notes] + [format_schedule(self.schedule)])


def format_schedule(schedule: Iterable, width: int = 100) -> str:
    """Wrap a schedule's steps into lines of at most ``width`` characters."""
    lines: list[str] = []
    cur = ""
    for s in schedule:
        tok = str(s)
        if cur and len(cur) + 1 + len(tok) > width:
            lines.append(cur)
            cur = tok
        else:
            cur = f"{cur} {tok}" if cur else tok
    if cur:
        lines.append(cur)
    return "\n".join(lines)


@dataclass
class Plan:
    """A planner's answer: the program it lowered to and what it predicts.

    ``solver``: e.g. ``"chain DP (extended)"``, ``"greedy (heuristic)"``, ``"none"``; ``program``: the
    function to run, rematerialised, with frees; ``overhead``: predicted recompute cost over the
    unconstrained compute cost on one cost model (0.1 = +10%); ``peak``: the bytes its fit is judged
    by (the VM's exact peak, or with workspaces counted the allocator bound); ``solution``: the
    solver's record it was lowered from (None: nothing was solved); ``seconds``: wall seconds spent
    planning."""

    solver: str
    notes: list[str]
    program: Function
    overhead: float
    solution: Solution | None = None
    peak: int | None = None
    budget: int | None = None
    seconds: float = 0.0
    algorithms: list[str] = field(default_factory=list)  # per-operator algorithm choices and why (plan.algorithms)
    unconstrained: Function | None = None  # the unconstrained step of a lean algorithm choice (None: the reference)

    def __str__(self) -> str:
        peak = "-" if self.peak is None else f"{format_bytes(self.peak)} ({self.peak} B)"
        budget = "none" if self.budget is None else format_bytes(self.budget)
        return (f"Plan[{self.solver}] budget {budget}, predicted peak {peak}, "
                f"predicted overhead {self.overhead:+.1%}")


__all__ = ["Plan", "ScheduleError", "Solution", "format_schedule"]
