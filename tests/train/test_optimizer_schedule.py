"""The fused optimizer follows ``optimizer.param_groups`` at every step: learning-rate schedules,
parameter groups with their own settings, changed hyperparameters and gradient clipping give the
parameters eager PyTorch's loop gives (``zero_grad, backward, clip_grad_norm_, step, scheduler.step``)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import remat
from _train_util import batches, make, rel_err


def _groups(model, weight_decay: float):
    """Two param groups, as recipes make them: no weight decay on biases (1-d parameters)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    plain = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def _warmup_cosine(opt, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _train(model, data, make_opt, steps: int, compiled: bool, loss_fn, budget=None, max_grad_norm=None,
           change=None):
    opt = make_opt(model)
    sched = _warmup_cosine(opt, 2, steps)
    losses = []
    step = None
    if compiled:
        if budget == "minimum":  # the least budget any plan meets: the step recomputes
            probe = copy.deepcopy(model)
            with pytest.raises(remat.BudgetTooSmall) as e:
                remat.compile(probe, data[0], loss_fn, optimizer=make_opt(probe), budget=1, max_grad_norm=max_grad_norm)
            budget = e.value.minimum
        step = remat.compile(model, data[0], loss_fn, optimizer=opt, budget=budget, max_grad_norm=max_grad_norm)
    with warnings.catch_warnings():  # (restored after: the filter must not reach other tests)
        warnings.simplefilter("error", UserWarning)  # e.g. "lr_scheduler.step() before optimizer.step()"
        for k in range(steps):
            if change is not None:
                change(opt, k)
            x, y = data[k % len(data)]
            if compiled:
                loss = step(x, y)
            else:
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    return losses, step


def _compare(name: str, make_opt, steps: int = 6, budget=None, max_grad_norm=None, change=None, tol=1e-4):
    model, inputs, loss_fn = make(name)
    data = batches(inputs, 3)
    eager_model, remat_model = copy.deepcopy(model), copy.deepcopy(model)
    want, _ = _train(eager_model, data, make_opt, steps, False, loss_fn, max_grad_norm=max_grad_norm, change=change)
    got, step = _train(remat_model, data, make_opt, steps, True, loss_fn, budget=budget, max_grad_norm=max_grad_norm,
                       change=change)
    assert all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
    for (n, p), q in zip(remat_model.named_parameters(), eager_model.parameters()):
        assert rel_err(p, q) <= tol, f"{n}: {rel_err(p, q):.2e}"
    return step


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_adamw_with_warmup_cosine_and_two_param_groups_follows_eager(budget):
    step = _compare("gpt", lambda m: torch.optim.AdamW(_groups(m, 0.1), lr=3e-3, betas=(0.9, 0.95)), budget=budget)
    r = step.report()
    assert r.measured_peak == r.predicted_peak
    if budget is not None:
        assert r.measured_peak <= r.budget and r.recomputed_instructions > 0


def test_sgd_momentum_with_a_schedule_and_changed_hyperparameters_follows_eager():
    """Momentum, dampening and weight decay changed mid-run (as a user might), with a schedule."""
    def change(opt, k):
        if k == 3:
            opt.param_groups[0]["momentum"] = 0.5
            opt.param_groups[1]["weight_decay"] = 0.01
            opt.param_groups[0]["dampening"] = 0.1

    _compare("mlp", lambda m: torch.optim.SGD(_groups(m, 1e-3), lr=0.05, momentum=0.9), change=change)


def test_adam_with_betas_and_eps_changed_after_compile_follows_eager():
    def change(opt, k):
        if k == 2:
            for g in opt.param_groups:
                g["betas"] = (0.8, 0.99)
                g["eps"] = 1e-6

    _compare("mlp", lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), change=change)


@pytest.mark.parametrize("budget", [None, "minimum"])
def test_gradient_clipping_by_global_norm_follows_clip_grad_norm(budget):
    """A max_grad_norm small enough that every step clips, under a schedule, two param groups."""
    step = _compare("gpt", lambda m: torch.optim.AdamW(_groups(m, 0.1), lr=3e-3), budget=budget, max_grad_norm=0.05)
    r = step.report()
    assert any("gradient clipping" in n for n in r.solver_notes)
    assert r.measured_peak == r.predicted_peak
    assert budget is None or (r.measured_peak <= r.budget and r.recomputed_instructions > 0)
    # the least budget is a second backward's: keeping every gradient needs more
    assert r.clip_strategy == ("keep gradients" if budget is None else "second backward")


def test_max_grad_norm_without_a_fused_optimizer_is_refused_with_the_alternative():
    model, inputs, loss_fn = make("mlp")
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        remat.compile(model, inputs, loss_fn, max_grad_norm=1.0)
