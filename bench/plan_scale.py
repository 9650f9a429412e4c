"""Setup time of ``remat.compile`` against graph size (issue 14): a narrow GPT swept in depth and a
long MLP chain, each stage of the setup timed (``report().stage_seconds``).

Models: ``zoo.GPT(vocab=64, seq=32, layers=L, heads=2, d=64)``, batch 16, for L in ``--layers``
(default 2 4 8 16 32 64 128: 32 layers are about 2,500 graph nodes, 128 about 10,000), and an MLP of ``--mlp-layers`` (default 1000) ``Linear(32, 32) + ReLU``
layers, batch 16, MSE loss. SGD with momentum, budget ``--budget`` (default 0.5 of the unconstrained
peak), static cost model, one thread. Each model is compiled once, in this process, in order.

Run:  PYTHONPATH=src .venv/bin/python bench/plan_scale.py [--layers 2 16] [--mlp-layers 0] [--out DIR] [--merge]
(``--merge``: keep the rows of the existing ``plan_scale.json`` for models not run this time.)
Writes bench/results/plan_scale.json (one row per model: instructions, graph nodes, seconds per
stage, planner and predicted overhead), bench/results/plan_scale.png (plan time against graph nodes)
and prints a table. Targets are reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import remat
from remat import zoo
from remat.plan.rematerialize import to_graph
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

TARGETS = {"gpt16_plan_s": 5.0, "gpt16_setup_s": 15.0, "gpt32_plan_s": 5.0, "gpt64_plan_s": 20.0, "gpt2_overhead": 0.5}


def gpt(layers: int):
    """The issue's narrow GPT and its example batch (inputs + targets)."""
    torch.manual_seed(0)
    model = zoo.GPT(64, 32, layers, 2, 64)
    idx, tgt = torch.randint(0, 64, (16, 32)), torch.randint(0, 64, (16, 32))
    return model, (idx, tgt), zoo.lm_loss


def mlp(layers: int, width: int = 32):
    """A chain of ``layers`` Linear + ReLU layers and its example batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    return model, (torch.randn(16, width), torch.randn(16, width)), nn.functional.mse_loss


def measure(name: str, layers: int, build, budget: float) -> dict:
    """Compile one model and return its row (sizes, seconds per stage, plan). A budget below the
    model's minimum (the long MLP's parameters and optimizer state alone exceed half its peak) is
    refused; the row then plans at the minimum the refusal names, and says so."""
    model, example, loss = build(layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    t0 = time.perf_counter()
    refused = None
    try:
        step = remat.compile(model, example, loss, optimizer=opt, budget=budget)
    except remat.BudgetTooSmall as e:
        refused = {"budget": budget, "seconds_to_refuse": time.perf_counter() - t0, "minimum": e.minimum}
        t0 = time.perf_counter()
        step = remat.compile(model, example, loss, optimizer=opt, budget=e.minimum)
    setup = time.perf_counter() - t0
    rep = step.report()
    joint_instrs = sum(1 for i in step.compilation.joint.entry.instrs if i.op.name != "return")
    nodes = len(to_graph(step.compilation.joint, step.compilation.costs).graph.compute_nodes)
    return {"model": name, "layers": layers, "joint_instructions": joint_instrs, "graph_nodes": nodes,
            "program_instructions": step.compilation.instructions, "setup_s": setup,
            "plan_s": rep.stage_seconds.get("plan"), "stage_seconds": rep.stage_seconds,
            "solver": step.compilation.plan.solver, "predicted_overhead": step.compilation.plan.overhead, "notes": list(step.compilation.notes),
            "budget_bytes": step.budget, "predicted_peak": step.predicted_peak, "refused": refused}


def growth(rows: list[dict], a: int, b: int) -> dict | None:
    """Plan-time growth between GPT depths a and b against graph-node growth (1.0 = linear)."""
    ra = next((r for r in rows if r["model"] == "gpt" and r["layers"] == a), None)
    rb = next((r for r in rows if r["model"] == "gpt" and r["layers"] == b), None)
    if ra is None or rb is None:
        return None
    t, n = rb["plan_s"] / ra["plan_s"], rb["graph_nodes"] / ra["graph_nodes"]
    import math
    return {"from_layers": a, "to_layers": b, "plan_time_ratio": t, "graph_nodes_ratio": n,
            "exponent": math.log(t) / math.log(n)}


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets as PASS/FAIL records (``met`` None when not measured)."""
    def row(layers):
        return next((r for r in rows if r["model"] == "gpt" and r["layers"] == layers), None)

    out = []
    for what, layers, key, limit in (("16 layers: planning <= 5 s", 16, "plan_s", TARGETS["gpt16_plan_s"]),
                                     ("16 layers: setup <= 15 s", 16, "setup_s", TARGETS["gpt16_setup_s"]),
                                     ("32 layers (~2,500 nodes): planning <= 5 s", 32, "plan_s",
                                      TARGETS["gpt32_plan_s"]),
                                     ("64 layers: planning <= 20 s", 64, "plan_s", TARGETS["gpt64_plan_s"]),
                                     ("2 layers: predicted overhead <= +50%", 2, "predicted_overhead",
                                      TARGETS["gpt2_overhead"])):
        r = row(layers)
        value = None if r is None else r[key]
        out.append({"target": what, "value": value, "met": None if value is None else value <= limit})
    r = row(128)
    out.append({"target": "128 layers (~10,000 nodes): plan time recorded (no target)",
                "value": None if r is None else r["plan_s"], "met": None})
    g = growth(rows, 16, 64)
    out.append({"target": "plan time ~linear in graph nodes, 16 -> 64 layers (exponent <= 1.2)",
                "value": None if g is None else g["exponent"], "met": None if g is None else g["exponent"] <= 1.2})
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Plan time against graph nodes, log-log, one series per model family."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, marker in (("gpt", "o"), ("mlp", "s")):
        rs = [r for r in rows if r["model"] == name]
        if rs:
            ax.plot([r["graph_nodes"] for r in rs], [r["plan_s"] for r in rs], marker=marker, label=name)
            for r in rs:
                ax.annotate(f"{r['layers']}", (r["graph_nodes"], r["plan_s"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph nodes (compute nodes of the training graph)")
    ax.set_ylabel("plan stage (s)")
    ax.set_title("remat.compile: plan time against graph size (budget 50%, 1 thread)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[2, 4, 8, 16, 32, 64, 128], help="GPT depths")
    ap.add_argument("--mlp-layers", type=int, default=1000, help="MLP chain length (0: skip)")
    ap.add_argument("--budget", type=float, default=0.5, help="fraction of the unconstrained peak")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--merge", action="store_true", help="keep the existing file's rows for models not run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    runs = [("gpt", L, gpt) for L in args.layers] + ([("mlp", args.mlp_layers, mlp)] if args.mlp_layers else [])
    rows = []
    print(f"{'model':>5} {'layers':>6} {'joint instrs':>12} {'nodes':>6} {'setup s':>8} {'plan s':>7}  "
          f"{'capture':>7} {'graph':>6} {'passes':>6}  solver (predicted overhead)")
    for name, layers, build in runs:
        r = measure(name, layers, build, args.budget)
        rows.append(r)
        st = r["stage_seconds"]
        print(f"{name:>5} {layers:>6} {r['joint_instructions']:>12} {r['graph_nodes']:>6} {r['setup_s']:>8.2f} "
              f"{r['plan_s']:>7.2f}  {st.get('capture', 0):>7.2f} {st.get('training graph', 0):>6.2f} "
              f"{st.get('passes', 0):>6.2f}  {r['solver']} ({r['predicted_overhead']:+.0%})"
              + ("" if r["refused"] is None else f"  [{args.budget:.0%} refused; planned at the minimum "
                                                 f"{r['refused']['minimum']:,} B]"), flush=True)
    if args.merge and (Path(args.out) / "plan_scale.json").exists():
        old = json.loads((Path(args.out) / "plan_scale.json").read_text())["rows"]
        ran = {(r["model"], r["layers"]) for r in rows}
        rows = sorted([r for r in old if (r["model"], r["layers"]) not in ran] + rows,
                      key=lambda r: (r["model"] != "gpt", r["layers"]))
    res = {"config": {"gpt": "zoo.GPT(vocab=64, seq=32, layers=L, heads=2, d=64), batch 16",
                      "mlp": f"{args.mlp_layers} x (Linear(32, 32) + ReLU), batch 16, MSE",
                      "optimizer": "SGD(lr=1e-3, momentum=0.9)", "budget": args.budget, "threads": args.threads,
                      "cost_model": "static", "merged": args.merge, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0},
           "machine": {**machine(), "load_avg": os.getloadavg()},
           "rows": rows, "growth_16_64": growth(rows, 16, 64), "targets": targets(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_scale.json").write_text(json.dumps(res, indent=1, default=float))
    plot(rows, out / "plan_scale.png")
    for t in res["targets"]:
        met = "n/a" if t["met"] is None else "PASS" if t["met"] else "FAIL"
        print(f"{met:>4}  {t['target']}: {t['value']}")
    print(f"wrote {out / 'plan_scale.json'} and {out / 'plan_scale.png'}")


if __name__ == "__main__":
    main()
