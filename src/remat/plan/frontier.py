"""A per-process cache of what planning a training step computed that does not depend on the
budget asked for, so planning the same step at another budget is faster and gives the same answer.

:func:`~.portfolio.plan_step`'s answer is a function of the step and the budget alone: the plans
made at each point of the step's ladder (:func:`~.portfolio.ladder_points`) and the MILP's search
around a given plan (:func:`~.milp.improve_in_windows`, bounded by node counts) are the same
whichever budget asked for them, so they are computed once per step and process and kept here
(:class:`PlanCache`), as are the last answers, plans and refusals, at the budgets asked for. Caches live in a small per-process table keyed by the step's printed program
and its costs (:func:`frontier_for`); :func:`forget_plans` empties it. A fresh process plans the
same, only slower.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

from ..ir import print_function
from .problem import StepProblem
from .record import Plan

MAX_STEPS = 8
"""Training steps whose caches the table keeps (least recently planned dropped first)."""


class PlanCache:
    """What planning one training step computed independently of the budget: ``ladder[g]``, the
    plans lowered at ladder point ``g`` (bytes), scored; :meth:`cached`, any other such result."""

    def __init__(self) -> None:
        self.ladder: dict[int, list[Plan]] = {}
        self._results: dict[Any, Any] = {}

    def cached(self, key: Any, compute: Callable[[], Any]) -> Any:
        """The result stored under ``key``, computed by ``compute()`` the first time. ``compute`` must
        be a function of the step and ``key`` alone (never of the budget being planned)."""
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]


_CACHE: OrderedDict[str, PlanCache] = OrderedDict()


def step_key(p: StepProblem) -> str:
    """A hash of what decides the plans of a step: its printed program (round-trips, so equal text
    means equal IR), the costs, the solver option, the step's extra bytes, whether peaks count
    kernel workspaces and the joint's workspaces (a dry run counts those it has not measured as 0:
    its plans are not a measured compile's)."""
    h = hashlib.sha256(print_function(p.unconstrained).encode())
    h.update(print_function(p.joint).encode())
    h.update(repr([p.costs.get(i) for b in p.joint.blocks for i in b.instrs]).encode())
    if p.workspaces is not None:
        h.update(repr([p.workspaces.get(i) for b in p.joint.blocks for i in b.instrs]).encode())
    h.update(repr((p.solver, p.milp_time_limit, p.extra_bytes, p.dialects, p.measured is not None,
                   p.workspace_fn is not None)).encode())  # with workspaces, peaks are allocator bounds
    return h.hexdigest()


def frontier_for(p: StepProblem) -> PlanCache:
    """The cache of this step in this process (a new one if none)."""
    key = step_key(p)
    f = _CACHE.pop(key, None) or PlanCache()
    _CACHE[key] = f
    while len(_CACHE) > MAX_STEPS:
        _CACHE.popitem(last=False)
    return f


def forget_plans() -> None:
    """Empty the cache (the answers stay the same; the next plans take as long as in a fresh process)."""
    _CACHE.clear()


__all__ = ["MAX_STEPS", "PlanCache", "forget_plans", "frontier_for", "step_key"]
