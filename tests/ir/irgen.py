"""Random *valid* IR programs for property tests of the text format and the verifier.

``generate_module(rng)`` builds a module that uses every sample of every op in ``OPS``
(operand dtypes varied where the type rule allows, attributes perturbed with special values),
chained so that results feed later instructions, spread over several functions with
multi-block control flow (block arguments, ``br``, ``cond_br``, loops), ``call`` between
functions, ``free``, dialect prefixes and gradient declarations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from remat.ir import OPS, Block, Builder, DType, Function, GradientSpec, Module, OpResult, Sample, TensorType, Value
from remat.ir.opdef import REQUIRED

# Ops whose structure (successors, callee, effects) the generator builds directly; they have no samples.
STRUCTURAL = frozenset({"return", "br", "cond_br", "call", "free"})
FLOATS = (DType.f16, DType.bf16, DType.f32, DType.f64)
INTS = (DType.i32, DType.i64)
SPECIAL_FLOATS = (1e-05, -0.0, math.inf, -math.inf, math.nan, -2.5, 1e300, 3.0)
SPECIAL_SCALARS = SPECIAL_FLOATS + (-7, 0, 2**40, True, False)
DIALECTS = ("torch", "numpy", "my_backend")
BOOL_SCALAR = TensorType(DType.bool, ())


def sampled_ops() -> list[str]:
    """Every op the generator instantiates from its samples (all but the structural ones)."""
    return [name for name in OPS if name not in STRUCTURAL]


def _array_type(a: np.ndarray) -> TensorType:
    return TensorType(DType.from_numpy(np.asarray(a).dtype), np.shape(a))


@dataclass
class Typed:
    """One instantiation of a sample: operand types and attributes accepted by the type rule."""

    op: str
    operand_types: list[TensorType]
    attrs: dict


def instantiate(rng: np.random.Generator, op: str, sample: Sample) -> Typed:
    """Cast the sample's arrays to random dtypes and perturb its attributes, keeping whatever the
    type rule accepts (falling back to the sample as given, which must be valid)."""
    opdef = OPS[op]
    base = [_array_type(a) for a in sample.args]
    attrs = dict(sample.attrs)

    def ok(types: list[TensorType], at: dict) -> bool:
        try:
            opdef.result_types(types, opdef.check_attrs(types, at))
            return True
        except (TypeError, ValueError, IndexError):
            return False

    if not ok(base, attrs):
        raise AssertionError(f"sample of '{op}' is rejected by its own type rule: {base} {attrs}")
    # Operand dtypes: all float operands share one float dtype, all int operands one int dtype.
    fdt, idt = FLOATS[rng.integers(len(FLOATS))], INTS[rng.integers(len(INTS))]
    cast = [t.with_dtype(fdt if t.dtype.is_float else idt if t.dtype.is_int else t.dtype) for t in base]
    types = cast if ok(cast, attrs) else base
    # Attributes: optional ones dropped or given explicitly, special values where accepted.
    for a in opdef.attrs:
        trial = dict(attrs)
        choice = rng.random()
        if a.kind in ("float", "scalar") and choice < 0.5:
            pool = SPECIAL_FLOATS if a.kind == "float" else SPECIAL_SCALARS
            trial[a.name] = pool[rng.integers(len(pool))]
        elif a.kind == "dtype" and choice < 0.5:
            trial[a.name] = list(DType)[rng.integers(len(DType))]
        elif a.default is not REQUIRED and choice < 0.2:
            trial[a.name] = a.default  # explicitly given default: must print as omitted
        elif a.kind == "ints" and choice < 0.4 and a.name in ("axes", "perm"):
            rank = types[0].rank if types else 0
            trial[a.name] = tuple(v - rank if rng.random() < 0.5 else v for v in attrs.get(a.name, ()))
        elif a.name == "axis" and a.name in attrs and types and choice < 0.4:
            trial[a.name] = attrs[a.name] - types[0].rank  # negative axis: normalised by the op
        if ok(types, trial):
            attrs = trial
    return Typed(op, types, attrs)


@dataclass
class _FnState:
    f: Function
    doms: dict[int, set[int]]               # block index -> indices of its dominators (itself included)
    defs: dict[int, list[Value]] = field(default_factory=dict)  # block index -> values defined there
    typed: dict[tuple, list[Value]] = field(default_factory=dict)  # (block index, type) -> values defined there
    freed: set[Value] = field(default_factory=set)
    no_free: set[Value] = field(default_factory=set)  # operands of views: their storage is shared


class Generator:
    """Stateful builder of one random module; see :func:`generate_module`."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.module = Module()
        self.types_seen: list[TensorType] = [TensorType(DType.f32, (3, 4)), TensorType(DType.f64, ()), BOOL_SCALAR]
        self._seen = set(self.types_seen)  # (membership; the list keeps the order picks draw from)

    # -- helpers
    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def pick(self, seq):
        return seq[self.rng.integers(len(seq))]

    def available(self, st: _FnState, bi: int, t: TensorType | None = None) -> list[Value]:
        """Values usable in block ``bi`` (of type ``t``): by dominating block, in definition order."""
        defs = st.defs if t is None else st.typed
        return [v for d in sorted(st.doms[bi]) for v in defs.get(d if t is None else (d, t), []) if v not in st.freed]

    def define(self, st: _FnState, bi: int, vals) -> None:
        st.defs.setdefault(bi, []).extend(vals)
        for v in vals:
            st.typed.setdefault((bi, v.type), []).append(v)
            if v.type not in self._seen:
                self._seen.add(v.type)
                self.types_seen.append(v.type)

    def create(self, st: _FnState, bi: int, b: Builder, name: str, operands, attrs=None, **kw):
        dialect = self.pick(DIALECTS) if self.chance(0.15) else None
        ins = b.create(name, operands, attrs or {}, dialect=dialect, **kw)
        self.define(st, bi, ins.results)
        if OPS[name].aliases:
            st.no_free.update(ins.operands)
            st.no_free.update(ins.results)
        if OPS[name].has("inplace"):  # overwritten operands may not be read again: they leave the pool
            st.freed.update(ins.operands[src] for src in OPS[name].aliases.values())
        return ins

    def value_of(self, st: _FnState, bi: int, b: Builder, t: TensorType) -> Value:
        """A value of type ``t`` usable at the end of block ``bi``: an existing one (chaining), a new
        parameter (entry block only), a cast of an existing value of the same shape, or a constant."""
        have = self.available(st, bi, t)
        if have and self.chance(0.7):
            return self.pick(have)
        r = self.rng.random()
        if bi == 0 and r < 0.4 and not st.f.module:
            v = st.f.entry.add_arg(t)
            self.define(st, 0, [v])
            return v
        same_shape = [v for v in self.available(st, bi) if v.type.shape == t.shape and v.type != t]
        if same_shape and r < 0.7:
            return self.create(st, bi, b, "cast", [self.pick(same_shape)], {"dtype": t.dtype}).results[0]
        value = True if t.dtype == DType.bool else self.pick((0, 1, -3)) if t.dtype.is_int else self.pick((0.5, -1.0, 2.0))
        return self.create(st, bi, b, "constant", [], {"value": value, "shape": t.shape, "dtype": t.dtype}).results[0]

    def emit(self, st: _FnState, bi: int, b: Builder, typed: Typed) -> None:
        operands = [self.value_of(st, bi, b, t) for t in typed.operand_types]
        self.create(st, bi, b, typed.op, operands, typed.attrs)
        if self.chance(0.15):
            # Free a value defined in this block that nothing later will use (it leaves the pool).
            mine = [v for v in st.defs.get(bi, []) if isinstance(v, OpResult) and v not in st.freed
                    and v not in st.no_free]
            if mine:
                v = self.pick(mine)
                b.free(v)
                st.freed.add(v)

    # -- functions
    def function(self, name: str, work: list[Typed]) -> Function:
        rng = self.rng
        nblocks = int(rng.integers(1, 5))
        # Terminators: block j < n-1 always reaches j+1 (so dominators of k are < k and blocks can be
        # filled in order); cond_br adds a second target anywhere but the entry (loops included).
        succs: dict[int, list[int]] = {}
        for j in range(nblocks - 1):
            succs[j] = [j + 1] + ([int(rng.integers(1, nblocks))] if self.chance(0.6) else [])
        succs[nblocks - 1] = []
        doms = _dominators(nblocks, succs)
        result_types = [self.pick(self.types_seen) for _ in range(int(rng.integers(0, 3)))]
        f = Function(name, [], result_types)
        for _ in range(1, nblocks):
            f.add_block(arg_types=[self.pick(self.types_seen) for _ in range(int(rng.integers(0, 3)))])
        st = _FnState(f, doms)
        self.define(st, 0, f.entry.args)
        for bi in range(1, nblocks):
            self.define(st, bi, f.blocks[bi].args)
        # Spread the work over the blocks, then fill them in order.
        per_block: dict[int, list[Typed]] = {i: [] for i in range(nblocks)}
        for w in work:
            per_block[int(rng.integers(nblocks))].append(w)
        for bi, blk in enumerate(f.blocks):
            b = Builder(blk)
            for w in per_block[bi]:
                self.emit(st, bi, b, w)
                if self.chance(0.1):
                    self.maybe_call(st, bi, b)
            if self.chance(0.3):
                self.maybe_call(st, bi, b)
            targets = succs[bi]
            if not targets:
                b.ret(*[self.value_of(st, bi, b, t) for t in result_types])
                continue
            args = [[self.value_of(st, bi, b, a.type) for a in f.blocks[t].args] for t in targets]
            if len(targets) == 1:
                b.br(f.blocks[targets[0]], *args[0])
            else:
                cond = self.value_of(st, bi, b, BOOL_SCALAR)
                b.cond_br(cond, f.blocks[targets[0]], args[0], f.blocks[targets[1]], args[1])
        if self.chance(0.5):
            # Blocks may appear in any order after the entry: uses can then precede their definition
            # in the text, and a bare `return` can be followed by the next block's label.
            rest = f.blocks[1:]
            f.blocks[1:] = [rest[k] for k in self.rng.permutation(len(rest))]
        return f

    def maybe_call(self, st: _FnState, bi: int, b: Builder) -> None:
        callees = [g for g in self.module if not g.is_declaration]
        if not callees:
            return
        g = self.pick(callees)
        args = [self.value_of(st, bi, b, t) for t in g.param_types]
        self.create(st, bi, b, "call", args, {"callee": g.name}, result_types=g.result_types)


def _dominators(n: int, succs: dict[int, list[int]]) -> dict[int, set[int]]:
    preds = {k: [j for j in range(n) if k in succs[j]] for k in range(n)}
    dom = {k: set(range(n)) for k in range(n)}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for k in range(1, n):
            new = set.intersection(*(dom[p] for p in preds[k])) | {k}
            if new != dom[k]:
                dom[k], changed = new, True
    return dom


def generate_module(rng: np.random.Generator, ops: list[str] | None = None, functions: int = 4) -> Module:
    """A random valid module using every sample of each op in ``ops`` (default: all sampled ops)."""
    gen = Generator(rng)
    work: list[Typed] = []
    for name in ops if ops is not None else sampled_ops():
        op = OPS[name]
        if op.sample is None:
            raise AssertionError(f"op '{name}' has no sample generator; add `sample=` to its declaration")
        for s in op.sample(rng):
            work.append(instantiate(rng, name, s))
    order = rng.permutation(len(work))
    chunks = np.array_split(order, functions)
    for i, chunk in enumerate(chunks):
        f = gen.function(f"f{i}", [work[k] for k in chunk])
        gen.module.add(f)
        # Gradient declarations of functions with parameters.
        if f.params and gen.chance(0.7):
            k = len(f.params)
            wrt = tuple(sorted(rng.choice(k, size=int(rng.integers(1, k + 1)), replace=False).tolist()))
            gen.module.add(Function(f"grad_f{i}", gradient=GradientSpec(f.name, wrt, gen.chance(0.5))))
    return gen.module
