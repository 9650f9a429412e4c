"""Parse and verify time of the two inputs issue 15 found quadratic: a function of N faulty
instructions (every one a verifier error) and a valid chain of N blocks.

    PYTHONPATH=src python bench/verifier_scaling.py [--faulty 2000] [--blocks 6000]
"""
from __future__ import annotations

import argparse
import time

from remat.ir import VerificationError, parse, verify


def faulty(n: int) -> str:
    """``n`` adds whose declared result type contradicts the type rule: ``n`` verifier errors."""
    body = "".join(f"  %{k + 1} = add %0, %0 : f32[3]\n" for k in range(n))
    return f"func @f(%0: f32[2]) -> f32[2] {{\n{body}  return %0\n}}\n"


def chain(n: int) -> str:
    """A valid function of ``n`` blocks, each branching to the next."""
    blocks = "".join(f"^b{k}(%v{k}: f32[2]):\n  br ^b{k + 1}(%v{k})\n" for k in range(1, n))
    return f"func @f(%0: f32[2]) -> f32[2] {{\n  br ^b1(%0)\n{blocks}^b{n}(%v{n}: f32[2]):\n  return %v{n}\n}}\n"


def timed(text: str) -> tuple[float, float, int]:
    """(parse seconds, verify seconds, number of errors)."""
    t0 = time.perf_counter()
    m = parse(text)
    t1 = time.perf_counter()
    try:
        verify(m)
        errs = 0
    except VerificationError as e:
        errs = len(e.errors)
    return t1 - t0, time.perf_counter() - t1, errs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--faulty", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=6000)
    a = ap.parse_args()
    for name, text in ((f"{a.faulty} faulty instructions", faulty(a.faulty)), (f"chain of {a.blocks} blocks", chain(a.blocks))):
        p, v, errs = timed(text)
        print(f"{name:28s} parse {p:7.3f} s  verify {v:7.3f} s  ({errs} errors)")


if __name__ == "__main__":
    main()
