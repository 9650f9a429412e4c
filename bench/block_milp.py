"""What the block MILP (``remat.plan.inner.milp_recipes``) buys under ``solver="auto"``: plans and setup
time with and without it, in this one process.

For each model (the ``transformers`` models of ``tests/models/hf_zoo.py`` at tiny configs with random
weights, their own loss; zoo ResNet, GPT and U-Net ``small`` with SGD momentum 0.9), one budget
(``--budget``, default 50% of the unconstrained peak) is compiled in alternation with the block MILP
off and on (``inner.BLOCK_MILP_SOLVERS`` without and with ``"auto"``), ``--rounds`` times each, a fresh
frontier and ``REMAT_SOLVE_CACHE=0`` every time, after one untimed warm-up compile (capture cache,
kernels). Per model: the predicted overhead of each (or the minimum a refusal names) and the median
``remat.compile`` seconds of each. Writes ``bench/results/block_milp.json``.

    PYTHONPATH=src .venv/bin/python bench/block_milp.py [--models gpt2,t5,resnet-zoo] [--precision bf16]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import remat
from remat import zoo
from remat.plan import inner
from remat.plan.frontier import forget_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from hf_zoo import MODELS as HF_MODELS  # noqa: E402  (the model table lives with the tests)
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

ZOO = ("resnet-zoo", "gpt-zoo", "unet-zoo")


def _compile(name: str, budget: float, precision: str):
    """One fresh compile of ``name`` at ``budget``: (seconds, the plan's predicted overhead or None,
    the refusal's minimum or None)."""
    if name in ZOO:
        model, example, loss_fn = zoo.make(name.removesuffix("-zoo"), "small")
        kw = dict(loss_fn=loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
        args: tuple = (model, example)
    else:
        model, inputs = {m.name: m for m in HF_MODELS}[name].build()
        kw, args = dict(count_workspaces=False), (copy.deepcopy(model), inputs)
    forget_plans()
    t0 = time.perf_counter()
    try:
        step = remat.compile(*args, budget=budget, precision=precision, **kw)
    except remat.BudgetTooSmall as e:
        return time.perf_counter() - t0, None, e.minimum
    return time.perf_counter() - t0, step.compilation.plan.overhead, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join([m.name for m in HF_MODELS] + list(ZOO)))
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "block_milp.json"))
    a = ap.parse_args()
    os.environ["REMAT_SOLVE_CACHE"] = "0"  # every compile plans afresh
    torch.set_num_threads(2)
    t_all = time.perf_counter()
    rows = []
    for name in a.models.split(","):
        _compile(name, a.budget, a.precision)  # warm-up: capture cache, kernels
        seen: dict[bool, list] = {False: [], True: []}
        for _ in range(a.rounds):
            for on in (False, True):
                inner.BLOCK_MILP_SOLVERS = ("auto", "milp") if on else ("milp",)
                seen[on].append(_compile(name, a.budget, a.precision))
        row = {"model": name}
        for on, key in ((False, "without"), (True, "with")):
            _, overhead, minimum = seen[on][-1]
            row[key] = {"compile_s": statistics.median(x[0] for x in seen[on]), "overhead": overhead, "minimum": minimum}
        row["same_plan_cost"] = (row["with"]["overhead"], row["with"]["minimum"]) == (row["without"]["overhead"],
                                                                                     row["without"]["minimum"])
        row["compile_ratio"] = row["with"]["compile_s"] / row["without"]["compile_s"]
        rows.append(row)
        w, wo = row["with"], row["without"]
        show = (lambda r: f"{r['overhead']:+.2%}" if r["overhead"] is not None else f"refused, minimum {r['minimum']:,} B")
        print(f"{name:12s} without {show(wo):>28s} {wo['compile_s']:5.1f} s | with {show(w):>28s} {w['compile_s']:5.1f} s"
              f" | compile x{row['compile_ratio']:.2f}", flush=True)
    out = {"config": {"budget": a.budget, "precision": a.precision, "rounds": a.rounds, "threads": 2,
                      "wall_s": time.perf_counter() - t_all},
           "machine": machine(), "results": rows,
           "summary": {"same_plan_cost": sum(r["same_plan_cost"] for r in rows), "models": len(rows),
                       "compile_s_without": sum(r["without"]["compile_s"] for r in rows),
                       "compile_s_with": sum(r["with"]["compile_s"] for r in rows)}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"same plan cost on {out['summary']['same_plan_cost']} of {len(rows)}; compile seconds "
          f"{out['summary']['compile_s_without']:.1f} without, {out['summary']['compile_s_with']:.1f} with; wrote {a.out}")


if __name__ == "__main__":
    main()
