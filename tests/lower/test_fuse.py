"""The fuse pass: golden rewrite of hand-written IR (frees, constants, escaping outputs), the peak
never rises, in-place updates split a group, the printed result round-trips, and on a real training
program the fused step is bit-identical with predicted == measured peak."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from remat.ir import Module, parse, verify
from remat.lower.fuse import FuseStats, find_groups, fuse, fuse_function
from remat.plan.simulator import predict_peak
from remat.pipeline import get_pass
from remat.runtime.vm import VM

SRC = """func @f(%0: f32[4,8], %1: f32[8], %2: f32[4,1]) -> (f32[4,8], f32[4,8]) {
  %3 = constant {value=0.0} : f32[]
  %4 = add %0, %1 : f32[4,8]
  %5 = mul %4, %2 : f32[4,8]
  free %0
  %6 = relu %5 : f32[4,8]
  free %4
  %7 = reduce_sum %6 {axes=[1], keepdims=true} : f32[4,1]
  %8 = gt %5, %3 : bool[4,8]
  %9 = select %8, %6, %3 : f32[4,8]
  free %5
  return %9, %6
}
"""

EXPECTED = """func @f(%0: f32[4,8], %1: f32[8], %2: f32[4,1]) -> (f32[4,8], f32[4,8]) {
  %3, %4 = fused %0, %1, %2 {body="%3 = add(%0, %1) %4 = mul(%3, %2) %5 = relu(%4) -> %4, %5"} : f32[4,8], f32[4,8]
  free %0
  %5 = reduce_sum %4 {axes=[1], keepdims=true} : f32[4,1]
  %6 = fused %3, %4 {body="%2 = constant() {value=0.0} %3 = gt(%0, %2) %4 = select(%3, %1, %2) -> %4"} : f32[4,8]
  free %3
  return %6, %4
}
"""


def run_both(m: Module, out: Module, args) -> None:
    """Same outputs bit for bit; predicted == measured peak; the fused peak is not higher."""
    a, sa = VM(m, dialects=("torch", "numpy")).run("f", *args)
    b, sb = VM(out).run("f", *args)
    for x, y in zip(a, b):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    assert sa.peak_bytes == predict_peak(m["f"]) and sb.peak_bytes == predict_peak(out["f"])
    assert sb.peak_bytes <= sa.peak_bytes


def test_golden_rewrite() -> None:
    m = parse(SRC)
    st = FuseStats()
    out = fuse(m, stats=st)
    verify(out)
    assert str(out) == EXPECTED
    assert (st.groups, st.fused_instructions, st.instructions_before, st.instructions_after) == (2, 5, 11, 6)
    assert str(parse(str(out))) == str(out)  # round trip of the fused program
    rng = np.random.default_rng(0)
    run_both(m, out, [rng.standard_normal(s).astype(np.float32) for s in ((4, 8), (8,), (4, 1))])


def test_registered_pass() -> None:
    assert str(get_pass("fuse")(parse(SRC))) == EXPECTED


def test_group_that_would_raise_the_peak_is_dropped() -> None:
    """Fusing mul+neg would keep both 4 MB operands of the mul alive across the 8 MB exp, up to the neg."""
    src = """func @f(%0: f32[1000,1000], %1: f32[2000,1000], %2: f32[1000,1000]) -> (f32[1000,1000], f32[2000,1000]) {
  %3 = exp %0 : f32[1000,1000]
  %4 = exp %2 : f32[1000,1000]
  %5 = mul %3, %4 : f32[1000,1000]
  free %3, %4
  %6 = exp %1 : f32[2000,1000]
  %7 = neg %5 : f32[1000,1000]
  return %7, %6
}
"""
    m = parse(src)
    assert len(find_groups(m["f"])) == 1
    st = FuseStats()
    out = fuse(m, stats=st)
    assert st.dropped_for_peak == 1 and st.groups == 0
    assert str(out) == str(m)


def test_peak_is_kept_when_fusion_lowers_it() -> None:
    src = """func @f(%0: f32[500,500], %1: f32[500]) -> f32[500,500] {
  %2 = add %0, %1 : f32[500,500]
  %3 = mul %2, %2 : f32[500,500]
  %4 = sub %3, %2 : f32[500,500]
  %5 = neg %4 : f32[500,500]
  return %5
}
"""
    # Unfused, %2 and %3 are live at once (sub reads both; it and neg then write over %3: remat.ir.reuse);
    # fused, only the result is.
    m = parse(src)
    out = fuse(m)
    assert sum(i.op.name == "fused" for i in out["f"].instructions()) == 1
    assert predict_peak(out["f"]) < predict_peak(m["f"])
    rng = np.random.default_rng(1)
    run_both(m, out, [rng.standard_normal((500, 500)).astype(np.float32), rng.standard_normal(500).astype(np.float32)])


def test_inplace_update_splits_the_group() -> None:
    """A member reads %1, which sgd_step then overwrites: the fused instruction cannot move past it."""
    src = """func @f(%0: f32[8], %1: f32[8], %2: f32[8], %3: i64[], %20: f64[4], %21: bool[]) -> (f32[8], f32[8], f32[8]) {
  %4 = mul %0, %1 : f32[8]
  %5, %6 = sgd_step %1, %0, %2, %3, %20, %21 : f32[8], f32[8]
  %7 = add %4, %0 : f32[8]
  %8 = neg %7 : f32[8]
  return %8, %5, %6
}
"""
    m = parse(src)
    out = fuse(m)
    verify(out)
    names = [i.op.name for i in out["f"].instructions()]
    assert names == ["mul", "sgd_step", "fused", "return"]


def test_inplace_update_through_a_view_splits_the_group() -> None:
    """A member reads a view of %1 (reshape), and sgd_step then overwrites %1 itself: same rule."""
    src = """func @f(%0: f32[8], %1: f32[8], %2: f32[8], %3: i64[], %20: f64[4], %21: bool[]) -> (f32[2,4], f32[8], f32[8]) {
  %4 = reshape %1 {shape=[2, 4]} : f32[2,4]
  %5 = reshape %0 {shape=[2, 4]} : f32[2,4]
  %6 = mul %5, %4 : f32[2,4]
  %7, %8 = sgd_step %1, %0, %2, %3, %20, %21 : f32[8], f32[8]
  %9 = add %6, %5 : f32[2,4]
  %10 = neg %9 : f32[2,4]
  return %10, %7, %8
}
"""
    m = parse(src)
    out = fuse(m)
    verify(out)
    names = [i.op.name for i in out["f"].instructions()]
    assert names.index("mul") < names.index("sgd_step") < names.index("fused")


def test_non_fusible_path_between_members_is_not_a_cycle() -> None:
    """%4 -> reduce_sum -> %6: fusing %4 and %6 together would need reduce_sum inside: two groups or none."""
    src = """func @f(%0: f32[4,8]) -> f32[4,8] {
  %1 = neg %0 : f32[4,8]
  %2 = abs %1 : f32[4,8]
  %3 = reduce_sum %2 {axes=[1], keepdims=true} : f32[4,1]
  %4 = mul %2, %3 : f32[4,8]
  %5 = neg %4 : f32[4,8]
  return %5
}
"""
    m = parse(src)
    out = fuse(m)
    verify(out)
    assert [i.op.name for i in out["f"].instructions()] == ["fused", "reduce_sum", "fused", "return"]
    run_both(m, out, [np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zoo_training_program_fuses_bit_identically(precision: str) -> None:
    """fp32, and bf16 (its casts fused into the residual adds, the attention's scale into its mask),
    run by the numba dialect's kernels bit for bit as the nodes one by one."""
    import remat
    from remat import zoo

    model, ex, loss_fn = zoo.make("gpt", "tiny", dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    step = remat.compile(model, ex, loss_fn, optimizer=opt, dialects=("torch", "numpy"),  # no numba: unfused
                         precision=precision)
    prog = step.program
    assert not any(i.op.name == "fused" for i in prog.instructions())
    st = FuseStats()
    fused = fuse(prog, stats=st)
    verify(fused)
    assert st.groups > 0 and st.instructions_after < st.instructions_before
    kinds = {v.type.dtype.value for i in fused.instructions() if i.op.name == "fused" for v in i.operands}
    assert precision != "bf16" or "bf16" in kinds
    ran = VM(Module([fused])).function(fused.name).entry.instrs
    assert all(i.dialect == "numba" for i in ran if i.op.name == "fused")
    assert str(parse(str(Module([fused])))) == str(Module([fused]))
    oa, sa = VM(Module([prog.clone()])).run(prog.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
    ob, sb = VM(Module([fused])).run(fused.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
    assert all(torch.equal(x, y) for x, y in zip(oa, ob))
    assert sa.peak_bytes == predict_peak(prog) and sb.peak_bytes == predict_peak(fused) <= sa.peak_bytes


def test_compile_fuses_its_program_and_times_the_stages() -> None:
    """remat.compile fuses the lowered program when the numba dialect is enabled, compiles the kernels
    as a setup stage, and the step keeps predicted == measured peak and eager's numbers."""
    import remat
    from remat import zoo

    # U-Net: its normalisation and activation backward chains fuse (a GPT's no longer do: the
    # gradient of its q/k/v split is one concat, not a sum of padded pieces).
    model, ex, loss_fn = zoo.make("unet", "tiny")
    ref = copy.deepcopy(model)
    step = remat.compile(model, ex, loss_fn)
    ran = step.vm.function(step.program.name).entry.instrs  # the VM's copy carries the chosen dialects
    assert any(i.op.name == "fused" and i.dialect == "numba" for i in ran)
    stages = step.report().stage_seconds
    assert "fuse" in stages and "compile kernels" in stages
    loss = step(*ex)
    assert step.report().measured_peak == step.report().predicted_peak
    want = loss_fn(ref(*ex[:-1]), ex[-1])
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_group_whose_values_nobody_reads_is_left_alone() -> None:
    """Values only freed (dead computations a rematerialised program can hold) form no fused op."""
    src = """func @f(%0: f32[4,8], %1: f32[4,8]) -> f32[4,8] {
  %2 = mul %0, %1 : f32[4,8]
  %3 = add %2, %1 : f32[4,8]
  free %3
  %4 = neg %0 : f32[4,8]
  return %4
}
"""
    m = parse(src)
    out = fuse(m)
    verify(out)
    assert "fused" not in [i.op.name for i in out["f"].instructions()]


def test_unfused_instructions_keep_their_provenance() -> None:
    """Instructions the pass leaves alone keep their source location and what they recompute (the
    recomputed value mapped to the fused program; None when that value vanished into a group)."""
    from remat.ir.core import Loc

    m = parse(SRC)
    f = m["f"]
    red = next(i for i in f.entry.instrs if i.op.name == "reduce_sum")
    red.loc = Loc("head.norm", "model.py", 12)
    red.recomputes = next(i for i in f.entry.instrs if i.op.name == "relu").result  # a group output
    out = fuse(m)["f"]
    red2 = next(i for i in out.entry.instrs if i.op.name == "reduce_sum")
    assert red2.loc == Loc("head.norm", "model.py", 12)
    assert red2.recomputes is red2.operands[0]  # the relu's value, now the fused instruction's 2nd result


def test_a_judge_undoes_only_the_groups_whose_span_it_rejects() -> None:
    """With a judge (the allocator bound under a budget, in remat.compile), a group whose span
    holds a rejected instruction stays unfused and the other groups are kept."""
    m = parse(SRC)
    fn = m["f"]
    all_groups = fuse(fn)
    assert [i.op.name for i in all_groups.instructions()].count("fused") == 2
    seen: list[int] = []

    def judge(out):  # rejects the first fused instruction while there is one
        seen.append(len(out.entry.instrs))
        return next((k for k, i in enumerate(out.entry.instrs) if i.op.name == "fused"
                     and "relu" in i.attrs["body"]), None)

    out = fuse_function(fn, judge=judge)
    verify(Module([out]))
    names = [i.op.name for i in out.instructions()]
    assert names.count("fused") == 1 and "relu" in names and len(seen) == 2
    run_both(m, Module([out]), [np.random.default_rng(4).standard_normal(t.shape).astype(np.float32) for t in fn.param_types])


def test_a_rejection_outside_every_rewrite_undoes_them_all():
    """keep_accepted drops the rewrites whose span holds a rejected instruction; when a rejection
    falls outside every span (rewrites that together moved a high-water mark), it keeps none, and
    the program runs as planned instead of failing the compile."""
    from remat.lower.fuse import keep_accepted

    fn = parse("func @f(%x: f32[4]) -> (f32[4]) {\n  %y = neg %x : f32[4]\n  return %y\n}\n")["f"]
    rewritten = fn.clone()
    items = ["a", "b"]
    spans = {id("a"): (0, 0), id("b"): (0, 0)}
    seen = []

    def rewrite(f, kept):
        seen.append(list(kept))
        return rewritten, spans

    assert keep_accepted(fn, items, rewrite, lambda out: None) == (rewritten, items)
    out, kept = keep_accepted(fn, items, rewrite, lambda out: 1)  # index 1: outside both spans
    assert out is fn and kept == []
    calls = iter([0, None])  # at 0, inside both spans: both undone, nothing left to rewrite
    out, kept = keep_accepted(fn, items, rewrite, lambda out: next(calls))
    assert out is fn and kept == [] and seen[-1] == items
