"""Cost models (issue 46): do predicted and measured recomputation agree, with the static cost model
and with the profiled one?

For each case (default: zoo ResNet, U-Net and GPT at size small with ``SGD(lr=1e-3, momentum=0.9)``,
and ``zoo.make("gpt", "medium")`` with ``precision="bf16"`` and no optimizer), all at ``budget="50%"``,
this compiles, on fresh copies of the model, the unconstrained step (no budget) and the budgeted step
with ``cost_model="static"`` and with ``cost_model="profiled"``, then times the three in one process:
after ``--warmup`` untimed steps each, ``--rounds`` rounds run one step of each in turn (the start of
the order rotating each round; ``.grad`` cleared outside the timer, as ``bench/speed.py`` does).

Per budgeted step it reports:

* predicted recomputation, from ``step.report()``: seconds (the planned step's predicted seconds less
  the unconstrained step's, on that cost model: static seconds are nominal, so only its fraction
  compares) and overhead (those seconds over the unconstrained step's predicted seconds);
* measured recomputation: the median budgeted step time less the median unconstrained step time,
  both measured here, and as a fraction of the unconstrained step; also the median over rounds of
  each round's difference; and the same from the steps' program runs alone (the VM's time, as the
  report measures it: a step call also binds its arguments and results, a few ms on ResNet that
  the cost model does not price, so the fractions compare there);
* the step time, the plan (solver, algorithm choices), predicted == measured peak, the compile time
  and, for the profiled model, how many instruction signatures were timed alone (instructions the
  step's own measured runs never ran).

The machine's load average is recorded before and after: on a shared 2-core machine another process
running at the same time slows steps of two intra-op threads by tens of times in bursts (``--threads
1`` is far less sensitive).

Run:  PYTHONPATH=src .venv/bin/python bench/cost_model.py [--cases resnet,unet] [--rounds 7] [--threads 2]
Writes bench/results/cost_model.json and prints a table. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import remat
from remat import zoo
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

RESULTS = Path(__file__).resolve().parent / "results"
LR, MOMENTUM = 1e-3, 0.9


@dataclass(frozen=True)
class Case:
    """A model and how it trains: ``zoo.make(model, size)``, SGD with momentum or no optimizer, a precision."""

    name: str
    model: str
    size: str
    sgd: bool = True
    precision: str = "fp32"


CASES = {c.name: c for c in (Case("resnet", "resnet", "small"), Case("unet", "unet", "small"),
                             Case("gpt", "gpt", "small"), Case("gpt-medium-bf16", "gpt", "medium", sgd=False,
                                                              precision="bf16"))}


@dataclass
class Row:
    """One budgeted step of a case (seconds; overheads as fractions of the unconstrained step)."""

    case: str
    cost_model: str
    budget: int
    solver: str
    algorithms: list[str]
    peak_ok: bool                      # predicted peak == measured peak <= budget
    compile_s: float
    profile_s: float | None            # the compile's ``profile`` stage (profiled only)
    measured_alone: int | None         # signatures timed alone (profiled only)
    plan_overhead: float               # the planner's, over the joint's compute
    predicted_step_s: float            # on the cost model (static: nominal seconds)
    predicted_unconstrained_s: float
    predicted_recompute_s: float
    predicted_overhead: float
    step_s: float                      # median over rounds, measured here
    unconstrained_step_s: float
    measured_recompute_s: float        # step_s - unconstrained_step_s
    measured_recompute_s_rounds: float  # median of each round's difference
    measured_overhead: float
    run_s: float                       # the same from the program's runs alone (the VM's time: what
    unconstrained_run_s: float         # the report's measured overhead and the prediction are of)
    measured_recompute_run_s: float
    measured_overhead_run: float
    rounds: list[float] = field(default_factory=list)


def _make(case: Case) -> tuple[torch.nn.Module, tuple, Any]:
    torch.manual_seed(0)
    model, inputs, loss_fn = zoo.make(case.model, case.size)
    model.train()
    return model, inputs, loss_fn


def _compile(case: Case, model: torch.nn.Module, inputs: tuple, loss_fn, budget, cost_model: str):
    """A fresh copy of ``model`` compiled (its optimizer made for the copy) and the compile's seconds."""
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) if case.sgd else None
    t0 = time.perf_counter()
    step = remat.compile(m, inputs, loss_fn, optimizer=opt, budget=budget, cost_model=cost_model,
                         precision=case.precision)
    return step, m, time.perf_counter() - t0


def _timed(step, model: torch.nn.Module, inputs: tuple) -> tuple[float, float]:
    """One step's wall seconds (``.grad`` cleared outside the timer) and its program's run (the VM's
    ``total_seconds``: without the call's own work around it, binding arguments and results)."""
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    step(*inputs)
    return time.perf_counter() - t0, step.last_stats.total_seconds


def bench_case(case: Case, budget: str, rounds: int, warmup: int, log) -> list[Row]:
    """The case's unconstrained step and its budgeted steps on each cost model, timed alternately."""
    model, inputs, loss_fn = _make(case)
    steps: dict[str, tuple] = {}
    compile_s: dict[str, float] = {}
    for name, b, cm in (("unconstrained", None, "static"), ("static", budget, "static"),
                        ("profiled", budget, "profiled")):
        step, m, secs = _compile(case, model, inputs, loss_fn, b, cm)
        steps[name], compile_s[name] = (step, m), secs
        log(f"  {case.name}: compiled {name} in {secs:.1f} s ({step.report().solver})")
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            _timed(*steps[name], inputs)
    times: dict[str, list[float]] = {n: [] for n in names}
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            wall, run = _timed(*steps[name], inputs)
            times[name].append(wall)
            runs[name].append(run)
    unc, unc_run = statistics.median(times["unconstrained"]), statistics.median(runs["unconstrained"])
    rows = []
    for cm in ("static", "profiled"):
        step, _ = steps[cm]
        rep = step.report()
        c = step.compilation
        med, run = statistics.median(times[cm]), statistics.median(runs[cm])
        rows.append(Row(
            case=case.name, cost_model=cm, budget=rep.budget, solver=rep.solver, algorithms=list(rep.algorithms),
            peak_ok=rep.measured_peak == rep.predicted_peak <= rep.budget, compile_s=compile_s[cm],
            profile_s=rep.stage_seconds.get("profile"),
            measured_alone=None if c.measured is None else c.measured.measured_alone,
            plan_overhead=c.plan.overhead, predicted_step_s=c.predicted_seconds,
            predicted_unconstrained_s=c.unconstrained_predicted_seconds,
            predicted_recompute_s=rep.predicted_recompute_seconds, predicted_overhead=rep.predicted_overhead,
            step_s=med, unconstrained_step_s=unc, measured_recompute_s=med - unc,
            measured_recompute_s_rounds=statistics.median(t - u for t, u in zip(times[cm], times["unconstrained"])),
            measured_overhead=med / unc - 1.0, run_s=run, unconstrained_run_s=unc_run,
            measured_recompute_run_s=run - unc_run, measured_overhead_run=run / unc_run - 1.0, rounds=times[cm]))
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'case':16} {'cost model':10} {'solver':22} {'predicted':>20} {'measured (step)':>20} "
          f"{'measured (run)':>20} {'step ms':>8} {'unc. ms':>8}")
    for r in rows:
        pred = f"{r.predicted_recompute_s * 1e3:7.2f} ms {r.predicted_overhead:+7.1%}"
        meas = f"{r.measured_recompute_s * 1e3:7.2f} ms {r.measured_overhead:+7.1%}"
        run = f"{r.measured_recompute_run_s * 1e3:7.2f} ms {r.measured_overhead_run:+7.1%}"
        print(f"{r.case:16} {r.cost_model:10} {r.solver[:22]:22} {pred:>20} {meas:>20} {run:>20} "
              f"{r.step_s * 1e3:8.2f} {r.unconstrained_step_s * 1e3:8.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--budget", default="50%", help="the budget of the budgeted steps (default 50%%)")
    p.add_argument("--rounds", type=int, default=7, help="alternating timing rounds (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per step before the rounds (default 2)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "cost_model.json")
    a = p.parse_args(argv)
    a.cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in a.cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; valid: {', '.join(CASES)}")
    if a.rounds < 1 or a.warmup < 1 or a.threads < 1:
        p.error("--rounds, --warmup and --threads must be >= 1")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    rows: list[Row] = []
    for name in a.cases:
        rows += bench_case(CASES[name], a.budget, a.rounds, a.warmup, lambda s: print(s, flush=True))
        gc.collect()
    doc = {"config": {"cases": a.cases, "budget": a.budget, "rounds": a.rounds, "warmup": a.warmup,
                      "threads": a.threads, "optimizer": f"SGD(lr={LR}, momentum={MOMENTUM}) (gpt-medium-bf16: none)",
                      "wall_s": time.perf_counter() - t0},
           "machine": {**machine(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
           "rows": [asdict(r) for r in rows]}
    print()
    print_table(rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"\nwrote {a.out} ({doc['config']['wall_s']:.0f} s)")
    return doc


if __name__ == "__main__":
    main()
