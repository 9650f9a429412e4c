"""Op declarations: one place per op (attributes, type rule, tags, cost, VJP, decomposition, test samples).

Every op of the IR is an :class:`OpDef` in :data:`OPS`. Backends key their kernels by the op
name, autodiff reads ``vjp``/``vjp_saves``, passes read ``tags``, the ``decompose`` pass reads
``decompose``, and the generated per-op tests read ``sample``. Declarations live in ``remat.ir.ops.*``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from .types import DType, TensorType

if TYPE_CHECKING:  # core imports this module
    from .core import Builder, Value

# Attribute kinds and the Python values they hold.
#   int: int        float: float        bool: bool        str: str
#   ints: tuple[int, ...]               dtype: DType       scalar: int | float | bool
ATTR_KINDS = ("int", "float", "bool", "str", "ints", "dtype", "scalar")

REQUIRED = object()  # marker: attribute has no default

# Tags an op may carry.
TAGS = frozenset({
    "elementwise",  # per-element, shapes broadcast
    "unary", "binary",
    "comparison",   # result is bool
    "reduction",
    "matmul",
    "conv",
    "dense",        # its arithmetic is matrix products (fused attention, a chunked head): priced at a device's matmul rate
    "random",       # a deterministic function of its explicit seed operand; replays on recompute
    "view",         # result shares the operand's storage (reshape)
    "effect",       # has effects beyond its results (free, return, branches): never CSE'd or DCE'd
    "terminator",   # ends a block
    "inplace",      # result reuses an operand's buffer (declared in ``aliases``)
    "overwrite",    # result 0 may be written over a dying operand of its type (each element read only to write it)
    "shape",        # moves data without arithmetic
    "constant",     # no operands; value given by attributes
    "control",      # run by the VM and the passes themselves (call, branches, return, free): no kernel, no VJP
    "autocast_low",  # computes in the low precision under autocast (torch.autocast's lower_precision_fp list)
    "autocast_f32",  # computes in float32 under autocast (torch.autocast's fp32 list)
    "promote",       # mixed floating-point operands are cast to the widest (torch.autocast's promote list)
})


_INT64 = (-(2**63), 2**63 - 1)


def _int64(where: str, value: Any) -> int:
    """``value`` as an int, refused (TypeError) outside the signed 64-bit range every dialect stores."""
    v = int(value)
    if not _INT64[0] <= v <= _INT64[1]:
        shown = str(v) if v.bit_length() < 200 else f"an integer of {v.bit_length()} bits"
        raise TypeError(f"{where} must fit in 64 bits ({_INT64[0]}..{_INT64[1]}), got {shown}")
    return v


def _float(where: str, value: Any) -> float:
    """``value`` as a float, refused (TypeError) when an integer is too large for one (|x| > 1.8e308)."""
    try:
        return float(value)
    except OverflowError:
        raise TypeError(f"{where} must be a number within the float range (|x| <= 1.8e308), "
                        f"got an integer of {int(value).bit_length()} bits") from None


@dataclass(frozen=True)
class Attr:
    """One attribute of an op: name, kind and default (``REQUIRED`` if none)."""

    name: str
    kind: str
    default: Any = REQUIRED

    def coerce(self, op: str, value: Any) -> Any:
        """Check and normalise a Python value for this attribute; raise TypeError naming it."""
        where = f"attribute '{self.name}' of '{op}'"
        k = self.kind
        if k == "int":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{where} must be an integer, got {value!r}")
            return _int64(where, value)
        if k == "float":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(f"{where} must be a number, got {value!r}")
            return _float(where, value)
        if k == "bool":
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"{where} must be true or false, got {value!r}")
            return bool(value)
        if k == "str":
            if not isinstance(value, str):
                raise TypeError(f"{where} must be a string, got {value!r}")
            return value
        if k == "ints":
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                value = (value,)
            try:
                items = tuple(value)
            except TypeError:
                raise TypeError(f"{where} must be a list of integers, got {value!r}") from None
            for v in items:
                if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                    raise TypeError(f"{where} must be a list of integers, got {value!r}")
            return tuple(_int64(where, v) for v in items)
        if k == "dtype":
            if isinstance(value, str):
                try:
                    return DType(value)
                except ValueError:
                    raise TypeError(f"{where} must be one of {', '.join(d.value for d in DType)}, got {value!r}") from None
            if not isinstance(value, DType):
                raise TypeError(f"{where} must be a dtype, got {value!r}")
            return value
        if k == "scalar":
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            if isinstance(value, (int, np.integer)):
                return _int64(where, value)
            if isinstance(value, (float, np.floating)):
                return float(value)
            raise TypeError(f"{where} must be a number or boolean, got {value!r}")
        raise AssertionError(k)


@dataclass(frozen=True)
class IndexBounds:
    """The valid values of an op's index operand: ``[0, size)``, plus ``ignore`` when not None."""

    operand: int
    size: int
    ignore: int | None = None


# A sample for generated per-op tests: operand arrays and attributes.
@dataclass
class Sample:
    args: list[np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)


DecomposeFn = Callable[["Builder", Sequence["Value"], Mapping[str, Any]], Sequence["Value"]]
InferFn = Callable[[Sequence[TensorType], Mapping[str, Any]], "TensorType | tuple[TensorType, ...]"]


@dataclass
class OpDef:
    """The single declaration of an op.

    ``infer`` is the type rule: operand types and attributes to result type(s), raising
    ``TypeError`` with a message saying what is wrong and what would be valid.
    ``num_operands`` is None for variadic ops. ``aliases`` maps a result index to the operand
    whose storage it shares (views and in-place updates), which memory accounting counts once.
    ``vjp`` is filled by the autodiff rules declared beside the op (see ``remat.autodiff``);
    ``vjp_saves`` says what the backward keeps from the forward: "inputs", "outputs", "none",
    a tuple of operand indices, or a ``Saves(operands, results)`` record (or a function of the
    attributes returning one); see ``remat.ir.ops._vjp.saved_indices``.
    ``nondiff`` marks ops without a derivative (comparisons, …).
    ``flops`` is the op's cost rule for the static cost model: (operand types, result types,
    attributes) to estimated floating-point operations (``remat.plan.costmodel``).
    ``index_bounds``: for ops with an integer index operand that every dialect's kernel checks
    (raising IndexError when out of range), (operand types, attributes) to :class:`IndexBounds`.
    The training step places no in-place update before the first check of each index value.
    ``decompose``: for a composite op (one with a native kernel that other ops can express), the
    same computation in other ops of the registry: ``(builder, operands, attributes)`` to one value
    per result, emitted through the builder. A dialect without a kernel for the op runs it through
    this (``remat.passes.decompose``); the generated tests check it against the op's kernel.
    Attached beside the declaration with :func:`def_decomposition`.
    """

    name: str
    num_operands: int | None
    attrs: tuple[Attr, ...]
    infer: InferFn
    tags: frozenset[str] = frozenset()
    doc: str = ""
    num_results: int = 1
    min_operands: int = 1  # for variadic ops
    aliases: Mapping[int, int] = field(default_factory=dict)
    nondiff: bool = False
    normalize: Callable[[Sequence[TensorType], dict], dict] | None = None
    sample: Callable[[np.random.Generator], list[Sample]] | None = None
    vjp: Callable | None = None
    vjp_saves: Any = None
    flops: Callable[[Sequence[TensorType], Sequence[TensorType], Mapping[str, Any]], float] | None = None
    index_bounds: Callable[[Sequence[TensorType], Mapping[str, Any]], "IndexBounds"] | None = None
    decompose: "DecomposeFn | None" = None
    attr_names: frozenset[str] = field(init=False, repr=False, compare=False)  # of ``attrs``

    def __post_init__(self) -> None:
        unknown = set(self.tags) - TAGS
        if unknown:
            raise ValueError(f"op '{self.name}' has unknown tags {sorted(unknown)}")
        for a in self.attrs:
            if a.kind not in ATTR_KINDS:
                raise ValueError(f"op '{self.name}' attribute '{a.name}' has unknown kind {a.kind!r}")
        self.tags = frozenset(self.tags)
        self.attr_names = frozenset(a.name for a in self.attrs)

    def attr(self, name: str) -> Attr | None:
        for a in self.attrs:
            if a.name == name:
                return a
        return None

    def check_attrs(self, types: Sequence[TensorType], attrs: Mapping[str, Any]) -> dict[str, Any]:
        """Coerce attributes, fill defaults, reject unknown or missing ones, normalise."""
        self.check_arity(len(types))
        known = self.attr_names
        if not known.issuperset(attrs):
            extra = set(attrs) - known
            valid = ", ".join(sorted(known)) or "none"
            raise TypeError(f"'{self.name}' has no attribute {', '.join(sorted(map(repr, extra)))}; valid attributes: {valid}")
        out: dict[str, Any] = {}
        for a in self.attrs:
            if a.name in attrs:
                out[a.name] = a.coerce(self.name, attrs[a.name])
            elif a.default is REQUIRED:
                raise TypeError(f"'{self.name}' requires attribute '{a.name}' ({a.kind})")
            else:
                out[a.name] = a.default
        if self.normalize is not None:
            out = self.normalize(types, out)
        return out

    def check_arity(self, n: int) -> None:
        if self.num_operands is not None and n != self.num_operands:
            raise TypeError(f"'{self.name}' takes {self.num_operands} operand(s), got {n}")
        if self.num_operands is None and n < self.min_operands:
            raise TypeError(f"'{self.name}' takes at least {self.min_operands} operand(s), got {n}")

    def result_types(self, types: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
        """Apply the type rule (after an arity check)."""
        self.check_arity(len(types))
        r = self.infer(types, attrs)
        return r if isinstance(r, tuple) else (r,)

    def has(self, tag: str) -> bool:
        return tag in self.tags

    def __repr__(self) -> str:
        return f"<op {self.name}>"


OPS: dict[str, OpDef] = {}


def declare(op: OpDef) -> OpDef:
    """Register an op declaration (once)."""
    if op.name in OPS:
        raise ValueError(f"op '{op.name}' is declared twice")
    OPS[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, OPS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"unknown op '{name}'{hint}") from None


def def_vjp(name: str, saves: Any):
    """Attach a VJP rule to an op declaration (used beside the declaration).

    ``saves``: "inputs", "outputs", "none", a tuple of operand indices, or a ``Saves`` record
    (``remat.ir.ops._vjp``) — what the backward keeps alive from the forward (RAF's flexible adjoints).
    """

    def deco(fn):
        op = OPS[name]
        if op.vjp is not None:
            raise ValueError(f"op '{name}' has two VJP rules")
        op.vjp = fn
        op.vjp_saves = saves
        return fn

    return deco


def def_decomposition(name: str):
    """Attach a decomposition to an op declaration (used beside the declaration, as ``def_vjp``).

    The rule is ``rule(b: Builder, xs: list[Value], attrs: dict) -> list[Value]``: it emits through
    ``b`` the op's computation on the operands ``xs`` in other ops of the registry and returns one
    value per result, of exactly the result types the op's type rule gives.
    """

    def deco(fn):
        op = OPS[name]
        if op.decompose is not None:
            raise ValueError(f"op '{name}' has two decompositions")
        op.decompose = fn
        return fn

    return deco
