"""Parser for the text format (grammar in docs/ir.md). ``parse(text) -> Module``.

Errors raise :class:`ParseError` with line, column and the offending token.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .core import Block, Function, GradientSpec, Instruction, Loc, Module, Successor, Value
from .opdef import OPS, get_op
from .types import DType, TensorType


class ParseError(ValueError):
    """A syntax error in IR text, with its position."""

    def __init__(self, message: str, line: int, column: int, token: str, source_line: str = ""):
        self.message, self.line, self.column, self.token = message, line, column, token
        shown = token if len(token) <= 40 else token[:36] + "…"  # a long token is shown by its start
        lo = max(0, column - 61)  # a long line is shown around the column
        src = ("…" if lo else "") + source_line[lo:column + 60] + ("…" if len(source_line) > column + 60 else "")
        caret = f"\n  {src}\n  {' ' * (column - 1 - lo + (1 if lo else 0))}^" if source_line else ""
        super().__init__(f"line {line}, column {column}: {message} (at {shown!r}){caret}")


_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r]+|//(?!\s*loc\()[^\n]*)
  | (?P<locmark>//(?=\s*loc\())
  | (?P<nl>\n)
  | (?P<value>%[A-Za-z0-9_.$-]+)
  | (?P<func>@[A-Za-z_][A-Za-z0-9_.$]*)
  | (?P<block>\^[A-Za-z_][A-Za-z0-9_.$]*)
  | (?P<number>-?(?:[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+|[0-9]+)|-?inf\b)
  | (?P<string>"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*")
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<arrow>->)
  | (?P<punct>[()\[\]{},:=])
  | (?P<bad>.)
""", re.VERBOSE | re.DOTALL)
"""One token per match, from any position: the last alternative (``bad``) takes a character no
token starts with, so :func:`tokenize` scans the text in one ``finditer`` and reports it."""


_ESCAPE = re.compile(r'\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})')

# Integers of the text format fit in a signed 64-bit integer (what every dialect stores); anything
# longer is refused before Python converts it (its int() refuses more than 4,300 digits anyway).
INT_MIN, INT_MAX = -(2**63), 2**63 - 1


def _string_error(text: str, pos: int) -> tuple[str, int]:
    """Why the string starting at ``pos`` is not a token (a JSON string on one line): the message
    and the position of the offending character."""
    k = pos + 1
    while k < len(text) and text[k] != '"':
        c = text[k]
        if c == "\\":
            if not _ESCAPE.match(text, k):
                return ("invalid escape in a string; valid: \\\" \\\\ \\/ \\b \\f \\n \\r \\t "
                        "and \\u followed by 4 hex digits"), k
            k += 6 if text[k + 1] == "u" else 2
            continue
        if c == "\n":
            break
        if ord(c) < 0x20:
            return f"control character U+{ord(c):04X} in a string; write it as an escape (\\u{ord(c):04x})", k
        k += 1
    return "unterminated string (a string closes with '\"' on the same line)", pos


@dataclass(slots=True)
class Tok:
    kind: str
    text: str
    line: int
    col: int


def _bad_character(text: str, pos: int, line: int, start: int) -> ParseError:
    """The error for the character at ``pos`` (line ``line``, which starts at ``start``), which no
    token starts with."""
    src = text.splitlines()[line - 1] if text.splitlines() else ""
    if text[pos] == '"':
        msg, at = _string_error(text, pos)
        bad = text[at:at + (6 if text.startswith("\\u", at) else 2 if text[at] == "\\" else 1)]
        return ParseError(msg, line, at - start + 1, bad, src)
    msg = ("unexpected character (numbers are written with the ASCII digits 0-9)" if text[pos].isdigit()
           else "unexpected character")
    return ParseError(msg, line, pos - start + 1, text[pos], src)


def tokenize(text: str) -> list[Tok]:
    """The tokens of ``text``, whitespace and comments dropped, then an ``eof`` token; ParseError at
    the first character no token starts with."""
    toks: list[Tok] = []
    append = toks.append
    line, start = 1, 0
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "ws" or kind == "locmark":  # '// loc(...)': provenance, read as a trailing loc(...)
            continue
        pos = m.start()
        if kind == "nl":
            line, start = line + 1, m.end()
        elif kind == "bad":
            raise _bad_character(text, pos, line, start)
        else:
            append(Tok(kind, m.group(), line, pos - start + 1))
    append(Tok("eof", "<end of input>", line, len(text) - start + 1))
    return toks


@dataclass
class _RawInstr:
    results: list[Tok]
    op: Tok
    dialect: str | None
    operands: list[Tok]
    attrs: dict[str, Any]
    successors: list[tuple[Tok, list[Tok]]]
    types: list[TensorType]
    callee: str | None = None
    instr: Instruction | None = None
    loc: Loc | None = None
    recompute: Tok | None = None


@dataclass
class _RawBlock:
    label: Tok | None
    args: list[tuple[Tok, TensorType]]
    instrs: list[_RawInstr] = field(default_factory=list)


class _Parser:
    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.toks = tokenize(text)
        self.i = 0

    # -- token helpers
    @property
    def tok(self) -> Tok:
        return self.toks[self.i]

    def error(self, msg: str, tok: Tok | None = None) -> ParseError:
        tok = tok or self.tok
        src = self.lines[tok.line - 1] if 0 < tok.line <= len(self.lines) else ""
        return ParseError(msg, tok.line, tok.col, tok.text, src)

    def next(self) -> Tok:
        t = self.tok
        self.i += 1
        return t

    def at(self, text: str) -> bool:
        return self.tok.text == text and self.tok.kind in ("punct", "arrow", "ident")

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.i += 1
            return True
        return False

    def missing(self, msg: str) -> ParseError:
        """An 'expected …' error. When the offending token starts a later line, the missing piece
        belongs at the end of the previous line, so point there."""
        prev = self.toks[self.i - 1] if self.i > 0 else None
        if prev is not None and self.tok.line > prev.line:
            src = self.lines[prev.line - 1] if 0 < prev.line <= len(self.lines) else ""
            return ParseError(msg, prev.line, prev.col + len(prev.text), "<end of line>", src)
        return self.error(msg)

    def expect(self, text: str, what: str = "") -> Tok:
        if not self.at(text):
            raise self.missing(f"expected '{text}'{' ' + what if what else ''}")
        return self.next()

    def expect_kind(self, kind: str, what: str) -> Tok:
        if self.tok.kind != kind:
            raise self.missing(f"expected {what}")
        return self.next()

    def integer(self, tok: Tok, what: str, lo: int = INT_MIN, hi: int = INT_MAX) -> int:
        """The value of an integer token, refused with a ParseError outside ``[lo, hi]``."""
        digits = tok.text.lstrip("-").lstrip("0")
        if len(digits) > 19 or not lo <= int(tok.text) <= hi:  # 19 digits hold any int64
            raise self.error(f"{what} {tok.text if len(tok.text) <= 24 else tok.text[:20] + '…'} is out of range; "
                             f"valid: {lo}..{hi}", tok)
        return int(tok.text)

    def at_block_header(self) -> bool:
        """Whether the current '^label' token starts a block (``^bb1:`` or ``^bb1(%3: ...``)."""
        def text(k: int) -> str:
            return self.toks[min(self.i + k, len(self.toks) - 1)].text

        kind2 = self.toks[min(self.i + 2, len(self.toks) - 1)].kind
        return text(1) == ":" or (text(1) == "(" and kind2 == "value" and text(3) == ":")

    # -- grammar
    def module(self) -> Module:
        m = Module()
        while self.tok.kind != "eof":
            f = self.function(m)
            if f.name in m:
                raise self.error(f"function @{f.name} is defined twice", self._fname_tok)
            m.add(f)
        return m

    def type(self) -> TensorType:
        t = self.expect_kind("ident", "a type such as f32[2,3]")
        try:
            dt = DType(t.text)
        except ValueError:
            raise self.error(f"unknown dtype '{t.text}'; valid: {', '.join(d.value for d in DType)}", t) from None
        self.expect("[", "after the dtype (a scalar is written f32[])")
        dims = []
        if not self.at("]"):
            while True:
                d = self.expect_kind("number", "a dimension (a non-negative integer)")
                if not re.fullmatch(r"[0-9]+", d.text):
                    raise self.error("dimensions must be non-negative integers", d)
                dims.append(self.integer(d, "dimension", 0))
                if not self.accept(","):
                    break
        self.expect("]", "to close the shape")
        return TensorType(dt, tuple(dims))

    def function(self, m: Module) -> Function:
        kw = self.expect_kind("ident", "'func'")
        if kw.text != "func":
            raise self.error("expected 'func'", kw)
        self._fname_tok = name = self.expect_kind("func", "a function name such as @main")
        fname = name.text[1:]
        if self.accept("="):
            kind = self.expect_kind("ident", "'gradient' or 'value_and_gradient'")
            if kind.text not in ("gradient", "value_and_gradient"):
                raise self.error("expected 'gradient' or 'value_and_gradient'", kind)
            of = self.expect_kind("func", "the differentiated function, such as @f").text[1:]
            wrt = self.expect_kind("ident", "'wrt'")
            if wrt.text != "wrt":
                raise self.error("expected 'wrt'", wrt)
            idx = []
            while True:
                t = self.expect_kind("number", "a parameter index")
                if not re.fullmatch(r"[0-9]+", t.text):
                    raise self.error("parameter indices are non-negative integers", t)
                idx.append(self.integer(t, "parameter index", 0))
                if not self.accept(","):
                    break
            return Function(fname, gradient=GradientSpec(of, tuple(idx), kind.text == "value_and_gradient"))
        self.expect("(", "to open the parameter list")
        params: list[tuple[Tok, TensorType]] = []
        if not self.at(")"):
            while True:
                v = self.expect_kind("value", "a parameter such as %0")
                self.expect(":", "after the parameter name")
                params.append((v, self.type()))
                if not self.accept(","):
                    break
        self.expect(")")
        self.expect("->", "and the result types")
        if self.accept("("):
            results = []
            if not self.at(")"):
                while True:
                    results.append(self.type())
                    if not self.accept(","):
                        break
            self.expect(")")
        else:
            results = [self.type()]
        self.expect("{", "to open the function body")
        blocks = [_RawBlock(None, params)]
        while not self.at("}"):
            if self.tok.kind == "eof":
                raise self.error(f"function @{fname} is not closed with '}}'")
            if self.tok.text == "func" and self.toks[self.i + 1].kind == "func":
                raise self.error(f"function @{fname} is not closed with '}}' before the next function")
            if self.tok.kind == "block":
                label = self.next()
                args = []
                if self.accept("("):
                    while True:
                        v = self.expect_kind("value", "a block argument such as %3")
                        self.expect(":")
                        args.append((v, self.type()))
                        if not self.accept(","):
                            break
                    self.expect(")")
                self.expect(":", "after the block label")
                blocks.append(_RawBlock(label, args))
                continue
            blocks[-1].instrs.append(self.instruction())
        self.expect("}")
        return self.build(fname, params, results, blocks)

    def attr_value(self) -> Any:
        t = self.tok
        if t.kind == "number":
            self.next()
            if re.fullmatch(r"-?[0-9]+", t.text):
                return self.integer(t, "integer")
            return float(t.text)
        if t.kind == "string":
            self.next()
            return json.loads(t.text)
        if t.kind == "ident":
            self.next()
            if t.text in ("true", "false"):
                return t.text == "true"
            if t.text in ("nan", "inf"):
                return float(t.text)
            try:
                return DType(t.text)
            except ValueError:
                raise self.error("expected an attribute value (number, true/false, string, dtype or [list])", t) from None
        if self.accept("["):
            items = []
            if not self.at("]"):
                while True:
                    n = self.expect_kind("number", "an integer")
                    if not re.fullmatch(r"-?[0-9]+", n.text):
                        raise self.error("list attributes hold integers", n)
                    items.append(self.integer(n, "integer"))
                    if not self.accept(","):
                        break
            self.expect("]")
            return tuple(items)
        raise self.error("expected an attribute value (number, true/false, string, dtype or [list])")

    def instruction(self) -> _RawInstr:
        results: list[Tok] = []
        if self.tok.kind == "value":
            while True:
                results.append(self.expect_kind("value", "a result name"))
                if not self.accept(","):
                    break
            self.expect("=", "after the result names")
        optok = self.expect_kind("ident", "an op name")
        dialect, opname = None, optok.text
        if opname not in OPS and "." in opname:
            dialect, opname = opname.split(".", 1)
        if opname not in OPS:
            try:
                get_op(opname)
            except KeyError as e:
                raise self.error(str(e.args[0]), optok) from None
        op = OPS[opname]
        operands: list[Tok] = []
        successors: list[tuple[Tok, list[Tok]]] = []
        attrs: dict[str, Any] = {}
        callee = None
        if opname == "call":
            callee = self.expect_kind("func", "the callee, such as @f").text[1:]
            self.expect("(")
            if not self.at(")"):
                while True:
                    operands.append(self.expect_kind("value", "an argument value"))
                    if not self.accept(","):
                        break
            self.expect(")")
            attrs["callee"] = callee
        else:
            # A '^label' right after a bare op (``return`` with no operands) may be the next
            # block's header, not a branch target: the grammar is newline-insensitive.
            if self.tok.kind == "value" or (self.tok.kind == "block" and not self.at_block_header()):
                while True:
                    if self.tok.kind == "value":
                        if successors:
                            raise self.error("operands must come before branch targets")
                        operands.append(self.next())
                    elif self.tok.kind == "block":
                        label = self.next()
                        args = []
                        if self.accept("("):
                            if not self.at(")"):
                                while True:
                                    args.append(self.expect_kind("value", "a branch argument"))
                                    if not self.accept(","):
                                        break
                            self.expect(")")
                        successors.append((label, args))
                    else:
                        raise self.error("expected an operand (%name) or a branch target (^label)")
                    if not self.accept(","):
                        break
            if self.accept("{"):
                if not self.at("}"):
                    while True:
                        key = self.expect_kind("ident", "an attribute name")
                        self.expect("=", "after the attribute name")
                        if key.text in attrs:
                            raise self.error(f"attribute '{key.text}' is given twice", key)
                        a = op.attr(key.text)
                        if a is None:
                            valid = ", ".join(x.name for x in op.attrs) or "none"
                            raise self.error(f"'{opname}' has no attribute '{key.text}'; valid: {valid}", key)
                        vtok = self.tok
                        try:
                            attrs[key.text] = a.coerce(opname, self.attr_value())
                        except TypeError as e:
                            raise self.error(str(e), vtok) from None
                        if not self.accept(","):
                            break
                self.expect("}", "to close the attributes")
        types: list[TensorType] = []
        if results:
            self.expect(":", "and the result types after the instruction")
            while True:
                types.append(self.type())
                if not self.accept(","):
                    break
            if len(types) != len(results):
                raise self.error(f"{len(results)} result name(s) but {len(types)} result type(s)", results[0])
        raw = _RawInstr(results, optok, dialect, operands, attrs, successors, types, callee)
        if self.at("loc") and self.toks[self.i + 1].text == "(":
            self.location(raw)
        return raw

    def location(self, raw: _RawInstr) -> None:
        """``loc(item, ...)``, items: the module path ``"..."``, the source line ``"file":INT``,
        and ``recompute=VALUE`` (the value a recomputation computes again)."""
        self.expect("loc")
        self.expect("(")
        path, file, line, seen = None, None, 0, False
        while not self.at(")"):
            if seen:
                self.expect(",", "between the items of loc(...)")
            seen = True
            if self.tok.kind == "string":
                tok = self.next()
                text = json.loads(tok.text)
                if self.accept(":"):
                    if file is not None:
                        raise self.error("loc(...) has two source locations", tok)
                    file, line = text, int(self.expect_kind("number", "a line number after the file").text)
                elif path is None and file is None:
                    path = text
                else:
                    raise self.error("loc(...) takes one module path, before the source location", tok)
            elif self.at("recompute") and raw.recompute is None:
                self.next()
                self.expect("=", "after 'recompute'")
                raw.recompute = self.expect_kind("value", "the value recomputed, such as %3")
            else:
                raise self.error('expected a module path ("..."), a source location ("file":line) '
                                 'or recompute=%value in loc(...)')
        self.expect(")", "to close loc(...)")
        if path is not None or file is not None:
            raw.loc = Loc(path or "", file or "", line)

    def build(self, fname: str, params, results, raw_blocks: list[_RawBlock]) -> Function:
        f = Function(fname, [t for _, t in params], results)
        f.blocks = []
        names: dict[str, Value] = {}
        labels: dict[str, Block] = {}

        def define(tok: Tok, v: Value) -> None:
            if tok.text in names:
                raise self.error(f"value {tok.text} is defined twice (SSA values have one definition)", tok)
            names[tok.text] = v

        for rb in raw_blocks:
            b = f.add_block(Block())
            if rb.label is not None:
                if rb.label.text in labels:
                    raise self.error(f"block {rb.label.text} is defined twice", rb.label)
                labels[rb.label.text] = b
            for tok, t in rb.args:
                define(tok, b.add_arg(t))
            for ri in rb.instrs:
                ri.instr = Instruction(OPS[ri.op.text.split(".")[-1] if ri.dialect else ri.op.text], [], {}, ri.types,
                                       dialect=ri.dialect, loc=ri.loc)
                for tok, r in zip(ri.results, ri.instr.results):
                    define(tok, r)
                b.append(ri.instr)

        def use(tok: Tok) -> Value:
            if tok.text not in names:
                raise self.error(f"use of undefined value {tok.text} in @{fname}", tok)
            return names[tok.text]

        for rb in raw_blocks:
            for ri in rb.instrs:
                ins = ri.instr
                ins.operands = [use(t) for t in ri.operands]
                if ri.recompute is not None:
                    ins.recomputes = use(ri.recompute)
                for label, args in ri.successors:
                    if label.text not in labels:
                        raise self.error(f"branch to undefined block {label.text} in @{fname}", label)
                    ins.successors.append(Successor(labels[label.text], [use(a) for a in args]))
                if ins.op.name == "call":
                    ins.attrs = dict(ri.attrs)
                else:
                    try:
                        ins.attrs = ins.op.check_attrs([v.type for v in ins.operands], ri.attrs)
                    except (TypeError, IndexError) as e:
                        raise self.error(str(e), ri.op) from None
        return f


def parse(text: str) -> Module:
    """Parse IR text into a :class:`Module` (not verified; call ``verify``)."""
    return _Parser(text).module()
