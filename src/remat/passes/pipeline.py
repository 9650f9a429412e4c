"""Running passes: a pass is a named pure function Module -> Module; a pipeline is a flat list of them.

``run_passes`` records each pass's time and can verify and print the IR after every pass (by default
only when ``$REMAT_VERIFY_EACH_PASS=1``: the test suite and debugging; a compile verifies each stage's
result once instead). Which name
means which pass is the registry's business (:mod:`remat.passes` for the passes of this package,
:mod:`remat.pipeline` for all of them).
"""
from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..ir import Module, verify

PassFn = Callable[[Module], Module]


@dataclass
class PassRecord:
    name: str
    seconds: float
    instructions_before: int
    instructions_after: int


@dataclass
class PipelineResult:
    module: Any  # the last pass's result: a Module (or a compilation record, for remat.compile's stages)
    records: list[PassRecord] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(f"// {r.name}: {r.instructions_before} -> {r.instructions_after} instructions "
                         f"({r.seconds * 1e3:.1f} ms)" for r in self.records)


def _count(m: Module | None) -> int:
    return 0 if m is None else sum(len(b.instrs) for f in m for b in f.blocks)


def lookup(table: dict[str, PassFn], names: Sequence[str], where: str = "") -> list[tuple[str, PassFn]]:
    """``(name, pass)`` for each name; a KeyError naming the unknown pass and the available ones."""
    out = []
    for name in names:
        if name not in table:
            raise KeyError(f"unknown pass '{name}'{where}; available passes: {', '.join(sorted(table))}")
        out.append((name, table[name]))
    return out


def verify_each_pass() -> bool:
    """The default of ``verify_each``: ``$REMAT_VERIFY_EACH_PASS=1`` (set by the test suite; for
    debugging a pass). Off otherwise: verifying costs about as much as the passes themselves."""
    return os.environ.get("REMAT_VERIFY_EACH_PASS", "0") == "1"


def run_passes(module: Any, steps: Sequence[tuple[str, Callable[[Any], Any]]], verify_each: bool | None = None,
               print_after: Callable[[str, Module], None] | None = None, *,
               around: Callable[[str], AbstractContextManager] | None = None,
               after: Callable[[PassRecord, Any], None] | None = None,
               ir: Callable[[Any], Module | None] | None = None) -> PipelineResult:
    """Run the passes in order (each returns a new value); verify after each one if asked
    (None: :func:`verify_each_pass`).

    The same runner runs ``remat.compile``'s stages, whose values are compilation records rather
    than modules: ``ir`` gives the IR of such a value (to count, verify and print; None when there
    is none yet), ``around(name)`` a context each step runs in, and ``after(record, value)`` is
    called after each step with its record (name, seconds, instruction counts)."""
    if verify_each is None:
        verify_each = verify_each_pass()
    ir_of = ir or (lambda m: m)
    res = PipelineResult(module)
    for name, fn in steps:
        before = _count(ir_of(res.module))
        t0 = time.perf_counter()
        with around(name) if around is not None else nullcontext():
            out = fn(res.module)
        dt = time.perf_counter() - t0
        out_ir = ir_of(out)
        if verify_each and out_ir is not None:
            verify(out_ir)
        record = PassRecord(name, dt, before, _count(out_ir))
        res.records.append(record)
        res.module = out
        if print_after:
            print_after(name, out)
        if after:
            after(record, out)
    return res
