"""Data-dependent routing under a budget: shapes are static after capture, values are not. A
recomputed router picks the same experts and a recomputed random masking masks the same patches,
so a step planned at 50% is bit-identical to the unconstrained step (same seed), and the plan
really recomputes them."""
from __future__ import annotations

import copy

import pytest
import torch

import remat

pytest.importorskip("transformers")
from hf_zoo import MODELS  # noqa: E402

ZOO = {m.name: m for m in MODELS}


def _count(step, *ops: str) -> int:
    return sum(1 for ins in step.program.entry.instrs if ins.op.name in ops)


@pytest.fixture(autouse=True)
def _recomputed_stay_recomputed(monkeypatch):
    """The tests are about replaying what a plan recomputes: small recomputed values (a router's
    top-k indices, the masking noise) stay recomputed, not read from their first run
    (``remat.lower.small_values``)."""
    import remat.lower.small_values as small

    monkeypatch.setattr(small, "find_small", lambda *args, **kwargs: [])


def _two_steps(model, inputs, **options):
    """(step, loss, gradients) unconstrained and at 50% of the unconstrained peak, from one model."""
    runs = []
    for budget in (None, 0.5):
        m = copy.deepcopy(model)
        step = remat.compile(m, inputs, budget=budget, count_workspaces=False, algorithms="reference", **options)
        loss = step(**inputs)
        runs.append((step, loss, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    return runs


@pytest.mark.slow
def test_recomputed_routing_picks_the_same_experts():
    model, inputs = ZOO["mixtral"].build()
    (base, l0, g0), (step, l1, g1) = _two_steps(model, inputs)
    rep = step.report()
    assert rep.measured_peak == rep.predicted_peak <= rep.budget
    assert _count(step, "topk", "sort") > _count(base, "topk", "sort") > 0  # the routing is recomputed
    assert torch.equal(l0, l1)
    for n, g in g0.items():
        assert torch.equal(g1[n], g), f"gradient of {n} differs"


@pytest.mark.slow
def test_recomputed_random_masking_masks_the_same_patches():
    model, inputs = ZOO["vitmae"].build()
    inputs = {k: v for k, v in inputs.items() if k != "noise"}  # remat draws the noise from its seed
    (base, l0, g0), (step, l1, g1) = _two_steps(model, inputs, seed=7)
    rep = step.report()
    assert rep.measured_peak == rep.predicted_peak <= rep.budget
    assert _count(step, "uniform") > _count(base, "uniform") == 1  # the noise is drawn again, and sorted again
    assert _count(step, "sort") > _count(base, "sort") > 0
    assert torch.equal(l0, l1)
    for n, g in g0.items():
        assert torch.equal(g1[n], g), f"gradient of {n} differs"
