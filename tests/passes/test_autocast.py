"""The ``autocast`` pass (``remat.passes.autocast``): mixed precision over the IR. On float32
captures of models it gives the program ``torch.export`` captures under ``torch.autocast``: the same
instructions in the same dtypes and bit-identical outputs; casts are made once per value and not
twice; the signature is kept; a DSL program trains through it within bf16 tolerance of float32."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import remat
from remat import zoo
from remat.frontend.torch_import import import_module
from remat.ir import DType, parse
from remat.passes.autocast import autocast
from _checked import autocast_as_captured, dtype_counts, run_checked


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet"])
def test_zoo_model_as_captured_under_torch_autocast(name):
    model, inputs, loss_fn = zoo.make(name, "tiny")
    autocast_as_captured(model, inputs, loss_fn)


def test_not_cast_twice():
    """A program already in mixed precision (a capture under torch.autocast) passes through unchanged."""
    model, inputs, loss_fn = zoo.make("gpt", "tiny")
    captured = import_module(model, inputs, loss_fn, train=None, cache=False, autocast=torch.bfloat16).function
    assert dtype_counts(autocast(captured)) == dtype_counts(captured)
    once = autocast(import_module(model, inputs, loss_fn, train=None, cache=False).function)
    assert str(autocast(once)) == str(once)


TEXT = """func @f(%x: f32[4,8], %w: f32[16,8], %b: f32[16], %v: f32[16,8], %t: i64[4]) -> (f32[], f32[4,16]) {
  %y = linear %x, %w, %b : f32[4,16]
  %z = linear %x, %w, %b : f32[4,16]
  %s = constant {value=0.5} : f32[]
  %h = mul %y, %s : f32[4,16]
  %r = add %h, %z : f32[4,16]
  %p = softmax %r {axis=1} : f32[4,16]
  %u = matmul %p, %v : f32[4,8]
  %o = linear %u, %w, %b : f32[4,16]
  %l, %lse = cross_entropy %o, %t : f32[], f32[4]
  return %l, %p
}
"""


def test_op_lists_on_ir_text():
    """Products in bf16 (each float operand cast once: %x and %w are read by three products), the
    scalar made again in bf16, the softmax in its operand's dtype, the loss in f32 (of the bf16
    logits, with no f32 copy of them); the signature kept (the bf16 result cast back to f32)."""
    m, out = run_checked(TEXT, ["autocast"])
    f = out["f"]
    assert f.param_types == m["f"].param_types and f.result_types == m["f"].result_types
    by = {(i.op.name, i.operands[0].type.dtype.value) for i in f.instructions() if i.operands and i.op.name != "return"}
    assert ("linear", "bf16") in by and ("matmul", "bf16") in by and ("softmax", "bf16") in by
    ce = next(i for i in f.instructions() if i.op.name == "cross_entropy")
    assert ce.attrs["upcast"] and ce.operands[0].type.dtype == DType.bf16 and ce.results[0].type.dtype == DType.f32
    casts = collections.Counter((i.operands[0], i.attrs["dtype"]) for i in f.instructions() if i.op.name == "cast")
    assert set(casts.values()) == {1}
    assert sum(1 for v, d in casts if d == DType.bf16 and v in f.params) == 4  # x, w, b, v: once each
    consts = [i for i in f.instructions() if i.op.name == "constant"]
    assert [c.results[0].type.dtype for c in consts] == [DType.bf16]  # the f32 scalar is not left behind
    x = np.random.default_rng(0)
    args = [x.standard_normal(t.shape).astype(np.float32) for t in m["f"].param_types[:4]] + [np.array([0, 3, 15, 2])]
    want = remat.run(m["f"], *args, dialects=("torch",))[0]
    got = remat.run(f, *args, dialects=("torch",))[0]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)


def test_f16_and_bad_dtype():
    out = autocast(parse(TEXT)["f"], "f16")
    assert {i.results[0].type.dtype for i in out.instructions() if i.op.name == "matmul"} == {DType.f16}
    with pytest.raises(ValueError, match="bf16 or f16, got 'f32'"):
        autocast(parse(TEXT)["f"], "f32")
    with pytest.raises(TypeError, match="a remat Function or a staged function"):
        autocast(object())


def _tiny_cnn_eager(args, autocast: bool) -> list[np.ndarray]:
    """``examples_dsl.tiny_cnn``'s gradients wrt its two weights in eager PyTorch (under torch.autocast)."""
    import torch.nn.functional as F

    x, w1, b1, w2 = (torch.tensor(a, requires_grad=True) for a in args[:4])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = F.max_pool2d(F.conv2d(x, w1, b1, padding=1).relu(), 2).reshape(8, -1)
        logp = F.log_softmax(h @ w2, dim=1)
        loss = -(logp * F.one_hot(torch.tensor(args[4]), 10).float()).sum(1).mean()
    loss.backward()
    return [w1.grad.numpy(), w2.grad.numpy()]


def test_staged_dsl_function_trains_in_bf16():
    """``remat.autocast`` of a staged function (with a staged call) differentiates with ``remat.grad``:
    float32 gradients no further from float32's than twice eager autocast's (a batch of 8 images
    through bf16 ReLUs and max pools: eager autocast's weight gradient is 4.5% from fp32 here; the
    IR adds the convolution's bias after it, rounding twice), the call's signature kept."""
    from remat.examples_dsl import tiny_cnn

    rng = np.random.default_rng(0)
    args = [(rng.standard_normal(s) * scale).astype(np.float32)  # weights at their fan-in's scale
            for s, scale in (((8, 3, 16, 16), 1.0), ((8, 3, 3, 3), 27 ** -0.5), ((8,), 0.1), ((512, 10), 512 ** -0.5))]
    args.append(rng.integers(0, 10, 8))
    mixed = remat.autocast(tiny_cnn, remat.bf16)
    want = remat.run(remat.grad(tiny_cnn, wrt=(1, 3)), *args)[0]
    got = remat.run(remat.grad(mixed, wrt=(1, 3)), *args)[0]
    assert any(i.op.name == "conv2d" and i.operands[0].type.dtype == DType.bf16
               for f in mixed.module for i in f.instructions())
    assert mixed.module["conv_block"].param_types == tiny_cnn.module["conv_block"].param_types
    for w, e, g, ea in zip(want, _tiny_cnn_eager(args, False), got, _tiny_cnn_eager(args, True)):
        np.testing.assert_allclose(w, e, rtol=1e-4, atol=1e-6)  # the float32 programs agree
        assert g.dtype == np.float32

        def rel(a, b):
            return np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel(g, w) <= 2 * rel(ea, e)


def test_an_op_refusing_the_new_dtypes_reads_the_float32_ones():
    """``index_put`` of float32 values into a product (bf16 after the pass) is refused by its type
    rule, as eager PyTorch refuses it: it reads the product cast back to float32, no cast left unread."""
    text = """func @f(%a: f32[4,8], %b: f32[8,8], %i: i64[2], %u: f32[2,8]) -> f32[4,8] {
  %p = matmul %a, %b : f32[4,8]
  %q = index_put %p, %i, %u : f32[4,8]
  return %q
}
"""
    m, out = run_checked(text, ["autocast"])
    f = out["f"]
    put = next(i for i in f.instructions() if i.op.name == "index_put")
    assert put.operands[0].type.dtype == DType.f32 and put.operands[0].instr.op.name == "cast"
    read = {v for i in f.instructions() for v in i.operands}
    assert all(i.results[0] in read for i in f.instructions() if i.op.name == "cast")
