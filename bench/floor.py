"""Memory-floor benchmark (issue 10): how low can a training step's budget go, and how large a batch fits?

Five parts, each with whatever op alternatives the op registry declares (this script names none):

* ``gpt``: the GPT medium of bench/speed.py (``zoo.make("gpt", "medium")``: 8 layers, d512, seq 256,
  batch 8, vocab 8000, no optimizer: gradients only). Its unconstrained peak; the minimum feasible
  budget of the whole-batch step and of each micro-batch count ``k`` dividing the batch (the
  ``BudgetTooSmall`` minimum of a compile at 1 byte, which is itself a feasible budget), as % of the
  unconstrained peak; one step at the smallest of them with measured == predicted checked; and the
  step at 25% (``micro_batches="auto"``) against the unconstrained step: ``--rounds`` alternating
  rounds in one process, median of the per-round ratio. Without an optimizer every gradient is a
  result of the step, live at its end: parameters and gradients alone are ~29.5% of the peak.
* ``gpt_sgd``: the same with ``torch.optim.SGD`` (each gradient consumed by its update inside the
  step), where 25% can be judged: parameters are ~14.7% of the peak. Micro-batching keeps every
  gradient (the accumulators) until the updates, so there the whole-batch step is the floor.
* ``max_batch``: the same GPT with ``torch.optim.AdamW`` under a 1.5 GiB cap (parameters, gradients
  and optimizer state included): ``remat.max_batch`` (compiled candidates, none run) against eager
  PyTorch's largest batch (allocator peak of a steady-state step from torch.profiler's memory
  events, measured per candidate), then one remat step at its batch (measured == predicted <= cap).
* ``zoo``: each zoo model at size ``small``, no optimizer, batch doubled from the size's default until
  the minimum feasible budget over micro-batch counts ``ZOO_MICRO_BATCHES`` is <= 25% of the whole
  batch's unconstrained peak (at most ``--max-doublings``); at that batch one step at 25% (measured ==
  predicted <= budget). Each model's least percentage reached is reported, and the minimum with kernel
  workspaces not counted beside it.
* ``hf``: models nobody here wrote, Hugging Face ``transformers`` image classifiers with batch norm (tiny
  configs, random weights, batch 16 of 64x64 images, no optimizer): the minimum with the reference
  algorithms and with the planner's choice, and one step at the latter (measured == predicted).

Targets (issue 10) are reported as pass/fail lines, never asserted. Timings are noisy on a shared
machine: ratios come from alternating runs in one process.

Run:  PYTHONPATH=src .venv/bin/python bench/floor.py [--quick] [--parts gpt,gpt_sgd,max_batch,zoo,hf] [--merge]
Writes bench/results/floor.json (floor_quick.json with --quick); with ``--merge`` the parts not run are
kept from that file, and ``config.measured_at`` names the revision each part was measured at.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

import remat
from remat import zoo
from remat.errors import format_bytes
from remat.train.max_batch import eager_max_batch, max_batch
from remat.train.microbatch import MicroBatchingRefused

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("gpt", "gpt_sgd", "max_batch", "zoo", "hf")
MIB = 1 << 20


def _log(msg: str) -> None:
    print(msg, flush=True)


def _revision(of: Path | None = None) -> str:
    """The checkout's git revision (with ``+changes`` when the work tree differs from it), or with ``of``
    the last commit that changed that file."""
    root = Path(__file__).resolve().parent.parent
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"] if of is None else ["git", "log", "-1", "--format=%h", "--", str(of)]
        rev = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        if of is not None:
            return rev or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+changes" if dirty else "")


def minimum(model, example, loss_fn, **options) -> tuple[int, int]:
    """``(minimum feasible budget, whole batch's unconstrained peak)`` in bytes, from the
    ``BudgetTooSmall`` a compile at 1 byte raises."""
    try:
        remat.compile(model, example, loss_fn, budget=1, **options)
    except remat.BudgetTooSmall as e:
        return e.minimum, e.unconstrained_peak
    raise AssertionError("a 1-byte budget compiled")


def one_step(step, example) -> dict[str, Any]:
    """Run one step; its predicted and measured peak and whether they agree within the budget."""
    step(*example)
    measured = step.last_stats.peak_bytes
    return {"predicted_peak": step.predicted_peak, "measured_peak": measured,
            "measured_eq_predicted": measured == step.predicted_peak,
            "within_budget": step.budget is None or measured <= step.budget}


def alternate(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each step, ``rounds`` rounds alternating between them (order rotating)."""
    names = list(steps)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            steps[n]()
            out[n].append(time.perf_counter() - t0)
    return out


def gpt_part(size: str, rounds: int, sgd: bool = False) -> dict[str, Any]:
    """The GPT's floor without an optimizer (its gradients are returned: all of them live at the end
    of the step), or with ``torch.optim.SGD`` (each gradient consumed by its update in the step)."""
    model, example, loss_fn = zoo.make("gpt", size)
    opt = {"optimizer": torch.optim.SGD(model.parameters(), lr=1e-3)} if sgd else {}
    batch = example[0].shape[0]
    _log(f"gpt {size}{' with SGD' if sgd else ''}: batch {batch}, compiling the unconstrained step ...")
    free = remat.compile(model, example, loss_fn, **opt)
    free_run = one_step(free, example)
    U = free.unconstrained_peak
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"model": f"zoo gpt {size}", "batch": batch,
                           "optimizer": "SGD(lr=1e-3)" if sgd else "none (gradients only)",
                           "unconstrained_peak": U, "parameter_bytes": params, "parameters_fraction": params / U,
                           "unconstrained_run": free_run, "minimum_by_micro_batches": {}}
    for k in [d for d in range(1, batch + 1) if batch % d == 0]:
        t0 = time.perf_counter()
        m, _ = minimum(model, example, loss_fn, micro_batches=k, full_batch_peak=U, **opt)
        out["minimum_by_micro_batches"][k] = {"minimum": m, "fraction": m / U, "seconds": time.perf_counter() - t0}
        _log(f"  k={k}: minimum {format_bytes(m)} = {m / U:.1%} of {format_bytes(U)}")
    mins = out["minimum_by_micro_batches"]
    k_best = min(mins, key=lambda k: mins[k]["minimum"])
    m_best = mins[k_best]["minimum"]
    step = remat.compile(model, example, loss_fn, budget=m_best, micro_batches=k_best, full_batch_peak=U, **opt)
    out["minimum"] = {"micro_batches": k_best, "budget": m_best, "fraction": m_best / U, "solver": step.compilation.plan.solver,
                      "algorithms": step.report().algorithms, **one_step(step, example)}
    out["minimum_whole_batch"] = {"budget": mins[1]["minimum"], "fraction": mins[1]["minimum"] / U}
    _log(f"  minimum {m_best / U:.1%} at k={k_best}: measured == predicted: {out['minimum']['measured_eq_predicted']}")
    try:
        s25 = remat.compile(model, example, loss_fn, budget="25%", micro_batches="auto", **opt)
    except remat.BudgetTooSmall as e:
        out["at_25"] = {"feasible": False, "minimum": e.minimum, "error": str(e)}
        _log(f"  25%: infeasible ({e})")
        return out
    run = one_step(s25, example)
    times = alternate({"unconstrained": lambda: free(*example), "at_25": lambda: s25(*example)}, rounds)
    ratios = [a / b for a, b in zip(times["at_25"], times["unconstrained"])]
    out["at_25"] = {"feasible": True, "budget": s25.budget, "micro_batches": s25.micro_batches,
                    "algorithms": s25.report().algorithms,
                    "micro_batch_choice": s25.report().micro_batch_choice, "solver": s25.compilation.plan.solver,
                    "recomputed_instructions": s25.compilation.recomputed, "predicted_overhead": s25.compilation.plan.overhead,
                    **run, "step_s_median": statistics.median(times["at_25"]),
                    "unconstrained_step_s_median": statistics.median(times["unconstrained"]),
                    "time_ratio_median": statistics.median(ratios), "time_ratios": ratios}
    _log(f"  25%: k={s25.micro_batches}, step x{out['at_25']['time_ratio_median']:.2f} of unconstrained "
         f"(median of {rounds} alternating rounds)")
    return out


def max_batch_part(size: str, budget: str) -> dict[str, Any]:
    model, _, loss_fn = zoo.make("gpt", size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def make_batch(n: int):
        return zoo.make("gpt", size, batch=n)[1]

    _log(f"max batch: gpt {size}, AdamW, budget {budget}")
    t0 = time.perf_counter()
    res = max_batch(model, make_batch, loss_fn, optimizer=opt, budget=budget, progress=lambda m: _log("  " + m))
    t_remat = time.perf_counter() - t0
    t0 = time.perf_counter()
    eager, eager_probes = eager_max_batch(model, make_batch, loss_fn, optimizer=opt, budget=budget,
                                          progress=lambda m: _log("  " + m))
    t_eager = time.perf_counter() - t0
    run = one_step(res.step, make_batch(res.batch)) if res.step is not None else None
    return {"model": f"zoo gpt {size}", "optimizer": "AdamW(lr=1e-3)", "budget": res.budget,
            "remat_batch": res.batch, "eager_batch": eager,
            "ratio": res.batch / eager if eager else None,
            "remat_probes": [vars(p) for p in res.probes], "eager_probes": [vars(p) for p in eager_probes],
            "remat_search_s": t_remat, "eager_search_s": t_eager, "remat_solver": getattr(res.step, "solver", None),
            "remat_run": run}


ZOO_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
"""Micro-batch counts the zoo part tries at each batch (those dividing it). Not ``"auto"``: that tries
every divisor of the batch, thousands of micro-batches at the large batches searched here."""


def zoo_part(size: str, max_doublings: int) -> list[dict[str, Any]]:
    """Each zoo model at batches doubling from its size's default: the minimum feasible budget (as % of
    the whole batch's unconstrained peak) at each micro-batch count, the least over them, until one is
    <= 25%; there, one step at 25% (measured == predicted <= budget). Models with batch norm refuse
    micro-batching (their statistics are over the whole batch), so only ``k = 1`` counts for them.
    ``minimum_vm_only``: the same minimum with kernel workspaces not counted (the VM's count alone),
    which shows how much of a floor the kernels' own temporaries set."""
    rows = []
    for name in ("mlp", "resnet", "gpt", "unet"):
        model, example, loss_fn = zoo.make(name, size)
        b0 = example[0].shape[0]
        tried = []
        row: dict[str, Any] = {"model": f"zoo {name} {size}", "optimizer": "none (gradients only)", "tried": tried,
                               "reaches_25": False}
        for j in range(max_doublings + 1):
            n = b0 * 2 ** j
            model, example, loss_fn = zoo.make(name, size, batch=n)
            U = remat.compile(model, example, loss_fn).unconstrained_peak
            entry: dict[str, Any] = {"batch": n, "unconstrained_peak": U, "by_micro_batches": {}}
            t0 = time.perf_counter()
            for k in (k for k in ZOO_MICRO_BATCHES if n % k == 0):
                try:
                    m, _ = minimum(model, example, loss_fn, micro_batches=k, full_batch_peak=U)
                except MicroBatchingRefused as e:
                    entry["micro_batching_refused"] = str(e)
                    break
                entry["by_micro_batches"][k] = {"minimum": m, "fraction": m / U}
            k_best = min(entry["by_micro_batches"], key=lambda k: entry["by_micro_batches"][k]["minimum"])
            m = entry["by_micro_batches"][k_best]["minimum"]
            m_vm, _ = minimum(model, example, loss_fn, micro_batches=k_best, full_batch_peak=U, count_workspaces=False)
            entry.update(minimum=m, fraction=m / U, micro_batches=k_best, minimum_vm_only=m_vm,
                         fraction_vm_only=m_vm / U, seconds=time.perf_counter() - t0)
            tried.append(entry)
            _log(f"zoo {name} batch {n}: minimum {m / U:.1%} of {format_bytes(U)} at k={k_best} "
                 f"(VM only: {m_vm / U:.1%}){' (micro-batching refused)' if 'micro_batching_refused' in entry else ''}")
            if m <= 0.25 * U:
                step = remat.compile(model, example, loss_fn, budget="25%", micro_batches=k_best, full_batch_peak=U)
                row.update(reaches_25=True, batch=n, micro_batches=k_best, budget=step.budget, solver=step.compilation.plan.solver,
                           **one_step(step, example))
                break
        best = min(tried, key=lambda e: e["fraction"])
        row.update(best_fraction=best["fraction"], best_batch=best["batch"], best_micro_batches=best["micro_batches"])
        rows.append(row)
    return rows


def _hf_conv_nets() -> dict[str, Callable[[], torch.nn.Module]]:
    """Hugging Face ``transformers`` image classifiers with batch norm, tiny configs, random weights."""
    import transformers as tf

    return {
        "hf ResNet (bottleneck)": lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[2, 2, 2], layer_type="bottleneck",
            num_labels=10)),
        "hf RegNet": lambda: tf.RegNetForImageClassification(tf.RegNetConfig(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 2, 1], groups_width=8,
            num_labels=10)),
        "hf MobileNetV2": lambda: tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
            num_channels=3, image_size=64, depth_multiplier=0.35, num_labels=10)),
    }


def _hf_loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits if hasattr(out, "logits") else out, target)


def hf_part(batch: int) -> list[dict[str, Any]]:
    """Models nobody here wrote: each ``_hf_conv_nets`` model on random 64x64 images, no optimizer. Its
    minimum feasible budget with the reference algorithms only and with the planner's choice
    (``algorithms="auto"``: the split batch-norm backward, without ATen's unused buffer), as fractions
    of the unconstrained peak; one step at the "auto" minimum (measured == predicted <= budget) and the
    choice it reports."""
    rows = []
    for name, make in _hf_conv_nets().items():
        torch.manual_seed(0)
        model = make()
        example = (torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,)))
        t0 = time.perf_counter()
        ref, U = minimum(model, example, _hf_loss, algorithms="reference")
        auto, _ = minimum(model, example, _hf_loss)
        step = remat.compile(model, example, _hf_loss, budget=auto)
        row = {"model": name, "batch": batch, "unconstrained_peak": U, "minimum_reference": ref,
               "fraction_reference": ref / U, "minimum_auto": auto, "fraction_auto": auto / U,
               "algorithms": step.report().algorithms, **one_step(step, example),
               "seconds": time.perf_counter() - t0}
        _log(f"{name} batch {batch}: minimum {ref / U:.1%} (reference algorithms) -> {auto / U:.1%} (auto) of "
             f"{format_bytes(U)}; at it measured == predicted: {row['measured_eq_predicted']}")
        rows.append(row)
    return rows


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets as pass/fail lines (None: not measured)."""
    out = []

    def add(what: str, value, ok) -> None:
        out.append({"target": what, "value": value, "met": ok})

    res = {k: v for k, v in res.items() if k in ("gpt", "gpt_sgd", "max_batch", "zoo")}
    # without an optimizer, and with SGD (gradients consumed by the update in the step: the target
    # judged where it is reachable)
    for key, name in (("gpt", "GPT medium"), ("gpt_sgd", "GPT medium with SGD")):
        g = res.get(key)
        if not g:
            continue
        add(f"{name}: minimum feasible budget <= 25% of the unconstrained peak", g["minimum"]["fraction"],
            g["minimum"]["fraction"] <= 0.25)
        add(f"{name}: measured == predicted at the minimum", g["minimum"]["measured_eq_predicted"],
            g["minimum"]["measured_eq_predicted"])
        a = g.get("at_25", {})
        add(f"{name}: step at 25% within 1.5x of the unconstrained step", a.get("time_ratio_median"),
            a.get("feasible") and a["time_ratio_median"] <= 1.5)
    mb = res.get("max_batch")
    if mb:
        add("largest batch under 1.5 GiB with AdamW >= 4x eager's", mb["ratio"],
            mb["ratio"] is not None and mb["ratio"] >= 4)
    z = res.get("zoo")
    if z:
        add("every zoo model reaches 25% at some batch size",
            {r["model"]: round(r["best_fraction"], 4) if "best_fraction" in r else r["reaches_25"] for r in z},
            all(r["reaches_25"] for r in z))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="GPT tiny instead of medium, a 2 MiB cap, zoo at tiny")
    ap.add_argument("--parts", default="gpt,gpt_sgd,max_batch,zoo,hf", help="comma-separated parts (default: all)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds (default: 5)")
    ap.add_argument("--max-doublings", type=int, default=5, help="zoo: batch doublings tried (default: 5)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    ap.add_argument("--out", default=str(RESULTS), help="output folder (default: bench/results)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the parts not run from the existing results file (each part records the revision "
                         "it was measured at)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = [p for p in args.parts.split(",") if p]
    t0 = time.perf_counter()
    res: dict[str, Any] = {}
    gsize, zsize, cap = ("tiny", "tiny", "2MiB") if args.quick else ("medium", "small", "1.5GiB")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("floor_quick.json" if args.quick else "floor.json")
    measured_at: dict[str, Any] = {}
    if args.merge and path.exists():
        old = json.loads(path.read_text())
        measured_at = old.get("config", {}).get("measured_at", {})
        res.update({k: v for k, v in old.items() if k in PARTS and k not in parts})
        measured_at = {k: v for k, v in measured_at.items() if k in res}
        for k in res:  # files written before parts recorded their revision: the commit that added the file
            measured_at.setdefault(k, f"before {_revision(path)}")

    def write() -> None:  # after every part, so a long run interrupted keeps what it measured
        res["targets"] = targets({k: v for k, v in res.items() if not (isinstance(v, dict) and "error" in v)})
        res["config"] = {"quick": args.quick, "parts": parts, "measured_at": measured_at, "rounds": args.rounds,
                         "threads": torch.get_num_threads(), "wall_s": time.perf_counter() - t0,
                         "torch": torch.__version__}
        path.write_text(json.dumps(res, indent=1, default=str) + "\n")

    for part, run in (("gpt", lambda: gpt_part(gsize, args.rounds)),
                      ("gpt_sgd", lambda: gpt_part(gsize, args.rounds, sgd=True)),
                      ("max_batch", lambda: max_batch_part(gsize, cap)),
                      ("zoo", lambda: zoo_part(zsize, args.max_doublings)),
                      ("hf", lambda: hf_part(4 if args.quick else 16))):
        if part in parts:
            try:
                res[part] = run()
            except Exception as e:  # noqa: BLE001  a part that fails is recorded, the others still run
                traceback.print_exc()
                res[part] = {"error": f"{type(e).__name__}: {e}"}
            measured_at[part] = _revision()
            write()
    write()
    _log("\ntargets:")
    for t in res["targets"]:
        _log(f"  [{'met' if t['met'] else 'NOT met' if t['met'] is not None else '-'}] {t['target']}: {t['value']}")
    _log(f"wrote {path} in {res['config']['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
