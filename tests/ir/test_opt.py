"""``python -m remat.opt``: parse, verify, run passes, print; errors on stderr with exit code 2 for bad input, 1 for a failing pass."""
from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from remat.ir import Builder, DType, Module, TensorType, parse, verify
from remat.opt import run
from remat.pipeline import PASSES

SRC = """// a comment
func @f(%x: f32[2,3]) -> f32[2] {
  %y = add %x, %x : f32[2,3]
  %s = reduce_sum %y {axes=-1} : f32[2]
  return %s
}
"""
CANON = """func @f(%0: f32[2,3]) -> f32[2] {
  %1 = add %0, %0 : f32[2,3]
  %2 = reduce_sum %1 {axes=[1]} : f32[2]
  return %2
}
"""


def opt(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = run(list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _append_neg(m: Module) -> Module:
    """Test pass: negate each function's first result before returning it (adds one instruction)."""
    m = m.clone()
    for f in m:
        if f.is_declaration:
            continue
        ret = f.blocks[-1].instrs[-1]
        b = Builder(f.blocks[-1], index=len(f.blocks[-1].instrs) - 1)
        ret.operands[0] = b.op("neg", ret.operands[0])
    return m


def _break_types(m: Module) -> Module:
    """Test pass producing invalid IR: declares every function to return f64[]."""
    m = m.clone()
    for f in m:
        f.result_types = [TensorType(DType.f64, ())]
    return m


def _crash(m: Module) -> Module:
    raise RuntimeError("boom")


@pytest.fixture
def test_passes():
    """Register passes for these tests only (removed afterwards, so other tests see the real registry)."""
    added = {"test-opt-neg": _append_neg, "test-opt-break": _break_types, "test-opt-crash": _crash}
    for k, fn in added.items():
        assert k not in PASSES
        PASSES[k] = fn
    yield
    for k in added:
        PASSES.pop(k, None)


def test_no_passes_prints_canonical_ir(tmp_path) -> None:
    p = tmp_path / "in.ir"
    p.write_text(SRC)
    assert opt(str(p)) == (0, CANON, "")


def test_stdin() -> None:
    assert opt("-", stdin=SRC) == (0, CANON, "")


def test_passes_run_in_order_and_output_verifies(test_passes) -> None:
    code, out, err = opt("-", "--passes", "test-opt-neg, test-opt-neg", stdin=SRC)
    assert code == 0 and err == ""
    verify(parse(out))
    assert out.count(" = neg ") == 2
    assert "return %4" in out


def test_print_after_all(test_passes) -> None:
    code, out, err = opt("-", "--passes", "test-opt-neg,test-opt-neg", "--print-after-all", stdin=SRC)
    assert code == 0
    heads = re.findall(r"^// ----- after (\S+) \((\d+) instructions, (\d+\.\d) ms\)$", err, flags=re.M)
    assert [(h[0], h[1]) for h in heads] == [("test-opt-neg", "4"), ("test-opt-neg", "5")], err
    chunks = re.split(r"^// ----- after .*\n", err, flags=re.M)[1:]
    assert len(chunks) == 2
    for chunk in chunks:
        verify(parse(chunk))
    assert chunks[1].rstrip("\n") + "\n" == out  # stdout holds only the final IR


def test_timing(test_passes) -> None:
    code, out, err = opt("-", "--passes", "test-opt-neg", "--timing", stdin=SRC)
    assert code == 0 and out.count(" = neg ") == 1
    assert re.fullmatch(r"// test-opt-neg: 3 -> 4 instructions \(\d+\.\d ms\)\n// total: 1 passes \(\d+\.\d ms\)\n", err), err


def test_unknown_pass_lists_the_available_ones() -> None:
    code, out, err = opt("-", "--passes", "nope", stdin=SRC)
    assert code == 2 and out == ""
    assert err.startswith("error: unknown pass 'nope'; available passes: ")
    listed = err.split("available passes: ")[1].strip().split(", ")
    assert listed == sorted(PASSES)


def test_unknown_pass_is_reported_before_reading_input(tmp_path) -> None:
    code, _, err = opt(str(tmp_path / "missing.ir"), "--passes", "nope")
    assert code == 2 and "unknown pass 'nope'" in err


def test_parse_error() -> None:
    code, out, err = opt("-", stdin="func @f(%0: f32[2]) -> f32[2] {\n  %1 = ad %0, %0 : f32[2]\n  return %1\n}\n")
    assert (code, out) == (2, "")
    assert err.startswith("error: <stdin>: line 2, column 8: unknown op 'ad'; did you mean")


def test_input_that_does_not_verify_and_no_verify() -> None:
    bad = "func @f(%0: f32[2]) -> f32[3] {\n  %1 = add %0, %0 : f32[3]\n  return %1\n}\n"
    code, out, err = opt("-", stdin=bad)
    assert (code, out) == (2, "")
    assert err.startswith("error: <stdin>: the input does not verify\nIR verification failed:\nin @f, entry block, instruction 'add'")
    assert opt("-", "--no-verify", stdin=bad) == (0, bad, "")


def test_pass_producing_invalid_ir_is_named(test_passes) -> None:
    code, out, err = opt("-", "--passes", "test-opt-neg,test-opt-break", stdin=SRC)
    assert (code, out) == (1, "")
    assert err.startswith("error: the IR after pass 'test-opt-break' does not verify (a bug in the pass)\n"), err
    assert "declared to return (f64[])" in err
    code, out, _ = opt("-", "--passes", "test-opt-break", "--no-verify", stdin=SRC)
    assert code == 0 and "-> f64[]" in out


def test_crashing_pass_is_named(test_passes) -> None:
    assert opt("-", "--passes", "test-opt-crash", stdin=SRC) == (1, "", "error: pass 'test-opt-crash' failed: RuntimeError: boom\n")


def test_missing_file(tmp_path) -> None:
    code, out, err = opt(str(tmp_path / "missing.ir"))
    assert (code, out) == (2, "")
    assert err.startswith(f"error: cannot read {tmp_path / 'missing.ir'}: ")


def test_module_entry_point() -> None:
    """``python -m remat.opt`` as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "remat.opt", "-"], input=SRC, capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (0, CANON, "")
    p = subprocess.run([sys.executable, "-m", "remat.opt", "-", "--passes", "nope"], input=SRC, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "unknown pass 'nope'" in p.stderr
