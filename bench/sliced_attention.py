"""Attention over slices of the batch (``remat.passes.attention.chunk_attention``): what planning it
beside the reference buys in bf16, where the explicit attention kernels hold the whole batch's scores.

For each model (Hugging Face ViT and Swin as ``bench/speed.py`` builds them, and a LoRA-wrapped Qwen2
over 64-token sequences; each with ``SGD(lr=1e-3, momentum=0.9)``, ``precision="bf16"``) this
measures, in one process:

* the minimum budget with the planner's choice (``algorithms="auto"``, which plans the sliced step
  beside the reference) and with the reference alone (``algorithms="reference"``), each from
  ``BudgetTooSmall.minimum`` of a 1-byte budget, as fractions of the unconstrained peak;
* at each budget of ``--budgets``: both compiled (the reference where it fits), whether the slices
  were chosen, the predicted recomputation, VM-measured peak == predicted, the allocator peak within
  the budget, and the first step's loss and gradients bit-identical between the two (and to the
  unconstrained step's);
* step times: ``--rounds`` rounds alternating eager bf16 autocast and every compiled step; medians,
  and the ratios to eager autocast's median.

Run:  PYTHONPATH=src .venv/bin/python bench/sliced_attention.py [--models hf-vit,hf-swin,lora-qwen2]
          [--budgets 50% 65% 80%] [--rounds 15]
Writes bench/results/sliced_attention.json and prints a table. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import remat

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402  (bench/ is on the path: the Hugging Face builders live there)
from _measure import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _lora_qwen2(size: str = "small"):
    """A Qwen2 (2 layers, d64, 4 heads over 2 key/value heads) with LoRA on q and v, batch 32 of 64 tokens."""
    import peft
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, use_cache=False)
    model = peft.get_peft_model(tf.Qwen2ForCausalLM(cfg), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                                           lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (32, 64), generator=g)
    return model, dict(input_ids=ids, labels=ids.clone())


MODELS = {"hf-vit": lambda: speed.HF_MODELS["hf-vit"]("small"), "hf-swin": lambda: speed.HF_MODELS["hf-swin"]("small"),
          "lora-qwen2": _lora_qwen2}


def _fresh(name: str):
    model, kw = MODELS[name]()
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    return model, kw, opt


def _minimum(name: str, algorithms: str) -> int:
    model, kw, opt = _fresh(name)
    try:
        remat.compile(model, kw, optimizer=opt, budget=1, precision="bf16", algorithms=algorithms)
    except remat.BudgetTooSmall as e:
        return int(e.minimum)
    raise AssertionError("a 1-byte budget fitted")


def _first_step(step, model, kw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = step(**kw)
    return loss.detach().clone(), [p.detach().clone() for p in model.parameters() if p.requires_grad]


def _sliced(report) -> bool:
    return any(a.startswith("attention over slices of the batch") and ": chosen;" in a for a in report.algorithms)


def bench_model(name: str, budgets: list[str], rounds: int) -> dict:
    model, kw, opt = _fresh(name)
    base = remat.compile(model, kw, optimizer=opt, precision="bf16")
    base_loss, base_params = _first_step(base, model, kw)
    peak = base.report().unconstrained_peak
    out: dict = {"model": name, "unconstrained_peak": peak,
                 "minimum_auto": _minimum(name, "auto"), "minimum_reference": _minimum(name, "reference")}
    out["minimum_auto_fraction"] = out["minimum_auto"] / peak
    out["minimum_reference_fraction"] = out["minimum_reference"] / peak
    steps: dict[str, tuple] = {}
    rows = []
    for b in budgets:
        row: dict = {"budget": b}
        firsts = {}
        for algorithms in ("auto", "reference"):
            m, k, o = _fresh(name)
            t0 = time.perf_counter()
            try:
                s = remat.compile(m, k, optimizer=o, budget=b, precision="bf16", algorithms=algorithms)
            except remat.BudgetTooSmall as e:
                row[algorithms] = {"status": "infeasible", "minimum": int(e.minimum)}
                continue
            setup = time.perf_counter() - t0
            firsts[algorithms] = _first_step(s, m, k)
            r = s.report()
            row[algorithms] = {"status": "ok", "sliced": _sliced(r), "predicted_overhead": r.predicted_overhead,
                               "predicted_peak": r.predicted_peak, "measured_peak": r.measured_peak,
                               "measured_allocator_peak": r.measured_allocator_peak, "budget_bytes": r.budget,
                               "exact": r.measured_peak == r.predicted_peak
                               and (r.measured_allocator_peak or 0) <= r.budget, "setup_s": setup}
            steps[f"{algorithms}@{b}"] = (s, k)
        row["identical_to_unconstrained"] = {a: bool(torch.equal(l, base_loss) and all(torch.equal(p, q) for p, q in zip(ps, base_params)))
                                             for a, (l, ps) in firsts.items()}
        rows.append(row)
    out["budgets"] = rows
    # Step times: eager bf16 autocast and every compiled step, alternating.
    em, ekw, eopt = _fresh(name)

    def eager():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = em(**ekw).loss
        loss.backward()
        eopt.step()
        eopt.zero_grad()

    runs = {"eager": eager, **{n: (lambda s=s, k=k: s(**k)) for n, (s, k) in steps.items()}}
    for f in runs.values():
        for _ in range(2):
            f()
    times: dict[str, list[float]] = {n: [] for n in runs}
    for _ in range(rounds):
        for n, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    eager_s = statistics.median(times["eager"])
    out["step_s"] = {n: statistics.median(t) for n, t in times.items()}
    out["ratio_to_eager"] = {n: statistics.median(t) / eager_s for n, t in times.items() if n != "eager"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="hf-vit,hf-swin,lora-qwen2")
    ap.add_argument("--budgets", nargs="+", default=["50%", "65%", "80%"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "sliced_attention.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    for name in a.models.split(","):
        r = bench_model(name, a.budgets, a.rounds)
        results.append(r)
        print(f"{name}: minimum {r['minimum_auto_fraction']:.1%} of the unconstrained peak with slices planned, "
              f"{r['minimum_reference_fraction']:.1%} with the reference alone", flush=True)
        for row in r["budgets"]:
            cells = []
            for alg in ("auto", "reference"):
                c = row[alg]
                key = f"{alg}@{row['budget']}"
                cells.append(f"{alg}: infeasible (minimum {c['minimum']:,} B)" if c["status"] != "ok" else
                             f"{alg}: {'sliced' if c['sliced'] else 'whole'}, predicted {c['predicted_overhead']:+.1%}, "
                             f"{r['ratio_to_eager'][key]:.3f}x eager, exact {c['exact']}")
            print(f"  {row['budget']:>4}  " + " | ".join(cells) + f"  identical {row['identical_to_unconstrained']}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"config": {"models": a.models, "budgets": a.budgets, "rounds": a.rounds,
                                            "threads": a.threads, "precision": "bf16",
                                            "optimizer": "SGD(lr=1e-3, momentum=0.9)"},
                                 "machine": machine(), "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
