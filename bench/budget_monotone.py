"""Issue 46: predicted overhead over budget sweeps of fresh plans, and the same plan in any order.

For each model (issue 46's residual CNN, ``tests/plan/residual_cnn.py``, without an optimizer and
with SGD; zoo GPT, ResNet and U-Net at ``--size``, SGD), ``--points`` budgets evenly from the
planners' minimum to the unconstrained peak are each planned with an empty plan cache, as a fresh
process plans them (``plan_step``, ``solver="auto"``: the neighbourhood MILP on). A row whose
predicted overhead is above the previous (smaller) budget's is flagged; then the same budgets are
planned again in a shuffled order in one process, and each plan must be the one planned alone.
Writes ``bench/results/budget_monotone.json`` and prints a table.

    PYTHONPATH=src .venv/bin/python bench/budget_monotone.py [--models rescnn,rescnn-sgd,gpt,resnet,unet] [--size small] [--points 8]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

import remat
from remat import zoo
from remat.ir import print_function
from remat.plan.frontier import forget_plans
from remat.plan.portfolio import plan_step
from remat.train.curve import minimum_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))
from residual_cnn import residual_cnn  # noqa: E402  (the model lives with the tests)


def build(name: str, size: str):
    if name.startswith("rescnn"):
        model, example, loss_fn = residual_cnn()
    else:
        model, example, loss_fn = zoo.make(name, size, torch.float32, **({"dropout": 0.0} if name == "gpt" else {}))
    optimizer = None if name == "rescnn" else torch.optim.SGD(model.parameters(), lr=0.1)
    return remat.compile(model, example, loss_fn, optimizer=optimizer)


def sweep(name: str, size: str, points: int) -> dict:
    step = build(name, size)
    prob, peak = step.compilation.problem, step.unconstrained_peak
    forget_plans()
    lo = minimum_budget(step)
    budgets = [int(lo + (peak - lo) * k / points) for k in range(points)]
    rows, plans = [], {}
    for b in budgets:
        forget_plans()
        t = time.perf_counter()
        plan = plan_step(dataclasses.replace(prob, budget=b))
        plans[b] = plan
        rows.append({"budget": b, "fraction": b / peak, "predicted_overhead": plan.overhead, "peak": plan.peak,
                     "solver": plan.solver, "seconds": time.perf_counter() - t})
    rises = [r["fraction"] for a, r in zip(rows, rows[1:]) if r["predicted_overhead"] > a["predicted_overhead"]]
    forget_plans()
    shuffled = list(budgets)
    random.Random(0).shuffle(shuffled)
    differ = []
    for b in shuffled:
        again = plan_step(dataclasses.replace(prob, budget=b))
        if print_function(again.program) != print_function(plans[b].program) or again.overhead != plans[b].overhead:
            differ.append(b / peak)
    return {"model": name, "size": size, "unconstrained_peak": peak, "rows": rows, "rises": rises,
            "differ_in_shuffled_order": differ}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="rescnn,rescnn-sgd,gpt,resnet,unet")
    ap.add_argument("--size", default="small")
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    out = [sweep(m, a.size, a.points) for m in a.models.split(",")]
    for s in out:
        for r in s["rows"]:
            print(f"{s['model']:10s} {s['size']:6s} {r['fraction']:6.1%} {r['predicted_overhead']:+8.1%} "
                  f"peak {r['peak'] / s['unconstrained_peak']:6.1%} {r['seconds']:5.1f} s  {r['solver']}")
        print(f"{s['model']:10s} rises at: {s['rises'] or 'none'}; plans that differ in a shuffled order: "
              f"{s['differ_in_shuffled_order'] or 'none'}")
    path = Path(a.out) / "budget_monotone.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
