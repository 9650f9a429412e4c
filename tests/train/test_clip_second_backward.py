"""Clipping by the global norm without keeping every gradient: under a budget that keeping them does
not meet, the step runs a norm pass (forward and backward, each gradient's squares summed and the
gradient dropped) and then the fused step, each update scaled by the clip coefficient. Parameters
and buffers follow eager PyTorch's ``zero_grad, backward, clip_grad_norm_, step``; the planner
chooses between the two strategies and the report says which."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from _train_util import batches, eager_loss, make, rel_err

KEEP, SECOND = "keep gradients", "second backward"


def _refusal(model, inputs, loss_fn, **options) -> remat.BudgetTooSmall:
    probe = copy.deepcopy(model)
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(probe, inputs, loss_fn, optimizer=torch.optim.AdamW(probe.parameters()), budget=1, **options)
    return e.value


def _bn_mlp():
    """Wide layers and a small batch: the gradients outweigh the activations, and batch norms
    update running statistics (buffers) once per step. (No bias before a batch norm: its gradient
    is rounding noise, which Adam would amplify differently in eager PyTorch and in remat.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 192, bias=False), nn.BatchNorm1d(192), nn.ReLU(),
                          nn.Linear(192, 192, bias=False), nn.BatchNorm1d(192), nn.ReLU(), nn.Linear(192, 10))
    return model, (torch.randn(8, 32), torch.randint(0, 10, (8,))), F.cross_entropy


def _eager(model, data, loss_fn, steps: int, max_norm: float, make_opt) -> list[float]:
    opt = make_opt(model)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = eager_loss(model, data[k % len(data)], loss_fn)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(float(loss))
    return losses


def _compare(model, inputs, loss_fn, budget, steps=4, max_norm=0.05, tol=1e-4, **options):
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)  # noqa: E731
    data = batches(inputs, 3)
    eager_model, remat_model = copy.deepcopy(model), copy.deepcopy(model)
    want = _eager(eager_model, data, loss_fn, steps, max_norm, make_opt)
    step = remat.compile(remat_model, data[0], loss_fn, optimizer=make_opt(remat_model), budget=budget,
                         max_grad_norm=max_norm, **options)
    got = [float(step(*data[k % len(data)])) for k in range(steps)]
    assert all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
    for (n, p), q in zip(remat_model.named_parameters(), eager_model.parameters()):
        assert rel_err(p, q) <= tol, f"{n}: {rel_err(p, q):.2e}"
    for (n, p), q in zip(remat_model.named_buffers(), eager_model.buffers()):
        assert (torch.equal(p, q) if not p.is_floating_point() else rel_err(p, q) <= tol), n
    return step


def test_a_budget_keeping_the_gradients_misses_clips_with_a_second_backward_as_eager_does():
    model, inputs, loss_fn = make("gpt")
    refusal = _refusal(model, inputs, loss_fn, max_grad_norm=0.05)
    assert "keeping every gradient needs at least" in str(refusal) and "second backward" in str(refusal)
    step = _compare(model, inputs, loss_fn, refusal.minimum)
    r = step.report()
    assert r.clip_strategy == SECOND and "gradient clipping" in str(r) and "second backward" in str(r)
    assert any("by a second backward" in n and "keeping every gradient needs at least" in n for n in r.solver_notes)
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert r.predicted_overhead > 0.5  # a whole forward and backward more


def test_batch_norm_statistics_are_updated_once_per_step_by_the_second_pass():
    model, inputs, loss_fn = _bn_mlp()
    refusal = _refusal(model, inputs, loss_fn, max_grad_norm=0.05)
    step = _compare(model, inputs, loss_fn, refusal.minimum)  # running statistics compared too
    r = step.report()
    assert r.clip_strategy == SECOND and r.measured_peak == r.predicted_peak <= r.budget


@pytest.mark.parametrize("what", ["dropout", "fp16"])
def test_a_second_backward_gives_the_bits_keeping_the_gradients_gives(what):
    """Dropout: the norm pass and the update pass share the step's seed, so the gradients the norm
    is taken of are those the updates use. fp16: each gradient is unscaled before its squares are
    summed and before its update. The norm's sums are added in the same order from the same values
    either way, so parameters are bit-identical to clipping with the gradients kept."""
    model, inputs, loss_fn = make("gpt", dropout=0.1 if what == "dropout" else 0.0)
    options = dict(max_grad_norm=0.05, seed=0, algorithms="reference")
    if what == "fp16":
        options["precision"] = "fp16"
    minimum = _refusal(model, inputs, loss_fn, **options).minimum
    kept, twice = copy.deepcopy(model), copy.deepcopy(model)
    a = remat.compile(kept, inputs, loss_fn, optimizer=torch.optim.AdamW(kept.parameters(), lr=1e-3), **options)
    b = remat.compile(twice, inputs, loss_fn, optimizer=torch.optim.AdamW(twice.parameters(), lr=1e-3),
                      budget=minimum, **options)
    assert (a.report().clip_strategy, b.report().clip_strategy) == (KEEP, SECOND)
    for x in batches(inputs, 3):
        assert float(a(*x)) == float(b(*x))
    for p, q in zip(kept.parameters(), twice.parameters()):
        assert torch.equal(p, q)
    r = b.report()
    assert r.measured_peak == r.predicted_peak <= r.budget


def test_the_faster_strategy_that_fits_is_chosen_and_the_minimum_is_the_lesser_of_both():
    model, inputs, loss_fn = make("gpt")
    refusal = _refusal(model, inputs, loss_fn, max_grad_norm=1.0)
    step = remat.compile(model, inputs, loss_fn, optimizer=torch.optim.AdamW(model.parameters()), budget="100%",
                         max_grad_norm=1.0)
    r = step.report()
    assert r.clip_strategy == KEEP and r.recomputed_instructions == 0
    assert any("a second backward was not planned" in n for n in r.solver_notes)
    assert step.minimum_budget() == refusal.minimum


def test_a_nonfinite_gradient_skips_the_step_in_both_passes_mode():
    model, inputs, loss_fn = _bn_mlp()
    refusal = _refusal(model, inputs, loss_fn, max_grad_norm=0.05)
    opt = torch.optim.AdamW(model.parameters())
    step = remat.compile(model, inputs, loss_fn, optimizer=opt, budget=refusal.minimum, max_grad_norm=0.05)
    assert step.report().clip_strategy == SECOND
    step(*inputs)
    before = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict())
    x = inputs[0].clone()
    x[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="skipped"):
        step(x, inputs[1])
    assert step.report().skipped_steps == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) or (v.isnan() == before[k].isnan()).all(), k
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_clip_strategy_imposes_one():
    model, inputs, loss_fn = make("gpt")
    refusal = _refusal(model, inputs, loss_fn, max_grad_norm=1.0)
    keep_minimum = _refusal(model, inputs, loss_fn, max_grad_norm=1.0, clip_strategy=KEEP).minimum
    assert keep_minimum > refusal.minimum
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(model, inputs, loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                      budget=refusal.minimum, max_grad_norm=1.0, clip_strategy=KEEP)
    assert e.value.minimum == keep_minimum
    step = remat.compile(model, inputs, loss_fn, optimizer=torch.optim.AdamW(model.parameters()),
                         max_grad_norm=1.0, clip_strategy=SECOND)  # no budget: still two passes
    step(*inputs)
    r = step.report()
    assert r.clip_strategy == SECOND and any("as asked" in n for n in r.solver_notes)
    assert r.measured_peak == r.predicted_peak
    with pytest.raises(ValueError, match="clip_strategy must be"):
        remat.compile(model, inputs, loss_fn, optimizer=torch.optim.AdamW(model.parameters()), max_grad_norm=1.0,
                      clip_strategy="twice")
    with pytest.raises(ValueError, match="give max_grad_norm too"):
        remat.compile(model, inputs, loss_fn, optimizer=torch.optim.AdamW(model.parameters()), clip_strategy=SECOND)
