"""The text format's guarantee: every valid program prints to canonical text that parses back to a
module printing the same text, and verifying again; non-canonical input reaches the same text."""
from __future__ import annotations

import math
import re
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from irgen import STRUCTURAL, generate_module, instantiate, sampled_ops
from remat.ir import OPS, Builder, DType, Function, Module, TensorType, parse, verify
from remat.ir.core import BlockArg
from remat.ir.parser import Tok, tokenize

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEEDS = st.integers(min_value=0, max_value=2**32 - 1)


def assert_round_trip(m: Module) -> str:
    """verify(m); print; parse; print again: identical text, and the parsed module verifies."""
    verify(m)
    s = str(m)
    m2 = parse(s)
    s2 = str(m2)
    assert s2 == s, f"print(parse(s)) != s\n--- s\n{s}\n--- print(parse(s))\n{s2}"
    verify(m2)
    return s


# ---------------------------------------------------------------- property: random valid programs
@SETTINGS
@given(seed=SEEDS)
def test_random_programs_round_trip(seed: int) -> None:
    m = generate_module(np.random.default_rng(seed))
    assert_round_trip(m)


def _corpus(seeds=range(40)) -> Iterator[Module]:
    return (generate_module(np.random.default_rng(s)) for s in seeds)


def test_corpus_covers_every_op_and_feature() -> None:
    """Completeness: the generated corpus uses every op of the registry and every feature of the
    format, so the round-trip property above really covers the whole text format (the corpus of up
    to 40 modules, generated until it has)."""
    seen_ops: set[str] = set()
    features: set[str] = set()
    wanted = {"gradient", "value_and_gradient", "multi-block", "block arguments", "bare return before a block label", "no results", "multiple results",
              "dialect", "loop (back edge)", "rank-0 type", "float nan", "float inf", "float 1e-05", "float -0.0",
              "empty list", "negative int", "dtype attribute", "bool attribute", "string attribute",
              *(f"dtype {d.value}" for d in DType)}
    for m in _corpus():
        if set(OPS) <= seen_ops and wanted <= features:
            break
        assert_round_trip(m)
        for f in m:
            if f.is_declaration:
                features.add("value_and_gradient" if f.gradient.with_value else "gradient")
                continue
            if len(f.blocks) > 1:
                features.add("multi-block")
            text = str(f)
            if re.search(r"^  return\n\^", text, flags=re.M):
                features.add("bare return before a block label")
            if any(b.args for b in f.blocks[1:]):
                features.add("block arguments")
            if not f.result_types:
                features.add("no results")
            if len(f.result_types) > 1:
                features.add("multiple results")
            for bi, b in enumerate(f.blocks):
                for ins in b.instrs:
                    seen_ops.add(ins.op.name)
                    if ins.dialect:
                        features.add("dialect")
                    if any(s.block in f.blocks[:bi + 1] for s in ins.successors):
                        features.add("loop (back edge)")
                    types = [v.type for v in ins.operands] + [r.type for r in ins.results]
                    if any(t.rank == 0 for t in types):
                        features.add("rank-0 type")
                    for a in ins.op.attrs:
                        v = ins.attrs.get(a.name)
                        if isinstance(v, float):
                            for name, test in (("nan", math.isnan), ("inf", math.isinf), ("1e-05", lambda x: x == 1e-05),
                                               ("-0.0", lambda x: x == 0 and math.copysign(1, x) < 0)):
                                if test(v):
                                    features.add(f"float {name}")
                        if isinstance(v, tuple) and not v and a.default != ():
                            features.add("empty list")
                        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                            features.add("negative int")
                        if isinstance(v, DType):
                            features.add("dtype attribute")
                        if isinstance(v, bool):
                            features.add("bool attribute")
                        if isinstance(v, str):
                            features.add("string attribute")
                    dts = {t.dtype for t in types}
                    features.update(f"dtype {d.value}" for d in dts)
    missing = set(OPS) - seen_ops
    assert not missing, f"ops never generated: {sorted(missing)}"
    assert wanted <= features, f"features never generated: {sorted(wanted - features)}"


@pytest.mark.parametrize("name", sampled_ops())
def test_each_op_sample_round_trips(name: str) -> None:
    """Every sample of every op, alone in a function, with its operands as parameters."""
    rng = np.random.default_rng(0)
    for k, s in enumerate(OPS[name].sample(rng)):
        t = instantiate(rng, name, s)
        f = Function(f"{name}_{k}", t.operand_types, [])
        ins = Builder(f.entry).create(name, f.params, t.attrs)
        f.result_types = [r.type for r in ins.results]
        Builder(f.entry).ret(*ins.results)
        assert_round_trip(Module([f]))


def test_structural_ops_are_the_only_ones_without_samples() -> None:
    without = {n for n, op in OPS.items() if op.sample is None}
    assert without == STRUCTURAL, f"ops without a sample generator: {sorted(without - STRUCTURAL)}"


# ---------------------------------------------------------------- attribute values
def _gelu_text(approx: str) -> str:
    lit = '"' + approx.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return f"func @f(%0: f32[3]) -> f32[3] {{\n  %1 = gelu %0 {{approximate={lit}}} : f32[3]\n  return %1\n}}\n"


@SETTINGS
@given(text=st.text(max_size=20))
def test_string_attributes_with_escapes_round_trip(text: str) -> None:
    # gelu's type rule only accepts "none"/"tanh", so this checks the syntax level: parse, print, parse.
    f = Function("f", [TensorType(DType.f32, (3,))], [TensorType(DType.f32, (3,))])
    b = Builder(f.entry)
    ins = b.create("gelu", f.params, {"approximate": text}, result_types=[TensorType(DType.f32, (3,))])
    b.ret(ins.results[0])
    s = str(Module([f]))
    m2 = parse(s)
    assert m2["f"].entry.instrs[0].attrs.get("approximate", "none") == text
    assert str(m2) == s


@SETTINGS
@given(value=st.floats(allow_nan=True, allow_infinity=True, width=64))
@example(value=-0.0)
@example(value=math.nan)
@example(value=1e-05)
def test_float_attributes_round_trip_exactly(value: float) -> None:
    f = Function("f", [TensorType(DType.f32, (2,))], [TensorType(DType.f32, (3,))])
    b = Builder(f.entry)
    b.ret(b.op("pad", f.params[0], low=[1], high=[0], value=value))
    s = assert_round_trip(Module([f]))
    got = parse(s)["f"].entry.instrs[0].attrs["value"]
    assert repr(got) == repr(value)  # bit-exact, -0.0 and nan included


@SETTINGS
@given(value=st.one_of(st.integers(-2**63, 2**63 - 1), st.booleans(), st.floats(allow_nan=True, width=64)))
def test_scalar_attributes_keep_their_kind(value) -> None:
    f = Function("f", [], [TensorType(DType.f64, (2,))])
    b = Builder(f.entry)
    b.ret(b.op("constant", value=value, shape=[2], dtype=DType.f64))
    s = assert_round_trip(Module([f]))
    got = parse(s)["f"].entry.instrs[0].attrs["value"]
    assert type(got) is type(value) and repr(got) == repr(value)


# ---------------------------------------------------------------- non-canonical input
_NAME_FIRST = "abcxyzABZ_"
_NAME_REST = "abcxyz019_.$"
_COMMENT_CHARS = "abc xyz%^@{}()[]=,:-/\\\"é"


def _name(rng: np.random.Generator, first: str, rest: str, taken) -> str:
    while True:
        n = "".join([rng.choice(list(first))] + list(rng.choice(list(rest), size=int(rng.integers(0, 8)))))
        if n not in taken:
            return n


def _reorder_attrs(toks, rng):
    """Shuffle the entries of every attribute dictionary ``{k=v, ...}`` (the printer reorders them)."""
    out, i = [], 0
    while i < len(toks):
        t = toks[i]
        if t.text == "{" and i + 2 < len(toks) and toks[i + 1].kind == "ident" and toks[i + 2].text == "=":
            j, depth, entries, cur = i + 1, 0, [], []
            while not (depth == 0 and toks[j].text == "}"):
                if toks[j].text == "[":
                    depth += 1
                elif toks[j].text == "]":
                    depth -= 1
                if depth == 0 and toks[j].text == ",":
                    entries.append(cur)
                    cur = []
                else:
                    cur.append(toks[j])
                j += 1
            entries.append(cur)
            rng.shuffle(entries)
            out.append(t)
            for k, e in enumerate(entries):
                if k:
                    out.append(Tok("punct", ",", 0, 0))
                out.extend(e)
            out.append(toks[j])
            i = j + 1
            continue
        out.append(t)
        i += 1
    return out


def noncanonical(text: str, rng: np.random.Generator) -> str:
    """Re-emit canonical text with fresh value and block names (per function), shuffled attributes,
    and random whitespace, newlines and comments between tokens."""
    toks = _reorder_attrs(tokenize(text)[:-1], rng)
    out: list[str] = []
    vmap: dict[str, str] = {}
    bmap: dict[str, str] = {}
    prev = None
    for t in toks:
        if t.kind == "ident" and t.text == "func":
            vmap, bmap = {}, {}  # names are scoped per function
        s = t.text
        if t.kind == "value":
            if s not in vmap:
                vmap[s] = "%" + _name(rng, _NAME_FIRST + "0123456789-", _NAME_REST + "-", {v[1:] for v in vmap.values()})
            s = vmap[s]
        elif t.kind == "block":
            if s not in bmap:
                bmap[s] = "^" + _name(rng, _NAME_FIRST, _NAME_REST, {v[1:] for v in bmap.values()})
            s = bmap[s]
        if prev is not None:
            tight = prev.kind in ("punct", "arrow") or t.kind in ("punct", "arrow")
            r = rng.random()
            if r < 0.1:
                comment = "".join(rng.choice(list(_COMMENT_CHARS), size=int(rng.integers(0, 15))))
                out.append(" //" + comment + "\n")
            elif r < 0.3:
                out.append(str(rng.choice(["\n", "\t", "   ", " \n  \n", "\r\n"])))
            elif tight and r < 0.7:
                pass
            else:
                out.append(" ")
        out.append(s)
        prev = t
    return "".join(out)


@SETTINGS
@given(seed=SEEDS)
def test_noncanonical_input_prints_canonically(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ops = sampled_ops()  # a third of the ops each time: the whitespace and layout are what vary here
    m = generate_module(rng, ops=sorted(rng.choice(ops, size=len(ops) // 3, replace=False).tolist()), functions=2)
    canonical = str(m)
    noisy = noncanonical(canonical, rng)
    m2 = parse(noisy)
    assert str(m2) == canonical, f"--- input\n{noisy}\n--- printed\n{m2}\n--- expected\n{canonical}"
    verify(m2)
    assert str(parse(str(m2))) == canonical


def test_noncanonical_attributes_are_normalised() -> None:
    text = """
    // a comment before anything
    func @main(%x: f32[3, 4],   %bias: f32[4]) -> (f32[3]) {   // trailing comment
      %y = add %x, %bias : f32[3,4]
      %s = reduce_sum %y {keepdims=false, axes=-1} : f32[3]   // default given, negative axis, one int
      %p = pad %s {value=0, high=[0], low=[1]} : f32[4]
      %t = slice %p {start=[1], stop=[4]} : f32[3]
      torch.free %p
      return %t
    }
    """
    m = parse(text)
    verify(m)
    assert str(m) == (
        "func @main(%0: f32[3,4], %1: f32[4]) -> f32[3] {\n"
        "  %2 = add %0, %1 : f32[3,4]\n"
        "  %3 = reduce_sum %2 {axes=[1]} : f32[3]\n"
        "  %4 = pad %3 {low=[1], high=[0], interior=[0]} : f32[4]\n"
        "  %5 = slice %4 {start=[1], stop=[4], step=[1]} : f32[3]\n"
        "  torch.free %4\n"
        "  return %5\n"
        "}\n")
    assert str(parse(str(m))) == str(m)


def test_return_without_operands_before_a_block_label() -> None:
    """``return`` with no operands followed by the next block's label: the label is not a branch target."""
    text = ("func @f(%0: bool[]) -> () {\n  cond_br %0, ^bb1, ^bb2(%0)\n^bb1:\n  return\n"
            "^bb2(%1: bool[]):\n  return\n}\n")
    m = parse(text)
    verify(m)
    assert str(m) == text
    assert isinstance(m["f"].blocks[2].args[0], BlockArg)


def test_negative_zero_is_not_taken_for_the_default() -> None:
    f = Function("f", [TensorType(DType.f32, (2,))], [TensorType(DType.f32, (3,))])
    b = Builder(f.entry)
    b.ret(b.op("pad", f.params[0], low=[1], high=[0], value=-0.0))
    s = assert_round_trip(Module([f]))
    assert "value=-0.0" in s
    b2 = Function("g", [TensorType(DType.f32, (2,))], [TensorType(DType.f32, (3,))])
    bb = Builder(b2.entry)
    bb.ret(bb.op("pad", b2.params[0], low=[1], high=[0], value=0.0))
    assert "value" not in assert_round_trip(Module([b2]))


def test_canonical_names_are_dense_and_in_order() -> None:
    """Names belong to the printer: parameters, block arguments and results are %0, %1, … in order
    of definition, blocks ^bb1, ^bb2, … in order."""
    for m in _corpus(range(2)):
        for f in m:
            if f.is_declaration:
                continue
            defs: list[int] = []
            labels: list[int] = []
            for line in str(f).splitlines():
                line = line.strip()
                if line.startswith("func") or line.startswith("^"):
                    defs += [int(x) for x in re.findall(r"%(\d+):", line)]
                    labels += [int(x) for x in re.findall(r"^\^bb(\d+)", line)]
                elif " = " in line:
                    defs += [int(x) for x in re.findall(r"%(\d+)", line.split(" = ", 1)[0])]
            assert defs == list(range(len(defs))), str(f)
            assert labels == list(range(1, len(f.blocks))), str(f)
