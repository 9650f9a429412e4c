"""Buffer reuse (issues 8 and 10): what writing element-wise results over a dying operand buys.

Since ``remat.ir.reuse``, an element-wise result (or a fused kernel's first) takes the buffer of an
operand of its type that dies with it, and its kernel writes in place. This compares, alternating in
one process, per model and budget of ``bench/speed.py`` (its own model builders, SGD with momentum
where it uses it): eager PyTorch, remat, and remat compiled and run with reuse off
(``remat.ir.reuse.disabled()``). A percentage budget is of each step's own unconstrained peak, as in
``bench/speed.py``; so at a budget the two remat steps plan for different byte counts, the same
share of the peak each would have. Per method: median step time over ``--rounds`` rounds (the order
reversed every other round), its ratio to eager, the median per-round ratio of reuse on to off, the
predicted peak (VM-measured, checked equal), the unconstrained peak the budget is relative to, and
the recomputed instructions.

    PYTHONPATH=src .venv/bin/python bench/buffer_reuse.py [--models unet,resnet,mlp,gpt] [--budgets none,50%] [--rounds 21]

Writes ``bench/results/buffer_reuse.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402  (bench/speed.py: the same models, methods and timed step)

from remat.ir.reuse import disabled  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _method(spec: "speed.ModelSpec", budget: str | None, reuse: bool) -> Any:
    method = "remat" if budget is None else f"remat@{budget}"
    if reuse:
        return speed._remat(spec, method)
    with disabled():  # planned, lowered and prepared for the VM without reuse
        return speed._remat(spec, method)


def _vm_reused(step: Any) -> int:
    """Kernels the step's VM runs over an operand's buffer (as it was prepared, reuse on or off)."""
    plan = step.vm._plans[step.program.name]
    return sum(1 for bp in plan.blocks for s in bp.steps
               if s.fn is not None and s.alias and s.alias[0] >= 0 and not s.ins.op.aliases)


def compare(name: str, budget: str | None, rounds: int, quick: bool = False) -> dict[str, Any]:
    spec = speed.model_specs(quick)[name]
    methods = {"eager": speed._eager_like(spec, "eager"), "reuse": _method(spec, budget, True),
               "no reuse": _method(spec, budget, False)}
    row: dict[str, Any] = {"model": name, "budget": budget or "none"}
    if any(m.row.status != "ok" for m in methods.values()):
        row["status"] = {k: m.row.status for k, m in methods.items()}
        row["error"] = {k: m.row.error for k, m in methods.items() if m.row.error}
        return row
    for m in methods.values():
        for _ in range(2):
            speed._one_step(m)
    times: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(rounds):
        order = list(methods.items()) if r % 2 == 0 else list(reversed(methods.items()))
        for k, m in order:
            times[k].append(speed._one_step(m)[0])
    eager = statistics.median(times["eager"])
    for k, m in methods.items():
        t = statistics.median(times[k])
        entry: dict[str, Any] = {"step_s": t, "x_eager": t / eager}
        if k != "eager":
            st = m.compiled
            measured = st.last_stats.peak_bytes
            entry.update(reused_buffers=_vm_reused(st), predicted_peak=st.predicted_peak, measured_peak=measured,
                         measured_eq_predicted=measured == st.predicted_peak,
                         unconstrained_peak=st.report().unconstrained_peak, recomputed=st.compilation.recomputed)
        row[k] = entry
    row["reuse_over_no_reuse"] = statistics.median(a / b for a, b in zip(times["reuse"], times["no reuse"]))
    row["status"] = "ok"
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="unet,resnet,mlp,gpt", help="comma-separated models of bench/speed.py")
    p.add_argument("--budgets", default="none,50%", help="comma-separated: none (unconstrained) or percentages")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny sizes (numbers meaningless), buffer_reuse_quick.json")
    p.add_argument("--out", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    known = speed.model_specs(a.quick)
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if m not in known:
            p.error(f"unknown model {m!r}; valid: {', '.join(known)}")
    budgets = [None if b == "none" else b for b in a.budgets.split(",") if b]
    t0 = time.perf_counter()
    rows = []
    for m in models:
        for b in budgets:
            r = compare(m, b, a.rounds, a.quick)
            rows.append(r)
            if r["status"] == "ok":
                print(f"{m:10s} {r['budget']:5s} eager {r['eager']['step_s'] * 1e3:7.1f} ms   reuse "
                      f"{r['reuse']['x_eager']:.3f}x  no reuse {r['no reuse']['x_eager']:.3f}x   reuse / no reuse "
                      f"{r['reuse_over_no_reuse']:.3f}   peaks {r['reuse']['predicted_peak']:,} / "
                      f"{r['no reuse']['predicted_peak']:,}   recomputed {r['reuse']['recomputed']} / "
                      f"{r['no reuse']['recomputed']}", flush=True)
            else:
                print(f"{m:10s} {r['budget']:5s} {r['status']}", flush=True)
    doc = {"config": {"quick": a.quick, "rounds": a.rounds, "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "wall_s": time.perf_counter() - t0}, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / ("buffer_reuse_quick.json" if a.quick else "buffer_reuse.json")
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return doc


if __name__ == "__main__":
    main()
