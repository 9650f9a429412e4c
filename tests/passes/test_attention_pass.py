"""The ``attention`` pass: explicit attention (matmul, scale, mask, softmax, matmul) becomes the
``attention`` op with the same numerics; near misses are left alone. Verified after the pass."""
from __future__ import annotations

import numpy as np
import pytest

from remat.ir import parse, verify
from remat.pipeline import run_pipeline

from _checked import run_checked
from _interp import evaluate

HEAD = "func @f(%0: f64[2,3,4,5], %1: f64[2,3,6,5], %2: f64[2,3,6,7], %3: bool[4,6], %4: f64[3,1,6]) -> {ret} {{\n"


def _prog(body: str, ret: str = "f64[2,3,4,7]") -> str:
    last = body.strip().splitlines()[-1].split("=")[0].strip()
    return HEAD.format(ret=ret) + "  " + body.strip().replace("\n", "\n  ") + f"\n  return {last}\n}}\n"


SCORES = """%5 = transpose %1 {perm=[0, 1, 3, 2]} : f64[2,3,5,6]
%6 = reshape %0 {shape=[6, 4, 5]} : f64[6,4,5]
%7 = reshape %5 {shape=[6, 5, 6]} : f64[6,5,6]
%8 = matmul %6, %7 : f64[6,4,6]
%9 = reshape %8 {shape=[2, 3, 4, 6]} : f64[2,3,4,6]"""
TAIL = """%20 = softmax %{s} {{axis=3}} : f64[2,3,4,6]
%21 = reshape %20 {{shape=[6, 4, 6]}} : f64[6,4,6]
%22 = reshape %2 {{shape=[6, 6, 7]}} : f64[6,6,7]
%23 = matmul %21, %22 : f64[6,4,7]
%24 = reshape %23 {{shape=[2, 3, 4, 7]}} : f64[2,3,4,7]"""
SCALE = "%10 = constant {value=0.4, dtype=f64} : f64[]\n%11 = mul %9, %10 : f64[2,3,4,6]"
NEG_INF = "%12 = constant {value=-inf, dtype=f64} : f64[]"

POSITIVE = {
    "plain": SCORES + "\n" + TAIL.format(s=9),
    "scaled": SCORES + "\n" + SCALE + "\n" + TAIL.format(s=11),
    "divided": SCORES + "\n%10 = constant {value=2.5, dtype=f64} : f64[]\n%11 = div %9, %10 : f64[2,3,4,6]\n"
               + TAIL.format(s=11),
    "masked_fill": SCORES + "\n" + SCALE + "\n" + NEG_INF + "\n%13 = not %3 : bool[4,6]\n"
                   "%14 = select %13, %12, %11 : f64[2,3,4,6]\n" + TAIL.format(s=14),
    "select_keep": SCORES + "\n" + SCALE + "\n" + NEG_INF + "\n%14 = select %3, %11, %12 : f64[2,3,4,6]\n"
                   + TAIL.format(s=14),
    "drop_condition": SCORES + "\n" + NEG_INF + "\n%13 = lt %4, %4 : bool[3,1,6]\n"
                      "%14 = select %13, %12, %9 : f64[2,3,4,6]\n" + TAIL.format(s=14),
    "additive": SCORES + "\n" + SCALE + "\n%14 = add %4, %11 : f64[2,3,4,6]\n" + TAIL.format(s=14),
}

NEGATIVE = {
    # the scores are also returned: the op would not materialise them
    "scores_used_twice": (SCORES + "\n" + TAIL.format(s=9) + "\n%25 = reduce_sum %9 {axes=[0, 1, 2, 3]} : f64[]\n"
                          "%26 = reduce_sum %24 {axes=[0, 1, 2, 3]} : f64[]\n%27 = add %25, %26 : f64[]", "f64[]"),
    # softmax over another axis
    "softmax_axis": (SCORES + "\n" + TAIL.format(s=9).replace("axis=3", "axis=2"), None),
    # a scale that is not a constant
    "tensor_scale": (SCORES + "\n%11 = mul %9, %4 : f64[2,3,4,6]\n" + TAIL.format(s=11), None),
    # masked with a finite fill value: not the same as dropping the score
    "finite_fill": (SCORES + "\n%12 = constant {value=-1000.0, dtype=f64} : f64[]\n"
                    "%14 = select %3, %9, %12 : f64[2,3,4,6]\n" + TAIL.format(s=14), None),
    # something between softmax and the second matmul (dropout's select, here a scaling)
    "after_softmax": (SCORES + "\n" + TAIL.format(s=9).replace(
        "%21 = reshape %20 {shape=[6, 4, 6]} : f64[6,4,6]",
        "%30 = constant {value=0.5, dtype=f64} : f64[]\n%31 = mul %20, %30 : f64[2,3,4,6]\n"
        "%21 = reshape %31 {shape=[6, 4, 6]} : f64[6,4,6]"), None),
}


def _args(rng):
    keep = rng.random((4, 6)) > 0.4
    keep[:, 0] = True
    return [rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 7)),
            keep, rng.standard_normal((3, 1, 6))]


def _run(text):
    return run_checked(text, ["attention", "dce"])


def _ops(f):
    return [i.op.name for i in f.instructions()]


@pytest.mark.parametrize("case", sorted(POSITIVE))
def test_explicit_attention_becomes_the_op(case):
    m, out = _run(_prog(POSITIVE[case]))
    ops = _ops(out["f"])
    assert ops.count("attention") == 1, str(out)
    assert not {"softmax", "matmul", "select", "mul", "div", "transpose"} & set(ops), str(out)
    args = _args(np.random.default_rng(0))
    np.testing.assert_allclose(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0], rtol=1e-12, atol=1e-12)


def test_scale_and_mask_become_attributes_and_operands():
    _, out = _run(_prog(POSITIVE["masked_fill"]))
    (att,) = [i for i in out["f"].instructions() if i.op.name == "attention"]
    assert att.attrs["scale"] == 0.4 and not att.attrs["is_causal"]
    assert att.operands[3] is out["f"].params[3]  # not(keep) was the drop condition: keep itself is the mask
    assert att.operands[1] is out["f"].params[1]  # k, not a copy of its transpose


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_near_misses_are_left_alone(case):
    body, ret = NEGATIVE[case]
    m, out = _run(_prog(body, ret or "f64[2,3,4,7]"))
    assert "attention" not in _ops(out["f"])
    args = _args(np.random.default_rng(1))
    np.testing.assert_array_equal(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0])


def test_zoo_gpt_attention_is_recognised_without_dropout_only():
    import torch

    from remat import zoo
    from remat.frontend.torch_import import import_module

    for dropout, matched in ((0.0, True), (0.1, False)):
        model, inputs, loss_fn = zoo.make("gpt", "tiny", torch.float32, dropout=dropout)
        im = import_module(model, inputs, loss_fn)
        ops = _ops(im.function)
        assert ops.count("attention") == (len(model.blocks) if matched else 0)
        assert ops.count("softmax") == (0 if matched else len(model.blocks))


# ---------------------------------------------------------------- heads transposed in and out (fold-head-transposes)
HEADS = """func @f(%0: f64[2,4,3,5], %1: f64[2,6,3,5], %2: {vtype}, %3: {mask}) -> f64[2,4,15] {{
  %4 = transpose %0 {{perm=[0, 2, 1, 3]}} : f64[2,3,4,5]
  %5 = transpose %1 {{perm=[0, 2, 1, 3]}} : f64[2,3,6,5]
  {value}
  %7, %8 = attention %4, %5, %6, %3 {{scale=0.5}} : f64[2,3,4,5], f64[2,3,4]
  %9 = transpose %7 {{perm=[0, 2, 1, 3]}} : f64[2,4,3,5]
  %10 = reshape %9 {{shape=[2, 4, 15]}} : f64[2,4,15]
  return %10
}}
"""
TRANSPOSED_V = dict(vtype="f64[2,6,3,5]", value="%6 = transpose %2 {perm=[0, 2, 1, 3]} : f64[2,3,6,5]")
PLAIN_V = dict(vtype="f64[2,3,6,5]", value="%6 = neg %2 : f64[2,3,6,5]")  # already [B, H, S, D]


def _heads_args(rng, mask_dtype, v_heads_first=False):
    mask = rng.random((2, 1, 4, 6)) > 0.4 if mask_dtype == "bool" else rng.standard_normal((2, 1, 4, 6))
    if mask_dtype == "bool":
        mask[..., 0] = True
    v = rng.standard_normal((2, 3, 6, 5) if v_heads_first else (2, 6, 3, 5))
    return [rng.standard_normal((2, 4, 3, 5)), rng.standard_normal((2, 6, 3, 5)), v, mask]


def _fold(text):
    return run_checked(text, ["fold-head-transposes", "simplify", "dce"])


def test_attention_reads_heads_transposed_operands_in_place():
    """q, k and v transposed [B, T, H, D] -> [B, H, T, D] and the output transposed back: the op reads
    and writes [B, T, H, D] itself (seq_first) and no transpose is left; same numbers."""
    m, out = _fold(HEADS.format(mask="bool[2,1,4,6]", **TRANSPOSED_V))
    (att,) = [i for i in out["f"].instructions() if i.op.name == "attention"]
    assert att.attrs["seq_first"] and att.operands[:3] == out["f"].params[:3]
    assert "transpose" not in _ops(out["f"]), str(out)
    args = _heads_args(np.random.default_rng(2), "bool")
    np.testing.assert_allclose(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0], rtol=1e-12, atol=1e-12)


def test_attention_with_an_additive_mask_reads_heads_transposed_operands_in_place():
    """A float mask (a learned position bias: Swin, T5) folds like a bool one; its cotangent swaps the
    heads back in the backward (the VJP, checked by the generated per-op tests' seq_first sample)."""
    m, out = _fold(HEADS.format(mask="f64[2,1,4,6]", **TRANSPOSED_V))
    (att,) = [i for i in out["f"].instructions() if i.op.name == "attention"]
    assert att.attrs["seq_first"] and att.operands[:3] == out["f"].params[:3] and att.operands[3] == out["f"].params[3]
    assert "transpose" not in _ops(out["f"]), str(out)
    args = _heads_args(np.random.default_rng(3), "f64")
    np.testing.assert_allclose(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0], rtol=1e-12, atol=1e-12)


def test_heads_transposes_are_kept_where_the_op_cannot_take_them():
    """An operand that is not a heads transpose: nothing changes."""
    m, out = _fold(HEADS.format(mask="bool[2,1,4,6]", **PLAIN_V))
    assert str(out) == str(m)
    args = _heads_args(np.random.default_rng(3), "bool", v_heads_first=True)
    np.testing.assert_array_equal(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0])


# ---------------------------------------------------------------- key/value heads repeated (fold-kv-repeats)
REPEAT = """func @f(%0: f64[2,4,3,5], %1: f64[2,2,6,5], %2: f64[2,2,6,5], %3: bool[2,1,3,6]) -> f64[2,4,3,5] {{
  %4 = reshape %1 {{shape=[2, 2, 1, 6, 5]}} : f64[2,2,1,6,5]
  %5 = broadcast %4 {{shape=[2, 2, 2, 6, 5]}} : f64[2,2,2,6,5]
  %6 = reshape %5 {{shape=[2, 4, 6, 5]}} : f64[2,4,6,5]
  %7 = reshape %2 {{shape=[2, 2, 1, 6, 5]}} : f64[2,2,1,6,5]
  %8 = broadcast %7 {{shape=[2, 2, 2, 6, 5]}} : f64[2,2,2,6,5]
  %9 = reshape %8 {{shape=[2, 4, 6, 5]}} : f64[2,4,6,5]
  %10, %11 = attention %0, %6, {value}, %3 {{scale=0.5}} : f64[2,4,3,5], f64[2,4,3]
  return %10
}}
"""


def _repeat_args(rng):
    mask = rng.random((2, 1, 3, 6)) > 0.4
    mask[..., 0] = True
    return [rng.standard_normal((2, 4, 3, 5)), rng.standard_normal((2, 2, 6, 5)), rng.standard_normal((2, 2, 6, 5)), mask]


def test_grouped_query_attention_reads_its_shared_key_value_heads():
    """Key and value heads repeated for grouped-query attention (Hugging Face's repeat_kv: unsqueeze,
    expand, reshape) are read by the op itself: no broadcast is left; same numbers."""
    m = parse(REPEAT.format(value="%9"))
    verify(m)
    out = run_pipeline(m, ["fold-kv-repeats", "simplify", "dce"]).module
    (att,) = [i for i in out["f"].instructions() if i.op.name == "attention"]
    assert att.operands[1:3] == out["f"].params[1:3], str(out)
    assert not {"broadcast", "reshape"} & set(_ops(out["f"])), str(out)
    args = _repeat_args(np.random.default_rng(4))
    np.testing.assert_allclose(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0], rtol=1e-12, atol=1e-12)


def test_kv_repeats_are_kept_unless_key_and_value_both_repeat():
    """The value is computed from the repeated key (not a repeat itself): nothing changes."""
    text = REPEAT.format(value="%12").replace("  %10, %11 = attention", "  %12 = neg %6 : f64[2,4,6,5]\n  %10, %11 = attention")
    m = parse(text)
    verify(m)
    out = run_pipeline(m, ["fold-kv-repeats"]).module
    assert str(out) == str(m)


ROTARY = """func @f(%0: f64[2,4,3,4], %1: f64[2,4,3,4], %2: f64[2,4,3,4], %3: f64[4,4], %4: f64[4,4]) -> f64[2,4,12] {{
  %5 = transpose %0 {{perm=[0, 2, 1, 3]}} : f64[2,3,4,4]
  %6 = transpose %1 {{perm=[0, 2, 1, 3]}} : f64[2,3,4,4]
  %7 = transpose %2 {{perm=[0, 2, 1, 3]}} : f64[2,3,4,4]
  %8 = reshape %3 {{shape=[1, 1, 4, 4]}} : f64[1,1,4,4]
  %9 = reshape %4 {{shape=[1, 1, 4, 4]}} : f64[1,1,4,4]
  %10 = mul %5, %8 : f64[2,3,4,4]
  %11 = slice %5 {{start=[0, 0, 0, 0], stop=[2, 3, 4, 2], step=[1, 1, 1, 1]}} : f64[2,3,4,2]
  %12 = slice %5 {{start=[0, 0, 0, 2], stop=[2, 3, 4, 4], step=[1, 1, 1, 1]}} : f64[2,3,4,2]
  %13 = neg %12 : f64[2,3,4,2]
  %14 = concat %13, %11 {{axis=3}} : f64[2,3,4,4]
  %15 = mul %14, %9 : f64[2,3,4,4]
  %16 = add %10, %15 : f64[2,3,4,4]
  %17 = mul %6, %8 : f64[2,3,4,4]
  %18, %19 = attention %16, %17, %7 {{scale=0.5, is_causal=true}} : f64[2,3,4,4], f64[2,3,4]
  %20 = transpose %18 {{perm=[0, 2, 1, 3]}} : f64[2,4,3,4]
  %21 = reshape %20 {{shape=[2, 4, 12]}} : f64[2,4,12]
  {extra}return %21
}}
"""


def test_a_rotary_embedding_is_computed_on_the_sequence_first_values():
    """q rotated (q * cos + rotate_half(q) * sin) and k scaled from their heads transposes: the rotation
    runs on [B, T, H, D] (cos and sin [1, 1, T, D] read as [1, T, 1, D] reshapes, the slices and the
    concatenation on the same last axis), attention is seq_first, no transpose is left; same numbers.
    Something else reading the rotated query keeps everything as it was."""
    m, out = _fold(ROTARY.format(extra=""))
    (att,) = [i for i in out["f"].instructions() if i.op.name == "attention"]
    assert att.attrs["seq_first"] and "transpose" not in _ops(out["f"]), str(out)
    rng = np.random.default_rng(6)
    args = [rng.standard_normal((2, 4, 3, 4)) for _ in range(3)] + [rng.standard_normal((4, 4)) for _ in range(2)]
    np.testing.assert_allclose(evaluate(out["f"], args, out)[0], evaluate(m["f"], args, m)[0], rtol=1e-12, atol=1e-12)
    m, out = _fold(ROTARY.format(extra="%22 = reduce_sum %16 {axes=[0, 1, 2, 3]} : f64[]\n  ").replace(
        "-> f64[2,4,12]", "-> (f64[2,4,12], f64[])").replace("return %21", "return %21, %22"))
    assert not any(i.attrs.get("seq_first") for i in out["f"].instructions() if i.op.name == "attention")


def test_chunk_attention_slices_short_low_precision_attention_only():
    """``chunk_attention`` sets ``chunks`` on low-precision attention over fewer than ``max_queries``
    queries, about ``scores_per_chunk`` scores a slice and at most one batch row each, and nowhere
    else (f32, long sequences, no batch axis); the VJP gives ``attention_grad`` the same slices, and
    the text round-trips with the attribute."""
    from remat.autodiff import differentiate
    from remat.ir import Function, GradientSpec, Module, print_function
    from remat.passes.attention import chunk_attention

    src = """func @f(%0: {t}[8,4,16,8], %1: {t}[8,4,16,8], %2: {t}[8,4,16,8]) -> f32[] {{
  %3, %4 = attention %0, %1, %2 {{scale=0.5}} : {t}[8,4,16,8], f32[8,4,16]
  %5 = cast %3 {{dtype=f32}} : f32[8,4,16,8]
  %6 = reduce_sum %5 {{axes=[0, 1, 2, 3]}} : f32[]
  return %6
}}
"""
    low = parse(src.format(t="bf16"))["f"]
    out, sites = chunk_attention(low, max_queries=128, scores_per_chunk=2048)
    verify(out)
    (att,) = [i for i in out.instructions() if i.op.name == "attention"]
    assert att.attrs["chunks"] == 4 and [s.chunks for s in sites] == [4] and sites[0].shape == (8, 4, 16, 16)
    assert next(parse(print_function(out))["f"].instructions()).attrs["chunks"] == 4
    assert chunk_attention(low, max_queries=128, scores_per_chunk=1)[1][0].chunks == 8  # one batch row a slice
    assert chunk_attention(low, max_queries=16)[1] == []  # as long as the flash kernels take
    assert chunk_attention(parse(src.format(t="f32"))["f"], max_queries=128, scores_per_chunk=2048)[1] == []
    # [T, H, D] operands (seq_first, rank 3) have no batch axis to slice: their leading axis is T
    seq = """func @f(%0: bf16[16,4,8], %1: bf16[16,4,8], %2: bf16[16,4,8]) -> bf16[16,4,8] {
  %3, %4 = attention %0, %1, %2 {scale=0.5, seq_first=true} : bf16[16,4,8], f32[4,16]
  return %3
}
"""
    assert chunk_attention(parse(seq)["f"], max_queries=128, scores_per_chunk=1)[1] == []
    with pytest.raises(Exception, match="chunks must be 1, or at most the leading axis"):
        verify(parse(seq.replace("seq_first=true}", "seq_first=true, chunks=2}")))
    m = differentiate(Module([out, Function("f_grad", gradient=GradientSpec("f", (0,), False))]))
    verify(m)
    assert [i.attrs["chunks"] for i in m["f_grad"].instructions() if i.op.name.startswith("attention")] == [4, 4]
