"""The non-finite guard of the fused update (``remat.compile(on_nonfinite=...)``).

A batch whose loss or any gradient has a NaN or infinite element changes nothing, as
``torch.amp.GradScaler`` skips its step: parameters, AdamW ``exp_avg`` / ``exp_avg_sq`` / ``step``
and SGD momentum buffers stay bit-identical, the next good batch trains exactly as if the bad one
had not happened, and ``on_nonfinite="raise"`` raises ``remat.NonFiniteStep`` instead.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from _train_util import assert_snapshot_equal, make_deep_mlp, snapshot
from remat import zoo

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def _mlp():
    model, (x, y), loss_fn = zoo.make("mlp", "tiny")
    return model, x, y, loss_fn


def _good(x: torch.Tensor, k: int) -> torch.Tensor:
    return x + 0.1 * k


def _nan_input(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[1, 3] = float("nan")
    return bad


class SqrtNet(nn.Module):
    """A linear layer plus ``sqrt(a + x[:, :1])``: where ``a + x = 0`` exactly, the forward is finite
    (sqrt(0) = 0) but the gradient of ``a`` is infinite (1 / (2 sqrt(0)))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3)
        self.a = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.lin(x) + torch.sqrt(self.a + x[:, :1])


def _sqrt_batch(k: int):
    g = torch.Generator().manual_seed(k)
    return torch.rand(6, 4, generator=g) + 0.5, torch.randn(6, 3, generator=g)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_nan_loss_skips_the_step_and_the_next_batch_trains_as_if_it_had_not_happened(opt_name):
    model, x, y, loss_fn = _mlp()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref_model.parameters())
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, on_nonfinite="skip")
    ref = remat.compile(ref_model, (x, y), loss_fn, optimizer=ref_opt, on_nonfinite="skip")
    for k in range(2):
        step(_good(x, k), y)
        ref(_good(x, k), y)
    before = snapshot(model, opt)
    loss = step(_nan_input(x), y)
    assert torch.isnan(loss)
    assert_snapshot_equal(snapshot(model, opt), before)  # parameters, exp_avg, exp_avg_sq, step, momentum
    assert step.report().skipped_steps == 1 and ref.report().skipped_steps == 0
    for k in range(2, 4):
        step(_good(x, k), y)
        ref(_good(x, k), y)
    assert_snapshot_equal(snapshot(model, opt), snapshot(ref_model, ref_opt))
    assert "1 step(s) skipped" in str(step.report())


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_an_infinite_gradient_with_a_finite_loss_skips_every_update(opt_name):
    model, ref_model = SqrtNet(), SqrtNet()
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref_model.parameters())
    x, y = _sqrt_batch(0)
    step = remat.compile(model, (x, y), F.mse_loss, optimizer=opt, on_nonfinite="skip", check_gradients=True)
    ref = remat.compile(ref_model, (x, y), F.mse_loss, optimizer=ref_opt, on_nonfinite="skip", check_gradients=True)
    for k in range(2):
        step(*_sqrt_batch(k))
        ref(*_sqrt_batch(k))
    bx, by = _sqrt_batch(7)
    bx[2, 0] = -model.a.detach()[0]  # a + x = 0 exactly in row 2
    eager = copy.deepcopy(model)
    eager_loss = F.mse_loss(eager(bx), by)
    eager_loss.backward()
    assert torch.isfinite(eager_loss) and torch.isinf(eager.a.grad).all()  # the case: only a gradient is infinite
    assert torch.isfinite(eager.lin.weight.grad).all()
    before = snapshot(model, opt)
    loss = step(bx, by)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(eager_loss.item(), rel=1e-6)
    assert_snapshot_equal(snapshot(model, opt), before)  # not one parameter updated, the finite ones neither
    for k in range(2, 4):
        step(*_sqrt_batch(k))
        ref(*_sqrt_batch(k))
    assert_snapshot_equal(snapshot(model, opt), snapshot(ref_model, ref_opt))
    assert step.report().skipped_steps == 1


def test_a_bad_first_step_creates_no_optimizer_state():
    """As GradScaler skipping optimizer.step(): the optimizer has no state until a step is taken."""
    model, x, y, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, on_nonfinite="skip")
    before = snapshot(model, opt)
    step(_nan_input(x), y)
    assert not opt.state and step.report().skipped_steps == 1
    assert_snapshot_equal(snapshot(model, opt), before)
    step(x, y)
    assert all(int(s["step"]) == 1 for s in opt.state.values())


def test_raise_names_the_step_and_leaves_state_untouched():
    model, x, y, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, on_nonfinite="raise")
    step(x, y)
    step(_good(x, 1), y)
    before = snapshot(model, opt)
    with pytest.raises(remat.NonFiniteStep, match=r"training step 3 \(optimizer step 3\): the loss is nan") as e:
        step(_nan_input(x), y)
    assert e.value.step == 3 and e.value.call == 3
    assert_snapshot_equal(snapshot(model, opt), before)
    step(_good(x, 2), y)  # training goes on
    assert all(int(s["step"]) == 3 for s in opt.state.values())


def test_raise_on_a_gradient_says_the_loss_was_finite():
    model = SqrtNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _sqrt_batch(0)
    step = remat.compile(model, (x, y), F.mse_loss, optimizer=opt, on_nonfinite="raise", check_gradients=True)
    step(x, y)
    before = snapshot(model, opt)
    bx, by = _sqrt_batch(1)
    bx[0, 0] = -model.a.detach()[0]
    with pytest.raises(remat.NonFiniteStep, match="the loss is finite .* but a gradient"):
        step(bx, by)
    assert_snapshot_equal(snapshot(model, opt), before)


def test_guarded_under_a_budget_measured_equals_predicted():
    model, (x, y), loss_fn = make_deep_mlp(batch=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin = copy.deepcopy(model)
    base = remat.compile(twin, (x, y), loss_fn, optimizer=torch.optim.AdamW(twin.parameters()),
                         on_nonfinite="skip", check_gradients=True)
    budget = int(base.report().unconstrained_peak * 0.6)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, budget=budget, measure_allocator=False,
                         on_nonfinite="skip", check_gradients=True)  # (the loss stays finite here: ReLU)
    assert step.compilation.recomputes
    step(x, y)
    before = snapshot(model, opt)
    bad = x.clone()
    bad[5, 2] = float("inf")
    step(bad, y)
    assert_snapshot_equal(snapshot(model, opt), before)
    r = step.report()
    assert r.skipped_steps == 1 and r.measured_peak == r.predicted_peak <= budget
    step(x, y)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= budget


def test_micro_batched_step_is_guarded():
    model, x, y, loss_fn = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, micro_batches=2, on_nonfinite="skip")
    step(x, y)
    before = snapshot(model, opt)
    step(_nan_input(x), y)  # the NaN is in the first micro-batch only
    assert_snapshot_equal(snapshot(model, opt), before)
    assert step.report().skipped_steps == 1


def test_off_updates_follow_their_gradients_and_a_nan_reaches_the_parameters():
    """on_nonfinite=None: the unguarded fused mode (the least memory), documented as such."""
    model, x, y, loss_fn = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt, on_nonfinite=None)
    names = [i.op.name for i in step.program.entry.instrs]
    assert "nonfinite" not in names and names.index("sgd_step") < len(names) - 1 - names.count("sgd_step")
    step(_nan_input(x), y)
    assert step.report().on_nonfinite is None and step.report().skipped_steps == 0
    assert any(torch.isnan(p).any() for p in model.parameters())


def test_the_default_checks_the_loss_at_no_cost_and_warns_once():
    """The default guard checks the loss only, known before the first gradient: each update still
    follows its own gradient and the peak is the unguarded step's; a bad batch is skipped, with one
    warning. A NaN only in a gradient passes (check_gradients=True stops it)."""
    model, x, y, loss_fn = _mlp()
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, (x, y), loss_fn, optimizer=opt)
    off = remat.compile(twin, (x, y), loss_fn, optimizer=torch.optim.AdamW(twin.parameters(), lr=1e-2),
                        on_nonfinite=None)
    names = [i.op.name for i in step.program.entry.instrs]
    assert names.count("nonfinite") == 1 and names.index("adam_step") < len(names) - 1 - names.count("adam_step")
    assert step.predicted_peak == off.predicted_peak
    step(x, y)
    before = snapshot(model, opt)
    with pytest.warns(RuntimeWarning, match="skipped"):
        step(_nan_input(x), y)
    assert_snapshot_equal(snapshot(model, opt), before)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(_nan_input(x), y)  # counted, not warned again
    assert step.report().skipped_steps == 2 and step.report().on_nonfinite == "skip"


def test_invalid_option_is_refused():
    model, x, y, loss_fn = _mlp()
    with pytest.raises(ValueError, match="on_nonfinite must be"):
        remat.compile(model, (x, y), loss_fn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      on_nonfinite="ignore")
