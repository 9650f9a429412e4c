"""A recomputed batch norm output normalised from the first run's statistics (``remat.lower.bn_recompute``):
the eval-mode kernel with alpha = invstd · weight, mean and unit variance gives the training kernel's
output bit for bit; compiled steps that recompute batch norms train bit-identically with and without
the rewrite, within their budget, predicted == measured peak."""
from __future__ import annotations

import pytest
import torch

import remat
import remat.lower.bn_recompute as bn_recompute
from remat import zoo
from remat.backends import torch_kernels as tk
from remat.ir import verify

from _lower_util import train

SHAPES = [(4, 16, 64, 64), (8, 64, 16, 16), (3, 5, 7, 9), (2, 3, 1, 1), (16, 128, 8, 8), (6, 4), (5, 3, 11)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_eval_kernel_from_the_statistics_equals_the_training_kernel(shape, dtype, channels_last):
    if channels_last and len(shape) != 4:
        pytest.skip("channels-last is rank 4")
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[1])
    c = shape[1]
    vec = torch.float64 if dtype == torch.float64 else torch.float32  # half inputs: float32 statistics
    for trial in range(3):
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + trial).to(dtype)
        if channels_last:  # NHWC as the IR holds it: channels on axis 3
            x, axis = x.permute(0, 2, 3, 1).contiguous(), 3
        else:
            axis = 1
        w, b = torch.randn(c, generator=g, dtype=vec), torch.randn(c, generator=g, dtype=vec)
        rm, rv = torch.zeros(c, dtype=vec), torch.ones(c, dtype=vec)
        y, mean, invstd, _, _ = tk.batch_norm(x, w, b, rm, rv, training=True, momentum=0.1, eps=1e-5, axis=axis)
        again = tk.batch_norm(x, invstd * w, b, mean, torch.ones_like(mean), training=False, momentum=0.1, eps=0.0,
                              axis=axis)
        assert torch.equal(y, again), (trial, (y.double() - again.double()).abs().max())


@pytest.mark.parametrize("name, precision, size", [("unet", "bf16", "tiny"), ("resnet", "fp32", "small")])
def test_steps_recomputing_batch_norms_train_bit_identically_within_the_budget(name, precision, size):
    """Zoo U-Net in bf16 (its tiny size: bf16 convolutions are slow on CPUs without native bf16;
    the first run's statistics alive for the backward anyway) and ResNet in fp32 (a chain plan: the
    backward reads the recomputation's statistics, now the first run's) at half their
    unconstrained peak (or their floor)."""
    step, losses, state = train(name, precision, 0.5, size=size)
    base, base_losses, base_state = train(name, precision, 0.5, bn_recompute, "find_recomputed", size=size)
    bns = [i for i in step.program.entry.instrs if i.op.name == "batch_norm"]
    rewritten = [i for i in bns if not i.attrs["training"]]
    assert rewritten and all(i.recomputes is not None for i in rewritten)
    assert not any(not i.attrs["training"] for i in base.program.entry.instrs if i.op.name == "batch_norm")
    verify(step.program.module or remat.ir.Module([step.program]))
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(state, base_state))
    rep = step.report()
    assert rep.predicted_peak == rep.measured_peak <= step.budget


@pytest.mark.parametrize("dtype, dialects", [(torch.float32, ("numpy",)), (torch.bfloat16, None)])
def test_other_dialects_and_half_precision_statistics_keep_the_training_kernel(dtype, dialects):
    """The numpy dialect normalises in its own order, and with bf16 statistics (a model in bf16) ATen
    multiplies invstd and weight in float32: their recomputed batch norms stay whole."""
    torch.manual_seed(0)
    model, ex, loss_fn = zoo.make("unet", "tiny", dtype)
    try:
        step = remat.compile(model, ex, loss_fn, budget=0.6, dialects=dialects)
    except remat.BudgetTooSmall as e:  # the floor counts this machine's kernel workspaces: plan at it
        torch.manual_seed(0)
        model, ex, loss_fn = zoo.make("unet", "tiny", dtype)
        step = remat.compile(model, ex, loss_fn, budget=e.minimum, dialects=dialects)
    bns = [i for i in step.program.entry.instrs if i.op.name == "batch_norm"]
    assert any(i.recomputes is not None for i in bns)
    assert all(i.attrs["training"] for i in bns)
