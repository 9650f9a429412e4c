"""Micro-batching (``remat.compile(..., micro_batches=k | "auto")``): gradients equal to the whole
batch's up to summation order, predicted == measured peak for the whole step, semantics refused
when micro-batches would compute something else."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat
from remat import zoo
from remat.plan.simulator import predict_peak
from remat.step.microbatch import microbatch_step
from remat.train.microbatch import MicroBatchingRefused


def _grads(model, example, loss_fn, **options):
    """The loss and ``.grad``s of one compiled step without an optimizer, on a copy of ``model``."""
    m = copy.deepcopy(model)
    step = remat.compile(m, example, loss_fn, **options)
    loss = step(*example)
    return step, loss, [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("k", [2, 4])
def test_gradients_equal_the_whole_batch_up_to_summation_order(k):
    model, example, loss_fn = zoo.make("gpt", "tiny", dtype=torch.float64, batch=4, dropout=0.0)
    _, loss1, g1 = _grads(model, example, loss_fn)
    step, loss_k, gk = _grads(model, example, loss_fn, micro_batches=k)
    assert step.micro_batches == k and step.compilation.loss_reduction == "mean"
    assert torch.allclose(loss_k, loss1, rtol=1e-13, atol=0)
    for a, b in zip(g1, gk):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-14)
    assert step.last_stats.peak_bytes == step.predicted_peak
    rep = step.report()
    assert rep.micro_batches == k and rep.batch_size == 4 and "micro-batches" in str(rep)


def test_sum_reduced_loss_is_detected_and_not_scaled():
    model, example, _ = zoo.make("mlp", "tiny", dtype=torch.float64, batch=8)

    def loss_fn(out, y):
        return F.cross_entropy(out, y, reduction="sum")

    _, loss1, g1 = _grads(model, example, loss_fn)
    step, loss2, g2 = _grads(model, example, loss_fn, micro_batches=2)
    assert step.compilation.loss_reduction == "sum"
    assert torch.allclose(loss1, loss2, rtol=1e-13)
    assert all(torch.allclose(a, b, rtol=1e-11, atol=1e-14) for a, b in zip(g1, g2))


def test_updates_under_a_budget_match_and_fit():
    """SGD with momentum, k=2 planned under a budget below its unconstrained micro-batched peak:
    the same updates as the whole batch (f64, tight), measured == predicted <= budget."""
    model, example, loss_fn = zoo.make("gpt", "tiny", dtype=torch.float64, batch=4, dropout=0.0)
    m1, m2 = copy.deepcopy(model), copy.deepcopy(model)
    s1 = remat.compile(m1, example, loss_fn, optimizer=torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9))
    m3 = copy.deepcopy(model)
    free2 = remat.compile(m3, example, loss_fn, micro_batches=2,
                          optimizer=torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(m3, example, loss_fn, micro_batches=2, budget=1,
                      optimizer=torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9))
    budget = (e.value.minimum + predict_peak(free2.compilation.unconstrained)) // 2
    s2 = remat.compile(m2, example, loss_fn, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9),
                       budget=budget, micro_batches=2)
    assert s2.compilation.recomputed > 0
    for _ in range(2):
        s1(*example)
        s2(*example)
        assert s2.last_stats.peak_bytes == s2.predicted_peak <= budget
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-13)


def test_auto_chooses_micro_batches_below_the_whole_batch_minimum():
    model, example, loss_fn = zoo.make("mlp", "tiny", batch=64)
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(model, example, loss_fn, budget=1, count_workspaces=False)
    # The minimum is a bounded search's, and the greedy is not monotone in the budget: go below it
    # until the whole batch cannot fit. Micro-batching must then (the VM's count).
    for f in (0.97, 0.93, 0.89, 0.85, 0.81, 0.77):
        budget = int(e.value.minimum * f)
        try:
            remat.compile(model, example, loss_fn, budget=budget, count_workspaces=False)
        except remat.BudgetTooSmall:
            break
    else:
        raise AssertionError("the whole batch fits at 77% of its reported minimum")
    step = remat.compile(model, example, loss_fn, budget=budget, micro_batches="auto", count_workspaces=False)
    assert step.micro_batches > 1
    step(*example)
    assert step.last_stats.peak_bytes == step.predicted_peak <= budget
    rep = step.report()
    assert rep.micro_batch_choice[0].startswith("k=1: infeasible")
    assert rep.micro_batch_choice[-1].startswith(f"chose k={step.micro_batches}")
    assert "micro-batching: k=1: infeasible" in str(rep)


def test_auto_without_need_keeps_the_whole_batch():
    model, example, loss_fn = zoo.make("mlp", "tiny")
    step = remat.compile(model, example, loss_fn, budget="100%", micro_batches="auto")
    assert step.micro_batches == 1 and step.compilation.recomputed == 0


def test_batch_norm_is_refused():
    model, example, loss_fn = zoo.make("resnet", "tiny")
    with pytest.raises(MicroBatchingRefused, match="batch_norm in training mode"):
        remat.compile(model, example, loss_fn, micro_batches=2)


def test_auto_with_batch_norm_says_why_it_did_not_micro_batch():
    model, example, loss_fn = zoo.make("resnet", "tiny")
    with pytest.raises(remat.BudgetTooSmall, match="refused: micro-batching would change"):
        remat.compile(model, example, loss_fn, budget=1, micro_batches="auto")


def test_a_mean_over_varying_counts_is_refused():
    """A mean over non-ignored tokens whose count differs between micro-batches is no mean of means."""
    model, (x, y), _ = zoo.make("gpt", "tiny", batch=4, dropout=0.0)
    y = y.clone()
    y[0, :10] = -1

    def loss_fn(logits, t):
        return F.cross_entropy(logits.flatten(0, 1), t.flatten(), ignore_index=-1)

    with pytest.raises(MicroBatchingRefused, match="neither their mean"):
        remat.compile(model, (x, y), loss_fn, micro_batches=2)
    step = remat.compile(model, (x, y), loss_fn, micro_batches=2, loss_reduction="mean")  # the user's call
    assert step.compilation.loss_reduction == "mean"


def test_a_loss_cast_to_float32_is_checked_in_float64():
    """``transformers``' losses cast their logits with ``.float()``: the float64 check keeps them in
    float64, so a mean over equal counts is a mean whatever the seed (float32 rounding refused some
    seeds), and one over varying counts is still refused."""
    def loss_fn(logits, t):
        return F.cross_entropy(logits.float().flatten(0, 1), t.flatten(), ignore_index=-1)

    for seed in range(4):
        model, (x, y), _ = zoo.make("gpt", "tiny", batch=4, dropout=0.0, seed=seed)
        step = remat.compile(model, (x, y), loss_fn, micro_batches=2)
        assert step.compilation.loss_reduction == "mean"
    y = y.clone()
    y[0, :10] = -1
    with pytest.raises(MicroBatchingRefused, match="neither their mean"):
        remat.compile(model, (x, y), loss_fn, micro_batches=2)


@pytest.mark.parametrize("k, match", [(3, r"does not divide the batch of 8; valid: \[1, 2, 4, 8\]"),
                                      (0, "positive int")])
def test_bad_micro_batch_counts(k, match):
    model, example, loss_fn = zoo.make("mlp", "tiny")
    with pytest.raises(ValueError, match=match):
        remat.compile(model, example, loss_fn, micro_batches=k)


def test_microbatch_step_refuses_buffer_updates():
    from remat.step.program import Layout

    model, example, loss_fn = zoo.make("mlp", "tiny")
    step = remat.compile(model, example, loss_fn)
    layout = Layout(step.binding.layout.n_params, step.binding.layout.n_state, step.binding.layout.n_inputs, False, 1)
    with pytest.raises(ValueError, match="once per micro-batch"):
        microbatch_step(step.compilation.joint, layout, None, [], True, 2)
