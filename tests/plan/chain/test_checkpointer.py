"""The thesis's PyTorch API (Listing 3.2/3.3) executed for real on the VM."""
from __future__ import annotations

import pytest
import torch

import remat
from remat.plan.chain import SequentialCheckpointer


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).double(), torch.randn(256, 32, dtype=torch.float64)


def _convnet():
    torch.manual_seed(1)
    seq = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding=1),
                              torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return seq.double(), torch.randn(8, 4, 8, 8, dtype=torch.float64)


@pytest.fixture(scope="module", params=[_mlp, _convnet], ids=["mlp", "conv"])
def setup(request):
    seq, x = request.param()
    with torch.no_grad():
        gy = torch.randn_like(seq(x))
    chk = SequentialCheckpointer(seq)
    chk.profile_sequence(x, gy, repeats=1)
    return seq, x, gy, chk


def _autograd(seq, x, gy):
    seq.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    seq(xr).backward(gy)
    return xr.grad, [p.grad.clone() for p in seq.parameters()]


def test_backprop_matches_autograd_and_is_bit_identical_across_budgets(setup):
    seq, x, gy, chk = setup
    ref_x, ref_p = _autograd(seq, x, gy)
    full = chk.solve_optimal_policy(10**12)
    seq.zero_grad(set_to_none=True)
    gx = chk.backprop_sequence(full, x, gy)
    torch.testing.assert_close(gx, ref_x, rtol=1e-10, atol=1e-12)
    for p, r in zip(seq.parameters(), ref_p):
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)
    first = [p.grad.clone() for p in seq.parameters()]
    minimum = None
    with pytest.raises(remat.BudgetTooSmall) as e:
        chk.solve_optimal_policy(1024)
    minimum = e.value.minimum
    assert f"{minimum} bytes" in str(e.value)
    for budget in (minimum, (minimum + full.peak) // 2, full.peak):
        policy = chk.solve_optimal_policy(budget)
        seq.zero_grad(set_to_none=True)
        gx2 = chk.backprop_sequence(policy, x, gy)
        assert chk.last_run.peak_bytes == policy.peak <= budget
        assert torch.equal(gx2, gx)
        assert all(torch.equal(p.grad, g) for p, g in zip(seq.parameters(), first))


def test_grad_accumulates_like_autograd(setup):
    seq, x, gy, chk = setup
    policy = chk.solve_optimal_policy(10**12)
    seq.zero_grad(set_to_none=True)
    chk.backprop_sequence(policy, x, gy)
    once = [p.grad.clone() for p in seq.parameters()]
    chk.backprop_sequence(policy, x, gy)
    for p, g in zip(seq.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


def test_listing_3_3_switches(setup):
    seq, x, gy, chk = setup
    full = chk.solve_optimal_policy(10**12)
    budget = int(full.peak * 0.8)
    for kw in ({"profile_mem": False, "profile_comp": False}, {"profile_comp": False}):
        try:
            p = chk.solve_optimal_policy(budget, **kw)
        except remat.BudgetTooSmall:
            continue
        assert p.peak <= budget
    costs = chk.costs()
    given = {"beta_f": costs.beta_f, "beta_b": costs.beta_b, "tape_bytes": costs.tape_bytes,
             "fwd_overhead": costs.fwd_overhead, "bwd_overhead": costs.bwd_overhead}
    p1 = chk.solve_optimal_policy(full.peak, memory_costs=given)
    assert p1.peak <= full.peak


def test_input_shape_mismatch_is_a_clear_error(setup):
    seq, x, gy, chk = setup
    policy = chk.solve_optimal_policy(10**12)
    with pytest.raises(ValueError, match="profiled for input"):
        chk.backprop_sequence(policy, x[:1], gy[:1])


def test_modules_with_state_are_rejected():
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    chk = SequentialCheckpointer(seq)
    with pytest.raises(ValueError, match="updates buffers or draws random numbers"):
        chk.profile_sequence(torch.randn(8, 4), torch.randn(8, 4))


class _Masked(torch.nn.Module):
    """A layer reading a non-trainable buffer (like a causal mask)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("mask", (torch.arange(8) % 2 == 0).double(), persistent=False)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.mask


def test_buffers_that_are_only_read_are_supported():
    torch.manual_seed(3)
    seq = torch.nn.Sequential(_Masked(), _Masked(), _Masked()).double()
    x, gy = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    ref_x, ref_p = _autograd(seq, x, gy)
    chk = SequentialCheckpointer(seq)
    chk.profile_sequence(x, gy, repeats=1)
    seq.zero_grad(set_to_none=True)
    gx = chk.backprop_sequence(chk.solve_optimal_policy(10**12), x, gy)
    torch.testing.assert_close(gx, ref_x, rtol=1e-10, atol=1e-12)
    for p, r in zip(seq.parameters(), ref_p):
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)
