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
from remat.passes.layout import channels_last
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
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(g, *args, dialects=[dialect])
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
            assert step.channels_last and step.report().channels_last
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
    assert not step.channels_last
    assert {i.attrs["layout"] for i in step.program.entry.instrs if "conv2d" in i.op.name} == {"NCHW"}
    with pytest.raises(ValueError, match="layout must be one of 'auto', 'NCHW', got 'NHWC'"):
        remat.compile(model, inputs, loss_fn, layout="NHWC")
