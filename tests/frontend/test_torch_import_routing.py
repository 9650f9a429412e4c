"""Imports of a mixture-of-experts layer's dispatch and a masked autoencoder's masking: ``sort`` and
``argsort`` (stable, ascending and descending), ``topk``, ``histc`` over a fixed range, ``index_put``
(assignment and accumulation, several index tensors, separated index axes), ``index_add``,
``torch.gather``, and a hand-written top-2 expert layer whose loss and gradients match eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.frontend.torch_import import UnsupportedOpError, import_module

from test_torch_import import assert_close, evaluate


class Routing(nn.Module):
    def forward(self, x, e, i, j, v):
        y = x.clone()
        y[i, j] = v                                           # two broadcast index tensors
        z = x.clone()
        z[:, j[0]] += 1.5                                     # accumulate along axis 1
        w = x.clone()
        w[i[:, 0], :, ] = v[:, :1].expand(-1, x.shape[1])     # whole rows
        inv = torch.empty_like(e)
        inv[e] = torch.arange(e.shape[0])                     # a permutation's inverse (transformers' MoE)
        vals, top = torch.topk(x, 2, dim=-1)
        low, _ = torch.topk(x, 2, dim=0, largest=False)
        s, order = torch.sort(x, dim=0, descending=True)
        return (y, z, w, inv, vals, top, low, s, order, torch.argsort(e.float()), torch.sort(e)[1],
                torch.histc(x, bins=4, min=-1.0, max=1.0), x.index_add(0, e[:3] % 4, v[:3, :1].expand(-1, 6)),
                torch.gather(x, 1, top))


def test_routing_ops_match_eager():
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64)
    e = torch.tensor([3, 0, 5, 1, 2, 4])
    i, j = torch.tensor([[0], [2], [3]]), torch.tensor([[1, 4]])
    v = torch.randn(3, 2, dtype=torch.float64)
    args = (x, e, i, j, v)
    model = Routing()
    im = import_module(model, args, train=False)
    want = model(*args)
    for dialects in (("numpy",), ("torch", "numpy")):
        got = evaluate(im, *args, dialects=dialects)
        assert len(got) == len(want)
        for n, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w.detach(), torch.float64, f"output {n} ({dialects[0]})")
    ops = {ins.op.name for ins in im.function.instructions()}
    assert {"sort", "topk", "histc", "index_put", "gather"} <= ops


class Top2Experts(nn.Module):
    """A mixture of 4 experts, top-2 routing, combined with ``index_add`` (the classic loop)."""

    def __init__(self, d: int = 8, n: int = 4):
        super().__init__()
        self.router = nn.Linear(d, n, dtype=torch.float64)
        self.experts = nn.ModuleList(nn.Linear(d, d, dtype=torch.float64) for _ in range(n))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            gate = (w * (idx == k)).sum(-1, keepdim=True)      # 0 for tokens not routed to expert k
            out = out.index_add(0, torch.arange(x.shape[0]), gate * expert(x))
        return out.pow(2).mean()


def test_gradients_through_top2_routing_match_eager():
    torch.manual_seed(0)
    model = Top2Experts()
    ref = copy.deepcopy(model)
    x = torch.randn(10, 8, dtype=torch.float64)
    step = remat.compile(model, (x,))
    loss = step(x)
    want = ref(x)
    want.backward()
    assert_close(loss.detach().numpy(), want.detach(), torch.float64, "loss")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad.numpy(), q.grad, torch.float64, n)


def test_histc_with_the_datas_range_is_refused_with_the_source_line():
    class DataRange(nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=4).sum() * x.sum()

    with pytest.raises(UnsupportedOpError, match="histc") as ei:
        import_module(DataRange(), (torch.randn(9),))
    assert "fixed range" in str(ei.value) and "test_torch_import_routing.py" in ei.value.source
