"""Tracing machinery of the staged DSL: the trace being built, the proxy :class:`Tensor`, and
the helpers that turn Python operators, scalars and indices into IR instructions.

A :class:`Trace` owns one :class:`~remat.ir.Function` under construction and a builder at its
current block. Every proxy remembers its trace and its *scope* (the ``remat.cond`` branch that
computed it): a proxy may only be used while its scope is open, which is exactly when its
definition dominates the use, so staging errors are caught here with a readable message
instead of by the verifier.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from ..ir import Builder, DType, Function, Instruction, TensorType, Value
from ..ir.types import _TypeMaker


class TracingError(TypeError):
    """Staged code did something that cannot be staged (a Python ``if`` on a traced tensor,
    a NumPy array inside traced code, a traced tensor used outside its function or branch)."""


class _Scope:
    """A region whose values are usable while it is open: a function body or a cond branch."""

    __slots__ = ("parent", "closed", "what")

    def __init__(self, parent: "_Scope | None", what: str):
        self.parent = parent
        self.closed = False
        self.what = what


class Trace:
    """One function being staged: its IR function, the insertion point and the calls it makes.

    ``call_sites`` pairs each emitted ``call`` instruction with the callee's specialization, so
    the module can be assembled (and callee names made unique) after tracing.
    """

    def __init__(self, name: str, param_types: Sequence[TensorType]):
        self.name = name
        self.function = Function(name, param_types, [])
        self.builder = Builder(self.function.entry)
        self.root = _Scope(None, f"@{name}")
        self.scope = self.root
        self.call_sites: list[tuple[Instruction, Any]] = []
        self.finished = False


_STATE = threading.local()


def _stack() -> list[Trace]:
    s = getattr(_STATE, "stack", None)
    if s is None:
        s = _STATE.stack = []
    return s


def in_trace() -> bool:
    """Whether a staged function is being traced on this thread."""
    return bool(_stack())


def current_trace(what: str) -> Trace:
    """The innermost trace; raises :class:`TracingError` outside staged code."""
    s = _stack()
    if not s:
        raise TracingError(f"{what} works on traced tensors and must be called inside a function decorated "
                           f"with @remat.function (it stages IR; it does not compute eagerly)")
    return s[-1]


@contextmanager
def tracing(trace: Trace) -> Iterator[Trace]:
    """Make ``trace`` the current one; mark it finished on exit (its proxies die with it)."""
    _stack().append(trace)
    try:
        yield trace
    finally:
        _stack().pop()
        trace.finished = True
        trace.root.closed = True


# ---------------------------------------------------------------- scalars and dtypes
_PY_SCALARS = (bool, int, float, np.bool_, np.integer, np.floating)


def is_scalar(v: Any) -> bool:
    """A Python or NumPy scalar (or a rank-0 NumPy array) that can become a constant."""
    return isinstance(v, _PY_SCALARS) or (isinstance(v, np.ndarray) and v.ndim == 0)


def scalar_default_dtype(v: Any) -> DType:
    """The dtype a scalar takes when nothing else decides it: bool, i64 for int, f32 for float;
    NumPy scalars keep their own dtype."""
    if isinstance(v, (np.generic, np.ndarray)):
        return DType.from_numpy(v.dtype)
    if isinstance(v, bool):
        return DType.bool
    if isinstance(v, int):
        return DType.i64
    if isinstance(v, float):
        return DType.f32
    raise TypeError(f"{v!r} is not a scalar")


def scalar_value(v: Any, dtype: DType, what: str) -> bool | int | float:
    """The Python value of scalar ``v`` as an element of ``dtype``; refuses lossy or
    meaningless conversions (a float into an integer tensor, a bool into arithmetic)."""
    py = v.item() if isinstance(v, (np.generic, np.ndarray)) else v
    if dtype == DType.bool:
        if not isinstance(py, bool):
            raise TypeError(f"{what}: cannot mix the number {py!r} with a bool tensor; use True/False or cast the tensor")
        return py
    if isinstance(py, bool):
        raise TypeError(f"{what}: cannot mix the Python bool {py!r} with a {dtype} tensor; use a number or "
                        f"cast the bool tensor")
    if dtype.is_int:
        if not isinstance(py, int):
            raise TypeError(f"{what}: cannot mix the Python float {py!r} with a {dtype} tensor (no silent promotion); "
                            f"cast the tensor with .astype(remat.f32) or use an integer")
        return int(py)
    return float(py)


def as_dtype(d: Any) -> DType:
    """Accept ``remat.f32``, ``DType.f32``, ``"f32"``, a NumPy dtype or ``float``/``int``/``bool``."""
    if isinstance(d, DType):
        return d
    if isinstance(d, _TypeMaker):
        return d.dtype
    if isinstance(d, TensorType):
        return d.dtype
    if isinstance(d, str):
        try:
            return DType(d)
        except ValueError:
            pass
    if d is float:
        return DType.f32
    if d is int:
        return DType.i64
    if d is bool:
        return DType.bool
    try:
        return DType.from_numpy(np.dtype(d))
    except TypeError:
        pass
    raise TypeError(f"{d!r} is not a dtype; valid: {', '.join(t.value for t in DType)} (e.g. remat.f32)")


def _is_foreign_array(v: Any) -> bool:
    return isinstance(v, np.ndarray) or type(v).__module__.split(".")[0] == "torch"


# ---------------------------------------------------------------- emitting
def check_live(tr: Trace, x: "Tensor", what: str) -> Value:
    """The IR value of proxy ``x`` if it may be used at the current point of ``tr``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{what}: expected a traced tensor, got {type(x).__name__} {x!r}")
    if x._trace is not tr:
        if x._trace.finished:
            raise TracingError(f"{what}: a traced tensor of @{x._trace.name} was used after its staging finished; "
                               f"traced tensors only live while their function is traced — return it instead of "
                               f"keeping it in a global or closure")
        raise TracingError(f"{what}: a traced tensor of @{x._trace.name} was captured inside @{tr.name}; "
                           f"pass it to @{tr.name} as an argument")
    if x._scope.closed:
        raise TracingError(f"{what}: a value computed inside a remat.cond branch ({x._scope.what}) is used outside "
                           f"that branch; return it from both branch functions so that it flows out of the cond")
    return x.value


def wrap(tr: Trace, v: Value) -> "Tensor":
    return Tensor(v, tr, tr.scope)


def emit(op: str, *operands: "Tensor", **attrs: Any):
    """Stage one IR op on traced operands; returns a Tensor (a tuple for several results)."""
    tr = current_trace(f"'{op}'")
    vals = [check_live(tr, x, f"'{op}'") for x in operands]
    res = tr.builder.op(op, *vals, **attrs)
    if isinstance(res, tuple):
        return tuple(wrap(tr, r) for r in res)
    return wrap(tr, res)


def constant(value: Any, shape: Sequence[int] = (), dtype: Any = None) -> "Tensor":
    """Stage a splat constant; the dtype defaults to the scalar's (bool, i64, f32)."""
    dt = scalar_default_dtype(value) if dtype is None else as_dtype(dtype)
    return emit("constant", value=scalar_value(value, dt, "constant"), shape=tuple(shape), dtype=dt)


def as_tensor(v: Any, dtype: DType | None, what: str) -> "Tensor":
    """A proxy as is; a scalar as a rank-0 constant of ``dtype`` (or its default dtype)."""
    if isinstance(v, Tensor):
        return v
    if is_scalar(v):
        dt = dtype if dtype is not None else scalar_default_dtype(v)
        return emit("constant", value=scalar_value(v, dt, what), shape=(), dtype=dt)
    if _is_foreign_array(v):
        raise TracingError(f"{what}: a {type(v).__module__}.{type(v).__name__} was used inside staged code; remat "
                           f"constants are splats only — pass the array as a parameter of the staged function")
    raise TypeError(f"{what}: unsupported operand of type {type(v).__name__}: {v!r}; "
                    f"expected a traced tensor or a Python scalar")


def binary(op: str, a: Any, b: Any, sym: str | None = None) -> "Tensor":
    """Stage ``a <op> b``: equal dtypes required, a Python scalar takes the tensor's dtype."""
    what = f"'{sym or op}'"
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.dtype != b.dtype:
            raise TypeError(f"{what} mixes {a.type} and {b.type}; remat does not promote dtypes silently — "
                            f"cast one side, e.g. .astype(remat.{b.dtype.value})")
    elif isinstance(a, Tensor):
        b = as_tensor(b, a.dtype, what)
    elif isinstance(b, Tensor):
        a = as_tensor(a, b.dtype, what)
    else:
        a = as_tensor(a, None, what)
        b = as_tensor(b, a.dtype, what)
    return emit(op, a, b)


def _normalize_axis(x: "Tensor", axis: Any, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{what}: axis must be an integer, got {axis!r}")
    r = x.ndim
    if not -r <= axis < r:
        valid = f"{-r}..{r - 1}" if r else "none (rank 0)"
        raise TypeError(f"{what}: axis {axis} is out of range for {x.type}; valid: {valid}")
    return int(axis) % r


def normalize_axes(x: "Tensor", axis: Any, what: str) -> tuple[int, ...]:
    """``None`` means every axis; an int or a sequence of ints, negatives counted from the end."""
    if axis is None:
        return tuple(range(x.ndim))
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = tuple(_normalize_axis(x, a, what) for a in items)
    if len(set(axes)) != len(axes):
        raise TypeError(f"{what}: repeated axis in {list(items)}")
    return axes


def reduce(op: str, x: "Tensor", axis: Any, keepdims: bool) -> "Tensor":
    axes = normalize_axes(x, axis, f"'{op}'")
    if not axes:
        return x
    return emit(op, x, axes=axes, keepdims=bool(keepdims))


def resolve_shape(x: "Tensor", shape: Sequence[Any], what: str) -> tuple[int, ...]:
    """A target shape for ``x`` with at most one -1 inferred from the element count."""
    shape = tuple(shape)
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < -1:
            raise TypeError(f"{what}: shape {list(shape)} has an invalid dimension {d!r}; use integers >= 0 and at most one -1")
    if sum(1 for d in shape if d == -1) > 1:
        raise TypeError(f"{what}: shape {list(shape)} has more than one -1")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        if known == 0 or x.size % known:
            raise TypeError(f"{what}: cannot reshape {x.type} ({x.size} elements) to {list(shape)}")
        shape = tuple(x.size // known if d == -1 else int(d) for d in shape)
    return tuple(int(d) for d in shape)


def reshape(x: "Tensor", shape: Sequence[Any]) -> "Tensor":
    shape = resolve_shape(x, shape, "reshape")
    if shape == x.shape:
        return x
    return emit("reshape", x, shape=shape)


def matmul(a: Any, b: Any) -> "Tensor":
    """``a @ b`` with NumPy's rule for vectors (a rank-1 operand gains and then loses an axis)."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        bad = b if isinstance(a, Tensor) else a
        if is_scalar(bad):
            raise TypeError(f"'@' needs two tensors, got a scalar {bad!r}; use '*' to scale")
        as_tensor(bad, None, "'@'")  # raises the appropriate error
    if a.ndim == 0 or b.ndim == 0:
        raise TypeError(f"'@' needs tensors of rank >= 1, got {a.type} and {b.type}; use '*' for scalars")
    if a.dtype != b.dtype:
        raise TypeError(f"'@' mixes {a.type} and {b.type}; remat does not promote dtypes silently — "
                        f"cast one side, e.g. .astype(remat.{b.dtype.value})")
    va, vb = a.ndim == 1, b.ndim == 1
    if va:
        a = reshape(a, (1, a.shape[0]))
    if vb:
        b = reshape(b, (b.shape[0], 1))
    out = emit("matmul", a, b)
    if va or vb:
        shape = out.shape[:-2] + (() if va else (out.shape[-2],)) + (() if vb else (out.shape[-1],))
        out = reshape(out, shape)
    return out


# ---------------------------------------------------------------- indexing
def _int_index(k: Any) -> bool:
    return isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))


def _list_to_index(k: list, d: int, axis: int) -> "Tensor":
    if not k:
        raise IndexError(f"an empty list cannot index axis {axis}; slice with x[0:0] for an empty result")
    vals = []
    for i in k:
        if not _int_index(i):
            raise IndexError(f"list indices must be integers, got {i!r} in {k!r}")
        if not -d <= i < d:
            raise IndexError(f"index {i} in {k!r} is out of bounds for axis {axis} with size {d}")
        vals.append(int(i) % d)
    parts = [constant(v, (1,), DType.i64) for v in vals]
    return parts[0] if len(parts) == 1 else emit("concat", *parts, axis=0)


def getitem(x: "Tensor", key: Any) -> "Tensor":
    """NumPy basic indexing (ints, slices with any step, ``...``, ``None``) plus one integer-tensor
    (or list) index, staged as ``slice``, ``gather`` and ``reshape``."""
    current_trace("indexing")
    key = key if isinstance(key, tuple) else (key,)
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
    if consumed > x.ndim:
        raise IndexError(f"too many indices for {x.type}: {consumed} given for rank {x.ndim}")
    expanded: list[Any] = []
    for k in key:
        if k is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - consumed))
        else:
            expanded.append(k)
    if not any(k is Ellipsis for k in key):
        expanded.extend([slice(None)] * (x.ndim - consumed))

    starts, stops, steps = [], [], []
    reverse: list[tuple[int, int]] = []   # (axis, length) to flip after slicing
    tensor_index: tuple[int, Any] | None = None
    has_int = False
    out_shape: list[int | str] = []
    ax = 0
    for k in expanded:
        if k is None:
            out_shape.append(1)
            continue
        d = x.shape[ax]
        if isinstance(k, slice):
            r = range(*k.indices(d))
            n = len(r)
            if n == 0:
                s = (0, 0, 1)
            elif r.step > 0:
                s = (r.start, r[-1] + 1, r.step)
            else:
                s = (r[-1], r.start + 1, -r.step)
                if n > 1:
                    reverse.append((ax, n))
            out_shape.append(n)
        elif _int_index(k):
            if not -d <= k < d:
                raise IndexError(f"index {k} is out of bounds for axis {ax} of {x.type} (size {d})")
            i = int(k) % d
            s = (i, i + 1, 1)
            has_int = True
        elif isinstance(k, (Tensor, list)):
            if tensor_index is not None:
                raise IndexError("only one tensor (or list) index is supported; index in two steps")
            if isinstance(k, Tensor):
                if k.dtype == DType.bool:
                    raise IndexError("boolean mask indexing gives a data-dependent shape, which static shapes cannot "
                                     "express; use remat.ops.where(mask, x, 0) instead")
                if not k.dtype.is_int:
                    raise IndexError(f"tensor indices must be i32 or i64, got {k.type}")
            tensor_index = (ax, k)
            s = (0, d, 1)
            out_shape.append("tensor")
        elif isinstance(k, (bool, np.bool_)):
            raise IndexError("a boolean index is not supported; use an integer or a slice")
        else:
            raise IndexError(f"unsupported index {k!r} of type {type(k).__name__}; valid: integers, slices, ..., None, "
                             f"or an integer tensor")
        starts.append(s[0]); stops.append(s[1]); steps.append(s[2])
        ax += 1
    if tensor_index is not None and has_int:
        raise IndexError("mixing an integer index with a tensor index is not supported (NumPy moves the gathered "
                         "axes in that case); apply the integer index in a separate step")

    y = x
    if any((a, b, c) != (0, d, 1) for a, b, c, d in zip(starts, stops, steps, x.shape)):
        y = emit("slice", y, start=tuple(starts), stop=tuple(stops), step=tuple(steps))
    for axis, n in reverse:
        idx = binary("sub", constant(n - 1, (), DType.i64), emit("iota", shape=(n,), axis=0, dtype=DType.i64))
        y = emit("gather", y, idx, axis=axis)
    if tensor_index is not None:
        axis, k = tensor_index
        idx = _list_to_index(k, x.shape[axis], axis) if isinstance(k, list) else k
        y = emit("gather", y, idx, axis=axis)
        pos = out_shape.index("tensor")
        out_shape[pos:pos + 1] = list(idx.shape)
    final = tuple(int(d) for d in out_shape)
    if y.shape != final:
        y = emit("reshape", y, shape=final)
    return y


# ---------------------------------------------------------------- the proxy
def _bool_error(x: "Tensor", what: str) -> TracingError:
    return TracingError(
        f"{what} of a traced tensor {x.type} is unknown while staging @{x._trace.name}: its value exists only when "
        f"the staged function runs. A Python `if`, `while`, `and`, `or` or `not` on a traced value cannot be "
        f"staged; use remat.cond(pred, true_fn, false_fn, *operands) for a data-dependent branch, or "
        f"remat.ops.where(mask, a, b) for an element-wise choice")


class Tensor:
    """A traced tensor: a proxy for an IR value while a ``@remat.function`` is being staged.

    Operators, indexing and methods stage IR instructions. ``==`` stages a comparison and returns a
    proxy, so proxies hash by identity.
    """

    __slots__ = ("value", "_trace", "_scope")
    __array_ufunc__ = None      # make NumPy defer to our reflected operators
    __array_priority__ = 1000

    def __init__(self, value: Value, trace: Trace, scope: _Scope):
        self.value = value
        self._trace = trace
        self._scope = scope

    # -- static facts
    @property
    def type(self) -> TensorType:
        return self.value.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> DType:
        return self.value.type.dtype

    @property
    def ndim(self) -> int:
        return self.value.type.rank

    @property
    def size(self) -> int:
        return self.value.type.numel

    def __repr__(self) -> str:
        return f"<traced {self.type} in @{self._trace.name}>"

    def __len__(self) -> int:
        if self.ndim == 0:
            raise TypeError(f"len() of a rank-0 tensor {self.type}")
        return self.shape[0]

    def __iter__(self) -> Iterator["Tensor"]:
        if self.ndim == 0:
            raise TypeError(f"iteration over a rank-0 tensor {self.type}")
        return (getitem(self, i) for i in range(self.shape[0]))

    # -- values that do not exist while staging
    def __bool__(self) -> bool:
        raise _bool_error(self, "the truth value")

    def __float__(self) -> float:
        raise _bool_error(self, "the Python float value")

    def __int__(self) -> int:
        raise _bool_error(self, "the Python int value")

    def __index__(self) -> int:
        raise _bool_error(self, "the Python int value")

    def __complex__(self) -> complex:
        raise _bool_error(self, "the Python complex value")

    def __array__(self, dtype=None, copy=None):
        raise TracingError(f"a traced tensor {self.type} cannot become a NumPy array while @{self._trace.name} is being "
                           f"staged; use remat.ops inside staged code")

    def __setitem__(self, key, value) -> None:
        raise TypeError("traced tensors are immutable; build a new one with remat.ops.where, concat, pad or scatter_add")

    # -- arithmetic
    def __add__(self, o): return binary("add", self, o, "+")
    def __radd__(self, o): return binary("add", o, self, "+")
    def __sub__(self, o): return binary("sub", self, o, "-")
    def __rsub__(self, o): return binary("sub", o, self, "-")
    def __mul__(self, o): return binary("mul", self, o, "*")
    def __rmul__(self, o): return binary("mul", o, self, "*")

    def __truediv__(self, o):
        _check_true_div(self, o)
        return binary("div", self, o, "/")

    def __rtruediv__(self, o):
        _check_true_div(self, o)
        return binary("div", o, self, "/")

    def __pow__(self, o): return binary("pow", self, o, "**")
    def __rpow__(self, o): return binary("pow", o, self, "**")
    def __matmul__(self, o): return matmul(self, o)
    def __rmatmul__(self, o): return matmul(o, self)
    def __neg__(self): return emit("neg", self)
    def __pos__(self): return self
    def __abs__(self): return emit("abs", self)

    # -- comparisons (bool tensors)
    def __lt__(self, o): return binary("lt", self, o, "<")
    def __le__(self, o): return binary("le", self, o, "<=")
    def __gt__(self, o): return binary("gt", self, o, ">")
    def __ge__(self, o): return binary("ge", self, o, ">=")
    def __eq__(self, o): return binary("eq", self, o, "==")  # type: ignore[override]
    def __ne__(self, o): return binary("ne", self, o, "!=")  # type: ignore[override]
    __hash__ = object.__hash__

    # -- logic on bool tensors
    def __and__(self, o): return _logic("and", self, o, "&")
    def __rand__(self, o): return _logic("and", o, self, "&")
    def __or__(self, o): return _logic("or", self, o, "|")
    def __ror__(self, o): return _logic("or", o, self, "|")
    def __xor__(self, o): return _logic("ne", self, o, "^")
    def __rxor__(self, o): return _logic("ne", o, self, "^")

    def __invert__(self):
        if self.dtype != DType.bool:
            raise TypeError(f"'~' takes a bool tensor, got {self.type}; bitwise ops on integers are not in the IR")
        return emit("not", self)

    # -- indexing
    def __getitem__(self, key): return getitem(self, key)

    # -- methods
    def sum(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        """Sum over ``axis`` (an int, a tuple, or None for all axes)."""
        return reduce("reduce_sum", self, axis, keepdims)

    def mean(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        """Mean over ``axis`` (floating-point tensors)."""
        return reduce("reduce_mean", self, axis, keepdims)

    def max(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        """Maximum over ``axis``."""
        return reduce("reduce_max", self, axis, keepdims)

    def min(self, axis: Any = None, keepdims: bool = False) -> "Tensor":
        """Minimum over ``axis`` (staged as -max(-x))."""
        return emit("neg", reduce("reduce_max", emit("neg", self), axis, keepdims))

    def reshape(self, *shape: Any) -> "Tensor":
        """Same elements, new shape (one -1 is inferred); ``x.reshape(2, 3)`` or ``x.reshape((2, 3))``."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return reshape(self, shape)

    def transpose(self, *perm: Any) -> "Tensor":
        """Permute axes; no arguments reverses them (as NumPy)."""
        if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
            perm = tuple(perm[0])
        if not perm:
            perm = tuple(reversed(range(self.ndim)))
        if len(perm) != self.ndim:
            raise TypeError(f"transpose of {self.type} needs {self.ndim} axes, got {list(perm)}")
        perm = tuple(_normalize_axis(self, p, "transpose") for p in perm)
        if perm == tuple(range(self.ndim)):
            return self
        return emit("transpose", self, perm=perm)

    @property
    def T(self) -> "Tensor":
        """Swap the last two axes (rank < 2: unchanged)."""
        if self.ndim < 2:
            return self
        perm = list(range(self.ndim))
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return emit("transpose", self, perm=tuple(perm))

    def astype(self, dtype: Any) -> "Tensor":
        """Convert the element type (no instruction when it is already ``dtype``)."""
        dt = as_dtype(dtype)
        return self if dt == self.dtype else emit("cast", self, dtype=dt)

    def exp(self) -> "Tensor": return emit("exp", self)
    def log(self) -> "Tensor": return emit("log", self)
    def sqrt(self) -> "Tensor": return emit("sqrt", self)
    def rsqrt(self) -> "Tensor": return emit("rsqrt", self)
    def tanh(self) -> "Tensor": return emit("tanh", self)
    def relu(self) -> "Tensor": return emit("relu", self)
    def sigmoid(self) -> "Tensor": return emit("sigmoid", self)
    def abs(self) -> "Tensor": return emit("abs", self)
    def sin(self) -> "Tensor": return emit("sin", self)
    def cos(self) -> "Tensor": return emit("cos", self)

    def softmax(self, axis: int = -1) -> "Tensor":
        return emit("softmax", self, axis=_normalize_axis(self, axis, "softmax"))

    def log_softmax(self, axis: int = -1) -> "Tensor":
        return emit("log_softmax", self, axis=_normalize_axis(self, axis, "log_softmax"))


def _check_true_div(a: Any, b: Any) -> None:
    for t in (a, b):
        if isinstance(t, Tensor) and not t.dtype.is_float and t.dtype != DType.bool:
            raise TypeError(f"'/' is true division, but {t.type} is an integer tensor; cast it first with "
                            f".astype(remat.f32)")


def _logic(op: str, a: Any, b: Any, sym: str) -> Tensor:
    for t in (a, b):
        if isinstance(t, Tensor) and t.dtype != DType.bool:
            raise TypeError(f"'{sym}' takes bool tensors, got {t.type}; bitwise ops on integers are not in the IR")
    return binary(op, a, b, sym)
