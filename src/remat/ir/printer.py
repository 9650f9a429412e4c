"""The canonical text format. Names are assigned here, in order of appearance:
parameters %0, %1, …, then block arguments and results as they occur; blocks ^bb1, ^bb2, …

    func @f(%0: f32[2,3], %1: f32[3]) -> f32[2,3] {
      %2 = add %0, %1 : f32[2,3]
      return %2
    }
    func @g = gradient @f wrt 0, 1

The grammar is documented in docs/ir.md.
"""
from __future__ import annotations

import json
from typing import Any

from .core import Block, Function, Instruction, Module, Value
from .opdef import REQUIRED
from .types import DType


def format_attr_value(kind: str, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, DType):
        return v.value
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(str(x) for x in v) + "]"
    raise TypeError(f"cannot print attribute value {v!r}")


def _is_default(a, v) -> bool:
    if a.default is REQUIRED:
        return False
    if type(a.default) is not type(v):
        return False
    if isinstance(v, float):  # -0.0 == 0.0 but is a different value; nan is never a default
        return repr(v) == repr(a.default)
    return a.default == v


class Namer:
    """Assigns printed names to the values and blocks of one function."""

    def __init__(self, f: Function):
        self.values: dict[Value, str] = {}
        self.blocks: dict[Block, str] = {}
        n = 0
        for i, b in enumerate(f.blocks):
            self.blocks[b] = f"^bb{i}"
            for a in b.args:
                self.values[a] = f"%{n}"
                n += 1
            for ins in b.instrs:
                for r in ins.results:
                    self.values[r] = f"%{n}"
                    n += 1

    def __getitem__(self, v: Value) -> str:
        try:
            return self.values[v]
        except KeyError:
            return f"%<undefined {v.type}>"

    def succ(self, s) -> str:
        name = self.blocks.get(s.block, "^<unknown block>")
        if s.args:
            return f"{name}({', '.join(self[a] for a in s.args)})"
        return name


def format_instruction(ins: Instruction, names: Namer) -> str:
    op = ins.op
    head = f"{ins.dialect}.{op.name}" if ins.dialect else op.name
    lhs = ", ".join(names[r] for r in ins.results)
    if op.name == "call":
        body = f"call @{ins.attrs['callee']}({', '.join(names[v] for v in ins.operands)})"
        if ins.dialect:
            body = f"{ins.dialect}.{body}"
    else:
        parts = [", ".join(names[v] for v in ins.operands)] if ins.operands else []
        if ins.successors:
            parts = [", ".join(parts + [names.succ(s) for s in ins.successors])]
        attrs = [f"{a.name}={format_attr_value(a.kind, ins.attrs[a.name])}" for a in op.attrs
                 if a.name in ins.attrs and not _is_default(a, ins.attrs[a.name])]
        if attrs:
            parts.append("{" + ", ".join(attrs) + "}")
        body = " ".join([head] + parts)
    loc = format_loc(ins, names)
    if ins.results:
        return f"{lhs} = {body} : {', '.join(str(r.type) for r in ins.results)}{loc}"
    return body + loc


def format_loc(ins: Instruction, names: "Namer") -> str:
    """The trailing provenance of an instruction, ``// loc("path", "file":line, recompute=%n)``
    (each part only when known; empty without provenance, so such IR prints unchanged). It reads
    as a comment to tools that skip comments; the parser reads it back."""
    parts = []
    if ins.loc is not None:
        parts.append(json.dumps(ins.loc.path))
        if ins.loc.file:
            parts.append(f"{json.dumps(ins.loc.file)}:{ins.loc.line}")
    if ins.recomputes is not None and ins.recomputes in names.values:
        parts.append(f"recompute={names[ins.recomputes]}")
    return f"  // loc({', '.join(parts)})" if parts else ""


def _result_sig(types) -> str:
    if len(types) == 1:
        return str(types[0])
    return "(" + ", ".join(str(t) for t in types) + ")"


def function_lines(f: Function) -> tuple[list[str], dict[Instruction, int], Namer | None]:
    """The printed lines of a function and the line index of each instruction."""
    if f.is_declaration:
        g = f.gradient
        kind = "value_and_gradient" if g.with_value else "gradient"
        return [f"func @{f.name} = {kind} @{g.of} wrt {', '.join(map(str, g.wrt))}"], {}, None
    names = Namer(f)
    params = ", ".join(f"{names[a]}: {a.type}" for a in f.params)
    lines = [f"func @{f.name}({params}) -> {_result_sig(f.result_types)} {{"]
    where: dict[Instruction, int] = {}
    for i, b in enumerate(f.blocks):
        if i > 0:
            args = f"({', '.join(f'{names[a]}: {a.type}' for a in b.args)})" if b.args else ""
            lines.append(f"{names.blocks[b]}{args}:")
        for ins in b.instrs:
            where[ins] = len(lines)
            lines.append("  " + format_instruction(ins, names))
    lines.append("}")
    return lines, where, names


def print_function(f: Function) -> str:
    return "\n".join(function_lines(f)[0]) + "\n"


def print_module(m: Module) -> str:
    return "\n".join(print_function(f) for f in m)
