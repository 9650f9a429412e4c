"""The verifier: structure, single definition, dominance, types against each op's rule,
branch arguments against block parameters, calls against callees, return types.

Errors name the function, block and instruction and show it in context.
"""
from __future__ import annotations

import re

from .core import Block, Function, Instruction, Module, Value
from .dominance import DominatorTree, dominators, predecessors, reachable  # noqa: F401 (re-exported)


class VerificationError(ValueError):
    """The IR breaks an invariant. ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("IR verification failed:\n" + "\n\n".join(errors))


class _Context:
    """The printed function, made once on the first error, so that each message shows the
    offending line with its neighbours (marked ``-->``) in time independent of the function's size."""

    def __init__(self, f: Function):
        self.f = f
        self._lines: tuple | None = None
        self._labels: dict[Block, int] | None = None

    def __call__(self, ins: Instruction | None, block: Block | None = None, radius: int = 2) -> str:
        from .printer import function_lines

        if self._lines is None:
            self._lines = function_lines(self.f)
        lines, where, names = self._lines
        if ins is not None and ins in where:
            k = where[ins]
        elif ins is None and block is not None and names is not None and block in names.blocks:
            if self._labels is None:  # line of each block's header (the entry's is the signature)
                by_label = {label: b for b, label in names.blocks.items()}
                self._labels = {self.f.entry: 0}
                for i, line in enumerate(lines):
                    if line.startswith("^"):  # block headers are the only unindented '^' lines
                        b = by_label.get(line.split("(")[0].rstrip(":"))
                        if b is not None:
                            self._labels[b] = i
            k = self._labels.get(block, -1)
            if k < 0:
                return ""
        else:
            return ""
        lo, hi = max(0, k - radius), min(len(lines), k + radius + 1)
        return "\n".join(("--> " if i == k else "    ") + lines[i] for i in range(lo, hi))


# Names the text format can write back (the parser's FUNC and dialect tokens): a module whose
# names break these would print to text that does not parse.
_FUNC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.$]*")
_DIALECT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _same_attrs(a: dict, b: dict) -> bool:
    """Equal as the text format sees them: same kinds of values too (``1`` is not ``1.0``, ``-0.0``
    is not ``0.0``), since either difference changes the printed text."""
    return a.keys() == b.keys() and all(type(a[k]) is type(b[k]) and repr(a[k]) == repr(b[k]) for k in a)


_RULES: dict[tuple, tuple] = {}
_RULES_MAX = 100_000


def _type_rule(op, types: list, attrs: dict) -> tuple:
    """``(normal attributes, whether ``attrs`` are in normal form, result types, problem)`` of one
    instruction's op applied to its operand types, memoised: a module is verified after every pass
    and most instructions are unchanged between passes. The key holds the attributes' reprs and
    types, so values the text format tells apart (``1`` and ``True``, ``0.0`` and ``-0.0``) are
    never confused; the entry holds the op itself, so a redeclared op is checked afresh."""
    key = (op.name, tuple(types), repr(attrs), tuple(map(type, attrs.values())))
    hit = _RULES.get(key)
    if hit is not None and hit[0] is op:
        return hit[1:]
    try:
        normal = op.check_attrs(types, attrs)
    except (TypeError, IndexError) as e:
        result = (None, True, None, str(e))
    else:
        same = _same_attrs(normal, attrs)
        try:
            result = (normal, same, op.result_types(types, normal), None)
        except (TypeError, IndexError) as e:  # reported after the attributes' normal form, as it follows it
            result = (normal, same, None, str(e))
    if len(_RULES) >= _RULES_MAX:
        _RULES.clear()
    _RULES[key] = (op, *result)
    return result


def verify_function(f: Function, module: Module | None = None) -> list[str]:
    """Every problem of one function as a message naming the function, block and instruction."""
    if not _FUNC_NAME.fullmatch(f.name):
        return [f"function name {f.name!r} cannot be written in the text format; "
                f"valid names match [A-Za-z_][A-Za-z0-9_.$]*"]
    if f.is_declaration:
        return [f"{e}\n--> {str(f).strip()}" for e in _verify_declaration(f, module)]
    if not f.blocks:
        return [f"in @{f.name}: a function needs at least one block"]
    return _verify_body(f, module)


def _verify_declaration(f: Function, module: Module | None) -> list[str]:
    """A gradient declaration names a function of the module and distinct, in-range parameters."""
    errs: list[str] = []
    g = f.gradient
    if module is not None:
        if g.of not in module:
            errs.append(f"in @{f.name}: gradient of unknown function @{g.of}; the module has "
                        f"{', '.join('@' + n for n in module.functions) or 'no functions'}")
        else:
            n = len(module[g.of].param_types) if not module[g.of].is_declaration else None
            bad = [i for i in g.wrt if n is not None and not 0 <= i < n]
            if bad:
                valid = f"valid: 0..{n - 1}" if n else "it has none to differentiate"
                errs.append(f"in @{f.name}: 'wrt' index {bad[0]} is out of range; @{g.of} has {n} parameters ({valid})")
    if not g.wrt:
        errs.append(f"in @{f.name}: 'wrt' is empty; name at least one parameter index of @{g.of}")
    if len(set(g.wrt)) != len(g.wrt):
        errs.append(f"in @{f.name}: 'wrt' repeats an index: {list(g.wrt)}")
    return errs


def _verify_body(f: Function, module: Module | None) -> list[str]:
    errs: list[str] = []
    bname = {b: ("entry block" if i == 0 else f"block ^bb{i}") for i, b in enumerate(f.blocks)}
    defs: dict[Value, tuple[Block, int]] = {}

    context = _Context(f)

    def err(b: Block, ins: Instruction | None, msg: str) -> None:
        where = f"in @{f.name}, {bname[b]}"
        if ins is not None:
            where += f", instruction '{ins.op.name}'"
        ctx = context(ins, block=b)
        errs.append(f"{where}: {msg}" + (f"\n{ctx}" if ctx else ""))

    # Definitions (single definition, ownership).
    for b in f.blocks:
        if b.function is not f:
            err(b, None, "block belongs to another function")
        for a in b.args:
            if a in defs:
                err(b, None, "block argument defined twice")
            defs[a] = (b, -1)
        for i, ins in enumerate(b.instrs):
            if ins.block is not b:
                err(b, ins, "instruction's parent block is wrong")
            for r in ins.results:
                if r in defs:
                    err(b, ins, "value defined twice (SSA values have one definition)")
                defs[r] = (b, i)

    dom = DominatorTree(f)

    def check_use(b: Block, i: int, ins: Instruction, v: Value, what: str) -> None:
        if v not in defs:
            err(b, ins, f"{what} is not defined in @{f.name} (a value from another function or a deleted instruction)")
            return
        db, di = defs[v]
        if b not in dom:  # unreachable: no path to check
            return
        if db is b:
            if di >= i:
                err(b, ins, f"{what} ({printed(v)}) is used before its definition")
        elif not dom.dominates(db, b):
            err(b, ins, f"{what} ({printed(v)}) is defined in {bname[db]}, which does not dominate its use")

    namer = []  # built on the first error only: the printed names of values

    def printed(v: Value) -> str:
        if not namer:
            from .printer import Namer

            namer.append(Namer(f))
        return namer[0][v]

    for b in f.blocks:
        if not b.instrs or not b.instrs[-1].op.has("terminator"):
            err(b, b.instrs[-1] if b.instrs else None, "block does not end with a terminator (return, br or cond_br)")
        freed: dict[Value, Instruction] = {}
        updated: dict[Value, Instruction] = {}  # operands an in-place op overwrote
        for i, ins in enumerate(b.instrs):
            op = ins.op
            if ins.dialect is not None and not _DIALECT.fullmatch(str(ins.dialect)):
                err(b, ins, f"dialect {ins.dialect!r} cannot be written in the text format; "
                            f"valid dialect names match [A-Za-z_][A-Za-z0-9_]*")
            if op.has("terminator") and i != len(b.instrs) - 1:
                err(b, ins, "terminator in the middle of a block")
            for k, v in enumerate(ins.operands):
                check_use(b, i, ins, v, f"operand {k}")
                if v in freed:
                    err(b, ins, f"operand {k} is used after it was freed")
                if v in updated and op.name != "free":  # releasing the old name is fine; reading it is not
                    err(b, ins, f"operand {k} is used after '{updated[v].op.name}' overwrote it in place; "
                                "use that instruction's result instead")
            for s in ins.successors:
                for k, v in enumerate(s.args):
                    check_use(b, i, ins, v, f"branch argument {k}")
            if op.name == "free":
                for v in ins.operands:
                    freed[v] = ins
            if op.has("inplace"):
                for src in op.aliases.values():
                    if src < len(ins.operands):
                        updated[ins.operands[src]] = ins
            # Successor structure.
            want = {"br": 1, "cond_br": 2}.get(op.name, 0)
            if len(ins.successors) != want:
                err(b, ins, f"'{op.name}' needs {want} branch target(s), has {len(ins.successors)}")
            for s in ins.successors:
                if s.block not in bname:
                    err(b, ins, "branch to a block outside the function")
                    continue
                if s.block is f.entry:
                    err(b, ins, "branch to the entry block (the entry block has no predecessors)")
                ptypes = [a.type for a in s.block.args]
                atypes = [a.type for a in s.args]
                if ptypes != atypes:
                    err(b, ins, f"branch to {bname[s.block]} passes ({', '.join(map(str, atypes))}) "
                                f"but the block takes ({', '.join(map(str, ptypes))})")
            # Types.
            types = [v.type for v in ins.operands]
            rtypes = tuple(r.type for r in ins.results)
            if op.name == "return":
                if list(types) != list(f.result_types):
                    err(b, ins, f"returns ({', '.join(map(str, types))}) but @{f.name} is declared to return "
                                f"({', '.join(map(str, f.result_types))})")
                continue
            if op.name == "call":
                callee = ins.attrs.get("callee")
                if module is None or callee not in module:
                    err(b, ins, f"call to unknown function @{callee}")
                    continue
                g = module[callee]
                if g.is_declaration:
                    err(b, ins, f"call to @{callee}, a gradient declaration not yet differentiated (run the 'grad' pass)")
                    continue
                if types != g.param_types:
                    err(b, ins, f"call passes ({', '.join(map(str, types))}) but @{callee} takes ({', '.join(map(str, g.param_types))})")
                if list(rtypes) != g.result_types:
                    err(b, ins, f"call results ({', '.join(map(str, rtypes))}) do not match @{callee}'s results ({', '.join(map(str, g.result_types))})")
                continue
            attrs, normal, expected, problem = _type_rule(op, types, ins.attrs)
            if not normal:
                err(b, ins, f"attributes {ins.attrs} are not in normal form (expected {attrs})")
            if problem is not None:
                err(b, ins, problem)
                continue
            if expected != rtypes:
                err(b, ins, f"result type ({', '.join(map(str, rtypes))}) does not match the type rule: "
                            f"operands ({', '.join(map(str, types))}) give ({', '.join(map(str, expected))})")
    return errs


def verify(obj: Module | Function) -> Module | Function:
    """Check every invariant; raise :class:`VerificationError` listing all problems. Returns ``obj``."""
    if isinstance(obj, Function):
        errs = verify_function(obj, obj.module)
    else:
        errs = []
        for f in obj:
            errs += verify_function(f, obj)
    if errs:
        raise VerificationError(errs)
    return obj
