"""Flexible adjoints measured on the VM, and the Python API over staged functions."""
from __future__ import annotations

import numpy as np
import pytest

import remat
from remat.autodiff import differentiate
from remat.ir import Builder, DType, Function, GradientSpec, Module, TensorType
from remat.pipeline import run_pipeline

N, D, LAYERS = 256, 32, 6  # activations [N, D] dominate the weights [D, D]


def _chain() -> Module:
    """loss(x, w1..wL) = sum(act_L(... act_1(x @ w1) ...)) with relu/tanh alternating."""
    t = TensorType(DType.f32, (N, D))
    w = TensorType(DType.f32, (D, D))
    f = Function("f", [t] + [w] * LAYERS, [TensorType(DType.f32, ())])
    b = Builder(f.entry)
    h = f.params[0]
    for i in range(LAYERS):
        h = b.op("relu" if i % 2 == 0 else "tanh", b.op("matmul", h, f.params[1 + i]))
    b.ret(b.op("reduce_sum", h, axes=[0, 1]))
    return Module([f, Function("g", gradient=GradientSpec("f", tuple(range(1, LAYERS + 1))))])


def _peak(adjoints: str):
    # No CSE here: it would merge an input-keeping rule's recomputed tanh(x) with the forward's.
    m = run_pipeline(differentiate(_chain(), adjoints), ["simplify", "dce"]).module
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((N, D)).astype(np.float32)] + \
           [(rng.standard_normal((D, D)) / 8).astype(np.float32) for _ in range(LAYERS)]
    outs, stats = remat.run(m["g"], *args)
    return outs, stats.peak_bytes


def test_keeping_outputs_lowers_peak_memory_of_the_backward():
    pytest.importorskip("remat.runtime.vm")
    out_o, peak_o = _peak("outputs")
    out_i, peak_i = _peak("inputs")
    for a, b in zip(out_o, out_i):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Keeping inputs keeps each pre-activation alive as well as the activation the next matmul keeps.
    assert peak_o < peak_i, (peak_o, peak_i)
    assert peak_i - peak_o >= (LAYERS - 2) * N * D * 4, (peak_o, peak_i)


def test_grad_and_value_and_grad_over_staged_functions():
    @remat.function
    def loss(x: remat.f64[4, 3], w: remat.f64[3, 2]):
        return remat.ops.reduce_sum(remat.ops.tanh(x @ w))

    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    dw = remat.grad(loss, wrt=1)
    gx_gw = remat.grad(loss, wrt=(0, 1))
    vg = remat.value_and_grad(loss, wrt=1)
    assert "gradient" not in dw.ir and "tanh" in dw.ir
    t = np.tanh(x @ w)
    ref_w = x.T @ (1 - t * t)
    np.testing.assert_allclose(dw(x, w), ref_w, rtol=1e-12)
    gx, gw = gx_gw(x, w)
    np.testing.assert_allclose(gx, (1 - t * t) @ w.T, rtol=1e-12)
    val, gw2 = vg(x, w)
    np.testing.assert_allclose(val, t.sum(), rtol=1e-12)
    np.testing.assert_allclose(gw2, ref_w, rtol=1e-12)
