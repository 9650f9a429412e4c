"""Translation rules beyond the zoo models: one module using many ATen ops at once (one export,
to keep the test fast), each output compared with PyTorch eager in float64."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.frontend.torch_import import UnsupportedOpError, import_module
from remat.ir import parse, verify

from test_torch_import import assert_close, evaluate


class ManyOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(4, 3, 3, padding=1, stride=2)
        self.gconv = nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2)
        self.deconv = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.ln = nn.LayerNorm([6, 6], elementwise_affine=False)
        self.emb = nn.Embedding(10, 6)

    def forward(self, x, q, idx):
        n, c, h, w = x.shape
        outs = [
            F.scaled_dot_product_attention(q, q * 0.5, q + 1.0, is_causal=True),
            F.interpolate(x, scale_factor=2, mode="nearest"),
            F.adaptive_avg_pool2d(x, 2), F.adaptive_avg_pool2d(x, 1),
            F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False),
            F.avg_pool2d(x, 2, divisor_override=3),
            F.max_pool2d(x, 2),
            torch.max(x, dim=1).values, torch.max(x, dim=1).indices, x.amin(dim=(2, 3)),
            x.var(dim=1), x.var(dim=(2, 3), unbiased=False, keepdim=True), torch.var_mean(x, dim=0)[1],
            F.silu(x), F.leaky_relu(x, 0.2), F.hardtanh(x), torch.clamp(x, min=-0.5), x.clamp(max=0.3),
            torch.sigmoid(x) * torch.tanh(x),
            F.pixel_shuffle(x, 2), x[:, 1], x[:, :, 1:5:2, -3:], x[-1],
            torch.cat([x, x * 2], dim=1), torch.stack([x.sum(), x.mean()]),
            *torch.split(x, [1, 3], dim=1), *x.unbind(0),
            F.pad(x, (1, 2, 0, 1), value=0.5), F.pad(x, (-1, 1)),
            torch.where(x > 0, x, torch.zeros_like(x)), x.masked_fill(x < -0.5, float("-inf")).exp(),
            torch.arange(5, dtype=x.dtype) * 0.5 + 1, torch.arange(2, 11, 3),
            x.transpose(1, 3).reshape(n, -1), x.permute(0, 2, 3, 1).contiguous().view(-1, c).t(),
            (x ** 2).sqrt() - x.abs(), x.pow(3), torch.rsqrt(x * x + 1), 2.0 ** x, 1.0 - x, 1 / (x.abs() + 1),
            torch.log1p(x.abs()), torch.expm1(x), torch.erf(x), torch.sin(x) + torch.cos(x), torch.sign(x),
            F.gelu(x), F.gelu(x, approximate="tanh"), F.softmax(x, dim=2), F.log_softmax(x, dim=-1),
            (x > 0) & (x < 0.5), (x > 0) | (x < -0.5), ~(x > 0), torch.logical_xor(x > 0, x > 0.3),
            (x > 0).sum(dim=1), (x > 1).any(dim=1), x.int() + 1, x.to(torch.float32).double(),
            torch.maximum(x, x.mean(dim=0)), torch.minimum(x, torch.full_like(x, 0.1)),
            self.conv1d(x.reshape(n, c, h * w)), self.gconv(x), self.deconv(x), self.gn(x), self.ln(x),
            self.emb(idx), torch.index_select(x, 2, idx[0, :3]), x[:, :, idx[0, :2]],
            torch.gather(x, 1, idx[:, :4].clamp(max=c - 1).reshape(n, 4, 1, 1).expand(n, 4, h, w)),
            torch.baddbmm(x[:, 0], x[:, 1], x[:, 2], beta=0.5, alpha=2.0), torch.bmm(x[:, 0], x[:, 1]),
            torch.addmm(x[0, 0], x[0, 1], x[0, 2], beta=0.0),
            x.mean(), x.sum(), x.sum(dim=[1, 2], keepdim=True), F.normalize(x, dim=1),
            x.repeat(1, 2, 1, 3), x[0, 0].repeat(2, 1, 2), x.repeat(1, 1, 1, 1),  # tiling, also with a new axis
            torch.ceil(x * 3), (x * 3).int().ceil(), x.remainder(0.7), torch.remainder(x, x.abs() + 0.5),
            idx % 4, idx.remainder(-3), (idx - 3) % 4,  # the divisor's sign, as Python's %
            torch.div(idx - 3, 4, rounding_mode="floor"), torch.div(x, 0.3, rounding_mode="floor"),
            F.interpolate(x, size=(9, 7), mode="bilinear"), F.interpolate(x, scale_factor=2, mode="bilinear",
                                                                         align_corners=True),
            x.argmax(dim=2), x.argmax(), torch.eye(3, dtype=x.dtype) * 2, torch.eye(2, 4) > 0,
        ]
        return tuple(outs)


def test_many_ops_match_eager():
    torch.manual_seed(0)
    model = ManyOps().double().eval()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    q = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    idx = torch.randint(0, 6, (2, 6))  # valid rows of x's height (6) and the embedding (10)
    im = import_module(model, (x, q, idx), train=False)
    verify(im.module)
    assert str(parse(str(im.module))) == str(im.module)
    want = model(x, q, idx)
    got = evaluate(im, x, q, idx)
    assert len(got) == len(want) == len(im.output_names)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, torch.float64, f"output {i}")


def test_training_batch_norm_1d_and_dropout_mask_output():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(5, momentum=0.3)
            self.bn_nostats = nn.BatchNorm1d(5, track_running_stats=False, affine=False)

        def forward(self, x):
            return self.bn_nostats(self.bn(x))

    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(16, 5, 3, dtype=torch.float64)
    im = import_module(net, (x,), train=True)
    assert im.output_names == ["output", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    got = evaluate(im, x)
    want = net(x)  # updates net's running statistics
    assert_close(got[0], want, torch.float64, "output")
    for name, g in zip(im.output_names[1:], got[1:]):
        assert_close(g, dict(net.named_buffers())[name], torch.float64, name)


def test_max_pool_indices_import_as_the_indices_op():
    class Unpool(nn.Module):
        def forward(self, x):
            y, i = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
            return y + i.to(x.dtype)

    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    im = import_module(Unpool(), (x,), train=False)
    assert "max_pool2d_with_indices" in str(im.module)
    (got,) = evaluate(im, x)
    assert_close(got, Unpool()(x), torch.float64, "pooled values plus indices")


def test_float32_numerics_of_normalisations():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                        nn.LayerNorm(4 * 6 * 6)).train()
    x = torch.randn(3, 3, 8, 8) * 3 + 1
    im = import_module(net, (x,))
    got = evaluate(im, x)
    assert_close(got[0], net(x), torch.float32, "output")
    assert np.all(np.isfinite(got[0]))


def test_normalisations_import_as_one_composite_op_each():
    """LayerNorm (with and without affine) and BatchNorm (train and eval) lower to one op each."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(4 * 6 * 6),
                        nn.LayerNorm(4 * 6 * 6, elementwise_affine=False), nn.LayerNorm(4 * 6 * 6, bias=False))
    x = torch.randn(3, 3, 8, 8)
    for train in (True, False):
        net.train(train)
        im = import_module(net, (x,), train=train)
        ops = [i.op.name for i in im.function.instructions()]
        assert ops.count("layer_norm") == 3 and ops.count("batch_norm") == 1, ops
        assert "reduce_mean" not in ops and "rsqrt" not in ops, ops
        bn = next(i for i in im.function.instructions() if i.op.name == "batch_norm")
        assert bn.attrs["training"] is train and len(bn.results) == (5 if train else 1)
        got = evaluate(im, x)
        assert_close(got[0], net(x), torch.float32, f"output (train={train})")


def test_embedding_padding_row_gets_no_gradient_and_scaled_gradients_are_refused():
    """nn.Embedding(padding_idx=p): PyTorch's backward leaves row p's gradient zero (the row is never
    trained); remat's gather carries padding_idx into its VJP. scale_grad_by_freq is refused by name."""
    import copy

    import remat

    class Emb(nn.Module):
        def __init__(self, **kw):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4, **kw), nn.Linear(4, 1)

        def forward(self, ids):
            return self.lin(self.emb(ids)).square().mean()

    torch.manual_seed(0)
    ids = torch.tensor([[0, 1, 2, 0, 3], [3, 0, 9, 9, 1]])
    for pad in (0, -1):  # nn.Embedding turns -1 into 9
        model = Emb(padding_idx=pad).double()
        ref = copy.deepcopy(model)
        step = remat.compile(model, (ids,), lambda y: y, num_targets=0)
        step(ids)
        ref(ids).backward()
        row = pad % 10
        assert torch.equal(model.emb.weight.grad[row], torch.zeros(4, dtype=torch.float64))
        assert_close(model.emb.weight.grad, ref.emb.weight.grad, torch.float64, f"embedding gradient, padding_idx={pad}")
    with pytest.raises(Exception, match="scale_grad_by_freq"):
        import_module(Emb(scale_grad_by_freq=True), (ids,))


def test_remainder_and_ceil_gradients_match_eager():
    """``a % b`` is ``a - floor(a / b) * b``: gradient 1 for ``a`` and ``-floor(a / b)`` for ``b``, as
    PyTorch's; ``ceil`` (like ``floor``) has none."""
    class Rem(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3, 5, dtype=torch.float64) * 3)
            self.b = nn.Parameter(torch.rand(3, 5, dtype=torch.float64) + 0.5)

        def forward(self, x):
            return ((self.a % self.b) * x + torch.ceil(self.a) * self.a).sum()

    torch.manual_seed(0)
    model, x = Rem(), torch.randn(3, 5, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref(x).backward()
    step = remat.compile(model, (x,), lambda out: out)
    step(x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_bilinear_resizing_trains_as_in_eager():
    """``F.interpolate(mode="bilinear")`` (BEiT's relative position bias, Segformer's and DPT's heads)
    through PyTorch's own decomposition: gradients as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(size=(13, 11), mode="bilinear")).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    step = remat.compile(model, (x,), lambda out: out.square().mean())
    step(x)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
