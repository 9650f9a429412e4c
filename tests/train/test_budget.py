"""``remat.compile`` under a memory budget: the measured peak of a step stays within the budget and
equals the predicted one, gradients and updates are bit-identical to the unconstrained compiled
step, an infeasible budget raises ``BudgetTooSmall`` with a minimum that is itself feasible and
leaves the model and optimizer untouched, and budgets can be given in every documented form."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

import remat
from remat.budget import parse_budget
from remat.errors import format_bytes
from _train_util import (assert_snapshot_equal, batches, grads_of, make, make_deep_mlp, snapshot)


def _compiled_grads(model, inputs, loss_fn, **options):
    """Compile a copy of ``model`` without an optimizer, run one step: (step, loss, gradients)."""
    m = copy.deepcopy(model)
    step = remat.compile(m, inputs, loss_fn, **options)
    loss = step(*inputs)
    return step, loss, grads_of(m)


def _assert_fits_and_identical(step, loss, grads, base_loss, base_grads) -> None:
    r = step.report()
    assert r.measured_peak is not None and r.budget is not None
    assert r.measured_peak <= r.budget, f"measured peak {r.measured_peak} B > budget {r.budget} B"
    assert r.measured_peak == r.predicted_peak, f"measured {r.measured_peak} B != predicted {r.predicted_peak} B"
    assert torch.equal(loss, base_loss)
    for n, g in base_grads.items():
        assert torch.equal(grads[n], g), f"gradient of {n} differs from the unconstrained compiled step"


# ---------------------------------------------------------------- an activation-dominated chain
@pytest.fixture(scope="module")
def deep():
    model, inputs, loss_fn = make_deep_mlp()
    base, loss, grads = _compiled_grads(model, inputs, loss_fn)
    # The premise of this fixture: activations, not parameters, dominate the peak.
    n_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 2 * n_param_bytes < 0.1 * base.unconstrained_peak
    return model, inputs, loss_fn, base, loss, grads


@pytest.fixture(scope="module")
def deep_budgeted(deep):
    """The deep MLP compiled (without an optimizer) and stepped once under a fraction of its peak."""
    model, inputs, loss_fn = deep[:3]
    cache = {}

    def get(fraction):
        if fraction not in cache:
            cache[fraction] = _compiled_grads(model, inputs, loss_fn, budget=fraction)
        return cache[fraction]

    return get


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_activation_heavy_step_fits_half_and_quarter_budgets(deep, deep_budgeted, fraction):
    model, inputs, loss_fn, base, base_loss, base_grads = deep
    step, loss, grads = deep_budgeted(fraction)
    assert step.unconstrained_peak == base.unconstrained_peak
    assert step.budget == int(fraction * base.unconstrained_peak)
    r = step.report()
    assert r.recomputed_instructions > 0 and r.solver != "none"
    _assert_fits_and_identical(step, loss, grads, base_loss, base_grads)


def test_report_fields_and_table(deep_budgeted):
    step = deep_budgeted(0.5)[0]
    r = step.report()
    assert isinstance(r, remat.train.Report)
    fields = {f.name for f in dataclasses.fields(r)}
    assert {"budget", "predicted_peak", "measured_peak", "unconstrained_peak", "overhead", "predicted_overhead",
            "solver"} <= fields
    assert r.budget == int(0.5 * r.unconstrained_peak)
    assert r.measured_peak == r.predicted_peak <= r.budget < r.unconstrained_peak
    assert r.solver != "none" and 0 < r.recomputed_instructions < r.instructions
    assert r.predicted_overhead > 0
    assert r.overhead is None  # the static cost model measures no unconstrained step to compare with
    assert set(r.stage_seconds) >= {"capture", "layout", "bind", "training graph", "prepare", "plan", "lower", "fuse", "prepare VM"}
    assert "profile" not in r.stage_seconds  # static costs: nothing runs at compile time
    assert r.step_seconds > 0 and r.plan_seconds >= 0 and r.setup_seconds >= r.plan_seconds
    table = str(r)
    lines = table.splitlines()
    assert lines[0] == "remat training step"
    for label in ("budget", "predicted peak", "measured peak", "unconstrained peak", "solver",
                  "predicted recompute overhead", "measured step overhead"):
        assert any(line.startswith(label) for line in lines), f"no '{label}' row in\n{table}"
    # Bytes print both human-readable and exact; the peak as a share of the unconstrained one.
    for v in (r.budget, r.measured_peak, r.unconstrained_peak):
        assert f"{format_bytes(v)} ({v:,} B)" in table
    assert f"{r.predicted_peak / r.unconstrained_peak:.1%}" in table
    # The planners' notes price overheads over the forward and backward, the headline over the step:
    # the table says so before them (they differed without a word: +45.0% won, +38.9% above).
    notes = [line for line in lines if line.startswith("  note: ")]
    assert any("predicted overhead" in n for n in notes)
    assert "over the forward and backward they plan" in notes[0]


def test_budgeted_optimizer_steps_equal_unconstrained_ones(deep):
    """In-place AdamW updates interleaved with a rematerialised backward: after 3 steps the
    parameters and optimizer state are bit-identical to the unconstrained compiled run (no
    recomputation reads an already-updated parameter)."""
    model, inputs, loss_fn, base, _, _ = deep
    runs = []
    for budget in (None, 0.5):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        step = remat.compile(m, inputs, loss_fn, optimizer=opt, budget=budget)
        losses = [step(*xs) for xs in batches(inputs, 3, seed=5)]
        r = step.report()
        assert r.measured_peak <= (r.budget or r.unconstrained_peak) and r.measured_peak == r.predicted_peak
        runs.append((m, opt, losses, r))
    (m0, o0, l0, r0), (m1, o1, l1, r1) = runs
    assert r1.recomputed_instructions > 0 and r1.measured_peak < r0.measured_peak
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    for (n, p), q in zip(m0.named_parameters(), m1.parameters()):
        assert torch.equal(p, q), f"parameter {n} differs after budgeted steps"
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(o0.state[p][k], o1.state[q][k]), f"optimizer state {k} of {n} differs"


# ---------------------------------------------------------------- the example models
# Batches large enough that activations are a good part of the peak (the tiny defaults are
# dominated by parameters). Where 50% / 25% is infeasible the reported minimum must be feasible.
ZOO = {"mlp": 64, "resnet": 8, "gpt": 4, "unet": 8}
_minimum_runs: dict = {}


@pytest.fixture(scope="module")
def zoo_base():
    cache = {}

    def get(name):
        if name not in cache:
            model, inputs, loss_fn = make(name, batch=ZOO[name])
            cache[name] = (model, inputs, loss_fn, *_compiled_grads(model, inputs, loss_fn))
        return cache[name]

    return get


@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_under_fractional_budget(zoo_base, name, fraction):
    """Bit-identical to the unconstrained step under every budget the reference algorithms meet
    (``algorithms="reference"``: below their minimum, "auto" may choose a memory-lean algorithm whose
    values differ in the last bit, tests/train/test_algorithm_choice.py)."""
    model, inputs, loss_fn, base, base_loss, base_grads = zoo_base(name)
    budget = int(fraction * base.unconstrained_peak)
    try:
        step, loss, grads = _compiled_grads(model, inputs, loss_fn, budget=fraction, solver="greedy",
                                            algorithms="reference")
    except remat.BudgetTooSmall as e:
        assert e.budget == budget and budget < e.minimum <= base.unconstrained_peak, (e.budget, e.minimum)
        assert f"{int(e.minimum)} bytes" in str(e)
        minimum = int(e.minimum)
        if (name, minimum) not in _minimum_runs:  # 50% and 25% often report the same minimum
            _minimum_runs[name, minimum] = _compiled_grads(model, inputs, loss_fn, budget=minimum, solver="greedy",
                                                           algorithms="reference")
        step, loss, grads = _minimum_runs[name, minimum]
        assert step.budget == minimum
    else:
        assert step.budget == budget
    _assert_fits_and_identical(step, loss, grads, base_loss, base_grads)


def test_unet_fits_half_its_unconstrained_peak(zoo_base):
    """A regression guard for the test above: the activation-heavy U-Net must not need the minimum
    of the VM's count. (Its convolutions' own workspaces, which the allocator sees, make 50% of
    the VM's count infeasible for the allocator: tests/train/test_allocator_budget.py.)"""
    model, inputs, loss_fn, base, base_loss, base_grads = zoo_base("unet")
    step, loss, grads = _compiled_grads(model, inputs, loss_fn, budget="50%", solver="greedy", count_workspaces=False)
    _assert_fits_and_identical(step, loss, grads, base_loss, base_grads)


# ---------------------------------------------------------------- infeasible budgets
@pytest.mark.parametrize("prior_steps", [0, 2])
def test_budget_below_minimum_raises_and_changes_nothing(prior_steps):
    model, inputs, loss_fn = make("resnet", torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for xs in batches(inputs, prior_steps, seed=3):  # an optimizer with state, and gradients left in .grad
        opt.zero_grad()
        loss_fn(model(*xs[:-1]), xs[-1]).backward()
        opt.step()
    before = snapshot(model, opt)
    with pytest.raises(remat.BudgetTooSmall) as info:
        remat.compile(model, inputs, loss_fn, optimizer=opt, budget=4096, solver="greedy")
    e = info.value
    assert e.budget == 4096 and e.minimum > 4096
    assert "4096" in str(e) or "4.00 KiB" in str(e)
    assert f"{int(e.minimum)} bytes" in str(e)
    assert_snapshot_equal(snapshot(model, opt), before)


def test_refusal_is_a_bounded_search(monkeypatch):
    """A refusal costs about as much as a plan: budget probes are single bounded greedy passes and
    the minimum is searched for once (to 2%), instead of a full bisection per failed probe with
    passes that may thrash up to 200 computes per node (minutes on mid-sized vision models)."""
    import remat.plan.greedy as greedy

    calls: list = []  # (graph nodes, step bound) per greedy pass
    real = greedy.greedy_compute_sequence

    def counted(graph, budget, order=None, *, score="raf_belady", max_steps=None):
        calls.append((len(graph.nodes), max_steps))
        return real(graph, budget, order, score=score, max_steps=max_steps)

    monkeypatch.setattr(greedy, "greedy_compute_sequence", counted)
    model, inputs, loss_fn = make("resnet", torch.float32)
    with pytest.raises(remat.BudgetTooSmall) as info:  # one planning problem: no lean-algorithm variant
        remat.compile(model, inputs, loss_fn, budget=4096, solver="greedy", algorithms="reference")
    # every pass is bounded but one whole-step pass (the plan at the minimum found, which succeeds)
    whole = max(n for n, _ in calls)
    step_passes = [m for n, m in calls if n == whole]
    assert step_passes and sum(1 for m in step_passes if m is None) <= 1, calls
    # probes (one pass per greedy score each, on at most two orders: scheduling.memory_aware_orders),
    # a 2% bisection (on the first order only), the plan at the minimum
    assert len(step_passes) <= 2 * 7 * len(greedy.SCORES) + 8 + 1, calls
    # block-internal plans (remat.plan.inner): per distinct block, twice (its donated arguments freed
    # after their last use, and held) and per recipe score, a 1% bisection of its backward (from its
    # no-eviction peak down, at most ~8 passes) and two recipes, all bounded
    from remat.plan.inner import RECIPE_SCORES

    block_passes = [(n, m) for n, m in calls if n < whole]
    assert all(m is not None for _, m in block_passes), calls
    assert len(block_passes) <= 2 * len(RECIPE_SCORES) * (10 * len({n for n, _ in block_passes}) + 10), calls
    step = remat.compile(model, inputs, loss_fn, budget=info.value.minimum, solver="greedy", algorithms="reference")
    step(*inputs)
    assert step.report().measured_peak <= info.value.minimum


# ---------------------------------------------------------------- budget forms
@pytest.mark.parametrize("form, expected", [
    (123456, 123456), ("123456", 123456), ("1.5MiB", 1572864), ("1.5 MiB", 1572864), ("800MB", 800_000_000),
    ("2KiB", 2048), ("1e3", 1000), ("1.5e3", 1500), ("1e-1", 100), ("5E-1", 500), ("40%", 400), ("12.5%", 125),
    (0.4, 400), (1.0, 1000), (2048.0, 2048)])
def test_parse_budget_forms(form, expected):
    assert parse_budget(form, reference=1000) == expected


@pytest.mark.parametrize("form, words", [
    ("1.5 parsecs", "not valid"), ("lots", "not valid"), ("-5", "not valid"), (-5, "positive"), (0, "positive"),
    (0.0, "not valid"), (1.5, "not valid"), ("150%", "(0, 1]"), ("0%", "(0, 1]"), (True, "not valid"),
    ([1024], "not valid"), (float("nan"), "not valid"), (float("inf"), "not valid")])
def test_parse_budget_rejects_bad_forms(form, words):
    with pytest.raises(ValueError) as info:
        parse_budget(form, reference=1000)
    msg = str(info.value)
    assert words in msg
    if words == "not valid":  # the message lists what is valid
        assert "'1.5GiB'" in msg and "'40%'" in msg


@pytest.fixture(scope="module")
def mlp_peak():
    model, inputs, loss_fn = make("mlp")
    return remat.compile(copy.deepcopy(model), inputs, loss_fn).unconstrained_peak


@pytest.mark.parametrize("form", ["int", "size", "percent", "fraction"])
def test_compile_accepts_budget_forms(mlp_peak, form):
    model, inputs, loss_fn = make("mlp")
    budget = {"int": mlp_peak + 100, "size": "1.5MiB", "percent": "100%", "fraction": 1.0}[form]
    step = remat.compile(model, inputs, loss_fn, budget=budget)
    assert step.budget == parse_budget(budget, reference=mlp_peak)
    assert step.unconstrained_peak == mlp_peak and step.compilation.plan.solver == "none"  # it fits: nothing recomputed
    step(*inputs)
    assert step.report().budget == step.budget >= step.report().measured_peak


@pytest.mark.parametrize("budget", ["40%", 0.4])
def test_compile_resolves_fractions_against_the_unconstrained_peak(mlp_peak, budget):
    model, inputs, loss_fn = make("mlp")  # parameters dominate: 40% is below its minimum
    with pytest.raises(remat.BudgetTooSmall) as info:
        remat.compile(model, inputs, loss_fn, budget=budget, solver="greedy")
    assert info.value.budget == int(0.4 * mlp_peak)


@pytest.mark.parametrize("budget", ["1.5 parsecs", -1, 1.5, "150%"])
def test_compile_rejects_bad_budget_forms(budget):
    model, inputs, loss_fn = make("mlp")
    before = snapshot(model)
    with pytest.raises(ValueError, match="budget") as info:
        remat.compile(model, inputs, loss_fn, budget=budget)
    assert not isinstance(info.value, remat.BudgetTooSmall)
    assert_snapshot_equal(snapshot(model), before)


def test_milp_out_of_time_does_not_end_the_compile(deep, monkeypatch):
    """solver="milp" runs the whole-graph MILP at a plan's probes (and at the ladder's lower budgets);
    one that ran out of time (NoSolutionFound) ended the compile, though other planners had plans."""
    from remat.plan import milp

    model, inputs, loss_fn, base, base_loss, base_grads = deep
    calls = []

    def out_of_time(graph, budget, **kw):
        calls.append(budget)
        raise milp.NoSolutionFound(budget, kw.get("time_limit", 0.0), 0.0, "Time limit reached")

    monkeypatch.setattr(milp, "solve_milp", out_of_time)
    step, loss, grads = _compiled_grads(model, inputs, loss_fn, budget=0.5, solver="milp")
    assert calls
    assert any("no schedule within its time limit" in n for n in step.report().solver_notes) or \
        step.report().solver.startswith("chain DP")
    _assert_fits_and_identical(step, loss, grads, base_loss, base_grads)


def test_an_unconstrained_steps_minimum_is_a_budget_a_compile_accepts(monkeypatch):
    """``minimum_budget()`` of a step compiled without a budget counts kernels' workspaces as a
    budgeted compile does (here a workspace of 256 KiB for every product, whatever this machine's
    kernels allocate): it is the refusal's minimum, and a compile at it fits."""
    import remat.runtime.allocator as allocator

    real = allocator.workspaces

    def large(fn, dialects=None, device=None):
        return {ins: max(w, 256 * 1024 if ins.op.name in ("linear", "matmul") else 0)
                for ins, w in real(fn, dialects, device).items()}

    monkeypatch.setattr(allocator, "workspaces", large)
    model, inputs, loss_fn = make_deep_mlp(batch=256)
    unconstrained = remat.compile(copy.deepcopy(model), inputs, loss_fn)
    with pytest.raises(remat.BudgetTooSmall) as info:
        remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=4096)
    assert unconstrained.minimum_budget() == info.value.minimum
    step = remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=info.value.minimum)
    assert step.report().predicted_allocator_peak <= info.value.minimum
