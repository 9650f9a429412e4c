"""simplify / fold / cse / dce / inline: each rule fires and keeps numerics, NaN/inf semantics
are kept, effects and random seeds are respected, inputs are never mutated, verify after each."""
from __future__ import annotations

import numpy as np
import pytest

from remat.ir import parse, verify
from remat.pipeline import get_pass, run_pipeline

from _interp import evaluate


def _run(text, names):
    m = parse(text)
    verify(m)
    before = str(m)
    out = run_pipeline(m, names).module  # verifies after each pass
    assert str(m) == before, "a pass mutated its input"
    return m, out


def _ops(f):
    return [i.op.name for i in f.instructions()]


def _same_numerics(m, out, args, name="f"):
    a = evaluate(m[name], args, m)
    b = evaluate(out[name], args, out)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


X = np.array([[1.5, -2.0, np.nan], [np.inf, 0.25, -np.inf]])

SIMPLIFY_CASES = {
    "mul_one": ("%1 = constant {value=1.0, dtype=f64} : f64[]\n  %2 = mul %0, %1 : f64[2,3]", []),
    "one_mul": ("%1 = constant {value=1.0, dtype=f64} : f64[]\n  %2 = mul %1, %0 : f64[2,3]", []),
    "add_zero": ("%1 = constant {value=0.0, dtype=f64} : f64[]\n  %2 = add %0, %1 : f64[2,3]", []),
    "zero_add": ("%1 = constant {value=0.0, dtype=f64} : f64[]\n  %2 = add %1, %0 : f64[2,3]", []),
    "sub_zero": ("%1 = constant {value=0.0, dtype=f64} : f64[]\n  %2 = sub %0, %1 : f64[2,3]", []),
    "div_one": ("%1 = constant {value=1.0, dtype=f64} : f64[]\n  %2 = div %0, %1 : f64[2,3]", []),
    "pow_one": ("%1 = constant {value=1.0, dtype=f64} : f64[]\n  %2 = pow %0, %1 : f64[2,3]", []),
    "neg_neg": ("%1 = neg %0 : f64[2,3]\n  %2 = neg %1 : f64[2,3]", []),
    "transpose_transpose": ("%1 = transpose %0 {perm=[1, 0]} : f64[3,2]\n  %2 = transpose %1 {perm=[1, 0]} : f64[2,3]", []),
    "transpose_identity": ("%1 = transpose %0 {perm=[0, 1]} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
    "reshape_reshape": ("%1 = reshape %0 {shape=[6]} : f64[6]\n  %2 = reshape %1 {shape=[2, 3]} : f64[2,3]", []),
    "reshape_same": ("%1 = reshape %0 {shape=[2, 3]} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
    "broadcast_same": ("%1 = broadcast %0 {shape=[2, 3]} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
    "cast_same": ("%1 = cast %0 {dtype=f64} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
    "select_true": ("%1 = constant {value=true, dtype=bool} : bool[]\n  %3 = neg %0 : f64[2,3]\n"
                    "  %2 = select %1, %0, %3 : f64[2,3]", []),
    "slice_full": ("%1 = slice %0 {start=[0, 0], stop=[2, 3], step=[1, 1]} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
    "reduce_no_axes": ("%1 = reduce_sum %0 {axes=[]} : f64[2,3]\n  %2 = copy %1 : f64[2,3]", ["copy"]),
}


def _prog(body):
    last = body.strip().splitlines()[-1].split("=")[0].strip()
    return f"func @f(%0: f64[2,3]) -> f64[2,3] {{\n  {body}\n  return {last}\n}}\n"


@pytest.mark.parametrize("case", sorted(SIMPLIFY_CASES))
def test_simplify_rule_fires_and_preserves_numerics(case):
    body, left = SIMPLIFY_CASES[case]
    m, out = _run(_prog(body), ["simplify", "dce"])
    assert _ops(out["f"]) == left + ["return"], str(out)
    _same_numerics(m, out, [X])


def test_broadcast_of_broadcast_and_composed_transposes():
    text = """func @f(%0: f64[3], %1: f64[2,3,4]) -> (f64[2,2,3], f64[4,2,3]) {
  %2 = broadcast %0 {shape=[2, 3]} : f64[2,3]
  %3 = broadcast %2 {shape=[2, 2, 3]} : f64[2,2,3]
  %4 = transpose %1 {perm=[1, 2, 0]} : f64[3,4,2]  // loc("attn", "model.py":7)
  %5 = transpose %4 {perm=[1, 2, 0]} : f64[4,2,3]  // loc("attn", "model.py":8)
  return %3, %5
}
"""
    m, out = _run(text, ["simplify", "dce"])
    assert _ops(out["f"]) == ["broadcast", "transpose", "return"]
    # what replaces an instruction keeps its provenance (a report names the layer a recomputation is of)
    assert str(out["f"].entry.instrs[1].loc) == str(m["f"].entry.instrs[3].loc) and out["f"].entry.instrs[1].loc.line == 8
    rng = np.random.default_rng(0)
    _same_numerics(m, out, [rng.standard_normal(3), rng.standard_normal((2, 3, 4))])


def test_a_chain_of_transposes_and_reshapes_that_keeps_the_stored_order_is_one_reshape():
    """``view_chain``: an NHWC value read as a sequence (to NCHW, ``flatten(2)``, ``transpose(1, 2)``)
    and a sequence read back as an NHWC image are reshapes of the value, with no copy; a chain that
    really reorders the elements keeps its transposes."""
    text = """func @f(%0: f64[2,3,4,5], %1: f64[2,12,5], %2: f64[2,3,4,5]) -> (f64[2,12,5], f64[2,3,4,5], f64[2,20,3], f64[5,2,12]) {
  %3 = transpose %0 {perm=[0, 3, 1, 2]} : f64[2,5,3,4]
  %4 = reshape %3 {shape=[2, 5, 12]} : f64[2,5,12]
  %5 = transpose %4 {perm=[0, 2, 1]} : f64[2,12,5]
  %6 = transpose %1 {perm=[0, 2, 1]} : f64[2,5,12]
  %7 = reshape %6 {shape=[2, 5, 3, 4]} : f64[2,5,3,4]
  %8 = transpose %7 {perm=[0, 2, 3, 1]} : f64[2,3,4,5]
  %9 = reshape %2 {shape=[2, 3, 20]} : f64[2,3,20]
  %10 = transpose %9 {perm=[0, 2, 1]} : f64[2,20,3]
  %11 = transpose %1 {perm=[2, 0, 1]} : f64[5,2,12]
  %12 = reshape %11 {shape=[10, 12]} : f64[10,12]
  %13 = reshape %12 {shape=[5, 2, 12]} : f64[5,2,12]
  return %5, %8, %10, %13
}
"""
    m, out = _run(text, ["simplify", "dce"])
    f = out["f"]
    assert _ops(f).count("transpose") == 2, str(out)  # %10 and %11 reorder elements
    assert [i.operands[0] for i in f.instructions() if i.op.name == "reshape"][:2] == list(f.params[:2])
    rng = np.random.default_rng(0)
    _same_numerics(m, out, [rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 12, 5)),
                            rng.standard_normal((2, 3, 4, 5))])


def test_a_pad_or_slice_between_a_transpose_and_its_inverse_runs_in_the_outer_layout():
    """``transpose_per_axis_transpose``: NHWC data transposed to NCHW, padded (TF-style, before a
    stride-2 convolution) or sliced, and transposed back is padded or sliced in NHWC, its per-axis
    attributes permuted; a second transpose that does not undo the first keeps both."""
    text = """func @f(%0: f64[2,5,6,3]) -> (f64[2,6,7,3], f64[2,2,3,3], f64[2,6,3,7]) {
  %1 = transpose %0 {perm=[0, 3, 1, 2]} : f64[2,3,5,6]
  %2 = pad %1 {low=[0, 0, 0, 1], high=[0, 0, 1, 0], interior=[0, 0, 0, 0], value=0.5} : f64[2,3,6,7]
  %3 = transpose %2 {perm=[0, 2, 3, 1]} : f64[2,6,7,3]
  %4 = slice %1 {start=[0, 0, 1, 0], stop=[2, 3, 5, 6], step=[1, 1, 2, 2]} : f64[2,3,2,3]
  %5 = transpose %4 {perm=[0, 2, 3, 1]} : f64[2,2,3,3]
  %6 = transpose %2 {perm=[0, 2, 1, 3]} : f64[2,6,3,7]
  return %3, %5, %6
}
"""
    m, out = _run(text, ["simplify", "dce"])
    f = out["f"]
    pads = [i for i in f.instructions() if i.op.name == "pad"]
    assert any(i.operands[0] is f.params[0] and list(i.attrs["low"]) == [0, 0, 1, 0] for i in pads), str(out)
    assert [i.operands[0] for i in f.instructions() if i.op.name == "slice"] == [f.params[0]]
    assert _ops(f).count("transpose") == 2, str(out)  # %6's pair does not cancel
    _same_numerics(m, out, [np.random.default_rng(1).standard_normal((2, 5, 6, 3))])


def test_matmul_reads_operands_transposed_in_their_last_two_dims_through_its_flags():
    text = """func @f(%0: f64[2,4,3], %1: f64[2,5,4], %2: f64[4,2,3]) -> (f64[2,3,5], f64[2,5,4], f64[2,3,3]) {
  %3 = transpose %0 {perm=[0, 2, 1]} : f64[2,3,4]
  %4 = transpose %1 {perm=[0, 2, 1]} : f64[2,4,5]
  %5 = matmul %3, %4 : f64[2,3,5]
  %6 = matmul %1, %0 : f64[2,5,3]
  %7 = transpose %6 {perm=[0, 2, 1]} : f64[2,3,5]
  %8 = matmul %7, %3 {transpose_a=true} : f64[2,5,4]
  %9 = transpose %2 {perm=[1, 0, 2]} : f64[2,4,3]
  %10 = matmul %3, %9 : f64[2,3,3]
  return %5, %8, %10
}
"""
    m, out = _run(text, ["simplify", "dce"])
    f = out["f"]
    mm = [i for i in f.instructions() if i.op.name == "matmul"]
    # Both swaps fold into the flags; a transposed flagged operand flips its flag back; a
    # permutation that moves a batch dim stays a materialised transpose.
    assert [(i.attrs["transpose_a"], i.attrs["transpose_b"]) for i in mm] == [(True, True), (False, False), (False, True), (True, False)]
    assert [i.attrs["perm"] for i in f.instructions() if i.op.name == "transpose"] == [(1, 0, 2)]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 5, 4)), rng.standard_normal((4, 2, 3))]
    for x, y in zip(evaluate(m["f"], args, m), evaluate(out["f"], args, out)):
        np.testing.assert_allclose(x, y, rtol=1e-12)


def test_matmul_over_a_batch_broadcast_operand_reads_the_operand_itself():
    # PyTorch's matmul decomposition: expand(weight, [b, in, out]) + bmm. The batch broadcast goes
    # (the product broadcasts batch axes itself); a broadcast of the matrix axes stays.
    text = """func @f(%0: f64[3,4,5], %1: f64[5,2], %2: f64[1,5], %3: f64[4,5]) -> (f64[3,4,2], f64[3,4,4], f64[3,4,4]) {
  %4 = broadcast %1 {shape=[3, 5, 2]} : f64[3,5,2]
  %5 = matmul %0, %4 : f64[3,4,2]
  %6 = broadcast %2 {shape=[3, 4, 5]} : f64[3,4,5]
  %7 = matmul %0, %6 {transpose_b=true} : f64[3,4,4]
  %8 = broadcast %3 {shape=[3, 4, 5]} : f64[3,4,5]
  %9 = matmul %8, %0 {transpose_b=true} : f64[3,4,4]
  return %5, %7, %9
}
"""
    m, out = _run(text, ["simplify", "dce"])
    f = out["f"]
    mm = [i for i in f.instructions() if i.op.name == "matmul"]
    assert [i.operands[1].type.shape for i in mm[:2]] == [(5, 2), (3, 4, 5)]
    assert mm[2].operands[0].type.shape == (4, 5)
    assert [i.operands[0].type.shape for i in f.instructions() if i.op.name == "broadcast"] == [(1, 5)]
    rng = np.random.default_rng(0)
    _same_numerics(m, out, [rng.standard_normal(s) for s in ((3, 4, 5), (5, 2), (1, 5), (4, 5))])


def test_elementwise_ops_read_a_broadcast_operand_in_place():
    """An element-wise op broadcasts its operands itself: a broadcast feeding it goes when the other
    operands span the result (a mean's cotangent spread over its input, as RMSNorm's backward has
    it); it stays where it sets the result's shape (a unary op; a sum with another [2,3,1])."""
    text = """func @f(%0: f64[2,3,1], %1: f64[2,3,4], %2: f64[1,1,4], %3: i64[2,3,4]) -> (f64[2,3,4], f64[2,3,4], f64[2,3,4], f64[2,3,4], f64[2,3,4]) {
  %4 = broadcast %0 {shape=[2, 3, 4]} : f64[2,3,4]
  %5 = mul %4, %1 : f64[2,3,4]
  %6 = broadcast %2 {shape=[2, 3, 4]} : f64[2,3,4]
  %7 = add %4, %6 : f64[2,3,4]
  %8 = relu %4 : f64[2,3,4]
  %9 = cast %3 {dtype=f64} : f64[2,3,4]
  %10 = gt %1, %9 : bool[2,3,4]
  %11 = select %10, %4, %9 : f64[2,3,4]
  %12 = add %4, %0 : f64[2,3,4]
  return %5, %7, %8, %11, %12
}
"""
    m, out = _run(text, ["simplify", "dce"])
    f = out["f"]
    ins = [i for i in f.instructions() if i.op.name not in ("return", "broadcast", "cast", "gt")]
    assert [i.op.name for i in ins] == ["mul", "add", "relu", "select", "add"]
    mul, add, relu, select, add2 = ins
    assert mul.operands[0] is f.params[0] and select.operands[1] is f.params[0]  # [2,3,1] read in place
    assert add.operands == [f.params[0], f.params[2]]  # [2,3,1] + [1,1,4] spans [2,3,4] without either copy
    assert relu.operands[0].type.shape == add2.operands[0].type.shape == (2, 3, 4)  # the broadcast sets the shape
    rng = np.random.default_rng(0)
    _same_numerics(m, out, [rng.standard_normal((2, 3, 1)), rng.standard_normal((2, 3, 4)), rng.standard_normal((1, 1, 4)),
                            rng.integers(-2, 3, (2, 3, 4))])


@pytest.mark.parametrize("body", [
    "%1 = constant {value=0.0, dtype=f64} : f64[]\n  %2 = mul %0, %1 : f64[2,3]",   # x*0 is NaN for inf/NaN
    "%2 = sub %0, %0 : f64[2,3]",                                                      # x-x is NaN for inf/NaN
    "%1 = constant {value=0.0, dtype=f64} : f64[]\n  %2 = div %1, %0 : f64[2,3]",
])
def test_nan_and_inf_semantics_are_kept(body):
    m, out = _run(_prog(body), ["simplify", "fold", "cse", "dce"])
    assert out["f"].entry.instrs[-2].op.name in ("mul", "sub", "div")
    _same_numerics(m, out, [X])
    assert np.isnan(evaluate(out["f"], [X], out)[0]).any()


def test_fold_splat_constants():
    text = """func @f(%0: f32[2,3]) -> f32[2,3] {
  %1 = constant {value=2.0} : f32[]
  %2 = constant {value=3.0} : f32[]
  %3 = mul %1, %2 : f32[]
  %4 = exp %3 : f32[]
  %5 = broadcast %4 {shape=[2, 3]} : f32[2,3]
  %6 = reduce_sum %5 {axes=[1], keepdims=true} : f32[2,1]
  %7 = add %0, %6 : f32[2,3]
  return %7
}
"""
    m, out = _run(text, ["fold", "dce"])
    assert _ops(out["f"]) == ["constant", "add", "return"]
    _same_numerics(m, out, [np.ones((2, 3), np.float32)])


def test_fold_never_folds_random_ops():
    text = """func @f() -> f32[2] {
  %0 = constant {value=7, dtype=i64} : i64[]
  %1 = uniform %0 {shape=[2]} : f32[2]
  return %1
}
"""
    _, out = _run(text, ["fold", "dce"])
    assert "uniform" in _ops(out["f"])


def test_cse_merges_pure_duplicates_and_same_seed_random_but_not_different_seeds():
    text = """func @f(%0: f32[4], %1: i64[], %2: i64[]) -> (f32[4], f32[4], f32[4], f32[4]) {
  %3 = exp %0 : f32[4]
  %4 = exp %0 : f32[4]
  %5 = add %3, %4 : f32[4]
  %6 = uniform %1 {shape=[4]} : f32[4]
  %7 = uniform %1 {shape=[4]} : f32[4]
  %8 = uniform %2 {shape=[4]} : f32[4]
  %9 = uniform %1 {shape=[4], high=2.0} : f32[4]
  return %5, %6, %7, %8
}
"""
    m, out = _run(text, ["cse"])
    ops = _ops(out["f"])
    assert ops.count("exp") == 1
    assert ops.count("uniform") == 3  # %7 merged into %6; %8 (other seed) and %9 (other attrs) kept
    ret = out["f"].entry.instrs[-1]
    assert ret.operands[1] is ret.operands[2] and ret.operands[3] is not ret.operands[1]


def test_cse_distinguishes_zero_from_negative_zero_and_dtypes():
    text = """func @f() -> (f32[], f32[], f64[]) {
  %0 = constant {value=0.0} : f32[]
  %1 = constant {value=-0.0} : f32[]
  %2 = constant {value=0.0, dtype=f64} : f64[]
  return %0, %1, %2
}
"""
    _, out = _run(text, ["cse"])
    assert _ops(out["f"]).count("constant") == 3


def test_cse_and_dce_keep_effects():
    text = """func @side(%0: f32[4]) -> f32[4] {
  %1 = exp %0 : f32[4]
  free %0
  return %1
}
func @f(%0: f32[4]) -> f32[4] {
  %1 = copy %0 : f32[4]
  %2 = call @side(%1) : f32[4]
  %3 = copy %0 : f32[4]
  %4 = call @side(%3) : f32[4]
  %5 = exp %0 : f32[4]
  return %2
}
"""
    m, out = _run(text, ["cse", "dce"])
    assert _ops(out["f"]).count("call") == 2  # calls to an impure callee: never merged or removed
    assert "exp" not in _ops(out["f"])        # the pure dead one goes
    assert "free" in _ops(out["side"])


def test_dce_drops_values_computed_only_to_be_freed():
    """A ``free`` is not a use: what a planned program computes only to free goes, with its free."""
    text = """func @f(%0: f32[4]) -> f32[4] {
  %1 = exp %0 : f32[4]
  %2 = neg %0 : f32[4]
  %3 = add %2, %2 : f32[4]
  free %2, %3
  %4 = mul %1, %1 : f32[4]
  free %1
  return %4
}
"""
    m, out = _run(text, ["dce"])
    assert _ops(out["f"]) == ["exp", "mul", "free", "return"]
    assert [o for i in out["f"].instructions() if i.op.name == "free" for o in i.operands] == [out["f"].entry.instrs[0].results[0]]
    _same_numerics(m, out, [np.arange(4, dtype=np.float32)])


def test_dce_removes_dead_block_arguments_and_unreachable_blocks():
    text = """func @f(%0: f32[], %1: bool[]) -> f32[] {
  cond_br %1, ^bb1(%0, %0), ^bb2
^bb1(%2: f32[], %3: f32[]):
  %4 = exp %2 : f32[]
  return %4
^bb2:
  return %0
^bb3:
  return %0
}
"""
    m, out = _run(text, ["dce"])
    f = out["f"]
    assert len(f.blocks) == 3 and len(f.blocks[1].args) == 1
    for c in (True, False):
        _same_numerics(m, out, [np.array(0.5, np.float32), np.array(c)])


def test_inline_single_and_multi_block_callees():
    text = """func @pick(%0: f32[3], %1: bool[]) -> f32[3] {
  cond_br %1, ^bb1, ^bb2
^bb1:
  %2 = exp %0 : f32[3]
  return %2
^bb2:
  return %0
}
func @sq(%0: f32[3]) -> f32[3] {
  %1 = mul %0, %0 : f32[3]
  return %1
}
func @f(%0: f32[3], %1: bool[]) -> f32[3] {
  %2 = call @sq(%0) : f32[3]
  %3 = call @pick(%2, %1) : f32[3]
  %4 = neg %3 : f32[3]
  return %4
}
"""
    m, out = _run(text, ["inline"])
    assert "call" not in _ops(out["f"])
    for c in (True, False):
        _same_numerics(m, out, [np.array([0.5, -1.0, 2.0], np.float32), np.array(c)])


def test_gradient_of_mlp_after_pipeline_has_no_dead_or_duplicate_instructions():
    from test_programs import MLP

    m, out = _run(MLP, ["grad", "simplify", "fold", "cse", "dce"])
    again = run_pipeline(out, ["cse", "dce"]).module
    assert str(again) == str(out)
    from remat.passes.cse import structural_key

    keys = [structural_key(i, {}) for i in out["g"].instructions() if i.results]
    assert len(keys) == len(set(keys))
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s) for s in [(8, 6), (6, 5), (5,), (5, 3), (3,), (8, 3)]]
    ref = evaluate(m.functions["loss"], args, m)  # noqa: F841  (the forward still runs)
    raw = run_pipeline(m, ["grad"]).module
    for a, b in zip(evaluate(raw["g"], args, raw), evaluate(out["g"], args, out)):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_passes_resolve_by_name():
    for n in ("grad", "simplify", "fold", "cse", "dce", "inline"):
        assert callable(get_pass(n))


def _split_gradient(spans):
    """g = pad(s0) + pad(s1) + pad(s2): the three slices of x [2, 6] (spans on axis 1) padded back."""
    lines, acc = [], None
    for k, (a, b) in enumerate(spans):
        lines.append(f"%{1 + 2 * k} = slice %0 {{start=[0, {a}], stop=[2, {b}], step=[1, 1]}} : f64[2,{b - a}]")
        lines.append(f"%{2 + 2 * k} = pad %{1 + 2 * k} {{low=[0, {a}], high=[0, {6 - b}]}} : f64[2,6]")
        if acc is None:
            acc = f"%{2 + 2 * k}"
        else:
            lines.append(f"%{10 + k} = add {acc}, %{2 + 2 * k} : f64[2,6]")
            acc = f"%{10 + k}"
    body = "\n  ".join(lines)
    return f"func @f(%0: f64[2,6]) -> f64[2,6] {{\n  {body}\n  return {acc}\n}}\n"


def test_adjacent_zero_pads_summed_become_one_concat():
    """The gradient of a tensor split in three (q, k, v): one join, no padded copies, same values."""
    m, out = _run(_split_gradient([(4, 6), (2, 4), (0, 2)]), ["simplify", "dce"])
    assert _ops(out["f"]) == ["slice", "slice", "slice", "concat", "return"], str(out)
    x = np.arange(12.0).reshape(2, 6) - 5.5
    _same_numerics(m, out, [x])


def test_pads_with_a_gap_are_left_alone():
    m, out = _run(_split_gradient([(0, 2), (3, 5)]), ["simplify", "dce"])
    assert _ops(out["f"]).count("pad") == 2 and "concat" not in _ops(out["f"])
