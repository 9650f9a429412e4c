"""Negative tests of the verifier: each error names the function, block and instruction, says what is
wrong, and shows the offending instruction (marked ``-->``) among its printed neighbours."""
from __future__ import annotations

import pytest

from remat.ir import Builder, DType, Function, GradientSpec, Module, TensorType, VerificationError, parse, verify
from remat.ir.core import Successor

F2 = TensorType(DType.f32, (2,))


def errors_of(m: Module | Function) -> list[str]:
    with pytest.raises(VerificationError) as info:
        verify(m)
    e = info.value
    assert str(e).startswith("IR verification failed:\n")
    return e.errors


def assert_one_error(m, where: str, fragments: list[str], marked: str | None = None) -> str:
    """Exactly one error; it starts with ``where`` (function, block, instruction), contains the
    fragments, and marks the line ``marked`` of the printed function with ``-->``."""
    errs = errors_of(m)
    assert len(errs) == 1, "\n\n".join(errs)
    e = errs[0]
    assert e.startswith(where + ": "), e
    for frag in fragments:
        assert frag in e, f"{frag!r} not in:\n{e}"
    if marked is not None:
        arrow = [line for line in e.splitlines() if line.startswith("-->")]
        if marked.startswith("func @") and "gradient" in marked:
            assert arrow == ["--> " + marked], e  # a declaration is one line: it is the context
        else:
            assert arrow == ["-->   " + marked if not marked.startswith("^") else "--> " + marked], e
            # The context shows neighbours too, not just the faulty line.
            assert len(e.splitlines()) >= 3, e
    return e


# (id, text, where, fragments, the marked line)
TEXT_CASES = [
    ("declared result type wrong",
     "func @f(%0: f32[2]) -> f32[3] {\n  %1 = add %0, %0 : f32[3]\n  return %1\n}\n",
     "in @f, entry block, instruction 'add'",
     ["result type (f32[3]) does not match the type rule", "operands (f32[2], f32[2]) give (f32[2])"],
     "%1 = add %0, %0 : f32[3]"),
    ("operand types rejected by the rule",
     "func @f(%0: f32[2], %1: f64[2]) -> f32[2] {\n  %2 = add %0, %1 : f32[2]\n  return %2\n}\n",
     "in @f, entry block, instruction 'add'",
     ["'add' operands must have the same dtype", "insert a cast"],
     "%2 = add %0, %1 : f32[2]"),
    ("use in a block not dominated by the definition",
     "func @f(%0: f32[2], %1: bool[]) -> f32[2] {\n  cond_br %1, ^bb1, ^bb2\n^bb1:\n  %2 = neg %0 : f32[2]\n"
     "  br ^bb3\n^bb2:\n  br ^bb3\n^bb3:\n  return %2\n}\n",
     "in @f, block ^bb3, instruction 'return'",
     ["operand 0 (%2) is defined in block ^bb1, which does not dominate its use"],
     "return %2"),
    ("use before definition in a block",
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = neg %2 : f32[2]\n  %2 = neg %0 : f32[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'neg'",
     ["operand 0 (%2) is used before its definition"],
     "%1 = neg %2 : f32[2]"),
    ("branch argument count",
     "func @f(%0: f32[2]) -> f32[2] {\n  br ^bb1(%0, %0)\n^bb1(%1: f32[2]):\n  return %1\n}\n",
     "in @f, entry block, instruction 'br'",
     ["branch to block ^bb1 passes (f32[2], f32[2]) but the block takes (f32[2])"],
     "br ^bb1(%0, %0)"),
    ("branch argument type",
     "func @f(%0: f32[2], %1: f64[2]) -> f32[2] {\n  br ^bb1(%1)\n^bb1(%2: f32[2]):\n  return %2\n}\n",
     "in @f, entry block, instruction 'br'",
     ["branch to block ^bb1 passes (f64[2]) but the block takes (f32[2])"],
     "br ^bb1(%1)"),
    ("cond_br condition type",
     "func @f(%0: f32[2]) -> f32[2] {\n  cond_br %0, ^bb1, ^bb1\n^bb1:\n  return %0\n}\n",
     "in @f, entry block, instruction 'cond_br'",
     ["'cond_br' condition must be bool[], got f32[2]"],
     "cond_br %0, ^bb1, ^bb1"),
    ("return type mismatch",
     "func @f(%0: f32[2]) -> f64[2] {\n  return %0\n}\n",
     "in @f, entry block, instruction 'return'",
     ["returns (f32[2]) but @f is declared to return (f64[2])"],
     "return %0"),
    ("missing terminator",
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = neg %0 : f32[2]\n}\n",
     "in @f, entry block, instruction 'neg'",
     ["block does not end with a terminator (return, br or cond_br)"],
     "%1 = neg %0 : f32[2]"),
    ("empty block",
     "func @f(%0: f32[2]) -> f32[2] {\n  br ^bb1\n^bb1:\n}\n",
     "in @f, block ^bb1",
     ["block does not end with a terminator"],
     "^bb1:"),
    ("terminator in the middle",
     "func @f(%0: f32[2]) -> f32[2] {\n  return %0\n  %1 = neg %0 : f32[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'return'",
     ["terminator in the middle of a block"],
     "return %0"),
    ("call to an unknown function",
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = call @g(%0) : f32[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'call'",
     ["call to unknown function @g"],
     "%1 = call @g(%0) : f32[2]"),
    ("call with wrong argument types",
     "func @g(%0: f64[2]) -> f32[2] {\n  %1 = cast %0 {dtype=f32} : f32[2]\n  return %1\n}\n"
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = call @g(%0) : f32[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'call'",
     ["call passes (f32[2]) but @g takes (f64[2])"],
     "%1 = call @g(%0) : f32[2]"),
    ("call with wrong result types",
     "func @g(%0: f32[2]) -> f32[2] {\n  return %0\n}\n"
     "func @f(%0: f32[2]) -> f64[2] {\n  %1 = call @g(%0) : f64[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'call'",
     ["call results (f64[2]) do not match @g's results (f32[2])"],
     "%1 = call @g(%0) : f64[2]"),
    ("call to a gradient declaration",
     "func @g(%0: f32[2]) -> f32[2] {\n  return %0\n}\nfunc @dg = gradient @g wrt 0\n"
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = call @dg(%0) : f32[2]\n  return %1\n}\n",
     "in @f, entry block, instruction 'call'",
     ["call to @dg, a gradient declaration not yet differentiated (run the 'grad' pass)"],
     "%1 = call @dg(%0) : f32[2]"),
    ("use after free",
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = neg %0 : f32[2]\n  free %1\n  %2 = neg %1 : f32[2]\n  return %2\n}\n",
     "in @f, entry block, instruction 'neg'",
     ["operand 0 is used after it was freed"],
     "%2 = neg %1 : f32[2]"),
    ("free twice",
     "func @f(%0: f32[2]) -> f32[2] {\n  %1 = neg %0 : f32[2]\n  free %1\n  free %1\n  return %0\n}\n",
     "in @f, entry block, instruction 'free'",
     ["operand 0 is used after it was freed"],
     None),
    ("use after an in-place update",
     "func @f(%0: f32[2], %1: f32[2], %2: f32[2], %3: i64[], %4: f64[4], %5: bool[]) -> f32[2] {\n"
     "  %6, %7 = sgd_step %0, %1, %2, %3, %4, %5 : f32[2], f32[2]\n"
     "  %8 = neg %0 : f32[2]\n  return %8\n}\n",
     "in @f, entry block, instruction 'neg'",
     ["operand 0 is used after 'sgd_step' overwrote it in place", "use that instruction's result instead"],
     "%8 = neg %0 : f32[2]"),
    ("gradient of an unknown function",
     "func @f(%0: f32[2]) -> f32[2] {\n  return %0\n}\nfunc @g = gradient @h wrt 0\n",
     "in @g", ["gradient of unknown function @h", "the module has @f, @g"],
     "func @g = gradient @h wrt 0"),
    ("gradient wrt index out of range",
     "func @f(%0: f32[2]) -> f32[2] {\n  return %0\n}\nfunc @g = gradient @f wrt 0, 3\n",
     "in @g", ["'wrt' index 3 is out of range; @f has 1 parameters (valid: 0..0)"],
     "func @g = gradient @f wrt 0, 3"),
    ("gradient wrt repeated index",
     "func @f(%0: f32[2], %1: f32[2]) -> f32[2] {\n  return %0\n}\nfunc @g = value_and_gradient @f wrt 1, 1\n",
     "in @g", ["'wrt' repeats an index: [1, 1]"],
     "func @g = value_and_gradient @f wrt 1, 1"),
]


@pytest.mark.parametrize("text, where, fragments, marked", [c[1:] for c in TEXT_CASES], ids=[c[0] for c in TEXT_CASES])
def test_verifier_error(text: str, where: str, fragments: list[str], marked: str | None) -> None:
    m = parse(text)  # parsing does not verify: these are all syntactically valid
    if marked is None:
        errs = errors_of(m)
        assert any(e.startswith(where) and all(f in e for f in fragments) for e in errs), "\n\n".join(errs)
    else:
        assert_one_error(m, where, fragments, marked)


def _fn(name: str = "f", params=(F2,), results=(F2,)) -> Function:
    return Function(name, list(params), list(results))


def test_value_from_another_function() -> None:
    g = _fn("g")
    Builder(g.entry).ret(g.params[0])
    f = _fn("f")
    b = Builder(f.entry)
    b.ret(b.op("neg", g.params[0]))  # g's parameter used in f
    m = Module([g, f])
    assert_one_error(m, "in @f, entry block, instruction 'neg'",
                     ["operand 0 is not defined in @f (a value from another function or a deleted instruction)"],
                     "%1 = neg %<undefined f32[2]> : f32[2]")


def test_branch_to_the_entry_block() -> None:
    f = _fn()
    body = f.add_block()
    Builder(f.entry).br(body)
    Builder(body).br(f.entry, f.params[0])
    assert_one_error(Module([f]), "in @f, block ^bb1, instruction 'br'",
                     ["branch to the entry block (the entry block has no predecessors)"], "br ^bb0(%0)")


def test_branch_to_a_block_of_another_function() -> None:
    g = _fn("g")
    other = g.add_block()
    Builder(g.entry).br(other)
    Builder(other).ret(g.params[0])
    f = _fn()
    Builder(f.entry).br(other)
    errs = errors_of(Module([g, f]))
    assert len(errs) == 1 and errs[0].startswith("in @f, entry block, instruction 'br': branch to a block outside the function"), errs


def test_terminator_with_wrong_number_of_targets() -> None:
    f = _fn(params=(F2, TensorType(DType.bool, ())))
    b1 = f.add_block()
    Builder(f.entry).create("cond_br", [f.params[1]], successors=[Successor(b1, [])])
    Builder(b1).ret(f.params[0])
    assert_one_error(Module([f]), "in @f, entry block, instruction 'cond_br'",
                     ["'cond_br' needs 2 branch target(s), has 1"], "cond_br %1, ^bb1")


def test_attributes_not_in_normal_form() -> None:
    f = Function("f", [TensorType(DType.f32, (2, 3))], [TensorType(DType.f32, (2,))])
    b = Builder(f.entry)
    r = b.op("reduce_sum", f.params[0], axes=[-1])
    r.instr.attrs["axes"] = (-1,)  # a pass that bypassed the Builder's normalisation
    b.ret(r)
    assert_one_error(Module([f]), "in @f, entry block, instruction 'reduce_sum'",
                     ["are not in normal form", "'axes': (1,)"], "%1 = reduce_sum %0 {axes=[-1]} : f32[2]")


def test_gradient_with_empty_wrt() -> None:
    f = _fn()
    Builder(f.entry).ret(f.params[0])
    g = Function("g", gradient=GradientSpec("f", ()))
    errs = errors_of(Module([f, g]))
    assert errs == ["in @g: 'wrt' is empty; name at least one parameter index of @f\n--> func @g = gradient @f wrt"]


def test_every_problem_is_reported() -> None:
    m = parse("func @f(%0: f32[2]) -> f64[2] {\n  %1 = add %0, %0 : f32[3]\n  return %1\n}\n"
              "func @g = gradient @nope wrt 0\n")
    errs = errors_of(m)
    assert len(errs) == 3, errs
    assert [e.split(":")[0] for e in errs] == ["in @f, entry block, instruction 'add'",
                                              "in @f, entry block, instruction 'return'", "in @g"]


def test_verify_a_function_outside_a_module() -> None:
    f = _fn()
    Builder(f.entry).ret(f.params[0])
    assert verify(f) is f
    g = _fn("g")
    b = Builder(g.entry)
    b.ret(b.call(f, g.params[0])[0])
    # Without a module, callees cannot be resolved.
    assert_one_error(g, "in @g, entry block, instruction 'call'", ["call to unknown function @f"], "%1 = call @f(%0) : f32[2]")
    m = Module([f, g])
    assert verify(m) is m


def test_unreachable_block_may_use_anything_defined() -> None:
    """Dominance is only checked in reachable blocks (unreachable code is dead, not wrong)."""
    m = parse("func @f(%0: f32[2]) -> f32[2] {\n  return %0\n^bb1:\n  %1 = neg %0 : f32[2]\n  return %1\n}\n")
    verify(m)


def test_names_the_text_format_cannot_write() -> None:
    """A valid module must print to text that parses: function names and dialects are identifiers."""
    f = _fn("<lambda>")
    Builder(f.entry).ret(f.params[0])
    errs = errors_of(Module([f]))
    assert errs == ["function name '<lambda>' cannot be written in the text format; "
                    "valid names match [A-Za-z_][A-Za-z0-9_.$]*"]
    g = _fn("g")
    b = Builder(g.entry)
    b.ret(b.create("neg", g.params, dialect="my.backend").results[0])
    assert_one_error(Module([g]), "in @g, entry block, instruction 'neg'",
                     ["dialect 'my.backend' cannot be written in the text format"], "%1 = my.backend.neg %0 : f32[2]")


def test_attribute_of_the_wrong_python_type_is_not_normal_form() -> None:
    """An int stored in a float attribute (bypassing the Builder) would print as `1` and parse back as 1.0."""
    f = Function("f", [F2], [TensorType(DType.f32, (3,))])
    b = Builder(f.entry)
    r = b.op("pad", f.params[0], low=[1], high=[0], value=1.0)
    r.instr.attrs["value"] = 1
    b.ret(r)
    assert_one_error(Module([f]), "in @f, entry block, instruction 'pad'", ["are not in normal form", "'value': 1.0"],
                     "%1 = pad %0 {low=[1], high=[0], interior=[0], value=1} : f32[3]")


def test_the_type_rule_memo_tells_apart_what_the_text_format_does() -> None:
    """The verifier memoises each instruction's type rule; a value equal to a checked one but of
    another kind (1.0 and 1, 1 and True, 0.0 and -0.0) is checked afresh, never taken as already valid."""

    def pad(value) -> Module:
        f = Function("f", [F2], [TensorType(DType.f32, (3,))])
        b = Builder(f.entry)
        r = b.op("pad", f.params[0], low=[1], high=[0], value=1.0)
        r.instr.attrs["value"] = value
        b.ret(r)
        return Module([f])

    def reduce(axes) -> Module:
        f = Function("f", [TensorType(DType.f32, (2, 3))], [TensorType(DType.f32, (2,))])
        b = Builder(f.entry)
        r = b.op("reduce_sum", f.params[0], axes=[1])
        r.instr.attrs["axes"] = axes
        b.ret(r)
        return Module([f])

    for _ in range(2):  # the second round reads the memo
        verify(pad(1.0))
        assert "are not in normal form" in errors_of(pad(1))[0]
        verify(pad(0.0)), verify(pad(-0.0))
        verify(reduce((1,)))
        assert "must be a list of integers" in errors_of(reduce((True,)))[0]
