"""F.scaled_dot_product_attention imports as one ``attention`` op (kept whole, not decomposed),
matching PyTorch eager forward and gradients; with dropout it keeps remat's replayable explicit form."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.frontend.torch_import import import_module

from test_torch_import import _imported_roundtrips, assert_close, evaluate


class Attn(nn.Module):
    """Self-attention over [B, H, T, D] projections, with the mask forms F.sdpa takes."""

    def __init__(self, d: int = 8, heads: int = 2, mode: str = "causal", dropout_p: float = 0.0):
        super().__init__()
        self.heads, self.mode, self.dropout_p = heads, mode, dropout_p
        self.qkv = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.randn(1, heads, 5, 5) * 0.1)  # a learned additive mask

    def forward(self, x, keep):
        b, t, c = x.shape
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.mode == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout_p)
        elif self.mode == "bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.transpose(1, 2).reshape(b, t, c).square().mean()


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, dtype=dtype)
    keep = torch.rand(5, 5, generator=g) > 0.4
    keep[:, 0] = True
    return x, keep


def _ops(im) -> list[str]:
    return [i.op.name for i in im.function.instructions()]


def test_multi_query_attention_reads_its_one_key_value_head():
    """Multi-query attention broadcasting one key/value head to all query heads (Falcon's
    ``expand``) reads the shared head itself: no broadcast copy kept; loss and gradients as eager's."""
    class MQA(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(8, 16), nn.Linear(8, 8)

        def forward(self, x):
            b, t, _ = x.shape
            q = self.q(x).reshape(b, t, 4, 4).transpose(1, 2)
            k, v = (z.reshape(b, t, 1, 4).transpose(1, 2).expand(b, 4, t, 4) for z in self.kv(x).split(4, dim=2))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).square().mean()

    torch.manual_seed(5)
    model = MQA().double()
    ref = copy.deepcopy(model)
    x, _ = _inputs(torch.float64)
    step = remat.compile(model, (x,), lambda y: y, num_targets=0)
    loss = step(x)
    (att,) = [i for i in step.program.instructions() if i.op.name == "attention"]
    heads = -2 if att.attrs["seq_first"] else -3
    assert att.operands[1].type.shape[heads] == 1 and "broadcast" not in [i.op.name for i in step.program.instructions()]
    want = ref(x)
    want.backward()
    assert_close(loss, want, torch.float64, "loss")
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close(q.grad, p.grad, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("mode", ["causal", "bool", "float"])
def test_sdpa_imports_as_one_op_and_matches_eager(mode):
    from remat.autodiff.api import gradient_transform

    torch.manual_seed(1)
    model = Attn(mode=mode).double()
    x, keep = _inputs(torch.float64)
    im = import_module(model, (x, keep))
    _imported_roundtrips(im)
    ops = _ops(im)
    assert ops.count("attention") == 1 and "softmax" not in ops and "exp" not in ops
    assert_close(evaluate(im, x, keep)[0], model(x, keep), torch.float64, "loss (numpy)")
    assert_close(evaluate(im, x, keep, dialects=None)[0], model(x, keep), torch.float64, "loss (torch)")
    n = len(im.param_names)
    module, gname = gradient_transform(tuple(range(n)))(im.module, im.function.name)
    assert "attention_grad" in [i.op.name for i in module[gname].instructions()]
    ref = copy.deepcopy(model)
    ref(x, keep).backward()
    for dialects in (("numpy",), None):
        outs, _ = remat.run(module[gname], *im.arguments(x, keep), dialects=dialects)
        named = dict(ref.named_parameters())
        assert len(outs) == n
        for pname, g in zip(im.param_names, outs):
            want = named[pname].grad if named[pname].grad is not None else torch.zeros_like(named[pname])
            assert_close(g, want, torch.float64, f"grad of {pname} ({dialects})")


def test_sdpa_with_dropout_keeps_the_replayable_explicit_form():
    torch.manual_seed(2)
    model = Attn(mode="causal", dropout_p=0.5)
    x, keep = _inputs(torch.float32)
    im = import_module(model, (x, keep))
    ops = _ops(im)
    assert "attention" not in ops and "bernoulli" in ops and "softmax" in ops
    a, b = evaluate(im, x, keep, seed=3)[0], evaluate(im, x, keep, seed=3)[0]
    assert np.isfinite(a) and a == b  # the mask is a function of the seed: it replays
    assert evaluate(im, x, keep, seed=4)[0] != a
    # With dropout off the explicit form agrees with eager (same lowering path, p = 0 skipped).
    model.dropout_p = 0.0
    assert "attention" in _ops(import_module(model, (x, keep)))


def test_sdpa_explicit_form_matches_eager_without_its_dropout():
    """The explicit lowering (used with dropout) is exact attention: check it with dropout forced to 1e-12."""
    torch.manual_seed(3)
    model = Attn(mode="causal", dropout_p=1e-12).double()
    x, keep = _inputs(torch.float64)
    im = import_module(model, (x, keep))
    assert "attention" not in _ops(im)
    assert_close(evaluate(im, x, keep)[0], model.eval()(x, keep), torch.float64, "loss")


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_grouped_query_attention_matches_eager_and_reads_the_shared_heads(masked):
    """enable_gqa=True with fewer key/value heads imports as the heads' repeat; before differentiation
    the op takes the shared heads itself (no repeat left in the training step); loss and gradients as eager's."""
    class GQA(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.kv = nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x, keep):
            b, t, _ = x.shape
            q = self.q(x).reshape(b, t, 4, 4).transpose(1, 2)
            k, v = (z.reshape(b, t, 2, 4).transpose(1, 2) for z in self.kv(x).split(8, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep if masked else None, is_causal=not masked,
                                               enable_gqa=True)
            return y.square().mean()

    torch.manual_seed(4)
    model = GQA().double()
    ref = copy.deepcopy(model)
    x, keep = _inputs(torch.float64)
    step = remat.compile(model, (x, keep), lambda y: y, num_targets=0)
    loss = step(x, keep)
    (att,) = [i for i in step.program.instructions() if i.op.name == "attention"]
    heads = -2 if att.attrs["seq_first"] else -3  # the heads transposes fold too: [B, S, H_kv, D]
    assert att.operands[1].type.shape[heads] == 2 and "broadcast" not in [i.op.name for i in step.program.instructions()]
    want = ref(x, keep)
    want.backward()
    assert_close(loss, want, torch.float64, "loss")
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert_close(q.grad, p.grad, torch.float64, f"grad of {name}")


@pytest.mark.parametrize("mode", ["causal", "bool", "float"])
def test_training_step_reads_heads_transposed_operands_in_place(mode):
    """The model transposes its [B, T, H, D] projections to heads-first and the output back: the
    training step's attention and attention_grad read and write [B, T, H, D] themselves
    (``seq_first``, by fold-head-transposes before differentiation), so no transpose is left, except
    with an additive mask, whose cotangent is built on [B, H, T, D]: the query, key, value and output
    gradient swapped back in the backward, and the row sums; gradients as eager's."""
    torch.manual_seed(3)
    model = Attn(mode=mode).double()
    ref = copy.deepcopy(model)
    x, keep = _inputs(torch.float64)
    step = remat.compile(model, (x, keep), lambda y: y, num_targets=0)
    step(x, keep)
    ops = [i.op.name for i in step.program.instructions()]
    assert all(i.attrs["seq_first"] for i in step.program.instructions() if i.op.name in ("attention", "attention_grad"))
    assert ops.count("transpose") == (5 if mode == "float" else 0)
    ref(x, keep).backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is None:  # the mask bias unused without an additive mask: no gradient, as in eager
            assert q.grad is None, name
        else:
            assert_close(q.grad, p.grad, torch.float64, f"grad of {name}")
