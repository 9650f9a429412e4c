"""A seeded mutator of IR text, and the property every input must keep (issue 15): parsing gives a
module, or raises ParseError; verifying a parsed module passes or raises VerificationError; a
module that verifies prints to text that parses back to the same text. No other exception type.

Seeds are the golden inputs (tests/golden/*.ir) and random valid modules that use every sample
of every op (irgen.generate_module), one function per seed text.

Used by tests/ir/test_fuzz.py (a few thousand inputs) and as a script for a large run::

    PYTHONPATH=src:tests/ir python tests/ir/irfuzz.py --inputs 50000 --seed 1
"""
from __future__ import annotations

import argparse
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np

from irgen import generate_module
from remat.ir import Module, ParseError, VerificationError, parse, verify

GOLDEN = Path(__file__).resolve().parent.parent / "golden"

# Fragments a mutation may insert: edge cases of every token kind of the grammar.
FRAGMENTS = (
    "9" * 4301, "1" * 310, "9223372036854775808", "-9223372036854775809", "18446744073709551616", "0", "-1",
    "1.5e308", "1e999", "-0.0", "inf", "-inf", "nan", "1e", "1.", ".5",
    '"\\q"', '"\\u12"', '"\\ud800"', '"\\u00e9"', '"a\tb"', '"unterminated', '"\\', '""',
    "\u0663", "\u00e9", "\u200b", "\x00", "\x7f", "\r", "\t", "\n", "\ufeff", "//", "/* */",
    "%", "%0", "%999999", "%-1", "^", "^bb0", "^bb99", "@", "@f0", "@nope", "func", "->", "=", ":", ",",
    "(", ")", "[", "]", "{", "}", "f32[]", "f32[0]", "i64[2,3]", "bool[]", "f99[1]",
    "gradient", "value_and_gradient", "wrt", "call", "return", "br", "cond_br", "free", "torch.", "numpy.add",
    "true", "false", "{axes=[0]}", "{axis=-1}", "{dtype=f32}",
)


def seeds(rng: np.random.Generator, modules: int = 2) -> list[str]:
    """Seed texts: every golden input, and each function of random valid modules on its own."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(GOLDEN.glob("*.ir"))]
    for _ in range(modules):
        m = generate_module(rng, functions=8)
        texts += [str(Module([f])) for f in m if not f.is_declaration]
        texts.append(str(m))
    return texts


def mutate(rng: np.random.Generator, text: str, pool: list[str]) -> str:
    """One to three random edits of ``text``: delete, duplicate or move a span, insert an edge-case
    fragment or a token from another seed, change a number, swap or drop lines, splice another seed."""
    for _ in range(int(rng.integers(1, 4))):
        n = len(text)
        i = int(rng.integers(0, n + 1))
        j = min(n, i + int(rng.integers(0, 12)))
        kind = int(rng.integers(0, 9))
        if kind == 0:
            text = text[:i] + text[j:]
        elif kind == 1:
            text = text[:j] + text[i:j] + text[j:]
        elif kind == 2:
            text = text[:i] + FRAGMENTS[int(rng.integers(0, len(FRAGMENTS)))] + text[j if rng.random() < 0.5 else i:]
        elif kind == 3:
            other = pool[int(rng.integers(0, len(pool)))].split()
            tok = other[int(rng.integers(0, len(other)))] if other else ""
            text = text[:i] + tok + " " + text[i:]
        elif kind == 4:
            digits = [k for k, c in enumerate(text) if c.isdigit()]
            if digits:
                k = digits[int(rng.integers(0, len(digits)))]
                text = text[:k] + str(int(rng.choice([0, 1, 2, 7, 63, 64, 2**31, 2**63, -1]))) + text[k + 1:]
        elif kind == 5:
            lines = text.split("\n")
            a, b = rng.integers(0, len(lines), size=2)
            lines[a], lines[b] = lines[b], lines[a]
            text = "\n".join(lines)
        elif kind == 6:
            lines = text.split("\n")
            del lines[int(rng.integers(0, len(lines)))]
            text = "\n".join(lines)
        elif kind == 7:
            other = pool[int(rng.integers(0, len(pool)))]
            k = int(rng.integers(0, len(other) + 1))
            text = text[:i] + other[k:]
        else:
            text = text[:i] + chr(int(rng.integers(0, 0x3000))) + text[j:]
    return text


def check(text: str) -> str:
    """The outcome of one input ('parse error', 'verification error' or 'valid'); raises
    AssertionError when a valid module does not print back to text that parses to the same text.
    Any other exception escapes (the property the fuzz tests assert)."""
    try:
        m = parse(text)
    except ParseError:
        return "parse error"
    try:
        verify(m)
    except VerificationError:
        return "verification error"
    printed = str(m)
    again = parse(printed)
    verify(again)
    assert str(again) == printed, f"round trip changed the text:\n{printed}\n---\n{again}"
    return "valid"


def run(n: int, seed: int, slow_s: float = 2.0) -> tuple[Counter, list[tuple[str, str]], list[tuple[float, str]]]:
    """Fuzz ``n`` inputs; return outcome counts, failures (input, traceback) and inputs slower than
    ``slow_s`` seconds (time, input)."""
    rng = np.random.default_rng(seed)
    pool = seeds(rng)
    counts: Counter = Counter()
    failures: list[tuple[str, str]] = []
    slow: list[tuple[float, str]] = []
    for _ in range(n):
        text = mutate(rng, pool[int(rng.integers(0, len(pool)))], pool)
        t0 = time.perf_counter()
        try:
            counts[check(text)] += 1
        except Exception:  # noqa: BLE001 - the property under test: report, keep fuzzing
            counts["failure"] += 1
            failures.append((text, traceback.format_exc()))
        dt = time.perf_counter() - t0
        if dt > slow_s:
            slow.append((dt, text))
    return counts, failures, slow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=50_000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t0 = time.perf_counter()
    counts, failures, slow = run(a.inputs, a.seed)
    kinds = Counter(tb.strip().splitlines()[-1].split(":")[0] for _, tb in failures)
    print(f"{a.inputs} inputs (seed {a.seed}) in {time.perf_counter() - t0:.0f} s: {dict(counts)}")
    print(f"failures by exception: {dict(kinds)}; inputs slower than 2 s: {len(slow)}")
    for text, tb in failures[:3]:
        print("-" * 60, "\n", repr(text[:500]), "\n", tb)


if __name__ == "__main__":
    main()
