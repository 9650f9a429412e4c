"""``remat.compile`` without a budget agrees with PyTorch eager: loss and gradients (float32 and
float64), 20 optimizer steps with torch.optim's SGD (momentum) and AdamW (parameters, optimizer
state, batch-norm running statistics), and switching between eager and compiled steps."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from _train_util import NAMES, assert_tensors_close, batches, eager_loss, grads_of, make, rel_err

TOL_GRAD = {torch.float32: 1e-5, torch.float64: 1e-10}
TOL_STEPS = 1e-8  # float64, after 20 optimizer steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", NAMES)
def test_loss_and_gradients_match_eager(name, dtype):
    model, inputs, loss_fn = make(name, dtype)
    ref = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    step = remat.compile(model, inputs, loss_fn)  # no optimizer: gradients land in .grad
    # Compiling profiles on copies: the model is untouched until the first step.
    assert_tensors_close(model.state_dict(), before, 0.0, "state after compile")
    assert all(p.grad is None for p in model.parameters())

    loss = step(*inputs)
    want = eager_loss(ref, inputs, loss_fn)
    want.backward()
    assert loss.dtype == want.dtype and loss.dim() == 0
    assert rel_err(loss, want) <= TOL_GRAD[dtype], (loss.item(), want.item())
    assert_tensors_close(grads_of(model), grads_of(ref), TOL_GRAD[dtype], f"{name} gradient")
    # In training mode the batch-norm statistics are updated exactly once, as in eager.
    assert_tensors_close(model.state_dict(), ref.state_dict(), TOL_GRAD[dtype], f"{name} state")


def _optimizers(kind: str, model, ref):
    if kind == "sgd":
        make_opt = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)
    else:
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    return make_opt(model.parameters()), make_opt(ref.parameters())


def _assert_optimizer_state_matches(opt, ref_opt, model, ref, tol: float) -> None:
    names = [n for n, _ in model.named_parameters()]
    for n, p, q in zip(names, model.parameters(), ref.parameters()):
        got, want = opt.state[p], ref_opt.state[q]
        assert want, f"eager optimizer has no state for {n}"
        # Every state entry torch keeps (momentum_buffer; exp_avg, exp_avg_sq, step) is there and equal.
        missing = set(want) - set(got)
        assert not missing, f"{n}: remat's optimizer state lacks {sorted(missing)}"
        assert_tensors_close({k: got[k] for k in want}, dict(want), tol, f"optimizer state of {n}")


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("name", NAMES)
def test_twenty_optimizer_steps_match_torch_optim(name, kind):
    model, inputs, loss_fn = make(name, torch.float64)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizers(kind, model, ref)
    ptrs = [p.data_ptr() for p in model.parameters()]
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    losses, ref_losses = [], []
    for xs in batches(inputs, 20, seed=1):
        losses.append(step(*xs).item())
        ref_opt.zero_grad()
        loss = eager_loss(ref, xs, loss_fn)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    for k, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= TOL_STEPS * abs(b), f"loss at step {k + 1}: {a} vs eager {b}"
    # Parameters and buffers (batch-norm running statistics, num_batches_tracked).
    assert_tensors_close(model.state_dict(), ref.state_dict(), TOL_STEPS, f"{name}/{kind} after 20 steps")
    _assert_optimizer_state_matches(opt, ref_opt, model, ref, TOL_STEPS)
    # The model's own tensors were updated in place, and no gradients were left behind.
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_switching_between_eager_and_compiled_steps(kind):
    """Eager steps first, then compiled ones (and back): the optimizer's step count and momentum
    carry over, so the run equals an all-eager run (Adam's bias correction, SGD's first-step buffer)."""
    model, inputs, loss_fn = make("resnet", torch.float64)
    ref = copy.deepcopy(model)
    opt, ref_opt = _optimizers(kind, model, ref)
    data = batches(inputs, 7, seed=2)

    def eager(m, o, xs):
        o.zero_grad()
        eager_loss(m, xs, loss_fn).backward()
        o.step()

    for xs in data:
        eager(ref, ref_opt, xs)
    for xs in data[:3]:
        eager(model, opt, xs)
    opt.zero_grad(set_to_none=True)
    step = remat.compile(model, inputs, loss_fn, optimizer=opt)
    for xs in data[3:6]:
        step(*xs)
    eager(model, opt, data[6])
    assert_tensors_close(model.state_dict(), ref.state_dict(), TOL_STEPS, f"resnet/{kind} eager-compiled-eager")
    _assert_optimizer_state_matches(opt, ref_opt, model, ref, TOL_STEPS)
