"""Per-operator algorithm choice (issue 10): how far the chunked cross-entropy lowers the memory
floor of a training step, and what it costs in step time.

For a zoo model (default: the speed benchmark's GPT medium, 8 layers, d512, seq 256, batch 8, vocab
8000, no optimizer) this measures, in one process:

* the unconstrained step's predicted peak (the reference algorithms) and the bytes no plan can go
  below (parameters, gradients and inputs: the step's arguments and results);
* the minimum feasible budget with the reference algorithms only (``algorithms="reference"``) and
  with the planner's choice (``algorithms="auto"``), each from ``BudgetTooSmall.minimum`` of a
  1-byte budget (a bounded search: a budget that fits, not necessarily the least);
* the step compiled at each minimum: VM-measured peak == predicted peak, the algorithm chosen;
* step times: ``--rounds`` rounds alternating the unconstrained step and both minimum-budget steps
  (one step each per round, order rotating); medians and per-round ratios to the unconstrained step.

Run:  PYTHONPATH=src python bench/algorithm_choice.py [--size medium] [--rounds 5]
Writes bench/results/algorithm_choice.json and prints a summary. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

import remat
from remat import zoo

RESULTS = Path(__file__).resolve().parent / "results"


def _minimum(model, inputs, loss_fn, algorithms: str) -> int:
    try:
        remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=1, algorithms=algorithms)
    except remat.BudgetTooSmall as e:
        return e.minimum
    raise AssertionError("a 1-byte budget fitted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="medium")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "algorithm_choice.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, inputs, loss_fn = zoo.make(a.model, a.size)
    model.train()
    out: dict = {"model": f"{a.model}/{a.size}", "rounds": a.rounds, "threads": a.threads}

    t0 = time.perf_counter()
    base = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    out["unconstrained_setup_s"] = time.perf_counter() - t0
    unc = base.unconstrained_peak
    args_bytes = sum(p.type.nbytes for p in base.program.params)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out["unconstrained_peak"] = unc
    out["floor_bytes"] = args_bytes + grad_bytes
    out["floor_fraction"] = (args_bytes + grad_bytes) / unc

    steps = {"unconstrained": base}
    for alg in ("reference", "auto"):
        t0 = time.perf_counter()
        m = _minimum(model, inputs, loss_fn, alg)
        out[f"minimum_{alg}"] = m
        out[f"minimum_{alg}_fraction"] = m / unc
        out[f"minimum_{alg}_search_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        steps[alg] = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=m, algorithms=alg)
        out[f"setup_{alg}_s"] = time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for k in names:  # warm-up
        steps[k](*inputs)
    for r in range(a.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            steps[k](*inputs)
            times[k].append(time.perf_counter() - t0)
    for k, st in steps.items():
        rep = st.report()
        out[k] = {"budget": rep.budget, "predicted_peak": rep.predicted_peak, "measured_peak": rep.measured_peak,
                  "measured_equals_predicted": rep.measured_peak == rep.predicted_peak, "solver": rep.solver,
                  "predicted_overhead": rep.predicted_overhead, "algorithms": rep.algorithms,
                  "step_s": statistics.median(times[k]), "step_s_rounds": times[k],
                  "x_unconstrained": statistics.median(t / u for t, u in zip(times[k], times["unconstrained"]))}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    mib = 2**20
    print(f"{out['model']}: unconstrained peak {unc / mib:.1f} MiB; parameters + gradients + inputs "
          f"{out['floor_bytes'] / mib:.1f} MiB ({out['floor_fraction']:.1%})")
    for k in ("reference", "auto"):
        s = out[k]
        print(f"  minimum, algorithms={k}: {out[f'minimum_{k}'] / mib:.1f} MiB ({out[f'minimum_{k}_fraction']:.1%}); "
              f"measured {s['measured_peak']} == predicted {s['predicted_peak']}: {s['measured_equals_predicted']}; "
              f"step {s['x_unconstrained']:.2f}x unconstrained (median of {a.rounds}); {s['solver']}")
        for line in s["algorithms"]:
            print(f"    {line}")
    print(f"  unconstrained step {out['unconstrained']['step_s'] * 1e3:.0f} ms (median)")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
