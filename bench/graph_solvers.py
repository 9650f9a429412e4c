"""Benchmark the DAG rematerialization solvers on synthetic training graphs.

For each graph (chain, residual chain, U-Net; 30-120 nodes) and budget (75% / 50% / 25%
of the no-remat peak): no-remat, memory-aware scheduling, RAF greedy (two scores)
and the Checkmate MILP (HiGHS via scipy, time-limited).  Reports recompute
overhead (cost / base cost - 1), exact peak (evaluate), and solve times; writes
bench/results/graph_solvers.json.

    PYTHONPATH=src .venv/bin/python bench/graph_solvers.py [--time-limit 15] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from remat.plan.graph import BudgetTooSmall, min_memory_lower_bound

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))
from graphgen import synthetic_training_graph  # noqa: E402  (the synthetic graphs live with the tests)
from remat.plan.greedy import greedy_min_budget, solve_greedy
from remat.plan.milp import NoSolutionFound, solve_milp
from remat.plan.scheduling import memory_aware_order, no_remat_plan, schedule_plan

GRAPHS = [("chain", 12), ("residual", 4), ("residual", 10), ("unet", 3), ("unet", 4)]
FRACTIONS = [0.75, 0.5, 0.25]


def _plan_row(plan) -> dict:
    return {
        "cost_s": plan.cost,
        "overhead": plan.overhead,
        "peak_bytes": plan.peak,
        "status": plan.status,
        "solve_time_s": round(plan.seconds, 4),
        "recomputes": len(plan.compute_order) - len(set(plan.compute_order)),
    }


def run(time_limit: float, quick: bool) -> dict:
    graphs = GRAPHS[:2] if quick else GRAPHS
    out: dict = {
        "time_limit_s": time_limit,
        "python": platform.python_version(),
        "note": "budgets are fractions of the no-remat peak (index order); overhead = cost/base_cost - 1",
        "cases": [],
    }
    for kind, n in graphs:
        g = synthetic_training_graph(kind, n, seed=0)
        base = no_remat_plan(g)
        sched = schedule_plan(g)
        order = memory_aware_order(g)
        lb = min_memory_lower_bound(g)
        gmin = greedy_min_budget(g)
        gmin_sched = greedy_min_budget(g, order)
        print(f"\n{kind}-{n}: {g}  no-remat peak {base.peak}  scheduled {sched.peak}  "
              f"lower bound {lb}  greedy min {gmin} (scheduled order {gmin_sched})")
        for frac in FRACTIONS:
            budget = int(frac * base.peak)
            case = {
                "graph": f"{kind}-{n}", "nodes": len(g), "compute_nodes": len(g.compute_nodes),
                "edges": g.num_edges(), "budget_fraction": frac, "budget_bytes": budget,
                "no_remat_peak": base.peak, "scheduled_peak": sched.peak, "lower_bound": lb,
                "greedy_min_budget": gmin, "base_cost_s": g.base_cost, "solvers": {},
            }
            for name, kw in [("greedy_raf", {"score": "raf"}), ("greedy", {}),
                             ("greedy_sched", {"order": order})]:
                try:
                    case["solvers"][name] = _plan_row(solve_greedy(g, budget, **kw))
                except BudgetTooSmall as e:
                    case["solvers"][name] = {"status": "budget_too_small", "minimum": e.minimum}
            t0 = time.perf_counter()
            try:
                case["solvers"]["milp"] = _plan_row(solve_milp(g, budget, time_limit=time_limit))
            except BudgetTooSmall as e:
                case["solvers"]["milp"] = {"status": "budget_too_small", "minimum": e.minimum,
                                           "solve_time_s": round(time.perf_counter() - t0, 3)}
            except NoSolutionFound as e:
                case["solvers"]["milp"] = {"status": "no_solution_in_time_limit",
                                           "solve_time_s": round(e.seconds, 3)}
            out["cases"].append(case)
            for name, r in case["solvers"].items():
                if "cost_s" in r:
                    print(f"  {int(frac * 100):>3}% {name:>12}: overhead {100 * r['overhead']:6.1f}%  "
                          f"peak {r['peak_bytes'] / budget:5.3f}xB  {r['status']:<20} {r['solve_time_s']:.2f}s")
                else:
                    print(f"  {int(frac * 100):>3}% {name:>12}: {r['status']} "
                          f"{r.get('minimum', '')} {r.get('solve_time_s', '')}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--time-limit", type=float, default=15.0, help="MILP time limit per case (s)")
    ap.add_argument("--quick", action="store_true", help="only the two smallest graphs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "graph_solvers.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    res = run(args.time_limit, args.quick)
    res["total_time_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"\nwrote {args.out} in {res['total_time_s']}s")


if __name__ == "__main__":
    main()
