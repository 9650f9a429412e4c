"""Setup work outside the planner against depth (issue 14): torch's capture (``torch.export``, then
``run_decompositions``) and remat's own work on it (translation to IR, training graph, passes), for
``zoo.GPT(vocab=64, seq=32, layers=L, heads=2, d=64)`` at batch 16 (``bench/plan_scale.py``'s model).

remat's three steps run on one export, ``--rounds`` times alternating two settings: ``old`` (the cyclic
garbage collector on, the IR verified after every pass: as before this change) and ``new`` (collector
paused, ``remat._gc``; the IR verified once per stage, as ``remat.compile`` does now). CPU seconds
(``time.process_time``, one thread), medians over rounds. torch's two steps are timed once.

Run:  PYTHONPATH=src .venv/bin/python bench/setup_scale.py [--layers 2 16 64] [--rounds 3]
Writes bench/results/setup_scale.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from remat import zoo
from remat._gc import cyclic_gc_paused
from remat.frontend import torch_import as ti
from remat.frontend._aten import decomposition_tables
from remat.passes.decompose import decompose_unclaimed
from remat.step.program import cleanup, training_graph

clock = time.process_time


def measure(layers: int, rounds: int) -> dict:
    """One depth: torch's capture once, then remat's steps ``rounds`` times per setting, alternating."""
    torch.manual_seed(0)
    model = zoo.GPT(64, 32, layers, 2, 64)
    example = (torch.randint(0, 64, (16, 32)), torch.randint(0, 64, (16, 32)))
    wrapper = ti._WithLoss(model, zoo.lm_loss, 1)
    wrapper.train(True)
    t = clock()
    ep = torch.export.export(wrapper, example)
    t_export = clock() - t
    t = clock()
    ep = ep.run_decompositions(decomposition_tables()[0][1])
    t_decompose = clock() - t
    runs: dict[str, list[list[float]]] = {"old": [], "new": []}
    for r in range(rounds):
        for kind in (("old", "new") if r % 2 == 0 else ("new", "old")):
            new = kind == "new"
            os.environ["REMAT_VERIFY_EACH_PASS"] = "0" if new else "1"
            row = []
            with cyclic_gc_paused(new):
                t = clock()
                imp = ti._translate(ep, wrapper, 2, True, "forward")
                row.append(clock() - t)
            with cyclic_gc_paused(new):
                t = clock()
                graph = training_graph(imp.function, len(imp.param_names))
                row.append(clock() - t)
            with cyclic_gc_paused(new):
                t = clock()
                joint = cleanup(decompose_unclaimed(graph, None))
                row.append(clock() - t)
            runs[kind].append(row)
    med = {k: [round(statistics.median(x[i] for x in v), 3) for i in range(3)] for k, v in runs.items()}
    return {"layers": layers, "forward_instructions": len(imp.function.entry.instrs),
            "joint_instructions": len(joint.entry.instrs), "torch_export_s": round(t_export, 3),
            "torch_decompose_s": round(t_decompose, 3),
            "old_s": dict(zip(("translate", "training graph", "passes"), med["old"])),
            "new_s": dict(zip(("translate", "training graph", "passes"), med["new"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 16, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for layers in args.layers:
        rows.append(measure(layers, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "setup_scale.json").write_text(json.dumps(
        {"config": {"model": "zoo.GPT(64, 32, L, 2, 64), batch 16", "rounds": args.rounds, "threads": 1,
                    "clock": "process_time", "load_avg": os.getloadavg()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
