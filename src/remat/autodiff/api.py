"""``remat.grad`` and ``remat.value_and_grad`` over staged DSL functions.

Both return a new staged function whose IR is the differentiated module after the clean-up
pipeline (``CLEANUP``), so ``.ir`` shows exactly the code that runs.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..ir import Function, GradientSpec, Module
from ..passes import CLEANUP, run
from .transform import differentiate


def _wrt(wrt: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(wrt, int):
        return (wrt,)
    out = tuple(wrt)
    if not out or not all(isinstance(i, int) for i in out):
        raise TypeError(f"wrt must be a parameter index or a non-empty tuple of indices, got {wrt!r}")
    return out


def _unique(m: Module, base: str) -> str:
    name, k = base, 1
    while name in m:
        k += 1
        name = f"{base}{k}"
    return name


def gradient_transform(wrt: int | Sequence[int], with_value: bool = False, adjoints: str = "outputs",
                       pipeline: Sequence[str] | None = None):
    """An IR transform ``(module, entry) -> (module, gradient_entry)`` for ``Staged.derive``."""
    idx = _wrt(wrt)

    def transform(module: Module, entry: str) -> tuple[Module, str]:
        n = len(module[entry].params)
        for i in idx:
            if not -n <= i < n:
                raise IndexError(f"wrt={i} is out of range: @{entry} has {n} parameters")
        norm = tuple(i % n for i in idx)
        m = module.clone()
        name = _unique(m, f"{entry}_{'value_and_grad' if with_value else 'grad'}")
        m.add(Function(name, gradient=GradientSpec(entry, norm, with_value)))
        m = differentiate(m, adjoints)
        m = run(m, list(CLEANUP if pipeline is None else pipeline)).module
        return m, name

    return transform


def grad(fn: Any, wrt: int | Sequence[int] = 0, *, adjoints: str = "outputs",
         pipeline: Sequence[str] | None = None) -> Any:
    """The gradient of a staged function with a scalar output, wrt parameter ``wrt`` (an index or a
    tuple of indices). For a non-scalar output the result takes the output cotangent as an extra
    trailing argument (a vector-Jacobian product). Returns a staged function."""
    return fn.derive(gradient_transform(wrt, False, adjoints, pipeline))


def value_and_grad(fn: Any, wrt: int | Sequence[int] = 0, *, adjoints: str = "outputs",
                   pipeline: Sequence[str] | None = None) -> Any:
    """Like :func:`grad`, returning f's outputs first, then the gradients."""
    return fn.derive(gradient_transform(wrt, True, adjoints, pipeline))
