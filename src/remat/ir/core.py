"""Modules, functions, basic blocks with arguments, instructions and SSA values.

Values carry a type but no name: names belong to the printer. Passes treat the IR as
immutable input and produce new modules (``Module.clone`` gives a fresh copy to rewrite).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .opdef import OpDef, get_op
from .types import TensorType


@dataclass(frozen=True)
class Loc:
    """Where an instruction comes from in the user's program: the submodule path (``""`` at the
    top level) and the source file and line (``""``/0 when unknown). Printed as a trailing
    ``loc(...)``; the importer sets it and passes carry it along."""

    path: str = ""
    file: str = ""
    line: int = 0


class Value:
    """An SSA value: a block argument or an instruction result."""

    __slots__ = ("type",)

    def __init__(self, type: TensorType):
        if not isinstance(type, TensorType):
            raise TypeError(f"value type must be a TensorType, got {type!r}")
        self.type = type

    @property
    def owner(self):  # the Instruction or Block defining this value
        raise NotImplementedError


class BlockArg(Value):
    __slots__ = ("block", "index")

    def __init__(self, type: TensorType, block: "Block", index: int):
        super().__init__(type)
        self.block = block
        self.index = index

    @property
    def owner(self) -> "Block":
        return self.block

    def __repr__(self) -> str:
        return f"<arg {self.index}: {self.type}>"


class OpResult(Value):
    __slots__ = ("instr", "index")

    def __init__(self, type: TensorType, instr: "Instruction", index: int):
        # Value.__init__ inlined: results are made by the hundred thousand while planning.
        if type.__class__ is not TensorType and not isinstance(type, TensorType):
            raise TypeError(f"value type must be a TensorType, got {type!r}")
        self.type = type
        self.instr = instr
        self.index = index

    @property
    def owner(self) -> "Instruction":
        return self.instr

    def __repr__(self) -> str:
        return f"<{self.instr.op.name} result {self.index}: {self.type}>"


_new_result = object.__new__


@dataclass
class Successor:
    """A branch target with the values passed to its block arguments."""

    block: "Block"
    args: list[Value]


class Instruction:
    """One operation: ``results = op(operands) {attrs}``, optionally with branch successors.

    ``dialect`` records the backend chosen to run it (None until dialects are assigned).
    Provenance: ``loc`` is the source location it comes from (:class:`Loc`, or None), and
    ``recomputes`` the value an earlier instruction of the function computed that this one
    computes again (set by rematerialisation; None for a first computation).
    """

    __slots__ = ("op", "operands", "attrs", "results", "successors", "dialect", "block", "loc", "recomputes")

    def __init__(self, op: OpDef, operands: Sequence[Value], attrs: dict[str, Any],
                 result_types: Sequence[TensorType], successors: Sequence[Successor] = (),
                 dialect: str | None = None, loc: Loc | None = None):
        self.op = op
        self.operands = list(operands)
        self.attrs = dict(attrs)
        # Results made without OpResult.__init__'s call (the same check): planning builds and drops
        # hundreds of thousands of instructions.
        results = []
        for t in result_types:
            if t.__class__ is not TensorType and not isinstance(t, TensorType):
                raise TypeError(f"value type must be a TensorType, got {t!r}")
            r = _new_result(OpResult)
            r.type, r.instr, r.index = t, self, len(results)
            results.append(r)
        self.results = results
        self.successors = list(successors)
        self.dialect = dialect
        self.block: Block | None = None
        self.loc = loc
        self.recomputes: Value | None = None

    @property
    def result(self) -> OpResult:
        if len(self.results) != 1:
            raise ValueError(f"'{self.op.name}' has {len(self.results)} results, not one")
        return self.results[0]

    @property
    def name(self) -> str:
        return self.op.name

    def __repr__(self) -> str:
        return f"<instr {self.op.name}>"


class Block:
    """A basic block: arguments, then instructions, the last a terminator."""

    def __init__(self, arg_types: Sequence[TensorType] = ()):
        self.args: list[BlockArg] = []
        self.instrs: list[Instruction] = []
        self.function: Function | None = None
        for t in arg_types:
            self.add_arg(t)

    def add_arg(self, type: TensorType) -> BlockArg:
        a = BlockArg(type, self, len(self.args))
        self.args.append(a)
        return a

    def append(self, instr: Instruction) -> Instruction:
        instr.block = self
        self.instrs.append(instr)
        return instr

    @property
    def terminator(self) -> Instruction | None:
        if self.instrs and self.instrs[-1].op.has("terminator"):
            return self.instrs[-1]
        return None

    def __repr__(self) -> str:
        return f"<block with {len(self.args)} args, {len(self.instrs)} instrs>"


@dataclass
class GradientSpec:
    """A declaration ``func @g = gradient @f wrt 1, 2``: to be filled by the differentiation pass.

    ``wrt`` are 0-based parameter indices of ``of``; ``with_value`` also returns f's outputs first.
    """

    of: str
    wrt: tuple[int, ...]
    with_value: bool = False


class Function:
    """A function: a list of blocks, the first one's arguments being the parameters.

    A function with ``gradient`` set and no blocks is a declaration awaiting differentiation.
    """

    def __init__(self, name: str, param_types: Sequence[TensorType] = (),
                 result_types: Sequence[TensorType] = (), gradient: GradientSpec | None = None):
        self.name = name
        self.result_types = list(result_types)
        self.blocks: list[Block] = []
        self.module: Module | None = None
        self.gradient = gradient
        if gradient is None:
            self.add_block(Block(param_types))

    @property
    def entry(self) -> Block:
        return self.blocks[0]

    @property
    def params(self) -> list[BlockArg]:
        return self.blocks[0].args if self.blocks else []

    @property
    def param_types(self) -> list[TensorType]:
        return [p.type for p in self.params]

    @property
    def is_declaration(self) -> bool:
        return self.gradient is not None and not self.blocks

    def add_block(self, block: Block | None = None, arg_types: Sequence[TensorType] = ()) -> Block:
        block = block if block is not None else Block(arg_types)
        block.function = self
        self.blocks.append(block)
        return block

    def instructions(self) -> Iterator[Instruction]:
        for b in self.blocks:
            yield from b.instrs

    def clone(self, name: str | None = None) -> "Function":
        """A deep copy with fresh values (same op declarations and attributes)."""
        f = Function(name or self.name, (), self.result_types, self.gradient)
        f.blocks = []
        vmap: dict[Value, Value] = {}
        bmap: dict[Block, Block] = {}
        for b in self.blocks:
            nb = f.add_block(Block())
            bmap[b] = nb
            for a in b.args:
                vmap[a] = nb.add_arg(a.type)
        for b in self.blocks:
            nb = bmap[b]
            for ins in b.instrs:
                ni = Instruction(ins.op, [vmap[v] for v in ins.operands], ins.attrs,
                                 [r.type for r in ins.results],
                                 [Successor(bmap[s.block], [vmap[v] for v in s.args]) for s in ins.successors],
                                 ins.dialect, ins.loc)
                for r, nr in zip(ins.results, ni.results):
                    vmap[r] = nr
                nb.append(ni)
                if ins.recomputes is not None:
                    ni.recomputes = vmap.get(ins.recomputes)
        return f

    def __str__(self) -> str:
        from .printer import print_function

        return print_function(self)

    def __repr__(self) -> str:
        return f"<function @{self.name}>"


class Module:
    """An ordered collection of functions, printable and parseable."""

    def __init__(self, functions: Sequence[Function] = ()):
        self.functions: dict[str, Function] = {}
        for f in functions:
            self.add(f)

    def add(self, f: Function) -> Function:
        if f.name in self.functions:
            raise ValueError(f"module already has a function @{f.name}")
        f.module = self
        self.functions[f.name] = f
        return f

    def __getitem__(self, name: str) -> Function:
        try:
            return self.functions[name]
        except KeyError:
            raise KeyError(f"no function @{name} in module; it has {', '.join('@' + n for n in self.functions) or 'none'}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.functions

    def __iter__(self) -> Iterator[Function]:
        return iter(self.functions.values())

    def clone(self) -> "Module":
        return Module([f.clone() for f in self])

    def __str__(self) -> str:
        from .printer import print_module

        return print_module(self)

    def __repr__(self) -> str:
        return f"<module {', '.join('@' + n for n in self.functions)}>"


class Builder:
    """Appends instructions to a block, applying each op's attribute check and type rule.

    ``b.op("add", x, y)`` returns the result value (a tuple for multi-result ops).
    ``loc`` is given to every instruction it creates (the importer and autodiff set it to the
    source location being translated or differentiated).
    """

    def __init__(self, block: Block, index: int | None = None, loc: Loc | None = None):
        self.block = block
        self.index = index  # insertion position; None = append
        self.loc = loc

    def _insert(self, instr: Instruction) -> Instruction:
        instr.block = self.block
        if self.index is None:
            self.block.instrs.append(instr)
        else:
            self.block.instrs.insert(self.index, instr)
            self.index += 1
        return instr

    def create(self, name: str, operands: Sequence[Value], attrs: dict[str, Any] | None = None,
               successors: Sequence[Successor] = (), result_types: Sequence[TensorType] | None = None,
               dialect: str | None = None, loc: Loc | None = None) -> Instruction:
        """Create and insert an instruction; result types come from the type rule unless given,
        its location from ``loc`` or else the builder's."""
        op = get_op(name)
        for i, v in enumerate(operands):
            if not isinstance(v, Value):
                raise TypeError(f"operand {i} of '{name}' is not an IR value: {v!r}")
        types = [v.type for v in operands]
        attrs = op.check_attrs(types, attrs or {})
        if result_types is None:
            result_types = op.result_types(types, attrs)
        return self._insert(Instruction(op, operands, attrs, result_types, successors, dialect,
                                        self.loc if loc is None else loc))

    def op(self, name: str, *operands: Value, **attrs: Any):
        ins = self.create(name, operands, attrs)
        if len(ins.results) == 1:
            return ins.results[0]
        return tuple(ins.results)

    # Control flow and calls.
    def ret(self, *values: Value) -> Instruction:
        return self.create("return", values)

    def br(self, block: Block, *args: Value) -> Instruction:
        return self.create("br", (), successors=[Successor(block, list(args))])

    def cond_br(self, cond: Value, t: Block, targs: Sequence[Value], f: Block, fargs: Sequence[Value]) -> Instruction:
        return self.create("cond_br", (cond,), successors=[Successor(t, list(targs)), Successor(f, list(fargs))])

    def call(self, callee: Function, *args: Value):
        ins = self.create("call", args, {"callee": callee.name}, result_types=callee.result_types)
        return tuple(ins.results)

    def free(self, *values: Value) -> Instruction:
        """A ``free`` of ``values``: :meth:`create` less the attribute check and the type rule, which
        a free (no attributes, no results) does not need; rematerialised programs are half frees."""
        op = get_op("free")
        for i, v in enumerate(values):
            if not isinstance(v, Value):
                raise TypeError(f"operand {i} of 'free' is not an IR value: {v!r}")
        op.check_arity(len(values))
        return self._insert(Instruction(op, values, {}, (), loc=self.loc))
