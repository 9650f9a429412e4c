"""Sibling convolution gradients: the merged kernel is bit-identical to the two single-gradient
kernels, the pass places the merged call where its operands exist and never raises the peak, and a
real training program runs bit-identically with predicted == measured peak."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from remat.backends import torch_kernels as tk
from remat.ir import Module, parse, verify
from remat.lower.siblings import find_pairs, merge_conv_grads
from remat.pipeline import get_pass
from remat.plan.simulator import predict_peak
from remat.runtime.vm import VM

CASES = [  # (x shape, w shape, attributes): zoo-like 3x3, 1x1 stride 2, groups, dilation and asymmetric padding
    ((16, 32, 16, 16), (32, 32, 3, 3), dict(padding=(1, 1))),
    ((4, 8, 9, 9), (16, 8, 1, 1), dict(stride=(2, 2))),
    ((2, 4, 7, 5), (4, 2, 3, 2), dict(stride=(2, 1), groups=2)),
    ((1, 2, 7, 7), (3, 2, 3, 3), dict(dilation=(2, 2), padding=(2, 1))),
    ((4, 8, 9, 9), (8, 1, 3, 3), dict(padding=(1, 1), groups=8)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("xs, ws, attrs", CASES)
def test_merged_kernel_is_bit_identical_to_the_single_gradient_kernels(xs, ws, attrs, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(xs, generator=g, dtype=dtype), torch.randn(ws, generator=g, dtype=dtype)
    a = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1, **attrs}
    y = torch.nn.functional.conv2d(x, w, None, a["stride"], a["padding"], a["dilation"], a["groups"])
    gy = torch.randn(y.shape, generator=g, dtype=dtype)
    gx, gw = tk.conv2d_grads(gy, x, w, **a)
    assert torch.equal(gx, tk.conv2d_input_grad(gy, w, xs, **a))
    assert torch.equal(gw, tk.conv2d_weight_grad(x, gy, ws, **a))


@pytest.mark.parametrize("xs, ws, layout, stride, padding, groups", [
    ((2, 6, 1, 1), (144, 6, 1, 1), "NCHW", 1, 0, 1),   # EfficientNet's squeeze-excite expand convolution
    ((4, 5, 3, 3), (24, 5, 1, 1), "NCHW", 1, 0, 1),
    ((2, 1, 1, 13), (8, 13, 1, 1), "NHWC", 1, 0, 1),
    ((2, 3, 3, 5), (24, 5, 1, 1), "NHWC", 1, 0, 1),
    ((4, 4, 4, 64), (64, 8, 3, 3), "NHWC", 1, 1, 8),   # Hugging Face RegNet's grouped convolutions
    ((4, 16, 16, 16), (16, 8, 3, 3), "NHWC", 1, 1, 2),
    ((4, 32, 16, 16), (32, 16, 3, 3), "NCHW", 2, 1, 2),
])
def test_input_gradients_match_the_merged_kernel_on_one_thread(xs, ws, layout, stride, padding, groups) -> None:
    """On one thread oneDNN's transposed convolution (the single input-gradient kernel) and its
    convolution backward (the merged kernel) differed in the last bits for 1x1 kernels over small
    maps with input channels no multiple of 4, and for grouped 3x3 kernels. Whether a pair is merged
    depends on the plan's peak, so two budgets' gradients differed (Hugging Face EfficientNet,
    RegNet)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(xs, generator=g), torch.randn(ws, generator=g)
        a = dict(stride=(stride,) * 2, padding=(padding,) * 2, dilation=(1, 1), groups=groups, layout=layout)
        k, hw = ws[2], (xs[1:3] if layout == "NHWC" else xs[2:])
        out = tuple((h + 2 * padding - k) // stride + 1 for h in hw)
        gy = torch.randn((xs[0],) + out + (ws[0],) if layout == "NHWC" else (xs[0], ws[0]) + out, generator=g)
        gx, _ = tk.conv2d_grads(gy, x, w, **a)
        assert torch.equal(gx, tk.conv2d_input_grad(gy, w, input_shape=xs, **a))
    finally:
        torch.set_num_threads(n)


LATE = """func @f(%0: f32[2,3,6,6], %1: f32[4,3,3,3], %2: f32[2,4,6,6]) -> (f32[2,3,6,6], f32[4,3,3,3]) {
  %3 = conv2d_input_grad %2, %1 {input_shape=[2,3,6,6], padding=[1,1]} : f32[2,3,6,6]
  free %1
  %4 = conv2d_weight_grad %0, %2 {weight_shape=[4,3,3,3], padding=[1,1]} : f32[4,3,3,3]
  free %0, %2
  return %3, %4
}
"""

EARLY = """func @f(%0: f32[2,3,6,6], %1: f32[4,3,3,3], %2: f32[2,4,6,6]) -> (f32[2,3,6,6], f32[4,3,3,3]) {
  %3 = conv2d_input_grad %2, %1 {input_shape=[2,3,6,6], padding=[1,1]} : f32[2,3,6,6]
  %4 = cumsum %3 {axis=3} : f32[2,3,6,6]
  free %3
  %5 = conv2d_weight_grad %0, %2 {weight_shape=[4,3,3,3], padding=[1,1]} : f32[4,3,3,3]
  return %4, %5
}
"""


def _args(fn) -> list[np.ndarray]:
    r = np.random.default_rng(3)
    return [r.standard_normal(t.shape).astype(np.float32) for t in fn.param_types]


def _same_run(before, after) -> None:
    verify(Module([after]))
    assert str(parse(str(Module([after])))) == str(Module([after]))  # canonical text round-trips
    args = _args(before)
    oa, sa = VM(Module([before])).run(before.name, *args)
    ob, sb = VM(Module([after])).run(after.name, *args)
    assert all(np.array_equal(a, b) for a, b in zip(oa, ob))
    assert sb.peak_bytes == predict_peak(after) <= sa.peak_bytes == predict_peak(before)


def test_late_merge_moves_the_free_of_the_first_members_operand() -> None:
    fn = parse(LATE)["f"]
    out = merge_conv_grads(fn)
    text = str(Module([out]))
    assert "%3, %4 = conv2d_grads %2, %0, %1 {padding=[1, 1]}" in text and "conv2d_input_grad" not in text
    names = [i.op.name for i in out.instructions()]
    assert names == ["conv2d_grads", "free", "free", "return"]
    _same_run(fn, out)


SHARED_INPUT = """func @f(%0: f32[2,4,6,6], %1: f32[4,1,3,3], %2: f32[4,1,3,3], %3: f32[2,4,3,3], %4: f32[2,4,3,3]) -> (f32[4,1,3,3], f32[4,1,3,3], f32[2,4,6,6], f32[2,4,6,6]) {
  %5 = conv2d_weight_grad %0, %3 {weight_shape=[4,1,3,3], stride=[2,2], padding=[1,1], groups=4} : f32[4,1,3,3]
  %6 = conv2d_weight_grad %0, %4 {weight_shape=[4,1,3,3], stride=[2,2], padding=[1,1], groups=4} : f32[4,1,3,3]
  free %0
  %7 = conv2d_input_grad %3, %1 {input_shape=[2,4,6,6], stride=[2,2], padding=[1,1], groups=4} : f32[2,4,6,6]
  %8 = conv2d_input_grad %4, %2 {input_shape=[2,4,6,6], stride=[2,2], padding=[1,1], groups=4} : f32[2,4,6,6]
  return %5, %6, %7, %8
}
"""


def test_two_late_merges_reading_one_input_free_it_once_after_both() -> None:
    """Two convolutions of one input (Hugging Face CvT's key and value projections), both weight
    gradients before both input gradients: each late merge deferred the input's free to after
    itself, so it was freed after the first merged call, while the second still read it, and twice."""
    fn = parse(SHARED_INPUT)["f"]
    out = merge_conv_grads(fn)
    assert [i.op.name for i in out.instructions()] == ["conv2d_grads", "conv2d_grads", "free", "return"]
    _same_run(fn, out)


def test_no_late_merge_past_an_in_place_update_of_the_first_members_operand() -> None:
    """The weight %1 (read by the input gradient) is updated in place before the weight gradient:
    merged there, the input gradient would read the updated weight, so the pair is not merged late."""
    src = """func @f(%0: f32[2,3,6,6], %1: f32[4,3,3,3], %2: f32[2,4,6,6], %9: f32[4,3,3,3], %10: f32[4,3,3,3], %11: i64[], %12: f64[4], %13: bool[]) -> (f32[2,3,6,6], f32[4,3,3,3], f32[4,3,3,3], f32[4,3,3,3]) {
  %3 = conv2d_input_grad %2, %1 {input_shape=[2,3,6,6], padding=[1,1]} : f32[2,3,6,6]
  %5, %6 = sgd_step %1, %9, %10, %11, %12, %13 : f32[4,3,3,3], f32[4,3,3,3]
  %4 = conv2d_weight_grad %0, %2 {weight_shape=[4,3,3,3], padding=[1,1]} : f32[4,3,3,3]
  return %3, %4, %5, %6
}
"""
    fn = parse(src)["f"]
    pairs = find_pairs(fn)
    assert all(p.at is p.input_grad for p in pairs)  # early (the weight gradient's operands exist there) or none


# EARLY's peak moved to three temporaries before the pair (cumsums: none can take another's buffer),
# so that merging early costs nothing.
EARLY_UNDER_PEAK = EARLY.replace("  %3 = conv2d_input_grad", """  %6 = cumsum %2 {axis=3} : f32[2,4,6,6]
  %7 = cumsum %6 {axis=3} : f32[2,4,6,6]
  %8 = cumsum %7 {axis=3} : f32[2,4,6,6]
  free %6, %7, %8
  %3 = conv2d_input_grad""")


def test_early_merge_when_the_first_result_is_read_in_between() -> None:
    fn = parse(EARLY_UNDER_PEAK)["f"]
    (pair,) = find_pairs(fn)
    assert pair.at is pair.input_grad
    out = merge_conv_grads(fn)
    assert [i.op.name for i in out.instructions()][3:] == ["free", "conv2d_grads", "cumsum", "free", "return"]
    _same_run(fn, out)


def test_a_merge_that_would_raise_the_peak_is_left_apart() -> None:
    # In EARLY the peak is at the cumsum between the two (not element-wise: it cannot write over its
    # operand): the weight gradient made early would add to it.
    fn = parse(EARLY)["f"]
    assert len(find_pairs(fn)) == 1
    out = merge_conv_grads(fn)
    assert "conv2d_grads" not in [i.op.name for i in out.instructions()]
    assert predict_peak(out) == predict_peak(fn)


def test_no_pair_when_neither_position_has_the_operands() -> None:
    # %5 (the weight gradient) needs %9, made from %3's consumer: merged early its operand cannot be
    # made yet; merged late, %3's consumer is in between.
    src = EARLY.replace("%5 = conv2d_weight_grad %0, %2", "%9 = mul %0, %4 : f32[2,3,6,6]\n  %5 = conv2d_weight_grad %9, %2")
    assert find_pairs(parse(src)["f"]) == []


def test_pass_is_registered() -> None:
    m = parse(LATE)
    out = get_pass("merge-conv-grads")(m)
    assert [i.op.name for i in out["f"].instructions()][0] == "conv2d_grads"


def test_zoo_resnet_step_merges_every_pair_bit_identically() -> None:
    import remat
    from remat import zoo

    model, ex, loss_fn = zoo.make("resnet", "tiny")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    step = remat.compile(model, ex, loss_fn, optimizer=opt, dialects=("torch", "numpy"))
    prog = step.program
    names = [i.op.name for i in prog.instructions()]
    assert "conv2d_grads" in names and "conv2d_input_grad" not in names  # the stem's input needs no gradient
    convs = names.count("conv2d")
    assert names.count("conv2d_grads") == convs - 1 and names.count("conv2d_weight_grad") == 1
    assert step.report().measured_peak is None or step.report().measured_peak == predict_peak(prog)
    # the same step unmerged: same outputs, bit for bit
    unmerged = step.compilation.plan.program
    assert "conv2d_grads" not in [i.op.name for i in unmerged.instructions()]
    oa, sa = VM(Module([unmerged.clone()])).run(unmerged.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
    ob, sb = VM(Module([prog.clone()])).run(prog.name, *step.binding.step_args(ex, copy=True, step=1), outputs="torch")
    assert all(torch.equal(a, b) for a, b in zip(oa, ob))
    assert sb.peak_bytes == predict_peak(prog) <= sa.peak_bytes == predict_peak(unmerged)


# A plan's order around a pair in a low-precision step: the weight gradient, the update of the weight
# it feeds (reading the gradient: no late merge), the weight's cast made again for the input gradient.
# The cast moves before the merged call (the update comes after it, so it reads the same weight).
CAST_BETWEEN = """func @f(%0: f32[2,3,6,6], %1: f32[4,3,3,3], %2: f32[2,4,6,6], %9: f32[4,3,3,3], %11: i64[], %12: f64[4], %13: bool[]) -> (f32[2,3,6,6], f32[4,3,3,3], f32[4,3,3,3]) {
  %20 = cumsum %2 {axis=3} : f32[2,4,6,6]
  %21 = cumsum %20 {axis=3} : f32[2,4,6,6]
  %22 = cumsum %21 {axis=3} : f32[2,4,6,6]
  free %20, %21, %22
  %4 = conv2d_weight_grad %0, %2 {weight_shape=[4,3,3,3], padding=[1,1]} : f32[4,3,3,3]
  free %0
  %5 = neg %4 : f32[4,3,3,3]
  free %4
  %6 = cast %1 {dtype=f64} : f64[4,3,3,3]
  %7 = cast %6 {dtype=f32} : f32[4,3,3,3]
  free %6
  %14, %15 = sgd_step %1, %5, %9, %11, %12, %13 : f32[4,3,3,3], f32[4,3,3,3]
  %3 = conv2d_input_grad %2, %7 {input_shape=[2,3,6,6], padding=[1,1]} : f32[2,3,6,6]
  free %2, %7
  return %3, %14, %15
}
"""


def _sgd_args(fn) -> list[np.ndarray]:
    args = _args(fn)
    args[-3:] = [np.array(1, np.int64), np.array([0.1, 0.9, 0.0, 0.0]), np.array(False)]
    return args


def test_early_merge_moves_the_input_gradients_weight_cast_before_it() -> None:
    fn = parse(CAST_BETWEEN)["f"]
    (pair,) = find_pairs(fn)
    assert pair.at is pair.weight_grad and [h.op.name for h in pair.hoisted] == ["cast", "cast"]
    out = merge_conv_grads(fn)
    verify(Module([out]))
    # the moved casts' intermediate is freed with them, before the merged call
    assert [i.op.name for i in out.instructions()][4:8] == ["cast", "cast", "free", "conv2d_grads"]
    args = _sgd_args(fn)
    oa, sa = VM(Module([fn])).run(fn.name, *[a.copy() for a in args])
    ob, sb = VM(Module([out])).run(out.name, *[a.copy() for a in args])
    assert all(np.array_equal(a, b) for a, b in zip(oa, ob))
    assert sb.peak_bytes == predict_peak(out) <= sa.peak_bytes == predict_peak(fn)


def test_no_early_merge_past_an_in_place_update_of_what_a_moved_instruction_reads() -> None:
    """The cast reads the weight after its update: made before the merged call it would read the weight
    before the update, so the pair is left apart."""
    src = CAST_BETWEEN.replace("""  %6 = cast %1 {dtype=f64} : f64[4,3,3,3]
  %7 = cast %6 {dtype=f32} : f32[4,3,3,3]
  free %6
  %14, %15 = sgd_step %1, %5, %9, %11, %12, %13 : f32[4,3,3,3], f32[4,3,3,3]
""", """  %14, %15 = sgd_step %1, %5, %9, %11, %12, %13 : f32[4,3,3,3], f32[4,3,3,3]
  %6 = cast %1 {dtype=f64} : f64[4,3,3,3]
  %7 = cast %6 {dtype=f32} : f32[4,3,3,3]
  free %6
""")
    assert find_pairs(parse(src)["f"]) == []
