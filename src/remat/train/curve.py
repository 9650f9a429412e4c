"""The budget sweep of a whole training step: predicted and measured peak and overhead of the plans
``remat.compile`` makes from its minimum budget to the unconstrained peak (``remat curve --model``).

The step is captured once; each budget is planned on the same :class:`~remat.plan.portfolio.StepProblem`
(so plans lowered for smaller budgets compete at larger ones) and run once on the VM, whose
measured peak must equal the prediction.
"""
from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..ir import Module
from ..plan import portfolio
from ..plan.portfolio import plan_step

CSV_FIELDS = ("budget", "budget_fraction", "solver", "predicted_peak", "measured_peak", "predicted_overhead",
              "measured_overhead", "step_seconds")


@dataclass
class SweepRow:
    """One budget of a sweep. Bytes and seconds; overheads are fractions (0.1 = +10%)."""

    budget: int
    budget_fraction: float      # of the unconstrained peak
    solver: str
    predicted_peak: int
    measured_peak: int
    predicted_overhead: float
    measured_overhead: float    # fastest run over the unconstrained step's fastest run, minus 1
    step_seconds: float


def minimum_budget(step) -> int:
    """The smallest budget (bytes) the planners find a plan for, for a compiled ``step``."""
    return portfolio.minimum_budget(step.compilation.problem)


def default_budgets(step, n_points: int = 10) -> list[int]:
    """``n_points`` budgets (bytes) evenly from the minimum to the unconstrained peak, both included."""
    lo, hi = minimum_budget(step), step.unconstrained_peak
    return sorted({int(round(x)) for x in np.linspace(lo, hi, n_points)})


def budget_sweep(step, budgets: Sequence[int], repeats: int = 3,
                 progress: Callable[[int, int], None] | None = None) -> list[SweepRow]:
    """Plan ``step`` (a compiled :class:`~remat.train.api.TrainStep`) at each budget, smallest
    first, and run each plan ``repeats`` times on the VM (on copies of its arguments), alternating
    with the unconstrained step so both see the same machine load; each time is the fastest run.
    PyTorch runs on one thread meanwhile: the VM's many small kernels only contend for more."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sweep(step, budgets, repeats, progress)
    finally:
        torch.set_num_threads(threads)


def _sweep(step, budgets: Sequence[int], repeats: int, progress: Callable[[int, int], None] | None) -> list[SweepRow]:
    from ..runtime.vm import VM

    args = step.binding.step_args(step.signature.example, copy=True, step=1)
    base = step.compilation.problem.unconstrained
    base_vm = VM(Module([base]), dialects=step.dialects, device=step.device)

    def once(vm, program):
        return vm.run(program.name, *[a.clone() if hasattr(a, "clone") else a for a in args])[1]

    once(base_vm, base)  # warm-up: the first run pays one-time kernel costs
    rows = []
    for k, b in enumerate(sorted(budgets)):
        if progress is not None:
            progress(k, len(budgets))
        cand = plan_step(dataclasses.replace(step.compilation.problem, budget=int(b)))
        vm = VM(Module([cand.program]), dialects=step.dialects, device=step.device)
        once(vm, cand.program)
        runs, base_runs = [], []
        for _ in range(repeats):
            runs.append(once(vm, cand.program))
            base_runs.append(once(base_vm, base))
        seconds = min(s.total_seconds for s in runs)
        over = 0.0 if cand.solver == "none" else seconds / min(s.total_seconds for s in base_runs) - 1.0
        rows.append(SweepRow(int(b), b / step.unconstrained_peak, cand.solver, cand.peak,
                             max(s.peak_bytes for s in runs), cand.overhead, over, seconds))
    return rows


def write_sweep(rows: Sequence[SweepRow], png_path: str, csv_path: str, title: str) -> None:
    """``rows`` as CSV, and as a PNG: overhead (predicted, measured) and peak (predicted, measured,
    the budget) against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))
    x = [r.budget / 2**20 for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(x, [100 * r.predicted_overhead for r in rows], "o-", color="C0", label="predicted")
    ax1.plot(x, [100 * r.measured_overhead for r in rows], "s--", color="C1", label="measured")
    for r, xi in zip(rows, x):
        ax1.annotate(r.solver.split(" (")[0], (xi, 100 * r.predicted_overhead), fontsize=6, rotation=30,
                     textcoords="offset points", xytext=(2, 4))
    ax1.set_xlabel("memory budget (MiB)")
    ax1.set_ylabel("recompute overhead (%)")
    ax1.set_title("overhead")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.plot(x, x, ":", color="C7", label="budget")
    ax2.plot(x, [r.predicted_peak / 2**20 for r in rows], "o-", color="C0", label="predicted peak")
    ax2.plot(x, [r.measured_peak / 2**20 for r in rows], "x", color="C3", ms=8, label="measured peak")
    ax2.set_xlabel("memory budget (MiB)")
    ax2.set_ylabel("peak (MiB)")
    ax2.set_title("peak")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def format_table(rows: Sequence[SweepRow]) -> str:
    """The sweep as a text table: budget, solver, predicted/measured overhead and peaks."""
    lines = [f"{'budget':>9} {'of peak':>7}  {'solver':<28} {'pred. overhead':>14} {'meas. overhead':>14} "
             f"{'pred. peak':>11} {'meas. peak':>11}"]
    for r in rows:
        meas = "-" if math.isnan(r.measured_overhead) else f"{r.measured_overhead:+.1%}"
        lines.append(f"{r.budget:>9} {r.budget_fraction:>7.0%}  {r.solver:<28} {r.predicted_overhead:>+14.1%} "
                     f"{meas:>14} {r.predicted_peak:>11} {r.measured_peak:>11}")
    return "\n".join(lines)


__all__ = ["CSV_FIELDS", "SweepRow", "budget_sweep", "default_budgets", "format_table", "minimum_budget",
           "write_sweep"]
