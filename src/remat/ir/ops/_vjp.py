"""Building blocks for the VJP rules declared beside each op (``@def_vjp`` at the end of each
``remat.ir.ops`` module).

A rule has the signature ``rule(b: Builder, p: Primal, g: Value) -> list[Value | None]``: it emits
IR through ``b`` computing one cotangent per operand (None where there is none: integer operands,
conditions, or a zero contribution). ``p`` holds only what the rule's ``saves`` declares, so a
rule cannot silently keep more of the forward alive than it says (RAF's flexible adjoints):
``p.x[i]`` is operand ``i`` if saved else None, ``p.y[j]`` result ``j`` if saved else None.
Types and attributes are always available (they are static, not memory). For an op with several
results, ``g`` is the list of the results' cotangents (None where a result's cotangent is zero).

``VARIANTS`` holds alternative rules keyed by (op, adjoint policy), e.g. input-keeping rules for
ops whose default rule keeps the output; ``remat.autodiff.differentiate(..., adjoints="inputs")``
uses them so the memory effect of the choice can be measured honestly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..core import Builder, Value
from ..opdef import OPS
from ..types import DType, TensorType


@dataclass
class Primal:
    """What a VJP rule sees of its forward instruction."""

    attrs: dict[str, Any]
    in_types: list[TensorType]
    out_types: list[TensorType]
    x: list[Value | None]  # operands, None unless saved
    y: list[Value | None]  # results, None unless saved


# (op name, policy) -> (rule, saves). Policy "inputs": the rule keeps inputs instead of outputs.
VARIANTS: dict[tuple[str, str], tuple[Callable, Any]] = {}


def def_vjp_variant(name: str, policy: str, saves: Any):
    """Register an alternative VJP rule for ``name`` under an adjoint ``policy`` (e.g. "inputs")."""

    def deco(fn):
        if name not in OPS:
            raise KeyError(f"variant VJP for unknown op '{name}'")
        VARIANTS[(name, policy)] = (fn, saves)
        return fn

    return deco


@dataclass(frozen=True)
class Saves:
    """An explicit ``saves`` declaration: which operands and which results the backward keeps.

    Indices past an instruction's actual operand/result count are ignored, so an op with optional
    trailing operands (e.g. a normalisation's weight) can name them once.
    """

    operands: tuple[int, ...] = ()
    results: tuple[int, ...] = ()


def saved_indices(saves: Any, n_operands: int, n_results: int = 1,
                  attrs: dict[str, Any] | None = None) -> tuple[set[int], set[int]]:
    """(operand indices kept, result indices kept) for a ``saves`` declaration.

    ``saves`` is "inputs", "outputs" (every result), "both", "none"/None, a tuple of operand
    indices, a :class:`Saves`, or a function ``(attrs, n_operands) -> Saves`` for ops whose saved
    values depend on their attributes (batch norm keeps batch statistics in training mode,
    running statistics in eval mode).
    """
    if callable(saves):
        saves = saves(attrs or {}, n_operands)
    if saves == "inputs":
        return set(range(n_operands)), set()
    if saves == "outputs":
        return set(), set(range(n_results))
    if saves == "none" or saves is None:
        return set(), set()
    if saves == "both":
        return set(range(n_operands)), set(range(n_results))
    if isinstance(saves, Saves):
        return ({i for i in saves.operands if i < n_operands}, {j for j in saves.results if j < n_results})
    return {int(i) for i in saves}, set()


# ---------------------------------------------------------------- emission helpers
def const(b: Builder, value: float, dtype: DType, shape: Sequence[int] = ()) -> Value:
    """A splat constant (scalar by default; element-wise ops broadcast it)."""
    v = bool(value) if dtype == DType.bool else (int(value) if dtype.is_int else float(value))
    return b.op("constant", value=v, shape=tuple(shape), dtype=dtype)


def cast_to(b: Builder, v: Value, dtype: DType) -> Value:
    """``v`` in ``dtype``: itself when it is of that dtype already, else a cast."""
    return v if v.type.dtype == dtype else b.op("cast", v, dtype=dtype)


def scalar_like(b: Builder, value: float, v: Value) -> Value:
    return const(b, value, v.type.dtype)


def unbroadcast(b: Builder, g: Value, shape: Sequence[int]) -> Value:
    """Sum ``g`` (of a broadcast result shape) back to ``shape`` (NumPy broadcasting, right-aligned)."""
    shape = tuple(shape)
    gs = g.type.shape
    if gs == shape:
        return g
    lead = len(gs) - len(shape)
    axes = list(range(lead))
    axes += [lead + i for i, d in enumerate(shape) if d == 1 and gs[lead + i] != 1]
    if axes:
        g = b.op("reduce_sum", g, axes=axes, keepdims=True)
    if g.type.shape != shape:
        g = b.op("reshape", g, shape=shape)
    return g


def expand_to(b: Builder, g: Value, shape: Sequence[int]) -> Value:
    """Broadcast ``g`` to ``shape`` (no-op when already there)."""
    shape = tuple(shape)
    return g if g.type.shape == shape else b.op("broadcast", g, shape=shape)


def zeros_like_type(b: Builder, t: TensorType) -> Value:
    return const(b, 0, t.dtype, t.shape)


def is_float(t: TensorType) -> bool:
    return t.dtype.is_float
