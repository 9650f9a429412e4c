"""Dry runs (``remat.compile(..., dry_run=True)``): a step planned on meta tensors is the step a real
compile plans, and its predicted peak is the peak the VM measures, to the byte."""
from __future__ import annotations

import re

import pytest
import torch

import remat
from remat import zoo
from remat.ir import Module, print_module
from remat.plan.frontier import forget_plans


def _text(fn) -> str:
    """The program's text without source locations (generated code's file names carry a counter)."""
    return re.sub(r"  // loc\(.*", "", print_module(Module([fn])))


def _call(step, ex):
    return step(**ex) if isinstance(ex, dict) else step(*ex)


def compile_both(build, budget, optimizer=True, **options):
    """The step planned on meta tensors and the same step compiled and run on real ones (both from a
    fresh plan cache, so that neither reuses the other's plans): (dry, real, real's BudgetTooSmall)."""
    options = {"count_workspaces": False, "solver": "greedy", **options}

    def make(device):
        torch.manual_seed(0)
        with torch.device(device):
            model, ex, loss = build()
        opt = torch.optim.AdamW(model.parameters()) if optimizer else None
        return model, ex, loss, opt

    results = []
    for device in ("meta", "cpu"):
        forget_plans()
        model, ex, loss, opt = make(device)
        try:
            step = remat.compile(model, ex, loss, optimizer=opt, budget=budget, dry_run=device == "meta", **options)
        except remat.BudgetTooSmall as e:
            results.append(e)
            continue
        if device == "cpu":
            _call(step, ex)
        results.append(step)
    forget_plans()
    return results


def check_same(dry, real):
    """Both refused with the same minimum, or the same program with predicted == measured peak."""
    if isinstance(real, remat.BudgetTooSmall):
        assert isinstance(dry, remat.BudgetTooSmall), "the real compile is refused, the dry run is not"
        assert dry.minimum == real.minimum
        return
    assert not isinstance(dry, Exception), dry
    assert _text(dry.program) == _text(real.program)
    assert dry.predicted_peak == real.predicted_peak == real.last_stats.peak_bytes
    rd, rr = dry.report(), real.report()
    assert rd.memory == rr.memory  # by kind, at the peak: measured on the real step's first run
    assert rd.predicted_overhead == rr.predicted_overhead and rd.solver == rr.solver


@pytest.mark.parametrize("budget", [None, "70%"])
@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt", "unet"])
def test_zoo_dry_run_plans_the_real_step(name, budget):
    dry, real = compile_both(lambda: zoo.make(name, "tiny"), budget)
    check_same(dry, real)


def test_dry_run_without_optimizer_and_bf16():
    dry, real = compile_both(lambda: zoo.make("gpt", "tiny"), "75%", optimizer=False, precision="bf16")
    check_same(dry, real)


def test_dry_run_uses_the_workspaces_a_real_compile_measured():
    """With workspaces counted, a dry run uses those measured on this machine before: the same plan."""
    compile_both(lambda: zoo.make("resnet", "tiny"), "70%", count_workspaces=True)  # measures them
    dry, real = compile_both(lambda: zoo.make("resnet", "tiny"), "70%", count_workspaces=True)
    check_same(dry, real)
    assert dry.report().workspace_bytes == real.report().workspace_bytes
    assert any("every kernel's measured" in n for n in dry.report().solver_notes)


def test_a_dry_run_does_not_lend_its_plans_to_a_real_compile(monkeypatch):
    """A dry run counts the workspaces it has not measured as 0; a real compile after it, in the same
    process, plans with the measured ones, not the dry run's plans (the in-process plan cache keyed
    only whether workspaces counted, and the real step's allocator peak went over its budget)."""
    import remat.train.dry_run as dry_run

    build = lambda: zoo.make("resnet", "tiny")  # noqa: E731
    alone = compile_both(build, "80%", count_workspaces=True)[1]  # measures the workspaces
    assert alone.report().workspace_bytes > 0
    monkeypatch.setattr(dry_run, "dry_workspaces", lambda c, fn: {})  # as on a machine that never measured them
    forget_plans()
    torch.manual_seed(0)
    with torch.device("meta"):
        model, ex, loss = build()
    remat.compile(model, ex, loss, optimizer=torch.optim.AdamW(model.parameters()), budget="80%", dry_run=True,
                  count_workspaces=True, solver="greedy")
    torch.manual_seed(0)
    model, ex, loss = build()
    real = remat.compile(model, ex, loss, optimizer=torch.optim.AdamW(model.parameters()), budget="80%",
                         count_workspaces=True, solver="greedy")
    forget_plans()
    assert _text(real.program) == _text(alone.program)
    _call(real, ex)
    r = real.report()
    assert r.measured_allocator_peak <= r.predicted_allocator_peak <= r.budget


def test_a_budget_above_the_named_devices_memory_is_warned_of():
    with torch.device("meta"):
        model, ex, loss = zoo.make("mlp", "tiny")
    with pytest.warns(UserWarning, match=r"more than h100-80gb's memory, 79\.\d+ GiB .*a plan within the budget may not"):
        remat.compile(model, ex, loss, budget="100GiB", dry_run=True, device="h100-80gb", solver="greedy")


def test_a_planned_step_refuses_to_run_and_reports():
    with torch.device("meta"):
        model, ex, loss = zoo.make("gpt", "tiny")
    step = remat.compile(model, ex, loss, optimizer=torch.optim.AdamW(model.parameters()), budget="80%",
                         dry_run=True, solver="greedy", count_workspaces=False)
    with pytest.raises(remat.DryRunStep, match="planned by a dry run"):
        step(*ex)
    r = step.report()
    assert r.dry_run and r.measured_peak is None
    assert r.minimum_budget <= r.predicted_peak <= r.budget
    assert {"parameters", "gradients", "optimizer state", "activations", "inputs"} <= set(r.memory)
    assert r.predicted_recompute_seconds > 0
    assert "dry run" in str(r) and "minimum feasible budget" in str(r)
    assert next(model.parameters()).is_meta  # nothing allocated
    points = step.curve(n_points=3)
    assert points[0].fits and points[0].budget == r.minimum_budget
    assert points[-1].predicted_overhead == 0.0


def test_a_curve_starts_at_the_minimum_and_it_fits():
    """The curve plans each budget as a compile at it would, algorithm choice included: its first
    point, the minimum (a causal LM's is reached with a memory-lean cross-entropy), fits (planned
    with the compiled step's algorithms alone, it said 'needs ...' at the minimum a refusal names)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (4, 32))
    step = remat.compile(model, dict(input_ids=ids, labels=ids), optimizer=torch.optim.AdamW(model.parameters()),
                         dry_run=True, count_workspaces=False)
    minimum = step.minimum_budget()
    first = step.curve(n_points=2)[0]
    assert first.budget == minimum and first.fits and first.predicted_peak <= minimum


def test_dry_run_plans_clipping_by_a_second_backward_as_the_real_compile():
    """max_grad_norm under a budget only a second backward meets: the same strategy and program; the
    curve starts at the lesser minimum of the two strategies, each budget choosing its own."""
    dry, real = compile_both(lambda: zoo.make("gpt", "tiny"), "85%", max_grad_norm=1.0)
    check_same(dry, real)
    assert dry.report().clip_strategy == real.report().clip_strategy == "second backward"
    points = dry.curve(n_points=3)
    assert points[0].fits and points[0].budget == dry.report().minimum_budget
    assert "(second backward)" in points[0].solver and "(keep gradients)" in points[-1].solver


def test_dry_run_refuses_what_needs_data():
    with torch.device("meta"):
        model, ex, loss = zoo.make("mlp", "tiny")
    with pytest.raises(ValueError, match="cannot measure costs"):
        remat.compile(model, ex, loss, dry_run=True, cost_model="profiled")
    with pytest.raises(ValueError, match="micro_batches=1"):
        remat.compile(model, ex, loss, dry_run=True, micro_batches=2)


def test_max_batch_on_meta_tensors():
    with torch.device("meta"):
        model, _, loss = zoo.make("mlp", "tiny")

    def batch(n):
        with torch.device("meta"):
            return torch.randn(n, 32), torch.randint(0, 10, (n,))

    mb = remat.max_batch(model, batch, loss, torch.optim.AdamW(model.parameters()), "256KiB", dry_run=True,
                         count_workspaces=False, solver="greedy", limit=4096)
    assert mb.batch > 1 and mb.step.predicted_peak <= 256 * 1024
    assert mb.step.compilation.options.dry_run


def test_dry_run_on_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def build():  # zoo.make_mlp's tiny MLP (its .to(dtype) cannot swap fake parameters)
        return zoo.MLP(32, 64, 2, 10), (torch.randn(8, 32), torch.randint(0, 10, (8,))), zoo.classification_loss

    with FakeTensorMode():
        model, ex, loss = build()
    fake = remat.compile(model, ex, loss, optimizer=torch.optim.AdamW(model.parameters()), budget=None,
                         dry_run=True, solver="greedy", count_workspaces=False)
    dry, real = compile_both(build, None)
    assert fake.predicted_peak == dry.predicted_peak == real.last_stats.peak_bytes
    assert _text(fake.program) == _text(real.program)
