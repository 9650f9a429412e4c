"""diffusers' ``UNet2DConditionModel`` (Stable Diffusion's U-Net: group norm, SiLU, cross-attention,
a timestep embedding) at a tiny config: one SGD step under a 50% budget matches eager (f32, 1e-5),
measured == predicted <= budget, and the unconstrained step's allocator peak stays below eager's
(group norm keeps its input and statistics, as ATen's backward does, not the centred and normalised
input)."""
from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import remat

diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _measure import measure_peak, resident_bytes  # noqa: E402


class _Denoiser(torch.nn.Module):
    """The U-Net's noise prediction from (latents, timesteps, text states)."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, text):
        return self.unet(x, t, encoder_hidden_states=text).sample


def _unet():
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(64, 128),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    inputs = (torch.randn(2, 4, 16, 16), torch.randint(0, 1000, (2,)), torch.randn(2, 8, 32), torch.randn(2, 4, 16, 16))
    return _Denoiser(unet).train(), inputs


def _loss(pred, noise):
    return F.mse_loss(pred, noise)


@pytest.mark.slow
def test_unet_step_at_half_the_peak_matches_eager_and_its_peak_stays_below_eagers():
    model, inputs = _unet()
    eager = copy.deepcopy(model)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)

    def eager_step():
        for p in eager.parameters():
            p.grad = None
        loss = _loss(eager(*inputs[:3]), inputs[3])
        loss.backward()
        opt_e.step()
        return loss.detach()

    m0 = copy.deepcopy(model)
    free = remat.compile(m0, inputs, _loss, optimizer=torch.optim.SGD(m0.parameters(), lr=0.1))
    ours = free.measure_allocator_peak(*inputs)
    step = remat.compile(model, inputs, _loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), budget=0.5,
                         count_workspaces=False)
    got = step(*inputs)
    want = eager_step()
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
    for (n, a), b in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")
    rep = step.report()
    assert rep.measured_peak == rep.predicted_peak <= rep.budget
    gc.collect()
    eager_peak = measure_peak(lambda: float(eager_step()), resident=resident_bytes(eager, opt_e, inputs)).peak_bytes
    assert ours <= eager_peak, (ours, eager_peak)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(got, want)) ** 0.5
    return float(num / sum((b.double() ** 2).sum() for b in want) ** 0.5)


@pytest.mark.slow
def test_unet_in_bf16_is_as_accurate_as_eager_autocast():
    """precision="bf16": its group norms take bf16 inputs with f32 parameters under autocast (ATen's
    mixed-type kernel, which keeps the bf16 input, not an f32 copy); the step's gradients are as far
    from fp32 as eager autocast's, under a budget with measured == predicted."""
    model, inputs = _unet()

    def eager(autocast: bool) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(m(*inputs[:3]), inputs[3])
        loss.backward()
        return _grads(m)

    bf16, fp32 = eager(True), eager(False)
    with pytest.raises(remat.BudgetTooSmall) as e:  # its floor is above half its peak
        remat.compile(copy.deepcopy(model), inputs, _loss, precision="bf16", budget=0.5)
    m = copy.deepcopy(model)
    step = remat.compile(m, inputs, _loss, precision="bf16", budget=e.value.minimum)
    assert any(i.op.name == "group_norm" and i.operands[0].type.dtype == remat.DType.bf16
               for i in step.program.instructions())
    step(*inputs)
    rep = step.report()
    assert rep.measured_peak == rep.predicted_peak <= rep.budget < rep.unconstrained_peak
    assert _rel(_grads(m), fp32) <= 1.25 * _rel(bf16, fp32)
