"""Buffer reuse (remat.ir.reuse): which element-wise results take a dying operand's buffer, and the VM
measuring exactly what the simulator predicts when they do, in every dialect."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat.ir import parse
from remat.ir.reuse import buffer_reuse, reuses_operand
from remat.plan.simulator import predict_peak, simulate


def reused(text: str) -> dict[str, int]:
    """Result name -> the index of the operand it is written over."""
    from remat.ir.printer import Namer

    f = parse(text)["f"]
    nm = Namer(f)
    return {nm[ins.results[0]]: k for ins, k in buffer_reuse(f).items()}


def test_a_dying_operand_of_the_result_type_is_written_over():
    got = reused("""func @f(%0: f32[8], %1: f32[8]) -> f32[8] {
  %2 = exp %0 : f32[8]
  %3 = mul %2, %1 : f32[8]
  %4 = neg %3 : f32[8]
  return %4
}
""")
    # exp reads a parameter (the caller's buffer): fresh. mul's first operand dies there; neg's too.
    assert got == {"%3": 0, "%4": 0}


def test_operands_read_later_parameters_broadcasts_and_other_dtypes_are_not():
    got = reused("""func @f(%0: f32[4,8], %1: f32[8]) -> (f32[4,8], bool[4,8]) {
  %2 = exp %0 : f32[4,8]
  %3 = add %1, %2 : f32[4,8]
  %4 = mul %3, %2 : f32[4,8]
  %5 = gt %4, %0 : bool[4,8]
  %6 = sub %4, %0 : f32[4,8]
  return %3, %5
}
""")
    # %3: %1 is a broadcast parameter, %2 is read again by %4. %4: %3 is returned, %2 dies: over %2 (index 1).
    # %5: bool result. %6: %4 dies there, but its result is never read: still written over %4.
    assert got == {"%4": 1, "%6": 0}


def test_a_view_read_later_keeps_its_storage():
    got = reused("""func @f(%0: f32[4,8]) -> f32[32] {
  %1 = exp %0 : f32[4,8]
  %2 = reshape %1 {shape=[32]} : f32[32]
  %3 = neg %1 : f32[4,8]
  %4 = reshape %3 {shape=[32]} : f32[32]
  %5 = add %2, %4 : f32[32]
  return %5
}
""")
    # %3 may not overwrite %1: its view %2 is read by %5. %5 overwrites %2 (the view of %1, dying).
    assert got == {"%5": 0}


def test_an_operand_read_through_another_value_of_its_storage_is_not_written():
    got = reused("""func @f(%0: f32[8]) -> f32[8] {
  %1 = exp %0 : f32[8]
  %2 = reshape %1 {shape=[8]} : f32[8]
  %3 = add %1, %2 : f32[8]
  return %3
}
""")
    assert got == {}


def test_frees_are_not_reads_and_branches_reuse_nothing():
    got = reused("""func @f(%0: f32[8]) -> f32[8] {
  %1 = exp %0 : f32[8]
  %2 = tanh %1 : f32[8]
  free %1
  %3 = cumsum %2 {axis=0} : f32[8]
  free %2
  return %3
}
""")
    assert got == {"%2": 0}
    loop = parse("""func @f(%0: f32[8], %1: bool[]) -> f32[8] {
  %2 = exp %0 : f32[8]
  cond_br %1, ^bb1, ^bb2
^bb1:
  %3 = neg %2 : f32[8]
  br ^bb3(%3)
^bb2:
  br ^bb3(%2)
^bb3(%4: f32[8]):
  return %4
}
""")["f"]
    assert buffer_reuse(loop) == {}


def test_which_ops_reuse():
    assert reuses_operand("add") and reuses_operand("relu_grad") and reuses_operand("fused")
    assert not any(reuses_operand(n) for n in ("copy", "cast", "reshape", "matmul", "sgd_step", "bernoulli", "conv2d"))


CHAIN = """func @f(%0: f32[64,32], %1: f32[32], %2: f32[64,32]) -> (f32[64,32], f32[]) {
  %3 = mul %0, %1 : f32[64,32]
  %4 = relu %3 : f32[64,32]
  %5 = relu_grad %2, %4 : f32[64,32]
  %6 = fused %5, %3, %1 {body="%3 = mul(%0, %1) %4 = add(%3, %2) -> %4"} : f32[64,32]
  %7 = reduce_sum %4 {axes=[0, 1]} : f32[]
  %8 = sub %6, %0 : f32[64,32]
  return %8, %7
}
"""


@pytest.mark.parametrize("dialects", [("numpy",), ("torch",), ("numba", "torch"), ("numba", "numpy")])
def test_the_vm_measures_what_is_predicted_and_computes_the_same_values(dialects):
    f = parse(CHAIN)["f"]
    # relu may not take mul's buffer (fused reads mul), relu_grad not relu's (reduce_sum reads it);
    # fused is written over relu_grad, sub over fused.
    assert sorted(ins.op.name for ins in buffer_reuse(f)) == ["fused", "sub"]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(t.shape).astype(np.float32) for t in f.param_types]
    x, s, g = args
    h = x * s
    r = np.maximum(h, 0)
    want = (np.where(r > 0, g, 0) * h + s) - x
    keep = [a.copy() for a in args]
    for record in ("full", "peak"):
        outs, st = remat.run(f, *args, dialects=dialects, record=record)
        np.testing.assert_allclose(outs[0], want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(outs[1], r.sum(), rtol=1e-5)
        assert st.peak_bytes == predict_peak(f)
        if record == "full":
            assert st.timeline == simulate(f).timeline
    for a, b in zip(args, keep):
        assert np.array_equal(a, b)  # the caller's buffers are never written
    # the parameters and mul, relu, relu_grad (the fused result takes relu_grad's buffer)
    assert predict_peak(f) == 2 * 64 * 32 * 4 + 32 * 4 + 3 * 64 * 32 * 4


def test_a_training_step_writes_in_place_and_keeps_its_promises():
    """The zoo ResNet's step reuses buffers (batch-norm and ReLU gradients over the gradients they
    read); measured == predicted, and the same losses as without a budget at its minimum."""
    from remat import zoo

    model, example, loss_fn = zoo.make("resnet", "tiny")
    step = remat.compile(model, example, loss_fn)
    assert len(buffer_reuse(step.program)) >= 8
    out = step(*example)
    assert step.report().measured_peak == step.predicted_peak
    assert torch.isfinite(out).all()
    fused = [ins for ins, k in buffer_reuse(step.program).items() if ins.op.name == "fused"]
    assert fused, "no fused kernel writes in place"
