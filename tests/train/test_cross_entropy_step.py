"""Cross-entropy in a training step: ``F.cross_entropy`` imports as one ``cross_entropy`` whose backward
writes the logits' gradient over the logits (one [N, C] tensor at the head, not three), and a
gradients-only step hands its gradients to ``.grad`` without copying them, so the call's allocator
peak is the VM's, within the budget."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.ir.reuse import buffer_reuse
from _train_util import make
from test_allocator_budget import profiler_peak


class Head(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 96):
        super().__init__()
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _data(n: int = 64, d: int = 16, vocab: int = 96):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[3] = -100  # an ignored row
    return torch.randn(n, d, generator=g), t


def test_the_logits_gradient_is_written_over_the_logits_and_matches_eager():
    torch.manual_seed(0)
    model = Head()
    x, t = _data()
    ours = copy.deepcopy(model)
    step = remat.compile(ours, (x, t), F.cross_entropy, optimizer=None)
    prog = step.program
    ops = [i.op.name for i in prog.entry.instrs]
    assert "cross_entropy" in ops and not {"log_softmax", "nll_loss", "log_softmax_grad", "nll_loss_grad"} & set(ops)
    grad = next(i for i in prog.entry.instrs if i.op.name == "cross_entropy_grad")
    assert buffer_reuse(prog).get(grad) == 1  # written over its logits operand
    loss = step(x, t)
    ref = copy.deepcopy(model)
    want = F.cross_entropy(ref(x), t)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
    r = step.report()
    assert r.measured_peak == r.predicted_peak


def test_gradients_only_step_keeps_the_vms_gradients_within_the_budget():
    model, inputs, loss_fn = make("gpt")
    try:  # at its least feasible budget: the parameters and gradients are most of the peak
        remat.compile(copy.deepcopy(model), inputs, loss_fn, optimizer=None, budget=1)
    except remat.BudgetTooSmall as e:
        least = e.minimum
    step = remat.compile(model, inputs, loss_fn, optimizer=None, budget=least)
    step(*inputs)
    for p in model.parameters():
        p.grad = None
    args = sum(p.type.nbytes for p in step.program.params)  # parameters and inputs, held before the call
    peak = args + profiler_peak(lambda: step(*inputs))
    r = step.report()
    assert r.measured_peak == r.predicted_peak and peak <= r.budget, (peak, r.budget)
    assert peak == r.measured_peak  # .grad takes the VM's gradients: nothing is copied after the run


class Shared(nn.Module):
    """Two parameters used only as their sum: their gradients are one value of the program."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 3))
        self.b = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x @ (self.a + self.b).t()


def test_a_gradient_returned_twice_gives_each_parameter_its_own_grad():
    torch.manual_seed(0)
    model = Shared()
    x, y = torch.randn(5, 3), torch.randn(5, 4)
    ref = copy.deepcopy(model)
    step = remat.compile(model, (x, y), F.mse_loss, optimizer=None)
    for _ in range(2):  # the second step adds to the first step's .grad
        step(x, y)
        F.mse_loss(ref(x), y).backward()
    assert model.a.grad.untyped_storage().data_ptr() != model.b.grad.untyped_storage().data_ptr()
    torch.testing.assert_close(model.a.grad, ref.a.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.b.grad, ref.b.grad, rtol=1e-5, atol=1e-6)


_W = torch.rand(96, generator=torch.Generator().manual_seed(3)) + 0.5
LOSSES = {
    "sum": lambda o, t: F.cross_entropy(o, t, reduction="sum"),
    "none, then mean": lambda o, t: F.cross_entropy(o, t, reduction="none").mean(),
    "class weights": lambda o, t: F.cross_entropy(o, t, weight=_W),
    "log_softmax, nll_loss": lambda o, t: F.nll_loss(F.log_softmax(o, -1), t),
    "label smoothing": lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1),  # reads the log-probabilities twice
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_cross_entropy_forms_match_eager(name):
    loss_fn = LOSSES[name]
    torch.manual_seed(0)
    model = Head()
    x, t = _data()
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    step = remat.compile(ours, (x, t), loss_fn, optimizer=None)
    ops = {i.op.name for i in step.program.entry.instrs}
    assert ("cross_entropy" in ops) == (name != "label smoothing"), ops
    loss = step(x, t)
    want = loss_fn(ref(x), t)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
