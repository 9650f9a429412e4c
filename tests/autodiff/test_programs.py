"""Gradients of composed programs against torch.autograd (float64), control flow, calls,
second order (Hessian-vector products vs finite differences of gradients)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from remat.autodiff import DifferentiationError, differentiate
from remat.ir import parse, verify
from remat.pipeline import run_pipeline

from _interp import evaluate

CLEAN = ["simplify", "fold", "cse", "dce"]


def _grad(text: str, name: str, args, clean=True):
    m = parse(text)
    verify(m)
    m = differentiate(m)
    verify(m)
    if clean:
        m = run_pipeline(m, CLEAN).module
    return evaluate(m[name], args, m), m


MLP = """func @loss(%0: f64[8,6], %1: f64[6,5], %2: f64[5], %3: f64[5,3], %4: f64[3], %5: f64[8,3]) -> f64[] {
  %6 = matmul %0, %1 : f64[8,5]
  %7 = add %6, %2 : f64[8,5]
  %8 = tanh %7 : f64[8,5]
  %9 = matmul %8, %3 : f64[8,3]
  %10 = add %9, %4 : f64[8,3]
  %11 = relu %10 : f64[8,3]
  %12 = sub %11, %5 : f64[8,3]
  %13 = mul %12, %12 : f64[8,3]
  %14 = reduce_mean %13 {axes=[0, 1]} : f64[]
  return %14
}
func @g = gradient @loss wrt 0, 1, 2, 3, 4
"""


def _torch_grads(fn, args, wrt):
    ts = [torch.tensor(a, requires_grad=i in wrt) for i, a in enumerate(args)]
    fn(*ts).backward()
    return [ts[i].grad.numpy() for i in wrt]


def test_mlp_matches_torch():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s) for s in [(8, 6), (6, 5), (5,), (5, 3), (3,), (8, 3)]]
    got, _ = _grad(MLP, "g", args)

    def f(x, w1, b1, w2, b2, t):
        return ((torch.relu(torch.tanh(x @ w1 + b1) @ w2 + b2) - t) ** 2).mean()

    for a, b in zip(got, _torch_grads(f, args, [0, 1, 2, 3, 4])):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


CONV = """func @loss(%0: f64[2,1,8,8], %1: f64[4,1,3,3], %2: f64[4,1,1], %3: f64[64,5], %4: f64[5], %5: f64[2,5]) -> f64[] {
  %6 = conv2d %0, %1 {padding=[1, 1]} : f64[2,4,8,8]
  %7 = add %6, %2 : f64[2,4,8,8]
  %8 = relu %7 : f64[2,4,8,8]
  %9 = max_pool2d %8 {kernel=[2, 2], stride=[2, 2]} : f64[2,4,4,4]
  %10 = reshape %9 {shape=[2, 64]} : f64[2,64]
  %11 = matmul %10, %3 : f64[2,5]
  %12 = add %11, %4 : f64[2,5]
  %13 = log_softmax %12 {axis=1} : f64[2,5]
  %14 = mul %13, %5 : f64[2,5]
  %15 = reduce_sum %14 {axes=[0, 1]} : f64[]
  %16 = neg %15 : f64[]
  return %16
}
func @g = gradient @loss wrt 0, 1, 2, 3, 4
"""


def test_conv_net_matches_torch():
    rng = np.random.default_rng(1)
    onehot = np.eye(5)[[1, 3]]
    args = [rng.standard_normal(s) for s in [(2, 1, 8, 8), (4, 1, 3, 3), (4, 1, 1), (64, 5), (5,)]] + [onehot]
    got, _ = _grad(CONV, "g", args)

    def f(x, w, cb, w2, b2, t):
        h = torch.nn.functional.max_pool2d(torch.relu(torch.nn.functional.conv2d(x, w, padding=1) + cb), 2)
        logp = torch.log_softmax(h.reshape(2, 64) @ w2 + b2, dim=1)
        return -(logp * t).sum()  # NLL of the one-hot targets

    for a, b in zip(got, _torch_grads(f, args, [0, 1, 2, 3, 4])):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


ATTN = """func @loss(%0: f64[5,4], %1: f64[5,4], %2: f64[5,4], %3: f64[5,4]) -> f64[] {
  %4 = transpose %1 {perm=[1, 0]} : f64[4,5]
  %5 = matmul %0, %4 : f64[5,5]
  %6 = constant {value=0.5, dtype=f64} : f64[]
  %7 = mul %5, %6 : f64[5,5]
  %8 = iota {shape=[5, 5], axis=0} : i64[5,5]
  %9 = iota {shape=[5, 5], axis=1} : i64[5,5]
  %10 = ge %8, %9 : bool[5,5]
  %11 = constant {value=-1e9, dtype=f64} : f64[]
  %12 = select %10, %7, %11 : f64[5,5]
  %13 = softmax %12 {axis=1} : f64[5,5]
  %14 = matmul %13, %2 : f64[5,4]
  %15 = mul %14, %3 : f64[5,4]
  %16 = reduce_sum %15 {axes=[0, 1]} : f64[]
  return %16
}
func @g = gradient @loss wrt 0, 1, 2
"""


def test_causal_attention_matches_torch():
    rng = np.random.default_rng(2)
    args = [rng.standard_normal((5, 4)) for _ in range(4)]
    got, _ = _grad(ATTN, "g", args)

    def f(q, k, v, w):
        s = (q @ k.T) / 2.0
        s = torch.where(torch.tril(torch.ones(5, 5, dtype=torch.bool)), s, torch.tensor(-1e9, dtype=torch.float64))
        return ((torch.softmax(s, dim=1) @ v) * w).sum()

    for a, b in zip(got, _torch_grads(f, args, [0, 1, 2])):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_value_and_gradient_returns_value_first():
    text = MLP.replace("func @g = gradient @loss wrt 0, 1, 2, 3, 4", "func @g = value_and_gradient @loss wrt 1")
    rng = np.random.default_rng(3)
    args = [rng.standard_normal(s) for s in [(8, 6), (6, 5), (5,), (5, 3), (3,), (8, 3)]]
    (val, gw), m = _grad(text, "g", args)
    np.testing.assert_allclose(val, evaluate(m["loss"], args, m)[0])
    assert gw.shape == (6, 5)


BRANCH = """func @f(%0: f64[3], %1: f64[]) -> f64[] {
  %2 = constant {value=0.0, dtype=f64} : f64[]
  %3 = gt %1, %2 : bool[]
  cond_br %3, ^bb1, ^bb2
^bb1:
  %4 = sin %0 : f64[3]
  %5 = mul %4, %1 : f64[3]
  br ^bb3(%5)
^bb2:
  %6 = exp %0 : f64[3]
  br ^bb3(%6)
^bb3(%7: f64[3]):
  %8 = tanh %7 : f64[3]
  %9 = reduce_sum %8 {axes=[0]} : f64[]
  return %9
}
func @g = gradient @f wrt 0, 1
"""


@pytest.mark.parametrize("s", [0.7, -0.4])
def test_gradient_flows_through_branches(s):
    x = np.array([0.3, -0.5, 1.1])
    (gx, gs), m = _grad(BRANCH, "g", [x, np.array(s)])
    assert any(i.op.name == "cond_br" for i in m["g"].instructions()) and len(m["g"].blocks) > 4

    def f(xt, st):
        return torch.tanh(torch.sin(xt) * st).sum() if s > 0 else torch.tanh(torch.exp(xt)).sum()

    tx, ts = torch.tensor(x, requires_grad=True), torch.tensor(s, dtype=torch.float64, requires_grad=True)
    f(tx, ts).backward()
    np.testing.assert_allclose(gx, tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gs, 0.0 if ts.grad is None else ts.grad.numpy(), atol=1e-12)


def test_loops_are_rejected_with_a_clear_error():
    text = """func @f(%0: f64[]) -> f64[] {
  br ^bb1(%0)
^bb1(%1: f64[]):
  %2 = mul %1, %1 : f64[]
  %3 = constant {value=10.0, dtype=f64} : f64[]
  %4 = lt %2, %3 : bool[]
  cond_br %4, ^bb1(%2), ^bb2
^bb2:
  return %2
}
func @g = gradient @f wrt 0
"""
    with pytest.raises(DifferentiationError, match="loop"):
        differentiate(parse(text))


def test_calls_are_inlined_and_differentiated():
    text = """func @sq(%0: f64[3]) -> f64[3] {
  %1 = mul %0, %0 : f64[3]
  return %1
}
func @f(%0: f64[3]) -> f64[] {
  %1 = call @sq(%0) : f64[3]
  %2 = sin %1 : f64[3]
  %3 = reduce_sum %2 {axes=[0]} : f64[]
  return %3
}
func @g = gradient @f wrt 0
"""
    x = np.array([0.1, 0.7, -1.2])
    (gx,), m = _grad(text, "g", [x])
    assert not any(i.op.name == "call" for i in m["g"].instructions())
    np.testing.assert_allclose(gx, np.cos(x * x) * 2 * x, rtol=1e-12)


def test_non_scalar_output_takes_a_trailing_cotangent():
    text = """func @f(%0: f64[2,3]) -> f64[2,3] {
  %1 = exp %0 : f64[2,3]
  return %1
}
func @g = gradient @f wrt 0
"""
    m = differentiate(parse(text))
    assert [str(t) for t in m["g"].param_types] == ["f64[2,3]", "f64[2,3]"]
    x, v = np.ones((2, 3)), np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(evaluate(m["g"], [x, v], m)[0], np.e * v)


def test_dropout_mask_is_reused_not_resampled():
    text = """func @f(%0: f64[4,4], %1: i64[]) -> f64[] {
  %2 = bernoulli %1 {shape=[4, 4], p=0.5} : bool[4,4]
  %3 = constant {value=0.0, dtype=f64} : f64[]
  %4 = select %2, %0, %3 : f64[4,4]
  %5 = mul %4, %4 : f64[4,4]
  %6 = reduce_sum %5 {axes=[0, 1]} : f64[]
  return %6
}
func @g = gradient @f wrt 0
"""
    m = differentiate(parse(text))
    assert sum(i.op.name == "bernoulli" for i in m["g"].instructions()) == 1
    x = np.random.default_rng(4).standard_normal((4, 4))
    seed = np.array(123, dtype=np.int64)
    (gx,) = evaluate(m["g"], [x, seed], m)
    mask = evaluate(parse("""func @m(%0: i64[]) -> bool[4,4] {
  %1 = bernoulli %0 {shape=[4, 4], p=0.5} : bool[4,4]
  return %1
}
""").functions["m"], [seed])[0]
    np.testing.assert_allclose(gx, np.where(mask, 2 * x, 0.0))


# ---------------------------------------------------------------- second order
HVP = """func @f(%0: f64[3,4], %1: f64[4,2]) -> f64[] {
  %2 = matmul %0, %1 : f64[3,2]
  %3 = tanh %2 : f64[3,2]
  %4 = exp %0 : f64[3,4]
  %5 = reduce_max %4 {axes=[1]} : f64[3]
  %6 = reduce_sum %3 {axes=[1]} : f64[3]
  %7 = mul %5, %6 : f64[3]
  %8 = sigmoid %7 : f64[3]
  %9 = div %8, %5 : f64[3]
  %10 = reduce_sum %9 {axes=[0]} : f64[]
  return %10
}
func @df = gradient @f wrt 0, 1
func @h(%0: f64[3,4], %1: f64[4,2], %2: f64[3,4], %3: f64[4,2]) -> f64[] {
  %4, %5 = call @df(%0, %1) : f64[3,4], f64[4,2]
  %6 = mul %4, %2 : f64[3,4]
  %7 = reduce_sum %6 {axes=[0, 1]} : f64[]
  %8 = mul %5, %3 : f64[4,2]
  %9 = reduce_sum %8 {axes=[0, 1]} : f64[]
  %10 = add %7, %9 : f64[]
  return %10
}
func @hvp = gradient @h wrt 0, 1
"""


def test_hessian_vector_product_matches_finite_differences_of_gradients():
    rng = np.random.default_rng(5)
    x, w, u, v = (rng.standard_normal(s) for s in [(3, 4), (4, 2), (3, 4), (4, 2)])
    m = run_pipeline(differentiate(parse(HVP)), CLEAN).module
    hx, hw = evaluate(m["hvp"], [x, w, u, v], m)
    eps = 1e-5
    gp = evaluate(m["df"], [x + eps * u, w + eps * v], m)
    gm = evaluate(m["df"], [x - eps * u, w - eps * v], m)
    np.testing.assert_allclose(hx, (gp[0] - gm[0]) / (2 * eps), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(hw, (gp[1] - gm[1]) / (2 * eps), rtol=1e-6, atol=1e-8)


def test_grad_of_grad_second_derivative():
    text = """func @f(%0: f64[]) -> f64[] {
  %1 = sin %0 : f64[]
  %2 = mul %1, %0 : f64[]
  return %2
}
func @df = gradient @f wrt 0
func @ddf = gradient @df wrt 0
"""
    m = differentiate(parse(text))
    verify(m)
    x = 0.8
    (d2,) = evaluate(m["ddf"], [np.array(x)], m)
    np.testing.assert_allclose(d2, 2 * np.cos(x) - x * np.sin(x), rtol=1e-12)
