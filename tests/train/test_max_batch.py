"""``remat.max_batch``: the largest batch whose step fits, found from compiled (never run)
candidates, and the step it returns trains at that batch within the budget."""
from __future__ import annotations

import pytest
import torch

import remat
from remat import zoo
from remat.train.max_batch import Probe, eager_step_peak, search


@pytest.mark.parametrize("answer, start, limit", [(37, 1, 1000), (1, 1, 64), (64, 1, 64), (0, 3, 64), (50, 5, 50),
                                                  (700, 1, 1000), (2, 1, 3)])
@pytest.mark.parametrize("curve", ["linear", "convex", "none"])
def test_search_finds_the_largest_fitting_size(answer, start, limit, curve):
    """Bisection, or interpolation towards ``target`` on bytes that grow linearly or convexly."""
    seen = []
    size = {"linear": lambda n: 1000 + 10 * n, "convex": lambda n: 1000 + n * n, "none": lambda n: 0}[curve]

    def fits(n):
        seen.append(n)
        return n <= answer, size(n), f"payload {n}"

    target = None if curve == "none" else size(answer)
    n, payload, probes = search(fits, start, limit, target=target)
    assert n == answer and payload == (None if answer == 0 else f"payload {answer}")
    assert len(seen) == len(set(seen)) and all(isinstance(p, Probe) for p in probes)
    assert len(seen) <= 2 * limit.bit_length() + 2


def _mlp(n):
    return zoo.make("mlp", "tiny", batch=n)[1]


def test_max_batch_fits_and_the_next_size_does_not_then_trains_within_the_budget():
    model, _, loss_fn = zoo.make("mlp", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = 120_000
    res = remat.max_batch(model, _mlp, loss_fn, optimizer=opt, budget=budget, limit=512)
    n = res.batch
    assert 1 < n < 512 and res.step is not None and res.budget == budget
    fit = {p.batch: p.fits for p in res.probes}
    assert fit[n] and fit.get(n + 1) is False  # bisection ends between n and n + 1
    with pytest.raises(remat.BudgetTooSmall):
        remat.compile(model, _mlp(n + 1), loss_fn, optimizer=opt, budget=budget)
    x, y = _mlp(n)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        res.step(x, y)
        assert res.step.last_stats.peak_bytes == res.step.predicted_peak <= budget
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert f"largest batch {n}" in str(res)


def test_max_batch_needs_an_absolute_budget():
    model, _, loss_fn = zoo.make("mlp", "tiny")
    for bad in ("40%", 0.5, None):
        with pytest.raises(ValueError, match="budget"):
            remat.max_batch(model, _mlp, loss_fn, budget=bad)
    for fraction in ("0.5", "1.0", 1.0, "50 %"):  # every spelling of a fraction: refused, not read as bytes
        with pytest.raises(ValueError, match="needs an absolute budget"):
            remat.max_batch(model, _mlp, loss_fn, budget=fraction)


def test_eager_step_peak_grows_with_the_batch_and_leaves_the_model_alone():
    model, _, loss_fn = zoo.make("mlp", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    small, large = (eager_step_peak(model, _mlp(n), loss_fn, opt) for n in (8, 64))
    params = sum(p.numel() * 4 for p in model.parameters())
    assert 4 * params < small < large  # parameters, gradients and AdamW's two moments at least
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state
