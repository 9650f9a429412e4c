"""The plans already lowered for a training step, kept across budgets so a larger budget never gets
a costlier plan than a smaller one did.

Every candidate a planner lowers has an exact peak (``predict_peak`` of its program) and an
overhead on one cost model (:func:`.costmodel.program_overhead`), whichever planner made it. A
:class:`Frontier` keeps the Pareto-minimal ones in (peak, overhead); planning the same step at
another budget reuses any of them whose peak fits. Frontiers live in a small per-process cache
keyed by the step's printed program and its costs (:func:`frontier_for`); :func:`forget_plans`
empties it (a fresh process plans the same).

What is guaranteed, for one step in one process while its frontier is cached (the last
:data:`MAX_STEPS` steps planned):

1. An answer never costs more than any answer given before it for a smaller or equal budget,
   whatever the order of the budgets: that plan is in the frontier, or one that peaks no higher and
   costs no more. Budgets planned smallest first are therefore monotone.
2. An answer given before a smaller budget was planned may cost more than that smaller budget's
   answer (its plan was not known yet); planning the larger budget again returns the cheaper plan.
3. With deterministic planners only (``solver="greedy"``: the chain DP and the greedy), planning
   a set of budgets a second time, in any order, adds no plan, so the second answers are the
   frontier's cheapest fitting plans: monotone in the budget. The time-limited MILPs (``"auto"``,
   ``"milp"``) may find new plans on a second pass, so there only 1 and 2 hold.

A fresh process starts with an empty frontier: its answers depend on the budgets it planned before.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable

from ..ir import print_function
from .problem import StepProblem
from .record import Plan

MAX_STEPS = 8
"""Training steps whose frontiers the cache keeps (least recently planned dropped first)."""


class Frontier:
    """Lowered plans of one training step, Pareto-minimal in (exact peak bytes, overhead)."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []
        self.searched: list[Plan] = []  # plans whose neighbourhood the MILP already searched

    def add(self, cand: Plan) -> None:
        """Keep ``cand`` unless a kept plan peaks no higher and costs no more; drop those it beats."""
        for q in self.plans:
            if q.peak <= cand.peak and q.overhead <= cand.overhead:
                return
        self.plans = [q for q in self.plans if not (cand.peak <= q.peak and cand.overhead <= q.overhead)]
        self.plans.append(cand)
        self.plans.sort(key=lambda q: q.peak)

    def add_all(self, cands: Iterable[Plan]) -> None:
        for c in cands:
            self.add(c)

    def best(self, budget: int) -> Plan | None:
        """The cheapest kept plan whose peak fits ``budget`` (the lower peak on a tie), or None."""
        fits = [q for q in self.plans if q.peak <= budget]
        return min(fits, key=lambda q: (q.overhead, q.peak)) if fits else None

    def minimum(self) -> int | None:
        """The lowest peak of a kept plan (bytes), or None when none is kept."""
        return self.plans[0].peak if self.plans else None


_CACHE: OrderedDict[str, Frontier] = OrderedDict()


def step_key(p: StepProblem) -> str:
    """A hash of what decides the plans of a step: its printed program (round-trips, so equal text
    means equal IR), the costs, the solver option, the step's extra bytes and whether peaks count
    kernel workspaces."""
    h = hashlib.sha256(print_function(p.unconstrained).encode())
    h.update(print_function(p.joint).encode())
    h.update(repr([p.costs.get(i) for b in p.joint.blocks for i in b.instrs]).encode())
    h.update(repr((p.solver, p.milp_time_limit, p.extra_bytes, p.dialects, p.example_args is not None,
                   p.workspace_fn is not None)).encode())  # with workspaces, peaks are allocator bounds
    return h.hexdigest()


def frontier_for(p: StepProblem) -> Frontier:
    """The frontier of plans lowered so far for this step in this process (a new one if none)."""
    key = step_key(p)
    f = _CACHE.pop(key, None) or Frontier()
    _CACHE[key] = f
    while len(_CACHE) > MAX_STEPS:
        _CACHE.popitem(last=False)
    return f


def forget_plans() -> None:
    """Empty the cache: the next plans are those a fresh process makes."""
    _CACHE.clear()


__all__ = ["Frontier", "MAX_STEPS", "forget_plans", "frontier_for", "step_key"]
