"""``tile-conv-bn-pool``: a convolution -> training batch norm -> ReLU -> max pool chain becomes one
batch-tiled ``conv_bn_relu_pool``: values (output, statistics, running statistics) equal the
reference ops' to float rounding in both layouts, the full-resolution values are gone, a model
input gets no input gradient, and what does not match is left alone."""
from __future__ import annotations

import numpy as np
import pytest

from remat.ir import Builder, DType, Function, Module, TensorType, verify
from remat.passes.convblock import TILES, tile_conv_bn_pool
from remat.pipeline import run_pipeline
from remat.runtime.vm import run

F64 = DType.f64


def _net(layout: str = "NCHW", relu_used: bool = False, batch: int = 5) -> Function:
    """x [N,3,8,8] (NCHW, the model input) -> conv 3x3 to 4 channels -> batch norm (running
    statistics) -> ReLU -> max pool 3x3 stride 2: (y, new running mean, new running var[, relu])."""
    nhwc = layout == "NHWC"
    vec = TensorType(F64, (4,))
    f = Function("f", [TensorType(F64, (4, 3, 3, 3)), vec, vec, vec, vec, TensorType(F64, (batch, 3, 8, 8))])
    w, gamma, beta, rm, rv, x = f.params
    b = Builder(f.entry)
    c = b.op("conv2d", x, w, padding=(1, 1), layout=layout, **({"input_layout": "NCHW"} if nhwc else {}))
    z, _, _, nrm, nrv = b.op("batch_norm", c, gamma, beta, rm, rv, axis=3 if nhwc else 1)
    r = b.op("relu", z)
    y, _ = b.op("max_pool2d_with_indices", r, kernel=(3, 3), stride=(2, 2), padding=(1, 1), layout=layout)
    outs = [y, nrm, nrv] + ([b.op("reduce_sum", r, axes=(0,))] if relu_used else [])
    f.result_types = [o.type for o in outs]
    b.ret(*outs)
    return f


def _args(f: Function, seed: int = 0) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [r.uniform(0.5, 1.5, p.type.shape) if k in (1, 4) else r.standard_normal(p.type.shape)
            for k, p in enumerate(f.params)]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_tiled_chain_gives_the_reference_values(layout, dialect):
    f = _net(layout)
    g, sites = tile_conv_bn_pool(f, n_params=5, min_tile_bytes=0)  # one sample a tile
    verify(Module([g]))
    ops = [i.op.name for i in g.entry.instrs]
    assert ops == ["conv_bn_relu_pool", "return"]
    (op,) = [i for i in g.entry.instrs if i.op.name == "conv_bn_relu_pool"]
    assert op.attrs["input_grad"] is False and op.attrs["input_layout"] == ("NCHW" if layout == "NHWC" else "")
    assert len(sites) == 1 and sites[0].batch == 5 and sites[0].tile == 1 and sites[0].activation_bytes == 5 * 4 * 64 * 8
    args = _args(f)
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(g, *args, dialects=[dialect])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_tile_covers_the_batch_in_at_most_TILES_tiles():
    f = _net(batch=2 * TILES + 1)
    assert tile_conv_bn_pool(f, n_params=5)[1][0].tile == 2 * TILES + 1  # 2 KiB a sample: MIN_TILE_BYTES is the batch
    assert tile_conv_bn_pool(f, n_params=5, min_tile_bytes=4 * 4 * 64 * 8)[1][0].tile == 4
    assert tile_conv_bn_pool(f, n_params=5, min_tile_bytes=0)[1][0].tile == 3
    g, sites = tile_conv_bn_pool(_net(), n_params=6)  # x among the differentiated parameters
    assert [i.attrs["input_grad"] for i in g.entry.instrs if i.op.name == "conv_bn_relu_pool"] == [True]


def test_non_matching_patterns_are_left_alone():
    f = _net(relu_used=True)  # the rectified activation is read elsewhere: it must exist
    g, sites = tile_conv_bn_pool(f, n_params=5)
    assert not sites and [i.op.name for i in g.entry.instrs] == [i.op.name for i in f.entry.instrs]


def test_registered_as_a_pass():
    out = run_pipeline(Module([_net()]), ["tile-conv-bn-pool"]).module["f"]
    (op,) = [i for i in out.entry.instrs if i.op.name == "conv_bn_relu_pool"]
    assert op.attrs["input_grad"] is True  # the pass alone cannot know x is a model input: it keeps its gradient


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_split_into_its_two_passes_gives_the_same_bits(dialect):
    """After differentiation the op runs as its statistics pass and its output pass (a recomputed
    output then convolves once a tile): bit for bit the combined kernel's results."""
    from remat.passes.convblock import split_conv_bn_relu_pool

    f, _ = tile_conv_bn_pool(_net("NHWC", batch=3), n_params=5, min_tile_bytes=0)
    g = split_conv_bn_relu_pool(Module([f]))["f"]
    verify(Module([g]))
    assert [i.op.name for i in g.entry.instrs] == ["conv_bn_stats", "conv_bn_relu_pool_apply", "return"]
    args = _args(f, seed=3)
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(g, *args, dialects=[dialect])
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
