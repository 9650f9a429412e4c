"""``precision="fp16"``: the forward under float16 autocast with dynamic loss scaling as
``torch.amp.GradScaler`` does it (scale the loss, unscale the gradients, skip a step whose gradients
overflowed and halve the scale), compared with the eager loop users run."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from _train_util import eager_loss, make


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _eager_fp16_step(model, opt, scaler, inputs, loss_fn):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = eager_loss(model, inputs, loss_fn)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 40])
def test_fp16_follows_the_eager_grad_scaler_loop(init_scale):
    """At the default scale no step overflows; at 2**40 the first steps overflow and are skipped with
    the scale halved each time, exactly as GradScaler does, leaving the parameters untouched."""
    model, inputs, loss_fn = make("gpt")
    m_e = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, optimizer=_sgd(model), precision="fp16", progress=lambda _: None)
    step.loss_scale = init_scale
    o_e, scaler = _sgd(m_e), torch.amp.GradScaler("cpu", init_scale=init_scale)
    for _ in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        skipped = step.report().skipped_steps
        got = step(*inputs)
        want = _eager_fp16_step(m_e, o_e, scaler, inputs, loss_fn)
        assert step.loss_scale == scaler.get_scale()
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        if step.report().skipped_steps > skipped:
            assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    assert (step.report().skipped_steps > 0) == (init_scale > 2.0 ** 30)
    for p, q in zip(model.parameters(), m_e.parameters()):
        assert (p - q).abs().max() <= 1e-3 * max(1.0, float(q.abs().max()))
    assert f"loss scale" in str(step.report()) and step.report().precision == "fp16"


def test_fp16_under_a_budget_measured_equals_predicted():
    model, inputs, loss_fn = make("gpt")
    with pytest.raises(remat.BudgetTooSmall) as e:
        twin = copy.deepcopy(model)
        remat.compile(twin, inputs, loss_fn, optimizer=_sgd(twin), precision="fp16", budget=1)
    step = remat.compile(model, inputs, loss_fn, optimizer=_sgd(model), precision="fp16", budget=e.value.minimum,
                         progress=lambda _: None)
    assert step.compilation.recomputes
    step(*inputs)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= r.budget


def test_fp16_without_the_fused_optimizer_is_refused_clearly():
    model, inputs, loss_fn = make("gpt")
    with pytest.raises(NotImplementedError, match="precision='fp16'.*needs optimizer="):
        remat.compile(model, inputs, loss_fn, precision="fp16")
    step = remat.compile(model, inputs, loss_fn, optimizer=_sgd(model), progress=lambda _: None)
    with pytest.raises(ValueError, match="only a step compiled with precision='fp16'"):
        step.loss_scale = 1024.0


def test_a_checkpoint_resumes_the_loss_scale_and_the_dropout_sequence():
    """``step.state_dict()`` holds the fp16 scaler's state and torch's random state (the dropout
    seeds' source): a fresh compile that loads it continues bit for bit."""
    model, inputs, loss_fn = make("gpt", dropout=0.1)
    start = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, optimizer=_sgd(model), precision="fp16", progress=lambda _: None)
    step.loss_scale = 2.0 ** 24  # a few overflows first: the scale moves, then steps train
    torch.manual_seed(3)
    for _ in range(8):
        step(*inputs)
    assert 0 < step.report().skipped_steps < 8 and step.loss_scale < 2.0 ** 24
    sd = copy.deepcopy(step.state_dict())
    want = float(step(*inputs))
    m2 = copy.deepcopy(start)
    s2 = remat.compile(m2, inputs, loss_fn, optimizer=_sgd(m2), precision="fp16", progress=lambda _: None)
    torch.manual_seed(99)  # overwritten by the checkpoint's random state
    s2.load_state_dict(sd)
    assert float(s2(*inputs)) == want and s2.loss_scale == step.loss_scale
    for p, q in zip(model.parameters(), m2.parameters()):
        assert torch.equal(p, q)
