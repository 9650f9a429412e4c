"""``remat.ops``: functions that stage IR ops inside a ``@remat.function``.

One function per IR op where users need it, named after the op (``relu``, ``conv2d``, …) with
NumPy-style aliases (``where`` for ``select``, ``sum`` for ``reduce_sum``). Python scalars are
accepted where a tensor operand is expected and become constants of the other operand's dtype.
``cond`` stages a data-dependent branch. ``emit`` stages any IR op by name.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..ir import Block, Builder, DType, TensorType
from ._dsl_trace import (Tensor, _check_true_div, _logic, _normalize_axis, _Scope, as_dtype, as_tensor, binary,
                         check_live, constant as _constant, current_trace, emit as _emit, is_scalar, matmul as _matmul,
                         reduce as _reduce, reshape as _reshape, scalar_default_dtype, scalar_value, wrap)

__all__ = [
    "abs", "add", "avg_pool2d", "bernoulli", "broadcast_to", "cast", "concat", "cond", "constant", "conv2d", "copy",
    "cos", "div", "dropout", "emit", "eq", "erf", "exp", "fold_seed", "full", "gather", "ge", "gelu", "gt", "iota",
    "le", "log", "log_softmax", "logical_and", "logical_not", "logical_or", "lt", "matmul", "max", "max_pool2d",
    "maximum", "mean", "min", "minimum", "mul", "ne", "neg", "normal", "one_hot", "ones", "pad", "pow", "reduce_max",
    "reduce_mean", "reduce_sum", "relu", "reshape", "rsqrt", "scatter_add", "select", "sigmoid", "sign", "sin",
    "slice", "softmax", "sqrt", "sub", "sum", "tanh", "transpose", "uniform", "where", "zeros",
]


def emit(op: str, *operands: Tensor, **attrs: Any):
    """Stage any IR op by name with its attributes: ``emit("reduce_sum", x, axes=[1])``."""
    return _emit(op, *operands, **attrs)


# ---------------------------------------------------------------- element-wise
def _unary(name: str, doc: str) -> Callable[[Tensor], Tensor]:
    def f(x: Tensor) -> Tensor:
        return _emit(name, as_tensor(x, None, f"'{name}'"))

    f.__name__ = f.__qualname__ = name
    f.__doc__ = doc
    return f


neg = _unary("neg", "-x")
abs = _unary("abs", "|x|")  # noqa: A001
sign = _unary("sign", "sign of x (-1, 0 or 1)")
relu = _unary("relu", "max(x, 0)")
exp = _unary("exp", "e^x")
log = _unary("log", "natural logarithm")
sqrt = _unary("sqrt", "square root")
rsqrt = _unary("rsqrt", "1/sqrt(x)")
tanh = _unary("tanh", "hyperbolic tangent")
sigmoid = _unary("sigmoid", "1/(1+e^-x)")
sin = _unary("sin", "sine")
cos = _unary("cos", "cosine")
erf = _unary("erf", "error function")
copy = _unary("copy", "a fresh copy of x (a new buffer)")


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit, exact (``"none"``) or with the ``"tanh"`` approximation."""
    return _emit("gelu", x, approximate=approximate)


def logical_not(x: Tensor) -> Tensor:
    """Element-wise not of a bool tensor (also ``~x``)."""
    return ~x


def _binary_fn(name: str, sym: str, doc: str) -> Callable[[Any, Any], Tensor]:
    def f(a: Any, b: Any) -> Tensor:
        return binary(name, a, b, sym)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = doc + " (NumPy broadcasting; a Python scalar takes the other operand's dtype)"
    return f


add = _binary_fn("add", "add", "a + b")
sub = _binary_fn("sub", "sub", "a - b")
mul = _binary_fn("mul", "mul", "a * b")
pow = _binary_fn("pow", "pow", "a ** b")  # noqa: A001
maximum = _binary_fn("maximum", "maximum", "element-wise maximum")
minimum = _binary_fn("minimum", "minimum", "element-wise minimum")
eq = _binary_fn("eq", "eq", "a == b, a bool tensor")
ne = _binary_fn("ne", "ne", "a != b, a bool tensor")
lt = _binary_fn("lt", "lt", "a < b, a bool tensor")
le = _binary_fn("le", "le", "a <= b, a bool tensor")
gt = _binary_fn("gt", "gt", "a > b, a bool tensor")
ge = _binary_fn("ge", "ge", "a >= b, a bool tensor")


def div(a: Any, b: Any) -> Tensor:
    """a / b (true division; floating-point operands)."""
    _check_true_div(a, b)
    return binary("div", a, b, "/")


def logical_and(a: Any, b: Any) -> Tensor:
    """Element-wise and of bool tensors (also ``a & b``)."""
    return _logic("and", a, b, "logical_and")


def logical_or(a: Any, b: Any) -> Tensor:
    """Element-wise or of bool tensors (also ``a | b``)."""
    return _logic("or", a, b, "logical_or")


def select(pred: Tensor, a: Any, b: Any) -> Tensor:
    """``pred ? a : b`` element-wise with broadcasting; ``a`` and ``b`` may be Python scalars."""
    if not isinstance(pred, Tensor) or pred.dtype != DType.bool:
        got = pred.type if isinstance(pred, Tensor) else repr(pred)
        raise TypeError(f"'select' needs a bool tensor condition, got {got}; build one with a comparison such as x > 0")
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.dtype != b.dtype:
            raise TypeError(f"'select' mixes {a.type} and {b.type}; cast one side, e.g. .astype(remat.{a.dtype.value})")
    elif isinstance(a, Tensor):
        b = as_tensor(b, a.dtype, "'select'")
    elif isinstance(b, Tensor):
        a = as_tensor(a, b.dtype, "'select'")
    else:
        a = as_tensor(a, None, "'select'")
        b = as_tensor(b, a.dtype, "'select'")
    return _emit("select", pred, a, b)


where = select


def cast(x: Tensor, dtype: Any) -> Tensor:
    """Convert the element type (``x.astype(dtype)``)."""
    return x.astype(dtype)


# ---------------------------------------------------------------- reductions, softmax, matmul
def reduce_sum(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Sum over ``axis`` (int, tuple, or None for all)."""
    return _reduce("reduce_sum", x, axis, keepdims)


def reduce_mean(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (int, tuple, or None for all)."""
    return _reduce("reduce_mean", x, axis, keepdims)


def reduce_max(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Maximum over ``axis`` (int, tuple, or None for all)."""
    return _reduce("reduce_max", x, axis, keepdims)


sum = reduce_sum  # noqa: A001
mean = reduce_mean
max = reduce_max  # noqa: A001


def min(x: Tensor, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Minimum over ``axis``, staged as -max(-x)."""
    return x.min(axis, keepdims)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Softmax along ``axis``."""
    return x.softmax(axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """Log-softmax along ``axis``."""
    return x.log_softmax(axis)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Batched matrix product with NumPy's rule for vectors (``a @ b``)."""
    return _matmul(a, b)


# ---------------------------------------------------------------- convolution and pooling (NCHW)
def _pair(v: Any, what: str) -> tuple[int, int]:
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return (v, v)
    t = tuple(v)
    if len(t) != 2:
        raise TypeError(f"{what} needs an int or a pair (height, width), got {v!r}")
    return t  # type: ignore[return-value]


def conv2d(x: Tensor, w: Tensor, bias: Tensor | None = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """2-d cross-correlation of ``x[N,C,H,W]`` with ``w[O,C/groups,kH,kW]``, plus ``bias[O]`` if given."""
    y = _emit("conv2d", x, w, stride=_pair(stride, "conv2d stride"), padding=_pair(padding, "conv2d padding"),
              dilation=_pair(dilation, "conv2d dilation"), groups=groups)
    if bias is not None:
        if bias.shape != (w.shape[0],):
            raise TypeError(f"conv2d bias must be [{w.shape[0]}] for weight {w.type}, got {bias.type}")
        y = y + _reshape(bias, (1, w.shape[0], 1, 1))
    return y


def _pool(op: str, x: Tensor, kernel: Any, stride: Any, padding: Any) -> Tensor:
    k = _pair(kernel, f"{op} kernel")
    s = k if stride is None else _pair(stride, f"{op} stride")
    return _emit(op, x, kernel=k, stride=s, padding=_pair(padding, f"{op} padding"))


def max_pool2d(x: Tensor, kernel: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """Max over windows of ``x[N,C,H,W]``; ``stride`` defaults to ``kernel``."""
    return _pool("max_pool2d", x, kernel, stride, padding)


def avg_pool2d(x: Tensor, kernel: Any, stride: Any = None, padding: Any = 0) -> Tensor:
    """Mean over windows of ``x[N,C,H,W]`` (padding counts as zeros); ``stride`` defaults to ``kernel``."""
    return _pool("avg_pool2d", x, kernel, stride, padding)


# ---------------------------------------------------------------- data movement
def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Same elements, new shape (one -1 inferred); a view of ``x``'s storage."""
    return _reshape(x, shape)


def transpose(x: Tensor, perm: Sequence[int] | None = None) -> Tensor:
    """Permute axes (None reverses them)."""
    return x.transpose(*(perm or ()))


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """NumPy ``broadcast_to``, materialised."""
    shape = tuple(shape)
    return x if x.shape == shape else _emit("broadcast", x, shape=shape)


def slice(x: Tensor, start: Sequence[int], stop: Sequence[int], step: Sequence[int] | None = None) -> Tensor:  # noqa: A001
    """``x[start:stop:step]`` per axis (positive steps); ``x[...]`` indexing is usually handier."""
    return _emit("slice", x, start=tuple(start), stop=tuple(stop), step=tuple(step or ()))


def pad(x: Tensor, low: Sequence[int], high: Sequence[int], interior: Sequence[int] | None = None,
        value: float = 0.0) -> Tensor:
    """Pad with ``value``: ``low``/``high`` elements per axis, ``interior`` between elements."""
    return _emit("pad", x, low=tuple(low), high=tuple(high), interior=tuple(interior or ()), value=value)


def concat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Join tensors along ``axis``."""
    xs = list(xs)
    if not xs:
        raise TypeError("concat needs at least one tensor")
    if len(xs) == 1:
        return xs[0]
    return _emit("concat", *xs, axis=_normalize_axis(xs[0], axis, "concat"))


def gather(table: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """NumPy ``take(table, indices, axis)``: an embedding lookup when ``axis`` is 0."""
    return _emit("gather", table, indices, axis=_normalize_axis(table, axis, "gather"))


def scatter_add(indices: Tensor, updates: Tensor, shape: Sequence[int], axis: int = 0) -> Tensor:
    """``zeros(shape)`` with ``updates`` added at ``indices`` along ``axis`` (the transpose of gather)."""
    axis = axis + len(shape) if axis < 0 else axis
    return _emit("scatter_add", indices, updates, shape=tuple(shape), axis=axis)


def one_hot(labels: Tensor, num_classes: int, dtype: Any = DType.f32) -> Tensor:
    """``labels[...]`` (integers) to one-hot vectors ``[..., num_classes]`` of ``dtype``."""
    if not labels.dtype.is_int:
        raise TypeError(f"one_hot needs integer labels, got {labels.type}")
    shape = labels.shape + (num_classes,)
    classes = _emit("iota", shape=shape, axis=len(shape) - 1, dtype=labels.dtype)
    return (classes == _reshape(labels, labels.shape + (1,))).astype(dtype)


# ---------------------------------------------------------------- values without operands
def constant(value: Any, shape: Sequence[int] = (), dtype: Any = None) -> Tensor:
    """A tensor filled with ``value``; dtype defaults to bool, i64 or f32 by the value's type."""
    return _constant(value, shape, dtype)


def full(shape: Sequence[int], value: Any, dtype: Any = None) -> Tensor:
    """NumPy ``full``: ``shape`` filled with ``value``."""
    return _constant(value, shape, dtype)


def zeros(shape: Sequence[int], dtype: Any = DType.f32) -> Tensor:
    dt = as_dtype(dtype)
    return _constant(False if dt == DType.bool else 0, shape, dt)


def ones(shape: Sequence[int], dtype: Any = DType.f32) -> Tensor:
    dt = as_dtype(dtype)
    return _constant(True if dt == DType.bool else 1, shape, dt)


def iota(shape: Sequence[int], axis: int = 0, dtype: Any = DType.i64) -> Tensor:
    """Indices 0, 1, 2, … along ``axis``, broadcast over the other axes."""
    shape = tuple(shape)
    axis = axis + len(shape) if axis < 0 else axis
    return _emit("iota", shape=shape, axis=axis, dtype=as_dtype(dtype))


# ---------------------------------------------------------------- randomness (explicit seeds)
def _seed(seed: Any, what: str) -> Tensor:
    if isinstance(seed, Tensor):
        return seed
    if isinstance(seed, int) and not isinstance(seed, bool):
        return _constant(seed, (), DType.i64)
    raise TypeError(f"{what} needs a seed: an i64[] tensor or a Python int, got {seed!r}")


def uniform(seed: Any, shape: Sequence[int], dtype: Any = DType.f32, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Uniform samples in [low, high), a deterministic function of ``seed`` (replayed on recompute)."""
    return _emit("uniform", _seed(seed, "uniform"), shape=tuple(shape), dtype=as_dtype(dtype), low=low, high=high)


def normal(seed: Any, shape: Sequence[int], dtype: Any = DType.f32, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Normal samples, a deterministic function of ``seed``."""
    return _emit("normal", _seed(seed, "normal"), shape=tuple(shape), dtype=as_dtype(dtype), mean=mean, std=std)


def bernoulli(seed: Any, shape: Sequence[int], p: float) -> Tensor:
    """A bool mask, true with probability ``p``, a deterministic function of ``seed``."""
    return _emit("bernoulli", _seed(seed, "bernoulli"), shape=tuple(shape), p=p)


def fold_seed(seed: Any, salt: int) -> Tensor:
    """An independent seed derived from ``seed`` and a constant ``salt`` (one per random op)."""
    return _emit("fold_seed", _seed(seed, "fold_seed"), salt=salt)


def dropout(x: Tensor, p: float, seed: Any) -> Tensor:
    """Inverted dropout: zero each element with probability ``p``, scale the rest by 1/(1-p).
    The mask comes from ``seed``, so a recomputation replays it."""
    if not 0.0 <= p < 1.0:
        raise TypeError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return x
    keep = bernoulli(seed, x.shape, 1.0 - p)
    return select(keep, x * (1.0 / (1.0 - p)), 0.0)


# ---------------------------------------------------------------- control flow
def _flatten(out: Any, what: str) -> tuple[list[Any], bool]:
    """Branch or function results: one value or a tuple/list of values; returns (items, single)."""
    if isinstance(out, (tuple, list)):
        items = list(out)
        for v in items:
            if isinstance(v, (tuple, list, dict)):
                raise TypeError(f"{what} returned a nested {type(v).__name__}; return a flat tuple of tensors")
        return items, False
    if out is None:
        raise TypeError(f"{what} returned None; it must return a tensor or a tuple of tensors")
    return [out], True


def _describe(v: Any) -> str:
    return str(v.type) if isinstance(v, Tensor) else f"{type(v).__name__} {v!r}"


def cond(pred: Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any], *operands: Any):
    """Stage ``true_fn(*operands) if pred else false_fn(*operands)`` for a bool[] ``pred``.

    Both branches are traced into their own blocks (``cond_br``), each ends with a ``br`` to a
    join block whose arguments carry the results; both must return the same types. Values the
    branches compute stay inside them; the results are what flows out.
    """
    tr = current_trace("remat.cond")
    if not isinstance(pred, Tensor) or pred.type != TensorType(DType.bool, ()):
        got = _describe(pred)
        raise TypeError(f"remat.cond needs a bool[] predicate (a rank-0 traced comparison such as x.sum() > 0), "
                        f"got {got}; for a Python bool use a Python `if`")
    pv = check_live(tr, pred, "remat.cond")
    for i, o in enumerate(operands):
        if isinstance(o, Tensor):
            check_live(tr, o, f"remat.cond operand {i}")
        elif not is_scalar(o):
            as_tensor(o, None, f"remat.cond operand {i}")  # raises a clear error
    fn = tr.function
    blocks = (Block(), Block())
    tr.builder.cond_br(pv, blocks[0], [], blocks[1], [])
    ends: list[tuple[Block, list[Any], bool]] = []
    for label, block, branch in (("true branch", blocks[0], true_fn), ("false branch", blocks[1], false_fn)):
        fn.add_block(block)
        outer = tr.scope
        tr.scope = _Scope(outer, f"the {label} of a remat.cond")
        tr.builder = Builder(block)
        try:
            items, single = _flatten(branch(*operands), f"the {label} of remat.cond")
            for k, v in enumerate(items):
                if isinstance(v, Tensor):
                    check_live(tr, v, f"result {k} of the {label} of remat.cond")
                elif not is_scalar(v):
                    as_tensor(v, None, f"result {k} of the {label} of remat.cond")
        finally:
            tr.scope.closed = True
            tr.scope = outer
        ends.append((tr.builder.block, items, single))

    (tb, t_items, t_single), (fb, f_items, f_single) = ends
    if len(t_items) != len(f_items) or t_single != f_single:
        raise TypeError(f"remat.cond branches return different structures: the true branch returns "
                        f"{len(t_items)} value(s), the false branch {len(f_items)}")
    types: list[TensorType] = []
    for k, (a, b) in enumerate(zip(t_items, f_items)):
        ta = a.type if isinstance(a, Tensor) else None
        tb_ = b.type if isinstance(b, Tensor) else None
        if ta is None and tb_ is None:
            ta = tb_ = TensorType(scalar_default_dtype(a), ())
        elif ta is None:
            ta = tb_  # a scalar result becomes a splat of the other branch's type
        elif tb_ is None:
            tb_ = ta
        if ta != tb_:
            raise TypeError(f"remat.cond branches return different types for result {k}: true branch {ta}, "
                            f"false branch {tb_}; both branches must return the same types")
        types.append(ta)

    join = Block(types)
    for block, items in ((tb, t_items), (fb, f_items)):
        b = Builder(block)
        vals = []
        for v, t in zip(items, types):
            if isinstance(v, Tensor):
                vals.append(v.value)
            else:
                vals.append(b.op("constant", value=scalar_value(v, t.dtype, "remat.cond result"), shape=t.shape,
                                 dtype=t.dtype))
        b.br(join, *vals)
    fn.add_block(join)
    tr.builder = Builder(join)
    outs = [wrap(tr, a) for a in join.args]
    return outs[0] if t_single else tuple(outs)
