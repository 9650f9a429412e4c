"""The torch dialect's two f32 GEMMs: ATen's (MKL) ``linear``/``matmul`` and oneDNN's
``linear_onednn``/``matmul_onednn``, which ``torch_kernels.onednn_gemm`` picks for large products
without a transposed left operand. The generated per-op samples are below the threshold, so these
tests build products above it: the choice, the kernel contract, agreement with the numpy
reference, run-to-run determinism, and a training step that runs oneDNN products giving gradients
close to eager's and bit-identical under a budget."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import remat
from remat import backends
from remat.backends import torch_kernels as tk

from test_kernels import as_f64, build, check_contract, run_kernel

pytestmark = pytest.mark.skipif(not tk._onednn_gemm_on(), reason="PyTorch without oneDNN here")

BIG = 2 ** 25  # tk.ONEDNN_MIN_MACS, spelled out: a change of the threshold should be deliberate


def _args(rng, op, m, k, n, transpose_a=False, transpose_b=False, lead=()):
    a = rng.standard_normal(lead + ((k, m) if transpose_a else (m, k))).astype(np.float32)
    if op == "linear":
        return [a, rng.standard_normal((n, k)).astype(np.float32), rng.standard_normal(n).astype(np.float32)], {}
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(np.float32)
    return [a, b], {"transpose_a": transpose_a, "transpose_b": transpose_b}


def test_threshold_is_the_documented_one():
    assert tk.ONEDNN_MIN_MACS == BIG


@pytest.mark.parametrize("op,transpose_b,lead", [("linear", False, ()), ("linear", False, (4,)),
                                                  ("matmul", False, ()), ("matmul", True, ()),
                                                  ("matmul", False, (2,))],
                         ids=["linear", "linear-rank3", "matmul", "matmul-bT", "matmul-rank3"])
def test_large_f32_products_run_on_onednn_and_match_the_reference(op, transpose_b, lead):
    rng = np.random.default_rng(len(lead) * 3 + transpose_b)
    m = 256 // max(1, int(np.prod(lead)))
    args, attrs = _args(rng, op, m, 256, 512, transpose_b=transpose_b, lead=lead)
    ins, attrs = build(op, args, attrs)
    impl = backends.kernel_for(ins, "torch")
    assert impl.fn.__name__ == f"{op}_onednn"
    ops, outs = run_kernel(ins, attrs, args, "torch")
    check_contract(ins, ops, outs, "torch")
    _, ref = run_kernel(ins, attrs, args, "numpy")
    np.testing.assert_allclose(as_f64(outs[0]), as_f64(ref[0]), rtol=2e-5, atol=2e-4)
    again = impl.fn(*ops, **attrs)
    assert torch.equal(again, outs[0]), "oneDNN's product changed between two runs on the same operands"
    mkl = [i for i in backends.dialects()["torch"].kernels[op] if i.fn.__name__ == op][0]
    np.testing.assert_allclose(as_f64(mkl.fn(*ops, **attrs)), as_f64(outs[0]), rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize("case", ["small", "transpose_a", "f64", "batched-b"])
def test_other_products_stay_with_aten(case):
    rng = np.random.default_rng(1)
    op = "linear" if case == "f64" else "matmul"
    if case == "small":
        args, attrs = _args(rng, op, 64, 64, 64)
    elif case == "transpose_a":  # a weight gradient: oneDNN would copy the transposed operand
        args, attrs = _args(rng, op, 512, 256, 512, transpose_a=True)
    elif case == "f64":
        args, attrs = _args(rng, op, 512, 256, 512)
        args = [a.astype(np.float64) for a in args]
    else:  # a batched right operand (attention's products): bmm
        a = rng.standard_normal((4, 256, 256)).astype(np.float32)
        args, attrs = [a, a.copy()], {"transpose_a": False, "transpose_b": False}
    ins, attrs = build(op, args, attrs)
    assert not tk.onednn_gemm(ins)
    assert backends.kernel_for(ins, "torch").fn.__name__ == op


def test_the_switch_turns_it_off(monkeypatch):
    # REMAT_ONEDNN_GEMM=0 in the environment sets tk.ONEDNN_GEMM to False when the kernels are imported
    args, attrs = _args(np.random.default_rng(2), "linear", 512, 256, 512)
    ins, _ = build("linear", args, attrs)
    assert tk.onednn_gemm(ins)
    monkeypatch.setattr(tk, "ONEDNN_GEMM", False)
    assert not tk.onednn_gemm(ins)
    assert backends.kernel_for(ins, "torch").fn.__name__ == "linear"


def test_workspaces_are_measured_per_implementation(monkeypatch):
    from remat.runtime import allocator

    args, attrs = _args(np.random.default_rng(3), "linear", 512, 256, 512)
    ins, _ = build("linear", args, attrs)
    ins.dialect = "torch"
    allocator.clear_cache()
    on = allocator._kernel_key(ins, None)
    monkeypatch.setattr(tk, "ONEDNN_GEMM", False)
    allocator.clear_cache()
    off = allocator._kernel_key(ins, None)
    allocator.clear_cache()
    assert "linear_onednn" in on and "linear_onednn" not in off and on != off


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(128, 256), nn.ReLU()]
        for _ in range(4):
            layers += [nn.Linear(256, 256), nn.ReLU()]
        self.body = nn.Sequential(*layers, nn.Linear(256, 10))

    def forward(self, x):
        return self.body(x)


def test_a_step_with_onednn_products_matches_eager_and_is_bit_identical_under_a_budget():
    torch.manual_seed(0)
    model = _Wide()
    x, y = torch.randn(1024, 128), torch.randint(0, 10, (1024,))  # activations dominate
    loss_fn = nn.functional.cross_entropy
    eager = copy.deepcopy(model)
    loss_fn(eager(x), y).backward()
    runs = []
    for budget in (None, "80%"):
        m = copy.deepcopy(model)
        step = remat.compile(m, (x, y), loss_fn, budget=budget)
        kernels = {ins.op.name + ":" + backends.kernel_for(ins, "torch").fn.__name__
                   for ins in step.program.entry.instrs if ins.op.name in ("linear", "matmul")}
        assert {"linear:linear_onednn", "matmul:matmul_onednn", "matmul:matmul"} <= kernels
        loss = step(x, y)
        if budget is not None:
            assert step.report().recomputed_instructions > 0
        runs.append((loss, {n: p.grad for n, p in m.named_parameters()}))
    (l0, g0), (l1, g1) = runs
    assert torch.equal(l0, l1)
    for n, p in eager.named_parameters():
        assert torch.equal(g0[n], g1[n]), f"{n}: the budgeted step's gradient differs"
        assert (g0[n] - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max().item()), n
