"""DSL functions run on the VM: results match NumPy, cond takes both branches, calls, argument
checking by parameter name, the per-signature cache, and both dialects."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat.frontend.dsl import ops

RNG = np.random.default_rng(0)


def arr(*shape, dtype=np.float32, low=-1.0, high=1.0):
    return RNG.uniform(low, high, size=shape).astype(dtype)


def check(fn, args, expected, dialects=("numpy",), rtol=1e-5, atol=1e-6):
    staged = remat.function(fn)
    outs, stats = staged.run(*args, dialects=list(dialects))
    outs = outs if isinstance(outs, tuple) else (outs,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected):
        e = np.asarray(e)
        assert o.shape == e.shape, (o.shape, e.shape)
        np.testing.assert_allclose(o.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
    assert stats.peak_bytes > 0
    return staged


X, Y, V = arr(2, 3), arr(3), arr(2, 3, 4)
POS = arr(2, 3, low=0.5, high=2.0)

OPERATOR_CASES = {
    "add": (lambda x, y: x + y, (X, Y), X + Y),
    "sub": (lambda x, y: 1.5 - x - y, (X, Y), 1.5 - X - Y),
    "mul": (lambda x, y: x * y * 2, (X, Y), X * Y * 2),
    "div": (lambda x, y: x / (y + 3.0), (X, Y), X / (Y + 3.0)),
    "pow": (lambda x: x ** 2 + 2 ** x, (POS,), POS ** 2 + 2 ** POS),
    "neg_abs": (lambda x: -abs(x), (X,), -np.abs(X)),
    "matmul": (lambda a, b: a @ b, (arr(2, 3), arr(3, 4)), None),
    "matvec": (lambda a, v: a @ v, (arr(2, 3), arr(3)), None),
    "compare": (lambda x, y: ((x < y) & (x >= -0.5)) | ~(x != y), (X, Y), ((X < Y) & (X >= -0.5)) | ~(X != Y)),
    "eq_xor": (lambda x: (x > 0) ^ (x == x), (X,), (X > 0) ^ (X == X)),
    "methods": (lambda x: (x.exp(), x.tanh(), x.relu(), x.sigmoid(), (x * x + 1).sqrt().log()),
                (X,), (np.exp(X), np.tanh(X), np.maximum(X, 0), 1 / (1 + np.exp(-X)), np.log(np.sqrt(X * X + 1)))),
    "reductions": (lambda v: (v.sum(), v.sum(axis=1), v.mean(axis=(0, -1), keepdims=True), v.max(0), v.min(axis=-1)),
                   (V,), (V.sum(), V.sum(axis=1), V.mean(axis=(0, 2), keepdims=True), V.max(0), V.min(axis=-1))),
    "shapes": (lambda v: (v.reshape(4, -1), v.transpose(2, 0, 1), v.T, v.transpose()),
               (V,), (V.reshape(4, -1), V.transpose(2, 0, 1), V.swapaxes(-1, -2), V.transpose())),
    "astype": (lambda x: (x * 10).astype(remat.i32).astype(remat.f64), (X,), (X * 10).astype(np.int32).astype(np.float64)),
    "softmax": (lambda x: (ops.softmax(x, axis=1), ops.log_softmax(x, 0)), (X,),
                (np.exp(X) / np.exp(X).sum(1, keepdims=True), X - np.log(np.exp(X).sum(0, keepdims=True)))),
    "where": (lambda x: ops.where(x > 0, x, 0.1 * x), (X,), np.where(X > 0, X, 0.1 * X)),
    "concat_pad": (lambda x: (ops.concat([x, -x], axis=1), ops.pad(x, [1, 0], [0, 2], value=9.0)), (X,),
                   (np.concatenate([X, -X], 1), np.pad(X, [(1, 0), (0, 2)], constant_values=9.0))),
    "iota_onehot": (lambda lab: ops.one_hot(lab, 4), (np.array([2, 0, 3], np.int64),), np.eye(4, dtype=np.float32)[[2, 0, 3]]),
}


@pytest.mark.parametrize("name", list(OPERATOR_CASES))
def test_results_match_numpy(name):
    fn, args, expected = OPERATOR_CASES[name]
    if expected is None:
        expected = np.matmul(*args)
    check(fn, args, expected)


INDEX_KEYS = [
    (1,), (-1,), (slice(1, 3),), (slice(None), 2), (Ellipsis, 0), (slice(None, None, 2),), (slice(None, None, -1),),
    (slice(3, 0, -2), Ellipsis, 1), (None, 1), (1, None, slice(2, 4), Ellipsis), ([2, 0, -1],),
    (slice(None), [1, 1]), (slice(1, 4), slice(None), slice(5, None, -3)),
]


@pytest.mark.parametrize("key", INDEX_KEYS, ids=[str(k) for k in INDEX_KEYS])
def test_indexing_matches_numpy(key):
    x = arr(4, 5, 6)
    check(lambda t: t[key], (x,), x[key])


def test_tensor_index_matches_numpy():
    table, idx, cols = arr(10, 3), np.array([[1, 9], [0, 4]], np.int64), np.array([2, 0, 2], np.int32)
    check(lambda t, i, j: (t[i], t[:, j], ops.gather(t, i[1], axis=0)), (table, idx, cols),
          (table[idx], table[:, cols], table[idx[1]]))


def test_conv_pool_match_torch():
    x, w, b = arr(2, 3, 8, 8), arr(4, 3, 3, 3), arr(4)

    def f(x, w, b):
        y = ops.conv2d(x, w, b, padding=1)
        return ops.max_pool2d(y, 2), ops.avg_pool2d(y, 2)

    tx, tw, tb = map(torch.from_numpy, (x, w, b))
    y = torch.nn.functional.conv2d(tx, tw, tb, padding=1)
    expected = (torch.nn.functional.max_pool2d(y, 2).numpy(), torch.nn.functional.avg_pool2d(y, 2).numpy())
    check(f, (x, w, b), expected, rtol=1e-4, atol=1e-5)


def test_random_ops_are_deterministic_in_the_seed():
    @remat.function
    def f(seed: remat.i64[()]):
        return ops.uniform(seed, (1000,)), ops.dropout(ops.ones((1000,)), 0.25, ops.fold_seed(seed, 1))

    u1, d1 = f(np.int64(3))
    u2, d2 = f(3)
    u3, _ = f(4)
    np.testing.assert_array_equal(u1, u2)
    np.testing.assert_array_equal(d1, d2)
    assert not np.array_equal(u1, u3)
    assert 0.0 <= u1.min() and u1.max() < 1.0
    kept = d1[d1 != 0]
    np.testing.assert_allclose(kept, 1 / 0.75, rtol=1e-6)
    assert 0.6 < kept.size / 1000 < 0.9


# ---------------------------------------------------------------- cond and calls
@remat.function
def _abs_or_double(x: remat.f32[3]):
    return remat.cond(x.sum() > 0, lambda v: (v * 2, 1.0), lambda v: (-v, 0.0), x)


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_cond_takes_both_branches(dialect):
    pos, neg = np.array([1, 2, -1], np.float32), np.array([-1, -2, 1], np.float32)
    (y, flag), _ = _abs_or_double.run(pos, dialects=[dialect])
    np.testing.assert_allclose(y, pos * 2)
    assert flag.shape == () and float(flag) == 1.0
    (y, flag), _ = _abs_or_double.run(neg, dialects=[dialect])
    np.testing.assert_allclose(y, -neg)
    assert float(flag) == 0.0


def test_nested_cond_runs():
    @remat.function
    def sign3(x: remat.f32[()]):
        return remat.cond(x > 0, lambda: 1.0, lambda: remat.cond(x < 0, lambda: -1.0, lambda: 0.0))

    assert [float(sign3(v)) for v in (2.0, -3.0, 0.0)] == [1.0, -1.0, 0.0]


def test_calls_run():
    @remat.function
    def layer(x, w):
        return (x @ w).tanh()

    @remat.function
    def net(x: remat.f32[2, 4], w1: remat.f32[4, 4], w2: remat.f32[4, 3]):
        return layer(layer(x, w1), w2)

    x, w1, w2 = arr(2, 4), arr(4, 4), arr(4, 3)
    np.testing.assert_allclose(net(x, w1, w2), np.tanh(np.tanh(x @ w1) @ w2), rtol=1e-5, atol=1e-6)
    assert list(net.module.functions) == ["net", "layer", "layer_1"]


# ---------------------------------------------------------------- arguments, cache, dialects
@remat.function
def _affine(x: remat.f32[2, 3], w: remat.f32[3, 4], b):
    return x @ w + b


def test_argument_errors_name_the_parameter():
    x, w, b = arr(2, 3), arr(3, 4), arr(4)
    with pytest.raises(TypeError, match="@_affine: parameter 'w' expects f32\\[3,4\\], got f32\\[4,3\\]"):
        _affine(x, w.T.copy(), b)
    with pytest.raises(TypeError, match="@_affine: parameter 'x' expects f32\\[2,3\\], got f64\\[2,3\\]"):
        _affine(x.astype(np.float64), w, b)
    with pytest.raises(TypeError, match="@_affine takes 3 argument\\(s\\) \\(x, w, b\\), got 2"):
        _affine(x, w)
    with pytest.raises(TypeError, match="parameter 'x' expects f32\\[2,3\\], got float 1.0"):
        _affine(1.0, w, b)
    with pytest.raises(TypeError, match="parameter 'b' takes an array"):
        _affine(x, w, "b")


def test_compiled_once_per_signature():
    @remat.function
    def f(x, y: remat.f32[()]):
        return x * y

    a = f(arr(3), 2.0)
    b = f(arr(3), np.float32(3.0))
    assert f.trace_count == 1 and len(f.signatures) == 1
    vm = f._cache[f.signatures[0]].vm(None)
    f(arr(3), 4)
    assert f._cache[f.signatures[0]].vm(None) is vm  # the prepared VM is reused too
    f(arr(2, 2), 1.0)
    assert f.trace_count == 2 and f.signatures[1] == (remat.f32[2, 2], remat.f32[()])
    assert a.shape == b.shape == (3,)


def test_scalars_and_torch_arguments():
    @remat.function
    def f(x, n, flag):
        return x * 2, n + 1, ~flag

    (x2, n1, nf) = f(torch.ones(2, dtype=torch.float64), 4, True)
    assert x2.dtype == np.float64 and n1.dtype == np.int64 and nf.dtype == np.bool_
    assert f.signatures[0] == (remat.f64[2], remat.i64[()], remat.bool_[()])
    assert int(n1) == 5 and bool(nf) is False
    y = f(torch.ones(3, dtype=torch.bfloat16), 1, False)[0]
    assert y.dtype == remat.DType.bf16.numpy


def test_both_dialects_agree_and_last_stats():
    x, w, b = arr(2, 3), arr(3, 4), arr(4)
    yn, sn = _affine.run(x, w, b, dialects=["numpy"])
    yt, st = _affine.run(x, w, b, dialects=["torch"])
    np.testing.assert_allclose(yn, yt, rtol=1e-6, atol=1e-6)
    assert _affine.last_stats is st
    assert sn.peak_bytes == st.peak_bytes
    assert "numpy.matmul" in str(_affine._last.vm(["numpy"]).module)


def test_from_module_runs_with_positional_names():
    s = remat.Staged.from_module(remat.parse("func @f(%0: f32[2]) -> f32[2] {\n  %1 = exp %0 : f32[2]\n  return %1\n}\n"), "f")
    np.testing.assert_allclose(s(np.zeros(2, np.float32)), [1.0, 1.0])
    with pytest.raises(TypeError, match="parameter '%0' expects f32\\[2\\], got f32\\[3\\]"):
        s(np.zeros(3, np.float32))


def test_grad_of_a_staged_function():
    @remat.function
    def loss(w, x):
        return ((x @ w).tanh() ** 2).sum()

    w, x = arr(3, 2, dtype=np.float64), arr(4, 3, dtype=np.float64)
    g = remat.grad(loss, wrt=0)(w, x)
    t = torch.from_numpy(w).requires_grad_()
    (torch.tanh(torch.from_numpy(x) @ t) ** 2).sum().backward()
    np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-8)


def test_vjp_of_a_non_scalar_output_takes_the_cotangent():
    @remat.function
    def f(x):
        return x.tanh() * 2

    x, ct = arr(3, dtype=np.float64), arr(3, dtype=np.float64)
    vjp = remat.grad(f, wrt=0)
    np.testing.assert_allclose(vjp(x, ct), ct * 2 * (1 - np.tanh(x) ** 2), rtol=1e-10)
    fixed = vjp.specialize(remat.f64[3])
    assert fixed.param_names == ("x", "%1")
    np.testing.assert_allclose(fixed(x, ct), vjp(x, ct))
    with pytest.raises(TypeError, match="parameter '%1' expects f64\\[3\\], got f64\\[2\\]"):
        fixed(x, ct[:2].copy())
