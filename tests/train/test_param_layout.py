"""Parameters (and optimizer state) of any layout are updated in place, or refused at compile time.

The step's kernels take contiguous tensors and the VM copies any other argument once; an in-place
update of such a copy would leave the model's tensor as it was (1.2e-3 off eager after one SGD
step). A dense parameter alone in its storage is stored contiguously in place (same object, values
and storage); a strided view sharing a storage is refused with its name, shape and strides.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from _train_util import rel_err


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _transposed(model: Net) -> Net:
    """fc1.weight stored transposed: non-contiguous, dense, alone in its storage."""
    w = model.fc1.weight.detach()
    model.fc1.weight = nn.Parameter(w.t().contiguous().t())
    assert not model.fc1.weight.is_contiguous()
    return model


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-2)], ids=["sgd", "adamw"])
def test_a_transposed_parameter_trains_like_eager(make_opt):
    model = _transposed(Net())
    eager = copy.deepcopy(model)
    opt, eager_opt = make_opt(model.parameters()), make_opt(eager.parameters())
    weight, storage = model.fc1.weight, model.fc1.weight.untyped_storage().data_ptr()
    data = _batches(3)
    step = remat.compile(model, data[0], F.cross_entropy, optimizer=opt)
    assert model.fc1.weight is weight and weight.untyped_storage().data_ptr() == storage  # in place
    assert torch.equal(weight, eager.fc1.weight)  # same values, now stored contiguously
    for x, y in data:
        step(x, y)
        eager_opt.zero_grad()
        F.cross_entropy(eager(x), y).backward()
        eager_opt.step()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert rel_err(p, q) < 1e-5, n
    assert rel_err(model.fc1.weight, Net().fc1.weight) > 1e-3  # it did train


def test_transposed_optimizer_state_is_updated_in_place():
    """State created eagerly for a transposed parameter (zeros_like keeps its strides), then the step."""
    model = _transposed(Net())
    eager = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager))
    data = _batches(3)
    for o, m in ((opt, model), (eager_opt, eager)):  # one eager step each: state exists, transposed
        F.cross_entropy(m(data[0][0]), data[0][1]).backward()
        o.step()
        o.zero_grad()
    exp_avg = opt.state[model.fc1.weight]["exp_avg"]
    assert not exp_avg.is_contiguous() and not model.fc1.weight.is_contiguous()
    step = remat.compile(model, data[0], F.cross_entropy, optimizer=opt)
    for x, y in data[1:]:
        step(x, y)
        F.cross_entropy(eager(x), y).backward()
        eager_opt.step()
        eager_opt.zero_grad()
    assert opt.state[model.fc1.weight]["exp_avg"] is exp_avg
    for k in ("exp_avg", "exp_avg_sq"):
        assert rel_err(opt.state[model.fc1.weight][k], eager_opt.state[eager.fc1.weight][k]) < 1e-5, k
    assert rel_err(model.fc1.weight, eager.fc1.weight) < 1e-5


def test_a_strided_view_of_a_shared_storage_is_refused_by_name():
    model = Net()
    big = torch.randn(16, 24)
    model.fc1.weight = nn.Parameter(big[:, ::2])  # every other column: not contiguous, storage shared
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match=r"parameter 'fc1.weight' \(shape \[16, 12\], strides \[24, 2\].*"
                                         r"nn.Parameter\(module.weight.detach\(\).contiguous\(\)\)"):
        remat.compile(model, (x, y), F.cross_entropy, optimizer=opt)
