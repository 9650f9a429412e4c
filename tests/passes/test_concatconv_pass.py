"""``split-concat-conv``: a convolution over a channel concatenation becomes one convolution per
input (the weight sliced along its input channels), summed: values equal the reference's up to
summation order in both layouts, the concatenation is gone, and what does not match is left alone."""
from __future__ import annotations

import numpy as np
import pytest

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
