"""The ``TrainStep`` object: the model's own tensors updated in place (``state_dict``
saves and loads), argument checking at call time, and dropout (training, and random ops replayed
bit-identically when recomputed under a budget)."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import remat
from _train_util import assert_snapshot_equal, batches, grads_of, make, snapshot


def test_state_dict_saves_and_parameters_stay_the_models_own():
    model, inputs, loss_fn = make("resnet")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tensors = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
    initial = copy.deepcopy(model.state_dict())
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    for xs in batches(inputs, 3):
        step(*xs)
    # Updated in place: same tensors, same storage, new values.
    assert {n: t.data_ptr() for n, t in tensors.items()} == ptrs
    assert all(t is tensors[n] for n, t in list(model.named_parameters()) + list(model.named_buffers()))
    assert not torch.equal(model.stem[0].weight, initial["stem.0.weight"])
    assert int(model.stem[1].num_batches_tracked) == 3
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    fresh, _, _ = make("resnet")
    fresh.load_state_dict(saved["model"])
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh_opt.load_state_dict(saved["optim"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])


@pytest.fixture(scope="module")
def mlp_step():
    model, inputs, loss_fn = make("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, inputs, opt, remat.compile(model, inputs, loss_fn, optimizer=opt)


@pytest.mark.parametrize("case", ["shape", "dtype", "target-dtype", "target-shape", "count", "not-a-tensor"])
def test_wrong_arguments_raise_type_error_and_change_nothing(mlp_step, case):
    model, (x, y), opt, step = mlp_step
    args, which = {
        "shape": ((x[:4], y), 0), "dtype": ((x.double(), y), 0), "target-dtype": ((x, y.int()), 1),
        "target-shape": ((x, y[:, None]), 1), "count": ((x,), None), "not-a-tensor": ((x.tolist(), y), 0)}[case]
    before = snapshot(model, opt)
    with pytest.raises(TypeError) as info:
        step(*args)
    msg = str(info.value)
    if which is None:
        assert "takes 2" in msg and "got 1" in msg
    else:
        assert f"argument {which}" in msg and "expected" in msg
        assert str(list(args[which].shape) if hasattr(args[which], "shape") else "") in msg
    assert_snapshot_equal(snapshot(model, opt), before)


def test_wrong_argument_after_steps_leaves_the_optimizer_alone(mlp_step):
    model, (x, y), opt, step = mlp_step
    step(x, y)
    taken = int(opt.state[model.head.weight]["step"])
    before = snapshot(model, opt)
    with pytest.raises(TypeError, match="argument 0"):
        step(x.T.contiguous(), y)
    assert_snapshot_equal(snapshot(model, opt), before)
    step(x, y)  # and it keeps working
    assert int(opt.state[model.head.weight]["step"]) == taken + 1


# ---------------------------------------------------------------- dropout
def test_gpt_with_dropout_trains():
    model, inputs, loss_fn = make("gpt", dropout=0.1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    assert step.imported.has_seed  # dropout is active: the step draws masks from a seed
    losses = [step(*inputs).item() for _ in range(8)]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0] - 0.3, losses  # one fixed batch: the loss must come down
    # A fresh seed per step: masks differ, so eval-mode loss is not what the train steps saw.
    with torch.no_grad():
        model.eval()
        eval_loss = loss_fn(model(inputs[0]), inputs[1]).item()
    assert math.isfinite(eval_loss) and eval_loss < losses[0]


def test_dropout_is_replayed_when_recomputed_under_a_budget():
    model, inputs, loss_fn = make("gpt", dropout=0.1)
    runs = []
    for budget in (None, 0.85):
        m = copy.deepcopy(model)
        step = remat.compile(m, inputs, loss_fn, budget=budget, seed=7)
        loss = step(*inputs)
        runs.append((step, loss, grads_of(m)))
    (base, l0, g0), (step, l1, g1) = runs
    r = step.report()
    assert r.measured_peak <= r.budget and r.measured_peak == r.predicted_peak

    def random_ops(fn):
        return sum(1 for ins in fn.entry.instrs if "random" in ins.op.tags)

    # Some dropout mask is drawn more than once (recomputed) ...
    assert random_ops(step.program) > random_ops(base.program) > 0
    # ... and the replay draws the same mask: bit-identical loss and gradients.
    assert torch.equal(l0, l1)
    for n, g in g0.items():
        assert torch.equal(g1[n], g), f"gradient of {n} differs"
    # The seed is really used: the next step (seed 7 + 1) draws other masks on the same,
    # unchanged parameters (no optimizer), so its loss differs.
    assert not torch.equal(base(*inputs), l0)


def test_changed_learning_rate_is_refused_without_side_effects(mlp_step):
    """The learning rate is compiled into the update ops: a schedule that changes it must be
    reported, not silently ignored, and the refused step must not touch the model."""
    model, (x, y), opt, step = mlp_step
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = lr / 10
    try:
        before = snapshot(model, opt)
        with pytest.raises(RuntimeError, match="learning rate"):
            step(x, y)
        assert_snapshot_equal(snapshot(model, opt), before)
    finally:
        opt.param_groups[0]["lr"] = lr
    step(x, y)
