"""Per-operator algorithm choice (issue 10; thesis §5.4.2): plan the step with the reference
algorithms, and with memory-lean alternatives only where no reference plan fits the budget.

An alternative is a whole-step variant whose forward had some ops rewritten to a memory-lean
algorithm before differentiation (today: the head's ``matmul -> log_softmax -> nll_loss`` as the
chunked ``linear_cross_entropy``, :mod:`remat.passes.crossentropy`; attention with dropout on its
probabilities as ``dropout_attention``, one score matrix at a time with the keep mask replayed from
its seed, :func:`remat.passes.attention.recognise_dropout_attention`; a convolution over a channel
concatenation as one convolution per input, summed, :func:`remat.passes.concatconv.split_concat_conv`;
and, after differentiation, each
training batch norm's backward as a reduction and an element-wise grad_x, without the unused
input-sized buffer ATen's kernel allocates, :func:`remat.passes.batchnorm.split_batch_norm_grad`). Its planning problem is built
on demand by the caller (differentiating and building a step program sit above this package), once
per step.

Exactness: under one algorithm choice, gradients are bit-identical across budgets (recomputation
replays the same kernels). The lean variant's values equal the reference's up to summation order
(its weight gradient is summed chunk by chunk; attention's probabilities come from a logsumexp), so the reference is kept whenever a reference plan
fits the budget, and every choice is reported (:attr:`Candidate.algorithms`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import BudgetTooSmall, format_bytes
from .liveness import predict_peak
from .portfolio import Candidate, StepProblem, fit_peak, plan_step


@dataclass
class Variant:
    """A step whose forward uses memory-lean algorithms: one line per rewritten site (op, where,
    sizes) and its planning problem (any budget; the chooser sets it). The problem is built by
    ``make`` on first use: differentiating the variant costs a training graph, needed only when the
    reference algorithms do not fit."""

    sites: list[str]
    make: Callable[[], StepProblem]
    _problem: StepProblem | None = field(default=None, repr=False)

    @property
    def problem(self) -> StepProblem:
        if self._problem is None:
            self._problem = self.make()
        return self._problem


VariantBuilder = Callable[[StepProblem], "Variant | None"]
"""Given the reference problem (its budget and workspaces), the lean variant (its problem built on
first use), or None when no op of the step has a lean alternative."""


def plan_choosing_algorithms(p: StepProblem, lean: VariantBuilder | None) -> Candidate:
    """The reference plan when one fits ``p.budget``, else the lean variant's plan.

    Without a budget, or when the unconstrained reference step fits, this is ``plan_step(p)``: no
    recomputation and the reference algorithms. Otherwise the reference is planned first (kept when it
    fits: gradients stay bit-identical), then the lean variant; a budget neither fits raises
    ``BudgetTooSmall`` with the smaller of their minimums. The result's ``algorithms`` says what was
    chosen and why (bytes saved)."""
    if lean is None or p.budget is None or fit_peak(p, p.unconstrained) <= p.budget:
        # (the peak a plan must keep within the budget: with workspaces counted, the allocator
        # bound; the VM's count alone fitting is not enough, or a minimum reached with the lean
        # algorithms would be refused when asked for again)
        return plan_step(p)
    ref: Candidate | None = None
    minimums: list[int] = []
    try:
        ref = plan_step(p)
    except BudgetTooSmall as e:
        minimums.append(e.minimum)
    variant = lean(p)
    if variant is None:
        if ref is None:
            raise BudgetTooSmall(p.budget, minimums[0], "this training step")
        return ref
    if ref is not None:
        # The reference algorithms fit: keep them, so that gradients stay bit-identical to the
        # unconstrained step under every budget the reference can meet.
        choice = [f"{s}: not chosen; the reference algorithms fit the budget (gradients stay bit-identical to "
                  f"the unconstrained step)" for s in variant.sites]
        return replace(ref, algorithms=choice, notes=ref.notes + [f"algorithm choice: {c}" for c in choice])
    q = replace(variant.problem, budget=p.budget)
    alt: Candidate | None = None  # the reference cannot fit from here on
    try:
        alt = plan_step(q)
    except BudgetTooSmall as e:
        minimums.append(e.minimum)
    if alt is None:
        best = min(minimums)
        if len(minimums) == 2 and minimums[1] < minimums[0]:
            # The lean variant's minimum: check that it plans (its minimum search can miss the chunk
            # buffers' workspaces), so that the minimum a user is told is a budget that plans.
            for _ in range(3):
                try:
                    plan_step(replace(q, budget=best))
                    break
                except BudgetTooSmall as e:
                    best = minimums[0] if e.minimum <= best else min(e.minimum, minimums[0])
                    if best == minimums[0]:
                        break
        raise BudgetTooSmall(p.budget, best, "this training step",
                             detail="with the reference algorithms and with " + "; ".join(variant.sites))
    ref_peak, alt_peak = predict_peak(p.unconstrained), predict_peak(q.unconstrained)
    why = (f"unconstrained peak {format_bytes(ref_peak)} -> {format_bytes(alt_peak)} "
           f"({format_bytes(ref_peak - alt_peak)} saved); the reference algorithms need at least "
           f"{format_bytes(minimums[0])}, over the budget")
    choice = [f"{s}: chosen; {why}" for s in variant.sites]
    return replace(alt, algorithms=choice, unconstrained=q.unconstrained,
                   notes=alt.notes + [f"algorithm choice: {c}" for c in choice])
