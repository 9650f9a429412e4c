"""``split-batch-norm``: a training batch norm becomes ``batch_norm_stats`` and element-wise ops
that give the same results as the composite (values close, statistics and running updates the
same); eval-mode batch norm stays whole; a compiled model's rematerialised steps stay bit-identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import remat
from remat import zoo
from remat.ir import Builder, DType, Function, Module, TensorType, verify
from remat.passes.batchnorm import split_batch_norm
from remat.pipeline import run_pipeline
from remat.runtime.vm import run

F32 = DType.f32


def _bn(training: bool = True, affine: bool = True, running: bool = True) -> Function:
    x = TensorType(F32, (4, 3, 5, 2))
    v = TensorType(F32, (3,))
    params = [x] + [v, v] * affine + [v, v] * running
    f = Function("f", params)
    b = Builder(f.entry)
    outs = b.op("batch_norm", *f.params, training=training, momentum=0.2, eps=1e-3, affine=affine)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    f.result_types = [o.type for o in outs]
    b.ret(*outs)
    return f


def _args(f: Function, seed: int = 0) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [r.uniform(0.5, 1.5, p.type.shape).astype(np.float32) for p in f.params]


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("running", [True, False])
@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_split_gives_the_composites_results(affine, running, dialect):
    f = _bn(affine=affine, running=running)
    m = split_batch_norm(Module([f]))
    verify(m)
    ops = [i.op.name for i in m["f"].entry.instrs]
    assert "batch_norm" not in ops and ops.count("batch_norm_stats") == 1
    args = _args(f)
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(m["f"], *args, dialects=[dialect])
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6, err_msg=f"result {k}")


def test_eval_mode_and_modules_without_batch_norm_are_left_alone():
    m = Module([_bn(training=False)])
    assert split_batch_norm(m) is m


def test_registered_as_a_pass():
    out = run_pipeline(Module([_bn()]), ["split-batch-norm"]).module["f"]
    assert "batch_norm_stats" in [i.op.name for i in out.entry.instrs]


@pytest.mark.parametrize("layout", ["NCHW", "auto"])
def test_a_compiled_unet_splits_every_nchw_batch_norm_and_stays_bit_identical_under_a_budget(layout):
    """NCHW: every training batch norm of the step is split (one statistics pass each,
    unconstrained); channels-last (the default for convolutions, but deep layers): those are not,
    ATen's channels-last kernel does both halves faster. Either way a step that recomputes (at the reference
    algorithms' minimum budget) gives the unconstrained step's gradients, bit for bit."""
    grads, recomputed = [], []
    for budget in (None, 0.5):
        model, inputs, loss_fn = zoo.make("unet", "tiny")
        try:
            step = remat.compile(model, inputs, loss_fn, budget=budget, layout=layout, algorithms="reference")
        except remat.BudgetTooSmall as e:  # tiny models: parameters dominate; plan at the minimum
            model, inputs, loss_fn = zoo.make("unet", "tiny")
            step = remat.compile(model, inputs, loss_fn, budget=e.minimum, layout=layout, algorithms="reference")
        recomputed.append(step.report().recomputed_instructions)
        step(*inputs)
        grads.append([p.grad.clone() for p in model.parameters()])
        n_bn = sum(isinstance(mod, torch.nn.BatchNorm2d) for mod in model.modules())
        whole = [i for i in step.program.entry.instrs if i.op.name == "batch_norm"]
        stats = [i for i in step.program.entry.instrs if i.op.name == "batch_norm_stats"]
        assert step.compilation.channels_last is (layout == "auto")
        assert all(i.attrs["axis"] == 3 for i in whole) and all(i.attrs["axis"] == 1 for i in stats)
        if budget is None:
            assert len(whole) + len(stats) == n_bn
            assert len(whole) == 0 if layout == "NCHW" else len(whole) > len(stats)  # deep layers stay NCHW
    assert recomputed[0] == 0 < recomputed[1]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- split-batch-norm-grad
def _bn_grad(axis: int, affine: bool) -> Function:
    x = TensorType(F32, (4, 3, 5, 2) if axis == 1 else (4, 5, 2, 3))
    v = TensorType(F32, (3,))
    f = Function("g", [x, x, v, v] + [v] * affine)
    b = Builder(f.entry)
    outs = b.op("batch_norm_grad", *f.params, training=True, eps=1e-3, axis=axis)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    f.result_types = [o.type for o in outs]
    b.ret(*outs)
    return f


@pytest.mark.parametrize("axis", [1, 3])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_split_grad_gives_the_whole_backwards_results(axis, affine, dialect):
    """grad_x within float rounding of the whole op; grad_weight and grad_bias are the reduction's own
    results, bit for bit the whole op's on the torch dialect (ATen's same reduction)."""
    from remat.passes.batchnorm import split_batch_norm_grad

    f = _bn_grad(axis, affine)
    m = split_batch_norm_grad(Module([f]))
    verify(m)
    ops = [i.op.name for i in m["g"].entry.instrs]
    assert "batch_norm_grad" not in ops and ops.count("batch_norm_grad_sums") == 1 and ops.count("fused") == 1
    args = _args(f, seed=3)
    want, _ = run(f, *args, dialects=[dialect])
    got, _ = run(m["g"], *args, dialects=[dialect])
    assert len(got) == len(want) == 1 + 2 * affine
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1:], want[1:]):
        (np.testing.assert_array_equal if dialect == "torch" else np.testing.assert_allclose)(a, b)


def test_split_grad_leaves_eval_mode_alone_and_is_registered():
    from remat.passes.batchnorm import split_batch_norm_grad

    x, v = TensorType(F32, (4, 3, 2, 2)), TensorType(F32, (3,))
    f = Function("e", [x, x, v, v])
    b = Builder(f.entry)
    gx = b.op("batch_norm_grad", *f.params, training=False)
    f.result_types = [gx.type]
    b.ret(gx)
    m = Module([f])
    assert split_batch_norm_grad(m) is m
    out = run_pipeline(Module([_bn_grad(1, True)]), ["split-batch-norm-grad"]).module["g"]
    assert "batch_norm_grad_sums" in [i.op.name for i in out.entry.instrs]
