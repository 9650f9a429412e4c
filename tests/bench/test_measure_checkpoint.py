"""The √N checkpointing baseline (bench/_checkpoint.py): segments chosen as documented, the same
loss and gradients as the unwrapped model, and less memory kept for the backward."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from _checkpoint import CheckpointedBlock, apply_sqrt_checkpointing, sqrt_segments  # noqa: E402
from _measure import measure_peak  # noqa: E402

from remat import zoo


def test_sqrt_segments() -> None:
    assert [sqrt_segments(n) for n in (1, 2, 3, 4, 6, 8, 9, 16, 20)] == [1, 2, 2, 2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError, match="at least one block"):
        sqrt_segments(0)


@pytest.mark.parametrize("name, kind, target, blocks, sizes", [
    ("mlp", "sequential", "body", 4, (2, 2)),          # tiny: Linear, ReLU twice
    ("resnet", "sequential", "stages", 2, (1, 1)),     # two stages of one block, flattened
    ("gpt", "sequential", "blocks", 2, (1, 1)),
    ("unet", "per-block", "down,up_conv", 5, (1,) * 5),  # 3 down + 2 up double convs
])
def test_plan_and_same_gradients(name: str, kind: str, target: str, blocks: int, sizes: tuple[int, ...]) -> None:
    kwargs = {"dropout": 0.0} if name == "gpt" else {}
    ref, inputs, loss_fn = zoo.make(name, "tiny", seed=3, **kwargs)
    ck, _, _ = zoo.make(name, "tiny", seed=3, **kwargs)
    plan = apply_sqrt_checkpointing(ck)
    assert (plan.kind, plan.target, plan.blocks, plan.segment_sizes) == (kind, target, blocks, sizes)
    assert sum(plan.segment_sizes) == plan.blocks and plan.segments == len(plan.segment_sizes)
    # parameters are shared with the wrapped blocks, not copied
    assert sum(p.numel() for p in ck.parameters()) == sum(p.numel() for p in ref.parameters())
    xs, ts = inputs[:-1], inputs[-1:]
    l_ref = loss_fn(ref(*xs), *ts)
    l_ref.backward()
    l_ck = loss_fn(ck(*xs), *ts)
    l_ck.backward()
    torch.testing.assert_close(l_ck, l_ref)
    for (n, p), q in zip(ref.named_parameters(), ck.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m: f"{name}: gradient of {n}: {m}")


def test_checkpointing_keeps_less_for_the_backward() -> None:
    torch.manual_seed(0)
    width, depth = 256, 16
    x = torch.randn(64, width)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(width, width)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(h))

    def build() -> nn.Module:
        torch.manual_seed(1)
        return nn.ModuleDict({"body": nn.Sequential(*[Layer() for _ in range(depth)])})

    plain = build()
    ck = build()
    plan = apply_sqrt_checkpointing(ck)
    assert plan.segment_sizes == (4, 4, 4, 4)
    kept = {}
    for label, model in (("plain", plain), ("ck", ck)):
        m = measure_peak(lambda: model["body"](x).sum())
        kept[label] = m.end_net_bytes  # what autograd keeps for the backward, plus the loss
    act = 64 * width * 4  # bytes of one activation
    # plain: each tanh output is kept (it is the tanh's saved output and the next Linear's saved
    # input; x itself was allocated before), plus the 4-byte loss. Checkpointed: the inputs of
    # segments 2..4 (outputs of segments 1..3) plus the last, not checkpointed, segment's 4 outputs.
    assert kept["plain"] == depth * act + 4
    # Each checkpointed segment also stores the CPU RNG state (preserve_rng_state=True).
    rng_state = torch.get_rng_state().numel()
    assert kept["ck"] == (3 + 4) * act + 4 + 3 * rng_state


def test_model_without_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="cannot segment it"):
        apply_sqrt_checkpointing(nn.Linear(3, 3))
    # composite blocks in a ModuleList are wrapped one by one
    m = nn.Module()
    m.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.ReLU()])
    plan = apply_sqrt_checkpointing(m)
    assert plan.kind == "per-block" and plan.blocks == 1 and isinstance(m.blocks[0], CheckpointedBlock)
