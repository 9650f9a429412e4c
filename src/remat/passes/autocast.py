"""``autocast``: mixed precision as a pass over the IR, following ``torch.autocast``'s CPU op lists.

The forward computes in float32; the pass rewrites it so that (RAF §3.1.2)

* ops tagged ``autocast_low`` (matrix products, convolutions, attention: ``torch.autocast``'s
  ``lower_precision_fp`` list) read their floating-point operands cast to the low dtype (bf16 or
  f16) and compute in it;
* ops tagged ``autocast_f32`` (the losses ``cross_entropy`` and ``nll_loss``: its ``fp32`` list)
  read their low-precision operands cast to float32;
* ops tagged ``promote`` (``concat``: its ``promote`` list) and element-wise ops read mixed
  floating-point operands cast to the widest of them, as PyTorch's type promotion does: the
  widest of the operands with dimensions, else of the 0-d values, else of the 0-d constants (a
  Python number); a 0-d ``constant`` is made again in the chosen dtype rather than cast;
* the bias of a convolution, which the importer adds after it (``add(conv2d(x, w), reshape(b))``),
  is cast with the convolution's operands, as ``torch.autocast`` casts it;
* a ``log_softmax`` read only by ``nll_loss`` (a cross-entropy as torch.export decomposes it) is
  float32 with its loss; a ``cross_entropy`` reads low-precision logits itself, in float32 a chunk
  at a time (``upcast``, as the import pipeline folds a capture's cast: ``fold_upcast``);
* every other op computes in the dtype its operands now have (a norm, a softmax, a pool or an
  activation of a bf16 value is bf16, as under ``torch.autocast``), its result types given again by
  its type rule. An op whose type rule refuses its operands' new dtypes reads them in their float32
  dtypes (an in-place scatter of float32 values into a bf16 buffer is refused eagerly too).

A value is cast at most once per dtype (a weight read by several products is cast once; its cast
is an instruction the planner sees, made where first needed), a value already in the op's dtype is
not cast again (a forward that casts itself, as one captured under ``torch.autocast``, is left as it
is), and each function keeps its signature: parameters, branch arguments, call arguments and
results are cast back to their declared types where they differ.

On the forward of a model captured in float32 this gives the program ``torch.export`` captures
under ``torch.autocast``, bit for bit (``tests/passes/test_autocast.py``, the zoo's models, and
``tests/models/test_autocast_pass.py``, six ``transformers`` models), but for what a float32 capture
no longer shows: the dtypes a model's code sets itself (a cast to float32 is no cast in float32:
Llama's RMS norm, T5's layer norm, the routers' ``softmax(..., dtype=float32)``; a region where the
model turns autocast off, as Llama's rotary embedding does), a product's bias that the importer adds
after it (GPT-2's ``addmm``), and losses that the importer decomposes (``mse_loss``,
``binary_cross_entropy_with_logits``: autocast computes them in float32 whole, the pass per
decomposed op). ``remat.compile(precision="bf16")`` therefore captures PyTorch models under
``torch.autocast``; this pass gives mixed precision to programs with no such capture (the DSL:
``remat.autocast(fn)``; IR text: ``remat opt --passes autocast``).
"""
from __future__ import annotations

from typing import Any

from ..ir import Block, Builder, Function, Instruction, Module, Value
from ..ir.core import Successor
from ..ir.types import DType, promote
from ._rewrite import use_counts
from .crossentropy import fold_upcast

LOW_DTYPES = tuple(d for d in DType if d.is_low)


def _is_constant(v: Value) -> bool:
    d = getattr(v, "instr", None)
    return d is not None and d.op.name == "constant"


def _biases(f: Function) -> set[Instruction]:
    """The reshapes that broadcast a convolution's bias (``add(conv2d(x, w), reshape(b))``, as the
    importer adds it): the bias is an operand of the convolution for ``torch.autocast``, cast with it."""
    uses = use_counts(f)
    out = set()
    for ins in f.instructions():
        if ins.op.name != "add":
            continue
        y, r = ins.operands
        d, rd = getattr(y, "instr", None), getattr(r, "instr", None)
        if (d is not None and d.op.has("autocast_low") and d.op.has("conv") and rd is not None
                and rd.op.name == "reshape" and rd.operands[0].type.rank == 1 and uses[r] == 1):
            out.add(rd)
    return out


def _losses(f: Function) -> set[Instruction]:
    """The ``log_softmax`` instructions read only by ``nll_loss``: a cross-entropy as torch.export
    decomposes it (over an image's pixels), which ``torch.autocast`` casts to float32 whole."""
    readers: dict[Value, set[str]] = {}
    for ins in f.instructions():
        for v in ins.operands:
            readers.setdefault(v, set()).add(ins.op.name)
    return {ins for ins in f.instructions()
            if ins.op.name == "log_softmax" and readers.get(ins.results[0]) == {"nll_loss"}}


class _Autocast:
    """The rewrite of one function into a new one (the input is not changed)."""

    def __init__(self, f: Function, low: DType):
        self.f, self.low = f, low
        self.new = Function(f.name, (), f.result_types, f.gradient)
        self.new.blocks = []
        self.vmap: dict[Value, Value] = {}
        self.bmap: dict[Block, Block] = {}
        self.casts: dict[tuple[Value, DType], Value] = {}
        self.spare: set[Instruction] = set()  # dropped if unread at the end: the casts and constants the
        # pass made (a cast an op refused), the constants it made again in another dtype
        self.biases = _biases(f)
        self.losses = _losses(f)
        self.b: Builder | None = None

    def cast(self, v: Value, dtype: DType) -> Value:
        """``v`` (a rewritten value) in ``dtype``: itself, a 0-d constant made again, or one cast."""
        if v.type.dtype == dtype:
            return v
        key = (v, dtype)
        if key not in self.casts:
            if _is_constant(v) and v.type.rank == 0:
                self.casts[key] = self.b.op("constant", value=v.instr.attrs["value"], shape=(), dtype=dtype)
                self.spare.add(v.instr)
            else:
                self.casts[key] = self.b.op("cast", v, dtype=dtype)
            self.spare.add(self.casts[key].instr)
        return self.casts[key]

    def operands(self, ins: Instruction) -> list[Value]:
        ops = [self.vmap[v] for v in ins.operands]
        floats = [i for i, v in enumerate(ops) if v.type.dtype.is_float]
        if not floats:
            return ops
        op = ins.op
        if op.has("autocast_low") or ins in self.biases:
            target = self.low
        elif op.has("autocast_f32") or ins in self.losses:
            if ins.attrs.get("upcast"):  # computes its low-precision operands in f32 itself
                return ops
            target = DType.f32
        elif op.has("elementwise") or op.has("promote"):
            dims = ([i for i in floats if ops[i].type.rank > 0]
                    or [i for i in floats if not _is_constant(ops[i])] or floats)
            target = ops[dims[0]].type.dtype
            for i in dims[1:]:
                target = promote(target, ops[i].type.dtype)
        else:
            return ops
        return [self.cast(v, target) if i in floats else v for i, v in enumerate(ops)]

    def instruction(self, ins: Instruction) -> None:
        name = ins.op.name
        if name == "return":
            self.b.create("return", [self.cast(self.vmap[v], t.dtype) for v, t in zip(ins.operands, self.f.result_types)])
            return
        if ins.successors:
            succ = [Successor(self.bmap[s.block], [self.cast(self.vmap[v], a.type.dtype)
                                                   for v, a in zip(s.args, s.block.args)]) for s in ins.successors]
            self.b.create(name, [self.vmap[v] for v in ins.operands], ins.attrs, successors=succ)
            return
        if name == "call":
            callee = self.f.module[ins.attrs["callee"]] if self.f.module is not None else None
            ptypes = callee.param_types if callee is not None else [v.type for v in ins.operands]
            args = [self.cast(self.vmap[v], t.dtype) for v, t in zip(ins.operands, ptypes)]
            new = self.b.create(name, args, ins.attrs, result_types=[r.type for r in ins.results])
        elif name == "cast":
            x = self.vmap[ins.operands[0]]
            if x.type.dtype == ins.attrs["dtype"]:  # a cast the rewrite made unneeded
                self.vmap[ins.results[0]] = x
                return
            new = self.b.create(name, [x], ins.attrs)
        else:
            ops = self.operands(ins)
            try:
                new = self.b.create(name, ops, ins.attrs)
            except (TypeError, ValueError):  # the op refuses these dtypes: it reads the float32 program's
                new = self.b.create(name, [self.cast(v, o.type.dtype) for v, o in zip(ops, ins.operands)], ins.attrs)
        for r, nr in zip(ins.results, new.results):
            self.vmap[r] = nr

    def run(self) -> Function:
        for blk in self.f.blocks:
            nb = self.new.add_block(Block())
            self.bmap[blk] = nb
            for a in blk.args:
                self.vmap[a] = nb.add_arg(a.type)
        for blk in self.f.blocks:
            self.casts = {}  # a cast made in one block is not visible in its siblings
            for ins in blk.instrs:
                self.b = Builder(self.bmap[blk], loc=ins.loc)
                self.instruction(ins)
        read = {v for ins in self.new.instructions() for v in ins.operands}
        read.update(v for ins in self.new.instructions() for s in ins.successors for v in s.args)
        for blk in self.new.blocks:
            blk.instrs = [i for i in blk.instrs if i not in self.spare or i.results[0] in read]
        return self.new


def _low(dtype: Any) -> DType:
    """The low dtype asked for: a DType, its name ("bf16"), or ``remat.bf16``."""
    d = getattr(dtype, "dtype", dtype)
    d = DType(d) if isinstance(d, str) and d in {t.value for t in DType} else d
    if d not in LOW_DTYPES:
        raise ValueError(f"autocast computes in bf16 or f16, got {getattr(dtype, 'value', dtype)!r}")
    return d


def autocast(f: Any, dtype: DType | str = DType.bf16) -> Any:
    """``f`` in mixed precision (see the module's docstring), ``f`` unchanged. ``f``: a
    :class:`~remat.ir.Function` (gives a new one) or a staged function (``@remat.function``: gives a
    staged function whose every specialization goes through the pass, to differentiate with
    ``remat.grad`` or run). ``dtype``: the low precision, ``"bf16"`` (or ``remat.bf16``) or ``"f16"``."""
    low = _low(dtype)
    if not isinstance(f, Function):
        if not hasattr(f, "derive"):
            raise TypeError(f"autocast takes a remat Function or a staged function, got {type(f).__name__}")
        return f.derive(lambda m, entry: (Module([autocast(g, low) for g in m]), entry))
    if f.is_declaration:
        return f.clone()
    return fold_upcast(_Autocast(f, low).run())[0]


def _pass(dtype: DType):
    def autocast_pass(module: Module) -> Module:
        return Module([autocast(f, dtype) for f in module])
    autocast_pass.__name__ = f"autocast_{dtype.value}_pass"
    autocast_pass.__doc__ = f"Every function of a module in mixed precision with {dtype.value} (:func:`autocast`)."
    return autocast_pass


autocast_pass = _pass(DType.bf16)
autocast_f16_pass = _pass(DType.f16)

__all__ = ["LOW_DTYPES", "autocast", "autocast_f16_pass", "autocast_pass"]
