"""Shared helpers for op declarations: type-rule building blocks and sample makers."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..opdef import Attr, Sample
from ..types import DType, TensorType, broadcast_shapes, promote  # noqa: F401  (re-exported)

FLOATS = (DType.f16, DType.bf16, DType.f32, DType.f64)


def expect_float(op: str, t: TensorType, what: str = "operand") -> None:
    if not t.dtype.is_float:
        raise TypeError(f"'{op}' needs a floating-point {what}, got {t}; valid dtypes: f16, bf16, f32, f64")


def expect_same_dtype(op: str, types: Sequence[TensorType]) -> DType:
    dts = {t.dtype for t in types}
    if len(dts) != 1:
        raise TypeError(f"'{op}' operands must have the same dtype, got {', '.join(str(t) for t in types)}; insert a cast")
    return dts.pop()


def bcast(op: str, types: Sequence[TensorType]) -> tuple[int, ...]:
    try:
        return broadcast_shapes(*(t.shape for t in types))
    except ValueError as e:
        raise TypeError(f"'{op}': {e}") from None


def check_axis(op: str, axis: int, rank: int, name: str = "axis") -> None:
    if not 0 <= axis < rank:
        raise TypeError(f"'{op}': {name} {axis} is out of range for rank {rank}; valid: 0..{rank - 1}")


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def ints(name: str, default=None) -> Attr:
    from ..opdef import REQUIRED

    return Attr(name, "ints", REQUIRED if default is None else default)


def rand(rng: np.random.Generator, *shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(np.float64)


def away_from(rng: np.random.Generator, *shape: int, gap: float = 0.2) -> np.ndarray:
    """Values in [-1, 1] at least ``gap`` away from 0 (for kinks such as relu and abs)."""
    x = rng.uniform(gap, 1.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return x.astype(np.float64)


def samples(*items: Sample) -> list[Sample]:
    return list(items)


# ---------------------------------------------------------------- cost rules (``OpDef.flops``)
# (operand types, result types, attributes) -> estimated floating-point operations.
def max_numel(ins: Sequence[TensorType], outs: Sequence[TensorType], attrs) -> float:
    """One operation per element of the largest operand or first result (elementwise, data movement)."""
    return float(max([outs[0].numel] + [t.numel for t in ins]))


def per_output(factor: float):
    """``factor`` operations per element of the first result (transcendental-heavy ops)."""
    def flops(ins: Sequence[TensorType], outs: Sequence[TensorType], attrs) -> float:
        return factor * outs[0].numel

    return flops


def no_flops(ins: Sequence[TensorType], outs: Sequence[TensorType], attrs) -> float:
    """No arithmetic: views, constants and control ops."""
    return 0.0
