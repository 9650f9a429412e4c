"""Benchmark of the chain checkpointing solvers (remat.plan.chain.solvers).

1. Solve time of the precise DP on a 100-stage heterogeneous chain with the
   budget split into 10,000 memory units (target: <= 10 s on 2 cores).
2. Cost lost to bucketing vs bucket size, with solver time (thesis Fig. 4.2),
   against the exact (bucket-free) frontier mode.
3. The extended model and the baselines at the same budget.

Run:  PYTHONPATH=src .venv/bin/python bench/chain_solver.py
Writes bench/results/chain_solver.json and prints a table.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from remat.plan.chain.costs import ChainCosts
from remat.plan.chain.solvers import minimum_budget, no_recompute_peak, solve
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

N = 100
SEED = 7
MAX_BYTES = 1_000_000
BUDGET_FRACTION = 0.3  # budget = min + 0.3 * (no-recompute peak - min)
UNIT_SWEEP = (250, 500, 1000, 2000, 5000, 10_000, 20_000)


def timed(fn, repeat: int = 1):
    """Best wall time (s) of ``repeat`` calls and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> dict:
    costs = ChainCosts.random(N, seed=SEED, max_bytes=MAX_BYTES)
    lo, hi = minimum_budget(costs), no_recompute_peak(costs)
    budget = int(lo + BUDGET_FRACTION * (hi - lo))
    base = costs.no_recompute_cost()
    # warm-up: JIT compile (cached on disk after the first run)
    solve(ChainCosts.random(5, seed=0), 10**7, "precise", bucket=10**4)
    solve(ChainCosts.random(5, seed=0), 10**7, "precise", bucket="exact")
    solve(ChainCosts.random(5, seed=0, extended=True), 10**7, "extended", bucket=10**4)

    t_exact, exact = timed(lambda: solve(costs, budget, "precise", bucket="exact"))
    res: dict = {
        "chain": {"N": N, "seed": SEED, "max_bytes": MAX_BYTES, "no_recompute_cost": base,
                  "no_recompute_peak_bytes": hi, "minimum_budget_bytes": lo},
        "budget_bytes": budget,
        "machine": machine(),
        "exact": {"time_s": t_exact, "cost": exact.cost, "peak": exact.peak,
                  "overhead": exact.cost / base, "frontier_points": exact.stats["frontier_points"]},
    }
    bucket10k = budget // 10_000
    t10k, p10k = timed(lambda: solve(costs, budget, "precise", bucket=bucket10k), repeat=2)
    res["headline"] = {"units": 10_000, "bucket_bytes": bucket10k, "time_s": t10k, "cost": p10k.cost,
                       "peak": p10k.peak, "overhead": p10k.cost / base,
                       "cost_lost_vs_exact": p10k.cost / exact.cost - 1.0}
    sweep = []
    for units in UNIT_SWEEP:
        bucket = max(1, budget // units)
        t, p = timed(lambda: solve(costs, budget, "precise", bucket=bucket))
        sweep.append({"units": units, "bucket_bytes": bucket, "time_s": t, "cost": p.cost, "peak": p.peak,
                      "cost_lost_vs_exact": p.cost / exact.cost - 1.0})
    res["bucket_sweep"] = sweep
    others = {}
    ext_costs = ChainCosts.random(N, seed=SEED, max_bytes=MAX_BYTES, extended=True)
    for m in ("uniform", "sqrt", "none"):
        t, p = timed(lambda: solve(costs, budget, m))
        others[m] = {"time_s": t, "cost": p.cost, "peak": p.peak, "feasible": p.feasible,
                     "overhead": p.cost / base}
    eb = int(minimum_budget(ext_costs.folded()) + BUDGET_FRACTION
             * (no_recompute_peak(ext_costs) - minimum_budget(ext_costs.folded())))
    t, pe = timed(lambda: solve(ext_costs, eb, "extended", bucket=max(1, eb // 2000)))
    t2, pp = timed(lambda: solve(ext_costs, eb, "precise", bucket=max(1, eb // 2000)))
    others["extended_vs_precise_on_tape_chain"] = {
        "budget_bytes": eb, "units": 2000, "extended_time_s": t, "extended_cost": pe.cost,
        "extended_peak": pe.peak, "precise_time_s": t2, "precise_cost": pp.cost, "precise_peak": pp.peak}
    res["others"] = others
    return res


def report(res: dict) -> None:
    h = res["headline"]
    print(f"chain N={res['chain']['N']}  budget={res['budget_bytes']:,} B  "
          f"(min {res['chain']['minimum_budget_bytes']:,}, no-recompute {res['chain']['no_recompute_peak_bytes']:,})")
    print(f"precise, 10,000 units (bucket {h['bucket_bytes']:,} B): {h['time_s']:.2f} s, "
          f"overhead {h['overhead']:.4f}, cost lost vs exact {100 * h['cost_lost_vs_exact']:.3f}%")
    e = res["exact"]
    print(f"exact frontier mode: {e['time_s']:.2f} s, overhead {e['overhead']:.4f}, "
          f"{e['frontier_points']:,} frontier points")
    print(f"{'units':>7} {'bucket B':>10} {'time s':>8} {'cost':>10} {'lost %':>8}")
    for r in res["bucket_sweep"]:
        print(f"{r['units']:>7} {r['bucket_bytes']:>10,} {r['time_s']:>8.2f} {r['cost']:>10.4f} "
              f"{100 * r['cost_lost_vs_exact']:>8.3f}")
    for m in ("uniform", "sqrt", "none"):
        o = res["others"][m]
        print(f"{m:>8}: cost {o['cost']:.4f} peak {o['peak']:,} feasible={o['feasible']}")
    x = res["others"]["extended_vs_precise_on_tape_chain"]
    print(f"tape chain @ {x['budget_bytes']:,} B, 2000 units: extended cost {x['extended_cost']:.4f} "
          f"({x['extended_time_s']:.2f} s) vs precise(folded) {x['precise_cost']:.4f} ({x['precise_time_s']:.2f} s)")


if __name__ == "__main__":
    out = main()
    here = os.path.dirname(os.path.abspath(__file__))
    os.makedirs(os.path.join(here, "results"), exist_ok=True)
    path = os.path.join(here, "results", "chain_solver.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2, default=float)
    report(out)
    print(f"wrote {path}")
