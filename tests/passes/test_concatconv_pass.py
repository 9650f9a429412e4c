"""``split-concat-conv``: a convolution over a channel concatenation becomes one convolution per
input (the weight sliced along its input channels), summed: values equal the reference's up to
summation order in both layouts, the concatenation is gone, and what does not match is left alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from remat.ir import Builder, DType, Function, Module, TensorType, verify
from remat.passes.concatconv import split_concat_conv
from remat.pipeline import run_pipeline
from remat.runtime.vm import run

F64 = DType.f64


def _net(layout: str = "NCHW", other_use: bool = False) -> Function:
    """concat(a, b) -> conv2d, channels 2 + 3 -> 4, 3x3, padding 1."""
    nhwc = layout == "NHWC"
    a = TensorType(F64, (2, 4, 4, 2) if nhwc else (2, 2, 4, 4))
    b_ = TensorType(F64, (2, 4, 4, 3) if nhwc else (2, 3, 4, 4))
    w = TensorType(F64, (4, 5, 3, 3))
    f = Function("f", [a, b_, w])
    b = Builder(f.entry)
    cat = b.op("concat", f.params[0], f.params[1], axis=3 if nhwc else 1)
    y = b.op("conv2d", cat, f.params[2], padding=(1, 1), layout=layout)
    outs = [y, b.op("reduce_sum", cat, axes=(0,))] if other_use else [y]
    f.result_types = [o.type for o in outs]
    b.ret(*outs)
    return f


def _args(f: Function, seed: int = 0) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [r.standard_normal(p.type.shape) for p in f.params]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_split_gives_the_reference_values(layout, dialect):
    f = _net(layout)
    g, sites = split_concat_conv(f)
    verify(Module([g]))
    ops = [i.op.name for i in g.entry.instrs]
    assert "concat" not in ops and ops.count("conv2d") == 2 and ops.count("slice") == 2
    assert len(sites) == 1 and sites[0].inputs == 2 and sites[0].concat_bytes == 2 * 5 * 4 * 4 * 8
    args = _args(f)
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(g, *args, dialects=[dialect])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)


def test_the_input_computed_last_is_convolved_first():
    """A U-Net's ``concat(skip, up(x))``: ``up(x)``, computed last, is convolved first, so that a
    recomputation frees it before the skip's convolution runs; the sum keeps the inputs' order, so
    the values are bit for bit those of convolving the skip first."""
    a = TensorType(F64, (2, 2, 4, 4))
    f = Function("f", [a, TensorType(F64, (2, 3, 4, 4)), TensorType(F64, (4, 5, 3, 3))])
    b = Builder(f.entry)
    up = b.op("neg", f.params[1])  # computed after the skip (a parameter)
    y = b.op("conv2d", b.op("concat", f.params[0], up, axis=1), f.params[2], padding=(1, 1))
    f.result_types = [y.type]
    b.ret(y)
    g, _ = split_concat_conv(f)
    convs = [i for i in g.entry.instrs if i.op.name == "conv2d"]
    assert convs[0].operands[0] is not g.params[0] and convs[1].operands[0] is g.params[0]
    (add,) = [i for i in g.entry.instrs if i.op.name == "add"]
    assert add.operands[0] is convs[1].results[0] and add.operands[1] is convs[0].results[0]
    args = _args(f)
    want, _ = run(f, *args, dialects=["torch"])
    got, _ = run(g, *args, dialects=["torch"])
    t = [torch.from_numpy(v) for v in (args[0], -args[1], args[2][:, :2], args[2][:, 2:])]
    ref = F.conv2d(t[0], t[2], padding=1) + F.conv2d(t[1], t[3], padding=1)  # the skip's term first
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert np.array_equal(got[0], ref.numpy())


def _batch_concat() -> Function:
    """A concatenation along the batch: not over the convolution's channels."""
    a = TensorType(F64, (1, 2, 4, 4))
    f = Function("f", [a, a, TensorType(F64, (4, 2, 3, 3))])
    b = Builder(f.entry)
    y = b.op("conv2d", b.op("concat", f.params[0], f.params[1], axis=0), f.params[2], padding=(1, 1))
    f.result_types = [y.type]
    b.ret(y)
    return f


@pytest.mark.parametrize("make", [lambda: _net(other_use=True), _batch_concat], ids=["concat-used-elsewhere", "batch"])
def test_non_matching_patterns_are_left_alone(make):
    f = make()
    g, sites = split_concat_conv(f)
    assert not sites and [i.op.name for i in g.entry.instrs] == [i.op.name for i in f.entry.instrs]


def test_registered_as_a_pass():
    out = run_pipeline(Module([_net()]), ["split-concat-conv"]).module["f"]
    assert "concat" not in [i.op.name for i in out.entry.instrs]
