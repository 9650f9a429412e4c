"""Planning models bigger than this machine (issue 48): Llama-3-8B's training step planned by a dry
run on the meta device for a GPU, and compared with PyTorch's ``MemTracker`` under ``FakeTensorMode``.

Model: ``bench/configs/llama3-8b.json`` (32 layers, width 4096, MLP 14336, 32 heads, 8 key-value
heads, vocabulary 128,256), batch 1 x 4,096 tokens, ``precision="bf16"`` (torch.autocast), AdamW;
``bench/configs/llama3-70b.json`` for the 70B-class rows (80 layers, width 8192, MLP 28672, 64 heads).
Rows (each in its own process, so that its host peak, ``getrusage`` maxrss, is its own):

- ``bf16w``: bf16 weights (pure bf16 training, bf16 AdamW state) on an H100 80 GB at 80 GiB (its
  unconstrained step fits) and at 60 GiB (it must recompute), at 2, 8 and 32 layers;
- ``fp32w``: fp32 master weights and AdamW state at 80 GiB: refused, with its minimum budget;
- ``lora``: LoRA r=16 on every projection (bf16 weights, base frozen) on an RTX 4090 at 24 GiB;
- ``70b``: Llama-3-70B's shape with bf16 weights (its full step fits no single device: the budget is
  85% of its unconstrained peak), and with LoRA r=16 on an H100 80 GB at 80 GiB (its weights alone
  are 131 GiB: refused, with the minimum);
- ``memtracker``: the unconstrained eager step of ``bf16w`` under FakeTensorMode with MemTracker
  (two steps: the first creates AdamW's state only in ``opt.step()``; the peak is the larger).

Each planned row records: compile seconds (capture to prediction), the minimum-budget search's
seconds (``report().minimum_budget``), host peak, predicted and unconstrained peaks, the minimum
budget, the peak by kind, the solver, predicted overhead and step seconds (H100 roofline).

Run:  PYTHONPATH=src .venv/bin/python bench/plan_large.py [--rows bf16w-2-60 ...] [--out bench/results]
(rows not named keep their results from the last run)
Writes bench/results/plan_large.{json,csv}. Targets (60 s, 4 GiB for Llama-3-8B) are reported, not asserted.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from _measure import machine  # noqa: E402  (bench/ is on the path: run as a script)

HERE = Path(__file__).resolve().parent
CONFIGS = {"8b": HERE / "configs" / "llama3-8b.json", "70b": HERE / "configs" / "llama3-70b.json"}
CONFIG = CONFIGS["8b"]
TARGETS = {"plan_seconds": 60.0, "host_peak_gib": 4.0}  # Llama-3-8B's; the 70B-class rows': 300 s
GiB = 1024**3

# name: (layers, weights, lora rank, device, budget[, config: CONFIGS' key, default "8b"])
ROWS = {
    "bf16w-2-80": (2, "bf16", None, "h100-80gb", "80GiB"),
    "bf16w-2-60": (2, "bf16", None, "h100-80gb", "60%"),
    "bf16w-8-80": (8, "bf16", None, "h100-80gb", "80GiB"),
    "bf16w-8-60": (8, "bf16", None, "h100-80gb", "80%"),
    "bf16w-32-80": (32, "bf16", None, "h100-80gb", "80GiB"),
    "bf16w-32-60": (32, "bf16", None, "h100-80gb", "60GiB"),
    "fp32w-32-80": (32, "fp32", None, "h100-80gb", "80GiB"),
    "lora-32-24": (32, "bf16", 16, "rtx4090-24gb", "24GiB"),
    "70b-bf16w-85": (80, "bf16", None, "h100-80gb", "85%", "70b"),
    "70b-lora-80": (80, "bf16", 16, "h100-80gb", "80GiB", "70b"),
}
MEMTRACKER = {"memtracker-2": 2, "memtracker-32": 32}


def _maxrss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB


def plan_row(name: str) -> dict:
    """One planned row, in this process."""
    import remat
    from remat.integrations.hf_config import load_config, plan_config

    layers, weights, lora, device, budget, *config = ROWS[name]
    model = config[0] if config else "8b"
    cfg = load_config(CONFIGS[model], num_hidden_layers=layers)
    row = {"row": name, "model": f"llama3-{model}", "layers": layers, "weights": weights, "lora": lora, "device": device, "budget_arg": budget,
           "batch": 1, "seq": 4096, "precision": "bf16", "optimizer": "adamw"}
    t0 = time.perf_counter()
    try:
        step, m = plan_config(cfg, 1, 4096, precision="bf16", weights=weights, optimizer="adamw", lora=lora,
                              device=device, budget=budget)
    except remat.BudgetTooSmall as e:
        row.update(fits=False, plan_seconds=time.perf_counter() - t0, minimum_budget=int(e.minimum),
                   unconstrained_peak=e.unconstrained_peak, host_peak_gib=_maxrss_gib())
        return row
    row["plan_seconds"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    r = step.report()
    c = step.compilation
    row.update(fits=True, minimum_seconds=time.perf_counter() - t1, host_peak_gib=_maxrss_gib(),
               parameters=m.parameters, trainable=m.trainable, budget=r.budget, predicted_peak=r.predicted_peak,
               device_peak=r.device_peak, unconstrained_peak=r.unconstrained_peak, minimum_budget=r.minimum_budget,
               memory=r.memory, solver=r.solver, predicted_overhead=r.predicted_overhead,
               predicted_step_seconds=r.predicted_step_seconds, predicted_recompute_seconds=r.predicted_recompute_seconds,
               instructions=r.instructions, joint_instructions=len(c.joint.entry.instrs), stage_seconds=r.stage_seconds,
               notes=[n for n in r.solver_notes if n.startswith(("instruction-level", "won", "chain of blocks"))])
    return row


def memtracker_row(name: str) -> dict:
    """PyTorch's MemTracker on the unconstrained eager step of ``bf16w`` under FakeTensorMode."""
    import torch
    import transformers as tf
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from remat.integrations.hf_config import load_config

    layers = MEMTRACKER[name]
    cfg = load_config(CONFIG, num_hidden_layers=layers)
    t0 = time.perf_counter()
    with FakeTensorMode():
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").train()
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.zeros(1, 4096, dtype=torch.long)
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            for i in range(2):  # the second step holds AdamW's state through its forward and backward
                if i:
                    mt.reset_mod_stats()  # per-module stats only; the tracker's peak spans both steps
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
        snap = mt.get_tracker_snapshot("peak")
    by = {str(getattr(k, "value", k)): int(v) for d in snap.values() for k, v in d.items()}
    return {"row": name, "layers": layers, "weights": "bf16", "device": "(fake cpu)", "seconds": time.perf_counter() - t0,
            "host_peak_gib": _maxrss_gib(), "memtracker_peak": by.get("Total"), "memtracker_by_kind": by}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="*", default=list(ROWS) + list(MEMTRACKER))
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one row, JSON on stdout
    args = ap.parse_args()
    if args.one:
        row = memtracker_row(args.one) if args.one in MEMTRACKER else plan_row(args.one)
        print("ROW " + json.dumps(row))
        return
    out = Path(args.out)
    old = out / "plan_large.json"
    kept = {r["row"]: r for r in json.loads(old.read_text())["rows"]} if old.exists() else {}
    rows = []
    for name in args.rows:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            row = {"row": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            row = json.loads(line[4:])
        row["wall_seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("memory", "notes", "stage_seconds",
                                                                    "memtracker_by_kind")}), flush=True)
    kept.update({r["row"]: r for r in rows})  # rows not run this time stay as they were
    rows = [kept[n] for n in list(ROWS) + list(MEMTRACKER) if n in kept]
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(),
            "targets": TARGETS, "configs": {k: str(v.relative_to(HERE.parent)) for k, v in CONFIGS.items()}}
    (out / "plan_large.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    fields = ["row", "model", "layers", "weights", "lora", "device", "budget_arg", "fits", "plan_seconds", "minimum_seconds",
              "host_peak_gib", "predicted_peak", "unconstrained_peak", "minimum_budget", "solver", "predicted_overhead",
              "predicted_step_seconds", "memtracker_peak", "seconds", "error"]
    with open(out / "plan_large.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
