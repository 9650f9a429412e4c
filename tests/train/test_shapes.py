"""A step called with other input shapes (the last, smaller batch of an epoch; another sequence
length) compiles a plan for them under the same byte budget, says so, caches it, and trains
exactly as a step compiled for those shapes from the start would."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import remat


class Seq(torch.nn.Module):
    """Token classifier over ``[B, T]`` ids: batch size and sequence length may both change."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc1, self.fc2 = torch.nn.Linear(16, 64), torch.nn.Linear(64, 50)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _batch(b: int, t: int):
    return torch.randint(0, 50, (b, t)), torch.randint(0, 50, (b, t))


def test_new_shapes_compile_and_cache_a_plan_under_the_same_budget():
    torch.manual_seed(0)
    model = Seq()
    twin = copy.deepcopy(model)
    messages = []
    step = remat.compile(model, _batch(16, 24), _ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         budget=0.9, progress=messages.append)
    budget = step.report().budget
    batches = [_batch(16, 24), _batch(5, 24), _batch(16, 9), _batch(5, 24)]
    losses = [step(*b) for b in batches]
    news = [m for m in messages if m.startswith("remat: new input shapes")]
    assert len(news) == 2 and "[5, 24]" in news[0] and "[16, 9]" in news[1], messages
    rep = step.report()
    assert rep.shapes_cached == 3 and "input shapes cached" in str(rep)
    for sub in step._variants.values():  # each shape's plan: within the first shapes' byte budget
        r = sub.report()
        assert r.budget == budget and r.measured_peak == r.predicted_peak <= budget

    # The same four steps, eagerly: the plans for the other shapes train exactly as compiled ones.
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for (x, y), got in zip(batches, losses):
        opt.zero_grad()
        want = _ce(twin(x), y)
        want.backward()
        opt.step()
        assert abs(float(got) - float(want.detach())) <= 1e-5
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def test_other_dtypes_or_ranks_are_still_refused():
    model = Seq()
    step = remat.compile(model, _batch(4, 6), _ce, keep_grads=True, progress=lambda m: None)
    x, y = _batch(4, 6)
    with pytest.raises(TypeError, match=r"argument 0 of the training step: expected torch.int64\[4, 6\] \(as compiled"):
        step(x.int(), y)
    with pytest.raises(TypeError, match=r"argument 0 .*got torch.int64\[24\]"):
        step(x.reshape(-1), y)


def test_shapes_the_model_cannot_take_are_a_type_error_naming_them():
    model = Seq()
    step = remat.compile(model, _batch(4, 6), _ce, keep_grads=True, progress=lambda m: None)
    x, y = _batch(4, 6)
    with pytest.raises(TypeError, match=r"argument 0: expected torch.int64\[4, 6\] \(as compiled\), got torch.int64"
                                        r"\[3, 6\]\) and compiling a step for it failed.*the model itself "
                                        r"raises on them when run eagerly: .*ValueError: Expected input batch_size "
                                        r"\(18\) to match target batch_size \(24\)"):
        step(x[:3], y)  # inputs and targets disagree on the batch: the model's own error is named
    assert step.report().shapes_cached == 1


def test_an_empty_batch_is_refused_before_anything_changes():
    """A batch of no samples (the last slice of a loader can be one) is a clear ValueError before any
    compile or run, parameters untouched (it reached the VM as another shape and failed there on an
    internal invariant: 'result 0 must share the storage of operand 0')."""
    model = Seq()
    step = remat.compile(model, _batch(4, 6), _ce, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         progress=lambda m: None)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(4, 6)
    with pytest.raises(ValueError, match=r"empty batch \(inputs of shapes \[\[0, 6\], \[0, 6\]\]"):
        step(x[:0], y[:0])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert step.report().shapes_cached == 1
