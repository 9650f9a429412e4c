"""Selective block plans: a chain stage that keeps its input and the tape values dear to recompute
(convolution outputs, norm statistics) and recomputes the cheap ones (activations) in its backward.

The recipe keeps what it should, its variant holds less tape than the stage, and a step whose plan
uses such stages fits its budget, is measured at its predicted peak, and trains bit-identically to
the unconstrained step."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat import zoo
from remat.plan import inner
from remat.plan.blocks import cut
from remat.plan.chain.profile import _tape_bytes
from remat.plan.costmodel import static_costs
from remat.plan.frontier import forget_plans
from remat.plan.inner import build_variant, selective_recipe


@pytest.fixture(scope="module")
def resnet():
    model, inputs, loss_fn = zoo.make("resnet", "small")
    return model, inputs, loss_fn


def test_a_residual_blocks_recipe_keeps_convolutions_and_statistics_not_activations(resnet):
    model, inputs, loss_fn = resnet
    step = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    p = step.compilation.problem
    blocks = cut(p.forward, p.n_state, p.n_params, backward_kept_only=True)
    seen = 0
    for st in blocks.stages:
        fwd = st.split.forward
        tape = fwd.entry.instrs[-1].operands[1 + st.n_aux:]
        ops = [getattr(t.owner, "op", None) for t in tape]
        names = [o.name if o is not None else "input" for o in ops]
        if names.count("conv2d") < 2 or "relu" not in names:
            continue  # not a residual block
        r = selective_recipe(st, static_costs)
        assert r is not None
        kept = {names[k] for k in r.keep}
        assert "conv2d" in kept and "relu" not in kept, (names, r.keep)
        assert all(names[k] in ("conv2d", "batch_norm", "batch_norm_stats") for k in r.keep)
        v = build_variant(st, r)
        assert v is not None and _tape_bytes(v) < _tape_bytes(st)
        seen += 1
    assert seen >= 4  # zoo ResNet small's residual blocks


def test_a_step_planned_with_selective_blocks_fits_and_trains_like_one_without(resnet, monkeypatch):
    """Zoo ResNet small at 50% (SGD with momentum): the chain plan keeps its residual blocks'
    convolution outputs, recomputes less than the plan without selective blocks, is measured at its
    predicted peak within the budget, and after two steps its parameters and momentum are
    bit-identical to those of the step planned without them (same memory-lean algorithms: the
    stem's tiled convolution sums in another order than the unconstrained step's)."""
    monkeypatch.setattr(inner, "INNER_PLANS", True)
    model, inputs, loss_fn = resnet
    runs = []
    real = inner.selective_recipe
    for selective in (False, True):
        monkeypatch.setattr(inner, "selective_recipe", real if selective else lambda *a: None)
        forget_plans()  # planned afresh: no block options of the other run
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        step = remat.compile(m, inputs, loss_fn, optimizer=opt, budget="50%")
        losses = [step(*inputs) for _ in range(2)]
        runs.append((m, opt, losses, step.report()))
    (m0, o0, l0, r0), (m1, o1, l1, r) = runs
    assert not any("tape values dear to recompute" in n for n in r0.solver_notes)
    assert any("tape values dear to recompute" in n for n in r.solver_notes), r.solver_notes
    assert r.predicted_overhead < r0.predicted_overhead
    assert r.measured_peak == r.predicted_peak <= r.budget
    assert [a.split(":")[0] for a in r.algorithms if ": chosen" in a] == [a.split(":")[0] for a in r0.algorithms if ": chosen" in a]
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    for (n, a), b in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(a, b), f"parameter {n} differs"
        assert torch.equal(o0.state[a]["momentum_buffer"], o1.state[b]["momentum_buffer"]), n
