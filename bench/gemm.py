"""Which CPU GEMM the torch dialect runs for f32 ``linear`` and ``matmul``: ATen's (MKL sgemm, the
``linear``/``matmul`` kernels) against oneDNN's (``linear_onednn``/``matmul_onednn``, PyTorch's
bundled oneDNN through ``mkldnn::_linear_pointwise``), on the products the benchmark models' training
steps really run.

Per model (the five of ``bench/speed.py`` and its Hugging Face models, unconstrained, SGD as there):
the program's distinct f32 ``linear``/``matmul`` instructions with a 2-D right operand (shapes and
transposes), each timed with random operands over ``--rounds`` alternating rounds of both kernels;
per product the median milliseconds, oneDNN's ratio to MKL, the multiply-adds and whether
``torch_kernels.onednn_gemm`` (what the step runs) picks oneDNN. Per model: the step's GEMM time
(each product's median times how often the step runs it) with MKL everywhere, with oneDNN
everywhere it can run, and with the checker's choice, as ratios to MKL everywhere. Products with a
transposed left operand (weight gradients) are listed with oneDNN run on the transposed view.

With ``--steps``, also the whole unconstrained training step, compiled twice in the same process
(with the checker's choice, and with ``torch_kernels.ONEDNN_GEMM`` off: ATen's kernels everywhere) and timed
over ``--rounds`` alternating rounds (``step_x_mkl``: the median of per-round ratios).

Run:  PYTHONPATH=src .venv/bin/python bench/gemm.py [--models mlp,gpt] [--rounds 15] [--steps]
Writes bench/results/gemm.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from _measure import write_kernel_rows
from speed import MODEL_NAMES, model_specs
from remat.backends import torch_kernels as tk


def _gemms(program) -> Counter:
    """(op, left shape, right shape, transpose_a, transpose_b, has bias) -> count, for the f32
    products with a 2-D right operand."""
    out: Counter = Counter()
    for ins in program.entry.instrs:
        if ins.op.name not in ("linear", "matmul") or any(v.type.dtype.name != "f32" for v in ins.operands):
            continue
        a, b = ins.operands[0].type, ins.operands[1].type
        if b.rank != 2:
            continue
        out[(ins.op.name, tuple(a.shape), tuple(b.shape), bool(ins.attrs.get("transpose_a", False)),
             bool(ins.attrs.get("transpose_b", False)), len(ins.operands) > 2, tk.onednn_gemm(ins))] += 1
    return out


def _kernels(key):
    op, ashape, bshape, ta, tb, bias, _ = key
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(ashape, generator=g), torch.randn(bshape, generator=g)
    if op == "linear":
        c = torch.randn(bshape[0], generator=g) if bias else None
        return (lambda: tk.linear(a, b, c)), (lambda: tk.linear_onednn(a, b, c))
    return ((lambda: tk.matmul(a, b, ta, tb)),
            (lambda: tk._fresh(tk._LINEAR_POINTWISE(a.mT if ta else a, b if tb else b.mT, None, "none", [], ""))))


def _macs(key) -> int:
    op, ashape, bshape, ta, tb, _, _ = key
    m = 1
    for d in (ashape[:-2] + ((ashape[-1],) if ta else (ashape[-2],))) if len(ashape) > 1 else ():
        m *= d
    k = ashape[-2] if ta else ashape[-1]
    n = bshape[0] if (op == "linear" or tb) else bshape[1]
    return m * k * n


def bench_product(key, rounds: int) -> dict:
    mkl, dnn = _kernels(key)
    for f in (mkl, dnn, mkl, dnn):
        f()
    times = {"mkl": [], "onednn": []}
    for r in range(rounds):
        for name, f in ((("mkl", mkl), ("onednn", dnn)) if r % 2 == 0 else (("onednn", dnn), ("mkl", mkl))):
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    op, ashape, bshape, ta, tb, bias, chosen = key
    return {"op": op, "a": list(ashape), "b": list(bshape), "transpose_a": ta, "transpose_b": tb, "bias": bias,
            "macs": _macs(key), "onednn_chosen": chosen, "mkl_ms": round(med["mkl"] * 1e3, 4),
            "onednn_ms": round(med["onednn"] * 1e3, 4), "onednn_x_mkl": round(med["onednn"] / med["mkl"], 3)}


def _compile(spec, onednn: bool):
    """A fresh copy of the model compiled unconstrained, with or without oneDNN's products; its step."""
    import remat
    from remat.runtime import allocator

    model, xs, ts, loss_fn = spec.make()
    opt = spec.make_optimizer(model.parameters())
    inputs = xs[0] if spec.hf else xs + ts
    saved = tk.ONEDNN_GEMM
    tk.ONEDNN_GEMM = onednn
    allocator.clear_cache()  # workspaces and kernel keys are per implementation
    try:
        step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    finally:
        tk.ONEDNN_GEMM = saved
        allocator.clear_cache()
    return step, ((lambda: step(**inputs)) if spec.hf else (lambda: step(*inputs)))


def onednn_kernels(step) -> int:
    """How many of the step's VM instructions run a oneDNN product kernel (as the VM resolved them)."""
    return sum(getattr(st.fn, "__name__", "").endswith("_onednn")
               for plan in step.vm._plans.values() for block in plan.blocks for st in block.steps)


def bench_steps(spec, rounds: int) -> dict:
    """The unconstrained step with the checker's choice against ATen's kernels everywhere."""
    compiled = {"chosen": _compile(spec, True), "mkl": _compile(spec, False)}
    steps = {k: f for k, (_, f) in compiled.items()}
    for f in list(steps.values()) * 2:
        f()
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(rounds):
        for k in names[r % 2:] + names[:r % 2]:
            t = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t)
    return {"onednn_kernels": {k: onednn_kernels(st) for k, (st, _) in compiled.items()},
            "step_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()},
            "step_x_mkl": round(statistics.median(a / b for a, b in zip(times["chosen"], times["mkl"])), 3)}


def bench_model(name: str, rounds: int, steps: bool = False) -> dict:
    spec = model_specs(False)[name]
    step, _ = _compile(spec, True)
    products = []
    step_ms = {"mkl": 0.0, "onednn": 0.0, "chosen": 0.0}
    for key, count in sorted(_gemms(step.program).items(), key=lambda kv: str(kv[0])):
        row = bench_product(key, rounds)
        row["count"] = count
        products.append(row)
        step_ms["mkl"] += count * row["mkl_ms"]
        step_ms["onednn"] += count * (row["onednn_ms"] if not key[3] else row["mkl_ms"])  # oneDNN wherever it can
        step_ms["chosen"] += count * (row["onednn_ms"] if row["onednn_chosen"] else row["mkl_ms"])
    base = step_ms["mkl"] or 1.0
    out = {"model": name, "products": products, "step_gemm_ms": {k: round(v, 3) for k, v in step_ms.items()},
           "step_gemm_x_mkl": {k: round(v / base, 3) for k, v in step_ms.items()}}
    if steps:
        del step
        out.update(bench_steps(spec, rounds))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_NAMES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", action="store_true", help="also time whole steps with and without oneDNN")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gemm.json"))
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        row = bench_model(name, a.rounds, a.steps)
        rows.append(row)
        x = row["step_gemm_x_mkl"]
        print(f"{name:11} {len(row['products']):3d} products  step GEMM time x MKL: oneDNN wherever it can "
              f"{x['onednn']:.3f}, as chosen {x['chosen']:.3f}  (MKL {row['step_gemm_ms']['mkl']:.2f} ms)"
              + (f"; whole step x{row['step_x_mkl']:.3f} ({row['step_ms']['chosen']:.1f} against "
                 f"{row['step_ms']['mkl']:.1f} ms)" if "step_x_mkl" in row else ""), flush=True)
        for p in row["products"]:
            print(f"    {p['op']:6} {str(p['a']):16} {str(p['b']):12} ta={int(p['transpose_a'])} tb={int(p['transpose_b'])}"
                  f" x{p['count']:<2d} 2^{p['macs'].bit_length() - 1:<2d} MKL {p['mkl_ms']:8.3f} ms  oneDNN "
                  f"x{p['onednn_x_mkl']:.2f}{'  <- oneDNN' if p['onednn_chosen'] else ''}")
    write_kernel_rows(a.out, rows, a.rounds)
    return rows


if __name__ == "__main__":
    main()
