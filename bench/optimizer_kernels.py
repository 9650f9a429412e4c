"""remat's optimizer-update kernels, one parameter per call as the VM runs them: ATen's fused kernels
(``torch._fused_sgd_`` / ``_fused_adam(w)_``, what ``sgd_step`` and ``adam_step`` run in f32/f64)
against the single-tensor updates they replaced (``remat.backends.torch_kernels.sgd_single`` /
``adam_single``), with ``torch.optim``'s default multi-tensor (foreach) step over all parameters
as eager's reference.

Per zoo model (size ``small``) and optimizer (SGD with momentum 0.9; AdamW with weight decay 0.01):
median seconds of one update of every parameter over ``--rounds`` alternating rounds, and the
ratios to the single-tensor loop. The parameters, gradients and states are the model's own shapes
with random values; the timing is warm (everything in cache), so in a training step, where the
state comes from memory, the absolute gains differ (``bench/speed.py`` measures those).

Run:  PYTHONPATH=src .venv/bin/python bench/optimizer_kernels.py
Writes bench/results/optimizer_kernels.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from _measure import write_kernel_rows
from remat import zoo
from remat.backends import torch_kernels as tk

MODELS = ("mlp", "resnet", "gpt", "unet")
SGD = {"lr": 1e-3, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False}
ADAMW = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "decoupled": True,
         "maximize": False}


def _methods(params: list[torch.Tensor], kind: str) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(0)
    ps = [p.detach().clone() for p in params]
    grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in ps]
    step = torch.tensor(5)
    if kind == "sgd":
        bufs = [torch.randn(p.shape, generator=g) * 1e-3 for p in ps]
        fused = lambda: [tk.sgd_step(p, d, b, step, **SGD) for p, d, b in zip(ps, grads, bufs)]
        single = lambda: [tk.sgd_single(p, d, b, step, **SGD) for p, d, b in zip(ps, grads, bufs)]
        eager_params = [torch.nn.Parameter(p.clone()) for p in ps]
        opt = torch.optim.SGD(eager_params, lr=SGD["lr"], momentum=SGD["momentum"])
    else:
        ms = [torch.randn(p.shape, generator=g) * 1e-3 for p in ps]
        vs = [torch.rand(p.shape, generator=g) * 1e-6 for p in ps]
        fused = lambda: [tk.adam_step(p, d, m, v, step, **ADAMW) for p, d, m, v in zip(ps, grads, ms, vs)]
        single = lambda: [tk.adam_single(p, d, m, v, step, **ADAMW) for p, d, m, v in zip(ps, grads, ms, vs)]
        eager_params = [torch.nn.Parameter(p.clone()) for p in ps]
        opt = torch.optim.AdamW(eager_params, lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"])
    for p, d in zip(eager_params, grads):
        p.grad = d.clone()
    opt.step()  # creates the state
    return {"single": single, "fused": fused, "torch.optim (foreach)": opt.step}


def bench(model: str, kind: str, rounds: int) -> dict:
    m, _, _ = zoo.make(model, "small")
    params = list(m.parameters())
    methods = _methods(params, kind)
    for f in methods.values():
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": model, "optimizer": kind, "tensors": len(params), "elements": sum(p.numel() for p in params),
            "ms": {k: round(v * 1e3, 4) for k, v in med.items()},
            "x_single": {k: round(v / med["single"], 3) for k, v in med.items()}}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "optimizer_kernels.json"))
    a = ap.parse_args(argv)
    rows = []
    for model in MODELS:
        for kind in ("sgd", "adamw"):
            row = bench(model, kind, a.rounds)
            rows.append(row)
            print(f"{model:7} {kind:6} {row['tensors']:3d} tensors {row['elements']:>9,} elements  "
                  + "  ".join(f"{k} {v:.3f} ms (x{row['x_single'][k]:.2f})" for k, v in row["ms"].items()), flush=True)
    write_kernel_rows(a.out, rows, a.rounds)
    return rows


if __name__ == "__main__":
    main()
