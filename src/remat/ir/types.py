"""Tensor types of the IR: a dtype and a static shape (rank 0 allowed)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from math import prod

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """Element types. The value is the name used in the text format."""

    bool = "bool"
    i32 = "i32"
    i64 = "i64"
    f16 = "f16"
    bf16 = "bf16"
    f32 = "f32"
    f64 = "f64"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.f16, DType.bf16, DType.f32, DType.f64)

    @property
    def is_low(self) -> bool:
        """bf16 or f16: the low precisions of mixed precision."""
        return self in (DType.bf16, DType.f16)

    @property
    def is_int(self) -> bool:
        return self in (DType.i32, DType.i64)

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype (bf16 through ml_dtypes)."""
        return _NUMPY[self]

    @staticmethod
    def from_numpy(dt: np.dtype) -> "DType":
        dt = np.dtype(dt)
        for k, v in _NUMPY.items():
            if v == dt:
                return k
        raise TypeError(f"numpy dtype {dt} has no remat dtype; valid: {', '.join(d.value for d in DType)}")

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return f"DType.{self.value}"


_DTYPE_CODE = {d: i for i, d in enumerate(DType)}
_ITEMSIZE = {DType.bool: 1, DType.i32: 4, DType.i64: 8, DType.f16: 2, DType.bf16: 2, DType.f32: 4, DType.f64: 8}
_NUMPY = {
    DType.bool: np.dtype(np.bool_),
    DType.i32: np.dtype(np.int32),
    DType.i64: np.dtype(np.int64),
    DType.f16: np.dtype(np.float16),
    DType.bf16: np.dtype(ml_dtypes.bfloat16),
    DType.f32: np.dtype(np.float32),
    DType.f64: np.dtype(np.float64),
}

# Result dtype of mixing two dtypes in a binary op (NumPy-like promotion restricted to our set).
_RANK = [DType.bool, DType.i32, DType.i64, DType.bf16, DType.f16, DType.f32, DType.f64]


def promote(a: DType, b: DType) -> DType:
    """Binary-op result dtype. Mixing f16 and bf16 goes to f32, as in PyTorch."""
    if a == b:
        return a
    if {a, b} == {DType.f16, DType.bf16}:
        return DType.f32
    return max(a, b, key=_RANK.index)


@dataclass(frozen=True)
class TensorType:
    """A tensor type: dtype and static shape. Printed as ``f32[2,3]``; a scalar is ``f32[]``."""

    dtype: DType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a DType, got {self.dtype!r}")
        shape = tuple(self.shape)
        for d in shape:
            if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
                raise TypeError(f"shape {shape} has an invalid dimension {d!r}; dimensions are integers >= 0")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    def __hash__(self) -> int:
        # Cached: types key the planners' memo tables (kernel keys, block kinds), hashed millions of
        # times; the dataclass's own hash rehashes the DType member (a Python-level Enum.__hash__).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((_DTYPE_CODE[self.dtype], self.shape))  # ints only: the same in every process (pickles)
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def rank(self) -> int:
        return len(self.shape)

    @cached_property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of a dense buffer of this type."""
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def with_dtype(self, dtype: DType) -> "TensorType":
        return TensorType(dtype, self.shape)

    def __str__(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.shape)}]"

    def __repr__(self) -> str:
        return f"TensorType({self})"


class _TypeMaker:
    """``remat.f32[1, 784]`` builds a TensorType; ``remat.f32[()]`` is a scalar."""

    def __init__(self, dtype: DType):
        self.dtype = dtype

    def __getitem__(self, shape) -> TensorType:
        if shape == () or shape is None:
            return TensorType(self.dtype, ())
        if not isinstance(shape, tuple):
            shape = (shape,)
        return TensorType(self.dtype, shape)

    @property
    def scalar(self) -> TensorType:
        return TensorType(self.dtype, ())

    def __repr__(self) -> str:
        return f"remat.{self.dtype.value}"


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes; raises ValueError naming the incompatible dims."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ValueError(f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast (axis {i - rank}: {sorted(dims)})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)
