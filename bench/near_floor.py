"""Issue 12: plans near the minimum budget, before and after the MILP on the greedy's neighbourhood.

For each model (zoo U-Net, GPT, ResNet at size ``small``, no optimizer; a tiny ``transformers``
GPT-2 and Llama from ``tests/models/hf_zoo.py``), budgets from the planners' minimum up a third of
the way to the unconstrained peak are planned twice in this one process: "before" with the
neighbourhood search switched off (``registry.NEIGHBOURHOOD_OPTIONS = ()``, what ``solver="auto"``
did before it), "after" as shipped; each with a fresh frontier, budgets smallest first. Every plan
is run on the VM: measured peak must equal the prediction and every output (loss, gradients) must be
``torch.equal`` to the unconstrained step's. Writes ``bench/results/near_floor.json``.

    PYTHONPATH=src .venv/bin/python bench/near_floor.py [--models unet,gpt,resnet,gpt2,llama] [--fractions 0 .05 .1 .2 .33]

The neighbourhood MILP's work is bounded by node counts (``milp.WINDOW_NODE_LIMIT``), so "after" is the
same on any machine; golden plans use ``solver="greedy"``, which never runs it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat import zoo
from remat.ir import Module
from remat.plan import registry
from remat.plan.frontier import forget_plans
from remat.plan.portfolio import plan_step
from remat.runtime.vm import VM
from remat.train.curve import minimum_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from hf_zoo import MODELS as HF_MODELS  # noqa: E402  (the model table lives with the tests)
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)


def _build(name: str):
    """A compiled step (no optimizer) of a zoo or Hugging Face model."""
    hf = {m.name: m for m in HF_MODELS}
    if name in ("gpt2", "llama"):
        model, inputs = hf[name].build()
        return remat.compile(model, inputs)
    kw = {"dropout": 0.0} if name == "gpt" else {}
    model, example, loss_fn = zoo.make(name, "small", torch.float32, **kw)
    return remat.compile(model, example, loss_fn)


def _run(step, program, args):
    """Outputs and the VM's peak of one run of ``program`` on copies of ``args``."""
    vm = VM(Module([program]), dialects=step.dialects)
    outs, stats = vm.run(program.name, *[a.clone() if hasattr(a, "clone") else a for a in args])
    return outs, stats.peak_bytes


def _sweep(step, budgets: list[int], neighbourhood: bool, ref_outs, args) -> list[dict]:
    saved = registry.NEIGHBOURHOOD_OPTIONS
    registry.NEIGHBOURHOOD_OPTIONS = saved if neighbourhood else ()
    forget_plans()
    rows = []
    try:
        for b in budgets:
            t0 = time.perf_counter()
            cand = plan_step(dataclasses.replace(step.compilation.problem, budget=b))
            seconds = time.perf_counter() - t0
            outs, peak = _run(step, cand.program, args)
            same = len(outs) == len(ref_outs) and all(torch.equal(torch.as_tensor(x), torch.as_tensor(y))
                                                      for x, y in zip(outs, ref_outs))
            rows.append({"budget": b, "solver": cand.solver, "predicted_overhead": cand.overhead,
                         "predicted_peak": cand.peak, "measured_peak": peak, "exact": peak == cand.peak <= b,
                         "outputs_bit_identical": same, "plan_seconds": round(seconds, 3),
                         "notes": [n for n in cand.notes if "neighbourhood" in n or n.startswith("won:")]})
    finally:
        registry.NEIGHBOURHOOD_OPTIONS = saved
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="unet,gpt,resnet,gpt2,llama")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.33],
                    help="budgets as fractions of the way from the minimum to the unconstrained peak")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "near_floor.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    results = []
    for name in a.models.split(","):
        step = _build(name)
        lo, hi = minimum_budget(step), step.unconstrained_peak
        budgets = sorted({int(lo + (hi - lo) * f) for f in a.fractions})
        args = step.binding.step_args(step.signature.example, copy=True, step=1)
        ref_outs, _ = _run(step, step.compilation.problem.unconstrained, args)
        before = _sweep(step, budgets, False, ref_outs, args)
        after = _sweep(step, budgets, True, ref_outs, args)
        print(f"{name}: minimum {lo:,} B, unconstrained {hi:,} B")
        for x, y in zip(before, after):
            print(f"  {x['budget'] / hi:5.1%}  before {x['predicted_overhead']:+8.1%} {x['solver']:28s} {x['plan_seconds']:5.1f}s"
                  f"  after {y['predicted_overhead']:+8.1%} {y['solver']:28s} {y['plan_seconds']:5.1f}s"
                  f"  exact {x['exact'] and y['exact']} bit-identical {x['outputs_bit_identical'] and y['outputs_bit_identical']}")
        results.append({"model": name, "minimum": lo, "unconstrained_peak": hi,
                        "budgets": [{"budget": x["budget"], "fraction_of_peak": x["budget"] / hi, "before": x, "after": y}
                                    for x, y in zip(before, after)],
                        "median_plan_seconds": {"before": statistics.median(x["plan_seconds"] for x in before),
                                                "after": statistics.median(y["plan_seconds"] for y in after)}})
    out = {"config": {"models": a.models, "fractions": a.fractions,
                      "neighbourhood_time_limit_s": registry.NEIGHBOURHOOD_TIME_LIMIT,
                      "near_floor_overhead": registry.NEAR_FLOOR_OVERHEAD},
           "machine": machine(),
           "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
