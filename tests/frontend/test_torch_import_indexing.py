"""Imports that real transformers emit: ``index.Tensor`` with several broadcast index tensors,
``cumsum``, ``as_strided`` that restrides, ``roll``, ``F.fold`` of tiling windows and a ceil-mode
average pool as one window; refusals that name the op and the source line; and the
capture stages (export, then decompositions with a fallback table) named when they fail."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.frontend.torch_import import CaptureError, UnsupportedOpError, import_module

from test_torch_import import assert_close, evaluate


class Indexing(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 5, 6, 7, dtype=torch.float64))

    def forward(self, x, i, j, k, m):
        return (self.w[i, j],                       # adjacent index tensors, broadcast [3,1] x [1,2]
                self.w[:, i, :, k],                 # separated: the broadcast index axes come first
                self.w[..., j - 2],                 # negative indices count from the end
                self.w[1:3, :, i[:, 0]],            # one index after a slice
                m[i[:, 0], k[0]],                   # a boolean table (transformers' create_causal_mask)
                torch.cumsum(x, 1), torch.cumsum(m.long(), -1), torch.cumsum(m, 0),  # bool sums as int64
                x.t().contiguous().as_strided((4, 3), (3, 1)),                      # a restride only
                x.as_strided((4, 3), (1, 4)))


def _index_args():
    torch.manual_seed(0)
    return (torch.randn(3, 4, dtype=torch.float64), torch.tensor([[0], [2], [3]]), torch.tensor([[1, 3]]),
            torch.tensor([[0], [6], [2]]), torch.rand(5, 7) > 0.5)


def test_indexing_cumsum_and_as_strided_match_eager():
    model, args = Indexing(), _index_args()
    im = import_module(model, args, train=False)
    want = model(*args)
    got = evaluate(im, *args)
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w.detach(), torch.float64, f"output {n}")
    ops = {i.op.name for i in im.function.instructions()}
    assert "cumsum" in ops and "gather" in ops


def test_gradients_through_indexing_and_cumsum_match_eager():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Parameter(torch.randn(6, 8, 5, dtype=torch.float64))

        def forward(self, x, i, j):
            y = self.emb[i, j] * x                       # [3, 4, 5]
            return torch.cumsum(y, 1).pow(2).sum() + (torch.cumsum(y, -1)[0] * x[1]).sum()

    torch.manual_seed(1)
    model = Net()
    ref = copy.deepcopy(model)
    x, i, j = torch.randn(3, 4, 5, dtype=torch.float64), torch.randint(-6, 6, (3, 1)), torch.randint(0, 8, (1, 4))
    step = remat.compile(model, (x, i, j))
    loss = step(x, i, j)
    want = ref(x, i, j)
    want.backward()
    assert_close(loss.detach().numpy(), want.detach(), torch.float64, "loss")
    assert_close(model.emb.grad.numpy(), ref.emb.grad, torch.float64, "gradient")


def test_boolean_mask_indexing_is_refused_with_the_source_line():
    class Masked(nn.Module):
        def forward(self, x):
            return x[x > 0].sum()

    with pytest.raises((UnsupportedOpError, CaptureError)) as ei:
        import_module(Masked(), (torch.randn(4, 3),))
    assert "test_torch_import_indexing.py" in str(ei.value)


def test_as_strided_that_repeats_elements_is_refused_with_the_source_line():
    class Overlap(nn.Module):
        def forward(self, x):
            return x.as_strided((3, 3), (1, 1)) * 2

    with pytest.raises(UnsupportedOpError, match="as_strided") as ei:
        import_module(Overlap(), (torch.randn(9),))
    assert "repeats" in str(ei.value) and "test_torch_import_indexing.py" in ei.value.source


class _ClampMin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).clamp_min(0.1)


def _broken(*args, **kwargs):
    raise RuntimeError("a broken decomposition")


def test_a_failing_decomposition_falls_back_to_keeping_the_op(monkeypatch):
    # remat's table decomposes clamp_min with PyTorch's rule; make that rule fail: the importer then
    # tries the table that keeps every op it lowers itself, and clamp_min is lowered whole.
    # (silu was the example here until remat kept it whole in its own table.)
    from remat.frontend._aten import decomposition_table

    assert torch.ops.aten.clamp_min.default in decomposition_table()
    default = torch.export.default_decompositions

    def with_broken_clamp_min():
        t = default()
        t[torch.ops.aten.clamp_min.default] = _broken
        return t

    monkeypatch.setattr(torch.export, "default_decompositions", with_broken_clamp_min)
    model, x = _ClampMin(), torch.randn(2, 4)
    im = import_module(model, (x,), train=False)
    assert_close(evaluate(im, x)[0], model(x).detach(), torch.float32, "output")


def test_failures_name_the_stage(monkeypatch, capfd):
    class DataDependent(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(CaptureError, match=r"capture \(torch.export.export\)") as ei:
        import_module(DataDependent(), (torch.randn(3),))
    # the error says it; the partial graph and the symbolic-shapes warnings torch prints are not repeated
    err = capfd.readouterr().err
    assert "def forward(" not in err and "symbolic_shapes" not in err, err
    assert ei.value.stage.startswith("capture") and ei.value.eager_error is None  # it runs eagerly
    line = DataDependent.forward.__code__.co_firstlineno + 1
    assert f"could not be traced at {__file__}:{line} (return x if x.sum() > 0 else -x)" in str(ei.value)

    default = torch.export.default_decompositions

    class Hardswish(nn.Module):
        def forward(self, x):
            return F.hardswish(x)

    def broken_hardswish():  # remat has no rule of its own for hardswish: every table decomposes it
        t = default()
        t[torch.ops.aten.hardswish.default] = _broken
        return t

    monkeypatch.setattr(torch.export, "default_decompositions", broken_hardswish)
    with pytest.raises(CaptureError, match="decomposition") as ei:
        import_module(Hardswish(), (torch.randn(2, 4),))
    assert len(ei.value.failures) == 2 and all("broken decomposition" in f for f in ei.value.failures)


def test_a_model_that_raises_by_itself_is_not_called_untraceable():
    """A model that fails when run eagerly (here a shape mismatch after a batch norm) gets a capture
    error that says so and shows the model's own error, not the hint to make it traceable; the check
    runs the model once without gradients and leaves its running statistics as they were."""

    class Mismatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.fc = nn.BatchNorm1d(3), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.bn(x))  # 3 features into a Linear of 4

    model = Mismatch().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CaptureError, match="raises on these example inputs when run eagerly") as ei:
        import_module(model, (torch.randn(5, 3),))
    assert ei.value.eager_error.startswith("RuntimeError") and "could not be traced" not in str(ei.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_slice_assignment_and_copy_match_eager():
    """T5's ``_shift_right``: ``y = x.new_zeros(...); y[..., 1:] = x[..., :-1].clone()`` (``copy``
    and ``slice_scatter`` after functionalisation), here with a gradient through both parts."""

    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 6, dtype=torch.float64))

        def forward(self, x):
            y = x.new_zeros(x.shape)
            y[..., 1:] = (x * self.w)[..., :-1]
            y[..., :1] = 7.0
            z = torch.empty_like(x)
            z.copy_(y[:1])  # broadcast from [1, 6]
            return (y * z).sum()

    torch.manual_seed(0)
    model, x = Shift(), torch.randn(4, 6, dtype=torch.float64)
    im = import_module(model, (x,), train=False)
    assert_close(evaluate(im, x)[0], model(x).detach(), torch.float64, "loss")
    step = remat.compile(model, (x,), None, keep_grads=True)
    step(x)
    eager = copy.deepcopy(model)
    eager.w.grad = None
    eager(x).backward()
    torch.testing.assert_close(model.w.grad, eager.w.grad, rtol=1e-12, atol=1e-12)


class VisionIdioms(nn.Module):
    """Swin's cyclic shift (``torch.roll``), MobileViTV2's patches folded back (``F.fold`` with
    stride = kernel) and EfficientNet's global pool (``AvgPool2d(1280, ceil_mode=True)``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 3, 4, 6, dtype=torch.float64))

    def forward(self, x):
        y = x * self.w
        patches = F.unfold(y, kernel_size=2, stride=2)                       # [2, 12, 6]
        return (torch.roll(y, shifts=(-1, 2), dims=(2, 3)), torch.roll(y, 5), torch.roll(y, -7, 1),
                F.fold(patches * 2.0, output_size=(4, 6), kernel_size=2, stride=2),
                F.fold(patches[0], output_size=(4, 6), kernel_size=(2, 2), stride=2),   # unbatched
                F.avg_pool2d(y, 1280, ceil_mode=True),                                 # one window past the input
                F.avg_pool2d(y, 9, stride=9, padding=2, ceil_mode=True),               # padding counted
                F.avg_pool2d(y, 9, stride=9, padding=2, ceil_mode=True, count_include_pad=False),
                F.avg_pool2d(y, 9, ceil_mode=True, divisor_override=5))


def test_roll_fold_and_ceil_mode_global_pool_match_eager():
    torch.manual_seed(0)
    model, x = VisionIdioms(), torch.randn(2, 3, 4, 6, dtype=torch.float64)
    im = import_module(model, (x,), train=False)
    want = model(x)
    got = evaluate(im, x)
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w.detach(), torch.float64, f"output {n}")
    ops = [i.op.name for i in im.function.instructions()]
    # roll: slices and concats; fold: a transpose; the pools: reductions. The one gather is F.unfold's.
    assert ops.count("gather") == 1 and "avg_pool2d" not in ops and "roll" not in str(im.module), ops


def test_gradients_through_roll_fold_and_ceil_mode_pool_match_eager():
    class Net(VisionIdioms):
        def forward(self, x):
            return sum((o * (i + 1.0)).pow(2).sum() for i, o in enumerate(super().forward(x)))

    torch.manual_seed(1)
    model, x = Net(), torch.randn(2, 3, 4, 6, dtype=torch.float64)
    eager = copy.deepcopy(model)
    step = remat.compile(model, (x,), None, keep_grads=True)
    loss = step(x)
    want = eager(x)
    want.backward()
    assert_close(loss.detach().numpy(), want.detach(), torch.float64, "loss")
    torch.testing.assert_close(model.w.grad, eager.w.grad, rtol=1e-12, atol=1e-12)


def test_overlapping_fold_is_refused_with_the_reason():
    class Overlap(nn.Module):
        def forward(self, x):
            return F.fold(F.unfold(x, 3, padding=1), output_size=(4, 4), kernel_size=3, padding=1)

    with pytest.raises(UnsupportedOpError, match="only windows that tile the output exactly"):
        import_module(Overlap(), (torch.randn(1, 2, 4, 4),), train=False)


def test_an_untraceable_loss_branch_names_the_loss_fn_way_around_it():
    """A model computing its own loss through data-dependent control flow (DeBERTa-v2's classifier
    keeps the labelled rows by ``nonzero``): the capture error says to compile without the labels and
    give a ``loss_fn``, and that step gives eager's loss and gradients."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, labels=None):
            logits = self.fc(x)
            if labels is None:
                return {"logits": logits}
            keep = (labels >= 0).nonzero().view(-1)
            loss = F.cross_entropy(logits[keep], labels[keep]) if keep.size(0) > 0 else logits.sum() * 0
            return {"loss": loss, "logits": logits}

    torch.manual_seed(0)
    model, x, y = Classifier(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    with pytest.raises(CaptureError, match=r"compile without them and give a loss_fn applied to the logits"):
        remat.compile(copy.deepcopy(model), dict(x=x, labels=y))
    eager = copy.deepcopy(model)
    F.cross_entropy(eager(x)["logits"], y).backward()
    step = remat.compile(model, dict(x=x, target=y), loss_fn=F.cross_entropy)
    torch.testing.assert_close(step(x=x, target=y), F.cross_entropy(eager(x)["logits"], y))
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
