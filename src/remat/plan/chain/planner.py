"""Fit a chain plan to a byte budget, measured on the compiled program.

The chain cost model leaves out what the executor adds around it (parameters, their gradients,
the caller's tensors), so the model budget handed to the solver is searched by bisection for the
largest one whose compiled program's exact predicted peak fits the budget.
"""
from __future__ import annotations

from ...errors import BudgetTooSmall
from ...ir import Module
from ..record import Plan, Solution
from .costs import ChainCosts
from .executor import ChainStage, compile_schedule

EXACT_METHODS = ("precise", "extended")


class ChainPlanner:
    """Solve, compile and budget-fit plans for one chain of stages with fixed costs."""

    def __init__(self, stages: list[ChainStage], costs: ChainCosts, name: str = "chain_step",
                 upstream_is_param: bool = True, return_output: bool = False, what: str = "",
                 binding=None, finish=None, peak_fn=None):
        """``binding``: a general layout (see ``executor.Binding``); ``finish``: maps the compiled
        chain function to the function whose peak must fit (e.g. a training step around it). With a
        ``finish`` the probed programs are not verified here: the caller verifies the one it keeps.
        ``peak_fn``: the bytes of a compiled function that must fit the budget (default: the VM's
        exact peak, ``predict_peak``; a training step counting kernel workspaces passes its
        allocator bound), so a refusal's minimum is one this planner can meet."""
        self.stages, self.costs, self.name = stages, costs, name
        self.upstream_is_param, self.return_output = upstream_is_param, return_output
        self.binding, self.finish, self.peak_fn = binding, finish, peak_fn
        self.what = what or f"this {len(stages)}-stage chain"
        self._compiled: dict = {}
        self._tables: dict = {}  # the extended DP's tables, kept across budgets (read at every smaller one)

    def compile(self, solution: Solution, budget: int) -> Plan:
        """``solution`` compiled into a program (once per schedule), with the program's exact peak."""
        from ..simulator import predict_peak

        key = tuple(solution.schedule)
        if key not in self._compiled:
            prog = compile_schedule(self.stages, list(solution.schedule), name=self.name,
                                    upstream_is_param=self.upstream_is_param, return_output=self.return_output,
                                    binding=self.binding, check=self.finish is None)
            if self.finish is not None:
                prog = Module([self.finish(prog[self.name])])
            fn = next(iter(prog))
            self._compiled[key] = (prog, (self.peak_fn or predict_peak)(fn))
        prog, peak = self._compiled[key]
        kind = "DP" if solution.solver in EXACT_METHODS else "baseline"
        return Plan(f"chain {kind} ({solution.solver})", list(solution.notes), next(iter(prog)), solution.overhead or 0.0,
                    solution, peak, budget, solution.seconds)

    def default_bucket(self) -> int:
        from .solvers import no_recompute_peak

        return max(1, int(no_recompute_peak(self.costs, "extended")) // 4000)

    def solve(self, budget: int, method: str = "extended", bucket=None, baseline: int = 0) -> Plan:
        """The least-compute plan whose program peaks within ``budget`` bytes, or BudgetTooSmall
        with the minimum. Baselines ("uniform", "sqrt", "none") get ``budget - baseline`` once."""
        from .solvers import minimum_budget, no_recompute_peak, solve

        bucket = self.default_bucket() if bucket is None else bucket
        what = f"{self.what} ({method})"
        if method not in EXACT_METHODS:
            plan = self.compile(solve(self.costs, max(budget - baseline, 0), method=method, bucket=bucket), budget)
            if plan.peak > budget:
                raise BudgetTooSmall(budget, plan.peak, f"{what}, whose plan ignores the budget")
            return plan

        tables = self._tables  # the DP's tables, solved once at the widest budget and read at every probe

        def attempt(m: int) -> Plan:
            return self.compile(solve(self.costs, m, method=method, bucket=bucket, tables=tables), budget)

        lo = minimum_budget(self.costs, bucket=bucket, method=method)
        best = attempt(lo)
        if best.peak > budget:
            raise BudgetTooSmall(budget, best.peak, what)
        hi = max(int(no_recompute_peak(self.costs, "extended")), lo)
        top = attempt(hi)  # the widest table: every probe below reads it
        if top.peak <= budget:
            return top
        if method == "extended" and isinstance(bucket, int):
            return self._search_levels(budget, lo, hi, bucket, tables, best)
        step = bucket if isinstance(bucket, int) else 1
        while hi - lo > step:  # invariant: the plan at lo fits, the plan at hi does not
            mid = (lo + hi) // 2
            p = attempt(mid)
            if p.peak <= budget:
                lo, best = mid, (p if p.solution.cost <= best.solution.cost else best)
            else:
                hi = mid
        return best

    def _search_levels(self, budget: int, lo: int, hi: int, bucket: int, tables: dict, best: Plan) -> Plan:
        """The cheapest of the DP's distinct plans between ``lo`` (fits) and ``hi`` (does not) whose
        program fits ``budget``, compiling few of them: the program adds a nearly constant number of
        bytes to the model's peak, so the last probe's excess predicts which plan fits; that guess and
        its neighbour are tried, then bisection over the plans takes over. Where fitting is monotone
        in the plans' order this is the boundary a bisection over budgets finds, in fewer compilations."""
        from .solvers import extended_levels, solve

        levels = extended_levels(self.costs, lo, hi, bucket, tables)
        plans: dict[int, Plan] = {}

        def probe(k: int) -> Plan:
            if k not in plans:
                plans[k] = self.compile(solve(self.costs, levels[k][0], method="extended", bucket=bucket,
                                              tables=tables), budget)
            return plans[k]

        a, b = 0, len(levels)  # invariant: plan a fits (the minimum's), plan b (the top's) does not
        last = best
        guesses = 2
        while b - a > 1:
            if guesses:
                guesses -= 1
                excess = last.peak - last.solution.stats["predicted_peak"]  # bytes the program adds to the model
                k = max((j for j in range(a + 1, b) if levels[j][1] + excess <= budget), default=a + 1)
            else:
                k = (a + b) // 2
            last = probe(k)
            if last.peak <= budget:
                a = k
                best = last if last.solution.cost <= best.solution.cost else best
            else:
                b = k
        return best

    def minimum(self, method: str = "extended", bucket=None) -> int:
        """The exact minimum feasible budget: the compiled peak of the most frugal plan."""
        from .solvers import minimum_budget, solve

        bucket = self.default_bucket() if bucket is None else bucket
        m = "extended" if method not in EXACT_METHODS else method
        return self.compile(solve(self.costs, minimum_budget(self.costs, bucket=bucket, method=m), method=m,
                                  bucket=bucket), 0).peak
