"""The pass registry: every pass of remat by name, and the named pipelines.

It sits above ``passes/``, ``autodiff/``, ``plan/`` and ``lower/`` and imports them explicitly, so a broken
import fails here with its own traceback instead of reading as an unknown pass, and no package
below imports back up.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .autodiff.transform import grad_pass
from .ir import Module
from .lower.fuse import fuse_pass
from .lower.small_values import reuse_small_pass
from .lower.siblings import merge_conv_grads_pass
from .passes import CLEANUP, PASSES as _LOCAL, PRE_DIFFERENTIATION
from .passes.pipeline import PassFn, PipelineResult, lookup, run_passes
from .plan.simulator import insert_frees_pass

PASSES: dict[str, PassFn] = {**_LOCAL, "grad": grad_pass, "insert-frees": insert_frees_pass, "fuse": fuse_pass,
                            "merge-conv-grads": merge_conv_grads_pass, "reuse-small": reuse_small_pass}
"""Every pass by name: those of :mod:`remat.passes`, differentiation, explicit frees and fusion."""

PIPELINES: dict[str, list[str]] = {
    "pre-differentiation": PRE_DIFFERENTIATION,
    "cleanup": CLEANUP,
    "differentiate": ["grad", *CLEANUP],
}
"""Named pipelines: a flat list of pass names each."""


def get_pass(name: str) -> PassFn:
    """The pass named ``name``; a KeyError listing the available ones."""
    return lookup(PASSES, [name])[0][1]


def run_pipeline(module: Module, names: Sequence[str] | str, verify_each: bool | None = None,
                 print_after: Callable[[str, Module], None] | None = None) -> PipelineResult:
    """Run passes by name in order, or the named pipeline ``names`` (a key of ``PIPELINES``)."""
    if isinstance(names, str):
        if names not in PIPELINES:
            raise KeyError(f"unknown pipeline '{names}'; available pipelines: {', '.join(sorted(PIPELINES))}")
        names = PIPELINES[names]
    return run_passes(module, lookup(PASSES, names), verify_each, print_after)


__all__ = ["PASSES", "PIPELINES", "get_pass", "run_pipeline"]
