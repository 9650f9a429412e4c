"""Passes are named pure functions Module -> Module; a pipeline is a flat, readable list of names.

``run_pipeline`` records each pass's time and can verify and print the IR after every pass.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..ir import Module, verify

PassFn = Callable[[Module], Module]

CLEANUP: list[str] = ["inline", "simplify", "fold", "cse", "dce"]
"""The clean-up pipeline run after differentiation: one flat function, simplified, folded,
common subexpressions merged, dead code removed."""
PASSES: dict[str, PassFn] = {}


def register_pass(name: str):
    """Register ``fn(module) -> module`` under ``name`` (must not mutate its input)."""

    def deco(fn: PassFn) -> PassFn:
        if name in PASSES:
            raise ValueError(f"pass '{name}' is registered twice")
        PASSES[name] = fn
        fn.pass_name = name
        return fn

    return deco


@dataclass
class PassRecord:
    name: str
    seconds: float
    instructions_before: int
    instructions_after: int


@dataclass
class PipelineResult:
    module: Module
    records: list[PassRecord] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(f"// {r.name}: {r.instructions_before} -> {r.instructions_after} instructions "
                         f"({r.seconds * 1e3:.1f} ms)" for r in self.records)


def _count(m: Module) -> int:
    return sum(len(b.instrs) for f in m for b in f.blocks)


def get_pass(name: str) -> PassFn:
    _load_builtin_passes()
    if name not in PASSES:
        raise KeyError(f"unknown pass '{name}'; available passes: {', '.join(sorted(PASSES))}")
    return PASSES[name]


def run_pipeline(module: Module, names: list[str], verify_each: bool = True,
                 print_after: Callable[[str, Module], None] | None = None) -> PipelineResult:
    """Run the passes in order on a copy-producing basis; verify after each one if asked."""
    res = PipelineResult(module)
    for name in names:
        fn = get_pass(name)
        before = _count(res.module)
        t0 = time.perf_counter()
        out = fn(res.module)
        dt = time.perf_counter() - t0
        if verify_each:
            verify(out)
        res.records.append(PassRecord(name, dt, before, _count(out)))
        res.module = out
        if print_after:
            print_after(name, out)
    return res


def _load_builtin_passes() -> None:
    """Import the modules that register passes (kept lazy so the IR has no import cycle)."""
    import importlib
    import pkgutil

    from .. import passes as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name not in ("pipeline",) and not m.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{m.name}")
    try:
        importlib.import_module("remat.autodiff")
    except ImportError:
        pass
    importlib.import_module("remat.plan.liveness")  # registers "insert-frees"
