"""Lowering rules from core ATen ops (as produced by ``torch.export`` + ``run_decompositions``) to
remat IR ops: one small function per ATen overload, registered in :data:`LOWERINGS`.

A rule receives a :class:`Lowerer` (builder, node metadata, helpers) and the node's arguments with
FX nodes replaced by IR values; it returns an IR value, or a tuple for multi-output ATen ops (with
``None`` for outputs it does not compute, which the importer rejects if they are used).
IR values have value semantics, so ATen views (view, permute, expand …) become the IR op that
computes the same logical array; strides never matter.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..ir import Builder, DType, TensorType, Value
from ..ir.ops.attention import repeat_kv
from ..ir.ops.routing import flat_along
from ..ir.types import broadcast_shapes

_TORCH_TO_DTYPE = {
    torch.bool: DType.bool, torch.int32: DType.i32, torch.int64: DType.i64, torch.float16: DType.f16,
    torch.bfloat16: DType.bf16, torch.float32: DType.f32, torch.float64: DType.f64,
}


def to_dtype(dt: torch.dtype) -> DType:
    """The remat dtype of a torch dtype; raises TypeError listing the supported ones."""
    try:
        return _TORCH_TO_DTYPE[dt]
    except KeyError:
        valid = ", ".join(str(t).removeprefix("torch.") for t in _TORCH_TO_DTYPE)
        raise TypeError(f"torch dtype {dt} has no remat equivalent; supported: {valid}") from None


class LoweringError(Exception):
    """An ATen op is supported but not with these arguments; the importer adds where it came from."""


class Lowerer:
    """State shared by the rules while translating one FX node: the builder, the node's expected
    outputs (``meta['val']``), and the function's dropout seed."""

    def __init__(self, builder: Builder, seed_fn: Callable[[], Value]):
        self.b = builder
        self._seed_fn = seed_fn
        self.node: torch.fx.Node | None = None
        self.dropout_count = 0

    # -- what the node must produce
    def meta(self, i: int | None = None) -> Any:
        v = self.node.meta.get("val")
        return v[i] if i is not None else v

    def out_type(self, i: int | None = None) -> TensorType:
        v = self.meta(i)
        return TensorType(to_dtype(v.dtype), tuple(int(d) for d in v.shape))

    @staticmethod
    def arg_meta(a: Any) -> Any:
        """The example value of an FX argument: a fake tensor for a node, else the Python value."""
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    def used_outputs(self) -> set[int]:
        """Indices of a multi-output node's results that some user reads."""
        used = set()
        for u in self.node.users:
            if u.op == "call_function" and u.target is operator.getitem:
                used.add(u.args[1])
            else:
                used.update(range(64))
        return used

    # -- value helpers
    def op(self, name: str, *operands: Value, **attrs: Any) -> Value:
        return self.b.op(name, *operands, **attrs)

    def const(self, value: float | int | bool, dtype: DType, shape: Sequence[int] = ()) -> Value:
        if dtype == DType.bool:
            value = bool(value)
        elif dtype.is_int:
            if isinstance(value, float) and value != int(value):
                raise LoweringError(f"constant {value!r} is not an integer but the tensor is {dtype}")
            value = int(value)
        else:
            value = float(value)
        return self.op("constant", value=value, shape=tuple(shape), dtype=dtype)

    def cast(self, v: Value, dtype: DType) -> Value:
        return v if v.type.dtype == dtype else self.op("cast", v, dtype=dtype)

    def value(self, x: Value | float | int | bool, dtype: DType) -> Value:
        """``x`` as an IR value of ``dtype``: Python scalars become constants, values are cast."""
        if isinstance(x, Value):
            return self.cast(x, dtype)
        return self.const(x, dtype)

    def reshape(self, v: Value, shape: Sequence[int]) -> Value:
        shape = tuple(int(d) for d in shape)
        return v if v.type.shape == shape else self.op("reshape", v, shape=shape)

    def seed(self) -> Value:
        """A fresh seed for the next random op: ``fold_seed(seed, k)`` for the k-th one."""
        k = self.dropout_count
        self.dropout_count += 1
        return self.op("fold_seed", self._seed_fn(), salt=k)


Rule = Callable[..., Any]
LOWERINGS: dict[str, Rule] = {}
# ATen overloads kept whole by ``run_decompositions`` (composite ops remat lowers to one IR op with
# a native kernel, instead of the primitives PyTorch's default table would decompose them into).
KEEP: set[str] = set()


def lower(*names: str, keep: bool = False):
    """Register a rule for ATen overloads given as ``"add.Tensor"`` (the ``aten.`` prefix implied),
    or for another library's op by its full name (``"transformers.grouped_mm_fallback.default"``).

    ``keep=True``: the overloads are removed from PyTorch's decomposition table, so the rule sees
    the composite op itself (e.g. ``linear``) rather than its decomposition.
    """

    def deco(fn: Rule) -> Rule:
        for n in names:
            if n in LOWERINGS:
                raise ValueError(f"two lowering rules for aten.{n}")
            LOWERINGS[n] = fn
            if keep:
                KEEP.add(n)
        return fn

    return deco


def _overload(name: str):
    """The ATen overload ``"packet.overload"`` names (``"packet"``: its default), or None."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)


DECOMPOSED = ("elu.default",)
"""Core ATen overloads that PyTorch's export table keeps but remat has no rule for, decomposed by
PyTorch's own decompositions (``torch._decomp``) into ops it lowers: ``elu`` (also ``selu`` and
``celu``, which PyTorch writes with it) as ``expm1``, products and a select; its gradient is then
the autodiff of those, equal to ATen's ``elu_backward`` up to rounding."""


def decomposition_table(keep: set[str] | None = None) -> dict:
    """PyTorch's default export decompositions, less the overloads in ``keep`` (default :data:`KEEP`),
    plus PyTorch's decompositions of :data:`DECOMPOSED`."""
    from torch._decomp import get_decompositions

    table = torch.export.default_decompositions()
    table.update(get_decompositions([op for op in map(_overload, DECOMPOSED) if op is not None]))
    for n in KEEP if keep is None else keep:
        op = _overload(n)
        if op is not None:
            table.pop(op, None)
    return table


def decomposition_tables() -> list[tuple[str, dict]]:
    """The decomposition tables the importer tries in order, named for error messages: remat's
    (composites with native kernels kept whole), then one that also keeps every other overload
    remat lowers itself, for when one of PyTorch's decompositions fails on a model (e.g. a
    ``view`` of a non-contiguous tensor in a decomposed attention)."""
    return [("remat's decomposition table", decomposition_table()),
            ("the table keeping every op remat lowers", decomposition_table(KEEP | set(LOWERINGS)))]


def _axis(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _axes(dims: Sequence[int] | int | None, rank: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return tuple(range(rank))
    return tuple(sorted({_axis(int(d), max(rank, 1)) for d in dims}))


def _pair(v: Sequence[int] | int, name: str) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    if len(v) == 1:
        return (v[0], v[0])
    if len(v) != 2:
        raise LoweringError(f"{name} {list(v)} needs 1 or 2 entries for a 2-d op")
    return v


# ---------------------------------------------------------------- element-wise
def _result_dtype(L: Lowerer) -> DType:
    """The dtype PyTorch computes a binary op in, from the node's example operands (tensors or scalars)."""
    a, b = L.node.args[:2]
    return to_dtype(torch.result_type(L.arg_meta(a), L.arg_meta(b)))


def _binary(name: str):
    def rule(L: Lowerer, a, b, alpha=1):
        dt = L.out_type().dtype if name not in _CMP else _result_dtype(L)
        if dt == DType.bool and name in ("add", "mul", "maximum", "minimum"):  # bool arithmetic is logic
            return L.op({"add": "or", "mul": "and", "maximum": "or", "minimum": "and"}[name], L.value(a, dt), L.value(b, dt))
        if alpha != 1:
            b = L.op("mul", L.value(b, dt), L.const(alpha, dt))
        return L.op(name, L.value(a, dt), L.value(b, dt))

    return rule


_CMP = {"eq", "ne", "lt", "le", "gt", "ge"}
for _n, _ops in {
    "add": ("add.Tensor", "add.Scalar"), "sub": ("sub.Tensor", "sub.Scalar"), "mul": ("mul.Tensor", "mul.Scalar"),
    "maximum": ("maximum.default",), "minimum": ("minimum.default",),
    "pow": ("pow.Tensor_Tensor",),
    **{c: (f"{c}.Tensor", f"{c}.Scalar") for c in _CMP},
}.items():
    lower(*_ops)(_binary(_n))


@lower("div.Tensor", "div.Scalar")
def _div(L: Lowerer, a, b):
    dt = L.out_type().dtype
    return L.op("div", L.value(a, dt), L.value(b, dt))


@lower("div.Tensor_mode")
def _div_mode(L: Lowerer, a, b, rounding_mode=None):
    if rounding_mode is None:
        return _div(L, a, b)
    if rounding_mode != "floor":
        raise LoweringError(f"division with rounding_mode={rounding_mode!r} is not supported (true division "
                            "or rounding_mode='floor')")
    q = _div(L, a, b)  # the IR divides integers rounding down already
    return L.op("floor", q) if L.out_type().dtype.is_float else q


@lower("remainder.Scalar", "remainder.Tensor")
def _remainder(L: Lowerer, a, b):
    """``a - floor(a / b) * b``: the sign of the divisor, as Python's ``%`` (hash buckets, block ids
    of Hugging Face's CANINE and LongT5). Integers exactly; floats up to rounding (ATen takes
    ``fmod`` and corrects its sign). The gradient is 1 for ``a`` and ``-floor(a / b)`` for ``b``."""
    dt = L.out_type().dtype
    a, b = L.value(a, dt), L.value(b, dt)
    q = L.op("div", a, b)
    if dt.is_float:
        q = L.op("floor", q)
    return L.op("sub", a, L.op("mul", q, b))


@lower("ceil.default")
def _ceil(L: Lowerer, x):
    """``-floor(-x)`` (DeBERTa-v2's log-bucketed relative positions); integers are their own ceiling."""
    dt = L.out_type().dtype
    x = L.cast(x, dt)
    return L.op("neg", L.op("floor", L.op("neg", x))) if dt.is_float else x


@lower("rsub.Scalar", "rsub.Tensor")
def _rsub(L: Lowerer, a, b, alpha=1):
    dt = L.out_type().dtype
    a = L.value(a, dt)
    if alpha != 1:
        a = L.op("mul", a, L.const(alpha, dt))
    return L.op("sub", L.value(b, dt), a)


@lower("pow.Tensor_Scalar")
def _pow_scalar(L: Lowerer, x, e):
    dt = L.out_type().dtype
    x = L.value(x, dt)
    if e == 1:
        return x
    if e == 2:
        return L.op("mul", x, x)
    if e == 0.5 and dt.is_float:
        return L.op("sqrt", x)
    if e == -0.5 and dt.is_float:
        return L.op("rsqrt", x)
    return L.op("pow", x, L.const(e, dt))


@lower("pow.Scalar")
def _pow_base(L: Lowerer, base, e):
    dt = L.out_type().dtype
    return L.op("pow", L.const(base, dt), L.value(e, dt))


_UNARY = {"neg": "neg", "abs": "abs", "sign": "sign", "relu": "relu", "exp": "exp", "log": "log", "sqrt": "sqrt",
          "rsqrt": "rsqrt", "tanh": "tanh", "sigmoid": "sigmoid", "sin": "sin", "cos": "cos", "erf": "erf",
          "floor": "floor"}


def _unary(name: str):
    def rule(L: Lowerer, x):
        return L.op(name, L.cast(x, L.out_type().dtype))

    return rule


for _a, _r in _UNARY.items():
    lower(f"{_a}.default")(_unary(_r))


@lower("gelu.default")
def _gelu(L: Lowerer, x, approximate="none"):
    return L.op("gelu", x, approximate=approximate)


@lower("reciprocal.default")
def _reciprocal(L: Lowerer, x):
    dt = L.out_type().dtype
    return L.op("div", L.const(1, dt), L.cast(x, dt))


@lower("log1p.default")
def _log1p(L: Lowerer, x):
    dt = L.out_type().dtype
    return L.op("log", L.op("add", L.cast(x, dt), L.const(1, dt)))


@lower("expm1.default")
def _expm1(L: Lowerer, x):
    dt = L.out_type().dtype
    return L.op("sub", L.op("exp", L.cast(x, dt)), L.const(1, dt))


@lower("silu.default", keep=True)
def _silu(L: Lowerer, x):
    """One op, whose backward keeps only ``x`` as PyTorch's does (``x * sigmoid(x)`` kept both)."""
    return L.op("silu", x)


@lower("leaky_relu.default")
def _leaky_relu(L: Lowerer, x, negative_slope=0.01):
    dt = x.type.dtype
    return L.op("select", L.op("gt", x, L.const(0, dt)), x, L.op("mul", x, L.const(negative_slope, dt)))


@lower("hardtanh.default", keep=True)
def _hardtanh(L: Lowerer, x, min_val=-1.0, max_val=1.0):
    """One op (ReLU6 is hardtanh(0, 6)): its backward keeps the output, where a clamp's keeps the input
    of both its halves (MobileNetV2's unconstrained peak: 1.27x eager's with the clamp)."""
    if not x.type.dtype.is_float or not min_val < max_val:
        return _clamp(L, x, min_val, max_val)
    return L.op("hardtanh", x, min_val=float(min_val), max_val=float(max_val))


@lower("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default")
def _clamp(L: Lowerer, x, min=None, max=None):
    if L.node.target.__name__.startswith("clamp_max"):
        min, max = None, min
    dt = L.out_type().dtype
    x = L.cast(x, dt)
    if min is not None:
        x = L.op("maximum", x, L.value(min, dt))
    if max is not None:
        x = L.op("minimum", x, L.value(max, dt))
    return x


@lower("where.self")
def _where(L: Lowerer, c, a, b):
    dt = L.out_type().dtype
    return L.op("select", L.cast(c, DType.bool) if isinstance(c, Value) else L.const(c, DType.bool),
                L.value(a, dt), L.value(b, dt))


@lower("bitwise_not.default")
def _bitwise_not(L: Lowerer, x):
    if x.type.dtype != DType.bool:
        raise LoweringError(f"bitwise_not of {x.type} is not supported (only of bool tensors)")
    return L.op("not", x)


@lower("logical_not.default")
def _logical_not(L: Lowerer, x):
    if x.type.dtype == DType.bool:
        return L.op("not", x)
    return L.op("eq", x, L.const(0, x.type.dtype))


def _as_bool(L: Lowerer, x) -> Value:
    if isinstance(x, Value):
        return x if x.type.dtype == DType.bool else L.op("ne", x, L.const(0, x.type.dtype))
    return L.const(bool(x), DType.bool)


def _logic(name: str):
    def rule(L: Lowerer, a, b):
        a, b = _as_bool(L, a), _as_bool(L, b)
        if name == "xor":
            return L.op("ne", a, b)
        return L.op(name, a, b)

    return rule


lower("logical_and.default", "bitwise_and.Tensor")(_logic("and"))
lower("logical_or.default", "bitwise_or.Tensor")(_logic("or"))
lower("logical_xor.default", "bitwise_xor.Tensor")(_logic("xor"))


@lower("_to_copy.default")
def _to_copy(L: Lowerer, x, **kwargs):
    return L.cast(x, L.out_type().dtype)


@lower("copy.default")
def _copy(L: Lowerer, dst, src, non_blocking=False):
    """Functional ``dst.copy_(src)`` (from in-place writes such as T5's ``_shift_right``): ``src``
    converted to ``dst``'s dtype and broadcast to its shape; ``dst``'s values are unused."""
    t = L.out_type()
    v = L.cast(src, t.dtype)
    return v if v.type.shape == t.shape else L.op("broadcast", v, shape=t.shape)


@lower("clone.default", "alias.default", "lift_fresh_copy.default", "detach.default", "contiguous.default")
def _identity(L: Lowerer, x, **kwargs):
    return x


@lower("_assert_tensor_metadata.default", "_assert_scalar.default", "_assert_async.msg")
def _assertion(L: Lowerer, *args, **kwargs):
    """Trace-time checks of dtypes and shapes: shapes are static in remat, so they hold already."""
    return None


# ---------------------------------------------------------------- creation
@lower("scalar_tensor.default", "full.default", "full_like.default", "zeros_like.default", "ones_like.default",
       "zeros.default", "ones.default", "empty.memory_format", "empty_like.default", "empty_permuted.default")
def _full(L: Lowerer, *args, **kwargs):
    """Constant tensors; ``empty*`` (contents unspecified, written before being read) as zeros."""
    t = L.out_type()
    name = L.node.target.__name__.split(".")[0]
    value = {"zeros_like": 0, "ones_like": 1, "zeros": 0, "ones": 1, "empty": 0, "empty_like": 0,
             "empty_permuted": 0}.get(name)
    if value is None:
        value = args[0] if name == "scalar_tensor" else args[1]
    return L.const(value, t.dtype, t.shape)


@lower("arange.default", "arange.start", "arange.start_step")
def _arange(L: Lowerer, *args, **kwargs):
    t = L.out_type()
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    v = L.op("iota", shape=t.shape, axis=0, dtype=t.dtype)
    if step != 1:
        v = L.op("mul", v, L.const(step, t.dtype))
    if start != 0:
        v = L.op("add", v, L.const(start, t.dtype))
    return v


# ---------------------------------------------------------------- shape
@lower("view.default", "_unsafe_view.default", "reshape.default", "squeeze.default", "squeeze.dim", "squeeze.dims",
       "unsqueeze.default", "flatten.using_ints", "view_copy.default")
def _reshape(L: Lowerer, x, *args, **kwargs):
    return L.reshape(x, L.out_type().shape)


@lower("permute.default")
def _permute(L: Lowerer, x, dims):
    perm = tuple(_axis(int(d), x.type.rank) for d in dims)
    return x if perm == tuple(range(x.type.rank)) else L.op("transpose", x, perm=perm)


@lower("transpose.int")
def _transpose(L: Lowerer, x, d0, d1):
    perm = list(range(x.type.rank))
    a, b = _axis(d0, x.type.rank), _axis(d1, x.type.rank)
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(L, x, perm)


@lower("t.default")
def _t(L: Lowerer, x):
    return x if x.type.rank < 2 else _permute(L, x, [1, 0])


@lower("expand.default", "expand_copy.default")
def _expand(L: Lowerer, x, size, implicit=False):
    shape = L.out_type().shape
    return x if x.type.shape == shape else L.op("broadcast", x, shape=shape)


@lower("repeat.default")
def _repeat(L: Lowerer, x, repeats):
    """``Tensor.repeat`` (tiling, as ``np.tile``): each axis of size d becomes the reps-fold of itself,
    as a broadcast of x with a new axis of the reps before each of its axes, merged back."""
    reps = [int(r) for r in repeats]
    shape = (1,) * (len(reps) - x.type.rank) + x.type.shape
    if all(r == 1 for r in reps):
        return x if x.type.shape == shape else L.op("reshape", x, shape=shape)
    spread = tuple(d for pair in zip([1] * len(shape), shape) for d in pair)
    tiled = tuple(d for pair in zip(reps, shape) for d in pair)
    b = L.op("broadcast", L.op("reshape", x, shape=spread), shape=tiled)
    return L.op("reshape", b, shape=tuple(r * d for r, d in zip(reps, shape)))


def _positions(shape: Sequence[int], strides: Sequence[int], offset: int) -> np.ndarray:
    """Storage position of every element of a strided tensor, in logical (row-major) order."""
    pos = np.full((), offset, dtype=np.int64)
    for d, st in zip(shape, strides):
        pos = pos[..., None] + np.arange(int(d), dtype=np.int64) * int(st)
    return pos.reshape(-1)


@lower("as_strided.default", "as_strided_copy.default")
def _as_strided(L: Lowerer, x, size, stride, storage_offset=None):
    """``as_strided`` that only restrides: the result holds each element of ``x`` exactly once
    (PyTorch emits it, e.g., to give a reduction's result a channels-last layout). Storage
    positions come from the example input's strides; the result is ``x``'s logical array
    reshaped and transposed, which remat computes by value (strides never matter in the IR)."""
    xm = L.arg_meta(L.node.args[0])
    size, stride = [int(d) for d in size], [int(d) for d in stride]
    off = int(xm.storage_offset() if storage_offset is None else storage_offset)
    n = math.prod(size)
    where = {int(p): i for i, p in enumerate(_positions(xm.shape, xm.stride(), int(xm.storage_offset())))}
    reads = _positions(size, stride, off)
    if n != x.type.numel or len(where) != n or len(set(reads.tolist())) != n or any(int(p) not in where for p in reads):
        raise LoweringError(f"as_strided to size {size}, strides {stride}, offset {off} over an input of shape "
                            f"{list(xm.shape)} and strides {list(xm.stride())} does not restride the input (it skips, "
                            "repeats or overlaps elements); only as_strided that permutes all elements is supported")
    logical = np.array([where[int(p)] for p in reads], dtype=np.int64).reshape(size)
    # Order the result's non-unit axes by their stride in x's logical array: x reshaped to those
    # sizes, then transposed into the result's axis order, must read the same elements.
    axes = [i for i, d in enumerate(size) if d > 1]
    first = logical.flat[0] if n else 0
    lstride = {i: int(logical[tuple(1 if j == i else 0 for j in range(len(size)))] - first) for i in axes}
    order = sorted(axes, key=lambda i: -lstride[i])
    perm = [order.index(i) for i in axes]
    expect = np.arange(n).reshape([size[i] for i in order]).transpose(perm).reshape(size)
    if not np.array_equal(expect, logical):
        raise LoweringError(f"as_strided to size {size}, strides {stride} permutes the input's elements in a way that "
                            "is no transpose; only as_strided equal to a reshape and a transpose is supported")
    y = L.reshape(x, [size[i] for i in order])
    if perm != list(range(len(perm))):
        y = L.op("transpose", y, perm=perm)
    return L.reshape(y, size)


def _slice(L: Lowerer, x: Value, dim: int, start: int, stop: int, step: int = 1) -> Value:
    shape = x.type.shape
    if start == 0 and stop == shape[dim] and step == 1:
        return x
    lo = [0] * len(shape)
    hi = list(shape)
    st = [1] * len(shape)
    lo[dim], hi[dim], st[dim] = start, stop, step
    return L.op("slice", x, start=lo, stop=hi, step=st)


@lower("slice.Tensor", "slice_copy.Tensor")
def _slice_tensor(L: Lowerer, x, dim=0, start=None, end=None, step=1):
    dim = _axis(dim, x.type.rank)
    s, e, st = slice(start, end, step).indices(x.type.shape[dim])
    if st < 1:
        raise LoweringError(f"slice step {step} is not supported; steps must be >= 1")
    e = max(e, s)
    return _slice(L, x, dim, s, e, st)


@lower("slice_scatter.default")
def _slice_scatter(L: Lowerer, x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``x[start:end]`` along ``dim`` replaced by ``src`` (functional slice assignment,
    e.g. ``y[..., 1:] = x[..., :-1]``): the kept parts of ``x`` around ``src``, concatenated."""
    dim = _axis(dim, x.type.rank)
    n = x.type.shape[dim]
    s, e, st = slice(start, end, step).indices(n)
    e = max(e, s)
    if st != 1:
        raise LoweringError(f"slice_scatter with step {step} is not supported; only step 1")
    src = L.cast(src, x.type.dtype)
    parts = ([_slice(L, x, dim, 0, s)] if s > 0 else []) + [src] + ([_slice(L, x, dim, e, n)] if e < n else [])
    return parts[0] if len(parts) == 1 else L.op("concat", *parts, axis=dim)


@lower("select.int", "select_copy.int")
def _select(L: Lowerer, x, dim, index):
    dim = _axis(dim, x.type.rank)
    index = index + x.type.shape[dim] if index < 0 else index
    return L.reshape(_slice(L, x, dim, index, index + 1), L.out_type().shape)


@lower("split_with_sizes.default", "split.Tensor", "split_with_sizes_copy.default", "split_copy.Tensor")
def _split(L: Lowerer, x, sizes, dim=0):
    dim = _axis(dim, x.type.rank)
    n = x.type.shape[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)] or [0]
    out, at = [], 0
    for s in sizes:
        out.append(_slice(L, x, dim, at, at + s))
        at += s
    return tuple(out)


@lower("unbind.int")
def _unbind(L: Lowerer, x, dim=0):
    dim = _axis(dim, x.type.rank)
    shape = x.type.shape[:dim] + x.type.shape[dim + 1:]
    return tuple(L.reshape(_slice(L, x, dim, i, i + 1), shape) for i in range(x.type.shape[dim]))


@lower("cat.default")
def _cat(L: Lowerer, tensors, dim=0):
    t = L.out_type()
    parts = [L.cast(v, t.dtype) for v in tensors if not (v.type.rank == 1 and v.type.shape[0] == 0)]
    if len(parts) == 1:
        return parts[0]
    return L.op("concat", *parts, axis=_axis(dim, t.rank))


@lower("roll.default", keep=True)
def _roll(L: Lowerer, x, shifts, dims=()):
    """``torch.roll`` (Swin's cyclic shift) as the two slices of each rolled axis, concatenated in
    swapped order (PyTorch's decomposition gathers at ``fmod(arange + shift, n)`` instead)."""
    shifts = [int(shifts)] if isinstance(shifts, int) else [int(v) for v in shifts]
    dims = [int(dims)] if isinstance(dims, int) else [int(d) for d in dims]
    if not dims:  # roll of the flattened tensor
        if len(shifts) != 1:
            raise LoweringError(f"roll with shifts {shifts} and no dims: give one shift (PyTorch does too)")
        return L.reshape(_roll(L, L.reshape(x, (x.type.numel,)), shifts, [0]), x.type.shape)
    if len(shifts) != len(dims):
        raise LoweringError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    for shift, d in zip(shifts, dims):
        d = _axis(d, x.type.rank)
        n = x.type.shape[d]
        k = shift % n if n else 0
        if k:
            x = L.op("concat", _slice(L, x, d, n - k, n), _slice(L, x, d, 0, n - k), axis=d)
    return x


@lower("col2im.default", keep=True)
def _col2im(L: Lowerer, x, output_size, kernel_size, dilation, padding, stride):
    """``F.fold`` (MobileViTV2's patches back to a feature map) where the windows tile the output
    exactly (stride = kernel, dilation 1, no padding, sizes divisible): a reshape and a transpose,
    [N, C*kh*kw, nh*nw] -> [N, C, nh*kh, nw*kw]. PyTorch's decomposition scatter-adds with
    ``index_put``; overlapping or padded windows (which need that sum) are refused."""
    (h, w), (kh, kw) = _pair(output_size, "output_size"), _pair(kernel_size, "kernel_size")
    if (_pair(dilation, "dilation") != (1, 1) or _pair(padding, "padding") != (0, 0)
            or _pair(stride, "stride") != (kh, kw) or h % kh or w % kw):
        raise LoweringError(f"col2im (F.fold) with kernel {[kh, kw]}, stride {list(_pair(stride, 'stride'))}, dilation "
                            f"{list(_pair(dilation, 'dilation'))} and padding {list(_pair(padding, 'padding'))} to "
                            f"{[h, w]} is not supported; only windows that tile the output exactly (stride = kernel, "
                            "dilation 1, no padding, output sizes multiples of the kernel)")
    batched = x.type.rank == 3
    n = x.type.shape[0] if batched else 1
    c = x.type.shape[-2] // (kh * kw)
    nh, nw = h // kh, w // kw
    v = L.op("transpose", L.reshape(x, (n, c, kh, kw, nh, nw)), perm=(0, 1, 4, 2, 5, 3))
    return L.reshape(v, L.out_type().shape)


@lower("constant_pad_nd.default")
def _pad(L: Lowerer, x, pad, value=0):
    rank = x.type.rank
    lo, hi = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):  # pad lists (left, right) pairs from the last axis backwards
        lo[rank - 1 - i], hi[rank - 1 - i] = int(pad[2 * i]), int(pad[2 * i + 1])
    if any(p > 0 for p in lo + hi):
        x = L.op("pad", x, low=[max(p, 0) for p in lo], high=[max(p, 0) for p in hi], value=float(value))
    if any(p < 0 for p in lo + hi):  # negative padding crops
        shape = x.type.shape
        x = L.op("slice", x, start=[max(-p, 0) for p in lo], stop=[d - max(-p, 0) for d, p in zip(shape, hi)])
    return x


@lower("embedding.default")
def _embedding(L: Lowerer, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """A gather of the table's rows; ``padding_idx``'s row gets no gradient (as PyTorch's backward)."""
    if scale_grad_by_freq:
        raise LoweringError("embedding with scale_grad_by_freq=True is not supported (its gradient is scaled by "
                            "each index's count in the batch)")
    pad = int(padding_idx) if padding_idx is not None else -1
    return L.op("gather", weight, indices, axis=0, padding_idx=pad if pad >= 0 else -1)


@lower("index_select.default")
def _index_select(L: Lowerer, x, dim, index):
    return L.reshape(L.op("gather", x, index, axis=_axis(dim, x.type.rank)), L.out_type().shape)


@lower("index.Tensor")
def _index(L: Lowerer, x, indices):
    """x[i0, i1, ...] with integer index tensors that broadcast together (``None`` keeps an axis):
    one ``gather`` along the indexed axes merged into one, at the flat index sum_k i_k * stride_k.
    As in NumPy/PyTorch, the broadcast index axes take the place of adjacent indexed axes and come
    first when the indexed axes are separated; negative indices count from the end."""
    rank = x.type.rank
    idx = _index_tensors(indices, rank, "indexing")
    dims = [d for d, v in enumerate(idx) if v is not None]
    if not dims:
        return x
    vals = [idx[d] for d in dims]
    if dims != list(range(dims[0], dims[-1] + 1)):  # separated: the indexed axes move to the front
        x = L.op("transpose", x, perm=dims + [d for d in range(rank) if d not in dims])
        dims = list(range(len(dims)))
    shape, first = x.type.shape, dims[0]
    flat, merged = _flat_index(L, vals, [shape[d] for d in dims])
    x = L.reshape(x, shape[:first] + (merged,) + shape[first + len(dims):])
    return L.reshape(L.op("gather", x, flat, axis=first), L.out_type().shape)


def _flat_index(L: Lowerer, vals: list[Value], sizes: list[int]) -> tuple[Value, int]:
    """(the flat index ``sum_k i_k * stride_k`` into the merged indexed axes, negative indices
    counted from the end; the merged axis' size) for index tensors ``vals`` over axes of ``sizes``."""
    it = DType.i64 if len(vals) > 1 else vals[0].type.dtype
    flat = None
    for k, (v, n) in enumerate(zip(vals, sizes)):
        v = L.cast(v, it)
        v = L.op("select", L.op("lt", v, L.const(0, it)), L.op("add", v, L.const(n, it)), v)
        stride = math.prod(sizes[k + 1:])
        term = v if stride == 1 else L.op("mul", v, L.const(stride, it))
        flat = term if flat is None else L.op("add", flat, term)
    return flat, math.prod(sizes)


def _index_tensors(indices, rank: int, what: str) -> list:
    """``indices`` padded with ``None`` to ``rank``, each integer (a boolean mask is refused)."""
    idx = list(indices) + [None] * (rank - len(indices))
    for v in idx:
        if v is None:
            continue
        if v.type.dtype == DType.bool:
            raise LoweringError(f"{what} with a boolean mask (x[mask]) involves a number of elements that depends on "
                                "the mask's values, and remat's shapes are static; use torch.where(mask, ...) or "
                                "multiply by the mask instead")
        if not v.type.dtype.is_int:
            raise LoweringError(f"index tensors must be integer or boolean, got {v.type}")
    return idx


@lower("index_put.default")
def _index_put(L: Lowerer, x, indices, values, accumulate=False):
    """``x[i0, i1, ...] = values`` (``+=`` with accumulate) with integer index tensors that broadcast
    together: one ``index_put`` along the indexed axes merged into one, as ``index.Tensor``."""
    rank = x.type.rank
    idx = _index_tensors(indices, rank, "index_put")
    dims = [d for d, v in enumerate(idx) if v is not None]
    values = L.cast(values, x.type.dtype)
    if not dims:
        v = values if values.type.shape == x.type.shape else L.op("broadcast", values, shape=x.type.shape)
        return L.op("add", x, v) if accumulate else v
    perm = None
    if dims != list(range(dims[0], dims[-1] + 1)):  # separated: the indexed axes move to the front
        perm = dims + [d for d in range(rank) if d not in dims]
        x = L.op("transpose", x, perm=perm)
        dims = list(range(len(dims)))
    vals = [idx[d] for d in ([d for d, v in enumerate(idx) if v is not None])]
    shape, first, nd = x.type.shape, dims[0], len(dims)
    bshape = broadcast_shapes(*(v.type.shape for v in vals))
    flat, merged = _flat_index(L, vals, [shape[d] for d in dims])
    if flat.type.shape != bshape:
        flat = L.op("broadcast", flat, shape=bshape)
    sub = shape[:first] + bshape + shape[first + nd:]
    if values.type.shape != sub:
        values = L.op("broadcast", values, shape=sub)
    n = math.prod(bshape)
    out = L.op("index_put", L.reshape(x, shape[:first] + (merged,) + shape[first + nd:]), L.reshape(flat, (n,)),
               L.reshape(values, shape[:first] + (n,) + shape[first + nd:]), axis=first, accumulate=bool(accumulate))
    out = L.reshape(out, shape)
    if perm is not None:
        inv = [0] * rank
        for i, q in enumerate(perm):
            inv[q] = i
        out = L.op("transpose", out, perm=inv)
    return out


@lower("index_add.default", keep=True)
def _index_add(L: Lowerer, x, dim, index, source, alpha=1):
    """``x.index_add(dim, index, source)`` (a mixture-of-experts layer's combine): ``index_put``
    with accumulate along ``dim``."""
    ax = _axis(dim, x.type.rank)
    src = L.cast(source, x.type.dtype)
    if alpha != 1:
        src = L.op("mul", src, L.const(alpha, x.type.dtype))
    if index.type.rank == 0:
        index = L.reshape(index, (1,))
        src = L.reshape(src, x.type.shape[:ax] + (1,) + x.type.shape[ax + 1:])
    return L.op("index_put", x, index, src, axis=ax, accumulate=True)


@lower("sort.default", "sort.stable")
def _sort(L: Lowerer, x, *args, **kwargs):
    """``torch.sort`` / ``argsort``: always stable (a valid order for ``stable=False`` too), so a
    recomputation and every dialect give the same indices."""
    if L.node.target is torch.ops.aten.sort.stable:
        dim, descending = kwargs.get("dim", -1), kwargs.get("descending", False)
    else:
        dim, descending = (list(args) + [-1, False][len(args):])[:2]
        dim, descending = kwargs.get("dim", dim), kwargs.get("descending", descending)
    x = L.cast(x, DType.i64) if x.type.dtype == DType.bool else x
    values, indices = L.op("sort", x, axis=_axis(int(dim), max(x.type.rank, 1)), descending=bool(descending))
    return L.cast(values, L.out_type(0).dtype), indices


@lower("topk.default")
def _topk(L: Lowerer, x, k, dim=-1, largest=True, sorted=True):
    """``torch.topk`` (a router's choice of experts): always sorted, equal values in order of position."""
    return L.op("topk", x, k=int(k), axis=_axis(int(dim), max(x.type.rank, 1)), largest=bool(largest))


@lower("histc.default")
def _histc(L: Lowerer, x, bins=100, min=0, max=0):
    """``torch.histc`` over a fixed range (the tokens per expert of a mixture-of-experts layer)."""
    if not min < max:
        raise LoweringError(f"histc with min={min} and max={max} takes its range from the data; give a fixed range "
                            "(min < max)")
    return L.op("histc", x, bins=int(bins), min=float(min), max=float(max))


@lower("transformers.grouped_mm_fallback.default")
def _grouped_mm_fallback(L: Lowerer, x, w, offs):
    """transformers' grouped matmul of its experts (``integrations/moe.py``): rows sorted by expert,
    ``offs`` the cumulative rows per expert."""
    return L.op("grouped_mm", x, w, offs)


@lower("cumsum.default")
def _cumsum(L: Lowerer, x, dim, dtype=None):
    """Running sum along ``dim`` in the result's dtype (booleans and small integers sum as int64)."""
    return L.op("cumsum", L.cast(x, L.out_type().dtype), axis=_axis(int(dim), x.type.rank))


@lower("gather.default")
def _gather_along(L: Lowerer, x, dim, index, sparse_grad=False):
    """torch.gather (take_along_axis; a masked autoencoder's kept patches): one ``gather`` of the
    flattened x at the flat positions the index points at, ``out[..., j, ...] = x[..., index[..., j, ...], ...]``
    (its gradient one ``scatter_add``, as PyTorch's backward)."""
    dim = _axis(dim, x.type.rank)
    flat = flat_along(L.b, index, x.type.shape, dim)
    return L.reshape(L.op("gather", L.reshape(x, (x.type.numel,)), flat, axis=0), index.type.shape)


# ---------------------------------------------------------------- reductions
@lower("sum.dim_IntList", "sum.default")
def _sum(L: Lowerer, x, dim=None, keepdim=False, dtype=None):
    t = L.out_type()
    return L.op("reduce_sum", L.cast(x, t.dtype), axes=_axes(dim, x.type.rank), keepdims=keepdim)


@lower("mean.dim", "mean.default")
def _mean(L: Lowerer, x, dim=None, keepdim=False, dtype=None):
    t = L.out_type()
    return L.op("reduce_mean", L.cast(x, t.dtype), axes=_axes(dim, x.type.rank), keepdims=keepdim)


@lower("amax.default")
def _amax(L: Lowerer, x, dim=(), keepdim=False):
    return L.op("reduce_max", x, axes=_axes(dim, x.type.rank), keepdims=keepdim)


@lower("amin.default")
def _amin(L: Lowerer, x, dim=(), keepdim=False):
    return L.op("neg", L.op("reduce_max", L.op("neg", x), axes=_axes(dim, x.type.rank), keepdims=keepdim))


def _first_max_index(L: Lowerer, x: Value, ax: int, m: Value, it) -> Value:
    """The first index along ``ax`` where ``x`` equals its maximum ``m`` (kept dims), as PyTorch's
    argmax: ``-max(-where(x == max, i, n))``, shaped ``it``."""
    i = L.op("iota", shape=x.type.shape, axis=ax, dtype=it.dtype)
    cand = L.op("select", L.op("eq", x, m), L.op("neg", i), L.const(-x.type.shape[ax], it.dtype))
    return L.reshape(L.op("neg", L.op("reduce_max", cand, axes=[ax], keepdims=True)), it.shape)


@lower("max.dim")
def _max_dim(L: Lowerer, x, dim, keepdim=False):
    ax = _axis(dim, x.type.rank)
    m = L.op("reduce_max", x, axes=[ax], keepdims=True)
    values = m if keepdim else L.reshape(m, L.out_type(0).shape)
    indices = _first_max_index(L, x, ax, m, L.out_type(1)) if 1 in L.used_outputs() else None
    return values, indices


@lower("argmax.default")
def _argmax(L: Lowerer, x, dim=None, keepdim=False):
    """CLIP's text pooling (the end-of-text token's position)."""
    if dim is None:  # over all elements, as one flat axis
        x, dim = L.reshape(x, (x.type.numel,)), 0
    ax = _axis(dim, x.type.rank)
    return _first_max_index(L, x, ax, L.op("reduce_max", x, axes=[ax], keepdims=True), L.out_type())


@lower("eye.default", "eye.m", keep=True)
def _eye(L: Lowerer, n, m=None, **kwargs):
    """``iota(rows) == iota(columns)`` (PyTorch's decomposition builds a uint8 arange; SigLIP's loss)."""
    t = L.out_type()
    rows, cols = (L.op("iota", shape=t.shape, axis=a, dtype=DType.i64) for a in (0, 1))
    eq = L.op("eq", rows, cols)
    return eq if t.dtype == DType.bool else L.op("cast", eq, dtype=t.dtype)


@lower("any.dim", "any.dims", "any.default")
def _any(L: Lowerer, x, dim=None, keepdim=False):
    v = L.op("cast", _as_bool(L, x), dtype=DType.i32)
    m = L.op("reduce_max", v, axes=_axes(dim, x.type.rank), keepdims=keepdim)
    return L.op("ne", m, L.const(0, DType.i32))


@lower("linalg_vector_norm.default")
def _vector_norm(L: Lowerer, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = L.cast(x, L.out_type().dtype)
    axes = _axes(dim, x.type.rank)
    if ord == 2:
        return L.op("sqrt", L.op("reduce_sum", L.op("mul", x, x), axes=axes, keepdims=keepdim))
    if ord == 1:
        return L.op("reduce_sum", L.op("abs", x), axes=axes, keepdims=keepdim)
    if ord == math.inf:
        return L.op("reduce_max", L.op("abs", x), axes=axes, keepdims=keepdim)
    raise LoweringError(f"vector norm of order {ord} is not supported (orders 1, 2 and inf are)")


def _var(L: Lowerer, x: Value, axes: tuple[int, ...], correction: float, keepdim: bool) -> tuple[Value, Value]:
    mean = L.op("reduce_mean", x, axes=axes, keepdims=True)
    d = L.op("sub", x, mean)
    n = math.prod(x.type.shape[a] for a in axes)
    ss = L.op("reduce_sum", L.op("mul", d, d), axes=axes, keepdims=keepdim)
    var = L.op("div", ss, L.const(max(n - correction, 0), x.type.dtype))
    return var, mean if keepdim else L.reshape(mean, var.type.shape)


@lower("var.correction", "var.dim")
def _var_rule(L: Lowerer, x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if isinstance(unbiased, bool):  # var.dim(x, dim, unbiased, keepdim)
        correction = 1 if unbiased else 0
    return _var(L, x, _axes(dim, x.type.rank), 1 if correction is None else correction, keepdim)[0]


@lower("var_mean.correction")
def _var_mean(L: Lowerer, x, dim=None, *, correction=None, keepdim=False):
    return _var(L, x, _axes(dim, x.type.rank), 1 if correction is None else correction, keepdim)


@lower("_softmax.default", "softmax.int")
def _softmax(L: Lowerer, x, dim, half_to_float=False):
    return L.cast(L.op("softmax", x, axis=_axis(dim, x.type.rank)), L.out_type().dtype)


@lower("_log_softmax.default", "log_softmax.int")
def _log_softmax(L: Lowerer, x, dim, half_to_float=False):
    return L.cast(L.op("log_softmax", x, axis=_axis(dim, x.type.rank)), L.out_type().dtype)


# ---------------------------------------------------------------- linear algebra
def _untransposed(v: Value) -> Value | None:
    """x when ``v`` is ``transpose(x)`` of a matrix (perm [1, 0]), else None."""
    ins = getattr(v, "instr", None)
    if ins is not None and ins.op.name == "transpose" and list(ins.attrs["perm"]) == [1, 0]:
        return ins.operands[0]
    return None


@lower("mm.default", "bmm.default")
def _mm(L: Lowerer, a, b):
    return L.op("matmul", a, b)


@lower("linear.default", keep=True)
def _linear(L: Lowerer, x, w, bias=None):
    """x @ w^T (+ bias): one ``linear`` (F.linear, the bias fused into addmm), or without a bias a
    matmul that reads w transposed in place."""
    if bias is None:
        return L.op("matmul", x, w, transpose_b=True)
    return L.op("linear", x, w, bias)


@lower("addmm.default", "baddbmm.default")
def _addmm(L: Lowerer, bias, a, b, *, beta=1, alpha=1):
    dt = L.out_type().dtype
    w = _untransposed(b) if L.node.target.__name__.startswith("addmm") else None
    if w is not None and alpha == 1 and beta == 1 and bias.type.shape == (w.type.shape[0],):
        return L.op("linear", a, w, bias)  # addmm(b, x, w^T) is PyTorch's linear
    p = L.op("matmul", a, b)
    if alpha != 1:
        p = L.op("mul", p, L.const(alpha, dt))
    if beta == 0:
        return p
    if beta != 1:
        bias = L.op("mul", bias, L.const(beta, dt))
    return L.op("add", p, bias)


# ---------------------------------------------------------------- attention
def _swap_last(L: Lowerer, x: Value) -> Value:
    r = x.type.rank
    return L.op("transpose", x, perm=list(range(r - 2)) + [r - 1, r - 2])


def _explicit_attention(L: Lowerer, q: Value, k: Value, v: Value, mask: Value | None, dropout_p: float,
                        is_causal: bool, scale: float) -> Value:
    """softmax(q kᵀ · scale, masked) with remat's replayable dropout, then @ v (for dropout_p > 0)."""
    dt = q.type.dtype
    s = L.op("mul", L.op("matmul", q, _swap_last(L, k)), L.const(scale, dt))
    t, n = s.type.shape[-2:]
    neg_inf = L.const(float("-inf"), dt)
    if is_causal:  # keep column <= row
        keep = L.op("ge", L.op("iota", shape=(t, n), axis=0), L.op("iota", shape=(t, n), axis=1))
        s = L.op("select", keep, s, neg_inf)
    if mask is not None:
        s = L.op("select", mask, s, neg_inf) if mask.type.dtype == DType.bool else L.op("add", s, mask)
    p, _ = _dropout(L, L.op("softmax", s, axis=s.type.rank - 1), dropout_p, True)
    return L.op("matmul", p, v)


@lower("scaled_dot_product_attention.default", keep=True)
def _sdpa(L: Lowerer, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as one ``attention`` op (the fused flash kernel on CPU); with
    dropout_p > 0 the explicit form, since the op has no dropout (remat's must replay on recompute)."""
    if q.type.rank != k.type.rank or q.type.rank != v.type.rank or q.type.rank < 2:
        raise LoweringError(f"attention needs query, key and value of the same rank >= 2, got {q.type}, {k.type}, {v.type}")
    if enable_gqa and q.type.shape[:-2] != k.type.shape[:-2]:
        # Grouped-query: each key/value head serves H / H_kv query heads (repeat_interleave on axis -3, as
        # PyTorch and Hugging Face's repeat_kv). Written as that repeat; fold-kv-repeats hands the shared
        # heads to the op itself before differentiation where it can take them (no additive mask).
        qs, ks = q.type.shape, k.type.shape
        if (q.type.rank < 3 or qs[:-3] != ks[:-3] or ks != v.type.shape[:-1] + ks[-1:] or ks[-3] == 0
                or qs[-3] % ks[-3]):
            raise LoweringError(f"grouped-query attention needs key and value heads (axis -3) dividing the query's, "
                                f"got {q.type}, {k.type}, {v.type}")
        k, v = repeat_kv(L, k, q), repeat_kv(L, v, q)
    if is_causal and attn_mask is not None:
        raise LoweringError("attention takes either attn_mask or is_causal=True, not both")
    dt = L.out_type().dtype
    scale = 1.0 / math.sqrt(q.type.shape[-1]) if scale is None else float(scale)
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.type.dtype == DType.bool else L.cast(attn_mask, dt)
    batch = q.type.shape[:-2]
    if not (batch == k.type.shape[:-2] == v.type.shape[:-2]):  # broadcast batch axes
        batch = broadcast_shapes(q.type.shape[:-2], k.type.shape[:-2], v.type.shape[:-2])
        q, k, v = (L.op("broadcast", x, shape=batch + x.type.shape[-2:]) if x.type.shape[:-2] != batch else x
                   for x in (q, k, v))
    if dropout_p > 0:
        return _explicit_attention(L, q, k, v, mask, float(dropout_p), bool(is_causal), scale)
    out, _ = L.op("attention", q, k, v, *([mask] if mask is not None else []), scale=scale, is_causal=bool(is_causal))
    return out


# ---------------------------------------------------------------- losses
_NLL_REDUCTION = {0: "none", 1: "mean", 2: "sum"}  # ATen's Reduction enum


@lower("nll_loss_forward.default", "nll_loss2d_forward.default", keep=True)
def _nll_loss_forward(L: Lowerer, x, target, weight, reduction, ignore_index):
    """(loss, total weight): ``nll_loss`` on the log-probabilities, so cross-entropy stays
    log_softmax + nll_loss (native kernels both ways) and no one-hot is ever built. ``nll_loss2d``
    (cross-entropy over an image's pixels, [N, C, H, W] and [N, H, W]) is the same op."""
    red = _NLL_REDUCTION[int(reduction)]
    ii = int(ignore_index)
    if x.type.rank == 1:  # a single sample [C] with a scalar target
        x, target = L.reshape(x, (1, x.type.shape[0])), L.reshape(target, (1,))
    if x.type.rank < 2:
        raise LoweringError(f"nll_loss of a rank-{x.type.rank} input {x.type} is not supported "
                            f"(only [C], [N, C] or [N, C, d1, ...])")
    dt = x.type.dtype
    every = list(range(target.type.rank))  # the reductions run over every row (and position)
    if weight is None:
        out = L.op("nll_loss", x, target, reduction=red, ignore_index=ii)
        total = None
        if 1 in L.used_outputs():
            keep = L.op("ne", target, L.const(ii, target.type.dtype))
            total = L.op("reduce_sum", L.op("cast", keep, dtype=dt), axes=every)
    else:
        keep = L.op("ne", target, L.const(ii, target.type.dtype))  # class weights: weighted per-row losses, divided by the summed weight of the kept rows
        safe = L.op("select", keep, target, L.const(0, target.type.dtype))
        wt = L.op("select", keep, L.op("gather", weight, safe, axis=0), L.const(0, dt))
        per = L.op("mul", L.op("nll_loss", x, target, reduction="none", ignore_index=ii), wt)
        total = L.op("reduce_sum", wt, axes=every)
        out = per if red == "none" else L.op("reduce_sum", per, axes=every)
        if red == "mean":
            out = L.op("div", out, total)
    return L.reshape(out, L.out_type(0).shape), total


# ---------------------------------------------------------------- convolution and pooling
@lower("convolution.default")
def _convolution(L: Lowerer, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    t = L.out_type()
    one_d = x.type.rank == 3
    if one_d:  # conv1d as a conv2d with a unit height
        x = L.reshape(x, x.type.shape[:2] + (1,) + x.type.shape[2:])
        w = L.reshape(w, w.type.shape[:2] + (1,) + w.type.shape[2:])
        stride, padding, dilation = (1, stride[0]), (0, padding[0]), (1, dilation[0])
    elif x.type.rank != 4:
        raise LoweringError(f"convolution of a rank-{x.type.rank} input {x.type} is not supported (1-d and 2-d only)")
    attrs = dict(stride=_pair(stride, "stride"), padding=_pair(padding, "padding"),
                 dilation=_pair(dilation, "dilation"), groups=int(groups))
    if transposed:  # a transposed convolution is the input gradient of the matching convolution
        out_shape = t.shape if not one_d else t.shape[:2] + (1,) + t.shape[2:]
        y = L.op("conv2d_input_grad", x, w, input_shape=out_shape, **attrs)
    else:
        y = L.op("conv2d", x, w, **attrs)
    if bias is not None:
        y = L.op("add", y, L.reshape(bias, (1, bias.type.shape[0], 1, 1)))
    return L.reshape(y, t.shape)


@lower("max_pool2d_with_indices.default", "max_pool2d.default")
def _max_pool(L: Lowerer, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    if _pair(dilation, "dilation") != (1, 1):
        raise LoweringError(f"max pooling with dilation {dilation} is not supported (only dilation 1)")
    attrs = dict(kernel=_pair(kernel, "kernel_size"), stride=_pair(stride, "stride") if stride else _pair(kernel, "kernel_size"),
                 padding=_pair(padding, "padding"))
    with_indices = L.node.target.__name__.startswith("max_pool2d_with_indices")
    # The backward keeps each window's winner index, as eager does: re-finding the winners from the
    # input costs ~20x a scatter of saved ones (zoo ResNet's stem pool: 1.6 ms against 0.07 ms). A model
    # that never reads the indices gets them as i32 (half of eager's i64 bytes), which keeps the
    # unconstrained peak below eager's where i64 raised it (zoo U-Net: +7%).
    uses_indices = with_indices and any(u.target is operator.getitem and u.args[1] == 1 for u in L.node.users)
    small = x.type.shape[-2] * x.type.shape[-1] < 2 ** 31
    y, idx = L.op("max_pool2d_with_indices", x, **attrs,
                  index_dtype=DType.i64 if uses_indices or not small else DType.i32)
    if not uses_indices:
        idx = None
    if ceil_mode and y.type.shape != L.out_type(0 if with_indices else None).shape:
        raise LoweringError("max pooling with ceil_mode=True is not supported when it changes the output size")
    return (y, idx) if with_indices else y


@lower("avg_pool2d.default")
def _avg_pool(L: Lowerer, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    k = _pair(kernel, "kernel_size")
    attrs = dict(kernel=k, stride=_pair(stride, "stride") if stride else k, padding=_pair(padding, "padding"))
    out_hw = L.out_type().shape[-2:]
    floor_hw = tuple((n + 2 * p - kk) // s + 1 for n, p, kk, s in
                     zip(x.type.shape[-2:], attrs["padding"], k, attrs["stride"]))
    if ceil_mode and floor_hw != out_hw and out_hw == (1, 1):
        return _avg_pool_one_window(L, x, k, attrs["padding"], count_include_pad, divisor_override)
    y = L.op("avg_pool2d", x, **attrs)
    if ceil_mode and y.type.shape != L.out_type().shape:
        raise LoweringError("average pooling with ceil_mode=True is not supported when it changes the output size")
    if divisor_override:
        return L.op("mul", y, L.const(k[0] * k[1] / divisor_override, x.type.dtype))
    if not count_include_pad and any(attrs["padding"]):  # divide by the number of real elements per window
        ones = L.const(1, x.type.dtype, (1, 1) + x.type.shape[2:])
        y = L.op("div", y, L.op("avg_pool2d", ones, **attrs))
    return y


def _avg_pool_one_window(L: Lowerer, x: Value, k: tuple[int, int], p: tuple[int, int], count_include_pad: bool,
                        divisor_override) -> Value:
    """Average pooling whose ``ceil_mode`` output is one window reaching past the input, e.g. Hugging
    Face EfficientNet's ``AvgPool2d(1280, ceil_mode=True)`` as a global pool: the sum of the
    elements the window covers over PyTorch's divisor (the window clipped to the padded input, or
    the elements it covers without ``count_include_pad``, or ``divisor_override``)."""
    h, w = x.type.shape[-2:]
    rows, cols = min(k[0] - p[0], h), min(k[1] - p[1], w)  # the window starts at -padding
    if divisor_override:
        divisor = int(divisor_override)
    elif count_include_pad:
        divisor = (min(k[0] - p[0], h + p[0]) + p[0]) * (min(k[1] - p[1], w + p[1]) + p[1])
    else:
        divisor = rows * cols
    r = x.type.rank
    v = _slice(L, _slice(L, x, r - 2, 0, rows), r - 1, 0, cols)
    if divisor == rows * cols:
        return L.op("reduce_mean", v, axes=[r - 2, r - 1], keepdims=True)
    return L.op("div", L.op("reduce_sum", v, axes=[r - 2, r - 1], keepdims=True), L.const(divisor, x.type.dtype))


@lower("_adaptive_avg_pool2d.default", "adaptive_avg_pool2d.default")
def _adaptive_avg_pool(L: Lowerer, x, output_size):
    oh, ow = _pair(output_size, "output_size")
    h, w = x.type.shape[-2:]
    if (oh, ow) == (1, 1):
        return L.op("reduce_mean", x, axes=[x.type.rank - 2, x.type.rank - 1], keepdims=True)
    if h % oh or w % ow or x.type.rank != 4:
        raise LoweringError(f"adaptive average pooling from {h}x{w} to {oh}x{ow} is supported only when the sizes divide")
    k = (h // oh, w // ow)
    return L.op("avg_pool2d", x, kernel=k, stride=k)


def _bilinear(L: Lowerer, x, align_corners, scales: Sequence) -> Value:
    """One ``upsample_bilinear2d`` to the traced output size, with the caller's scale factors (ATen uses
    them for the source positions when given)."""
    if x.type.rank != 4:
        raise LoweringError(f"bilinear upsampling of a rank-{x.type.rank} input {x.type} is not supported (only [N, C, H, W])")
    sh, sw = (float(s) if s is not None else 0.0 for s in scales)
    return L.op("upsample_bilinear2d", x, size=L.out_type().shape[2:], align_corners=bool(align_corners),
                scale_h=sh, scale_w=sw)


@lower("upsample_bilinear2d.default", keep=True)
def _upsample_bilinear(L: Lowerer, x, output_size, align_corners, scales_h=None, scales_w=None):
    return _bilinear(L, x, align_corners, (scales_h, scales_w))


@lower("upsample_bilinear2d.vec", keep=True)
def _upsample_bilinear_vec(L: Lowerer, x, output_size, align_corners, scale_factors=None):
    scales = (None, None) if output_size is not None or scale_factors is None else tuple(scale_factors)
    return _bilinear(L, x, align_corners, scales)


@lower("upsample_nearest2d.vec", "upsample_nearest2d.default")
def _upsample_nearest(L: Lowerer, x, *args, **kwargs):
    n, c, h, w = x.type.shape
    oh, ow = L.out_type().shape[2:]
    if oh % h or ow % w:
        raise LoweringError(f"nearest upsampling from {h}x{w} to {oh}x{ow} is supported only by integer factors")
    sh, sw = oh // h, ow // w  # repeat each pixel sh x sw times: [n,c,h,1,w,1] -> [n,c,h,sh,w,sw]
    v = L.op("broadcast", L.reshape(x, (n, c, h, 1, w, 1)), shape=(n, c, h, sh, w, sw))
    return L.reshape(v, (n, c, oh, ow))


# ---------------------------------------------------------------- normalisation
def _normalize(L: Lowerer, x: Value, axes: Sequence[int], eps: float) -> tuple[Value, Value, Value, Value]:
    """(x - mean) * rsqrt(var + eps) over ``axes``, with mean, rstd and the biased variance (dims kept)."""
    dt = x.type.dtype
    mean = L.op("reduce_mean", x, axes=axes, keepdims=True)
    d = L.op("sub", x, mean)
    var = L.op("reduce_mean", L.op("mul", d, d), axes=axes, keepdims=True)
    rstd = L.op("rsqrt", L.op("add", var, L.const(eps, dt)))
    return L.op("mul", d, rstd), mean, rstd, var


def _channel(v: Value, rank: int, L: Lowerer) -> Value:
    """A per-channel vector [C] shaped to broadcast over an NC… tensor."""
    return L.reshape(v, (1, v.type.shape[0]) + (1,) * (rank - 2))


def _affine(L: Lowerer, y: Value, weight, bias, shape_fn) -> Value:
    if weight is not None:
        y = L.op("mul", y, shape_fn(weight))
    if bias is not None:
        y = L.op("add", y, shape_fn(bias))
    return y


@lower("native_layer_norm.default")
def _layer_norm(L: Lowerer, x, normalized_shape, weight, bias, eps):
    """One ``layer_norm`` op (native kernel and backward); a bias without a weight is added after."""
    axis = x.type.rank - len(normalized_shape)
    affine = [] if weight is None else [weight] + ([bias] if bias is not None else [])
    y, mean, rstd = L.op("layer_norm", x, *affine, axis=axis, eps=eps)
    if weight is None and bias is not None:
        y = L.op("add", y, bias)
    if mean.type.dtype != x.type.dtype:
        # An f16/bf16 input with f32 weight (under autocast): ATen's kernel computes the statistics
        # in f32 and its backward reads them so, as the op's own do; torch.export's shape rule says
        # the input's dtype, so the forward's results are given so (unused, they are removed).
        mean, rstd = (L.op("cast", v, dtype=x.type.dtype) for v in (mean, rstd))
    return y, mean, rstd


@lower("native_group_norm.default")
def _group_norm(L: Lowerer, x, weight, bias, N, C, HxW, group, eps):
    """One ``group_norm`` op (native kernel and backward: it keeps x and the [N, groups] statistics,
    not the centred or normalised x), also for a half-precision input with float32 parameters (under
    ``torch.autocast``: ATen's mixed-type kernel); parameters of another dtype than x's are
    normalised with reductions instead."""
    dt = x.type.dtype
    mixed = (dt.is_low and weight is not None and bias is not None
             and weight.type.dtype == bias.type.dtype == DType.f32)
    if (mixed or all(v is None or v.type.dtype == dt for v in (weight, bias))) and x.type.rank >= 2:
        affine = []
        if weight is not None or bias is not None:
            c = x.type.shape[1]
            affine = [weight if weight is not None else L.const(1, dt, (c,)), bias if bias is not None else L.const(0, dt, (c,))]
        y, mean, rstd = L.op("group_norm", x, *affine, groups=int(group), eps=float(eps))
        # Mixed types: f32 statistics, which the backward reads; torch.export's shape rule may say
        # the input's dtype, so the forward's results are given as it says (unused, they are removed).
        val = L.meta() if L.node is not None else None
        given = list(val[1:3]) if isinstance(val, (tuple, list)) else []
        return (y, *(L.cast(v, to_dtype(t.dtype)) if isinstance(t, torch.Tensor) else v
                     for v, t in zip((mean, rstd), given + [None] * (2 - len(given)))))
    shape = x.type.shape
    g = L.reshape(x, (N, group, (C // group) * HxW))
    y, mean, rstd, _ = _normalize(L, g, [2], eps)
    y = L.reshape(y, shape)
    y = _affine(L, y, weight, bias, lambda v: _channel(v, len(shape), L))
    return y, L.reshape(mean, (N, group)), L.reshape(rstd, (N, group))


def _batch_norm(L: Lowerer, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """One ``batch_norm`` op (native kernel and backward). Training: (y, mean, invstd, new running
    mean, new running var), the last two None without running statistics; eval: (y, None, None).

    A half-precision input with float32 weights and statistics (under ``torch.autocast``, which
    leaves batch norm to ATen's mixed-dtype kernel) is one mixed-dtype ``batch_norm`` as that kernel
    is: x read in its dtype, normalised in float32, y in x's dtype, the statistics and running
    statistics float32, so the backward keeps x itself, not a float32 copy (the saved mean and
    invstd are given in the dtype the capture's metadata gives them; the backward reads the op's
    float32 ones, as eager autograd saves them). Other mixes of dtypes are normalised in the
    per-channel dtype and rounded back."""
    vectors = [v for v in (weight, bias, running_mean, running_var) if v is not None]
    wide = next((v.type.dtype for v in vectors if v.type.dtype != x.type.dtype), None)
    mixed = (wide == DType.f32 and x.type.dtype.is_low
             and all(v.type.dtype == wide for v in vectors))
    if wide is not None and mixed:
        outs = _batch_norm_op(L, x, weight, bias, running_mean, running_var, training, momentum, eps, wide)
        if not training:
            return outs
        val = L.meta() if L.node is not None else None
        given = list(val[:3]) if isinstance(val, (tuple, list)) else []
        dts = [to_dtype(t.dtype) if isinstance(t, torch.Tensor) else wide for t in (given + [None] * 3)[1:3]]
        return (outs[0],) + tuple(v if v.type.dtype == dt else L.cast(v, dt) for v, dt in zip(outs[1:3], dts)) \
            + tuple(outs[3:])
    if wide is not None:
        outs = _batch_norm(L, L.cast(x, wide), weight, bias, running_mean, running_var, training, momentum, eps)
        val = L.meta() if L.node is not None else None
        given = list(val[:3]) if isinstance(val, (tuple, list)) else []
        dts = [x.type.dtype] + [to_dtype(t.dtype) if isinstance(t, torch.Tensor) else x.type.dtype
                                for t in (given + [None] * 3)[1:3]]
        return tuple(None if v is None else L.cast(v, dt) for v, dt in zip(outs[:3], dts)) + tuple(outs[3:])
    return _batch_norm_op(L, x, weight, bias, running_mean, running_var, training, momentum, eps, x.type.dtype)


def _batch_norm_op(L: Lowerer, x, weight, bias, running_mean, running_var, training, momentum, eps, dt):
    """The ``batch_norm`` op of :func:`_batch_norm`, its per-channel values in ``dt``."""
    C = x.type.shape[1]
    affine = weight is not None or bias is not None
    aff = []
    if affine:  # torch's modules give both or neither; a lone one is completed with the identity
        aff = [weight if weight is not None else L.const(1, dt, (C,)), bias if bias is not None else L.const(0, dt, (C,))]
    running = [running_mean, running_var] if running_mean is not None else []
    if not training:
        if not running:
            raise LoweringError("batch norm in eval mode needs running statistics")
        y = L.op("batch_norm", x, *aff, *running, training=False, momentum=momentum, eps=eps, affine=affine)
        # The saved mean/invstd outputs are empty in PyTorch's eval mode and unused by forward graphs.
        return y, None, None
    outs = L.op("batch_norm", x, *aff, *running, training=True, momentum=momentum, eps=eps, affine=affine)
    return tuple(outs) + ((None, None) if not running else ())


@lower("_native_batch_norm_legit_functional.default")
def _bn_functional(L: Lowerer, x, weight, bias, running_mean, running_var, training, momentum, eps):
    out = _batch_norm(L, x, weight, bias, running_mean, running_var, training, momentum, eps)
    if not training:  # same five outputs: running statistics unchanged
        return out[0], out[1], out[2], running_mean, running_var
    if running_mean is not None and x.type.dtype.is_low and out[3].type.dtype != DType.f32:
        # PyTorch's functional form updates the running statistics in f32 for a half-precision input
        # (its statistics are f32); the model's copy into its buffers rounds them back.
        return out[:3] + tuple(L.cast(v, DType.f32) for v in out[3:])
    return out


@lower("_native_batch_norm_legit_no_training.default")
def _bn_no_training(L: Lowerer, x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(L, x, weight, bias, running_mean, running_var, False, momentum, eps)


@lower("_native_batch_norm_legit.no_stats")
def _bn_no_stats(L: Lowerer, x, weight, bias, training, momentum, eps):
    return _batch_norm(L, x, weight, bias, None, None, True, momentum, eps)[:3]


# ---------------------------------------------------------------- dropout
def _dropout(L: Lowerer, x: Value, p: float, train: bool | None) -> tuple[Value, Value | None]:
    """Inverted dropout: keep each element with probability 1-p (a bernoulli mask drawn from a
    seed folded from the function's seed parameter) and scale kept ones by 1/(1-p)."""
    if not train or p == 0:
        return x, None
    dt = x.type.dtype
    if p >= 1:
        return L.const(0, dt, x.type.shape), L.const(False, DType.bool, x.type.shape)
    mask = L.op("bernoulli", L.seed(), shape=x.type.shape, p=1.0 - p)
    y = L.op("select", mask, L.op("mul", x, L.const(1.0 / (1.0 - p), dt)), L.const(0, dt))
    return y, mask


@lower("rand.default", "rand_like.default")
def _rand(L: Lowerer, *args, **kwargs):
    """Uniform samples in [0, 1) (e.g. stochastic depth's keep mask ``floor(keep + rand)``), drawn
    from a seed folded from the function's seed parameter, like dropout: a recomputation replays the
    same values, which differ from torch's generator."""
    t = L.out_type()
    if not t.dtype.is_float:
        raise LoweringError(f"rand produces floats, got {t}")
    return L.op("uniform", L.seed(), shape=t.shape, dtype=t.dtype)


@lower("bernoulli.p")
def _bernoulli_p(L: Lowerer, x, p=0.5, generator=None):
    """``x.bernoulli(p)``: ones with probability p, else zeros, of x's shape and dtype (in-place
    dropout, ``F.dropout(..., inplace=True)``, exports as this mask times x). Drawn from a seed
    folded from the function's seed parameter, like dropout."""
    if generator is not None:
        raise LoweringError("bernoulli with an explicit generator is not supported (remat draws from its own seed)")
    t = L.out_type()
    if not t.dtype.is_float:
        raise LoweringError(f"bernoulli produces floats here, got {t}")
    mask = L.op("bernoulli", L.seed(), shape=t.shape, p=float(p))
    return L.op("select", mask, L.const(1, t.dtype), L.const(0, t.dtype))


@lower("native_dropout.default")
def _native_dropout(L: Lowerer, x, p, train):
    y, mask = _dropout(L, x, p, train)
    if mask is None and 1 in L.used_outputs():
        mask = L.const(True, DType.bool, x.type.shape)
    return y, mask


@lower("dropout.default")
def _dropout_rule(L: Lowerer, x, p, train):
    return _dropout(L, x, p, train)[0]


SUPPORTED = tuple(sorted(n if n.count(".") > 1 else f"aten.{n}" for n in LOWERINGS))
