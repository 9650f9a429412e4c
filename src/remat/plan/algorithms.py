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
fits the budget, and every choice is reported (:attr:`Plan.algorithms`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import BudgetTooSmall, format_bytes
from .costmodel import CostModel
from .simulator import predict_peak
from .portfolio import plan_step, sharing_block_recipes
from .problem import StepProblem, fit_peak
from .record import Plan


@dataclass
class Variant:
    """A step whose forward uses memory-lean algorithms: one line per rewritten site (op, where,
    sizes) and its planning problem (any budget; the chooser sets it). The problem is built by
    ``make`` on first use: differentiating the variant costs a training graph, needed only when the
    reference algorithms do not fit."""

    sites: list[str]
    make: Callable[[], StepProblem]
    exact: bool = False
    """Its values are the reference's, bit for bit (a kernel computing over slices of the batch):
    planned beside the reference whenever the budget binds, and chosen when its plan is cheaper."""
    _problem: StepProblem | None = field(default=None, repr=False)

    @property
    def problem(self) -> StepProblem:
        if self._problem is None:
            self._problem = self.make()
        return self._problem


VariantBuilder = Callable[[StepProblem], "list[Variant]"]
"""Given the reference problem (its budget and workspaces), the lean variants (their problems built on
first use) in order of preference: the faster first, the leaner later (e.g. a batch-tiled op in tiles
large enough to run fast, then in smaller ones); empty when no op of the step has a lean alternative."""


def against_reference(p: StepProblem, q: StepProblem, alt: Plan) -> tuple[float, float]:
    """The overhead of ``alt`` (planned on the lean variant ``q``) against the reference problem
    ``p``'s unconstrained step, and the lean variant's own part of it (its unconstrained step over
    the reference's): both on one cost model, each instruction priced by its problem's costs, so
    that a plan's predicted overhead compares with the measured one (step time over the
    unconstrained step's) whichever algorithms it runs."""
    ref = CostModel(p.costs)
    both = CostModel({**q.costs, **p.costs}, p.measured)
    if ref.base <= 0:
        return alt.overhead, 0.0
    base = both.program_cost(p.unconstrained)
    return (max(0.0, (both.program_cost(alt.program) - base) / ref.base),
            (both.program_cost(q.unconstrained) - base) / ref.base)


def plan_choosing_algorithms(p: StepProblem, lean: VariantBuilder | None) -> Plan:
    """The reference plan when one fits ``p.budget``, else the first lean variant's plan that fits.

    Without a budget, or when the unconstrained reference step fits, this is ``plan_step(p)``: no
    recomputation and the reference algorithms. Otherwise the reference is planned first (kept when it
    fits: gradients stay bit-identical), then each lean variant in order; a budget none fits raises
    ``BudgetTooSmall`` with the smallest of their minimums. The result's ``algorithms`` says what was
    chosen and why (bytes saved, and the minimums of the variants tried before it). The steps it
    plans share their block recipes (:func:`~.portfolio.sharing_block_recipes`): the reference and
    its lean variants hold many of the same blocks."""
    with sharing_block_recipes():
        return _choose(p, lean)


def _said(plan: Plan, lines: list[str], **changes) -> Plan:
    """``plan`` (with ``changes``) with algorithm-choice ``lines`` added to its ``algorithms`` and notes."""
    return replace(plan, algorithms=plan.algorithms + lines, notes=plan.notes + [f"algorithm choice: {c}" for c in lines],
                   **changes)


def _exact_or_reference(p: StepProblem, v: Variant, ref: Plan | None, ref_min: int | None
                        ) -> tuple[Plan | None, int | None]:
    """The reference's plan (or minimum) and the exact variant ``v``'s, whichever is cheaper (its
    overhead against the reference's unconstrained step), or fits: (plan or None, the smaller
    minimum when none fits). Planned at every budget that binds, not only near the floor, so that a
    larger budget never loses the cheaper plan a smaller one found. The choice is said in the
    plan's ``algorithms`` and notes."""
    q = replace(v.problem, budget=p.budget)
    try:
        alt = plan_step(q)
    except BudgetTooSmall as e:
        if ref is None:
            return None, min(ref_min, e.minimum)
        line = [f"{s}: not chosen; with it the step needs at least {format_bytes(e.minimum)}" for s in v.sites]
        return _said(ref, line), ref_min
    overhead, dispatch = against_reference(p, q, alt)
    if ref is not None and ref.overhead <= overhead:
        line = [f"{s}: not chosen; predicted overhead {overhead:+.1%} with it, {ref.overhead:+.1%} without" for s in v.sites]
        return _said(ref, line), ref_min
    why = (f"the reference algorithms need at least {format_bytes(ref_min)}, over the budget" if ref is None else
           f"predicted overhead {overhead:+.1%} with it ({dispatch:+.1%} of it the slices' dispatch), "
           f"{ref.overhead:+.1%} without")
    line = [f"{s}: chosen; the same values as the reference (each batch element is computed alone either way); "
            f"{why}" for s in v.sites]
    return _said(alt, line, overhead=overhead, unconstrained=q.unconstrained), ref_min


def _choose(p: StepProblem, lean: VariantBuilder | None) -> Plan:
    """:func:`plan_choosing_algorithms`' choice, its steps' block recipes shared."""
    if lean is None or p.budget is None or fit_peak(p, p.unconstrained) <= p.budget:
        # (the peak a plan must keep within the budget: with workspaces counted, the allocator
        # bound; the VM's count alone fitting is not enough, or a minimum reached with the lean
        # algorithms would be refused when asked for again)
        return plan_step(p)
    ref: Plan | None = None
    ref_min: int | None = None
    try:
        ref = plan_step(p)
    except BudgetTooSmall as e:
        ref_min = e.minimum
    variants = lean(p)
    exact = [v for v in variants if v.exact]
    variants = [v for v in variants if not v.exact]
    for v in exact:
        ref, ref_min = _exact_or_reference(p, v, ref, ref_min)
    if not variants:
        if ref is None:
            raise BudgetTooSmall(p.budget, ref_min, "this training step")
        return ref
    if ref is not None:
        # The reference algorithms fit: keep them, so that gradients stay bit-identical to the
        # unconstrained step under every budget the reference can meet.
        choice = [f"{s}: not chosen; the reference algorithms fit the budget (gradients stay bit-identical to "
                  f"the unconstrained step)" for s in variants[0].sites]
        return _said(ref, choice)
    tried: list[tuple[Variant, int]] = []  # (variant, its minimum): none fitted so far
    for variant in variants:
        q = replace(variant.problem, budget=p.budget)
        try:
            alt = plan_step(q)
        except BudgetTooSmall as e:
            tried.append((variant, e.minimum))
            continue
        ref_peak, alt_peak = predict_peak(p.unconstrained), predict_peak(q.unconstrained)
        why = (f"unconstrained peak {format_bytes(ref_peak)} -> {format_bytes(alt_peak)} "
               f"({format_bytes(ref_peak - alt_peak)} saved); the reference algorithms need at least "
               f"{format_bytes(ref_min)}, over the budget")
        choice = [f"{s}: chosen; {why}" for s in variant.sites]
        choice += [f"{s}: not chosen; with it the step needs at least {format_bytes(m)}, over the budget"
                   for v, m in tried for s in v.sites if s not in variant.sites]
        overhead, lean = against_reference(p, q, alt)
        cost = (f"predicted overhead {overhead:+.1%} against the reference algorithms' unconstrained step: the lean "
                f"algorithms {lean:+.1%}, recomputation {alt.overhead:+.1%} of the lean step")
        return replace(alt, overhead=overhead, algorithms=choice, unconstrained=q.unconstrained,
                       notes=alt.notes + [f"algorithm choice: {c}" for c in choice] + [f"algorithm choice: {cost}"])
    leanest, lean_min = min(tried, key=lambda t: t[1])
    best = min(lean_min, ref_min)
    if lean_min < ref_min:
        # The lean variant's minimum: check that it plans (its minimum search can miss the chunk
        # buffers' workspaces), so that the minimum a user is told is a budget that plans.
        q = replace(leanest.problem, budget=p.budget)
        for _ in range(3):
            try:
                plan_step(replace(q, budget=best))
                break
            except BudgetTooSmall as e:
                best = ref_min if e.minimum <= best else min(e.minimum, ref_min)
                if best == ref_min:
                    break
    raise BudgetTooSmall(p.budget, best, "this training step",
                         detail="with the reference algorithms and with " + "; ".join(leanest.sites))
