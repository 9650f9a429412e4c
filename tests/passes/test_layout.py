"""The ``channels-last`` pass (``remat.passes.layout``): convolutional graphs computed NHWC."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import remat
from remat import zoo
from remat.frontend.torch_import import import_module
from remat.ir import Module, verify
from dataclasses import replace

from remat.passes import layout as layout_pass
from remat.passes.layout import channels_last, ohwi_params
from remat.pipeline import run_pipeline
from remat.runtime.vm import run


class _Net(torch.nn.Module):
    """Convolution, batch norm, ReLU, pooling, a channel concat, a global average pool and a flatten
    into a linear head: every kind of op the pass handles, and one it does not (the flatten)."""

    def __init__(self, flatten: bool = False):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.c2 = torch.nn.Conv2d(8, 6, 3, padding=1, bias=False)
        self.flatten = flatten
        self.fc = torch.nn.Linear(6 * 4 * 4 if flatten else 6, 5)

    def forward(self, x):
        y = F.relu(self.bn(self.c1(x)))
        y = F.max_pool2d(torch.cat([y, y * 0.5], dim=1), 2)
        y = self.c2(y)
        y = y.flatten(1) if self.flatten else y.mean(dim=(2, 3))
        return self.fc(y)


def _imported(flatten: bool = False):
    torch.manual_seed(0)
    net = _Net(flatten)
    x = torch.randn(2, 3, 8, 8)
    return import_module(net, (x,), train=True, cache=False), net, x


def _ops(f):
    return [i.op.name for i in f.entry.instrs]


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_the_nhwc_forward_computes_the_same_values(flatten, dialect):
    imp, _, x = _imported(flatten)
    out = channels_last(imp.module)
    verify(out)
    f, g = imp.function, out[imp.function.name]
    args = imp.arguments(x)
    ohwi = ohwi_params(g)
    assert len(ohwi) == 2  # both convolutions' weights
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(g, *[np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if i in ohwi else a for i, a in enumerate(args)],
                 dialects=[dialect])
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=f"result {k}")


def test_layouts_chosen_for_each_op():
    imp, _, _ = _imported()
    g = channels_last(imp.module)[imp.function.name]
    by_op = {}
    for ins in g.entry.instrs:
        by_op.setdefault(ins.op.name, []).append(ins)
    assert all(i.attrs["layout"] == "NHWC" for i in by_op["conv2d"] + by_op["max_pool2d_with_indices"])
    assert [i.attrs["axis"] for i in by_op["batch_norm"]] == [3]
    assert [i.attrs["axis"] for i in by_op["concat"]] == [3]  # the channel axis, stored last
    assert [i.attrs["axes"] for i in by_op["reduce_mean"]] == [(1, 2)]  # H and W; [N, C] needs no transpose
    # No transpose at all: the first convolution reads the model's input as it is (NCHW), and the
    # conv bias [1, C, 1, 1] is reshaped to [1, 1, 1, C], never copied.
    assert "transpose" not in by_op
    first = by_op["conv2d"][0]
    assert first.operands[0] is g.params[-1] and first.attrs["input_layout"] == "NCHW"
    assert by_op["conv2d"][1].attrs["input_layout"] == ""


def test_an_op_without_a_layout_reads_nchw():
    imp, _, _ = _imported(flatten=True)
    g = channels_last(imp.module)[imp.function.name]
    perms = [i.attrs["perm"] for i in g.entry.instrs if i.op.name == "transpose"]
    assert perms == [(0, 3, 1, 2)]  # back to NCHW before the flatten
    flat = next(i for i in g.entry.instrs if i.op.name == "reshape" and i.results[0].type.rank == 2)
    assert flat.operands[0].instr.op.name == "transpose"


def test_functions_without_convolutions_are_left_alone():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    imp = import_module(Mlp(), (torch.randn(3, 4),), train=True, cache=False)
    assert channels_last(imp.module) is imp.module


def test_registered_as_a_pass():
    imp, _, _ = _imported()
    out = run_pipeline(Module(list(imp.module)), ["channels-last"]).module[imp.function.name]
    assert [i.attrs["layout"] for i in out.entry.instrs if i.op.name == "conv2d"] == ["NHWC", "NHWC"]


@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_a_channels_last_step_matches_eager_channels_last_and_nchw(name):
    """The compiled step's gradients equal eager PyTorch's in the same layout (the same ATen
    kernels) to f32 rounding, and eager NCHW's to f32 summation order."""
    grads = {}
    for how in ("remat", "eager-cl", "eager"):
        torch.manual_seed(0)
        model, inputs, loss_fn = zoo.make(name, "tiny")
        if how == "remat":
            step = remat.compile(model, inputs, loss_fn)
            assert step.compilation.channels_last and step.report().channels_last
            step(*inputs)
        else:
            if how == "eager-cl":
                model = model.to(memory_format=torch.channels_last)
                inputs = [inputs[0].contiguous(memory_format=torch.channels_last), *inputs[1:]]
            loss_fn(model(*inputs[:-1]), inputs[-1]).backward()
        grads[how] = [p.grad for p in model.parameters()]
    for a, b in zip(grads["remat"], grads["eager-cl"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads["remat"], grads["eager"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_layout_option():
    model, inputs, loss_fn = zoo.make("resnet", "tiny")
    step = remat.compile(model, inputs, loss_fn, layout="NCHW")
    assert not step.compilation.channels_last
    assert {i.attrs["layout"] for i in step.program.entry.instrs if "conv2d" in i.op.name} == {"NCHW"}
    with pytest.raises(ValueError, match="layout must be one of 'auto', 'NCHW', got 'NHWC'"):
        remat.compile(model, inputs, loss_fn, layout="NHWC")


def test_weights_of_nhwc_convolutions_are_stored_ohwi():
    """A parameter read only as the weight of NHWC convolutions is taken OHWI (its channels-last
    bytes); ``weights=False`` keeps every weight OIHW."""
    imp, net, _ = _imported()
    g = channels_last(imp.module)[imp.function.name]
    convs = [i for i in g.entry.instrs if i.op.name == "conv2d"]
    assert [c.attrs["weight_layout"] for c in convs] == ["OHWI", "OHWI"]
    assert ohwi_params(g) == tuple(sorted(g.params.index(c.operands[1]) for c in convs))
    assert convs[1].operands[1].type.shape == (6, 3, 3, 8)  # [O, kH, kW, I] of c2's [6, 8, 3, 3]
    plain = channels_last(imp.module, weights=False)[imp.function.name]
    assert ohwi_params(plain) == ()
    assert {i.attrs["weight_layout"] for i in plain.entry.instrs if i.op.name == "conv2d"} == {"OIHW"}


def test_param_tensors_store_ohwi_weights_channels_last():
    """``ImportedModel.param_tensors`` hands an OHWI parameter over as the contiguous OHWI view of
    the live weight, stored channels-last in place (same object, same values); ``copy=True`` copies
    and leaves the model as it is."""
    imp, net, x = _imported()
    g = channels_last(imp.module)[imp.function.name]
    imp2 = replace(imp, function=g, ohwi=ohwi_params(g))
    i = next(k for k in imp2.ohwi if g.params[k].type.shape == (6, 3, 3, 8))  # c2's weight
    w = net.c2.weight
    before, ptr = w.detach().clone(), w.data_ptr()
    copied = imp2.param_tensors(copy=True)[i]
    assert w.is_contiguous() and copied.is_contiguous() and tuple(copied.shape) == (6, 3, 3, 8)
    view = imp2.param_tensors()[i]
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    assert view.is_contiguous() and view.data_ptr() == w.data_ptr()
    assert torch.equal(w, before) and torch.equal(view, before.permute(0, 2, 3, 1))
    assert w.data_ptr() == ptr  # reordered within its own storage
    # A weight replaced by a contiguous tensor is stored channels-last again on the next call.
    w.data = before.clone()
    assert imp2.param_tensors()[i].data_ptr() == w.data_ptr() and w.is_contiguous(memory_format=torch.channels_last)
    # A weight in neither layout is named.
    w.data = before.clone().transpose(2, 3)
    with pytest.raises(ValueError, match=r"weight of shape \(6, 8, 3, 3\) with strides .* neither contiguous nor"):
        imp2.param_tensors()


@pytest.mark.parametrize("name", ["resnet", "unet"])
def test_ohwi_weights_give_the_same_training_as_oihw(name, monkeypatch):
    """Training with OHWI weights (SGD with momentum, three steps, the optimizer stepped eagerly once
    first, so its momentum buffers exist in OIHW) gives the gradients of OIHW weights bit for bit at
    the first step, and the same parameters and momentum to the last bit of the fused SGD kernel
    (which rounds its vectorised body and its tail differently, and the elements in its tail depend
    on the layout); the model's weights, gradients and momentum come out channels-last."""
    import remat.passes.layout as layout

    runs = {}
    for ohwi in (False, True):
        torch.manual_seed(0)
        model, inputs, loss_fn = zoo.make(name, "tiny")
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn(model(*inputs[:-1]), inputs[-1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with monkeypatch.context() as m:
            m.setattr(layout, "OHWI_WEIGHTS", ohwi)
            # Every convolution NHWC in both runs (deep layers too, which the pass keeps NCHW): only the
            # weights' layout differs, on every convolution but those an algorithm may take.
            m.setattr(layout, "_activation_bound", lambda ins: True)
            step = remat.compile(model, inputs, loss_fn, optimizer=opt, keep_grads=True)
        assert bool(step.compilation.imported.ohwi) == ohwi
        grads = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step(*inputs)
            grads.append([p.grad.clone() for p in model.parameters()])
        rep = step.report()
        assert rep.predicted_peak == rep.measured_peak
        runs[ohwi] = (grads, model, opt)
    (g0, m0, o0), (g1, m1, o1) = runs[False], runs[True]
    assert all(torch.equal(a, b) for a, b in zip(g0[0], g1[0]))
    cl = 0
    for (n, p0), p1, a, b in zip(m0.named_parameters(), m1.parameters(), g0[-1], g1[-1]):
        torch.testing.assert_close(p1, p0, rtol=1e-6, atol=1e-7, msg=n)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(o1.state[p1]["momentum_buffer"], o0.state[p0]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6, msg=n)
        if p1.dim() == 4 and not p1.is_contiguous():
            cl += 1
            assert p1.is_contiguous(memory_format=torch.channels_last)
            assert p1.grad.is_contiguous(memory_format=torch.channels_last)
            assert o1.state[p1]["momentum_buffer"].is_contiguous(memory_format=torch.channels_last)
    assert cl > 0


def test_weights_a_memory_lean_algorithm_may_take_stay_oihw():
    """The zoo ResNet's stem (convolution -> batch norm -> ReLU -> max pool, which convblock may
    tile) keeps its weight OIHW; the other NHWC convolutions' weights are OHWI."""
    model, inputs, loss_fn = zoo.make("resnet", "tiny")
    imp = import_module(model, tuple(inputs[:-1]), train=True, cache=False)
    g = channels_last(imp.module)[imp.function.name]
    convs = [i for i in g.entry.instrs if i.op.name == "conv2d"]
    assert convs[0].operands[0] is g.params[-1] and convs[0].attrs["weight_layout"] == "OIHW"
    assert {c.attrs["weight_layout"] for c in convs[1:] if c.attrs["layout"] == "NHWC"} == {"OHWI"}


def test_deep_convolutions_stay_nchw_with_oihw_weights():
    """A convolution whose weight outweighs its feature maps (the zoo ResNet's last stage) stays NCHW,
    its weight OIHW, whether or not the other weights are stored OHWI (taken NHWC with an OHWI weight,
    its weight gradient's workspaces raised the step's minimum budget: see ``_activation_bound``)."""
    model, inputs, loss_fn = zoo.make("resnet", "tiny")
    imp = import_module(model, tuple(inputs[:-1]), train=True, cache=False)
    f = imp.function
    deep = [not layout_pass._activation_bound(i) for i in f.entry.instrs if i.op.name == "conv2d"]
    assert any(deep) and not all(deep)
    for weights in (False, True):
        g = channels_last(imp.module, weights=weights)[f.name]
        convs = [i for i in g.entry.instrs if i.op.name == "conv2d"]  # in the captured order
        assert {(c.attrs["layout"], c.attrs["weight_layout"]) for c, d in zip(convs, deep) if d} == {("NCHW", "OIHW")}
        assert ("OHWI" in {c.attrs["weight_layout"] for c in convs}) is weights


class _Decoder(torch.nn.Module):
    """Segformer's decode head in small: sequences [N, H*W, C] projected by a linear layer, read as
    images (``transpose(1, 2).reshape``), resized bilinearly to one size, concatenated and fused by a
    1x1 convolution."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(c, 8) for c in (4, 6))
        self.fuse = torch.nn.Conv2d(16, 5, 1)

    def forward(self, a, b):
        maps = []
        for seq, hw, lin in ((a, 4, self.proj[0]), (b, 2, self.proj[1])):
            x = lin(seq).transpose(1, 2).reshape(seq.shape[0], 8, hw, hw)
            maps.append(F.interpolate(x, size=(8, 8), mode="bilinear", align_corners=False))
        return self.fuse(torch.cat(maps, dim=1))


def test_a_sequence_read_as_an_image_is_resized_nhwc_without_a_copy():
    """The resize reads the linear layer's [N, H*W, C] output as NHWC data (its NCHW view's NHWC
    transpose is a reshape), so neither it, the concatenation nor the convolution needs a transposed
    copy, forward or backward; the step matches eager PyTorch."""
    torch.manual_seed(0)
    model = _Decoder()
    a, b = torch.randn(2, 16, 4), torch.randn(2, 4, 6)
    t = torch.randn(2, 5, 8, 8)
    loss_fn = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731
    step = remat.compile(model, (a, b, t), loss_fn)
    prog = step.program
    ups = [i for i in prog.instructions() if i.op.name.startswith("upsample_bilinear2d")]
    assert len(ups) == 4 and all(i.attrs["layout"] == "NHWC" for i in ups)
    big = [i for i in prog.instructions() if i.op.name == "transpose" and i.results[0].type.numel >= 2 * 8 * 8 * 8]
    assert not big, [str(i) for i in big]
    loss = step(a, b, t)
    torch.manual_seed(0)
    ref = _Decoder()
    want = loss_fn(ref(a, b), t)
    want.backward()
    assert abs(float(loss) - float(want.detach())) <= 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.contiguous(), q.grad, rtol=1e-5, atol=1e-6)
