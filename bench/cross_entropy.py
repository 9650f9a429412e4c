"""remat's ``cross_entropy`` kernels against the ``log_softmax -> nll_loss`` pair they replaced,
as the VM runs them in the torch dialect.

Per head shape ``[N, C]`` (GPT medium's, a 32k vocabulary's, the zoo MLP's): median milliseconds
over ``--rounds`` alternating rounds of
* forward: ``log_softmax`` then ``nll_loss`` (the pair) against ``cross_entropy`` (loss and logsumexp);
* backward: ``nll_loss_grad`` then ``log_softmax_grad`` (the pair, two fresh ``[N, C]`` results)
  against ``cross_entropy_grad`` written over the logits (its out-variant, as the VM runs it when the
  logits die there) and into a fresh buffer;
and how many ``[N, C]`` tensors each holds at its peak (the pair: log-probabilities, one-hot
gradient, gradient; remat: the logits, then their gradient in the same buffer). Fresh buffers are
allocated in each call, as in a training step (page faults included). Gradients agree within
``--rtol`` (checked; the two round differently).

Run:  PYTHONPATH=src .venv/bin/python bench/cross_entropy.py
Writes bench/results/cross_entropy.json.
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

SHAPES = {"gpt-medium head": (2048, 8000), "32k vocabulary": (1024, 32000), "mlp head": (512, 10)}


def _case(n: int, c: int) -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], None]], Callable[[], float]]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, c, generator=g) * 3
    t = torch.randint(0, c, (n,), generator=g)
    t[1] = -100  # an ignored row
    one = torch.tensor(1.0)
    lp = tk.log_softmax(z, 1)
    _, lse = tk.cross_entropy(z, t)
    scratch = [z.clone()]

    def refill() -> None:  # the in-place backward overwrites its logits: a new copy before each timed call
        scratch[0].copy_(z)

    forward = {"pair": lambda: tk.nll_loss(tk.log_softmax(z, 1), t), "cross_entropy": lambda: tk.cross_entropy(z, t)}
    backward = {"pair": lambda: tk.log_softmax_grad(tk.nll_loss_grad(one, t, c), lp, 1),
                "cross_entropy (in place)": lambda: tk.cross_entropy_grad_out(scratch[0], one, scratch[0], lse, t),
                "cross_entropy (fresh)": lambda: tk.cross_entropy_grad(one, z, lse, t)}
    prep = {"cross_entropy (in place)": refill}

    def agreement() -> float:
        ref = backward["pair"]()
        refill()
        got = backward["cross_entropy (in place)"]()
        return float((ref - got).abs().max() / ref.abs().max())

    return {**{f"forward {k}": f for k, f in forward.items()}, **{f"backward {k}": f for k, f in backward.items()}}, \
        {f"backward {k}": f for k, f in prep.items()}, agreement


def bench(name: str, n: int, c: int, rounds: int) -> dict:
    methods, prep, agreement = _case(n, c)
    names = list(methods)
    for k in names:
        for _ in range(2):
            prep.get(k, lambda: None)()
            methods[k]()
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            prep.get(k, lambda: None)()
            t0 = time.perf_counter()
            methods[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": name, "rows": n, "classes": c, "ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            "x_pair": {"forward": round(med["forward cross_entropy"] / med["forward pair"], 3),
                       "backward (in place)": round(med["backward cross_entropy (in place)"] / med["backward pair"], 3),
                       "backward (fresh)": round(med["backward cross_entropy (fresh)"] / med["backward pair"], 3)},
            "nc_tensors_at_peak": {"pair": 3, "cross_entropy": 1}, "max_relative_difference": agreement()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--rtol", type=float, default=1e-5, help="largest relative gradient difference accepted")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cross_entropy.json"))
    a = ap.parse_args(argv)
    rows = checked_rows({name: (lambda name=name, n=n, c=c: bench(name, n, c, a.rounds)) for name, (n, c) in SHAPES.items()},
                        lambda row: f"[{row['rows']}, {row['classes']}]  "
                        + "  ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items()) + f"  | x pair: {row['x_pair']}",
                        a.rtol)
    write_kernel_rows(a.out, rows, a.rounds)
    return rows


if __name__ == "__main__":
    main()
