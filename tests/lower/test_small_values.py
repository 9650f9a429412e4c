"""Small recomputed values read from their first run (``remat.lower.small_values``): the rewritten
program computes the same values with fewer instructions and never a peak above its limit; steps
whose plans recompute small values (a chain plan's statistics and step counters, a graph plan's
weight casts and dropout seeds) train bit-identically with and without the rewrite, predicted ==
measured peak within the budget."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat.lower.small_values as reuse
from remat.ir import Module, parse, verify
from remat.plan.simulator import predict_peak
from remat.runtime.vm import VM

from _lower_util import train

# The row maxima %2 (256 bytes) are dropped after their first use and recomputed (%7) for the
# backward-like second use; %6 (a large exp) is recomputed too, and only read by the recomputation of
# %8, which stays (16 KiB, above the limit the tests give).
SRC = """func @f(%0: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %2 = reduce_max %0 {axes=[1], keepdims=true} : f32[64,1]
  %3 = sub %0, %2 : f32[64,64]
  free %2
  %4 = exp %3 : f32[64,64]
  free %3
  %5 = neg %4 : f32[64,64]
  free %4
  %7 = reduce_max %0 {axes=[1], keepdims=true} : f32[64,1]  // loc(recompute=%2)
  %8 = sub %0, %7 : f32[64,64]  // loc(recompute=%3)
  free %7
  %9 = mul %8, %5 : f32[64,64]
  free %8
  return %5, %9
}
"""


def _run(fn):
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    return VM(Module([fn])).run(fn.name, x)


def test_a_small_recomputation_reads_the_first_run_and_values_stay() -> None:
    fn = parse(SRC)["f"]
    assert [i.op.name for i in reuse.find_small(fn, 1024)] == ["reduce_max"]
    out = reuse.reuse_small(fn, small=1024)
    verify(Module([out]))
    assert str(parse(str(Module([out])))) == str(Module([out]))  # canonical text round-trips
    names = [i.op.name for i in out.instructions() if i.op.name != "free"]
    assert names.count("reduce_max") == 1 and names.count("sub") == 2
    (a, sa), (b, sb) = _run(fn), _run(out)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    # the kept maxima (256 bytes) live on; the recomputation's own 256 bytes are not allocated: same peak
    assert sb.peak_bytes == predict_peak(out) <= sa.peak_bytes == predict_peak(fn)


def test_a_limit_the_kept_value_would_break_undoes_the_rewrite() -> None:
    fn = parse(SRC)["f"]
    tight = predict_peak(fn) - 1  # below the program's own peak: no rewrite can be accepted
    assert reuse.reuse_small(fn, limit=tight, small=1024) is fn
    assert reuse.reuse_small(fn, small=16) is fn  # nothing that small


# A scalar constant (%10, 4 bytes) and the row maxima (%11, 256 bytes) recomputed for the second use;
# kept from their first runs, both would live through the peak at the forward's %9.
SCALAR = """func @f(%0: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %1 = constant {value=2.0, dtype=f32} : f32[]
  %2 = reduce_max %0 {axes=[1], keepdims=true} : f32[64,1]
  %3 = mul %0, %1 : f32[64,64]
  free %1
  %4 = sub %3, %2 : f32[64,64]
  free %2
  free %3
  %5 = exp %4 : f32[64,64]
  %6 = neg %4 : f32[64,64]
  %7 = mul %5, %6 : f32[64,64]
  %9 = add %7, %4 : f32[64,64]
  %8 = add %9, %5 : f32[64,64]
  free %4, %5, %6, %7, %9
  %10 = constant {value=2.0, dtype=f32} : f32[]  // loc(recompute=%1)
  %11 = reduce_max %0 {axes=[1], keepdims=true} : f32[64,1]  // loc(recompute=%2)
  %12 = mul %0, %10 : f32[64,64]  // loc(recompute=%3)
  free %10
  %13 = sub %12, %11 : f32[64,64]  // loc(recompute=%4)
  free %11
  free %12
  %14 = mul %13, %8 : f32[64,64]
  free %13
  return %8, %14
}
"""


@pytest.mark.parametrize("room, kept", [(0, []), (4, ["constant"]), (255, ["constant"]),
                                        (260, ["constant", "reduce_max"])])
def test_the_largest_kept_value_is_undone_first(room: int, kept: list) -> None:
    """A limit with room for the scalar but not for the maxima undoes the maxima's drop only: the
    scalar is not undone with it."""
    fn = parse(SCALAR)["f"]
    out = reuse.reuse_small(fn, limit=predict_peak(fn) + room, small=1024)
    verify(Module([out]))
    recomputed = [i.op.name for i in out.instructions() if i.recomputes is not None]
    assert [op for op in ("constant", "reduce_max") if op not in recomputed] == kept
    assert predict_peak(out) <= predict_peak(fn) + room
    (a, _), (b, _) = _run(fn), _run(out)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def _recomputed(program) -> int:
    return sum(1 for i in program.entry.instrs if i.recomputes is not None and not i.op.has("view"))


@pytest.mark.parametrize("name, precision, size", [("resnet", "fp32", "small"), ("gpt", "bf16", "tiny")])
def test_steps_reusing_small_values_train_bit_identically_within_the_budget(name, precision, size):
    """Zoo ResNet in fp32 (a chain plan re-runs whole blocks: the stem's statistics pass, batch-norm
    counters) and the zoo GPT in bf16 (dropout seeds, weight casts; its tiny size: bf16 products
    are slow on CPUs without native bf16) at half their unconstrained peak."""
    step, losses, state = train(name, precision, 0.5, size=size)
    base, base_losses, base_state = train(name, precision, 0.5, reuse, "find_small", size=size)
    assert _recomputed(step.compilation.plan.program) == _recomputed(base.compilation.plan.program)  # one plan
    assert _recomputed(step.program) < _recomputed(base.program)
    verify(Module([step.program]))
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(state, base_state))
    rep = step.report()
    assert rep.predicted_peak == rep.measured_peak <= step.budget
