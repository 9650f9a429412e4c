"""A model whose attention is the fused op keeps remat's promises under budgets: the measured peak
equals the predicted one and fits, and gradients are bit-identical to the unconstrained step
(the flash kernels are deterministic; recomputing attention replays the same numbers)."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from _train_util import eager_loss, grads_of, make


@pytest.fixture(scope="module")
def gpt():
    # Module-scoped fixtures run outside the function-scoped one-thread fixture: set the same
    # thread count here, since native kernels (layer_norm's weight gradient) reduce per thread.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, inputs, loss_fn = make("gpt", batch=4)
        m = copy.deepcopy(model)
        base = remat.compile(m, inputs, loss_fn)
        loss = base(*inputs)
    finally:
        torch.set_num_threads(n)
    return model, inputs, loss_fn, base, loss, grads_of(m)


def _ops(fn):
    return [i.op.name for i in fn.entry.instrs]


def test_unconstrained_step_uses_the_fused_op_and_matches_eager(gpt):
    model, inputs, loss_fn, base, loss, grads = gpt
    ops = _ops(base.program)
    n = len(model.blocks)
    assert ops.count("attention") == n and ops.count("attention_grad") == n and "softmax" not in ops
    ref = copy.deepcopy(model)
    want = eager_loss(ref, inputs, loss_fn)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("solver", ["auto", "greedy"])
def test_budgeted_step_is_exact_and_identical(gpt, solver):
    model, inputs, loss_fn, base, base_loss, base_grads = gpt
    m = copy.deepcopy(model)
    try:
        step = remat.compile(m, inputs, loss_fn, budget="50%", solver=solver)
    except remat.BudgetTooSmall as e:
        step = remat.compile(m, inputs, loss_fn, budget=int(e.minimum), solver=solver)
    loss = step(*inputs)
    r = step.report()
    assert "attention" in _ops(step.program)
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert torch.equal(loss, base_loss)
    for name, g in grads_of(m).items():
        assert torch.equal(g, base_grads[name]), name
