"""Compute-memory trade-off curves of the chain solvers (thesis Fig. 4.1).

``tradeoff_curve`` solves every (budget, method) pair; ``plot_curve`` draws
compute overhead (cost / no-recompute cost) against the budget in bytes and
writes the rows as CSV; ``curve_main`` does both for the ``remat curve`` CLI.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from .costs import BudgetTooSmall, ChainCosts
from .solvers import minimum_budget, no_recompute_peak, solve

__all__ = ["tradeoff_curve", "plot_curve", "curve_main", "default_budgets"]

CSV_FIELDS = ("method", "budget", "cost", "overhead", "peak", "feasible", "solve_time_s", "bucket")


def default_budgets(costs: ChainCosts, n_points: int = 40) -> list[int]:
    """Budgets (bytes) from the exact minimum to 5% above the no-recompute peak."""
    lo = minimum_budget(costs, 1)
    hi = no_recompute_peak(costs)
    return sorted({int(round(x)) for x in np.linspace(lo, hi * 1.05, n_points)})


def tradeoff_curve(
    costs: ChainCosts,
    budgets: Iterable[float],
    methods: Sequence[str] = ("uniform", "precise", "extended", "sqrt"),
    *,
    units: int = 2000,
    progress: bool = True,
) -> list[dict]:
    """One row per (method, budget): cost, overhead, simulated peak, feasibility.

    DP methods use ``bucket = ceil(budget / units)`` bytes per memory unit.  An
    infeasible DP budget gives ``cost = nan`` and ``feasible = False``; baselines
    report their true (simulated) peak and ``feasible = peak <= budget``.
    """
    budgets = list(budgets)
    base = costs.no_recompute_cost()
    rows: list[dict] = []
    jobs = [(m, b) for m in methods for b in budgets]
    for m, b in tqdm(jobs, desc="trade-off curve", disable=not progress, leave=False):
        bucket = max(1, math.ceil(b / units)) if m in ("precise", "extended") else None
        try:
            p = solve(costs, b, m, bucket=bucket)
            rows.append(dict(method=m, budget=b, cost=p.cost, overhead=p.cost / base, peak=p.peak,
                             feasible=p.feasible, solve_time_s=p.seconds, bucket=bucket))
        except BudgetTooSmall:
            rows.append(dict(method=m, budget=b, cost=math.nan, overhead=math.nan, peak=math.nan,
                             feasible=False, solve_time_s=math.nan, bucket=bucket))
    return rows


def plot_curve(rows: list[dict], png_path: str, csv_path: str | None = None, title: str | None = None) -> None:
    """Plot overhead vs budget per method (hollow markers: the plan exceeds the budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if csv_path:
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k) for k in CSV_FIELDS})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"precise": ("C0", "o"), "extended": ("C2", "^"), "uniform": ("C1", "s"),
              "sqrt": ("C3", "D"), "none": ("C7", "x")}
    for m in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == m]
        col, mk = styles.get(m, ("k", "."))
        ok = [r for r in rs if r["feasible"]]
        bad = [r for r in rs if not r["feasible"] and not math.isnan(r["cost"])]
        ax.plot([r["budget"] for r in ok], [r["overhead"] for r in ok], marker=mk, ms=4, color=col,
                label=m, lw=1.2)
        if bad:
            ax.scatter([r["budget"] for r in bad], [r["overhead"] for r in bad], marker=mk, s=18,
                       facecolors="none", edgecolors=col, label=f"{m} (over budget)")
    ax.set_xlabel("memory budget (bytes)")
    ax.set_ylabel("compute cost / no-recompute cost")
    ax.set_title(title or "Compute-memory trade-off")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def curve_main(costs: ChainCosts, out_dir: str, n_points: int = 40,
               methods: Sequence[str] = ("uniform", "precise", "extended", "sqrt"),
               units: int = 2000, progress: bool = True) -> tuple[str, str]:
    """Compute and write ``curve.png`` and ``curve.csv`` into ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    rows = tradeoff_curve(costs, default_budgets(costs, n_points), methods, units=units, progress=progress)
    png = os.path.join(out_dir, "curve.png")
    csv_path = os.path.join(out_dir, "curve.csv")
    plot_curve(rows, png, csv_path, title=f"Compute-memory trade-off, N={costs.n}")
    return png, csv_path
