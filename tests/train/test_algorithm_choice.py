"""The planner's per-operator algorithm choice (issue 10): under a budget the reference algorithms
cannot reach, ``remat.compile`` picks the chunked ``linear_cross_entropy`` for a large-vocabulary
head, fits the budget with measured == predicted peak, reports the choice, and gives the
unconstrained step's gradients up to summation order; under one algorithm choice gradients stay
bit-identical across budgets; ``algorithms="reference"`` never rewrites."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from _train_util import grads_of


class WideHead(nn.Module):
    """Token embedding, one GELU layer and a bias-free head over a large vocabulary: the logits
    ([N, V]) dominate the step's memory, as in a language model."""

    def __init__(self, vocab: int = 1500, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(h + self.mlp(h))


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = WideHead()
    x = torch.randint(0, 1500, (4, 32))
    y = torch.randint(0, 1500, (4, 32))
    base = remat.compile(copy.deepcopy(model), (x, y), _loss)
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(copy.deepcopy(model), (x, y), _loss, budget=1, count_workspaces=False)
    return model, (x, y), base, e.value.minimum  # the least budget found with the lean algorithm


def _run(model, inputs, **options):
    m = copy.deepcopy(model)
    step = remat.compile(m, inputs, _loss, **{"count_workspaces": False, **options})
    loss = step(*inputs)
    return step, loss, grads_of(m)


def test_lean_algorithm_reaches_below_the_reference_minimum(case):
    model, inputs, base, lean_min = case
    budget = lean_min
    step, loss, grads = _run(model, inputs, budget=budget)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= budget
    assert len(r.algorithms) == 1 and "linear_cross_entropy at head" in r.algorithms[0]
    assert ": chosen;" in r.algorithms[0] and "reference algorithms need at least" in r.algorithms[0]
    assert "algorithm: linear_cross_entropy" in str(r)
    m0 = copy.deepcopy(model)
    base_loss = remat.compile(m0, inputs, _loss)(*inputs)
    torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
    for n, g in grads_of(m0).items():  # summation order only: the head's gradient is summed by chunk
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7)


def test_lean_plan_predicts_its_overhead_against_the_reference_step(case):
    """The predicted overhead of a plan on lean algorithms is priced against the reference
    algorithms' unconstrained step (as the measured overhead is), so it counts what the lean
    algorithms cost as well as what is recomputed: never below the reference step's."""
    from remat.plan.costmodel import CostModel

    model, inputs, base, lean_min = case
    step, _, _ = _run(model, inputs, budget=lean_min)
    c = step.compilation
    cost = CostModel(c.costs)  # static: the lean step's own instructions are priced the same way
    reference = cost.program_cost(c.unconstrained)
    want = cost.program_cost(c.plan.program) - reference
    r = step.report()
    assert r.predicted_recompute_seconds == pytest.approx(max(0.0, want), rel=1e-9, abs=1e-15)
    assert r.predicted_overhead == pytest.approx(max(0.0, want) / reference, rel=1e-9, abs=1e-12)
    assert r.predicted_overhead > 0 and any("against the reference algorithms' unconstrained step" in n
                                            for n in r.solver_notes)


def test_reference_only_refuses_that_budget(case):
    model, inputs, _, lean_min = case
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(copy.deepcopy(model), inputs, _loss, budget=lean_min, algorithms="reference", count_workspaces=False)
    # The reference holds the [N, V] logits (then their gradient, written over them); the chunked
    # head holds one chunk's, as a workspace, not as an IR value.
    assert e.value.minimum > lean_min + 0.8 * 128 * 1500 * 4


def test_same_choice_is_bit_identical_across_budgets(case):
    model, inputs, _, lean_min = case
    runs = [_run(model, inputs, budget=b) for b in (lean_min, int(lean_min * 1.3))]
    for step, _, _ in runs:
        assert ": chosen;" in step.report().algorithms[0]
    (_, l1, g1), (_, l2, g2) = runs
    assert torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_unconstrained_and_fitting_budgets_keep_the_reference(case):
    model, inputs, base, _ = case
    step, _, _ = _run(model, inputs, budget=base.unconstrained_peak)
    assert step.report().algorithms == []
    assert not any(i.op.name == "linear_cross_entropy" for i in step.program.entry.instrs)


def test_bad_option_names_the_valid_ones(case):
    model, inputs, _, _ = case
    with pytest.raises(ValueError, match="algorithms must be one of 'auto', 'reference'"):
        remat.compile(copy.deepcopy(model), inputs, _loss, algorithms="fast")


def test_lean_variant_not_chosen_while_the_reference_fits():
    """Just under the unconstrained peak the reference algorithms fit (with a little
    recomputation): they are kept, so gradients stay bit-identical to the unconstrained step."""
    torch.manual_seed(1)
    model = WideHead(vocab=600, d=64)
    x, y = torch.randint(0, 600, (2, 32)), torch.randint(0, 600, (2, 32))
    base = remat.compile(copy.deepcopy(model), (x, y), _loss)
    step = remat.compile(copy.deepcopy(model), (x, y), _loss, budget=base.unconstrained_peak - 1)
    (line,) = step.report().algorithms
    assert ": not chosen;" in line and "the reference algorithms fit the budget" in line
    assert not any(i.op.name == "linear_cross_entropy" for i in step.program.entry.instrs)


class LongAttention(nn.Module):
    """One head of attention with dropout over a long sequence: its [T, T] scores dominate."""

    def __init__(self, d: int = 8, p: float = 0.2):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = self.drop(F.softmax((q @ k.transpose(-2, -1)) * 0.3, dim=-1))
        return self.out(att @ v).mean(dim=(1, 2))


def test_dropout_attention_is_chosen_where_the_explicit_form_cannot_fit():
    torch.manual_seed(1)
    model, x, y = LongAttention(), torch.randn(2, 128, 8), torch.randn(2)
    def loss(out, target):
        return F.mse_loss(out, target)

    with pytest.raises(remat.BudgetTooSmall) as ref:
        remat.compile(copy.deepcopy(model), (x, y), loss, budget=1, algorithms="reference", count_workspaces=False)
    with pytest.raises(remat.BudgetTooSmall) as lean:
        remat.compile(copy.deepcopy(model), (x, y), loss, budget=1, count_workspaces=False)
    scores = 2 * 128 * 128 * 4
    assert lean.value.minimum + scores <= ref.value.minimum  # the explicit form holds more than one [T, T] at once
    m = copy.deepcopy(model)
    step = remat.compile(m, (x, y), loss, budget=lean.value.minimum, count_workspaces=False)
    torch.manual_seed(7)
    out = step(x, y)
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= lean.value.minimum
    assert len(r.algorithms) == 1 and r.algorithms[0].startswith("dropout_attention at 1 attention(s)")
    assert ": chosen;" in r.algorithms[0]
    m0 = copy.deepcopy(model)
    base = remat.compile(m0, (x, y), loss)
    torch.manual_seed(7)
    base = base(x, y)  # the same seed: the same dropout mask, replayed by the op
    torch.testing.assert_close(out, base, rtol=1e-6, atol=1e-7)
    for n, g in grads_of(m0).items():
        torch.testing.assert_close(grads_of(m)[n], g, rtol=1e-5, atol=1e-7)


def test_batch_norm_backward_without_atens_spare_buffer_lowers_the_minimum():
    """A conv net's floor is set near its stem's batch-norm backward, where ATen's kernel allocates an
    input-sized buffer it never uses. The split backward (a reduction, then grad_x element-wise) has
    no such workspace: below the reference's minimum the planner chooses it, reports it, fits with
    measured == predicted peak, and gives eager's gradients to float rounding."""
    from remat import zoo

    def minimum(**kw):
        model, inputs, loss_fn = zoo.make("resnet", "tiny", batch=32)
        with pytest.raises(remat.BudgetTooSmall) as e:
            remat.compile(model, inputs, loss_fn, budget=1, **kw)
        return e.value.minimum

    ref, auto = minimum(algorithms="reference"), minimum()
    assert auto < ref
    model, inputs, loss_fn = zoo.make("resnet", "tiny", batch=32)
    eager = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, budget=auto)
    assert any(line.startswith("batch_norm_grad at ") and ": chosen;" in line for line in step.report().algorithms)
    ops = [i.op.name for i in step.program.entry.instrs]
    assert "batch_norm_grad_sums" in ops and "batch_norm_grad" not in ops  # every one split, as reported
    step(*inputs)
    assert step.last_stats.peak_bytes == step.predicted_peak <= auto
    loss_fn(eager(*inputs[:-1]), inputs[-1]).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_chain_planner_differentiates_blocks_with_the_chosen_batch_norm_backward(monkeypatch):
    """The chain DP re-differentiates the forward block by block: under the lean choice its blocks
    split their batch-norm backwards as the step's joint does (``StepProblem.split_bn_grad``), so
    its plan runs the algorithm the report names (and reaches the same low minimum)."""
    import remat.plan.portfolio as portfolio
    from remat import zoo
    from remat.plan.frontier import forget_plans

    forget_plans()  # plans of this model made earlier in the process would be reused
    monkeypatch.setattr(portfolio, "plan_graph", lambda *a, **k: None)  # only the chain of blocks plans
    try:
        model, inputs, loss_fn = zoo.make("resnet", "tiny", batch=32)
        with pytest.raises(remat.BudgetTooSmall) as e:
            remat.compile(model, inputs, loss_fn, budget=1)
        model, inputs, loss_fn = zoo.make("resnet", "tiny", batch=32)
        step = remat.compile(model, inputs, loss_fn, budget=e.value.minimum)
    finally:
        forget_plans()  # nor should later tests reuse these chain-only plans
    assert step.compilation.plan.solver.startswith("chain DP")
    assert any(line.startswith("batch_norm_grad at ") and ": chosen;" in line for line in step.report().algorithms)
    ops = [i.op.name for i in step.program.entry.instrs]
    assert "batch_norm_grad_sums" in ops and "batch_norm_grad" not in ops
    step(*inputs)
    assert step.last_stats.peak_bytes == step.predicted_peak <= e.value.minimum


def test_unet_skip_concatenations_are_split_below_the_reference_minimum():
    """A U-Net's up path convolves the concatenation of a skip and the upsampled map: below the
    reference's minimum the planner runs one convolution per input instead (never the concatenated
    activation or one gradient for both), reports it, fits with measured == predicted peak, and
    gives eager's gradients to float rounding."""
    from remat import zoo

    model, inputs, loss_fn = zoo.make("unet", "tiny", batch=16)
    with pytest.raises(remat.BudgetTooSmall) as ref:
        remat.compile(model, inputs, loss_fn, budget=1, algorithms="reference")
    with pytest.raises(remat.BudgetTooSmall) as auto:
        remat.compile(model, inputs, loss_fn, budget=1)
    assert auto.value.minimum < ref.value.minimum
    eager = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, budget=auto.value.minimum)
    assert any(line.startswith("conv2d over concat at 2 convolution(s)") and ": chosen;" in line
               for line in step.report().algorithms)
    conv_inputs = {i.operands[0] for i in step.program.entry.instrs if i.op.name == "conv2d"}
    assert not any(i.op.name == "concat" and i.results[0] in conv_inputs for i in step.program.entry.instrs)
    step(*inputs)
    assert step.last_stats.peak_bytes == step.predicted_peak <= auto.value.minimum
    loss_fn(eager(*inputs[:-1]), inputs[-1]).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_unet_block_internal_plans_release_the_skip_they_recompute_from(monkeypatch):
    """The chain block spanning a U-Net's top-level skip keeps only its input (the skip) and
    recomputes the rest in its backward: releasing the skip there once the recomputation has read
    it, and the block's output gradient once its last reader ran (``partition.Split.donated``),
    lowers the floor; measured == predicted at it, and the gradients are bit-identical to a larger
    budget's under the same algorithm choices."""
    from remat import zoo
    from remat.plan import inner
    from remat.plan.frontier import forget_plans

    model, inputs, loss_fn = zoo.make("unet", "tiny", batch=32)
    minima = {}
    for donate in (False, True):
        monkeypatch.setattr(inner, "DONATE", donate)
        forget_plans()  # the step's block recipes are kept per process; planned afresh under this setting
        with pytest.raises(remat.BudgetTooSmall) as e:
            remat.compile(copy.deepcopy(model), inputs, loss_fn, budget=1)
        minima[donate] = e.value.minimum
    assert minima[True] < 0.92 * minima[False]
    runs = []
    for budget in (minima[True], int(minima[True] * 1.05)):
        m = copy.deepcopy(model)
        step = remat.compile(m, inputs, loss_fn, budget=budget)
        loss = step(*inputs)
        assert step.last_stats.peak_bytes == step.predicted_peak <= budget
        assert any("keep only their input" in n for n in step.report().solver_notes)
        runs.append((step.report().algorithms, loss, grads_of(m)))
    (alg1, l1, g1), (alg2, l2, g2) = runs
    assert alg1 == alg2 and torch.equal(l1, l2)
    assert all(torch.equal(g1[n], g2[n]) for n in g1)


def test_resnet_stem_is_tiled_over_the_batch_below_the_reference_minimum():
    """A ResNet's stem (convolution, batch norm, ReLU, max pool at full resolution) sets its floor:
    below the reference's minimum the planner runs it as one batch-tiled ``conv_bn_relu_pool``
    (never the full-resolution activations or their gradients), reports it, fits with measured ==
    predicted peak, and gives eager's gradients and running statistics to float rounding."""
    from remat import zoo

    model, inputs, loss_fn = zoo.make("resnet", "tiny", batch=32)
    with pytest.raises(remat.BudgetTooSmall) as ref:
        remat.compile(model, inputs, loss_fn, budget=1, algorithms="reference")
    with pytest.raises(remat.BudgetTooSmall) as auto:
        remat.compile(model, inputs, loss_fn, budget=1)
    assert auto.value.minimum < 0.8 * ref.value.minimum
    eager = copy.deepcopy(model)
    step = remat.compile(model, inputs, loss_fn, budget=auto.value.minimum)
    assert any(line.startswith("conv_bn_relu_pool at stem.0 (convolution, batch norm, ReLU and max pool over 32 "
                               "samples, 1 at a time") and ": chosen;" in line for line in step.report().algorithms)
    # The faster tiling (here one tile of the whole batch: 8 KiB a sample) was tried first, and said so.
    assert any(line.startswith("conv_bn_relu_pool at stem.0 (convolution, batch norm, ReLU and max pool over 32 "
                               "samples, 32 at a time") and ": not chosen; with it the step needs at least" in line
               for line in step.report().algorithms)
    ops = [i.op.name for i in step.program.entry.instrs]
    assert {"conv_bn_stats", "conv_bn_relu_pool_apply", "conv_bn_relu_pool_grad"} <= set(ops)  # its passes, split
    assert ops.count("max_pool2d_with_indices") == 0  # the stem's was the only pool
    step(*inputs)
    assert step.last_stats.peak_bytes == step.predicted_peak <= auto.value.minimum
    loss_fn(eager(*inputs[:-1]), inputs[-1]).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_head_is_chunked_below_the_reference_minimum(case):
    """In bf16 the loss of the bf16 logits is f32 (autocast's): below the reference's minimum the head
    is chunked with it, each chunk's logits a bf16 product and the loss in f32, within the budget
    and as close to eager autocast's gradients as bf16 allows."""
    model, inputs, _, _ = case
    with pytest.raises(remat.BudgetTooSmall) as e:
        remat.compile(copy.deepcopy(model), inputs, _loss, budget=1, count_workspaces=False, precision="bf16")
    step, loss, grads = _run(model, inputs, budget=e.value.minimum, precision="bf16")
    r = step.report()
    assert r.measured_peak == r.predicted_peak <= e.value.minimum
    assert any("linear_cross_entropy at head" in a and ": chosen;" in a for a in r.algorithms)
    lce = [i for i in step.program.instructions() if i.op.name == "linear_cross_entropy"]
    assert len(lce) == 1 and lce[0].attrs["upcast"] and lce[0].operands[0].type.dtype == remat.ir.DType.bf16
    assert loss.dtype == torch.float32
    m = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss = _loss(m(inputs[0]), inputs[1])
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss.detach(), rtol=2e-3, atol=0)
    want = grads_of(m)
    num = sum(((grads[n].double() - g.double()) ** 2).sum() for n, g in want.items()) ** 0.5
    assert float(num / sum((g.double() ** 2).sum() for g in want.values()) ** 0.5) < 2e-2


def test_reference_and_lean_steps_share_block_recipes_and_plan_the_same(monkeypatch):
    """The steps one compile plans (the reference and its lean variant) search each distinct block's
    recipes once between them, and plan exactly as when each searches its own: zoo GPT tiny, refused
    at one byte (block-internal plans tried for both steps), then planned at the minimum."""
    import contextlib

    import remat.plan.algorithms as algorithms
    import remat.plan.inner as inner
    from remat.plan.frontier import forget_plans

    searched = []
    recipes = inner.recipes
    monkeypatch.setattr(inner, "recipes", lambda st, *a, **k: searched.append(
        (str(st.split.forward.clone("block")), str(st.split.backward.clone("block")))) or recipes(st, *a, **k))
    model, (x, y), loss_fn = remat.zoo.make("gpt", "tiny", batch=4)
    answers = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(algorithms, "sharing_block_recipes", contextlib.nullcontext)
        forget_plans()
        searched.clear()
        with pytest.raises(remat.BudgetTooSmall) as e:
            remat.compile(copy.deepcopy(model), (x, y), loss_fn, budget=1, count_workspaces=False)
        counts = (len(searched), len(set(searched)))
        step = remat.compile(copy.deepcopy(model), (x, y), loss_fn, budget=e.value.minimum, count_workspaces=False)
        answers[shared] = e.value.minimum, str(step.program), counts
    (m1, p1, (n1, d1)), (m0, p0, (n0, d0)) = answers[True], answers[False]
    assert n1 == d1 == d0 < n0  # once each when shared; some searched twice otherwise
    assert (m1, p1) == (m0, p0)
