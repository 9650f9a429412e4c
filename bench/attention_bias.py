"""The backward of attention with a learned additive mask (a relative position bias: Swin's, T5's):
``attention_bias_grad``, one kernel (stop 39), against what the step ran before it: the flash backward
for q, k and v, then the mask's cotangent from primitives (the query, key, value and output gradient
swapped to heads-first, ``q kᵀ``, the probabilities recomputed, ``g vᵀ``, the row sums, the scores'
gradient summed over the batch), as the VM runs them in the torch dialect.

Per shape ``[B, H, T, D]`` (Swin's three stages at bench size: 4x4 windows, head size 24; a T5-like
encoder: 256 tokens, 4 heads of 64), operands ``[B, T, H, D]`` as ``fold-head-transposes`` leaves them
(``seq_first``), a mask ``[1, H, T, T]``: median milliseconds over ``--rounds`` alternating rounds,
each call after writing a 32 MiB buffer so that its operands come from memory, as they do in a
training step (``--hot`` skips that). Gradients agree within ``--rtol`` (checked).

Run:  PYTHONPATH=src .venv/bin/python bench/attention_bias.py
Writes bench/results/attention_bias.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from _measure import checked_rows, write_kernel_rows
from remat.backends import torch_kernels as tk

SHAPES = {"swin stage 1": (256, 2, 16, 24), "swin stage 2": (64, 4, 16, 24), "swin stage 3": (16, 8, 16, 24),
          "t5-like encoder": (8, 4, 256, 64)}


def _case(b: int, h: int, t: int, d: int) -> dict[str, Callable[[], tuple]]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=g) for _ in range(3))
    mask = torch.randn(1, h, t, t, generator=g)
    scale = d ** -0.5
    out, lse = tk.attention_flash(q, k, v, mask, scale=scale, seq_first=True)
    gout = torch.randn(out.shape, generator=g)

    def separate() -> tuple:
        gq, gk, gv = tk.attention_grad_flash(gout, q, k, v, out, lse, mask, scale=scale, seq_first=True)
        qh, kh, vh, gh = (x.transpose(1, 2).contiguous() for x in (q, k, v, gout))
        p = torch.exp(torch.matmul(qh, kh.mT) * scale + mask - lse.unsqueeze(-1))
        dp = torch.matmul(gh, vh.mT)
        rows = (gout * out).sum(-1, keepdim=True).transpose(1, 2).contiguous()
        return gq, gk, gv, (p * (dp - rows)).sum(0, keepdim=True)

    def one_kernel() -> tuple:
        return tk.attention_bias_grad(gout, q, k, v, out, lse, mask, scale=scale, seq_first=True)

    return {"separate": separate, "attention_bias_grad": one_kernel}


def bench(name: str, shape: tuple[int, int, int, int], rounds: int, hot: bool) -> dict:
    methods = _case(*shape)
    flush = torch.empty(32 * 2**20 // 4)
    names = list(methods)
    for f in methods.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            if not hot:
                flush.add_(1.0)
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref, got = methods["separate"](), methods["attention_bias_grad"]()
    diff = max(float((a - c).abs().max() / a.abs().max()) for a, c in zip(ref, got))
    return {"shape": name, "b_h_t_d": list(shape), "ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            "x_separate": round(med["attention_bias_grad"] / med["separate"], 3), "max_relative_difference": diff}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--hot", action="store_true", help="operands stay in cache between calls")
    ap.add_argument("--rtol", type=float, default=1e-5, help="largest relative gradient difference accepted")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "attention_bias.json"))
    a = ap.parse_args(argv)
    rows = checked_rows({name: (lambda name=name, shape=shape: bench(name, shape, a.rounds, a.hot))
                         for name, shape in SHAPES.items()},
                        lambda row: f"{tuple(row['b_h_t_d'])}  " + "  ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items())
                        + f"  | x separate {row['x_separate']:.2f}", a.rtol)
    write_kernel_rows(a.out, rows, a.rounds)
    return rows


if __name__ == "__main__":
    main()
