"""Clipping by the global norm inside the fused step (``max_grad_norm``): keeping every gradient until
the norm is known, or a second backward (a norm pass, then the step), chosen by the planner.

Zoo GPT ``small`` (4 layers, d128, 64 tokens, batch 8, vocab 512, no dropout) with AdamW and
``max_grad_norm=1.0``. Reported: the unconstrained peak; each strategy's minimum budget
(``remat.train.compilation.clip_minimums``, workspaces counted as a budgeted compile counts them);
then at each budget of a grid (the unconstrained peak, fractions of it, each strategy's minimum),
the strategy the planner chose, and each strategy forced (``clip_strategy=``) where it fits: its
measured peak (== predicted <= budget checked) and its step time (median of ``--steps`` steps after
a warm-up step, median over ``--rounds`` alternating rounds in one process) against the
unconstrained step's.

Run:  PYTHONPATH=src .venv/bin/python bench/clip_strategies.py [--steps 5] [--rounds 3]
Writes bench/results/clip_strategies.json.
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
from remat.errors import format_bytes
from remat.train.compilation import CLIP_STRATEGIES, clip_minimums
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

RESULTS = Path(__file__).resolve().parent / "results"
MAX_GRAD_NORM = 1.0


def _compile(model, inputs, loss_fn, budget, strategy: str = "auto"):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    return remat.compile(m, inputs, loss_fn, optimizer=opt, budget=budget, max_grad_norm=MAX_GRAD_NORM,
                         clip_strategy=strategy)


def _seconds(step, inputs, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step(*inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, inputs, loss_fn = zoo.make("gpt", "small", dropout=0.0)
    free = _compile(model, inputs, loss_fn, None)
    top = free.report().unconstrained_peak
    minimums = clip_minimums(_compile(model, inputs, loss_fn, top).compilation)
    print(f"unconstrained peak {format_bytes(top)}; minimum budgets: "
          + ", ".join(f"{k} {format_bytes(v)} ({v / top:.1%})" for k, v in minimums.items()), flush=True)
    budgets = sorted({top, *(int(top * f) for f in (0.9, 0.8, 0.7, 0.6)), *minimums.values()}, reverse=True)
    chosen = {b: _compile(model, inputs, loss_fn, b).report().clip_strategy for b in budgets}
    steps = {}  # (budget, strategy) -> step: each strategy forced wherever it fits
    for b in budgets:
        for s in CLIP_STRATEGIES:
            try:
                steps[b, s] = _compile(model, inputs, loss_fn, b, s)
            except remat.BudgetTooSmall:
                pass
    for s in [free, *steps.values()]:
        s(*inputs)  # warm-up (and the allocator's measurement of budgeted steps)
    times: dict[object, list[float]] = {k: [] for k in ["free", *steps]}
    for _ in range(args.rounds):
        times["free"].append(_seconds(free, inputs, args.steps))
        for k, s in steps.items():
            times[k].append(_seconds(s, inputs, args.steps))
    base = statistics.median(times["free"])
    rows = []
    for b in budgets:
        row = {"budget": b, "budget_fraction": round(b / top, 4), "chosen": chosen[b]}
        for s in CLIP_STRATEGIES:
            if (b, s) not in steps:
                row[s] = None
                continue
            r, t = steps[b, s].report(), statistics.median(times[b, s])
            row[s] = {"predicted_peak": r.predicted_peak, "measured_peak": r.measured_peak,
                      "measured_equals_predicted": r.measured_peak == r.predicted_peak,
                      "within_budget": r.measured_peak <= b, "predicted_step_ms": round(r.predicted_step_seconds * 1e3, 3),
                      "step_ms": round(t * 1e3, 2), "step_vs_unconstrained": round(t / base, 3)}
        rows.append(row)
        cells = [f"{s}: " + ("does not fit" if row[s] is None else
                             f"{row[s]['step_ms']:.1f} ms = {row[s]['step_vs_unconstrained']:.2f}x, peak "
                             f"{format_bytes(row[s]['measured_peak'])} (== predicted: {row[s]['measured_equals_predicted']})")
                 for s in CLIP_STRATEGIES]
        print(f"budget {format_bytes(b)} ({b / top:.1%}), chosen {chosen[b]}; " + "; ".join(cells), flush=True)
    fastest_chosen = all(row[row["chosen"]]["step_ms"] <= min(row[s]["step_ms"] for s in CLIP_STRATEGIES if row[s])
                         for row in rows)
    print(f"the planner's choice was the faster measured strategy at every budget: {fastest_chosen}")
    out = {"config": {"model": "zoo gpt small (dropout 0)", "optimizer": "AdamW", "max_grad_norm": MAX_GRAD_NORM,
                      "steps": args.steps, "rounds": args.rounds, "torch_threads": 1},
           "machine": machine(),
           "unconstrained_peak": top, "unconstrained_step_ms": round(base * 1e3, 2),
           "minimum_budget": minimums, "budgets": rows, "chosen_is_fastest_measured": fastest_chosen}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "clip_strategies.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
