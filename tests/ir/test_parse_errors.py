"""Negative tests of the parser: every error is a ParseError naming line, column and the offending
token, with a message that says what was wrong and what would be valid."""
from __future__ import annotations

import pytest

import remat
from remat.ir import parse

F = "func @f(%0: f32[2]) -> f32[2] {{\n{body}\n}}\n"

# (case id, text, line, column, token, message fragments)
CASES = [
    ("unknown op with did-you-mean", F.format(body="  %1 = ad %0, %0 : f32[2]\n  return %1"),
     2, 8, "ad", ["unknown op 'ad'", "did you mean", "add"]),
    ("unknown op after a dialect prefix", F.format(body="  %1 = torch.addd %0, %0 : f32[2]\n  return %1"),
     2, 8, "torch.addd", ["unknown op 'addd'", "did you mean add"]),
    ("unknown dtype", "func @f(%0: f31[2]) -> f32[2] {\n  return %0\n}\n",
     1, 13, "f31", ["unknown dtype 'f31'", "valid: bool, i32, i64, f16, bf16, f32, f64"]),
    ("type without brackets", "func @f(%0: f32) -> f32[2] {\n  return %0\n}\n",
     1, 16, ")", ["expected '['", "a scalar is written f32[]"]),
    ("negative dimension", "func @f(%0: f32[-2]) -> f32[2] {\n  return %0\n}\n",
     1, 17, "-2", ["dimensions must be non-negative integers"]),
    ("missing ': types' (points at the end of the instruction)", F.format(body="  %1 = add %0, %0\n  return %1"),
     2, 18, "<end of line>", ["expected ':' and the result types"]),
    ("more result names than types", F.format(body="  %1, %2 = add %0, %0 : f32[2]\n  return %1"),
     2, 3, "%1", ["2 result name(s) but 1 result type(s)"]),
    ("undefined value", F.format(body="  %1 = add %0, %7 : f32[2]\n  return %1"),
     2, 16, "%7", ["use of undefined value %7 in @f"]),
    ("duplicate definition", F.format(body="  %0 = add %0, %0 : f32[2]\n  return %0"),
     2, 3, "%0", ["value %0 is defined twice", "one definition"]),
    ("unknown attribute", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 {axis=[0]} : f32[]\n  return %1\n}\n",
     2, 23, "axis", ["'reduce_sum' has no attribute 'axis'", "valid: axes, keepdims"]),
    ("attribute given twice", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 {axes=[0], axes=[0]} : f32[]\n  return %1\n}\n",
     2, 33, "axes", ["attribute 'axes' is given twice"]),
    ("missing required attribute", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 : f32[]\n  return %1\n}\n",
     2, 8, "reduce_sum", ["'reduce_sum' requires attribute 'axes' (ints)"]),
    ("bad attribute value: wrong kind", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 {axes=true} : f32[]\n  return %1\n}\n",
     2, 28, "true", ["attribute 'axes' of 'reduce_sum' must be a list of integers", "got True"]),
    ("bad attribute value: float in an int list", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 {axes=[0.5]} : f32[]\n  return %1\n}\n",
     2, 29, "0.5", ["list attributes hold integers"]),
    ("bad attribute value: not a value", F.format(body="  %1 = softmax %0 {axis=x} : f32[2]\n  return %1"),
     2, 25, "x", ["expected an attribute value", "number, true/false, string, dtype or [list]"]),
    ("bad attribute value: unknown dtype", F.format(body="  %1 = cast %0 {dtype=\"f8\"} : f32[2]\n  return %1"),
     2, 23, '"f8"', ["attribute 'dtype' of 'cast' must be one of bool, i32"]),
    ("unterminated string", F.format(body="  %1 = gelu %0 {approximate=\"tanh} : f32[2]\n  return %1"),
     2, 29, '"', ["unterminated string"]),
    ("unexpected character", F.format(body="  %1 = add %0, %0 : f32[2] ;\n  return %1"),
     2, 28, ";", ["unexpected character"]),
    ("unterminated function at end of input", "func @f(%0: f32[2]) -> f32[2] {\n  return %0\n",
     3, 1, "<end of input>", ["function @f is not closed with '}'"]),
    ("unterminated function before the next one",
     "func @f(%0: f32[2]) -> f32[2] {\n  return %0\nfunc @g(%0: f32[2]) -> f32[2] {\n  return %0\n}\n",
     3, 1, "func", ["function @f is not closed with '}' before the next function"]),
    ("branch to undefined block", F.format(body="  br ^exit(%0)\n^bb1(%1: f32[2]):\n  return %1"),
     2, 6, "^exit", ["branch to undefined block ^exit in @f"]),
    ("block defined twice", F.format(body="  br ^a\n^a:\n  br ^a\n^a:\n  return %0"),
     5, 1, "^a", ["block ^a is defined twice"]),
    ("operand after a branch target", "func @f(%0: bool[]) -> () {\n  cond_br ^a, %0, ^a\n^a:\n  return\n}\n",
     2, 15, "%0", ["operands must come before branch targets"]),
    ("function defined twice", "func @f(%0: f32[2]) -> f32[2] {\n  return %0\n}\nfunc @f(%0: f32[2]) -> f32[2] {\n  return %0\n}\n",
     4, 6, "@f", ["function @f is defined twice"]),
    ("gradient with a bad index", "func @g = gradient @f wrt a\n",
     1, 27, "a", ["expected a parameter index"]),
    ("gradient of an unknown kind", "func @g = hessian @f wrt 0\n",
     1, 11, "hessian", ["expected 'gradient' or 'value_and_gradient'"]),
    ("missing 'func'", "fun @f(%0: f32[2]) -> f32[2] {\n  return %0\n}\n",
     1, 1, "fun", ["expected 'func'"]),
    ("missing arrow", "func @f(%0: f32[2]) f32[2] {\n  return %0\n}\n",
     1, 21, "f32", ["expected '->' and the result types"]),
    ("attribute type rule error at the op", "func @f(%0: f32[2]) -> f32[2] {\n  %1 = softmax %0 {axis=\"0\"} : f32[2]\n  return %1\n}\n",
     2, 25, '"0"', ["attribute 'axis' of 'softmax' must be an integer"]),
]


@pytest.mark.parametrize("text, line, column, token, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_error(text: str, line: int, column: int, token: str, fragments: list[str]) -> None:
    with pytest.raises(remat.ParseError) as info:
        parse(text)
    e = info.value
    assert (e.line, e.column, e.token) == (line, column, token), str(e)
    for frag in fragments:
        assert frag in e.message, f"{frag!r} not in {e.message!r}"
    # The rendered message leads with the position and, when the line exists, shows it with a caret.
    rendered = str(e)
    assert rendered.startswith(f"line {line}, column {column}: ")
    lines = text.splitlines()
    if line <= len(lines):
        src = lines[line - 1]
        assert f"\n  {src}\n  {' ' * (column - 1)}^" in rendered, rendered


def test_parse_error_is_a_value_error() -> None:
    assert issubclass(remat.ParseError, ValueError)


def test_valid_text_parses() -> None:
    """Control: the template the negative cases are built from is itself valid."""
    m = parse(F.format(body="  %1 = add %0, %0 : f32[2]\n  return %1"))
    remat.verify(m)


# Inputs a fuzzer found escaping as the wrong exception (issue 15): every one is a ParseError now.
HARDENING = [
    ("dimension of 4301 digits", "func @f(%0: f32[" + "9" * 4301 + "]) -> f32[] {\n  return\n}\n",
     1, 17, ["dimension", "out of range", "valid: 0..9223372036854775807"]),
    ("dimension past int64", "func @f(%0: f32[9223372036854775808]) -> f32[] {\n  return\n}\n",
     1, 17, ["dimension 9223372036854775808 is out of range"]),
    ("wrt index of 4301 digits", "func @g = gradient @f wrt " + "1" * 4301 + "\n",
     1, 27, ["parameter index", "out of range"]),
    ("integer attribute of 4301 digits", F.format(body="  %1 = softmax %0 {axis=" + "7" * 4301 + "} : f32[2]\n  return %1"),
     2, 25, ["integer", "out of range"]),
    ("int list attribute past int64", "func @f(%0: f32[2]) -> f32[] {\n  %1 = reduce_sum %0 {axes=[-9223372036854775809]} : f32[]\n  return %1\n}\n",
     2, 29, ["integer -9223372036854775809 is out of range"]),
    ("float attribute given a 310-digit integer", F.format(body="  %1 = pad %0 {low=[0], high=[0], value=" + "9" * 310 + "} : f32[2]\n  return %1"),
     2, 41, ["integer", "out of range"]),
    ("invalid escape", F.format(body="  %1 = gelu %0 {approximate=\"\\q\"} : f32[2]\n  return %1"),
     2, 30, ["invalid escape", "\\u followed by 4 hex digits"]),
    ("short unicode escape", F.format(body="  %1 = gelu %0 {approximate=\"\\u12\"} : f32[2]\n  return %1"),
     2, 30, ["invalid escape"]),
    ("control character in a string", F.format(body="  %1 = gelu %0 {approximate=\"a\tb\"} : f32[2]\n  return %1"),
     2, 31, ["control character U+0009", "\\u0009"]),
    ("non-ASCII digit", "func @f(%0: f32[\u0663]) -> f32[] {\n  return\n}\n",
     1, 17, ["unexpected character", "ASCII digits 0-9"]),
]


@pytest.mark.parametrize("text,line,col,fragments", [c[1:] for c in HARDENING], ids=[c[0] for c in HARDENING])
def test_hardening_inputs_raise_parse_error(text: str, line: int, col: int, fragments: list[str]) -> None:
    with pytest.raises(remat.ir.ParseError) as e:
        parse(text)
    assert (e.value.line, e.value.column) == (line, col), str(e.value)
    for frag in fragments:
        assert frag in str(e.value), str(e.value)


@pytest.mark.parametrize("op,attr,value,fragment", [
    ("pad", "value", 10**310, "must be a number within the float range"),
    ("softmax", "axis", 2**63, "must fit in 64 bits"),
    ("reduce_sum", "axes", (0, -(2**63) - 1), "must fit in 64 bits"),
])
def test_attr_coerce_refuses_out_of_range_numbers(op: str, attr: str, value, fragment: str) -> None:
    """Attributes given from Python (not only parsed text) are bounded with a TypeError naming them."""
    from remat.ir.opdef import OPS

    with pytest.raises(TypeError, match=f"attribute '{attr}' of '{op}' {fragment}"):
        OPS[op].attr(attr).coerce(op, value)
